/* GPU quant-op bench (BENCH.md): the device-to-device copy ceiling and every
 * quant op on bf16 [M, 7168] inputs of 64 MiB, 256 MiB and 1 GiB, timed with
 * events on the backend's stream (warm-up, median of the runs), reported as
 * GB/s of bytes moved (input read once + outputs written once, scales
 * included) and % of the copy bandwidth measured in the same run. The bf16
 * matrix-product ceiling comes from torch (bench/gpu/matmul_ceiling.py,
 * run beside this by tests/gpu/run.sh).
 *
 * --fused: fused_moe instead (BENCH.md shapes and token counts, bf16 and
 * wna16 int4 g128, seeded uniform random routing rotated over 8 draws so
 * that the routed experts' weights are not served from L2): median time,
 * routed-expert weight bytes (+ scales, + activations in and out) / time
 * and % of the copy ceiling, TFLOP/s and % of the matmul ceiling given by
 * --matmul-tflops (bf16; fp8 W8A8 rows: --fp8-matmul-tflops, the fp8 e4m3
 * GEMM's rate; bench/gpu/matmul_ceiling.py, same run).
 *
 *   moe-bench-gpu [--runs N] [--max-mib 1024]
 *   moe-bench-gpu --fused [--runs N] [--matmul-tflops X] [--fp8-matmul-tflops X] [--max-tokens T] [--only
 * NAME|bf16|int4|int8|mxfp4|fp8[,...]]
 *                 [--tokens T1,T2,...] [--tune FILE] [--host-time]
 *
 * --only floor: a layer small enough (E 8, k 2, H 256, I 128) that a
 * call's time is its fixed cost (launches, align and sum, the pipelines'
 * fill); run only when named. --host-time: per cell, on stderr, the host's
 * time to issue one call (no waiting) and the time per call of 8 calls
 * back to back (the device's rate when the host keeps ahead).
 *
 * --tune FILE: also times every tile configuration of the tensor-core path
 * per cell (a table on stderr) and writes the rows where one beats the
 * untuned choice to FILE, in the form of kernels/gpu/fused_moe_tuned.h
 * (the time column is then the untuned choice's). */
#include <ctype.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu.h"
#include "moe/codec.h"
#include "moe/expert_set.h"
#include "moe/ops.h"

#define CHECK(x)                                                                                             \
  do {                                                                                                       \
    hipError_t e_ = (x);                                                                                     \
    if (e_ != hipSuccess) {                                                                                  \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, hipGetErrorString(e_));                     \
      exit(1);                                                                                               \
    }                                                                                                        \
  } while (0)

static int runs = 50;
static bool host_time; /* --host-time */

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* Median milliseconds of `runs` timed repetitions of fn(arg) on stream st:
 * each repetition `rep` calls back to back between the two events, divided
 * by rep. rep = 1 is one call on an idle device (the host's launch latency
 * counted: a few us, which is 10-15% of a 64 MiB quant op); rep > 1 keeps
 * the device busy, the rate of a stream of calls. */
static double time_median_rep(hipStream_t st, void (*fn)(void *), void *arg, int rep) {
  hipEvent_t e0, e1;
  CHECK(hipEventCreate(&e0));
  CHECK(hipEventCreate(&e1));
  for (int i = 0; i < 3; i++)
    fn(arg);
  float *ms = malloc(sizeof *ms * (size_t)runs);
  for (int i = 0; i < runs; i++) {
    CHECK(hipEventRecord(e0, st));
    for (int r = 0; r < rep; r++)
      fn(arg);
    CHECK(hipEventRecord(e1, st));
    CHECK(hipEventSynchronize(e1));
    CHECK(hipEventElapsedTime(&ms[i], e0, e1));
    ms[i] /= (float)rep;
  }
  qsort(ms, (size_t)runs, sizeof *ms, cmp_float);
  double med = ms[runs / 2];
  free(ms);
  CHECK(hipEventDestroy(e0));
  CHECK(hipEventDestroy(e1));
  return med;
}

static double time_median(hipStream_t st, void (*fn)(void *), void *arg) {
  return time_median_rep(st, fn, arg, 1);
}

typedef struct copy_arg {
  void *dst, *src;
  size_t n;
  hipStream_t st;
} copy_arg;

static void run_copy(void *p) {
  copy_arg *a = p;
  CHECK(hipMemcpyAsync(a->dst, a->src, a->n, hipMemcpyDeviceToDevice, a->st));
}

typedef struct op_arg {
  moe_call *c;
  moe_backend *b;
} op_arg;

static void run_op(void *p) {
  op_arg *a = p;
  moe_error err;
  if (moe_call_run(a->c, a->b, &err) != MOE_OK) {
    fprintf(stderr, "run: %s\n", err.msg);
    exit(1);
  }
}

typedef struct bench_case {
  const char *label;
  const char *op;
  moe_param params[3];
  size_t nparams;
  bool static_scale;
  bool two_reads; /* dynamic per-tensor: the input is read twice */
} bench_case;

