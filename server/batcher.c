/* batcher: merges inference requests for the same model and the same
 * parameters along the token axis (docs/design.md "Batching"), on the loop
 * thread. Decoding's last step computes a request's batch key
 * (moed_batch_key, here since only batching reads it); a request joins the
 * open batch with the same key; a batch goes to the device queues when it holds
 * max_batch_tokens rows or when its timer (max_queue_delay_us, rounded up
 * to libuv's milliseconds) fires. Delay 0 still merges what arrived in the
 * same loop iteration: the timer fires in the next one. Requests held here
 * are bounded by max_queue_size (beyond: UNAVAILABLE).
 *
 * Also the inference jobs themselves: one job = one batch (or one large
 * request decoded on the worker). */
#include <grpc/byte_buffer_reader.h>
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
    j->job.priority = MOED_PRIORITY_LEVELS; /* a merged call runs at its highest request's level */
    for (size_t k = 0; k < n; k++)
      if (reqs[k]->priority < j->job.priority) j->job.priority = reqs[k]->priority;
    if (moed_devices_submit(s->devices, &j->job)) return;
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

size_t moed_batcher_held(const moed_batcher *b) { return b ? b->held : 0; }

void moed_batcher_flush_all(moed_batcher *b) {
  while (b->open)
    flush(b, b->open);
}

void moed_batcher_destroy(moed_batcher *b) {
  if (!b) return;
  moed_batcher_flush_all(b);
  free(b); /* the batches' timers only point at their batch, freed on close */
}
