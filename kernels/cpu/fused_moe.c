/* fused_moe on the CPU (docs/numerics.md "fused_moe"). One pipeline for every
 * weight format (kernels/cpu/weight_format.h):
 *
 *   route (when router_logits are given)
 *   -> group the (token, k) pairs by expert (counting sort)
 *   -> per (expert, tile of I): dequantize a strip of W13, gate_up GEMM,
 *      activation                                       (phase 1)
 *   -> per (expert, tile of H): dequantize a strip of W2, down GEMM, times
 *      the routed weight                                 (phase 2)
 *   -> per token: the sum over its k experts in k order (phase 3).
 *
 * Summation order, fixed whatever the batch: each GEMM output is a dot
 * product over j kept in LANES partial sums (lane l takes j = l, l + LANES,
 * l + 2 LANES, ... in ascending order), then combined pairwise (lane l with
 * l + 8, then + 4, + 2, + 1). A token's dot products read only its own row
 * and the weights, and one code path serves 1 token or 1000 per expert: the
 * same bits alone or in any batch. The lanes are plain arrays, so vector
 * width (and the ISA clone picked) never changes a result. Experts with few
 * tokens in a chunk take the weight format's dot instead (with AVX-512: the
 * weights decoded in registers, kernels/cpu/weight_avx512.c), which keeps
 * these lanes, their order and this sum: the same bits either way.
 *
 * fp8 weights (docs/numerics.md "Weight scheme fp8") take the same path
 * with two parameters: each GEMM's K axis is cut into its scale blocks
 * (k_layout: one block of K for every other scheme), the GEMM input is
 * quantized to e4m3fn first (x in phase 0 or, with static scales, per
 * expert in phase 1; a between phases 1 and 2), and strip_gemm scales each
 * block's dot product (gemm_scales) and adds them in ascending order.
 * Expert biases (every scheme) are added to the GEMM sums before the
 * rounding of g, u and y. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "../ops/op.h"
#include "cpu.h"
#include "topk.h"
#include "weight_format.h"

#define LANES 16
#define MR 4     /* token rows per dot block */
#define NR 4     /* weight rows per dot block */
#define STRIP 32 /* weight rows one work item dequantizes: a multiple of NR, even */
#define HALF (STRIP / 2)
/* An expert with at most this many tokens in a chunk takes its dot products
 * straight from the stored weights (the format's dot: each weight decoded
 * into registers once per MR tokens) instead of through a dequantized strip
 * (decoded once, then stored and re-read per MR tokens). Both give the same
 * bits. 32: measured on one AVX-512 core, Qwen3 T=256 (16 tokens an expert)
 * 14-20% faster than with 8, Mixtral T=64 (16) 20-27%; at 64 tokens an
 * expert the strip was as fast or faster. */
#ifndef MOE_FUSED_DIRECT_TOKENS
#define MOE_FUSED_DIRECT_TOKENS 32
#endif
_Static_assert(LANES == MOE_WEIGHT_LANES && MR == MOE_WEIGHT_DOT_TOKENS && NR == MOE_WEIGHT_DOT_ROWS,
               "the formats' dot kernels use the pipeline's lanes and blocks");
/* Tokens are processed in chunks whose activation buffers stay near this
 * size; a token's result does not depend on the chunking (a build may set it
 * small to test that). */
#ifndef MOE_FUSED_CHUNK_BYTES
#define MOE_FUSED_CHUNK_BYTES ((size_t)64 << 20)
#endif

/* ---- the dot kernels ------------------------------------------------------------ */

/* Combines LANES partial sums in the fixed pairwise order (the formats'
 * vector dot, kernels/cpu/weight_avx512.c, combines its lanes the same way). */
