/* moec: moed's command-line client on gRPC core.
 *
 *   moec [-a HOST:PORT] health
 *   moec [-a HOST:PORT] models
 *   moec [-a HOST:PORT] infer -m MODEL --input NAME=FILE.npy[:DATATYPE] ...
 *        [--param KEY=VALUE ...] [--output-dir DIR] [--timeout-ms N]
 *   moec [-a HOST:PORT] upload DIR [--name NAME] [--replace] [--chunk-bytes N]
 *
 * Inputs are sent as raw_input_contents; the KServe datatype follows the
 * npy dtype (<f4 FP32, <f2 FP16, |u1 UINT8, |i1 INT8, <i4 INT32) or the
 * :DATATYPE suffix (BF16 data are stored in .npy files as <u2). Outputs are
 * written as DIR/NAME.npy (BF16 as <u2; narrow formats as |u1 bytes, their
 * real format printed). */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "bench_report.h"
#include "expert_store.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"
#include "grpc_args.h"
#include "grpc_service.pb-c.h"
#include "kserve_types.h"
#include "load.h"
#include "moe/codec.h"
#include "moe/ops.h"
#include "moe/safetensors.h"
#include "npy.h"
#include "token_dist.h"

#define MAX_TENSORS 16
#define BENCH_MAX_LEVELS 64
#define BENCH_MAX_MESSAGES 65536 /* requests prepared: token counts x --variants */

typedef struct client {
  grpc_channel *ch;
  grpc_completion_queue *cq;
  int timeout_ms;
} client;

static grpc_slice moec_flatten(grpc_byte_buffer *bb) {
  grpc_byte_buffer_reader rd;
  grpc_slice all = grpc_empty_slice();
  if (bb && grpc_byte_buffer_reader_init(&rd, bb)) {
    all = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
  }
  return all;
}

/* One unary call. Returns the gRPC status; *resp unpacked on OK. */
static grpc_status_code unary(client *c, const char *method, const ProtobufCMessage *req,
                              const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp, char *msg,
                              size_t cap) {
  size_t n = protobuf_c_message_get_packed_size(req);
  grpc_slice s = grpc_slice_malloc(n);
  protobuf_c_message_pack(req, GRPC_SLICE_START_PTR(s));
  grpc_byte_buffer *send = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  gpr_timespec deadline = c->timeout_ms > 0 ? gpr_time_add(gpr_now(GPR_CLOCK_REALTIME),
                                                           gpr_time_from_millis(c->timeout_ms, GPR_TIMESPAN))
                                            : gpr_inf_future(GPR_CLOCK_REALTIME);
  grpc_slice m = grpc_slice_from_static_string(method);
  grpc_call *call =
      grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq, m, NULL, deadline, NULL);
  grpc_slice_unref(m);
  grpc_metadata_array md, trailing;
  grpc_metadata_array_init(&md);
  grpc_metadata_array_init(&trailing);
  grpc_byte_buffer *recv = NULL;
  grpc_status_code status = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = send;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &recv;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
  ops[5].data.recv_status_on_client.status = &status;
  ops[5].data.recv_status_on_client.status_details = &details;
  grpc_call_start_batch(call, ops, 6, (void *)1, NULL);
  grpc_completion_queue_pluck(c->cq, (void *)1, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  snprintf(msg, cap, "%.*s", (int)GRPC_SLICE_LENGTH(details), (const char *)GRPC_SLICE_START_PTR(details));
  *resp = NULL;
  if (status == GRPC_STATUS_OK) {
    grpc_byte_buffer_reader rd0;
    grpc_slice all = grpc_empty_slice();
    if (recv && grpc_byte_buffer_reader_init(&rd0, recv)) {
      all = grpc_byte_buffer_reader_readall(&rd0);
      grpc_byte_buffer_reader_destroy(&rd0);
    }
    *resp = protobuf_c_message_unpack(rd, NULL, GRPC_SLICE_LENGTH(all), GRPC_SLICE_START_PTR(all));
    grpc_slice_unref(all);
    if (!*resp) {
      status = GRPC_STATUS_INTERNAL;
      snprintf(msg, cap, "malformed response");
    }
  }
  if (recv) grpc_byte_buffer_destroy(recv);
  grpc_byte_buffer_destroy(send);
  grpc_slice_unref(details);
  grpc_metadata_array_destroy(&md);
  grpc_metadata_array_destroy(&trailing);
  grpc_call_unref(call);
  return status;
}

static int report(const char *what, grpc_status_code st, const char *msg) {
  fprintf(stderr, "moec: %s: %s: %s\n", what, load_status_name(st), msg);
  return 1;
}

/* ---- commands ---------------------------------------------------------------- */

static int cmd_health(client *c) {
  char msg[1024];
  ProtobufCMessage *r;
  Inference__ServerLiveRequest lq = INFERENCE__SERVER_LIVE_REQUEST__INIT;
  grpc_status_code st = unary(c, "/inference.GRPCInferenceService/ServerLive", &lq.base,
                              &inference__server_live_response__descriptor, &r, msg, sizeof msg);
  if (st) return report("ServerLive", st, msg);
  int live = ((Inference__ServerLiveResponse *)r)->live;
  protobuf_c_message_free_unpacked(r, NULL);
  Inference__ServerReadyRequest rq = INFERENCE__SERVER_READY_REQUEST__INIT;
  st = unary(c, "/inference.GRPCInferenceService/ServerReady", &rq.base,
             &inference__server_ready_response__descriptor, &r, msg, sizeof msg);
  if (st) return report("ServerReady", st, msg);
  int ready = ((Inference__ServerReadyResponse *)r)->ready;
  protobuf_c_message_free_unpacked(r, NULL);
  Inference__ServerMetadataRequest mq = INFERENCE__SERVER_METADATA_REQUEST__INIT;
  st = unary(c, "/inference.GRPCInferenceService/ServerMetadata", &mq.base,
             &inference__server_metadata_response__descriptor, &r, msg, sizeof msg);
  if (st) return report("ServerMetadata", st, msg);
  Inference__ServerMetadataResponse *m = (Inference__ServerMetadataResponse *)r;
  printf("live: %s\nready: %s\nserver: %s %s\nextensions:", live ? "true" : "false", ready ? "true" : "false",
         m->name, m->version);
  for (size_t i = 0; i < m->n_extensions; i++)
    printf(" %s", m->extensions[i]);
  printf("\n");
  protobuf_c_message_free_unpacked(r, NULL);
  return ready ? 0 : 3;
}

static int cmd_models(client *c) {
  char msg[1024];
  ProtobufCMessage *r;
  Inference__RepositoryIndexRequest q = INFERENCE__REPOSITORY_INDEX_REQUEST__INIT;
  grpc_status_code st = unary(c, "/inference.GRPCInferenceService/RepositoryIndex", &q.base,
                              &inference__repository_index_response__descriptor, &r, msg, sizeof msg);
  if (st) return report("RepositoryIndex", st, msg);
  Inference__RepositoryIndexResponse *ix = (Inference__RepositoryIndexResponse *)r;
  for (size_t i = 0; i < ix->n_models; i++)
    printf("%-32s %-12s %s\n", ix->models[i]->name, ix->models[i]->state, ix->models[i]->reason);
  protobuf_c_message_free_unpacked(r, NULL);
  return 0;
}

