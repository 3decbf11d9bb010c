/* infer_run: decoded requests -> one op call on a worker's backend -> each
 * request's outputs (infer_req.h). Requests with the same batch key run as
 * one call along the first axis, whose outputs are split back by rows;
 * inputs and outputs are staged into the backend's memory (none of that on
 * host backends, whose outputs go to gRPC as slices without a copy). On a
 * device, per call: the inputs in one allocation with one gathered copy,
 * the op's kernels queued behind it without a wait, the outputs' copies
 * queued behind those, and one wait; each step's time goes to the
 * worker's phase sums (moed_phases). A merged batch on a device with an
 * answer thread is not waited for at once: it is held (its answerer's
 * `launched`) while the worker stages and launches the next batch behind
 * it, so that the device goes from one batch to the next without the
 * host's staging between them; then the held one's outputs are completed
 * and its answers posted. At most one batch waits that way per worker. */
#include <stdlib.h>
#include <string.h>

#include "infer_req.h"

/* The phase clock of one job: each lap's time since the last goes to a
 * phase of ph (NULL: only the clock runs). */
typedef struct laps {
  moed_phases *ph;
  uint64_t at;
} laps;

static void lap(laps *l, moed_phase p) {
  const uint64_t now = moed_now_ns();
  if (l->ph) l->ph->ns[p] += now - l->at;
  l->at = now;
}

/* One op call and the memory it uses. */
typedef struct run_ctx {
  moed_server *srv;
  moe_backend *b;
  moe_call *call;
  laps *laps;
  void *device_in; /* one block for the device copies of every input (non-host backends) */
  bool out_queued; /* copies to host_out queued, not yet synchronized */
  bool defer;      /* the caller may complete the copies later (deferred, group) */
  bool deferred;   /* they are queued as the backend's copy group `group` */
  uint64_t group;
  void *outputs[MOED_MAX_TENSORS];  /* output buffers (backend memory) */
  void *host_out[MOED_MAX_TENSORS]; /* host copies (non-host backends) */
  moed_weights *cached;             /* inline fused_moe weights from the cache */
  size_t num_out;
  moed_infer_req **reqs; /* the requests the call serves (its stop check) */
  size_t n_reqs;
  bool stopped; /* the op stopped early (run_stop) */
  char err[MOED_ERR_LEN];
} run_ctx;

bool moed_caller_gone(uint64_t deadline_ns, const moed_rpc *rpc, uint64_t now) {
  return now >= deadline_ns || moed_rpc_cancelled(rpc);
}

/* A running op stops once nobody waits for it (every caller cancelled or
 * past its deadline) or the drain timeout has passed (moed_server.stop_work).
 * Called from the op's threads. */
static bool run_stop(void *ctx) {
  const run_ctx *c = ctx;
  if (atomic_load(&c->srv->stop_work)) return true;
  const uint64_t now = moed_now_ns();
  for (size_t k = 0; k < c->n_reqs; k++)
    if (!moed_caller_gone(c->reqs[k]->deadline_ns, c->reqs[k]->req->rpc, now)) return false;
  return true;
}

/* Why r's work is not done (OK: it is still wanted): its caller cancelled,
 * its deadline passed, or, for an op that ran and was stopped (`stopped`),
 * the drain timeout passed. Work is skipped when nobody waits for it or it
 * is already too late. */
grpc_status_code moed_infer_unwanted(const moed_server *srv, const moed_infer_req *r, bool stopped,
                                     char *err) {
  if (stopped && atomic_load(&srv->stop_work))
    return moed_failf(err, GRPC_STATUS_UNAVAILABLE,
                      "server shutting down: work stopped at the drain timeout");
  /* the deadline first: gRPC core cancels a call whose deadline passed */
  if (moed_now_ns() >= r->deadline_ns) {
    const char *when = stopped ? "while running: the work was stopped" : "before the work started";
    if (r->timeout_us)
      return moed_failf(err, GRPC_STATUS_DEADLINE_EXCEEDED, "parameters['timeout']: %llu us passed %s",
                        (unsigned long long)r->timeout_us, when);
    return moed_failf(err, GRPC_STATUS_DEADLINE_EXCEEDED, "deadline exceeded %s", when);
  }
  if (moed_rpc_cancelled(r->req->rpc)) return moed_failf(err, GRPC_STATUS_CANCELLED, "call cancelled");
  return GRPC_STATUS_OK;
}

