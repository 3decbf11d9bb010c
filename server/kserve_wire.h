/* kserve_wire: the KServe messages at the wire level, where moed reads and
 * writes them itself instead of through protobuf-c (which would copy every
 * tensor byte): one field iterator for everything read, the request's raw
 * contents located in place, and the response encoder that hands each
 * output to gRPC as its own slice. The datatype table is
 * proto/kserve_types.h (shared with moec). */
#ifndef MOED_KSERVE_WIRE_H
#define MOED_KSERVE_WIRE_H

#include <grpc/grpc.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "grpc_service.pb-c.h"
#include "moe/ops.h"

/* Tensors of one request (inputs) or of one response (outputs). */
#define MOED_MAX_TENSORS 24

/* ---- reading: one field iterator ------------------------------------------------------ */

/* The wire types these messages use; groups and the reserved types never
 * occur in them, so the iterator treats them as malformed. */
enum { MOED_WIRE_VARINT = 0, MOED_WIRE_FIXED64 = 1, MOED_WIRE_LEN = 2, MOED_WIRE_FIXED32 = 5 };

/* One top-level field, as offsets into the walked bytes. */
typedef struct moed_wire_field {
  uint32_t number;
  uint32_t type;     /* MOED_WIRE_* */
  uint64_t varint;   /* MOED_WIRE_VARINT: the value */
  size_t start, end; /* the whole field, tag included */
  size_t at, len;    /* its value (MOED_WIRE_LEN: without the length) */
} moed_wire_field;

typedef struct moed_wire_iter {
  const uint8_t *p;
  size_t n, pos;
  bool prefix; /* see moed_wire_begin */
  bool bad;    /* the walk stopped at bytes that are not a field */
} moed_wire_iter;

/* Walks the top-level fields of the message in p[0..n). With `prefix`, p
 * holds only the message's first bytes (the first slice of a large one): a
 * length-delimited value may then run past n; it is returned cut (len: the
 * bytes present) and is the last field of the walk. */
moed_wire_iter moed_wire_begin(const uint8_t *p, size_t n, bool prefix);
/* The next field into *f; false at the end, or at malformed bytes (bad set). */
bool moed_wire_next(moed_wire_iter *it, moed_wire_field *f);

/* Why a string field of the message p[0..n) of type d, nested messages
 * included, cannot be taken ("contains a NUL byte": protobuf-c cuts a
 * string at it, so "good\0x" would name set "good"; "not valid UTF-8":
 * proto3 strings are UTF-8, and one echoed into an answer would make it
 * unparseable), or NULL: every request moed unpacks is checked, and refused
 * naming the field, whose path (parameters[0].key) goes to field[0..size).
 * Malformed bytes stop the walk (the unpack refuses them). */
const char *moed_wire_bad_string(const ProtobufCMessageDescriptor *d, const uint8_t *p, size_t n, char *field,
                                 size_t size);

/* ---- ModelInferRequest ------------------------------------------------------------------ */

/* Splits a ModelInferRequest: raw_input_contents are recorded in place
 * (raw[], pointing into p), the other fields' bytes are copied to `rest`
 * (small: names, shapes, parameters) for protobuf-c. With rest and raw
 * NULL, only counts (*rest_len, *n_raw). false: not a well-formed message. */
bool moed_kserve_split_raw(const uint8_t *p, size_t n, uint8_t *rest, size_t *rest_len,
                           ProtobufCBinaryData *raw, size_t *n_raw);
/* The string fields of a ModelInferRequest read before decoding. */
typedef enum moed_kserve_string_field {
  MOED_KSERVE_MODEL_NAME = 1, /* ModelInferRequest.model_name */
  MOED_KSERVE_ID = 3,         /* ModelInferRequest.id */
} moed_kserve_string_field;
/* The last such field of the message p[0..n) (protobuf's rule for a field
 * given twice; prefix: of its first bytes only, as moed_wire_begin) into
 * out[0..size) ("" when there is none, it does not fit, it may be cut, or
 * it holds a NUL; of a malformed message, the last one before the fault). */
void moed_kserve_string(const uint8_t *p, size_t n, bool prefix, moed_kserve_string_field field, char *out,
                        size_t size);
/* The integer value of request parameter `key` in the message p[0..n)
 * (prefix: its first bytes only, as moed_wire_begin; parameters are field
 * 4, ahead of the tensors in every encoder we know); -1 when it is absent,
 * not an integer >= 0, or not within those bytes. */
int64_t moed_kserve_int_param(const uint8_t *p, size_t n, bool prefix, const char *key);
/* The sum over the inputs of the ModelInferRequest p[0..n) of their
 * integer parameter `key`, without unpacking it; once over cap, cap + 1.
 * false: a value that is not an integer >= 0, or malformed bytes. */
bool moed_kserve_input_param_sum(const uint8_t *p, size_t n, const char *key, uint64_t cap, uint64_t *sum);
/* moed_wire_bad_string of the ModelInferRequest p[0..n) (model_name,
 * model_version, id, a tensor's name or datatype, a parameter's key or
 * string value, at any depth: "a\0b" would name model "a"). */
const char *moed_kserve_bad_field(const uint8_t *p, size_t n, char *field, size_t size);
/* Where the data of the first raw_input_contents starts in a message whose
 * first bytes are p[0..n); 0: not within them. */
size_t moed_kserve_raw_at(const uint8_t *p, size_t n);

/* ---- ModelInferResponse ----------------------------------------------------------------- */

/* The response to q from model `model`: the message without its raw
 * contents packed by protobuf-c, then each output as a raw_output_contents
 * field whose bytes are the slice data[i] itself (referenced, not copied;
 * protobuf allows any field order). Only the outputs q asks for, or all of
 * outs[0..num_out). With `stream`, wrapped as
 * ModelStreamInferResponse.infer_response. Over max_bytes it fails;
 * bytes_out grows by the output bytes sent; on failure err (MOED_ERR_LEN)
 * says why. */
grpc_status_code moed_kserve_encode(const Inference__ModelInferRequest *q, const char *model, bool stream,
                                    size_t max_bytes, const moe_named_tensor *outs, const grpc_slice *data,
                                    size_t num_out, grpc_byte_buffer **out, uint64_t *bytes_out, char *err);

#endif
