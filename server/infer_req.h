/* infer_req: the decoded inference request and the steps that hand it on,
 * internal to the inference path. A request goes through the files in this
 * order:
 *   infer_decode.c  the message (walked by kserve_wire.c) -> moed_infer_req
 *   batcher.c       its batch key; merged with others or queued alone
 *   infer_run.c     one op call, merged or not; outputs split per request
 *                   and encoded by kserve_wire.c
 *   infer_answer.c  the answer, its statistics (model_stats.c), freed
 * moed.h declares what the rest of the server calls. */
#ifndef MOED_INFER_REQ_H
#define MOED_INFER_REQ_H

#include "grpc_service.pb-c.h"
#include "kserve_wire.h"
#include "moed.h"

#define MOED_MAX_PARAMS 64

struct moed_infer_req {
  moed_request *req;
  grpc_slice flat;                   /* the message bytes; raw inputs point here */
  Inference__ModelInferRequest *msg; /* everything but raw_input_contents */
  ProtobufCBinaryData *raw;          /* raw_input_contents, in place in `flat` */
  size_t n_raw;
  moed_model *model;
  moe_named_tensor in[MOED_MAX_TENSORS];
  size_t n_in;
  moe_param params[MOED_MAX_PARAMS];
  size_t n_params;
  void *owned[MOED_MAX_TENSORS]; /* converted typed contents */
  int64_t rows;                  /* batch rows; 0 = never batched */
  uint8_t *key;                  /* batch key (see moed_batch_key) */
  size_t key_len;
  uint64_t deadline_ns;  /* the call's deadline, or parameters['timeout'] after arrival if sooner */
  uint64_t timeout_us;   /* parameters['timeout'] when it set deadline_ns, else 0 */
  int priority;          /* level of parameters['priority'] (1 highest; MOED_PRIORITY_DEFAULT without) */
  grpc_status_code code; /* decode failure */
  char err[MOED_ERR_LEN];
  uint64_t bytes_in;
};

/* ---- batcher.c: the batch key ---------------------------------------------------------- */

/* Sets r's batch key and rows when r may be merged (decoding's last step);
 * leaves them empty (never batched) otherwise. */
void moed_batch_key(moed_infer_req *r, const moed_server *srv);

/* ---- infer_run.c ----------------------------------------------------------------------- */

/* Why r's work is not done (OK: it is still wanted; else err[] says, naming
 * parameters['timeout'] when that set the deadline): cancelled, past its
 * deadline, or (stopped: the op ran and was stopped) the drain timeout. */
grpc_status_code moed_infer_unwanted(const moed_server *srv, const moed_infer_req *r, bool stopped,
                                     char *err);

/* ---- infer_answer.c ------------------------------------------------------------------- */

/* r's batch size as Triton counts it: its rows along the batch axis for a
 * model that has one (moed_model_max_batch_size > 0), else 1. */
uint64_t moed_infer_batch_size(const moed_server *srv, const moed_infer_req *r);
/* Frees what decoding and the batch key allocated, and the moed_request
 * (NULL: nothing); answers nothing (moed_infer_finish does both). */
void moed_infer_req_free(moed_infer_req *r);

/* Answers r (resp: the encoded response, taken; NULL on failure), records
 * its statistics (t: its time on the worker; NULL or start_ns 0: it never
 * started) and frees it. */
void moed_infer_finish(moed_server *srv, moed_infer_req *r, grpc_status_code code, const char *msg,
                       grpc_byte_buffer *resp, const moed_timing *t, uint64_t bytes_out);

#endif
