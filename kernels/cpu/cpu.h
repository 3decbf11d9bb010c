/* Internal: the CPU backend's context, shared by the CPU op functions. */
#ifndef MOE_CPU_CPU_H
#define MOE_CPU_CPU_H

#include <stdbool.h>
#include <stddef.h>

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

/* Whether fused_moe takes the formats' AVX-512 members (weight_format.h):
 * the CPU has AVX-512 and the reference kernels are not asked for. */
bool moe_cpu_vector_kernels(void);
/* Tests: true makes fused_moe take its reference kernels (weights
 * dequantized element by element into a strip, every dot product read from
 * the strip: the code the vector members must equal byte for byte);
 * process-wide, read once per call. */
void moe_cpu_set_reference_kernels(bool on);

/* fused_moe's fp8 activations (docs/numerics.md "Weight scheme fp8"): the
 * n fp32 values v are quantized to e4m3fn as quant.per_token_group does one
 * group (static_scale <= 0: the dynamic scale of the group; else quant.per_tensor's
 * static scale) and replaced by their codes' exact values; returns the scale. */
float moe_cpu_fp8_quant_group(float *v, size_t n, float static_scale, bool exact_division);

#endif
