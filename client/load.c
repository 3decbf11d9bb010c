/* load: see load.h. Every thread owns a completion queue and a fixed set of
 * call slots. Shared state: two atomic counters (calls started, calls
 * measured), the stop flag, and each thread's measured samples, which the
 * thread appends and the caller's thread takes at each window's end (under
 * the thread's own mutex). */
#include "load.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grpc_args.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *load_status_name(grpc_status_code c) {
  static const char *const names[LOAD_STATUS_CODES] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  return (unsigned)c < LOAD_STATUS_CODES ? names[c] : "?";
}

/* ---- one call ------------------------------------------------------------------ */

/* What a slot's pending batch is. A unary call lives for one request; a
 * stream (cfg->stream) carries its slot's requests in turn and is closed at
 * the end of the run, or when one of them fails at the call level. */
typedef enum slot_phase {
  SLOT_IDLE,        /* free (a stream may be open on it) */
  SLOT_UNARY,       /* one unary call */
  SLOT_STREAM_MSG,  /* one request and its response on the open stream */
  SLOT_STREAM_DIED, /* the stream ended under a request: its status is fetched for it */
  SLOT_STREAM_CLOSE /* the end of the run: half-close, then the status */
} slot_phase;

typedef struct call_slot {
  grpc_call *call;
  grpc_byte_buffer *send, *recv;
  grpc_metadata_array md, trailing;
  grpc_status_code status;
  grpc_slice details;
  double start; /* open loop: the scheduled time, so that a server falling behind shows */
  bool measured;
  bool late;               /* open loop: started > 1 ms after its scheduled time */
  const load_message *msg; /* what it sends */
  slot_phase phase;
} call_slot;

typedef struct load_run_state {
  const load_config *cfg;
  double t0, measure_from;
  atomic_long started, measured;
  atomic_bool stop;
} load_run_state;

static void batch(call_slot *c, const grpc_op *ops, size_t n) {
  if (grpc_call_start_batch(c->call, ops, n, c, NULL) != GRPC_CALL_OK) abort(); /* ops are well-formed */
}

static void call_open(load_run_state *s, grpc_channel *ch, grpc_completion_queue *cq, call_slot *c) {
  grpc_metadata_array_init(&c->md);
  grpc_metadata_array_init(&c->trailing);
  c->details = grpc_empty_slice();
  gpr_timespec deadline =
      s->cfg->timeout_ms > 0
          ? gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis(s->cfg->timeout_ms, GPR_TIMESPAN))
          : gpr_inf_future(GPR_CLOCK_REALTIME);
  grpc_slice method = grpc_slice_from_static_string(s->cfg->method);
  c->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method, NULL, deadline, NULL);
}

static void call_release(call_slot *c) {
  grpc_metadata_array_destroy(&c->md);
  grpc_metadata_array_destroy(&c->trailing);
  grpc_slice_unref(c->details);
  grpc_call_unref(c->call);
  c->call = NULL;
}

/* One request on slot c: a new unary call, or the next message on its stream
 * (opened with the first). */
static void request_start(load_run_state *s, grpc_channel *ch, grpc_completion_queue *cq, call_slot *c,
                          const load_message *msg, double start, bool measured) {
  bool first = !c->call;
  if (first) call_open(s, ch, cq, c);
  c->measured = measured;
  c->start = start;
  c->msg = msg;
  c->send = grpc_byte_buffer_copy(msg->bytes);
  c->recv = NULL;
  c->status = GRPC_STATUS_OK;
  grpc_op ops[6];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  if (first) ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[n].op = GRPC_OP_SEND_MESSAGE;
  ops[n++].data.send_message.send_message = c->send;
  if (!s->cfg->stream) ops[n++].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  if (first) {
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n++].data.recv_initial_metadata.recv_initial_metadata = &c->md;
  }
  ops[n].op = GRPC_OP_RECV_MESSAGE;
  ops[n++].data.recv_message.recv_message = &c->recv;
  if (!s->cfg->stream) {
    ops[n].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[n].data.recv_status_on_client.trailing_metadata = &c->trailing;
    ops[n].data.recv_status_on_client.status = &c->status;
    ops[n++].data.recv_status_on_client.status_details = &c->details;
  }
  c->phase = s->cfg->stream ? SLOT_STREAM_MSG : SLOT_UNARY;
  batch(c, ops, n);
}

