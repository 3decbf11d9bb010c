/* moe/codec.h against independent references over every input pattern:
 * fp16 <-> fp32 against the CPU's own conversion instructions (F16C), bf16
 * rounding against nearest-of-two-candidates in double precision. These
 * conversions carry every fp16/bf16 result of every op (docs/numerics.md
 * "Common"). The quant encoders (fp32 -> int8 over every pattern; fp32 ->
 * fp8/fp4 over a prime stride plus every grid point and midpoint with their
 * neighbours) against references written from docs/numerics.md "Narrow
 * formats". Sanitizer builds walk a prime stride instead of all 2^32. */
#include <check.h>
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "moe/codec.h"

#if defined(__SANITIZE_ADDRESS__) || defined(MOE_SLOW_BUILD)
#define STRIDE 4099u
#else
#define STRIDE 1u
#endif

__attribute__((target("f16c"))) static uint16_t hw_f32_to_f16(float f) {
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
__attribute__((target("f16c"))) static float hw_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

START_TEST(f16_to_f32_every_pattern) {
  if (!__builtin_cpu_supports("f16c")) {
    printf("skipped: this CPU has no F16C to compare against\n");
    return;
  }
  for (uint32_t h = 0; h < 65536; h++) {
    uint32_t want = moe_f32_bits(hw_f16_to_f32((uint16_t)h)), got = moe_f32_bits(moe_f16_to_f32((uint16_t)h));
    ck_assert_msg(want == got, "f16 0x%04x: hw 0x%08x, codec 0x%08x", h, want, got);
  }
}
END_TEST

START_TEST(f32_to_f16_every_pattern) {
  if (!__builtin_cpu_supports("f16c")) {
    printf("skipped: this CPU has no F16C to compare against\n");
    return;
  }
  uint64_t checked = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += STRIDE) {
    float f = moe_f32_from_bits((uint32_t)u);
    uint16_t got = moe_f32_to_f16(f);
    /* docs/numerics.md: NaN -> the canonical 0x7E00 (hardware keeps payloads) */
    uint16_t want = isnan(f) ? 0x7E00 : hw_f32_to_f16(f);
    if (want != got) ck_abort_msg("f32 0x%08x: want 0x%04x, codec 0x%04x", (uint32_t)u, want, got);
    checked++;
  }
  printf("f32 -> f16: %llu patterns match F16C\n", (unsigned long long)checked);
}
END_TEST

/* bf16 reference: of the two bf16 values around x, the nearer in double;
 * ties to the even code; beyond the largest finite, past the halfway point,
 * inf. */
static uint16_t ref_bf16(float f) {
  uint32_t u = moe_f32_bits(f);
  if (isnan(f)) return 0x7FC0;
  if (isinf(f)) return (uint16_t)(u >> 16);
  uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1); /* toward zero, away from zero */
  double x = fabs((double)f), a = fabs((double)moe_bf16_to_f32(lo));
  double b = (hi & 0x7FFF) == 0x7F80 ? ldexp(1.0, 128) : fabs((double)moe_bf16_to_f32(hi));
  if (x - a < b - x) return lo;
  if (x - a > b - x) return hi;
  return (lo & 1) ? hi : lo;
}

START_TEST(f32_to_bf16_every_pattern) {
  uint64_t checked = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += STRIDE * 7u) {
    float f = moe_f32_from_bits((uint32_t)u);
    uint16_t want = ref_bf16(f), got = moe_f32_to_bf16(f);
    if (want != got) ck_abort_msg("f32 0x%08x: want 0x%04x, codec 0x%04x", (uint32_t)u, want, got);
    checked++;
  }
  printf("f32 -> bf16: %llu patterns match the double reference\n", (unsigned long long)checked);
}
END_TEST

/* The branch-free e4m3fn decoder (fused_moe's fp8 weights) against the
 * generic narrow decoder, bit for bit, on all 256 codes (NaN codes: NaN). */
START_TEST(e4m3fn_fast_decode_every_code) {
  static const moe_narrow_fmt e4m3 = MOE_FMT_E4M3FN;
  for (int c = 0; c < 256; c++) {
    const float want = moe_narrow_to_f32((uint8_t)c, &e4m3), got = moe_e4m3fn_to_f32((uint8_t)c);
    if (moe_f32_isnan(want))
      ck_assert_msg(moe_f32_isnan(got), "code %#x: %a, want NaN", c, (double)got);
    else
      ck_assert_msg(moe_f32_bits(got) == moe_f32_bits(want), "code %#x: %a, want %a", c, (double)got,
                    (double)want);
  }
}
END_TEST

/* int8 reference (docs/numerics.md "fp32 to int8"): RNE in double, clamp,
 * NaN -> 0. */
static int8_t ref_int8(float f) {
  if (isnan(f)) return 0;
  double r = nearbyint((double)f); /* the default rounding mode: to nearest, ties to even */
  return (int8_t)(r > 127.0 ? 127 : r < -128.0 ? -128 : (int)r);
}

