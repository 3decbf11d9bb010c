/* gpu_metrics: Triton's GPU metrics for /metrics (nv_gpu_utilization,
 * nv_gpu_memory_total_bytes, nv_gpu_memory_used_bytes, nv_gpu_power_usage,
 * nv_gpu_power_limit, nv_energy_consumption; label gpu_uuid), one sample per
 * GPU worker, read from NVML on each scrape.
 *
 * NVML is the NVIDIA driver's own library (libnvidia-ml.so.1), present only
 * where the driver is installed, so it is not a build dependency: it is
 * opened with dlopen once per process (MOED_NVML_LIBRARY names another file:
 * the tests' fake one) and never unloaded, when the metrics port starts if
 * there are GPU workers: nvmlInit and the device lookups happen there, not
 * on a scrape, and nv_energy_consumption counts from then. Missing or
 * failing, the metrics are left out and the log says why once.
 *
 * Which NVML device a worker's GPU is: worker i runs on CUDA device i (the
 * order the op library numbers GPUs in, devices.c), which is NVML device i
 * unless CUDA_VISIBLE_DEVICES renumbers them (its entries are NVML indices or
 * GPU UUIDs). CUDA orders devices fastest first unless CUDA_DEVICE_ORDER=
 * PCI_BUS_ID, NVML always by PCI bus id: on a machine with mixed GPUs the
 * two may differ, so a device whose NVML name is not the backend's is left
 * out with a warning. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moed.h"
#include "prom_label.h"

/* A scrape stops reading devices after this long (NVML calls take
 * microseconds; a GPU fallen off the bus may not). */
#define SCRAPE_BUDGET_NS (100 * 1000000LL)

/* ---- NVML, declared here --------------------------------------------------------
 * The few types and functions called, as the NVML API reference defines
 * them: nvmlReturn_t (NVML_SUCCESS = 0), nvmlDevice_t, nvmlUtilization_t,
 * nvmlMemory_t; nvmlInit_v2, nvmlErrorString, nvmlDeviceGetCount_v2,
 * nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetUUID, nvmlDeviceGetName,
 * nvmlDeviceGetUtilizationRates, nvmlDeviceGetMemoryInfo,
 * nvmlDeviceGetPowerUsage, nvmlDeviceGetPowerManagementLimit,
 * nvmlDeviceGetTotalEnergyConsumption. */

typedef int nvml_return;                    /* nvmlReturn_t */
typedef struct nvml_device_st *nvml_device; /* nvmlDevice_t */
typedef struct {
  unsigned int gpu, memory; /* percent of the last sample period busy */
} nvml_utilization;         /* nvmlUtilization_t */
typedef struct {
  unsigned long long total, free, used; /* bytes */
} nvml_memory;                          /* nvmlMemory_t */
#define NVML_SUCCESS 0
#define NVML_STRING_SIZE 96 /* NVML_DEVICE_UUID_V2_BUFFER_SIZE, NVML_DEVICE_NAME_V2_BUFFER_SIZE */

typedef struct nvml_api {
  nvml_return (*init)(void);
  const char *(*error_string)(nvml_return);
  nvml_return (*count)(unsigned *);
  nvml_return (*by_index)(unsigned, nvml_device *);
  nvml_return (*uuid)(nvml_device, char *, unsigned);
  nvml_return (*name)(nvml_device, char *, unsigned);
  nvml_return (*utilization)(nvml_device, nvml_utilization *);
  nvml_return (*memory)(nvml_device, nvml_memory *);
  nvml_return (*power)(nvml_device, unsigned *);            /* mW */
  nvml_return (*power_limit)(nvml_device, unsigned *);      /* mW */
  nvml_return (*energy)(nvml_device, unsigned long long *); /* mJ since the driver loaded */
} nvml_api;

static const struct {
  const char *name;
  size_t offset;
} nvml_symbols[] = {
    {"nvmlInit_v2", offsetof(nvml_api, init)},
    {"nvmlErrorString", offsetof(nvml_api, error_string)},
    {"nvmlDeviceGetCount_v2", offsetof(nvml_api, count)},
    {"nvmlDeviceGetHandleByIndex_v2", offsetof(nvml_api, by_index)},
    {"nvmlDeviceGetUUID", offsetof(nvml_api, uuid)},
    {"nvmlDeviceGetName", offsetof(nvml_api, name)},
    {"nvmlDeviceGetUtilizationRates", offsetof(nvml_api, utilization)},
    {"nvmlDeviceGetMemoryInfo", offsetof(nvml_api, memory)},
    {"nvmlDeviceGetPowerUsage", offsetof(nvml_api, power)},
    {"nvmlDeviceGetPowerManagementLimit", offsetof(nvml_api, power_limit)},
    {"nvmlDeviceGetTotalEnergyConsumption", offsetof(nvml_api, energy)},
};

