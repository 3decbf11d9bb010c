/* batcher: merges inference requests for the same model and the same
 * parameters along the token axis (docs/design.md "Batching"), on the loop
 * thread. Decoding's last step computes a request's batch key
 * (moed_batch_key, here since only batching reads it); a request joins the
 * open batch with the same key; a batch goes to the device queues when it holds
 * max_batch_tokens rows or when its timer (max_queue_delay_us, rounded up
 * to libuv's milliseconds) fires. Delay 0 still merges what arrived in the
 * same loop iteration: the timer fires in the next one. A batch whose delay
 * has passed stays open while the device queues already hold work of its
 * priority level or higher and no worker is free for it (moed_devices_busy):
 * sent now it would only wait there as one more small job, so it keeps
 * taking requests (up to max_batch_tokens, which still sends it at once)
 * until a worker finishes a job; that worker wakes the loop (a uv_async),
 * which sends the held batches, highest level and oldest first, while one
 * is free for them (Triton's dynamic batcher: requests gather while the
 * instance is busy). Requests merge only with requests of their own
 * priority level, so a held batch never carries one past the queue's
 * order. Requests held here are bounded by max_queue_size (when full, held
 * batches are sent first, then: UNAVAILABLE).
 *
 * Also the inference jobs themselves: one job = one batch (or one large
 * request decoded on the worker), and their callers giving up while they
 * wait in the device queues: a request whose call is cancelled or whose
 * deadline (the call's, or parameters['timeout']) passes there is answered
 * then, on the loop, not when a worker reaches it, and a job left without
 * requests leaves its queue (the sweep, below). */
#include <grpc/byte_buffer_reader.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "infer_req.h"

/* ---- the batch key ------------------------------------------------------------------------ */

#define MAX_SMALL_INPUT 4096 /* rank <= 1 inputs of a batch must be byte-equal: bounded */

bool moed_model_batches(const moed_server *srv, const moed_model *m) {
  /* a built-in op that takes weights takes them inline: each request brings
   * its own weight set, and a merged call can compute with only one */
  return srv->cfg->max_batch_tokens > 0 && moe_op_describe(m->op)->rows_independent &&
         !(m->builtin && moe_op_takes_weights(m->op));
}

typedef struct keybuf {
  uint8_t *p;
  size_t len, cap;
  bool oom;
} keybuf;

static void kb_put(keybuf *k, const void *data, size_t n) {
  if (k->oom) return;
  if (n > SIZE_MAX / 2 - k->len) {
    k->oom = true;
    return;
  }
  if (k->len + n > k->cap) {
    size_t cap = (k->len + n) * 2 + 64;
    uint8_t *g = realloc(k->p, cap);
    if (!g) {
      k->oom = true;
      return;
    }
    k->p = g;
    k->cap = cap;
  }
  memcpy(k->p + k->len, data, n);
  k->len += n;
}

static void kb_str(keybuf *k, const char *s) { kb_put(k, s ? s : "", strlen(s ? s : "") + 1); }

static int cmp_param(const void *a, const void *b) {
  return strcmp((*(const moe_param *const *)a)->name, (*(const moe_param *const *)b)->name);
}
static int cmp_input(const void *a, const void *b) {
  return strcmp((*(const moe_named_tensor *const *)a)->name, (*(const moe_named_tensor *const *)b)->name);
}

/* Whether r may be merged with others along the first axis, and the key
 * that must be equal for two requests to merge: the parameters (sorted by
 * name), each input's name, dtype and trailing dims (sorted by name), and
 * the bytes of inputs of rank <= 1 (a static scale, a bias: shared by the
 * whole batch, so they must be the same). Rows = the first dim shared by
 * every input of rank >= 2. The op library guarantees that such an op's row
 * r depends on row r of its inputs only (moe_op_info.rows_independent). */
