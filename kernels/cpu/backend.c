/* The CPU backend: host memory, OpenMP threads, a reusable workspace. */
#include <cpuid.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "../ops/backend_impl.h"
#include "../ops/op.h"
#include "cpu.h"

typedef struct cpu_ctx {
  int threads;
  void *ws;
  size_t ws_size;
} cpu_ctx;

int moe_cpu_threads(const moe_backend *b) { return ((const cpu_ctx *)b->context)->threads; }

int moe_cpu_threads_for(const moe_backend *b, size_t elements) {
  enum { PARALLEL_MIN = 1 << 16 };
  return elements < PARALLEL_MIN ? 1 : moe_cpu_threads(b);
}

static _Atomic bool reference_kernels;
static _Atomic int isa_cap = MOE_CPU_ISA_AVX512_VBMI;

void moe_cpu_set_reference_kernels(bool on) { atomic_store(&reference_kernels, on); }

void moe_cpu_set_isa_cap(moe_cpu_isa cap) { atomic_store(&isa_cap, (int)cap); }

static moe_cpu_isa cpu_isa(void) {
  static _Atomic int isa = -1; /* the CPU's answer; threads that ask at once all get the same */
  int has = atomic_load_explicit(&isa, memory_order_relaxed);
  if (has < 0) {
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    /* F16C by cpuid: clang's __builtin_cpu_supports does not know "f16c" */
    unsigned a, b, c, d;
    const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    has = avx512 && __builtin_cpu_supports("avx512vbmi") ? MOE_CPU_ISA_AVX512_VBMI
          : avx512                                       ? MOE_CPU_ISA_AVX512
          : avx2                                         ? MOE_CPU_ISA_AVX2
                                                         : MOE_CPU_ISA_C;
    atomic_store_explicit(&isa, has, memory_order_relaxed);
  }
  return (moe_cpu_isa)has;
}

static _Atomic size_t stream_min; /* 0: the last-level cache's size */

void moe_cpu_set_stream_min(size_t bytes) { atomic_store(&stream_min, bytes); }

bool moe_cpu_stream_codes(size_t bytes) {
  size_t min = atomic_load(&stream_min);
  if (!min) {
    static _Atomic size_t llc; /* read once; threads that ask at once all get the same */
    min = atomic_load_explicit(&llc, memory_order_relaxed);
    if (!min) {
      long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE), l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
      min = l3 > 0 ? (size_t)l3 : l2 > 0 ? (size_t)l2 : (size_t)32 << 20;
      atomic_store_explicit(&llc, min, memory_order_relaxed);
    }
  }
  return bytes >= min;
}

moe_cpu_isa moe_cpu_quant_isa(void) {
  if (atomic_load(&reference_kernels)) return MOE_CPU_ISA_C;
  const moe_cpu_isa has = cpu_isa(), cap = (moe_cpu_isa)atomic_load(&isa_cap);
  return has < cap ? has : cap;
}

bool moe_cpu_vector_kernels(void) {
  return cpu_isa() >= MOE_CPU_ISA_AVX512 && !atomic_load(&reference_kernels);
}

void *moe_cpu_workspace(moe_backend *b, size_t bytes) {
  cpu_ctx *ctx = b->context;
  if (bytes <= ctx->ws_size) return ctx->ws;
  size_t rounded = (bytes + 63) & ~(size_t)63;
  if (rounded < bytes) return NULL;
  void *p = aligned_alloc(64, rounded);
  if (!p) return NULL;
  free(ctx->ws);
  ctx->ws = p;
  ctx->ws_size = rounded;
  return p;
}

static moe_status cpu_alloc(moe_backend *b, size_t n, void **out) {
  (void)b;
  size_t rounded = (n + 63) & ~(size_t)63;
  if (rounded < n) return MOE_EOVERFLOW;
  *out = moe_host_alloc(rounded ? rounded : 64, 64); /* inline weights cached here: huge pages */
  return *out ? MOE_OK : MOE_ENOMEM;
}

static void cpu_free(moe_backend *b, void *p) {
  (void)b;
  free(p);
}

static moe_status cpu_copy(moe_backend *b, void *dst, const void *src, size_t n) {
  (void)b;
  if (n) memcpy(dst, src, n);
  return MOE_OK;
}

static moe_status cpu_sync(moe_backend *b) {
  (void)b;
  return MOE_OK;
}

static moe_status cpu_run(moe_backend *b, moe_call *c, moe_error *err) { return c->op->cpu(b, c, err); }

static void cpu_destroy(moe_backend *b) {
  cpu_ctx *ctx = b->context;
  if (ctx) free(ctx->ws);
  free(ctx);
}

static const struct moe_backend_i cpu_iface = {
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_in = cpu_copy,
    .copy_out = cpu_copy,
    .synchronize = cpu_sync,
    .run = cpu_run,
    .destroy = cpu_destroy,
};

moe_status moe_backend_cpu_create(int threads, moe_backend **out, moe_error *err) {
  moe_backend *b = calloc(1, sizeof *b);
  cpu_ctx *ctx = calloc(1, sizeof *ctx);
  if (!b || !ctx) {
    free(b);
    free(ctx);
    return moe_fail(err, MOE_ENOMEM, "out of memory");
  }
#ifdef _OPENMP
  if (threads <= 0) threads = omp_get_max_threads();
#else
  threads = 1;
#endif
  ctx->threads = threads;
  b->iface = &cpu_iface;
  b->kind = MOE_BACKEND_CPU;
  b->device = MOE_BACKEND_HOST;
  b->context = ctx;
  snprintf(b->name, sizeof b->name, "cpu (%d threads)", threads);
  *out = b;
  return MOE_OK;
}
