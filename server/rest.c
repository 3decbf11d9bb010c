/* rest: the KServe v2 REST API (Triton's HTTP/REST protocol) on its own
 * port, with Triton's binary tensor extension: the port, and each call's
 * way to the handlers and back.
 *
 * Every endpoint is a translation, not a second implementation: the JSON
 * request becomes the gRPC method's protobuf request (rest_routes.c,
 * rest_infer.c), goes to the same handler the gRPC port calls
 * (moed_handle_request, through a local moed_rpc), and the protobuf answer
 * becomes JSON (rest_answer.c). Metadata, config, statistics, the
 * repository and inference (admission, batching, the device workers) thus
 * behave alike on both ports. Answers come from any thread (a worker
 * finishes an inference); they cross to the loop through one queue and a
 * uv_async, as rpc.c's requests do the other way. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rest_call.h"

/* ---- calls: to the handlers and back ---------------------------------------------- */

static void rest_free(moed_rest *r) {
  pthread_mutex_destroy(&r->mu);
  free(r);
}

static void call_free(rest_call *k) {
  if (k->resp) grpc_byte_buffer_destroy(k->resp);
  free(k->msg);
  if (k->rpc) moed_rpc_release(k->rpc);
  free(k);
}

/* Drops a finished call once the port is closed; r->mu held. true: r is
 * to be freed (the last call, the async handle closed). */
static bool drop_locked(moed_rest *r, rest_call *k) {
  call_free(k);
  return --r->outstanding == 0 && r->async_closed;
}

/* moed_rpc_done_fn: any thread. */
static void call_done(void *arg, grpc_status_code code, const char *msg, grpc_byte_buffer *resp) {
  rest_call *k = arg;
  moed_rest *r = k->rest;
  k->code = code;
  k->msg = msg ? strdup(msg) : NULL;
  k->resp = resp;
  pthread_mutex_lock(&r->mu);
  if (r->closed) {
    bool last = drop_locked(r, k);
    pthread_mutex_unlock(&r->mu);
    if (last) rest_free(r);
    return;
  }
  if (r->q_tail)
    r->q_tail->next = k;
  else
    r->q_head = k;
  r->q_tail = k;
  uv_async_send(&r->async);
  pthread_mutex_unlock(&r->mu);
}

static void call_gone(void *arg) {
  rest_call *k = arg;
  k->c = NULL;
  moed_rpc_local_cancel(k->rpc);
  moed_handle_cancel(k->rest->srv); /* its queued work is answered and leaves the device queue */
}

/* --auth-tokens: whether rq's Authorization header allows `method` (the
 * gRPC port's tokens and roles); false: refused, logged and answered. The
 * peer goes to peer[0..320) where a log line names it (a refusal, a
 * repository change), as rpc.c does: "rest:ADDR:PORT token 'NAME'". Checked
 * before a body is parsed, so that a refusal is 401/403 whatever the body. */
bool moed_rest_allowed(moed_http_conn *c, const moed_http_request *rq, moed_method method, char *peer) {
  char who[128], why[MOED_ERR_LEN];
  grpc_status_code auth = moed_auth_check_value(method, rq->authorization_len < 0 ? NULL : rq->authorization,
                                                rq->authorization_len < 0 ? 0 : (size_t)rq->authorization_len,
                                                who, sizeof who, why);
  peer[0] = 0;
  if (auth != GRPC_STATUS_OK || moed_method_changes(method)) {
    memcpy(peer, "rest:", 5);
    moed_http_peer(c, peer + 5, 320 - 5);
    if (who[0]) snprintf(peer + strlen(peer), 320 - strlen(peer), " token '%s'", who);
  }
  if (auth == GRPC_STATUS_OK) return true;
  moed_log(moed_method_changes(method) ? MOED_LOG_WARN : MOED_LOG_DEBUG, "auth_refused",
           "REST %s from %s: %s", moed_method_name(method), peer, why);
  moed_http_respond_error(c, moed_http_status_from_grpc(auth), why);
  return false;
}

/* Hands the protobuf request `payload` (taken) to the handler of `method`;
 * the answer reaches c through moed_rest_answer. k: allocated by the caller (its
 * output choices set), taken. */
