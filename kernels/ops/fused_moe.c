/* fused_moe: the op table entry and its validation (docs/numerics.md "fused_moe").
 *
 * Called two ways: as a loaded expert set (moe_op_prepare's `set`), or as
 * the built-in model "fused_moe" with the weights as inputs, from which
 * prepare builds a set that borrows them (c->owned_set). Either way the
 * request carries hidden_states and either router_logits (routed here with
 * the set's routing config, which request parameters override) or
 * topk_ids + topk_weights.
 *
 * prepare reads topk_ids (host memory at that point) to reject ids outside
 * [0, E): a backend that copies inputs to its device does so after prepare. */
#include <string.h>

#include "../model/scheme.h"
#include "op.h"
#include "routing.h"

/* Every input but hidden_states is optional (and ModelConfig says so): the
 * weights come from an expert set or inline (build_inline_set says which a
 * scheme needs), the routing from router_logits or topk_ids + topk_weights. */
#define HELD_WEIGHT (MOE_INPUT_WEIGHT | MOE_INPUT_SET_HELD)
static const moe_op_io_desc fused_inputs[MOE_FUSED_IN_COUNT] = {
    [MOE_FUSED_IN_HIDDEN] = {"hidden_states", false, "fp16,bf16", MOE_IO_ACTIVATION, "T,H"},
    [MOE_FUSED_IN_LOGITS] = {"router_logits", true, "fp32,fp16,bf16", 0, "T,E"},
    [MOE_FUSED_IN_IDS] = {"topk_ids", true, "int32", 0, "T,k"},
    [MOE_FUSED_IN_TOPK_WEIGHTS] = {"topk_weights", true, "fp32", 0, "T,k"},
    [MOE_FUSED_IN_WEIGHTS + MOE_W13] = {"w13", true, "fp16,bf16", HELD_WEIGHT, "E,N,H"},
    [MOE_FUSED_IN_WEIGHTS + MOE_W2] = {"w2", true, "fp16,bf16", HELD_WEIGHT, "E,H,I"},
    [MOE_FUSED_IN_WEIGHTS + MOE_W13_QWEIGHT] = {"w13_qweight", true, "uint8", HELD_WEIGHT, "E,N,Hq"},
    [MOE_FUSED_IN_WEIGHTS +
        MOE_W13_SCALES] = {"w13_scales", true, "fp32,fp16,bf16,uint8", HELD_WEIGHT, "E,N,Hg"},
    [MOE_FUSED_IN_WEIGHTS + MOE_W13_QZEROS] = {"w13_qzeros", true, "uint8", HELD_WEIGHT, "E,Nz,Hg"},
    [MOE_FUSED_IN_WEIGHTS + MOE_W2_QWEIGHT] = {"w2_qweight", true, "uint8", HELD_WEIGHT, "E,H,Iq"},
    [MOE_FUSED_IN_WEIGHTS +
        MOE_W2_SCALES] = {"w2_scales", true, "fp32,fp16,bf16,uint8", HELD_WEIGHT, "E,H,Ig"},
    [MOE_FUSED_IN_WEIGHTS + MOE_W2_QZEROS] = {"w2_qzeros", true, "uint8", HELD_WEIGHT, "E,Hz,Ig"},
    [MOE_FUSED_IN_WEIGHTS + MOE_W13_BIAS] = {"w13_bias", true, "fp32,fp16,bf16", HELD_WEIGHT, "E,N"},
    [MOE_FUSED_IN_WEIGHTS + MOE_W2_BIAS] = {"w2_bias", true, "fp32,fp16,bf16", HELD_WEIGHT, "E,H"},
    [MOE_FUSED_IN_WEIGHTS + MOE_A13_SCALE] = {"a13_scale", true, "fp32", HELD_WEIGHT, "E"},
    [MOE_FUSED_IN_WEIGHTS + MOE_A2_SCALE] = {"a2_scale", true, "fp32", HELD_WEIGHT, "E"},
    [MOE_FUSED_IN_BIAS] = {"correction_bias", true, "fp32", MOE_INPUT_SET_HELD, "E"},
};
static const moe_op_io_desc fused_outputs[] = {{"output", false, "fp16,bf16", MOE_IO_ACTIVATION, "T,H"}};

