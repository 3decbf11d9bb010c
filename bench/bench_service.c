/* bench_service: the service load generator (BENCH.md "Service").
 *
 *   bench_service --target HOST:PORT --mode small --concurrency N [--seconds S] [--warmup S] [--threads T]
 *   bench_service --target HOST:PORT --mode large [--calls N] [--out-dtype fp8_e4m3fn|int8]
 *
 * small: ModelInfer quant.per_tensor on a 4 KiB FP32 tensor [1, 1024]
 *   (out_dtype fp8_e4m3fn), `concurrency` calls kept in flight over one
 *   channel by T client threads (each its own completion queue); after the
 *   warm-up, every call's latency is recorded: p50, p99, max, calls/s.
 * large: one 64 MiB activation (BF16 [4096, 8192]) quant.per_token call at a
 *   time; GB/s = request bytes / end-to-end time (median of the calls).
 * Prints one line of key=value pairs. The same request bytes go to an echo
 * server for the baseline (it sends them back). */
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../client/grpc_args.h"
#include "grpc_service.pb-c.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- the request ----------------------------------------------------------------- */

static grpc_byte_buffer *make_request(bool large, const char *out_dtype, size_t *bytes) {
  int64_t shape_small[2] = {1, 1024}, shape_large[2] = {4096, 8192};
  int64_t *shape = large ? shape_large : shape_small;
  size_t n = (size_t)(shape[0] * shape[1]) * (large ? 2 : 4);
  uint8_t *data = malloc(n);
  if (!data) return NULL;
  /* deterministic, finite values: bf16/fp32 bit patterns of small numbers */
  uint32_t x = 12345;
  if (large) {
    uint16_t *p = (uint16_t *)data;
    for (size_t i = 0; i < n / 2; i++) {
      x = x * 1664525u + 1013904223u;
      p[i] = (uint16_t)(0x3C00 + (x >> 25)); /* bf16 in [2^-7, 2^-6) * small mantissas */
    }
  } else {
    float *p = (float *)data;
    for (size_t i = 0; i < n / 4; i++) {
      x = x * 1664525u + 1013904223u;
      p[i] = (float)((int32_t)(x >> 8) - (1 << 23)) / (float)(1 << 20);
    }
  }
  Inference__ModelInferRequest__InferInputTensor in =
      INFERENCE__MODEL_INFER_REQUEST__INFER_INPUT_TENSOR__INIT;
  Inference__ModelInferRequest__InferInputTensor *pin = &in;
  in.name = "x";
  in.datatype = large ? "BF16" : "FP32";
  in.n_shape = 2;
  in.shape = shape;
  Inference__InferParameter pv = INFERENCE__INFER_PARAMETER__INIT;
  pv.parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM;
  pv.string_param = (char *)out_dtype;
  Inference__ModelInferRequest__ParametersEntry pe = INFERENCE__MODEL_INFER_REQUEST__PARAMETERS_ENTRY__INIT;
  Inference__ModelInferRequest__ParametersEntry *ppe = &pe;
  pe.key = "out_dtype";
  pe.value = &pv;
  ProtobufCBinaryData raw = {n, data};
  Inference__ModelInferRequest req = INFERENCE__MODEL_INFER_REQUEST__INIT;
  req.model_name = large ? "quant.per_token" : "quant.per_tensor";
  req.n_inputs = 1;
  req.inputs = &pin;
  req.n_parameters = 1;
  req.parameters = &ppe;
  req.n_raw_input_contents = 1;
  req.raw_input_contents = &raw;
  size_t len = inference__model_infer_request__get_packed_size(&req);
  grpc_slice s = grpc_slice_malloc(len);
  inference__model_infer_request__pack(&req, GRPC_SLICE_START_PTR(s));
  free(data);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  *bytes = n;
  return bb;
}

/* ---- calls ------------------------------------------------------------------------------- */

typedef struct call_state {
  grpc_call *call;
  grpc_byte_buffer *send, *recv;
  grpc_metadata_array md, trailing;
  grpc_status_code status;
  grpc_slice details;
  double start;
} call_state;

