/* CPU: the scaled quant ops (NUMERICS.md quant.per_tensor, quant.per_token,
 * dequant.per_tensor). Element-wise, so any split across threads gives the
 * same bits. */
#include "../ops/op.h"
#include "cpu.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Elements per OpenMP work item: big enough to amortize scheduling. */
#define CHUNK 16384

/* ---- shared loops ----------------------------------------------------------- */

/* max |x| over the finite elements of x[begin, end). */
ALWAYS_INLINE float amax_range(const void *x, moe_dtype xt, size_t begin, size_t end) {
  float m = 0.0f;
  for (size_t i = begin; i < end; i++) {
    float v = moe_f32_abs(moe_load_float(x, xt, i));
    if (moe_f32_isfinite(v) && v > m) m = v;
  }
  return m;
}

MOE_CPU_HOT static float amax_of(const void *x, moe_dtype xt, size_t begin, size_t end) {
  switch (xt) {
  case MOE_F16: return amax_range(x, MOE_F16, begin, end);
  case MOE_BF16: return amax_range(x, MOE_BF16, begin, end);
  default: return amax_range(x, MOE_F32, begin, end);
  }
}

/* buf[j] = x[i0 + j] * r (fast) or x[i0 + j] / s (exact), j < n. */
ALWAYS_INLINE void scale_tile(const void *x, moe_dtype xt, size_t i0, size_t n, float s, float r, bool exact,
                              float *buf) {
  if (exact)
    for (size_t j = 0; j < n; j++) buf[j] = moe_load_float(x, xt, i0 + j) / s;
  else
    for (size_t j = 0; j < n; j++) buf[j] = moe_load_float(x, xt, i0 + j) * r;
}

/* q[i] = cvt(scaled x[i]) for i in [begin, end), a tile at a time through an
 * L1-resident buffer so that each loop is straight-line and vectorizes. */
MOE_CPU_HOT static void encode(const void *x, moe_dtype xt, size_t begin, size_t end, float s,
                               const moe_scaled_args *a, void *q) {
  enum { TILE = 512 };
  float buf[TILE];
  const float r = 1.0f / s; /* fast mode: one reciprocal, then multiplies */
  const moe_narrow_fmt fmt = a->fmt;
  for (size_t i0 = begin; i0 < end; i0 += TILE) {
    size_t n = end - i0 < TILE ? end - i0 : TILE;
    switch (xt) {
    case MOE_F16: scale_tile(x, MOE_F16, i0, n, s, r, a->exact_division, buf); break;
    case MOE_BF16: scale_tile(x, MOE_BF16, i0, n, s, r, a->exact_division, buf); break;
    default: scale_tile(x, MOE_F32, i0, n, s, r, a->exact_division, buf); break;
    }
    if (a->qdtype == MOE_INT8) {
      int8_t *qi = (int8_t *)q + i0;
      for (size_t j = 0; j < n; j++) qi[j] = moe_f32_to_int8(buf[j]);
    } else {
      uint8_t *qn = (uint8_t *)q + i0;
      for (size_t j = 0; j < n; j++) qn[j] = moe_f32_to_narrow(buf[j], &fmt, false);
    }
  }
}

/* Dynamic scale from an amax: s = amax / dtype_max, 1 when that is 0. */
static float scale_from_amax(float amax, float dtype_max) {
  float s = amax / dtype_max;
  return s == 0.0f ? 1.0f : s;
}

/* ---- ops ------------------------------------------------------------------------ */

moe_status moe_cpu_quant_per_tensor(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_scaled_args *a = &c->args.scaled;
  const moe_tensor *x = &c->in[0].tensor;
  size_t n = 0;
  moe_tensor_numel(x, &n);
  long chunks = (long)((n + CHUNK - 1) / CHUNK);
  int threads = moe_cpu_threads(b);
  float s = a->static_scale;
  if (!a->has_static_scale) {
    float amax = 0.0f; /* max is exact, so the reduction order cannot matter */
#pragma omp parallel for num_threads(threads) reduction(max : amax) schedule(static)
    for (long ch = 0; ch < chunks; ch++) {
      size_t end = (size_t)(ch + 1) * CHUNK < n ? (size_t)(ch + 1) * CHUNK : n;
      float m = amax_of(x->data, x->dtype, (size_t)ch * CHUNK, end);
      if (m > amax) amax = m;
    }
    s = scale_from_amax(amax, a->dtype_max);
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long ch = 0; ch < chunks; ch++) {
    size_t end = (size_t)(ch + 1) * CHUNK < n ? (size_t)(ch + 1) * CHUNK : n;
    encode(x->data, x->dtype, (size_t)ch * CHUNK, end, s, a, c->out[0].tensor.data);
  }
  *(float *)c->out[1].tensor.data = s;
  return MOE_OK;
}

moe_status moe_cpu_quant_per_token(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_scaled_args *a = &c->args.scaled;
  const moe_tensor *x = &c->in[0].tensor;
  long rows = (long)moe_tensor_rows(x);
  size_t k = (size_t)moe_tensor_cols(x);
  float *scales = c->out[1].tensor.data;
#pragma omp parallel for num_threads(moe_cpu_threads(b)) schedule(static)
  for (long r = 0; r < rows; r++) {
    size_t begin = (size_t)r * k;
    float amax = amax_of(x->data, x->dtype, begin, begin + k);
    if (a->has_scale_ub && a->scale_ub < amax) amax = a->scale_ub;
    float s = scale_from_amax(amax, a->dtype_max);
    scales[r] = s;
    encode(x->data, x->dtype, begin, begin + k, s, a, c->out[0].tensor.data);
  }
  return MOE_OK;
}

ALWAYS_INLINE void decode_range(const void *q, const moe_scaled_args *a, size_t begin, size_t end, moe_dtype yt,
                                void *y) {
  const moe_narrow_fmt fmt = a->fmt;
  const float s = a->static_scale;
  for (size_t i = begin; i < end; i++) {
    float v = a->qdtype == MOE_INT8 ? (float)((const int8_t *)q)[i]
                                    : moe_narrow_to_f32(((const uint8_t *)q)[i], &fmt);
    moe_store_float(y, yt, i, v * s);
  }
}

MOE_CPU_HOT static void decode(const void *q, const moe_scaled_args *a, size_t begin, size_t end, void *y) {
  switch (a->out_dtype) {
  case MOE_F16: decode_range(q, a, begin, end, MOE_F16, y); break;
  case MOE_BF16: decode_range(q, a, begin, end, MOE_BF16, y); break;
  default: decode_range(q, a, begin, end, MOE_F32, y); break;
  }
}

moe_status moe_cpu_dequant_per_tensor(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_scaled_args *a = &c->args.scaled;
  size_t n = 0;
  moe_tensor_numel(&c->in[0].tensor, &n);
  long chunks = (long)((n + CHUNK - 1) / CHUNK);
  const void *q = c->in[0].tensor.data;
  void *y = c->out[0].tensor.data;
#pragma omp parallel for num_threads(moe_cpu_threads(b)) schedule(static)
  for (long ch = 0; ch < chunks; ch++) {
    size_t begin = (size_t)ch * CHUNK, end = begin + CHUNK < n ? begin + CHUNK : n;
    decode(q, a, begin, end, y);
  }
  return MOE_OK;
}