static const moe_tensor *weight_in(const moe_call *c, moe_expert_tensor slot) {
  return MOE_FUSED_IN_WEIGHTS + (size_t)slot < MOE_FUSED_IN_COUNT
             ? moe_call_in(c, MOE_FUSED_IN_WEIGHTS + (size_t)slot)
             : NULL;
}

/* Checks a rank-3 weight input before its shape is read. */
static moe_status weight_rank3(const moe_tensor *t, const char *name, moe_error *err) {
  return moe_check_shape(t, name, 3, 3, err);
}

/* Inline weights: the config follows from the tensors' shapes and dtypes,
 * the parameters scheme/activation and the scheme's own (moe_schemes[]
 * from_inline) may state it, and are then checked against them by the
 * set's validation. */
static moe_status build_inline_set(moe_call *c, const moe_params *p, moe_error *err) {
  const moe_tensor *slots[MOE_EXPERT_TENSOR_COUNT];
  for (int slot = 0; slot < MOE_EXPERT_TENSOR_COUNT; slot++)
    slots[slot] = weight_in(c, (moe_expert_tensor)slot);
  const moe_tensor *w13 = slots[MOE_W13], *q13 = slots[MOE_W13_QWEIGHT], *s13 = slots[MOE_W13_SCALES];
  moe_expert_config cfg;
  moe_expert_config_defaults(&cfg);
  moe_status s;
  if (!w13 && !q13)
    return moe_fail(err, MOE_EINVAL,
                    "w13: missing (model fused_moe takes its weights as inputs: w13 + w2, or w13_qweight + "
                    "w13_scales + w2_qweight + w2_scales for wna16, fp8 and mxfp4)");
  /* without a scheme parameter: codes with UINT8 (e8m0) scales are mxfp4,
   * with scales of rank 1 or 2 fp8 (per tensor, per channel), else wna16;
   * fp8 with block scales looks like int8 wna16 and must be named */
  int scheme = !q13                             ? (w13->dtype == MOE_F16 ? MOE_SCHEME_FP16 : MOE_SCHEME_BF16)
               : s13 && s13->dtype == MOE_UINT8 ? MOE_SCHEME_MXFP4
               : s13 && s13->ndim < 3           ? MOE_SCHEME_FP8
                                                : MOE_SCHEME_WNA16;
  int activation = MOE_ACT_SILU;
  if ((s = moe_params_choice(p, "scheme", moe_scheme_names, &scheme, err))) return s;
  if ((s = moe_params_choice(p, "activation", moe_activation_names, &activation, err))) return s;
  cfg.scheme = (moe_scheme)scheme;
  cfg.activation = (moe_activation)activation;
  const moe_scheme_desc *d = &moe_schemes[cfg.scheme];
  const moe_tensor *first = d->quantized ? q13 : w13;
  const char *first_name = d->quantized ? "w13_qweight" : "w13";
  if (!first)
    return moe_fail(err, MOE_EINVAL, "%s: missing (scheme %s)", first_name, moe_scheme_names[scheme]);
  if ((s = weight_rank3(first, first_name, err))) return s;
  if (first->shape[1] % 2 != 0)
    return moe_fail(err, MOE_EINVAL, "%s: dimension 1 is 2I (gate and up rows), got odd %lld", first_name,
                    (long long)first->shape[1]);
  cfg.num_experts = cfg.global_num_experts = first->shape[0];
  cfg.intermediate_size = first->shape[1] / 2;
  if (!d->quantized) {
    cfg.hidden_size = w13->shape[2];
  } else { /* H is W2's row count */
    const moe_tensor *q2 = slots[MOE_W2_QWEIGHT];
    if (!q2) return moe_fail(err, MOE_EINVAL, "w2_qweight: missing (scheme %s)", moe_scheme_names[scheme]);
    if ((s = weight_rank3(q2, "w2_qweight", err))) return s;
    cfg.hidden_size = q2->shape[1];
  }
  cfg.has_bias = slots[MOE_W13_BIAS] || slots[MOE_W2_BIAS];
  if (d->from_inline && (s = d->from_inline(&cfg, slots, p, err))) return s;
  /* routing comes from the request's parameters (see fused_prepare) */
  moe_named_tensor tensors[MOE_EXPERT_TENSOR_COUNT];
  size_t n = 0;
  for (int slot = 0; slot < MOE_EXPERT_TENSOR_COUNT; slot++)
    if (slots[slot]) tensors[n++] = (moe_named_tensor){moe_expert_tensor_names[slot], *slots[slot]};
  return moe_expert_set_from_tensors("fused_moe", &cfg, tensors, n, &c->owned_set, err);
}

