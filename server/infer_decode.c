/* infer_decode: a ModelInfer or ModelStreamInfer message -> moed_infer_req,
 * the first step of the inference path (infer_req.h).
 *
 * Decoding (moed_infer_decode) runs on the loop for small messages (so the
 * batcher can see model, parameters and shapes) and on a worker for large
 * ones.
 *
 * Every size a request declares (shape, byte counts, element counts) is
 * untrusted: products are overflow-checked before anything is allocated.
 * raw_input_contents are located in the received bytes and read in place
 * (protobuf-c would copy them); host-memory backends compute on them
 * directly. */
#include <stdlib.h>
#include <string.h>

#include "infer_req.h"

#define fail(r, code, ...) moed_failf((r)->err, code, __VA_ARGS__)

bool moed_infer_failed(const moed_infer_req *r) { return r->code != GRPC_STATUS_OK; }

bool moed_infer_inline_ok(moed_server *srv, grpc_byte_buffer *payload) {
  grpc_slice s = moed_rpc_flatten(payload);
  char name[128];
  moed_kserve_string(GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s), false, MOED_KSERVE_MODEL_NAME, name,
                     sizeof name);
  /* a tensor in shared memory costs what its region's bytes cost, not what
   * the message does: only small ones stay on the fast path */
  const bool shm_ok = moed_infer_shm_small(GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s));
  grpc_slice_unref(s);
  if (!shm_ok) return false;
  moed_model *m = moed_repository_acquire(srv->repo, name);
  /* unknown: answered at once wherever it runs; an op that takes weights (an
   * expert set or inline weights) may compute far longer than its message
   * suggests */
  bool ok = !m || (!moe_op_takes_weights(m->op) && !moed_model_batches(srv, m));
  moed_model_release(m);
  return ok;
}

/* ---- the message bytes ------------------------------------------------------------------ */

static void hostmem_release(void *p) { moed_hostmem_free(p); }

/* The message as one slice. A large message arrives in many slices and is
 * copied once; it is placed so that the first raw_input_contents field's
 * data (the activation) starts 64-byte aligned and is read in place. */
static grpc_slice flatten_aligned(grpc_byte_buffer *bb) {
  if (!bb || bb->type != GRPC_BB_RAW || bb->data.raw.compression != GRPC_COMPRESS_NONE ||
      bb->data.raw.slice_buffer.count <= 1)
    return moed_rpc_flatten(bb);
  const grpc_slice *first = &bb->data.raw.slice_buffer.slices[0];
  size_t data_at = moed_kserve_raw_at(GRPC_SLICE_START_PTR(*first), GRPC_SLICE_LENGTH(*first));
  size_t len = grpc_byte_buffer_length(bb), pad = (64 - data_at % 64) % 64;
  uint8_t *base = len <= SIZE_MAX - 64 ? moed_hostmem_alloc(len + pad) : NULL;
  if (!base) return moed_rpc_flatten(bb);
  size_t off = pad;
  for (size_t i = 0; i < bb->data.raw.slice_buffer.count; i++) {
    const grpc_slice *s = &bb->data.raw.slice_buffer.slices[i];
    memcpy(base + off, GRPC_SLICE_START_PTR(*s), GRPC_SLICE_LENGTH(*s));
    off += GRPC_SLICE_LENGTH(*s);
  }
  return grpc_slice_new_with_user_data(base + pad, len, hostmem_release, base);
}

