/* rpc: bridges gRPC core to the libuv loop, and does nothing else: the
 * server and its method table, accepting calls, the completion-queue
 * thread, and the hand-off of each request to the loop. A call's own
 * state machine (reads, writes, the final status) is rpc_call.c's.
 *
 * One completion-queue thread runs every call's small state machine
 * (accept, receive, send completions). Each request crosses to the loop once
 * (an MPSC list + uv_async), never once per tag: handing every tag over costs
 * ~40% of small-call throughput. Responses are started from whichever thread
 * has them (grpc_call_start_batch is thread-safe); their completions come
 * back here. */
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rpc_call.h"

/* ---- method table ----------------------------------------------------------- */

#define KSERVE(m) "/inference.GRPCInferenceService/" m
const method_desc moed_rpc_methods[MOED_M_COUNT] = {
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
    /* registering maps a node-local object or device buffer: who did it is
     * logged as for repository changes */
    [MOED_M_SHM_STATUS] = {.path = KSERVE("SystemSharedMemoryStatus")},
    [MOED_M_SHM_REGISTER] = {.path = KSERVE("SystemSharedMemoryRegister"), .changes = true},
    [MOED_M_SHM_UNREGISTER] = {.path = KSERVE("SystemSharedMemoryUnregister"), .changes = true},
    [MOED_M_CUDA_SHM_STATUS] = {.path = KSERVE("CudaSharedMemoryStatus")},
    [MOED_M_CUDA_SHM_REGISTER] = {.path = KSERVE("CudaSharedMemoryRegister"), .changes = true},
    [MOED_M_CUDA_SHM_UNREGISTER] = {.path = KSERVE("CudaSharedMemoryUnregister"), .changes = true},
};
#undef KSERVE

uint64_t moed_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- request bytes held ----------------------------------------------------------- */

/* Request message bytes held by every call, from their arrival until each
 * request is answered and freed (moed_request_free), against
 * --grpc-body-budget-bytes: gRPC core bounds each message
 * (--max-message-bytes) and moed the calls (--max-open-calls), this bounds
 * the bytes together (1024 requests in flight could otherwise hold 1 TiB).
 * Not gRPC core's resource quota (grpc_resource_quota_resize): it lets
 * allocations overcommit and, under pressure, cancels calls it picks
 * rather than refusing the one that does not fit with a status naming the
 * limit. */
static _Atomic size_t request_bytes;

grpc_status_code moed_rpc_claim(moed_rpc_server *s, size_t n, char *why) {
  if (moed_budget_claim(&request_bytes, n, s->body_budget)) return GRPC_STATUS_OK;
  return moed_failf(why, GRPC_STATUS_RESOURCE_EXHAUSTED,
                    "request: %zu bytes, with the %zu held by requests in work, would pass "
                    "--grpc-body-budget-bytes %zu; retry later",
                    n, atomic_load(&request_bytes), s->body_budget);
}

size_t moed_rpc_request_bytes(void) { return atomic_load(&request_bytes); }

void moed_request_answered(moed_request *req) {
  moed_budget_release(&request_bytes, req->held);
  req->held = 0;
}

void moed_request_free(moed_request *req) {
  if (req->payload) grpc_byte_buffer_destroy(req->payload);
  moed_request_answered(req);
  free(req);
}

/* ---- hand-off to the loop --------------------------------------------------------- */

