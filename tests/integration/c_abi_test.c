/* Exercises libproxima's C ABI from C (not C++), linked against the shared library. Prints
 * "c abi ok" and exits 0 on success; otherwise names the failing step.
 * Usage: c_abi_test TARGET [NAMESPACE TOKEN]   (with a token: proxima_connect_with, and a wrong
 * token must be refused with UNAUTHENTICATED first). Either way the transport choice of
 * proxima_connect_options is checked: AUTO picks UCX, INLINE and UCX are honoured, 7 is refused. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/proxima.h"

#define CHECK(cond, what)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "FAILED: %s (last error: %s)\n", what, proxima_last_error()); \
      return 1;                                                                \
    }                                                                          \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 2 && argc != 4) return 2;
  CHECK(proxima_abi_version() == PROXIMA_ABI_VERSION, "abi version");
  proxima_client* c = NULL;
  proxima_connect_options o;
  memset(&o, 0, sizeof(o));
  o.size = sizeof(o);
  o.target = argv[1];
  o.connect_timeout_ms = 5000;
  if (argc == 2) {
    CHECK(proxima_connect(argv[1], "default", 5000, 10000, &c) == PROXIMA_OK, "connect");
  } else {
    o.namespace_name = argv[2];
    o.token = "this-token-is-not-configured-anywhere";
    CHECK(proxima_connect_with(&o, &c) == 16 /* UNAUTHENTICATED */, "wrong token refused");
    CHECK(strstr(proxima_last_error(), "bearer token") != NULL, "wrong token message");
    /* The token from a file (token_file): both ways at once is refused, the file alone works. */
    char path[] = "/tmp/proxima-c-abi-token-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    FILE* f = fdopen(fd, "w");
    CHECK(f != NULL && fprintf(f, "%s\n", argv[3]) > 0 && fclose(f) == 0, "write token file");
    o.token_file = path;
    CHECK(proxima_connect_with(&o, &c) == 3 /* INVALID_ARGUMENT */, "token and token_file");
    o.token = NULL;
    CHECK(proxima_connect_with(&o, &c) == PROXIMA_OK, "connect with token_file");
    proxima_close(c);
    c = NULL;
    unlink(path);
    o.token_file = NULL;
    o.token = argv[3];
    CHECK(proxima_connect_with(&o, &c) == PROXIMA_OK, "connect with token");
  }
  /* Transport 0 (AUTO) picks UCX against a local proximad: with a token, the blocks below then
   * move over the authenticated UCX data plane. */
  proxima_transport transport = PROXIMA_TRANSPORT_INLINE;
  CHECK(proxima_transport_in_use(c, &transport) == PROXIMA_OK && transport == PROXIMA_TRANSPORT_UCX,
        "auto picks UCX against a local proximad");
  proxima_client* other = NULL;
  o.transport = PROXIMA_TRANSPORT_INLINE;
  CHECK(proxima_connect_with(&o, &other) == PROXIMA_OK, "connect inline");
  CHECK(proxima_transport_in_use(other, &transport) == PROXIMA_OK &&
            transport == PROXIMA_TRANSPORT_INLINE,
        "forced inline");
  proxima_close(other);
  other = NULL;
  o.transport = PROXIMA_TRANSPORT_UCX;
  CHECK(proxima_connect_with(&o, &other) == PROXIMA_OK, "connect ucx");
  CHECK(proxima_transport_in_use(other, &transport) == PROXIMA_OK &&
            transport == PROXIMA_TRANSPORT_UCX,
        "forced ucx");
  proxima_close(other);
  other = NULL;
  o.transport = (proxima_transport)7;
  CHECK(proxima_connect_with(&o, &other) == 3 && other == NULL,
        "unknown transport is INVALID_ARGUMENT");
  CHECK(strstr(proxima_last_error(), "transport") != NULL, "message names the transport");
  proxima_model_profile profile = {2, 2, 64, 16, PROXIMA_DTYPE_FP16, "c-abi-model"};
  uint64_t id = 0, block_bytes = 0;
  CHECK(proxima_register_profile(c, &profile, &id, &block_bytes) == PROXIMA_OK, "register");
  CHECK(block_bytes == 2u * 2 * 16 * 2 * 64 * 2, "block bytes");

  enum { N = 3 };
  uint8_t keys[N * PROXIMA_KEY_BYTES];
  unsigned char* blocks[N];
  unsigned char* out[N];
  for (int i = 0; i < N; ++i) {
    memset(keys + i * PROXIMA_KEY_BYTES, 'a' + i, PROXIMA_KEY_BYTES);
    blocks[i] = malloc(block_bytes);
    out[i] = malloc(block_bytes);
    for (uint64_t j = 0; j < block_bytes; ++j) blocks[i][j] = (unsigned char)(j * 7 + i);
  }
  proxima_memory_region* regions[N];
  for (int i = 0; i < N; ++i) {
    CHECK(proxima_register_memory(c, blocks[i], block_bytes, &regions[i]) == PROXIMA_OK,
          "register memory");
  }
  int32_t outcomes[N];
  CHECK(proxima_put(c, id, 2, keys, (const void* const*)blocks, outcomes) == PROXIMA_OK, "put");
  CHECK(outcomes[0] == PROXIMA_PUT_STORED && outcomes[1] == PROXIMA_PUT_STORED, "put outcomes");
  size_t present = 99;
  CHECK(proxima_lookup(c, id, N, keys, &present) == PROXIMA_OK && present == 2, "lookup");
  uint8_t found[N];
  CHECK(proxima_get(c, id, N, keys, (void* const*)out, found) == PROXIMA_OK, "get");
  CHECK(found[0] == 1 && found[1] == 1 && found[2] == 0, "found flags");
  CHECK(memcmp(out[0], blocks[0], block_bytes) == 0 && memcmp(out[1], blocks[1], block_bytes) == 0,
        "bytes");
  char* json = NULL;
  char quoted_ns[80];
  snprintf(quoted_ns, sizeof(quoted_ns), "\"%s\"", argc == 4 ? argv[2] : "default");
  CHECK(proxima_stats_json(c, &json) == PROXIMA_OK && strstr(json, quoted_ns) != NULL, "stats");
  proxima_free_string(json);
  size_t deleted = 0;
  CHECK(proxima_delete(c, id, N, keys, &deleted) == PROXIMA_OK && deleted == 2, "delete");

  /* Errors: a bad profile id is NOT_FOUND (5) with a message; the client stays usable. */
  CHECK(proxima_lookup(c, id + 1, 1, keys, &present) == 5, "unknown profile is NOT_FOUND");
  CHECK(strlen(proxima_last_error()) > 0, "error message");
  profile.head_dim = 0;
  CHECK(proxima_register_profile(c, &profile, &id, &block_bytes) == 3, "bad profile");
  CHECK(strstr(proxima_last_error(), "head_dim") != NULL, "message names the field");
  proxima_client* dead = NULL;
  CHECK(proxima_connect("127.0.0.1:1", "default", 300, 300, &dead) == 14 && dead == NULL,
        "dead daemon is UNAVAILABLE");
  for (int i = 0; i < N; ++i) proxima_deregister_memory(regions[i]);
  for (int i = 0; i < N; ++i) {
    free(blocks[i]);
    free(out[i]);
  }
  proxima_close(c);
  printf("c abi ok\n");
  return 0;
}
