/* load: see load.h. Every thread owns a completion queue and a fixed set of
 * call slots; the shared state is two atomic counters (calls started, calls
 * measured) and the merge of each thread's samples at its end. */
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
  slot_phase phase;
} call_slot;

typedef struct load_run_state {
  const load_config *cfg;
  grpc_channel **ch;
  double t0, measure_from, measure_to;
  atomic_long started, measured;
  atomic_bool stop;
  pthread_mutex_t mu; /* guards out */
  load_result *out;
  size_t cap_lat;
  double first_start, last_end;
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
                          double start, bool measured) {
  bool first = !c->call;
  if (first) call_open(s, ch, cq, c);
  c->measured = measured;
  c->start = start;
  c->send = grpc_byte_buffer_copy(s->cfg->request);
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

/* Whether one more call may start at `now`; *measured says if it counts. */
static bool may_start(load_run_state *s, double now, bool *measured) {
  const load_config *cfg = s->cfg;
  if (atomic_load(&s->stop)) return false;
  if (cfg->requests <= 0 && now >= s->measure_to) return false;
  long idx = atomic_fetch_add(&s->started, 1);
  *measured = idx >= cfg->warmup_requests && now >= s->measure_from;
  if (*measured && cfg->requests > 0 && atomic_fetch_add(&s->measured, 1) >= cfg->requests) {
    atomic_store(&s->stop, true);
    return false;
  }
  return true;
}

/* ---- one thread: its channel, completion queue and share of the calls ---------- */

typedef struct thread_arg {
  load_run_state *s;
  grpc_channel *ch;
  int slots;   /* calls in flight at most */
  double rate; /* this thread's share; 0 = closed loop */
  unsigned seed;
  int rc;
} thread_arg;

typedef struct thread_tally {
  double *lat;
  size_t n, cap;
  load_result r; /* counts only */
  double first_start, last_end;
  size_t request_bytes; /* the send buffer is emptied by the call: measured once */
} thread_tally;

static int tally(thread_tally *t, call_slot *c, double end) {
  load_result *r = &t->r;
  unsigned st = (unsigned)c->status < LOAD_STATUS_CODES ? (unsigned)c->status : GRPC_STATUS_UNKNOWN;
  r->n_calls++;
  r->by_status[st]++;
  r->bytes_sent += t->request_bytes;
  if (c->recv) r->bytes_received += grpc_byte_buffer_length(c->recv);
  if (c->start < t->first_start) t->first_start = c->start;
  if (end > t->last_end) t->last_end = end;
  if (st != GRPC_STATUS_OK) {
    if (!r->first_error[0])
      snprintf(r->first_error, sizeof r->first_error, "%s: %.*s", load_status_name((grpc_status_code)st),
               (int)GRPC_SLICE_LENGTH(c->details), (const char *)GRPC_SLICE_START_PTR(c->details));
    return 0;
  }
  if (t->n == t->cap) {
    size_t cap = t->cap ? 2 * t->cap : 4096;
    double *g = realloc(t->lat, cap * sizeof *g);
    if (!g) return -1;
    t->lat = g;
    t->cap = cap;
  }
  t->lat[t->n++] = end - c->start;
  return 0;
}

static double next_gap(const thread_arg *a, unsigned *seed) {
  if (!a->s->cfg->poisson) return 1.0 / a->rate;
  double u = ((double)rand_r(seed) + 1.0) / ((double)RAND_MAX + 2.0); /* (0, 1) */
  return -log(u) / a->rate;
}

static void *load_thread(void *arg) {
  thread_arg *a = arg;
  load_run_state *s = a->s;
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  call_slot *slots = calloc((size_t)a->slots, sizeof *slots);
  thread_tally t = {.first_start = 1e300, .request_bytes = grpc_byte_buffer_length(s->cfg->request)};
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
      request_start(s, a->ch, cq, &slots[i], open ? next : now, measured);
      live++;
      if (open && measured && now - next > 1e-3) t.r.late++;
      if (open) next += next_gap(a, &a->seed);
    }
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
    double end = now_s();
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
    bool oom = c->measured && tally(&t, c, end) != 0;
    bool release = c->phase != SLOT_STREAM_MSG; /* unary, or a stream that died */
    request_end(c);
    if (release) call_release(c);
    live--;
    if (oom) goto fail;
  }
  pthread_mutex_lock(&s->mu);
  load_result *r = s->out;
  if (r->n_ok + t.n > s->cap_lat) {
    double *g = realloc(r->latency_s, (r->n_ok + t.n) * sizeof *g);
    if (!g) {
      pthread_mutex_unlock(&s->mu);
      goto fail;
    }
    r->latency_s = g;
    s->cap_lat = r->n_ok + t.n;
  }
  if (t.n) memcpy(r->latency_s + r->n_ok, t.lat, t.n * sizeof *t.lat);
  r->n_ok += t.n;
  r->n_calls += t.r.n_calls;
  for (int i = 0; i < LOAD_STATUS_CODES; i++)
    r->by_status[i] += t.r.by_status[i];
  r->bytes_sent += t.r.bytes_sent;
  r->bytes_received += t.r.bytes_received;
  r->late += t.r.late;
  if (!r->first_error[0]) memcpy(r->first_error, t.r.first_error, sizeof r->first_error);
  if (t.first_start < s->first_start) s->first_start = t.first_start;
  if (t.last_end > s->last_end) s->last_end = t.last_end;
  pthread_mutex_unlock(&s->mu);
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
  free(t.lat);
  free(slots);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  return NULL;
}

