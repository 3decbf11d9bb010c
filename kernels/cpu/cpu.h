/* Internal: the CPU backend's context, shared by the CPU op functions. */
#ifndef MOE_CPU_CPU_H
#define MOE_CPU_CPU_H

#include <stdbool.h>
#include <stddef.h>

#include "moe/backend.h"
#include "moe/codec.h"
#include "moe/tensor.h"

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
/* The instruction sets the quant ops' hand-written lane code may use, in
 * order: each level includes the ones below it. */
typedef enum moe_cpu_isa {
  MOE_CPU_ISA_C = 0,       /* the C loops (compiled as target_clones) */
  MOE_CPU_ISA_AVX2,        /* AVX2 + FMA + F16C */
  MOE_CPU_ISA_AVX512,      /* AVX-512 F/BW/DQ/VL */
  MOE_CPU_ISA_AVX512_VBMI, /* ... and VBMI's byte permutes */
} moe_cpu_isa;
/* The level the quant ops take: the CPU's, capped by moe_cpu_set_isa_cap;
 * MOE_CPU_ISA_C while the reference kernels are asked for. */
moe_cpu_isa moe_cpu_quant_isa(void);
/* Tests: the highest level the quant ops may take (process-wide, read once
 * per call), so that each lower path runs on a machine that has the higher
 * ones. MOE_CPU_ISA_AVX512_VBMI (the default) caps nothing. */
void moe_cpu_set_isa_cap(moe_cpu_isa cap);
/* Tests: true makes fused_moe take its reference kernels (weights
 * dequantized element by element into a strip, every dot product read from
 * the strip: the code the vector members must equal byte for byte);
 * process-wide, read once per call. */
void moe_cpu_set_reference_kernels(bool on);

/* How far ahead (bytes) the quant ops prefetch their input: a page, since
 * the hardware prefetchers stop at 4 KiB boundaries. On the Intel VM at
 * 1 GiB (past the L3) it took static fp8 from 148 to 108 ms (bench/RESULTS.md). */
#define MOE_CPU_PREFETCH 4096
/* A look-ahead: `bytes` ahead, into L2 only (prefetcht2) or into L1.
 * quant.per_tensor's straight streams over the whole tensor (amax and codes)
 * take two pages into L2 (MOE_CPU_AHEAD_STREAM); per_token and
 * per_token_group the next batch into L1, or the two next into L2 while
 * their codes are streamed (below); quant.mx a page into L1. An L1 prefetch
 * and a streamed store each hold one of the core's line fill buffers:
 * streamed codes gained only with the L2 look-ahead (bench/RESULTS.md). */
typedef struct moe_cpu_ahead {
  size_t bytes;
  bool l2;
} moe_cpu_ahead;
#define MOE_CPU_AHEAD_STREAM ((moe_cpu_ahead){2 * MOE_CPU_PREFETCH, true})
static inline void moe_cpu_prefetch(const void *p, moe_cpu_ahead a) {
  if (a.l2)
    __builtin_prefetch((const char *)p + a.bytes, 0, 1);
  else
    __builtin_prefetch((const char *)p + a.bytes, 0, 3);
}

/* Whether the scaled quant ops write their codes with non-temporal
 * (streaming) stores: when the call's input and output together exceed the
 * last-level cache (sysconf; 32 MiB where it says nothing), so the codes
 * would leave the cache before anyone read them, and a cached store would
 * first read each line from memory for nothing. On the Intel VM at 1 GiB,
 * with the L2 look-ahead: static int8 114 -> 94 ms, per_token_group 128
 * 143 -> 130 ms. The bits are the same either way. */
bool moe_cpu_stream_codes(size_t bytes);
/* Tests: the byte count from which moe_cpu_stream_codes says yes
 * (process-wide; 0 restores the cache-size rule), so the streamed paths
 * run on small tensors. */
void moe_cpu_set_stream_min(size_t bytes);

