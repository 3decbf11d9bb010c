/* The op table's flags (moe/ops.h, MOE_INPUT_*, MOE_IO_*): the server asks
 * them which inputs are expert weights (cached by content, no batching of
 * inline weights), which an expert set holds (not advertised by a set),
 * which tensors are in the set's activation dtype, and which op an expert
 * set is served as, so a wrong flag changes what clients see. Checked here
 * against names written out independently of the table. Also each tensor's
 * advertised axes (ModelMetadata's shape and rank). */
#include <check.h>
#include <stddef.h>
#include <string.h>

#include "moe/expert_set.h"
#include "moe/ops.h"

/* The flags of op's input `name`; fails the test when op has no such input. */
static unsigned input_flags(const moe_op *op, const char *name) {
  const moe_op_info *info = moe_op_describe(op);
  for (size_t i = 0; i < info->num_inputs; i++)
    if (strcmp(info->inputs[i].name, name) == 0) return info->inputs[i].flags;
  ck_abort_msg("%s has no input '%s'", info->name, name);
  return 0;
}

START_TEST(fused_moe_weights_are_flagged) {
  static const char *const weights[] = {"w13",        "w2",         "w13_qweight", "w13_scales",
                                        "w13_qzeros", "w2_qweight", "w2_scales",   "w2_qzeros",
                                        "w13_bias",   "w2_bias",    "a13_scale",   "a2_scale"};
  static const char *const others[] = {"hidden_states", "router_logits", "topk_ids", "topk_weights",
                                       "correction_bias"};
  const moe_op *op = moe_op_find("fused_moe");
  ck_assert_ptr_nonnull(op);
  /* a set holds its correction_bias too (a set's model rejects it inline) */
  static const unsigned other_flags[] = {MOE_IO_ACTIVATION, 0, 0, 0, MOE_INPUT_SET_HELD};
  for (size_t i = 0; i < sizeof weights / sizeof weights[0]; i++)
    ck_assert_msg(input_flags(op, weights[i]) == (MOE_INPUT_WEIGHT | MOE_INPUT_SET_HELD),
                  "%s: flags %#x, expected MOE_INPUT_WEIGHT | MOE_INPUT_SET_HELD", weights[i],
                  input_flags(op, weights[i]));
  for (size_t i = 0; i < sizeof others / sizeof others[0]; i++)
    ck_assert_msg(input_flags(op, others[i]) == other_flags[i], "%s: flags %#x, expected %#x", others[i],
                  input_flags(op, others[i]), other_flags[i]);
  /* nothing else: every input is one of the two lists */
  const moe_op_info *info = moe_op_describe(op);
  ck_assert_uint_eq(info->num_inputs, sizeof weights / sizeof weights[0] + sizeof others / sizeof others[0]);
  /* the flag and the expert set's own notion of a weight tensor agree */
  for (size_t i = 0; i < info->num_inputs; i++)
    ck_assert_msg(!!(info->inputs[i].flags & MOE_INPUT_WEIGHT) ==
                      moe_expert_tensor_is_weight(info->inputs[i].name),
                  "%s: flag and moe_expert_tensor_is_weight disagree", info->inputs[i].name);
  ck_assert(moe_op_takes_weights(op));
}
END_TEST

/* ModelConfig shows the table's `optional`: for fused_moe only hidden_states
 * is required (weights and routing each come one of two ways). */
START_TEST(fused_moe_requires_only_hidden_states) {
  const moe_op_info *info = moe_op_describe(moe_op_find("fused_moe"));
  for (size_t i = 0; i < info->num_inputs; i++)
    ck_assert_msg(info->inputs[i].optional == (strcmp(info->inputs[i].name, "hidden_states") != 0),
                  "%s: optional %d", info->inputs[i].name, info->inputs[i].optional);
}
END_TEST

