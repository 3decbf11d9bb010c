/* moe: backends (where ops run), opened by device.
 *
 * A backend is opaque: callers open one on a device, stage tensors through
 * the memory wrappers below and run prepared calls on it (moe/ops.h). Its
 * interface (the vtable each backend fills) is the library's own
 * (kernels/ops/backend_impl.h), so callers never depend on which backend
 * they hold. A backend object is used by one thread at a time (one device
 * worker owns it); open one per worker. */
#ifndef MOE_BACKEND_H
#define MOE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_backend moe_backend;
typedef struct moe_call moe_call;

/* Memory a backend holds on its device (moe_backend_memory_get). */
typedef struct moe_backend_memory {
  size_t resident; /* expert sets and packed inline weights kept on the device */
  size_t held;     /* everything taken from the device: resident, in use, cached for reuse */
} moe_backend_memory;

/* ---- devices ----------------------------------------------------------------
 * The host CPU is always there; GPUs are numbered 0..moe_backend_device_count()-1. */

/* The device number of the host CPU backend (host memory, OpenMP threads). */
#define MOE_BACKEND_HOST (-1)

/* Number of usable GPUs (0 when the build has no GPU backend or none is
 * present); *why (may be NULL) tells which, for the log. */
int moe_backend_device_count(const char **why);
/* A backend on `device`: MOE_BACKEND_HOST or a GPU number. cpu_threads is
 * the host backend's thread count (<= 0: the OpenMP default, all cores);
 * GPU backends ignore it. */
moe_status moe_backend_open(int device, int cpu_threads, moe_backend **out, moe_error *err);
void moe_backend_destroy(moe_backend *b);

/* "cpu (2 threads)", "gpu0: NVIDIA H200": for logs and reports. */
const char *moe_backend_name(const moe_backend *b);
/* Whether b's memory is host memory (the host CPU backend): its buffers can
 * be read and written in place, without copy_in/copy_out. */
bool moe_backend_is_host(const moe_backend *b);

/* ---- memory -------------------------------------------------------------------
 * Callers (the server, tests, benches) stage tensors through these. */

/* Host memory aligned to `align` (a power of two), freed with free(); from
 * MOE_HOST_HUGE_PAGE bytes on aligned to that and advised for transparent
 * huge pages (Linux madvise; without THP the advice does nothing): a core
 * streaming expert weights from DRAM misses the TLB less (bench/RESULTS.md:
 * the CPU's int4 decode from DRAM 8% faster). The expert-set loader, the
 * host backend's memory and the benches take theirs from here. NULL when
 * out of memory, for a bad `align` or a size beyond PTRDIFF_MAX. */
#define MOE_HOST_HUGE_PAGE ((size_t)2 << 20)
void *moe_host_alloc(size_t nbytes, size_t align);
/* Memory of this backend; host memory for the host backend. */
moe_status moe_backend_alloc(moe_backend *b, size_t nbytes, void **out);
void moe_backend_free(moe_backend *b, void *ptr);
/* Host -> backend and backend -> host, ordered on the backend's stream. */
moe_status moe_backend_copy_in(moe_backend *b, void *dst, const void *src, size_t nbytes);
moe_status moe_backend_copy_out(moe_backend *b, void *dst, const void *src, size_t nbytes);
/* Host -> backend of n host buffers into one allocation at once: src[i]
 * (nbytes[i]) to dst + off[i], the pieces in increasing offsets, not
 * overlapping. A GPU backend copies pieces that span at most its pinned
 * staging buffer with one host copy into it and one transfer (the bytes
 * between pieces are written too: dst's own padding), larger spans piece
 * by piece as moe_backend_copy_in; the same ordering on its stream. */
moe_status moe_backend_copy_in_gather(moe_backend *b, void *dst, const void *const src[], const size_t off[],
                                      const size_t nbytes[], size_t n);
/* Backend -> host, queued after the work queued so far: dst holds the
 * bytes once the next moe_backend_synchronize returns (not before; other
 * copies of the backend may complete it earlier). Host backends copy at
 * once. dst stays the caller's; it must stay valid until then. */
moe_status moe_backend_copy_out_async(moe_backend *b, void *dst, const void *src, size_t nbytes);
/* Ends the group of moe_backend_copy_out_async copies queued since the last
 * group ended (possibly none) and names it in *group: its copies complete
 * with moe_backend_copy_out_finish(group), which waits for the device to
 * reach them and not for work queued later, so the owning thread can
 * queue the next call before it waits for this one. MOE_EUNSUPPORTED:
 * the backend copies at once (host backends): nothing to wait for. */
moe_status moe_backend_copy_out_end(moe_backend *b, uint64_t *group);
/* Completes the copies of ended `group` and of every group before it (at
 * once when something else, a synchronize or a copy, completed them). */
moe_status moe_backend_copy_out_finish(moe_backend *b, uint64_t group);
/* Waits for everything queued on the backend (and completes the copies of
 * moe_backend_copy_out_async). */
moe_status moe_backend_synchronize(moe_backend *b);
/* The owning thread, between runs: frees the device copies of expert sets
 * whose last reference the backend holds and, when that freed anything,
 * returns cached memory to the device; bytes freed (0 when the backend
 * keeps nothing resident). */
size_t moe_backend_trim(moe_backend *b);
/* Any thread: a snapshot of the bytes held; zeros for backends without
 * device memory of their own. */
void moe_backend_memory_get(const moe_backend *b, moe_backend_memory *out);

#ifdef __cplusplus
}
#endif
#endif