/* ---- the run --------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int load_run(const load_config *cfg, load_result *out) {
  memset(out, 0, sizeof *out);
  int n = cfg->channels, rc = -1, created = 0;
  load_run_state s;
  memset(&s, 0, sizeof s);
  s.cfg = cfg;
  s.out = out;
  s.first_start = 1e300;
  pthread_mutex_init(&s.mu, NULL);
  grpc_channel **ch = calloc((size_t)n, sizeof *ch);
  pthread_t *th = calloc((size_t)n, sizeof *th);
  thread_arg *ta = calloc((size_t)n, sizeof *ta);
  if (!ch || !th || !ta) {
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
  s.measure_to = s.measure_from + cfg->duration_s;
  for (int i = 0; i < n; i++) {
    ta[i] = (thread_arg){&s,
                         ch[i],
                         cfg->concurrency / n + (i < cfg->concurrency % n),
                         cfg->rate / n,
                         (unsigned)i * 2654435761u + 1u,
                         0};
    if (pthread_create(&th[i], NULL, load_thread, &ta[i]) != 0) {
      fprintf(stderr, "load: cannot start a client thread\n");
      atomic_store(&s.stop, true);
      break;
    }
    created++;
  }
  rc = created == n ? 0 : -1;
  for (int i = 0; i < created; i++) {
    pthread_join(th[i], NULL);
    if (ta[i].rc) rc = -1;
  }
  for (int i = 0; i < n; i++)
    grpc_channel_destroy(ch[i]);
  if (out->n_ok) qsort(out->latency_s, out->n_ok, sizeof *out->latency_s, cmp_double);
  out->elapsed_s = out->n_calls ? s.last_end - s.first_start : 0;
fail:
  free(ta);
  free(th);
  free(ch);
  pthread_mutex_destroy(&s.mu);
  return rc;
}

void load_result_free(load_result *r) {
  free(r->latency_s);
  r->latency_s = NULL;
}

double load_percentile(const load_result *r, double p) {
  if (!r->n_ok) return 0;
  double rank =
      ceil(p * (double)r->n_ok); /* nearest rank: the smallest value with >= p of them at or below */
  size_t i = rank < 1 ? 0 : (size_t)rank - 1;
  return r->latency_s[i < r->n_ok ? i : r->n_ok - 1];
}
