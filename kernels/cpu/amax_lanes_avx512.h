/* Internal: the 16-bit maxima of 16 registers at once, for the quant ops'
 * AVX-512 amax passes (quant_mx.c's blocks, quant_encode_avx512.c's units).
 * A tree of vertical maxes that halves each register's lanes while it
 * merges the registers: 256-bit halves, 128-bit quarters (vshufi64x2),
 * 64-bit (vpunpck*qdq), 32-bit (vshufps) and the two words of a dword,
 * about 4 ops per register instead of a reduction of its own (~13); the
 * registers end up in dword lanes 4k + j = register k + 4j, which one vpermd
 * puts in order. */
#ifndef MOE_CPU_AMAX_LANES_AVX512_H
#define MOE_CPU_AMAX_LANES_AVX512_H

#include <immintrin.h>

#define AMAX_LANES_TARGET __attribute__((target("avx512f,avx512bw"), always_inline))

/* Dword lane k: the unsigned 16-bit max of r[k]'s 32 words in its low word
 * (the high word is not specified). Overwrites r. */
static inline AMAX_LANES_TARGET __m512i amax_lanes_max16(__m512i r[16]) {
  for (int b = 0; b < 16; b += 2) /* [r b, r b + 1], 16 words each */
    r[b / 2] = _mm512_max_epu16(_mm512_shuffle_i64x2(r[b], r[b + 1], 0x44),
                                _mm512_shuffle_i64x2(r[b], r[b + 1], 0xEE));
  for (int b = 0; b < 8; b += 2) /* r 4i .. 4i + 3 in the 128-bit lanes, 8 words each */
    r[b / 2] = _mm512_max_epu16(_mm512_shuffle_i64x2(r[b], r[b + 1], 0x88),
                                _mm512_shuffle_i64x2(r[b], r[b + 1], 0xDD));
  for (int b = 0; b < 4; b += 2) /* lane k: r 8i + k, 8i + k + 4, 4 words each */
    r[b / 2] = _mm512_max_epu16(_mm512_unpacklo_epi64(r[b], r[b + 1]), _mm512_unpackhi_epi64(r[b], r[b + 1]));
  const __m512 g = _mm512_castsi512_ps(r[0]), h = _mm512_castsi512_ps(r[1]);
  __m512i m = _mm512_max_epu16(_mm512_castps_si512(_mm512_shuffle_ps(g, h, _MM_SHUFFLE(2, 0, 2, 0))),
                               _mm512_castps_si512(_mm512_shuffle_ps(g, h, _MM_SHUFFLE(3, 1, 3, 1))));
  m = _mm512_max_epu16(m, _mm512_srli_epi32(m, 16)); /* the register's max in the dword's low word */
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), m);
}

#endif
