/* load: the load engine of `moec bench` and bench/moe-bench-service. One
 * packed request is sent over and over on gRPC core: kept `concurrency`
 * times in flight (closed loop) or started at a request rate (open loop),
 * over `channels` channels, each driven by its own thread and completion
 * queue. After the warm-up every call's status, latency and bytes are
 * recorded. */
#ifndef MOEC_LOAD_H
#define MOEC_LOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>

#define LOAD_STATUS_CODES 17 /* gRPC status codes 0..16; others count as UNKNOWN */

typedef struct load_config {
  const char *target;              /* HOST:PORT */
  grpc_channel_credentials *creds; /* not owned; NULL: plaintext */
  const char *method;              /* "/inference.GRPCInferenceService/ModelInfer" */
  bool stream;                     /* method is ModelStreamInfer: one stream per in-flight slot carries
                                      its requests in turn (errors come as error_message) */
  grpc_byte_buffer *request;       /* sent by every call; not owned */
  int channels;                    /* >= 1; one client thread each */
  int concurrency;                 /* calls in flight at most, all channels together (>= channels) */
  double rate;                     /* > 0: open loop, calls started per second; 0: closed loop */
  bool poisson;                    /* open loop: exponential gaps instead of constant ones */
  double warmup_s;                 /* calls started earlier are not measured */
  long warmup_requests;            /* ... nor the first this many calls */
  double duration_s;               /* measure this long (when requests == 0) */
  long requests;                   /* > 0: measure exactly this many calls instead */
  int timeout_ms;                  /* each call's deadline (stream: the whole stream's); 0 = none */
} load_config;

typedef struct load_result {
  double *latency_s;                   /* OK calls, sorted ascending */
  size_t n_ok;                         /* == by_status[0] */
  size_t n_calls;                      /* measured calls, all statuses */
  size_t by_status[LOAD_STATUS_CODES]; /* measured calls by gRPC status */
  uint64_t bytes_sent, bytes_received; /* measured calls' request and response messages */
  double elapsed_s;                    /* first measured start to last measured completion */
  size_t late;                         /* open loop: measured calls started > 1 ms late (cap, busy client) */
  char first_error[256];               /* the first failed call's status details */
} load_result;

/* 0, or -1 when a thread or buffer could not be had (said on stderr). The
 * caller frees out with load_result_free. */
int load_run(const load_config *cfg, load_result *out);
void load_result_free(load_result *r);
/* The p-quantile (0..1) of the OK latencies by nearest rank; 0 without any. */
double load_percentile(const load_result *r, double p);
/* "OK", "NOT_FOUND", ... */
const char *load_status_name(grpc_status_code c);

#endif
