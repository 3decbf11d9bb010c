/* GPU: fused_moe's GEMMs on the tensor cores (NVIDIA sm_80+: mma.sync
 * m16n8k16, bf16/fp16 operands, fp32 accumulators; cp.async pipeline).
 * fused_moe.hip runs the pipeline (route, align, sum) and calls
 * moe_tc_gemm for gate_up and down when moe_gpu_fused_packs says the set's
 * shape and scheme run here; everything else (and AMD) takes the portable
 * GEMM in fused_moe.hip.
 *
 * Operands. A = the weights (16 rows of W per mma: the mma's M is the
 * GEMM's N), B = the tokens of one expert's tile (8 per mma: n8). A is
 * read from a packed copy made once when the weights reach the device
 * (moe_tc_pack). 16-bit weights: for each 64-column block of K, every
 * row's 128 bytes with their 16-byte chunks in the stage's swizzled order,
 * so a stage's A is one contiguous run (16-byte cp.async copies, or one
 * bulk copy) that wgmma reads from shared memory (sm_90a) or ldmatrix
 * loads (mma.sync). Quantized codes: for each 16-row x 64-column block,
 * the 32 lanes' fragment registers lane after lane, so each lane reads its
 * codes with one 16-byte shared load and dequantizes them in registers
 * (wgmma with A from registers). int4 codes are stored so that one lop3 makes two 16-bit
 * floats (code | 0x4300 in bf16 = 128 + q, | 0x6400 in fp16 = 1024 + q);
 * int8 codes by prmt (fp16: 0x64qq) or through fp32 (bf16: 0x4B0000qq).
 * docs/numerics.md's w = act((q - z) * s): (q - z) is an exact small integer in
 * either form; when the scales are in the activation dtype, one packed
 * 16-bit multiply by s rounds the exact product once, which is the
 * contract's fp32 product (exact: at most 9 x 11 significant bits) rounded
 * to act; other scales take an fp32 multiply and one conversion, as the
 * contract writes it. W13's rows are packed as 8 gate rows then the 8 up
 * rows of the same units in each 16-row block, so one lane holds a unit's
 * gate and up sums and applies the activation in registers.
 *
 * Batch invariance. Every output element (weight row n, token slot) is one
 * fp32 accumulator that starts at 0 and takes one mma.m16n8k16 per 16
 * columns of K in ascending order: the same instruction on the same 16 +
 * 16 operand values in the same order whatever the tile configuration
 * (BT, BN, warp layout: chosen from the batch size), the token's position
 * in its tile, the other tokens, or the grid. No atomics. The one K split
 * (moe_tc_split) is a property of the set's shape and scheme: for such a
 * set every batch size and configuration accumulates the same K segments
 * from 0 and the sum kernel folds them in segment order. The dequantized
 * weights are the same bits in every configuration (the per-group path is
 * chosen from the set's dtypes, not from the call).
 * Results are deterministic and independent of batching; across backends
 * docs/numerics.md's tolerance applies (another summation order than the CPU).
 *
 * The large tile with 16-bit weights on sm_90a runs tc_gemm_bulk (one
 * copying thread, mbarriers, no block barrier; see there), the rest
 * tc_gemm.
 *
 * Grid: x = the tile list, y = the weight strips; blocks run in groups of
 * RASTER tiles x every strip (tiles fastest), so the tiles of one expert
 * that share a weight strip run together and hit L2. Blocks past the tile
 * count the align step wrote return at once. (The bulk kernel takes the
 * same (tile, strip) order from a counter, one block per SM.)
 *
 * Pipeline (sm_90a): a stage's wgmma group stays in flight while the next
 * stage is dequantized and issued (wgmma.wait_group 1), so a stage slot is
 * refilled two stages after its use and the fragment registers alternate
 * between two buffers that are kept live until their products are done. */
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "../ops/backend_impl.h" /* b->device */
#include "fused_moe_gpu.h"

/* moe_tc_packed_bytes is plain arithmetic on the configuration; the rest
 * exists on NVIDIA only (AMD: moe_gpu_fused_packs is false). */
size_t moe_tc_packed_bytes(const moe_expert_config *cfg, int slot) {
  const size_t e = (size_t)cfg->num_experts, h = (size_t)cfg->hidden_size,
               in = (size_t)cfg->intermediate_size;
  const bool w13 =
      slot == MOE_W13 || slot == MOE_W13_QWEIGHT || slot == MOE_W13_SCALES || slot == MOE_W13_QZEROS;
  const size_t n = w13 ? 2 * in : h, k = w13 ? h : in;
  const bool fp4 = cfg->scheme == MOE_SCHEME_MXFP4;
  const size_t groups = fp4 ? k / 32 : cfg->group_size == -1 ? 1 : k / (size_t)cfg->group_size;
  /* fp8: the codes in the int8 fragment order; the scales stay as the files have them */
  if (cfg->scheme == MOE_SCHEME_FP8) return slot == MOE_W13_QWEIGHT || slot == MOE_W2_QWEIGHT ? e * n * k : 0;
  if (cfg->scheme != MOE_SCHEME_WNA16 && !fp4) return slot == MOE_W13 || slot == MOE_W2 ? e * n * k * 2 : 0;
  if (slot == MOE_W13_QWEIGHT || slot == MOE_W2_QWEIGHT) return e * n * k * (fp4 ? 4 : (size_t)cfg->bits) / 8;
  /* scales: fp32, or mxfp4's e8m0 bytes as they are (a quarter of the bytes a decode stage copies)
   * and then a flag byte per expert and 16 rows (moe_tc_pack) */
  if (slot == MOE_W13_SCALES || slot == MOE_W2_SCALES)
    return fp4 ? e * groups * n + e * (n / 16) : e * groups * n * 4;
  if ((slot == MOE_W13_QZEROS || slot == MOE_W2_QZEROS) && cfg->has_zero_points) return e * groups * n;
  return 0;
}

const char *const moe_tc_config_names[TC_CONFIGS] = {"small", "medium", "wide", "large", "tall"};

extern "C" moe_status moe_gpu_fused_pack(moe_backend *b, const moe_expert_set *set,
                                         void *const src[MOE_EXPERT_TENSOR_COUNT],
                                         void *dst[MOE_EXPERT_TENSOR_COUNT], moe_error *err) {
  const moe_expert_config *cfg = &set->cfg;
  moe_status s = MOE_OK;
  for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++) {
    dst[i] = NULL;
    const size_t bytes = moe_tc_packed_bytes(cfg, i);
    if (!s && bytes && src[i] && (s = moe_backend_alloc(b, bytes, &dst[i])))
      moe_fail(err, s, "expert set '%s': %zu bytes of device memory for the packed %s", set->name, bytes,
               moe_expert_tensor_names[i]);
  }
  const moe_dtype sdt[2] = {set->t[MOE_W13_SCALES].dtype, set->t[MOE_W2_SCALES].dtype};
  if (!s) s = moe_tc_pack(b, cfg, sdt, src, dst, err);
  if (s)
    for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++)
      if (dst[i]) {
        moe_backend_free(b, dst[i]);
        dst[i] = NULL;
      }
  return s;
}

#if defined(MOE_GPU_CUDA)
namespace {

constexpr int KB = 64;    /* K columns per pipeline stage */
constexpr int RASTER = 8; /* tiles per group of the block order (tc_gemm) */

/* weight kinds: 16-bit rows, int4 / int8 codes (wna16), fp4 e2m1 codes
 * (mxfp4: packed as int4, dequantized by value), fp8 e4m3fn codes (W8A8:
 * packed as int8; the tokens are e4m3 codes too, both multiplied as fp16,
 * which holds every e4m3 value exactly) */
enum { TW_16, TW_INT4, TW_INT8, TW_FP4, TW_FP8, TW_KINDS };
__host__ __device__ constexpr bool four_bit(int w) { return w == TW_INT4 || w == TW_FP4; }
/* codes with per-group scales (and zero points) staged with the weights */
__host__ __device__ constexpr bool grouped(int w) { return w == TW_INT4 || w == TW_INT8 || w == TW_FP4; }

/* bytes of one packed 16-row x KB block */
__host__ __device__ constexpr int chunk_bytes(int w) {
  return w == TW_16 ? 2048 : w == TW_INT8 || w == TW_FP8 ? 1024 : 512;
}

int tc_wkind_of(moe_scheme scheme, int bits) {
  return scheme == MOE_SCHEME_MXFP4   ? TW_FP4
         : scheme == MOE_SCHEME_FP8   ? TW_FP8
         : scheme != MOE_SCHEME_WNA16 ? TW_16
         : bits == 4                  ? TW_INT4
                                      : TW_INT8;
}
int tc_wkind(const moe_expert_config *cfg) { return tc_wkind_of(cfg->scheme, (int)cfg->bits); }

/* Tile configurations: WG warpgroups, each 64 weight rows (16 per warp) x
 * BT tokens; BUDGET bytes of shared memory for the stages (small tiles
 * leave room for several blocks per SM, the large one takes one SM and a
 * deep pipeline); KS blocks of KB columns per stage (one barrier and one
 * round of copies per stage: packed int4/int8 blocks are small, so decode
 * tiles take several per stage, or the per-stage latency, not the bytes,
 * bounds them). The large tile is 256 x 128 because the L2 -> SM path,
 * not the tensor cores, bounded a 128 x 128 one (32 KB per 2 MFLOP per 64
 * columns of K); 128 x 256 (two warpgroups of n256) measured slower, and
 * so did 192 x 128 (three warpgroups, five stages) and 128 x 128 with six
 * stages: four warpgroups keep the tensor cores busier than a deeper
 * pipeline does. */
/* MINB: blocks per SM the registers must allow (__launch_bounds__; 0: not
 * stated. Stated as 1 it let the int4 decode tile take 137 registers
 * instead of 125, three blocks per SM instead of four: 26% slower.) */
template <int WG_, int BT_, int BUDGET_, int KS_ = 1, int MINB_ = 0> struct Cfg {
  static constexpr int WG = WG_, BT = BT_, NT = BT_ / 8, BUDGET = BUDGET_, KS = KS_, MINB = MINB_;
  static constexpr int BN = 64 * WG, THREADS = 128 * WG;
};
using CfgS = Cfg<1, 8, 49152>;  /* decode: 64 x 8 */
using CfgM = Cfg<1, 32, 49152>; /* 64 x 32 */
/* 128 x 64, two blocks per SM: at most 128 registers (fp8's two sets of
 * sums took 144-154, one block per SM: DeepSeek-V3 T=4096 1.5x slower) */
using CfgW = Cfg<2, 64, 98304, 1, 2>;
using CfgL = Cfg<4, 128, 200704>; /* 256 x 128 */
/* packed int4/int8 weights at decode: several KB blocks per stage (fewer
 * barriers and copy rounds per weight byte), three stages, four blocks
 * per SM (bench/RESULTS.md, sixth pass) */
using CfgQS = Cfg<1, 8, 65536, 4>;
using CfgQM = Cfg<1, 32, 49152, 2>;
/* fp8's: MINB 1 stated (more registers: DeepSeek-V3 T=1 252 -> 208 us,
 * Mixtral 319 -> 270 us; int4's lose 26% so); the small one a K block per
 * stage, three stages in ~31 KB, so that DeepSeek-V3's decode grid (512
 * blocks for gate_up) runs in one wave (three blocks per SM with four KB
 * blocks per stage took 1.3 waves: T=1 166 -> 134 us, T=64 2.64 -> 2.39 ms) */
using CfgQS8 = Cfg<1, 8, 32768, 2, 1>;
using CfgQM8 = Cfg<1, 32, 49152, 2, 1>;

/* One stage: B (the tokens: per KB block, 128-byte rows, 16-byte chunks
 * swizzled by row: the wgmma 128-byte swizzle, so the stage is 1024-byte
 * aligned), A (packed weights, per KB block), and for wna16 the scales
 * and zero points of the groups that start in the stage. */
template <int W, class C> struct Smem {
  static constexpr bool WNA16 = grouped(W);
  static constexpr int KS = C::KS, COLS = KS * KB;
  static constexpr int B1 = C::BT * KB * 2, B = KS * B1;
  static constexpr int A1 = C::BN / 16 * chunk_bytes(W), A = KS * A1;
  static constexpr int SGS = COLS / 16;          /* groups starting in a stage, at most (G >= 16) */
  static constexpr int SB = W == TW_FP4 ? 1 : 4; /* bytes per scale: e8m0 (mxfp4) or fp32 */
  static constexpr int S = WNA16 ? SGS * C::BN * SB : 0;
  static constexpr int Z = WNA16 && W != TW_FP4 ? SGS * C::BN : 0; /* mxfp4 has no zero points */
  static constexpr int STAGE = (B + A + S + Z + 1023) / 1024 * 1024;
  /* the budget's worth of stages, 3 to 8 deep */
  static constexpr int STAGES = C::BUDGET / STAGE < 3 ? 3 : C::BUDGET / STAGE > 8 ? 8 : C::BUDGET / STAGE;
  static constexpr int BYTES = STAGES * STAGE + 1024; /* + alignment slack */
};

/* ---- device primitives --------------------------------------------------------- */

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16 bytes global -> shared; zero-filled when !ok (src must still be valid) */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(ok ? 16 : 0));
}
/* the same, issued only when ok (a predicate, not a branch) */
__device__ __forceinline__ void cp_async16_if(void *dst, const void *src, bool ok) {
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %2, 0; @p cp.async.cg.shared.global [%0], [%1], 16; }\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"((int)ok));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

[[maybe_unused]] __device__ __forceinline__ void ldmatrix_x2(uint32_t &d0, uint32_t &d1, const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(d0), "=r"(d1)
               : "r"(smem_addr(p)));
}
[[maybe_unused]] __device__ __forceinline__ void ldmatrix_x4(uint32_t &d0, uint32_t &d1, uint32_t &d2,
                                                             uint32_t &d3, const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(smem_addr(p)));
}

template <int ACT>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if (ACT == A_BF16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* sm_90a: every configuration multiplies with wgmma (A = the weight
 * fragments from registers, B = the token stage through a descriptor);
 * elsewhere every configuration uses mma.sync. One instruction family per
 * device: that is what makes the configurations bit-identical. */
#define MOE_TC_WGMMA 1

/* K-major operand, 128-byte swizzle, 8-row groups 1024 bytes apart */
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t saddr) {
  return (uint64_t)((saddr & 0x3FFFFu) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
         (uint64_t)1 << 62;
}
/* cp.async and plain stores are generic-proxy writes; wgmma reads through
 * the async proxy */
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* the accumulators as they are here (no copies across the wgmma region) */
template <int NT> __device__ __forceinline__ void fence_acc(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; j++)
    asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
}
/* registers an in-flight wgmma reads: live (not reused) until this point */
__device__ __forceinline__ void keep_alive(uint32_t (&r)[4]) {
  asm volatile("" : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3])::"memory");
}

/* D (64 x N, fp32, this thread's N / 2 values: n8 block j, c0..c3 as in
 * mma.sync's C) += A (64 x 16) x B (N x 16 at desc). SS: A from shared
 * memory too (adesc: 64 rows, K-major, 128-byte swizzle); else A is this
 * warp's 16 x 16 fragment in registers (a). One asm per (N, form, dtype);
 * the operand lists are spelled by the macros. */
#define MOE_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define MOE_D16(j) MOE_D4(j), MOE_D4(j + 1), MOE_D4(j + 2), MOE_D4(j + 3)
#define MOE_WGMMA_TY(SHAPE, TY, SD, DREGS, AREGS, TAIL, ...)                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SD ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." TY \
               "." TY " " DREGS ", " AREGS ", p, 1, 1" TAIL ";\n}\n"                                         \
               : __VA_ARGS__                                                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "l"(adesc)                           \
               : "memory")