static moe_param ps(const char *n, const char *v) {
  return (moe_param){.name = n, .type = MOE_PARAM_STRING, .s = v};
}
static moe_param pi(const char *n, int64_t v) {
  return (moe_param){.name = n, .type = MOE_PARAM_INT, .i = v};
}

/* ---- fused_moe ---------------------------------------------------------------------------- */

static uint64_t brng = 0x9E3779B97F4A7C15ull;
static uint64_t bnext(void) {
  brng ^= brng << 13, brng ^= brng >> 7, brng ^= brng << 17;
  return brng;
}
static float bunif(float lo, float hi) { return lo + (hi - lo) * (float)(bnext() >> 40) / (float)(1 << 24); }

/* dst[0, n) on the device from a 64 MiB host pattern of kind: 0 bf16 U(-a, a),
 * 1 random bytes (int4 / e2m1 codes), 2 bf16 scales U(a/2, a), 3 e8m0 bytes
 * a or a + 1, 4 e4m3fn codes (random bytes but NaN), 5 f32 scales U(a/2, a).
 * Patterns repeat every 64 MiB (more than L2); never zeros. */
static void fill_device(moe_backend *b, void *dst, size_t n, int kind, float a) {
  const size_t tile = (size_t)64 << 20;
  size_t len = n < tile ? n : tile;
  uint8_t *h = malloc(len);
  for (size_t i = 0; i + 1 < len; i += 2) {
    if (kind == 5) { /* n is whole f32s */
      const float f = bunif(a / 2, a);
      memcpy(h + i, &f, 4);
      i += 2;
      continue;
    }
    uint16_t v = kind == 1 || kind == 4 ? (uint16_t)bnext()
                 : kind == 3 ? (uint16_t)((unsigned)a + (bnext() & 1) + ((unsigned)a + (bnext() & 1)) * 256u)
                             : moe_f32_to_bf16(kind == 0 ? bunif(-a, a) : bunif(a / 2, a));
    if (kind == 4) /* 0x7F / 0xFF are NaN: 0x7E / 0xFE instead */
      v ^= ((v & 0x7F) == 0x7F ? 1u : 0u) | (((v >> 8) & 0x7F) == 0x7F ? 0x100u : 0u);
    memcpy(h + i, &v, 2);
  }
  moe_backend_copy_in(b, dst, h, len);
  for (size_t off = len; off < n; off += len)
    CHECK(hipMemcpyAsync((char *)dst + off, dst, n - off < len ? n - off : len, hipMemcpyDeviceToDevice,
                         moe_gpu_stream(b)));
  moe_backend_synchronize(b);
  free(h);
}

typedef struct rot_arg {
  moe_call **calls;
  int n, next;
  moe_backend *b;
} rot_arg;

static void run_rot(void *p) {
  rot_arg *a = p;
  moe_error err;
  if (moe_call_run(a->calls[a->next], a->b, &err) != MOE_OK) {
    fprintf(stderr, "fused_moe: %s\n", err.msg);
    exit(1);
  }
  a->next = (a->next + 1) % a->n;
}

static void *dev_alloc(moe_backend *b, size_t n) {
  void *p;
  if (moe_backend_alloc(b, n, &p) != MOE_OK) {
    fprintf(stderr, "device alloc of %zu bytes failed\n", n);
    exit(1);
  }
  return p;
}

/* Quantized weights on the device, w[0..3] = w13 codes and scales, w2
 * codes and scales: wna16 int4 or int8 (bits) with bf16 scales per 128
 * (U(a/2, a), a = 0.5 / sqrt(K), / 16 for int8's 16x wider codes) or mxfp4
 * (mx) with e8m0 scales per 32 (near 1 / (2.93 sqrt(K))); returns the bytes
 * of one expert. */
static size_t packed_weights(moe_backend *b, moe_named_tensor w[4], int64_t E, int64_t H, int64_t I, int bits,
                             bool mx) {
  static const char *const names[4] = {"w13_qweight", "w13_scales", "w2_qweight", "w2_scales"};
  const int64_t g = mx ? 32 : 128;
  size_t per_expert = 0;
  for (int m = 0; m < 2; m++) {
    const int64_t n = m ? H : 2 * I, k = m ? I : H;
    const int64_t kq = k * bits / 8; /* code bytes per row */
    const size_t q = (size_t)(n * kq), sc = (size_t)(n * (k / g)) * (mx ? 1 : 2);
    w[2 * m] = (moe_named_tensor){names[2 * m], {MOE_UINT8, 3, {E, n, kq}, dev_alloc(b, q * E), q * E}};
    w[2 * m + 1] = (moe_named_tensor){
        names[2 * m + 1], {mx ? MOE_UINT8 : MOE_BF16, 3, {E, n, k / g}, dev_alloc(b, sc * E), sc * E}};
    fill_device(b, w[2 * m].tensor.data, q * E, 1, 0);
    fill_device(b, w[2 * m + 1].tensor.data, sc * E, mx ? 3 : 2,
                mx ? 127.0f + floorf(log2f(1.0f / (2.93f * sqrtf((float)k))))
                   : 0.5f / sqrtf((float)k) / (bits == 8 ? 16.0f : 1.0f));
    per_expert += q + sc;
  }
  return per_expert;
}

