/* Internal to kernels/gpu/: what fused_moe.hip (the pipeline and the
 * portable GEMM) and fused_moe_tc.hip (the tensor-core GEMM, NVIDIA sm_80+)
 * share: the activation dtype helpers, docs/numerics.md's activation epilogue,
 * and the tensor-core path's entry points. HIP/CUDA C++ only. */
#ifndef MOE_GPU_FUSED_MOE_GPU_H
#define MOE_GPU_FUSED_MOE_GPU_H

#include "gpu.h"
#include "moe/codec.h"

extern "C" {
#include "../ops/op.h"
}

enum { A_BF16, A_F16 };

/* v rounded to the activation dtype (RNE, overflow to inf), as a float.
 * On NVIDIA sm_80+ one cvt each way: the same bits as the codec's
 * conversions for every non-NaN v (a NaN stays a NaN; only to16, below,
 * fixes its bits). The codec's integer sequence made the gate_up epilogue
 * of the bulk GEMM instruction-bound (a quarter of the kernel at T = 4096). */
#if defined(MOE_GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MOE_GPU_CVT16 1
/* the hardware's conversion: v's bits in the activation dtype */
template <int ACT> __device__ __forceinline__ unsigned short cvt16(float v) {
  unsigned short h;
  if (ACT == A_BF16)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
#endif
template <int ACT> __device__ __forceinline__ float act_round(float v) {
#if defined(MOE_GPU_CVT16)
  const unsigned short h = cvt16<ACT>(v);
  if (ACT == A_BF16) return moe_f32_from_bits((uint32_t)h << 16);
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
  return r;
#else
  return ACT == A_BF16 ? moe_bf16_to_f32(moe_f32_to_bf16(v)) : moe_f16_to_f32(moe_f32_to_f16(v));
#endif
}
template <int ACT> __device__ __forceinline__ uint16_t to16(float v) {
#if defined(MOE_GPU_CVT16)
  /* as act_round; a NaN gets the codec's bits by a select */
  const unsigned short h = cvt16<ACT>(v);
  return moe_f32_isnan(v) ? (ACT == A_BF16 ? (uint16_t)0x7FC0 : (uint16_t)0x7E00) : (uint16_t)h;
#else
  return ACT == A_BF16 ? moe_f32_to_bf16(v) : moe_f32_to_f16(v);
#endif
}
template <int ACT> __device__ __forceinline__ float from16(uint32_t h) {
  return ACT == A_BF16 ? moe_bf16_to_f32((uint16_t)h) : moe_f16_to_f32((uint16_t)h);
}

/* exp and erf in fp32 (CUDA's and HIP's accurate expf/erff: within 2 ulp
 * of libm's, far inside docs/numerics.md's tolerance; rounding from double cost
 * a tenth of a large gate_up GEMM in fp64 work). */
__device__ __forceinline__ float exp_f(float x) { return expf(x); }
__device__ __forceinline__ float erf_f(float x) { return erff(x); }

/* a / b for b = 1 + exp(x) (>= 1 or inf): docs/numerics.md's correctly
 * rounded fp32 division. On NVIDIA the sequence of the fast path of CUDA's
 * IEEE division (a reciprocal estimate refined once, the quotient corrected
 * once by its exact residual), correctly rounded whenever a, 1 / b and the
 * quotient are normal (b < 2^126: for silu, g > -87), without that
 * division's operand check and branch to its slow path: the branch cut the
 * gate_up epilogue's 32 independent elements per thread into one
 * latency-bound chain. At the extremes (a subnormal quotient, b >= 2^126)
 * the result is within a few ulp; b = inf gives the division's signed
 * zero, a = +-inf the division's +-inf. */
__device__ __forceinline__ float div_ge1(float a, float b) {
#if defined(MOE_GPU_CUDA) && defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(b));
  r = fmaf(fmaf(-b, r, 1.0f), r, r);
  const float q = a * r, q1 = fmaf(fmaf(-b, q, a), r, q);
  return b == INFINITY ? copysignf(0.0f, a) : isinf(a) ? q : q1;
#else
  return a / b;
#endif
}

/* docs/numerics.md: a = act(act(f(g)) * u), or swiglu_oai; g and u act-rounded.
 * The CPU's expressions (kernels/cpu/fused_moe.c activate()). */
template <int ACT> __device__ __forceinline__ float activate(int fn, float g, float u) {
  if (fn == MOE_ACT_GELU)
    return act_round<ACT>(act_round<ACT>(0.5f * g * (1.0f + erf_f(g * 0.70710678118654752f))) * u);
  if (fn == MOE_ACT_SWIGLU_OAI) {
    g = g > 7.0f ? 7.0f : g;
    u = u > 7.0f ? 7.0f : (u < -7.0f ? -7.0f : u);
    return act_round<ACT>((u + 1.0f) * g * div_ge1(1.0f, 1.0f + exp_f(-(1.702f * g))));
  }
  return act_round<ACT>(act_round<ACT>(div_ge1(g, 1.0f + exp_f(-g))) * u);
}

/* ---- programmatic dependent launch (NVIDIA sm_90+) ------------------------------
 * fused_moe's kernels after routing (align, the two GEMMs, the sum) are
 * launched so that each is launched while the one before it finishes
 * (its launch latency hidden). Each calls pdl_wait() before it reads or
 * writes any buffer (until then it computes indices only): that waits for
 * the kernel before it to complete with its memory visible. Each calls
 * pdl_next() once its main work is done (before its last stores, which
 * the next kernel's pdl_wait still waits for): the next kernel launches when
 * every block has, so that its blocks find the SMs mostly free and spread
 * over them (a trigger at the start let a small grid pile onto the SMs that
 * freed first: Mixtral T=1 down 11% slower). A kernel launched plainly
 * passes pdl_wait at once; on AMD or before sm_90 both are empty;
 * MOE_GPU_PDL=0 launches every kernel plainly. */
__device__ __forceinline__ void pdl_wait() {
#if defined(MOE_GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_next() {
#if defined(MOE_GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
/* Whether b's launches overlap this way (sm_90+, not turned off). */
bool moe_gpu_pdl(moe_backend *b);
/* k<<<grid, block, smem, st>>>(args...), overlapping the kernel before it
 * when pdl, in clusters of `cluster` blocks along x (NVIDIA; 1: none). */
template <typename... P, typename... A>
hipError_t pdl_launch(bool pdl, unsigned cluster, void (*k)(P...), dim3 grid, dim3 block, size_t smem,
                      hipStream_t st, A &&...args) {
#if defined(MOE_GPU_CUDA)
  if (pdl || cluster > 1) {
    cudaLaunchAttribute attr[2];
    unsigned n = 0;
    if (pdl) {
      attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[n++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster > 1) {
      attr[n].id = cudaLaunchAttributeClusterDimension;
      attr[n].val.clusterDim.x = cluster;
      attr[n].val.clusterDim.y = 1;
      attr[n++].val.clusterDim.z = 1;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = n;
    return cudaLaunchKernelEx(&cfg, k, static_cast<A &&>(args)...);
  }
#endif
  (void)cluster;
  (void)pdl;
  k<<<grid, block, smem, st>>>(static_cast<A &&>(args)...);
  return hipGetLastError();
}

/* ---- the tensor-core path (fused_moe_tc.hip) ----------------------------------- */

/* Tile configurations of the tensor-core GEMM (token rows per tile BT):
 * a launch choice from the batch only; every one computes each output
 * element with the same instruction sequence (fused_moe_tc.hip's header). */
int moe_tc_rows(int config);      /* BT of a configuration */
int moe_tc_bulk_rows(int config); /* BT of the bulk path (moe_tc_bulk) in a configuration */
/* The configuration for a batch of `avg` slots per routed expert on b:
 * the tuned table's where it has the device and set (fused_moe_tuned.h),
 * else a default by weight kind (measured on the H200: bench/RESULTS.md) */
int moe_tc_choose(moe_backend *b, const moe_expert_config *cfg, int64_t avg);
/* K segments of the down GEMM (1: none): a property of the set's shape and
 * scheme only, never of the batch, so a token's sums are the same fold
 * whatever came with it (docs/gpu-kernels.md "Batch invariance"). */
int moe_tc_split(const moe_expert_config *cfg);

/* One GEMM of the pipeline on packed weights (moe_gpu_fused_pack). */
struct TcArgs {
  const uint8_t *w;    /* packed weights */
  const float *scale;  /* packed scales [E][groups][N]: fp32 (wna16), e8m0 bytes (mxfp4) */
  const uint8_t *zero; /* wna16 with zero points: packed [E][groups][N]; NULL: the midpoint */
  int n, k, groups, group;
  int scale16;   /* the set's scales are in the activation dtype: 16-bit dequant */
  int phase;     /* 1: gate_up -> a; 2: down -> y */
  const void *x; /* phase 1: hidden_states [T, H]; phase 2: a [slots, I] */
  int x_vec;     /* x 16-byte aligned: cp.async rows */
  int inter, hidden, top_k, activation;
  const int *sorted, *ntiles;
  const int4 *tiles;
  /* gate_up of a batch of at most 32 slots (tensor-core decode tiles,
   * 16-bit weights): no align kernel; every block derives its tile from the ids and
   * block 0 writes sorted, tiles and ntiles for down (tiny_align). NULL:
   * the align kernel wrote them. */
  const int32_t *ids;
  int nids, el, offset;
  const float *tw;
  uint16_t *out;
  int cap;     /* the bulk path (moe_tc_bulk): rows of the K-major buffers (phase 1's x and out, phase 2's x);
                * 0: the generic kernel, row-major buffers */
  int bt;      /* the bulk path: rows per tile (moe_tc_bulk_rows) */
  int *next;   /* the bulk path: the persistent kernel's item counter (zeroed by moe_tc_gather: phase 1's
                * and, at next[1], phase 2's) */
  int split;   /* K segments (moe_tc_split; 1 for phase 1 and the bulk path) */
  int slots;   /* split > 1: rows of each segment's part */
  float *part; /* split > 1: the segments' fp32 sums [split][slots][hidden], no routing weight */
  const void *bias; /* the GEMM's expert biases [E][N] in the files' row order (NULL: none) */
  int bias_dt;      /* their moe_dtype: F32, F16 or BF16 */
  /* fp8 W8A8: x holds the e4m3 codes' values in fp16 (moe_tc_fp8_act), its
   * rows in the tile list's order, or by token in phase 1 (xtok) */
  int xtok;
  int wscale;       /* moe_weight_scale: per_tensor, per_channel or block */
  float *xs;        /* the activations' scales [K / xg][xrows] (written by moe_tc_fp8_act) */
  int xrows;        /* the slots' rows and a tile's worth of padding (the GEMM reads a tile's run) */
  int xg;           /* columns per activation scale: BK (block) or K */
  const float *wsc; /* the weight scales as the files have them: [E], [E][N] or [E][ceil(N / bn)][K / bk] */
  int bn, bk;
  /* mxfp4, set by moe_tc_gemm: per expert and 16 packed rows, whether all
   * their scales allow the 16-bit multiply (bit 0: bf16, bit 1: fp16) */
  const uint8_t *fp4_fast;
};

/* Whether a set takes this path: gpu.h's moe_gpu_fused_packs. */
/* Bytes of the packed form of expert tensor `slot` (0: not packed). The
 * packing itself: gpu.h's moe_gpu_fused_pack. */
size_t moe_tc_packed_bytes(const moe_expert_config *cfg, int slot);
/* Packs the uploaded tensors `src` (device, files' layout; scale_dt: the
 * dtypes of W13's and W2's scales) into `dst` (device, moe_tc_packed_bytes
 * each; NULL where that is 0). On b's stream. */
moe_status moe_tc_pack(moe_backend *b, const moe_expert_config *cfg, const moe_dtype scale_dt[2],
                       void *const src[MOE_EXPERT_TENSOR_COUNT], void *dst[MOE_EXPERT_TENSOR_COUNT],
                       moe_error *err);
/* Whether the call's GEMMs take the bulk path (sm_90a, 16-bit weights,
 * the large tile; MOE_GPU_TC_BULK=0: never): then the caller gathers
 * phase 1's x with moe_tc_gather into a K-major buffer of cap = max_tiles
 * x 128 rows and sizes the intermediate the same (TcArgs.cap). */
bool moe_tc_bulk(moe_backend *b, const moe_expert_config *cfg, int config);
moe_status moe_tc_gather(moe_backend *b, int max_tiles, const TcArgs &a, uint16_t *xk, moe_error *err);
/* fp8 W8A8: the GEMM's activations (phase 1: hidden_states; phase 2: a) to
 * e4m3fn codes, one scale per a.xg columns (dynamic: the amax's,
 * docs/numerics.md quant.per_token_group / per_token; static: the expert's
 * entry of `static_scale`), written as the codes' fp16 values into xq and
 * the scales into a.xs in the tile list's order. x: a.x's rows (act dtype).
 * tokens > 0 (phase 1, dynamic scales only: a token's codes are then the
 * same for each of its slots): xq gets one row per token (read with
 * TcArgs.xtok), each token's scales go through xs_tok ([K / xg][tokens]). */
moe_status moe_tc_fp8_act(moe_backend *b, int act, int max_tiles, const TcArgs &a, const void *x,
                          const float *static_scale, int exact, uint16_t *xq, int tokens, float *xs_tok,
                          moe_error *err);
/* One GEMM launch (grid over the worst-case tile count). */
moe_status moe_tc_gemm(moe_backend *b, const moe_expert_config *cfg, int act, int config, int max_tiles,
                       const TcArgs &a, moe_error *err);

#endif