static void request_end(call_slot *c) {
  grpc_byte_buffer_destroy(c->send);
  if (c->recv) grpc_byte_buffer_destroy(c->recv);
  c->send = c->recv = NULL;
  c->phase = SLOT_IDLE;
}

/* Fetches the stream's status: after it died under a request (DIED), or to
 * end it (CLOSE: half-close first). */
static void stream_status(call_slot *c, slot_phase phase) {
  grpc_op ops[2];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  if (phase == SLOT_STREAM_CLOSE) ops[n++].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  grpc_slice_unref(c->details);
  c->details = grpc_empty_slice();
  ops[n].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[n].data.recv_status_on_client.trailing_metadata = &c->trailing;
  ops[n].data.recv_status_on_client.status = &c->status;
  ops[n++].data.recv_status_on_client.status_details = &c->details;
  c->phase = phase;
  batch(c, ops, n);
}

static bool varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
  *v = 0;
  for (int shift = 0; *p < end && shift < 64; shift += 7) {
    uint8_t b = *(*p)++;
    *v |= (uint64_t)(b & 0x7F) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

/* A stream response answers a request with an error when its field 1
 * (ModelStreamInferResponse.error_message) is set: the status goes into the
 * message only, as "CODE: why" or bare (UNKNOWN). Top-level wire scan, no
 * unpacking of the outputs. */
static void stream_response_status(call_slot *c) {
  grpc_byte_buffer_reader rd;
  if (!c->recv || !grpc_byte_buffer_reader_init(&rd, c->recv)) return;
  grpc_slice all = grpc_byte_buffer_reader_readall(&rd);
  grpc_byte_buffer_reader_destroy(&rd);
  const uint8_t *p = GRPC_SLICE_START_PTR(all), *end = p + GRPC_SLICE_LENGTH(all);
  uint64_t key, len;
  while (p < end && varint(&p, end, &key)) {
    unsigned wire = (unsigned)(key & 7);
    if (wire == 0 && varint(&p, end, &len)) continue;
    if (wire == 1 && end - p >= 8) {
      p += 8;
      continue;
    }
    if (wire == 5 && end - p >= 4) {
      p += 4;
      continue;
    }
    if (wire != 2 || !varint(&p, end, &len) || len > (uint64_t)(end - p)) break; /* malformed */
    if (key >> 3 == 1 && len > 0) {
      c->status = GRPC_STATUS_UNKNOWN;
      for (int code = 1; code < LOAD_STATUS_CODES; code++) {
        size_t k = strlen(load_status_name((grpc_status_code)code));
        if (len > k + 1 && memcmp(p, load_status_name((grpc_status_code)code), k) == 0 && p[k] == ':')
          c->status = (grpc_status_code)code;
      }
      grpc_slice_unref(c->details);
      c->details = grpc_slice_from_copied_buffer((const char *)p, (size_t)len);
      break;
    }
    p += len;
  }
  grpc_slice_unref(all);
}

/* Whether one more call may start at `now`; *measured says if it counts
 * (requests: started after the warm-up; windows: any call after the first
 * warmup_requests, placed in a window by its completion). */
static bool may_start(load_run_state *s, double now, bool *measured) {
  const load_config *cfg = s->cfg;
  if (atomic_load(&s->stop)) return false;
  long idx = atomic_fetch_add(&s->started, 1);
  *measured = idx >= cfg->warmup_requests && (cfg->requests <= 0 || now >= s->measure_from);
  if (*measured && cfg->requests > 0 && atomic_fetch_add(&s->measured, 1) >= cfg->requests) {
    atomic_store(&s->stop, true);
    return false;
  }
  return true;
}

/* ---- one thread: its channel, completion queue and share of the calls ---------- */

/* One measured call. */
typedef struct sample {
  double start, end;
  uint32_t tokens, sent, received;
  uint8_t status;
  bool late;
} sample;

typedef struct thread_arg {
  load_run_state *s;
  grpc_channel *ch;
  int slots;   /* calls in flight at most */
  double rate; /* this thread's share; 0 = closed loop */
  unsigned seed;
  int rc;
  pthread_mutex_t mu; /* guards the samples */
  sample *samples;    /* in order of completion */
  size_t n, cap;
  size_t all_calls, all_ok; /* every call completed (read after the join) */
  char first_error[256];    /* the first failure after the warm-up (read after the join) */
} thread_arg;

/* Records call c that just completed: 0, or -1 out of memory. The end time
 * is read under the mutex, so that a harvest holding it at time t has every
 * sample that ended before t. */
static int tally(thread_arg *a, call_slot *c) {
  unsigned st = (unsigned)c->status < LOAD_STATUS_CODES ? (unsigned)c->status : GRPC_STATUS_UNKNOWN;
  a->all_calls++;
  a->all_ok += st == GRPC_STATUS_OK;
  if (!c->measured) return 0;
  size_t sent = grpc_byte_buffer_length(c->msg->bytes),
         received = c->recv ? grpc_byte_buffer_length(c->recv) : 0;
  pthread_mutex_lock(&a->mu);
  double end = now_s();
  if (a->n == a->cap) {
    size_t cap = a->cap ? 2 * a->cap : 4096;
    sample *g = cap <= SIZE_MAX / sizeof *g ? realloc(a->samples, cap * sizeof *g) : NULL;
    if (!g) {
      pthread_mutex_unlock(&a->mu);
      return -1;
    }
    a->samples = g;
    a->cap = cap;
  }
  a->samples[a->n++] =
      (sample){c->start, end, c->msg->tokens, (uint32_t)sent, (uint32_t)received, (uint8_t)st, c->late};
  pthread_mutex_unlock(&a->mu);
  if (st != GRPC_STATUS_OK && !a->first_error[0] && end >= a->s->measure_from)
    snprintf(a->first_error, sizeof a->first_error, "%s: %.*s", load_status_name((grpc_status_code)st),
             (int)GRPC_SLICE_LENGTH(c->details), (const char *)GRPC_SLICE_START_PTR(c->details));
  return 0;
}

static double uniform01(unsigned *seed) { return (double)rand_r(seed) / ((double)RAND_MAX + 1.0); }

static double next_gap(const thread_arg *a, unsigned *seed) {
  if (!a->s->cfg->poisson) return 1.0 / a->rate;
  double u = ((double)rand_r(seed) + 1.0) / ((double)RAND_MAX + 2.0); /* (0, 1) */
  return -log(u) / a->rate;
}

/* The message of the next call: the first whose cdf exceeds a uniform draw. */
static const load_message *draw(const load_config *cfg, unsigned *seed) {
  if (cfg->n_messages == 1) return cfg->messages;
  double u = uniform01(seed);
  size_t lo = 0, hi = cfg->n_messages - 1;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (cfg->messages[mid].cdf > u)
      hi = mid;
    else
      lo = mid + 1;
  }
  return &cfg->messages[lo];
}