static const char *descr_for(const char *kserve) {
  const moed_kserve_type *k = moed_kserve_by_name(kserve);
  return k ? k->npy : NULL;
}

/* "k=v": bool, int, double or string by the look of v. */
static int parse_param(char *kv, Inference__ModelInferRequest__ParametersEntry *e,
                       Inference__InferParameter *p) {
  char *eq = strchr(kv, '=');
  if (!eq) return -1;
  *eq = 0;
  const char *v = eq + 1;
  inference__model_infer_request__parameters_entry__init(e);
  inference__infer_parameter__init(p);
  e->key = kv;
  e->value = p;
  char *end;
  if (strcmp(v, "true") == 0 || strcmp(v, "false") == 0) {
    p->parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_BOOL_PARAM;
    p->bool_param = v[0] == 't';
    return 0;
  }
  errno = 0;
  long long i = strtoll(v, &end, 10);
  if (*v && !*end && !errno) {
    p->parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_INT64_PARAM;
    p->int64_param = i;
    return 0;
  }
  double d = strtod(v, &end);
  if (*v && !*end) {
    p->parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_DOUBLE_PARAM;
    p->double_param = d;
    return 0;
  }
  p->parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM;
  p->string_param = (char *)v;
  return 0;
}

/* Deterministic values for a->shape and k: finite and small for float
 * types (uniform in [-1, 1)), [0, 8) for integers, random bytes for narrow
 * formats. 0, or -1 said on stderr. */
static int random_fill(const char *input, npy_array *a, const moed_kserve_type *k) {
  size_t count = 1;
  bool big = false;
  for (int d = 0; d < a->ndim; d++) {
    if (a->shape[d] && count > ((size_t)1 << 30) / (size_t)a->shape[d]) big = true;
    count = big ? 0 : count * (size_t)a->shape[d];
  }
  if (big || count > ((size_t)1 << 30) / k->size) {
    fprintf(stderr, "moec: --input %s: more than 1 GiB\n", input);
    return -1;
  }
  snprintf(a->descr, sizeof a->descr, "%s", k->npy);
  a->nbytes = count * k->size;
  free(a->data);
  if (!(a->data = malloc(a->nbytes ? a->nbytes : 1))) {
    fprintf(stderr, "moec: --input %s: out of memory\n", input);
    return -1;
  }
  unsigned seed = 12345;
  uint8_t *p = a->data;
  for (size_t i = 0; i < count; i++) {
    float f = (float)rand_r(&seed) / ((float)RAND_MAX + 1.0f) * 2.0f - 1.0f;
    int v = rand_r(&seed);
    switch (k->dtype) {
    case MOE_F32: memcpy(p + 4 * i, &f, 4); break;
    case MOE_F16: ((uint16_t *)a->data)[i] = moe_f32_to_f16(f); break;
    case MOE_BF16: ((uint16_t *)a->data)[i] = moe_f32_to_bf16(f); break;
    case MOE_INT32: ((int32_t *)a->data)[i] = v & 7; break;
    case MOE_INT8: ((int8_t *)a->data)[i] = (int8_t)(v & 7); break;
    default: memset(p + k->size * i, v & 0xFF, k->size); break; /* UINT8: narrow formats' codes */
    }
  }
  return 0;
}

/* "random:SHAPE:DATATYPE" (SHAPE as 4x1024): random_fill's values. 0, or
 * -1 said on stderr. */
static int input_random(const char *input, const char *spec, npy_array *a, const moed_kserve_type **kt) {
  memset(a, 0, sizeof *a);
  char buf[256];
  snprintf(buf, sizeof buf, "%s", spec);
  char *dt = strrchr(buf, ':');
  const moed_kserve_type *k = dt ? moed_kserve_by_name(dt + 1) : NULL;
  if (!k || !k->npy) {
    fprintf(stderr, "moec: --input %s=random:%s: expected random:SHAPE:DATATYPE (e.g. random:4x1024:FP32)\n",
            input, spec);
    return -1;
  }
  *dt = 0;
  size_t count = 1;
  for (char *tok = buf, *end; *tok; tok = *end ? end + 1 : end) {
    errno = 0;
    long long d = strtoll(tok, &end, 10);
    if (end == tok || (*end && *end != 'x') || errno || d < 0 || a->ndim == NPY_MAX_DIMS ||
        (d && count > ((size_t)1 << 30) / (size_t)d)) {
      fprintf(stderr, "moec: --input %s=random:%s: bad shape (dims >= 0 joined by x, at most %d, 1 GiB)\n",
              input, spec, NPY_MAX_DIMS);
      return -1;
    }
    a->shape[a->ndim++] = d;
    count *= (size_t)d;
  }
  *kt = k;
  return random_fill(input, a, k);
}

/* A ModelInferRequest from --input and --param specs (parsed in place);
 * infer_request_free releases the arrays. */
typedef struct infer_request {
  npy_array arr[MAX_TENSORS];
  const moed_kserve_type *random[MAX_TENSORS]; /* a random input's type (NULL: read from a file) */
  bool token_axis[MAX_TENSORS];                /* bench --tokens: leads with the token axis */
  int loaded;
  Inference__ModelInferRequest__InferInputTensor it[MAX_TENSORS], *pit[MAX_TENSORS];
  ProtobufCBinaryData raw[MAX_TENSORS];
  Inference__ModelInferRequest__ParametersEntry pe[MAX_TENSORS * 2], *ppe[MAX_TENSORS * 2];
  Inference__InferParameter pv[MAX_TENSORS * 2];
  Inference__ModelInferRequest req;
} infer_request;

static void infer_request_free(infer_request *r) {
  for (int i = 0; i < r->loaded; i++)
    npy_free(&r->arr[i]);
  r->loaded = 0;
}

/* 0, or -1 said on stderr (r freed). */
static int infer_request_init(infer_request *r, const char *model, char **inputs, int n_in, char **params,
                              int n_params) {
  char err[512];
  r->loaded = 0;
  for (int i = 0; i < n_in; i++) {
    char *spec = inputs[i];
    char *eq = strchr(spec, '=');
    if (!eq) {
      fprintf(stderr, "moec: --input %s: expected NAME=FILE.npy[:DATATYPE] or NAME=random:SHAPE:DATATYPE\n",
              spec);
      goto fail;
    }
    *eq = 0;
    char *file = eq + 1;
    const char *kserve = NULL;
    r->random[i] = NULL;
    if (strncmp(file, "random:", 7) == 0) {
      if (input_random(spec, file + 7, &r->arr[i], &r->random[i]) != 0) goto fail;
      r->loaded++;
      kserve = r->random[i]->name;
    } else {
      char *dt = strrchr(file, ':');
      if (dt) *dt++ = 0;
      if (npy_read(file, &r->arr[i], err, sizeof err) != 0) {
        fprintf(stderr, "moec: %s\n", err);
        goto fail;
      }
      r->loaded++;
      kserve = dt;
      const moed_kserve_type *by_descr = moed_kserve_by_npy(r->arr[i].descr);
      if (!kserve && by_descr) kserve = by_descr->name;
      if (!kserve) {
        fprintf(stderr, "moec: %s: npy dtype %s has no KServe datatype\n", file, r->arr[i].descr);
        goto fail;
      }
    }
    inference__model_infer_request__infer_input_tensor__init(&r->it[i]);
    r->it[i].name = spec;
    r->it[i].datatype = (char *)kserve;
    r->it[i].n_shape = (size_t)r->arr[i].ndim;
    r->it[i].shape = r->arr[i].shape;
    r->pit[i] = &r->it[i];
    r->raw[i].data = r->arr[i].data;
    r->raw[i].len = r->arr[i].nbytes;
  }
  for (int i = 0; i < n_params; i++) {
    if (parse_param(params[i], &r->pe[i], &r->pv[i]) != 0) {
      fprintf(stderr, "moec: --param %s: expected KEY=VALUE\n", params[i]);
      goto fail;
    }
    r->ppe[i] = &r->pe[i];
  }
  inference__model_infer_request__init(&r->req);
  r->req.model_name = (char *)model;
  r->req.n_inputs = (size_t)n_in;
  r->req.inputs = r->pit;
  r->req.n_raw_input_contents = (size_t)n_in;
  r->req.raw_input_contents = r->raw;
  r->req.n_parameters = (size_t)n_params;
  r->req.parameters = r->ppe;
  return 0;
fail:
  infer_request_free(r);
  return -1;
}

