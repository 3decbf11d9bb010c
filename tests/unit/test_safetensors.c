/* The safetensors reader and writer: round trips, a file written by the
 * reference implementation, every kind of malformed header, every truncation,
 * and seeded random corruption (must fail cleanly or yield in-bounds tensors;
 * run under ASan in CI). */
#include <check.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "moe/ops.h"
#include "moe/safetensors.h"
#include "test_tmpdir.h"

/* ---- helpers ------------------------------------------------------------------- */

static void make_tmpdir(void) { make_tmpdir_named("st"); }

/* The whole file, malloc'ed. */
static unsigned char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  ck_assert_ptr_nonnull(f);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *buf = malloc(n ? (size_t)n : 1);
  ck_assert_ptr_nonnull(buf);
  ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  *len = (size_t)n;
  return buf;
}

static void write_file(const char *path, const void *data, size_t len) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  ck_assert_uint_eq(fwrite(data, 1, len, f), len);
  ck_assert_int_eq(fclose(f), 0);
}

/* A file image: 8-byte length of `json`, `json`, then `dlen` bytes of data
 * (value i & 0xFF). Exactly sized, so that ASan sees any overread. */
static unsigned char *make_image(const char *json, size_t dlen, size_t *len) {
  size_t n = strlen(json);
  *len = 8 + n + dlen;
  unsigned char *buf = malloc(*len);
  ck_assert_ptr_nonnull(buf);
  for (int i = 0; i < 8; i++)
    buf[i] = (unsigned char)((uint64_t)n >> (8 * i));
  memcpy(buf + 8, json, n);
  for (size_t i = 0; i < dlen; i++)
    buf[8 + n + i] = (unsigned char)i;
  return buf;
}

/* Opens an image of `json` + dlen data bytes; returns the status and leaves
 * the message in *err. */
static moe_status open_image(const char *json, size_t dlen, moe_error *err) {
  size_t len;
  unsigned char *img = make_image(json, dlen, &len);
  moe_safetensors *st = NULL;
  memset(err, 0, sizeof *err);
  moe_status s = moe_safetensors_open_buffer(img, len, &st, err);
  if (s == MOE_OK) ck_assert_ptr_nonnull(st);
  moe_safetensors_close(st);
  free(img);
  return s;
}

#define ck_assert_msg_has(err, needle)                                                                       \
  ck_assert_msg(strstr((err).msg, (needle)) != NULL, "message '%s' lacks '%s'", (err).msg, (needle))

/* ---- round trip ---------------------------------------------------------------- */

enum { RT_N = 10 };
static float rt_f32[6] = {0.f, 1.f, -2.5f, 3.25f, 1e-30f, -0.f};
static uint16_t rt_f16[4] = {0x3C00, 0xBC00, 0x7BFF, 0x0001};
static uint16_t rt_bf16[4] = {0x3F80, 0xC000, 0x7F7F, 0x0001};
static uint8_t rt_u8[3] = {0, 128, 255};
static int8_t rt_i8[5] = {-128, -1, 0, 1, 127};
static int32_t rt_i32[2] = {INT32_MIN, INT32_MAX};
static uint8_t rt_e4m3[3] = {0x7E, 0x00, 0xFE};
static uint8_t rt_e5m2[1] = {0x3C};
static float rt_scalar[1] = {42.f};

static void rt_tensors(moe_named_tensor *t) {
  memset(t, 0, RT_N * sizeof *t);
  t[0] = (moe_named_tensor){"u8", {MOE_UINT8, 1, {3}, rt_u8, 3}};
  t[1] = (moe_named_tensor){"f32", {MOE_F32, 2, {2, 3}, rt_f32, 24}};
  t[2] = (moe_named_tensor){"f16", {MOE_F16, 1, {4}, rt_f16, 8}};
  t[3] = (moe_named_tensor){"bf16", {MOE_BF16, 2, {2, 2}, rt_bf16, 8}};
  t[4] = (moe_named_tensor){"i8", {MOE_INT8, 1, {5}, rt_i8, 5}};
  t[5] = (moe_named_tensor){"i32", {MOE_INT32, 3, {1, 2, 1}, rt_i32, 8}};
  t[6] = (moe_named_tensor){"fp8 \"e4m3\"\n", {MOE_FP8_E4M3FN, 1, {3}, rt_e4m3, 3}};
  t[7] = (moe_named_tensor){"e5m2", {MOE_FP8_E5M2, 1, {1}, rt_e5m2, 1}};
  t[8] = (moe_named_tensor){"scalar", {MOE_F32, 0, {0}, rt_scalar, 4}};
  t[9] = (moe_named_tensor){"empty", {MOE_INT32, 2, {0, 3}, NULL, 0}};
}

