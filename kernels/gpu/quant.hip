/* GPU: every quant op (docs/numerics.md quant.per_tensor, quant.per_token,
 * quant.mx, dequant.per_tensor, dequant.mx), bit-exact with the CPU backend
 * (kernels/cpu/quant_scaled.c, quant_mx.c).
 *
 * The portable path converts with codec.h alone (the one definition both
 * backends compile); the fast path (NVIDIA) uses hardware conversions and
 * the e2m1 formulations below where they compute the same function. The
 * unit of work is a vector of 8 consecutive elements (one 16-byte load of
 * 16-bit input, two of fp32), coalesced across the warp; quant.mx gives a
 * thread the vectors whose codes fill one 16-byte store. The streaming
 * kernels run on resident grids. A scalar path covers misaligned buffers
 * and tails. Reductions are integer maxima of |x| bits (exact, so
 * order-free); no atomics. Warp size 32 or 64: shuffles use at most 4-lane
 * groups or the full warpSize. Built with --fmad=false / -ffp-contract=off
 * and denormals preserved. */
#include <stdlib.h>
#include <string.h>

#include "gpu.h"

extern "C" {
#include "../ops/op.h"
}

namespace {

enum InKind { IN_F32, IN_F16, IN_BF16 };
enum QKind { Q_E4M3FN, Q_E4M3FNUZ, Q_E5M2, Q_E2M1, Q_INT8 };
enum OutKind { OUT_F32, OUT_F16, OUT_BF16 };

constexpr int VEC = 8; /* elements per thread per step */

/* ---- element access ------------------------------------------------------- */

template <int IN> __device__ __forceinline__ float widen16(uint32_t h) {
  return IN == IN_BF16 ? moe_bf16_to_f32((uint16_t)h) : moe_f16_to_f32((uint16_t)h);
}

template <int IN> __device__ __forceinline__ float load1(const void *x, size_t i) {
  if (IN == IN_F32) return ((const float *)x)[i];
  return widen16<IN>(((const uint16_t *)x)[i]);
}

/* 8 elements from x[i..i+7]; x + i 16-byte aligned. */
template <int IN> __device__ __forceinline__ void load8(const void *x, size_t i, float v[VEC]) {
  if (IN == IN_F32) {
    const float4 *p = (const float4 *)((const float *)x + i);
    float4 a = p[0], b = p[1];
    v[0] = a.x;
    v[1] = a.y;
    v[2] = a.z;
    v[3] = a.w;
    v[4] = b.x;
    v[5] = b.y;
    v[6] = b.z;
    v[7] = b.w;
  } else {
    uint4 u = *(const uint4 *)((const uint16_t *)x + i);
    uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
      v[2 * k] = widen16<IN>(w[k] & 0xFFFFu);
      v[2 * k + 1] = widen16<IN>(w[k] >> 16);
    }
  }
}

template <int OUT> __device__ __forceinline__ uint32_t narrow16(float f) {
  return OUT == OUT_BF16 ? moe_f32_to_bf16(f) : moe_f32_to_f16(f);
}

/* fp32 results: a NaN is stored as the codec's quiet NaN 0x7FC00000. The CPU
 * gets those bits by IEEE NaN propagation (every NaN here comes from
 * codec.h's decoders); NVIDIA's multiply returns 0x7FFFFFFF instead. */
__device__ __forceinline__ float canon_nan(float f) {
  return moe_f32_isnan(f) ? moe_f32_from_bits(0x7FC00000u) : f;
}

template <int OUT> __device__ __forceinline__ void store1(void *y, size_t i, float f) {
  if (OUT == OUT_F32)
    ((float *)y)[i] = canon_nan(f);
  else
    ((uint16_t *)y)[i] = (uint16_t)narrow16<OUT>(f);
}

/* y[i..i+7] = v; y + i 16-byte aligned when vec. */
template <int OUT> __device__ __forceinline__ void store8(void *y, size_t i, const float v[VEC], bool vec) {
  if (!vec) {
#pragma unroll
    for (int k = 0; k < VEC; k++)
      store1<OUT>(y, i + k, v[k]);
  } else if (OUT == OUT_F32) {
    float4 *p = (float4 *)((float *)y + i);
    p[0] = make_float4(canon_nan(v[0]), canon_nan(v[1]), canon_nan(v[2]), canon_nan(v[3]));
    p[1] = make_float4(canon_nan(v[4]), canon_nan(v[5]), canon_nan(v[6]), canon_nan(v[7]));
  } else {
    uint4 u;
    u.x = narrow16<OUT>(v[0]) | (narrow16<OUT>(v[1]) << 16);
    u.y = narrow16<OUT>(v[2]) | (narrow16<OUT>(v[3]) << 16);
    u.z = narrow16<OUT>(v[4]) | (narrow16<OUT>(v[5]) << 16);
    u.w = narrow16<OUT>(v[6]) | (narrow16<OUT>(v[7]) << 16);
    *(uint4 *)((uint16_t *)y + i) = u;
  }
}

/* ---- codes (codec.h; the format a compile-time constant so it folds) ------ */

template <int Q> __device__ __forceinline__ moe_narrow_fmt fmt_of() {
  if (Q == Q_E4M3FNUZ) {
    moe_narrow_fmt f = MOE_FMT_E4M3FNUZ;
    return f;
  }
  if (Q == Q_E5M2) {
    moe_narrow_fmt f = MOE_FMT_E5M2;
    return f;
  }
  if (Q == Q_E2M1) {
    moe_narrow_fmt f = MOE_FMT_E2M1;
    return f;
  }
  moe_narrow_fmt f = MOE_FMT_E4M3FN;
  return f;
}

template <int Q> __device__ __forceinline__ uint32_t encode(float v, bool half_up) {
  if (Q == Q_INT8) return (uint8_t)moe_f32_to_int8(v);
  if (Q == Q_E2M1) return moe_f32_to_e2m1(v, half_up); /* 7 compares, not the generic rounding */
  const moe_narrow_fmt f = fmt_of<Q>();
  return moe_f32_to_narrow(v, &f, half_up);
}

/* NVIDIA fast path (HW = true): the hardware conversions that compute
 * exactly the codec's function, selected at compile time per target:
 * sm_89+ cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (RNE with subnormals, satfinite,
 * NaN -> 0x7F), and cvt.rni.s32.f32 (NaN -> 0) with cvt.pack's saturation
 * to [-128, 127] (one F2IP per pair on sm_90, no clamps: per_token int8 at
 * 1 GiB 79% -> 88% of copy with the next-row prefetch). Other targets and
 * formats (e4m3fnuz, e2m1; AMD) use codec.h. The GPU test runs both paths
 * (MOE_GPU_PORTABLE=1 forces the codec). */
