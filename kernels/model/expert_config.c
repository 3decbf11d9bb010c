/* An expert set's config.json: defaults, parsing, validation, serializing,
 * and the name tables of the set's enums and tensor slots
 * (docs/expert-set.md lists the keys). */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "moe/expert_set.h"
#include "scheme.h"

const char *const moe_scheme_names[] = {"bf16", "fp16", "wna16", "fp8", "mxfp4", NULL};
const char *const moe_weight_scale_names[] = {"per_tensor", "per_channel", "block", NULL};
const char *const moe_activation_names[] = {"silu", "gelu", "swiglu_oai", NULL};
const char *const moe_scoring_names[] = {"softmax", "sigmoid", NULL};
const char *const moe_expert_tensor_names[] = {
    "w13",       "w2",       "w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight",      "w2_scales",
    "w2_qzeros", "w13_bias", "w2_bias",     "a13_scale",  "a2_scale",   "correction_bias", NULL};

bool moe_expert_tensor_is_weight(const char *name) {
  for (int i = 0; name && moe_expert_tensor_names[i]; i++)
    if (i != MOE_CORRECTION_BIAS && strcmp(moe_expert_tensor_names[i], name) == 0) return true;
  return false;
}

/* Sizes and expert counts beyond this are corruption, not a model; the cap
 * also keeps products such as 2 * I far from int64 overflow. */
#define CFG_MAX_DIM ((int64_t)INT32_MAX)
/* JSON numbers are doubles: integers beyond 2^53 are not exact. */
#define CFG_MAX_JSON_INT 9007199254740992.0

/* ---- defaults and validation ------------------------------------------------- */

void moe_expert_config_defaults(moe_expert_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->scheme = MOE_SCHEME_BF16;
  cfg->activation = MOE_ACT_SILU;
  cfg->bits = 0; /* no quantized weights: bf16/fp16 */
  cfg->group_size = -1;
  cfg->has_zero_points = false;
  cfg->weight_scale = MOE_WSCALE_PER_TENSOR;
  cfg->block_n = cfg->block_k = 128; /* DeepSeek-V3's blocks */
  cfg->expert_offset = 0;
  cfg->routing.top_k = 1;
  cfg->routing.scoring = MOE_SCORING_SOFTMAX;
  cfg->routing.renormalize = false;
  cfg->routing.num_expert_group = 1;
  cfg->routing.topk_group = 1;
  cfg->routing.routed_scaling_factor = 1.0;
}

static moe_status check_dim(const char *key, int64_t v, moe_error *err) {
  if (v < 1 || v > CFG_MAX_DIM)
    return moe_fail(err, MOE_EINVAL, "%s: must be in [1, %lld], got %lld", key, (long long)CFG_MAX_DIM,
                    (long long)v);
  return MOE_OK;
}

moe_status moe_expert_config_validate(const moe_expert_config *c, moe_error *err) {
  if (!c) return moe_fail(err, MOE_EINVAL, "config: missing");
  if ((unsigned)c->scheme >= MOE_SCHEME_COUNT)
    return moe_fail(err, MOE_EINVAL, "scheme: value %d out of range", (int)c->scheme);
  if ((unsigned)c->activation >= MOE_ACT_COUNT)
    return moe_fail(err, MOE_EINVAL, "activation: value %d out of range", (int)c->activation);
  moe_status s;
  if ((s = check_dim("num_experts", c->num_experts, err))) return s;
  if ((s = check_dim("global_num_experts", c->global_num_experts, err))) return s;
  if ((s = check_dim("hidden_size", c->hidden_size, err))) return s;
  if ((s = check_dim("intermediate_size", c->intermediate_size, err))) return s;
  if (c->expert_offset < 0 || c->expert_offset > CFG_MAX_DIM)
    return moe_fail(err, MOE_EINVAL, "expert_offset: must be in [0, %lld], got %lld", (long long)CFG_MAX_DIM,
                    (long long)c->expert_offset);
  if (c->expert_offset + c->num_experts > c->global_num_experts) /* both capped: no overflow */
    return moe_fail(err, MOE_EINVAL,
                    "global_num_experts: %lld is less than expert_offset + num_experts = %lld + %lld",
                    (long long)c->global_num_experts, (long long)c->expert_offset, (long long)c->num_experts);
  if ((s = moe_scheme_check_config(c, err))) return s;
  if (c->routing.topk_group < 0)
    return moe_fail(err, MOE_EINVAL, "topk_group: must be >= 0, got %lld", (long long)c->routing.topk_group);
  /* the same routing rules as a request's (moe.topk) */
  return moe_routing_check(&c->routing, c->global_num_experts, err);
}