typedef struct bench {
  grpc_channel *ch;
  grpc_byte_buffer *request;
  double measure_from, measure_to;
  pthread_mutex_t mu;
  double *lat;
  size_t n_lat, cap_lat;
  size_t errors;
  grpc_status_code last_error;
} bench;

static void call_start(bench *b, grpc_completion_queue *cq, call_state *c) {
  memset(c, 0, sizeof *c);
  c->send = grpc_byte_buffer_copy(b->request);
  grpc_metadata_array_init(&c->md);
  grpc_metadata_array_init(&c->trailing);
  c->details = grpc_empty_slice();
  grpc_slice method = grpc_slice_from_static_string("/inference.GRPCInferenceService/ModelInfer");
  c->call = grpc_channel_create_call(b->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method, NULL,
                                     gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = c->send;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &c->md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &c->recv;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &c->trailing;
  ops[5].data.recv_status_on_client.status = &c->status;
  ops[5].data.recv_status_on_client.status_details = &c->details;
  c->start = now_s();
  grpc_call_start_batch(c->call, ops, 6, c, NULL);
}

static void call_end(call_state *c) {
  grpc_byte_buffer_destroy(c->send);
  if (c->recv) grpc_byte_buffer_destroy(c->recv);
  grpc_metadata_array_destroy(&c->md);
  grpc_metadata_array_destroy(&c->trailing);
  grpc_slice_unref(c->details);
  grpc_call_unref(c->call);
}

typedef struct thread_arg {
  bench *b;
  int calls; /* kept in flight by this thread */
} thread_arg;

static void *client_thread(void *arg) {
  bench *b = ((thread_arg *)arg)->b;
  int per_thread = ((thread_arg *)arg)->calls;
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  call_state *calls = calloc((size_t)per_thread, sizeof *calls);
  size_t cap = 1 << 16, n = 0;
  double *lat = malloc(cap * sizeof *lat);
  if (!calls || !lat) abort();
  for (int i = 0; i < per_thread; i++)
    call_start(b, cq, &calls[i]);
  int live = per_thread;
  size_t errors = 0;
  grpc_status_code last = GRPC_STATUS_OK;
  while (live) {
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type != GRPC_OP_COMPLETE) continue;
    call_state *c = ev.tag;
    double t = now_s();
    if (c->start >= b->measure_from && t <= b->measure_to) {
      if (c->status != GRPC_STATUS_OK || !ev.success) {
        errors++;
        last = c->status;
      } else {
        if (n == cap) {
          cap *= 2;
          double *g = realloc(lat, cap * sizeof *g);
          if (!g) abort();
          lat = g;
        }
        lat[n++] = t - c->start;
      }
    }
    call_end(c);
    if (t < b->measure_to)
      call_start(b, cq, c);
    else
      live--;
  }
  pthread_mutex_lock(&b->mu);
  if (b->n_lat + n > b->cap_lat) {
    size_t want = b->n_lat + n;
    double *g = realloc(b->lat, want * sizeof *g);
    if (!g) abort();
    b->lat = g;
    b->cap_lat = want;
  }
  memcpy(b->lat + b->n_lat, lat, n * sizeof *lat);
  b->n_lat += n;
  b->errors += errors;
  if (errors) b->last_error = last;
  pthread_mutex_unlock(&b->mu);
  free(lat);
  free(calls);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  return NULL;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double pct(const double *v, size_t n, double p) {
  if (!n) return 0;
  size_t i = (size_t)(p * (double)(n - 1) + 0.5);
  return v[i];
}

int main(int argc, char **argv) {
  const char *target = "127.0.0.1:8001", *mode = "small", *out_dtype = "fp8_e4m3fn";
  int concurrency = 1, threads = 1, calls = 5;
  double seconds = 2, warmup = 0.5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--target") == 0)
      target = argv[i + 1];
    else if (strcmp(argv[i], "--mode") == 0)
      mode = argv[i + 1];
    else if (strcmp(argv[i], "--concurrency") == 0)
      concurrency = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--threads") == 0)
      threads = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--seconds") == 0)
      seconds = atof(argv[i + 1]);
    else if (strcmp(argv[i], "--warmup") == 0)
      warmup = atof(argv[i + 1]);
    else if (strcmp(argv[i], "--calls") == 0)
      calls = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--out-dtype") == 0)
      out_dtype = argv[i + 1];
    else {
      fprintf(stderr,
              "usage: bench_service --target HOST:PORT --mode small|large [--concurrency N] [--threads T] "
              "[--seconds S] [--warmup S] [--calls N] [--out-dtype fp8_e4m3fn|int8]\n");
      return 2;
    }
  }
  bool large = strcmp(mode, "large") == 0;
  if (concurrency < 1 || threads < 1 || calls < 1) return fprintf(stderr, "bench_service: bad counts\n"), 2;
  if (large) concurrency = threads = 1;
  if (threads > concurrency) threads = concurrency;
  grpc_init();
  grpc_arg args[2];
  grpc_channel_args chargs = moec_size_args(args, 1 << 30);
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  bench b;
  memset(&b, 0, sizeof b);
  pthread_mutex_init(&b.mu, NULL);
  b.ch = grpc_channel_create(target, creds, &chargs);
  grpc_channel_credentials_release(creds);
  size_t bytes = 0;
  b.request = make_request(large, out_dtype, &bytes);
  if (!b.request) return 1;
  int rc = 0;
  if (large) {
    /* sequential calls; the first warms the allocators and the connection */
    double *t = calloc((size_t)calls, sizeof *t);
    for (int i = 0; i <= calls; i++) {
      b.measure_from = 0;
      b.measure_to = 1e300;
      grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
      call_state c;
      call_start(&b, cq, &c);
      grpc_completion_queue_pluck(cq, &c, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
      double dt = now_s() - c.start;
      if (c.status != GRPC_STATUS_OK) {
        fprintf(stderr, "bench_service: status %d: %.*s\n", (int)c.status, (int)GRPC_SLICE_LENGTH(c.details),
                (const char *)GRPC_SLICE_START_PTR(c.details));
        rc = 1;
      }
      size_t resp = c.recv ? grpc_byte_buffer_length(c.recv) : 0;
      call_end(&c);
      grpc_completion_queue_shutdown(cq);
      grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
      grpc_completion_queue_destroy(cq);
      if (i > 0) t[i - 1] = dt;
      if (i == calls) {
        qsort(t, (size_t)calls, sizeof *t, cmp_double);
        double med = pct(t, (size_t)calls, 0.5);
        printf(
            "mode=large request_bytes=%zu response_bytes=%zu calls=%d median_ms=%.2f min_ms=%.2f gbps=%.3f\n",
            bytes, resp, calls, med * 1e3, t[0] * 1e3, (double)bytes / med / 1e9);
      }
    }
    free(t);
  } else {
    double t0 = now_s();
    b.measure_from = t0 + warmup;
    b.measure_to = t0 + warmup + seconds;
    pthread_t th[256];
    thread_arg ta[256];
    if (threads > 256) threads = 256;
    for (int i = 0; i < threads; i++) {
      ta[i] = (thread_arg){&b, concurrency / threads + (i < concurrency % threads)};
      if (pthread_create(&th[i], NULL, client_thread, &ta[i]) != 0) return 1;
    }
    for (int i = 0; i < threads; i++)
      pthread_join(th[i], NULL);
    qsort(b.lat, b.n_lat, sizeof *b.lat, cmp_double);
    printf("mode=small concurrency=%d calls=%zu errors=%zu p50_us=%.1f p90_us=%.1f p99_us=%.1f max_us=%.1f "
           "calls_per_s=%.0f\n",
           concurrency, b.n_lat, b.errors, pct(b.lat, b.n_lat, 0.5) * 1e6, pct(b.lat, b.n_lat, 0.9) * 1e6,
           pct(b.lat, b.n_lat, 0.99) * 1e6, b.n_lat ? b.lat[b.n_lat - 1] * 1e6 : 0,
           (double)b.n_lat / seconds);
    if (b.errors) {
      fprintf(stderr, "bench_service: %zu calls failed (last status %d)\n", b.errors, (int)b.last_error);
      rc = 1;
    }
    free(b.lat);
  }
  grpc_byte_buffer_destroy(b.request);
  grpc_channel_destroy(b.ch);
  pthread_mutex_destroy(&b.mu);
  grpc_shutdown();
  return rc;
}
