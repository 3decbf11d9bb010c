/* dequant.per_tensor: y = float(q) * s, rounded to out_dtype (docs/numerics.md). */
#include "quant_args.h"

static const moe_op_io_desc inputs[] = {
    {"q", false, "uint8,int8,fp8_e4m3fn,fp8_e4m3fnuz", 0, "T,K"},
    {"scale", false, "fp32", 0, "1"},
};
static const moe_op_io_desc outputs[] = {
    {"y", false, "fp32,fp16,bf16", 0, "T,K"},
};

static moe_status prepare(moe_call *c, const moe_params *p, moe_error *err) {
  moe_scaled_args *a = &c->args.scaled;
  moe_tensor *q = &c->in[0].tensor;
  /* in_dtype defaults to what q already says; plain uint8 means e4m3fn */
  moe_dtype dflt = (q->dtype == MOE_INT8 || q->dtype == MOE_FP8_E4M3FNUZ) ? q->dtype : MOE_FP8_E4M3FN;
  moe_status s = moe_parse_scaled_dtype(p, "in_dtype", dflt, a, err);
  if (!s) s = moe_narrow_view(q, "q", a->qdtype, err);
  if (!s) s = moe_check_shape(q, "q", 0, MOE_MAX_DIMS, err);
  if (!s) s = moe_parse_out_float(p, &a->out_dtype, err);
  if (!s) s = moe_read_static_scale(&c->in[1].tensor, "scale", &a->static_scale, err);
  if (!s) s = moe_call_set_output(c, 0, a->out_dtype, q->ndim, q->shape, err);
  return s;
}

const moe_op moe_op_dequant_per_tensor = {
    .info = {"dequant.per_tensor", inputs, 2, outputs, 1, true},
    .prepare = prepare,
    .cpu = moe_cpu_dequant_per_tensor,
    .gpu = MOE_GPU_FN(moe_gpu_dequant_per_tensor),
};
