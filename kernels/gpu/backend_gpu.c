/* The GPU backend: one device, one stream, a caching device memory pool (no
 * device malloc per call in steady state), pinned host staging buffers for
 * the copies. Fills the same struct moe_backend_i (kernels/ops/backend_impl.h)
 * as the CPU backend (kernels/cpu/backend.c). HIP runtime names; hip_compat.h
 * maps them to CUDA on NVIDIA. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../ops/backend_impl.h"
#include "../ops/op.h"
#include "gpu.h"

/* ---- device memory pool ---------------------------------------------------
 * Size classes: four per power of two from 512 B up (at most 25% slack).
 * Freed blocks go back to their class's list and are reused by later allocs;
 * every block lives on the backend's one stream, so a block reused after a
 * free is ordered after the work that used it. */

#define POOL_CLASSES (4 * 64)
#define STAGE_CHUNK ((size_t)16 << 20)

typedef struct pool_node {
  void *ptr;
  struct pool_node *next;
} pool_node;

typedef struct live_slot {
  void *ptr; /* NULL: empty */
  int cls;
} live_slot;

/* Device copies of one loaded expert set (moe_gpu_set_weights). The entry
 * holds a reference to the set: gpu_trim frees both once it is the last. */
typedef struct set_entry {
  moe_expert_set *set;
  void *dev[MOE_EXPERT_TENSOR_COUNT];
  size_t bytes; /* pool bytes of dev[] */
  struct set_entry *next;
} set_entry;

/* Packed copies of one inline-weight set (moe_gpu_inline_packed): keyed by
 * the source device buffers and the configuration that packed them. */
typedef struct packed_entry {
  void *src[MOE_EXPERT_TENSOR_COUNT];
  size_t src_bytes[MOE_EXPERT_TENSOR_COUNT];
  moe_expert_config cfg;
  moe_dtype scale_dt[2];
  void *dst[MOE_EXPERT_TENSOR_COUNT];
  size_t bytes; /* pool bytes of dst[] */
  struct packed_entry *next;
} packed_entry;

/* A device -> host copy queued by gpu_copy_out_async: its bytes wait at
 * stage[1] + off until the host copies them to dst (pending_finish, or
 * copies_finish for its group). Groups (moe_backend_copy_out_end) take the
 * halves of stage[1] in turn, so that a caller can complete one call's
 * copies while the next call's are queued behind them: group g lives in
 * half g & 1, and an ended group is finished before a later group of its
 * parity gets copies or its event. */
typedef struct pending_out {
  void *dst;
  size_t off, len;
  uint64_t group;
} pending_out;
#define PENDING_MAX 16 /* copies queued at once; more: the first ones are completed */

typedef struct gpu_ctx {
  int device;
  int sm_count;
  int cc_major; /* compute capability (NVIDIA) or gfx major (AMD) */
  hipStream_t stream;
  pool_node *free_list[POOL_CLASSES];
  live_slot *live; /* open addressing, power-of-two capacity */
  size_t live_cap, live_count;
  size_t pool_bytes; /* held from the device, in use or cached */
  void *ws;          /* workspace, from the pool */
  size_t ws_size;
  void *stage[2]; /* pinned host staging: STAGE_CHUNK, and stage[1] two halves of it */
  hipEvent_t stage_done[2];
  pending_out pending[PENDING_MAX]; /* into stage[1], in stream (and group) order */
  int n_pending;
  size_t half_end[2];       /* bytes of each half of stage[1] the pending copies use */
  uint64_t group;           /* the open group: gpu_copy_out_async's copies join it */
  uint64_t done;            /* every group <= done is complete */
  hipEvent_t group_done[2]; /* the end of the last ended group of each parity */
  set_entry *sets;          /* a short list: a worker serves a few sets */
  packed_entry *packed;     /* most recently used first, at most MOE_GPU_PACKED_INLINE */
  size_t resident;          /* pool bytes of sets and packed entries */
  moe_backend_memory shown; /* resident and pool_bytes for other threads (__atomic) */
} gpu_ctx;

moe_status moe_gpu_check(hipError_t e, const char *what, moe_error *err) {
  if (e == hipSuccess) return MOE_OK;
  return moe_fail(err, MOE_EDEVICE, "%s: %s", what, hipGetErrorString(e));
}

/* Bytes of size class cls (the inverse of size_class). */
static size_t class_bytes(int cls) {
  const int p = cls / 4, q = cls % 4;
  return ((size_t)1 << p) + (p >= 2 ? ((size_t)1 << (p - 2)) * (size_t)q : 0);
}

