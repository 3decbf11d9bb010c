/* The safetensors format: reader (file read into memory the object owns,
 * header validated before any tensor is handed out) and writer.
 *
 * Layout: an 8-byte little-endian length N, N bytes of JSON
 *   {"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
 *    ..., "__metadata__": {..}}
 * then the data section; offsets count from its start. Like the reference
 * implementation we require the tensors to tile the data section exactly (no
 * overlap, no gap, nothing after the last one), so a file we accept is one
 * every other reader accepts too. Malformed files are MOE_EIO; dtypes we do
 * not map are MOE_EUNSUPPORTED, naming the tensor. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "moe/backend.h"
#include "moe/ops.h"
#include "moe/safetensors.h"

/* The reference implementation's cap: a longer header is a corrupt length. */
#define ST_MAX_HEADER ((uint64_t)100 * 1000 * 1000)
/* Header integers arrive as JSON doubles, exact only up to 2^53. */
#define ST_MAX_JSON_INT 9007199254740992.0
/* Bytes per read(2) call when loading a file: a bounded request per call
 * (some kernels cap one read near 2 GiB anyway), straight into the owned
 * buffer, so a large file needs no second copy. */
#define ST_READ_CHUNK ((size_t)64 << 20)

/* ---- the dtype table --------------------------------------------------------- */

/* Every safetensors dtype whose size we know. dtype INVALID: known but not
 * mapped to ours; such a file opens (its offsets can still be checked) and
 * moe_safetensors_get reports the tensor as unsupported. */
static const struct {
  const char *name;
  moe_dtype dtype;
  unsigned size;
} st_dtypes[] = {
    {"F32", MOE_F32, 4},
    {"F16", MOE_F16, 2},
    {"BF16", MOE_BF16, 2},
    {"U8", MOE_UINT8, 1},
    {"I8", MOE_INT8, 1},
    {"I32", MOE_INT32, 4},
    {"F8_E4M3", MOE_FP8_E4M3FN, 1},
    {"F8_E5M2", MOE_FP8_E5M2, 1},
    {"F64", MOE_DTYPE_INVALID, 8},
    {"I64", MOE_DTYPE_INVALID, 8},
    {"U64", MOE_DTYPE_INVALID, 8},
    {"U32", MOE_DTYPE_INVALID, 4},
    {"I16", MOE_DTYPE_INVALID, 2},
    {"U16", MOE_DTYPE_INVALID, 2},
    {"BOOL", MOE_DTYPE_INVALID, 1},
};
#define ST_DTYPE_COUNT (sizeof st_dtypes / sizeof st_dtypes[0])

/* Row of a safetensors dtype name; ST_DTYPE_COUNT when unknown. */
static size_t st_dtype_by_name(const char *name) {
  for (size_t i = 0; i < ST_DTYPE_COUNT; i++)
    if (strcmp(st_dtypes[i].name, name) == 0) return i;
  return ST_DTYPE_COUNT;
}

/* Row of one of our dtypes; ST_DTYPE_COUNT when the format has no name for it. */
static size_t st_dtype_by_moe(moe_dtype t) {
  for (size_t i = 0; i < ST_DTYPE_COUNT; i++)
    if (t != MOE_DTYPE_INVALID && st_dtypes[i].dtype == t) return i;
  return ST_DTYPE_COUNT;
}

const char *moe_safetensors_dtype_name(moe_dtype t) {
  const size_t row = st_dtype_by_moe(t);
  return row < ST_DTYPE_COUNT ? st_dtypes[row].name : NULL;
}

/* ---- the reader ---------------------------------------------------------------- */

typedef struct st_entry {
  char *name; /* owned */
  size_t row; /* in st_dtypes */
  int32_t ndim;
  int64_t shape[MOE_MAX_DIMS];
  size_t begin, end; /* within the data section */
} st_entry;

