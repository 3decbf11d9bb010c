/* Internal: the weight formats of fused_moe on the CPU.
 *
 * docs/design.md: a weight scheme plugs into fused_moe as a small weight-format
 * interface, never as a copy of the pipeline. A format knows one thing: how
 * to turn a tile of one expert's matrix into fp32 values already rounded to
 * the activation dtype (docs/numerics.md "fused_moe": w = act(...)). The pipeline
 * (kernels/cpu/fused_moe.c) does the rest, the same for every format.
 *
 * One scheme has its scales outside the weights: fp8 multiplies the sums of
 * exact code products by activation and weight scales per K block
 * (docs/numerics.md "Weight scheme fp8"). Its format gives the codes' exact
 * values and the matrix says how the GEMM scales them (`scaled` and the
 * fields after it): a parameter of the one pipeline, not a second one. */
#ifndef MOE_CPU_WEIGHT_FORMAT_H
#define MOE_CPU_WEIGHT_FORMAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu.h"
#include "moe/codec.h"
#include "moe/expert_set.h"
#include "moe/tensor.h"

/* For helpers of a MOE_CPU_HOT function: inlined, they are built for its ISA too. */
#define MOE_CPU_INLINE static inline __attribute__((always_inline))

typedef struct moe_weight_format moe_weight_format;

/* One GEMM's weights in an expert set: per expert a matrix of `rows` outputs
 * by `cols` inputs (W13: 2I x H, W2: H x I), row-major, in the set's storage. */
typedef struct moe_weight_matrix {
  const moe_weight_format *fmt;
  int64_t rows, cols;
  moe_dtype act;       /* F16 or BF16: what w is rounded to */
  const uint8_t *data; /* bf16/fp16 values, or codes: int4 / e2m1 (two per byte along cols), int8 / e4m3fn */
  size_t row_bytes;    /* bytes of one row of data */
  /* wna16, mxfp4 (and fp8: its weight scales, applied in the GEMM) */
  const void *scales;    /* [E, rows, groups]; fp8: see moe_weight_row_scales */
  moe_dtype scale_dtype; /* F32, F16 or BF16; mxfp4: UINT8 (e8m0) */
  const uint8_t
      *zeros;     /* [E, rows / 2, groups] (int4, packed along rows) or [E, rows, groups]; NULL: default */
  int64_t group;  /* columns per group (cols when one group per row); mxfp4: 32 */
  int64_t groups; /* cols / group */
  /* every scheme: the bias [E, rows] (F32 or the activation dtype); NULL: none */
  const void *bias;
  moe_dtype bias_dtype;
  /* fp8: the GEMM scales its block sums (dequant gives exact code values) */
  bool scaled;
  bool blockwise;          /* acc = SUM_b p_b * (sx_b * sw_b); else acc = (p * sx) * sw */
  int64_t kblock;          /* columns per K block: BK, or cols */
  int64_t scale_rows;      /* rows per weight scale: BN (block), 1 (per_channel), rows (per_tensor) */
  int64_t scale_cols;      /* weight scales per row of them: cols / BK, or 1 */
  const float *act_scales; /* static activation scales [E] (a13_scale / a2_scale); NULL: per token */
  bool exact_division;     /* activation quantization: x / s instead of x * (1 / s) */
} moe_weight_matrix;

/* fp8: the weight scales of row n of expert e, one per K block. */
static inline const float *moe_weight_row_scales(const moe_weight_matrix *m, int64_t e, int64_t n) {
  const int64_t row_blocks = (m->rows + m->scale_rows - 1) / m->scale_rows;
  return (const float *)m->scales +
         ((size_t)e * (size_t)row_blocks + (size_t)(n / m->scale_rows)) * (size_t)m->scale_cols;
}