/* A loaded set fixes its weights: inline weights or a contradicting
 * weight parameter are mistakes, not overrides. */
static moe_status check_loaded_set(const moe_call *c, const moe_expert_set *set, const moe_params *p,
                                   moe_error *err) {
  const moe_expert_config *cfg = &set->cfg;
  moe_status s;
  for (size_t i = MOE_FUSED_IN_WEIGHTS; i < MOE_FUSED_IN_COUNT; i++)
    if (moe_call_in(c, i))
      return moe_fail(err, MOE_EINVAL,
                      "%s: expert set '%s' holds its own weights; inline weights are for model "
                      "fused_moe",
                      c->op->info.inputs[i].name, set->name);
  int scheme = (int)cfg->scheme, activation = (int)cfg->activation, ws = (int)cfg->weight_scale;
  int64_t bits = cfg->bits, group_size = cfg->group_size, block_n = cfg->block_n, block_k = cfg->block_k;
  bool exact = cfg->exact_division;
  if ((s = moe_params_choice(p, "scheme", moe_scheme_names, &scheme, err))) return s;
  if ((s = moe_params_choice(p, "activation", moe_activation_names, &activation, err))) return s;
  if ((s = moe_params_int(p, "bits", &bits, err))) return s;
  if ((s = moe_params_int(p, "group_size", &group_size, err))) return s;
  if ((s = moe_params_choice(p, "weight_scale", moe_weight_scale_names, &ws, err))) return s;
  if ((s = moe_params_int(p, "block_n", &block_n, err))) return s;
  if ((s = moe_params_int(p, "block_k", &block_k, err))) return s;
  if ((s = moe_params_bool(p, "exact_division", &exact, err))) return s;
  const char *what = scheme != (int)cfg->scheme           ? "scheme"
                     : activation != (int)cfg->activation ? "activation"
                     : bits != cfg->bits                  ? "bits"
                     : group_size != cfg->group_size      ? "group_size"
                     : ws != (int)cfg->weight_scale       ? "weight_scale"
                     : block_n != cfg->block_n            ? "block_n"
                     : block_k != cfg->block_k            ? "block_k"
                     : exact != cfg->exact_division       ? "exact_division"
                                                          : NULL;
  if (what) return moe_fail(err, MOE_EINVAL, "%s: differs from expert set '%s'", what, set->name);
  return MOE_OK;
}

const char *moe_expert_set_act_dtypes(const moe_expert_set *set) {
  moe_dtype act = moe_schemes[set->cfg.scheme].act;
  return act == MOE_DTYPE_INVALID ? fused_inputs[MOE_FUSED_IN_HIDDEN].dtypes : moe_dtype_name(act);
}

/* hidden_states: 16-bit, the dtype the scheme computes in, [T, H]; a
 * 16-bit bias in that dtype too. */