#if defined(MOE_GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define MOE_HW_FP8 1
#endif
#if defined(MOE_GPU_CUDA)
#define MOE_HW_INT8 1
#endif

template <int Q> __host__ __device__ constexpr bool hw_has() {
#if defined(MOE_HW_FP8)
  if (Q == Q_E4M3FN || Q == Q_E5M2) return true;
#endif
#if defined(MOE_HW_INT8)
  if (Q == Q_INT8) return true;
#endif
  return false;
}

/* codes of (lo, hi) as lo | hi << 8 */
template <int Q> __device__ __forceinline__ uint32_t encode2_hw(float lo, float hi) {
#if defined(MOE_HW_FP8)
  if (Q == Q_E4M3FN || Q == Q_E5M2) {
    unsigned short r;
    if (Q == Q_E4M3FN)
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
  }
#endif
#if defined(MOE_HW_INT8)
  if (Q == Q_INT8) { /* cvt.pack saturates both to [-128, 127]: hi << 8 | lo */
    uint32_t r;
    asm("cvt.pack.sat.s8.s32.b32 %0, %1, %2, %3;"
        : "=r"(r)
        : "r"(__float2int_rn(hi)), "r"(__float2int_rn(lo)), "r"(0));
    return r;
  }
#endif
  return encode<Q>(lo, false) | encode<Q>(hi, false) << 8;
}

/* 8 codes of v[k] (* r, or / s when exact) packed little-endian. */
template <int Q, bool HW>
__device__ __forceinline__ uint2 encode8_pack(const float v[VEC], float s, float r, bool exact) {
  float y[VEC];
#pragma unroll
  for (int k = 0; k < VEC; k++)
    y[k] = exact ? v[k] / s : v[k] * r;
  uint32_t c[VEC / 2];
  if (HW && hw_has<Q>()) {
#pragma unroll
    for (int k = 0; k < VEC / 2; k++)
      c[k] = encode2_hw<Q>(y[2 * k], y[2 * k + 1]);
  } else {
#pragma unroll
    for (int k = 0; k < VEC / 2; k++)
      c[k] = encode<Q>(y[2 * k], false) | encode<Q>(y[2 * k + 1], false) << 8;
  }
  return make_uint2(c[0] | c[1] << 16, c[2] | c[3] << 16);
}

template <int Q> __device__ __forceinline__ float decode(uint32_t code) {
  if (Q == Q_INT8) return (float)(int8_t)(uint8_t)code;
  const moe_narrow_fmt f = fmt_of<Q>();
  return moe_narrow_to_f32((uint8_t)code, &f);
}

/* |x| bits when x is finite, else 0: the amax of docs/numerics.md ignores NaN and
 * inf, and the max of non-negative floats is the max of their bits. */
__device__ __forceinline__ uint32_t finite_abs_bits(float x) {
  uint32_t b = moe_f32_bits(x) & 0x7FFFFFFFu;
  return b < 0x7F800000u ? b : 0u;
}

/* ---- reductions (warp size 32 or 64) ----------------------------------------- */

__device__ __forceinline__ uint32_t warp_max(uint32_t m) {
  for (int o = warpSize / 2; o > 0; o >>= 1) {
    uint32_t t = MOE_SHFL_XOR(m, o);
    m = t > m ? t : m;
  }
  return m;
}

/* Max over the block; every thread gets it. */
__device__ uint32_t block_max(uint32_t m) {
  __shared__ uint32_t part[MOE_GPU_BLOCK / 32];
  int lane = (int)threadIdx.x % warpSize, w = (int)threadIdx.x / warpSize;
  int nw = ((int)blockDim.x + warpSize - 1) / warpSize;
  m = warp_max(m);
  if (lane == 0) part[w] = m;
  __syncthreads();
  if (w == 0) {
    m = lane < nw ? part[lane] : 0u;
    m = warp_max(m);
    if (lane == 0) part[0] = m;
  }
  __syncthreads();
  m = part[0];
  __syncthreads();
  return m;
}

template <int Q, bool HW>
__device__ __forceinline__ void encode8(const float v[VEC], float s, float r, bool exact, uint8_t *q,
                                        size_t i, bool vec) {
  uint2 w = encode8_pack<Q, HW>(v, s, r, exact);
  if (vec) {
    *(uint2 *)(q + i) = w;
  } else {
#pragma unroll
    for (int k = 0; k < 4; k++) {
      q[i + k] = (uint8_t)(w.x >> (8 * k));
      q[i + 4 + k] = (uint8_t)(w.y >> (8 * k));
    }
  }
}

/* 8 elements as loaded: one 16-byte word (16-bit input) or two (fp32);
 * half the registers of 8 floats for bf16/fp16. */
template <int IN> struct raw8 { uint4 w[IN == IN_F32 ? 2 : 1]; };

template <int IN> __device__ __forceinline__ void load_raw8(const void *x, size_t i, raw8<IN> &r) {
  const uint4 *p = (const uint4 *)((const char *)x + i * (IN == IN_F32 ? 4 : 2));
  r.w[0] = p[0];
  if constexpr (IN == IN_F32) r.w[1] = p[1];
}

/* The same from any address (the scalar path of misaligned buffers). */
template <int IN>
__device__ __forceinline__ void load_raw8_any(const void *x, size_t i, raw8<IN> &r, bool vec) {
  if (vec) {
    load_raw8<IN>(x, i, r);
  } else if constexpr (IN == IN_F32) {
    const uint32_t *p = (const uint32_t *)x + i;
    r.w[0] = make_uint4(p[0], p[1], p[2], p[3]);
    r.w[1] = make_uint4(p[4], p[5], p[6], p[7]);
  } else {
    const uint16_t *p = (const uint16_t *)x + i;
    r.w[0] = make_uint4(p[0] | (uint32_t)p[1] << 16, p[2] | (uint32_t)p[3] << 16, p[4] | (uint32_t)p[5] << 16,
                        p[6] | (uint32_t)p[7] << 16);
  }
}

template <int IN> __device__ __forceinline__ void unpack8(const raw8<IN> &r, float v[VEC]) {
  if constexpr (IN == IN_F32) {
    const uint32_t u[8] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w, r.w[1].x, r.w[1].y, r.w[1].z, r.w[1].w};
#pragma unroll
    for (int k = 0; k < VEC; k++)
      v[k] = moe_f32_from_bits(u[k]);
  } else {
    const uint32_t u[4] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
      v[2 * k] = widen16<IN>(u[k] & 0xFFFFu);
      v[2 * k + 1] = widen16<IN>(u[k] >> 16);
    }
  }
}

/* ---- streaming: a grid that stays resident -------------------------------------- */

