/* kserve_wire: KServe messages at the wire level (see kserve_wire.h). Every
 * byte read here is untrusted: each length is checked against what is left
 * before it is used. */
#include "kserve_wire.h"

#include <stdio.h>
#include <string.h>

#include "moed.h"

/* Field numbers (proto/grpc_service.proto) of what is read or written here. */
enum {
  REQUEST_PARAMETERS = 4,           /* ModelInferRequest.parameters (map entries: key 1, value 2) */
  REQUEST_INPUTS = 5,               /* ModelInferRequest.inputs */
  INPUT_PARAMETERS = 4,             /* InferInputTensor.parameters (map entries, as above) */
  PARAM_INT64 = 2,                  /* InferParameter.int64_param */
  PARAM_UINT64 = 5,                 /* InferParameter.uint64_param */
  REQUEST_RAW_INPUT_CONTENTS = 7,   /* ModelInferRequest.raw_input_contents */
  RESPONSE_RAW_OUTPUT_CONTENTS = 6, /* ModelInferResponse.raw_output_contents */
  STREAM_INFER_RESPONSE = 2,        /* ModelStreamInferResponse.infer_response */
};

#define SMALL_RESPONSE 16384 /* responses up to this size are sent as one slice */

/* ---- varints ---------------------------------------------------------------------------- */

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

static size_t put_varint(uint8_t *p, uint64_t v) {
  size_t n = 0;
  do {
    uint8_t b = v & 0x7F;
    v >>= 7;
    p[n++] = b | (v ? 0x80 : 0);
  } while (v);
  return n;
}

/* The tag and length of a length-delimited field; for the field numbers
 * here (< 16) at most 11 bytes. */
static size_t put_len_header(uint8_t *p, uint32_t field, uint64_t len) {
  size_t n = put_varint(p, ((uint64_t)field << 3) | MOED_WIRE_LEN);
  return n + put_varint(p + n, len);
}

static const char *string_fault(const uint8_t *s, size_t n);

/* ---- the field iterator ------------------------------------------------------------------ */

moed_wire_iter moed_wire_begin(const uint8_t *p, size_t n, bool prefix) {
  return (moed_wire_iter){.p = p, .n = n, .prefix = prefix};
}

static bool stop_bad(moed_wire_iter *it) {
  it->bad = true;
  return false;
}

bool moed_wire_next(moed_wire_iter *it, moed_wire_field *f) {
  const uint8_t *p = it->p;
  size_t n = it->n, pos = it->pos;
  if (it->bad || pos >= n) return false;
  uint64_t tag, v;
  if (!read_varint(p, n, &pos, &tag) || (tag >> 3) == 0 || (tag >> 3) > UINT32_MAX) return stop_bad(it);
  f->number = (uint32_t)(tag >> 3);
  f->type = (uint32_t)(tag & 7);
  f->varint = 0;
  f->start = it->pos;
  f->at = pos;
  switch (f->type) {
  case MOED_WIRE_VARINT:
    if (!read_varint(p, n, &pos, &f->varint)) return stop_bad(it);
    f->len = pos - f->at;
    break;
  case MOED_WIRE_FIXED64:
  case MOED_WIRE_FIXED32:
    f->len = f->type == MOED_WIRE_FIXED64 ? 8 : 4;
    if (n - pos < f->len) return stop_bad(it);
    pos += f->len;
    break;
  case MOED_WIRE_LEN:
    if (!read_varint(p, n, &pos, &v)) return stop_bad(it);
    f->at = pos;
    if (v <= n - pos) {
      f->len = (size_t)v;
    } else if (it->prefix) { /* the value goes on past the bytes we have: nothing follows it here */
      f->len = n - pos;
    } else {
      return stop_bad(it);
    }
    pos += f->len;
    break;
  default: return stop_bad(it); /* groups and reserved wire types: not these messages */
  }
  f->end = it->pos = pos;
  return true;
}

/* ---- ModelInferRequest ------------------------------------------------------------------ */

