/* upload: moe.v1.ExpertStore.Upload, a client-streamed expert set.
 *
 * First message: header (name, config.json, replace); then chunks of
 * tensors in order, each tensor announced by a TensorHeader on its first
 * chunk. Each tensor is streamed into its own safetensors file (the header
 * is known from the TensorHeader, so nothing is buffered) in a hidden
 * directory of the model repository (a temporary directory when moed has
 * none); when the client closes, the directory is loaded and checked as any
 * expert set, moved to its name and served. The reply carries the name,
 * the tensor bytes and their XXH3-64 (in upload order).
 *
 * File writes block, so every message is processed on libuv's thread pool;
 * the stream is paced (the next message is read once this one is written),
 * which bounds memory to one chunk per upload. An upload whose client sends
 * nothing for --idle-timeout is ended (DEADLINE_EXCEEDED): each holds one of
 * --max-uploads and its bytes of the budget, which a client that stalls
 * (without a deadline, with its connection kept alive) held for good. */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "expert_store.pb-c.h"
#include "kserve_wire.h"
#include "moe/safetensors.h"
#include "moed.h"

/* The list of uploads (s->uploads) is the loop's, but on_header reads the
 * other uploads' names on a pool thread: changes to the list and to a name
 * are made under this lock. */
static pthread_mutex_t names_mu = PTHREAD_MUTEX_INITIALIZER;

typedef struct moed_upload {
  struct moed_upload *next;
  moed_server *srv;
  moed_rpc *rpc;
  uv_work_t work;
  moed_request *cur; /* the message being processed */
  uv_timer_t idle;   /* with a call: runs while the next message is awaited */
  bool idle_expired; /* it fired: the call was ended for it */

  bool have_header;
  char name[128];
  bool replace;
  bool chunk_offsets, tensor_xxh3; /* the header's integrity options */
  char *config_json;
  char dir[PATH_MAX]; /* where the files are written; "" until created */
  int fd;             /* the current tensor's file, -1 between tensors */
  char tensor[32];
  uint64_t left; /* bytes of the current tensor still to come */
  uint64_t size; /* the current tensor's nbytes */
  bool check_xxh3;
  uint64_t want_xxh3;        /* the client's XXH3-64 of the current tensor */
  XXH3_state_t *tensor_hash; /* of the bytes of the current tensor so far */
  bool seen[MOE_EXPERT_TENSOR_COUNT];
  uint64_t total;
  uint64_t reserved; /* in srv->upload_bytes: the announced tensors' bytes */
  XXH3_state_t *hash;

  bool done; /* answered: code, msg */
  grpc_status_code code;
  char msg[600];
  grpc_byte_buffer *response;
} moed_upload;

/* Who uploads, for the log ("memory": no call, the fuzz target's). */
static const char *upload_peer(const moed_upload *u) { return u->rpc ? moed_rpc_peer(u->rpc) : "memory"; }

static bool upload_fail(moed_upload *u, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool upload_fail(moed_upload *u, grpc_status_code code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(u->msg, sizeof u->msg, fmt, ap);
  va_end(ap);
  /* the client learns no server path: its upload's files by their names */
  moed_msg_relative(u->msg, sizeof u->msg, u->dir, "upload");
  moed_msg_relative(u->msg, sizeof u->msg, u->srv->cfg->model_repository, "model repository");
  u->code = code;
  u->done = true;
  return false;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  remove(path);
  return 0;
}

static void remove_tree(const char *dir) {
  if (*dir) nftw(dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
}

static bool write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    b += w;
    n -= (size_t)w;
  }
  return true;
}

/* ---- messages ---------------------------------------------------------------------- */

