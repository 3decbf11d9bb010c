/* infer: ModelInfer and ModelStreamInfer requests, from the wire to an op
 * call and back, run on a device worker.
 *
 * Every size a request declares (shape, byte counts, element counts) is
 * untrusted: products are overflow-checked before anything is allocated.
 * Host-memory backends read the request's bytes in place and their outputs
 * are handed to gRPC as slices without a copy. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grpc_service.pb-c.h"
#include "moed.h"

#define MAX_INPUTS 16

/* ---- the datatype table: KServe name <-> moe dtype ---------------------------- */

typedef struct wire_type {
  const char *kserve;
  moe_dtype dtype;
  size_t size;
} wire_type;

static const wire_type wire_types[] = {
    {"FP32", MOE_F32, 4}, {"FP16", MOE_F16, 2},   {"BF16", MOE_BF16, 2},
    {"UINT8", MOE_UINT8, 1}, {"INT8", MOE_INT8, 1}, {"INT32", MOE_INT32, 4},
};

static const wire_type *wire_from_name(const char *name) {
  for (size_t i = 0; i < sizeof wire_types / sizeof wire_types[0]; i++)
    if (name && strcmp(wire_types[i].kserve, name) == 0) return &wire_types[i];
  return NULL;
}

const char *moed_kserve_datatype(moe_dtype t) {
  for (size_t i = 0; i < sizeof wire_types / sizeof wire_types[0]; i++)
    if (wire_types[i].dtype == t) return wire_types[i].kserve;
  return "UINT8"; /* narrow formats travel as bytes */
}

/* ---- one request's state ----------------------------------------------------------- */

typedef struct infer_ctx {
  moed_server *srv;
  moe_backend *b;
  Inference__ModelInferRequest *req;
  moed_model *model;
  moe_call *call;
  void *owned[MAX_INPUTS];     /* converted typed contents (host) */
  void *device_in[MAX_INPUTS]; /* device copies of inputs (non-host backends) */
  void *outputs[MAX_INPUTS];   /* output buffers (backend memory) */
  void *host_out[MAX_INPUTS];  /* host copies (non-host backends) */
  size_t num_out;
  char msg[600];
  uint64_t bytes_in, bytes_out;
} infer_ctx;

static void ctx_cleanup(infer_ctx *c) {
  for (size_t i = 0; i < MAX_INPUTS; i++) {
    free(c->owned[i]);
    if (c->device_in[i]) c->b->iface->free(c->b, c->device_in[i]);
    if (c->outputs[i]) {
      if (moed_backend_is_host(c->b))
        free(c->outputs[i]);
      else
        c->b->iface->free(c->b, c->outputs[i]);
    }
    free(c->host_out[i]);
  }
  moe_call_destroy(c->call);
  if (c->req) inference__model_infer_request__free_unpacked(c->req, NULL);
  moed_model_release(c->model);
}

static grpc_status_code fail(infer_ctx *c, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static grpc_status_code fail(infer_ctx *c, grpc_status_code code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->msg, sizeof c->msg, fmt, ap);
  va_end(ap);
  return code;
}

/* ---- decoding ---------------------------------------------------------------------- */

/* Element count and byte size of a wire-declared shape, overflow-checked. */
static grpc_status_code check_shape(infer_ctx *c, size_t i, const Inference__ModelInferRequest__InferInputTensor *t,
                                    const wire_type *wt, moe_tensor *out, size_t *numel) {
  if (t->n_shape > MOE_MAX_DIMS)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': rank %zu exceeds %d", i, t->name, t->n_shape,
                MOE_MAX_DIMS);
  size_t n = 1;
  for (size_t d = 0; d < t->n_shape; d++) {
    if (t->shape[d] < 0)
      return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': shape[%zu] = %lld is negative", i, t->name, d,
                  (long long)t->shape[d]);
    if (!moe_mul_size(n, (size_t)t->shape[d], &n) || n > (size_t)INT64_MAX)
      return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': shape overflows", i, t->name);
    out->shape[d] = t->shape[d];
  }
  size_t bytes;
  if (!moe_mul_size(n, wt->size, &bytes))
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': byte size overflows", i, t->name);
  if (bytes > c->srv->cfg->max_tensor_bytes)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': %zu bytes exceed the limit of %zu", i, t->name,
                bytes, c->srv->cfg->max_tensor_bytes);
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < t->n_shape; d++) rows *= t->shape[d]; /* <= n: no overflow */
  if (t->n_shape >= 2 && rows > c->srv->cfg->max_tokens)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': %lld rows exceed max tokens %lld", i, t->name,
                (long long)rows, (long long)c->srv->cfg->max_tokens);
  out->dtype = wt->dtype;
  out->ndim = (int32_t)t->n_shape;
  out->nbytes = bytes;
  *numel = n;
  return GRPC_STATUS_OK;
}

