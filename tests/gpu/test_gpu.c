/* The GPU backend against the CPU backend (issue: GPU backend; NUMERICS.md
 * "Tolerances"): every quant op run on both backends on the same inputs,
 * outputs poisoned (differently on each side) before each run, every output
 * byte compared. Exhaustive over the fp16 and bf16 bit patterns x >= 300
 * scales; random fp32 bits; tails, odd shapes and misaligned buffers (the
 * kernels' scalar paths).
 *
 * No GPU (CI): prints "skipped: no GPU" and passes.
 * MOE_GPU_TEST_QUICK=1: a handful of scales per case (for compute-sanitizer). */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/backend.h"
#include "moe/codec.h"
#include "moe/ops.h"

static moe_backend *cpu, *gpu;
static int quick;
static unsigned long long runs, bytes_compared;

/* ---- helpers ---------------------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rng_state = x;
}

static moe_tensor tensor2(moe_dtype dt, int64_t r, int64_t c, void *data) {
  moe_tensor t = {.dtype = dt, .ndim = 2, .shape = {r, c}, .data = data};
  ck_assert(moe_tensor_bytes(&t, &t.nbytes) == MOE_OK);
  return t;
}

static moe_param pstr(const char *name, const char *v) { return (moe_param){.name = name, .type = MOE_PARAM_STRING, .s = v}; }
static moe_param pbool(const char *name, bool v) { return (moe_param){.name = name, .type = MOE_PARAM_BOOL, .b = v}; }
static moe_param pdbl(const char *name, double v) { return (moe_param){.name = name, .type = MOE_PARAM_DOUBLE, .d = v}; }

/* Runs `op` on the CPU and the GPU backend with the same host inputs and
 * compares every output byte. Device buffers start `misalign` bytes past a
 * pool block (0: aligned). */
static void check_op(const char *op, const moe_named_tensor *in, size_t nin, const moe_param *params, size_t np,
                     size_t misalign, const char *label) {
  moe_params P = {params, np};
  moe_call *c = NULL;
  moe_error err = {{0}};
  moe_status s = moe_op_prepare(moe_op_find(op), in, nin, &P, NULL, &c, &err);
  ck_assert_msg(s == MOE_OK, "%s: prepare: %s", label, err.msg);
  size_t no = moe_call_num_outputs(c), ni = moe_call_num_inputs(c);
  void *ref[8] = {0}, *got[8] = {0}, *dout[8] = {0}, *din[12] = {0};
  ck_assert(no <= 8 && ni <= 12);
  for (size_t i = 0; i < no; i++) {
    moe_named_tensor *o = moe_call_output(c, i);
    ref[i] = malloc(o->tensor.nbytes + 1);
    got[i] = malloc(o->tensor.nbytes + 1);
    ck_assert(ref[i] && got[i]);
    memset(ref[i], 0xA5, o->tensor.nbytes);
    o->tensor.data = ref[i];
  }
  s = moe_call_run(c, cpu, &err);
  ck_assert_msg(s == MOE_OK, "%s: cpu run: %s", label, err.msg);

  /* the same call on the GPU: inputs and outputs rebound to device memory */
  for (size_t j = 0; j < ni; j++) {
    moe_tensor *t = &moe_call_input(c, j)->tensor;
    if (!t->data) continue;
    ck_assert(gpu->iface->alloc(gpu, t->nbytes + misalign, &din[j]) == MOE_OK);
    void *d = (char *)din[j] + misalign;
    ck_assert(gpu->iface->copy_in(gpu, d, t->data, t->nbytes) == MOE_OK);
    t->data = d;
  }
  static unsigned poison_round;
  static const uint8_t poisons[] = {0x5A, 0xC3, 0x96, 0x3C, 0xFF, 0x00};
  uint8_t poison = poisons[poison_round++ % sizeof poisons];
  for (size_t i = 0; i < no; i++) {
    moe_named_tensor *o = moe_call_output(c, i);
    size_t n = o->tensor.nbytes;
    ck_assert(gpu->iface->alloc(gpu, n + misalign, &dout[i]) == MOE_OK);
    void *d = (char *)dout[i] + misalign;
    memset(got[i], poison, n);
    ck_assert(gpu->iface->copy_in(gpu, d, got[i], n) == MOE_OK);
    o->tensor.data = d;
  }
  s = moe_call_run(c, gpu, &err);
  ck_assert_msg(s == MOE_OK, "%s: gpu run: %s", label, err.msg);
  ck_assert_msg(gpu->iface->synchronize(gpu) == MOE_OK, "%s: gpu synchronize failed", label);
  for (size_t i = 0; i < no; i++) {
    moe_named_tensor *o = moe_call_output(c, i);
    size_t n = o->tensor.nbytes;
    ck_assert(gpu->iface->copy_out(gpu, got[i], o->tensor.data, n) == MOE_OK);
    if (memcmp(ref[i], got[i], n) != 0) {
      size_t k = 0;
      while (((uint8_t *)ref[i])[k] == ((uint8_t *)got[i])[k]) k++;
      size_t nbad = 0;
      for (size_t m = k; m < n; m++) nbad += ((uint8_t *)ref[i])[m] != ((uint8_t *)got[i])[m];
      ck_abort_msg("%s: output '%s' differs at byte %zu of %zu (cpu 0x%02x, gpu 0x%02x; %zu bytes differ)", label,
                   o->name, k, n, ((uint8_t *)ref[i])[k], ((uint8_t *)got[i])[k], nbad);
    }
    bytes_compared += n;
  }
  runs++;
  for (size_t i = 0; i < no; i++) {
    gpu->iface->free(gpu, dout[i]);
    free(ref[i]);
    free(got[i]);
  }
  for (size_t j = 0; j < ni; j++) gpu->iface->free(gpu, din[j]);
  moe_call_destroy(c);
}

