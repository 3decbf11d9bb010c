/* GPU: moe.topk (docs/numerics.md "moe.topk"), also fused_moe's routing step
 * (moe_gpu_route). One block per row; the row mirrors the CPU's
 * (kernels/cpu/topk.c) operation for operation, so that ids are the same and
 * weights the same up to exp:
 *
 * - exp is computed in double and rounded once to fp32, which is the
 *   correctly rounded expf except (in theory) for a handful of inputs. The
 *   CPU calls glibc's expf, which is correctly rounded except on a small
 *   documented set of inputs (about 1e-4 of them, never off by more than one
 *   ulp). So scores and keys are bit-identical to the CPU's except where
 *   glibc misrounds; only then can two keys within one ulp of each other
 *   order differently (the GPU's order is then the one of the correctly
 *   rounded scores). The GPU test checks ids exactly and weights to 1e-6.
 *   (CUDA's own expf has up to 2 ulp error and differs from glibc far more
 *   often, which would flip near-ties in practice.)
 * - every sum runs in the CPU's order (index order, one thread), every
 *   choice uses the CPU's order (value descending, NaN loses, ties to the
 *   lower index): a parallel argmax under that total order finds the same
 *   element as the CPU's sequential scan.
 * Built without FMA contraction (MOE_GPU_EXACT_KERNELS). Warp size 32 or 64:
 * the cross-thread steps go through shared memory only. */
#include "gpu.h"

extern "C" {
#include "../ops/op.h"
}

namespace {

constexpr int THREADS = 64; /* one wavefront on AMD, two warps on NVIDIA */

__device__ __forceinline__ float exp_cr(float x) { return (float)exp((double)x); }

/* a beats b: larger, or a number against NaN (kernels/cpu/topk.c beats()). */
__device__ __forceinline__ bool beats(float a, float b) {
  return a > b || (moe_f32_isnan(b) && !moe_f32_isnan(a));
}

/* (av, ai) comes first in the order of every choice; index -1: none. */
__device__ __forceinline__ bool first(float av, int ai, float bv, int bi) {
  if (ai < 0) return false;
  if (bi < 0) return true;
  return beats(av, bv) || (!beats(bv, av) && ai < bi);
}

__device__ __forceinline__ float load_logit(const void *p, int dt, size_t i) {
  if (dt == MOE_F16) return moe_f16_to_f32(((const uint16_t *)p)[i]);
  if (dt == MOE_BF16) return moe_bf16_to_f32(((const uint16_t *)p)[i]);
  return ((const float *)p)[i];
}

struct route_params {
  int scoring, renormalize, has_bias;
  int groups, topk_group, top_k;
  float scale;
};

/* Index of the best eligible entry of v[0..n) but `skip`, -1 when none
 * (sequential, the CPU's best_of). */
__device__ int best_of(const float *v, const unsigned char *eligible, int n, int skip) {
  int best = -1;
  for (int i = 0; i < n; i++)
    if (eligible[i] && i != skip && (best < 0 || beats(v[i], v[best]))) best = i;
  return best;
}

__global__ void __launch_bounds__(THREADS) route_kernel(const void *logits, int dt, int E, const float *bias,
                                                        route_params p, int32_t *ids_out, float *w_out) {
  extern __shared__ float smem[];
  float *score = smem, *key = score + E, *gscore = key + E;
  unsigned char *eligible = (unsigned char *)(gscore + E), *unchosen = eligible + E;
  __shared__ float red_v[THREADS];
  __shared__ int red_i[THREADS];
  __shared__ float total;
  const int tid = (int)threadIdx.x;
  const size_t row = blockIdx.x;
  const size_t base = row * (size_t)E;

  for (int e = tid; e < E; e += THREADS)
    score[e] = load_logit(logits, dt, base + (size_t)e);
  if (p.scoring == MOE_SCORING_SIGMOID) {
    for (int e = tid; e < E; e += THREADS)
      score[e] = 1.0f / (1.0f + exp_cr(-score[e]));
  } else {
    /* max: NaN never compares greater, so it is skipped (as on the CPU); the
     * sign of a zero maximum cannot change exp(x - m) */
    float m = -INFINITY;
    for (int e = tid; e < E; e += THREADS)
      if (score[e] > m) m = score[e];
    red_v[tid] = m;
    __syncthreads();
    if (tid == 0) {
      float mm = -INFINITY;
      for (int i = 0; i < THREADS; i++)
        if (red_v[i] > mm) mm = red_v[i];
      red_v[0] = mm;
    }
    __syncthreads();
    m = red_v[0];
    for (int e = tid; e < E; e += THREADS)
      score[e] = exp_cr(score[e] - m);
    __syncthreads();
    if (tid == 0) { /* summed in index order, as on the CPU */
      float sum = 0.0f;
      for (int e = 0; e < E; e++)
        sum += score[e];
      total = sum;
    }
    __syncthreads();
    const float sum = total;
    for (int e = tid; e < E; e += THREADS)
      score[e] = score[e] / sum;
  }
  for (int e = tid; e < E; e += THREADS) {
    key[e] = p.has_bias ? score[e] + bias[e] : score[e];
    eligible[e] = 1;
  }
  __syncthreads();
  if (p.groups > 1) { /* keep the topk_group best groups (kernels/cpu/topk.c keep_best_groups) */
    const int per = E / p.groups;
    for (int g = tid; g < p.groups; g += THREADS) {
      const float *k = key + g * per;
      const int a = best_of(k, eligible + g * per, per, -1);
      float s = k[a];
      if (p.has_bias && per > 1) s = s + k[best_of(k, eligible + g * per, per, a)];
      gscore[g] = s;
      unchosen[g] = 1;
    }
    __syncthreads();
    if (tid == 0)
      for (int i = 0; i < p.topk_group; i++)
        unchosen[best_of(gscore, unchosen, p.groups, -1)] = 0;
    __syncthreads();
    for (int e = tid; e < E; e += THREADS)
      eligible[e] = !unchosen[e / per];
    __syncthreads();
  }
  /* top-k: k block-wide argmaxes under the total order of first() */
  for (int i = 0; i < p.top_k; i++) {
    float bv = 0.0f;
    int bi = -1;
    for (int e = tid; e < E; e += THREADS)
      if (eligible[e] && first(key[e], e, bv, bi)) {
        bv = key[e];
        bi = e;
      }
    red_v[tid] = bv;
    red_i[tid] = bi;
    __syncthreads();
    if (tid == 0) {
      for (int t = 1; t < THREADS; t++)
        if (first(red_v[t], red_i[t], bv, bi)) {
          bv = red_v[t];
          bi = red_i[t];
        }
      eligible[bi] = 0; /* eligible count >= top_k: checked in prepare */
      red_i[0] = bi;
    }
    __syncthreads();
    if (tid == 0) {
      ids_out[row * (size_t)p.top_k + (size_t)i] = red_i[0];
      w_out[row * (size_t)p.top_k + (size_t)i] = score[red_i[0]];
    }
    __syncthreads();
  }
  if (tid == 0) { /* the CPU's order: renormalize in k order, then scale */
    float *w = w_out + row * (size_t)p.top_k;
    if (p.renormalize) {
      float sum = 0.0f;
      for (int i = 0; i < p.top_k; i++)
        sum += w[i];
      for (int i = 0; i < p.top_k; i++)
        w[i] = w[i] / sum;
    }
    for (int i = 0; i < p.top_k; i++)
      w[i] = w[i] * p.scale;
  }
}

} // namespace

