/* What the infer fuzz targets share: a server with the built-in models and
 * the default limits (bounded for the fuzzer's memory), and the path a
 * ModelInferRequest takes before anything runs. */
#ifndef MOE_FUZZ_INFER_COMMON_H
#define MOE_FUZZ_INFER_COMMON_H

#include <stdlib.h>

#include "infer_req.h"

static moed_config fuzz_cfg;
static moed_server fuzz_srv;

static void fuzz_server_init(char *argv0) {
  char *args[] = {argv0, NULL};
  grpc_init();
  if (moed_config_parse(&fuzz_cfg, 1, args) != 0) abort();
  fuzz_cfg.max_tensor_bytes = fuzz_cfg.max_message_bytes = (size_t)1 << 24;
  moed_log_init(MOED_LOG_ERROR, false);
  fuzz_srv.cfg = &fuzz_cfg;
  if (moed_repository_create(NULL, &fuzz_srv.repo) != 0) abort();
}

/* The message (taken) decoded and validated as the server does: the wire
 * walk and NUL check (kserve_wire.c), protobuf-c, names, shapes, sizes,
 * typed contents and parameters (infer_decode.c), the batch key
 * (batcher.c), then the op's own validation (moe_op_prepare) for whichever
 * built-in model it names. Nothing runs; a request that passes only gets
 * its call freed. */
static void fuzz_decode_and_prepare(grpc_byte_buffer *payload) {
  moed_request *req = calloc(1, sizeof *req);
  if (!req) abort();
  req->method = MOED_M_MODEL_INFER;
  req->payload = payload;
  moed_infer_req *r = moed_infer_decode(&fuzz_srv, req);
  if (r && !moed_infer_failed(r)) {
    moe_params mp = {r->params, r->n_params};
    moe_call *call = NULL;
    moe_error err;
    if (moe_op_prepare(r->model->op, r->in, r->n_in, &mp, r->model->set, &call, &err) == MOE_OK)
      moe_call_destroy(call);
  }
  moed_infer_req_free(r);
}

#endif
