/* The weight formats' AVX-512 members (kernels/cpu/weight_avx512.c) against
 * their element-by-element reference (kernels/cpu/weight_format.c), bit for
 * bit, on matrices built to cover the formats' whole input space:
 * - int4: every code x every zero point x 32 scales, among them ones whose
 *   products are subnormal or overflow in fp32, bf16 or fp16, rounding ties
 *   of both, +-0, +-inf and NaN; with bf16 and fp16 activations;
 * - int8: all 256 codes under every scale, zero points across the range;
 * - mxfp4: every code under every e8m0 scale (0..254);
 * - bf16 and fp16 weights: every 16-bit pattern.
 * For each: the strip dequantization (dequant_fast) equals dequant, and the
 * direct dot (1 to 4 token rows) equals the pipeline's lane arithmetic and
 * pairwise lane sum done here in C on the reference values (NaN: NaN in both).
 * Where the CPU has no AVX-512 the members are never taken: the test says so
 * and checks nothing. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu.h"
#include "cpu/weight_format.h"
#include "moe/codec.h"
#include "moe/expert_set.h"
#include "ops/op.h"

#define LANES MOE_WEIGHT_LANES

/* The scales of the wna16 cases: each column group of a row takes one. */
static const float scales[] = {1.0f,
                               0.0078125f,
                               3.14159274f,
                               -0.5f,
                               1e-3f,
                               0.0f,
                               -0.0f,
                               1e-39f,          /* subnormal in fp32 */
                               1.4e-45f,        /* the least fp32 subnormal */
                               1.17549435e-38f, /* FLT_MIN: the least normal */
                               1e-6f,
                               3e-8f,   /* fp16 subnormal products */
                               4368.0f, /* 15 * 4368 = 65520: fp16's overflow boundary (rounds to inf) */
                               4367.0f,
                               5000.0f,
                               3.0e37f,
                               2.3e37f,
                               4.2535296e37f,  /* fp32 products near and past FLT_MAX */
                               3.40282347e38f, /* FLT_MAX */
                               1.00390625f,    /* 1 + 2^-8: a bf16 tie at (q - z) = +-1 */
                               1.01171875f,    /* 1 + 3 * 2^-8: a tie rounding up */
                               1.00048828f,    /* 1 + 2^-11: an fp16 tie */
                               -1.00146484f,   /* -(1 + 3 * 2^-11) */
                               0.333333343f,
                               -7.77e-3f,
                               123.456f,
                               2.5e-20f,
                               6.1e-5f,
                               INFINITY,
                               -INFINITY,
                               NAN,
                               -NAN};
#define N_SCALES ((int64_t)(sizeof scales / sizeof scales[0]))

static uint64_t rng = 88172645463325252ull;
static uint32_t rng_u32(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint32_t)(rng >> 32);
}

/* A one-expert set of the config's scheme over the tensors t[0..n). */
static moe_expert_set *make_set(moe_expert_config *cfg, moe_named_tensor *t, size_t n) {
  cfg->num_experts = cfg->global_num_experts = 1;
  cfg->routing.top_k = 1;
  moe_expert_set *set = NULL;
  moe_error err = {{0}};
  moe_status s = moe_expert_set_from_tensors("decode", cfg, t, n, &set, &err);
  ck_assert_msg(s == MOE_OK, "set: %s", err.msg);
  return set;
}

static bool same_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

/* dequant_fast against dequant for every row of m; the direct dot against
 * the lane sums of the reference values for rows in fours. */
