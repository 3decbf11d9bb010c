/* Channel/server arguments shared by moec and the bench tools: gRPC's
 * message size limits (default 4 MiB receive) raised to `bytes` both ways,
 * since MoE activations and weights are far larger; TLS credentials. */
#ifndef MOEC_GRPC_ARGS_H
#define MOEC_GRPC_ARGS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>

/* Fills args[2] and returns the grpc_channel_args that point at them. */
static inline grpc_channel_args moec_size_args(grpc_arg args[2], int bytes) {
  memset(args, 0, 2 * sizeof *args);
  args[0].type = args[1].type = GRPC_ARG_INTEGER;
  args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  args[1].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
  args[0].value.integer = args[1].value.integer = bytes;
  return (grpc_channel_args){2, args};
}

/* Transport security of a client (moec's --tls-ca, --tls-cert, --tls-key;
 * the same meaning as moed's --tls-* flags): TLS when any is set, the
 * server verified against `ca` (NULL: the system roots), and a client
 * certificate (cert + key) presented for mTLS. */
typedef struct moec_tls {
  const char *ca, *cert, *key;
  const char *token; /* a bearer token sent with every call (moed's --auth-tokens); NULL: none */
} moec_tls;

/* The token as call metadata, also over plaintext (the plugin's minimum
 * security level is none: moed behind a TLS-terminating proxy, tests). */
static inline int moec_token_metadata(void *state, grpc_auth_metadata_context ctx,
                                      grpc_credentials_plugin_metadata_cb cb, void *user_data,
                                      grpc_metadata md[GRPC_METADATA_CREDENTIALS_PLUGIN_SYNC_MAX], size_t *n,
                                      grpc_status_code *status, const char **details) {
  (void)ctx;
  (void)cb;
  (void)user_data;
  memset(md, 0, sizeof *md);
  md[0].key = grpc_slice_from_static_string("authorization");
  md[0].value = grpc_slice_from_copied_string((const char *)state);
  *n = 1;
  *status = GRPC_STATUS_OK;
  *details = NULL;
  return 1; /* answered synchronously */
}

static inline void moec_token_destroy(void *state) { free(state); }

/* A whole PEM file, malloc'ed and NUL-terminated; NULL (message printed). */
static inline char *moec_read_pem(const char *path) {
  FILE *f = fopen(path, "rb");
  char *buf = NULL;
  long n = -1;
  if (f && fseek(f, 0, SEEK_END) == 0) n = ftell(f);
  if (f && n > 0 && n <= (1L << 20) && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1)) &&
      fread(buf, 1, (size_t)n, f) == (size_t)n) {
    buf[n] = 0;
  } else {
    fprintf(stderr, "moec: cannot read %s (a PEM file of at most 1 MiB)\n", path);
    free(buf);
    buf = NULL;
  }
  if (f) fclose(f);
  return buf;
}

/* Channel credentials for t without its token (insecure when nothing is
 * set); NULL when a file does not read (message printed). */
static inline grpc_channel_credentials *moec_transport_credentials(const moec_tls *t) {
  if (!t->ca && !t->cert && !t->key) return grpc_insecure_credentials_create();
  if (!t->cert != !t->key) {
    fprintf(stderr, "moec: --tls-cert and --tls-key go together\n");
    return NULL;
  }
  grpc_channel_credentials *creds = NULL;
  char *ca = t->ca ? moec_read_pem(t->ca) : NULL;
  char *cert = t->cert ? moec_read_pem(t->cert) : NULL;
  char *key = t->key ? moec_read_pem(t->key) : NULL;
  if ((!t->ca || ca) && (!t->cert || (cert && key))) {
    grpc_ssl_pem_key_cert_pair pair = {key, cert};
    creds = grpc_ssl_credentials_create(ca, t->cert ? &pair : NULL, NULL, NULL);
  }
  free(ca);
  free(cert);
  free(key);
  return creds;
}

/* t's channel credentials with its token; the caller releases them. */
static inline grpc_channel_credentials *moec_channel_credentials(const moec_tls *t) {
  grpc_channel_credentials *creds = moec_transport_credentials(t);
  if (!creds || !t->token) return creds;
  size_t n = strlen(t->token);
  char *bearer = malloc(n + 8);
  if (!bearer) {
    grpc_channel_credentials_release(creds);
    return NULL;
  }
  memcpy(bearer, "Bearer ", 7);
  memcpy(bearer + 7, t->token, n + 1);
  grpc_metadata_credentials_plugin plugin = {moec_token_metadata, NULL, moec_token_destroy, bearer,
                                             "moec_token"};
  grpc_call_credentials *call =
      grpc_metadata_credentials_create_from_plugin(plugin, GRPC_SECURITY_NONE, NULL);
  grpc_channel_credentials *both = grpc_composite_channel_credentials_create(creds, call, NULL);
  grpc_call_credentials_release(call);
  grpc_channel_credentials_release(creds);
  /* cppcheck-suppress memleak ; bearer is the plugin's state, freed by moec_token_destroy */
  return both;
}

#endif
