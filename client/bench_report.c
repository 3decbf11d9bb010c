/* bench_report: see bench_report.h. One table of the quantities a level
 * reports (level_fields) feeds the JSON, the CSV and the text table, so the
 * three name the same numbers the same way. */
#include "bench_report.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const struct {
  const char *name;
  double p;
} pcts[] = {{"p50", 0.5}, {"p90", 0.9}, {"p95", 0.95}, {"p99", 0.99}, {"max", 1.0}};
#define N_PCTS (sizeof pcts / sizeof pcts[0])

static const char *mode_name(const bench_run *b) {
  return b->rate > 0 ? (b->poisson ? "open-poisson" : "open") : "closed";
}

static double per_s(double x, double elapsed) { return elapsed > 0 ? x / elapsed : 0; }

/* ---- JSON --------------------------------------------------------------------------- */

static cJSON *level_json(const bench_run *b, const bench_level *l) {
  const load_result *r = &l->r;
  cJSON *j = cJSON_CreateObject(), *lat = cJSON_CreateObject(), *err = cJSON_CreateObject(),
        *wins = cJSON_CreateArray();
  cJSON_AddNumberToObject(j, "concurrency", l->concurrency);
  cJSON_AddNumberToObject(j, "channels", b->channels < l->concurrency ? b->channels : l->concurrency);
  cJSON_AddNumberToObject(j, "rate", b->rate);
  cJSON_AddNumberToObject(j, "requests", (double)r->c.n_calls);
  cJSON_AddNumberToObject(j, "ok", (double)r->c.n_ok);
  cJSON_AddNumberToObject(j, "errors", (double)(r->c.n_calls - r->c.n_ok));
  for (int i = 1; i < LOAD_STATUS_CODES; i++)
    if (r->c.by_status[i])
      cJSON_AddNumberToObject(err, load_status_name((grpc_status_code)i), (double)r->c.by_status[i]);
  cJSON_AddItemToObject(j, "errors_by_status", err);
  if (r->first_error[0] && r->c.n_calls != r->c.n_ok)
    cJSON_AddStringToObject(j, "first_error", r->first_error);
  cJSON_AddNumberToObject(j, "late", (double)r->c.late);
  cJSON_AddNumberToObject(j, "elapsed_s", r->elapsed_s);
  cJSON_AddNumberToObject(j, "requests_per_s", per_s((double)r->c.n_ok, r->elapsed_s));
  cJSON_AddNumberToObject(j, "tokens", (double)r->c.tokens_ok);
  cJSON_AddNumberToObject(j, "tokens_per_s", per_s((double)r->c.tokens_ok, r->elapsed_s));
  cJSON_AddNumberToObject(j, "sent_bytes_per_s", per_s((double)r->c.bytes_sent, r->elapsed_s));
  cJSON_AddNumberToObject(j, "received_bytes_per_s", per_s((double)r->c.bytes_received, r->elapsed_s));
  cJSON_AddNumberToObject(j, "request_bytes",
                          r->c.n_calls ? (double)r->c.bytes_sent / (double)r->c.n_calls : 0);
  for (size_t i = 0; i < N_PCTS; i++)
    cJSON_AddNumberToObject(lat, pcts[i].name, load_percentile(r, pcts[i].p) * 1e3);
  cJSON_AddItemToObject(j, "latency_ms", lat);
  for (int i = 0; i < r->n_windows; i++) {
    const load_window *w = &r->windows[i];
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "requests", (double)w->c.n_calls);
    cJSON_AddNumberToObject(o, "ok", (double)w->c.n_ok);
    cJSON_AddNumberToObject(o, "tokens", (double)w->c.tokens_ok);
    cJSON_AddNumberToObject(o, "elapsed_s", w->elapsed_s);
    cJSON_AddNumberToObject(o, "requests_per_s", w->requests_per_s);
    cJSON_AddNumberToObject(o, "p99_ms", w->p99_s * 1e3);
    cJSON_AddItemToArray(wins, o);
  }
  cJSON_AddItemToObject(j, "windows", wins);
  if (b->requests > 0 || b->stability <= 0)
    cJSON_AddNullToObject(j, "stable"); /* not searched for */
  else
    cJSON_AddBoolToObject(j, "stable", r->stable);
  cJSON_AddNumberToObject(j, "sent_requests", (double)r->all_calls);
  cJSON_AddNumberToObject(j, "sent_ok", (double)r->all_ok);
  if (l->server.valid) {
    cJSON *s = cJSON_CreateObject();
    cJSON_AddNumberToObject(s, "requests", (double)l->server.requests);
    cJSON_AddNumberToObject(s, "queue_us", l->server.queue_us);
    cJSON_AddNumberToObject(s, "compute_input_us", l->server.compute_input_us);
    cJSON_AddNumberToObject(s, "compute_infer_us", l->server.compute_infer_us);
    cJSON_AddNumberToObject(s, "compute_output_us", l->server.compute_output_us);
    cJSON_AddItemToObject(j, "server", s);
  } else {
    cJSON_AddNullToObject(j, "server");
  }
  return j;
}

