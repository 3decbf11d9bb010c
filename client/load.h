/* load: the load engine of `moec bench` and bench/moe-bench-service. Packed
 * requests are sent over and over on gRPC core: kept `concurrency` times in
 * flight (closed loop) or started at a request rate (open loop), over
 * `channels` channels, each driven by its own thread and completion queue.
 * Each call sends one of a few prepared messages, drawn at random (seeded)
 * by their probabilities.
 *
 * What is measured: either exactly `requests` calls after the warm-up, or
 * the calls completed in consecutive windows of `window_s` seconds after
 * the warm-up, until the last LOAD_STABLE_WINDOWS windows agree (requests/s
 * and p99 each within `stability` of their mean) or `max_windows` have
 * passed. A window holds the calls that completed in it, so the run's
 * counts are the sums over its windows. */
#ifndef MOEC_LOAD_H
#define MOEC_LOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>

#define LOAD_STATUS_CODES 17  /* gRPC status codes 0..16; others count as UNKNOWN */
#define LOAD_STABLE_WINDOWS 3 /* windows that must agree for a run to be stable */

/* One prepared request message. */
typedef struct load_message {
  grpc_byte_buffer *bytes; /* not owned */
  uint32_t tokens;         /* its token count, for tokens/s */
  double cdf;              /* the probability of this message and those before it; the last is 1 */
} load_message;

typedef struct load_window load_window;

typedef struct load_config {
  const char *target;              /* HOST:PORT */
  grpc_channel_credentials *creds; /* not owned; NULL: plaintext */
  const char *method;              /* "/inference.GRPCInferenceService/ModelInfer" */
  bool stream;                     /* method is ModelStreamInfer: one stream per in-flight slot carries
                                      its requests in turn (errors come as error_message) */
  const load_message *messages;    /* n_messages >= 1; not owned */
  size_t n_messages;
  unsigned seed;        /* the draws of messages and of Poisson gaps */
  int channels;         /* >= 1; one client thread each */
  int concurrency;      /* calls in flight at most, all channels together (>= channels) */
  double rate;          /* > 0: open loop, calls started per second; 0: closed loop */
  bool poisson;         /* open loop: exponential gaps instead of constant ones */
  double warmup_s;      /* calls started (requests) or completed (windows) earlier are not measured */
  long warmup_requests; /* ... nor the first this many calls */
  long requests;        /* > 0: measure exactly this many calls (one window) ... */
  double window_s;      /* ... else windows of this length */
  int max_windows;      /* >= 1 */
  double stability;     /* > 0: stop once stable (a fraction: 0.1 = 10 %); 0: run max_windows */
  int timeout_ms;       /* each call's deadline (stream: the whole stream's); 0 = none */
  void (*on_window)(const load_window *w, int index, void *arg); /* NULL, or told of each window */
  void *on_window_arg;
} load_config;

/* Counts of measured calls. */
typedef struct load_counts {
  size_t n_calls;                      /* all statuses */
  size_t n_ok;                         /* == by_status[0] */
  size_t by_status[LOAD_STATUS_CODES]; /* by gRPC status */
  uint64_t tokens_ok;                  /* the tokens of the OK calls */
  uint64_t bytes_sent, bytes_received; /* request and response messages */
  size_t late;                         /* open loop: calls started > 1 ms late (cap, busy client) */
} load_counts;

struct load_window {
  load_counts c;
  double elapsed_s;      /* the window's length */
  double requests_per_s; /* OK calls per second */
  double p99_s;          /* of the window's OK calls; 0 without any */
};

typedef struct load_result {
  load_counts c;        /* the sums over the windows */
  double *latency_s;    /* the OK calls', sorted ascending (c.n_ok of them) */
  double elapsed_s;     /* the windows' total (requests: first measured start to last completion) */
  load_window *windows; /* n_windows */
  int n_windows;
  bool stable;              /* windows: the last LOAD_STABLE_WINDOWS agreed */
  size_t all_calls, all_ok; /* every call of the run, warm-up and the calls after the last window
                               included: what the server saw */
  char first_error[256];    /* the first failed measured call's status details */
} load_result;

/* 0, or -1 when a thread or buffer could not be had (said on stderr). The
 * caller frees out with load_result_free. */
int load_run(const load_config *cfg, load_result *out);
void load_result_free(load_result *r);
/* The p-quantile (0..1) of sorted[0..n) by nearest rank; 0 when n is 0. */
double load_quantile(const double *sorted, size_t n, double p);
/* The same over a run's OK latencies. */
double load_percentile(const load_result *r, double p);
/* "OK", "NOT_FOUND", ... */
const char *load_status_name(grpc_status_code c);

#endif