/* The element-wise ops stream at memory speed with no tail: the grid is
 * exactly what the device holds at once (occupancy x SMs, resident_grid),
 * striding over the tensor so that every thread gets the same number of
 * vectors give or take one. (The old grid of 8 blocks per SM, with
 * 40-register kernels that fit 6, ran a second, mostly idle wave: 92% of
 * copy bandwidth at 1 GiB.) for_each_vector can issue the 16-byte loads of
 * U vectors before it uses the first; on the H200 U = 1 measured best
 * (per_tensor static at 256 MiB: 93% of copy with U = 1, 86-90% with 2, 4
 * and 8, which cost registers and so resident threads). */
constexpr int STREAM_U = 1;

/* f(r, v) for every vector v < nv of x, U per thread per round. */
template <int IN, int U, typename F>
__device__ __forceinline__ void for_each_vector(const void *x, size_t nv, F &&f) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t v0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x; v0 < nv; v0 += U * stride) {
    raw8<IN> r[U];
#pragma unroll
    for (int j = 0; j < U; j++)
      if (v0 + j * stride < nv) load_raw8<IN>(x, (v0 + j * stride) * VEC, r[j]);
#pragma unroll
    for (int j = 0; j < U; j++)
      if (v0 + j * stride < nv) f(r[j], v0 + j * stride);
  }
}

/* ---- quant.per_tensor ---------------------------------------------------------- */

/* Pass 1 of the dynamic scale: one partial amax (bits) per block. */
template <int IN, int U>
__global__ void __launch_bounds__(MOE_GPU_BLOCK)
    amax_partials(const void *x, size_t n, int vec, uint32_t *partials) {
  const size_t nv = vec ? n / VEC : 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  uint32_t m = 0;
  for_each_vector<IN, U>(x, nv, [&](const raw8<IN> &r, size_t) {
    float a[VEC];
    unpack8<IN>(r, a);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
      const uint32_t u = finite_abs_bits(a[k]);
      m = u > m ? u : m;
    }
  });
  for (size_t i = nv * VEC + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t u = finite_abs_bits(load1<IN>(x, i));
    m = u > m ? u : m;
  }
  m = block_max(m);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

/* q = cvt(x * (1/s)) or cvt(x / s) (EXACT: a template parameter, as the
 * division's code would cost the multiply's kernel registers, and with them
 * resident threads). The scale is `s_static`, or (partials given) amax of
 * the partials / dtype_max, reduced by every block alike. */
template <int IN, int Q, bool HW, int U, bool EXACT>
__global__ void __launch_bounds__(MOE_GPU_BLOCK)
    quant_per_tensor_kernel(const void *x, uint8_t *q, size_t n, int vec, float s_static,
                            const uint32_t *partials, int npart, float dtype_max, float *scale_out) {
  constexpr bool exact = EXACT;
  float s = s_static;
  if (partials) {
    uint32_t m = 0;
    for (int i = (int)threadIdx.x; i < npart; i += (int)blockDim.x)
      m = partials[i] > m ? partials[i] : m;
    s = moe_dynamic_scale(moe_f32_from_bits(block_max(m)), dtype_max, false);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = s;
  const float r = 1.0f / s;
  const size_t nv = vec ? n / VEC : 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for_each_vector<IN, U>(x, nv, [&](const raw8<IN> &w, size_t v) {
    float a[VEC];
    unpack8<IN>(w, a);
    encode8<Q, HW>(a, s, r, exact, q, v * VEC, true);
  });
  for (size_t i = nv * VEC + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = load1<IN>(x, i);
    q[i] = (uint8_t)encode<Q>(exact ? v / s : v * r, false);
  }
}

/* ---- quant.per_token, quant.per_token_group ------------------------------------------ */

/* One block per row (per_token) or per group of a row (per_token_group
 * with wide or unaligned groups). The first CACHE vectors of each thread stay in
 * registers between the amax pass and the encode pass (a 7168-wide bf16 row
 * is read once); wider rows re-read the rest (from L2). The block's next row
 * is loaded before this row's reduction and stores, so that its loads are in
 * flight across the barriers (a row at a time left each block idle there). */
template <int IN, int Q, bool HW>
__global__ void __launch_bounds__(MOE_GPU_BLOCK, IN == IN_F32 ? 2 : 4) /* two rows' cache per thread */
    quant_per_token_kernel(const void *x, uint8_t *q, float *scales, int64_t rows, int64_t k, int vec,
                           float dtype_max, int has_ub, float ub, int pow2, int exact) {
  constexpr int CACHE = 4;
  const size_t nv = vec ? (size_t)k / VEC : 0;
  const size_t bd = blockDim.x;
  auto load_cache = [&](int64_t row, raw8<IN> d[CACHE]) {
#pragma unroll
    for (int j = 0; j < CACHE; j++) {
      const size_t v = threadIdx.x + j * bd;
      if (v < nv) load_raw8<IN>(x, (size_t)row * (size_t)k + v * VEC, d[j]);
    }
  };
  raw8<IN> c[CACHE];
  if ((int64_t)blockIdx.x < rows) load_cache(blockIdx.x, c);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const size_t base = (size_t)row * (size_t)k;
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < CACHE; j++) {
      size_t v = threadIdx.x + j * bd;
      if (v < nv) {
        float a[VEC];
        unpack8<IN>(c[j], a);
#pragma unroll
        for (int e = 0; e < VEC; e++) {
          uint32_t u = finite_abs_bits(a[e]);
          m = u > m ? u : m;
        }
      }
    }
    for (size_t v = threadIdx.x + CACHE * bd; v < nv; v += bd) {
      float a[VEC];
      load8<IN>(x, base + v * VEC, a);
#pragma unroll
      for (int e = 0; e < VEC; e++) {
        uint32_t u = finite_abs_bits(a[e]);
        m = u > m ? u : m;
      }
    }
    for (size_t i = nv * VEC + threadIdx.x; i < (size_t)k; i += bd) {
      uint32_t u = finite_abs_bits(load1<IN>(x, base + i));
      m = u > m ? u : m;
    }
    raw8<IN> nc[CACHE];
    if (row + gridDim.x < rows) load_cache(row + gridDim.x, nc);
    float amax = moe_f32_from_bits(block_max(m));
    if (has_ub && ub < amax) amax = ub;
    const float s = moe_dynamic_scale(amax, dtype_max, pow2);
    const float r = 1.0f / s;
    if (threadIdx.x == 0) scales[row] = s;
#pragma unroll
    for (int j = 0; j < CACHE; j++) {
      size_t v = threadIdx.x + j * bd;
      if (v < nv) {
        float a[VEC];
        unpack8<IN>(c[j], a);
        encode8<Q, HW>(a, s, r, exact, q, base + v * VEC, true);
      }
    }
    for (size_t v = threadIdx.x + CACHE * bd; v < nv; v += bd) {
      float a[VEC];
      load8<IN>(x, base + v * VEC, a);
      encode8<Q, HW>(a, s, r, exact, q, base + v * VEC, true);
    }
    for (size_t i = nv * VEC + threadIdx.x; i < (size_t)k; i += bd) {
      float v = load1<IN>(x, base + i);
      q[base + i] = (uint8_t)encode<Q>(exact ? v / s : v * r, false);
    }
#pragma unroll
    for (int j = 0; j < CACHE; j++)
      c[j] = nc[j];
  }
}