cJSON *bench_report_json(const bench_run *b) {
  cJSON *j = cJSON_CreateObject(), *levels = cJSON_CreateArray();
  cJSON_AddStringToObject(j, "model", b->model);
  cJSON_AddStringToObject(j, "target", b->target);
  cJSON_AddStringToObject(j, "mode", mode_name(b));
  cJSON_AddBoolToObject(j, "stream", b->stream);
  cJSON_AddNumberToObject(j, "channels", b->channels);
  cJSON_AddNumberToObject(j, "rate", b->rate);
  if (b->tokens)
    cJSON_AddStringToObject(j, "tokens_spec", b->tokens);
  else
    cJSON_AddNullToObject(j, "tokens_spec");
  cJSON_AddNumberToObject(j, "variants", b->variants);
  cJSON_AddNumberToObject(j, "seed", b->seed);
  if (b->requests > 0) {
    cJSON_AddNumberToObject(j, "requests_per_level", (double)b->requests);
  } else {
    cJSON_AddNumberToObject(j, "window_s", b->window_s);
    cJSON_AddNumberToObject(j, "max_windows", b->max_windows);
    cJSON_AddNumberToObject(j, "stability_pct", b->stability * 100);
  }
  for (int i = 0; i < b->n_levels; i++)
    cJSON_AddItemToArray(levels, level_json(b, &b->levels[i]));
  cJSON_AddItemToObject(j, "levels", levels);
  return j;
}

/* path "-": stdout; else the file, created or truncated. */
static FILE *open_out(const char *flag, const char *path) {
  if (strcmp(path, "-") == 0) return stdout;
  FILE *f = fopen(path, "w");
  if (!f) fprintf(stderr, "moec: %s %s: %s\n", flag, path, strerror(errno));
  return f;
}

static int close_out(const char *flag, const char *path, FILE *f) {
  int bad = ferror(f);
  if (f == stdout) return fflush(f) || bad ? -1 : 0;
  if (fclose(f) != 0 || bad) {
    fprintf(stderr, "moec: %s %s: write failed\n", flag, path);
    return -1;
  }
  return 0;
}

int bench_report_write_json(const char *path, const bench_run *b) {
  cJSON *j = bench_report_json(b);
  char *text = j ? cJSON_Print(j) : NULL;
  cJSON_Delete(j);
  if (!text) {
    fprintf(stderr, "moec: --json: out of memory\n");
    return -1;
  }
  FILE *f = open_out("--json", path);
  if (f) fprintf(f, "%s\n", text);
  free(text);
  return f ? close_out("--json", path, f) : -1;
}

/* ---- CSV: a header, then one row per level ---------------------------------------- */

int bench_report_write_csv(const char *path, const bench_run *b) {
  FILE *f = open_out("--csv", path);
  if (!f) return -1;
  fputs("concurrency,rate,requests,ok,errors,elapsed_s,requests_per_s,tokens_per_s", f);
  for (size_t i = 0; i < N_PCTS; i++)
    fprintf(f, ",%s_ms", pcts[i].name);
  fputs(",windows,stable,server_requests,queue_us,compute_input_us,compute_infer_us,compute_output_us,"
        "errors_by_status\n",
        f);
  for (int k = 0; k < b->n_levels; k++) {
    const bench_level *l = &b->levels[k];
    const load_result *r = &l->r;
    fprintf(f, "%d,%g,%zu,%zu,%zu,%.6f,%.3f,%.3f", l->concurrency, b->rate, r->c.n_calls, r->c.n_ok,
            r->c.n_calls - r->c.n_ok, r->elapsed_s, per_s((double)r->c.n_ok, r->elapsed_s),
            per_s((double)r->c.tokens_ok, r->elapsed_s));
    for (size_t i = 0; i < N_PCTS; i++)
      fprintf(f, ",%.6f", load_percentile(r, pcts[i].p) * 1e3);
    fprintf(f, ",%d,%s", r->n_windows,
            b->requests > 0 || b->stability <= 0 ? ""
            : r->stable                          ? "true"
                                                 : "false");
    if (l->server.valid)
      fprintf(f, ",%llu,%.3f,%.3f,%.3f,%.3f", (unsigned long long)l->server.requests, l->server.queue_us,
              l->server.compute_input_us, l->server.compute_infer_us, l->server.compute_output_us);
    else
      fputs(",,,,,", f);
    fputc(',', f); /* NAME=count separated by spaces: no quoting needed */
    for (int i = 1, first = 1; i < LOAD_STATUS_CODES; i++)
      if (r->c.by_status[i]) {
        fprintf(f, "%s%s=%zu", first ? "" : " ", load_status_name((grpc_status_code)i), r->c.by_status[i]);
        first = 0;
      }
    fputc('\n', f);
  }
  return close_out("--csv", path, f);
}

