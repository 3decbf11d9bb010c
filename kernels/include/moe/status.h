/* moe: status codes and error messages of the op library. */
#ifndef MOE_STATUS_H
#define MOE_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

/* Errors are negative, like libuv's. The server maps each to one gRPC status
 * (server/status_map.c); keep the two tables in step. */
typedef enum moe_status {
  MOE_OK = 0,
  MOE_EINVAL = -1,       /* a tensor, dtype, shape or parameter does not fit the op */
  MOE_ENOTFOUND = -2,    /* no such op, model, tensor or file */
  MOE_ENOMEM = -3,       /* host or device memory exhausted */
  MOE_EOVERFLOW = -4,    /* a size computation overflowed (untrusted shapes) */
  MOE_EIO = -5,          /* a file could not be read or is malformed */
  MOE_EUNSUPPORTED = -6, /* valid request this backend or build does not run */
  MOE_EDEVICE = -7,      /* a device runtime call failed */
  MOE_EBUSY = -8,        /* resource in use (e.g. unloading a referenced set) */
  MOE_ECANCELLED = -9,   /* the call's stop check said stop (moe_call_set_stop) */
} moe_status;

/* A short constant description of `s` ("invalid argument", ...). */
const char *moe_strerror(moe_status s);

/* The detail of an error: which tensor, field or parameter, and why. */
typedef struct moe_error {
  char msg[512];
} moe_error;

/* Formats `fmt` into err->msg (err may be NULL) and returns `s`, so that
 * validation code reads `return moe_fail(err, MOE_EINVAL, "x: ...")`. */
moe_status moe_fail(moe_error *err, moe_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#ifdef __cplusplus
}
#endif
#endif
