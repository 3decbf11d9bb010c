/* The weight formats of fused_moe on the CPU (docs/numerics.md "fused_moe",
 * weights): bf16/fp16 values; wna16 int4/int8 codes with per-group scales
 * and optional zero points, w = act((q - z) * scale); mxfp4 e2m1 codes with
 * e8m0 scales per 32, w = act(value * 2^(b - 127)); fp8 e4m3fn codes, whose
 * exact values the GEMM scales (weight_format.h). */
#include <string.h>

#include "../ops/op.h"
#include "weight_format.h"

/* Set data may sit at any byte offset (safetensors offsets are not aligned). */
MOE_CPU_INLINE uint16_t load_u16(const uint8_t *p) {
  uint16_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* ---- token rows: what the formats' dot may fuse -------------------------------- */

moe_x_range moe_weight_x_range(const float *x, int64_t n, moe_dtype act) {
  moe_x_range r = MOE_X_RANGE_EMPTY; /* widened by each nonzero value */
  for (int64_t j = 0; j < n; j++) {
    const uint32_t u = moe_f32_bits(x[j]), a = u & 0x7FFFFFFFu;
    if (a == 0) continue;
    if (a >= 0x7F800000u || moe_f32_bits(moe_round_to(x[j], act)) != u) return (moe_x_range){false, 0, 0};
    const int be = (int)(a >> 23); /* fp32 subnormals: [2^-149, 2^-126) */
    const int lo = be ? be - 127 : -149, hi = be ? be - 126 : -126;
    r.lo = lo < r.lo ? lo : r.lo;
    r.hi = hi > r.hi ? hi : r.hi;
  }
  return r;
}

/* ---- bf16 / fp16: the weights are already in the activation dtype ---------- */

/* Widening only; `fp16` is a constant after inlining (the bf16 loop
 * vectorizes, the codec's fp16 widening has branches and stays scalar). */
MOE_CPU_INLINE void dequant_dense(const moe_weight_matrix *m, bool fp16, int64_t e, int64_t n0, int64_t nrows,
                                  int64_t k0, int64_t ncols, float *dst, size_t ld) {
  for (int64_t r = 0; r < nrows; r++) {
    const uint8_t *src = moe_weight_row(m, e, n0 + r) + (size_t)k0 * 2;
    float *d = dst + (size_t)r * ld;
    for (int64_t j = 0; j < ncols; j++)
      d[j] = fp16 ? moe_f16_to_f32(load_u16(src + 2 * j)) : moe_bf16_to_f32(load_u16(src + 2 * j));
  }
}

static MOE_CPU_HOT void dequant_bf16(const moe_weight_matrix *m, int64_t e, int64_t n0, int64_t nrows,
                                     int64_t k0, int64_t ncols, float *dst, size_t ld) {
  dequant_dense(m, false, e, n0, nrows, k0, ncols, dst, ld);
}

static MOE_CPU_HOT void dequant_fp16(const moe_weight_matrix *m, int64_t e, int64_t n0, int64_t nrows,
                                     int64_t k0, int64_t ncols, float *dst, size_t ld) {
  dequant_dense(m, true, e, n0, nrows, k0, ncols, dst, ld);
}

/* ---- wna16 ------------------------------------------------------------------- */

/* act() in place. The bf16 rounding is branch-free and vectorizes; the fp16
 * one (subnormal and overflow paths) stays scalar. */
MOE_CPU_INLINE void round_to_act(float *v, int64_t n, moe_dtype act) {
  if (act == MOE_BF16)
    for (int64_t j = 0; j < n; j++)
      v[j] = moe_bf16_to_f32(moe_f32_to_bf16(v[j]));
  else
    for (int64_t j = 0; j < n; j++)
      v[j] = moe_round_to(v[j], act);
}

/* One code of a row: int4 packed along the row (low nibble = even column). */
MOE_CPU_INLINE float code_at(const uint8_t *q, int bits, int64_t j) {
  if (bits == 4) return (float)((q[j >> 1] >> ((j & 1) << 2)) & 15);
  return (float)q[j];
}

/* The two wna16 formats differ only in `bits`, a constant after inlining, so
 * each gets its own straight loops. With bf16 activations the rounding
 * vectorizes and runs over the row; with fp16 an int4 group's 16 possible
 * values are rounded once into a table instead (int8 has 256: rounded each). */
MOE_CPU_INLINE void dequant_wna16(const moe_weight_matrix *m, int bits, int64_t e, int64_t n0, int64_t nrows,
                                  int64_t k0, int64_t ncols, float *dst, size_t ld) {
  const bool table = bits == 4 && m->act != MOE_BF16;
  for (int64_t r = 0; r < nrows; r++) {
    const int64_t n = n0 + r;
    const uint8_t *q = moe_weight_row(m, e, n);
    const size_t scale_row = ((size_t)e * (size_t)m->rows + (size_t)n) * (size_t)m->groups;
    float *d = dst + (size_t)r * ld - k0; /* d[j] for j in [k0, k0 + ncols) */
    for (int64_t j = k0; j < k0 + ncols;) {
      const int64_t g = j / m->group;
      int64_t end = (g + 1) * m->group;
      if (end > k0 + ncols) end = k0 + ncols;
      const float s = moe_load_float(m->scales, m->scale_dtype, scale_row + (size_t)g);
      const float z = moe_weight_zero_point(m, bits, e, n, g);
      const bool whole_bytes = bits == 4 && ((j | end) & 1) == 0;
      const uint8_t *qb = q + j / 2;
      float *dd = d + j;
      /* float(q) - float(z) is exact; one rounding for the product */
      if (table) {
        float lut[16];
        for (int c = 0; c < 16; c++)
          lut[c] = moe_round_to(((float)c - z) * s, m->act);
        if (whole_bytes) {
          for (int64_t i = 0; i < (end - j) / 2; i++) {
            dd[2 * i] = lut[qb[i] & 15];
            dd[2 * i + 1] = lut[qb[i] >> 4];
          }
        } else {
          for (int64_t jj = j; jj < end; jj++)
            d[jj] = lut[(int)code_at(q, bits, jj)];
        }
      } else if (whole_bytes) { /* both nibbles per step: vectorizes */
        for (int64_t i = 0; i < (end - j) / 2; i++) {
          dd[2 * i] = ((float)(qb[i] & 15) - z) * s;
          dd[2 * i + 1] = ((float)(qb[i] >> 4) - z) * s;
        }
      } else {
        for (int64_t jj = j; jj < end; jj++)
          d[jj] = (code_at(q, bits, jj) - z) * s;
      }
      j = end;
    }
    if (!table) round_to_act(d + k0, ncols, m->act);
  }
}

static MOE_CPU_HOT void dequant_int4(const moe_weight_matrix *m, int64_t e, int64_t n0, int64_t nrows,
                                     int64_t k0, int64_t ncols, float *dst, size_t ld) {
  dequant_wna16(m, 4, e, n0, nrows, k0, ncols, dst, ld);
}

static MOE_CPU_HOT void dequant_int8(const moe_weight_matrix *m, int64_t e, int64_t n0, int64_t nrows,
                                     int64_t k0, int64_t ncols, float *dst, size_t ld) {
  dequant_wna16(m, 8, e, n0, nrows, k0, ncols, dst, ld);
}

/* ---- mxfp4 ---------------------------------------------------------------------- */

/* value(code) * 2^(b - 127) is exact in fp32; one act rounding follows. As
 * for int4: with bf16 activations the products go straight into the row
 * and the rounding vectorizes over it; with fp16 a block's 16 possible
 * weights are rounded once into a table that the codes index. */
const float moe_e2m1_value[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static MOE_CPU_HOT void dequant_mxfp4(const moe_weight_matrix *m, int64_t e, int64_t n0, int64_t nrows,
                                      int64_t k0, int64_t ncols, float *dst, size_t ld) {
  const bool table = m->act != MOE_BF16;
  const uint8_t *scales = m->scales;
  for (int64_t r = 0; r < nrows; r++) {
    const int64_t n = n0 + r;
    const uint8_t *q = moe_weight_row(m, e, n);
    const size_t scale_row = ((size_t)e * (size_t)m->rows + (size_t)n) * (size_t)m->groups;
    float *d = dst + (size_t)r * ld - k0; /* d[j] for j in [k0, k0 + ncols) */
    /* blocks of 32 start at even columns and k0, ncols are even: whole bytes */
    for (int64_t j = k0; j < k0 + ncols;) {
      const int64_t g = j / m->group;
      int64_t end = (g + 1) * m->group;
      if (end > k0 + ncols) end = k0 + ncols;
      const float s = moe_e8m0_to_f32(scales[scale_row + (size_t)g]); /* never 0xFF: refused at load */
      const uint8_t *qb = q + j / 2;
      float *dd = d + j;
      if (table) {
        float lut[16];
        for (int c = 0; c < 16; c++)
          lut[c] = moe_round_to(moe_e2m1_value[c] * s, m->act);
        for (int64_t i = 0; i < (end - j) / 2; i++) {
          dd[2 * i] = lut[qb[i] & 15];
          dd[2 * i + 1] = lut[qb[i] >> 4];
        }
      } else {
        for (int64_t i = 0; i < (end - j) / 2; i++) {
          dd[2 * i] = moe_e2m1_value[qb[i] & 15] * s;
          dd[2 * i + 1] = moe_e2m1_value[qb[i] >> 4] * s;
        }
      }
      j = end;
    }
    if (!table) round_to_act(d + k0, ncols, m->act);
  }
}

/* ---- fp8 -------------------------------------------------------------------------- */

/* The codes' exact values; the scales come in the GEMM. */
static MOE_CPU_HOT void dequant_fp8(const moe_weight_matrix *m, int64_t e, int64_t n0, int64_t nrows,
                                    int64_t k0, int64_t ncols, float *dst, size_t ld) {
  for (int64_t r = 0; r < nrows; r++) {
    const uint8_t *q = moe_weight_row(m, e, n0 + r) + k0;
    float *d = dst + (size_t)r * ld;
    for (int64_t j = 0; j < ncols; j++)
      d[j] = moe_e4m3fn_to_f32(q[j]); /* branch-free: the loop vectorizes */
  }
}

/* ---- the table ------------------------------------------------------------------ */

static const moe_weight_format format_bf16 = {"bf16", dequant_bf16, moe_dequant_bf16_avx512,
                                              moe_dot_bf16_avx512, false};
static const moe_weight_format format_fp16 = {"fp16", dequant_fp16, moe_dequant_fp16_avx512,
                                              moe_dot_fp16_avx512, false};
static const moe_weight_format format_int4 = {"wna16 int4", dequant_int4, moe_dequant_int4_avx512,
                                              moe_dot_int4_avx512, true};
static const moe_weight_format format_int8 = {"wna16 int8", dequant_int8, moe_dequant_int8_avx512,
                                              moe_dot_int8_avx512, false};
static const moe_weight_format format_mxfp4 = {"mxfp4", dequant_mxfp4, moe_dequant_mxfp4_avx512,
                                               moe_dot_mxfp4_avx512, true};
static const moe_weight_format format_fp8 = {"fp8 e4m3fn", dequant_fp8, NULL, NULL, false};

const int32_t moe_weight_x_order[MOE_WEIGHT_LANES] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};

void moe_weight_order_x(float *dst, const float *src, int64_t kp) {
  for (int64_t c = 0; c < kp; c += MOE_WEIGHT_LANES)
    for (int p = 0; p < MOE_WEIGHT_LANES; p++)
      dst[c + p] = src[c + moe_weight_x_order[p]];
}

void moe_weight_matrix_init(const moe_expert_set *set, moe_expert_tensor which, moe_dtype act,
                            moe_weight_matrix *m) {
  const moe_expert_config *cfg = &set->cfg;
  const bool w13 = which == MOE_W13;
  memset(m, 0, sizeof *m);
  m->rows = w13 ? 2 * cfg->intermediate_size : cfg->hidden_size;
  m->cols = w13 ? cfg->hidden_size : cfg->intermediate_size;
  m->act = act;
  const moe_tensor *bias = &set->t[w13 ? MOE_W13_BIAS : MOE_W2_BIAS];
  m->bias = bias->data;
  m->bias_dtype = bias->dtype;
  m->kblock = m->cols;
  const moe_tensor *q = &set->t[w13 ? MOE_W13_QWEIGHT : MOE_W2_QWEIGHT];
  const moe_tensor *s = &set->t[w13 ? MOE_W13_SCALES : MOE_W2_SCALES];
  switch (cfg->scheme) {
  case MOE_SCHEME_BF16:
  case MOE_SCHEME_FP16: {
    const moe_tensor *t = &set->t[w13 ? MOE_W13 : MOE_W2];
    m->fmt = t->dtype == MOE_F16 ? &format_fp16 : &format_bf16;
    m->data = t->data;
    m->row_bytes = (size_t)m->cols * 2;
    break;
  }
  case MOE_SCHEME_WNA16: {
    const moe_tensor *z = &set->t[w13 ? MOE_W13_QZEROS : MOE_W2_QZEROS];
    m->fmt = cfg->bits == 4 ? &format_int4 : &format_int8;
    m->data = q->data;
    m->row_bytes = (size_t)(cfg->bits == 4 ? m->cols / 2 : m->cols);
    m->scales = s->data;
    m->scale_dtype = s->dtype;
    m->zeros = cfg->has_zero_points ? z->data : NULL;
    m->group = cfg->group_size == -1 ? m->cols : cfg->group_size;
    m->groups = m->cols / m->group;
    break;
  }
  case MOE_SCHEME_MXFP4:
    m->fmt = &format_mxfp4;
    m->data = q->data;
    m->row_bytes = (size_t)m->cols / 2;
    m->scales = s->data;
    m->scale_dtype = MOE_UINT8;
    m->group = 32;
    m->groups = m->cols / 32;
    break;
  case MOE_SCHEME_FP8: {
    m->fmt = &format_fp8;
    m->data = q->data;
    m->row_bytes = (size_t)m->cols;
    m->scales = s->data;
    m->scale_dtype = MOE_F32;
    m->scaled = true;
    m->blockwise = cfg->weight_scale == MOE_WSCALE_BLOCK;
    m->kblock = m->blockwise ? cfg->block_k : m->cols;
    m->scale_rows = m->blockwise ? cfg->block_n : cfg->weight_scale == MOE_WSCALE_PER_CHANNEL ? 1 : m->rows;
    m->scale_cols = m->blockwise ? m->cols / cfg->block_k : 1; /* BK divides K (validated) */
    m->act_scales = cfg->has_act_scales ? set->t[w13 ? MOE_A13_SCALE : MOE_A2_SCALE].data : NULL;
    m->exact_division = cfg->exact_division;
    break;
  }
  default: break;
  }
}
