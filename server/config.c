/* config: command-line flags (getopt_long), with MOED_* environment
 * variables as defaults for the ones Kubernetes users set. Flags win. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "moed.h"

static const char usage[] =
    "usage: moed [options]\n"
    "  --address ADDR            bind address, IPv4 or IPv6 (::1 or [::1]) (MOED_ADDRESS, default 0.0.0.0)\n"
    "  --grpc-port N             gRPC port (MOED_GRPC_PORT, default 8001; 0 = any free)\n"
    "  --http-port N             metrics/health HTTP port (MOED_HTTP_PORT, default 8002; -1 = off)\n"
    "  --rest-port N             KServe v2 REST API port (MOED_REST_PORT, default 8000; 0 = any free,\n"
    "                            -1 = off)\n"
    "  --model-repository DIR    expert sets, one per subdirectory (MOED_MODEL_REPOSITORY)\n"
    "  --device auto|cpu|gpu     backends: gpu = one worker per GPU (ops without a GPU kernel run on the\n"
    "                            CPU), cpu = CPU only, auto = gpu when one is present (MOED_DEVICE)\n"
    "  --workers N               device workers on the CPU backend (MOED_WORKERS, default 2)\n"
    "  --threads-per-worker N    CPU threads per worker (MOED_THREADS_PER_WORKER, 0 = cores/workers)\n"
    "  --max-message-bytes N     gRPC send/receive limit (MOED_MAX_MESSAGE_BYTES, default 1 GiB)\n"
    "  --max-tensor-bytes N      per input tensor (default 1 GiB)\n"
    "  --max-tokens N            rows per request (default 1048576)\n"
    "  --max-inflight N          admitted requests, beyond: UNAVAILABLE (MOED_MAX_INFLIGHT, default 1024)\n"
    "  --max-open-calls N        gRPC calls open at once (streams included), beyond: RESOURCE_EXHAUSTED\n"
    "                            at once (MOED_MAX_OPEN_CALLS, default 4096)\n"
    "  --max-queue-size N        queued jobs per device queue (default 1024)\n"
    "  --request-slots N         armed accepts per method (default 16)\n"
    "  --drain-timeout SECONDS   SIGTERM: wait for in-flight work (MOED_DRAIN_TIMEOUT, default 30)\n"
    "  --cache-bytes N           inline fused_moe weight cache on the device (MOED_CACHE_BYTES, default 1 "
    "GiB; 0 = off)\n"
    "  --cache-host              use that cache on host backends too (they read request bytes in place)\n"
    "  --max-batch-tokens N      rows merged into one call for row-independent ops (MOED_MAX_BATCH_TOKENS,\n"
    "                            default 4096; 0 = no batching)\n"
    "  --max-queue-delay-us N    longest wait for a batch to fill (MOED_MAX_QUEUE_DELAY_US, default 0 =\n"
    "                            merge what arrives together; rounded up to ms)\n"
    "  --max-upload-bytes N      tensor bytes per ExpertStore upload (default 64 GiB)\n"
    "  --inline-bytes N          unbatched ModelInfer messages up to N bytes run on the gRPC thread\n"
    "                            (CPU backend; MOED_INLINE_BYTES, default 65536; 0 = always hand off)\n"
    "  --handshake-timeout SEC   a connection that has not sent its gRPC handshake (HTTP: its whole\n"
    "                            request) within SEC is closed (MOED_HANDSHAKE_TIMEOUT, default 10)\n"
    "  --http-body-min-rate N    an HTTP request body slower than N bytes/s on average, past a first\n"
    "                            --handshake-timeout, is cut off (MOED_HTTP_BODY_MIN_RATE, default\n"
    "                            65536; 0 = only the pause between reads is bounded)\n"
    "  --idle-timeout SEC        a gRPC connection without calls for SEC is closed, an upload without a\n"
    "                            message ended; keepalive pings find dead peers (MOED_IDLE_TIMEOUT,\n"
    "                            default 300)\n"
    "  --max-connection-age SEC  a gRPC connection older than SEC gets GOAWAY (clients reconnect for new\n"
    "                            calls; MOED_MAX_CONNECTION_AGE, default 0 = never)\n"
    "  --max-connection-age-grace SEC  its calls then have SEC to finish before it is closed (default 30)\n"
    "  --stream-buffer-bytes N   responses a stream's client has not read yet; beyond, the stream's next\n"
    "                            request waits (default 64 MiB)\n"
    "  --response-buffer-bytes N the same over every stream: beyond, streams holding some pause too,\n"
    "                            and one holding its stream budget is ended with RESOURCE_EXHAUSTED\n"
    "                            (default 2 GiB)\n"
    "  --http-max-connections N  open HTTP connections; beyond: closed at accept (default 256)\n"
    "  --fd-reserve N            descriptors kept free of connections: a connection accepted into the\n"
    "                            last N below the open-file limit is closed at once (MOED_FD_RESERVE,\n"
    "                            default 64; at most a quarter of the limit)\n"
    "  --tls-cert FILE           PEM certificate chain: the gRPC, REST and metrics ports speak TLS\n"
    "                            (MOED_TLS_CERT; reread with the key and client CA on SIGHUP, for new\n"
    "                            connections)\n"
    "  --http-port-plaintext     the metrics/health port (--http-port) stays plaintext under --tls-cert\n"
    "                            (MOED_HTTP_PORT_PLAINTEXT)\n"
    "  --tls-key FILE            its PEM private key (MOED_TLS_KEY)\n"
    "  --tls-client-ca FILE      PEM CA bundle client certificates are verified against "
    "(MOED_TLS_CLIENT_CA)\n"
    "  --tls-client-auth MODE    none|optional|require: a client certificate not asked for, verified when\n"
    "                            sent, required (MOED_TLS_CLIENT_AUTH; default require with "
    "--tls-client-ca)\n"
    "  --auth-tokens FILE        bearer tokens, one \"NAME ROLE TOKEN\" a line (ROLE infer|admin): every "
    "gRPC\n"
    "                            call needs 'authorization: Bearer TOKEN'; admin for repository changes\n"
    "                            and uploads (MOED_AUTH_TOKENS; reread on SIGHUP)\n"
    "  --auth-health-exempt      ServerLive/ServerReady/ModelReady/grpc.health.v1 and the HTTP port's\n"
    "                            /v2/health/* need no token (MOED_AUTH_HEALTH_EXEMPT=1)\n"
    "  --auth-metrics-exempt     the HTTP port's /metrics needs no token (MOED_AUTH_METRICS_EXEMPT=1)\n"
    "  --max-uploads N           uploads in progress at once; more: RESOURCE_EXHAUSTED (MOED_MAX_UPLOADS, "
    "4)\n"
    "  --upload-budget-bytes N   tensor bytes of all uploads in progress together "
    "(MOED_UPLOAD_BUDGET_BYTES,\n"
    "                            default 64 GiB)\n"
    "  --http-body-budget-bytes N  request body bytes held by all HTTP connections together; a body that\n"
    "                            would pass it: 503, connection closed (MOED_HTTP_BODY_BUDGET_BYTES,\n"
    "                            default 2 GiB)\n"
    "  --grpc-body-budget-bytes N  gRPC request message bytes held by all calls together until each\n"
    "                            request is answered; a message that would pass it: RESOURCE_EXHAUSTED\n"
    "                            (MOED_GRPC_BODY_BUDGET_BYTES, default 2 GiB)\n"
    "  --grpc-memory-bytes N     memory gRPC core may hold for all connections together (messages being\n"
    "                            received included); near it, its streams are reset and reads slow\n"
    "                            (MOED_GRPC_MEMORY_BYTES, default --grpc-body-budget-bytes + 1 GiB)\n"
    "  --shm-max-regions N      system shared-memory regions registered at once (MOED_SHM_MAX_REGIONS,\n"
    "                            default 64; 0 = the extension off)\n"
    "  --log-level LEVEL         error|warn|info|debug (MOED_LOG_LEVEL, default info)\n"
    "  --log-json                JSON log lines (MOED_LOG_JSON=1)\n"
    "  --port-file PATH          write \"GRPC_PORT HTTP_PORT REST_PORT\" once listening (tests; -1: off)\n"
    "  --help                    this text\n"
    "Triton's spellings, for deployments written for tritonserver (but Triton's --http-port is its REST\n"
    "port, moed's --rest-port; its --metrics-port is moed's --http-port):\n"
    "  --grpc-address ADDR       = --address (the gRPC port's; the HTTP port's too unless --http-address)\n"
    "  --http-address ADDR       the HTTP ports' (REST and metrics) bind address\n"
    "  --allow-http true|false   false: no HTTP port (= --http-port -1 --rest-port -1)\n"
    "  --allow-gpu-metrics B     false: no nv_gpu_* metrics on /metrics (default true: read from NVML where\n"
    "                            the NVIDIA driver is installed, one sample per GPU worker)\n"
    "  --exit-timeout-secs N     = --drain-timeout\n"
    "  --log-verbose N           N > 0: --log-level debug, 0: info\n"
    "  --strict-model-config B   accepted; moed derives every model's configuration itself\n"
    "  --model-control-mode M    moed (default): every set loaded at start, RepositoryModelLoad/Unload and\n"
    "                            uploads allowed; none: every set loaded, those refused; explicit: only the\n"
    "                            --load-model sets loaded at start, changes allowed; poll: every set\n"
    "                            loaded, then the directory followed (new, changed, removed sets), RPC\n"
    "                            changes refused\n"
    "  --repository-poll-secs N  poll: seconds between scans of the repository (default 15; refused\n"
    "                            without --model-control-mode poll)\n"
    "  --load-model NAME         with explicit: a set to load at start (repeatable; * = every set)\n";

enum {
  OPT_ADDRESS = 256,
  OPT_GRPC_PORT,
  OPT_HTTP_PORT,
  OPT_REPO,
  OPT_WORKERS,
  OPT_TPW,
  OPT_MAX_MSG,
  OPT_MAX_TENSOR,
  OPT_MAX_TOKENS,
  OPT_MAX_INFLIGHT,
  OPT_MAX_OPEN_CALLS,
  OPT_MAX_QUEUE,
  OPT_SLOTS,
  OPT_DRAIN,
  OPT_CACHE,
  OPT_LOG_LEVEL,
  OPT_LOG_JSON,
  OPT_PORT_FILE,
  OPT_HELP,
  OPT_CACHE_HOST,
  OPT_BATCH_TOKENS,
  OPT_QUEUE_DELAY,
  OPT_MAX_UPLOAD,
  OPT_INLINE,
  OPT_DEVICE,
  OPT_HTTP_ADDRESS,
  OPT_ALLOW_HTTP,
  OPT_LOG_VERBOSE,
  OPT_STRICT_CONFIG,
  OPT_CONTROL_MODE,
  OPT_LOAD_MODEL,
  OPT_POLL_SECS,
  OPT_HANDSHAKE,
  OPT_BODY_RATE,
  OPT_IDLE,
  OPT_HTTP_CONNS,
  OPT_STREAM_BUF,
  OPT_RESPONSE_BUF,
  OPT_FD_RESERVE,
  OPT_CONN_AGE,
  OPT_CONN_AGE_GRACE,
  OPT_REST_PORT,
  OPT_TLS_CERT,
  OPT_TLS_KEY,
  OPT_TLS_CLIENT_CA,
  OPT_TLS_CLIENT_AUTH,
  OPT_HTTP_PLAINTEXT,
  OPT_AUTH_TOKENS,
  OPT_AUTH_HEALTH_EXEMPT,
  OPT_AUTH_METRICS_EXEMPT,
  OPT_MAX_UPLOADS,
  OPT_UPLOAD_BUDGET,
  OPT_HTTP_BODY_BUDGET,
  OPT_GRPC_BODY_BUDGET,
  OPT_GRPC_MEMORY,
  OPT_ALLOW_GPU_METRICS,
  OPT_SHM_MAX_REGIONS,
};

static const struct option options[] = {
    {"address", required_argument, NULL, OPT_ADDRESS},
    {"grpc-port", required_argument, NULL, OPT_GRPC_PORT},
    {"http-port", required_argument, NULL, OPT_HTTP_PORT},
    {"rest-port", required_argument, NULL, OPT_REST_PORT},
    {"model-repository", required_argument, NULL, OPT_REPO},
    {"workers", required_argument, NULL, OPT_WORKERS},
    {"threads-per-worker", required_argument, NULL, OPT_TPW},
    {"max-message-bytes", required_argument, NULL, OPT_MAX_MSG},
    {"max-tensor-bytes", required_argument, NULL, OPT_MAX_TENSOR},
    {"max-tokens", required_argument, NULL, OPT_MAX_TOKENS},
    {"max-inflight", required_argument, NULL, OPT_MAX_INFLIGHT},
    {"max-open-calls", required_argument, NULL, OPT_MAX_OPEN_CALLS},
    {"max-queue-size", required_argument, NULL, OPT_MAX_QUEUE},
    {"request-slots", required_argument, NULL, OPT_SLOTS},
    {"drain-timeout", required_argument, NULL, OPT_DRAIN},
    {"cache-bytes", required_argument, NULL, OPT_CACHE},
    {"log-level", required_argument, NULL, OPT_LOG_LEVEL},
    {"log-json", no_argument, NULL, OPT_LOG_JSON},
    {"port-file", required_argument, NULL, OPT_PORT_FILE},
    {"cache-host", no_argument, NULL, OPT_CACHE_HOST},
    {"max-batch-tokens", required_argument, NULL, OPT_BATCH_TOKENS},
    {"max-queue-delay-us", required_argument, NULL, OPT_QUEUE_DELAY},
    {"max-upload-bytes", required_argument, NULL, OPT_MAX_UPLOAD},
    {"inline-bytes", required_argument, NULL, OPT_INLINE},
    {"device", required_argument, NULL, OPT_DEVICE},
    {"handshake-timeout", required_argument, NULL, OPT_HANDSHAKE},
    {"http-body-min-rate", required_argument, NULL, OPT_BODY_RATE},
    {"idle-timeout", required_argument, NULL, OPT_IDLE},
    {"http-max-connections", required_argument, NULL, OPT_HTTP_CONNS},
    {"stream-buffer-bytes", required_argument, NULL, OPT_STREAM_BUF},
    {"response-buffer-bytes", required_argument, NULL, OPT_RESPONSE_BUF},
    {"fd-reserve", required_argument, NULL, OPT_FD_RESERVE},
    {"max-connection-age", required_argument, NULL, OPT_CONN_AGE},
    {"max-connection-age-grace", required_argument, NULL, OPT_CONN_AGE_GRACE},
    {"tls-cert", required_argument, NULL, OPT_TLS_CERT},
    {"tls-key", required_argument, NULL, OPT_TLS_KEY},
    {"tls-client-ca", required_argument, NULL, OPT_TLS_CLIENT_CA},
    {"tls-client-auth", required_argument, NULL, OPT_TLS_CLIENT_AUTH},
    {"http-port-plaintext", no_argument, NULL, OPT_HTTP_PLAINTEXT},
    {"auth-tokens", required_argument, NULL, OPT_AUTH_TOKENS},
    {"auth-health-exempt", no_argument, NULL, OPT_AUTH_HEALTH_EXEMPT},
    {"auth-metrics-exempt", no_argument, NULL, OPT_AUTH_METRICS_EXEMPT},
    {"max-uploads", required_argument, NULL, OPT_MAX_UPLOADS},
    {"upload-budget-bytes", required_argument, NULL, OPT_UPLOAD_BUDGET},
    {"http-body-budget-bytes", required_argument, NULL, OPT_HTTP_BODY_BUDGET},
    {"grpc-body-budget-bytes", required_argument, NULL, OPT_GRPC_BODY_BUDGET},
    {"grpc-memory-bytes", required_argument, NULL, OPT_GRPC_MEMORY},
    {"shm-max-regions", required_argument, NULL, OPT_SHM_MAX_REGIONS},
    {"help", no_argument, NULL, OPT_HELP},
    /* Triton's spellings (usage) */
    {"grpc-address", required_argument, NULL, OPT_ADDRESS},
    {"http-address", required_argument, NULL, OPT_HTTP_ADDRESS},
    {"allow-http", required_argument, NULL, OPT_ALLOW_HTTP},
    {"allow-gpu-metrics", required_argument, NULL, OPT_ALLOW_GPU_METRICS},
    {"exit-timeout-secs", required_argument, NULL, OPT_DRAIN},
    {"log-verbose", required_argument, NULL, OPT_LOG_VERBOSE},
    {"strict-model-config", required_argument, NULL, OPT_STRICT_CONFIG},
    {"model-control-mode", required_argument, NULL, OPT_CONTROL_MODE},
    {"load-model", required_argument, NULL, OPT_LOAD_MODEL},
    {"repository-poll-secs", required_argument, NULL, OPT_POLL_SECS},
    {NULL, 0, NULL, 0},
};

