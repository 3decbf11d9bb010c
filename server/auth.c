/* auth: bearer tokens with roles, checked on every gRPC call before it is
 * handed to the loop (rpc.c calls moed_auth_check on the CQ thread), and on
 * every request of the HTTP ports (rest.c, http.c: moed_auth_check_value).
 *
 * --auth-tokens FILE holds one token a line, "NAME ROLE TOKEN" ('#'
 * comments and blank lines skipped): NAME follows the model-name rule and
 * is what the log shows, ROLE is `infer` (inference, metadata, statistics,
 * the repository index, health, shared-memory regions) or `admin`
 * (everything, repository changes and uploads included), TOKEN is 16 to
 * 256 printable characters without spaces. Clients send `authorization: Bearer TOKEN`. SIGHUP rereads the
 * file; a file that does not parse keeps the tokens in force (logged). */
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "moed.h"

#define MAX_TOKENS 1024
#define TOKEN_MIN 16
#define TOKEN_MAX 256
#define FILE_MAX (1 << 20)

typedef struct token {
  char name[128];
  bool admin;
  size_t len;
  char secret[TOKEN_MAX + 1];
} token;

typedef struct token_set {
  size_t n;
  token t[];
} token_set;

static struct {
  const char *path;    /* NULL: no authorization */
  bool health_exempt;  /* health RPCs need no token */
  pthread_rwlock_t mu; /* the set is swapped on reload while the CQ thread reads */
  token_set *set;
} auth = {.mu = PTHREAD_RWLOCK_INITIALIZER};

/* What each method needs: 0 none beyond health exemption, 1 infer, 2 admin.
 * Shared-memory regions are the inference clients' (security.md says what
 * a registration can reach). */
enum { NEED_HEALTH = 0, NEED_INFER, NEED_ADMIN };
static const unsigned char need[MOED_M_COUNT] = {
    [MOED_M_SERVER_LIVE] = NEED_HEALTH,        [MOED_M_SERVER_READY] = NEED_HEALTH,
    [MOED_M_MODEL_READY] = NEED_HEALTH,        [MOED_M_HEALTH_CHECK] = NEED_HEALTH,
    [MOED_M_HEALTH_WATCH] = NEED_HEALTH,       [MOED_M_SERVER_METADATA] = NEED_INFER,
    [MOED_M_MODEL_METADATA] = NEED_INFER,      [MOED_M_MODEL_INFER] = NEED_INFER,
    [MOED_M_MODEL_STREAM_INFER] = NEED_INFER,  [MOED_M_MODEL_CONFIG] = NEED_INFER,
    [MOED_M_MODEL_STATISTICS] = NEED_INFER,    [MOED_M_REPOSITORY_INDEX] = NEED_INFER,
    [MOED_M_REPOSITORY_LOAD] = NEED_ADMIN,     [MOED_M_REPOSITORY_UNLOAD] = NEED_ADMIN,
    [MOED_M_EXPERT_UPLOAD] = NEED_ADMIN,       [MOED_M_SHM_STATUS] = NEED_INFER,
    [MOED_M_SHM_REGISTER] = NEED_INFER,        [MOED_M_SHM_UNREGISTER] = NEED_INFER,
    [MOED_M_CUDA_SHM_STATUS] = NEED_INFER,     [MOED_M_CUDA_SHM_REGISTER] = NEED_INFER,
    [MOED_M_CUDA_SHM_UNREGISTER] = NEED_INFER,
};

/* Parses the token file; NULL with why[] set (naming the line, never a
 * token). */
static token_set *load_tokens(const char *path, char *why, size_t n) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(why, n, "%s: cannot open", path);
    return NULL;
  }
  token_set *set = calloc(1, sizeof *set + MAX_TOKENS * sizeof set->t[0]);
  char line[1024];
  int lineno = 0;
  size_t bytes = 0;
  if (!set) {
    snprintf(why, n, "%s: out of memory", path);
    goto fail;
  }
  while (fgets(line, sizeof line, f)) {
    lineno++;
    bytes += strlen(line);
    if (bytes > FILE_MAX || (!strchr(line, '\n') && !feof(f))) {
      snprintf(why, n, "%s:%d: line longer than %zu bytes or file over %d bytes", path, lineno,
               sizeof line - 1, FILE_MAX);
      goto fail;
    }
    char *save = NULL, *name = strtok_r(line, " \t\r\n", &save);
    if (!name || name[0] == '#') continue;
    char *role = strtok_r(NULL, " \t\r\n", &save), *secret = strtok_r(NULL, " \t\r\n", &save);
    const char *bad = !role || !secret || strtok_r(NULL, " \t\r\n", &save) ? "expected NAME ROLE TOKEN"
                      : !moed_model_name_ok(name)                          ? "NAME: " MOED_MODEL_NAME_RULE
                      : strcmp(role, "infer") && strcmp(role, "admin")     ? "ROLE: infer or admin"
                      : strlen(secret) < TOKEN_MIN || strlen(secret) > TOKEN_MAX
                          ? "TOKEN: 16 to 256 characters"
                      : set->n == MAX_TOKENS ? "more than 1024 tokens"
                                             : NULL;
    for (const char *p = secret; !bad && *p; p++)
      if (!isgraph((unsigned char)*p)) bad = "TOKEN: printable characters only";
    if (bad) {
      snprintf(why, n, "%s:%d: %s", path, lineno, bad);
      goto fail;
    }
    token *t = &set->t[set->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->admin = !strcmp(role, "admin");
    t->len = strlen(secret);
    memcpy(t->secret, secret, t->len + 1);
  }
  if (set->n == 0) {
    snprintf(why, n, "%s: no tokens", path);
    goto fail;
  }
  memset(line, 0, sizeof line);
  fclose(f);
  return set;
fail:
  memset(line, 0, sizeof line);
  free(set);
  fclose(f);
  return NULL;
}