/* Groups (per_token_group's, or per_token's short rows) of G a multiple of 8
 * up to 8 * 32 * GROUP_CACHE: a team of ts lanes per group (a power of two
 * dividing G / 8, at most 32), each lane's G / 8 / ts vectors loaded at
 * once and kept in registers between the amax and the encode; a team's
 * amax meets through xor-shuffles inside it (whole for warp sizes 32 and
 * 64). The loop bound is block-uniform so that every lane reaches every
 * shuffle. */
constexpr int GROUP_CACHE = 4;
template <int IN, int Q, bool HW>
__global__ void __launch_bounds__(MOE_GPU_BLOCK)
    quant_group_kernel(const void *x, uint8_t *q, float *scales, int64_t groups, int g, int ts,
                       float dtype_max, int has_ub, float ub, int pow2, int exact) {
  const int per = g / VEC / ts, sub = (int)threadIdx.x % ts;
  const int64_t teams = (int64_t)blockDim.x / ts, stride = (int64_t)gridDim.x * teams;
  for (int64_t first = (int64_t)blockIdx.x * teams; first < groups; first += stride) {
    const int64_t grp = first + (int64_t)threadIdx.x / ts;
    const bool active = grp < groups;
    const size_t base = (size_t)grp * (size_t)g;
    raw8<IN> c[GROUP_CACHE];
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < GROUP_CACHE; j++)
      if (active && j < per) load_raw8<IN>(x, base + (size_t)(j * ts + sub) * VEC, c[j]);
#pragma unroll
    for (int j = 0; j < GROUP_CACHE; j++)
      if (active && j < per) {
        float a[VEC];
        unpack8<IN>(c[j], a);
#pragma unroll
        for (int e = 0; e < VEC; e++) {
          const uint32_t u = finite_abs_bits(a[e]);
          m = u > m ? u : m;
        }
      }
    for (int off = ts / 2; off > 0; off >>= 1) {
      const uint32_t o = MOE_SHFL_XOR(m, off);
      m = o > m ? o : m;
    }
    float amax = moe_f32_from_bits(m);
    if (has_ub && ub < amax) amax = ub;
    const float s = moe_dynamic_scale(amax, dtype_max, pow2), r = 1.0f / s;
    if (active && sub == 0) scales[grp] = s;
#pragma unroll
    for (int j = 0; j < GROUP_CACHE; j++)
      if (active && j < per) {
        float a[VEC];
        unpack8<IN>(c[j], a);
        encode8<Q, HW>(a, s, r, exact, q, base + (size_t)(j * ts + sub) * VEC, true);
      }
  }
}

/* ---- quant.mx ----------------------------------------------------------------------- */

/* Packed 16-bit lane maxima and minima (one VIMNMX on sm_90). */
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if defined(MOE_GPU_CUDA)
  return __vmaxu2(a, b);
#else
  const uint32_t lo = (a & 0xFFFFu) > (b & 0xFFFFu) ? a & 0xFFFFu : b & 0xFFFFu;
  const uint32_t hi = (a >> 16) > (b >> 16) ? a >> 16 : b >> 16;
  return lo | hi << 16;
#endif
}

/* max |x| bits (fp32 domain) of 8 elements, NaN and inf included: the max is
 * >= 0x7F800000 exactly when one of them is NaN or inf, so the block's NaN
 * flag needs no compare per element. 16-bit inputs reduce in their own bits
 * (|x| bits order like |x|, and widening keeps the order) two lanes at a
 * time, and only the maximum is widened. */
template <int IN> __device__ __forceinline__ uint32_t abs_max8(const raw8<IN> &r) {
  if constexpr (IN == IN_F32) {
    const uint32_t u[8] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w, r.w[1].x, r.w[1].y, r.w[1].z, r.w[1].w};
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < VEC; k++)
      m = (u[k] & 0x7FFFFFFFu) > m ? u[k] & 0x7FFFFFFFu : m;
    return m;
  } else {
    const uint32_t k = 0x7FFF7FFFu;
    uint32_t m = max_u16x2(max_u16x2(r.w[0].x & k, r.w[0].y & k), max_u16x2(r.w[0].z & k, r.w[0].w & k));
    m = (m & 0xFFFFu) > (m >> 16) ? m & 0xFFFFu : m >> 16;
    return moe_f32_bits(widen16<IN>(m));
  }
}

/* fp4 e2m1 (fast path): codec.h's moe_f32_to_e2m1 counts the seven rounding
 * boundaries; here one IEEE add does the rounding. For |y| in the binade
 * [2^e, 2^(e+1)), M = 2^(max(e, 0) + 22) has an ulp equal to the e2m1 step
 * there (2^(e-1), and 0.5 below 1), so |y| + M rounds |y| to the e2m1 grid
 * with ties to the even code; bits(|y| + M) - bits(M) counts the steps k,
 * and the magnitude code is k + 2 max(e, 0), saturated at 7. half_up sets
 * |y|'s lowest bit first: far below the step, it lifts exact ties (and only
 * them) past the midpoint. Valid for finite |y| < 16, which every
 * non-NaN MX block gives (|y| < 12 under each scale rule); the GPU test
 * compares it with the CPU's codec on every bf16/fp16 pattern x 300 scales. */
__device__ __forceinline__ uint32_t e2m1_by_add(float y, uint32_t lsb) {
  const uint32_t u = moe_f32_bits(y), a = (u & 0x7FFFFFFFu) | lsb;
  const uint32_t e0 = (a > 0x3F800000u ? a : 0x3F800000u) & 0x7F800000u; /* 2^max(e, 0) */
  const uint32_t m = e0 + (22u << 23);
  const uint32_t c = moe_f32_bits(moe_f32_from_bits(a) + moe_f32_from_bits(m)) - m + ((e0 >> 22) - 254u);
  return (c < 7u ? c : 7u) | (u >> 31) << 3;
}