static bool parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return false;
  *out = v;
  return true;
}

static bool parse_bool(const char *s, bool *out) {
  if (!strcmp(s, "true") || !strcmp(s, "1")) return *out = true, true;
  if (!strcmp(s, "false") || !strcmp(s, "0")) return *out = false, true;
  return false;
}

static bool parse_level(const char *s, int *out) {
  static const char *const names[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; i++)
    if (strcmp(s, names[i]) == 0) {
      *out = i;
      return true;
    }
  return false;
}

/* An IPv4 or IPv6 literal, the latter with or without brackets ("::1",
 * "[::1]"); stored bare in buf, which the config then points at (rpc.c
 * adds the brackets gRPC's "host:port" needs). Host names are refused: the
 * HTTP port binds through uv_ip*_addr, which takes literals only. */
static bool parse_host(const char *v, char *buf, size_t size, const char **out) {
  size_t n = strlen(v);
  if (n >= 2 && v[0] == '[' && v[n - 1] == ']') {
    v++;
    n -= 2;
  }
  if (n == 0 || n >= size) return false;
  memcpy(buf, v, n);
  buf[n] = 0;
  struct sockaddr_in a4;
  struct sockaddr_in6 a6;
  if (uv_ip4_addr(buf, 0, &a4) != 0 && (!strchr(buf, ':') || uv_ip6_addr(buf, 0, &a6) != 0)) return false;
  *out = buf;
  return true;
}

