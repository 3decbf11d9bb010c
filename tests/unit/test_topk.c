/* moe.topk (docs/numerics.md "moe.topk"): ties to the lower index, grouped
 * routing (group max, and the DeepSeek-V3 sum of the top two with a
 * correction bias), bias-chosen experts with unbiased weights,
 * renormalization and the scaling factor, each on a small case whose
 * expected values are worked out here from the definition; and every bad
 * input rejected with the offending name in the message. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "moe/codec.h"
#include "moe/ops.h"

#define ck_assert_msg_has(err, needle)                                                                       \
  ck_assert_msg(strstr((err).msg, (needle)) != NULL, "message '%s' lacks '%s'", (err).msg, (needle))

/* ---- helpers ------------------------------------------------------------------- */

typedef struct routing_req {
  const float *logits; /* [tokens, experts] */
  int64_t tokens, experts;
  const float *bias; /* [experts] or NULL */
  int64_t top_k;
  const char *scoring; /* NULL: default */
  int renormalize;     /* -1: absent */
  int64_t groups, topk_group;
  double scale; /* 0: absent */
} routing_req;

static moe_tensor f32_tensor(const float *p, int ndim, int64_t d0, int64_t d1) {
  moe_tensor t = {MOE_F32, ndim, {d0, d1}, (void *)p, 0};
  t.nbytes = (size_t)(ndim == 1 ? d0 : d0 * d1) * sizeof(float);
  return t;
}

static size_t build_params(const routing_req *r, moe_param *items) {
  size_t n = 0;
  items[n++] = (moe_param){.name = "top_k", .type = MOE_PARAM_INT, .i = r->top_k};
  if (r->scoring) items[n++] = (moe_param){.name = "scoring", .type = MOE_PARAM_STRING, .s = r->scoring};
  if (r->renormalize >= 0)
    items[n++] = (moe_param){.name = "renormalize", .type = MOE_PARAM_BOOL, .b = r->renormalize != 0};
  if (r->groups) {
    items[n++] = (moe_param){.name = "num_expert_group", .type = MOE_PARAM_INT, .i = r->groups};
    items[n++] = (moe_param){.name = "topk_group", .type = MOE_PARAM_INT, .i = r->topk_group};
  }
  if (r->scale != 0.0)
    items[n++] = (moe_param){.name = "routed_scaling_factor", .type = MOE_PARAM_DOUBLE, .d = r->scale};
  return n;
}

/* Runs moe.topk; ids and weights receive tokens * top_k values. */
static void route(const routing_req *r, int32_t *ids, float *weights) {
  moe_named_tensor in[2] = {{"router_logits", f32_tensor(r->logits, 2, r->tokens, r->experts)},
                            {"correction_bias", f32_tensor(r->bias, 1, r->experts, 0)}};
  moe_param items[8];
  moe_params params = {items, build_params(r, items)};
  moe_named_tensor *out = NULL;
  size_t n_out = 0;
  moe_error err = {{0}};
  moe_status s = moe_run_host("moe.topk", in, r->bias ? 2 : 1, &params, NULL, &out, &n_out, &err);
  ck_assert_msg(s == MOE_OK, "moe.topk failed: %s", err.msg);
  ck_assert_uint_eq(n_out, 2);
  ck_assert_str_eq(out[0].name, "topk_ids");
  ck_assert_str_eq(out[1].name, "topk_weights");
  ck_assert_int_eq(out[0].tensor.dtype, MOE_INT32);
  ck_assert_int_eq(out[1].tensor.dtype, MOE_F32);
  ck_assert_int_eq(out[0].tensor.shape[0], r->tokens);
  ck_assert_int_eq(out[0].tensor.shape[1], r->top_k);
  memcpy(ids, out[0].tensor.data, (size_t)(r->tokens * r->top_k) * sizeof(int32_t));
  memcpy(weights, out[1].tensor.data, (size_t)(r->tokens * r->top_k) * sizeof(float));
  moe_outputs_free(out, n_out);
}