/* Writes the round-trip tensors to a file and returns its bytes. */
static unsigned char *rt_image(size_t *len) {
  moe_named_tensor t[RT_N];
  char path[600];
  moe_error err = {{0}};
  rt_tensors(t);
  tmp_path(path, sizeof path, "rt.safetensors");
  ck_assert_int_eq(moe_safetensors_write(path, t, RT_N, &err), MOE_OK);
  return read_file(path, len);
}

START_TEST(roundtrip) {
  moe_named_tensor t[RT_N];
  char path[600];
  moe_error err = {{0}};
  moe_safetensors *st = NULL;
  rt_tensors(t);
  tmp_path(path, sizeof path, "rt.safetensors");
  ck_assert_int_eq(moe_safetensors_write(path, t, RT_N, &err), MOE_OK);
  ck_assert_int_eq(access(path, F_OK), 0);
  char tmp[620];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  ck_assert_int_ne(access(tmp, F_OK), 0); /* renamed into place */

  size_t len;
  unsigned char *img = read_file(path, &len);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = (n << 8) | img[i];
  ck_assert_uint_eq(n % 8, 0); /* header padded: data 8-aligned */
  ck_assert_uint_eq(img[8], '{');
  free(img);

  ck_assert_int_eq(moe_safetensors_open(path, &st, &err), MOE_OK);
  ck_assert_uint_eq(moe_safetensors_count(st), RT_N);
  ck_assert_ptr_null(moe_safetensors_name(st, RT_N));
  for (size_t i = 0; i < RT_N; i++) {
    ck_assert_str_eq(moe_safetensors_name(st, i), t[i].name); /* header order = the caller's */
    moe_tensor got;
    ck_assert_int_eq(moe_safetensors_get(st, t[i].name, &got, &err), MOE_OK);
    ck_assert_int_eq(got.dtype, t[i].tensor.dtype);
    ck_assert_int_eq(got.ndim, t[i].tensor.ndim);
    for (int d = 0; d < got.ndim; d++)
      ck_assert_int_eq(got.shape[d], t[i].tensor.shape[d]);
    ck_assert_uint_eq(got.nbytes, t[i].tensor.nbytes);
    if (got.nbytes) ck_assert_int_eq(memcmp(got.data, t[i].tensor.data, got.nbytes), 0);
    unsigned esize = moe_dtype_bits(got.dtype) / 8;
    ck_assert_uint_eq((uintptr_t)got.data % esize, 0); /* natural alignment */
  }
  moe_tensor got;
  ck_assert_int_eq(moe_safetensors_get(st, "nope", &got, &err), MOE_ENOTFOUND);
  ck_assert_msg_has(err, "nope");
  moe_safetensors_close(st);

  /* the same bytes through the buffer entry point */
  img = read_file(path, &len);
  ck_assert_int_eq(moe_safetensors_open_buffer(img, len, &st, &err), MOE_OK);
  ck_assert_uint_eq(moe_safetensors_count(st), RT_N);
  ck_assert_int_eq(moe_safetensors_get(st, "f32", &got, &err), MOE_OK);
  ck_assert(((unsigned char *)got.data >= img) && ((unsigned char *)got.data + 24 <= img + len));
  moe_safetensors_close(st);
  free(img);

  /* an empty file set is valid too */
  tmp_path(path, sizeof path, "none.safetensors");
  ck_assert_int_eq(moe_safetensors_write(path, NULL, 0, &err), MOE_OK);
  ck_assert_int_eq(moe_safetensors_open(path, &st, &err), MOE_OK);
  ck_assert_uint_eq(moe_safetensors_count(st), 0);
  moe_safetensors_close(st);
}
END_TEST