/* Applies one option's value; false with a message when it does not parse. */
/* Triton's flags that moed spells otherwise: a tritonserver command line
 * that names one is refused (it could not mean the same), with moed's own
 * spelling. Triton's --http-port is its REST port; moed's --http-port is
 * the metrics and health port, as Triton's --metrics-port. */
static void triton_hint(const char *arg) {
  static const struct {
    const char *flag, *hint;
  } hints[] = {
      {"--metrics-port", "Triton's --metrics-port is moed's --http-port (metrics and health probes; moed's "
                         "REST port, Triton's --http-port, is --rest-port)"},
      {"--allow-metrics", "moed's metrics port is off with --http-port -1"},
      {"--allow-grpc", "moed always serves gRPC"},
      {"--model-store", "Triton's --model-store is --model-repository"},
  };
  if (!arg) return;
  const size_t n = strcspn(arg, "=");
  for (size_t i = 0; i < sizeof hints / sizeof hints[0]; i++)
    if (strlen(hints[i].flag) == n && !strncmp(arg, hints[i].flag, n))
      fprintf(stderr, "moed: %s\n", hints[i].hint);
}

static bool apply(moed_config *c, int opt, const char *v, const char *src) {
  int64_t n = 0;
  bool ok = true;
  switch (opt) {
  case OPT_ADDRESS: ok = parse_host(v, c->address_buf[0], sizeof c->address_buf[0], &c->address); break;
  case OPT_HTTP_ADDRESS:
    ok = parse_host(v, c->address_buf[1], sizeof c->address_buf[1], &c->http_address);
    break;
  case OPT_ALLOW_HTTP: {
    bool allow = true;
    ok = parse_bool(v, &allow);
    c->http_off = ok && !allow;
    break;
  }
  case OPT_ALLOW_GPU_METRICS: {
    bool allow = true;
    ok = parse_bool(v, &allow);
    c->gpu_metrics_off = ok && !allow;
    break;
  }
  case OPT_LOG_VERBOSE:
    ok = parse_i64(v, 0, INT32_MAX, &n) && (c->log_level = n > 0 ? MOED_LOG_DEBUG : MOED_LOG_INFO, true);
    break;
  case OPT_CONTROL_MODE: {
    static const char *const modes[] = {"moed", "none", "explicit", "poll"}; /* MOED_CONTROL_* order */
    ok = false;
    for (int i = 0; i < (int)(sizeof modes / sizeof modes[0]) && !ok; i++)
      if ((ok = !strcmp(v, modes[i]))) c->model_control = i;
    break;
  }
  case OPT_POLL_SECS: ok = parse_i64(v, 1, 86400, &n) && (c->repository_poll_secs = (int)n, true); break;
  case OPT_LOAD_MODEL:
    ok = c->n_load_models < (int)(sizeof c->load_models / sizeof c->load_models[0]) &&
         (!strcmp(v, "*") || moed_model_name_ok(v));
    if (ok) c->load_models[c->n_load_models++] = v;
    break;
  case OPT_STRICT_CONFIG: {
    bool strict; /* checked, then unused: every configuration is moed's own */
    ok = parse_bool(v, &strict);
    (void)strict;
    break;
  }
  case OPT_DEVICE:
    ok = !strcmp(v, "auto") || !strcmp(v, "cpu") || !strcmp(v, "gpu");
    if (ok) c->device = v;
    break;
  case OPT_GRPC_PORT: ok = parse_i64(v, 0, 65535, &n) && (c->grpc_port = (int)n, true); break;
  case OPT_HTTP_PORT: ok = parse_i64(v, -1, 65535, &n) && (c->http_port = (int)n, true); break;
  case OPT_REST_PORT: ok = parse_i64(v, -1, 65535, &n) && (c->rest_port = (int)n, true); break;
  case OPT_REPO: c->model_repository = v; break;
  case OPT_WORKERS: ok = parse_i64(v, 1, 1024, &n) && (c->workers = (int)n, true); break;
  case OPT_TPW: ok = parse_i64(v, 0, 4096, &n) && (c->threads_per_worker = (int)n, true); break;
  case OPT_MAX_MSG: ok = parse_i64(v, 1024, INT32_MAX, &n) && (c->max_message_bytes = (size_t)n, true); break;
  case OPT_MAX_TENSOR: ok = parse_i64(v, 1, INT64_MAX, &n) && (c->max_tensor_bytes = (size_t)n, true); break;
  case OPT_MAX_TOKENS: ok = parse_i64(v, 1, INT64_MAX, &n) && (c->max_tokens = n, true); break;
  case OPT_MAX_INFLIGHT: ok = parse_i64(v, 1, 1 << 24, &n) && (c->max_inflight = (int)n, true); break;
  case OPT_MAX_OPEN_CALLS: ok = parse_i64(v, 1, 1 << 24, &n) && (c->max_open_calls = (int)n, true); break;
  case OPT_MAX_QUEUE: ok = parse_i64(v, 1, 1 << 24, &n) && (c->max_queue_size = (int)n, true); break;
  case OPT_SLOTS: ok = parse_i64(v, 1, 4096, &n) && (c->request_slots = (int)n, true); break;
  case OPT_DRAIN: {
    char *end;
    double d = strtod(v, &end);
    ok = end != v && !*end && d >= 0 && d < 86400;
    if (ok) c->drain_timeout_s = d;
    break;
  }
  case OPT_CACHE: ok = parse_i64(v, 0, INT64_MAX, &n) && (c->cache_bytes = (size_t)n, true); break;
  case OPT_LOG_LEVEL: ok = parse_level(v, &c->log_level); break;
  case OPT_LOG_JSON: c->log_json = !v || strcmp(v, "0") != 0; break;
  case OPT_PORT_FILE: c->port_file = v; break;
  case OPT_CACHE_HOST: c->cache_host = true; break;
  case OPT_BATCH_TOKENS: ok = parse_i64(v, 0, INT32_MAX, &n) && (c->max_batch_tokens = n, true); break;
  case OPT_QUEUE_DELAY:
    /* the batcher's timer is libuv's, in whole milliseconds: the delay kept
     * (and reported in ModelConfig's dynamic_batching) is the one it waits */
    ok = parse_i64(v, 0, 60000000, &n) && (c->max_queue_delay_us = (n + 999) / 1000 * 1000, true);
    break;
  case OPT_INLINE: ok = parse_i64(v, 0, 1 << 30, &n) && (c->inline_bytes = (size_t)n, true); break;
  case OPT_HANDSHAKE: ok = parse_i64(v, 1, 3600, &n) && (c->handshake_timeout_s = (int)n, true); break;
  case OPT_BODY_RATE:
    ok = parse_i64(v, 0, INT32_MAX, &n) && (c->http_body_min_rate = (uint64_t)n, true);
    break;
  case OPT_IDLE: ok = parse_i64(v, 1, 86400 * 7, &n) && (c->idle_timeout_s = (int)n, true); break;
  case OPT_CONN_AGE:
    ok = parse_i64(v, 0, INT32_MAX / 1000, &n) && (c->max_connection_age_s = (int)n, true);
    break;
  case OPT_CONN_AGE_GRACE:
    ok = parse_i64(v, 0, 86400 * 7, &n) && (c->connection_age_grace_s = (int)n, true);
    break;
  case OPT_FD_RESERVE: ok = parse_i64(v, 0, 1 << 20, &n) && (c->fd_reserve = (int)n, true); break;
  case OPT_HTTP_CONNS: ok = parse_i64(v, 1, 1 << 20, &n) && (c->http_max_connections = (int)n, true); break;
  case OPT_STREAM_BUF:
    ok = parse_i64(v, 1, INT64_MAX, &n) && (c->stream_buffer_bytes = (size_t)n, true);
    break;
  case OPT_RESPONSE_BUF:
    ok = parse_i64(v, 1, INT64_MAX, &n) && (c->response_buffer_bytes = (size_t)n, true);
    break;
  case OPT_TLS_CERT: c->tls_cert = v; break;
  case OPT_TLS_KEY: c->tls_key = v; break;
  case OPT_TLS_CLIENT_CA: c->tls_client_ca = v; break;
  case OPT_TLS_CLIENT_AUTH:
    ok = !strcmp(v, "none") || !strcmp(v, "optional") || !strcmp(v, "require");
    c->tls_client_auth = !strcmp(v, "optional")  ? MOED_CLIENT_AUTH_OPTIONAL
                         : !strcmp(v, "require") ? MOED_CLIENT_AUTH_REQUIRE
                                                 : MOED_CLIENT_AUTH_NONE;
    break;
  case OPT_AUTH_TOKENS: c->auth_tokens = v; break;
  case OPT_AUTH_HEALTH_EXEMPT: c->auth_health_exempt = !v || strcmp(v, "0") != 0; break;
  case OPT_AUTH_METRICS_EXEMPT: c->auth_metrics_exempt = !v || strcmp(v, "0") != 0; break;
  case OPT_HTTP_PLAINTEXT: c->http_port_plaintext = !v || strcmp(v, "0") != 0; break;
  case OPT_MAX_UPLOADS: ok = parse_i64(v, 1, 1 << 16, &n) && (c->max_uploads = (int)n, true); break;
  case OPT_SHM_MAX_REGIONS: ok = parse_i64(v, 0, 1 << 16, &n) && (c->shm_max_regions = (int)n, true); break;
  case OPT_UPLOAD_BUDGET:
    ok = parse_i64(v, 1, INT64_MAX, &n) && (c->upload_budget_bytes = (size_t)n, true);
    break;
  case OPT_HTTP_BODY_BUDGET:
    ok = parse_i64(v, 1, INT64_MAX, &n) && (c->http_body_budget_bytes = (size_t)n, true);
    break;
  case OPT_GRPC_MEMORY:
    ok = parse_i64(v, 1 << 20, INT64_MAX, &n) && (c->grpc_memory_bytes = (size_t)n, true);
    break;
  case OPT_GRPC_BODY_BUDGET:
    ok = parse_i64(v, 1, INT64_MAX, &n) && (c->grpc_body_budget_bytes = (size_t)n, true);
    break;
  case OPT_MAX_UPLOAD: ok = parse_i64(v, 1, INT64_MAX, &n) && (c->max_upload_bytes = (size_t)n, true); break;
  }
  if (!ok && (opt == OPT_ADDRESS || opt == OPT_HTTP_ADDRESS))
    fprintf(stderr, "moed: bad value '%s' for %s: not an IPv4 or IPv6 address (IPv6 with or without [])\n", v,
            src);
  else if (!ok)
    fprintf(stderr, "moed: bad value '%s' for %s\n", v, src);
  return ok;
}

