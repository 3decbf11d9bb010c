/* Internal: the CPU backend's context, shared by the CPU op functions. */
#ifndef MOE_CPU_CPU_H
#define MOE_CPU_CPU_H

#include <stddef.h>

#include "moe/backend.h"

/* Threads the op functions use (OpenMP num_threads). */
int moe_cpu_threads(const moe_backend *b);
/* A scratch buffer of at least `bytes` (64-byte aligned), owned by the
 * backend and reused across calls, so hot paths never allocate per call.
 * Valid until the next call of this function on `b`. NULL when out of memory. */
void *moe_cpu_workspace(moe_backend *b, size_t bytes);

#endif
