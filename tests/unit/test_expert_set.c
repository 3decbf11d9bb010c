/* Expert sets: config.json parsing (every error names its key), synthetic
 * sets of every scheme written and loaded back, and validation failures
 * (wrong shape, wrong dtype, missing and extra tensors) naming the tensor. */
#include <check.h>
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "moe/codec.h"
#include "moe/expert_set.h"
#include "moe/safetensors.h"
#include "test_tmpdir.h"

/* ---- helpers ------------------------------------------------------------------- */

static void make_tmpdir(void) { make_tmpdir_named("es"); }

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  ck_assert_int_eq(fclose(f), 0);
}

static unsigned char *read_all(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  ck_assert_ptr_nonnull(f);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *buf = malloc((size_t)n + 1);
  ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  *len = (size_t)n;
  return buf;
}

#define ck_assert_msg_has(err, needle)                                                                       \
  ck_assert_msg(strstr((err).msg, (needle)) != NULL, "message '%s' lacks '%s'", (err).msg, (needle))

/* The message starts with "<tensor>:" (names that prefix others, such as w13
 * and w13_qweight, are then told apart). */
#define ck_assert_names_tensor(err, name)                                                                    \
  do {                                                                                                       \
    size_t n_ = strlen(name);                                                                                \
    ck_assert_msg(strncmp((err).msg, (name), n_) == 0 && (err).msg[n_] == ':',                               \
                  "message '%s' does not name %s", (err).msg, (name));                                       \
  } while (0)

/* Field by field: the struct has padding, so memcmp would compare garbage. */
static void ck_cfg_eq(const moe_expert_config *a, const moe_expert_config *b) {
  ck_assert_int_eq(a->scheme, b->scheme);
  ck_assert_int_eq(a->num_experts, b->num_experts);
  ck_assert_int_eq(a->global_num_experts, b->global_num_experts);
  ck_assert_int_eq(a->expert_offset, b->expert_offset);
  ck_assert_int_eq(a->hidden_size, b->hidden_size);
  ck_assert_int_eq(a->intermediate_size, b->intermediate_size);
  ck_assert_int_eq(a->activation, b->activation);
  ck_assert_int_eq(a->bits, b->bits);
  ck_assert_int_eq(a->group_size, b->group_size);
  ck_assert_int_eq(a->has_zero_points, b->has_zero_points);
  ck_assert_int_eq(a->weight_scale, b->weight_scale);
  ck_assert_int_eq(a->block_n, b->block_n);
  ck_assert_int_eq(a->block_k, b->block_k);
  ck_assert_int_eq(a->has_act_scales, b->has_act_scales);
  ck_assert_int_eq(a->exact_division, b->exact_division);
  ck_assert_int_eq(a->has_bias, b->has_bias);
  ck_assert_int_eq(a->routing.top_k, b->routing.top_k);
  ck_assert_int_eq(a->routing.scoring, b->routing.scoring);
  ck_assert_int_eq(a->routing.renormalize, b->routing.renormalize);
  ck_assert_int_eq(a->routing.num_expert_group, b->routing.num_expert_group);
  ck_assert_int_eq(a->routing.topk_group, b->routing.topk_group);
  ck_assert(a->routing.routed_scaling_factor == b->routing.routed_scaling_factor);
}

static moe_expert_config small_config(moe_scheme scheme, int bits, int64_t group, bool zp) {
  moe_expert_config c;
  moe_expert_config_defaults(&c);
  c.scheme = scheme;
  c.num_experts = 4;
  c.global_num_experts = 4;
  c.hidden_size = 128;
  c.intermediate_size = 64;
  c.bits = bits;
  c.group_size = group;
  c.has_zero_points = zp;
  c.routing.top_k = 2;
  return c;
}

/* ---- config.json ---------------------------------------------------------------------- */

START_TEST(config_defaults_and_parse) {
  moe_expert_config c;
  moe_error err = {{0}};
  moe_expert_config_defaults(&c);
  ck_assert_int_eq(c.scheme, MOE_SCHEME_BF16);
  ck_assert_int_eq(c.activation, MOE_ACT_SILU);
  ck_assert_int_eq(c.group_size, -1);
  ck_assert(!c.has_zero_points);
  ck_assert_int_eq(c.routing.top_k, 1);
  ck_assert(!c.routing.renormalize);
  ck_assert(c.routing.routed_scaling_factor == 1.0);

  ck_assert_int_eq(moe_expert_config_parse(
                       "{\"num_experts\": 8, \"hidden_size\": 64, \"intermediate_size\": 32}", &c, &err),
                   MOE_OK);
  ck_assert_int_eq(c.num_experts, 8);
  ck_assert_int_eq(c.global_num_experts, 8); /* defaults to num_experts */
  ck_assert_int_eq(c.expert_offset, 0);
  ck_assert_int_eq(c.scheme, MOE_SCHEME_BF16);
  ck_assert_int_eq(c.routing.scoring, MOE_SCORING_SOFTMAX);

  const char *full =
      "{\"scheme\":\"wna16\",\"num_experts\":16,\"global_num_experts\":64,\"expert_offset\":32,"
      "\"hidden_size\":256,\"intermediate_size\":128,\"activation\":\"swiglu_oai\",\"bits\":8,"
      "\"group_size\":128,\"has_zero_points\":true,\"top_k\":6,\"scoring\":\"sigmoid\","
      "\"renormalize\":true,\"num_expert_group\":8,\"topk_group\":3,"
      "\"routed_scaling_factor\":2.5}";
  ck_assert_int_eq(moe_expert_config_parse(full, &c, &err), MOE_OK);
  ck_assert_int_eq(c.scheme, MOE_SCHEME_WNA16);
  ck_assert_int_eq(c.num_experts, 16);
  ck_assert_int_eq(c.global_num_experts, 64);
  ck_assert_int_eq(c.expert_offset, 32);
  ck_assert_int_eq(c.hidden_size, 256);
  ck_assert_int_eq(c.intermediate_size, 128);
  ck_assert_int_eq(c.activation, MOE_ACT_SWIGLU_OAI);
  ck_assert_int_eq(c.bits, 8);
  ck_assert_int_eq(c.group_size, 128);
  ck_assert(c.has_zero_points);
  ck_assert_int_eq(c.routing.top_k, 6);
  ck_assert_int_eq(c.routing.scoring, MOE_SCORING_SIGMOID);
  ck_assert(c.routing.renormalize);
  ck_assert_int_eq(c.routing.num_expert_group, 8);
  ck_assert_int_eq(c.routing.topk_group, 3);
  ck_assert(c.routing.routed_scaling_factor == 2.5);

  /* to_json reads back to the same config */
  char *json = moe_expert_config_to_json(&c);
  ck_assert_ptr_nonnull(json);
  moe_expert_config back;
  ck_assert_int_eq(moe_expert_config_parse(json, &back, &err), MOE_OK);
  ck_cfg_eq(&back, &c);
  free(json);

  moe_expert_config b16 = small_config(MOE_SCHEME_FP16, 0, -1, false);
  b16.routing.routed_scaling_factor = 0.1; /* not exact in decimal: needs %.17g */
  json = moe_expert_config_to_json(&b16);
  ck_assert_ptr_null(strstr(json, "bits")); /* quantization keys only for wna16 */
  ck_assert_int_eq(moe_expert_config_parse(json, &back, &err), MOE_OK);
  ck_cfg_eq(&back, &b16);
  free(json);

  b16.scheme = (moe_scheme)7;
  ck_assert_ptr_null(moe_expert_config_to_json(&b16));
}
END_TEST

