/* http: the side port on the loop: Prometheus /metrics and the Kubernetes
 * probes /v2/health/live and /v2/health/ready. One request per connection
 * (Connection: close), parsed by http-parser; a connection has
 * --handshake-timeout to send its whole request (slowloris), and at most
 * --http-max-connections are open (beyond: closed at accept).
 *
 * The probes check the gRPC listener itself: gRPC core stops accepting
 * for good once accept4 fails (fd_budget.c keeps EMFILE from it; this
 * catches what it does not), and a probe that only read a flag would keep
 * answering 200 for a pod nobody can call. Each probe connects to the gRPC
 * port and expects the server's HTTP/2 SETTINGS frame (TLS: its ServerHello) within PROBE_MS; a
 * probe connection refused at accept for want of descriptors means a full
 * server, not a stuck one: live 200, ready 503. */
#include <http_parser.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed.h"
#include "prom_label.h"

#define PROBE_MS 2000

struct moed_http {
  moed_server *srv;
  uv_tcp_t tcp;
  int open;                     /* connections open (loop thread) */
  uint64_t refused;             /* closed at accept: over --http-max-connections */
  uint64_t timeouts;            /* closed: no whole request within --handshake-timeout */
  struct sockaddr_storage grpc; /* what the probes connect to */
  bool grpc_ok;                 /* parsed (a host name is not: probes answer 503, not checked) */
};

typedef struct probe probe;

typedef struct conn {
  uv_tcp_t tcp;
  uv_timer_t timer; /* the request deadline */
  int handles;      /* open handles of tcp and timer: freed at 0 */
  moed_http *h;
  http_parser parser;
  char url[256];
  size_t url_len;
  bool complete; /* the request was whole (its answer may wait for a probe) */
  bool responded;
  probe *pr; /* the gRPC listener check this request waits for */
} conn;

struct probe {
  uv_tcp_t tcp;
  uv_timer_t timer;
  uv_connect_t creq;
  uv_write_t wreq;
  int handles;
  conn *c; /* NULL once the requester went away */
  bool done;
  bool ready;        /* readiness (a full server is not ready) or liveness (it is alive) */
  uint64_t refused0; /* connections refused at accept when the probe started */
  bool tls;          /* the gRPC port speaks TLS */
  unsigned char buf[16];
  size_t got;
};

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

static void hist(wbuf *b, const char *metric, const char *model, const moed_hist *h) {
  uint64_t cum = 0;
  for (int i = 0; i < MOED_HIST_BUCKETS; i++) {
    cum += atomic_load(&h->le[i]);
    if (i < MOED_HIST_BUCKETS - 1)
      wb_printf(b, "%s_bucket{model=\"%s\",le=\"%g\"} %llu\n", metric, model,
                (double)moed_hist_bounds_ns[i] / 1e9, (unsigned long long)cum);
    else
      wb_printf(b, "%s_bucket{model=\"%s\",le=\"+Inf\"} %llu\n", metric, model, (unsigned long long)cum);
  }
  wb_printf(b, "%s_sum{model=\"%s\"} %.9f\n", metric, model, (double)atomic_load(&h->sum_ns) / 1e9);
  wb_printf(b, "%s_count{model=\"%s\"} %llu\n", metric, model, (unsigned long long)atomic_load(&h->count));
}

typedef struct metrics_pass {
  wbuf *b;
  int section;
} metrics_pass;

static void model_metrics(moed_model *m, void *arg) {
  metrics_pass *p = arg;
  const moed_model_stats *st = m->stats;
  wbuf *b = p->b;
  char name[MOED_PROM_LABEL_SIZE(sizeof m->name)];
  moed_prom_label(name, sizeof name, m->name);
  switch (p->section) {
  case 0:
    wb_printf(b, "moed_requests_total{model=\"%s\",outcome=\"success\"} %llu\n", name,
              (unsigned long long)atomic_load(&st->success_count));
    wb_printf(b, "moed_requests_total{model=\"%s\",outcome=\"failure\"} %llu\n", name,
              (unsigned long long)atomic_load(&st->fail_count));
    break;
  case 1: hist(b, "moed_queue_seconds", name, &st->queue_hist); break;
  case 2: hist(b, "moed_compute_seconds", name, &st->compute_hist); break;
  case 3: hist(b, "moed_request_seconds", name, &st->total_hist); break;
  case 4:
    wb_printf(b, "moed_bytes_in_total{model=\"%s\"} %llu\n", name,
              (unsigned long long)atomic_load(&st->bytes_in));
    break;
  case 5:
    wb_printf(b, "moed_bytes_out_total{model=\"%s\"} %llu\n", name,
              (unsigned long long)atomic_load(&st->bytes_out));
    break;
  }
}