/* The scaled quant ops' codes in SIMD lanes: `units` runs of g elements,
 * unit u's codes q[i] = cvt(x[i] * r[u]), or cvt(x[i] / s[u]) when `exact`,
 * to int8 or to fp8 `fmt` (e4m3fn, e4m3fnuz), for the leading multiple of 64
 * (AVX-512, quant_encode_avx512.c; needs MOE_CPU_ISA_AVX512_VBMI) or 32
 * (AVX2, quant_encode_avx2.c) of each unit, prefetching the input
 * `ahead`; `stream`: the codes by non-temporal stores where q is
 * aligned to the vector (moe_cpu_stream_codes), fenced before the return so
 * the caller's own stores come after them. Return that count per unit (0
 * for a format they do not encode); the caller's C loop takes the rest.
 * g == 32 (quant.mx's blocks): every element, AVX-512 in pairs of units (a
 * step each) where `units` is even (else 0), AVX2 a unit a step. AVX-512
 * also encodes fp4 e2m1 (quant.mx's mxfp4) of fp16/bf16 input at g == 32:
 * two codes a byte, low nibble first, q[i / 2] (MOE_SCALED_FP4; a NaN
 * encodes as the max finite value: quant.mx zeroes those blocks). */
typedef size_t (*moe_cpu_scaled_lanes)(const void *x, moe_dtype xt, size_t units, size_t g, const float *s,
                                       const float *r, bool exact, bool int8, const moe_narrow_fmt *fmt,
                                       moe_cpu_ahead ahead, bool stream, uint8_t *q);
size_t moe_cpu_encode_scaled_avx512(const void *x, moe_dtype xt, size_t units, size_t g, const float *s,
                                    const float *r, bool exact, bool int8, const moe_narrow_fmt *fmt,
                                    moe_cpu_ahead ahead, bool stream, uint8_t *q);
/* The lane encoders' output kinds, and the kind for int8 / fmt with the
 * fp32 bounds they clamp to before rounding: *hi the largest finite value
 * (int8: 127), *lo the value of magnitude code max_mag + 1, whose code NaN
 * is given (int8: -128; fp4: its max finite value, since e2m1 has no NaN
 * code: quant.mx zeroes NaN blocks). -1: a format they do not encode (e4m3
 * shapes and e2m1 only: no inf codes; e5m2 is not a scaled op's output).
 * fp4 is the AVX-512 encoder's alone, at g == 32 of fp16/bf16 input. */
enum { MOE_SCALED_INT8, MOE_SCALED_FP8_NEG_ZERO, MOE_SCALED_FP8_NO_NEG_ZERO, MOE_SCALED_FP4 };
static inline int moe_cpu_scaled_kind(bool int8, const moe_narrow_fmt *fmt, float *hi, float *lo) {
  if (int8) {
    *hi = 127.0f;
    *lo = -128.0f;
    return MOE_SCALED_INT8;
  }
  if (fmt->bits == 4 && fmt->mbits == 1 && !fmt->inf_codes) {
    *hi = *lo = fmt->max_finite;
    return MOE_SCALED_FP4;
  }
  if (fmt->bits != 8 || fmt->mbits != 3 || fmt->inf_codes) return -1;
  const int c = fmt->max_mag + 1; /* N: code max_mag + 1's value on the format's grid */
  *hi = fmt->max_finite;
  *lo = (float)(8 + (c & 7)) * moe_pow2f((c >> 3) - fmt->bias - 3);
  return fmt->neg_zero ? MOE_SCALED_FP8_NEG_ZERO : MOE_SCALED_FP8_NO_NEG_ZERO;
}

/* The lane encoders' dispatch, a statement that returns: one call of the
 * encoder's function-like macro LOOP(XT, OUT) per (input dtype xt, output
 * kind out), each with both as constants, so that every inner loop is
 * compiled straight for its pair (the division mode stays a branch the
 * compiler hoists); the switch itself runs once per call. */
#define MOE_CPU_SCALED_DISPATCH(xt, out, LOOP)                                                               \
  switch (xt) {                                                                                              \
  case MOE_BF16: MOE_CPU_SCALED_DISPATCH_OUT_(MOE_BF16, out, LOOP);                                          \
  case MOE_F16: MOE_CPU_SCALED_DISPATCH_OUT_(MOE_F16, out, LOOP);                                            \
  default: MOE_CPU_SCALED_DISPATCH_OUT_(MOE_F32, out, LOOP);                                                 \
  }