static int cmd_infer(client *c, const char *model, char **inputs, int n_in, char **params, int n_params,
                     const char *out_dir) {
  infer_request ir;
  char err[512];
  int rc = 1;
  if (infer_request_init(&ir, model, inputs, n_in, params, n_params) != 0) return 1;
  ProtobufCMessage *r;
  char msg[1024];
  grpc_status_code st = unary(c, "/inference.GRPCInferenceService/ModelInfer", &ir.req.base,
                              &inference__model_infer_response__descriptor, &r, msg, sizeof msg);
  if (st) {
    report("ModelInfer", st, msg);
    rc = 2;
    goto done;
  }
  Inference__ModelInferResponse *resp = (Inference__ModelInferResponse *)r;
  rc = 0;
  for (size_t i = 0; i < resp->n_outputs; i++) {
    Inference__ModelInferResponse__InferOutputTensor *o = resp->outputs[i];
    const char *real = "";
    for (size_t k = 0; k < o->n_parameters; k++)
      if (strcmp(o->parameters[k]->key, "dtype") == 0 && o->parameters[k]->value &&
          o->parameters[k]->value->parameter_choice_case ==
              INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM)
        real = o->parameters[k]->value->string_param;
    printf("%s %s [", o->name, o->datatype);
    for (size_t d = 0; d < o->n_shape; d++)
      printf("%s%lld", d ? ", " : "", (long long)o->shape[d]);
    printf("]%s%s\n", *real ? " dtype=" : "", real);
    const char *descr = descr_for(o->datatype);
    if (i >= resp->n_raw_output_contents || !descr) {
      fprintf(stderr, "moec: output %s: no raw contents\n", o->name);
      rc = 1;
      continue;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.npy", out_dir, o->name);
    if (npy_write(path, descr, (int)o->n_shape, o->shape, resp->raw_output_contents[i].data,
                  resp->raw_output_contents[i].len, err, sizeof err) != 0) {
      fprintf(stderr, "moec: %s\n", err);
      rc = 1;
    }
  }
  protobuf_c_message_free_unpacked(r, NULL);
done:
  infer_request_free(&ir);
  return rc;
}

/* --output-dir: created when missing (its parent must exist), checked
 * before the call so that a bad path costs no inference. */
static bool output_dir_ok(const char *dir) {
  struct stat st;
  if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
    fprintf(stderr, "moec: --output-dir %s: cannot create it: %s\n", dir, strerror(errno));
    return false;
  }
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
    fprintf(stderr, "moec: --output-dir %s: not a directory\n", dir);
    return false;
  }
  return true;
}

/* ---- upload: moe.v1.ExpertStore.Upload (client streaming) ------------------------ */

typedef struct upload_call {
  client *c;
  grpc_call *call;
  bool broken; /* a send failed: the server ended the call, its status tells why */
  XXH3_state_t *hash;
  uint64_t bytes;
  size_t chunk;
} upload_call;

static bool ops_wait(upload_call *u, const grpc_op *ops, size_t n, void *tag) {
  if (grpc_call_start_batch(u->call, ops, n, tag, NULL) != GRPC_CALL_OK) return false;
  return grpc_completion_queue_pluck(u->c->cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).success != 0;
}

static bool send_msg(upload_call *u, const Moe__V1__UploadRequest *m) {
  if (u->broken) return false;
  size_t n = moe__v1__upload_request__get_packed_size(m);
  grpc_slice s = grpc_slice_malloc(n);
  moe__v1__upload_request__pack(m, GRPC_SLICE_START_PTR(s));
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_MESSAGE;
  op.data.send_message.send_message = bb;
  u->broken = !ops_wait(u, &op, 1, (void *)2);
  grpc_byte_buffer_destroy(bb);
  return !u->broken;
}

/* One tensor in chunks: the first carries its TensorHeader. */
static bool send_tensor(upload_call *u, const char *name, const moe_tensor *t) {
  Moe__V1__TensorHeader th = MOE__V1__TENSOR_HEADER__INIT;
  th.name = (char *)name;
  th.dtype = (char *)moe_dtype_name(t->dtype);
  th.n_shape = (size_t)t->ndim;
  th.shape = (int64_t *)t->shape;
  th.nbytes = t->nbytes;
  th.xxh3 = XXH3_64bits(t->data, t->nbytes);
  size_t off = 0;
  do {
    size_t n = t->nbytes - off < u->chunk ? t->nbytes - off : u->chunk;
    Moe__V1__UploadChunk ch = MOE__V1__UPLOAD_CHUNK__INIT;
    ch.tensor = off == 0 ? &th : NULL;
    ch.data.data = (uint8_t *)t->data + off;
    ch.data.len = n;
    ch.offset = off;
    Moe__V1__UploadRequest m = MOE__V1__UPLOAD_REQUEST__INIT;
    m.part_case = MOE__V1__UPLOAD_REQUEST__PART_CHUNK;
    m.chunk = &ch;
    if (!send_msg(u, &m)) return false;
    XXH3_64bits_update(u->hash, ch.data.data, n);
    u->bytes += n;
    off += n;
  } while (off < t->nbytes);
  return true;
}

static int st_filter(const struct dirent *e) {
  size_t n = strlen(e->d_name);
  return e->d_name[0] != '.' && n > 12 && strcmp(e->d_name + n - 12, ".safetensors") == 0;
}

static char *read_text(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *buf = NULL;
  long n = -1;
  if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
      (buf = malloc((size_t)n + 1)) && fread(buf, 1, (size_t)n, f) == (size_t)n) {
    buf[n] = 0;
  } else {
    free(buf);
    buf = NULL;
  }
  fclose(f);
  return buf;
}