typedef struct cfg_case {
  const char *json; /* the members after the base ones */
  const char *key;  /* the message must name it */
} cfg_case;

#define BASE "\"num_experts\":8,\"hidden_size\":256,\"intermediate_size\":128"
#define WNA "\"scheme\":\"wna16\",\"bits\":4,"

static const cfg_case cfg_cases[] = {
    {"{" BASE ",\"hiden_size\":256}", "config"}, /* unknown keys are not echoed */
    {"{" BASE ",\"num_expert\":8}", "config"},
    {"{" BASE ",\"scheme\":\"int4\"}", "scheme"},
    {"{" BASE ",\"scheme\":4}", "scheme"},
    {"{\"num_experts\":0,\"hidden_size\":256,\"intermediate_size\":128}", "num_experts"},
    {"{\"num_experts\":1.5,\"hidden_size\":256,\"intermediate_size\":128}", "num_experts"},
    {"{\"num_experts\":\"8\",\"hidden_size\":256,\"intermediate_size\":128}", "num_experts"},
    {"{\"num_experts\":1e300,\"hidden_size\":256,\"intermediate_size\":128}", "num_experts"},
    {"{\"num_experts\":8,\"intermediate_size\":128}", "hidden_size"},
    {"{\"num_experts\":8,\"hidden_size\":256}", "intermediate_size"},
    {"{\"hidden_size\":256,\"intermediate_size\":128}", "num_experts"},
    {"{\"num_experts\":8,\"hidden_size\":256,\"intermediate_size\":-128}", "intermediate_size"},
    {"{\"num_experts\":8,\"hidden_size\":4294967296,\"intermediate_size\":128}", "hidden_size"},
    {"{" BASE ",\"expert_offset\":-1}", "expert_offset"},
    {"{" BASE ",\"expert_offset\":4,\"global_num_experts\":10}", "global_num_experts"},
    {"{" BASE ",\"global_num_experts\":0}", "global_num_experts"},
    {"{" BASE ",\"scheme\":\"wna16\"}", "bits"},
    {"{" BASE ",\"scheme\":\"wna16\",\"bits\":3}", "bits"},
    {"{" BASE ",\"scheme\":\"wna16\",\"bits\":\"4\"}", "bits"},
    {"{" BASE "," WNA "\"group_size\":48}", "group_size"},
    {"{" BASE "," WNA "\"group_size\":0}", "group_size"},
    {"{" BASE "," WNA "\"group_size\":-2}", "group_size"},
    {"{" BASE "," WNA "\"group_size\":256}", "group_size"}, /* divides H, not I */
    {"{\"num_experts\":8,\"hidden_size\":255,\"intermediate_size\":128," WNA "\"group_size\":-1}",
     "hidden_size"},
    {"{\"num_experts\":8,\"hidden_size\":256,\"intermediate_size\":127," WNA "\"group_size\":-1}",
     "intermediate_size"},
    {"{" BASE "," WNA "\"has_zero_points\":\"yes\"}", "has_zero_points"},
    {"{" BASE ",\"bits\":4}", "bits"},
    {"{" BASE ",\"group_size\":64}", "group_size"},
    {"{" BASE ",\"has_zero_points\":true}", "has_zero_points"},
    {"{" BASE ",\"activation\":\"relu\"}", "activation"},
    {"{" BASE ",\"top_k\":0}", "top_k"},
    {"{" BASE ",\"top_k\":9}", "top_k"},
    {"{" BASE ",\"expert_offset\":0,\"global_num_experts\":16,\"top_k\":17}", "top_k"},
    {"{" BASE ",\"scoring\":\"tanh\"}", "scoring"},
    {"{" BASE ",\"renormalize\":1}", "renormalize"},
    {"{" BASE ",\"num_expert_group\":3}", "num_expert_group"},
    {"{" BASE ",\"num_expert_group\":-1}", "num_expert_group"},
    {"{" BASE ",\"num_expert_group\":4,\"topk_group\":5}", "topk_group"},
    {"{" BASE ",\"num_expert_group\":4,\"topk_group\":0}", "topk_group"},
    {"{" BASE ",\"num_expert_group\":4,\"topk_group\":1,\"top_k\":3}", "top_k"},
    {"{" BASE ",\"topk_group\":-1}", "topk_group"},
    {"{" BASE ",\"routed_scaling_factor\":0}", "routed_scaling_factor"},
    {"{" BASE ",\"routed_scaling_factor\":\"2\"}", "routed_scaling_factor"},
    {"{" BASE ",\"num_experts\":8}", "num_experts"}, /* given twice */
    {"{" BASE ",\"scheme\":\"fp8\",\"weight_scale\":\"per_row\"}", "weight_scale"},
    {"{" BASE ",\"scheme\":\"fp8\",\"weight_scale\":\"block\",\"block_k\":96}", "block_k"},
    {"{" BASE ",\"scheme\":\"fp8\",\"weight_scale\":\"block\",\"block_k\":0}", "block_k"},
    {"{" BASE ",\"scheme\":\"fp8\",\"weight_scale\":\"block\",\"block_n\":0}", "block_n"},
    {"{" BASE ",\"scheme\":\"fp8\",\"weight_scale\":\"block\",\"has_activation_scales\":true}",
     "has_activation_scales"},
    {"{" BASE ",\"scheme\":\"fp8\",\"bits\":8}", "bits"},
    {"{" BASE ",\"block_k\":64}", "block_k"},
    {"{" BASE ",\"scheme\":\"wna16\",\"bits\":4,\"exact_division\":true}", "exact_division"},
    {"{" BASE ",\"has_bias\":1}", "has_bias"},
    {"{\"num_experts\":8,\"hidden_size\":48,\"intermediate_size\":128,\"scheme\":\"mxfp4\"}", "hidden_size"},
    {"{\"num_experts\":8,\"hidden_size\":64,\"intermediate_size\":80,\"scheme\":\"mxfp4\"}",
     "intermediate_size"},
    {"{" BASE, "config"},
    {"[" BASE "]", "config"},
    {"{" BASE "} {}", "config"},
    {"", "config"},
};