static int size_class(size_t n, size_t *bytes) {
  size_t want = n < 512 ? 512 : n;
  int p = 63 - __builtin_clzll((unsigned long long)want); /* 2^p <= want */
  for (int q = 0; q < 4; q++)
    if (class_bytes(4 * p + q) >= want) {
      *bytes = class_bytes(4 * p + q);
      return 4 * p + q;
    }
  if (p + 1 >= 64) return -1;
  *bytes = class_bytes(4 * (p + 1));
  return 4 * (p + 1);
}

static size_t hash_ptr(const void *p, size_t cap) {
  uint64_t x = (uint64_t)(uintptr_t)p;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return (size_t)x & (cap - 1);
}

static moe_status live_insert(gpu_ctx *ctx, void *ptr, int cls);

static moe_status live_grow(gpu_ctx *ctx) {
  size_t ncap = ctx->live_cap ? ctx->live_cap * 2 : 256;
  live_slot *old = ctx->live;
  size_t ocap = ctx->live_cap;
  ctx->live = calloc(ncap, sizeof *ctx->live);
  if (!ctx->live) {
    ctx->live = old;
    return MOE_ENOMEM;
  }
  ctx->live_cap = ncap;
  ctx->live_count = 0;
  for (size_t i = 0; i < ocap; i++)
    if (old[i].ptr) live_insert(ctx, old[i].ptr, old[i].cls);
  free(old);
  return MOE_OK;
}

static moe_status live_insert(gpu_ctx *ctx, void *ptr, int cls) {
  if ((ctx->live_count + 1) * 2 > ctx->live_cap) {
    moe_status s = live_grow(ctx);
    if (s) return s;
  }
  size_t i = hash_ptr(ptr, ctx->live_cap);
  while (ctx->live[i].ptr)
    i = (i + 1) & (ctx->live_cap - 1);
  ctx->live[i].ptr = ptr;
  ctx->live[i].cls = cls;
  ctx->live_count++;
  return MOE_OK;
}

/* The slot holding ptr; SIZE_MAX when ptr is not a live block of this pool. */
static size_t live_find(const gpu_ctx *ctx, const void *ptr) {
  if (!ptr || !ctx->live_cap) return SIZE_MAX;
  size_t i = hash_ptr(ptr, ctx->live_cap);
  while (ctx->live[i].ptr && ctx->live[i].ptr != ptr)
    i = (i + 1) & (ctx->live_cap - 1);
  return ctx->live[i].ptr ? i : SIZE_MAX;
}

/* Removes ptr; its class, or -1 when ptr is not a live block of this pool. */
static int live_remove(gpu_ctx *ctx, void *ptr) {
  const size_t i = live_find(ctx, ptr);
  if (i == SIZE_MAX) return -1;
  int cls = ctx->live[i].cls;
  ctx->live[i].ptr = NULL;
  ctx->live_count--;
  /* re-seat the rest of the cluster (linear probing deletion) */
  for (size_t j = (i + 1) & (ctx->live_cap - 1); ctx->live[j].ptr; j = (j + 1) & (ctx->live_cap - 1)) {
    live_slot s = ctx->live[j];
    ctx->live[j].ptr = NULL;
    ctx->live_count--;
    live_insert(ctx, s.ptr, s.cls);
  }
  return cls;
}

/* The counters other threads read (moe_backend_memory_get). */
static void publish(gpu_ctx *ctx) {
  __atomic_store_n(&ctx->shown.resident, ctx->resident, __ATOMIC_RELAXED);
  __atomic_store_n(&ctx->shown.held, ctx->pool_bytes, __ATOMIC_RELAXED);
}

/* Returns every cached (free) block to the device. */
static void pool_trim(gpu_ctx *ctx) {
  hipStreamSynchronize(ctx->stream);
  for (int c = 0; c < POOL_CLASSES; c++) {
    while (ctx->free_list[c]) {
      pool_node *n = ctx->free_list[c];
      ctx->free_list[c] = n->next;
      hipFree(n->ptr);
      ctx->pool_bytes -= class_bytes(c);
      free(n);
    }
  }
  publish(ctx);
}

