/* repository: the models moed serves (built-in ops, expert sets from the
 * model repository directory or uploaded) and their reference counts.
 * Requests hold a reference for as long as they use a model, so unloading
 * (which drops the repository's reference) never frees a set under a
 * running request. One mutex guards the table; lookups are short. */
#include <dirent.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "moed.h"

typedef struct stats_entry {
  struct stats_entry *next;
  char name[128];
  moed_model_stats stats;
} stats_entry;

struct moed_repository {
  pthread_mutex_t mu;
  char *dir;
  moed_model **models;
  size_t count, cap;
  stats_entry *stats; /* by name, kept across unload/reload */
};

/* r->mu held. */
static moed_model_stats *stats_for(moed_repository *r, const char *name) {
  for (stats_entry *e = r->stats; e; e = e->next)
    if (strcmp(e->name, name) == 0) return &e->stats;
  stats_entry *e = calloc(1, sizeof *e);
  if (!e) return NULL;
  snprintf(e->name, sizeof e->name, "%s", name);
  e->next = r->stats;
  r->stats = e;
  return &e->stats;
}

static void model_free(moed_model *m) {
  moe_expert_set_destroy(m->set);
  free(m);
}

void moed_model_release(moed_model *m) {
  if (m && atomic_fetch_sub(&m->refs, 1) == 1) model_free(m);
}

/* r->mu held. Index of `name` or r->count. */
static size_t find_locked(moed_repository *r, const char *name) {
  for (size_t i = 0; i < r->count; i++)
    if (strcmp(r->models[i]->name, name) == 0) return i;
  return r->count;
}

/* r->mu held. Adds m (taking the repository's reference), replacing any
 * model of the same name. */
static moe_status insert_locked(moed_repository *r, moed_model *m, moe_error *err) {
  m->stats = stats_for(r, m->name);
  if (!m->stats) return moe_fail(err, MOE_ENOMEM, "out of memory");
  size_t i = find_locked(r, m->name);
  if (i < r->count) {
    moed_model_release(r->models[i]);
    r->models[i] = m;
    return MOE_OK;
  }
  if (r->count == r->cap) {
    size_t cap = r->cap ? r->cap * 2 : 16;
    moed_model **grown = realloc(r->models, cap * sizeof *grown);
    if (!grown) return moe_fail(err, MOE_ENOMEM, "out of memory");
    r->models = grown;
    r->cap = cap;
  }
  r->models[r->count++] = m;
  return MOE_OK;
}

static moed_model *model_new(const char *name, const moe_op *op, moe_expert_set *set, bool builtin) {
  moed_model *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  snprintf(m->name, sizeof m->name, "%s", name);
  m->op = op;
  m->set = set;
  m->builtin = builtin;
  atomic_init(&m->refs, 1);
  return m;
}

int moed_repository_create(const char *dir, moed_repository **out) {
  moed_repository *r = calloc(1, sizeof *r);
  if (!r) return -1;
  pthread_mutex_init(&r->mu, NULL);
  if (dir && !(r->dir = strdup(dir))) goto fail;
  for (size_t i = 0; i < moe_op_count(); i++) {
    const moe_op *op = moe_op_at(i);
    moed_model *m = model_new(moe_op_name(op), op, NULL, true);
    moe_error err;
    if (!m) goto fail;
    if (insert_locked(r, m, &err) != MOE_OK) {
      model_free(m);
      goto fail;
    }
  }
  *out = r;
  return 0;
fail:
  moed_repository_destroy(r);
  return -1;
}

void moed_repository_destroy(moed_repository *r) {
  if (!r) return;
  for (size_t i = 0; i < r->count; i++)
    moed_model_release(r->models[i]);
  free(r->models);
  for (stats_entry *e = r->stats; e;) {
    stats_entry *next = e->next;
    free(e);
    e = next;
  }
  free(r->dir);
  pthread_mutex_destroy(&r->mu);
  free(r);
}

