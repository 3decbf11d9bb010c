/* libFuzzer: the upload state machine (server/upload.c) over random
 * sequences of messages: headers, tensor starts, data chunks (with right or
 * wrong offsets and checksums), raw UploadRequest bytes, then a commit or
 * an abort, each through moed_upload_message as the stream's messages go.
 * The input is a program of such steps (below); the messages are built with
 * protobuf-c, so most inputs reach the checks past decoding and some
 * complete a small valid expert set.
 *
 * Checks beyond "no crash, no leak": once answered the upload takes no
 * more messages; a refusal names a field or its cause in its message; an
 * upload that is neither committed nor failed never answers OK; the upload
 * byte budget returns to 0 when the upload is freed; and nothing of an
 * upload stays in its directory (the repository holds a committed set
 * only through moed_repository_add). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "expert_store.pb-c.h"
#include "moed.h"

static moed_config cfg;
static moed_server srv;

typedef struct reader {
  const uint8_t *p;
  size_t n;
} reader;

static uint8_t byte(reader *r) {
  if (!r->n) return 0;
  r->n--;
  return *r->p++;
}

/* Up to want bytes of the input, in place. */
static const uint8_t *bytes(reader *r, size_t want, size_t *got) {
  *got = want < r->n ? want : r->n;
  const uint8_t *p = r->p;
  r->p += *got;
  r->n -= *got;
  return p;
}

/* The one expert set a valid program builds: bf16, E=2, H=16, I=8. */
static const char *const configs[] = {
    "{\"num_experts\": 2, \"hidden_size\": 16, \"intermediate_size\": 8, \"scheme\": \"bf16\", \"top_k\": 1}",
    "{}",
    "{\"num_experts\": 0}",
    ("{\"num_experts\": 2, \"hidden_size\": 16, \"intermediate_size\": 8, \"scheme\": \"wna16\", \"bits\": "
     "4, "
     "\"group_size\": 8}"),
};
static const char *const names[] = {"fz", "fz2", "quant.per_tensor", "bad/name", "", ".hidden"};
static const char *const tensors[] = {"w13", "w2", "w13_scales", "correction_bias", "w99"};
static const char *const dtypes[] = {"bf16", "fp32", "uint8", "int4", "nope"};
static const int64_t valid_shape[2][3] = {{2, 16, 16}, {2, 16, 8}}; /* w13 [E, 2I, H], w2 [E, H, I] */

typedef struct state {
  uint64_t size, sent; /* the current tensor's bytes as announced, and sent so far */
} state;

static bool send_msg(moed_upload *u, Moe__V1__UploadRequest *m) {
  size_t n = moe__v1__upload_request__get_packed_size(m);
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) abort();
  moe__v1__upload_request__pack(m, buf);
  bool more = moed_upload_message(u, buf, n, false);
  free(buf);
  return more;
}

