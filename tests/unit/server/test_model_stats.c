/* model_stats.c, the statistics ModelStatistics and /metrics read: the
 * batch-size table (each size one slot, claimed once even when threads
 * race for it; sizes past the table counted as untracked, never merged
 * into another size's), the snapshot in increasing size, and the counts
 * perf_analyzer compares (one success count, its times summed). Expected
 * values are worked out here from the calls made. */
#include <check.h>
#include <pthread.h>
#include <stdlib.h>

#include "moed.h"

static moed_model_stats *stats_new(void) {
  moed_model_stats *st = calloc(1, sizeof *st);
  ck_assert_ptr_nonnull(st);
  return st;
}

START_TEST(batch_sizes_sorted_and_bounded) {
  moed_model_stats *st = stats_new();
  const moed_timing t = {1, 10, 20, 30};
  /* sizes 300, 299, ..., 1: the first MOED_BATCH_SIZES distinct ones are kept */
  for (uint64_t size = 300; size >= 1; size--)
    moed_stats_record_execution(st, size, &t);
  moed_stats_record_execution(st, 300, &t); /* a kept size again */
  moed_stats_record_execution(st, 1, &t);   /* an untracked size again */
  moed_batch_snapshot *snap = calloc(MOED_BATCH_SIZES, sizeof *snap);
  ck_assert_ptr_nonnull(snap);
  size_t n = moed_stats_batches(st, snap);
  ck_assert_uint_eq(n, MOED_BATCH_SIZES);
  for (size_t i = 0; i < n; i++) {
    ck_assert_uint_eq(snap[i].size, 300 - MOED_BATCH_SIZES + 1 + i); /* 45..300, increasing */
    uint64_t runs = snap[i].size == 300 ? 2 : 1;
    ck_assert_uint_eq(snap[i].count, runs);
    ck_assert_uint_eq(snap[i].input_ns, 10 * runs);
    ck_assert_uint_eq(snap[i].infer_ns, 20 * runs);
    ck_assert_uint_eq(snap[i].output_ns, 30 * runs);
  }
  ck_assert_uint_eq(atomic_load(&st->batch_untracked), 300 - MOED_BATCH_SIZES + 1);
  ck_assert_uint_eq(atomic_load(&st->execution_count), 302);
  free(snap);
  free(st);
}
END_TEST

typedef struct racer {
  moed_model_stats *st;
  int seed;
} racer;

/* Executions of sizes 1..40 in an order of its own, 50 rounds. */
static void *race(void *arg) {
  racer *r = arg;
  const moed_timing t = {1, 1, 1, 1};
  for (int round = 0; round < 50; round++)
    for (int k = 0; k < 40; k++)
      moed_stats_record_execution(r->st, (uint64_t)((k * 7 + r->seed + round) % 40) + 1, &t);
  return NULL;
}

START_TEST(racing_threads_share_one_slot_per_size) {
  moed_model_stats *st = stats_new();
  pthread_t th[8];
  racer rs[8];
  for (int i = 0; i < 8; i++) {
    rs[i] = (racer){st, i * 13};
    ck_assert_int_eq(pthread_create(&th[i], NULL, race, &rs[i]), 0);
  }
  for (int i = 0; i < 8; i++)
    pthread_join(th[i], NULL);
  moed_batch_snapshot snap[MOED_BATCH_SIZES];
  size_t n = moed_stats_batches(st, snap);
  ck_assert_uint_eq(n, 40);
  for (size_t i = 0; i < n; i++) {
    ck_assert_uint_eq(snap[i].size, i + 1);
    ck_assert_uint_eq(snap[i].count, 8 * 50); /* each thread ran each size once per round */
  }
  free(st);
}
END_TEST

START_TEST(successes_count_once_with_their_times) {
  moed_model_stats *st = stats_new();
  const moed_timing t = {5, 100, 200, 300};
  moed_stats_record(st, true, 1000, &t, 2000, 3, 64, 32);
  moed_stats_record(st, true, 1000, &t, 2000, 1, 64, 32);
  moed_stats_record(st, false, 0, NULL, 500, 0, 64, 0);
  ck_assert_uint_eq(atomic_load(&st->success_count), 2);
  ck_assert_uint_eq(atomic_load(&st->success_ns), 4000);
  ck_assert_uint_eq(atomic_load(&st->queue_ns), 2000);
  ck_assert_uint_eq(atomic_load(&st->compute_input_ns), 200);
  ck_assert_uint_eq(atomic_load(&st->compute_ns), 400);
  ck_assert_uint_eq(atomic_load(&st->compute_output_ns), 600);
  ck_assert_uint_eq(atomic_load(&st->inference_count), 4); /* batch sizes 3 and 1 */
  ck_assert_uint_eq(atomic_load(&st->fail_count), 1);
  ck_assert_uint_eq(atomic_load(&st->fail_ns), 500);
  ck_assert_uint_eq(atomic_load(&st->bytes_in), 192);
  ck_assert_uint_eq(atomic_load(&st->bytes_out), 64);
  free(st);
}
END_TEST

/* Each execution lands in the first bucket whose bound is >= its size:
 * sizes 1, 2, 3, 4, 5 and 20000 go to le=1, 2, 4, 4, 8 and +Inf. */
START_TEST(batch_histogram_buckets) {
  moed_model_stats *st = stats_new();
  const moed_timing t = {1, 1, 1, 1};
  const uint64_t sizes[] = {1, 2, 3, 4, 5, 20000};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
    moed_stats_record_execution(st, sizes[i], &t);
  const uint64_t want[MOED_HIST_BUCKETS] = {[0] = 1, [1] = 1, [2] = 2, [3] = 1, [MOED_HIST_BUCKETS - 1] = 1};
  for (int b = 0; b < MOED_HIST_BUCKETS; b++)
    ck_assert_uint_eq(atomic_load(&st->batch_hist.le[b]), want[b]);
  ck_assert_uint_eq(atomic_load(&st->batch_hist.count), 6);
  ck_assert_uint_eq(atomic_load(&st->batch_hist.sum), 1 + 2 + 3 + 4 + 5 + 20000);
  ck_assert_uint_eq(moed_hist_bounds_rows[MOED_HIST_BUCKETS - 2], 16384);
  free(st);
}
END_TEST

int main(void) {
  Suite *s = suite_create("model_stats");
  TCase *tc = tcase_create("stats");
  tcase_add_test(tc, batch_sizes_sorted_and_bounded);
  tcase_add_test(tc, racing_threads_share_one_slot_per_size);
  tcase_add_test(tc, successes_count_once_with_their_times);
  tcase_add_test(tc, batch_histogram_buckets);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
