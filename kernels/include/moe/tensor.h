/* moe: dtypes and tensor descriptors. */
#ifndef MOE_TENSOR_H
#define MOE_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every element type an op reads or writes. The one table that describes
 * them is in kernels/ops/dtype.c. */
typedef enum moe_dtype {
  MOE_DTYPE_INVALID = 0,
  MOE_F32,
  MOE_F16,
  MOE_BF16,
  MOE_FP8_E4M3FN,
  MOE_FP8_E4M3FNUZ,
  MOE_FP8_E5M2,
  MOE_INT8,
  MOE_UINT8,
  MOE_INT32,
  MOE_E8M0,
  MOE_FP4_E2M1, /* packed two per byte along the last axis (low nibble first) */
  MOE_DTYPE_COUNT
} moe_dtype;

/* Name as used in op parameters and docs/numerics.md ("bf16", "fp8_e4m3fn"). */
const char *moe_dtype_name(moe_dtype t);
/* MOE_DTYPE_INVALID when unknown. */
moe_dtype moe_dtype_from_name(const char *name);
/* Storage bits per element (4 for FP4_E2M1). 0 for INVALID. */
unsigned moe_dtype_bits(moe_dtype t);
/* True for F32, F16, BF16: the dtypes widened to fp32 exactly. */
bool moe_dtype_is_float(moe_dtype t);

#define MOE_MAX_DIMS 8

/* A row-major contiguous tensor. `shape` counts elements, also for packed
 * FP4 (whose last axis must then be even); `data` lives in the memory of the
 * backend the op runs on; `nbytes` is the size of that buffer. */
typedef struct moe_tensor {
  moe_dtype dtype;
  int32_t ndim;
  int64_t shape[MOE_MAX_DIMS];
  void *data;
  size_t nbytes;
} moe_tensor;

/* Element count; MOE_EOVERFLOW (with *out untouched) when a dim is negative
 * or the product does not fit size_t / int64. */
moe_status moe_tensor_numel(const moe_tensor *t, size_t *out);
/* Bytes the shape and dtype need (overflow-checked as above). */
moe_status moe_tensor_bytes(const moe_tensor *t, size_t *out);
/* Rows when all axes but the last are flattened (1 for rank 0 and 1). */
int64_t moe_tensor_rows(const moe_tensor *t);
/* Length of the last axis (1 for rank 0). */
int64_t moe_tensor_cols(const moe_tensor *t);

/* Overflow-checked size arithmetic: false when the result does not fit. */
bool moe_mul_size(size_t a, size_t b, size_t *out);
bool moe_add_size(size_t a, size_t b, size_t *out);

#ifdef __cplusplus
}
#endif
#endif