static void render_metrics(moed_http *h, wbuf *b) {
  moed_server *s = h->srv;
  static const char *const heads[] = {
      "# HELP moed_requests_total Inference requests by model and outcome.\n# TYPE moed_requests_total "
      "counter\n",
      "# HELP moed_queue_seconds Time from arrival to the start of compute.\n# TYPE moed_queue_seconds "
      "histogram\n",
      "# HELP moed_compute_seconds Time running the op.\n# TYPE moed_compute_seconds histogram\n",
      "# HELP moed_request_seconds Time from arrival to response.\n# TYPE moed_request_seconds histogram\n",
      "# HELP moed_bytes_in_total Input tensor bytes received.\n# TYPE moed_bytes_in_total counter\n",
      "# HELP moed_bytes_out_total Output tensor bytes sent.\n# TYPE moed_bytes_out_total counter\n",
  };
  for (int sec = 0; sec < 6; sec++) {
    wb_printf(b, "%s", heads[sec]);
    metrics_pass p = {b, sec};
    moed_repository_foreach(s->repo, model_metrics, &p);
  }
  wb_printf(b,
            "# HELP moed_inflight_requests Admitted inference requests not yet answered.\n"
            "# TYPE moed_inflight_requests gauge\nmoed_inflight_requests %d\n",
            atomic_load(&s->inflight));
  wb_printf(b,
            "# HELP moed_stream_buffered_bytes ModelStreamInfer responses queued for clients, not yet "
            "written (bounded by --stream-buffer-bytes per stream, --response-buffer-bytes in all).\n"
            "# TYPE moed_stream_buffered_bytes gauge\nmoed_stream_buffered_bytes %zu\n",
            moed_rpc_buffered_bytes(s->rpc));
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
  wb_printf(b, "# HELP moed_device_memory_bytes Device memory per worker: resident (expert sets and packed "
               "weights kept on the device) and held (all the backend took from the device).\n"
               "# TYPE moed_device_memory_bytes gauge\n");
  for (int i = 0; i < moed_devices_count(s->devices); i++) {
    moe_backend_memory mem;
    char name[MOED_PROM_LABEL_SIZE(128)];
    moed_prom_label(name, sizeof name, moed_devices_memory(s->devices, i, &mem));
    wb_printf(b, "moed_device_memory_bytes{worker=\"%d\",backend=\"%s\",kind=\"resident\"} %zu\n", i, name,
              mem.resident);
    wb_printf(b, "moed_device_memory_bytes{worker=\"%d\",backend=\"%s\",kind=\"held\"} %zu\n", i, name,
              mem.held);
  }
  wb_printf(b,
            "# HELP moed_http_connections_closed_total HTTP connections closed by moed: over "
            "--http-max-connections at accept (refused), or without a whole request within "
            "--handshake-timeout (timeout).\n"
            "# TYPE moed_http_connections_closed_total counter\n"
            "moed_http_connections_closed_total{reason=\"refused\"} %llu\n"
            "moed_http_connections_closed_total{reason=\"timeout\"} %llu\n"
            "# HELP moed_http_connections Open HTTP connections.\n# TYPE moed_http_connections gauge\n"
            "moed_http_connections %d\n",
            (unsigned long long)h->refused, (unsigned long long)h->timeouts, h->open);
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

/* ---- connections -------------------------------------------------------------- */

static void on_closed(uv_handle_t *hd) {
  conn *c = hd->data;
  if (--c->handles == 0) {
    c->h->open--;
    free(c);
  }
}

static void close_conn(conn *c) {
  if (c->pr) c->pr->c = NULL; /* the probe finishes on its own, answering no one */
  c->pr = NULL;
  if (!uv_is_closing((uv_handle_t *)&c->tcp)) uv_close((uv_handle_t *)&c->tcp, on_closed);
  if (!uv_is_closing((uv_handle_t *)&c->timer)) uv_close((uv_handle_t *)&c->timer, on_closed);
}

typedef struct write_req {
  uv_write_t w;
  char *buf;
  conn *c;
} write_req;

static void on_written(uv_write_t *w, int status) {
  (void)status;
  write_req *wr = (write_req *)w;
  close_conn(wr->c);
  free(wr->buf);
  free(wr);
}

static void respond(conn *c, int code, const char *reason, const char *ctype, const char *body, size_t len) {
  wbuf b = {0};
  c->responded = true;
  wb_printf(&b, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
            code, reason, ctype, len);
  if (!b.oom && len) {
    char *g = realloc(b.p, b.len + len);
    if (!g) {
      b.oom = true;
    } else {
      b.p = g;
      memcpy(b.p + b.len, body, len);
      b.len += len;
    }
  }
  write_req *wr = b.oom ? NULL : malloc(sizeof *wr);
  if (!wr) {
    free(b.p);
    close_conn(c);
    return;
  }
  wr->buf = b.p;
  wr->c = c;
  uv_buf_t ub = uv_buf_init(b.p, (unsigned)b.len);
  if (uv_write(&wr->w, (uv_stream_t *)&c->tcp, &ub, 1, on_written) != 0) {
    free(wr->buf);
    free(wr);
    close_conn(c);
  }
}

static int on_url(http_parser *p, const char *at, size_t len) {
  conn *c = p->data;
  size_t room = sizeof c->url - 1 - c->url_len;
  if (len > room) len = room;
  memcpy(c->url + c->url_len, at, len);
  c->url_len += len;
  c->url[c->url_len] = 0;
  return 0;
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
  conn *c = pr->c;
  /* refused at accept (the count moved while the probe waited): the listener
   * works and descriptors are full up to the reserve; alive, not ready */
  bool full = !ok && refusals() > pr->refused0;
  if (c) {
    c->pr = NULL;
    if (ok || (full && !pr->ready))
      respond(c, 200, "OK", "text/plain", "", 0);
    else if (full)
      respond(c, 503, "Service Unavailable", "text/plain", "at the connection limit\n", 24);
    else
      respond(c, 503, "Service Unavailable", "text/plain", "grpc listener not answering\n", 28);
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

/* Answers c once the gRPC port has (200) or has not (503) answered. */
static void probe_start(conn *c, bool ready) {
  moed_server *s = c->h->srv;
  probe *pr = calloc(1, sizeof *pr);
  if (!pr || !c->h->grpc_ok) {
    free(pr);
    respond(c, 503, "Service Unavailable", "text/plain", "grpc listener not checked\n", 26);
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
  c->pr = pr;
  uv_timer_start(&pr->timer, probe_timeout, PROBE_MS, 0);
  if (uv_tcp_connect(&pr->creq, &pr->tcp, (const struct sockaddr *)&c->h->grpc, probe_connected) != 0)
    probe_finish(pr, false);
}

static int on_message_complete(http_parser *p) {
  conn *c = p->data;
  moed_server *s = c->h->srv;
  char *q = strchr(c->url, '?');
  if (q) *q = 0;
  if (p->method != HTTP_GET) {
    respond(c, 405, "Method Not Allowed", "text/plain", "GET only\n", 9);
  } else if (strcmp(c->url, "/metrics") == 0) {
    wbuf b = {0};
    render_metrics(c->h, &b);
    if (b.oom)
      respond(c, 500, "Internal Server Error", "text/plain", "out of memory\n", 14);
    else
      respond(c, 200, "OK", "text/plain; version=0.0.4", b.p, b.len);
    free(b.p);
  } else if (strcmp(c->url, "/v2/health/live") == 0) {
    if (atomic_load(&s->draining)) /* the gRPC port closes on purpose; the exit is bounded by the drain */
      respond(c, 200, "OK", "text/plain", "", 0);
    else
      probe_start(c, false);
  } else if (strcmp(c->url, "/v2/health/ready") == 0) {
    if (atomic_load(&s->ready))
      probe_start(c, true);
    else
      respond(c, 503, "Service Unavailable", "text/plain", "", 0);
  } else {
    respond(c, 404, "Not Found", "text/plain", "not found\n", 10);
  }
  c->complete = true;
  uv_timer_stop(&c->timer); /* the request is whole: the answer (or its probe) has its own bound */
  return 1;                 /* one request per connection: stop parsing */
}

static const http_parser_settings settings = {
    .on_url = on_url,
    .on_message_complete = on_message_complete,
};

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)h;
  buf->base = malloc(suggested);
  buf->len = buf->base ? suggested : 0;
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf) {
  conn *c = st->data;
  if (n > 0 && !c->complete) {
    size_t used = http_parser_execute(&c->parser, &settings, buf->base, (size_t)n);
    if (!c->complete && (c->parser.http_errno != HPE_OK || used != (size_t)n)) {
      uv_read_stop(st);
      respond(c, 400, "Bad Request", "text/plain", "bad request\n", 12);
    } else if (c->complete) {
      uv_read_stop(st);
    }
  } else if (n < 0) {
    if (!c->responded) close_conn(c);
  }
  free(buf->base);
}

static void on_deadline(uv_timer_t *t) {
  conn *c = t->data;
  c->h->timeouts++;
  close_conn(c);
}

static void on_connection(uv_stream_t *server, int status) {
  moed_http *h = server->data;
  if (status < 0) return;
  conn *c = calloc(1, sizeof *c);
  if (!c) return;
  c->h = h;
  h->open++;
  uv_tcp_init(server->loop, &c->tcp);
  uv_timer_init(server->loop, &c->timer);
  c->handles = 2;
  c->tcp.data = c->timer.data = c;
  if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
    close_conn(c);
    return;
  }
  if (h->open > h->srv->cfg->http_max_connections) { /* accepted only to leave the backlog */
    h->refused++;
    close_conn(c);
    return;
  }
  uv_timer_start(&c->timer, on_deadline, (uint64_t)h->srv->cfg->handshake_timeout_s * 1000, 0);
  http_parser_init(&c->parser, HTTP_REQUEST);
  c->parser.data = c;
  uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
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
  const char *ghost = !strcmp(g, "0.0.0.0") ? "127.0.0.1" : !strcmp(g, "::") ? "::1" : g;
  struct sockaddr_storage addr;
  h->grpc_ok = parse_addr(ghost, s->grpc_port, &h->grpc);
  if (!parse_addr(address, port, &addr)) { /* config.c admits literals only: not expected */
    moed_log(MOED_LOG_ERROR, "bind_failed", "http %s: not an IP address", address);
    free(h);
    return -1;
  }
  uv_tcp_init(s->loop, &h->tcp);
  h->tcp.data = h;
  int rc = uv_tcp_bind(&h->tcp, (const struct sockaddr *)&addr, 0);
  if (rc == 0) rc = uv_listen((uv_stream_t *)&h->tcp, 128, on_connection);
  uv_os_fd_t lfd;
  if (rc == 0 && uv_fileno((uv_handle_t *)&h->tcp, &lfd) == 0) moed_fd_budget_side_listener(lfd);
  if (rc != 0) {
    moed_log(MOED_LOG_ERROR, "bind_failed", "http %s:%d: %s", address, port, uv_strerror(rc));
    moed_http_stop(h);
    return -1;
  }
  struct sockaddr_storage name;
  int len = sizeof name;
  uv_tcp_getsockname(&h->tcp, (struct sockaddr *)&name, &len);
  *bound_port = ntohs(((struct sockaddr_in *)&name)->sin_port);
  *out = h;
  return 0;
}

static void on_listener_closed(uv_handle_t *hd) { free(hd->data); }

void moed_http_stop(moed_http *h) {
  if (h) uv_close((uv_handle_t *)&h->tcp, on_listener_closed);
}