void moed_batch_key(moed_infer_req *r, const moed_server *srv) {
  const moed_config *cfg = srv->cfg;
  if (!moed_model_batches(srv, r->model)) return;
  int64_t rows = 0;
  const moe_named_tensor *ins[MOED_MAX_TENSORS];
  const moe_param *ps[MOED_MAX_PARAMS];
  for (size_t i = 0; i < r->n_in; i++) {
    const moe_tensor *t = &r->in[i].tensor;
    for (size_t j = 0; j < i; j++)
      if (strcmp(r->in[j].name, r->in[i].name) == 0) return; /* ambiguous: the op will say so */
    if (t->ndim >= 2) {
      if (rows && t->shape[0] != rows) return;
      rows = t->shape[0];
    } else if (t->nbytes > MAX_SMALL_INPUT) {
      return;
    }
    ins[i] = &r->in[i];
  }
  if (rows <= 0 || rows > cfg->max_batch_tokens) return;
  for (size_t i = 0; i < r->n_params; i++) {
    for (size_t j = 0; j < i; j++)
      if (strcmp(r->params[j].name, r->params[i].name) == 0) return;
    ps[i] = &r->params[i];
  }
  qsort(ins, r->n_in, sizeof ins[0], cmp_input);
  qsort(ps, r->n_params, sizeof ps[0], cmp_param);
  keybuf k = {0};
  for (size_t i = 0; i < r->n_params; i++) {
    const moe_param *p = ps[i];
    uint8_t type = (uint8_t)p->type;
    kb_str(&k, p->name);
    kb_put(&k, &type, 1);
    switch (p->type) {
    case MOE_PARAM_STRING: kb_str(&k, p->s); break;
    case MOE_PARAM_BOOL: kb_put(&k, &p->b, sizeof p->b); break;
    case MOE_PARAM_INT: kb_put(&k, &p->i, sizeof p->i); break;
    case MOE_PARAM_DOUBLE: kb_put(&k, &p->d, sizeof p->d); break;
    }
  }
  for (size_t i = 0; i < r->n_in; i++) {
    const moe_tensor *t = &ins[i]->tensor;
    int32_t head[2] = {(int32_t)t->dtype, t->ndim};
    kb_str(&k, ins[i]->name);
    kb_put(&k, head, sizeof head);
    if (t->ndim >= 2) {
      kb_put(&k, &t->shape[1], sizeof t->shape[0] * (size_t)(t->ndim - 1));
    } else {
      kb_put(&k, t->shape, sizeof t->shape[0] * (size_t)t->ndim);
      kb_put(&k, &t->nbytes, sizeof t->nbytes);
      if (t->nbytes) kb_put(&k, t->data, t->nbytes);
    }
  }
  if (k.oom) {
    free(k.p);
    return; /* unbatched is always correct */
  }
  r->key = k.p;
  r->key_len = k.len;
  r->rows = rows;
}

int64_t moed_infer_batch_rows(const moed_infer_req *r) { return r->code ? 0 : r->rows; }

bool moed_infer_same_batch(const moed_infer_req *a, const moed_infer_req *b) {
  return a->model == b->model && a->key_len == b->key_len && memcmp(a->key, b->key, a->key_len) == 0;
}

/* ---- the batcher --------------------------------------------------------------------- */

typedef struct open_batch {
  struct open_batch *next;
  uv_timer_t timer;
  moed_batcher *owner;
  moed_infer_req **reqs;
  size_t n, cap;
  int64_t rows;
  int priority; /* every request's level */
  uint64_t seq; /* creation order: the oldest held batch goes first */
  bool due;     /* its delay passed: held only while the devices are busy */
} open_batch;

struct infer_job;

struct moed_batcher {
  moed_server *srv;
  open_batch *open;
  size_t held; /* requests in open batches */
  /* our jobs in the device queues that no worker has taken yet (watch_mu);
   * the timer fires at the earliest deadline among their requests (loop) */
  struct infer_job *watched;
  uv_timer_t expiry;
  uint64_t armed_ns; /* the deadline the timer is set for; UINT64_MAX: none */
  uint64_t seq;      /* batches created */
  /* a worker finishing a job wakes the loop through this while a due batch
   * is held (holding: set before each busy check, so that a worker that
   * frees up after the check sees it) */
  uv_async_t wake;
  _Atomic bool holding;
  int closed; /* handles closed (destroy) */
};

/* ---- jobs ------------------------------------------------------------------------- */

