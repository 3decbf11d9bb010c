/* weight_cache: device copies of the weights that requests to the built-in
 * fused_moe model carry inline (docs/design.md "Ops"), keyed by content, so a
 * caller sending the same weights again skips their copy to the device.
 *
 * Key: XXH3-128 over every weight tensor's name, dtype, shape and bytes,
 * plus the backend (host backends share entries); an entry also keeps the tensors' descriptors, compared
 * on a hit. Bounded by bytes; least recently used entries that no request
 * is using are evicted first. One mutex: lookups are a short list walk,
 * and the copy on a miss happens outside it. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "moed.h"

#define MAX_WEIGHTS 16

struct moed_weights {
  moed_weights *prev, *next; /* LRU list, most recent first */
  XXH128_hash_t key;
  moe_backend *b;
  size_t n, bytes;
  moe_named_tensor desc[MAX_WEIGHTS]; /* names point at moe_expert_tensor_names */
  void *data[MAX_WEIGHTS];
  int refs;   /* requests using it (c->mu) */
  bool ready; /* copied; until then others wait for it */
  bool dead;  /* evicted or failed while in use: freed by the last release */
};

struct moed_weight_cache {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  moed_weights *head, *tail;
  size_t limit, bytes;
  moed_weight_cache_stats st;
};

int moed_weight_cache_create(size_t limit_bytes, moed_weight_cache **out) {
  moed_weight_cache *c = calloc(1, sizeof *c);
  if (!c) return -1;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  c->limit = limit_bytes;
  *out = c;
  return 0;
}

static void entry_free(moed_weights *w) {
  for (size_t i = 0; i < w->n; i++)
    if (w->data[i]) moe_backend_free(w->b, w->data[i]);
  free(w);
}

static void unlink_locked(moed_weight_cache *c, moed_weights *w) {
  if (w->prev)
    w->prev->next = w->next;
  else
    c->head = w->next;
  if (w->next)
    w->next->prev = w->prev;
  else
    c->tail = w->prev;
  w->prev = w->next = NULL;
  c->bytes -= w->bytes;
  c->st.entries--;
}

static void push_front_locked(moed_weight_cache *c, moed_weights *w) {
  w->prev = NULL;
  w->next = c->head;
  if (c->head)
    c->head->prev = w;
  else
    c->tail = w;
  c->head = w;
}

