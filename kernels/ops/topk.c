/* PLACEHOLDER: replaced by the topk implementation. */
#include "op.h"
static const moe_op_io_desc in[] = {{"router_logits", false, "fp32,fp16,bf16"}, {"correction_bias", true, "fp32"}};
static const moe_op_io_desc out[] = {{"topk_ids", false, "int32"}, {"topk_weights", false, "fp32"}};
static moe_status prepare(moe_call *c, const moe_params *p, moe_error *err) {
  return moe_fail(err, MOE_EUNSUPPORTED, "moe.topk: not implemented yet");
}
moe_status moe_cpu_topk(moe_backend *b, moe_call *c, moe_error *err) { return MOE_EUNSUPPORTED; }
const moe_op moe_op_topk = {{"moe.topk", in, 2, out, 2, true}, prepare, moe_cpu_topk, NULL};
