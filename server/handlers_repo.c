/* handlers_repo: the repository RPCs: RepositoryIndex answered on the
 * loop; RepositoryModelLoad and Unload as jobs on a worker (loading maps
 * and checks files), each change logged with who asked. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "handlers_req.h"

/* ---- the index ------------------------------------------------------------------------------ */

void moed_handle_repository_index(moed_server *s, moed_request *req) {
  Inference__RepositoryIndexRequest *in = moed_unpack(req, &inference__repository_index_request__descriptor);
  if (!in) return;
  moed_index_entry *e = NULL;
  size_t n = moed_repository_index(s->repo, &e);
  Inference__RepositoryIndexResponse__ModelIndex *mi = calloc(n ? n : 1, sizeof *mi);
  Inference__RepositoryIndexResponse__ModelIndex **pmi = calloc(n ? n : 1, sizeof *pmi);
  if (!mi || !pmi) {
    moed_reply_error(req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
  } else {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
      if (in->ready && strcmp(e[i].state, "READY") != 0) continue;
      inference__repository_index_response__model_index__init(&mi[k]);
      mi[k].name = e[i].name;
      mi[k].version = "1";
      mi[k].state = (char *)e[i].state;
      mi[k].reason = e[i].reason;
      pmi[k] = &mi[k];
      k++;
    }
    Inference__RepositoryIndexResponse r = INFERENCE__REPOSITORY_INDEX_RESPONSE__INIT;
    r.n_models = k;
    r.models = pmi;
    moed_reply(req, &r.base);
  }
  free(mi);
  free(pmi);
  free(e);
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

/* ---- changes: jobs on a worker ------------------------------------------------------------- */

typedef struct request_job {
  moed_job job;
  moed_server *srv;
  moed_request *req;
} request_job;

static void job_free(request_job *j) {
  moed_request_free(j->req);
  free(j);
}

/* The key of the first parameter of a load or unload request that moed does
 * not take (NULL: none), as the REST port refuses them: unload_dependents
 * (a bool) means nothing without ensembles and is allowed on unload; a
 * load's config and file overrides are not taken (moed derives every
 * configuration), and one ignored silently would look applied. */
static const char *repo_param_unsupported(const ProtobufCMessage *m, bool load) {
  const Inference__RepositoryModelLoadRequest *l = (const void *)m;
  const Inference__RepositoryModelUnloadRequest *u = (const void *)m;
  const size_t n = load ? l->n_parameters : u->n_parameters;
  for (size_t i = 0; i < n; i++) {
    const char *key = load ? l->parameters[i]->key : u->parameters[i]->key;
    const Inference__ModelRepositoryParameter *v = load ? l->parameters[i]->value : u->parameters[i]->value;
    if (!load && !strcmp(key, "unload_dependents") && v &&
        v->parameter_choice_case == INFERENCE__MODEL_REPOSITORY_PARAMETER__PARAMETER_CHOICE_BOOL_PARAM)
      continue;
    return key;
  }
  return NULL;
}

static void repo_change_run(moed_job *job, moe_backend *b) {
  (void)b;
  request_job *j = (request_job *)job;
  moed_request *req = j->req;
  bool load = req->method == MOED_M_REPOSITORY_LOAD;
  moe_error err = {{0}};
  moe_status st;
  ProtobufCMessage *m = moed_unpack(req, load ? &inference__repository_model_load_request__descriptor
                                              : &inference__repository_model_unload_request__descriptor);
  if (!m) goto done;
  const char *name = load ? ((Inference__RepositoryModelLoadRequest *)m)->model_name
                          : ((Inference__RepositoryModelUnloadRequest *)m)->model_name;
  const char *param = repo_param_unsupported(m, load);
  if (param) {
    st = moe_fail(&err, MOE_EINVAL, "parameters.%.64s: not supported by moed's %s", param,
                  load ? "load" : "unload");
  } else {
    st = load ? moed_repository_load(j->srv->repo, name, &err)
              : moed_repository_unload(j->srv->repo, name, &err);
  }
  /* every change (and every refused one) says who asked; a name that is
   * not valid is not written into the log */
  moed_log(MOED_LOG_INFO, load ? "repository_load" : "repository_unload", "%s: %s, by %s",
           moed_model_name_ok(name) ? name : "(invalid name)", st == MOE_OK ? "done" : err.msg,
           moed_rpc_peer(req->rpc));
  if (st != MOE_OK) {
    moed_rpc_finish(req->rpc, moed_status_from_moe(st), err.msg, NULL);
  } else if (load) {
    Inference__RepositoryModelLoadResponse r = INFERENCE__REPOSITORY_MODEL_LOAD_RESPONSE__INIT;
    moed_rpc_finish(req->rpc, GRPC_STATUS_OK, NULL, moed_rpc_pack(&r.base));
  } else {
    Inference__RepositoryModelUnloadResponse r = INFERENCE__REPOSITORY_MODEL_UNLOAD_RESPONSE__INIT;
    moed_rpc_finish(req->rpc, GRPC_STATUS_OK, NULL, moed_rpc_pack(&r.base));
  }
  protobuf_c_message_free_unpacked(m, NULL);
done:
  job_free(j);
}

static void repo_change_cancel(moed_job *job, moe_backend *b) {
  (void)b;
  request_job *j = (request_job *)job;
  moed_rpc_finish(j->req->rpc, GRPC_STATUS_UNAVAILABLE, "server shutting down", NULL);
  job_free(j);
}

/* Queues a job the sweep does not watch (a repository change is answered by its worker only). */
static bool devices_submit(moed_server *s, moed_job *job) { return moed_devices_submit(s->devices, job); }

/* Repository changes run on a worker (loading maps and checks files). */
void moed_handle_repository_change(moed_server *s, moed_request *req) {
  if (atomic_load(&s->draining)) return moed_refuse(s, req, "server is shutting down");
  request_job *j = calloc(1, sizeof *j);
  if (!j) return moed_refuse(s, req, "server out of memory");
  j->job.run = repo_change_run;
  j->job.cancel = repo_change_cancel;
  j->srv = s;
  j->req = req;
  if (moed_batcher_queue(s, &j->job, devices_submit)) return;
  free(j);
  moed_refuse(s, req, "device queue full");
}
