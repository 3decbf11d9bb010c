/* json_number: floats in the REST API's JSON tensors that plain JSON
 * cannot spell (json_number.c). */
#ifndef MOED_JSON_NUMBER_H
#define MOED_JSON_NUMBER_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>

/* text[0, len) with every bare NaN, Infinity and -Infinity value (the
 * tokens Python's json and tritonclient.http write for non-finite floats)
 * rewritten to a same-length form cJSON parses: NaN as an empty object
 * (read back by moed_json_nonfinite_value), the infinities as 1e999 and
 * -1e999 padded with spaces. Byte offsets stay those of the client's text.
 * NULL when there is none (parse the text as it is) or out of memory
 * (*oom set); else a malloc'ed copy the caller frees. */
char *moed_json_nonfinite_in(const char *text, size_t len, bool *oom);

/* Where a string of the JSON value at the start of text[0, len) holds a
 * NUL: a \u0000 escape, or a NUL byte (not JSON, but cJSON takes it).
 * cJSON keeps strings NUL-terminated, so such a string would be cut there
 * ("x\u0000y" read as input "x"): the REST port refuses it. Its byte
 * offset, or len when there is none (bytes after the value are not
 * looked at). */
size_t moed_json_nul_at(const char *text, size_t len);

/* text[0, len) parsed as one JSON value with nothing but whitespace after
 * it (cJSON stops at the value's end and ignores the rest: `{...} junk` or
 * two objects back to back would be taken). NULL when malformed, *bad_at
 * then the byte offset where it is. */
cJSON *moed_json_parse_whole(const char *text, size_t len, size_t *bad_at);

/* A data element that moed_json_nonfinite_in wrote for NaN: true and *v NaN. */
bool moed_json_nonfinite_value(const cJSON *e, double *v);

/* A float element for an answer's data: as cJSON prints a number, except
 * -0.0 (cJSON prints "-0", which parsers read as the integer 0 and so lose
 * the sign) and the non-finite values (cJSON prints null, which tritonclient
 * reads as NaN, so an infinity would come back NaN): those as -0.0, NaN,
 * Infinity, -Infinity, what Python's json and tritonclient.http read back. */
cJSON *moed_json_float(double v);

#endif
