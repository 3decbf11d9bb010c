/* prom_label: label values in the Prometheus text exposition format. */
#ifndef MOED_PROM_LABEL_H
#define MOED_PROM_LABEL_H

#include <stddef.h>

/* Room for any value of up to n bytes escaped, with its NUL. */
#define MOED_PROM_LABEL_SIZE(n) (2 * (n) + 1)

/* Writes `in` into out[0..cap) escaped as a label value must be between its
 * double quotes (backslash, double quote and line feed as \\, \" and \n;
 * everything else as is), always NUL-terminated; cut at a whole escape when
 * cap is short. Returns the escaped length, not counting the NUL (>= cap:
 * it was cut). Every label value /metrics writes goes through this, so no
 * name can end a label or a sample line. */
size_t moed_prom_label(char *out, size_t cap, const char *in);

#endif
