/* The op table, binding named inputs to an op, and running a prepared call. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/scheme.h"
#include "backend_impl.h"
#include "op.h"

/* ---- the table ------------------------------------------------------------ */

static const moe_op *const op_table[] = {
    &moe_op_quant_per_tensor,
    &moe_op_quant_per_token,
    &moe_op_quant_per_token_group,
    &moe_op_quant_mx,
    &moe_op_dequant_per_tensor,
    &moe_op_dequant_mx,
    &moe_op_topk,
    &moe_op_fused_moe,
};
#define OP_COUNT (sizeof op_table / sizeof op_table[0])

size_t moe_op_count(void) { return OP_COUNT; }
const moe_op *moe_op_at(size_t i) { return i < OP_COUNT ? op_table[i] : NULL; }
const char *moe_op_name(const moe_op *op) { return op->info.name; }
const moe_op_info *moe_op_describe(const moe_op *op) { return &op->info; }

bool moe_op_supported(const moe_op *op, const moe_backend *b) {
  return b->kind == MOE_BACKEND_CPU ? op->cpu != NULL : op->gpu != NULL;
}

moe_status moe_call_check_backend(const moe_call *c, const moe_backend *b, moe_error *err) {
  if (!moe_op_supported(c->op, b))
    return moe_fail(err, MOE_EUNSUPPORTED, "%s: no kernel on %s in this build", c->op->info.name, b->name);
  if (c->op != &moe_op_fused_moe || b->kind == MOE_BACKEND_CPU) return MOE_OK;
  const moe_expert_set *set = c->args.fused.set;
  if (!moe_schemes[set->cfg.scheme].gpu)
    return moe_fail(err, MOE_EUNSUPPORTED,
                    "fused_moe: scheme %s has no GPU kernel yet (the CPU backend serves it)",
                    moe_scheme_names[set->cfg.scheme]);
  const char *lacks = b->iface->fused_lacks ? b->iface->fused_lacks(b, &set->cfg)
                      : set->cfg.has_bias   ? "expert biases (w13_bias, w2_bias)"
                                            : NULL;
  if (lacks)
    return moe_fail(err, MOE_EUNSUPPORTED, "fused_moe: %s: no kernel on %s (the CPU backend serves it)",
                    lacks, b->name);
  return MOE_OK;
}

const moe_op *moe_op_find(const char *name) {
  if (!name) return NULL;
  for (size_t i = 0; i < OP_COUNT; i++)
    if (strcmp(op_table[i]->info.name, name) == 0) return op_table[i];
  return NULL;
}

/* ---- validation helpers ----------------------------------------------------- */

moe_status moe_check_dtype(const moe_tensor *t, const char *what, const moe_dtype *allowed, moe_error *err) {
  char list[160] = "";
  size_t used = 0;
  for (const moe_dtype *a = allowed; *a != MOE_DTYPE_INVALID; a++) {
    if (t->dtype == *a) return MOE_OK;
    used += (size_t)snprintf(list + used, used < sizeof list ? sizeof list - used : 0, "%s%s",
                             a == allowed ? "" : ", ", moe_dtype_name(*a));
  }
  return moe_fail(err, MOE_EINVAL, "%s: dtype %s not accepted (expected %s)", what, moe_dtype_name(t->dtype),
                  list);
}

moe_status moe_check_shape(const moe_tensor *t, const char *what, int min_rank, int max_rank,
                           moe_error *err) {
  if (t->ndim < min_rank || t->ndim > max_rank) {
    if (min_rank == max_rank)
      return moe_fail(err, MOE_EINVAL, "%s: rank %d, expected %d", what, t->ndim, min_rank);
    return moe_fail(err, MOE_EINVAL, "%s: rank %d, expected %d to %d", what, t->ndim, min_rank, max_rank);
  }
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] < 0) return moe_fail(err, MOE_EINVAL, "%s: negative dimension %d", what, i);
  if (t->dtype == MOE_FP4_E2M1 && (moe_tensor_cols(t) & 1))
    return moe_fail(err, MOE_EINVAL, "%s: packed fp4 needs an even last dimension", what);
  size_t need;
  if (moe_tensor_bytes(t, &need) != MOE_OK)
    return moe_fail(err, MOE_EINVAL, "%s: shape too large (element count overflows)", what);
  if (t->nbytes != need)
    return moe_fail(err, MOE_EINVAL, "%s: %zu bytes given, shape and dtype need %zu", what, t->nbytes, need);
  return MOE_OK;
}

