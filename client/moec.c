/* moec: moed's command-line client on gRPC core.
 *
 *   moec [-a HOST:PORT] health
 *   moec [-a HOST:PORT] models
 *   moec [-a HOST:PORT] infer -m MODEL --input NAME=FILE.npy[:DATATYPE] ...
 *        [--param KEY=VALUE ...] [--output-dir DIR] [--timeout-ms N]
 *
 * Inputs are sent as raw_input_contents; the KServe datatype follows the
 * npy dtype (<f4 FP32, <f2 FP16, |u1 UINT8, |i1 INT8, <i4 INT32) or the
 * :DATATYPE suffix (BF16 data are stored in .npy files as <u2). Outputs are
 * written as DIR/NAME.npy (BF16 as <u2; narrow formats as |u1 bytes, their
 * real format printed). */
#include <errno.h>
#include <getopt.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/support/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "grpc_service.pb-c.h"
#include "npy.h"

#define MAX_TENSORS 16

typedef struct client {
  grpc_channel *ch;
  grpc_completion_queue *cq;
  int timeout_ms;
} client;

/* One unary call. Returns the gRPC status; *resp unpacked on OK. */
static grpc_status_code unary(client *c, const char *method, const ProtobufCMessage *req,
                              const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp, char *msg, size_t cap) {
  size_t n = protobuf_c_message_get_packed_size(req);
  grpc_slice s = grpc_slice_malloc(n);
  protobuf_c_message_pack(req, GRPC_SLICE_START_PTR(s));
  grpc_byte_buffer *send = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  gpr_timespec deadline = c->timeout_ms > 0 ? gpr_time_add(gpr_now(GPR_CLOCK_REALTIME),
                                                           gpr_time_from_millis(c->timeout_ms, GPR_TIMESPAN))
                                            : gpr_inf_future(GPR_CLOCK_REALTIME);
  grpc_slice m = grpc_slice_from_static_string(method);
  grpc_call *call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq, m, NULL, deadline, NULL);
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

static const char *code_name(grpc_status_code c) {
  static const char *const names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                      "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                      "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  return (unsigned)c < sizeof names / sizeof names[0] ? names[c] : "?";
}