struct moe_safetensors {
  const uint8_t *base; /* the whole file or buffer */
  size_t size;
  void *owned;         /* `base` when we read the file; NULL for a caller's buffer */
  const uint8_t *data; /* data section */
  size_t data_size;
  st_entry *entries; /* in header order */
  size_t count;
  st_entry **by_name; /* sorted by name, for lookup and duplicate detection */
  char origin[256];   /* path or "(buffer)", for messages */
};

static int cmp_entry_name(const void *a, const void *b) {
  return strcmp((*(st_entry *const *)a)->name, (*(st_entry *const *)b)->name);
}

static int cmp_entry_offset(const void *a, const void *b) {
  const st_entry *x = *(st_entry *const *)a, *y = *(st_entry *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

/* A JSON number that is a non-negative integer exactly representable. */
static bool json_uint(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v)) return false;
  double d = v->valuedouble;
  /* the range test first: converting NaN or a negative to uint64 is undefined */
  if (!(d >= 0.0 && d <= ST_MAX_JSON_INT)) return false;
  uint64_t u = (uint64_t)d;
  if ((double)u != d) return false;
  *out = u;
  return true;
}

/* Parses and checks one header entry into e. */
static moe_status parse_entry(const moe_safetensors *st, const cJSON *item, st_entry *e, moe_error *err) {
  const char *name = item->string;
  if (!cJSON_IsObject(item))
    return moe_fail(err, MOE_EIO, "%s: tensor '%s': header entry is not an object", st->origin, name);

  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
  if (!cJSON_IsString(dt) || !dt->valuestring)
    return moe_fail(err, MOE_EIO, "%s: tensor '%s': dtype missing or not a string", st->origin, name);
  e->row = st_dtype_by_name(dt->valuestring);
  if (e->row == ST_DTYPE_COUNT)
    return moe_fail(err, MOE_EUNSUPPORTED, "%s: tensor '%s': unknown dtype '%s'", st->origin, name,
                    dt->valuestring);

  const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
  if (!cJSON_IsArray(shape))
    return moe_fail(err, MOE_EIO, "%s: tensor '%s': shape missing or not an array", st->origin, name);
  int rank = cJSON_GetArraySize(shape);
  if (rank > MOE_MAX_DIMS)
    return moe_fail(err, MOE_EIO, "%s: tensor '%s': shape has rank %d, at most %d supported", st->origin,
                    name, rank, MOE_MAX_DIMS);
  e->ndim = rank;
  size_t numel = 1;
  bool overflow = false;
  int d = 0;
  for (const cJSON *dim = shape->child; dim; dim = dim->next, d++) {
    uint64_t u;
    if (!json_uint(dim, &u))
      return moe_fail(err, MOE_EIO, "%s: tensor '%s': shape[%d] is not a non-negative integer", st->origin,
                      name, d);
    e->shape[d] = (int64_t)u;
    /* left to right, as moe_tensor_numel does: a shape the rest of the
     * library cannot size is rejected here */
    if (!overflow && (!moe_mul_size(numel, (size_t)u, &numel) || numel > (size_t)INT64_MAX)) overflow = true;
  }
  size_t nbytes = 0;
  if (overflow || !moe_mul_size(numel, st_dtypes[e->row].size, &nbytes))
    return moe_fail(err, MOE_EIO, "%s: tensor '%s': shape overflows the size arithmetic", st->origin, name);

  const cJSON *offs = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
  uint64_t begin, end;
  if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || !json_uint(offs->child, &begin) ||
      !json_uint(offs->child->next, &end))
    return moe_fail(err, MOE_EIO, "%s: tensor '%s': data_offsets must be [begin, end] non-negative integers",
                    st->origin, name);
  if (begin > end || end > st->data_size)
    return moe_fail(err, MOE_EIO,
                    "%s: tensor '%s': data_offsets [%llu, %llu] outside the data section of %zu bytes",
                    st->origin, name, (unsigned long long)begin, (unsigned long long)end, st->data_size);
  if (end - begin != nbytes)
    return moe_fail(err, MOE_EIO, "%s: tensor '%s': data_offsets span %llu bytes, dtype and shape need %zu",
                    st->origin, name, (unsigned long long)(end - begin), nbytes);
  e->begin = (size_t)begin;
  e->end = (size_t)end;
  return MOE_OK;
}