static nvml_api nvml;
static const char *nvml_why; /* NULL once loaded and initialized */
static char nvml_why_buf[256];
static int nvml_level; /* of the line that says why: debug when there is no driver library */
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;

static void nvml_load(void) {
  const char *path = getenv("MOED_NVML_LIBRARY");
  if (!path || !*path) path = "libnvidia-ml.so.1";
  nvml_level = MOED_LOG_DEBUG;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(nvml_why_buf, sizeof nvml_why_buf, "%s", dlerror());
    nvml_why = nvml_why_buf;
    return;
  }
  nvml_level = MOED_LOG_WARN; /* a driver library that does not work: worth a warning */
  for (size_t i = 0; i < sizeof nvml_symbols / sizeof nvml_symbols[0]; i++) {
    void *p = dlsym(lib, nvml_symbols[i].name);
    if (!p) {
      snprintf(nvml_why_buf, sizeof nvml_why_buf, "%s: no %s", path, nvml_symbols[i].name);
      nvml_why = nvml_why_buf;
      return; /* lib stays open: dlclose could run the library's destructors under other threads */
    }
    memcpy((char *)&nvml + nvml_symbols[i].offset, &p, sizeof p); /* POSIX: data and code pointers agree */
  }
  nvml_return r = nvml.init();
  if (r != NVML_SUCCESS) {
    snprintf(nvml_why_buf, sizeof nvml_why_buf, "%s: nvmlInit_v2: %s", path, nvml.error_string(r));
    nvml_why = nvml_why_buf;
  }
}

/* ---- which NVML device a CUDA device number is ----------------------------------- */

/* The NVML device whose UUID starts with uuid (CUDA_VISIBLE_DEVICES may
 * abbreviate it); it must be the only one. */
static bool device_by_uuid(const char *uuid, nvml_device *out) {
  unsigned n = 0;
  int found = 0;
  if (nvml.count(&n) != NVML_SUCCESS) return false;
  for (unsigned i = 0; i < n; i++) {
    nvml_device d;
    char u[NVML_STRING_SIZE];
    if (nvml.by_index(i, &d) == NVML_SUCCESS && nvml.uuid(d, u, sizeof u) == NVML_SUCCESS &&
        strncmp(u, uuid, strlen(uuid)) == 0) {
      *out = d;
      found++;
    }
  }
  return found == 1;
}

/* CUDA device `ordinal` as NVML's; false with why[size] when it has none. */
static bool device_for_ordinal(int ordinal, nvml_device *out, char *why, size_t size) {
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  if (!vis) {
    if (nvml.by_index((unsigned)ordinal, out) == NVML_SUCCESS) return true;
    snprintf(why, size, "no NVML device %d", ordinal);
    return false;
  }
  /* the ordinal-th comma-separated entry, spaces trimmed */
  const char *p = vis;
  for (int k = 0; k < ordinal && p; k++) {
    p = strchr(p, ',');
    if (p) p++;
  }
  if (!p) {
    snprintf(why, size, "CUDA_VISIBLE_DEVICES '%s' has no entry %d", vis, ordinal);
    return false;
  }
  char entry[NVML_STRING_SIZE];
  while (*p == ' ')
    p++;
  size_t n = strcspn(p, ", ");
  if (n == 0 || n >= sizeof entry) {
    snprintf(why, size, "CUDA_VISIBLE_DEVICES '%s': entry %d is empty or too long", vis, ordinal);
    return false;
  }
  memcpy(entry, p, n);
  entry[n] = 0;
  char *end;
  unsigned long index = strtoul(entry, &end, 10);
  bool ok = false; /* MIG-... instances stay unmapped: NVML has handles of their own for them */
  if (*end == 0 && entry[0] >= '0' && entry[0] <= '9')
    ok = index <= 0xffffffffUL && nvml.by_index((unsigned)index, out) == NVML_SUCCESS;
  else if (strncmp(entry, "GPU-", 4) == 0)
    ok = device_by_uuid(entry, out);
  if (!ok)
    snprintf(why, size, "CUDA_VISIBLE_DEVICES entry '%s' is no NVML device (an index or GPU-UUID)", entry);
  return ok;
}

