/* infer_shm: the tensors of one inference request that live in shared
 * memory, system or CUDA (Triton's extensions; the regions are shm.c's,
 * which copies either kind to and from host memory). An input or
 * a requested output names a region in its parameters:
 *   shared_memory_region     string, a registered region
 *   shared_memory_offset     integer >= 0, bytes into the region (default 0)
 *   shared_memory_byte_size  integer >= 0, required with the region
 * The span is checked against the region at every use. Input bytes are
 * copied into the request's own memory before the op validates them (small
 * ones while decoding, since the batch key reads them; large ones on the
 * worker), so a client rewriting its region cannot change them mid-call.
 * Outputs are copied into their region once computed. */
#include <stdio.h>
#include <string.h>

#include "infer_req.h"

#define P_REGION "shared_memory_region"
#define P_OFFSET "shared_memory_offset"
#define P_SIZE "shared_memory_byte_size"

/* Inputs up to this size are copied while decoding (on the loop: cheap). */
#define COPY_AT_DECODE ((uint64_t)64 << 10)

typedef struct shm_ref {
  const char *region; /* NULL: the tensor names none */
  int64_t offset, size;
  bool has_offset, has_size;
} shm_ref;

/* One tensor parameter into ref when it is one of the three (what: the
 * tensor, for messages); any other is refused, naming it, as the REST
 * port refuses it: a tensor parameter moed would ignore (Triton's
 * `classification` of an output) must not pass unnoticed. */
