/* moe: expert sets, the weights of one MoE layer (or a shard of its experts)
 * served as one fused_moe model. On disk: a directory with config.json and
 * one or more .safetensors files (docs/expert-set.md). */
#ifndef MOE_EXPERT_SET_H
#define MOE_EXPERT_SET_H

#include <stdbool.h>
#include <stdint.h>

#include "moe/ops.h"
#include "moe/status.h"
#include "moe/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum moe_scheme {
  MOE_SCHEME_BF16 = 0, /* weights bf16 (activations bf16) */
  MOE_SCHEME_FP16,     /* weights fp16 (activations fp16) */
  MOE_SCHEME_WNA16,    /* int4/int8 weights, per-group scales, 16-bit activations */
  MOE_SCHEME_FP8,      /* fp8 e4m3fn weights and activations (W8A8), F32 weight scales */
  MOE_SCHEME_MXFP4,    /* fp4 e2m1 weights with e8m0 scales per 32 (W4A16) */
  MOE_SCHEME_COUNT
} moe_scheme;

typedef enum moe_activation {
  MOE_ACT_SILU = 0,
  MOE_ACT_GELU,
  MOE_ACT_SWIGLU_OAI,
  MOE_ACT_COUNT
} moe_activation;

/* fp8: the layout of the weight scales (docs/numerics.md "Weight scheme fp8"). */
typedef enum moe_weight_scale {
  MOE_WSCALE_PER_TENSOR = 0, /* [E] */
  MOE_WSCALE_PER_CHANNEL,    /* [E, N] */
  MOE_WSCALE_BLOCK,          /* [E, ceil(N / BN), ceil(K / BK)] */
  MOE_WSCALE_COUNT
} moe_weight_scale;

typedef enum moe_scoring { MOE_SCORING_SOFTMAX = 0, MOE_SCORING_SIGMOID, MOE_SCORING_COUNT } moe_scoring;

/* Name tables (index = enum value), NULL-terminated, for parsing. */
extern const char *const moe_scheme_names[];
extern const char *const moe_activation_names[];
extern const char *const moe_scoring_names[];
extern const char *const moe_weight_scale_names[];

/* Routing parameters of moe.topk (also the defaults of an expert set). */
typedef struct moe_routing {
  int64_t top_k;
  moe_scoring scoring;
  bool renormalize;
  int64_t num_expert_group; /* <= 1: no grouping */
  int64_t topk_group;
  double routed_scaling_factor; /* default 1 */
} moe_routing;

/* Checks *r against `num_experts` experts, naming the parameter at fault. */
moe_status moe_routing_check(const moe_routing *r, int64_t num_experts, moe_error *err);

typedef struct moe_expert_config {
  moe_scheme scheme;
  int64_t num_experts;        /* experts held here, E_local */
  int64_t global_num_experts; /* E of the whole layer (>= offset + E_local) */
  int64_t expert_offset;      /* first global expert id held here */
  int64_t hidden_size;        /* H */
  int64_t intermediate_size;  /* I */
  moe_activation activation;
  int bits;                      /* wna16: 4 or 8 */
  int64_t group_size;            /* wna16: divides K of each GEMM; -1 = one group per row */
  bool has_zero_points;          /* wna16 */
  moe_weight_scale weight_scale; /* fp8 */
  int64_t block_n, block_k;      /* fp8 block: BN, BK (default 128, 128) */
  bool has_act_scales;           /* fp8 per_tensor: static a13_scale / a2_scale given */
  bool exact_division;           /* fp8: activation quantization divides (x / s) */
  bool has_bias;                 /* every scheme: w13_bias and w2_bias given */
  moe_routing routing;
} moe_expert_config;

/* Tensor slots of an expert set; names in moe_expert_tensor_names. */
typedef enum moe_expert_tensor {
  MOE_W13 = 0,     /* [E, 2I, H] bf16/fp16 */
  MOE_W2,          /* [E, H, I] */
  MOE_W13_QWEIGHT, /* wna16, fp8, mxfp4: codes */
  MOE_W13_SCALES,
  MOE_W13_QZEROS, /* wna16 */
  MOE_W2_QWEIGHT,
  MOE_W2_SCALES,
  MOE_W2_QZEROS,
  MOE_W13_BIAS,  /* optional (has_bias) [E, 2I], every scheme */
  MOE_W2_BIAS,   /* optional (has_bias) [E, H] */
  MOE_A13_SCALE, /* fp8 static activation scales [E] (has_act_scales) */
  MOE_A2_SCALE,
  MOE_CORRECTION_BIAS, /* optional F32 [E_global], used when routing here */
  MOE_EXPERT_TENSOR_COUNT
} moe_expert_tensor;