static int cmd_upload(client *c, const char *dir, const char *name, bool replace, size_t chunk) {
  char path[4096];
  struct dirent **files = NULL;
  int nfiles = -1, rc = 1;
  moe_safetensors *st = NULL;
  upload_call u = {c, NULL, false, XXH3_createState(), 0, chunk};
  snprintf(path, sizeof path, "%s/config.json", dir);
  char *config = read_text(path);
  if (!config) {
    fprintf(stderr, "moec: cannot read %s\n", path);
    goto done;
  }
  if ((nfiles = scandir(dir, &files, st_filter, alphasort)) < 0) {
    fprintf(stderr, "moec: cannot list %s: %s\n", dir, strerror(errno));
    goto done;
  }
  char model[256];
  if (name) {
    snprintf(model, sizeof model, "%s", name);
  } else { /* the directory's name */
    const char *end = dir + strlen(dir);
    while (end > dir && end[-1] == '/')
      end--;
    const char *start = end;
    while (start > dir && start[-1] != '/')
      start--;
    int len = end - start < (int)sizeof model - 1 ? (int)(end - start) : (int)sizeof model - 1;
    snprintf(model, sizeof model, "%.*s", len, start);
  }
  XXH3_64bits_reset(u.hash);
  gpr_timespec deadline = c->timeout_ms > 0 ? gpr_time_add(gpr_now(GPR_CLOCK_REALTIME),
                                                           gpr_time_from_millis(c->timeout_ms, GPR_TIMESPAN))
                                            : gpr_inf_future(GPR_CLOCK_REALTIME);
  grpc_slice method = grpc_slice_from_static_string("/moe.v1.ExpertStore/Upload");
  u.call =
      grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq, method, NULL, deadline, NULL);
  grpc_slice_unref(method);
  grpc_metadata_array md, trailing;
  grpc_metadata_array_init(&md);
  grpc_metadata_array_init(&trailing);
  grpc_status_code status = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();
  grpc_byte_buffer *recv = NULL;
  grpc_op ops[3];
  memset(ops, 0, sizeof ops);
  /* the status is asked for at once, so that a server that stops the
   * upload early is heard even while sends fail */
  ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[0].data.recv_status_on_client.trailing_metadata = &trailing;
  ops[0].data.recv_status_on_client.status = &status;
  ops[0].data.recv_status_on_client.status_details = &details;
  grpc_call_start_batch(u.call, ops, 1, (void *)9, NULL);
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  u.broken = !ops_wait(&u, ops, 1, (void *)1);

  Moe__V1__UploadHeader h = MOE__V1__UPLOAD_HEADER__INIT;
  h.name = model;
  h.config_json = config;
  h.replace = replace;
  h.chunk_offsets = h.tensor_xxh3 =
      true; /* the server checks each chunk's place and each tensor on arrival */
  Moe__V1__UploadRequest m = MOE__V1__UPLOAD_REQUEST__INIT;
  m.part_case = MOE__V1__UPLOAD_REQUEST__PART_HEADER;
  m.header = &h;
  bool ok = send_msg(&u, &m);
  for (int f = 0; ok && f < nfiles; f++) {
    moe_error err = {{0}};
    snprintf(path, sizeof path, "%s/%s", dir, files[f]->d_name);
    if (moe_safetensors_open(path, &st, &err) != MOE_OK) {
      fprintf(stderr, "moec: %s: %s\n", path, err.msg);
      ok = false;
      grpc_call_cancel(u.call, NULL);
      break;
    }
    for (size_t i = 0; ok && i < moe_safetensors_count(st); i++) {
      moe_tensor t;
      const char *tn = moe_safetensors_name(st, i);
      if (moe_safetensors_get(st, tn, &t, &err) != MOE_OK) {
        fprintf(stderr, "moec: %s: %s\n", path, err.msg);
        ok = false;
        grpc_call_cancel(u.call, NULL);
        break;
      }
      ok = send_tensor(&u, tn, &t);
    }
    moe_safetensors_close(st);
    st = NULL;
  }
  { /* also after a failed send: the status waits for the messages to be read */
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[1].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[1].data.recv_initial_metadata.recv_initial_metadata = &md;
    ops[2].op = GRPC_OP_RECV_MESSAGE;
    ops[2].data.recv_message.recv_message = &recv;
    grpc_call_start_batch(u.call, ops, 3, (void *)3, NULL);
    grpc_completion_queue_pluck(c->cq, (void *)3, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  }
  grpc_completion_queue_pluck(c->cq, (void *)9, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  if (status != GRPC_STATUS_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%.*s", (int)GRPC_SLICE_LENGTH(details),
             (const char *)GRPC_SLICE_START_PTR(details));
    report("Upload", status, msg);
  } else if (ok && recv) {
    grpc_slice all = moec_flatten(recv);
    Moe__V1__UploadResponse *r =
        moe__v1__upload_response__unpack(NULL, GRPC_SLICE_LENGTH(all), GRPC_SLICE_START_PTR(all));
    grpc_slice_unref(all);
    uint64_t mine = XXH3_64bits_digest(u.hash);
    if (!r) {
      fprintf(stderr, "moec: Upload: malformed response\n");
    } else if (r->bytes != u.bytes || r->checksum != mine) {
      fprintf(stderr, "moec: Upload: server got %llu bytes xxh3 %016llx, sent %llu bytes xxh3 %016llx\n",
              (unsigned long long)r->bytes, (unsigned long long)r->checksum, (unsigned long long)u.bytes,
              (unsigned long long)mine);
    } else {
      printf("uploaded %s: %llu bytes, xxh3 %016llx (verified)\n", r->name, (unsigned long long)r->bytes,
             (unsigned long long)r->checksum);
      rc = 0;
    }
    if (r) moe__v1__upload_response__free_unpacked(r, NULL);
  }
  if (recv) grpc_byte_buffer_destroy(recv);
  grpc_slice_unref(details);
  grpc_metadata_array_destroy(&md);
  grpc_metadata_array_destroy(&trailing);
  grpc_call_unref(u.call);
done:
  for (int f = 0; f < nfiles; f++)
    free(files[f]);
  free(files);
  free(config);
  XXH3_freeState(u.hash);
  return rc;
}

/* ---- bench: load on one model (client/load.c), a sweep of levels -------------------- */

typedef struct bench_opts {
  bench_run run;
  int levels[BENCH_MAX_LEVELS]; /* --concurrency: the sweep */
  int n_levels;
  load_config load; /* what every level shares */
  int variants;     /* --variants: requests per token count, each from its own rows */
  const char *json, *csv, *svg;
} bench_opts;

/* --concurrency: "N", "START:END[:STEP]" (STEP default 1) or "N,N,...". */
static bool parse_levels(const char *spec, bench_opts *o) {
  char *end;
  const char *p = spec;
  long v[3] = {0, 0, 1};
  int n = 0;
  o->n_levels = 0;
  bool list = strchr(spec, ',') != NULL;
  for (;;) {
    errno = 0;
    long x = strtol(p, &end, 10);
    if (end == p || errno || x < 1 || x > 65536) goto bad;
    p = end;
    if (list) {
      if (o->n_levels == BENCH_MAX_LEVELS) goto bad;
      o->levels[o->n_levels++] = (int)x;
    } else {
      if (n == 3) goto bad;
      v[n++] = x;
    }
    if (!*p) break;
    if (*p++ != (list ? ',' : ':')) goto bad;
  }
  if (list) return true;
  if (n == 1) v[1] = v[0];
  if (v[1] < v[0] || (v[1] - v[0]) / v[2] + 1 > BENCH_MAX_LEVELS) goto bad;
  for (long c = v[0]; c <= v[1]; c += v[2])
    o->levels[o->n_levels++] = (int)c;
  return true;
bad:
  fprintf(
      stderr,
      "moec: --concurrency %s: expected N, START:END[:STEP] or N,N,... (each 1..65536, at most %d levels)\n",
      spec, BENCH_MAX_LEVELS);
  return false;
}

