/* http_conn: HTTP/1.1 connections on the loop, for both HTTP listeners
 * (http.c's side port, rest.c's KServe REST port): accept with a cap on
 * open connections, parse with http-parser, buffer a bounded body, hand
 * each whole request to the listener's handler, write its answer, and keep
 * the connection for the next request or close it.
 *
 * Deadlines (slowloris): a request's line and headers must arrive within
 * --handshake-timeout of its first byte, and its body may pause at most as
 * long between two reads; a keep-alive connection waits --idle-timeout for
 * its next request. While the handler works (the answer may come from a
 * worker), no deadline runs: the answer has its own bounds. One request at
 * a time per connection: bytes of a pipelined next request are held (up to
 * HELD_MAX, then reading pauses) until the answer is written.
 *
 * A client that leaves while its request is in work: reading goes on while
 * the handler works, so a connection error or the client's FIN is seen
 * then, not when the answer is written. A FIN is a half-close or a close,
 * which TCP does not tell apart until the server writes, and moed has
 * nothing to write before the answer. It is taken as the client leaving
 * (the handler's gone() is called and nothing is written) unless the
 * client said it would send nothing more: the last whole request it sent
 * does not keep the connection (Connection: close, or HTTP/1.0 without
 * keep-alive), and nothing follows that request. Such a client is answered
 * (every request up to that one) and the connection then closed.
 *
 * Transport: the socket as is, or TLS (OpenSSL through memory BIOs: the
 * records go through libuv's stream like any bytes; tls.c owns the
 * context and its reload), or, for the fuzz target, no socket at all (a
 * memory connection: bytes fed in, written bytes handed to a sink). The
 * parsing and answering above do not know which. */
#include <cjson/cJSON.h>
#include <http_parser.h>
#include <limits.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed.h"

#define IHCL "inference-header-content-length"

/* Bytes held while a request is in work (a pipelined request); past this,
 * reading pauses until the answer is written and a close is not seen. */
#define HELD_MAX (64 * 1024)

enum { H_OTHER, H_IHCL, H_EXPECT, H_ENCODING, H_AUTH };

struct moed_http_listener {
  uv_tcp_t tcp;
  uv_loop_t *loop;
  moed_http_options o;
  moed_http_handler fn;
  void *arg;
  moed_http_conn *conns;                              /* open connections (loop thread) */
  moed_http_listener *next_listener, **prev_listener; /* every listener, for /metrics (loop thread) */
  moed_http_stats n;
  bool memory; /* no socket (moed_http_memory_listener) */
  bool closing;
};

static moed_http_listener *listeners; /* loop thread */

struct moed_http_conn {
  moed_http_conn *next, **prev;
  uv_tcp_t tcp;
  uv_timer_t timer;
  int handles; /* open handles of tcp and timer: freed at 0 */
  moed_http_listener *l;
  http_parser parser;
  moed_http_request rq;
  size_t body_cap;
  bool in_request; /* its first byte came: the deadline is the request's, not the idle one */
  bool url_long, too_large, in_body;
  char hname[40]; /* the header name arriving (a read may end inside it); longer: none moed reads */
  size_t hname_len;
  bool in_value; /* the last piece was a value: a name piece starts the next header */
  int header;    /* the header whose value comes: H_* */
  char hval[32]; /* its value (but Authorization's, kept in rq), cut at 31 bytes */
  size_t hval_len;
  bool expect_continue;            /* Expect: 100-continue (curl sends it before a body over 1 KiB) */
  bool encoded;                    /* Content-Encoding other than identity: 415 */
  char unauthorized[MOED_ERR_LEN]; /* set: a body from a client without a known token: 401 */
  bool over_budget;                /* its body would pass --http-body-budget-bytes: 503 */
  bool busy;                       /* a whole request is with the handler or its answer being written */
  bool keep_alive;                 /* of the current request */
  bool said_close;                 /* the current request declared itself the client's last */
  bool paused;                     /* the socket is not read (held bytes at HELD_MAX, or a refusal) */
  bool eof;                        /* the client's FIN (or TLS close_notify) came: nothing more will */
  bool half_closed;                /* ... after its last request: it still waits for the answers */
  bool closing;
  void (*gone)(void *); /* the deferred handler's: the connection closed first */
  void *gone_arg;
  char *pending; /* bytes read past the current request (pipelined), held for after its answer */
  size_t pending_len;
  SSL *ssl;                                   /* TLS: its BIOs hold records read and to write */
  void (*sink)(void *, const char *, size_t); /* a memory connection's output (no tcp) */
  void *sink_arg;
  struct write_req *unfinished; /* a memory connection's answer, written, its completion not yet run */
};

/* ---- connections ---------------------------------------------------------------- */

/* Request body bytes held by every HTTP connection (buffer capacity, kept
 * until the request is answered: its protobuf copy lives that long too),
 * against --http-body-budget-bytes: each body is bounded by
 * --max-message-bytes, this bounds them together (256 connections could
 * otherwise hold 256 GiB). Atomic: the ports may have loops of their own. */