/* ---- parsing ------------------------------------------------------------------------ */

enum cfg_key {
  K_SCHEME,
  K_NUM_EXPERTS,
  K_GLOBAL_NUM_EXPERTS,
  K_EXPERT_OFFSET,
  K_HIDDEN_SIZE,
  K_INTERMEDIATE_SIZE,
  K_ACTIVATION,
  K_BITS,
  K_GROUP_SIZE,
  K_HAS_ZERO_POINTS,
  K_WEIGHT_SCALE,
  K_BLOCK_N,
  K_BLOCK_K,
  K_HAS_ACT_SCALES,
  K_EXACT_DIVISION,
  K_HAS_BIAS,
  K_TOP_K,
  K_SCORING,
  K_RENORMALIZE,
  K_NUM_EXPERT_GROUP,
  K_TOPK_GROUP,
  K_ROUTED_SCALING_FACTOR,
  K_COUNT
};

static const char *const cfg_keys[K_COUNT] = {
    [K_SCHEME] = "scheme",
    [K_NUM_EXPERTS] = "num_experts",
    [K_GLOBAL_NUM_EXPERTS] = "global_num_experts",
    [K_EXPERT_OFFSET] = "expert_offset",
    [K_HIDDEN_SIZE] = "hidden_size",
    [K_INTERMEDIATE_SIZE] = "intermediate_size",
    [K_ACTIVATION] = "activation",
    [K_BITS] = "bits",
    [K_GROUP_SIZE] = "group_size",
    [K_HAS_ZERO_POINTS] = "has_zero_points",
    [K_WEIGHT_SCALE] = "weight_scale",
    [K_BLOCK_N] = "block_n",
    [K_BLOCK_K] = "block_k",
    [K_HAS_ACT_SCALES] = "has_activation_scales",
    [K_EXACT_DIVISION] = "exact_division",
    [K_HAS_BIAS] = "has_bias",
    [K_TOP_K] = "top_k",
    [K_SCORING] = "scoring",
    [K_RENORMALIZE] = "renormalize",
    [K_NUM_EXPERT_GROUP] = "num_expert_group",
    [K_TOPK_GROUP] = "topk_group",
    [K_ROUTED_SCALING_FACTOR] = "routed_scaling_factor",
};

static moe_status json_int(const cJSON *v, const char *key, int64_t *out, moe_error *err) {
  double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
  /* range first: converting NaN or a huge double to int64 is undefined */
  if (!(d >= -CFG_MAX_JSON_INT && d <= CFG_MAX_JSON_INT) || (double)(int64_t)d != d)
    return moe_fail(err, MOE_EINVAL, "%s: must be an integer", key);
  *out = (int64_t)d;
  return MOE_OK;
}

static moe_status json_bool(const cJSON *v, const char *key, bool *out, moe_error *err) {
  if (!cJSON_IsBool(v)) return moe_fail(err, MOE_EINVAL, "%s: must be true or false", key);
  *out = cJSON_IsTrue(v);
  return MOE_OK;
}

static moe_status json_double(const cJSON *v, const char *key, double *out, moe_error *err) {
  if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
    return moe_fail(err, MOE_EINVAL, "%s: must be a finite number", key);
  *out = v->valuedouble;
  return MOE_OK;
}

static moe_status json_choice(const cJSON *v, const char *key, const char *const *names, int *out,
                              moe_error *err) {
  if (cJSON_IsString(v) && v->valuestring)
    for (int i = 0; names[i]; i++)
      if (strcmp(names[i], v->valuestring) == 0) {
        *out = i;
        return MOE_OK;
      }
  char list[128] = "";
  size_t used = 0;
  for (int i = 0; names[i] && used < sizeof list; i++)
    used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", names[i]);
  return moe_fail(err, MOE_EINVAL, "%s: must be one of %s", key, list);
}

