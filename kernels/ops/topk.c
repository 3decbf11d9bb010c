/* moe.topk: the op table entry and its validation (docs/numerics.md "moe.topk").
 * The routing parameters are parsed here for fused_moe too (checked by
 * kernels/model/routing.c). */
#include <math.h>

#include "op.h"
#include "routing.h"

enum { IN_LOGITS = 0, IN_BIAS, IN_COUNT };
enum { OUT_IDS = 0, OUT_WEIGHTS, OUT_COUNT };

static const moe_op_io_desc topk_inputs[IN_COUNT] = {
    [IN_LOGITS] = {"router_logits", false, "fp32,fp16,bf16", 0, "T,E"},
    [IN_BIAS] = {"correction_bias", true, "fp32", 0, "E"},
};
static const moe_op_io_desc topk_outputs[OUT_COUNT] = {
    [OUT_IDS] = {"topk_ids", false, "int32", 0, "T,k"},
    [OUT_WEIGHTS] = {"topk_weights", false, "fp32", 0, "T,k"},
};

moe_status moe_routing_params(const moe_params *p, moe_routing *r, moe_error *err) {
  int scoring = (int)r->scoring;
  moe_status s;
  if ((s = moe_params_int(p, "top_k", &r->top_k, err))) return s;
  if ((s = moe_params_choice(p, "scoring", moe_scoring_names, &scoring, err))) return s;
  r->scoring = (moe_scoring)scoring;
  if ((s = moe_params_bool(p, "renormalize", &r->renormalize, err))) return s;
  if ((s = moe_params_int(p, "num_expert_group", &r->num_expert_group, err))) return s;
  if ((s = moe_params_int(p, "topk_group", &r->topk_group, err))) return s;
  return moe_params_double(p, "routed_scaling_factor", &r->routed_scaling_factor, err);
}

static moe_status topk_prepare(moe_call *c, const moe_params *p, moe_error *err) {
  static const moe_dtype logit_types[] = {MOE_F32, MOE_F16, MOE_BF16, MOE_DTYPE_INVALID};
  static const moe_dtype bias_types[] = {MOE_F32, MOE_DTYPE_INVALID};
  moe_topk_args *a = &c->args.topk;
  const moe_tensor *logits = moe_call_in(c, IN_LOGITS), *bias = moe_call_in(c, IN_BIAS);
  moe_status s;
  if ((s = moe_check_dtype(logits, "router_logits", logit_types, err))) return s;
  if ((s = moe_check_shape(logits, "router_logits", 2, 2, err))) return s;
  const int64_t tokens = logits->shape[0], experts = logits->shape[1];
  if (experts < 1) return moe_fail(err, MOE_EINVAL, "router_logits: [T, E] with E = 0 experts");
  if (bias) {
    if ((s = moe_check_dtype(bias, "correction_bias", bias_types, err))) return s;
    if ((s = moe_check_shape(bias, "correction_bias", 1, 1, err))) return s;
    if (bias->shape[0] != experts)
      return moe_fail(err, MOE_EINVAL, "correction_bias: shape [%lld], router_logits has %lld experts",
                      (long long)bias->shape[0], (long long)experts);
  }
  if (!moe_params_has(p, "top_k")) return moe_fail(err, MOE_EINVAL, "top_k: required parameter missing");
  moe_routing r = {.top_k = 0, .scoring = MOE_SCORING_SOFTMAX, .routed_scaling_factor = 1.0};
  if ((s = moe_routing_params(p, &r, err))) return s;
  if ((s = moe_routing_check(&r, experts, err))) return s;
  a->routing = r;
  a->has_bias = bias != NULL;
  const int64_t shape[2] = {tokens, r.top_k};
  if ((s = moe_call_set_output(c, OUT_IDS, MOE_INT32, 2, shape, err))) return s;
  return moe_call_set_output(c, OUT_WEIGHTS, MOE_F32, 2, shape, err);
}

const moe_op moe_op_topk = {
    .info = {"moe.topk", topk_inputs, IN_COUNT, topk_outputs, OUT_COUNT, true},
    .prepare = topk_prepare,
    .cpu = moe_cpu_topk,
    .gpu = MOE_GPU_FN(moe_gpu_topk),
};
