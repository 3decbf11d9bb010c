/* batcher: merges inference requests for the same model and the same
 * parameters along the token axis (docs/design.md "Batching"), on the loop
 * thread. A request joins the open batch with its batch key
 * (moed_infer_same_batch); a batch goes to the device queues when it holds
 * max_batch_tokens rows or when its timer (max_queue_delay_us, rounded up
 * to libuv's milliseconds) fires. Delay 0 still merges what arrived in the
 * same loop iteration: the timer fires in the next one. Requests held here
 * are bounded by max_queue_size (beyond: UNAVAILABLE).
 *
 * Also the inference jobs themselves: one job = one batch (or one large
 * request decoded on the worker). */
#include <stdlib.h>
#include <string.h>

#include "moed.h"

typedef struct open_batch {
  struct open_batch *next;
  uv_timer_t timer;
  moed_batcher *owner;
  moed_infer_req **reqs;
  size_t n, cap;
  int64_t rows;
} open_batch;

struct moed_batcher {
  moed_server *srv;
  open_batch *open;
  size_t held; /* requests in open batches */
};

/* ---- jobs ------------------------------------------------------------------------- */

typedef struct infer_job {
  moed_job job;
  moed_server *srv;
  moed_request *raw; /* a large request, decoded on the worker */
  size_t n;
  moed_infer_req *reqs[];
} infer_job;

static void infer_job_run(moed_job *job, moe_backend *b) {
  infer_job *j = (infer_job *)job;
  if (j->raw) {
    moed_infer_req *r = moed_infer_decode(j->srv, j->raw);
    if (r) moed_infer_run(j->srv, b, &r, 1);
  } else {
    moed_infer_run(j->srv, b, j->reqs, j->n);
  }
  free(j);
}

static void infer_job_cancel(moed_job *job, moe_backend *b) {
  (void)b;
  infer_job *j = (infer_job *)job;
  if (j->raw) moed_request_reject(j->srv, j->raw, GRPC_STATUS_UNAVAILABLE, "server shutting down");
  for (size_t k = 0; k < j->n; k++)
    moed_infer_reject(j->srv, j->reqs[k], GRPC_STATUS_UNAVAILABLE, "server shutting down");
  free(j);
}

static infer_job *job_new(moed_server *s, size_t n) {
  if (n > (SIZE_MAX - sizeof(infer_job)) / sizeof(moed_infer_req *)) return NULL;
  infer_job *j = calloc(1, sizeof *j + n * sizeof(moed_infer_req *));
  if (!j) return NULL;
  j->job.run = infer_job_run;
  j->job.cancel = infer_job_cancel;
  j->srv = s;
  j->n = n;
  return j;
}

void moed_infer_dispatch(moed_server *s, moed_infer_req **reqs, size_t n) {
  infer_job *j = job_new(s, n);
  if (j) {
    memcpy(j->reqs, reqs, n * sizeof *reqs);
    if (moed_devices_submit(s->devices, &j->job)) return;
    free(j);
  }
  atomic_fetch_add(&s->rejected, n);
  for (size_t k = 0; k < n; k++)
    moed_infer_reject(s, reqs[k], GRPC_STATUS_UNAVAILABLE, "device queue full");
}

void moed_infer_dispatch_raw(moed_server *s, moed_request *req) {
  infer_job *j = job_new(s, 0);
  if (j) {
    j->raw = req;
    if (moed_devices_submit(s->devices, &j->job)) return;
    free(j);
  }
  atomic_fetch_add(&s->rejected, 1);
  moed_request_reject(s, req, GRPC_STATUS_UNAVAILABLE, "device queue full");
}

/* ---- open batches ------------------------------------------------------------------- */

static void on_batch_closed(uv_handle_t *h) {
  open_batch *ob = h->data;
  free(ob->reqs);
  free(ob);
}

static void flush(moed_batcher *b, open_batch *ob) {
  for (open_batch **pp = &b->open; *pp; pp = &(*pp)->next)
    if (*pp == ob) {
      *pp = ob->next;
      break;
    }
  uv_timer_stop(&ob->timer);
  b->held -= ob->n;
  moed_infer_dispatch(b->srv, ob->reqs, ob->n);
  ob->n = 0;
  uv_close((uv_handle_t *)&ob->timer, on_batch_closed);
}

static void on_timer(uv_timer_t *t) {
  open_batch *ob = t->data;
  flush(ob->owner, ob);
}

static open_batch *batch_new(moed_batcher *b) {
  open_batch *ob = calloc(1, sizeof *ob);
  if (!ob) return NULL;
  ob->owner = b;
  ob->cap = 8;
  ob->reqs = malloc(ob->cap * sizeof *ob->reqs);
  if (!ob->reqs) {
    free(ob);
    return NULL;
  }
  uv_timer_init(b->srv->loop, &ob->timer);
  ob->timer.data = ob;
  int64_t us = b->srv->cfg->max_queue_delay_us;
  uv_timer_start(&ob->timer, on_timer, (uint64_t)((us + 999) / 1000), 0);
  ob->next = b->open;
  b->open = ob;
  return ob;
}

void moed_batcher_submit(moed_batcher *b, moed_infer_req *r) {
  moed_server *s = b->srv;
  if (b->held >= (size_t)s->cfg->max_queue_size) {
    atomic_fetch_add(&s->rejected, 1);
    moed_infer_reject(s, r, GRPC_STATUS_UNAVAILABLE, "batch queue full");
    return;
  }
  int64_t rows = moed_infer_batch_rows(r);
  open_batch *ob = b->open;
  while (ob && !moed_infer_same_batch(ob->reqs[0], r))
    ob = ob->next;
  if (ob && ob->rows + rows > s->cfg->max_batch_tokens) { /* full: send it, start another */
    flush(b, ob);
    ob = NULL;
  }
  if (!ob && !(ob = batch_new(b))) {
    moed_infer_dispatch(s, &r, 1); /* no memory to batch: run it alone */
    return;
  }
  if (ob->n == ob->cap) {
    moed_infer_req **g =
        ob->cap <= SIZE_MAX / 2 / sizeof *g ? realloc(ob->reqs, ob->cap * 2 * sizeof *g) : NULL;
    if (!g) {
      moed_infer_dispatch(s, &r, 1);
      return;
    }
    ob->reqs = g;
    ob->cap *= 2;
  }
  ob->reqs[ob->n++] = r;
  ob->rows += rows;
  b->held++;
  if (ob->rows >= s->cfg->max_batch_tokens) flush(b, ob);
}

int moed_batcher_create(moed_server *s, moed_batcher **out) {
  moed_batcher *b = calloc(1, sizeof *b);
  if (!b) return -1;
  b->srv = s;
  *out = b;
  return 0;
}

void moed_batcher_flush_all(moed_batcher *b) {
  while (b->open)
    flush(b, b->open);
}

void moed_batcher_destroy(moed_batcher *b) {
  if (!b) return;
  moed_batcher_flush_all(b);
  free(b); /* the batches' timers only point at their batch, freed on close */
}
