/* moe: backends (where ops run) and their interface.
 *
 * A backend is { iface, kind, device, context } (ggml's layout): the CPU
 * backend and the GPU backend fill the same interface. A backend object is
 * used by one thread at a time (one device worker owns it); create one per
 * worker. */
#ifndef MOE_BACKEND_H
#define MOE_BACKEND_H

#include <stddef.h>

#include "moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_backend moe_backend;
typedef struct moe_call moe_call;

/* Memory a backend holds on its device (moe_backend_memory_get). */
typedef struct moe_backend_memory {
  size_t resident; /* expert sets and packed inline weights kept on the device */
  size_t held;     /* everything taken from the device: resident, in use, cached for reuse */
} moe_backend_memory;

typedef enum moe_backend_kind {
  MOE_BACKEND_CPU = 0,
  MOE_BACKEND_GPU = 1,
} moe_backend_kind;

struct moe_backend_i {
  /* memory of this backend; host memory for the CPU backend */
  moe_status (*alloc)(moe_backend *b, size_t nbytes, void **out);
  void (*free)(moe_backend *b, void *ptr);
  /* host -> backend and backend -> host, ordered on the backend's stream */
  moe_status (*copy_in)(moe_backend *b, void *dst, const void *src, size_t nbytes);
  moe_status (*copy_out)(moe_backend *b, void *dst, const void *src, size_t nbytes);
  /* waits for everything queued on the backend */
  moe_status (*synchronize)(moe_backend *b);
  /* runs a prepared call whose tensors live in this backend's memory */
  moe_status (*run)(moe_backend *b, moe_call *c, moe_error *err);
  /* releases the context (not the moe_backend struct itself) */
  void (*destroy)(moe_backend *b);
  /* optional (NULL: nothing resident): frees the device copies of expert
   * sets whose last reference the backend holds and, when that freed
   * anything, returns cached memory to the device; bytes freed */
  size_t (*trim)(moe_backend *b);
  /* optional: bytes held now (any thread; a snapshot) */
  void (*memory)(const moe_backend *b, moe_backend_memory *out);
};

struct moe_backend {
  const struct moe_backend_i *iface;
  moe_backend_kind kind;
  int device;    /* GPU ordinal; -1 for the CPU */
  char name[64]; /* "cpu (2 threads)", "gpu0: NVIDIA H200" */
  void *context;
};

/* threads <= 0: the OpenMP default (all cores). */
moe_status moe_backend_cpu_create(int threads, moe_backend **out, moe_error *err);
/* Number of usable GPUs (0 when the build has no GPU backend or none is
 * present); *why (may be NULL) tells which, for the log. */
int moe_backend_gpu_count(const char **why);
moe_status moe_backend_gpu_create(int device, moe_backend **out, moe_error *err);
void moe_backend_destroy(moe_backend *b);
/* The interface's memory operations, for callers (the server, tests,
 * benches): they stage tensors through these, never through b->iface. */
moe_status moe_backend_alloc(moe_backend *b, size_t nbytes, void **out);
void moe_backend_free(moe_backend *b, void *ptr);
moe_status moe_backend_copy_in(moe_backend *b, void *dst, const void *src, size_t nbytes);
moe_status moe_backend_copy_out(moe_backend *b, void *dst, const void *src, size_t nbytes);
moe_status moe_backend_synchronize(moe_backend *b);
/* The owning thread, between runs: see moe_backend_i.trim (0 when the
 * backend keeps nothing resident). */
size_t moe_backend_trim(moe_backend *b);
/* Any thread: zeros for backends without device memory of their own. */
void moe_backend_memory_get(const moe_backend *b, moe_backend_memory *out);

#ifdef __cplusplus
}
#endif
#endif
