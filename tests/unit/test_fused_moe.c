/* fused_moe on the CPU backend (docs/numerics.md "fused_moe"):
 * - each scheme (bf16, fp16, wna16 int4/int8 with and without zero points,
 *   group sizes 32/64/128/-1, odd sizes; mxfp4; fp8 with block, per-channel
 *   and per-tensor weight scales, dynamic and static activation scales;
 *   expert biases in F32 and the activation dtype) and activation against a
 *   plain float64 reference with the same rounding points, written here
 *   from the definition (tolerances of docs/numerics.md, fp8's looser one);
 * - batch invariance: a token's output bits alone and inside batches of 2, 7
 *   and 64 random tokens are identical;
 * - outputs poisoned with NaN before each call are fully written;
 * - the AVX-512 weight decoders (the strip's and the direct dot of experts
 *   with few tokens) give the bytes of the kept reference path (weights
 *   dequantized element by element, every dot product from the strip) for
 *   every case at 1, 5, 40 and 200 tokens;
 * - routing by router_logits equals moe.topk followed by topk_ids;
 * - expert shards: ids outside the shard contribute nothing;
 * - every bad input is rejected with MOE_EINVAL naming the field. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu.h"
#include "moe/backend.h"
#include "moe/codec.h"
#include "moe/expert_set.h"
#include "moe/ops.h"

#define ck_assert_msg_has(err, needle)                                                                       \
  ck_assert_msg(strstr((err).msg, (needle)) != NULL, "message '%s' lacks '%s'", (err).msg, (needle))

/* ---- random numbers ------------------------------------------------------------- */

static uint64_t rng_state;
static uint32_t rng_u32(void) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(rng_state >> 33);
}
static float rng_uniform(float lo, float hi) {
  return lo + (hi - lo) * (float)(rng_u32() >> 8) / (float)(1u << 23) * 0.5f;
}

/* ---- a model: config + weights in memory ------------------------------------------ */

typedef struct fm_case {
  const char *name;
  moe_scheme scheme;
  moe_dtype act;     /* hidden_states dtype */
  int bits;          /* wna16 */
  int64_t group;     /* wna16 */
  bool zeros;        /* wna16 */
  moe_dtype scale_t; /* wna16 scales */
  int64_t hidden, inter;
  moe_weight_scale ws; /* fp8 */
  int64_t bn, bk;      /* fp8 block */
  bool static_a;       /* fp8 per_tensor: a13_scale / a2_scale */
  moe_dtype bias_t;    /* w13_bias / w2_bias; MOE_DTYPE_INVALID (0): none */
} fm_case;

/* each row names the fields its scheme uses; the others are zero */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
static const fm_case cases[] = {
    {"bf16", MOE_SCHEME_BF16, MOE_BF16, 0, -1, false, MOE_F32, 256, 128},
    {"fp16", MOE_SCHEME_FP16, MOE_F16, 0, -1, false, MOE_F32, 256, 128},
    {"bf16 odd sizes", MOE_SCHEME_BF16, MOE_BF16, 0, -1, false, MOE_F32, 72, 20},
    {"fp16 odd sizes", MOE_SCHEME_FP16, MOE_F16, 0, -1, false, MOE_F32, 40, 36},
    {"int4 g128 bf16", MOE_SCHEME_WNA16, MOE_BF16, 4, 128, false, MOE_BF16, 256, 128},
    {"int4 g64 zp fp16", MOE_SCHEME_WNA16, MOE_F16, 4, 64, true, MOE_F16, 256, 128},
    {"int4 g32 zp bf16", MOE_SCHEME_WNA16, MOE_BF16, 4, 32, true, MOE_F32, 256, 128},
    {"int4 g-1 fp16", MOE_SCHEME_WNA16, MOE_F16, 4, -1, false, MOE_F32, 256, 128},
    {"int4 g-1 zp bf16", MOE_SCHEME_WNA16, MOE_BF16, 4, -1, true, MOE_BF16, 256, 128},
    {"int4 g4 zp odd sizes", MOE_SCHEME_WNA16, MOE_BF16, 4, 4, true, MOE_F32, 72, 20},
    {"int4 g3 odd groups", MOE_SCHEME_WNA16, MOE_F16, 4, 3, false, MOE_F16, 48, 18},
    {"int8 g128 bf16", MOE_SCHEME_WNA16, MOE_BF16, 8, 128, false, MOE_BF16, 256, 128},
    {"int8 g64 zp fp16", MOE_SCHEME_WNA16, MOE_F16, 8, 64, true, MOE_F32, 256, 128},
    {"int8 g32 fp16", MOE_SCHEME_WNA16, MOE_F16, 8, 32, false, MOE_F16, 256, 128},
    {"int8 g-1 zp bf16", MOE_SCHEME_WNA16, MOE_BF16, 8, -1, true, MOE_F32, 256, 128},
    {"int8 g5 zp odd sizes", MOE_SCHEME_WNA16, MOE_BF16, 8, 5, true, MOE_BF16, 40, 30},
    {"bf16 bias bf16", MOE_SCHEME_BF16, MOE_BF16, 0, -1, false, MOE_F32, 72, 20, .bias_t = MOE_BF16},
    {"int4 g64 bias f32 fp16", MOE_SCHEME_WNA16, MOE_F16, 4, 64, false, MOE_F16, 256, 128, .bias_t = MOE_F32},
    {"mxfp4 bf16", MOE_SCHEME_MXFP4, MOE_BF16, 0, -1, false, 0, 256, 128},
    {"mxfp4 fp16", MOE_SCHEME_MXFP4, MOE_F16, 0, -1, false, 0, 256, 96},
    {"mxfp4 bf16 bias f32", MOE_SCHEME_MXFP4, MOE_BF16, 0, -1, false, 0, 256, 128, .bias_t = MOE_F32},
    {"mxfp4 fp16 bias fp16", MOE_SCHEME_MXFP4, MOE_F16, 0, -1, false, 0, 64, 160, .bias_t = MOE_F16},
    {"fp8 block 128 bf16", MOE_SCHEME_FP8, MOE_BF16, 0, -1, false, 0, 256, 128, MOE_WSCALE_BLOCK, 128, 128},
    {"fp8 block 48x64 fp16 bias", MOE_SCHEME_FP8, MOE_F16, 0, -1, false, 0, 256, 128, MOE_WSCALE_BLOCK, 48,
     64, .bias_t = MOE_F32},
    {"fp8 block 40x24 odd", MOE_SCHEME_FP8, MOE_BF16, 0, -1, false, 0, 72, 48, MOE_WSCALE_BLOCK, 40, 24},
    {"fp8 per_channel bf16", MOE_SCHEME_FP8, MOE_BF16, 0, -1, false, 0, 256, 128, MOE_WSCALE_PER_CHANNEL},
    {"fp8 per_tensor fp16", MOE_SCHEME_FP8, MOE_F16, 0, -1, false, 0, 72, 20, MOE_WSCALE_PER_TENSOR},
    {"fp8 per_tensor static bf16 bias", MOE_SCHEME_FP8, MOE_BF16, 0, -1, false, 0, 256, 128,
     MOE_WSCALE_PER_TENSOR, .static_a = true, .bias_t = MOE_BF16},
};
#pragma GCC diagnostic pop
#define N_CASES ((int)(sizeof cases / sizeof cases[0]))

#define N_EXPERTS 6
#define TOP_K 3

typedef struct model {
  fm_case c;
  moe_activation activation;
  moe_expert_config cfg;
  void *buf[MOE_EXPERT_TENSOR_COUNT];
  moe_named_tensor t[MOE_EXPERT_TENSOR_COUNT];
  size_t nt;
} model;