bool moed_kserve_split_raw(const uint8_t *p, size_t n, uint8_t *rest, size_t *rest_len,
                           ProtobufCBinaryData *raw, size_t *n_raw) {
  size_t rl = 0, nr = 0;
  moed_wire_iter it = moed_wire_begin(p, n, false);
  moed_wire_field f;
  while (moed_wire_next(&it, &f)) {
    if (f.number == REQUEST_RAW_INPUT_CONTENTS) {
      if (f.type != MOED_WIRE_LEN) return false; /* raw contents must be length-delimited */
      if (raw) raw[nr] = (ProtobufCBinaryData){f.len, (uint8_t *)p + f.at};
      nr++;
      continue;
    }
    if (rest) memcpy(rest + rl, p + f.start, f.end - f.start);
    rl += f.end - f.start;
  }
  if (it.bad) return false;
  *rest_len = rl;
  *n_raw = nr;
  return true;
}

void moed_kserve_string(const uint8_t *p, size_t n, bool prefix, moed_kserve_string_field field, char *out,
                        size_t size) {
  moed_wire_iter it = moed_wire_begin(p, n, prefix);
  moed_wire_field f;
  out[0] = 0;
  /* the last such field, as protobuf-c (any protobuf parser) decodes a
   * string given twice: the first one would let a message name a cheap op
   * here and an expert set when decoded (the inline fast path's choice) */
  while (moed_wire_next(&it, &f)) {
    if (f.number != (uint32_t)field || f.type != MOED_WIRE_LEN) continue;
    out[0] = 0;
    /* one holding a NUL is left out (cut there it would name something
     * else), and one not UTF-8 (echoed, it would make the answer unparseable) */
    if (f.len < size && (!prefix || f.at + f.len < n) && !string_fault(p + f.at, f.len)) {
      memcpy(out, p + f.at, f.len);
      out[f.len] = 0;
    }
  }
}

/* InferParameter m[0..n)'s integer; -1: none, or negative. */
static int64_t param_int(const uint8_t *m, size_t n) {
  moed_wire_iter it = moed_wire_begin(m, n, false);
  moed_wire_field f;
  while (moed_wire_next(&it, &f))
    if ((f.number == PARAM_INT64 || f.number == PARAM_UINT64) && f.type == MOED_WIRE_VARINT)
      return f.varint <= INT64_MAX ? (int64_t)f.varint : -1; /* a negative int64 is a huge varint */
  return -1;
}

/* Map entry m[0..n) (key 1, InferParameter 2): whether its key is `key`
 * (klen bytes), and its integer into *v (param_int's; -1: none). */
static bool entry_int(const uint8_t *m, size_t n, const char *key, size_t klen, int64_t *v) {
  moed_wire_iter e = moed_wire_begin(m, n, false);
  moed_wire_field k;
  bool match = false;
  *v = -1;
  while (moed_wire_next(&e, &k)) {
    if (k.number == 1 && k.type == MOED_WIRE_LEN)
      match = k.len == klen && memcmp(m + k.at, key, klen) == 0;
    else if (k.number == 2 && k.type == MOED_WIRE_LEN)
      *v = param_int(m + k.at, k.len);
  }
  return match;
}

int64_t moed_kserve_int_param(const uint8_t *p, size_t n, bool prefix, const char *key) {
  const size_t klen = strlen(key);
  moed_wire_iter it = moed_wire_begin(p, n, prefix);
  moed_wire_field f;
  int64_t v;
  while (moed_wire_next(&it, &f)) {
    if (f.number != REQUEST_PARAMETERS || f.type != MOED_WIRE_LEN || (prefix && f.at + f.len >= n)) continue;
    if (entry_int(p + f.at, f.len, key, klen, &v)) return v;
  }
  return -1;
}

bool moed_kserve_input_param_sum(const uint8_t *p, size_t n, const char *key, uint64_t cap, uint64_t *sum) {
  const size_t klen = strlen(key);
  moed_wire_iter it = moed_wire_begin(p, n, false);
  moed_wire_field f, g;
  *sum = 0;
  while (moed_wire_next(&it, &f)) {
    if (f.number != REQUEST_INPUTS || f.type != MOED_WIRE_LEN) continue;
    moed_wire_iter t = moed_wire_begin(p + f.at, f.len, false);
    while (moed_wire_next(&t, &g)) {
      int64_t v;
      if (g.number != INPUT_PARAMETERS || g.type != MOED_WIRE_LEN ||
          !entry_int(p + f.at + g.at, g.len, key, klen, &v))
        continue;
      if (v < 0) return false;
      *sum = (uint64_t)v > cap - *sum ? cap + 1 : *sum + (uint64_t)v;
      if (*sum > cap) return true;
    }
    if (t.bad) return false;
  }
  return !it.bad;
}