void moed_rpc_handoff(moed_rpc_server *s, moed_rpc *r, grpc_byte_buffer *payload, size_t held) {
  moed_request *req = calloc(1, sizeof *req);
  if (!req) { /* cannot even queue it: answer here */
    if (payload) grpc_byte_buffer_destroy(payload);
    moed_budget_release(&request_bytes, held);
    moed_rpc_finish(r, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory", NULL);
    return;
  }
  req->rpc = r;
  req->method = r->method;
  req->payload = payload;
  req->held = held;
  req->received_ns = moed_now_ns();
  /* true: try_inline took req (answered or queued it) */
  /* cppcheck-suppress memleak */
  if (s->try_inline && s->try_inline(req, s->arg)) return;
  moed_rpc_start_close(r); /* queued work must learn of a cancel */
  pthread_mutex_lock(&s->q_mu);
  if (s->q_tail)
    s->q_tail->next = req;
  else
    s->q_head = req;
  s->q_tail = req;
  pthread_mutex_unlock(&s->q_mu);
  uv_async_send(&s->async);
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

/* ---- the completion-queue thread ---------------------------------------------- */

static void arm_slot(moed_rpc_server *s, accept_slot *slot) {
  if (atomic_load(&s->shutting_down)) return;
  slot->call = NULL;
  slot->payload = NULL;
  grpc_metadata_array_init(&slot->md);
  grpc_byte_buffer **payload = moed_rpc_methods[slot->method].read_stream ? NULL : &slot->payload;
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
const char *moed_method_name(moed_method m) { return moed_rpc_methods[m].path; }
bool moed_method_changes(moed_method m) { return moed_rpc_methods[m].changes; }

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
  if (auth != GRPC_STATUS_OK || moed_rpc_methods[method].changes)
    describe_peer(call, token, peer, sizeof peer);
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
  /* its message, read whole already, is held from here until it is answered */
  const size_t held = payload && !probe ? grpc_byte_buffer_length(payload) : 0;
  if (auth == GRPC_STATUS_OK) auth = moed_rpc_claim(s, held, why);
  moed_rpc *r = auth == GRPC_STATUS_OK ? moed_rpc_new(s, call, method, deadline) : NULL;
  if (!r && auth == GRPC_STATUS_OK) moed_budget_release(&request_bytes, held);
  if (!r) { /* refused before any of its messages is read, or out of memory */
    /* refused repository changes always in the log; the rest at debug */
    if (auth == GRPC_STATUS_UNAUTHENTICATED || auth == GRPC_STATUS_PERMISSION_DENIED)
      moed_log(moed_rpc_methods[method].changes ? MOED_LOG_WARN : MOED_LOG_DEBUG, "auth_refused",
               "%s from %s: %s", moed_rpc_methods[method].path, peer, why);
    grpc_call_cancel_with_status(call, auth != GRPC_STATUS_OK ? auth : GRPC_STATUS_RESOURCE_EXHAUSTED,
                                 auth != GRPC_STATUS_OK ? why : "server out of memory", NULL);
    grpc_call_unref(call);
    if (payload) grpc_byte_buffer_destroy(payload);
    return;
  }
  snprintf(r->peer, sizeof r->peer, "%s", peer);
  if (moed_rpc_methods[method].read_stream) {
    moed_rpc_start_recv(r);
    moed_rpc_release(r); /* the receive batch holds it from here */
    return;
  }
  moed_rpc_handoff(s, r, payload, held); /* the creation reference travels with it */
}

/* Why method path p[0..n) is answered UNIMPLEMENTED, into why[0..size): a
 * Triton method moed does not implement says so; any other is named when
 * it is short and printable (the client's bytes: never a forged line). */
static void unknown_method(const char *p, size_t n, char *why, size_t size) {
  static const char svc[] = "/inference.GRPCInferenceService/";
  char name[64];
  const size_t k = sizeof svc - 1;
  if (n > k && n - k < sizeof name && !memcmp(p, svc, k)) {
    memcpy(name, p + k, n - k);
    name[n - k] = 0;
    const char *ext = moed_extension_unimplemented(name);
    if (ext) {
      snprintf(why, size, "%s", ext);
      return;
    }
  }
  bool shown = n <= 128;
  for (size_t i = 0; shown && i < n; i++)
    shown = p[i] > ' ' && p[i] < 0x7f;
  snprintf(why, size, "unknown method%s%.*s", shown ? " " : "", shown ? (int)n : 0, p);
}

static void on_generic(moed_rpc_server *s, bool ok) {
  generic_slot *g = &s->generic;
  grpc_call *call = g->call;
  char why[256];
  unknown_method((const char *)GRPC_SLICE_START_PTR(g->details.method), GRPC_SLICE_LENGTH(g->details.method),
                 why, sizeof why);
  grpc_call_details_destroy(&g->details);
  grpc_metadata_array_destroy(&g->md);
  if (!ok) return;
  arm_generic(s);
  moed_rpc *r = moed_rpc_new(s, call, MOED_M_COUNT, gpr_inf_future(GPR_CLOCK_REALTIME));
  if (!r) {
    grpc_call_cancel_with_status(call, GRPC_STATUS_UNIMPLEMENTED, why, NULL);
    grpc_call_unref(call);
    return;
  }
  moed_rpc_finish(r, GRPC_STATUS_UNIMPLEMENTED, why, NULL);
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
      if (!ok || r->close_cancelled) moed_rpc_mark_cancelled(r);
      moed_rpc_release(r);
      break;
    }
    case TAG_RECV:
      moed_rpc_on_recv(tag->ptr, ok);
      moed_rpc_release(tag->ptr);
      break;
    case TAG_WRITE:
      moed_rpc_on_write(tag->ptr, ok);
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
  s->body_budget = cfg->grpc_body_budget_bytes;
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
      {GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max_msg},
      {GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max_msg},
      {GRPC_ARG_ALLOW_REUSEPORT, 0}, /* a second moed on the same port must fail, not share */
      {GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, cfg->handshake_timeout_s * 1000},
      {GRPC_ARG_MAX_CONNECTION_IDLE_MS, idle_ms},
      {GRPC_ARG_KEEPALIVE_TIME_MS, idle_ms},
      {GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000},
      {GRPC_ARG_MAX_CONNECTION_AGE_MS, age_ms},
      {GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, cfg->connection_age_grace_s * 1000},
  };
  /* Without a quota gRPC core reads every stream's message for as long as
   * the message says it is long: 40 streams that each announce 512 MiB and
   * send 64 MiB held 2.6 GiB (measured), --grpc-body-budget-bytes counting
   * only whole messages. Near the quota gRPC core resets streams and reads
   * less. The default leaves 1 GiB beside a full body budget, so legitimate
   * load meets moed's own RESOURCE_EXHAUSTED (naming the flag) first. */
  const size_t headroom = (size_t)1 << 30;
  const size_t quota_bytes = cfg->grpc_memory_bytes ? cfg->grpc_memory_bytes
                             : cfg->grpc_body_budget_bytes > SIZE_MAX - headroom
                                 ? SIZE_MAX
                                 : cfg->grpc_body_budget_bytes + headroom;
  grpc_resource_quota *quota = grpc_resource_quota_create("moed");
  grpc_resource_quota_resize(quota, quota_bytes);
  grpc_arg args[1 + sizeof ints / sizeof ints[0]];
  memset(args, 0, sizeof args);
  args[0].type = GRPC_ARG_POINTER;
  args[0].key = (char *)GRPC_ARG_RESOURCE_QUOTA;
  args[0].value.pointer.p = quota;
  args[0].value.pointer.vtable = grpc_resource_quota_arg_vtable();
  for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
    args[1 + i].type = GRPC_ARG_INTEGER;
    args[1 + i].key = (char *)ints[i].key;
    args[1 + i].value.integer = ints[i].value;
  }
  grpc_channel_args chargs = {sizeof args / sizeof args[0], args};

  s->server = grpc_server_create(&chargs, NULL);
  grpc_resource_quota_unref(quota); /* the server holds its own reference */
  s->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(s->server, s->cq, NULL);

  size_t per = cfg->request_slots > 0 ? (size_t)cfg->request_slots : 1;
  s->num_slots = per * MOED_M_COUNT;
  s->slots = calloc(s->num_slots, sizeof *s->slots);
  if (!s->slots) goto fail;
  for (int m = 0; m < MOED_M_COUNT; m++) {
    grpc_server_register_method_payload_handling ph =
        moed_rpc_methods[m].read_stream ? GRPC_SRM_PAYLOAD_NONE : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER;
    void *reg = grpc_server_register_method(s->server, moed_rpc_methods[m].path, NULL, ph, 0);
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
