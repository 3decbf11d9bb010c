/* CPU: the codes of the scaled quant ops (docs/numerics.md quant.per_tensor,
 * quant.per_token, quant.per_token_group) in AVX-512 lanes, 64 elements a
 * step, taken where the CPU has AVX-512 with VBMI (moe_cpu_quant_isa). The
 * results are moe_f32_to_narrow's and moe_f32_to_int8's (codec.h) bit for
 * bit; test_quant_ops compares them with the C loops on every fp16/bf16
 * pattern. The C encoders spend ~16 lane ops per 16 elements plus a
 * 32 -> 8 bit pack of 2 uops; these spend ~7 and a pack of under 1.
 *
 * fp8 (e4m3fn, e4m3fnuz), on a = |x * r|:
 * - a = min(max finite, a) (inf and beyond saturate; NaN stays NaN), then
 *   min(a, N) with N the value of magnitude code max_mag + 1 (480 for
 *   e4m3fn, 256 for e4m3fnuz): only NaN becomes N, whose code is then the
 *   format's NaN code (0x7F, 0x80).
 * - the magnitude code by one rounding add (narrow_lanes_avx512.h).
 * - the low bytes of four such vectors packed by two vpermt2b (VBMI), the
 *   sign bits of 64 inputs by one more and merged by one vpternlogd; then
 *   e4m3fn's NaN with a sign (0xFF) back to 0x7F, e4m3fnuz's -0 to 0x00.
 * int8, on v = x * r with its sign: min(127, v), max(-128, v) (NaN stays
 * NaN), vcvtps2dq with round-to-nearest-even encoded in the instruction (so
 * MXCSR cannot change it): NaN converts to 0x80000000, whose low byte is the
 * NaN code 0; the low bytes packed as for fp8. Clamping before rounding
 * equals saturating after it, the bounds being integers. */
#include <immintrin.h>

#include "../ops/op.h"
#include "amax_lanes_avx512.h"
#include "cpu.h"
#include "narrow_lanes_avx512.h"

#define VBMI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,f16c")))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* What the loop needs of the output format, built once per call. */
typedef struct lanes {
  __m512 hi, nan;      /* fp8: max finite, N; int8: 127, -128 */
  narrow_lanes narrow; /* fp8 */
  __m512i order;       /* vpermt2b index: byte 0 of each dword of two vectors, in element order */
  __m512i sign_idx;
} lanes;

/* 64 elements widened to fp32 in v[0..3]; the bytes of their sign bits in
 * the order of the elements, bit 7 (fp8 only). bf16: the even elements by a
 * shift, the odd ones by a mask (v[0], v[2] even, v[1], v[3] odd; `order`
 * interleaves them back); fp16: vcvtph2ps (exact; a NaN's payload is quieted,
 * and any NaN encodes to the NaN code); fp32: as loaded. */
VBMI ALWAYS_INLINE void load64(const void *x, moe_dtype xt, size_t i, bool abs, const lanes *L, __m512 v[4],
                               __m512i *sign) {
  if (xt == MOE_F32) {
    const float *f = (const float *)x + i;
    __m512i u[4];
    for (int k = 0; k < 4; k++)
      u[k] = _mm512_loadu_si512(f + 16 * k);
    if (abs) {
      const __m512i idx3 = _mm512_add_epi8(L->order, _mm512_set1_epi8(3)); /* byte 3: the sign */
      *sign = _mm512_mask_blend_epi64(0xF0, _mm512_permutex2var_epi8(u[0], idx3, u[1]),
                                      _mm512_permutex2var_epi8(u[2], idx3, u[3]));
      for (int k = 0; k < 4; k++)
        u[k] = _mm512_and_si512(u[k], _mm512_set1_epi32(0x7FFFFFFF));
    }
    for (int k = 0; k < 4; k++)
      v[k] = _mm512_castsi512_ps(u[k]);
    return;
  }
  const uint16_t *h = (const uint16_t *)x + i;
  __m512i w[2] = {_mm512_loadu_si512(h), _mm512_loadu_si512(h + 32)};
  if (abs) {
    *sign = _mm512_permutex2var_epi8(w[0], L->sign_idx, w[1]);
    w[0] = _mm512_and_si512(w[0], _mm512_set1_epi16(0x7FFF));
    w[1] = _mm512_and_si512(w[1], _mm512_set1_epi16(0x7FFF));
  }
  for (int k = 0; k < 2; k++)
    if (xt == MOE_BF16) {
      v[2 * k] = _mm512_castsi512_ps(_mm512_slli_epi32(w[k], 16));
      v[2 * k + 1] = _mm512_castsi512_ps(_mm512_and_si512(w[k], _mm512_set1_epi32((int)0xFFFF0000u)));
    } else {
      v[2 * k] = _mm512_cvtph_ps(_mm512_castsi512_si256(w[k]));
      v[2 * k + 1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w[k], 1));
    }
}