#define MOE_WGMMA(SHAPE, SD, DREGS, RS_A, SS_A, ...)                                                         \
  do {                                                                                                       \
    if (SS && ACT == A_BF16)                                                                                 \
      MOE_WGMMA_TY(SHAPE, "bf16", SD, DREGS, SS_A, ", 0, 0", __VA_ARGS__);                                   \
    else if (SS)                                                                                             \
      MOE_WGMMA_TY(SHAPE, "f16", SD, DREGS, SS_A, ", 0, 0", __VA_ARGS__);                                    \
    else if (ACT == A_BF16)                                                                                  \
      MOE_WGMMA_TY(SHAPE, "bf16", SD, DREGS, RS_A, ", 0", __VA_ARGS__);                                      \
    else                                                                                                     \
      MOE_WGMMA_TY(SHAPE, "f16", SD, DREGS, RS_A, ", 0", __VA_ARGS__);                                       \
  } while (0)
#define MOE_WGMMA_SD(SHAPE, ...)                                                                             \
  do {                                                                                                       \
    if constexpr (SD)                                                                                        \
      MOE_WGMMA(SHAPE, "1", __VA_ARGS__);                                                                    \
    else                                                                                                     \
      MOE_WGMMA(SHAPE, "0", __VA_ARGS__);                                                                    \
  } while (0)
/* SD = 0: D = A x B (the sums restart without an instruction that writes
 * them: fp8's K blocks), else D += A x B. An immediate: a predicate from a
 * register is an instruction inside the products' stage, and ptxas
 * serializes every wgmma of such a kernel. */
template <int N, int ACT, bool SS, int SD = 1>
__device__ __forceinline__ void wgmma(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t adesc,
                                      uint64_t desc) {
  if constexpr (N == 8)
    MOE_WGMMA_SD("m64n8k16", "{%0, %1, %2, %3}", "{%4, %5, %6, %7}, %8", "%9, %8", MOE_D4(0));
  else if constexpr (N == 16)
    MOE_WGMMA_SD("m64n16k16", "{%0, %1, %2, %3, %4, %5, %6, %7}", "{%8, %9, %10, %11}, %12", "%13, %12",
                 MOE_D4(0), MOE_D4(1));
  else if constexpr (N == 32)
    MOE_WGMMA_SD("m64n32k16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}",
                 "{%16, %17, %18, %19}, %20", "%21, %20", MOE_D16(0));
  else if constexpr (N == 64)
    MOE_WGMMA_SD("m64n64k16",
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
                 "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}",
                 "{%32, %33, %34, %35}, %36", "%37, %36", MOE_D16(0), MOE_D16(4));
  else if constexpr (N == 128)
    MOE_WGMMA_SD("m64n128k16",
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
                 "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
                 "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
                 "%56, %57, %58, %59, %60, %61, %62, %63}",
                 "{%64, %65, %66, %67}, %68", "%69, %68", MOE_D16(0), MOE_D16(4), MOE_D16(8), MOE_D16(12));
  else if constexpr (N == 136) /* the bulk path's tallest tiles */
    MOE_WGMMA_SD("m64n136k16",
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
                 "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
                 "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
                 "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67}",
                 "{%68, %69, %70, %71}, %72", "%73, %72", MOE_D16(0), MOE_D16(4), MOE_D16(8), MOE_D16(12),
                 MOE_D4(16));
  else
    static_assert(N == 8, "no wgmma shape for this tile");
}
#undef MOE_WGMMA_SD
#undef MOE_WGMMA
#undef MOE_WGMMA_TY
#undef MOE_D16
#undef MOE_D4
constexpr bool WGMMA = true;
#else
constexpr bool WGMMA = false;
#endif

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t d; /* (a & mask) | bits */
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
  return d;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

/* packed 16-bit pairs: a - b, a * b (one rounding each, RNE, subnormals kept) */
template <int ACT> __device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
  uint32_t d;
  if (ACT == A_BF16)
    asm("{ .reg .b32 one; mov.b32 one, 0xBF80BF80; fma.rn.bf16x2 %0, %2, one, %1; }\n"
        : "=r"(d)
        : "r"(a), "r"(b));
  else
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
template <int ACT> __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  uint32_t d;
  if (ACT == A_BF16)
    asm("{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 %0, %1, %2, z; }\n" : "=r"(d) : "r"(a), "r"(b));
  else
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
/* two fp32 -> one pair of act values (lo, hi), RNE */
template <int ACT> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t d;
  if (ACT == A_BF16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
template <int ACT> __device__ __forceinline__ void unpack2(uint32_t v, float &lo, float &hi) {
  lo = from16<ACT>(v & 0xFFFFu);
  hi = from16<ACT>(v >> 16);
}

/* Two e4m3fn codes (lo | hi << 8) as an fp16 pair, exactly (NaN codes
 * NaN). sm_89+ has the instruction; older targets never run fp8 sets
 * (moe_gpu_fused_packs) but compile this: the codes' bits under fp16's
 * exponent field are the values x 2^-8 (subnormals included), then x 256. */
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(d) : "h"((unsigned short)two));
  return d;
#else
  const uint32_t t = (two & 0xFFu) | (two & 0xFF00u) << 8;
  return mul2<A_F16>((t & 0x007F007Fu) << 7 | (t & 0x00800080u) << 8, 0x5C005C00u);
#endif
}

/* Per-row dequantization state of one lane's two rows (r and r + 8). */
struct Deq {
  uint32_t s16[2];  /* {s, s} in act (scale16); mxfp4: {s m, s m}, m = 2^126 (bf16) or 2^14 (fp16) */
  bool fast;        /* mxfp4: every row's scale of the group allows the 16-bit multiply (dequant) */
  uint32_t zb16[2]; /* {B + z, B + z} in act: the 16-bit code base plus the zero point */
  float s[2];       /* fp32 scale */
  float zb32[2];    /* 2^23 + z (int8 in bf16) */
};

/* Eight fragment values (a0..a7) of one lane for one 16 x 16 block, as
 * four act pairs: pair p holds row (p & 1 ? r + 8 : r). */
/* mxfp4 codes in a lane's word (moe_tc_pack): bit b (m, e0, e1, s) of
 * pair p's first code sits at fp4_at(p, b), of its second 16 bits higher.
 * Chosen for the move under a bf16's exponent field (m, e0, e1 to bits 6-8,
 * s to 15): one shift and mask for pairs 0-2, three for pair 3 (a search
 * found no placement that serves all four pairs with one each); fp16
 * (bits 9-11, 15) takes two for pairs 0-2. */
__host__ __device__ constexpr int fp4_at(int p, int b) {
  return p < 3 ? 3 * p + (b == 3 ? 9 : b) : (b < 2 ? 10 + b : 11 + b);
}
/* Whether an e8m0 scale byte b (s = 2^(b - 127)) allows mxfp4's 16-bit
 * multiply in act (dequant): s x 2^126 (bf16) or s x 2^14 (fp16) a normal
 * number of that type, b <= 128 (fp16: 99 <= b <= 128). The packing's
 * flags (fp4_flags) and the kernel's per-group check ask this one rule. */
__host__ __device__ constexpr bool fp4_fast16(int act, uint32_t b) {
  return b <= 128 && (act == A_BF16 || b >= 99);
}
/* where bit b goes: under the exponent field's low end, s to the sign */
__host__ __device__ constexpr int fp4_to(int act, int b) { return b == 3 ? 15 : (act == A_BF16 ? 6 : 9) + b; }
/* the bits of pair p that move by `shift` (both halves) */
__host__ __device__ constexpr uint32_t fp4_mask(int act, int p, int shift) {
  uint32_t m = 0;
  for (int b = 0; b < 4; b++)
    if (fp4_to(act, b) - fp4_at(p, b) == shift) m |= 0x10001u << fp4_to(act, b);
  return m;
}
/* pair p's two codes as 16-bit floats' bits (see dequant) */
template <int ACT, int P> __device__ __forceinline__ uint32_t fp4_bits(uint32_t w) {
  uint32_t r = 0;
#pragma unroll
  for (int sh = -15; sh <= 15; sh++) {
    const uint32_t m = fp4_mask(ACT, P, sh); /* a constant once unrolled */
    if (m) r |= (sh >= 0 ? w << sh : w >> -sh) & m;
  }
  return r;
}

template <int W, int ACT>
__device__ __forceinline__ void dequant(const uint32_t *words, const Deq &d, bool scale16,
                                        uint32_t (&out)[4]) {
  if (W == TW_FP4) {
    /* e2m1 code c (sign, 2 exponent bits, 1 mantissa bit) as a 16-bit float
     * by its bits: the sign to bit 15, the rest under the exponent field's
     * low end, so the value is value(c) x 2^-126 (bf16) or x 2^-14 (fp16),
     * exact (a subnormal for c's subnormal half); then value(c) x 2^(b - 127)
     * rounded once to act (docs/numerics.md mxfp4). scale16 (the group's
     * scales s <= 2, and >= 2^-28 for fp16): one packed 16-bit multiply by s
     * x 2^126 (2^14), a power of two the 16-bit type holds as a normal
     * number, rounds the exact product once (at most 2 significant bits,
     * |product| <= 12, >= 2^-128: within bf16's subnormals); else in fp32
     * and one conversion. */
    const float mag = ACT == A_BF16 ? 0x1p126f : 0x1p14f;
    const uint32_t w = words[0];
    const uint32_t pairs[4] = {fp4_bits<ACT, 0>(w), fp4_bits<ACT, 1>(w), fp4_bits<ACT, 2>(w),
                               fp4_bits<ACT, 3>(w)};
#pragma unroll
    for (int p = 0; p < 4; p++) {
      const uint32_t bits = pairs[p];
      if (scale16) {
        out[p] = mul2<ACT>(bits, d.s16[p & 1]);
      } else {
        float lo, hi;
        unpack2<ACT>(bits, lo, hi);
        out[p] = pack2<ACT>(lo * mag * d.s[p & 1], hi * mag * d.s[p & 1]);
      }
    }
  } else if (W == TW_FP8) { /* as int8: words[0] = a0..a3, words[1] = a4..a7; no scale here */
#pragma unroll
    for (int p = 0; p < 4; p++)
      out[p] = e4m3x2_f16x2(words[p >> 1] >> (16 * (p & 1)));
  } else if (W == TW_INT4) {
    const uint32_t base = ACT == A_BF16 ? 0x43004300u : 0x64006400u, w = words[0];
#pragma unroll
    for (int p = 0; p < 4; p++) {
      const uint32_t x = lop3_and_or(w >> (4 * p), 0x000F000Fu, base);
      const uint32_t qz = sub2<ACT>(x, d.zb16[p & 1]); /* q - z, exact */
      if (scale16) {
        out[p] = mul2<ACT>(qz, d.s16[p & 1]);
      } else {
        float lo, hi;
        unpack2<ACT>(qz, lo, hi);
        out[p] = pack2<ACT>(lo * d.s[p & 1], hi * d.s[p & 1]);
      }
    }
  } else { /* int8: words[0] = a0..a3, words[1] = a4..a7 */
#pragma unroll
    for (int p = 0; p < 4; p++) {
      const uint32_t w = words[p >> 1], b0 = (p & 1) * 2;
      if (ACT == A_F16) {
        const uint32_t x = prmt(w, 0x64646464u, 0x4140u + b0 * 0x0101u); /* {1024 + q0, 1024 + q1} */
        const uint32_t qz = sub2<ACT>(x, d.zb16[p & 1]);
        if (scale16) {
          out[p] = mul2<ACT>(qz, d.s16[p & 1]);
        } else {
          float lo, hi;
          unpack2<ACT>(qz, lo, hi);
          out[p] = pack2<ACT>(lo * d.s[p & 1], hi * d.s[p & 1]);
        }
      } else {
        const float lo = __uint_as_float(prmt(w, 0x4B000000u, 0x7440u + b0)) - d.zb32[p & 1];
        const float hi = __uint_as_float(prmt(w, 0x4B000000u, 0x7441u + b0)) - d.zb32[p & 1];
        out[p] = scale16 ? mul2<ACT>(pack2<ACT>(lo, hi), d.s16[p & 1])
                         : pack2<ACT>(lo * d.s[p & 1], hi * d.s[p & 1]);
      }
    }
  }
}

/* ---- the GEMM kernels -------------------------------------------------------------- */

/* How a main loop dequantizes: groups of 16 or 32 columns found by a
 * check every 16 columns (wna16), mxfp4's groups of 32 at constant places
 * (stages and segments start on a KB block), groups of whole KB blocks with
 * scales in the activation dtype or not, or any of these, checked in every
 * KB block (M_RUNTIME; and 16-bit weights, which are not dequantized).
 * wna16 g16/g32 keep the check: the constant schedule took their decode
 * tile from 126 to 156 registers (three blocks per SM instead of four: int4
 * g128 23% slower, the routes share one kernel's register count). */
enum { M_SMALL_GROUPS, M_FP4, M_SCALE16, M_SCALE32, M_RUNTIME };

/* This block's (tile, weight strip). Groups of RASTER tiles (consecutive
 * tiles are mostly one expert's) sweep every strip, tiles fastest, so a
 * wave of blocks shares a few strips and one expert's tokens in L2
 * instead of streaming every expert's tokens once per strip. */
__device__ __forceinline__ void item_order(long long pid, int nm, int strips, int &ti, int &strip) {
  const long long in_group = (long long)RASTER * strips;
  const int first = (int)(pid / in_group) * RASTER;
  const int gsz = nm - first < RASTER ? nm - first : RASTER;
  ti = first + (int)(pid % in_group % gsz);
  strip = (int)(pid % in_group / gsz);
}
__device__ __forceinline__ void block_order(int &ti, int &strip) {
  item_order((long long)blockIdx.y * gridDim.x + blockIdx.x, (int)gridDim.x, (int)gridDim.y, ti, strip);
}

/* Element (row pos, column col) of a K-major buffer with `cap` rows: [K /
 * KB][cap][KB], 16-byte chunks swizzled by row as in a stage. */
__host__ __device__ __forceinline__ size_t kmajor(int col, int pos, int cap) {
  return ((size_t)(col / KB) * (size_t)cap + (size_t)pos) * KB +
         (size_t)((((col >> 3) & 7) ^ (pos & 7)) << 3) + (size_t)(col & 7);
}

/* The epilogue of both GEMM kernels: this warp's accumulators (16-row
 * block mt; c0, c1 = row r (lane / 4), tokens 2 (lane % 4) + {0, 1}; c2,
 * c3 = row r + 8) for the tile's first `rows` tokens. Phase 1: packed rows
 * are the gate of unit 8 mt + r, then its up: one activated value per
 * unit, at a's row `row` (KMAJOR: row `row` of the K-major buffer with
 * a.cap rows, for the bulk down GEMM; else row-major). Phase 2: the
 * routing-weighted row of each slot in y, or (seg >= 0) the segment's fp32
 * sums for the sum kernel to fold. */
__device__ __forceinline__ float bias_at(const TcArgs &a, size_t i) {
  return a.bias_dt == MOE_F16    ? moe_f16_to_f32(((const uint16_t *)a.bias)[i])
         : a.bias_dt == MOE_BF16 ? moe_bf16_to_f32(((const uint16_t *)a.bias)[i])
                                 : ((const float *)a.bias)[i];
}

