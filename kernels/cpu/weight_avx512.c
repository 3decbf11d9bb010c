/* The weight formats' vector members (weight_format.h: dequant_fast, dot)
 * in AVX-512, taken where the CPU has it (moe_cpu_vector_kernels). They
 * give the reference functions' values (weight_format.c), 16 columns at a
 * time: int4 and mxfp4 round a group's 16 possible weights once into a
 * table (one register) and look the codes up with a variable permute
 * (vpermps), the nibbles spread to lanes by a byte unpack, a widening and a
 * shift per lane; int8 computes (q - z) * s in the lanes and rounds there;
 * bf16 weights widen by a shift, fp16 by vcvtph2ps. Lane l of a chunk at
 * column j holds column j + l, as in the pipeline's dot kernels
 * (kernels/cpu/fused_moe.c), so the sums keep their order and their bits.
 * The int4 / int8 / mxfp4 dot fuses a product and its sum into one FMA in
 * groups where the product is proven exact (fuse_window): the same bits.
 *
 * Intrinsics rather than the clones of MOE_CPU_HOT: GCC 12 turns the byte
 * shuffles of its generic vectors into scalar code (and once crashed on
 * them in a clone). */
#include <immintrin.h>
#include <string.h>

#include "../ops/op.h"
#include "weight_format.h"

#define V512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c")))
#define V512_INLINE                                                                                          \
  static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512dq,avx512vl,f16c")))

#define LANES MOE_WEIGHT_LANES
#define DOT_ROWS MOE_WEIGHT_DOT_ROWS
#define DOT_TOKENS MOE_WEIGHT_DOT_TOKENS

enum decoder { DEC_BF16, DEC_FP16, DEC_INT4, DEC_INT8, DEC_MXFP4 };

/* ---- act() in the lanes ------------------------------------------------------ */

/* moe_bf16_to_f32(moe_f32_to_bf16(v)): RNE on the bits, NaN -> 0x7FC00000
 * (`nan_in`: whether v may hold NaN; int8 knows per group that it cannot). */
V512_INLINE __m512 round_bf16(__m512 v, bool nan_in) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u));
  if (!nan_in) return _mm512_castsi512_ps(r);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000)));
}

/* moe_f16_to_f32(moe_f32_to_f16(v)): IEEE RNE with subnormals and overflow
 * to inf is what vcvtps2ph does; the codec's NaN is the one 0x7E00. */