static _Atomic size_t body_bytes;

/* Grows c's claim to cap bytes; false (nothing claimed) past the budget. */
static bool body_claim(moed_http_conn *c, size_t cap) {
  const size_t more = cap - c->body_cap, budget = c->l->o.cfg->http_body_budget_bytes;
  size_t held = atomic_load(&body_bytes);
  do {
    if (more > budget || held > budget - more) return false;
  } while (!atomic_compare_exchange_weak(&body_bytes, &held, held + more));
  return true;
}

static void body_release(moed_http_conn *c) {
  atomic_fetch_sub(&body_bytes, c->body_cap);
  c->body_cap = 0;
}

static void on_closed(uv_handle_t *hd) {
  moed_http_conn *c = hd->data;
  if (--c->handles) return;
  SSL_free(c->ssl); /* and its BIOs */
  body_release(c);
  free(c->rq.body);
  free(c->pending);
  free(c);
}

static void tls_flush(moed_http_conn *c, struct write_req *wr);

static void close_conn(moed_http_conn *c) {
  if (c->closing) return;
  c->closing = true;
  if (c->gone) c->gone(c->gone_arg);
  c->gone = NULL;
  *c->prev = c->next;
  if (c->next) c->next->prev = c->prev;
  c->l->n.open--;
  if (c->ssl && SSL_is_init_finished(c->ssl)) { /* close_notify, best effort: the socket closes next */
    SSL_shutdown(c->ssl);
    tls_flush(c, NULL);
  }
  if (!c->sink) uv_close((uv_handle_t *)&c->tcp, on_closed);
  uv_close((uv_handle_t *)&c->timer, on_closed);
}

static void on_deadline(uv_timer_t *t) {
  moed_http_conn *c = t->data;
  if (c->in_request) /* an idle keep-alive connection's end is no timeout */
    c->l->n.timeouts++;
  else
    c->l->n.idle_closed++;
  close_conn(c);
}

static void arm(moed_http_conn *c, int seconds) {
  uv_timer_start(&c->timer, on_deadline, (uint64_t)seconds * 1000, 0);
}

/* ---- transport: plain, TLS or memory ----------------------------------------------- */

/* An answer being written: its bytes (or their TLS records), then the next request. */
typedef struct write_req {
  uv_write_t w;
  moed_http_conn *c;
  char *head;
  void (*release)(void *);
  void *release_arg;
  char *records; /* TLS: the encrypted answer */
} write_req;

/* Bytes written by TLS itself (handshake, alerts, close_notify): freed when sent. */
typedef struct tls_out {
  uv_write_t w;
  char data[];
} tls_out;

static void on_written(uv_write_t *w, int status);
static void on_tls_out(uv_write_t *w, int status) {
  (void)status; /* a failed write shows as a read error too: the connection closes there */
  free(w);
}

/* Writes the records TLS has produced: with wr, as the answer wr (its
 * completion runs on_written), else on their own. */
static void tls_flush(moed_http_conn *c, write_req *wr) {
  BIO *out = SSL_get_wbio(c->ssl);
  size_t n = BIO_ctrl_pending(out);
  if (!n && !wr) return;
  char *data = NULL;
  tls_out *o = NULL;
  if (wr)
    data = wr->records = malloc(n ? n : 1);
  else if ((o = malloc(sizeof *o + n)))
    data = o->data;
  if (!data || BIO_read(out, data, (int)n) != (int)n) goto fail; /* one answer's records: n < INT_MAX */
  uv_buf_t b = uv_buf_init(data, (unsigned)n);
  if (wr ? uv_write(&wr->w, (uv_stream_t *)&c->tcp, &b, 1, on_written) == 0
         : uv_write(&o->w, (uv_stream_t *)&c->tcp, &b, 1, on_tls_out) == 0)
    return;
fail:
  free(o);
  (void)BIO_reset(out);
  if (wr) on_written(&wr->w, UV_ENOMEM); /* frees wr and closes */
}

/* Writes bufs[0..n) as the answer wr; its completion runs on_written. */
static int send_answer(moed_http_conn *c, write_req *wr, const uv_buf_t *bufs, unsigned n) {
  if (c->sink) { /* completed by moed_http_memory_feed, as the loop would after the write */
    for (unsigned i = 0; i < n; i++)
      c->sink(c->sink_arg, bufs[i].base, bufs[i].len);
    c->unfinished = wr;
    return 0;
  }
  if (!c->ssl) return uv_write(&wr->w, (uv_stream_t *)&c->tcp, bufs, n, on_written);
  for (unsigned i = 0; i < n; i++) /* a memory BIO takes all: SSL_write never writes part */
    for (size_t at = 0; at < bufs[i].len;) {
      int step = bufs[i].len - at > INT_MAX ? INT_MAX : (int)(bufs[i].len - at);
      if (SSL_write(c->ssl, bufs[i].base + at, step) != step) return -1;
      at += (size_t)step;
    }
  tls_flush(c, wr);
  return 0;
}