/* A queued job's requests are answered by whoever comes first: the worker
 * that takes the job, or the sweep for those whose caller gave up. One
 * lock for the process's one batcher: a job may outlive the batcher (the
 * device queues stop after the loop), never this lock. Order: watch_mu,
 * then the device queues' lock (moed_devices_withdraw), never the reverse. */
static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;

typedef struct infer_job {
  moed_job job;
  moed_server *srv;
  moed_request *raw;                /* a large request, decoded on the worker */
  struct infer_job *wnext, **wprev; /* in the batcher's watch list (watch_mu); wprev NULL: not */
  uint64_t deadline_ns;             /* its requests' earliest (watch_mu) */
  bool abandoned;                   /* every request answered by the sweep; its worker frees it (watch_mu) */
  size_t n;                         /* requests left to run (watch_mu until taken) */
  moed_infer_req *reqs[];
} infer_job;

static void unwatch_locked(infer_job *j) {
  if (!j->wprev) return;
  *j->wprev = j->wnext;
  if (j->wnext) j->wnext->wprev = j->wprev;
  j->wprev = NULL;
}

/* The worker's claim on j: false when the sweep answered all of it. */
static bool take(infer_job *j) {
  pthread_mutex_lock(&watch_mu);
  bool abandoned = j->abandoned;
  unwatch_locked(j);
  pthread_mutex_unlock(&watch_mu);
  if (abandoned) free(j);
  return !abandoned;
}

static void infer_job_run(moed_job *job, moe_backend *b) {
  infer_job *j = (infer_job *)job;
  if (!take(j)) return;
  if (j->raw) {
    moed_infer_req *r = moed_infer_decode(j->srv, j->raw);
    if (r) moed_infer_run_timed(j->srv, b, &r, 1, job->phases, job->answerer);
  } else {
    moed_infer_run_timed(j->srv, b, j->reqs, j->n, job->phases, job->answerer);
  }
  free(j);
}