/* ---- the table ---------------------------------------------------------------------- */

void bench_report_table(FILE *f, const bench_run *b) {
  fprintf(f, "model      %s at %s\n", b->model, b->target);
  fprintf(f, "load       %s%s, up to %d channel(s)", mode_name(b), b->stream ? " (streams)" : "",
          b->channels);
  if (b->rate > 0) fprintf(f, ", %.1f requests/s offered", b->rate);
  if (b->tokens) fprintf(f, ", tokens %s (seed %u)", b->tokens, b->seed);
  if (b->variants > 1) fprintf(f, ", %d variants each", b->variants);
  if (b->requests > 0)
    fprintf(f, "\nmeasured   %ld requests per level\n", b->requests);
  else if (b->stability > 0)
    fprintf(
        f,
        "\nmeasured   windows of %.3f s until requests/s and p99 agree within %.1f %% over %d (at most %d)\n",
        b->window_s, b->stability * 100, LOAD_STABLE_WINDOWS, b->max_windows);
  else
    fprintf(f, "\nmeasured   %d window(s) of %.3f s\n", b->max_windows, b->window_s);
  fprintf(f, "%11s %10s %11s %11s %9s %9s %9s %9s %9s %8s %7s %7s | %9s %9s %9s %9s\n", "concurrency",
          "requests", "requests/s", "tokens/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "max ms", "errors",
          "windows", "stable", "queue us", "input us", "infer us", "output us");
  for (int k = 0; k < b->n_levels; k++) {
    const bench_level *l = &b->levels[k];
    const load_result *r = &l->r;
    fprintf(f, "%11d %10zu %11.1f %11.1f", l->concurrency, r->c.n_calls,
            per_s((double)r->c.n_ok, r->elapsed_s), per_s((double)r->c.tokens_ok, r->elapsed_s));
    for (size_t i = 0; i < N_PCTS; i++)
      fprintf(f, " %9.3f", load_percentile(r, pcts[i].p) * 1e3);
    fprintf(f, " %8zu %7d %7s |", r->c.n_calls - r->c.n_ok, r->n_windows,
            b->requests > 0 || b->stability <= 0 ? "-"
            : r->stable                          ? "yes"
                                                 : "no");
    if (l->server.valid)
      fprintf(f, " %9.1f %9.1f %9.1f %9.1f\n", l->server.queue_us, l->server.compute_input_us,
              l->server.compute_infer_us, l->server.compute_output_us);
    else
      fprintf(f, " %9s %9s %9s %9s\n", "-", "-", "-", "-");
  }
  for (int k = 0; k < b->n_levels; k++) {
    const load_result *r = &b->levels[k].r;
    for (int i = 1; i < LOAD_STATUS_CODES; i++)
      if (r->c.by_status[i])
        fprintf(f, "concurrency %d: %zu %s\n", b->levels[k].concurrency, r->c.by_status[i],
                load_status_name((grpc_status_code)i));
    if (r->c.n_calls != r->c.n_ok && r->first_error[0])
      fprintf(f, "concurrency %d: first error: %s\n", b->levels[k].concurrency, r->first_error);
  }
}

/* ---- SVG: p50 and p99 latency against requests/s, one point per level -------------- */

#define SVG_W 720
#define SVG_H 450
#define SVG_L 80 /* margins: room for the tick labels and axis titles */
#define SVG_R 30
#define SVG_T 50
#define SVG_B 60

/* Text as XML character data or an attribute value. */
static void xml_text(FILE *f, const char *s) {
  for (; *s; s++)
    switch (*s) {
    case '&': fputs("&amp;", f); break;
    case '<': fputs("&lt;", f); break;
    case '>': fputs("&gt;", f); break;
    case '"': fputs("&quot;", f); break;
    default: fputc(*s, f);
    }
}

/* A round step (1, 2 or 5 times a power of ten) that cuts [0, max] into at
 * most about 5 ticks. */
static double tick_step(double max) {
  double raw = max / 5, mag = pow(10, floor(log10(raw))), m = raw / mag;
  return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * mag;
}

