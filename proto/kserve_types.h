/* The KServe v2 tensor datatypes moed and moec speak: one table that maps
 * each wire name to moe's dtype, its element size, the model-config enum
 * (ModelMetadata/ModelConfig) and the numpy descriptor moec reads and
 * writes. Narrow formats (fp8, fp4, e8m0) travel as UINT8 bytes. */
#ifndef MOED_KSERVE_TYPES_H
#define MOED_KSERVE_TYPES_H

#include <stddef.h>

#include "moe/tensor.h"

typedef struct moed_kserve_type {
  const char *name; /* "FP32", "BF16", ... */
  moe_dtype dtype;
  size_t size;     /* bytes per element */
  int config_type; /* Inference__DataType (model_config.proto) */
  const char *npy; /* numpy descr: "<f4"; bf16 as "<u2" */
} moed_kserve_type;

/* NULL when the name, dtype or descriptor is not on the wire. */
const moed_kserve_type *moed_kserve_by_name(const char *name);
const moed_kserve_type *moed_kserve_by_dtype(moe_dtype t);
const moed_kserve_type *moed_kserve_by_npy(const char *descr);
/* The wire name a tensor of dtype t travels as ("UINT8" for narrow formats). */
const char *moed_kserve_datatype(moe_dtype t);

#endif
