/* rest: the KServe v2 REST API (Triton's HTTP/REST protocol) on its own
 * port, with Triton's binary tensor extension.
 *
 * Every endpoint is a translation, not a second implementation: the JSON
 * request becomes the gRPC method's protobuf request, goes to the same
 * handler the gRPC port calls (moed_handle_request, through a local
 * moed_rpc), and the protobuf answer becomes JSON. Metadata, config,
 * statistics, the repository and inference (admission, batching, the
 * device workers) thus behave alike on both ports. Answers come from any
 * thread (a worker finishes an inference); they cross to the loop through
 * one queue and a uv_async, as rpc.c's requests do the other way. */
#include <cjson/cJSON.h>
#include <ctype.h>
#include <http_parser.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc_service.pb-c.h"
#include "json_number.h"
#include "kserve_wire.h"
#include "moe/codec.h"
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
static bool allowed(moed_http_conn *c, const moed_http_request *rq, moed_method method, char *peer) {
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
 * the answer reaches c through answer(). k: allocated by the caller (its
 * output choices set), taken. */
static void submit(moed_rest *r, moed_http_conn *c, const moed_http_request *rq, moed_method method,
                   grpc_byte_buffer *payload, rest_call *k) {
  char peer[320];
  if (!allowed(c, rq, method, peer)) {
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

static void call(moed_rest *r, moed_http_conn *c, const moed_http_request *rq, moed_method method,
                 const ProtobufCMessage *m) {
  rest_call *k = calloc(1, sizeof *k);
  if (!k) return moed_http_respond_error(c, 500, "server out of memory");
  if (method == MOED_M_MODEL_READY) {
    const Inference__ModelReadyRequest *q = (const Inference__ModelReadyRequest *)m;
    snprintf(k->model, sizeof k->model, "'%.120s'%s%s", q->name, *q->version ? " version " : "",
             *q->version ? moed_version_shown(q->version) : "");
  }
  submit(r, c, rq, method, moed_rpc_pack(m), k);
}

/* ---- protobuf -> JSON ---------------------------------------------------------------- */

static cJSON *pb_json(const ProtobufCMessage *m);

static bool is_map_entry(const ProtobufCMessageDescriptor *d) {
  return d->n_fields == 2 && !strcmp(d->fields[0].name, "key") && !strcmp(d->fields[1].name, "value");
}

/* One value of field f at p; NULL for bytes (never in these answers). */
static cJSON *pb_value(const ProtobufCFieldDescriptor *f, const void *p) {
  switch (f->type) {
  case PROTOBUF_C_TYPE_INT32:
  case PROTOBUF_C_TYPE_SINT32:
  case PROTOBUF_C_TYPE_SFIXED32: return cJSON_CreateNumber(*(const int32_t *)p);
  case PROTOBUF_C_TYPE_UINT32:
  case PROTOBUF_C_TYPE_FIXED32: return cJSON_CreateNumber(*(const uint32_t *)p);
  case PROTOBUF_C_TYPE_INT64:
  case PROTOBUF_C_TYPE_SINT64:
  case PROTOBUF_C_TYPE_SFIXED64: return cJSON_CreateNumber((double)*(const int64_t *)p);
  case PROTOBUF_C_TYPE_UINT64:
  case PROTOBUF_C_TYPE_FIXED64: return cJSON_CreateNumber((double)*(const uint64_t *)p);
  case PROTOBUF_C_TYPE_FLOAT: return cJSON_CreateNumber(*(const float *)p);
  case PROTOBUF_C_TYPE_DOUBLE: return cJSON_CreateNumber(*(const double *)p);
  case PROTOBUF_C_TYPE_BOOL: return cJSON_CreateBool(*(const protobuf_c_boolean *)p);
  case PROTOBUF_C_TYPE_ENUM: {
    const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(f->descriptor, *(const int *)p);
    return v ? cJSON_CreateString(v->name) : cJSON_CreateNumber(*(const int *)p);
  }
  case PROTOBUF_C_TYPE_STRING: return cJSON_CreateString(*(char *const *)p ? *(char *const *)p : "");
  case PROTOBUF_C_TYPE_MESSAGE: return pb_json(*(ProtobufCMessage *const *)p);
  default: return NULL;
  }
}

static size_t pb_size(const ProtobufCFieldDescriptor *f) {
  switch (f->type) {
  case PROTOBUF_C_TYPE_INT64:
  case PROTOBUF_C_TYPE_SINT64:
  case PROTOBUF_C_TYPE_SFIXED64:
  case PROTOBUF_C_TYPE_UINT64:
  case PROTOBUF_C_TYPE_FIXED64:
  case PROTOBUF_C_TYPE_DOUBLE: return 8;
  case PROTOBUF_C_TYPE_STRING:
  case PROTOBUF_C_TYPE_MESSAGE: return sizeof(void *);
  case PROTOBUF_C_TYPE_BYTES: return sizeof(ProtobufCBinaryData);
  case PROTOBUF_C_TYPE_BOOL: return sizeof(protobuf_c_boolean);
  default: return 4;
  }
}

/* A message as Triton's REST JSON writes it: proto field names, enums by
 * name, maps as objects, every field present (zero values too, as
 * Triton's statistics and config answers show them), oneofs by the member
 * set. Large integers lose precision past 2^53 (JSON numbers). */
static cJSON *pb_json(const ProtobufCMessage *m) {
  if (!m) return cJSON_CreateNull();
  const ProtobufCMessageDescriptor *d = m->descriptor;
  cJSON *o = cJSON_CreateObject();
  for (unsigned i = 0; o && i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    const char *at = (const char *)m + f->offset;
    cJSON *v = NULL;
    if (f->type == PROTOBUF_C_TYPE_BYTES) continue;
    if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
      if (*(const uint32_t *)((const char *)m + f->quantifier_offset) != f->id) continue;
      v = pb_value(f, at);
    } else if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t n = *(const size_t *)((const char *)m + f->quantifier_offset);
      const char *arr = *(char *const *)at;
      bool map = f->type == PROTOBUF_C_TYPE_MESSAGE && is_map_entry(f->descriptor);
      v = map ? cJSON_CreateObject() : cJSON_CreateArray();
      for (size_t k = 0; v && k < n; k++) {
        if (map) {
          const ProtobufCMessage *e = ((ProtobufCMessage *const *)arr)[k];
          const ProtobufCMessageDescriptor *ed = e->descriptor;
          const char *key = *(char *const *)((const char *)e + ed->fields[0].offset);
          cJSON_AddItemToObject(v, key ? key : "",
                                pb_value(&ed->fields[1], (const char *)e + ed->fields[1].offset));
        } else {
          cJSON_AddItemToArray(v, pb_value(f, arr + k * pb_size(f)));
        }
      }
    } else if (f->type == PROTOBUF_C_TYPE_MESSAGE && !*(ProtobufCMessage *const *)at) {
      /* an absent sub-message is left out, except a statistics duration:
       * Triton's REST statistics carry every one (cache_hit, cache_miss at
       * zero included), and clients index them without checking */
      if (f->descriptor != &inference__statistic_duration__descriptor) continue;
      const Inference__StatisticDuration zero = INFERENCE__STATISTIC_DURATION__INIT;
      v = pb_json(&zero.base);
    } else {
      v = pb_value(f, at);
    }
    if (v) cJSON_AddItemToObject(o, f->name, v);
  }
  return o;
}

/* ---- tensors in JSON -------------------------------------------------------------------- */

/* Element k of a tensor of type t at p, as a JSON number. */
static double elem_get(const moed_kserve_type *t, const uint8_t *p, size_t k) {
  switch (t->dtype) {
  case MOE_F32: {
    float f;
    memcpy(&f, p + 4 * k, 4);
    return f;
  }
  case MOE_F16:
  case MOE_BF16: {
    uint16_t h;
    memcpy(&h, p + 2 * k, 2);
    return t->dtype == MOE_F16 ? moe_f16_to_f32(h) : moe_bf16_to_f32(h);
  }
  case MOE_INT32: {
    int32_t v;
    memcpy(&v, p + 4 * k, 4);
    return v;
  }
  case MOE_INT8: return (int8_t)p[k];
  default: return p[k];
  }
}

/* Stores v as element k; false when the type cannot hold it. */
static bool elem_set(const moed_kserve_type *t, uint8_t *p, size_t k, double v) {
  switch (t->dtype) {
  case MOE_F32: {
    float f = (float)v;
    memcpy(p + 4 * k, &f, 4);
    return true;
  }
  case MOE_F16:
  case MOE_BF16: {
    uint16_t h = t->dtype == MOE_F16 ? moe_f32_to_f16((float)v) : moe_f32_to_bf16((float)v);
    memcpy(p + 2 * k, &h, 2);
    return true;
  }
  case MOE_INT32: {
    if (v != floor(v) || v < INT32_MIN || v > INT32_MAX) return false;
    int32_t x = (int32_t)v;
    memcpy(p + 4 * k, &x, 4);
    return true;
  }
  case MOE_INT8:
    if (v != floor(v) || v < -128 || v > 127) return false;
    p[k] = (uint8_t)(int8_t)v;
    return true;
  default:
    if (v != floor(v) || v < 0 || v > 255) return false;
    p[k] = (uint8_t)v;
    return true;
  }
}

typedef struct json_fill {
  const moed_kserve_type *t;
  uint8_t *p;
  size_t n, numel;
  bool bad; /* an element that is not a number of the type */
} json_fill;

/* Flattens `data` (row-major, nested arrays or flat, as Triton takes it);
 * elements past numel are counted, not stored. */
static void fill(json_fill *f, const cJSON *a) {
  for (const cJSON *e = a->child; e && !f->bad; e = e->next) {
    if (cJSON_IsArray(e)) {
      fill(f, e);
      continue;
    }
    double v;
    if (cJSON_IsNumber(e))
      v = e->valuedouble;
    else if (!moed_json_nonfinite_value(e, &v)) {
      f->bad = true;
      return;
    }
    if (f->n < f->numel && !elem_set(f->t, f->p, f->n, v)) {
      f->bad = true;
      return;
    }
    f->n++;
  }
}

/* ---- inference ------------------------------------------------------------------------------ */

/* cJSON holds a parsed number in a ~64-byte node: a JSON document costs up to
 * ~30x its text in memory. The JSON part of a request and the JSON data of
 * an answer are bounded so; large tensors travel binary. */
#define MAX_JSON_BYTES ((size_t)16 << 20)
#define MAX_JSON_ELEMENTS ((size_t)1 << 22)

typedef struct infer_build {
  Inference__ModelInferRequest m;
  Inference__ModelInferRequest__InferInputTensor in[MOED_MAX_TENSORS], *pin[MOED_MAX_TENSORS];
  Inference__ModelInferRequest__InferRequestedOutputTensor out[MOED_MAX_TENSORS], *pout[MOED_MAX_TENSORS];
  int64_t shapes[MOED_MAX_TENSORS][MOE_MAX_DIMS];
  ProtobufCBinaryData raw[MOED_MAX_TENSORS];
  bool in_shm[MOED_MAX_TENSORS]; /* names a shared-memory region: no raw contents */
  void *owned[MOED_MAX_TENSORS]; /* JSON data converted */
  /* tensors' shared-memory parameters (3 each), inputs then outputs */
  Inference__InferParameter tv[2][MOED_MAX_TENSORS][3];
  Inference__ModelInferRequest__InferInputTensor__ParametersEntry ie[MOED_MAX_TENSORS][3],
      *pie[MOED_MAX_TENSORS][3];
  Inference__ModelInferRequest__InferRequestedOutputTensor__ParametersEntry oe[MOED_MAX_TENSORS][3],
      *poe[MOED_MAX_TENSORS][3];
  Inference__InferParameter pv[64];
  Inference__ModelInferRequest__ParametersEntry pe[64], *ppe[64];
  char err[MOED_ERR_LEN];
} infer_build;

#define bad(b, ...) (snprintf((b)->err, sizeof(b)->err, __VA_ARGS__), false)

/* Request parameters (Triton's JSON: bool, number or string values), less
 * the binary extension's own `binary_data_output`. */
static bool build_params(infer_build *b, const cJSON *params, rest_call *k) {
  if (!params) return true;
  if (!cJSON_IsObject(params)) return bad(b, "parameters: not a JSON object");
  size_t n = 0;
  for (const cJSON *e = params->child; e; e = e->next) {
    if (!strcmp(e->string, "binary_data_output")) {
      if (!cJSON_IsBool(e)) return bad(b, "parameters.binary_data_output: not a boolean");
      k->binary_default = cJSON_IsTrue(e);
      continue;
    }
    if (n == sizeof b->pv / sizeof b->pv[0]) return bad(b, "parameters: more than %zu", n);
    Inference__InferParameter *v = &b->pv[n];
    inference__infer_parameter__init(v);
    if (cJSON_IsBool(e)) {
      v->parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_BOOL_PARAM;
      v->bool_param = cJSON_IsTrue(e);
    } else if (cJSON_IsString(e)) {
      v->parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM;
      v->string_param = e->valuestring;
    } else if (cJSON_IsNumber(e) && e->valuedouble == floor(e->valuedouble) &&
               fabs(e->valuedouble) < 9.0e18) {
      v->parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_INT64_PARAM;
      v->int64_param = (int64_t)e->valuedouble;
    } else if (cJSON_IsNumber(e)) {
      v->parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_DOUBLE_PARAM;
      v->double_param = e->valuedouble;
    } else {
      return bad(b, "parameters.%s: not a boolean, number or string", e->string);
    }
    inference__model_infer_request__parameters_entry__init(&b->pe[n]);
    b->pe[n].key = e->string;
    b->pe[n].value = v;
    b->ppe[n] = &b->pe[n];
    n++;
  }
  b->m.n_parameters = n;
  b->m.parameters = b->ppe;
  return true;
}

/* A tensor's parameter e when it is one of Triton's shared-memory three,
 * into v as the gRPC request carries it (infer_shm.c checks the values:
 * anything but a string or an integer is left empty, for it to name). */
static bool shm_param(const cJSON *e, Inference__InferParameter *v) {
  if (strcmp(e->string, "shared_memory_region") != 0 && strcmp(e->string, "shared_memory_offset") != 0 &&
      strcmp(e->string, "shared_memory_byte_size") != 0)
    return false;
  inference__infer_parameter__init(v);
  if (cJSON_IsString(e)) {
    v->parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM;
    v->string_param = e->valuestring;
  } else if (cJSON_IsNumber(e) && e->valuedouble == floor(e->valuedouble) && fabs(e->valuedouble) < 9.0e18) {
    v->parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_INT64_PARAM;
    v->int64_param = (int64_t)e->valuedouble;
  }
  return true;
}

/* inputs[i]: name, datatype, shape, and its data (JSON `data`, or
 * `binary_data_size` bytes of the binary part at *bin_at). */
static bool build_input(infer_build *b, const moed_config *cfg, size_t i, const cJSON *t, const char *bin,
                        size_t bin_len, size_t *bin_at) {
  Inference__ModelInferRequest__InferInputTensor *in = &b->in[i];
  inference__model_infer_request__infer_input_tensor__init(in);
  const cJSON *name = cJSON_GetObjectItemCaseSensitive(t, "name");
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(t, "datatype");
  const cJSON *shape = cJSON_GetObjectItemCaseSensitive(t, "shape");
  const cJSON *data = cJSON_GetObjectItemCaseSensitive(t, "data");
  const cJSON *params = cJSON_GetObjectItemCaseSensitive(t, "parameters");
  if (!cJSON_IsObject(t)) return bad(b, "inputs[%zu]: not a JSON object", i);
  if (!cJSON_IsString(name)) return bad(b, "inputs[%zu].name: missing or not a string", i);
  const char *nm = name->valuestring;
  if (!cJSON_IsString(dt)) return bad(b, "inputs[%zu] '%s': datatype missing or not a string", i, nm);
  if (!cJSON_IsArray(shape)) return bad(b, "inputs[%zu] '%s': shape missing or not an array", i, nm);
  in->name = (char *)nm;
  in->datatype = dt->valuestring;
  size_t rank = 0, numel = 1;
  for (const cJSON *e = shape->child; e; e = e->next, rank++) {
    if (rank == MOE_MAX_DIMS) return bad(b, "inputs[%zu] '%s': rank exceeds %d", i, nm, MOE_MAX_DIMS);
    if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || e->valuedouble < 0 ||
        e->valuedouble > (double)INT64_MAX / 2)
      return bad(b, "inputs[%zu] '%s': shape[%zu] is not a non-negative integer", i, nm, rank);
    b->shapes[i][rank] = (int64_t)e->valuedouble;
    if (!moe_mul_size(numel, (size_t)b->shapes[i][rank], &numel))
      return bad(b, "inputs[%zu] '%s': shape overflows", i, nm);
  }
  in->shape = b->shapes[i];
  in->n_shape = rank;
  const cJSON *bsize = params ? cJSON_GetObjectItemCaseSensitive(params, "binary_data_size") : NULL;
  if (params && !cJSON_IsObject(params)) return bad(b, "inputs[%zu] '%s': parameters: not an object", i, nm);
  size_t np = 0;
  for (const cJSON *e = params ? params->child : NULL; e; e = e->next) {
    if (np < 3 && shm_param(e, &b->tv[0][i][np])) {
      inference__model_infer_request__infer_input_tensor__parameters_entry__init(&b->ie[i][np]);
      b->ie[i][np].key = e->string;
      b->ie[i][np].value = &b->tv[0][i][np];
      b->pie[i][np] = &b->ie[i][np];
      np++;
    } else if (strcmp(e->string, "binary_data_size") != 0) {
      return bad(b,
                 "inputs[%zu] '%s': parameters.%s is not supported (binary_data_size and the "
                 "shared_memory_* ones are)",
                 i, nm, e->string);
    }
  }
  in->n_parameters = np;
  in->parameters = b->pie[i];
  if (params && cJSON_GetObjectItemCaseSensitive(params, "shared_memory_region")) {
    if (data || bsize)
      return bad(b, "inputs[%zu] '%s': data given with parameters.shared_memory_region", i, nm);
    b->in_shm[i] = true; /* its bytes are in the region */
    return true;
  }
  if (bsize) {
    if (data) return bad(b, "inputs[%zu] '%s': both data and parameters.binary_data_size", i, nm);
    if (!cJSON_IsNumber(bsize) || bsize->valuedouble < 0 || bsize->valuedouble != floor(bsize->valuedouble))
      return bad(b, "inputs[%zu] '%s': parameters.binary_data_size is not a non-negative integer", i, nm);
    double want = bsize->valuedouble;
    if (want > (double)(bin_len - *bin_at))
      return bad(b,
                 "inputs[%zu] '%s': parameters.binary_data_size %.0f runs past the end of the request body "
                 "(%zu bytes of binary data left)",
                 i, nm, want, bin_len - *bin_at);
    b->raw[i].data = (uint8_t *)bin + *bin_at;
    b->raw[i].len = (size_t)want;
    *bin_at += (size_t)want;
    return true;
  }
  if (!cJSON_IsArray(data))
    return bad(b, "inputs[%zu] '%s': no data (a JSON array, or parameters.binary_data_size)", i, nm);
  const moed_kserve_type *kt = moed_kserve_by_name(dt->valuestring);
  if (!kt)
    return bad(b,
               "inputs[%zu] '%s': datatype '%.32s' is not one moed takes (FP32, FP16, BF16, UINT8, INT8, "
               "INT32)",
               i, nm, dt->valuestring);
  size_t bytes;
  if (!moe_mul_size(numel, kt->size, &bytes) || bytes > cfg->max_tensor_bytes)
    return bad(b, "inputs[%zu] '%s': %zu elements exceed the limit of %zu bytes", i, nm, numel,
               cfg->max_tensor_bytes);
  json_fill f = {kt, malloc(bytes ? bytes : 1), 0, numel, false};
  if (!f.p) return bad(b, "server out of memory");
  b->owned[i] = f.p;
  fill(&f, data);
  if (f.bad) return bad(b, "inputs[%zu] '%s': data[%zu] is not a %s value", i, nm, f.n, dt->valuestring);
  if (f.n != numel)
    return bad(b, "inputs[%zu] '%s': data has %zu elements, shape needs %zu", i, nm, f.n, numel);
  b->raw[i].data = f.p;
  b->raw[i].len = bytes;
  return true;
}