/* ---- the metrics -------------------------------------------------------------------- */

typedef struct gpu {
  int worker;
  nvml_device dev;
  char uuid[MOED_PROM_LABEL_SIZE(NVML_STRING_SIZE)]; /* escaped for the label */
  unsigned long long energy0;                        /* mJ at start: the metric counts from there */
  bool has_energy0;
} gpu;

struct moed_gpu_metrics {
  pthread_mutex_t mu; /* one scrape at a time: the flags below */
  gpu *gpus;
  int n;
  bool budget_logged, error_logged;
};

/* Triton's families, in Triton's order (HELP texts as Triton's, but for the
 * energy one's start) */
enum { UTILIZATION, MEMORY_TOTAL, MEMORY_USED, POWER, POWER_LIMIT, ENERGY, N_FAMILIES };
static const struct {
  const char *name, *help, *type;
} families[N_FAMILIES] = {
    {"nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "gauge"},
    {"nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "gauge"},
    {"nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "gauge"},
    {"nv_gpu_power_usage", "GPU power usage in watts", "gauge"},
    {"nv_gpu_power_limit", "GPU power management limit in watts", "gauge"},
    {"nv_energy_consumption", "GPU energy consumption in joules since moed started", "counter"},
};

/* What the backend calls device i: "gpuN: NAME" (backend_gpu.c), at most 48
 * bytes of the name. */
static const char *backend_device_name(const char *backend) {
  const char *p = strstr(backend, ": ");
  return p ? p + 2 : backend;
}

moed_gpu_metrics *moed_gpu_metrics_create(bool allow, int n_workers, const char *const backends[]) {
  int n_gpus = 0;
  for (int i = 0; i < n_workers; i++)
    n_gpus += backends[i] != NULL;
  if (!allow || n_gpus == 0) {
    moed_log(MOED_LOG_DEBUG, "gpu_metrics", "off: %s",
             !allow ? "--allow-gpu-metrics false" : "no GPU workers");
    return NULL;
  }
  pthread_once(&nvml_once, nvml_load);
  if (nvml_why) {
    moed_log(nvml_level, "gpu_metrics", "off: NVML not available (%s)", nvml_why);
    return NULL;
  }
  moed_gpu_metrics *g = calloc(1, sizeof *g);
  if (!g || !(g->gpus = calloc((size_t)n_gpus, sizeof *g->gpus))) goto fail;
  pthread_mutex_init(&g->mu, NULL);
  for (int i = 0; i < n_workers; i++) {
    if (!backends[i]) continue;
    gpu *d = &g->gpus[g->n];
    char why[256], uuid[NVML_STRING_SIZE], name[NVML_STRING_SIZE];
    const char *want = backend_device_name(backends[i]);
    if (!device_for_ordinal(i, &d->dev, why, sizeof why)) {
      moed_log(MOED_LOG_WARN, "gpu_metrics", "worker %d (%s) left out: %s", i, backends[i], why);
      continue;
    }
    nvml_return r = nvml.uuid(d->dev, uuid, sizeof uuid);
    if (r == NVML_SUCCESS) r = nvml.name(d->dev, name, sizeof name);
    if (r != NVML_SUCCESS) {
      moed_log(MOED_LOG_WARN, "gpu_metrics", "worker %d (%s) left out: nvmlDeviceGetUUID/Name: %s", i,
               backends[i], nvml.error_string(r));
      continue;
    }
    if (strncmp(name, want, strlen(want)) != 0) {
      moed_log(MOED_LOG_WARN, "gpu_metrics",
               "worker %d (%s) left out: its NVML device is a %s (%s): CUDA and NVML number the GPUs "
               "differently; set CUDA_DEVICE_ORDER=PCI_BUS_ID",
               i, backends[i], name, uuid);
      continue;
    }
    moed_prom_label(d->uuid, sizeof d->uuid, uuid);
    d->worker = i;
    d->has_energy0 = nvml.energy(d->dev, &d->energy0) == NVML_SUCCESS;
    moed_log(MOED_LOG_INFO, "gpu_metrics", "worker %d (%s): NVML %s%s", i, backends[i], uuid,
             d->has_energy0 ? "" : " (no energy counter)");
    g->n++;
  }
  if (g->n == 0) {
    moed_log(MOED_LOG_WARN, "gpu_metrics", "off: no GPU worker has an NVML device");
    moed_gpu_metrics_destroy(g);
    return NULL;
  }
  return g;
fail:
  moed_log(MOED_LOG_WARN, "gpu_metrics", "off: out of memory");
  if (g) free(g->gpus);
  free(g);
  return NULL;
}

void moed_gpu_metrics_destroy(moed_gpu_metrics *g) {
  if (!g) return;
  pthread_mutex_destroy(&g->mu);
  free(g->gpus);
  free(g);
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* One device's values; ok[f] false where NVML had none (the sample is left
 * out, as Triton does). Returns the first error, for the log. */
static nvml_return sample(gpu *d, double v[N_FAMILIES], bool ok[N_FAMILIES]) {
  nvml_utilization u = {0};
  nvml_memory m = {0};
  unsigned mw = 0, limit_mw = 0;
  unsigned long long mj = 0;
  nvml_return r[N_FAMILIES];
  r[UTILIZATION] = nvml.utilization(d->dev, &u);
  r[MEMORY_TOTAL] = r[MEMORY_USED] = nvml.memory(d->dev, &m);
  r[POWER] = nvml.power(d->dev, &mw);
  r[POWER_LIMIT] = nvml.power_limit(d->dev, &limit_mw);
  r[ENERGY] = d->has_energy0 ? nvml.energy(d->dev, &mj) : NVML_SUCCESS;
  ok[UTILIZATION] = r[UTILIZATION] == NVML_SUCCESS && (v[UTILIZATION] = u.gpu / 100.0, true);
  ok[MEMORY_TOTAL] = r[MEMORY_TOTAL] == NVML_SUCCESS && (v[MEMORY_TOTAL] = (double)m.total, true);
  ok[MEMORY_USED] = r[MEMORY_USED] == NVML_SUCCESS && (v[MEMORY_USED] = (double)m.used, true);
  ok[POWER] = r[POWER] == NVML_SUCCESS && (v[POWER] = mw / 1000.0, true);
  ok[POWER_LIMIT] = r[POWER_LIMIT] == NVML_SUCCESS && (v[POWER_LIMIT] = limit_mw / 1000.0, true);
  /* a counter never goes back: one that did (the driver reloaded) is left out */
  ok[ENERGY] = d->has_energy0 && r[ENERGY] == NVML_SUCCESS && mj >= d->energy0 &&
               (v[ENERGY] = (double)(mj - d->energy0) / 1000.0, true);
  for (int f = 0; f < N_FAMILIES; f++)
    if (r[f] != NVML_SUCCESS) return r[f];
  return NVML_SUCCESS;
}

char *moed_gpu_metrics_render(moed_gpu_metrics *g, size_t *len) {
  if (!g || g->n == 0) return NULL;
  double(*v)[N_FAMILIES] = calloc((size_t)g->n, sizeof *v);
  bool(*ok)[N_FAMILIES] = calloc((size_t)g->n, sizeof *ok);
  char *text = NULL;
  *len = 0;
  FILE *f = v && ok ? open_memstream(&text, len) : NULL;
  if (!f) goto out;
  pthread_mutex_lock(&g->mu);
  const int64_t t0 = now_ns();
  int sampled = 0;
  for (; sampled < g->n; sampled++) {
    if (now_ns() - t0 > SCRAPE_BUDGET_NS) {
      if (!g->budget_logged)
        moed_log(MOED_LOG_WARN, "gpu_metrics", "a scrape read %d of %d GPUs in %lld ms: the rest left out",
                 sampled, g->n, SCRAPE_BUDGET_NS / 1000000);
      g->budget_logged = true;
      break;
    }
    gpu *d = &g->gpus[sampled];
    nvml_return r = sample(d, v[sampled], ok[sampled]);
    if (r != NVML_SUCCESS && !g->error_logged) {
      moed_log(MOED_LOG_DEBUG, "gpu_metrics", "worker %d: %s (its failing samples are left out)", d->worker,
               nvml.error_string(r));
      g->error_logged = true;
    }
  }
  pthread_mutex_unlock(&g->mu);
  for (int fam = 0; fam < N_FAMILIES; fam++) {
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", families[fam].name, families[fam].help, families[fam].name,
            families[fam].type);
    for (int i = 0; i < sampled; i++)
      if (ok[i][fam]) fprintf(f, "%s{gpu_uuid=\"%s\"} %f\n", families[fam].name, g->gpus[i].uuid, v[i][fam]);
  }
  if (fclose(f) != 0) { /* out of memory while writing: nothing rather than a part */
    free(text);
    text = NULL;
  }
out:
  free(v);
  free(ok);
  return text;
}
