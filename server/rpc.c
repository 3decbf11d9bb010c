/* rpc: bridges gRPC core to the libuv loop, and does nothing else.
 *
 * One completion-queue thread runs every call's small state machine
 * (accept, receive, send completions). Each request crosses to the loop once
 * (an MPSC list + uv_async), never once per tag: handing every tag over costs
 * ~40% of small-call throughput. Responses are started from whichever thread
 * has them (grpc_call_start_batch is thread-safe); their completions come
 * back here. */
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moed.h"

/* ---- method table ----------------------------------------------------------- */

typedef struct method_desc {
  const char *path;
  bool read_stream;  /* client streams: payload read message by message */
  bool write_stream; /* server streams */
  bool paced;        /* read_stream: the next read waits for moed_rpc_read_next */
  bool changes;      /* changes the repository: the caller's identity is kept for the log */
} method_desc;

#define KSERVE(m) "/inference.GRPCInferenceService/" m
static const method_desc methods[MOED_M_COUNT] = {
    [MOED_M_SERVER_LIVE] = {.path = KSERVE("ServerLive")},
    [MOED_M_SERVER_READY] = {.path = KSERVE("ServerReady")},
    [MOED_M_MODEL_READY] = {.path = KSERVE("ModelReady")},
    [MOED_M_SERVER_METADATA] = {.path = KSERVE("ServerMetadata")},
    [MOED_M_MODEL_METADATA] = {.path = KSERVE("ModelMetadata")},
    [MOED_M_MODEL_INFER] = {.path = KSERVE("ModelInfer")},
    [MOED_M_MODEL_STREAM_INFER] = {.path = KSERVE("ModelStreamInfer"),
                                   .read_stream = true,
                                   .write_stream = true},
    [MOED_M_MODEL_CONFIG] = {.path = KSERVE("ModelConfig")},
    [MOED_M_MODEL_STATISTICS] = {.path = KSERVE("ModelStatistics")},
    [MOED_M_REPOSITORY_INDEX] = {.path = KSERVE("RepositoryIndex")},
    [MOED_M_REPOSITORY_LOAD] = {.path = KSERVE("RepositoryModelLoad"), .changes = true},
    [MOED_M_REPOSITORY_UNLOAD] = {.path = KSERVE("RepositoryModelUnload"), .changes = true},
    [MOED_M_HEALTH_CHECK] = {.path = "/grpc.health.v1.Health/Check"},
    [MOED_M_HEALTH_WATCH] = {.path = "/grpc.health.v1.Health/Watch", .write_stream = true},
    [MOED_M_EXPERT_UPLOAD] = {.path = "/moe.v1.ExpertStore/Upload",
                              .read_stream = true,
                              .paced = true,
                              .changes = true},
    /* registering maps a node-local object: who did it is logged as for repository changes */
    [MOED_M_SHM_STATUS] = {.path = KSERVE("SystemSharedMemoryStatus")},
    [MOED_M_SHM_REGISTER] = {.path = KSERVE("SystemSharedMemoryRegister"), .changes = true},
    [MOED_M_SHM_UNREGISTER] = {.path = KSERVE("SystemSharedMemoryUnregister"), .changes = true},
    [MOED_M_CUDA_SHM_STATUS] = {.path = KSERVE("CudaSharedMemoryStatus")},
    [MOED_M_CUDA_SHM_REGISTER] = {.path = KSERVE("CudaSharedMemoryRegister")},
    [MOED_M_CUDA_SHM_UNREGISTER] = {.path = KSERVE("CudaSharedMemoryUnregister")},
};
#undef KSERVE

/* ---- types -------------------------------------------------------------------- */

typedef enum tag_kind {
  TAG_ACCEPT,
  TAG_GENERIC,
  TAG_CLOSE,
  TAG_WRITE,
  TAG_RECV,
  TAG_FINISH,
  TAG_SHUTDOWN
} tag_kind;

typedef struct rpc_tag {
  tag_kind kind;
  void *ptr;
} rpc_tag;

/* An armed request for one registered method; re-armed on every accept. */
typedef struct accept_slot {
  rpc_tag tag;
  moed_method method;
  void *registered;
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload;
} accept_slot;

/* The slot for methods nobody registered: answered UNIMPLEMENTED. */
typedef struct generic_slot {
  rpc_tag tag;
  grpc_call *call;
  grpc_call_details details;
  grpc_metadata_array md;
} generic_slot;

typedef struct out_msg {
  struct out_msg *next;
  grpc_byte_buffer *bb;
  size_t len;
} out_msg;