static grpc_status_code unpack_message(moed_infer_req *r) {
  const uint8_t *p = GRPC_SLICE_START_PTR(r->flat);
  size_t n = GRPC_SLICE_LENGTH(r->flat), rest_len = 0, n_raw = 0;
  if (!moed_kserve_split_raw(p, n, NULL, &rest_len, NULL, &n_raw))
    return fail(r, GRPC_STATUS_INVALID_ARGUMENT, "request: not a valid ModelInferRequest message");
  uint8_t *rest = malloc(rest_len ? rest_len : 1);
  r->raw = calloc(n_raw ? n_raw : 1, sizeof *r->raw);
  if (!rest || !r->raw) {
    free(rest);
    return fail(r, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
  }
  moed_kserve_split_raw(p, n, rest, &rest_len, r->raw, &n_raw);
  r->n_raw = n_raw;
  char field[96];
  const char *fault = moed_kserve_bad_field(rest, rest_len, field, sizeof field);
  if (fault) {
    free(rest);
    return fail(r, GRPC_STATUS_INVALID_ARGUMENT, "%s: %s", field, fault);
  }
  r->msg = inference__model_infer_request__unpack(NULL, rest_len, rest);
  free(rest);
  if (!r->msg) return fail(r, GRPC_STATUS_INVALID_ARGUMENT, "request: not a valid ModelInferRequest message");
  return GRPC_STATUS_OK;
}

/* Model and tensor names follow the model-name rule (moed_model_name_ok), so
 * none can forge a log line or a metric label or look like a path; a
 * rejected name is never echoed. */
static grpc_status_code check_names(moed_infer_req *r) {
  const Inference__ModelInferRequest *m = r->msg;
  if (!moed_model_name_ok(m->model_name))
    return fail(r, GRPC_STATUS_INVALID_ARGUMENT, "model_name: not a valid name (%s)", MOED_MODEL_NAME_RULE);
  for (size_t i = 0; i < m->n_inputs; i++)
    if (!moed_model_name_ok(m->inputs[i]->name))
      return fail(r, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu].name: not a valid name (%s)", i,
                  MOED_MODEL_NAME_RULE);
  if (m->n_outputs > MOED_MAX_TENSORS) /* refused before the op runs, not at its answer */
    return fail(r, GRPC_STATUS_INVALID_ARGUMENT, "outputs: %zu requested, at most %d", m->n_outputs,
                MOED_MAX_TENSORS);
  for (size_t i = 0; i < m->n_outputs; i++) {
    if (!moed_model_name_ok(m->outputs[i]->name))
      return fail(r, GRPC_STATUS_INVALID_ARGUMENT, "outputs[%zu].name: not a valid name (%s)", i,
                  MOED_MODEL_NAME_RULE);
    /* as an input given twice: the answer would carry the tensor twice (and
     * two shared-memory placements of one output could not both be meant) */
    for (size_t j = 0; j < i; j++)
      if (!strcmp(m->outputs[j]->name, m->outputs[i]->name))
        return fail(r, GRPC_STATUS_INVALID_ARGUMENT, "outputs[%zu] '%s': requested twice (outputs[%zu])", i,
                    m->outputs[i]->name, j);
  }
  return GRPC_STATUS_OK;
}

/* ---- inputs and parameters ---------------------------------------------------------------- */

/* Element count and byte size of a wire-declared shape, overflow-checked. */
static grpc_status_code check_shape(moed_infer_req *c, const moed_config *cfg, size_t i,
                                    const Inference__ModelInferRequest__InferInputTensor *t,
                                    const moed_kserve_type *wt, moe_tensor *out, size_t *numel) {
  if (t->n_shape > MOE_MAX_DIMS)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': rank %zu exceeds %d", i, t->name,
                t->n_shape, MOE_MAX_DIMS);
  size_t n = 1;
  for (size_t d = 0; d < t->n_shape; d++) {
    if (t->shape[d] < 0)
      return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': shape[%zu] = %lld is negative", i,
                  t->name, d, (long long)t->shape[d]);
    if (!moe_mul_size(n, (size_t)t->shape[d], &n) || n > (size_t)INT64_MAX)
      return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': shape overflows", i, t->name);
    out->shape[d] = t->shape[d];
  }
  size_t bytes;
  if (!moe_mul_size(n, wt->size, &bytes))
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': byte size overflows", i, t->name);
  if (bytes > cfg->max_tensor_bytes)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': %zu bytes exceed the limit of %zu", i,
                t->name, bytes, cfg->max_tensor_bytes);
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < t->n_shape; d++)
    rows *= t->shape[d]; /* <= n: no overflow */
  if (t->n_shape >= 2 && rows > cfg->max_tokens)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': %lld rows exceed max tokens %lld", i,
                t->name, (long long)rows, (long long)cfg->max_tokens);
  out->dtype = wt->dtype;
  out->ndim = (int32_t)t->n_shape;
  out->nbytes = bytes;
  *numel = n;
  return GRPC_STATUS_OK;
}

