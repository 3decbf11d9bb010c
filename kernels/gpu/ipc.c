/* moe/ipc.h: another process's device memory, opened from its IPC handle
 * (the server's CUDA shared-memory regions). Plain C over the runtime API
 * (HIP names; hip_compat.h maps them to CUDA), compiled into the op library
 * of every build: without a GPU backend (no MOE_HAVE_GPU) only the refusals.
 *
 * The copies are synchronous on the legacy default stream, which the
 * backends' streams (created non-blocking) never wait for nor make wait:
 * a region copy on a device worker's thread does not serialize with its
 * kernels. A failed call's error is cleared from the thread (the runtime
 * keeps the last one per thread) so that a worker's next launch check does
 * not report it as its own. */
#include <string.h>

#include "moe/ipc.h"

#ifdef MOE_HAVE_GPU
#include "gpu.h"

_Static_assert(sizeof(hipIpcMemHandle_t) == MOE_IPC_HANDLE_BYTES, "an IPC handle is 64 bytes");

bool moe_ipc_supported(void) { return true; }

/* Makes `device` current, keeping the caller's in *prev. */
static moe_status enter(int device, int *prev, moe_error *err) {
  int n = 0;
  hipError_t e = hipGetDeviceCount(&n);
  if (e != hipSuccess || device < 0 || device >= n) {
    hipGetLastError();
    return moe_fail(err, MOE_EINVAL, "gpu %d: no such device (%d present)", device, e == hipSuccess ? n : 0);
  }
  if ((e = hipGetDevice(prev)) == hipSuccess) e = hipSetDevice(device);
  if (e != hipSuccess) hipGetLastError();
  return moe_gpu_check(e, "hipSetDevice", err);
}

/* The caller's device back; s (or the failure to restore it) returned. */
static moe_status leave(int prev, moe_status s, moe_error *err) {
  hipError_t e = hipSetDevice(prev);
  if (e != hipSuccess) hipGetLastError();
  return s ? s : moe_gpu_check(e, "hipSetDevice (restoring the caller's device)", err);
}

/* e as a status (what: the call, for the message), its error cleared. */
static moe_status check(hipError_t e, moe_status kind, const char *what, int device, moe_error *err) {
  if (e == hipSuccess) return MOE_OK;
  hipGetLastError();
  return moe_fail(err, kind, "%s on gpu %d: %s", what, device, hipGetErrorString(e));
}

moe_status moe_ipc_open(int device, const unsigned char handle[MOE_IPC_HANDLE_BYTES], void **ptr,
                        size_t *size, moe_error *err) {
  int prev = 0;
  moe_status s = enter(device, &prev, err);
  if (s) return s;
  hipIpcMemHandle_t h;
  memcpy(&h, handle, sizeof h);
  void *p = NULL;
  /* EINVAL: a handle that opens nothing here is the caller's (not from a
   * live allocation, or from this very process) */
  s = check(hipIpcOpenMemHandle(&p, h, hipIpcMemLazyEnablePeerAccess), MOE_EINVAL, "hipIpcOpenMemHandle",
            device, err);
  hipDeviceptr_t base = NULL;
  size_t len = 0;
  if (!s && (s = check(hipMemGetAddressRange(&base, &len, p), MOE_EDEVICE,
                       "the opened allocation's size (hipMemGetAddressRange)", device, err)))
    hipIpcCloseMemHandle(p);
  if (!s) {
    /* the mapping starts at the exported allocation's base: p - base is 0
     * unless a runtime maps otherwise; what lies past p is what is ours */
    const size_t before = (size_t)((const char *)p - (const char *)base);
    *ptr = p;
    *size = len > before ? len - before : 0;
  }
  return leave(prev, s, err);
}

moe_status moe_ipc_close(int device, void *ptr, moe_error *err) {
  int prev = 0;
  moe_status s = enter(device, &prev, err);
  if (s) return s;
  return leave(prev, check(hipIpcCloseMemHandle(ptr), MOE_EDEVICE, "hipIpcCloseMemHandle", device, err), err);
}

/* One synchronous copy; to_device: host -> device, waited for until the
 * bytes are in device memory (from pageable memory the copy may return
 * once staged). */
static moe_status copy(int device, void *dst, const void *src, size_t n, bool to_device, moe_error *err) {
  int prev = 0;
  moe_status s = enter(device, &prev, err);
  if (s) return s;
  s = check(hipMemcpy(dst, src, n, to_device ? hipMemcpyHostToDevice : hipMemcpyDeviceToHost), MOE_EDEVICE,
            to_device ? "hipMemcpy (host to device)" : "hipMemcpy (device to host)", device, err);
  if (!s && to_device) s = check(hipStreamSynchronize(0), MOE_EDEVICE, "hipStreamSynchronize", device, err);
  return leave(prev, s, err);
}

moe_status moe_ipc_read(int device, void *dst, const void *src, size_t n, moe_error *err) {
  return copy(device, dst, src, n, false, err);
}

moe_status moe_ipc_write(int device, void *dst, const void *src, size_t n, moe_error *err) {
  return copy(device, dst, src, n, true, err);
}

#else /* no GPU backend */

#define NO_GPU "this build has no GPU backend (no nvcc or hipcc found at configure time)"

bool moe_ipc_supported(void) { return false; }

moe_status moe_ipc_open(int device, const unsigned char handle[MOE_IPC_HANDLE_BYTES], void **ptr,
                        size_t *size, moe_error *err) {
  (void)device, (void)handle, (void)ptr, (void)size;
  return moe_fail(err, MOE_EUNSUPPORTED, NO_GPU);
}

moe_status moe_ipc_close(int device, void *ptr, moe_error *err) {
  (void)device, (void)ptr;
  return moe_fail(err, MOE_EUNSUPPORTED, NO_GPU);
}

moe_status moe_ipc_read(int device, void *dst, const void *src, size_t n, moe_error *err) {
  (void)device, (void)dst, (void)src, (void)n;
  return moe_fail(err, MOE_EUNSUPPORTED, NO_GPU);
}

moe_status moe_ipc_write(int device, void *dst, const void *src, size_t n, moe_error *err) {
  (void)device, (void)dst, (void)src, (void)n;
  return moe_fail(err, MOE_EUNSUPPORTED, NO_GPU);
}
#endif