static moe_status gpu_alloc(moe_backend *b, size_t nbytes, void **out) {
  gpu_ctx *ctx = b->context;
  size_t sz;
  int cls = size_class(nbytes, &sz);
  if (cls < 0 || cls >= POOL_CLASSES) return MOE_EOVERFLOW;
  void *p = NULL;
  if (ctx->free_list[cls]) {
    pool_node *n = ctx->free_list[cls];
    ctx->free_list[cls] = n->next;
    p = n->ptr;
    free(n);
  } else {
    if (hipSetDevice(ctx->device) != hipSuccess) return MOE_EDEVICE;
    if (hipMalloc(&p, sz) != hipSuccess) {
      hipGetLastError();
      pool_trim(ctx);
      if (hipMalloc(&p, sz) != hipSuccess) {
        hipGetLastError();
        return MOE_ENOMEM;
      }
    }
    ctx->pool_bytes += sz;
    publish(ctx);
  }
  if (live_insert(ctx, p, cls) != MOE_OK) {
    hipFree(p);
    return MOE_ENOMEM;
  }
  *out = p;
  return MOE_OK;
}

/* Returns a block to the pool (the backend's own blocks: workspace, set
 * copies, packed copies); gpu_free is the API's free. */
static void pool_free(moe_backend *b, void *ptr) {
  gpu_ctx *ctx = b->context;
  if (!ptr) return;
  int cls = live_remove(ctx, ptr);
  if (cls < 0) return; /* not ours */
  pool_node *n = malloc(sizeof *n);
  if (!n) { /* cannot cache it: give it back */
    hipStreamSynchronize(ctx->stream);
    hipFree(ptr);
    ctx->pool_bytes -= class_bytes(cls);
    publish(ctx);
    return;
  }
  n->ptr = ptr;
  n->next = ctx->free_list[cls];
  ctx->free_list[cls] = n;
}

void *moe_gpu_workspace(moe_backend *b, size_t bytes) {
  gpu_ctx *ctx = b->context;
  if (bytes <= ctx->ws_size && ctx->ws) return ctx->ws;
  void *p;
  if (gpu_alloc(b, bytes, &p) != MOE_OK) return NULL;
  if (ctx->ws) pool_free(b, ctx->ws); /* stream-ordered reuse: safe */
  ctx->ws = p;
  ctx->ws_size = bytes;
  return p;
}

hipStream_t moe_gpu_stream(moe_backend *b) { return ((gpu_ctx *)b->context)->stream; }
int moe_gpu_sm_count(const moe_backend *b) { return ((const gpu_ctx *)b->context)->sm_count; }
int moe_gpu_cc_major(const moe_backend *b) { return ((const gpu_ctx *)b->context)->cc_major; }
const char *moe_gpu_device_name(const moe_backend *b) {
  const char *p = strstr(b->name, ": "); /* the backend's name is "gpuN: <device name>" */
  return p ? p + 2 : b->name;
}

moe_status moe_gpu_enter(moe_backend *b, moe_error *err) {
  return moe_gpu_check(hipSetDevice(((gpu_ctx *)b->context)->device), "hipSetDevice", err);
}

/* ---- copies through pinned staging ----------------------------------------
 * Pageable host memory cannot be copied asynchronously; two pinned chunks
 * alternate so that the host memcpy of one overlaps the DMA of the other. */

static void packed_drop_overlapping(moe_backend *b, const void *p, size_t n);

/* Completes the queued device -> host copies: waits for the last (or not,
 * `synced`: the stream is idle) and copies their bytes out of stage[1].
 * Every use of stage[1]'s first STAGE_CHUNK bytes by the chunked copies
 * comes after it. */
static moe_status pending_finish(gpu_ctx *ctx, bool synced) {
  ctx->done = ctx->group - 1;
  if (!ctx->n_pending) return MOE_OK;
  const bool ok = synced || hipEventSynchronize(ctx->stage_done[1]) == hipSuccess;
  for (int i = 0; ok && i < ctx->n_pending; i++)
    memcpy(ctx->pending[i].dst, (const char *)ctx->stage[1] + ctx->pending[i].off, ctx->pending[i].len);
  ctx->n_pending = 0;
  ctx->half_end[0] = ctx->half_end[1] = 0;
  return ok ? MOE_OK : MOE_EDEVICE;
}

/* Completes the copies of ended group g and of every group before it:
 * waits for g's end on the stream only, not for the work queued after. */