static int report(const char *what, grpc_status_code st, const char *msg) {
  fprintf(stderr, "moec: %s: %s: %s\n", what, code_name(st), msg);
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
  st = unary(c, "/inference.GRPCInferenceService/ServerReady", &rq.base, &inference__server_ready_response__descriptor,
             &r, msg, sizeof msg);
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
  for (size_t i = 0; i < m->n_extensions; i++) printf(" %s", m->extensions[i]);
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

static const struct { const char *descr, *kserve; } npy_kserve[] = {
    {"<f4", "FP32"}, {"<f2", "FP16"}, {"<u2", "BF16"}, {"|u1", "UINT8"}, {"|i1", "INT8"}, {"<i4", "INT32"},
};

static const char *descr_for(const char *kserve) {
  for (size_t i = 0; i < sizeof npy_kserve / sizeof npy_kserve[0]; i++)
    if (strcmp(npy_kserve[i].kserve, kserve) == 0) return npy_kserve[i].descr;
  return NULL;
}

/* "k=v": bool, int, double or string by the look of v. */
static int parse_param(char *kv, Inference__ModelInferRequest__ParametersEntry *e, Inference__InferParameter *p) {
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

static int cmd_infer(client *c, const char *model, char **inputs, int n_in, char **params, int n_params,
                     const char *out_dir) {
  npy_array arr[MAX_TENSORS];
  Inference__ModelInferRequest__InferInputTensor it[MAX_TENSORS], *pit[MAX_TENSORS];
  ProtobufCBinaryData raw[MAX_TENSORS];
  Inference__ModelInferRequest__ParametersEntry pe[MAX_TENSORS * 2], *ppe[MAX_TENSORS * 2];
  Inference__InferParameter pv[MAX_TENSORS * 2];
  char err[512];
  int rc = 1, loaded = 0;
  for (int i = 0; i < n_in; i++) {
    char *spec = inputs[i];
    char *eq = strchr(spec, '=');
    if (!eq) {
      fprintf(stderr, "moec: --input %s: expected NAME=FILE.npy[:DATATYPE]\n", spec);
      goto done;
    }
    *eq = 0;
    char *file = eq + 1;
    char *dt = strrchr(file, ':');
    if (dt) *dt++ = 0;
    if (npy_read(file, &arr[i], err, sizeof err) != 0) {
      fprintf(stderr, "moec: %s\n", err);
      goto done;
    }
    loaded++;
    const char *kserve = dt;
    if (!kserve)
      for (size_t k = 0; k < sizeof npy_kserve / sizeof npy_kserve[0]; k++)
        if (strcmp(npy_kserve[k].descr, arr[i].descr) == 0) kserve = npy_kserve[k].kserve;
    if (!kserve) {
      fprintf(stderr, "moec: %s: npy dtype %s has no KServe datatype\n", file, arr[i].descr);
      goto done;
    }
    inference__model_infer_request__infer_input_tensor__init(&it[i]);
    it[i].name = spec;
    it[i].datatype = (char *)kserve;
    it[i].n_shape = (size_t)arr[i].ndim;
    it[i].shape = arr[i].shape;
    pit[i] = &it[i];
    raw[i].data = arr[i].data;
    raw[i].len = arr[i].nbytes;
  }
  for (int i = 0; i < n_params; i++)
    if (parse_param(params[i], &pe[i], &pv[i]) != 0) {
      fprintf(stderr, "moec: --param %s: expected KEY=VALUE\n", params[i]);
      goto done;
    } else {
      ppe[i] = &pe[i];
    }
  Inference__ModelInferRequest req = INFERENCE__MODEL_INFER_REQUEST__INIT;
  req.model_name = (char *)model;
  req.n_inputs = (size_t)n_in;
  req.inputs = pit;
  req.n_raw_input_contents = (size_t)n_in;
  req.raw_input_contents = raw;
  req.n_parameters = (size_t)n_params;
  req.parameters = ppe;
  ProtobufCMessage *r;
  char msg[1024];
  grpc_status_code st = unary(c, "/inference.GRPCInferenceService/ModelInfer", &req.base,
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
          o->parameters[k]->value->parameter_choice_case == INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM)
        real = o->parameters[k]->value->string_param;
    printf("%s %s [", o->name, o->datatype);
    for (size_t d = 0; d < o->n_shape; d++) printf("%s%lld", d ? ", " : "", (long long)o->shape[d]);
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
  for (int i = 0; i < loaded; i++) npy_free(&arr[i]);
  return rc;
}

static void usage(FILE *f) {
  fputs("usage: moec [-a HOST:PORT] [--timeout-ms N] COMMAND\n"
        "  health                      liveness, readiness, server metadata\n"
        "  models                      the repository index\n"
        "  infer -m MODEL --input NAME=FILE.npy[:DATATYPE]... [--param K=V]... [--output-dir DIR]\n"
        "env: MOEC_ADDRESS (default localhost:8001)\n",
        f);
}

int main(int argc, char **argv) {
  const char *addr = getenv("MOEC_ADDRESS") ? getenv("MOEC_ADDRESS") : "localhost:8001";
  const char *model = NULL, *out_dir = ".";
  char *inputs[MAX_TENSORS], *params[MAX_TENSORS * 2];
  int n_in = 0, n_params = 0, timeout_ms = 0;
  static const struct option opts[] = {
      {"address", required_argument, NULL, 'a'}, {"model", required_argument, NULL, 'm'},
      {"input", required_argument, NULL, 'i'},   {"param", required_argument, NULL, 'p'},
      {"output-dir", required_argument, NULL, 'o'}, {"timeout-ms", required_argument, NULL, 't'},
      {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0},
  };
  int opt;
  /* GNU getopt permutes: the command word may stand anywhere */
  while ((opt = getopt_long(argc, argv, "a:m:i:p:o:t:h", opts, NULL)) != -1) {
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
    case 't': timeout_ms = atoi(optarg); break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  const char *cmd = optind < argc ? argv[optind] : NULL;
  if (!cmd) {
    usage(stderr);
    return 2;
  }
  grpc_init();
  grpc_arg args[2];
  memset(args, 0, sizeof args);
  args[0].type = args[1].type = GRPC_ARG_INTEGER;
  args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  args[1].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
  args[0].value.integer = args[1].value.integer = 1 << 30;
  grpc_channel_args chargs = {2, args};
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  client c = {grpc_channel_create(addr, creds, &chargs), grpc_completion_queue_create_for_pluck(NULL), timeout_ms};
  grpc_channel_credentials_release(creds);
  int rc;
  if (strcmp(cmd, "health") == 0)
    rc = cmd_health(&c);
  else if (strcmp(cmd, "models") == 0)
    rc = cmd_models(&c);
  else if (strcmp(cmd, "infer") == 0) {
    if (!model) {
      fprintf(stderr, "moec: infer needs -m MODEL\n");
      rc = 2;
    } else {
      rc = cmd_infer(&c, model, inputs, n_in, params, n_params, out_dir);
    }
  } else {
    fprintf(stderr, "moec: unknown command '%s'\n", cmd);
    usage(stderr);
    rc = 2;
  }
  grpc_channel_destroy(c.ch);
  grpc_completion_queue_shutdown(c.cq);
  while (grpc_completion_queue_pluck(c.cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type != GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(c.cq);
  grpc_shutdown();
  return rc;
}
