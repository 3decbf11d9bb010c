/* Internal: the op table entry, a prepared call and each op's parsed
 * arguments. Shared by the validation code (kernels/ops), the CPU backend
 * (kernels/cpu) and the GPU backend (kernels/gpu); never installed. */
#ifndef MOE_OPS_OP_H
#define MOE_OPS_OP_H

#include "moe/backend.h"
#include "moe/codec.h"
#include "moe/expert_set.h"
#include "moe/ops.h"

#define MOE_OP_MAX_IO 24

typedef moe_status (*moe_op_prepare_fn)(moe_call *c, const moe_params *p, moe_error *err);
typedef moe_status (*moe_op_run_fn)(moe_backend *b, moe_call *c, moe_error *err);

/* One op = one entry: name and interface, validation, CPU and GPU function. */
struct moe_op {
  moe_op_info info;
  moe_op_prepare_fn prepare; /* inputs bound by name; checks them, parses params
                                into c->args, sets the outputs' dtype and shape */
  moe_op_run_fn cpu;         /* host memory */
  moe_op_run_fn gpu;         /* device memory; NULL until the GPU has the op */
};

/* Which of p's items an op's prepare looked up (params.c, per thread):
 * moe_params_track(p) before it, moe_params_unread(p) after: the name of
 * the first item no getter asked for (NULL: none), which moe_op_prepare
 * rejects, so a misspelt parameter is an error, not a silent default.
 * Items past the 64th are not tracked (the server takes at most 64). */
void moe_params_track(const moe_params *p);
const char *moe_params_unread(const moe_params *p);

/* ---- parsed arguments, one struct per op ---------------------------------- */

typedef enum moe_narrow_kind {
  MOE_NARROW_E4M3FN = 0,
  MOE_NARROW_E4M3FNUZ,
  MOE_NARROW_E5M2,
  MOE_NARROW_E2M1,
  MOE_NARROW_INT8, /* not a float format: the int8 codec */
} moe_narrow_kind;

/* quant.per_tensor, quant.per_token, quant.per_token_group, dequant.per_tensor */
typedef struct moe_scaled_args {
  moe_dtype qdtype;      /* FP8_E4M3FN, FP8_E4M3FNUZ or INT8 */
  moe_narrow_fmt fmt;    /* codec of qdtype (unused for INT8) */
  float dtype_max;       /* 448, 240, 127 */
  bool exact_division;   /* per_tensor: x / s instead of x * (1/s) */
  bool has_static_scale; /* per_tensor: `scale` input given */
  float static_scale;    /* its value, read and checked (finite, > 0) by prepare;
                            also the scale of dequant.per_tensor */
  bool has_scale_ub;     /* per_token */
  float scale_ub;
  int64_t group;       /* per_token (K), per_token_group (G): elements per scale, a divisor of K */
  bool pow2_scale;     /* per_token_group scale_rule = pow2_up: s rounded up to a power of two */
  moe_dtype out_dtype; /* dequant: F32, F16 or BF16 */
} moe_scaled_args;

/* quant.mx, dequant.mx */
typedef struct moe_mx_args {
  moe_dtype qdtype; /* FP4_E2M1, FP8_E4M3FN or FP8_E5M2 */
  moe_narrow_fmt fmt;
  moe_mx_rule rule;
  bool half_up;
  moe_dtype out_dtype; /* dequant */
} moe_mx_args;

/* moe.topk */
typedef struct moe_topk_args {
  moe_routing routing;
  bool has_bias;
} moe_topk_args;

/* fused_moe input slots; the weight slots follow moe_expert_tensor's order,
 * so input MOE_FUSED_IN_WEIGHTS + s is expert tensor s. */
enum {
  MOE_FUSED_IN_HIDDEN = 0,
  MOE_FUSED_IN_LOGITS,
  MOE_FUSED_IN_IDS,
  MOE_FUSED_IN_TOPK_WEIGHTS,
  MOE_FUSED_IN_WEIGHTS,
  MOE_FUSED_IN_BIAS = MOE_FUSED_IN_WEIGHTS + MOE_CORRECTION_BIAS,
  MOE_FUSED_IN_COUNT
};

/* fused_moe */
typedef struct moe_fused_args {
  const moe_expert_set *set; /* the loaded set, or c->owned_set (inline weights) */
  moe_dtype act;             /* F16 or BF16: dtype of hidden_states */
  bool route;                /* router_logits given: route with set->cfg.routing */
  moe_routing routing;
  int64_t tokens, top_k;
} moe_fused_args;

/* ---- a prepared call ------------------------------------------------------ */