static moe_status copies_finish(gpu_ctx *ctx, uint64_t g) {
  if (g <= ctx->done) return MOE_OK;
  /* failed: the copies are dropped all the same (their bytes never came;
   * their buffers may be freed once the caller has the error) */
  const bool ok = hipEventSynchronize(ctx->group_done[g & 1]) == hipSuccess;
  int kept = 0;
  ctx->half_end[0] = ctx->half_end[1] = 0;
  for (int i = 0; i < ctx->n_pending; i++) {
    const pending_out *q = &ctx->pending[i];
    if (q->group <= g) {
      if (ok) memcpy(q->dst, (const char *)ctx->stage[1] + q->off, q->len);
      continue;
    }
    const int h = (int)(q->group & 1);
    const size_t end = q->off - (size_t)h * STAGE_CHUNK + q->len, aligned = (end + 255) & ~(size_t)255;
    if (aligned > ctx->half_end[h]) ctx->half_end[h] = aligned < STAGE_CHUNK ? aligned : STAGE_CHUNK;
    ctx->pending[kept++] = *q;
  }
  ctx->n_pending = kept;
  ctx->done = g;
  return ok ? MOE_OK : MOE_EDEVICE;
}

static moe_status gpu_copy_in(moe_backend *b, void *dst, const void *src, size_t n) {
  gpu_ctx *ctx = b->context;
  /* stage[1] only from the second chunk on: a copy of one chunk does not
   * wait for the copies queued out of it (a call staged under the last) */
  moe_status s = n > STAGE_CHUNK ? pending_finish(ctx, false) : MOE_OK;
  if (s) return s;
  packed_drop_overlapping(b, dst, n);
  for (size_t off = 0, k = 0; off < n; off += STAGE_CHUNK, k++) {
    int i = (int)(k & 1);
    size_t len = n - off < STAGE_CHUNK ? n - off : STAGE_CHUNK;
    if (hipEventSynchronize(ctx->stage_done[i]) != hipSuccess) return MOE_EDEVICE;
    memcpy(ctx->stage[i], (const char *)src + off, len);
    if (hipMemcpyAsync((char *)dst + off, ctx->stage[i], len, hipMemcpyHostToDevice, ctx->stream) !=
        hipSuccess)
      return MOE_EDEVICE;
    if (hipEventRecord(ctx->stage_done[i], ctx->stream) != hipSuccess) return MOE_EDEVICE;
  }
  return MOE_OK;
}

/* Small inputs of one call at once: one host copy into stage[0] and one
 * transfer of their span (a call's inputs otherwise cost a transfer each,
 * and the second waited for the first to leave stage[0]). Larger spans go
 * piece by piece through gpu_copy_in's double buffering. */
static moe_status gpu_copy_in_gather(moe_backend *b, void *dst, const void *const src[], const size_t off[],
                                     const size_t nbytes[], size_t n) {
  gpu_ctx *ctx = b->context;
  size_t span = 0;
  for (size_t i = 0; i < n; i++) { /* increasing, not overlapping: the span is the last end */
    if (off[i] < span || nbytes[i] > SIZE_MAX - off[i]) return MOE_EINVAL;
    span = off[i] + nbytes[i];
  }
  if (n < 2 || span > STAGE_CHUNK) {
    for (size_t i = 0; i < n; i++) {
      moe_status s = gpu_copy_in(b, (char *)dst + off[i], src[i], nbytes[i]);
      if (s) return s;
    }
    return MOE_OK;
  }
  packed_drop_overlapping(b, dst, span); /* stage[0] only: nothing waits for stage[1] */
  if (hipEventSynchronize(ctx->stage_done[0]) != hipSuccess) return MOE_EDEVICE;
  for (size_t i = 0; i < n; i++)
    memcpy((char *)ctx->stage[0] + off[i], src[i], nbytes[i]);
  if (hipMemcpyAsync(dst, ctx->stage[0], span, hipMemcpyHostToDevice, ctx->stream) != hipSuccess)
    return MOE_EDEVICE;
  return hipEventRecord(ctx->stage_done[0], ctx->stream) == hipSuccess ? MOE_OK : MOE_EDEVICE;
}

