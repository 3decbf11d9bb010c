/* rest_answer: a finished call's protobuf answer as Triton's REST JSON
 * (inference's own in rest_infer.c): any message written field by field
 * from its descriptor, and the few answers Triton shapes otherwise (the
 * probes' status codes, the config and lists without their wrapper). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rest_call.h"

/* ---- protobuf -> JSON ---------------------------------------------------------------- */

static cJSON *pb_json(const ProtobufCMessage *m);

static bool is_map_entry(const ProtobufCMessageDescriptor *d) {
  return d->n_fields == 2 && !strcmp(d->fields[0].name, "key") && !strcmp(d->fields[1].name, "value");
}

/* One value of field f at p; NULL for bytes (never in these answers). */
static cJSON *pb_value(const ProtobufCFieldDescriptor *f, const void *p) {
  switch (f->type) {
  case PROTOBUF_C_TYPE_INT32:
  case PROTOBUF_C_TYPE_SINT32:
  case PROTOBUF_C_TYPE_SFIXED32: return cJSON_CreateNumber(*(const int32_t *)p);
  case PROTOBUF_C_TYPE_UINT32:
  case PROTOBUF_C_TYPE_FIXED32: return cJSON_CreateNumber(*(const uint32_t *)p);
  case PROTOBUF_C_TYPE_INT64:
  case PROTOBUF_C_TYPE_SINT64:
  case PROTOBUF_C_TYPE_SFIXED64: return cJSON_CreateNumber((double)*(const int64_t *)p);
  case PROTOBUF_C_TYPE_UINT64:
  case PROTOBUF_C_TYPE_FIXED64: return cJSON_CreateNumber((double)*(const uint64_t *)p);
  case PROTOBUF_C_TYPE_FLOAT: return cJSON_CreateNumber(*(const float *)p);
  case PROTOBUF_C_TYPE_DOUBLE: return cJSON_CreateNumber(*(const double *)p);
  case PROTOBUF_C_TYPE_BOOL: return cJSON_CreateBool(*(const protobuf_c_boolean *)p);
  case PROTOBUF_C_TYPE_ENUM: {
    const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(f->descriptor, *(const int *)p);
    return v ? cJSON_CreateString(v->name) : cJSON_CreateNumber(*(const int *)p);
  }
  case PROTOBUF_C_TYPE_STRING: return cJSON_CreateString(*(char *const *)p ? *(char *const *)p : "");
  case PROTOBUF_C_TYPE_MESSAGE: return pb_json(*(ProtobufCMessage *const *)p);
  default: return NULL;
  }
}

static size_t pb_size(const ProtobufCFieldDescriptor *f) {
  switch (f->type) {
  case PROTOBUF_C_TYPE_INT64:
  case PROTOBUF_C_TYPE_SINT64:
  case PROTOBUF_C_TYPE_SFIXED64:
  case PROTOBUF_C_TYPE_UINT64:
  case PROTOBUF_C_TYPE_FIXED64:
  case PROTOBUF_C_TYPE_DOUBLE: return 8;
  case PROTOBUF_C_TYPE_STRING:
  case PROTOBUF_C_TYPE_MESSAGE: return sizeof(void *);
  case PROTOBUF_C_TYPE_BYTES: return sizeof(ProtobufCBinaryData);
  case PROTOBUF_C_TYPE_BOOL: return sizeof(protobuf_c_boolean);
  default: return 4;
  }
}

/* A message as Triton's REST JSON writes it: proto field names, enums by
 * name, maps as objects, every field present (zero values too, as
 * Triton's statistics and config answers show them), oneofs by the member
 * set. Large integers lose precision past 2^53 (JSON numbers). */
static cJSON *pb_json(const ProtobufCMessage *m) {
  if (!m) return cJSON_CreateNull();
  const ProtobufCMessageDescriptor *d = m->descriptor;
  cJSON *o = cJSON_CreateObject();
  for (unsigned i = 0; o && i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    const char *at = (const char *)m + f->offset;
    cJSON *v = NULL;
    if (f->type == PROTOBUF_C_TYPE_BYTES) continue;
    if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
      if (*(const uint32_t *)((const char *)m + f->quantifier_offset) != f->id) continue;
      v = pb_value(f, at);
    } else if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t n = *(const size_t *)((const char *)m + f->quantifier_offset);
      const char *arr = *(char *const *)at;
      bool map = f->type == PROTOBUF_C_TYPE_MESSAGE && is_map_entry(f->descriptor);
      v = map ? cJSON_CreateObject() : cJSON_CreateArray();
      for (size_t k = 0; v && k < n; k++) {
        if (map) {
          const ProtobufCMessage *e = ((ProtobufCMessage *const *)arr)[k];
          const ProtobufCMessageDescriptor *ed = e->descriptor;
          const char *key = *(char *const *)((const char *)e + ed->fields[0].offset);
          cJSON_AddItemToObject(v, key ? key : "",
                                pb_value(&ed->fields[1], (const char *)e + ed->fields[1].offset));
        } else {
          cJSON_AddItemToArray(v, pb_value(f, arr + k * pb_size(f)));
        }
      }
    } else if (f->type == PROTOBUF_C_TYPE_MESSAGE && !*(ProtobufCMessage *const *)at) {
      /* an absent sub-message is left out, except a statistics duration:
       * Triton's REST statistics carry every one (cache_hit, cache_miss at
       * zero included), and clients index them without checking */
      if (f->descriptor != &inference__statistic_duration__descriptor) continue;
      const Inference__StatisticDuration zero = INFERENCE__STATISTIC_DURATION__INIT;
      v = pb_json(&zero.base);
    } else {
      v = pb_value(f, at);
    }
    if (v) cJSON_AddItemToObject(o, f->name, v);
  }
  return o;
}

