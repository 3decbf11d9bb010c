/* libFuzzer: a KServe v2 REST infer body as the REST port gets it (JSON
 * tensors, Triton's binary-data extension with Inference-Header-Content-Length),
 * turned into a ModelInferRequest by rest.c and then decoded and validated
 * as every infer request is (fuzz_infer_common.h). Input: byte 0 picks the
 * model, byte 1 the header-length case (0: none, 1: bytes 2..5 little
 * endian, 2: not a number), the body from byte 6. A refusal must be 400,
 * 413 or 500 with a message. */
#include <stdint.h>
#include <string.h>

#include "fuzz_infer_common.h"

static const char *const models[] = {"quant.per_tensor", "quant.per_token",    "quant.per_token_group",
                                     "quant.mx",         "dequant.per_tensor", "dequant.mx",
                                     "moe.topk",         "fused_moe"};

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  fuzz_server_init((*argv)[0]);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 6) return 0;
  const char *model = models[data[0] % (sizeof models / sizeof models[0])];
  const int64_t hlen = data[1] % 3 == 0   ? -1
                       : data[1] % 3 == 2 ? -2
                                          : (int64_t)((uint32_t)data[2] | (uint32_t)data[3] << 8 |
                                                      (uint32_t)data[4] << 16 | (uint32_t)data[5] << 24);
  int code = 0;
  char why[MOED_ERR_LEN] = "";
  grpc_byte_buffer *m =
      moed_rest_infer_message(&fuzz_cfg, (const char *)data + 6, size - 6, hlen, model, &code, why);
  if (!m) {
    if ((code != 400 && code != 413 && code != 500) || !why[0]) abort();
    return 0;
  }
  fuzz_decode_and_prepare(m);
  return 0;
}
