/* Quant ops through the generic op API: hand-computed cases from
 * docs/numerics.md (ties, saturation, NaN, -0, scale rules) and every bad-input
 * path (status + the offending field named). The exhaustive bit-exact sweep
 * against an independent oracle lives in tests/oracle/. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu.h"
#include "moe/codec.h"
#include "moe/ops.h"

/* ---- helpers ------------------------------------------------------------------ */

static moe_named_tensor tensor(const char *name, moe_dtype dt, void *data, size_t nbytes, int ndim,
                               const int64_t *shape) {
  moe_named_tensor t = {name, {dt, ndim, {0}, data, nbytes}};
  for (int i = 0; i < ndim; i++)
    t.tensor.shape[i] = shape[i];
  return t;
}

static moe_param pstr(const char *name, const char *v) {
  return (moe_param){name, MOE_PARAM_STRING, v, 0, 0, 0};
}
static moe_param pbool(const char *name, bool v) { return (moe_param){name, MOE_PARAM_BOOL, NULL, v, 0, 0}; }
static moe_param pint(const char *name, int64_t v) { return (moe_param){name, MOE_PARAM_INT, NULL, 0, v, 0}; }
static moe_param pdbl(const char *name, double v) {
  return (moe_param){name, MOE_PARAM_DOUBLE, NULL, 0, 0, v};
}

/* Runs op; returns status; outputs in *out (freed by caller). */
static moe_status run(const char *op, moe_named_tensor *in, size_t nin, moe_param *p, size_t np,
                      moe_named_tensor **out, size_t *nout, moe_error *err) {
  moe_params params = {p, np};
  memset(err, 0, sizeof *err);
  return moe_run_host(op, in, nin, &params, NULL, out, nout, err);
}

static void expect_einval(const char *op, moe_named_tensor *in, size_t nin, moe_param *p, size_t np,
                          const char *field) {
  moe_named_tensor *out = NULL;
  size_t nout = 0;
  moe_error err;
  moe_status s = run(op, in, nin, p, np, &out, &nout, &err);
  ck_assert_int_eq(s, MOE_EINVAL);
  ck_assert_msg(strstr(err.msg, field) != NULL, "message '%s' does not name '%s'", err.msg, field);
  ck_assert_ptr_null(out);
}

/* ---- values ------------------------------------------------------------------- */

START_TEST(fp4_ties_follow_rne) {
  /* docs/numerics.md: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 2.5 -> 2, 5 -> 4; block
   * amax 6 gives scale 2^0 under `even` for e2m1 (emax 2). */
  float x[32] = {0.25f, 0.75f, 1.25f, 2.5f, 5.0f, 6.0f, -0.25f, -6.0f};
  int64_t shape[1] = {32};
  moe_named_tensor in[1] = {tensor("x", MOE_F32, x, sizeof x, 1, shape)};
  moe_param p[1] = {pstr("format", "mxfp4")};
  moe_named_tensor *out;
  size_t n;
  moe_error err;
  ck_assert_int_eq(run("quant.mx", in, 1, p, 1, &out, &n, &err), MOE_OK);
  const uint8_t *q = out[0].tensor.data, *s = out[1].tensor.data;
  /* amax 6: bits(6) + 0x200000 keeps exponent 2 -> unb = 2 - 2 = 0 (7 would
   * carry into exponent 3) */
  ck_assert_uint_eq(s[0], 127);
  /* codes: 0.25->0, 0.75->2 (1.0), 1.25->2, 2.5->4 (2.0), 5->6 (4.0), 6->7, -0.25->0x8 (-0), -6->0xF */
  ck_assert_uint_eq(q[0], 0x20);
  ck_assert_uint_eq(q[1], 0x42);
  ck_assert_uint_eq(q[2], 0x76);
  ck_assert_uint_eq(q[3], 0xF8);
  moe_outputs_free(out, n);
}
END_TEST

START_TEST(half_up_rounds_ties_away) {
  float x[32] = {0.25f, 0.75f, 1.25f, 2.5f, 5.0f, 6.0f};
  int64_t shape[1] = {32};
  moe_named_tensor in[1] = {tensor("x", MOE_F32, x, sizeof x, 1, shape)};
  moe_param p[2] = {pstr("format", "mxfp4"), pstr("element_rounding", "half_up")};
  moe_named_tensor *out;
  size_t n;
  moe_error err;
  ck_assert_int_eq(run("quant.mx", in, 1, p, 2, &out, &n, &err), MOE_OK);
  const uint8_t *q = out[0].tensor.data;
  /* 0.25->0.5 (1), 0.75->1.0 (2), 1.25->1.5 (3), 2.5->3 (5), 5->6 (7), 6->6 (7) */
  ck_assert_uint_eq(q[0], 0x21);
  ck_assert_uint_eq(q[1], 0x53);
  ck_assert_uint_eq(q[2], 0x77);
  moe_outputs_free(out, n);
}
END_TEST

START_TEST(nan_block_gets_nan_scale) {
  float x[64];
  for (int i = 0; i < 64; i++)
    x[i] = (float)i;
  x[40] = NAN;
  int64_t shape[2] = {1, 64};
  moe_named_tensor in[1] = {tensor("x", MOE_F32, x, sizeof x, 2, shape)};
  moe_param p[1] = {pstr("format", "mxfp8_e4m3fn")};
  moe_named_tensor *out;
  size_t n;
  moe_error err;
  ck_assert_int_eq(run("quant.mx", in, 1, p, 1, &out, &n, &err), MOE_OK);
  const uint8_t *q = out[0].tensor.data, *s = out[1].tensor.data;
  ck_assert_uint_ne(s[0], 0xFF);
  ck_assert_uint_eq(s[1], 0xFF);
  for (int i = 32; i < 64; i++)
    ck_assert_uint_eq(q[i], 0);
  moe_outputs_free(out, n);
}
END_TEST

