/* http: the side port on the loop: Prometheus /metrics and the Kubernetes
 * probes /v2/health/live and /v2/health/ready. One request per connection
 * (Connection: close), on http_conn.c's connections (deadlines, the
 * --http-max-connections cap).
 *
 * The probes check the gRPC listener itself: gRPC core stops accepting
 * for good once accept4 fails (fd_budget.c keeps EMFILE from it; this
 * catches what it does not), and a probe that only read a flag would keep
 * answering 200 for a pod nobody can call. Each probe connects to the gRPC
 * port and expects the server's HTTP/2 SETTINGS frame (TLS: its ServerHello) within PROBE_MS; a
 * probe connection refused at accept for want of descriptors means a full
 * server, not a stuck one: live 200, ready 503.
 *
 * With --auth-tokens this port checks the same bearer tokens as the others
 * (authorized() below says which role each path needs). */
#include <http_parser.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed.h"
#include "prom_label.h"

#define PROBE_MS 2000

struct moed_http {
  moed_server *srv;
  moed_http_listener *l;
  struct sockaddr_storage grpc; /* what the probes connect to */
  bool grpc_ok;                 /* parsed (a host name is not: probes answer 503, not checked) */
  moed_gpu_metrics *gpu;        /* NULL: no nv_gpu_* metrics */
};

/* A check of the gRPC listener that a probe request waits for. */
typedef struct probe {
  uv_tcp_t tcp;
  uv_timer_t timer;
  uv_connect_t creq;
  uv_write_t wreq;
  int handles;
  moed_http_conn *c; /* NULL once the requester went away */
  bool done;
  bool ready;        /* readiness (a full server is not ready) or liveness (it is alive) */
  uint64_t refused0; /* connections refused at accept when the probe started */
  bool tls;          /* the gRPC port speaks TLS */
  unsigned char buf[16];
  size_t got;
} probe;

typedef struct wbuf {
  char *p;
  size_t len, cap;
  bool oom;
} wbuf;

static void wb_printf(wbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void wb_printf(wbuf *b, const char *fmt, ...) {
  if (b->oom) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->oom = true;
      return;
    }
    if ((size_t)n < b->cap - b->len) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap * 2 + (size_t)n + 1;
    char *g = realloc(b->p, cap);
    if (!g) {
      b->oom = true;
      return;
    }
    b->p = g;
    b->cap = cap;
  }
}

/* ---- /metrics ------------------------------------------------------------------ */

/* A histogram's buckets: its bounds, the unit they and the sum are shown
 * in (1e9: ns as seconds; 1: as counted) and the sum's decimals (ns). */
typedef struct hist_kind {
  const uint64_t *bounds;
  double unit;
  int decimals;
} hist_kind;

static const hist_kind seconds = {moed_hist_bounds_ns, 1e9, 9}, rows = {moed_hist_bounds_rows, 1, 0};

/* _count is the +Inf bucket as read, so the two agree while requests land
 * between the reads of one scrape (Prometheus requires them equal). */
static void hist(wbuf *b, const char *metric, const char *model, const moed_hist *h, const hist_kind *k) {
  uint64_t cum = 0;
  for (int i = 0; i < MOED_HIST_BUCKETS; i++) {
    cum += atomic_load(&h->le[i]);
    if (i < MOED_HIST_BUCKETS - 1)
      wb_printf(b, "%s_bucket{model=\"%s\",le=\"%g\"} %llu\n", metric, model, (double)k->bounds[i] / k->unit,
                (unsigned long long)cum);
    else
      wb_printf(b, "%s_bucket{model=\"%s\",le=\"+Inf\"} %llu\n", metric, model, (unsigned long long)cum);
  }
  wb_printf(b, "%s_sum{model=\"%s\"} %.*f\n", metric, model, k->decimals,
            (double)atomic_load(&h->sum) / k->unit);
  wb_printf(b, "%s_count{model=\"%s\"} %llu\n", metric, model, (unsigned long long)cum);
}