/* Completes before returning: dst is filled. */
static moe_status gpu_copy_out(moe_backend *b, void *dst, const void *src, size_t n) {
  gpu_ctx *ctx = b->context;
  moe_status s = pending_finish(ctx, false);
  if (s) return s;
  size_t prev_off = 0, prev_len = 0;
  int prev = -1;
  for (size_t off = 0, k = 0; off < n; off += STAGE_CHUNK, k++) {
    int i = (int)(k & 1);
    size_t len = n - off < STAGE_CHUNK ? n - off : STAGE_CHUNK;
    if (hipEventSynchronize(ctx->stage_done[i]) != hipSuccess) return MOE_EDEVICE;
    if (hipMemcpyAsync(ctx->stage[i], (const char *)src + off, len, hipMemcpyDeviceToHost, ctx->stream) !=
        hipSuccess)
      return MOE_EDEVICE;
    if (hipEventRecord(ctx->stage_done[i], ctx->stream) != hipSuccess) return MOE_EDEVICE;
    if (prev >= 0) {
      if (hipEventSynchronize(ctx->stage_done[prev]) != hipSuccess) return MOE_EDEVICE;
      memcpy((char *)dst + prev_off, ctx->stage[prev], prev_len);
    }
    prev = i;
    prev_off = off;
    prev_len = len;
  }
  if (prev >= 0) {
    if (hipEventSynchronize(ctx->stage_done[prev]) != hipSuccess) return MOE_EDEVICE;
    memcpy((char *)dst + prev_off, ctx->stage[prev], prev_len);
  }
  return MOE_OK;
}

/* Queued behind the work on the stream, into the open group's half of
 * stage[1], so that the copy starts when the op ends, without the host
 * between them; completed by the next synchronize, any copy through
 * stage[1] (pending_finish) or its group's finish. Nothing waits here for
 * the half: every earlier use of it is ordered before on the stream, and
 * the host touches it only after the copy is completed. */
static moe_status gpu_copy_out_async(moe_backend *b, void *dst, const void *src, size_t n) {
  gpu_ctx *ctx = b->context;
  if (n > STAGE_CHUNK) return gpu_copy_out(b, dst, src, n); /* complete at once: allowed */
  const int h = (int)(ctx->group & 1);
  moe_status s = copies_finish(ctx, ctx->group - 2); /* the half's last ended group */
  if (!s && (ctx->n_pending == PENDING_MAX || n > STAGE_CHUNK - ctx->half_end[h]))
    s = pending_finish(ctx, false);
  if (s) return s;
  const size_t off = (size_t)h * STAGE_CHUNK + ctx->half_end[h];
  if (hipMemcpyAsync((char *)ctx->stage[1] + off, src, n, hipMemcpyDeviceToHost, ctx->stream) != hipSuccess ||
      hipEventRecord(ctx->stage_done[1], ctx->stream) != hipSuccess)
    return MOE_EDEVICE;
  ctx->pending[ctx->n_pending++] = (pending_out){dst, off, n, ctx->group};
  const size_t end = ctx->half_end[h] + n, aligned = (end + 255) & ~(size_t)255; /* n <= STAGE_CHUNK */
  ctx->half_end[h] = aligned < STAGE_CHUNK ? aligned : STAGE_CHUNK;
  return MOE_OK;
}

static moe_status gpu_copy_out_end(moe_backend *b, uint64_t *group) {
  gpu_ctx *ctx = b->context;
  const uint64_t g = ctx->group;
  moe_status s = copies_finish(ctx, g - 2); /* group_done[g & 1] is about to be its no more */
  if (s) return s;
  if (hipEventRecord(ctx->group_done[g & 1], ctx->stream) != hipSuccess) return MOE_EDEVICE;
  ctx->group = g + 1;
  *group = g;
  return MOE_OK;
}

static moe_status gpu_copy_out_finish(moe_backend *b, uint64_t group) {
  gpu_ctx *ctx = b->context;
  if (group >= ctx->group) return MOE_EINVAL; /* not ended */
  return copies_finish(ctx, group);
}

/* ---- device copies of loaded expert sets ------------------------------------ */

/* Counts blocks[] (live pool blocks or NULL) as resident; their bytes. */
static size_t resident_add(gpu_ctx *ctx, void *const blocks[MOE_EXPERT_TENSOR_COUNT]) {
  size_t bytes = 0;
  for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++) {
    const size_t slot = live_find(ctx, blocks[i]);
    if (slot != SIZE_MAX) bytes += class_bytes(ctx->live[slot].cls);
  }
  ctx->resident += bytes;
  publish(ctx);
  return bytes;
}

/* Frees blocks[] to the pool and takes their `bytes` off the resident count. */
static void resident_free(moe_backend *b, void *const blocks[MOE_EXPERT_TENSOR_COUNT], size_t bytes) {
  gpu_ctx *ctx = b->context;
  for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++)
    if (blocks[i]) pool_free(b, blocks[i]); /* stream-ordered reuse: safe */
  ctx->resident -= bytes;
  publish(ctx);
}

/* Frees the copies (stream-ordered reuse: safe) and drops the entry's
 * reference to its set (NULL while the entry is being built). */
