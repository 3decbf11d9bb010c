/* The weight schemes of fused_moe, one descriptor each (scheme.h): bf16,
 * fp16, wna16, fp8 and mxfp4 (docs/numerics.md "fused_moe"; the tensors of
 * each in docs/expert-set.md). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "moe/codec.h"
#include "scheme.h"

const moe_slot_role moe_slot_roles[MOE_EXPERT_TENSOR_COUNT] = {
    [MOE_W13] = {MOE_KIND_W, true},
    [MOE_W2] = {MOE_KIND_W, false},
    [MOE_W13_QWEIGHT] = {MOE_KIND_QWEIGHT, true},
    [MOE_W13_SCALES] = {MOE_KIND_SCALES, true},
    [MOE_W13_QZEROS] = {MOE_KIND_QZEROS, true},
    [MOE_W2_QWEIGHT] = {MOE_KIND_QWEIGHT, false},
    [MOE_W2_SCALES] = {MOE_KIND_SCALES, false},
    [MOE_W2_QZEROS] = {MOE_KIND_QZEROS, false},
    [MOE_W13_BIAS] = {MOE_KIND_BIAS, true},
    [MOE_W2_BIAS] = {MOE_KIND_BIAS, false},
    [MOE_A13_SCALE] = {MOE_KIND_ASCALE, true},
    [MOE_A2_SCALE] = {MOE_KIND_ASCALE, false},
    [MOE_CORRECTION_BIAS] = {MOE_KIND_NONE, false},
};

moe_gemm_dims moe_gemm_of(const moe_expert_config *cfg, bool w13) {
  const int64_t h = cfg->hidden_size, i = cfg->intermediate_size;
  return (moe_gemm_dims){w13, cfg->num_experts, w13 ? 2 * i : h, w13 ? h : i};
}

/* "[E, 2I, H/2]"-style symbols: the GEMM's N and K names with a suffix on K. */
static void symbols(moe_slot_spec *sp, const moe_gemm_dims *g, const char *n_suffix, const char *k_suffix) {
  snprintf(sp->symbols, sizeof sp->symbols, "[E, %s%s, %s%s]", g->w13 ? "2I" : "H", n_suffix,
           g->w13 ? "H" : "I", k_suffix);
}

static void shape3(moe_slot_spec *sp, int64_t a, int64_t b, int64_t c) {
  sp->ndim = 3;
  sp->shape[0] = a;
  sp->shape[1] = b;
  sp->shape[2] = c;
}

/* uniform on [-a, a] (variance a^2 / 3) */
static float uniform_sym(uint64_t *rng, float a) { return (2.0f * moe_uniform01(rng) - 1.0f) * a; }

static size_t numel(const moe_tensor *t) { return t->nbytes / (moe_dtype_bits(t->dtype) / 8); }

static void store_f32(moe_tensor *t, size_t i, float v) { memcpy((uint8_t *)t->data + 4 * i, &v, 4); }

/* ---- bf16 / fp16 --------------------------------------------------------------------- */

static void dense_layout(const moe_expert_config *cfg, const moe_gemm_dims *g, moe_slot_kind kind,
                         moe_slot_spec *sp) {
  if (kind != MOE_KIND_W) return;
  sp->presence = MOE_SLOT_REQUIRED;
  sp->dtypes[0] = cfg->scheme == MOE_SCHEME_FP16 ? MOE_F16 : MOE_BF16;
  shape3(sp, g->e, g->n, g->k);
  symbols(sp, g, "", "");
}

/* Weights whose dequantized values have standard deviation about
 * 1/sqrt(K): a GEMM over K inputs of size O(1) then stays O(1), so outputs
 * neither vanish nor overflow fp16. */
static void dense_fill(const moe_expert_config *cfg, const moe_gemm_dims *g, moe_slot_kind kind,
                       moe_tensor *t, uint64_t *rng) {
  (void)cfg;
  (void)kind;
  const float a = (float)sqrt(3.0 / (double)g->k);
  for (size_t i = 0; i < numel(t); i++) {
    const float v = uniform_sym(rng, a);
    const uint16_t code = t->dtype == MOE_F16 ? moe_f32_to_f16(v) : moe_f32_to_bf16(v);
    memcpy((uint8_t *)t->data + 2 * i, &code, 2);
  }
}