START_TEST(config_errors_name_the_key) {
  const cfg_case *c = &cfg_cases[_i];
  moe_expert_config cfg, before;
  moe_error err = {{0}};
  moe_expert_config_defaults(&cfg);
  cfg.num_experts = 77; /* must stay untouched on failure */
  before = cfg;
  moe_status s = moe_expert_config_parse(c->json, &cfg, &err);
  ck_assert_msg(s == MOE_EINVAL, "case %d (%s): status %d (%s)", _i, c->json, s, err.msg);
  ck_assert_msg(strncmp(err.msg, c->key, strlen(c->key)) == 0 && err.msg[strlen(c->key)] == ':',
                "case %d: message '%s' does not start with key '%s'", _i, err.msg, c->key);
  ck_cfg_eq(&cfg, &before);
}
END_TEST

/* Serializing keeps every double exact (cJSON's printer alone kept 15
 * digits when they read back within an epsilon; fuzz/regressions/
 * expert_config has the input that found it). */
START_TEST(config_json_round_trips_doubles_exactly) {
  static const double values[] = {7580058572823141489.5, 0.1, 2.5, 1.0 / 3.0, 1e-300, 16.000000000000004};
  for (size_t i = 0; i < sizeof values / sizeof values[0]; i++) {
    moe_expert_config cfg, back;
    moe_error err = {{0}};
    moe_expert_config_defaults(&cfg);
    cfg.num_experts = cfg.global_num_experts = 8;
    cfg.hidden_size = 128;
    cfg.intermediate_size = 64;
    cfg.routing.routed_scaling_factor = values[i];
    char *json = moe_expert_config_to_json(&cfg);
    ck_assert_ptr_nonnull(json);
    ck_assert_int_eq(moe_expert_config_parse(json, &back, &err), MOE_OK);
    ck_assert_msg(back.routing.routed_scaling_factor == values[i], "%.17g came back as %.17g", values[i],
                  back.routing.routed_scaling_factor);
    free(json);
  }
}
END_TEST

/* A config.json that is some other JSON file (a link gone wrong, or one
 * planted to read files): the message names the key's position only, none
 * of the file's content. */
START_TEST(config_errors_echo_no_foreign_content) {
  moe_expert_config cfg;
  moe_error err = {{0}};
  const char *foreign = "{\"root:x:0:0\":\"secret-value\",\"num_experts\":8}";
  ck_assert_int_eq(moe_expert_config_parse(foreign, &cfg, &err), MOE_EINVAL);
  ck_assert_msg(strstr(err.msg, "root") == NULL && strstr(err.msg, "secret") == NULL, "echoed: %s", err.msg);
  ck_assert_msg(strstr(err.msg, "key number 1") != NULL, "no position: %s", err.msg);
}
END_TEST

/* ---- synthetic sets of every scheme ------------------------------------------------------------ */

typedef struct scheme_case {
  moe_scheme scheme;
  int bits;
  int64_t group;
  bool zp;
} scheme_case;

static const scheme_case scheme_cases[] = {
    {MOE_SCHEME_BF16, 0, -1, false},  {MOE_SCHEME_FP16, 0, -1, false},  {MOE_SCHEME_WNA16, 4, -1, false},
    {MOE_SCHEME_WNA16, 4, 64, false}, {MOE_SCHEME_WNA16, 4, -1, true},  {MOE_SCHEME_WNA16, 4, 64, true},
    {MOE_SCHEME_WNA16, 8, -1, false}, {MOE_SCHEME_WNA16, 8, 64, false}, {MOE_SCHEME_WNA16, 8, -1, true},
    {MOE_SCHEME_WNA16, 8, 64, true},  {MOE_SCHEME_WNA16, 4, 32, true},
};

static void expect_shape(const moe_tensor *t, int64_t a, int64_t b, int64_t c) {
  ck_assert_int_eq(t->ndim, 3);
  ck_assert_int_eq(t->shape[0], a);
  ck_assert_int_eq(t->shape[1], b);
  ck_assert_int_eq(t->shape[2], c);
}

