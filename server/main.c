/* moed: entry point. Builds the pieces, runs the loop, and drives the
 * graceful drain: SIGTERM/SIGINT -> not ready, new inference and uploads
 * refused, in-flight work and uploads in progress complete (bounded by
 * --drain-timeout: past it, running ops stop at their next work item and
 * their calls get UNAVAILABLE, uploads are cancelled), gRPC shut down,
 * exit 0; EXIT_MARGIN_S after the timeout the process exits whatever runs. */
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "moed.h"

typedef struct app {
  moed_server srv;
  moed_config cfg;
  uv_loop_t loop;
  uv_signal_t sigterm, sigint, sighup;
  uv_timer_t tick; /* watch reaping; drain progress */
  moed_http *http;
  moed_rest *rest;
  moed_poller *poller; /* --model-control-mode poll */
  int stage;           /* 0 serving, 1 draining, 2 rpc shutting down, 3 done */
  uint64_t stage_deadline_ns;
  bool cancelled_all;
} app;

static void finish_loop(app *a) {
  a->stage = 3;
  moed_batcher_destroy(a->srv.batcher);
  a->srv.batcher = NULL;
  moed_rpc_destroy(a->srv.rpc);
  a->srv.rpc = NULL;
  moed_http_stop(a->http);
  a->http = NULL;
  moed_rest_stop(a->rest);
  a->rest = NULL;
  uv_timer_stop(&a->tick);
  uv_close((uv_handle_t *)&a->tick, NULL);
  uv_close((uv_handle_t *)&a->sigterm, NULL);
  uv_close((uv_handle_t *)&a->sigint, NULL);
  uv_close((uv_handle_t *)&a->sighup, NULL);
}

/* SIGHUP: certificates rotated (tls.c rereads them at the next handshake). */
static void on_sighup(uv_signal_t *h, int signum) {
  (void)h;
  (void)signum;
  moed_tls_reload();
  moed_auth_reload();
  moed_log(MOED_LOG_INFO, "sighup", "certificate files are reread at the next TLS handshake");
}

static void on_tick(uv_timer_t *t) {
  app *a = t->data;
  moed_server *s = &a->srv;
  moed_health_changed(s);
  moed_devices_poll(s->devices); /* sets unloaded or replaced leave the devices */
  uint64_t now = moed_now_ns();
  int uploads = moed_upload_count(s);
  if (a->stage == 1 && ((atomic_load(&s->inflight) == 0 && uploads == 0) || now >= a->stage_deadline_ns)) {
    if (atomic_load(&s->inflight)) {
      moed_log(MOED_LOG_WARN, "drain_timeout", "%d requests still in flight: their work is stopped",
               atomic_load(&s->inflight));
      atomic_store(&s->stop_work, true); /* the exit is bounded by the timeout, not by the longest op */
    }
    if (uploads) /* cancelled with the open streams below */
      moed_log(MOED_LOG_WARN, "drain_timeout", "%d uploads still in progress: they are cut off", uploads);
    moed_health_close(s);
    moed_rpc_shutdown(s->rpc);
    a->stage = 2;
    a->stage_deadline_ns = now + 1000000000u; /* grace for open streams */
  }
  if (a->stage == 2) {
    if (!a->cancelled_all && now >= a->stage_deadline_ns) {
      moed_rpc_cancel_all(s->rpc);
      a->cancelled_all = true;
    }
    if (moed_rpc_quiet(s->rpc)) {
      moed_log(MOED_LOG_INFO, "stopped", "all calls finished");
      finish_loop(a);
    }
  }
}

/* The exit's hard bound: whatever still runs EXIT_MARGIN_S past the drain
 * timeout (an op without a stop check, a shutdown step that hangs) is
 * abandoned, so a pod's grace period of --drain-timeout + 5 s always holds. */
#define EXIT_MARGIN_S 4

static void *exit_watchdog(void *arg) {
  const uint64_t deadline = *(const uint64_t *)arg;
  struct timespec t = {(time_t)(deadline / 1000000000u), (long)(deadline % 1000000000u)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR) {
  }
  moed_log(MOED_LOG_ERROR, "exit_forced", "still running %d s after the drain timeout: exiting now",
           EXIT_MARGIN_S);
  _exit(1);
  return NULL;
}