/* Bytes ahead of the answer (100 Continue), best effort. */
static void send_now(moed_http_conn *c, const char *data, size_t len) {
  if (c->sink) return c->sink(c->sink_arg, data, len);
  if (c->ssl) {
    if (SSL_write(c->ssl, data, (int)len) == (int)len) tls_flush(c, NULL);
    return;
  }
  uv_buf_t b = uv_buf_init((char *)data, (unsigned)len);
  uv_try_write((uv_stream_t *)&c->tcp, &b, 1); /* a fresh connection's socket takes 25 bytes; if not, the
                                                 client sends the body after its own wait (curl: 1 s) */
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf);
static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);

static void pause_input(moed_http_conn *c) {
  if (!c->sink && !c->paused) uv_read_stop((uv_stream_t *)&c->tcp);
  c->paused = true;
}

static int resume_input(moed_http_conn *c) {
  if (!c->paused) return 0; /* libuv refuses a second start */
  c->paused = false;
  return c->sink ? 0 : uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

/* Keeps data[0..n) for after the answer of the request in work. */
static void hold(moed_http_conn *c, const char *data, size_t n) {
  char *g = realloc(c->pending, c->pending_len + n);
  if (!g) return close_conn(c);
  memcpy(g + c->pending_len, data, n);
  c->pending = g;
  c->pending_len += n;
  if (c->pending_len >= HELD_MAX) pause_input(c);
}

/* ---- parsing ----------------------------------------------------------------------- */

static int on_message_begin(http_parser *p) {
  moed_http_conn *c = p->data;
  c->rq.path[0] = 0;
  c->rq.body_len = 0;
  c->rq.inference_header_length = -1;
  c->rq.authorization_len = -1;
  c->url_long = c->too_large = c->in_body = c->expect_continue = c->encoded = c->over_budget = false;
  c->unauthorized[0] = 0;
  c->header = H_OTHER;
  c->in_request = true;
  c->hname_len = c->hval_len = 0;
  c->in_value = false;
  arm(c, c->l->o.cfg->handshake_timeout_s);
  return 0;
}

static int on_url(http_parser *p, const char *at, size_t len) {
  moed_http_conn *c = p->data;
  size_t have = strlen(c->rq.path);
  if (c->url_long || len > sizeof c->rq.path - 1 - have) { /* refused once the headers are whole */
    c->url_long = true;
    return 0;
  }
  memcpy(c->rq.path + have, at, len);
  c->rq.path[have + len] = 0;
  return 0;
}

/* Names and values may arrive in pieces (a read can end anywhere): each is
 * gathered whole, and a header is read once its value ended (the next
 * name begins or the headers end). */
static void header_done(moed_http_conn *c) {
  const char *v = c->hval;
  size_t n = c->hval_len;
  const bool cut = n >= sizeof c->hval - 1;
  while (n && (v[n - 1] == ' ' || v[n - 1] == '\t')) /* trailing whitespace is no part of a value */
    c->hval[--n] = 0;
  switch (c->header) {
  case H_ENCODING: /* no decompression here: a compressed body would read as malformed JSON */
    if (!(n == 8 && strncasecmp(v, "identity", 8) == 0)) c->encoded = true;
    break;
  case H_EXPECT: c->expect_continue = n == 12 && strncasecmp(v, "100-continue", 12) == 0; break;
  case H_IHCL: {
    char *end;
    long long x = strtoll(v, &end, 10);
    c->rq.inference_header_length = (n == 0 || cut || *end || x < 0) ? -2 : x;
    break;
  }
  default: break;
  }
}

static int on_header_field(http_parser *p, const char *at, size_t len) {
  moed_http_conn *c = p->data;
  if (c->in_value) {
    header_done(c);
    c->in_value = false;
    c->hname_len = 0;
  }
  if (len > sizeof c->hname - c->hname_len) len = sizeof c->hname - c->hname_len; /* too long: no match */
  memcpy(c->hname + c->hname_len, at, len);
  c->hname_len += len;
  return 0;
}

static int on_header_value(http_parser *p, const char *at, size_t len) {
  moed_http_conn *c = p->data;
  if (!c->in_value) { /* the name is whole */
    const char *h = c->hname;
    const size_t n = c->hname_len;
    c->header = n == strlen(IHCL) && strncasecmp(h, IHCL, n) == 0        ? H_IHCL
                : n == 6 && strncasecmp(h, "expect", 6) == 0             ? H_EXPECT
                : n == 16 && strncasecmp(h, "content-encoding", 16) == 0 ? H_ENCODING
                : n == 13 && strncasecmp(h, "authorization", 13) == 0    ? H_AUTH
                                                                         : H_OTHER;
    c->in_value = true;
    c->hval_len = 0;
    c->hval[0] = 0;
  }
  if (c->header == H_AUTH) { /* past the buffer it is cut */
    moed_http_request *rq = &c->rq;
    size_t have = rq->authorization_len < 0 ? 0 : (size_t)rq->authorization_len;
    size_t take = len < sizeof rq->authorization - 1 - have ? len : sizeof rq->authorization - 1 - have;
    memcpy(rq->authorization + have, at, take);
    rq->authorization_len = (int)(have + take);
    rq->authorization[have + take] = 0;
    return 0;
  }
  if (c->header == H_OTHER) return 0;
  if (len > sizeof c->hval - 1 - c->hval_len) len = sizeof c->hval - 1 - c->hval_len;
  memcpy(c->hval + c->hval_len, at, len);
  c->hval_len += len;
  c->hval[c->hval_len] = 0;
  return 0;
}

static int on_headers_complete(http_parser *p) {
  moed_http_conn *c = p->data;
  if (c->in_value) header_done(c);
  c->in_value = false;
  if (c->url_long) return -1;
  /* chunked bodies have no length: they are checked as they arrive */
  if (!(p->flags & F_CHUNKED) && p->content_length != ULLONG_MAX && p->content_length > c->l->o.max_body) {
    c->too_large = true;
    return -1; /* an error: the parse stops here (1 would mean "no body") */
  }
  if (c->encoded) return -1;
  /* --auth-tokens: a body is read only from a client with a known token
   * (every endpoint that takes one needs a token of some role; which role is
   * checked at the route), so that no one without a token can make moed
   * buffer up to --max-message-bytes on each of its connections */
  const bool body = (p->flags & F_CHUNKED) || (p->content_length != ULLONG_MAX && p->content_length > 0);
  char who[128];
  if (body &&
      moed_auth_check_value(MOED_M_MODEL_INFER, c->rq.authorization_len < 0 ? NULL : c->rq.authorization,
                            c->rq.authorization_len < 0 ? 0 : (size_t)c->rq.authorization_len, who,
                            sizeof who, c->unauthorized) != GRPC_STATUS_OK)
    return -1;
  c->unauthorized[0] = 0;
  c->in_body = true;
  if (c->expect_continue && p->content_length > 0) { /* the client waits for this before its body */
    static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
    send_now(c, cont, sizeof cont - 1);
  }
  return 0;
}

static int on_body(http_parser *p, const char *at, size_t len) {
  moed_http_conn *c = p->data;
  if (len > c->l->o.max_body - c->rq.body_len) {
    c->too_large = true;
    return 1;
  }
  if (c->rq.body_len + len + 1 > c->body_cap) { /* + 1: the handler gets a NUL after the body */
    size_t cap = c->body_cap ? c->body_cap : 4096;
    while (cap < c->rq.body_len + len + 1)
      cap = cap > SIZE_MAX / 2 ? SIZE_MAX : cap * 2;
    if (cap > c->l->o.max_body + 1) cap = c->rq.body_len + len + 1; /* not past what a body may take */
    if (!body_claim(c, cap)) {
      c->over_budget = true;
      return 1;
    }
    char *g = realloc(c->rq.body, cap);
    if (!g) {
      atomic_fetch_sub(&body_bytes, cap - c->body_cap);
      c->too_large = true;
      return 1;
    }
    c->rq.body = g;
    c->body_cap = cap;
  }
  memcpy(c->rq.body + c->rq.body_len, at, len);
  c->rq.body_len += len;
  return 0;
}

static int on_message_complete(http_parser *p) {
  moed_http_conn *c = p->data;
  c->busy = true;
  c->in_request = false;
  c->said_close = !http_should_keep_alive(p);
  c->keep_alive = c->l->o.keep_alive && !c->said_close;
  http_parser_pause(p, 1); /* one request at a time: the rest waits in c->pending */
  return 0;
}

static const http_parser_settings settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_message_complete = on_message_complete,
};