/* Every 16-bit pattern, in order. */
static uint16_t *all_patterns(void) {
  uint16_t *p = malloc(65536 * sizeof *p);
  for (uint32_t i = 0; i < 65536; i++) p[i] = (uint16_t)i;
  return p;
}

static void shuffle16(uint16_t *p, size_t n) {
  for (size_t i = n - 1; i > 0; i--) {
    size_t j = rng() % (i + 1);
    uint16_t t = p[i];
    p[i] = p[j];
    p[j] = t;
  }
}

static float widen(moe_dtype dt, uint16_t h) { return dt == MOE_BF16 ? moe_bf16_to_f32(h) : moe_f16_to_f32(h); }

/* >= 300 finite positive scales: every 3rd power of two over the whole fp32
 * range (subnormals included), the format maxima and their reciprocals,
 * FLT_MIN/MAX neighbours, and log-uniform random values. */
static size_t make_scales(float *s, size_t cap) {
  size_t n = 0;
  for (int e = -149; e <= 127 && n < cap; e += 3) s[n++] = moe_pow2f(e);
  const float special[] = {1.0f, 448.0f, 240.0f, 127.0f, 57344.0f, 6.0f, 1.0f / 448.0f, 1.0f / 240.0f,
                           1.0f / 127.0f, 1.0f / 6.0f, 0.1f, 0.3f, 3.0f, 1e-3f, 1e3f, 1.1754942e-38f,
                           1.1754944e-38f, 1.4e-45f, 2.8e-45f, 3.4028235e38f, 3.0e38f, 65504.0f, 1.0f / 65504.0f,
                           0.999999940f, 1.00000012f};
  for (size_t i = 0; i < sizeof special / sizeof special[0] && n < cap; i++) s[n++] = special[i];
  while (n < cap) {
    uint32_t bits = (uint32_t)(rng() % 0x7F7FFFFFu) + 1u; /* finite, > 0 */
    s[n++] = moe_f32_from_bits(bits);
  }
  return n;
}

#define NSCALES 320
static float scales[NSCALES];
static size_t nscales_used(void) { return quick ? 6 : NSCALES; }

static const char *const scaled_out[] = {"fp8_e4m3fn", "fp8_e4m3fnuz", "int8"};
static const moe_dtype half_types[] = {MOE_BF16, MOE_F16};

/* ---- quant.per_tensor ------------------------------------------------------------ */

START_TEST(per_tensor_static_exhaustive) {
  uint16_t *x = all_patterns();
  char label[160];
  for (int d = 0; d < 2; d++) {
    for (size_t si = 0; si < nscales_used(); si++) {
      float s = scales[si];
      moe_named_tensor in[2] = {{"x", tensor2(half_types[d], 256, 256, x)}, {"scale", tensor2(MOE_F32, 1, 1, &s)}};
      in[1].tensor.ndim = 1;
      for (int o = 0; o < 3; o++)
        for (int ex = 0; ex < 2; ex++) {
          moe_param p[2] = {pstr("out_dtype", scaled_out[o]), pbool("exact_division", ex)};
          snprintf(label, sizeof label, "per_tensor static %s s=%a %s exact=%d", moe_dtype_name(half_types[d]),
                   (double)s, scaled_out[o], ex);
          check_op("quant.per_tensor", in, 2, p, 2, 0, label);
        }
    }
  }
  free(x);
}
END_TEST