/* The tensors must tile the data section: sorted by offset, each begins where
 * the previous one ended, and the last ends at the end of the file. */
static moe_status check_tiling(const moe_safetensors *st, moe_error *err) {
  moe_status s = MOE_OK;
  st_entry **order = malloc((st->count ? st->count : 1) * sizeof *order);
  if (!order) return moe_fail(err, MOE_ENOMEM, "%s: out of memory", st->origin);
  for (size_t i = 0; i < st->count; i++)
    order[i] = &st->entries[i];
  qsort(order, st->count, sizeof *order, cmp_entry_offset);
  size_t pos = 0;
  for (size_t i = 0; i < st->count; i++) {
    if (order[i]->begin != pos) {
      s = moe_fail(err, MOE_EIO, "%s: tensor '%s': data_offsets begin at %zu, expected %zu (%s)", st->origin,
                   order[i]->name, order[i]->begin, pos,
                   order[i]->begin < pos ? "overlaps the previous tensor" : "gap before it");
      goto fail;
    }
    pos = order[i]->end;
  }
  if (pos != st->data_size)
    s = moe_fail(err, MOE_EIO, "%s: data section has %zu bytes, tensors cover %zu", st->origin, st->data_size,
                 pos);
fail:
  free(order);
  return s;
}

/* Validates the header of st->base and fills the entries. */
static moe_status parse_header(moe_safetensors *st, moe_error *err) {
  moe_status s = MOE_OK;
  char *text = NULL;
  cJSON *root = NULL;
  if (st->size < 8) {
    s = moe_fail(err, MOE_EIO, "%s: %zu bytes, too short for a safetensors header", st->origin, st->size);
    goto fail;
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = (n << 8) | st->base[i];
  if (n > st->size - 8 || n > ST_MAX_HEADER || n < 2) {
    s = moe_fail(err, MOE_EIO, "%s: header length %llu is invalid for a file of %zu bytes", st->origin,
                 (unsigned long long)n, st->size);
    goto fail;
  }
  /* Parse a NUL-terminated copy: no JSON parser read can then run past the
   * header into (or beyond) the mapping. */
  text = malloc((size_t)n + 1);
  if (!text) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory for the header", st->origin);
    goto fail;
  }
  memcpy(text, st->base + 8, (size_t)n);
  text[n] = '\0';
  const char *end = NULL;
  root = cJSON_ParseWithOpts(text, &end, 0);
  if (!root) {
    s = moe_fail(err, MOE_EIO, "%s: header is not valid JSON (at byte %td)", st->origin,
                 end ? end - text : 0);
    goto fail;
  }
  /* The format pads the header with spaces; anything else after the object
   * (an embedded NUL included) is corruption. */
  while (end < text + n && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
    end++;
  if (end != text + n) {
    s = moe_fail(err, MOE_EIO, "%s: header has trailing bytes after the JSON object (at byte %td)",
                 st->origin, end - text);
    goto fail;
  }
  if (!cJSON_IsObject(root)) {
    s = moe_fail(err, MOE_EIO, "%s: header is not a JSON object", st->origin);
    goto fail;
  }
  st->data = st->base + 8 + n;
  st->data_size = st->size - 8 - (size_t)n;

  size_t count = 0;
  for (const cJSON *it = root->child; it; it = it->next)
    if (strcmp(it->string, "__metadata__") != 0) count++;
  st->entries = calloc(count ? count : 1, sizeof *st->entries);
  st->by_name = calloc(count ? count : 1, sizeof *st->by_name);
  if (!st->entries || !st->by_name) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory for %zu header entries", st->origin, count);
    goto fail;
  }
  for (const cJSON *it = root->child; it; it = it->next) {
    if (strcmp(it->string, "__metadata__") == 0) continue; /* free-form strings: ignored */
    st_entry *e = &st->entries[st->count];
    s = parse_entry(st, it, e, err);
    if (s) goto fail;
    e->name = strdup(it->string);
    if (!e->name) {
      s = moe_fail(err, MOE_ENOMEM, "%s: out of memory", st->origin);
      goto fail;
    }
    st->by_name[st->count] = e;
    st->count++;
  }
  qsort(st->by_name, st->count, sizeof *st->by_name, cmp_entry_name);
  for (size_t i = 1; i < st->count; i++)
    if (strcmp(st->by_name[i - 1]->name, st->by_name[i]->name) == 0) {
      s = moe_fail(err, MOE_EIO, "%s: tensor '%s' appears twice in the header", st->origin,
                   st->by_name[i]->name);
      goto fail;
    }
  s = check_tiling(st, err);
fail:
  cJSON_Delete(root);
  free(text);
  return s;
}