static moe_status check_hidden(const moe_tensor *x, const moe_expert_set *set, moe_error *err) {
  static const moe_dtype act_types[] = {MOE_BF16, MOE_F16, MOE_DTYPE_INVALID};
  const moe_expert_config *cfg = &set->cfg;
  const moe_dtype act = moe_schemes[cfg->scheme].act;
  moe_status s;
  if (x->dtype == MOE_F32 && act == MOE_DTYPE_INVALID)
    return moe_fail(err, MOE_EINVAL,
                    "hidden_states: dtype fp32; scheme %s takes 16-bit activations only (fp16 or bf16)",
                    moe_scheme_names[cfg->scheme]);
  if ((s = moe_check_dtype(x, "hidden_states", act_types, err))) return s;
  for (int slot = MOE_W13_BIAS; slot <= MOE_W2_BIAS; slot++) {
    const moe_dtype bt = set->t[slot].dtype;
    if (set->t[slot].data && bt != MOE_F32 && bt != x->dtype)
      return moe_fail(err, MOE_EINVAL,
                      "%s: dtype %s; a bias is fp32 or the activation dtype (hidden_states is %s)",
                      moe_expert_tensor_names[slot], moe_dtype_name(bt), moe_dtype_name(x->dtype));
  }
  if (act != MOE_DTYPE_INVALID && x->dtype != act)
    return moe_fail(err, MOE_EINVAL, "hidden_states: dtype %s; scheme %s computes in %s",
                    moe_dtype_name(x->dtype), moe_scheme_names[cfg->scheme], moe_dtype_name(act));
  if ((s = moe_check_shape(x, "hidden_states", 2, 2, err))) return s;
  if (x->shape[1] != cfg->hidden_size)
    return moe_fail(err, MOE_EINVAL, "hidden_states: shape [%lld, %lld], the experts' hidden size is %lld",
                    (long long)x->shape[0], (long long)x->shape[1], (long long)cfg->hidden_size);
  return MOE_OK;
}

/* topk_ids INT32 [T, k] with every id in [0, E), topk_weights F32 [T, k]. */
static moe_status check_ids(const moe_tensor *ids, const moe_tensor *w, int64_t tokens, int64_t experts,
                            moe_error *err) {
  static const moe_dtype id_types[] = {MOE_INT32, MOE_DTYPE_INVALID};
  static const moe_dtype weight_types[] = {MOE_F32, MOE_DTYPE_INVALID};
  moe_status s;
  if (!ids) return moe_fail(err, MOE_EINVAL, "topk_ids: missing (topk_weights given)");
  if (!w) return moe_fail(err, MOE_EINVAL, "topk_weights: missing (topk_ids given)");
  if ((s = moe_check_dtype(ids, "topk_ids", id_types, err))) return s;
  if ((s = moe_check_shape(ids, "topk_ids", 2, 2, err))) return s;
  if ((s = moe_check_dtype(w, "topk_weights", weight_types, err))) return s;
  if ((s = moe_check_shape(w, "topk_weights", 2, 2, err))) return s;
  if (ids->shape[0] != tokens)
    return moe_fail(err, MOE_EINVAL, "topk_ids: %lld rows, hidden_states has %lld tokens",
                    (long long)ids->shape[0], (long long)tokens);
  if (ids->shape[1] < 1) return moe_fail(err, MOE_EINVAL, "topk_ids: [T, k] with k = 0");
  if (w->shape[0] != ids->shape[0] || w->shape[1] != ids->shape[1])
    return moe_fail(err, MOE_EINVAL, "topk_weights: shape [%lld, %lld], topk_ids is [%lld, %lld]",
                    (long long)w->shape[0], (long long)w->shape[1], (long long)ids->shape[0],
                    (long long)ids->shape[1]);
  const int32_t *id = ids->data;
  const size_t n = (size_t)ids->shape[0] * (size_t)ids->shape[1]; /* fits: the tensor's bytes were checked */
  for (size_t i = 0; i < n; i++)
    if (id[i] < 0 || id[i] >= experts)
      return moe_fail(err, MOE_EINVAL, "topk_ids: id %d at [%zu, %zu] is outside [0, %lld)", id[i],
                      i / (size_t)ids->shape[1], i % (size_t)ids->shape[1], (long long)experts);
  return MOE_OK;
}

