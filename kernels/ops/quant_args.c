/* Parameter parsing shared by quant.* and dequant.* (one table per concept). */
#include <string.h>

#include "quant_args.h"

const moe_dtype moe_float_dtypes[] = {MOE_F32, MOE_F16, MOE_BF16, MOE_DTYPE_INVALID};

/* The per-tensor / per-token formats and their dtype_max (docs/numerics.md). */
static const struct {
  const char *name;
  moe_dtype dtype;
  float dtype_max;
} scaled_formats[] = {
    {"fp8_e4m3fn", MOE_FP8_E4M3FN, 448.0f},
    {"fp8_e4m3fnuz", MOE_FP8_E4M3FNUZ, 240.0f},
    {"int8", MOE_INT8, 127.0f},
    {NULL, MOE_DTYPE_INVALID, 0},
};

/* The MX formats. */
static const struct {
  const char *name;
  moe_dtype dtype;
} mx_formats[] = {
    {"mxfp4", MOE_FP4_E2M1},
    {"mxfp8_e4m3fn", MOE_FP8_E4M3FN},
    {"mxfp8_e5m2", MOE_FP8_E5M2},
    {NULL, MOE_DTYPE_INVALID},
};

static const char *const scaled_names[] = {"fp8_e4m3fn", "fp8_e4m3fnuz", "int8", NULL};
static const char *const mx_names[] = {"mxfp4", "mxfp8_e4m3fn", "mxfp8_e5m2", NULL};
static const char *const float_names[] = {"fp32", "fp16", "bf16", NULL};
static const moe_dtype float_by_index[] = {MOE_F32, MOE_F16, MOE_BF16};

moe_status moe_parse_scaled_dtype(const moe_params *p, const char *param, moe_dtype dflt, moe_scaled_args *a,
                                  moe_error *err) {
  int idx = -1;
  for (int i = 0; scaled_formats[i].name; i++)
    if (scaled_formats[i].dtype == dflt) idx = i;
  moe_status s = moe_params_choice(p, param, scaled_names, &idx, err);
  if (s) return s;
  a->qdtype = scaled_formats[idx].dtype;
  a->dtype_max = scaled_formats[idx].dtype_max;
  a->fmt = moe_narrow_fmt_of(a->qdtype);
  return MOE_OK;
}

moe_status moe_parse_mx_format(const moe_params *p, moe_mx_args *a, moe_error *err) {
  int idx = 0;
  moe_status s = moe_params_choice(p, "format", mx_names, &idx, err);
  if (s) return s;
  a->qdtype = mx_formats[idx].dtype;
  a->fmt = moe_narrow_fmt_of(a->qdtype);
  return MOE_OK;
}

moe_status moe_parse_out_float(const moe_params *p, moe_dtype *out, moe_error *err) {
  int idx = 0;
  moe_status s = moe_params_choice(p, "out_dtype", float_names, &idx, err);
  if (s) return s;
  *out = float_by_index[idx];
  return MOE_OK;
}

moe_status moe_read_static_scale(const moe_tensor *t, const char *what, float *out, moe_error *err) {
  static const moe_dtype f32[] = {MOE_F32, MOE_DTYPE_INVALID};
  moe_status s = moe_check_dtype(t, what, f32, err);
  if (s) return s;
  s = moe_check_shape(t, what, 0, MOE_MAX_DIMS, err);
  if (s) return s;
  size_t n = 0;
  moe_tensor_numel(t, &n);
  if (n != 1) return moe_fail(err, MOE_EINVAL, "%s: expected one element, got %zu", what, n);
  float v;
  memcpy(&v, t->data, sizeof v);
  if (!moe_f32_isfinite(v) || !(v > 0.0f))
    return moe_fail(err, MOE_EINVAL, "%s: must be finite and > 0 (got %g)", what, (double)v);
  *out = v;
  return MOE_OK;
}
