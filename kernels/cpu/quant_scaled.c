/* CPU: the scaled quant ops (docs/numerics.md quant.per_tensor, quant.per_token,
 * quant.per_token_group, dequant.per_tensor). Element-wise, so any split across threads gives the
 * same bits. */
#include "../ops/op.h"
#include "cpu.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Elements per OpenMP work item: big enough to amortize scheduling. */
#define CHUNK 16384

/* The SIMD encoder the quant ops take at this call (read once per call). */
static moe_cpu_scaled_lanes scaled_lanes(void) {
  const moe_cpu_isa isa = moe_cpu_quant_isa();
  return isa >= MOE_CPU_ISA_AVX512_VBMI ? moe_cpu_encode_scaled_avx512
         : isa >= MOE_CPU_ISA_AVX2      ? moe_cpu_encode_scaled_avx2
                                        : NULL;
}

/* The amax lanes the quant ops take at this call (read once per call). */
static moe_cpu_amax_lanes amax_lanes(void) {
  return moe_cpu_quant_isa() >= MOE_CPU_ISA_AVX512 ? moe_cpu_amax_units_avx512 : NULL;
}

/* ---- shared loops ----------------------------------------------------------- */

/* max |x| over the finite elements of x[begin, end). In the integer domain:
 * for non-negative floats the bit patterns order like the values, and an
 * integer max reduction vectorizes where a NaN-aware float one does not.
 * fp16/bf16 in their own 16-bit lanes: twice the elements per vector, no
 * widening. */
ALWAYS_INLINE float amax_span(const void *x, moe_dtype xt, size_t begin, size_t end) {
  if (xt == MOE_F32) {
    int32_t m = 0; /* signed: SSE2 has a signed 32-bit compare, no unsigned one */
    for (size_t i = begin; i < end; i++) {
      int32_t a = (int32_t)(moe_f32_bits(((const float *)x)[i]) & 0x7FFFFFFFu);
      a = a < 0x7F800000 ? a : 0;
      m = a > m ? a : m;
    }
    return moe_f32_from_bits((uint32_t)m);
  }
  const uint16_t *h = x;
  const int16_t inf = xt == MOE_BF16 ? 0x7F80 : 0x7C00; /* the exponent field all ones */
  int16_t m = 0;                                        /* |h| < 0x8000, so signed 16-bit compares order it */
  for (size_t i = begin; i < end; i++) {
    int16_t a = (int16_t)(h[i] & 0x7FFF);
    a = a < inf ? a : 0;
    m = a > m ? a : m;
  }
  return moe_load_float(&m, xt, 0);
}

/* amax_span a page of input at a time, each page's lines prefetched `ahead`
 * first (cpu.h: the hardware prefetchers stop at page boundaries). The max
 * is exact, so the split cannot change it. */
ALWAYS_INLINE float amax_range(const void *x, moe_dtype xt, size_t begin, size_t end, moe_cpu_ahead ahead) {
  const size_t es = xt == MOE_F32 ? 4 : 2, page = 4096 / es;
  float m = 0.0f;
  for (size_t i0 = begin; i0 < end; i0 += page) {
    const size_t i1 = end - i0 < page ? end : i0 + page;
    for (size_t b = 0; b < (i1 - i0) * es; b += 64)
      moe_cpu_prefetch((const char *)x + i0 * es + b, ahead);
    const float a = amax_span(x, xt, i0, i1);
    m = a > m ? a : m;
  }
  return m;
}

/* `lanes` (NULL: none): 16-bit input by the lane amax instead. */
MOE_CPU_HOT static float amax_of(const void *x, moe_dtype xt, size_t begin, size_t end,
                                 moe_cpu_amax_lanes lanes) {
  float m;
  if (lanes &&
      lanes((const char *)x + begin * (moe_dtype_bits(xt) / 8), xt, 1, end - begin, MOE_CPU_AHEAD_STREAM, &m))
    return m;
  switch (xt) {
  case MOE_F16: return amax_range(x, MOE_F16, begin, end, MOE_CPU_AHEAD_STREAM);
  case MOE_BF16: return amax_range(x, MOE_BF16, begin, end, MOE_CPU_AHEAD_STREAM);
  default: return amax_range(x, MOE_F32, begin, end, MOE_CPU_AHEAD_STREAM);
  }
}

/* q[i] = cvt(x[i] / s) (exact) or cvt(x[i] * r) for i in [begin, end): one
 * straight loop per (input dtype, division mode, output type), each element
 * loaded, scaled and encoded in registers, so it vectorizes. */
