/* moe: a reader of the safetensors format (header JSON + raw little-endian
 * tensors), a file's bytes read into memory the object owns. Every dtype,
 * shape and offset is validated with overflow checks before a tensor is
 * handed out. */
#ifndef MOE_SAFETENSORS_H
#define MOE_SAFETENSORS_H

#include <stddef.h>

#include "moe/status.h"
#include "moe/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_safetensors moe_safetensors;

/* Opens and validates `path`: header length, JSON, each entry's dtype,
 * shape, data_offsets (ordered, inside the file, size = numel * dtype size).
 * The whole file is read into a page-aligned buffer the object owns (not
 * mapped), so later changes to the file, truncation included, do not reach
 * the tensors handed out; a file that shrinks or changes during the read
 * fails with MOE_EIO naming it (and the tensor when known). */
moe_status moe_safetensors_open(const char *path, moe_safetensors **out, moe_error *err);
/* Same over a caller-owned buffer (not copied; must outlive the object). */
moe_status moe_safetensors_open_buffer(const void *data, size_t size, moe_safetensors **out, moe_error *err);
void moe_safetensors_close(moe_safetensors *st);

size_t moe_safetensors_count(const moe_safetensors *st);
const char *moe_safetensors_name(const moe_safetensors *st, size_t i);
/* The tensor named `name` (data points into the object's buffer, valid
 * until moe_safetensors_close); MOE_ENOTFOUND
 * when absent. Safetensors dtypes map to ours: F32, F16, BF16, U8, I8, I32,
 * F8_E4M3 (fp8_e4m3fn), F8_E5M2; others are reported as unsupported. */
moe_status moe_safetensors_get(const moe_safetensors *st, const char *name, moe_tensor *out, moe_error *err);
/* The safetensors name of dtype t ("BF16", "F8_E4M3"); NULL when the format
 * has none. */
const char *moe_safetensors_dtype_name(moe_dtype t);
typedef struct moe_named_tensor moe_named_tensor;
/* The header of a file that holds `tensor` alone (its data, which the
 * caller writes, at offsets [0, nbytes)): malloc'ed JSON padded to a
 * multiple of 8, *len its length, without the 8-byte length prefix. NULL
 * when the dtype has no safetensors name or memory runs out. */
char *moe_safetensors_header(const moe_named_tensor *tensor, size_t *len);

/* Writes tensors to `path` in safetensors format (used by the synthetic
 * expert-set writer and by tests). */
moe_status moe_safetensors_write(const char *path, const moe_named_tensor *tensors, size_t n, moe_error *err);

#ifdef __cplusplus
}
#endif
#endif