/* Builds the object over base/size; `owned` (may be NULL) becomes ours on success. */
static moe_status st_create(const void *base, size_t size, void *owned, const char *origin,
                            moe_safetensors **out, moe_error *err) {
  moe_safetensors *st = calloc(1, sizeof *st);
  if (!st) return moe_fail(err, MOE_ENOMEM, "%s: out of memory", origin);
  st->base = base;
  st->size = size;
  snprintf(st->origin, sizeof st->origin, "%s", origin);
  moe_status s = parse_header(st, err);
  if (s) goto fail;
  st->owned = owned;
  *out = st;
  return MOE_OK;
fail:
  moe_safetensors_close(st); /* st->owned still NULL: the caller keeps the buffer */
  return s;
}

/* The tensor whose data hold file byte `pos`; NULL in the header. For read
 * errors, which then name what could not be loaded. */
static const char *tensor_at(const moe_safetensors *st, size_t pos) {
  const size_t data_start = (size_t)(st->data - st->base);
  for (size_t i = 0; pos >= data_start && i < st->count; i++)
    if (pos - data_start >= st->entries[i].begin && pos - data_start < st->entries[i].end)
      return st->entries[i].name;
  return NULL;
}

/* Reads file bytes [from, to) of fd into buf + from, in chunks. `st` (may
 * be NULL: header not parsed yet) names the tensor at a failing offset. */
static moe_status read_range(int fd, uint8_t *buf, size_t from, size_t to, const char *path,
                             const moe_safetensors *st, moe_error *err) {
  size_t pos = from;
  while (pos < to) {
    const size_t want = to - pos < ST_READ_CHUNK ? to - pos : ST_READ_CHUNK;
    /* pos < file size, which came from an off_t */
    const ssize_t got = pread(fd, buf + pos, want, (off_t)pos);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int e = got < 0 ? errno : 0;
      const char *tn = st ? tensor_at(st, pos) : NULL;
      return moe_fail(err, MOE_EIO, "%s%s%s%s: read at byte %zu of %zu: %s", path, tn ? ": tensor '" : "",
                      tn ? tn : "", tn ? "'" : "", pos, to,
                      e ? strerror(e) : "end of file (file shrank while loading)");
    }
    pos += (size_t)got;
  }
  return MOE_OK;
}

/* The file is read, not mapped: a mapping faults (SIGBUS) or changes under
 * its readers when someone truncates or rewrites the file in place, and an
 * expert set's tensors are read for as long as it is served. The header is
 * read and validated first, so a corrupt file costs no data read and read
 * errors can name the tensor. */
