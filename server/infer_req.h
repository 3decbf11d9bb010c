/* infer_req: the decoded inference request and the steps that hand it on,
 * internal to the inference path. A request goes through the files in this
 * order:
 *   infer_decode.c  the message (walked by kserve_wire.c) -> moed_infer_req
 *   infer_shm.c     inputs read from, outputs written to shared memory
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

/* A tensor's span in a shared-memory region: [offset, offset + size) of
 * region (held by the request; NULL: none), checked when it was named and
 * again at each copy. */
typedef struct moed_shm_at {
  const moed_shm_region *region;
  uint64_t offset, size;
} moed_shm_at;

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
  /* shared memory (infer_shm.c): the regions the request uses (one
   * reference each), inputs still to be copied out of a region (region
   * NULL: none), and where each requested output goes (region NULL: in the
   * response) with the room there */
  moed_shm_region *shm[2 * MOED_MAX_TENSORS];
  size_t n_shm;
  moed_shm_at shm_in[MOED_MAX_TENSORS];
  moed_shm_at shm_out[MOED_MAX_TENSORS];
};

/* ---- infer_shm.c ------------------------------------------------------------------------- */

/* Whether the ModelInferRequest p[0..n) (a small one) reads at most the
 * bytes that decoding copies at once from shared memory (true when it
 * names no region; false when it cannot tell). */
bool moed_infer_shm_small(const uint8_t *p, size_t n);
/* Whether input t names a shared-memory region (parameters['shared_memory_region']). */
bool moed_infer_shm_named(const Inference__ModelInferRequest__InferInputTensor *t);
/* Input i of r->msg (its tensor `out` with shape and dtype set) from the
 * region it names: bounds and byte size checked, the bytes copied now when
 * small (else at moed_infer_shm_inputs). OK with *used false: it names no
 * region. */
grpc_status_code moed_infer_shm_input(moed_infer_req *r, moed_server *srv, size_t i, moe_tensor *out,
                                      bool *used);
/* Each requested output that names a region: the region found and the
 * span checked (decoding). */
grpc_status_code moed_infer_shm_outputs_decode(moed_infer_req *r, moed_server *srv);
/* Copies the inputs left in their regions into the request's own memory
 * (on the worker, before the op reads them: a client writing its region
 * meanwhile cannot change what was validated). Error in r->err. */
grpc_status_code moed_infer_shm_inputs(moed_infer_req *r);
/* Writes each output r asks into shared memory into its region and puts an
 * empty slice in its place in data[] (the response then carries its
 * metadata and no bytes, as Triton's does). outs/data: the model's
 * outputs. Error in err[MOED_ERR_LEN] naming the output. */
grpc_status_code moed_infer_shm_outputs(moed_infer_req *r, const moe_named_tensor *outs, grpc_slice *data,
                                        size_t num_out, char *err);

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
