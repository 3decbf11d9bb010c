/* log: one line per event on stderr, plain or JSON. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "moed.h"

static int log_level = MOED_LOG_INFO;
static bool log_json;
static const char *const level_names[] = {"error", "warn", "info", "debug"};

void moed_log_init(int level, bool json) {
  log_level = level;
  log_json = json;
}

void moed_log(int level, const char *event, const char *fmt, ...) {
  if (level > log_level) return;
  char msg[1024], ts[40];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* messages may quote what a client sent (an upload's tensor name, a
   * dtype): no control character may end the line and forge the next one */
  for (char *p = msg; *p; p++)
    if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  struct tm tm;
  gmtime_r(&now.tv_sec, &tm);
  size_t n = strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(ts + n, sizeof ts - n, ".%03ldZ", now.tv_nsec / 1000000);
  if (log_json) { /* cJSON escapes; out of memory: the plain line below */
    cJSON *o = cJSON_CreateObject();
    char *line = o && cJSON_AddStringToObject(o, "ts", ts) &&
                         cJSON_AddStringToObject(o, "level", level_names[level]) &&
                         cJSON_AddStringToObject(o, "event", event) && cJSON_AddStringToObject(o, "msg", msg)
                     ? cJSON_PrintUnformatted(o)
                     : NULL;
    cJSON_Delete(o);
    if (line) {
      fprintf(stderr, "%s\n", line);
      free(line);
      return;
    }
  }
  fprintf(stderr, "%s %-5s %s: %s\n", ts, level_names[level], event, msg);
}
