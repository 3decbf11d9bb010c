/* Internal: the routing parameters of moe.topk (docs/numerics.md "moe.topk"),
 * shared with fused_moe, which routes router_logits by the same definition. */
#ifndef MOE_OPS_ROUTING_H
#define MOE_OPS_ROUTING_H

#include "moe/expert_set.h"
#include "moe/params.h"

/* Overrides the fields of *r that `p` names: top_k, scoring, renormalize,
 * num_expert_group, topk_group, routed_scaling_factor. */
moe_status moe_routing_params(const moe_params *p, moe_routing *r, moe_error *err);

#endif
