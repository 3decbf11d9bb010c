/* libFuzzer: an expert set's config.json parser and validator (kernels/
 * model/expert_config.c). An accepted config must serialize, parse back and
 * serialize to the same text (every value exact: what moe-mkset and an
 * upload write is what is loaded). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe/expert_set.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  if (!text) return 0;
  memcpy(text, data, size);
  text[size] = 0; /* the parser takes C text, as read_text hands it over */
  moe_expert_config cfg, back;
  moe_error err;
  if (moe_expert_config_parse(text, &cfg, &err) == MOE_OK) {
    char *json = moe_expert_config_to_json(&cfg);
    if (!json || moe_expert_config_parse(json, &back, &err) != MOE_OK) abort();
    char *again = moe_expert_config_to_json(&back);
    if (!again || strcmp(json, again) != 0 ||
        back.routing.routed_scaling_factor != cfg.routing.routed_scaling_factor)
      abort();
    free(again);
    free(json);
  }
  free(text);
  return 0;
}