#if defined(MOE_GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MOE_HW_BF16X2 1
/* The same for two bf16 elements x of one word, with sm_90's packed bf16
 * and 16-bit integer lanes: s = fma(|x|, mult, M) rounds |y| = |x| * mult
 * (exact: mult is a power of two, or 0) plus M once, as the add does;
 * M = 2^(max(e, 0) + 6), whose bf16 ulp is the step, comes from x's
 * exponent field plus log2(mult) (k2: log2(mult) << 7 per lane, or -2^14
 * when mult = 0) and a max with 1.0 in one add-max. Below bf16's normal
 * range (x subnormal or zero) the field is 0 and |y| < 2: max(e, 0) = 0
 * either way. The sign is x's (mult >= 0); the caller adds it. Lane
 * arithmetic in 32-bit words: every lane's result stays in [0, 2^16).
 * Codes in bits 0-2 and 16-18. */
__device__ __forceinline__ uint32_t e2m1x2_bf16(uint32_t x, uint32_t mult2, uint32_t k2, uint32_t lsb2) {
  const uint32_t a = (x & 0x7FFF7FFFu) | lsb2;
  const uint32_t e0 = __viaddmax_s16x2(x & 0x7F807F80u, k2, 0x3F803F80u); /* 2^max(e, 0) */
  uint32_t s;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(s) : "r"(a), "r"(mult2), "r"(e0 + 0x03000300u));
  const uint32_t c = s - e0 + (e0 >> 6) - 0x03FE03FEu; /* s - M + 2 (E - 127) = k + 2 max(e, 0) */
  return __vminu2(c, 0x00070007u);
}

/* Sign bits of the 4 elements of words x0 x1 (low element first) at bit 3
 * of bytes 0-3 in the order e0 e2 e1 e3: prmt's sign-replicating mode
 * copies bit 15 / 31 of each word over a byte. */
__device__ __forceinline__ uint32_t signs4(uint32_t x0, uint32_t x1) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x0), "r"(x1), "r"(0xFBD9u));
  return r & 0x08080808u;
}
#endif

/* The codes of one vector's 8 elements e (raw r) at factor mult: fp8 as 8
 * bytes, fp4 as 8 nibbles in .x (low nibble first). */
template <int IN, int Q, bool HW>
__device__ __forceinline__ uint2 mx_codes8(const raw8<IN> &r, float mult, int half_up) {
#if defined(MOE_HW_BF16X2)
  /* mult = 2^-127 (scale byte 254, a block amax >= 1.75 * 2^127 under
   * even / floor) is below bf16's normal range: the fp32 path below */
  const uint32_t mb = moe_f32_bits(mult) >> 16;
  if (HW && Q == Q_E2M1 && IN == IN_BF16 && (mb >= 0x80u || mb == 0u)) {
    const uint32_t m2 = mb * 0x10001u, l2 = half_up ? 0x10001u : 0u;
    const uint32_t k2 = mb ? ((mb - 0x3F80u) & 0xFFFFu) * 0x10001u : 0xC000C000u;
    const uint4 x = r.w[0];
    const uint32_t n0 = e2m1x2_bf16(x.x, m2, k2, l2), n1 = e2m1x2_bf16(x.y, m2, k2, l2);
    const uint32_t n2 = e2m1x2_bf16(x.z, m2, k2, l2), n3 = e2m1x2_bf16(x.w, m2, k2, l2);
    /* codes e0 e2 e1 e3 at bits 0, 8, 16, 24 (and signs); + >> 12 moves
     * e1 e3 to bits 4, 12 without carries */
    uint32_t lo = (n0 | n1 << 8) | signs4(x.x, x.y), hi = (n2 | n3 << 8) | signs4(x.z, x.w);
    lo += lo >> 12;
    hi += hi >> 12;
    return make_uint2(__byte_perm(lo, hi, 0x5410), 0u);
  }
#endif
  float e[VEC];
  unpack8<IN>(r, e);
  uint32_t c[VEC];
  if (HW && Q == Q_E2M1) {
#pragma unroll
    for (int k = 0; k < VEC; k++)
      c[k] = e2m1_by_add(e[k] * mult, (uint32_t)half_up);
  } else if (HW && hw_has<Q>()) {
#pragma unroll
    for (int k = 0; k < VEC / 2; k++) {
      const uint32_t pr = encode2_hw<Q>(e[2 * k] * mult, e[2 * k + 1] * mult);
      c[2 * k] = pr & 0xFFu;
      c[2 * k + 1] = pr >> 8;
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; k++)
      c[k] = encode<Q>(e[k] * mult, Q == Q_E2M1 && half_up);
  }
  if (Q == Q_E2M1)
    return make_uint2(
        c[0] | c[1] << 4 | c[2] << 8 | c[3] << 12 | c[4] << 16 | c[5] << 20 | c[6] << 24 | c[7] << 28, 0u);
  return make_uint2(c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24, c[4] | c[5] << 8 | c[6] << 16 | c[7] << 24);
}

/* One thread's N consecutive vectors r (8 elements each, the first vector
 * v) of a 32-element block, which 4 / N consecutive lanes share: the
 * block's max |x| bits meet through xor-shuffles inside that lane group
 * (whole for warp size 32 and 64). Every lane of the warp calls this
 * (active or not) so that the shuffles are whole. N > 1 spreads the
 * block's shuffles and scale over more elements and widens the stores
 * (N = 4: a whole block per thread, no shuffle, 64 bytes of bf16 read and
 * a 16-byte fp4 store). */
template <int IN, int Q, bool HW, int N>
__device__ __forceinline__ void mx_part(const raw8<IN> (&r)[N], size_t v, bool active, uint8_t *q,
                                        uint8_t *scales, int vec, int rule, int half_up) {
  const moe_narrow_fmt f = fmt_of<Q>();
  uint32_t m = 0;
  if (active)
#pragma unroll
    for (int j = 0; j < N; j++) {
      const uint32_t t = abs_max8<IN>(r[j]);
      m = t > m ? t : m;
    }
#pragma unroll
  for (int o = 1; o < 4 / N; o *= 2) {
    const uint32_t t = MOE_SHFL_XOR(m, o);
    m = t > m ? t : m;
  }
  if (!active) return;
  uint2 w[N];
  uint8_t sbyte;
  if (m >= 0x7F800000u) { /* OCP: a NaN scale makes the whole block NaN */
    sbyte = 0xFF;
#pragma unroll
    for (int j = 0; j < N; j++)
      w[j] = make_uint2(0u, 0u);
  } else {
    float mult;
    sbyte = moe_mx_scale(moe_f32_from_bits(m), (moe_mx_rule)rule, &f, &mult);
#pragma unroll
    for (int j = 0; j < N; j++)
      w[j] = mx_codes8<IN, Q, HW>(r[j], mult, half_up);
  }
  constexpr int cb = Q == Q_E2M1 ? 4 : 8; /* code bytes per vector */
  uint8_t *dst = q + v * cb;
  if (vec) { /* 16-byte stores where N vectors' codes fill them */
    if constexpr (Q == Q_E2M1 && N == 1)
      *(uint32_t *)dst = w[0].x;
    else if constexpr (Q == Q_E2M1 && N == 2)
      *(uint2 *)dst = make_uint2(w[0].x, w[1].x);
    else if constexpr (Q == Q_E2M1)
#pragma unroll
      for (int j = 0; j < N; j += 4)
        *(uint4 *)(dst + j * 4) = make_uint4(w[j].x, w[j + 1].x, w[j + 2].x, w[j + 3].x);
    else if constexpr (N == 1)
      *(uint2 *)dst = w[0];
    else
#pragma unroll
      for (int j = 0; j < N; j += 2)
        *(uint4 *)(dst + j * 8) = make_uint4(w[j].x, w[j].y, w[j + 1].x, w[j + 1].y);
  } else {
#pragma unroll
    for (int j = 0; j < N; j++)
#pragma unroll
      for (int k = 0; k < cb; k++)
        dst[j * cb + k] = (uint8_t)((k < 4 ? w[j].x : w[j].y) >> (8 * (k & 3)));
  }
  if ((v & 3) == 0) scales[v >> 2] = sbyte;
}