static void check_matrix(const moe_weight_matrix *m, const char *what) {
  const int64_t rows = m->rows, cols = m->cols, kp = (cols + LANES - 1) / LANES * LANES;
  const size_t n = (size_t)rows * (size_t)kp;
  float *ref = calloc(n, sizeof(float)), *vec = calloc(n, sizeof(float));
  ck_assert_ptr_nonnull(ref);
  ck_assert_ptr_nonnull(vec);
  ck_assert_msg(moe_weight_vector_ok(m), "%s: the vector members do not serve this matrix", what);
  m->fmt->dequant(m, 0, 0, rows, 0, cols, ref, (size_t)kp);
  m->fmt->dequant_fast(m, 0, 0, rows, 0, cols, vec, (size_t)kp);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < cols; j++) {
      const size_t i = (size_t)r * (size_t)kp + (size_t)j;
      ck_assert_msg(same_bits(ref[i], vec[i]), "%s: row %lld column %lld: %a (0x%08x), reference %a (0x%08x)",
                    what, (long long)r, (long long)j, (double)vec[i], moe_f32_bits(vec[i]), (double)ref[i],
                    moe_f32_bits(ref[i]));
    }
  /* token rows of order one, zero past cols as the pipeline pads them;
   * variant 0 not of the activation dtype (the dot never fuses), 1 to 3 of
   * it (the pipeline's rows: the dot fuses where it proves the products
   * exact), 2 and 3 scaled by 2^60 and 2^-60 toward fp32's overflow and
   * underflow (fp16 rows become infinite at 2^60: not fused) */
  float *x = calloc((size_t)MOE_WEIGHT_DOT_TOKENS * (size_t)kp, sizeof(float));
  /* the rows as the dot takes them: in its lane order where it asks (dot_x_ordered) */
  float *xo = calloc((size_t)MOE_WEIGHT_DOT_TOKENS * (size_t)kp, sizeof(float));
  ck_assert_ptr_nonnull(x);
  ck_assert_ptr_nonnull(xo);
  const float *xr[MOE_WEIGHT_DOT_TOKENS], *xd[MOE_WEIGHT_DOT_TOKENS];
  float out[MOE_WEIGHT_DOT_TOKENS * MOE_WEIGHT_DOT_ROWS];
  for (int variant = 0; variant < 4; variant++) {
    const float mul = variant == 2 ? 0x1p60f : variant == 3 ? 0x1p-60f : 1.0f;
    moe_x_range range[MOE_WEIGHT_DOT_TOKENS];
    for (int t = 0; t < MOE_WEIGHT_DOT_TOKENS; t++) {
      for (int64_t j = 0; j < cols; j++) {
        const float v = (float)((int32_t)(rng_u32() % 2001u) - 1000) / 997.0f * mul;
        x[(size_t)t * (size_t)kp + (size_t)j] = variant ? moe_round_to(v, m->act) : v;
      }
      xr[t] = x + (size_t)t * (size_t)kp;
      xd[t] = xr[t];
      if (m->fmt->dot_x_ordered) {
        moe_weight_order_x(xo + (size_t)t * (size_t)kp, xr[t], kp);
        xd[t] = xo + (size_t)t * (size_t)kp;
      }
      range[t] = moe_weight_x_range(xr[t], kp, m->act);
      ck_assert_msg(range[t].exact == (variant == 1 || variant == 3 || (variant == 2 && m->act == MOE_BF16)),
                    "%s: token row %d of variant %d: exact %d", what, t, variant, range[t].exact);
    }
    for (int64_t r0 = 0; r0 + MOE_WEIGHT_DOT_ROWS <= rows; r0 += MOE_WEIGHT_DOT_ROWS) {
      int64_t rr[MOE_WEIGHT_DOT_ROWS];
      for (int r = 0; r < MOE_WEIGHT_DOT_ROWS; r++)
        rr[r] = r0 + r;
      for (int mr = 1; mr <= MOE_WEIGHT_DOT_TOKENS; mr++) {
        moe_x_range joined = range[0];
        for (int t = 1; t < mr; t++)
          joined = moe_x_range_join(joined, range[t]);
        m->fmt->dot(m, 0, rr, mr, xd, joined, kp, out);
        for (int t = 0; t < mr; t++)
          for (int r = 0; r < MOE_WEIGHT_DOT_ROWS; r++) {
            float a[LANES] = {0}, b[8], c[4];
            for (int l = 0; l < LANES; l++) { /* lane l: columns l, l + 16, ... in order; product, then sum */
              for (int64_t j = l; j < kp; j += LANES) {
                const float p = xr[t][j] * ref[(size_t)(r0 + r) * (size_t)kp + (size_t)j];
                a[l] = a[l] + p;
              }
            }
            for (int l = 0; l < 8; l++)
              b[l] = a[l] + a[l + 8];
            for (int l = 0; l < 4; l++)
              c[l] = b[l] + b[l + 4];
            const float want = (c[0] + c[2]) + (c[1] + c[3]), got = out[t * MOE_WEIGHT_DOT_ROWS + r];
            ck_assert_msg(same_bits(got, want) || (isnan(got) && isnan(want)),
                          "%s: x variant %d: dot of token %d with row %lld, %d rows a call: %a, reference %a",
                          what, variant, t, (long long)(r0 + r), mr, (double)got, (double)want);
          }
      }
    }
  }
  free(x);
  free(xo);
  free(ref);
  free(vec);
}

