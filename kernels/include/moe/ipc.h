/* moe: device memory of another process, opened from the IPC handle that
 * process exported (CUDA's cudaIpcMemHandle_t, HIP's hipIpcMemHandle_t:
 * 64 opaque bytes). The server's CUDA shared-memory regions are these.
 *
 * Any thread, any time: each call makes `device` current for its duration
 * and gives the calling thread its previous device back, so that a device
 * worker may copy into a region of another GPU without losing its own. A
 * build without a GPU backend has every function: they fail with
 * MOE_EUNSUPPORTED (moe_ipc_supported says so beforehand). */
#ifndef MOE_IPC_H
#define MOE_IPC_H

#include <stdbool.h>
#include <stddef.h>

#include "moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_IPC_HANDLE_BYTES 64

/* Whether this build can open IPC handles (it has a GPU backend). */
bool moe_ipc_supported(void);
/* Maps the allocation `handle` names into this process on `device`: *ptr
 * its first byte, *size its bytes from *ptr on (what may be read and
 * written through it). Close with moe_ipc_close. */
moe_status moe_ipc_open(int device, const unsigned char handle[MOE_IPC_HANDLE_BYTES], void **ptr,
                        size_t *size, moe_error *err);
/* Unmaps what moe_ipc_open mapped (the exporter's allocation stays its own). */
moe_status moe_ipc_close(int device, void *ptr, moe_error *err);
/* Copies n bytes from the device at src (mapped) to the host at dst;
 * dst holds them when it returns. */
moe_status moe_ipc_read(int device, void *dst, const void *src, size_t n, moe_error *err);
/* Copies n bytes from the host at src to the device at dst (mapped); the
 * bytes are in device memory when it returns (not only staged), so that an
 * answer sent next finds them there. */
moe_status moe_ipc_write(int device, void *dst, const void *src, size_t n, moe_error *err);

#ifdef __cplusplus
}
#endif
#endif