static const struct {
  const char *env;
  int opt;
} env_map[] = {
    {"MOED_ADDRESS", OPT_ADDRESS},
    {"MOED_GRPC_PORT", OPT_GRPC_PORT},
    {"MOED_HTTP_PORT", OPT_HTTP_PORT},
    {"MOED_REST_PORT", OPT_REST_PORT},
    {"MOED_MODEL_REPOSITORY", OPT_REPO},
    {"MOED_WORKERS", OPT_WORKERS},
    {"MOED_THREADS_PER_WORKER", OPT_TPW},
    {"MOED_MAX_MESSAGE_BYTES", OPT_MAX_MSG},
    {"MOED_MAX_INFLIGHT", OPT_MAX_INFLIGHT},
    {"MOED_MAX_OPEN_CALLS", OPT_MAX_OPEN_CALLS},
    {"MOED_DRAIN_TIMEOUT", OPT_DRAIN},
    {"MOED_LOG_LEVEL", OPT_LOG_LEVEL},
    {"MOED_LOG_JSON", OPT_LOG_JSON},
    {"MOED_CACHE_BYTES", OPT_CACHE},
    {"MOED_INLINE_BYTES", OPT_INLINE},
    {"MOED_DEVICE", OPT_DEVICE},
    {"MOED_MAX_BATCH_TOKENS", OPT_BATCH_TOKENS},
    {"MOED_MAX_QUEUE_DELAY_US", OPT_QUEUE_DELAY},
    {"MOED_HANDSHAKE_TIMEOUT", OPT_HANDSHAKE},
    {"MOED_HTTP_BODY_MIN_RATE", OPT_BODY_RATE},
    {"MOED_IDLE_TIMEOUT", OPT_IDLE},
    {"MOED_FD_RESERVE", OPT_FD_RESERVE},
    {"MOED_MAX_CONNECTION_AGE", OPT_CONN_AGE},
    {"MOED_TLS_CERT", OPT_TLS_CERT},
    {"MOED_TLS_KEY", OPT_TLS_KEY},
    {"MOED_TLS_CLIENT_CA", OPT_TLS_CLIENT_CA},
    {"MOED_TLS_CLIENT_AUTH", OPT_TLS_CLIENT_AUTH},
    {"MOED_HTTP_PORT_PLAINTEXT", OPT_HTTP_PLAINTEXT},
    {"MOED_AUTH_TOKENS", OPT_AUTH_TOKENS},
    {"MOED_AUTH_HEALTH_EXEMPT", OPT_AUTH_HEALTH_EXEMPT},
    {"MOED_AUTH_METRICS_EXEMPT", OPT_AUTH_METRICS_EXEMPT},
    {"MOED_MAX_UPLOADS", OPT_MAX_UPLOADS},
    {"MOED_UPLOAD_BUDGET_BYTES", OPT_UPLOAD_BUDGET},
    {"MOED_HTTP_BODY_BUDGET_BYTES", OPT_HTTP_BODY_BUDGET},
    {"MOED_GRPC_BODY_BUDGET_BYTES", OPT_GRPC_BODY_BUDGET},
    {"MOED_GRPC_MEMORY_BYTES", OPT_GRPC_MEMORY},
    {"MOED_SHM_MAX_REGIONS", OPT_SHM_MAX_REGIONS},
};