/* outputs[i]: a name, and whether it comes back binary. */
static bool build_output(infer_build *b, size_t i, const cJSON *t, rest_call *k) {
  const cJSON *name = cJSON_GetObjectItemCaseSensitive(t, "name");
  const cJSON *params = cJSON_GetObjectItemCaseSensitive(t, "parameters");
  if (!cJSON_IsString(name)) return bad(b, "outputs[%zu].name: missing or not a string", i);
  if (params && !cJSON_IsObject(params))
    return bad(b, "outputs[%zu] '%s': parameters: not an object", i, name->valuestring);
  bool binary = k->binary_default;
  size_t np = 0;
  for (const cJSON *e = params ? params->child : NULL; e; e = e->next) {
    if (np < 3 && shm_param(e, &b->tv[1][i][np])) {
      inference__model_infer_request__infer_requested_output_tensor__parameters_entry__init(&b->oe[i][np]);
      b->oe[i][np].key = e->string;
      b->oe[i][np].value = &b->tv[1][i][np];
      b->poe[i][np] = &b->oe[i][np];
      np++;
      continue;
    }
    if (!strcmp(e->string, "binary_data") && !cJSON_IsBool(e))
      return bad(b, "outputs[%zu] '%s': parameters.binary_data: not a boolean", i, name->valuestring);
    if (strcmp(e->string, "binary_data") != 0)
      return bad(b,
                 "outputs[%zu] '%s': parameters.%s is not supported (binary_data, a boolean, and the "
                 "shared_memory_* ones are)",
                 i, name->valuestring, e->string);
    binary = cJSON_IsTrue(e);
  }
  inference__model_infer_request__infer_requested_output_tensor__init(&b->out[i]);
  b->out[i].name = name->valuestring;
  b->out[i].n_parameters = np;
  b->out[i].parameters = b->poe[i];
  k->out_shm[i] = params && cJSON_GetObjectItemCaseSensitive(params, "shared_memory_region");
  b->pout[i] = &b->out[i];
  snprintf(k->out_name[i], sizeof k->out_name[i], "%s", name->valuestring);
  k->out_binary[i] = binary;
  k->n_out = i + 1;
  return true;
}