V512_INLINE __m512 round_f16(__m512 v, bool nan_in) {
  const __m512 r = _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  if (!nan_in) return r;
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(r, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

V512_INLINE __m512 round_act(__m512 v, moe_dtype act, bool nan_in) {
  return act == MOE_F16 ? round_f16(v, nan_in) : round_bf16(v, nan_in);
}

/* ---- one row as the decoders walk it ------------------------------------------ */

typedef struct row_dec {
  const uint8_t *q; /* the row's storage */
  int64_t n;        /* its row index */
  size_t s0;        /* the index of its first group's scale */
  int64_t next;     /* first column past the loaded group */
  __m512 lut;       /* int4, mxfp4: the group's weight of each code */
  __m512 s, z;      /* int8: the group's scale and zero point */
  bool nan;         /* int8: whether (q - z) * s can be NaN: only for a NaN or infinite scale */
  bool fuse;        /* dot: every product of the group with the token rows is exact (moe_x_range) */
} row_dec;

V512_INLINE void row_open(const moe_weight_matrix *m, int64_t e, int64_t n, int64_t j, row_dec *d) {
  d->q = moe_weight_row(m, e, n);
  d->n = n;
  d->s0 = ((size_t)e * (size_t)m->rows + (size_t)n) * (size_t)m->groups;
  d->next = j; /* the first chunk loads its group */
  d->lut = d->s = d->z = _mm512_setzero_ps();
  d->nan = false;
  d->fuse = false;
}

/* The groups whose products with the token rows the dot may fuse, by
 * their scale's exponent b (the biased fp32 exponent of an int4 / int8
 * scale, the e8m0 byte of mxfp4): [lo, hi], empty when lo > hi. Computed
 * once a call from the rows' range xr (moe_x_range): a group's nonzero |w|
 * lie in [2^(b + wlo), 2^(b + whi)]; its products are exact when w is
 * finite (2^(b + whi) at most the act dtype's largest power of two) and
 * every nonzero |x * w| in [2^-126, 2^128) (at most 22 significant bits:
 * exact there). Zero products are exact. The bounds:
 * - int4 / int8: |(q - z) * s| for integers 1 <= |q - z| <= 2^bits - 1 lies
 *   in [|s|, 2^bits |s|), so in [2^(b - 127), 2^(b - 126 + bits)), and the
 *   act rounding (monotone, the bounds representable) keeps it there or on
 *   the upper bound; b = 0 (zero, subnormal) and 255 (inf, NaN) left out;
 * - mxfp4: e2m1's nonzero magnitudes lie in [0.5, 6]: w in [2^(b - 128),
 *   2^(b - 124)]; b = 255 (NaN) left out. */
typedef struct fuse_window {
  int lo, hi;
} fuse_window;

V512_INLINE fuse_window fuse_window_of(enum decoder dec, moe_dtype act, moe_x_range xr) {
  if (!xr.exact || (dec != DEC_INT4 && dec != DEC_INT8 && dec != DEC_MXFP4)) return (fuse_window){1, 0};
  const int wlo = dec == DEC_MXFP4 ? -128 : -127, whi = dec == DEC_MXFP4  ? -124
                                                        : dec == DEC_INT4 ? -122
                                                                          : -118;
  const int blo = dec == DEC_MXFP4 ? 0 : 1, wmax = act == MOE_F16 ? 15 : 127;
  int lo = -126 - xr.lo - wlo, hi = 128 - xr.hi - whi;
  lo = lo > blo ? lo : blo;
  hi = hi < 254 ? hi : 254;
  hi = hi < wmax - whi ? hi : wmax - whi;
  return (fuse_window){lo, hi};
}

/* The group of column j (bf16 / fp16 weights have none: group 0). */
V512_INLINE int64_t group_of(const moe_weight_matrix *m, int64_t j) {
  return m->group > 0 ? j / m->group : 0;
}

/* Loads group g (the dot counts them: no division per group and row). */
V512_INLINE void row_group(const moe_weight_matrix *m, enum decoder dec, moe_dtype act, fuse_window fw,
                           int64_t e, row_dec *d, int64_t g) {
  if (dec == DEC_BF16 || dec == DEC_FP16) {
    d->next = INT64_MAX;
    return;
  }
  d->next = (g + 1) * m->group;
  const size_t si = d->s0 + (size_t)g;
  if (dec == DEC_MXFP4) { /* value * 2^(b - 127) is exact; one act rounding */
    const uint8_t b = ((const uint8_t *)m->scales)[si];
    const float s = moe_e8m0_to_f32(b);
    d->fuse = b >= fw.lo && b <= fw.hi;
    d->lut = round_act(_mm512_mul_ps(_mm512_loadu_ps(moe_e2m1_value), _mm512_set1_ps(s)), act, true);
    return;
  }
  const float s = moe_load_float(m->scales, m->scale_dtype, si);
  d->nan = !moe_f32_isfinite(s); /* q - z is a finite integer */
  const int b = (int)((moe_f32_bits(s) >> 23) & 0xFF);
  d->fuse = b >= fw.lo && b <= fw.hi;
  d->s = _mm512_set1_ps(s);
  if (dec == DEC_INT4) { /* float(c) - float(z) is exact; one rounding for the product; NaN only
                          * from a NaN or infinite scale */
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 cz = m->zeros ? _mm512_sub_ps(codes, _mm512_set1_ps(moe_weight_zero_point(m, 4, e, d->n, g)))
                               : _mm512_sub_ps(codes, _mm512_set1_ps(8.0f)); /* a constant */
    const __m512 p = _mm512_mul_ps(cz, d->s);
    d->lut = d->nan ? round_act(p, act, true) : round_act(p, act, false);
    return;
  }
  d->z = _mm512_set1_ps(moe_weight_zero_point(m, 8, e, d->n, g));
}

/* Columns [j, j + 16) of the row; lanes from `valid` on are +0 (the zero
 * padding the dot kernels read past the last column) and their bytes are
 * not read (masked loads). */
V512_INLINE __m512 row_chunk(enum decoder dec, moe_dtype act, const row_dec *d, int64_t j, int64_t valid) {
  const __mmask16 lanes = valid >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1u);
  __m512 w;
  if (dec == DEC_INT4 || dec == DEC_MXFP4) {
    const __m128i b = _mm_maskz_loadu_epi8((__mmask16)((1u << ((valid + 1) / 2)) - 1u), d->q + j / 2);
    /* lane l: byte l / 2, shifted to its low nibble (even l) or high (odd l);
     * vpermps reads the index's low 4 bits only */
    const __m512i pairs = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
    const __m512i code =
        _mm512_srlv_epi32(pairs, _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
    w = _mm512_permutexvar_ps(code, d->lut);
  } else if (dec == DEC_INT8) {
    const __m128i b = _mm_maskz_loadu_epi8(lanes, d->q + j);
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
    const __m512 p = _mm512_mul_ps(_mm512_sub_ps(q, d->z), d->s);
    w = d->nan ? round_act(p, act, true) : round_act(p, act, false);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(lanes, d->q + 2 * j);
    w = dec == DEC_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                        : _mm512_cvtph_ps(h);
  }
  return valid >= LANES ? w : _mm512_maskz_mov_ps(lanes, w);
}

/* ---- the kernels ---------------------------------------------------------------- */

/* The dot kernel's int4/mxfp4 chunks in a permuted lane order that makes
 * the nibble spread one broadcast and one shift: 8 bytes broadcast to every
 * 64-bit lane put the low 4 bytes in the even 32-bit lanes and the high 4
 * in the odd ones, so physical lane p takes nibble moe_weight_x_order[p]
 * (p / 2 of the low bytes for even p, 8 + p / 2 of the high ones for odd
 * p) after a shift by 4 * (p / 2). The token rows come in the same order
 * (the format's dot_x_ordered: the pipeline orders each row once) and the
 * accumulators are put back at the end: each logical lane still sums its
 * columns in the same order, so the bits do not move. */
static const int32_t perm_inv[LANES] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};

V512_INLINE __m512 chunk_permuted(const row_dec *d, int64_t j, int64_t valid) {
  uint64_t bytes = 0;
  memcpy(&bytes, d->q + (size_t)j / 2, valid >= LANES ? LANES / 2 : (size_t)valid / 2);
  const __m512i code =
      _mm512_srlv_epi32(_mm512_set1_epi64((long long)bytes),
                        _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28));
  return _mm512_permutexvar_ps(code, d->lut); /* vpermps reads the index's low 4 bits only */
}