static void set_entry_free(moe_backend *b, set_entry *e) {
  resident_free(b, e->dev, e->bytes);
  moe_expert_set_release_hold(e->set);
  free(e);
}

/* Sets nobody but device caches reference any more (unloaded, replaced)
 * leave the device; the pool then gives its cached blocks back, so the
 * device's free memory returns to what it was before the set came. */
static size_t gpu_trim(moe_backend *b) {
  gpu_ctx *ctx = b->context;
  size_t freed = 0;
  for (set_entry **p = &ctx->sets; *p;) {
    set_entry *e = *p;
    if (moe_expert_set_unused(e->set)) {
      *p = e->next;
      freed += e->bytes;
      set_entry_free(b, e);
    } else {
      p = &e->next;
    }
  }
  if (freed) pool_trim(ctx);
  return freed;
}

static void gpu_memory(const moe_backend *b, moe_backend_memory *out) {
  const gpu_ctx *ctx = b->context;
  out->resident = __atomic_load_n(&ctx->shown.resident, __ATOMIC_RELAXED);
  out->held = __atomic_load_n(&ctx->shown.held, __ATOMIC_RELAXED);
}

moe_status moe_gpu_set_weights(moe_backend *b, const moe_expert_set *set, void *dev[MOE_EXPERT_TENSOR_COUNT],
                               moe_error *err) {
  gpu_ctx *ctx = b->context;
  set_entry *e = ctx->sets;
  while (e && e->set != set)
    e = e->next;
  if (!e) {
    e = calloc(1, sizeof *e);
    if (!e) return moe_fail(err, MOE_ENOMEM, "out of memory");
    for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++) {
      const moe_tensor *t = &set->t[i];
      if (!t->data || !t->nbytes) continue;
      moe_status s = gpu_alloc(b, t->nbytes, &e->dev[i]);
      if (!s) s = gpu_copy_in(b, e->dev[i], t->data, t->nbytes);
      if (s) {
        set_entry_free(b, e);
        return moe_fail(err, s, "expert set '%s': %s to the device failed (%zu bytes)", set->name,
                        moe_expert_tensor_names[i], t->nbytes);
      }
    }
    if (moe_gpu_fused_tc(b, &set->cfg)) { /* the tensor-core layout replaces the files' */
      void *packed[MOE_EXPERT_TENSOR_COUNT];
      moe_status s = moe_gpu_fused_pack(b, set, e->dev, packed, err);
      if (s) {
        set_entry_free(b, e);
        return s;
      }
      for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++)
        if (packed[i]) {
          pool_free(b, e->dev[i]);
          e->dev[i] = packed[i];
        }
    }
    /* the set's refcount is not part of its value: the cache may hold a
     * reference to a set it was given as const */
    e->set = moe_expert_set_hold((moe_expert_set *)set);
    e->bytes = resident_add(ctx, e->dev);
    e->next = ctx->sets;
    ctx->sets = e;
  }
  memcpy(dev, e->dev, sizeof e->dev);
  return MOE_OK;
}

/* ---- packed copies of inline weights ------------------------------------------ */

static void packed_entry_free(moe_backend *b, packed_entry *e) {
  resident_free(b, e->dst, e->bytes);
  free(e);
}

/* Drops every entry packed from a buffer that overlaps [p, p + n). */
static void packed_drop_overlapping(moe_backend *b, const void *p, size_t n) {
  gpu_ctx *ctx = b->context;
  const char *lo = p, *hi = lo + n;
  packed_entry **pp = &ctx->packed;
  while (*pp) {
    packed_entry *e = *pp;
    bool hit = false;
    for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT && !hit; i++) {
      const char *s = e->src[i];
      hit = s && s < hi && lo < s + e->src_bytes[i];
    }
    if (hit) {
      *pp = e->next;
      packed_entry_free(b, e);
    } else {
      pp = &e->next;
    }
  }
}

static bool packed_matches(const packed_entry *e, const moe_expert_set *set, void *const dev[]) {
  const moe_expert_config *a = &e->cfg, *c = &set->cfg;
  if (a->scheme != c->scheme || a->num_experts != c->num_experts || a->hidden_size != c->hidden_size ||
      a->intermediate_size != c->intermediate_size || a->bits != c->bits || a->group_size != c->group_size ||
      a->has_zero_points != c->has_zero_points || a->activation != c->activation ||
      e->scale_dt[0] != set->t[MOE_W13_SCALES].dtype || e->scale_dt[1] != set->t[MOE_W2_SCALES].dtype)
    return false;
  for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++)
    if (e->dst[i] && (e->src[i] != dev[i] || e->src_bytes[i] != set->t[i].nbytes)) return false;
  return true;
}