START_TEST(write_rejects) {
  char path[600];
  moe_error err = {{0}};
  uint8_t b[4] = {0};
  tmp_path(path, sizeof path, "bad.safetensors");
  moe_named_tensor fp4 = {"packed", {MOE_FP4_E2M1, 1, {8}, b, 4}};
  ck_assert_int_eq(moe_safetensors_write(path, &fp4, 1, &err), MOE_EUNSUPPORTED);
  ck_assert_msg_has(err, "packed");
  moe_named_tensor dup[2] = {{"x", {MOE_UINT8, 1, {4}, b, 4}}, {"x", {MOE_UINT8, 1, {4}, b, 4}}};
  ck_assert_int_eq(moe_safetensors_write(path, dup, 2, &err), MOE_EINVAL);
  ck_assert_msg_has(err, "'x'");
  moe_named_tensor size = {"sized", {MOE_F32, 1, {2}, b, 4}};
  ck_assert_int_eq(moe_safetensors_write(path, &size, 1, &err), MOE_EINVAL);
  ck_assert_msg_has(err, "sized");
  moe_named_tensor meta = {"__metadata__", {MOE_UINT8, 1, {4}, b, 4}};
  ck_assert_int_eq(moe_safetensors_write(path, &meta, 1, &err), MOE_EINVAL);
  moe_named_tensor nodata = {"nodata", {MOE_UINT8, 1, {4}, NULL, 4}};
  ck_assert_int_eq(moe_safetensors_write(path, &nodata, 1, &err), MOE_EINVAL);
  ck_assert_msg_has(err, "nodata");
  ck_assert_int_ne(access(path, F_OK), 0); /* nothing written */
  moe_named_tensor ok = {"ok", {MOE_UINT8, 1, {4}, b, 4}};
  ck_assert_int_eq(moe_safetensors_write("/nonexistent-dir/x.safetensors", &ok, 1, &err), MOE_EIO);
  ck_assert_msg_has(err, "nonexistent-dir");
}
END_TEST

/* Header written by the reference implementation (Python safetensors 0.8.0,
 * safetensors.numpy.save_file with metadata {"format": "np"}): its order
 * (largest alignment first), its padding, an F64 and an empty tensor. */
static const char reference_header[] =
    "{\"__metadata__\":{\"format\":\"np\"},\"f\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,16]},"
    "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[16,40]},\"e\":{\"dtype\":\"I32\",\"shape\":["
    "0,3],"
    "\"data_offsets\":[40,40]},\"c\":{\"dtype\":\"F16\",\"shape\":[2,2],\"data_offsets\":[40,48]},\"b\":{"
    "\"dtype\":"
    "\"I8\",\"shape\":[5],\"data_offsets\":[48,53]}} ";