static void start_exit_watchdog(double drain_timeout_s) {
  static uint64_t deadline;
  deadline = moed_now_ns() + (uint64_t)((drain_timeout_s + EXIT_MARGIN_S) * 1e9);
  pthread_attr_t attr;
  pthread_t t;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&t, &attr, exit_watchdog, &deadline) != 0)
    moed_log(MOED_LOG_WARN, "draining", "no exit watchdog: the exit waits for running work");
  pthread_attr_destroy(&attr);
}

static void on_signal(uv_signal_t *h, int signum) {
  app *a = h->data;
  if (a->stage == 0) {
    moed_log(MOED_LOG_INFO, "draining", "signal %d: not ready, %d in flight, %d uploads, drain timeout %.1fs",
             signum, atomic_load(&a->srv.inflight), moed_upload_count(&a->srv), a->cfg.drain_timeout_s);
    start_exit_watchdog(a->cfg.drain_timeout_s);
    atomic_store(&a->srv.ready, false);
    atomic_store(&a->srv.draining, true);
    /* no request joins a held batch any more: waiting out its delay would only lengthen the drain */
    moed_batcher_flush_all(a->srv.batcher);
    moed_health_changed(&a->srv);
    a->stage = 1;
    a->stage_deadline_ns = moed_now_ns() + (uint64_t)(a->cfg.drain_timeout_s * 1e9);
    uv_timer_set_repeat(&a->tick, 10);
    uv_timer_again(&a->tick);
  } else if (a->stage == 1) { /* a second signal: stop waiting */
    a->stage_deadline_ns = 0;
  }
}

static void write_port_file(const char *path, int grpc_port, int http_port, int rest_port) {
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) return;
  fprintf(f, "%d %d %d\n", grpc_port, http_port, rest_port);
  fclose(f);
  rename(tmp, path); /* readers never see a half-written file */
}

/* "ADDR:PORT" ("[ADDR]:PORT" for IPv6), or "off" for a port turned off. */
static const char *endpoint(char buf[80], const char *addr, int port) {
  if (port < 0) return "off";
  snprintf(buf, 80, strchr(addr, ':') ? "[%s]:%d" : "%s:%d", addr, port);
  return buf;
}