/* Stores one key's value into cfg. */
static moe_status parse_key(enum cfg_key k, const cJSON *v, moe_expert_config *cfg, moe_error *err) {
  const char *key = cfg_keys[k];
  moe_routing *r = &cfg->routing;
  moe_status s = MOE_OK;
  int choice = 0;
  int64_t i64 = 0;
  switch (k) {
  case K_SCHEME:
    if (!(s = json_choice(v, key, moe_scheme_names, &choice, err))) cfg->scheme = (moe_scheme)choice;
    break;
  case K_ACTIVATION:
    if (!(s = json_choice(v, key, moe_activation_names, &choice, err)))
      cfg->activation = (moe_activation)choice;
    break;
  case K_SCORING:
    if (!(s = json_choice(v, key, moe_scoring_names, &choice, err))) r->scoring = (moe_scoring)choice;
    break;
  case K_NUM_EXPERTS: s = json_int(v, key, &cfg->num_experts, err); break;
  case K_GLOBAL_NUM_EXPERTS: s = json_int(v, key, &cfg->global_num_experts, err); break;
  case K_EXPERT_OFFSET: s = json_int(v, key, &cfg->expert_offset, err); break;
  case K_HIDDEN_SIZE: s = json_int(v, key, &cfg->hidden_size, err); break;
  case K_INTERMEDIATE_SIZE: s = json_int(v, key, &cfg->intermediate_size, err); break;
  case K_BITS:
    if (!(s = json_int(v, key, &i64, err))) {
      if (i64 != 4 && i64 != 8)
        return moe_fail(err, MOE_EINVAL, "bits: must be 4 or 8, got %lld", (long long)i64);
      cfg->bits = (int)i64;
    }
    break;
  case K_GROUP_SIZE: s = json_int(v, key, &cfg->group_size, err); break;
  case K_HAS_ZERO_POINTS: s = json_bool(v, key, &cfg->has_zero_points, err); break;
  case K_WEIGHT_SCALE:
    if (!(s = json_choice(v, key, moe_weight_scale_names, &choice, err)))
      cfg->weight_scale = (moe_weight_scale)choice;
    break;
  case K_BLOCK_N: s = json_int(v, key, &cfg->block_n, err); break;
  case K_BLOCK_K: s = json_int(v, key, &cfg->block_k, err); break;
  case K_HAS_ACT_SCALES: s = json_bool(v, key, &cfg->has_act_scales, err); break;
  case K_EXACT_DIVISION: s = json_bool(v, key, &cfg->exact_division, err); break;
  case K_HAS_BIAS: s = json_bool(v, key, &cfg->has_bias, err); break;
  case K_TOP_K: s = json_int(v, key, &r->top_k, err); break;
  case K_RENORMALIZE: s = json_bool(v, key, &r->renormalize, err); break;
  case K_NUM_EXPERT_GROUP: s = json_int(v, key, &r->num_expert_group, err); break;
  case K_TOPK_GROUP: s = json_int(v, key, &r->topk_group, err); break;
  case K_ROUTED_SCALING_FACTOR: s = json_double(v, key, &r->routed_scaling_factor, err); break;
  case K_COUNT: break;
  }
  return s;
}

