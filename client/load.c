/* load: see load.h. Every thread owns a completion queue and a fixed set of
 * call slots; the shared state is two atomic counters (calls started, calls
 * measured) and the merge of each thread's samples at its end. */
#include "load.h"

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

typedef struct call_slot {
  grpc_call *call;
  grpc_byte_buffer *send, *recv;
  grpc_metadata_array md, trailing;
  grpc_status_code status;
  grpc_slice details;
  double start; /* open loop: the scheduled time, so that a server falling behind shows */
  bool measured, busy;
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

static void call_start(load_run_state *s, grpc_channel *ch, grpc_completion_queue *cq, call_slot *c,
                       double start, bool measured) {
  memset(c, 0, sizeof *c);
  c->busy = true;
  c->measured = measured;
  c->start = start;
  c->send = grpc_byte_buffer_copy(s->cfg->request);
  grpc_metadata_array_init(&c->md);
  grpc_metadata_array_init(&c->trailing);
  c->details = grpc_empty_slice();
  gpr_timespec deadline =
      s->cfg->timeout_ms > 0
          ? gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis(s->cfg->timeout_ms, GPR_TIMESPAN))
          : gpr_inf_future(GPR_CLOCK_REALTIME);
  grpc_slice method = grpc_slice_from_static_string(s->cfg->method);
  c->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method, NULL, deadline, NULL);
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = c->send;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &c->md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &c->recv;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &c->trailing;
  ops[5].data.recv_status_on_client.status = &c->status;
  ops[5].data.recv_status_on_client.status_details = &c->details;
  if (grpc_call_start_batch(c->call, ops, 6, c, NULL) != GRPC_CALL_OK) abort(); /* ops are well-formed */
}

static void call_end(call_slot *c) {
  grpc_byte_buffer_destroy(c->send);
  if (c->recv) grpc_byte_buffer_destroy(c->recv);
  grpc_metadata_array_destroy(&c->md);
  grpc_metadata_array_destroy(&c->trailing);
  grpc_slice_unref(c->details);
  grpc_call_unref(c->call);
  c->busy = false;
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
      if (slots[i].busy) continue;
      bool measured;
      if (!may_start(s, open ? next : now, &measured)) {
        stopping = true;
        break;
      }
      call_start(s, a->ch, cq, &slots[i], open ? next : now, measured);
      live++;
      if (open && measured && now - next > 1e-3) t.r.late++;
      if (open) next += next_gap(a, &a->seed);
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
    bool oom = c->measured && tally(&t, c, now_s()) != 0;
    call_end(c);
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
  for (int i = 0; slots && i < a->slots; i++) /* cancel and reap what is still in flight */
    if (slots[i].busy) grpc_call_cancel(slots[i].call, NULL);
  while (live > 0) {
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type != GRPC_OP_COMPLETE) continue;
    call_end(ev.tag);
    live--;
  }
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
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  for (int i = 0; i < n; i++)
    ch[i] = grpc_channel_create(cfg->target, creds, &chargs);
  grpc_channel_credentials_release(creds);
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
  qsort(out->latency_s, out->n_ok, sizeof *out->latency_s, cmp_double);
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
