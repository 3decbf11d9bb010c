/* Internal: the backend interface (the vtable) and the backend object, laid
 * out like ggml's { iface, device, context }. The CPU backend
 * (kernels/cpu/backend.c) and the GPU backend (kernels/gpu/backend_gpu.c)
 * fill it; kernels/ops/backend.c and call.c dispatch through it. Callers
 * outside the library see moe_backend as opaque (moe/backend.h), so that a
 * backend can change its layout, and the server never branches on which
 * backend it holds. Never installed; included only by kernels/ sources. */
#ifndef MOE_OPS_BACKEND_IMPL_H
#define MOE_OPS_BACKEND_IMPL_H

#include "moe/backend.h"
#include "moe/expert_set.h" /* moe_expert_config */

#ifdef __cplusplus
extern "C" {
#endif

/* Which table of op functions runs on a backend (moe_op.cpu or .gpu). */
typedef enum moe_backend_kind {
  MOE_BACKEND_CPU = 0,
  MOE_BACKEND_GPU = 1,
} moe_backend_kind;

/* The moe_backend_* wrappers of moe/backend.h call these. */
struct moe_backend_i {
  moe_status (*alloc)(moe_backend *b, size_t nbytes, void **out);
  void (*free)(moe_backend *b, void *ptr);
  moe_status (*copy_in)(moe_backend *b, void *dst, const void *src, size_t nbytes);
  moe_status (*copy_out)(moe_backend *b, void *dst, const void *src, size_t nbytes);
  moe_status (*synchronize)(moe_backend *b);
  /* optional (NULL: copy_in per piece): moe_backend_copy_in_gather */
  moe_status (*copy_in_gather)(moe_backend *b, void *dst, const void *const src[], const size_t off[],
                               const size_t nbytes[], size_t n);
  /* optional (NULL: copy_out, complete at once): moe_backend_copy_out_async */
  moe_status (*copy_out_async)(moe_backend *b, void *dst, const void *src, size_t nbytes);
  /* optional, both or neither (NULL: copies complete at once, no groups):
   * moe_backend_copy_out_end and moe_backend_copy_out_finish */
  moe_status (*copy_out_end)(moe_backend *b, uint64_t *group);
  moe_status (*copy_out_finish)(moe_backend *b, uint64_t group);
  /* runs a prepared call whose tensors live in this backend's memory */
  moe_status (*run)(moe_backend *b, moe_call *c, moe_error *err);
  /* releases the context (not the moe_backend struct itself) */
  void (*destroy)(moe_backend *b);
  /* optional (NULL: nothing resident): moe_backend_trim */
  size_t (*trim)(moe_backend *b);
  /* optional (NULL: zeros): moe_backend_memory_get */
  void (*memory)(const moe_backend *b, moe_backend_memory *out);
  /* optional, for backends whose fused_moe serves some sets of a scheme the
   * descriptor marks gpu and not others (NULL: every such set, no biases):
   * what of the set has no kernel here ("expert biases ..."), NULL when it
   * all runs (moe_call_check_backend) */
  const char *(*fused_lacks)(const moe_backend *b, const moe_expert_config *cfg);
};

struct moe_backend {
  const struct moe_backend_i *iface;
  moe_backend_kind kind;
  int device;    /* GPU ordinal; MOE_BACKEND_HOST for the CPU */
  char name[64]; /* moe_backend_name */
  void *context;
};

/* The constructors moe_backend_open picks between. threads <= 0: the
 * OpenMP default (all cores). */
moe_status moe_backend_cpu_create(int threads, moe_backend **out, moe_error *err);
moe_status moe_backend_gpu_create(int device, moe_backend **out, moe_error *err);

#ifdef __cplusplus
}
#endif
#endif
