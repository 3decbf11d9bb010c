/* CPU benchmark of every op (BENCH.md): bytes moved / time as GB/s and the
 * ratio to this machine's memcpy bandwidth measured in the same run with the
 * same thread count; fused_moe also as GFLOP/s and the ratio to OpenBLAS's
 * fp32 GEMM rate on the same threads (the compute ceiling, which binds from
 * a few hundred tokens on). Not a test: prints markdown tables for
 * bench/RESULTS.md, the median and the fastest run of each row (on a shared
 * machine the fastest is the least disturbed).
 *
 *   moe-bench-cpu [--quick] [--quant-only] [--fused-only] [--tokens 1,16,256] [--threads N] [--reference]
 *                 [--in-cache] [--mib 64,1024] [--isa c|avx2|avx512|avx512vbmi] [--cpu-time]
 *
 * --reference runs fused_moe through the CPU backend's reference kernels
 * (the element-wise path the vector decoders replace): old and new in one
 * binary. --in-cache adds the quant ops in cache (implies --quant-only): the
 * compute per element, the figure to tune them by (run it with --threads 1).
 * --mib: the quant table's input sizes (default 64; this VM's L3 is 480 MiB,
 * so 1024 is the one out of every cache). --isa caps the quant ops' lane code
 * (moe_cpu_set_isa_cap): each lower path timed on this machine. --cpu-time
 * (with --threads 1): every time, the memcpy ceiling's too, by the thread's
 * CPU clock instead of the wall clock, for A/B runs on a shared machine.
 */
#include <getopt.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef MOE_BENCH_OPENBLAS
#include <cblas.h>
#endif

#include "cpu/cpu.h"
#include "moe/backend.h"
#include "moe/codec.h"
#include "moe/expert_set.h"
#include "moe/ops.h"

/* The clock of every time taken: wall time, or with --cpu-time (one thread
 * only) the calling thread's CPU time, from which a loaded machine's
 * preemption drops out (its cache and memory traffic do not). */
static clockid_t bench_clock = CLOCK_MONOTONIC;

static double now(void) {
  struct timespec ts;
  clock_gettime(bench_clock, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* splitmix64: seeded, cheap, good enough for benchmark data. */
static uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* as moed's expert sets are allocated (huge pages for large buffers) */
static void *xalloc(size_t n) {
  void *p = moe_host_alloc((n + 63) & ~(size_t)63, 64);
  if (!p) {
    fprintf(stderr, "out of memory (%zu bytes)\n", n);
    exit(1);
  }
  return p;
}

/* bf16 values ~ U(-a, a); written in parallel so pages land on all threads */
static uint16_t *random_bf16(size_t n, float a, uint64_t seed) {
  uint16_t *p = xalloc(n * 2);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) {
    float u = (float)(mix(seed + i) >> 40) * (1.0f / 16777216.0f);
    p[i] = moe_f32_to_bf16((2.0f * u - 1.0f) * a);
  }
  return p;
}

static uint8_t *random_bytes(size_t n, uint64_t seed) {
  uint8_t *p = xalloc(n);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++)
    p[i] = (uint8_t)(mix(seed + i) >> 56);
  return p;
}

/* ---- ceiling ------------------------------------------------------------------ */

static double memcpy_gbs(size_t bytes, int threads) {
  char *a = xalloc(bytes), *b = xalloc(bytes);
  memset(a, 1, bytes);
  memset(b, 2, bytes);
  double best[5];
  for (int r = 0; r < 5; r++) {
    double t0 = now();
#pragma omp parallel num_threads(threads)
    {
      int t = omp_get_thread_num(), n = omp_get_num_threads();
      size_t lo = bytes / (size_t)n * (size_t)t,
             hi = t == n - 1 ? bytes : bytes / (size_t)n * (size_t)(t + 1);
      memcpy(b + lo, a + lo, hi - lo);
    }
    best[r] = now() - t0;
  }
  qsort(best, 5, sizeof best[0], cmp_double);
  free(a);
  free(b);
  return 2.0 * (double)bytes / best[2] / 1e9; /* read + write */
}

/* fp32 GEMM GFLOP/s of OpenBLAS on `threads` threads: the median of 5
 * [n, n] x [n, n] products after a warm-up; 0 in a build without OpenBLAS. */
