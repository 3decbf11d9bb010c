/* moe: scalar codecs of every number format in docs/numerics.md ("Common",
 * "Narrow formats", the scale rules of "quant.mx").
 *
 * One definition for every backend: this header compiles as C (CPU backend)
 * and as HIP/CUDA device code (GPU backend), so the bit-exact contract lives
 * in one place. Rounding is integer arithmetic, or one IEEE add of a power
 * of two to a bit-masked |x| (round to nearest even, the default mode; no
 * multiply to contract with; its result is normal, and a subnormal operand
 * rounds to zero either way), so no compiler flag (FMA contraction,
 * flush-to-zero) can change a result; the other float operations are single
 * multiplies and divisions, which IEEE fixes. */
#ifndef MOE_CODEC_H
#define MOE_CODEC_H

#include <stdbool.h>
#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MOE_HD __host__ __device__ static inline
#else
#define MOE_HD static inline
#endif

/* ---- fp32 bits ---------------------------------------------------------- */

MOE_HD uint32_t moe_f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
}

MOE_HD float moe_f32_from_bits(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

MOE_HD bool moe_f32_isnan(float f) { return (moe_f32_bits(f) & 0x7FFFFFFFu) > 0x7F800000u; }
MOE_HD bool moe_f32_isfinite(float f) { return (moe_f32_bits(f) & 0x7F800000u) != 0x7F800000u; }
MOE_HD float moe_f32_abs(float f) { return moe_f32_from_bits(moe_f32_bits(f) & 0x7FFFFFFFu); }

/* 2^e exactly, for e in [-149, 127] (subnormal powers included). */
MOE_HD float moe_pow2f(int e) {
  if (e >= -126) return moe_f32_from_bits((uint32_t)(e + 127) << 23);
  return moe_f32_from_bits(1u << (e + 149));
}

/* Rounds the 24-bit significand `mant` right by `shift` bits: round to
 * nearest, ties to even (half_up = false) or ties away from zero. */
MOE_HD uint32_t moe_round_shift(uint32_t mant, int shift, bool half_up) {
  if (shift <= 0) return mant << (-shift);
  if (shift > 25) return 0; /* below half of the smallest step */
  uint32_t n = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (half_up || (n & 1u)))) n++;
  return n;
}

/* ---- dynamic scales (quant.per_tensor, per_token, per_token_group) ------- */

/* s = amax / dtype_max, 1 when that is 0; pow2_up (per_token_group's
 * scale_rule) then rounds s up to a power of two through its bits. */
MOE_HD float moe_dynamic_scale(float amax, float dtype_max, bool pow2_up) {
  float s = amax / dtype_max;
  if (s == 0.0f) s = 1.0f;
  return pow2_up ? moe_f32_from_bits((moe_f32_bits(s) + 0x7FFFFFu) & 0x7F800000u) : s;
}

/* ---- bf16 / fp16 -------------------------------------------------------- */

MOE_HD float moe_bf16_to_f32(uint16_t h) { return moe_f32_from_bits((uint32_t)h << 16); }

/* RNE; overflow rounds to inf; NaN -> 0x7FC0. */
MOE_HD uint16_t moe_f32_to_bf16(float f) {
  uint32_t u = moe_f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Both fp16 conversions are branch-free (selects only) so that loops over
 * them vectorize. */
MOE_HD float moe_f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  const uint32_t normal = ((e + 112u) << 23) | (m << 13);
  /* inf, or NaN with its payload, quieted as IEEE widening (and F16C) does */
  const uint32_t special = 0x7F800000u | (m << 13) | (m ? 0x400000u : 0u);
  const uint32_t sub = moe_f32_bits((float)m * moe_f32_from_bits(0x33800000u)); /* m * 2^-24, exact */
  const uint32_t mag = e == 0 ? sub : (e == 0x1Fu ? special : normal);
  return moe_f32_from_bits(sign | mag);
}

