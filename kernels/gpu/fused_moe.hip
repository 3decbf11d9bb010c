/* GPU: fused_moe (docs/numerics.md "fused_moe"). One pipeline, all on the
 * backend's stream, no host sync:
 *
 *   route       moe_gpu_route (topk.hip), when router_logits are given
 *   align       one block: the (token, k) slots grouped by local expert
 *               (counts, prefix sums, placement at per-expert cursors by
 *               shared-memory atomics), and the list of M tiles (expert,
 *               first row, rows <= BM) with its length, on the device
 *   gate_up     grouped GEMM over the tiles x strips of W13; activation in
 *               the epilogue -> a [slot rows in sorted order, I] (act dtype)
 *   down        grouped GEMM over the tiles x strips of W2; times the routed
 *               weight in the epilogue -> y [slot, H] (act dtype)
 *   sum         out[t] = act(sum over k of y[t, k] in k order, fp32)
 *
 * The GEMM grid is sized for the most tiles any routing can need; blocks
 * past the tile count the align step wrote return at once.
 *
 * The portable GEMM (below; AMD's only one, and NVIDIA's for the sets the
 * tensor cores do not take, or all with MOE_GPU_PORTABLE=1) serves every
 * scheme. Weight schemes are tile loaders (Loader<W>: chunk loads of one
 * weight row, and the dequantization of pieces of a chunk into fp32 via
 * codec.h: 16-bit values widened, wna16 act((q - z) * s), mxfp4
 * act(value * 2^(b - 127)), fp8 the e4m3fn codes' exact values), plugged
 * into the one GEMM kernel template. fp8 W8A8 quantizes each GEMM's input
 * first (fp8_act_rows: e4m3fn codes and their scales per tile row and K
 * block, quant.per_token_group's arithmetic, or the expert's static scale)
 * and scales the sums of code products in the GEMM (below); expert biases
 * are added to the sums in the epilogues, before the roundings of g, u and
 * y. Nothing else differs between schemes.
 *
 * Summation order (batch invariance): every dot product over K is split
 * across a group of 32 lanes (a warp on NVIDIA, half a wavefront on AMD).
 * K is walked as segments, each padded to whole steps of 32 chunks: one
 * segment of K, except fp8 with block scales, whose K blocks (BK columns)
 * are a segment each. Lane l owns the chunks l, l + 32, l + 64, ... of a
 * segment, adds their elements in ascending order into one fp32
 * accumulator (fmaf), and the 32 partial sums are combined by a fixed xor
 * butterfly (16, 8, 4, 2, 1). fp8 block scales: each segment's sum p_b is
 * scaled as p_b * (sx_b * sw_b) and added to the total in ascending b; one
 * segment: (p * sx) * sw (docs/numerics.md "Weight scheme fp8"). That order
 * depends on K and the scheme only: not on the token's tile, the tile
 * height BM (a launch choice from the batch size), the rows beside it (so
 * the order of an expert's rows, which align leaves to its atomics) or the
 * grid. No atomics, no split K. Results are deterministic; they are not
 * bit-identical to the CPU's (another summation order: docs/numerics.md's
 * tolerance applies). The file is built with FMA contraction on: the
 * contract's separate roundings around the scale products and bias adds
 * are written with add_rn / mul_rn. */
#include <stdlib.h>
#include <string.h>

#include "fused_moe_gpu.h"

