/* The status a failure is answered with: the one map from the op library's
 * status codes to gRPC's (see kernels/include/moe/status.h; keep the two in
 * step), and the message beside it. */
#include <stdarg.h>
#include <stdio.h>

#include "moed.h"

grpc_status_code moed_status_from_moe(moe_status s) {
  switch (s) {
  case MOE_OK: return GRPC_STATUS_OK;
  case MOE_EINVAL: return GRPC_STATUS_INVALID_ARGUMENT;
  case MOE_EOVERFLOW: return GRPC_STATUS_INVALID_ARGUMENT; /* untrusted shapes too large */
  case MOE_ENOTFOUND: return GRPC_STATUS_NOT_FOUND;
  case MOE_ENOMEM: return GRPC_STATUS_RESOURCE_EXHAUSTED;
  case MOE_EUNSUPPORTED: return GRPC_STATUS_UNIMPLEMENTED;
  case MOE_EBUSY: return GRPC_STATUS_UNAVAILABLE;
  case MOE_ECANCELLED: return GRPC_STATUS_CANCELLED;
  case MOE_EIO: return GRPC_STATUS_INTERNAL;
  case MOE_EDEVICE: return GRPC_STATUS_INTERNAL;
  }
  return GRPC_STATUS_INTERNAL;
}

grpc_status_code moed_failf(char *buf, grpc_status_code code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, MOED_ERR_LEN, fmt, ap);
  va_end(ap);
  return code;
}
