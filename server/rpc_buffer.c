/* rpc_buffer: gRPC byte buffers to bytes and back: a received message
 * flattened (shared when it is one slice), a malloc'ed buffer or a packed
 * protobuf message made a byte buffer to send. */
#include <grpc/byte_buffer_reader.h>
#include <stdlib.h>
#include <string.h>

#include "moed.h"

grpc_slice moed_rpc_flatten(grpc_byte_buffer *bb) {
  grpc_byte_buffer_reader rd;
  if (!bb) return grpc_empty_slice();
  /* one uncompressed slice (small messages): shared, not copied */
  if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE &&
      bb->data.raw.slice_buffer.count == 1)
    return grpc_slice_ref(bb->data.raw.slice_buffer.slices[0]);
  if (!grpc_byte_buffer_reader_init(&rd, bb)) return grpc_empty_slice();
  if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE) {
    /* many slices (a large message): one copy into a reusable buffer */
    size_t len = grpc_byte_buffer_length(bb), off = 0;
    uint8_t *p = moed_hostmem_alloc(len);
    grpc_slice piece;
    while (p && grpc_byte_buffer_reader_next(&rd, &piece)) {
      size_t n = GRPC_SLICE_LENGTH(piece);
      if (n > len - off) n = len - off; /* never: the length is the slices' sum */
      memcpy(p + off, GRPC_SLICE_START_PTR(piece), n);
      off += n;
      grpc_slice_unref(piece);
    }
    grpc_byte_buffer_reader_destroy(&rd);
    return p ? moed_hostmem_slice(p, off) : grpc_empty_slice();
  }
  grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
  grpc_byte_buffer_reader_destroy(&rd);
  return s;
}

grpc_byte_buffer *moed_rpc_buffer_take(void *data, size_t len) {
  grpc_slice s = grpc_slice_new(data ? data : malloc(1), len, free);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

grpc_byte_buffer *moed_rpc_pack(const ProtobufCMessage *m) {
  size_t n = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) return NULL;
  protobuf_c_message_pack(m, buf);
  return moed_rpc_buffer_take(buf, n);
}
