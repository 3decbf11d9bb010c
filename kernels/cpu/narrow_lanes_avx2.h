/* Internal: fp32 -> narrow float magnitude codes in AVX2 lanes, the
 * rounding add of narrow_lanes_avx512.h (which says why it is
 * moe_f32_to_narrow's rounding) with its addend computed instead of looked
 * up (vpermd has 8 entries; e4m3fn spans 15 binades, e5m2 30):
 * m(E) = e + (e >> (23 - mbits)) + c, e = a's exponent bits clamped up to
 * 2^Emin, c = ((23 - mbits) << 23) - (bits(2^Emin) >> (23 - mbits)). For the
 * quant ops' AVX2 lane code (quant_encode_avx2.c, quant_mx.c). */
#ifndef MOE_CPU_NARROW_LANES_AVX2_H
#define MOE_CPU_NARROW_LANES_AVX2_H

#include <immintrin.h>

#include "moe/codec.h"

#define NARROW_AVX2_TARGET __attribute__((target("avx2"), always_inline))

typedef struct narrow_avx2 {
  __m256 max_finite;
  __m256i min_normal, add; /* bits(2^Emin), c */
  __m128i shift;           /* 23 - mbits */
} narrow_avx2;

static inline NARROW_AVX2_TARGET narrow_avx2 narrow_avx2_of(const moe_narrow_fmt *fmt) {
  const int sh = 23 - fmt->mbits, min_exp = (128 - fmt->bias) << 23;
  narrow_avx2 L = {_mm256_set1_ps(fmt->max_finite), _mm256_set1_epi32(min_exp),
                   _mm256_set1_epi32((sh << 23) - (min_exp >> sh)), _mm_cvtsi32_si128(sh)};
  return L;
}

/* The magnitude code of a (>= 0; NaN: see the callers) in the low byte of
 * each lane, the bits above it cleared. `clamped`: a is already <= max
 * finite, or past it on purpose (a NaN marker). */
static inline NARROW_AVX2_TARGET __m256i narrow_avx2_mag(__m256 a, const narrow_avx2 *L, bool half_up,
                                                         bool clamped) {
  if (!clamped) a = _mm256_min_ps(L->max_finite, a); /* satfinite; operand order: NaN stays NaN */
  __m256i ai = _mm256_castps_si256(a);
  const __m256i e = _mm256_max_epu32(_mm256_and_si256(ai, _mm256_set1_epi32(0x7F800000)), L->min_normal);
  const __m256i m = _mm256_add_epi32(_mm256_add_epi32(e, _mm256_srl_epi32(e, L->shift)), L->add);
  if (half_up) ai = _mm256_or_si256(ai, _mm256_set1_epi32(1));
  const __m256i t = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(ai), _mm256_castsi256_ps(m)));
  return _mm256_and_si256(t, _mm256_set1_epi32(0xFF));
}

/* The low bytes of four vectors of 8 dword lanes (elements 0-7, 8-15, 16-23,
 * 24-31; each lane <= 0xFF) as 32 bytes in element order: after the two packs
 * dword d of 128-bit lane l holds elements 8 d + 4 l .. + 3. */
static inline NARROW_AVX2_TARGET __m256i narrow_avx2_pack(const __m256i c[4]) {
  return _mm256_permutevar8x32_epi32(
      _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 32 16-bit values (x0: elements 0-15, x1: 16-31) shifted right by `shift`
 * (>= 8), one byte each in element order: with 8, bit 7 is the sign. */
static inline NARROW_AVX2_TARGET __m256i narrow_avx2_high_bytes(__m256i x0, __m256i x1, int shift) {
  const __m128i n = _mm_cvtsi32_si128(shift);
  return _mm256_permute4x64_epi64(_mm256_packus_epi16(_mm256_srl_epi16(x0, n), _mm256_srl_epi16(x1, n)),
                                  0xD8);
}

#endif