static void fail_request(moed_http_conn *c, int code, const char *why) {
  c->busy = true;
  c->keep_alive = false;
  pause_input(c);
  moed_http_respond_error(c, code, why);
}

/* Feeds data[0..n) to the parser; a whole request goes to the handler. */
static void feed(moed_http_conn *c, const char *data, size_t n) {
  size_t used = http_parser_execute(&c->parser, &settings, data, n);
  const enum http_errno e = HTTP_PARSER_ERRNO(&c->parser);
  /* a refusal once the parse stopped, whatever the reads' sizes were: the
   * callbacks' own stops (HPE_CB_*) by their reason, the rest malformed */
  if (e != HPE_OK && e != HPE_PAUSED) {
    char why[160];
    if (c->over_budget) {
      snprintf(
          why, sizeof why,
          "request bodies held by all connections would exceed --http-body-budget-bytes (%zu): retry later",
          c->l->o.cfg->http_body_budget_bytes);
      return fail_request(c, 503, why);
    }
    if (c->too_large) {
      snprintf(why, sizeof why, "request body exceeds the limit of %zu bytes (--max-message-bytes)",
               c->l->o.max_body);
      return fail_request(c, 413, why);
    }
    if (c->url_long && e == HPE_CB_headers_complete) return fail_request(c, 414, "request URL too long");
    if (c->unauthorized[0] && e == HPE_CB_headers_complete) return fail_request(c, 401, c->unauthorized);
    if (c->encoded && e == HPE_CB_headers_complete)
      return fail_request(c, 415, "Content-Encoding: moed takes uncompressed bodies only");
    snprintf(why, sizeof why, "malformed HTTP request: %s", http_errno_description(e));
    return fail_request(c, 400, why);
  }
  if (!c->busy) {
    if (c->in_body)
      arm(c, c->l->o.cfg->handshake_timeout_s); /* the body is coming: the next read has as long */
    return;
  }
  uv_timer_stop(&c->timer);
  if (used < n) hold(c, data + used, n - used); /* a pipelined request */
  if (c->closing) return;
  char *q = strchr(c->rq.path, '?');
  if (q) *q = 0;
  if (c->rq.body) c->rq.body[c->rq.body_len] = 0;
  c->rq.method = (int)c->parser.method;
  c->l->fn(c, &c->rq, c->l->arg);
}