/* The typed `contents` of input i, converted to the storage type. */
static grpc_status_code typed_contents(infer_ctx *c, size_t i, const Inference__ModelInferRequest__InferInputTensor *t,
                                       moe_tensor *out, size_t numel) {
  const Inference__InferTensorContents *tc = t->contents;
  size_t have = 0;
  const char *field = "";
  switch (out->dtype) {
  case MOE_F32: have = tc->n_fp32_contents; field = "fp32_contents"; break;
  case MOE_INT32:
  case MOE_INT8: have = tc->n_int_contents; field = "int_contents"; break;
  case MOE_UINT8: have = tc->n_uint_contents; field = "uint_contents"; break;
  default:
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': %s has no typed contents; use raw_input_contents",
                i, t->name, t->datatype);
  }
  if (have != numel)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': contents.%s has %zu elements, shape needs %zu", i,
                t->name, field, have, numel);
  switch (out->dtype) {
  case MOE_F32: out->data = tc->fp32_contents; break; /* already fp32, in place */
  case MOE_INT32: out->data = tc->int_contents; break;
  case MOE_INT8: {
    int8_t *p = malloc(numel ? numel : 1);
    if (!p) return fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    c->owned[i] = p;
    for (size_t k = 0; k < numel; k++) {
      if (tc->int_contents[k] < -128 || tc->int_contents[k] > 127)
        return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': contents.int_contents[%zu] out of INT8 range",
                    i, t->name, k);
      p[k] = (int8_t)tc->int_contents[k];
    }
    out->data = p;
    break;
  }
  default: { /* UINT8 */
    uint8_t *p = malloc(numel ? numel : 1);
    if (!p) return fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    c->owned[i] = p;
    for (size_t k = 0; k < numel; k++) {
      if (tc->uint_contents[k] > 255)
        return fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                    "inputs[%zu] '%s': contents.uint_contents[%zu] out of UINT8 range", i, t->name, k);
      p[k] = (uint8_t)tc->uint_contents[k];
    }
    out->data = p;
    break;
  }
  }
  return GRPC_STATUS_OK;
}

static grpc_status_code decode_inputs(infer_ctx *c, moe_named_tensor *in, size_t *n_in) {
  const Inference__ModelInferRequest *r = c->req;
  if (r->n_inputs > MAX_INPUTS)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs: %zu given, at most %d", r->n_inputs, MAX_INPUTS);
  if (r->n_raw_input_contents && r->n_raw_input_contents != r->n_inputs)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "raw_input_contents: %zu given for %zu inputs",
                r->n_raw_input_contents, r->n_inputs);
  for (size_t i = 0; i < r->n_inputs; i++) {
    const Inference__ModelInferRequest__InferInputTensor *t = r->inputs[i];
    if (!t->name || !*t->name) return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu]: name is empty", i);
    const wire_type *wt = wire_from_name(t->datatype);
    if (!wt)
      return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': datatype '%s' not supported", i, t->name,
                  t->datatype);
    memset(&in[i], 0, sizeof in[i]);
    in[i].name = t->name;
    size_t numel = 0;
    grpc_status_code code = check_shape(c, i, t, wt, &in[i].tensor, &numel);
    if (code) return code;
    if (r->n_raw_input_contents) {
      const ProtobufCBinaryData *raw = &r->raw_input_contents[i];
      if (raw->len != in[i].tensor.nbytes)
        return fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                    "inputs[%zu] '%s': raw_input_contents[%zu] has %zu bytes, shape and %s need %zu", i, t->name, i,
                    raw->len, t->datatype, in[i].tensor.nbytes);
      in[i].tensor.data = raw->data;
    } else if (t->contents) {
      code = typed_contents(c, i, t, &in[i].tensor, numel);
      if (code) return code;
    } else if (numel) {
      return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': no data (raw_input_contents or contents)", i,
                  t->name);
    }
    c->bytes_in += in[i].tensor.nbytes;
  }
  *n_in = r->n_inputs;
  return GRPC_STATUS_OK;
}

