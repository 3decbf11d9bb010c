/* rest_call: what the REST port's files share, internal to them. A request
 * goes through them in this order:
 *   rest_routes.c  the path and method -> the gRPC method and its request
 *   rest_infer.c   an infer body's JSON (and binary data) -> ModelInferRequest
 *   rest.c         the call handed to the handlers, its answer back on the loop
 *   rest_answer.c  the protobuf answer -> Triton's JSON (rest_infer.c: infer's)
 * moed.h declares what the rest of the server calls. */
#ifndef MOED_REST_CALL_H
#define MOED_REST_CALL_H

#include <cjson/cJSON.h>
#include <pthread.h>

#include "grpc_service.pb-c.h"
#include "kserve_wire.h"
#include "moed.h"

struct moed_rest {
  moed_server *srv;
  moed_http_listener *l;
  uv_async_t async;
  pthread_mutex_t mu; /* the answer queue, outstanding, closed */
  struct rest_call *q_head, *q_tail;
  int outstanding; /* calls handed to the handlers, not yet freed */
  bool closed;     /* answers are dropped where they finish */
  bool async_closed;
};

/* One request handed to the handlers. */
typedef struct rest_call {
  struct rest_call *next;
  moed_rest *rest;
  moed_http_conn *c; /* NULL once the client left (loop thread) */
  moed_rpc *rpc;
  moed_method method;
  /* infer: which outputs go as binary (Triton's binary_data), by name */
  bool binary_default;
  size_t n_out;
  char out_name[MOED_MAX_TENSORS][128];
  bool out_binary[MOED_MAX_TENSORS];
  bool out_shm[MOED_MAX_TENSORS]; /* written to shared memory: no data in the answer */
  char model[160];                /* ModelReady: the model and version its "not ready" names */
  /* the answer */
  grpc_status_code code;
  char *msg;
  grpc_byte_buffer *resp;
} rest_call;
/* --auth-tokens: whether rq's Authorization header allows `method`; false:
 * refused, logged and answered. peer[0..320): the caller, for the log. */
bool moed_rest_allowed(moed_http_conn *c, const moed_http_request *rq, moed_method method, char *peer);
/* Hands the protobuf request `payload` (taken) to the handler of `method`;
 * k (taken) is answered on the loop by moed_rest_answer. */
void moed_rest_submit(moed_rest *r, moed_http_conn *c, const moed_http_request *rq, moed_method method,
                      grpc_byte_buffer *payload, rest_call *k);
/* The same for a request message m (packed here). */
void moed_rest_call(moed_rest *r, moed_http_conn *c, const moed_http_request *rq, moed_method method,
                    const ProtobufCMessage *m);

/* rest_routes.c: every request on the port (the listener's handler). */
void moed_rest_on_request(moed_http_conn *c, moed_http_request *rq, void *arg);

/* rest_answer.c: a finished call's answer, on the loop (k->c is set). */
void moed_rest_answer(rest_call *k);

/* rest_infer.c: POST /v2/models/NAME[/versions/V]/infer, and its answer. */
void moed_rest_infer(moed_rest *r, moed_http_conn *c, moed_http_request *rq, const char *model,
                     const char *version);
void moed_rest_answer_infer(rest_call *k, const Inference__ModelInferResponse *m);

#endif
