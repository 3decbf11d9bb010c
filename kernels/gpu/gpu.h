/* Internal: the GPU backend's context, shared by the GPU op functions
 * (kernels/gpu/ *.hip), the GPU test and the GPU bench. Never installed. */
#ifndef MOE_GPU_GPU_H
#define MOE_GPU_GPU_H

#include <stddef.h>

#include "hip_compat.h"
#include "moe/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The backend's one stream: every op, copy and memset of `b` is queued on it. */
hipStream_t moe_gpu_stream(moe_backend *b);
/* Multiprocessors (compute units) of b's device, for grid sizing. */
int moe_gpu_sm_count(const moe_backend *b);
/* Device scratch of at least `bytes`, owned by the backend and reused across
 * calls (no device malloc per call once it has grown). Valid until the next
 * call of this function on `b`; work queued on b's stream may use it. NULL
 * when device memory is exhausted. */
void *moe_gpu_workspace(moe_backend *b, size_t bytes);
/* MOE_OK for hipSuccess, else MOE_EDEVICE with "what: <runtime message>". */
moe_status moe_gpu_check(hipError_t e, const char *what, moe_error *err);
/* Makes b's device current on the calling thread (one worker owns b). */
moe_status moe_gpu_enter(moe_backend *b, moe_error *err);

#ifdef __cplusplus
}
#endif
#endif
