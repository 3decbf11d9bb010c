/* Typed access to op parameters, tolerant of clients that send every value
 * as a string (tritonclient's parameters map does for some types). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/params.h"

/* The parameters of the op preparation running on this thread
 * (moe_params_track): bit i of `seen` is set once a getter looked item i
 * up, whether or not its value was then used. */
static _Thread_local const moe_param *tracked;
static _Thread_local uint64_t seen;

static const moe_param *find(const moe_params *p, const char *name) {
  if (!p) return NULL;
  for (size_t i = 0; i < p->count; i++)
    if (p->items[i].name && strcmp(p->items[i].name, name) == 0) {
      if (p->items == tracked && i < 64) seen |= (uint64_t)1 << i;
      return &p->items[i];
    }
  return NULL;
}

void moe_params_track(const moe_params *p) {
  tracked = p ? p->items : NULL;
  seen = 0;
}

const char *moe_params_unread(const moe_params *p) {
  const char *unread = NULL;
  if (p && p->items == tracked)
    for (size_t i = 0; i < p->count && i < 64 && !unread; i++)
      if (!(seen >> i & 1)) unread = p->items[i].name ? p->items[i].name : "";
  tracked = NULL;
  return unread;
}

bool moe_params_has(const moe_params *p, const char *name) { return find(p, name) != NULL; }

moe_status moe_params_string(const moe_params *p, const char *name, const char **out, moe_error *err) {
  const moe_param *q = find(p, name);
  if (!q) return MOE_OK;
  if (q->type != MOE_PARAM_STRING || !q->s)
    return moe_fail(err, MOE_EINVAL, "parameter '%s' must be a string", name);
  *out = q->s;
  return MOE_OK;
}

moe_status moe_params_bool(const moe_params *p, const char *name, bool *out, moe_error *err) {
  const moe_param *q = find(p, name);
  if (!q) return MOE_OK;
  if (q->type == MOE_PARAM_BOOL) {
    *out = q->b;
    return MOE_OK;
  }
  if (q->type == MOE_PARAM_INT && (q->i == 0 || q->i == 1)) {
    *out = q->i == 1;
    return MOE_OK;
  }
  if (q->type == MOE_PARAM_STRING && q->s && (!strcmp(q->s, "true") || !strcmp(q->s, "false"))) {
    *out = q->s[0] == 't';
    return MOE_OK;
  }
  return moe_fail(err, MOE_EINVAL, "parameter '%s' must be a bool", name);
}

moe_status moe_params_int(const moe_params *p, const char *name, int64_t *out, moe_error *err) {
  const moe_param *q = find(p, name);
  if (!q) return MOE_OK;
  if (q->type == MOE_PARAM_INT) {
    *out = q->i;
    return MOE_OK;
  }
  if (q->type == MOE_PARAM_STRING && q->s && *q->s) {
    char *end;
    errno = 0;
    long long v = strtoll(q->s, &end, 10);
    if (!*end && !errno) {
      *out = v;
      return MOE_OK;
    }
  }
  return moe_fail(err, MOE_EINVAL, "parameter '%s' must be an integer", name);
}

moe_status moe_params_double(const moe_params *p, const char *name, double *out, moe_error *err) {
  const moe_param *q = find(p, name);
  if (!q) return MOE_OK;
  if (q->type == MOE_PARAM_DOUBLE) {
    *out = q->d;
    return MOE_OK;
  }
  if (q->type == MOE_PARAM_INT) {
    *out = (double)q->i;
    return MOE_OK;
  }
  if (q->type == MOE_PARAM_STRING && q->s && *q->s) {
    char *end;
    double v = strtod(q->s, &end);
    if (!*end) {
      *out = v;
      return MOE_OK;
    }
  }
  return moe_fail(err, MOE_EINVAL, "parameter '%s' must be a number", name);
}

moe_status moe_params_choice(const moe_params *p, const char *name, const char *const *choices, int *out,
                             moe_error *err) {
  const char *s = NULL;
  moe_status st = moe_params_string(p, name, &s, err);
  if (st || !s) return st;
  for (int i = 0; choices[i]; i++)
    if (strcmp(choices[i], s) == 0) {
      *out = i;
      return MOE_OK;
    }
  char list[256] = "";
  size_t used = 0;
  for (int i = 0; choices[i] && used < sizeof list; i++) {
    int n = snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", choices[i]);
    if (n < 0) break;
    used += (size_t)n;
  }
  return moe_fail(err, MOE_EINVAL, "parameter '%s' = '%s' is not one of: %s", name, s, list);
}