static grpc_status_code decode_params(infer_ctx *c, moe_param *p, size_t *n) {
  const Inference__ModelInferRequest *r = c->req;
  if (r->n_parameters > 64)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters: %zu given, at most 64", r->n_parameters);
  for (size_t i = 0; i < r->n_parameters; i++) {
    const Inference__ModelInferRequest__ParametersEntry *e = r->parameters[i];
    memset(&p[i], 0, sizeof p[i]);
    p[i].name = e->key;
    const Inference__InferParameter *v = e->value;
    if (!v) return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters['%s']: no value", e->key);
    switch (v->parameter_choice_case) {
    case INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_BOOL_PARAM: p[i].type = MOE_PARAM_BOOL; p[i].b = v->bool_param; break;
    case INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_INT64_PARAM: p[i].type = MOE_PARAM_INT; p[i].i = v->int64_param; break;
    case INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM: p[i].type = MOE_PARAM_STRING; p[i].s = v->string_param; break;
    case INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_DOUBLE_PARAM: p[i].type = MOE_PARAM_DOUBLE; p[i].d = v->double_param; break;
    case INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_UINT64_PARAM:
      if (v->uint64_param > (uint64_t)INT64_MAX)
        return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters['%s']: value too large", e->key);
      p[i].type = MOE_PARAM_INT;
      p[i].i = (int64_t)v->uint64_param;
      break;
    default: return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters['%s']: no value", e->key);
    }
  }
  *n = r->n_parameters;
  return GRPC_STATUS_OK;
}

/* ---- encoding ------------------------------------------------------------------------ */

static size_t put_varint(uint8_t *p, uint64_t v) {
  size_t n = 0;
  do {
    uint8_t b = v & 0x7F;
    v >>= 7;
    p[n++] = b | (v ? 0x80 : 0);
  } while (v);
  return n;
}

/* The response: the message without its raw contents (protobuf-c), then
 * each output as a `raw_output_contents` field (6) whose bytes are the
 * output buffer itself, handed over as a slice. Protobuf allows any field
 * order. With `stream`, wrapped as ModelStreamInferResponse.infer_response. */