/* Elements in a tensor's typed contents, of every type (0: none or NULL). */
static size_t contents_count(const Inference__InferTensorContents *tc) {
  return tc ? tc->n_bool_contents + tc->n_int_contents + tc->n_int64_contents + tc->n_uint_contents +
                  tc->n_uint64_contents + tc->n_fp32_contents + tc->n_fp64_contents + tc->n_bytes_contents
            : 0;
}

/* The typed `contents` of input i, converted to the storage type. */
static grpc_status_code typed_contents(moed_infer_req *c, size_t i,
                                       const Inference__ModelInferRequest__InferInputTensor *t,
                                       moe_tensor *out, size_t numel) {
  const Inference__InferTensorContents *tc = t->contents;
  size_t have = 0;
  const char *field = "";
  switch (out->dtype) {
  case MOE_F32:
    have = tc->n_fp32_contents;
    field = "fp32_contents";
    break;
  case MOE_INT32:
  case MOE_INT8:
    have = tc->n_int_contents;
    field = "int_contents";
    break;
  case MOE_UINT8:
    have = tc->n_uint_contents;
    field = "uint_contents";
    break;
  default:
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                "inputs[%zu] '%s': %s has no typed contents; use raw_input_contents", i, t->name,
                t->datatype);
  }
  /* elements in another typed field would be silently dropped */
  if (contents_count(tc) != have)
    return fail(
        c, GRPC_STATUS_INVALID_ARGUMENT,
        "inputs[%zu] '%s': contents other than contents.%s given (a %s input's elements go there only)", i,
        t->name, field, t->datatype);
  if (have != numel)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                "inputs[%zu] '%s': contents.%s has %zu elements, shape needs %zu", i, t->name, field, have,
                numel);
  switch (out->dtype) {
  case MOE_F32: out->data = tc->fp32_contents; break; /* already fp32, in place */
  case MOE_INT32: out->data = tc->int_contents; break;
  case MOE_INT8: {
    int8_t *p = moed_hostmem_alloc(numel);
    if (!p) return fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    c->owned[i] = p;
    for (size_t k = 0; k < numel; k++) {
      if (tc->int_contents[k] < -128 || tc->int_contents[k] > 127)
        return fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                    "inputs[%zu] '%s': contents.int_contents[%zu] out of INT8 range", i, t->name, k);
      p[k] = (int8_t)tc->int_contents[k];
    }
    out->data = p;
    break;
  }
  default: { /* UINT8 */
    uint8_t *p = moed_hostmem_alloc(numel);
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

static grpc_status_code decode_inputs(moed_infer_req *c, moed_server *srv) {
  const moed_config *cfg = srv->cfg;
  const Inference__ModelInferRequest *r = c->msg;
  if (r->n_inputs > MOED_MAX_TENSORS)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs: %zu given, at most %d", r->n_inputs,
                MOED_MAX_TENSORS);
  /* raw_input_contents hold the inputs not in shared memory, in order (Triton's rule) */
  size_t n_shm = 0, next_raw = 0;
  for (size_t i = 0; i < r->n_inputs; i++)
    n_shm += moed_infer_shm_named(r->inputs[i]);
  if (c->n_raw && c->n_raw != r->n_inputs - n_shm)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                "raw_input_contents: %zu given for %zu inputs (%zu more in shared memory)", c->n_raw,
                r->n_inputs - n_shm, n_shm);
  for (size_t i = 0; i < r->n_inputs; i++) {
    const Inference__ModelInferRequest__InferInputTensor *t = r->inputs[i];
    if (!t->name || !*t->name) return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu]: name is empty", i);
    const moed_kserve_type *wt = moed_kserve_by_name(t->datatype);
    if (!wt)
      return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': datatype '%s' not supported", i,
                  t->name, t->datatype);
    memset(&c->in[i], 0, sizeof c->in[i]);
    c->in[i].name = t->name;
    size_t numel = 0;
    grpc_status_code code = check_shape(c, cfg, i, t, wt, &c->in[i].tensor, &numel);
    if (code) return code;
    bool in_shm = false;
    if ((code = moed_infer_shm_input(c, srv, i, &c->in[i].tensor, &in_shm))) return code;
    /* one source of data per input: Triton refuses contents beside raw
     * contents too (which one was used would be moed's guess) */
    if ((in_shm || c->n_raw) && contents_count(t->contents))
      return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs[%zu] '%s': contents given as well as %s", i,
                  t->name, in_shm ? "a shared memory region" : "raw_input_contents");
    if (in_shm) {
      /* read from its region (infer_shm.c) */
    } else if (c->n_raw) {
      const size_t k = next_raw++;
      const ProtobufCBinaryData *raw = &c->raw[k];
      if (raw->len != c->in[i].tensor.nbytes)
        return fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                    "inputs[%zu] '%s': raw_input_contents[%zu] has %zu bytes, shape and %s need %zu", i,
                    t->name, k, raw->len, t->datatype, c->in[i].tensor.nbytes);
      c->in[i].tensor.data = raw->data;
      size_t align = moe_dtype_bits(wt->dtype) / 8;
      if (align > 1 && (uintptr_t)raw->data % align) {
        /* the op reads whole elements: a misaligned field is copied (the
         * large ones are aligned by flatten_aligned; small ones cost little) */
        if (!(c->owned[i] = moed_hostmem_alloc(raw->len)))
          return fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for input '%s'", t->name);
        memcpy(c->owned[i], raw->data, raw->len);
        c->in[i].tensor.data = c->owned[i];
      }
    } else if (t->contents) {
      code = typed_contents(c, i, t, &c->in[i].tensor, numel);
      if (code) return code;
    } else if (numel) {
      return fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                  "inputs[%zu] '%s': no data (raw_input_contents or contents)", i, t->name);
    }
    c->bytes_in += c->in[i].tensor.nbytes;
  }
  c->n_in = r->n_inputs;
  return GRPC_STATUS_OK;
}