/* Marks the inputs on the token axis (the first input's first dim, and
 * every input whose first dim equals it) and makes them at least `rows`
 * long: random ones generated anew, .npy ones must have that many rows
 * (each request sends a prefix). 0, or -1 said on stderr. */
static int token_rows(infer_request *ir, int64_t rows) {
  if (ir->loaded == 0 || ir->arr[0].ndim < 1 || ir->arr[0].shape[0] < 1) {
    fprintf(stderr, "moec: --tokens: the first input needs a first dim >= 1 (the token axis)\n");
    return -1;
  }
  for (int i = 0; i < ir->loaded; i++)
    ir->token_axis[i] = ir->arr[i].ndim >= 1 && ir->arr[i].shape[0] == ir->arr[0].shape[0];
  for (int i = 0; i < ir->loaded; i++) {
    npy_array *a = &ir->arr[i];
    if (!ir->token_axis[i] || a->shape[0] >= rows) continue;
    if (ir->random[i]) {
      a->shape[0] = rows;
      if (random_fill(ir->it[i].name, a, ir->random[i]) != 0) return -1;
      ir->raw[i].data = a->data;
      ir->raw[i].len = a->nbytes;
    } else {
      fprintf(stderr,
              "moec: --tokens: input %s has %lld rows, fewer than the %lld needed (the largest count x "
              "--variants)\n",
              ir->it[i].name, (long long)a->shape[0], (long long)rows);
      return -1;
    }
  }
  return 0;
}

/* The message for `rows` tokens (0: the request as given; else after
 * token_rows) from row `first` on of the inputs on the token axis: its
 * fields without the raw contents, packed, then each input's contents as
 * field 7 (raw_input_contents, the message's last field) referencing ir's
 * arrays without a copy; ir outlives the message. NULL: out of memory. */
static grpc_byte_buffer *bench_message(infer_request *ir, int64_t rows, int64_t first) {
  int n = (int)ir->req.n_inputs;
  int64_t shapes[MAX_TENSORS][NPY_MAX_DIMS];
  size_t len[MAX_TENSORS], off[MAX_TENSORS];
  grpc_slice slices[1 + 2 * MAX_TENSORS];
  for (int i = 0; i < n; i++) {
    const npy_array *a = &ir->arr[i];
    memcpy(shapes[i], a->shape, sizeof shapes[i]);
    len[i] = a->nbytes;
    off[i] = 0;
    if (rows > 0 &&
        ir->token_axis[i]) { /* rows [first, first + rows) of a (token_rows made them): no overflow */
      len[i] = a->nbytes / (size_t)a->shape[0] * (size_t)rows;
      off[i] = a->nbytes / (size_t)a->shape[0] * (size_t)first;
      shapes[i][0] = rows;
    }
    ir->it[i].shape = shapes[i];
  }
  ir->req.n_raw_input_contents = 0;
  size_t hn = inference__model_infer_request__get_packed_size(&ir->req);
  slices[0] = grpc_slice_malloc(hn);
  inference__model_infer_request__pack(&ir->req, GRPC_SLICE_START_PTR(slices[0]));
  ir->req.n_raw_input_contents = (size_t)n;
  for (int i = 0; i < n; i++) {
    ir->it[i].shape = ir->arr[i].shape;
    uint8_t head[11] = {(7 << 3) | 2}; /* field 7, length-delimited; then the length as a varint */
    size_t k = 1;
    for (uint64_t v = len[i]; k == 1 || v; v >>= 7)
      head[k++] = (uint8_t)(v & 0x7F) | (v >> 7 ? 0x80 : 0);
    slices[1 + 2 * i] = grpc_slice_from_copied_buffer((const char *)head, k);
    slices[2 + 2 * i] = grpc_slice_from_static_buffer((const uint8_t *)ir->arr[i].data + off[i], len[i]);
  }
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(slices, (size_t)(1 + 2 * n));
  for (int i = 0; i < 1 + 2 * n; i++)
    grpc_slice_unref(slices[i]);
  return bb;
}

/* A model's ModelStatistics summed over its versions: successes and the
 * time they spent in each phase. */
typedef struct stat_totals {
  uint64_t count, queue_ns, input_ns, infer_ns, output_ns;
} stat_totals;

/* A server that never answers ModelStatistics (a bare echo server whose
 * gRPC core leaves unregistered methods waiting) costs the bench this long,
 * not forever; --timeout-ms when shorter. */
#define BENCH_STATS_TIMEOUT_MS 2000

static bool stat_totals_get(client *c, const char *model, stat_totals *t) {
  char msg[1024];
  ProtobufCMessage *r;
  Inference__ModelStatisticsRequest q = INFERENCE__MODEL_STATISTICS_REQUEST__INIT;
  q.name = (char *)model;
  memset(t, 0, sizeof *t);
  client sc = *c;
  if (sc.timeout_ms <= 0 || sc.timeout_ms > BENCH_STATS_TIMEOUT_MS) sc.timeout_ms = BENCH_STATS_TIMEOUT_MS;
  grpc_status_code st = unary(&sc, "/inference.GRPCInferenceService/ModelStatistics", &q.base,
                              &inference__model_statistics_response__descriptor, &r, msg, sizeof msg);
  if (st) {
    fprintf(stderr, "moec: bench: ModelStatistics: %s: %s (no server-side breakdown)\n", load_status_name(st),
            msg);
    return false;
  }
  Inference__ModelStatisticsResponse *resp = (Inference__ModelStatisticsResponse *)r;
  for (size_t i = 0; i < resp->n_model_stats; i++) {
    const Inference__InferStatistics *is = resp->model_stats[i]->inference_stats;
    if (!is) continue;
#define ADD(field, dur)                                                                                      \
  if (is->dur) t->field += is->dur->ns
    if (is->success) t->count += is->success->count;
    ADD(queue_ns, queue);
    ADD(input_ns, compute_input);
    ADD(infer_ns, compute_infer);
    ADD(output_ns, compute_output);
#undef ADD
  }
  protobuf_c_message_free_unpacked(r, NULL);
  return true;
}

/* after - before, per successful request of the level. */
static bench_server_side server_side(const stat_totals *before, const stat_totals *after) {
  bench_server_side s = {.valid = true, .requests = after->count - before->count};
  double n = s.requests ? (double)s.requests * 1e3 : 1; /* ns per request -> us */
  s.queue_us = (double)(after->queue_ns - before->queue_ns) / n;
  s.compute_input_us = (double)(after->input_ns - before->input_ns) / n;
  s.compute_infer_us = (double)(after->infer_ns - before->infer_ns) / n;
  s.compute_output_us = (double)(after->output_ns - before->output_ns) / n;
  return s;
}

/* The progress line on a terminal: each window as it ends. */
static void bench_progress(const load_window *w, int index, void *arg) {
  const int *concurrency = arg;
  fprintf(stderr, "\rconcurrency %d: window %d: %zu requests, %.1f requests/s, p99 %.3f ms   ", *concurrency,
          index + 1, w->c.n_calls, w->requests_per_s, w->p99_s * 1e3);
  fflush(stderr);
}