/* Bytes from the client: parsed, or held while a request is in work. */
static void take_input(moed_http_conn *c, const char *data, size_t n) {
  if (c->busy)
    hold(c, data, n);
  else
    feed(c, data, n);
}

static int scan_begin(http_parser *p) {
  ((int *)p->data)[0]++;
  return 0;
}
static int scan_complete(http_parser *p) {
  int *n = p->data;
  n[1]++;
  n[2] = !http_should_keep_alive(p);
  return 0;
}

/* Whether the client, whose FIN came while a request was in work, had said
 * it would send nothing more: the last whole request it sent (the one in
 * work, or the last of those held behind it) does not keep the connection,
 * and no partial or malformed one follows it. */
static bool sending_done(const moed_http_conn *c) {
  if (!c->pending_len) return c->said_close;
  static const http_parser_settings scan = {.on_message_begin = scan_begin,
                                            .on_message_complete = scan_complete};
  int n[3] = {0, 0, 0}; /* requests begun, whole, the last whole one said close */
  http_parser p;
  http_parser_init(&p, HTTP_REQUEST);
  p.data = n;
  const size_t used = http_parser_execute(&p, &scan, c->pending, c->pending_len);
  if (HTTP_PARSER_ERRNO(&p) != HPE_OK || used != c->pending_len || n[0] != n[1]) return false;
  return n[1] ? n[2] : c->said_close; /* only blank lines held: the request in work decides */
}

/* The client's FIN (or TLS close_notify). Between requests, or within one
 * not yet whole, the connection ends as before. With a request in work, it
 * ends there (the handler's gone() is called: the client left) unless the
 * client had said it sends nothing more; then its answers are written and
 * the connection closed after them (next_request). */
static void peer_eof(moed_http_conn *c) {
  if (c->eof || c->closing) return;
  c->eof = true;
  if (!c->busy) return close_conn(c);
  c->half_closed = sending_done(c);
  if (!c->half_closed && c->gone) {
    c->l->n.abandoned++;
    close_conn(c);
  }
}

/* A connection error (a reset): the client is gone whatever it had sent. */
static void peer_lost(moed_http_conn *c) {
  if (c->gone && !c->closing) c->l->n.abandoned++;
  close_conn(c);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)h;
  buf->base = malloc(suggested);
  buf->len = buf->base ? suggested : 0;
}

/* Decrypts what TLS holds and takes it as input, until more records are
 * needed or HELD_MAX bytes are held (the rest stays in TLS's buffers for
 * next_request); close_notify is the client's FIN; a failed handshake (no
 * client certificate under mTLS, a client that does not speak TLS) closes
 * the connection after its alert. */
static void tls_input(moed_http_conn *c) {
  char plain[16384]; /* one TLS record's plaintext at most */
  while (!c->closing && !c->eof && !(c->busy && c->pending_len >= HELD_MAX)) {
    int n = SSL_read(c->ssl, plain, sizeof plain);
    if (n > 0) {
      take_input(c, plain, (size_t)n);
      continue;
    }
    int e = SSL_get_error(c->ssl, n);
    if (e == SSL_ERROR_WANT_READ) break;
    if (e == SSL_ERROR_ZERO_RETURN) {
      peer_eof(c);
      break;
    }
    char why[160];
    ERR_error_string_n(ERR_get_error(), why, sizeof why);
    c->l->n.tls_failed++;
    moed_log(MOED_LOG_DEBUG, "tls_handshake_failed", "%s: %s", c->l->o.name, why);
    ERR_clear_error();
    tls_flush(c, NULL); /* the alert */
    return close_conn(c);
  }
  if (!c->closing) tls_flush(c, NULL); /* the handshake's answers */
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf) {
  moed_http_conn *c = st->data;
  if (n > 0 && !c->closing) {
    if (!c->ssl)
      take_input(c, buf->base, (size_t)n);
    else if (BIO_write(SSL_get_rbio(c->ssl), buf->base, (int)n) != (int)n) /* n <= 64 KiB (on_alloc) */
      close_conn(c);
    else
      tls_input(c);
  } else if (n == UV_EOF) {
    peer_eof(c);
  } else if (n < 0) {
    peer_lost(c);
  }
  free(buf->base);
}