/* RNE with subnormals; |x| >= 65520 -> inf; NaN -> 0x7E00. */
MOE_HD uint16_t moe_f32_to_f16(float f) {
  const uint32_t u = moe_f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  /* normal in fp16: rebias, round off 13 bits (a carry bumps the exponent) */
  uint32_t h = a - (112u << 23);
  h += 0xFFFu + ((h >> 13) & 1u);
  const uint32_t normal = h >> 13;
  /* below 2^-14: the step is 2^-24; scale exactly and round with the
   * 1.5 * 2^23 add (RNE). Clamped so the conversion stays in range for
   * the inputs this path does not serve. */
  float t = moe_f32_from_bits(a) * moe_f32_from_bits(0x4B800000u); /* * 2^24 */
  t = t < 2048.0f ? t : 2048.0f;
  const uint32_t sub = (uint32_t)(int32_t)((t + 12582912.0f) - 12582912.0f);
  uint32_t mag = a < 0x38800000u ? sub : normal;
  mag = a >= 0x477FF000u ? 0x7C00u : mag;
  return (uint16_t)(a > 0x7F800000u ? 0x7E00u : (sign | mag));
}

/* ---- narrow floats: fp8 e4m3fn / e4m3fnuz / e5m2, fp4 e2m1 --------------- */

typedef struct moe_narrow_fmt {
  int mbits;           /* mantissa bits */
  int bias;            /* exponent bias */
  int bits;            /* code width: 8, or 4 for fp4 */
  uint8_t max_mag;     /* magnitude code of the max finite value */
  int16_t nan_code;    /* code produced for NaN; -1: format has none */
  bool neg_zero;       /* false: -0 encodes as 0x00 (fnuz) */
  bool inf_codes;      /* e5m2: exponent field all ones is inf/NaN on decode */
  bool nan_is_max;     /* e4m3fn: magnitude 0x7F is NaN on decode */
  bool nan_is_negzero; /* fnuz: 0x80 is NaN on decode */
  float max_finite;
  int emax; /* floor(log2(max finite)): the MX emax */
} moe_narrow_fmt;

#define MOE_FMT_E4M3FN                                                                                       \
  { 3, 7, 8, 0x7E, 0x7F, true, false, true, false, 448.0f, 8 }
#define MOE_FMT_E4M3FNUZ                                                                                     \
  { 3, 8, 8, 0x7F, 0x80, false, false, false, true, 240.0f, 7 }
#define MOE_FMT_E5M2                                                                                         \
  { 2, 15, 8, 0x7B, 0x7F, true, true, false, false, 57344.0f, 15 }
#define MOE_FMT_E2M1                                                                                         \
  { 1, 1, 4, 0x7, -1, true, false, false, false, 6.0f, 2 }

/* fp32 -> fp4 e2m1 by counting the rounding boundaries |f| passes: with
 * only eight magnitudes this is seven compares (the GPU's portable path);
 * moe_f32_to_narrow gives the same codes for MOE_FMT_E2M1. A boundary that is
 * a tie counts when |f| reaches it if the tie goes up (to the even code, or
 * always with half_up), else only when |f| exceeds it. NaN passes none
 * (code 0); sign kept (-0 -> 0x8). */
MOE_HD uint8_t moe_f32_to_e2m1(float f, bool half_up) {
  const float a = moe_f32_abs(f);
  const uint32_t h = (uint32_t)half_up;
  uint32_t mag = (uint32_t)(a > 0.25f) | ((uint32_t)(a == 0.25f) & h); /* 0 | 0.5: tie to even 0 */
  mag += (uint32_t)(a >= 0.75f);                                       /* 0.5 | 1: tie to even 1 */
  mag += (uint32_t)(a > 1.25f) | ((uint32_t)(a == 1.25f) & h);         /* 1 | 1.5: tie to 1 */
  mag += (uint32_t)(a >= 1.75f);                                       /* 1.5 | 2: tie to 2 */
  mag += (uint32_t)(a > 2.5f) | ((uint32_t)(a == 2.5f) & h);           /* 2 | 3: tie to 2 */
  mag += (uint32_t)(a >= 3.5f);                                        /* 3 | 4: tie to 4 */
  mag += (uint32_t)(a > 5.0f) | ((uint32_t)(a == 5.0f) & h);           /* 4 | 6: tie to 4 */
  return (uint8_t)(((moe_f32_bits(f) >> 31) << 3) | mag);
}

