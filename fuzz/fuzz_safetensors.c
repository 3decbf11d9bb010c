/* libFuzzer: the safetensors reader on arbitrary bytes (kernels/model/
 * safetensors.c). Every accepted file must hand out tensors that lie inside
 * the buffer with nbytes = shape x dtype. */
#include <stdint.h>
#include <stdlib.h>

#include "moe/ops.h"
#include "moe/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  moe_safetensors *st = NULL;
  moe_error err;
  if (moe_safetensors_open_buffer(data, size, &st, &err) != MOE_OK) return 0;
  for (size_t i = 0; i < moe_safetensors_count(st); i++) {
    moe_tensor t;
    if (moe_safetensors_get(st, moe_safetensors_name(st, i), &t, &err) != MOE_OK) continue;
    const uint8_t *p = t.data;
    size_t numel = 1;
    for (int d = 0; d < t.ndim; d++)
      numel *= (size_t)t.shape[d];
    if (p < data || p + t.nbytes > data + size || numel * moe_dtype_bits(t.dtype) / 8 != t.nbytes) abort();
  }
  moe_safetensors_close(st);
  return 0;
}
