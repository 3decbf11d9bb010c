/* token_dist.c, `moec bench --tokens`: the distinct counts and their
 * cumulative probabilities for a list (repeats weigh more), a uniform range
 * and a Zipf law, each worked out here by hand; malformed specs refused
 * with a message naming the flag. */
#include <check.h>
#include <math.h>
#include <string.h>

#include "token_dist.h"

static void parse_ok(const char *spec, token_dist *d) {
  char err[256] = "";
  ck_assert_msg(token_dist_parse(spec, d, err, sizeof err) == 0, "%s: %s", spec, err);
}

START_TEST(list_with_repeats) {
  token_dist d;
  parse_ok("16,1,4,1", &d); /* 1 twice: P(1) = 2/4 */
  ck_assert_uint_eq(d.n, 3);
  const uint32_t want[] = {1, 4, 16};
  const double cdf[] = {0.5, 0.75, 1.0};
  for (size_t i = 0; i < 3; i++) {
    ck_assert_uint_eq(d.tokens[i], want[i]);
    ck_assert_double_eq_tol(d.cdf[i], cdf[i], 1e-12);
  }
  token_dist_free(&d);
  parse_ok("7", &d);
  ck_assert_uint_eq(d.n, 1);
  ck_assert_uint_eq(d.tokens[0], 7);
  ck_assert(d.cdf[0] == 1.0);
  token_dist_free(&d);
}
END_TEST

START_TEST(uniform_range) {
  token_dist d;
  parse_ok("uniform:3:6", &d);
  ck_assert_uint_eq(d.n, 4);
  for (size_t i = 0; i < 4; i++) {
    ck_assert_uint_eq(d.tokens[i], 3 + i);
    ck_assert_double_eq_tol(d.cdf[i], (double)(i + 1) / 4, 1e-12);
  }
  ck_assert(d.cdf[3] == 1.0);
  token_dist_free(&d);
}
END_TEST

START_TEST(zipf_law) {
  token_dist d;
  parse_ok("zipf:2:3", &d); /* weights 1, 1/4, 1/9: total 49/36 */
  ck_assert_uint_eq(d.n, 3);
  ck_assert_double_eq_tol(d.cdf[0], 36.0 / 49, 1e-12);
  ck_assert_double_eq_tol(d.cdf[1], 45.0 / 49, 1e-12);
  ck_assert(d.cdf[2] == 1.0);
  token_dist_free(&d);
}
END_TEST

START_TEST(malformed_refused) {
  const char *bad[] = {"",          "0",           "1,,2",         "1,",       "-3",        "65537",
                       "uniform:5", "uniform:5:4", "uniform:0:4",  "zipf:0:8", "zipf:11:8", "zipf:1.5",
                       "zipf:x:8",  "normal:1:4",  "uniform:1:4x", "4 "};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    token_dist d;
    char err[256] = "";
    ck_assert_msg(token_dist_parse(bad[i], &d, err, sizeof err) == -1, "'%s' accepted", bad[i]);
    ck_assert_msg(strncmp(err, "--tokens ", 9) == 0, "'%s': %s", bad[i], err);
    ck_assert_ptr_null(d.tokens);
  }
}
END_TEST

int main(void) {
  Suite *s = suite_create("token_dist");
  TCase *tc = tcase_create("parse");
  tcase_add_test(tc, list_with_repeats);
  tcase_add_test(tc, uniform_range);
  tcase_add_test(tc, zipf_law);
  tcase_add_test(tc, malformed_refused);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