/* ---- wna16 ------------------------------------------------------------------------------- */

static moe_status wna16_check(const moe_expert_config *c, moe_error *err) {
  if (c->bits != 4 && c->bits != 8)
    return moe_fail(err, MOE_EINVAL, "bits: must be 4 or 8 for scheme wna16, got %d", c->bits);
  int64_t g = c->group_size;
  if (g != -1 && (g < 1 || c->hidden_size % g != 0 || c->intermediate_size % g != 0))
    return moe_fail(
        err, MOE_EINVAL,
        "group_size: must be -1 or a positive divisor of hidden_size (%lld) and intermediate_size "
        "(%lld), got %lld",
        (long long)c->hidden_size, (long long)c->intermediate_size, (long long)g);
  /* int4 codes are packed two per byte along K, zero points along N */
  if (c->bits == 4 && c->hidden_size % 2 != 0)
    return moe_fail(err, MOE_EINVAL, "hidden_size: must be even for 4-bit weights, got %lld",
                    (long long)c->hidden_size);
  if (c->bits == 4 && c->intermediate_size % 2 != 0)
    return moe_fail(err, MOE_EINVAL, "intermediate_size: must be even for 4-bit weights, got %lld",
                    (long long)c->intermediate_size);
  return MOE_OK;
}

static void wna16_layout(const moe_expert_config *cfg, const moe_gemm_dims *g, moe_slot_kind kind,
                         moe_slot_spec *sp) {
  const bool int4 = cfg->bits == 4;
  const int64_t groups = cfg->group_size == -1 ? 1 : g->k / (cfg->group_size > 0 ? cfg->group_size : 1);
  switch (kind) {
  case MOE_KIND_QWEIGHT:
    sp->presence = MOE_SLOT_REQUIRED;
    sp->dtypes[0] = MOE_UINT8;
    shape3(sp, g->e, g->n, int4 ? g->k / 2 : g->k);
    symbols(sp, g, "", int4 ? "/2" : "");
    break;
  case MOE_KIND_SCALES:
    sp->presence = MOE_SLOT_REQUIRED;
    /* the writer's bf16: the dtype the 16-bit activations of most checkpoints use */
    sp->dtypes[0] = MOE_BF16;
    sp->dtypes[1] = MOE_F32;
    sp->dtypes[2] = MOE_F16;
    shape3(sp, g->e, g->n, groups);
    symbols(sp, g, "", "/G");
    break;
  case MOE_KIND_QZEROS:
    sp->presence = cfg->has_zero_points ? MOE_SLOT_REQUIRED : MOE_SLOT_ABSENT;
    sp->why = "has_zero_points is false";
    sp->dtypes[0] = MOE_UINT8;
    shape3(sp, g->e, int4 ? g->n / 2 : g->n, groups); /* int4 zero points pack along N */
    symbols(sp, g, int4 ? "/2" : "", "/G");
    break;
  default: break;
  }
}

static void wna16_fill(const moe_expert_config *cfg, const moe_gemm_dims *g, moe_slot_kind kind,
                       moe_tensor *t, uint64_t *rng) {
  uint8_t *bytes = t->data;
  if (kind == MOE_KIND_QWEIGHT) { /* every byte uniform = every code (int4: both nibbles) uniform */
    for (size_t i = 0; i < t->nbytes; i++)
      bytes[i] = (uint8_t)(moe_splitmix64(rng) >> 56);
  } else if (kind == MOE_KIND_SCALES) {
    /* uniform codes over 2^bits values: (q - z) has std sqrt((4^bits - 1) / 12) */
    const double code_std = sqrt((double)((1u << (2 * cfg->bits)) - 1u) / 12.0);
    const float base = (float)(1.0 / (sqrt((double)g->k) * code_std));
    for (size_t i = 0; i < numel(t); i++) {
      const uint16_t code = moe_f32_to_bf16(base * (0.75f + 0.5f * moe_uniform01(rng)));
      memcpy(bytes + 2 * i, &code, 2);
    }
  } else { /* zero points near the implicit one (8 or 128), so codes stay centred */
    const int mid = 1 << (cfg->bits - 1);
    for (size_t i = 0; i < t->nbytes; i++) {
      const uint64_t r = moe_splitmix64(rng);
      const int lo = mid - 2 + (int)(r & 3), hi = mid - 2 + (int)((r >> 2) & 3);
      bytes[i] = cfg->bits == 4 ? (uint8_t)(lo | (hi << 4)) : (uint8_t)lo;
    }
  }
}

