/* npy: the NumPy .npy format (version 1.0/2.0 header + raw C-order data),
 * enough for moec's tensors: little-endian f4, f2, u2, u1, i1, i4. */
#ifndef MOEC_NPY_H
#define MOEC_NPY_H

#include <stddef.h>
#include <stdint.h>

#define NPY_MAX_DIMS 8

typedef struct npy_array {
  char descr[8]; /* "<f4", "|u1", ... */
  int ndim;
  int64_t shape[NPY_MAX_DIMS];
  void *data; /* malloc'ed; owned by the array */
  size_t nbytes;
} npy_array;

/* 0 on success; on failure -1 with a message in err. */
int npy_read(const char *path, npy_array *out, char *err, size_t err_cap);
int npy_write(const char *path, const char *descr, int ndim, const int64_t *shape, const void *data,
              size_t nbytes, char *err, size_t err_cap);
void npy_free(npy_array *a);
/* Bytes per element of a descr, 0 when unsupported. */
size_t npy_itemsize(const char *descr);

#endif