static double sgemm_gflops(int n, int threads) {
#ifndef MOE_BENCH_OPENBLAS
  (void)n;
  (void)threads;
  return 0.0;
#else
  const size_t nn = (size_t)n * (size_t)n;
  float *a = xalloc(nn * 4), *b = xalloc(nn * 4), *c = xalloc(nn * 4);
  for (size_t i = 0; i < nn; i++) {
    a[i] = (float)(mix(i) >> 40) * (1.0f / 16777216.0f) - 0.5f;
    b[i] = (float)(mix(i + nn) >> 40) * (1.0f / 16777216.0f) - 0.5f;
  }
  openblas_set_num_threads(threads);
  double t[5] = {0};
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n); /* warm-up */
  for (int r = 0; r < 5; r++) {
    double t0 = now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
    t[r] = now() - t0;
  }
  qsort(t, 5, sizeof t[0], cmp_double);
  free(a);
  free(b);
  free(c);
  /* OpenBLAS's threads spin a while after a call before they sleep: left
   * alone they took 80% of the memcpy ceiling that followed on 2 cores */
  sleep(1);
  return 2.0 * (double)n * (double)n * (double)n / t[2] / 1e9;
#endif
}

/* ---- timing an op ------------------------------------------------------------------ */

/* Median seconds of `c` on `b`, after one warm-up, at least `min_runs` and
 * about one second in all; the fastest run in *best when not NULL (on a
 * shared machine the least disturbed one). */
static double time_call(moe_call *c, moe_backend *b, int min_runs, double *best) {
  moe_error err;
  if (moe_call_run(c, b, &err)) {
    fprintf(stderr, "run failed: %s\n", err.msg);
    exit(1);
  }
  double t[64];
  int n = 0;
  double start = now();
  do { /* at least one run */
    double t0 = now();
    moe_call_run(c, b, &err);
    t[n++] = now() - t0;
  } while (n < 64 && (n < min_runs || now() - start < 1.0));
  qsort(t, (size_t)n, sizeof t[0], cmp_double);
  if (best) *best = t[0];
  return t[n / 2];
}

/* Prepares `op`, allocates its outputs, times it; returns seconds; *out_bytes
 * gets the output bytes. */
static double bench_op(const char *op, moe_named_tensor *in, size_t nin, moe_param *p, size_t np,
                       const moe_expert_set *set, moe_backend *b, size_t *out_bytes, double *best) {
  moe_params params = {p, np};
  moe_call *c;
  moe_error err;
  if (moe_op_prepare(moe_op_find(op), in, nin, &params, set, &c, &err)) {
    fprintf(stderr, "%s: %s\n", op, err.msg);
    exit(1);
  }
  *out_bytes = 0;
  for (size_t i = 0; i < moe_call_num_outputs(c); i++) {
    moe_named_tensor *o = moe_call_output(c, i);
    o->tensor.data = xalloc(o->tensor.nbytes ? o->tensor.nbytes : 1);
    memset(o->tensor.data, 0, o->tensor.nbytes);
    *out_bytes += o->tensor.nbytes;
  }
  double t = time_call(c, b, 3, best);
  for (size_t i = 0; i < moe_call_num_outputs(c); i++)
    free(moe_call_output(c, i)->tensor.data);
  moe_call_destroy(c);
  return t;
}

static moe_param pstr(const char *n, const char *v) { return (moe_param){n, MOE_PARAM_STRING, v, 0, 0, 0}; }

/* ---- quant ops ------------------------------------------------------------------------ */

#define PSTR(n, v)                                                                                           \
  { n, MOE_PARAM_STRING, v, 0, 0, 0 }
/* The quant rows: bf16 input, the scale tensor as a second input for the static ops. */
static const struct {
  const char *label, *op;
  int nin;
  moe_param p[3];
  int np;
} quant_cases[] = {
    {"per_tensor static fp8", "quant.per_tensor", 2, {PSTR("out_dtype", "fp8_e4m3fn")}, 1},
    {"per_tensor static int8", "quant.per_tensor", 2, {PSTR("out_dtype", "int8")}, 1},
    {"per_tensor dynamic fp8", "quant.per_tensor", 1, {PSTR("out_dtype", "fp8_e4m3fn")}, 1},
    {"per_token fp8", "quant.per_token", 1, {PSTR("out_dtype", "fp8_e4m3fn")}, 1},
    {"per_token_group 128 fp8", "quant.per_token_group", 1, {PSTR("out_dtype", "fp8_e4m3fn")}, 1},
    {"mxfp8 e4m3fn", "quant.mx", 1, {PSTR("format", "mxfp8_e4m3fn")}, 1},
    {"mxfp4", "quant.mx", 1, {PSTR("format", "mxfp4")}, 1},
};