/* The pipeline's fixed pairwise sum of 16 lanes (kernels/cpu/fused_moe.c
 * lanes_sum): lane l + lane l + 8, then + 4, then (c0 + c2) + (c1 + c3). */
V512_INLINE float lanes_sum(__m512 a) {
  const __m256 b = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c)); /* c0 + c2, c1 + c3 */
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

/* The accumulation of one chunk: a product, then a sum (two roundings, as
 * the pipeline's C lanes), per token row and weight row; `fused`: one
 * fused multiply-add, where row_dec.fuse proved each product exact. The
 * token rows' lanes are in the weights' order already (dot_x_ordered). */
V512_INLINE void dot_chunk(__m512 acc[DOT_TOKENS][DOT_ROWS], const __m512 *w, int mr, bool fused,
                           const float *const *x, int64_t j) {
#pragma GCC unroll 4
  for (int t = 0; t < mr; t++) {
    const __m512 xv = _mm512_loadu_ps(x[t] + j);
#pragma GCC unroll 4
    for (int r = 0; r < DOT_ROWS; r++)
      acc[t][r] = fused ? _mm512_fmadd_ps(xv, w[r], acc[t][r]) /* the product exact: the same bits */
                        : _mm512_add_ps(acc[t][r], _mm512_mul_ps(xv, w[r]));
  }
}

