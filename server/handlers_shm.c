/* handlers_shm: Triton's shared-memory extensions over RPC, system and
 * CUDA: regions registered, unregistered and listed (the regions are
 * shm.c's, one registry of both kinds). The two extensions' methods differ
 * in their messages only, so each of register/unregister and status is
 * one scaffold taking the kind. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "handlers_req.h"
#include "moe/ipc.h"

static bool shm_on(moed_server *s, moed_request *req) {
  if (!s->shm)
    moed_reply_error(req, GRPC_STATUS_FAILED_PRECONDITION, "shared memory is off (--shm-max-regions 0)");
  return s->shm != NULL;
}

/* The GPUs moed runs on, numbered as CUDA numbers them: a GPU worker i runs
 * on device i (devices.c opens one per device, all or none); none when the
 * workers are the CPU's. */
static int gpus(const moed_server *s) {
  moe_backend_memory m;
  int n = 0;
  while (s->devices && n < moed_devices_count(s->devices) && moed_devices_memory(s->devices, n, &m))
    n++;
  return n;
}

int moed_cuda_shm_gpus(const moed_server *s) { return moe_ipc_supported() ? gpus(s) : 0; }

/* Register, or unregister (`reg` false), a region of one kind. An
 * unregister's name is checked before the on/off check, a register's by
 * shm.c. Every answer is an empty message. */
void moed_handle_shm_change(moed_server *s, moed_request *req, bool reg, moed_shm_kind kind) {
  const bool cuda = kind == MOED_SHM_CUDA;
  const ProtobufCMessageDescriptor *d =
      reg ? (cuda ? &inference__cuda_shared_memory_register_request__descriptor
                  : &inference__system_shared_memory_register_request__descriptor)
          : (cuda ? &inference__cuda_shared_memory_unregister_request__descriptor
                  : &inference__system_shared_memory_unregister_request__descriptor);
  const ProtobufCMessageDescriptor *rd =
      reg ? (cuda ? &inference__cuda_shared_memory_register_response__descriptor
                  : &inference__system_shared_memory_register_response__descriptor)
          : (cuda ? &inference__cuda_shared_memory_unregister_response__descriptor
                  : &inference__system_shared_memory_unregister_response__descriptor);
  ProtobufCMessage *m = moed_unpack(req, d);
  if (!m) return;
  const Inference__SystemSharedMemoryRegisterRequest *sys = reg && !cuda ? (void *)m : NULL;
  const Inference__CudaSharedMemoryRegisterRequest *dev = reg && cuda ? (void *)m : NULL;
  /* each message's name is its first field */
  const char *name = sys    ? sys->name
                     : dev  ? dev->name
                     : cuda ? ((Inference__CudaSharedMemoryUnregisterRequest *)m)->name
                            : ((Inference__SystemSharedMemoryUnregisterRequest *)m)->name;
  const char *peer = moed_rpc_peer(req->rpc);
  char err[MOED_ERR_LEN];
  grpc_status_code code = GRPC_STATUS_OK;
  if (!reg && *name && !moed_model_name_ok(name))
    code = moed_failf(err, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid region name (%s)",
                      MOED_MODEL_NAME_RULE);
  else if (!shm_on(s, req))
    goto done;
  else if (sys)
    code = moed_shm_register(s->shm, name, sys->key, sys->offset, sys->byte_size, err);
  else if (dev)
    code = moed_shm_register_cuda(s->shm, name, dev->raw_handle.data, dev->raw_handle.len, dev->device_id,
                                  dev->byte_size, gpus(s), err);
  else
    moed_shm_unregister(s->shm, kind, name);
  if (code) {
    moed_rpc_finish(req->rpc, code, err, NULL);
    goto done;
  }
  if (sys)
    moed_log(MOED_LOG_INFO, "shm_register", "region %s: '%s' bytes [%llu, +%llu), by %s", name, sys->key,
             (unsigned long long)sys->offset, (unsigned long long)sys->byte_size, peer);
  else if (dev)
    moed_log(MOED_LOG_INFO, "cuda_shm_register", "region %s: GPU %lld, %llu bytes, by %s", name,
             (long long)dev->device_id, (unsigned long long)dev->byte_size, peer);
  else
    moed_log(MOED_LOG_INFO, cuda ? "cuda_shm_unregister" : "shm_unregister", "region %s, by %s",
             *name ? name : "(all)", peer);
  union {
    Inference__SystemSharedMemoryRegisterResponse a;
    Inference__SystemSharedMemoryUnregisterResponse b;
    Inference__CudaSharedMemoryRegisterResponse c;
    Inference__CudaSharedMemoryUnregisterResponse e;
  } r;
  protobuf_c_message_init(rd, &r);
  moed_reply(req, (ProtobufCMessage *)&r);
done:
  protobuf_c_message_free_unpacked(m, NULL);
}