static bool build_infer(infer_build *b, const moed_config *cfg, const cJSON *j, const char *model,
                        const char *version, const char *bin, size_t bin_len, rest_call *k) {
  if (!cJSON_IsObject(j)) return bad(b, "request: not a JSON object");
  inference__model_infer_request__init(&b->m);
  b->m.model_name = (char *)model;
  b->m.model_version = (char *)version;
  const cJSON *id = cJSON_GetObjectItemCaseSensitive(j, "id");
  if (id && !cJSON_IsString(id)) return bad(b, "id: not a string");
  if (id) b->m.id = id->valuestring;
  if (!build_params(b, cJSON_GetObjectItemCaseSensitive(j, "parameters"), k)) return false;
  const cJSON *ins = cJSON_GetObjectItemCaseSensitive(j, "inputs");
  const cJSON *outs = cJSON_GetObjectItemCaseSensitive(j, "outputs");
  if (!cJSON_IsArray(ins)) return bad(b, "inputs: missing or not an array");
  if (outs && !cJSON_IsArray(outs)) return bad(b, "outputs: not an array");
  size_t n = 0, bin_at = 0;
  for (const cJSON *t = ins->child; t; t = t->next, n++) {
    if (n == MOED_MAX_TENSORS) return bad(b, "inputs: more than %d", MOED_MAX_TENSORS);
    if (!build_input(b, cfg, n, t, bin, bin_len, &bin_at)) return false;
    b->pin[n] = &b->in[n];
  }
  if (bin_at != bin_len)
    return bad(b, "binary data: %zu bytes follow the JSON header, the inputs' binary_data_size take %zu",
               bin_len, bin_at);
  b->m.inputs = b->pin;
  b->m.n_inputs = n;
  /* raw contents for the inputs not in shared memory, in order (as gRPC clients send them) */
  size_t n_raw = 0;
  for (size_t i = 0; i < n; i++)
    if (!b->in_shm[i]) b->raw[n_raw++] = b->raw[i];
  b->m.raw_input_contents = b->raw;
  b->m.n_raw_input_contents = n_raw;
  n = 0;
  for (const cJSON *t = outs ? outs->child : NULL; t; t = t->next, n++) {
    if (n == MOED_MAX_TENSORS) return bad(b, "outputs: more than %d", MOED_MAX_TENSORS);
    if (!build_output(b, n, t, k)) return false;
  }
  b->m.outputs = b->pout;
  b->m.n_outputs = n;
  return true;
}

