/* Expert sets: the tensors of one MoE layer checked against their config
 * (layouts of docs/numerics.md "fused_moe"), loaded from a directory of
 * safetensors files, built over borrowed tensors, or written with synthetic
 * weights. docs/expert-set.md describes the directory. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "moe/codec.h"
#include "moe/expert_set.h"
#include "moe/safetensors.h"
#include "scheme.h"

/* config.json is a few hundred bytes; anything near this is not a config. */
#define CONFIG_MAX_BYTES (1u << 20)

/* ---- checking each tensor slot against its expected form (scheme.h) ------------- */

static void format_shape(char *buf, size_t cap, int32_t ndim, const int64_t *shape) {
  size_t used = (size_t)snprintf(buf, cap, "[");
  for (int32_t d = 0; d < ndim && d < MOE_MAX_DIMS && used < cap; d++)
    used += (size_t)snprintf(buf + used, cap - used, "%s%lld", d ? ", " : "", (long long)shape[d]);
  if (used < cap) snprintf(buf + used, cap - used, "]");
}

static moe_status check_slot(const moe_expert_config *cfg, moe_expert_tensor slot, const moe_tensor *t,
                             moe_error *err) {
  const char *name = moe_expert_tensor_names[slot];
  moe_slot_spec sp = moe_slot_expected(cfg, slot);
  char want[96], got[96], dtypes[64] = "";
  format_shape(want, sizeof want, sp.ndim, sp.shape);
  if (!t->data) {
    if (sp.presence == MOE_SLOT_REQUIRED)
      return moe_fail(err, MOE_EINVAL, "%s: missing (scheme %s needs %s %s of %s)", name,
                      moe_scheme_names[cfg->scheme], sp.symbols, want, moe_dtype_name(sp.dtypes[0]));
    return MOE_OK;
  }
  if (sp.presence == MOE_SLOT_ABSENT) {
    if (sp.why) return moe_fail(err, MOE_EINVAL, "%s: does not belong to this set (%s)", name, sp.why);
    return moe_fail(err, MOE_EINVAL, "%s: does not belong to this set (scheme %s has no such tensor)", name,
                    moe_scheme_names[cfg->scheme]);
  }
  bool dtype_ok = false;
  size_t used = 0;
  for (const moe_dtype *d = sp.dtypes; *d != MOE_DTYPE_INVALID; d++) {
    dtype_ok |= *d == t->dtype;
    used += (size_t)snprintf(dtypes + used, used < sizeof dtypes ? sizeof dtypes - used : 0, "%s%s",
                             d == sp.dtypes ? "" : " or ", moe_dtype_name(*d));
  }
  if (!dtype_ok)
    return moe_fail(err, MOE_EINVAL, "%s: dtype %s, expected %s", name, moe_dtype_name(t->dtype), dtypes);
  bool shape_ok = t->ndim == sp.ndim;
  for (int32_t d = 0; shape_ok && d < sp.ndim; d++)
    shape_ok = t->shape[d] == sp.shape[d];
  if (!shape_ok) {
    format_shape(got, sizeof got, t->ndim, t->shape);
    return moe_fail(err, MOE_EINVAL, "%s: shape %s, expected %s = %s", name, got, want, sp.symbols);
  }
  size_t need;
  if (moe_tensor_bytes(t, &need) != MOE_OK || t->nbytes != need)
    return moe_fail(err, MOE_EINVAL, "%s: %zu bytes given, shape %s of %s needs %zu", name, t->nbytes, want,
                    moe_dtype_name(t->dtype), need);
  return MOE_OK;
}

moe_status moe_expert_set_validate(const moe_expert_set *set, moe_error *err) {
  if (!set) return moe_fail(err, MOE_EINVAL, "expert set: missing");
  moe_status s = moe_expert_config_validate(&set->cfg, err);
  if (s) return s;
  for (int slot = 0; slot < MOE_EXPERT_TENSOR_COUNT; slot++) {
    s = check_slot(&set->cfg, (moe_expert_tensor)slot, &set->t[slot], err);
    if (s) return s;
  }
  const moe_scheme_desc *d = &moe_schemes[set->cfg.scheme];
  return d->check_values ? d->check_values(set, err) : MOE_OK;
}

/* ---- building sets ----------------------------------------------------------------- */

/* What a loaded set owns: its files, read into memory (the tensors point
 * into their buffers). */
typedef struct set_files {
  size_t count;
  moe_safetensors *files[];
} set_files;

static void set_files_destroy(set_files *f) {
  if (!f) return;
  for (size_t i = 0; i < f->count; i++)
    moe_safetensors_close(f->files[i]);
  free(f);
}

static uint64_t unused_count; /* atomic */