namespace {

constexpr int LG = 32;                     /* lanes per dot-product group */
constexpr int GROUPS = MOE_GPU_BLOCK / LG; /* lane groups per block */
constexpr int NPW = 4;                     /* weight rows per lane group */
constexpr int KT = 1024;                   /* K positions staged in shared memory per step */
constexpr int KT_PHYS = KT + KT / 8;       /* + 4 floats of padding per 32: conflict-free reads */

/* weight kinds: 16-bit values, wna16 int4 / int8 codes, mxfp4 e2m1 codes, fp8 e4m3fn codes */
enum { W_BF16, W_F16, W_INT4, W_INT8, W_FP4, W_FP8 };

/* elements per chunk (one lane's load): 16 bytes; fp8 4, so that a K block
 * of 128 columns (DeepSeek-V3's BK) is one step of the 32 lanes */
__host__ __device__ constexpr int chunk_of(int w) {
  return w == W_INT4 || w == W_FP4 ? 32 : w == W_INT8 ? 16 : w == W_FP8 ? 4 : 8;
}
__host__ __device__ constexpr int chunk_bytes(int w) { return w == W_FP8 ? 4 : 16; }
/* elements per piece (one dequantization step; x read as one or two float4) */
__host__ __device__ constexpr int piece_of(int w) { return chunk_of(w) < 8 ? chunk_of(w) : 8; }

__device__ __forceinline__ int phys(int j) { return j + (j >> 5) * 4; }

__device__ __forceinline__ float load_float(const void *p, int dt, size_t i) {
  if (dt == MOE_F16) return moe_f16_to_f32(((const uint16_t *)p)[i]);
  if (dt == MOE_BF16) return moe_bf16_to_f32(((const uint16_t *)p)[i]);
  return ((const float *)p)[i];
}

/* a + b and a * b, each rounded, never fused with a neighbouring operation
 * into an fma (the file is built with contraction on) */
__device__ __forceinline__ float add_rn(float a, float b) {
#if defined(MOE_GPU_CUDA)
  return __fadd_rn(a, b);
#else
#pragma clang fp contract(off)
  return a + b;
#endif
}
__device__ __forceinline__ float mul_rn(float a, float b) {
#if defined(MOE_GPU_CUDA)
  return __fmul_rn(a, b);
#else
#pragma clang fp contract(off)
  return a * b;
#endif
}

/* The sum of v over the 32 lanes of a group, in the fixed butterfly order:
 * every lane gets the same bits. */
__device__ __forceinline__ float lane_sum(float v) {
#pragma unroll
  for (int o = LG / 2; o > 0; o >>= 1)
    v += MOE_SHFL_XOR(v, o);
  return v;
}

/* ---- weights: one GEMM's matrix on the device ---------------------------------- */

/* kernels/cpu/weight_format.h's moe_weight_matrix, device pointers. */
struct Wmat {
  const uint8_t *data;
  size_t row_bytes;
  int rows, cols;     /* per expert: N outputs x K inputs */
  const void *scales; /* wna16: scale_dt (F32, F16, BF16); mxfp4: e8m0 bytes; fp8: F32 weight scales */
  int scale_dt;
  const uint8_t *zeros; /* NULL: the midpoint */
  int group, groups;
  /* K as the lanes walk it: nseg segments of seg columns, each padded to
   * segp positions (whole steps); fp8 block scales: a K block (BK) each,
   * else one of K */
  int seg, nseg, segp;
  int wscale, bn;  /* fp8: moe_weight_scale, BN */
  int vec;         /* rows aligned to whole chunks and seg a multiple of the chunk: one load per chunk */
  int chunk_scale; /* group a multiple of the chunk: one scale per chunk */
  int sub_scale;   /* group a multiple of 8: one scale per 8-element piece */
};

/* fp8: the weight scale of row n of expert e in K block b */
__device__ __forceinline__ float fp8_wscale(const Wmat &m, int e, int n, int b) {
  const float *s = (const float *)m.scales;
  if (m.wscale == MOE_WSCALE_PER_TENSOR) return s[e];
  if (m.wscale == MOE_WSCALE_PER_CHANNEL) return s[(size_t)e * (size_t)m.rows + (size_t)n];
  const int nbn = (m.rows + m.bn - 1) / m.bn;
  return s[((size_t)e * (size_t)nbn + (size_t)(n / m.bn)) * (size_t)m.nseg + (size_t)b];
}

/* One lane's chunk of one weight row as loaded: its bytes of values or codes
 * and, with one scale group per chunk, its scale and zero point. */
struct Raw {
  uint4 v;
  float s, zb; /* scale; 2^23 + zero point */
};

template <int W> struct Loader {
  static constexpr int CH = chunk_of(W), CB = chunk_bytes(W), PE = piece_of(W);
  static constexpr bool WNA16 = W == W_INT4 || W == W_INT8;
  static constexpr bool GROUPED = WNA16 || W == W_FP4; /* a scale per group of columns */
  static constexpr int BITS = W == W_INT4 || W == W_FP4 ? 4 : W == W_INT8 || W == W_FP8 ? 8 : 16;

  /* 2^23 + z of row n, group g: (q | 2^23 as float) - (2^23 + z) is q - z exactly */
  static __device__ __forceinline__ float zero_bias(const Wmat &m, int e, int n, int g) {
    if (!WNA16) return 0.0f;
    float z;
    if (!m.zeros) {
      z = BITS == 4 ? 8.0f : 128.0f;
    } else if (BITS == 4) {
      uint32_t b =
          m.zeros[((size_t)e * (size_t)(m.rows / 2) + (size_t)(n / 2)) * (size_t)m.groups + (size_t)g];
      z = (float)((n & 1) ? b >> 4 : b & 15u);
    } else {
      z = (float)m.zeros[((size_t)e * (size_t)m.rows + (size_t)n) * (size_t)m.groups + (size_t)g];
    }
    return 8388608.0f + z;
  }
  static __device__ __forceinline__ float scale(const Wmat &m, int e, int n, int g) {
    const size_t i = ((size_t)e * (size_t)m.rows + (size_t)n) * (size_t)m.groups + (size_t)g;
    if (W == W_FP4) return moe_e8m0_to_f32(((const uint8_t *)m.scales)[i]); /* never 0xFF: refused at load */
    return load_float(m.scales, m.scale_dt, i);
  }
  /* the weight of code c: act-rounded, or fp8's exact value (the GEMM scales its sums) */
  template <int ACT> static __device__ __forceinline__ float value(uint32_t c, float s, float zb) {
    if (W == W_BF16) return moe_bf16_to_f32((uint16_t)c);
    if (W == W_F16) return moe_f16_to_f32((uint16_t)c);
    if (W == W_FP8) return moe_e4m3fn_to_f32((uint8_t)c);
    if (W == W_FP4) {
      const moe_narrow_fmt f = MOE_FMT_E2M1;
      return act_round<ACT>(moe_narrow_to_f32((uint8_t)c, &f) * s); /* exact product, one rounding */
    }
    return act_round<ACT>((moe_f32_from_bits(0x4B000000u | c) - zb) * s);
  }

  /* chunk of row n of expert e starting at column j0 */
  static __device__ __forceinline__ void load(const Wmat &m, int e, int n, int j0, bool valid, Raw &r) {
    r.v = make_uint4(0, 0, 0, 0);
    r.s = 0.0f;
    r.zb = 0.0f;
    if (!valid) return;
    const uint8_t *row = m.data + ((size_t)e * (size_t)m.rows + (size_t)n) * m.row_bytes;
    const size_t off = (size_t)j0 * BITS / 8;
    if (m.vec) {
      if (CB == 16)
        r.v = *(const uint4 *)(row + off);
      else
        r.v.x = *(const uint32_t *)(row + off);
    } else { /* tails and unaligned rows: bytes, zero past the row */
      uint32_t w[4] = {0, 0, 0, 0};
      for (int b = 0; b < CB; b++)
        if (off + (size_t)b < m.row_bytes) w[b >> 2] |= (uint32_t)row[off + (size_t)b] << (8 * (b & 3));
      r.v = make_uint4(w[0], w[1], w[2], w[3]);
    }
    if (GROUPED && m.chunk_scale) {
      const int g = j0 / m.group;
      r.s = scale(m, e, n, g);
      r.zb = zero_bias(m, e, n, g);
    }
  }

  /* w[q] = the weight at column j0 + PE p + q (value()); 0 at and past jend,
   * the end of the chunk's segment. */
  template <int ACT>
  static __device__ __forceinline__ void piece(const Wmat &m, const Raw &r, int e, int n, int j0, int jend,
                                               int p, bool valid, float w[PE]) {
    const uint32_t word[4] = {r.v.x, r.v.y, r.v.z, r.v.w};
    const int j = j0 + PE * p;
    if (!valid || (!m.vec && j >= jend)) { /* no row, or a piece past its segment */
#pragma unroll
      for (int q = 0; q < PE; q++)
        w[q] = 0.0f;
      return;
    }
    uint32_t code[PE];
#pragma unroll
    for (int q = 0; q < PE; q++) {
      const int i = PE * p + q; /* element of the chunk */
      code[q] = BITS == 4   ? (word[i >> 3] >> (4 * (i & 7))) & 15u
                : BITS == 8 ? (word[i >> 2] >> (8 * (i & 3))) & 0xFFu
                            : (word[i >> 1] >> (16 * (i & 1))) & 0xFFFFu;
    }
    if (!GROUPED) {
#pragma unroll
      for (int q = 0; q < PE; q++)
        w[q] = value<ACT>(code[q], 0.0f, 0.0f);
    } else if (m.chunk_scale || m.sub_scale) {
      float s = r.s, zb = r.zb;
      if (!m.chunk_scale) {
        const int g = j / m.group;
        s = scale(m, e, n, g);
        zb = zero_bias(m, e, n, g);
      }
#pragma unroll
      for (int q = 0; q < PE; q++)
        w[q] = value<ACT>(code[q], s, zb);
    } else { /* groups that split a piece (group sizes not a multiple of 8) */
#pragma unroll
      for (int q = 0; q < PE; q++) {
        const int g = (j + q < jend ? j + q : jend - 1) / m.group;
        w[q] = value<ACT>(code[q], scale(m, e, n, g), zero_bias(m, e, n, g));
      }
    }
    if (!m.vec) /* past the segment: zero (the staged x is zero there too) */
#pragma unroll
      for (int q = 0; q < PE; q++)
        if (j + q >= jend) w[q] = 0.0f;
  }
};

/* ---- fp8 W8A8: the GEMM inputs' codes ------------------------------------------------- */

struct ActQ {
  const void *x;    /* phase 1: hidden_states [T, K]; phase 2: a [slots, K] (act dtype) */
  int k, seg, nseg; /* K in nseg groups of seg columns (the GEMM's segments) */
  int phase, top_k;
  const int *sorted, *ntiles;
  const int4 *tiles;
  const float *static_scale; /* a13_scale / a2_scale [E]; NULL: dynamic */
  int exact;                 /* x / s, else x * (1 / s) */
  uint8_t *q;                /* e4m3fn codes [tile rows][K] */
  float *s;                  /* their scales [tile rows][nseg] */
};

/* Every tile row's input (phase 1: its token's hidden_states row; phase 2
 * its row of a) to e4m3fn codes, one scale per seg columns: dynamic as
 * quant.per_token_group / per_token make them (the finite amax, s =
 * amax / 448 or 1, codec.h's e4m3fn rounding of x * (1 / s) or x / s),
 * static with the tile's expert's scale: the CPU's codes bit for bit. A
 * lane group per (row, segment); blocks past the tile count return. */
template <int ACT> __global__ void __launch_bounds__(MOE_GPU_BLOCK) fp8_act_rows(ActQ a) {
  const int tid = (int)threadIdx.x, lane = tid % LG, grp = tid / LG;
  const int ntiles = *a.ntiles;
  const moe_narrow_fmt fmt = MOE_FMT_E4M3FN;
  for (int mt = (int)blockIdx.x; mt < ntiles; mt += (int)gridDim.x) {
    const int4 tile = a.tiles[mt];
    const int e = tile.x, row0 = tile.y, rows = tile.z;
    for (int u = (int)blockIdx.y * GROUPS + grp; u < rows * a.nseg; u += (int)gridDim.y * GROUPS) {
      const int p = row0 + u / a.nseg, b = u % a.nseg;
      const size_t src = a.phase == 1 ? (size_t)(a.sorted[p] / a.top_k) : (size_t)p;
      const uint16_t *in = (const uint16_t *)a.x + src * (size_t)a.k + (size_t)b * (size_t)a.seg;
      float s;
      if (a.static_scale) {
        s = a.static_scale[e];
      } else {
        uint32_t mx = 0; /* |v| bits of the finite values: their max is the amax */
        for (int j = lane; j < a.seg; j += LG) {
          const uint32_t bits = moe_f32_bits(from16<ACT>(in[j])) & 0x7FFFFFFFu;
          mx = bits < 0x7F800000u && bits > mx ? bits : mx;
        }
#pragma unroll
        for (int o = LG / 2; o > 0; o >>= 1) {
          const uint32_t t = MOE_SHFL_XOR(mx, o);
          mx = t > mx ? t : mx;
        }
        s = moe_dynamic_scale(moe_f32_from_bits(mx), 448.0f, false);
      }
      const float r = 1.0f / s;
      uint8_t *out = a.q + (size_t)p * (size_t)a.k + (size_t)b * (size_t)a.seg;
      for (int j = lane; j < a.seg; j += LG) {
        const float v = from16<ACT>(in[j]);
        out[j] = moe_f32_to_narrow(a.exact ? v / s : v * r, &fmt, false);
      }
      if (lane == 0) a.s[(size_t)p * (size_t)a.nseg + (size_t)b] = s;
    }
  }
}

/* ---- the grouped GEMM ------------------------------------------------------------ */

struct GemmArgs {
  Wmat w;
  int inter, hidden, top_k, activation, interleaved;
  const void *x;   /* phase 1: hidden_states [T, H]; phase 2: a [slots, I] (act dtype); fp8: their
                      e4m3fn codes, a row per tile row (fp8_act_rows) */
  int x_vec;       /* x rows aligned for one load of 8 elements and seg a multiple of 8 */
  const float *xs; /* fp8: the codes' scales [tile rows][nseg] */
  const int *sorted, *ntiles;
  const int4 *tiles; /* {local expert, first row in sorted order, rows, 0} */
  const float *tw;   /* routed weight of each slot */
  const void *bias;  /* the expert biases [E][N] in the files' row order (NULL: none) */
  int bias_dt;       /* their moe_dtype: F32, F16 or BF16 */
  uint16_t *out;     /* phase 1: a; phase 2: y [slots, H] */
};

/* Block (x, y): weight strip x (GROUPS x NPW rows: phase 1 two intermediate
 * units per lane group, gate and up rows; phase 2 four hidden rows) against
 * tiles y, y + gridDim.y, ... (BM token rows each). */
/* Tall tiles (BM = 8, many tokens: arithmetic-bound) get the registers of one
 * block per SM; short ones two blocks, for more loads in flight. */
template <int W, int ACT, int PHASE, int BM>
__global__ void __launch_bounds__(MOE_GPU_BLOCK, BM >= 8 ? 1 : 2) gemm_kernel(GemmArgs a) {
  using L = Loader<W>;
  constexpr int CH = L::CH, PE = L::PE;
  constexpr bool FP8 = W == W_FP8;
  constexpr int U = KT / (LG * CH); /* steps per staged tile */
  static_assert(BM * (PHASE == 1 ? 2 : NPW) <= LG, "one epilogue value per lane");
  static_assert(KT % (LG * CH) == 0 && CH % PE == 0, "whole steps per staged tile, whole pieces per chunk");
  __shared__ __align__(16) float xs[BM][KT_PHYS];
  __shared__ int slot_of[BM];
  const int tid = (int)threadIdx.x, lane = tid % LG, grp = tid / LG;
  const int K = a.w.cols, seg = a.w.seg, nseg = a.w.nseg, segp = a.w.segp;
  const int sps = segp / (LG * CH), nsteps = nseg * sps; /* steps per segment, in all */
  const int ntiles = *a.ntiles;

  /* this lane group's weight rows and whether they exist */
  int row[NPW];
  bool rvalid[NPW];
  int unit0 = 0;
  if (PHASE == 1) {
    unit0 = ((int)blockIdx.x * GROUPS + grp) * 2;
#pragma unroll
    for (int nn = 0; nn < NPW; nn++) {
      const int unit = unit0 + (a.interleaved ? nn >> 1 : nn & 1);
      row[nn] = a.interleaved ? 2 * unit0 + nn : (nn < 2 ? unit : a.inter + unit);
      rvalid[nn] = unit < a.inter;
    }
  } else {
#pragma unroll
    for (int nn = 0; nn < NPW; nn++) {
      row[nn] = ((int)blockIdx.x * GROUPS + grp) * NPW + nn;
      rvalid[nn] = row[nn] < a.hidden;
    }
  }

  /* this lane's chunk of step st: its first column j0 and the end of its
   * segment; false for the padding past the segment's columns */
  auto locate = [&](int st, int &j0, int &jend) {
    const int b = st / sps, o = (st - b * sps) * LG * CH + lane * CH;
    j0 = b * seg + o;
    jend = b * seg + seg;
    return o < seg;
  };

  for (int mt = (int)blockIdx.y; mt < ntiles; mt += (int)gridDim.y) {
    const int4 tile = a.tiles[mt];
    const int e = tile.x, row0 = tile.y, rows = tile.z;
    if (tid < BM) slot_of[tid] = tid < rows ? a.sorted[row0 + tid] : 0;

    /* K positions v0 .. v0 + KT of x's rows -> xs, fp32 (fp8: the codes'
     * values), zero in the padding and past the tile's rows */
    auto stage = [&](int v0) {
      for (int i = tid; i < BM * (KT / 8); i += MOE_GPU_BLOCK) {
        const int m = i / (KT / 8), c = i % (KT / 8), v = v0 + 8 * c;
        const int b = v / segp, o = v - b * segp;
        float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (m < rows && b < nseg && o < seg) {
          /* fp8 codes have a row per tile row; hidden_states one per token */
          const size_t xrow = PHASE == 1 && !FP8 ? (size_t)(slot_of[m] / a.top_k) : (size_t)(row0 + m);
          const size_t j = xrow * (size_t)K + (size_t)b * (size_t)seg + (size_t)o;
          if (FP8) {
            const uint8_t *src = (const uint8_t *)a.x + j;
            if (a.x_vec) {
              const uint2 u = *(const uint2 *)src;
#pragma unroll
              for (int q = 0; q < 8; q++)
                x[q] = moe_e4m3fn_to_f32((uint8_t)((q < 4 ? u.x : u.y) >> (8 * (q & 3))));
            } else {
              for (int q = 0; q < 8 && o + q < seg; q++)
                x[q] = moe_e4m3fn_to_f32(src[q]);
            }
          } else {
            const uint16_t *src = (const uint16_t *)a.x + j;
            if (a.x_vec) {
              const uint4 u = *(const uint4 *)src;
              const uint32_t wd[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
              for (int q = 0; q < 8; q++)
                x[q] = from16<ACT>((wd[q >> 1] >> (16 * (q & 1))) & 0xFFFFu);
            } else {
              for (int q = 0; q < 8 && o + q < seg; q++)
                x[q] = from16<ACT>(src[q]);
            }
          }
        }
        float4 *dst = (float4 *)&xs[m][phys(8 * c)];
        dst[0] = make_float4(x[0], x[1], x[2], x[3]);
        dst[1] = make_float4(x[4], x[5], x[6], x[7]);
      }
    };

    /* acc: this lane's sums of the current segment; tot: fp8 block scales'
     * running totals (every lane the same) */
    float acc[BM][NPW], tot[FP8 ? BM : 1][NPW];
#pragma unroll
    for (int m = 0; m < BM; m++)
#pragma unroll
      for (int nn = 0; nn < NPW; nn++)
        acc[m][nn] = 0.0f;
#pragma unroll
    for (int m = 0; m < (FP8 ? BM : 1); m++)
#pragma unroll
      for (int nn = 0; nn < NPW; nn++)
        tot[m][nn] = 0.0f;

    /* fp8 block scales: segment b's sums p_b (the butterfly) join tot as
     * p_b * (sx_b * sw_b), blocks in ascending order */
    auto fold = [&](int b) {
#pragma unroll
      for (int m = 0; m < (FP8 ? BM : 1); m++) {
        if (m < rows) {
          const float sx = a.xs[(size_t)(row0 + m) * (size_t)nseg + (size_t)b];
#pragma unroll
          for (int nn = 0; nn < NPW; nn++) {
            const float sw = fp8_wscale(a.w, e, rvalid[nn] ? row[nn] : 0, b);
            tot[m][nn] = add_rn(tot[m][nn], mul_rn(lane_sum(acc[m][nn]), mul_rn(sx, sw)));
            acc[m][nn] = 0.0f;
          }
        }
      }
    };

    auto load_step = [&](int st, Raw(&r)[NPW]) {
      int j0, jend;
      const bool in = locate(st, j0, jend);
#pragma unroll
      for (int nn = 0; nn < NPW; nn++)
        L::load(a.w, e, row[nn], j0, rvalid[nn] && in, r[nn]);
    };
    auto step = [&](int st, const Raw(&r)[NPW]) {
      if (st % U == 0) {
        __syncthreads(); /* everyone is done with the previous x tile (and slot_of is written) */
        stage(st / U * KT);
        __syncthreads();
      }
      int j0, jend;
      const bool in = locate(st, j0, jend);
      const int jt = (st % U) * LG * CH + lane * CH; /* the chunk's position in xs */
#pragma unroll
      for (int p = 0; p < CH / PE; p++) {
        float w[NPW][PE];
#pragma unroll
        for (int nn = 0; nn < NPW; nn++)
          L::template piece<ACT>(a.w, r[nn], e, row[nn], j0, jend, p, rvalid[nn] && in, w[nn]);
#pragma unroll
        for (int m = 0; m < BM; m++) {
          if (m < rows) {
            float xv[8];
            const float4 x0 = *(const float4 *)&xs[m][phys(jt + PE * p)];
            xv[0] = x0.x, xv[1] = x0.y, xv[2] = x0.z, xv[3] = x0.w;
            if (PE == 8) {
              const float4 x1 = *(const float4 *)&xs[m][phys(jt + PE * p) + 4];
              xv[4] = x1.x, xv[5] = x1.y, xv[6] = x1.z, xv[7] = x1.w;
            }
#pragma unroll
            for (int q = 0; q < PE; q++)
#pragma unroll
              for (int nn = 0; nn < NPW; nn++)
                acc[m][nn] = fmaf(xv[q], w[nn][q], acc[m][nn]);
          }
        }
      }
      if (FP8 && nseg > 1 && (st + 1) % sps == 0) fold(st / sps);
    };

    /* two chunks per row in flight: the next step's loads go out before this
     * step's arithmetic */
    Raw ra[NPW], rb[NPW];
    load_step(0, ra);
    for (int st = 0; st < nsteps; st += 2) {
      if (st + 1 < nsteps) load_step(st + 1, rb);
      step(st, ra);
      if (st + 2 < nsteps) load_step(st + 2, ra);
      if (st + 1 < nsteps) step(st + 1, rb);
    }

    /* every lane ends with the same full sums: the block totals, or the
     * fixed butterfly of its one segment */
#pragma unroll
    for (int m = 0; m < BM; m++) {
      if (m < rows) {
#pragma unroll
        for (int nn = 0; nn < NPW; nn++)
          acc[m][nn] = FP8 && nseg > 1 ? tot[FP8 ? m : 0][nn] : lane_sum(acc[m][nn]);
      }
    }

    /* the contract's SUM of token row m and weight row n: fp8 with one
     * segment scaled as (p * sx) * sw; then the expert's bias */
    auto finish = [&](float v, int m, int n) {
      if (FP8 && nseg == 1) v = mul_rn(mul_rn(v, a.xs[(size_t)(row0 + m)]), fp8_wscale(a.w, e, n, 0));
      if (a.bias) v = add_rn(v, load_float(a.bias, a.bias_dt, (size_t)e * (size_t)a.w.rows + (size_t)n));
      return v;
    };

    if (PHASE == 1) { /* lane 2 m + u: unit u of row m */
      const int lm = lane >> 1, lu = lane & 1;
      float g = 0.0f, u = 0.0f;
      int rg = 0, ru = 0;
#pragma unroll
      for (int m = 0; m < BM; m++)
#pragma unroll
        for (int uu = 0; uu < 2; uu++)
          if (lm == m && lu == uu) { /* constant indices: acc stays in registers */
            g = a.interleaved ? acc[m][2 * uu] : acc[m][uu];
            u = a.interleaved ? acc[m][2 * uu + 1] : acc[m][2 + uu];
            rg = a.interleaved ? row[2 * uu] : row[uu];
            ru = a.interleaved ? row[2 * uu + 1] : row[2 + uu];
          }
      const int unit = unit0 + lu;
      if (lm < rows && unit < a.inter) {
        g = finish(g, lm, rg);
        u = finish(u, lm, ru);
        const float v = activate<ACT>(a.activation, act_round<ACT>(g), act_round<ACT>(u));
        a.out[(size_t)(row0 + lm) * (size_t)a.inter + (size_t)unit] = to16<ACT>(v);
      }
    } else { /* lane NPW m + nn: hidden row nn of token row m */
      const int lm = lane / NPW, ln = lane % NPW;
      float v = 0.0f;
      int h = 0;
#pragma unroll
      for (int m = 0; m < BM; m++)
#pragma unroll
        for (int nn = 0; nn < NPW; nn++)
          if (lm == m && ln == nn) {
            v = acc[m][nn];
            h = row[nn];
          }
      if (lm < rows && h < a.hidden) {
        const int slot = slot_of[lm];
        a.out[(size_t)slot * (size_t)a.hidden + (size_t)h] = to16<ACT>(finish(v, lm, h) * a.tw[slot]);
      }
    }
    __syncthreads(); /* slot_of and xs are rewritten by the next tile */
  }
}

/* ---- align: slots grouped by local expert, and the tile list ----------------------- */

constexpr int ALIGN_THREADS = 1024, ALIGN_SMEM_EXPERTS = 2048, ALIGN_UNROLL = 8;

/* slot s's local expert, or -1 (past the end, or an expert held elsewhere) */
__device__ __forceinline__ int align_key(const int32_t *ids, int s, int n, int offset, int el) {
  const int le = s < n ? ids[s] - offset : -1;
  return le >= 0 && le < el ? le : -1;
}

/* The align passes, each run by one block's threads (blockDim.x, a power
 * of two <= ALIGN_THREADS) over slots lo..hi (ALIGN_UNROLL loads in flight
 * per thread). The order of an expert's slots among its rows is the order
 * the atomics happened to run in: nothing computed depends on it (each
 * output element is its own token row times the weights, docs/design.md). */
__device__ __forceinline__ void align_count(const int32_t *ids, int lo, int hi, int offset, int el,
                                            int *ctr) {
  const int tid = (int)threadIdx.x, nt = (int)blockDim.x;
  for (int base = lo; base < hi; base += nt * ALIGN_UNROLL) {
    int key[ALIGN_UNROLL];
#pragma unroll
    for (int u = 0; u < ALIGN_UNROLL; u++)
      key[u] = align_key(ids, base + u * nt + tid, hi, offset, el);
#pragma unroll
    for (int u = 0; u < ALIGN_UNROLL; u++)
      if (key[u] >= 0) atomicAdd(&ctr[key[u]], 1);
  }
}
/* each slot at its expert's cursor cur[e] (advanced) */
__device__ __forceinline__ void align_place(const int32_t *ids, int lo, int hi, int offset, int el, int *cur,
                                            int *sorted) {
  const int tid = (int)threadIdx.x, nt = (int)blockDim.x;
  for (int base = lo; base < hi; base += nt * ALIGN_UNROLL) {
    int key[ALIGN_UNROLL];
#pragma unroll
    for (int u = 0; u < ALIGN_UNROLL; u++)
      key[u] = align_key(ids, base + u * nt + tid, hi, offset, el);
#pragma unroll
    for (int u = 0; u < ALIGN_UNROLL; u++)
      if (key[u] >= 0) sorted[atomicAdd(&cur[key[u]], 1)] = base + u * nt + tid;
  }
}
/* Exclusive scans over experts of the counts ctr[e] (-> start) and of their
 * tile counts (-> tstart; start[el], tstart[el]: the totals, *ntiles),
 * blockDim.x experts at a time (integer sums: exact in any order); each
 * counter becomes its expert's first row. Ends with a block barrier. */
__device__ __forceinline__ void align_scan(int *ctr, int el, int bm, int *start, int *tstart, int *ntiles) {
  const int tid = (int)threadIdx.x, nt = (int)blockDim.x;
  __shared__ int s_pos[ALIGN_THREADS], s_til[ALIGN_THREADS];
  __shared__ int carry_pos, carry_til;
  if (tid == 0) carry_pos = carry_til = 0;
  for (int base = 0; base < el; base += nt) {
    const int e = base + tid;
    const int cnt = e < el ? ctr[e] : 0, til = (cnt + bm - 1) / bm;
    s_pos[tid] = cnt;
    s_til[tid] = til;
    __syncthreads();
    for (int o = 1; o < nt; o <<= 1) {
      const int a = tid >= o ? s_pos[tid - o] : 0, b = tid >= o ? s_til[tid - o] : 0;
      __syncthreads();
      s_pos[tid] += a;
      s_til[tid] += b;
      __syncthreads();
    }
    const int pos = carry_pos + s_pos[tid], t = carry_til + s_til[tid];
    __syncthreads(); /* every thread has read the carries */
    if (e < el) {
      start[e] = ctr[e] = pos - cnt;
      tstart[e] = t - til;
    }
    if (tid == nt - 1) {
      carry_pos = pos;
      carry_til = t;
    }
    __syncthreads();
  }
  if (tid == 0) {
    start[el] = carry_pos;
    tstart[el] = carry_til;
    *ntiles = carry_til;
  }
  __syncthreads();
}
/* the tile list: tile i belongs to the last expert whose first tile is <= i */
__device__ __forceinline__ void align_tiles(const int *start, const int *tstart, int el, int bm,
                                            int4 *tiles) {
  for (int i = (int)threadIdx.x; i < tstart[el]; i += (int)blockDim.x) {
    int lo = 0, hi = el - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tstart[mid] <= i)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int t = i - tstart[lo], cnt = start[lo + 1] - start[lo];
    tiles[i] = make_int4(lo, start[lo] + t * bm, min(bm, cnt - t * bm), 0);
  }
}

/* One block: count, scan, place, tiles. The counters live in shared memory
 * up to ALIGN_SMEM_EXPERTS local experts (SMEM), beyond in global scratch. */
template <bool SMEM>
__global__ void __launch_bounds__(ALIGN_THREADS)
    align_kernel(const int32_t *ids, int n, int el, int offset, int bm, int *scratch, int4 *tiles,
                 int *ntiles, int *sorted) {
  pdl_wait();
  __shared__ int s_ctr[SMEM ? ALIGN_SMEM_EXPERTS : 1], s_start[SMEM ? ALIGN_SMEM_EXPERTS + 1 : 1],
      s_tstart[SMEM ? ALIGN_SMEM_EXPERTS + 1 : 1];
  int *ctr = SMEM ? s_ctr : scratch, *start = SMEM ? s_start : scratch + el,
      *tstart = SMEM ? s_tstart : scratch + 2 * el + 1;
  for (int e = (int)threadIdx.x; e < el; e += (int)blockDim.x)
    ctr[e] = 0;
  __syncthreads();
  align_count(ids, 0, n, offset, el, ctr);
  __syncthreads();
  align_scan(ctr, el, bm, start, tstart, ntiles);
  align_place(ids, 0, n, offset, el, ctr, sorted);
  align_tiles(start, tstart, el, bm, tiles);
  pdl_next();
}

/* Large batches (one block's passes took 40 us at 32768 slots, the
 * three kernels below 8-10: Qwen3-30B-A3B bf16 T = 4096 -3%; at 8192 slots
 * they were 1% slower than the one block: ALIGN_MULTI_MIN). ALIGN_MULTI
 * blocks take a chunk each. 1: each block's counts per expert, hist[b][e];
 * 2 (one block): the totals' scans and the tile list, and each hist[b][e]
 * turned into block b's first row for expert e; 3: each block places its
 * chunk from there. Needs el <= ALIGN_SMEM_EXPERTS. */
constexpr int ALIGN_MULTI = 32, ALIGN_MULTI_MIN = 16384, ALIGN_MULTI_THREADS = 512;
__device__ __forceinline__ void align_chunk(int n, int &lo, int &hi) {
  const int per = (n + (int)gridDim.x - 1) / (int)gridDim.x;
  lo = (int)blockIdx.x * per;
  hi = min(n, lo + per);
}
__global__ void __launch_bounds__(ALIGN_MULTI_THREADS)
    align_multi_count(const int32_t *ids, int n, int el, int offset, int *hist) {
  pdl_wait();
  __shared__ int ctr[ALIGN_SMEM_EXPERTS];
  for (int e = (int)threadIdx.x; e < el; e += (int)blockDim.x)
    ctr[e] = 0;
  __syncthreads();
  int lo, hi;
  align_chunk(n, lo, hi);
  align_count(ids, lo, hi, offset, el, ctr);
  __syncthreads();
  pdl_next();
  for (int e = (int)threadIdx.x; e < el; e += (int)blockDim.x)
    hist[(size_t)blockIdx.x * el + e] = ctr[e];
}
__global__ void __launch_bounds__(ALIGN_THREADS)
    align_multi_scan(int *hist, int blocks, int el, int bm, int4 *tiles, int *ntiles) {
  pdl_wait();
  __shared__ int ctr[ALIGN_SMEM_EXPERTS], start[ALIGN_SMEM_EXPERTS + 1], tstart[ALIGN_SMEM_EXPERTS + 1];
  for (int e = (int)threadIdx.x; e < el; e += (int)blockDim.x) {
    int sum = 0;
    for (int b = 0; b < blocks; b++)
      sum += hist[(size_t)b * el + e];
    ctr[e] = sum;
  }
  __syncthreads();
  align_scan(ctr, el, bm, start, tstart, ntiles);
  for (int e = (int)threadIdx.x; e < el; e += (int)blockDim.x) {
    int row = start[e];
    for (int b = 0; b < blocks; b++) {
      const int c = hist[(size_t)b * el + e];
      hist[(size_t)b * el + e] = row;
      row += c;
    }
  }
  align_tiles(start, tstart, el, bm, tiles);
  pdl_next();
}
__global__ void __launch_bounds__(ALIGN_MULTI_THREADS)
    align_multi_place(const int32_t *ids, int n, int el, int offset, const int *hist, int *sorted) {
  pdl_wait();
  __shared__ int cur[ALIGN_SMEM_EXPERTS];
  for (int e = (int)threadIdx.x; e < el; e += (int)blockDim.x)
    cur[e] = hist[(size_t)blockIdx.x * el + e];
  __syncthreads();
  int lo, hi;
  align_chunk(n, lo, hi);
  align_place(ids, lo, hi, offset, el, cur, sorted);
  pdl_next();
}

/* ---- sum over k --------------------------------------------------------------------- */

/* y[slot, h .. h + 8) of a split down GEMM (moe_tc_split): its segments'
 * fp32 sums folded in segment order, times the routing weight, rounded to
 * act: what the unsplit epilogue stores. hidden % 8 == 0 (moe_tc_split). */
template <int ACT>
__device__ __forceinline__ uint4 fold_parts(const float *part, int split, size_t slots, int hidden,
                                            size_t slot, int h0, float w) {
  const float *p = part + slot * (size_t)hidden + (size_t)h0;
  float4 lo = *(const float4 *)p, hi = *(const float4 *)(p + 4);
  for (int s = 1; s < split; s++) {
    p += slots * (size_t)hidden;
    const float4 l = *(const float4 *)p, h = *(const float4 *)(p + 4);
    lo = make_float4(lo.x + l.x, lo.y + l.y, lo.z + l.z, lo.w + l.w);
    hi = make_float4(hi.x + h.x, hi.y + h.y, hi.z + h.z, hi.w + h.w);
  }
  uint4 u;
  u.x = to16<ACT>(lo.x * w) | (uint32_t)to16<ACT>(lo.y * w) << 16;
  u.y = to16<ACT>(lo.z * w) | (uint32_t)to16<ACT>(lo.w * w) << 16;
  u.z = to16<ACT>(hi.x * w) | (uint32_t)to16<ACT>(hi.y * w) << 16;
  u.w = to16<ACT>(hi.z * w) | (uint32_t)to16<ACT>(hi.w * w) << 16;
  return u;
}

/* out[t, h .. h + 8) = act(sum over k of y[t k + kk, ...]), experts held
 * elsewhere skipped; 8 columns per thread. With split > 1, y comes from
 * the down GEMM's segment sums (fold_parts). */
constexpr int SUM_K = 8;
template <int ACT>
__global__ void __launch_bounds__(MOE_GPU_BLOCK)
    sum_kernel(const uint16_t *y, const float *part, int split, const float *tw, const int32_t *ids,
               int tokens, int k, int hidden, int offset, int el, int vec, uint16_t *out) {
  pdl_wait();
  /* x: 8-column pieces of a row; y: rows, strided (no 64-bit division
   * per item, as a flat index needed) */
  const int piece = (int)(blockIdx.x * blockDim.x + threadIdx.x);
  if (piece >= (hidden + 7) / 8) return;
  const int h0 = piece * 8;
  for (int t = (int)blockIdx.y; t < tokens; t += (int)gridDim.y) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    /* SUM_K slots at a time: their ids, then their rows, are loaded
     * together (one memory round trip each, not one per slot); the adds
     * stay in ascending kk order */
    for (int k0 = 0; k0 < k; k0 += SUM_K) {
      const size_t slot0 = (size_t)t * (size_t)k + (size_t)k0;
      bool held[SUM_K];
#pragma unroll
      for (int j = 0; j < SUM_K; j++) {
        const int le = k0 + j < k ? ids[slot0 + j] - offset : -1;
        held[j] = le >= 0 && le < el;
      }
      if (vec || split > 1) {
        uint4 u[SUM_K];
#pragma unroll
        for (int j = 0; j < SUM_K; j++)
          if (held[j])
            u[j] = split > 1 ? fold_parts<ACT>(part, split, (size_t)tokens * (size_t)k, hidden, slot0 + j, h0,
                                               tw[slot0 + j])
                             : *(const uint4 *)(y + (slot0 + j) * (size_t)hidden + (size_t)h0);
#pragma unroll
        for (int j = 0; j < SUM_K; j++) {
          if (!held[j]) continue;
          const uint32_t wd[4] = {u[j].x, u[j].y, u[j].z, u[j].w};
#pragma unroll
          for (int q = 0; q < 8; q++)
            acc[q] += from16<ACT>((wd[q >> 1] >> (16 * (q & 1))) & 0xFFFFu);
        }
      } else {
        for (int j = 0; j < SUM_K; j++) {
          if (!held[j]) continue;
          const uint16_t *src = y + (slot0 + j) * (size_t)hidden + (size_t)h0;
          for (int q = 0; q < 8 && h0 + q < hidden; q++)
            acc[q] += from16<ACT>(src[q]);
        }
      }
    }
    uint16_t *dst = out + (size_t)t * (size_t)hidden + (size_t)h0;
    if (vec) {
      uint4 u;
      u.x = to16<ACT>(acc[0]) | (uint32_t)to16<ACT>(acc[1]) << 16;
      u.y = to16<ACT>(acc[2]) | (uint32_t)to16<ACT>(acc[3]) << 16;
      u.z = to16<ACT>(acc[4]) | (uint32_t)to16<ACT>(acc[5]) << 16;
      u.w = to16<ACT>(acc[6]) | (uint32_t)to16<ACT>(acc[7]) << 16;
      *(uint4 *)dst = u;
    } else {
      for (int q = 0; q < 8 && h0 + q < hidden; q++)
        dst[q] = to16<ACT>(acc[q]);
    }
  }
}