/* Whether s[0..n) is UTF-8 as protobuf requires of a string: no overlong
 * forms, no surrogates, nothing past U+10FFFF. */
static bool utf8_ok(const uint8_t *s, size_t n) {
  for (size_t i = 0; i < n;) {
    const uint8_t c = s[i];
    size_t len;
    uint32_t cp, min;
    if (c < 0x80) {
      i++;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; k++) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
      cp = cp << 6 | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

/* Why string s[0..n) cannot be taken as it is, or NULL. */
static const char *string_fault(const uint8_t *s, size_t n) {
  if (memchr(s, 0, n)) return "contains a NUL byte";
  /* proto3 strings are UTF-8: echoed into an answer (an id, an error
   * message) it would make the answer one that stock clients' protobuf
   * refuses to parse ("Exception deserializing response"), ending their
   * stream */
  if (!utf8_ok(s, n)) return "not valid UTF-8";
  return NULL;
}

/* The walk of moed_wire_bad_string below: p[0..n) as a message of d, its
 * path so far in field[0..used); depth bounds the recursion (the KServe
 * messages nest 4 deep: request, tensor, parameter map entry, parameter). */
static const char *bad_walk(const ProtobufCMessageDescriptor *d, const uint8_t *p, size_t n, char *field,
                            size_t size, size_t used, int depth) {
  size_t seen[64] = {0}; /* per field of d: repeated values seen so far (their index) */
  moed_wire_iter it = moed_wire_begin(p, n, false);
  moed_wire_field f;
  while (moed_wire_next(&it, &f)) {
    const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field(d, f.number);
    if (!fd || f.type != MOED_WIRE_LEN) continue;
    const size_t i = (size_t)(fd - d->fields);
    const size_t k = i < 64 ? seen[i]++ : 0;
    const char *fault = fd->type == PROTOBUF_C_TYPE_STRING ? string_fault(p + f.at, f.len) : NULL;
    const bool sub = fd->type == PROTOBUF_C_TYPE_MESSAGE && depth < 8;
    if (!fault && !sub) continue;
    int w = fd->label == PROTOBUF_C_LABEL_REPEATED
                ? snprintf(field + used, size - used, "%s%s[%zu]", used ? "." : "", fd->name, k)
                : snprintf(field + used, size - used, "%s%s", used ? "." : "", fd->name);
    const size_t at = w < 0 || (size_t)w >= size - used ? size - 1 : used + (size_t)w;
    if (fault) return fault;
    if ((fault = bad_walk(fd->descriptor, p + f.at, f.len, field, size, at, depth + 1))) return fault;
    field[used] = 0;
  }
  return NULL;
}

const char *moed_wire_bad_string(const ProtobufCMessageDescriptor *d, const uint8_t *p, size_t n, char *field,
                                 size_t size) {
  if (!size) return NULL;
  field[0] = 0;
  return bad_walk(d, p, n, field, size, 0, 0);
}

const char *moed_kserve_bad_field(const uint8_t *p, size_t n, char *field, size_t size) {
  return moed_wire_bad_string(&inference__model_infer_request__descriptor, p, n, field, size);
}

size_t moed_kserve_raw_at(const uint8_t *p, size_t n) {
  moed_wire_iter it = moed_wire_begin(p, n, true);
  moed_wire_field f;
  while (moed_wire_next(&it, &f)) /* the fields before the first raw contents (small) */
    if (f.number == REQUEST_RAW_INPUT_CONTENTS && f.type == MOED_WIRE_LEN) return f.at;
  return 0;
}

/* ---- ModelInferResponse ----------------------------------------------------------------- */

/* tritonclient's stream option enable_empty_final_response (the request
 * parameter triton_enable_empty_final_response true): its users read each
 * response's triton_final_response to know a request is done, and wait on
 * until one says true. moed answers every request with one response, so
 * that response is the final one and says so, as Triton's does for a model
 * that is not decoupled. */
static bool wants_final_flag(const Inference__ModelInferRequest *q) {
  for (size_t i = 0; i < q->n_parameters; i++) {
    const Inference__ModelInferRequest__ParametersEntry *e = q->parameters[i];
    if (e->key && !strcmp(e->key, "triton_enable_empty_final_response") && e->value &&
        e->value->parameter_choice_case == INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_BOOL_PARAM)
      return e->value->bool_param;
  }
  return false;
}

grpc_status_code moed_kserve_encode(const Inference__ModelInferRequest *q, const char *model, bool stream,
                                    size_t max_bytes, const moe_named_tensor *outs, const grpc_slice *data,
                                    size_t num_out, grpc_byte_buffer **out, uint64_t *bytes_out, char *err) {
  Inference__ModelInferResponse resp = INFERENCE__MODEL_INFER_RESPONSE__INIT;
  Inference__ModelInferResponse__InferOutputTensor ot[MOED_MAX_TENSORS];
  Inference__ModelInferResponse__InferOutputTensor *otp[MOED_MAX_TENSORS];
  Inference__ModelInferResponse__InferOutputTensor__ParametersEntry pe[MOED_MAX_TENSORS],
      *pep[MOED_MAX_TENSORS];
  Inference__InferParameter pv[MOED_MAX_TENSORS];
  int64_t shapes[MOED_MAX_TENSORS][MOE_MAX_DIMS];
  size_t sel[MOED_MAX_TENSORS], nsel = 0;

  /* requested outputs, or all of them */
  if (q->n_outputs) {
    if (q->n_outputs > MOED_MAX_TENSORS)
      return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "outputs: too many requested");
    for (size_t k = 0; k < q->n_outputs; k++) {
      size_t j = num_out;
      for (size_t i = 0; i < num_out; i++)
        if (q->outputs[k]->name && strcmp(outs[i].name, q->outputs[k]->name) == 0) j = i;
      if (j == num_out)
        return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "outputs[%zu]: model %s has no output '%s'", k,
                          model, q->outputs[k]->name ? q->outputs[k]->name : "");
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
  resp.model_name = (char *)model;
  resp.model_version = "1";
  resp.id = q->id;
  resp.n_outputs = nsel;
  resp.outputs = otp;
  Inference__ModelInferResponse__ParametersEntry final =
      INFERENCE__MODEL_INFER_RESPONSE__PARAMETERS_ENTRY__INIT;
  Inference__ModelInferResponse__ParametersEntry *finalp = &final;
  Inference__InferParameter final_v = INFERENCE__INFER_PARAMETER__INIT;
  if (stream && wants_final_flag(q)) {
    final_v.parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_BOOL_PARAM;
    final_v.bool_param = true;
    final.key = "triton_final_response";
    final.value = &final_v;
    resp.n_parameters = 1;
    resp.parameters = &finalp;
  }

  size_t hdr_len = inference__model_infer_response__get_packed_size(&resp);
  size_t total = hdr_len;
  uint8_t prefixes[MOED_MAX_TENSORS][11];
  size_t prefix_len[MOED_MAX_TENSORS];
  for (size_t k = 0; k < nsel; k++) {
    size_t nb = GRPC_SLICE_LENGTH(data[sel[k]]);
    prefix_len[k] = put_len_header(prefixes[k], RESPONSE_RAW_OUTPUT_CONTENTS, nb);
    if (!moe_add_size(total, prefix_len[k], &total) || !moe_add_size(total, nb, &total))
      return moed_failf(err, GRPC_STATUS_RESOURCE_EXHAUSTED, "response too large");
  }
  if (total > max_bytes)
    return moed_failf(err, GRPC_STATUS_RESOURCE_EXHAUSTED,
                      "response of %zu bytes exceeds the message limit %zu", total, max_bytes);

  /* the small pieces (wrapper, header, field prefixes) share one slice */
  size_t small = 11 + hdr_len;
  for (size_t k = 0; k < nsel; k++)
    small += prefix_len[k];
  grpc_slice head = grpc_slice_malloc(small);
  uint8_t *hp = GRPC_SLICE_START_PTR(head);
  size_t off = 0;
  if (stream) off += put_len_header(hp + off, STREAM_INFER_RESPONSE, total);
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
  grpc_slice slices[1 + 2 * MOED_MAX_TENSORS];
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
