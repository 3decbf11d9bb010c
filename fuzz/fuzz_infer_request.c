/* libFuzzer: a ModelInferRequest as moed receives it over gRPC, decoded and
 * validated as the server does before running anything
 * (fuzz_infer_common.h), and the region sizes the gRPC thread reads off
 * the wire first. */
#include <stdint.h>

#include "fuzz_infer_common.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  fuzz_server_init((*argv)[0]);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  (void)moed_infer_shm_small(data, size); /* the fast path's wire walk of the same bytes (infer_shm.c) */
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)data, size);
  grpc_byte_buffer *payload = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  fuzz_decode_and_prepare(payload);
  return 0;
}
