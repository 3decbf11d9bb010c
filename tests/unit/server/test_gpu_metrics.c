/* gpu_metrics.c against fake_nvml.c (two fixed GPUs, values listed there),
 * loaded as the driver's library would be, through MOED_NVML_LIBRARY: the
 * exact exposition lines (Triton's names, HELP/TYPE and gpu_uuid label; a
 * value NVML does not support left out; energy counted from create), the
 * CUDA_VISIBLE_DEVICES mapping, a device whose name is not the backend's
 * left out, and no metrics (the log saying why) with --allow-gpu-metrics
 * false, without GPU workers, without a usable library. Each test runs in
 * a fork of its own (Check's default), so each loads NVML afresh. */
#include <check.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed.h"

/* moed_log, recorded: "LEVEL event: message\n" lines */
static char logged[8192];

void moed_log(int level, const char *event, const char *fmt, ...) {
  size_t n = strlen(logged);
  n += (size_t)snprintf(logged + n, sizeof logged - n, "%d %s: ", level, event);
  if (n >= sizeof logged) return;
  va_list ap;
  va_start(ap, fmt);
  n += (size_t)vsnprintf(logged + n, sizeof logged - n, fmt, ap);
  va_end(ap);
  if (n < sizeof logged - 1) strcat(logged, "\n");
}

static const char *fake(void) {
  const char *p = getenv("MOED_FAKE_NVML");
  ck_assert_msg(p && *p, "MOED_FAKE_NVML names fake_nvml's library (ctest sets it)");
  return p;
}

static void use_fake(void) {
  setenv("MOED_NVML_LIBRARY", fake(), 1);
  unsetenv("CUDA_VISIBLE_DEVICES");
}

static const char *const two_gpus[] = {"gpu0: NVIDIA H200", "gpu1: NVIDIA H200"};

#define U0 "{gpu_uuid=\"GPU-11111111-2222-3333-4444-000000000000\"}"
#define U1 "{gpu_uuid=\"GPU-55555555-6666-7777-8888-000000000001\"}"

/* fake_nvml's values as Triton writes them: utilization 37 % and 100 %;
 * 143771 MiB = 150754820096 bytes; 1 GiB used, then 0; 123456 mW, device
 * 1's power not supported (no sample); 700000 mW limits; energy read once
 * at create, then `joules` x (2500 mJ more per read) since. */
static char *expected(const char *joules) {
  static char buf[4096];
  snprintf(buf, sizeof buf,
           "# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)\n"
           "# TYPE nv_gpu_utilization gauge\n"
           "nv_gpu_utilization" U0 " 0.370000\n"
           "nv_gpu_utilization" U1 " 1.000000\n"
           "# HELP nv_gpu_memory_total_bytes GPU total memory, in bytes\n"
           "# TYPE nv_gpu_memory_total_bytes gauge\n"
           "nv_gpu_memory_total_bytes" U0 " 150754820096.000000\n"
           "nv_gpu_memory_total_bytes" U1 " 150754820096.000000\n"
           "# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes\n"
           "# TYPE nv_gpu_memory_used_bytes gauge\n"
           "nv_gpu_memory_used_bytes" U0 " 1073741824.000000\n"
           "nv_gpu_memory_used_bytes" U1 " 0.000000\n"
           "# HELP nv_gpu_power_usage GPU power usage in watts\n"
           "# TYPE nv_gpu_power_usage gauge\n"
           "nv_gpu_power_usage" U0 " 123.456000\n"
           "# HELP nv_gpu_power_limit GPU power management limit in watts\n"
           "# TYPE nv_gpu_power_limit gauge\n"
           "nv_gpu_power_limit" U0 " 700.000000\n"
           "nv_gpu_power_limit" U1 " 700.000000\n"
           "# HELP nv_energy_consumption GPU energy consumption in joules since moed started\n"
           "# TYPE nv_energy_consumption counter\n"
           "nv_energy_consumption" U0 " %s\n"
           "nv_energy_consumption" U1 " %s\n",
           joules, joules);
  return buf;
}

static char *render(moed_gpu_metrics *g) {
  size_t len = 0;
  char *text = moed_gpu_metrics_render(g, &len);
  ck_assert_ptr_nonnull(text);
  ck_assert_uint_eq(len, strlen(text));
  return text;
}