/* The files' row of this lane's accumulator rows in 16-row block mt (h =
 * 0: c0, c1; h = 1: c2, c3): phase 1 packs 8 units' gate rows, then their
 * up rows (moe_tc_pack's orig_row) */
__device__ __forceinline__ int file_row(const TcArgs &a, int mt, int lane, int h) {
  if (a.phase == 2) return 16 * mt + (lane >> 2) + 8 * h;
  const int u = 8 * mt + (lane >> 2);
  return a.activation == MOE_ACT_SWIGLU_OAI ? 2 * u + h : h * a.inter + u;
}

/* FN: the activation when the caller knows it (-1: a.activation); FULL:
 * every token column of the tile is one of its rows (no check per
 * element). Both only take branches out of the bulk kernel's epilogue,
 * which runs while the tensor cores idle. */
template <int ACT, bool KMAJOR, int NT, int FN = -1, bool FULL = false>
__device__ __forceinline__ void store_tile(const TcArgs &a, const float (&acc)[NT][4], int mt, int lane,
                                           int rows, int row, const int *slot_of, const float *tw_of, int seg,
                                           int e) {
  /* expert e's biases of this lane's rows, added to the sums before their
   * rounding (phase 1: the unit's gate and up rows, in the files' order;
   * phase 2: rows h, h + 8, before the routing weight; a set with biases
   * is never split in K: moe_tc_split) */
  float b0 = 0.0f, b1 = 0.0f;
  if (a.bias) {
    const size_t base = (size_t)e * (size_t)a.n;
    b0 = bias_at(a, base + (size_t)file_row(a, mt, lane, 0));
    b1 = bias_at(a, base + (size_t)file_row(a, mt, lane, 1));
  }
  const int tok0 = 2 * (lane & 3);
  if (a.phase == 1) {
    /* this lane's unit for token tok = 8 j + 2 (lane % 4) + q is element
     * o1[q] + j * step1 of a.out (KMAJOR: row is a multiple of 8, a bulk
     * tile's first row, so the swizzle depends on q alone), the index
     * arithmetic out of the per-element loop */
    const int unit = 8 * mt + (lane >> 2);
    size_t o1[2];
    for (int q = 0; q < 2; q++)
      o1[q] = KMAJOR ? kmajor(unit, row + tok0 + q, a.cap)
                     : (size_t)(row + tok0 + q) * (size_t)a.inter + (size_t)unit;
    const size_t step1 = KMAJOR ? (size_t)8 * KB : (size_t)8 * (size_t)a.inter;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int q = 0; q < 2; q++)
        if (FULL || j * 8 + tok0 + q < rows) {
          const float v = activate<ACT>(FN >= 0 ? FN : a.activation, act_round<ACT>(acc[j][q] + b0),
                                        act_round<ACT>(acc[j][2 + q] + b1));
          a.out[o1[q] + (size_t)j * step1] = to16<ACT>(v);
        }
    return;
  }
  const int h = 16 * mt + (lane >> 2);
#pragma unroll
  for (int j = 0; j < NT; j++)
#pragma unroll
    for (int q = 0; q < 2; q++) {
      const int tok = j * 8 + tok0 + q;
      if (!FULL && tok >= rows) continue;
      const int slot = slot_of[tok];
      if (seg >= 0) {
        float *p = a.part + ((size_t)seg * (size_t)a.slots + (size_t)slot) * (size_t)a.hidden + (size_t)h;
        p[0] = acc[j][q];
        p[8] = acc[j][2 + q];
      } else {
        const float w = tw_of[tok];
        a.out[(size_t)slot * (size_t)a.hidden + (size_t)h] = to16<ACT>((acc[j][q] + b0) * w);
        a.out[(size_t)slot * (size_t)a.hidden + (size_t)(h + 8)] = to16<ACT>((acc[j][2 + q] + b1) * w);
      }
    }
}

/* The tile's slots (-1 past its count) and, for phase 2, their routing
 * weights: read once before the main loop, for the epilogue. */
__device__ __forceinline__ int load_slot(const TcArgs &a, const int *sorted, int row0, int rows, int i,
                                         int *slot_of, float *tw_of) {
  const int slot = i < rows ? sorted[row0 + i] : -1;
  slot_of[i] = slot;
  if (a.phase == 2) tw_of[i] = slot < 0 ? 0.0f : a.tw[slot];
  return slot;
}

/* The align step for a batch of at most 32 slots (TcArgs.ids), run by
 * warp 0 of every gate_up block instead of an align kernel (a launch and
 * its wait are most of it at decode). The same tile list as the align
 * kernel's: local experts ascending, each expert's slots in tiles of bm
 * rows from its first row (the exclusive sum of the smaller experts'
 * counts); within an expert the slots go in slot order (the align kernel
 * places them in any order: a slot's results do not depend on its row).
 * Writes this block's tile, the tile count and the tile's slots (sorted,
 * indexed from the tile's first row) to shared memory; block 0 also
 * writes sorted, tiles and ntiles for down. Lane j holds slot j. */
__device__ __forceinline__ void tiny_align(const TcArgs &a, int ti, int bm, bool first_block, int4 *s_tile,
                                           int *s_ntiles, int *s_sorted) {
  const int lane = (int)threadIdx.x & 31;
  int le = lane < a.nids ? a.ids[lane] - a.offset : -1;
  if (le >= a.el) le = -1;
  const bool held = le >= 0;
  int before = 0, same_before = 0, cnt = 0; /* held slots of smaller experts; of this one, earlier; all */
  for (int j = 0; j < 32; j++) {
    const int lj = __shfl_sync(0xFFFFFFFFu, le, j);
    if (held && lj >= 0) {
      before += lj < le;
      cnt += lj == le;
      same_before += lj == le && j < lane;
    }
  }
  const bool lead = held && same_before == 0; /* the expert's first slot speaks for it */
  const int ntl = lead ? (cnt + bm - 1) / bm : 0;
  int tstart = 0, total = 0; /* this expert's first tile; all tiles */
  for (int j = 0; j < 32; j++) {
    const int lj = __shfl_sync(0xFFFFFFFFu, le, j), nj = __shfl_sync(0xFFFFFFFFu, ntl, j);
    total += nj;
    tstart += held && lj < le ? nj : 0;
  }
  if (first_block) { /* the workspace's lists (const for the GEMMs that read them) */
    if (held) const_cast<int *>(a.sorted)[before + same_before] = lane;
    for (int t = 0; t < ntl; t++)
      const_cast<int4 *>(a.tiles)[tstart + t] = make_int4(le, before + t * bm, min(bm, cnt - t * bm), 0);
    if (lane == 0) *const_cast<int *>(a.ntiles) = total;
  }
  if (lane == 0) *s_ntiles = total;
  if (lead && ti >= tstart && ti < tstart + ntl)
    *s_tile = make_int4(le, before + (ti - tstart) * bm, min(bm, cnt - (ti - tstart) * bm), 0);
  __syncwarp();
  if (ti < total) {
    const int4 t = *s_tile;
    const int r = before + same_before - t.y;
    if (held && le == t.x && r >= 0 && r < t.z) s_sorted[r] = lane;
  }
}

/* SPLIT: the down GEMM in K segments (moe_tc_split; a kernel of its own so
 * that the unsplit ones keep their registers: the large int4 tile sits at
 * the 128-register cap, where the extra epilogue cost 4-8% at T = 4096). */
/* FB: fp8 block scales, KB blocks per K block (2: BK = 128), 0 otherwise: a
 * constant, so that where a K block starts and ends is known per unrolled
 * copy of the loop and no branch sits among the products */
template <int W, int ACT, class C, bool SPLIT, int FB = 0>
__global__ void __launch_bounds__(C::THREADS, C::MINB) tc_gemm(TcArgs a) {
  using S = Smem<W, C>;
  constexpr int BN = C::BN, BT = C::BT, NT = C::NT, CH = chunk_bytes(W), THREADS = C::THREADS, KS = C::KS;
  constexpr int ST = S::STAGES;
  constexpr bool WNA16 = S::WNA16, FP8 = W == TW_FP8;
  /* the multiplied type: fp8 codes' values are fp16 values */
  constexpr int MT = FP8 ? A_F16 : ACT;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  __shared__ int src_row[BT], slot_of[BT];
  __shared__ float tw_of[BT]; /* phase 2: the slots' routing weights, read before the main loop */
  /* stages start on a 1024-byte boundary of the shared window (the swizzle) */
  uint8_t *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);

  int ti, strip;
  block_order(ti, strip);
  pdl_wait();
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int4 tile;
  const int *sorted = a.sorted; /* the tile's slots at sorted[row0 ..] */
  if (W == TW_16 && a.ids) {    /* decode: no align kernel ran (tiny_align: 16-bit weights only) */
    __shared__ int4 s_tile;
    __shared__ int s_ntiles, s_sorted[BT];
    if (warp == 0) tiny_align(a, ti, BT, blockIdx.x == 0 && blockIdx.y == 0, &s_tile, &s_ntiles, s_sorted);
    __syncthreads();
    if (ti >= s_ntiles) return;
    tile = s_tile;
    sorted = s_sorted - tile.y;
  } else {
    if (ti >= *a.ntiles) return;
    tile = a.tiles[ti];
  }
  const int e = tile.x, row0 = tile.y, rows = tile.z;
  /* this block's K segment (moe_tc_split: a.split > 1 for phase 2 only):
   * KB blocks kbs .. kbs + nkb_seg with accumulators of its own, folded by
   * the sum. The main loop counts within the segment (segments start at a
   * group's first column): the copy sources start at kbs. */
  const int split = SPLIT ? a.split : 1, seg = strip % split;
  strip /= split;
  __shared__ int seg_of; /* for the epilogue: no register held through the main loop */
  if (SPLIT && tid == 0) seg_of = seg;
  const int N = a.n, K = a.k, nkb = K / KB, mtc = N / 16, nkb_seg = nkb / split, kbs = seg * nkb_seg,
            seg_cols = nkb_seg * KB, nst = (nkb_seg + KS - 1) / KS;
  const int n0 = strip * BN;
  const int mt = n0 / 16 + warp; /* this warp's 16-row block */
  for (int i = tid; i < BT; i += THREADS) {
    const int slot = load_slot(a, sorted, row0, rows, i, slot_of, tw_of);
    src_row[i] = i >= rows ? -1 : a.phase == 1 && (!FP8 || a.xtok) ? slot / a.top_k : row0 + i;
  }
  /* token rows past the tile's count are zero in every stage: written once
   * here and never copied (a decode tile is mostly such rows) */
  if (rows < BT)
    for (int i = tid; i < ST * KS * BT * 8; i += THREADS) {
      const int r = i / 8 % BT, blk = i / 8 / BT; /* blk: stage * KS + KB block */
      if (r >= rows)
        *(uint4 *)(smem + (blk / KS) * S::STAGE + (blk % KS) * S::B1 + r * 128 + (i & 7) * 16) =
            make_uint4(0, 0, 0, 0);
    }
  /* mxfp4: whether every scale of the block's rows allows the 16-bit
   * multiply (moe_tc_pack's flag per 16 rows), the same answer in every
   * warp: then its main loop has no vote and no branch per group */
  bool fp4_fast = false;
  if constexpr (W == TW_FP4)
    fp4_fast =
        __syncthreads_and(mt >= mtc || (a.fp4_fast[(size_t)e * mtc + mt] >> (ACT == A_BF16 ? 0 : 1) & 1));
  else
    __syncthreads();

  /* The main loop is issue-bound at small batches (wna16 dequantizes every
   * weight), so everything per stage that is not a copy, a dequantization
   * or a product is kept out of it: copy sources are running pointers,
   * shared-memory offsets are fixed per thread, group starts are counted
   * columns (no division by the group size). */
  const uint8_t *wexp = a.w + (size_t)e * (size_t)mtc * (size_t)nkb * CH;
  /* a KB block's A: 16-bit weights are whole 128-byte rows (N of them per
   * KB columns), the others one packed block per 16 rows */
  const size_t a_step = W == TW_16 ? (size_t)N * 128 : CH;

  /* Per-thread copy assignments, fixed for the tile: piece tid + q THREADS
   * of a KB block's A and B; the sources move on by a KB block per copy. */
  constexpr int APC = CH / 16;                             /* 16-byte pieces per 16-row block */
  constexpr int AP = (S::A1 / 16 + THREADS - 1) / THREADS; /* A pieces per thread */
  constexpr int BP = (BT * 8 + THREADS - 1) / THREADS;     /* B pieces per thread */
  const uint8_t *a_src[AP];
  bool a_ok[AP];
#pragma unroll
  for (int q = 0; q < AP; q++) {
    const int i = tid + q * THREADS, m = n0 / 16 + i / APC;
    a_ok[q] = i < S::A1 / 16 && m < mtc;
    a_src[q] = !a_ok[q]     ? a.w
               : W == TW_16 ? wexp + (size_t)(n0 * 8 + i) * 16 + (size_t)kbs * a_step
                            : wexp + ((size_t)m * nkb + kbs) * CH + (i % APC) * 16;
  }
  const uint16_t *b_src[BP];
  bool b_ok[BP]; /* a present row's piece */
  int b_dst[BP]; /* its place in a KB block's B */