static void ctx_cleanup(run_ctx *c) {
  /* a copy into host_out still queued (an error after it): done before host_out goes */
  if (c->out_queued) moe_backend_synchronize(c->b);
  if (c->device_in) moe_backend_free(c->b, c->device_in);
  for (size_t i = 0; i < MOED_MAX_TENSORS; i++) {
    if (c->outputs[i]) {
      if (moe_backend_is_host(c->b))
        moed_hostmem_free(c->outputs[i]);
      else
        moe_backend_free(c->b, c->outputs[i]);
    }
    moed_hostmem_free(c->host_out[i]);
  }
  if (c->cached) moed_weight_cache_release(c->srv->weights, c->cached);
  moe_call_destroy(c->call);
}

/* Inline weights (the op table's MOE_INPUT_WEIGHT inputs of a built-in; an
 * expert set holds its own) through the device cache: a hit skips their
 * copy to the device. Rebinds the weight inputs; *done[i] marks them. */
static void bind_cached_weights(run_ctx *c, const moed_model *m, bool *done) {
  if (!c->srv->weights || !m->builtin || !moe_op_takes_weights(m->op)) return;
  if (moe_backend_is_host(c->b) && !c->srv->cfg->cache_host) return; /* host backends read in place */
  const moe_op_io_desc *desc = moe_op_describe(m->op)->inputs;       /* in the call's input order */
  moe_named_tensor w[MOED_MAX_TENSORS];
  size_t idx[MOED_MAX_TENSORS], n = 0;
  for (size_t i = 0; i < moe_call_num_inputs(c->call) && i < MOED_MAX_TENSORS; i++) {
    moe_named_tensor *t = moe_call_input(c->call, i);
    if (t->name && t->tensor.data && (desc[i].flags & MOE_INPUT_WEIGHT)) {
      w[n] = *t;
      idx[n++] = i;
    }
  }
  void *data[MOED_MAX_TENSORS];
  if (!n || !(c->cached = moed_weight_cache_get(c->srv->weights, c->b, w, n, data))) return;
  for (size_t k = 0; k < n; k++) {
    moe_call_input(c->call, idx[k])->tensor.data = data[k];
    done[idx[k]] = true;
  }
}

#define DEVICE_ALIGN 256 /* each input's place in the inputs' block: the alignment of a block of its own */

/* The inputs to the device (non-host backends): one block holds them all,
 * each at a DEVICE_ALIGN offset, filled by one gathered copy. */
static grpc_status_code inputs_to_device(run_ctx *c, const bool *done) {
  const void *src[MOED_MAX_TENSORS];
  size_t off[MOED_MAX_TENSORS], len[MOED_MAX_TENSORS], idx[MOED_MAX_TENSORS], n = 0, end = 0;
  for (size_t i = 0; i < moe_call_num_inputs(c->call) && i < MOED_MAX_TENSORS; i++) {
    const moe_named_tensor *t = moe_call_input(c->call, i);
    if (done[i] || !t->name || !t->tensor.data || !t->tensor.nbytes) continue;
    if (end > SIZE_MAX - DEVICE_ALIGN || t->tensor.nbytes > SIZE_MAX - DEVICE_ALIGN - end)
      return moed_failf(c->err, GRPC_STATUS_RESOURCE_EXHAUSTED, "device memory exhausted for input '%s'",
                        t->name);
    src[n] = t->tensor.data;
    off[n] = (end + DEVICE_ALIGN - 1) & ~(size_t)(DEVICE_ALIGN - 1);
    len[n] = t->tensor.nbytes;
    idx[n++] = i;
    end = off[n - 1] + len[n - 1];
  }
  if (!n) return GRPC_STATUS_OK;
  if (moe_backend_alloc(c->b, end, &c->device_in) != MOE_OK)
    return moed_failf(c->err, GRPC_STATUS_RESOURCE_EXHAUSTED, "device memory exhausted for input '%s'",
                      moe_call_input(c->call, idx[0])->name);
  if (moe_backend_copy_in_gather(c->b, c->device_in, src, off, len, n) != MOE_OK)
    return moed_failf(c->err, GRPC_STATUS_INTERNAL, "copy of input '%s' to the device failed",
                      moe_call_input(c->call, idx[0])->name);
  for (size_t k = 0; k < n; k++)
    moe_call_input(c->call, idx[k])->tensor.data = (char *)c->device_in + off[k];
  return GRPC_STATUS_OK;
}