moe_status moe_safetensors_open(const char *path, moe_safetensors **out, moe_error *err) {
  moe_status s;
  uint8_t *buf = NULL;
  moe_safetensors *st = NULL;
  struct stat sb, after;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    s = moe_fail(err, errno == ENOENT ? MOE_ENOTFOUND : MOE_EIO, "%s: %s", path, strerror(errno));
    goto fail;
  }
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    s = moe_fail(err, MOE_EIO, "%s: not a readable regular file", path);
    goto fail;
  }
  if (sb.st_size < 8 || (uint64_t)sb.st_size > SIZE_MAX) {
    s = moe_fail(err, MOE_EIO, "%s: %lld bytes, too short for a safetensors header", path,
                 (long long)sb.st_size);
    goto fail;
  }
  const size_t size = (size_t)sb.st_size;
  /* page-aligned, as a mapping was: tensors keep the alignment the file
   * gives them, and device copies may pin whole pages; huge pages for
   * large files (moe_host_alloc) */
  const long page = sysconf(_SC_PAGESIZE);
  void *mem = moe_host_alloc(size, page > 0 ? (size_t)page : 4096);
  if (!mem) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory for %zu bytes", path, size);
    goto fail;
  }
  buf = mem;
  s = read_range(fd, buf, 0, 8, path, NULL, err);
  if (s) goto fail;
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = (n << 8) | buf[i];
  /* an invalid length is left for parse_header to report */
  const size_t header_end = n <= size - 8 && n <= ST_MAX_HEADER ? 8 + (size_t)n : 8;
  s = read_range(fd, buf, 8, header_end, path, NULL, err);
  if (s) goto fail;
  s = st_create(buf, size, buf, path, &st, err);
  if (s) goto fail;
  buf = NULL; /* st's now */
  s = read_range(fd, (uint8_t *)st->owned, header_end, size, path, st, err);
  if (s) goto fail;
  /* a writer during the load could leave us a mix of two files */
  if (fstat(fd, &after) != 0 || after.st_size != sb.st_size || after.st_mtim.tv_sec != sb.st_mtim.tv_sec ||
      after.st_mtim.tv_nsec != sb.st_mtim.tv_nsec) {
    s = moe_fail(err, MOE_EIO, "%s: file changed while loading", path);
    goto fail;
  }
  close(fd);
  *out = st;
  return MOE_OK;
fail:
  moe_safetensors_close(st);
  free(buf);
  if (fd >= 0) close(fd);
  return s;
}

moe_status moe_safetensors_open_buffer(const void *data, size_t size, moe_safetensors **out, moe_error *err) {
  if (!data && size) return moe_fail(err, MOE_EINVAL, "(buffer): no data");
  return st_create(data, size, NULL, "(buffer)", out, err);
}

void moe_safetensors_close(moe_safetensors *st) {
  if (!st) return;
  for (size_t i = 0; i < st->count; i++)
    free(st->entries[i].name);
  free(st->entries);
  free(st->by_name);
  free(st->owned);
  free(st);
}

size_t moe_safetensors_count(const moe_safetensors *st) { return st->count; }

const char *moe_safetensors_name(const moe_safetensors *st, size_t i) {
  return i < st->count ? st->entries[i].name : NULL;
}

moe_status moe_safetensors_get(const moe_safetensors *st, const char *name, moe_tensor *out, moe_error *err) {
  if (!name) return moe_fail(err, MOE_EINVAL, "%s: no tensor name given", st->origin);
  st_entry key = {.name = (char *)name}, *pkey = &key;
  st_entry **hit = bsearch(&pkey, st->by_name, st->count, sizeof *st->by_name, cmp_entry_name);
  if (!hit) return moe_fail(err, MOE_ENOTFOUND, "%s: no tensor '%s'", st->origin, name);
  const st_entry *e = *hit;
  if (st_dtypes[e->row].dtype == MOE_DTYPE_INVALID)
    return moe_fail(err, MOE_EUNSUPPORTED, "%s: tensor '%s': dtype %s is not supported", st->origin, name,
                    st_dtypes[e->row].name);
  memset(out, 0, sizeof *out);
  out->dtype = st_dtypes[e->row].dtype;
  out->ndim = e->ndim;
  for (int d = 0; d < e->ndim; d++)
    out->shape[d] = e->shape[d];
  /* moe_tensor has no const: users only read */
  out->data = (void *)(uintptr_t)(st->data + e->begin);
  out->nbytes = e->end - e->begin;
  return MOE_OK;
}

