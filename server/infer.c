/* infer: ModelInfer and ModelStreamInfer requests, from the wire to an op
 * call and back.
 *
 * Decoding (moed_infer_decode) runs on the loop for small messages (so the
 * batcher can see model, parameters and shapes) and on a worker for large
 * ones; running (moed_infer_run) always on a worker.
 *
 * Every size a request declares (shape, byte counts, element counts) is
 * untrusted: products are overflow-checked before anything is allocated.
 * raw_input_contents are located in the received bytes and read in place
 * (protobuf-c would copy them); host-memory backends compute on them
 * directly and their outputs are handed to gRPC as slices without a copy. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grpc_service.pb-c.h"
#include "moed.h"

#define MAX_INPUTS 16
#define MAX_PARAMS 64
#define MAX_SMALL_INPUT 4096
#define SMALL_RESPONSE                                                                                       \
  16384 /* responses up to this size are sent as one slice */ /* rank <= 1 inputs of a batch must be         \
                                                                 byte-equal: bounded */

/* ---- a decoded request --------------------------------------------------------------- */

struct moed_infer_req {
  moed_request *req;
  grpc_slice flat;                   /* the message bytes; raw inputs point here */
  Inference__ModelInferRequest *msg; /* everything but raw_input_contents */
  ProtobufCBinaryData *raw;          /* raw_input_contents, in place in `flat` */
  size_t n_raw;
  moed_model *model;
  moe_named_tensor in[MAX_INPUTS];
  size_t n_in;
  moe_param params[MAX_PARAMS];
  size_t n_params;
  void *owned[MAX_INPUTS]; /* converted typed contents */
  int64_t rows;            /* batch rows; 0 = never batched */
  uint8_t *key;            /* batch key (see batch_key) */
  size_t key_len;
  grpc_status_code code; /* decode failure */
  char err[600];
  uint64_t bytes_in;
};

static grpc_status_code failf(char *buf, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static grpc_status_code failf(char *buf, grpc_status_code code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, 600, fmt, ap);
  va_end(ap);
  return code;
}
#define fail(r, code, ...) failf((r)->err, code, __VA_ARGS__)

static void req_free(moed_infer_req *r) {
  if (!r) return;
  for (size_t i = 0; i < MAX_INPUTS; i++)
    moed_hostmem_free(r->owned[i]);
  free(r->raw);
  free(r->key);
  if (r->msg) inference__model_infer_request__free_unpacked(r->msg, NULL);
  grpc_slice_unref(r->flat);
  moed_model_release(r->model);
  if (r->req->payload) grpc_byte_buffer_destroy(r->req->payload);
  free(r->req);
  free(r);
}

bool moed_infer_failed(const moed_infer_req *r) { return r->code != GRPC_STATUS_OK; }
int64_t moed_infer_batch_rows(const moed_infer_req *r) { return r->code ? 0 : r->rows; }

bool moed_infer_same_batch(const moed_infer_req *a, const moed_infer_req *b) {
  return a->model == b->model && a->key_len == b->key_len && memcmp(a->key, b->key, a->key_len) == 0;
}

/* ---- the wire: raw contents located in place ----------------------------------------- */

static bool read_varint(const uint8_t *p, size_t n, size_t *pos, uint64_t *out) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (*pos >= n) return false;
    uint8_t b = p[(*pos)++];
    v |= (uint64_t)(b & 0x7F) << shift;
    if (!(b & 0x80)) {
      *out = v;
      return true;
    }
  }
  return false;
}

/* Walks the top-level fields of a ModelInferRequest: raw_input_contents
 * (field 7) are recorded in place, the other fields' bytes are copied to
 * `rest` (small: names, shapes, parameters) for protobuf-c. With rest NULL,
 * only counts. false: not a well-formed message. */
static bool split_raw(const uint8_t *p, size_t n, uint8_t *rest, size_t *rest_len, ProtobufCBinaryData *raw,
                      size_t *n_raw) {
  size_t pos = 0, rl = 0, nr = 0;
  while (pos < n) {
    size_t start = pos;
    uint64_t tag, v;
    if (!read_varint(p, n, &pos, &tag) || (tag >> 3) == 0 || (tag >> 3) > UINT32_MAX) return false;
    uint32_t wt = (uint32_t)(tag & 7);
    switch (wt) {
    case 0:
      if (!read_varint(p, n, &pos, &v)) return false;
      break;
    case 1:
      if (n - pos < 8) return false;
      pos += 8;
      break;
    case 5:
      if (n - pos < 4) return false;
      pos += 4;
      break;
    case 2:
      if (!read_varint(p, n, &pos, &v) || v > n - pos) return false;
      if ((tag >> 3) == 7) {
        if (raw) raw[nr] = (ProtobufCBinaryData){(size_t)v, (uint8_t *)p + pos};
        nr++;
        pos += (size_t)v;
        continue;
      }
      pos += (size_t)v;
      break;
    default: return false; /* groups and reserved wire types: not this message */
    }
    if ((tag >> 3) == 7) return false; /* raw contents must be length-delimited */
    if (rest) memcpy(rest + rl, p + start, pos - start);
    rl += pos - start;
  }
  *rest_len = rl;
  *n_raw = nr;
  return true;
}