/* The answer is written: the next request, or the end. */
static void next_request(moed_http_conn *c) {
  if (c->closing) return;
  if (!c->keep_alive || (c->eof && !c->half_closed)) return close_conn(c);
  c->busy = false;
  free(c->rq.body); /* a large body's buffer is not kept for an idle connection */
  c->rq.body = NULL;
  body_release(c);
  c->rq.body_len = 0;
  c->in_body = false;
  http_parser_pause(&c->parser, 0);
  arm(c, c->l->o.cfg->idle_timeout_s);
  if (!c->eof && resume_input(c) != 0) return close_conn(c);
  if (c->pending) {
    char *p = c->pending;
    size_t len = c->pending_len;
    c->pending = NULL;
    c->pending_len = 0;
    feed(c, p, len); /* held behind a next request again when one is whole */
    free(p);
  }
  if (c->ssl && !c->closing) tls_input(c);              /* records left in TLS's buffers */
  if (c->eof && !c->busy && !c->closing) close_conn(c); /* half-closed: nothing more comes */
}

/* ---- answers ---------------------------------------------------------------------- */

static void on_written(uv_write_t *w, int status) {
  write_req *wr = (write_req *)w;
  moed_http_conn *c = wr->c;
  if (wr->release) wr->release(wr->release_arg);
  free(wr->head);
  free(wr->records);
  free(wr);
  if (status < 0)
    close_conn(c);
  else
    next_request(c);
}

void moed_http_respond(moed_http_conn *c, int code, const char *ctype, const char *extra,
                       const uv_buf_t *body, size_t nbody, void (*release)(void *), void *arg) {
  c->gone = NULL;
  if (c->closing) {
    if (release) release(arg);
    return;
  }
  size_t len = 0;
  for (size_t i = 0; i < nbody; i++)
    len += body[i].len;
  char head[512];
  int hn =
      snprintf(head, sizeof head, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s%s\r\n",
               code, http_status_str((enum http_status)code), ctype, len, extra ? extra : "",
               c->keep_alive ? "" : "Connection: close\r\n");
  write_req *wr = calloc(1, sizeof *wr);
  uv_buf_t bufs[4];
  if (!wr || hn < 0 || (size_t)hn >= sizeof head || nbody > 3 || !(wr->head = strdup(head))) {
    free(wr);
    if (release) release(arg);
    return close_conn(c);
  }
  wr->c = c;
  wr->release = release;
  wr->release_arg = arg;
  bufs[0] = uv_buf_init(wr->head, (unsigned)hn);
  for (size_t i = 0; i < nbody; i++)
    bufs[i + 1] = body[i];
  if (send_answer(c, wr, bufs, (unsigned)nbody + 1) != 0) {
    if (release) release(arg);
    free(wr->head);
    free(wr->records);
    free(wr);
    close_conn(c);
  }
}

void moed_http_respond_copy(moed_http_conn *c, int code, const char *ctype, const char *body, size_t len) {
  char *copy = malloc(len ? len : 1);
  if (!copy) return close_conn(c);
  memcpy(copy, body, len);
  uv_buf_t b = uv_buf_init(copy, (unsigned)len);
  moed_http_respond(c, code, ctype, NULL, &b, 1, free, copy);
}

/* The length of the well-formed UTF-8 sequence at p (RFC 3629: no
 * overlong forms, surrogates or code points past U+10FFFF), 0 if none. */
static size_t utf8_seq(const unsigned char *p) {
  const unsigned char b = p[0];
  if (b < 0x80) return 1;
  const size_t n = b >= 0xC2 && b <= 0xDF ? 2 : b >= 0xE0 && b <= 0xEF ? 3 : b >= 0xF0 && b <= 0xF4 ? 4 : 0;
  if (!n) return 0;
  /* the second byte's range depends on the lead (the excluded forms) */
  const unsigned char lo = b == 0xE0   ? 0xA0
                           : b == 0xF0 ? 0x90
                                       : 0x80,
                      hi = b == 0xED   ? 0x9F
                           : b == 0xF4 ? 0x8F
                                       : 0xBF;
  if (p[1] < lo || p[1] > hi) return 0;
  for (size_t i = 2; i < n; i++)
    if (p[i] < 0x80 || p[i] > 0xBF) return 0;
  return n;
}