static void check_set(const moe_expert_set *set, const char *name) {
  const moe_dtype acts[2] = {MOE_BF16, MOE_F16};
  for (int a = 0; a < 2; a++)
    for (int w = 0; w < 2; w++) {
      moe_weight_matrix m;
      moe_weight_matrix_init(set, w ? MOE_W2 : MOE_W13, acts[a], &m);
      char what[160];
      snprintf(what, sizeof what, "%s %s, %s activations", name, w ? "w2" : "w13",
               acts[a] == MOE_F16 ? "fp16" : "bf16");
      check_matrix(&m, what);
    }
}

static bool have_vector_kernels(void) {
  if (moe_cpu_vector_kernels()) return true;
  printf("no AVX-512 on this CPU: the vector members are never taken, nothing to compare\n");
  return false;
}

/* ---- wna16 -------------------------------------------------------------------------- */

/* W13 with 32 rows (I = 16) and one 16-column group per scale, so row n
 * (zero point n % 16 for int4) meets every scale; codes permuted along the
 * row so that every group holds each int4 code once (int8: all 256 codes
 * over the row). W2 [H, 16] with random codes, scales and zero points. */
static void check_wna16(int bits, int64_t tail, moe_dtype sdt, bool zeros) {
  const int64_t I = 16, rows = 2 * I, g = 16, H = N_SCALES * g + tail, G = (H + g - 1) / g;
  moe_expert_config cfg;
  moe_expert_config_defaults(&cfg);
  cfg.scheme = MOE_SCHEME_WNA16;
  cfg.bits = bits;
  cfg.group_size = tail ? -1 : g; /* one group when the row has a partial last chunk */
  cfg.has_zero_points = zeros;
  cfg.hidden_size = H;
  cfg.intermediate_size = I;
  const int64_t groups13 = tail ? 1 : G, groups2 = tail ? 1 : I / g;
  const size_t per = bits == 4 ? 2 : 1; /* codes per byte */
  uint8_t *q13 = calloc((size_t)(rows * H) / per, 1), *q2 = calloc((size_t)(H * I) / per, 1);
  float *s13 = malloc((size_t)(rows * groups13) * 4), *s2 = malloc((size_t)(H * groups2) * 4);
  const size_t zr13 = (size_t)(bits == 4 ? rows / 2 : rows), zr2 = (size_t)(bits == 4 ? H / 2 : H);
  uint8_t *z13 = calloc(zr13 * (size_t)groups13, 1), *z2 = calloc(zr2 * (size_t)groups2, 1);
  for (int64_t n = 0; n < rows; n++) {
    for (int64_t j = 0; j < H; j++) {
      const uint32_t code = bits == 4 ? (uint32_t)((j * 7 + n) % 16) : (uint32_t)((j * 37 + n * 11) % 256);
      uint8_t *b = q13 + (size_t)(n * H + j) / per;
      *b = (uint8_t)(bits == 4 ? *b | (code << ((j & 1) * 4)) : code);
    }
    for (int64_t k = 0; k < groups13; k++) {
      s13[n * groups13 + k] = scales[(k + (tail ? n : 0)) % N_SCALES];
      const uint32_t z = bits == 4 ? (uint32_t)(n % 16) : (uint32_t)((n * 53 + k * 17) % 256);
      uint8_t *zb = z13 + (size_t)(bits == 4 ? n / 2 : n) * (size_t)groups13 + (size_t)k;
      *zb = (uint8_t)(bits == 4 ? *zb | (z << ((n & 1) * 4)) : z);
    }
  }
  for (size_t i = 0; i < (size_t)(H * I) / per; i++)
    q2[i] = (uint8_t)rng_u32();
  for (size_t i = 0; i < (size_t)(H * groups2); i++)
    s2[i] = scales[rng_u32() % (uint32_t)N_SCALES];
  for (size_t i = 0; i < zr2 * (size_t)groups2; i++)
    z2[i] = (uint8_t)rng_u32();
  /* bf16 / fp16 scales: the same list rounded (the vector members read them in their own way) */
  const size_t ssz = sdt == MOE_F32 ? 4 : 2;
  uint16_t *h13 = malloc((size_t)(rows * groups13) * 2), *h2 = malloc((size_t)(H * groups2) * 2);
  for (size_t i = 0; i < (size_t)(rows * groups13); i++)
    h13[i] = sdt == MOE_F16 ? moe_f32_to_f16(s13[i]) : moe_f32_to_bf16(s13[i]);
  for (size_t i = 0; i < (size_t)(H * groups2); i++)
    h2[i] = sdt == MOE_F16 ? moe_f32_to_f16(s2[i]) : moe_f32_to_bf16(s2[i]);
  void *sp13 = sdt == MOE_F32 ? (void *)s13 : (void *)h13, *sp2 = sdt == MOE_F32 ? (void *)s2 : (void *)h2;
  moe_named_tensor t[6] = {
      {"w13_qweight", {MOE_UINT8, 3, {1, rows, H / (int64_t)per}, q13, (size_t)(rows * H) / per}},
      {"w13_scales", {sdt, 3, {1, rows, groups13}, sp13, (size_t)(rows * groups13) * ssz}},
      {"w2_qweight", {MOE_UINT8, 3, {1, H, I / (int64_t)per}, q2, (size_t)(H * I) / per}},
      {"w2_scales", {sdt, 3, {1, H, groups2}, sp2, (size_t)(H * groups2) * ssz}},
      {"w13_qzeros", {MOE_UINT8, 3, {1, (int64_t)zr13, groups13}, z13, zr13 * (size_t)groups13}},
      {"w2_qzeros", {MOE_UINT8, 3, {1, (int64_t)zr2, groups2}, z2, zr2 * (size_t)groups2}},
  };
  moe_expert_set *set = make_set(&cfg, t, zeros ? 6 : 4);
  char name[96];
  snprintf(name, sizeof name, "int%d%s, %s scales%s", bits, tail ? " one group, partial last chunk" : " g16",
           sdt == MOE_F32   ? "fp32"
           : sdt == MOE_F16 ? "fp16"
                            : "bf16",
           zeros ? "" : ", no zero points");
  check_set(set, name);
  moe_expert_set_destroy(set);
  free(q13);
  free(q2);
  free(s13);
  free(s2);
  free(z13);
  free(z2);
  free(h13);
  free(h2);
}