/* The bias of row n of expert e as fp32 (0 without biases). */
static inline float moe_weight_bias(const moe_weight_matrix *m, int64_t e, int64_t n) {
  if (!m->bias) return 0.0f;
  const size_t i = (size_t)e * (size_t)m->rows + (size_t)n;
  switch (m->bias_dtype) {
  case MOE_F16: return moe_f16_to_f32(((const uint16_t *)m->bias)[i]);
  case MOE_BF16: return moe_bf16_to_f32(((const uint16_t *)m->bias)[i]);
  default: return ((const float *)m->bias)[i];
  }
}

/* Columns per chunk of the vector decoders: the dot kernels' lane count
 * (kernels/cpu/fused_moe.c), lane l of a chunk at j holding column j + l. */
#define MOE_WEIGHT_LANES 16
/* Weight rows per call of a format's dot (the pipeline's NR). */
#define MOE_WEIGHT_DOT_ROWS 4
/* Token rows per call of a format's dot, at most (the pipeline's MR). */
#define MOE_WEIGHT_DOT_TOKENS 4

/* What a format's dot may know of its token rows to use one fused
 * multiply-add where the contract asks for a rounded product then a sum:
 * when x and w are both values of the activation dtype (8 or 11
 * significant bits), x * w has at most 22 significant bits and is exact in
 * fp32 unless it leaves the normal range; then fma(x, w, acc) rounds once,
 * exactly as acc + round(x * w), and the bits do not move. `exact`: every
 * value is finite and of the activation dtype; then each nonzero |x| lies
 * in [2^lo, 2^hi) (lo > hi when every value is 0). */
typedef struct moe_x_range {
  bool exact;
  int lo, hi;
} moe_x_range;

/* The range of no rows (every value 0): lo > hi, exact. */
#define MOE_X_RANGE_EMPTY ((moe_x_range){true, 1000, -1000})

/* The range of x[0..n) for activations of dtype act (F16 or BF16). */
moe_x_range moe_weight_x_range(const float *x, int64_t n, moe_dtype act);
/* The range of token rows a and b together. */
static inline moe_x_range moe_x_range_join(moe_x_range a, moe_x_range b) {
  return (moe_x_range){a.exact && b.exact, a.lo < b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi};
}

typedef void moe_weight_dequant_fn(const moe_weight_matrix *m, int64_t e, int64_t n0, int64_t nrows,
                                   int64_t k0, int64_t ncols, float *dst, size_t ld);

struct moe_weight_format {
  const char *name;
  /* dst[r * ld + j] = w[e][n0 + r][k0 + j] dequantized and act-rounded, for
   * r < nrows and j < ncols. k0 and ncols even (int4 never splits a byte).
   * Written element by element: the reference the vector kernels equal. */
  moe_weight_dequant_fn *dequant;
  /* (optional) the same values, 16 columns at a time with vector shuffles
   * where the matrix's groups allow (moe_weight_vector_ok), else dequant.
   * The vector members need AVX-512 (moe_cpu_vector_kernels). */
  moe_weight_dequant_fn *dequant_fast;
  /* (optional, only where moe_weight_vector_ok) the dot products of token
   * rows x[0..mr) (1 <= mr <= MOE_WEIGHT_DOT_TOKENS, kp columns: a multiple of
   * 16, zero past cols) with weight rows rows[0..MOE_WEIGHT_DOT_ROWS) of
   * expert e, decoded from storage into registers and never written out:
   * out[m * DOT_ROWS + r], in the pipeline's order (kernels/cpu/fused_moe.c):
   * lane l sums x[m][j] * w[j] for j = l, l + 16, ... in ascending order,
   * each product rounded, then added; the 16 lanes are then added pairwise
   * (l with l + 8, then + 4, then (0 + 2) + (1 + 3)). So the same bits as
   * a dequantized strip through the pipeline's dot kernels; columns past
   * cols count as +0 weights. `xr`: the range of the mr token rows together
   * (moe_x_range): where it and a group's scale prove every product exact,
   * the group's multiply-adds are fused, with the same bits. */
  void (*dot)(const moe_weight_matrix *m, int64_t e, const int64_t *rows, int mr, const float *const *x,
              moe_x_range xr, int64_t kp, float *out);
  /* dot takes its token rows with each 16-column chunk in moe_weight_x_order
   * (made once per row by moe_weight_order_x): the order its decoder yields
   * the weights in, so no chunk of x is shuffled per weight row block */
  bool dot_x_ordered;
};

