/* http_conn: what the HTTP connection files share, internal to them (both
 * HTTP listeners, http.c's side port and rest.c's KServe REST port, use the
 * API in moed.h). A connection's bytes go through them in this order:
 *   http_transport.c  the socket's bytes as is, decrypted by TLS, or fed in
 *                     memory (the fuzz target); answers written back the same way
 *   http_parse.c      http-parser: one whole request, its body bounded
 *   http_conn.c       the connection: deadlines, one request at a time, the
 *                     client's leaving, the listener and its cap
 *   http_answer.c     the handler's answer, then the next request */
#ifndef MOED_HTTP_CONN_H
#define MOED_HTTP_CONN_H

#include <http_parser.h>
#include <openssl/ssl.h>

#include "moed.h"

/* Bytes held while a request is in work (a pipelined request); past this,
 * reading pauses until the answer is written and a close is not seen. */
#define HELD_MAX (64 * 1024)

/* How long a connection past --http-max-connections has for its request
 * (http_conn.c's probation_start): a probe or a scrape sends it at once. */
#define PROBATION_MS 250

struct moed_http_listener {
  uv_tcp_t tcp;
  uv_loop_t *loop;
  moed_http_options o;
  moed_http_handler fn;
  void *arg;
  moed_http_conn *conns;                              /* open connections, newest first (loop thread) */
  int probation;                                      /* of those, past the cap (probation_start) */
  moed_http_listener *next_listener, **prev_listener; /* every listener, for /metrics (loop thread) */
  moed_http_stats n;
  bool memory; /* no socket (moed_http_memory_listener) */
  bool closing;
};

struct moed_http_conn {
  moed_http_conn *next, **prev;
  uv_tcp_t tcp;
  uv_timer_t timer;
  int handles; /* open handles of tcp and timer: freed at 0 */
  moed_http_listener *l;
  http_parser parser;
  moed_http_request rq;
  size_t body_cap;
  uint64_t body_t0_ms; /* when its headers were whole (uv_now): the body's rate is counted from here */
  /* an answer the socket has not taken whole: when it was queued, its bytes
   * then, and when the client last took some (moed_http_conn_watch_write) */
  uint64_t write_t0_ms, write_seen_ms;
  size_t write_queued, write_left;
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
  bool probation;       /* accepted past the cap: one request within PROBATION_MS, then closed */
  void (*gone)(void *); /* the deferred handler's: the connection closed first */
  void *gone_arg;
  char *pending; /* bytes read past the current request (pipelined), held for after its answer */
  size_t pending_len;
  SSL *ssl;                                   /* TLS: its BIOs hold records read and to write */
  void (*sink)(void *, const char *, size_t); /* a memory connection's output (no tcp) */
  void *sink_arg;
  struct write_req *unfinished; /* a memory connection's answer, written, its completion not yet run */
};

/* An answer being written: its bytes (or their TLS records), then the next request. */
typedef struct write_req {
  uv_write_t w;
  moed_http_conn *c;
  char *head;
  void (*release)(void *);
  void *release_arg;
  char *records; /* TLS: the encrypted answer */
} write_req;
/* http_conn.c: the connection */

/* Closes c (the handler's gone() is called first when it deferred). */
void moed_http_conn_close(moed_http_conn *c);
/* The deadline: c closes in `seconds` unless re-armed or stopped. */
void moed_http_conn_arm(moed_http_conn *c, int seconds);
/* The deadline while a body arrives: the next read within
 * --handshake-timeout, and the body so far at --http-body-min-rate on
 * average after a first --handshake-timeout. */
void moed_http_conn_arm_body(moed_http_conn *c);
/* After an answer is queued: while the socket has not taken it whole, the
 * client must read something every --handshake-timeout and the answer at
 * --http-body-min-rate on average after a first --handshake-timeout, else
 * the connection is closed (and the answer freed). */
void moed_http_conn_watch_write(moed_http_conn *c);
/* Stops reading the socket (held bytes at HELD_MAX, or a refusal). */
void moed_http_conn_pause(moed_http_conn *c);
/* Bytes from the client (plain, or decrypted): parsed, or held while a
 * request is in work. */
void moed_http_conn_take_input(moed_http_conn *c, const char *data, size_t n);
/* The client's FIN (or TLS close_notify). */
void moed_http_conn_eof(moed_http_conn *c);
/* The answer is written: the next request, or the end. */
void moed_http_conn_answered(moed_http_conn *c);
/* A connection on l, in the open list, its timer armed (not its socket). */
moed_http_conn *moed_http_conn_new(moed_http_listener *l);
/* A listener (no socket yet) in the list of every listener. */
moed_http_listener *moed_http_listener_new(uv_loop_t *loop, const moed_http_options *o, moed_http_handler fn,
                                           void *arg);

/* http_parse.c: the request */

/* Feeds data[0..n) to the parser; a whole request goes to the handler, a
 * refused or malformed one is answered and the connection closed after. */
void moed_http_feed(moed_http_conn *c, const char *data, size_t n);
/* Gives back c's claim on --http-body-budget-bytes (its body is freed). */
void moed_http_body_release(moed_http_conn *c);

/* http_transport.c: bytes in and out */

/* Sets up TLS on an accepted connection; false: out of memory. */
bool moed_http_tls_attach(moed_http_conn *c);
/* Records read from the socket (n <= INT_MAX): decrypted and taken as input. */
void moed_http_tls_read(moed_http_conn *c, const char *data, size_t n);
/* Decrypts what TLS holds and takes it as input (a failed handshake closes c). */
void moed_http_tls_input(moed_http_conn *c);
/* Writes the records TLS has produced: with wr, as the answer wr (its
 * completion runs moed_http_written), else on their own. */
void moed_http_tls_flush(moed_http_conn *c, write_req *wr);
/* Writes bufs[0..n) as the answer wr; its completion runs moed_http_written.
 * Not 0: nothing was written (the caller frees wr). */
int moed_http_send_answer(moed_http_conn *c, write_req *wr, const uv_buf_t *bufs, unsigned n);
/* Bytes ahead of the answer (100 Continue), best effort. */
void moed_http_send_now(moed_http_conn *c, const char *data, size_t len);
/* " cert 'SUBJECT'" of a verified client certificate (mTLS) into out, or "". */
void moed_http_tls_subject(moed_http_conn *c, char *out, size_t size);

/* http_answer.c: answers */

/* An answer's write completed (status < 0: failed): wr freed, then the next
 * request or the close. */
void moed_http_written(uv_write_t *w, int status);
/* Frees wr and runs its release (the answer's body). */
void moed_http_write_free(write_req *wr);

#endif
