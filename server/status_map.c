/* The status a failure is answered with: the one map from the op library's
 * status codes to gRPC's (see kernels/include/moe/status.h; keep the two in
 * step), gRPC's to HTTP's (the REST port), and the message beside it. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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

int moed_http_status_from_grpc(grpc_status_code code) {
  switch (code) {
  case GRPC_STATUS_OK: return 200;
  case GRPC_STATUS_INVALID_ARGUMENT:
  case GRPC_STATUS_OUT_OF_RANGE:
  case GRPC_STATUS_FAILED_PRECONDITION: return 400;
  case GRPC_STATUS_UNAUTHENTICATED: return 401;
  case GRPC_STATUS_PERMISSION_DENIED: return 403;
  case GRPC_STATUS_NOT_FOUND: return 404;
  case GRPC_STATUS_ALREADY_EXISTS:
  case GRPC_STATUS_ABORTED: return 409;
  case GRPC_STATUS_RESOURCE_EXHAUSTED: return 429;
  case GRPC_STATUS_CANCELLED: return 499; /* the client left (nginx's code; nobody reads it) */
  case GRPC_STATUS_UNIMPLEMENTED: return 501;
  case GRPC_STATUS_UNAVAILABLE: return 503;
  case GRPC_STATUS_DEADLINE_EXCEEDED: return 504;
  default: return 500;
  }
}

grpc_status_code moed_failf(char *buf, grpc_status_code code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, MOED_ERR_LEN, fmt, ap);
  va_end(ap);
  return code;
}

void moed_msg_relative(char *msg, size_t cap, const char *dir, const char *label) {
  size_t dl = dir ? strlen(dir) : 0;
  while (dl > 1 && dir[dl - 1] == '/')
    dl--;
  if (!dl || !cap) return;
  char out[MOED_ERR_LEN];
  size_t o = 0, limit = cap < sizeof out ? cap : sizeof out;
  for (const char *p = msg; *p && o + 1 < limit;) {
    bool starts = p == msg || strchr(" '\"(:", p[-1]); /* a path's start, not a longer name's tail */
    if (starts && strncmp(p, dir, dl) == 0 && (p[dl] == '/' || p[dl] == 0 || p[dl] == ':' || p[dl] == ' ')) {
      p += dl;
      if (*p == '/') { /* "dir/x" -> "x" */
        p++;
        continue;
      }
      for (const char *l = label; *l && o + 1 < limit; l++) /* "dir" alone -> label */
        out[o++] = *l;
      continue;
    }
    out[o++] = *p++;
  }
  out[o] = 0;
  memcpy(msg, out, o + 1);
}

/* Stock clients call these (tritonclient's get/update_trace_settings and
 * get/update_log_settings): answered as what they are, not as an unknown
 * method or path. */
static const struct {
  const char *method, *segment, *why;
} UNIMPLEMENTED[] = {
    {"TraceSetting", "trace",
     "trace: Triton's trace extension is not implemented by moed (ModelStatistics and /metrics time each "
     "phase of a request)"},
    {"LogSettings", "logging",
     "logging: Triton's logging extension is not implemented by moed (its log is set at start: --log-level, "
     "--log-json)"},
};

const char *moed_extension_unimplemented(const char *name) {
  for (size_t i = 0; i < sizeof UNIMPLEMENTED / sizeof UNIMPLEMENTED[0]; i++)
    if (!strcmp(name, UNIMPLEMENTED[i].method) || !strcmp(name, UNIMPLEMENTED[i].segment))
      return UNIMPLEMENTED[i].why;
  return NULL;
}
