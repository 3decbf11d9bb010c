/* http_transport: how an HTTP connection's bytes come and go: the socket
 * as is, TLS (OpenSSL through memory BIOs: the records go through libuv's
 * stream like any bytes; tls.c owns the context and its reload), or, for
 * the fuzz target, no socket at all (a memory connection: bytes fed in,
 * written bytes handed to a sink). The parsing and answering above do not
 * know which. */
#include <limits.h>
#include <openssl/err.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_conn.h"

/* ---- writes ----------------------------------------------------------------------- */

/* Bytes written by TLS itself (handshake, alerts, close_notify): freed when sent. */
typedef struct tls_out {
  uv_write_t w;
  char data[];
} tls_out;

static void on_tls_out(uv_write_t *w, int status) {
  (void)status; /* a failed write shows as a read error too: the connection closes there */
  free(w);
}

void moed_http_tls_flush(moed_http_conn *c, write_req *wr) {
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
  if (wr ? uv_write(&wr->w, (uv_stream_t *)&c->tcp, &b, 1, moed_http_written) == 0
         : uv_write(&o->w, (uv_stream_t *)&c->tcp, &b, 1, on_tls_out) == 0)
    return;
fail:
  free(o);
  (void)BIO_reset(out);
  if (wr) moed_http_written(&wr->w, UV_ENOMEM); /* frees wr and closes */
}

int moed_http_send_answer(moed_http_conn *c, write_req *wr, const uv_buf_t *bufs, unsigned n) {
  if (c->sink) { /* completed by moed_http_memory_feed, as the loop would after the write */
    for (unsigned i = 0; i < n; i++)
      c->sink(c->sink_arg, bufs[i].base, bufs[i].len);
    c->unfinished = wr;
    return 0;
  }
  if (!c->ssl) return uv_write(&wr->w, (uv_stream_t *)&c->tcp, bufs, n, moed_http_written);
  for (unsigned i = 0; i < n; i++) /* a memory BIO takes all: SSL_write never writes part */
    for (size_t at = 0; at < bufs[i].len;) {
      int step = bufs[i].len - at > INT_MAX ? INT_MAX : (int)(bufs[i].len - at);
      if (SSL_write(c->ssl, bufs[i].base + at, step) != step) return -1;
      at += (size_t)step;
    }
  moed_http_tls_flush(c, wr);
  return 0;
}

void moed_http_send_now(moed_http_conn *c, const char *data, size_t len) {
  if (c->sink) return c->sink(c->sink_arg, data, len);
  if (c->ssl) {
    if (SSL_write(c->ssl, data, (int)len) == (int)len) moed_http_tls_flush(c, NULL);
    return;
  }
  uv_buf_t b = uv_buf_init((char *)data, (unsigned)len);
  uv_try_write((uv_stream_t *)&c->tcp, &b, 1); /* a fresh connection's socket takes 25 bytes; if not, the
                                                 client sends the body after its own wait (curl: 1 s) */
}
/* ---- TLS ---------------------------------------------------------------------------- */

bool moed_http_tls_attach(moed_http_conn *c) {
  SSL_CTX *ctx = moed_tls_http_context();
  BIO *in = BIO_new(BIO_s_mem()), *out = BIO_new(BIO_s_mem());
  c->ssl = ctx && in && out ? SSL_new(ctx) : NULL;
  if (!c->ssl) {
    BIO_free(in);
    BIO_free(out);
    return false;
  }
  SSL_set_bio(c->ssl, in, out); /* owned by ssl from here */
  SSL_set_accept_state(c->ssl);
  return true;
}

/* Decrypts what TLS holds and takes it as input, until more records are
 * needed or HELD_MAX bytes are held (the rest stays in TLS's buffers for
 * moed_http_conn_answered); close_notify is the client's FIN; a failed handshake (no
 * client certificate under mTLS, a client that does not speak TLS) closes
 * the connection after its alert. */
