/* The KServe datatype table (kserve_types.h). */
#include "kserve_types.h"

#include <string.h>

#include "model_config.pb-c.h"

static const moed_kserve_type types[] = {
    {"FP32", MOE_F32, 4, INFERENCE__DATA_TYPE__TYPE_FP32, "<f4"},
    {"FP16", MOE_F16, 2, INFERENCE__DATA_TYPE__TYPE_FP16, "<f2"},
    {"BF16", MOE_BF16, 2, INFERENCE__DATA_TYPE__TYPE_BF16, "<u2"},
    {"UINT8", MOE_UINT8, 1, INFERENCE__DATA_TYPE__TYPE_UINT8, "|u1"},
    {"INT8", MOE_INT8, 1, INFERENCE__DATA_TYPE__TYPE_INT8, "|i1"},
    {"INT32", MOE_INT32, 4, INFERENCE__DATA_TYPE__TYPE_INT32, "<i4"},
};
#define NTYPES (sizeof types / sizeof types[0])

const moed_kserve_type *moed_kserve_by_name(const char *name) {
  for (size_t i = 0; name && i < NTYPES; i++)
    if (strcmp(types[i].name, name) == 0) return &types[i];
  return NULL;
}

const moed_kserve_type *moed_kserve_by_dtype(moe_dtype t) {
  for (size_t i = 0; i < NTYPES; i++)
    if (types[i].dtype == t) return &types[i];
  return NULL;
}

const moed_kserve_type *moed_kserve_by_npy(const char *descr) {
  for (size_t i = 0; descr && i < NTYPES; i++)
    if (strcmp(types[i].npy, descr) == 0) return &types[i];
  return NULL;
}

const char *moed_kserve_datatype(moe_dtype t) {
  const moed_kserve_type *k = moed_kserve_by_dtype(t);
  return k ? k->name : "UINT8";
}
