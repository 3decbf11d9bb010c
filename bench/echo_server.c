/* echo_server: the service benchmark's baseline (BENCH.md "Service").
 *
 * A minimal gRPC C-core server that answers ModelInfer by sending the
 * request's bytes back: the same stack, transport and call pattern as moed
 * (registered method, payload read with the accept, one completion-queue
 * thread, accept slots re-armed on every call) with no work in between.
 * Whatever moed costs beyond this is moed's own.
 *
 *   echo_server [--port N] [--port-file PATH] [--slots N]
 * Runs until SIGINT/SIGTERM. */
#include "../client/grpc_args.h"
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct slot {
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload;
  int cancelled;
  grpc_slice details;
  int phase; /* 0 armed, 1 answering */
} slot;

static grpc_server *server;
static grpc_completion_queue *cq;
static void *method;
static volatile sig_atomic_t stop;

static void arm(slot *s) {
  s->phase = 0;
  s->call = NULL;
  s->payload = NULL;
  grpc_metadata_array_init(&s->md);
  grpc_server_request_registered_call(server, method, &s->call, &s->deadline, &s->md, &s->payload, cq, cq, s);
}

static void answer(slot *s) {
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  s->details = grpc_empty_slice();
  if (!s->payload) s->payload = grpc_raw_byte_buffer_create(NULL, 0); /* the client sent none */
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = s->payload;
  ops[2].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[2].data.send_status_from_server.status = GRPC_STATUS_OK;
  ops[2].data.send_status_from_server.status_details = &s->details;
  ops[3].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[3].data.recv_close_on_server.cancelled = &s->cancelled;
  s->phase = 1;
  grpc_call_start_batch(s->call, ops, 4, s, NULL);
}

static void on_signal(int sig) {
  (void)sig;
  stop = 1;
}

int main(int argc, char **argv) {
  int port = 0, nslots = 64;
  const char *port_file = NULL;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--port") == 0)
      port = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--port-file") == 0)
      port_file = argv[i + 1];
    else if (strcmp(argv[i], "--slots") == 0)
      nslots = atoi(argv[i + 1]);
    else
      return fprintf(stderr, "usage: echo_server [--port N] [--port-file PATH] [--slots N]\n"), 2;
  }
  if (nslots < 1) nslots = 1;
  grpc_init();
  grpc_arg args[2];
  grpc_channel_args chargs = moec_size_args(args, 1 << 30);
  server = grpc_server_create(&chargs, NULL);
  cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(server, cq, NULL);
  method = grpc_server_register_method(server, "/inference.GRPCInferenceService/ModelInfer", NULL,
                                       GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
  int bound = grpc_server_add_http2_port(server, addr, creds);
  grpc_server_credentials_release(creds);
  if (bound <= 0) return fprintf(stderr, "echo_server: cannot listen on %s\n", addr), 1;
  grpc_server_start(server);
  slot *slots = calloc((size_t)nslots, sizeof *slots);
  if (!slots) return 1;
  for (int i = 0; i < nslots; i++)
    arm(&slots[i]);
  if (port_file) {
    FILE *f = fopen(port_file, "w");
    if (f) {
      fprintf(f, "%d\n", bound);
      fclose(f);
    }
  }
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  bool shutting = false;
  int tag_shutdown = 0;
  for (;;) {
    if (stop && !shutting) {
      shutting = true;
      grpc_server_shutdown_and_notify(server, cq, &tag_shutdown);
      grpc_server_cancel_all_calls(server);
    }
    grpc_event ev = grpc_completion_queue_next(
        cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(200, GPR_TIMESPAN)), NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) continue;
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.tag == &tag_shutdown) {
      grpc_completion_queue_shutdown(cq);
      continue;
    }
    slot *s = ev.tag;
    if (s->phase == 0) {
      grpc_metadata_array_destroy(&s->md);
      if (!ev.success) continue; /* shutting down */
      answer(s);
    } else {
      if (s->payload) grpc_byte_buffer_destroy(s->payload);
      grpc_call_unref(s->call);
      if (!shutting) arm(s);
    }
  }
  grpc_server_destroy(server);
  grpc_completion_queue_destroy(cq);
  free(slots);
  grpc_shutdown();
  return 0;
}