/* Patterns with magnitudes above `lim` folded below it, so the dynamic amax
 * moves over the whole range; NaN and inf stay (they are not in the amax). */
static void fold_patterns(moe_dtype dt, uint16_t *dst, const uint16_t *src, uint16_t lim) {
  uint16_t expmask = dt == MOE_BF16 ? 0x7F80 : 0x7C00;
  for (size_t i = 0; i < 65536; i++) {
    uint16_t mag = src[i] & 0x7FFF;
    bool special = (mag & expmask) == expmask;
    if (!special && mag > lim) mag = (uint16_t)(mag % (lim + 1u));
    dst[i] = (uint16_t)((src[i] & 0x8000) | mag);
  }
}

START_TEST(per_tensor_dynamic) {
  uint16_t *x = all_patterns(), *y = malloc(65536 * 2);
  char label[160];
  int steps = quick ? 4 : 96;
  for (int d = 0; d < 2; d++) {
    uint16_t maxfin = half_types[d] == MOE_BF16 ? 0x7F7F : 0x7BFF;
    for (int k = 0; k <= steps; k++) {
      uint16_t lim = (uint16_t)((uint32_t)maxfin * (uint32_t)k / (uint32_t)steps);
      fold_patterns(half_types[d], y, x, lim);
      if (k & 1) shuffle16(y, 65536);
      moe_named_tensor in[1] = {{"x", tensor2(half_types[d], 64, 1024, y)}};
      for (int o = 0; o < 3; o++)
        for (int ex = 0; ex < 2; ex++) {
          moe_param p[2] = {pstr("out_dtype", scaled_out[o]), pbool("exact_division", ex)};
          snprintf(label, sizeof label, "per_tensor dynamic %s lim=0x%04x %s exact=%d",
                   moe_dtype_name(half_types[d]), lim, scaled_out[o], ex);
          check_op("quant.per_tensor", in, 1, p, 2, (k % 5 == 4) ? 4 : 0, label);
        }
    }
  }
  /* all zeros (s = 1), all NaN/inf (no finite element: s = 1), odd lengths */
  memset(y, 0, 65536 * 2);
  for (int i = 0; i < 100; i++) y[i] = (uint16_t)(i & 1 ? 0x7FC0 : 0xFF80);
  size_t lens[] = {1, 7, 100, 4097, 65536};
  for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
    for (int o = 0; o < 3; o++) {
      moe_named_tensor in[1] = {{"x", tensor2(MOE_BF16, 1, (int64_t)lens[li], y)}};
      moe_param p[1] = {pstr("out_dtype", scaled_out[o])};
      snprintf(label, sizeof label, "per_tensor dynamic zeros/nan n=%zu %s", lens[li], scaled_out[o]);
      check_op("quant.per_tensor", in, 1, p, 1, 0, label);
    }
  free(x);
  free(y);
}
END_TEST

START_TEST(per_tensor_random_f32) {
  size_t n = quick ? (1u << 16) + 3 : (3u << 20) + 5; /* many blocks of partial maxima; a tail */
  uint32_t *x = malloc(n * 4);
  char label[160];
  for (int round = 0; round < (quick ? 1 : 4); round++) {
    for (size_t i = 0; i < n; i++) {
      uint32_t r = (uint32_t)rng();
      /* mostly moderate exponents, some anything (NaN, inf, subnormal) */
      x[i] = (i % 17) ? (r & 0x807FFFFFu) | ((100u + (r >> 24) % 56u) << 23) : r;
    }
    for (int o = 0; o < 3; o++)
      for (int ex = 0; ex < 2; ex++)
        for (int st = 0; st < 2; st++) {
          float s = scales[(size_t)(round * 7 + o) % nscales_used()];
          moe_named_tensor in[2] = {{"x", tensor2(MOE_F32, 1, (int64_t)n, x)}, {"scale", tensor2(MOE_F32, 1, 1, &s)}};
          in[1].tensor.ndim = 1;
          moe_param p[2] = {pstr("out_dtype", scaled_out[o]), pbool("exact_division", ex)};
          snprintf(label, sizeof label, "per_tensor f32 random round %d %s exact=%d static=%d", round, scaled_out[o],
                   ex, st);
          check_op("quant.per_tensor", in, st ? 2 : 1, p, 2, round == 1 ? 4 : 0, label);
        }
  }
  free(x);
}
END_TEST

/* ---- quant.per_token ----------------------------------------------------------- */