moe_expert_set *moe_expert_set_ref(moe_expert_set *set) {
  if (set) __atomic_fetch_add(&set->refs, 1, __ATOMIC_RELAXED);
  return set;
}

moe_expert_set *moe_expert_set_hold(moe_expert_set *set) {
  if (!set) return NULL;
  __atomic_fetch_add(&set->holds, 1, __ATOMIC_RELAXED);
  return moe_expert_set_ref(set);
}

bool moe_expert_set_unused(const moe_expert_set *set) {
  /* holds only change on the holders' own threads, and a holder asks
   * about its own hold: holds cannot fall under what this thread saw */
  return __atomic_load_n(&set->refs, __ATOMIC_ACQUIRE) == __atomic_load_n(&set->holds, __ATOMIC_ACQUIRE);
}

uint64_t moe_expert_set_unused_count(void) { return __atomic_load_n(&unused_count, __ATOMIC_ACQUIRE); }

/* Drops a reference; a user's (not a hold's) that leaves only holds makes
 * the set unused. */
static void unref(moe_expert_set *set, bool user) {
  const int left = __atomic_sub_fetch(&set->refs, 1, __ATOMIC_ACQ_REL);
  if (left > 0) {
    if (user && left == __atomic_load_n(&set->holds, __ATOMIC_ACQUIRE))
      __atomic_fetch_add(&unused_count, 1, __ATOMIC_RELEASE);
    return;
  }
  set_files_destroy(set->owner);
  free(set);
}

void moe_expert_set_destroy(moe_expert_set *set) {
  if (set) unref(set, true);
}

void moe_expert_set_release_hold(moe_expert_set *set) {
  if (!set) return;
  __atomic_fetch_sub(&set->holds, 1, __ATOMIC_RELAXED);
  unref(set, false);
}

static int slot_by_name(const char *name) {
  for (int i = 0; moe_expert_tensor_names[i]; i++)
    if (strcmp(moe_expert_tensor_names[i], name) == 0) return i;
  return -1;
}

/* A new set with cfg and name, no tensors. */
static moe_status set_create(const char *name, const moe_expert_config *cfg, moe_expert_set **out,
                             moe_error *err) {
  if (!name) name = "";
  if (strlen(name) >= sizeof((moe_expert_set *)0)->name)
    return moe_fail(err, MOE_EINVAL, "expert set name '%.32s...': longer than %zu bytes", name,
                    sizeof((moe_expert_set *)0)->name - 1);
  moe_expert_set *set = calloc(1, sizeof *set);
  if (!set) return moe_fail(err, MOE_ENOMEM, "expert set %s: out of memory", name);
  snprintf(set->name, sizeof set->name, "%s", name);
  set->cfg = *cfg;
  set->refs = 1;
  *out = set;
  return MOE_OK;
}

moe_status moe_expert_set_from_tensors(const char *name, const moe_expert_config *cfg,
                                       const moe_named_tensor *tensors, size_t n, moe_expert_set **out,
                                       moe_error *err) {
  moe_expert_set *set = NULL;
  if (!cfg) return moe_fail(err, MOE_EINVAL, "expert set: no config");
  moe_status s = set_create(name, cfg, &set, err);
  if (s) return s;
  for (size_t i = 0; i < n; i++) {
    const char *tn = tensors[i].name ? tensors[i].name : "(null)";
    int slot = slot_by_name(tn);
    if (slot < 0) {
      s = moe_fail(err, MOE_EINVAL, "%s: not a tensor of an expert set", tn);
      goto fail;
    }
    if (set->t[slot].data) {
      s = moe_fail(err, MOE_EINVAL, "%s: given twice", tn);
      goto fail;
    }
    set->t[slot] = tensors[i].tensor;
  }
  s = moe_expert_set_validate(set, err);
  if (s) goto fail;
  *out = set;
  return MOE_OK;
fail:
  moe_expert_set_destroy(set);
  return s;
}

/* dir + "/" + leaf, malloc'ed; NULL when out of memory. */
static char *path_join(const char *dir, const char *leaf) {
  size_t a = strlen(dir), b = strlen(leaf);
  char *p = malloc(a + b + 2);
  if (!p) return NULL;
  memcpy(p, dir, a);
  p[a] = '/';
  memcpy(p + a + 1, leaf, b + 1);
  return p;
}