static void *load_thread(void *arg) {
  thread_arg *a = arg;
  load_run_state *s = a->s;
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  call_slot *slots = calloc((size_t)a->slots, sizeof *slots);
  int live = 0;
  bool open = a->rate > 0, stopping = false;
  double next = s->t0;
  if (!slots) goto fail;
  for (;;) {
    double now = now_s();
    /* start what may start: every free slot (closed loop) or every call due (open loop) */
    for (int i = 0; !stopping && i < a->slots && (!open || next <= now); i++) {
      if (slots[i].phase != SLOT_IDLE) continue;
      bool measured;
      if (!may_start(s, open ? next : now, &measured)) {
        stopping = true;
        break;
      }
      request_start(s, a->ch, cq, &slots[i], draw(s->cfg, &a->seed), open ? next : now, measured);
      slots[i].late = open && now - next > 1e-3;
      live++;
      if (open) next += next_gap(a, &a->seed);
    }
    if (!stopping && atomic_load(&s->stop)) stopping = true;
    for (int i = 0; stopping && i < a->slots; i++) /* streams idle at the end: closed */
      if (slots[i].phase == SLOT_IDLE && slots[i].call) {
        stream_status(&slots[i], SLOT_STREAM_CLOSE);
        live++;
      }
    if (stopping && live == 0) break;
    /* sleep until a call ends, the next start is due, or 50 ms (to see the end of the run) */
    double wake = now + 0.05;
    if (open && !stopping && live < a->slots && next < wake) wake = next;
    gpr_timespec dl = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                   gpr_time_from_micros((int64_t)((wake - now) * 1e6), GPR_TIMESPAN));
    grpc_event ev = grpc_completion_queue_next(cq, dl, NULL);
    if (ev.type != GRPC_OP_COMPLETE) continue;
    call_slot *c = ev.tag;
    if (c->phase == SLOT_STREAM_CLOSE) {
      call_release(c);
      c->phase = SLOT_IDLE;
      live--;
      continue;
    }
    if (c->phase == SLOT_STREAM_MSG) {
      if (!ev.success || !c->recv) { /* the stream ended: its status answers the request */
        stream_status(c, SLOT_STREAM_DIED);
        continue;
      }
      stream_response_status(c);
    }
    bool oom = tally(a, c) != 0;
    bool release = c->phase != SLOT_STREAM_MSG; /* unary, or a stream that died */
    request_end(c);
    if (release) call_release(c);
    live--;
    if (oom) goto fail;
  }
  goto done;
