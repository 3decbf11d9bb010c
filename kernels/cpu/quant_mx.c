/* CPU: quant.mx and dequant.mx (docs/numerics.md "quant.mx"): quant in
 * tiles of 16 blocks of 32 elements, dequant a block at a time through a
 * table of the codes' values; blocks are
 * independent, so any thread split gives the same bits. Where the CPU has
 * AVX-512 or AVX2 (moe_cpu_quant_isa), a tile of fp16/bf16 input is
 * quantized by intrinsics (amaxes, scales, codes); fp32 input, other CPUs
 * and the reference switch take the C below. dequant in AVX-512 lanes where
 * the CPU has them (dequant_avx512.c), else the C below. */
#include <immintrin.h>
#include <string.h>

#include "../ops/op.h"
#include "amax_lanes_avx512.h"
#include "cpu.h"
#include "narrow_lanes_avx2.h"
#include "narrow_lanes_avx512.h"

#define BLOCK 32
#define GROUP 512 /* blocks per OpenMP work item */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

#define TILE 16 /* blocks quantized together: 512 elements, 2 KiB of fp32 in L1 */

/* ---- the front of a tile of fp16/bf16 input in AVX-512 -------------------------------- */
/* GCC vectorizes the per-block C loops below across the blocks (strided
 * accesses) rather than along them; here a block of 32 16-bit values is one
 * register. The amax: a 16-bit max of |h| (|h| orders like the values, and
 * widening keeps the order and the NaN/inf flag, so it is the C path's fp32
 * amax), the tile's 16 blocks reduced together; the scales of the 16 blocks
 * in one register; then each block widened (a shift for bf16, vcvtph2ps for
 * fp16: exact, as moe_f16_to_f32 but for NaN payloads, whose blocks are
 * zeroed anyway), multiplied, encoded and packed without a pass through
 * memory. test_quant_ops compares the bytes with the C path on every
 * fp16/bf16 pattern. In cache, one thread, bf16 in: mxfp8 0.35 -> 0.163 ns
 * per element over three passes (bench/RESULTS.md). */
#define V512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c")))

/* moe_mx_scale of the tile's finite amaxes in the lanes (the same integer
 * and IEEE steps, the branches as selects); NaN/inf blocks get 0xFF and a
 * factor 0. Returns whether any block is NaN/inf. */
V512 static bool tile_scales_avx512(const uint32_t *amax, size_t nb, moe_mx_rule rule,
                                    const moe_narrow_fmt *fmt, uint8_t *scales, float *mult) {
  const __mmask16 k = (__mmask16)((1u << nb) - 1u);
  const __m512i am = _mm512_maskz_loadu_epi32(k, amax);
  __m512i sb, mb;
  if (rule == MOE_MX_EVEN || rule == MOE_MX_FLOOR) {
    __m512i r = rule == MOE_MX_EVEN ? _mm512_add_epi32(am, _mm512_set1_epi32(0x200000)) : am;
    const __m512i e = _mm512_srli_epi32(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFF800000u)), 23);
    __m512i unb = _mm512_sub_epi32(e, _mm512_set1_epi32(127 + fmt->emax));
    unb = _mm512_mask_mov_epi32(unb, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                                _mm512_set1_epi32(-127));
    unb = _mm512_mask_mov_epi32(unb, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                                _mm512_set1_epi32(127));
    unb = _mm512_min_epi32(_mm512_max_epi32(unb, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    /* 2^-unb: normal for unb <= 126, else 2^-127 (a subnormal) */
    mb = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), unb), 23);
    mb = _mm512_mask_mov_epi32(mb, _mm512_cmpgt_epi32_mask(unb, _mm512_set1_epi32(126)),
                               _mm512_set1_epi32(1 << 22));
    sb = _mm512_add_epi32(unb, _mm512_set1_epi32(127));
  } else {
    const __m512i db =
        _mm512_castps_si512(_mm512_div_ps(_mm512_castsi512_ps(am), _mm512_set1_ps(fmt->max_finite)));
    const __m512i up = rule == MOE_MX_AMAX_UP ? _mm512_add_epi32(db, _mm512_set1_epi32(0x7FFFFF)) : db;
    const __m512i xe = _mm512_and_si512(up, _mm512_set1_epi32(0x7F800000));
    mb = _mm512_castps_si512(_mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_castsi512_ps(xe)));
    mb = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(xe, xe), mb);
    sb = _mm512_srli_epi32(xe, 23);
  }
  /* NaN or inf: OCP's NaN scale makes the whole block NaN */
  const __mmask16 nf = _mm512_mask_cmpge_epu32_mask(k, am, _mm512_set1_epi32(0x7F800000));
  sb = _mm512_mask_mov_epi32(sb, nf, _mm512_set1_epi32(0xFF));
  mb = _mm512_mask_mov_epi32(mb, nf, _mm512_setzero_si512());
  _mm512_mask_cvtepi32_storeu_epi8(scales, k, sb);
  _mm512_mask_storeu_ps(mult, k, _mm512_castsi512_ps(mb));
  return nf != 0;
}

