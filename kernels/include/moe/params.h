/* moe: op parameters, as they arrive in a KServe request's `parameters` map. */
#ifndef MOE_PARAMS_H
#define MOE_PARAMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum moe_param_type {
  MOE_PARAM_STRING = 0,
  MOE_PARAM_BOOL,
  MOE_PARAM_INT,
  MOE_PARAM_DOUBLE,
} moe_param_type;

/* Flat (no union) so that ctypes and other FFIs can build it directly.
 * Only the member named by `type` is read. */
typedef struct moe_param {
  const char *name;
  moe_param_type type;
  const char *s;
  bool b;
  int64_t i;
  double d;
} moe_param;

typedef struct moe_params {
  const moe_param *items;
  size_t count;
} moe_params;

/* Typed getters. Each returns MOE_OK and writes *out when the parameter is
 * present with a usable type, MOE_OK leaving *out (the default) untouched when
 * absent, and MOE_EINVAL naming the parameter when it has the wrong type or
 * value. Ints are accepted for doubles; "true"/"false" strings for bools and
 * decimal strings for ints/doubles (some clients send every value as string). */
moe_status moe_params_string(const moe_params *p, const char *name, const char **out, moe_error *err);
moe_status moe_params_bool(const moe_params *p, const char *name, bool *out, moe_error *err);
moe_status moe_params_int(const moe_params *p, const char *name, int64_t *out, moe_error *err);
moe_status moe_params_double(const moe_params *p, const char *name, double *out, moe_error *err);
/* A string parameter that must be one of `choices` (NULL-terminated); *out is
 * the index. Absent: *out untouched. */
moe_status moe_params_choice(const moe_params *p, const char *name, const char *const *choices, int *out,
                             moe_error *err);
/* True when a parameter of that name is present. */
bool moe_params_has(const moe_params *p, const char *name);

#ifdef __cplusplus
}
#endif
#endif