/* Triton's per-model counters under Triton's names (what dashboards written
 * for tritonserver read), from the same statistics as ModelStatistics:
 * durations are of successful requests, in microseconds. */
static const struct {
  const char *name, *help;
  size_t field; /* offsetof(moed_model_stats, ...) of an _Atomic uint64_t */
  bool ns;      /* a duration in ns, shown in us */
} triton_metrics[] = {
    {"nv_inference_request_success", "Number of successful inference requests, all batch sizes",
     offsetof(moed_model_stats, success_count), false},
    {"nv_inference_request_failure", "Number of failed inference requests, all batch sizes",
     offsetof(moed_model_stats, fail_count), false},
    {"nv_inference_count", "Number of inferences performed (a request of batch size n counts n)",
     offsetof(moed_model_stats, inference_count), false},
    {"nv_inference_exec_count", "Number of model executions performed (merged requests count once)",
     offsetof(moed_model_stats, execution_count), false},
    {"nv_inference_request_duration_us", "Cumulative inference request duration in microseconds",
     offsetof(moed_model_stats, success_ns), true},
    {"nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds",
     offsetof(moed_model_stats, queue_ns), true},
    {"nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds",
     offsetof(moed_model_stats, compute_input_ns), true},
    {"nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds",
     offsetof(moed_model_stats, compute_ns), true},
    {"nv_inference_compute_output_duration_us",
     "Cumulative inference compute output duration in microseconds",
     offsetof(moed_model_stats, compute_output_ns), true},
};
#define N_TRITON_METRICS (sizeof triton_metrics / sizeof triton_metrics[0])
#define N_MOED_SECTIONS 7

typedef struct metrics_pass {
  wbuf *b;
  size_t section; /* moed's sections, then Triton's metrics */
} metrics_pass;

static void model_metrics(moed_model *m, void *arg) {
  metrics_pass *p = arg;
  moed_model_stats *st = m->stats;
  wbuf *b = p->b;
  char name[MOED_PROM_LABEL_SIZE(sizeof m->name)];
  moed_prom_label(name, sizeof name, m->name);
  if (p->section >= N_MOED_SECTIONS) {
    size_t i = p->section - N_MOED_SECTIONS;
    uint64_t v = atomic_load((_Atomic uint64_t *)((char *)st + triton_metrics[i].field));
    wb_printf(b, "%s{model=\"%s\",version=\"1\"} %llu\n", triton_metrics[i].name, name,
              (unsigned long long)(triton_metrics[i].ns ? v / 1000 : v));
    return;
  }
  switch (p->section) {
  case 0:
    wb_printf(b, "moed_requests_total{model=\"%s\",outcome=\"success\"} %llu\n", name,
              (unsigned long long)atomic_load(&st->success_count));
    wb_printf(b, "moed_requests_total{model=\"%s\",outcome=\"failure\"} %llu\n", name,
              (unsigned long long)atomic_load(&st->fail_count));
    break;
  case 1: hist(b, "moed_queue_seconds", name, &st->queue_hist, &seconds); break;
  case 2: hist(b, "moed_compute_seconds", name, &st->compute_hist, &seconds); break;
  case 3: hist(b, "moed_request_seconds", name, &st->total_hist, &seconds); break;
  case 4:
    wb_printf(b, "moed_bytes_in_total{model=\"%s\"} %llu\n", name,
              (unsigned long long)atomic_load(&st->bytes_in));
    break;
  case 5:
    wb_printf(b, "moed_bytes_out_total{model=\"%s\"} %llu\n", name,
              (unsigned long long)atomic_load(&st->bytes_out));
    break;
  case 6: hist(b, "moed_batch_size", name, &st->batch_hist, &rows); break;
  }
}