struct moed_rpc {
  moed_rpc_server *srv;
  grpc_call *call;
  moed_method method;
  uint64_t deadline_ns;
  _Atomic int refs;
  _Atomic bool cancelled;
  int close_cancelled; /* written by RECV_CLOSE_ON_SERVER */
  bool close_started;  /* RECV_CLOSE_ON_SERVER asked for (else the final batch does) */
  rpc_tag close_tag, write_tag, recv_tag, finish_tag;

  pthread_mutex_t mu; /* the send side and stream bookkeeping below */
  bool md_sent;
  bool writing; /* one write batch in flight */
  out_msg *wq_head, *wq_tail;
  grpc_byte_buffer *writing_bb;
  bool finishing; /* final status requested */
  bool finished;  /* final status batch started */
  grpc_status_code fin_code;
  grpc_slice fin_details;
  grpc_byte_buffer *fin_msg;
  bool read_done;
  int pending; /* stream hand-offs not yet done */
  grpc_byte_buffer *recv_bb;
  /* responses queued or being written, not yet sent: their bytes (also in
   * the server's `buffered`), their count, the one being written (kept:
   * a sent byte buffer's slices may have been taken by the transport, so
   * its length is not known after the write) */
  size_t wq_bytes, writing_len;
  int wq_count;
  bool recv_paused; /* the next read waits until the stream has room */
  /* a local call (moed_rpc_local): no gRPC call, the answer goes here */
  moed_rpc_done_fn done;
  void *done_arg;
  char peer[320]; /* repository changes: address, certificate subject, token name */
};

struct moed_rpc_server {
  grpc_server *server;
  grpc_completion_queue *cq;
  pthread_t thread;
  bool thread_started;
  uv_async_t async;
  moed_request_fn on_request;
  moed_inline_fn try_inline;
  moed_cancel_fn on_cancel;
  void *arg;
  _Atomic bool cancels; /* a call was cancelled since the loop last called on_cancel */

  pthread_mutex_t q_mu; /* the hand-off list (many producers, the loop consumes) */
  moed_request *q_head, *q_tail;

  accept_slot *slots;
  size_t num_slots;
  generic_slot generic;
  rpc_tag shutdown_tag;
  _Atomic bool shutting_down;
  _Atomic bool shutdown_done;
  _Atomic int live_calls;
  /* Stream responses buffered for clients (all calls), and the limits: a
   * stream pauses its reads while it holds stream_bytes (or STREAM_QUEUE
   * messages, or STREAM_PENDING requests in work), and while it holds any
   * and all streams together hold total_bytes. The work it had already
   * read still answers; when an answer would take the total past
   * total_bytes, a stream that holds its stream_bytes already is ended
   * with RESOURCE_EXHAUSTED. A client that never reads its responses so
   * costs bounded memory and stops being read; a paused stream that holds
   * nothing is never kept waiting. */
  _Atomic size_t buffered;
  size_t stream_bytes, total_bytes;
  int max_open_calls; /* --max-open-calls: a call past it is refused at accept */
};

uint64_t moed_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void start_close(moed_rpc *r);

/* ---- hand-off to the loop --------------------------------------------------------- */