moe_status moe_narrow_view(moe_tensor *t, const char *what, moe_dtype real, moe_error *err) {
  if (t->dtype == real) return MOE_OK;
  if (t->dtype != MOE_UINT8 && !(real == MOE_INT8 && t->dtype == MOE_INT8))
    return moe_fail(err, MOE_EINVAL, "%s: dtype %s, expected uint8 (holding %s codes) or %s", what,
                    moe_dtype_name(t->dtype), moe_dtype_name(real), moe_dtype_name(real));
  t->dtype = real;
  if (real == MOE_FP4_E2M1 && t->ndim > 0) {
    int64_t last = t->shape[t->ndim - 1];
    if (last > INT64_MAX / 2) return moe_fail(err, MOE_EINVAL, "%s: last dimension too large", what);
    t->shape[t->ndim - 1] = last * 2;
  }
  return MOE_OK;
}

moe_narrow_fmt moe_narrow_fmt_of(moe_dtype t) {
  static const moe_narrow_fmt e4m3fn = MOE_FMT_E4M3FN, e4m3fnuz = MOE_FMT_E4M3FNUZ, e5m2 = MOE_FMT_E5M2,
                              e2m1 = MOE_FMT_E2M1;
  switch (t) {
  case MOE_FP8_E4M3FNUZ: return e4m3fnuz;
  case MOE_FP8_E5M2: return e5m2;
  case MOE_FP4_E2M1: return e2m1;
  default: return e4m3fn;
  }
}

moe_status moe_call_set_output(moe_call *c, size_t i, moe_dtype dt, int32_t ndim, const int64_t *shape,
                               moe_error *err) {
  moe_named_tensor *o = &c->out[i];
  o->name = c->op->info.outputs[i].name;
  o->tensor.dtype = dt;
  o->tensor.ndim = ndim;
  for (int d = 0; d < ndim; d++)
    o->tensor.shape[d] = shape[d];
  o->tensor.data = NULL;
  if (moe_tensor_bytes(&o->tensor, &o->tensor.nbytes) != MOE_OK)
    return moe_fail(err, MOE_EINVAL, "%s: output shape too large", o->name);
  if (i + 1 > c->num_out) c->num_out = i + 1;
  return MOE_OK;
}

/* ---- prepare / run ---------------------------------------------------------- */

static moe_status bind_inputs(moe_call *c, const moe_named_tensor *in, size_t n, moe_error *err) {
  const moe_op_info *info = &c->op->info;
  for (size_t j = 0; j < n; j++) {
    size_t slot = info->num_inputs;
    for (size_t i = 0; i < info->num_inputs; i++)
      if (in[j].name && strcmp(in[j].name, info->inputs[i].name) == 0) slot = i;
    if (slot == info->num_inputs)
      return moe_fail(err, MOE_EINVAL, "unknown input '%s' for model %s", in[j].name ? in[j].name : "(null)",
                      info->name);
    if (c->in[slot].name) return moe_fail(err, MOE_EINVAL, "input '%s' given twice", in[j].name);
    if (in[j].tensor.nbytes && !in[j].tensor.data)
      return moe_fail(err, MOE_EINVAL, "input '%s' has no data", in[j].name);
    c->in[slot].name = info->inputs[slot].name;
    c->in[slot].tensor = in[j].tensor;
  }
  return MOE_OK;
}

moe_status moe_op_prepare(const moe_op *op, const moe_named_tensor *inputs, size_t num_inputs,
                          const moe_params *params, const moe_expert_set *set, moe_call **out,
                          moe_error *err) {
  if (!op) return moe_fail(err, MOE_ENOTFOUND, "no such op");
  moe_call *c = calloc(1, sizeof *c);
  if (!c) return moe_fail(err, MOE_ENOMEM, "out of memory");
  c->op = op;
  if (op == &moe_op_fused_moe) c->args.fused.set = set;
  moe_status s = bind_inputs(c, inputs, num_inputs, err);
  if (s) goto fail;
  for (size_t i = 0; i < op->info.num_inputs; i++) {
    /* inputs that an expert set replaces are checked by the op itself */
    if (!c->in[i].name && !op->info.inputs[i].optional) {
      s = moe_fail(err, MOE_EINVAL, "missing input '%s' for model %s", op->info.inputs[i].name,
                   op->info.name);
      goto fail;
    }
  }
  moe_params_track(params);
  s = op->prepare(c, params, err);
  const char *unread = moe_params_unread(params);
  if (!s && unread)
    s = moe_fail(err, MOE_EINVAL,
                 "parameter '%s' is not one %s takes here (misspelt, or meant for another model?)", unread,
                 op->info.name);
  if (s) goto fail;
  *out = c;
  return MOE_OK;
fail:
  moe_call_destroy(c);
  return s;
}