void moed_http_respond_error(moed_http_conn *c, int code, const char *msg) {
  /* a message may quote what the client sent (a path, an input's name): its
   * bytes that are not UTF-8 become '?', so that the answer is JSON a strict
   * client decodes (cJSON copies them as they are) */
  const size_t len = strlen(msg);
  char *clean = malloc(len + 1);
  if (!clean) return close_conn(c);
  for (size_t i = 0; i < len;) {
    const size_t n = utf8_seq((const unsigned char *)msg + i);
    if (n) {
      memcpy(clean + i, msg + i, n);
      i += n;
    } else {
      clean[i++] = '?';
    }
  }
  clean[len] = 0;
  /* cJSON writes the message as a JSON string (quotes, control characters) */
  cJSON *o = cJSON_CreateObject();
  char *s = o && cJSON_AddStringToObject(o, "error", clean) ? cJSON_PrintUnformatted(o) : NULL;
  free(clean);
  cJSON_Delete(o);
  if (!s) return close_conn(c);
  uv_buf_t b = uv_buf_init(s, (unsigned)strlen(s));
  moed_http_respond(c, code, "application/json", NULL, &b, 1, free, s);
}

void moed_http_defer(moed_http_conn *c, void (*gone)(void *), void *arg) {
  c->gone = gone;
  c->gone_arg = arg;
}

/* ---- the listener ---------------------------------------------------------------- */

/* A connection on l, in the open list, its timer armed (not its socket). */
static moed_http_conn *conn_new(moed_http_listener *l) {
  moed_http_conn *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->l = l;
  l->n.open++;
  c->next = l->conns;
  if (c->next) c->next->prev = &c->next;
  c->prev = &l->conns;
  l->conns = c;
  uv_timer_init(l->loop, &c->timer);
  c->handles = 1;
  c->timer.data = c;
  http_parser_init(&c->parser, HTTP_REQUEST);
  c->parser.data = c;
  arm(c, l->o.cfg->handshake_timeout_s); /* TLS's handshake included */
  return c;
}

static void on_connection(uv_stream_t *server, int status) {
  moed_http_listener *l = server->data;
  if (status < 0) return;
  moed_http_conn *c = conn_new(l);
  if (!c) return;
  uv_tcp_init(l->loop, &c->tcp);
  c->handles++;
  c->tcp.data = c;
  if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) return close_conn(c);
  if (l->n.open > l->o.cfg->http_max_connections) { /* accepted only to leave the backlog */
    l->n.refused++;
    return close_conn(c);
  }
  l->n.accepted++;
  uv_tcp_nodelay(&c->tcp, 1); /* an answer is one write: nothing to gain from Nagle */
  if (l->o.tls) {
    SSL_CTX *ctx = moed_tls_http_context();
    BIO *in = BIO_new(BIO_s_mem()), *out = BIO_new(BIO_s_mem());
    c->ssl = ctx && in && out ? SSL_new(ctx) : NULL;
    if (!c->ssl) {
      BIO_free(in);
      BIO_free(out);
      return close_conn(c);
    }
    SSL_set_bio(c->ssl, in, out); /* owned by ssl from here */
    SSL_set_accept_state(c->ssl);
  }
  if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) close_conn(c);
}

static moed_http_listener *listener_new(uv_loop_t *loop, const moed_http_options *o, moed_http_handler fn,
                                        void *arg) {
  moed_http_listener *l = calloc(1, sizeof *l);
  if (!l) return NULL;
  l->loop = loop;
  l->o = *o;
  l->fn = fn;
  l->arg = arg;
  l->next_listener = listeners;
  if (listeners) listeners->prev_listener = &l->next_listener;
  l->prev_listener = &listeners;
  listeners = l;
  return l;
}

int moed_http_listen(uv_loop_t *loop, const char *address, int port, const moed_http_options *o,
                     moed_http_handler fn, void *arg, moed_http_listener **out, int *bound_port) {
  struct sockaddr_storage addr;
  if (uv_ip4_addr(address, port, (struct sockaddr_in *)&addr) != 0 &&
      uv_ip6_addr(address, port, (struct sockaddr_in6 *)&addr) != 0) {
    moed_log(MOED_LOG_ERROR, "bind_failed", "%s %s:%d: not an IP address", o->name, address, port);
    return -1;
  }
  if (o->tls && !moed_tls_http_context()) return -1; /* logged; the files were read for gRPC already */
  moed_http_listener *l = listener_new(loop, o, fn, arg);
  if (!l) return -1;
  uv_tcp_init(loop, &l->tcp);
  l->tcp.data = l;
  int rc = uv_tcp_bind(&l->tcp, (const struct sockaddr *)&addr, 0);
  if (rc == 0) rc = uv_listen((uv_stream_t *)&l->tcp, 128, on_connection);
  uv_os_fd_t lfd;
  if (rc == 0 && o->side && uv_fileno((uv_handle_t *)&l->tcp, &lfd) == 0) moed_fd_budget_side_listener(lfd);
  if (rc != 0) {
    moed_log(MOED_LOG_ERROR, "bind_failed", "%s %s:%d: %s", o->name, address, port, uv_strerror(rc));
    moed_http_listener_close(l);
    return -1;
  }
  struct sockaddr_storage name;
  int len = sizeof name;
  uv_tcp_getsockname(&l->tcp, (struct sockaddr *)&name, &len);
  *bound_port = ntohs(((struct sockaddr_in *)&name)->sin_port);
  *out = l;
  return 0;
}