/* The HTTP ports' connection counts, one series per port. */
static void http_open(const char *port, const moed_http_stats *n, void *arg) {
  wb_printf(arg, "moed_http_connections{port=\"%s\"} %d\n", port, n->open);
}
static void http_accepted(const char *port, const moed_http_stats *n, void *arg) {
  wb_printf(arg, "moed_http_connections_accepted_total{port=\"%s\"} %llu\n", port,
            (unsigned long long)n->accepted);
}
static void http_abandoned(const char *port, const moed_http_stats *n, void *arg) {
  wb_printf(arg, "moed_http_requests_abandoned_total{port=\"%s\"} %llu\n", port,
            (unsigned long long)n->abandoned);
}
static void http_closed(const char *port, const moed_http_stats *n, void *arg) {
  const struct {
    const char *reason;
    uint64_t v;
  } r[] = {
      {"refused", n->refused}, {"timeout", n->timeouts}, {"idle", n->idle_closed}, {"tls", n->tls_failed}};
  for (size_t i = 0; i < sizeof r / sizeof r[0]; i++)
    wb_printf(arg, "moed_http_connections_closed_total{port=\"%s\",reason=\"%s\"} %llu\n", port, r[i].reason,
              (unsigned long long)r[i].v);
}

static void render_metrics(moed_http *h, wbuf *b) {
  moed_server *s = h->srv;
  static const char *const heads[N_MOED_SECTIONS] = {
      "# HELP moed_requests_total Inference requests by model and outcome.\n# TYPE moed_requests_total "
      "counter\n",
      "# HELP moed_queue_seconds Time from arrival to the start of compute.\n# TYPE moed_queue_seconds "
      "histogram\n",
      "# HELP moed_compute_seconds Time running the op.\n# TYPE moed_compute_seconds histogram\n",
      "# HELP moed_request_seconds Time from arrival to response.\n# TYPE moed_request_seconds histogram\n",
      "# HELP moed_bytes_in_total Input tensor bytes received.\n# TYPE moed_bytes_in_total counter\n",
      "# HELP moed_bytes_out_total Output tensor bytes sent.\n# TYPE moed_bytes_out_total counter\n",
      "# HELP moed_batch_size Rows per execution along the batch axis (tokens for fused_moe and the quant "
      "ops; requests for a model without one), as ModelStatistics batch_stats counts them.\n"
      "# TYPE moed_batch_size histogram\n",
  };
  for (size_t sec = 0; sec < N_MOED_SECTIONS + N_TRITON_METRICS; sec++) {
    if (sec < N_MOED_SECTIONS)
      wb_printf(b, "%s", heads[sec]);
    else
      wb_printf(b, "# HELP %s %s\n# TYPE %s counter\n", triton_metrics[sec - N_MOED_SECTIONS].name,
                triton_metrics[sec - N_MOED_SECTIONS].help, triton_metrics[sec - N_MOED_SECTIONS].name);
    metrics_pass p = {b, sec};
    moed_repository_foreach(s->repo, model_metrics, &p);
  }
  wb_printf(b,
            "# HELP moed_inflight_requests Admitted inference requests not yet answered.\n"
            "# TYPE moed_inflight_requests gauge\nmoed_inflight_requests %d\n",
            atomic_load(&s->inflight));
  int queued[MOED_PRIORITY_LEVELS];
  const int nw = moed_devices_count(s->devices);
  moed_worker_load *wl = calloc(nw > 0 ? (size_t)nw : 1, sizeof *wl); /* NULL: no per-worker samples */
  int running = moed_devices_load(s->devices, queued, wl);
  wb_printf(b, "# HELP moed_device_queue_jobs Jobs (a batch, or one request) waiting in the device queues "
               "(one queue per priority level, shared by every worker).\n"
               "# TYPE moed_device_queue_jobs gauge\n");
  for (int l = 0; l < MOED_PRIORITY_LEVELS; l++)
    wb_printf(b, "moed_device_queue_jobs{priority=\"%d\"} %d\n", l + 1, queued[l]);
  wb_printf(b,
            "# HELP moed_batches_in_flight Jobs the device workers are running now.\n"
            "# TYPE moed_batches_in_flight gauge\nmoed_batches_in_flight %d\n"
            "# HELP moed_batcher_requests Requests held in open batches, waiting for max_batch_tokens rows "
            "or max_queue_delay_us.\n# TYPE moed_batcher_requests gauge\nmoed_batcher_requests %zu\n",
            running, moed_batcher_held(s->batcher));
  /* the queues are shared by every worker (one per GPU): what is per device
   * is the work each one takes from them, read with the gauges above */
  if (wl) {
    char(*names)[MOED_PROM_LABEL_SIZE(128)] = calloc((size_t)nw, sizeof *names);
    for (int i = 0; names && i < nw; i++)
      moed_prom_label(names[i], sizeof names[i], moed_devices_worker_name(s->devices, i));
    wb_printf(b, "# HELP moed_worker_busy 1 while the device worker (one per GPU, else a CPU worker) runs a "
                 "job: the batches in flight per device.\n# TYPE moed_worker_busy gauge\n");
    for (int i = 0; names && i < nw; i++)
      wb_printf(b, "moed_worker_busy{worker=\"%d\",backend=\"%s\"} %d\n", i, names[i], wl[i].busy ? 1 : 0);
    wb_printf(b, "# HELP moed_worker_jobs_total Jobs (a batch, or one request) each device worker has run.\n"
                 "# TYPE moed_worker_jobs_total counter\n");
    for (int i = 0; names && i < nw; i++)
      wb_printf(b, "moed_worker_jobs_total{worker=\"%d\",backend=\"%s\"} %llu\n", i, names[i],
                (unsigned long long)wl[i].jobs);
    wb_printf(b, "# HELP moed_worker_executions_total Op calls (a merged batch, or one request) each device "
                 "worker has run: what moed_worker_phase_seconds_total is spent on.\n"
                 "# TYPE moed_worker_executions_total counter\n");
    for (int i = 0; names && i < nw; i++)
      wb_printf(b, "moed_worker_executions_total{worker=\"%d\",backend=\"%s\"} %llu\n", i, names[i],
                (unsigned long long)wl[i].phases.executions);
    static const char *const phase[MOED_PHASES] = MOED_PHASE_NAMES;
    wb_printf(b,
              "# HELP moed_worker_phase_seconds_total Seconds each device worker spent per phase of its "
              "executions: gather (requests merged), prepare (call and memory), copy_in, launch (the op "
              "run; on a GPU its kernels queued), copy_out (queued), wait (the device finishing), answer "
              "(responses sent, or handed to the answer thread), answer_async (the worker's answer thread, "
              "beside its next batch).\n# TYPE moed_worker_phase_seconds_total counter\n");
    for (int i = 0; names && i < nw; i++)
      for (int p = 0; p < MOED_PHASES; p++)
        wb_printf(b, "moed_worker_phase_seconds_total{worker=\"%d\",backend=\"%s\",phase=\"%s\"} %.9f\n", i,
                  names[i], phase[p], (double)wl[i].phases.ns[p] / 1e9);
    free(names);
  }
  free(wl);
  wb_printf(b,
            "# HELP moed_stream_buffered_bytes ModelStreamInfer responses queued for clients, not yet "
            "written (bounded by --stream-buffer-bytes per stream, --response-buffer-bytes in all).\n"
            "# TYPE moed_stream_buffered_bytes gauge\nmoed_stream_buffered_bytes %zu\n",
            moed_rpc_buffered_bytes(s->rpc));
  wb_printf(b,
            "# HELP moed_grpc_request_bytes gRPC request message bytes held until each request is answered "
            "(bounded by --grpc-body-budget-bytes).\n"
            "# TYPE moed_grpc_request_bytes gauge\nmoed_grpc_request_bytes %zu\n",
            moed_rpc_request_bytes());
  wb_printf(b,
            "# HELP moed_rejected_total Requests refused (limits, drain).\n"
            "# TYPE moed_rejected_total counter\nmoed_rejected_total %llu\n",
            (unsigned long long)atomic_load(&s->rejected));
  if (s->weights) {
    moed_weight_cache_stats cs;
    moed_weight_cache_stats_get(s->weights, &cs);
    wb_printf(b,
              "# HELP moed_weight_cache_hits_total Inline fused_moe weight sets found on the device.\n"
              "# TYPE moed_weight_cache_hits_total counter\nmoed_weight_cache_hits_total %llu\n"
              "# HELP moed_weight_cache_misses_total Inline weight sets copied to the device.\n"
              "# TYPE moed_weight_cache_misses_total counter\nmoed_weight_cache_misses_total %llu\n"
              "# HELP moed_weight_cache_evictions_total Weight sets evicted (least recently used).\n"
              "# TYPE moed_weight_cache_evictions_total counter\nmoed_weight_cache_evictions_total %llu\n"
              "# HELP moed_weight_cache_bytes Bytes held by the weight cache.\n"
              "# TYPE moed_weight_cache_bytes gauge\nmoed_weight_cache_bytes %llu\n",
              (unsigned long long)cs.hits, (unsigned long long)cs.misses, (unsigned long long)cs.evictions,
              (unsigned long long)cs.bytes);
  }
  wb_printf(b, "# HELP moed_device_memory_bytes Device memory per GPU worker: resident (expert sets and "
               "packed weights kept on the device) and held (all the backend took from the device).\n"
               "# TYPE moed_device_memory_bytes gauge\n");
  for (int i = 0; i < moed_devices_count(s->devices); i++) {
    moe_backend_memory mem;
    char name[MOED_PROM_LABEL_SIZE(128)];
    const char *backend = moed_devices_memory(s->devices, i, &mem);
    if (!backend) continue; /* host memory: no device memory to show */
    moed_prom_label(name, sizeof name, backend);
    wb_printf(b, "moed_device_memory_bytes{worker=\"%d\",backend=\"%s\",kind=\"resident\"} %zu\n", i, name,
              mem.resident);
    wb_printf(b, "moed_device_memory_bytes{worker=\"%d\",backend=\"%s\",kind=\"held\"} %zu\n", i, name,
              mem.held);
  }
  size_t gpu_len;
  char *gpu_text = moed_gpu_metrics_render(h->gpu, &gpu_len);
  if (gpu_text) wb_printf(b, "%.*s", (int)gpu_len, gpu_text);
  free(gpu_text);
  wb_printf(b, "# HELP moed_http_connections Open HTTP connections, per port (rest: the KServe REST port, "
               "http: this one).\n# TYPE moed_http_connections gauge\n");
  moed_http_foreach_listener(http_open, b);
  wb_printf(b, "# HELP moed_http_connections_accepted_total HTTP connections accepted (not refused).\n"
               "# TYPE moed_http_connections_accepted_total counter\n");
  moed_http_foreach_listener(http_accepted, b);
  wb_printf(b, "# HELP moed_http_connections_closed_total HTTP connections closed by moed: over "
               "--http-max-connections at accept (refused), a request begun but not whole within "
               "--handshake-timeout, a body or an answer below --http-body-min-rate or stalled (timeout), "
               "no request within --idle-timeout (idle), a failed TLS handshake (tls).\n"
               "# TYPE moed_http_connections_closed_total counter\n");
  moed_http_foreach_listener(http_closed, b);
  wb_printf(b, "# HELP moed_http_requests_abandoned_total Requests in work whose client closed or reset its "
               "connection (their work withdrawn, nothing written).\n"
               "# TYPE moed_http_requests_abandoned_total counter\n");
  moed_http_foreach_listener(http_abandoned, b);
  uint64_t fd_reserve, fd_exhausted;
  moed_fd_budget_refused(&fd_reserve, &fd_exhausted);
  wb_printf(b,
            "# HELP moed_connections_refused_total Connections (gRPC and HTTP) closed at accept: their "
            "descriptor fell into --fd-reserve (reserve), or none was left (exhausted).\n"
            "# TYPE moed_connections_refused_total counter\n"
            "moed_connections_refused_total{reason=\"reserve\"} %llu\n"
            "moed_connections_refused_total{reason=\"exhausted\"} %llu\n",
            (unsigned long long)fd_reserve, (unsigned long long)fd_exhausted);
  wb_printf(
      b, "# HELP moed_ready Whether the server accepts inference.\n# TYPE moed_ready gauge\nmoed_ready %d\n",
      atomic_load(&s->ready) ? 1 : 0);
}