static grpc_status_code encode(infer_ctx *c, bool stream, grpc_byte_buffer **out) {
  Inference__ModelInferResponse resp = INFERENCE__MODEL_INFER_RESPONSE__INIT;
  Inference__ModelInferResponse__InferOutputTensor ot[MAX_INPUTS];
  Inference__ModelInferResponse__InferOutputTensor *otp[MAX_INPUTS];
  Inference__ModelInferResponse__InferOutputTensor__ParametersEntry pe[MAX_INPUTS], *pep[MAX_INPUTS];
  Inference__InferParameter pv[MAX_INPUTS];
  int64_t shapes[MAX_INPUTS][MOE_MAX_DIMS];
  size_t sel[MAX_INPUTS], nsel = 0;
  const Inference__ModelInferRequest *r = c->req;

  /* requested outputs, or all of them */
  if (r->n_outputs) {
    if (r->n_outputs > MAX_INPUTS) return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "outputs: too many requested");
    for (size_t k = 0; k < r->n_outputs; k++) {
      size_t j = c->num_out;
      for (size_t i = 0; i < c->num_out; i++)
        if (r->outputs[k]->name && strcmp(moe_call_output(c->call, i)->name, r->outputs[k]->name) == 0) j = i;
      if (j == c->num_out)
        return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "outputs[%zu]: model %s has no output '%s'", k, c->model->name,
                    r->outputs[k]->name ? r->outputs[k]->name : "");
      sel[nsel++] = j;
    }
  } else {
    for (size_t i = 0; i < c->num_out; i++) sel[nsel++] = i;
  }

  for (size_t k = 0; k < nsel; k++) {
    const moe_named_tensor *o = moe_call_output(c->call, sel[k]);
    const moe_tensor *t = &o->tensor;
    inference__model_infer_response__infer_output_tensor__init(&ot[k]);
    otp[k] = &ot[k];
    ot[k].name = (char *)o->name;
    ot[k].datatype = (char *)moed_kserve_datatype(t->dtype);
    for (int d = 0; d < t->ndim; d++) shapes[k][d] = t->shape[d];
    if (t->dtype == MOE_FP4_E2M1 && t->ndim > 0) shapes[k][t->ndim - 1] /= 2; /* packed bytes on the wire */
    ot[k].n_shape = (size_t)t->ndim;
    ot[k].shape = shapes[k];
    bool narrow = moe_dtype_bits(t->dtype) <= 8 && t->dtype != MOE_UINT8;
    if (narrow) { /* the real format, since the protocol has no fp8/fp4 */
      inference__model_infer_response__infer_output_tensor__parameters_entry__init(&pe[k]);
      inference__infer_parameter__init(&pv[k]);
      pv[k].parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM;
      pv[k].string_param = (char *)moe_dtype_name(t->dtype);
      pe[k].key = "dtype";
      pe[k].value = &pv[k];
      pep[k] = &pe[k];
      ot[k].n_parameters = 1;
      ot[k].parameters = &pep[k];
    }
  }
  resp.model_name = c->model->name;
  resp.model_version = "1";
  resp.id = r->id;
  resp.n_outputs = nsel;
  resp.outputs = otp;

  size_t hdr_len = inference__model_infer_response__get_packed_size(&resp);
  size_t total = hdr_len;
  uint8_t prefixes[MAX_INPUTS][11];
  size_t prefix_len[MAX_INPUTS];
  for (size_t k = 0; k < nsel; k++) {
    size_t nb = moe_call_output(c->call, sel[k])->tensor.nbytes;
    prefixes[k][0] = (6 << 3) | 2;
    prefix_len[k] = 1 + put_varint(prefixes[k] + 1, nb);
    if (!moe_add_size(total, prefix_len[k], &total) || !moe_add_size(total, nb, &total))
      return fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "response too large");
  }
  if (total > c->srv->cfg->max_message_bytes)
    return fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "response of %zu bytes exceeds the message limit %zu", total,
                c->srv->cfg->max_message_bytes);

  grpc_slice slices[2 + 2 * MAX_INPUTS];
  size_t ns = 0;
  if (stream) {
    uint8_t wrap[11];
    wrap[0] = (2 << 3) | 2;
    size_t wl = 1 + put_varint(wrap + 1, total);
    slices[ns++] = grpc_slice_from_copied_buffer((const char *)wrap, wl);
  }
  grpc_slice hdr = grpc_slice_malloc(hdr_len);
  inference__model_infer_response__pack(&resp, GRPC_SLICE_START_PTR(hdr));
  slices[ns++] = hdr;
  for (size_t k = 0; k < nsel; k++) {
    size_t i = sel[k];
    size_t nb = moe_call_output(c->call, i)->tensor.nbytes;
    slices[ns++] = grpc_slice_from_copied_buffer((const char *)prefixes[k], prefix_len[k]);
    void **owner = moed_backend_is_host(c->b) ? &c->outputs[i] : &c->host_out[i];
    /* the same output listed twice: the second one copies */
    bool given = *owner == NULL;
    if (given)
      slices[ns++] = grpc_slice_from_copied_buffer((const char *)moe_call_output(c->call, i)->tensor.data, nb);
    else {
      slices[ns++] = grpc_slice_new(*owner, nb, free);
      *owner = NULL; /* the slice owns it now */
    }
    c->bytes_out += nb;
  }
  *out = grpc_raw_byte_buffer_create(slices, ns);
  for (size_t k = 0; k < ns; k++) grpc_slice_unref(slices[k]);
  return GRPC_STATUS_OK;
}

