/* prom_label: label-value escaping of the Prometheus text format
 * ("Text-based format", label_value: \\, \" and \n escaped). */
#include "prom_label.h"

size_t moed_prom_label(char *out, size_t cap, const char *in) {
  size_t need = 0, o = 0;
  for (const char *p = in ? in : ""; *p; p++) {
    const char *esc = *p == '\\' ? "\\\\" : *p == '"' ? "\\\"" : *p == '\n' ? "\\n" : NULL;
    size_t k = esc ? 2 : 1;
    if (cap && o == need && o + k < cap) { /* still writing: the whole escape fits */
      if (esc) {
        out[o] = esc[0];
        out[o + 1] = esc[1];
      } else {
        out[o] = *p;
      }
      o += k;
    }
    need += k;
  }
  if (cap) out[o] = 0;
  return need;
}
