/* token_dist: `moec bench --tokens`, the token counts of the requests: a
 * list ("1,4,16": each request one of them, equally likely), a uniform
 * range ("uniform:1:64": every count from 1 to 64 equally likely) or a Zipf
 * law ("zipf:1.1:64": count k in 1..64 with probability proportional to
 * k^-1.1: mostly short requests, a few long ones). The draws themselves are
 * the load engine's (seeded). */
#ifndef MOEC_TOKEN_DIST_H
#define MOEC_TOKEN_DIST_H

#include <stddef.h>
#include <stdint.h>

#define TOKEN_DIST_MAX_COUNT 65536 /* largest token count, and most distinct counts */

typedef struct token_dist {
  uint32_t *tokens; /* the distinct counts, ascending */
  double *cdf;      /* P(count <= tokens[i]); the last is 1 */
  size_t n;
} token_dist;

/* 0, or -1 with a message naming the flag and the spec in err. */
int token_dist_parse(const char *spec, token_dist *out, char *err, size_t err_cap);
void token_dist_free(token_dist *d);

#endif