START_TEST(per_token_exhaustive) {
  uint16_t *x = all_patterns(), *y = malloc(65536 * 2);
  char label[160];
  const int64_t shapes[][2] = {{512, 128}, {64, 1024}, {8, 8192}, {655, 100}, {7, 9360}};
  const double ubs[] = {0.0 /* none */, 1e-3, 1.0, 300.0, 3e38};
  for (int d = 0; d < 2; d++)
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
      for (int shuf = 0; shuf < 2; shuf++) {
        memcpy(y, x, 65536 * 2);
        if (shuf) shuffle16(y, 65536);
        for (size_t u = 0; u < (quick ? 2 : sizeof ubs / sizeof ubs[0]); u++)
          for (int o = 0; o < 3; o++) {
            moe_named_tensor in[1] = {{"x", tensor2(half_types[d], shapes[si][0], shapes[si][1], y)}};
            moe_param p[2] = {pstr("out_dtype", scaled_out[o]), pdbl("scale_ub", ubs[u])};
            snprintf(label, sizeof label, "per_token %s [%lld,%lld] shuffled=%d ub=%g %s",
                     moe_dtype_name(half_types[d]), (long long)shapes[si][0], (long long)shapes[si][1], shuf, ubs[u],
                     scaled_out[o]);
            check_op("quant.per_token", in, 1, p, u ? 2 : 1, (si == 1 && shuf) ? 4 : 0, label);
          }
      }
  /* per-row amax spread over many scales: row r of x scaled by scales[r] */
  size_t rows = nscales_used(), k = 7168;
  float *xf = malloc(rows * k * 4);
  for (size_t r = 0; r < rows; r++)
    for (size_t j = 0; j < k; j++) xf[r * k + j] = widen(MOE_BF16, x[(r * k + j * 9) & 0xFFFF]) * scales[r];
  for (int o = 0; o < 3; o++) {
    moe_named_tensor in[1] = {{"x", tensor2(MOE_F32, (int64_t)rows, (int64_t)k, xf)}};
    moe_param p[1] = {pstr("out_dtype", scaled_out[o])};
    snprintf(label, sizeof label, "per_token f32 scaled rows x 7168 %s", scaled_out[o]);
    check_op("quant.per_token", in, 1, p, 1, 0, label);
  }
  free(xf);
  free(x);
  free(y);
}
END_TEST

/* ---- quant.mx ------------------------------------------------------------------ */

static const char *const mx_formats[] = {"mxfp4", "mxfp8_e4m3fn", "mxfp8_e5m2"};
static const char *const mx_rules[] = {"even", "floor", "amax_up", "amax_down"};

static void mx_all_variants(const moe_named_tensor *in, size_t misalign, const char *what) {
  char label[200];
  for (int f = 0; f < 3; f++)
    for (int r = 0; r < 4; r++)
      for (int h = 0; h < (f == 0 ? 2 : 1); h++) {
        moe_param p[3] = {pstr("format", mx_formats[f]), pstr("scale_rule", mx_rules[r]),
                          pstr("element_rounding", h ? "half_up" : "rne")};
        snprintf(label, sizeof label, "quant.mx %s %s %s %s", what, mx_formats[f], mx_rules[r], h ? "half_up" : "rne");
        check_op("quant.mx", in, 1, p, 3, misalign, label);
      }
}

START_TEST(mx_exhaustive) {
  uint16_t *x = all_patterns(), *y = malloc(65536 * 2);
  float *xf = malloc(65536 * 4);
  char what[96];
  for (int d = 0; d < 2; d++) {
    /* the patterns themselves: in order (each block a run of neighbours) and shuffled */
    for (int shuf = 0; shuf < 2; shuf++) {
      memcpy(y, x, 65536 * 2);
      if (shuf) shuffle16(y, 65536);
      moe_named_tensor in[1] = {{"x", tensor2(half_types[d], 256, 256, y)}};
      snprintf(what, sizeof what, "%s patterns shuffled=%d", moe_dtype_name(half_types[d]), shuf);
      mx_all_variants(in, shuf ? 4 : 0, what);
    }
    /* x 300+ scales: fp32 products cover every block exponent and the
     * saturating / subnormal ends of each format */
    for (size_t si = 0; si < nscales_used(); si++) {
      memcpy(y, x, 65536 * 2);
      if (si & 1) shuffle16(y, 65536);
      for (size_t i = 0; i < 65536; i++) xf[i] = widen(half_types[d], y[i]) * scales[si];
      moe_named_tensor in[1] = {{"x", tensor2(MOE_F32, 2048, 32, xf)}};
      snprintf(what, sizeof what, "%s patterns x %a", moe_dtype_name(half_types[d]), (double)scales[si]);
      mx_all_variants(in, 0, what);
    }
  }
  free(x);
  free(y);
  free(xf);
}
END_TEST