/* The KServe/Triton request parameters the server itself takes (not the
 * op's, and not part of the batch key): `timeout` in microseconds (0: none)
 * shortens the call's deadline, counted from arrival; `priority` is a level
 * as Triton's queue policy numbers them (1 highest .. MOED_PRIORITY_LEVELS,
 * 0: MOED_PRIORITY_DEFAULT; both integers); `triton_enable_empty_final_response`
 * (bool) is accepted. Triton's other reserved names are refused here: the
 * sequence batcher's (moed's models are stateless) and any other `triton_`
 * name. Any other name goes to the op, which rejects names it does not take.
 * true: e was one of them (or an error is set). */
static bool server_param(moed_infer_req *c, const Inference__ModelInferRequest__ParametersEntry *e,
                         grpc_status_code *code) {
  /* tritonclient's stream option enable_empty_final_response: every moed
   * model answers each request with exactly one (final) response, which the
   * encoder marks final (moed_kserve_encode); accepted so the op does not
   * reject the name */
  if (strcmp(e->key, "triton_enable_empty_final_response") == 0) {
    if (!e->value ||
        e->value->parameter_choice_case != INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_BOOL_PARAM)
      *code = fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters['%s']: a bool is expected", e->key);
    return true;
  }
  if (strncmp(e->key, "sequence_", 9) == 0 &&
      (!strcmp(e->key + 9, "id") || !strcmp(e->key + 9, "start") || !strcmp(e->key + 9, "end"))) {
    *code =
        fail(c, GRPC_STATUS_INVALID_ARGUMENT,
             "parameters['%s']: moed has no sequence batching (its models keep no state between requests)",
             e->key);
    return true;
  }
  if (strncmp(e->key, "triton_", 7) == 0) {
    *code = fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                 "parameters['%s']: names starting with 'triton_' are reserved", e->key);
    return true;
  }
  const bool timeout = strcmp(e->key, "timeout") == 0;
  if (!timeout && strcmp(e->key, "priority") != 0) return false;
  const Inference__InferParameter *v = e->value;
  int64_t n = -1;
  if (v && v->parameter_choice_case == INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_INT64_PARAM)
    n = v->int64_param;
  else if (v && v->parameter_choice_case == INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_UINT64_PARAM)
    n = v->uint64_param > (uint64_t)INT64_MAX ? -1 : (int64_t)v->uint64_param;
  if (n < 0) {
    *code = fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters['%s']: an integer >= 0 is expected", e->key);
    return true;
  }
  if (!timeout) {
    if (n > MOED_PRIORITY_LEVELS)
      *code = fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                   "parameters['priority']: %lld is not a level: 1 (highest) to %d, or 0 for the default %d",
                   (long long)n, MOED_PRIORITY_LEVELS, MOED_PRIORITY_DEFAULT);
    else
      c->priority = n ? (int)n : MOED_PRIORITY_DEFAULT;
  } else if (n > 0) {
    const uint64_t us = (uint64_t)n,
                   at = c->req->received_ns + (us > UINT64_MAX / 2000 ? UINT64_MAX / 2 : us * 1000);
    if (at < c->deadline_ns) {
      c->deadline_ns = at;
      c->timeout_us = us; /* the deadline is the parameter's: errors name it */
    }
  }
  return true;
}

