/* devices: the device queues. Each worker thread owns one backend (one per
 * GPU the op library lists, else the host CPU's) and runs jobs from a
 * bounded queue, one FIFO per priority level: a worker takes the oldest job
 * of the highest level that has one (Triton's priority queue policy). A job
 * nobody waits for any more is withdrawn from any place in its queue (the
 * batcher's sweep), so that abandoned work does not hold the queue's bound.
 * A worker that finishes a job tells the batcher (moed_devices_on_free),
 * which holds batches while every worker is busy and work of their level
 * already waits (moed_devices_busy): they keep filling until one is free.
 * Which backend a device number opens is the library's business
 * (moe_backend_open); only moed_devices_create picks the numbers.
 *
 * A GPU worker has an answer thread: the responses of a merged batch (a
 * few microseconds each: encoding, gRPC, freeing) are sent there while
 * the worker stages and launches its next batch, so the device does not
 * idle through them. CPU workers answer on their own thread (their op
 * wants every core anyway). MOED_ANSWER_THREAD=1 gives every worker one,
 * =0 none (tests; A/B runs). A worker with an answer thread holds a merged
 * device batch while it launches the next (infer_run.c);
 * MOED_HOLD_BATCH=0 waits for each at once instead (A/B runs). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moed.h"

#define ANSWERS_MAX 4 /* merged batches queued on an answer thread; the worker waits beyond */

typedef struct worker worker;

/* A worker's answer thread and its queue (started and joined by the worker). */
struct moed_answerer {
  pthread_mutex_t mu;
  pthread_cond_t cv; /* an answer queued, one done, or stopping */
  moed_answer *head, *tail;
  int n; /* queued or running */
  bool stopping;
  pthread_t thread;
  worker *w;
  moed_launched *launched; /* the worker's (not the answer thread's): moed_answerer_launched */
  bool hold;               /* launched is used (MOED_HOLD_BATCH) */
};

struct worker {
  moed_devices *d;
  pthread_t thread;
  moe_backend *backend;
  moe_backend *fallback; /* GPU workers: a CPU backend for ops without a GPU kernel */
  unsigned trim_seen;    /* d->trim_gen when this worker last trimmed (d->mu) */
  moed_worker_load load; /* d->mu */
  bool answers;          /* start an answer thread */
};

struct moed_devices {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  moed_job *head[MOED_PRIORITY_LEVELS], *tail[MOED_PRIORITY_LEVELS]; /* [0]: level 1, the highest */
  int queued, max_queued;
  int queued_at[MOED_PRIORITY_LEVELS]; /* of queued, per level (/metrics) */
  int running;                         /* jobs a worker has taken and not finished */
  bool stopping;
  bool stopped; /* workers joined */
  /* expert sets left to device caches only (moe_expert_set_unused_count)
   * as last seen; each change asks every worker to trim its backends */
  uint64_t unused_seen;
  unsigned trim_gen;
  worker *workers;
  int num_workers;
  void (*on_free)(void *arg); /* after each job, under mu (moed_devices_on_free) */
  void *on_free_arg;
  moe_backend *inline_backend; /* the CQ thread's (host backends only) */
};

/* d->mu held. */
static void poll_locked(moed_devices *d) {
  const uint64_t n = moe_expert_set_unused_count();
  if (n == d->unused_seen) return;
  d->unused_seen = n;
  d->trim_gen++;
  pthread_cond_broadcast(&d->cv);
}

void moed_devices_poll(moed_devices *d) {
  if (!d) return;
  pthread_mutex_lock(&d->mu);
  poll_locked(d);
  pthread_mutex_unlock(&d->mu);
}

/* On the worker's thread (a backend is used by one thread at a time). */
static void trim(worker *w) {
  const size_t freed = moe_backend_trim(w->backend) + moe_backend_trim(w->fallback);
  if (freed)
    moed_log(MOED_LOG_INFO, "device_trim", "%s: %zu bytes of unused expert sets freed",
             moe_backend_name(w->backend), freed);
}

/* The queue (0: level 1) a job waits in. */
static int level_of(const moed_job *job) {
  return job->priority >= 1 && job->priority <= MOED_PRIORITY_LEVELS ? job->priority - 1
                                                                     : MOED_PRIORITY_DEFAULT - 1;
}

/* d->mu held: job leaves its queue (the head when a worker takes it; any
 * place when withdrawn). */