extern "C" moe_status moe_gpu_route(moe_backend *b, const moe_tensor *logits, const float *bias,
                                    const moe_routing *r, int32_t *ids, float *weights, moe_error *err) {
  const int64_t T = logits->shape[0], E = logits->shape[1];
  if (T == 0) return MOE_OK;
  /* score, key, group scores (fp32) and two flag bytes per expert */
  const size_t smem = (size_t)E * (3 * sizeof(float) + 2);
  if (smem > 40 * 1024 || T > 0x7FFFFFFF)
    return moe_fail(err, MOE_EUNSUPPORTED,
                    "moe.topk on the GPU: at most 3400 experts and 2^31 - 1 rows (got %lld x %lld)",
                    (long long)T, (long long)E);
  route_params p;
  p.scoring = (int)r->scoring;
  p.renormalize = r->renormalize;
  p.has_bias = bias != NULL;
  p.groups = (int)r->num_expert_group;
  p.topk_group = (int)r->topk_group;
  p.top_k = (int)r->top_k;
  p.scale = (float)r->routed_scaling_factor;
  route_kernel<<<(unsigned)T, THREADS, smem, moe_gpu_stream(b)>>>(logits->data, (int)logits->dtype, (int)E,
                                                                  bias, p, ids, weights);
  return moe_gpu_check(hipGetLastError(), "moe.topk", err);
}

extern "C" moe_status moe_gpu_topk(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_tensor *bias = moe_call_in(c, 1);
  return moe_gpu_route(b, &c->in[0].tensor, bias ? (const float *)bias->data : NULL, &c->args.topk.routing,
                       (int32_t *)c->out[0].tensor.data, (float *)c->out[1].tensor.data, err);
}
