/* tls: the ports' credentials. Without --tls-cert every port is
 * plaintext; with it, the gRPC port speaks TLS through gRPC core's SSL
 * server credentials and the HTTP ports through an OpenSSL context built
 * here from the same files (http_transport.c runs the records), both optionally
 * verifying client certificates against --tls-client-ca
 * (--tls-client-auth optional|require).
 *
 * The certificate, key and client CA are read through gRPC core's
 * certificate config fetcher, which gRPC calls before each new handshake:
 * it rereads the files only when SIGHUP bumped the generation, so a
 * rotated certificate (cert-manager rewriting a mounted Secret) is served
 * from the next connection on, existing connections are untouched, and
 * files that do not read or parse keep the previous certificate (logged). */
#include <errno.h>
#include <grpc/grpc_security.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed.h"

#define PEM_MAX ((long)1 << 20) /* a certificate chain or key file larger than this is not one */

static struct {
  const char *cert, *key, *client_ca;
  int client_auth;        /* MOED_CLIENT_AUTH_* */
  atomic_uint generation; /* bumped by moed_tls_reload */
  pthread_mutex_t mu;     /* fetches may run on several handshake threads */
  unsigned loaded;        /* the generation last fetched (mu) */
  bool have;              /* a config was handed to gRPC (mu) */
  SSL_CTX *http;          /* the HTTP ports' context (loop thread) */
  unsigned http_loaded;   /* the generation it was built at */
} tls = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* The whole file, NUL-terminated (malloc'ed); NULL with why[] set. */
static char *read_pem(const char *path, char *why, size_t n) {
  FILE *f = fopen(path, "rb");
  char *buf = NULL;
  long size = -1;
  if (!f) {
    snprintf(why, n, "%s: %s", path, strerror(errno));
    return NULL;
  }
  if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
  if (size <= 0 || size > PEM_MAX || fseek(f, 0, SEEK_SET) != 0) {
    snprintf(why, n, "%s: empty, unreadable or larger than %ld bytes", path, PEM_MAX);
    goto out;
  }
  buf = malloc((size_t)size + 1);
  if (!buf || fread(buf, 1, (size_t)size, f) != (size_t)size) {
    snprintf(why, n, "%s: read failed", path);
    free(buf);
    buf = NULL;
    goto out;
  }
  buf[size] = 0;
  if (!strstr(buf, "-----BEGIN ")) {
    snprintf(why, n, "%s: not PEM", path);
    free(buf);
    buf = NULL;
  }
out:
  fclose(f);
  return buf;
}

/* A certificate config from the three files; NULL with why[] set. gRPC
 * core copies the strings it is given. */
static grpc_ssl_server_certificate_config *load_config(char *why, size_t n) {
  grpc_ssl_server_certificate_config *c = NULL;
  char *cert = read_pem(tls.cert, why, n);
  char *key = cert ? read_pem(tls.key, why, n) : NULL;
  char *ca = key && tls.client_ca ? read_pem(tls.client_ca, why, n) : NULL;
  if (key && (!tls.client_ca || ca)) {
    grpc_ssl_pem_key_cert_pair pair = {key, cert};
    /* gRPC core (1.51) asserts roots in a fetched config even when no
     * client certificate is asked for: then the server's own chain stands
     * in, and is never used */
    c = grpc_ssl_server_certificate_config_create(ca ? ca : cert, &pair, 1);
    if (!c) snprintf(why, n, "gRPC refused the certificate configuration");
  }
  if (key) memset(key, 0, strlen(key)); /* no copy of the private key left in freed memory */
  free(cert);
  free(key);
  free(ca);
  return c;
}

static grpc_ssl_certificate_config_reload_status fetch(void *arg, grpc_ssl_server_certificate_config **out) {
  (void)arg;
  unsigned want = atomic_load(&tls.generation);
  grpc_ssl_certificate_config_reload_status st = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
  pthread_mutex_lock(&tls.mu);
  if (!tls.have || tls.loaded != want) {
    char why[512];
    grpc_ssl_server_certificate_config *c = load_config(why, sizeof why);
    tls.loaded = want; /* a failed reload is not retried on every handshake: SIGHUP again */
    if (c) {
      *out = c;
      st = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
      moed_log(MOED_LOG_INFO, "tls_loaded", "%s (client certificates: %s)", tls.cert,
               tls.client_ca ? tls.client_ca : "not requested");
      tls.have = true;
    } else {
      st = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_FAIL;
      moed_log(MOED_LOG_ERROR, "tls_reload_failed", "%s; %s", why,
               tls.have ? "the previous certificate is kept" : "TLS cannot start");
    }
  }
  pthread_mutex_unlock(&tls.mu);
  return st;
}

void moed_tls_reload(void) {
  if (tls.cert) atomic_fetch_add(&tls.generation, 1);
}

grpc_server_credentials *moed_tls_server_credentials(const moed_config *cfg) {
  if (!cfg->tls_cert) return grpc_insecure_server_credentials_create();
  tls.cert = cfg->tls_cert;
  tls.key = cfg->tls_key;
  tls.client_ca = cfg->tls_client_ca;
  tls.client_auth = cfg->tls_client_auth;
  /* read once here, so that bad files stop the start with their reason
   * rather than as a port gRPC cannot add */
  char why[512];
  grpc_ssl_server_certificate_config *probe = load_config(why, sizeof why);
  if (!probe) {
    moed_log(MOED_LOG_ERROR, "tls_failed", "%s", why);
    return NULL;
  }
  grpc_ssl_server_certificate_config_destroy(probe);
  static const grpc_ssl_client_certificate_request_type req[] = {
      [MOED_CLIENT_AUTH_NONE] = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
      [MOED_CLIENT_AUTH_OPTIONAL] = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY,
      [MOED_CLIENT_AUTH_REQUIRE] = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY,
  };
  grpc_ssl_server_credentials_options *o =
      grpc_ssl_server_credentials_create_options_using_config_fetcher(req[cfg->tls_client_auth], fetch, NULL);
  return o ? grpc_ssl_server_credentials_create_with_options(o) : NULL;
}

/* ---- the HTTP ports: an OpenSSL context from the same files --------------------------- */

/* NULL with why[] set (OpenSSL's reason). */
static SSL_CTX *http_context(char *why, size_t n) {
  SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
  STACK_OF(X509_NAME) *names = NULL;
  const char *step = "TLS context";
  if (!ctx) goto fail;
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  step = tls.cert;
  if (SSL_CTX_use_certificate_chain_file(ctx, tls.cert) != 1) goto fail;
  step = tls.key;
  if (SSL_CTX_use_PrivateKey_file(ctx, tls.key, SSL_FILETYPE_PEM) != 1 || SSL_CTX_check_private_key(ctx) != 1)
    goto fail;
  if (tls.client_auth != MOED_CLIENT_AUTH_NONE) {
    step = tls.client_ca;
    if (SSL_CTX_load_verify_locations(ctx, tls.client_ca, NULL) != 1 ||
        !(names = SSL_load_client_CA_file(tls.client_ca)))
      goto fail;
    SSL_CTX_set_client_CA_list(ctx, names); /* the CAs named in the CertificateRequest; taken */
    SSL_CTX_set_verify(
        ctx,
        SSL_VERIFY_PEER | (tls.client_auth == MOED_CLIENT_AUTH_REQUIRE ? SSL_VERIFY_FAIL_IF_NO_PEER_CERT : 0),
        NULL);
  }
  /* resumed sessions keep their verified peer: OpenSSL wants a context id for that */
  static const unsigned char sid[] = "moed-http";
  SSL_CTX_set_session_id_context(ctx, sid, sizeof sid - 1);
  return ctx;
fail:;
  char reason[256];
  ERR_error_string_n(ERR_get_error(), reason, sizeof reason);
  ERR_clear_error();
  snprintf(why, n, "%s: %s", step, reason);
  SSL_CTX_free(ctx);
  return NULL;
}

SSL_CTX *moed_tls_http_context(void) {
  if (!tls.cert) return NULL;
  unsigned want = atomic_load(&tls.generation);
  if (tls.http && tls.http_loaded == want) return tls.http;
  char why[512];
  SSL_CTX *ctx = http_context(why, sizeof why);
  tls.http_loaded = want; /* a failed reload is not retried on every connection: SIGHUP again */
  if (!ctx) {
    moed_log(MOED_LOG_ERROR, "tls_reload_failed", "HTTP ports: %s; %s", why,
             tls.http ? "the previous certificate is kept" : "TLS cannot start");
    return tls.http;
  }
  if (tls.http) moed_log(MOED_LOG_INFO, "tls_loaded", "HTTP ports: %s", tls.cert);
  SSL_CTX_free(tls.http); /* connections made with it hold their own reference */
  tls.http = ctx;
  return ctx;
}

void moed_tls_destroy(void) {
  SSL_CTX_free(tls.http);
  tls.http = NULL;
}