static void bench_quant(moe_backend *b, double ceiling, size_t mib) {
  int64_t k = 7168, m = (int64_t)(mib << 20) / 2 / k;
  size_t n = (size_t)(m * k);
  uint16_t *x = random_bf16(n, 4.0f, 1);
  float one = 0.05f;
  int64_t shape[2] = {m, k}, sshape[1] = {1};
  moe_named_tensor in[2] = {{"x", {MOE_BF16, 2, {m, k}, x, n * 2}}, {"scale", {MOE_F32, 1, {1}, &one, 4}}};
  (void)shape;
  (void)sshape;
  for (size_t i = 0; i < sizeof quant_cases / sizeof quant_cases[0]; i++) {
    size_t ob;
    moe_param p[3];
    memcpy(p, quant_cases[i].p, sizeof p);
    double best;
    double t = bench_op(quant_cases[i].op, in, (size_t)quant_cases[i].nin, p, (size_t)quant_cases[i].np, NULL,
                        b, &ob, &best);
    /* dynamic per-tensor reads the input twice when it does not fit on chip */
    double bytes = (double)(n * 2 + ob);
    double gbs = bytes / t / 1e9, best_gbs = bytes / best / 1e9;
    printf("| %s | bf16 [%lld, %lld] %zu MiB | %.3f ms | %.2f GB/s | %.0f%% | %.3f ms | %.0f%% |\n",
           quant_cases[i].label, (long long)m, (long long)k, mib, t * 1e3, gbs, 100.0 * gbs / ceiling,
           best * 1e3, 100.0 * best_gbs / ceiling);
  }
  /* the dequant ops back to bf16: codes of the same shape, e8m0 scales near 1 */
  uint8_t *q = random_bytes(n, 2), *e8 = random_bytes(n / 32, 3);
  for (size_t i = 0; i < n / 32; i++)
    e8[i] = (uint8_t)(120 + e8[i] % 16);
  const struct {
    const char *label, *op, *format;
    moe_dtype qt;
    size_t qbytes;
  } dq[] = {{"dequant.per_tensor fp8 -> bf16", "dequant.per_tensor", NULL, MOE_FP8_E4M3FN, n},
            {"dequant.mx mxfp8 -> bf16", "dequant.mx", "mxfp8_e4m3fn", MOE_FP8_E4M3FN, n},
            {"dequant.mx mxfp4 -> bf16", "dequant.mx", "mxfp4", MOE_FP4_E2M1, n / 2}};
  for (size_t i = 0; i < sizeof dq / sizeof dq[0]; i++) {
    const bool mx = dq[i].format != NULL;
    moe_named_tensor din[2] = {
        {"q", {dq[i].qt, 2, {m, k}, q, dq[i].qbytes}},
        {mx ? "scales" : "scale",
         mx ? (moe_tensor){MOE_UINT8, 2, {m, k / 32}, e8, n / 32} : (moe_tensor){MOE_F32, 1, {1}, &one, 4}}};
    moe_param p[2] = {pstr("out_dtype", "bf16"), pstr("format", mx ? dq[i].format : "")};
    size_t ob;
    double best;
    double t = bench_op(dq[i].op, din, 2, p, mx ? 2 : 1, NULL, b, &ob, &best);
    double bytes = (double)(dq[i].qbytes + (mx ? n / 32 : 0) + ob);
    double gbs = bytes / t / 1e9, best_gbs = bytes / best / 1e9;
    printf("| %s | [%lld, %lld] | %.3f ms | %.2f GB/s | %.0f%% | %.3f ms | %.0f%% |\n", dq[i].label,
           (long long)m, (long long)k, t * 1e3, gbs, 100.0 * gbs / ceiling, best * 1e3,
           100.0 * best_gbs / ceiling);
  }
  free(q);
  free(e8);
  free(x);
}

/* The quant ops in cache: bf16 [16, 7168] (224 KiB, in L2), the fastest of
 * 400 calls, as ns per element per thread: the compute an op spends per
 * element, which a shared machine's load disturbs far less than the 64 MiB
 * rows; set against the bytes' time at the measured memcpy rate. */