START_TEST(two_gpus_exact_lines) {
  use_fake();
  moed_gpu_metrics *g = moed_gpu_metrics_create(true, 2, two_gpus);
  ck_assert_ptr_nonnull(g);
  char *text = render(g);
  ck_assert_str_eq(text, expected("2.500000"));
  free(text);
  text = render(g); /* a counter: 2500 mJ more per read */
  ck_assert_str_eq(text, expected("5.000000"));
  free(text);
  /* device 1's unsupported power is said once, at debug level */
  ck_assert_ptr_nonnull(strstr(logged, "3 gpu_metrics: worker 1: Not Supported"));
  ck_assert_ptr_null(strstr(strstr(logged, "worker 1: Not Supported") + 1, "worker 1: Not Supported"));
  ck_assert_ptr_nonnull(strstr(logged, "2 gpu_metrics: worker 0 (gpu0: NVIDIA H200): NVML "
                                       "GPU-11111111-2222-3333-4444-000000000000\n"));
  moed_gpu_metrics_destroy(g);
}
END_TEST

/* only the worker's lines: the sample lines of one uuid */
static void assert_only(const char *text, const char *present, const char *absent) {
  ck_assert_ptr_nonnull(strstr(text, present));
  ck_assert_ptr_null(strstr(text, absent));
}

START_TEST(visible_devices_renumber) {
  use_fake();
  /* CUDA device 0 is NVML's 1 (by index); worker 1 is a host worker */
  setenv("CUDA_VISIBLE_DEVICES", "1,0", 1);
  const char *one[] = {"gpu0: NVIDIA H200", NULL};
  moed_gpu_metrics *g = moed_gpu_metrics_create(true, 2, one);
  ck_assert_ptr_nonnull(g);
  char *text = render(g);
  assert_only(text, "nv_gpu_utilization" U1 " 1.000000\n", U0);
  free(text);
  moed_gpu_metrics_destroy(g);
}
END_TEST

START_TEST(visible_devices_by_uuid) {
  use_fake();
  /* a whole UUID, then an abbreviated one (CUDA takes a unique prefix) */
  setenv("CUDA_VISIBLE_DEVICES", "GPU-55555555-6666-7777-8888-000000000001, GPU-1111", 1);
  moed_gpu_metrics *g = moed_gpu_metrics_create(true, 2, two_gpus);
  ck_assert_ptr_nonnull(g);
  char *text = render(g);
  /* the order of the workers: device 1's sample first */
  const char *a = strstr(text, "nv_gpu_utilization" U1), *b = strstr(text, "nv_gpu_utilization" U0);
  ck_assert_ptr_nonnull(a);
  ck_assert_ptr_nonnull(b);
  ck_assert(a < b);
  free(text);
  moed_gpu_metrics_destroy(g);
}
END_TEST

START_TEST(visible_devices_unmapped) {
  use_fake();
  /* "GPU-", a prefix of both UUIDs, a MIG instance, an index NVML lacks: no device each */
  const char *lists[] = {"GPU-", "MIG-0c0b1f5d-aaaa-bbbb-cccc-000000000000", "7", "0"};
  for (int i = 0; i < 4; i++) {
    setenv("CUDA_VISIBLE_DEVICES", lists[i], 1);
    logged[0] = 0;
    moed_gpu_metrics *g = moed_gpu_metrics_create(true, i < 3 ? 1 : 2, two_gpus);
    size_t len;
    char *text = moed_gpu_metrics_render(g, &len);
    if (i < 3) { /* the one worker left out, said at warn level: no metrics */
      ck_assert_ptr_null(g);
      ck_assert_ptr_null(text);
      ck_assert_ptr_nonnull(strstr(logged, "1 gpu_metrics: off: no GPU worker has an NVML device\n"));
      ck_assert_msg(
          strstr(logged, "1 gpu_metrics: worker 0 (gpu0: NVIDIA H200) left out: CUDA_VISIBLE_DEVICES"),
          "%s: %s", lists[i], logged);
    } else { /* "0" lists one device: worker 1 has no entry */
      ck_assert_ptr_nonnull(text);
      assert_only(text, U0, U1);
      ck_assert_ptr_nonnull(strstr(logged,
                                   "worker 1 (gpu1: NVIDIA H200) left out: CUDA_VISIBLE_DEVICES '0' has "
                                   "no entry 1"));
    }
    free(text);
    moed_gpu_metrics_destroy(g);
  }
}
END_TEST