static grpc_status_code shm_param(moed_infer_req *r, const char *what, const char *key,
                                  const Inference__InferParameter *v, shm_ref *ref) {
  const bool region = strcmp(key, P_REGION) == 0, offset = strcmp(key, P_OFFSET) == 0,
             size = strcmp(key, P_SIZE) == 0;
  if (!region && !offset && !size)
    return moed_failf(r->err, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s: parameters['%s'] is not one moed takes (the shared_memory_* ones are)", what, key);
  const int c = v ? (int)v->parameter_choice_case : 0;
  if (region) {
    if (c != INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM)
      return moed_failf(r->err, GRPC_STATUS_INVALID_ARGUMENT, "%s: parameters['%s']: a string is expected",
                        what, key);
    ref->region = v->string_param;
    return GRPC_STATUS_OK;
  }
  int64_t n = -1;
  if (c == INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_INT64_PARAM)
    n = v->int64_param;
  else if (c == INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_UINT64_PARAM && v->uint64_param <= INT64_MAX)
    n = (int64_t)v->uint64_param;
  if (n < 0)
    return moed_failf(r->err, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s: parameters['%s']: an integer >= 0 is expected", what, key);
  if (offset) {
    ref->offset = n;
    ref->has_offset = true;
  } else {
    ref->size = n;
    ref->has_size = true;
  }
  return GRPC_STATUS_OK;
}

/* The span ref names into *at, its region held by r. */
static grpc_status_code shm_resolve(moed_infer_req *r, moed_server *srv, const char *what, const shm_ref *ref,
                                    moed_shm_at *at) {
  if (!ref->region)
    return moed_failf(r->err, GRPC_STATUS_INVALID_ARGUMENT, "%s: parameters['%s'] given without '%s'", what,
                      ref->has_offset ? P_OFFSET : P_SIZE, P_REGION);
  if (!ref->has_size)
    return moed_failf(r->err, GRPC_STATUS_INVALID_ARGUMENT, "%s: parameters['%s'] is required with '%s'",
                      what, P_SIZE, P_REGION);
  if (!srv->shm)
    return moed_failf(r->err, GRPC_STATUS_FAILED_PRECONDITION,
                      "%s: parameters['%s']: shared memory is off (--shm-max-regions 0)", what, P_REGION);
  if (!moed_model_name_ok(ref->region)) /* not echoed */
    return moed_failf(r->err, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s: parameters['%s']: not a valid region name (%s)", what, P_REGION,
                      MOED_MODEL_NAME_RULE);
  if (r->n_shm == sizeof r->shm / sizeof r->shm[0]) /* inputs and outputs are bounded: cannot happen */
    return moed_failf(r->err, GRPC_STATUS_INVALID_ARGUMENT, "%s: too many shared memory tensors", what);
  moed_shm_region *g = moed_shm_acquire(srv->shm, ref->region);
  if (!g)
    return moed_failf(r->err, GRPC_STATUS_NOT_FOUND, "%s: parameters['%s']: no region '%s' is registered",
                      what, P_REGION, ref->region);
  r->shm[r->n_shm++] = g; /* released with r */
  *at = (moed_shm_at){g, (uint64_t)ref->offset, (uint64_t)ref->size};
  if (!moed_shm_span(g, at->offset, at->size))
    return moed_failf(
        r->err, GRPC_STATUS_INVALID_ARGUMENT,
        "%s: parameters['%s'] + ['%s']: %lld + %lld bytes run past the end of region '%s' (%llu bytes)", what,
        P_OFFSET, P_SIZE, (long long)ref->offset, (long long)ref->size, ref->region,
        (unsigned long long)moed_shm_byte_size(g));
  return GRPC_STATUS_OK;
}

/* Which of the request's tensors a span is for. */
typedef enum { SHM_INPUT, SHM_OUTPUT } shm_dir;

#define WHAT_LEN 200

/* The span that inputs[i] or outputs[i] (dir) of r->msg names in its
 * parameters, checked against its region (held by r), into *at. OK with
 * *used false: the tensor names none. what: the tensor as messages name
 * it. */
static grpc_status_code shm_span(moed_infer_req *r, moed_server *srv, shm_dir dir, size_t i,
                                 char what[WHAT_LEN], bool *used, moed_shm_at *at) {
  const Inference__ModelInferRequest *m = r->msg;
  const bool in = dir == SHM_INPUT;
  snprintf(what, WHAT_LEN, "%s[%zu] '%s'", in ? "inputs" : "outputs", i,
           in ? m->inputs[i]->name : m->outputs[i]->name);
  shm_ref ref = {0};
  grpc_status_code code;
  const size_t n = in ? m->inputs[i]->n_parameters : m->outputs[i]->n_parameters;
  for (size_t k = 0; k < n; k++) {
    /* the two entry types are alike but distinct: each read as its own */
    const char *key = in ? m->inputs[i]->parameters[k]->key : m->outputs[i]->parameters[k]->key;
    const Inference__InferParameter *v =
        in ? m->inputs[i]->parameters[k]->value : m->outputs[i]->parameters[k]->value;
    if (key && (code = shm_param(r, what, key, v, &ref))) return code;
  }
  *used = ref.region || ref.has_offset || ref.has_size;
  if (!*used) return GRPC_STATUS_OK;
  return shm_resolve(r, srv, what, &ref, at);
}

/* Input i's bytes from r->shm_in[i] into memory of its own. */
static grpc_status_code copy_input(moed_infer_req *r, size_t i, const char *name, moe_tensor *t) {
  if (t->nbytes && !(r->owned[i] = moed_hostmem_alloc(t->nbytes)))
    return moed_failf(r->err, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for input '%s'", name);
  char why[MOED_ERR_LEN];
  grpc_status_code code =
      t->nbytes ? moed_shm_read(r->shm_in[i].region, r->shm_in[i].offset, r->owned[i], t->nbytes, why) : 0;
  if (code) return moed_failf(r->err, code, "inputs[%zu] '%s': %s", i, name, why);
  t->data = r->owned[i];
  r->shm_in[i].region = NULL;
  return GRPC_STATUS_OK;
}

bool moed_infer_shm_small(const uint8_t *p, size_t n) {
  /* the common case, no region, without a walk: the tensors' parameters
   * precede the raw contents in every encoder we know, so only those bytes
   * are searched (a request encoded otherwise is still served right, only
   * its region's copy may then run on the gRPC thread); else the sizes read
   * off the wire, so that decoding unpacks the message once */
  const size_t raw_at = moed_kserve_raw_at(p, n);
  if (!memmem(p, raw_at ? raw_at : n, P_REGION, sizeof P_REGION - 1)) return true;
  uint64_t total;
  return moed_kserve_input_param_sum(p, n, P_SIZE, COPY_AT_DECODE, &total) && total <= COPY_AT_DECODE;
}

bool moed_infer_shm_named(const Inference__ModelInferRequest__InferInputTensor *t) {
  for (size_t k = 0; k < t->n_parameters; k++)
    if (t->parameters[k]->key && strcmp(t->parameters[k]->key, P_REGION) == 0) return true;
  return false;
}

grpc_status_code moed_infer_shm_input(moed_infer_req *r, moed_server *srv, size_t i, moe_tensor *out,
                                      bool *used) {
  const Inference__ModelInferRequest__InferInputTensor *t = r->msg->inputs[i];
  char what[WHAT_LEN];
  moed_shm_at at = {0};
  grpc_status_code code = shm_span(r, srv, SHM_INPUT, i, what, used, &at);
  if (code || !*used) return code;
  if (t->contents)
    return moed_failf(r->err, GRPC_STATUS_INVALID_ARGUMENT, "%s: contents given with parameters['%s']", what,
                      P_REGION);
  if (at.size != out->nbytes)
    return moed_failf(r->err, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s: parameters['%s'] = %lld, shape and %s need %zu bytes", what, P_SIZE,
                      (long long)at.size, t->datatype, out->nbytes);
  if (out->nbytes > COPY_AT_DECODE) {
    r->shm_in[i] = at; /* moed_infer_shm_inputs copies it on the worker */
    out->data = NULL;
    return GRPC_STATUS_OK;
  }
  r->shm_in[i] = at;
  return copy_input(r, i, t->name, out);
}

grpc_status_code moed_infer_shm_outputs_decode(moed_infer_req *r, moed_server *srv) {
  const Inference__ModelInferRequest *m = r->msg;
  for (size_t k = 0; k < m->n_outputs && k < MOED_MAX_TENSORS; k++) {
    char what[WHAT_LEN];
    bool used = false;
    grpc_status_code code = shm_span(r, srv, SHM_OUTPUT, k, what, &used, &r->shm_out[k]);
    if (code) return code;
  }
  return GRPC_STATUS_OK;
}

grpc_status_code moed_infer_shm_inputs(moed_infer_req *r) {
  for (size_t i = 0; i < r->n_in; i++) {
    grpc_status_code code =
        r->shm_in[i].region ? copy_input(r, i, r->in[i].name, &r->in[i].tensor) : GRPC_STATUS_OK;
    if (code) return code;
  }
  return GRPC_STATUS_OK;
}

grpc_status_code moed_infer_shm_outputs(moed_infer_req *r, const moe_named_tensor *outs, grpc_slice *data,
                                        size_t num_out, char *err) {
  const Inference__ModelInferRequest *m = r->msg;
  for (size_t k = 0; k < m->n_outputs && k < MOED_MAX_TENSORS; k++) {
    if (!r->shm_out[k].region) continue;
    const char *name = m->outputs[k]->name;
    size_t j = 0;
    while (j < num_out && strcmp(outs[j].name, name) != 0)
      j++;
    if (j == num_out) continue; /* the encoder names an output the model lacks */
    const size_t n = GRPC_SLICE_LENGTH(data[j]);
    if (n > r->shm_out[k].size)
      return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT,
                        "outputs[%zu] '%s': parameters['%s'] = %llu bytes, the output needs %zu", k, name,
                        P_SIZE, (unsigned long long)r->shm_out[k].size, n);
    char why[MOED_ERR_LEN];
    grpc_status_code code =
        moed_shm_write(r->shm_out[k].region, r->shm_out[k].offset, GRPC_SLICE_START_PTR(data[j]), n, why);
    if (code) return moed_failf(err, code, "outputs[%zu] '%s': %s", k, name, why);
    grpc_slice_unref(data[j]);
    data[j] = grpc_empty_slice();
  }
  return GRPC_STATUS_OK;
}