void moed_http_peer(moed_http_conn *c, char *out, size_t size) {
  if (c->sink) {
    snprintf(out, size, "memory");
    return;
  }
  struct sockaddr_storage sa;
  int len = sizeof sa;
  char host[INET6_ADDRSTRLEN] = "";
  int port = 0;
  if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&sa, &len) == 0) {
    if (sa.ss_family == AF_INET6) {
      uv_ip6_name((const struct sockaddr_in6 *)&sa, host, sizeof host);
      port = ntohs(((const struct sockaddr_in6 *)&sa)->sin6_port);
    } else if (sa.ss_family == AF_INET) {
      uv_ip4_name((const struct sockaddr_in *)&sa, host, sizeof host);
      port = ntohs(((const struct sockaddr_in *)&sa)->sin_port);
    }
  }
  char subject[160] = ""; /* mTLS: the verified client certificate's, as rpc.c names gRPC peers */
  X509 *cert = c->ssl ? SSL_get0_peer_certificate(c->ssl) : NULL;
  BIO *mem = cert && SSL_get_verify_result(c->ssl) == X509_V_OK ? BIO_new(BIO_s_mem()) : NULL;
  if (mem && X509_NAME_print_ex(mem, X509_get_subject_name(cert), 0, XN_FLAG_RFC2253) >= 0) {
    int n = BIO_read(mem, subject, sizeof subject - 1);
    subject[n > 0 ? n : 0] = 0;
  }
  BIO_free(mem);
  for (char *p = subject; *p; p++) /* the client's text: one log line */
    if ((unsigned char)*p < 0x20 || *p == '\'' || *p == 0x7f) *p = '?';
  if (host[0])
    snprintf(out, size, sa.ss_family == AF_INET6 ? "[%s]:%d%s%s%s" : "%s:%d%s%s%s", host, port,
             *subject ? " cert '" : "", subject, *subject ? "'" : "");
  else
    snprintf(out, size, "unknown");
}

void moed_http_foreach_listener(void (*fn)(const char *name, const moed_http_stats *n, void *arg),
                                void *arg) {
  for (const moed_http_listener *l = listeners; l; l = l->next_listener)
    if (!l->memory) fn(l->o.name, &l->n, arg);
}

static void on_listener_closed(uv_handle_t *hd) { free(hd->data); }

void moed_http_listener_close(moed_http_listener *l) {
  if (!l) return;
  while (l->conns)
    close_conn(l->conns);
  *l->prev_listener = l->next_listener;
  if (l->next_listener) l->next_listener->prev_listener = l->prev_listener;
  if (l->memory)
    free(l);
  else
    uv_close((uv_handle_t *)&l->tcp, on_listener_closed);
}

/* ---- memory connections (the fuzz target) ------------------------------------------ */

moed_http_listener *moed_http_memory_listener(uv_loop_t *loop, const moed_http_options *o,
                                              moed_http_handler fn, void *arg) {
  moed_http_options plain = *o;
  plain.tls = false;
  moed_http_listener *l = listener_new(loop, &plain, fn, arg);
  if (l) l->memory = true;
  return l;
}

moed_http_conn *moed_http_memory_conn(moed_http_listener *l, void (*sink)(void *, const char *, size_t),
                                      void *arg) {
  moed_http_conn *c = conn_new(l);
  if (!c) return NULL;
  c->sink = sink;
  c->sink_arg = arg;
  return c;
}

bool moed_http_memory_feed(moed_http_conn *c, const char *data, size_t n) {
  if (!c->closing && n) take_input(c, data, n);
  while (!c->closing && c->unfinished) { /* answered: the write "completes", pipelined requests follow */
    write_req *wr = c->unfinished;
    c->unfinished = NULL;
    on_written(&wr->w, 0);
  }
  return !c->closing;
}

bool moed_http_memory_eof(moed_http_conn *c) {
  if (!c->closing) peer_eof(c);
  return !c->closing;
}

void moed_http_memory_close(moed_http_conn *c) {
  if (c->unfinished) { /* its completion will not run: release what it holds */
    write_req *wr = c->unfinished;
    c->unfinished = NULL;
    if (wr->release) wr->release(wr->release_arg);
    free(wr->head);
    free(wr);
  }
  close_conn(c);
}
