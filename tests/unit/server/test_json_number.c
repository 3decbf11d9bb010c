/* json_number.c: the non-finite tokens Python's json writes (NaN, Infinity,
 * -Infinity) are rewritten in place where a value stands, never inside a
 * string or a longer word, keeping every byte offset; the rewritten text
 * parses with cJSON to NaN and the infinities; answers print -0.0 and the
 * non-finite values so that Python reads back the same floats. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "json_number.h"

/* The rewritten text of s (s itself when nothing is rewritten). */
static char *rewritten(const char *s) {
  bool oom = true;
  char *r = moed_json_nonfinite_in(s, strlen(s), &oom);
  ck_assert(!oom);
  if (!r) return strdup(s);
  char *z = calloc(1, strlen(s) + 1);
  memcpy(z, r, strlen(s));
  free(r);
  return z;
}

START_TEST(tokens_parse_to_nonfinite) {
  const char *in = "{\"data\":[1, NaN,Infinity , -Infinity,-0.0,\nNaN]}";
  char *t = rewritten(in);
  ck_assert_uint_eq(strlen(t), strlen(in));
  cJSON *j = cJSON_Parse(t);
  ck_assert_ptr_nonnull(j);
  double v[6] = {0};
  size_t n = 0;
  for (const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "data")->child; e && n < 6; e = e->next, n++) {
    if (cJSON_IsNumber(e))
      v[n] = e->valuedouble;
    else
      ck_assert(moed_json_nonfinite_value(e, &v[n]));
  }
  ck_assert_uint_eq(n, 6);
  ck_assert(v[0] == 1);
  ck_assert(isnan(v[1]));
  ck_assert(isinf(v[2]) && v[2] > 0);
  ck_assert(isinf(v[3]) && v[3] < 0);
  ck_assert(v[4] == 0 && signbit(v[4]));
  ck_assert(isnan(v[5]));
  /* an object with members is not a NaN */
  cJSON *o = cJSON_Parse("{\"a\":1}");
  double x;
  ck_assert(!moed_json_nonfinite_value(o, &x));
  cJSON_Delete(o);
  cJSON_Delete(j);
  free(t);
}
END_TEST

START_TEST(strings_and_words_untouched) {
  bool oom;
  /* in strings (escaped quotes too), as keys, as parts of longer words, after a value */
  const char *same[] = {"{\"id\":\"NaN\"}", "{\"a\":\"x\\\"NaN\"}", "{\"NaN\":1}", "[NaNa]",
                        "[Infinity2]",      "[-Infinityx]",         "[1 NaN]",     "{\"p\":true}"};
  for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
    ck_assert_ptr_null(moed_json_nonfinite_in(same[i], strlen(same[i]), &oom));
  /* a bare value elsewhere than in data is rewritten too (the caller decides what it means) */
  char *t = rewritten("{\"x\": NaN}");
  ck_assert_str_eq(t, "{\"x\": {} }");
  free(t);
}
END_TEST

START_TEST(answers_keep_sign_and_nonfinite) {
  const double in[] = {-0.0, 0.0, NAN, INFINITY, -INFINITY, 1.5};
  const char *want[] = {"[-0.0]", "[0]", "[NaN]", "[Infinity]", "[-Infinity]", "[1.5]"};
  for (size_t i = 0; i < 6; i++) {
    cJSON *a = cJSON_CreateArray();
    cJSON_AddItemToArray(a, moed_json_float(in[i]));
    char *s = cJSON_PrintUnformatted(a);
    ck_assert_str_eq(s, want[i]);
    free(s);
    cJSON_Delete(a);
  }
}
END_TEST

/* cJSON would cut "x\u0000y" to "x": every NUL a string would hold is
 * found, at its offset; an escaped backslash before "u0000" is not one, and
 * bytes after the value (a REST request's binary data) are not looked at */
START_TEST(nul_in_strings_found) {
  /* each text with its length (a raw NUL inside) and where the NUL is (-1: none) */
#define CASE(t, at)                                                                                          \
  { t, sizeof t - 1, at }
  static const struct {
    const char *text;
    size_t len;
    long at;
  } cases[] = {
      CASE("{\"id\":\"a\\u0000b\"}", 8),   /* the escape */
      CASE("{\"a\\u0000\":1}", 3),         /* in a key */
      CASE("{\"id\":\"a\0b\"}", 8),        /* a raw NUL byte in a string */
      CASE("{\"id\":\"a\\\\u0000\"}", -1), /* \\ then u0000: no NUL */
      CASE("{\"id\":\"\\\"\\u0000\"}", 9), /* after an escaped quote, still in the string */
      CASE("{\"a\":[1]}\0\"\\u0000", -1),  /* after the value: not looked at */
      CASE("{\"a\":\"\\u000\"}", -1),      /* cut short: not a NUL */
  };
#undef CASE
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    ck_assert_uint_eq(moed_json_nul_at(cases[i].text, cases[i].len),
                      cases[i].at < 0 ? cases[i].len : (size_t)cases[i].at);
}
END_TEST

int main(void) {
  Suite *s = suite_create("json_number");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, tokens_parse_to_nonfinite);
  tcase_add_test(tc, strings_and_words_untouched);
  tcase_add_test(tc, answers_keep_sign_and_nonfinite);
  tcase_add_test(tc, nul_in_strings_found);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