/* 0 when every level's measured calls succeeded (and there was one), 1
 * otherwise; 2 for inputs that do not load. */
static int cmd_bench(client *c, const char *model, char **inputs, int n_in, char **params, int n_params,
                     bench_opts *o) {
  infer_request ir;
  token_dist td = {0};
  load_message *msgs = NULL;
  size_t n_msgs = 0;
  bench_run *b = &o->run;
  int rc = 2;
  char err[512];
  /* the output files are written after the sweep: a path that cannot be
   * written is said before the sweep runs */
  const char *const outs[3][2] = {{"--json", o->json}, {"--csv", o->csv}, {"--svg", o->svg}};
  for (int i = 0; i < 3; i++) {
    if (!outs[i][1] || strcmp(outs[i][1], "-") == 0) continue;
    FILE *f = fopen(outs[i][1], "w");
    if (!f) {
      fprintf(stderr, "moec: %s %s: %s\n", outs[i][0], outs[i][1], strerror(errno));
      return 2;
    }
    fclose(f);
  }
  if (infer_request_init(&ir, model, inputs, n_in, params, n_params) != 0) return 2;
  if (b->tokens) {
    if (token_dist_parse(b->tokens, &td, err, sizeof err) != 0) {
      fprintf(stderr, "moec: %s\n", err);
      goto done;
    }
    if (td.n * (size_t)o->variants > BENCH_MAX_MESSAGES) {
      fprintf(stderr,
              "moec: --variants %d: %zu token counts x %d variants is more than %d requests to prepare\n",
              o->variants, td.n, o->variants, BENCH_MAX_MESSAGES);
      goto done;
    }
    /* variant v of every count: rows [v x the largest count, ...) */
    if (token_rows(&ir, (int64_t)td.tokens[td.n - 1] * o->variants) != 0) goto done;
  }
  const size_t nv = (size_t)o->variants; /* 1 without --tokens (main checks) */
  n_msgs = (b->tokens ? td.n : 1) * nv;
  if (!(msgs = calloc(n_msgs, sizeof *msgs))) goto done;
  for (size_t i = 0; i < n_msgs; i++) {
    const size_t t = i / nv, v = i % nv;
    msgs[i].tokens = b->tokens ? td.tokens[t] : ir.arr[0].ndim >= 1 ? (uint32_t)ir.arr[0].shape[0] : 1;
    /* the count's probability shared evenly by its variants; its last variant ends where the count does */
    const double lo = b->tokens && t ? td.cdf[t - 1] : 0, hi = b->tokens ? td.cdf[t] : 1;
    msgs[i].cdf = v + 1 == nv ? hi : lo + (hi - lo) * (double)(v + 1) / (double)nv;
    const int64_t first = b->tokens ? (int64_t)v * td.tokens[td.n - 1] : 0;
    if (!(msgs[i].bytes = bench_message(&ir, b->tokens ? td.tokens[t] : 0, first))) goto done;
  }
  o->load.messages = msgs;
  o->load.n_messages = n_msgs;
  o->load.method = b->stream ? "/inference.GRPCInferenceService/ModelStreamInfer"
                             : "/inference.GRPCInferenceService/ModelInfer";
  if (!(b->levels = calloc((size_t)o->n_levels, sizeof *b->levels))) goto done;
  rc = 0;
  bool tty = isatty(STDERR_FILENO);
  for (int k = 0; k < o->n_levels && rc == 0; k++) {
    bench_level *l = &b->levels[k];
    load_config cfg = o->load;
    cfg.concurrency = l->concurrency = o->levels[k];
    if (cfg.channels > cfg.concurrency) cfg.channels = cfg.concurrency;
    cfg.on_window = tty ? bench_progress : NULL;
    cfg.on_window_arg = &l->concurrency;
    stat_totals before, after;
    bool have = stat_totals_get(c, model, &before);
    if (load_run(&cfg, &l->r) != 0) rc = 1;
    b->n_levels = k + 1;
    if (have && stat_totals_get(c, model, &after)) l->server = server_side(&before, &after);
    if (tty) fputc('\n', stderr);
  }
  if (rc) goto done;
  if (!(o->json && strcmp(o->json, "-") == 0)) bench_report_table(stdout, b);
  if (o->json && bench_report_write_json(o->json, b) != 0) rc = 1;
  if (o->csv && bench_report_write_csv(o->csv, b) != 0) rc = 1;
  if (o->svg && bench_report_write_svg(o->svg, b) != 0) rc = 1;
  for (int k = 0; k < b->n_levels; k++) {
    const load_result *r = &b->levels[k].r;
    if (r->c.n_calls != r->c.n_ok)
      fprintf(stderr, "moec: bench: concurrency %d: %zu of %zu requests failed (first: %s)\n",
              b->levels[k].concurrency, r->c.n_calls - r->c.n_ok, r->c.n_calls, r->first_error);
    else if (r->c.n_ok == 0)
      fprintf(stderr, "moec: bench: concurrency %d: no request completed in the measured window\n",
              b->levels[k].concurrency);
    if (r->c.n_ok == 0 || r->c.n_ok != r->c.n_calls) rc = 1;
  }
done:
  for (int k = 0; b->levels && k < b->n_levels; k++)
    load_result_free(&b->levels[k].r);
  free(b->levels);
  b->levels = NULL;
  for (size_t i = 0; msgs && i < n_msgs; i++)
    if (msgs[i].bytes) grpc_byte_buffer_destroy(msgs[i].bytes);
  free(msgs);
  token_dist_free(&td);
  infer_request_free(&ir);
  return rc;
}

/* A whole number in [lo, hi] or a message naming the flag. */
static bool flag_long(const char *flag, const char *v, long lo, long hi, long *out) {
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (!*v || *end || errno || x < lo || x > hi) {
    fprintf(stderr, "moec: %s: expected a whole number in %ld..%ld, got '%s'\n", flag, lo, hi, v);
    return false;
  }
  *out = x;
  return true;
}

static bool flag_double(const char *flag, const char *v, double lo, double hi, double *out) {
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (!*v || *end || errno || !(x >= lo && x <= hi)) {
    fprintf(stderr, "moec: %s: expected a number in %g..%g, got '%s'\n", flag, lo, hi, v);
    return false;
  }
  *out = x;
  return true;
}

