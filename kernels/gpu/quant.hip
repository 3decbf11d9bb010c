/* GPU: every quant op (docs/numerics.md quant.per_tensor, quant.per_token,
 * quant.mx, dequant.per_tensor, dequant.mx), bit-exact with the CPU backend
 * (kernels/cpu/quant_scaled.c, quant_mx.c).
 *
 * Every conversion is a codec.h function (the one definition both backends
 * compile); kernels only move bytes and reduce. Each thread handles 8
 * consecutive elements: one 16-byte load of 16-bit input (two of fp32) and
 * one 8-byte store of fp8/int8 codes (4 bytes of fp4), coalesced across the
 * warp. A scalar path covers misaligned buffers and tails. Reductions are
 * integer maxima of |x| bits (exact, so order-free); no atomics. Warp size
 * 32 or 64: shuffles use at most 4-lane groups or the full warpSize. Built
 * with --fmad=false / -ffp-contract=off and denormals preserved. */
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

template <int IN> __device__ __forceinline__ void load8_any(const void *x, size_t i, float v[VEC], bool vec) {
  if (vec) {
    load8<IN>(x, i, v);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; k++)
      v[k] = load1<IN>(x, i + k);
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
 * NaN -> 0x7F), and cvt.rni.s32.f32 (NaN -> 0) clamped to [-128, 127]. Other
 * targets and formats (e4m3fnuz, e2m1; AMD) use codec.h. The GPU test runs
 * both paths (MOE_GPU_PORTABLE=1 forces the codec). */
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
  if (Q == Q_INT8) {
    int a = __float2int_rn(lo), b = __float2int_rn(hi);
    a = a < -128 ? -128 : a > 127 ? 127 : a;
    b = b < -128 ? -128 : b > 127 ? 127 : b;
    return ((uint32_t)a & 0xFFu) | ((uint32_t)b & 0xFFu) << 8;
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

/* ---- quant.per_tensor ---------------------------------------------------------- */

/* Pass 1 of the dynamic scale: one partial amax (bits) per block. */
template <int IN>
__global__ void __launch_bounds__(MOE_GPU_BLOCK)
    amax_partials(const void *x, size_t n, int vec, uint32_t *partials) {
  size_t nv = vec ? n / VEC : 0;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t m = 0;
  for (size_t v = t; v < nv; v += 2 * stride) {
    float a[VEC], b[VEC];
    bool two = v + stride < nv;
    load8<IN>(x, v * VEC, a);
    if (two) load8<IN>(x, (v + stride) * VEC, b);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
      uint32_t u = finite_abs_bits(a[k]), w = two ? finite_abs_bits(b[k]) : 0u;
      m = u > m ? u : m;
      m = w > m ? w : m;
    }
  }
  for (size_t i = nv * VEC + t; i < n; i += stride) {
    uint32_t u = finite_abs_bits(load1<IN>(x, i));
    m = u > m ? u : m;
  }
  m = block_max(m);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

/* q = cvt(x * (1/s)) or cvt(x / s). The scale is `s_static`, or (partials
 * given) amax of the partials / dtype_max, reduced by every block alike. */
template <int IN, int Q, bool HW>
__global__ void __launch_bounds__(MOE_GPU_BLOCK)
    quant_per_tensor_kernel(const void *x, uint8_t *q, size_t n, int vec, float s_static,
                            const uint32_t *partials, int npart, float dtype_max, int exact,
                            float *scale_out) {
  float s = s_static;
  if (partials) {
    uint32_t m = 0;
    for (int i = (int)threadIdx.x; i < npart; i += (int)blockDim.x)
      m = partials[i] > m ? partials[i] : m;
    s = moe_dynamic_scale(moe_f32_from_bits(block_max(m)), dtype_max, false);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = s;
  const float r = 1.0f / s;
  size_t nv = vec ? n / VEC : 0;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (size_t v = t; v < nv; v += 2 * stride) {
    float a[VEC], b[VEC];
    bool two = v + stride < nv;
    load8<IN>(x, v * VEC, a);
    if (two) load8<IN>(x, (v + stride) * VEC, b);
    encode8<Q, HW>(a, s, r, exact, q, v * VEC, true);
    if (two) encode8<Q, HW>(b, s, r, exact, q, (v + stride) * VEC, true);
  }
  for (size_t i = nv * VEC + t; i < n; i += stride) {
    float v = load1<IN>(x, i);
    q[i] = (uint8_t)encode<Q>(exact ? v / s : v * r, false);
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

/* ---- quant.per_token, quant.per_token_group ------------------------------------------ */

/* One block per row (per_token) or per group of a row (per_token_group
 * with wide or unaligned groups). The first CACHE vectors of each thread stay in
 * registers between the amax pass and the encode pass (a 7168-wide bf16 row
 * is read once); wider rows re-read the rest (from L2). */
template <int IN, int Q, bool HW>
__global__ void __launch_bounds__(MOE_GPU_BLOCK, IN == IN_F32 ? 3 : 5) /* rows in flight per SM */
    quant_per_token_kernel(const void *x, uint8_t *q, float *scales, int64_t rows, int64_t k, int vec,
                           float dtype_max, int has_ub, float ub, int pow2, int exact) {
  constexpr int CACHE = 4;
  const size_t nv = vec ? (size_t)k / VEC : 0;
  const size_t bd = blockDim.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const size_t base = (size_t)row * (size_t)k;
    raw8<IN> c[CACHE];
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < CACHE; j++) {
      size_t v = threadIdx.x + j * bd;
      if (v < nv) load_raw8<IN>(x, base + v * VEC, c[j]);
    }
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

/* Four consecutive lanes share one 32-element block (8 elements each); the
 * block's amax and NaN/inf flag meet through two xor-shuffles inside the
 * 4-lane group, which is whole for warp size 32 and 64. The loop bound is
 * block-uniform so that every lane reaches every shuffle. */
/* One thread's 8 elements e (vector v) of a 32-element block: every lane of
 * the warp calls this (active or not) so that the shuffles are whole. */
template <int Q, bool HW>
__device__ __forceinline__ void mx_part(const float e[VEC], size_t v, bool active, uint8_t *q,
                                        uint8_t *scales, int vec, int rule, int half_up) {
  const moe_narrow_fmt f = fmt_of<Q>();
  uint32_t m = 0, special = 0;
#pragma unroll
  for (int k = 0; k < VEC; k++) {
    uint32_t b = moe_f32_bits(e[k]) & 0x7FFFFFFFu;
    special |= b >= 0x7F800000u;
    m = b > m ? b : m;
  }
  uint32_t t = MOE_SHFL_XOR(m, 1);
  m = t > m ? t : m;
  t = MOE_SHFL_XOR(m, 2);
  m = t > m ? t : m;
  special |= MOE_SHFL_XOR(special, 1);
  special |= MOE_SHFL_XOR(special, 2);
  if (!active) return;
  uint32_t c[VEC];
  uint8_t sbyte;
  if (special) { /* OCP: a NaN scale makes the whole block NaN */
    sbyte = 0xFF;
#pragma unroll
    for (int k = 0; k < VEC; k++)
      c[k] = 0;
  } else {
    float mult;
    sbyte = moe_mx_scale(moe_f32_from_bits(m), (moe_mx_rule)rule, &f, &mult);
    if (HW && hw_has<Q>()) {
#pragma unroll
      for (int k = 0; k < VEC / 2; k++) {
        uint32_t pr = encode2_hw<Q>(e[2 * k] * mult, e[2 * k + 1] * mult);
        c[2 * k] = pr & 0xFFu;
        c[2 * k + 1] = pr >> 8;
      }
    } else {
#pragma unroll
      for (int k = 0; k < VEC; k++)
        c[k] = encode<Q>(e[k] * mult, Q == Q_E2M1 && half_up);
    }
  }
  if (Q == Q_E2M1) {
    uint32_t w =
        c[0] | c[1] << 4 | c[2] << 8 | c[3] << 12 | c[4] << 16 | c[5] << 20 | c[6] << 24 | c[7] << 28;
    if (vec) {
      *(uint32_t *)(q + v * 4) = w;
    } else {
#pragma unroll
      for (int k = 0; k < 4; k++)
        q[v * 4 + k] = (uint8_t)(w >> (8 * k));
    }
  } else {
    uint2 w =
        make_uint2(c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24, c[4] | c[5] << 8 | c[6] << 16 | c[7] << 24);
    if (vec) {
      *(uint2 *)(q + v * VEC) = w;
    } else {
#pragma unroll
      for (int k = 0; k < 4; k++) {
        q[v * VEC + k] = (uint8_t)(w.x >> (8 * k));
        q[v * VEC + 4 + k] = (uint8_t)(w.y >> (8 * k));
      }
    }
  }
  if ((v & 3) == 0) scales[v >> 2] = sbyte;
}

/* One vector per thread per step (measured on the H200: two per step ran
 * mxfp8 at 69% of copy bandwidth instead of 81%); the step bound is
 * block-uniform so that every lane reaches the shuffles. */
template <int IN, int Q, bool HW>
__global__ void __launch_bounds__(MOE_GPU_BLOCK)
    quant_mx_kernel(const void *x, uint8_t *q, uint8_t *scales, size_t nblocks, int vec, int rule,
                    int half_up) {
  const size_t nv = nblocks * 4;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t v0 = (size_t)blockIdx.x * blockDim.x; v0 < nv; v0 += stride) {
    const size_t v = v0 + threadIdx.x;
    const bool active = v < nv;
    float e[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++)
      e[k] = 0.0f;
    if (active) load8_any<IN>(x, v * VEC, e, vec);
    mx_part<Q, HW>(e, v, active, q, scales, vec, rule, half_up);
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

moe_status launched(const char *what, moe_error *err) { return moe_gpu_check(hipGetLastError(), what, err); }

/* Vendor fast path unless MOE_GPU_PORTABLE is set (non-empty, not "0"). */
bool use_hw() {
  static int hw = -1;
  if (hw < 0) {
    const char *e = getenv("MOE_GPU_PORTABLE");
    hw = !(e && *e && strcmp(e, "0") != 0);
  }
  return hw != 0;
}

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
  if (!a->has_static_scale) {
    npart = (int)grid_for(b, (n / VEC + 1) / 2 + 1, 8);
    partials = (uint32_t *)moe_gpu_workspace(b, (size_t)npart * sizeof *partials);
    if (!partials) return moe_fail(err, MOE_ENOMEM, "quant.per_tensor: device workspace");
    switch (in_kind(x->dtype)) {
    case IN_F16: amax_partials<IN_F16><<<npart, MOE_GPU_BLOCK, 0, st>>>(x->data, n, vec, partials); break;
    case IN_BF16: amax_partials<IN_BF16><<<npart, MOE_GPU_BLOCK, 0, st>>>(x->data, n, vec, partials); break;
    default: amax_partials<IN_F32><<<npart, MOE_GPU_BLOCK, 0, st>>>(x->data, n, vec, partials); break;
    }
    moe_status s = launched("quant.per_tensor amax", err);
    if (s) return s;
  }
  unsigned grid = grid_for(b, (n / VEC + 1) / 2 + 1, 8);
  float s_static = a->has_static_scale ? a->static_scale : 1.0f;
  dispatch_in_q(in_kind(x->dtype), q_kind(a->qdtype), [&]<int IN, int Q>() {
    if (hw)
      quant_per_tensor_kernel<IN, Q, true><<<grid, MOE_GPU_BLOCK, 0, st>>>(
          x->data, q, n, vec, s_static, partials, npart, a->dtype_max, a->exact_division, scale_out);
    else
      quant_per_tensor_kernel<IN, Q, false><<<grid, MOE_GPU_BLOCK, 0, st>>>(
          x->data, q, n, vec, s_static, partials, npart, a->dtype_max, a->exact_division, scale_out);
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
  unsigned grid = (unsigned)((size_t)rows < cap ? (size_t)rows : cap);
  dispatch_in_q(in_kind(x->dtype), q_kind(a->qdtype), [&]<int IN, int Q>() {
    if (hw)
      quant_per_token_kernel<IN, Q, true>
          <<<grid, MOE_GPU_BLOCK, 0, st>>>(x->data, q, scales, rows, k, vec, a->dtype_max, a->has_scale_ub,
                                           a->scale_ub, a->pow2_scale, a->exact_division);
    else
      quant_per_token_kernel<IN, Q, false>
          <<<grid, MOE_GPU_BLOCK, 0, st>>>(x->data, q, scales, rows, k, vec, a->dtype_max, a->has_scale_ub,
                                           a->scale_ub, a->pow2_scale, a->exact_division);
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
  int vec = aligned(x->data, 16) && aligned(q, qk == Q_E2M1 ? 4 : 8);
  unsigned grid = grid_for(b, nblocks * 4, 8);
  hipStream_t st = moe_gpu_stream(b);
  auto go = [&]<int IN>() {
    switch (qk) {
    case Q_E2M1:
      quant_mx_kernel<IN, Q_E2M1, false>
          <<<grid, MOE_GPU_BLOCK, 0, st>>>(x->data, q, scales, nblocks, vec, a->rule, a->half_up);
      break;
    case Q_E5M2:
      if (hw)
        quant_mx_kernel<IN, Q_E5M2, true>
            <<<grid, MOE_GPU_BLOCK, 0, st>>>(x->data, q, scales, nblocks, vec, a->rule, 0);
      else
        quant_mx_kernel<IN, Q_E5M2, false>
            <<<grid, MOE_GPU_BLOCK, 0, st>>>(x->data, q, scales, nblocks, vec, a->rule, 0);
      break;
    default:
      if (hw)
        quant_mx_kernel<IN, Q_E4M3FN, true>
            <<<grid, MOE_GPU_BLOCK, 0, st>>>(x->data, q, scales, nblocks, vec, a->rule, 0);
      else
        quant_mx_kernel<IN, Q_E4M3FN, false>
            <<<grid, MOE_GPU_BLOCK, 0, st>>>(x->data, q, scales, nblocks, vec, a->rule, 0);
      break;
    }
  };
  switch (in_kind(x->dtype)) {
  case IN_F16: go.template operator()<IN_F16>(); break;
  case IN_BF16: go.template operator()<IN_BF16>(); break;
  default: go.template operator()<IN_F32>(); break;
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
