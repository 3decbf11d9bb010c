/* CPU: quant.mx and dequant.mx (docs/numerics.md "quant.mx"), one 32-element
 * block at a time; blocks are independent, so any thread split gives the
 * same bits. */
#include "../ops/op.h"
#include "cpu.h"

#define BLOCK 32
#define GROUP 512 /* blocks per OpenMP work item */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Quantizes one block: scale byte into *scale, codes into q (fp4: packed
 * 16 bytes, low nibble = even element; fp8: 32 bytes). */
ALWAYS_INLINE void quant_block(const void *x, moe_dtype xt, size_t base, const moe_mx_args *a, uint8_t *q,
                               uint8_t *scale) {
  float v[BLOCK];
  uint32_t amax_bits = 0; /* integer max: vectorizes, orders like the values */
  for (int i = 0; i < BLOCK; i++) {
    v[i] = moe_load_float(x, xt, base + (size_t)i);
    uint32_t m = moe_f32_bits(v[i]) & 0x7FFFFFFFu;
    amax_bits = m > amax_bits ? m : amax_bits;
  }
  float amax = moe_f32_from_bits(amax_bits);
  bool fp4 = a->qdtype == MOE_FP4_E2M1;
  if (amax_bits >= 0x7F800000u) { /* NaN or inf: OCP's NaN scale makes the whole block NaN */
    *scale = 0xFF;
    for (int i = 0; i < (fp4 ? BLOCK / 2 : BLOCK); i++)
      q[i] = 0;
    return;
  }
  /* locals, not loads through `a`: byte stores to q may alias *a, which
   * would keep the loops below from vectorizing */
  const moe_narrow_fmt fmt = a->fmt;
  const bool half_up = a->half_up;
  float mult;
  *scale = moe_mx_scale(amax, a->rule, &fmt, &mult);
  uint8_t codes[BLOCK];
  if (fp4) /* the compare-count encoder; the generic one gives the same codes */
    for (int i = 0; i < BLOCK; i++)
      codes[i] = moe_f32_to_e2m1(v[i] * mult, half_up);
  else
    for (int i = 0; i < BLOCK; i++)
      codes[i] = moe_f32_to_narrow(v[i] * mult, &fmt, half_up);
  if (fp4)
    for (int i = 0; i < BLOCK / 2; i++)
      q[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
  else
    for (int i = 0; i < BLOCK; i++)
      q[i] = codes[i];
}

/* Blocks [b0, b1). */
MOE_CPU_HOT static void quant_blocks(const moe_tensor *x, const moe_mx_args *a, size_t b0, size_t b1,
                                     uint8_t *q, uint8_t *scales) {
  size_t qbytes = a->qdtype == MOE_FP4_E2M1 ? BLOCK / 2 : BLOCK;
  for (size_t blk = b0; blk < b1; blk++) {
    size_t base = blk * BLOCK;
    uint8_t *qb = q + blk * qbytes;
    switch (x->dtype) {
    case MOE_F16: quant_block(x->data, MOE_F16, base, a, qb, &scales[blk]); break;
    case MOE_BF16: quant_block(x->data, MOE_BF16, base, a, qb, &scales[blk]); break;
    default: quant_block(x->data, MOE_F32, base, a, qb, &scales[blk]); break;
    }
  }
}

moe_status moe_cpu_quant_mx(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_mx_args *a = &c->args.mx;
  const moe_tensor *x = &c->in[0].tensor;
  size_t n = 0;
  moe_tensor_numel(x, &n);
  size_t blocks = n / BLOCK;
  long groups = (long)((blocks + GROUP - 1) / GROUP);
  uint8_t *q = c->out[0].tensor.data, *scales = c->out[1].tensor.data;
#pragma omp parallel for num_threads(moe_cpu_threads_for(b, n)) schedule(static)
  for (long g = 0; g < groups; g++) {
    size_t b0 = (size_t)g * GROUP, b1 = b0 + GROUP < blocks ? b0 + GROUP : blocks;
    quant_blocks(x, a, b0, b1, q, scales);
  }
  return MOE_OK;
}

ALWAYS_INLINE void dequant_block(const uint8_t *q, uint8_t sbyte, const moe_mx_args *a, size_t base,
                                 moe_dtype yt, void *y) {
  float scale = moe_e8m0_to_f32(sbyte);
  bool fp4 = a->qdtype == MOE_FP4_E2M1;
  for (int i = 0; i < BLOCK; i++) {
    uint8_t code = fp4 ? (uint8_t)((q[i / 2] >> ((i & 1) * 4)) & 0xF) : q[i];
    moe_store_float(y, yt, base + (size_t)i, moe_narrow_to_f32(code, &a->fmt) * scale);
  }
}

MOE_CPU_HOT static void dequant_blocks(const moe_mx_args *a, const uint8_t *q, const uint8_t *scales,
                                       size_t b0, size_t b1, void *y) {
  size_t qbytes = a->qdtype == MOE_FP4_E2M1 ? BLOCK / 2 : BLOCK;
  for (size_t blk = b0; blk < b1; blk++) {
    const uint8_t *qb = q + blk * qbytes;
    size_t base = blk * BLOCK;
    switch (a->out_dtype) {
    case MOE_F16: dequant_block(qb, scales[blk], a, base, MOE_F16, y); break;
    case MOE_BF16: dequant_block(qb, scales[blk], a, base, MOE_BF16, y); break;
    default: dequant_block(qb, scales[blk], a, base, MOE_F32, y); break;
    }
  }
}

moe_status moe_cpu_dequant_mx(moe_backend *b, moe_call *c, moe_error *err) {
  const moe_mx_args *a = &c->args.mx;
  size_t n = 0;
  moe_tensor_numel(&c->in[0].tensor, &n);
  size_t blocks = n / BLOCK;
  long groups = (long)((blocks + GROUP - 1) / GROUP);
  const uint8_t *q = c->in[0].tensor.data, *scales = c->in[1].tensor.data;
  void *y = c->out[0].tensor.data;
#pragma omp parallel for num_threads(moe_cpu_threads_for(b, n)) schedule(static)
  for (long g = 0; g < groups; g++) {
    size_t b0 = (size_t)g * GROUP, b1 = b0 + GROUP < blocks ? b0 + GROUP : blocks;
    dequant_blocks(a, q, scales, b0, b1, y);
  }
  return MOE_OK;
}