moe_status moe_gpu_inline_packed(moe_backend *b, const moe_expert_set *set,
                                 void *dev[MOE_EXPERT_TENSOR_COUNT], moe_error *err) {
  gpu_ctx *ctx = b->context;
  packed_entry **pp = &ctx->packed, *e = NULL;
  for (; *pp; pp = &(*pp)->next)
    if (packed_matches(*pp, set, dev)) {
      e = *pp;
      *pp = e->next; /* to the front below */
      break;
    }
  if (!e) {
    if (!(e = calloc(1, sizeof *e))) return moe_fail(err, MOE_ENOMEM, "out of memory");
    moe_status s = moe_gpu_fused_pack(b, set, dev, e->dst, err);
    if (s) {
      free(e);
      return s;
    }
    for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++)
      if (e->dst[i]) {
        e->src[i] = dev[i];
        e->src_bytes[i] = set->t[i].nbytes;
      }
    e->bytes = resident_add(ctx, e->dst);
    e->cfg = set->cfg;
    e->scale_dt[0] = set->t[MOE_W13_SCALES].dtype;
    e->scale_dt[1] = set->t[MOE_W2_SCALES].dtype;
    /* bound: the oldest past the limit go */
    int kept = 0;
    for (packed_entry **q = &ctx->packed; *q;) {
      if (++kept >= MOE_GPU_PACKED_INLINE) {
        packed_entry *old = *q;
        *q = old->next;
        packed_entry_free(b, old);
      } else {
        q = &(*q)->next;
      }
    }
  }
  e->next = ctx->packed;
  ctx->packed = e;
  for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++)
    if (e->dst[i]) dev[i] = e->dst[i];
  return MOE_OK;
}

/* The API's free: a buffer a packed copy was made from takes that copy
 * along (anywhere in the block: gathered inputs share one). ptr is looked
 * up twice on purpose: freeing the packed copies removes their blocks from
 * the live table, whose deletion re-seats entries, so the slot found here
 * may not hold ptr by the time pool_free runs. */
static void gpu_free(moe_backend *b, void *ptr) {
  if (!ptr) return;
  gpu_ctx *ctx = b->context;
  const size_t slot = live_find(ctx, ptr);
  packed_drop_overlapping(b, ptr, slot == SIZE_MAX ? 1 : class_bytes(ctx->live[slot].cls));
  pool_free(b, ptr);
}

static moe_status gpu_sync(moe_backend *b) {
  gpu_ctx *ctx = b->context;
  if (hipStreamSynchronize(ctx->stream) != hipSuccess) {
    ctx->n_pending = 0; /* their bytes never came */
    ctx->half_end[0] = ctx->half_end[1] = 0;
    ctx->done = ctx->group - 1;
    return MOE_EDEVICE;
  }
  return pending_finish(ctx, true);
}

static moe_status gpu_run(moe_backend *b, moe_call *c, moe_error *err) {
  /* the op, and fused_moe's scheme (gpu_fused_lacks) */
  moe_status s = moe_call_check_backend(c, b, err);
  if (s) return s;
  s = moe_gpu_enter(b, err);
  if (s) return s;
  return c->op->gpu(b, c, err);
}

static void gpu_destroy(moe_backend *b) {
  gpu_ctx *ctx = b->context;
  if (!ctx) return;
  hipSetDevice(ctx->device);
  if (ctx->stream) hipStreamSynchronize(ctx->stream);
  while (ctx->sets) {
    set_entry *e = ctx->sets;
    ctx->sets = e->next;
    moe_expert_set_release_hold(e->set);
    free(e); /* its blocks are live pool blocks: freed just below */
  }
  while (ctx->packed) {
    packed_entry *e = ctx->packed;
    ctx->packed = e->next;
    free(e);
  }
  for (size_t i = 0; i < ctx->live_cap; i++)
    if (ctx->live[i].ptr) hipFree(ctx->live[i].ptr);
  free(ctx->live);
  pool_trim(ctx);
  for (int i = 0; i < 2; i++) {
    if (ctx->stage[i]) hipHostFree(ctx->stage[i]);
    if (ctx->stage_done[i]) hipEventDestroy(ctx->stage_done[i]);
    if (ctx->group_done[i]) hipEventDestroy(ctx->group_done[i]);
  }
  if (ctx->stream) hipStreamDestroy(ctx->stream);
  free(ctx);
  b->context = NULL;
}