/* One vector's codes in the low byte of each lane. */
VBMI ALWAYS_INLINE __m512i code16(__m512 v, __m512 mul, int out, bool exact, const lanes *L) {
  const __m512 y = exact ? _mm512_div_ps(v, mul) : _mm512_mul_ps(v, mul);
  if (out == MOE_SCALED_INT8) {
    const __m512 c = _mm512_max_ps(L->nan, _mm512_min_ps(L->hi, y)); /* operand order keeps NaN */
    return _mm512_cvt_roundps_epi32(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  const __m512 a = _mm512_min_ps(_mm512_min_ps(L->hi, y), L->nan); /* NaN -> N */
  return narrow_lanes_mag(a, &L->narrow, false, true);
}

/* The codes of the 64 elements at x[i]: the first 32 scaled by mul[0], the
 * others by mul[1] (s[u] when exact, else r[u]). */
VBMI ALWAYS_INLINE void step64(const void *x, moe_dtype xt, size_t i, const __m512 mul[2], int out,
                               bool exact, const lanes *L, moe_cpu_ahead ahead, bool stream, uint8_t *q) {
  const bool fp8 = out != MOE_SCALED_INT8;
  __m512 v[4];
  __m512i sign = _mm512_setzero_si512(), c[4];
  const size_t es = xt == MOE_F32 ? 4 : 2;
  for (size_t l = 0; l < 64 * es; l += 64) /* the input `ahead` bytes ahead */
    moe_cpu_prefetch((const char *)x + i * es + l, ahead);
  load64(x, xt, i, fp8, L, v, &sign);
  for (int k = 0; k < 4; k++) /* v[0], v[1] hold elements of the first 32 (load64) */
    c[k] = code16(v[k], mul[k / 2], out, exact, L);
  __m512i b = _mm512_mask_blend_epi64(0xF0, _mm512_permutex2var_epi8(c[0], L->order, c[1]),
                                      _mm512_permutex2var_epi8(c[2], L->order, c[3]));
  if (out ==
      MOE_SCALED_FP4) { /* the sign to bit 3 (a 16-bit shift moves each byte's bit 7 there), then
                         * each byte pair into one byte, low nibble first; -0 kept, as every MX format */
    b = _mm512_ternarylogic_epi32(b, _mm512_srli_epi16(sign, 4), _mm512_set1_epi8(0x08), 0xF8);
    const __m256i packed = _mm512_cvtepi16_epi8(_mm512_or_si512(b, _mm512_srli_epi16(b, 4)));
    _mm256_storeu_si256((__m256i *)(q + i / 2), packed);
    return;
  }
  if (fp8) {
    const __m512i mag = b;
    b = _mm512_ternarylogic_epi32(mag, sign, _mm512_set1_epi8((char)0x80), 0xF8); /* mag | (sign & 0x80) */
    if (out == MOE_SCALED_FP8_NEG_ZERO) /* NaN's code has no sign: 0xFF -> 0x7F */
      b = _mm512_mask_blend_epi8(_mm512_cmpeq_epi8_mask(b, _mm512_set1_epi8(-1)), b, _mm512_set1_epi8(0x7F));
    else /* no -0: a zero magnitude drops its sign */
      b = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(mag, mag), b);
  }
  if (stream && !((uintptr_t)(q + i) & 63)) /* a whole line, written around the cache */
    _mm512_stream_si512((void *)(q + i), b);
  else
    _mm512_storeu_si512(q + i, b);
}

/* Units [0, units) of g elements, unit u scaled by s[u] (exact) or r[u]:
 * the leading multiple of 64 of each; g == 32 (quant.mx's blocks) with
 * `units` even: the units in pairs, a step each (odd: none, 0). */
VBMI ALWAYS_INLINE size_t encode_loop(const void *x, moe_dtype xt, size_t units, size_t g, const float *s,
                                      const float *r, int out, bool exact, const lanes *L,
                                      moe_cpu_ahead ahead, bool stream, uint8_t *q) {
  const float *m = exact ? s : r;
  size_t n = g / 64 * 64;
  if (g == 32 && units % 2 == 0) {
    for (size_t u = 0; u + 1 < units; u += 2)
      step64(x, xt, u * 32, (const __m512[2]){_mm512_set1_ps(m[u]), _mm512_set1_ps(m[u + 1])}, out, exact, L,
             ahead, stream, q);
    n = 32;
  } else {
    for (size_t u = 0; u < units; u++) {
      const __m512 mul = _mm512_set1_ps(m[u]);
      for (size_t i = u * g, end = i + n; i < end; i += 64)
        step64(x, xt, i, (const __m512[2]){mul, mul}, out, exact, L, ahead, stream, q);
    }
  }
  if (stream) _mm_sfence(); /* the streamed lines ordered before the caller's later stores */
  return n;
}

/* vpermt2b indices. Output byte j (j < 32) of a pack of two vectors of codes: bf16 takes element j
 * from vector j & 1 (even/odd), lane j / 2; fp16 and fp32 from vector j / 16, lane j % 16; the
 * second half alike (its vpermt2b fills bytes 32..63 from the next two vectors). Bit 6 picks the
 * second vector; a lane's low byte is at 4 * lane. */
#define ORDER_BF16_32                                                                                        \
  0, 64, 4, 68, 8, 72, 12, 76, 16, 80, 20, 84, 24, 88, 28, 92, 32, 96, 36, 100, 40, 104, 44, 108, 48, 112,   \
      52, 116, 56, 120, 60, 124
#define ORDER_NATURAL_32                                                                                     \
  0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 96, 100, 104, \
      108, 112, 116, 120, 124
static const uint8_t order_bf16[64] = {ORDER_BF16_32, ORDER_BF16_32};
static const uint8_t order_natural[64] = {ORDER_NATURAL_32, ORDER_NATURAL_32};
/* the high byte (sign, exponent) of 16-bit element j of two vectors: byte 2j + 1 */
static const uint8_t sign_idx[64] = {
    1,  3,  5,  7,  9,  11, 13,  15,  17,  19,  21,  23,  25,  27,  29,  31,  33,  35,  37,  39, 41, 43,
    45, 47, 49, 51, 53, 55, 57,  59,  61,  63,  65,  67,  69,  71,  73,  75,  77,  79,  81,  83, 85, 87,
    89, 91, 93, 95, 97, 99, 101, 103, 105, 107, 109, 111, 113, 115, 117, 119, 121, 123, 125, 127};

VBMI size_t moe_cpu_encode_scaled_avx512(const void *x, moe_dtype xt, size_t units, size_t g, const float *s,
                                         const float *r, bool exact, bool int8, const moe_narrow_fmt *fmt,
                                         moe_cpu_ahead ahead, bool stream, uint8_t *q) {
  lanes L;
  float hi, lo;
  const int out = moe_cpu_scaled_kind(int8, fmt, &hi, &lo);
  const bool fp4 = out == MOE_SCALED_FP4;
  if (out < 0 || (fp4 && (g != 32 || (xt != MOE_BF16 && xt != MOE_F16)))) return 0;
  L.hi = _mm512_set1_ps(hi);
  L.nan = _mm512_set1_ps(lo);
  if (!int8) L.narrow = narrow_lanes_of(fmt);
  L.order = _mm512_loadu_si512(xt == MOE_BF16 ? order_bf16 : order_natural);
  L.sign_idx = _mm512_loadu_si512(sign_idx);
  /* one straight loop per (input dtype, output kind) */
#define ENCODE(XT, OUT) encode_loop(x, XT, units, g, s, r, OUT, exact, &L, ahead, stream, q)
  if (fp4) return xt == MOE_BF16 ? ENCODE(MOE_BF16, MOE_SCALED_FP4) : ENCODE(MOE_F16, MOE_SCALED_FP4);
  MOE_CPU_SCALED_DISPATCH(xt, out, ENCODE)
#undef ENCODE
}

/* ---- the amaxes of 16-bit units ------------------------------------------------------- */
/* The max of |h| over a unit's finite elements in 16-bit lanes: first over
 * every element (one vpand and one vpmaxuw per 32: half the work of the C
 * loop's vectorized compare-and-select), and only for a unit whose max is
 * then inf or NaN, again with the non-finite elements masked out. |h| orders
 * like the values, so the max bits are the amax's. The units' maxima by the
 * tree of amax_lanes_avx512.h, 16 at a time. */
#define V512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c")))

/* The 32-word max of |h| over h[0, g): every element (`finite` false) or
 * those below `inf` (the exponent field all ones). Tail by a masked load. */
V512 ALWAYS_INLINE __m512i unit_max(const uint16_t *h, size_t g, bool finite, uint16_t inf,
                                    moe_cpu_ahead ahead) {
  const __m512i abs = _mm512_set1_epi16(0x7FFF), lim = _mm512_set1_epi16((short)inf);
  __m512i m[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}; /* two chains */
  size_t i = 0;
  for (; i + 64 <= g; i += 64)
    for (int k = 0; k < 2; k++) {
      moe_cpu_prefetch(h + i + 32 * k, ahead);
      const __m512i a = _mm512_and_si512(_mm512_loadu_si512(h + i + 32 * k), abs);
      m[k] = finite ? _mm512_mask_max_epu16(m[k], _mm512_cmplt_epu16_mask(a, lim), m[k], a)
                    : _mm512_max_epu16(m[k], a);
    }
  for (; i < g; i += 32) {
    const size_t left = g - i;
    const __mmask32 k = left >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << left) - 1u);
    const __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi16(k, h + i), abs);
    m[0] = finite ? _mm512_mask_max_epu16(m[0], _mm512_cmplt_epu16_mask(a, lim), m[0], a)
                  : _mm512_max_epu16(m[0], a);
  }
  return _mm512_max_epu16(m[0], m[1]);
}

