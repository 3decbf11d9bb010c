/* Internal: routing of one row of router logits on the host (docs/numerics.md
 * "moe.topk"), shared by moe.topk and fused_moe's CPU functions. */
#ifndef MOE_CPU_TOPK_H
#define MOE_CPU_TOPK_H

#include <stddef.h>
#include <stdint.h>

#include "moe/expert_set.h"
#include "moe/tensor.h"

/* Scratch bytes one thread needs to route rows of `num_experts` logits. */
size_t moe_cpu_route_scratch_bytes(int64_t num_experts);

/* Routes row `t` of `logits` [T, E] (F32/F16/BF16) with `r` (already
 * checked against E); `bias` is F32 [E] or NULL. Writes r->top_k ids and
 * weights. Depends on that row only, so batching cannot change it. */
void moe_cpu_route_row(const moe_routing *r, const moe_tensor *logits, int64_t t, const float *bias,
                       void *scratch, int32_t *ids, float *weights);

#endif
