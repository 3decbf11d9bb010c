/* bench_service: the service load generator (BENCH.md "Service").
 *
 *   bench_service --target HOST:PORT --mode small --concurrency N [--seconds S] [--warmup S] [--threads T]
 *   bench_service --target HOST:PORT --mode large [--calls N] [--out-dtype fp8_e4m3fn|int8]
 *
 * small: ModelInfer quant.per_tensor on a 4 KiB FP32 tensor [1, 1024]
 *   (out_dtype fp8_e4m3fn), `concurrency` calls kept in flight over T
 *   channels, one client thread and completion queue each (client/load.c,
 *   the engine of `moec bench`); after the warm-up, every call's latency is
 *   recorded: p50, p99, max, calls/s.
 * large: one 64 MiB activation (BF16 [4096, 8192]) quant.per_token call at a
 *   time; GB/s = request bytes / end-to-end time (median of the calls).
 * Prints one line of key=value pairs. The same request bytes go to an echo
 * server for the baseline (it sends them back). */
#include <grpc/grpc.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc_service.pb-c.h"
#include "load.h"

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

/* ---- the run: client/load.c ------------------------------------------------------ */

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
  size_t bytes = 0;
  load_message msg = {make_request(large, out_dtype, &bytes), 1, 1};
  load_config cfg = {.target = target,
                     .method = "/inference.GRPCInferenceService/ModelInfer",
                     .messages = &msg,
                     .n_messages = 1,
                     .channels = threads,
                     .concurrency = concurrency,
                     .warmup_s = large ? 0 : warmup,
                     .warmup_requests = large ? 1 : 0, /* the first large call warms the allocators */
                     .window_s = seconds,              /* one window of `seconds` */
                     .max_windows = 1,
                     .requests = large ? calls : 0};
  if (!msg.bytes) return 1;
  load_result r;
  int rc = load_run(&cfg, &r) == 0 ? 0 : 1;
  if (rc == 0 && large) {
    double med = load_percentile(&r, 0.5);
    printf("mode=large request_bytes=%zu response_bytes=%zu calls=%zu median_ms=%.2f min_ms=%.2f gbps=%.3f\n",
           bytes, r.c.n_ok ? (size_t)(r.c.bytes_received / r.c.n_ok) : 0, r.c.n_ok, med * 1e3,
           r.c.n_ok ? r.latency_s[0] * 1e3 : 0, med > 0 ? (double)bytes / med / 1e9 : 0);
  } else if (rc == 0) {
    printf("mode=small concurrency=%d calls=%zu errors=%zu p50_us=%.1f p90_us=%.1f p99_us=%.1f max_us=%.1f "
           "calls_per_s=%.0f\n",
           concurrency, r.c.n_ok, r.c.n_calls - r.c.n_ok, load_percentile(&r, 0.5) * 1e6,
           load_percentile(&r, 0.9) * 1e6, load_percentile(&r, 0.99) * 1e6, load_percentile(&r, 1.0) * 1e6,
           r.elapsed_s > 0 ? (double)r.c.n_ok / r.elapsed_s : 0);
  }
  if (rc == 0 && r.c.n_calls != r.c.n_ok) {
    fprintf(stderr, "bench_service: %zu calls failed (first: %s)\n", r.c.n_calls - r.c.n_ok, r.first_error);
    rc = 1;
  }
  load_result_free(&r);
  grpc_byte_buffer_destroy(msg.bytes);
  grpc_shutdown();
  return rc;
}
