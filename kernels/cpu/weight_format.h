/* Internal: the weight formats of fused_moe on the CPU.
 *
 * docs/design.md: a weight scheme plugs into fused_moe as a small weight-format
 * interface, never as a copy of the pipeline. A format knows one thing: how
 * to turn a tile of one expert's matrix into fp32 values already rounded to
 * the activation dtype (docs/numerics.md "fused_moe": w = act(...)). The pipeline
 * (kernels/cpu/fused_moe.c) does the rest, the same for every format. */
#ifndef MOE_CPU_WEIGHT_FORMAT_H
#define MOE_CPU_WEIGHT_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#include "cpu.h"
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
  const uint8_t *data; /* bf16/fp16 values, or int4 (two per byte along cols) / int8 codes */
  size_t row_bytes;    /* bytes of one row of data */
  /* wna16 only */
  const void *scales;    /* [E, rows, groups] */
  moe_dtype scale_dtype; /* F32, F16 or BF16 */
  const uint8_t
      *zeros;     /* [E, rows / 2, groups] (int4, packed along rows) or [E, rows, groups]; NULL: default */
  int64_t group;  /* columns per group (cols when one group per row) */
  int64_t groups; /* cols / group */
} moe_weight_matrix;

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