void moed_weight_cache_destroy(moed_weight_cache *c) {
  if (!c) return;
  while (c->head) { /* no request runs any more: every entry is idle */
    moed_weights *w = c->head;
    unlink_locked(c, w);
    entry_free(w);
  }
  pthread_cond_destroy(&c->cv);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

static const char *canonical_name(const char *name) {
  for (int i = 0; i < MOE_EXPERT_TENSOR_COUNT; i++)
    if (strcmp(moe_expert_tensor_names[i], name) == 0) return moe_expert_tensor_names[i];
  return NULL;
}

static bool same_desc(const moed_weights *w, const moe_named_tensor *t, size_t n) {
  if (w->n != n) return false;
  for (size_t i = 0; i < n; i++) {
    const moe_tensor *a = &w->desc[i].tensor, *b = &t[i].tensor;
    if (strcmp(w->desc[i].name, t[i].name) != 0 || a->dtype != b->dtype || a->ndim != b->ndim ||
        a->nbytes != b->nbytes || memcmp(a->shape, b->shape, sizeof a->shape[0] * (size_t)a->ndim) != 0)
      return false;
  }
  return true;
}

/* Evicts idle entries, least recent first, until `need` more bytes fit. */
static bool make_room_locked(moed_weight_cache *c, size_t need) {
  moed_weights *w = c->tail;
  while (c->bytes + need > c->limit && w) {
    moed_weights *prev = w->prev;
    if (w->refs == 0) {
      unlink_locked(c, w);
      c->st.evictions++;
      entry_free(w);
    }
    w = prev;
  }
  return c->bytes + need <= c->limit;
}

moed_weights *moed_weight_cache_get(moed_weight_cache *c, moe_backend *b, const moe_named_tensor *t, size_t n,
                                    void **data) {
  if (n == 0 || n > MAX_WEIGHTS) return NULL;
  size_t bytes = 0;
  XXH3_state_t *h = XXH3_createState();
  if (!h) return NULL;
  XXH3_128bits_reset(h);
  for (size_t i = 0; i < n; i++) {
    const moe_tensor *x = &t[i].tensor;
    int32_t head[2] = {(int32_t)x->dtype, x->ndim};
    if (!canonical_name(t[i].name) || !moe_add_size(bytes, x->nbytes, &bytes)) {
      XXH3_freeState(h);
      return NULL;
    }
    XXH3_128bits_update(h, t[i].name, strlen(t[i].name) + 1);
    XXH3_128bits_update(h, head, sizeof head);
    XXH3_128bits_update(h, x->shape, sizeof x->shape[0] * (size_t)x->ndim);
    XXH3_128bits_update(h, x->data, x->nbytes);
  }
  XXH128_hash_t key = XXH3_128bits_digest(h);
  XXH3_freeState(h);
  if (bytes > c->limit) return NULL; /* would evict everything for one request */

  pthread_mutex_lock(&c->mu);
  bool host = moe_backend_is_host(b);
  for (moed_weights *w = c->head; w; w = w->next) {
    /* host backends share one memory: their copies serve every worker */
    bool same_memory = w->b == b || (host && moe_backend_is_host(w->b));
    if (!same_memory || !XXH128_isEqual(w->key, key) || !same_desc(w, t, n)) continue;
    w->refs++;
    while (!w->ready && !w->dead)
      pthread_cond_wait(&c->cv, &c->mu); /* another worker is copying it */
    if (w->dead) {                       /* its copy failed */
      if (--w->refs == 0) entry_free(w);
      pthread_mutex_unlock(&c->mu);
      return NULL;
    }
    if (c->head != w) {
      unlink_locked(c, w);
      c->bytes += w->bytes;
      c->st.entries++;
      push_front_locked(c, w);
    }
    c->st.hits++;
    pthread_mutex_unlock(&c->mu);
    memcpy(data, w->data, n * sizeof *data);
    return w;
  }
  c->st.misses++;
  if (!make_room_locked(c, bytes)) {
    pthread_mutex_unlock(&c->mu);
    return NULL;
  }
  moed_weights *w = calloc(1, sizeof *w);
  if (!w) {
    pthread_mutex_unlock(&c->mu);
    return NULL;
  }
  w->key = key;
  w->b = b;
  w->n = n;
  w->bytes = bytes;
  w->refs = 1;
  for (size_t i = 0; i < n; i++) {
    w->desc[i] = t[i];
    w->desc[i].name = canonical_name(t[i].name);
    w->desc[i].tensor.data = NULL;
  }
  push_front_locked(c, w); /* reserved now so that a second worker waits instead of copying too */
  c->bytes += bytes;
  c->st.entries++;
  pthread_mutex_unlock(&c->mu);

  bool ok = true;
  for (size_t i = 0; i < n && ok; i++)
    ok = moe_backend_alloc(b, t[i].tensor.nbytes ? t[i].tensor.nbytes : 1, &w->data[i]) == MOE_OK &&
         moe_backend_copy_in(b, w->data[i], t[i].tensor.data, t[i].tensor.nbytes) == MOE_OK;
  /* the copy must have landed before another request's kernels read it */
  ok = ok && moe_backend_synchronize(b) == MOE_OK;

  pthread_mutex_lock(&c->mu);
  if (!ok) {
    unlink_locked(c, w);
    w->dead = true;
    pthread_cond_broadcast(&c->cv);
    if (--w->refs == 0) entry_free(w);
    pthread_mutex_unlock(&c->mu);
    return NULL;
  }
  w->ready = true;
  c->st.bytes = c->bytes;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  memcpy(data, w->data, n * sizeof *data);
  return w;
}

void moed_weight_cache_release(moed_weight_cache *c, moed_weights *w) {
  pthread_mutex_lock(&c->mu);
  w->refs--;
  pthread_mutex_unlock(&c->mu);
}

void moed_weight_cache_stats_get(moed_weight_cache *c, moed_weight_cache_stats *out) {
  pthread_mutex_lock(&c->mu);
  *out = c->st;
  out->bytes = c->bytes;
  pthread_mutex_unlock(&c->mu);
}