/* The status of a kind's regions (all, or the one named). */
void moed_handle_shm_status(moed_server *s, moed_request *req, moed_shm_kind kind) {
  const bool cuda = kind == MOED_SHM_CUDA;
  ProtobufCMessage *in = moed_unpack(req, cuda ? &inference__cuda_shared_memory_status_request__descriptor
                                               : &inference__system_shared_memory_status_request__descriptor);
  if (!in) return;
  const char *name = cuda ? ((Inference__CudaSharedMemoryStatusRequest *)in)->name
                          : ((Inference__SystemSharedMemoryStatusRequest *)in)->name;
  /* the two kinds' messages: one of each member is used */
  typedef union {
    Inference__SystemSharedMemoryStatusResponse__RegionStatus sys;
    Inference__CudaSharedMemoryStatusResponse__RegionStatus cuda;
  } region_status;
  typedef union {
    Inference__SystemSharedMemoryStatusResponse__RegionsEntry sys;
    Inference__CudaSharedMemoryStatusResponse__RegionsEntry cuda;
  } region_entry;
  moed_shm_info *v = NULL;
  region_status *st = NULL;
  region_entry *e = NULL;
  void **pe = NULL;
  long n = 0;
  if (*name && !moed_model_name_ok(name)) {
    moed_reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid region name (%s)",
                     MOED_MODEL_NAME_RULE);
    goto done;
  }
  if (!shm_on(s, req)) goto done;
  n = moed_shm_status(s->shm, kind, name, &v);
  st = calloc(n > 0 ? (size_t)n : 1, sizeof *st);
  e = calloc(n > 0 ? (size_t)n : 1, sizeof *e);
  pe = calloc(n > 0 ? (size_t)n : 1, sizeof *pe);
  if (n < 0 || !st || !e || !pe) {
    moed_reply_error(req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
    goto done;
  }
  if (*name && n == 0) {
    moed_reply_error(req, GRPC_STATUS_NOT_FOUND, "name: no %s shared memory region '%s' is registered",
                     cuda ? "CUDA" : "system", name);
    goto done;
  }
  for (long i = 0; i < n; i++) {
    if (cuda) {
      inference__cuda_shared_memory_status_response__region_status__init(&st[i].cuda);
      inference__cuda_shared_memory_status_response__regions_entry__init(&e[i].cuda);
      st[i].cuda.name = v[i].name;
      st[i].cuda.device_id = (uint64_t)v[i].device_id;
      st[i].cuda.byte_size = v[i].byte_size;
      e[i].cuda.key = v[i].name;
      e[i].cuda.value = &st[i].cuda;
    } else {
      inference__system_shared_memory_status_response__region_status__init(&st[i].sys);
      inference__system_shared_memory_status_response__regions_entry__init(&e[i].sys);
      st[i].sys.name = v[i].name;
      st[i].sys.key = v[i].key;
      st[i].sys.offset = v[i].offset;
      st[i].sys.byte_size = v[i].byte_size;
      e[i].sys.key = v[i].name;
      e[i].sys.value = &st[i].sys;
    }
    pe[i] = &e[i];
  }
  if (cuda) {
    Inference__CudaSharedMemoryStatusResponse r = INFERENCE__CUDA_SHARED_MEMORY_STATUS_RESPONSE__INIT;
    r.n_regions = (size_t)n;
    r.regions = (Inference__CudaSharedMemoryStatusResponse__RegionsEntry **)pe;
    moed_reply(req, &r.base);
  } else {
    Inference__SystemSharedMemoryStatusResponse r = INFERENCE__SYSTEM_SHARED_MEMORY_STATUS_RESPONSE__INIT;
    r.n_regions = (size_t)n;
    r.regions = (Inference__SystemSharedMemoryStatusResponse__RegionsEntry **)pe;
    moed_reply(req, &r.base);
  }
done:
  free(v);
  free(st);
  free(e);
  free(pe);
  protobuf_c_message_free_unpacked(in, NULL);
}
