/* moed: the server's internal interfaces, one section per file.
 *
 * Threads: the gRPC completion-queue thread (rpc.c), the libuv loop thread
 * (main.c: timers, signals, HTTP, hand-offs), the device workers (devices.c).
 * Hand-offs between them are queues; the shared counters are atomics. */
#ifndef MOED_H
#define MOED_H

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "kserve_types.h"
#include "moe/backend.h"
#include "moe/expert_set.h"
#include "moe/ops.h"

#define MOED_VERSION "0.1.0"

/* ---- config.c ------------------------------------------------------------- */

typedef struct moed_config {
  const char *address;         /* bind address, "0.0.0.0" */
  const char *http_address;    /* the HTTP port's, when it differs (NULL: address) */
  char address_buf[2][64];     /* the two above as parsed: IPv6 without brackets */
  bool http_off;               /* --allow-http false: no HTTP port whatever --http-port says */
  bool gpu_metrics_off;        /* --allow-gpu-metrics false: no nv_gpu_* metrics (gpu_metrics.c) */
  int model_control;           /* MOED_CONTROL_*: what is loaded at start, whether RPCs may change it */
  int repository_poll_secs;    /* poll: seconds between scans of the repository directory */
  const char *load_models[64]; /* --load-model names (explicit control; "*": every set) */
  int n_load_models;
  int grpc_port;                /* 8001; 0 = pick a free one */
  int http_port;                /* 8002; 0 = pick, -1 = off */
  int rest_port;                /* the KServe REST API: 8000; 0 = pick, -1 = off */
  const char *model_repository; /* NULL: built-ins only */
  const char *device;           /* auto | cpu | gpu: which backends the workers own */
  int workers;                  /* CPU device workers (GPU: one per device) */
  int threads_per_worker;       /* CPU backend threads; 0 = cores / workers */
  size_t max_message_bytes;     /* gRPC send/receive limit */
  size_t max_tensor_bytes;      /* per input tensor */
  int64_t max_tokens;           /* rows of the first input per request */
  int max_inflight;             /* admitted requests; beyond: UNAVAILABLE */
  int max_open_calls;           /* gRPC calls open at once (streams included); beyond: RESOURCE_EXHAUSTED */
  int request_slots;            /* armed accept slots per method */
  int max_queue_size;           /* queued jobs per device queue */
  double drain_timeout_s;       /* SIGTERM: wait for in-flight work */
  int log_level;                /* 0 error, 1 warn, 2 info, 3 debug */
  bool log_json;
  const char *port_file;        /* write "grpc_port http_port" once bound (tests) */
  size_t cache_bytes;           /* inline-weight device cache; 0 = off */
  bool cache_host;              /* also cache on host backends (they read in place) */
  int64_t max_batch_tokens;     /* rows merged per batch; 0 = no batching */
  int64_t max_queue_delay_us;   /* longest wait for a batch to fill */
  size_t max_upload_bytes;      /* ExpertStore: tensor bytes per upload */
  size_t inline_bytes;          /* unbatched requests up to this size run on the CQ thread (host backends) */
  int handshake_timeout_s;      /* gRPC handshake / whole HTTP request, else the connection is closed */
  uint64_t http_body_min_rate;  /* bytes/s an HTTP body keeps on average past its first handshake_timeout_s */
  int idle_timeout_s;           /* gRPC connection without calls: closed */
  int max_connection_age_s;     /* gRPC connection older: GOAWAY (0 = none) */
  int connection_age_grace_s;   /* ... then closed this much later */
  int http_max_connections;     /* open HTTP connections; beyond: closed at accept */
  int fd_reserve;               /* descriptors kept from connections (fd_budget.c) */
  size_t stream_buffer_bytes;   /* unsent responses of one stream; beyond: its reads pause */
  size_t response_buffer_bytes; /* of all streams; beyond: a stream holding some is ended */
  const char *tls_cert;         /* PEM chain for the gRPC and HTTP ports (NULL: plaintext) */
  const char *tls_key;          /* its private key */
  const char *tls_client_ca;    /* CA bundle client certificates are verified against */
  int tls_client_auth;          /* MOED_CLIENT_AUTH_* */
  bool http_port_plaintext;     /* the metrics/health port stays plain under --tls-cert */
  const char *auth_tokens;      /* "NAME ROLE TOKEN" lines (auth.c); NULL: no authorization */
  bool auth_health_exempt;      /* health RPCs and the HTTP port's probes need no token */
  bool auth_metrics_exempt;     /* the HTTP port's /metrics needs no token */
  int max_uploads;              /* uploads in progress at once; beyond: RESOURCE_EXHAUSTED */
  size_t upload_budget_bytes;   /* tensor bytes of all uploads in progress together */
  size_t http_body_budget_bytes; /* request body bytes held by all HTTP connections together */
  size_t grpc_body_budget_bytes; /* gRPC request message bytes held by all calls together */
  size_t grpc_memory_bytes;      /* gRPC core's resource quota; 0: grpc_body_budget_bytes + 1 GiB */
  int shm_max_regions;           /* system shared-memory regions registered at once; 0: extension off */
} moed_config;

/* --tls-client-auth: no client certificate asked; verified when sent; required */
enum { MOED_CLIENT_AUTH_NONE = 0, MOED_CLIENT_AUTH_OPTIONAL, MOED_CLIENT_AUTH_REQUIRE };

/* 0: run; 1: exit 0 (--help); -1: bad flags (message printed). */
int moed_config_parse(moed_config *cfg, int argc, char **argv);

/* ---- log.c ---------------------------------------------------------------- */

enum { MOED_LOG_ERROR = 0, MOED_LOG_WARN, MOED_LOG_INFO, MOED_LOG_DEBUG };
/* --model-control-mode: moed's own (every set loaded at start, the repository
 * RPCs and uploads allowed), Triton's none (every set loaded, no changes by
 * RPC), explicit (only --load-model sets loaded, changes allowed) and poll
 * (every set loaded, then the directory followed; no changes by RPC) */
enum { MOED_CONTROL_MOED = 0, MOED_CONTROL_NONE, MOED_CONTROL_EXPLICIT, MOED_CONTROL_POLL };
void moed_log_init(int level, bool json);
/* One line per event: `event` is a short key ("listening", "model_loaded"),
 * the rest a printf message. */