static void handoff(moed_rpc_server *s, moed_rpc *r, grpc_byte_buffer *payload) {
  moed_request *req = calloc(1, sizeof *req);
  if (!req) { /* cannot even queue it: answer here */
    if (payload) grpc_byte_buffer_destroy(payload);
    moed_rpc_finish(r, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory", NULL);
    return;
  }
  req->rpc = r;
  req->method = r->method;
  req->payload = payload;
  req->received_ns = moed_now_ns();
  /* true: try_inline took req (answered or queued it) */
  /* cppcheck-suppress memleak */
  if (s->try_inline && s->try_inline(req, s->arg)) return;
  start_close(r); /* queued work must learn of a cancel */
  pthread_mutex_lock(&s->q_mu);
  if (s->q_tail)
    s->q_tail->next = req;
  else
    s->q_head = req;
  s->q_tail = req;
  pthread_mutex_unlock(&s->q_mu);
  uv_async_send(&s->async);
}

/* Marks r cancelled (its client went away, its deadline passed, or it was
 * ended here) and tells the loop, which answers the work it queued for r
 * now rather than when a worker reaches it (any thread). */
static void mark_cancelled(moed_rpc *r) {
  if (atomic_exchange(&r->cancelled, true) || !r->srv) return;
  if (!atomic_exchange(&r->srv->cancels, true)) uv_async_send(&r->srv->async);
}

static void on_async(uv_async_t *h) {
  moed_rpc_server *s = h->data;
  pthread_mutex_lock(&s->q_mu);
  moed_request *req = s->q_head;
  s->q_head = s->q_tail = NULL;
  pthread_mutex_unlock(&s->q_mu);
  while (req) {
    moed_request *next = req->next;
    req->next = NULL;
    s->on_request(req, s->arg);
    req = next;
  }
  /* after the hand-offs: a request cancelled as it arrived is found queued */
  if (atomic_exchange(&s->cancels, false) && s->on_cancel) s->on_cancel(s->arg);
}

/* ---- call objects ---------------------------------------------------------------- */

static void start_batch(moed_rpc *r, const grpc_op *ops, size_t n, rpc_tag *tag) {
  atomic_fetch_add(&r->refs, 1);
  grpc_call_error e = grpc_call_start_batch(r->call, ops, n, tag, NULL);
  if (e != GRPC_CALL_OK) {
    /* a programming error in the state machine; keep the call collectable */
    moed_log(MOED_LOG_ERROR, "start_batch", "grpc_call_start_batch: %d", (int)e);
    atomic_fetch_sub(&r->refs, 1);
  }
}

void moed_rpc_ref(moed_rpc *r) { atomic_fetch_add(&r->refs, 1); }

void moed_rpc_release(moed_rpc *r) {
  if (atomic_fetch_sub(&r->refs, 1) != 1) return;
  moed_rpc_server *s = r->srv;
  for (out_msg *m = r->wq_head; m;) {
    out_msg *next = m->next;
    grpc_byte_buffer_destroy(m->bb);
    free(m);
    m = next;
  }
  if (r->writing_bb) grpc_byte_buffer_destroy(r->writing_bb);
  if (s) atomic_fetch_sub(&s->buffered, r->wq_bytes);
  if (r->fin_msg) grpc_byte_buffer_destroy(r->fin_msg);
  if (r->recv_bb) grpc_byte_buffer_destroy(r->recv_bb);
  grpc_slice_unref(r->fin_details);
  if (r->call) grpc_call_unref(r->call);
  pthread_mutex_destroy(&r->mu);
  free(r);
  if (s) atomic_fetch_sub(&s->live_calls, 1);
}

moed_rpc *moed_rpc_local(moed_method method, moed_rpc_done_fn done, void *arg, const char *peer) {
  moed_rpc *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  snprintf(r->peer, sizeof r->peer, "%s", peer);
  r->method = method;
  r->deadline_ns = UINT64_MAX;
  atomic_init(&r->refs, 2);
  pthread_mutex_init(&r->mu, NULL);
  r->fin_details = grpc_empty_slice();
  r->done = done;
  r->done_arg = arg;
  return r;
}

void moed_rpc_local_cancel(moed_rpc *r) { atomic_store(&r->cancelled, true); }

bool moed_rpc_cancelled(const moed_rpc *r) { return atomic_load(&r->cancelled); }
/* r NULL: a request without a call (fuzz/fuzz_infer_request.c decodes such) */
uint64_t moed_rpc_deadline_ns(const moed_rpc *r) { return r ? r->deadline_ns : UINT64_MAX; }

static uint64_t deadline_to_ns(gpr_timespec d) {
  if (gpr_time_cmp(d, gpr_inf_future(d.clock_type)) == 0) return UINT64_MAX;
  gpr_timespec m = gpr_convert_clock_type(d, GPR_CLOCK_MONOTONIC);
  if (m.tv_sec < 0) return 0;
  /* gpr's monotonic clock is CLOCK_MONOTONIC on Linux, as moed_now_ns */
  return (uint64_t)m.tv_sec * 1000000000u + (uint64_t)m.tv_nsec;
}

/* Started alone, it completes when the client cancels, which is how queued
 * work learns that nobody waits for it. A call answered on the CQ thread
 * right away (the inline fast path) skips it: its final batch receives the
 * close instead, one batch and one completion fewer per call. */
static void start_close(moed_rpc *r) {
  pthread_mutex_lock(&r->mu);
  bool go = !r->close_started && !r->finished;
  r->close_started = true;
  pthread_mutex_unlock(&r->mu);
  if (!go) return;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &r->close_cancelled;
  start_batch(r, &op, 1, &r->close_tag);
}

/* A batch that sends something starts with the initial metadata while it
 * is unsent; r->mu held. How many ops that put in ops[]: 0 or 1. */
static size_t metadata_op_locked(moed_rpc *r, grpc_op *ops) {
  if (r->md_sent) return 0;
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  r->md_sent = true;
  return 1;
}

/* Starts the final batch; r->mu held, nothing being written. */
static void start_finish_locked(moed_rpc *r) {
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  size_t n = metadata_op_locked(r, ops);
  if (r->fin_msg) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = r->fin_msg;
    n++;
  }
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = r->fin_code;
  ops[n].data.send_status_from_server.status_details = &r->fin_details;
  n++;
  if (!r->close_started) {
    r->close_started = true;
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n].data.recv_close_on_server.cancelled = &r->close_cancelled;
    n++;
  }
  r->finished = true;
  start_batch(r, ops, n, &r->finish_tag);
}

