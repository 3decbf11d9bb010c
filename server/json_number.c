/* json_number: NaN, the infinities and -0.0 in the REST API's JSON tensor
 * data, so that a float tensor sent or answered as JSON keeps every value
 * a binary one keeps (NaN payloads aside: JSON has one NaN). JSON itself
 * has no token for a non-finite number; Python's json module (numpy's
 * tolist() through it) and tritonclient.http write NaN, Infinity and
 * -Infinity and read them back, so moed takes and writes those. */
#include "json_number.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct token {
  const char *word;
  const char *as; /* the same length: byte offsets in parse errors stay the client's */
} token;

static const token TOKENS[] = {
    {"NaN", "{} "},
    {"Infinity", "1e999   "},
    {"-Infinity", "-1e999   "},
};

static bool ident_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

/* The token at text[i] when it stands where a value may: after '[', ',' or
 * ':' (whitespace between) and not followed by a letter or digit. */
static const token *token_at(const char *text, size_t len, size_t i, char prev) {
  if (prev != '[' && prev != ',' && prev != ':') return NULL;
  for (size_t t = 0; t < sizeof TOKENS / sizeof TOKENS[0]; t++) {
    const size_t n = strlen(TOKENS[t].word);
    if (len - i >= n && !memcmp(text + i, TOKENS[t].word, n) && (i + n == len || !ident_char(text[i + n])))
      return &TOKENS[t];
  }
  return NULL;
}

/* Walks the JSON text outside its strings; each token found is counted and,
 * when out is given, rewritten there. */
static size_t rewrite(const char *text, size_t len, char *out) {
  size_t found = 0;
  char prev = 0; /* the last character outside strings that is not whitespace */
  for (size_t i = 0; i < len; i++) {
    const char c = text[i];
    if (c == '"') { /* skip the string, its escapes included */
      for (i++; i < len && text[i] != '"'; i++)
        if (text[i] == '\\') i++;
      prev = '"';
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') continue;
    const token *t = token_at(text, len, i, prev);
    if (t) {
      const size_t n = strlen(t->word);
      if (out) memcpy(out + i, t->as, n);
      found++;
      i += n - 1;
      prev = '0'; /* a value */
      continue;
    }
    prev = c;
  }
  return found;
}

char *moed_json_nonfinite_in(const char *text, size_t len, bool *oom) {
  *oom = false;
  if (!rewrite(text, len, NULL)) return NULL;
  char *out = malloc(len ? len : 1);
  if (!out) {
    *oom = true;
    return NULL;
  }
  memcpy(out, text, len);
  rewrite(text, len, out);
  return out;
}

bool moed_json_nonfinite_value(const cJSON *e, double *v) {
  if (!cJSON_IsObject(e) || e->child) return false;
  *v = NAN;
  return true;
}

cJSON *moed_json_float(double v) {
  if (isnan(v)) return cJSON_CreateRaw("NaN");
  if (isinf(v)) return cJSON_CreateRaw(v > 0 ? "Infinity" : "-Infinity");
  if (v == 0 && signbit(v)) return cJSON_CreateRaw("-0.0");
  return cJSON_CreateNumber(v);
}

size_t moed_json_nul_at(const char *text, size_t len) {
  bool in_string = false;
  size_t depth = 0;
  for (size_t i = 0; i < len; i++) {
    const char ch = text[i];
    if (in_string) {
      if (!ch || (ch == '\\' && i + 5 < len && text[i + 1] == 'u' && !memcmp(text + i + 2, "0000", 4)))
        return i;
      if (ch == '\\')
        i++; /* the escaped character: an escaped quote does not end the string */
      else if (ch == '"')
        in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '{' || ch == '[') {
      depth++;
    } else if ((ch == '}' || ch == ']') && depth && !--depth) {
      return len; /* the value ends here: what follows is cJSON's to refuse or ignore */
    }
  }
  return len;
}

cJSON *moed_json_parse_whole(const char *text, size_t len, size_t *bad_at) {
  const char *end = NULL;
  cJSON *j = cJSON_ParseWithLengthOpts(text, len, &end, false);
  if (!end || end < text || end > text + len) end = text; /* cJSON gave no position */
  if (j) {
    while (end < text + len && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
      end++;
    if (end == text + len) return j;
    cJSON_Delete(j);
  }
  *bad_at = (size_t)(end - text);
  return NULL;
}