int bench_report_write_svg(const char *path, const bench_run *b) {
  static const struct {
    const char *cls, *color;
    double p;
  } series[] = {{"p50", "#1f77b4", 0.5}, {"p99", "#d62728", 0.99}};
  FILE *f = open_out("--svg", path);
  if (!f) return -1;
  double xmax = 0, ymax = 0;
  for (int k = 0; k < b->n_levels; k++) {
    const load_result *r = &b->levels[k].r;
    double x = per_s((double)r->c.n_ok, r->elapsed_s), y = load_percentile(r, 0.99) * 1e3;
    if (x > xmax) xmax = x;
    if (y > ymax) ymax = y;
  }
  double xstep = tick_step(xmax > 0 ? xmax * 1.05 : 1), ystep = tick_step(ymax > 0 ? ymax * 1.05 : 1);
  xmax = ceil((xmax > 0 ? xmax * 1.05 : 1) / xstep) * xstep;
  ymax = ceil((ymax > 0 ? ymax * 1.05 : 1) / ystep) * ystep;
  const double pw = SVG_W - SVG_L - SVG_R, ph = SVG_H - SVG_T - SVG_B;
#define PX(x) (SVG_L + (x) / xmax * pw)
#define PY(y) (SVG_T + ph - (y) / ymax * ph)
  fprintf(
      f,
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n<text x=\"%d\" y=\"24\" font-size=\"15\">",
      SVG_W, SVG_H, SVG_W, SVG_H, SVG_L);
  fputs("moec bench: ", f);
  xml_text(f, b->model);
  fprintf(f, " (%s", mode_name(b));
  if (b->tokens) {
    fputs(", tokens ", f);
    xml_text(f, b->tokens);
  }
  fputs(")</text>\n", f);
  /* axes, grid and ticks */
  fprintf(f, "<g stroke=\"#ccc\">\n");
  for (double x = 0; x <= xmax + xstep / 2; x += xstep)
    fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%.1f\"/>\n", PX(x), SVG_T, PX(x), SVG_T + ph);
  for (double y = 0; y <= ymax + ystep / 2; y += ystep)
    fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", SVG_L, PY(y), SVG_L + pw, PY(y));
  fprintf(f, "</g>\n<g text-anchor=\"middle\">\n");
  for (double x = 0; x <= xmax + xstep / 2; x += xstep)
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">%g</text>\n", PX(x), SVG_T + ph + 16, x);
  fprintf(f, "<text x=\"%.1f\" y=\"%d\">throughput (requests/s)</text>\n", SVG_L + pw / 2, SVG_H - 14);
  fprintf(f, "</g>\n<g text-anchor=\"end\">\n");
  for (double y = 0; y <= ymax + ystep / 2; y += ystep)
    fprintf(f, "<text x=\"%d\" y=\"%.1f\">%g</text>\n", SVG_L - 6, PY(y) + 4, y);
  fprintf(
      f,
      "</g>\n<text transform=\"translate(20,%.1f) rotate(-90)\" text-anchor=\"middle\">latency (ms)</text>\n",
      SVG_T + ph / 2);
  /* one line and one point per level for each series; the p99 points are
   * labelled with their concurrency */
  for (size_t s = 0; s < sizeof series / sizeof series[0]; s++) {
    fprintf(f, "<polyline class=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"",
            series[s].cls, series[s].color);
    for (int k = 0; k < b->n_levels; k++) {
      const load_result *r = &b->levels[k].r;
      fprintf(f, "%s%.1f,%.1f", k ? " " : "", PX(per_s((double)r->c.n_ok, r->elapsed_s)),
              PY(load_percentile(r, series[s].p) * 1e3));
    }
    fprintf(f, "\"/>\n");
    for (int k = 0; k < b->n_levels; k++) {
      const load_result *r = &b->levels[k].r;
      double x = per_s((double)r->c.n_ok, r->elapsed_s), y = load_percentile(r, series[s].p) * 1e3;
      fprintf(f,
              "<circle class=\"%s\" cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"%s\"><title>concurrency %d: %.1f "
              "requests/s, %s %.3f ms</title></circle>\n",
              series[s].cls, PX(x), PY(y), series[s].color, b->levels[k].concurrency, x, series[s].cls, y);
      if (s == 1)
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\">c=%d</text>\n", PX(x) + 6, PY(y) - 6,
                b->levels[k].concurrency);
    }
  }
  /* the legend */
  for (size_t s = 0; s < sizeof series / sizeof series[0]; s++)
    fprintf(f,
            "<line x1=\"%d\" y1=\"%zu\" x2=\"%d\" y2=\"%zu\" stroke=\"%s\" stroke-width=\"2\"/>"
            "<text x=\"%d\" y=\"%zu\">%s latency</text>\n",
            SVG_L + 12, (size_t)SVG_T + 12 + 16 * s, SVG_L + 36, (size_t)SVG_T + 12 + 16 * s, series[s].color,
            SVG_L + 42, (size_t)SVG_T + 16 + 16 * s, series[s].cls);
  fputs("</svg>\n", f);
#undef PX
#undef PY
  return close_out("--svg", path, f);
}