/* fp8 W8A8 weights on the device (w as packed4_weights'): e4m3fn codes
 * and F32 scales per 128 x 128 block, U(a/2, a) with a = 2 / (224 sqrt(K));
 * returns the bytes of one expert. */
static size_t fp8_weights(moe_backend *b, moe_named_tensor w[4], int64_t E, int64_t H, int64_t I) {
  static const char *const names[4] = {"w13_qweight", "w13_scales", "w2_qweight", "w2_scales"};
  size_t per_expert = 0;
  for (int m = 0; m < 2; m++) {
    const int64_t n = m ? H : 2 * I, k = m ? I : H, nb = (n + 127) / 128, kb = k / 128;
    const size_t q = (size_t)(n * k), sc = (size_t)(nb * kb) * 4;
    w[2 * m] = (moe_named_tensor){names[2 * m], {MOE_UINT8, 3, {E, n, k}, dev_alloc(b, q * E), q * E}};
    w[2 * m + 1] =
        (moe_named_tensor){names[2 * m + 1], {MOE_F32, 3, {E, nb, kb}, dev_alloc(b, sc * E), sc * E}};
    fill_device(b, w[2 * m].tensor.data, q * E, 4, 0);
    fill_device(b, w[2 * m + 1].tensor.data, sc * E, 5, 2.0f / (224.0f * sqrtf((float)k)));
    per_expert += q + sc;
  }
  return per_expert;
}

/* n host bytes of a valid e8m0 scale (the caller frees them) */
static void *host_e8m0(size_t n) {
  void *p = malloc(n);
  if (!p) {
    fprintf(stderr, "out of host memory\n");
    exit(1);
  }
  memset(p, 127, n);
  return p;
}

#define ROT 8

/* --only A,B,...: every entry names part of the layer or the scheme (bf16, int4) */
static bool selected(const char *only, const char *layer, const char *scheme) {
  if (!only) return true;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", only);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
    if (!strstr(layer, tok) && strcmp(scheme, tok)) return false;
  return true;
}

/* --tokens T1,T2,...: the token counts to run (all when absent) */
static bool token_selected(const char *list, int64_t t) {
  if (!list) return true;
  for (const char *p = list; *p;) {
    char *end;
    const long long v = strtoll(p, &end, 10);
    if (end == p) return false;
    if (v == t) return true;
    p = *end == ',' ? end + 1 : end;
  }
  return false;
}

/* Median ms of the rotated calls: `runs` runs, fewer (>= 20) where that
 * would take more than about 3 s; *used: the count. A first single run
 * longer than `limit` ms (> 0) is returned as it is (*used = 1). */
static double time_cell(moe_backend *b, rot_arg *ra, int *used, double limit) {
  const int saved = runs;
  hipEvent_t e0, e1;
  float ms0;
  CHECK(hipEventCreate(&e0));
  CHECK(hipEventCreate(&e1));
  run_rot(ra);
  CHECK(hipEventRecord(e0, moe_gpu_stream(b)));
  run_rot(ra);
  CHECK(hipEventRecord(e1, moe_gpu_stream(b)));
  CHECK(hipEventSynchronize(e1));
  CHECK(hipEventElapsedTime(&ms0, e0, e1));
  CHECK(hipEventDestroy(e0));
  CHECK(hipEventDestroy(e1));
  if (limit > 0 && ms0 > limit) {
    *used = 1;
    return ms0;
  }
  if (ms0 * runs > 3000.0f) runs = ms0 > 150.0f ? 20 : (int)(3000.0f / ms0) < 20 ? 20 : (int)(3000.0f / ms0);
  const double ms = time_median(moe_gpu_stream(b), run_rot, ra);
  if (host_time) { /* the host's issue time per call, and the device's rate for back-to-back calls */
    struct timespec t0, t1;
    CHECK(hipDeviceSynchronize());
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < 50; i++)
      run_rot(ra);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    CHECK(hipDeviceSynchronize());
    const double host =
        ((double)(t1.tv_sec - t0.tv_sec) * 1e6 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e3) / 50;
    fprintf(stderr, "host issue %.1f us/call, one call %.1f us, back to back %.1f us/call\n", host, ms * 1e3,
            time_median_rep(moe_gpu_stream(b), run_rot, ra, 8) * 1e3);
  }
  *used = runs;
  runs = saved;
  return ms;
}

/* ---- --tune: the tile configuration table (kernels/gpu/fused_moe_tuned.h) ---- */

/* A configuration must beat the untuned choice by this much to get a row
 * (run-to-run noise of the bench is 1-3%). */
#define TUNE_MARGIN 0.97