#define STREAM_QUEUE 1024 /* responses queued per stream */
#define STREAM_PENDING 32 /* requests of one stream in work */

/* r->mu held: whether the stream may read its next request. */
static bool stream_room_locked(const moed_rpc *r) {
  const moed_rpc_server *s = r->srv;
  return r->wq_bytes < s->stream_bytes && r->wq_count < STREAM_QUEUE && r->pending < STREAM_PENDING &&
         (r->wq_bytes == 0 || atomic_load(&s->buffered) < s->total_bytes);
}

/* r->mu held: a paused read that may go now (the caller starts it, unlocked). */
static bool resume_locked(moed_rpc *r) {
  if (!r->recv_paused || r->finishing || r->read_done || !stream_room_locked(r)) return false;
  r->recv_paused = false;
  return true;
}

static void start_recv(moed_rpc *r);

/* Starts the next queued write; r->mu held, nothing being written. */
static void start_write_locked(moed_rpc *r) {
  out_msg *m = r->wq_head;
  r->wq_head = m->next;
  if (!r->wq_head) r->wq_tail = NULL;
  r->writing_bb = m->bb;
  r->writing_len = m->len;
  r->wq_count--;
  free(m);
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  size_t n = metadata_op_locked(r, ops);
  ops[n].op = GRPC_OP_SEND_MESSAGE;
  ops[n].data.send_message.send_message = r->writing_bb;
  n++;
  r->writing = true;
  start_batch(r, ops, n, &r->write_tag);
}

void moed_rpc_finish(moed_rpc *r, grpc_status_code code, const char *msg, grpc_byte_buffer *response) {
  if (r->done) { /* a local call is unary: answered once */
    r->done(r->done_arg, code, msg, response);
    moed_rpc_release(r);
    return;
  }
  pthread_mutex_lock(&r->mu);
  if (r->method < MOED_M_COUNT && methods[r->method].read_stream) r->pending--;
  if (r->finishing) { /* a stream already ended (error or cancel): drop */
    pthread_mutex_unlock(&r->mu);
    if (response) grpc_byte_buffer_destroy(response);
    moed_rpc_release(r);
    return;
  }
  r->finishing = true;
  r->fin_code = code;
  r->fin_details = grpc_slice_from_copied_string(msg ? msg : "");
  r->fin_msg = response;
  if (!r->writing) start_finish_locked(r);
  pthread_mutex_unlock(&r->mu);
  moed_rpc_release(r);
}

void moed_rpc_stream_write(moed_rpc *r, grpc_byte_buffer *message) {
  out_msg *m = malloc(sizeof *m);
  const size_t n = grpc_byte_buffer_length(message);
  moed_rpc_server *s = r->srv;
  pthread_mutex_lock(&r->mu);
  bool over =
      m && !r->finishing && r->wq_bytes >= s->stream_bytes && atomic_load(&s->buffered) + n > s->total_bytes;
  static const char why[] = "responses buffered for stream clients past --response-buffer-bytes, this "
                            "stream's past --stream-buffer-bytes: its client does not read them";
  if (!m || r->finishing || over) {
    if (over) { /* what the stream still sends is dropped; a final batch started by the write in
                   flight (before the cancel below takes) carries this status, not OK */
      r->finishing = true;
      r->fin_code = GRPC_STATUS_RESOURCE_EXHAUSTED;
      r->fin_details = grpc_slice_from_static_string(why);
    }
    pthread_mutex_unlock(&r->mu);
    free(m);
    grpc_byte_buffer_destroy(message);
    if (over) {
      grpc_call_cancel_with_status(r->call, GRPC_STATUS_RESOURCE_EXHAUSTED, why, NULL);
      mark_cancelled(r); /* after: the loop's sweep answers the stream's queued work */
    }
    return;
  }
  m->next = NULL;
  m->bb = message;
  m->len = n;
  r->wq_bytes += n;
  r->wq_count++;
  atomic_fetch_add(&s->buffered, n);
  if (r->wq_tail)
    r->wq_tail->next = m;
  else
    r->wq_head = m;
  r->wq_tail = m;
  if (!r->writing) start_write_locked(r);
  pthread_mutex_unlock(&r->mu);
}

/* r->mu held: ends a read stream whose reads and work are all done. */
static void maybe_end_stream_locked(moed_rpc *r) {
  if (r->read_done && r->pending == 0 && !r->finishing) {
    r->finishing = true;
    r->fin_code = GRPC_STATUS_OK;
    r->fin_details = grpc_empty_slice();
    if (!r->writing) start_finish_locked(r);
  }
}

