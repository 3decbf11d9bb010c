/* handlers_shm: Triton's shared-memory extensions over RPC: system shared
 * memory regions registered, unregistered and listed (the regions are
 * shm.c's), and the CUDA extension, which moed answers without ever
 * holding a region. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "handlers_req.h"

/* ---- shared memory (Triton's extensions; the regions are shm.c's) ---------------------------- */

static bool shm_on(moed_server *s, moed_request *req) {
  if (!s->shm)
    moed_reply_error(req, GRPC_STATUS_FAILED_PRECONDITION,
                     "system shared memory is off (--shm-max-regions 0)");
  return s->shm != NULL;
}

/* Register, or unregister (`reg` false): one scaffold, as in cuda_shm. An
 * unregister's name is checked before the on/off check, a register's by
 * moed_shm_register. Both answers are empty messages. */
void moed_handle_shm_change(moed_server *s, moed_request *req, bool reg) {
  ProtobufCMessage *m =
      moed_unpack(req, reg ? &inference__system_shared_memory_register_request__descriptor
                           : &inference__system_shared_memory_unregister_request__descriptor);
  if (!m) return;
  const Inference__SystemSharedMemoryRegisterRequest *in = reg ? (void *)m : NULL;
  const char *name = reg ? in->name : ((Inference__SystemSharedMemoryUnregisterRequest *)m)->name;
  const char *peer = moed_rpc_peer(req->rpc);
  char err[MOED_ERR_LEN];
  grpc_status_code code = GRPC_STATUS_OK;
  if (!reg && *name && !moed_model_name_ok(name))
    code = moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid region name (%s)",
                      MOED_MODEL_NAME_RULE);
  else if (!shm_on(s, req))
    goto done;
  else if (reg)
    code = moed_shm_register(s->shm, name, in->key, in->offset, in->byte_size, err);
  else
    moed_shm_unregister(s->shm, name);
  if (code) {
    moed_rpc_finish(req->rpc, code, err, NULL);
  } else if (reg) {
    moed_log(MOED_LOG_INFO, "shm_register", "region %s: '%s' bytes [%llu, +%llu), by %s", name, in->key,
             (unsigned long long)in->offset, (unsigned long long)in->byte_size, peer);
    Inference__SystemSharedMemoryRegisterResponse r = INFERENCE__SYSTEM_SHARED_MEMORY_REGISTER_RESPONSE__INIT;
    moed_reply(req, &r.base);
  } else {
    moed_log(MOED_LOG_INFO, "shm_unregister", "region %s, by %s", *name ? name : "(all)", peer);
    Inference__SystemSharedMemoryUnregisterResponse r =
        INFERENCE__SYSTEM_SHARED_MEMORY_UNREGISTER_RESPONSE__INIT;
    moed_reply(req, &r.base);
  }
done:
  protobuf_c_message_free_unpacked(m, NULL);
}

void moed_handle_shm_status(moed_server *s, moed_request *req) {
  Inference__SystemSharedMemoryStatusRequest *in =
      moed_unpack(req, &inference__system_shared_memory_status_request__descriptor);
  if (!in) return;
  moed_shm_info *v = NULL;
  Inference__SystemSharedMemoryStatusResponse__RegionStatus *st = NULL;
  Inference__SystemSharedMemoryStatusResponse__RegionsEntry *e = NULL, **pe = NULL;
  long n = 0;
  if (*in->name && !moed_model_name_ok(in->name)) {
    moed_reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid region name (%s)",
                     MOED_MODEL_NAME_RULE);
    goto done;
  }
  if (!shm_on(s, req)) goto done;
  n = moed_shm_status(s->shm, in->name, &v);
  st = calloc(n > 0 ? (size_t)n : 1, sizeof *st);
  e = calloc(n > 0 ? (size_t)n : 1, sizeof *e);
  pe = calloc(n > 0 ? (size_t)n : 1, sizeof *pe);
  if (n < 0 || !st || !e || !pe) {
    moed_reply_error(req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
    goto done;
  }
  if (*in->name && n == 0) {
    moed_reply_error(req, GRPC_STATUS_NOT_FOUND, "name: no region '%s' is registered", in->name);
    goto done;
  }
  for (long i = 0; i < n; i++) {
    inference__system_shared_memory_status_response__region_status__init(&st[i]);
    inference__system_shared_memory_status_response__regions_entry__init(&e[i]);
    st[i].name = v[i].name;
    st[i].key = v[i].key;
    st[i].offset = v[i].offset;
    st[i].byte_size = v[i].byte_size;
    e[i].key = v[i].name;
    e[i].value = &st[i];
    pe[i] = &e[i];
  }
  Inference__SystemSharedMemoryStatusResponse r = INFERENCE__SYSTEM_SHARED_MEMORY_STATUS_RESPONSE__INIT;
  r.n_regions = (size_t)n;
  r.regions = pe;
  moed_reply(req, &r.base);
done:
  free(v);
  free(st);
  free(e);
  free(pe);
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

/* CUDA shared memory: moed maps no device buffer of another process (no
 * CUDA IPC), so none is ever registered: status lists none, unregistering
 * has nothing to do, registering is refused with what to use instead. */
void moed_handle_cuda_shm(moed_request *req) {
  if (req->method == MOED_M_CUDA_SHM_REGISTER) {
    moed_reply_error(req, GRPC_STATUS_UNIMPLEMENTED,
                     "CUDA shared memory is not supported by moed (no CUDA IPC): register the tensors' host "
                     "memory with SystemSharedMemoryRegister instead");
    return;
  }
  const bool status = req->method == MOED_M_CUDA_SHM_STATUS;
  ProtobufCMessage *in =
      moed_unpack(req, status ? &inference__cuda_shared_memory_status_request__descriptor
                              : &inference__cuda_shared_memory_unregister_request__descriptor);
  if (!in) return;
  const char *name = status ? ((Inference__CudaSharedMemoryStatusRequest *)in)->name
                            : ((Inference__CudaSharedMemoryUnregisterRequest *)in)->name;
  if (status && *name) {
    moed_reply_error(req, GRPC_STATUS_NOT_FOUND,
                     "name: no CUDA shared memory region is registered (moed has none)");
  } else if (status) {
    Inference__CudaSharedMemoryStatusResponse r = INFERENCE__CUDA_SHARED_MEMORY_STATUS_RESPONSE__INIT;
    moed_reply(req, &r.base);
  } else {
    Inference__CudaSharedMemoryUnregisterResponse r = INFERENCE__CUDA_SHARED_MEMORY_UNREGISTER_RESPONSE__INIT;
    moed_reply(req, &r.base);
  }
  protobuf_c_message_free_unpacked(in, NULL);
}
