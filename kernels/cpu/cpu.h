/* Internal: the CPU backend's context, shared by the CPU op functions. */
#ifndef MOE_CPU_CPU_H
#define MOE_CPU_CPU_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "moe/backend.h"

/* Hot loops are compiled three times, for x86-64-v4 (AVX-512), AVX2 and the
 * x86-64 baseline, and the loader picks one (GNU ifunc): same source, same
 * IEEE results (no contraction, sums in an order fixed in the C source),
 * wider vectors where the machine has them. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MOE_NO_CLONES)
#define MOE_CPU_HOT __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MOE_CPU_HOT
#endif

/* Outputs of at least this many bytes are written with non-temporal stores
 * (moe_cpu_stream): bigger than the caches, they would only evict the input,
 * and a regular store first reads every line it writes. */
#define MOE_CPU_STREAM_MIN ((size_t)4 << 20)

/* dst[0, n) = src[0, n) around the caches where the CPU has non-temporal
 * stores (x86: 16-byte movntdq, the edges with plain stores), else memcpy.
 * Call moe_cpu_stream_fence() before the data is read by another thread. */
static inline void moe_cpu_stream(uint8_t *dst, const uint8_t *src, size_t n) {
  size_t i = 0;
#if defined(__x86_64__) && defined(__SSE2__)
  for (; i < n && ((uintptr_t)(dst + i) & 15u); i++)
    dst[i] = src[i];
  for (; i + 16 <= n; i += 16)
    _mm_stream_si128((__m128i *)(void *)(dst + i), _mm_loadu_si128((const __m128i *)(const void *)(src + i)));
#endif
  memcpy(dst + i, src + i, n - i);
}

static inline void moe_cpu_stream_fence(void) {
#if defined(__x86_64__) && defined(__SSE2__)
  _mm_sfence();
#endif
}

/* Threads the op functions use (OpenMP num_threads). */
int moe_cpu_threads(const moe_backend *b);
/* Threads for `elements` of streaming work: 1 below a cutoff, where waking
 * a thread team costs more than the work (a 256-element quant call took
 * 15x longer with the team than without on a loaded 2-core machine). */
int moe_cpu_threads_for(const moe_backend *b, size_t elements);
/* A scratch buffer of at least `bytes` (64-byte aligned), owned by the
 * backend and reused across calls, so hot paths never allocate per call.
 * Valid until the next call of this function on `b`. NULL when out of memory. */
void *moe_cpu_workspace(moe_backend *b, size_t bytes);

#endif