/* Each thread takes N consecutive vectors, U such units per round, all
 * loaded before the first is encoded (as for_each_vector, but the round
 * bound is block-uniform so that every lane reaches the shuffles). */
/* N: the vectors whose codes fill one 16-byte store, 4 for fp4 and 2 for
 * fp8 (H200, bf16 [M, 7168] at 1 GiB: mxfp4 90% of copy with N = 2, 96%
 * with 4, as its encoder is issue-bound; mxfp8 94% with 2, 90% with 4,
 * whose 32 bytes of codes per thread took two half-coalesced stores).
 * U = 2, 4: no faster. */
template <int Q> constexpr int MX_N = Q == Q_E2M1 ? 4 : 2;
constexpr int MX_U = 1;
template <int IN, int Q, bool HW, int U>
__global__ void __launch_bounds__(MOE_GPU_BLOCK)
    quant_mx_kernel(const void *x, uint8_t *q, uint8_t *scales, size_t nblocks, int vec, int rule,
                    int half_up) {
  constexpr int N = MX_N<Q>;
  const size_t nu = nblocks * 4 / N; /* units of N vectors */
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t u0 = (size_t)blockIdx.x * blockDim.x; u0 < nu; u0 += U * stride) {
    raw8<IN> r[U][N];
#pragma unroll
    for (int j = 0; j < U; j++) {
      const size_t u = u0 + j * stride + threadIdx.x;
      if (u < nu)
#pragma unroll
        for (int i = 0; i < N; i++)
          load_raw8_any<IN>(x, (u * N + i) * VEC, r[j][i], vec);
    }
#pragma unroll
    for (int j = 0; j < U; j++) {
      const size_t u = u0 + j * stride + threadIdx.x;
      mx_part<IN, Q, HW, N>(r[j], u * N, u < nu, q, scales, vec, rule, half_up);
    }
  }
}

/* ---- dequant ------------------------------------------------------------------------ */

template <int Q, int OUT>
__global__ void __launch_bounds__(MOE_GPU_BLOCK)
    dequant_per_tensor_kernel(const uint8_t *q, void *y, size_t n, int vec, float s) {
  size_t nv = vec ? n / VEC : 0;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (size_t v = t; v < nv; v += stride) {
    uint2 w = *(const uint2 *)(q + v * VEC);
    float o[VEC];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      o[k] = decode<Q>((w.x >> (8 * k)) & 0xFFu) * s;
      o[4 + k] = decode<Q>((w.y >> (8 * k)) & 0xFFu) * s;
    }
    store8<OUT>(y, v * VEC, o, true);
  }
  for (size_t i = nv * VEC + t; i < n; i += stride)
    store1<OUT>(y, i, decode<Q>(q[i]) * s);
}

/* Thread v: elements 8v..8v+7, in block v/4. */
template <int Q, int OUT>
__global__ void __launch_bounds__(MOE_GPU_BLOCK)
    dequant_mx_kernel(const uint8_t *q, const uint8_t *scales, void *y, size_t nblocks, int vec) {
  const size_t nv = nblocks * 4;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t v = (size_t)blockIdx.x * blockDim.x + threadIdx.x; v < nv; v += stride) {
    const float sc = moe_e8m0_to_f32(scales[v >> 2]);
    uint32_t c[VEC];
    if (Q == Q_E2M1) {
      uint32_t w;
      if (vec) {
        w = *(const uint32_t *)(q + v * 4);
      } else {
        w = 0;
#pragma unroll
        for (int k = 0; k < 4; k++)
          w |= (uint32_t)q[v * 4 + k] << (8 * k);
      }
#pragma unroll
      for (int k = 0; k < VEC; k++)
        c[k] = (w >> (4 * k)) & 0xFu;
    } else {
      uint2 w;
      if (vec) {
        w = *(const uint2 *)(q + v * VEC);
      } else {
        w.x = w.y = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
          w.x |= (uint32_t)q[v * VEC + k] << (8 * k);
          w.y |= (uint32_t)q[v * VEC + 4 + k] << (8 * k);
        }
      }
#pragma unroll
      for (int k = 0; k < 4; k++) {
        c[k] = (w.x >> (8 * k)) & 0xFFu;
        c[4 + k] = (w.y >> (8 * k)) & 0xFFu;
      }
    }
    float o[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++)
      o[k] = decode<Q>(c[k]) * sc;
    store8<OUT>(y, v * VEC, o, vec != 0);
  }
}

/* ---- host side: dispatch on dtypes ------------------------------------------------ */

