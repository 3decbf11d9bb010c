/* shm: the shared-memory regions of Triton's extensions, and nothing else:
 * system regions (shm_open + mmap read/write) and CUDA ones (another
 * process's device memory, opened from its IPC handle: moe/ipc.h), in one
 * registry (one namespace of names, as Triton's), each of one kind:
 * register, unregister, status, the references requests hold while they
 * read inputs from a region or write outputs into it (infer_shm.c), and the
 * copies between a region and host memory.
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

#include "moe/ipc.h"
#include "moed.h"

struct moed_shm_region {
  _Atomic int refs;
  moed_shm_info info;
  void *map; /* system: the mapping, from `offset` rounded down to a page; CUDA: the opened handle's */
  size_t map_len;
  uint8_t *base; /* the region's first byte (system: map + offset's remainder; CUDA: device memory, map) */
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
  if (r->info.kind == MOED_SHM_CUDA) {
    moe_error e = {{0}};
    if (moe_ipc_close(r->info.device_id, r->map, &e))
      moed_log(MOED_LOG_WARN, "cuda_shm_close", "region %s: %s", r->info.name, e.msg);
  } else {
    munmap(r->map, r->map_len);
  }
  free(r);
}

void moed_shm_destroy(moed_shm *s) {
  if (!s) return;
  moed_shm_unregister(s, MOED_SHM_ANY, NULL);
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
  r->info.kind = MOED_SHM_SYSTEM;
  snprintf(r->info.name, sizeof r->info.name, "%s", name);
  snprintf(r->info.key, sizeof r->info.key, "%s", key);
  r->info.offset = offset;
  r->info.byte_size = byte_size;
  *out = r;
out:
  close(fd); /* the mapping keeps the object */
  return code;
}

/* Whether `name` may be registered now: taken (by a region of either
 * kind) or the registry full fail. With r, r is registered under the same
 * lock (a racing registration of the same name may have won since the
 * check before mapping). */
static grpc_status_code admit(moed_shm *s, const char *name, moed_shm_region *r, char *err) {
  grpc_status_code code = GRPC_STATUS_OK;
  pthread_mutex_lock(&s->mu);
  if (find_locked(s, name) >= 0)
    code = moed_failf(err, GRPC_STATUS_ALREADY_EXISTS, "name: region '%s' is already registered", name);
  else if (s->n >= s->max)
    code = moed_failf(err, GRPC_STATUS_RESOURCE_EXHAUSTED,
                      "name: %d regions are registered, the most --shm-max-regions allows", s->max);
  else if (r)
    s->r[s->n++] = r;
  pthread_mutex_unlock(&s->mu);
  return code;
}

/* The checks of both kinds before anything is opened (name, byte_size, the name free and room left). */
static grpc_status_code precheck(moed_shm *s, const char *name, uint64_t byte_size, char *err) {
  if (!moed_model_name_ok(name))
    return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid region name (%s)",
                      MOED_MODEL_NAME_RULE);
  if (byte_size == 0) return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "byte_size: must be > 0");
  return admit(s, name, NULL, err);
}

grpc_status_code moed_shm_register(moed_shm *s, const char *name, const char *key, uint64_t offset,
                                   uint64_t byte_size, char *err) {
  grpc_status_code code = precheck(s, name, byte_size, err);
  if (code) return code;
  if (!key_ok(key))
    return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "key: not a valid shared memory key (%s)",
                      MOED_SHM_KEY_RULE);
  moed_shm_region *r = NULL;
  if ((code = map_region(name, key, offset, byte_size, &r, err))) return code;
  if ((code = admit(s, name, r, err))) moed_shm_release(r); /* mapped outside the lock */
  return code;
}

