/* CPU: the codes of the scaled quant ops (docs/numerics.md quant.per_tensor,
 * quant.per_token, quant.per_token_group) in AVX2 lanes, 32 elements a step,
 * for CPUs with AVX2 but without AVX-512 VBMI (moe_cpu_quant_isa): the plan
 * of quant_encode_avx512.c in 8 lanes. fp8 (e4m3fn, e4m3fnuz) on
 * a = |x * r|: min(max finite, a), then min(a, N) so that only NaN becomes N,
 * the value of the NaN code's magnitude; the magnitude by the rounding add of
 * narrow_lanes_avx2.h; the low bytes packed (vpackusdw, vpackuswb, vpermd),
 * the inputs' sign bits packed alike and or-ed in; e4m3fn's NaN with a sign
 * back to 0x7F, e4m3fnuz's -0 to 0x00. int8 on x * r with its sign:
 * min(127, v), max(-128, v) (NaN stays NaN), vroundps to nearest even (the
 * mode in the instruction, not MXCSR's), vcvttps2dq (NaN -> 0x80000000, low
 * byte 0, the NaN code), the low bytes packed. test_quant_ops compares them
 * with the C loops (moe_cpu_set_isa_cap) on every fp16/bf16 pattern. */
#include <immintrin.h>

#include "../ops/op.h"
#include "cpu.h"
#include "narrow_lanes_avx2.h"

#define VAVX2 __attribute__((target("avx2,f16c")))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef struct lanes {
  __m256 hi, lo;      /* fp8: max finite, N; int8: 127, -128 */
  narrow_avx2 narrow; /* fp8 */
} lanes;

/* 32 elements widened to fp32 in v[0..3] (elements 8k .. 8k + 7), their
 * sign bits as bytes (bit 7) in element order when `abs`, then |x|. fp16:
 * vcvtph2ps (exact; a NaN's payload is quieted, and any NaN encodes to the
 * NaN code). */
VAVX2 ALWAYS_INLINE void load32(const void *x, moe_dtype xt, size_t i, bool abs, __m256 v[4], __m256i *sign) {
  if (xt == MOE_F32) {
    const float *f = (const float *)x + i;
    __m256i u[4], s[4];
    for (int k = 0; k < 4; k++) {
      u[k] = _mm256_loadu_si256((const __m256i *)(f + 8 * k));
      s[k] = _mm256_srli_epi32(u[k], 24);
      if (abs) u[k] = _mm256_and_si256(u[k], _mm256_set1_epi32(0x7FFFFFFF));
      v[k] = _mm256_castsi256_ps(u[k]);
    }
    if (abs) *sign = narrow_avx2_pack(s);
    return;
  }
  const uint16_t *h = (const uint16_t *)x + i;
  __m256i w[2] = {_mm256_loadu_si256((const __m256i *)h), _mm256_loadu_si256((const __m256i *)(h + 16))};
  if (abs) {
    *sign = narrow_avx2_high_bytes(w[0], w[1], 8);
    w[0] = _mm256_and_si256(w[0], _mm256_set1_epi16(0x7FFF));
    w[1] = _mm256_and_si256(w[1], _mm256_set1_epi16(0x7FFF));
  }
  for (int k = 0; k < 4; k++) {
    const __m128i x8 = k & 1 ? _mm256_extracti128_si256(w[k / 2], 1) : _mm256_castsi256_si128(w[k / 2]);
    v[k] = xt == MOE_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x8), 16))
                          : _mm256_cvtph_ps(x8);
  }
}

/* One vector's codes in the low byte of each lane, the bits above cleared. */
VAVX2 ALWAYS_INLINE __m256i code8(__m256 v, __m256 mul, int out, bool exact, const lanes *L) {
  const __m256 y = exact ? _mm256_div_ps(v, mul) : _mm256_mul_ps(v, mul);
  if (out == MOE_SCALED_INT8) {
    const __m256 c = _mm256_max_ps(L->lo, _mm256_min_ps(L->hi, y)); /* operand order keeps NaN */
    const __m256i i = _mm256_cvttps_epi32(_mm256_round_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm256_and_si256(i, _mm256_set1_epi32(0xFF));
  }
  const __m256 a = _mm256_min_ps(_mm256_min_ps(L->hi, y), L->lo); /* NaN -> N */
  return narrow_avx2_mag(a, &L->narrow, false, true);
}

/* Units [0, units) of g elements, unit u scaled by s[u] (exact) or r[u]:
 * the leading multiple of 32 of each. */
VAVX2 ALWAYS_INLINE size_t encode_loop(const void *x, moe_dtype xt, size_t units, size_t g, const float *s,
                                       const float *r, int out, bool exact, const lanes *L,
                                       moe_cpu_ahead ahead, bool stream, uint8_t *q) {
  const bool fp8 = out != MOE_SCALED_INT8;
  const size_t n = g / 32 * 32;
  for (size_t u = 0; u < units; u++) {
    const __m256 mul = _mm256_set1_ps(exact ? s[u] : r[u]);
    for (size_t i = u * g, end = i + n; i < end; i += 32) {
      __m256 v[4];
      __m256i sign = _mm256_setzero_si256(), c[4];
      const size_t es = xt == MOE_F32 ? 4 : 2;
      for (size_t l = 0; l < 32 * es; l += 64) /* the input `ahead` bytes ahead */
        moe_cpu_prefetch((const char *)x + i * es + l, ahead);
      load32(x, xt, i, fp8, v, &sign);
      for (int k = 0; k < 4; k++)
        c[k] = code8(v[k], mul, out, exact, L);
      __m256i b = narrow_avx2_pack(c);
      if (fp8) {
        const __m256i mag = b;
        b = _mm256_or_si256(mag, _mm256_and_si256(sign, _mm256_set1_epi8((char)0x80)));
        if (out == MOE_SCALED_FP8_NEG_ZERO) /* NaN's code has no sign: 0xFF -> 0x7F */
          b = _mm256_xor_si256(
              b, _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi8(-1)), _mm256_set1_epi8((char)0x80)));
        else /* no -0: a zero magnitude drops its sign */
          b = _mm256_andnot_si256(_mm256_cmpeq_epi8(mag, _mm256_setzero_si256()), b);
      }
      if (stream && !((uintptr_t)(q + i) & 31)) /* written around the cache */
        _mm256_stream_si256((__m256i *)(q + i), b);
      else
        _mm256_storeu_si256((__m256i *)(q + i), b);
    }
  }
  if (stream) _mm_sfence(); /* the streamed lines ordered before the caller's later stores */
  return n;
}

VAVX2 size_t moe_cpu_encode_scaled_avx2(const void *x, moe_dtype xt, size_t units, size_t g, const float *s,
                                        const float *r, bool exact, bool int8, const moe_narrow_fmt *fmt,
                                        moe_cpu_ahead ahead, bool stream, uint8_t *q) {
  lanes L;
  float hi, lo;
  const int out = moe_cpu_scaled_kind(int8, fmt, &hi, &lo);
  if (out < 0 || out == MOE_SCALED_FP4) return 0; /* fp4: the AVX-512 encoder's alone */
  L.hi = _mm256_set1_ps(hi);
  L.lo = _mm256_set1_ps(lo);
  if (!int8) L.narrow = narrow_avx2_of(fmt);
    /* one straight loop per (input dtype, output kind) */
#define ENCODE(XT, OUT) encode_loop(x, XT, units, g, s, r, OUT, exact, &L, ahead, stream, q)
  MOE_CPU_SCALED_DISPATCH(xt, out, ENCODE)
#undef ENCODE
}
