/* quant.mx: docs/numerics.md "quant.mx (mxfp4, mxfp8 e4m3fn, mxfp8 e5m2)". */
#include "quant_args.h"

static const moe_op_io_desc inputs[] = {
    {"x", false, "fp32,fp16,bf16", 0, "T,K"},
};
static const moe_op_io_desc outputs[] = {
    {"q", false, "fp4_e2m1,fp8_e4m3fn,fp8_e5m2", 0, "T,K"},
    {"scales", false, "e8m0", 0, "T,G"},
};

static const char *const rule_names[] = {"even", "floor", "amax_up", "amax_down", NULL};
static const char *const rounding_names[] = {"rne", "half_up", NULL};

static moe_status prepare(moe_call *c, const moe_params *p, moe_error *err) {
  moe_mx_args *a = &c->args.mx;
  const moe_tensor *x = &c->in[0].tensor;
  moe_status s = moe_check_dtype(x, "x", moe_float_dtypes, err);
  if (!s) s = moe_check_shape(x, "x", 1, MOE_MAX_DIMS, err);
  if (!s) s = moe_parse_mx_format(p, a, err);
  if (s) return s;
  int rule = MOE_MX_EVEN, rounding = 0;
  if ((s = moe_params_choice(p, "scale_rule", rule_names, &rule, err))) return s;
  if ((s = moe_params_choice(p, "element_rounding", rounding_names, &rounding, err))) return s;
  a->rule = (moe_mx_rule)rule;
  a->half_up = rounding == 1;
  if (a->half_up && a->qdtype != MOE_FP4_E2M1)
    return moe_fail(err, MOE_EINVAL, "parameter 'element_rounding' = 'half_up' is only offered for mxfp4");
  int64_t k = moe_tensor_cols(x);
  if (k % 32)
    return moe_fail(err, MOE_EINVAL, "x: last dimension K = %lld is not a multiple of 32 (MX block size)",
                    (long long)k);
  int64_t scales_shape[MOE_MAX_DIMS];
  for (int d = 0; d < x->ndim; d++)
    scales_shape[d] = x->shape[d];
  scales_shape[x->ndim - 1] = k / 32;
  s = moe_call_set_output(c, 0, a->qdtype, x->ndim, x->shape, err);
  if (!s) s = moe_call_set_output(c, 1, MOE_E8M0, x->ndim, scales_shape, err);
  return s;
}

const moe_op moe_op_quant_mx = {
    .info = {"quant.mx", inputs, 1, outputs, 2, true},
    .prepare = prepare,
    .cpu = moe_cpu_quant_mx,
    .gpu = MOE_GPU_FN(moe_gpu_quant_mx),
};