static void bench_quant_in_cache(moe_backend *b, double ceiling, int threads) {
  int64_t m = 16, k = 7168;
  size_t n = (size_t)(m * k);
  uint16_t *x = random_bf16(n, 4.0f, 1);
  float one = 0.05f;
  moe_named_tensor in[2] = {{"x", {MOE_BF16, 2, {m, k}, x, n * 2}}, {"scale", {MOE_F32, 1, {1}, &one, 4}}};
  printf("| op (in cache, bf16 [16, 7168]) | fastest of 400 | ns per element per thread | bytes at memcpy "
         "speed, ns per element per thread |\n|---|---|---|---|\n");
  for (size_t i = 0; i < sizeof quant_cases / sizeof quant_cases[0]; i++) {
    moe_param p[3];
    memcpy(p, quant_cases[i].p, sizeof p);
    moe_params params = {p, (size_t)quant_cases[i].np};
    moe_call *c;
    moe_error err;
    if (moe_op_prepare(moe_op_find(quant_cases[i].op), in, (size_t)quant_cases[i].nin, &params, NULL, &c,
                       &err)) {
      fprintf(stderr, "%s: %s\n", quant_cases[i].op, err.msg);
      exit(1);
    }
    size_t ob = 0;
    for (size_t o = 0; o < moe_call_num_outputs(c); o++) {
      moe_named_tensor *t = moe_call_output(c, o);
      t->tensor.data = xalloc(t->tensor.nbytes ? t->tensor.nbytes : 1);
      ob += t->tensor.nbytes;
    }
    double best = 1e30;
    for (int r = 0; r < 400; r++) {
      double t0 = now();
      moe_call_run(c, b, &err);
      double d = now() - t0;
      best = d < best ? d : best;
    }
    const double per = best * 1e9 / (double)n * threads;
    const double bytes_per = (double)(n * 2 + ob) / (double)n / (ceiling / threads);
    printf("| %s | %.2f us | %.3f ns | %.3f ns |\n", quant_cases[i].label, best * 1e6, per, bytes_per);
    for (size_t o = 0; o < moe_call_num_outputs(c); o++)
      free(moe_call_output(c, o)->tensor.data);
    moe_call_destroy(c);
  }
  free(x);
}

/* ---- fused_moe ---------------------------------------------------------------------------- */

typedef struct layer {
  const char *name;
  int64_t e, k, h, i;
} layer;

