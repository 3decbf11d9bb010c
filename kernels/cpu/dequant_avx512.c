/* CPU: the dequant ops' lanes in AVX-512 (docs/numerics.md dequant.per_tensor,
 * dequant.mx), taken where the CPU has them (moe_cpu_quant_isa); the C loops
 * of quant_scaled.c and quant_mx.c take the rest and are the reference these
 * equal bit for bit (test_quant_ops: every code with every scale byte, and
 * codes with hundreds of per-tensor scales, against the C path).
 *
 * The C loops spend ~2 cycles an element on a table load and a store each
 * (GCC does not turn the 16-bit output's rounding and the table lookups
 * into lanes): dequant.mx ran at 17-21% of memcpy, dequant.per_tensor at
 * ~55% (bench/RESULTS.md). Here:
 * - dequant.per_tensor to fp16/bf16: the call's table of finished outputs
 *   (256 codes -> 16 bits) split into a low-byte and a high-byte plane of
 *   four vectors each; 64 codes look both up with two vpermt2b per plane
 *   (7 index bits) and a blend on bit 7, and two more vpermt2b interleave
 *   the planes into 64 outputs: ~9 lane ops for 64 elements (VBMI).
 * - dequant.mx, fp4: a block's 16 possible outputs computed in one vector
 *   (value x scale, rounded), the 32 nibbles spread to bytes in element
 *   order and looked up by one vpermw (16-bit outputs) or two vpermps.
 * - dequant.mx, fp8: to bf16 with VBMI, a table lookup as per_tensor's and
 *   the block's power of two added to the exponent field where that is
 *   exact (dequant_fp8_bf16); else the codes' values computed in lanes
 *   (dequant_fp8), times the block's scale, rounded there. A gather from
 *   the table of values ran at ~1.1 cycles an element on Zen 4. */
#include <immintrin.h>

#include "../ops/op.h"
#include "cpu.h"

#define V512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c")))
#define VBMI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,f16c")))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { BLOCK = 32 }; /* elements per mx block */

/* The 16-bit output bits of fp32 lanes, in the low half of each lane:
 * moe_f32_to_bf16 (RNE on the bits, every NaN 0x7FC0) or moe_f32_to_f16
 * (vcvtps2ph's IEEE RNE: subnormals, overflow to inf; every NaN 0x7E00). */
V512 ALWAYS_INLINE __m512i half_bits(__m512 v, moe_dtype yt) {
  const __m512i u = _mm512_castps_si512(v);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  if (yt == MOE_BF16) {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  }
  const __m512i r = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7E00));
}

/* ---- dequant.per_tensor ------------------------------------------------------------- */

/* vpermt2b index of output word k of a pair of planes: byte 2k the low
 * plane's byte k, byte 2k + 1 the high plane's (bit 6: the second operand);
 * `half` 1: words 32..63 */
#define INTERLEAVE_8(k) (k), 64 + (k), (k) + 1, 65 + (k), (k) + 2, 66 + (k), (k) + 3, 67 + (k)
#define INTERLEAVE_32(h)                                                                                     \
  INTERLEAVE_8(32 * (h)), INTERLEAVE_8(32 * (h) + 4), INTERLEAVE_8(32 * (h) + 8),                            \
      INTERLEAVE_8(32 * (h) + 12), INTERLEAVE_8(32 * (h) + 16), INTERLEAVE_8(32 * (h) + 20),                 \
      INTERLEAVE_8(32 * (h) + 24), INTERLEAVE_8(32 * (h) + 28)
static const uint8_t interleave[2][64] = {{INTERLEAVE_32(0)}, {INTERLEAVE_32(1)}};

void moe_cpu_lut16_plan(const uint16_t table[256], moe_cpu_dequant_plan *p) {
  for (int c = 0; c < 256; c++) {
    p->lo[c] = (uint8_t)table[c];
    p->hi[c] = (uint8_t)(table[c] >> 8);
  }
}

