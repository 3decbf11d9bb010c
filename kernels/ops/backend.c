/* The public backend API over the interface every backend fills: opening by
 * device, lifetime, accessors and the memory wrappers; and the GPU entry
 * points of a build without a GPU backend. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "backend_impl.h"

void *moe_host_alloc(size_t nbytes, size_t align) {
  if (!align || (align & (align - 1))) return NULL;
  /* no object may span more than PTRDIFF_MAX bytes (pointer differences inside
   * it must be defined); refusing here also keeps sanitizing allocators, which
   * abort on impossible sizes rather than return an error, out of it */
  if (nbytes > (size_t)PTRDIFF_MAX - MOE_HOST_HUGE_PAGE) return NULL;
  const bool huge = nbytes >= MOE_HOST_HUGE_PAGE;
  if (huge && align < MOE_HOST_HUGE_PAGE) align = MOE_HOST_HUGE_PAGE;
  if (align < sizeof(void *)) align = sizeof(void *); /* posix_memalign's least */
  void *p = NULL;
  if (posix_memalign(&p, align, nbytes ? nbytes : 1) != 0) return NULL;
  /* the whole huge pages of the block; a refusal (no THP) leaves it as it is */
  if (huge) (void)madvise(p, nbytes / MOE_HOST_HUGE_PAGE * MOE_HOST_HUGE_PAGE, MADV_HUGEPAGE);
  return p;
}

moe_status moe_backend_open(int device, int cpu_threads, moe_backend **out, moe_error *err) {
  if (device == MOE_BACKEND_HOST) return moe_backend_cpu_create(cpu_threads, out, err);
  return moe_backend_gpu_create(device, out, err);
}

void moe_backend_destroy(moe_backend *b) {
  if (!b) return;
  if (b->iface && b->iface->destroy) b->iface->destroy(b);
  free(b);
}

const char *moe_backend_name(const moe_backend *b) { return b->name; }
bool moe_backend_is_host(const moe_backend *b) { return b->kind == MOE_BACKEND_CPU; }

moe_status moe_backend_alloc(moe_backend *b, size_t nbytes, void **out) {
  return b->iface->alloc(b, nbytes, out);
}
void moe_backend_free(moe_backend *b, void *ptr) { b->iface->free(b, ptr); }
moe_status moe_backend_copy_in(moe_backend *b, void *dst, const void *src, size_t nbytes) {
  return b->iface->copy_in(b, dst, src, nbytes);
}
moe_status moe_backend_copy_out(moe_backend *b, void *dst, const void *src, size_t nbytes) {
  return b->iface->copy_out(b, dst, src, nbytes);
}
moe_status moe_backend_copy_in_gather(moe_backend *b, void *dst, const void *const src[], const size_t off[],
                                      const size_t nbytes[], size_t n) {
  size_t end = 0;
  for (size_t i = 0; i < n; i++) { /* increasing, not overlapping (every backend alike) */
    if (off[i] < end || nbytes[i] > SIZE_MAX - off[i]) return MOE_EINVAL;
    end = off[i] + nbytes[i];
  }
  if (b->iface->copy_in_gather) return b->iface->copy_in_gather(b, dst, src, off, nbytes, n);
  for (size_t i = 0; i < n; i++) {
    moe_status s = b->iface->copy_in(b, (char *)dst + off[i], src[i], nbytes[i]);
    if (s) return s;
  }
  return MOE_OK;
}
moe_status moe_backend_copy_out_async(moe_backend *b, void *dst, const void *src, size_t nbytes) {
  if (b->iface->copy_out_async) return b->iface->copy_out_async(b, dst, src, nbytes);
  return b->iface->copy_out(b, dst, src, nbytes);
}
moe_status moe_backend_copy_out_end(moe_backend *b, uint64_t *group) {
  return b->iface->copy_out_end ? b->iface->copy_out_end(b, group) : MOE_EUNSUPPORTED;
}
moe_status moe_backend_copy_out_finish(moe_backend *b, uint64_t group) {
  return b->iface->copy_out_finish ? b->iface->copy_out_finish(b, group) : MOE_EUNSUPPORTED;
}
moe_status moe_backend_synchronize(moe_backend *b) { return b->iface->synchronize(b); }

size_t moe_backend_trim(moe_backend *b) { return b && b->iface->trim ? b->iface->trim(b) : 0; }

void moe_backend_memory_get(const moe_backend *b, moe_backend_memory *out) {
  out->resident = out->held = 0;
  if (b && b->iface->memory) b->iface->memory(b, out);
}

#ifndef MOE_HAVE_GPU
int moe_backend_device_count(const char **why) {
  if (why) *why = "this build has no GPU backend (no nvcc or hipcc found at configure time)";
  return 0;
}

moe_status moe_backend_gpu_create(int device, moe_backend **out, moe_error *err) {
  (void)device;
  (void)out;
  return moe_fail(err, MOE_EUNSUPPORTED, "this build has no GPU backend");
}
#endif
