/* npy: reader and writer of the .npy header format (magic, version, header
 * length, a Python-dict header, then the data). Shapes are untrusted:
 * products are overflow-checked and must match the file size. */
#include "npy.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char magic[] = "\x93NUMPY";

size_t npy_itemsize(const char *d) {
  static const struct {
    const char *descr;
    size_t size;
  } table[] = {
      {"<f4", 4}, {"<f2", 2}, {"<u2", 2}, {"|u1", 1}, {"|i1", 1}, {"<i4", 4}, {"<f8", 8}, {"<i8", 8},
  };
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
    if (strcmp(table[i].descr, d) == 0) return table[i].size;
  return 0;
}

/* The text after `'key':` in the header dict (skipping spaces), or NULL. */
static const char *dict_value(const char *hdr, const char *key) {
  char pat[32];
  snprintf(pat, sizeof pat, "'%s':", key);
  const char *p = strstr(hdr, pat);
  if (!p) return NULL;
  p += strlen(pat);
  while (*p == ' ')
    p++;
  return p;
}

int npy_read(const char *path, npy_array *out, char *err, size_t cap) {
  memset(out, 0, sizeof *out);
  char *hdr = NULL;
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, cap, "%s: %s", path, strerror(errno));
    return -1;
  }
  unsigned char pre[10];
  if (fread(pre, 1, 8, f) != 8 || memcmp(pre, magic, 6) != 0) {
    snprintf(err, cap, "%s: not a .npy file", path);
    goto fail;
  }
  size_t hlen;
  if (pre[6] == 1) {
    if (fread(pre, 1, 2, f) != 2) goto short_read;
    hlen = (size_t)pre[0] | (size_t)pre[1] << 8;
  } else {
    if (fread(pre, 1, 4, f) != 4) goto short_read;
    hlen = (size_t)pre[0] | (size_t)pre[1] << 8 | (size_t)pre[2] << 16 | (size_t)pre[3] << 24;
    if (hlen > (1u << 20)) {
      snprintf(err, cap, "%s: header too large", path);
      goto fail;
    }
  }
  hdr = malloc(hlen + 1);
  if (!hdr || fread(hdr, 1, hlen, f) != hlen) goto short_read;
  hdr[hlen] = 0;
  const char *d = dict_value(hdr, "descr");
  if (!d || *d != '\'' || !strchr(d + 1, '\'') ||
      (size_t)(strchr(d + 1, '\'') - d - 1) >= sizeof out->descr) {
    snprintf(err, cap, "%s: no descr in header", path);
    goto fail;
  }
  memcpy(out->descr, d + 1, (size_t)(strchr(d + 1, '\'') - d - 1));
  if (strcmp(out->descr, "<b1") == 0 || strcmp(out->descr, "|b1") == 0) strcpy(out->descr, "|u1");
  if (strcmp(out->descr, "<u1") == 0) strcpy(out->descr, "|u1");
  if (strcmp(out->descr, "<i1") == 0) strcpy(out->descr, "|i1");
  size_t item = npy_itemsize(out->descr);
  if (!item) {
    snprintf(err, cap, "%s: dtype %s not supported", path, out->descr);
    goto fail;
  }
  const char *fo = dict_value(hdr, "fortran_order");
  if (!fo || strncmp(fo, "False", 5) != 0) {
    snprintf(err, cap, "%s: Fortran-order arrays not supported", path);
    goto fail;
  }
  const char *sh = dict_value(hdr, "shape");
  if (!sh || *sh != '(') {
    snprintf(err, cap, "%s: no shape in header", path);
    goto fail;
  }
  sh++;
  size_t numel = 1;
  while (*sh && *sh != ')') {
    while (*sh == ' ' || *sh == ',')
      sh++;
    if (*sh == ')') break;
    char *end;
    errno = 0;
    long long v = strtoll(sh, &end, 10);
    if (end == sh || errno || v < 0 || out->ndim == NPY_MAX_DIMS) {
      snprintf(err, cap, "%s: bad shape", path);
      goto fail;
    }
    if (v && numel > SIZE_MAX / (size_t)v) {
      snprintf(err, cap, "%s: shape overflows", path);
      goto fail;
    }
    numel *= (size_t)v;
    out->shape[out->ndim++] = v;
    sh = end;
  }
  if (numel > SIZE_MAX / item) {
    snprintf(err, cap, "%s: shape overflows", path);
    goto fail;
  }
  out->nbytes = numel * item;
  out->data = malloc(out->nbytes ? out->nbytes : 1);
  if (!out->data) {
    snprintf(err, cap, "%s: out of memory", path);
    goto fail;
  }
  if (fread(out->data, 1, out->nbytes, f) != out->nbytes) goto short_read;
  free(hdr);
  fclose(f);
  return 0;
short_read:
  snprintf(err, cap, "%s: file too short", path);
fail:
  free(hdr);
  npy_free(out);
  fclose(f);
  return -1;
}

int npy_write(const char *path, const char *descr, int ndim, const int64_t *shape, const void *data,
              size_t nbytes, char *err, size_t cap) {
  char dict[512];
  int n = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (", descr);
  for (int i = 0; i < ndim; i++)
    n += snprintf(dict + n, sizeof dict - (size_t)n, "%lld%s", (long long)shape[i],
                  ndim == 1 ? "," : (i + 1 < ndim ? ", " : ""));
  n += snprintf(dict + n, sizeof dict - (size_t)n, "), }");
  /* pad with spaces so that the data starts on a 64-byte boundary */
  size_t total = 10 + (size_t)n + 1;
  size_t padded = (total + 63) / 64 * 64;
  size_t hlen = padded - 10;
  unsigned char pre[10];
  memcpy(pre, magic, 6);
  pre[6] = 1;
  pre[7] = 0;
  pre[8] = (unsigned char)(hlen & 0xFF);
  pre[9] = (unsigned char)(hlen >> 8);
  FILE *f = fopen(path, "wb");
  if (!f) {
    snprintf(err, cap, "%s: %s", path, strerror(errno));
    return -1;
  }
  bool ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, (size_t)n, f) == (size_t)n;
  for (size_t i = 10 + (size_t)n; ok && i + 1 < padded; i++)
    ok = fputc(' ', f) != EOF;
  ok = ok && fputc('\n', f) != EOF;
  ok = ok && (nbytes == 0 || fwrite(data, 1, nbytes, f) == nbytes);
  if (fclose(f) != 0) ok = false;
  if (!ok) snprintf(err, cap, "%s: write failed", path);
  return ok ? 0 : -1;
}

void npy_free(npy_array *a) {
  free(a->data);
  a->data = NULL;
}