/* Reads a whole small text file; *out malloc'ed and NUL-terminated. */
static moe_status read_text(const char *path, size_t cap, char **out, moe_error *err) {
  moe_status s = MOE_OK;
  char *buf = NULL;
  FILE *f = fopen(path, "rb");
  if (!f) return moe_fail(err, errno == ENOENT ? MOE_ENOTFOUND : MOE_EIO, "%s: %s", path, strerror(errno));
  buf = malloc(cap + 1);
  if (!buf) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory", path);
    goto fail;
  }
  size_t n = fread(buf, 1, cap + 1, f);
  if (ferror(f)) {
    s = moe_fail(err, MOE_EIO, "%s: read error", path);
    goto fail;
  }
  if (n > cap) {
    s = moe_fail(err, MOE_EIO, "%s: larger than %zu bytes", path, cap);
    goto fail;
  }
  buf[n] = '\0';
  if (strlen(buf) != n) {
    s = moe_fail(err, MOE_EIO, "%s: contains a NUL byte", path);
    goto fail;
  }
  *out = buf;
  buf = NULL;
fail:
  free(buf);
  fclose(f);
  return s;
}

/* Prefixes err's message with `where`: the callee names the key or tensor,
 * the caller adds the file or directory. */
static moe_status prefix_error(moe_error *err, moe_status s, const char *where) {
  if (!err) return s;
  char msg[sizeof err->msg];
  memcpy(msg, err->msg, sizeof msg);
  return moe_fail(err, s, "%s: %s", where, msg);
}

static int is_safetensors_file(const struct dirent *d) {
  size_t n = strlen(d->d_name);
  const char *ext = ".safetensors";
  size_t e = strlen(ext);
  return d->d_name[0] != '.' && n > e && strcmp(d->d_name + n - e, ext) == 0;
}

/* Binds every tensor of file `fi` to its slot; from[] remembers which file
 * filled a slot, for the duplicate message. */
static moe_status bind_file(moe_expert_set *set, set_files *files, size_t fi, const char *path, size_t *from,
                            struct dirent *const *list, moe_error *err) {
  moe_safetensors *st = files->files[fi];
  for (size_t i = 0; i < moe_safetensors_count(st); i++) {
    const char *tn = moe_safetensors_name(st, i);
    int slot = slot_by_name(tn);
    if (slot < 0)
      return moe_fail(err, MOE_EINVAL,
                      "%s: tensor '%s' is not a tensor of an expert set (see docs/expert-set.md)", path, tn);
    if (set->t[slot].data)
      return moe_fail(err, MOE_EINVAL, "%s: tensor '%s' also in %s", path, tn, list[from[slot]]->d_name);
    moe_tensor t;
    moe_status s = moe_safetensors_get(st, tn, &t, err);
    if (s) return s;
    /* kernels read elements through typed pointers */
    unsigned align = moe_dtype_bits(t.dtype) / 8;
    if (align > 1 && (uintptr_t)t.data % align != 0)
      return moe_fail(err, MOE_EINVAL, "%s: tensor '%s' is not aligned to its %u-byte elements", path, tn,
                      align);
    if (!t.data || t.nbytes == 0) return moe_fail(err, MOE_EINVAL, "%s: tensor '%s' is empty", path, tn);
    set->t[slot] = t;
    from[slot] = fi;
  }
  return MOE_OK;
}

moe_status moe_expert_set_load(const char *dir, const char *name, moe_expert_set **out, moe_error *err) {
  moe_status s = MOE_OK;
  moe_expert_set *set = NULL;
  set_files *files = NULL;
  struct dirent **list = NULL;
  int nlist = 0;
  char *cfg_path = NULL, *text = NULL, *file_path = NULL;
  size_t from[MOE_EXPERT_TENSOR_COUNT] = {0};
  moe_expert_config cfg;

  if (!dir) return moe_fail(err, MOE_EINVAL, "expert set: no directory");
  cfg_path = path_join(dir, "config.json");
  if (!cfg_path) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory", dir);
    goto fail;
  }
  s = read_text(cfg_path, CONFIG_MAX_BYTES, &text, err);
  if (s) goto fail;
  s = moe_expert_config_parse(text, &cfg, err);
  if (s) {
    s = prefix_error(err, s, cfg_path);
    goto fail;
  }
  s = set_create(name, &cfg, &set, err);
  if (s) goto fail;

  nlist = scandir(dir, &list, is_safetensors_file, alphasort);
  if (nlist < 0) {
    s = moe_fail(err, errno == ENOENT ? MOE_ENOTFOUND : MOE_EIO, "%s: %s", dir, strerror(errno));
    nlist = 0;
    goto fail;
  }
  if (nlist == 0) {
    s = moe_fail(err, MOE_ENOTFOUND, "%s: no .safetensors files", dir);
    goto fail;
  }
  files = calloc(1, sizeof *files + (size_t)nlist * sizeof files->files[0]);
  if (!files) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory", dir);
    goto fail;
  }
  set->owner = files;
  for (int i = 0; i < nlist; i++) {
    free(file_path);
    file_path = path_join(dir, list[i]->d_name);
    if (!file_path) {
      s = moe_fail(err, MOE_ENOMEM, "%s: out of memory", dir);
      goto fail;
    }
    s = moe_safetensors_open(file_path, &files->files[i], err);
    if (s) goto fail;
    files->count++;
    s = bind_file(set, files, (size_t)i, file_path, from, list, err);
    if (s) goto fail;
  }
  s = moe_expert_set_validate(set, err);
  if (s) {
    s = prefix_error(err, s, dir);
    goto fail;
  }
  *out = set;
  set = NULL;