/* The full chunks [g0, g1) of one group of the DOT_ROWS rows. */
V512_INLINE void dot_group(const moe_weight_matrix *m, enum decoder dec, moe_dtype act, row_dec *d,
                           __m512 acc[DOT_TOKENS][DOT_ROWS], int mr, bool fused, const float *const *x,
                           int64_t g0, int64_t g1) {
  const bool permuted = dec == DEC_INT4 || dec == DEC_MXFP4;
  const int64_t line_cols = permuted ? 128 : dec == DEC_INT8 ? 64 : 32; /* columns per 64-byte line */
  for (int64_t j = g0; j < g1; j += LANES) {
    __m512 w[DOT_ROWS];
    /* the same line of the next call's rows (the pipeline's next 4 rows,
     * adjacent in storage) into L2, as this call's rows came in; a
     * prefetch never faults, past the last expert's rows either */
    if (j % line_cols == 0)
#pragma GCC unroll 4
      for (int r = 0; r < DOT_ROWS; r++)
        _mm_prefetch((const char *)d[r].q + DOT_ROWS * m->row_bytes + (j / line_cols) * 64, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int r = 0; r < DOT_ROWS; r++)
      w[r] = permuted ? chunk_permuted(&d[r], j, LANES) : row_chunk(dec, act, &d[r], j, LANES);
    dot_chunk(acc, w, mr, fused, x, j);
  }
}

/* int4: the tables of groups [g, g + n) of one row (n <= LANES) into
 * lut[i][r], their scales read and checked in one vector (the scalar loads,
 * exponent tests and finiteness tests of row_group were most of a group's
 * setup); the bits of *fuse of groups whose products are not proven exact
 * (fuse_window) cleared. The same table values as row_group. */
V512_INLINE void int4_luts(const moe_weight_matrix *m, moe_dtype act, fuse_window fw, int64_t e,
                           const row_dec *d, int r, int64_t g, int n, __m512 lut[][DOT_ROWS],
                           __mmask16 *fuse) {
  const __mmask16 valid = (__mmask16)((1u << n) - 1u);
  const size_t si = d->s0 + (size_t)g;
  __m512 sv;
  if (m->scale_dtype == MOE_F32) {
    sv = _mm512_maskz_loadu_ps(valid, (const float *)m->scales + si);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(valid, (const uint16_t *)m->scales + si);
    sv = m->scale_dtype == MOE_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                    : _mm512_cvtph_ps(h); /* exact, as moe_f16_to_f32 (NaN: a NaN) */
  }
  const __m512i b = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(sv), 23), _mm512_set1_epi32(0xFF));
  *fuse &= _mm512_cmpge_epi32_mask(b, _mm512_set1_epi32(fw.lo)) &
           _mm512_cmple_epi32_mask(b, _mm512_set1_epi32(fw.hi));
  const unsigned nonfinite = _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(0xFF));
  float sa[LANES];
  _mm512_storeu_ps(sa, sv);
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 c8 = _mm512_sub_ps(codes, _mm512_set1_ps(8.0f));
  for (int i = 0; i < n; i++) {
    const __m512 cz =
        m->zeros ? _mm512_sub_ps(codes, _mm512_set1_ps(moe_weight_zero_point(m, 4, e, d->n, g + i))) : c8;
    const __m512 p = _mm512_mul_ps(cz, _mm512_set1_ps(sa[i]));
    lut[i][r] = (nonfinite >> i) & 1u ? round_act(p, act, true) : round_act(p, act, false);
  }
}