START_TEST(reference_file) {
  ck_assert_uint_eq(strlen(reference_header), 0x138);
  size_t len;
  unsigned char *img = make_image(reference_header, 53, &len);
  unsigned char *data = img + 8 + 0x138;
  memset(data, 0, 16); /* f: zeros (F64) */
  for (int i = 0; i < 6; i++) {
    float v = (float)i;
    memcpy(data + 16 + 4 * i, &v, 4); /* a: 0..5 */
  }
  for (int i = 0; i < 4; i++)
    data[40 + 2 * i] = 0x00, data[41 + 2 * i] = 0x3C; /* c: fp16 ones */
  for (int i = 0; i < 5; i++)
    data[48 + i] = (unsigned char)i; /* b: 0..4 */
  moe_safetensors *st = NULL;
  moe_error err = {{0}};
  ck_assert_int_eq(moe_safetensors_open_buffer(img, len, &st, &err), MOE_OK);
  ck_assert_uint_eq(moe_safetensors_count(st), 5); /* __metadata__ is not a tensor */
  ck_assert_str_eq(moe_safetensors_name(st, 0), "f");
  moe_tensor t;
  ck_assert_int_eq(moe_safetensors_get(st, "f", &t, &err), MOE_EUNSUPPORTED);
  ck_assert_msg_has(err, "'f'");
  ck_assert_msg_has(err, "F64");
  ck_assert_int_eq(moe_safetensors_get(st, "__metadata__", &t, &err), MOE_ENOTFOUND);
  ck_assert_int_eq(moe_safetensors_get(st, "a", &t, &err), MOE_OK);
  ck_assert_int_eq(t.dtype, MOE_F32);
  ck_assert_int_eq(t.ndim, 2);
  ck_assert_int_eq(t.shape[1], 3);
  ck_assert_float_eq(((const float *)t.data)[5], 5.0f);
  ck_assert_int_eq(moe_safetensors_get(st, "e", &t, &err), MOE_OK);
  ck_assert_uint_eq(t.nbytes, 0);
  ck_assert_int_eq(t.shape[0], 0);
  ck_assert_int_eq(moe_safetensors_get(st, "c", &t, &err), MOE_OK);
  ck_assert_int_eq(t.dtype, MOE_F16);
  ck_assert_uint_eq(((const uint16_t *)t.data)[3], 0x3C00);
  ck_assert_int_eq(moe_safetensors_get(st, "b", &t, &err), MOE_OK);
  ck_assert_int_eq(t.dtype, MOE_INT8);
  ck_assert_int_eq(((const int8_t *)t.data)[4], 4);
  moe_safetensors_close(st);
  free(img);
}
END_TEST

/* ---- malformed files ---------------------------------------------------------------- */

START_TEST(every_truncation) {
  size_t len;
  unsigned char *full = rt_image(&len);
  moe_error err;
  for (size_t cut = 0; cut < len; cut++) {
    unsigned char *img = malloc(cut ? cut : 1);
    ck_assert_ptr_nonnull(img);
    memcpy(img, full, cut);
    moe_safetensors *st = NULL;
    memset(&err, 0, sizeof err);
    moe_status s = moe_safetensors_open_buffer(img, cut, &st, &err);
    ck_assert_msg(s == MOE_EIO, "truncated to %zu of %zu bytes: status %d (%s)", cut, len, s, err.msg);
    ck_assert_ptr_null(st);
    ck_assert_msg_has(err, "(buffer)");
    free(img);
  }
  /* one byte too many is corruption as well */
  unsigned char *longer = malloc(len + 1);
  memcpy(longer, full, len);
  longer[len] = 0;
  moe_safetensors *st = NULL;
  ck_assert_int_eq(moe_safetensors_open_buffer(longer, len + 1, &st, &err), MOE_EIO);
  ck_assert_msg_has(err, "cover");
  free(longer);

  /* the same through files, naming the path */
  char path[600];
  tmp_path(path, sizeof path, "cut.safetensors");
  const size_t cuts[] = {0, 1, 7, 8, 9, len / 2, len - 1};
  for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
    write_file(path, full, cuts[i]);
    ck_assert_int_eq(moe_safetensors_open(path, &st, &err), MOE_EIO);
    ck_assert_msg_has(err, "cut.safetensors");
  }
  tmp_path(path, sizeof path, "absent.safetensors");
  ck_assert_int_eq(moe_safetensors_open(path, &st, &err), MOE_ENOTFOUND);
  ck_assert_msg_has(err, "absent.safetensors");
  ck_assert_int_eq(moe_safetensors_open(tmpdir, &st, &err), MOE_EIO); /* a directory */
  free(full);
}
END_TEST