static bool on_header(moed_upload *u, const Moe__V1__UploadHeader *h) {
  moed_server *s = u->srv;
  if (u->have_header) return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "header: sent twice");
  if (!moed_model_name_ok(h->name))
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "header.name: not a valid model name (%s)",
                       MOED_MODEL_NAME_RULE);
  moe_expert_config cfg;
  moe_error err = {{0}};
  if (moe_expert_config_parse(h->config_json, &cfg, &err) != MOE_OK)
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "header.config_json: %s", err.msg);
  moed_model *m = moed_repository_acquire(s->repo, h->name);
  bool builtin = m && m->builtin, exists = m != NULL;
  moed_model_release(m);
  if (builtin)
    return upload_fail(u, GRPC_STATUS_ALREADY_EXISTS, "header.name: '%s' is a built-in model", h->name);
  if (exists && !h->replace)
    return upload_fail(u, GRPC_STATUS_ALREADY_EXISTS,
                       "header.name: model '%s' exists (set replace to replace it)", h->name);
  /* one upload per name at a time: two would race for the rename into the
   * repository (the loser failed with INTERNAL before); the name is held
   * until this upload ends */
  pthread_mutex_lock(&names_mu);
  bool busy = false;
  for (const moed_upload *v = s->uploads; v && !busy; v = v->next)
    busy = v != u && strcmp(v->name, h->name) == 0;
  if (!busy) snprintf(u->name, sizeof u->name, "%s", h->name);
  pthread_mutex_unlock(&names_mu);
  if (busy)
    return upload_fail(u, GRPC_STATUS_ABORTED,
                       "header.name: another upload of '%s' is in progress; retry later", h->name);
  u->replace = h->replace;
  u->chunk_offsets = h->chunk_offsets;
  u->tensor_xxh3 = h->tensor_xxh3;
  if (!(u->config_json = strdup(h->config_json)))
    return upload_fail(u, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
  /* hidden inside the repository (the loaders skip dot names), so the
   * final rename stays on one file system */
  const char *base = s->cfg->model_repository;
  const char *tmp = getenv("TMPDIR");
  int n = base ? snprintf(u->dir, sizeof u->dir, "%s/.upload-XXXXXX", base)
               : snprintf(u->dir, sizeof u->dir, "%s/moed-upload-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (n < 0 || (size_t)n >= sizeof u->dir || !mkdtemp(u->dir) || chmod(u->dir, 0755) != 0) {
    u->dir[0] = 0;
    return upload_fail(u, GRPC_STATUS_INTERNAL, "cannot create an upload directory: %s", strerror(errno));
  }
  u->have_header = true;
  return true;
}