START_TEST(per_tensor_saturates_and_maps_nan) {
  float x[6] = {1000.0f, -1000.0f, INFINITY, NAN, -0.0f, 464.0f};
  float one = 1.0f;
  int64_t shape[1] = {6}, sshape[1] = {1};
  moe_named_tensor in[2] = {tensor("x", MOE_F32, x, sizeof x, 1, shape),
                            tensor("scale", MOE_F32, &one, sizeof one, 1, sshape)};
  const struct {
    const char *dt;
    uint8_t want[6];
  } cases[] = {
      /* e4m3fn: max 448 = 0x7E, NaN 0x7F, -0 kept, 464 is a tie -> even 448 */
      {"fp8_e4m3fn", {0x7E, 0xFE, 0x7E, 0x7F, 0x80, 0x7E}},
      /* e4m3fnuz: max 240 = 0x7F, NaN 0x80, -0 -> 0 */
      {"fp8_e4m3fnuz", {0x7F, 0xFF, 0x7F, 0x80, 0x00, 0x7F}},
      /* int8: saturate, NaN -> 0 */
      {"int8", {127, 0x80, 127, 0, 0, 127}},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    moe_param p[1] = {pstr("out_dtype", cases[k].dt)};
    moe_named_tensor *out;
    size_t n;
    moe_error err;
    ck_assert_int_eq(run("quant.per_tensor", in, 2, p, 1, &out, &n, &err), MOE_OK);
    ck_assert_mem_eq(out[0].tensor.data, cases[k].want, 6);
    ck_assert_float_eq(*(float *)out[1].tensor.data, 1.0f);
    moe_outputs_free(out, n);
  }
}
END_TEST

START_TEST(dynamic_scale_is_amax_over_finite) {
  float x[4] = {-896.0f, 2.0f, INFINITY, NAN};
  int64_t shape[1] = {4};
  moe_named_tensor in[1] = {tensor("x", MOE_F32, x, sizeof x, 1, shape)};
  moe_named_tensor *out;
  size_t n;
  moe_error err;
  ck_assert_int_eq(run("quant.per_tensor", in, 1, NULL, 0, &out, &n, &err), MOE_OK);
  ck_assert_float_eq(*(float *)out[1].tensor.data, 2.0f); /* 896 / 448 */
  const uint8_t *q = out[0].tensor.data;
  ck_assert_uint_eq(q[0], 0xFE); /* -448 */
  ck_assert_uint_eq(q[1], 0x38); /* 1.0 */
  moe_outputs_free(out, n);
  /* all zeros: s = 1 */
  float z[3] = {0, -0.0f, 0};
  in[0] = tensor("x", MOE_F32, z, sizeof z, 1, (int64_t[]){3});
  ck_assert_int_eq(run("quant.per_tensor", in, 1, NULL, 0, &out, &n, &err), MOE_OK);
  ck_assert_float_eq(*(float *)out[1].tensor.data, 1.0f);
  moe_outputs_free(out, n);
}
END_TEST

START_TEST(per_token_scale_ub_caps_amax) {
  float x[2][4] = {{100.0f, 1.0f, 0, 0}, {1.0f, 0.5f, 0, 0}};
  int64_t shape[2] = {2, 4};
  moe_named_tensor in[1] = {tensor("x", MOE_F32, x, sizeof x, 2, shape)};
  moe_param p[2] = {pstr("out_dtype", "int8"), pdbl("scale_ub", 12.7)};
  moe_named_tensor *out;
  size_t n;
  moe_error err;
  ck_assert_int_eq(run("quant.per_token", in, 1, p, 2, &out, &n, &err), MOE_OK);
  const float *s = out[1].tensor.data;
  ck_assert_int_eq(out[1].tensor.shape[0], 2);
  ck_assert_int_eq(out[1].tensor.shape[1], 1);
  ck_assert_float_eq(s[0], 12.7f / 127.0f);
  ck_assert_float_eq(s[1], 1.0f / 127.0f);
  const int8_t *q = out[0].tensor.data;
  ck_assert_int_eq(q[0], 127); /* saturated by the cap */
  ck_assert_int_eq(q[4], 127);
  moe_outputs_free(out, n);
}
END_TEST