size_t moe_call_num_outputs(const moe_call *c) { return c->num_out; }
moe_named_tensor *moe_call_output(moe_call *c, size_t i) { return i < c->num_out ? &c->out[i] : NULL; }
size_t moe_call_num_inputs(const moe_call *c) { return c->op->info.num_inputs; }
moe_named_tensor *moe_call_input(moe_call *c, size_t i) {
  return i < c->op->info.num_inputs ? &c->in[i] : NULL;
}

moe_status moe_call_run(moe_call *c, moe_backend *b, moe_error *err) {
  for (size_t i = 0; i < c->num_out; i++)
    if (c->out[i].tensor.nbytes && !c->out[i].tensor.data)
      return moe_fail(err, MOE_EINVAL, "output '%s' has no buffer", c->out[i].name);
  moe_status s = moe_call_check_backend(c, b, err);
  if (s) return s;
  return b->iface->run(b, c, err);
}

void moe_call_set_stop(moe_call *c, moe_stop_fn stop, void *ctx) {
  c->stop = stop;
  c->stop_ctx = ctx;
}

void moe_call_destroy(moe_call *c) {
  if (!c) return;
  moe_expert_set_destroy(c->owned_set);
  free(c);
}

/* ---- host convenience --------------------------------------------------------- */

void moe_outputs_free(moe_named_tensor *outputs, size_t n) {
  if (!outputs) return;
  for (size_t i = 0; i < n; i++)
    free(outputs[i].tensor.data);
  free(outputs);
}

/* One CPU backend shared by moe_run_host callers, one call at a time. */
static pthread_mutex_t host_lock = PTHREAD_MUTEX_INITIALIZER;
static moe_backend *host_backend;

moe_status moe_run_host(const char *op_name, const moe_named_tensor *inputs, size_t num_inputs,
                        const moe_params *params, const moe_expert_set *set, moe_named_tensor **outputs,
                        size_t *num_outputs, moe_error *err) {
  const moe_op *op = moe_op_find(op_name);
  if (!op) return moe_fail(err, MOE_ENOTFOUND, "unknown model '%s'", op_name ? op_name : "(null)");
  moe_call *c = NULL;
  moe_named_tensor *outs = NULL;
  moe_status s = moe_op_prepare(op, inputs, num_inputs, params, set, &c, err);
  if (s) return s;
  size_t n = moe_call_num_outputs(c);
  outs = calloc(n ? n : 1, sizeof *outs);
  if (!outs) {
    s = moe_fail(err, MOE_ENOMEM, "out of memory");
    goto fail;
  }
  for (size_t i = 0; i < n; i++) {
    moe_named_tensor *o = moe_call_output(c, i);
    /* aligned as the backends' buffers are, so that callers here (the tests)
     * take the kernels' aligned paths too (streamed stores, cpu.h); free()s */
    const size_t rounded = (o->tensor.nbytes + 63) & ~(size_t)63;
    o->tensor.data = rounded >= o->tensor.nbytes ? aligned_alloc(64, rounded ? rounded : 64) : NULL;
    if (!o->tensor.data) {
      s = moe_fail(err, MOE_ENOMEM, "out of memory for output '%s'", o->name);
      goto fail;
    }
    outs[i] = *o;
  }
  pthread_mutex_lock(&host_lock);
  if (!host_backend) s = moe_backend_cpu_create(0, &host_backend, err);
  if (!s) s = moe_call_run(c, host_backend, err);
  pthread_mutex_unlock(&host_lock);
  if (s) goto fail;
  moe_call_destroy(c);
  *outputs = outs;
  *num_outputs = n;
  return MOE_OK;
fail:
  if (outs)
    for (size_t i = 0; i < n; i++)
      free(outs[i].tensor.data);
  free(outs);
  moe_call_destroy(c);
  return s;
}