/* Whether the model would merge this request with others (batch_key's
 * model-level conditions). */
static bool model_batches(const moed_server *srv, const moed_model *m) {
  return srv->cfg->max_batch_tokens > 0 && moe_op_describe(m->op)->rows_independent &&
         !(m->builtin && m->op == moe_op_find("fused_moe")); /* inline weights: a batch per weight set */
}

bool moed_infer_inline_ok(moed_server *srv, grpc_byte_buffer *payload) {
  grpc_slice s = moed_rpc_flatten(payload);
  const uint8_t *p = GRPC_SLICE_START_PTR(s);
  size_t n = GRPC_SLICE_LENGTH(s), pos = 0;
  char name[128] = "";
  while (pos < n) { /* the first model_name (field 1); other fields skipped */
    uint64_t tag, v;
    if (!read_varint(p, n, &pos, &tag)) break;
    uint32_t wt = (uint32_t)(tag & 7);
    if (wt == 0) {
      if (!read_varint(p, n, &pos, &v)) break;
    } else if (wt == 1 || wt == 5) {
      if (n - pos < (wt == 1 ? 8u : 4u)) break;
      pos += wt == 1 ? 8 : 4;
    } else if (wt == 2) {
      if (!read_varint(p, n, &pos, &v) || v > n - pos) break;
      if ((tag >> 3) == 1) {
        if (v < sizeof name) {
          memcpy(name, p + pos, (size_t)v);
          name[v] = 0;
        }
        break;
      }
      pos += (size_t)v;
    } else {
      break;
    }
  }
  grpc_slice_unref(s);
  moed_model *m = moed_repository_acquire(srv->repo, name);
  /* unknown: answered at once wherever it runs; fused_moe (an expert set or
   * inline weights) may compute far longer than its message suggests */
  bool ok = !m || (m->op != moe_op_find("fused_moe") && !model_batches(srv, m));
  moed_model_release(m);
  return ok;
}

static void hostmem_release(void *p) { moed_hostmem_free(p); }

/* The message as one slice. A large message arrives in many slices and is
 * copied once; it is placed so that the first raw_input_contents field's
 * data (the activation) starts 64-byte aligned and is read in place. */
static grpc_slice flatten_aligned(grpc_byte_buffer *bb) {
  if (!bb || bb->type != GRPC_BB_RAW || bb->data.raw.compression != GRPC_COMPRESS_NONE ||
      bb->data.raw.slice_buffer.count <= 1)
    return moed_rpc_flatten(bb);
  const grpc_slice *first = &bb->data.raw.slice_buffer.slices[0];
  const uint8_t *p = GRPC_SLICE_START_PTR(*first);
  size_t n = GRPC_SLICE_LENGTH(*first), pos = 0, data_at = 0;
  while (pos < n && !data_at) { /* the fields before the first field 7 (small) */
    uint64_t tag, v;
    if (!read_varint(p, n, &pos, &tag)) break;
    uint32_t wt = (uint32_t)(tag & 7);
    if (wt == 0) {
      if (!read_varint(p, n, &pos, &v)) break;
    } else if (wt == 1 || wt == 5) {
      pos += wt == 1 ? 8 : 4;
    } else if (wt == 2) {
      if (!read_varint(p, n, &pos, &v)) break;
      if ((tag >> 3) == 7)
        data_at = pos;
      else if (v > n - pos)
        break;
      else
        pos += (size_t)v;
    } else {
      break;
    }
  }
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
  if (!split_raw(p, n, NULL, &rest_len, NULL, &n_raw))
    return fail(r, GRPC_STATUS_INVALID_ARGUMENT, "request: not a valid ModelInferRequest message");
  uint8_t *rest = malloc(rest_len ? rest_len : 1);
  r->raw = calloc(n_raw ? n_raw : 1, sizeof *r->raw);
  if (!rest || !r->raw) {
    free(rest);
    return fail(r, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
  }
  split_raw(p, n, rest, &rest_len, r->raw, &n_raw);
  r->n_raw = n_raw;
  r->msg = inference__model_infer_request__unpack(NULL, rest_len, rest);
  free(rest);
  if (!r->msg) return fail(r, GRPC_STATUS_INVALID_ARGUMENT, "request: not a valid ModelInferRequest message");
  return GRPC_STATUS_OK;
}

/* ---- decoding ---------------------------------------------------------------------- */

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

static grpc_status_code decode_inputs(moed_infer_req *c, const moed_config *cfg) {
  const Inference__ModelInferRequest *r = c->msg;
  if (r->n_inputs > MAX_INPUTS)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "inputs: %zu given, at most %d", r->n_inputs, MAX_INPUTS);
  if (c->n_raw && c->n_raw != r->n_inputs)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "raw_input_contents: %zu given for %zu inputs", c->n_raw,
                r->n_inputs);
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
    if (c->n_raw) {
      const ProtobufCBinaryData *raw = &c->raw[i];
      if (raw->len != c->in[i].tensor.nbytes)
        return fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                    "inputs[%zu] '%s': raw_input_contents[%zu] has %zu bytes, shape and %s need %zu", i,
                    t->name, i, raw->len, t->datatype, c->in[i].tensor.nbytes);
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