/* The block amax's fp32 bits from the 16-bit maxes of |h| in the 16 lanes of
 * m16 (the AVX-512 and the AVX2 front share it). */
__attribute__((target("avx2"), always_inline)) static inline uint32_t block_amax_bits(__m256i m16,
                                                                                      bool bf16) {
  __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(m16), _mm256_extracti128_si256(m16, 1));
  m8 = _mm_max_epu16(m8, _mm_shuffle_epi32(m8, 0x4E));
  m8 = _mm_max_epu16(m8, _mm_shuffle_epi32(m8, 0xB1));
  m8 = _mm_max_epu16(m8, _mm_srli_epi32(m8, 16));
  const uint16_t top = (uint16_t)_mm_cvtsi128_si32(m8);
  return bf16 ? (uint32_t)top << 16 : moe_f32_bits(moe_f16_to_f32(top));
}

/* The tile's 16 block amaxes by the tree of amax_lanes_avx512.h. Blocks past
 * nb are zeros. */
V512 static void tile_amax_avx512(const uint16_t *h, bool bf16, size_t nb, uint32_t *amax) {
  const __m512i abs_mask = _mm512_set1_epi16(0x7FFF);
  __m512i r[TILE];
  for (size_t b = 0; b < TILE; b++) {
    moe_cpu_prefetch(h + b * BLOCK, (moe_cpu_ahead){MOE_CPU_PREFETCH, false}); /* cpu.h */
    r[b] = b < nb ? _mm512_and_si512(_mm512_loadu_si512(h + b * BLOCK), abs_mask) : _mm512_setzero_si512();
  }
  const __m512i m = amax_lanes_max16(r);
  const __m512i bits = bf16 ? _mm512_slli_epi32(m, 16)
                            : _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(m))); /* exact */
  _mm512_storeu_si512(amax, bits);
}

/* The tile's codes straight from x: widened, times the block's factor,
 * the magnitude by one rounding add (narrow_lanes_avx512.h), the sign merged
 * by one vpternlogd, packed in registers (fp8: vpmovdb; fp4: the byte pairs
 * of a 16-bit lane folded by a shift, then vpmovwb). */
V512 static void tile_encode_avx512(const uint16_t *h, bool bf16, size_t nb, const float *mult,
                                    const moe_narrow_fmt *fmt, bool half_up, bool fp4, uint8_t *q) {
  const narrow_lanes L = narrow_lanes_of(fmt); /* a local: the stores to q may alias *fmt */
  const __m128i sign_shift = _mm_cvtsi32_si128(32 - fmt->bits);
  const __m512i sign_bit = _mm512_set1_epi32(1 << (fmt->bits - 1));
  for (size_t b = 0; b < nb; b++) {
    const __m512 sc = _mm512_set1_ps(mult[b]);
    __m128i c[2];
    for (size_t k = 0; k < 2; k++) {
      const __m256i x = _mm256_loadu_si256((const __m256i *)(h + b * BLOCK + 16 * k));
      const __m512 v =
          bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)) : _mm512_cvtph_ps(x);
      const __m512i y = _mm512_castps_si512(_mm512_mul_ps(v, sc));
      const __m512i mag = narrow_lanes_mag(
          _mm512_castsi512_ps(_mm512_and_si512(y, _mm512_set1_epi32(0x7FFFFFFF))), &L, half_up, false);
      /* mag | (the sign moved to the code's top bit); the bits above the low byte do not matter */
      c[k] = _mm512_cvtepi32_epi8(
          _mm512_ternarylogic_epi32(mag, _mm512_srl_epi32(y, sign_shift), sign_bit, 0xF8));
    }
    if (fp4) {
      const __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(c[0]), c[1], 1);
      _mm_storeu_si128((__m128i *)(q + b * (BLOCK / 2)),
                       _mm256_cvtepi16_epi8(_mm256_or_si256(w, _mm256_srli_epi16(w, 4))));
    } else {
      _mm_storeu_si128((__m128i *)(q + b * BLOCK), c[0]);
      _mm_storeu_si128((__m128i *)(q + b * BLOCK + 16), c[1]);
    }
  }
}