bool moe_gpu_portable(void) {
  static int portable = -1; /* read once; threads that race read the same */
  int v = __atomic_load_n(&portable, __ATOMIC_RELAXED);
  if (v < 0) {
    const char *e = getenv("MOE_GPU_PORTABLE");
    v = e && *e && strcmp(e, "0") != 0;
    __atomic_store_n(&portable, v, __ATOMIC_RELAXED);
  }
  return v != 0;
}

bool moe_gpu_fused_tc(moe_backend *b, const moe_expert_config *cfg) {
  return !moe_gpu_portable() && moe_gpu_fused_packs(b, cfg);
}

/* Every scheme, with or without biases, runs on both GEMM paths (the
 * tensor-core one where moe_gpu_fused_tc takes the set, the portable one
 * everywhere else, AMD included): nothing is lacking. The hook stays
 * because a backend without one is taken to lack biases (kernels/ops/call.c). */
static const char *gpu_fused_lacks(const moe_backend *b, const moe_expert_config *cfg) {
  (void)b;
  (void)cfg;
  return NULL;
}

static const struct moe_backend_i gpu_iface = {
    .alloc = gpu_alloc,
    .free = gpu_free,
    .copy_in = gpu_copy_in,
    .copy_out = gpu_copy_out,
    .synchronize = gpu_sync,
    .copy_in_gather = gpu_copy_in_gather,
    .copy_out_async = gpu_copy_out_async,
    .copy_out_end = gpu_copy_out_end,
    .copy_out_finish = gpu_copy_out_finish,
    .run = gpu_run,
    .destroy = gpu_destroy,
    .trim = gpu_trim,
    .memory = gpu_memory,
    .fused_lacks = gpu_fused_lacks,
};

int moe_backend_device_count(const char **why) {
  int n = 0;
  hipError_t e = hipGetDeviceCount(&n);
  if (e != hipSuccess || n <= 0) {
    hipGetLastError();
    if (why) *why = "no GPU (" MOE_VENDOR " runtime finds no device)";
    return 0;
  }
  if (why) *why = "GPU backend (" MOE_VENDOR ")";
  return n;
}

moe_status moe_backend_gpu_create(int device, moe_backend **out, moe_error *err) {
  int n = moe_backend_device_count(NULL);
  if (device < 0 || device >= n)
    return moe_fail(err, MOE_EINVAL, "gpu %d: no such device (%d present)", device, n);
  moe_backend *b = calloc(1, sizeof *b);
  gpu_ctx *ctx = calloc(1, sizeof *ctx);
  moe_status s = MOE_OK;
  if (!b || !ctx) {
    free(b);
    free(ctx);
    return moe_fail(err, MOE_ENOMEM, "out of memory");
  }
  ctx->device = device;
  b->iface = &gpu_iface;
  b->kind = MOE_BACKEND_GPU;
  b->device = device;
  b->context = ctx;
  hipDeviceProp_t prop;
  if ((s = moe_gpu_check(hipSetDevice(device), "hipSetDevice", err))) goto fail;
  if ((s = moe_gpu_check(hipGetDeviceProperties(&prop, device), "hipGetDeviceProperties", err))) goto fail;
  ctx->sm_count = prop.multiProcessorCount > 0 ? prop.multiProcessorCount : 1;
  ctx->cc_major = prop.major;
  snprintf(b->name, sizeof b->name, "gpu%d: %.48s", device, prop.name);
  if ((s = moe_gpu_check(hipStreamCreateWithFlags(&ctx->stream, hipStreamNonBlocking), "stream", err)))
    goto fail;
  ctx->group = 2; /* copies_finish(group - 2) names no group before it */
  ctx->done = 1;
  for (int i = 0; i < 2; i++) {
    if ((s = moe_gpu_check(hipHostMalloc(&ctx->stage[i], (size_t)(i + 1) * STAGE_CHUNK, hipHostMallocDefault),
                           "pinned staging", err)))
      goto fail;
    /* recorded once so that the first wait on them returns at once */
    hipEvent_t *ev[2] = {&ctx->stage_done[i], &ctx->group_done[i]};
    for (int k = 0; k < 2; k++) {
      if ((s = moe_gpu_check(hipEventCreateWithFlags(ev[k], hipEventDisableTiming), "event", err))) goto fail;
      if ((s = moe_gpu_check(hipEventRecord(*ev[k], ctx->stream), "event", err))) goto fail;
    }
  }
  *out = b;
  return MOE_OK;
fail:
  moe_backend_destroy(b);
  return s;
}
