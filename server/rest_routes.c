/* rest_routes: the REST port's endpoints: a request's path (its segments
 * percent-decoded) and method name the gRPC method, and the path and a
 * small JSON body fill its request message; inference goes to
 * rest_infer.c. Anything else is 404 or 405 naming what was asked. */
#include <ctype.h>
#include <http_parser.h>
#include <math.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_number.h"
#include "moe/ipc.h"
#include "rest_call.h"

static void no_endpoint(moed_http_conn *c, const char *path) {
  char why[sizeof((moed_http_request *)0)->path + 32];
  snprintf(why, sizeof why, "no such endpoint: %s", path);
  moed_http_respond_error(c, 404, why);
}

/* ---- routes ---------------------------------------------------------------------------------- */

/* The path's segments into seg[0..n), cut in place; n, or max + 1 when there are more. */
static size_t split_path(char *p, char **seg, size_t max) {
  size_t n = 0;
  char *save = NULL;
  for (char *s = strtok_r(p, "/", &save); s; s = strtok_r(NULL, "/", &save)) {
    if (n == max) return max + 1; /* deeper than any endpoint */
    seg[n++] = s;
  }
  return n;
}

/* Decodes a path segment's percent-encoding (RFC 3986 2.1) in place, as
 * tritonclient.http quotes model names in its paths and Triton decodes them;
 * the name is then checked by the same rule as on gRPC (a decoded '/', quote
 * or newline is refused there, naming the field). NULL, or why not: a '%'
 * without two hex digits, or a %00 that would cut the C string short. */
static const char *pct_decode(char *s) {
  char *w = s;
  for (const char *r = s; *r; r++) {
    if (*r != '%') {
      *w++ = *r;
      continue;
    }
    if (!isxdigit((unsigned char)r[1]) || !isxdigit((unsigned char)r[2]))
      return "'%' not followed by two hex digits";
    const char hex[3] = {r[1], r[2], 0};
    const long v = strtol(hex, NULL, 16);
    if (v == 0) return "%00 (NUL)";
    *w++ = (char)v;
    r += 2;
  }
  *w = 0;
  return NULL;
}

/* The optional JSON body of a repository call, as an object (NULL: none).
 * false: answered 400. */
static bool body_object(moed_http_conn *c, const moed_http_request *rq, cJSON **out) {
  *out = NULL;
  if (!rq->body || !rq->body_len) return true;
  const size_t nul = moed_json_nul_at(rq->body, rq->body_len);
  if (nul < rq->body_len) {
    char why[96];
    snprintf(why, sizeof why, "request: a NUL in a JSON string at byte %zu (it would cut the string short)",
             nul);
    moed_http_respond_error(c, 400, why);
    return false;
  }
  size_t bad_at;
  *out = moed_json_parse_whole(rq->body, rq->body_len, &bad_at);
  if (!*out) {
    char why[64];
    snprintf(why, sizeof why, "request: malformed JSON at byte %zu", bad_at);
    moed_http_respond_error(c, 400, why);
    return false;
  }
  if (!cJSON_IsObject(*out)) {
    cJSON_Delete(*out);
    moed_http_respond_error(c, 400, "request: not a JSON object");
    return false;
  }
  return true;
}

static void repository(moed_rest *r, moed_http_conn *c, moed_http_request *rq, const char *path, char **seg,
                       size_t n) {
  const bool index = n == 3 && !strcmp(seg[2], "index"),
             change = n == 5 && !strcmp(seg[2], "models") &&
                      (!strcmp(seg[4], "load") || !strcmp(seg[4], "unload"));
  char peer[320];
  if (!index && !change) return no_endpoint(c, path);
  if (rq->method != HTTP_POST) return moed_http_respond_error(c, 405, "the repository endpoints take POST");
  if (!moed_rest_allowed(c, rq,
                         index                     ? MOED_M_REPOSITORY_INDEX
                         : !strcmp(seg[4], "load") ? MOED_M_REPOSITORY_LOAD
                                                   : MOED_M_REPOSITORY_UNLOAD,
                         peer))
    return;
  cJSON *j;
  if (!body_object(c, rq, &j)) return;
  const cJSON *params = cJSON_GetObjectItemCaseSensitive(j, "parameters");
  if (index) {
    const cJSON *ready = cJSON_GetObjectItemCaseSensitive(j, "ready");
    Inference__RepositoryIndexRequest m = INFERENCE__REPOSITORY_INDEX_REQUEST__INIT;
    if (ready && !cJSON_IsBool(ready)) {
      moed_http_respond_error(c, 400, "ready: not a boolean");
    } else {
      m.ready = cJSON_IsTrue(ready);
      moed_rest_call(r, c, rq, MOED_M_REPOSITORY_INDEX, &m.base);
    }
  } else {
    bool load = !strcmp(seg[4], "load");
    const cJSON *e = params ? params->child : NULL;
    /* unload_dependents means nothing here (no ensembles); config and files
     * overrides are not taken: moed derives every configuration */
    while (e && !load && !strcmp(e->string, "unload_dependents") && cJSON_IsBool(e))
      e = e->next;
    char why[200];
    if (params && !cJSON_IsObject(params)) {
      moed_http_respond_error(c, 400, "parameters: not a JSON object");
    } else if (e) {
      snprintf(why, sizeof why, "parameters.%.64s: not supported by moed's %s", e->string, seg[4]);
      moed_http_respond_error(c, 400, why);
    } else if (load) {
      Inference__RepositoryModelLoadRequest m = INFERENCE__REPOSITORY_MODEL_LOAD_REQUEST__INIT;
      m.model_name = seg[3];
      moed_rest_call(r, c, rq, MOED_M_REPOSITORY_LOAD, &m.base);
    } else {
      Inference__RepositoryModelUnloadRequest m = INFERENCE__REPOSITORY_MODEL_UNLOAD_REQUEST__INIT;
      m.model_name = seg[3];
      moed_rest_call(r, c, rq, MOED_M_REPOSITORY_UNLOAD, &m.base);
    }
  }
  cJSON_Delete(j);
}