/* ---- answers ------------------------------------------------------------------------------ */

static void respond_json(moed_http_conn *c, cJSON *j) {
  char *s = j ? cJSON_PrintUnformatted(j) : NULL;
  cJSON_Delete(j);
  if (!s) return moed_http_respond_error(c, 500, "server out of memory");
  uv_buf_t b = uv_buf_init(s, (unsigned)strlen(s));
  moed_http_respond(c, 200, "application/json", NULL, &b, 1, free, s);
}

static const ProtobufCMessageDescriptor *response_descriptor(moed_method m) {
  switch (m) {
  case MOED_M_SERVER_LIVE: return &inference__server_live_response__descriptor;
  case MOED_M_SERVER_READY: return &inference__server_ready_response__descriptor;
  case MOED_M_MODEL_READY: return &inference__model_ready_response__descriptor;
  case MOED_M_SERVER_METADATA: return &inference__server_metadata_response__descriptor;
  case MOED_M_MODEL_METADATA: return &inference__model_metadata_response__descriptor;
  case MOED_M_MODEL_CONFIG: return &inference__model_config_response__descriptor;
  case MOED_M_MODEL_STATISTICS: return &inference__model_statistics_response__descriptor;
  case MOED_M_REPOSITORY_INDEX: return &inference__repository_index_response__descriptor;
  case MOED_M_MODEL_INFER: return &inference__model_infer_response__descriptor;
  case MOED_M_SHM_STATUS: return &inference__system_shared_memory_status_response__descriptor;
  case MOED_M_CUDA_SHM_STATUS: return &inference__cuda_shared_memory_status_response__descriptor;
  default: return NULL; /* load, unload, shared-memory changes: nothing to say */
  }
}

/* A finished call's answer, on the loop. */
void moed_rest_answer(rest_call *k) {
  moed_http_conn *c = k->c;
  if (k->code != GRPC_STATUS_OK)
    return moed_http_respond_error(c, moed_http_status_from_grpc(k->code), k->msg ? k->msg : "failed");
  const ProtobufCMessageDescriptor *d = response_descriptor(k->method);
  if (!d) return moed_http_respond_copy(c, 200, "application/json", "", 0);
  grpc_slice s = moed_rpc_flatten(k->resp);
  ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
  grpc_slice_unref(s);
  if (!m) return moed_http_respond_error(c, 500, "server out of memory");
  switch (k->method) {
  case MOED_M_SERVER_LIVE:
  case MOED_M_SERVER_READY:
  case MOED_M_MODEL_READY: { /* KServe: 200 true, 4xx false; the three answers' one field is the bool */
    bool yes = k->method == MOED_M_SERVER_LIVE    ? ((Inference__ServerLiveResponse *)m)->live
               : k->method == MOED_M_SERVER_READY ? ((Inference__ServerReadyResponse *)m)->ready
                                                  : ((Inference__ModelReadyResponse *)m)->ready;
    char why[240];
    snprintf(why, sizeof why, "model %s is not ready (not loaded, no such model or version, or draining)",
             k->model);
    if (yes)
      moed_http_respond_copy(c, 200, "text/plain", "", 0);
    else
      moed_http_respond_error(c, 400, k->method == MOED_M_MODEL_READY ? why : "server not ready");
    break;
  }
  case MOED_M_MODEL_CONFIG: /* Triton answers the config itself */
    respond_json(c, pb_json(&((Inference__ModelConfigResponse *)m)->config->base));
    break;
  case MOED_M_REPOSITORY_INDEX: { /* Triton answers the list itself */
    cJSON *j = pb_json(m), *models = cJSON_DetachItemFromObject(j, "models");
    cJSON_Delete(j);
    respond_json(c, models);
    break;
  }
  case MOED_M_MODEL_INFER: moed_rest_answer_infer(k, (Inference__ModelInferResponse *)m); break;
  case MOED_M_SHM_STATUS:
  case MOED_M_CUDA_SHM_STATUS: { /* Triton answers a list of the regions, not the map */
    cJSON *j = pb_json(m), *map = cJSON_GetObjectItemCaseSensitive(j, "regions"), *list = cJSON_CreateArray();
    for (cJSON *e = map ? map->child : NULL; list && e;) {
      cJSON *next = e->next;
      cJSON_AddItemToArray(list, cJSON_DetachItemViaPointer(map, e));
      e = next;
    }
    cJSON_Delete(j);
    respond_json(c, list);
    break;
  }
  default: respond_json(c, pb_json(m)); break;
  }
  protobuf_c_message_free_unpacked(m, NULL);
}