static void respond(moed_http_conn *c, int code, const char *ctype, const char *body, size_t len) {
  moed_http_respond_copy(c, code, ctype, body, len);
}

/* ---- the gRPC listener check ------------------------------------------------- */

static void probe_closed(uv_handle_t *hd) {
  probe *pr = hd->data;
  if (--pr->handles == 0) free(pr);
}

static uint64_t refusals(void) {
  uint64_t reserve, exhausted;
  moed_fd_budget_refused(&reserve, &exhausted);
  return reserve + exhausted;
}

static void probe_finish(probe *pr, bool ok) {
  if (pr->done) return;
  pr->done = true;
  moed_http_conn *c = pr->c;
  /* refused at accept (the count moved while the probe waited): the listener
   * works and descriptors are full up to the reserve; alive, not ready */
  bool full = !ok && refusals() > pr->refused0;
  if (c) {
    if (ok || (full && !pr->ready))
      respond(c, 200, "text/plain", "", 0);
    else if (full)
      respond(c, 503, "text/plain", "at the connection limit\n", 24);
    else
      respond(c, 503, "text/plain", "grpc listener not answering\n", 28);
  }
  uv_close((uv_handle_t *)&pr->tcp, probe_closed);
  uv_close((uv_handle_t *)&pr->timer, probe_closed);
}