/* /v2/models/NAME[/versions/V][/ACTION] */
static void model(moed_rest *r, moed_http_conn *c, moed_http_request *rq, const char *path, char **seg,
                  size_t n) {
  const char *name = seg[2], *version = "", *action = "";
  size_t at = 3;
  if (n > at + 1 && !strcmp(seg[at], "versions")) {
    version = seg[at + 1];
    at += 2;
  }
  if (n == at + 2 && !strcmp(seg[at], "trace") && !strcmp(seg[at + 1], "setting"))
    return moed_http_respond_error(c, 501, moed_extension_unimplemented("trace"));
  if (n == at + 1)
    action = seg[at];
  else if (n != at)
    return no_endpoint(c, path);
  bool post = !strcmp(action, "infer");
  if (post && rq->method != HTTP_POST) return moed_http_respond_error(c, 405, "infer takes POST");
  if (post) return moed_rest_infer(r, c, rq, name, version);
  /* the GETs on a model: each a request message of (name, version) */
  static const struct {
    const char *action;
    moed_method method;
    const ProtobufCMessageDescriptor *d;
  } gets[] = {
      {"", MOED_M_MODEL_METADATA, &inference__model_metadata_request__descriptor},
      {"ready", MOED_M_MODEL_READY, &inference__model_ready_request__descriptor},
      {"config", MOED_M_MODEL_CONFIG, &inference__model_config_request__descriptor},
      {"stats", MOED_M_MODEL_STATISTICS, &inference__model_statistics_request__descriptor},
  };
  for (size_t i = 0; i < sizeof gets / sizeof gets[0]; i++) {
    if (strcmp(action, gets[i].action)) continue;
    if (rq->method != HTTP_GET) return moed_http_respond_error(c, 405, "this endpoint takes GET");
    union {
      ProtobufCMessage base;
      Inference__ModelMetadataRequest a;
      Inference__ModelReadyRequest b;
      Inference__ModelConfigRequest c;
      Inference__ModelStatisticsRequest d;
    } m;
    protobuf_c_message_init(gets[i].d, &m);
    *(const char **)((char *)&m +
                     protobuf_c_message_descriptor_get_field_by_name(gets[i].d, "name")->offset) = name;
    *(const char **)((char *)&m +
                     protobuf_c_message_descriptor_get_field_by_name(gets[i].d, "version")->offset) = version;
    return moed_rest_call(r, c, rq, gets[i].method, &m.base);
  }
  no_endpoint(c, path);
}

/* A JSON number that is an integer in [0, 2^53] (exact); false otherwise. */
static bool json_u64(const cJSON *v, uint64_t *out) {
  if (!v) return true; /* absent: 0 */
  if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble != floor(v->valuedouble) ||
      v->valuedouble > 9007199254740992.0)
    return false;
  *out = (uint64_t)v->valuedouble;
  return true;
}

#define B64_MAX 128 /* characters of base64 taken for a raw_handle (64 bytes are 88) */

/* Base64 text (Triton's {"b64": ...}) into out[0..cap); its length, or -1
 * when the text is not base64, is longer than B64_MAX or decodes to more
 * than cap bytes. */
