/* log: one line per event on stderr, plain or JSON. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "moed.h"

static int log_level = MOED_LOG_INFO;
static bool log_json;
static const char *const level_names[] = {"error", "warn", "info", "debug"};

void moed_log_init(int level, bool json) {
  log_level = level;
  log_json = json;
}

/* Escapes a message for a JSON string (quotes, backslashes, controls). */
static void json_escape(char *dst, size_t cap, const char *src) {
  size_t o = 0;
  for (; *src && o + 7 < cap; src++) {
    unsigned char c = (unsigned char)*src;
    if (c == '"' || c == '\\') {
      dst[o++] = '\\';
      dst[o++] = (char)c;
    } else if (c < 0x20) {
      o += (size_t)snprintf(dst + o, cap - o, "\\u%04x", c);
    } else {
      dst[o++] = (char)c;
    }
  }
  dst[o] = 0;
}

void moed_log(int level, const char *event, const char *fmt, ...) {
  if (level > log_level) return;
  char msg[1024], ts[40];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  struct tm tm;
  gmtime_r(&now.tv_sec, &tm);
  size_t n = strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(ts + n, sizeof ts - n, ".%03ldZ", now.tv_nsec / 1000000);
  if (log_json) {
    char esc[2200];
    json_escape(esc, sizeof esc, msg);
    fprintf(stderr, "{\"ts\":\"%s\",\"level\":\"%s\",\"event\":\"%s\",\"msg\":\"%s\"}\n", ts, level_names[level],
            event, esc);
  } else {
    fprintf(stderr, "%s %-5s %s: %s\n", ts, level_names[level], event, msg);
  }
}