/* dot (weight_format.h) for mr token rows, mr a constant after inlining:
 * the mr x 4 accumulators stay in registers, summed across lanes at the
 * end. Group by group (the tables loaded before its chunks), the row's
 * partial last chunk after them. */
V512_INLINE void dot_rows(const moe_weight_matrix *m, enum decoder dec, moe_dtype act, int64_t e,
                          const int64_t *rows, int mr, const float *const *x, moe_x_range xr, int64_t kp,
                          float *out) {
  const bool permuted = dec == DEC_INT4 || dec == DEC_MXFP4;
  const fuse_window fw = fuse_window_of(dec, act, xr);
  row_dec d[DOT_ROWS];
  __m512 acc[DOT_TOKENS][DOT_ROWS];
#pragma GCC unroll 4
  for (int r = 0; r < DOT_ROWS; r++) {
    row_open(m, e, rows[r], 0, &d[r]);
#pragma GCC unroll 4
    for (int t = 0; t < mr; t++)
      acc[t][r] = _mm512_setzero_ps();
  }
  const int64_t full = m->cols / LANES * LANES;
  if (dec == DEC_INT4) { /* the tables of up to LANES groups of the rows, then their chunks */
    const int64_t ngroups = (full + m->group - 1) / m->group;
    for (int64_t gb = 0; gb < ngroups; gb += LANES) {
      const int gn = ngroups - gb < LANES ? (int)(ngroups - gb) : LANES;
      __m512 lut[LANES][DOT_ROWS];
      __mmask16 fuse = 0xFFFF;
#pragma GCC unroll 4
      for (int r = 0; r < DOT_ROWS; r++)
        int4_luts(m, act, fw, e, &d[r], r, gb, gn, lut, &fuse);
      for (int i = 0; i < gn; i++) {
        const int64_t g0 = (gb + i) * m->group, g1 = g0 + m->group < full ? g0 + m->group : full;
#pragma GCC unroll 4
        for (int r = 0; r < DOT_ROWS; r++)
          d[r].lut = lut[i][r];
        if ((fuse >> i) & 1u)
          dot_group(m, dec, act, d, acc, mr, true, x, g0, g1);
        else
          dot_group(m, dec, act, d, acc, mr, false, x, g0, g1);
      }
    }
  }
  for (int64_t g0 = dec == DEC_INT4 ? full : 0, g = 0; g0 < full; g++) {
#pragma GCC unroll 4
    for (int r = 0; r < DOT_ROWS; r++)
      row_group(m, dec, act, fw, e, &d[r], g);
    const int64_t g1 = d[0].next < full ? d[0].next : full;
    if (d[0].fuse && d[1].fuse && d[2].fuse && d[3].fuse)
      dot_group(m, dec, act, d, acc, mr, true, x, g0, g1);
    else
      dot_group(m, dec, act, d, acc, mr, false, x, g0, g1);
    g0 = g1;
  }
  if (full < kp) { /* columns past cols: +0 weights, as the strip's zero padding */
    const int64_t valid = m->cols - full;
    __mmask16 keep = 0; /* the physical lanes of the valid columns */
    for (int p = 0; p < LANES; p++)
      keep |= (__mmask16)((permuted ? moe_weight_x_order[p] : p) < valid) << p;
    __m512 w[DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < DOT_ROWS; r++) {
      row_group(m, dec, act, fw, e, &d[r], group_of(m, full));
      w[r] = _mm512_maskz_mov_ps(keep, permuted ? chunk_permuted(&d[r], full, valid)
                                                : row_chunk(dec, act, &d[r], full, valid));
    }
    dot_chunk(acc, w, mr, false, x, full);
  }
#pragma GCC unroll 4
  for (int t = 0; t < mr; t++)
#pragma GCC unroll 4
    for (int r = 0; r < DOT_ROWS; r++)
      out[t * DOT_ROWS + r] =
          lanes_sum(permuted ? _mm512_permutexvar_ps(_mm512_loadu_si512(perm_inv), acc[t][r]) : acc[t][r]);
}

