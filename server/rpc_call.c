/* rpc_call: one gRPC call: its references, the reads of a client stream,
 * the responses queued and written one batch at a time, the final status,
 * and the bounds on what a stream buffers for a client that does not read.
 * Any thread starts a response; completions arrive on rpc.c's CQ thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc_call.h"

/* Marks r cancelled (its client went away, its deadline passed, or it was
 * ended here) and tells the loop, which answers the work it queued for r
 * now rather than when a worker reaches it (any thread). */
void moed_rpc_mark_cancelled(moed_rpc *r) {
  if (atomic_exchange(&r->cancelled, true) || !r->srv) return;
  if (!atomic_exchange(&r->srv->cancels, true)) uv_async_send(&r->srv->async);
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
void moed_rpc_start_close(moed_rpc *r) {
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
  if (r->method < MOED_M_COUNT && moed_rpc_methods[r->method].read_stream) r->pending--;
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

/* Ends call r with `code` and why, unless it is ending already: what it
 * still sends is dropped, and a final batch started by a write in flight
 * (before the cancel takes) carries this status, not OK; it is marked
 * cancelled first, so that the read the cancel completes is taken for the
 * client's leaving (an upload is not committed), and the loop's sweep
 * answers the stream's queued work. */
void moed_rpc_end(moed_rpc *r, grpc_status_code code, const char *why) {
  pthread_mutex_lock(&r->mu);
  const bool first = !r->finishing;
  if (first) {
    r->finishing = true;
    r->fin_code = code;
    grpc_slice_unref(r->fin_details);
    r->fin_details = grpc_slice_from_copied_string(why);
  }
  pthread_mutex_unlock(&r->mu);
  if (!first) return;
  moed_rpc_mark_cancelled(r);
  if (r->call) grpc_call_cancel_with_status(r->call, code, why, NULL);
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
    pthread_mutex_unlock(&r->mu);
    free(m);
    grpc_byte_buffer_destroy(message);
    if (over) moed_rpc_end(r, GRPC_STATUS_RESOURCE_EXHAUSTED, why);
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
  if (go) moed_rpc_start_recv(r);
  moed_rpc_release(r);
}

moed_rpc *moed_rpc_new(moed_rpc_server *s, grpc_call *call, moed_method method, gpr_timespec deadline) {
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
  if (method >= MOED_M_COUNT || moed_rpc_methods[method].read_stream || moed_rpc_methods[method].write_stream)
    moed_rpc_start_close(r); /* streams: at once (unary calls: see start_close) */
  return r;
}

void moed_rpc_start_recv(moed_rpc *r) {
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &r->recv_bb;
  start_batch(r, &op, 1, &r->recv_tag);
}

void moed_rpc_on_recv(moed_rpc *r, bool ok) {
  grpc_byte_buffer *bb = r->recv_bb;
  r->recv_bb = NULL;
  if (!ok && bb) {
    grpc_byte_buffer_destroy(bb);
    bb = NULL;
  }
  if (!ok) moed_rpc_mark_cancelled(r);
  /* a message past --grpc-body-budget-bytes ends the stream, as its client's leaving would */
  size_t held = 0;
  char why[MOED_ERR_LEN];
  if (bb && moed_rpc_claim(r->srv, grpc_byte_buffer_length(bb), why) != GRPC_STATUS_OK) {
    grpc_byte_buffer_destroy(bb);
    bb = NULL;
    moed_rpc_end(r, GRPC_STATUS_RESOURCE_EXHAUSTED, why);
  } else if (bb) {
    held = grpc_byte_buffer_length(bb);
  }
  pthread_mutex_lock(&r->mu);
  r->pending++;
  if (!bb) r->read_done = true;
  pthread_mutex_unlock(&r->mu);
  moed_rpc_ref(r); /* for the hand-off */
  moed_rpc_handoff(r->srv, r, bb, held);
  if (bb && !moed_rpc_methods[r->method].paced) {
    pthread_mutex_lock(&r->mu);
    const bool go = stream_room_locked(r);
    r->recv_paused = !go;
    pthread_mutex_unlock(&r->mu);
    if (go) moed_rpc_start_recv(r);
  }
}

void moed_rpc_read_next(moed_rpc *r) {
  pthread_mutex_lock(&r->mu);
  bool go = !r->finishing && !r->read_done;
  pthread_mutex_unlock(&r->mu);
  if (go) moed_rpc_start_recv(r);
}

void moed_rpc_on_write(moed_rpc *r, bool ok) {
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
  if (go) moed_rpc_start_recv(r);
}