static void expect_ids(const int32_t *got, const int32_t *want, int n) {
  for (int i = 0; i < n; i++)
    ck_assert_msg(got[i] == want[i], "id %d: got %d, want %d", i, got[i], want[i]);
}

/* Weights are specified bit-exactly: compare bits. */
static void expect_weights(const float *got, const float *want, int n) {
  for (int i = 0; i < n; i++)
    ck_assert_msg(moe_f32_bits(got[i]) == moe_f32_bits(want[i]), "weight %d: got %.9g, want %.9g", i, got[i],
                  want[i]);
}

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* ---- softmax, ties, renormalize, scale ------------------------------------------ */

START_TEST(softmax_ties_to_lower_index) {
  const float logits[4] = {1, 3, 2, 3};
  routing_req r = {logits, 1, 4, NULL, 2, NULL, -1, 0, 0, 0};
  int32_t ids[2];
  float w[2];
  route(&r, ids, w);
  /* experts 1 and 3 tie at the top: lower index first */
  expect_ids(ids, (const int32_t[]){1, 3}, 2);
  /* softmax: exp(x - max) summed in index order, each divided by the sum */
  const float e0 = expf(1.0f - 3.0f), e1 = expf(0.0f), e2 = expf(2.0f - 3.0f), e3 = expf(0.0f);
  const float sum = ((e0 + e1) + e2) + e3;
  expect_weights(w, (const float[]){e1 / sum, e3 / sum}, 2);
}
END_TEST

START_TEST(all_equal_logits) {
  const float logits[2 * 4] = {0, 0, 0, 0, -2, -2, -2, -2};
  routing_req r = {logits, 2, 4, NULL, 3, "softmax", 0, 0, 0, 0};
  int32_t ids[6];
  float w[6];
  route(&r, ids, w);
  expect_ids(ids, (const int32_t[]){0, 1, 2, 0, 1, 2}, 6);
  expect_weights(w, (const float[]){0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f}, 6);
}
END_TEST

START_TEST(sigmoid_renormalize_scale) {
  const float logits[4] = {0, 2, -1, 1};
  int32_t ids[2];
  float w[2];
  const float s1 = sigmoid(2.0f), s3 = sigmoid(1.0f);
  routing_req r = {logits, 1, 4, NULL, 2, "sigmoid", -1, 0, 0, 0};
  route(&r, ids, w);
  expect_ids(ids, (const int32_t[]){1, 3}, 2);
  expect_weights(w, (const float[]){s1, s3}, 2);

  r.renormalize = 1;
  route(&r, ids, w);
  const float sum = s1 + s3;
  expect_weights(w, (const float[]){s1 / sum, s3 / sum}, 2);

  r.scale = 2.5; /* applied after renormalization, always */
  route(&r, ids, w);
  expect_weights(w, (const float[]){(s1 / sum) * 2.5f, (s3 / sum) * 2.5f}, 2);

  r.renormalize = 0;
  route(&r, ids, w);
  expect_weights(w, (const float[]){s1 * 2.5f, s3 * 2.5f}, 2);
}
END_TEST

START_TEST(bias_chooses_weights_unbiased) {
  const float logits[3] = {2, 0, 1};
  const float bias[3] = {0, 5, 0};
  routing_req r = {logits, 1, 3, bias, 2, "sigmoid", -1, 0, 0, 0};
  int32_t ids[2];
  float w[2];
  route(&r, ids, w);
  /* keys: sig(2), 0.5 + 5, sig(1): expert 1 first, then 0 */
  expect_ids(ids, (const int32_t[]){1, 0}, 2);
  expect_weights(w, (const float[]){0.5f, sigmoid(2.0f)}, 2);
  r.renormalize = 1;
  route(&r, ids, w);
  const float sum = 0.5f + sigmoid(2.0f);
  expect_weights(w, (const float[]){0.5f / sum, sigmoid(2.0f) / sum}, 2);
}
END_TEST

