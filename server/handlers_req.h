/* handlers_req: what the handler files share, internal to them: answering
 * a request and reading its message. handlers.c dispatches each request
 * by method to its group: health and server metadata (handlers.c), model
 * metadata, config and statistics (handlers_model.c), the repository
 * (handlers_repo.c), shared memory (handlers_shm.c), inference (the
 * inference path, infer_req.h) and uploads (upload.c). */
#ifndef MOED_HANDLERS_REQ_H
#define MOED_HANDLERS_REQ_H

#include "grpc_service.pb-c.h"
#include "moed.h"

/* OK with m packed as the answer (RESOURCE_EXHAUSTED when out of memory). */
void moed_reply(moed_request *req, const ProtobufCMessage *m);
/* The status and its printf message. */
void moed_reply_error(moed_request *req, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The request message, or NULL after answering INVALID_ARGUMENT when the
 * bytes are not one (every handler starts here). */
void *moed_unpack(moed_request *req, const ProtobufCMessageDescriptor *d);
/* v when it names a version moed does not have (every model has "1"), else NULL. */
const char *moed_version_other(const char *v);
/* Answers a request refused before admission (UNAVAILABLE) and frees it. */
void moed_refuse(moed_server *s, moed_request *req, const char *why);

/* handlers_model.c */
void moed_handle_model_ready(moed_server *s, moed_request *req);
void moed_handle_model_metadata(moed_server *s, moed_request *req);
void moed_handle_model_config(moed_server *s, moed_request *req);
void moed_handle_model_statistics(moed_server *s, moed_request *req);

/* handlers_repo.c: the index on the loop; a load or unload as a job on a worker */
void moed_handle_repository_index(moed_server *s, moed_request *req);
void moed_handle_repository_change(moed_server *s, moed_request *req);

/* handlers_shm.c: Triton's shared-memory extensions, system or CUDA (kind)
 * (reg: register, else unregister) */
void moed_handle_shm_change(moed_server *s, moed_request *req, bool reg, moed_shm_kind kind);
void moed_handle_shm_status(moed_server *s, moed_request *req, moed_shm_kind kind);
/* The GPUs a CUDA region may be registered on (0..n-1); 0 in a build
 * without a GPU backend or when moed runs on no GPU. */
int moed_cuda_shm_gpus(const moed_server *s);

#endif