moe_status moe_expert_config_parse(const char *json, moe_expert_config *cfg, moe_error *err) {
  moe_status s = MOE_OK;
  cJSON *root = NULL;
  moe_expert_config c;
  bool seen[K_COUNT] = {false};
  moe_expert_config_defaults(&c);
  if (!json) return moe_fail(err, MOE_EINVAL, "config: no text");
  const char *end = NULL;
  root = cJSON_ParseWithOpts(json, &end, 0);
  if (!root) {
    s = moe_fail(err, MOE_EINVAL, "config: not valid JSON (at byte %td)", end ? end - json : 0);
    goto fail;
  }
  while (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r')
    end++;
  if (*end) {
    s = moe_fail(err, MOE_EINVAL, "config: trailing text after the JSON object (at byte %td)", end - json);
    goto fail;
  }
  if (!cJSON_IsObject(root)) {
    s = moe_fail(err, MOE_EINVAL, "config: not a JSON object");
    goto fail;
  }
  int index = 0;
  for (const cJSON *it = root->child; it; it = it->next, index++) {
    int k = 0;
    while (k < K_COUNT && strcmp(cfg_keys[k], it->string) != 0)
      k++;
    /* a typo must not silently fall back to a default; the key itself is not
     * echoed: a config.json linked to some other JSON file would otherwise
     * show that file's keys to whoever asked for the load */
    if (k == K_COUNT) {
      s = moe_fail(err, MOE_EINVAL,
                   "config: key number %d of the object is not an expert-set config key (docs/expert-set.md)",
                   index + 1);
      goto fail;
    }
    if (seen[k]) {
      s = moe_fail(err, MOE_EINVAL, "%s: key given twice", it->string);
      goto fail;
    }
    seen[k] = true;
    s = parse_key((enum cfg_key)k, it, &c, err);
    if (s) goto fail;
  }
  static const enum cfg_key required[] = {K_NUM_EXPERTS, K_HIDDEN_SIZE, K_INTERMEDIATE_SIZE};
  for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
    if (!seen[required[i]]) {
      s = moe_fail(err, MOE_EINVAL, "%s: required key missing", cfg_keys[required[i]]);
      goto fail;
    }
  if (!seen[K_GLOBAL_NUM_EXPERTS]) c.global_num_experts = c.num_experts; /* an unsharded set */
  s = moe_expert_config_validate(&c, err);
  if (s) goto fail;
  *cfg = c;
fail:
  cJSON_Delete(root);
  return s;
}

/* ---- serializing -------------------------------------------------------------------- */

/* A double written with 17 significant digits, which always reads back to
 * the same value: cJSON's own printer tries 15 digits first and keeps them
 * when they read back to within a relative epsilon, not exactly (found by
 * fuzz/fuzz_expert_config.c: 7580058572823141489.5 came back one ulp off). */
static bool add_exact_double(cJSON *o, const char *key, double v) {
  char num[32];
  if (!isfinite(v)) return false; /* JSON has no NaN or inf (parsing refuses them too) */
  snprintf(num, sizeof num, "%.17g", v);
  return cJSON_AddRawToObject(o, key, num) != NULL;
}

/* snprintf semantics: the length the JSON needs, written when it fits. */
char *moe_expert_config_to_json(const moe_expert_config *cfg) {
  if (!cfg || (unsigned)cfg->scheme >= MOE_SCHEME_COUNT || (unsigned)cfg->activation >= MOE_ACT_COUNT ||
      (unsigned)cfg->routing.scoring >= MOE_SCORING_COUNT)
    return NULL;
  const moe_routing *r = &cfg->routing;
  cJSON *o = cJSON_CreateObject();
  /* sizes are at most CFG_MAX_DIM (exact as doubles, and cJSON prints
   * integers exactly); the one fractional value goes through add_exact_double */
  bool ok = o && cJSON_AddStringToObject(o, "scheme", moe_scheme_names[cfg->scheme]) &&
            cJSON_AddNumberToObject(o, "num_experts", (double)cfg->num_experts) &&
            cJSON_AddNumberToObject(o, "global_num_experts", (double)cfg->global_num_experts) &&
            cJSON_AddNumberToObject(o, "expert_offset", (double)cfg->expert_offset) &&
            cJSON_AddNumberToObject(o, "hidden_size", (double)cfg->hidden_size) &&
            cJSON_AddNumberToObject(o, "intermediate_size", (double)cfg->intermediate_size) &&
            cJSON_AddStringToObject(o, "activation", moe_activation_names[cfg->activation]);
  if (ok && cfg->scheme == MOE_SCHEME_WNA16)
    ok = cJSON_AddNumberToObject(o, "bits", cfg->bits) &&
         cJSON_AddNumberToObject(o, "group_size", (double)cfg->group_size) &&
         cJSON_AddBoolToObject(o, "has_zero_points", cfg->has_zero_points);
  if (ok && cfg->scheme == MOE_SCHEME_FP8)
    ok = (unsigned)cfg->weight_scale < MOE_WSCALE_COUNT &&
         cJSON_AddStringToObject(o, "weight_scale", moe_weight_scale_names[cfg->weight_scale]) &&
         cJSON_AddNumberToObject(o, "block_n", (double)cfg->block_n) &&
         cJSON_AddNumberToObject(o, "block_k", (double)cfg->block_k) &&
         cJSON_AddBoolToObject(o, "has_activation_scales", cfg->has_act_scales) &&
         cJSON_AddBoolToObject(o, "exact_division", cfg->exact_division);
  ok = ok && cJSON_AddBoolToObject(o, "has_bias", cfg->has_bias);
  ok = ok && cJSON_AddNumberToObject(o, "top_k", (double)r->top_k) &&
       cJSON_AddStringToObject(o, "scoring", moe_scoring_names[r->scoring]) &&
       cJSON_AddBoolToObject(o, "renormalize", r->renormalize) &&
       cJSON_AddNumberToObject(o, "num_expert_group", (double)r->num_expert_group) &&
       cJSON_AddNumberToObject(o, "topk_group", (double)r->topk_group) &&
       add_exact_double(o, "routed_scaling_factor", r->routed_scaling_factor);
  char *text = ok ? cJSON_Print(o) : NULL;
  cJSON_Delete(o);
  return text;
}