/* Backend memory for the outputs and (devices) the inputs, copied in. */
static grpc_status_code bind_memory(run_ctx *c, const moed_model *m) {
  moe_backend *b = c->b;
  bool host = moe_backend_is_host(b);
  bool done[MOED_MAX_TENSORS] = {false};
  bind_cached_weights(c, m, done);
  for (size_t i = 0; i < c->num_out; i++) {
    moe_named_tensor *o = moe_call_output(c->call, i);
    void *p = NULL;
    if (host)
      p = moed_hostmem_alloc(o->tensor.nbytes);
    else if (moe_backend_alloc(b, o->tensor.nbytes ? o->tensor.nbytes : 1, &p) != MOE_OK)
      p = NULL;
    if (!p)
      return moed_failf(c->err, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for output '%s'", o->name);
    c->outputs[i] = p;
    o->tensor.data = p;
  }
  lap(c->laps, MOED_PHASE_PREPARE);
  if (host) return GRPC_STATUS_OK;
  grpc_status_code code = inputs_to_device(c, done);
  lap(c->laps, MOED_PHASE_COPY_IN);
  return code;
}

/* Non-host backends: the outputs' copies to host buffers, queued behind
 * the op (complete at the next synchronize). */
static grpc_status_code queue_copy_out(run_ctx *c) {
  for (size_t i = 0; i < c->num_out; i++) {
    moe_named_tensor *o = moe_call_output(c->call, i);
    c->host_out[i] = moed_hostmem_alloc(o->tensor.nbytes);
    if (!c->host_out[i])
      return moed_failf(c->err, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for output '%s'", o->name);
    c->out_queued = true;
    if (moe_backend_copy_out_async(c->b, c->host_out[i], o->tensor.data, o->tensor.nbytes) != MOE_OK)
      return moed_failf(c->err, GRPC_STATUS_INTERNAL, "copy of output '%s' from the device failed", o->name);
  }
  return GRPC_STATUS_OK;
}

/* Host buffers of the outputs: the outputs themselves on host backends,
 * the copies otherwise. Ownership moves to the caller (take[i]). */
static void take_outputs(run_ctx *c, void **take) {
  bool host = moe_backend_is_host(c->b);
  for (size_t i = 0; i < c->num_out; i++) {
    void **owner = host ? &c->outputs[i] : &c->host_out[i];
    take[i] = *owner;
    *owner = NULL;
  }
}

/* prepare + memory + run + outputs to the host; on error c->err. The
 * caller sets t->start_ns where its staging began; t's input, infer and
 * output are filled here. On a device the outputs' copies are queued
 * behind the op and waited for with it: infer is the op and that copy (a
 * few microseconds for decode batches), output the host's part of it. */
static grpc_status_code run_call(run_ctx *c, const moed_model *m, const moe_named_tensor *in, size_t n_in,
                                 const moe_param *params, size_t n_params, void **host_outs, moed_timing *t) {
  moe_params mp = {params, n_params};
  moe_error err = {{0}};
  moe_status ms = moe_op_prepare(m->op, in, n_in, &mp, m->set, &c->call, &err);
  if (ms != MOE_OK) return moed_failf(c->err, moed_status_from_moe(ms), "%s", err.msg);
  /* a call the worker's backend has no kernel for (a fused_moe scheme or
   * biases the GPU lacks) runs on its host fallback, as whole ops do
   * (moed_infer_run); without one, moe_call_run answers UNIMPLEMENTED */
  if (c->b && moe_call_check_backend(c->call, c->b, NULL) != MOE_OK)
    c->b = moed_devices_fallback(c->srv->devices, c->b);
  c->num_out = moe_call_num_outputs(c->call);
  if (c->num_out > MOED_MAX_TENSORS)
    return moed_failf(c->err, GRPC_STATUS_INTERNAL, "op has too many outputs");
  grpc_status_code code = bind_memory(c, m);
  if (code) return code;
  const uint64_t staged = c->laps->at; /* bind_memory's last lap */
  t->input_ns = staged - t->start_ns;
  moe_call_set_stop(c->call, run_stop, c);
  if (c->laps->ph) c->laps->ph->executions++;
  ms = moe_call_run(c->call, c->b, &err);
  lap(c->laps, MOED_PHASE_LAUNCH);
  c->stopped = ms == MOE_ECANCELLED;
  if (ms != MOE_OK) return moed_failf(c->err, moed_status_from_moe(ms), "%s", err.msg);
  if (!moe_backend_is_host(c->b)) {
    /* no wait before the copies: they start when the op ends, on the device */
    code = queue_copy_out(c);
    lap(c->laps, MOED_PHASE_COPY_OUT);
    if (code) return code;
    if (c->defer && moe_backend_copy_out_end(c->b, &c->group) == MOE_OK) {
      c->out_queued = false; /* the caller's now: it finishes the group before host_out is read or freed */
      c->deferred = true;
      take_outputs(c, host_outs);
      return GRPC_STATUS_OK;
    }
    c->out_queued = false;
    const moe_status sync = moe_backend_synchronize(c->b);
    lap(c->laps, MOED_PHASE_WAIT);
    if (sync != MOE_OK) return moed_failf(c->err, GRPC_STATUS_INTERNAL, "device synchronize failed");
  }
  const uint64_t ran = c->laps->at;
  t->infer_ns = ran - staged;
  take_outputs(c, host_outs);
  t->output_ns = moed_now_ns() - ran;
  return GRPC_STATUS_OK;
}

/* r's response, from outputs in host memory. */
static grpc_status_code encode(const moed_server *srv, const moed_infer_req *r, const moe_named_tensor *outs,
                               const grpc_slice *data, size_t num_out, grpc_byte_buffer **out,
                               uint64_t *bytes_out, char *err) {
  return moed_kserve_encode(r->msg, r->model->name, r->req->method == MOED_M_MODEL_STREAM_INFER,
                            srv->cfg->max_message_bytes, outs, data, num_out, out, bytes_out, err);
}

static void run_single(moed_server *srv, moe_backend *b, moed_infer_req *r, laps *l) {
  run_ctx c;
  memset(&c, 0, sizeof c);
  c.srv = srv;
  c.b = b;
  c.laps = l;
  c.reqs = &r;
  c.n_reqs = 1;
  moed_timing t = {0};
  uint64_t bytes_out = 0;
  grpc_byte_buffer *resp = NULL;
  void *host[MOED_MAX_TENSORS] = {NULL};
  grpc_slice data[MOED_MAX_TENSORS];
  size_t nd = 0;
  grpc_status_code code = moed_infer_unwanted(srv, r, false, c.err);
  if (code) goto done;
  lap(l, MOED_PHASE_GATHER);
  t.start_ns = l->at;
  code = run_call(&c, r->model, r->in, r->n_in, r->params, r->n_params, host, &t);
  if (c.stopped) code = moed_infer_unwanted(srv, r, true, c.err);
  if (code) goto done;
  moed_stats_record_execution(r->model->stats, moed_infer_batch_size(srv, r), &t);
  const uint64_t encoding = moed_now_ns();
  moe_named_tensor outs[MOED_MAX_TENSORS];
  for (; nd < c.num_out; nd++) { /* each output buffer becomes the slice that owns it */
    outs[nd] = *moe_call_output(c.call, nd);
    data[nd] = moed_hostmem_slice(host[nd], outs[nd].tensor.nbytes);
    host[nd] = NULL;
  }
  code = moed_infer_shm_outputs(r, outs, data, c.num_out, c.err);
  if (!code) code = encode(srv, r, outs, data, c.num_out, &resp, &bytes_out, c.err);
  t.output_ns += moed_now_ns() - encoding;
done:
  for (size_t i = 0; i < nd; i++)
    grpc_slice_unref(data[i]);
  for (size_t i = 0; i < MOED_MAX_TENSORS; i++)
    moed_hostmem_free(host[i]);
  ctx_cleanup(&c);
  moed_infer_finish(srv, r, code, c.err, resp, &t, bytes_out);
  lap(l, MOED_PHASE_ANSWER);
}

/* The outputs of a merged call, shared by the slices of every request's
 * response; freed with the last slice. */
typedef struct shared_outputs {
  _Atomic size_t refs;
  void *buf[MOED_MAX_TENSORS];
} shared_outputs;

static void shared_unref(void *p) {
  shared_outputs *s = p;
  if (atomic_fetch_sub(&s->refs, 1) != 1) return;
  for (size_t i = 0; i < MOED_MAX_TENSORS; i++)
    moed_hostmem_free(s->buf[i]);
  free(s);
}

/* The responses of a merged call: each request's rows of the outputs. */
typedef struct merged_answer {
  moed_answer base; /* on the answer thread */
  moed_server *srv;
  shared_outputs *shared; /* one reference, dropped when done */
  moed_timing t;          /* the batch's */
  /* launched and held (moed_launched): outputs complete with group's copies */
  moe_backend *b;
  uint64_t group;
  moed_answerer *answerer;
  moed_model_stats *stats;
  uint64_t batch; /* Triton's batch size of the execution */
  size_t num_out, n;
  moe_named_tensor outs[MOED_MAX_TENSORS];
  size_t out_row[MOED_MAX_TENSORS]; /* bytes per row of each output */
  moed_infer_req **reqs;            /* answered and freed here */
  moed_infer_req *own[];            /* reqs on the answer thread */
} merged_answer;

static void answer_merged(merged_answer *a) {
  shared_outputs *shared = a->shared;
  int64_t row = 0;
  for (size_t k = 0; k < a->n; k++) {
    moed_infer_req *rk = a->reqs[k];
    moed_timing tk = a->t; /* the batch's times, and this request's encoding */
    const uint64_t encoding = moed_now_ns();
    moe_named_tensor mine[MOED_MAX_TENSORS];
    grpc_slice data[MOED_MAX_TENSORS];
    for (size_t i = 0; i < a->num_out; i++) {
      mine[i] = a->outs[i];
      mine[i].tensor.shape[0] = rk->rows;
      mine[i].tensor.nbytes = a->out_row[i] * (size_t)rk->rows;
      data[i] = grpc_slice_new_with_user_data((uint8_t *)shared->buf[i] + a->out_row[i] * (size_t)row,
                                              mine[i].tensor.nbytes, shared_unref, shared);
    }
    row += rk->rows;
    grpc_byte_buffer *resp = NULL;
    uint64_t bytes_out = 0;
    char err[MOED_ERR_LEN];
    grpc_status_code code = moed_infer_shm_outputs(rk, mine, data, a->num_out, err);
    if (!code) code = encode(a->srv, rk, mine, data, a->num_out, &resp, &bytes_out, err);
    for (size_t i = 0; i < a->num_out; i++)
      grpc_slice_unref(data[i]);
    tk.output_ns += moed_now_ns() - encoding;
    moed_infer_finish(a->srv, rk, code, err, resp, &tk, bytes_out);
    a->reqs[k] = NULL;
  }
  shared_unref(shared);
}

static void answer_async(moed_answer *base) {
  merged_answer *a = (merged_answer *)base;
  answer_merged(a);
  free(a);
}

/* Runs reqs (same batch key, all still wanted) as one call along the first
 * axis, answered on answerer when there is one; false: merging was refused
 * (the caller runs them one by one). */
static bool run_merged(moed_server *srv, moe_backend *b, moed_infer_req **reqs, size_t n, laps *l,
                       moed_answerer *answerer) {
  moed_infer_req *r0 = reqs[0];
  /* the call borrows the model's set: held until the call is gone, since
   * the requests (and their references) are freed as they are answered */
  moed_model *model = r0->model;
  atomic_fetch_add(&model->refs, 1);
  moe_named_tensor in[MOED_MAX_TENSORS];
  void *merged[MOED_MAX_TENSORS] = {NULL};
  void *host[MOED_MAX_TENSORS] = {NULL};
  shared_outputs *shared = NULL;
  run_ctx c;
  memset(&c, 0, sizeof c);
  c.srv = srv;
  c.b = b;
  c.laps = l;
  c.reqs = reqs;
  c.n_reqs = n;
  c.defer = answerer && moed_answerer_launched(answerer);
  bool ok = false;
  moed_timing t = {.start_ns = moed_now_ns()}; /* merging the rows is input staging */
  int64_t total = 0;
  for (size_t k = 0; k < n; k++)
    total += reqs[k]->rows; /* each <= max_batch_tokens: small */

  /* the merged inputs: rank >= 2 concatenated along axis 0, others shared */
  for (size_t i = 0; i < r0->n_in; i++) {
    in[i] = r0->in[i];
    const moe_tensor *t0 = &r0->in[i].tensor;
    if (t0->ndim < 2) continue;
    size_t row_bytes = t0->nbytes / (size_t)t0->shape[0], bytes;
    if (!moe_mul_size(row_bytes, (size_t)total, &bytes) || !(merged[i] = moed_hostmem_alloc(bytes))) goto out;
    size_t off = 0;
    for (size_t k = 0; k < n; k++) {
      const moed_infer_req *rk = reqs[k];
      for (size_t j = 0; j < rk->n_in; j++)
        if (strcmp(rk->in[j].name, in[i].name) == 0) {
          memcpy((uint8_t *)merged[i] + off, rk->in[j].tensor.data, rk->in[j].tensor.nbytes);
          off += rk->in[j].tensor.nbytes;
        }
    }
    if (off != bytes) goto out; /* the key guarantees it; never trust it blindly */
    in[i].tensor.data = merged[i];
    in[i].tensor.shape[0] = total;
    in[i].tensor.nbytes = bytes;
  }
  lap(l, MOED_PHASE_GATHER);
  if (run_call(&c, r0->model, in, r0->n_in, r0->params, r0->n_params, host, &t)) {
    if (!c.stopped) goto out;
    for (size_t k = 0; k < n; k++) { /* stopped: answered here, not run again one by one */
      char err[MOED_ERR_LEN];
      grpc_status_code code = moed_infer_unwanted(srv, reqs[k], true, err);
      moed_infer_finish(srv, reqs[k], code, err, NULL, NULL, 0);
      reqs[k] = NULL;
    }
    ok = true;
    goto out;
  }
  /* every output must be row-major along the same rows to be split */
  moe_named_tensor outs[MOED_MAX_TENSORS];
  size_t out_row[MOED_MAX_TENSORS];
  for (size_t i = 0; i < c.num_out; i++) {
    outs[i] = *moe_call_output(c.call, i);
    const moe_tensor *t = &outs[i].tensor;
    if (t->ndim < 1 || t->shape[0] != total || t->nbytes % (size_t)total) goto out;
    out_row[i] = t->nbytes / (size_t)total;
  }
  uint64_t batch = 0; /* Triton's batch size: the batch-axis rows of every request merged */
  for (size_t k = 0; k < n; k++)
    batch += moed_infer_batch_size(srv, reqs[k]);
  merged_answer here, *a = NULL; /* on the answer thread: a copy of reqs, freed there */
  if (answerer && n <= (SIZE_MAX - sizeof *a) / sizeof *reqs && (a = malloc(sizeof *a + n * sizeof *reqs))) {
    memcpy(a->own, reqs, n * sizeof *reqs);
    a->reqs = a->own;
  } else {
    a = &here;
    a->reqs = reqs;
  }
  if (c.deferred && a == &here) { /* nowhere to hold it: completed now */
    c.deferred = false;
    if (moe_backend_copy_out_finish(c.b, c.group) != MOE_OK) goto out; /* one by one: their own errors */
    t.infer_ns = moed_now_ns() - (t.start_ns + t.input_ns);
  }
  if (!(shared = calloc(1, sizeof *shared))) {
    if (a != &here) free(a);
    goto out;
  }
  memcpy(shared->buf, host, sizeof host);
  memset(host, 0, sizeof host);
  atomic_init(&shared->refs, 1 + n * c.num_out);
  ok = true;
  a->base.run = answer_async;
  a->srv = srv;
  a->shared = shared;
  a->t = t;
  a->num_out = c.num_out;
  a->n = n;
  memcpy(a->outs, outs, sizeof outs);
  memcpy(a->out_row, out_row, sizeof out_row);
  a->b = c.b;
  a->group = c.group;
  a->answerer = answerer;
  a->stats = r0->model->stats;
  a->batch = batch;
  if (c.deferred) { /* held: the batch before it completes now, this one after the next launch */
    c.deferred = false;
    for (size_t k = 0; k < n; k++)
      reqs[k] = NULL;
    moed_infer_launched_finish(moed_answerer_launched(answerer), NULL);
    lap(l, MOED_PHASE_WAIT);
    *moed_answerer_launched(answerer) = a;
  } else {
    moed_stats_record_execution(a->stats, batch, &t);
    if (a == &here) {
      answer_merged(a);
    } else {
      moed_answerer_post(answerer, &a->base);
      for (size_t k = 0; k < n; k++)
        reqs[k] = NULL; /* the answer thread's now */
    }
  }
out:
  /* a group still deferred here was not held (an error after the launch):
   * complete it before its host buffers are freed */
  if (c.deferred) (void)moe_backend_copy_out_finish(c.b, c.group);
  for (size_t i = 0; i < MOED_MAX_TENSORS; i++) {
    moed_hostmem_free(merged[i]);
    moed_hostmem_free(host[i]);
  }
  ctx_cleanup(&c);
  moed_model_release(model);
  lap(l, MOED_PHASE_ANSWER);
  return ok;
}

void moed_infer_launched_finish(moed_launched **slot, moed_phases *ph) {
  merged_answer *a = *slot;
  if (!a) return;
  *slot = NULL;
  const uint64_t t0 = moed_now_ns();
  const moe_status s = moe_backend_copy_out_finish(a->b, a->group);
  const uint64_t now = moed_now_ns();
  if (ph) ph->ns[MOED_PHASE_WAIT] += now - t0;
  if (s != MOE_OK) { /* the outputs never came: nothing to answer with */
    for (size_t k = 0; k < a->n; k++) {
      char err[MOED_ERR_LEN];
      moed_failf(err, GRPC_STATUS_INTERNAL, "device failed while running the batch (%s)", moe_strerror(s));
      moed_infer_finish(a->srv, a->reqs[k], GRPC_STATUS_INTERNAL, err, NULL, NULL, 0);
    }
    shared_unref(a->shared);
    free(a);
    return;
  }
  a->t.infer_ns = now - (a->t.start_ns + a->t.input_ns);
  moed_stats_record_execution(a->stats, a->batch, &a->t);
  moed_answerer_post(a->answerer, &a->base);
}

void moed_infer_run(moed_server *srv, moe_backend *b, moed_infer_req **reqs, size_t n) {
  moed_infer_run_timed(srv, b, reqs, n, NULL, NULL);
}

void moed_infer_run_timed(moed_server *srv, moe_backend *b, moed_infer_req **reqs, size_t n, moed_phases *ph,
                          moed_answerer *answerer) {
  laps l = {ph, moed_now_ns()};
  size_t live = 0;
  for (size_t k = 0; k < n; k++) { /* answer what failed or is no longer wanted */
    moed_infer_req *r = reqs[k];
    char err[MOED_ERR_LEN];
    grpc_status_code code = r->code ? r->code : moed_infer_unwanted(srv, r, false, err);
    /* inputs still in shared memory become the request's own before anything reads them */
    if (!code && (r->code = moed_infer_shm_inputs(r))) code = r->code;
    if (code)
      moed_infer_finish(srv, r, code, r->code ? r->err : err, NULL, NULL, 0);
    else
      reqs[live++] = r;
  }
  /* every request here is for one model (the batch key): an op this
   * backend has no kernel for runs on the worker's host fallback */
  if (live && b && !moe_op_supported(reqs[0]->model->op, b)) b = moed_devices_fallback(srv->devices, b);
  /* a batch held from an earlier job that this job does not replace is
   * completed after it (its copies are complete by then: this job's own
   * wait completed them) */
  moed_launched **slot = answerer ? moed_answerer_launched(answerer) : NULL, *held = slot ? *slot : NULL;
  if (!(live > 1 && run_merged(srv, b, reqs, live, &l, answerer)))
    for (size_t k = 0; k < live; k++)
      run_single(srv, b, reqs[k], &l);
  if (held && *slot == held) {
    moed_infer_launched_finish(slot, NULL);
    lap(&l, MOED_PHASE_WAIT);
  }
}
