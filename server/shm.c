/* shm: the system shared-memory regions of Triton's extension, and nothing
 * else: register (shm_open + mmap read/write), unregister, status, and the
 * references requests hold while they read inputs from a region or write
 * outputs into it (infer_shm.c).
 *
 * The registry is a small array under one mutex (a lookup is a few string
 * compares; at most --shm-max-regions entries). Each region is reference
 * counted: the registry holds one, each request that uses it one more, so
 * unregistering while requests are in flight only takes the name away; the
 * mapping is unmapped by whoever drops the last reference.
 *
 * The object belongs to the client, which may shrink it while it is
 * mapped: touching the pages past its new end raises SIGBUS. Every copy to
 * or from a region goes through moed_shm_copy, which turns that fault into
 * an error for the one request instead of the end of the server. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "moed.h"

struct moed_shm_region {
  _Atomic int refs;
  moed_shm_info info;
  void *map; /* the mapping: from `offset` rounded down to a page */
  size_t map_len;
  uint8_t *base; /* the region's first byte (map + offset's remainder) */
};

struct moed_shm {
  pthread_mutex_t mu;
  int max, n;
  moed_shm_region **r; /* [max] */
};

/* POSIX names one object by "/name"; glibc takes it with or without the
 * slash. Nothing that could climb out of /dev/shm or forge a log line. */
static bool key_ok(const char *key) {
  if (!key) return false;
  const char *k = key + (key[0] == '/');
  size_t n = strlen(k);
  if (n == 0 || n > 250 || strcmp(k, ".") == 0 || strcmp(k, "..") == 0) return false;
  for (size_t i = 0; i < n; i++) {
    char c = k[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
          c == '_' || c == '-'))
      return false;
  }
  return true;
}

/* ---- copies that survive a truncated object ----------------------------------------- */

static _Thread_local sigjmp_buf *volatile copy_jmp; /* set while this thread copies */
static struct sigaction prev_bus;                   /* the handler before ours */
static pthread_once_t bus_once = PTHREAD_ONCE_INIT;

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
  if (copy_jmp) siglongjmp(*copy_jmp, 1);
  /* not a region copy: what would have happened without us */
  if (prev_bus.sa_flags & SA_SIGINFO) {
    prev_bus.sa_sigaction(sig, si, uc);
  } else if (prev_bus.sa_handler != SIG_DFL && prev_bus.sa_handler != SIG_IGN) {
    prev_bus.sa_handler(sig);
  } else {
    signal(SIGBUS, SIG_DFL); /* the faulting access runs again and ends the process */
  }
}

static void install_sigbus(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &prev_bus);
}

bool moed_shm_copy(void *dst, const void *src, size_t n) {
  sigjmp_buf jb;
  if (sigsetjmp(jb, 1)) {
    copy_jmp = NULL;
    return false;
  }
  copy_jmp = &jb;
  memcpy(dst, src, n);
  copy_jmp = NULL;
  return true;
}

/* ---- the registry ------------------------------------------------------------------- */

int moed_shm_create(int max_regions, moed_shm **out) {
  pthread_once(&bus_once, install_sigbus);
  moed_shm *s = calloc(1, sizeof *s);
  if (!s || !(s->r = calloc(max_regions > 0 ? (size_t)max_regions : 1, sizeof *s->r))) {
    free(s);
    return -1;
  }
  pthread_mutex_init(&s->mu, NULL);
  s->max = max_regions;
  *out = s;
  return 0;
}

void moed_shm_release(moed_shm_region *r) {
  if (!r || atomic_fetch_sub(&r->refs, 1) != 1) return;
  munmap(r->map, r->map_len);
  free(r);
}

void moed_shm_destroy(moed_shm *s) {
  if (!s) return;
  moed_shm_unregister(s, NULL);
  pthread_mutex_destroy(&s->mu);
  free(s->r);
  free(s);
}

/* Index of `name` in the registry, or -1 (under mu). */
static int find_locked(const moed_shm *s, const char *name) {
  for (int i = 0; i < s->n; i++)
    if (strcmp(s->r[i]->info.name, name) == 0) return i;
  return -1;
}

/* Maps [offset, offset + byte_size) of the object `key` into a new region
 * (not yet registered). */
