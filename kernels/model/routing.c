/* The routing parameters' validity (docs/numerics.md "moe.topk"): the one
 * check behind expert-set configs (expert_config.c), moe.topk and fused_moe's
 * per-call overrides (kernels/ops/). */
#include <math.h>

#include "moe/expert_set.h"

moe_status moe_routing_check(const moe_routing *r, int64_t num_experts, moe_error *err) {
  const long long e = (long long)num_experts;
  if ((unsigned)r->scoring >= MOE_SCORING_COUNT)
    return moe_fail(err, MOE_EINVAL, "scoring: value %d out of range", (int)r->scoring);
  if (r->top_k < 1 || r->top_k > num_experts)
    return moe_fail(err, MOE_EINVAL, "top_k: must be in [1, %lld] (the number of experts), got %lld", e,
                    (long long)r->top_k);
  if (r->num_expert_group < 0 || r->num_expert_group > num_experts)
    return moe_fail(err, MOE_EINVAL,
                    "num_expert_group: must be in [0, %lld] (the number of experts), got %lld", e,
                    (long long)r->num_expert_group);
  if (r->num_expert_group > 1) { /* 0 and 1 both mean: no grouping */
    const int64_t groups = r->num_expert_group, per_group = num_experts / groups;
    if (num_experts % groups != 0)
      return moe_fail(err, MOE_EINVAL, "num_expert_group: %lld does not divide the %lld experts",
                      (long long)groups, e);
    if (r->topk_group < 1 || r->topk_group > groups)
      return moe_fail(err, MOE_EINVAL, "topk_group: must be in [1, num_expert_group = %lld], got %lld",
                      (long long)groups, (long long)r->topk_group);
    if (r->top_k > r->topk_group * per_group) /* both <= E: no overflow */
      return moe_fail(
          err, MOE_EINVAL, "top_k: %lld exceeds the %lld experts of the topk_group = %lld kept groups",
          (long long)r->top_k, (long long)r->topk_group * (long long)per_group, (long long)r->topk_group);
  }
  /* applied as an fp32 factor: it must stay finite there */
  if (!(r->routed_scaling_factor > 0.0) || !isfinite((float)r->routed_scaling_factor))
    return moe_fail(err, MOE_EINVAL, "routed_scaling_factor: must be > 0 and finite in fp32, got %g",
                    r->routed_scaling_factor);
  return MOE_OK;
}