static void bench_fused(moe_backend *b, double ceiling, double gemm, const layer *L, bool wna16,
                        const int *tokens, int nt) {
  moe_expert_config cfg;
  moe_expert_config_defaults(&cfg);
  cfg.scheme = wna16 ? MOE_SCHEME_WNA16 : MOE_SCHEME_BF16;
  cfg.num_experts = cfg.global_num_experts = L->e;
  cfg.hidden_size = L->h;
  cfg.intermediate_size = L->i;
  cfg.routing.top_k = L->k;
  if (wna16) {
    cfg.bits = 4;
    cfg.group_size = 128;
  }
  size_t e = (size_t)L->e, h = (size_t)L->h, in = (size_t)L->i;
  moe_named_tensor t[6];
  size_t nt_w = 0;
  void *bufs[6] = {0};
  if (!wna16) {
    bufs[0] = random_bf16(e * 2 * in * h, 0.03f, 11);
    bufs[1] = random_bf16(e * h * in, 0.03f, 12);
    t[nt_w++] = (moe_named_tensor){"w13", {MOE_BF16, 3, {L->e, 2 * L->i, L->h}, bufs[0], e * 2 * in * h * 2}};
    t[nt_w++] = (moe_named_tensor){"w2", {MOE_BF16, 3, {L->e, L->h, L->i}, bufs[1], e * h * in * 2}};
  } else {
    bufs[0] = random_bytes(e * 2 * in * h / 2, 21);
    bufs[1] = random_bf16(e * 2 * in * (h / 128), 0.004f, 22);
    bufs[2] = random_bytes(e * h * in / 2, 23);
    bufs[3] = random_bf16(e * h * (in / 128), 0.004f, 24);
    t[nt_w++] = (moe_named_tensor){"w13_qweight",
                                   {MOE_UINT8, 3, {L->e, 2 * L->i, L->h / 2}, bufs[0], e * 2 * in * h / 2}};
    t[nt_w++] = (moe_named_tensor){
        "w13_scales", {MOE_BF16, 3, {L->e, 2 * L->i, L->h / 128}, bufs[1], e * 2 * in * (h / 128) * 2}};
    t[nt_w++] =
        (moe_named_tensor){"w2_qweight", {MOE_UINT8, 3, {L->e, L->h, L->i / 2}, bufs[2], e * h * in / 2}};
    t[nt_w++] = (moe_named_tensor){"w2_scales",
                                   {MOE_BF16, 3, {L->e, L->h, L->i / 128}, bufs[3], e * h * (in / 128) * 2}};
  }
  moe_expert_set *set;
  moe_error err;
  if (moe_expert_set_from_tensors(L->name, &cfg, t, nt_w, &set, &err)) {
    fprintf(stderr, "expert set: %s\n", err.msg);
    exit(1);
  }
  double w_per_expert =
      wna16 ? (double)(3 * in * h) / 2 + (double)(3 * in * h / 128) * 2 : (double)(3 * in * h) * 2;
  for (int ti = 0; ti < nt; ti++) {
    int64_t T = tokens[ti];
    size_t tk = (size_t)T * (size_t)L->k;
    uint16_t *x = random_bf16((size_t)T * h, 1.0f, 31);
    int32_t *ids = xalloc(tk * 4);
    float *w = xalloc(tk * 4);
    char *used = calloc(e, 1);
    for (size_t r = 0; r < (size_t)T; r++) /* k distinct experts per token, uniform */
      for (size_t j = 0; j < (size_t)L->k; j++) {
        int32_t id;
        bool dup;
        uint64_t s = r * 131 + j;
        do {
          id = (int32_t)(mix(s++ * 7919) % e);
          dup = false;
          for (size_t q = 0; q < j; q++)
            dup |= ids[r * (size_t)L->k + q] == id;
        } while (dup);
        ids[r * (size_t)L->k + j] = id;
        w[r * (size_t)L->k + j] = 1.0f / (float)L->k;
        used[id] = 1;
      }
    size_t n_used = 0;
    for (size_t q = 0; q < e; q++)
      n_used += used[q];
    moe_named_tensor inputs[3] = {
        {"hidden_states", {MOE_BF16, 2, {T, L->h}, x, (size_t)T * h * 2}},
        {"topk_ids", {MOE_INT32, 2, {T, L->k}, ids, tk * 4}},
        {"topk_weights", {MOE_F32, 2, {T, L->k}, w, tk * 4}},
    };
    size_t ob;
    double best;
    double sec = bench_op("fused_moe", inputs, 3, NULL, 0, set, b, &ob, &best);
    double bytes = w_per_expert * (double)n_used + (double)(T * L->h * 2) * 2 + (double)tk * 8;
    double flops = 2.0 * (double)T * (double)L->k * (double)(h * 2 * in + in * h);
    double gbs = bytes / sec / 1e9, gflops = flops / sec / 1e9;
    printf("| %s | %s | %lld | %.3f ms | %.3f ms | %.2f GB/s | %.0f%% | %.0f%% | %.1f GFLOP/s | %.0f%% | "
           "%.0f%% |\n",
           L->name, wna16 ? "wna16 int4 g128" : "bf16", (long long)T, sec * 1e3, best * 1e3, gbs,
           100.0 * gbs / ceiling, 100.0 * bytes / best / 1e9 / ceiling, gflops, 100.0 * gflops / gemm,
           100.0 * flops / best / 1e9 / gemm);
    fflush(stdout);
    free(x);
    free(ids);
    free(w);
    free(used);
  }
  moe_expert_set_destroy(set);
  for (int q = 0; q < 6; q++)
    free(bufs[q]);
}

/* "1,16,256" into tokens[] (at most max); returns the count, 0 when malformed. */
static int parse_tokens(const char *s, int *tokens, int max) {
  int n = 0;
  for (const char *p = s; *p && n < max;) {
    char *end;
    long v = strtol(p, &end, 10);
    if (end == p || v < 1 || v > 1 << 20 || (*end && *end != ',')) return 0;
    tokens[n++] = (int)v;
    p = *end ? end + 1 : end;
  }
  return n;
}

static bool parse_isa(const char *s, moe_cpu_isa *isa) {
  static const char *const names[] = {"c", "avx2", "avx512", "avx512vbmi"};
  for (int i = 0; i < 4; i++)
    if (strcmp(s, names[i]) == 0) {
      *isa = (moe_cpu_isa)i;
      return true;
    }
  return false;
}