int moed_auth_init(const moed_config *cfg) {
  auth.path = cfg->auth_tokens;
  auth.health_exempt = cfg->auth_health_exempt;
  if (!auth.path) return 0;
  char why[600];
  auth.set = load_tokens(auth.path, why, sizeof why);
  if (!auth.set) {
    moed_log(MOED_LOG_ERROR, "auth_failed", "%s", why);
    return -1;
  }
  moed_log(MOED_LOG_INFO, "auth", "%zu tokens from %s%s", auth.set->n, auth.path,
           auth.health_exempt ? " (health RPCs exempt)" : "");
  return 0;
}

void moed_auth_reload(void) {
  if (!auth.path) return;
  char why[600];
  token_set *set = load_tokens(auth.path, why, sizeof why);
  if (!set) {
    moed_log(MOED_LOG_ERROR, "auth_reload_failed", "%s; the tokens in force are kept", why);
    return;
  }
  pthread_rwlock_wrlock(&auth.mu);
  token_set *old = auth.set;
  auth.set = set;
  pthread_rwlock_unlock(&auth.mu);
  moed_log(MOED_LOG_INFO, "auth", "%zu tokens reloaded from %s", set->n, auth.path);
  free(old);
}

void moed_auth_destroy(void) {
  free(auth.set);
  auth.set = NULL;
}

/* Equal in time that depends on the lengths only, not on where they differ. */
static bool same_secret(const token *t, const char *p, size_t n) {
  unsigned char diff = (unsigned char)(t->len != n);
  for (size_t i = 0; i < t->len; i++)
    diff |= (unsigned char)(t->secret[i] ^ (i < n ? p[i] : 0));
  return diff == 0;
}

static bool slice_is(grpc_slice s, const char *lit) {
  size_t n = strlen(lit);
  return GRPC_SLICE_LENGTH(s) == n && memcmp(GRPC_SLICE_START_PTR(s), lit, n) == 0;
}

grpc_status_code moed_auth_check(moed_method m, const grpc_metadata_array *md, char *who, size_t who_size,
                                 char *why) {
  const grpc_metadata *found = NULL;
  for (size_t i = 0; i < md->count && !found; i++)
    if (slice_is(md->metadata[i].key, "authorization")) found = &md->metadata[i];
  return moed_auth_check_value(m, found ? (const char *)GRPC_SLICE_START_PTR(found->value) : NULL,
                               found ? GRPC_SLICE_LENGTH(found->value) : 0, who, who_size, why);
}

grpc_status_code moed_auth_check_value(moed_method m, const char *v, size_t n, char *who, size_t who_size,
                                       char *why) {
  if (who_size) who[0] = 0;
  if (!auth.path || (need[m] == NEED_HEALTH && auth.health_exempt)) return GRPC_STATUS_OK;
  if (!v)
    return moed_failf(why, GRPC_STATUS_UNAUTHENTICATED,
                      "authorization: a bearer token is required ('authorization: Bearer TOKEN')");
  if (n < 7 || strncasecmp(v, "Bearer ", 7) != 0)
    return moed_failf(why, GRPC_STATUS_UNAUTHENTICATED, "authorization: not 'Bearer TOKEN'");
  v += 7;
  n -= 7;
  grpc_status_code code = GRPC_STATUS_UNAUTHENTICATED;
  moed_failf(why, code, "authorization: unknown token");
  pthread_rwlock_rdlock(&auth.mu);
  for (size_t i = 0; i < auth.set->n; i++) { /* every entry compared: the time says nothing of which */
    const token *t = &auth.set->t[i];
    if (!same_secret(t, v, n) || code != GRPC_STATUS_UNAUTHENTICATED) continue;
    snprintf(who, who_size, "%s", t->name);
    if (need[m] == NEED_ADMIN && !t->admin)
      code = moed_failf(why, GRPC_STATUS_PERMISSION_DENIED,
                        "authorization: token '%s' has role infer; this RPC needs admin", t->name);
    else
      code = GRPC_STATUS_OK;
  }
  pthread_rwlock_unlock(&auth.mu);
  return code;
}
