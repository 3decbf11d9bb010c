/* libFuzzer: a ModelInferRequest as moed receives it, decoded and validated
 * as the server does before running anything: the wire walk and NUL check
 * (kserve_wire.c), protobuf-c, names, shapes, sizes, typed contents and
 * parameters (infer_decode.c), the batch key (batcher.c), then the op's
 * own validation (moe_op_prepare) for whichever built-in model the message
 * names. Nothing runs; a request that passes only gets its call freed. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "infer_req.h"

static moed_config cfg;
static moed_server srv;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  char *args[] = {(*argv)[0], NULL};
  grpc_init();
  if (moed_config_parse(&cfg, 1, args) != 0) abort();
  cfg.max_tensor_bytes = cfg.max_message_bytes = (size_t)1 << 24; /* the fuzzer's memory is bounded */
  moed_log_init(MOED_LOG_ERROR, false);
  srv.cfg = &cfg;
  if (moed_repository_create(NULL, &srv.repo) != 0) abort();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)data, size);
  moed_request *req = calloc(1, sizeof *req);
  if (!req) abort();
  req->method = MOED_M_MODEL_INFER;
  req->payload = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  moed_infer_req *r = moed_infer_decode(&srv, req);
  if (r && !moed_infer_failed(r)) {
    moe_params mp = {r->params, r->n_params};
    moe_call *call = NULL;
    moe_error err;
    if (moe_op_prepare(r->model->op, r->in, r->n_in, &mp, r->model->set, &call, &err) == MOE_OK)
      moe_call_destroy(call);
  }
  moed_infer_req_free(r);
  return 0;
}