/* fp32 -> narrow code: round to the format's grid (subnormals included;
 * ties to even, or away from zero with half_up), then satfinite; NaN -> the
 * NaN code (0 for fp4, which has none: MX handles NaN blocks before this).
 * About fifteen integer ops and one float add, no branches, every shift by
 * a loop-invariant amount, so a loop over it vectorizes. */
MOE_HD uint8_t moe_f32_to_narrow(float f, const moe_narrow_fmt *fmt, bool half_up) {
  const uint32_t s = 23u - (uint32_t)fmt->mbits;
  const uint32_t min_exp = (uint32_t)(128 - fmt->bias) << 23; /* 2^emin, the smallest normal */
  const uint32_t max_exp = (uint32_t)(127 + fmt->emax) << 23;
  const uint32_t u = moe_f32_bits(f);
  const uint32_t a = u & 0x7FFFFFFFu;
  /* |f|'s binade clamped to the format's normal range [emin, emax] */
  uint32_t e = a & 0x7F800000u;
  e = e > min_exp ? e : min_exp;
  e = e < max_exp ? e : max_exp;
  /* m = 2^(e + s): its ulp is the format's step in that binade, so one IEEE
   * add rounds |f| to the grid (ties to even; half_up: |f|'s lowest bit set
   * first lifts exact ties, and no other value, over the midpoint) and
   * bits(|f| + m) - bits(m) counts steps: the code within the binade */
  const uint32_t m = e + (s << 23);
  const uint32_t t = moe_f32_bits(moe_f32_from_bits(a | (uint32_t)half_up) + moe_f32_from_bits(m));
  uint32_t mag = t - m + ((e - min_exp) >> s);
  mag = mag < fmt->max_mag ? mag : fmt->max_mag; /* satfinite; inf too */
  const uint32_t sbit = (u >> 31) << (fmt->bits - 1);
  const uint32_t sign = (mag != 0u || fmt->neg_zero) ? sbit : 0u;
  const uint32_t nan = fmt->nan_code < 0 ? 0u : (uint32_t)fmt->nan_code;
  return (uint8_t)(a > 0x7F800000u ? nan : (sign | mag));
}

/* narrow code -> fp32, exact. */
MOE_HD float moe_narrow_to_f32(uint8_t code, const moe_narrow_fmt *fmt) {
  uint32_t sbit = 1u << (fmt->bits - 1);
  uint32_t mag = code & (sbit - 1u);
  bool neg = (code & sbit) != 0;
  if (fmt->nan_is_negzero && code == 0x80) return moe_f32_from_bits(0x7FC00000u);
  if (fmt->nan_is_max && mag == 0x7F) return moe_f32_from_bits(0x7FC00000u);
  uint32_t e = mag >> fmt->mbits, m = mag & ((1u << fmt->mbits) - 1u);
  if (fmt->inf_codes && e == (1u << (fmt->bits - 1 - fmt->mbits)) - 1u) {
    float v = m ? moe_f32_from_bits(0x7FC00000u) : moe_f32_from_bits(0x7F800000u);
    return (neg && !m) ? -v : v;
  }
  float v = e == 0 ? (float)m * moe_pow2f(1 - fmt->bias - fmt->mbits)
                   : (float)((1u << fmt->mbits) + m) * moe_pow2f((int)e - fmt->bias - fmt->mbits);
  return neg ? -v : v;
}

