/* shm.c, the shared-memory registry: registration errors (each status and
 * the field it names), spans at and past a region's end (overflow
 * included) with the offset inside the object honoured, the region limit,
 * status, a region that outlives its unregistration while held, a copy
 * from an object truncated under its region failing instead of killing
 * the process, and the reads and writes of a region checked at each use.
 * CUDA regions: what is refused before a handle is opened (a build without
 * a GPU backend opens none). Each test makes its own POSIX object. Also
 * the region sizes a request declares, read off the wire. */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kserve_wire.h"
#include "moe/ipc.h"
#include "moed.h"

static char key[64];

/* A fresh object of n bytes; its name in key[]. */
static void object(size_t n) {
  snprintf(key, sizeof key, "/moed_unit_shm_%d", (int)getpid());
  shm_unlink(key);
  int fd = shm_open(key, O_RDWR | O_CREAT | O_EXCL, 0600);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)n), 0);
  close(fd);
}

static void teardown(void) { shm_unlink(key); }

START_TEST(register_errors_name_the_field) {
  object(8192);
  moed_shm *s;
  char err[MOED_ERR_LEN];
  ck_assert_int_eq(moed_shm_create(2, &s), 0);
  ck_assert_int_eq(moed_shm_register(s, "a", "/moed_unit_no_such_object", 0, 64, err), GRPC_STATUS_NOT_FOUND);
  ck_assert_ptr_nonnull(strstr(err, "key:"));
  ck_assert_int_eq(moed_shm_register(s, "a", "x/y", 0, 64, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(err, "key:"));
  ck_assert_int_eq(moed_shm_register(s, "a", "/..", 0, 64, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_int_eq(moed_shm_register(s, "a b", key, 0, 64, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(err, "name:"));
  ck_assert_int_eq(moed_shm_register(s, "a", key, 0, 0, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(err, "byte_size:"));
  ck_assert_int_eq(moed_shm_register(s, "a", key, 8000, 193, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(err, "offset + byte_size:"));
  ck_assert_int_eq(moed_shm_register(s, "a", key, UINT64_MAX - 10, 100, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_int_eq(moed_shm_register(s, "a", key, 8000, 192, err), GRPC_STATUS_OK); /* to the last byte */
  ck_assert_int_eq(moed_shm_register(s, "a", key, 0, 64, err), GRPC_STATUS_ALREADY_EXISTS);
  ck_assert_int_eq(moed_shm_register(s, "b", key, 0, 64, err), GRPC_STATUS_OK);
  ck_assert_int_eq(moed_shm_register(s, "c", key, 0, 64, err), GRPC_STATUS_RESOURCE_EXHAUSTED);
  moed_shm_unregister(s, MOED_SHM_CUDA, "b"); /* another kind's name: nothing */
  ck_assert_int_eq(moed_shm_register(s, "c", key, 0, 64, err), GRPC_STATUS_RESOURCE_EXHAUSTED);
  moed_shm_unregister(s, MOED_SHM_SYSTEM, "b");
  ck_assert_int_eq(moed_shm_register(s, "c", key, 0, 64, err), GRPC_STATUS_OK);
  moed_shm_destroy(s);
}
END_TEST

START_TEST(spans_and_offsets) {
  object(3 * 4096);
  moed_shm *s;
  char err[MOED_ERR_LEN];
  ck_assert_int_eq(moed_shm_create(4, &s), 0);
  /* an offset that is not a page's: the region still starts there */
  ck_assert_int_eq(moed_shm_register(s, "r", key, 4096 + 100, 1000, err), GRPC_STATUS_OK);
  moed_shm_region *r = moed_shm_acquire(s, "r");
  ck_assert_ptr_nonnull(r);
  ck_assert_uint_eq(moed_shm_byte_size(r), 1000);
  ck_assert_ptr_nonnull(moed_shm_span(r, 0, 1000));
  ck_assert_ptr_nonnull(moed_shm_span(r, 1000, 0)); /* empty, at the end */
  ck_assert_ptr_null(moed_shm_span(r, 1, 1000));
  ck_assert_ptr_null(moed_shm_span(r, 1001, 0));
  ck_assert_ptr_null(moed_shm_span(r, UINT64_MAX, 2)); /* offset + size wraps */
  ck_assert_ptr_null(moed_shm_span(r, 2, UINT64_MAX));
  uint8_t *p = moed_shm_span(r, 10, 4);
  memcpy(p, "moed", 4);
  int fd = shm_open(key, O_RDONLY, 0);
  char got[4];
  ck_assert_int_eq(pread(fd, got, 4, 4096 + 100 + 10), 4);
  close(fd);
  ck_assert_int_eq(memcmp(got, "moed", 4), 0);
  ck_assert_ptr_null(moed_shm_acquire(s, "nope"));
  moed_shm_release(r);
  moed_shm_destroy(s);
}
END_TEST

START_TEST(status_lists_regions) {
  object(4096);
  moed_shm *s;
  char err[MOED_ERR_LEN];
  ck_assert_int_eq(moed_shm_create(4, &s), 0);
  ck_assert_int_eq(moed_shm_register(s, "x", key, 0, 16, err), GRPC_STATUS_OK);
  ck_assert_int_eq(moed_shm_register(s, "y", key + 1, 64, 32, err), GRPC_STATUS_OK); /* the key without '/' */
  moed_shm_info *v;
  ck_assert_int_eq(moed_shm_status(s, MOED_SHM_SYSTEM, "", &v), 2);
  free(v);
  ck_assert_int_eq(moed_shm_status(s, MOED_SHM_CUDA, "", &v), 0); /* the other kind lists none */
  free(v);
  ck_assert_int_eq(moed_shm_status(s, MOED_SHM_CUDA, "y", &v), 0);
  free(v);
  ck_assert_int_eq(moed_shm_status(s, MOED_SHM_SYSTEM, "y", &v), 1);
  ck_assert_int_eq(v[0].kind, MOED_SHM_SYSTEM);
  ck_assert_str_eq(v[0].name, "y");
  ck_assert_str_eq(v[0].key, key + 1);
  ck_assert_uint_eq(v[0].offset, 64);
  ck_assert_uint_eq(v[0].byte_size, 32);
  free(v);
  ck_assert_int_eq(moed_shm_status(s, MOED_SHM_SYSTEM, "z", &v), 0);
  free(v);
  moed_shm_unregister(s, MOED_SHM_SYSTEM, "never"); /* no error, nothing changes */
  moed_shm_unregister(s, MOED_SHM_CUDA, "");        /* every CUDA region: none */
  ck_assert_int_eq(moed_shm_status(s, MOED_SHM_ANY, NULL, &v), 2);
  free(v);
  moed_shm_unregister(s, MOED_SHM_SYSTEM, "");
  ck_assert_int_eq(moed_shm_status(s, MOED_SHM_ANY, NULL, &v), 0);
  free(v);
  moed_shm_destroy(s);
}
END_TEST

START_TEST(held_region_outlives_unregister) {
  object(4096);
  moed_shm *s;
  char err[MOED_ERR_LEN];
  ck_assert_int_eq(moed_shm_create(4, &s), 0);
  ck_assert_int_eq(moed_shm_register(s, "h", key, 0, 4096, err), GRPC_STATUS_OK);
  moed_shm_region *r = moed_shm_acquire(s, "h");
  moed_shm_unregister(s, MOED_SHM_SYSTEM, "h");
  ck_assert_ptr_null(moed_shm_acquire(s, "h")); /* the name is gone at once */
  uint8_t *p = moed_shm_span(r, 4000, 96);      /* ... the mapping is not */
  memset(p, 7, 96);
  ck_assert_uint_eq(p[95], 7);
  ck_assert_int_eq(moed_shm_register(s, "h", key, 0, 64, err), GRPC_STATUS_OK); /* the name free again */
  moed_shm_release(r);
  moed_shm_destroy(s);
}
END_TEST

START_TEST(truncated_object_fails_the_copy) {
  object(1 << 16);
  moed_shm *s;
  char err[MOED_ERR_LEN];
  ck_assert_int_eq(moed_shm_create(4, &s), 0);
  ck_assert_int_eq(moed_shm_register(s, "t", key, 0, 1 << 16, err), GRPC_STATUS_OK);
  moed_shm_region *r = moed_shm_acquire(s, "t");
  static uint8_t buf[1 << 16];
  ck_assert(moed_shm_copy(buf, moed_shm_span(r, 0, sizeof buf), sizeof buf));
  int fd = shm_open(key, O_RDWR, 0);
  ck_assert_int_eq(ftruncate(fd, 0), 0); /* the client shrinks its object */
  close(fd);
  ck_assert(!moed_shm_copy(buf, moed_shm_span(r, 0, sizeof buf), sizeof buf));
  ck_assert(!moed_shm_copy(moed_shm_span(r, 4096, 8), buf, 8));
  ck_assert(moed_shm_copy(buf, buf + 8, 8)); /* other copies are untouched */
  char why[MOED_ERR_LEN];
  ck_assert_int_eq(moed_shm_read(r, 0, buf, 8, why),
                   GRPC_STATUS_INVALID_ARGUMENT); /* through the region API */
  ck_assert_ptr_nonnull(strstr(why, "no longer backed"));
  moed_shm_release(r);
  moed_shm_destroy(s);
}
END_TEST

/* moed_shm_read / moed_shm_write: the span checked at each use, overflow
 * included, before any byte moves. */
START_TEST(reads_and_writes_are_bounded) {
  object(4096);
  moed_shm *s;
  char err[MOED_ERR_LEN], why[MOED_ERR_LEN];
  ck_assert_int_eq(moed_shm_create(4, &s), 0);
  ck_assert_int_eq(moed_shm_register(s, "w", key, 64, 256, err), GRPC_STATUS_OK);
  moed_shm_region *r = moed_shm_acquire(s, "w");
  ck_assert_int_eq(moed_shm_region_kind(r), MOED_SHM_SYSTEM);
  uint8_t buf[300], got[300];
  for (int i = 0; i < 300; i++)
    buf[i] = (uint8_t)(i * 7 + 1);
  ck_assert_int_eq(moed_shm_write(r, 200, buf, 56, why), GRPC_STATUS_OK); /* to the last byte */
  ck_assert_int_eq(moed_shm_read(r, 200, got, 56, why), GRPC_STATUS_OK);
  ck_assert_int_eq(memcmp(got, buf, 56), 0);
  memset(got, 0, sizeof got);
  ck_assert_int_eq(moed_shm_write(r, 200, buf, 57, why), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(why, "past the end of region 'w' (256 bytes)"));
  ck_assert_int_eq(moed_shm_read(r, 0, got, 257, why), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_int_eq(moed_shm_read(r, UINT64_MAX - 2, got, 8, why), GRPC_STATUS_INVALID_ARGUMENT); /* wraps */
  ck_assert_int_eq(moed_shm_read(r, 257, got, 0, why), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_int_eq(moed_shm_read(r, 256, got, 0, why), GRPC_STATUS_OK); /* empty, at the end */
  for (int i = 0; i < 300; i++)                                         /* the refused copies moved nothing */
    ck_assert_uint_eq(got[i], 0);
  int fd = shm_open(key, O_RDONLY, 0); /* the write went to the object at offset 64 + 200 */
  ck_assert_int_eq(pread(fd, got, 56, 64 + 200), 56);
  close(fd);
  ck_assert_int_eq(memcmp(got, buf, 56), 0);
  moed_shm_release(r);
  moed_shm_destroy(s);
}
END_TEST

/* A CUDA region's registration: every field checked before a handle is
 * opened, each failure naming it; names shared with system regions. This
 * build opens no handle unless it has a GPU backend: then UNIMPLEMENTED;
 * with one, moed running on no GPU is FAILED_PRECONDITION and a GPU it
 * does not run on INVALID_ARGUMENT. */
START_TEST(cuda_register_refusals) {
  object(4096);
  moed_shm *s;
  char err[MOED_ERR_LEN];
  uint8_t h[MOE_IPC_HANDLE_BYTES + 1] = {0};
  ck_assert_int_eq(moed_shm_create(4, &s), 0);
  ck_assert_int_eq(moed_shm_register(s, "sys", key, 0, 64, err), GRPC_STATUS_OK);
  ck_assert_int_eq(moed_shm_register_cuda(s, "a b", h, 64, 0, 64, 1, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(err, "name:"));
  ck_assert_int_eq(moed_shm_register_cuda(s, "g", h, 63, 0, 64, 1, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(err, "raw_handle: 63 bytes"));
  ck_assert_int_eq(moed_shm_register_cuda(s, "g", h, 65, 0, 64, 1, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(err, "raw_handle:"));
  ck_assert_int_eq(moed_shm_register_cuda(s, "g", NULL, 0, 0, 64, 1, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_int_eq(moed_shm_register_cuda(s, "g", h, 64, 0, 0, 1, err), GRPC_STATUS_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(err, "byte_size:"));
  ck_assert_int_eq(moed_shm_register_cuda(s, "sys", h, 64, 0, 64, 1, err), GRPC_STATUS_ALREADY_EXISTS);
  ck_assert_ptr_nonnull(strstr(err, "name: region 'sys'"));
  if (!moe_ipc_supported()) {
    ck_assert_int_eq(moed_shm_register_cuda(s, "g", h, 64, 0, 64, 1, err), GRPC_STATUS_UNIMPLEMENTED);
    ck_assert_ptr_nonnull(strstr(err, "no GPU backend"));
  } else {
    ck_assert_int_eq(moed_shm_register_cuda(s, "g", h, 64, 0, 64, 0, err), GRPC_STATUS_FAILED_PRECONDITION);
    ck_assert_ptr_nonnull(strstr(err, "device_id:"));
    ck_assert_int_eq(moed_shm_register_cuda(s, "g", h, 64, 2, 64, 2, err), GRPC_STATUS_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(err, "device_id: 2"));
    ck_assert_int_eq(moed_shm_register_cuda(s, "g", h, 64, -1, 64, 2, err), GRPC_STATUS_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(err, "device_id: -1"));
  }
  moed_shm_info *v;
  ck_assert_int_eq(moed_shm_status(s, MOED_SHM_CUDA, NULL, &v), 0); /* nothing half-registered */
  free(v);
  ck_assert_ptr_null(moed_shm_acquire(s, "g"));
  moed_shm_destroy(s);
}
END_TEST

/* The sizes that decide whether a request's region copies are small are
 * read off the wire (kserve_wire.c), not by unpacking it: summed over the
 * inputs, capped, and false for a value that is not an integer >= 0 or for
 * bytes that are not a message. */
static size_t packed(Inference__InferParameter *sizes[2], uint8_t *buf) {
  static Inference__ModelInferRequest__InferInputTensor__ParametersEntry e[2];
  static Inference__ModelInferRequest__InferInputTensor__ParametersEntry *pe[2][1];
  static Inference__ModelInferRequest__InferInputTensor t[2], *pt[2];
  Inference__ModelInferRequest m = INFERENCE__MODEL_INFER_REQUEST__INIT;
  for (int i = 0; i < 2; i++) {
    inference__model_infer_request__infer_input_tensor__init(&t[i]);
    inference__model_infer_request__infer_input_tensor__parameters_entry__init(&e[i]);
    e[i].key = "shared_memory_byte_size";
    e[i].value = sizes[i];
    pe[i][0] = &e[i];
    t[i].name = "x";
    t[i].n_parameters = sizes[i] ? 1 : 0;
    t[i].parameters = pe[i];
    pt[i] = &t[i];
  }
  m.model_name = "m";
  m.n_inputs = 2;
  m.inputs = pt;
  ck_assert_uint_le(inference__model_infer_request__get_packed_size(&m), 256);
  return inference__model_infer_request__pack(&m, buf);
}

START_TEST(input_sizes_read_off_the_wire) {
  Inference__InferParameter a = INFERENCE__INFER_PARAMETER__INIT, b = INFERENCE__INFER_PARAMETER__INIT;
  a.parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_UINT64_PARAM;
  a.uint64_param = 100;
  b.parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_INT64_PARAM;
  b.int64_param = 200;
  uint8_t buf[256];
  uint64_t sum = 7;
  size_t n = packed((Inference__InferParameter *[2]){&a, &b}, buf);
  ck_assert(moed_kserve_input_param_sum(buf, n, "shared_memory_byte_size", 1000, &sum));
  ck_assert_uint_eq(sum, 300);
  ck_assert(moed_kserve_input_param_sum(buf, n, "shared_memory_byte_size", 250, &sum));
  ck_assert_uint_eq(sum, 251); /* over the cap: cap + 1 */
  ck_assert(moed_kserve_input_param_sum(buf, n, "shared_memory_offset", 1000, &sum));
  ck_assert_uint_eq(sum, 0); /* another key */
  ck_assert(!moed_kserve_input_param_sum(buf, n - 1, "shared_memory_byte_size", 1000, &sum)); /* cut */
  n = packed((Inference__InferParameter *[2]){&a, NULL}, buf);
  ck_assert(moed_kserve_input_param_sum(buf, n, "shared_memory_byte_size", 1000, &sum));
  ck_assert_uint_eq(sum, 100);
  b.int64_param = -1;
  n = packed((Inference__InferParameter *[2]){&a, &b}, buf);
  ck_assert(!moed_kserve_input_param_sum(buf, n, "shared_memory_byte_size", 1000, &sum));
  b.parameter_choice_case = INFERENCE__INFER_PARAMETER__PARAMETER_CHOICE_STRING_PARAM;
  b.string_param = "200";
  n = packed((Inference__InferParameter *[2]){&a, &b}, buf);
  ck_assert(!moed_kserve_input_param_sum(buf, n, "shared_memory_byte_size", 1000, &sum));
}
END_TEST

int main(void) {
  Suite *su = suite_create("shm");
  TCase *tc = tcase_create("registry");
  tcase_add_checked_fixture(tc, NULL, teardown);
  tcase_add_test(tc, register_errors_name_the_field);
  tcase_add_test(tc, spans_and_offsets);
  tcase_add_test(tc, status_lists_regions);
  tcase_add_test(tc, held_region_outlives_unregister);
  tcase_add_test(tc, truncated_object_fails_the_copy);
  tcase_add_test(tc, reads_and_writes_are_bounded);
  tcase_add_test(tc, cuda_register_refusals);
  tcase_add_test(tc, input_sizes_read_off_the_wire);
  suite_add_tcase(su, tc);
  SRunner *sr = srunner_create(su);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