typedef struct tune_pick {
  int64_t avg; /* slots per routed expert, as fused_moe.hip computes it */
  int config;  /* -1: the untuned choice stays */
} tune_pick;

typedef struct tune_state {
  FILE *out;
  tune_pick picks[16];
  int n;
} tune_state;

/* Times every configuration on the prepared calls (the untuned time
 * `untuned` is already measured with MOE_GPU_TC_TUNED=0) and records the
 * winner for this cell. */
static void tune_cell(moe_backend *b, rot_arg *ra, const char *layer, int64_t E, int64_t K, int64_t T,
                      int int4, double untuned, tune_state *ts) {
  double t[TC_CONFIGS];
  int used[TC_CONFIGS], best = -1; /* used: 0 not run (scheme), 1 one run (pruned), else the median's runs */
  for (int c = 0; c < TC_CONFIGS; c++) {
    used[c] = 0;
    /* packed codes never take the wide tile, and tall is the large one for them (fused_moe_tc.hip) */
    if (int4 && (c == TC_WIDE || c == TC_TALL)) continue;
    setenv("MOE_GPU_FUSED_TILE", moe_tc_config_names[c], 1);
    /* a configuration 1.5x slower than the untuned one in a single run is not timed further */
    t[c] = time_cell(b, ra, &used[c], 1.5 * untuned);
    if (used[c] > 1 && (best < 0 || t[c] < t[best])) best = c;
  }
  unsetenv("MOE_GPU_FUSED_TILE");
  const int64_t n = T * K, avg = n / (E < n ? E : n);
  /* a row only where another configuration than the untuned one wins (the
   * untuned one forced measures the untuned time again, give or take the noise) */
  const int pick =
      best >= 0 && best != moe_tc_untuned(int4 ? MOE_SCHEME_WNA16 : MOE_SCHEME_BF16, int4 ? 4 : 0, avg) &&
              t[best] < TUNE_MARGIN * untuned
          ? best
          : -1;
  fprintf(stderr, "| %s | %s | %lld | %lld | %.1f |", layer, int4 ? "wna16 int4 g128" : "bf16", (long long)T,
          (long long)avg, untuned * 1e3);
  for (int c = 0; c < TC_CONFIGS; c++)
    if (!used[c])
      fprintf(stderr, " - |");
    else
      fprintf(stderr, used[c] == 1 ? " (%.0f) |" : " %.1f |", t[c] * 1e3); /* (one run) */
  fprintf(stderr, " %s |\n", pick < 0 ? "untuned" : moe_tc_config_names[pick]);
  if (ts->n < (int)(sizeof ts->picks / sizeof ts->picks[0])) ts->picks[ts->n++] = (tune_pick){avg, pick};
}

/* The rows of one set: each measured avg (token counts with the same avg
 * must agree, else the untuned choice stays) covers the slot counts up to
 * the geometric midpoint to its neighbours. */
static void tune_emit(tune_state *ts, const char *device, int64_t E, int64_t H, int64_t I, int int4) {
  int64_t avg[16];
  int cfg[16], m = 0;
  for (int i = 0; i < ts->n; i++) {
    int j = 0;
    while (j < m && avg[j] != ts->picks[i].avg)
      j++;
    if (j == m)
      avg[m] = ts->picks[i].avg, cfg[m++] = ts->picks[i].config;
    else if (cfg[j] != ts->picks[i].config)
      cfg[j] = -1;
  }
  for (int i = 0; i < m; i++) {
    if (cfg[i] < 0) continue;
    const int64_t lo = i == 0 ? 0 : (int64_t)sqrt((double)avg[i - 1] * (double)avg[i]) + 1;
    fprintf(ts->out, "    {\"%s\", %lld, %lld, %lld, %s, %lld, ", device, (long long)E, (long long)H,
            (long long)I, int4 ? "TW_INT4" : "TW_16", (long long)lo);
    if (i + 1 < m)
      fprintf(ts->out, "%lld, ", (long long)sqrt((double)avg[i] * (double)avg[i + 1]));
    else
      fprintf(ts->out, "INT64_MAX, ");
    fprintf(ts->out, "TC_"); /* the enum: TC_ and the name in capitals */
    for (const char *c = moe_tc_config_names[cfg[i]]; *c; c++)
      fputc(toupper((unsigned char)*c), ts->out);
    fprintf(ts->out, "},\n");
  }
  ts->n = 0;
}

/* The weight schemes a fused cell runs, in table order (--only names them). */
typedef enum { W_BF16, W_PACKED, W_FP8 } weight_kind;
typedef struct {
  const char *name, *label;
  weight_kind kind;
  int bits;          /* W_PACKED: code width */
  bool mx;           /* W_PACKED: e2m1 codes with e8m0 scales (else wna16 codes with bf16 scales per 128) */
  const char *param; /* fused_moe's "scheme" parameter; NULL: the weights' dtypes say it */
  bool tunable;      /* the tile tuner's table covers it (bf16 and wna16 int4) */
} bench_scheme;
static const bench_scheme schemes[] = {
    {"bf16", "bf16", W_BF16, 16, false, NULL, true},
    {"int4", "wna16 int4 g128", W_PACKED, 4, false, NULL, true},
    {"int8", "wna16 int8 g128", W_PACKED, 8, false, NULL, false},
    {"mxfp4", "mxfp4", W_PACKED, 4, true, "mxfp4", false},
    {"fp8", "fp8 block 128", W_FP8, 8, false, "fp8", false},
};