#pragma unroll
  for (int q = 0; q < BP; q++) {
    /* piece i: row i / 8, 16-byte chunk i % 8. Packed codes with one
     * warpgroup: lanes 2j, 2j + 1 of warp w take chunks 2w, 2w + 1 of a row
     * (one 32-byte sector per pair), so a decode tile's few rows are copied
     * by every warp, not all by the first one: the warpgroup's products wait
     * for its slowest warp, and the first one also dequantizes */
    const int i = W != TW_16 && THREADS == 128 ? q * THREADS + (lane >> 1) * 8 + 2 * warp + (lane & 1)
                                               : tid + q * THREADS;
    const int r = i >> 3, c = i & 7;
    const int xr = i < BT * 8 ? src_row[r] : -1;
    b_ok[q] = xr >= 0;
    b_src[q] = (const uint16_t *)a.x + (xr < 0 ? 0 : (size_t)xr * (size_t)K + c * 8 + (size_t)kbs * KB);
    b_dst[q] = r * 128 + ((c ^ (r & 7)) << 4);
  }
  /* wna16: this thread's 16-byte piece of a group's scales (and zero
   * points) for the strip's rows. Decode tiles with groups of whole KB
   * blocks (WSPLIT): at most KS <= 4 groups start in a stage, warp w copies
   * the w-th (lanes 0-15 the scales, 16-19 the zero points), so that no
   * warp loops over the stage's groups; else threads 0.. copy every group. */
  const int G = W == TW_FP4 ? 32 : a.group; /* a constant for mxfp4 */
  const bool wsplit = C::WG == 1 && KS > 1 && G >= KB;
  /* mxfp4: every stage but perhaps the last holds COLS / 32 groups, whose
   * e8m0 scales (16 rows per 16-byte piece) are numbered across the stage;
   * thread tid copies piece tid (and tid + THREADS, ...), so that no
   * thread loops over groups. (wna16's g16/g32 keep the loop below: this
   * schedule cost their decode tile registers.) */
  constexpr int SPS = BN / 16, SQ = (S::SGS * SPS + THREADS - 1) / THREADS;
  const uint8_t *sg_src = W == TW_FP4 ? (const uint8_t *)a.scale +
                                            ((size_t)e * a.groups + (size_t)(kbs * KB / G)) * (size_t)N + n0
                                      : NULL;
  const int sp = wsplit ? lane : tid, zp = wsplit ? lane - 16 : tid;
  const bool s_ok = WNA16 && sp < BN / 4 && n0 + 4 * sp < N;
  const bool z_ok = WNA16 && W != TW_FP4 && a.zero && zp >= 0 && zp < BN / 16 && n0 + 16 * zp < N;
  /* segments start at a group's first column (moe_tc_split) */
  const size_t g0 = (size_t)e * a.groups + (size_t)(kbs * KB / G);
  const float *s_src = s_ok ? a.scale + g0 * (size_t)N + n0 + 4 * sp : NULL;
  const uint8_t *z_src = z_ok ? a.zero + g0 * (size_t)N + n0 + 16 * zp : NULL;
  int iss_gcol = 0; /* first column of the next group whose scales are copied (in the segment) */

  /* stage st (KB blocks st KS.., the last stage may hold fewer) into sb */
  auto issue_as = [&](int st, uint8_t *sb, auto vec, auto full) {
    /* 0/1: x's rows (un)aligned, one branch per stage; 2: checked per piece */
    constexpr int XV = decltype(vec)::value;
    constexpr bool FULL = decltype(full)::value; /* every KB block of the stage is in the segment */
    const bool x_vec = XV == 2 ? a.x_vec != 0 : XV == 1;
#pragma unroll
    for (int u = 0; u < KS; u++) {
      const int kb = st * KS + u; /* in the segment */
      if (KS > 1 && !FULL && kb >= nkb_seg) break;
#pragma unroll
      for (int q = 0; q < AP; q++) {
        const int i = tid + q * THREADS;
        if ((q + 1) * THREADS <= S::A1 / 16 || i < S::A1 / 16)
          cp_async16(sb + S::B + u * S::A1 + i * 16, a_src[q] + u * a_step, a_ok[q]);
      }
#pragma unroll
      for (int q = 0; q < BP; q++) {
        uint8_t *dst = sb + u * S::B1 + b_dst[q];
        const uint16_t *src = b_src[q] + u * KB; /* the source moves on once per stage (below) */
        if (x_vec) {
          cp_async16_if(dst, src, b_ok[q]);
        } else if (b_ok[q]) { /* unaligned rows: 16-bit loads, ordered by the barrier before use */
          uint16_t v[8];
#pragma unroll
          for (int e8 = 0; e8 < 8; e8++)
            v[e8] = src[e8];
          uint4 w4;
          w4.x = v[0] | (uint32_t)v[1] << 16;
          w4.y = v[2] | (uint32_t)v[3] << 16;
          w4.z = v[4] | (uint32_t)v[5] << 16;
          w4.w = v[6] | (uint32_t)v[7] << 16;
          *(uint4 *)dst = w4;
        }
      }
    }
    /* the sources move on by the stage (after a last, shorter stage they are not used) */
#pragma unroll
    for (int q = 0; q < BP; q++)
      b_src[q] += KS * KB;
#pragma unroll
    for (int q = 0; q < AP; q++)
      if (a_ok[q]) a_src[q] += KS * a_step;
    /* scales and zero points of the groups that start in this stage, in
     * slots 0.. (compute reloads its registers at each group's first column) */
    if (WNA16) {
      const int col_end = (st + 1) * S::COLS < seg_cols ? (st + 1) * S::COLS : seg_cols;
      float *ss = (float *)(sb + S::B + S::A);
      uint8_t *sz = sb + S::B + S::A + S::S;
      if (wsplit) {
        if (iss_gcol + warp * G < col_end) {
          if (s_ok) cp_async16(ss + warp * BN + 4 * sp, s_src + (size_t)warp * N, true);
          if (z_ok) cp_async16(sz + warp * BN + 16 * zp, z_src + (size_t)warp * N, true);
        }
        int ng = 0;
        for (; iss_gcol < col_end; iss_gcol += G)
          ng++;
        if (s_ok) s_src += (size_t)ng * N;
        if (z_ok) z_src += (size_t)ng * N;
      } else if constexpr (W == TW_FP4) {
        constexpr int slots = S::COLS / 32;
#pragma unroll
        for (int q = 0; q < SQ; q++) {
          const int i = tid + q * THREADS, js = i / SPS, pc = i % SPS;
          if (js < slots)
            cp_async16_if(sb + S::B + S::A + js * BN + 16 * pc, sg_src + (size_t)js * N + 16 * pc,
                          n0 + 16 * pc < N && iss_gcol + js * 32 < col_end);
        }
        iss_gcol += S::COLS; /* past the segment's end after its last stage: no more copies */
        sg_src += (size_t)slots * N;
      } else {
        for (int j = 0; iss_gcol < col_end; j++, iss_gcol += G) {
          if (s_ok) {
            cp_async16(ss + j * BN + 4 * sp, s_src, true);
            s_src += N;
          }
          if (z_ok) {
            cp_async16(sz + j * BN + 16 * zp, z_src, true);
            z_src += N;
          }
        }
      }
    }
  };
  /* the decode tiles branch once per stage; the large tile checks per piece
   * (two copies of its copy code cost it registers: spills) */
  auto issue = [&](int st, uint8_t *sb) {
    /* a full stage (every one but perhaps the last) copies without a check per KB block */
    auto by_fill = [&](auto vec) {
      if ((st + 1) * KS <= nkb_seg)
        issue_as(st, sb, vec, std::true_type{});
      else
        issue_as(st, sb, vec, std::false_type{});
    };
    if constexpr (KS == 1)
      issue_as(st, sb, std::integral_constant<int, 2>{}, std::true_type{});
    else if (a.x_vec)
      by_fill(std::integral_constant<int, 1>{});
    else
      by_fill(std::integral_constant<int, 0>{});
  };

  struct Acc {
    float v[NT][4];           /* the tile's fp32 sums (per main-loop copy) */
    float t[FP8 ? NT : 1][4]; /* fp8 block scales: the scaled K blocks' sum (v: the current block's) */
  };
  const uint32_t zdef = W == TW_INT4 ? 8 : 128;
  Deq dq; /* the group's scales and zero points: reloaded where a group starts */
  /* 128 + z (bf16) and 1024 + z (fp16) by their bits (z < 2^7 resp. 2^10),
   * and 2^23 + z: set once here for sets without zero points (the
   * midpoint), by reload where a group starts otherwise */
  auto set_zero = [&](int h, uint32_t z) {
    const uint32_t zb = (ACT == A_BF16 ? 0x4300u : 0x6400u) + z;
    dq.zb16[h] = zb | zb << 16;
    dq.zb32[h] = __uint_as_float(0x4B000000u + z);
  };
  set_zero(0, zdef);
  set_zero(1, zdef);
  int cmp_gcol = 0; /* first column of the next group compute reloads (in the segment) */
  const int raw_off = S::B + warp * CH + lane * 16;
  const int sc_off =
      S::B + S::A + (W == TW_FP4 ? warp * 16 + 2 * (lane >> 2) : (warp * 16 + (lane >> 2)) * 4);
  const int zp_off = S::B + S::A + S::S + warp * 16 + (lane >> 2);
#if defined(MOE_TC_WGMMA)
  /* descriptors of the shared window's start: a stage, a KB block and 16
   * columns further are plain adds to the address field (16-byte units) */
  const uint64_t desc0 = wgmma_desc(smem_addr(smem));
#endif
  /* Where the main loop ends early (a last stage of fewer KB blocks, an odd
   * stage count), every product in flight is retired before it jumps: on
   * that path the loop's next iteration would rewrite the fragment
   * registers of the products still in flight, and ptxas, which cannot see
   * that the path ends the loop, serialized every wgmma of the kernel (fp8:
   * DeepSeek-V3 T=1 254 -> 240 us). Runs once per block. */
  auto retire_all = [&]() {
#if defined(MOE_TC_WGMMA)
    wgmma_wait<0>();
#endif
  };
  /* fp8 (docs/numerics.md "fp8"): the scales' addresses are worked out once
   * per tile, so that a K block's scales are loads at fixed offsets (the
   * divisions and index arithmetic of every block, ~500 instructions per
   * thread, made the block-scale loop issue-bound). Activation scales: this
   * lane's token columns (j, q) are tile rows j 8 + 2 (lane % 4) + q, and
   * xs is [K / xg][xrows] (a K block's scales of a tile are one run); rows
   * past the tile's count read padding, whose products are zero and never
   * stored. Weight scales: this lane's rows h = 0, 1 (rows past N: the
   * first scale, unused). */
  [[maybe_unused]] const float *const sx_base = FP8 ? a.xs + row0 + 2 * (lane & 3) : NULL;
  [[maybe_unused]] auto fp8_sx = [&](int j, int q, int b) {
    return sx_base[(size_t)b * (size_t)a.xrows + (size_t)(j * 8 + q)];
  };
  [[maybe_unused]] const float *sw_base[2] = {a.wsc, a.wsc};
  if (FP8 && mt < mtc)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int r = file_row(a, mt, lane, h);
      const int nbn = (N + a.bn - 1) / a.bn;
      sw_base[h] = a.wscale == MOE_WSCALE_PER_TENSOR ? a.wsc + e
                   : a.wscale == MOE_WSCALE_PER_CHANNEL
                       ? a.wsc + (size_t)e * (size_t)N + (size_t)r
                       : a.wsc + ((size_t)e * (size_t)nbn + (size_t)(r / a.bn)) * (size_t)(K / a.bk);
    }
  [[maybe_unused]] auto fp8_sw = [&](int h, int b) { return sw_base[h][FB > 0 ? b : 0]; };
  /* fp8 block scales: K block b's products (ac.v, summed from 0) join ac.t
   * as p_b * (sx * sw), blocks in ascending order. The scales are loaded
   * before the products' wait (loaded a K block ahead, they measured no
   * faster). wgmma: the next block's first product restarts the sums
   * (nothing but wgmma may write them between its products, or ptxas
   * serializes them); mma.sync: zeroed here. */
  [[maybe_unused]] auto fp8_block_end = [&](Acc &ac, int b) {
    float sx[NT][2];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int q = 0; q < 2; q++)
        sx[j][q] = fp8_sx(j, q, b);
    const float sw0 = fp8_sw(0, b), sw1 = fp8_sw(1, b);
#if defined(MOE_TC_WGMMA)
    wgmma_wait<0>();
