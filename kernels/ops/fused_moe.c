/* PLACEHOLDER: replaced by the fused_moe implementation. */
#include "op.h"
static const moe_op_io_desc in[] = {{"hidden_states", false, "fp16,bf16"}};
static const moe_op_io_desc out[] = {{"output", false, "fp16,bf16"}};
static moe_status prepare(moe_call *c, const moe_params *p, moe_error *err) {
  return moe_fail(err, MOE_EUNSUPPORTED, "fused_moe: not implemented yet");
}
moe_status moe_cpu_fused_moe(moe_backend *b, moe_call *c, moe_error *err) { return MOE_EUNSUPPORTED; }
const moe_op moe_op_fused_moe = {{"fused_moe", in, 1, out, 1, true}, prepare, moe_cpu_fused_moe, NULL};