START_TEST(half_precision_logits) {
  /* fp16/bf16 logits are widened exactly: same routing as their fp32 values */
  const float vals[4] = {0.5f, -1.25f, 3.0f, 0.5f};
  uint16_t h[4], b[4];
  for (int i = 0; i < 4; i++) {
    h[i] = moe_f32_to_f16(vals[i]);
    b[i] = moe_f32_to_bf16(vals[i]);
  }
  int32_t want_ids[2];
  float want_w[2];
  routing_req r = {vals, 1, 4, NULL, 2, NULL, -1, 0, 0, 0};
  route(&r, want_ids, want_w);
  expect_ids(want_ids, (const int32_t[]){2, 0}, 2);
  const moe_dtype types[2] = {MOE_F16, MOE_BF16};
  const uint16_t *data[2] = {h, b};
  for (int i = 0; i < 2; i++) {
    moe_named_tensor in = {"router_logits", {types[i], 2, {1, 4}, (void *)data[i], sizeof h}};
    moe_param p = {.name = "top_k", .type = MOE_PARAM_INT, .i = 2};
    moe_params params = {&p, 1};
    moe_named_tensor *out;
    size_t n;
    moe_error err;
    ck_assert_int_eq(moe_run_host("moe.topk", &in, 1, &params, NULL, &out, &n, &err), MOE_OK);
    expect_ids(out[0].tensor.data, want_ids, 2);
    expect_weights(out[1].tensor.data, want_w, 2);
    moe_outputs_free(out, n);
  }
}
END_TEST

/* ---- grouped routing -------------------------------------------------------------- */

START_TEST(grouped_keeps_best_group) {
  /* 8 experts in 4 groups of 2. Ungrouped top-2 would be {0, 2}; with one
   * group kept (group 0, max 5) the choice stays inside it. */
  const float logits[8] = {5, 1, 4.9f, 0, 0, 0, 0, 0};
  routing_req r = {logits, 1, 8, NULL, 2, "softmax", -1, 4, 1, 0};
  int32_t ids[2];
  float w[2];
  route(&r, ids, w);
  expect_ids(ids, (const int32_t[]){0, 1}, 2);
  /* the weights are still the softmax over all 8 experts */
  float e[8], sum = 0.0f;
  for (int i = 0; i < 8; i++) {
    e[i] = expf(logits[i] - 5.0f);
    sum += e[i];
  }
  expect_weights(w, (const float[]){e[0] / sum, e[1] / sum}, 2);

  r.groups = 0; /* ungrouped, for contrast */
  route(&r, ids, w);
  expect_ids(ids, (const int32_t[]){0, 2}, 2);

  r.groups = 4; /* two groups kept: groups 0 and 1 (max 4.9) */
  r.topk_group = 2;
  route(&r, ids, w);
  expect_ids(ids, (const int32_t[]){0, 2}, 2);
}
END_TEST

START_TEST(grouped_group_ties_to_lower_group) {
  /* groups 1 and 2 tie at max 3; one group kept: group 1 */
  const float logits[6] = {1, 0, 3, 2, 2.5f, 3};
  routing_req r = {logits, 1, 6, NULL, 2, "sigmoid", -1, 3, 1, 0};
  int32_t ids[2];
  float w[2];
  route(&r, ids, w);
  expect_ids(ids, (const int32_t[]){2, 3}, 2);
  expect_weights(w, (const float[]){sigmoid(3.0f), sigmoid(2.0f)}, 2);
}
END_TEST