START_TEST(other_name_left_out) {
  use_fake();
  /* CUDA's device 1 is not NVML's 1 (fastest-first order on mixed GPUs) */
  const char *mixed[] = {"gpu0: NVIDIA H200", "gpu1: NVIDIA A100-SXM4-80GB"};
  moed_gpu_metrics *g = moed_gpu_metrics_create(true, 2, mixed);
  ck_assert_ptr_nonnull(g);
  char *text = render(g);
  assert_only(text, U0, U1);
  free(text);
  ck_assert_ptr_nonnull(strstr(logged,
                               "1 gpu_metrics: worker 1 (gpu1: NVIDIA A100-SXM4-80GB) left out: its NVML "
                               "device is a NVIDIA H200"));
  ck_assert_ptr_nonnull(strstr(logged, "CUDA_DEVICE_ORDER=PCI_BUS_ID"));
  moed_gpu_metrics_destroy(g);
}
END_TEST

/* NULL, no library opened, and the one debug line saying why */
static void assert_off(moed_gpu_metrics *g, const char *why) {
  ck_assert_ptr_null(g);
  size_t len = 0;
  ck_assert_ptr_null(moed_gpu_metrics_render(g, &len));
  ck_assert_msg(strstr(logged, why) != NULL, "log '%s' lacks '%s'", logged, why);
  int lines = 0;
  for (const char *p = logged; (p = strchr(p, '\n')); p++)
    lines++;
  ck_assert_int_eq(lines, 1);
}

START_TEST(disallowed) {
  use_fake();
  assert_off(moed_gpu_metrics_create(false, 2, two_gpus), "3 gpu_metrics: off: --allow-gpu-metrics false\n");
  ck_assert_ptr_null(dlopen(fake(), RTLD_NOW | RTLD_NOLOAD)); /* never loaded */
}
END_TEST

START_TEST(no_gpu_workers) {
  use_fake();
  const char *cpu[] = {NULL, NULL};
  assert_off(moed_gpu_metrics_create(true, 2, cpu), "3 gpu_metrics: off: no GPU workers\n");
  ck_assert_ptr_null(dlopen(fake(), RTLD_NOW | RTLD_NOLOAD));
}
END_TEST

START_TEST(no_library) {
  setenv("MOED_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1", 1);
  assert_off(moed_gpu_metrics_create(true, 2, two_gpus),
             "3 gpu_metrics: off: NVML not available (/nonexistent/libnvidia-ml.so.1: cannot open");
}
END_TEST

START_TEST(not_nvml) {
  /* a library that loads but is not NVML: a warning, not a crash */
  setenv("MOED_NVML_LIBRARY", "libm.so.6", 1);
  assert_off(moed_gpu_metrics_create(true, 2, two_gpus),
             "1 gpu_metrics: off: NVML not available (libm.so.6: no nvmlInit_v2)\n");
}
END_TEST

/* --print: the text for two_gpus with the library MOED_NVML_LIBRARY names
 * (tests/integration/test_gpu_metrics.py hands it to perf_analyzer). */
static int print(void) {
  moed_gpu_metrics *g = moed_gpu_metrics_create(true, 2, two_gpus);
  size_t len = 0;
  char *text = moed_gpu_metrics_render(g, &len);
  if (text) fwrite(text, 1, len, stdout);
  free(text);
  moed_gpu_metrics_destroy(g);
  return text ? EXIT_SUCCESS : EXIT_FAILURE;
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--print") == 0) return print();
  Suite *s = suite_create("gpu_metrics");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, two_gpus_exact_lines);
  tcase_add_test(tc, visible_devices_renumber);
  tcase_add_test(tc, visible_devices_by_uuid);
  tcase_add_test(tc, visible_devices_unmapped);
  tcase_add_test(tc, other_name_left_out);
  tcase_add_test(tc, disallowed);
  tcase_add_test(tc, no_gpu_workers);
  tcase_add_test(tc, no_library);
  tcase_add_test(tc, not_nvml);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