/* e4m3fn code -> its exact value, as moe_narrow_to_f32 with MOE_FMT_E4M3FN
 * but branch-free, so that loops over it vectorize (fused_moe's fp8 weights):
 * the magnitude bits moved to fp32's exponent/mantissa position read as the
 * value times 2^-120 (normal codes on normal floats, subnormal codes on
 * subnormal ones, both exact), so one exact multiply by 2^120 scales it;
 * 0x7F and 0xFF are NaN. */
MOE_HD float moe_e4m3fn_to_f32(uint8_t c) {
  const float mag =
      moe_f32_from_bits((uint32_t)(c & 0x7Fu) << 20) * moe_f32_from_bits(0x7B800000u); /* 2^120 */
  const float v = moe_f32_from_bits(moe_f32_bits(mag) | ((uint32_t)(c & 0x80u) << 24));
  return (c & 0x7Fu) == 0x7Fu ? moe_f32_from_bits(0x7FC00000u) : v;
}

/* ---- int8 ---------------------------------------------------------------- */

/* RNE, saturate to [-128, 127], NaN -> 0 (vLLM's behaviour). On the
 * magnitude: |f| + 2^23 rounds to an integer in one IEEE add (RNE; larger
 * magnitudes and inf only need to stay above the clamp), clamped to 127, or
 * 128 for a negative value, then negated by the sign. Integer selects only,
 * so loops over it vectorize. */
MOE_HD int8_t moe_f32_to_int8(float f) {
  const uint32_t u = moe_f32_bits(f), a = u & 0x7FFFFFFFu, neg = u >> 31;
  uint32_t t = moe_f32_bits(moe_f32_from_bits(a) + 8388608.0f) - 0x4B000000u;
  t = t < 127u + neg ? t : 127u + neg;
  t = (t ^ (0u - neg)) + neg;
  return (int8_t)(int32_t)(a > 0x7F800000u ? 0u : t);
}

/* ---- MX block scales (docs/numerics.md "quant.mx") ----------------------------- */

typedef enum moe_mx_rule {
  MOE_MX_EVEN = 0,
  MOE_MX_FLOOR,
  MOE_MX_AMAX_UP,
  MOE_MX_AMAX_DOWN,
} moe_mx_rule;

/* From a finite block amax: the e8m0 scale byte and the fp32 factor the
 * elements are multiplied by before conversion. */
MOE_HD uint8_t moe_mx_scale(float amax, moe_mx_rule rule, const moe_narrow_fmt *fmt, float *mult) {
  uint32_t b = moe_f32_bits(amax);
  if (rule == MOE_MX_EVEN || rule == MOE_MX_FLOOR) {
    uint32_t r = ((rule == MOE_MX_EVEN) ? b + 0x200000u : b) & 0xFF800000u;
    int e = (int)((r >> 23) & 0xFFu);
    int unb = (e == 0) ? -127 : (e == 255) ? 127 : e - 127 - fmt->emax;
    if (unb < -127) unb = -127;
    if (unb > 127) unb = 127;
    *mult = moe_pow2f(-unb);
    return (uint8_t)(unb + 127);
  }
  float d = amax / fmt->max_finite;
  uint32_t db = moe_f32_bits(d);
  uint32_t xe = ((rule == MOE_MX_AMAX_UP) ? db + 0x7FFFFFu : db) & 0x7F800000u;
  *mult = xe == 0 ? 0.0f : 1.0f / moe_f32_from_bits(xe);
  return (uint8_t)(xe >> 23);
}

/* e8m0 byte -> its power of two (0xFF -> NaN). */
MOE_HD float moe_e8m0_to_f32(uint8_t b) {
  if (b == 0xFF) return moe_f32_from_bits(0x7FC00000u);
  return moe_pow2f((int)b - 127);
}

#endif