/* ---- the front of a tile of fp16/bf16 input in AVX2 ------------------------------------ */
/* For CPUs without AVX-512: the amaxes as above in two 256-bit halves, the
 * scales by the C code (moe_mx_scale), the codes below. test_quant_ops runs
 * it against the C path (moe_cpu_set_isa_cap) on every fp16/bf16 pattern. */
#define VAVX2 __attribute__((target("avx2,f16c")))

VAVX2 static void tile_amax_avx2(const uint16_t *h, bool bf16, size_t nb, uint32_t *amax) {
  const __m256i abs_mask = _mm256_set1_epi16(0x7FFF);
  for (size_t b = 0; b < nb; b++) {
    moe_cpu_prefetch(h + b * BLOCK, (moe_cpu_ahead){MOE_CPU_PREFETCH, false}); /* cpu.h */
    const __m256i lo = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(h + b * BLOCK)), abs_mask);
    const __m256i hi = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(h + b * BLOCK + 16)), abs_mask);
    amax[b] = block_amax_bits(_mm256_max_epu16(lo, hi), bf16);
  }
}

/* The tile's codes: the rounding add with its addend computed
 * (narrow_lanes_avx2.h), the magnitudes' low bytes packed, the signs packed
 * from the inputs' high bytes and or-ed in (every MX format keeps -0;
 * NaN/inf blocks are zeroed after). */
VAVX2 static void tile_encode_avx2(const uint16_t *h, bool bf16, size_t nb, const float *mult,
                                   const moe_narrow_fmt *fmt, bool half_up, bool fp4, uint8_t *q) {
  const narrow_avx2 L = narrow_avx2_of(fmt); /* a local: the stores to q may alias *fmt */
  /* the sign: bit 15 of the input to the code's top bit */
  const int sign_shift = fp4 ? 12 : 8;
  const __m256i sign_bit = _mm256_set1_epi8((char)(fp4 ? 0x08 : 0x80));
  for (size_t b = 0; b < nb; b++) {
    const uint16_t *hb = h + b * BLOCK;
    const __m256 sc = _mm256_set1_ps(mult[b]);
    __m256i c[4];
    for (size_t k = 0; k < 4; k++) {
      const __m128i x = _mm_loadu_si128((const __m128i *)(hb + 8 * k));
      const __m256 v =
          bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)) : _mm256_cvtph_ps(x);
      const __m256i a =
          _mm256_and_si256(_mm256_castps_si256(_mm256_mul_ps(v, sc)), _mm256_set1_epi32(0x7FFFFFFF));
      c[k] = narrow_avx2_mag(_mm256_castsi256_ps(a), &L, half_up, false);
    }
    const __m256i sign = narrow_avx2_high_bytes(_mm256_loadu_si256((const __m256i *)hb),
                                                _mm256_loadu_si256((const __m256i *)(hb + 16)), sign_shift);
    const __m256i bytes = _mm256_or_si256(narrow_avx2_pack(c), _mm256_and_si256(sign, sign_bit));
    if (fp4) { /* the pair of codes in a 16-bit lane folded into its low byte, then the low bytes */
      const __m256i w =
          _mm256_and_si256(_mm256_or_si256(bytes, _mm256_srli_epi16(bytes, 4)), _mm256_set1_epi16(0xFF));
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08);
      _mm_storeu_si128((__m128i *)(q + b * (BLOCK / 2)), _mm256_castsi256_si128(p));
    } else {
      _mm256_storeu_si256((__m256i *)(q + b * BLOCK), bytes);
    }
  }
}

/* Quantizes blocks [b0, b0 + nb), nb <= TILE, in passes over an L1-resident
 * tile so that each loop is long, straight and vectorizes: widen x, the
 * blocks' amax (an integer max of |x| bits: orders like the values and
 * flags NaN/inf as >= 0x7F800000), the scales (scalar, one per block), the
 * scaled elements, then one encode loop over the whole tile. `isa`: 16-bit
 * input through the AVX-512 or the AVX2 functions above instead. */