static void usage(FILE *f) {
  fputs(
      "usage: moec [-a HOST:PORT] [--timeout-ms N] COMMAND\n"
      "  health                      liveness, readiness, server metadata\n"
      "  models                      the repository index\n"
      "  infer -m MODEL --input NAME=FILE.npy[:DATATYPE]... [--param K=V]... [--output-dir DIR]\n"
      "  upload DIR [--name NAME] [--replace] [--chunk-bytes N]\n"
      "                              stream an expert set (config.json + *.safetensors) to ExpertStore\n"
      "  bench -m MODEL --input ... [--param K=V]... [load flags]\n"
      "                              load one model (ModelInfer) at each level of a sweep; per level:\n"
      "                              requests/s, tokens/s, latency p50/p90/p95/p99/max, errors by gRPC\n"
      "                              status, the server's queue/compute split (ModelStatistics deltas)\n"
      "inputs (infer, bench): NAME=FILE.npy[:DATATYPE] or NAME=random:SHAPE:DATATYPE\n"
      "  (e.g. x=random:4x1024:FP32; floats uniform in [-1, 1), integers in [0, 8))\n"
      "bench load flags:\n"
      "  --concurrency C   requests in flight (closed loop; default 1): N, a sweep START:END[:STEP]\n"
      "                    (STEP default 1) or a list N,N,...; with --rate one N, the cap (default 256)\n"
      "  --channels M      gRPC channels (connections), each with one client thread (default 1; a level\n"
      "                    uses at most its concurrency)\n"
      "  --rate R          open loop: start R requests/s whatever the replies (latency from the\n"
      "                    scheduled start); --poisson: exponential gaps instead of even ones\n"
      "  --warmup S        seconds of load before each level is measured (default 1)\n"
      "  --window-ms W     measure each level in windows of W ms (default 1000; a window holds the\n"
      "                    requests that completed in it) until the last 3 windows agree ...\n"
      "  --stability-pct P ... requests/s and p99 each within P % of their mean (default 10; 0: no\n"
      "                    check) ...\n"
      "  --max-windows N   ... or N windows passed (default 10)\n"
      "  --duration S      instead: one window of S seconds per level ...\n"
      "  --requests K      ... or exactly K requests per level (counted from the warm-up's end)\n"
      "  --tokens T        token counts of the requests (the first dim of the first input and of every\n"
      "                    input whose first dim equals it): N,N,... (each request one of them),\n"
      "                    uniform:MIN:MAX or zipf:S:MAX (count k with probability ~ k^-S); shorter\n"
      "                    random inputs are made MAX rows long, .npy inputs need MAX rows (each\n"
      "                    request sends a prefix)\n"
      "  --variants N      with --tokens: N different requests per token count, drawn evenly; variant v\n"
      "                    sends the rows from v x the largest count on (random inputs are made N x\n"
      "                    that long, .npy inputs need as many rows), so that requests differ (an\n"
      "                    expert set's routing) instead of repeating one (default 1)\n"
      "  --seed N          the draws of --tokens, --variants and --poisson (default 1)\n"
      "  --stream          ModelStreamInfer: one stream per request in flight carries its requests\n"
      "  --json FILE       the report as JSON (- : stdout, instead of the table)\n"
      "  --csv FILE        one row per level (- : stdout)\n"
      "  --svg FILE        a plot of p50 and p99 latency against requests/s, one point per level\n"
      "  exit status: 0 when every measured request succeeded, 1 when any failed, 2 for bad flags\n"
      "--timeout-ms N: each call's deadline (bench: each request's)\n"
      "TLS (moed's --tls-cert): --tls-ca FILE verifies the server (PEM roots; TLS with the system roots\n"
      "  when only --tls-cert is given); --tls-cert FILE --tls-key FILE present a client certificate (mTLS)\n"
      "--token-file FILE: the bearer token on its first line is sent with every call (moed's --auth-tokens;\n"
      "  env MOEC_TOKEN gives it too)\n"
      "env: MOEC_ADDRESS (default localhost:8001)\n",
      f);
}

enum {
  OPT_CONCURRENCY = 1000,
  OPT_CHANNELS,
  OPT_RATE,
  OPT_POISSON,
  OPT_DURATION,
  OPT_REQUESTS,
  OPT_WARMUP,
  OPT_WINDOW_MS,
  OPT_STABILITY_PCT,
  OPT_MAX_WINDOWS,
  OPT_TOKENS,
  OPT_SEED,
  OPT_VARIANTS,
  OPT_JSON,
  OPT_CSV,
  OPT_SVG,
  OPT_STREAM,
  OPT_TLS_CA,
  OPT_TLS_CERT,
  OPT_TLS_KEY,
  OPT_TOKEN_FILE,
};

