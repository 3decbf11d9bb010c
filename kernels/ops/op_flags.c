/* Op-wide questions answered from the inputs' flags (moe_op_io_desc.flags),
 * so that callers ask the table what an op takes instead of matching its
 * name: the flags of each input are the one place that says it. */
#include "op.h"

bool moe_op_takes_weights(const moe_op *op) {
  const moe_op_info *info = moe_op_describe(op);
  for (size_t i = 0; i < info->num_inputs; i++)
    if (info->inputs[i].flags & MOE_INPUT_WEIGHT) return true;
  return false;
}

/* An expert set replaces exactly the weight inputs, so the op that has them
 * is the one a set is served as. */
const moe_op *moe_op_for_expert_sets(void) {
  for (size_t i = 0; i < moe_op_count(); i++)
    if (moe_op_takes_weights(moe_op_at(i))) return moe_op_at(i);
  return NULL;
}