/* Opens the tensor's file and writes its safetensors header. */
static bool start_tensor(moed_upload *u, const Moe__V1__TensorHeader *t) {
  int slot = -1;
  for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++)
    if (strcmp(moe_expert_tensor_names[i], t->name) == 0) slot = i;
  if (slot < 0)
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "chunk.tensor.name: '%s' is not an expert-set tensor",
                       t->name);
  if (u->seen[slot])
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "chunk.tensor.name: '%s' sent twice", t->name);
  moe_dtype dt = moe_dtype_from_name(t->dtype);
  const char *st = moe_safetensors_dtype_name(dt);
  if (!st)
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT,
                       "chunk.tensor.dtype: '%s' not supported (tensor '%s')", t->dtype, t->name);
  if (t->n_shape < 1 || t->n_shape > MOE_MAX_DIMS)
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "chunk.tensor.shape: rank %zu (tensor '%s'), 1..%d",
                       t->n_shape, t->name, MOE_MAX_DIMS);
  size_t numel = 1, bytes;
  for (size_t d = 0; d < t->n_shape; d++)
    if (t->shape[d] < 0 || !moe_mul_size(numel, (size_t)t->shape[d], &numel))
      return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT,
                         "chunk.tensor.shape: dim %zu of '%s' negative or overflowing", d, t->name);
  if (!moe_mul_size(numel, moe_dtype_bits(dt) / 8, &bytes) || bytes != t->nbytes)
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT,
                       "chunk.tensor.nbytes: %llu for '%s', shape and dtype need %zu",
                       (unsigned long long)t->nbytes, t->name, bytes);
  uint64_t total;
  if (__builtin_add_overflow(u->total, t->nbytes, &total) || total > u->srv->cfg->max_upload_bytes)
    return upload_fail(u, GRPC_STATUS_RESOURCE_EXHAUSTED,
                       "chunk.tensor.nbytes: upload exceeds the limit of %zu bytes",
                       u->srv->cfg->max_upload_bytes);
  /* all uploads in progress together: each announced tensor is reserved
   * against --upload-budget-bytes until its upload ends */
  const uint64_t held = atomic_fetch_add(&u->srv->upload_bytes, t->nbytes);
  if (held + t->nbytes > u->srv->cfg->upload_budget_bytes) { /* both within 2^63: no overflow */
    atomic_fetch_sub(&u->srv->upload_bytes, t->nbytes);
    return upload_fail(
        u, GRPC_STATUS_RESOURCE_EXHAUSTED,
        "chunk.tensor.nbytes: the uploads in progress would hold more than --upload-budget-bytes "
        "(%zu bytes); retry later",
        u->srv->cfg->upload_budget_bytes);
  }
  u->reserved += t->nbytes;

  moe_named_tensor desc = {t->name, {dt, (int)t->n_shape, {0}, NULL, (size_t)t->nbytes}};
  for (size_t d = 0; d < t->n_shape; d++)
    desc.tensor.shape[d] = t->shape[d];
  size_t n = 0;
  char *json = moe_safetensors_header(&desc, &n);
  if (!json) return upload_fail(u, GRPC_STATUS_RESOURCE_EXHAUSTED, "tensor '%s': out of memory", t->name);
  uint8_t len[8];
  for (int i = 0; i < 8; i++)
    len[i] = (uint8_t)((uint64_t)n >> (8 * i));

  char path[PATH_MAX + 64];
  snprintf(path, sizeof path, "%s/%s.safetensors", u->dir, t->name);
  u->fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  const bool written = u->fd >= 0 && write_all(u->fd, len, 8) && write_all(u->fd, json, n);
  free(json);
  if (!written) return upload_fail(u, GRPC_STATUS_INTERNAL, "cannot write %s: %s", path, strerror(errno));
  u->seen[slot] = true;
  snprintf(u->tensor, sizeof u->tensor, "%s", t->name);
  u->left = u->size = t->nbytes;
  u->check_xxh3 = u->tensor_xxh3;
  u->want_xxh3 = t->xxh3;
  XXH3_64bits_reset(u->tensor_hash);
  u->total = total;
  return true;
}

static bool end_tensor(moed_upload *u) {
  int fd = u->fd;
  u->fd = -1;
  if (close(fd) != 0)
    return upload_fail(u, GRPC_STATUS_INTERNAL, "cannot write tensor '%s': %s", u->tensor, strerror(errno));
  const uint64_t got = XXH3_64bits_digest(u->tensor_hash);
  if (u->check_xxh3 && got != u->want_xxh3) /* nothing of this upload is stored */
    return upload_fail(u, GRPC_STATUS_DATA_LOSS,
                       "chunk.tensor.xxh3: tensor '%s' arrived with XXH3-64 %016llx, the client sent %016llx",
                       u->tensor, (unsigned long long)got, (unsigned long long)u->want_xxh3);
  return true;
}

static bool on_chunk(moed_upload *u, const Moe__V1__UploadChunk *c) {
  if (!u->have_header)
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "header: the first message must be the header");
  if (c->tensor) {
    if (u->fd >= 0)
      return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT,
                         "chunk.tensor: '%s' starts with %llu bytes of '%s' missing", c->tensor->name,
                         (unsigned long long)u->left, u->tensor);
    if (!start_tensor(u, c->tensor)) return false;
  }
  if (u->chunk_offsets && (u->fd < 0 || c->offset != u->size - u->left))
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT,
                       "chunk.offset: %llu, but tensor '%s' has %llu bytes so far (a chunk lost, repeated or "
                       "out of order)",
                       (unsigned long long)c->offset, u->fd < 0 ? "(none)" : u->tensor,
                       (unsigned long long)(u->fd < 0 ? 0 : u->size - u->left));
  if (c->data.len == 0) goto check_end;
  if (u->fd < 0)
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT,
                       "chunk.data: no tensor started (chunk.tensor missing)");
  if (c->data.len > u->left)
    return upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "chunk.data: %zu bytes, tensor '%s' has %llu left",
                       c->data.len, u->tensor, (unsigned long long)u->left);
  if (!write_all(u->fd, c->data.data, c->data.len))
    return upload_fail(u, GRPC_STATUS_INTERNAL, "cannot write tensor '%s': %s", u->tensor, strerror(errno));
  XXH3_64bits_update(u->hash, c->data.data, c->data.len);
  XXH3_64bits_update(u->tensor_hash, c->data.data, c->data.len);
  u->left -= c->data.len;
