/* fake_nvml: a stand-in for the driver's libnvidia-ml.so.1 with two fixed
 * GPUs, for test_gpu_metrics (loaded through MOED_NVML_LIBRARY). Test-only:
 * it exports the NVML functions gpu_metrics.c calls, with the values the
 * test's expected exposition lines are worked out from:
 *   device 0: GPU-11111111-2222-3333-4444-000000000000, "NVIDIA H200", 37 %
 *     busy, 143771 MiB total, 1 GiB used, 123456 mW, limit 700000 mW;
 *   device 1: GPU-55555555-6666-7777-8888-000000000001, "NVIDIA H200",
 *     100 % busy, 143771 MiB total, 0 used, power NOT_SUPPORTED, limit
 *     700000 mW;
 *   energy: 5000000 mJ (device 0) and 5001000 mJ (device 1) at the first
 *   read, 2500 mJ more at each later read. */
#include <stdio.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st {
  const char *uuid;
  unsigned util, power_mw;
  int power_ret;
  unsigned long long used, energy_mj;
} * nvmlDevice_t;
typedef struct {
  unsigned int gpu, memory;
} nvmlUtilization_t;
typedef struct {
  unsigned long long total, free, used;
} nvmlMemory_t;

enum { SUCCESS = 0, ERROR_INVALID_ARGUMENT = 2, ERROR_NOT_SUPPORTED = 3, ERROR_INSUFFICIENT_SIZE = 7 };
#define TOTAL (143771ULL << 20)

static struct nvmlDevice_st devices[2] = {
    {"GPU-11111111-2222-3333-4444-000000000000", 37, 123456, SUCCESS, 1ULL << 30, 5000000},
    {"GPU-55555555-6666-7777-8888-000000000001", 100, 0, ERROR_NOT_SUPPORTED, 0, 5001000},
};

nvmlReturn_t nvmlInit_v2(void) { return SUCCESS; }

const char *nvmlErrorString(nvmlReturn_t r) {
  return r == ERROR_NOT_SUPPORTED ? "Not Supported" : "Unknown Error";
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n) {
  *n = 2;
  return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *out) {
  if (i >= 2) return ERROR_INVALID_ARGUMENT;
  *out = &devices[i];
  return SUCCESS;
}

static nvmlReturn_t copy(const char *s, char *out, unsigned size) {
  if (strlen(s) >= size) return ERROR_INSUFFICIENT_SIZE;
  strcpy(out, s);
  return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *out, unsigned size) { return copy(d->uuid, out, size); }

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *out, unsigned size) {
  (void)d;
  return copy("NVIDIA H200", out, size);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
  u->gpu = d->util;
  u->memory = 0;
  return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
  m->total = TOTAL;
  m->used = d->used;
  m->free = TOTAL - d->used;
  return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned *mw) {
  if (d->power_ret != SUCCESS) return d->power_ret;
  *mw = d->power_mw;
  return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t d, unsigned *mw) {
  (void)d;
  *mw = 700000;
  return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *mj) {
  *mj = d->energy_mj;
  d->energy_mj += 2500;
  return SUCCESS;
}