/* ---- running ---------------------------------------------------------------------------- */

static void *alloc_host(size_t n) {
  size_t rounded = (n + 63) & ~(size_t)63;
  if (rounded < n) return NULL;
  return aligned_alloc(64, rounded ? rounded : 64);
}

static grpc_status_code bind_memory(infer_ctx *c) {
  moe_backend *b = c->b;
  bool host = moed_backend_is_host(b);
  if (!host) { /* inputs to the device */
    for (size_t i = 0; i < moe_call_num_inputs(c->call) && i < MAX_INPUTS; i++) {
      moe_named_tensor *t = moe_call_input(c->call, i);
      if (!t->name || !t->tensor.data || !t->tensor.nbytes) continue;
      if (b->iface->alloc(b, t->tensor.nbytes, &c->device_in[i]) != MOE_OK)
        return fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "device memory exhausted for input '%s'", t->name);
      if (b->iface->copy_in(b, c->device_in[i], t->tensor.data, t->tensor.nbytes) != MOE_OK)
        return fail(c, GRPC_STATUS_INTERNAL, "copy of input '%s' to the device failed", t->name);
      t->tensor.data = c->device_in[i];
    }
  }
  for (size_t i = 0; i < c->num_out; i++) {
    moe_named_tensor *o = moe_call_output(c->call, i);
    void *p = NULL;
    if (host)
      p = alloc_host(o->tensor.nbytes);
    else if (b->iface->alloc(b, o->tensor.nbytes ? o->tensor.nbytes : 1, &p) != MOE_OK)
      p = NULL;
    if (!p) return fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for output '%s'", o->name);
    c->outputs[i] = p;
    o->tensor.data = p;
  }
  return GRPC_STATUS_OK;
}

static grpc_status_code copy_out(infer_ctx *c) {
  if (moed_backend_is_host(c->b)) return GRPC_STATUS_OK;
  for (size_t i = 0; i < c->num_out; i++) {
    moe_named_tensor *o = moe_call_output(c->call, i);
    c->host_out[i] = alloc_host(o->tensor.nbytes);
    if (!c->host_out[i]) return fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for output '%s'", o->name);
    if (c->b->iface->copy_out(c->b, c->host_out[i], o->tensor.data, o->tensor.nbytes) != MOE_OK)
      return fail(c, GRPC_STATUS_INTERNAL, "copy of output '%s' from the device failed", o->name);
    o->tensor.data = c->host_out[i];
  }
  if (c->b->iface->synchronize(c->b) != MOE_OK) return fail(c, GRPC_STATUS_INTERNAL, "device synchronize failed");
  return GRPC_STATUS_OK;
}

/* Work is skipped when nobody waits for it or it is already too late. */
static grpc_status_code still_wanted(infer_ctx *c, moed_rpc *rpc) {
  if (moed_rpc_cancelled(rpc)) return fail(c, GRPC_STATUS_CANCELLED, "call cancelled");
  if (moed_now_ns() >= moed_rpc_deadline_ns(rpc))
    return fail(c, GRPC_STATUS_DEADLINE_EXCEEDED, "deadline exceeded before the work started");
  return GRPC_STATUS_OK;
}