/* The ModelInferRequest of a REST infer body: body[0..len) is the JSON
 * header (hlen bytes, Inference-Header-Content-Length; -1: all of it; -2:
 * that header was not a number) and then the inputs' binary data. NULL
 * when refused: *code the HTTP status, why[MOED_ERR_LEN] the message. k
 * learns which outputs go back as binary. */
static grpc_byte_buffer *infer_message(const moed_config *cfg, const char *body, size_t len, int64_t hlen,
                                       const char *model, const char *version, rest_call *k, int *code,
                                       char *why) {
  size_t json_len = len;
  *code = 400;
  if (hlen == -2) {
    moed_failf(why, 0, "Inference-Header-Content-Length: not a non-negative integer");
    return NULL;
  }
  if (hlen >= 0) {
    if ((uint64_t)hlen > len) {
      moed_failf(why, 0, "Inference-Header-Content-Length: larger than the request body");
      return NULL;
    }
    json_len = (size_t)hlen;
  }
  if (!body || json_len == 0) {
    moed_failf(why, 0, "request: no JSON body");
    return NULL;
  }
  if (json_len > MAX_JSON_BYTES) {
    *code = 413;
    moed_failf(
        why, 0,
        "request: its JSON is %zu bytes, over %zu: send large tensors as binary data (binary_data_size)",
        json_len, (size_t)MAX_JSON_BYTES);
    return NULL;
  }
  const size_t nul = moed_json_nul_at(body, json_len);
  if (nul < json_len) {
    moed_failf(why, 0, "request: a NUL in a JSON string at byte %zu (it would cut the string short)", nul);
    return NULL;
  }
  bool oom;
  char *nonfinite = moed_json_nonfinite_in(body, json_len, &oom); /* NaN, Infinity as Python writes them */
  if (oom) {
    *code = 500;
    moed_failf(why, 0, "server out of memory");
    return NULL;
  }
  const char *text = nonfinite ? nonfinite : body;
  cJSON *j = cJSON_ParseWithLength(text, json_len);
  if (!j) {
    const char *at = cJSON_GetErrorPtr();
    const size_t off = at && at >= text && at <= text + json_len ? (size_t)(at - text) : 0;
    free(nonfinite);
    moed_failf(why, 0, "request: malformed JSON at byte %zu", off);
    return NULL;
  }
  free(nonfinite); /* cJSON holds copies of what it keeps */
  infer_build *b = calloc(1, sizeof *b);
  grpc_byte_buffer *payload = NULL;
  if (!b) {
    *code = 500;
    moed_failf(why, 0, "server out of memory");
  } else if (!build_infer(b, cfg, j, model, version, body + json_len, len - json_len, k)) {
    moed_failf(why, 0, "%s", b->err);
  } else if (!(payload = moed_rpc_pack(&b->m.base))) {
    *code = 500;
    moed_failf(why, 0, "server out of memory");
  }
  for (size_t i = 0; b && i < MOED_MAX_TENSORS; i++)
    free(b->owned[i]);
  free(b);
  cJSON_Delete(j);
  return payload;
}

