/* PLACEHOLDER: replaced by the expert-set implementation. */
#include <stdlib.h>
#include "moe/expert_set.h"
void moe_expert_set_destroy(moe_expert_set *set) { (void)set; }