static moe_status wna16_from_inline(moe_expert_config *cfg, const moe_tensor *const *slots,
                                    const moe_params *p, moe_error *err) {
  const moe_tensor *q13 = slots[MOE_W13_QWEIGHT], *s13 = slots[MOE_W13_SCALES];
  moe_status s;
  /* the last axis of w13_qweight tells the bits */
  int64_t bits = q13->shape[2] == cfg->hidden_size ? 8 : 4;
  if ((s = moe_params_int(p, "bits", &bits, err))) return s;
  if (bits != 4 && bits != 8)
    return moe_fail(err, MOE_EINVAL, "bits: must be 4 or 8, got %lld", (long long)bits);
  cfg->bits = (int)bits;
  /* group size from the scales' group count unless stated */
  if (s13 && s13->ndim == 3 && s13->shape[2] > 0 && cfg->hidden_size % s13->shape[2] == 0)
    cfg->group_size = s13->shape[2] == 1 ? -1 : cfg->hidden_size / s13->shape[2];
  if ((s = moe_params_int(p, "group_size", &cfg->group_size, err))) return s;
  cfg->has_zero_points = slots[MOE_W13_QZEROS] || slots[MOE_W2_QZEROS];
  return MOE_OK;
}

/* ---- fp8 W8A8 -------------------------------------------------------------------------------- */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static moe_status fp8_check(const moe_expert_config *c, moe_error *err) {
  if ((unsigned)c->weight_scale >= MOE_WSCALE_COUNT)
    return moe_fail(err, MOE_EINVAL, "weight_scale: value %d out of range", (int)c->weight_scale);
  if (c->weight_scale == MOE_WSCALE_BLOCK) {
    /* capped like every size of a config, so ceil(N / BN) cannot overflow */
    if (c->block_n < 1 || c->block_n > INT32_MAX)
      return moe_fail(err, MOE_EINVAL, "block_n: must be in [1, %d], got %lld", INT32_MAX,
                      (long long)c->block_n);
    /* activations are quantized per group of BK along K: BK divides both K */
    if (c->block_k < 1 || c->hidden_size % c->block_k != 0 || c->intermediate_size % c->block_k != 0)
      return moe_fail(err, MOE_EINVAL,
                      "block_k: must divide hidden_size (%lld) and intermediate_size (%lld), got %lld",
                      (long long)c->hidden_size, (long long)c->intermediate_size, (long long)c->block_k);
  }
  if (c->has_act_scales && c->weight_scale != MOE_WSCALE_PER_TENSOR)
    return moe_fail(err, MOE_EINVAL,
                    "has_activation_scales: static activation scales go with weight_scale per_tensor (is %s)",
                    moe_weight_scale_names[c->weight_scale]);
  return MOE_OK;
}

static void fp8_layout(const moe_expert_config *cfg, const moe_gemm_dims *g, moe_slot_kind kind,
                       moe_slot_spec *sp) {
  switch (kind) {
  case MOE_KIND_QWEIGHT:
    sp->presence = MOE_SLOT_REQUIRED;
    sp->dtypes[0] = MOE_UINT8;
    shape3(sp, g->e, g->n, g->k);
    symbols(sp, g, "", "");
    break;
  case MOE_KIND_SCALES:
    sp->presence = MOE_SLOT_REQUIRED;
    sp->dtypes[0] = MOE_F32;
    if (cfg->weight_scale == MOE_WSCALE_BLOCK) {
      shape3(sp, g->e, ceil_div(g->n, cfg->block_n), ceil_div(g->k, cfg->block_k));
      symbols(sp, g, "/BN", "/BK");
    } else if (cfg->weight_scale == MOE_WSCALE_PER_CHANNEL) {
      sp->ndim = 2;
      sp->shape[0] = g->e;
      sp->shape[1] = g->n;
      snprintf(sp->symbols, sizeof sp->symbols, "[E, %s]", g->w13 ? "2I" : "H");
    } else {
      sp->ndim = 1;
      sp->shape[0] = g->e;
      snprintf(sp->symbols, sizeof sp->symbols, "[E]");
    }
    break;
  case MOE_KIND_ASCALE:
    sp->presence = cfg->has_act_scales ? MOE_SLOT_REQUIRED : MOE_SLOT_ABSENT;
    sp->why = "has_activation_scales is false (activations are quantized per token)";
    sp->dtypes[0] = MOE_F32;
    sp->ndim = 1;
    sp->shape[0] = g->e;
    snprintf(sp->symbols, sizeof sp->symbols, "[E]");
    break;
  default: break;
  }
}