#define MOE_CPU_SCALED_DISPATCH_OUT_(XT, out, LOOP)                                                          \
  switch (out) {                                                                                             \
  case MOE_SCALED_INT8: return LOOP(XT, MOE_SCALED_INT8);                                                    \
  case MOE_SCALED_FP8_NEG_ZERO: return LOOP(XT, MOE_SCALED_FP8_NEG_ZERO);                                    \
  default: return LOOP(XT, MOE_SCALED_FP8_NO_NEG_ZERO);                                                      \
  }

/* The scaled ops' amaxes in AVX-512 lanes (quant_encode_avx512.c; needs
 * MOE_CPU_ISA_AVX512): amax[u] = the max |x| over the finite elements of
 * unit u, units [0, units) of g elements, as the C loops compute it,
 * prefetching the input `ahead`. Returns `units`, or 0 for an input dtype it
 * does not take (fp32: the C loops). */
typedef size_t (*moe_cpu_amax_lanes)(const void *x, moe_dtype xt, size_t units, size_t g, moe_cpu_ahead ahead,
                                     float *amax);
size_t moe_cpu_amax_units_avx512(const void *x, moe_dtype xt, size_t units, size_t g, moe_cpu_ahead ahead,
                                 float *amax);

/* The dequant ops' lanes (dequant_avx512.c). What they need of a call is
 * built once per call, before the threads split it (a 256-entry table's byte
 * planes, the fp8 decode's and the exponent add's bounds), and read by every
 * chunk. */
typedef struct moe_cpu_dequant_plan {
  uint8_t lo[256], hi[256]; /* 16-bit outputs by code, as two byte planes */
  int shift, special;       /* mx fp8 lane decode: 23 - mbits, the least magnitude taken from the table */
  float unbias;             /* 2^(127 - bias) */
  int kmin, kmax;           /* mx fp8 -> bf16: the block exponents the add takes */
  bool bf16_add;            /* mx fp8 -> bf16 by the exponent add (VBMI) */
} moe_cpu_dequant_plan;
/* dequant.per_tensor's table of finished outputs as the plan's planes. */
void moe_cpu_lut16_plan(const uint16_t table[256], moe_cpu_dequant_plan *p);
/* y[i] = the planes' output of q[i] for the leading multiple of 64 of n
 * elements, that count returned (needs MOE_CPU_ISA_AVX512_VBMI). */
size_t moe_cpu_lut16_avx512(const uint8_t *q, const moe_cpu_dequant_plan *p, size_t n, uint16_t *y);
/* dequant.mx's plan for format fmt to yt (`vbmi`: the CPU has VBMI too);
 * value: the format's code values (16 for fp4, else 256) by
 * moe_narrow_to_f32. false: a format whose NaN/inf codes the lanes do not
 * place (the C loops take the call). */
bool moe_cpu_dequant_mx_plan(const moe_narrow_fmt *fmt, const float *value, moe_dtype yt, bool vbmi,
                             moe_cpu_dequant_plan *p);
/* dequant.mx's blocks [b0, b1) of q (fp4: 16 bytes a block, else 32) with
 * their e8m0 scales: value[code] x scale rounded to yt (F32, F16 or BF16)
 * at y[32 b ..] (needs MOE_CPU_ISA_AVX512). */
void moe_cpu_dequant_mx_avx512(const uint8_t *q, const uint8_t *scales, const float *value,
                               const moe_narrow_fmt *fmt, const moe_cpu_dequant_plan *p, size_t b0, size_t b1,
                               moe_dtype yt, void *y);

size_t moe_cpu_encode_scaled_avx2(const void *x, moe_dtype xt, size_t units, size_t g, const float *s,
                                  const float *r, bool exact, bool int8, const moe_narrow_fmt *fmt,
                                  moe_cpu_ahead ahead, bool stream, uint8_t *q);

/* fused_moe's fp8 activations (docs/numerics.md "Weight scheme fp8"): the
 * n fp32 values v are quantized to e4m3fn as quant.per_token_group does one
 * group (static_scale <= 0: the dynamic scale of the group; else quant.per_tensor's
 * static scale) and replaced by their codes' exact values; returns the scale. */
float moe_cpu_fp8_quant_group(float *v, size_t n, float static_scale, bool exact_division);

#endif