static long b64_decode(const char *text, unsigned char *out, size_t cap) {
  const size_t n = strlen(text);
  if (n > B64_MAX) return -1;
  unsigned char buf[B64_MAX / 4 * 3 + 3];
  EVP_ENCODE_CTX *ctx = EVP_ENCODE_CTX_new();
  int len = 0, tail = 0;
  const bool ok = ctx && EVP_DecodeUpdate(ctx, buf, &len, (const unsigned char *)text, (int)n) >= 0 &&
                  EVP_DecodeFinal(ctx, buf + len, &tail) == 1;
  EVP_ENCODE_CTX_free(ctx);
  if (!ok || (size_t)(len + tail) > cap) return -1;
  memcpy(out, buf, (size_t)(len + tail));
  return len + tail;
}

/* POST /v2/cudasharedmemory/region/NAME/register, Triton's body:
 * {"raw_handle": {"b64": BASE64}, "device_id": N, "byte_size": N}. */
static void cuda_register(moed_rest *r, moed_http_conn *c, moed_http_request *rq, const char *name,
                          const cJSON *j) {
  const cJSON *h = cJSON_GetObjectItemCaseSensitive(j, "raw_handle");
  const cJSON *b64 = cJSON_IsObject(h) ? cJSON_GetObjectItemCaseSensitive(h, "b64") : NULL;
  unsigned char handle[MOE_IPC_HANDLE_BYTES + 1]; /* one more: a longer one is seen as such */
  long len = cJSON_IsString(b64) ? b64_decode(b64->valuestring, handle, sizeof handle) : -1;
  uint64_t device = 0, byte_size = 0;
  if (len < 0)
    return moed_http_respond_error(
        c, 400, "raw_handle: missing, or not {\"b64\": base64 of a 64-byte CUDA IPC handle}");
  if (!json_u64(cJSON_GetObjectItemCaseSensitive(j, "device_id"), &device) || device > INT32_MAX)
    return moed_http_respond_error(c, 400, "device_id: not a non-negative integer (a GPU number)");
  if (!json_u64(cJSON_GetObjectItemCaseSensitive(j, "byte_size"), &byte_size))
    return moed_http_respond_error(c, 400, "byte_size: not a non-negative integer (at most 2^53)");
  Inference__CudaSharedMemoryRegisterRequest m = INFERENCE__CUDA_SHARED_MEMORY_REGISTER_REQUEST__INIT;
  m.name = (char *)name;
  m.raw_handle.data = handle;
  m.raw_handle.len = (size_t)len;
  m.device_id = (int64_t)device;
  m.byte_size = byte_size;
  moed_rest_call(r, c, rq, MOED_M_CUDA_SHM_REGISTER, &m.base);
}

/* Triton's shared-memory extensions: /v2/{system,cuda}sharedmemory[/region/NAME]/status (GET),
 * .../register, .../unregister (POST), translated to the gRPC methods. */
static void shared_memory(moed_rest *r, moed_http_conn *c, moed_http_request *rq, const char *path,
                          char **seg, size_t n) {
  const bool cuda = !strcmp(seg[1], "cudasharedmemory");
  const char *name = "";
  size_t at = 2;
  if (n >= 4 && !strcmp(seg[2], "region")) {
    name = seg[3];
    at = 4;
  }
  const char *action = n == at + 1 ? seg[at] : "";
  const bool status = !strcmp(action, "status"), reg = !strcmp(action, "register") && *name,
             unreg = !strcmp(action, "unregister");
  if (!status && !reg && !unreg) return no_endpoint(c, path);
  if (rq->method != (status ? HTTP_GET : HTTP_POST))
    return moed_http_respond_error(c, 405, status ? "status takes GET" : "register and unregister take POST");
  if (status && cuda) {
    Inference__CudaSharedMemoryStatusRequest m = INFERENCE__CUDA_SHARED_MEMORY_STATUS_REQUEST__INIT;
    m.name = (char *)name;
    return moed_rest_call(r, c, rq, MOED_M_CUDA_SHM_STATUS, &m.base);
  }
  if (status) {
    Inference__SystemSharedMemoryStatusRequest m = INFERENCE__SYSTEM_SHARED_MEMORY_STATUS_REQUEST__INIT;
    m.name = (char *)name;
    return moed_rest_call(r, c, rq, MOED_M_SHM_STATUS, &m.base);
  }
  if (unreg && cuda) {
    Inference__CudaSharedMemoryUnregisterRequest m = INFERENCE__CUDA_SHARED_MEMORY_UNREGISTER_REQUEST__INIT;
    m.name = (char *)name;
    return moed_rest_call(r, c, rq, MOED_M_CUDA_SHM_UNREGISTER, &m.base);
  }
  if (unreg) {
    Inference__SystemSharedMemoryUnregisterRequest m =
        INFERENCE__SYSTEM_SHARED_MEMORY_UNREGISTER_REQUEST__INIT;
    m.name = (char *)name;
    return moed_rest_call(r, c, rq, MOED_M_SHM_UNREGISTER, &m.base);
  }
  char peer[320];
  if (!moed_rest_allowed(c, rq, cuda ? MOED_M_CUDA_SHM_REGISTER : MOED_M_SHM_REGISTER, peer)) return;
  cJSON *j;
  if (!body_object(c, rq, &j)) return;
  if (cuda) {
    cuda_register(r, c, rq, name, j);
    return cJSON_Delete(j);
  }
  Inference__SystemSharedMemoryRegisterRequest m = INFERENCE__SYSTEM_SHARED_MEMORY_REGISTER_REQUEST__INIT;
  const cJSON *key = cJSON_GetObjectItemCaseSensitive(j, "key");
  m.name = (char *)name;
  m.key = cJSON_IsString(key) ? key->valuestring : NULL;
  if (!m.key)
    moed_http_respond_error(c, 400, "key: missing or not a string");
  else if (!json_u64(cJSON_GetObjectItemCaseSensitive(j, "offset"), &m.offset))
    moed_http_respond_error(c, 400, "offset: not a non-negative integer (at most 2^53)");
  else if (!json_u64(cJSON_GetObjectItemCaseSensitive(j, "byte_size"), &m.byte_size))
    moed_http_respond_error(c, 400, "byte_size: not a non-negative integer (at most 2^53)");
  else
    moed_rest_call(r, c, rq, MOED_M_SHM_REGISTER, &m.base);
  cJSON_Delete(j);
}

