/* bench_report: what `moec bench` writes: the table on stdout, JSON, CSV
 * and an SVG plot of latency percentiles against throughput, one row (one
 * point) per level of the sweep. */
#ifndef MOEC_BENCH_REPORT_H
#define MOEC_BENCH_REPORT_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "load.h"

/* The server's side of one level: ModelStatistics after minus before,
 * averaged per successful request. */
typedef struct bench_server_side {
  bool valid; /* both statistics were read */
  uint64_t requests;
  double queue_us, compute_input_us, compute_infer_us, compute_output_us;
} bench_server_side;

typedef struct bench_level {
  int concurrency; /* closed loop: calls in flight; open loop: their cap */
  load_result r;
  bench_server_side server;
} bench_level;

typedef struct bench_run {
  const char *model, *target;
  bool stream;
  int channels; /* at most; a level has min(channels, concurrency) */
  double rate;  /* > 0: open loop */
  bool poisson;
  const char *tokens; /* the --tokens spec; NULL: each request as given */
  int variants;       /* different requests per token count (--variants) */
  unsigned seed;
  long requests;    /* > 0: a fixed count per level */
  double window_s;  /* else windows ... */
  int max_windows;  /* ... at most this many ... */
  double stability; /* ... until stable within this fraction (0: not searched) */
  bench_level *levels;
  int n_levels;
} bench_run;

/* The whole report; NULL when out of memory. */
cJSON *bench_report_json(const bench_run *b);
void bench_report_table(FILE *f, const bench_run *b);
/* path "-": stdout. 0, or -1 said on stderr (naming the flag). */
int bench_report_write_json(const char *path, const bench_run *b);
int bench_report_write_csv(const char *path, const bench_run *b);
int bench_report_write_svg(const char *path, const bench_run *b);

#endif