/* The plan's byte planes as four vectors each, and the interleaving indices. */
typedef struct lut16 {
  __m512i lo[4], hi[4], i0, i1;
} lut16;

VBMI ALWAYS_INLINE lut16 lut16_of(const moe_cpu_dequant_plan *p) {
  lut16 t;
  for (int k = 0; k < 4; k++) {
    t.lo[k] = _mm512_loadu_si512(p->lo + 64 * k);
    t.hi[k] = _mm512_loadu_si512(p->hi + 64 * k);
  }
  t.i0 = _mm512_loadu_si512(interleave[0]);
  t.i1 = _mm512_loadu_si512(interleave[1]);
  return t;
}

/* One byte plane's lookup of 64 codes: 128 entries a vpermt2b, bit 7 picks. */
VBMI ALWAYS_INLINE __m512i plane_lookup(const __m512i t[4], __m512i c, __mmask64 high) {
  return _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t[0], c, t[1]),
                                _mm512_permutex2var_epi8(t[2], c, t[3]));
}

/* The outputs of 64 codes: y[0] the first 32, y[1] the others. */
VBMI ALWAYS_INLINE void lut16_lookup(const lut16 *t, __m512i c, __m512i y[2]) {
  const __mmask64 high = _mm512_movepi8_mask(c);
  const __m512i l = plane_lookup(t->lo, c, high), h = plane_lookup(t->hi, c, high);
  y[0] = _mm512_permutex2var_epi8(l, t->i0, h);
  y[1] = _mm512_permutex2var_epi8(l, t->i1, h);
}

VBMI size_t moe_cpu_lut16_avx512(const uint8_t *q, const moe_cpu_dequant_plan *p, size_t n, uint16_t *y) {
  const lut16 t = lut16_of(p);
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512i v[2];
    lut16_lookup(&t, _mm512_loadu_si512(q + i), v);
    _mm512_storeu_si512(y + i, v[0]);
    _mm512_storeu_si512(y + i + 32, v[1]);
  }
  return i;
}

/* ---- dequant.mx ---------------------------------------------------------------------- */

/* Stores 16 outputs of fp32 lanes p at element i of y (yt's width). */
V512 ALWAYS_INLINE void store16(void *y, moe_dtype yt, size_t i, __m512 p) {
  if (yt == MOE_F32)
    _mm512_storeu_ps((float *)y + i, p);
  else
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + i), _mm512_cvtepi32_epi16(half_bits(p, yt)));
}

V512 ALWAYS_INLINE void dequant_fp4(const uint8_t *q, size_t b0, size_t b1, const uint8_t *scales,
                                    const float *value, moe_dtype yt, void *y) {
  const __m512 vals = _mm512_loadu_ps(value); /* the 16 codes' values */
  for (size_t b = b0; b < b1; b++) {
    const __m512 t = _mm512_mul_ps(vals, _mm512_set1_ps(moe_e8m0_to_f32(scales[b])));
    /* element 2j: byte j's low nibble, 2j + 1: its high one */
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + b * (BLOCK / 2)));
    const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    const __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi); /* elements 0-15, 16-31 */
    if (yt == MOE_F32) {
      _mm512_storeu_ps((float *)y + b * BLOCK, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c0), t));
      _mm512_storeu_ps((float *)y + b * BLOCK + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c1), t));
    } else { /* the 16 outputs as words 0-15 of a vector; vpermw with the codes as word indices */
      const __m512i table = _mm512_zextsi256_si512(_mm512_cvtepi32_epi16(half_bits(t, yt)));
      const __m512i idx = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(c0), c1, 1));
      _mm512_storeu_si512((uint16_t *)y + b * BLOCK, _mm512_permutexvar_epi16(idx, table));
    }
  }
}