START_TEST(per_token_group_scales_and_pow2_up) {
  /* groups of 4: amax 3 -> s = 3 / 448; pow2_up -> 2^-7, then x * 128 encodes
   * exactly: 1 -> 128 (0x70), -3 -> -384 (0xFC), 0.5 -> 64 (0x68). The all-zero
   * group keeps s = 1 (a power of two already). */
  float x[2][8] = {{1.0f, -3.0f, 0.0f, 0.5f, 0, 0, 0, 0}, {448.0f, 0, 0, 0, 0, 0, 0, 1e-40f}};
  int64_t shape[2] = {2, 8};
  moe_named_tensor in[1] = {tensor("x", MOE_F32, x, sizeof x, 2, shape)};
  moe_param p[2] = {pint("group_size", 4), pstr("scale_rule", "pow2_up")};
  moe_named_tensor *out;
  size_t n;
  moe_error err;
  ck_assert_int_eq(run("quant.per_token_group", in, 1, p, 2, &out, &n, &err), MOE_OK);
  ck_assert_int_eq(out[0].tensor.dtype, MOE_FP8_E4M3FN);
  ck_assert_int_eq(out[1].tensor.ndim, 2);
  ck_assert_int_eq(out[1].tensor.shape[0], 2);
  ck_assert_int_eq(out[1].tensor.shape[1], 2);
  const float *s = out[1].tensor.data;
  ck_assert_float_eq(s[0], 0.0078125f);
  ck_assert_float_eq(s[1], 1.0f);
  ck_assert_float_eq(s[2], 1.0f);            /* 448 / 448 */
  ck_assert_float_eq(s[3], ldexpf(1, -126)); /* 1e-40 / 448 (subnormal) up to the least normal power */
  const uint8_t *q = out[0].tensor.data;
  ck_assert_uint_eq(q[0], 0x70);
  ck_assert_uint_eq(q[1], 0xFC);
  ck_assert_uint_eq(q[2], 0x00);
  ck_assert_uint_eq(q[3], 0x68);
  ck_assert_uint_eq(q[8], 0x7E); /* 448 */
  moe_outputs_free(out, n);
  /* without the rule: s = amax / 448 as is; default group 128 needs K % 128 */
  ck_assert_int_eq(run("quant.per_token_group", in, 1, p, 1, &out, &n, &err), MOE_OK);
  ck_assert_float_eq(((float *)out[1].tensor.data)[0], 3.0f / 448.0f);
  moe_outputs_free(out, n);
  /* rank 1: scales [K / G] */
  float r1[256] = {0};
  moe_named_tensor in1[1] = {tensor("x", MOE_F32, r1, sizeof r1, 1, (int64_t[]){256})};
  ck_assert_int_eq(run("quant.per_token_group", in1, 1, NULL, 0, &out, &n, &err), MOE_OK);
  ck_assert_int_eq(out[1].tensor.ndim, 1);
  ck_assert_int_eq(out[1].tensor.shape[0], 2);
  moe_outputs_free(out, n);
}
END_TEST

START_TEST(dequant_mx_nan_scale_and_fp4_nibbles) {
  uint8_t q[16] = {0x7F}, s[1] = {128}; /* element 0 = low nibble 0xF (-6), 1 = high 0x7 (6); scale 2 */
  int64_t qs[1] = {16}, ss[1] = {1};
  moe_named_tensor in[2] = {tensor("q", MOE_UINT8, q, sizeof q, 1, qs),
                            tensor("scales", MOE_UINT8, s, 1, 1, ss)};
  moe_param p[1] = {pstr("format", "mxfp4")};
  moe_named_tensor *out;
  size_t n;
  moe_error err;
  ck_assert_int_eq(run("dequant.mx", in, 2, p, 1, &out, &n, &err), MOE_OK);
  const float *y = out[0].tensor.data;
  ck_assert_int_eq(out[0].tensor.shape[0], 32);
  ck_assert_float_eq(y[0], -12.0f);
  ck_assert_float_eq(y[1], 12.0f);
  ck_assert_float_eq(y[2], 0.0f);
  moe_outputs_free(out, n);
  s[0] = 0xFF;
  ck_assert_int_eq(run("dequant.mx", in, 2, p, 1, &out, &n, &err), MOE_OK);
  ck_assert(isnan(((float *)out[0].tensor.data)[0]));
  moe_outputs_free(out, n);
}
END_TEST

START_TEST(dequant_per_tensor_rounds_to_out_dtype) {
  int8_t q[2] = {-128, 3};
  float scale = 0.1f;
  int64_t qs[1] = {2}, ss[1] = {1};
  moe_named_tensor in[2] = {tensor("q", MOE_INT8, q, sizeof q, 1, qs),
                            tensor("scale", MOE_F32, &scale, sizeof scale, 1, ss)};
  moe_param p[1] = {pstr("out_dtype", "bf16")};
  moe_named_tensor *out;
  size_t n;
  moe_error err;
  ck_assert_int_eq(run("dequant.per_tensor", in, 2, p, 1, &out, &n, &err), MOE_OK);
  const uint16_t *y = out[0].tensor.data;
  ck_assert_uint_eq(y[0], moe_f32_to_bf16(-128.0f * 0.1f));
  ck_assert_uint_eq(y[1], moe_f32_to_bf16(3.0f * 0.1f));
  moe_outputs_free(out, n);
}
END_TEST

/* The dequant ops' lanes (dequant_avx512.c) against the C loops (the
 * reference switch), byte for byte. dequant.mx: every code of each format
 * with every scale byte (0xFF, NaN, too): 256 rows, row r a run of every
 * code (fp8: 8 blocks of codes 0..255; fp4: 16 blocks of bytes 0..255, every
 * pair of nibbles), block b scaled by byte (r + b) mod 256. dequant.per_tensor:
 * every code, in a count that leaves a tail of 13 for the C loop, with
 * scales (finite, > 0: the op's rule) that are powers of two, odd values,
 * subnormal, and large enough that products overflow to inf, for each
 * in_dtype (its NaN codes included). Each to fp32, fp16 and bf16. */
static void expect_same_as_c_path(const char *op, moe_named_tensor *in, size_t nin, moe_param *p, size_t np,
                                  const char *what) {
  moe_named_tensor *out[2];
  size_t nout[2];
  moe_error err;
  for (int ref = 0; ref < 2; ref++) {
    moe_cpu_set_reference_kernels(ref == 1);
    ck_assert_msg(run(op, in, nin, p, np, &out[ref], &nout[ref], &err) == MOE_OK, "%s: %s: %s", op, what,
                  err.msg);
  }
  moe_cpu_set_reference_kernels(false);
  ck_assert_msg(out[0][0].tensor.nbytes == out[1][0].tensor.nbytes &&
                    memcmp(out[0][0].tensor.data, out[1][0].tensor.data, out[1][0].tensor.nbytes) == 0,
                "%s: %s differs from the C path", op, what);
  for (int ref = 0; ref < 2; ref++)
    moe_outputs_free(out[ref], nout[ref]);
}