check_end:
  if (u->fd >= 0 && u->left == 0) return end_tensor(u);
  return true;
}

/* The client closed: load what was written, move it in place, serve it. */
static void commit(moed_upload *u) {
  moed_server *s = u->srv;
  if (!u->have_header) {
    upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "header: missing (no message sent)");
    return;
  }
  if (u->fd >= 0) {
    upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "chunk.data: stream ended with %llu bytes of '%s' missing",
                (unsigned long long)u->left, u->tensor);
    return;
  }
  char path[PATH_MAX + 64];
  snprintf(path, sizeof path, "%s/config.json", u->dir);
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  bool ok = fd >= 0 && write_all(fd, u->config_json, strlen(u->config_json));
  if (fd >= 0 && close(fd) != 0) ok = false;
  if (!ok) {
    upload_fail(u, GRPC_STATUS_INTERNAL, "cannot write %s: %s", path, strerror(errno));
    return;
  }
  moe_expert_set *set = NULL;
  moe_error err = {{0}};
  moe_status st = moe_expert_set_load(u->dir, u->name, &set, &err);
  if (st != MOE_OK) { /* a bad tensor or config: the client's mistake */
    upload_fail(u, st == MOE_ENOMEM ? GRPC_STATUS_RESOURCE_EXHAUSTED : GRPC_STATUS_INVALID_ARGUMENT, "%s",
                err.msg);
    return;
  }
  /* the set is mapped: its files may move (repository) or go (no repository) */
  if (s->cfg->model_repository) {
    char target[PATH_MAX + 200];
    snprintf(target, sizeof target, "%s/%s", s->cfg->model_repository, u->name);
    unsigned flags = u->replace ? RENAME_EXCHANGE : RENAME_NOREPLACE;
    int rc = renameat2(AT_FDCWD, u->dir, AT_FDCWD, target, flags);
    if (rc != 0 && u->replace && errno == ENOENT)
      rc = rename(u->dir, target); /* nothing to exchange with */
    else if (rc == 0 && u->replace) {
      remove_tree(u->dir); /* now holds the replaced set's files */
    }
    if (rc != 0) {
      int e = errno;
      moe_expert_set_destroy(set);
      if (e == EEXIST || e == ENOTEMPTY) /* a directory of that name appeared meanwhile */
        upload_fail(u, GRPC_STATUS_ALREADY_EXISTS,
                    "header.name: '%s' exists in the model repository (set replace)", u->name);
      else
        upload_fail(u, GRPC_STATUS_INTERNAL, "cannot move the upload to %s: %s", target, strerror(e));
      return;
    }
    u->dir[0] = 0; /* committed: nothing to clean up */
  }
  st = moed_repository_add(s->repo, set, u->replace, &err);
  if (st != MOE_OK) {
    upload_fail(u, st == MOE_EBUSY ? GRPC_STATUS_ALREADY_EXISTS : moed_status_from_moe(st), "%s", err.msg);
    return;
  }
  Moe__V1__UploadResponse r = MOE__V1__UPLOAD_RESPONSE__INIT;
  r.name = u->name;
  r.bytes = u->total;
  r.checksum = XXH3_64bits_digest(u->hash);
  if (!(u->response = moed_rpc_pack(&r.base))) {
    upload_fail(u, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  moed_log(MOED_LOG_INFO, "model_uploaded", "%s: %llu bytes, xxh3 %016llx%s, by %s", u->name,
           (unsigned long long)r.bytes, (unsigned long long)r.checksum, u->replace ? ", replacing" : "",
           upload_peer(u));
  u->code = GRPC_STATUS_OK;
  u->done = true;
}

/* ---- the thread pool and the loop ----------------------------------------------------- */

/* One message of the stream (data NULL: the client closed; cancelled: it
 * went away instead): the state machine's one entry. */
static void upload_message(moed_upload *u, const uint8_t *data, size_t len, bool cancelled) {
  if (!data) {
    if (u->idle_expired)
      upload_fail(u, GRPC_STATUS_DEADLINE_EXCEEDED, "upload: no message for --idle-timeout (%d s)",
                  u->srv->cfg->idle_timeout_s);
    else if (cancelled)
      upload_fail(u, GRPC_STATUS_CANCELLED, "upload cancelled");
    else
      commit(u);
    return;
  }
  char field[96];
  const char *fault =
      moed_wire_bad_string(&moe__v1__upload_request__descriptor, data, len, field, sizeof field);
  if (fault) {
    upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "%s: %s", field, fault);
    return;
  }
  Moe__V1__UploadRequest *m = moe__v1__upload_request__unpack(NULL, len, data);
  if (!m) {
    upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "request: not a valid UploadRequest message");
    return;
  }
  if (m->part_case == MOE__V1__UPLOAD_REQUEST__PART_HEADER)
    on_header(u, m->header);
  else if (m->part_case == MOE__V1__UPLOAD_REQUEST__PART_CHUNK)
    on_chunk(u, m->chunk);
  else
    upload_fail(u, GRPC_STATUS_INVALID_ARGUMENT, "part: neither header nor chunk");
  moe__v1__upload_request__free_unpacked(m, NULL);
}