void moed_rpc_stream_done(moed_rpc *r) {
  pthread_mutex_lock(&r->mu);
  r->pending--;
  maybe_end_stream_locked(r);
  const bool go = resume_locked(r);
  pthread_mutex_unlock(&r->mu);
  if (go) start_recv(r);
  moed_rpc_release(r);
}

grpc_slice moed_rpc_flatten(grpc_byte_buffer *bb) {
  grpc_byte_buffer_reader rd;
  if (!bb) return grpc_empty_slice();
  /* one uncompressed slice (small messages): shared, not copied */
  if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE &&
      bb->data.raw.slice_buffer.count == 1)
    return grpc_slice_ref(bb->data.raw.slice_buffer.slices[0]);
  if (!grpc_byte_buffer_reader_init(&rd, bb)) return grpc_empty_slice();
  if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE) {
    /* many slices (a large message): one copy into a reusable buffer */
    size_t len = grpc_byte_buffer_length(bb), off = 0;
    uint8_t *p = moed_hostmem_alloc(len);
    grpc_slice piece;
    while (p && grpc_byte_buffer_reader_next(&rd, &piece)) {
      size_t n = GRPC_SLICE_LENGTH(piece);
      if (n > len - off) n = len - off; /* never: the length is the slices' sum */
      memcpy(p + off, GRPC_SLICE_START_PTR(piece), n);
      off += n;
      grpc_slice_unref(piece);
    }
    grpc_byte_buffer_reader_destroy(&rd);
    return p ? moed_hostmem_slice(p, off) : grpc_empty_slice();
  }
  grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
  grpc_byte_buffer_reader_destroy(&rd);
  return s;
}

grpc_byte_buffer *moed_rpc_buffer_take(void *data, size_t len) {
  grpc_slice s = grpc_slice_new(data ? data : malloc(1), len, free);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

grpc_byte_buffer *moed_rpc_pack(const ProtobufCMessage *m) {
  size_t n = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) return NULL;
  protobuf_c_message_pack(m, buf);
  return moed_rpc_buffer_take(buf, n);
}

/* ---- the completion-queue thread ---------------------------------------------- */

static void arm_slot(moed_rpc_server *s, accept_slot *slot) {
  if (atomic_load(&s->shutting_down)) return;
  slot->call = NULL;
  slot->payload = NULL;
  grpc_metadata_array_init(&slot->md);
  grpc_byte_buffer **payload = methods[slot->method].read_stream ? NULL : &slot->payload;
  grpc_call_error e =
      grpc_server_request_registered_call(s->server, slot->registered, &slot->call, &slot->deadline,
                                          &slot->md, payload, s->cq, s->cq, &slot->tag);
  if (e != GRPC_CALL_OK) moed_log(MOED_LOG_ERROR, "arm_slot", "request_registered_call: %d", (int)e);
}

static void arm_generic(moed_rpc_server *s) {
  if (atomic_load(&s->shutting_down)) return;
  generic_slot *g = &s->generic;
  g->call = NULL;
  grpc_call_details_init(&g->details);
  grpc_metadata_array_init(&g->md);
  grpc_server_request_call(s->server, &g->call, &g->details, &g->md, s->cq, s->cq, &g->tag);
}

static moed_rpc *rpc_new(moed_rpc_server *s, grpc_call *call, moed_method method, gpr_timespec deadline) {
  moed_rpc *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->srv = s;
  r->call = call;
  r->method = method;
  r->deadline_ns = deadline_to_ns(deadline);
  atomic_init(&r->refs, 1);
  pthread_mutex_init(&r->mu, NULL);
  r->fin_details = grpc_empty_slice();
  r->close_tag = (rpc_tag){TAG_CLOSE, r};
  r->write_tag = (rpc_tag){TAG_WRITE, r};
  r->recv_tag = (rpc_tag){TAG_RECV, r};
  r->finish_tag = (rpc_tag){TAG_FINISH, r};
  atomic_fetch_add(&s->live_calls, 1);
  if (method >= MOED_M_COUNT || methods[method].read_stream || methods[method].write_stream)
    start_close(r); /* streams: at once (unary calls: see start_close) */
  return r;
}

static void start_recv(moed_rpc *r) {
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &r->recv_bb;
  start_batch(r, &op, 1, &r->recv_tag);
}

/* "ipv4:10.0.0.7:51234 cert 'CN=ops' token 'deploy'" into out: who asked
 * for a repository change (the log line of every change carries it). */