/* ---- host side ---------------------------------------------------------------------- */

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* The portable GEMM's weight kind of a set. */
int wkind(const moe_expert_config *cfg) {
  switch (cfg->scheme) {
  case MOE_SCHEME_BF16: return W_BF16;
  case MOE_SCHEME_FP16: return W_F16;
  case MOE_SCHEME_MXFP4: return W_FP4;
  case MOE_SCHEME_FP8: return W_FP8;
  default: return cfg->bits == 4 ? W_INT4 : W_INT8;
  }
}

/* kernels/cpu/weight_format.c moe_weight_matrix_init, over device copies. */
Wmat wmat(const moe_expert_config *cfg, bool w13, void *const dev[MOE_EXPERT_TENSOR_COUNT],
          const moe_expert_set *set) {
  Wmat m;
  memset(&m, 0, sizeof m);
  m.rows = (int)(w13 ? 2 * cfg->intermediate_size : cfg->hidden_size);
  m.cols = (int)(w13 ? cfg->hidden_size : cfg->intermediate_size);
  m.seg = m.cols;
  m.nseg = 1;
  m.group = m.cols;
  m.groups = 1;
  const int qs = w13 ? MOE_W13_QWEIGHT : MOE_W2_QWEIGHT, ss = w13 ? MOE_W13_SCALES : MOE_W2_SCALES;
  const int w = wkind(cfg);
  switch (w) {
  case W_BF16:
  case W_F16:
    m.data = (const uint8_t *)dev[w13 ? MOE_W13 : MOE_W2];
    m.row_bytes = (size_t)m.cols * 2;
    break;
  case W_FP4: /* e2m1 codes packed along K, e8m0 scales per 32 */
    m.data = (const uint8_t *)dev[qs];
    m.row_bytes = (size_t)m.cols / 2;
    m.scales = dev[ss];
    m.scale_dt = MOE_UINT8;
    m.group = 32;
    m.groups = m.cols / 32;
    break;
  case W_FP8: /* e4m3fn codes; the weight scales multiply the GEMM's sums */
    m.data = (const uint8_t *)dev[qs];
    m.row_bytes = (size_t)m.cols;
    m.scales = dev[ss];
    m.scale_dt = MOE_F32;
    m.wscale = (int)cfg->weight_scale;
    m.bn = (int)cfg->block_n;
    if (cfg->weight_scale == MOE_WSCALE_BLOCK) { /* BK divides K (validated) */
      m.seg = (int)cfg->block_k;
      m.nseg = m.cols / m.seg;
    }
    break;
  default: /* wna16 */
    m.data = (const uint8_t *)dev[qs];
    m.row_bytes = (size_t)(cfg->bits == 4 ? m.cols / 2 : m.cols);
    m.scales = dev[ss];
    m.scale_dt = (int)set->t[ss].dtype;
    m.zeros = cfg->has_zero_points ? (const uint8_t *)dev[w13 ? MOE_W13_QZEROS : MOE_W2_QZEROS] : NULL;
    m.group = (int)(cfg->group_size == -1 ? m.cols : cfg->group_size);
    m.groups = m.cols / m.group;
    break;
  }
  const int ch = chunk_of(w), cb = chunk_bytes(w), step = LG * ch;
  m.segp = (m.seg + step - 1) / step * step;
  m.vec = ((uintptr_t)m.data % (uintptr_t)cb) == 0 && m.row_bytes % (size_t)cb == 0 && m.seg % ch == 0;
  m.chunk_scale = m.vec && m.group % ch == 0;
  m.sub_scale = m.group % 8 == 0;
  return m;
}