START_TEST(int4_every_code_zero_point_and_scale) {
  if (!have_vector_kernels()) return;
  check_wna16(4, 0, MOE_F32, true);
  check_wna16(4, 8, MOE_F32, true); /* K = 16 * 32 + 8: the masked last chunk */
  check_wna16(4, 0, MOE_BF16, true);
  check_wna16(4, 0, MOE_F16, false);
  check_wna16(4, 0, MOE_BF16, false);
}
END_TEST

START_TEST(int8_every_code_and_scale) {
  if (!have_vector_kernels()) return;
  check_wna16(8, 0, MOE_F32, true);
  check_wna16(8, 6, MOE_F32, true);
}
END_TEST

/* ---- mxfp4 ---------------------------------------------------------------------------- */

START_TEST(mxfp4_every_code_and_scale) {
  if (!have_vector_kernels()) return;
  const int64_t I = 32, rows = 2 * I, H = 255 * 32; /* W13 row n, block k: scale (n + k) % 255 */
  moe_expert_config cfg;
  moe_expert_config_defaults(&cfg);
  cfg.scheme = MOE_SCHEME_MXFP4;
  cfg.hidden_size = H;
  cfg.intermediate_size = I;
  uint8_t *q13 = malloc((size_t)(rows * H) / 2), *s13 = malloc((size_t)(rows * H) / 32);
  uint8_t *q2 = malloc((size_t)(H * I) / 2), *s2 = malloc((size_t)(H * I) / 32);
  for (int64_t n = 0; n < rows; n++) {
    for (int64_t j = 0; j < H; j += 2) /* codes (j * 7 + n) % 16: each block holds all 16 twice */
      q13[(n * H + j) / 2] = (uint8_t)(((j * 7 + n) % 16) | (((j * 7 + 7 + n) % 16) << 4));
    for (int64_t k = 0; k < H / 32; k++)
      s13[n * (H / 32) + k] = (uint8_t)((n + k) % 255);
  }
  for (size_t i = 0; i < (size_t)(H * I) / 2; i++)
    q2[i] = (uint8_t)rng_u32();
  for (size_t i = 0; i < (size_t)(H * I) / 32; i++)
    s2[i] = (uint8_t)(rng_u32() % 255);
  moe_named_tensor t[4] = {
      {"w13_qweight", {MOE_UINT8, 3, {1, rows, H / 2}, q13, (size_t)(rows * H) / 2}},
      {"w13_scales", {MOE_UINT8, 3, {1, rows, H / 32}, s13, (size_t)(rows * H) / 32}},
      {"w2_qweight", {MOE_UINT8, 3, {1, H, I / 2}, q2, (size_t)(H * I) / 2}},
      {"w2_scales", {MOE_UINT8, 3, {1, H, I / 32}, s2, (size_t)(H * I) / 32}},
  };
  moe_expert_set *set = make_set(&cfg, t, 4);
  check_set(set, "mxfp4");
  moe_expert_set_destroy(set);
  free(q13);
  free(s13);
  free(q2);
  free(s2);
}
END_TEST

