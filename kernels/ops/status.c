/* moe_strerror and moe_fail. */
#include <stdarg.h>
#include <stdio.h>

#include "moe/status.h"

const char *moe_strerror(moe_status s) {
  switch (s) {
  case MOE_OK: return "ok";
  case MOE_EINVAL: return "invalid argument";
  case MOE_ENOTFOUND: return "not found";
  case MOE_ENOMEM: return "out of memory";
  case MOE_EOVERFLOW: return "size overflow";
  case MOE_EIO: return "i/o or format error";
  case MOE_EUNSUPPORTED: return "unsupported";
  case MOE_EDEVICE: return "device error";
  case MOE_EBUSY: return "busy";
  case MOE_ECANCELLED: return "cancelled";
  }
  return "unknown error";
}

moe_status moe_fail(moe_error *err, moe_status s, const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
  }
  return s;
}