START_TEST(write_and_load_every_scheme) {
  const scheme_case *sc = &scheme_cases[_i];
  moe_expert_config cfg = small_config(sc->scheme, sc->bits, sc->group, sc->zp);
  const int64_t E = 4, H = 128, I = 64;
  char dir[600];
  moe_error err = {{0}};
  tmp_path(dir, sizeof dir, "sets/one"); /* parents created too */
  ck_assert_int_eq(moe_expert_set_write_random(dir, &cfg, 7, &err), MOE_OK);

  moe_expert_set *set = NULL;
  ck_assert_msg(moe_expert_set_load(dir, "layer0", &set, &err) == MOE_OK, "%s", err.msg);
  ck_assert_str_eq(set->name, "layer0");
  ck_assert_ptr_nonnull(set->owner);
  ck_cfg_eq(&set->cfg, &cfg);
  ck_assert_int_eq(moe_expert_set_validate(set, &err), MOE_OK);
  ck_assert_ptr_null(set->t[MOE_CORRECTION_BIAS].data);

  if (sc->scheme != MOE_SCHEME_WNA16) {
    moe_dtype want = sc->scheme == MOE_SCHEME_FP16 ? MOE_F16 : MOE_BF16;
    ck_assert_int_eq(set->t[MOE_W13].dtype, want);
    ck_assert_int_eq(set->t[MOE_W2].dtype, want);
    expect_shape(&set->t[MOE_W13], E, 2 * I, H);
    expect_shape(&set->t[MOE_W2], E, H, I);
    for (int s = MOE_W13_QWEIGHT; s <= MOE_W2_QZEROS; s++)
      ck_assert_ptr_null(set->t[s].data);
    /* uniform on +-sqrt(3/H): bounded, variance about 1/H */
    const uint16_t *w = set->t[MOE_W13].data;
    size_t n = set->t[MOE_W13].nbytes / 2;
    double sq = 0, bound = sqrt(3.0 / (double)H) * 1.01;
    for (size_t i = 0; i < n; i++) {
      double v = want == MOE_F16 ? moe_f16_to_f32(w[i]) : moe_bf16_to_f32(w[i]);
      ck_assert(isfinite(v) && fabs(v) <= bound);
      sq += v * v;
    }
    ck_assert_double_eq_tol(sq / (double)n * (double)H, 1.0, 0.1);
  } else {
    const int64_t g13 = sc->group == -1 ? 1 : H / sc->group, g2 = sc->group == -1 ? 1 : I / sc->group;
    const int64_t pack = sc->bits == 4 ? 2 : 1;
    ck_assert_ptr_null(set->t[MOE_W13].data);
    ck_assert_ptr_null(set->t[MOE_W2].data);
    ck_assert_int_eq(set->t[MOE_W13_QWEIGHT].dtype, MOE_UINT8);
    expect_shape(&set->t[MOE_W13_QWEIGHT], E, 2 * I, H / pack);
    expect_shape(&set->t[MOE_W2_QWEIGHT], E, H, I / pack);
    ck_assert_int_eq(set->t[MOE_W13_SCALES].dtype, MOE_BF16);
    expect_shape(&set->t[MOE_W13_SCALES], E, 2 * I, g13);
    expect_shape(&set->t[MOE_W2_SCALES], E, H, g2);
    if (sc->zp) {
      ck_assert_int_eq(set->t[MOE_W13_QZEROS].dtype, MOE_UINT8);
      expect_shape(&set->t[MOE_W13_QZEROS], E, 2 * I / pack, g13);
      expect_shape(&set->t[MOE_W2_QZEROS], E, H / pack, g2);
      const uint8_t *z = set->t[MOE_W2_QZEROS].data;
      int mid = 1 << (sc->bits - 1);
      for (size_t i = 0; i < set->t[MOE_W2_QZEROS].nbytes; i++) {
        int lo = sc->bits == 4 ? (z[i] & 15) : z[i];
        ck_assert(lo >= mid - 2 && lo <= mid + 1);
      }
    } else {
      ck_assert_ptr_null(set->t[MOE_W13_QZEROS].data);
      ck_assert_ptr_null(set->t[MOE_W2_QZEROS].data);
    }
    /* scales positive and near 1/(sqrt(K) * code std) */
    const uint16_t *sc13 = set->t[MOE_W13_SCALES].data;
    double code_std = sqrt((double)((1 << (2 * sc->bits)) - 1) / 12.0),
           base = 1.0 / (sqrt((double)H) * code_std);
    for (size_t i = 0; i < set->t[MOE_W13_SCALES].nbytes / 2; i++) {
      double v = moe_bf16_to_f32(sc13[i]);
      ck_assert(v >= base * 0.74 && v <= base * 1.26);
    }
    /* every code value occurs */
    int seen[256] = {0};
    const uint8_t *q = set->t[MOE_W13_QWEIGHT].data;
    for (size_t i = 0; i < set->t[MOE_W13_QWEIGHT].nbytes; i++)
      seen[sc->bits == 4 ? q[i] & 15 : q[i]] = 1;
    for (int v = 0; v < (1 << sc->bits); v++)
      ck_assert_msg(seen[v], "code %d never written", v);
  }
  moe_expert_set_destroy(set);
}
END_TEST