#endif
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int q = 0; q < 2; q++) {
        ac.t[j][q] += ac.v[j][q] * (sx[j][q] * sw0);
        ac.t[j][2 + q] += ac.v[j][2 + q] * (sx[j][q] * sw1);
#if !defined(MOE_TC_WGMMA)
        ac.v[j][q] = ac.v[j][2 + q] = 0.0f;
#endif
      }
  };
  /* compute: for each KB block of the stage at sb, this warp's A fragments
   * into af (rows past N: zeros, results unused), then the block's
   * multiply-adds. With wgmma they stay in flight when the block is done
   * (af and the stage too, until the next block's wait): af alternates
   * between two buffers by KB block (afA for even blocks of the stage). */
  auto compute = [&](Acc &ac, int st, const uint8_t *sb, uint32_t(&afA)[KB / 16][4],
                     uint32_t(&afB)[KB / 16][4], auto mode, auto par) {
    [[maybe_unused]] constexpr int MODE = decltype(mode)::value; /* fp8 has one route */
    int j = 0;                                                   /* the stage's group slot */
#if defined(MOE_TC_WGMMA)
    /* the stage's descriptor once (stages start on 1024-byte boundaries): a
     * KB block and 16 columns further are constant adds */
    const uint64_t dstage = desc0 + ((uint32_t)(sb - smem) >> 4);
#endif
#pragma unroll
    for (int u = 0; u < KS; u++) {
      const int kb = st * KS + u;    /* in the segment */
      if (KS > 1 && kb >= nkb_seg) { /* the last stage's end: its products are done first (below) */
        retire_all();
        break;
      }
      uint32_t(&af)[KB / 16][4] = (u & 1) ? afB : afA;
      uint32_t(&af_prev)[KB / 16][4] = (u & 1) ? afA : afB;
      (void)af_prev;
      /* 16-bit weights: the tensor cores read A from the stage (wgmma) or
       * ldmatrix does (mma.sync); packed codes are dequantized from raw */
      constexpr bool A_SMEM = W == TW_16 && WGMMA;
      uint4 raw[W == TW_16 ? 1 : CH / 512];
#pragma unroll
      for (int h = 0; h < (W == TW_16 ? 0 : CH / 512); h++)
        raw[h] = *(const uint4 *)(sb + raw_off + u * S::A1 + h * 512);
      /* the group's scales and zero points into dq (slot j of the stage) */
      /* vote (mxfp4): whether the warp's rows all allow the 16-bit multiply
       * (dq.fast); blocks whose scales all do (fp4_fast) skip it */
      auto reload_as = [&](auto vote) {
        cmp_gcol += G;
        if constexpr (W == TW_FP4) {
          /* e8m0 bytes of rows r, r + 8 side by side (moe_tc_pack); b: s =
           * 2^(b - 127) (b = 0: 2^-127, an fp32 subnormal; 0xFF is refused at
           * load). The 16-bit multiply (the codes' bits are value x 2^-126 in
           * bf16, x 2^-14 in fp16) takes s x 2^126 (2^14), a normal number of
           * the 16-bit type for b <= 128 (fp16: 99 <= b <= 128), made by its
           * bits: 2^(b - 1) in bf16, 2^(b - 113) in fp16, twice. */
          const uint32_t two = *(const uint16_t *)(sb + sc_off + j * BN);
          bool ok = true;
#pragma unroll
          for (int h = 0; h < 2; h++) {
            const uint32_t b8 = h ? two >> 8 : two & 0xFFu;
            dq.s[h] = b8 ? __uint_as_float(b8 << 23) : 0x1p-127f;
            dq.s16[h] = ACT == A_BF16 ? b8 * 0x00800080u + 0x3F003F00u        /* (b + 126) << 7 */
                                      : b8 * 0x04000400u - 98u * 0x04000400u; /* (b - 98) << 10 */
            ok = ok && fp4_fast16(ACT, b8);
          }
          if constexpr (decltype(vote)::value) dq.fast = __all_sync(0xFFFFFFFFu, ok); /* no divergence */
        } else {
#pragma unroll
          for (int h = 0; h < 2; h++) {
            const float sc = *(const float *)(sb + sc_off + j * BN * 4 + h * 32);
            dq.s[h] = sc;
            dq.s16[h] = pack2<ACT>(sc, sc); /* exact when scale16 */
            if (a.zero) set_zero(h, sb[zp_off + j * BN + h * 8]);
          }
        }
        j++;
      };
      auto reload = [&]() { reload_as(std::true_type{}); };
      auto deq = [&](int ks, bool scale16) {
        if (four_bit(W)) {
          const uint32_t wd[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
          dequant<W, MT>(&wd[ks], dq, scale16, af[ks]);
        } else {
          const uint4 v = raw[(ks >> 1) & (CH / 512 - 1)];
          const uint32_t wd[2] = {(ks & 1) ? v.z : v.x, (ks & 1) ? v.w : v.y};
          dequant<W, MT>(wd, dq, scale16, af[ks]);
        }
      };
      if constexpr (W == TW_16) {
        if constexpr (!A_SMEM) { /* rows 0-7 / 8-15 x columns 0-7 / 8-15: the four fragment registers */
#pragma unroll
          for (int ks = 0; ks < KB / 16; ks++) {
            const int r = warp * 16 + (lane & 15), chunk = 2 * ks + (lane >> 4);
            ldmatrix_x4(af[ks][0], af[ks][1], af[ks][2], af[ks][3],
                        sb + S::B + u * S::A1 + r * 128 + ((chunk ^ (r & 7)) << 4));
          }
        }
      } else if constexpr (FP8) { /* no scales in the weights (they join per K block or at the end) */
#pragma unroll
        for (int ks = 0; ks < KB / 16; ks++)
          deq(ks, false);
      } else if constexpr (MODE == M_SMALL_GROUPS) {
        /* groups of 16 or 32 columns: a check every 16 */
#pragma unroll
        for (int ks = 0; ks < KB / 16; ks++) {
          if (kb * KB + ks * 16 == cmp_gcol) reload();
          deq(ks, a.scale16);
        }
      } else if constexpr (MODE == M_FP4) {
        /* a block whose scales all allow the 16-bit multiply: a group every
         * 32 columns, its reload and slot constants, no vote, no branch */
#pragma unroll
        for (int ks = 0; ks < KB / 16; ks += 2) {
          reload_as(std::false_type{});
          deq(ks, true);
          deq(ks + 1, true);
        }
      } else if constexpr (MODE == M_RUNTIME) { /* the route checked here (see main_loop's dispatch) */
        if (G < KB) {
#pragma unroll
          for (int ks = 0; ks < KB / 16; ks++) {
            if (kb * KB + ks * 16 == cmp_gcol) reload();
            deq(ks, W == TW_FP4 ? dq.fast : a.scale16 != 0); /* mxfp4: the group's scales decide */
          }
        } else {
          if (kb * KB == cmp_gcol) reload();
          if (a.scale16) {
#pragma unroll
            for (int ks = 0; ks < KB / 16; ks++)
              deq(ks, true);
          } else {
#pragma unroll
            for (int ks = 0; ks < KB / 16; ks++)
              deq(ks, false);
          }
        }
      } else { /* groups of whole KB blocks: one check per block */
        if (kb * KB == cmp_gcol) reload();
#pragma unroll
        for (int ks = 0; ks < KB / 16; ks++)
          deq(ks, MODE == M_SCALE16);
      }
      /* fp8 block scales: where K blocks start (the first product starts their
       * sums: scale-d 0) and end; constants once u is unrolled (par: st's parity) */
      [[maybe_unused]] const int pos = decltype(par)::value * KS + u;
      [[maybe_unused]] const bool restart = FB > 0 && pos % (FB > 0 ? FB : 1) == 0,
                                  block_end = FB > 0 && (pos + 1) % (FB > 0 ? FB : 1) == 0;
#if defined(MOE_TC_WGMMA)
      /* everything the products read or write is in place before the fence
       * and untouched until their wait (else ptxas serializes them) */
      if (!A_SMEM)
#pragma unroll
        for (int ks = 0; ks < KB / 16; ks++)
          keep_alive(af[ks]);
      wgmma_fence();
      const uint32_t none[4] = {0, 0, 0, 0}; /* SS: no A registers */
      const uint64_t db = dstage + (uint32_t)(u * S::B1 >> 4),
                     da = dstage + ((uint32_t)(S::B + u * S::A1 + (warp >> 2) * 8192) >> 4);
#pragma unroll
      for (int ks = 0; ks < KB / 16; ks++) {
        if constexpr (A_SMEM) /* this warpgroup's 64 rows of the stage */
          wgmma<BT, MT, true>(ac.v, none, da + ks * 2, db + ks * 2);
        else if (FP8 && ks == 0 && restart)
          wgmma<BT, MT, false, 0>(ac.v, af[ks], 0, db + ks * 2);
        else
          wgmma<BT, MT, false>(ac.v, af[ks], 0, db + ks * 2);
      }
      wgmma_commit();
      if (block_end) fp8_block_end(ac, kb / (FB > 0 ? FB : 1));
      /* This block's products stay in flight while the next block's
       * fragments are made; the previous block's are done here. Its
       * fragments (af_prev) must stay in their registers until this point,
       * or the compiler may hand those registers to af, written while the
       * tensor cores still read them (that race gave wrong results). */
      wgmma_wait<1>();
      if (!A_SMEM)
#pragma unroll
        for (int ks = 0; ks < KB / 16; ks++)
          keep_alive(af_prev[ks]);
#else
      const uint8_t *sbu = sb + u * S::B1;
#pragma unroll
      for (int ks = 0; ks < KB / 16; ks++) {
#pragma unroll
        for (int jj = 0; jj < NT; jj += 2) {
          const int mat = lane >> 3, t = jj + (NT > 1 ? mat >> 1 : 0), r = t * 8 + (lane & 7);
          const int chunk = 2 * ks + (mat & 1);
          const uint8_t *p = sbu + r * 128 + ((chunk ^ (r & 7)) << 4);
          uint32_t b0, b1, b2, b3;
          if (NT > 1) {
            ldmatrix_x4(b0, b1, b2, b3, p);
            mma<MT>(ac.v[jj], af[ks], b0, b1);
            mma<MT>(ac.v[jj + 1], af[ks], b2, b3);
          } else {
            ldmatrix_x2(b0, b1, p);
            mma<MT>(ac.v[jj], af[ks], b0, b1);
          }
        }
      }
      if (block_end) fp8_block_end(ac, kb / (FB > 0 ? FB : 1));
#endif
    }
  };

  /* PF stages ahead */
#if defined(MOE_TC_WGMMA)
  constexpr int PF = ST - 2; /* the stage before this one is still being read */
#else
  constexpr int PF = ST - 1;
#endif
#pragma unroll
  for (int s = 0; s < PF; s++) {
    if (s < nst) issue(s, smem + s * S::STAGE);
    cp_async_commit();
  }
  uint8_t *const smem_end = smem + ST * S::STAGE;
  uint8_t *iss_sb = smem + PF * S::STAGE, *cmp_sb = smem;
  auto step = [&](Acc &ac, int st, uint32_t(&afA)[KB / 16][4], uint32_t(&afB)[KB / 16][4], auto mode,
                  auto par) {
    cp_async_wait<PF - 1>();
#if defined(MOE_TC_WGMMA)
    fence_proxy_async();
#endif
    __syncthreads(); /* stage st landed for everyone; the stage PF ahead is free */
    if (st + PF < nst) issue(st + PF, iss_sb);
    iss_sb = iss_sb + S::STAGE == smem_end ? smem : iss_sb + S::STAGE;
    cp_async_commit();
    compute(ac, st, cmp_sb, afA, afB, mode, par);
    cmp_sb = cmp_sb + S::STAGE == smem_end ? smem : cmp_sb + S::STAGE;
  };
  uint32_t af0[KB / 16][4], af1[KB / 16][4];
  /* the main loop and the epilogue, with accumulators of their own: each
   * dequantization route below is a copy of this, and accumulators shared by
   * the copies made ptxas serialize every wgmma (moves into them at the join) */
  auto finish = [&](Acc &ac) {
#if defined(MOE_TC_WGMMA)
    wgmma_wait<0>();
    fence_acc(ac.v); /* the epilogue reads the accumulators after the wait */
#endif
    cp_async_wait<0>();
    pdl_next();          /* the next GEMM (or the sum) may launch: only this block's stores are left */
    if constexpr (FP8) { /* the sums with their scales: block ones done, else (sum * sx) * sw */
      constexpr bool blk = FB > 0;
      const float sw0 = blk ? 1.0f : fp8_sw(0, 0), sw1 = blk ? 1.0f : fp8_sw(1, 0);
#pragma unroll
      for (int j = 0; j < NT; j++)
#pragma unroll
        for (int q = 0; q < 2; q++) {
          const float sx = blk ? 1.0f : fp8_sx(j, q, 0);
          ac.v[j][q] = blk ? ac.t[j][q] : ac.v[j][q] * sx * sw0;
          ac.v[j][2 + q] = blk ? ac.t[j][2 + q] : ac.v[j][2 + q] * sx * sw1;
        }
    }
    if (mt < mtc)
      store_tile<ACT, false>(a, ac.v, mt, lane, rows, row0, slot_of, tw_of, SPLIT ? seg_of : -1, e);
  };
  auto main_loop = [&](auto mode) {
    Acc ac;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int q = 0; q < 4; q++)
        ac.v[j][q] = 0.0f;
#pragma unroll
    for (int j = 0; j < (FP8 ? NT : 1); j++)
#pragma unroll
      for (int q = 0; q < 4; q++)
        ac.t[j][q] = 0.0f;
    if constexpr (KS % 2 == 0) { /* each stage ends on afB: the next starts on afA */
      for (int st = 0; st < nst; st++)
        step(ac, st, af0, af1, mode, std::integral_constant<int, 0>{}); /* st KS is even */
    } else { /* by two: the fragment buffers alternate by name */
      for (int st = 0; st < nst; st += 2) {
        step(ac, st, af0, af1, mode, std::integral_constant<int, 0>{});
        if (st + 1 < nst)
          step(ac, st + 1, af1, af0, mode, std::integral_constant<int, 1>{});
        else
          retire_all();
      }
    }
    finish(ac);
  };
  /* The decode tiles decide the dequantization route once per block,
   * outside the loop: a check of the group size and the scale kind in every
   * KB block cost issue slots and a constant load their loop could not hide.
   * The large tile keeps one loop that checks (three copies of it push its
   * registers past the cap into spills). */
  if constexpr (!WNA16 || KS == 1)
    main_loop(std::integral_constant<int, M_RUNTIME>{});
  else if constexpr (W == TW_FP4) { /* groups of 32, always */
    /* Two loops under a branch on a per-block value: ptxas then computes
     * their wgmma descriptors on the vector path (R2UR moves), yet one loop
     * with the flag checked per group measured 1-7% slower (RESULTS.md,
     * fourteenth pass). */
    if (fp4_fast)
      main_loop(std::integral_constant<int, M_FP4>{});
    else /* some scale of the block needs the fp32 route: checked per group */
      main_loop(std::integral_constant<int, M_RUNTIME>{});
  } else if (G < KB)
    main_loop(std::integral_constant<int, M_SMALL_GROUPS>{});
  else if (a.scale16)
    main_loop(std::integral_constant<int, M_SCALE16>{});
  else
    main_loop(std::integral_constant<int, M_SCALE32>{});
}

/* The bulk path (sm_90a, 16-bit weights, the large tile): every operand
 * of a stage is one contiguous run, so one thread copies it with two bulk
 * copies and the multiplying warps never copy, load fragments or meet at
 * a block barrier. A = the weight rows (moe_tc_pack's layout), B = the
 * tile's token rows from a K-major buffer written for the call (phase 1:
 * gather_rows; phase 2: phase 1's epilogue), tile ti's rows at ti * BT.
 * Stages are handed over by mbarriers: full (the copies' bytes landed),
 * empty (each multiplying warp's products of the stage are done). The
 * products are the generic kernel's wgmma on the same operands in the
 * same K order (batch invariance: identical bits, test_gpu's tile test). */
namespace bulk {
constexpr int BN = 256, CONSUMERS = 4, THREADS = 128 * CONSUMERS + 32, A = BN * KB * 2, STAGES = 4;
/* the tile heights (token rows): the large configuration's 128, the tall
 * one's 136 (TC_TALL: an expert with 129-136 slots in one item instead of
 * two; the tuner picks it where that pays) */
constexpr int BT_LARGE = 128, BT_TALL = 136;
template <int BT> struct Rows {
  static constexpr int B = BT * KB * 2, STAGE = B + A, BYTES = STAGES * STAGE + 1024;
};
} // namespace bulk

#if defined(MOE_TC_WGMMA)
__device__ __forceinline__ void mbar_init(uint64_t *bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
/* CLUSTER: what the other block of a cluster wrote before its arrival is
 * visible after. BOUNDED: a wait that depends on the other block traps
 * after 10 s (a launch error instead of a hung device: the clusters are
 * new and their protocol has no other watchdog) */
template <bool CLUSTER = false, bool BOUNDED = false>
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
  uint32_t done;
  [[maybe_unused]] uint64_t t0 = 0;
  do {
    if constexpr (CLUSTER)
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], "
                   "%2;\nselp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done)
                   : "r"(smem_addr(bar)), "r"(parity)
                   : "memory");
    else
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, "
                   "0, p;\n}\n"
                   : "=r"(done)
                   : "r"(smem_addr(bar)), "r"(parity)
                   : "memory");
    if constexpr (BOUNDED)
      if (!done) {
        uint64_t now;
        asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
        if (!t0)
          t0 = now;
        else if (now - t0 > 10000000000ull)
          __trap();
      }
  } while (!done);
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
/* one arrival that also expects `bytes` of bulk copies */
__device__ __forceinline__ void mbar_expect(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
/* `bytes` (a multiple of 16) by the copy engine, counted on bar */
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
/* bulk_copy into the same offset of both blocks of a cluster of two, counted
 * on each one's bar at the same offset */
__device__ __forceinline__ void bulk_copy_pair(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], "
               "[%1], %2, [%3], %4;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar)), "h"((uint16_t)3)
               : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
/* p's address in the other block of a cluster of two */
__device__ __forceinline__ uint32_t peer(const void *p) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(r)
               : "r"(smem_addr(p)), "r"(cluster_rank() ^ 1));
  return r;
}
/* an arrival on the other block's bar; PUBLISH: what this thread wrote
 * before (into that block's shared memory) is visible to its waiters (a
 * cluster-scope release: two memory barriers). A stage's release needs no
 * fence: its reads were wgmma's, complete at wgmma.wait_group */
template <bool PUBLISH = false> __device__ __forceinline__ void mbar_arrive_peer(uint64_t *bar) {
  if constexpr (PUBLISH)
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(peer(bar))
                 : "memory");
  else
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(peer(bar)) : "memory");
}
/* a stage's products are done in this block: it may be refilled, in a
 * cluster of two only once the other block's are too (both copying
 * threads write into both blocks' stage) */
template <int CL> __device__ __forceinline__ void release_stage(uint64_t *bar) {
  mbar_arrive(bar);
  if constexpr (CL > 1) mbar_arrive_peer(bar);
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}
#endif

#if defined(MOE_TC_WGMMA)
/* The token columns a block multiplies: its tile's rows rounded up to a
 * wgmma width (16, 32, 64 or 128), so an expert's last, mostly empty tile
 * costs what its rows need (bench/RESULTS.md, tenth pass: DeepSeek-V3 bf16
 * T = 4096 -9%). The width changes N of the instruction only:
 * every output element is still one accumulator taking the same k16
 * products in the same order (the tile test compares the widths). */
__device__ __forceinline__ int bulk_cols(int rows) {
  return rows <= 16 ? 16 : rows <= 32 ? 32 : rows <= 64 ? 64 : rows <= 128 ? 128 : bulk::BT_TALL;
}

/* The block's products and epilogue on consumer warp `warp` with N token
 * columns (the copying warp copied N rows of each stage's token tile);
 * g0: the ring's stage count before this item (the persistent kernel's
 * ring runs on across items). */