static void probe_timeout(uv_timer_t *t) { probe_finish(t->data, false); }

static void probe_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf) {
  (void)suggested;
  probe *pr = hd->data;
  buf->base = (char *)pr->buf + pr->got;
  buf->len = sizeof pr->buf - pr->got;
}

/* HTTP/2 (RFC 9113): a frame header is length (3 bytes), type (1 byte: 4 =
 * SETTINGS), flags, stream id; the server's first frame is its SETTINGS.
 * TLS (RFC 8446): a record header is type (1 byte: 22 = handshake),
 * version (2), length (2); the server's first record holds its ServerHello. */
static void probe_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf) {
  (void)buf;
  probe *pr = st->data;
  if (n < 0) {
    probe_finish(pr, false);
    return;
  }
  pr->got += (size_t)n;
  if (pr->tls && pr->got >= 5)
    probe_finish(pr, pr->buf[0] == 22);
  else if (!pr->tls && pr->got >= 9)
    probe_finish(pr, pr->buf[3] == 4);
}

/* With TLS on the gRPC port the probe opens a TLS 1.3 handshake instead of
 * HTTP/2 (whose preface the server would log as a failed handshake) and
 * hangs up after the ServerHello, which gRPC core does not log. A
 * ClientHello the server can answer: TLS_AES_128_GCM_SHA256, P-256 with the
 * curve's base point as the key share (a valid point; no secret is ever
 * derived), ECDSA P-256 and RSA-PSS signatures. */