START_TEST(header_length) {
  size_t len;
  unsigned char *img = rt_image(&len);
  moe_safetensors *st = NULL;
  moe_error err;
  const uint64_t bad[] = {len - 8 + 1, len, UINT64_MAX, (uint64_t)1 << 63, 0, 1, 200000000};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    unsigned char *c = malloc(len);
    memcpy(c, img, len);
    for (int b = 0; b < 8; b++)
      c[b] = (unsigned char)(bad[i] >> (8 * b));
    memset(&err, 0, sizeof err);
    ck_assert_int_eq(moe_safetensors_open_buffer(c, len, &st, &err), MOE_EIO);
    ck_assert_msg(strstr(err.msg, "header") != NULL, "%s", err.msg);
    free(c);
  }
  free(img);
}
END_TEST

typedef struct bad_case {
  const char *json;
  size_t dlen;
  moe_status status;
  const char *needle; /* must appear in the message */
} bad_case;

static const bad_case bad_cases[] = {
    /* not JSON, not an object, trailing bytes */
    {"{\"a\":", 0, MOE_EIO, "JSON"},
    {"{\"a\":{}}}", 0, MOE_EIO, "trailing"},
    {"{} x", 0, MOE_EIO, "trailing"},
    {"[]", 0, MOE_EIO, "object"},
    {"\"str\"", 0, MOE_EIO, "object"},
    {"{\"w\": 5}", 0, MOE_EIO, "'w'"},
    /* dtype */
    {"{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MOE_EIO, "dtype"},
    {"{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MOE_EIO, "dtype"},
    {"{\"wq\":{\"dtype\":\"Q7\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MOE_EUNSUPPORTED, "'wq'"},
    {"{\"wq\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MOE_EUNSUPPORTED, "f32"},
    /* shape */
    {"{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, MOE_EIO, "shape"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, MOE_EIO, "shape[0]"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, MOE_EIO, "shape[0]"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1,\"2\"],\"data_offsets\":[0,8]}}", 8, MOE_EIO, "shape[1]"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, MOE_EIO, "rank"},
    {"{\"big\":{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776],\"data_offsets\":[0,4]}}", 4,
     MOE_EIO, "overflow"},
    {"{\"big\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,4]}}", 4, MOE_EIO,
     "shape[0]"},
    {"{\"big\":{\"dtype\":\"F32\",\"shape\":[4503599627370496,4096],\"data_offsets\":[0,4]}}", 4, MOE_EIO,
     "overflow"},
    /* the element count fits, the byte count does not */
    {"{\"big\":{\"dtype\":\"F64\",\"shape\":[2147483648,2147483648],\"data_offsets\":[0,4]}}", 4, MOE_EIO,
     "overflow"},
    {"{\"big\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296,0],\"data_offsets\":[0,0]}}", 0, MOE_EIO,
     "overflow"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4, MOE_EIO, "shape"},
    /* data_offsets */
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, MOE_EIO, "data_offsets"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, MOE_EIO, "data_offsets"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 4, MOE_EIO, "data_offsets"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, MOE_EIO, "data_offsets"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,\"4\"]}}", 4, MOE_EIO, "data_offsets"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,104]}}", 4, MOE_EIO, "data_offsets"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, MOE_EIO, "data_offsets"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,1e300]}}", 4, MOE_EIO, "data_offsets"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, MOE_EIO, "need 12"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,4]}}", 4, MOE_EIO, "need 0"},
    /* tiling: overlap, gap, trailing data, duplicate names */
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
     12, MOE_EIO, "overlaps"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
     8, MOE_EIO, "overlaps"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
     20, MOE_EIO, "gap"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 9, MOE_EIO, "cover"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
     16, MOE_EIO, "twice"},
};

START_TEST(malformed_header) {
  const bad_case *c = &bad_cases[_i];
  moe_error err;
  moe_status s = open_image(c->json, c->dlen, &err);
  ck_assert_msg(s == c->status, "case %d: status %d, expected %d (%s)", _i, s, c->status, err.msg);
  ck_assert_msg(strstr(err.msg, c->needle) != NULL, "case %d: message '%s' lacks '%s'", _i, err.msg,
                c->needle);
  ck_assert_msg_has(err, "(buffer)");
}
END_TEST