void moed_rest_on_request(moed_http_conn *c, moed_http_request *rq, void *arg) {
  moed_rest *r = arg;
  char *seg[8], path[sizeof rq->path];
  snprintf(path, sizeof path, "%s", rq->path); /* split_path cuts rq->path */
  size_t n = split_path(rq->path, seg, 8);
  for (size_t i = 0; i < n && i < 8; i++) {
    const char *bad = pct_decode(seg[i]);
    if (bad) {
      char why[96];
      snprintf(why, sizeof why, "path: segment %zu: %s", i + 1, bad);
      return moed_http_respond_error(c, 400, why);
    }
  }
  if (n == 0 || n > 8 || strcmp(seg[0], "v2") != 0) return no_endpoint(c, path);
  bool get = rq->method == HTTP_GET;
  if (n >= 2 && !strcmp(seg[1], "repository")) {
    return repository(r, c, rq, path, seg, n);
  }
  if (n >= 3 && !strcmp(seg[1], "models") && !(n == 3 && !strcmp(seg[2], "stats")))
    return model(r, c, rq, path, seg, n);
  if (n >= 3 && (!strcmp(seg[1], "systemsharedmemory") || !strcmp(seg[1], "cudasharedmemory")))
    return shared_memory(r, c, rq, path, seg, n);
  /* Triton's /v2/trace/setting and /v2/logging, whatever the method */
  const char *ext = (n == 3 && !strcmp(seg[1], "trace") && !strcmp(seg[2], "setting")) ||
                            (n == 2 && !strcmp(seg[1], "logging"))
                        ? moed_extension_unimplemented(seg[1])
                        : NULL;
  if (ext) return moed_http_respond_error(c, 501, ext);
  const bool live = n == 3 && !strcmp(seg[1], "health") && !strcmp(seg[2], "live"),
             ready = n == 3 && !strcmp(seg[1], "health") && !strcmp(seg[2], "ready"),
             stats = n == 3 && !strcmp(seg[1], "models"); /* /v2/models/stats: every model's */
  if (n != 1 && !live && !ready && !stats) return no_endpoint(c, path);
  if (!get) return moed_http_respond_error(c, 405, "this endpoint takes GET");
  if (live) {
    Inference__ServerLiveRequest m = INFERENCE__SERVER_LIVE_REQUEST__INIT;
    moed_rest_call(r, c, rq, MOED_M_SERVER_LIVE, &m.base);
  } else if (ready) {
    Inference__ServerReadyRequest m = INFERENCE__SERVER_READY_REQUEST__INIT;
    moed_rest_call(r, c, rq, MOED_M_SERVER_READY, &m.base);
  } else if (stats) {
    Inference__ModelStatisticsRequest m = INFERENCE__MODEL_STATISTICS_REQUEST__INIT;
    moed_rest_call(r, c, rq, MOED_M_MODEL_STATISTICS, &m.base);
  } else {
    Inference__ServerMetadataRequest m = INFERENCE__SERVER_METADATA_REQUEST__INIT;
    moed_rest_call(r, c, rq, MOED_M_SERVER_METADATA, &m.base);
  }
}