grpc_byte_buffer *moed_rest_infer_message(const moed_config *cfg, const char *body, size_t len, int64_t hlen,
                                          const char *model, int *code, char *why) {
  rest_call *k = calloc(1, sizeof *k);
  *code = 500;
  if (!k) return NULL;
  grpc_byte_buffer *m = infer_message(cfg, body, len, hlen, model, "", k, code, why);
  free(k);
  return m;
}

static void infer(moed_rest *r, moed_http_conn *c, moed_http_request *rq, const char *model,
                  const char *version) {
  char peer[320];
  if (!allowed(c, rq, MOED_M_MODEL_INFER, peer)) return;
  rest_call *k = calloc(1, sizeof *k);
  if (!k) return moed_http_respond_error(c, 500, "server out of memory");
  char why[MOED_ERR_LEN];
  int code;
  grpc_byte_buffer *payload = infer_message(r->srv->cfg, rq->body, rq->body_len, rq->inference_header_length,
                                            model, version, k, &code, why);
  if (!payload) {
    free(k);
    return moed_http_respond_error(c, code, why);
  }
  free(rq->body); /* the message holds its own copy now: one at a time in memory */
  rq->body = NULL;
  rq->body_len = 0;
  submit(r, c, rq, MOED_M_MODEL_INFER, payload, k);
}

static bool output_binary(const rest_call *k, const char *name) {
  for (size_t i = 0; i < k->n_out; i++)
    if (!strcmp(k->out_name[i], name)) return k->out_binary[i];
  return k->binary_default;
}

static bool output_shm(const rest_call *k, const char *name) {
  for (size_t i = 0; i < k->n_out; i++)
    if (!strcmp(k->out_name[i], name)) return k->out_shm[i];
  return false;
}

/* The ModelInferResponse as JSON, each output's data in it or (binary)
 * after it, in output order. */
static void answer_infer(rest_call *k, const Inference__ModelInferResponse *m) {
  size_t json_elements = 0;
  for (size_t i = 0; i < m->n_outputs && i < m->n_raw_output_contents; i++) {
    const moed_kserve_type *kt = moed_kserve_by_name(m->outputs[i]->datatype);
    if (kt && !output_binary(k, m->outputs[i]->name))
      json_elements += m->raw_output_contents[i].len / kt->size;
  }
  if (json_elements > MAX_JSON_ELEMENTS) {
    char why[240];
    snprintf(why, sizeof why, "outputs: %zu elements as JSON, over %zu: ask for them binary (binary_data)",
             json_elements, MAX_JSON_ELEMENTS);
    return moed_http_respond_error(k->c, 413, why);
  }
  cJSON *j = cJSON_CreateObject(), *outs = cJSON_CreateArray();
  size_t bin_len = 0;
  bool ok = j && outs;
  if (ok) {
    cJSON_AddStringToObject(j, "model_name", m->model_name ? m->model_name : "");
    cJSON_AddStringToObject(j, "model_version", m->model_version ? m->model_version : "");
    if (m->id && *m->id) cJSON_AddStringToObject(j, "id", m->id);
  }
  for (size_t i = 0; ok && i < m->n_outputs; i++) {
    const Inference__ModelInferResponse__InferOutputTensor *t = m->outputs[i];
    const ProtobufCBinaryData *raw = i < m->n_raw_output_contents ? &m->raw_output_contents[i] : NULL;
    const moed_kserve_type *kt = moed_kserve_by_name(t->datatype);
    cJSON *o = cJSON_CreateObject(), *shape = cJSON_CreateArray();
    ok = o && shape && raw;
    if (!ok) {
      cJSON_Delete(o);
      cJSON_Delete(shape);
      break;
    }
    cJSON_AddStringToObject(o, "name", t->name);
    cJSON_AddStringToObject(o, "datatype", t->datatype);
    for (size_t d = 0; d < t->n_shape; d++)
      cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t->shape[d]));
    cJSON_AddItemToObject(o, "shape", shape);
    if (output_shm(k, t->name)) {
      /* its bytes are in the region it named: the metadata alone, as Triton answers */
    } else if (output_binary(k, t->name) || !kt) {
      cJSON *p = cJSON_AddObjectToObject(o, "parameters");
      cJSON_AddNumberToObject(p, "binary_data_size", (double)raw->len);
      bin_len += raw->len;
    } else {
      cJSON *data = cJSON_AddArrayToObject(o, "data");
      for (size_t e = 0; data && e < raw->len / kt->size; e++)
        cJSON_AddItemToArray(data, moed_json_float(elem_get(kt, raw->data, e)));
    }
    cJSON_AddItemToArray(outs, o);
  }
  cJSON_AddItemToObject(j, "outputs", outs);
  char *text = ok ? cJSON_PrintUnformatted(j) : NULL;
  cJSON_Delete(j);
  size_t tl = text ? strlen(text) : 0;
  /* uv_buf_t lengths are 32-bit; outputs are bounded by --max-message-bytes (< 2 GiB) */
  char *body = text && tl < UINT32_MAX - bin_len ? realloc(text, tl + bin_len + 1) : NULL;
  if (!body) {
    free(text);
    return moed_http_respond_error(k->c, 500, "server out of memory");
  }
  size_t at = tl;
  for (size_t i = 0; i < m->n_outputs; i++)
    if (!output_shm(k, m->outputs[i]->name) &&
        (output_binary(k, m->outputs[i]->name) || !moed_kserve_by_name(m->outputs[i]->datatype))) {
      memcpy(body + at, m->raw_output_contents[i].data, m->raw_output_contents[i].len);
      at += m->raw_output_contents[i].len;
    }
  char extra[96];
  snprintf(extra, sizeof extra, "Inference-Header-Content-Length: %zu\r\n", tl);
  uv_buf_t ub = uv_buf_init(body, (unsigned)at);
  moed_http_respond(k->c, 200, bin_len ? "application/octet-stream" : "application/json",
                    bin_len ? extra : NULL, &ub, 1, free, body);
}

