/* quant.per_tensor: docs/numerics.md "quant.per_tensor (static and dynamic)". */
#include "quant_args.h"

static const moe_op_io_desc inputs[] = {
    {"x", false, "fp32,fp16,bf16", 0, "T,K"},
    {"scale", true, "fp32", 0, "1"},
};
static const moe_op_io_desc outputs[] = {
    {"q", false, "fp8_e4m3fn,fp8_e4m3fnuz,int8", 0, "T,K"},
    {"scale", false, "fp32", 0, "1"},
};

static moe_status prepare(moe_call *c, const moe_params *p, moe_error *err) {
  moe_scaled_args *a = &c->args.scaled;
  const moe_tensor *x = &c->in[0].tensor;
  moe_status s = moe_check_dtype(x, "x", moe_float_dtypes, err);
  if (!s) s = moe_check_shape(x, "x", 0, MOE_MAX_DIMS, err);
  if (!s) s = moe_parse_scaled_dtype(p, "out_dtype", MOE_FP8_E4M3FN, a, err);
  if (!s) s = moe_params_bool(p, "exact_division", &a->exact_division, err);
  if (s) return s;
  const moe_tensor *scale = moe_call_in(c, 1);
  a->has_static_scale = scale != NULL;
  if (scale && (s = moe_read_static_scale(scale, "scale", &a->static_scale, err))) return s;
  static const int64_t one[1] = {1};
  s = moe_call_set_output(c, 0, a->qdtype, x->ndim, x->shape, err);
  if (!s) s = moe_call_set_output(c, 1, MOE_F32, 1, one, err);
  return s;
}

const moe_op moe_op_quant_per_tensor = {
    .info = {"quant.per_tensor", inputs, 2, outputs, 2, false},
    .prepare = prepare,
    .cpu = moe_cpu_quant_per_tensor,
    .gpu = MOE_GPU_FN(moe_gpu_quant_per_tensor),
};