static void bench_fused(moe_backend *b, double copy_gbs, double mm_tflops, double mm8_tflops,
                        int64_t max_tokens, const char *only, const char *only_tokens, FILE *tune) {
  tune_state tt = {tune, {{0}}, 0};
  const char *device = moe_gpu_device_name(b);
  if (tune) {
    setenv("MOE_GPU_TC_TUNED", "0", 1); /* "time (us)" is then the untuned choice's */
    fprintf(stderr, "\n| layer | scheme | T | slots per expert | untuned (us) |");
    for (int c = 0; c < TC_CONFIGS; c++)
      fprintf(stderr, " %s |", moe_tc_config_names[c]);
    fprintf(stderr, " pick |\n|---|---|---|---|---|");
    for (int c = 0; c <= TC_CONFIGS; c++)
      fprintf(stderr, "---|");
    fprintf(stderr, "\n");
    fprintf(tune, "/* Tuned tile configurations of the tensor-core fused_moe (fused_moe_tc.hip's\n"
                  " * Tuned rows; the last row ends the table). Written by\n"
                  " * `moe-bench-gpu --fused --tune FILE` on the device it names; the rows\n"
                  " * below are its output as measured (bench/RESULTS.md, tuner). Only rows\n"
                  " * where a configuration beat the untuned choice by 3%% or more. */\n"
                  "static const Tuned tuned[] = {\n");
  }
  /* opt_in: run only when --only names it. "floor": weights small enough
   * that the call's time is its fixed cost (launches, the align and sum
   * steps, the pipeline's fill and drain), what a decode call pays on top
   * of its weight bytes */
  static const struct {
    const char *name;
    int64_t e, k, h, i;
    bool opt_in;
  } models[] = {{"qwen3-30b-a3b", 128, 8, 2048, 768, false},
                {"mixtral-8x7b", 8, 2, 4096, 14336, false},
                {"deepseek-v3", 256, 8, 7168, 2048, false},
                {"floor", 8, 2, 256, 128, true}};
  static const int64_t tokens[] = {1, 4, 16, 64, 256, 1024, 4096};
  printf("\n| layer | scheme | T | time (us) | routed weight GB | GB/s | %% of copy BW | TFLOP/s | %% of "
         "matmul |\n"
         "|---|---|---|---|---|---|---|---|---|\n");
  for (size_t mi = 0; mi < sizeof models / sizeof models[0]; mi++)
    for (size_t si = 0; si < sizeof schemes / sizeof schemes[0]; si++) {
      const bench_scheme *sc = &schemes[si];
      if (!selected(only, models[mi].name, sc->name)) continue;
      if (models[mi].opt_in && (!only || !strstr(only, models[mi].name))) continue;
      const int64_t E = models[mi].e, K = models[mi].k, H = models[mi].h, I = models[mi].i;
      /* weights on the device, inline inputs of model fused_moe */
      moe_named_tensor w[4];
      size_t nw;
      size_t per_expert; /* bytes one routed expert costs: weights + scales */
      if (sc->kind == W_FP8) {
        per_expert = fp8_weights(b, w, E, H, I);
        nw = 4;
      } else if (sc->kind == W_BF16) {
        size_t b13 = (size_t)(2 * I * H) * 2, b2 = (size_t)(H * I) * 2;
        w[0] = (moe_named_tensor){"w13", {MOE_BF16, 3, {E, 2 * I, H}, dev_alloc(b, b13 * E), b13 * E}};
        w[1] = (moe_named_tensor){"w2", {MOE_BF16, 3, {E, H, I}, dev_alloc(b, b2 * E), b2 * E}};
        fill_device(b, w[0].tensor.data, w[0].tensor.nbytes, 0, 2.0f / sqrtf((float)H));
        fill_device(b, w[1].tensor.data, w[1].tensor.nbytes, 0, 2.0f / sqrtf((float)I));
        nw = 2;
        per_expert = b13 + b2;
      } else {
        per_expert = packed_weights(b, w, E, H, I, sc->bits, sc->mx);
        nw = 4;
      }
      void *hsc[4] = {0}; /* mxfp4: host copies of the scales for prepare (host_e8m0) */
      for (size_t q = 0; sc->mx && q < nw; q++)
        if (strstr(w[q].name, "_scales")) hsc[q] = host_e8m0(w[q].tensor.nbytes);
      const int64_t tmax = max_tokens < 4096 ? max_tokens : 4096;
      void *x = dev_alloc(b, (size_t)(tmax * H) * 2), *out = dev_alloc(b, (size_t)(tmax * H) * 2);
      fill_device(b, x, (size_t)(tmax * H) * 2, 0, 1.0f);
      for (size_t ti = 0; ti < sizeof tokens / sizeof tokens[0]; ti++) {
        const int64_t T = tokens[ti];
        if (T > tmax) break;
        if (!token_selected(only_tokens, T)) continue;
        moe_call *calls[ROT];
        void *dids[ROT], *dw[ROT];
        double wbytes = 0;
        int32_t *ids = malloc((size_t)(T * K) * 4);
        float *tw = malloc((size_t)(T * K) * 4);
        unsigned char *used = malloc((size_t)E);
        for (int r = 0; r < ROT; r++) {
          memset(used, 0, (size_t)E);
          for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < K; j++) {
              int32_t id;
              bool dup;
              do { /* distinct experts per token */
                id = (int32_t)(bnext() % (uint64_t)E);
                dup = false;
                for (int64_t q = 0; q < j; q++)
                  dup |= ids[t * K + q] == id;
              } while (dup);
              ids[t * K + j] = id;
              tw[t * K + j] = bunif(0.05f, 1.0f);
              used[id] = 1;
            }
          for (int64_t e = 0; e < E; e++)
            wbytes += used[e] ? (double)per_expert / ROT : 0.0;
          moe_named_tensor in[7] = {
              {"hidden_states", {MOE_BF16, 2, {T, H}, x, (size_t)(T * H) * 2}},
              {"topk_ids", {MOE_INT32, 2, {T, K}, ids, (size_t)(T * K) * 4}},
              {"topk_weights", {MOE_F32, 2, {T, K}, tw, (size_t)(T * K) * 4}},
          };
          for (size_t q = 0; q < nw; q++) {
            in[3 + q] = w[q];
            /* mxfp4: prepare reads the scale bytes (0xFF is refused): host copies of the same
             * pattern's range, the device buffers put back below */
            if (hsc[q]) in[3 + q].tensor.data = hsc[q];
          }
          moe_error err;
          const moe_param sp = {.name = "scheme", .type = MOE_PARAM_STRING, .s = sc->param};
          const moe_params ps = {&sp, 1};
          if (moe_op_prepare(moe_op_find("fused_moe"), in, 3 + nw, sc->param ? &ps : NULL, NULL, &calls[r],
                             &err) != MOE_OK) {
            fprintf(stderr, "fused_moe prepare: %s\n", err.msg);
            exit(1);
          }
          /* ids were checked on the host; now device copies */
          dids[r] = dev_alloc(b, (size_t)(T * K) * 4);
          dw[r] = dev_alloc(b, (size_t)(T * K) * 4);
          moe_backend_copy_in(b, dids[r], ids, (size_t)(T * K) * 4);
          moe_backend_copy_in(b, dw[r], tw, (size_t)(T * K) * 4);
          for (size_t q = 0; q < moe_call_num_inputs(calls[r]); q++) {
            moe_named_tensor *t = moe_call_input(calls[r], q);
            if (t->name && !strcmp(t->name, "topk_ids")) t->tensor.data = dids[r];
            if (t->name && !strcmp(t->name, "topk_weights")) t->tensor.data = dw[r];
            for (size_t v = 0; sc->mx && t->name && v < nw; v++)
              if (!strcmp(t->name, w[v].name) && hsc[v]) t->tensor.data = w[v].tensor.data;
          }
          moe_call_output(calls[r], 0)->tensor.data = out;
        }
        moe_backend_synchronize(b);
        rot_arg ra = {calls, ROT, 0, b};
        int used_runs;
        const double ms = time_cell(b, &ra, &used_runs, 0);
        if (tune && sc->tunable) tune_cell(b, &ra, models[mi].name, E, K, T, sc->bits == 4, ms, &tt);
        const double bytes = wbytes + 2.0 * (double)(T * H) * 2 + (double)(T * K) * 8;
        const double gbs = bytes / (ms * 1e-3) / 1e9;
        const double flops = 2.0 * (double)T * (double)K * (double)(H * 2 * I + I * H);
        const double tf = flops / (ms * 1e-3) / 1e12;
        printf("| %s | %s | %lld | %.1f | %.3f | %.0f | %.1f%% | %.2f | ", models[mi].name, sc->label,
               (long long)T, ms * 1e3, wbytes / 1e9, gbs, 100.0 * gbs / copy_gbs, tf);
        const double ceiling = sc->kind == W_FP8 ? mm8_tflops : mm_tflops;
        if (ceiling > 0)
          printf("%.2f%% |", 100.0 * tf / ceiling);
        else
          printf("- |");
        printf(" <!-- %d runs -->\n", used_runs);
        fflush(stdout);
        for (int r = 0; r < ROT; r++) {
          moe_call_destroy(calls[r]);
          moe_backend_free(b, dids[r]);
          moe_backend_free(b, dw[r]);
        }
        free(ids);
        free(tw);
        free(used);
      }
      if (tune && sc->tunable) tune_emit(&tt, device, E, H, I, sc->bits == 4);
      moe_backend_free(b, x);
      moe_backend_free(b, out);
      for (size_t q = 0; q < nw; q++) {
        moe_backend_free(b, w[q].tensor.data);
        free(hsc[q]);
      }
    }
  if (tune) {
    fprintf(tune, "    {nullptr, 0, 0, 0, 0, 0, 0, 0},\n};\n");
    unsetenv("MOE_GPU_TC_TUNED");
  }
}