START_TEST(dequant_vector_matches_c_path) {
  static const char *const outs[3] = {"fp32", "fp16", "bf16"};
  enum { ROWS = 256, K8 = 256, K4 = 512 };
  static uint8_t q[ROWS * K8], s8[ROWS * (K8 / 32)], s4[ROWS * (K4 / 32)];
  for (int r = 0; r < ROWS; r++) {
    for (int j = 0; j < K8; j++)
      q[r * K8 + j] = (uint8_t)j;
    for (int b = 0; b < K8 / 32; b++)
      s8[r * (K8 / 32) + b] = (uint8_t)(r + b);
    for (int b = 0; b < K4 / 32; b++)
      s4[r * (K4 / 32) + b] = (uint8_t)(r + b);
  }
  static const char *const formats[3] = {"mxfp8_e4m3fn", "mxfp8_e5m2", "mxfp4"};
  for (int f = 0; f < 3; f++) {
    const bool fp4 = f == 2;
    const int64_t k = fp4 ? K4 : K8;
    int64_t qs[2] = {ROWS, fp4 ? K4 / 2 : K8}, ss[2] = {ROWS, k / 32};
    moe_named_tensor in[2] = {tensor("q", MOE_UINT8, q, sizeof q, 2, qs),
                              tensor("scales", MOE_UINT8, fp4 ? s4 : s8, (size_t)(ROWS * k / 32), 2, ss)};
    for (int o = 0; o < 3; o++) {
      moe_param p[2] = {pstr("format", formats[f]), pstr("out_dtype", outs[o])};
      char what[64];
      snprintf(what, sizeof what, "%s to %s", formats[f], outs[o]);
      expect_same_as_c_path("dequant.mx", in, 2, p, 2, what);
    }
  }
  enum { N = 3 * 256 + 13 };
  uint8_t codes[N];
  for (int i = 0; i < N; i++)
    codes[i] = (uint8_t)(i * 7 + i / 256); /* every code, not in order */
  float scales[320];
  int ns = 0;
  for (int e = -149; e <= 127; e += 3)
    scales[ns++] = ldexpf(1.0f, e);
  const float odd[] = {0.1f,    1.0f / 3.0f, 3.0f,   7.5e-3f, 1.17549421e-38f, 1e-45f,
                       3.4e38f, 65504.0f,    448.0f, 1e30f,   2.2e-5f,         6.1e-5f};
  for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++)
    scales[ns++] = odd[i];
  while (ns < 320)
    scales[ns] = (float)ns * 0.0173f + 1e-3f, ns++;
  static const char *const ins[3] = {"fp8_e4m3fn", "fp8_e4m3fnuz", "int8"};
  int64_t qs[1] = {N}, one[1] = {1};
  for (int d = 0; d < 3; d++)
    for (int o = 0; o < 3; o++)
      for (int si = 0; si < ns; si++) {
        moe_named_tensor in[2] = {tensor("q", d == 2 ? MOE_INT8 : MOE_UINT8, codes, N, 1, qs),
                                  tensor("scale", MOE_F32, &scales[si], sizeof(float), 1, one)};
        moe_param p[2] = {pstr("in_dtype", ins[d]), pstr("out_dtype", outs[o])};
        char what[96];
        snprintf(what, sizeof what, "%s to %s, scale %a", ins[d], outs[o], (double)scales[si]);
        expect_same_as_c_path("dequant.per_tensor", in, 2, p, 2, what);
      }
}
END_TEST

/* ---- bad input ---------------------------------------------------------------------- */

