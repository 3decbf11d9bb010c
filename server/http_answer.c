/* http_answer: a handler's answer on its connection: the status line and
 * headers, the body written in place (or copied), errors as Triton's
 * {"error": ...} JSON; when the write completes, the connection goes on to
 * its next request (http_conn.c). */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_conn.h"

void moed_http_write_free(write_req *wr) {
  if (wr->release) wr->release(wr->release_arg);
  free(wr->head);
  free(wr->records);
  free(wr);
}

void moed_http_written(uv_write_t *w, int status) {
  write_req *wr = (write_req *)w;
  moed_http_conn *c = wr->c;
  moed_http_write_free(wr);
  if (status < 0)
    moed_http_conn_close(c);
  else
    moed_http_conn_answered(c);
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
    return moed_http_conn_close(c);
  }
  wr->c = c;
  wr->release = release;
  wr->release_arg = arg;
  bufs[0] = uv_buf_init(wr->head, (unsigned)hn);
  for (size_t i = 0; i < nbody; i++)
    bufs[i + 1] = body[i];
  if (moed_http_send_answer(c, wr, bufs, (unsigned)nbody + 1) != 0) {
    moed_http_write_free(wr);
    moed_http_conn_close(c);
    return;
  }
  moed_http_conn_watch_write(c);
}

void moed_http_respond_copy(moed_http_conn *c, int code, const char *ctype, const char *body, size_t len) {
  char *copy = malloc(len ? len : 1);
  if (!copy) return moed_http_conn_close(c);
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
  if (!clean) return moed_http_conn_close(c);
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
  if (!s) return moed_http_conn_close(c);
  uv_buf_t b = uv_buf_init(s, (unsigned)strlen(s));
  moed_http_respond(c, code, "application/json", NULL, &b, 1, free, s);
}

void moed_http_defer(moed_http_conn *c, void (*gone)(void *), void *arg) {
  c->gone = gone;
  c->gone_arg = arg;
}
