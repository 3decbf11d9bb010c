/* libFuzzer: the HTTP/1.1 connection layer (server/http_conn.c) without a
 * socket: a byte stream (pipelined requests, chunked bodies, anything) fed
 * to a memory connection in pieces split at points the input chooses, the
 * answers collected. A request whose path starts "/d" is answered later
 * (deferred, as an inference is): before the next piece arrives, or at the
 * end; bytes that arrive meanwhile are held by the connection.
 *
 * Input: the first byte seeds the split points, the rest is the stream.
 * Checks beyond "no crash, no leak": the handler sees a NUL-terminated path
 * and body within the limits; the bytes written are a sequence of whole
 * answers (head, Content-Length bytes of body), one per request handled
 * plus at most one refusal that ends the connection; and
 * the bytes written are the same whatever the split, as they are when the
 * whole stream arrives in one read. Then the whole stream once more,
 * followed by the client's FIN: its answers are those of the first run up
 * to where the connection ended; a deferred request whose client is taken
 * as gone (the FIN came while it was in work, after a keep-alive request)
 * is never answered, and then the answers stop short of the first run's;
 * otherwise they are all of them. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed.h"

#define MAX_BODY 1024

typedef struct out {
  char *p;
  size_t len, cap;
  int handled;             /* requests the handler took */
  int gone;                /* deferred requests whose connection closed first */
  moed_http_conn *waiting; /* the deferred request's connection (NULL: none) */
  char text[1200];         /* its answer */
  int text_len;
} out;

static void sink(void *arg, const char *data, size_t n) {
  out *o = arg;
  if (o->len + n > o->cap) {
    size_t cap = (o->len + n) * 2;
    char *g = realloc(o->p, cap);
    if (!g) abort();
    o->p = g;
    o->cap = cap;
  }
  memcpy(o->p + o->len, data, n);
  o->len += n;
}

static out *current; /* the connection being run */

static void on_gone(void *arg) {
  out *o = arg;
  if (!o->waiting) abort(); /* called once, for a request in work */
  o->waiting = NULL;
  o->gone++;
}

/* Answers from what it was given (the body by its FNV-1a hash: its bytes
 * could fake a status line), so that a request read differently (another
 * path, header or body cut) writes different bytes. */
static void on_request(moed_http_conn *c, moed_http_request *rq, void *arg) {
  (void)arg;
  if (strnlen(rq->path, sizeof rq->path) == sizeof rq->path || rq->body_len > MAX_BODY ||
      (rq->body && rq->body[rq->body_len] != 0) || rq->authorization_len >= (int)sizeof rq->authorization)
    abort();
  current->handled++;
  uint64_t h = 14695981039346656037u;
  for (size_t i = 0; i < rq->body_len; i++)
    h = (h ^ (uint8_t)rq->body[i]) * 1099511628211u;
  uint64_t ha = 14695981039346656037u;
  for (int i = 0; i < rq->authorization_len; i++)
    ha = (ha ^ (uint8_t)rq->authorization[i]) * 1099511628211u;
  char *text = current->text;
  int n = snprintf(text, sizeof current->text, "%d %s|%lld|%d %016llx|%zu %016llx", rq->method, rq->path,
                   (long long)rq->inference_header_length, rq->authorization_len, (unsigned long long)ha,
                   rq->body_len, (unsigned long long)h);
  if (rq->path[1] == 'd') { /* "/d...": answered later (answer_waiting) */
    current->waiting = c;
    current->text_len = n;
    moed_http_defer(c, on_gone, current);
  } else if (rq->path[1] == 'e') { /* "/e...": the error answer's JSON writer */
    moed_http_respond_error(c, 400, text);
  } else {
    moed_http_respond_copy(c, 200, "text/plain", text, (size_t)n);
  }
}

/* Answers the deferred requests, each letting the connection go on to the
 * requests held behind it (which may defer again); false once it closed. */