static grpc_status_code decode_params(moed_infer_req *c) {
  const Inference__ModelInferRequest *r = c->msg;
  moe_param *p = c->params;
  if (r->n_parameters > MOED_MAX_PARAMS)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters: %zu given, at most %d", r->n_parameters,
                MOED_MAX_PARAMS);
  size_t np = 0;
  for (size_t k = 0; k < r->n_parameters; k++) {
    const Inference__ModelInferRequest__ParametersEntry *e = r->parameters[k];
    /* a key twice (a JSON object's, or map entries on the wire): which value
     * counts would be a guess, and the op would call the second one unknown */
    for (size_t j = 0; j < k && e->key; j++)
      if (r->parameters[j]->key && !strcmp(r->parameters[j]->key, e->key))
        return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters['%s']: given twice", e->key);
    grpc_status_code code = GRPC_STATUS_OK;
    if (e->key && server_param(c, e, &code)) {
      if (code) return code;
      continue;
    }
    const size_t i = np++;
    memset(&p[i], 0, sizeof p[i]);
    p[i].name = e->key;
    const Inference__InferParameter *v = e->value;
    if (!v) return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters['%s']: no value", e->key);
    switch (v->parameter_choice_case) {
    case INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_BOOL_PARAM:
      p[i].type = MOE_PARAM_BOOL;
      p[i].b = v->bool_param;
      break;
    case INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_INT64_PARAM:
      p[i].type = MOE_PARAM_INT;
      p[i].i = v->int64_param;
      break;
    case INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM:
      p[i].type = MOE_PARAM_STRING;
      p[i].s = v->string_param;
      break;
    case INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_DOUBLE_PARAM:
      p[i].type = MOE_PARAM_DOUBLE;
      p[i].d = v->double_param;
      break;
    case INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_UINT64_PARAM:
      if (v->uint64_param > (uint64_t)INT64_MAX)
        return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters['%s']: value too large", e->key);
      p[i].type = MOE_PARAM_INT;
      p[i].i = (int64_t)v->uint64_param;
      break;
    default: return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters['%s']: no value", e->key);
    }
  }
  c->n_params = np;
  return GRPC_STATUS_OK;
}

moed_infer_req *moed_infer_decode(moed_server *srv, moed_request *req) {
  moed_infer_req *r = calloc(1, sizeof *r);
  if (!r) {
    moed_request_reject(srv, req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
    return NULL;
  }
  r->req = req;
  r->deadline_ns = moed_rpc_deadline_ns(req->rpc);
  r->priority = MOED_PRIORITY_DEFAULT;
  r->flat = flatten_aligned(req->payload);
  if (req->payload) grpc_byte_buffer_destroy(req->payload);
  req->payload = NULL;
  if ((r->code = unpack_message(r))) return r;
  if ((r->code = check_names(r))) return r;
  r->model = moed_repository_acquire(srv->repo, r->msg->model_name);
  if (!r->model) {
    r->code = fail(r, GRPC_STATUS_NOT_FOUND, "model_name: model '%s' not found", r->msg->model_name);
    return r;
  }
  if (r->msg->model_version && *r->msg->model_version && strcmp(r->msg->model_version, "1") != 0) {
    r->code = fail(r, GRPC_STATUS_NOT_FOUND, "model_version: model '%s' has no version '%s'", r->model->name,
                   moed_version_shown(r->msg->model_version));
    return r;
  }
  if ((r->code = decode_inputs(r, srv))) return r;
  if ((r->code = moed_infer_shm_outputs_decode(r, srv))) return r;
  if ((r->code = decode_params(r))) return r;
  moed_batch_key(r, srv);
  return r;
}
