/* model_stats: every update of a model's statistics (moed_model_stats:
 * counts, times, batch sizes, latency histograms), in one place. The
 * inference path records here; handlers.c (ModelStatistics) and http.c
 * (/metrics) only read them. */
#include <time.h>

#include "moed.h"

/* Upper bounds of the latency histogram buckets (the last is +Inf). */
const uint64_t moed_hist_bounds_ns[MOED_HIST_BUCKETS - 1] = {
    10000,   25000,    50000,    100000,   250000,    500000,     1000000,     2500000,
    5000000, 10000000, 25000000, 50000000, 100000000, 1000000000, 10000000000,
};

void moed_hist_observe(moed_hist *h, uint64_t ns) {
  int b = 0;
  while (b < MOED_HIST_BUCKETS - 1 && ns > moed_hist_bounds_ns[b])
    b++;
  atomic_fetch_add(&h->le[b], 1);
  atomic_fetch_add(&h->count, 1);
  atomic_fetch_add(&h->sum_ns, ns);
}

void moed_stats_record(moed_model_stats *st, bool ok, uint64_t queue_ns, const moed_timing *t,
                       uint64_t total_ns, uint64_t in, uint64_t out) {
  static const moed_timing never = {0};
  if (!t) t = &never;
  if (ok) { /* Triton counts queue and compute for successes only, each once */
    atomic_fetch_add(&st->success_count, 1);
    atomic_fetch_add(&st->success_ns, total_ns);
    atomic_fetch_add(&st->queue_count, 1);
    atomic_fetch_add(&st->queue_ns, queue_ns);
    atomic_fetch_add(&st->compute_input_count, 1);
    atomic_fetch_add(&st->compute_input_ns, t->input_ns);
    atomic_fetch_add(&st->compute_count, 1);
    atomic_fetch_add(&st->compute_ns, t->infer_ns);
    atomic_fetch_add(&st->compute_output_count, 1);
    atomic_fetch_add(&st->compute_output_ns, t->output_ns);
    atomic_fetch_add(&st->inference_count, 1);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    atomic_store(&st->last_inference_ms, (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u);
    moed_hist_observe(&st->queue_hist, queue_ns);
    moed_hist_observe(&st->compute_hist, t->infer_ns);
  } else {
    atomic_fetch_add(&st->fail_count, 1);
    atomic_fetch_add(&st->fail_ns, total_ns);
  }
  moed_hist_observe(&st->total_hist, total_ns);
  atomic_fetch_add(&st->bytes_in, in);
  atomic_fetch_add(&st->bytes_out, out);
}

/* One execution of `size` merged requests (Triton's batch statistics). */
void moed_stats_record_execution(moed_model_stats *st, size_t size, const moed_timing *t) {
  size_t i = size < MOED_BATCH_STATS ? size - 1 : MOED_BATCH_STATS - 1;
  atomic_fetch_add(&st->execution_count, 1);
  atomic_fetch_add(&st->batch_count[i], 1);
  atomic_fetch_add(&st->batch_input_ns[i], t->input_ns);
  atomic_fetch_add(&st->batch_ns[i], t->infer_ns);
  atomic_fetch_add(&st->batch_output_ns[i], t->output_ns);
}