void moed_rest_submit(moed_rest *r, moed_http_conn *c, const moed_http_request *rq, moed_method method,
                      grpc_byte_buffer *payload, rest_call *k) {
  char peer[320];
  if (!moed_rest_allowed(c, rq, method, peer)) {
    if (payload) grpc_byte_buffer_destroy(payload);
    free(k);
    return;
  }
  moed_request *req = calloc(1, sizeof *req);
  k->rest = r;
  k->c = c;
  k->method = method;
  k->rpc = req && payload ? moed_rpc_local(method, call_done, k, peer) : NULL;
  if (!k->rpc) {
    if (payload) grpc_byte_buffer_destroy(payload);
    free(req);
    free(k);
    return moed_http_respond_error(c, 500, "server out of memory");
  }
  req->rpc = k->rpc;
  req->method = method;
  req->payload = payload;
  req->received_ns = moed_now_ns();
  pthread_mutex_lock(&r->mu);
  r->outstanding++;
  pthread_mutex_unlock(&r->mu);
  moed_http_defer(c, call_gone, k);
  moed_handle_request(req, r->srv);
}

void moed_rest_call(moed_rest *r, moed_http_conn *c, const moed_http_request *rq, moed_method method,
                    const ProtobufCMessage *m) {
  rest_call *k = calloc(1, sizeof *k);
  if (!k) return moed_http_respond_error(c, 500, "server out of memory");
  if (method == MOED_M_MODEL_READY) {
    const Inference__ModelReadyRequest *q = (const Inference__ModelReadyRequest *)m;
    snprintf(k->model, sizeof k->model, "'%.120s'%s%s", q->name, *q->version ? " version " : "",
             *q->version ? moed_version_shown(q->version) : "");
  }
  moed_rest_submit(r, c, rq, method, moed_rpc_pack(m), k);
}

static void on_async(uv_async_t *h) {
  moed_rest *r = h->data;
  pthread_mutex_lock(&r->mu);
  rest_call *k = r->q_head;
  r->q_head = r->q_tail = NULL;
  pthread_mutex_unlock(&r->mu);
  while (k) {
    rest_call *next = k->next;
    if (k->c) moed_rest_answer(k);
    pthread_mutex_lock(&r->mu);
    r->outstanding--;
    pthread_mutex_unlock(&r->mu);
    call_free(k);
    k = next;
  }
}

/* ---- the port ------------------------------------------------------------------------------ */

int moed_rest_start(moed_server *s, const char *address, int port, moed_rest **out, int *bound_port) {
  moed_rest *r = calloc(1, sizeof *r);
  if (!r) return -1;
  r->srv = s;
  pthread_mutex_init(&r->mu, NULL);
  const moed_http_options o = {.name = "rest",
                               .cfg = s->cfg,
                               .max_body = s->cfg->max_message_bytes,
                               .keep_alive = true,
                               .tls = s->cfg->tls_cert != NULL};
  if (moed_http_listen(s->loop, address, port, &o, moed_rest_on_request, r, &r->l, bound_port) != 0) {
    rest_free(r);
    return -1;
  }
  uv_async_init(s->loop, &r->async, on_async);
  r->async.data = r;
  *out = r;
  return 0;
}

static void on_async_closed(uv_handle_t *h) {
  moed_rest *r = h->data;
  pthread_mutex_lock(&r->mu);
  rest_call *k = r->q_head; /* finished after the last on_async: nobody to answer */
  r->q_head = r->q_tail = NULL;
  while (k) {
    rest_call *next = k->next;
    call_free(k);
    r->outstanding--;
    k = next;
  }
  r->async_closed = true;
  bool last = r->outstanding == 0;
  pthread_mutex_unlock(&r->mu);
  if (last) rest_free(r);
}

void moed_rest_stop(moed_rest *r) {
  if (!r) return;
  moed_http_listener_close(r->l); /* every call's connection is gone: answers are dropped from here */
  pthread_mutex_lock(&r->mu);
  r->closed = true;
  pthread_mutex_unlock(&r->mu);
  uv_close((uv_handle_t *)&r->async, on_async_closed);
}