/* K positions the portable GEMM walks (segments padded to whole steps) */
int64_t walked(const moe_expert_config *cfg, bool w13) {
  const int64_t k = w13 ? cfg->hidden_size : cfg->intermediate_size, step = LG * chunk_of(wkind(cfg));
  const int64_t seg =
      cfg->scheme == MOE_SCHEME_FP8 && cfg->weight_scale == MOE_WSCALE_BLOCK ? cfg->block_k : k;
  return k / seg * ((seg + step - 1) / step * step);
}

/* workspace offsets, 256-byte aligned */
struct Plan {
  size_t size = 0;
  bool overflow = false;
  size_t take(size_t count, size_t elem) {
    size_t off = size, bytes;
    if (!moe_mul_size(count, elem, &bytes) || !moe_add_size(bytes, 255, &bytes) ||
        !moe_add_size(size, bytes & ~(size_t)255, &size))
      overflow = true;
    return off;
  }
};

/* Instantiated: tile heights 1 and 8 only, and the 16-bit weight formats
 * with their own activation dtype only (the op rejects the others): the
 * file's compile time is that of these kernels. */
template <int W, int ACT> void launch_gemm(int phase, int bm, dim3 grid, hipStream_t st, const GemmArgs &g) {
  if (phase == 1 && bm == 1)
    gemm_kernel<W, ACT, 1, 1><<<grid, MOE_GPU_BLOCK, 0, st>>>(g);
  else if (phase == 1)
    gemm_kernel<W, ACT, 1, 8><<<grid, MOE_GPU_BLOCK, 0, st>>>(g);
  else if (bm == 1)
    gemm_kernel<W, ACT, 2, 1><<<grid, MOE_GPU_BLOCK, 0, st>>>(g);
  else
    gemm_kernel<W, ACT, 2, 8><<<grid, MOE_GPU_BLOCK, 0, st>>>(g);
}