START_TEST(grouped_with_bias_sums_top_two) {
  /* sigmoid(0) = 0.5 exactly, so the bias sets the keys: 0.5 + bias.
   * Keys [0.9, 0.1 | 0.6, 0.6 | 0.5, 0.5 | 0.2, 0.1]: group 0 has the best
   * max (0.9), but with a bias groups score the sum of their top two
   * (DeepSeek-V3): 1.0, 1.2, 1.0, 0.3, so group 1 is kept. */
  const float logits[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const float bias[8] = {0.4f, -0.4f, 0.1f, 0.1f, 0.0f, 0.0f, -0.3f, -0.4f};
  routing_req r = {logits, 1, 8, bias, 2, "sigmoid", -1, 4, 1, 0};
  int32_t ids[2];
  float w[2];
  route(&r, ids, w);
  expect_ids(ids, (const int32_t[]){2, 3}, 2); /* tie inside the group: lower index */
  expect_weights(w, (const float[]){0.5f, 0.5f}, 2);

  /* two groups kept: 1 (1.2) and 0 (1.0, ties group 2 and wins by index) */
  r.topk_group = 2;
  route(&r, ids, w);
  expect_ids(ids, (const int32_t[]){0, 2}, 2);

  r.topk_group = 1;
  r.renormalize = 1;
  r.scale = 2.5;
  route(&r, ids, w);
  expect_weights(w, (const float[]){(0.5f / 1.0f) * 2.5f, (0.5f / 1.0f) * 2.5f}, 2);
}
END_TEST

START_TEST(grouped_without_bias_uses_max) {
  /* the same keys as above, as logits of sigmoid scores without a bias:
   * groups score their max, so group 0 (max) is kept */
  float logits[8];
  const float keys[8] = {0.9f, 0.1f, 0.6f, 0.6f, 0.5f, 0.5f, 0.2f, 0.1f};
  for (int i = 0; i < 8; i++)
    logits[i] = logf(keys[i] / (1.0f - keys[i]));
  routing_req r = {logits, 1, 8, NULL, 2, "sigmoid", -1, 4, 1, 0};
  int32_t ids[2];
  float w[2];
  route(&r, ids, w);
  expect_ids(ids, (const int32_t[]){0, 1}, 2);
  expect_weights(w, (const float[]){sigmoid(logits[0]), sigmoid(logits[1])}, 2);
}
END_TEST

START_TEST(rows_are_independent) {
  /* many rows: each equals the row routed alone */
  enum { T = 37, E = 16, K = 4 };
  float logits[T * E];
  uint32_t state = 12345;
  for (int i = 0; i < T * E; i++) {
    state = state * 1664525u + 1013904223u;
    logits[i] = (float)(state >> 8) / (float)(1u << 24) * 8.0f - 4.0f;
  }
  routing_req r = {logits, T, E, NULL, K, "softmax", 1, 4, 2, 1.5};
  int32_t ids[T * K];
  float w[T * K];
  route(&r, ids, w);
  for (int t = 0; t < T; t += 5) {
    routing_req one = r;
    one.logits = logits + t * E;
    one.tokens = 1;
    int32_t id1[K];
    float w1[K];
    route(&one, id1, w1);
    expect_ids(id1, ids + t * K, K);
    expect_weights(w1, w + t * K, K);
  }
}
END_TEST

/* ---- bad input -------------------------------------------------------------------- */

static void expect_einval(const moe_named_tensor *in, size_t n_in, const moe_param *items, size_t n_items,
                          const char *needle) {
  moe_params params = {items, n_items};
  moe_named_tensor *out = NULL;
  size_t n_out = 0;
  moe_error err = {{0}};
  moe_status s = moe_run_host("moe.topk", in, n_in, &params, NULL, &out, &n_out, &err);
  ck_assert_msg(s == MOE_EINVAL, "expected EINVAL for '%s', got %d (%s)", needle, s, err.msg);
  ck_assert_msg_has(err, needle);
}

START_TEST(bad_inputs) {
  float logits[2 * 6] = {0};
  float bias[6] = {0};
  int32_t ints[12] = {0};
  const moe_named_tensor good = {"router_logits", f32_tensor(logits, 2, 2, 6)};
  const moe_param k2 = {.name = "top_k", .type = MOE_PARAM_INT, .i = 2};
  moe_named_tensor in[2];
  moe_param p[4];

  in[0] = good; /* top_k missing */
  expect_einval(in, 1, NULL, 0, "top_k");
  p[0] = k2;
  p[0].i = 0;
  expect_einval(in, 1, p, 1, "top_k");
  p[0].i = 7;
  expect_einval(in, 1, p, 1, "top_k");
  p[0] = (moe_param){.name = "top_k", .type = MOE_PARAM_STRING, .s = "two"};
  expect_einval(in, 1, p, 1, "top_k");

  p[0] = k2; /* logits: dtype, rank, bytes */
  in[0] = good;
  in[0].tensor.dtype = MOE_INT32;
  in[0].tensor.data = ints;
  in[0].tensor.nbytes = sizeof ints;
  expect_einval(in, 1, p, 1, "router_logits");
  in[0] = good;
  in[0].tensor.ndim = 1;
  in[0].tensor.shape[0] = 12;
  expect_einval(in, 1, p, 1, "router_logits");
  in[0] = good;
  in[0].tensor.nbytes -= 4;
  expect_einval(in, 1, p, 1, "router_logits");

  in[0] = good; /* bias: shape, dtype */
  in[1] = (moe_named_tensor){"correction_bias", f32_tensor(bias, 1, 5, 0)};
  expect_einval(in, 2, p, 1, "correction_bias");
  in[1] = (moe_named_tensor){"correction_bias", {MOE_INT32, 1, {6}, ints, 6 * sizeof(int32_t)}};
  expect_einval(in, 2, p, 1, "correction_bias");
  in[1] = (moe_named_tensor){"bias", f32_tensor(bias, 1, 6, 0)};
  expect_einval(in, 2, p, 1, "bias");

  p[1] = (moe_param){.name = "scoring", .type = MOE_PARAM_STRING, .s = "relu"};
  expect_einval(in, 1, p, 2, "scoring");
  p[1] = (moe_param){.name = "routed_scaling_factor", .type = MOE_PARAM_DOUBLE, .d = -1.0};
  expect_einval(in, 1, p, 2, "routed_scaling_factor");
  p[1].d = 1e300; /* not finite in fp32 */
  expect_einval(in, 1, p, 2, "routed_scaling_factor");

  /* grouping: E % G, topk_group range, top_k beyond the kept experts */
  p[1] = (moe_param){.name = "num_expert_group", .type = MOE_PARAM_INT, .i = 4};
  p[2] = (moe_param){.name = "topk_group", .type = MOE_PARAM_INT, .i = 1};
  expect_einval(in, 1, p, 3, "num_expert_group");
  p[1].i = 3;
  p[2].i = 0;
  expect_einval(in, 1, p, 3, "topk_group");
  p[2].i = 4;
  expect_einval(in, 1, p, 3, "topk_group");
  p[0].i = 3; /* 3 groups of 2, one kept: at most 2 experts */
  p[2].i = 1;
  expect_einval(in, 1, p, 3, "top_k");
}
END_TEST

static Suite *topk_suite(void) {
  Suite *s = suite_create("moe.topk");
  TCase *tc = tcase_create("routing");
  tcase_add_test(tc, softmax_ties_to_lower_index);
  tcase_add_test(tc, all_equal_logits);
  tcase_add_test(tc, sigmoid_renormalize_scale);
  tcase_add_test(tc, bias_chooses_weights_unbiased);
  tcase_add_test(tc, half_precision_logits);
  tcase_add_test(tc, grouped_keeps_best_group);
  tcase_add_test(tc, grouped_group_ties_to_lower_group);
  tcase_add_test(tc, grouped_with_bias_sums_top_two);
  tcase_add_test(tc, grouped_without_bias_uses_max);
  tcase_add_test(tc, rows_are_independent);
  tcase_add_test(tc, bad_inputs);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(topk_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
