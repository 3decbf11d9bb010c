/* handlers: the protocol. Each request arrives here on the loop thread and
 * is dispatched by method to its handler group (handlers_req.h); small
 * RPCs are answered at once, inference and repository changes become jobs
 * on the device queues. Here: the shared answer helpers, health and server
 * metadata, admission and the inference entry, and the dispatch. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "handlers_req.h"
#include "kserve_wire.h"

/* ---- message helpers ------------------------------------------------------------- */

void moed_reply(moed_request *req, const ProtobufCMessage *m) {
  grpc_byte_buffer *bb = moed_rpc_pack(m);
  if (!bb)
    moed_rpc_finish(req->rpc, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory", NULL);
  else
    moed_rpc_finish(req->rpc, GRPC_STATUS_OK, NULL, bb);
}

void moed_reply_error(moed_request *req, grpc_status_code code, const char *fmt, ...) {
  char msg[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  moed_rpc_finish(req->rpc, code, msg, NULL);
}

void *moed_unpack(moed_request *req, const ProtobufCMessageDescriptor *d) {
  grpc_slice sl = moed_rpc_flatten(req->payload);
  char field[96];
  const char *fault =
      moed_wire_bad_string(d, GRPC_SLICE_START_PTR(sl), GRPC_SLICE_LENGTH(sl), field, sizeof field);
  if (fault) {
    grpc_slice_unref(sl);
    moed_reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "%s: %s", field, fault);
    return NULL;
  }
  ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, GRPC_SLICE_LENGTH(sl), GRPC_SLICE_START_PTR(sl));
  grpc_slice_unref(sl);
  if (!m)
    moed_reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "request: not a valid %s message", d->short_name);
  return m;
}

const char *moed_version_other(const char *v) { return (!v || !*v || strcmp(v, "1") == 0) ? NULL : v; }

/* ---- health and server metadata ------------------------------------------------------ */

static void server_metadata(const moed_server *s, moed_request *req) {
  /* the last two only while regions may be registered, the CUDA one where
   * one could open (a GPU build running on GPUs) */
  static char *extensions[] = {"model_repository", "statistics",           "grpc_health",
                               "moe_expert_store", "system_shared_memory", "cuda_shared_memory"};
  Inference__ServerMetadataResponse r = INFERENCE__SERVER_METADATA_RESPONSE__INIT;
  r.name = "moed";
  r.version = MOED_VERSION;
  r.n_extensions =
      sizeof extensions / sizeof extensions[0] - !s->shm - !(s->shm && moed_cuda_shm_gpus(s) > 0);
  r.extensions = extensions;
  moed_reply(req, &r.base);
}

/* Health service names: "" = live, "moed" and the inference service = ready. */
static int health_status(moed_server *s, const char *service) {
  if (!service || !*service) return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
  if (strcmp(service, "moed") == 0 || strcmp(service, "inference.GRPCInferenceService") == 0)
    return atomic_load(&s->ready) ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                                  : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
  return -1;
}

typedef struct moed_watch {
  struct moed_watch *next;
  moed_rpc *rpc;
  char service[128];
  int last;
} moed_watch;

static void watch_send(moed_watch *w, int status) {
  Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  r.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)status;
  grpc_byte_buffer *bb = moed_rpc_pack(&r.base);
  if (bb) moed_rpc_stream_write(w->rpc, bb);
  w->last = status;
}

void moed_health_changed(moed_server *s) {
  for (moed_watch **pp = &s->watches; *pp;) {
    moed_watch *w = *pp;
    if (moed_rpc_cancelled(w->rpc)) { /* the client went away: drop it */
      *pp = w->next;
      moed_rpc_finish(w->rpc, GRPC_STATUS_CANCELLED, "cancelled", NULL);
      free(w);
      continue;
    }
    int st = health_status(s, w->service);
    if (st < 0) st = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
    if (st != w->last) watch_send(w, st);
    pp = &w->next;
  }
}

void moed_health_close(moed_server *s) {
  while (s->watches) {
    moed_watch *w = s->watches;
    s->watches = w->next;
    moed_rpc_finish(w->rpc, GRPC_STATUS_UNAVAILABLE, "server shutting down", NULL);
    free(w);
  }
}

