/* quant.per_token: docs/numerics.md "quant.per_token". */
#include "quant_args.h"

static const moe_op_io_desc inputs[] = {
    {"x", false, "fp32,fp16,bf16", 0, "T,K"},
};
static const moe_op_io_desc outputs[] = {
    {"q", false, "fp8_e4m3fn,fp8_e4m3fnuz,int8", 0, "T,K"},
    {"scales", false, "fp32", 0, "T,1"},
};

static moe_status prepare(moe_call *c, const moe_params *p, moe_error *err) {
  moe_scaled_args *a = &c->args.scaled;
  const moe_tensor *x = &c->in[0].tensor;
  moe_status s = moe_check_dtype(x, "x", moe_float_dtypes, err);
  if (!s) s = moe_check_shape(x, "x", 1, MOE_MAX_DIMS, err);
  if (!s) s = moe_parse_scaled_dtype(p, "out_dtype", MOE_FP8_E4M3FN, a, err);
  if (!s) s = moe_params_bool(p, "exact_division", &a->exact_division, err);
  if (s) return s;
  double ub = 0;
  a->has_scale_ub = moe_params_has(p, "scale_ub");
  if ((s = moe_params_double(p, "scale_ub", &ub, err))) return s;
  if (a->has_scale_ub) {
    a->scale_ub = (float)ub;
    if (!moe_f32_isfinite(a->scale_ub) || !(a->scale_ub > 0.0f))
      return moe_fail(err, MOE_EINVAL, "parameter 'scale_ub' must be finite and > 0 as fp32 (got %g)", ub);
  }
  a->group = moe_tensor_cols(x);
  int64_t scales_shape[2] = {moe_tensor_rows(x), 1};
  s = moe_call_set_output(c, 0, a->qdtype, x->ndim, x->shape, err);
  if (!s) s = moe_call_set_output(c, 1, MOE_F32, 2, scales_shape, err);
  return s;
}

const moe_op moe_op_quant_per_token = {
    .info = {"quant.per_token", inputs, 1, outputs, 2, true},
    .prepare = prepare,
    .cpu = moe_cpu_quant_grouped,
    .gpu = MOE_GPU_FN(moe_gpu_quant_grouped),
};