START_TEST(bad_inputs_are_named) {
  float x[64] = {0};
  uint16_t h[64] = {0};
  int32_t ix[4] = {0};
  int64_t s64[1] = {64}, s33[1] = {33}, s2[2] = {2, 32}, s1[1] = {1}, big[3] = {INT64_MAX / 2, 4, 4};
  float zero = 0.0f, inf = INFINITY, nan = NAN, neg = -1.0f;

  /* wrong dtype */
  moe_named_tensor wrong_dt[1] = {tensor("x", MOE_INT32, ix, sizeof ix, 1, (int64_t[]){4})};
  expect_einval("quant.per_tensor", wrong_dt, 1, NULL, 0, "x");
  /* byte size not matching the shape */
  moe_named_tensor short_buf[1] = {tensor("x", MOE_F32, x, 10, 1, s64)};
  expect_einval("quant.per_token", short_buf, 1, NULL, 0, "x");
  /* K not a multiple of 32 */
  moe_named_tensor k33[1] = {tensor("x", MOE_F32, x, 33 * 4, 1, s33)};
  expect_einval("quant.mx", k33, 1, NULL, 0, "K");
  /* element count overflow */
  moe_named_tensor huge[1] = {tensor("x", MOE_BF16, h, sizeof h, 3, big)};
  expect_einval("quant.mx", huge, 1, NULL, 0, "x");
  /* a parameter the op does not take (misspelt out_dtype): named, not ignored */
  moe_named_tensor ok_x[1] = {tensor("x", MOE_F32, x, sizeof x, 1, s64)};
  moe_param misspelt[2] = {pstr("out_dtype", "int8"), pstr("out_dtyp", "fp8_e4m3fn")};
  expect_einval("quant.per_tensor", ok_x, 1, misspelt, 2, "'out_dtyp'");
  expect_einval("quant.mx", ok_x, 1, (moe_param[]){pint("group_size", 32)}, 1, "'group_size'");
  /* rank 0 where a last axis is needed */
  moe_named_tensor scalar[1] = {tensor("x", MOE_F32, x, 4, 0, NULL)};
  expect_einval("quant.per_token", scalar, 1, NULL, 0, "x");
  /* static scales: zero, negative, inf, NaN, wrong count */
  float *bad_scales[] = {&zero, &neg, &inf, &nan};
  for (int i = 0; i < 4; i++) {
    moe_named_tensor in[2] = {tensor("x", MOE_F32, x, sizeof x, 1, s64),
                              tensor("scale", MOE_F32, bad_scales[i], 4, 1, s1)};
    expect_einval("quant.per_tensor", in, 2, NULL, 0, "scale");
    moe_named_tensor dq[2] = {tensor("q", MOE_UINT8, h, 64, 1, s64),
                              tensor("scale", MOE_F32, bad_scales[i], 4, 1, s1)};
    expect_einval("dequant.per_tensor", dq, 2, NULL, 0, "scale");
  }
  moe_named_tensor two_scales[2] = {tensor("x", MOE_F32, x, sizeof x, 1, s64),
                                    tensor("scale", MOE_F32, x, 8, 1, (int64_t[]){2})};
  expect_einval("quant.per_tensor", two_scales, 2, NULL, 0, "scale");
  /* parameter values */
  moe_named_tensor ok[1] = {tensor("x", MOE_F32, x, sizeof x, 2, s2)};
  moe_param p1[1] = {pstr("out_dtype", "fp8_e5m2")};
  expect_einval("quant.per_tensor", ok, 1, p1, 1, "out_dtype");
  moe_param p2[2] = {pstr("format", "mxfp8_e4m3fn"), pstr("element_rounding", "half_up")};
  expect_einval("quant.mx", ok, 1, p2, 2, "element_rounding");
  moe_param p3[1] = {pstr("scale_rule", "nearest")};
  expect_einval("quant.mx", ok, 1, p3, 1, "scale_rule");
  moe_param p4[1] = {pstr("exact_division", "maybe")};
  expect_einval("quant.per_tensor", ok, 1, p4, 1, "exact_division");
  moe_param p5[1] = {pdbl("scale_ub", -1.0)};
  expect_einval("quant.per_token", ok, 1, p5, 1, "scale_ub");
  moe_param p6[1] = {pbool("format", true)};
  expect_einval("quant.mx", ok, 1, p6, 1, "format");
  /* per_token_group: G not dividing K (default 128 too), G < 1, e5m2, unknown rule */
  moe_param g5[1] = {pint("group_size", 5)}, g0[1] = {pint("group_size", 0)};
  expect_einval("quant.per_token_group", ok, 1, g5, 1, "group_size");
  expect_einval("quant.per_token_group", ok, 1, g0, 1, "group_size");
  expect_einval("quant.per_token_group", ok, 1, NULL, 0, "group_size");
  moe_param ge5[2] = {pint("group_size", 8), pstr("out_dtype", "fp8_e5m2")};
  expect_einval("quant.per_token_group", ok, 1, ge5, 2, "out_dtype");
  moe_param gr[2] = {pint("group_size", 8), pstr("scale_rule", "even")};
  expect_einval("quant.per_token_group", ok, 1, gr, 2, "scale_rule");
  /* unknown and missing inputs */
  moe_named_tensor unknown[2] = {ok[0], tensor("y", MOE_F32, x, 4, 1, s1)};
  expect_einval("quant.per_token", unknown, 2, NULL, 0, "y");
  expect_einval("dequant.per_tensor", ok, 0, NULL, 0, "q");
  /* dequant.mx: scales shape not matching q */
  moe_named_tensor mismatch[2] = {tensor("q", MOE_UINT8, h, 64, 1, s64),
                                  tensor("scales", MOE_UINT8, h, 1, 1, s1)};
  moe_param fp8[1] = {pstr("format", "mxfp8_e5m2")};
  expect_einval("dequant.mx", mismatch, 2, fp8, 1, "scales");
}
END_TEST

START_TEST(unknown_op_is_not_found) {
  moe_named_tensor *out = NULL;
  size_t n = 0;
  moe_error err;
  ck_assert_int_eq(run("quant.nope", NULL, 0, NULL, 0, &out, &n, &err), MOE_ENOTFOUND);
  ck_assert_ptr_nonnull(strstr(err.msg, "quant.nope"));
}
END_TEST

/* ---- large calls ----------------------------------------------------------------- */

/* A large call (several work items per thread, the dynamic per_tensor's
 * two passes over per-thread ranges) must give the same bytes as its row
 * slices, each a small call. bf16 values over a few octaves, with NaN, inf,
 * zeros and subnormals mixed in; K = 1000 puts per-token rows at unaligned
 * output offsets. */
static uint16_t *big_bf16(size_t n) {
  uint16_t *x = malloc(n * 2);
  ck_assert_ptr_nonnull(x);
  uint64_t z = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < n; i++) {
    z ^= z << 13, z ^= z >> 7, z ^= z << 17;
    uint16_t h = (uint16_t)(((z >> 20) & 0x8000u) | ((120u + (z >> 40) % 14u) << 7) | (z & 0x7Fu));
    if ((z >> 50) % 4096 == 0) {
      static const uint16_t special[6] = {0x7FC0, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0005};
      h = special[(z >> 8) % 6];
    }
    x[i] = h;
  }
  return x;
}

