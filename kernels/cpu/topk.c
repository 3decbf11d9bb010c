/* moe.topk on the CPU (docs/numerics.md "moe.topk"): each row routed on its own,
 * in fp32, with every choice ordered by (value descending, index ascending). */
#include <math.h>
#include <stdbool.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "../ops/op.h"
#include "cpu.h"
#include "topk.h"

/* Scratch of one row: scores, keys and group scores (fp32; at most E
 * groups), then two flag bytes per expert (eligible; group still unchosen). */
size_t moe_cpu_route_scratch_bytes(int64_t num_experts) {
  return (size_t)num_experts * (3 * sizeof(float) + 2);
}

/* The order of every choice: a beats b when larger; NaN loses to any number,
 * and equal values keep the earlier (lower-index) candidate, because callers
 * scan in index order and replace only on a strict win. */
static inline bool beats(float a, float b) { return a > b || (isnan(b) && !isnan(a)); }

/* Index of the best eligible entry of v[0..n), -1 when none is eligible. */
static int64_t best_of(const float *v, const unsigned char *eligible, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; i++)
    if (eligible[i] && (best < 0 || beats(v[i], v[best]))) best = i;
  return best;
}

static void score_row(const moe_routing *r, const moe_tensor *logits, int64_t t, float *score) {
  const int64_t e_count = logits->shape[1];
  const size_t base = (size_t)t * (size_t)e_count;
  for (int64_t e = 0; e < e_count; e++)
    score[e] = moe_load_float(logits->data, logits->dtype, base + (size_t)e);
  if (r->scoring == MOE_SCORING_SIGMOID) {
    for (int64_t e = 0; e < e_count; e++)
      score[e] = 1.0f / (1.0f + expf(-score[e]));
    return;
  }
  /* softmax: max-subtracted, summed in index order, each divided by the sum */
  float m = -INFINITY, sum = 0.0f;
  for (int64_t e = 0; e < e_count; e++)
    if (score[e] > m) m = score[e];
  for (int64_t e = 0; e < e_count; e++) {
    score[e] = expf(score[e] - m);
    sum += score[e];
  }
  for (int64_t e = 0; e < e_count; e++)
    score[e] = score[e] / sum;
}

/* Grouped routing: clears eligible[e] for experts outside the topk_group best
 * groups. A group scores its best key, or with a correction bias the sum of
 * its two best keys (DeepSeek-V3; a group of one expert scores that key). */
static void keep_best_groups(const moe_routing *r, int64_t e_count, const float *key, bool has_bias,
                             float *group_score, unsigned char *unchosen, unsigned char *eligible) {
  const int64_t groups = r->num_expert_group, per = e_count / groups;
  for (int64_t g = 0; g < groups; g++) {
    const float *k = key + g * per;
    unsigned char *el = eligible + g * per;
    int64_t first = best_of(k, el, per);
    float s = k[first];
    if (has_bias && per > 1) {
      el[first] = 0;
      s = s + k[best_of(k, el, per)];
      el[first] = 1;
    }
    group_score[g] = s;
  }
  memset(unchosen, 1, (size_t)groups);
  for (int64_t i = 0; i < r->topk_group; i++)
    unchosen[best_of(group_score, unchosen, groups)] = 0;
  for (int64_t e = 0; e < e_count; e++)
    eligible[e] = !unchosen[e / per];
}

void moe_cpu_route_row(const moe_routing *r, const moe_tensor *logits, int64_t t, const float *bias,
                       void *scratch, int32_t *ids, float *weights) {
  const int64_t e_count = logits->shape[1];
  float *score = scratch, *key = score + e_count, *group_score = key + e_count;
  unsigned char *eligible = (unsigned char *)(group_score + e_count), *unchosen = eligible + e_count;
  score_row(r, logits, t, score);
  /* a bias chooses the experts; the weights stay the unbiased scores */
  for (int64_t e = 0; e < e_count; e++)
    key[e] = bias ? score[e] + bias[e] : score[e];
  memset(eligible, 1, (size_t)e_count);
  if (r->num_expert_group > 1)
    keep_best_groups(r, e_count, key, bias != NULL, group_score, unchosen, eligible);
  for (int64_t i = 0; i < r->top_k; i++) {
    int64_t e = best_of(key, eligible, e_count); /* eligible count >= top_k: checked in prepare */
    eligible[e] = 0;
    ids[i] = (int32_t)e;
    weights[i] = score[e];
  }
  if (r->renormalize) {
    float sum = 0.0f;
    for (int64_t i = 0; i < r->top_k; i++)
      sum += weights[i];
    for (int64_t i = 0; i < r->top_k; i++)
      weights[i] = weights[i] / sum;
  }
  const float scale = (float)r->routed_scaling_factor;
  for (int64_t i = 0; i < r->top_k; i++)
    weights[i] = weights[i] * scale;
}

moe_status moe_cpu_topk(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_topk_args *a = &c->args.topk;
  const moe_tensor *logits = moe_call_in(c, 0), *bias = moe_call_in(c, 1);
  const int64_t tokens = logits->shape[0], k = a->routing.top_k;
  int32_t *ids = c->out[0].tensor.data;
  float *weights = c->out[1].tensor.data;
  if (tokens == 0) return MOE_OK;
  /* one scratch per thread, 64-byte apart so threads never share a line */
  const size_t per_thread = (moe_cpu_route_scratch_bytes(logits->shape[1]) + 63) & ~(size_t)63;
  /* routing costs ~E operations a token: count them as the work */
  int threads = moe_cpu_threads_for(b, (size_t)tokens * (size_t)logits->shape[1]);
  if ((int64_t)threads > tokens) threads = (int)tokens;
  size_t bytes;
  if (!moe_mul_size(per_thread, (size_t)threads, &bytes))
    return moe_fail(err, MOE_EOVERFLOW, "router_logits: scratch size overflows");
  unsigned char *ws = moe_cpu_workspace(b, bytes);
  if (!ws) return moe_fail(err, MOE_ENOMEM, "moe.topk: out of memory for %zu bytes of scratch", bytes);
  const float *bias_data = bias ? bias->data : NULL;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t t = 0; t < tokens; t++) {
#ifdef _OPENMP
    unsigned char *scratch = ws + (size_t)omp_get_thread_num() * per_thread;
#else
    unsigned char *scratch = ws;
#endif
    moe_cpu_route_row(&a->routing, logits, t, bias_data, scratch, ids + t * k, weights + t * k);
  }
  return MOE_OK;
}