int main(int argc, char **argv) {
  const char *addr = getenv("MOEC_ADDRESS") ? getenv("MOEC_ADDRESS") : "localhost:8001";
  const char *model = NULL, *out_dir = ".";
  char *inputs[MAX_TENSORS], *params[MAX_TENSORS * 2];
  int n_in = 0, n_params = 0;
  long timeout_ms = 0, v;
  const char *name = NULL;
  bool replace = false, concurrency_set = false, windows_set = false;
  double duration = 0, window_ms = 1000, stability_pct = 10;
  size_t chunk = (size_t)4 << 20;
  bench_opts bo = {.levels = {1},
                   .n_levels = 1,
                   .load = {.channels = 1, .warmup_s = 1, .max_windows = 10, .seed = 1},
                   .variants = 1};
  moec_tls tls = {0};
  const char *token_file = NULL;
  char token[512] = "";
  tls.token = getenv("MOEC_TOKEN") && *getenv("MOEC_TOKEN") ? getenv("MOEC_TOKEN") : NULL;
  static const struct option opts[] = {
      {"address", required_argument, NULL, 'a'},
      {"model", required_argument, NULL, 'm'},
      {"input", required_argument, NULL, 'i'},
      {"param", required_argument, NULL, 'p'},
      {"output-dir", required_argument, NULL, 'o'},
      {"timeout-ms", required_argument, NULL, 't'},
      {"name", required_argument, NULL, 'n'},
      {"replace", no_argument, NULL, 'r'},
      {"chunk-bytes", required_argument, NULL, 'c'},
      {"concurrency", required_argument, NULL, OPT_CONCURRENCY},
      {"channels", required_argument, NULL, OPT_CHANNELS},
      {"rate", required_argument, NULL, OPT_RATE},
      {"poisson", no_argument, NULL, OPT_POISSON},
      {"duration", required_argument, NULL, OPT_DURATION},
      {"requests", required_argument, NULL, OPT_REQUESTS},
      {"warmup", required_argument, NULL, OPT_WARMUP},
      {"window-ms", required_argument, NULL, OPT_WINDOW_MS},
      {"stability-pct", required_argument, NULL, OPT_STABILITY_PCT},
      {"max-windows", required_argument, NULL, OPT_MAX_WINDOWS},
      {"tokens", required_argument, NULL, OPT_TOKENS},
      {"seed", required_argument, NULL, OPT_SEED},
      {"variants", required_argument, NULL, OPT_VARIANTS},
      {"json", required_argument, NULL, OPT_JSON},
      {"csv", required_argument, NULL, OPT_CSV},
      {"svg", required_argument, NULL, OPT_SVG},
      {"stream", no_argument, NULL, OPT_STREAM},
      {"tls-ca", required_argument, NULL, OPT_TLS_CA},
      {"tls-cert", required_argument, NULL, OPT_TLS_CERT},
      {"tls-key", required_argument, NULL, OPT_TLS_KEY},
      {"token-file", required_argument, NULL, OPT_TOKEN_FILE},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  int opt;
  /* GNU getopt permutes: the command word may stand anywhere */
  while ((opt = getopt_long(argc, argv, "a:m:i:p:o:t:n:rc:h", opts, NULL)) != -1) {
    switch (opt) {
    case 'a': addr = optarg; break;
    case 'm': model = optarg; break;
    case 'i':
      if (n_in == MAX_TENSORS) return fprintf(stderr, "moec: too many inputs\n"), 2;
      inputs[n_in++] = optarg;
      break;
    case 'p':
      if (n_params == MAX_TENSORS * 2) return fprintf(stderr, "moec: too many params\n"), 2;
      params[n_params++] = optarg;
      break;
    case 'o': out_dir = optarg; break;
    case 't':
      if (!flag_long("--timeout-ms", optarg, 0, 86400000, &timeout_ms)) return 2;
      break;
    case 'n': name = optarg; break;
    case 'r': replace = true; break;
    case 'c':
      if (!flag_long("--chunk-bytes", optarg, 1, 1L << 30, &v)) return 2;
      chunk = (size_t)v;
      break;
    case OPT_CONCURRENCY:
      if (!parse_levels(optarg, &bo)) return 2;
      concurrency_set = true;
      break;
    case OPT_CHANNELS:
      if (!flag_long("--channels", optarg, 1, 1024, &v)) return 2;
      bo.load.channels = (int)v;
      break;
    case OPT_RATE:
      if (!flag_double("--rate", optarg, 1e-3, 1e7, &bo.load.rate)) return 2;
      break;
    case OPT_POISSON: bo.load.poisson = true; break;
    case OPT_DURATION:
      if (!flag_double("--duration", optarg, 1e-3, 86400, &duration)) return 2;
      break;
    case OPT_REQUESTS:
      if (!flag_long("--requests", optarg, 1, 1000000000L, &bo.load.requests)) return 2;
      break;
    case OPT_WARMUP:
      if (!flag_double("--warmup", optarg, 0, 86400, &bo.load.warmup_s)) return 2;
      break;
    case OPT_WINDOW_MS:
      if (!flag_double("--window-ms", optarg, 1, 3600000, &window_ms)) return 2;
      windows_set = true;
      break;
    case OPT_STABILITY_PCT:
      if (!flag_double("--stability-pct", optarg, 0, 100, &stability_pct)) return 2;
      windows_set = true;
      break;
    case OPT_MAX_WINDOWS:
      if (!flag_long("--max-windows", optarg, 1, 10000, &v)) return 2;
      bo.load.max_windows = (int)v;
      windows_set = true;
      break;
    case OPT_TOKENS: bo.run.tokens = optarg; break;
    case OPT_VARIANTS:
      if (!flag_long("--variants", optarg, 1, BENCH_MAX_MESSAGES, &v)) return 2;
      bo.variants = (int)v;
      break;
    case OPT_SEED:
      if (!flag_long("--seed", optarg, 0, 2147483647L, &v)) return 2;
      bo.load.seed = (unsigned)v;
      break;
    case OPT_JSON: bo.json = optarg; break;
    case OPT_CSV: bo.csv = optarg; break;
    case OPT_SVG: bo.svg = optarg; break;
    case OPT_STREAM: bo.load.stream = true; break;
    case OPT_TLS_CA: tls.ca = optarg; break;
    case OPT_TLS_CERT: tls.cert = optarg; break;
    case OPT_TLS_KEY: tls.key = optarg; break;
    case OPT_TOKEN_FILE: token_file = optarg; break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  const char *cmd = optind < argc ? argv[optind] : NULL;
  if (!cmd) {
    usage(stderr);
    return 2;
  }
  if (token_file) { /* a file, not a flag value: a token on the command line shows in ps */
    FILE *f = fopen(token_file, "r");
    bool ok = f && fgets(token, sizeof token, f);
    if (f) fclose(f);
    token[strcspn(token, "\r\n")] = 0;
    if (!ok || !*token) {
      fprintf(stderr, "moec: --token-file %s: cannot read a token from its first line\n", token_file);
      return 2;
    }
    tls.token = token;
  }
  grpc_init();
  grpc_arg args[2];
  grpc_channel_args chargs = moec_size_args(args, 1 << 30);
  grpc_channel_credentials *creds = moec_channel_credentials(&tls);
  if (!creds) {
    grpc_shutdown();
    return 2;
  }
  client c = {grpc_channel_create(addr, creds, &chargs), grpc_completion_queue_create_for_pluck(NULL),
              (int)timeout_ms};
  bo.load.creds = creds;
  int rc;
  if (strcmp(cmd, "health") == 0)
    rc = cmd_health(&c);
  else if (strcmp(cmd, "models") == 0)
    rc = cmd_models(&c);
  else if (strcmp(cmd, "infer") == 0) {
    if (!model) {
      fprintf(stderr, "moec: infer needs -m MODEL\n");
      rc = 2;
    } else if (!output_dir_ok(out_dir)) {
      rc = 2;
    } else {
      rc = cmd_infer(&c, model, inputs, n_in, params, n_params, out_dir);
    }
  } else if (strcmp(cmd, "upload") == 0) {
    if (optind + 1 >= argc) {
      fprintf(stderr, "moec: upload needs DIR\n");
      rc = 2;
    } else {
      rc = cmd_upload(&c, argv[optind + 1], name, replace, chunk);
    }
  } else if (strcmp(cmd, "bench") == 0) {
    if (!model) {
      fprintf(stderr, "moec: bench needs -m MODEL\n");
      rc = 2;
    } else if (bo.load.stream && timeout_ms > 0) {
      fprintf(stderr, "moec: --timeout-ms: a deadline per request does not apply to --stream\n");
      rc = 2;
    } else if (bo.variants > 1 && !bo.run.tokens) {
      fprintf(stderr, "moec: --variants needs --tokens (the rows each variant sends)\n");
      rc = 2;
    } else if (bo.load.poisson && bo.load.rate <= 0) {
      fprintf(stderr, "moec: --poisson needs --rate\n");
      rc = 2;
    } else if (bo.load.rate > 0 && bo.n_levels > 1) {
      fprintf(stderr, "moec: --concurrency: a sweep is of closed-loop levels; with --rate give one cap\n");
      rc = 2;
    } else if ((duration > 0) + (bo.load.requests > 0) + windows_set > 1) {
      fprintf(stderr, "moec: --duration, --requests and --window-ms/--stability-pct/--max-windows: one of "
                      "them says how a level is measured\n");
      rc = 2;
    } else {
      if (bo.load.rate > 0 && !concurrency_set) bo.levels[0] = 256;
      bo.load.target = addr;
      bo.load.timeout_ms = (int)timeout_ms;
      bo.load.window_s = duration > 0 ? duration : window_ms / 1e3;
      bo.load.stability = duration > 0 ? 0 : stability_pct / 100;
      if (duration > 0) bo.load.max_windows = 1;
      bo.run = (bench_run){.model = model,
                           .target = addr,
                           .stream = bo.load.stream,
                           .channels = bo.load.channels,
                           .rate = bo.load.rate,
                           .poisson = bo.load.poisson,
                           .tokens = bo.run.tokens,
                           .seed = bo.load.seed,
                           .variants = bo.variants,
                           .requests = bo.load.requests,
                           .window_s = bo.load.window_s,
                           .max_windows = bo.load.max_windows,
                           .stability = bo.load.stability};
      rc = cmd_bench(&c, model, inputs, n_in, params, n_params, &bo);
    }
  } else {
    fprintf(stderr, "moec: unknown command '%s'\n", cmd);
    usage(stderr);
    rc = 2;
  }
  grpc_channel_destroy(c.ch);
  grpc_channel_credentials_release(creds);
  grpc_completion_queue_shutdown(c.cq);
  while (grpc_completion_queue_pluck(c.cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(c.cq);
  grpc_shutdown();
  return rc;
}