static void health(moed_server *s, moed_request *req, bool watch) {
  Grpc__Health__V1__HealthCheckRequest *in =
      moed_unpack(req, &grpc__health__v1__health_check_request__descriptor);
  if (!in) return;
  int st = health_status(s, in->service);
  if (!watch) {
    if (st < 0) {
      moed_reply_error(req, GRPC_STATUS_NOT_FOUND, "service: unknown service '%s'", in->service);
    } else {
      Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
      r.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)st;
      moed_reply(req, &r.base);
    }
  } else {
    moed_watch *w = calloc(1, sizeof *w);
    if (!w) {
      moed_reply_error(req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
    } else { /* the watch keeps the request's reference until it ends */
      w->rpc = req->rpc;
      snprintf(w->service, sizeof w->service, "%s", in->service ? in->service : "");
      watch_send(w, st < 0 ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN : st);
      w->next = s->watches;
      s->watches = w;
    }
  }
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

/* ---- admission and inference ----------------------------------------------------------------- */

/* Messages up to this size are decoded on the loop (microseconds), so the
 * batcher sees their model and shapes; larger ones are decoded on a worker
 * and run alone (they fill a batch by themselves). */
#define LOOP_DECODE_MAX ((size_t)1 << 20)

void moed_refuse(moed_server *s, moed_request *req, const char *why) {
  atomic_fetch_add(&s->rejected, 1);
  moed_request_refuse(req, GRPC_STATUS_UNAVAILABLE, why);
}

/* Drain and the in-flight limit; false: refused (answered and freed). */
static bool admit(moed_server *s, moed_request *req) {
  if (atomic_load(&s->draining)) {
    moed_refuse(s, req, "server is shutting down");
    return false;
  }
  if (atomic_fetch_add(&s->inflight, 1) >= s->cfg->max_inflight) {
    atomic_fetch_sub(&s->inflight, 1);
    moed_refuse(s, req, "too many requests in flight");
    return false;
  }
  return true; /* admitted: from here the inference path answers it and drops the in-flight count */
}

bool moed_handle_inline(moed_request *req, void *arg) {
  moed_server *s = arg;
  moe_backend *b = s->devices ? moed_devices_inline_backend(s->devices) : NULL;
  if (!b || req->method != MOED_M_MODEL_INFER || !req->payload ||
      grpc_byte_buffer_length(req->payload) > s->cfg->inline_bytes || !moed_infer_inline_ok(s, req->payload))
    return false;
  if (!admit(s, req)) return true;
  moed_infer_req *r = moed_infer_decode(s, req);
  if (r) moed_infer_run(s, b, &r, 1);
  return true;
}

/* Admission, then decode here and batch, or hand a large message to a
 * worker undecoded. */
static void infer(moed_server *s, moed_request *req) {
  if (!admit(s, req)) return;
  if (req->payload && grpc_byte_buffer_length(req->payload) > LOOP_DECODE_MAX)
    return moed_infer_dispatch_raw(s, req);
  moed_infer_req *r = moed_infer_decode(s, req);
  if (!r) return;
  if (moed_infer_failed(r))
    moed_infer_run(s, NULL, &r, 1); /* only answers it */
  else if (moed_infer_batch_rows(r) > 0)
    moed_batcher_submit(s->batcher, r);
  else
    moed_infer_dispatch(s, &r, 1);
}

/* ---- dispatch -------------------------------------------------------------------------------- */

void moed_handle_cancel(void *arg) {
  moed_server *s = arg;
  moed_batcher_sweep(s->batcher);
}

void moed_handle_request(moed_request *req, void *arg) {
  moed_server *s = arg;
  bool keep = false; /* the request was handed on (a job owns it) */
  switch (req->method) {
  case MOED_M_SERVER_LIVE: {
    Inference__ServerLiveResponse r = INFERENCE__SERVER_LIVE_RESPONSE__INIT;
    r.live = true;
    moed_reply(req, &r.base);
    break;
  }
  case MOED_M_SERVER_READY: {
    Inference__ServerReadyResponse r = INFERENCE__SERVER_READY_RESPONSE__INIT;
    r.ready = atomic_load(&s->ready);
    moed_reply(req, &r.base);
    break;
  }
  case MOED_M_MODEL_READY: moed_handle_model_ready(s, req); break;
  case MOED_M_SERVER_METADATA: server_metadata(s, req); break;
  case MOED_M_MODEL_METADATA: moed_handle_model_metadata(s, req); break;
  case MOED_M_MODEL_CONFIG: moed_handle_model_config(s, req); break;
  case MOED_M_MODEL_STATISTICS: moed_handle_model_statistics(s, req); break;
  case MOED_M_REPOSITORY_INDEX: moed_handle_repository_index(s, req); break;
  case MOED_M_HEALTH_CHECK: health(s, req, false); break;
  case MOED_M_HEALTH_WATCH: health(s, req, true); break;
  case MOED_M_SHM_REGISTER: moed_handle_shm_change(s, req, true, MOED_SHM_SYSTEM); break;
  case MOED_M_SHM_UNREGISTER: moed_handle_shm_change(s, req, false, MOED_SHM_SYSTEM); break;
  case MOED_M_SHM_STATUS: moed_handle_shm_status(s, req, MOED_SHM_SYSTEM); break;
  case MOED_M_CUDA_SHM_REGISTER: moed_handle_shm_change(s, req, true, MOED_SHM_CUDA); break;
  case MOED_M_CUDA_SHM_UNREGISTER: moed_handle_shm_change(s, req, false, MOED_SHM_CUDA); break;
  case MOED_M_CUDA_SHM_STATUS: moed_handle_shm_status(s, req, MOED_SHM_CUDA); break;
  case MOED_M_MODEL_INFER:
    infer(s, req);
    keep = true;
    break;
  case MOED_M_MODEL_STREAM_INFER:
    if (!req->payload) { /* the client closed its side */
      moed_rpc_stream_done(req->rpc);
      break;
    }
    infer(s, req);
    keep = true;
    break;
  case MOED_M_REPOSITORY_LOAD:
  case MOED_M_REPOSITORY_UNLOAD:
  case MOED_M_EXPERT_UPLOAD:
    /* refused for good (not UNAVAILABLE: a retry cannot succeed); an upload
     * stream at its first message */
    if (s->cfg->model_control == MOED_CONTROL_NONE || s->cfg->model_control == MOED_CONTROL_POLL) {
      moed_rpc_finish(req->rpc, GRPC_STATUS_FAILED_PRECONDITION,
                      s->cfg->model_control == MOED_CONTROL_NONE
                          ? "the model repository is not changed by RPC (--model-control-mode none)"
                          : "the model repository follows its directory (--model-control-mode poll)",
                      NULL);
      break;
    }
    if (req->method == MOED_M_EXPERT_UPLOAD)
      moed_upload_handle(s, req);
    else
      moed_handle_repository_change(s, req);
    keep = true;
    break;
  default: moed_rpc_finish(req->rpc, GRPC_STATUS_UNIMPLEMENTED, "unknown method", NULL); break;
  }
  if (!keep) {
    moed_request_free(req);
  }
}