static void describe_peer(grpc_call *call, const char *token, char *out, size_t n) {
  char *addr = grpc_call_get_peer(call);
  char subject[160] = "";
  grpc_auth_context *ctx = grpc_call_auth_context(call);
  if (ctx) {
    grpc_auth_property_iterator it =
        grpc_auth_context_find_properties_by_name(ctx, GRPC_X509_SUBJECT_PROPERTY_NAME);
    const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
    if (p)
      snprintf(subject, sizeof subject, "%.*s", (int)(p->value_length < 159 ? p->value_length : 159),
               p->value);
    grpc_auth_context_release(ctx);
  }
  for (char *c = subject; *c; c++) /* a certificate's subject is the client's text: one log line */
    if ((unsigned char)*c < 0x20 || *c == '\'' || *c == 0x7f) *c = '?';
  snprintf(out, n, "%s%s%s%s%s%s%s", addr ? addr : "unknown", *subject ? " cert '" : "", subject,
           *subject ? "'" : "", *token ? " token '" : "", token, *token ? "'" : "");
  gpr_free(addr);
}

const char *moed_rpc_peer(const moed_rpc *r) { return r->peer[0] ? r->peer : "unknown"; }
const char *moed_method_name(moed_method m) { return methods[m].path; }
bool moed_method_changes(moed_method m) { return methods[m].changes; }

static void on_accept(moed_rpc_server *s, accept_slot *slot, bool ok) {
  if (!ok) { /* shutdown */
    grpc_metadata_array_destroy(&slot->md);
    if (slot->payload) grpc_byte_buffer_destroy(slot->payload);
    return;
  }
  grpc_call *call = slot->call;
  grpc_byte_buffer *payload = slot->payload;
  gpr_timespec deadline = slot->deadline;
  moed_method method = slot->method;
  char why[MOED_ERR_LEN], token[128], peer[320] = "";
  grpc_status_code auth = moed_auth_check(method, &slot->md, token, sizeof token, why);
  grpc_metadata_array_destroy(&slot->md);
  arm_slot(s, slot); /* the slot is free again before we work on the call */
  if (auth != GRPC_STATUS_OK || methods[method].changes) describe_peer(call, token, peer, sizeof peer);
  /* every open call holds gRPC core's call state (~12 KiB), and a stream
   * (a health Watch, an idle ModelStreamInfer) holds it for as long as its
   * client likes: their number is bounded, or 20,000 Watch streams cost
   * 230 MiB and any number could be opened */
  const int open = atomic_load(&s->live_calls);
  /* the probes' unary checks pass: answered at once, they hold nothing, and
   * a full server must not look dead to the kubelet */
  const bool probe =
      method == MOED_M_HEALTH_CHECK || method == MOED_M_SERVER_LIVE || method == MOED_M_SERVER_READY;
  if (auth == GRPC_STATUS_OK && !probe && open >= s->max_open_calls)
    auth = moed_failf(why, GRPC_STATUS_RESOURCE_EXHAUSTED,
                      "calls: %d open, at most --max-open-calls %d; retry later", open, s->max_open_calls);
  moed_rpc *r = auth == GRPC_STATUS_OK ? rpc_new(s, call, method, deadline) : NULL;
  if (!r) { /* refused before any of its messages is read, or out of memory */
    /* refused repository changes always in the log; the rest at debug */
    if (auth == GRPC_STATUS_UNAUTHENTICATED || auth == GRPC_STATUS_PERMISSION_DENIED)
      moed_log(methods[method].changes ? MOED_LOG_WARN : MOED_LOG_DEBUG, "auth_refused", "%s from %s: %s",
               methods[method].path, peer, why);
    grpc_call_cancel_with_status(call, auth != GRPC_STATUS_OK ? auth : GRPC_STATUS_RESOURCE_EXHAUSTED,
                                 auth != GRPC_STATUS_OK ? why : "server out of memory", NULL);
    grpc_call_unref(call);
    if (payload) grpc_byte_buffer_destroy(payload);
    return;
  }
  snprintf(r->peer, sizeof r->peer, "%s", peer);
  if (methods[method].read_stream) {
    start_recv(r);
    moed_rpc_release(r); /* the receive batch holds it from here */
    return;
  }
  handoff(s, r, payload); /* the creation reference travels with it */
}

static void on_recv(moed_rpc *r, bool ok) {
  grpc_byte_buffer *bb = r->recv_bb;
  r->recv_bb = NULL;
  if (!ok && bb) {
    grpc_byte_buffer_destroy(bb);
    bb = NULL;
  }
  if (!ok) mark_cancelled(r);
  pthread_mutex_lock(&r->mu);
  r->pending++;
  if (!bb) r->read_done = true;
  pthread_mutex_unlock(&r->mu);
  moed_rpc_ref(r); /* for the hand-off */
  handoff(r->srv, r, bb);
  if (bb && !methods[r->method].paced) {
    pthread_mutex_lock(&r->mu);
    const bool go = stream_room_locked(r);
    r->recv_paused = !go;
    pthread_mutex_unlock(&r->mu);
    if (go) start_recv(r);
  }
}