/* ---- answers ------------------------------------------------------------------------------ */

static void respond_json(moed_http_conn *c, cJSON *j) {
  char *s = j ? cJSON_PrintUnformatted(j) : NULL;
  cJSON_Delete(j);
  if (!s) return moed_http_respond_error(c, 500, "server out of memory");
  uv_buf_t b = uv_buf_init(s, (unsigned)strlen(s));
  moed_http_respond(c, 200, "application/json", NULL, &b, 1, free, s);
}

static const ProtobufCMessageDescriptor *response_descriptor(moed_method m) {
  switch (m) {
  case MOED_M_SERVER_LIVE: return &inference__server_live_response__descriptor;
  case MOED_M_SERVER_READY: return &inference__server_ready_response__descriptor;
  case MOED_M_MODEL_READY: return &inference__model_ready_response__descriptor;
  case MOED_M_SERVER_METADATA: return &inference__server_metadata_response__descriptor;
  case MOED_M_MODEL_METADATA: return &inference__model_metadata_response__descriptor;
  case MOED_M_MODEL_CONFIG: return &inference__model_config_response__descriptor;
  case MOED_M_MODEL_STATISTICS: return &inference__model_statistics_response__descriptor;
  case MOED_M_REPOSITORY_INDEX: return &inference__repository_index_response__descriptor;
  case MOED_M_MODEL_INFER: return &inference__model_infer_response__descriptor;
  case MOED_M_SHM_STATUS: return &inference__system_shared_memory_status_response__descriptor;
  case MOED_M_CUDA_SHM_STATUS: return &inference__cuda_shared_memory_status_response__descriptor;
  default: return NULL; /* load, unload, shared-memory changes: nothing to say */
  }
}

/* A finished call's answer, on the loop. */
static void answer(rest_call *k) {
  moed_http_conn *c = k->c;
  if (k->code != GRPC_STATUS_OK)
    return moed_http_respond_error(c, moed_http_status_from_grpc(k->code), k->msg ? k->msg : "failed");
  const ProtobufCMessageDescriptor *d = response_descriptor(k->method);
  if (!d) return moed_http_respond_copy(c, 200, "application/json", "", 0);
  grpc_slice s = moed_rpc_flatten(k->resp);
  ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
  grpc_slice_unref(s);
  if (!m) return moed_http_respond_error(c, 500, "server out of memory");
  switch (k->method) {
  case MOED_M_SERVER_LIVE:
  case MOED_M_SERVER_READY:
  case MOED_M_MODEL_READY: { /* KServe: 200 true, 4xx false; the three answers' one field is the bool */
    bool yes = k->method == MOED_M_SERVER_LIVE    ? ((Inference__ServerLiveResponse *)m)->live
               : k->method == MOED_M_SERVER_READY ? ((Inference__ServerReadyResponse *)m)->ready
                                                  : ((Inference__ModelReadyResponse *)m)->ready;
    char why[240];
    snprintf(why, sizeof why, "model %s is not ready (not loaded, no such model or version, or draining)",
             k->model);
    if (yes)
      moed_http_respond_copy(c, 200, "text/plain", "", 0);
    else
      moed_http_respond_error(c, 400, k->method == MOED_M_MODEL_READY ? why : "server not ready");
    break;
  }
  case MOED_M_MODEL_CONFIG: /* Triton answers the config itself */
    respond_json(c, pb_json(&((Inference__ModelConfigResponse *)m)->config->base));
    break;
  case MOED_M_REPOSITORY_INDEX: { /* Triton answers the list itself */
    cJSON *j = pb_json(m), *models = cJSON_DetachItemFromObject(j, "models");
    cJSON_Delete(j);
    respond_json(c, models);
    break;
  }
  case MOED_M_MODEL_INFER: answer_infer(k, (Inference__ModelInferResponse *)m); break;
  case MOED_M_SHM_STATUS:
  case MOED_M_CUDA_SHM_STATUS: { /* Triton answers a list of the regions, not the map */
    cJSON *j = pb_json(m), *map = cJSON_GetObjectItemCaseSensitive(j, "regions"), *list = cJSON_CreateArray();
    for (cJSON *e = map ? map->child : NULL; list && e;) {
      cJSON *next = e->next;
      cJSON_AddItemToArray(list, cJSON_DetachItemViaPointer(map, e));
      e = next;
    }
    cJSON_Delete(j);
    respond_json(c, list);
    break;
  }
  default: respond_json(c, pb_json(m)); break;
  }
  protobuf_c_message_free_unpacked(m, NULL);
}

static void on_async(uv_async_t *h) {
  moed_rest *r = h->data;
  pthread_mutex_lock(&r->mu);
  rest_call *k = r->q_head;
  r->q_head = r->q_tail = NULL;
  pthread_mutex_unlock(&r->mu);
  while (k) {
    rest_call *next = k->next;
    if (k->c) answer(k);
    pthread_mutex_lock(&r->mu);
    r->outstanding--;
    pthread_mutex_unlock(&r->mu);
    call_free(k);
    k = next;
  }
}

static void no_endpoint(moed_http_conn *c, const char *path) {
  char why[sizeof((moed_http_request *)0)->path + 32];
  snprintf(why, sizeof why, "no such endpoint: %s", path);
  moed_http_respond_error(c, 404, why);
}

/* ---- routes ---------------------------------------------------------------------------------- */

/* The path's segments into seg[0..n), cut in place; n, or max + 1 when there are more. */
static size_t split_path(char *p, char **seg, size_t max) {
  size_t n = 0;
  char *save = NULL;
  for (char *s = strtok_r(p, "/", &save); s; s = strtok_r(NULL, "/", &save)) {
    if (n == max) return max + 1; /* deeper than any endpoint */
    seg[n++] = s;
  }
  return n;
}