/* Static activation scales: finite and > 0 (docs/numerics.md "Weight scheme fp8"). */
static moe_status fp8_values(const moe_expert_set *set, moe_error *err) {
  for (int slot = MOE_A13_SCALE; slot <= MOE_A2_SCALE; slot++) {
    const moe_tensor *t = &set->t[slot];
    for (size_t i = 0; t->data && i < numel(t); i++) {
      float v;
      memcpy(&v, (const uint8_t *)t->data + 4 * i, 4);
      if (!(v > 0.0f) || !moe_f32_isfinite(v))
        return moe_fail(err, MOE_EINVAL,
                        "%s: entry %zu is %g; static activation scales must be finite and > 0",
                        moe_expert_tensor_names[slot], i, (double)v);
    }
  }
  return MOE_OK;
}

/* Codes of values uniform on [-224, 224] (half the e4m3fn range), scales
 * that bring them to about U(-1, 1) * sqrt(3 / K); static activation
 * scales for activations of order one. */
static void fp8_fill(const moe_expert_config *cfg, const moe_gemm_dims *g, moe_slot_kind kind, moe_tensor *t,
                     uint64_t *rng) {
  (void)cfg;
  static const moe_narrow_fmt e4m3 = MOE_FMT_E4M3FN;
  if (kind == MOE_KIND_QWEIGHT) {
    for (size_t i = 0; i < t->nbytes; i++)
      ((uint8_t *)t->data)[i] = moe_f32_to_narrow(uniform_sym(rng, 224.0f), &e4m3, false);
  } else if (kind == MOE_KIND_SCALES) {
    const float base = (float)(sqrt(3.0 / (double)g->k) / 224.0);
    for (size_t i = 0; i < numel(t); i++)
      store_f32(t, i, base * (0.75f + 0.5f * moe_uniform01(rng)));
  } else {
    for (size_t i = 0; i < numel(t); i++)
      store_f32(t, i, (4.0f / 448.0f) * (0.75f + 0.5f * moe_uniform01(rng)));
  }
}

static moe_status fp8_from_inline(moe_expert_config *cfg, const moe_tensor *const *slots, const moe_params *p,
                                  moe_error *err) {
  const moe_tensor *s13 = slots[MOE_W13_SCALES];
  moe_status s;
  /* the scales' rank tells the layout unless stated */
  int ws = !s13 || s13->ndim == 1 ? MOE_WSCALE_PER_TENSOR
           : s13->ndim == 2       ? MOE_WSCALE_PER_CHANNEL
                                  : MOE_WSCALE_BLOCK;
  if ((s = moe_params_choice(p, "weight_scale", moe_weight_scale_names, &ws, err))) return s;
  cfg->weight_scale = (moe_weight_scale)ws;
  if ((s = moe_params_int(p, "block_n", &cfg->block_n, err))) return s;
  if ((s = moe_params_int(p, "block_k", &cfg->block_k, err))) return s;
  if ((s = moe_params_bool(p, "exact_division", &cfg->exact_division, err))) return s;
  cfg->has_act_scales = slots[MOE_A13_SCALE] || slots[MOE_A2_SCALE];
  return MOE_OK;
}

/* ---- mxfp4 W4A16 -------------------------------------------------------------------------------- */

#define MX_BLOCK 32

static moe_status mxfp4_check(const moe_expert_config *c, moe_error *err) {
  if (c->hidden_size % MX_BLOCK != 0)
    return moe_fail(err, MOE_EINVAL, "hidden_size: must be a multiple of 32 for mxfp4 weights, got %lld",
                    (long long)c->hidden_size);
  if (c->intermediate_size % MX_BLOCK != 0)
    return moe_fail(err, MOE_EINVAL,
                    "intermediate_size: must be a multiple of 32 for mxfp4 weights, got %lld",
                    (long long)c->intermediate_size);
  return MOE_OK;
}

