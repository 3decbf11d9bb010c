/* repository_poll: --model-control-mode poll (Triton's): a thread that
 * rescans the model repository directory every --repository-poll-secs and
 * loads the sets that appeared, reloads those whose files changed, and
 * unloads those whose directory went away. A change is seen in any file's
 * name, size, modification time or inode (a file replaced by rename); a set
 * that fails to load is logged and tried again at its next change. Sets
 * added by upload are not in the directory scan's table and are left
 * alone. Loading runs on this thread: requests keep being served by the
 * loaded version until the new one replaces it (moed_repository_load). */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <xxhash.h>

#include "moed.h"

typedef struct seen_set {
  char name[128];
  uint64_t print; /* fingerprint of the directory's files */
  bool present;   /* found by the scan in progress */
} seen_set;

struct moed_poller {
  moed_repository *repo;
  char *dir;
  int secs;
  pthread_t thread;
  bool started;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool stop;
  seen_set *sets;
  size_t n, cap;
};

/* What the files of directory `path` look like now (0: it cannot be read). */
static uint64_t fingerprint(const char *path) {
  DIR *d = opendir(path);
  if (!d) return 0;
  uint64_t print = 1;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char file[PATH_MAX];
    struct stat st;
    if ((size_t)snprintf(file, sizeof file, "%s/%s", path, e->d_name) >= sizeof file || stat(file, &st) != 0)
      continue;
    struct {
      int64_t size, sec, nsec;
      uint64_t ino;
    } key = {(int64_t)st.st_size, (int64_t)st.st_mtim.tv_sec, (int64_t)st.st_mtim.tv_nsec,
             (uint64_t)st.st_ino};
    /* files come in readdir's order: combined so that the order does not matter */
    print ^= XXH3_64bits_withSeed(&key, sizeof key, XXH3_64bits(e->d_name, strlen(e->d_name)));
  }
  closedir(d);
  return print;
}

static seen_set *find(moed_poller *p, const char *name) {
  for (size_t i = 0; i < p->n; i++)
    if (strcmp(p->sets[i].name, name) == 0) return &p->sets[i];
  return NULL;
}

static seen_set *add(moed_poller *p, const char *name) {
  if (p->n == p->cap) {
    size_t cap = p->cap ? p->cap * 2 : 16;
    seen_set *g = realloc(p->sets, cap * sizeof *g);
    if (!g) return NULL;
    p->sets = g;
    p->cap = cap;
  }
  seen_set *s = &p->sets[p->n++];
  memset(s, 0, sizeof *s);
  snprintf(s->name, sizeof s->name, "%.127s", name); /* moed_model_name_ok: shorter */
  return s;
}

/* One pass over the directory. `load`: act on what changed (false on the
 * first pass, which only records what moed loaded at start). */
static void scan(moed_poller *p, bool load) {
  DIR *d = opendir(p->dir);
  if (!d) {
    moed_log(MOED_LOG_WARN, "repository_poll", "cannot open %s: %s", p->dir, strerror(errno));
    return; /* a directory gone for a moment unloads nothing */
  }
  for (size_t i = 0; i < p->n; i++)
    p->sets[i].present = false;
  struct dirent *e;
  while ((e = readdir(d))) {
    char path[PATH_MAX];
    struct stat st;
    if (!moed_model_name_ok(e->d_name) ||
        (size_t)snprintf(path, sizeof path, "%s/%s", p->dir, e->d_name) >= sizeof path ||
        stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
      continue;
    seen_set *s = find(p, e->d_name);
    const uint64_t print = fingerprint(path);
    if (!s && !(s = add(p, e->d_name))) continue; /* out of memory: seen next time */
    s->present = true;
    if (s->print == print) continue;
    const bool known = s->print != 0;
    s->print = print;
    if (!load) continue;
    moe_error err = {{0}};
    if (moed_repository_load(p->repo, s->name, &err) != MOE_OK)
      moed_log(MOED_LOG_WARN, "model_load_failed", "%s (%s by poll): %s", s->name, known ? "changed" : "new",
               err.msg);
  }
  closedir(d);
  for (size_t i = 0; i < p->n;) {
    if (p->sets[i].present) {
      i++;
      continue;
    }
    moe_error err = {{0}};
    if (load)
      moed_repository_unload(p->repo, p->sets[i].name, &err); /* not loaded (it failed): nothing to do */
    p->sets[i] = p->sets[--p->n];
  }
}

static void *poll_main(void *arg) {
  moed_poller *p = arg;
  pthread_mutex_lock(&p->mu);
  while (!p->stop) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += p->secs;
    while (!p->stop && pthread_cond_timedwait(&p->cv, &p->mu, &until) != ETIMEDOUT) {
    }
    if (p->stop) break;
    pthread_mutex_unlock(&p->mu);
    scan(p, true);
    pthread_mutex_lock(&p->mu);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

int moed_poller_start(moed_repository *repo, const char *dir, int secs, moed_poller **out) {
  moed_poller *p = calloc(1, sizeof *p);
  if (!p || !(p->dir = strdup(dir))) {
    free(p);
    return -1;
  }
  p->repo = repo;
  p->secs = secs;
  pthread_mutex_init(&p->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&p->cv, &ca);
  pthread_condattr_destroy(&ca);
  scan(p, false);
  if (pthread_create(&p->thread, NULL, poll_main, p) != 0) {
    moed_poller_stop(p);
    return -1;
  }
  p->started = true;
  *out = p;
  return 0;
}

void moed_poller_stop(moed_poller *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = true;
  pthread_cond_signal(&p->cv);
  pthread_mutex_unlock(&p->mu);
  if (p->started) pthread_join(p->thread, NULL); /* a load in progress finishes first */
  pthread_cond_destroy(&p->cv);
  pthread_mutex_destroy(&p->mu);
  free(p->sets);
  free(p->dir);
  free(p);
}