template <int ACT> void launch_kind(int w, int phase, int bm, dim3 grid, hipStream_t st, const GemmArgs &g) {
  switch (w) {
  case W_INT4: launch_gemm<W_INT4, ACT>(phase, bm, grid, st, g); break;
  case W_INT8: launch_gemm<W_INT8, ACT>(phase, bm, grid, st, g); break;
  case W_FP4: launch_gemm<W_FP4, ACT>(phase, bm, grid, st, g); break;
  case W_FP8: launch_gemm<W_FP8, ACT>(phase, bm, grid, st, g); break;
  default: launch_gemm<ACT == A_BF16 ? W_BF16 : W_F16, ACT>(phase, bm, grid, st, g); break;
  }
}

} // namespace

bool moe_gpu_pdl(moe_backend *b) {
  static int off = -1; /* MOE_GPU_PDL=0, read once (a benign race: every thread reads the same) */
  if (off < 0) {
    const char *e = getenv("MOE_GPU_PDL");
    off = e && !strcmp(e, "0");
  }
#if defined(MOE_GPU_CUDA)
  return !off && moe_gpu_cc_major(b) >= 9;
#else
  (void)b;
  return false;
#endif
}

extern "C" moe_status moe_gpu_fused_moe(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_fused_args *args = &c->args.fused;
  const moe_expert_config *cfg = &args->set->cfg;
  const int64_t tokens = args->tokens, k = args->top_k;
  if (tokens == 0) return MOE_OK;
  const int64_t n64 = tokens * k, el = cfg->num_experts, hidden = cfg->hidden_size,
                inter = cfg->intermediate_size;
  if (n64 > 0x7FFFFFFF / 2 || el > 0x7FFFFFFF / 4 || hidden > 0x7FFFFFFF / 2 || inter > 0x7FFFFFFF / 4)
    return moe_fail(err, MOE_EUNSUPPORTED, "fused_moe on the GPU: sizes past 32-bit indexing");
  if (walked(cfg, true) > 0x3FFFFFFF || walked(cfg, false) > 0x3FFFFFFF)
    return moe_fail(err, MOE_EUNSUPPORTED,
                    "fused_moe on the GPU: block_k %lld: K blocks padded to whole steps of the portable GEMM "
                    "pass 32-bit indexing",
                    (long long)cfg->block_k);
  const int n = (int)n64;

  /* weights: inline ones are the call's inputs (device pointers already);
   * a loaded set's are uploaded once and cached by the backend */
  void *dev[MOE_EXPERT_TENSOR_COUNT] = {0};
  if (c->owned_set) {
    for (int s = 0; s < MOE_EXPERT_TENSOR_COUNT; s++)
      if (MOE_FUSED_IN_WEIGHTS + s < MOE_FUSED_IN_COUNT) dev[s] = c->in[MOE_FUSED_IN_WEIGHTS + s].tensor.data;
  } else {
    moe_status s = moe_gpu_set_weights(b, args->set, dev, err);
    if (s) return s;
  }

  /* The tensor-core path serves every shape and scheme it can (a property
   * of the set and the device, never of the call); its tile height (and
   * the portable path's) is a launch choice from the batch only: results
   * do not depend on it. MOE_GPU_FUSED_TILE=small|medium|wide|large|tall
   * forces one tensor-core configuration (tests compare them bit for bit). */
  const bool tc = moe_gpu_fused_tc(b, cfg);
  const int64_t avg = n64 / (el < n64 ? el : n64);
  int tc_config = moe_tc_choose(b, cfg, avg);
  if (const char *force = getenv("MOE_GPU_FUSED_TILE"))
    for (int i = 0; i < TC_CONFIGS; i++)
      if (!strcmp(force, moe_tc_config_names[i])) tc_config = i;
  const bool fp8 = cfg->scheme == MOE_SCHEME_FP8, blockwise = fp8 && cfg->weight_scale == MOE_WSCALE_BLOCK;
  if (fp8 && tc_config >= TC_LARGE) tc_config = TC_WIDE; /* fp8's largest tile (moe_tc_choose) */
  /* the bulk path's tiles are taller than the large configuration's (moe_tc_bulk_rows) */
  bool bulk = tc && moe_tc_bulk(b, cfg, tc_config);
  int bm = bulk ? moe_tc_bulk_rows(tc_config) : tc ? moe_tc_rows(tc_config) : avg < 4 ? 1 : 8;
  int64_t max_tiles = (n64 + bm - 1) / bm + (el < n64 ? el : n64);
  if (bulk && max_tiles * bm > 0x7FFFFFFF) { /* its K-major buffers' rows are int: the generic kernel */
    bulk = false;
    bm = moe_tc_rows(tc_config);
    max_tiles = (n64 + bm - 1) / bm + (el < n64 ? el : n64);
  }
  Plan p;
  const size_t o_ids = p.take(args->route ? (size_t)n : 0, 4), o_w = p.take(args->route ? (size_t)n : 0, 4);
  const bool multi = n >= ALIGN_MULTI_MIN && el <= ALIGN_SMEM_EXPERTS;
  const size_t o_scratch = p.take(multi                     ? (size_t)ALIGN_MULTI * (size_t)el
                                  : el > ALIGN_SMEM_EXPERTS ? 3 * (size_t)el + 2
                                                            : 0,
                                  4);
  const size_t o_tiles = p.take((size_t)max_tiles, sizeof(int4));
  const size_t o_ntiles = p.take(1, 4), o_sorted = p.take((size_t)n, 4);
  /* the bulk path's K-major buffers have a row per tile row (bm per tile) */
  const size_t rows_a = bulk ? (size_t)max_tiles * (size_t)bm : (size_t)n;
  const size_t o_xk = p.take(bulk ? rows_a * (size_t)hidden : 0, 2);
  const size_t o_next = p.take(bulk ? 2 : 0, 4);
  const size_t o_a = p.take(rows_a * (size_t)inter, 2), o_y = p.take((size_t)n * (size_t)hidden, 2);
  /* a split down GEMM's segment sums (moe_tc_split) */
  const int split = tc && !bulk ? moe_tc_split(cfg) : 1;
  const size_t o_part = p.take(split > 1 ? (size_t)split * (size_t)n * (size_t)hidden : 0, 4);
  /* fp8: each GEMM's activations as codes (fp16 values; gate_up's a row per
   * token unless static scales make them per expert, down's a row per slot)
   * and their scales (a row per slot, and gate_up's per token) */
  const int64_t xg1 = blockwise ? cfg->block_k : hidden, xg2 = blockwise ? cfg->block_k : inter;
  /* by token from 256 tokens: below, the scale copy's launch cost more than
   * the k-fold quantization saved (H200: Qwen3-30B-A3B T = 1 41 -> 49 us,
   * T = 4096 1770 -> 1580); the codes and scales are the same either way */
  const bool tc8 = tc && fp8, xtok = tc8 && !cfg->has_act_scales && tokens >= 256;
  const size_t xrows = (size_t)n + 128; /* + a tile of padding (TcArgs.xrows) */
  const size_t o_xq = p.take(tc8 ? (size_t)(xtok ? tokens : n) * (size_t)hidden : 0, 2),
               o_xs = p.take(tc8 ? xrows * (size_t)(hidden / xg1) : 0, 4),
               o_xt = p.take(xtok ? (size_t)tokens * (size_t)(hidden / xg1) : 0, 4),
               o_aq = p.take(tc8 ? (size_t)n * (size_t)inter : 0, 2),
               o_as = p.take(tc8 ? xrows * (size_t)(inter / xg2) : 0, 4);
  /* the portable path's fp8 codes and scales, a row per tile row (one GEMM's at a time) */
  const bool pfp8 = !tc && fp8;
  const size_t o_pq = p.take(pfp8 ? (size_t)n * (size_t)(hidden > inter ? hidden : inter) : 0, 1),
               o_ps = p.take(
                   pfp8 ? (size_t)n * (size_t)(hidden / xg1 > inter / xg2 ? hidden / xg1 : inter / xg2) : 0,
                   4);
  if (p.overflow) return moe_fail(err, MOE_EOVERFLOW, "fused_moe: workspace size overflows");
  char *ws = (char *)moe_gpu_workspace(b, p.size);
  if (!ws) return moe_fail(err, MOE_ENOMEM, "fused_moe: %zu bytes of device workspace", p.size);
  hipStream_t st = moe_gpu_stream(b);

  const int32_t *ids;
  const float *tw;
  if (args->route) {
    const float *bias =
        (const float *)(c->owned_set ? c->in[MOE_FUSED_IN_BIAS].tensor.data : dev[MOE_CORRECTION_BIAS]);
    moe_status s = moe_gpu_route(b, &c->in[MOE_FUSED_IN_LOGITS].tensor, bias, &args->routing,
                                 (int32_t *)(ws + o_ids), (float *)(ws + o_w), err);
    if (s) return s;
    ids = (const int32_t *)(ws + o_ids);
    tw = (const float *)(ws + o_w);
  } else {
    ids = (const int32_t *)c->in[MOE_FUSED_IN_IDS].tensor.data;
    tw = (const float *)c->in[MOE_FUSED_IN_TOPK_WEIGHTS].tensor.data;
  }

  int *ntiles = (int *)(ws + o_ntiles), *sorted = (int *)(ws + o_sorted);
  const int4 *tiles = (const int4 *)(ws + o_tiles);
  /* a small batch takes fewer threads (shorter scan, less to start) */
  const unsigned at = n <= 2048 ? 256 : ALIGN_THREADS;
  int *scratch = (int *)(ws + o_scratch);
  const bool pdl = moe_gpu_pdl(b);
  const int off = (int)cfg->expert_offset;
  moe_status s = MOE_OK;
  /* decode with 16-bit weights on the tensor cores: no align kernel, gate_up
   * aligns for itself (TcArgs.ids): Qwen3-30B-A3B bf16 T=1 -7%, a call
   * without weights -20%. The packed-code kernels took 2-4% longer with the
   * code in them (their decode loop is issue-bound; bench/RESULTS.md,
   * sixteenth pass), so they keep the align kernel. */
  const bool tiny =
      tc && !bulk && n <= 32 && (cfg->scheme == MOE_SCHEME_BF16 || cfg->scheme == MOE_SCHEME_FP16);
  if (tiny)
    ; /* tiny_align in gate_up */
  else if (multi) {
    s = moe_gpu_check(pdl_launch(pdl, 1, align_multi_count, dim3(ALIGN_MULTI), dim3(ALIGN_MULTI_THREADS), 0,
                                 st, ids, (int)n, (int)el, off, scratch),
                      "fused_moe align count", err);
    if (!s)
      s = moe_gpu_check(pdl_launch(pdl, 1, align_multi_scan, dim3(1), dim3(ALIGN_THREADS), 0, st, scratch,
                                   ALIGN_MULTI, (int)el, bm, (int4 *)(ws + o_tiles), ntiles),
                        "fused_moe align scan", err);
    if (!s)
      s = moe_gpu_check(pdl_launch(pdl, 1, align_multi_place, dim3(ALIGN_MULTI), dim3(ALIGN_MULTI_THREADS), 0,
                                   st, ids, (int)n, (int)el, off, (const int *)scratch, sorted),
                        "fused_moe align place", err);
  } else
    s = moe_gpu_check(pdl_launch(pdl, 1, el <= ALIGN_SMEM_EXPERTS ? align_kernel<true> : align_kernel<false>,
                                 dim3(1), dim3(at), 0, st, ids, (int)n, (int)el, off, bm, scratch,
                                 (int4 *)(ws + o_tiles), ntiles, sorted),
                      "fused_moe align", err);
  if (s) return s;

  const void *x = c->in[MOE_FUSED_IN_HIDDEN].tensor.data;
  uint16_t *a_buf = (uint16_t *)(ws + o_a), *y_buf = (uint16_t *)(ws + o_y);
  const int act = args->act == MOE_BF16 ? A_BF16 : A_F16;
  if (tc) {
    if (c->owned_set && (s = moe_gpu_inline_packed(b, args->set, dev, err))) return s;
    /* packed codes with per-group scales: wna16, and mxfp4 (groups of 32, e8m0 scales) */
    const bool mx = cfg->scheme == MOE_SCHEME_MXFP4, wna16 = cfg->scheme == MOE_SCHEME_WNA16 || mx;
    TcArgs t1;
    memset(&t1, 0, sizeof t1);
    t1.inter = (int)inter;
    t1.hidden = (int)hidden;
    t1.top_k = (int)k;
    t1.activation = (int)cfg->activation;
    t1.sorted = sorted;
    t1.ntiles = ntiles;
    t1.tiles = tiles;
    t1.tw = tw;
    t1.split = 1;
    TcArgs t2 = t1;
    t2.split = split;
    t2.slots = n;
    t2.part = split > 1 ? (float *)(ws + o_part) : NULL;
    for (int m = 0; m < 2; m++) {
      TcArgs &t = m == 0 ? t1 : t2;
      const int ws_ =
          wna16 || fp8 ? (m == 0 ? MOE_W13_QWEIGHT : MOE_W2_QWEIGHT) : (m == 0 ? MOE_W13 : MOE_W2);
      const int ss = m == 0 ? MOE_W13_SCALES : MOE_W2_SCALES, zs = m == 0 ? MOE_W13_QZEROS : MOE_W2_QZEROS;
      t.n = (int)(m == 0 ? 2 * inter : hidden);
      t.k = (int)(m == 0 ? hidden : inter);
      t.w = (const uint8_t *)dev[ws_];
      t.group = mx ? 32 : cfg->group_size == -1 || !wna16 ? t.k : (int)cfg->group_size;
      t.groups = t.k / t.group;
      if (wna16) {
        t.scale = (const float *)dev[ss];
        t.zero = cfg->has_zero_points ? (const uint8_t *)dev[zs] : NULL;
        t.scale16 = args->set->t[ss].dtype == args->act;
      }
      if (fp8) {
        t.wscale = (int)cfg->weight_scale;
        t.wsc = (const float *)dev[ss];
        t.bn = (int)cfg->block_n;
        t.bk = blockwise ? (int)cfg->block_k : t.k;
        t.xg = (int)(m == 0 ? xg1 : xg2);
        t.xs = (float *)(ws + (m == 0 ? o_xs : o_as));
        t.xrows = (int)xrows;
      }
      /* the expert biases, added to the sums in the epilogue (docs/numerics.md) */
      const int bs = m == 0 ? MOE_W13_BIAS : MOE_W2_BIAS;
      if (cfg->has_bias) {
        t.bias = dev[bs];
        t.bias_dt = (int)args->set->t[bs].dtype;
      }
      t.phase = m + 1;
    }
    if (tiny) {
      t1.ids = ids;
      t1.nids = (int)n;
      t1.el = (int)el;
      t1.offset = off;
    }
    t1.x = x;
    t1.x_vec = aligned16(x);
    t1.out = a_buf;
    t2.x = a_buf;
    t2.x_vec = 1;
    t2.out = y_buf;
    if (bulk) {
      t1.cap = t2.cap = (int)rows_a;
      t1.bt = t2.bt = bm;
      t1.next = (int *)(ws + o_next);
      t2.next = t1.next + 1;
      if ((s = moe_tc_gather(b, (int)max_tiles, t1, (uint16_t *)(ws + o_xk), err))) return s;
      t1.x = ws + o_xk;
    }
    /* fp8: each GEMM's activations quantized first (static scales: the set's a13 / a2) */
    const bool st_sc = fp8 && cfg->has_act_scales;
    if (fp8) {
      t1.x = ws + o_xq;
      t1.x_vec = 1;
      t1.xtok = xtok;
      if ((s = moe_tc_fp8_act(b, act, (int)max_tiles, t1, x, st_sc ? (const float *)dev[MOE_A13_SCALE] : NULL,
                              cfg->exact_division, (uint16_t *)(ws + o_xq), xtok ? (int)tokens : 0,
                              (float *)(ws + o_xt), err)))
        return s;
    }
    if ((s = moe_tc_gemm(b, cfg, act, tc_config, (int)max_tiles, t1, err))) return s;
    if (fp8) {
      t2.x = ws + o_aq;
      if ((s = moe_tc_fp8_act(b, act, (int)max_tiles, t2, a_buf,
                              st_sc ? (const float *)dev[MOE_A2_SCALE] : NULL, cfg->exact_division,
                              (uint16_t *)(ws + o_aq), 0, NULL, err)))
        return s;
    }
    if ((s = moe_tc_gemm(b, cfg, act, tc_config, (int)max_tiles, t2, err))) return s;
  } else {
    GemmArgs g1;
    memset(&g1, 0, sizeof g1);
    g1.inter = (int)inter;
    g1.hidden = (int)hidden;
    g1.top_k = (int)k;
    g1.activation = (int)cfg->activation;
    g1.interleaved = cfg->activation == MOE_ACT_SWIGLU_OAI;
    g1.sorted = sorted;
    g1.ntiles = ntiles;
    g1.tiles = tiles;
    g1.tw = tw;
    GemmArgs g2 = g1;
    g1.w = wmat(cfg, true, dev, args->set);
    g1.x = x;
    g1.x_vec = aligned16(x) && hidden % 8 == 0;
    g1.out = a_buf;
    g2.w = wmat(cfg, false, dev, args->set);
    g2.x = a_buf;
    g2.x_vec = inter % 8 == 0;
    g2.out = y_buf;
    if (cfg->has_bias) { /* added to the sums in the epilogues (docs/numerics.md "Expert biases") */
      g1.bias = dev[MOE_W13_BIAS];
      g1.bias_dt = (int)args->set->t[MOE_W13_BIAS].dtype;
      g2.bias = dev[MOE_W2_BIAS];
      g2.bias_dt = (int)args->set->t[MOE_W2_BIAS].dtype;
    }
    const unsigned gy = (unsigned)(max_tiles < 65535 ? max_tiles : 65535);
    const dim3 grid1((unsigned)((inter + 2 * GROUPS - 1) / (2 * GROUPS)), gy);
    const dim3 grid2((unsigned)((hidden + GROUPS * NPW - 1) / (GROUPS * NPW)), gy);
    const int w = wkind(cfg);
    for (int phase = 1; phase <= 2 && !s; phase++) {
      GemmArgs &g = phase == 1 ? g1 : g2;
      if (fp8) { /* the GEMM's input to e4m3fn codes first (static scales: the set's a13 / a2) */
        ActQ q;
        memset(&q, 0, sizeof q);
        q.x = g.x;
        q.k = g.w.cols;
        q.seg = g.w.seg;
        q.nseg = g.w.nseg;
        q.phase = phase;
        q.top_k = (int)k;
        q.sorted = sorted;
        q.ntiles = ntiles;
        q.tiles = tiles;
        q.static_scale =
            cfg->has_act_scales ? (const float *)dev[phase == 1 ? MOE_A13_SCALE : MOE_A2_SCALE] : NULL;
        q.exact = cfg->exact_division;
        q.q = (uint8_t *)(ws + o_pq);
        q.s = (float *)(ws + o_ps);
        const int64_t units = (int64_t)bm * q.nseg, qy = (units + GROUPS - 1) / GROUPS;
        const dim3 qgrid(gy, (unsigned)(qy < 64 ? qy : 64));
        if (act == A_BF16)
          fp8_act_rows<A_BF16><<<qgrid, MOE_GPU_BLOCK, 0, st>>>(q);
        else
          fp8_act_rows<A_F16><<<qgrid, MOE_GPU_BLOCK, 0, st>>>(q);
        g.x = q.q;
        g.x_vec = q.seg % 8 == 0; /* rows of K = nseg x seg bytes in a 256-byte aligned buffer */
        g.xs = q.s;
      }
      if (act == A_BF16)
        launch_kind<A_BF16>(w, phase, bm, phase == 1 ? grid1 : grid2, st, g);
      else
        launch_kind<A_F16>(w, phase, bm, phase == 1 ? grid1 : grid2, st, g);
      s = moe_gpu_check(hipGetLastError(), phase == 1 ? "fused_moe gate_up" : "fused_moe down", err);
    }
    if (s) return s;
  }

  void *out = c->out[0].tensor.data;
  const int vec = aligned16(out) && hidden % 8 == 0;
  /* a row's pieces across x, rows across y: about 16 blocks per SM in all */
  const int64_t gx = ((hidden + 7) / 8 + MOE_GPU_BLOCK - 1) / MOE_GPU_BLOCK,
                want = (int64_t)moe_gpu_sm_count(b) * 16 / gx;
  const int64_t gy = want < 1 ? 1 : want > tokens ? tokens : want > 65535 ? 65535 : want;
  return moe_gpu_check(pdl_launch(pdl, 1, args->act == MOE_BF16 ? sum_kernel<A_BF16> : sum_kernel<A_F16>,
                                  dim3((unsigned)gx, (unsigned)gy), dim3(MOE_GPU_BLOCK), 0, st,
                                  (const uint16_t *)y_buf, (const float *)(ws + o_part), split, tw, ids,
                                  (int)tokens, (int)k, (int)hidden, (int)cfg->expert_offset, (int)el, vec,
                                  (uint16_t *)out),
                       "fused_moe sum", err);
}