static void mxfp4_layout(const moe_expert_config *cfg, const moe_gemm_dims *g, moe_slot_kind kind,
                         moe_slot_spec *sp) {
  (void)cfg;
  if (kind != MOE_KIND_QWEIGHT && kind != MOE_KIND_SCALES) return;
  sp->presence = MOE_SLOT_REQUIRED;
  sp->dtypes[0] = MOE_UINT8;
  const bool codes = kind == MOE_KIND_QWEIGHT;
  shape3(sp, g->e, g->n, codes ? g->k / 2 : g->k / MX_BLOCK);
  symbols(sp, g, "", codes ? "/2" : "/32");
}

/* A NaN scale (e8m0 0xFF) would make a whole block NaN: refused at load. */
static moe_status mxfp4_values(const moe_expert_set *set, moe_error *err) {
  for (int slot = MOE_W13_SCALES; slot <= MOE_W2_SCALES; slot += MOE_W2_SCALES - MOE_W13_SCALES) {
    const moe_tensor *t = &set->t[slot];
    const uint8_t *b = t->data;
    const void *hit = b ? memchr(b, 0xFF, t->nbytes) : NULL;
    if (!hit) continue;
    const size_t i = (size_t)((const uint8_t *)hit - b), cols = (size_t)t->shape[2],
                 rows = (size_t)t->shape[1];
    return moe_fail(err, MOE_EINVAL, "%s: e8m0 scale byte 0xFF (NaN) at [%zu, %zu, %zu]",
                    moe_expert_tensor_names[slot], i / (rows * cols), i / cols % rows, i % cols);
  }
  return MOE_OK;
}

/* Uniform codes (values of std ~2.93) and scales 2^(b - 127) near
 * 1 / (2.93 sqrt(K)), one of two neighbouring powers per block. */
static void mxfp4_fill(const moe_expert_config *cfg, const moe_gemm_dims *g, moe_slot_kind kind,
                       moe_tensor *t, uint64_t *rng) {
  (void)cfg;
  uint8_t *bytes = t->data;
  if (kind == MOE_KIND_QWEIGHT) {
    for (size_t i = 0; i < t->nbytes; i++)
      bytes[i] = (uint8_t)(moe_splitmix64(rng) >> 56);
    return;
  }
  const int e = (int)floor(log2(1.0 / (2.93 * sqrt((double)g->k))));
  for (size_t i = 0; i < t->nbytes; i++)
    bytes[i] = (uint8_t)(127 + e + (int)(moe_splitmix64(rng) >> 63));
}

/* ---- the table --------------------------------------------------------------------------------- */

const moe_scheme_desc moe_schemes[MOE_SCHEME_COUNT] = {
    [MOE_SCHEME_BF16] = {.act = MOE_BF16, .gpu = true, .layout = dense_layout, .fill = dense_fill},
    [MOE_SCHEME_FP16] = {.act = MOE_F16, .gpu = true, .layout = dense_layout, .fill = dense_fill},
    [MOE_SCHEME_WNA16] = {.act = MOE_DTYPE_INVALID,
                          .quantized = true,
                          .gpu = true,
                          .check_config = wna16_check,
                          .layout = wna16_layout,
                          .fill = wna16_fill,
                          .from_inline = wna16_from_inline},
    [MOE_SCHEME_FP8] = {.act = MOE_DTYPE_INVALID,
                        .quantized = true,
                        .gpu = true, /* both GPU GEMMs (tensor-core and portable) */
                        .check_config = fp8_check,
                        .layout = fp8_layout,
                        .check_values = fp8_values,
                        .fill = fp8_fill,
                        .from_inline = fp8_from_inline},
    [MOE_SCHEME_MXFP4] = {.act = MOE_DTYPE_INVALID,
                          .quantized = true,
                          .gpu = true, /* both GPU GEMMs (tensor-core and portable) */
                          .check_config = mxfp4_check,
                          .layout = mxfp4_layout,
                          .check_values = mxfp4_values,
                          .fill = mxfp4_fill},
};

/* Keys that belong to one scheme: on another they must keep their defaults
 * (a quantization key on a 16-bit set is a mistake, not a no-op). */