/* ---- bf16 / fp16 weights ----------------------------------------------------------------- */

START_TEST(dense_every_pattern) {
  if (!have_vector_kernels()) return;
  const int64_t I = 16,
                H = 2048 + 8; /* W13: 32 x 2056 >= 65536 values: every pattern, a partial chunk a row */
  for (int f16 = 0; f16 < 2; f16++) {
    moe_expert_config cfg;
    moe_expert_config_defaults(&cfg);
    cfg.scheme = f16 ? MOE_SCHEME_FP16 : MOE_SCHEME_BF16;
    cfg.hidden_size = H;
    cfg.intermediate_size = I;
    uint16_t *w13 = malloc((size_t)(2 * I * H) * 2), *w2 = malloc((size_t)(H * I) * 2);
    for (size_t i = 0; i < (size_t)(2 * I * H); i++)
      w13[i] = (uint16_t)(i * 40503u);
    for (size_t i = 0; i < (size_t)(H * I); i++)
      w2[i] = (uint16_t)rng_u32();
    const moe_dtype dt = f16 ? MOE_F16 : MOE_BF16;
    moe_named_tensor t[2] = {{"w13", {dt, 3, {1, 2 * I, H}, w13, (size_t)(2 * I * H) * 2}},
                             {"w2", {dt, 3, {1, H, I}, w2, (size_t)(H * I) * 2}}};
    moe_expert_set *set = make_set(&cfg, t, 2);
    moe_weight_matrix m;
    moe_weight_matrix_init(set, MOE_W13, dt, &m);
    check_matrix(&m, f16 ? "fp16 w13" : "bf16 w13");
    moe_weight_matrix_init(set, MOE_W2, dt, &m);
    check_matrix(&m, f16 ? "fp16 w2" : "bf16 w2");
    moe_expert_set_destroy(set);
    free(w13);
    free(w2);
  }
}
END_TEST

int main(void) {
  Suite *s = suite_create("weight_decode");
  TCase *tc = tcase_create("avx512");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, int4_every_code_zero_point_and_scale);
  tcase_add_test(tc, int8_every_code_and_scale);
  tcase_add_test(tc, mxfp4_every_code_and_scale);
  tcase_add_test(tc, dense_every_pattern);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