static bool answer_waiting(moed_http_conn *c, out *o) {
  while (o->waiting) {
    if (o->waiting != c) abort();
    o->waiting = NULL;
    moed_http_respond_copy(c, 200, "text/plain", o->text, (size_t)o->text_len);
    if (!moed_http_memory_feed(c, NULL, 0)) return false; /* the write completes: the next request */
  }
  return true;
}

static uv_loop_t loop;
static moed_config cfg;
static moed_http_listener *listener;

/* The stream through one connection, split by seed (0: in one piece),
 * then (eof) the client's FIN. */
static void run(const uint8_t *data, size_t size, unsigned seed, bool eof, out *o) {
  moed_http_conn *c = moed_http_memory_conn(listener, sink, o);
  if (!c) abort();
  current = o;
  size_t at = 0;
  bool open = true;
  while (at < size && (open = answer_waiting(c, o))) {
    size_t step = size - at;
    if (seed) {
      seed = seed * 1103515245u + 12345u;
      step = 1 + (seed >> 16) % 97;
      if (step > size - at) step = size - at;
    }
    if (!(open = moed_http_memory_feed(c, (const char *)data + at, step))) break;
    at += step;
  }
  if (eof && open) open = moed_http_memory_eof(c);
  if (open) answer_waiting(c, o);
  moed_http_memory_close(c);
  if (o->waiting) abort();      /* a deferred request neither answered nor told gone */
  uv_run(&loop, UV_RUN_NOWAIT); /* the closed connection's timer: then it is freed */
}

/* The answers in o, walked by their heads and Content-Length (100 Continue
 * interim heads not counted); -1 when the bytes are not such a sequence. */
static int count_answers(const out *o) {
  int n = 0;
  size_t at = 0;
  while (at < o->len) {
    const char *p = o->p + at, *end = o->p + o->len;
    if ((size_t)(end - p) < 12 || memcmp(p, "HTTP/1.1 ", 9) != 0) return -1;
    const char *head_end = memmem(p, (size_t)(end - p), "\r\n\r\n", 4);
    if (!head_end) return -1;
    at = (size_t)(head_end + 4 - o->p);
    if (memcmp(p + 9, "100 ", 4) == 0) continue;
    const char *cl = memmem(p, (size_t)(head_end - p), "\r\nContent-Length: ", 18);
    if (!cl) return -1;
    size_t len = strtoul(cl + 18, NULL, 10);
    if (len > o->len - at) return -1;
    at += len;
    n++;
  }
  return n;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  char *args[] = {(*argv)[0], NULL};
  if (moed_config_parse(&cfg, 1, args) != 0) abort();
  moed_log_init(MOED_LOG_ERROR, false);
  uv_loop_init(&loop);
  const moed_http_options o = {.name = "fuzz", .cfg = &cfg, .max_body = MAX_BODY, .keep_alive = true};
  listener = moed_http_memory_listener(&loop, &o, on_request, NULL);
  if (!listener) abort();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  out whole = {0}, split = {0}, fin = {0};
  run(data + 1, size - 1, 0, false, &whole);
  run(data + 1, size - 1, 1u + data[0], false, &split);
  run(data + 1, size - 1, 0, true, &fin);
  if (whole.gone || split.gone || fin.gone > 1) abort();
  /* the FIN's run: the first run's answers, all of them or (a request gone) fewer */
  if (fin.len > whole.len || (fin.len && memcmp(fin.p, whole.p, fin.len) != 0) ||
      (fin.gone ? fin.len == whole.len : fin.len != whole.len))
    abort();
  /* an answer per handled request, and at most one refusal (it ends the connection) */
  int answers = count_answers(&whole);
  if (answers < whole.handled || answers > whole.handled + 1) abort();
  if (getenv("FUZZ_HTTP_VERBOSE")) /* the two outputs (fuzz/make_corpus.py's seeds) */
    fprintf(stderr, "whole:\n%.*s\nsplit:\n%.*s\n", (int)whole.len, whole.p ? whole.p : "", (int)split.len,
            split.p ? split.p : "");
  if (whole.len != split.len || (whole.len && memcmp(whole.p, split.p, whole.len) != 0)) abort();
  free(whole.p);
  free(split.p);
  free(fin.p);
  return 0;
}