V512 size_t moe_cpu_amax_units_avx512(const void *x, moe_dtype xt, size_t units, size_t g,
                                      moe_cpu_ahead ahead, float *amax) {
  if (xt != MOE_BF16 && xt != MOE_F16) return 0;
  const uint16_t *h = x;
  const uint16_t inf = xt == MOE_BF16 ? 0x7F80 : 0x7C00;
  for (size_t u0 = 0; u0 < units; u0 += 16) {
    const size_t nu = units - u0 < 16 ? units - u0 : 16;
    __m512i r[16];
    for (size_t k = 0; k < 16; k++)
      r[k] = k < nu ? unit_max(h + (u0 + k) * g, g, false, inf, ahead) : _mm512_setzero_si512();
    __m512i m = _mm512_and_si512(amax_lanes_max16(r), _mm512_set1_epi32(0xFFFF));
    const __mmask16 live = (__mmask16)((1u << nu) - 1u);
    __mmask16 bad = _mm512_mask_cmpge_epu32_mask(live, m, _mm512_set1_epi32(inf));
    while (bad) { /* a NaN or inf in unit k: its finite elements' max, by the tree of one */
      const unsigned k = (unsigned)__builtin_ctz(bad);
      bad &= (__mmask16)(bad - 1);
      __m512i one[16] = {unit_max(h + (u0 + k) * g, g, true, inf, ahead)};
      for (int j = 1; j < 16; j++)
        one[j] = _mm512_setzero_si512();
      const __m512i mk = _mm512_and_si512(amax_lanes_max16(one), _mm512_set1_epi32(0xFFFF));
      m = _mm512_mask_permutexvar_epi32(m, (__mmask16)(1u << k), _mm512_setzero_si512(), mk);
    }
    const __m512 f = xt == MOE_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(m, 16))
                                    : _mm512_cvtph_ps(_mm512_cvtepi32_epi16(m)); /* exact */
    _mm512_mask_storeu_ps(amax + u0, live, f);
  }
  return units;
}