START_TEST(quant_and_topk_take_no_weights) {
  static const char *const ops[] = {"quant.per_tensor",   "quant.per_token", "quant.mx",
                                    "dequant.per_tensor", "dequant.mx",      "moe.topk"};
  for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
    const moe_op *op = moe_op_find(ops[k]);
    ck_assert_msg(op != NULL, "no op %s", ops[k]);
    const moe_op_info *info = moe_op_describe(op);
    ck_assert_uint_gt(info->num_inputs, 0);
    for (size_t i = 0; i < info->num_inputs; i++)
      ck_assert_msg(info->inputs[i].flags == 0, "%s input %s: flags %#x, expected none", ops[k],
                    info->inputs[i].name, info->inputs[i].flags);
    ck_assert_msg(!moe_op_takes_weights(op), "%s takes weights", ops[k]);
  }
}
END_TEST

START_TEST(expert_sets_are_served_as_fused_moe) {
  ck_assert_ptr_nonnull(moe_op_find("fused_moe"));
  ck_assert_ptr_eq(moe_op_for_expert_sets(), moe_op_find("fused_moe"));
}
END_TEST

/* Outputs carry no input flags; only fused_moe's output is an activation. */
START_TEST(outputs_have_no_input_flags) {
  for (size_t k = 0; k < moe_op_count(); k++) {
    const moe_op_info *info = moe_op_describe(moe_op_at(k));
    const unsigned want = moe_op_at(k) == moe_op_find("fused_moe") ? MOE_IO_ACTIVATION : 0;
    for (size_t i = 0; i < info->num_outputs; i++)
      ck_assert_msg(info->outputs[i].flags == want, "%s output %s: flags %#x", info->name,
                    info->outputs[i].name, info->outputs[i].flags);
  }
}
END_TEST

/* The axes of op `name`'s input (or output) `io`; fails when it has none. */
static const char *axes_of(const char *name, bool input, const char *io) {
  const moe_op_info *info = moe_op_describe(moe_op_find(name));
  const moe_op_io_desc *v = input ? info->inputs : info->outputs;
  size_t n = input ? info->num_inputs : info->num_outputs;
  for (size_t i = 0; i < n; i++)
    if (strcmp(v[i].name, io) == 0) return v[i].axes;
  ck_abort_msg("%s has no %s '%s'", name, input ? "input" : "output", io);
  return NULL;
}

/* Every tensor has axes; a few checked against the ops' documented shapes
 * (docs/numerics.md): the token axis first where the op has one. */
START_TEST(axes_match_the_documented_shapes) {
  for (size_t k = 0; k < moe_op_count(); k++) {
    const moe_op_info *info = moe_op_describe(moe_op_at(k));
    for (size_t i = 0; i < info->num_inputs + info->num_outputs; i++) {
      const moe_op_io_desc *d =
          i < info->num_inputs ? &info->inputs[i] : &info->outputs[i - info->num_inputs];
      ck_assert_msg(d->axes && *d->axes, "%s %s: no axes", info->name, d->name);
    }
  }
  ck_assert_str_eq(axes_of("quant.per_tensor", true, "x"), "T,K");
  ck_assert_str_eq(axes_of("quant.per_tensor", true, "scale"), "1");
  ck_assert_str_eq(axes_of("quant.per_tensor", false, "scale"), "1");
  ck_assert_str_eq(axes_of("quant.per_token", false, "scales"), "T,1");
  ck_assert_str_eq(axes_of("moe.topk", true, "correction_bias"), "E");
  ck_assert_str_eq(axes_of("fused_moe", true, "hidden_states"), "T,H");
  ck_assert_str_eq(axes_of("fused_moe", true, "router_logits"), "T,E");
  ck_assert_str_eq(axes_of("fused_moe", true, "w13"), "E,N,H");
  ck_assert_str_eq(axes_of("fused_moe", false, "output"), "T,H");
}
END_TEST

static Suite *op_table_suite(void) {
  Suite *s = suite_create("op_table");
  TCase *tc = tcase_create("flags");
  tcase_add_test(tc, fused_moe_weights_are_flagged);
  tcase_add_test(tc, fused_moe_requires_only_hidden_states);
  tcase_add_test(tc, quant_and_topk_take_no_weights);
  tcase_add_test(tc, expert_sets_are_served_as_fused_moe);
  tcase_add_test(tc, outputs_have_no_input_flags);
  tcase_add_test(tc, axes_match_the_documented_shapes);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(op_table_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
