/* The dtype table and tensor size arithmetic. */
#include <string.h>

#include "moe/tensor.h"

/* One row per dtype, indexed by moe_dtype. */
static const struct {
  const char *name;
  unsigned bits;
  bool is_float;
} dtype_table[MOE_DTYPE_COUNT] = {
    [MOE_DTYPE_INVALID] = {"invalid", 0, false},
    [MOE_F32] = {"fp32", 32, true},
    [MOE_F16] = {"fp16", 16, true},
    [MOE_BF16] = {"bf16", 16, true},
    [MOE_FP8_E4M3FN] = {"fp8_e4m3fn", 8, false},
    [MOE_FP8_E4M3FNUZ] = {"fp8_e4m3fnuz", 8, false},
    [MOE_FP8_E5M2] = {"fp8_e5m2", 8, false},
    [MOE_INT8] = {"int8", 8, false},
    [MOE_UINT8] = {"uint8", 8, false},
    [MOE_INT32] = {"int32", 32, false},
    [MOE_E8M0] = {"e8m0", 8, false},
    [MOE_FP4_E2M1] = {"fp4_e2m1", 4, false},
};

const char *moe_dtype_name(moe_dtype t) {
  return (t > 0 && t < MOE_DTYPE_COUNT) ? dtype_table[t].name : "invalid";
}

moe_dtype moe_dtype_from_name(const char *name) {
  if (!name) return MOE_DTYPE_INVALID;
  for (int t = 1; t < MOE_DTYPE_COUNT; t++)
    if (strcmp(dtype_table[t].name, name) == 0) return (moe_dtype)t;
  return MOE_DTYPE_INVALID;
}

unsigned moe_dtype_bits(moe_dtype t) { return (t > 0 && t < MOE_DTYPE_COUNT) ? dtype_table[t].bits : 0; }

bool moe_dtype_is_float(moe_dtype t) { return (t > 0 && t < MOE_DTYPE_COUNT) && dtype_table[t].is_float; }

bool moe_mul_size(size_t a, size_t b, size_t *out) { return !__builtin_mul_overflow(a, b, out); }

bool moe_add_size(size_t a, size_t b, size_t *out) { return !__builtin_add_overflow(a, b, out); }

moe_status moe_tensor_numel(const moe_tensor *t, size_t *out) {
  if (t->ndim < 0 || t->ndim > MOE_MAX_DIMS) return MOE_EOVERFLOW;
  size_t n = 1;
  for (int i = 0; i < t->ndim; i++) {
    /* int64 dims must stay representable in both size_t and int64 products */
    if (t->shape[i] < 0 || !moe_mul_size(n, (size_t)t->shape[i], &n) || n > (size_t)INT64_MAX)
      return MOE_EOVERFLOW;
  }
  *out = n;
  return MOE_OK;
}

moe_status moe_tensor_bytes(const moe_tensor *t, size_t *out) {
  size_t n;
  moe_status s = moe_tensor_numel(t, &n);
  if (s) return s;
  unsigned bits = moe_dtype_bits(t->dtype);
  if (bits == 0) return MOE_EINVAL;
  if (bits == 4) { /* packed pairs along the last axis */
    *out = n / 2 + (n & 1);
    return MOE_OK;
  }
  return moe_mul_size(n, bits / 8, out) ? MOE_OK : MOE_EOVERFLOW;
}

int64_t moe_tensor_rows(const moe_tensor *t) {
  int64_t r = 1;
  for (int i = 0; i + 1 < t->ndim; i++)
    r *= t->shape[i];
  return r;
}

int64_t moe_tensor_cols(const moe_tensor *t) { return t->ndim > 0 ? t->shape[t->ndim - 1] : 1; }