/* Decodes a path segment's percent-encoding (RFC 3986 2.1) in place, as
 * tritonclient.http quotes model names in its paths and Triton decodes them;
 * the name is then checked by the same rule as on gRPC (a decoded '/', quote
 * or newline is refused there, naming the field). NULL, or why not: a '%'
 * without two hex digits, or a %00 that would cut the C string short. */
static const char *pct_decode(char *s) {
  char *w = s;
  for (const char *r = s; *r; r++) {
    if (*r != '%') {
      *w++ = *r;
      continue;
    }
    if (!isxdigit((unsigned char)r[1]) || !isxdigit((unsigned char)r[2]))
      return "'%' not followed by two hex digits";
    const char hex[3] = {r[1], r[2], 0};
    const long v = strtol(hex, NULL, 16);
    if (v == 0) return "%00 (NUL)";
    *w++ = (char)v;
    r += 2;
  }
  *w = 0;
  return NULL;
}

/* The optional JSON body of a repository call, as an object (NULL: none).
 * false: answered 400. */
static bool body_object(moed_http_conn *c, const moed_http_request *rq, cJSON **out) {
  *out = NULL;
  if (!rq->body || !rq->body_len) return true;
  const size_t nul = moed_json_nul_at(rq->body, rq->body_len);
  if (nul < rq->body_len) {
    char why[96];
    snprintf(why, sizeof why, "request: a NUL in a JSON string at byte %zu (it would cut the string short)",
             nul);
    moed_http_respond_error(c, 400, why);
    return false;
  }
  *out = cJSON_ParseWithLength(rq->body, rq->body_len);
  if (!cJSON_IsObject(*out)) {
    cJSON_Delete(*out);
    moed_http_respond_error(c, 400, "request: malformed JSON (an object expected)");
    return false;
  }
  return true;
}

static void repository(moed_rest *r, moed_http_conn *c, moed_http_request *rq, const char *path, char **seg,
                       size_t n) {
  const bool index = n == 3 && !strcmp(seg[2], "index"),
             change = n == 5 && !strcmp(seg[2], "models") &&
                      (!strcmp(seg[4], "load") || !strcmp(seg[4], "unload"));
  char peer[320];
  if (!index && !change) return no_endpoint(c, path);
  if (!allowed(c, rq,
               index                     ? MOED_M_REPOSITORY_INDEX
               : !strcmp(seg[4], "load") ? MOED_M_REPOSITORY_LOAD
                                         : MOED_M_REPOSITORY_UNLOAD,
               peer))
    return;
  cJSON *j;
  if (!body_object(c, rq, &j)) return;
  const cJSON *params = cJSON_GetObjectItemCaseSensitive(j, "parameters");
  if (index) {
    const cJSON *ready = cJSON_GetObjectItemCaseSensitive(j, "ready");
    Inference__RepositoryIndexRequest m = INFERENCE__REPOSITORY_INDEX_REQUEST__INIT;
    if (ready && !cJSON_IsBool(ready)) {
      moed_http_respond_error(c, 400, "ready: not a boolean");
    } else {
      m.ready = cJSON_IsTrue(ready);
      call(r, c, rq, MOED_M_REPOSITORY_INDEX, &m.base);
    }
  } else {
    bool load = !strcmp(seg[4], "load");
    const cJSON *e = params ? params->child : NULL;
    /* unload_dependents means nothing here (no ensembles); config and files
     * overrides are not taken: moed derives every configuration */
    while (e && !load && !strcmp(e->string, "unload_dependents") && cJSON_IsBool(e))
      e = e->next;
    char why[200];
    if (params && !cJSON_IsObject(params)) {
      moed_http_respond_error(c, 400, "parameters: not a JSON object");
    } else if (e) {
      snprintf(why, sizeof why, "parameters.%.64s: not supported by moed's %s", e->string, seg[4]);
      moed_http_respond_error(c, 400, why);
    } else if (load) {
      Inference__RepositoryModelLoadRequest m = INFERENCE__REPOSITORY_MODEL_LOAD_REQUEST__INIT;
      m.model_name = seg[3];
      call(r, c, rq, MOED_M_REPOSITORY_LOAD, &m.base);
    } else {
      Inference__RepositoryModelUnloadRequest m = INFERENCE__REPOSITORY_MODEL_UNLOAD_REQUEST__INIT;
      m.model_name = seg[3];
      call(r, c, rq, MOED_M_REPOSITORY_UNLOAD, &m.base);
    }
  }
  cJSON_Delete(j);
}

/* /v2/models/NAME[/versions/V][/ACTION] */
static void model(moed_rest *r, moed_http_conn *c, moed_http_request *rq, const char *path, char **seg,
                  size_t n) {
  const char *name = seg[2], *version = "", *action = "";
  size_t at = 3;
  if (n > at + 1 && !strcmp(seg[at], "versions")) {
    version = seg[at + 1];
    at += 2;
  }
  if (n == at + 1)
    action = seg[at];
  else if (n != at)
    return no_endpoint(c, path);
  bool post = !strcmp(action, "infer");
  if (rq->method != (post ? HTTP_POST : HTTP_GET))
    return moed_http_respond_error(c, 405, post ? "infer takes POST" : "this endpoint takes GET");
  if (post) return infer(r, c, rq, name, version);
  /* the GETs on a model: each a request message of (name, version) */
  static const struct {
    const char *action;
    moed_method method;
    const ProtobufCMessageDescriptor *d;
  } gets[] = {
      {"", MOED_M_MODEL_METADATA, &inference__model_metadata_request__descriptor},
      {"ready", MOED_M_MODEL_READY, &inference__model_ready_request__descriptor},
      {"config", MOED_M_MODEL_CONFIG, &inference__model_config_request__descriptor},
      {"stats", MOED_M_MODEL_STATISTICS, &inference__model_statistics_request__descriptor},
  };
  for (size_t i = 0; i < sizeof gets / sizeof gets[0]; i++) {
    if (strcmp(action, gets[i].action)) continue;
    union {
      ProtobufCMessage base;
      Inference__ModelMetadataRequest a;
      Inference__ModelReadyRequest b;
      Inference__ModelConfigRequest c;
      Inference__ModelStatisticsRequest d;
    } m;
    protobuf_c_message_init(gets[i].d, &m);
    *(const char **)((char *)&m +
                     protobuf_c_message_descriptor_get_field_by_name(gets[i].d, "name")->offset) = name;
    *(const char **)((char *)&m +
                     protobuf_c_message_descriptor_get_field_by_name(gets[i].d, "version")->offset) = version;
    return call(r, c, rq, gets[i].method, &m.base);
  }
  no_endpoint(c, path);
}

/* A JSON number that is an integer in [0, 2^53] (exact); false otherwise. */
static bool json_u64(const cJSON *v, uint64_t *out) {
  if (!v) return true; /* absent: 0 */
  if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble != floor(v->valuedouble) ||
      v->valuedouble > 9007199254740992.0)
    return false;
  *out = (uint64_t)v->valuedouble;
  return true;
}