int main(int argc, char **argv) {
  int threads = 0, quick = 0, quant_only = 0, fused_only = 0, reference = 0, in_cache = 0, cpu_time = 0;
  int toks[8] = {1, 16, 256}, nt = 3;
  int mibs[8] = {64}, nm = 1;
  moe_cpu_isa isa = MOE_CPU_ISA_AVX512_VBMI;
  static const struct option opts[] = {
      {"threads", required_argument, 0, 't'}, {"quick", no_argument, 0, 'q'},
      {"quant-only", no_argument, 0, 'Q'},    {"fused-only", no_argument, 0, 'F'},
      {"tokens", required_argument, 0, 'T'},  {"reference", no_argument, 0, 'R'},
      {"in-cache", no_argument, 0, 'C'},      {"mib", required_argument, 0, 'M'},
      {"isa", required_argument, 0, 'I'},     {"cpu-time", no_argument, 0, 'P'},
      {"help", no_argument, 0, 'h'},          {0, 0, 0, 0}};
  for (int ch; (ch = getopt_long(argc, argv, "t:qQFT:RCM:I:Ph", opts, NULL)) != -1;) {
    if (ch == 't')
      threads = atoi(optarg);
    else if (ch == 'q')
      quick = 1;
    else if (ch == 'Q')
      quant_only = 1;
    else if (ch == 'F')
      fused_only = 1;
    else if (ch == 'R')
      reference = 1;
    else if (ch == 'P')
      cpu_time = 1;
    else if (ch == 'C')
      in_cache = quant_only = 1;
    else if (ch == 'T' && (nt = parse_tokens(optarg, toks, 8)) > 0)
      continue;
    else if (ch == 'M' && (nm = parse_tokens(optarg, mibs, 8)) > 0)
      continue;
    else if (ch == 'I' && parse_isa(optarg, &isa))
      continue;
    else {
      printf("usage: %s [--threads N] [--quick] [--quant-only] [--fused-only] [--tokens 1,16,256] "
             "[--reference] [--in-cache] [--mib 64,1024] [--isa c|avx2|avx512|avx512vbmi] [--cpu-time]\n",
             argv[0]);
      return ch == 'h' ? 0 : 2;
    }
  }
  if (quick && nt > 2) nt = 2;
  if (cpu_time && threads != 1) {
    fprintf(stderr, "--cpu-time times one thread: add --threads 1\n");
    return 2;
  }
  if (cpu_time) bench_clock = CLOCK_THREAD_CPUTIME_ID;
  moe_cpu_set_reference_kernels(reference);
  moe_cpu_set_isa_cap(isa);
  moe_backend *b;
  moe_error err;
  if (moe_backend_open(MOE_BACKEND_HOST, threads, &b, &err)) return 1;
  int nthreads = omp_get_max_threads();
  if (threads > 0) nthreads = threads;
  omp_set_num_threads(nthreads);
  double gemm = quant_only ? 0.0 : sgemm_gflops(2048, nthreads);
  double ceiling = memcpy_gbs((size_t)1 << 30, nthreads);
  printf("backend: %s; memcpy ceiling (1 GiB, read+write): %.2f GB/s", moe_backend_name(b), ceiling);
  if (!quant_only && gemm > 0.0)
    printf("; OpenBLAS sgemm [2048]^3 on %d threads: %.1f GFLOP/s", nthreads, gemm);
  if (!quant_only && gemm <= 0.0) printf("; no OpenBLAS in this build: %% of sgemm reads inf");
  printf("%s%s; quant lane code: %s\n\n", reference ? "; fused_moe: reference kernels" : "",
         cpu_time ? "; times: the thread's CPU time" : "",
         (const char *[]){"C", "AVX2", "AVX-512", "AVX-512 VBMI"}[moe_cpu_quant_isa()]);
  if (!fused_only) {
    printf("| op | input | median | GB/s | %% of memcpy | fastest | %% of memcpy (fastest) |\n"
           "|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nm; i++)
      bench_quant(b, ceiling, (size_t)mibs[i]);
  }
  if (in_cache) {
    printf("\n");
    bench_quant_in_cache(b, ceiling, nthreads);
  }
  if (quant_only) {
    moe_backend_destroy(b);
    return 0;
  }
  printf("\n| layer | scheme | T | median | fastest | weight GB/s | %% of memcpy | %% of memcpy (fastest) | "
         "GFLOP/s | "
         "%% of sgemm | %% of sgemm (fastest) |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  static const layer qwen = {"qwen3-30b-a3b", 128, 8, 2048, 768},
                     mixtral = {"mixtral-8x7b", 8, 2, 4096, 14336};
  bench_fused(b, ceiling, gemm, &qwen, true, toks, nt);
  bench_fused(b, ceiling, gemm, &qwen, false, toks, nt);
  bench_fused(b, ceiling, gemm, &mixtral, true, toks, nt);
  bench_fused(b, ceiling, gemm, &mixtral, false, toks, nt);
  moe_backend_destroy(b);
  return 0;
}