/* Physical lane p of a chunk holds column moe_weight_x_order[p] where a
 * format's dot_x_ordered says so: the int4 and mxfp4 decoders spread 8
 * bytes of codes with one broadcast and one shift, which puts the low
 * nibbles' columns 0-7 in the even lanes and the high ones' 8-15 in the
 * odd lanes (kernels/cpu/weight_avx512.c). */
extern const int32_t moe_weight_x_order[MOE_WEIGHT_LANES];
/* dst[c * 16 + p] = src[c * 16 + moe_weight_x_order[p]] for kp columns (a
 * multiple of 16); a permutation, so the values and ranges stay the same. */
void moe_weight_order_x(float *dst, const float *src, int64_t kp);

/* Whether every 16-column chunk of m's rows lies in one scale group (the
 * vector decoders take one group's scale and zero point per chunk). */
static inline bool moe_weight_vector_ok(const moe_weight_matrix *m) {
  return !m->scaled && (m->groups <= 1 || m->group % MOE_WEIGHT_LANES == 0);
}

/* Row n of expert e in storage. */
MOE_CPU_INLINE const uint8_t *moe_weight_row(const moe_weight_matrix *m, int64_t e, int64_t n) {
  return m->data + ((size_t)e * (size_t)m->rows + (size_t)n) * m->row_bytes;
}

/* wna16: the zero point of row n, group g: int4 packs two rows per byte
 * (low nibble = even row); without zero points the code's midpoint (8 or 128). */
MOE_CPU_INLINE float moe_weight_zero_point(const moe_weight_matrix *m, int bits, int64_t e, int64_t n,
                                           int64_t g) {
  if (!m->zeros) return bits == 4 ? 8.0f : 128.0f;
  if (bits == 4) {
    uint8_t b =
        m->zeros[((size_t)e * (size_t)(m->rows / 2) + (size_t)(n / 2)) * (size_t)m->groups + (size_t)g];
    return (float)((n & 1) ? b >> 4 : b & 15);
  }
  return (float)m->zeros[((size_t)e * (size_t)m->rows + (size_t)n) * (size_t)m->groups + (size_t)g];
}

/* e2m1's value of each code. */
extern const float moe_e2m1_value[16];

/* The AVX-512 members of the formats (kernels/cpu/weight_avx512.c). */
void moe_dot_bf16_avx512(const moe_weight_matrix *m, int64_t e, const int64_t *rows, int mr,
                         const float *const *x, moe_x_range xr, int64_t kp, float *out);
void moe_dot_fp16_avx512(const moe_weight_matrix *m, int64_t e, const int64_t *rows, int mr,
                         const float *const *x, moe_x_range xr, int64_t kp, float *out);
void moe_dot_int4_avx512(const moe_weight_matrix *m, int64_t e, const int64_t *rows, int mr,
                         const float *const *x, moe_x_range xr, int64_t kp, float *out);
void moe_dot_int8_avx512(const moe_weight_matrix *m, int64_t e, const int64_t *rows, int mr,
                         const float *const *x, moe_x_range xr, int64_t kp, float *out);
void moe_dot_mxfp4_avx512(const moe_weight_matrix *m, int64_t e, const int64_t *rows, int mr,
                          const float *const *x, moe_x_range xr, int64_t kp, float *out);
moe_weight_dequant_fn moe_dequant_bf16_avx512, moe_dequant_fp16_avx512, moe_dequant_int4_avx512,
    moe_dequant_int8_avx512, moe_dequant_mxfp4_avx512;

/* Matrix `which` (MOE_W13 or MOE_W2) of a validated set, for activations of
 * dtype `act` (the caller has checked that the set's scheme accepts it). */
void moe_weight_matrix_init(const moe_expert_set *set, moe_expert_tensor which, moe_dtype act,
                            moe_weight_matrix *m);

#endif
