/* http_conn: HTTP/1.1 connections on the loop, for both HTTP listeners
 * (http.c's side port, rest.c's KServe REST port): accept with a cap on
 * open connections, hand each whole request (http_parse.c) to the
 * listener's handler, and after its answer (http_answer.c) keep the
 * connection for the next request or close it. The bytes come and go
 * through http_transport.c (plain, TLS or memory), which this file does
 * not tell apart.
 *
 * Deadlines (slowloris): a request's line and headers must arrive within
 * --handshake-timeout of its first byte, and its body may pause at most as
 * long between two reads and must average --http-body-min-rate after a
 * first --handshake-timeout; a keep-alive connection waits --idle-timeout for
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
 * (every request up to that one) and the connection then closed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_conn.h"

static moed_http_listener *listeners; /* loop thread */

/* ---- connections ---------------------------------------------------------------- */

static void on_closed(uv_handle_t *hd) {
  moed_http_conn *c = hd->data;
  if (--c->handles) return;
  SSL_free(c->ssl); /* and its BIOs */
  moed_http_body_release(c);
  free(c->rq.body);
  free(c->pending);
  free(c);
}

void moed_http_conn_close(moed_http_conn *c) {
  if (c->closing) return;
  c->closing = true;
  if (c->gone) c->gone(c->gone_arg);
  c->gone = NULL;
  *c->prev = c->next;
  if (c->next) c->next->prev = c->prev;
  c->l->n.open--;
  c->l->probation -= c->probation;
  if (c->ssl && SSL_is_init_finished(c->ssl)) { /* close_notify, best effort: the socket closes next */
    SSL_shutdown(c->ssl);
    moed_http_tls_flush(c, NULL);
  }
  if (!c->sink) uv_close((uv_handle_t *)&c->tcp, on_closed);
  uv_close((uv_handle_t *)&c->timer, on_closed);
}

static void on_deadline(uv_timer_t *t) {
  moed_http_conn *c = t->data;
  if (c->probation) /* past the cap, and no whole request in time */
    c->l->n.refused++;
  else if (c->in_request) /* an idle keep-alive connection's end is no timeout */
    c->l->n.timeouts++;
  else
    c->l->n.idle_closed++;
  moed_http_conn_close(c);
}

void moed_http_conn_arm(moed_http_conn *c, int seconds) {
  uv_timer_start(&c->timer, on_deadline, (uint64_t)seconds * 1000, 0);
}

/* The rate rule of bodies and answers alike: ms left before `bytes` moved
 * since t0_ms fall below --http-body-min-rate on average after a first
 * --handshake-timeout (0: behind already; UINT64_MAX: no rate set).
 * bytes <= --max-message-bytes (< 2^31): the product stays far from 2^64. */
static uint64_t rate_left_ms(const moed_config *cfg, uint64_t t0_ms, uint64_t bytes, uint64_t now) {
  if (!cfg->http_body_min_rate) return UINT64_MAX;
  const uint64_t allowed = (uint64_t)cfg->handshake_timeout_s * 1000 + bytes * 1000 / cfg->http_body_min_rate;
  const uint64_t spent = now - t0_ms;
  return allowed > spent ? allowed - spent : 0;
}

/* Without the rate a body sent a byte every few seconds holds its
 * connection, and its share of the body budget, for as long as the body is
 * long (slowloris' body variant, "R.U.D.Y."): the pause alone bounds nothing. */
void moed_http_conn_arm_body(moed_http_conn *c) {
  const moed_config *cfg = c->l->o.cfg;
  const uint64_t pause = (uint64_t)cfg->handshake_timeout_s * 1000;
  const uint64_t left = rate_left_ms(cfg, c->body_t0_ms, c->rq.body_len, uv_now(c->timer.loop));
  uv_timer_start(&c->timer, on_deadline, left < pause ? left : pause, 0);
}

/* The slow reader's side of the same: a client that sends requests and
 * never reads their answers would hold each answer (up to
 * --max-message-bytes) and its connection for good; libuv's write never
 * completes, so progress is read off the stream's write queue. */
static void on_write_check(uv_timer_t *t) {
  moed_http_conn *c = t->data;
  const moed_config *cfg = c->l->o.cfg;
  const size_t left = uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp);
  const uint64_t now = uv_now(t->loop), grace = (uint64_t)cfg->handshake_timeout_s * 1000;
  if (left < c->write_left) {
    c->write_left = left;
    c->write_seen_ms = now;
  }
  if (!left) return; /* taken whole: the write's callback comes next */
  const bool stalled = now - c->write_seen_ms > grace;
  if (stalled || !rate_left_ms(cfg, c->write_t0_ms, c->write_queued - c->write_left, now)) {
    c->l->n.timeouts++;
    moed_http_conn_close(c); /* the queued write is cancelled: its callback frees the answer */
  }
}

void moed_http_conn_watch_write(moed_http_conn *c) {
  if (c->sink || c->closing) return;
  c->write_queued = c->write_left = uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp);
  if (!c->write_queued) return; /* the socket took it at once */
  c->write_t0_ms = c->write_seen_ms = uv_now(c->timer.loop);
  const uint64_t every = (uint64_t)c->l->o.cfg->handshake_timeout_s * 1000 / 4;
  uv_timer_start(&c->timer, on_write_check, every ? every : 1, every ? every : 1);
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf);
static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);

void moed_http_conn_pause(moed_http_conn *c) {
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
  if (!g) return moed_http_conn_close(c);
  memcpy(g + c->pending_len, data, n);
  c->pending = g;
  c->pending_len += n;
  if (c->pending_len >= HELD_MAX) moed_http_conn_pause(c);
}