ALWAYS_INLINE void encode_range(const void *x, moe_dtype xt, size_t begin, size_t end, float s, float r,
                                bool exact, bool int8, const moe_narrow_fmt *fmt, void *q) {
  if (int8)
    for (size_t i = begin; i < end; i++) {
      const float v = moe_load_float(x, xt, i);
      ((int8_t *)q)[i] = moe_f32_to_int8(exact ? v / s : v * r);
    }
  else
    for (size_t i = begin; i < end; i++) {
      const float v = moe_load_float(x, xt, i);
      ((uint8_t *)q)[i] = moe_f32_to_narrow(exact ? v / s : v * r, fmt, false);
    }
}

ALWAYS_INLINE void encode_dtype(const void *x, moe_dtype xt, size_t begin, size_t end, float s, float r,
                                bool exact, bool int8, const moe_narrow_fmt *fmt, void *q) {
  if (exact)
    encode_range(x, xt, begin, end, s, r, true, int8, fmt, q);
  else
    encode_range(x, xt, begin, end, s, r, false, int8, fmt, q);
}

/* `lanes` (NULL: none): the leading elements by the SIMD encoder, the rest by
 * the C loops. */
MOE_CPU_HOT static void encode(const void *x, moe_dtype xt, size_t begin, size_t end, float s,
                               const moe_scaled_args *a, moe_cpu_scaled_lanes lanes, bool stream, void *q) {
  const float r = 1.0f / s; /* fast mode: one reciprocal, then multiplies */
  /* a local copy: byte stores to q may alias *a, which would keep the loops
   * from vectorizing */
  const moe_narrow_fmt fmt = a->fmt;
  const bool exact = a->exact_division, int8 = a->qdtype == MOE_INT8;
  if (lanes)
    begin += lanes((const char *)x + begin * (moe_dtype_bits(xt) / 8), xt, 1, end - begin, &s, &r, exact,
                   int8, &fmt, MOE_CPU_AHEAD_STREAM, stream, (uint8_t *)q + begin);
  switch (xt) {
  case MOE_F16: encode_dtype(x, MOE_F16, begin, end, s, r, exact, int8, &fmt, q); break;
  case MOE_BF16: encode_dtype(x, MOE_BF16, begin, end, s, r, exact, int8, &fmt, q); break;
  default: encode_dtype(x, MOE_F32, begin, end, s, r, exact, int8, &fmt, q); break;
  }
}

/* Units [u0, u1) of g elements, one scale each, in batches of about 4096
 * elements that stay in L1: the batch's amaxes, then its scales (so the
 * divisions of different units overlap instead of each waiting for its
 * unit's reduction), then its codes. All inlined: a unit of 128 costs no
 * calls. */
ALWAYS_INLINE void quant_units_dtype(const void *x, moe_dtype xt, size_t u0, size_t u1, size_t g,
                                     const moe_scaled_args *a, moe_cpu_scaled_lanes lanes,
                                     moe_cpu_amax_lanes amax_in_lanes, bool stream, float *scales, void *q) {
  enum { BATCH_ELEMS = 4096, MAX_BATCH = 64 };
  const moe_narrow_fmt fmt = a->fmt; /* locals: stores to q and scales may alias *a */
  const bool exact = a->exact_division, int8 = a->qdtype == MOE_INT8, pow2 = a->pow2_scale;
  const bool has_ub = a->has_scale_ub;
  const float ub = a->scale_ub, dtype_max = a->dtype_max;
  size_t batch = g >= BATCH_ELEMS ? 1 : BATCH_ELEMS / g;
  batch = batch < MAX_BATCH ? batch : MAX_BATCH;
  float s[MAX_BATCH], r[MAX_BATCH];
  for (size_t b0 = u0; b0 < u1; b0 += batch) {
    const size_t nb = u1 - b0 < batch ? u1 - b0 : batch;
    const moe_cpu_ahead page = {MOE_CPU_PREFETCH, false};
    const size_t got =
        amax_in_lanes ? amax_in_lanes((const char *)x + b0 * g * (moe_dtype_bits(xt) / 8), xt, nb, g, page, s)
                      : 0;
    for (size_t k = got; k < nb; k++)
      s[k] = amax_range(x, xt, (b0 + k) * g, (b0 + k + 1) * g, page);
    for (size_t k = 0; k < nb; k++) {
      const float amax = has_ub && ub < s[k] ? ub : s[k];
      s[k] = moe_dynamic_scale(amax, dtype_max, pow2);
      r[k] = 1.0f / s[k];
      scales[b0 + k] = s[k];
    }
    size_t done = 0; /* of each unit, by the lane encoder: the batch's units in one call */
    if (lanes) {
      /* prefetching ahead, where the next amax passes read: the memory stays
       * busy while this batch, already in cache, is encoded. The next batch
       * into L1; with streamed codes the two next into L2 only, since a
       * streamed store and an L1 prefetch each hold a line fill buffer
       * (streamed with the L1 look-ahead: 13-15% slower past the L3, with
       * this one 5-9% faster; bench/RESULTS.md) */
      const size_t span = nb * g * (moe_dtype_bits(xt) / 8);
      const moe_cpu_ahead ahead = stream ? (moe_cpu_ahead){2 * span, true} : (moe_cpu_ahead){span, false};
      done = lanes((const char *)x + b0 * g * (moe_dtype_bits(xt) / 8), xt, nb, g, s, r, exact, int8, &fmt,
                   ahead, stream, (uint8_t *)q + b0 * g);
    }
    if (done == g) continue;
    if (done)
      for (size_t k = 0; k < nb; k++)
        encode_dtype(x, xt, (b0 + k) * g + done, (b0 + k + 1) * g, s[k], r[k], exact, int8, &fmt, q);
    else if (g == 128) /* per_token_group's usual G as a constant trip count: no loop set-up per unit */
      for (size_t k = 0; k < nb; k++) {
        const size_t o = (b0 + k) * 128;
        encode_dtype((const char *)x + o * (moe_dtype_bits(xt) / 8), xt, 0, 128, s[k], r[k], exact, int8,
                     &fmt, (uint8_t *)q + o);
      }
    else
      for (size_t k = 0; k < nb; k++)
        encode_dtype(x, xt, (b0 + k) * g, (b0 + k + 1) * g, s[k], r[k], exact, int8, &fmt, q);
  }
}