/* ---- the writer ----------------------------------------------------------------- */

/* A growing string for the header. */
/* The header text: {name: {dtype, shape, data_offsets}} in the given order
 * (cJSON: names escaped), integers printed exactly (raw: cJSON's numbers are
 * doubles), padded with spaces to a multiple of 8 so that the data start
 * aligned. NULL when out of memory. */
static char *header_json(const moe_named_tensor *t, size_t n, const size_t *rows, const size_t *begin,
                         size_t *len) {
  cJSON *root = cJSON_CreateObject();
  bool ok = root != NULL;
  char num[24];
  for (size_t i = 0; ok && i < n; i++) {
    cJSON *e = cJSON_AddObjectToObject(root, t[i].name), *shape = NULL, *offs = NULL;
    ok = e && cJSON_AddStringToObject(e, "dtype", st_dtypes[rows[i]].name) &&
         (shape = cJSON_AddArrayToObject(e, "shape")) && (offs = cJSON_AddArrayToObject(e, "data_offsets"));
    for (int d = 0; ok && d < t[i].tensor.ndim; d++) {
      snprintf(num, sizeof num, "%llu", (unsigned long long)t[i].tensor.shape[d]);
      ok = cJSON_AddItemToArray(shape, cJSON_CreateRaw(num));
    }
    for (int k = 0; ok && k < 2; k++) {
      snprintf(num, sizeof num, "%llu", (unsigned long long)begin[i] + (k ? t[i].tensor.nbytes : 0));
      ok = cJSON_AddItemToArray(offs, cJSON_CreateRaw(num));
    }
  }
  char *text = ok ? cJSON_PrintUnformatted(root) : NULL;
  cJSON_Delete(root);
  if (!text) return NULL;
  size_t l = strlen(text), padded = (l + 7) / 8 * 8;
  char *out = realloc(text, padded + 1);
  if (!out) {
    free(text);
    return NULL;
  }
  memset(out + l, ' ', padded - l);
  out[padded] = 0;
  *len = padded;
  return out;
}

/* Data-section order: larger elements first, so that every tensor starts at
 * a multiple of its element size (the header is padded to 8 bytes). */
typedef struct write_slot {
  size_t index;
  unsigned size;
} write_slot;

static int cmp_write_slot(const void *a, const void *b) {
  const write_slot *x = a, *y = b;
  if (x->size != y->size) return x->size > y->size ? -1 : 1;
  return x->index < y->index ? -1 : x->index > y->index;
}

/* Checks the tensors to write; rows[i] receives tensor i's st_dtypes row. */
static moe_status check_write_inputs(const moe_named_tensor *t, size_t n, size_t *rows, moe_error *err) {
  for (size_t i = 0; i < n; i++) {
    const char *name = t[i].name;
    if (!name || !*name || strcmp(name, "__metadata__") == 0)
      return moe_fail(err, MOE_EINVAL, "tensor %zu: missing or reserved name", i);
    for (size_t j = 0; j < i; j++)
      if (strcmp(t[j].name, name) == 0) return moe_fail(err, MOE_EINVAL, "tensor '%s' given twice", name);
    rows[i] = st_dtype_by_moe(t[i].tensor.dtype);
    if (rows[i] == ST_DTYPE_COUNT)
      return moe_fail(err, MOE_EUNSUPPORTED, "tensor '%s': dtype %s has no safetensors name", name,
                      moe_dtype_name(t[i].tensor.dtype));
    size_t need;
    if (t[i].tensor.ndim < 0 || t[i].tensor.ndim > MOE_MAX_DIMS || moe_tensor_bytes(&t[i].tensor, &need))
      return moe_fail(err, MOE_EINVAL, "tensor '%s': invalid shape", name);
    if (need != t[i].tensor.nbytes)
      return moe_fail(err, MOE_EINVAL, "tensor '%s': %zu bytes given, shape and dtype need %zu", name,
                      t[i].tensor.nbytes, need);
    if (need && !t[i].tensor.data) return moe_fail(err, MOE_EINVAL, "tensor '%s': no data", name);
  }
  return MOE_OK;
}