template <int N, int ACT, int BT, int CL>
__device__ __forceinline__ void bulk_item(const TcArgs &a, uint8_t *smem, uint64_t *full, uint64_t *empty,
                                          int g0, int nkb, int n0, int ti, int rows, const int *slot_of,
                                          const float *tw_of, int e) {
  using namespace bulk;
  constexpr int B = Rows<BT>::B, STAGE = Rows<BT>::STAGE;
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  float acc[N / 8][4];
#pragma unroll
  for (int j = 0; j < N / 8; j++)
#pragma unroll
    for (int q = 0; q < 4; q++)
      acc[j][q] = 0.0f;
  const uint32_t none[4] = {0, 0, 0, 0};
  /* descriptors of stage 0; a stage and 16 columns further are plain adds
   * to the address field (in 16-byte units) */
  const uint64_t db = wgmma_desc(smem_addr(smem)),
                 da = wgmma_desc(smem_addr(smem) + B + (warp >> 2) * 64 * 128);
  for (int kb = 0; kb < nkb; kb++) {
    const int g = g0 + kb, s = g % STAGES;
    mbar_wait<false, (CL > 1)>(&full[s], (g / STAGES) & 1);
    const uint32_t so = (uint32_t)(s * STAGE) >> 4;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KB / 16; ks++)
      wgmma<N, ACT, true>(acc, none, da + so + ks * 2, db + so + ks * 2);
    wgmma_commit();
    wgmma_wait<1>(); /* the previous stage's products are done: hand it back */
    if (kb > 0 && lane == 0) release_stage<CL>(&empty[(g - 1) % STAGES]);
  }
  wgmma_wait<0>();
  fence_acc(acc);
  if (lane == 0)
    release_stage<CL>(&empty[(g0 + nkb - 1) % STAGES]); /* the last stage too: the ring runs on */
  const int mt = n0 / 16 + warp;
  if (mt >= a.n / 16) return;
  /* silu's gate_up and full items (most at large T) without the checks per element */
  const bool silu = a.phase == 1 && a.activation == MOE_ACT_SILU;
  if constexpr (N >= 128) {
    if (rows == N) {
      if (silu)
        store_tile<ACT, true, N / 8, MOE_ACT_SILU, true>(a, acc, mt, lane, rows, ti * BT, slot_of, tw_of, -1,
                                                         e);
      else
        store_tile<ACT, true, N / 8, -1, true>(a, acc, mt, lane, rows, ti * BT, slot_of, tw_of, -1, e);
      return;
    }
  }
  if (silu)
    store_tile<ACT, true, N / 8, MOE_ACT_SILU>(a, acc, mt, lane, rows, ti * BT, slot_of, tw_of, -1, e);
  else
    store_tile<ACT, true, N / 8>(a, acc, mt, lane, rows, ti * BT, slot_of, tw_of, -1, e);
}

/* bulk_item at the item's token width (bulk_cols) */
template <int ACT, int BT, int CL>
__device__ __forceinline__ void bulk_any(const TcArgs &a, uint8_t *smem, uint64_t *full, uint64_t *empty,
                                         int g0, int nkb, int n0, int ti, int rows, const int *slot_of,
                                         const float *tw_of, int e) {
  switch (bulk_cols(rows)) {
  case 16: bulk_item<16, ACT, BT, CL>(a, smem, full, empty, g0, nkb, n0, ti, rows, slot_of, tw_of, e); break;
  case 32: bulk_item<32, ACT, BT, CL>(a, smem, full, empty, g0, nkb, n0, ti, rows, slot_of, tw_of, e); break;
  case 64: bulk_item<64, ACT, BT, CL>(a, smem, full, empty, g0, nkb, n0, ti, rows, slot_of, tw_of, e); break;
  case 128:
    bulk_item<128, ACT, BT, CL>(a, smem, full, empty, g0, nkb, n0, ti, rows, slot_of, tw_of, e);
    break;
  default:
    if constexpr (BT > 128)
      bulk_item<BT, ACT, BT, CL>(a, smem, full, empty, g0, nkb, n0, ti, rows, slot_of, tw_of, e);
    break;
  }
}

/* One item's stages, issued by the copying thread from the ring's stage
 * count g0 on (waiting for each slot's previous use to be handed back). In
 * a cluster of two (CL 2: the same tile, two strips) each copying thread
 * copies half of the token rows into both blocks. */
template <int BT, int CL>
__device__ __forceinline__ void bulk_copy_item(const TcArgs &a, uint8_t *smem, uint64_t *full,
                                               uint64_t *empty, int g0, int nkb, int n0, int ti, int e,
                                               int cols, uint32_t rank) {
  using namespace bulk;
  constexpr int B = Rows<BT>::B, STAGE = Rows<BT>::STAGE;
  const int N = a.n;
  const uint32_t a_bytes = (uint32_t)((N - n0 < BN ? N - n0 : BN) * KB * 2),
                 b_bytes = (uint32_t)(cols * KB * 2);
  const uint8_t *wa = a.w + ((size_t)e * nkb * N + n0) * KB * 2, *xb = (const uint8_t *)a.x + (size_t)ti * B;
  for (int kb = 0; kb < nkb; kb++) {
    const int g = g0 + kb, s = g % STAGES;
    if (g >= STAGES) mbar_wait<false, (CL > 1)>(&empty[s], (g / STAGES - 1) & 1);
    uint8_t *sb = smem + s * STAGE;
    mbar_expect(&full[s], a_bytes + b_bytes);
    const uint8_t *src = xb + (size_t)kb * a.cap * KB * 2;
    if constexpr (CL > 1) /* halves of >= 8 rows: multiples of 1 KB */
      bulk_copy_pair(sb + rank * (b_bytes / 2), src + rank * (b_bytes / 2), b_bytes / 2, &full[s]);
    else
      bulk_copy(sb, src, b_bytes, &full[s]);
    bulk_copy(sb + B, wa + (size_t)kb * N * KB * 2, a_bytes, &full[s]);
  }
}
#endif

/* The persistent bulk kernel: one block per SM taking (tile, strip)
 * items from a counter (a.next, zeroed by gather_rows) in block_order's
 * order, so the next item's first stages are copied while this item's
 * epilogue runs and no block waits for a launch. The counter only
 * schedules: an item's products and their order do not depend on the
 * block that runs it or on what it ran before (bulk_item starts its
 * accumulators at 0).
 * The copying warp publishes each item (its tile, strip and slot lists)
 * in one of two item buffers (item_full); the consumers hand a buffer back
 * after its epilogue (item_empty).
 * CL 2: clusters of two blocks take (tile, strip pair) items, block r the
 * strip 2 p + r, and each token stage is read from L2 once for both (half
 * by each copying thread, multicast): a sixth less L2 traffic, which
 * bounds the large GEMMs of small experts (bench/RESULTS.md, sixteenth
 * pass). Block 0 takes the items from the counter and passes each to
 * block 1 (pid_box, pid_full). The products are the same. */
template <int ACT, int BT, int CL>
__global__ void __launch_bounds__(bulk::THREADS, 1) tc_gemm_bulk(TcArgs a) {
#if defined(MOE_TC_WGMMA)
  using namespace bulk;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  __shared__ uint64_t full[STAGES], empty[STAGES], item_full[2], item_empty[2], pid_full[2];
  __shared__ int4 item[2]; /* ti (-1: no more), strip, expert, rows */
  __shared__ int pid_box[2];
  __shared__ int slot_of[2][BT];
  __shared__ float tw_of[2][BT];
  uint8_t *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid < STAGES) {
    mbar_init(&full[tid], 1);
    mbar_init(&empty[tid], 4 * CONSUMERS * CL);
  }
  if (tid < 2) {
    mbar_init(&item_full[tid], 32);
    mbar_init(&item_empty[tid], 128 * CONSUMERS);
    mbar_init(&pid_full[tid], 1);
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  if constexpr (CL > 1)
    cluster_sync(); /* the other block's barriers exist before any arrival on them */
  else
    __syncthreads();
  pdl_wait();
  const uint32_t rank = CL > 1 ? cluster_rank() : 0;
  const int nkb = a.k / KB, strips = (a.n + BN - 1) / BN / CL;
  if (warp == 4 * CONSUMERS) { /* the copying warp */
    const int nt = *a.ntiles;
    const long long total = (long long)nt * strips;
    int g = 0;
    for (int it = 0;; it++) {
      const int buf = it & 1;
      /* CL 2: block 1 has read pid_box[buf] for item it - 2 before block 0's
       * consumers are done with that item (they need block 1's copies) */
      if (CL > 1 && it >= 2) mbar_wait(&item_empty[buf], (it / 2 - 1) & 1);
      int pid = 0;
      if (lane == 0) {
        if (rank == 0) {
          pid = atomicAdd(a.next, 1);
          if constexpr (CL > 1) {
            asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(peer(&pid_box[buf])), "r"(pid)
                         : "memory");
            mbar_arrive_peer<true>(&pid_full[buf]);
          }
        } else {
          mbar_wait<true, true>(&pid_full[buf], (it / 2) & 1);
          pid = *(volatile int *)&pid_box[buf];
        }
      }
      pid = __shfl_sync(0xffffffffu, pid, 0);
      if (CL == 1 && it >= 2) mbar_wait(&item_empty[buf], (it / 2 - 1) & 1); /* the counter's latency first */
      if (pid >= total) {
        if (lane == 0) item[buf] = make_int4(-1, 0, 0, 0);
        pdl_next(); /* the next kernel may launch: only the last items' products and stores are left */
        mbar_arrive(&item_full[buf]);
        break;
      }
      int ti, strip;
      item_order(pid, nt, strips, ti, strip);
      strip = strip * CL + (int)rank;
      const int4 tile = a.tiles[ti];
      for (int i = lane; i < BT; i += 32)
        load_slot(a, a.sorted, tile.y, tile.z, i, slot_of[buf], tw_of[buf]);
      if (lane == 0) item[buf] = make_int4(ti, strip, tile.x, tile.z);
      mbar_arrive(&item_full[buf]);
      if (lane == 0)
        bulk_copy_item<BT, CL>(a, smem, full, empty, g, nkb, strip * BN, ti, tile.x, bulk_cols(tile.z), rank);
      g += nkb;
    }
  } else {
    int g = 0;
    for (int it = 0;; it++) {
      const int buf = it & 1;
      mbar_wait(&item_full[buf], (it / 2) & 1);
      const int4 m = item[buf];
      if (m.x < 0) break;
      bulk_any<ACT, BT, CL>(a, smem, full, empty, g, nkb, m.y * BN, m.x, m.w, slot_of[buf], tw_of[buf], m.z);
      g += nkb;
      mbar_arrive(&item_empty[buf]);
    }
  }
  if constexpr (CL > 1) cluster_sync(); /* no block leaves while the other may still arrive on its barriers */
#else
  (void)a; /* moe_tc_bulk is false off sm_90a */
#endif
}

/* Phase 1's B for the bulk path: hidden_states rows in tile order, K-major
 * (tile ti's row i at ti * BT + i). Rows past the tile's count are not
 * written (as phase 1's epilogue leaves them in phase 2's B): whatever
 * they hold only reaches the products of their own token columns, which
 * no epilogue stores (each output element is one column's dot product).
 * Writing zeros there cost up to half the kernel's bytes (Qwen3-30B-A3B at
 * T = 1024: one half-empty 128-row tile per expert). One block per (tile,
 * KB columns), 16 bytes per thread and step. */
__global__ void gather_rows(TcArgs a, uint16_t *xk) {
  const int BT = a.bt;
  pdl_wait();
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 2) a.next[threadIdx.x] = 0; /* both GEMMs' items */
  const int ti = (int)blockIdx.x;
  if (ti >= *a.ntiles) return;
  const int4 tile = a.tiles[ti];
  const int row0 = tile.y, rows = tile.z, K = a.k;
  const uint16_t *x = (const uint16_t *)a.x;
  for (int q = (int)threadIdx.x; q < BT * KB / 8; q += (int)blockDim.x) {
    const int c = q & 7, r = q / 8, col = (int)blockIdx.y * KB + c * 8;
    if (r >= rows) break; /* r grows with q */
    const uint16_t *src = x + (size_t)(a.sorted[row0 + r] / a.top_k) * (size_t)K + col;
    uint4 v;
    if (a.x_vec) {
      v = *(const uint4 *)src;
    } else {
      uint32_t u[4];
      for (int p = 0; p < 4; p++)
        u[p] = src[2 * p] | (uint32_t)src[2 * p + 1] << 16;
      v = make_uint4(u[0], u[1], u[2], u[3]);
    }
    *(uint4 *)(xk + kmajor(col, ti * BT + r, a.cap)) = v;
  }
  pdl_next();
}

/* ---- packing ------------------------------------------------------------------------ */

/* Original row of packed row p of a matrix with N rows (W13: N = 2I). */
__device__ __forceinline__ int orig_row(int p, bool w13, int inter, bool interleaved) {
  if (!w13) return p;
  const int unit = (p >> 4) * 8 + (p & 7), up = (p >> 3) & 1;
  return interleaved ? 2 * unit + up : up * inter + unit;
}

/* One thread per (expert, 16-row block, KB block, lane). 16-bit weights:
 * [E][K / KB][N][KB], each 128-byte row's 16-byte chunks in the stage's
 * swizzled order, so that a stage's A (rows n0.. of one KB block) is one
 * contiguous run; packed codes: the fragment order per 16-row block. */
template <int W>
__global__ void pack_weights(const uint8_t *src, uint8_t *dst, int experts, int n, int k, int w13, int inter,
                             int interleaved) {
  const int mtc = n / 16, nkb = k / KB;
  const size_t total = (size_t)experts * mtc * nkb * 32;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const int lane = (int)(i % 32), kb = (int)(i / 32 % nkb), mt = (int)(i / 32 / nkb % mtc);
    const int e = (int)(i / 32 / nkb / mtc);
    if (W == TW_16) { /* lane: half a row, chunks swizzled as in the stage (row r: c ^ (r & 7)) */
      const int r = mt * 16 + (lane >> 1), row = orig_row(r, w13, inter, interleaved);
      const uint16_t *in = (const uint16_t *)src + ((size_t)e * n + row) * k + kb * KB;
      uint8_t *out = dst + (((size_t)e * nkb + kb) * n + r) * 128;
      for (int c = (lane & 1) * 4; c < (lane & 1) * 4 + 4; c++) {
        uint32_t v[4];
        for (int p = 0; p < 4; p++)
          v[p] = in[c * 8 + 2 * p] | (uint32_t)in[c * 8 + 2 * p + 1] << 16;
        *(uint4 *)(out + ((c ^ (r & 7)) << 4)) = make_uint4(v[0], v[1], v[2], v[3]);
      }
      continue;
    }
    const int g = lane >> 2, c = lane & 3;
    const int rows[2] = {orig_row(mt * 16 + g, w13, inter, interleaved),
                         orig_row(mt * 16 + g + 8, w13, inter, interleaved)};
    uint8_t *out = dst + ((size_t)e * mtc * nkb + (size_t)mt * nkb + kb) * chunk_bytes(W);
    for (int ks = 0; ks < 4; ks++) {
      uint32_t v[8]; /* a0..a7: (row, col) = (g | g + 8 by bit 1, 2c + bit 0 + 8 by bit 2) */
      for (int q = 0; q < 8; q++) {
        const size_t row = (size_t)e * n + rows[(q >> 1) & 1];
        const int col = kb * KB + ks * 16 + 2 * c + (q & 1) + 8 * (q >> 2);
        if (W == TW_INT8) {
          v[q] = src[row * k + col];
        } else {
          const uint8_t b = src[row * (size_t)(k / 2) + col / 2];
          v[q] = (col & 1) ? b >> 4 : b & 15u;
        }
      }
      if (W == TW_INT8) {
        uint32_t *o = (uint32_t *)(out + (ks >> 1) * 512 + lane * 16 + (ks & 1) * 8);
        o[0] = v[0] | v[1] << 8 | v[2] << 16 | v[3] << 24;
        o[1] = v[4] | v[5] << 8 | v[6] << 16 | v[7] << 24;
      } else if (W == TW_FP4) { /* pair p: its codes' bits where dequant wants them (fp4_at) */
        uint32_t wd = 0;
        for (int p = 0; p < 4; p++)
          for (int bit = 0; bit < 4; bit++)
            wd |= (v[2 * p] >> bit & 1u) << fp4_at(p, bit) | (v[2 * p + 1] >> bit & 1u)
                                                                 << (16 + fp4_at(p, bit));
        *(uint32_t *)(out + lane * 16 + ks * 4) = wd;
      } else { /* pair p: low element at nibble p, high at nibble p + 4 */
        uint32_t wd = 0;
        for (int p = 0; p < 4; p++)
          wd |= v[2 * p] << (4 * p) | v[2 * p + 1] << (4 * (p + 4));
        *(uint32_t *)(out + lane * 16 + ks * 4) = wd;
      }
    }
  }
}

