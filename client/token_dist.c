/* token_dist: see token_dist.h. */
#include "token_dist.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A whole number in [lo, hi] at *p, which is moved past it. */
static int whole(const char **p, long lo, long hi, long *out) {
  char *end;
  errno = 0;
  long v = strtol(*p, &end, 10);
  if (end == *p || errno || v < lo || v > hi) return -1;
  *p = end;
  *out = v;
  return 0;
}

/* weight[k] for count k + 1, k < n: normalized into a cdf over the counts
 * with a weight (at least one). */
static int from_weights(const double *weight, long n, token_dist *out) {
  size_t m = 0;
  double total = 0;
  for (long k = 0; k < n; k++)
    if (weight[k] > 0) {
      m++;
      total += weight[k];
    }
  out->tokens = malloc(m * sizeof *out->tokens);
  out->cdf = malloc(m * sizeof *out->cdf);
  if (!out->tokens || !out->cdf) return -1;
  double acc = 0;
  out->n = 0;
  for (long k = 0; k < n; k++)
    if (weight[k] > 0) {
      acc += weight[k];
      out->tokens[out->n] = (uint32_t)(k + 1);
      out->cdf[out->n++] = acc / total;
    }
  out->cdf[out->n - 1] = 1; /* exactly, whatever the rounding */
  return 0;
}

int token_dist_parse(const char *spec, token_dist *out, char *err, size_t err_cap) {
  memset(out, 0, sizeof *out);
  double *weight = calloc(TOKEN_DIST_MAX_COUNT, sizeof *weight); /* by count - 1 */
  const char *p = spec;
  long a, b;
  int rc = -1;
  if (!weight) {
    snprintf(err, err_cap, "--tokens %s: out of memory", spec);
    return -1;
  }
  if (strncmp(spec, "uniform:", 8) == 0) {
    p += 8;
    if (whole(&p, 1, TOKEN_DIST_MAX_COUNT, &a) || *p++ != ':' || whole(&p, a, TOKEN_DIST_MAX_COUNT, &b) || *p)
      goto bad;
    for (long k = a; k <= b; k++)
      weight[k - 1] = 1;
  } else if (strncmp(spec, "zipf:", 5) == 0) {
    char *end;
    errno = 0;
    double s = strtod(spec + 5, &end);
    p = end;
    if (end == spec + 5 || errno || !(s > 0 && s <= 10) || *p++ != ':' ||
        whole(&p, 1, TOKEN_DIST_MAX_COUNT, &b) || *p)
      goto bad;
    for (long k = 1; k <= b; k++)
      weight[k - 1] = pow((double)k, -s);
  } else {
    for (;;) {
      if (whole(&p, 1, TOKEN_DIST_MAX_COUNT, &a)) goto bad;
      weight[a - 1] += 1;
      if (!*p) break;
      if (*p++ != ',') goto bad;
    }
  }
  if (from_weights(weight, TOKEN_DIST_MAX_COUNT, out) != 0) {
    snprintf(err, err_cap, "--tokens %s: out of memory", spec);
    token_dist_free(out);
    goto done;
  }
  rc = 0;
  goto done;
bad:
  snprintf(err, err_cap,
           "--tokens %s: expected N[,N...], uniform:MIN:MAX or zipf:S:MAX (counts 1..%d, 0 < S <= 10)", spec,
           TOKEN_DIST_MAX_COUNT);
done:
  free(weight);
  return rc;
}

void token_dist_free(token_dist *d) {
  free(d->tokens);
  free(d->cdf);
  memset(d, 0, sizeof *d);
}