static void check_slices(const char *op, uint16_t *x, int64_t m, int64_t k, moe_param *p, size_t np,
                         const float *static_scale) {
  enum { SLICE = 256 }; /* rows per small call */
  int64_t shape[2] = {m, k}, one[1] = {1};
  float sc = static_scale ? *static_scale : 0.0f;
  moe_named_tensor in[2] = {tensor("x", MOE_BF16, x, (size_t)(m * k) * 2, 2, shape),
                            tensor("scale", MOE_F32, &sc, 4, 1, one)};
  size_t nin = static_scale ? 2 : 1;
  moe_named_tensor *whole;
  size_t nw;
  moe_error err;
  ck_assert_int_eq(run(op, in, nin, p, np, &whole, &nw, &err), MOE_OK);
  size_t off[2] = {0, 0};
  for (int64_t r0 = 0; r0 < m; r0 += SLICE) {
    int64_t rows = m - r0 < SLICE ? m - r0 : SLICE;
    int64_t sshape[2] = {rows, k};
    in[0] = tensor("x", MOE_BF16, x + r0 * k, (size_t)(rows * k) * 2, 2, sshape);
    moe_named_tensor *part;
    size_t np2;
    ck_assert_int_eq(run(op, in, nin, p, np, &part, &np2, &err), MOE_OK);
    for (size_t o = 0; o < 2; o++) {
      if (static_scale && o == 1) continue; /* the echoed scale */
      ck_assert_msg(memcmp((const uint8_t *)whole[o].tensor.data + off[o], part[o].tensor.data,
                           part[o].tensor.nbytes) == 0,
                    "%s: output %zu of rows [%lld, %lld) differs from the whole call", op, o, (long long)r0,
                    (long long)(r0 + rows));
      off[o] += part[o].tensor.nbytes;
    }
    moe_outputs_free(part, np2);
  }
  moe_outputs_free(whole, nw);
}

START_TEST(large_calls_match_their_slices) {
  const int64_t m = 4400, k = 1000; /* 4.4 M elements */
  uint16_t *x = big_bf16((size_t)(m * k));
  float s = 0.05f;
  moe_param fp8[1] = {pstr("out_dtype", "fp8_e4m3fn")}, i8[1] = {pstr("out_dtype", "int8")};
  moe_param fnuz_exact[2] = {pstr("out_dtype", "fp8_e4m3fnuz"), pbool("exact_division", true)};
  check_slices("quant.per_tensor", x, m, k, fp8, 1, &s);
  check_slices("quant.per_tensor", x, m, k, i8, 1, &s);
  check_slices("quant.per_tensor", x, m, k, fnuz_exact, 2, &s);
  check_slices("quant.per_token", x, m, k, fp8, 1, NULL);
  check_slices("quant.per_token", x, m, k, i8, 1, NULL);
  moe_param group[2] = {pstr("out_dtype", "fp8_e4m3fn"), pint("group_size", 40)};
  check_slices("quant.per_token_group", x, m, k, group, 2, NULL);
  /* dynamic per_tensor: its scale from the whole call, then the slices with it as a static scale */
  int64_t shape[2] = {m, k};
  moe_named_tensor in[1] = {tensor("x", MOE_BF16, x, (size_t)(m * k) * 2, 2, shape)};
  moe_named_tensor *dyn;
  size_t nd;
  moe_error err;
  ck_assert_int_eq(run("quant.per_tensor", in, 1, fp8, 1, &dyn, &nd, &err), MOE_OK);
  float ds = *(const float *)dyn[1].tensor.data;
  moe_named_tensor st_in[2] = {in[0], tensor("scale", MOE_F32, &ds, 4, 1, (int64_t[1]){1})};
  moe_named_tensor *st;
  size_t ns;
  ck_assert_int_eq(run("quant.per_tensor", st_in, 2, fp8, 1, &st, &ns, &err), MOE_OK);
  ck_assert(memcmp(dyn[0].tensor.data, st[0].tensor.data, dyn[0].tensor.nbytes) == 0);
  moe_outputs_free(st, ns);
  moe_outputs_free(dyn, nd);
  check_slices("quant.per_tensor", x, m, k, fp8, 1, &ds);
  free(x);
  /* quant.mx: K a multiple of 32 */
  const int64_t mm = 1100, kk = 4096;
  x = big_bf16((size_t)(2 * mm * kk));
  moe_param mx8[1] = {pstr("format", "mxfp8_e4m3fn")}, mx4[1] = {pstr("format", "mxfp4")};
  moe_param mx4h[3] = {pstr("format", "mxfp4"), pstr("scale_rule", "amax_up"),
                       pstr("element_rounding", "half_up")};
  check_slices("quant.mx", x, mm, kk, mx8, 1, NULL);
  check_slices("quant.mx", x, mm * 2, kk, mx4, 1, NULL);
  check_slices("quant.mx", x, mm * 2, kk, mx4h, 3, NULL);
  free(x);
}
END_TEST

/* Every 16-bit pattern twice (1 << 17 values): in bit order, then the second
 * copy shuffled (NaN/inf runs, subnormals and magnitudes mixed). */
static uint16_t *every_pattern_twice(void) {
  enum { N = 1 << 17 };
  uint16_t *x = malloc(N * sizeof *x);
  ck_assert_ptr_nonnull(x);
  for (uint32_t i = 0; i < N; i++)
    x[i] = (uint16_t)i;
  uint64_t z = 0x9E3779B97F4A7C15ull;
  for (uint32_t i = N - 1; i > N / 2; i--) { /* Fisher-Yates over the second half */
    z ^= z << 13, z ^= z >> 7, z ^= z << 17;
    uint32_t j = N / 2 + (uint32_t)(z % (i - N / 2 + 1));
    uint16_t t = x[i];
    x[i] = x[j];
    x[j] = t;
  }
  return x;
}

/* quant.mx's AVX-512 and AVX2 fronts (the amaxes, scales and codes of
 * 16-bit input, kernels/cpu/quant_mx.c) give the bytes of its C path (the
 * reference kernels): every fp16 and bf16 pattern, in bit order and shuffled
 * (NaN/inf blocks, subnormals, mixed magnitudes), every scale rule, mxfp8
 * e4m3fn / e5m2 and mxfp4 with both roundings. A front the CPU lacks falls
 * to the next lower one, down to the C path. */
