/* moed_prom_label (server/prom_label.c): label values escaped as the
 * Prometheus text format requires; expected strings written by hand from
 * the format's rules (\\, \" and \n; nothing else changes). */
#include <check.h>
#include <string.h>

#include "prom_label.h"

START_TEST(escapes_the_three_characters) {
  static const struct {
    const char *in, *out;
  } cases[] = {
      {"quant.per_token", "quant.per_token"},
      {"", ""},
      {"a\"b", "a\\\"b"},
      {"a\\b", "a\\\\b"},
      {"line\nforged_metric 1", "line\\nforged_metric 1"},
      {"\"}\n", "\\\"}\\n"},
      {"tab\tand\rcr", "tab\tand\rcr"}, /* the format escapes only the three */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char out[64];
    size_t n = moed_prom_label(out, sizeof out, cases[i].in);
    ck_assert_str_eq(out, cases[i].out);
    ck_assert_uint_eq(n, strlen(cases[i].out));
  }
}
END_TEST

START_TEST(cut_at_a_whole_escape) {
  char out[5];
  /* "ab\"c" escapes to 5 characters: a b \ " c; 4 fit, but the escape is
   * not split: "ab" then the NUL */
  size_t n = moed_prom_label(out, 4, "ab\"c");
  ck_assert_str_eq(out, "ab");
  ck_assert_uint_eq(n, 5);
  n = moed_prom_label(out, sizeof out, "ab\"c");
  ck_assert_str_eq(out, "ab\\\"");
  ck_assert_uint_eq(n, 5);
  ck_assert_uint_eq(moed_prom_label(NULL, 0, "\n\n"), 4); /* the size needed */
}
END_TEST

int main(void) {
  Suite *s = suite_create("prom_label");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, escapes_the_three_characters);
  tcase_add_test(tc, cut_at_a_whole_escape);
  suite_add_tcase(s, tc);
  SRunner *r = srunner_create(s);
  srunner_run_all(r, CK_NORMAL);
  int failed = srunner_ntests_failed(r);
  srunner_free(r);
  return failed ? 1 : 0;
}