static grpc_status_code map_region(const char *name, const char *key, uint64_t offset, uint64_t byte_size,
                                   moed_shm_region **out, char *err) {
  int fd = shm_open(key, O_RDWR, 0);
  if (fd < 0) {
    int e = errno;
    return moed_failf(err,
                      e == ENOENT   ? GRPC_STATUS_NOT_FOUND
                      : e == EACCES ? GRPC_STATUS_PERMISSION_DENIED
                                    : GRPC_STATUS_INVALID_ARGUMENT,
                      "key: cannot open shared memory object '%s' read/write: %s", key, strerror(e));
  }
  grpc_status_code code = GRPC_STATUS_OK;
  struct stat st;
  uint64_t end;
  const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), start = offset - offset % page;
  moed_shm_region *r = NULL;
  if (fstat(fd, &st) != 0) {
    code = moed_failf(err, GRPC_STATUS_INTERNAL, "key: fstat of '%s' failed: %s", key, strerror(errno));
    goto out;
  }
  if (__builtin_add_overflow(offset, byte_size, &end) || end > (uint64_t)st.st_size) {
    code = moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT,
                      "offset + byte_size: %llu + %llu is past the end of '%s' (%lld bytes)",
                      (unsigned long long)offset, (unsigned long long)byte_size, key, (long long)st.st_size);
    goto out;
  }
  if (!(r = calloc(1, sizeof *r))) {
    code = moed_failf(err, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
    goto out;
  }
  r->map_len = (size_t)(end - start);
  r->map = mmap(NULL, r->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)start);
  if (r->map == MAP_FAILED) {
    code =
        moed_failf(err, GRPC_STATUS_RESOURCE_EXHAUSTED, "key: mmap of '%s' failed: %s", key, strerror(errno));
    free(r);
    r = NULL;
    goto out;
  }
  r->base = (uint8_t *)r->map + (offset - start);
  atomic_init(&r->refs, 1); /* the registry's */
  snprintf(r->info.name, sizeof r->info.name, "%s", name);
  snprintf(r->info.key, sizeof r->info.key, "%s", key);
  r->info.offset = offset;
  r->info.byte_size = byte_size;
  *out = r;
out:
  close(fd); /* the mapping keeps the object */
  return code;
}

grpc_status_code moed_shm_register(moed_shm *s, const char *name, const char *key, uint64_t offset,
                                   uint64_t byte_size, char *err) {
  if (!moed_model_name_ok(name))
    return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid region name (%s)",
                      MOED_MODEL_NAME_RULE);
  if (!key_ok(key))
    return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "key: not a valid shared memory key (%s)",
                      MOED_SHM_KEY_RULE);
  if (byte_size == 0) return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "byte_size: must be > 0");
  pthread_mutex_lock(&s->mu);
  const bool taken = find_locked(s, name) >= 0, full = s->n >= s->max;
  pthread_mutex_unlock(&s->mu);
  if (taken)
    return moed_failf(err, GRPC_STATUS_ALREADY_EXISTS, "name: region '%s' is already registered", name);
  if (full)
    return moed_failf(err, GRPC_STATUS_RESOURCE_EXHAUSTED,
                      "name: %d regions are registered, the most --shm-max-regions allows", s->max);
  moed_shm_region *r = NULL;
  grpc_status_code code = map_region(name, key, offset, byte_size, &r, err);
  if (code) return code;
  /* mapped outside the lock; a racing registration of the same name may win */
  pthread_mutex_lock(&s->mu);
  if (find_locked(s, name) >= 0)
    code = moed_failf(err, GRPC_STATUS_ALREADY_EXISTS, "name: region '%s' is already registered", name);
  else if (s->n >= s->max)
    code = moed_failf(err, GRPC_STATUS_RESOURCE_EXHAUSTED,
                      "name: %d regions are registered, the most --shm-max-regions allows", s->max);
  else
    s->r[s->n++] = r;
  pthread_mutex_unlock(&s->mu);
  if (code) moed_shm_release(r);
  return code;
}

void moed_shm_unregister(moed_shm *s, const char *name) {
  moed_shm_region *gone[64];
  for (;;) { /* in rounds: references are dropped outside the lock (munmap) */
    size_t n = 0;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->n && n < sizeof gone / sizeof gone[0];) {
      if (name && *name && strcmp(s->r[i]->info.name, name) != 0) {
        i++;
        continue;
      }
      gone[n++] = s->r[i];
      s->r[i] = s->r[--s->n];
    }
    const bool more = n == sizeof gone / sizeof gone[0];
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < n; i++)
      moed_shm_release(gone[i]);
    if (!more) return;
  }
}

long moed_shm_status(moed_shm *s, const char *name, moed_shm_info **out) {
  pthread_mutex_lock(&s->mu);
  moed_shm_info *v = malloc((s->n ? (size_t)s->n : 1) * sizeof *v);
  long n = 0;
  for (int i = 0; v && i < s->n; i++)
    if (!name || !*name || strcmp(s->r[i]->info.name, name) == 0) v[n++] = s->r[i]->info;
  pthread_mutex_unlock(&s->mu);
  *out = v;
  return v ? n : -1;
}

moed_shm_region *moed_shm_acquire(moed_shm *s, const char *name) {
  if (!s || !name) return NULL;
  pthread_mutex_lock(&s->mu);
  int i = find_locked(s, name);
  moed_shm_region *r = i >= 0 ? s->r[i] : NULL;
  if (r) atomic_fetch_add(&r->refs, 1);
  pthread_mutex_unlock(&s->mu);
  return r;
}

uint8_t *moed_shm_span(const moed_shm_region *r, uint64_t offset, uint64_t size) {
  uint64_t end;
  if (__builtin_add_overflow(offset, size, &end) || end > r->info.byte_size) return NULL;
  return r->base + offset;
}

uint64_t moed_shm_byte_size(const moed_shm_region *r) { return r->info.byte_size; }