START_TEST(quant_mx_vector_front_matches_c_path) {
  enum { N = 1 << 17 }; /* every pattern twice: bit order, then shuffled */
  uint16_t *x = every_pattern_twice();
  static const char *const formats[3] = {"mxfp8_e4m3fn", "mxfp8_e5m2", "mxfp4"};
  static const char *const rules[4] = {"even", "floor", "amax_up", "amax_down"};
  static const moe_dtype dtypes[2] = {MOE_BF16, MOE_F16};
  /* [512, 256]: whole tiles of 16 blocks; [1, N - 160]: 4091 blocks, so a tile of 11 at the end */
  const int64_t shapes[2][2] = {{N / 256, 256}, {1, N - 160}};
  for (int sh = 0; sh < 2; sh++)
    for (int d = 0; d < 2; d++)
      for (int f = 0; f < 3; f++)
        for (int r = 0; r < 4; r++)
          for (int h = 0; h < (f == 2 ? 2 : 1); h++) {
            const size_t n = (size_t)(shapes[sh][0] * shapes[sh][1]);
            moe_named_tensor in[1] = {tensor("x", dtypes[d], x, n * sizeof *x, 2, shapes[sh])};
            moe_param p[3] = {pstr("format", formats[f]), pstr("scale_rule", rules[r]),
                              pstr("element_rounding", h ? "half_up" : "rne")};
            /* the machine's own front, the AVX2 front (capped), the C path (the reference switch) */
            moe_named_tensor *out[3];
            size_t nout[3];
            moe_error err;
            for (int run_ = 0; run_ < 3; run_++) {
              moe_cpu_set_isa_cap(run_ == 1 ? MOE_CPU_ISA_AVX2 : MOE_CPU_ISA_AVX512_VBMI);
              moe_cpu_set_reference_kernels(run_ == 2);
              ck_assert_int_eq(run("quant.mx", in, 1, p, 3, &out[run_], &nout[run_], &err), MOE_OK);
            }
            moe_cpu_set_reference_kernels(false);
            moe_cpu_set_isa_cap(MOE_CPU_ISA_AVX512_VBMI);
            for (int run_ = 0; run_ < 2; run_++)
              for (size_t o = 0; o < 2; o++)
                ck_assert_msg(
                    memcmp(out[run_][o].tensor.data, out[2][o].tensor.data, out[2][o].tensor.nbytes) == 0,
                    "shape %d %s %s %s %s: output %zu of the %s front differs from the C path", sh,
                    d ? "fp16" : "bf16", formats[f], rules[r], h ? "half_up" : "rne", o,
                    run_ ? "AVX2" : "machine's");
            for (int run_ = 0; run_ < 3; run_++)
              moe_outputs_free(out[run_], nout[run_]);
          }
  free(x);
}
END_TEST

/* Every quant path of a lower dispatch level (moe_cpu_set_isa_cap; the C
 * loops at MOE_CPU_ISA_C) against the machine's own: the scaled ops on every
 * fp16 and bf16 pattern (in bit order, then shuffled: NaN, inf, -0,
 * subnormals, every tie) and on random fp32 bits, at scales that include
 * powers of two, odd values, subnormal ones and ones whose reciprocal
 * overflows, both division modes, fp8 e4m3fn / e4m3fnuz and int8; dynamic
 * per_tensor, per_token (with and without scale_ub) and per_token_group
 * alike (groups of 40 and 200 too: the lane amax's partial vectors; of 32:
 * the encoder's pairs of units). The oracle tests check the machine's own
 * path against the contract; this one ties each lower path to it. On a machine without the higher levels both
 * runs take the same path. The lane encoders' streamed stores (taken only past the last-level cache, cpu.h
 * moe_cpu_stream_codes) are forced on for two more levels, the machine's and AVX2's, against the cached
 * stores of the machine's level; per_token's rows of 1000 put codes of both kinds into one cache line. */
typedef struct level {
  moe_cpu_isa cap;
  bool stream;
} level;

/* Runs op at the machine's level (cached stores) and at `at`; every output byte equal. */
static void expect_same_at_cap(level at, const char *op, moe_named_tensor *in, size_t nin, moe_param *p,
                               size_t np, const char *what) {
  moe_named_tensor *out[2];
  size_t nout[2];
  moe_error err;
  for (int k = 0; k < 2; k++) {
    moe_cpu_set_isa_cap(k ? at.cap : MOE_CPU_ISA_AVX512_VBMI);
    moe_cpu_set_stream_min(k && at.stream ? 1 : SIZE_MAX);
    ck_assert_int_eq(run(op, in, nin, p, np, &out[k], &nout[k], &err), MOE_OK);
  }
  moe_cpu_set_isa_cap(MOE_CPU_ISA_AVX512_VBMI);
  moe_cpu_set_stream_min(0);
  for (size_t o = 0; o < nout[0]; o++)
    ck_assert_msg(memcmp(out[0][o].tensor.data, out[1][o].tensor.data, out[0][o].tensor.nbytes) == 0,
                  "%s %s: output %zu differs at dispatch level %d%s", op, what, o, (int)at.cap,
                  at.stream ? " with streamed stores" : "");
  moe_outputs_free(out[0], nout[0]);
  moe_outputs_free(out[1], nout[1]);
}