grpc_status_code moed_shm_register_cuda(moed_shm *s, const char *name, const uint8_t *handle,
                                        size_t handle_len, int64_t device_id, uint64_t byte_size, int gpus,
                                        char *err) {
  grpc_status_code code = precheck(s, name, byte_size, err);
  if (code) return code;
  if (handle_len != MOE_IPC_HANDLE_BYTES)
    return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT,
                      "raw_handle: %zu bytes, a CUDA IPC handle (cudaIpcMemHandle_t) has %d", handle_len,
                      MOE_IPC_HANDLE_BYTES);
  if (!moe_ipc_supported())
    return moed_failf(err, GRPC_STATUS_UNIMPLEMENTED,
                      "CUDA shared memory needs a GPU build of moed (this one has no GPU backend): register "
                      "the tensors' host memory with SystemSharedMemoryRegister instead");
  if (gpus <= 0)
    return moed_failf(err, GRPC_STATUS_FAILED_PRECONDITION,
                      "device_id: moed runs on no GPU (--device cpu, or no GPU found at start): register the "
                      "tensors' host memory with SystemSharedMemoryRegister instead");
  if (device_id < 0 || device_id >= gpus)
    return moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "device_id: %lld is not a GPU moed runs on (0..%d)",
                      (long long)device_id, gpus - 1);
  moed_shm_region *r = calloc(1, sizeof *r);
  if (!r) return moed_failf(err, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
  moe_error e = {{0}};
  void *p = NULL;
  size_t len = 0;
  moe_status st = moe_ipc_open((int)device_id, handle, &p, &len, &e);
  if (st) {
    free(r);
    return moed_failf(err, st == MOE_EINVAL ? GRPC_STATUS_INVALID_ARGUMENT : GRPC_STATUS_INTERNAL,
                      "raw_handle: cannot open it on GPU %lld: %s", (long long)device_id, e.msg);
  }
  r->map = r->base = p;
  r->map_len = len;
  atomic_init(&r->refs, 1); /* the registry's */
  r->info.kind = MOED_SHM_CUDA;
  r->info.device_id = (int)device_id;
  r->info.byte_size = byte_size;
  snprintf(r->info.name, sizeof r->info.name, "%s", name);
  if (byte_size > len)
    code = moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT,
                      "byte_size: %llu is past the end of the allocation the handle names (%zu bytes)",
                      (unsigned long long)byte_size, len);
  if (code || (code = admit(s, name, r, err))) moed_shm_release(r); /* opened outside the lock */
  return code;
}

/* Whether region r is one that an unregister or status of `kind` and `name` (NULL or "": any) means. */
static bool named(const moed_shm_region *r, moed_shm_kind kind, const char *name) {
  return (kind == MOED_SHM_ANY || r->info.kind == kind) &&
         (!name || !*name || strcmp(r->info.name, name) == 0);
}

void moed_shm_unregister(moed_shm *s, moed_shm_kind kind, const char *name) {
  moed_shm_region *gone[64];
  for (;;) { /* in rounds: references are dropped outside the lock (munmap) */
    size_t n = 0;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->n && n < sizeof gone / sizeof gone[0];) {
      if (!named(s->r[i], kind, name)) {
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

long moed_shm_status(moed_shm *s, moed_shm_kind kind, const char *name, moed_shm_info **out) {
  pthread_mutex_lock(&s->mu);
  moed_shm_info *v = malloc((s->n ? (size_t)s->n : 1) * sizeof *v);
  long n = 0;
  for (int i = 0; v && i < s->n; i++)
    if (named(s->r[i], kind, name)) v[n++] = s->r[i]->info;
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

moed_shm_kind moed_shm_region_kind(const moed_shm_region *r) { return r->info.kind; }

/* One copy between region r's [offset, offset + n) and host memory at
 * `host` (to_region: host -> region), bounds checked again here. */
static grpc_status_code region_copy(const moed_shm_region *r, uint64_t offset, void *host, size_t n,
                                    bool to_region, char why[MOED_ERR_LEN]) {
  uint8_t *at = moed_shm_span(r, offset, n);
  if (!at) {
    snprintf(why, MOED_ERR_LEN, "bytes [%llu, +%zu) run past the end of region '%s' (%llu bytes)",
             (unsigned long long)offset, n, r->info.name, (unsigned long long)r->info.byte_size);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if (n == 0) return GRPC_STATUS_OK;
  if (r->info.kind == MOED_SHM_CUDA) {
    moe_error e = {{0}};
    moe_status st = to_region ? moe_ipc_write(r->info.device_id, at, host, n, &e)
                              : moe_ipc_read(r->info.device_id, host, at, n, &e);
    if (st)
      snprintf(why, MOED_ERR_LEN, "the copy %s CUDA shared memory region '%.128s' failed: %.400s",
               to_region ? "into" : "from", r->info.name, e.msg);
    return st ? GRPC_STATUS_INTERNAL : GRPC_STATUS_OK;
  }
  if (!(to_region ? moed_shm_copy(at, host, n) : moed_shm_copy(host, at, n))) {
    snprintf(why, MOED_ERR_LEN, "its shared memory region is no longer backed (the object was truncated)");
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  return GRPC_STATUS_OK;
}

grpc_status_code moed_shm_read(const moed_shm_region *r, uint64_t offset, void *dst, size_t n,
                               char why[MOED_ERR_LEN]) {
  return region_copy(r, offset, dst, n, false, why);
}

grpc_status_code moed_shm_write(const moed_shm_region *r, uint64_t offset, const void *src, size_t n,
                                char why[MOED_ERR_LEN]) {
  return region_copy(r, offset, (void *)src, n, true, why);
}