extern const char *const moe_expert_tensor_names[];
/* Whether `name` is one of an expert set's weight tensors (the w13 / w2
 * matrices, scales, zero points, biases and static activation scales; not
 * the routing's correction_bias):
 * what a fused_moe request carries inline and the weight cache keys on. */
bool moe_expert_tensor_is_weight(const char *name);

struct moe_expert_set {
  char name[128];
  moe_expert_config cfg;
  moe_tensor t[MOE_EXPERT_TENSOR_COUNT]; /* data NULL when absent */
  void *owner;                           /* the loaded files' buffers; NULL when borrowed */
  int refs;                              /* references, holds included (atomic) */
  int holds;                             /* of those, device caches' (atomic; moe_expert_set_hold) */
};

/* Defaults: bf16, silu, routing softmax top_k 1 renormalize false,
 * routed_scaling_factor 1, offset 0, group_size -1, no zero points, fp8
 * per_tensor with 128 x 128 blocks, no biases. */
void moe_expert_config_defaults(moe_expert_config *cfg);
/* Parses config.json text into cfg (starting from the defaults). */
moe_status moe_expert_config_parse(const char *json, moe_expert_config *cfg, moe_error *err);
/* Serializes cfg as JSON (malloc'ed string; caller frees). NULL when out of
 * memory or an enum is out of range. */
char *moe_expert_config_to_json(const moe_expert_config *cfg);
/* Checks the config's ranges and their consistency (what parse checks after
 * reading the keys), naming the offending key in err. */
moe_status moe_expert_config_validate(const moe_expert_config *cfg, moe_error *err);

/* Checks every tensor against the config (dtype, shape, presence), naming
 * the tensor in err. */
moe_status moe_expert_set_validate(const moe_expert_set *set, moe_error *err);

/* Loads a directory (config.json + *.safetensors); the weights are read
 * into memory the set owns (freed with it), so changing the files later
 * does not change or crash the set: only a new load sees them. */
moe_status moe_expert_set_load(const char *dir, const char *name, moe_expert_set **out, moe_error *err);
/* Builds a set that borrows the tensors named as in moe_expert_tensor_names
 * (missing optional ones stay absent); validated. */
moe_status moe_expert_set_from_tensors(const char *name, const moe_expert_config *cfg,
                                       const moe_named_tensor *tensors, size_t n, moe_expert_set **out,
                                       moe_error *err);
/* Lifetime. A set starts with one reference, its creator's; users take
 * more (moe_expert_set_ref) and drop them (moe_expert_set_destroy; the last
 * frees the set and its weights). A backend that keeps a device copy of
 * a set takes a hold instead (a reference that does not keep the set in
 * use): once every remaining reference is a hold, the set is unused,
 * moe_expert_set_unused_count() moves on, and each backend frees its copy
 * and drops its hold in moe_backend_trim. So a set's memory on every device
 * has one owner and ends with the set's last user. Any thread. */
moe_expert_set *moe_expert_set_ref(moe_expert_set *set);
void moe_expert_set_destroy(moe_expert_set *set);
moe_expert_set *moe_expert_set_hold(moe_expert_set *set);
void moe_expert_set_release_hold(moe_expert_set *set);
/* Whether only holds remain (a snapshot; a set that is unused stays so:
 * nobody who could take a new reference is left). */
bool moe_expert_set_unused(const moe_expert_set *set);
/* How many times a held set became unused in this process (monotonic):
 * the device workers trim when it changes. */
uint64_t moe_expert_set_unused_count(void);

/* Writes a synthetic set with seeded random weights into `dir` (created). */
moe_status moe_expert_set_write_random(const char *dir, const moe_expert_config *cfg, uint64_t seed,
                                       moe_error *err);

#ifdef __cplusplus
}
#endif
#endif