START_TEST(scaled_quant_lower_levels_match) {
  enum { N = 1 << 17 };
  uint16_t *x16 = every_pattern_twice();
  uint32_t *x32 = malloc(N * sizeof *x32);
  ck_assert_ptr_nonnull(x32);
  uint64_t z = 0x2545F4914F6CDD1Dull;
  for (uint32_t i = 0; i < N; i++) {
    z ^= z << 13, z ^= z >> 7, z ^= z << 17;
    x32[i] = (uint32_t)(z >> 16);
  }
  static const float scales[] = {
      1.0f,   0.5f,   2.0f,        0.05f,     0.1f,       1.0f / 3,         448.0f / 240,
      7.0f,   1e-3f,  1e-20f,      1e-30f,    1e20f,      3.4e38f,          1e-38f,
      1e-40f, 1e-45f, 0.3f,        123.456f,  1.0f / 448, 1.0f / 127,       65504.0f / 448,
      1e-7f,  6e-8f,  0x1.8p-120f, 0x1p-100f, 0x1p100f,   0x1.fffffep+127f, 0x1p-126f};
  static const char *const dtypes[3] = {"fp8_e4m3fn", "fp8_e4m3fnuz", "int8"};
  const moe_dtype xts[3] = {MOE_BF16, MOE_F16, MOE_F32};
  static const level levels[] = {{MOE_CPU_ISA_C, false},
                                 {MOE_CPU_ISA_AVX2, false},
                                 {MOE_CPU_ISA_AVX2, true},
                                 {MOE_CPU_ISA_AVX512_VBMI, true}};
  for (size_t l = 0; l < sizeof levels / sizeof levels[0]; l++)
    for (int d = 0; d < 3; d++) {
      const level cap = levels[l];
      const void *x = xts[d] == MOE_F32 ? (const void *)x32 : (const void *)x16;
      const size_t es = xts[d] == MOE_F32 ? 4 : 2;
      int64_t shape[2] = {N / 1024, 1024}, one[1] = {1};
      for (int o = 0; o < 3; o++)
        for (int exact = 0; exact < 2; exact++) {
          moe_param p[4] = {pstr("out_dtype", dtypes[o]), pbool("exact_division", exact)};
          char what[96];
          for (size_t k = 0; k < sizeof scales / sizeof scales[0]; k++) {
            float sc = scales[k];
            moe_named_tensor in[2] = {tensor("x", xts[d], (void *)x, N * es, 2, shape),
                                      tensor("scale", MOE_F32, &sc, 4, 1, one)};
            snprintf(what, sizeof what, "x dtype %d %s exact %d scale %a", (int)xts[d], dtypes[o], exact, sc);
            expect_same_at_cap(cap, "quant.per_tensor", in, 2, p, 2, what);
          }
          moe_named_tensor in[1] = {tensor("x", xts[d], (void *)x, N * es, 2, shape)};
          snprintf(what, sizeof what, "x dtype %d %s exact %d", (int)xts[d], dtypes[o], exact);
          expect_same_at_cap(cap, "quant.per_tensor", in, 1, p, 2, what);
          expect_same_at_cap(cap, "quant.per_token", in, 1, p, 2, what);
          p[2] = pdbl("scale_ub", 3.0);
          expect_same_at_cap(cap, "quant.per_token", in, 1, p, 3, what);
          for (int g = 64; g <= 256; g *= 2) {
            p[2] = pint("group_size", g);
            expect_same_at_cap(cap, "quant.per_token_group", in, 1, p, 3, what);
            p[3] = pstr("scale_rule", "pow2_up");
            expect_same_at_cap(cap, "quant.per_token_group", in, 1, p, 4, what);
          }
          /* rows of a length that leaves a tail past the last 64-element step */
          int64_t odd[2] = {N / 1000, 1000};
          moe_named_tensor tail[1] = {tensor("x", xts[d], (void *)x, (size_t)(odd[0] * odd[1]) * es, 2, odd)};
          expect_same_at_cap(cap, "quant.per_token", tail, 1, p, 2, what);
          /* groups that are not a multiple of 32 (the lane amax's masked tail) nor of 64 */
          for (int g = 40; g <= 200; g += 160) {
            p[2] = pint("group_size", g);
            expect_same_at_cap(cap, "quant.per_token_group", tail, 1, p, 3, what);
          }
          /* groups of 32 (the AVX-512 encoder's pairs: 4095 groups, so batches of 64 and a last
           * one of 63), and a per_tensor call whose last chunk holds 32 elements */
          int64_t g32[2] = {1, 32 * 4095}, last32[2] = {1, 16384 * 7 + 32};
          moe_named_tensor by32[1] = {tensor("x", xts[d], (void *)x, (size_t)(32 * 4095) * es, 2, g32)};
          p[2] = pint("group_size", 32);
          expect_same_at_cap(cap, "quant.per_token_group", by32, 1, p, 3, what);
          moe_named_tensor chunk32[1] = {tensor("x", xts[d], (void *)x, (size_t)last32[1] * es, 2, last32)};
          expect_same_at_cap(cap, "quant.per_tensor", chunk32, 1, p, 2, what);
        }
    }
  free(x32);
  free(x16);
}
END_TEST

int main(void) {
  Suite *s = suite_create("quant_ops");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, fp4_ties_follow_rne);
  tcase_add_test(tc, half_up_rounds_ties_away);
  tcase_add_test(tc, nan_block_gets_nan_scale);
  tcase_add_test(tc, per_tensor_saturates_and_maps_nan);
  tcase_add_test(tc, dynamic_scale_is_amax_over_finite);
  tcase_add_test(tc, per_token_scale_ub_caps_amax);
  tcase_add_test(tc, per_token_group_scales_and_pow2_up);
  tcase_add_test(tc, dequant_mx_nan_scale_and_fp4_nibbles);
  tcase_add_test(tc, quant_mx_vector_front_matches_c_path);
  tcase_add_test(tc, scaled_quant_lower_levels_match);
  tcase_add_test(tc, dequant_per_tensor_rounds_to_out_dtype);
  tcase_add_test(tc, dequant_vector_matches_c_path);
  tcase_add_test(tc, bad_inputs_are_named);
  tcase_add_test(tc, unknown_op_is_not_found);
  tcase_add_test(tc, large_calls_match_their_slices);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
