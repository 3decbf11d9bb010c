/* model_stats: every update of a model's statistics (moed_model_stats:
 * counts, times, batch sizes, latency histograms), in one place. The
 * inference path records here; handlers_model.c (ModelStatistics) and http.c
 * (/metrics) only read them. */
#include <stdlib.h>
#include <time.h>

#include "moed.h"

const uint64_t moed_hist_bounds_ns[MOED_HIST_BUCKETS - 1] = {
    10000,   25000,    50000,    100000,   250000,    500000,     1000000,     2500000,
    5000000, 10000000, 25000000, 50000000, 100000000, 1000000000, 10000000000,
};

/* powers of two: a batch fills up to max_batch_tokens, usually one of them */
const uint64_t moed_hist_bounds_rows[MOED_HIST_BUCKETS - 1] = {
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
};

void moed_hist_observe(moed_hist *h, const uint64_t *bounds, uint64_t v) {
  int b = 0;
  while (b < MOED_HIST_BUCKETS - 1 && v > bounds[b])
    b++;
  atomic_fetch_add(&h->le[b], 1);
  atomic_fetch_add(&h->sum, v);
  atomic_fetch_add(&h->count, 1); /* last: a reader that sees the count sees its bucket and sum */
}

void moed_stats_record(moed_model_stats *st, bool ok, uint64_t queue_ns, const moed_timing *t,
                       uint64_t total_ns, uint64_t inferences, uint64_t in, uint64_t out) {
  static const moed_timing never = {0};
  if (!t) t = &never;
  if (ok) { /* Triton counts queue and compute for successes only, each once */
    atomic_fetch_add(&st->queue_ns, queue_ns);
    atomic_fetch_add(&st->compute_input_ns, t->input_ns);
    atomic_fetch_add(&st->compute_ns, t->infer_ns);
    atomic_fetch_add(&st->compute_output_ns, t->output_ns);
    atomic_fetch_add(&st->success_ns, total_ns);
    atomic_fetch_add(&st->inference_count, inferences);
    atomic_fetch_add(&st->success_count, 1); /* after the times: a reader sees no count without them */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    atomic_store(&st->last_inference_ms, (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u);
    moed_hist_observe(&st->queue_hist, moed_hist_bounds_ns, queue_ns);
    moed_hist_observe(&st->compute_hist, moed_hist_bounds_ns, t->infer_ns);
  } else {
    atomic_fetch_add(&st->fail_count, 1);
    atomic_fetch_add(&st->fail_ns, total_ns);
  }
  moed_hist_observe(&st->total_hist, moed_hist_bounds_ns, total_ns);
  atomic_fetch_add(&st->bytes_in, in);
  atomic_fetch_add(&st->bytes_out, out);
}

/* The slot of batch size `size`, claimed on first use (lock-free: a slot's
 * size goes from 0 to its size once); NULL when every slot holds another. */
static moed_batch_stat *batch_slot(moed_model_stats *st, uint64_t size) {
  for (size_t k = 0; k < MOED_BATCH_SIZES; k++) {
    moed_batch_stat *b = &st->batch[(size + k) % MOED_BATCH_SIZES];
    uint64_t have = atomic_load(&b->size);
    if (have == 0) {
      uint64_t zero = 0;
      if (atomic_compare_exchange_strong(&b->size, &zero, size)) return b;
      have = zero; /* another thread claimed it meanwhile: for which size? */
    }
    if (have == size) return b;
  }
  return NULL;
}

void moed_stats_record_execution(moed_model_stats *st, uint64_t size, const moed_timing *t) {
  atomic_fetch_add(&st->execution_count, 1);
  moed_hist_observe(&st->batch_hist, moed_hist_bounds_rows, size);
  moed_batch_stat *b = size ? batch_slot(st, size) : NULL;
  if (!b) {
    atomic_fetch_add(&st->batch_untracked, 1);
    return;
  }
  atomic_fetch_add(&b->input_ns, t->input_ns);
  atomic_fetch_add(&b->infer_ns, t->infer_ns);
  atomic_fetch_add(&b->output_ns, t->output_ns);
  atomic_fetch_add(&b->count, 1);
}

static int by_size(const void *a, const void *b) {
  const moed_batch_snapshot *x = a, *y = b;
  return (x->size > y->size) - (x->size < y->size);
}

size_t moed_stats_batches(moed_model_stats *st, moed_batch_snapshot *out) {
  size_t n = 0;
  for (size_t k = 0; k < MOED_BATCH_SIZES; k++) {
    moed_batch_stat *b = &st->batch[k];
    moed_batch_snapshot s = {atomic_load(&b->size), atomic_load(&b->count), atomic_load(&b->input_ns),
                             atomic_load(&b->infer_ns), atomic_load(&b->output_ns)};
    if (s.size && s.count) out[n++] = s;
  }
  qsort(out, n, sizeof *out, by_size);
  return n;
}