/* One step of the program; false once the upload is answered. */
static bool step(moed_upload *u, reader *r, state *st, bool *ended) {
  Moe__V1__UploadRequest m = MOE__V1__UPLOAD_REQUEST__INIT;
  Moe__V1__UploadHeader h = MOE__V1__UPLOAD_HEADER__INIT;
  Moe__V1__UploadChunk c = MOE__V1__UPLOAD_CHUNK__INIT;
  Moe__V1__TensorHeader t = MOE__V1__TENSOR_HEADER__INIT;
  uint8_t op = byte(r);
  switch (op % 6) {
  case 0: { /* raw message bytes */
    size_t n;
    const uint8_t *p = bytes(r, byte(r), &n);
    return moed_upload_message(u, p, n, false);
  }
  case 1: { /* a header */
    uint8_t f = byte(r);
    h.name = (char *)names[(f >> 3) % (sizeof names / sizeof names[0])];
    h.config_json = (char *)configs[(f >> 6) % (sizeof configs / sizeof configs[0])];
    h.replace = f & 1;
    h.chunk_offsets = f & 2;
    h.tensor_xxh3 = f & 4;
    m.part_case = MOE__V1__UPLOAD_REQUEST__PART_HEADER;
    m.header = &h;
    return send_msg(u, &m);
  }
  case 2: { /* a tensor's first chunk */
    uint8_t f = byte(r), g = byte(r);
    int which = f % (sizeof tensors / sizeof tensors[0]);
    int64_t shape[4];
    t.name = (char *)tensors[which];
    t.dtype = (char *)dtypes[(f >> 3) % (sizeof dtypes / sizeof dtypes[0])];
    if (which < 2 && (g & 1)) { /* the shape the set needs */
      memcpy(shape, valid_shape[which], sizeof valid_shape[which]);
      t.n_shape = 3;
    } else {
      t.n_shape = g % 5;
      for (size_t d = 0; d < t.n_shape; d++)
        shape[d] = (int8_t)byte(r);
    }
    t.shape = shape;
    uint64_t numel = 1;
    for (size_t d = 0; d < t.n_shape; d++)
      numel *= (uint64_t)shape[d];
    t.nbytes = (g & 2) ? numel * 2 : byte(r); /* bf16's size, or any */
    size_t n;
    const uint8_t *p = bytes(r, (size_t)(byte(r)) * 8, &n);
    c.data.data = (uint8_t *)p;
    c.data.len = n;
    t.xxh3 = (g & 4) ? XXH3_64bits(p, n) : byte(r); /* right when the chunk holds the whole tensor */
    c.tensor = &t;
    c.offset = (g & 8) ? byte(r) : 0;
    st->size = t.nbytes;
    st->sent = n;
    m.part_case = MOE__V1__UPLOAD_REQUEST__PART_CHUNK;
    m.chunk = &c;
    return send_msg(u, &m);
  }
  case 3: { /* more bytes of the tensor */
    uint8_t f = byte(r);
    size_t n;
    const uint8_t *p = bytes(r, (size_t)(byte(r)) * 8, &n);
    c.data.data = (uint8_t *)p;
    c.data.len = n;
    c.offset = (f & 1) ? byte(r) : st->sent; /* where it must start, or anywhere */
    st->sent += n;
    m.part_case = MOE__V1__UPLOAD_REQUEST__PART_CHUNK;
    m.chunk = &c;
    return send_msg(u, &m);
  }
  case 4: /* the client closes: commit */ *ended = true; return moed_upload_message(u, NULL, 0, false);
  default: /* the client goes away */ *ended = true; return moed_upload_message(u, NULL, 0, true);
  }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  char *args[] = {(*argv)[0], NULL};
  if (moed_config_parse(&cfg, 1, args) != 0) abort();
  cfg.max_upload_bytes = 1 << 20;
  cfg.upload_budget_bytes = 1 << 20;
  moed_log_init(MOED_LOG_ERROR, false);
  srv.cfg = &cfg;
  if (moed_repository_create(NULL, &srv.repo) != 0) abort();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  reader r = {data, size};
  state st = {0};
  moed_upload *u = moed_upload_open(&srv);
  if (!u) abort();
  bool ended = false, more = true;
  for (int steps = 0; more && r.n && steps < 64; steps++)
    more = step(u, &r, &st, &ended);
  const char *msg;
  grpc_status_code code = moed_upload_status(u, &msg);
  if (getenv("FUZZ_UPLOAD_VERBOSE")) /* what a seed ends with (fuzz/make_corpus.py) */
    fprintf(stderr, "upload: status %d %s\n", (int)code, msg);
  if (more != (code == GRPC_STATUS_UNKNOWN)) abort();           /* answered exactly when it says it is */
  if (!more && moed_upload_message(u, NULL, 0, false)) abort(); /* nothing after the answer */
  if (code == GRPC_STATUS_OK && !ended) abort();
  if (code != GRPC_STATUS_OK && code != GRPC_STATUS_UNKNOWN && !msg[0]) abort();
  if (code == GRPC_STATUS_OK) { /* served: unloaded again, so that every run starts alike */
    moe_error err;
    if (moed_repository_unload(srv.repo, "fz", &err) != MOE_OK &&
        moed_repository_unload(srv.repo, "fz2", &err) != MOE_OK)
      abort(); /* it answered OK, so one of them is served */
  }
  moed_upload_close(u);
  if (atomic_load(&srv.upload_bytes) != 0) abort();
  return 0;
}
