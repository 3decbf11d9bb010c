/* rest_infer: inference on the REST port: a request's JSON header and
 * binary data become the ModelInferRequest the gRPC port would get, and the
 * ModelInferResponse becomes JSON, each output's data in it or (binary,
 * Triton's extension) after it. Tensors in JSON are converted here, element
 * by element, to and from the KServe datatype's bytes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_number.h"
#include "kserve_wire.h"
#include "moe/codec.h"
#include "rest_call.h"

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
    /* a JSON number is a double: past 2^53 the dimension read need not be the one written */
    if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || e->valuedouble < 0 ||
        e->valuedouble > 9007199254740992.0)
      return bad(b, "inputs[%zu] '%s': shape[%zu] is not a non-negative integer (at most 2^53)", i, nm, rank);
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
  size_t off;
  cJSON *j = moed_json_parse_whole(text, json_len, &off);
  if (!j) {
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

void moed_rest_infer(moed_rest *r, moed_http_conn *c, moed_http_request *rq, const char *model,
                     const char *version) {
  char peer[320];
  if (!moed_rest_allowed(c, rq, MOED_M_MODEL_INFER, peer)) return;
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
  moed_rest_submit(r, c, rq, MOED_M_MODEL_INFER, payload, k);
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
void moed_rest_answer_infer(rest_call *k, const Inference__ModelInferResponse *m) {
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
    for (size_t d = 0; d < t->n_shape; d++) { /* exact: as a double, 2^61 would print 2.305843009213694e+18 */
      char dim[24];
      snprintf(dim, sizeof dim, "%lld", (long long)t->shape[d]);
      cJSON_AddItemToArray(shape, cJSON_CreateRaw(dim));
    }
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
