/* quant.per_token_group: docs/numerics.md "quant.per_token_group". */
#include "quant_args.h"

static const moe_op_io_desc inputs[] = {
    {"x", false, "fp32,fp16,bf16", 0, "T,K"},
};
static const moe_op_io_desc outputs[] = {
    {"q", false, "fp8_e4m3fn,fp8_e4m3fnuz,int8", 0, "T,K"},
    {"scales", false, "fp32", 0, "T,S"}, /* S = K / group_size */
};

static const char *const scale_rules[] = {"exact", "pow2_up", NULL};

static moe_status prepare(moe_call *c, const moe_params *p, moe_error *err) {
  moe_scaled_args *a = &c->args.scaled;
  const moe_tensor *x = &c->in[0].tensor;
  moe_status s = moe_check_dtype(x, "x", moe_float_dtypes, err);
  if (!s) s = moe_check_shape(x, "x", 1, MOE_MAX_DIMS, err);
  if (!s) s = moe_parse_scaled_dtype(p, "out_dtype", MOE_FP8_E4M3FN, a, err);
  if (!s) s = moe_params_bool(p, "exact_division", &a->exact_division, err);
  int rule = 0;
  if (!s) s = moe_params_choice(p, "scale_rule", scale_rules, &rule, err);
  int64_t g = 128;
  if (!s) s = moe_params_int(p, "group_size", &g, err);
  if (s) return s;
  const int64_t k = moe_tensor_cols(x);
  if (g < 1 || (k % g) != 0)
    return moe_fail(err, MOE_EINVAL,
                    "parameter 'group_size' (%lld) must be >= 1 and divide x's last axis (%lld)",
                    (long long)g, (long long)k);
  a->group = g;
  a->pow2_scale = rule == 1;
  int64_t scales_shape[MOE_MAX_DIMS];
  for (int i = 0; i + 1 < x->ndim; i++)
    scales_shape[i] = x->shape[i];
  scales_shape[x->ndim - 1] = k / g;
  s = moe_call_set_output(c, 0, a->qdtype, x->ndim, x->shape, err);
  if (!s) s = moe_call_set_output(c, 1, MOE_F32, x->ndim, scales_shape, err);
  return s;
}

const moe_op moe_op_quant_per_token_group = {
    .info = {"quant.per_token_group", inputs, 1, outputs, 2, true},
    .prepare = prepare,
    .cpu = moe_cpu_quant_grouped,
    .gpu = MOE_GPU_FN(moe_gpu_quant_grouped),
};