/* clang-format off */
static const unsigned char tls_hello[] = {
    0x16, 0x03, 0x01, 0x00, 0x93,                   /* record: handshake, 147 bytes */
    0x01, 0x00, 0x00, 0x8f, 0x03, 0x03,             /* ClientHello, 143 bytes, legacy version 1.2 */
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, /* random (32 bytes) */
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0x00,                                           /* no session id */
    0x00, 0x02, 0x13, 0x01,                         /* cipher suites: TLS_AES_128_GCM_SHA256 */
    0x01, 0x00,                                     /* compression: none */
    0x00, 0x64,                                     /* extensions, 100 bytes */
    0x00, 0x2b, 0x00, 0x03, 0x02, 0x03, 0x04,       /* supported_versions: TLS 1.3 */
    0x00, 0x0a, 0x00, 0x04, 0x00, 0x02, 0x00, 0x17, /* supported_groups: secp256r1 */
    0x00, 0x0d, 0x00, 0x06, 0x00, 0x04, 0x04, 0x03, 0x08, 0x04, /* signature_algorithms */
    0x00, 0x33, 0x00, 0x47, 0x00, 0x45, 0x00, 0x17, 0x00, 0x41, /* key_share: secp256r1, 65 bytes */
    0x04,                                           /* uncompressed point G: x, then y */
    0x6b, 0x17, 0xd1, 0xf2, 0xe1, 0x2c, 0x42, 0x47, 0xf8, 0xbc, 0xe6, 0xe5, 0x63, 0xa4, 0x40, 0xf2,
    0x77, 0x03, 0x7d, 0x81, 0x2d, 0xeb, 0x33, 0xa0, 0xf4, 0xa1, 0x39, 0x45, 0xd8, 0x98, 0xc2, 0x96,
    0x4f, 0xe3, 0x42, 0xe2, 0xfe, 0x1a, 0x7f, 0x9b, 0x8e, 0xe7, 0xeb, 0x4a, 0x7c, 0x0f, 0x9e, 0x16,
    0x2b, 0xce, 0x33, 0x57, 0x6b, 0x31, 0x5e, 0xce, 0xcb, 0xb6, 0x40, 0x68, 0x37, 0xbf, 0x51, 0xf5,
};
/* clang-format on */