static moe_status fused_prepare(moe_call *c, const moe_params *p, moe_error *err) {
  static const moe_dtype logit_types[] = {MOE_F32, MOE_F16, MOE_BF16, MOE_DTYPE_INVALID};
  moe_fused_args *a = &c->args.fused;
  const moe_tensor *x = moe_call_in(c, MOE_FUSED_IN_HIDDEN), *logits = moe_call_in(c, MOE_FUSED_IN_LOGITS);
  const moe_tensor *ids = moe_call_in(c, MOE_FUSED_IN_IDS), *w = moe_call_in(c, MOE_FUSED_IN_TOPK_WEIGHTS);
  moe_status s;
  if (a->set) {
    if ((s = check_loaded_set(c, a->set, p, err))) return s;
  } else {
    if ((s = build_inline_set(c, p, err))) return s;
    a->set = c->owned_set;
  }
  const moe_expert_config *cfg = &a->set->cfg;
  if ((s = check_hidden(x, a->set, err))) return s;
  a->act = x->dtype;
  a->tokens = x->shape[0];
  if (logits && (ids || w))
    return moe_fail(err, MOE_EINVAL,
                    "router_logits: give router_logits or topk_ids + topk_weights, not both");
  if (!logits && !ids && !w)
    return moe_fail(err, MOE_EINVAL, "router_logits: missing (or topk_ids + topk_weights)");
  a->route = logits != NULL;
  if (a->route) {
    if ((s = moe_check_dtype(logits, "router_logits", logit_types, err))) return s;
    if ((s = moe_check_shape(logits, "router_logits", 2, 2, err))) return s;
    if (logits->shape[0] != a->tokens || logits->shape[1] != cfg->global_num_experts)
      return moe_fail(err, MOE_EINVAL,
                      "router_logits: shape [%lld, %lld], expected [%lld, %lld] (tokens, experts)",
                      (long long)logits->shape[0], (long long)logits->shape[1], (long long)a->tokens,
                      (long long)cfg->global_num_experts);
    /* inline weights carry no routing config: top_k must be stated */
    if (c->owned_set && !moe_params_has(p, "top_k"))
      return moe_fail(err, MOE_EINVAL, "top_k: required parameter with router_logits and inline weights");
    a->routing = cfg->routing;
    if ((s = moe_routing_params(p, &a->routing, err))) return s;
    if ((s = moe_routing_check(&a->routing, cfg->global_num_experts, err))) return s;
    a->top_k = a->routing.top_k;
  } else {
    if ((s = check_ids(ids, w, a->tokens, cfg->global_num_experts, err))) return s;
    a->top_k = ids->shape[1];
    /* routing parameters do nothing beside precomputed ids, but callers
     * send them anyway: they are still parsed (a wrong type is an error,
     * so is a top_k other than the ids' width), which also makes them
     * known names, not rejected as misspelt (moe_op_prepare) */
    moe_routing unused = cfg->routing;
    unused.top_k = a->top_k;
    if ((s = moe_routing_params(p, &unused, err))) return s;
    if (unused.top_k != a->top_k)
      return moe_fail(err, MOE_EINVAL, "top_k: %lld, but topk_ids has %lld columns", (long long)unused.top_k,
                      (long long)a->top_k);
  }
  const int64_t shape[2] = {a->tokens, cfg->hidden_size};
  return moe_call_set_output(c, 0, x->dtype, 2, shape, err);
}

const moe_op moe_op_fused_moe = {
    .info = {"fused_moe", fused_inputs, MOE_FUSED_IN_COUNT, fused_outputs, 1, true},
    .prepare = fused_prepare,
    .cpu = moe_cpu_fused_moe,
    .gpu = MOE_GPU_FN(moe_gpu_fused_moe),
};