START_TEST(accepted_headers) {
  moe_error err;
  /* metadata anywhere, padding spaces, unknown per-entry fields, zero-size tensors */
  ck_assert_int_eq(open_image("{\"__metadata__\":{\"k\":\"v\"}}      ", 0, &err), MOE_OK);
  ck_assert_int_eq(open_image("{}", 0, &err), MOE_OK);
  ck_assert_int_eq(open_image("{\"z\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]},"
                              "\"a\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3],\"extra\":1}}",
                              3, &err),
                   MOE_OK);
  ck_assert_int_eq(open_image("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                              "\"__metadata__\":{}}\n",
                              4, &err),
                   MOE_OK);
}
END_TEST

/* ---- random corruption ----------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

START_TEST(random_corruption) {
  size_t len;
  unsigned char *base = rt_image(&len);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = (n << 8) | base[i];
  /* bytes that steer a JSON parser into its interesting branches */
  static const char tokens[] = "{}[]\",:-0123456789eE. \\u\x00\xff";
  uint64_t rng = 12345;
  int accepted = 0;
  for (int iter = 0; iter < 5000; iter++) {
    unsigned char *img = malloc(len);
    memcpy(img, base, len);
    int edits = 1 + (int)(splitmix64(&rng) % 4);
    for (int e = 0; e < edits; e++) {
      uint64_t r = splitmix64(&rng);
      /* mostly the header, now and then the length prefix */
      size_t at = (r & 15) == 0 ? (size_t)((r >> 8) % 8) : 8 + (size_t)((r >> 8) % n);
      switch ((r >> 4) % 3) {
      case 0: img[at] = (unsigned char)(r >> 40); break;
      case 1: img[at] ^= (unsigned char)(1u << ((r >> 40) % 8)); break;
      default: img[at] = (unsigned char)tokens[(r >> 40) % (sizeof tokens - 1)]; break;
      }
    }
    moe_safetensors *st = NULL;
    moe_error err = {{0}};
    moe_status s = moe_safetensors_open_buffer(img, len, &st, &err);
    if (s == MOE_OK) {
      accepted++;
      /* a valid object: every tensor lies inside the buffer; reading every
       * byte lets ASan prove it */
      unsigned sum = 0;
      for (size_t i = 0; i < moe_safetensors_count(st); i++) {
        moe_tensor t;
        moe_status g = moe_safetensors_get(st, moe_safetensors_name(st, i), &t, &err);
        ck_assert(g == MOE_OK || g == MOE_EUNSUPPORTED);
        if (g) continue;
        size_t need;
        ck_assert_int_eq(moe_tensor_bytes(&t, &need), MOE_OK);
        ck_assert_uint_eq(need, t.nbytes);
        ck_assert((unsigned char *)t.data >= img + 8 && (unsigned char *)t.data + t.nbytes <= img + len);
        for (size_t b = 0; b < t.nbytes; b++)
          sum += ((unsigned char *)t.data)[b];
      }
      (void)sum;
      moe_safetensors_close(st);
    } else {
      ck_assert_ptr_null(st);
      ck_assert(s == MOE_EIO || s == MOE_EUNSUPPORTED);
      ck_assert(err.msg[0] != '\0');
    }
    free(img);
  }
  /* some mutations (inside a name or a padding space) keep the file valid;
   * most do not. Both paths ran. */
  ck_assert_int_gt(accepted, 0);
  ck_assert_int_lt(accepted, 5000);
  free(base);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("safetensors");
  TCase *tc = tcase_create("core");
  tcase_add_checked_fixture(tc, make_tmpdir, remove_tmpdir);
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, roundtrip);
  tcase_add_test(tc, write_rejects);
  tcase_add_test(tc, reference_file);
  tcase_add_test(tc, every_truncation);
  tcase_add_test(tc, header_length);
  tcase_add_loop_test(tc, malformed_header, 0, (int)(sizeof bad_cases / sizeof bad_cases[0]));
  tcase_add_test(tc, accepted_headers);
  tcase_add_test(tc, random_corruption);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