static void unlink_locked(moed_devices *d, moed_job *job) {
  const int l = level_of(job);
  if (job->prev)
    job->prev->next = job->next;
  else
    d->head[l] = job->next;
  if (job->next)
    job->next->prev = job->prev;
  else
    d->tail[l] = job->prev;
  job->next = job->prev = NULL;
  job->queued = false;
  d->queued--;
  d->queued_at[l]--;
}

/* d->mu held. The next job to run, taken off its queue; NULL: none. */
static moed_job *take_locked(moed_devices *d) {
  for (int l = 0; l < MOED_PRIORITY_LEVELS; l++) {
    moed_job *job = d->head[l];
    if (!job) continue;
    unlink_locked(d, job);
    return job;
  }
  return NULL;
}

static void *answer_main(void *arg) {
  moed_answerer *q = arg;
  moed_devices *d = q->w->d;
  pthread_mutex_lock(&q->mu);
  for (;;) {
    while (!q->head && !q->stopping)
      pthread_cond_wait(&q->cv, &q->mu);
    moed_answer *a = q->head;
    if (!a) break; /* stopping and nothing left */
    q->head = a->next;
    if (!q->head) q->tail = NULL;
    pthread_mutex_unlock(&q->mu);
    const uint64_t t0 = moed_now_ns();
    a->run(a);
    const uint64_t took = moed_now_ns() - t0;
    pthread_mutex_lock(&d->mu);
    q->w->load.phases.ns[MOED_PHASE_ANSWER_ASYNC] += took;
    pthread_mutex_unlock(&d->mu);
    pthread_mutex_lock(&q->mu);
    q->n--;
    pthread_cond_broadcast(&q->cv);
  }
  pthread_mutex_unlock(&q->mu);
  return NULL;
}

moed_launched **moed_answerer_launched(moed_answerer *q) { return q->hold ? &q->launched : NULL; }

void moed_answerer_post(moed_answerer *q, moed_answer *a) {
  a->next = NULL;
  pthread_mutex_lock(&q->mu);
  while (q->n >= ANSWERS_MAX)
    pthread_cond_wait(&q->cv, &q->mu);
  if (q->tail)
    q->tail->next = a;
  else
    q->head = a;
  q->tail = a;
  q->n++;
  pthread_cond_broadcast(&q->cv);
  pthread_mutex_unlock(&q->mu);
}

/* w's answer thread; NULL (answers on the worker) when not wanted or not started. */
static moed_answerer *answerer_start(worker *w) {
  if (!w->answers) return NULL;
  moed_answerer *q = calloc(1, sizeof *q);
  if (!q) return NULL;
  q->w = w;
  const char *hold = getenv("MOED_HOLD_BATCH");
  q->hold = !hold || strcmp(hold, "0") != 0;
  pthread_mutex_init(&q->mu, NULL);
  pthread_cond_init(&q->cv, NULL);
  if (pthread_create(&q->thread, NULL, answer_main, q) == 0) return q;
  pthread_cond_destroy(&q->cv);
  pthread_mutex_destroy(&q->mu);
  free(q);
  moed_log(MOED_LOG_WARN, "answer_thread", "%s: no answer thread: answers on the worker",
           moe_backend_name(w->backend));
  return NULL;
}

/* Sends what is queued, then ends the thread. */
static void answerer_stop(moed_answerer *q) {
  if (!q) return;
  pthread_mutex_lock(&q->mu);
  q->stopping = true;
  pthread_cond_broadcast(&q->cv);
  pthread_mutex_unlock(&q->mu);
  pthread_join(q->thread, NULL);
  pthread_cond_destroy(&q->cv);
  pthread_mutex_destroy(&q->mu);
  free(q);
}