/* ---- dequant --------------------------------------------------------------------- */

static const char *const float_out[] = {"fp32", "fp16", "bf16"};

START_TEST(dequant_per_tensor_exhaustive) {
  uint8_t *q = malloc(4096 + 3);
  for (size_t i = 0; i < 4096 + 3; i++) q[i] = (uint8_t)(i * 7 + (i >> 8));
  char label[160];
  for (size_t si = 0; si < nscales_used(); si++)
    for (int t = 0; t < 3; t++)
      for (int o = 0; o < 3; o++) {
        float s = scales[si];
        size_t n = (si % 3 == 0) ? 4096 + 3 : 4096;
        moe_named_tensor in[2] = {{"q", tensor2(t == 2 ? MOE_INT8 : MOE_UINT8, 1, (int64_t)n, q)},
                                  {"scale", tensor2(MOE_F32, 1, 1, &s)}};
        in[1].tensor.ndim = 1;
        moe_param p[2] = {pstr("in_dtype", scaled_out[t]), pstr("out_dtype", float_out[o])};
        snprintf(label, sizeof label, "dequant.per_tensor %s -> %s s=%a n=%zu", scaled_out[t], float_out[o], (double)s,
                 n);
        check_op("dequant.per_tensor", in, 2, p, 2, (si % 5 == 1) ? 4 : 0, label);
      }
  free(q);
}
END_TEST

START_TEST(dequant_mx_exhaustive) {
  /* every code with every scale byte: fp8 block i has scale i / 8 and codes
   * 32 (i % 8) ..; fp4 block i has scale i / 16 and bytes 16 (i % 16) .. */
  uint8_t *q = malloc(65536), *sc = malloc(4096);
  for (size_t i = 0; i < 65536; i++) q[i] = (uint8_t)i;
  char label[160];
  for (int f = 0; f < 3; f++) {
    bool fp4 = f == 0;
    int64_t blocks = fp4 ? 4096 : 2048;
    for (int64_t b = 0; b < blocks; b++) sc[b] = (uint8_t)(fp4 ? b / 16 : b / 8);
    for (int o = 0; o < 3; o++)
      for (int mis = 0; mis < 2; mis++) {
        moe_named_tensor in[2] = {{"q", tensor2(MOE_UINT8, blocks, fp4 ? 16 : 32, q)},
                                  {"scales", tensor2(MOE_UINT8, blocks, 1, sc)}};
        moe_param p[2] = {pstr("format", mx_formats[f]), pstr("out_dtype", float_out[o])};
        snprintf(label, sizeof label, "dequant.mx %s -> %s misaligned=%d", mx_formats[f], float_out[o], mis);
        check_op("dequant.mx", in, 2, p, 2, mis ? 4 : 0, label);
      }
  }
  free(q);
  free(sc);
}
END_TEST

/* ---- runner ---------------------------------------------------------------------- */

int main(void) {
  const char *why = NULL;
  int n = moe_backend_gpu_count(&why);
  if (n <= 0) {
    printf("skipped: no GPU (%s)\n", why ? why : "");
    return 0;
  }
  const char *qe = getenv("MOE_GPU_TEST_QUICK");
  quick = qe && *qe && strcmp(qe, "0") != 0;
  moe_error err = {{0}};
  if (moe_backend_cpu_create(0, &cpu, &err) != MOE_OK || moe_backend_gpu_create(0, &gpu, &err) != MOE_OK) {
    fprintf(stderr, "backend: %s\n", err.msg);
    return 1;
  }
  printf("gpu: %s; cpu: %s; %s\n", gpu->name, cpu->name, quick ? "quick" : "full");
  make_scales(scales, NSCALES);

  Suite *s = suite_create("gpu");
  TCase *tc = tcase_create("quant");
  tcase_set_timeout(tc, 3600);
  tcase_add_test(tc, per_tensor_static_exhaustive);
  tcase_add_test(tc, per_tensor_dynamic);
  tcase_add_test(tc, per_tensor_random_f32);
  tcase_add_test(tc, per_token_exhaustive);
  tcase_add_test(tc, mx_exhaustive);
  tcase_add_test(tc, dequant_per_tensor_exhaustive);
  tcase_add_test(tc, dequant_mx_exhaustive);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_set_fork_status(sr, CK_NOFORK); /* the device context lives in this process */
  srunner_run_all(sr, CK_VERBOSE);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  printf("gpu vs cpu: %llu op runs compared, %llu output bytes, all bit-identical unless reported above\n", runs,
         bytes_compared);
  moe_backend_destroy(gpu);
  moe_backend_destroy(cpu);
  return failed ? 1 : 0;
}