MOE_CPU_HOT static void quant_units(const void *x, moe_dtype xt, size_t u0, size_t u1, size_t g,
                                    const moe_scaled_args *a, moe_cpu_scaled_lanes lanes,
                                    moe_cpu_amax_lanes amax_in_lanes, bool stream, float *scales, void *q) {
  switch (xt) {
  case MOE_F16: quant_units_dtype(x, MOE_F16, u0, u1, g, a, lanes, amax_in_lanes, stream, scales, q); break;
  case MOE_BF16: quant_units_dtype(x, MOE_BF16, u0, u1, g, a, lanes, amax_in_lanes, stream, scales, q); break;
  default: quant_units_dtype(x, MOE_F32, u0, u1, g, a, lanes, amax_in_lanes, stream, scales, q); break;
  }
}

/* ---- ops ------------------------------------------------------------------------ */

moe_status moe_cpu_quant_per_tensor(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_scaled_args *a = &c->args.scaled;
  const moe_tensor *x = &c->in[0].tensor;
  size_t n = 0;
  moe_tensor_numel(x, &n);
  long chunks = (long)((n + CHUNK - 1) / CHUNK);
  int threads = moe_cpu_threads_for(b, n);
  float s = a->static_scale;
  const moe_cpu_scaled_lanes lanes = scaled_lanes();
  const bool stream = moe_cpu_stream_codes(x->nbytes + n); /* cpu.h; one byte a code */
  if (!a->has_static_scale) {
    const moe_cpu_amax_lanes amax_in_lanes = amax_lanes();
    float amax = 0.0f; /* max is exact, so the reduction order cannot matter */
#pragma omp parallel for num_threads(threads) reduction(max : amax) schedule(static)
    for (long ch = 0; ch < chunks; ch++) {
      size_t end = (size_t)(ch + 1) * CHUNK < n ? (size_t)(ch + 1) * CHUNK : n;
      float m = amax_of(x->data, x->dtype, (size_t)ch * CHUNK, end, amax_in_lanes);
      if (m > amax) amax = m;
    }
    s = moe_dynamic_scale(amax, a->dtype_max, false);
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long ch = 0; ch < chunks; ch++) {
    size_t end = (size_t)(ch + 1) * CHUNK < n ? (size_t)(ch + 1) * CHUNK : n;
    encode(x->data, x->dtype, (size_t)ch * CHUNK, end, s, a, lanes, stream, c->out[0].tensor.data);
  }
  *(float *)c->out[1].tensor.data = s;
  return MOE_OK;
}

