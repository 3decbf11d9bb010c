/* Internal: fp32 -> narrow float magnitude codes in AVX-512 lanes by one
 * rounding add, for the quant ops' lane encoders (quant_encode_avx512.c,
 * quant_mx.c). The codes are moe_f32_to_narrow's (codec.h), bit for bit.
 *
 * For a >= 0 in binade E (E clamped up to the format's smallest normal
 * binade Emin), m(E) = 2^(E + 23 - mbits) + ((E - Emin) << mbits) ulps has
 * ulp(m) = the format's step in that binade, so the one IEEE add a + m rounds
 * a to the grid (ties to even: the added offset is a multiple of 2^mbits,
 * even; half_up: a's lowest bit set first lifts exact ties, and no other
 * value, over the midpoint) and the low bits of the sum are the magnitude
 * code: the steps of a in its binade plus the codes of the binades below. A
 * value that rounds up into the next binade lands on that binade's first
 * code. m(E) comes from a table indexed by the biased exponent mod 16
 * (vpermd) or mod 32 (vpermt2d, e5m2's 30 binades): the clamped binades Emin
 * .. Emin + 15 (31) fill it without collision. Saturation is a min on a
 * before the add (rounding a clamped value equals saturating the rounded one:
 * max finite is on the grid). About 6 lane ops instead of the codec's ~16. */
#ifndef MOE_CPU_NARROW_LANES_AVX512_H
#define MOE_CPU_NARROW_LANES_AVX512_H

#include <immintrin.h>

#include "moe/codec.h"

#define NARROW_LANES_TARGET __attribute__((target("avx512f"), always_inline))

typedef struct narrow_lanes {
  __m512 max_finite;
  __m512i min_normal; /* bits of 2^Emin */
  __m512i table[2];   /* m(E) by (127 + E) mod 32: lanes 0-15, 16-31 */
  bool wide;          /* more than 16 binades: the 32-entry table */
} narrow_lanes;

static inline NARROW_LANES_TARGET narrow_lanes narrow_lanes_of(const moe_narrow_fmt *fmt) {
  narrow_lanes L;
  const int emin = 1 - fmt->bias, sh = 23 - fmt->mbits;
  L.wide = fmt->emax - emin + 1 > 16;
  const int span = L.wide ? 32 : 16;
  for (int h = 0; h < 2; h++) {
    /* lane k of half h: the binade E in [emin, emin + span) with (127 + E) mod span == 16h + k */
    const __m512i k = _mm512_add_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16 * h));
    const __m512i steps =
        _mm512_and_si512(_mm512_sub_epi32(k, _mm512_set1_epi32(127 + emin)), _mm512_set1_epi32(span - 1));
    L.table[h] =
        _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(steps, _mm512_set1_epi32(127 + emin + sh)), 23),
                         _mm512_sll_epi32(steps, _mm_cvtsi32_si128(fmt->mbits)));
  }
  L.min_normal = _mm512_set1_epi32((127 + emin) << 23);
  L.max_finite = _mm512_set1_ps(fmt->max_finite);
  return L;
}

/* The magnitude code of a (>= 0, or NaN: see the callers) in the low bits of
 * each lane (above them: m's exponent). `clamped`: a is already <= max
 * finite (or the caller wants a value past it, e.g. a NaN marker). */
static inline NARROW_LANES_TARGET __m512i narrow_lanes_mag(__m512 a, const narrow_lanes *L, bool half_up,
                                                           bool clamped) {
  if (!clamped) a = _mm512_min_ps(L->max_finite, a); /* operand order: NaN stays NaN */
  const __m512i e = _mm512_srli_epi32(_mm512_max_epu32(_mm512_castps_si512(a), L->min_normal), 23);
  const __m512i m = L->wide ? _mm512_permutex2var_epi32(L->table[0], e, L->table[1])
                            : _mm512_permutexvar_epi32(e, L->table[0]);
  if (half_up) a = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_set1_epi32(1)));
  return _mm512_castps_si512(_mm512_add_ps(a, _mm512_castsi512_ps(m)));
}

#endif