ALWAYS_INLINE void quant_tile(const void *x, moe_dtype xt, size_t b0, size_t nb, const moe_mx_args *a,
                              const moe_narrow_fmt *fmt, moe_cpu_isa isa, uint8_t *q, uint8_t *scales) {
  float v[TILE * BLOCK];
  uint32_t amax[TILE];
  float mult[TILE];
  const size_t n = nb * BLOCK, base = b0 * BLOCK;
  const uint16_t *h = (const uint16_t *)x + base;
  if (isa >= MOE_CPU_ISA_AVX512) {
    tile_amax_avx512(h, xt == MOE_BF16, nb, amax);
  } else if (isa == MOE_CPU_ISA_AVX2) {
    tile_amax_avx2(h, xt == MOE_BF16, nb, amax);
  } else {
    for (size_t i = 0; i < n; i++)
      v[i] = moe_load_float(x, xt, base + i);
    for (size_t b = 0; b < nb; b++) {
      uint32_t m = 0;
      for (int i = 0; i < BLOCK; i++) {
        const uint32_t e = moe_f32_bits(v[b * BLOCK + (size_t)i]) & 0x7FFFFFFFu;
        m = e > m ? e : m;
      }
      amax[b] = m;
    }
  }
  bool non_finite = false;
  if (isa >= MOE_CPU_ISA_AVX512)
    non_finite = tile_scales_avx512(amax, nb, a->rule, fmt, scales + b0, mult);
  else
    for (size_t b = 0; b < nb; b++) {
      if (amax[b] >= 0x7F800000u) { /* NaN or inf: OCP's NaN scale makes the whole block NaN */
        scales[b0 + b] = 0xFF;
        mult[b] = 0.0f;
        non_finite = true;
      } else {
        scales[b0 + b] = moe_mx_scale(moe_f32_from_bits(amax[b]), a->rule, fmt, &mult[b]);
      }
    }
  const bool half_up = a->half_up, fp4 = a->qdtype == MOE_FP4_E2M1;
  if (isa != MOE_CPU_ISA_C) {
    uint8_t *qb = q + b0 * (fp4 ? BLOCK / 2 : BLOCK);
    if (isa >= MOE_CPU_ISA_AVX512)
      tile_encode_avx512(h, xt == MOE_BF16, nb, mult, fmt, half_up, fp4, qb);
    else
      tile_encode_avx2(h, xt == MOE_BF16, nb, mult, fmt, half_up, fp4, qb);
    if (non_finite)
      for (size_t b = 0; b < nb; b++)
        if (scales[b0 + b] == 0xFF)
          memset(q + (b0 + b) * (fp4 ? BLOCK / 2 : BLOCK), 0, fp4 ? BLOCK / 2 : BLOCK);
    return;
  }
  for (size_t b = 0; b < nb; b++)
    for (int i = 0; i < BLOCK; i++)
      v[b * BLOCK + (size_t)i] *= mult[b];
  if (fp4) {
    uint8_t *qb = q + b0 * (BLOCK / 2);
    /* the codes a byte each (the fp8 loop's shape), then packed in pairs:
     * the even/odd split on bytes, not on fp32 lanes */
    uint8_t codes[TILE * BLOCK];
    for (size_t j = 0; j < n; j++)
      codes[j] = moe_f32_to_narrow(v[j], fmt, half_up);
    for (size_t j = 0; j < n / 2; j++)
      qb[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
    if (non_finite)
      for (size_t b = 0; b < nb; b++)
        if (scales[b0 + b] == 0xFF) memset(qb + b * (BLOCK / 2), 0, BLOCK / 2);
  } else {
    uint8_t *qb = q + b0 * BLOCK;
    for (size_t j = 0; j < n; j++)
      qb[j] = moe_f32_to_narrow(v[j], fmt, half_up);
    if (non_finite)
      for (size_t b = 0; b < nb; b++)
        if (scales[b0 + b] == 0xFF) memset(qb + b * BLOCK, 0, BLOCK);
  }
}

/* mxfp8 e4m3fn and mxfp4 of 16-bit input with RNE, where the CPU has VBMI: RUN blocks'
 * amaxes and scales a tile at a time (as above), then their codes by the
 * scaled ops' lane encoder (cpu.h moe_cpu_scaled_lanes, g = 32: two blocks a
 * 64-element step, packed by vpermt2b and stored 64 bytes at once, fp4's
 * byte pairs folded into 32; the same
 * cvt(x * factor), RNE, saturating, -0 kept), one call for the run so that
 * its set-up is paid once per RUN blocks. Blocks of NaN/inf (factor 0, codes
 * NaN) are zeroed after, as above. nb even (cpu.h: the encoder's g = 32).
 * The codes stay cached stores: streamed ones past the L3 measured no faster
 * (bench/RESULTS.md), as the 16-byte ones before. */
#define RUN (4 * TILE)
V512 static void quant_run_pairs(const uint16_t *h, moe_dtype xt, size_t b0, size_t nb, const moe_mx_args *a,
                                 const moe_narrow_fmt *fmt, uint8_t *q, uint8_t *scales) {
  uint32_t amax[RUN];
  float mult[RUN];
  bool non_finite = false;
  for (size_t t = 0; t < nb; t += TILE) {
    const size_t nt = nb - t < TILE ? nb - t : TILE;
    tile_amax_avx512(h + t * BLOCK, xt == MOE_BF16, nt, amax + t);
    non_finite |= tile_scales_avx512(amax + t, nt, a->rule, fmt, scales + b0 + t, mult + t);
  }
  moe_cpu_encode_scaled_avx512(h, xt, nb, BLOCK, mult, mult, false, false, fmt,
                               (moe_cpu_ahead){MOE_CPU_PREFETCH, false}, false, q);
  const size_t cb = fmt->bits == 4 ? BLOCK / 2 : BLOCK; /* code bytes a block */
  if (non_finite)
    for (size_t b = 0; b < nb; b++)
      if (scales[b0 + b] == 0xFF) memset(q + b * cb, 0, cb);
}

/* Blocks [b0, b1); `pairs`: by quant_run_pairs. */
MOE_CPU_HOT static void quant_blocks(const moe_tensor *x, const moe_mx_args *a, moe_cpu_isa isa, bool pairs,
                                     size_t b0, size_t b1, uint8_t *q, uint8_t *scales) {
  /* a local copy: byte stores to q may alias *a, which would keep the
   * loops from vectorizing */
  const moe_narrow_fmt fmt = a->fmt;
  if (pairs) { /* an odd last block by the tiles below */
    const size_t even = b0 + ((b1 - b0) & ~(size_t)1);
    for (size_t t = b0; t < even; t += RUN)
      quant_run_pairs((const uint16_t *)x->data + t * BLOCK, x->dtype, t, even - t < RUN ? even - t : RUN, a,
                      &fmt, q + t * (fmt.bits == 4 ? BLOCK / 2 : BLOCK), scales);
    b0 = even;
  }
  for (size_t t = b0; t < b1; t += TILE) {
    const size_t nb = b1 - t < TILE ? b1 - t : TILE;
    switch (x->dtype) {
    case MOE_F16: quant_tile(x->data, MOE_F16, t, nb, a, &fmt, isa, q, scales); break;
    case MOE_BF16: quant_tile(x->data, MOE_BF16, t, nb, a, &fmt, isa, q, scales); break;
    default: quant_tile(x->data, MOE_F32, t, nb, a, &fmt, MOE_CPU_ISA_C, q, scales); break;
    }
  }
}

moe_status moe_cpu_quant_mx(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_mx_args *a = &c->args.mx;
  const moe_tensor *x = &c->in[0].tensor;
  size_t n = 0;
  moe_tensor_numel(x, &n);
  size_t blocks = n / BLOCK;
  long groups = (long)((blocks + GROUP - 1) / GROUP);
  uint8_t *q = c->out[0].tensor.data, *scales = c->out[1].tensor.data;
  const moe_cpu_isa isa = moe_cpu_quant_isa(); /* read once per call */
  float hi, lo;
  const int kind = moe_cpu_scaled_kind(false, &a->fmt, &hi, &lo);
  const bool pairs = isa >= MOE_CPU_ISA_AVX512_VBMI && (x->dtype == MOE_BF16 || x->dtype == MOE_F16) &&
                     !a->half_up && (kind == MOE_SCALED_FP8_NEG_ZERO || kind == MOE_SCALED_FP4);
#pragma omp parallel for num_threads(moe_cpu_threads_for(b, n)) schedule(static)
  for (long g = 0; g < groups; g++) {
    size_t b0 = (size_t)g * GROUP, b1 = b0 + GROUP < blocks ? b0 + GROUP : blocks;
    quant_blocks(x, a, isa, pairs, b0, b1, q, scales);
  }
  return MOE_OK;
}

/* y = value(code) * scale, each element: its value from a table of the
 * format's codes decoded once per call (the codec's decoder takes the format
 * at run time and branches), the product, then the output rounding. */
ALWAYS_INLINE void dequant_block(const uint8_t *q, uint8_t sbyte, bool fp4, const float *value, size_t base,
                                 moe_dtype yt, void *y) {
  const float scale = moe_e8m0_to_f32(sbyte);
  float v[BLOCK];
  for (int i = 0; i < BLOCK; i++) {
    const uint8_t code = fp4 ? (uint8_t)((q[i / 2] >> ((i & 1) * 4)) & 0xF) : q[i];
    v[i] = value[code] * scale;
  }
  for (int i = 0; i < BLOCK; i++)
    moe_store_float(y, yt, base + (size_t)i, v[i]);
}

ALWAYS_INLINE void dequant_blocks_dtype(bool fp4, const float *value, const uint8_t *q, const uint8_t *scales,
                                        size_t b0, size_t b1, moe_dtype yt, void *y) {
  const size_t qbytes = fp4 ? BLOCK / 2 : BLOCK;
  for (size_t blk = b0; blk < b1; blk++)
    dequant_block(q + blk * qbytes, scales[blk], fp4, value, blk * BLOCK, yt, y);
}

/* `plan`: the AVX-512 lanes (NULL: the C loops) */
MOE_CPU_HOT static void dequant_blocks(const moe_mx_args *a, const float *value, const uint8_t *q,
                                       const uint8_t *scales, const moe_cpu_dequant_plan *plan, size_t b0,
                                       size_t b1, void *y) {
  const bool fp4 = a->qdtype == MOE_FP4_E2M1;
  if (plan) {
    moe_cpu_dequant_mx_avx512(q, scales, value, &a->fmt, plan, b0, b1, a->out_dtype, y);
    return;
  }
  switch (a->out_dtype) {
  case MOE_F16:
    if (fp4)
      dequant_blocks_dtype(true, value, q, scales, b0, b1, MOE_F16, y);
    else
      dequant_blocks_dtype(false, value, q, scales, b0, b1, MOE_F16, y);
    break;
  case MOE_BF16:
    if (fp4)
      dequant_blocks_dtype(true, value, q, scales, b0, b1, MOE_BF16, y);
    else
      dequant_blocks_dtype(false, value, q, scales, b0, b1, MOE_BF16, y);
    break;
  default:
    if (fp4)
      dequant_blocks_dtype(true, value, q, scales, b0, b1, MOE_F32, y);
    else
      dequant_blocks_dtype(false, value, q, scales, b0, b1, MOE_F32, y);
    break;
  }
}

moe_status moe_cpu_dequant_mx(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_mx_args *a = &c->args.mx;
  size_t n = 0;
  moe_tensor_numel(&c->in[0].tensor, &n);
  size_t blocks = n / BLOCK;
  long groups = (long)((blocks + GROUP - 1) / GROUP);
  const uint8_t *q = c->in[0].tensor.data, *scales = c->in[1].tensor.data;
  void *y = c->out[0].tensor.data;
  float value[256];
  for (int code = 0; code < (a->qdtype == MOE_FP4_E2M1 ? 16 : 256); code++)
    value[code] = moe_narrow_to_f32((uint8_t)code, &a->fmt);
  const moe_cpu_isa isa = moe_cpu_quant_isa(); /* read once per call */
  moe_cpu_dequant_plan plan;                   /* once per call, read by every group */
  const bool lanes =
      isa >= MOE_CPU_ISA_AVX512 &&
      moe_cpu_dequant_mx_plan(&a->fmt, value, a->out_dtype, isa >= MOE_CPU_ISA_AVX512_VBMI, &plan);
#pragma omp parallel for num_threads(moe_cpu_threads_for(b, n)) schedule(static)
  for (long g = 0; g < groups; g++) {
    size_t b0 = (size_t)g * GROUP, b1 = b0 + GROUP < blocks ? b0 + GROUP : blocks;
    dequant_blocks(a, value, q, scales, lanes ? &plan : NULL, b0, b1, y);
  }
  return MOE_OK;
}