static void upload_work(uv_work_t *w) {
  moed_upload *u = w->data;
  moed_request *req = u->cur;
  if (!req->payload) return upload_message(u, NULL, 0, moed_rpc_cancelled(u->rpc));
  grpc_slice s = moed_rpc_flatten(req->payload);
  grpc_byte_buffer_destroy(req->payload);
  req->payload = NULL;
  upload_message(u, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s), false);
  grpc_slice_unref(s);
}

/* The client sent nothing for --idle-timeout: the call ends, and the read
 * it completes (as a cancelled one) frees the upload (loop). */
static void on_idle(uv_timer_t *t) {
  moed_upload *u = t->data;
  char why[128];
  snprintf(why, sizeof why, "upload: no message for --idle-timeout (%d s)", u->srv->cfg->idle_timeout_s);
  u->idle_expired = true;
  moed_rpc_end(u->rpc, GRPC_STATUS_DEADLINE_EXCEEDED, why);
}

static void upload_closed(uv_handle_t *h) { free(h->data); }

/* A new upload in s->uploads (rpc: its call, NULL for none); NULL: out of memory. */
static moed_upload *upload_new(moed_server *s, moed_rpc *rpc) {
  moed_upload *u = calloc(1, sizeof *u);
  if (!u || !(u->hash = XXH3_createState()) || !(u->tensor_hash = XXH3_createState())) {
    if (u) XXH3_freeState(u->hash);
    free(u);
    return NULL;
  }
  XXH3_64bits_reset(u->hash);
  u->srv = s;
  u->rpc = rpc;
  u->fd = -1;
  u->work.data = u;
  if (rpc) { /* on the loop; does not keep it running */
    uv_timer_init(s->loop, &u->idle);
    uv_unref((uv_handle_t *)&u->idle);
    u->idle.data = u;
  }
  pthread_mutex_lock(&names_mu);
  u->next = s->uploads;
  s->uploads = u;
  pthread_mutex_unlock(&names_mu);
  return u;
}

