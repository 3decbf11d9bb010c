/* rpc_call: what the gRPC bridge's files share, internal to them: the
 * method table, the completion-queue tags, a call (moed_rpc) and the
 * server. rpc.c accepts calls and hands their requests to the loop;
 * rpc_call.c runs each call (its references, reads, writes and final
 * status); rpc_buffer.c turns byte buffers into bytes and back. */
#ifndef MOED_RPC_CALL_H
#define MOED_RPC_CALL_H

#include <grpc/support/time.h>
#include <pthread.h>

#include "moed.h"

typedef struct method_desc {
  const char *path;
  bool read_stream;  /* client streams: payload read message by message */
  bool write_stream; /* server streams */
  bool paced;        /* read_stream: the next read waits for moed_rpc_read_next */
  bool changes;      /* changes the repository: the caller's identity is kept for the log */
} method_desc;
/* By moed_method: rpc.c's table. */
extern const method_desc moed_rpc_methods[MOED_M_COUNT];

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
  size_t body_budget; /* --grpc-body-budget-bytes: request bytes held by all calls */
};
/* rpc.c: a request (or a stream's message: payload NULL at its end) to the
 * loop, or answered inline; r's reference and the `held` bytes claimed for
 * it (moed_rpc_claim) travel with it. */
void moed_rpc_handoff(moed_rpc_server *s, moed_rpc *r, grpc_byte_buffer *payload, size_t held);
/* Claims n bytes of a request message from --grpc-body-budget-bytes (held
 * until its moed_request is freed): OK, or RESOURCE_EXHAUSTED with
 * why[MOED_ERR_LEN] naming the budget. */
grpc_status_code moed_rpc_claim(moed_rpc_server *s, size_t n, char *why);

/* rpc_call.c */

/* A call accepted for method (MOED_M_COUNT: unknown), one reference held. */
moed_rpc *moed_rpc_new(moed_rpc_server *s, grpc_call *call, moed_method method, gpr_timespec deadline);
/* Marks r cancelled and tells the loop (any thread). */
void moed_rpc_mark_cancelled(moed_rpc *r);
/* Asks for the client's close (how queued work learns of a cancel). */
void moed_rpc_start_close(moed_rpc *r);
/* Asks for the next message of a client stream. */
void moed_rpc_start_recv(moed_rpc *r);
/* The completions of a receive and a write batch (CQ thread). */
void moed_rpc_on_recv(moed_rpc *r, bool ok);
void moed_rpc_on_write(moed_rpc *r, bool ok);

#endif
