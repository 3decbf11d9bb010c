/* dequant.mx: y = value(code) * 2^(b - 127), b = 0xFF -> NaN (docs/numerics.md). */
#include "quant_args.h"

static const moe_op_io_desc inputs[] = {
    {"q", false, "uint8,fp4_e2m1,fp8_e4m3fn,fp8_e5m2", 0, "T,K"},
    {"scales", false, "uint8,e8m0", 0, "T,G"},
};
static const moe_op_io_desc outputs[] = {
    {"y", false, "fp32,fp16,bf16", 0, "T,K"},
};

static moe_status prepare(moe_call *c, const moe_params *p, moe_error *err) {
  moe_mx_args *a = &c->args.mx;
  moe_tensor *q = &c->in[0].tensor, *sc = &c->in[1].tensor;
  moe_status s = moe_parse_mx_format(p, a, err);
  if (!s) s = moe_narrow_view(q, "q", a->qdtype, err);
  if (!s) s = moe_check_shape(q, "q", 1, MOE_MAX_DIMS, err);
  if (!s) s = moe_narrow_view(sc, "scales", MOE_E8M0, err);
  if (!s) s = moe_check_shape(sc, "scales", 1, MOE_MAX_DIMS, err);
  if (!s) s = moe_parse_out_float(p, &a->out_dtype, err);
  if (s) return s;
  int64_t k = moe_tensor_cols(q);
  if (k % 32)
    return moe_fail(err, MOE_EINVAL, "q: last dimension K = %lld is not a multiple of 32 (MX block size)",
                    (long long)k);
  bool match = sc->ndim == q->ndim && sc->shape[q->ndim - 1] == k / 32;
  for (int d = 0; match && d + 1 < q->ndim; d++)
    match = sc->shape[d] == q->shape[d];
  if (!match)
    return moe_fail(err, MOE_EINVAL, "scales: shape must be q's with the last axis K/32 = %lld",
                    (long long)(k / 32));
  return moe_call_set_output(c, 0, a->out_dtype, q->ndim, q->shape, err);
}

const moe_op moe_op_dequant_mx = {
    .info = {"dequant.mx", inputs, 2, outputs, 1, true},
    .prepare = prepare,
    .cpu = moe_cpu_dequant_mx,
    .gpu = MOE_GPU_FN(moe_gpu_dequant_mx),
};