static void probe_written(uv_write_t *w, int status) {
  probe *pr = w->data;
  if (status < 0) probe_finish(pr, false);
}

static void probe_connected(uv_connect_t *cr, int status) {
  probe *pr = cr->data;
  /* the client connection preface, then an empty SETTINGS frame */
  static char hello[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\4\0\0\0\0\0";
  if (pr->done) return;
  uv_buf_t b =
      pr->tls ? uv_buf_init((char *)tls_hello, sizeof tls_hello) : uv_buf_init(hello, sizeof hello - 1);
  pr->wreq.data = pr;
  if (status < 0 || uv_write(&pr->wreq, (uv_stream_t *)&pr->tcp, &b, 1, probe_written) != 0 ||
      uv_read_start((uv_stream_t *)&pr->tcp, probe_alloc, probe_read) != 0)
    probe_finish(pr, false);
}

static void probe_gone(void *arg) { ((probe *)arg)->c = NULL; } /* it finishes on its own, answering no one */

/* Answers c once the gRPC port has (200) or has not (503) answered. */
static void probe_start(moed_http *h, moed_http_conn *c, bool ready) {
  moed_server *s = h->srv;
  probe *pr = calloc(1, sizeof *pr);
  if (!pr || !h->grpc_ok) {
    free(pr);
    respond(c, 503, "text/plain", "grpc listener not checked\n", 26);
    return;
  }
  uv_tcp_init(s->loop, &pr->tcp);
  uv_timer_init(s->loop, &pr->timer);
  pr->handles = 2;
  pr->tcp.data = pr->timer.data = pr->creq.data = pr;
  pr->c = c;
  pr->ready = ready;
  pr->refused0 = refusals();
  pr->tls = s->cfg->tls_cert != NULL;
  moed_http_defer(c, probe_gone, pr);
  uv_timer_start(&pr->timer, probe_timeout, PROBE_MS, 0);
  if (uv_tcp_connect(&pr->creq, &pr->tcp, (const struct sockaddr *)&h->grpc, probe_connected) != 0)
    probe_finish(pr, false);
}

/* --auth-tokens on this port: the probes are health calls (exempt with
 * --auth-health-exempt, like the gRPC ones), /metrics shows what
 * ModelStatistics does (an infer token; exempt with --auth-metrics-exempt).
 * true: allowed; else c was answered 401 or 403 with why. */
static bool authorized(moed_http *h, moed_http_conn *c, const moed_http_request *rq, bool metrics) {
  if (metrics && h->srv->cfg->auth_metrics_exempt) return true;
  char who[128], why[MOED_ERR_LEN], peer[160];
  grpc_status_code code = moed_auth_check_value(metrics ? MOED_M_MODEL_STATISTICS : MOED_M_SERVER_LIVE,
                                                rq->authorization_len < 0 ? NULL : rq->authorization,
                                                rq->authorization_len < 0 ? 0 : (size_t)rq->authorization_len,
                                                who, sizeof who, why);
  if (code == GRPC_STATUS_OK) return true;
  moed_http_peer(c, peer, sizeof peer);
  moed_log(MOED_LOG_DEBUG, "auth_refused", "HTTP %s from http:%s: %s", rq->path, peer, why);
  moed_http_respond_error(c, moed_http_status_from_grpc(code), why);
  return false;
}

static void on_request(moed_http_conn *c, moed_http_request *rq, void *arg) {
  moed_http *h = arg;
  moed_server *s = h->srv;
  bool metrics = strcmp(rq->path, "/metrics") == 0;
  bool known = metrics || !strcmp(rq->path, "/v2/health/live") || !strcmp(rq->path, "/v2/health/ready");
  if (rq->method != HTTP_GET) {
    respond(c, 405, "text/plain", "GET only\n", 9);
  } else if (known && !authorized(h, c, rq, metrics)) {
    /* answered */
  } else if (metrics) {
    wbuf b = {0};
    render_metrics(h, &b);
    if (b.oom)
      respond(c, 500, "text/plain", "out of memory\n", 14);
    else
      respond(c, 200, "text/plain; version=0.0.4", b.p, b.len);
    free(b.p);
  } else if (strcmp(rq->path, "/v2/health/live") == 0) {
    if (atomic_load(&s->draining)) /* the gRPC port closes on purpose; the exit is bounded by the drain */
      respond(c, 200, "text/plain", "", 0);
    else
      probe_start(h, c, false);
  } else if (strcmp(rq->path, "/v2/health/ready") == 0) {
    if (atomic_load(&s->ready))
      probe_start(h, c, true);
    else
      respond(c, 503, "text/plain", "", 0);
  } else {
    respond(c, 404, "text/plain", "not found\n", 10);
  }
}

static bool parse_addr(const char *host, int port, struct sockaddr_storage *out) {
  return uv_ip4_addr(host, port, (struct sockaddr_in *)out) == 0 ||
         uv_ip6_addr(host, port, (struct sockaddr_in6 *)out) == 0;
}

int moed_http_start(moed_server *s, const char *address, int port, moed_http **out, int *bound_port) {
  moed_http *h = calloc(1, sizeof *h);
  if (!h) return -1;
  h->srv = s;
  /* the gRPC listener the probes check; a wildcard bind is checked on loopback */
  const char *g = s->cfg->address;
  const char *ghost = !strcmp(g, "0.0.0.0")                      ? "127.0.0.1"
                      : (!strcmp(g, "::") || !strcmp(g, "[::]")) ? "::1"
                                                                 : g;
  h->grpc_ok = parse_addr(ghost, s->grpc_port, &h->grpc);
  /* NVML read from here on: nv_energy_consumption counts from the start */
  const int workers = moed_devices_count(s->devices);
  const char **backends = calloc(workers > 0 ? (size_t)workers : 1, sizeof *backends);
  for (int i = 0; backends && i < workers; i++) {
    moe_backend_memory mem;
    backends[i] = moed_devices_memory(s->devices, i, &mem); /* NULL: a host worker */
  }
  if (backends) h->gpu = moed_gpu_metrics_create(!s->cfg->gpu_metrics_off, workers, backends);
  free(backends);
  /* requests here are GETs: a body is not needed, 4 KiB bounds one */
  const moed_http_options o = {.name = "http",
                               .cfg = s->cfg,
                               .max_body = 4096,
                               .side = true,
                               .tls = s->cfg->tls_cert && !s->cfg->http_port_plaintext};
  if (moed_http_listen(s->loop, address, port, &o, on_request, h, &h->l, bound_port) != 0) {
    moed_gpu_metrics_destroy(h->gpu);
    free(h);
    return -1;
  }
  *out = h;
  return 0;
}

void moed_http_stop(moed_http *h) {
  if (!h) return;
  moed_http_listener_close(h->l);
  moed_gpu_metrics_destroy(h->gpu);
  free(h);
}
