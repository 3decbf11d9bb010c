/* moe_host_alloc: the requested alignment below MOE_HOST_HUGE_PAGE bytes,
 * huge-page alignment and the kernel's huge-page advice from there on (read
 * back from /proc/self/smaps where the kernel offers transparent huge
 * pages), refusals for bad alignments and impossible sizes. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/backend.h"

/* Whether THP can be advised here: /sys/.../enabled names [always] or [madvise]. */
static bool thp_available(void) {
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  if (!f) return false;
  char line[128] = "";
  const bool ok = fgets(line, sizeof line, f) && !strstr(line, "[never]");
  fclose(f);
  return ok;
}

/* The THPeligible field of the mapping that holds p; -1 when not found. */
static int thp_eligible(const void *p) {
  FILE *f = fopen("/proc/self/smaps", "r");
  if (!f) return -1;
  char line[512];
  bool inside = false;
  int got = -1;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
      inside = (uintptr_t)p >= lo && (uintptr_t)p < hi;
      continue;
    }
    int v;
    if (inside && sscanf(line, "THPeligible: %d", &v) == 1) {
      got = v;
      break;
    }
  }
  fclose(f);
  return got;
}

START_TEST(small_blocks_keep_the_requested_alignment) {
  const size_t aligns[] = {1, 8, 64, 4096};
  for (size_t i = 0; i < sizeof aligns / sizeof aligns[0]; i++) {
    uint8_t *p = moe_host_alloc(1000, aligns[i]);
    ck_assert_ptr_nonnull(p);
    ck_assert_uint_eq((uintptr_t)p % aligns[i], 0);
    memset(p, 0xA5, 1000);
    ck_assert_uint_eq(p[999], 0xA5);
    free(p);
  }
  void *z = moe_host_alloc(0, 64); /* a valid pointer, freed as any */
  ck_assert_ptr_nonnull(z);
  free(z);
}
END_TEST

START_TEST(large_blocks_are_huge_page_aligned_and_advised) {
  const size_t n = 3 * MOE_HOST_HUGE_PAGE + 12345;
  uint8_t *p = moe_host_alloc(n, 64);
  ck_assert_ptr_nonnull(p);
  ck_assert_uint_eq((uintptr_t)p % MOE_HOST_HUGE_PAGE, 0);
  memset(p, 1, n);
  ck_assert_uint_eq(p[n - 1], 1);
  if (thp_available())
    ck_assert_msg(thp_eligible(p) == 1, "THPeligible of the block's first huge page: %d", thp_eligible(p));
  else
    fprintf(stderr, "skipped: no transparent huge pages here, the advice is not visible\n");
  free(p);
}
END_TEST

START_TEST(bad_requests_are_refused) {
  ck_assert_ptr_null(moe_host_alloc(64, 0));
  ck_assert_ptr_null(moe_host_alloc(64, 48));
  ck_assert_ptr_null(moe_host_alloc(SIZE_MAX, 64));
  ck_assert_ptr_null(moe_host_alloc(SIZE_MAX - MOE_HOST_HUGE_PAGE / 2, 64));
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("host_alloc");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, small_blocks_keep_the_requested_alignment);
  tcase_add_test(tc, large_blocks_are_huge_page_aligned_and_advised);
  tcase_add_test(tc, bad_requests_are_refused);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  const int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