char *moe_safetensors_header(const moe_named_tensor *tensor, size_t *len) {
  const size_t row = st_dtype_by_moe(tensor->tensor.dtype), begin = 0;
  return row < ST_DTYPE_COUNT ? header_json(tensor, 1, &row, &begin, len) : NULL;
}

moe_status moe_safetensors_write(const char *path, const moe_named_tensor *tensors, size_t n,
                                 moe_error *err) {
  moe_status s = MOE_OK;
  size_t *rows = NULL, *begin = NULL;
  write_slot *order = NULL;
  char *hdr = NULL;
  size_t hdr_len = 0;
  char *tmp = NULL;
  FILE *f = NULL;

  rows = calloc(n ? n : 1, sizeof *rows);
  begin = calloc(n ? n : 1, sizeof *begin);
  order = calloc(n ? n : 1, sizeof *order);
  if (!rows || !begin || !order) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory", path);
    goto fail;
  }
  s = check_write_inputs(tensors, n, rows, err);
  if (s) goto fail;

  for (size_t i = 0; i < n; i++)
    order[i] = (write_slot){i, st_dtypes[rows[i]].size};
  qsort(order, n, sizeof *order, cmp_write_slot);
  size_t pos = 0;
  for (size_t i = 0; i < n; i++) {
    begin[order[i].index] = pos;
    if (!moe_add_size(pos, tensors[order[i].index].tensor.nbytes, &pos)) {
      s = moe_fail(err, MOE_EOVERFLOW, "%s: total size overflows", path);
      goto fail;
    }
  }

  /* the header lists tensors in the caller's order */
  hdr = header_json(tensors, n, rows, begin, &hdr_len);
  if (!hdr) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory for the header", path);
    goto fail;
  }

  /* write beside the target and rename: readers never see half a file */
  size_t plen = strlen(path);
  tmp = malloc(plen + 5);
  if (!tmp) {
    s = moe_fail(err, MOE_ENOMEM, "%s: out of memory", path);
    goto fail;
  }
  memcpy(tmp, path, plen);
  memcpy(tmp + plen, ".tmp", 5);
  f = fopen(tmp, "wb");
  if (!f) {
    s = moe_fail(err, MOE_EIO, "%s: %s", tmp, strerror(errno));
    goto fail;
  }
  unsigned char len8[8];
  for (int i = 0; i < 8; i++)
    len8[i] = (unsigned char)((uint64_t)hdr_len >> (8 * i));
  bool ok = fwrite(len8, 1, 8, f) == 8 && fwrite(hdr, 1, hdr_len, f) == hdr_len;
  for (size_t i = 0; ok && i < n; i++) {
    const moe_tensor *t = &tensors[order[i].index].tensor;
    if (t->nbytes) ok = fwrite(t->data, 1, t->nbytes, f) == t->nbytes;
  }
  int close_rc = fclose(f);
  f = NULL;
  if (!ok || close_rc != 0 || rename(tmp, path) != 0) {
    s = moe_fail(err, MOE_EIO, "%s: write failed: %s", path, strerror(errno));
    unlink(tmp);
    goto fail;
  }
fail:
  if (f) {
    fclose(f);
    unlink(tmp);
  }
  free(tmp);
  free(hdr);
  free(order);
  free(begin);
  free(rows);
  return s;
}