fail:
  fprintf(stderr, "load: out of memory\n");
  a->rc = -1;
  atomic_store(&s->stop, true);
  for (int i = 0; slots && i < a->slots; i++) /* cancel, reap what is in flight, release */
    if (slots[i].call) grpc_call_cancel(slots[i].call, NULL);
  while (live > 0) {
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type != GRPC_OP_COMPLETE) continue;
    call_slot *c = ev.tag;
    if (c->phase != SLOT_STREAM_CLOSE) request_end(c);
    c->phase = SLOT_IDLE;
    live--;
  }
  for (int i = 0; slots && i < a->slots; i++)
    if (slots[i].call) call_release(&slots[i]);
done:
  free(slots);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  return NULL;
}

/* ---- windows: the samples of every thread, taken as each window ends ---------------- */

typedef struct harvest {
  load_result *out;
  size_t cap_lat;
  double first_start, last_end; /* requests: the span of the measured calls */
} harvest;

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Moves the samples of thread a that ended before `to` into w (those that
 * ended before `from` are dropped: the warm-up) and their OK latencies onto
 * out->latency_s. 0, or -1 out of memory. */
static int harvest_thread(harvest *h, thread_arg *a, double from, double to, load_window *w) {
  load_result *r = h->out;
  int rc = 0;
  pthread_mutex_lock(&a->mu);
  size_t k = 0;
  for (; k < a->n && a->samples[k].end < to; k++) {
    const sample *x = &a->samples[k];
    if (x->end < from) continue;
    load_counts *c = &w->c;
    c->n_calls++;
    c->by_status[x->status]++;
    c->bytes_sent += x->sent;
    c->bytes_received += x->received;
    c->late += x->late;
    if (x->start < h->first_start) h->first_start = x->start;
    if (x->end > h->last_end) h->last_end = x->end;
    if (x->status != GRPC_STATUS_OK) continue;
    if (r->c.n_ok + c->n_ok == h->cap_lat) {
      size_t cap = h->cap_lat ? 2 * h->cap_lat : 4096;
      double *g = cap <= SIZE_MAX / sizeof *g ? realloc(r->latency_s, cap * sizeof *g) : NULL;
      if (!g) {
        rc = -1;
        k = a->n; /* the rest dropped: the run fails anyway */
        break;
      }
      r->latency_s = g;
      h->cap_lat = cap;
    }
    r->latency_s[r->c.n_ok + c->n_ok] = x->end - x->start;
    c->n_ok++;
    c->tokens_ok += x->tokens;
  }
  memmove(a->samples, a->samples + k, (a->n - k) * sizeof *a->samples);
  a->n -= k;
  pthread_mutex_unlock(&a->mu);
  return rc;
}