V512_INLINE void dot_dec(const moe_weight_matrix *m, enum decoder dec, int64_t e, const int64_t *rows, int mr,
                         const float *const *x, moe_x_range xr, int64_t kp, float *out) {
  const bool f16 = m->act == MOE_F16;
  switch (mr) { /* each token count its own loop: the accumulators stay in registers */
  case 4:
    f16 ? dot_rows(m, dec, MOE_F16, e, rows, 4, x, xr, kp, out)
        : dot_rows(m, dec, MOE_BF16, e, rows, 4, x, xr, kp, out);
    break;
  case 3:
    f16 ? dot_rows(m, dec, MOE_F16, e, rows, 3, x, xr, kp, out)
        : dot_rows(m, dec, MOE_BF16, e, rows, 3, x, xr, kp, out);
    break;
  case 2:
    f16 ? dot_rows(m, dec, MOE_F16, e, rows, 2, x, xr, kp, out)
        : dot_rows(m, dec, MOE_BF16, e, rows, 2, x, xr, kp, out);
    break;
  default:
    f16 ? dot_rows(m, dec, MOE_F16, e, rows, 1, x, xr, kp, out)
        : dot_rows(m, dec, MOE_BF16, e, rows, 1, x, xr, kp, out);
    break;
  }
}

/* dequant_fast: chunks stored whole, the last one by its valid lanes. */
V512_INLINE void dequant_rows(const moe_weight_matrix *m, enum decoder dec, moe_dtype act, int64_t e,
                              int64_t n0, int64_t nrows, int64_t k0, int64_t ncols, float *dst, size_t ld) {
  for (int64_t r = 0; r < nrows; r++) {
    row_dec d;
    row_open(m, e, n0 + r, k0, &d);
    float *out = dst + (size_t)r * ld - k0;
    for (int64_t j = k0; j < k0 + ncols; j += LANES) {
      const int64_t valid = k0 + ncols - j < LANES ? k0 + ncols - j : LANES;
      if (j >= d.next) row_group(m, dec, act, (fuse_window){1, 0}, e, &d, group_of(m, j));
      const __m512 w = row_chunk(dec, act, &d, j, valid);
      _mm512_mask_storeu_ps(out + j, valid >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1u), w);
    }
  }
}

V512_INLINE void dequant_dec(const moe_weight_matrix *m, enum decoder dec, int64_t e, int64_t n0,
                             int64_t nrows, int64_t k0, int64_t ncols, float *dst, size_t ld) {
  if (!moe_weight_vector_ok(m) || k0 % LANES != 0) {
    m->fmt->dequant(m, e, n0, nrows, k0, ncols, dst, ld);
    return;
  }
  if (m->act == MOE_F16)
    dequant_rows(m, dec, MOE_F16, e, n0, nrows, k0, ncols, dst, ld);
  else
    dequant_rows(m, dec, MOE_BF16, e, n0, nrows, k0, ncols, dst, ld);
}

/* Each format's two members: the decoder a constant in each. */
#define FORMAT_KERNELS(name, dec)                                                                            \
  V512 void moe_dot_##name##_avx512(const moe_weight_matrix *m, int64_t e, const int64_t *rows, int mr,      \
                                    const float *const *x, moe_x_range xr, int64_t kp, float *out) {         \
    dot_dec(m, dec, e, rows, mr, x, xr, kp, out);                                                            \
  }                                                                                                          \
  V512 void moe_dequant_##name##_avx512(const moe_weight_matrix *m, int64_t e, int64_t n0, int64_t nrows,    \
                                        int64_t k0, int64_t ncols, float *dst, size_t ld) {                  \
    dequant_dec(m, dec, e, n0, nrows, k0, ncols, dst, ld);                                                   \
  }
FORMAT_KERNELS(bf16, DEC_BF16)
FORMAT_KERNELS(fp16, DEC_FP16)
FORMAT_KERNELS(int4, DEC_INT4)
FORMAT_KERNELS(int8, DEC_INT8)
FORMAT_KERNELS(mxfp4, DEC_MXFP4)