static bool key_bits(const moe_expert_config *c) { return c->bits != 0; }
static bool key_group_size(const moe_expert_config *c) { return c->group_size != -1; }
static bool key_zero_points(const moe_expert_config *c) { return c->has_zero_points; }
static bool key_weight_scale(const moe_expert_config *c) { return c->weight_scale != MOE_WSCALE_PER_TENSOR; }
static bool key_block_n(const moe_expert_config *c) { return c->block_n != 128; }
static bool key_block_k(const moe_expert_config *c) { return c->block_k != 128; }
static bool key_act_scales(const moe_expert_config *c) { return c->has_act_scales; }
static bool key_exact_division(const moe_expert_config *c) { return c->exact_division; }

static const struct {
  const char *key;
  moe_scheme owner;
  bool (*is_set)(const moe_expert_config *c);
} scheme_keys[] = {
    {"bits", MOE_SCHEME_WNA16, key_bits},
    {"group_size", MOE_SCHEME_WNA16, key_group_size},
    {"has_zero_points", MOE_SCHEME_WNA16, key_zero_points},
    {"weight_scale", MOE_SCHEME_FP8, key_weight_scale},
    {"block_n", MOE_SCHEME_FP8, key_block_n},
    {"block_k", MOE_SCHEME_FP8, key_block_k},
    {"has_activation_scales", MOE_SCHEME_FP8, key_act_scales},
    {"exact_division", MOE_SCHEME_FP8, key_exact_division},
};

moe_status moe_scheme_check_config(const moe_expert_config *cfg, moe_error *err) {
  for (size_t i = 0; i < sizeof scheme_keys / sizeof scheme_keys[0]; i++)
    if (scheme_keys[i].owner != cfg->scheme && scheme_keys[i].is_set(cfg))
      return moe_fail(err, MOE_EINVAL, "%s: only scheme %s takes this key (scheme is %s)", scheme_keys[i].key,
                      moe_scheme_names[scheme_keys[i].owner], moe_scheme_names[cfg->scheme]);
  const moe_scheme_desc *d = &moe_schemes[cfg->scheme];
  return d->check_config ? d->check_config(cfg, err) : MOE_OK;
}

moe_slot_spec moe_slot_expected(const moe_expert_config *cfg, moe_expert_tensor slot) {
  moe_slot_spec sp;
  memset(&sp, 0, sizeof sp);
  const moe_slot_role role = moe_slot_roles[slot];
  const moe_gemm_dims g = moe_gemm_of(cfg, role.w13);
  const moe_scheme_desc *d = &moe_schemes[cfg->scheme];
  switch (role.kind) {
  case MOE_KIND_NONE: /* correction_bias: the routing's, any scheme */
    sp.presence = MOE_SLOT_OPTIONAL;
    sp.dtypes[0] = MOE_F32;
    sp.ndim = 1;
    sp.shape[0] = cfg->global_num_experts;
    snprintf(sp.symbols, sizeof sp.symbols, "[global_num_experts]");
    break;
  case MOE_KIND_BIAS: /* every scheme: F32 or an activation dtype it takes */
    sp.presence = cfg->has_bias ? MOE_SLOT_REQUIRED : MOE_SLOT_ABSENT;
    sp.why = "has_bias is false";
    sp.dtypes[0] = MOE_F32;
    sp.dtypes[1] = d->act == MOE_DTYPE_INVALID ? MOE_BF16 : d->act;
    sp.dtypes[2] = d->act == MOE_DTYPE_INVALID ? MOE_F16 : MOE_DTYPE_INVALID;
    sp.ndim = 2;
    sp.shape[0] = g.e;
    sp.shape[1] = g.n;
    snprintf(sp.symbols, sizeof sp.symbols, "[E, %s]", g.w13 ? "2I" : "H");
    break;
  default: d->layout(cfg, &g, role.kind, &sp); break;
  }
  return sp;
}

void moe_slot_fill(const moe_expert_config *cfg, moe_expert_tensor slot, moe_tensor *t, uint64_t *rng) {
  const moe_slot_role role = moe_slot_roles[slot];
  const moe_gemm_dims g = moe_gemm_of(cfg, role.w13);
  if (role.kind == MOE_KIND_BIAS) { /* small next to outputs of order one */
    for (size_t i = 0; i < numel(t); i++)
      store_f32(t, i, uniform_sym(rng, 0.25f));
    return;
  }
  if (role.kind != MOE_KIND_NONE) moe_schemes[cfg->scheme].fill(cfg, &g, role.kind, t, rng);
}