struct moe_call {
  const moe_op *op;
  /* inputs in the order of op->info.inputs; absent optional ones have
   * tensor.data == NULL and dtype MOE_DTYPE_INVALID */
  moe_named_tensor in[MOE_OP_MAX_IO];
  moe_named_tensor out[MOE_OP_MAX_IO];
  size_t num_out;
  moe_expert_set *owned_set; /* built from inline weights; freed with the call */
  moe_stop_fn stop;          /* moe_call_set_stop; NULL: runs to the end */
  void *stop_ctx;
  union {
    moe_scaled_args scaled;
    moe_mx_args mx;
    moe_topk_args topk;
    moe_fused_args fused;
  } args;
};

/* Input slot `i`, NULL when the optional input is absent. */
static inline const moe_tensor *moe_call_in(const moe_call *c, size_t i) {
  return c->in[i].tensor.data || c->in[i].tensor.dtype != MOE_DTYPE_INVALID ? &c->in[i].tensor : NULL;
}

/* Sets output `i` of c: name from the op's info, dtype and shape given; nbytes
 * computed (overflow-checked). */
moe_status moe_call_set_output(moe_call *c, size_t i, moe_dtype dt, int32_t ndim, const int64_t *shape,
                               moe_error *err);

/* ---- shared validation helpers ------------------------------------------- */

/* `what` must have one of the dtypes in `allowed` (terminated by
 * MOE_DTYPE_INVALID); error names the tensor and lists what is accepted. */
moe_status moe_check_dtype(const moe_tensor *t, const char *what, const moe_dtype *allowed, moe_error *err);
/* Rank must be in [min_rank, max_rank]; every dim >= 0; nbytes must equal
 * what shape and dtype need. */
moe_status moe_check_shape(const moe_tensor *t, const char *what, int min_rank, int max_rank, moe_error *err);
/* Interprets a UINT8 (storage) tensor as narrow dtype `real` (for FP4 the
 * last axis doubles); a tensor already of dtype `real` passes unchanged. */
moe_status moe_narrow_view(moe_tensor *t, const char *what, moe_dtype real, moe_error *err);

/* Codec of a narrow float dtype (FP8_*, FP4_E2M1). */
moe_narrow_fmt moe_narrow_fmt_of(moe_dtype t);
/* Element i of a F32/F16/BF16 array, widened exactly. */
static inline float moe_load_float(const void *p, moe_dtype t, size_t i) {
  switch (t) {
  case MOE_F16: return moe_f16_to_f32(((const uint16_t *)p)[i]);
  case MOE_BF16: return moe_bf16_to_f32(((const uint16_t *)p)[i]);
  default: return ((const float *)p)[i];
  }
}
/* Stores v into element i of a F32/F16/BF16 array with docs/numerics.md rounding. */
static inline void moe_store_float(void *p, moe_dtype t, size_t i, float v) {
  switch (t) {
  case MOE_F16: ((uint16_t *)p)[i] = moe_f32_to_f16(v); break;
  case MOE_BF16: ((uint16_t *)p)[i] = moe_f32_to_bf16(v); break;
  default: ((float *)p)[i] = v; break;
  }
}
/* v rounded to the activation dtype and widened back (NUMERICS act(.)). */
static inline float moe_round_to(float v, moe_dtype t) {
  switch (t) {
  case MOE_F16: return moe_f16_to_f32(moe_f32_to_f16(v));
  case MOE_BF16: return moe_bf16_to_f32(moe_f32_to_bf16(v));
  default: return v;
  }
}

/* The op table entries (kernels/ops/<op>.c). */
extern const moe_op moe_op_quant_per_tensor;
extern const moe_op moe_op_quant_per_token;
extern const moe_op moe_op_quant_per_token_group;
extern const moe_op moe_op_quant_mx;
extern const moe_op moe_op_dequant_per_tensor;
extern const moe_op moe_op_dequant_mx;
extern const moe_op moe_op_topk;
extern const moe_op moe_op_fused_moe;

/* CPU functions (kernels/cpu/<op>.c). */
moe_status moe_cpu_quant_per_tensor(moe_backend *b, moe_call *c, moe_error *err);
/* quant.per_token and quant.per_token_group: one scale per args.scaled.group elements */
moe_status moe_cpu_quant_grouped(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_cpu_quant_mx(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_cpu_dequant_per_tensor(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_cpu_dequant_mx(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_cpu_topk(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_cpu_fused_moe(moe_backend *b, moe_call *c, moe_error *err);

/* GPU functions (kernels/gpu/); defined only in GPU builds. */
#ifdef MOE_HAVE_GPU
moe_status moe_gpu_quant_per_tensor(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_gpu_quant_grouped(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_gpu_quant_mx(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_gpu_dequant_per_tensor(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_gpu_dequant_mx(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_gpu_topk(moe_backend *b, moe_call *c, moe_error *err);
moe_status moe_gpu_fused_moe(moe_backend *b, moe_call *c, moe_error *err);
#define MOE_GPU_FN(f) f
#else
#define MOE_GPU_FN(f) NULL
#endif

#endif