/* One scale per a->group consecutive elements (per_token: a row, per_token_group: G of a row). */
moe_status moe_cpu_quant_grouped(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_scaled_args *a = &c->args.scaled;
  const moe_tensor *x = &c->in[0].tensor;
  size_t n = 0;
  moe_tensor_numel(x, &n);
  if (n == 0) return MOE_OK;
  const size_t g = (size_t)a->group;
  const size_t units = n / g;
  /* work items of whole units, about CHUNK elements each */
  const size_t per = g >= CHUNK ? 1 : CHUNK / g;
  const long items = (long)((units + per - 1) / per);
  float *scales = c->out[1].tensor.data;
  const moe_cpu_scaled_lanes lanes = scaled_lanes();
  const moe_cpu_amax_lanes amax = amax_lanes();
  const bool stream = moe_cpu_stream_codes(x->nbytes + n); /* cpu.h; one byte a code */
#pragma omp parallel for num_threads(moe_cpu_threads_for(b, n)) schedule(static)
  for (long it = 0; it < items; it++) {
    const size_t u0 = (size_t)it * per, u1 = u0 + per < units ? u0 + per : units;
    quant_units(x->data, x->dtype, u0, u1, g, a, lanes, amax, stream, scales, c->out[0].tensor.data);
  }
  return MOE_OK;
}

float moe_cpu_fp8_quant_group(float *v, size_t n, float static_scale, bool exact_division) {
  enum { TILE = 512 };
  const moe_scaled_args a = {
      .qdtype = MOE_FP8_E4M3FN, .fmt = MOE_FMT_E4M3FN, .dtype_max = 448.0f, .exact_division = exact_division};
  const float s =
      static_scale > 0.0f ? static_scale : moe_dynamic_scale(amax_of(v, MOE_F32, 0, n, NULL), 448.0f, false);
  const moe_cpu_scaled_lanes lanes = scaled_lanes();
  uint8_t q[TILE];
  for (size_t i0 = 0; i0 < n; i0 += TILE) {
    const size_t m = n - i0 < TILE ? n - i0 : TILE;
    encode(v + i0, MOE_F32, 0, m, s, &a, lanes, false, q);
    for (size_t j = 0; j < m; j++)
      v[i0 + j] = moe_narrow_to_f32(q[j], &a.fmt);
  }
  return s;
}

/* y depends only on the code (256 of them) for one scale and output dtype:
 * the call builds the table of finished outputs, elements are lookups. */
typedef struct decode_lut {
  uint32_t f32[256];
  uint16_t f16[256]; /* f16 or bf16 bits */
} decode_lut;

static void decode_lut_build(const moe_scaled_args *a, decode_lut *lut) {
  for (int code = 0; code < 256; code++) {
    float v = a->qdtype == MOE_INT8 ? (float)(int8_t)code : moe_narrow_to_f32((uint8_t)code, &a->fmt);
    float y = v * a->static_scale;
    lut->f32[code] = moe_f32_bits(y);
    lut->f16[code] = a->out_dtype == MOE_F16 ? moe_f32_to_f16(y) : moe_f32_to_bf16(y);
  }
}

/* `planes`: 16-bit outputs by byte-plane lookups in lanes (NULL: the C loop) */
MOE_CPU_HOT static void decode(const uint8_t *q, const decode_lut *lut, bool f32,
                               const moe_cpu_dequant_plan *planes, size_t begin, size_t end, void *y) {
  if (planes) begin += moe_cpu_lut16_avx512(q + begin, planes, end - begin, (uint16_t *)y + begin);
  if (f32)
    for (size_t i = begin; i < end; i++)
      ((uint32_t *)y)[i] = lut->f32[q[i]];
  else
    for (size_t i = begin; i < end; i++)
      ((uint16_t *)y)[i] = lut->f16[q[i]];
}

moe_status moe_cpu_dequant_per_tensor(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_scaled_args *a = &c->args.scaled;
  size_t n = 0;
  moe_tensor_numel(&c->in[0].tensor, &n);
  long chunks = (long)((n + CHUNK - 1) / CHUNK);
  const uint8_t *q = c->in[0].tensor.data; /* int8 codes index as their byte */
  void *y = c->out[0].tensor.data;
  decode_lut lut;
  decode_lut_build(a, &lut);
  const bool f32 = a->out_dtype == MOE_F32, lanes = !f32 && moe_cpu_quant_isa() >= MOE_CPU_ISA_AVX512_VBMI;
  moe_cpu_dequant_plan planes;
  if (lanes) moe_cpu_lut16_plan(lut.f16, &planes); /* once per call, read by every chunk */
#pragma omp parallel for num_threads(moe_cpu_threads_for(b, n)) schedule(static)
  for (long ch = 0; ch < chunks; ch++) {
    size_t begin = (size_t)ch * CHUNK, end = begin + CHUNK < n ? begin + CHUNK : n;
    decode(q, &lut, f32, lanes ? &planes : NULL, begin, end, y);
  }
  return MOE_OK;
}
