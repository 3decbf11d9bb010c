/* handlers: the protocol. Each request arrives here on the loop thread;
 * small RPCs are answered at once, inference and repository changes become
 * jobs on the device queues. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "expert_store.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"
#include "grpc_service.pb-c.h"
#include "kserve_wire.h"
#include "moed.h"

/* ---- message helpers ------------------------------------------------------------- */

static void reply(moed_request *req, const ProtobufCMessage *m) {
  grpc_byte_buffer *bb = moed_rpc_pack(m);
  if (!bb)
    moed_rpc_finish(req->rpc, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory", NULL);
  else
    moed_rpc_finish(req->rpc, GRPC_STATUS_OK, NULL, bb);
}

static void reply_error(moed_request *req, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void reply_error(moed_request *req, grpc_status_code code, const char *fmt, ...) {
  char msg[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  moed_rpc_finish(req->rpc, code, msg, NULL);
}

/* The request message, or NULL after answering INVALID_ARGUMENT when the
 * bytes are not one (every handler starts here). */
static void *unpack(moed_request *req, const ProtobufCMessageDescriptor *d) {
  grpc_slice sl = moed_rpc_flatten(req->payload);
  char field[96];
  if (moed_wire_nul_string(d, GRPC_SLICE_START_PTR(sl), GRPC_SLICE_LENGTH(sl), field, sizeof field)) {
    grpc_slice_unref(sl);
    reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "%s: contains a NUL byte", field);
    return NULL;
  }
  ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, GRPC_SLICE_LENGTH(sl), GRPC_SLICE_START_PTR(sl));
  grpc_slice_unref(sl);
  if (!m) reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "request: not a valid %s message", d->short_name);
  return m;
}

static const char *version_ok(const char *v) { return (!v || !*v || strcmp(v, "1") == 0) ? NULL : v; }

/* ---- health and server metadata ------------------------------------------------------ */

static void server_metadata(const moed_server *s, moed_request *req) {
  /* the last one only while regions may be registered */
  static char *extensions[] = {"model_repository", "statistics", "grpc_health", "moe_expert_store",
                               "system_shared_memory"};
  Inference__ServerMetadataResponse r = INFERENCE__SERVER_METADATA_RESPONSE__INIT;
  r.name = "moed";
  r.version = MOED_VERSION;
  r.n_extensions = sizeof extensions / sizeof extensions[0] - !s->shm;
  r.extensions = extensions;
  reply(req, &r.base);
}

/* Health service names: "" = live, "moed" and the inference service = ready. */
static int health_status(moed_server *s, const char *service) {
  if (!service || !*service) return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
  if (strcmp(service, "moed") == 0 || strcmp(service, "inference.GRPCInferenceService") == 0)
    return atomic_load(&s->ready) ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                                  : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
  return -1;
}

typedef struct moed_watch {
  struct moed_watch *next;
  moed_rpc *rpc;
  char service[128];
  int last;
} moed_watch;

static void watch_send(moed_watch *w, int status) {
  Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  r.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)status;
  grpc_byte_buffer *bb = moed_rpc_pack(&r.base);
  if (bb) moed_rpc_stream_write(w->rpc, bb);
  w->last = status;
}

void moed_health_changed(moed_server *s) {
  for (moed_watch **pp = &s->watches; *pp;) {
    moed_watch *w = *pp;
    if (moed_rpc_cancelled(w->rpc)) { /* the client went away: drop it */
      *pp = w->next;
      moed_rpc_finish(w->rpc, GRPC_STATUS_CANCELLED, "cancelled", NULL);
      free(w);
      continue;
    }
    int st = health_status(s, w->service);
    if (st < 0) st = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
    if (st != w->last) watch_send(w, st);
    pp = &w->next;
  }
}

void moed_health_close(moed_server *s) {
  while (s->watches) {
    moed_watch *w = s->watches;
    s->watches = w->next;
    moed_rpc_finish(w->rpc, GRPC_STATUS_UNAVAILABLE, "server shutting down", NULL);
    free(w);
  }
}