START_TEST(f32_to_int8_every_pattern) {
  uint64_t checked = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += STRIDE) {
    float f = moe_f32_from_bits((uint32_t)u);
    int8_t want = ref_int8(f), got = moe_f32_to_int8(f);
    if (want != got) ck_abort_msg("f32 0x%08x: want %d, codec %d", (uint32_t)u, want, got);
    checked++;
  }
  printf("f32 -> int8: %llu patterns match the double reference\n", (unsigned long long)checked);
}
END_TEST

/* Narrow reference (docs/numerics.md "fp32 to fp8", "fp32 to fp4 e2m1"): the
 * format's finite non-negative values, decoded by moe_narrow_to_f32, indexed
 * by magnitude code; |f| goes to the nearer of its two neighbours in double,
 * a tie to the even code (or the larger with half_up), above the largest
 * finite value to it; the sign bit kept unless the format has no -0. */
typedef struct narrow_ref {
  moe_narrow_fmt fmt;
  double value[128];
  int count; /* magnitude codes 0 .. count - 1 */
} narrow_ref;

static void narrow_ref_init(narrow_ref *r, moe_narrow_fmt fmt) {
  r->fmt = fmt;
  r->count = fmt.max_mag + 1;
  for (int c = 0; c < r->count; c++)
    r->value[c] = (double)moe_narrow_to_f32((uint8_t)c, &fmt);
}

static uint8_t ref_narrow(const narrow_ref *r, float f, bool half_up) {
  if (isnan(f)) return r->fmt.nan_code < 0 ? 0 : (uint8_t)r->fmt.nan_code;
  double x = fabs((double)f);
  int lo = 0, hi = r->count - 1; /* largest code with value <= x */
  if (x >= r->value[hi]) {
    lo = hi;
  } else {
    while (hi - lo > 1) {
      int mid = (lo + hi) / 2;
      if (r->value[mid] <= x)
        lo = mid;
      else
        hi = mid;
    }
  }
  int mag = lo;
  if (lo < r->count - 1) {
    double dl = x - r->value[lo], dh = r->value[lo + 1] - x;
    if (dh < dl || (dh == dl && (half_up || (lo & 1)))) mag = lo + 1;
  }
  bool neg = signbit(f) && (mag != 0 || r->fmt.neg_zero);
  return (uint8_t)((neg ? 1u << (r->fmt.bits - 1) : 0u) | (unsigned)mag);
}

static void check_narrow(const narrow_ref *r, const char *name, bool half_up, uint32_t u) {
  float f = moe_f32_from_bits(u);
  uint8_t want = ref_narrow(r, f, half_up), got = moe_f32_to_narrow(f, &r->fmt, half_up);
  if (want != got)
    ck_abort_msg("%s%s f32 0x%08x: want 0x%02x, codec 0x%02x", name, half_up ? " half_up" : "", u, want, got);
}

START_TEST(f32_to_narrow_stride_and_ties) {
  static const struct {
    const char *name;
    moe_narrow_fmt fmt;
  } formats[] = {{"e4m3fn", MOE_FMT_E4M3FN},
                 {"e4m3fnuz", MOE_FMT_E4M3FNUZ},
                 {"e5m2", MOE_FMT_E5M2},
                 {"e2m1", MOE_FMT_E2M1}};
  uint64_t checked = 0;
  for (size_t i = 0; i < sizeof formats / sizeof formats[0]; i++) {
    narrow_ref r;
    narrow_ref_init(&r, formats[i].fmt);
    for (int hu = 0; hu < 2; hu++) {
      for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += 61u * STRIDE, checked++)
        check_narrow(&r, formats[i].name, hu, (uint32_t)u);
      /* every grid value and midpoint (exact in fp32), +-8 ulps, both signs */
      for (int c = 0; c < r.count; c++) {
        double pts[2] = {r.value[c], c + 1 < r.count ? (r.value[c] + r.value[c + 1]) / 2 : 2 * r.value[c]};
        for (int k = 0; k < 2; k++)
          for (int d = -8; d <= 8; d++)
            for (uint32_t sign = 0; sign < 2; sign++, checked++)
              check_narrow(&r, formats[i].name, hu,
                           (moe_f32_bits((float)pts[k]) + (uint32_t)d) | (sign << 31));
      }
    }
  }
  printf("f32 -> fp8/fp4: %llu cases match the decoded-grid reference\n", (unsigned long long)checked);
}
END_TEST

int main(void) {
  Suite *s = suite_create("codec");
  TCase *tc = tcase_create("exhaustive");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, f16_to_f32_every_pattern);
  tcase_add_test(tc, f32_to_f16_every_pattern);
  tcase_add_test(tc, f32_to_bf16_every_pattern);
  tcase_add_test(tc, e4m3fn_fast_decode_every_code);
  tcase_add_test(tc, f32_to_int8_every_pattern);
  tcase_add_test(tc, f32_to_narrow_stride_and_ties);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