static void store_act(void *p, moe_dtype t, size_t i, float v) {
  if (t == MOE_F32)
    ((float *)p)[i] = v;
  else
    ((uint16_t *)p)[i] = t == MOE_F16 ? moe_f32_to_f16(v) : moe_f32_to_bf16(v);
}
static float load_act(const void *p, moe_dtype t, size_t i) {
  if (t == MOE_F32) return ((const float *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  return t == MOE_F16 ? moe_f16_to_f32(h) : moe_bf16_to_f32(h);
}
static float round_act(float v, moe_dtype t) {
  return t == MOE_F16 ? moe_f16_to_f32(moe_f32_to_f16(v)) : moe_bf16_to_f32(moe_f32_to_bf16(v));
}
static size_t dtype_size(moe_dtype t) { return t == MOE_F32 ? 4 : 2; }

/* A tensor of rank 3, or less where trailing dimensions are 0. */
static void add_tensor(model *m, moe_expert_tensor slot, moe_dtype dt, int64_t d0, int64_t d1, int64_t d2,
                       size_t elem) {
  const int32_t ndim = d2 ? 3 : d1 ? 2 : 1;
  size_t n = (size_t)(d0 * (d1 ? d1 : 1) * (d2 ? d2 : 1));
  m->buf[slot] = malloc(n * elem);
  ck_assert_ptr_nonnull(m->buf[slot]);
  m->t[m->nt++] =
      (moe_named_tensor){moe_expert_tensor_names[slot], {dt, ndim, {d0, d1, d2}, m->buf[slot], n * elem}};
}

static size_t numel_of(const moe_tensor *t) {
  size_t n = 1;
  for (int d = 0; d < t->ndim; d++)
    n *= (size_t)t->shape[d];
  return n;
}

static const moe_narrow_fmt fmt_e4m3 = MOE_FMT_E4M3FN, fmt_e2m1 = MOE_FMT_E2M1;

/* The new schemes' tensors (and every scheme's biases): mxfp4 codes with
 * e8m0 scales near 1 / (2.93 sqrt(K)); fp8 codes of U(-224, 224) with
 * scales to about U(-1, 1) sqrt(3 / K) in the case's layout; static
 * activation scales for inputs of order one; biases U(-0.25, 0.25). */
static void add_new_scheme(model *m, const fm_case *c) {
  const int64_t e = N_EXPERTS, h = c->hidden, i2 = 2 * c->inter, in = c->inter;
  moe_expert_config *cfg = &m->cfg;
  for (int g = 0; g < 2; g++) {
    const int64_t n = g ? h : i2, k = g ? in : h;
    const moe_expert_tensor q = g ? MOE_W2_QWEIGHT : MOE_W13_QWEIGHT, sc = g ? MOE_W2_SCALES : MOE_W13_SCALES;
    if (c->scheme == MOE_SCHEME_MXFP4) {
      add_tensor(m, q, MOE_UINT8, e, n, k / 2, 1);
      add_tensor(m, sc, MOE_UINT8, e, n, k / 32, 1);
      for (size_t j = 0; j < (size_t)(e * n * k / 2); j++)
        ((uint8_t *)m->buf[q])[j] = (uint8_t)rng_u32();
      const int base = 127 + (int)floor(log2(1.0 / (2.93 * sqrt((double)k))));
      for (size_t j = 0; j < (size_t)(e * n * k / 32); j++)
        ((uint8_t *)m->buf[sc])[j] = (uint8_t)(base + (int)(rng_u32() % 2));
    } else if (c->scheme == MOE_SCHEME_FP8) {
      add_tensor(m, q, MOE_UINT8, e, n, k, 1);
      for (size_t j = 0; j < (size_t)(e * n * k); j++)
        ((uint8_t *)m->buf[q])[j] = moe_f32_to_narrow(rng_uniform(-224, 224), &fmt_e4m3, false);
      if (c->ws == MOE_WSCALE_BLOCK)
        add_tensor(m, sc, MOE_F32, e, (n + c->bn - 1) / c->bn, k / c->bk, 4);
      else if (c->ws == MOE_WSCALE_PER_CHANNEL)
        add_tensor(m, sc, MOE_F32, e, n, 0, 4);
      else
        add_tensor(m, sc, MOE_F32, e, 0, 0, 4);
      const moe_tensor *st = &m->t[m->nt - 1].tensor;
      for (size_t j = 0; j < numel_of(st); j++)
        ((float *)m->buf[sc])[j] = rng_uniform(0.75f, 1.25f) * sqrtf(3.0f / (float)k) / 224.0f;
      if (c->static_a) {
        const moe_expert_tensor as = g ? MOE_A2_SCALE : MOE_A13_SCALE;
        add_tensor(m, as, MOE_F32, e, 0, 0, 4);
        for (size_t j = 0; j < (size_t)e; j++)
          ((float *)m->buf[as])[j] = rng_uniform(0.75f, 1.25f) * 4.0f / 448.0f;
      }
    }
    if (c->bias_t) {
      const moe_expert_tensor b = g ? MOE_W2_BIAS : MOE_W13_BIAS;
      add_tensor(m, b, c->bias_t, e, n, 0, dtype_size(c->bias_t));
      for (size_t j = 0; j < (size_t)(e * n); j++)
        store_act(m->buf[b], c->bias_t, j, rng_uniform(-0.25f, 0.25f));
    }
  }
  cfg->weight_scale = c->ws;
  if (c->scheme == MOE_SCHEME_FP8 && c->ws == MOE_WSCALE_BLOCK) cfg->block_n = c->bn, cfg->block_k = c->bk;
  cfg->has_act_scales = c->static_a;
  cfg->has_bias = c->bias_t != MOE_DTYPE_INVALID;
}

static void model_make(model *m, const fm_case *c, moe_activation activation, uint64_t seed) {
  memset(m, 0, sizeof *m);
  m->c = *c;
  m->activation = activation;
  rng_state = seed;
  moe_expert_config_defaults(&m->cfg);
  moe_expert_config *cfg = &m->cfg;
  cfg->scheme = c->scheme;
  cfg->num_experts = cfg->global_num_experts = N_EXPERTS;
  cfg->hidden_size = c->hidden;
  cfg->intermediate_size = c->inter;
  cfg->activation = activation;
  cfg->routing.top_k = TOP_K;
  const int64_t e = N_EXPERTS, h = c->hidden, i2 = 2 * c->inter, in = c->inter;
  if (c->scheme == MOE_SCHEME_MXFP4 || c->scheme == MOE_SCHEME_FP8) {
    add_new_scheme(m, c);
    return;
  }
  if (c->scheme != MOE_SCHEME_WNA16) {
    /* weights ~ U(-1, 1) / sqrt(K): outputs of order one */
    add_tensor(m, MOE_W13, c->act, e, i2, h, 2);
    add_tensor(m, MOE_W2, c->act, e, h, in, 2);
    for (size_t j = 0; j < (size_t)(e * i2 * h); j++)
      store_act(m->buf[MOE_W13], c->act, j, rng_uniform(-1, 1) * 2.0f / sqrtf((float)h));
    for (size_t j = 0; j < (size_t)(e * h * in); j++)
      store_act(m->buf[MOE_W2], c->act, j, rng_uniform(-1, 1) * 2.0f / sqrtf((float)in));
    add_new_scheme(m, c); /* the biases */
    return;
  }
  cfg->bits = c->bits;
  cfg->group_size = c->group;
  cfg->has_zero_points = c->zeros;
  const int div = c->bits == 4 ? 2 : 1;
  const int64_t g13 = c->group == -1 ? 1 : h / c->group, g2 = c->group == -1 ? 1 : in / c->group;
  add_tensor(m, MOE_W13_QWEIGHT, MOE_UINT8, e, i2, h / div, 1);
  add_tensor(m, MOE_W13_SCALES, c->scale_t, e, i2, g13, dtype_size(c->scale_t));
  add_tensor(m, MOE_W2_QWEIGHT, MOE_UINT8, e, h, in / div, 1);
  add_tensor(m, MOE_W2_SCALES, c->scale_t, e, h, g2, dtype_size(c->scale_t));
  if (c->zeros) {
    add_tensor(m, MOE_W13_QZEROS, MOE_UINT8, e, c->bits == 4 ? i2 / 2 : i2, g13, 1);
    add_tensor(m, MOE_W2_QZEROS, MOE_UINT8, e, c->bits == 4 ? h / 2 : h, g2, 1);
  }
  const size_t quantized = m->nt;
  add_new_scheme(m, c); /* the biases */
  for (size_t i = 0; i < quantized; i++) {
    const moe_tensor *t = &m->t[i].tensor;
    const char *name = m->t[i].name;
    const size_t n = (size_t)(t->shape[0] * t->shape[1] * t->shape[2]);
    if (strstr(name, "_scales")) {
      /* step so that codes span about U(-1, 1) / sqrt(K) */
      const float k = strncmp(name, "w13", 3) == 0 ? (float)h : (float)in;
      const float half = c->bits == 4 ? 8.0f : 128.0f;
      for (size_t j = 0; j < n; j++)
        store_act(t->data, c->scale_t, j, rng_uniform(0.5f, 1.5f) * 2.0f / sqrtf(k) / half);
    } else if (strstr(name, "_qzeros")) {
      /* near the midpoint, so the weights stay centred */
      for (size_t j = 0; j < n; j++)
        ((uint8_t *)t->data)[j] =
            c->bits == 4 ? (uint8_t)(0x77 + (rng_u32() % 3) * 0x11) : (uint8_t)(126 + rng_u32() % 5);
    } else {
      for (size_t j = 0; j < n; j++)
        ((uint8_t *)t->data)[j] = (uint8_t)rng_u32();
    }
  }
}

static void model_free(model *m) {
  for (int s = 0; s < MOE_EXPERT_TENSOR_COUNT; s++)
    free(m->buf[s]);
}

static moe_expert_set *model_set(const model *m, const moe_expert_config *cfg) {
  moe_expert_set *set = NULL;
  moe_error err = {{0}};
  moe_status s = moe_expert_set_from_tensors("test", cfg ? cfg : &m->cfg, m->t, m->nt, &set, &err);
  ck_assert_msg(s == MOE_OK, "expert set: %s", err.msg);
  return set;
}

/* ---- the reference: docs/numerics.md "fused_moe" in float64 sums ------------------------ */

/* w[e][n][j] of W13 (down = false, N = 2I, K = H) or W2 (N = H, K = I). */
static float ref_weight(const model *m, bool down, int64_t e, int64_t n, int64_t j) {
  const fm_case *c = &m->c;
  const int64_t nn = down ? c->hidden : 2 * c->inter, k = down ? c->inter : c->hidden;
  if (c->scheme == MOE_SCHEME_BF16 || c->scheme == MOE_SCHEME_FP16)
    return load_act(m->buf[down ? MOE_W2 : MOE_W13], c->act, (size_t)((e * nn + n) * k + j));
  const uint8_t *qw = m->buf[down ? MOE_W2_QWEIGHT : MOE_W13_QWEIGHT];
  if (c->scheme == MOE_SCHEME_FP8) /* the code's value: the scales come in the GEMM */
    return moe_narrow_to_f32(qw[(e * nn + n) * k + j], &fmt_e4m3);
  if (c->scheme == MOE_SCHEME_MXFP4) {
    const uint8_t b = qw[(e * nn + n) * (k / 2) + j / 2];
    const uint8_t sb =
        ((const uint8_t *)m->buf[down ? MOE_W2_SCALES : MOE_W13_SCALES])[(e * nn + n) * (k / 32) + j / 32];
    return round_act(moe_narrow_to_f32(j % 2 ? b >> 4 : b & 15, &fmt_e2m1) * (float)ldexp(1.0, sb - 127),
                     c->act);
  }
  const int64_t group = c->group == -1 ? k : c->group, groups = k / group, g = j / group;
  const uint8_t *q = m->buf[down ? MOE_W2_QWEIGHT : MOE_W13_QWEIGHT];
  float code, zero;
  if (c->bits == 4) {
    uint8_t b = q[(e * nn + n) * (k / 2) + j / 2];
    code = (float)(j % 2 ? b >> 4 : b & 15);
  } else {
    code = (float)q[(e * nn + n) * k + j];
  }
  if (!c->zeros) {
    zero = c->bits == 4 ? 8.0f : 128.0f;
  } else if (c->bits == 4) {
    uint8_t b =
        ((const uint8_t *)m->buf[down ? MOE_W2_QZEROS : MOE_W13_QZEROS])[(e * (nn / 2) + n / 2) * groups + g];
    zero = (float)(n % 2 ? b >> 4 : b & 15);
  } else {
    zero = (float)((const uint8_t *)m->buf[down ? MOE_W2_QZEROS : MOE_W13_QZEROS])[(e * nn + n) * groups + g];
  }
  const float scale = load_act(m->buf[down ? MOE_W2_SCALES : MOE_W13_SCALES], c->scale_t,
                               (size_t)((e * nn + n) * groups + g));
  return round_act((code - zero) * scale, c->act);
}

/* fp8: v[0..n) quantized to e4m3fn as the contract's quant ops do (s given,
 * or dynamic from the finite amax), replaced by the codes' values; the scale. */
static float ref_fp8_quant(float *v, int64_t n, float s, bool exact) {
  if (s <= 0.0f) {
    float amax = 0.0f;
    for (int64_t j = 0; j < n; j++)
      if (isfinite(v[j]) && fabsf(v[j]) > amax) amax = fabsf(v[j]);
    s = amax / 448.0f;
    if (s == 0.0f) s = 1.0f;
  }
  const float r = 1.0f / s;
  for (int64_t j = 0; j < n; j++)
    v[j] = moe_narrow_to_f32(moe_f32_to_narrow(exact ? v[j] / s : v[j] * r, &fmt_e4m3, false), &fmt_e4m3);
  return s;
}

/* fp8: the GEMM input v [K] quantized at the case's granularity (in place);
 * sx[b] its scales per K block (one unless block scales). */
static void ref_fp8_input(const model *m, bool down, int64_t e, float *v, int64_t k, float *sx) {
  const fm_case *c = &m->c;
  const int64_t bk = c->ws == MOE_WSCALE_BLOCK ? c->bk : k;
  const float st = c->static_a ? ((const float *)m->buf[down ? MOE_A2_SCALE : MOE_A13_SCALE])[e] : 0.0f;
  for (int64_t b = 0; b < k / bk; b++)
    sx[b] = ref_fp8_quant(v + b * bk, bk, st, m->cfg.exact_division);
}

/* The fp32 GEMM result of row n (before bias and rounding) in float64:
 * SUM_j v[j] * w[n, j], for fp8 with the scales of the contract. */
static double ref_dot(const model *m, bool down, int64_t e, int64_t n, const float *v, const float *sx) {
  const fm_case *c = &m->c;
  const int64_t nn = down ? c->hidden : 2 * c->inter, k = down ? c->inter : c->hidden;
  if (c->scheme != MOE_SCHEME_FP8) {
    double s = 0.0;
    for (int64_t j = 0; j < k; j++)
      s += (double)v[j] * ref_weight(m, down, e, n, j);
    return s;
  }
  const float *sw = m->buf[down ? MOE_W2_SCALES : MOE_W13_SCALES];
  const int64_t bk = c->ws == MOE_WSCALE_BLOCK ? c->bk : k, kb = k / bk;
  double acc = 0.0;
  for (int64_t b = 0; b < kb; b++) {
    double p = 0.0;
    for (int64_t j = b * bk; j < (b + 1) * bk; j++)
      p += (double)v[j] * ref_weight(m, down, e, n, j);
    if (c->ws == MOE_WSCALE_BLOCK) {
      const int64_t nb = (nn + c->bn - 1) / c->bn;
      acc += p * (double)(sx[b] * sw[(e * nb + n / c->bn) * kb + b]); /* the scales' product in fp32 */
    } else {
      acc = p * sx[0] * (c->ws == MOE_WSCALE_PER_CHANNEL ? sw[e * nn + n] : sw[e]);
    }
  }
  return acc;
}

static double ref_bias(const model *m, bool down, int64_t e, int64_t n) {
  const fm_case *c = &m->c;
  if (!c->bias_t) return 0.0;
  const int64_t nn = down ? c->hidden : 2 * c->inter;
  return load_act(m->buf[down ? MOE_W2_BIAS : MOE_W13_BIAS], c->bias_t, (size_t)(e * nn + n));
}

static float ref_activation(moe_activation fn, float g, float u, moe_dtype t) {
  switch (fn) {
  case MOE_ACT_SILU: return round_act(round_act(g / (1.0f + expf(-g)), t) * u, t);
  case MOE_ACT_GELU: return round_act(round_act((float)(0.5 * g * (1.0 + erf(g / sqrt(2.0)))), t) * u, t);
  default:
    g = fminf(g, 7.0f);
    u = fmaxf(fminf(u, 7.0f), -7.0f);
    return round_act((u + 1.0f) * g * (1.0f / (1.0f + expf(-1.702f * g))), t);
  }
}

/* out[t][h] in double before the final rounding; experts outside
 * [offset, offset + local) contribute nothing. */
static void reference(const model *m, const void *x, int64_t tokens, const int32_t *ids, const float *w,
                      int64_t offset, int64_t local, double *out) {
  const fm_case *c = &m->c;
  const int64_t h = c->hidden, in = c->inter;
  const bool interleaved = m->activation == MOE_ACT_SWIGLU_OAI;
  float *a = malloc((size_t)in * sizeof(float)), *xv = malloc((size_t)h * sizeof(float));
  float sx[64], sa[64]; /* scales per K block */
  for (int64_t t = 0; t < tokens; t++) {
    for (int64_t j = 0; j < h; j++)
      out[t * h + j] = 0.0;
    for (int k = 0; k < TOP_K; k++) {
      const int64_t e = ids[t * TOP_K + k]; /* the model holds every expert */
      if (e < offset || e >= offset + local) continue;
      for (int64_t j = 0; j < h; j++)
        xv[j] = load_act(x, c->act, (size_t)(t * h + j));
      if (c->scheme == MOE_SCHEME_FP8) ref_fp8_input(m, false, e, xv, h, sx);
      for (int64_t i = 0; i < in; i++) {
        const int64_t rg = interleaved ? 2 * i : i, ru = interleaved ? 2 * i + 1 : in + i;
        const double sg = ref_dot(m, false, e, rg, xv, sx) + ref_bias(m, false, e, rg);
        const double su = ref_dot(m, false, e, ru, xv, sx) + ref_bias(m, false, e, ru);
        a[i] =
            ref_activation(m->activation, round_act((float)sg, c->act), round_act((float)su, c->act), c->act);
      }
      if (c->scheme == MOE_SCHEME_FP8) ref_fp8_input(m, true, e, a, in, sa);
      for (int64_t j = 0; j < h; j++) {
        const double s = ref_dot(m, true, e, j, a, sa) + ref_bias(m, true, e, j);
        out[t * h + j] += round_act((float)s * w[t * TOP_K + k], c->act);
      }
    }
  }
  free(a);
  free(xv);
}

/* ---- calling the op ------------------------------------------------------------------ */

static moe_backend *cpu;

typedef struct request {
  const void *x; /* [tokens, H] of the act dtype */
  int64_t tokens;
  const int32_t *ids; /* [tokens, TOP_K] */
  const float *w;
  const float *logits; /* instead of ids/w: [tokens, E] */
} request;

/* Runs fused_moe with outputs poisoned with NaN; checks every element was
 * written (no NaN left: inputs are finite). Returns malloc'ed output. */
static void *run_fused(const model *m, const moe_expert_set *set, const request *r, const moe_param *params,
                       size_t n_params) {
  const fm_case *c = &m->c;
  moe_named_tensor in[3 + MOE_EXPERT_TENSOR_COUNT];
  size_t n = 0;
  in[n++] = (moe_named_tensor){
      "hidden_states",
      {c->act, 2, {r->tokens, c->hidden}, (void *)r->x, (size_t)(r->tokens * c->hidden) * 2}};
  if (r->logits) {
    in[n++] = (moe_named_tensor){
        "router_logits",
        {MOE_F32, 2, {r->tokens, N_EXPERTS}, (void *)r->logits, (size_t)(r->tokens * N_EXPERTS) * 4}};
  } else {
    in[n++] = (moe_named_tensor){
        "topk_ids", {MOE_INT32, 2, {r->tokens, TOP_K}, (void *)r->ids, (size_t)(r->tokens * TOP_K) * 4}};
    in[n++] = (moe_named_tensor){
        "topk_weights", {MOE_F32, 2, {r->tokens, TOP_K}, (void *)r->w, (size_t)(r->tokens * TOP_K) * 4}};
  }
  if (!set)
    for (size_t k = 0; k < m->nt; k++)
      in[n++] = m->t[k];
  moe_params p = {params, n_params};
  moe_call *call = NULL;
  moe_error err = {{0}};
  moe_status s = moe_op_prepare(moe_op_find("fused_moe"), in, n, &p, set, &call, &err);
  ck_assert_msg(s == MOE_OK, "prepare: %s", err.msg);
  ck_assert_uint_eq(moe_call_num_outputs(call), 1);
  moe_named_tensor *o = moe_call_output(call, 0);
  ck_assert_str_eq(o->name, "output");
  ck_assert_int_eq(o->tensor.dtype, c->act);
  ck_assert_int_eq(o->tensor.ndim, 2);
  ck_assert_int_eq(o->tensor.shape[0], r->tokens);
  ck_assert_int_eq(o->tensor.shape[1], c->hidden);
  size_t bytes = o->tensor.nbytes;
  void *out = malloc(bytes ? bytes : 1);
  memset(out, 0xFF, bytes); /* 0xFFFF: NaN in fp16 and bf16 */
  o->tensor.data = out;
  s = moe_call_run(call, cpu, &err);
  ck_assert_msg(s == MOE_OK, "run: %s", err.msg);
  moe_call_destroy(call);
  for (size_t i = 0; i < bytes / 2; i++) {
    float v = load_act(out, c->act, i);
    ck_assert_msg(isfinite(v), "output element %zu not written (or not finite): %g", i, v);
  }
  return out;
}

/* Random tokens: hidden states, distinct ids per token, weights. */
typedef struct batch {
  void *x;
  int32_t *ids;
  float *w;
  float *logits;
  int64_t tokens;
} batch;

static void batch_make(batch *b, const fm_case *c, int64_t tokens, int64_t experts) {
  b->tokens = tokens;
  b->x = malloc((size_t)(tokens * c->hidden) * 2);
  b->ids = malloc((size_t)(tokens * TOP_K) * sizeof(int32_t));
  b->w = malloc((size_t)(tokens * TOP_K) * sizeof(float));
  b->logits = malloc((size_t)(tokens * N_EXPERTS) * sizeof(float));
  for (int64_t j = 0; j < tokens * c->hidden; j++)
    store_act(b->x, c->act, (size_t)j, rng_uniform(-1, 1));
  for (int64_t t = 0; t < tokens; t++) {
    for (int k = 0; k < TOP_K; k++) {
      int32_t e;
      bool dup;
      do {
        e = (int32_t)(rng_u32() % (uint32_t)experts);
        dup = false;
        for (int q = 0; q < k; q++)
          dup |= b->ids[t * TOP_K + q] == e;
      } while (dup);
      b->ids[t * TOP_K + k] = e;
      b->w[t * TOP_K + k] = rng_uniform(0.05f, 0.6f);
    }
    for (int e = 0; e < N_EXPERTS; e++)
      b->logits[t * N_EXPERTS + e] = rng_uniform(-3, 3);
  }
}

static void batch_free(batch *b) {
  free(b->x);
  free(b->ids);
  free(b->w);
  free(b->logits);
}

/* Tokens idx[0..n) of `from` as a new batch. */
static void batch_pick(batch *dst, const batch *from, const fm_case *c, const int64_t *idx, int64_t n) {
  dst->tokens = n;
  dst->x = malloc((size_t)(n * c->hidden) * 2);
  dst->ids = malloc((size_t)(n * TOP_K) * sizeof(int32_t));
  dst->w = malloc((size_t)(n * TOP_K) * sizeof(float));
  dst->logits = malloc((size_t)(n * N_EXPERTS) * sizeof(float));
  for (int64_t i = 0; i < n; i++) {
    memcpy((uint16_t *)dst->x + i * c->hidden, (const uint16_t *)from->x + idx[i] * c->hidden,
           (size_t)c->hidden * 2);
    memcpy(dst->ids + i * TOP_K, from->ids + idx[i] * TOP_K, TOP_K * sizeof(int32_t));
    memcpy(dst->w + i * TOP_K, from->w + idx[i] * TOP_K, TOP_K * sizeof(float));
    memcpy(dst->logits + i * N_EXPERTS, from->logits + idx[i] * N_EXPERTS, N_EXPERTS * sizeof(float));
  }
}

static const char *const act_names[] = {"silu", "gelu", "swiglu_oai"};

/* ---- accuracy against the reference ------------------------------------------------- */

START_TEST(matches_reference) {
  const fm_case *c = &cases[_i / MOE_ACT_COUNT];
  const moe_activation fn = (moe_activation)(_i % MOE_ACT_COUNT);
  model m;
  model_make(&m, c, fn, 1000 + (uint64_t)_i);
  batch b;
  batch_make(&b, c, 16, N_EXPERTS);
  moe_param p[4] = {{.name = "activation", .type = MOE_PARAM_STRING, .s = act_names[fn]},
                    {.name = "scheme", .type = MOE_PARAM_STRING, .s = moe_scheme_names[c->scheme]},
                    {.name = "block_n", .type = MOE_PARAM_INT, .i = c->bn},
                    {.name = "block_k", .type = MOE_PARAM_INT, .i = c->bk}};
  request r = {b.x, b.tokens, b.ids, b.w, NULL};
  /* inline weights; fp8 with block scales must be named (it looks like wna16 int8) */
  void *out = run_fused(&m, NULL, &r, p, c->ws == MOE_WSCALE_BLOCK ? 4 : 1);
  double *ref = malloc((size_t)(b.tokens * c->hidden) * sizeof(double));
  reference(&m, b.x, b.tokens, b.ids, b.w, 0, N_EXPERTS, ref);
  double num = 0.0, den = 0.0;
  for (int64_t j = 0; j < b.tokens * c->hidden; j++) {
    const double want = round_act((float)ref[j], c->act), got = load_act(out, c->act, (size_t)j);
    num += (got - want) * (got - want);
    den += want * want;
  }
  const bool fp8 = c->scheme == MOE_SCHEME_FP8;
  const double rel = sqrt(num / den), tol = c->act == MOE_BF16 ? (fp8 ? 4e-3 : 1e-3) : (fp8 ? 2e-3 : 2.5e-4);
  ck_assert_msg(den > 0.0, "%s %s: reference is all zero", c->name, act_names[fn]);
  printf("%-34s %-10s rel L2 %.3g (bound %.3g)\n", c->name, act_names[fn], rel, tol);
  ck_assert_msg(rel <= tol, "%s %s: relative error %.3g > %.3g", c->name, act_names[fn], rel, tol);
  /* the same through a set built over the tensors */
  moe_expert_set *set = model_set(&m, NULL);
  void *out2 = run_fused(&m, set, &r, NULL, 0);
  ck_assert_int_eq(memcmp(out, out2, (size_t)(b.tokens * c->hidden) * 2), 0);
  moe_expert_set_destroy(set);
  free(out);
  free(out2);
  free(ref);
  batch_free(&b);
  model_free(&m);
}
END_TEST

/* ---- batch invariance ------------------------------------------------------------------ */

START_TEST(batch_invariant) {
  const fm_case *c = &cases[_i / MOE_ACT_COUNT];
  const moe_activation fn = (moe_activation)(_i % MOE_ACT_COUNT);
  model m;
  model_make(&m, c, fn, 2000 + (uint64_t)_i);
  moe_expert_set *set = model_set(&m, NULL);
  batch b;
  batch_make(&b, c, 64, N_EXPERTS); /* 64 * 3 pairs over 6 experts: ~32 tokens per expert */
  const size_t row = (size_t)c->hidden * 2;
  request full = {b.x, b.tokens, b.ids, b.w, NULL};
  uint8_t *out64 = run_fused(&m, set, &full, NULL, 0);
  const int64_t sizes[3] = {1, 2, 7};
  for (int64_t probe = 0; probe < 64; probe += 9) {
    for (int si = 0; si < 3; si++) {
      /* the probe token at a random position among random others */
      int64_t idx[7] = {0};
      const int64_t n = sizes[si], pos = (int64_t)(rng_u32() % (uint32_t)n);
      for (int64_t i = 0; i < n; i++)
        idx[i] = i == pos ? probe : (int64_t)(rng_u32() % 64);
      batch sub;
      batch_pick(&sub, &b, c, idx, n);
      request r = {sub.x, sub.tokens, sub.ids, sub.w, NULL};
      uint8_t *out = run_fused(&m, set, &r, NULL, 0);
      for (int64_t i = 0; i < n; i++)
        ck_assert_msg(memcmp(out + (size_t)i * row, out64 + (size_t)idx[i] * row, row) == 0,
                      "%s %s: token %lld differs in a batch of %lld from the batch of 64", c->name,
                      act_names[fn], (long long)idx[i], (long long)n);
      free(out);
      batch_free(&sub);
    }
  }
  free(out64);
  batch_free(&b);
  moe_expert_set_destroy(set);
  model_free(&m);
}
END_TEST

/* ---- vector kernels against the reference path ------------------------------------------ */

START_TEST(vector_kernels_equal_reference) {
  const fm_case *c = &cases[_i];
  const moe_activation fn = (moe_activation)(_i % MOE_ACT_COUNT);
  model m;
  model_make(&m, c, fn, 3000 + (uint64_t)_i);
  moe_expert_set *set = model_set(&m, NULL);
  if (_i == 0 && !moe_cpu_vector_kernels()) printf("no AVX-512 here: both runs take the reference path\n");
  /* 1 token: the direct dot, one token row; 5: up to four rows; 40: ~20 per
   * expert, several calls of the direct dot; 200: ~100 per expert, through
   * strips of the vector dequantization */
  const int64_t sizes[4] = {1, 5, 40, 200};
  for (int si = 0; si < 4; si++) {
    batch b;
    batch_make(&b, c, sizes[si], N_EXPERTS);
    request r = {b.x, b.tokens, b.ids, b.w, NULL};
    uint8_t *vec = run_fused(&m, set, &r, NULL, 0);
    moe_cpu_set_reference_kernels(true);
    uint8_t *ref = run_fused(&m, set, &r, NULL, 0);
    moe_cpu_set_reference_kernels(false);
    const size_t bytes = (size_t)(b.tokens * c->hidden) * 2;
    for (size_t j = 0; j < bytes; j += 2)
      ck_assert_msg(memcmp(vec + j, ref + j, 2) == 0, "%s %s, %lld tokens: element %zu: %04x, reference %04x",
                    c->name, act_names[fn], (long long)b.tokens, j / 2, *(uint16_t *)(vec + j),
                    *(uint16_t *)(ref + j));
    free(vec);
    free(ref);
    batch_free(&b);
  }
  moe_expert_set_destroy(set);
  model_free(&m);
}
END_TEST

/* ---- routing, shards ------------------------------------------------------------------ */

START_TEST(router_logits_equal_topk_then_ids) {
  const fm_case *c = &cases[4]; /* int4 g128 */
  model m;
  model_make(&m, c, MOE_ACT_SILU, 77);
  m.cfg.routing = (moe_routing){.top_k = TOP_K,
                                .scoring = MOE_SCORING_SIGMOID,
                                .renormalize = true,
                                .num_expert_group = 3,
                                .topk_group = 2,
                                .routed_scaling_factor = 1.5};
  moe_expert_set *set = model_set(&m, NULL);
  batch b;
  batch_make(&b, c, 9, N_EXPERTS);
  request by_logits = {b.x, b.tokens, NULL, NULL, b.logits};
  void *out1 = run_fused(&m, set, &by_logits, NULL, 0);

  moe_named_tensor tin = {"router_logits",
                          {MOE_F32, 2, {b.tokens, N_EXPERTS}, b.logits, (size_t)(b.tokens * N_EXPERTS) * 4}};
  moe_param tp[6] = {{.name = "top_k", .type = MOE_PARAM_INT, .i = TOP_K},
                     {.name = "scoring", .type = MOE_PARAM_STRING, .s = "sigmoid"},
                     {.name = "renormalize", .type = MOE_PARAM_BOOL, .b = true},
                     {.name = "num_expert_group", .type = MOE_PARAM_INT, .i = 3},
                     {.name = "topk_group", .type = MOE_PARAM_INT, .i = 2},
                     {.name = "routed_scaling_factor", .type = MOE_PARAM_DOUBLE, .d = 1.5}};
  moe_params tparams = {tp, 6};
  moe_named_tensor *routed;
  size_t nr;
  moe_error err;
  ck_assert_int_eq(moe_run_host("moe.topk", &tin, 1, &tparams, NULL, &routed, &nr, &err), MOE_OK);
  request by_ids = {b.x, b.tokens, routed[0].tensor.data, routed[1].tensor.data, NULL};
  void *out2 = run_fused(&m, set, &by_ids, NULL, 0);
  ck_assert_int_eq(memcmp(out1, out2, (size_t)(b.tokens * c->hidden) * 2), 0);

  /* request parameters override the set's routing */
  moe_param over = {.name = "top_k", .type = MOE_PARAM_INT, .i = 1};
  void *out3 = run_fused(&m, set, &by_logits, &over, 1);
  ck_assert_int_ne(memcmp(out1, out3, (size_t)(b.tokens * c->hidden) * 2), 0);
  free(out3);

  moe_outputs_free(routed, nr);
  free(out1);
  free(out2);
  batch_free(&b);
  moe_expert_set_destroy(set);
  model_free(&m);
}
END_TEST

START_TEST(shards_contribute_their_experts_only) {
  const fm_case *c = &cases[0]; /* bf16 */
  model m;
  model_make(&m, c, MOE_ACT_SILU, 99);
  batch b;
  batch_make(&b, c, 12, N_EXPERTS);
  /* shard 1 holds global experts [3, 6): its tensors are the tail of the
   * full ones; token 0 is routed only to experts 0..2 (not here) */
  b.ids[0] = 0, b.ids[1] = 1, b.ids[2] = 2;
  moe_expert_config cfg = m.cfg;
  cfg.num_experts = 3;
  cfg.expert_offset = 3;
  moe_named_tensor shard[2];
  for (int s = 0; s < 2; s++) {
    shard[s] = m.t[s];
    const size_t per = shard[s].tensor.nbytes / N_EXPERTS;
    shard[s].tensor.shape[0] = 3;
    shard[s].tensor.data = (uint8_t *)shard[s].tensor.data + 3 * per;
    shard[s].tensor.nbytes = 3 * per;
  }
  moe_expert_set *set = NULL;
  moe_error err;
  ck_assert_msg(moe_expert_set_from_tensors("shard", &cfg, shard, 2, &set, &err) == MOE_OK, "%s", err.msg);
  request r = {b.x, b.tokens, b.ids, b.w, NULL};
  uint16_t *out = run_fused(&m, set, &r, NULL, 0);
  for (int64_t j = 0; j < c->hidden; j++)
    ck_assert_uint_eq(out[j], 0); /* token 0: nothing here */
  double *ref = malloc((size_t)(b.tokens * c->hidden) * sizeof(double));
  reference(&m, b.x, b.tokens, b.ids, b.w, 3, 3, ref);
  double num = 0.0, den = 0.0;
  for (int64_t j = 0; j < b.tokens * c->hidden; j++) {
    const double want = round_act((float)ref[j], c->act), got = load_act(out, c->act, (size_t)j);
    num += (got - want) * (got - want);
    den += want * want;
  }
  ck_assert_msg(sqrt(num / den) <= 1e-3, "shard: relative error %.3g", sqrt(num / den));
  free(ref);
  free(out);
  moe_expert_set_destroy(set);
  batch_free(&b);
  model_free(&m);
}
END_TEST

/* ---- bad input ---------------------------------------------------------------------------- */

/* inputs: hidden_states, topk_ids, topk_weights, then the weights */
typedef struct bad_req {
  moe_named_tensor in[16];
  size_t n;
  moe_param p[6];
  size_t np;
  const moe_expert_set *set;
} bad_req;

static void expect_einval(const bad_req *r, const char *needle) {
  moe_params params = {r->p, r->np};
  moe_named_tensor *out = NULL;
  size_t n_out = 0;
  moe_error err = {{0}};
  moe_status s = moe_run_host("fused_moe", r->in, r->n, &params, r->set, &out, &n_out, &err);
  if (s == MOE_OK) moe_outputs_free(out, n_out);
  ck_assert_msg(s == MOE_EINVAL, "expected EINVAL naming '%s', got %d (%s)", needle, s, err.msg);
  ck_assert_msg_has(err, needle);
}

static int find_input(const bad_req *r, const char *name) {
  for (size_t i = 0; i < r->n; i++)
    if (strcmp(r->in[i].name, name) == 0) return (int)i;
  ck_abort_msg("no input %s", name);
  return -1;
}

static void drop_input(bad_req *r, const char *name) {
  int i = find_input(r, name);
  r->in[i] = r->in[--r->n];
}

static void good_request(bad_req *r, const model *m, const batch *b) {
  memset(r, 0, sizeof *r);
  const fm_case *c = &m->c;
  r->in[r->n++] = (moe_named_tensor){
      "hidden_states", {c->act, 2, {b->tokens, c->hidden}, b->x, (size_t)(b->tokens * c->hidden) * 2}};
  r->in[r->n++] = (moe_named_tensor){
      "topk_ids", {MOE_INT32, 2, {b->tokens, TOP_K}, b->ids, (size_t)(b->tokens * TOP_K) * 4}};
  r->in[r->n++] = (moe_named_tensor){"topk_weights",
                                     {MOE_F32, 2, {b->tokens, TOP_K}, b->w, (size_t)(b->tokens * TOP_K) * 4}};
  for (size_t k = 0; k < m->nt; k++)
    r->in[r->n++] = m->t[k];
}

START_TEST(bad_inputs_dense) {
  model m;
  model_make(&m, &cases[0], MOE_ACT_SILU, 5); /* bf16 */
  batch b;
  batch_make(&b, &m.c, 4, N_EXPERTS);
  float xf[4 * 256] = {0};
  float logits[4 * N_EXPERTS] = {0};
  bad_req r, base;
  good_request(&base, &m, &b);
  { /* sanity: the base request runs */
    moe_params params = {NULL, 0};
    moe_named_tensor *out;
    size_t n;
    moe_error err;
    ck_assert_msg(moe_run_host("fused_moe", base.in, base.n, &params, NULL, &out, &n, &err) == MOE_OK, "%s",
                  err.msg);
    moe_outputs_free(out, n);
  }
  r = base; /* hidden_states: dtype (fp16 for a bf16 scheme; fp32), rank, H, bytes */
  r.in[find_input(&r, "hidden_states")].tensor.dtype = MOE_F16;
  expect_einval(&r, "hidden_states");
  r = base;
  r.in[0].tensor = (moe_tensor){MOE_F32, 2, {4, 256}, xf, sizeof xf};
  expect_einval(&r, "hidden_states");
  r = base;
  r.in[0].tensor.ndim = 3;
  r.in[0].tensor.shape[0] = 2, r.in[0].tensor.shape[1] = 2, r.in[0].tensor.shape[2] = 256;
  expect_einval(&r, "hidden_states");
  r = base;
  r.in[0].tensor.shape[0] = 8, r.in[0].tensor.shape[1] = 128;
  expect_einval(&r, "hidden_states");
  r = base;
  r.in[0].tensor.nbytes -= 2;
  expect_einval(&r, "hidden_states");

  /* ids: out of range (high, negative), dtype, shape, k mismatch with weights, missing */
  r = base;
  b.ids[5] = N_EXPERTS;
  expect_einval(&r, "topk_ids");
  b.ids[5] = -1;
  expect_einval(&r, "topk_ids");
  b.ids[5] = 0;
  r.in[1].tensor.dtype = MOE_F32;
  expect_einval(&r, "topk_ids");
  r = base;
  r.in[1].tensor.shape[0] = 3, r.in[1].tensor.shape[1] = 4; /* same bytes, wrong token count */
  expect_einval(&r, "topk_ids");
  r = base;
  r.in[2].tensor.shape[0] = 6, r.in[2].tensor.shape[1] = 2;
  expect_einval(&r, "topk_weights");
  r = base;
  r.in[2].tensor.dtype = MOE_BF16;
  r.in[2].tensor.nbytes /= 2;
  expect_einval(&r, "topk_weights");
  r = base;
  drop_input(&r, "topk_weights");
  expect_einval(&r, "topk_weights");
  r = base;
  drop_input(&r, "topk_ids");
  expect_einval(&r, "topk_ids");
  r = base; /* no routing at all; both kinds */
  drop_input(&r, "topk_ids");
  drop_input(&r, "topk_weights");
  expect_einval(&r, "router_logits");
  r = base;
  r.in[r.n++] = (moe_named_tensor){"router_logits", {MOE_F32, 2, {4, N_EXPERTS}, logits, sizeof logits}};
  expect_einval(&r, "router_logits");
  /* router_logits: E mismatch; inline weights need top_k */
  drop_input(&r, "topk_ids");
  drop_input(&r, "topk_weights");
  expect_einval(&r, "top_k");
  r.p[r.np++] = (moe_param){.name = "top_k", .type = MOE_PARAM_INT, .i = 2};
  r.in[find_input(&r, "router_logits")].tensor.shape[1] = 3,
                      r.in[find_input(&r, "router_logits")].tensor.shape[0] = 8;
  expect_einval(&r, "router_logits");
  r.in[find_input(&r, "router_logits")].tensor.shape[1] = N_EXPERTS,
                      r.in[find_input(&r, "router_logits")].tensor.shape[0] = 4;
  r.p[0].i = N_EXPERTS + 1;
  expect_einval(&r, "top_k");

  /* weights: missing, dtype, bytes, shape mismatch between w13 and w2 */
  r = base;
  drop_input(&r, "w2");
  expect_einval(&r, "w2");
  r = base;
  drop_input(&r, "w13");
  expect_einval(&r, "w13");
  r = base;
  r.in[find_input(&r, "w13")].tensor.dtype = MOE_F32;
  r.in[find_input(&r, "w13")].tensor.shape[2] = 128;
  expect_einval(&r, "w13");
  r = base;
  r.in[find_input(&r, "w2")].tensor.nbytes -= 2;
  expect_einval(&r, "w2");
  r = base;
  r.in[find_input(&r, "w2")].tensor.shape[2] = 64, r.in[find_input(&r, "w2")].tensor.shape[1] = 512;
  expect_einval(&r, "w2");
  r = base; /* parameters */
  r.p[r.np++] = (moe_param){.name = "activation", .type = MOE_PARAM_STRING, .s = "relu"};
  expect_einval(&r, "activation");
  r = base;
  r.p[r.np++] = (moe_param){.name = "scheme", .type = MOE_PARAM_STRING, .s = "wna16"};
  expect_einval(&r, "w13_qweight");

  /* a loaded set: inline weights and contradicting parameters are refused */
  moe_expert_set *set = model_set(&m, NULL);
  r = base;
  r.set = set;
  expect_einval(&r, "w13");
  r.n = 3;
  r.p[r.np++] = (moe_param){.name = "activation", .type = MOE_PARAM_STRING, .s = "gelu"};
  expect_einval(&r, "activation");
  moe_expert_set_destroy(set);
  batch_free(&b);
  model_free(&m);
}
END_TEST

START_TEST(bad_inputs_wna16) {
  model m;
  model_make(&m, &cases[5], MOE_ACT_SILU, 6); /* int4 g64 zero points, fp16 */
  batch b;
  batch_make(&b, &m.c, 4, N_EXPERTS);
  float xf[4 * 256] = {0};
  bad_req r, base;
  good_request(&base, &m, &b);
  r = base; /* fp32 activations: wna16 takes 16-bit ones only */
  r.in[0].tensor = (moe_tensor){MOE_F32, 2, {4, 256}, xf, sizeof xf};
  expect_einval(&r, "hidden_states");
  expect_einval(&r, "16-bit");
  r = base; /* a group size that divides neither K */
  r.p[r.np++] = (moe_param){.name = "group_size", .type = MOE_PARAM_INT, .i = 48};
  expect_einval(&r, "group_size");
  r.p[0].i = 0;
  expect_einval(&r, "group_size");
  r = base; /* a group size the scales do not have */
  r.p[r.np++] = (moe_param){.name = "group_size", .type = MOE_PARAM_INT, .i = 32};
  expect_einval(&r, "w13_scales");
  r = base;
  r.p[r.np++] = (moe_param){.name = "bits", .type = MOE_PARAM_INT, .i = 3};
  expect_einval(&r, "bits");
  r = base; /* bits 8 with int4-sized codes */
  r.p[r.np++] = (moe_param){.name = "bits", .type = MOE_PARAM_INT, .i = 8};
  expect_einval(&r, "w13_qweight");
  r = base;
  drop_input(&r, "w13_scales");
  expect_einval(&r, "w13_scales");
  r = base;
  drop_input(&r, "w2_qweight");
  expect_einval(&r, "w2_qweight");
  r = base; /* zero points for one GEMM only */
  drop_input(&r, "w2_qzeros");
  expect_einval(&r, "w2_qzeros");
  r = base;
  r.in[find_input(&r, "w13_qzeros")].tensor.shape[1] = 64,
                      r.in[find_input(&r, "w13_qzeros")].tensor.shape[2] = 8;
  expect_einval(&r, "w13_qzeros");
  r = base;
  r.in[find_input(&r, "w2_scales")].tensor.dtype = MOE_INT32;
  r.in[find_input(&r, "w2_scales")].tensor.shape[2] = 1;
  expect_einval(&r, "w2_scales");
  r = base; /* dense weights beside quantized ones */
  r.in[r.n++] =
      (moe_named_tensor){"w2", {MOE_F16, 3, {N_EXPERTS, 256, 128}, b.x, (size_t)N_EXPERTS * 256 * 128 * 2}};
  expect_einval(&r, "w2");
  r = base;
  r.in[r.n++] = (moe_named_tensor){"experts", {MOE_F16, 1, {1}, b.x, 2}};
  expect_einval(&r, "experts");
  batch_free(&b);
  model_free(&m);
}
END_TEST

static const fm_case *case_named(const char *name) {
  for (int i = 0; i < N_CASES; i++)
    if (strcmp(cases[i].name, name) == 0) return &cases[i];
  ck_abort_msg("no case %s", name);
  return NULL;
}

START_TEST(bad_inputs_mxfp4_and_bias) {
  model m;
  model_make(&m, case_named("mxfp4 bf16 bias f32"), MOE_ACT_SWIGLU_OAI, 7); /* H 256, I 128 */
  batch b;
  batch_make(&b, &m.c, 4, N_EXPERTS);
  float xf[4 * 256] = {0};
  uint16_t b16[N_EXPERTS * 256] = {0};
  bad_req r, base;
  good_request(&base, &m, &b);
  { /* sanity: the base request runs */
    moe_params params = {NULL, 0};
    moe_named_tensor *out;
    size_t n;
    moe_error err;
    ck_assert_msg(moe_run_host("fused_moe", base.in, base.n, &params, NULL, &out, &n, &err) == MOE_OK, "%s",
                  err.msg);
    moe_outputs_free(out, n);
  }
  r = base; /* 16-bit activations only */
  r.in[0].tensor = (moe_tensor){MOE_F32, 2, {4, 256}, xf, sizeof xf};
  expect_einval(&r, "hidden_states");
  expect_einval(&r, "16-bit");
  /* e8m0 0xFF (a NaN scale) in the weights: the tensor and the index */
  uint8_t *s2 = m.buf[MOE_W2_SCALES];
  const size_t at = (size_t)((1 * 256 + 2) * 4 + 3); /* w2_scales [6, 256, 4] */
  const uint8_t keep = s2[at];
  s2[at] = 0xFF;
  r = base;
  expect_einval(&r, "w2_scales: e8m0 scale byte 0xFF (NaN) at [1, 2, 3]");
  s2[at] = keep;
  r = base; /* scales of another dtype */
  r.in[find_input(&r, "w13_scales")].tensor.dtype = MOE_BF16;
  r.in[find_input(&r, "w13_scales")].tensor.shape[2] = 4;
  r.p[r.np++] = (moe_param){.name = "scheme", .type = MOE_PARAM_STRING, .s = "mxfp4"};
  expect_einval(&r, "w13_scales");
  /* biases: shape, one without the other, dtype other than f32 or the activations' */
  r = base;
  r.in[find_input(&r, "w13_bias")].tensor.shape[1] = 128;
  r.in[find_input(&r, "w13_bias")].tensor.nbytes /= 2;
  expect_einval(&r, "w13_bias: shape [6, 128], expected [6, 256]");
  r = base;
  drop_input(&r, "w2_bias");
  expect_einval(&r, "w2_bias: missing");
  r = base;
  r.in[find_input(&r, "w2_bias")].tensor = (moe_tensor){MOE_F16, 2, {N_EXPERTS, 256}, b16, sizeof b16};
  expect_einval(&r, "w2_bias: dtype fp16");
  r = base;
  r.in[find_input(&r, "w2_bias")].tensor = (moe_tensor){MOE_F16, 1, {N_EXPERTS * 256}, b16, sizeof b16};
  expect_einval(&r, "w2_bias");
  /* a loaded set without biases refuses them inline; one with them, a contradicting scheme */
  moe_expert_set *set = model_set(&m, NULL);
  r = base;
  r.set = set;
  r.n = 3;
  r.p[r.np++] = (moe_param){.name = "scheme", .type = MOE_PARAM_STRING, .s = "wna16"};
  expect_einval(&r, "scheme: differs");
  moe_expert_set_destroy(set);
  batch_free(&b);
  model_free(&m);
}
END_TEST

START_TEST(bad_inputs_fp8) {
  model m;
  model_make(&m, case_named("fp8 block 48x64 fp16 bias"), MOE_ACT_SILU, 8); /* H 256, I 128 */
  batch b;
  batch_make(&b, &m.c, 4, N_EXPERTS);
  float xf[4 * 256] = {0};
  bad_req r, base;
  good_request(&base, &m, &b);
  base.p[base.np++] = (moe_param){.name = "scheme", .type = MOE_PARAM_STRING, .s = "fp8"};
  base.p[base.np++] = (moe_param){.name = "block_n", .type = MOE_PARAM_INT, .i = 48};
  base.p[base.np++] = (moe_param){.name = "block_k", .type = MOE_PARAM_INT, .i = 64};
  { /* sanity: the base request runs */
    moe_params params = {base.p, base.np};
    moe_named_tensor *out;
    size_t n;
    moe_error err;
    ck_assert_msg(moe_run_host("fused_moe", base.in, base.n, &params, NULL, &out, &n, &err) == MOE_OK, "%s",
                  err.msg);
    moe_outputs_free(out, n);
  }
  r = base; /* a block size that does not divide K (H = 256, I = 128) */
  r.p[2].i = 48;
  expect_einval(&r, "block_k: must divide");
  r.p[2].i = 0;
  expect_einval(&r, "block_k");
  r = base; /* block_n the scales do not have */
  r.p[1].i = 64;
  expect_einval(&r, "w13_scales: shape [6, 6, 4], expected [6, 4, 4]");
  r = base;
  r.p[1].i = 0;
  expect_einval(&r, "block_n");
  r = base; /* 16-bit activations only */
  r.in[0].tensor = (moe_tensor){MOE_F32, 2, {4, 256}, xf, sizeof xf};
  expect_einval(&r, "hidden_states");
  r = base;
  r.p[0].s = "fp9";
  expect_einval(&r, "scheme");
  r = base;
  r.p[r.np++] = (moe_param){.name = "weight_scale", .type = MOE_PARAM_STRING, .s = "per_row"};
  expect_einval(&r, "weight_scale");
  r = base; /* per_channel scales must be [E, N] */
  r.p[r.np++] = (moe_param){.name = "weight_scale", .type = MOE_PARAM_STRING, .s = "per_channel"};
  expect_einval(&r, "w13_scales");
  r = base; /* codes as another dtype */
  r.in[find_input(&r, "w2_qweight")].tensor.dtype = MOE_INT8;
  expect_einval(&r, "w2_qweight");
  batch_free(&b);
  model_free(&m);

  /* static activation scales: finite and > 0, both given, per_tensor only */
  model_make(&m, case_named("fp8 per_tensor static bf16 bias"), MOE_ACT_SILU, 9);
  batch_make(&b, &m.c, 4, N_EXPERTS);
  good_request(&base, &m, &b);
  float *a13 = m.buf[MOE_A13_SCALE];
  const float keep = a13[4];
  a13[4] = 0.0f;
  r = base;
  expect_einval(&r, "a13_scale: entry 4");
  a13[4] = NAN;
  expect_einval(&r, "a13_scale: entry 4");
  a13[4] = INFINITY;
  expect_einval(&r, "a13_scale: entry 4");
  a13[4] = keep;
  r = base;
  drop_input(&r, "a2_scale");
  expect_einval(&r, "a2_scale: missing");
  r = base;
  r.p[r.np++] = (moe_param){.name = "weight_scale", .type = MOE_PARAM_STRING, .s = "per_channel"};
  expect_einval(&r, "has_activation_scales");
  /* a loaded fp8 set: a contradicting exact_division or block size is refused */
  moe_expert_set *set = model_set(&m, NULL);
  r = base;
  r.set = set;
  r.n = 3;
  r.p[r.np++] = (moe_param){.name = "exact_division", .type = MOE_PARAM_BOOL, .b = true};
  expect_einval(&r, "exact_division: differs");
  moe_expert_set_destroy(set);
  batch_free(&b);
  model_free(&m);
}
END_TEST

static void setup(void) {
  moe_error err;
  ck_assert_int_eq(moe_backend_open(MOE_BACKEND_HOST, 0, &cpu, &err), MOE_OK);
}
static void teardown(void) { moe_backend_destroy(cpu); }

static Suite *fused_suite(void) {
  Suite *s = suite_create("fused_moe");
  TCase *tc = tcase_create("cpu");
  tcase_set_timeout(tc, 600);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_loop_test(tc, matches_reference, 0, N_CASES * MOE_ACT_COUNT);
  tcase_add_loop_test(tc, batch_invariant, 0, N_CASES * MOE_ACT_COUNT);
  tcase_add_loop_test(tc, vector_kernels_equal_reference, 0, N_CASES);
  tcase_add_test(tc, router_logits_equal_topk_then_ids);
  tcase_add_test(tc, shards_contribute_their_experts_only);
  tcase_add_test(tc, bad_inputs_dense);
  tcase_add_test(tc, bad_inputs_wna16);
  tcase_add_test(tc, bad_inputs_mxfp4_and_bias);
  tcase_add_test(tc, bad_inputs_fp8);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(fused_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