static void *worker_main(void *arg) {
  worker *w = arg;
  moed_devices *d = w->d;
  moed_answerer *answerer = answerer_start(w);
  pthread_mutex_lock(&d->mu);
  for (;;) {
    if (answerer && answerer->launched && !d->queued) { /* nothing to launch behind it: complete it now */
      moed_phases ph = {{0}, 0};
      pthread_mutex_unlock(&d->mu);
      moed_infer_launched_finish(&answerer->launched, &ph);
      pthread_mutex_lock(&d->mu);
      w->load.phases.ns[MOED_PHASE_WAIT] += ph.ns[MOED_PHASE_WAIT];
      continue;
    }
    while (!d->queued && !d->stopping && w->trim_seen == d->trim_gen)
      pthread_cond_wait(&d->cv, &d->mu);
    if (w->trim_seen != d->trim_gen) {
      w->trim_seen = d->trim_gen;
      pthread_mutex_unlock(&d->mu);
      trim(w);
      pthread_mutex_lock(&d->mu);
      continue;
    }
    moed_job *job = take_locked(d);
    if (!job) break; /* stopping and nothing left */
    d->running++;
    w->load.busy = true;
    pthread_mutex_unlock(&d->mu);
    moed_phases ph = {{0}, 0}; /* this job's, added below under the lock /metrics reads with */
    job->phases = &ph;
    job->answerer = answerer;
    job->run(job, w->backend); /* may free job */
    pthread_mutex_lock(&d->mu);
    d->running--;
    w->load.busy = false;
    w->load.jobs++;
    for (int p = 0; p < MOED_PHASES; p++)
      w->load.phases.ns[p] += ph.ns[p];
    w->load.phases.executions += ph.executions;
    poll_locked(d); /* the job may have dropped a set's last use */
    if (d->on_free) d->on_free(d->on_free_arg);
  }
  pthread_mutex_unlock(&d->mu);
  answerer_stop(answerer); /* every answer sent before the worker is joined */
  return NULL;
}

/* GPU workers when asked for (or, with auto, when a GPU is there): one per
 * device, each with a CPU fallback; else cfg->workers CPU workers. */
static int plan_gpus(const moed_config *cfg) {
  if (strcmp(cfg->device, "cpu") == 0) return 0;
  const char *why = NULL;
  int n = moe_backend_device_count(&why);
  if (n == 0) {
    moed_log(strcmp(cfg->device, "gpu") == 0 ? MOED_LOG_ERROR : MOED_LOG_INFO, "no_gpu", "%s",
             why ? why : "no GPU found");
    return strcmp(cfg->device, "gpu") == 0 ? -1 : 0;
  }
  return n;
}

int moed_devices_create(const moed_config *cfg, moed_devices **out) {
  moed_devices *d = calloc(1, sizeof *d);
  if (!d) return -1;
  pthread_mutex_init(&d->mu, NULL);
  pthread_cond_init(&d->cv, NULL);
  d->max_queued = cfg->max_queue_size;
  int gpus = plan_gpus(cfg);
  if (gpus < 0) goto fail;
  int n = gpus ? gpus : cfg->workers;
  d->workers = calloc((size_t)n, sizeof *d->workers);
  if (!d->workers) goto fail;
  const char *at = getenv("MOED_ANSWER_THREAD"); /* unset: GPU workers; 1: every worker; 0: none */
  const bool answers_all = at && strcmp(at, "1") == 0, answers_none = at && strcmp(at, "0") == 0;
  int threads = cfg->threads_per_worker;
  if (threads <= 0) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    threads = (int)(cores / n);
    if (threads < 1) threads = 1;
  }
  for (int i = 0; i < n; i++) {
    worker *w = &d->workers[i];
    moe_error err = {{0}};
    w->d = d;
    moe_status s = moe_backend_open(gpus ? i : MOE_BACKEND_HOST, threads, &w->backend, &err);
    if (!s && gpus) s = moe_backend_open(MOE_BACKEND_HOST, threads, &w->fallback, &err);
    w->answers = !answers_none && (answers_all || (!s && !moe_backend_is_host(w->backend)));
    if (s != MOE_OK) {
      moed_log(MOED_LOG_ERROR, "backend_failed", "worker %d: %s", i, err.msg);
      moe_backend_destroy(w->backend);
      w->backend = NULL;
      goto fail;
    }
    if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
      moe_backend_destroy(w->backend);
      moe_backend_destroy(w->fallback);
      w->backend = w->fallback = NULL;
      goto fail;
    }
    d->num_workers++;
  }
  if (cfg->inline_bytes && moe_backend_is_host(d->workers[0].backend)) {
    moe_error err = {{0}};
    if (moe_backend_open(MOE_BACKEND_HOST, 1, &d->inline_backend, &err) != MOE_OK)
      moed_log(MOED_LOG_WARN, "backend_failed", "inline backend: %s", err.msg); /* the fast path stays off */
  }
  moed_log(MOED_LOG_INFO, "devices", "%d workers on %s%s", d->num_workers,
           moe_backend_name(d->workers[0].backend),
           gpus ? " (CPU fallback for ops without a GPU kernel)" : "");
  *out = d;
  return 0;