static void counts_add(load_counts *to, const load_counts *c) {
  to->n_calls += c->n_calls;
  to->n_ok += c->n_ok;
  for (int i = 0; i < LOAD_STATUS_CODES; i++)
    to->by_status[i] += c->by_status[i];
  to->tokens_ok += c->tokens_ok;
  to->bytes_sent += c->bytes_sent;
  to->bytes_received += c->bytes_received;
  to->late += c->late;
}

/* Window `index` [from, to) out of every thread's samples, added to the
 * run's totals. 0, or -1 out of memory. */
static int harvest_window(harvest *h, thread_arg *ta, int n_threads, double from, double to, int index) {
  load_result *r = h->out;
  load_window *w = &r->windows[index];
  memset(w, 0, sizeof *w);
  int rc = 0;
  for (int i = 0; i < n_threads; i++)
    if (harvest_thread(h, &ta[i], from, to, w) != 0) rc = -1;
  double *lat = r->latency_s + r->c.n_ok; /* this window's, sorted for its p99 */
  if (w->c.n_ok) qsort(lat, w->c.n_ok, sizeof *lat, cmp_double);
  w->elapsed_s = to - from;
  w->requests_per_s = w->elapsed_s > 0 ? (double)w->c.n_ok / w->elapsed_s : 0;
  w->p99_s = load_quantile(lat, w->c.n_ok, 0.99);
  counts_add(&r->c, &w->c);
  r->n_windows = index + 1;
  return rc;
}

/* Whether windows w[0..n) agree: requests/s and p99 each within tol of
 * their mean. */
static bool windows_agree(const load_window *w, int n, double tol) {
  double rate = 0, p99 = 0;
  for (int i = 0; i < n; i++) {
    rate += w[i].requests_per_s / n;
    p99 += w[i].p99_s / n;
  }
  if (!(rate > 0 && p99 > 0)) return false;
  for (int i = 0; i < n; i++)
    if (fabs(w[i].requests_per_s - rate) > tol * rate || fabs(w[i].p99_s - p99) > tol * p99) return false;
  return true;
}

/* Sleeps until time t (true) or until the run stops (false). */
static bool sleep_until(load_run_state *s, double t) {
  for (;;) {
    if (atomic_load(&s->stop)) return false;
    double left = t - now_s();
    if (left <= 0) return true;
    if (left > 0.05) left = 0.05;
    struct timespec ts = {0, (long)(left * 1e9)};
    nanosleep(&ts, NULL);
  }
}

/* ---- the run --------------------------------------------------------------------- */