/* scales [E][N][groups] (any float dtype) -> fp32 [E][groups][N packed],
 * mxfp4's e8m0 bytes (e8) -> the same bytes [E][groups][N packed]; zero
 * points (int4 packed along N, or int8) -> uint8 [E][groups][N packed] */
__global__ void pack_groups(const void *scales, int scale_dt, const uint8_t *zeros, int bits, void *s_out,
                            int e8, uint8_t *z_out, int experts, int n, int groups, int w13, int inter,
                            int interleaved) {
  const size_t total = (size_t)experts * groups * n;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const int p = (int)(i % n), g = (int)(i / n % groups), e = (int)(i / n / groups);
    const int r = orig_row(p, w13, inter, interleaved);
    const size_t si = ((size_t)e * n + r) * groups + g;
    if (e8) /* rows r and r + 8 of each 16 side by side: one 16-bit load in the kernel */
      ((uint8_t *)s_out)[i - p % 16 + p % 8 * 2 + p / 8 % 2] = ((const uint8_t *)scales)[si];
    else
      ((float *)s_out)[i] = scale_dt == MOE_F16    ? moe_f16_to_f32(((const uint16_t *)scales)[si])
                            : scale_dt == MOE_BF16 ? moe_bf16_to_f32(((const uint16_t *)scales)[si])
                                                   : ((const float *)scales)[si];
    if (zeros) {
      if (bits == 4) {
        const uint8_t b = zeros[((size_t)e * (n / 2) + r / 2) * groups + g];
        z_out[i] = (r & 1) ? b >> 4 : b & 15u;
      } else {
        z_out[i] = zeros[si];
      }
    }
  }
}

/* mxfp4: after the packed scales [E][groups][N], per expert and 16 rows:
 * bit 0, every scale allows bf16's 16-bit multiply; bit 1, fp16's
 * (fp4_fast16; tc_gemm's fp4_fast) */
__global__ void fp4_flags(uint8_t *sc, int experts, int n, int groups) {
  const size_t total = (size_t)experts * (size_t)(n / 16);
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const int mt = (int)(i % (size_t)(n / 16)), e = (int)(i / (size_t)(n / 16));
    bool bf = true, hf = true;
    for (int g = 0; g < groups; g++)
      for (int r = 0; r < 16; r++) {
        const uint32_t b8 = sc[((size_t)e * groups + g) * (size_t)n + (size_t)mt * 16 + r];
        bf = bf && fp4_fast16(A_BF16, b8);
        hf = hf && fp4_fast16(A_F16, b8);
      }
    sc[(size_t)experts * groups * (size_t)n + i] = (uint8_t)(bf | hf << 1);
  }
}

template <int W, int ACT, class C, bool SPLIT = false, int FB = 0>
moe_status launch(moe_backend *b, int max_tiles, const TcArgs &a, moe_error *err) {
  using S = Smem<W, C>;
  /* the limit is an attribute of the function per device; set once each
   * (a benign race: every thread sets the same value) */
  static bool attr_set[64];
  const int dev = b->device;
  if (dev < 0 || dev >= 64 || !attr_set[dev]) {
    moe_status s = moe_gpu_check(cudaFuncSetAttribute(tc_gemm<W, ACT, C, SPLIT, FB>,
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize, S::BYTES),
                                 "fused_moe tensor-core smem", err);
    if (s) return s;
    if (dev >= 0 && dev < 64) attr_set[dev] = true;
  }
  /* tiles x strips (x K segments) */
  const dim3 grid((unsigned)max_tiles, (unsigned)((a.n + C::BN - 1) / C::BN * a.split));
  return moe_gpu_check(pdl_launch(moe_gpu_pdl(b), 1, tc_gemm<W, ACT, C, SPLIT, FB>, grid, dim3(C::THREADS),
                                  S::BYTES, moe_gpu_stream(b), a),
                       "fused_moe tensor-core gemm", err);
}

/* packed codes: their decode tiles, the split kernel when SPLIT, fp8's
 * block scales when FB */
template <int W, int ACT, bool SPLIT, int FB = 0>
moe_status launch_packed(moe_backend *b, int config, int max_tiles, const TcArgs &a, moe_error *err) {
  using QS = std::conditional_t<W == TW_FP8, CfgQS8, CfgQS>;
  using QM = std::conditional_t<W == TW_FP8, CfgQM8, CfgQM>;
  switch (config) {
  case TC_SMALL: return launch<W, ACT, QS, SPLIT, FB>(b, max_tiles, a, err);
  case TC_MEDIUM: return launch<W, ACT, QM, SPLIT, FB>(b, max_tiles, a, err);
  default:
    /* fp8 block scales keep two sets of sums: the large tile's would pass the register cap */
    if constexpr (W == TW_FP8)
      return launch<W, ACT, CfgW, SPLIT, FB>(b, max_tiles, a, err);
    else
      return launch<W, ACT, CfgL, SPLIT>(b, max_tiles, a, err);
  }
}

template <int W, int ACT>
moe_status launch_cfg(moe_backend *b, int config, int max_tiles, const TcArgs &a, moe_error *err) {
  if constexpr (W == TW_16) {
    switch (config) {
    case TC_SMALL: return launch<W, ACT, CfgS>(b, max_tiles, a, err);
    case TC_MEDIUM: return launch<W, ACT, CfgM>(b, max_tiles, a, err);
    case TC_WIDE: return launch<W, ACT, CfgW>(b, max_tiles, a, err);
    default: return launch<W, ACT, CfgL>(b, max_tiles, a, err);
    }
  } else { /* packed codes: the wide tile is never chosen (moe_tc_choose), so forcing it takes the large one
            */
    if constexpr (W == TW_FP8) /* never split (moe_tc_split); BK = 128 (moe_gpu_fused_packs) */
      return a.wscale == MOE_WSCALE_BLOCK
                 ? launch_packed<W, ACT, false, 128 / KB>(b, config, max_tiles, a, err)
                 : launch_packed<W, ACT, false>(b, config, max_tiles, a, err);
    else
      return a.split > 1 ? launch_packed<W, ACT, true>(b, config, max_tiles, a, err)
                         : launch_packed<W, ACT, false>(b, config, max_tiles, a, err);
  }
}

template <int W>
moe_status launch_act(moe_backend *b, int act, int config, int max_tiles, const TcArgs &a, moe_error *err) {
  return act == A_BF16 ? launch_cfg<W, A_BF16>(b, config, max_tiles, a, err)
                       : launch_cfg<W, A_F16>(b, config, max_tiles, a, err);
}

/* Clusters of two sharing the token stages where the strips pair up
 * (every layer of bench/RESULTS.md), with MOE_GPU_BULK_CLUSTER=1 only:
 * written without a GPU at hand and not yet run on one
 * (docs/gpu-kernels.md), so not the default. */
static int bulk_cluster(const TcArgs &a) {
  const char *env = getenv("MOE_GPU_BULK_CLUSTER");
  return (a.n + bulk::BN - 1) / bulk::BN % 2 == 0 && env && !strcmp(env, "1") ? 2 : 1;
}

template <int ACT, int BT, int CL>
moe_status launch_bulk_cl(moe_backend *b, int max_tiles, const TcArgs &a, moe_error *err) {
  constexpr int BYTES = bulk::Rows<BT>::BYTES;
  static bool attr_set[64];  /* as in launch */
  static int max_blocks[64]; /* blocks of this kernel resident at once (clusters that fit, x CL) */
  const int dev = b->device;
  if (dev < 0 || dev >= 64 || !attr_set[dev]) {
    moe_status s = moe_gpu_check(
        cudaFuncSetAttribute(tc_gemm_bulk<ACT, BT, CL>, cudaFuncAttributeMaxDynamicSharedMemorySize, BYTES),
        "fused_moe tensor-core smem", err);
    if (s) return s;
    int fit = moe_gpu_sm_count(b) / CL;
    if (CL > 1) {
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = CL;
      attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3((unsigned)(fit * CL));
      cfg.blockDim = dim3(bulk::THREADS);
      cfg.dynamicSmemBytes = BYTES;
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      s = moe_gpu_check(cudaOccupancyMaxActiveClusters(&fit, tc_gemm_bulk<ACT, BT, CL>, &cfg),
                        "fused_moe tensor-core clusters", err);
      if (s) return s;
    }
    if (dev >= 0 && dev < 64) {
      max_blocks[dev] = fit * CL;
      attr_set[dev] = true;
    }
  }
  /* one block per SM (fewer with MOE_GPU_BULK_BLOCKS: tests run many items per block) */
  long long blocks = dev >= 0 && dev < 64 ? max_blocks[dev] : moe_gpu_sm_count(b),
            items = (long long)max_tiles * ((a.n + bulk::BN - 1) / bulk::BN);
  if (const char *cap = getenv("MOE_GPU_BULK_BLOCKS"))
    if (atoi(cap) > 0 && atoi(cap) < blocks) blocks = atoi(cap);
  if (items < blocks) blocks = items;
  blocks = blocks / CL * CL; /* whole clusters: items come in CL strips each */
  if (blocks < CL) blocks = CL;
  return moe_gpu_check(pdl_launch(moe_gpu_pdl(b), (unsigned)CL, tc_gemm_bulk<ACT, BT, CL>,
                                  dim3((unsigned)blocks), dim3(bulk::THREADS), BYTES, moe_gpu_stream(b), a),
                       "fused_moe tensor-core gemm", err);
}

template <int ACT, int BT>
moe_status launch_bulk(moe_backend *b, int max_tiles, const TcArgs &a, moe_error *err) {
  return bulk_cluster(a) > 1 ? launch_bulk_cl<ACT, BT, 2>(b, max_tiles, a, err)
                             : launch_bulk_cl<ACT, BT, 1>(b, max_tiles, a, err);
}

/* Two fp32 values as e4m3fn codes (RNE, subnormals, saturated to +-448, NaN
 * -> 0x7F: codec.h's moe_f32_to_narrow, which sm_89+'s cvt computes exactly;
 * quant.hip's fast path and tests rely on the same equality), returned as
 * those codes' values in an fp16 pair. */
__device__ __forceinline__ uint32_t e4m3_values2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short c;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(c) : "f"(hi), "f"(lo));
  return e4m3x2_f16x2(c);
#else
  const moe_narrow_fmt f = MOE_FMT_E4M3FN;
  return e4m3x2_f16x2(moe_f32_to_narrow(lo, &f, false) | moe_f32_to_narrow(hi, &f, false) << 8);
#endif
}

/* Four 16-bit values at p (8-byte aligned when VEC) as fp32. */
template <int ACT, bool VEC> __device__ __forceinline__ void load4(const uint16_t *p, float v[4]) {
  uint32_t w[2];
  if (VEC) {
    const uint2 u = *(const uint2 *)p;
    w[0] = u.x;
    w[1] = u.y;
  } else {
    w[0] = p[0] | (uint32_t)p[1] << 16;
    w[1] = p[2] | (uint32_t)p[3] << 16;
  }
  unpack2<ACT>(w[0], v[0], v[1]);
  unpack2<ACT>(w[1], v[2], v[3]);
}

/* fp8 W8A8 (moe_tc_fp8_act): per (tile row, group of a.xg columns): the
 * group's amax (finite values), its scale, the codes as
 * quant.per_token_group makes them (x * (1 / s) or x / s), their values in
 * fp16. A warp per unit, four columns per lane and step; a group of 512
 * columns or more (per-token scales: g = K, up to 16K) takes a block. The
 * second pass reads the group again (L1). */
__host__ __device__ constexpr bool fp8_act_whole(int g) { return g >= 512; }

/* tokens per block row of the grid (by token): one, so that a small batch
 * still spreads over the SMs (64 left Qwen3-30B-A3B's T = 64 on two blocks:
 * 251 us against 198 by slot) */
constexpr int FP8_TOKEN_ROWS = 1;

/* tokens > 0: by token (phase 1, dynamic scales): rows of x are tokens, xq
 * gets a row per token and xs_tok the scales [K / xg][tokens]; else by the
 * tiles' slots: xq and a.xs in the tile list's order. */
template <int ACT, bool VEC>
__global__ void __launch_bounds__(256) fp8_act_kernel(TcArgs a, const void *x, const float *static_scale,
                                                      int exact, uint16_t *xq, int tokens, float *xs_tok) {
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  __shared__ uint32_t part[8]; /* the warps' amax bits (a block per unit) */
  pdl_wait();
  int e = 0, row0, rows;
  if (tokens) {
    row0 = (int)blockIdx.x * FP8_TOKEN_ROWS;
    rows = tokens - row0 < FP8_TOKEN_ROWS ? tokens - row0 : FP8_TOKEN_ROWS;
  } else {
    if ((int)blockIdx.x >= *a.ntiles) return;
    const int4 tile = a.tiles[blockIdx.x];
    e = tile.x, row0 = tile.y, rows = tile.z;
  }
  const int K = a.k, g = a.xg, nb = K / g;
  const bool whole = fp8_act_whole(g);
  const int warps = (int)blockDim.x >> 5, lanes = whole ? (int)blockDim.x : 32,
            me = whole ? (int)threadIdx.x : lane;
  const int first = whole ? (int)blockIdx.y : (int)blockIdx.y * warps + warp,
            step = whole ? (int)gridDim.y : (int)gridDim.y * warps;
  for (int u = first; u < rows * nb; u += step) { /* u is one value across a block when whole */
    const int p = row0 + u / nb, blk = u % nb;
    const size_t src = a.phase == 1 && !tokens ? (size_t)(a.sorted[p] / a.top_k) : (size_t)p;
    const uint16_t *in = (const uint16_t *)x + src * (size_t)K + (size_t)blk * g;
    uint32_t m = 0; /* |v| bits of the finite values: their max is the amax */
    for (int j = 4 * me; j < g; j += 4 * lanes) {
      float v[4];
      load4<ACT, VEC>(in + j, v);
#pragma unroll
      for (int q = 0; q < 4; q++) {
        const uint32_t bits = moe_f32_bits(v[q]) & 0x7FFFFFFFu;
        m = bits < 0x7F800000u && bits > m ? bits : m;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const uint32_t t = MOE_SHFL_XOR(m, o);
      m = t > m ? t : m;
    }
    if (whole) {
      if (lane == 0) part[warp] = m;
      __syncthreads();
      for (int w = 0; w < warps; w++)
        m = part[w] > m ? part[w] : m;
      __syncthreads(); /* part is rewritten for the next unit */
    }
    const float s = static_scale ? static_scale[e] : moe_dynamic_scale(moe_f32_from_bits(m), 448.0f, false);
    const float r = 1.0f / s;
    uint16_t *out = xq + (size_t)p * (size_t)K + (size_t)blk * g; /* 8-byte aligned: K % 128 == 0 */
    for (int j = 4 * me; j < g; j += 4 * lanes) {
      float v[4];
      load4<ACT, VEC>(in + j, v);
#pragma unroll
      for (int q = 0; q < 4; q++)
        v[q] = exact ? v[q] / s : v[q] * r;
      *(uint2 *)(out + j) = make_uint2(e4m3_values2(v[0], v[1]), e4m3_values2(v[2], v[3]));
    }
    if (me == 0) {
      if (tokens)
        xs_tok[(size_t)blk * (size_t)tokens + (size_t)p] = s;
      else
        a.xs[(size_t)blk * (size_t)a.xrows + (size_t)p] = s;
    }
  }
  pdl_next();
}

/* By token, then: each tile slot's scales from its token's (a.xs in the
 * tile list's order, as the GEMM's joins read them). */
__global__ void fp8_scale_slots(TcArgs a, const float *xs_tok, int tokens) {
  pdl_wait();
  if ((int)blockIdx.x >= *a.ntiles) return;
  const int4 tile = a.tiles[blockIdx.x];
  const int row0 = tile.y, rows = tile.z, nb = a.k / a.xg;
  for (int u = (int)threadIdx.x; u < rows * nb; u += (int)blockDim.x) {
    const int p = row0 + u % rows, blk = u / rows;
    a.xs[(size_t)blk * (size_t)a.xrows + (size_t)p] =
        xs_tok[(size_t)blk * (size_t)tokens + (size_t)(a.sorted[p] / a.top_k)];
  }
  pdl_next();
}

unsigned blocks_for(size_t items, moe_backend *b) {
  size_t blocks = (items + 255) / 256, cap = (size_t)moe_gpu_sm_count(b) * 16;
  return (unsigned)(blocks < 1 ? 1 : blocks > cap ? cap : blocks);
}

} // namespace