void moed_rpc_read_next(moed_rpc *r) {
  pthread_mutex_lock(&r->mu);
  bool go = !r->finishing && !r->read_done;
  pthread_mutex_unlock(&r->mu);
  if (go) start_recv(r);
}

static void on_write(moed_rpc *r, bool ok) {
  pthread_mutex_lock(&r->mu);
  grpc_byte_buffer_destroy(r->writing_bb);
  r->writing_bb = NULL;
  r->writing = false;
  r->wq_bytes -= r->writing_len;
  atomic_fetch_sub(&r->srv->buffered, r->writing_len);
  r->writing_len = 0;
  if (r->wq_head && ok && !atomic_load(&r->cancelled))
    start_write_locked(r);
  else if (r->finishing && !r->finished)
    start_finish_locked(r);
  const bool go = resume_locked(r);
  pthread_mutex_unlock(&r->mu);
  if (go) start_recv(r);
}

static void on_generic(moed_rpc_server *s, bool ok) {
  generic_slot *g = &s->generic;
  grpc_call *call = g->call;
  grpc_call_details_destroy(&g->details);
  grpc_metadata_array_destroy(&g->md);
  if (!ok) return;
  arm_generic(s);
  moed_rpc *r = rpc_new(s, call, MOED_M_COUNT, gpr_inf_future(GPR_CLOCK_REALTIME));
  if (!r) {
    grpc_call_cancel_with_status(call, GRPC_STATUS_UNIMPLEMENTED, "unknown method", NULL);
    grpc_call_unref(call);
    return;
  }
  moed_rpc_finish(r, GRPC_STATUS_UNIMPLEMENTED, "unknown method", NULL);
}

static void *cq_thread(void *arg) {
  moed_rpc_server *s = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    rpc_tag *tag = ev.tag;
    bool ok = ev.success != 0;
    switch (tag->kind) {
    case TAG_ACCEPT: on_accept(s, tag->ptr, ok); break;
    case TAG_GENERIC: on_generic(s, ok); break;
    case TAG_SHUTDOWN: atomic_store(&s->shutdown_done, true); break;
    case TAG_CLOSE: {
      moed_rpc *r = tag->ptr;
      if (!ok || r->close_cancelled) mark_cancelled(r);
      moed_rpc_release(r);
      break;
    }
    case TAG_RECV:
      on_recv(tag->ptr, ok);
      moed_rpc_release(tag->ptr);
      break;
    case TAG_WRITE:
      on_write(tag->ptr, ok);
      moed_rpc_release(tag->ptr);
      break;
    case TAG_FINISH: moed_rpc_release(tag->ptr); break;
    }
  }
  return NULL;
}

/* ---- start / stop ------------------------------------------------------------- */

int moed_rpc_active(moed_rpc_server *s) { return atomic_load(&s->live_calls); }