/* fp8 codes' values in lanes: the magnitude bits moved to fp32's exponent
 * and mantissa position read as the value times 2^(bias - 127) (normal
 * codes on normal floats, subnormal ones on subnormal floats, both exact),
 * so one exact multiply by 2^(127 - bias) scales them, and the sign is or-ed
 * in (as moe_e4m3fn_to_f32). Magnitudes from `special` on (NaN, inf: where
 * this differs from the table; 0x7F for e4m3fn, 0x7C
 * for e5m2) take the table's value of their code by a vpermt2ps from the
 * table's codes 0x70-0x7F and 0xF0-0xFF, index (c & 0xF) | sign << 4
 * (moe_cpu_dequant_mx_plan finds `special` and refuses a format where it is
 * below 0x70).
 * Branch-free: random codes (the bench's) hold a NaN in one vector in eight,
 * and a masked gather there cost more than the lookup everywhere. */
V512 ALWAYS_INLINE void dequant_fp8(const uint8_t *q, size_t b0, size_t b1, const uint8_t *scales,
                                    const float *value, const moe_cpu_dequant_plan *f, moe_dtype yt,
                                    void *y) {
  const __m512i mag_mask = _mm512_set1_epi32(0x7F << f->shift),
                special = _mm512_set1_epi32(f->special << f->shift);
  const __m512 unbias = _mm512_set1_ps(f->unbias), hi0 = _mm512_loadu_ps(value + 0x70),
               hi1 = _mm512_loadu_ps(value + 0xF0); /* the values of codes 0x70-0x7F, 0xF0-0xFF */
  for (size_t b = b0; b < b1; b++) {
    const __m512 s = _mm512_set1_ps(moe_e8m0_to_f32(scales[b]));
    for (size_t k = 0; k < BLOCK; k += 16) {
      const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + b * BLOCK + k)));
      const __m512i mag = _mm512_and_si512(_mm512_slli_epi32(c, f->shift), mag_mask);
      const __m512 v = _mm512_castsi512_ps(
          _mm512_or_si512(_mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(mag), unbias)),
                          _mm512_and_si512(_mm512_slli_epi32(c, 24), _mm512_set1_epi32((int)0x80000000u))));
      /* (c & 0xF) | (c >> 3 & ~0xF), ternary 0xE4 = (A & C) | (B & ~C): c < 256, so c >> 3 is bit 4 at most
       */
      const __m512i idx =
          _mm512_ternarylogic_epi32(c, _mm512_srli_epi32(c, 3), _mm512_set1_epi32(0x0F), 0xE4);
      const __m512 t = _mm512_permutex2var_ps(hi0, idx, hi1);
      store16(y, yt, b * BLOCK + k,
              _mm512_mul_ps(_mm512_mask_mov_ps(v, _mm512_cmpge_epu32_mask(mag, special), t), s));
    }
  }
}

/* fp8 to bf16 where the CPU has VBMI: a block's scale is a power of two
 * 2^k, so for a finite nonzero code value v (4 significant bits at most)
 * the product v x 2^k is exact, and so is its bf16, as long as bf16(v)'s
 * exponent field plus k stays in [1, 254]: then the output is bf16(v) with
 * k added to that field, one 16-bit add. The bf16 of every code comes from
 * a 256-entry table (the byte-plane lookup of dequant.per_tensor); zeros,
 * NaN and inf keep their table value (times 2^k they stay what they are).
 * Pairs of such blocks (64 codes a lookup); any other block (the range left,
 * scale 0xFF's NaN) by dequant_fp8. */
/* Whether scale byte s takes the exponent add: 2^k in the plan's bounds (0xFF, NaN, never). */
static inline bool exponent_add(uint8_t s, const moe_cpu_dequant_plan *p) {
  return s != 0xFF && (int)s - 127 >= p->kmin && (int)s - 127 <= p->kmax;
}

