/* Internal: one descriptor per weight scheme of fused_moe (docs/numerics.md
 * "fused_moe", the weight schemes; docs/expert-set.md, the tensors).
 *
 * A scheme is its entry in moe_schemes[]: the activation dtypes it takes,
 * its config keys, the form of each of its tensor slots, the checks of
 * values a form cannot express, the synthetic weights moe-mkset writes, and
 * how inline weights state it. Validation (expert_set.c), the config
 * (expert_config.c), the op's inline weights (ops/fused_moe.c) and the
 * backends' dispatch (ops/call.c) ask the table; the CPU weight format
 * (cpu/weight_format.c) and the kernels are the rest of a scheme. Slots that
 * every scheme has (the biases, correction_bias) are described here once. */
#ifndef MOE_MODEL_SCHEME_H
#define MOE_MODEL_SCHEME_H

#include <stdbool.h>
#include <stdint.h>

#include "moe/expert_set.h"
#include "moe/params.h"

typedef enum moe_slot_presence {
  MOE_SLOT_ABSENT = 0,
  MOE_SLOT_REQUIRED,
  MOE_SLOT_OPTIONAL
} moe_slot_presence;

/* The role of a slot within one GEMM (W13 or W2). */
typedef enum moe_slot_kind {
  MOE_KIND_NONE = 0, /* not a GEMM's (correction_bias) */
  MOE_KIND_W,        /* 16-bit weights */
  MOE_KIND_QWEIGHT,  /* codes */
  MOE_KIND_SCALES,
  MOE_KIND_QZEROS,
  MOE_KIND_BIAS,
  MOE_KIND_ASCALE, /* static activation scales */
} moe_slot_kind;

typedef struct moe_slot_role {
  moe_slot_kind kind;
  bool w13; /* the gate/up GEMM's (else the down GEMM's) */
} moe_slot_role;
extern const moe_slot_role moe_slot_roles[MOE_EXPERT_TENSOR_COUNT];

/* One GEMM of a set: per expert N output rows by K inputs. */
typedef struct moe_gemm_dims {
  bool w13;
  int64_t e, n, k;
} moe_gemm_dims;
moe_gemm_dims moe_gemm_of(const moe_expert_config *cfg, bool w13);

/* The expected form of one slot. */
typedef struct moe_slot_spec {
  moe_slot_presence presence;
  moe_dtype dtypes[4]; /* accepted; MOE_DTYPE_INVALID-terminated; [0] is what the writer uses */
  int32_t ndim;
  int64_t shape[3];
  char symbols[48]; /* the shape in config terms, for messages */
  const char *why;  /* when absent: why the slot does not belong here (NULL: the generic reason) */
} moe_slot_spec;

/* splitmix64 (Steele, Lea, Flood 2014): the synthetic weights' generator;
 * the same seed gives the same files everywhere. */
static inline uint64_t moe_splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/* uniform in [0, 1), 24 random bits: exact in fp32 */
static inline float moe_uniform01(uint64_t *state) {
  return (float)(moe_splitmix64(state) >> 40) * (1.0f / 16777216.0f);
}

/* Indexed by moe_scheme; the names are moe_scheme_names' (expert_config.c). */
typedef struct moe_scheme_desc {
  moe_dtype act;  /* the one activation dtype it computes in; MOE_DTYPE_INVALID: fp16 or bf16 */
  bool quantized; /* weights in w13_qweight / w2_qweight (+ scales), not w13 / w2 */
  bool gpu;       /* the GPU backend has kernels for it (kernels/gpu/) */
  /* optional: the scheme's own config keys (the others' are rejected before) */
  moe_status (*check_config)(const moe_expert_config *cfg, moe_error *err);
  /* the form of a slot of kind W, QWEIGHT, SCALES, QZEROS or ASCALE; left
   * absent for the kinds the scheme does not have */
  void (*layout)(const moe_expert_config *cfg, const moe_gemm_dims *g, moe_slot_kind kind, moe_slot_spec *sp);
  /* optional: what a form cannot check (values), naming tensor and index */
  moe_status (*check_values)(const moe_expert_set *set, moe_error *err);
  /* synthetic weights of a slot the layout requires (t sized and typed) */
  void (*fill)(const moe_expert_config *cfg, const moe_gemm_dims *g, moe_slot_kind kind, moe_tensor *t,
               uint64_t *rng);
  /* optional: inline weights, the scheme's config from the tensors (by slot, NULL
   * when absent; cfg has scheme, E, I and H already) and the request's
   * parameters */
  moe_status (*from_inline)(moe_expert_config *cfg, const moe_tensor *const *slots, const moe_params *p,
                            moe_error *err);
} moe_scheme_desc;

extern const moe_scheme_desc moe_schemes[MOE_SCHEME_COUNT];

/* cfg's scheme-specific keys: foreign keys left at their defaults, then the
 * scheme's own checks. cfg->scheme in range. */
moe_status moe_scheme_check_config(const moe_expert_config *cfg, moe_error *err);
/* The expected form of `slot` in a set of config cfg (valid). */
moe_slot_spec moe_slot_expected(const moe_expert_config *cfg, moe_expert_tensor slot);
/* Synthetic contents of a required slot. */
void moe_slot_fill(const moe_expert_config *cfg, moe_expert_tensor slot, moe_tensor *t, uint64_t *rng);

#endif