int moed_rpc_start(const moed_config *cfg, uv_loop_t *loop, moed_request_fn on_request,
                   moed_inline_fn try_inline, moed_cancel_fn on_cancel, void *arg, moed_rpc_server **out,
                   int *bound_port) {
  moed_rpc_server *s = calloc(1, sizeof *s);
  if (!s) return -1;
  s->on_request = on_request;
  s->try_inline = try_inline;
  s->on_cancel = on_cancel;
  s->arg = arg;
  pthread_mutex_init(&s->q_mu, NULL);
  s->shutdown_tag = (rpc_tag){TAG_SHUTDOWN, s};
  s->generic.tag = (rpc_tag){TAG_GENERIC, s};

  s->max_open_calls = cfg->max_open_calls;
  s->stream_bytes = cfg->stream_buffer_bytes;
  s->total_bytes = cfg->response_buffer_bytes;
  int max_msg = cfg->max_message_bytes > (size_t)INT32_MAX ? INT32_MAX : (int)cfg->max_message_bytes;
  /* Connections cannot pile up (issue 13; fd_budget.c keeps them out of
   * the descriptor reserve): a connection that never completes its
   * handshake, or holds no calls, is closed; keepalive pings (at most one
   * per idle interval, answers within 20 s) find peers that went away; with
   * --max-connection-age even a busy connection is asked to go (GOAWAY,
   * then closed after the grace). */
  const int idle_ms = cfg->idle_timeout_s > INT32_MAX / 1000 ? INT32_MAX : cfg->idle_timeout_s * 1000;
  const int age_ms = cfg->max_connection_age_s ? cfg->max_connection_age_s * 1000 : INT32_MAX;
  const struct {
    const char *key;
    int value;
  } ints[] = {
      {GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, cfg->handshake_timeout_s * 1000},
      {GRPC_ARG_MAX_CONNECTION_IDLE_MS, idle_ms},
      {GRPC_ARG_KEEPALIVE_TIME_MS, idle_ms},
      {GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000},
      {GRPC_ARG_MAX_CONNECTION_AGE_MS, age_ms},
      {GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, cfg->connection_age_grace_s * 1000},
  };
  grpc_arg args[3 + sizeof ints / sizeof ints[0]];
  memset(args, 0, sizeof args);
  for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
    args[3 + i].type = GRPC_ARG_INTEGER;
    args[3 + i].key = (char *)ints[i].key;
    args[3 + i].value.integer = ints[i].value;
  }
  args[0].type = GRPC_ARG_INTEGER;
  args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  args[0].value.integer = max_msg;
  args[1].type = GRPC_ARG_INTEGER;
  args[1].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
  args[1].value.integer = max_msg;
  args[2].type = GRPC_ARG_INTEGER;
  args[2].key = (char *)GRPC_ARG_ALLOW_REUSEPORT;
  args[2].value.integer = 0; /* a second moed on the same port must fail, not share */
  grpc_channel_args chargs = {sizeof args / sizeof args[0], args};

  s->server = grpc_server_create(&chargs, NULL);
  s->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(s->server, s->cq, NULL);

  size_t per = cfg->request_slots > 0 ? (size_t)cfg->request_slots : 1;
  s->num_slots = per * MOED_M_COUNT;
  s->slots = calloc(s->num_slots, sizeof *s->slots);
  if (!s->slots) goto fail;
  for (int m = 0; m < MOED_M_COUNT; m++) {
    grpc_server_register_method_payload_handling ph =
        methods[m].read_stream ? GRPC_SRM_PAYLOAD_NONE : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER;
    void *reg = grpc_server_register_method(s->server, methods[m].path, NULL, ph, 0);
    if (!reg) goto fail;
    for (size_t i = 0; i < per; i++) {
      accept_slot *slot = &s->slots[(size_t)m * per + i];
      slot->tag = (rpc_tag){TAG_ACCEPT, slot};
      slot->method = (moed_method)m;
      slot->registered = reg;
    }
  }

  char addr[300];
  /* an IPv6 literal (config.c keeps it bare) needs its brackets before the port */
  snprintf(addr, sizeof addr, strchr(cfg->address, ':') ? "[%s]:%d" : "%s:%d", cfg->address, cfg->grpc_port);
  grpc_server_credentials *creds = moed_tls_server_credentials(cfg);
  if (!creds) goto fail;
  int port = grpc_server_add_http2_port(s->server, addr, creds);
  grpc_server_credentials_release(creds);
  if (port <= 0) {
    moed_log(MOED_LOG_ERROR, "bind_failed", "cannot listen on %s", addr);
    goto fail;
  }
  grpc_server_start(s->server);
  for (size_t i = 0; i < s->num_slots; i++)
    arm_slot(s, &s->slots[i]);
  arm_generic(s);

  uv_async_init(loop, &s->async, on_async);
  s->async.data = s;
  if (pthread_create(&s->thread, NULL, cq_thread, s) != 0) goto fail_async;
  s->thread_started = true;
  *bound_port = port;
  *out = s;
  return 0;
fail_async:
  uv_close((uv_handle_t *)&s->async, NULL);
fail:
  /* the server never started or has no calls: plain teardown */
  if (s->server) {
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
    grpc_server_cancel_all_calls(s->server);
    grpc_completion_queue_shutdown(s->cq);
    while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_server_destroy(s->server);
    grpc_completion_queue_destroy(s->cq);
  }
  free(s->slots);
  pthread_mutex_destroy(&s->q_mu);
  free(s);
  return -1;
}

void moed_rpc_shutdown(moed_rpc_server *s) {
  if (atomic_exchange(&s->shutting_down, true)) return;
  grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
}

void moed_rpc_cancel_all(moed_rpc_server *s) { grpc_server_cancel_all_calls(s->server); }

size_t moed_rpc_buffered_bytes(moed_rpc_server *s) { return s ? atomic_load(&s->buffered) : 0; }

bool moed_rpc_quiet(moed_rpc_server *s) {
  return atomic_load(&s->shutdown_done) && atomic_load(&s->live_calls) == 0;
}

static void on_async_closed(uv_handle_t *h) {
  moed_rpc_server *s = h->data;
  pthread_mutex_destroy(&s->q_mu);
  free(s);
}

void moed_rpc_destroy(moed_rpc_server *s) {
  grpc_completion_queue_shutdown(s->cq);
  if (s->thread_started) pthread_join(s->thread, NULL);
  grpc_server_destroy(s->server);
  grpc_completion_queue_destroy(s->cq);
  free(s->slots);
  uv_close((uv_handle_t *)&s->async, on_async_closed);
}
