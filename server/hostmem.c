/* hostmem: host buffers for tensors (received messages, outputs, merged
 * batches), 64-byte aligned. Buffers of 1 MiB and more are kept for reuse
 * after free, up to a bounded total: glibc serves allocations that large
 * with a fresh mmap each time (its threshold cannot exceed 32 MiB), and
 * faulting in fresh pages costs more than the copy that fills them
 * (measured: about a third of a 64 MiB request's time on the server). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moed.h"

#define HEADER 64 /* keeps the caller's pointer 64-byte aligned */
#define LARGE ((size_t)1 << 20)
#define MAGIC 0x6d6f6564686d656dull
#define MAX_KEPT 16

typedef struct header {
  uint64_t magic;
  size_t cap; /* usable bytes after the header */
} header;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static header *kept[MAX_KEPT];
static size_t n_kept, kept_bytes, kept_limit = (size_t)512 << 20;

void moed_hostmem_limit(size_t bytes) {
  pthread_mutex_lock(&mu);
  kept_limit = bytes;
  pthread_mutex_unlock(&mu);
}

void *moed_hostmem_alloc(size_t n) {
  size_t cap = n ? n : 1;
  if (cap >= LARGE) { /* round to 1 MiB so that buffers of similar size are shared */
    if (cap > SIZE_MAX - 2 * LARGE) return NULL;
    cap = (cap + LARGE - 1) & ~(LARGE - 1);
    pthread_mutex_lock(&mu);
    size_t best = n_kept;
    for (size_t i = 0; i < n_kept; i++) /* the smallest that fits, not more than twice the need */
      if (kept[i]->cap >= cap && kept[i]->cap / 2 <= cap &&
          (best == n_kept || kept[i]->cap < kept[best]->cap))
        best = i;
    if (best < n_kept) {
      header *h = kept[best];
      kept[best] = kept[--n_kept];
      kept_bytes -= h->cap;
      pthread_mutex_unlock(&mu);
      return (uint8_t *)h + HEADER;
    }
    pthread_mutex_unlock(&mu);
  } else {
    cap = (cap + 63) & ~(size_t)63;
  }
  header *h = aligned_alloc(64, HEADER + cap);
  if (!h) return NULL;
  h->magic = MAGIC;
  h->cap = cap;
  return (uint8_t *)h + HEADER;
}

void moed_hostmem_free(void *p) {
  if (!p) return;
  header *h = (header *)((uint8_t *)p - HEADER);
  if (h->cap >= LARGE) {
    pthread_mutex_lock(&mu);
    if (n_kept < MAX_KEPT && kept_bytes + h->cap <= kept_limit) {
      kept[n_kept++] = h;
      kept_bytes += h->cap;
      h = NULL;
    }
    pthread_mutex_unlock(&mu);
  }
  free(h);
}

void moed_hostmem_trim(void) {
  pthread_mutex_lock(&mu);
  while (n_kept)
    free(kept[--n_kept]);
  kept_bytes = 0;
  pthread_mutex_unlock(&mu);
}

static void slice_free(void *p) { moed_hostmem_free(p); }

grpc_slice moed_hostmem_slice(void *p, size_t len) { return grpc_slice_new(p, len, slice_free); }
