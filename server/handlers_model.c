/* handlers_model: what a client reads about a model: ModelReady,
 * ModelMetadata and ModelConfig (from model_desc.c's description, shaped as
 * Triton answers them), and ModelStatistics (model_stats.c's counters). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "handlers_req.h"
#include "kserve_wire.h"

/* ---- model metadata and config ------------------------------------------------------------ */

static int config_type(const char *kserve) {
  const moed_kserve_type *k = moed_kserve_by_name(kserve);
  return k ? k->config_type : INFERENCE__DATA_TYPE__TYPE_INVALID;
}

static moed_model *model_or_reply(moed_server *s, moed_request *req, const char *name, const char *version) {
  if (!moed_model_name_ok(name)) { /* never echoed: it could forge a line of the client's log */
    moed_reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid model name (%s)",
                     MOED_MODEL_NAME_RULE);
    return NULL;
  }
  moed_model *m = moed_repository_acquire(s->repo, name);
  if (!m) {
    moed_reply_error(req, GRPC_STATUS_NOT_FOUND, "name: model '%s' not found", name ? name : "");
    return NULL;
  }
  if (moed_version_other(version)) {
    moed_reply_error(req, GRPC_STATUS_NOT_FOUND, "version: model '%s' has no version '%s'", m->name,
                     moed_version_shown(version));
    moed_model_release(m);
    return NULL;
  }
  return m;
}

void moed_handle_model_ready(moed_server *s, moed_request *req) {
  Inference__ModelReadyRequest *in = moed_unpack(req, &inference__model_ready_request__descriptor);
  if (!in) return;
  if (!moed_model_name_ok(in->name)) { /* as model_or_reply: refused, never echoed (REST would echo it) */
    moed_reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid model name (%s)",
                     MOED_MODEL_NAME_RULE);
    protobuf_c_message_free_unpacked(&in->base, NULL);
    return;
  }
  moed_model *m = moed_repository_acquire(s->repo, in->name);
  Inference__ModelReadyResponse r = INFERENCE__MODEL_READY_RESPONSE__INIT;
  r.ready = m && !moed_version_other(in->version) && atomic_load(&s->ready);
  moed_model_release(m);
  moed_reply(req, &r.base);
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

void moed_handle_model_metadata(moed_server *s, moed_request *req) {
  Inference__ModelMetadataRequest *in = moed_unpack(req, &inference__model_metadata_request__descriptor);
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
    moed_reply(req, &r.base);
    moed_model_release(m);
  }
  protobuf_c_message_free_unpacked(&in->base, NULL);
}

void moed_handle_model_config(moed_server *s, moed_request *req) {
  Inference__ModelConfigRequest *in = moed_unpack(req, &inference__model_config_request__descriptor);
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
    moed_reply(req, &r.base);
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
  /* each model's name: the model may be unloaded (and freed) once the
   * repository's lock is dropped, before the answer is packed */
  char (*names)[sizeof((moed_model *)0)->name];
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
  memcpy(o->names[o->n], m->name, sizeof o->names[o->n]);
  ms->name = o->names[o->n];
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

void moed_handle_model_statistics(moed_server *s, moed_request *req) {
  Inference__ModelStatisticsRequest *in = moed_unpack(req, &inference__model_statistics_request__descriptor);
  if (!in) return;
  stats_out o = {0};
  o.only = in->name && *in->name ? in->name : NULL;
  if (o.only && !moed_model_name_ok(o.only)) {
    moed_reply_error(req, GRPC_STATUS_INVALID_ARGUMENT, "name: not a valid model name (%s)",
                     MOED_MODEL_NAME_RULE);
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
  o.names = calloc(o.cap, sizeof *o.names);
  Inference__ModelStatistics **pv = calloc(o.cap, sizeof *pv);
  if (!o.v || !o.is || !o.d || !o.bs || !o.pbs || !o.bd || !o.snap || !o.names || !pv) {
    moed_reply_error(req, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory");
    goto done;
  }
  moed_repository_foreach(s->repo, collect_stats, &o);
  if (o.only && o.n == 0) {
    moed_reply_error(req, GRPC_STATUS_NOT_FOUND, "name: model '%s' not found", o.only);
    goto done;
  }
  /* as metadata and config answer it: another version's statistics are
   * not version 1's (without a name every model's are asked for) */
  if (o.only && moed_version_other(in->version)) {
    moed_reply_error(req, GRPC_STATUS_NOT_FOUND, "version: model '%s' has no version '%s'", o.only,
                     moed_version_shown(in->version));
    goto done;
  }
  for (size_t i = 0; i < o.n; i++)
    pv[i] = &o.v[i];
  Inference__ModelStatisticsResponse r = INFERENCE__MODEL_STATISTICS_RESPONSE__INIT;
  r.n_model_stats = o.n;
  r.model_stats = pv;
  moed_reply(req, &r.base);
done:
  free(pv);
  free(o.v);
  free(o.is);
  free(o.d);
  free(o.bs);
  free(o.pbs);
  free(o.bd);
  free(o.snap);
  free(o.names);
  protobuf_c_message_free_unpacked(&in->base, NULL);
}