int load_run(const load_config *cfg, load_result *out) {
  memset(out, 0, sizeof *out);
  int n = cfg->channels, rc = -1, created = 0;
  load_run_state s;
  memset(&s, 0, sizeof s);
  s.cfg = cfg;
  harvest h = {out, 0, 1e300, 0};
  bool windows = cfg->requests <= 0;
  int max_windows = windows ? cfg->max_windows : 1;
  grpc_channel **ch = calloc((size_t)n, sizeof *ch);
  pthread_t *th = calloc((size_t)n, sizeof *th);
  thread_arg *ta = calloc((size_t)n, sizeof *ta);
  out->windows = max_windows >= 1 ? calloc((size_t)max_windows, sizeof *out->windows) : NULL;
  if (!ch || !th || !ta || !out->windows) {
    fprintf(stderr, "load: out of memory\n");
    goto fail;
  }
  /* a local subchannel pool per channel: otherwise gRPC core shares one
   * connection among channels with equal arguments */
  grpc_arg args[3];
  grpc_channel_args chargs = moec_size_args(args, 1 << 30);
  memset(&args[2], 0, sizeof args[2]);
  args[2].type = GRPC_ARG_INTEGER;
  args[2].key = (char *)GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
  args[2].value.integer = 1;
  chargs.num_args = 3;
  grpc_channel_credentials *creds = cfg->creds ? NULL : grpc_insecure_credentials_create();
  for (int i = 0; i < n; i++)
    ch[i] = grpc_channel_create(cfg->target, cfg->creds ? cfg->creds : creds, &chargs);
  if (creds) grpc_channel_credentials_release(creds);
  s.t0 = now_s();
  s.measure_from = s.t0 + cfg->warmup_s;
  for (int i = 0; i < n; i++) {
    ta[i] = (thread_arg){.s = &s,
                         .ch = ch[i],
                         .slots = cfg->concurrency / n + (i < cfg->concurrency % n),
                         .rate = cfg->rate / n,
                         .seed = cfg->seed + (unsigned)i * 2654435761u + 1u};
    pthread_mutex_init(&ta[i].mu, NULL);
    if (pthread_create(&th[i], NULL, load_thread, &ta[i]) != 0) {
      pthread_mutex_destroy(&ta[i].mu);
      fprintf(stderr, "load: cannot start a client thread\n");
      atomic_store(&s.stop, true);
      break;
    }
    created++;
  }
  rc = created == n ? 0 : -1;
  /* windows: each taken as it ends, until stable or max_windows */
  double from = s.measure_from;
  for (int k = 0; windows && rc == 0 && k < max_windows; k++) {
    double to = from + cfg->window_s;
    if (!sleep_until(&s, to)) break; /* a thread failed */
    if (harvest_window(&h, ta, created, from, to, k) != 0) rc = -1;
    if (cfg->on_window) cfg->on_window(&out->windows[k], k, cfg->on_window_arg);
    if (cfg->stability > 0 && k + 1 >= LOAD_STABLE_WINDOWS &&
        windows_agree(&out->windows[k + 1 - LOAD_STABLE_WINDOWS], LOAD_STABLE_WINDOWS, cfg->stability)) {
      out->stable = true;
      break;
    }
    from = to;
  }
  if (windows) atomic_store(&s.stop, true); /* the calls in flight finish; they are in no window */
  for (int i = 0; i < created; i++) {
    pthread_join(th[i], NULL);
    if (ta[i].rc) rc = -1;
  }
  if (!windows && rc == 0) { /* requests: every measured call, one window */
    if (harvest_window(&h, ta, created, -1e300, 1e300, 0) != 0) rc = -1;
    out->windows[0].elapsed_s = out->c.n_calls ? h.last_end - h.first_start : 0;
    out->windows[0].requests_per_s =
        out->windows[0].elapsed_s > 0 ? (double)out->c.n_ok / out->windows[0].elapsed_s : 0;
    if (cfg->on_window) cfg->on_window(&out->windows[0], 0, cfg->on_window_arg);
  }
  for (int i = 0; i < out->n_windows; i++)
    out->elapsed_s += out->windows[i].elapsed_s;
  for (int i = 0; i < created; i++) {
    out->all_calls += ta[i].all_calls;
    out->all_ok += ta[i].all_ok;
    if (!out->first_error[0]) memcpy(out->first_error, ta[i].first_error, sizeof out->first_error);
    free(ta[i].samples);
    pthread_mutex_destroy(&ta[i].mu);
  }
  for (int i = 0; i < n; i++)
    grpc_channel_destroy(ch[i]);
  if (out->c.n_ok) qsort(out->latency_s, out->c.n_ok, sizeof *out->latency_s, cmp_double);
fail:
  free(ta);
  free(th);
  free(ch);
  return rc;
}

void load_result_free(load_result *r) {
  free(r->latency_s);
  free(r->windows);
  r->latency_s = NULL;
  r->windows = NULL;
}

double load_quantile(const double *sorted, size_t n, double p) {
  if (!n) return 0;
  double rank = ceil(p * (double)n); /* nearest rank: the smallest value with >= p of them at or below */
  size_t i = rank < 1 ? 0 : (size_t)rank - 1;
  return sorted[i < n ? i : n - 1];
}

double load_percentile(const load_result *r, double p) { return load_quantile(r->latency_s, r->c.n_ok, p); }