fail:
  moed_devices_destroy(d);
  return -1;
}

moe_backend *moed_devices_fallback(moed_devices *d, moe_backend *b) {
  for (int i = 0; i < d->num_workers; i++)
    if (d->workers[i].backend == b && d->workers[i].fallback) return d->workers[i].fallback;
  return b;
}

bool moed_devices_submit(moed_devices *d, moed_job *job) {
  pthread_mutex_lock(&d->mu);
  if (d->queued >= d->max_queued || d->stopping) {
    pthread_mutex_unlock(&d->mu);
    return false;
  }
  const int l = level_of(job);
  job->next = NULL;
  job->prev = d->tail[l];
  if (d->tail[l])
    d->tail[l]->next = job;
  else
    d->head[l] = job;
  d->tail[l] = job;
  job->queued = true;
  d->queued++;
  d->queued_at[l]++;
  pthread_cond_signal(&d->cv);
  pthread_mutex_unlock(&d->mu);
  return true;
}

bool moed_devices_withdraw(moed_devices *d, moed_job *job) {
  pthread_mutex_lock(&d->mu);
  const bool queued = job->queued;
  if (queued) unlink_locked(d, job);
  pthread_mutex_unlock(&d->mu);
  return queued;
}

bool moed_devices_busy(moed_devices *d, int priority) {
  const moed_job probe = {.priority = priority};
  pthread_mutex_lock(&d->mu);
  int ahead = 0; /* jobs a worker takes before one of this level submitted now */
  for (int l = 0; l <= level_of(&probe); l++)
    ahead += d->queued_at[l];
  const bool busy = ahead > 0 && ahead >= d->num_workers - d->running;
  pthread_mutex_unlock(&d->mu);
  return busy;
}

void moed_devices_on_free(moed_devices *d, void (*fn)(void *arg), void *arg) {
  pthread_mutex_lock(&d->mu);
  d->on_free = fn;
  d->on_free_arg = arg;
  pthread_mutex_unlock(&d->mu);
}

moe_backend *moed_devices_inline_backend(moed_devices *d) { return d->inline_backend; }

int moed_devices_count(const moed_devices *d) { return d ? d->num_workers : 0; }

int moed_devices_load(moed_devices *d, int queued[MOED_PRIORITY_LEVELS], moed_worker_load *workers) {
  pthread_mutex_lock(&d->mu);
  memcpy(queued, d->queued_at, sizeof d->queued_at);
  for (int i = 0; workers && i < d->num_workers; i++)
    workers[i] = d->workers[i].load;
  int running = d->running;
  pthread_mutex_unlock(&d->mu);
  return running;
}

const char *moed_devices_memory(const moed_devices *d, int i, moe_backend_memory *out) {
  if (moe_backend_is_host(d->workers[i].backend)) return NULL;
  moe_backend_memory_get(d->workers[i].backend, out);
  return moe_backend_name(d->workers[i].backend);
}

const char *moed_devices_worker_name(const moed_devices *d, int i) {
  return moe_backend_name(d->workers[i].backend);
}

const char *moed_devices_backend_name(moed_devices *d) {
  return d->num_workers ? moe_backend_name(d->workers[0].backend) : "none";
}

void moed_devices_stop(moed_devices *d) {
  if (!d || d->stopped) return;
  pthread_mutex_lock(&d->mu);
  d->stopping = true;
  pthread_cond_broadcast(&d->cv);
  pthread_mutex_unlock(&d->mu);
  for (int i = 0; i < d->num_workers; i++)
    pthread_join(d->workers[i].thread, NULL);
  d->stopped = true;
}

void moed_devices_destroy(moed_devices *d) {
  if (!d) return;
  moed_devices_stop(d);
  for (int i = 0; i < d->num_workers; i++) {
    moe_backend_destroy(d->workers[i].backend);
    moe_backend_destroy(d->workers[i].fallback);
  }
  if (d->inline_backend) moe_backend_destroy(d->inline_backend);
  free(d->workers);
  pthread_cond_destroy(&d->cv);
  pthread_mutex_destroy(&d->mu);
  free(d);
}