/* Triton's shared-memory extensions: /v2/{system,cuda}sharedmemory[/region/NAME]/status (GET),
 * .../register, .../unregister (POST), translated to the gRPC methods. */
static void shared_memory(moed_rest *r, moed_http_conn *c, moed_http_request *rq, const char *path,
                          char **seg, size_t n) {
  const bool cuda = !strcmp(seg[1], "cudasharedmemory");
  const char *name = "";
  size_t at = 2;
  if (n >= 4 && !strcmp(seg[2], "region")) {
    name = seg[3];
    at = 4;
  }
  const char *action = n == at + 1 ? seg[at] : "";
  const bool status = !strcmp(action, "status"), reg = !strcmp(action, "register") && *name,
             unreg = !strcmp(action, "unregister");
  if (!status && !reg && !unreg) return no_endpoint(c, path);
  if (rq->method != (status ? HTTP_GET : HTTP_POST))
    return moed_http_respond_error(c, 405, status ? "status takes GET" : "register and unregister take POST");
  if (status && cuda) {
    Inference__CudaSharedMemoryStatusRequest m = INFERENCE__CUDA_SHARED_MEMORY_STATUS_REQUEST__INIT;
    m.name = (char *)name;
    return call(r, c, rq, MOED_M_CUDA_SHM_STATUS, &m.base);
  }
  if (status) {
    Inference__SystemSharedMemoryStatusRequest m = INFERENCE__SYSTEM_SHARED_MEMORY_STATUS_REQUEST__INIT;
    m.name = (char *)name;
    return call(r, c, rq, MOED_M_SHM_STATUS, &m.base);
  }
  if (unreg && cuda) {
    Inference__CudaSharedMemoryUnregisterRequest m = INFERENCE__CUDA_SHARED_MEMORY_UNREGISTER_REQUEST__INIT;
    m.name = (char *)name;
    return call(r, c, rq, MOED_M_CUDA_SHM_UNREGISTER, &m.base);
  }
  if (unreg) {
    Inference__SystemSharedMemoryUnregisterRequest m =
        INFERENCE__SYSTEM_SHARED_MEMORY_UNREGISTER_REQUEST__INIT;
    m.name = (char *)name;
    return call(r, c, rq, MOED_M_SHM_UNREGISTER, &m.base);
  }
  if (cuda) { /* the handler refuses it, whatever the body */
    Inference__CudaSharedMemoryRegisterRequest m = INFERENCE__CUDA_SHARED_MEMORY_REGISTER_REQUEST__INIT;
    m.name = (char *)name;
    return call(r, c, rq, MOED_M_CUDA_SHM_REGISTER, &m.base);
  }
  char peer[320];
  if (!allowed(c, rq, MOED_M_SHM_REGISTER, peer)) return;
  cJSON *j;
  if (!body_object(c, rq, &j)) return;
  Inference__SystemSharedMemoryRegisterRequest m = INFERENCE__SYSTEM_SHARED_MEMORY_REGISTER_REQUEST__INIT;
  const cJSON *key = cJSON_GetObjectItemCaseSensitive(j, "key");
  m.name = (char *)name;
  m.key = cJSON_IsString(key) ? key->valuestring : NULL;
  if (!m.key)
    moed_http_respond_error(c, 400, "key: missing or not a string");
  else if (!json_u64(cJSON_GetObjectItemCaseSensitive(j, "offset"), &m.offset))
    moed_http_respond_error(c, 400, "offset: not a non-negative integer (at most 2^53)");
  else if (!json_u64(cJSON_GetObjectItemCaseSensitive(j, "byte_size"), &m.byte_size))
    moed_http_respond_error(c, 400, "byte_size: not a non-negative integer (at most 2^53)");
  else
    call(r, c, rq, MOED_M_SHM_REGISTER, &m.base);
  cJSON_Delete(j);
}

static void on_request(moed_http_conn *c, moed_http_request *rq, void *arg) {
  moed_rest *r = arg;
  char *seg[8], path[sizeof rq->path];
  snprintf(path, sizeof path, "%s", rq->path); /* split_path cuts rq->path */
  size_t n = split_path(rq->path, seg, 8);
  for (size_t i = 0; i < n && i < 8; i++) {
    const char *bad = pct_decode(seg[i]);
    if (bad) {
      char why[96];
      snprintf(why, sizeof why, "path: segment %zu: %s", i + 1, bad);
      return moed_http_respond_error(c, 400, why);
    }
  }
  if (n == 0 || n > 8 || strcmp(seg[0], "v2") != 0) return no_endpoint(c, path);
  bool get = rq->method == HTTP_GET;
  if (n >= 2 && !strcmp(seg[1], "repository")) {
    if (rq->method != HTTP_POST) return moed_http_respond_error(c, 405, "the repository endpoints take POST");
    return repository(r, c, rq, path, seg, n);
  }
  if (n >= 3 && !strcmp(seg[1], "models") && !(n == 3 && !strcmp(seg[2], "stats")))
    return model(r, c, rq, path, seg, n);
  if (n >= 3 && (!strcmp(seg[1], "systemsharedmemory") || !strcmp(seg[1], "cudasharedmemory")))
    return shared_memory(r, c, rq, path, seg, n);
  if (!get) return moed_http_respond_error(c, 405, "this endpoint takes GET");
  if (n == 1) {
    Inference__ServerMetadataRequest m = INFERENCE__SERVER_METADATA_REQUEST__INIT;
    call(r, c, rq, MOED_M_SERVER_METADATA, &m.base);
  } else if (n == 3 && !strcmp(seg[1], "health") && !strcmp(seg[2], "live")) {
    Inference__ServerLiveRequest m = INFERENCE__SERVER_LIVE_REQUEST__INIT;
    call(r, c, rq, MOED_M_SERVER_LIVE, &m.base);
  } else if (n == 3 && !strcmp(seg[1], "health") && !strcmp(seg[2], "ready")) {
    Inference__ServerReadyRequest m = INFERENCE__SERVER_READY_REQUEST__INIT;
    call(r, c, rq, MOED_M_SERVER_READY, &m.base);
  } else if (n == 3 && !strcmp(seg[1], "models")) { /* /v2/models/stats: every model's */
    Inference__ModelStatisticsRequest m = INFERENCE__MODEL_STATISTICS_REQUEST__INIT;
    call(r, c, rq, MOED_M_MODEL_STATISTICS, &m.base);
  } else {
    no_endpoint(c, path);
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
  if (moed_http_listen(s->loop, address, port, &o, on_request, r, &r->l, bound_port) != 0) {
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