fail:
  moe_expert_set_destroy(set);
  for (int i = 0; i < nlist; i++)
    free(list[i]);
  free(list);
  free(file_path);
  free(text);
  free(cfg_path);
  return s;
}

/* ---- synthetic sets ------------------------------------------------------------------ */

/* mkdir -p: creates dir and its missing parents. */
static moe_status make_dirs(const char *dir, moe_error *err) {
  moe_status s = MOE_OK;
  char *p = strdup(dir);
  if (!p) return moe_fail(err, MOE_ENOMEM, "%s: out of memory", dir);
  for (char *c = p + 1; *c; c++) {
    if (*c != '/') continue;
    *c = '\0';
    if (mkdir(p, 0777) != 0 && errno != EEXIST) {
      s = moe_fail(err, MOE_EIO, "%s: %s", p, strerror(errno));
      goto fail;
    }
    *c = '/';
  }
  struct stat sb;
  if ((mkdir(p, 0777) != 0 && errno != EEXIST) || stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode))
    s = moe_fail(err, MOE_EIO, "%s: cannot create the directory", dir);
fail:
  free(p);
  return s;
}

moe_status moe_expert_set_write_random(const char *dir, const moe_expert_config *cfg, uint64_t seed,
                                       moe_error *err) {
  moe_status s;
  moe_named_tensor tensors[MOE_EXPERT_TENSOR_COUNT];
  size_t n = 0;
  char *path = NULL, *json = NULL;
  FILE *f = NULL;
  uint64_t rng = seed;
  memset(tensors, 0, sizeof tensors);

  if (!dir || !cfg) return moe_fail(err, MOE_EINVAL, "expert set: no directory or config");
  s = moe_expert_config_validate(cfg, err);
  if (s) return s;
  s = make_dirs(dir, err);
  if (s) return s;

  for (int slot = 0; slot < MOE_EXPERT_TENSOR_COUNT; slot++) {
    moe_slot_spec sp = moe_slot_expected(cfg, (moe_expert_tensor)slot);
    if (sp.presence != MOE_SLOT_REQUIRED) continue; /* optional slots (correction_bias) stay out */
    moe_named_tensor *nt = &tensors[n];
    nt->name = moe_expert_tensor_names[slot];
    nt->tensor.dtype = sp.dtypes[0];
    nt->tensor.ndim = sp.ndim;
    memcpy(nt->tensor.shape, sp.shape, sizeof sp.shape);
    if (moe_tensor_bytes(&nt->tensor, &nt->tensor.nbytes) != MOE_OK) {
      s = moe_fail(err, MOE_EOVERFLOW, "%s: size overflows", nt->name);
      goto fail;
    }
    nt->tensor.data = malloc(nt->tensor.nbytes ? nt->tensor.nbytes : 1);
    if (!nt->tensor.data) {
      s = moe_fail(err, MOE_ENOMEM, "%s: out of memory for %zu bytes", nt->name, nt->tensor.nbytes);
      goto fail;
    }
    n++;
    moe_slot_fill(cfg, (moe_expert_tensor)slot, &nt->tensor, &rng);
  }

  path = path_join(dir, "weights.safetensors");
  json = moe_expert_config_to_json(cfg);
  if (!path || !json) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory", dir);
    goto fail;
  }
  s = moe_safetensors_write(path, tensors, n, err);
  if (s) goto fail;
  /* config last: a directory with config.json is complete */
  free(path);
  path = path_join(dir, "config.json");
  if (!path) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory", dir);
    goto fail;
  }
  f = fopen(path, "wb");
  if (!f) {
    s = moe_fail(err, MOE_EIO, "%s: %s", path, strerror(errno));
    goto fail;
  }
  size_t len = strlen(json);
  bool ok = fwrite(json, 1, len, f) == len;
  if (fclose(f) != 0) ok = false;
  f = NULL;
  if (!ok) s = moe_fail(err, MOE_EIO, "%s: write failed", path);
fail:
  if (f) fclose(f);
  for (size_t i = 0; i < n; i++)
    free(tensors[i].tensor.data);
  free(json);
  free(path);
  return s;
}