static void health(moed_server *s, moed_request *req, bool watch) {
  Grpc__Health__V1__HealthCheckRequest *in = unpack(req, &grpc__health__v1__health_check_request__descriptor);
  if (!in) return;
  int st = health_status(s, in->service);
  if (!watch) {
    if (st < 0) {
      reply_error(req, GRPC_STATUS_NOT_FOUND, "service: unknown service '%s'", in->service);
    } else {
      Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
      r.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)st;
      reply(req, &r.base);
    }
  } else {
    moed_watch *w = calloc(1, sizeof *w);
    if (!w) {
      reply_error(req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
    } else { /* the watch keeps the request's reference until it ends */
      w->rpc = req->rpc;
      snprintf(w->service, sizeof w->service, "%s", in->service ? in->service : "");
      watch_send(w, st < 0 ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN : st);
      w->next = s->watches;
      s->watches = w;
    }
  }
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

/* ---- model metadata and config ------------------------------------------------------------ */

static int config_type(const char *kserve) {
  const moed_kserve_type *k = moed_kserve_by_name(kserve);
  return k ? k->config_type : INFERENCE__DATA_TYPE__TYPE_INVALID;
}

static moed_model *model_or_reply(moed_server *s, moed_request *req, const char *name, const char *version) {
  if (!moed_model_name_ok(name)) { /* never echoed: it could forge a line of the client's log */
    reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid model name (%s)", MOED_MODEL_NAME_RULE);
    return NULL;
  }
  moed_model *m = moed_repository_acquire(s->repo, name);
  if (!m) {
    reply_error(req, GRPC_STATUS_NOT_FOUND, "name: model '%s' not found", name ? name : "");
    return NULL;
  }
  if (version_ok(version)) {
    reply_error(req, GRPC_STATUS_NOT_FOUND, "version: model '%s' has no version '%s'", m->name,
                moed_version_shown(version));
    moed_model_release(m);
    return NULL;
  }
  return m;
}

static void model_ready(moed_server *s, moed_request *req) {
  Inference__ModelReadyRequest *in = unpack(req, &inference__model_ready_request__descriptor);
  if (!in) return;
  if (!moed_model_name_ok(in->name)) { /* as model_or_reply: refused, never echoed (REST would echo it) */
    reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid model name (%s)", MOED_MODEL_NAME_RULE);
    protobuf_c_message_free_unpacked(&in->base, NULL);
    return;
  }
  moed_model *m = moed_repository_acquire(s->repo, in->name);
  Inference__ModelReadyResponse r = INFERENCE__MODEL_READY_RESPONSE__INIT;
  r.ready = m && !version_ok(in->version) && atomic_load(&s->ready);
  moed_model_release(m);
  reply(req, &r.base);
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

static void model_metadata(moed_server *s, moed_request *req) {
  Inference__ModelMetadataRequest *in = unpack(req, &inference__model_metadata_request__descriptor);
  if (!in) return;
  moed_model *m = model_or_reply(s, req, in->name, in->version);
  if (m) {
    moed_model_desc md;
    moed_model_describe(s, m, &md);
    Inference__ModelMetadataResponse__TensorMetadata tm[2 * MOED_MAX_IO], *tin[MOED_MAX_IO],
        *tout[MOED_MAX_IO];
    for (size_t i = 0; i < md.n_in + md.n_out; i++) {
      const moed_tensor_desc *v = i < md.n_in ? &md.in[i] : &md.out[i - md.n_in];
      inference__model_metadata_response__tensor_metadata__init(&tm[i]);
      tm[i].name = (char *)v->name;
      tm[i].datatype = (char *)v->datatype;
      tm[i].n_shape = v->rank; /* the full shape: the batch axis, when there is one, is T */
      tm[i].shape = (int64_t *)v->shape;
      if (i < md.n_in)
        tin[i] = &tm[i];
      else
        tout[i - md.n_in] = &tm[i];
    }
    static char *versions[] = {"1"};
    Inference__ModelMetadataResponse r = INFERENCE__MODEL_METADATA_RESPONSE__INIT;
    r.name = m->name;
    r.n_versions = 1;
    r.versions = versions;
    r.platform = "moed";
    r.n_inputs = md.n_in;
    r.inputs = tin;
    r.n_outputs = md.n_out;
    r.outputs = tout;
    reply(req, &r.base);
    moed_model_release(m);
  }
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

static void model_config(moed_server *s, moed_request *req) {
  Inference__ModelConfigRequest *in = unpack(req, &inference__model_config_request__descriptor);
  if (!in) return;
  moed_model *m = model_or_reply(s, req, in->name, in->version);
  if (m) {
    moed_model_desc md;
    moed_model_describe(s, m, &md);
    Inference__ModelInput mi[MOED_MAX_IO], *pmi[MOED_MAX_IO];
    Inference__ModelOutput mo[MOED_MAX_IO], *pmo[MOED_MAX_IO];
    const int32_t mbs = md.max_batch_size;
    const size_t skip = mbs > 0; /* Triton's dims leave out the batch axis */
    for (size_t i = 0; i < md.n_in; i++) {
      inference__model_input__init(&mi[i]);
      mi[i].name = (char *)md.in[i].name;
      mi[i].data_type = (Inference__DataType)config_type(md.in[i].datatype);
      mi[i].n_dims = md.in[i].rank - skip;
      mi[i].dims = md.in[i].shape + skip;
      mi[i].optional = md.in[i].optional;
      pmi[i] = &mi[i];
    }
    for (size_t i = 0; i < md.n_out; i++) {
      inference__model_output__init(&mo[i]);
      mo[i].name = (char *)md.out[i].name;
      mo[i].data_type = (Inference__DataType)config_type(md.out[i].datatype);
      mo[i].n_dims = md.out[i].rank - skip;
      mo[i].dims = md.out[i].shape + skip;
      pmo[i] = &mo[i];
    }
    Inference__ModelParameter pv[3];
    Inference__ModelConfig__ParametersEntry pe[3], *ppe[3];
    size_t np = 0;
    char *json = m->set ? moe_expert_config_to_json(&m->set->cfg) : NULL;
    char *types = moed_model_datatypes_json(&md);
    const struct {
      const char *key, *value;
    } params[] = {
        {"rows_independent", md.rows_independent ? "true" : "false"},
        {"expert_set_config", json},
        {"datatypes", types},
    };
    for (size_t i = 0; i < sizeof params / sizeof params[0]; i++) {
      if (!params[i].value) continue;
      inference__model_parameter__init(&pv[np]);
      inference__model_config__parameters_entry__init(&pe[np]);
      pv[np].string_value = (char *)params[i].value;
      pe[np].key = (char *)params[i].key;
      pe[np].value = &pv[np];
      ppe[np] = &pe[np];
      np++;
    }
    Inference__ModelConfig cfg = INFERENCE__MODEL_CONFIG__INIT;
    cfg.name = m->name;
    cfg.platform = "moed";
    cfg.backend = "moed";
    cfg.max_batch_size = mbs;
    /* the batcher as Triton's dynamic batcher: a batch is sent once it holds
     * max_batch_size rows (the one preferred size) or when the delay
     * passes; the device queues take requests by priority level, and a
     * request's timeout (allowed per request, none by default) rejects it */
    Inference__ModelQueuePolicy qp = INFERENCE__MODEL_QUEUE_POLICY__INIT;
    qp.timeout_action = INFERENCE__MODEL_QUEUE_POLICY__TIMEOUT_ACTION__REJECT;
    qp.allow_timeout_override = true;
    qp.max_queue_size = (uint32_t)s->cfg->max_queue_size;
    int32_t preferred = mbs;
    Inference__ModelDynamicBatching db = INFERENCE__MODEL_DYNAMIC_BATCHING__INIT;
    db.n_preferred_batch_size = 1;
    db.preferred_batch_size = &preferred;
    db.max_queue_delay_microseconds = (uint64_t)s->cfg->max_queue_delay_us;
    db.priority_levels = MOED_PRIORITY_LEVELS;
    db.default_priority_level = MOED_PRIORITY_DEFAULT;
    db.default_queue_policy = &qp;
    if (mbs > 0) cfg.dynamic_batching = &db;
    cfg.n_input = md.n_in;
    cfg.input = pmi;
    cfg.n_output = md.n_out;
    cfg.output = pmo;
    cfg.n_parameters = np;
    cfg.parameters = ppe;
    Inference__ModelConfigResponse r = INFERENCE__MODEL_CONFIG_RESPONSE__INIT;
    r.config = &cfg;
    reply(req, &r.base);
    free(json);
    free(types);
    moed_model_release(m);
  }
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

/* ---- statistics --------------------------------------------------------------------------- */

typedef struct stats_out {
  const char *only; /* NULL: every model */
  Inference__ModelStatistics *v;
  Inference__StatisticDuration *d;
  Inference__InferStatistics *is;
  Inference__InferBatchStatistics *bs, **pbs; /* MOED_BATCH_SIZES per model */
  Inference__StatisticDuration *bd;           /* 3 per batch statistic */
  moed_batch_snapshot *snap;                  /* MOED_BATCH_SIZES, reused per model */
  size_t n, cap;
} stats_out;

static void dur(Inference__StatisticDuration *d, uint64_t count, uint64_t ns) {
  inference__statistic_duration__init(d);
  d->count = count;
  d->ns = ns;
}

static void collect_stats(moed_model *m, void *arg) {
  stats_out *o = arg;
  if ((o->only && strcmp(o->only, m->name) != 0) || o->n == o->cap) return;
  moed_model_stats *st = m->stats;
  Inference__ModelStatistics *ms = &o->v[o->n];
  Inference__InferStatistics *is = &o->is[o->n];
  Inference__StatisticDuration *d = &o->d[o->n * 6];
  inference__model_statistics__init(ms);
  inference__infer_statistics__init(is);
  ms->name = m->name;
  ms->version = "1";
  /* the count first: every time read after it includes at least its requests */
  const uint64_t ok = atomic_load(&st->success_count);
  ms->last_inference = atomic_load(&st->last_inference_ms);
  ms->inference_count = atomic_load(&st->inference_count);
  ms->execution_count = atomic_load(&st->execution_count);
  dur(&d[0], ok, atomic_load(&st->success_ns));
  dur(&d[1], atomic_load(&st->fail_count), atomic_load(&st->fail_ns));
  dur(&d[2], ok, atomic_load(&st->queue_ns));
  dur(&d[3], ok, atomic_load(&st->compute_input_ns));
  dur(&d[4], ok, atomic_load(&st->compute_ns));
  dur(&d[5], ok, atomic_load(&st->compute_output_ns));
  is->success = &d[0];
  is->fail = &d[1];
  is->queue = &d[2];
  is->compute_input = &d[3];
  is->compute_infer = &d[4];
  is->compute_output = &d[5];
  ms->inference_stats = is;
  /* executions per batch size */
  Inference__InferBatchStatistics *bs = &o->bs[o->n * MOED_BATCH_SIZES];
  Inference__InferBatchStatistics **pbs = &o->pbs[o->n * MOED_BATCH_SIZES];
  Inference__StatisticDuration *bd = &o->bd[o->n * MOED_BATCH_SIZES * 3];
  size_t nb = moed_stats_batches(st, o->snap);
  for (size_t i = 0; i < nb; i++) {
    const moed_batch_snapshot *b = &o->snap[i];
    inference__infer_batch_statistics__init(&bs[i]);
    bs[i].batch_size = b->size;
    dur(&bd[i * 3], b->count, b->input_ns);
    dur(&bd[i * 3 + 1], b->count, b->infer_ns);
    dur(&bd[i * 3 + 2], b->count, b->output_ns);
    bs[i].compute_input = &bd[i * 3];
    bs[i].compute_infer = &bd[i * 3 + 1];
    bs[i].compute_output = &bd[i * 3 + 2];
    pbs[i] = &bs[i];
  }
  ms->n_batch_stats = nb;
  ms->batch_stats = pbs;
  o->n++;
}

static void count_models(moed_model *m, void *arg) {
  (void)m;
  (*(size_t *)arg)++;
}

static void model_statistics(moed_server *s, moed_request *req) {
  Inference__ModelStatisticsRequest *in = unpack(req, &inference__model_statistics_request__descriptor);
  if (!in) return;
  stats_out o = {0};
  o.only = in->name && *in->name ? in->name : NULL;
  if (o.only && !moed_model_name_ok(o.only)) {
    reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid model name (%s)", MOED_MODEL_NAME_RULE);
    protobuf_c_message_free_unpacked(&in->base, NULL);
    return;
  }
  moed_repository_foreach(s->repo, count_models, &o.cap);
  o.cap += 8; /* models loaded meanwhile are left out */
  o.v = calloc(o.cap, sizeof *o.v);
  o.is = calloc(o.cap, sizeof *o.is);
  o.d = calloc(o.cap * 6, sizeof *o.d);
  o.bs = calloc(o.cap * MOED_BATCH_SIZES, sizeof *o.bs);
  o.pbs = calloc(o.cap * MOED_BATCH_SIZES, sizeof *o.pbs);
  o.bd = calloc(o.cap * MOED_BATCH_SIZES * 3, sizeof *o.bd);
  o.snap = calloc(MOED_BATCH_SIZES, sizeof *o.snap);
  Inference__ModelStatistics **pv = calloc(o.cap, sizeof *pv);
  if (!o.v || !o.is || !o.d || !o.bs || !o.pbs || !o.bd || !o.snap || !pv) {
    reply_error(req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
    goto done;
  }
  moed_repository_foreach(s->repo, collect_stats, &o);
  if (o.only && o.n == 0) {
    reply_error(req, GRPC_STATUS_NOT_FOUND, "name: model '%s' not found", o.only);
    goto done;
  }
  for (size_t i = 0; i < o.n; i++)
    pv[i] = &o.v[i];
  Inference__ModelStatisticsResponse r = INFERENCE__MODEL_STATISTICS_RESPONSE__INIT;
  r.n_model_stats = o.n;
  r.model_stats = pv;
  reply(req, &r.base);
done:
  free(pv);
  free(o.v);
  free(o.is);
  free(o.d);
  free(o.bs);
  free(o.pbs);
  free(o.bd);
  free(o.snap);
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

/* ---- repository ---------------------------------------------------------------------------- */

static void repository_index(moed_server *s, moed_request *req) {
  Inference__RepositoryIndexRequest *in = unpack(req, &inference__repository_index_request__descriptor);
  if (!in) return;
  moed_index_entry *e = NULL;
  size_t n = moed_repository_index(s->repo, &e);
  Inference__RepositoryIndexResponse__ModelIndex *mi = calloc(n ? n : 1, sizeof *mi);
  Inference__RepositoryIndexResponse__ModelIndex **pmi = calloc(n ? n : 1, sizeof *pmi);
  if (!mi || !pmi) {
    reply_error(req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
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
    reply(req, &r.base);
  }
  free(mi);
  free(pmi);
  free(e);
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

/* ---- shared memory (Triton's extensions; the regions are shm.c's) ---------------------------- */

static bool shm_on(moed_server *s, moed_request *req) {
  if (!s->shm)
    reply_error(req, GRPC_STATUS_FAILED_PRECONDITION, "system shared memory is off (--shm-max-regions 0)");
  return s->shm != NULL;
}

/* Register, or unregister (`reg` false): one scaffold, as in cuda_shm. An
 * unregister's name is checked before the on/off check, a register's by
 * moed_shm_register. Both answers are empty messages. */
static void shm_change(moed_server *s, moed_request *req, bool reg) {
  ProtobufCMessage *m = unpack(req, reg ? &inference__system_shared_memory_register_request__descriptor
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
    reply(req, &r.base);
  } else {
    moed_log(MOED_LOG_INFO, "shm_unregister", "region %s, by %s", *name ? name : "(all)", peer);
    Inference__SystemSharedMemoryUnregisterResponse r =
        INFERENCE__SYSTEM_SHARED_MEMORY_UNREGISTER_RESPONSE__INIT;
    reply(req, &r.base);
  }
done:
  protobuf_c_message_free_unpacked(m, NULL);
}

static void shm_status(moed_server *s, moed_request *req) {
  Inference__SystemSharedMemoryStatusRequest *in =
      unpack(req, &inference__system_shared_memory_status_request__descriptor);
  if (!in) return;
  moed_shm_info *v = NULL;
  Inference__SystemSharedMemoryStatusResponse__RegionStatus *st = NULL;
  Inference__SystemSharedMemoryStatusResponse__RegionsEntry *e = NULL, **pe = NULL;
  long n = 0;
  if (*in->name && !moed_model_name_ok(in->name)) {
    reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid region name (%s)",
                MOED_MODEL_NAME_RULE);
    goto done;
  }
  if (!shm_on(s, req)) goto done;
  n = moed_shm_status(s->shm, in->name, &v);
  st = calloc(n > 0 ? (size_t)n : 1, sizeof *st);
  e = calloc(n > 0 ? (size_t)n : 1, sizeof *e);
  pe = calloc(n > 0 ? (size_t)n : 1, sizeof *pe);
  if (n < 0 || !st || !e || !pe) {
    reply_error(req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
    goto done;
  }
  if (*in->name && n == 0) {
    reply_error(req, GRPC_STATUS_NOT_FOUND, "name: no region '%s' is registered", in->name);
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
  reply(req, &r.base);
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
static void cuda_shm(moed_request *req) {
  if (req->method == MOED_M_CUDA_SHM_REGISTER) {
    reply_error(req, GRPC_STATUS_UNIMPLEMENTED,
                "CUDA shared memory is not supported by moed (no CUDA IPC): register the tensors' host "
                "memory with SystemSharedMemoryRegister instead");
    return;
  }
  const bool status = req->method == MOED_M_CUDA_SHM_STATUS;
  ProtobufCMessage *in = unpack(req, status ? &inference__cuda_shared_memory_status_request__descriptor
                                            : &inference__cuda_shared_memory_unregister_request__descriptor);
  if (!in) return;
  const char *name = status ? ((Inference__CudaSharedMemoryStatusRequest *)in)->name
                            : ((Inference__CudaSharedMemoryUnregisterRequest *)in)->name;
  if (status && *name) {
    reply_error(req, GRPC_STATUS_NOT_FOUND,
                "name: no CUDA shared memory region is registered (moed has none)");
  } else if (status) {
    Inference__CudaSharedMemoryStatusResponse r = INFERENCE__CUDA_SHARED_MEMORY_STATUS_RESPONSE__INIT;
    reply(req, &r.base);
  } else {
    Inference__CudaSharedMemoryUnregisterResponse r = INFERENCE__CUDA_SHARED_MEMORY_UNREGISTER_RESPONSE__INIT;
    reply(req, &r.base);
  }
  protobuf_c_message_free_unpacked(in, NULL);
}

/* ---- jobs on the device queues -------------------------------------------------------------- */

/* Messages up to this size are decoded on the loop (microseconds), so the
 * batcher sees their model and shapes; larger ones are decoded on a worker
 * and run alone (they fill a batch by themselves). */
#define LOOP_DECODE_MAX ((size_t)1 << 20)

typedef struct request_job {
  moed_job job;
  moed_server *srv;
  moed_request *req;
} request_job;

static void job_free(request_job *j) {
  if (j->req->payload) grpc_byte_buffer_destroy(j->req->payload);
  free(j->req);
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
  ProtobufCMessage *m = unpack(req, load ? &inference__repository_model_load_request__descriptor
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

/* Answers a request refused before admission (UNAVAILABLE) and frees it. */
static void refuse(moed_server *s, moed_request *req, const char *why) {
  atomic_fetch_add(&s->rejected, 1);
  moed_request_refuse(req, GRPC_STATUS_UNAVAILABLE, why);
}

/* Queues a job the sweep does not watch (a repository change is answered by its worker only). */
static bool devices_submit(moed_server *s, moed_job *job) { return moed_devices_submit(s->devices, job); }

/* Repository changes run on a worker (loading maps and checks files). */
static void submit_repo_change(moed_server *s, moed_request *req) {
  if (atomic_load(&s->draining)) return refuse(s, req, "server is shutting down");
  request_job *j = calloc(1, sizeof *j);
  if (!j) return refuse(s, req, "server out of memory");
  j->job.run = repo_change_run;
  j->job.cancel = repo_change_cancel;
  j->srv = s;
  j->req = req;
  if (moed_batcher_queue(s, &j->job, devices_submit)) return;
  free(j);
  refuse(s, req, "device queue full");
}

/* Drain and the in-flight limit; false: refused (answered and freed). */
static bool admit(moed_server *s, moed_request *req) {
  if (atomic_load(&s->draining)) {
    refuse(s, req, "server is shutting down");
    return false;
  }
  if (atomic_fetch_add(&s->inflight, 1) >= s->cfg->max_inflight) {
    atomic_fetch_sub(&s->inflight, 1);
    refuse(s, req, "too many requests in flight");
    return false;
  }
  return true; /* admitted: from here the inference path answers it and drops the in-flight count */
}

bool moed_handle_inline(moed_request *req, void *arg) {
  moed_server *s = arg;
  moe_backend *b = s->devices ? moed_devices_inline_backend(s->devices) : NULL;
  if (!b || req->method != MOED_M_MODEL_INFER || !req->payload ||
      grpc_byte_buffer_length(req->payload) > s->cfg->inline_bytes || !moed_infer_inline_ok(s, req->payload))
    return false;
  if (!admit(s, req)) return true;
  moed_infer_req *r = moed_infer_decode(s, req);
  if (r) moed_infer_run(s, b, &r, 1);
  return true;
}

/* Admission, then decode here and batch, or hand a large message to a
 * worker undecoded. */
static void infer(moed_server *s, moed_request *req) {
  if (!admit(s, req)) return;
  if (req->payload && grpc_byte_buffer_length(req->payload) > LOOP_DECODE_MAX)
    return moed_infer_dispatch_raw(s, req);
  moed_infer_req *r = moed_infer_decode(s, req);
  if (!r) return;
  if (moed_infer_failed(r))
    moed_infer_run(s, NULL, &r, 1); /* only answers it */
  else if (moed_infer_batch_rows(r) > 0)
    moed_batcher_submit(s->batcher, r);
  else
    moed_infer_dispatch(s, &r, 1);
}

/* ---- dispatch -------------------------------------------------------------------------------- */

void moed_handle_cancel(void *arg) {
  moed_server *s = arg;
  moed_batcher_sweep(s->batcher);
}

void moed_handle_request(moed_request *req, void *arg) {
  moed_server *s = arg;
  bool keep = false; /* the request was handed on (a job owns it) */
  switch (req->method) {
  case MOED_M_SERVER_LIVE: {
    Inference__ServerLiveResponse r = INFERENCE__SERVER_LIVE_RESPONSE__INIT;
    r.live = true;
    reply(req, &r.base);
    break;
  }
  case MOED_M_SERVER_READY: {
    Inference__ServerReadyResponse r = INFERENCE__SERVER_READY_RESPONSE__INIT;
    r.ready = atomic_load(&s->ready);
    reply(req, &r.base);
    break;
  }
  case MOED_M_MODEL_READY: model_ready(s, req); break;
  case MOED_M_SERVER_METADATA: server_metadata(s, req); break;
  case MOED_M_MODEL_METADATA: model_metadata(s, req); break;
  case MOED_M_MODEL_CONFIG: model_config(s, req); break;
  case MOED_M_MODEL_STATISTICS: model_statistics(s, req); break;
  case MOED_M_REPOSITORY_INDEX: repository_index(s, req); break;
  case MOED_M_HEALTH_CHECK: health(s, req, false); break;
  case MOED_M_HEALTH_WATCH: health(s, req, true); break;
  case MOED_M_SHM_REGISTER: shm_change(s, req, true); break;
  case MOED_M_SHM_UNREGISTER: shm_change(s, req, false); break;
  case MOED_M_SHM_STATUS: shm_status(s, req); break;
  case MOED_M_CUDA_SHM_STATUS:
  case MOED_M_CUDA_SHM_REGISTER:
  case MOED_M_CUDA_SHM_UNREGISTER: cuda_shm(req); break;
  case MOED_M_MODEL_INFER:
    infer(s, req);
    keep = true;
    break;
  case MOED_M_MODEL_STREAM_INFER:
    if (!req->payload) { /* the client closed its side */
      moed_rpc_stream_done(req->rpc);
      break;
    }
    infer(s, req);
    keep = true;
    break;
  case MOED_M_REPOSITORY_LOAD:
  case MOED_M_REPOSITORY_UNLOAD:
  case MOED_M_EXPERT_UPLOAD:
    /* refused for good (not UNAVAILABLE: a retry cannot succeed); an upload
     * stream at its first message */
    if (s->cfg->model_control == MOED_CONTROL_NONE || s->cfg->model_control == MOED_CONTROL_POLL) {
      moed_rpc_finish(req->rpc, GRPC_STATUS_FAILED_PRECONDITION,
                      s->cfg->model_control == MOED_CONTROL_NONE
                          ? "the model repository is not changed by RPC (--model-control-mode none)"
                          : "the model repository follows its directory (--model-control-mode poll)",
                      NULL);
      break;
    }
    if (req->method == MOED_M_EXPERT_UPLOAD)
      moed_upload_handle(s, req);
    else
      submit_repo_change(s, req);
    keep = true;
    break;
  default: moed_rpc_finish(req->rpc, GRPC_STATUS_UNIMPLEMENTED, "unknown method", NULL); break;
  }
  if (!keep) {
    if (req->payload) grpc_byte_buffer_destroy(req->payload);
    free(req);
  }
}