moed_model *moed_repository_acquire(moed_repository *r, const char *name) {
  moed_model *m = NULL;
  pthread_mutex_lock(&r->mu);
  size_t i = find_locked(r, name ? name : "");
  if (i < r->count) {
    m = r->models[i];
    atomic_fetch_add(&m->refs, 1);
  }
  pthread_mutex_unlock(&r->mu);
  return m;
}

/* A model name usable as a directory entry: no path tricks. */
bool moed_model_name_ok(const char *name) {
  if (!name || !*name || strlen(name) >= 128 || name[0] == '.') return false;
  for (const char *p = name; *p; p++) /* nothing that could end a path, a metric label or a log line */
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '.' ||
          *p == '_' || *p == '-'))
      return false;
  return true;
}

const char *moed_version_shown(const char *v) {
  size_t n = 0;
  while (v && v[n] >= '0' && v[n] <= '9')
    n++;
  return v && n && n < 20 && !v[n] ? v : "(not a version number)";
}

moe_status moed_repository_load(moed_repository *r, const char *name, moe_error *err) {
  if (!moed_model_name_ok(name))
    return moe_fail(err, MOE_EINVAL, "model_name: not a valid model name (%s)", MOED_MODEL_NAME_RULE);
  pthread_mutex_lock(&r->mu);
  size_t i = find_locked(r, name);
  bool builtin = i < r->count && r->models[i]->builtin;
  pthread_mutex_unlock(&r->mu);
  if (builtin) return MOE_OK; /* always loaded */
  if (!r->dir) return moe_fail(err, MOE_ENOTFOUND, "model '%s': no model repository configured", name);
  char path[PATH_MAX];
  if ((size_t)snprintf(path, sizeof path, "%s/%s", r->dir, name) >= sizeof path)
    return moe_fail(err, MOE_EINVAL, "model_name: path too long");
  struct stat st;
  if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
    return moe_fail(err, MOE_ENOTFOUND, "model '%s' not found in the model repository", name);
  moe_expert_set *set = NULL;
  /* loading reads and validates files: done outside the lock */
  moe_status s = moe_expert_set_load(path, name, &set, err);
  if (s != MOE_OK) { /* "<name>/config.json: ..." for the client, not the server's absolute path */
    if (err) moed_msg_relative(err->msg, sizeof err->msg, r->dir, "model repository");
    return s;
  }
  return moed_repository_add(r, set, true, err);
}

moe_status moed_repository_add(moed_repository *r, moe_expert_set *set, bool replace, moe_error *err) {
  moed_model *m = model_new(set->name, moe_op_for_expert_sets(), set, false);
  if (!m) {
    moe_expert_set_destroy(set);
    return moe_fail(err, MOE_ENOMEM, "out of memory");
  }
  /* what the log line says, read while m is ours: once inserted and the
   * lock dropped, a concurrent load of the same name may replace and free
   * it (two workers each loading it) */
  char loaded[256];
  snprintf(loaded, sizeof loaded, "%s: %lld experts, H=%lld I=%lld, %s", m->name,
           (long long)set->cfg.num_experts, (long long)set->cfg.hidden_size,
           (long long)set->cfg.intermediate_size, moe_scheme_names[set->cfg.scheme]);
  pthread_mutex_lock(&r->mu);
  size_t i = find_locked(r, set->name);
  moe_status s = MOE_OK;
  if (i < r->count && (r->models[i]->builtin || !replace))
    s = moe_fail(err, MOE_EBUSY, "model '%s' already exists", set->name);
  else
    s = insert_locked(r, m, err);
  pthread_mutex_unlock(&r->mu);
  if (s != MOE_OK) {
    model_free(m);
    return s;
  }
  moed_log(MOED_LOG_INFO, "model_loaded", "%s", loaded);
  return MOE_OK;
}

