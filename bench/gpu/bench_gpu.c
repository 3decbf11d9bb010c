/* GPU quant-op bench (BENCH.md): the device-to-device copy ceiling and every
 * quant op on bf16 [M, 7168] inputs of 64 MiB, 256 MiB and 1 GiB, timed with
 * events on the backend's stream (warm-up, median of the runs), reported as
 * GB/s of bytes moved (input read once + outputs written once, scales
 * included) and % of the copy bandwidth measured in the same run. The bf16
 * matrix-product ceiling comes from torch (bench/gpu/matmul_ceiling.py,
 * run beside this by tests/gpu/run.sh).
 *
 *   moe-bench-gpu [--runs N] [--max-mib 1024]                                */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"
#include "moe/codec.h"
#include "moe/ops.h"

#define CHECK(x)                                                                                                   \
  do {                                                                                                             \
    hipError_t e_ = (x);                                                                                           \
    if (e_ != hipSuccess) {                                                                                        \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, hipGetErrorString(e_));                            \
      exit(1);                                                                                                     \
    }                                                                                                              \
  } while (0)

static int runs = 50;

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* Median milliseconds of `runs` timed repetitions of fn(arg) on stream st. */
static double time_median(hipStream_t st, void (*fn)(void *), void *arg) {
  hipEvent_t e0, e1;
  CHECK(hipEventCreate(&e0));
  CHECK(hipEventCreate(&e1));
  for (int i = 0; i < 3; i++) fn(arg);
  float *ms = malloc(sizeof *ms * (size_t)runs);
  for (int i = 0; i < runs; i++) {
    CHECK(hipEventRecord(e0, st));
    fn(arg);
    CHECK(hipEventRecord(e1, st));
    CHECK(hipEventSynchronize(e1));
    CHECK(hipEventElapsedTime(&ms[i], e0, e1));
  }
  qsort(ms, (size_t)runs, sizeof *ms, cmp_float);
  double med = ms[runs / 2];
  free(ms);
  CHECK(hipEventDestroy(e0));
  CHECK(hipEventDestroy(e1));
  return med;
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

static moe_param ps(const char *n, const char *v) { return (moe_param){.name = n, .type = MOE_PARAM_STRING, .s = v}; }

int main(int argc, char **argv) {
  size_t max_mib = 1024;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--max-mib") && i + 1 < argc) max_mib = (size_t)atol(argv[++i]);
  }
  const char *why;
  if (moe_backend_gpu_count(&why) <= 0) {
    printf("skipped: no GPU (%s)\n", why);
    return 0;
  }
  moe_backend *b;
  moe_error err;
  if (moe_backend_gpu_create(0, &b, &err) != MOE_OK) {
    fprintf(stderr, "gpu: %s\n", err.msg);
    return 1;
  }
  hipStream_t st = moe_gpu_stream(b);
  int drv = 0, rt = 0;
  hipDriverGetVersion(&drv);
  hipRuntimeGetVersion(&rt);
  printf("device: %s (driver %d, runtime %d), %d SMs; median of %d runs after 3 warm-ups\n", b->name, drv, rt,
         moe_gpu_sm_count(b), runs);

  /* ---- ceiling: D2D copy of 1 GiB, bytes read + written ---- */
  const size_t gib = (size_t)1 << 30;
  void *src, *dst;
  if (b->iface->alloc(b, gib, &src) || b->iface->alloc(b, gib, &dst)) {
    fprintf(stderr, "alloc failed\n");
    return 1;
  }
  CHECK(hipMemsetAsync(src, 0x3C, gib, st));
  copy_arg ca = {dst, src, gib, st};
  double copy_ms = time_median(st, run_copy, &ca);
  double copy_gbs = 2.0 * (double)gib / (copy_ms * 1e-3) / 1e9;
  printf("ceiling: D2D copy 1 GiB: %.3f ms, %.1f GB/s (read + write)\n", copy_ms, copy_gbs);
  b->iface->free(b, dst);

  /* ---- inputs: random finite bf16 (never zeros), tiled from 64 MiB ---- */
  const size_t tile = (size_t)64 << 20;
  uint16_t *h = malloc(tile);
  uint64_t r = 0x243F6A8885A308D3ull;
  for (size_t i = 0; i < tile / 2; i++) {
    r ^= r << 13, r ^= r >> 7, r ^= r << 17;
    float v = (float)((int64_t)(r >> 40) - (1 << 23)) / (float)(1 << 21); /* about [-4, 4) */
    h[i] = moe_f32_to_bf16(v);
  }
  for (size_t off = 0; off < gib; off += tile) b->iface->copy_in(b, (char *)src + off, h, tile);
  b->iface->synchronize(b);
  free(h);

  float one = 0.02f;
  bench_case cases[] = {
      {"per_tensor static fp8_e4m3fn", "quant.per_tensor", {ps("out_dtype", "fp8_e4m3fn")}, 1, true, false},
      {"per_tensor static int8", "quant.per_tensor", {ps("out_dtype", "int8")}, 1, true, false},
      {"per_tensor dynamic fp8_e4m3fn", "quant.per_tensor", {ps("out_dtype", "fp8_e4m3fn")}, 1, false, true},
      {"per_token fp8_e4m3fn", "quant.per_token", {ps("out_dtype", "fp8_e4m3fn")}, 1, false, false},
      {"per_token int8", "quant.per_token", {ps("out_dtype", "int8")}, 1, false, false},
      {"mxfp8_e4m3fn (even, rne)", "quant.mx", {ps("format", "mxfp8_e4m3fn")}, 1, false, false},
      {"mxfp4 (even, rne)", "quant.mx", {ps("format", "mxfp4")}, 1, false, false},
      {"mxfp4 (amax_up, half_up)", "quant.mx", {ps("format", "mxfp4"), ps("scale_rule", "amax_up"), ps("element_rounding", "half_up")}, 3, false, false},
  };
  const size_t sizes_mib[] = {64, 256, 1024};
  const int64_t k = 7168;
  printf("\n| op | input | M | time (us) | GB/s | %% of copy BW |\n|---|---|---|---|---|---|\n");
  for (size_t si = 0; si < 3; si++) {
    if (sizes_mib[si] > max_mib) continue;
    int64_t m = (int64_t)((sizes_mib[si] << 20) / (size_t)(k * 2));
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
      bench_case *bc = &cases[ci];
      moe_named_tensor in[2] = {{"x", {.dtype = MOE_BF16, .ndim = 2, .shape = {m, k}, .data = src}},
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
        if (b->iface->alloc(b, ot->tensor.nbytes, &outs[o])) {
          fprintf(stderr, "alloc failed\n");
          return 1;
        }
        ot->tensor.data = outs[o];
        bytes += ot->tensor.nbytes;
      }
      if (bc->static_scale) { /* the kernels take the validated value; the buffer lives on the device too */
        void *ds;
        b->iface->alloc(b, 4, &ds);
        b->iface->copy_in(b, ds, &one, 4);
        moe_call_input(c, 1)->tensor.data = ds;
      }
      op_arg oa = {c, b};
      double ms = time_median(st, run_op, &oa);
      double gbs = (double)bytes / (ms * 1e-3) / 1e9;
      printf("| %s | %zu MiB | %lld | %.1f | %.0f | %.1f%%", bc->label, sizes_mib[si], (long long)m, ms * 1e3, gbs,
             100.0 * gbs / copy_gbs);
      if (bc->two_reads) {
        double bound_ms = (double)(bytes + in[0].tensor.nbytes) / (copy_gbs * 1e9) * 1e3;
        printf(" (%.1f%% of the two-read bound)", 100.0 * bound_ms / ms);
      }
      printf(" |\n");
      for (size_t o = 0; o < 4; o++)
        if (outs[o]) b->iface->free(b, outs[o]);
      if (bc->static_scale) b->iface->free(b, moe_call_input(c, 1)->tensor.data);
      moe_call_destroy(c);
    }
  }
  b->iface->free(b, src);
  moe_backend_destroy(b);
  return 0;
}