void moed_http_tls_input(moed_http_conn *c) {
  char plain[16384]; /* one TLS record's plaintext at most */
  while (!c->closing && !c->eof && !(c->busy && c->pending_len >= HELD_MAX)) {
    int n = SSL_read(c->ssl, plain, sizeof plain);
    if (n > 0) {
      moed_http_conn_take_input(c, plain, (size_t)n);
      continue;
    }
    int e = SSL_get_error(c->ssl, n);
    if (e == SSL_ERROR_WANT_READ) break;
    if (e == SSL_ERROR_ZERO_RETURN) {
      moed_http_conn_eof(c);
      break;
    }
    char why[160];
    ERR_error_string_n(ERR_get_error(), why, sizeof why);
    c->l->n.tls_failed++;
    moed_log(MOED_LOG_DEBUG, "tls_handshake_failed", "%s: %s", c->l->o.name, why);
    ERR_clear_error();
    moed_http_tls_flush(c, NULL); /* the alert */
    return moed_http_conn_close(c);
  }
  if (!c->closing) moed_http_tls_flush(c, NULL); /* the handshake's answers */
}
void moed_http_tls_read(moed_http_conn *c, const char *data, size_t n) {
  if (BIO_write(SSL_get_rbio(c->ssl), data, (int)n) != (int)n) return moed_http_conn_close(c);
  moed_http_tls_input(c);
}

void moed_http_tls_subject(moed_http_conn *c, char *out, size_t size) {
  char subject[160] = "";
  X509 *cert = c->ssl ? SSL_get0_peer_certificate(c->ssl) : NULL;
  BIO *mem = cert && SSL_get_verify_result(c->ssl) == X509_V_OK ? BIO_new(BIO_s_mem()) : NULL;
  if (mem && X509_NAME_print_ex(mem, X509_get_subject_name(cert), 0, XN_FLAG_RFC2253) >= 0) {
    int n = BIO_read(mem, subject, sizeof subject - 1);
    subject[n > 0 ? n : 0] = 0;
  }
  BIO_free(mem);
  for (char *p = subject; *p; p++) /* the client's text: one log line */
    if ((unsigned char)*p < 0x20 || *p == '\'' || *p == 0x7f) *p = '?';
  snprintf(out, size, "%s%s%s", *subject ? " cert '" : "", subject, *subject ? "'" : "");
}

/* ---- memory connections (the fuzz target) ------------------------------------------ */

moed_http_listener *moed_http_memory_listener(uv_loop_t *loop, const moed_http_options *o,
                                              moed_http_handler fn, void *arg) {
  moed_http_options plain = *o;
  plain.tls = false;
  moed_http_listener *l = moed_http_listener_new(loop, &plain, fn, arg);
  if (l) l->memory = true;
  return l;
}

moed_http_conn *moed_http_memory_conn(moed_http_listener *l, void (*sink)(void *, const char *, size_t),
                                      void *arg) {
  moed_http_conn *c = moed_http_conn_new(l);
  if (!c) return NULL;
  c->sink = sink;
  c->sink_arg = arg;
  return c;
}

bool moed_http_memory_feed(moed_http_conn *c, const char *data, size_t n) {
  if (!c->closing && n) moed_http_conn_take_input(c, data, n);
  while (!c->closing && c->unfinished) { /* answered: the write "completes", pipelined requests follow */
    write_req *wr = c->unfinished;
    c->unfinished = NULL;
    moed_http_written(&wr->w, 0);
  }
  return !c->closing;
}

bool moed_http_memory_eof(moed_http_conn *c) {
  if (!c->closing) moed_http_conn_eof(c);
  return !c->closing;
}

void moed_http_memory_close(moed_http_conn *c) {
  if (c->unfinished) { /* its completion will not run: release what it holds */
    moed_http_write_free(c->unfinished);
    c->unfinished = NULL;
  }
  moed_http_conn_close(c);
}