void moed_http_conn_take_input(moed_http_conn *c, const char *data, size_t n) {
  if (c->busy)
    hold(c, data, n);
  else
    moed_http_feed(c, data, n);
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
 * the connection closed after them (moed_http_conn_answered). */
void moed_http_conn_eof(moed_http_conn *c) {
  if (c->eof || c->closing) return;
  c->eof = true;
  if (!c->busy) return moed_http_conn_close(c);
  c->half_closed = sending_done(c);
  if (!c->half_closed && c->gone) {
    c->l->n.abandoned++;
    moed_http_conn_close(c);
  }
}

/* A connection error (a reset): the client is gone whatever it had sent. */
static void peer_lost(moed_http_conn *c) {
  if (c->gone && !c->closing) c->l->n.abandoned++;
  moed_http_conn_close(c);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)h;
  buf->base = malloc(suggested);
  buf->len = buf->base ? suggested : 0;
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf) {
  moed_http_conn *c = st->data;
  if (n > 0 && !c->closing) {
    if (!c->ssl)
      moed_http_conn_take_input(c, buf->base, (size_t)n);
    else
      moed_http_tls_read(c, buf->base, (size_t)n); /* n <= 64 KiB (on_alloc) */
  } else if (n == UV_EOF) {
    moed_http_conn_eof(c);
  } else if (n < 0) {
    peer_lost(c);
  }
  free(buf->base);
}

void moed_http_conn_answered(moed_http_conn *c) {
  if (c->closing) return;
  if (!c->keep_alive || (c->eof && !c->half_closed)) return moed_http_conn_close(c);
  c->busy = false;
  free(c->rq.body); /* a large body's buffer is not kept for an idle connection */
  c->rq.body = NULL;
  moed_http_body_release(c);
  c->rq.body_len = 0;
  c->in_body = false;
  http_parser_pause(&c->parser, 0);
  moed_http_conn_arm(c, c->l->o.cfg->idle_timeout_s);
  if (!c->eof && resume_input(c) != 0) return moed_http_conn_close(c);
  if (c->pending) {
    char *p = c->pending;
    size_t len = c->pending_len;
    c->pending = NULL;
    c->pending_len = 0;
    moed_http_feed(c, p, len); /* held behind a next request again when one is whole */
    free(p);
  }
  if (c->ssl && !c->closing) moed_http_tls_input(c);              /* records left in TLS's buffers */
  if (c->eof && !c->busy && !c->closing) moed_http_conn_close(c); /* half-closed: nothing more comes */
}

/* ---- the listener ---------------------------------------------------------------- */

moed_http_conn *moed_http_conn_new(moed_http_listener *l) {
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
  moed_http_conn_arm(c, l->o.cfg->handshake_timeout_s); /* TLS's handshake included */
  return c;
}

/* Past --http-max-connections, a new connection is kept PROBATION_MS for
 * one whole request (then closed after its answer): idle connections that
 * fill the cap (a flood, or a leaking client) would otherwise lock out
 * every new client until their deadlines, the kubelet's probes and
 * Prometheus's scrapes included, and those send their request at once. At
 * most as many as the cap are on probation; a new one past that replaces
 * the oldest whose request is not whole, so that a flood of connections
 * that send nothing must outrun a probe's first round trip to keep it out.
 * false: none could be replaced (every one's request is in work). */
static bool probation_start(moed_http_listener *l, moed_http_conn *c) {
  if (l->probation >= l->o.cfg->http_max_connections) {
    moed_http_conn *oldest = NULL;
    for (moed_http_conn *o = l->conns; o; o = o->next) /* newest first */
      if (o->probation && !o->busy && o != c) oldest = o;
    if (!oldest) return false;
    l->n.refused++;
    moed_http_conn_close(oldest);
  }
  c->probation = true;
  l->probation++;
  uv_timer_start(&c->timer, on_deadline, PROBATION_MS, 0);
  return true;
}

static void on_connection(uv_stream_t *server, int status) {
  moed_http_listener *l = server->data;
  if (status < 0) return;
  moed_http_conn *c = moed_http_conn_new(l);
  if (!c) return;
  uv_tcp_init(l->loop, &c->tcp);
  c->handles++;
  c->tcp.data = c;
  if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) return moed_http_conn_close(c);
  if (l->n.open - l->probation > l->o.cfg->http_max_connections && !probation_start(l, c)) {
    l->n.refused++; /* accepted only to leave the backlog */
    return moed_http_conn_close(c);
  }
  if (!c->probation) l->n.accepted++; /* on probation: once its request is whole (http_parse.c) */
  uv_tcp_nodelay(&c->tcp, 1);         /* an answer is one write: nothing to gain from Nagle */
  if (l->o.tls && !moed_http_tls_attach(c)) return moed_http_conn_close(c);
  if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) moed_http_conn_close(c);
}

moed_http_listener *moed_http_listener_new(uv_loop_t *loop, const moed_http_options *o, moed_http_handler fn,
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
  moed_http_listener *l = moed_http_listener_new(loop, o, fn, arg);
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
  char cert[180]; /* mTLS: the verified client certificate's, as rpc.c names gRPC peers */
  moed_http_tls_subject(c, cert, sizeof cert);
  if (host[0])
    snprintf(out, size, sa.ss_family == AF_INET6 ? "[%s]:%d%s" : "%s:%d%s", host, port, cert);
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
    moed_http_conn_close(l->conns);
  *l->prev_listener = l->next_listener;
  if (l->next_listener) l->next_listener->prev_listener = l->prev_listener;
  if (l->memory)
    free(l);
  else
    uv_close((uv_handle_t *)&l->tcp, on_listener_closed);
}
