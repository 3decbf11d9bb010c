/* http_parse: one HTTP/1.1 request read with http-parser: its path, the
 * few headers moed reads (Inference-Header-Content-Length, Expect,
 * Content-Encoding, Authorization) and its body, bounded by
 * --max-message-bytes each and --http-body-budget-bytes together. A whole
 * request pauses the parser (one at a time: http_conn.c holds the rest)
 * and goes to the listener's handler; a refused one (413, 414, 415, 401,
 * 503, or 400 when malformed) is answered and its connection closed. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_conn.h"

#define IHCL "inference-header-content-length"

enum { H_OTHER, H_IHCL, H_EXPECT, H_ENCODING, H_AUTH };

/* ---- the body budget ------------------------------------------------------------- */

/* Request body bytes held by every HTTP connection (buffer capacity, kept
 * until the request is answered: its protobuf copy lives that long too),
 * against --http-body-budget-bytes: each body is bounded by
 * --max-message-bytes, this bounds them together (256 connections could
 * otherwise hold 256 GiB). Atomic: the ports may have loops of their own. */
static _Atomic size_t body_bytes;

/* Grows c's claim to cap bytes; false (nothing claimed) past the budget. */
static bool body_claim(moed_http_conn *c, size_t cap) {
  return moed_budget_claim(&body_bytes, cap - c->body_cap, c->l->o.cfg->http_body_budget_bytes);
}

void moed_http_body_release(moed_http_conn *c) {
  moed_budget_release(&body_bytes, c->body_cap);
  c->body_cap = 0;
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
  if (!c->probation) moed_http_conn_arm(c, c->l->o.cfg->handshake_timeout_s); /* on probation: its own */
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
  c->body_t0_ms = uv_now(c->timer.loop);
  if (c->expect_continue && p->content_length > 0) { /* the client waits for this before its body */
    static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
    moed_http_send_now(c, cont, sizeof cont - 1);
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
      moed_budget_release(&body_bytes, cap - c->body_cap);
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
  c->keep_alive = c->l->o.keep_alive && !c->said_close && !c->probation;
  if (c->probation) c->l->n.accepted++; /* served past the cap */
  http_parser_pause(p, 1);              /* one request at a time: the rest waits in c->pending */
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
  moed_http_conn_pause(c);
  moed_http_respond_error(c, code, why);
}

void moed_http_feed(moed_http_conn *c, const char *data, size_t n) {
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
    if (c->in_body && !c->probation) /* the body is coming: the next read has as long, at the rate */
      moed_http_conn_arm_body(c);
    return;
  }
  uv_timer_stop(&c->timer);
  if (used < n) moed_http_conn_take_input(c, data + used, n - used); /* a pipelined request: held */
  if (c->closing) return;
  char *q = strchr(c->rq.path, '?');
  if (q) *q = 0;
  if (c->rq.body) c->rq.body[c->rq.body_len] = 0;
  c->rq.method = (int)c->parser.method;
  c->l->fn(c, &c->rq, c->l->arg);
}