bool aligned(const void *p, size_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

int in_kind(moe_dtype t) { return t == MOE_F16 ? IN_F16 : t == MOE_BF16 ? IN_BF16 : IN_F32; }
int out_kind(moe_dtype t) { return t == MOE_F16 ? OUT_F16 : t == MOE_BF16 ? OUT_BF16 : OUT_F32; }
int q_kind(moe_dtype t) {
  switch (t) {
  case MOE_FP8_E4M3FNUZ: return Q_E4M3FNUZ;
  case MOE_FP8_E5M2: return Q_E5M2;
  case MOE_FP4_E2M1: return Q_E2M1;
  case MOE_INT8: return Q_INT8;
  default: return Q_E4M3FN;
  }
}

/* Grid for a grid-stride loop over `items` thread-items. */
unsigned grid_for(const moe_backend *b, size_t items, int per_sm) {
  size_t want = (items + MOE_GPU_BLOCK - 1) / MOE_GPU_BLOCK;
  size_t cap = (size_t)moe_gpu_sm_count(b) * (size_t)per_sm;
  if (want > cap) want = cap;
  return want ? (unsigned)want : 1u;
}

#if defined(MOE_GPU_CUDA)
#define hipOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#endif

/* Blocks of kernel K that one SM holds at once (MOE_GPU_BLOCK threads),
 * asked once per kernel (per process: the first device's answer). */
template <auto K> int resident_per_sm() {
  static const int n = [] {
    int r = 0;
    return hipOccupancyMaxActiveBlocksPerMultiprocessor(&r, K, MOE_GPU_BLOCK, 0) == hipSuccess && r > 0 ? r
                                                                                                        : 1;
  }();
  return n;
}

/* The streaming kernels' grid (for_each_vector): every block resident at
 * once, fewer blocks when `items` vectors give each thread less than u. */
template <auto K> unsigned resident_grid(const moe_backend *b, size_t items, int u) {
  const size_t per_block = (size_t)MOE_GPU_BLOCK * (size_t)u;
  size_t want = (items + per_block - 1) / per_block;
  const size_t cap = (size_t)moe_gpu_sm_count(b) * (size_t)resident_per_sm<K>();
  if (want > cap) want = cap;
  return want ? (unsigned)want : 1u;
}

moe_status launched(const char *what, moe_error *err) { return moe_gpu_check(hipGetLastError(), what, err); }

/* Vendor fast path unless MOE_GPU_PORTABLE is set (gpu.h). */
bool use_hw() { return !moe_gpu_portable(); }

/* Calls fn.template operator()<IN, Q>() for the runtime kinds. */
template <typename F> void dispatch_in_q(int in, int qk, F &&fn) {
#define MOE_Q_CASES(IN)                                                                                      \
  switch (qk) {                                                                                              \
  case Q_E4M3FN: fn.template operator()<IN, Q_E4M3FN>(); break;                                              \
  case Q_E4M3FNUZ: fn.template operator()<IN, Q_E4M3FNUZ>(); break;                                          \
  default: fn.template operator()<IN, Q_INT8>(); break;                                                      \
  }
  switch (in) {
  case IN_F16: MOE_Q_CASES(IN_F16); break;
  case IN_BF16: MOE_Q_CASES(IN_BF16); break;
  default: MOE_Q_CASES(IN_F32); break;
  }
#undef MOE_Q_CASES
}

} // namespace

/* ---- op entry points (kernels/ops/op.h) ------------------------------------------- */

extern "C" moe_status moe_gpu_quant_per_tensor(moe_backend *b, moe_call *c, moe_error *err) {
  const bool hw = use_hw();
  const moe_scaled_args *a = &c->args.scaled;
  const moe_tensor *x = &c->in[0].tensor;
  uint8_t *q = (uint8_t *)c->out[0].tensor.data;
  float *scale_out = (float *)c->out[1].tensor.data;
  size_t n = 0;
  moe_tensor_numel(x, &n);
  hipStream_t st = moe_gpu_stream(b);
  int vec = aligned(x->data, 16) && aligned(q, 8);
  uint32_t *partials = NULL;
  int npart = 0;
  const int in = in_kind(x->dtype);
  constexpr int U = STREAM_U;
  if (!a->has_static_scale) {
    auto amax = [&]<int IN>() {
      constexpr auto K = amax_partials<IN, U>;
      npart = (int)resident_grid<K>(b, n / VEC + 1, U);
      partials = (uint32_t *)moe_gpu_workspace(b, (size_t)npart * sizeof *partials);
      if (partials) K<<<npart, MOE_GPU_BLOCK, 0, st>>>(x->data, n, vec, partials);
    };
    switch (in) {
    case IN_F16: amax.template operator()<IN_F16>(); break;
    case IN_BF16: amax.template operator()<IN_BF16>(); break;
    default: amax.template operator()<IN_F32>(); break;
    }
    if (!partials) return moe_fail(err, MOE_ENOMEM, "quant.per_tensor: device workspace");
    moe_status s = launched("quant.per_tensor amax", err);
    if (s) return s;
  }
  const float s_static = a->has_static_scale ? a->static_scale : 1.0f;
  dispatch_in_q(in, q_kind(a->qdtype), [&]<int IN, int Q>() {
    auto go = [&]<bool HW, bool EXACT>() {
      constexpr auto K = quant_per_tensor_kernel<IN, Q, HW, U, EXACT>;
      K<<<resident_grid<K>(b, n / VEC + 1, U), MOE_GPU_BLOCK, 0, st>>>(x->data, q, n, vec, s_static, partials,
                                                                       npart, a->dtype_max, scale_out);
    };
    if (hw && a->exact_division)
      go.template operator()<true, true>();
    else if (hw)
      go.template operator()<true, false>();
    else if (a->exact_division)
      go.template operator()<false, true>();
    else
      go.template operator()<false, false>();
  });
  return launched("quant.per_tensor", err);
}

/* quant.per_token and quant.per_token_group: one scale per a->group
 * elements; small aligned groups by lane teams, the rest a block per group. */
extern "C" moe_status moe_gpu_quant_grouped(moe_backend *b, moe_call *c, moe_error *err) {
  const bool hw = use_hw();
  const moe_scaled_args *a = &c->args.scaled;
  const moe_tensor *x = &c->in[0].tensor;
  uint8_t *q = (uint8_t *)c->out[0].tensor.data;
  float *scales = (float *)c->out[1].tensor.data;
  size_t n = 0;
  moe_tensor_numel(x, &n);
  if (n == 0) return MOE_OK;
  const int64_t k = a->group, rows = (int64_t)(n / (size_t)k);
  size_t esize = x->dtype == MOE_F32 ? 4 : 2;
  int vec = aligned(x->data, 16) && aligned(q, 8) && ((size_t)k * esize) % 16 == 0 && k % VEC == 0;
  const size_t cap = (size_t)moe_gpu_sm_count(b) * 16;
  hipStream_t st = moe_gpu_stream(b);
  /* lanes per group for the team kernel: the fewest that keep at most
   * GROUP_CACHE vectors each, so that each lane has several loads in flight
   * (0: a block per group) */
  int ts = 0;
  const int64_t nvec = k / VEC;
  for (int t = 1; vec && !ts && t <= 32; t *= 2)
    if (nvec % t == 0 && nvec / t <= GROUP_CACHE) ts = t;
  if (ts) {
    const size_t teams = MOE_GPU_BLOCK / (size_t)ts, blocks = ((size_t)rows + teams - 1) / teams;
    const unsigned grid = (unsigned)(blocks < cap ? blocks : cap);
    dispatch_in_q(in_kind(x->dtype), q_kind(a->qdtype), [&]<int IN, int Q>() {
      if (hw)
        quant_group_kernel<IN, Q, true>
            <<<grid, MOE_GPU_BLOCK, 0, st>>>(x->data, q, scales, rows, (int)k, ts, a->dtype_max,
                                             a->has_scale_ub, a->scale_ub, a->pow2_scale, a->exact_division);
      else
        quant_group_kernel<IN, Q, false>
            <<<grid, MOE_GPU_BLOCK, 0, st>>>(x->data, q, scales, rows, (int)k, ts, a->dtype_max,
                                             a->has_scale_ub, a->scale_ub, a->pow2_scale, a->exact_division);
    });
    return launched(c->op->info.name, err);
  }
  /* rows stride over a resident grid (each block prefetches its next row) */
  dispatch_in_q(in_kind(x->dtype), q_kind(a->qdtype), [&]<int IN, int Q>() {
    auto go = [&]<bool HW>() {
      constexpr auto K = quant_per_token_kernel<IN, Q, HW>;
      K<<<resident_grid<K>(b, (size_t)rows * MOE_GPU_BLOCK, 1), MOE_GPU_BLOCK, 0, st>>>(
          x->data, q, scales, rows, k, vec, a->dtype_max, a->has_scale_ub, a->scale_ub, a->pow2_scale,
          a->exact_division);
    };
    if (hw)
      go.template operator()<true>();
    else
      go.template operator()<false>();
  });
  return launched(c->op->info.name, err);
}