static void upload_free(moed_server *s, moed_upload *u) {
  pthread_mutex_lock(&names_mu);
  for (moed_upload **pp = &s->uploads; *pp; pp = &(*pp)->next)
    if (*pp == u) {
      *pp = u->next;
      break;
    }
  pthread_mutex_unlock(&names_mu);
  atomic_fetch_sub(&s->upload_bytes, u->reserved);
  if (u->fd >= 0) close(u->fd);
  remove_tree(u->dir);
  if (u->hash) XXH3_freeState(u->hash);
  if (u->tensor_hash) XXH3_freeState(u->tensor_hash);
  free(u->config_json);
  if (u->rpc)
    uv_close((uv_handle_t *)&u->idle, upload_closed);
  else
    free(u);
}

static void upload_after(uv_work_t *w, int status) {
  moed_upload *u = w->data;
  moed_rpc *rpc = u->cur->rpc;
  moed_request_free(u->cur); /* its chunk is written: before the next is asked for */
  u->cur = NULL;
  if (status != 0 && !u->done) upload_fail(u, GRPC_STATUS_INTERNAL, "upload work failed");
  if (u->done) {
    if (u->code) /* before the finish, which may free the call */
      moed_log(MOED_LOG_INFO, "upload_failed", "%s: %s, by %s", u->name[0] ? u->name : "?", u->msg,
               upload_peer(u));
    moed_rpc_finish(rpc, u->code, u->code ? u->msg : NULL, u->response); /* the hand-off's reference */
    u->response = NULL;
    upload_free(u->srv, u);
  } else {
    uv_timer_start(&u->idle, on_idle, (uint64_t)u->srv->cfg->idle_timeout_s * 1000, 0);
    moed_rpc_read_next(rpc);
    moed_rpc_stream_done(rpc);
  }
}

void moed_upload_handle(moed_server *s, moed_request *req) {
  moed_upload *u = s->uploads;
  while (u && u->rpc != req->rpc)
    u = u->next;
  if (!u) {
    if (atomic_load(&s->draining) || !req->payload) {
      moed_rpc_finish(req->rpc, req->payload ? GRPC_STATUS_UNAVAILABLE : GRPC_STATUS_INVALID_ARGUMENT,
                      req->payload ? "server is shutting down" : "header: missing (no message sent)", NULL);
      moed_request_free(req);
      return;
    }
    if (moed_upload_count(s) >= s->cfg->max_uploads) { /* each holds a thread-pool slot, files and bytes */
      char why[128];
      snprintf(why, sizeof why, "uploads: %d in progress, at most --max-uploads %d; retry later",
               moed_upload_count(s), s->cfg->max_uploads);
      moed_log(MOED_LOG_INFO, "upload_failed", "%s, by %s", why, moed_rpc_peer(req->rpc));
      moed_rpc_finish(req->rpc, GRPC_STATUS_RESOURCE_EXHAUSTED, why, NULL);
      moed_request_free(req);
      return;
    }
    if (!(u = upload_new(s, req->rpc))) {
      moed_rpc_finish(req->rpc, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory", NULL);
      moed_request_free(req);
      return;
    }
  }
  if (u->rpc) uv_timer_stop(&u->idle);
  u->cur = req;
  if (uv_queue_work(s->loop, &u->work, upload_work, upload_after) != 0) {
    upload_fail(u, GRPC_STATUS_INTERNAL, "cannot queue the upload work");
    upload_after(&u->work, 0);
  }
}

int moed_upload_count(const moed_server *s) {
  int n = 0;
  for (const moed_upload *u = s->uploads; u; u = u->next)
    n++;
  return n;
}

/* ---- without a call (fuzz/fuzz_upload.c) ------------------------------------------------ */

moed_upload *moed_upload_open(moed_server *s) { return upload_new(s, NULL); }

bool moed_upload_message(moed_upload *u, const uint8_t *data, size_t len, bool cancelled) {
  if (!u->done) upload_message(u, data, len, cancelled);
  return !u->done;
}

grpc_status_code moed_upload_status(const moed_upload *u, const char **msg) {
  *msg = u->code ? u->msg : "";
  return u->done ? u->code : GRPC_STATUS_UNKNOWN;
}

void moed_upload_close(moed_upload *u) {
  if (u->response) grpc_byte_buffer_destroy(u->response);
  upload_free(u->srv, u);
}