MOE_CPU_INLINE float lanes_sum(const float *a) {
  float b[8], c[4];
  for (int l = 0; l < 8; l++)
    b[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; l++)
    c[l] = b[l] + b[l + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

/* out[m * NR + r] = x[m] . w[r] over kp columns (a multiple of LANES; the
 * padding is zero in both), for the NR rows of w (stride ldw) and MR token
 * rows (dot_rows4, sharing each weight load) or one (dot_rows1). Both do the
 * same element-wise lane arithmetic, written out per token row so that the
 * accumulators stay in registers; the lane loops vectorize without
 * reassociation, and each (token, output) gets identical bits from either. */
static MOE_CPU_HOT void dot_rows4(const float *const *x, const float *w, size_t ldw, int64_t kp, float *out) {
  float a0[NR][LANES] = {{0}}, a1[NR][LANES] = {{0}}, a2[NR][LANES] = {{0}}, a3[NR][LANES] = {{0}};
  for (int64_t j = 0; j < kp; j += LANES) {
    const float *x0 = x[0] + j, *x1 = x[1] + j, *x2 = x[2] + j, *x3 = x[3] + j;
    for (int r = 0; r < NR; r++) {
      const float *wr = w + (size_t)r * ldw + j;
      for (int l = 0; l < LANES; l++) {
        a0[r][l] += x0[l] * wr[l];
        a1[r][l] += x1[l] * wr[l];
        a2[r][l] += x2[l] * wr[l];
        a3[r][l] += x3[l] * wr[l];
      }
    }
  }
  for (int r = 0; r < NR; r++) {
    out[0 * NR + r] = lanes_sum(a0[r]);
    out[1 * NR + r] = lanes_sum(a1[r]);
    out[2 * NR + r] = lanes_sum(a2[r]);
    out[3 * NR + r] = lanes_sum(a3[r]);
  }
}

static MOE_CPU_HOT void dot_rows1(const float *const *x, const float *w, size_t ldw, int64_t kp, float *out) {
  float a0[NR][LANES] = {{0}};
  for (int64_t j = 0; j < kp; j += LANES) {
    const float *x0 = x[0] + j;
    for (int r = 0; r < NR; r++) {
      const float *wr = w + (size_t)r * ldw + j;
      for (int l = 0; l < LANES; l++)
        a0[r][l] += x0[l] * wr[l];
    }
  }
  for (int r = 0; r < NR; r++)
    out[r] = lanes_sum(a0[r]);
}

/* A GEMM's K axis as rows are laid out for the dot kernels: `blocks`
 * blocks of `len` columns, each zero-padded to `pad` (a multiple of LANES),
 * `stride` = blocks * pad floats a row. One block of K columns except for
 * fp8 weights with block scales (BK columns each). */
typedef struct k_layout {
  int64_t blocks, len, pad, stride;
} k_layout;

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

static k_layout k_layout_of(const moe_weight_matrix *w) {
  k_layout l = {w->cols / w->kblock, w->kblock, round_up(w->kblock, LANES), 0};
  l.stride = l.blocks * l.pad;
  return l;
}

/* Where column j of a row sits. */
static inline int64_t k_pos(const k_layout *l, int64_t j) {
  return l->blocks == 1 ? j : (j / l->len) * l->pad + j % l->len;
}

/* fp8: the scales of one strip GEMM, one per K block of each token row
 * (activations) and each strip row (weights; one when not blockwise). */
typedef struct gemm_scales {
  const float *sx[MR];
  const float *sw[STRIP];
  bool blockwise; /* acc = SUM_b p_b * (sx_b * sw_b); else acc = (p * sx) * sw */
} gemm_scales;

/* A work item's STRIP weight rows: dequantized into `strip` (row stride
 * ld), or, when `direct` is set, read by the format's dot straight from
 * rows[] of expert e of *w (no scales, one K block). */
typedef struct strip_src {
  const float *strip;
  size_t ld;
  bool direct;
  const moe_weight_matrix *w;
  int64_t e;
  int64_t rows[STRIP];
  moe_x_range xr; /* direct: the range of the token rows of the call (weight_format.h) */
} strip_src;

/* tile[m * STRIP + n] = x[m] . strip[n] for every strip row n; with
 * scales, the scaled block sums of docs/numerics.md "Weight scheme fp8". */
static void strip_gemm(int mr, const float *const *x, const strip_src *src, const k_layout *l,
                       const gemm_scales *sc, float *tile) {
  float out[MR * NR] = {0};
  const size_t ld = src->ld;
  for (int n0 = 0; n0 < STRIP; n0 += NR) {
    const float *w = src->strip + (size_t)n0 * ld;
    if (!sc) {
      if (src->direct) {
        src->w->fmt->dot(src->w, src->e, src->rows + n0, mr, x, src->xr, l->stride, out);
      } else {
        (mr == MR ? dot_rows4 : dot_rows1)(x, w, ld, l->stride, out);
      }
      for (int m = 0; m < mr; m++)
        for (int r = 0; r < NR; r++)
          tile[m * STRIP + n0 + r] = out[m * NR + r];
      continue;
    }
    float acc[MR * NR] = {0};
    for (int64_t b = 0; b < l->blocks; b++) {
      const size_t off = (size_t)(b * l->pad);
      const float *xb[MR];
      for (int m = 0; m < mr; m++)
        xb[m] = x[m] + off;
      (mr == MR ? dot_rows4 : dot_rows1)(xb, w + off, ld, l->pad, out);
      for (int m = 0; m < mr; m++)
        for (int r = 0; r < NR; r++) {
          const float p = out[m * NR + r], sx = sc->sx[m][b], sw = sc->sw[n0 + r][b];
          acc[m * NR + r] = sc->blockwise ? acc[m * NR + r] + p * (sx * sw) : (p * sx) * sw;
        }
    }
    for (int m = 0; m < mr; m++)
      for (int r = 0; r < NR; r++)
        tile[m * STRIP + n0 + r] = acc[m * NR + r];
  }
}

/* ---- the pipeline's state ------------------------------------------------------- */

typedef struct work_item {
  int64_t expert; /* local index */
  int64_t n0;     /* first intermediate unit (phase 1) or hidden unit (phase 2) */
} work_item;

typedef struct fused_ctx {
  moe_weight_matrix w13, w2;
  moe_activation activation;
  moe_dtype act;
  int64_t hidden, inter;
  k_layout kx, ka; /* the K axes of the gate_up GEMM (x: H) and the down GEMM (a: I) */
  int64_t top_k, local_experts, expert_offset;
  const moe_tensor *x; /* hidden_states [T, H] */
  moe_tensor *out;     /* output [T, H] */
  const int32_t *ids;  /* [T, k], global expert ids */
  const float *weights;
  /* the chunk being processed: tokens [t0, t0 + tokens) */
  int64_t t0, tokens;
  float *xf;          /* [tokens, kx.stride]: hidden_states in fp32 (fp8: their codes' values unless
                         static scales), zero-padded */
  float *xs;          /* fp8, dynamic: [tokens, kx.blocks] the scales of xf */
  int32_t *expert_of; /* [tokens * k]: local expert of each slot, -1 when not here */
  int32_t *order;     /* [tokens * k]: slots grouped by expert */
  int64_t *start;     /* [local_experts + 1]: each expert's range in order[] */
  int64_t *cursor;    /* [local_experts] */
  float *a;           /* [tokens * k, ka.stride]: activations, rows in order[] order (fp8: quantized
                         between phases 1 and 2) */
  float *as;          /* fp8: [tokens * k, ka.blocks] the scales of a */
  float *y;           /* [tokens * k, hidden]: act(routed expert output), rows by slot */
  moe_x_range *xr;    /* direct13: [tokens] the range of each row of xf */
  moe_x_range *ar;    /* direct2: [tokens * k] the range of each row of a */
  float *xo,
      *ao; /* direct13 / direct2 with a dot_x_ordered format: xf's / a's rows in its order; else NULL */
  work_item *items1, *items2;
  int64_t n_items1, n_items2;
  moe_weight_dequant_fn *dequant13, *dequant2; /* the strips' dequantization */
  bool direct13, direct2;                      /* whether the formats' dot serves experts with few tokens */
  const moe_call *call;                        /* its stop check (moe_call_set_stop) */
  _Atomic bool stopped;                        /* set by the first thread whose check said stop */
} fused_ctx;

/* Whether the rest of the work is to be skipped: asked before each item. */
static bool stop_now(fused_ctx *f) {
  if (atomic_load_explicit(&f->stopped, memory_order_relaxed)) return true;
  if (!f->call->stop || !f->call->stop(f->call->stop_ctx)) return false;
  atomic_store(&f->stopped, true);
  return true;
}

/* ---- phase 1: gate_up GEMM and activation --------------------------------------- */

static inline float act_round(float v, moe_dtype act) { return moe_round_to(v, act); }

/* a = act(act(f(g)) * u), or swiglu_oai; g and u already act-rounded. */
static inline float activate(moe_activation fn, float g, float u, moe_dtype act) {
  switch (fn) {
  case MOE_ACT_GELU: /* exact (erf) form */
    return act_round(act_round(0.5f * g * (1.0f + erff(g * 0.70710678118654752f)), act) * u, act);
  case MOE_ACT_SWIGLU_OAI: /* comparisons written so that NaN passes through */
    g = g > 7.0f ? 7.0f : g;
    u = u > 7.0f ? 7.0f : (u < -7.0f ? -7.0f : u);
    return act_round((u + 1.0f) * g * (1.0f / (1.0f + expf(-(1.702f * g)))), act);
  default: /* silu */ return act_round(act_round(g / (1.0f + expf(-g)), act) * u, act);
  }
}

/* Zeroes what the dot kernels read beyond the dequantized values: padding
 * columns of the rows in use and whole rows that are not. */
static void strip_pad(float *strip, const k_layout *l, const bool *used) {
  const size_t ld = (size_t)l->stride;
  for (int r = 0; r < STRIP; r++) {
    float *row = strip + (size_t)r * ld;
    if (!used[r]) {
      memset(row, 0, ld * sizeof(float));
      continue;
    }
    for (int64_t b = 0; b < l->blocks; b++)
      memset(row + b * l->pad + l->len, 0, (size_t)(l->pad - l->len) * sizeof(float));
  }
}

/* Weight rows [n0, n0 + nrows) of expert e into strip rows from dst, block
 * by block of the K layout. */
static void dequant_rows(moe_weight_dequant_fn *dequant, const moe_weight_matrix *w, const k_layout *l,
                         int64_t e, int64_t n0, int64_t nrows, float *dst) {
  for (int64_t b = 0; b < l->blocks; b++)
    dequant(w, e, n0, nrows, b * l->len, l->len, dst + b * l->pad, (size_t)l->stride);
}

/* The W13 row of strip row r of an item at i0 with ni units (any valid
 * row for strip rows not in use). */
static int64_t gate_up_row(const fused_ctx *f, int64_t i0, int64_t ni, int r) {
  if (f->activation == MOE_ACT_SWIGLU_OAI) return r < 2 * ni ? 2 * i0 + r : 2 * i0;
  if (r < HALF) return r < ni ? i0 + r : i0;
  return r - HALF < ni ? f->inter + i0 + (r - HALF) : i0;
}

static void gate_up_item(const fused_ctx *f, const work_item *it, float *strip, float *tile, float *xq) {
  const moe_weight_matrix *w = &f->w13;
  const int64_t i0 = it->n0, ni = f->inter - i0 < HALF ? f->inter - i0 : HALF, e = it->expert;
  const bool interleaved = f->activation == MOE_ACT_SWIGLU_OAI; /* gate at even rows of W13 */
  const k_layout *l = &f->kx;
  const size_t ld = (size_t)l->stride;
  const int64_t begin = f->start[e], end = f->start[e + 1];
  strip_src src = {.strip = strip, .ld = ld, .w = w, .e = e};
  src.direct = f->direct13 && end - begin <= MOE_FUSED_DIRECT_TOKENS;
  if (src.direct) {
    for (int r = 0; r < STRIP; r++)
      src.rows[r] = gate_up_row(f, i0, ni, r);
  } else {
    bool used[STRIP] = {false};
    if (interleaved) {
      dequant_rows(f->dequant13, w, l, e, 2 * i0, 2 * ni, strip);
      for (int64_t r = 0; r < 2 * ni; r++)
        used[r] = true;
    } else { /* gate rows to strip rows [0, HALF), up rows to [HALF, STRIP) */
      dequant_rows(f->dequant13, w, l, e, i0, ni, strip);
      dequant_rows(f->dequant13, w, l, e, f->inter + i0, ni, strip + HALF * ld);
      for (int64_t r = 0; r < ni; r++)
        used[r] = used[HALF + r] = true;
    }
    strip_pad(strip, l, used);
  }
  gemm_scales sc = {.blockwise = w->blockwise};
  if (w->scaled)
    for (int r = 0; r < STRIP; r++)
      sc.sw[r] = moe_weight_row_scales(w, e, gate_up_row(f, i0, ni, r));
  for (int64_t p = begin; p < end;) {
    /* the dot kernels take MR token rows or one; the formats' dot any count up to MR */
    const int mr = end - p >= MR ? MR : src.direct ? (int)(end - p) : 1;
    const float *x[MR];
    src.xr = MOE_X_RANGE_EMPTY; /* joined with each row's below */
    for (int m = 0; m < mr; m++) {
      const int64_t tl = f->order[p + m] / f->top_k;
      x[m] = (src.direct && f->xo ? f->xo : f->xf) + (size_t)tl * ld;
      if (src.direct) src.xr = moe_x_range_join(src.xr, f->xr[tl]);
      if (!w->scaled) continue;
      if (w->act_scales) { /* static: the expert's scale (one block: per_tensor) */
        float *q = xq + (size_t)m * ld;
        memcpy(q, x[m], ld * sizeof(float));
        moe_cpu_fp8_quant_group(q, (size_t)f->hidden, w->act_scales[e], w->exact_division);
        x[m] = q;
        sc.sx[m] = &w->act_scales[e];
      } else {
        sc.sx[m] = f->xs + (size_t)tl * (size_t)l->blocks;
      }
    }
    strip_gemm(mr, x, &src, l, w->scaled ? &sc : NULL, tile);
    for (int m = 0; m < mr; m++) {
      const float *t = tile + m * STRIP;
      float *a = f->a + (size_t)(p + m) * (size_t)f->ka.stride;
      for (int64_t i = 0; i < ni; i++) {
        const int cg = interleaved ? (int)(2 * i) : (int)i,
                  cu = interleaved ? (int)(2 * i + 1) : HALF + (int)i;
        float sg = t[cg], su = t[cu];
        if (w->bias) { /* the bias follows its weight row */
          sg += moe_weight_bias(w, e, gate_up_row(f, i0, ni, cg));
          su += moe_weight_bias(w, e, gate_up_row(f, i0, ni, cu));
        }
        a[k_pos(&f->ka, i0 + i)] =
            activate(f->activation, act_round(sg, f->act), act_round(su, f->act), f->act);
      }
      if (i0 + ni == f->inter && f->ka.blocks == 1) /* the down GEMM reads the padding */
        memset(a + f->inter, 0, (size_t)(f->ka.stride - f->inter) * sizeof(float));
    }
    p += mr;
  }
}

/* fp8: row p of a to e4m3fn codes' values, one scale per K block (the
 * expert's static a2_scale, or dynamic per block); block padding zeroed. */
static void quantize_a(const fused_ctx *f, int64_t p) {
  const moe_weight_matrix *w = &f->w2;
  const k_layout *l = &f->ka;
  float *row = f->a + (size_t)p * (size_t)l->stride, *s = f->as + (size_t)p * (size_t)l->blocks;
  const int64_t e = f->expert_of[f->order[p]];
  const float st = w->act_scales ? w->act_scales[e] : 0.0f;
  for (int64_t b = 0; b < l->blocks; b++) {
    float *blk = row + b * l->pad;
    s[b] = moe_cpu_fp8_quant_group(blk, (size_t)l->len, st, w->exact_division);
    memset(blk + l->len, 0, (size_t)(l->pad - l->len) * sizeof(float));
  }
}

/* ---- phase 2: down GEMM times the routed weight ------------------------------------ */

static void down_item(const fused_ctx *f, const work_item *it, float *strip, float *tile) {
  const moe_weight_matrix *w = &f->w2;
  const int64_t h0 = it->n0, nh = f->hidden - h0 < STRIP ? f->hidden - h0 : STRIP, e = it->expert;
  const k_layout *l = &f->ka;
  const size_t ld = (size_t)l->stride;
  const int64_t begin = f->start[e], end = f->start[e + 1];
  strip_src src = {.strip = strip, .ld = ld, .w = w, .e = e};
  src.direct = f->direct2 && end - begin <= MOE_FUSED_DIRECT_TOKENS;
  if (src.direct) {
    for (int r = 0; r < STRIP; r++)
      src.rows[r] = h0 + (r < nh ? r : 0);
  } else {
    bool used[STRIP] = {false};
    dequant_rows(f->dequant2, w, l, e, h0, nh, strip);
    for (int64_t r = 0; r < nh; r++)
      used[r] = true;
    strip_pad(strip, l, used);
  }
  gemm_scales sc = {.blockwise = w->blockwise};
  if (w->scaled)
    for (int r = 0; r < STRIP; r++)
      sc.sw[r] = moe_weight_row_scales(w, e, h0 + (r < nh ? r : 0));
  for (int64_t p = begin; p < end;) {
    /* the dot kernels take MR token rows or one; the formats' dot any count up to MR */
    const int mr = end - p >= MR ? MR : src.direct ? (int)(end - p) : 1;
    const float *x[MR];
    src.xr = MOE_X_RANGE_EMPTY; /* joined with each row's below */
    for (int m = 0; m < mr; m++) {
      x[m] = (src.direct && f->ao ? f->ao : f->a) + (size_t)(p + m) * ld;
      sc.sx[m] = f->as + (size_t)(p + m) * (size_t)l->blocks;
      if (src.direct) src.xr = moe_x_range_join(src.xr, f->ar[p + m]);
    }
    strip_gemm(mr, x, &src, l, w->scaled ? &sc : NULL, tile);
    for (int m = 0; m < mr; m++) {
      const int64_t slot = f->order[p + m];
      const float rw = f->weights[f->t0 * f->top_k + slot];
      float *y = f->y + (size_t)slot * (size_t)f->hidden + h0;
      for (int64_t r = 0; r < nh; r++) {
        float v = tile[m * STRIP + r];
        if (w->bias) v += moe_weight_bias(w, e, h0 + r); /* before the routed weight */
        y[r] = act_round(v * rw, f->act);
      }
    }
    p += mr;
  }
}

/* ---- phase 0 and 3: conversion in, the sum over k out ------------------------------ */

/* Row tl of xf: hidden_states in fp32 in the K layout; fp8 with dynamic
 * scales: quantized per block (quant.per_token_group with G = BK, or
 * quant.per_token over one block of H). */
static void convert_token(const fused_ctx *f, int64_t tl) {
  const k_layout *l = &f->kx;
  float *row = f->xf + (size_t)tl * (size_t)l->stride;
  const size_t base = (size_t)(f->t0 + tl) * (size_t)f->hidden;
  for (int64_t b = 0; b < l->blocks; b++) {
    float *blk = row + b * l->pad;
    for (int64_t j = 0; j < l->len; j++)
      blk[j] = moe_load_float(f->x->data, f->act, base + (size_t)(b * l->len + j));
    memset(blk + l->len, 0, (size_t)(l->pad - l->len) * sizeof(float));
    if (f->w13.scaled && !f->w13.act_scales)
      f->xs[tl * l->blocks + b] = moe_cpu_fp8_quant_group(blk, (size_t)l->len, 0.0f, f->w13.exact_division);
  }
  if (f->direct13) f->xr[tl] = moe_weight_x_range(row, l->stride, f->act);
  if (f->xo) moe_weight_order_x(f->xo + (size_t)tl * (size_t)l->stride, row, l->stride);
}

/* out = act(sum over k of y_k) in fp32, k in the order given; experts held
 * elsewhere contribute nothing. */
static void sum_token(const fused_ctx *f, int64_t tl, float *acc) {
  const int64_t h = f->hidden;
  memset(acc, 0, (size_t)h * sizeof(float));
  for (int64_t kk = 0; kk < f->top_k; kk++) {
    const int64_t slot = tl * f->top_k + kk;
    if (f->expert_of[slot] < 0) continue;
    const float *y = f->y + (size_t)slot * (size_t)h;
    for (int64_t j = 0; j < h; j++)
      acc[j] += y[j];
  }
  const size_t base = (size_t)(f->t0 + tl) * (size_t)h;
  for (int64_t j = 0; j < h; j++)
    moe_store_float(f->out->data, f->act, base + (size_t)j, acc[j]);
}

/* Counting sort of the chunk's slots by local expert, and the work lists. */
static void group_by_expert(fused_ctx *f) {
  const int64_t slots = f->tokens * f->top_k, ne = f->local_experts;
  memset(f->start, 0, (size_t)(ne + 1) * sizeof(int64_t));
  for (int64_t s = 0; s < slots; s++) {
    const int64_t le = (int64_t)f->ids[f->t0 * f->top_k + s] - f->expert_offset;
    f->expert_of[s] = le >= 0 && le < ne ? (int32_t)le : -1;
    if (f->expert_of[s] >= 0) f->start[le + 1]++;
  }
  for (int64_t e = 0; e < ne; e++)
    f->start[e + 1] += f->start[e];
  memcpy(f->cursor, f->start, (size_t)ne * sizeof(int64_t));
  for (int64_t s = 0; s < slots; s++)
    if (f->expert_of[s] >= 0) f->order[f->cursor[f->expert_of[s]]++] = (int32_t)s;
  f->n_items1 = f->n_items2 = 0;
  for (int64_t e = 0; e < ne; e++) {
    if (f->start[e + 1] == f->start[e]) continue;
    for (int64_t i0 = 0; i0 < f->inter; i0 += HALF)
      f->items1[f->n_items1++] = (work_item){e, i0};
    for (int64_t h0 = 0; h0 < f->hidden; h0 += STRIP)
      f->items2[f->n_items2++] = (work_item){e, h0};
  }
}

/* ---- workspace -------------------------------------------------------------------- */

/* Offsets into one workspace, 64-byte aligned, overflow-checked. */
typedef struct ws_plan {
  size_t size;
  bool overflow;
} ws_plan;

static size_t ws_take(ws_plan *p, size_t count, size_t elem) {
  size_t bytes, off = p->size;
  if (!moe_mul_size(count, elem, &bytes) || !moe_add_size(bytes, 63, &bytes) ||
      !moe_add_size(p->size, bytes & ~(size_t)63, &p->size))
    p->overflow = true;
  return off;
}

/* A part of the workspace (offsets from ws_take keep it 64-byte aligned). */
static inline void *ws_at(void *base, size_t off) { return (char *)base + off; }

static inline int thread_id(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/* Input slots, in the order of kernels/ops/fused_moe.c's descriptors. */

moe_status moe_cpu_fused_moe(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_fused_args *args = &c->args.fused;
  const moe_expert_config *cfg = &args->set->cfg;
  fused_ctx f = {
      .activation = cfg->activation,
      .act = args->act,
      .hidden = cfg->hidden_size,
      .inter = cfg->intermediate_size,
      .top_k = args->top_k,
      .local_experts = cfg->num_experts,
      .expert_offset = cfg->expert_offset,
      .x = moe_call_in(c, MOE_FUSED_IN_HIDDEN),
      .out = &c->out[0].tensor,
      .call = c,
  };
  const int64_t tokens = args->tokens, k = args->top_k;
  if (tokens == 0) return MOE_OK;
  moe_weight_matrix_init(args->set, MOE_W13, f.act, &f.w13);
  moe_weight_matrix_init(args->set, MOE_W2, f.act, &f.w2);
  f.kx = k_layout_of(&f.w13);
  f.ka = k_layout_of(&f.w2);
  const bool vector = moe_cpu_vector_kernels();
  f.dequant13 = vector && f.w13.fmt->dequant_fast ? f.w13.fmt->dequant_fast : f.w13.fmt->dequant;
  f.dequant2 = vector && f.w2.fmt->dequant_fast ? f.w2.fmt->dequant_fast : f.w2.fmt->dequant;
  f.direct13 = vector && f.w13.fmt->dot && moe_weight_vector_ok(&f.w13) && f.kx.blocks == 1;
  f.direct2 = vector && f.w2.fmt->dot && moe_weight_vector_ok(&f.w2) && f.ka.blocks == 1;
  const bool order13 = f.direct13 && f.w13.fmt->dot_x_ordered, order2 = f.direct2 && f.w2.fmt->dot_x_ordered;

  /* chunk: tokens whose activation buffers fit MOE_FUSED_CHUNK_BYTES (at least one) */
  size_t per_slot, per_token;
  if (!moe_add_size((size_t)(f.ka.stride * (order2 ? 2 : 1) + f.ka.blocks), (size_t)f.hidden, &per_slot) ||
      !moe_mul_size(per_slot, 4, &per_slot) || !moe_add_size(per_slot, 16, &per_slot) ||
      !moe_mul_size(per_slot, (size_t)k, &per_token) ||
      !moe_add_size(per_token, (size_t)(f.kx.stride * (order13 ? 2 : 1) + f.kx.blocks) * 4, &per_token))
    return moe_fail(err, MOE_EOVERFLOW, "fused_moe: workspace size overflows");
  int64_t chunk = (int64_t)(MOE_FUSED_CHUNK_BYTES / per_token);
  if (chunk < 1) chunk = 1;
  if (chunk > tokens) chunk = tokens;

  int threads = moe_cpu_threads(b);
  const int64_t kp_max = f.kx.stride > f.ka.stride ? f.kx.stride : f.ka.stride;
  const size_t chunk_slots = (size_t)chunk * (size_t)k, ne = (size_t)f.local_experts;
  const size_t route_scratch =
      args->route ? (moe_cpu_route_scratch_bytes(cfg->global_num_experts) + 63) & ~(size_t)63 : 0;
  ws_plan thread_plan = {0}; /* each thread's part */
  const size_t o_strip =
      ws_take(&thread_plan, (size_t)STRIP * (size_t)kp_max, sizeof(float)); /* also phase 3's row */
  const size_t o_tile = ws_take(&thread_plan, MR * STRIP, sizeof(float));
  const size_t o_route = ws_take(&thread_plan, 1, route_scratch);
  const size_t o_xq = /* fp8 with static scales: the token rows quantized per expert */
      ws_take(&thread_plan, f.w13.act_scales ? (size_t)MR * (size_t)f.kx.stride : 0, sizeof(float));
  const size_t per_thread = thread_plan.size;

  ws_plan p = {0};
  const size_t o_ids = ws_take(&p, args->route ? (size_t)tokens * (size_t)k : 0, sizeof(int32_t));
  const size_t o_w = ws_take(&p, args->route ? (size_t)tokens * (size_t)k : 0, sizeof(float));
  const size_t o_xf = ws_take(&p, (size_t)chunk * (size_t)f.kx.stride, sizeof(float));
  const size_t o_xs = ws_take(&p, f.w13.scaled ? (size_t)chunk * (size_t)f.kx.blocks : 0, sizeof(float));
  const size_t o_as = ws_take(&p, f.w2.scaled ? chunk_slots * (size_t)f.ka.blocks : 0, sizeof(float));
  const size_t o_expert_of = ws_take(&p, chunk_slots, sizeof(int32_t));
  const size_t o_order = ws_take(&p, chunk_slots, sizeof(int32_t));
  const size_t o_start = ws_take(&p, ne + 1, sizeof(int64_t));
  const size_t o_cursor = ws_take(&p, ne, sizeof(int64_t));
  const size_t o_a = ws_take(&p, chunk_slots * (size_t)f.ka.stride, sizeof(float));
  const size_t o_y = ws_take(&p, chunk_slots * (size_t)f.hidden, sizeof(float));
  const size_t o_xr = ws_take(&p, (size_t)chunk, sizeof(moe_x_range));
  const size_t o_ar = ws_take(&p, chunk_slots, sizeof(moe_x_range));
  const size_t o_xo = ws_take(&p, order13 ? (size_t)chunk * (size_t)f.kx.stride : 0, sizeof(float));
  const size_t o_ao = ws_take(&p, order2 ? chunk_slots * (size_t)f.ka.stride : 0, sizeof(float));
  const size_t o_items1 = ws_take(&p, ne * (size_t)((f.inter + HALF - 1) / HALF), sizeof(work_item));
  const size_t o_items2 = ws_take(&p, ne * (size_t)((f.hidden + STRIP - 1) / STRIP), sizeof(work_item));
  const size_t o_threads = ws_take(&p, (size_t)threads, per_thread);
  if (p.overflow || thread_plan.overflow)
    return moe_fail(err, MOE_EOVERFLOW, "fused_moe: workspace size overflows");
  unsigned char *ws = moe_cpu_workspace(b, p.size);
  if (!ws) return moe_fail(err, MOE_ENOMEM, "fused_moe: out of memory for %zu bytes of workspace", p.size);
  f.xf = ws_at(ws, o_xf);
  f.xs = ws_at(ws, o_xs);
  f.as = ws_at(ws, o_as);
  f.expert_of = ws_at(ws, o_expert_of);
  f.order = ws_at(ws, o_order);
  f.start = ws_at(ws, o_start);
  f.cursor = ws_at(ws, o_cursor);
  f.a = ws_at(ws, o_a);
  f.y = ws_at(ws, o_y);
  f.xr = ws_at(ws, o_xr);
  f.ar = ws_at(ws, o_ar);
  f.xo = order13 ? ws_at(ws, o_xo) : NULL;
  f.ao = order2 ? ws_at(ws, o_ao) : NULL;
  f.items1 = ws_at(ws, o_items1);
  f.items2 = ws_at(ws, o_items2);
  unsigned char *thread_ws = ws + o_threads;

  if (args->route) { /* router_logits: each token routed on its own */
    const moe_tensor *logits = moe_call_in(c, MOE_FUSED_IN_LOGITS);
    const moe_tensor *bias = &args->set->t[MOE_CORRECTION_BIAS];
    int32_t *ids = ws_at(ws, o_ids);
    float *w = ws_at(ws, o_w);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tokens > 1)
    for (int64_t t = 0; t < tokens; t++)
      moe_cpu_route_row(&args->routing, logits, t, bias->data,
                        thread_ws + (size_t)thread_id() * per_thread + o_route, ids + t * k, w + t * k);
    f.ids = ids;
    f.weights = w;
  } else {
    f.ids = moe_call_in(c, MOE_FUSED_IN_IDS)->data;
    f.weights = moe_call_in(c, MOE_FUSED_IN_TOPK_WEIGHTS)->data;
  }

  for (f.t0 = 0; f.t0 < tokens; f.t0 += chunk) {
    f.tokens = tokens - f.t0 < chunk ? tokens - f.t0 : chunk;
    group_by_expert(&f);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      unsigned char *mine = thread_ws + (size_t)thread_id() * per_thread;
      float *strip = ws_at(mine, o_strip), *tile = ws_at(mine, o_tile), *xq = ws_at(mine, o_xq);
#pragma omp for schedule(static)
      for (int64_t tl = 0; tl < f.tokens; tl++)
        convert_token(&f, tl);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < f.n_items1; i++)
        if (!stop_now(&f)) gate_up_item(&f, &f.items1[i], strip, tile, xq);
      if (f.w2.scaled) {
#pragma omp for schedule(static)
        for (int64_t q = 0; q < f.start[f.local_experts]; q++)
          quantize_a(&f, q);
      }
      if (f.direct2) { /* rows of a are complete only now */
#pragma omp for schedule(static)
        for (int64_t q = 0; q < f.start[f.local_experts]; q++) {
          const float *row = f.a + (size_t)q * (size_t)f.ka.stride;
          f.ar[q] = moe_weight_x_range(row, f.inter, f.act);
          if (f.ao) moe_weight_order_x(f.ao + (size_t)q * (size_t)f.ka.stride, row, f.ka.stride);
        }
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < f.n_items2; i++)
        if (!stop_now(&f)) down_item(&f, &f.items2[i], strip, tile);
#pragma omp for schedule(static)
      for (int64_t tl = 0; tl < f.tokens; tl++)
        sum_token(&f, tl, strip);
    }
    if (atomic_load(&f.stopped)) return moe_fail(err, MOE_ECANCELLED, "fused_moe: stopped by its caller");
  }
  return MOE_OK;
}