int moe_tc_rows(int config) {
  /* tall: the large tile where the bulk path does not run (moe_tc_bulk) */
  static const int rows[TC_CONFIGS] = {CfgS::BT, CfgM::BT, CfgW::BT, CfgL::BT, CfgL::BT};
  return rows[config];
}
int moe_tc_bulk_rows(int config) { return config == TC_TALL ? bulk::BT_TALL : bulk::BT_LARGE; }

/* A row of the tuned table (fused_moe_tuned.h, written by `moe-bench-gpu
 * --tune`): on device `device`, for sets of this shape and weight kind and
 * batches of lo..hi slots per routed expert, configuration `config` beat
 * the untuned choice. The table ends with a row whose device is NULL. */
struct Tuned {
  const char *device;
  int experts, hidden, inter, wkind;
  int64_t lo, hi;
  int config;
};
#include "fused_moe_tuned.h"

int moe_tc_choose(moe_backend *b, const moe_expert_config *cfg, int64_t avg) {
  const int w = tc_wkind(cfg);
  const char *off = getenv("MOE_GPU_TC_TUNED"); /* 0: the untuned choice (what the tuner compares against) */
  if (!(off && !strcmp(off, "0"))) {
    const char *name = moe_gpu_device_name(b);
    for (const Tuned *t = tuned; t->device; t++)
      if (t->experts == cfg->num_experts && t->hidden == cfg->hidden_size &&
          t->inter == cfg->intermediate_size && t->wkind == w && avg >= t->lo && avg <= t->hi &&
          !strcmp(t->device, name))
        return t->config;
  }
  return moe_tc_untuned(cfg->scheme, (int)cfg->bits, avg);
}

extern "C" int moe_tc_untuned(moe_scheme scheme, int bits, int64_t avg) {
  const int w = tc_wkind_of(scheme, bits);
  /* the largest average slot count each configuration takes, per weight
   * kind (0: never); measured on the H200 (bench/RESULTS.md, tile choice).
   * The 128 x 64 tile pays for 16-bit weights only: with int4/int8 its
   * two warpgroups per block leave too few warps for the dequantization. */
  static const int64_t upto[TW_KINDS][TC_CONFIGS] = {
      /* TW_16 */ {4, 16, 48, INT64_MAX, 0}, /* tall: only where the tuner found it faster */
      /* TW_INT4 */ {4, 48, 0, INT64_MAX, 0},
      /* TW_INT8 */ {4, 48, 0, INT64_MAX, 0},
      /* TW_FP4 */ {4, 48, 0, INT64_MAX, 0},
      /* TW_FP8 */ {16, 64, INT64_MAX, 0, 0}, /* the wide tile is its largest (launch_packed) */
  };
  for (int c = 0; c < TC_CONFIGS; c++)
    if (avg <= upto[w][c]) return c;
  return TC_LARGE;
}

int moe_tc_split(const moe_expert_config *cfg) {
  /* Packed int4/int8 weights are dequantized on the fly, so a GEMM whose
   * blocks are one per SM at decode (few 64-row strips, long K: Mixtral's
   * down GEMM, 64 strips x 2 experts) is bound by each block's dependency
   * chain, not by memory; four K segments give it four times the blocks
   * (bench/RESULTS.md, sixth pass). Segments start at a scale group. */
  constexpr int SEGS = 4;
  const int64_t n = cfg->hidden_size, k = cfg->intermediate_size;
  const int64_t g = cfg->group_size == -1 ? k : cfg->group_size;
  if (cfg->scheme != MOE_SCHEME_WNA16 || cfg->has_bias || n / 64 > 64 || k < 8192 || (k / KB) % SEGS ||
      (k / SEGS) % g || n % 8)
    return 1;
  return SEGS;
}

bool moe_tc_bulk(moe_backend *b, const moe_expert_config *cfg, int config) {
#if defined(MOE_TC_SM90A)
  const char *off = getenv("MOE_GPU_TC_BULK"); /* 0: the generic kernel (tests compare the two) */
  return moe_gpu_cc_major(b) == 9 && tc_wkind(cfg) == TW_16 && (config == TC_LARGE || config == TC_TALL) &&
         !(off && !strcmp(off, "0"));
#else
  (void)b, (void)cfg, (void)config;
  return false;
#endif
}

moe_status moe_tc_fp8_act(moe_backend *b, int act, int max_tiles, const TcArgs &a, const void *x,
                          const float *static_scale, int exact, uint16_t *xq, int tokens, float *xs_tok,
                          moe_error *err) {
  /* a row's units over several blocks: with one block per tile a decode
   * tile's few rows left its warps looping over K / xg groups one after
   * another (Mixtral's a, 112 groups: 23 us of a 207 us call at T = 1), and
   * a per-token row of 14336 columns on one warp */
  const unsigned per_row = fp8_act_whole(a.xg) ? 8u : (unsigned)((a.k / a.xg + 7) / 8);
  const unsigned blocks =
      tokens ? (unsigned)((tokens + FP8_TOKEN_ROWS - 1) / FP8_TOKEN_ROWS) : (unsigned)max_tiles;
  /* 8-byte loads where every row is 8-byte aligned (K % 128 == 0) */
  const bool vec = ((uintptr_t)x & 7) == 0;
  moe_status s = moe_gpu_check(
      pdl_launch(moe_gpu_pdl(b), 1,
                 act == A_BF16 ? (vec ? fp8_act_kernel<A_BF16, true> : fp8_act_kernel<A_BF16, false>)
                               : (vec ? fp8_act_kernel<A_F16, true> : fp8_act_kernel<A_F16, false>),
                 dim3(blocks, per_row), dim3(256), 0, moe_gpu_stream(b), a, x, static_scale, exact, xq,
                 tokens, xs_tok),
      "fused_moe fp8 activations", err);
  if (s || !tokens) return s;
  return moe_gpu_check(pdl_launch(moe_gpu_pdl(b), 1, fp8_scale_slots, dim3((unsigned)max_tiles), dim3(256), 0,
                                  moe_gpu_stream(b), a, (const float *)xs_tok, tokens),
                       "fused_moe fp8 activation scales", err);
}

moe_status moe_tc_gather(moe_backend *b, int max_tiles, const TcArgs &a, uint16_t *xk, moe_error *err) {
  return moe_gpu_check(pdl_launch(moe_gpu_pdl(b), 1, gather_rows,
                                  dim3((unsigned)max_tiles, (unsigned)(a.k / KB)), dim3(256), 0,
                                  moe_gpu_stream(b), a, xk),
                       "fused_moe row gather", err);
}

extern "C" bool moe_gpu_fused_packs(moe_backend *b, const moe_expert_config *cfg) {
  if (moe_gpu_cc_major(b) < 8) return false;
  /* K of both GEMMs whole KB blocks (an odd count too: gpt-oss's 2880 is
   * 45; the main loop's last pair of stages may be one) */
  const int64_t h = cfg->hidden_size, in = cfg->intermediate_size, g = cfg->group_size;
  if (h % KB || in % KB) return false;
  if (cfg->scheme == MOE_SCHEME_MXFP4) return true; /* groups of 32 */
  /* fp8: e4m3 conversions (sm_89+; Hopper here: the major is what the
   * backend keeps); block scales of 128 columns along K (tc_gemm's FB) and
   * whole 16-row blocks (a warp's rows) along N */
  if (cfg->scheme == MOE_SCHEME_FP8)
    return moe_gpu_cc_major(b) >= 9 &&
           (cfg->weight_scale != MOE_WSCALE_BLOCK || (cfg->block_k == 2 * KB && cfg->block_n % 16 == 0));
  if (cfg->scheme != MOE_SCHEME_WNA16) return true;
  return g == -1 || g % KB == 0 || g == 16 || g == 32;
}

moe_status moe_tc_pack(moe_backend *b, const moe_expert_config *cfg, const moe_dtype scale_dt[2],
                       void *const src[MOE_EXPERT_TENSOR_COUNT], void *dst[MOE_EXPERT_TENSOR_COUNT],
                       moe_error *err) {
  hipStream_t st = moe_gpu_stream(b);
  const int e = (int)cfg->num_experts, h = (int)cfg->hidden_size, in = (int)cfg->intermediate_size;
  const int il = cfg->activation == MOE_ACT_SWIGLU_OAI, w = tc_wkind(cfg);
  for (int m = 0; m < 2; m++) {
    const bool w13 = m == 0;
    const int n = w13 ? 2 * in : h, k = w13 ? h : in;
    const int ws = w == TW_16 ? (w13 ? MOE_W13 : MOE_W2) : (w13 ? MOE_W13_QWEIGHT : MOE_W2_QWEIGHT);
    const unsigned nb = blocks_for((size_t)e * (n / 16) * (k / KB) * 32, b);
    const uint8_t *s = (const uint8_t *)src[ws];
    uint8_t *d = (uint8_t *)dst[ws];
    if (w == TW_16)
      pack_weights<TW_16><<<nb, 256, 0, st>>>(s, d, e, n, k, w13, in, il);
    else if (w == TW_INT4)
      pack_weights<TW_INT4><<<nb, 256, 0, st>>>(s, d, e, n, k, w13, in, il);
    else if (w == TW_FP4)
      pack_weights<TW_FP4><<<nb, 256, 0, st>>>(s, d, e, n, k, w13, in, il);
    else /* int8 and fp8 codes */
      pack_weights<TW_INT8><<<nb, 256, 0, st>>>(s, d, e, n, k, w13, in, il);
    if (grouped(w)) {
      const int ss = w13 ? MOE_W13_SCALES : MOE_W2_SCALES, zs = w13 ? MOE_W13_QZEROS : MOE_W2_QZEROS;
      const int groups = w == TW_FP4 ? k / 32 : cfg->group_size == -1 ? 1 : k / (int)cfg->group_size;
      pack_groups<<<blocks_for((size_t)e * groups * n, b), 256, 0, st>>>(
          src[ss], (int)scale_dt[m], cfg->has_zero_points ? (const uint8_t *)src[zs] : NULL, cfg->bits,
          dst[ss], w == TW_FP4, cfg->has_zero_points ? (uint8_t *)dst[zs] : NULL, e, n, groups, w13, in, il);
      if (w == TW_FP4)
        fp4_flags<<<blocks_for((size_t)e * (n / 16), b), 256, 0, st>>>((uint8_t *)dst[ss], e, n, groups);
    }
  }
  return moe_gpu_check(hipGetLastError(), "fused_moe weight packing", err);
}

moe_status moe_tc_gemm(moe_backend *b, const moe_expert_config *cfg, int act, int config, int max_tiles,
                       const TcArgs &a, moe_error *err) {
  if (a.cap) {
    if (a.bt == bulk::BT_TALL)
      return act == A_BF16 ? launch_bulk<A_BF16, bulk::BT_TALL>(b, max_tiles, a, err)
                           : launch_bulk<A_F16, bulk::BT_TALL>(b, max_tiles, a, err);
    return act == A_BF16 ? launch_bulk<A_BF16, bulk::BT_LARGE>(b, max_tiles, a, err)
                         : launch_bulk<A_F16, bulk::BT_LARGE>(b, max_tiles, a, err);
  }
  switch (tc_wkind(cfg)) {
  case TW_INT4: return launch_act<TW_INT4>(b, act, config, max_tiles, a, err);
  case TW_INT8: return launch_act<TW_INT8>(b, act, config, max_tiles, a, err);
  case TW_FP4: {
    TcArgs f = a; /* the flags follow the scales (moe_tc_packed_bytes) */
    f.fp4_fast = (const uint8_t *)a.scale + (size_t)cfg->num_experts * (size_t)a.groups * (size_t)a.n;
    return launch_act<TW_FP4>(b, act, config, max_tiles, f, err);
  }
  case TW_FP8: return launch_act<TW_FP8>(b, act, config, max_tiles, a, err);
  default: return launch_act<TW_16>(b, act, config, max_tiles, a, err);
  }
}

#else /* AMD: no tensor-core path yet (the portable GEMM serves every shape) */

int moe_tc_rows(int config) { return 8; }
int moe_tc_bulk_rows(int config) { return 8; }
int moe_tc_choose(moe_backend *b, const moe_expert_config *cfg, int64_t avg) { return TC_SMALL; }
extern "C" int moe_tc_untuned(moe_scheme scheme, int bits, int64_t avg) { return TC_SMALL; }
int moe_tc_split(const moe_expert_config *cfg) { return 1; }
bool moe_tc_bulk(moe_backend *b, const moe_expert_config *cfg, int config) { return false; }
moe_status moe_tc_gather(moe_backend *b, int max_tiles, const TcArgs &a, uint16_t *xk, moe_error *err) {
  return moe_fail(err, MOE_EUNSUPPORTED, "fused_moe: no tensor-core path on this GPU");
}
moe_status moe_tc_fp8_act(moe_backend *b, int act, int max_tiles, const TcArgs &a, const void *x,
                          const float *static_scale, int exact, uint16_t *xq, int tokens, float *xs_tok,
                          moe_error *err) {
  return moe_fail(err, MOE_EUNSUPPORTED, "fused_moe: no tensor-core path on this GPU");
}
extern "C" bool moe_gpu_fused_packs(moe_backend *b, const moe_expert_config *cfg) { return false; }
moe_status moe_tc_pack(moe_backend *b, const moe_expert_config *cfg, const moe_dtype scale_dt[2],
                       void *const src[MOE_EXPERT_TENSOR_COUNT], void *dst[MOE_EXPERT_TENSOR_COUNT],
                       moe_error *err) {
  return moe_fail(err, MOE_EUNSUPPORTED, "fused_moe: no tensor-core path on this GPU");
}
moe_status moe_tc_gemm(moe_backend *b, const moe_expert_config *cfg, int act, int config, int max_tiles,
                       const TcArgs &a, moe_error *err) {
  return moe_fail(err, MOE_EUNSUPPORTED, "fused_moe: no tensor-core path on this GPU");
}
#endif