int moed_config_parse(moed_config *c, int argc, char **argv) {
  *c = (moed_config){
      .address = "0.0.0.0",
      .device = "auto",
      .grpc_port = 8001,
      .http_port = 8002,
      .rest_port = 8000,
      .workers = 2,
      .max_message_bytes = (size_t)1 << 30,
      .max_tensor_bytes = (size_t)1 << 30,
      .max_tokens = 1 << 20,
      .max_inflight = 1024,
      .max_open_calls = 4096,
      .request_slots = 16,
      .max_queue_size = 1024,
      .drain_timeout_s = 30,
      .log_level = MOED_LOG_INFO,
      .cache_bytes = (size_t)1 << 30,
      .max_batch_tokens = 4096,
      .max_upload_bytes = (size_t)64 << 30,
      .inline_bytes = 65536,
      .handshake_timeout_s = 10,
      .http_body_min_rate = 65536,
      .idle_timeout_s = 300,
      .http_max_connections = 256,
      .fd_reserve = 64,
      .connection_age_grace_s = 30,
      .repository_poll_secs = 0, /* 0: not given; poll mode's default is set after parsing */
      .stream_buffer_bytes = (size_t)64 << 20,
      .response_buffer_bytes = (size_t)2 << 30,
      .tls_client_auth = -1, /* require when a client CA is given */
      .max_uploads = 4,
      .upload_budget_bytes = (size_t)64 << 30,
      .http_body_budget_bytes = (size_t)2 << 30,
      .grpc_body_budget_bytes = (size_t)2 << 30,
      .shm_max_regions = 64,
  };
  for (size_t i = 0; i < sizeof env_map / sizeof env_map[0]; i++) {
    const char *v = getenv(env_map[i].env);
    if (v && *v && !apply(c, env_map[i].opt, v, env_map[i].env)) return -1;
  }
  optind = 1;
  int opt, li = -1;
  while ((opt = getopt_long(argc, argv, "h", options, &li)) != -1) {
    if (opt == OPT_HELP || opt == 'h') {
      fputs(usage, stdout);
      return 1;
    }
    if (opt == '?') { /* getopt_long named the flag; the usage would bury that line */
      triton_hint(argv[optind - 1]);
      fputs("moed: moed --help lists every flag\n", stderr);
      return -1;
    }
    /* the flag's own name: argv[optind - 1] is the value for "--flag value" */
    char flag[64];
    snprintf(flag, sizeof flag, "--%s", li >= 0 ? options[li].name : "?");
    li = -1;
    if (!apply(c, opt, optarg, flag)) return -1;
  }
  if (optind < argc) {
    fprintf(stderr, "moed: unexpected argument '%s'\n", argv[optind]);
    return -1;
  }
  if (c->http_off) c->http_port = c->rest_port = -1;
  if (c->tls_client_auth < 0)
    c->tls_client_auth = c->tls_client_ca ? MOED_CLIENT_AUTH_REQUIRE : MOED_CLIENT_AUTH_NONE;
  const char *tls_why = !c->tls_cert != !c->tls_key        ? "--tls-cert and --tls-key go together"
                        : c->tls_client_ca && !c->tls_cert ? "--tls-client-ca needs --tls-cert and --tls-key"
                        : c->tls_client_auth != MOED_CLIENT_AUTH_NONE && !c->tls_client_ca
                            ? "--tls-client-auth optional|require needs --tls-client-ca"
                            : NULL;
  if (tls_why) {
    fprintf(stderr, "moed: %s\n", tls_why);
    return -1;
  }
  if (c->n_load_models && c->model_control != MOED_CONTROL_EXPLICIT) {
    fprintf(stderr, "moed: --load-model needs --model-control-mode explicit\n");
    return -1;
  }
  if (c->model_control == MOED_CONTROL_POLL && !c->model_repository) {
    fprintf(stderr, "moed: --model-control-mode poll needs --model-repository\n");
    return -1;
  }
  /* an interval without polling would be a silent no-op: the operator meant
   * poll mode, or has a stale flag (Triton ignores it; refusing says which) */
  if (c->repository_poll_secs && c->model_control != MOED_CONTROL_POLL) {
    fprintf(stderr, "moed: --repository-poll-secs needs --model-control-mode poll\n");
    return -1;
  }
  if (!c->repository_poll_secs) c->repository_poll_secs = 15;
  /* a repository that is not there is a deployment error, not an empty
   * server that reports ready (Triton refuses to start too) */
  if (c->model_repository) {
    struct stat st;
    const char *why = stat(c->model_repository, &st) != 0 ? strerror(errno)
                      : !S_ISDIR(st.st_mode)              ? "not a directory"
                                                          : NULL;
    if (why) {
      fprintf(stderr, "moed: --model-repository (MOED_MODEL_REPOSITORY) '%s': %s\n", c->model_repository,
              why);
      return -1;
    }
  }
  return 0;
}