START_TEST(write_is_deterministic) {
  moe_expert_config cfg = small_config(MOE_SCHEME_WNA16, 4, 64, true);
  char a[600], b[600], c[600], pa[700], pb[700], pc[700];
  moe_error err = {{0}};
  tmp_path(a, sizeof a, "a");
  tmp_path(b, sizeof b, "b");
  tmp_path(c, sizeof c, "c");
  ck_assert_int_eq(moe_expert_set_write_random(a, &cfg, 99, &err), MOE_OK);
  ck_assert_int_eq(moe_expert_set_write_random(b, &cfg, 99, &err), MOE_OK);
  ck_assert_int_eq(moe_expert_set_write_random(c, &cfg, 100, &err), MOE_OK);
  snprintf(pa, sizeof pa, "%s/weights.safetensors", a);
  snprintf(pb, sizeof pb, "%s/weights.safetensors", b);
  snprintf(pc, sizeof pc, "%s/weights.safetensors", c);
  size_t la, lb, lc;
  unsigned char *da = read_all(pa, &la), *db = read_all(pb, &lb), *dc = read_all(pc, &lc);
  ck_assert_uint_eq(la, lb);
  ck_assert_uint_eq(la, lc);
  ck_assert_int_eq(memcmp(da, db, la), 0);
  ck_assert_int_ne(memcmp(da, dc, la), 0);
  free(da);
  free(db);
  free(dc);
  /* writing again over an existing set replaces it */
  ck_assert_int_eq(moe_expert_set_write_random(a, &cfg, 100, &err), MOE_OK);
  da = read_all(pa, &la);
  dc = read_all(pc, &lc);
  ck_assert_int_eq(memcmp(da, dc, la), 0);
  free(da);
  free(dc);
  /* an invalid config writes nothing */
  cfg.bits = 5;
  tmp_path(a, sizeof a, "never");
  ck_assert_int_eq(moe_expert_set_write_random(a, &cfg, 1, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "bits");
  ck_assert_int_ne(access(a, F_OK), 0);
}
END_TEST

START_TEST(shard_with_offset) {
  moe_expert_config cfg = small_config(MOE_SCHEME_BF16, 0, -1, false);
  cfg.expert_offset = 4;
  cfg.global_num_experts = 12;
  cfg.routing.num_expert_group = 4;
  cfg.routing.topk_group = 2;
  cfg.routing.top_k = 6;
  cfg.routing.scoring = MOE_SCORING_SIGMOID;
  cfg.activation = MOE_ACT_GELU;
  char dir[600];
  moe_error err = {{0}};
  tmp_path(dir, sizeof dir, "shard");
  ck_assert_int_eq(moe_expert_set_write_random(dir, &cfg, 3, &err), MOE_OK);
  moe_expert_set *set = NULL;
  ck_assert_int_eq(moe_expert_set_load(dir, NULL, &set, &err), MOE_OK);
  ck_assert_str_eq(set->name, "");
  ck_assert_int_eq(set->cfg.expert_offset, 4);
  ck_assert_int_eq(set->cfg.global_num_experts, 12);
  ck_assert_int_eq(set->cfg.activation, MOE_ACT_GELU);
  ck_assert_int_eq(set->t[MOE_W13].shape[0], 4); /* local experts only */
  moe_expert_set_destroy(set);
  moe_expert_set_destroy(NULL); /* NULL-safe */
}
END_TEST

/* ---- validation failures --------------------------------------------------------------------- */

/* Buffers for a set of config `c` built in memory: every slot the config
 * needs, at its expected shape, zero-filled. */
typedef struct mem_set {
  moe_named_tensor t[MOE_EXPERT_TENSOR_COUNT];
  size_t n;
} mem_set;

static void mem_add(mem_set *m, moe_expert_tensor slot, moe_dtype dt, int32_t ndim, const int64_t *shape) {
  moe_named_tensor *nt = &m->t[m->n++];
  nt->name = moe_expert_tensor_names[slot];
  nt->tensor.dtype = dt;
  nt->tensor.ndim = ndim;
  for (int d = 0; d < ndim; d++)
    nt->tensor.shape[d] = shape[d];
  ck_assert_int_eq(moe_tensor_bytes(&nt->tensor, &nt->tensor.nbytes), MOE_OK);
  nt->tensor.data = calloc(1, nt->tensor.nbytes);
  ck_assert_ptr_nonnull(nt->tensor.data);
}

static void mem_build(mem_set *m, const moe_expert_config *c, moe_dtype scale_dt) {
  memset(m, 0, sizeof *m);
  const int64_t E = c->num_experts, H = c->hidden_size, I = c->intermediate_size;
  if (c->scheme != MOE_SCHEME_WNA16) {
    moe_dtype dt = c->scheme == MOE_SCHEME_FP16 ? MOE_F16 : MOE_BF16;
    mem_add(m, MOE_W13, dt, 3, (int64_t[]){E, 2 * I, H});
    mem_add(m, MOE_W2, dt, 3, (int64_t[]){E, H, I});
    return;
  }
  const int64_t p = c->bits == 4 ? 2 : 1;
  const int64_t g13 = c->group_size == -1 ? 1 : H / c->group_size,
                g2 = c->group_size == -1 ? 1 : I / c->group_size;
  mem_add(m, MOE_W13_QWEIGHT, MOE_UINT8, 3, (int64_t[]){E, 2 * I, H / p});
  mem_add(m, MOE_W13_SCALES, scale_dt, 3, (int64_t[]){E, 2 * I, g13});
  mem_add(m, MOE_W2_QWEIGHT, MOE_UINT8, 3, (int64_t[]){E, H, I / p});
  mem_add(m, MOE_W2_SCALES, scale_dt, 3, (int64_t[]){E, H, g2});
  if (c->has_zero_points) {
    mem_add(m, MOE_W13_QZEROS, MOE_UINT8, 3, (int64_t[]){E, 2 * I / p, g13});
    mem_add(m, MOE_W2_QZEROS, MOE_UINT8, 3, (int64_t[]){E, H / p, g2});
  }
}

static void mem_free(mem_set *m) {
  for (size_t i = 0; i < m->n; i++)
    free(m->t[i].tensor.data);
}

static moe_named_tensor *mem_find(mem_set *m, moe_expert_tensor slot) {
  for (size_t i = 0; i < m->n; i++)
    if (strcmp(m->t[i].name, moe_expert_tensor_names[slot]) == 0) return &m->t[i];
  ck_abort_msg("no tensor %s", moe_expert_tensor_names[slot]);
  return NULL;
}

/* Removes a slot's tensor (its buffer freed). */
static void mem_drop(mem_set *m, moe_expert_tensor slot) {
  moe_named_tensor *t = mem_find(m, slot);
  free(t->tensor.data);
  *t = m->t[--m->n];
}

static moe_status try_set(const moe_expert_config *c, mem_set *m, moe_error *err) {
  moe_expert_set *set = NULL;
  memset(err, 0, sizeof *err);
  moe_status s = moe_expert_set_from_tensors("t", c, m->t, m->n, &set, err);
  if (s == MOE_OK) {
    ck_assert_ptr_nonnull(set);
    ck_assert_ptr_null(set->owner); /* borrowed */
    moe_expert_set_destroy(set);
  } else {
    ck_assert_ptr_null(set);
  }
  return s;
}

START_TEST(from_tensors_accepts) {
  moe_error err;
  mem_set m;
  const moe_dtype scale_dts[] = {MOE_F32, MOE_F16, MOE_BF16};
  for (int i = 0; i < 3; i++) {
    moe_expert_config c = small_config(MOE_SCHEME_WNA16, i == 1 ? 8 : 4, 32, i != 0);
    mem_build(&m, &c, scale_dts[i]);
    ck_assert_msg(try_set(&c, &m, &err) == MOE_OK, "%s", err.msg);
    mem_free(&m);
  }
  moe_expert_config c = small_config(MOE_SCHEME_FP16, 0, -1, false);
  c.global_num_experts = 16;
  c.expert_offset = 12;
  mem_build(&m, &c, MOE_F32);
  mem_add(&m, MOE_CORRECTION_BIAS, MOE_F32, 1, (int64_t[]){16}); /* global E */
  moe_expert_set *set = NULL;
  ck_assert_int_eq(moe_expert_set_from_tensors("fp16 set", &c, m.t, m.n, &set, &err), MOE_OK);
  ck_assert_str_eq(set->name, "fp16 set");
  ck_assert_ptr_eq(set->t[MOE_W13].data, mem_find(&m, MOE_W13)->tensor.data); /* borrowed, not copied */
  ck_assert_ptr_nonnull(set->t[MOE_CORRECTION_BIAS].data);
  moe_expert_set_destroy(set);
  mem_free(&m);
}
END_TEST

/* References and device-cache holds: a set is unused once only holds are
 * left (the count of such events moves by one), and freed with the last
 * hold; users' references never make it unused. */
START_TEST(lifetime_refs_and_holds) {
  moe_error err;
  mem_set m;
  moe_expert_config c = small_config(MOE_SCHEME_BF16, 0, -1, false);
  mem_build(&m, &c, MOE_F32);
  for (int holders = 0; holders <= 2; holders++) {
    moe_expert_set *set = NULL;
    ck_assert_int_eq(moe_expert_set_from_tensors("t", &c, m.t, m.n, &set, &err), MOE_OK);
    ck_assert(!moe_expert_set_unused(set));
    for (int h = 0; h < holders; h++)
      ck_assert_ptr_eq(moe_expert_set_hold(set), set);
    ck_assert_ptr_eq(moe_expert_set_ref(set), set); /* a second user */
    const uint64_t before = moe_expert_set_unused_count();
    moe_expert_set_destroy(set); /* the second user is done: the creator still uses it */
    ck_assert(!moe_expert_set_unused(set) || holders == 0);
    ck_assert_uint_eq(moe_expert_set_unused_count(), before);
    if (holders == 0) {
      moe_expert_set_destroy(set); /* last reference, no holds: freed, nothing to trim */
      ck_assert_uint_eq(moe_expert_set_unused_count(), before);
      continue;
    }
    moe_expert_set_destroy(set); /* the creator's: only holds are left */
    ck_assert(moe_expert_set_unused(set));
    ck_assert_uint_eq(moe_expert_set_unused_count(), before + 1);
    for (int h = 0; h < holders; h++) {
      ck_assert(moe_expert_set_unused(set)); /* still allocated until the last hold */
      moe_expert_set_release_hold(set);
    }
    ck_assert_uint_eq(moe_expert_set_unused_count(), before + 1);
  }
  mem_free(&m);
}
END_TEST

START_TEST(from_tensors_rejects) {
  moe_error err;
  mem_set m;
  moe_expert_config bf = small_config(MOE_SCHEME_BF16, 0, -1, false);
  moe_expert_config wq = small_config(MOE_SCHEME_WNA16, 4, 64, false);
  moe_expert_config wz = small_config(MOE_SCHEME_WNA16, 4, 64, true);

  /* wrong shape: names the tensor and the expected shape */
  mem_build(&m, &bf, MOE_F32);
  mem_find(&m, MOE_W13)->tensor.shape[1] = 64;
  mem_find(&m, MOE_W13)->tensor.nbytes /= 2;
  ck_assert_int_eq(try_set(&bf, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w13");
  ck_assert_msg_has(err, "[4, 128, 128]");
  ck_assert_msg_has(err, "[E, 2I, H]");
  mem_free(&m);

  /* wrong rank */
  mem_build(&m, &bf, MOE_F32);
  mem_find(&m, MOE_W2)->tensor.ndim = 2;
  mem_find(&m, MOE_W2)->tensor.shape[1] *= 64;
  ck_assert_int_eq(try_set(&bf, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w2");
  mem_free(&m);

  /* wrong dtype: fp16 weights in a bf16 set */
  mem_build(&m, &bf, MOE_F32);
  mem_find(&m, MOE_W2)->tensor.dtype = MOE_F16;
  ck_assert_int_eq(try_set(&bf, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w2");
  ck_assert_msg_has(err, "dtype fp16");
  mem_free(&m);

  /* byte size not matching the shape */
  mem_build(&m, &bf, MOE_F32);
  mem_find(&m, MOE_W2)->tensor.nbytes -= 2;
  ck_assert_int_eq(try_set(&bf, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w2");
  ck_assert_msg_has(err, "bytes");
  mem_free(&m);

  /* missing tensor */
  mem_build(&m, &wq, MOE_BF16);
  mem_drop(&m, MOE_W2_SCALES);
  ck_assert_int_eq(try_set(&wq, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w2_scales");
  ck_assert_msg_has(err, "missing");
  ck_assert_msg_has(err, "[4, 128, 1]");
  mem_free(&m);

  /* extra tensor: bf16 weights in a wna16 set */
  mem_build(&m, &wq, MOE_BF16);
  mem_add(&m, MOE_W13, MOE_BF16, 3, (int64_t[]){4, 128, 128});
  ck_assert_int_eq(try_set(&wq, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w13");
  ck_assert_msg_has(err, "wna16");
  mem_free(&m);

  /* zero points without has_zero_points */
  mem_build(&m, &wz, MOE_BF16);
  ck_assert_int_eq(try_set(&wq, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w13_qzeros");
  ck_assert_msg_has(err, "has_zero_points");
  mem_free(&m);

  /* has_zero_points without zero points */
  mem_build(&m, &wq, MOE_BF16);
  ck_assert_int_eq(try_set(&wz, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w13_qzeros");
  ck_assert_msg_has(err, "missing");
  mem_free(&m);

  /* int4 qweight at the int8 width */
  mem_build(&m, &wq, MOE_BF16);
  moe_named_tensor *q = mem_find(&m, MOE_W13_QWEIGHT);
  free(q->tensor.data);
  q->tensor.shape[2] = 128;
  q->tensor.nbytes *= 2;
  q->tensor.data = calloc(1, q->tensor.nbytes);
  ck_assert_int_eq(try_set(&wq, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w13_qweight");
  ck_assert_msg_has(err, "[4, 128, 64]");
  mem_free(&m);

  /* int4 zero points must pack along N */
  mem_build(&m, &wz, MOE_BF16);
  moe_named_tensor *z = mem_find(&m, MOE_W2_QZEROS);
  z->tensor.shape[1] = 128;
  z->tensor.shape[2] = 1;
  ck_assert_int_eq(try_set(&wz, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w2_qzeros");
  ck_assert_msg_has(err, "[E, H/2, I/G]");
  mem_free(&m);

  /* qweight stored as int8 */
  mem_build(&m, &wq, MOE_BF16);
  mem_find(&m, MOE_W2_QWEIGHT)->tensor.dtype = MOE_INT8;
  ck_assert_int_eq(try_set(&wq, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w2_qweight");
  mem_free(&m);

  /* scales of a non-float dtype */
  mem_build(&m, &wq, MOE_INT32);
  ck_assert_int_eq(try_set(&wq, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w13_scales");
  mem_free(&m);

  /* correction_bias sized to the local experts of a shard */
  moe_expert_config shard = bf;
  shard.global_num_experts = 8;
  mem_build(&m, &shard, MOE_F32);
  mem_add(&m, MOE_CORRECTION_BIAS, MOE_F32, 1, (int64_t[]){4});
  ck_assert_int_eq(try_set(&shard, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "correction_bias");
  ck_assert_msg_has(err, "[8]");
  mem_free(&m);

  /* unknown and duplicate names */
  mem_build(&m, &bf, MOE_F32);
  m.t[m.n] = m.t[0];
  m.t[m.n].name = "w4";
  m.n++;
  ck_assert_int_eq(try_set(&bf, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w4");
  m.t[m.n - 1].name = "w13";
  ck_assert_int_eq(try_set(&bf, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "w13");
  ck_assert_msg_has(err, "twice");
  m.n--;
  mem_free(&m);

  /* an invalid config is reported by key */
  mem_build(&m, &bf, MOE_F32);
  moe_expert_config badk = bf;
  badk.routing.top_k = 5;
  ck_assert_int_eq(try_set(&badk, &m, &err), MOE_EINVAL);
  ck_assert_names_tensor(err, "top_k");
  mem_free(&m);
}
END_TEST

/* ---- loading failures on disk ------------------------------------------------------------------ */

START_TEST(load_rejects) {
  moe_expert_config cfg = small_config(MOE_SCHEME_BF16, 0, -1, false);
  char dir[600], path[700];
  moe_error err = {{0}};
  moe_expert_set *set = NULL;
  mem_set m;
  tmp_path(dir, sizeof dir, "bad");

  /* no directory, no config */
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_ENOTFOUND);
  ck_assert_msg_has(err, "config.json");
  ck_assert_ptr_null(set);

  /* a config, no weights */
  mkdir(dir, 0777);
  snprintf(path, sizeof path, "%s/config.json", dir);
  char *json = moe_expert_config_to_json(&cfg);
  write_text(path, json);
  free(json);
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_ENOTFOUND);
  ck_assert_msg_has(err, "safetensors");

  /* a bad config names the file and the unknown key's position (not the key) */
  write_text(path, "{\"num_experts\":4,\"hidden_size\":128,\"intermediate_size\":64,\"topk\":2}");
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_EINVAL);
  ck_assert_msg_has(err, "config.json: config: key number 4");
  ck_assert_msg(!strstr(err.msg, "topk"), "unknown key echoed: %s", err.msg);

  /* valid set, then tamper with it */
  ck_assert_int_eq(moe_expert_set_write_random(dir, &cfg, 5, &err), MOE_OK);
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_OK);
  moe_expert_set_destroy(set);
  set = NULL;

  /* a second file holding w13 again */
  mem_build(&m, &cfg, MOE_F32);
  snprintf(path, sizeof path, "%s/a-extra.safetensors", dir);
  ck_assert_int_eq(moe_safetensors_write(path, &m.t[0], 1, &err), MOE_OK);
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_EINVAL);
  ck_assert_msg_has(err, "'w13'");
  ck_assert_msg_has(err, "a-extra.safetensors");
  ck_assert_msg_has(err, "weights.safetensors");
  ck_assert_ptr_null(set);

  /* an unknown tensor name */
  moe_named_tensor extra = m.t[0];
  extra.name = "w3";
  ck_assert_int_eq(moe_safetensors_write(path, &extra, 1, &err), MOE_OK);
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_EINVAL);
  ck_assert_msg_has(err, "'w3'");

  /* tensors split over two files load as one set */
  snprintf(path, sizeof path, "%s/a-extra.safetensors", dir);
  ck_assert_int_eq(remove(path), 0);
  char wpath[700];
  snprintf(wpath, sizeof wpath, "%s/weights.safetensors", dir);
  ck_assert_int_eq(moe_safetensors_write(wpath, &m.t[0], 1, &err), MOE_OK); /* w13 only */
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_EINVAL);
  ck_assert_msg_has(err, "w2: missing");
  snprintf(path, sizeof path, "%s/w2.safetensors", dir);
  ck_assert_int_eq(moe_safetensors_write(path, &m.t[1], 1, &err), MOE_OK);
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_OK);
  ck_assert_ptr_nonnull(set->t[MOE_W2].data);
  moe_expert_set_destroy(set);
  set = NULL;
  ck_assert_int_eq(remove(path), 0);

  /* wrong shape on disk: names the directory and the tensor */
  m.t[1].tensor.shape[2] = 32;
  m.t[1].tensor.nbytes /= 2;
  moe_named_tensor both[2] = {m.t[0], m.t[1]};
  ck_assert_int_eq(moe_safetensors_write(wpath, both, 2, &err), MOE_OK);
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_EINVAL);
  ck_assert_msg_has(err, dir);
  ck_assert_msg_has(err, "w2: shape [4, 128, 32], expected [4, 128, 64]");

  /* a wrong dtype on disk */
  uint8_t raw[8] = {0};
  moe_named_tensor bad = {"correction_bias", {MOE_FP8_E4M3FN, 1, {8}, raw, 8}};
  m.t[1].tensor.shape[2] = 64;
  m.t[1].tensor.nbytes *= 2;
  moe_named_tensor three[3] = {m.t[0], m.t[1], bad};
  ck_assert_int_eq(moe_safetensors_write(wpath, three, 3, &err), MOE_OK);
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_EINVAL);
  ck_assert_msg_has(err, "correction_bias: dtype fp8_e4m3fn");

  /* a corrupt weights file */
  write_text(wpath, "garbage");
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_EIO);
  ck_assert_msg_has(err, "weights.safetensors");

  /* a name too long for the set */
  char longname[200];
  memset(longname, 'n', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  ck_assert_int_eq(moe_expert_set_write_random(dir, &cfg, 5, &err), MOE_OK);
  ck_assert_int_eq(moe_expert_set_load(dir, longname, &set, &err), MOE_EINVAL);
  ck_assert_msg_has(err, "name");
  ck_assert_ptr_null(set);
  mem_free(&m);
}
END_TEST

/* The file under a loaded set changes in place (truncated, then rewritten
 * with other bytes, as a careless copy into the repository does): the set
 * keeps the weights it loaded. A mapping of the file would raise SIGBUS on
 * the truncated pages and then show the new bytes. */
static void ck_set_matches(const moe_expert_set *set, const moe_safetensors *want, const char *when) {
  for (size_t i = 0; i < moe_safetensors_count(want); i++) {
    const char *tn = moe_safetensors_name(want, i);
    moe_tensor w;
    moe_error err;
    ck_assert_int_eq(moe_safetensors_get(want, tn, &w, &err), MOE_OK);
    int slot = 0;
    while (strcmp(moe_expert_tensor_names[slot], tn) != 0)
      slot++;
    ck_assert_uint_eq(set->t[slot].nbytes, w.nbytes);
    ck_assert_msg(memcmp(set->t[slot].data, w.data, w.nbytes) == 0, "%s: bytes changed %s", tn, when);
  }
}

START_TEST(load_survives_file_changes) {
  moe_expert_config cfg = small_config(MOE_SCHEME_WNA16, 4, 64, true);
  char dir[600], path[700];
  moe_error err = {{0}};
  tmp_path(dir, sizeof dir, "changed");
  snprintf(path, sizeof path, "%s/weights.safetensors", dir);
  ck_assert_int_eq(moe_expert_set_write_random(dir, &cfg, 11, &err), MOE_OK);
  size_t len;
  unsigned char *orig = read_all(path, &len);
  moe_safetensors *want = NULL;
  ck_assert_int_eq(moe_safetensors_open_buffer(orig, len, &want, &err), MOE_OK);

  moe_expert_set *set = NULL;
  ck_assert_msg(moe_expert_set_load(dir, "x", &set, &err) == MOE_OK, "%s", err.msg);
  ck_set_matches(set, want, "after the load");

  /* in place (the same inode), not a rename */
  FILE *f = fopen(path, "r+b");
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(ftruncate(fileno(f), 4), 0);
  ck_set_matches(set, want, "after truncation");
  unsigned char *junk = malloc(len);
  memset(junk, 0xA5, len);
  ck_assert_uint_eq(fwrite(junk, 1, len, f), len);
  ck_assert_int_eq(fclose(f), 0);
  ck_set_matches(set, want, "after the rewrite");

  /* only a new load sees the change: here a file it rejects, cleanly */
  moe_expert_set *again = NULL;
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &again, &err), MOE_EIO);
  ck_assert_msg_has(err, "weights.safetensors");
  ck_assert_ptr_null(again);
  ck_set_matches(set, want, "after the failed reload");

  moe_expert_set_destroy(set);
  moe_safetensors_close(want);
  free(junk);
  free(orig);
}
END_TEST

/* ---- the schemes of issue 14: fp8, mxfp4, biases ------------------------------------------ */

/* moe-mkset's sets of the new schemes load back with every tensor in its
 * layout, and the config round-trips. */
START_TEST(write_and_load_new_schemes) {
  moe_expert_config cfgs[3];
  cfgs[0] = small_config(MOE_SCHEME_FP8, 0, -1, false);
  cfgs[0].weight_scale = MOE_WSCALE_BLOCK, cfgs[0].block_n = 48, cfgs[0].block_k = 32,
  cfgs[0].has_bias = true;
  cfgs[1] = small_config(MOE_SCHEME_FP8, 0, -1, false);
  cfgs[1].has_act_scales = true, cfgs[1].exact_division = true;
  cfgs[2] = small_config(MOE_SCHEME_MXFP4, 0, -1, false);
  cfgs[2].has_bias = true;
  const int64_t E = 4, H = 128, I = 64;
  for (int i = 0; i < 3; i++) {
    char dir[600];
    char leaf[16];
    snprintf(leaf, sizeof leaf, "new%d", i);
    tmp_path(dir, sizeof dir, leaf);
    moe_error err = {{0}};
    ck_assert_msg(moe_expert_set_write_random(dir, &cfgs[i], 3, &err) == MOE_OK, "%s", err.msg);
    moe_expert_set *set = NULL;
    ck_assert_msg(moe_expert_set_load(dir, "n", &set, &err) == MOE_OK, "%s", err.msg);
    ck_cfg_eq(&set->cfg, &cfgs[i]);
    const bool mx = cfgs[i].scheme == MOE_SCHEME_MXFP4;
    expect_shape(&set->t[MOE_W13_QWEIGHT], E, 2 * I, mx ? H / 2 : H);
    expect_shape(&set->t[MOE_W2_QWEIGHT], E, H, mx ? I / 2 : I);
    if (mx) {
      expect_shape(&set->t[MOE_W13_SCALES], E, 2 * I, H / 32);
      ck_assert_int_eq(set->t[MOE_W2_SCALES].dtype, MOE_UINT8);
    } else if (i == 0) {
      expect_shape(&set->t[MOE_W13_SCALES], E, (2 * I + 47) / 48, H / 32);
      expect_shape(&set->t[MOE_W2_SCALES], E, (H + 47) / 48, I / 32);
    } else {
      ck_assert_int_eq(set->t[MOE_W13_SCALES].ndim, 1);
      ck_assert_int_eq(set->t[MOE_A13_SCALE].shape[0], E);
      ck_assert_ptr_nonnull(set->t[MOE_A2_SCALE].data);
    }
    ck_assert_int_eq(set->t[MOE_W13_BIAS].data != NULL, cfgs[i].has_bias);
    if (cfgs[i].has_bias) {
      ck_assert_int_eq(set->t[MOE_W2_BIAS].ndim, 2);
      ck_assert_int_eq(set->t[MOE_W2_BIAS].shape[1], H);
    }
    moe_expert_set_destroy(set);
  }
}
END_TEST

/* An e8m0 byte 0xFF in an mxfp4 set's scales is refused at load, naming
 * the tensor and the index. */
START_TEST(mxfp4_nan_scale_refused_at_load) {
  moe_expert_config cfg = small_config(MOE_SCHEME_MXFP4, 0, -1, false);
  char dir[600], path[700];
  moe_error err = {{0}};
  tmp_path(dir, sizeof dir, "mxnan");
  snprintf(path, sizeof path, "%s/weights.safetensors", dir);
  ck_assert_int_eq(moe_expert_set_write_random(dir, &cfg, 5, &err), MOE_OK);
  size_t len;
  unsigned char *bytes = read_all(path, &len);
  moe_safetensors *st = NULL;
  ck_assert_int_eq(moe_safetensors_open_buffer(bytes, len, &st, &err), MOE_OK);
  moe_tensor t;
  ck_assert_int_eq(moe_safetensors_get(st, "w2_scales", &t, &err), MOE_OK);
  /* w2_scales [4, 128, 2]: index [2, 5, 1] */
  const size_t off = (size_t)((const unsigned char *)t.data - bytes) + (2 * 128 + 5) * 2 + 1;
  moe_safetensors_close(st);
  bytes[off] = 0xFF;
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  ck_assert_uint_eq(fwrite(bytes, 1, len, f), len);
  ck_assert_int_eq(fclose(f), 0);
  moe_expert_set *set = NULL;
  ck_assert_int_eq(moe_expert_set_load(dir, "x", &set, &err), MOE_EINVAL);
  ck_assert_msg_has(err, "w2_scales");
  ck_assert_msg_has(err, "[2, 5, 1]");
  ck_assert_msg_has(err, "0xFF");
  ck_assert_ptr_null(set);
  free(bytes);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("expert_set");
  TCase *tc = tcase_create("core");
  tcase_add_checked_fixture(tc, make_tmpdir, remove_tmpdir);
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, config_defaults_and_parse);
  tcase_add_loop_test(tc, config_errors_name_the_key, 0, (int)(sizeof cfg_cases / sizeof cfg_cases[0]));
  tcase_add_test(tc, config_errors_echo_no_foreign_content);
  tcase_add_test(tc, config_json_round_trips_doubles_exactly);
  tcase_add_loop_test(tc, write_and_load_every_scheme, 0,
                      (int)(sizeof scheme_cases / sizeof scheme_cases[0]));
  tcase_add_test(tc, write_is_deterministic);
  tcase_add_test(tc, shard_with_offset);
  tcase_add_test(tc, from_tensors_accepts);
  tcase_add_test(tc, from_tensors_rejects);
  tcase_add_test(tc, lifetime_refs_and_holds);
  tcase_add_test(tc, load_rejects);
  tcase_add_test(tc, load_survives_file_changes);
  tcase_add_test(tc, write_and_load_new_schemes);
  tcase_add_test(tc, mxfp4_nan_scale_refused_at_load);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