int main(int argc, char **argv) {
  static app a;
  int rc = moed_config_parse(&a.cfg, argc, argv);
  if (rc) return rc > 0 ? 0 : 2;
  moed_log_init(a.cfg.log_level, a.cfg.log_json);
  signal(SIGPIPE, SIG_IGN);
  /* every descriptor the hard limit allows, connections kept out of the last
   * --fd-reserve, and no accept that fails with EMFILE: gRPC core's listener
   * never recovers from one (fd_budget.c; the HTTP probes would report it) */
  moed_fd_budget_init(a.cfg.fd_reserve);
  /* Multi-MiB tensors: keep freed memory in the heap instead of mmap/munmap
   * per request (fresh pages fault 2-3x slower). */
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  mallopt(M_TOP_PAD, 16 << 20);

  moed_server *s = &a.srv;
  s->cfg = &a.cfg;
  s->loop = &a.loop;
  uv_loop_init(&a.loop);
  grpc_init();
  int exit_code = 1;
  int grpc_port = 0, http_port = -1, rest_port = -1;

  if (moed_auth_init(&a.cfg) != 0) goto out;
  if (moed_repository_create(a.cfg.model_repository, &s->repo) != 0) goto out;
  if (a.cfg.model_control != MOED_CONTROL_EXPLICIT) {
    moed_repository_load_all(s->repo);
  } else {
    for (int i = 0; i < a.cfg.n_load_models; i++) { /* as Triton: a named model that fails stops the start */
      moe_error err = {{0}};
      if (!strcmp(a.cfg.load_models[i], "*")) {
        moed_repository_load_all(s->repo);
      } else if (moed_repository_load(s->repo, a.cfg.load_models[i], &err) != MOE_OK) {
        fprintf(stderr, "moed: --load-model %s: %s\n", a.cfg.load_models[i], err.msg);
        goto out;
      }
    }
  }
  if (a.cfg.model_control == MOED_CONTROL_POLL &&
      moed_poller_start(s->repo, a.cfg.model_repository, a.cfg.repository_poll_secs, &a.poller) != 0)
    goto out;
  if (moed_devices_create(&a.cfg, &s->devices) != 0) goto out;
  if (moed_batcher_create(s, &s->batcher) != 0) goto out;
  if (a.cfg.cache_bytes && moed_weight_cache_create(a.cfg.cache_bytes, &s->weights) != 0) goto out;
  if (a.cfg.shm_max_regions > 0 && moed_shm_create(a.cfg.shm_max_regions, &s->shm) != 0) goto out;
  if (moed_rpc_start(&a.cfg, &a.loop, moed_handle_request, moed_handle_inline, moed_handle_cancel, s, &s->rpc,
                     &grpc_port) != 0)
    goto out;
  s->grpc_port = grpc_port;
  const char *http_address = a.cfg.http_address ? a.cfg.http_address : a.cfg.address;
  if ((a.cfg.http_port >= 0 && moed_http_start(s, http_address, a.cfg.http_port, &a.http, &http_port) != 0) ||
      (a.cfg.rest_port >= 0 && moed_rest_start(s, http_address, a.cfg.rest_port, &a.rest, &rest_port) != 0)) {
    moed_http_stop(a.http);
    a.http = NULL;
    moed_rpc_shutdown(s->rpc);
    moed_rpc_cancel_all(s->rpc);
    while (!moed_rpc_quiet(s->rpc))
      uv_run(&a.loop, UV_RUN_NOWAIT);
    moed_rpc_destroy(s->rpc);
    s->rpc = NULL;
    uv_run(&a.loop, UV_RUN_DEFAULT);
    goto out;
  }
  uv_signal_init(&a.loop, &a.sigterm);
  uv_signal_init(&a.loop, &a.sigint);
  a.sigterm.data = a.sigint.data = &a;
  uv_signal_start(&a.sigterm, on_signal, SIGTERM);
  uv_signal_start(&a.sigint, on_signal, SIGINT);
  uv_signal_init(&a.loop, &a.sighup);
  uv_signal_start(&a.sighup, on_sighup, SIGHUP);
  uv_timer_init(&a.loop, &a.tick);
  a.tick.data = &a;
  uv_timer_start(&a.tick, on_tick, 1000, 1000);

  atomic_store(&s->ready, true);
  /* every port with its address, so a newcomer sees where REST and metrics listen */
  const char *http_addr = a.cfg.http_address ? a.cfg.http_address : a.cfg.address;
  char g[80], r[80], h[80];
  moed_log(MOED_LOG_INFO, "listening", "grpc %s rest %s http %s, backend %s, moed %s",
           endpoint(g, a.cfg.address, grpc_port), endpoint(r, http_addr, rest_port),
           endpoint(h, http_addr, http_port), moed_devices_backend_name(s->devices), MOED_VERSION);
  if (a.cfg.port_file) write_port_file(a.cfg.port_file, grpc_port, http_port, rest_port);
  uv_run(&a.loop, UV_RUN_DEFAULT);
  exit_code = 0;
out:
  moed_poller_stop(a.poller);
  moed_batcher_destroy(s->batcher); /* set only when the loop never ran */
  uv_run(&a.loop, UV_RUN_NOWAIT);   /* ... then its timer's close */
  moed_devices_stop(s->devices);
  moed_weight_cache_destroy(s->weights); /* no request uses it; its backends still live */
  moed_shm_destroy(s->shm);              /* no request holds a region any more */
  moed_devices_destroy(s->devices);
  moed_repository_destroy(s->repo);
  moed_auth_destroy();
  moed_tls_destroy();
  uv_loop_close(&a.loop);
  grpc_shutdown();
  moed_hostmem_trim();
  return exit_code;
}
