/* model_desc: what a model shows to clients, whatever the protocol: each
 * input and output with its datatypes and shape, and Triton's
 * max_batch_size, from the op table (moe_op_io_desc,
 * kernels/include/moe/ops.h), the model's expert set and the server's
 * flags. ModelMetadata and ModelConfig (handlers_model.c) render it as protobuf;
 * a REST front end renders the same description as JSON. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "moed.h"

/* The first dtype of a comma-separated list, as a KServe datatype (the
 * protocol has one per tensor; the op accepts every one in the list). */
static const char *first_datatype(const char *list) {
  char first[32];
  size_t n = strcspn(list, ",");
  if (n >= sizeof first) n = sizeof first - 1;
  memcpy(first, list, n);
  first[n] = 0;
  moe_dtype t = moe_dtype_from_name(first);
  return t == MOE_DTYPE_INVALID ? "UINT8" : moed_kserve_datatype(t);
}

/* The size of axis `name` (moe_op_io_desc.axes) for model m: an expert set
 * fixes H and E, a number is itself; anything else is free (-1). The top-k
 * width k stays free: topk_ids of any width are taken. */
static int64_t axis_size(const moed_model *m, const char *name, size_t len) {
  if (m->set && len == 1 && name[0] == 'H') return m->set->cfg.hidden_size;
  if (m->set && len == 1 && name[0] == 'E') return m->set->cfg.global_num_experts;
  int64_t v = 0;
  for (size_t i = 0; i < len; i++) {
    if (name[i] < '0' || name[i] > '9' || v > INT32_MAX) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return len ? v : -1;
}

static void tensor_desc(const moed_model *m, const moe_op_io_desc *d, moed_tensor_desc *out) {
  out->name = d->name;
  out->optional = d->optional;
  /* an expert set computes in one activation dtype: advertise only it */
  out->dtypes = m->set && (d->flags & MOE_IO_ACTIVATION) ? moe_expert_set_act_dtypes(m->set) : d->dtypes;
  out->datatype = first_datatype(out->dtypes);
  out->rank = 0;
  for (const char *a = d->axes; *a && out->rank < MOE_MAX_DIMS;) {
    size_t len = strcspn(a, ",");
    out->shape[out->rank++] = axis_size(m, a, len);
    a += len + (a[len] == ',');
  }
}

/* Whether model m shows input d: an expert set hides the inputs it holds
 * (its weights, its correction_bias: the op rejects them inline). */
static bool shown(const moed_model *m, const moe_op_io_desc *d, bool input) {
  return !(input && m->set && (d->flags & MOE_INPUT_SET_HELD));
}

/* Triton's max_batch_size: > 0 says every input and output has a first,
 * batch axis along which the server merges requests, and clients
 * (perf_analyzer) then send [batch] + dims. moed merges along the token
 * axis T up to max_batch_tokens rows, so a model that batches and whose
 * every tensor starts with T says max_batch_tokens. A model with a tensor
 * without that axis (a shared static scale, a bias) says 0 even where the
 * server merges its requests: a batch axis prepended to such a tensor
 * would be rejected. Read per request (statistics): no shapes built. */
int32_t moed_model_max_batch_size(const moed_server *s, const moed_model *m) {
  if (!moed_model_batches(s, m)) return 0;
  const moe_op_info *info = moe_op_describe(m->op);
  for (int side = 0; side < 2; side++) {
    const moe_op_io_desc *v = side == 0 ? info->inputs : info->outputs;
    size_t n = side == 0 ? info->num_inputs : info->num_outputs;
    for (size_t i = 0; i < n; i++)
      if (shown(m, &v[i], side == 0) && (v[i].axes[0] != 'T' || strcspn(v[i].axes, ",") != 1)) return 0;
  }
  return (int32_t)s->cfg->max_batch_tokens; /* the flag's range is at most INT32_MAX */
}

void moed_model_describe(const moed_server *s, const moed_model *m, moed_model_desc *out) {
  const moe_op_info *info = moe_op_describe(m->op);
  out->n_in = out->n_out = 0;
  for (size_t i = 0; i < info->num_inputs && out->n_in < MOED_MAX_IO; i++)
    if (shown(m, &info->inputs[i], true)) tensor_desc(m, &info->inputs[i], &out->in[out->n_in++]);
  for (size_t i = 0; i < info->num_outputs && out->n_out < MOED_MAX_IO; i++)
    tensor_desc(m, &info->outputs[i], &out->out[out->n_out++]);
  out->max_batch_size = moed_model_max_batch_size(s, m);
  out->rows_independent = info->rows_independent;
}

char *moed_model_datatypes_json(const moed_model_desc *d) {
  cJSON *root = cJSON_CreateObject();
  bool any = false;
  for (size_t i = 0; root && i < d->n_in + d->n_out; i++) {
    const moed_tensor_desc *v = i < d->n_in ? &d->in[i] : &d->out[i - d->n_in];
    const char *names[16];
    size_t n = 0;
    for (const char *a = v->dtypes; *a && n < 16;) {
      char one[32];
      size_t len = strcspn(a, ",");
      snprintf(one, sizeof one, "%.*s", (int)(len < sizeof one ? len : sizeof one - 1), a);
      a += len + (a[len] == ',');
      moe_dtype t = moe_dtype_from_name(one);
      const char *k = t == MOE_DTYPE_INVALID ? NULL : moed_kserve_datatype(t);
      bool seen = !k; /* fp8 formats all travel as UINT8: one entry */
      for (size_t j = 0; j < n && !seen; j++)
        seen = strcmp(names[j], k) == 0;
      if (!seen) names[n++] = k;
    }
    if (n < 2) continue;
    cJSON *arr = cJSON_CreateStringArray(names, (int)n);
    if (!arr || !cJSON_AddItemToObject(root, v->name, arr)) {
      cJSON_Delete(arr);
      cJSON_Delete(root);
      return NULL;
    }
    any = true;
  }
  char *json = any ? cJSON_PrintUnformatted(root) : NULL;
  cJSON_Delete(root);
  return json;
}