moe_status moed_repository_unload(moed_repository *r, const char *name, moe_error *err) {
  /* refused as a load refuses it: no such name can be loaded, and one that
   * is not valid is not echoed (it may hold a newline, or run long) */
  if (!moed_model_name_ok(name))
    return moe_fail(err, MOE_EINVAL, "model_name: not a valid model name (%s)", MOED_MODEL_NAME_RULE);
  pthread_mutex_lock(&r->mu);
  size_t i = find_locked(r, name);
  if (i == r->count) {
    pthread_mutex_unlock(&r->mu);
    return moe_fail(err, MOE_ENOTFOUND, "model '%s' is not loaded", name);
  }
  if (r->models[i]->builtin) {
    pthread_mutex_unlock(&r->mu);
    return moe_fail(err, MOE_EINVAL, "model_name: '%s' is built in and cannot be unloaded", name);
  }
  moed_model *m = r->models[i];
  r->models[i] = r->models[--r->count];
  pthread_mutex_unlock(&r->mu);
  moed_log(MOED_LOG_INFO, "model_unloaded", "%s", name);
  moed_model_release(m); /* freed now, or by the last request using it */
  return MOE_OK;
}

void moed_repository_load_all(moed_repository *r) {
  if (!r->dir) return;
  DIR *dir = opendir(r->dir);
  if (!dir) {
    moed_log(MOED_LOG_WARN, "repository", "cannot open %s", r->dir);
    return;
  }
  struct dirent *e;
  while ((e = readdir(dir))) {
    if (!moed_model_name_ok(e->d_name)) continue;
    moe_error err = {{0}};
    char path[PATH_MAX];
    struct stat st;
    if ((size_t)snprintf(path, sizeof path, "%s/%s", r->dir, e->d_name) >= sizeof path) continue;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    if (moed_repository_load(r, e->d_name, &err) != MOE_OK)
      moed_log(MOED_LOG_WARN, "model_load_failed", "%s: %s", e->d_name, err.msg);
  }
  closedir(dir);
}

size_t moed_repository_index(moed_repository *r, moed_index_entry **out) {
  *out = NULL;
  size_t n = 0, cap = 0;
  moed_index_entry *v = NULL;
  pthread_mutex_lock(&r->mu);
  for (size_t i = 0; i < r->count; i++) {
    if (n == cap) {
      cap = cap ? cap * 2 : 32;
      moed_index_entry *g = realloc(v, cap * sizeof *g);
      if (!g) break;
      v = g;
    }
    snprintf(v[n].name, sizeof v[n].name, "%s", r->models[i]->name);
    v[n].state = "READY";
    v[n].reason[0] = 0;
    n++;
  }
  pthread_mutex_unlock(&r->mu);
  /* directory entries not loaded: listed UNAVAILABLE */
  DIR *dir = r->dir ? opendir(r->dir) : NULL;
  struct dirent *e;
  while (dir && (e = readdir(dir))) {
    if (!moed_model_name_ok(e->d_name)) continue;
    bool seen = false;
    for (size_t i = 0; i < n && !seen; i++)
      seen = strcmp(v[i].name, e->d_name) == 0;
    if (seen) continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 32;
      moed_index_entry *g = realloc(v, cap * sizeof *g);
      if (!g) break;
      v = g;
    }
    snprintf(v[n].name, sizeof v[n].name, "%.127s", e->d_name);
    v[n].state = "UNAVAILABLE";
    snprintf(v[n].reason, sizeof v[n].reason, "unloaded");
    n++;
  }
  if (dir) closedir(dir);
  *out = v;
  return n;
}

void moed_repository_foreach(moed_repository *r, void (*fn)(moed_model *m, void *arg), void *arg) {
  pthread_mutex_lock(&r->mu);
  for (size_t i = 0; i < r->count; i++)
    fn(r->models[i], arg);
  pthread_mutex_unlock(&r->mu);
}