VBMI static void dequant_fp8_bf16(const uint8_t *q, size_t b0, size_t b1, const uint8_t *scales,
                                  const float *value, const moe_cpu_dequant_plan *p, uint16_t *y) {
  const lut16 t = lut16_of(p);
  size_t b = b0;
  while (b < b1) {
    if (b + 1 >= b1 || !exponent_add(scales[b], p) || !exponent_add(scales[b + 1], p)) {
      dequant_fp8(q, b, b + 1, scales, value, p, MOE_BF16, y);
      b++;
      continue;
    }
    __m512i v[2];
    lut16_lookup(&t, _mm512_loadu_si512(q + b * BLOCK), v);
    const int k[2] = {(int)scales[b] - 127, (int)scales[b + 1] - 127};
    for (int h = 0; h < 2; h++) { /* the finite nonzero: 1 <= |bits| <= 0x7F7F */
      const __m512i a =
          _mm512_sub_epi16(_mm512_and_si512(v[h], _mm512_set1_epi16(0x7FFF)), _mm512_set1_epi16(1));
      const __mmask32 live = _mm512_cmplt_epu16_mask(a, _mm512_set1_epi16(0x7F7F));
      _mm512_storeu_si512(y + (b + (size_t)h) * BLOCK,
                          _mm512_mask_add_epi16(v[h], live, v[h], _mm512_set1_epi16((short)(k[h] * 128))));
    }
    b += 2;
  }
}

bool moe_cpu_dequant_mx_plan(const moe_narrow_fmt *fmt, const float *value, moe_dtype yt, bool vbmi,
                             moe_cpu_dequant_plan *p) {
  p->bf16_add = false;
  if (fmt->bits == 4) return true;
  /* the lane decode: the least magnitude from which it (the same operations,
   * in scalar) and the table may differ for either sign; 128 when they agree */
  p->shift = 23 - fmt->mbits;
  p->unbias = moe_pow2f(127 - fmt->bias);
  p->special = 128;
  for (int mag = 127; mag >= 0; mag--)
    for (uint32_t sign = 0; sign < 2; sign++) {
      const float m = moe_f32_from_bits((uint32_t)mag << p->shift) * p->unbias;
      if ((moe_f32_bits(m) | sign << 31) != moe_f32_bits(value[(uint32_t)mag | sign << 7])) p->special = mag;
    }
  if (p->special < 0x70) return false; /* specials outside the lookup's codes: no format of dequant.mx */
  if (!vbmi || yt != MOE_BF16) return true;
  /* the exponent add: the bf16 of every code, and the bounds of k over the
   * finite nonzero codes' bf16 exponent fields */
  uint16_t table[256];
  int emin = 255, emax = 0;
  for (int c = 0; c < 256; c++) {
    table[c] = moe_f32_to_bf16(value[c]);
    const int e = (table[c] >> 7) & 0xFF;
    if ((table[c] & 0x7FFF) != 0 && e != 0xFF) {
      emin = e < emin ? e : emin;
      emax = e > emax ? e : emax;
    }
  }
  moe_cpu_lut16_plan(table, p);
  p->kmin = 1 - emin;
  p->kmax = 254 - emax;
  p->bf16_add = true;
  return true;
}

V512 void moe_cpu_dequant_mx_avx512(const uint8_t *q, const uint8_t *scales, const float *value,
                                    const moe_narrow_fmt *fmt, const moe_cpu_dequant_plan *p, size_t b0,
                                    size_t b1, moe_dtype yt, void *y) {
  const bool fp4 = fmt->bits == 4;
  if (p->bf16_add) {
    dequant_fp8_bf16(q, b0, b1, scales, value, p, y);
    return;
  }
  /* one straight loop per (format width, output dtype) */
#define DEQUANT(YT)                                                                                          \
  fp4 ? dequant_fp4(q, b0, b1, scales, value, YT, y) : dequant_fp8(q, b0, b1, scales, value, p, YT, y)
  switch (yt) {
  case MOE_F16: DEQUANT(MOE_F16); break;
  case MOE_BF16: DEQUANT(MOE_BF16); break;
  default: DEQUANT(MOE_F32); break;
  }
#undef DEQUANT
}