extern "C" moe_status moe_gpu_quant_mx(moe_backend *b, moe_call *c, moe_error *err) {
  const bool hw = use_hw();
  const moe_mx_args *a = &c->args.mx;
  const moe_tensor *x = &c->in[0].tensor;
  uint8_t *q = (uint8_t *)c->out[0].tensor.data, *scales = (uint8_t *)c->out[1].tensor.data;
  size_t n = 0;
  moe_tensor_numel(x, &n);
  size_t nblocks = n / 32;
  if (nblocks == 0) return MOE_OK;
  int qk = q_kind(a->qdtype);
  const int vec = aligned(x->data, 16) && aligned(q, 16); /* 16-byte code stores */
  hipStream_t st = moe_gpu_stream(b);
  auto go = [&]<int IN, int Q, int U>() {
    auto launch = [&]<bool HW>() {
      constexpr auto K = quant_mx_kernel<IN, Q, HW, U>;
      K<<<resident_grid<K>(b, nblocks * 4 / MX_N<Q>, U), MOE_GPU_BLOCK, 0, st>>>(
          x->data, q, scales, nblocks, vec, a->rule, Q == Q_E2M1 ? a->half_up : 0);
    };
    if (hw)
      launch.template operator()<true>();
    else
      launch.template operator()<false>();
  };
  auto go_in = [&]<int IN, int U>() {
    switch (qk) {
    case Q_E2M1: go.template operator()<IN, Q_E2M1, U>(); break;
    case Q_E5M2: go.template operator()<IN, Q_E5M2, U>(); break;
    default: go.template operator()<IN, Q_E4M3FN, U>(); break;
    }
  };
  switch (in_kind(x->dtype)) {
  case IN_F16: go_in.template operator()<IN_F16, MX_U>(); break;
  case IN_BF16: go_in.template operator()<IN_BF16, MX_U>(); break;
  default: go_in.template operator()<IN_F32, MX_U>(); break;
  }
  return launched("quant.mx", err);
}

extern "C" moe_status moe_gpu_dequant_per_tensor(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_scaled_args *a = &c->args.scaled;
  const uint8_t *q = (const uint8_t *)c->in[0].tensor.data;
  void *y = c->out[0].tensor.data;
  size_t n = 0;
  moe_tensor_numel(&c->out[0].tensor, &n);
  if (n == 0) return MOE_OK;
  int vec = aligned(q, 8) && aligned(y, 16);
  unsigned grid = grid_for(b, n / VEC + 1, 8);
  hipStream_t st = moe_gpu_stream(b);
  float s = a->static_scale;
  auto go = [&]<int Q>() {
    switch (out_kind(a->out_dtype)) {
    case OUT_F16:
      dequant_per_tensor_kernel<Q, OUT_F16><<<grid, MOE_GPU_BLOCK, 0, st>>>(q, y, n, vec, s);
      break;
    case OUT_BF16:
      dequant_per_tensor_kernel<Q, OUT_BF16><<<grid, MOE_GPU_BLOCK, 0, st>>>(q, y, n, vec, s);
      break;
    default: dequant_per_tensor_kernel<Q, OUT_F32><<<grid, MOE_GPU_BLOCK, 0, st>>>(q, y, n, vec, s); break;
    }
  };
  switch (q_kind(a->qdtype)) {
  case Q_E4M3FNUZ: go.template operator()<Q_E4M3FNUZ>(); break;
  case Q_INT8: go.template operator()<Q_INT8>(); break;
  default: go.template operator()<Q_E4M3FN>(); break;
  }
  return launched("dequant.per_tensor", err);
}

extern "C" moe_status moe_gpu_dequant_mx(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_mx_args *a = &c->args.mx;
  const uint8_t *q = (const uint8_t *)c->in[0].tensor.data, *scales = (const uint8_t *)c->in[1].tensor.data;
  void *y = c->out[0].tensor.data;
  size_t n = 0;
  moe_tensor_numel(&c->out[0].tensor, &n);
  size_t nblocks = n / 32;
  if (nblocks == 0) return MOE_OK;
  int qk = q_kind(a->qdtype);
  int vec = aligned(q, qk == Q_E2M1 ? 4 : 8) && aligned(y, 16);
  unsigned grid = grid_for(b, nblocks * 4, 8);
  hipStream_t st = moe_gpu_stream(b);
  auto go = [&]<int Q>() {
    switch (out_kind(a->out_dtype)) {
    case OUT_F16:
      dequant_mx_kernel<Q, OUT_F16><<<grid, MOE_GPU_BLOCK, 0, st>>>(q, scales, y, nblocks, vec);
      break;
    case OUT_BF16:
      dequant_mx_kernel<Q, OUT_BF16><<<grid, MOE_GPU_BLOCK, 0, st>>>(q, scales, y, nblocks, vec);
      break;
    default: dequant_mx_kernel<Q, OUT_F32><<<grid, MOE_GPU_BLOCK, 0, st>>>(q, scales, y, nblocks, vec); break;
    }
  };
  switch (qk) {
  case Q_E2M1: go.template operator()<Q_E2M1>(); break;
  case Q_E5M2: go.template operator()<Q_E5M2>(); break;
  default: go.template operator()<Q_E4M3FN>(); break;
  }
  return launched("dequant.mx", err);
}