static void infer_job_cancel(moed_job *job, moe_backend *b) {
  (void)b;
  infer_job *j = (infer_job *)job;
  if (!take(j)) return;
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

/* ---- abandoned work in the device queues -------------------------------------------- */

/* A request whose caller gave up (cancelled the call, or its deadline or
 * parameters['timeout'] passed) while its job waits is answered then, by
 * the sweep on the loop, not when a worker reaches it; a job left without
 * requests is withdrawn from its device queue, so that it stops counting
 * against --max-queue-size at once; the same in the open batches, whose
 * requests count against that bound too. The sweep runs at each deadline (a
 * timer), after calls were cancelled (rpc.c's on_cancel; the REST port
 * when a client leaves) and before a job is refused as the queue is full. */

static void on_expiry(uv_timer_t *t);
static size_t purge_open(moed_batcher *b, uint64_t *next);
static void flush_due(moed_batcher *b);

/* Sets the timer for `at` if that is sooner than the one set (loop thread). */
static void expiry_arm(moed_batcher *b, uint64_t at) {
  if (at >= b->armed_ns) return;
  const uint64_t now = moed_now_ns();
  const uint64_t ms = at > now ? (at - now + 999999) / 1000000 : 0; /* never early: libuv counts ms */
  b->armed_ns = at;
  uv_timer_start(&b->expiry, on_expiry, ms, 0);
}

/* Queues an infer job on the devices, watched (loop thread; a
 * moed_submit_fn). false: the queue is full (it is not queued). */
static bool watch_submit(moed_server *s, moed_job *job) {
  infer_job *j = (infer_job *)job;
  moed_batcher *b = s->batcher;
  const uint64_t deadline = j->deadline_ns; /* once submitted, j is the worker's to free */
  if (b) { /* before the submit: a worker may take j at once, and unwatches it then */
    pthread_mutex_lock(&watch_mu);
    j->wnext = b->watched;
    if (j->wnext) j->wnext->wprev = &j->wnext;
    j->wprev = &b->watched;
    b->watched = j;
    pthread_mutex_unlock(&watch_mu);
  }
  if (!moed_devices_submit(s->devices, &j->job)) {
    if (b) {
      pthread_mutex_lock(&watch_mu);
      unwatch_locked(j);
      pthread_mutex_unlock(&watch_mu);
    }
    return false;
  }
  if (b && deadline != UINT64_MAX) expiry_arm(b, deadline);
  return true;
}

#define SWEEP_BATCH 64 /* answered per pass, outside the lock */

/* One pass of the sweep: takes up to max requests whose callers gave up at
 * `now` out of the watched jobs (raw: a job's undecoded request); a job
 * left without requests is withdrawn from its device queue and freed, or,
 * when a worker has just taken it, marked for that worker to free.
 * *next: the earliest deadline left; *withdrawn counts the jobs withdrawn. */
static size_t sweep_pass(moed_batcher *b, uint64_t now, moed_infer_req **out, moed_request **raw_out,
                         size_t *n_raw, size_t max, uint64_t *next, size_t *withdrawn) {
  size_t got = 0;
  *next = UINT64_MAX;
  *n_raw = 0;
  pthread_mutex_lock(&watch_mu);
  for (infer_job *j = b->watched, *jn; j && got + *n_raw < max; j = jn) {
    jn = j->wnext;
    if (j->raw) {
      if (moed_caller_gone(j->deadline_ns, j->raw->rpc, now)) {
        raw_out[(*n_raw)++] = j->raw;
        j->raw = NULL;
      } else if (j->deadline_ns < *next) {
        *next = j->deadline_ns;
      }
    } else {
      size_t live = 0;
      j->deadline_ns = UINT64_MAX;
      for (size_t k = 0; k < j->n; k++) {
        moed_infer_req *r = j->reqs[k];
        if (got + *n_raw < max && moed_caller_gone(r->deadline_ns, r->req->rpc, now)) {
          out[got++] = r;
          continue;
        }
        j->reqs[live++] = r; /* still wanted, or the next pass takes it */
        if (r->deadline_ns < j->deadline_ns) j->deadline_ns = r->deadline_ns;
      }
      j->n = live;
      if (j->deadline_ns < *next) *next = j->deadline_ns;
    }
    if (j->raw || j->n) continue;
    unwatch_locked(j);
    if (moed_devices_withdraw(b->srv->devices, &j->job)) {
      free(j);
      (*withdrawn)++;
    } else {
      j->abandoned = true; /* a worker took it and waits for this lock */
    }
  }
  pthread_mutex_unlock(&watch_mu);
  return got;
}

size_t moed_batcher_sweep(moed_batcher *b) {
  if (!b) return 0;
  moed_server *s = b->srv;
  moed_infer_req *reqs[SWEEP_BATCH];
  moed_request *raw[SWEEP_BATCH];
  size_t n, n_raw, withdrawn = 0;
  uint64_t next, next_open;
  purge_open(b, &next_open);
  do {
    const uint64_t now = moed_now_ns();
    n = sweep_pass(b, now, reqs, raw, &n_raw, SWEEP_BATCH, &next, &withdrawn);
    for (size_t k = 0; k < n; k++) {
      char err[MOED_ERR_LEN];
      grpc_status_code code = moed_infer_unwanted(s, reqs[k], false, err);
      moed_infer_finish(s, reqs[k], code ? code : GRPC_STATUS_DEADLINE_EXCEEDED,
                        code ? err : "deadline exceeded before the work started", NULL, NULL, 0);
    }
    for (size_t k = 0; k < n_raw; k++) {
      const bool late = now >= moed_rpc_deadline_ns(raw[k]->rpc);
      moed_request_reject(s, raw[k], late ? GRPC_STATUS_DEADLINE_EXCEEDED : GRPC_STATUS_CANCELLED,
                          late ? "deadline exceeded before the work started" : "call cancelled");
    }
  } while (n + n_raw == SWEEP_BATCH);
  if (next_open < next) next = next_open;
  if (next != UINT64_MAX) expiry_arm(b, next);
  if (withdrawn) flush_due(b); /* held batches may have waited for the jobs withdrawn */
  return withdrawn;
}

static void on_expiry(uv_timer_t *t) {
  moed_batcher *b = t->data;
  b->armed_ns = UINT64_MAX;
  moed_batcher_sweep(b);
}

bool moed_batcher_queue(moed_server *s, moed_job *job, moed_submit_fn submit) {
  return submit(s, job) || (moed_batcher_sweep(s->batcher) && submit(s, job));
}

void moed_infer_dispatch(moed_server *s, moed_infer_req **reqs, size_t n) {
  size_t live = 0;
  for (size_t k = 0; k < n; k++) { /* a caller that gave up in an open batch: answered now */
    char err[MOED_ERR_LEN];
    grpc_status_code code = moed_infer_unwanted(s, reqs[k], false, err);
    if (code)
      moed_infer_finish(s, reqs[k], code, err, NULL, NULL, 0);
    else
      reqs[live++] = reqs[k];
  }
  if (!live) return;
  n = live;
  infer_job *j = job_new(s, n);
  if (j) {
    memcpy(j->reqs, reqs, n * sizeof *reqs);
    j->job.priority = MOED_PRIORITY_LEVELS; /* a merged call runs at its highest request's level */
    j->deadline_ns = UINT64_MAX;
    for (size_t k = 0; k < n; k++) {
      if (reqs[k]->priority < j->job.priority) j->job.priority = reqs[k]->priority;
      if (reqs[k]->deadline_ns < j->deadline_ns) j->deadline_ns = reqs[k]->deadline_ns;
    }
    if (moed_batcher_queue(s, &j->job, watch_submit)) return;
    free(j);
  }
  atomic_fetch_add(&s->rejected, n);
  for (size_t k = 0; k < n; k++)
    moed_infer_reject(s, reqs[k], GRPC_STATUS_UNAVAILABLE, "device queue full");
}

/* The queue level of a request not decoded yet, from its message's first
 * bytes (decoding rejects a bad value later; here it is the default). */
static int raw_priority(const moed_request *req) {
  grpc_byte_buffer_reader rd;
  grpc_slice first;
  int64_t v = -1;
  if (!req->payload || !grpc_byte_buffer_reader_init(&rd, req->payload)) return MOED_PRIORITY_DEFAULT;
  if (grpc_byte_buffer_reader_next(&rd, &first)) {
    v = moed_kserve_int_param(GRPC_SLICE_START_PTR(first), GRPC_SLICE_LENGTH(first), true, "priority");
    grpc_slice_unref(first);
  }
  grpc_byte_buffer_reader_destroy(&rd);
  return v >= 1 && v <= MOED_PRIORITY_LEVELS ? (int)v : MOED_PRIORITY_DEFAULT;
}

void moed_infer_dispatch_raw(moed_server *s, moed_request *req) {
  infer_job *j = job_new(s, 0);
  if (j) {
    j->raw = req;
    j->job.priority = raw_priority(req);
    j->deadline_ns = moed_rpc_deadline_ns(req->rpc); /* parameters['timeout'] is read on the worker */
    if (moed_batcher_queue(s, &j->job, watch_submit)) return;
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

/* Sends ob to the device queues (whatever their load) and closes it. */
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

/* Answers the requests of open batches whose callers gave up; a batch left
 * empty is closed (its flush queues nothing). Returns how many; *next: the
 * earliest deadline among those left (UINT64_MAX: none). */
static size_t purge_open(moed_batcher *b, uint64_t *next) {
  size_t gone = 0;
  *next = UINT64_MAX;
  for (open_batch *ob = b->open, *ob_next; ob; ob = ob_next) {
    ob_next = ob->next;
    size_t live = 0;
    for (size_t k = 0; k < ob->n; k++) {
      moed_infer_req *r = ob->reqs[k];
      char err[MOED_ERR_LEN];
      grpc_status_code code = moed_infer_unwanted(b->srv, r, false, err);
      if (!code) {
        ob->reqs[live++] = r;
        if (r->deadline_ns < *next) *next = r->deadline_ns;
        continue;
      }
      ob->rows -= moed_infer_batch_rows(r);
      moed_infer_finish(b->srv, r, code, err, NULL, NULL, 0);
    }
    gone += ob->n - live;
    b->held -= ob->n - live;
    ob->n = live;
    if (!live) flush(b, ob);
  }
  return gone;
}

/* The due batch to send first: the highest level, then the oldest. */
static open_batch *first_due(const moed_batcher *b) {
  open_batch *best = NULL;
  for (open_batch *ob = b->open; ob; ob = ob->next)
    if (ob->due &&
        (!best || ob->priority < best->priority || (ob->priority == best->priority && ob->seq < best->seq)))
      best = ob;
  return best;
}

/* Sends the due batches while a worker is free for them. When the first
 * must wait, so do the rest (busy for a level is busy for every lower one). */
static void flush_due(moed_batcher *b) {
  open_batch *ob;
  while ((ob = first_due(b))) {
    atomic_store(&b->holding, true); /* before the check: see the struct */
    if (moed_devices_busy(b->srv->devices, ob->priority)) return;
    flush(b, ob);
  }
  atomic_store(&b->holding, false);
}

static void on_timer(uv_timer_t *t) {
  open_batch *ob = t->data;
  ob->due = true;
  flush_due(ob->owner);
}

static void on_wake(uv_async_t *h) { flush_due(h->data); }

/* A worker finished a job (its thread, under the device queues' lock). */
static void on_worker_free(void *arg) {
  moed_batcher *b = arg;
  if (atomic_load(&b->holding)) uv_async_send(&b->wake);
}

static open_batch *batch_new(moed_batcher *b, int priority) {
  open_batch *ob = calloc(1, sizeof *ob);
  if (!ob) return NULL;
  ob->owner = b;
  ob->priority = priority;
  ob->seq = b->seq++;
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
  const size_t max_held = (size_t)s->cfg->max_queue_size;
  uint64_t next;
  if (b->held >= max_held) purge_open(b, &next); /* callers that gave up hold no places */
  for (open_batch *ob; b->held >= max_held && (ob = first_due(b));)
    flush(b, ob); /* held only to grow: sent, they free places here before a request is refused */
  if (b->held >= max_held) {
    atomic_fetch_add(&s->rejected, 1);
    moed_infer_reject(s, r, GRPC_STATUS_UNAVAILABLE, "batch queue full");
    return;
  }
  int64_t rows = moed_infer_batch_rows(r);
  open_batch *ob = b->open;
  while (ob && !(ob->priority == r->priority && moed_infer_same_batch(ob->reqs[0], r)))
    ob = ob->next;
  if (ob && ob->rows + rows > s->cfg->max_batch_tokens) { /* full: send it, start another */
    flush(b, ob);
    ob = NULL;
  }
  if (!ob && !(ob = batch_new(b, r->priority))) {
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
  if (r->deadline_ns != UINT64_MAX) expiry_arm(b, r->deadline_ns); /* answered then if still held */
  if (ob->rows >= s->cfg->max_batch_tokens) flush(b, ob);
}

int moed_batcher_create(moed_server *s, moed_batcher **out) {
  moed_batcher *b = calloc(1, sizeof *b);
  if (!b) return -1;
  b->srv = s;
  b->armed_ns = UINT64_MAX;
  if (uv_async_init(s->loop, &b->wake, on_wake) != 0) {
    free(b);
    return -1;
  }
  b->wake.data = b;
  uv_timer_init(s->loop, &b->expiry);
  b->expiry.data = b;
  uv_unref((uv_handle_t *)&b->wake); /* held batches never keep a stopping loop alive */
  moed_devices_on_free(s->devices, on_worker_free, b);
  *out = b;
  return 0;
}

size_t moed_batcher_held(const moed_batcher *b) { return b ? b->held : 0; }

void moed_batcher_flush_all(moed_batcher *b) {
  while (b->open)
    flush(b, b->open);
}

/* b goes with the last of its two handles (libuv's order of close callbacks is its own). */
static void on_handle_closed(uv_handle_t *h) {
  moed_batcher *b = h->data;
  if (++b->closed == 2) free(b);
}

void moed_batcher_destroy(moed_batcher *b) {
  if (!b) return;
  moed_devices_on_free(b->srv->devices, NULL, NULL); /* no worker touches b->wake after this */
  uv_close((uv_handle_t *)&b->wake, on_handle_closed);
  moed_batcher_flush_all(b);
  pthread_mutex_lock(&watch_mu); /* jobs still queued run (or are cancelled) unwatched */
  while (b->watched)
    unwatch_locked(b->watched);
  pthread_mutex_unlock(&watch_mu);
  /* the batches' timers only point at their batch, freed on close; b goes with its own two */
  uv_close((uv_handle_t *)&b->expiry, on_handle_closed);
}