static void record(moed_model_stats *st, bool ok, uint64_t queue_ns, uint64_t compute_ns, uint64_t total_ns,
                   uint64_t in, uint64_t out) {
  if (ok) {
    atomic_fetch_add(&st->success_count, 1);
    atomic_fetch_add(&st->success_ns, total_ns);
    atomic_fetch_add(&st->queue_count, 1);
    atomic_fetch_add(&st->queue_ns, queue_ns);
    atomic_fetch_add(&st->compute_count, 1);
    atomic_fetch_add(&st->compute_ns, compute_ns);
    atomic_fetch_add(&st->inference_count, 1);
    atomic_fetch_add(&st->execution_count, 1);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    atomic_store(&st->last_inference_ms, (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u);
    moed_hist_observe(&st->queue_hist, queue_ns);
    moed_hist_observe(&st->compute_hist, compute_ns);
  } else {
    atomic_fetch_add(&st->fail_count, 1);
    atomic_fetch_add(&st->fail_ns, total_ns);
  }
  moed_hist_observe(&st->total_hist, total_ns);
  atomic_fetch_add(&st->bytes_in, in);
  atomic_fetch_add(&st->bytes_out, out);
}

grpc_status_code moed_infer_execute(moed_server *srv, moe_backend *b, moed_rpc *rpc, grpc_byte_buffer *payload,
                                    uint64_t received_ns, bool stream, grpc_byte_buffer **response, char *msg,
                                    size_t msg_cap, char *id, size_t id_cap) {
  infer_ctx c;
  memset(&c, 0, sizeof c);
  c.srv = srv;
  c.b = b;
  *response = NULL;
  if (id_cap) id[0] = 0;
  grpc_status_code code = still_wanted(&c, rpc);
  uint64_t start_ns = 0, end_ns = 0;
  if (code) goto done;

  grpc_slice s = moed_rpc_flatten(payload);
  c.req = inference__model_infer_request__unpack(NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
  grpc_slice_unref(s);
  if (!c.req) {
    code = fail(&c, GRPC_STATUS_INVALID_ARGUMENT, "request: not a valid ModelInferRequest message");
    goto done;
  }
  if (c.req->id && id_cap) snprintf(id, id_cap, "%s", c.req->id);
  c.model = moed_repository_acquire(srv->repo, c.req->model_name);
  if (!c.model) {
    code = fail(&c, GRPC_STATUS_NOT_FOUND, "model_name: model '%s' not found", c.req->model_name);
    goto done;
  }
  if (c.req->model_version && *c.req->model_version && strcmp(c.req->model_version, "1") != 0) {
    code = fail(&c, GRPC_STATUS_NOT_FOUND, "model_version: model '%s' has no version '%s'", c.model->name,
                c.req->model_version);
    goto done;
  }
  moe_named_tensor in[MAX_INPUTS];
  moe_param params[64];
  size_t n_in = 0, n_params = 0;
  if ((code = decode_inputs(&c, in, &n_in))) goto done;
  if ((code = decode_params(&c, params, &n_params))) goto done;
  moe_params mp = {params, n_params};
  moe_error err = {{0}};
  moe_status ms = moe_op_prepare(c.model->op, in, n_in, &mp, c.model->set, &c.call, &err);
  if (ms != MOE_OK) {
    code = fail(&c, moed_status_from_moe(ms), "%s", err.msg);
    goto done;
  }
  c.num_out = moe_call_num_outputs(c.call);
  if (c.num_out > MAX_INPUTS) {
    code = fail(&c, GRPC_STATUS_INTERNAL, "op has too many outputs");
    goto done;
  }
  if ((code = still_wanted(&c, rpc))) goto done; /* last check before the work */
  if ((code = bind_memory(&c))) goto done;
  start_ns = moed_now_ns();
  ms = moe_call_run(c.call, b, &err);
  if (ms != MOE_OK) {
    code = fail(&c, moed_status_from_moe(ms), "%s", err.msg);
    goto done;
  }
  if ((code = copy_out(&c))) goto done;
  end_ns = moed_now_ns();
  code = encode(&c, stream, response);
done:
  if (c.model) {
    uint64_t now = moed_now_ns();
    record(c.model->stats, code == GRPC_STATUS_OK, (start_ns ? start_ns : now) - received_ns,
           end_ns - start_ns, now - received_ns, c.bytes_in, c.bytes_out);
  }
  snprintf(msg, msg_cap, "%s", code ? c.msg : "");
  ctx_cleanup(&c);
  return code;
}
