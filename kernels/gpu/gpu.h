/* Internal: the GPU backend's context, shared by the GPU op functions
 * (kernels/gpu/ *.hip), the GPU test and the GPU bench. Never installed. */
#ifndef MOE_GPU_GPU_H
#define MOE_GPU_GPU_H

#include <stdbool.h>
#include <stddef.h>

#include "hip_compat.h"
#include "moe/backend.h"
#include "moe/expert_set.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The backend's one stream: every op, copy and memset of `b` is queued on it. */
hipStream_t moe_gpu_stream(moe_backend *b);
/* Multiprocessors (compute units) of b's device, for grid sizing. */
int moe_gpu_sm_count(const moe_backend *b);
/* Major compute capability of b's device (NVIDIA; the gfx major on AMD). */
int moe_gpu_cc_major(const moe_backend *b);
/* The device's model name as the runtime reports it ("NVIDIA H200"): the
 * key of the tuned tile table (fused_moe_tuned.h). */
const char *moe_gpu_device_name(const moe_backend *b);
/* Device scratch of at least `bytes`, owned by the backend and reused across
 * calls (no device malloc per call once it has grown). Valid until the next
 * call of this function on `b`; work queued on b's stream may use it. NULL
 * when device memory is exhausted. */
void *moe_gpu_workspace(moe_backend *b, size_t bytes);
/* MOE_OK for hipSuccess, else MOE_EDEVICE with "what: <runtime message>". */
moe_status moe_gpu_check(hipError_t e, const char *what, moe_error *err);
/* Makes b's device current on the calling thread (one worker owns b). */
moe_status moe_gpu_enter(moe_backend *b, moe_error *err);

/* Device copies of a loaded expert set's tensors (whose data are host
 * pointers: the files, read into memory at load), cached by the set's
 * address: the first call uploads every present tensor, later calls return
 * the same copies.
 * dev[slot] is NULL where the set has no tensor. Entries are keyed by the
 * set, whose reference the cache holds (so its address is not reused while
 * the entry exists); moe_backend_trim frees the copies once the cache holds
 * the last reference. Inline weights (c->owned_set) never come here: their
 * tensors are the call's inputs, already device pointers. */
moe_status moe_gpu_set_weights(moe_backend *b, const moe_expert_set *set, void *dev[MOE_EXPERT_TENSOR_COUNT],
                               moe_error *err);

/* fused_moe's tensor-core path (kernels/gpu/fused_moe_tc.hip) reads its
 * weights in a packed layout. moe_gpu_fused_packs: whether sets of this
 * configuration take that path on b (shape, scheme and device only).
 * moe_gpu_fused_pack: allocates dst[slot] (b's memory) for every slot that
 * has a packed form and packs src (device tensors of `set`, the files'
 * layout) into it on b's stream; NULL elsewhere; nothing allocated on
 * failure. moe_gpu_set_weights packs a loaded set once (and frees the
 * originals); moe_gpu_inline_packed keeps packed copies of inline weights. */
bool moe_gpu_fused_packs(moe_backend *b, const moe_expert_config *cfg);
moe_status moe_gpu_fused_pack(moe_backend *b, const moe_expert_set *set,
                              void *const src[MOE_EXPERT_TENSOR_COUNT], void *dst[MOE_EXPERT_TENSOR_COUNT],
                              moe_error *err);
/* Whether sets of this configuration take the tensor-core path on b (and
 * are packed for it): moe_gpu_fused_packs, unless moe_gpu_portable. Every
 * caller asks this, never moe_gpu_fused_packs alone. */
bool moe_gpu_fused_tc(moe_backend *b, const moe_expert_config *cfg);
/* MOE_GPU_PORTABLE set (non-empty, not "0"), read once per process: only
 * the kernels AMD gets run (quant.hip's codec conversions, fused_moe's
 * portable GEMM for every set), so that tests exercise them on NVIDIA. Sets
 * are packed at load by moe_gpu_fused_tc, hence one answer per process. */
bool moe_gpu_portable(void);
/* Packed copies of an inline-weight set's tensors dev (device pointers, the
 * call's inputs), replaced in dev: made on the first call and reused while
 * the same device buffers come back; an entry is dropped when one of its
 * source buffers is freed or written through this backend (free, copy_in),
 * and the least recently used go past MOE_GPU_PACKED_INLINE entries. */
#define MOE_GPU_PACKED_INLINE 4
moe_status moe_gpu_inline_packed(moe_backend *b, const moe_expert_set *set,
                                 void *dev[MOE_EXPERT_TENSOR_COUNT], moe_error *err);

/* Tile configurations of fused_moe's tensor-core GEMM (fused_moe_gpu.h),
 * by name: MOE_GPU_FUSED_TILE=<name> forces one, and the bench's tuner
 * (moe-bench-gpu --tune) times each. */
enum { TC_SMALL, TC_MEDIUM, TC_WIDE, TC_LARGE, TC_TALL, TC_CONFIGS };
extern const char *const moe_tc_config_names[TC_CONFIGS]; /* small, medium, wide, large, tall */
/* The configuration an untuned set of `scheme` (wna16: `bits`) takes at
 * `avg` slots per routed expert (the tuner writes rows that differ from it) */
int moe_tc_untuned(moe_scheme scheme, int bits, int64_t avg);

/* moe.topk routing of rows [0, T) of `logits` (device) into ids/weights
 * (device, [T, r->top_k]); bias: device F32 [E] or NULL. Queued on b's
 * stream; also fused_moe's routing step (kernels/gpu/topk.hip). */
moe_status moe_gpu_route(moe_backend *b, const moe_tensor *logits, const float *bias, const moe_routing *r,
                         int32_t *ids, float *weights, moe_error *err);

#ifdef __cplusplus
}
#endif
#endif
