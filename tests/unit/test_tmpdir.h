/* A per-test-program scratch directory under $MOE_TEST_TMP (or /tmp), for
 * the Check tests that write files. Header-only: each test is one program. */
#ifndef MOE_TEST_TMPDIR_H
#define MOE_TEST_TMPDIR_H

#include <check.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

static char tmpdir[512];

/* prefix: a short tag naming the test program in the directory name */
static void make_tmpdir_named(const char *prefix) {
  const char *base = getenv("MOE_TEST_TMP");
  if (!base || !*base) base = "/tmp";
  mkdir(base, 0777);
  snprintf(tmpdir, sizeof tmpdir, "%s/%s_XXXXXX", base, prefix);
  ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(path);
}

static void remove_tmpdir(void) { nftw(tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

static void tmp_path(char *buf, size_t cap, const char *leaf) { snprintf(buf, cap, "%s/%s", tmpdir, leaf); }

#endif