void moed_log(int level, const char *event, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- hostmem.c: host tensor buffers, large ones kept for reuse ------------- */

/* 64-byte aligned; buffers >= 1 MiB return to a bounded pool on free (fresh
 * multi-MiB pages fault more slowly than the copy that fills them). */
void *moed_hostmem_alloc(size_t n);
void moed_hostmem_free(void *p);
/* A slice that owns p (freed with moed_hostmem_free). */
grpc_slice moed_hostmem_slice(void *p, size_t len);
/* Frees the pool (exit). */
void moed_hostmem_trim(void);

/* ---- budget.c: bytes held by all clients together, against a limit ---------- */

/* Claims n more bytes of *held against budget: false (nothing claimed)
 * when all together would pass it. Any thread. */
bool moed_budget_claim(_Atomic size_t *held, size_t n, size_t budget);
/* Gives back n bytes claimed. */
void moed_budget_release(_Atomic size_t *held, size_t n);

/* ---- status_map.c ---------------------------------------------------------- */

grpc_status_code moed_status_from_moe(moe_status s);
/* The HTTP status the REST port answers a gRPC status with. */
int moed_http_status_from_grpc(grpc_status_code code);
/* Triton's protocol extensions moed does not implement, by their gRPC
 * method (TraceSetting) or REST path segment (trace): why, for an
 * UNIMPLEMENTED (HTTP 501) answer naming the extension; NULL for others. */
const char *moed_extension_unimplemented(const char *name);

/* Room for a failure's message (it names the offending field). */
#define MOED_ERR_LEN 600
/* Writes the message into buf[0..MOED_ERR_LEN); returns code, so that a
 * failure is answered in one statement. */
grpc_status_code moed_failf(char *buf, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Rewrites msg[0..cap) so that it names no server path under dir: "dir/x"
 * becomes "x" and dir alone becomes `label` (clients see paths relative to
 * the model repository only; the log keeps the full ones). */
void moed_msg_relative(char *msg, size_t cap, const char *dir, const char *label);

/* ---- rpc.c, rpc_call.c, rpc_buffer.c: gRPC core <-> libuv bridge ---------- */

typedef enum moed_method {
  MOED_M_SERVER_LIVE = 0,
  MOED_M_SERVER_READY,
  MOED_M_MODEL_READY,
  MOED_M_SERVER_METADATA,
  MOED_M_MODEL_METADATA,
  MOED_M_MODEL_INFER,
  MOED_M_MODEL_STREAM_INFER,
  MOED_M_MODEL_CONFIG,
  MOED_M_MODEL_STATISTICS,
  MOED_M_REPOSITORY_INDEX,
  MOED_M_REPOSITORY_LOAD,
  MOED_M_REPOSITORY_UNLOAD,
  MOED_M_HEALTH_CHECK,
  MOED_M_HEALTH_WATCH,
  MOED_M_EXPERT_UPLOAD,
  MOED_M_SHM_STATUS, /* Triton's system shared-memory extension (shm.c) */
  MOED_M_SHM_REGISTER,
  MOED_M_SHM_UNREGISTER,
  MOED_M_CUDA_SHM_STATUS, /* ... and its CUDA one (CUDA IPC handles; GPU builds) */
  MOED_M_CUDA_SHM_REGISTER,
  MOED_M_CUDA_SHM_UNREGISTER,
  MOED_M_COUNT
} moed_method;

typedef struct moed_rpc moed_rpc;

/* One unit handed from the CQ thread to the loop: a unary call with its
 * request, or one message of a stream (payload NULL: the client closed its
 * side of the stream). The receiver owns `payload` and one reference on
 * `rpc` (released by replying or with moed_rpc_release). */
typedef struct moed_request {
  struct moed_request *next;
  moed_rpc *rpc;
  moed_method method;
  grpc_byte_buffer *payload;
  uint64_t received_ns; /* monotonic */
  size_t held;          /* its message's bytes claimed from --grpc-body-budget-bytes (rpc.c) */
} moed_request;

/* Frees req, its payload, and its claim on --grpc-body-budget-bytes: the
 * end of every request, answered or refused. */
void moed_request_free(moed_request *req);
/* Gives back req's claim before its answer is sent, where the request is
 * freed only after it (inference, upload chunks): a client that has its
 * answer may send the next request at once. */
void moed_request_answered(moed_request *req);

typedef struct moed_rpc_server moed_rpc_server;
typedef void (*moed_request_fn)(moed_request *req, void *arg);
/* The fast path: called on the CQ thread first; true = it took the request. */
typedef bool (*moed_inline_fn)(moed_request *req, void *arg);

/* After calls were cancelled (their clients went away or their deadlines
 * passed): on the loop thread, once for any number of them. */
typedef void (*moed_cancel_fn)(void *arg);

/* Binds, registers the methods, starts the CQ thread; each request reaches
 * `on_request` on the loop thread unless `try_inline` (may be NULL) took it
 * on the CQ thread; `on_cancel` (may be NULL) follows cancellations.
 * *bound_port gets the port. */
int moed_rpc_start(const moed_config *cfg, uv_loop_t *loop, moed_request_fn on_request,
                   moed_inline_fn try_inline, moed_cancel_fn on_cancel, void *arg, moed_rpc_server **out,
                   int *bound_port);
/* Calls accepted and not yet freed. */
int moed_rpc_active(moed_rpc_server *s);
/* Stream responses queued for clients and not yet written (any thread). */
size_t moed_rpc_buffered_bytes(moed_rpc_server *s);
/* Request message bytes held by calls until answered (any thread). */
size_t moed_rpc_request_bytes(void);
/* Shutdown in steps driven by the loop (which keeps serving hand-offs
 * meanwhile): stop accepting; cancel what is left; quiet = the server's
 * shutdown finished and every call is freed; then destroy (joins the CQ
 * thread, frees the server once the loop closed its handle). */
void moed_rpc_shutdown(moed_rpc_server *s);
void moed_rpc_cancel_all(moed_rpc_server *s);
bool moed_rpc_quiet(moed_rpc_server *s);
void moed_rpc_destroy(moed_rpc_server *s);

/* Sends the response message (NULL: none) and the status; for a stream, the
 * final status. Thread-safe; consumes the request's reference. `msg` NULL
 * or a human message naming the offending field. */
void moed_rpc_finish(moed_rpc *r, grpc_status_code code, const char *msg, grpc_byte_buffer *response);
/* Ends the call now with `code` and why (thread-safe): a stream the server
 * gives up on; the pending read completes as if the client had left. */
void moed_rpc_end(moed_rpc *r, grpc_status_code code, const char *why);
/* Streams: queues one message (sent in order, one write at a time). */
void moed_rpc_stream_write(moed_rpc *r, grpc_byte_buffer *message);
/* Streams: one request's work is done (pairs with each hand-off); when the
 * client has closed and nothing is pending the stream ends with OK. */
void moed_rpc_stream_done(moed_rpc *r);
/* A call that came in over another protocol (the REST port, rest.c) for
 * the same handlers: a unary moed_rpc without a gRPC call, whose answer
 * moed_rpc_finish hands to done(arg, ...) on the thread that finishes it
 * (response: taken by done; msg: valid during the call). It starts with two
 * references: the request's (moed_rpc_finish consumes it) and the caller's
 * (released with moed_rpc_release once it needs the call no more). No
 * deadline; moed_rpc_local_cancel marks it cancelled (its client left).
 * peer: what the log names for a repository change (address, token). */
typedef void (*moed_rpc_done_fn)(void *arg, grpc_status_code code, const char *msg,
                                 grpc_byte_buffer *response);
moed_rpc *moed_rpc_local(moed_method method, moed_rpc_done_fn done, void *arg, const char *peer);
/* The method's gRPC path; whether it changes the repository (logged with its peer). */
const char *moed_method_name(moed_method m);
bool moed_method_changes(moed_method m);
void moed_rpc_local_cancel(moed_rpc *r);
void moed_rpc_ref(moed_rpc *r);
void moed_rpc_release(moed_rpc *r);
bool moed_rpc_cancelled(const moed_rpc *r);
/* Who made a repository-changing call (RepositoryModelLoad/Unload, Upload):
 * "ADDRESS[ cert 'SUBJECT'][ token 'NAME']"; "unknown" for other calls. */
const char *moed_rpc_peer(const moed_rpc *r);
/* Deadline as CLOCK_MONOTONIC ns (UINT64_MAX: none). */
uint64_t moed_rpc_deadline_ns(const moed_rpc *r);
/* Paced client streams (upload): asks for the next message once the last
 * one is processed, so a fast client cannot queue unbounded memory. */
void moed_rpc_read_next(moed_rpc *r);
/* Flattens a received byte buffer into one slice (caller unrefs); a
 * one-slice buffer is referenced, not copied. */
grpc_slice moed_rpc_flatten(grpc_byte_buffer *bb);
/* A byte buffer that takes ownership of a malloc'ed buffer. */
grpc_byte_buffer *moed_rpc_buffer_take(void *data, size_t len);
/* m packed into a new byte buffer (NULL: out of memory) */
grpc_byte_buffer *moed_rpc_pack(const ProtobufCMessage *m);

uint64_t moed_now_ns(void);

/* ---- model_stats.c: per-model statistics (the repository keeps them by name) */

#define MOED_HIST_BUCKETS 16

typedef struct moed_hist {
  _Atomic uint64_t le[MOED_HIST_BUCKETS]; /* counts per bucket (not cumulative) */
  _Atomic uint64_t count, sum;            /* sum: of the observed values (ns, rows) */
} moed_hist;

/* Distinct batch sizes tracked per model (Triton's batch_stats); executions
 * of sizes beyond the first this many are counted in batch_untracked. */
#define MOED_BATCH_SIZES 256

/* One batch size's executions; `size` 0: a free slot (claimed once). */
typedef struct moed_batch_stat {
  _Atomic uint64_t size, count, input_ns, infer_ns, output_ns;
} moed_batch_stat;

/* Every success counts once in queue, compute_input, compute_infer and
 * compute_output, so one counter (success_count) is their count: a reader
 * never sees them differ (perf_analyzer aborts when they do). */
typedef struct moed_model_stats {
  _Atomic uint64_t success_count, success_ns, fail_count, fail_ns;
  _Atomic uint64_t queue_ns, compute_input_ns, compute_ns, compute_output_ns;
  _Atomic uint64_t inference_count, execution_count, last_inference_ms;
  _Atomic uint64_t bytes_in, bytes_out;
  moed_batch_stat batch[MOED_BATCH_SIZES]; /* open addressing by size */
  _Atomic uint64_t batch_untracked;
  moed_hist queue_hist, compute_hist, total_hist; /* ns */
  moed_hist batch_hist;                           /* rows per execution, as batch[] counts them */
} moed_model_stats;

/* Upper bounds of the buckets but the last (+Inf): latencies in ns, 10 us
 * to 10 s; batch sizes in rows, 1, 2, 4, ... 16384. */
extern const uint64_t moed_hist_bounds_ns[MOED_HIST_BUCKETS - 1];
extern const uint64_t moed_hist_bounds_rows[MOED_HIST_BUCKETS - 1];
void moed_hist_observe(moed_hist *h, const uint64_t *bounds, uint64_t v);
/* Where a request's time went on its worker, split as Triton's statistics
 * split it (ModelStatistics compute_input, compute_infer, compute_output;
 * perf_analyzer requires the three counted for every success). */
typedef struct moed_timing {
  uint64_t start_ns;  /* the worker took it up: its queue time ends; 0: never */
  uint64_t input_ns;  /* inputs staged: merged, validated, copied to the device */
  uint64_t infer_ns;  /* the op ran (to its end, on a device) */
  uint64_t output_ns; /* outputs copied to the host and encoded as the response */
} moed_timing;

/* One request answered (ok or not): its time queued (arrival to t's start),
 * on the worker (t; NULL: it never started), in all, its batch size
 * (inferences: the rows along the batch axis for a model with one, else 1)
 * and its tensor bytes in and out. */
void moed_stats_record(moed_model_stats *st, bool ok, uint64_t queue_ns, const moed_timing *t,
                       uint64_t total_ns, uint64_t inferences, uint64_t in, uint64_t out);
/* One execution of batch size `size` (Triton's batch statistics: the rows
 * of every request merged, along the batch axis; requests merged for a
 * model without one); t's output is the copy to the host (encoding is per
 * request). Also observed in batch_hist. */
void moed_stats_record_execution(moed_model_stats *st, uint64_t size, const moed_timing *t);
typedef struct moed_batch_snapshot {
  uint64_t size, count, input_ns, infer_ns, output_ns;
} moed_batch_snapshot;
/* The batch sizes executed so far into out[0..MOED_BATCH_SIZES), in
 * increasing size; returns how many. */
size_t moed_stats_batches(moed_model_stats *st, moed_batch_snapshot *out);

/* ---- repository.c: models and their reference counts ----------------------- */

typedef struct moed_model {
  char name[128];
  const moe_op *op;    /* fused_moe for expert sets */
  moe_expert_set *set; /* NULL for built-ins (fused_moe: inline weights) */
  bool builtin;
  _Atomic int refs;        /* the repository's + one per request using it */
  moed_model_stats *stats; /* shared by every load of the same name */
} moed_model;

typedef struct moed_repository moed_repository;

int moed_repository_create(const char *dir, moed_repository **out);
/* A name usable as a model and a directory entry (no '/', no leading '.'). */
bool moed_model_name_ok(const char *name);
/* the rule moed_model_name_ok checks, for error messages (which never echo a rejected name) */
#define MOED_MODEL_NAME_RULE "letters, digits, '.', '_', '-'; 1 to 127 characters, not starting with '.'"
/* A model version as a message may quote it: v when it is a number (1 to 19
 * digits, as Triton's versions are), else a placeholder, so that a version
 * string cannot carry a quote or a newline into a client's log. */
const char *moed_version_shown(const char *v);
void moed_repository_destroy(moed_repository *r);
/* Loads every subdirectory of the repository directory. */
void moed_repository_load_all(moed_repository *r);
/* NULL (and *status, *msg set) when absent. Caller releases. */
moed_model *moed_repository_acquire(moed_repository *r, const char *name);
void moed_model_release(moed_model *m);
/* Loads `name` from the directory (reloads if loaded). */
moe_status moed_repository_load(moed_repository *r, const char *name, moe_error *err);
moe_status moed_repository_unload(moed_repository *r, const char *name, moe_error *err);
/* Adds a set built elsewhere (ExpertStore upload); takes ownership. */
moe_status moed_repository_add(moed_repository *r, moe_expert_set *set, bool replace, moe_error *err);

/* ---- repository_poll.c: --model-control-mode poll ----------------------------- */

typedef struct moed_poller moed_poller;
/* Records the directory's sets as loaded now, then rescans every `secs`
 * on a thread of its own (loads new and changed sets, unloads removed ones). */
int moed_poller_start(moed_repository *r, const char *dir, int secs, moed_poller **out);
/* Joins the thread (after a load in progress); NULL is a no-op. */
void moed_poller_stop(moed_poller *p);

typedef struct moed_index_entry {
  char name[128];
  const char *state; /* "READY", "UNAVAILABLE" */
  char reason[256];
} moed_index_entry;
/* Every model known (loaded or present in the directory); malloc'ed. */
size_t moed_repository_index(moed_repository *r, moed_index_entry **out);
/* Stats of every loaded model; calls fn for each under the lock. */
void moed_repository_foreach(moed_repository *r, void (*fn)(moed_model *m, void *arg), void *arg);

/* ---- shm.c: shared-memory regions (Triton's system and CUDA extensions) --- */

/* The registry: region name -> a POSIX shared-memory object's bytes
 * [offset, offset + byte_size), mapped read/write at registration (a
 * system region), or the first byte_size bytes of another process's device
 * allocation, opened from its IPC handle (a CUDA region). One namespace of
 * names for both kinds. At most max regions; any thread (one mutex). A
 * region is reference-counted: an unregistered region leaves the registry
 * at once, and its mapping lives until the last request that acquired it
 * lets it go. */
typedef struct moed_shm moed_shm;
typedef struct moed_shm_region moed_shm_region;
/* A region's kind; MOED_SHM_ANY: either, where unregister and status filter. */
typedef enum moed_shm_kind { MOED_SHM_ANY = -1, MOED_SHM_SYSTEM, MOED_SHM_CUDA } moed_shm_kind;

int moed_shm_create(int max_regions, moed_shm **out);
/* Unregisters every region (mappings still acquired live on). */
void moed_shm_destroy(moed_shm *s);
/* OK, or a failure naming the field in err[MOED_ERR_LEN]: name or key not
 * valid (INVALID_ARGUMENT), name taken (ALREADY_EXISTS), no such object
 * (NOT_FOUND), byte_size 0 or [offset, offset + byte_size) past the
 * object's end (INVALID_ARGUMENT), the registry full (RESOURCE_EXHAUSTED). */
grpc_status_code moed_shm_register(moed_shm *s, const char *name, const char *key, uint64_t offset,
                                   uint64_t byte_size, char *err);
/* A CUDA region: handle[handle_len] a cudaIpcMemHandle_t of another
 * process's allocation, opened on GPU device_id (one of 0..gpus-1, the
 * GPUs moed runs on). OK, or a failure naming the field: name (as above),
 * raw_handle not 64 bytes, byte_size 0 or past the allocation, or the
 * handle that does not open (INVALID_ARGUMENT); a build without a GPU
 * backend (UNIMPLEMENTED); gpus 0: moed runs on no GPU
 * (FAILED_PRECONDITION); device_id not one of them (INVALID_ARGUMENT);
 * name taken, registry full (as above). */
grpc_status_code moed_shm_register_cuda(moed_shm *s, const char *name, const uint8_t *handle,
                                        size_t handle_len, int64_t device_id, uint64_t byte_size, int gpus,
                                        char *err);
/* Unregisters `name` (NULL or "": every region) of `kind`; a name not
 * registered (or of the other kind) is no error (Triton's rule:
 * unregistering is idempotent). */
void moed_shm_unregister(moed_shm *s, moed_shm_kind kind, const char *name);
typedef struct moed_shm_info {
  moed_shm_kind kind;
  char name[128];
  char key[256];   /* system */
  uint64_t offset; /* system */
  uint64_t byte_size;
  int device_id; /* CUDA */
} moed_shm_info;
/* The regions of `kind` registered now (only `name` unless NULL or ""),
 * malloc'ed into *out (free()); returns how many, or -1 when out of
 * memory. */
long moed_shm_status(moed_shm *s, moed_shm_kind kind, const char *name, moed_shm_info **out);
/* The region registered as `name` with a reference for the caller; NULL
 * when there is none. */
moed_shm_region *moed_shm_acquire(moed_shm *s, const char *name);
void moed_shm_release(moed_shm_region *r);
/* The region's bytes [offset, offset + size), or NULL when they are not
 * all within it (overflow-checked). A CUDA region's are device memory:
 * only moed_shm_read and moed_shm_write touch them. */
uint8_t *moed_shm_span(const moed_shm_region *r, uint64_t offset, uint64_t size);
uint64_t moed_shm_byte_size(const moed_shm_region *r);
moed_shm_kind moed_shm_region_kind(const moed_shm_region *r);
/* n bytes from region r at offset into host memory dst (read), or from
 * host memory src into r at offset (write), either kind; the span checked
 * against r first (overflow-checked). OK, or the failure with
 * why[MOED_ERR_LEN] (a phrase for a message naming the tensor): past the
 * end, the object truncated (system; INVALID_ARGUMENT), the device copy
 * failed (CUDA; INTERNAL). A write is in the region when it returns. */
grpc_status_code moed_shm_read(const moed_shm_region *r, uint64_t offset, void *dst, size_t n,
                               char why[MOED_ERR_LEN]);
grpc_status_code moed_shm_write(const moed_shm_region *r, uint64_t offset, const void *src, size_t n,
                                char why[MOED_ERR_LEN]);
/* memcpy to or from a region's bytes; false when they are no longer backed
 * (the client shrank its object: the fault is caught, nothing is lost but
 * this copy). */
bool moed_shm_copy(void *dst, const void *src, size_t n);
/* A region name follows the model-name rule (it is echoed in messages). */
#define MOED_SHM_KEY_RULE "an optional leading '/', then 1 to 250 of letters, digits, '.', '_', '-'"

/* ---- devices.c: device queues (one worker per backend) --------------------- */

typedef struct moed_devices moed_devices;
typedef struct moed_job moed_job;
typedef void (*moed_job_fn)(moed_job *job, moe_backend *b);

/* Where a device worker's time goes per execution (one op call: a merged
 * batch, or one request), in the order an execution passes through them
 * (infer_run.c; /metrics moed_worker_phase_seconds_total). On a GPU the
 * kernels run between the launch and the end of the wait: the wait is the
 * device time the host did not hide. MOED_PHASE_NAMES: their label values. */
typedef enum moed_phase {
  MOED_PHASE_GATHER,   /* requests checked, rows merged into one host buffer */
  MOED_PHASE_PREPARE,  /* the op's call prepared, backend memory bound */
  MOED_PHASE_COPY_IN,  /* inputs queued to the device (host side of the copies) */
  MOED_PHASE_LAUNCH,   /* the op run (a device: its kernels queued) */
  MOED_PHASE_COPY_OUT, /* a device: the outputs' copies to host buffers queued behind the op */
  MOED_PHASE_WAIT,     /* a device: waiting for the op and those copies (merged: after the next launch) */
  MOED_PHASE_ANSWER, /* responses encoded and sent, statistics, memory freed (or handed to the answer thread)
                      */
  MOED_PHASE_ANSWER_ASYNC, /* the worker's answer thread: merged batches' responses, beside the next batch */
  MOED_PHASES
} moed_phase;
#define MOED_PHASE_NAMES                                                                                     \
  { "gather", "prepare", "copy_in", "launch", "copy_out", "wait", "answer", "answer_async" }
/* The responses of a merged batch, encoded and sent on the worker's answer
 * thread (devices.c) while the worker goes on to its next batch; run does
 * it and frees a. */
typedef struct moed_answer moed_answer;
struct moed_answer {
  moed_answer *next;
  void (*run)(moed_answer *a);
};
typedef struct moed_answerer moed_answerer;
/* Queues a on q's thread, in order; waits while a few are queued already
 * (the bound). Only the worker that owns q (its job's answerer). */
void moed_answerer_post(moed_answerer *q, moed_answer *a);
/* A worker's sums over its executions (clock_gettime MONOTONIC; nothing allocated). */
typedef struct moed_phases {
  uint64_t ns[MOED_PHASES];
  uint64_t executions; /* op calls that reached the backend (the ones timed) */
} moed_phases;
/* A merged batch launched on a device and not yet waited for (infer_run.c):
 * its worker holds one while it stages and launches the next batch behind
 * it. The slot is q's (devices.c) and only q's worker touches it; NULL
 * when q's worker waits for each batch at once (MOED_HOLD_BATCH=0). */
typedef struct merged_answer moed_launched;
moed_launched **moed_answerer_launched(moed_answerer *q);
/* Completes the batch held in *slot, if any: waits for its outputs (not for
 * work launched after it), records its execution and posts its answers on
 * its answer thread; the requests get INTERNAL when the device failed.
 * Empties the slot; the wait's time goes to ph (NULL: not kept). */
void moed_infer_launched_finish(moed_launched **slot, moed_phases *ph);

/* Request priority levels as Triton's queue policy numbers them: 1 is the
 * highest, MOED_PRIORITY_LEVELS the lowest; a request without one (or 0)
 * gets MOED_PRIORITY_DEFAULT. Higher levels leave the device queues first. */
#define MOED_PRIORITY_LEVELS 3
#define MOED_PRIORITY_DEFAULT 2

struct moed_job {
  moed_job *next, *prev;   /* in its queue (devices.c, under its lock) */
  bool queued;             /* in a queue, not yet taken by a worker nor withdrawn (devices.c) */
  moed_job_fn run;         /* on a worker thread */
  moed_job_fn cancel;      /* instead of run when the queues stop (b NULL) */
  int priority;            /* 1..MOED_PRIORITY_LEVELS; 0: MOED_PRIORITY_DEFAULT */
  moed_phases *phases;     /* set by the worker before run: where run adds its executions' times */
  moed_answerer *answerer; /* set by the worker before run: its answer thread; NULL: answer on the worker */
};

int moed_devices_create(const moed_config *cfg, moed_devices **out);
/* false when every queue is full (the caller answers UNAVAILABLE). */
bool moed_devices_submit(moed_devices *d, moed_job *job);
/* Takes a submitted job back out of its queue; true: no worker took it (it
 * no longer counts against --max-queue-size, the caller owns it again);
 * false: a worker has it. The caller must know job is alive (not yet
 * freed by its run). Any thread. */
bool moed_devices_withdraw(moed_devices *d, moed_job *job);
/* Whether a job of this priority level submitted now would wait: jobs of
 * its level or higher are queued and no worker is left free for it after
 * them (the batcher then keeps a batch open to grow). Any thread. */
bool moed_devices_busy(moed_devices *d, int priority);
/* fn(arg) is called on a worker thread each time it finishes a job, under
 * the queues' lock (so it must not call back into them: uv_async_send);
 * after moed_devices_on_free(d, NULL, NULL) returns it is never called. */
void moed_devices_on_free(moed_devices *d, void (*fn)(void *arg), void *arg);
/* Runs what is queued, then joins the workers (backends stay). */
void moed_devices_stop(moed_devices *d);
/* The host backend that runs ops worker backend b has no kernel for (b
 * itself when b is a host backend). */
moe_backend *moed_devices_fallback(moed_devices *d, moe_backend *b);
/* A host backend for the CQ thread's fast path; NULL when the workers'
 * backends are not host memory or the fast path is off. */
moe_backend *moed_devices_inline_backend(moed_devices *d);
/* Stops, then destroys the backends. */
void moed_devices_destroy(moed_devices *d);
const char *moed_devices_backend_name(moed_devices *d);
/* Asks every worker to trim its backends (moe_backend_trim) when an expert
 * set was left to device caches since the last call; workers also check
 * after each job. Any thread (main.c's tick). */
void moed_devices_poll(moed_devices *d);
/* Workers; any thread. */
int moed_devices_count(const moed_devices *d);
/* One worker's share of the load (/metrics: per device). */
typedef struct moed_worker_load {
  bool busy;          /* running a job now */
  uint64_t jobs;      /* jobs it has run */
  moed_phases phases; /* of the jobs it has finished */
} moed_worker_load;
/* Jobs waiting in the device queues per priority level (queued[0]: level
 * 1) and, when workers is not NULL, each worker's load (moed_devices_count
 * of them), all read at one instant; returns the jobs the workers are
 * running now (the busy ones). Any thread. */
int moed_devices_load(moed_devices *d, int queued[MOED_PRIORITY_LEVELS], moed_worker_load *workers);
/* The device memory of worker i's backend, and its name; NULL (out left
 * alone) when it works in host memory (the CPU's: no device memory). Any
 * thread. */
const char *moed_devices_memory(const moed_devices *d, int i, moe_backend_memory *out);
/* Worker i's backend's name (a GPU's, or the CPU's). Any thread. */
const char *moed_devices_worker_name(const moed_devices *d, int i);

/* ---- handlers*.c: the protocol --------------------------------------------- */

typedef struct moed_batcher moed_batcher;
typedef struct moed_weight_cache moed_weight_cache;

typedef struct moed_server {
  const moed_config *cfg;
  uv_loop_t *loop;
  moed_rpc_server *rpc;
  int grpc_port; /* bound (the HTTP probes check it) */
  moed_repository *repo;
  moed_devices *devices;
  _Atomic bool ready;
  _Atomic bool draining;
  _Atomic bool stop_work; /* the drain timeout passed: running ops stop at their next work item */
  _Atomic int inflight;   /* admitted infer requests not yet answered */
  _Atomic uint64_t rejected;
  struct moed_watch *watches;    /* health Watch streams (loop thread) */
  struct moed_upload *uploads;   /* uploads in progress (loop thread) */
  _Atomic uint64_t upload_bytes; /* tensor bytes they announced (upload.c, --upload-budget-bytes) */
  moed_batcher *batcher;
  moed_weight_cache *weights;
  moed_shm *shm; /* system shared-memory regions; NULL: --shm-max-regions 0 */
} moed_server;

/* The loop's request callback (moed_request_fn). */
void moed_handle_request(moed_request *req, void *server);
/* The CQ thread's fast path (moed_inline_fn): a small unary ModelInfer for
 * a model that is never batched runs right there on a host backend, without
 * a hand-off (each one costs a thread wake-up: about as much as the whole
 * call on this stack). */
bool moed_handle_inline(moed_request *req, void *server);
/* The loop's cancellation callback (moed_cancel_fn): queued work of calls
 * that were cancelled is answered and leaves the device queues. */
void moed_handle_cancel(void *server);
/* Health status changed (drain): answers every Watch stream. */
void moed_health_changed(moed_server *s);
/* Ends every Watch stream (shutdown). */
void moed_health_close(moed_server *s);

/* ---- model_desc.c: what a model shows (ModelMetadata, ModelConfig; any protocol) */

#define MOED_MAX_IO 16

/* One input or output as its model shows it. */
typedef struct moed_tensor_desc {
  const char *name;
  const char *dtypes;          /* every dtype it takes (gives): moe dtype names, comma-separated */
  const char *datatype;        /* the first of them as a KServe datatype (the protocol shows one) */
  int64_t shape[MOE_MAX_DIMS]; /* the full shape: -1 a free size, else the size the model fixes */
  size_t rank;
  bool optional;
} moed_tensor_desc;

typedef struct moed_model_desc {
  moed_tensor_desc in[MOED_MAX_IO], out[MOED_MAX_IO];
  size_t n_in, n_out;
  int32_t max_batch_size; /* Triton's: > 0, every shape leads with the batch axis (config dims omit it) */
  bool rows_independent;
} moed_model_desc;

/* Model m as clients see it; the strings are static (op table, set). */
void moed_model_describe(const moed_server *s, const moed_model *m, moed_model_desc *out);
/* Triton's max_batch_size of m alone (read per request by the statistics). */
int32_t moed_model_max_batch_size(const moed_server *s, const moed_model *m);
/* A JSON object naming every KServe datatype of each tensor that has more
 * than one ({"x": ["FP32", "FP16", "BF16"]}); NULL when none has, or out of
 * memory. Freed with free(). */
char *moed_model_datatypes_json(const moed_model_desc *d);

/* ---- the inference path (infer_req.h: the order of its files) ---------------- */

/* A decoded inference request: message, model reference, inputs (raw
 * contents point into the received bytes, not copied) and parameters.
 * Owns its moed_request (and the reference on the call it holds). */
typedef struct moed_infer_req moed_infer_req;

/* infer_decode.c: decodes req (consuming its payload). NULL only when out
 * of memory (req is then answered and freed). A request that does not
 * decode is returned with an error that moed_infer_run answers;
 * moed_infer_failed tells. */
moed_infer_req *moed_infer_decode(moed_server *srv, moed_request *req);
bool moed_infer_failed(const moed_infer_req *r);
/* Whether this payload's model may run on the CQ thread: a built-in op
 * that is never batched (its cost follows its message size). Reads only
 * model_name. */
bool moed_infer_inline_ok(moed_server *srv, grpc_byte_buffer *payload);
/* infer_run.c: runs reqs[0..n) (one merged call when n > 1; each alone
 * when merging is refused), answers each, records statistics, frees them.
 * moed_infer_run_timed also adds each execution's phase times to *ph (a
 * device worker's; NULL: not kept) and answers merged batches on answerer
 * (NULL: here). */
void moed_infer_run(moed_server *srv, moe_backend *b, moed_infer_req **reqs, size_t n);
void moed_infer_run_timed(moed_server *srv, moe_backend *b, moed_infer_req **reqs, size_t n, moed_phases *ph,
                          moed_answerer *answerer);
/* infer_answer.c: answers r with `code` (stream: an error message on the
 * stream) and frees it; it never ran. */
void moed_infer_reject(moed_server *srv, moed_infer_req *r, grpc_status_code code, const char *why);
/* Answers a request that was never decoded the same way (on a stream with
 * its request id, read from the message's first bytes). */
void moed_request_reject(moed_server *srv, moed_request *req, grpc_status_code code, const char *why);
/* The same for a request never admitted (it holds no in-flight count). */
void moed_request_refuse(moed_request *req, grpc_status_code code, const char *why);

/* ---- batcher.c: the batch key; merging requests along the token axis (loop) -- */

/* Whether the model would merge a request with others at all (the batch
 * key's model-level conditions; ModelConfig reports them). */
bool moed_model_batches(const moed_server *srv, const moed_model *m);
/* Rows merged along the first axis by the batcher; 0: never batched. */
int64_t moed_infer_batch_rows(const moed_infer_req *r);
/* Same model, parameters, input names/dtypes/trailing dims and small
 * inputs: the two may run as one call. */
bool moed_infer_same_batch(const moed_infer_req *a, const moed_infer_req *b);

int moed_batcher_create(moed_server *s, moed_batcher **out);
/* Takes r (batchable: moed_infer_batch_rows > 0); it runs within
 * max_queue_delay_us, merged with others of the same batch key. */
void moed_batcher_submit(moed_batcher *b, moed_infer_req *r);
/* Queues reqs[0..n) as one job on the device queues; when they are full,
 * answers each UNAVAILABLE. */
void moed_infer_dispatch(moed_server *s, moed_infer_req **reqs, size_t n);
/* Queues an admitted request that is decoded on the worker (large). */
void moed_infer_dispatch_raw(moed_server *s, moed_request *req);
/* Whether the caller of work with this deadline and call stopped waiting by
 * `now` (cancelled, or the deadline passed). Any thread. */
bool moed_caller_gone(uint64_t deadline_ns, const moed_rpc *rpc, uint64_t now);
/* Answers every queued request whose caller gave up (cancelled, or past
 * its deadline or parameters['timeout']) and withdraws the jobs left
 * without requests from the device queues; returns how many it withdrew
 * (loop thread; b NULL: none). */
size_t moed_batcher_sweep(moed_batcher *b);
/* How a job is put on the device queues: false when they are full. */
typedef bool (*moed_submit_fn)(moed_server *s, moed_job *job);
/* Queues job by submit; when the queues are full, first sweeps (the work
 * whose callers gave up frees places no live job holds), then tries once
 * more. false: still full, job not queued (loop thread). */
bool moed_batcher_queue(moed_server *s, moed_job *job, moed_submit_fn submit);
/* Requests held in open batches, not yet sent to the device queues (loop). */
size_t moed_batcher_held(const moed_batcher *b);
/* Sends every open batch to the device queues now (drain). */
void moed_batcher_flush_all(moed_batcher *b);
/* Flushes, then closes its handles (the loop frees it). */
void moed_batcher_destroy(moed_batcher *b);

/* ---- weight_cache.c: inline fused_moe weights on the device ------------------ */

/* Device copies of one request's weight tensors, keyed by XXH3-128 of their
 * names, dtypes, shapes and bytes; bounded by bytes, least recently used
 * evicted first (entries in use are never evicted). Shared by the workers;
 * entries belong to one backend. */
typedef struct moed_weights moed_weights;
int moed_weight_cache_create(size_t limit_bytes, moed_weight_cache **out);
void moed_weight_cache_destroy(moed_weight_cache *c);
/* The cached copies of tensors t[0..n) on b (copied there on a miss); NULL
 * when they do not fit the cache or the backend is out of memory (the
 * caller then copies as usual). data[i] gets the device pointer of t[i]. */
moed_weights *moed_weight_cache_get(moed_weight_cache *c, moe_backend *b, const moe_named_tensor *t, size_t n,
                                    void **data);
void moed_weight_cache_release(moed_weight_cache *c, moed_weights *w);
typedef struct moed_weight_cache_stats {
  uint64_t hits, misses, evictions, bytes, entries;
} moed_weight_cache_stats;
void moed_weight_cache_stats_get(moed_weight_cache *c, moed_weight_cache_stats *out);

/* ---- upload.c: moe.v1.ExpertStore.Upload ----------------------------------- */

/* One message of an upload stream (payload NULL: the client closed). */
void moed_upload_handle(moed_server *s, moed_request *req);
/* Uploads in progress (the drain waits for them; loop thread). */
int moed_upload_count(const moed_server *s);
/* The same state machine without a call, on the calling thread
 * (fuzz/fuzz_upload.c): open, then each UploadRequest message (data NULL:
 * the client closed, or with cancelled went away); false once answered,
 * with moed_upload_status's code (UNKNOWN while not) and message; close
 * frees it and its files. */
typedef struct moed_upload moed_upload;
moed_upload *moed_upload_open(moed_server *s);
bool moed_upload_message(moed_upload *u, const uint8_t *data, size_t len, bool cancelled);
grpc_status_code moed_upload_status(const moed_upload *u, const char **msg);
void moed_upload_close(moed_upload *u);

/* ---- fd_budget.c: descriptors for connections, a reserve kept --------------- */

/* Raises the open-file limit to the hard limit; from then on an accepted
 * connection (gRPC's or HTTP's) whose descriptor would fall into the last
 * `reserve` ones is closed at once, and accept never fails with EMFILE. */
void moed_fd_budget_init(int reserve);
/* Connections on listener fd (the HTTP port) may use the first half of the
 * reserve: its probes answer while gRPC connections fill the rest. */
void moed_fd_budget_side_listener(int fd);
/* Connections closed at accept: into the reserve; with no descriptor left. */
void moed_fd_budget_refused(uint64_t *reserve, uint64_t *exhausted);

/* ---- http_conn.c (http_conn.h inside): HTTP/1.1 connections (both ports) -- */

typedef struct moed_http_listener moed_http_listener;
typedef struct moed_http_conn moed_http_conn;

/* One whole request, owned by its connection until answered. */
typedef struct moed_http_request {
  int method;      /* http_parser's enum http_method */
  char path[1024]; /* the URL without its query */
  char *body;      /* body_len bytes and a NUL (NULL: no body); the handler may take it (free, set NULL) */
  size_t body_len; /* at most max_body */
  int64_t inference_header_length; /* Inference-Header-Content-Length; -1 absent, -2 not a number */
  char authorization[300];         /* the Authorization header's value (cut: no token matches) */
  int authorization_len;           /* -1: absent */
} moed_http_request;

/* Called on the loop with each request; it answers with moed_http_respond*
 * now, or calls moed_http_defer and answers later (on the loop). */
typedef void (*moed_http_handler)(moed_http_conn *c, moed_http_request *rq, void *arg);

typedef struct moed_http_options {
  const char *name;       /* for logs: "http", "rest" */
  const moed_config *cfg; /* deadlines, connection cap */
  size_t max_body;        /* larger: 413 */
  bool keep_alive;        /* false: one request per connection */
  bool side;              /* a side port (moed_fd_budget_side_listener) */
  bool tls;               /* TLS with tls.c's context (--tls-cert) */
} moed_http_options;

/* A listener's connection counts (loop thread). */
typedef struct moed_http_stats {
  int open;          /* open now */
  uint64_t accepted; /* accepted and served (not refused) */
  uint64_t refused;  /* closed at accept: over --http-max-connections */
  uint64_t timeouts; /* closed with a request begun but not whole within the deadlines */
  uint64_t
      idle_closed;     /* closed with no request begun within --idle-timeout (--handshake-timeout at first) */
  uint64_t tls_failed; /* closed by a failed TLS handshake or record */
  uint64_t abandoned;  /* requests in work whose client closed or reset the connection (http_conn.c) */
} moed_http_stats;

int moed_http_listen(uv_loop_t *loop, const char *address, int port, const moed_http_options *o,
                     moed_http_handler fn, void *arg, moed_http_listener **out, int *bound_port);
/* Closes the listener and every connection (deferred ones: gone is called). */
void moed_http_listener_close(moed_http_listener *l);
/* fn(name, counts) for every listening HTTP port (loop thread). */
void moed_http_foreach_listener(void (*fn)(const char *name, const moed_http_stats *n, void *arg), void *arg);
/* The answer: status, Content-Type, `extra` header lines ("Name: v\r\n...",
 * or NULL), body[0..nbody) (nbody <= 3) written in place, then release(arg)
 * (also when the connection is gone). */
void moed_http_respond(moed_http_conn *c, int code, const char *ctype, const char *extra,
                       const uv_buf_t *body, size_t nbody, void (*release)(void *), void *arg);
/* The same with a copied body. */
void moed_http_respond_copy(moed_http_conn *c, int code, const char *ctype, const char *body, size_t len);
/* {"error": msg} (application/json), as Triton answers errors. */
void moed_http_respond_error(moed_http_conn *c, int code, const char *msg);
/* The answer comes later: if the connection closes first, gone(arg) is
 * called (on the loop) and the answer must not be sent. The connection is
 * read meanwhile, so gone also follows the client's leaving: a reset, or a
 * FIN unless the client had said its last request was the last
 * (http_conn.c). */
void moed_http_defer(moed_http_conn *c, void (*gone)(void *), void *arg);
/* The client's address, "ADDR:PORT" ("unknown" when it cannot be read),
 * and under mTLS " cert 'SUBJECT'" of its verified certificate. */
void moed_http_peer(moed_http_conn *c, char *out, size_t size);
/* Memory connections (fuzz/fuzz_http_conn.c): a listener without a socket,
 * connections whose written bytes go to sink. memory_feed hands bytes in
 * as a read would, then completes each answer's write as the loop would;
 * false once the connection closed (memory_close is still called). */
moed_http_listener *moed_http_memory_listener(uv_loop_t *loop, const moed_http_options *o,
                                              moed_http_handler fn, void *arg);
moed_http_conn *moed_http_memory_conn(moed_http_listener *l, void (*sink)(void *, const char *, size_t),
                                      void *arg);
bool moed_http_memory_feed(moed_http_conn *c, const char *data, size_t n);
/* The client's FIN, as a read of EOF would see it; false once the connection closed. */
bool moed_http_memory_eof(moed_http_conn *c);
void moed_http_memory_close(moed_http_conn *c);

/* ---- tls.c: the gRPC port's credentials ----------------------------------- */

/* Insecure without cfg->tls_cert; else TLS whose files are reread on the
 * first handshake after moed_tls_reload. NULL (logged) when they do not
 * load at start. */
grpc_server_credentials *moed_tls_server_credentials(const moed_config *cfg);
/* SIGHUP: the next handshake reads the certificate files again. */
void moed_tls_reload(void);
/* The HTTP ports' OpenSSL context (an SSL_CTX, owned by tls.c) from the
 * same files, rebuilt at the first call after moed_tls_reload (loop
 * thread); NULL (logged) when they never loaded. */
struct ssl_ctx_st *moed_tls_http_context(void);
/* Frees the HTTP ports' context (at exit). */
void moed_tls_destroy(void);

/* ---- auth.c: bearer tokens and roles ---------------------------------------- */

/* Reads --auth-tokens (none: every call allowed); -1 (logged) when it does
 * not load. */
int moed_auth_init(const moed_config *cfg);
/* SIGHUP: the token file is read again (a bad one keeps the tokens in force). */
void moed_auth_reload(void);
void moed_auth_destroy(void);
/* Whether a call of method m with request metadata md may run: OK,
 * UNAUTHENTICATED (no or an unknown bearer token) or PERMISSION_DENIED (an
 * infer token on a repository change), why[MOED_ERR_LEN] saying which;
 * who[] gets the token's name. Any thread. */
grpc_status_code moed_auth_check(moed_method m, const grpc_metadata_array *md, char *who, size_t who_size,
                                 char *why);
/* The same for the value v[0..n) of an authorization header (v NULL:
 * none was sent): the REST port's check. */
grpc_status_code moed_auth_check_value(moed_method m, const char *v, size_t n, char *who, size_t who_size,
                                       char *why);

/* ---- http.c: metrics and probes on the side port ----------------------------- */

typedef struct moed_http moed_http;
int moed_http_start(moed_server *s, const char *address, int port, moed_http **out, int *bound_port);
void moed_http_stop(moed_http *h);

/* ---- gpu_metrics.c: Triton's GPU metrics from NVML, loaded at run time ------- */

typedef struct moed_gpu_metrics moed_gpu_metrics;
/* Finds the NVML device of each GPU worker: backends[i] is worker i's
 * backend name (moed_devices_memory), NULL for a host worker. NULL (the
 * log says why) when none is to be shown: !allow, no GPU worker, no NVML. */
moed_gpu_metrics *moed_gpu_metrics_create(bool allow, int n_workers, const char *const backends[]);
/* The six nv_gpu_* / nv_energy_consumption families, one sample per GPU,
 * read now (at most ~100 ms): malloc'd text of *len bytes; NULL when g is
 * NULL or out of memory. Any thread. */
char *moed_gpu_metrics_render(moed_gpu_metrics *g, size_t *len);
void moed_gpu_metrics_destroy(moed_gpu_metrics *g);

/* ---- rest*.c: the KServe v2 REST API ------------------------------------------ */

typedef struct moed_rest moed_rest;
int moed_rest_start(moed_server *s, const char *address, int port, moed_rest **out, int *bound_port);
/* Closes the port and its connections; calls still in work are freed when
 * they finish (any thread). */
void moed_rest_stop(moed_rest *r);
/* The ModelInferRequest a REST infer body for `model` becomes, as the port
 * builds it: the JSON header (hlen bytes: Inference-Header-Content-Length,
 * -1 none, -2 not a number) then the binary data. NULL when refused: *code
 * the HTTP status, why[MOED_ERR_LEN] the message. (fuzz/fuzz_rest_infer.c) */
grpc_byte_buffer *moed_rest_infer_message(const moed_config *cfg, const char *body, size_t len, int64_t hlen,
                                          const char *model, int *code, char *why);

#endif