int main(int argc, char **argv) {
  size_t max_mib = 1024;
  bool fused = false;
  double mm_tflops = 0, mm8_tflops = 0;
  int64_t max_tokens = 4096;
  const char *only =
      NULL; /* --only A,B: layers whose name contains each, or a scheme (bf16, int4, int8, mxfp4, fp8) */
  const char *only_tokens = NULL; /* --tokens T1,T2 */
  const char *tune_path = NULL;   /* --tune FILE: the tuned table (with --fused) */
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--runs") && i + 1 < argc)
      runs = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--max-mib") && i + 1 < argc)
      max_mib = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--fused"))
      fused = true;
    else if (!strcmp(argv[i], "--matmul-tflops") && i + 1 < argc)
      mm_tflops = atof(argv[++i]);
    else if (!strcmp(argv[i], "--fp8-matmul-tflops") && i + 1 < argc)
      mm8_tflops = atof(argv[++i]);
    else if (!strcmp(argv[i], "--max-tokens") && i + 1 < argc)
      max_tokens = atol(argv[++i]);
    else if (!strcmp(argv[i], "--only") && i + 1 < argc)
      only = argv[++i];
    else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
      only_tokens = argv[++i];
    else if (!strcmp(argv[i], "--tune") && i + 1 < argc)
      tune_path = argv[++i];
    else if (!strcmp(argv[i], "--host-time"))
      host_time = true;
  }
  setvbuf(stdout, NULL, _IOLBF, 0); /* lines reach a pipe as they are printed */
  const char *why;
  if (moe_backend_device_count(&why) <= 0) {
    printf("skipped: no GPU (%s)\n", why);
    return 0;
  }
  moe_backend *b;
  moe_error err;
  if (moe_backend_open(0, 0, &b, &err) != MOE_OK) {
    fprintf(stderr, "gpu: %s\n", err.msg);
    return 1;
  }
  hipStream_t st = moe_gpu_stream(b);
  int drv = 0, rt = 0;
  hipDriverGetVersion(&drv);
  hipRuntimeGetVersion(&rt);
  printf("device: %s (driver %d, runtime %d), %d SMs; median of %d runs after 3 warm-ups\n",
         moe_backend_name(b), drv, rt, moe_gpu_sm_count(b), runs);

  /* ---- ceiling: D2D copy of 1 GiB, bytes read + written ---- */
  const size_t gib = (size_t)1 << 30;
  void *src, *dst;
  if (moe_backend_alloc(b, gib, &src) || moe_backend_alloc(b, gib, &dst)) {
    fprintf(stderr, "alloc failed\n");
    return 1;
  }
  CHECK(hipMemsetAsync(src, 0x3C, gib, st));
  copy_arg ca = {dst, src, gib, st};
  double copy_ms = time_median(st, run_copy, &ca);
  double copy_gbs = 2.0 * (double)gib / (copy_ms * 1e-3) / 1e9;
  printf("ceiling: D2D copy 1 GiB: %.3f ms, %.1f GB/s (read + write)\n", copy_ms, copy_gbs);
  moe_backend_free(b, dst);
  if (fused) {
    moe_backend_free(b, src);
    FILE *tune = NULL;
    if (tune_path && !(tune = fopen(tune_path, "w"))) {
      perror(tune_path);
      return 1;
    }
    bench_fused(b, copy_gbs, mm_tflops, mm8_tflops, max_tokens, only, only_tokens, tune);
    if (tune && fclose(tune)) {
      perror(tune_path);
      return 1;
    }
    moe_backend_destroy(b);
    return 0;
  }

  /* ---- inputs: random finite bf16 (never zeros), tiled from 64 MiB ---- */
  const size_t tile = (size_t)64 << 20;
  uint16_t *h = malloc(tile);
  uint64_t r = 0x243F6A8885A308D3ull;
  for (size_t i = 0; i < tile / 2; i++) {
    r ^= r << 13, r ^= r >> 7, r ^= r << 17;
    float v = (float)((int64_t)(r >> 40) - (1 << 23)) / (float)(1 << 21); /* about [-4, 4) */
    h[i] = moe_f32_to_bf16(v);
  }
  for (size_t off = 0; off < gib; off += tile)
    moe_backend_copy_in(b, (char *)src + off, h, tile);
  moe_backend_synchronize(b);
  free(h);

  float one = 0.02f;
  bench_case cases[] = {
      {"per_tensor static fp8_e4m3fn", "quant.per_tensor", {ps("out_dtype", "fp8_e4m3fn")}, 1, true, false},
      {"per_tensor static int8", "quant.per_tensor", {ps("out_dtype", "int8")}, 1, true, false},
      {"per_tensor dynamic fp8_e4m3fn", "quant.per_tensor", {ps("out_dtype", "fp8_e4m3fn")}, 1, false, true},
      {"per_token fp8_e4m3fn", "quant.per_token", {ps("out_dtype", "fp8_e4m3fn")}, 1, false, false},
      {"per_token int8", "quant.per_token", {ps("out_dtype", "int8")}, 1, false, false},
      {"per_token_group 128 fp8_e4m3fn", "quant.per_token_group", {pi("group_size", 128)}, 1, false, false},
      {"per_token_group 128 fp8_e4m3fn pow2_up",
       "quant.per_token_group",
       {pi("group_size", 128), ps("scale_rule", "pow2_up")},
       2,
       false,
       false},
      {"mxfp8_e4m3fn (even, rne)", "quant.mx", {ps("format", "mxfp8_e4m3fn")}, 1, false, false},
      {"mxfp4 (even, rne)", "quant.mx", {ps("format", "mxfp4")}, 1, false, false},
      {"mxfp4 (amax_up, half_up)",
       "quant.mx",
       {ps("format", "mxfp4"), ps("scale_rule", "amax_up"), ps("element_rounding", "half_up")},
       3,
       false,
       false},
  };
  const size_t sizes_mib[] = {64, 256, 1024};
  const int64_t k = 7168;
  printf("\n| op | input | M | time (us) | GB/s | %% of copy BW | back to back: time (us) | %% of copy BW "
         "|\n|---|---|---|---|---|---|---|---|\n");
  for (size_t si = 0; si < 3; si++) {
    if (sizes_mib[si] > max_mib) continue;
    int64_t m = (int64_t)((sizes_mib[si] << 20) / (size_t)(k * 2));
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
      bench_case *bc = &cases[ci];
      moe_named_tensor in[2] = {
          {"x", {.dtype = MOE_BF16, .ndim = 2, .shape = {m, k}, .data = src}},
          {"scale", {.dtype = MOE_F32, .ndim = 1, .shape = {1}, .data = &one, .nbytes = 4}}};
      in[0].tensor.nbytes = (size_t)m * (size_t)k * 2;
      moe_params p = {bc->params, bc->nparams};
      moe_call *c;
      if (moe_op_prepare(moe_op_find(bc->op), in, bc->static_scale ? 2 : 1, &p, NULL, &c, &err) != MOE_OK) {
        fprintf(stderr, "%s: %s\n", bc->label, err.msg);
        return 1;
      }
      size_t bytes = in[0].tensor.nbytes;
      void *outs[4] = {0};
      for (size_t o = 0; o < moe_call_num_outputs(c); o++) {
        moe_named_tensor *ot = moe_call_output(c, o);
        if (moe_backend_alloc(b, ot->tensor.nbytes, &outs[o])) {
          fprintf(stderr, "alloc failed\n");
          return 1;
        }
        ot->tensor.data = outs[o];
        bytes += ot->tensor.nbytes;
      }
      if (bc->static_scale) { /* the kernels take the validated value; the buffer lives on the device too */
        void *ds;
        moe_backend_alloc(b, 4, &ds);
        moe_backend_copy_in(b, ds, &one, 4);
        moe_call_input(c, 1)->tensor.data = ds;
      }
      op_arg oa = {c, b};
      double ms = time_median(st, run_op, &oa);
      double gbs = (double)bytes / (ms * 1e-3) / 1e9;
      printf("| %s | %zu MiB | %lld | %.1f | %.0f | %.1f%%", bc->label, sizes_mib[si], (long long)m, ms * 1e3,
             gbs, 100.0 * gbs / copy_gbs);
      const double bound_ms = (double)(bytes + in[0].tensor.nbytes) / (copy_gbs * 1e9) * 1e3;
      if (bc->two_reads) printf(" (%.1f%% of the two-read bound)", 100.0 * bound_ms / ms);
      const double ms8 = time_median_rep(st, run_op, &oa, 8);
      printf(" | %.1f | %.1f%%", ms8 * 1e3, 100.0 * (double)bytes / (ms8 * 1e-3) / 1e9 / copy_gbs);
      if (bc->two_reads) printf(" (%.1f%% of the two-read bound)", 100.0 * bound_ms / ms8);
      printf(" |\n");
      for (size_t o = 0; o < 4; o++)
        if (outs[o]) moe_backend_free(b, outs[o]);
      if (bc->static_scale) moe_backend_free(b, moe_call_input(c, 1)->tensor.data);
      moe_call_destroy(c);
    }
  }
  moe_backend_free(b, src);
  moe_backend_destroy(b);
  return 0;
}
