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

struct moe_weight_format {
  const char *name;
  /* dst[r * ld + j] = w[e][n0 + r][k0 + j] dequantized and act-rounded, for
   * r < nrows and j < ncols. k0 and ncols even (int4 never splits a byte). */
  void (*dequant)(const moe_weight_matrix *m, int64_t e, int64_t n0, int64_t nrows, int64_t k0, int64_t ncols,
                  float *dst, size_t ld);
};

/* Matrix `which` (MOE_W13 or MOE_W2) of a validated set, for activations of
 * dtype `act` (the caller has checked that the set's scheme accepts it). */
void moe_weight_matrix_init(const moe_expert_set *set, moe_expert_tensor which, moe_dtype act,
                            moe_weight_matrix *m);

#endif