static grpc_status_code decode_params(moed_infer_req *c) {
  const Inference__ModelInferRequest *r = c->msg;
  moe_param *p = c->params;
  if (r->n_parameters > MAX_PARAMS)
    return fail(c, GRPC_STATUS_INVALID_ARGUMENT, "parameters: %zu given, at most %d", r->n_parameters,
                MAX_PARAMS);
  for (size_t i = 0; i < r->n_parameters; i++) {
    const Inference__ModelInferRequest__ParametersEntry *e = r->parameters[i];
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
  c->n_params = r->n_parameters;
  return GRPC_STATUS_OK;
}

/* ---- the batch key ------------------------------------------------------------------------ */

typedef struct keybuf {
  uint8_t *p;
  size_t len, cap;
  bool oom;
} keybuf;

static void kb_put(keybuf *k, const void *data, size_t n) {
  if (k->oom) return;
  if (n > SIZE_MAX / 2 - k->len) {
    k->oom = true;
    return;
  }
  if (k->len + n > k->cap) {
    size_t cap = (k->len + n) * 2 + 64;
    uint8_t *g = realloc(k->p, cap);
    if (!g) {
      k->oom = true;
      return;
    }
    k->p = g;
    k->cap = cap;
  }
  memcpy(k->p + k->len, data, n);
  k->len += n;
}

static void kb_str(keybuf *k, const char *s) { kb_put(k, s ? s : "", strlen(s ? s : "") + 1); }

static int cmp_param(const void *a, const void *b) {
  return strcmp((*(const moe_param *const *)a)->name, (*(const moe_param *const *)b)->name);
}
static int cmp_input(const void *a, const void *b) {
  return strcmp((*(const moe_named_tensor *const *)a)->name, (*(const moe_named_tensor *const *)b)->name);
}

/* Whether r may be merged with others along the first axis, and the key
 * that must be equal for two requests to merge: the parameters (sorted by
 * name), each input's name, dtype and trailing dims (sorted by name), and
 * the bytes of inputs of rank <= 1 (a static scale, a bias: shared by the
 * whole batch, so they must be the same). Rows = the first dim shared by
 * every input of rank >= 2. The op library guarantees that such an op's row
 * r depends on row r of its inputs only (moe_op_info.rows_independent). */
static void batch_key(moed_infer_req *r, const moed_server *srv) {
  const moed_config *cfg = srv->cfg;
  if (!model_batches(srv, r->model)) return;
  int64_t rows = 0;
  const moe_named_tensor *ins[MAX_INPUTS];
  const moe_param *ps[MAX_PARAMS];
  for (size_t i = 0; i < r->n_in; i++) {
    const moe_tensor *t = &r->in[i].tensor;
    for (size_t j = 0; j < i; j++)
      if (strcmp(r->in[j].name, r->in[i].name) == 0) return; /* ambiguous: the op will say so */
    if (t->ndim >= 2) {
      if (rows && t->shape[0] != rows) return;
      rows = t->shape[0];
    } else if (t->nbytes > MAX_SMALL_INPUT) {
      return;
    }
    ins[i] = &r->in[i];
  }
  if (rows <= 0 || rows > cfg->max_batch_tokens) return;
  for (size_t i = 0; i < r->n_params; i++) {
    for (size_t j = 0; j < i; j++)
      if (strcmp(r->params[j].name, r->params[i].name) == 0) return;
    ps[i] = &r->params[i];
  }
  qsort(ins, r->n_in, sizeof ins[0], cmp_input);
  qsort(ps, r->n_params, sizeof ps[0], cmp_param);
  keybuf k = {0};
  for (size_t i = 0; i < r->n_params; i++) {
    const moe_param *p = ps[i];
    uint8_t type = (uint8_t)p->type;
    kb_str(&k, p->name);
    kb_put(&k, &type, 1);
    switch (p->type) {
    case MOE_PARAM_STRING: kb_str(&k, p->s); break;
    case MOE_PARAM_BOOL: kb_put(&k, &p->b, sizeof p->b); break;
    case MOE_PARAM_INT: kb_put(&k, &p->i, sizeof p->i); break;
    case MOE_PARAM_DOUBLE: kb_put(&k, &p->d, sizeof p->d); break;
    }
  }
  for (size_t i = 0; i < r->n_in; i++) {
    const moe_tensor *t = &ins[i]->tensor;
    int32_t head[2] = {(int32_t)t->dtype, t->ndim};
    kb_str(&k, ins[i]->name);
    kb_put(&k, head, sizeof head);
    if (t->ndim >= 2) {
      kb_put(&k, &t->shape[1], sizeof t->shape[0] * (size_t)(t->ndim - 1));
    } else {
      kb_put(&k, t->shape, sizeof t->shape[0] * (size_t)t->ndim);
      kb_put(&k, &t->nbytes, sizeof t->nbytes);
      if (t->nbytes) kb_put(&k, t->data, t->nbytes);
    }
  }
  if (k.oom) {
    free(k.p);
    return; /* unbatched is always correct */
  }
  r->key = k.p;
  r->key_len = k.len;
  r->rows = rows;
}

moed_infer_req *moed_infer_decode(moed_server *srv, moed_request *req) {
  moed_infer_req *r = calloc(1, sizeof *r);
  if (!r) {
    moed_request_reject(srv, req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
    return NULL;
  }
  r->req = req;
  r->flat = flatten_aligned(req->payload);
  if (req->payload) grpc_byte_buffer_destroy(req->payload);
  req->payload = NULL;
  if ((r->code = unpack_message(r))) return r;
  r->model = moed_repository_acquire(srv->repo, r->msg->model_name);
  if (!r->model) {
    r->code = fail(r, GRPC_STATUS_NOT_FOUND, "model_name: model '%s' not found", r->msg->model_name);
    return r;
  }
  if (r->msg->model_version && *r->msg->model_version && strcmp(r->msg->model_version, "1") != 0) {
    r->code = fail(r, GRPC_STATUS_NOT_FOUND, "model_version: model '%s' has no version '%s'", r->model->name,
                   r->msg->model_version);
    return r;
  }
  if ((r->code = decode_inputs(r, srv->cfg))) return r;
  if ((r->code = decode_params(r))) return r;
  batch_key(r, srv);
  return r;
}

/* ---- answering ------------------------------------------------------------------------- */

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

/* One execution of `size` merged requests (Triton's batch statistics). */
static void record_execution(moed_model_stats *st, size_t size, uint64_t compute_ns) {
  size_t i = size < MOED_BATCH_STATS ? size - 1 : MOED_BATCH_STATS - 1;
  atomic_fetch_add(&st->execution_count, 1);
  atomic_fetch_add(&st->batch_count[i], 1);
  atomic_fetch_add(&st->batch_ns[i], compute_ns);
}

static grpc_byte_buffer *pack_stream_error(const char *id, const char *msg) {
  Inference__ModelStreamInferResponse r = INFERENCE__MODEL_STREAM_INFER_RESPONSE__INIT;
  Inference__ModelInferResponse ir = INFERENCE__MODEL_INFER_RESPONSE__INIT;
  ir.id = (char *)(id ? id : "");
  r.error_message = (char *)msg;
  r.infer_response = &ir;
  size_t n = inference__model_stream_infer_response__get_packed_size(&r);
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) return NULL;
  inference__model_stream_infer_response__pack(&r, buf);
  return moed_rpc_buffer_take(buf, n);
}

/* Sends the answer to one request: unary -> status (+ response); stream ->
 * the response or an error message, and the stream goes on. */
static void respond(moed_request *req, const char *id, grpc_status_code code, const char *msg,
                    grpc_byte_buffer *resp) {
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

void moed_request_reject(moed_server *srv, moed_request *req, grpc_status_code code, const char *why) {
  char msg[128];
  bool stream = req->method == MOED_M_MODEL_STREAM_INFER;
  snprintf(msg, sizeof msg, "%s%s", stream && code == GRPC_STATUS_UNAVAILABLE ? "UNAVAILABLE: " : "", why);
  respond(req, NULL, code, msg, NULL);
  if (req->payload) grpc_byte_buffer_destroy(req->payload);
  free(req);
  atomic_fetch_sub(&srv->inflight, 1);
}

/* Answers r, records its statistics and frees it. */
static void finish_req(moed_server *srv, moed_infer_req *r, grpc_status_code code, const char *msg,
                       grpc_byte_buffer *resp, uint64_t start_ns, uint64_t compute_ns, uint64_t bytes_out) {
  respond(r->req, r->msg ? r->msg->id : NULL, code, msg, resp);
  if (r->model) {
    uint64_t now = moed_now_ns();
    record(r->model->stats, code == GRPC_STATUS_OK, (start_ns ? start_ns : now) - r->req->received_ns,
           compute_ns, now - r->req->received_ns, r->bytes_in, bytes_out);
  }
  req_free(r);
  atomic_fetch_sub(&srv->inflight, 1);
}

void moed_infer_reject(moed_server *srv, moed_infer_req *r, grpc_status_code code, const char *why) {
  char msg[128];
  snprintf(msg, sizeof msg, "%s%s",
           r->req->method == MOED_M_MODEL_STREAM_INFER && code == GRPC_STATUS_UNAVAILABLE ? "UNAVAILABLE: "
                                                                                          : "",
           why);
  finish_req(srv, r, code, msg, NULL, 0, 0, 0);
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
 * slice data[i] itself (referenced, not copied). Protobuf allows any field
 * order. With `stream`, wrapped as ModelStreamInferResponse.infer_response. */
static grpc_status_code encode(moed_server *srv, moed_infer_req *r, const moe_named_tensor *outs,
                               const grpc_slice *data, size_t num_out, grpc_byte_buffer **out,
                               uint64_t *bytes_out, char *err) {
  Inference__ModelInferResponse resp = INFERENCE__MODEL_INFER_RESPONSE__INIT;
  Inference__ModelInferResponse__InferOutputTensor ot[MAX_INPUTS];
  Inference__ModelInferResponse__InferOutputTensor *otp[MAX_INPUTS];
  Inference__ModelInferResponse__InferOutputTensor__ParametersEntry pe[MAX_INPUTS], *pep[MAX_INPUTS];
  Inference__InferParameter pv[MAX_INPUTS];
  int64_t shapes[MAX_INPUTS][MOE_MAX_DIMS];
  size_t sel[MAX_INPUTS], nsel = 0;
  const Inference__ModelInferRequest *q = r->msg;
  bool stream = r->req->method == MOED_M_MODEL_STREAM_INFER;

  /* requested outputs, or all of them */
  if (q->n_outputs) {
    if (q->n_outputs > MAX_INPUTS)
      return failf(err, GRPC_STATUS_INVALID_ARGUMENT, "outputs: too many requested");
    for (size_t k = 0; k < q->n_outputs; k++) {
      size_t j = num_out;
      for (size_t i = 0; i < num_out; i++)
        if (q->outputs[k]->name && strcmp(outs[i].name, q->outputs[k]->name) == 0) j = i;
      if (j == num_out)
        return failf(err, GRPC_STATUS_INVALID_ARGUMENT, "outputs[%zu]: model %s has no output '%s'", k,
                     r->model->name, q->outputs[k]->name ? q->outputs[k]->name : "");
      sel[nsel++] = j;
    }
  } else {
    for (size_t i = 0; i < num_out; i++)
      sel[nsel++] = i;
  }

  for (size_t k = 0; k < nsel; k++) {
    const moe_tensor *t = &outs[sel[k]].tensor;
    inference__model_infer_response__infer_output_tensor__init(&ot[k]);
    otp[k] = &ot[k];
    ot[k].name = (char *)outs[sel[k]].name;
    ot[k].datatype = (char *)moed_kserve_datatype(t->dtype);
    for (int d = 0; d < t->ndim; d++)
      shapes[k][d] = t->shape[d];
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
  resp.model_name = r->model->name;
  resp.model_version = "1";
  resp.id = q->id;
  resp.n_outputs = nsel;
  resp.outputs = otp;

  size_t hdr_len = inference__model_infer_response__get_packed_size(&resp);
  size_t total = hdr_len;
  uint8_t prefixes[MAX_INPUTS][11];
  size_t prefix_len[MAX_INPUTS];
  for (size_t k = 0; k < nsel; k++) {
    size_t nb = GRPC_SLICE_LENGTH(data[sel[k]]);
    prefixes[k][0] = (6 << 3) | 2;
    prefix_len[k] = 1 + put_varint(prefixes[k] + 1, nb);
    if (!moe_add_size(total, prefix_len[k], &total) || !moe_add_size(total, nb, &total))
      return failf(err, GRPC_STATUS_RESOURCE_EXHAUSTED, "response too large");
  }
  if (total > srv->cfg->max_message_bytes)
    return failf(err, GRPC_STATUS_RESOURCE_EXHAUSTED, "response of %zu bytes exceeds the message limit %zu",
                 total, srv->cfg->max_message_bytes);

  /* the small pieces (wrapper, header, field prefixes) share one slice */
  size_t small = 11 + hdr_len;
  for (size_t k = 0; k < nsel; k++)
    small += prefix_len[k];
  grpc_slice head = grpc_slice_malloc(small);
  uint8_t *hp = GRPC_SLICE_START_PTR(head);
  size_t off = 0;
  if (stream) {
    hp[off++] = (2 << 3) | 2;
    off += put_varint(hp + off, total);
  }
  inference__model_infer_response__pack(&resp, hp + off);
  off += hdr_len;
  if (total + 11 <= SMALL_RESPONSE) { /* small: one contiguous slice is cheaper than several */
    grpc_slice one = grpc_slice_malloc(off + total - hdr_len);
    uint8_t *op = GRPC_SLICE_START_PTR(one);
    memcpy(op, hp, off);
    size_t o = off;
    for (size_t k = 0; k < nsel; k++) {
      memcpy(op + o, prefixes[k], prefix_len[k]);
      o += prefix_len[k];
      memcpy(op + o, GRPC_SLICE_START_PTR(data[sel[k]]), GRPC_SLICE_LENGTH(data[sel[k]]));
      o += GRPC_SLICE_LENGTH(data[sel[k]]);
      *bytes_out += GRPC_SLICE_LENGTH(data[sel[k]]);
    }
    *out = grpc_raw_byte_buffer_create(&one, 1);
    grpc_slice_unref(one);
    grpc_slice_unref(head);
    return GRPC_STATUS_OK;
  }
  grpc_slice slices[1 + 2 * MAX_INPUTS];
  size_t ns = 0;
  size_t piece = off; /* bytes of `head` before the first output */
  slices[ns++] = grpc_slice_sub(head, 0, piece);
  for (size_t k = 0; k < nsel; k++) {
    memcpy(hp + off, prefixes[k], prefix_len[k]);
    slices[ns++] = grpc_slice_sub(head, off, off + prefix_len[k]);
    off += prefix_len[k];
    slices[ns++] = grpc_slice_ref(data[sel[k]]);
    *bytes_out += GRPC_SLICE_LENGTH(data[sel[k]]);
  }
  *out = grpc_raw_byte_buffer_create(slices, ns);
  for (size_t k = 0; k < ns; k++)
    grpc_slice_unref(slices[k]);
  grpc_slice_unref(head);
  return GRPC_STATUS_OK;
}

/* ---- running ---------------------------------------------------------------------------- */

/* One op call and the memory it uses. */
typedef struct run_ctx {
  moed_server *srv;
  moe_backend *b;
  moe_call *call;
  void *device_in[MAX_INPUTS]; /* device copies of inputs (non-host backends) */
  void *outputs[MAX_INPUTS];   /* output buffers (backend memory) */
  void *host_out[MAX_INPUTS];  /* host copies (non-host backends) */
  moed_weights *cached;        /* inline fused_moe weights from the cache */
  size_t num_out;
  char err[600];
} run_ctx;

static void ctx_cleanup(run_ctx *c) {
  for (size_t i = 0; i < MAX_INPUTS; i++) {
    if (c->device_in[i]) moe_backend_free(c->b, c->device_in[i]);
    if (c->outputs[i]) {
      if (moed_backend_is_host(c->b))
        moed_hostmem_free(c->outputs[i]);
      else
        moe_backend_free(c->b, c->outputs[i]);
    }
    moed_hostmem_free(c->host_out[i]);
  }
  if (c->cached) moed_weight_cache_release(c->srv->weights, c->cached);
  moe_call_destroy(c->call);
}

/* Inline fused_moe weights through the device cache: a hit skips their copy
 * to the device. Rebinds the weight inputs; *done[i] marks them. */
static void bind_cached_weights(run_ctx *c, const moed_model *m, bool *done) {
  if (!c->srv->weights || !m->builtin || m->op != moe_op_find("fused_moe")) return;
  if (moed_backend_is_host(c->b) && !c->srv->cfg->cache_host) return; /* host backends read in place */
  moe_named_tensor w[MAX_INPUTS];
  size_t idx[MAX_INPUTS], n = 0;
  for (size_t i = 0; i < moe_call_num_inputs(c->call) && i < MAX_INPUTS; i++) {
    moe_named_tensor *t = moe_call_input(c->call, i);
    if (t->name && t->tensor.data && moe_expert_tensor_is_weight(t->name)) {
      w[n] = *t;
      idx[n++] = i;
    }
  }
  void *data[MAX_INPUTS];
  if (!n || !(c->cached = moed_weight_cache_get(c->srv->weights, c->b, w, n, data))) return;
  for (size_t k = 0; k < n; k++) {
    moe_call_input(c->call, idx[k])->tensor.data = data[k];
    done[idx[k]] = true;
  }
}

static grpc_status_code bind_memory(run_ctx *c, const moed_model *m) {
  moe_backend *b = c->b;
  bool host = moed_backend_is_host(b);
  bool done[MAX_INPUTS] = {false};
  bind_cached_weights(c, m, done);
  if (!host) { /* inputs to the device */
    for (size_t i = 0; i < moe_call_num_inputs(c->call) && i < MAX_INPUTS; i++) {
      moe_named_tensor *t = moe_call_input(c->call, i);
      if (done[i] || !t->name || !t->tensor.data || !t->tensor.nbytes) continue;
      if (moe_backend_alloc(b, t->tensor.nbytes, &c->device_in[i]) != MOE_OK)
        return failf(c->err, GRPC_STATUS_RESOURCE_EXHAUSTED, "device memory exhausted for input '%s'",
                     t->name);
      if (moe_backend_copy_in(b, c->device_in[i], t->tensor.data, t->tensor.nbytes) != MOE_OK)
        return failf(c->err, GRPC_STATUS_INTERNAL, "copy of input '%s' to the device failed", t->name);
      t->tensor.data = c->device_in[i];
    }
  }
  for (size_t i = 0; i < c->num_out; i++) {
    moe_named_tensor *o = moe_call_output(c->call, i);
    void *p = NULL;
    if (host)
      p = moed_hostmem_alloc(o->tensor.nbytes);
    else if (moe_backend_alloc(b, o->tensor.nbytes ? o->tensor.nbytes : 1, &p) != MOE_OK)
      p = NULL;
    if (!p) return failf(c->err, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for output '%s'", o->name);
    c->outputs[i] = p;
    o->tensor.data = p;
  }
  return GRPC_STATUS_OK;
}

/* Host buffers of the outputs: the outputs themselves on host backends,
 * copies otherwise. Ownership moves to the caller (take[i]). */
static grpc_status_code copy_out(run_ctx *c, void **take) {
  bool host = moed_backend_is_host(c->b);
  for (size_t i = 0; i < c->num_out; i++) {
    moe_named_tensor *o = moe_call_output(c->call, i);
    if (!host) {
      c->host_out[i] = moed_hostmem_alloc(o->tensor.nbytes);
      if (!c->host_out[i])
        return failf(c->err, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for output '%s'", o->name);
      if (moe_backend_copy_out(c->b, c->host_out[i], o->tensor.data, o->tensor.nbytes) != MOE_OK)
        return failf(c->err, GRPC_STATUS_INTERNAL, "copy of output '%s' from the device failed", o->name);
    }
  }
  if (!host && moe_backend_synchronize(c->b) != MOE_OK)
    return failf(c->err, GRPC_STATUS_INTERNAL, "device synchronize failed");
  for (size_t i = 0; i < c->num_out; i++) {
    void **owner = host ? &c->outputs[i] : &c->host_out[i];
    take[i] = *owner;
    *owner = NULL;
  }
  return GRPC_STATUS_OK;
}

/* Work is skipped when nobody waits for it or it is already too late. */
static grpc_status_code still_wanted(moed_rpc *rpc, char *err) {
  if (moed_rpc_cancelled(rpc)) return failf(err, GRPC_STATUS_CANCELLED, "call cancelled");
  if (moed_now_ns() >= moed_rpc_deadline_ns(rpc))
    return failf(err, GRPC_STATUS_DEADLINE_EXCEEDED, "deadline exceeded before the work started");
  return GRPC_STATUS_OK;
}

/* prepare + memory + run + outputs to the host; on error c->err. */
static grpc_status_code run_call(run_ctx *c, const moed_model *m, const moe_named_tensor *in, size_t n_in,
                                 const moe_param *params, size_t n_params, void **host_outs,
                                 uint64_t *start_ns, uint64_t *compute_ns) {
  moe_params mp = {params, n_params};
  moe_error err = {{0}};
  moe_status ms = moe_op_prepare(m->op, in, n_in, &mp, m->set, &c->call, &err);
  if (ms != MOE_OK) return failf(c->err, moed_status_from_moe(ms), "%s", err.msg);
  c->num_out = moe_call_num_outputs(c->call);
  if (c->num_out > MAX_INPUTS) return failf(c->err, GRPC_STATUS_INTERNAL, "op has too many outputs");
  grpc_status_code code = bind_memory(c, m);
  if (code) return code;
  *start_ns = moed_now_ns();
  ms = moe_call_run(c->call, c->b, &err);
  if (ms != MOE_OK) return failf(c->err, moed_status_from_moe(ms), "%s", err.msg);
  code = copy_out(c, host_outs);
  *compute_ns = moed_now_ns() - *start_ns;
  return code;
}

static void run_single(moed_server *srv, moe_backend *b, moed_infer_req *r) {
  run_ctx c;
  memset(&c, 0, sizeof c);
  c.srv = srv;
  c.b = b;
  uint64_t start_ns = 0, compute_ns = 0, bytes_out = 0;
  grpc_byte_buffer *resp = NULL;
  void *host[MAX_INPUTS] = {NULL};
  grpc_slice data[MAX_INPUTS];
  size_t nd = 0;
  grpc_status_code code = still_wanted(r->req->rpc, c.err);
  if (code) goto done;
  code = run_call(&c, r->model, r->in, r->n_in, r->params, r->n_params, host, &start_ns, &compute_ns);
  if (code) goto done;
  record_execution(r->model->stats, 1, compute_ns);
  moe_named_tensor outs[MAX_INPUTS];
  for (; nd < c.num_out; nd++) { /* each output buffer becomes the slice that owns it */
    outs[nd] = *moe_call_output(c.call, nd);
    data[nd] = moed_hostmem_slice(host[nd], outs[nd].tensor.nbytes);
    host[nd] = NULL;
  }
  code = encode(srv, r, outs, data, c.num_out, &resp, &bytes_out, c.err);
done:
  for (size_t i = 0; i < nd; i++)
    grpc_slice_unref(data[i]);
  for (size_t i = 0; i < MAX_INPUTS; i++)
    moed_hostmem_free(host[i]);
  ctx_cleanup(&c);
  finish_req(srv, r, code, c.err, resp, start_ns, compute_ns, bytes_out);
}

/* The outputs of a merged call, shared by the slices of every request's
 * response; freed with the last slice. */
typedef struct shared_outputs {
  _Atomic size_t refs;
  void *buf[MAX_INPUTS];
} shared_outputs;

static void shared_unref(void *p) {
  shared_outputs *s = p;
  if (atomic_fetch_sub(&s->refs, 1) != 1) return;
  for (size_t i = 0; i < MAX_INPUTS; i++)
    moed_hostmem_free(s->buf[i]);
  free(s);
}

/* Runs reqs (same batch key, all still wanted) as one call along the first
 * axis. false: merging was refused (the caller runs them one by one). */
static bool run_merged(moed_server *srv, moe_backend *b, moed_infer_req **reqs, size_t n) {
  moed_infer_req *r0 = reqs[0];
  /* the call borrows the model's set: held until the call is gone, since
   * the requests (and their references) are freed as they are answered */
  moed_model *model = r0->model;
  atomic_fetch_add(&model->refs, 1);
  moe_named_tensor in[MAX_INPUTS];
  void *merged[MAX_INPUTS] = {NULL};
  void *host[MAX_INPUTS] = {NULL};
  shared_outputs *shared = NULL;
  run_ctx c;
  memset(&c, 0, sizeof c);
  c.srv = srv;
  c.b = b;
  bool ok = false;
  int64_t total = 0;
  for (size_t k = 0; k < n; k++)
    total += reqs[k]->rows; /* each <= max_batch_tokens: small */

  /* the merged inputs: rank >= 2 concatenated along axis 0, others shared */
  for (size_t i = 0; i < r0->n_in; i++) {
    in[i] = r0->in[i];
    const moe_tensor *t0 = &r0->in[i].tensor;
    if (t0->ndim < 2) continue;
    size_t row_bytes = t0->nbytes / (size_t)t0->shape[0], bytes;
    if (!moe_mul_size(row_bytes, (size_t)total, &bytes) || !(merged[i] = moed_hostmem_alloc(bytes))) goto out;
    size_t off = 0;
    for (size_t k = 0; k < n; k++) {
      const moed_infer_req *rk = reqs[k];
      for (size_t j = 0; j < rk->n_in; j++)
        if (strcmp(rk->in[j].name, in[i].name) == 0) {
          memcpy((uint8_t *)merged[i] + off, rk->in[j].tensor.data, rk->in[j].tensor.nbytes);
          off += rk->in[j].tensor.nbytes;
        }
    }
    if (off != bytes) goto out; /* the key guarantees it; never trust it blindly */
    in[i].tensor.data = merged[i];
    in[i].tensor.shape[0] = total;
    in[i].tensor.nbytes = bytes;
  }
  uint64_t start_ns = 0, compute_ns = 0;
  if (run_call(&c, r0->model, in, r0->n_in, r0->params, r0->n_params, host, &start_ns, &compute_ns)) goto out;
  /* every output must be row-major along the same rows to be split */
  moe_named_tensor outs[MAX_INPUTS];
  size_t out_row[MAX_INPUTS];
  for (size_t i = 0; i < c.num_out; i++) {
    outs[i] = *moe_call_output(c.call, i);
    const moe_tensor *t = &outs[i].tensor;
    if (t->ndim < 1 || t->shape[0] != total || t->nbytes % (size_t)total) goto out;
    out_row[i] = t->nbytes / (size_t)total;
  }
  record_execution(r0->model->stats, n, compute_ns);
  if (!(shared = calloc(1, sizeof *shared))) goto out;
  memcpy(shared->buf, host, sizeof host);
  memset(host, 0, sizeof host);
  atomic_init(&shared->refs, 1 + n * c.num_out);
  ok = true;
  int64_t row = 0;
  for (size_t k = 0; k < n; k++) {
    moed_infer_req *rk = reqs[k];
    moe_named_tensor mine[MAX_INPUTS];
    grpc_slice data[MAX_INPUTS];
    for (size_t i = 0; i < c.num_out; i++) {
      mine[i] = outs[i];
      mine[i].tensor.shape[0] = rk->rows;
      mine[i].tensor.nbytes = out_row[i] * (size_t)rk->rows;
      data[i] = grpc_slice_new_with_user_data((uint8_t *)shared->buf[i] + out_row[i] * (size_t)row,
                                              mine[i].tensor.nbytes, shared_unref, shared);
    }
    row += rk->rows;
    grpc_byte_buffer *resp = NULL;
    uint64_t bytes_out = 0;
    char err[600];
    grpc_status_code code = encode(srv, rk, mine, data, c.num_out, &resp, &bytes_out, err);
    for (size_t i = 0; i < c.num_out; i++)
      grpc_slice_unref(data[i]);
    finish_req(srv, rk, code, err, resp, start_ns, compute_ns, bytes_out);
    reqs[k] = NULL;
  }
  shared_unref(shared);
out:
  for (size_t i = 0; i < MAX_INPUTS; i++) {
    moed_hostmem_free(merged[i]);
    moed_hostmem_free(host[i]);
  }
  ctx_cleanup(&c);
  moed_model_release(model);
  return ok;
}

void moed_infer_run(moed_server *srv, moe_backend *b, moed_infer_req **reqs, size_t n) {
  size_t live = 0;
  for (size_t k = 0; k < n; k++) { /* answer what failed or is no longer wanted */
    moed_infer_req *r = reqs[k];
    char err[600];
    grpc_status_code code = r->code ? r->code : still_wanted(r->req->rpc, err);
    if (code)
      finish_req(srv, r, code, r->code ? r->err : err, NULL, 0, 0, 0);
    else
      reqs[live++] = r;
  }
  /* every request here is for one model (the batch key): an op this
   * backend has no kernel for runs on the worker's host fallback */
  if (live && b && !moe_op_supported(reqs[0]->model->op, b)) b = moed_devices_fallback(srv->devices, b);
  if (live > 1 && run_merged(srv, b, reqs, live)) return;
  for (size_t k = 0; k < live; k++)
    run_single(srv, b, reqs[k]);
}
