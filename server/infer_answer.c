/* infer_answer: the last step of every inference request, however far it
 * got (infer_req.h): the answer on its call or stream, its statistics,
 * and the request freed with the in-flight count it held. */
#include <grpc/byte_buffer_reader.h>
#include <stdio.h>
#include <stdlib.h>

#include "infer_req.h"

void moed_infer_req_free(moed_infer_req *r) {
  if (!r) return;
  for (size_t i = 0; i < MOED_MAX_TENSORS; i++)
    moed_hostmem_free(r->owned[i]);
  for (size_t i = 0; i < r->n_shm; i++) /* an unregistered region is unmapped with its last user */
    moed_shm_release(r->shm[i]);
  free(r->raw);
  free(r->key);
  if (r->msg) inference__model_infer_request__free_unpacked(r->msg, NULL);
  grpc_slice_unref(r->flat);
  moed_model_release(r->model);
  moed_request_free(r->req);
  free(r);
}

static grpc_byte_buffer *pack_stream_error(const char *id, const char *msg) {
  Inference__ModelStreamInferResponse r = INFERENCE__MODEL_STREAM_INFER_RESPONSE__INIT;
  Inference__ModelInferResponse ir = INFERENCE__MODEL_INFER_RESPONSE__INIT;
  ir.id = (char *)(id ? id : "");
  r.error_message = (char *)msg;
  r.infer_response = &ir;
  return moed_rpc_pack(&r.base);
}

/* Sends the answer to one request: unary -> status (+ response); stream ->
 * the response or an error message, and the stream goes on. */
static void respond(moed_request *req, const char *id, grpc_status_code code, const char *msg,
                    grpc_byte_buffer *resp) {
  moed_request_answered(req);
  if (req->method != MOED_M_MODEL_STREAM_INFER) {
    moed_rpc_finish(req->rpc, code, code ? msg : NULL, resp);
    return;
  }
  if (code != GRPC_STATUS_OK) {
    if (resp) grpc_byte_buffer_destroy(resp);
    resp = pack_stream_error(id, msg);
  }
  if (resp) moed_rpc_stream_write(req->rpc, resp);
  moed_rpc_stream_done(req->rpc);
}

/* A refusal's message: on a stream the status code reaches the client only
 * as text (the stream itself goes on), so UNAVAILABLE is named there. */
static void reject_message(char msg[128], const moed_request *req, grpc_status_code code, const char *why) {
  bool stream = req->method == MOED_M_MODEL_STREAM_INFER;
  snprintf(msg, 128, "%s%s", stream && code == GRPC_STATUS_UNAVAILABLE ? "UNAVAILABLE: " : "", why);
}

/* The request id of an undecoded stream request, from its payload's first
 * slice (the id precedes the tensors in every encoder we know; "" if not). */
static void peek_id(const moed_request *req, char *id, size_t size) {
  id[0] = 0;
  grpc_byte_buffer_reader rd;
  if (req->method != MOED_M_MODEL_STREAM_INFER || !req->payload ||
      !grpc_byte_buffer_reader_init(&rd, req->payload))
    return;
  grpc_slice first;
  if (grpc_byte_buffer_reader_next(&rd, &first)) {
    moed_kserve_string(GRPC_SLICE_START_PTR(first), GRPC_SLICE_LENGTH(first), true, MOED_KSERVE_ID, id, size);
    grpc_slice_unref(first);
  }
  grpc_byte_buffer_reader_destroy(&rd);
}

void moed_request_refuse(moed_request *req, grpc_status_code code, const char *why) {
  char msg[128], id[256];
  reject_message(msg, req, code, why);
  peek_id(req, id, sizeof id);
  respond(req, id, code, msg, NULL);
  moed_request_free(req);
}

void moed_request_reject(moed_server *srv, moed_request *req, grpc_status_code code, const char *why) {
  moed_request_refuse(req, code, why);
  atomic_fetch_sub(&srv->inflight, 1);
}

uint64_t moed_infer_batch_size(const moed_server *srv, const moed_infer_req *r) {
  if (!r->model || !r->n_in || r->in[0].tensor.ndim < 1 || moed_model_max_batch_size(srv, r->model) <= 0)
    return 1;
  return (uint64_t)r->in[0].tensor.shape[0]; /* every tensor leads with the batch axis */
}

void moed_infer_finish(moed_server *srv, moed_infer_req *r, grpc_status_code code, const char *msg,
                       grpc_byte_buffer *resp, const moed_timing *t, uint64_t bytes_out) {
  if (r->model) { /* before the answer: a client that reads ModelStatistics next finds its request */
    uint64_t now = moed_now_ns(), start = t && t->start_ns ? t->start_ns : now;
    moed_stats_record(r->model->stats, code == GRPC_STATUS_OK, start - r->req->received_ns, t,
                      now - r->req->received_ns, code == GRPC_STATUS_OK ? moed_infer_batch_size(srv, r) : 0,
                      r->bytes_in, bytes_out);
  }
  /* a message refused before protobuf-c read it (malformed, or a NUL in a
   * string): its id from the bytes, so that a stream client can still match
   * the refusal to its request */
  char id[256] = "";
  if (!r->msg)
    moed_kserve_string(GRPC_SLICE_START_PTR(r->flat), GRPC_SLICE_LENGTH(r->flat), false, MOED_KSERVE_ID, id,
                       sizeof id);
  respond(r->req, r->msg ? r->msg->id : id, code, msg, resp);
  moed_infer_req_free(r);
  atomic_fetch_sub(&srv->inflight, 1);
}

void moed_infer_reject(moed_server *srv, moed_infer_req *r, grpc_status_code code, const char *why) {
  char msg[128];
  reject_message(msg, r->req, code, why);
  moed_infer_finish(srv, r, code, msg, NULL, NULL, 0);
}
