/* libproxima C ABI: a stable C interface over the C++ client (client/client.h), for the Python
 * binding and other languages.
 *
 * Conventions:
 *  - Every function returns a proxima_status: 0 (PROXIMA_OK) on success, otherwise a gRPC/Abseil
 *    status code (3 INVALID_ARGUMENT, 5 NOT_FOUND, 8 RESOURCE_EXHAUSTED, 14 UNAVAILABLE, ...).
 *    proxima_last_error() then returns the message, valid until the next call on this thread.
 *  - Output parameters are written only on success.
 *  - Keys are 32 bytes each, passed as one array of n * 32 bytes.
 *  - A proxima_client may be used from several threads at once.
 *  - The ABI only grows: new functions are added, existing signatures never change.
 */
#ifndef PROXIMA_CLIENT_PROXIMA_H_
#define PROXIMA_CLIENT_PROXIMA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define PROXIMA_EXPORT __attribute__((visibility("default")))
#else
#define PROXIMA_EXPORT
#endif

#define PROXIMA_ABI_VERSION 1
#define PROXIMA_KEY_BYTES 32
#define PROXIMA_OK 0

typedef int proxima_status;
typedef struct proxima_client proxima_client;
typedef struct proxima_memory_region proxima_memory_region;

/* How block bytes move (see client/client.h). AUTO: UCX when the daemon serves it and can reach
 * this process, inline otherwise. */
typedef enum {
  PROXIMA_TRANSPORT_AUTO = 0,
  PROXIMA_TRANSPORT_UCX = 1,
  PROXIMA_TRANSPORT_INLINE = 2
} proxima_transport;

typedef enum {
  PROXIMA_DTYPE_FP16 = 1,
  PROXIMA_DTYPE_BF16 = 2,
  PROXIMA_DTYPE_FP8_E4M3 = 3
} proxima_dtype;

typedef enum {
  PROXIMA_PUT_STORED = 1,
  PROXIMA_PUT_ALREADY_PRESENT = 2,
  PROXIMA_PUT_NO_SPACE = 3
} proxima_put_outcome;

typedef struct {
  uint32_t num_layers;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  uint32_t tokens_per_block;
  proxima_dtype dtype;
  const char* fingerprint; /* NUL-terminated; model name + revision + parallel layout */
} proxima_model_profile;

/* Returns PROXIMA_ABI_VERSION of the library actually loaded. */
PROXIMA_EXPORT int proxima_abi_version(void);

/* Message of the last failed call on this thread ("" if none). */
PROXIMA_EXPORT const char* proxima_last_error(void);

/* Connects to proximad at `target` ("unix:/run/proxima/proximad.sock" or "host:port") for
 * namespace `namespace_name`. Timeouts in milliseconds; 0 picks the default (5 s / 30 s).
 * While the daemon cannot be reached (down, restarting), calls fail 14 (UNAVAILABLE) at once
 * rather than wait out call_timeout; the client reconnects by itself in the background, and
 * calls succeed again within about a second of the daemon serving. */
PROXIMA_EXPORT proxima_status proxima_connect(const char* target, const char* namespace_name,
                               int64_t connect_timeout_ms, int64_t call_timeout_ms,
                               proxima_client** client_out);

/* Options of proxima_connect_with(). Zero-initialize, set `size` to sizeof(proxima_connect_options)
 * (so later versions can add fields), then set what you need; NULL strings mean "not set". */
typedef struct {
  size_t size;                /* sizeof(proxima_connect_options) */
  const char* target;         /* required: "unix:/run/proxima/proximad.sock" or "host:port" */
  const char* namespace_name; /* NULL: "default" */
  const char* token;          /* bearer token of the namespace; NULL for an open namespace */
  const char* tls_ca_file;    /* PEM CA that signed the daemon's certificate: enables TLS */
  const char* tls_cert_file;  /* PEM client certificate (mTLS), with tls_key_file */
  const char* tls_key_file;
  const char* tls_server_name; /* name to verify in the daemon's certificate, if not target's */
  int64_t connect_timeout_ms; /* 0: 5 s */
  int64_t call_timeout_ms;    /* 0: 30 s */
  proxima_transport transport; /* 0 (PROXIMA_TRANSPORT_AUTO): UCX when usable, else inline;
                                  PROXIMA_TRANSPORT_UCX fails (FAILED_PRECONDITION or
                                  UNAVAILABLE) when UCX cannot be used */
  const char* token_file;      /* or a file holding the token, read again every 10 s (a rotated
                                  token is presented without reconnecting); not with `token` */
} proxima_connect_options;

/* Connects with TLS, a bearer token and/or a transport choice (see proxima_connect_options). */
PROXIMA_EXPORT proxima_status proxima_connect_with(const proxima_connect_options* options,
                                                   proxima_client** client_out);

/* The transport in use (PROXIMA_TRANSPORT_UCX or PROXIMA_TRANSPORT_INLINE). */
PROXIMA_EXPORT proxima_status proxima_transport_in_use(proxima_client* client,
                                                       proxima_transport* transport_out);

/* Registers [data, data + size) for UCX once (e.g. a whole KV cache); blocks inside it then move
 * without registration cost. A no-op handle over inline. Deregister before proxima_close. */
PROXIMA_EXPORT proxima_status proxima_register_memory(proxima_client* client, void* data,
                                                      size_t size,
                                                      proxima_memory_region** region_out);
/* Deregisters (NULL is allowed); a transfer in flight keeps the registration until it ends. */
PROXIMA_EXPORT void proxima_deregister_memory(proxima_memory_region* region);

/* Closes the connection and frees `client` (NULL is allowed). */
PROXIMA_EXPORT void proxima_close(proxima_client* client);

PROXIMA_EXPORT proxima_status proxima_register_profile(proxima_client* client,
                                        const proxima_model_profile* profile,
                                        uint64_t* profile_id_out, uint64_t* block_bytes_out);

/* Stores n blocks: keys is n*32 bytes, blocks[i] points to block_bytes bytes. outcomes_out
 * (n entries, may be NULL) receives a proxima_put_outcome per block. */
PROXIMA_EXPORT proxima_status proxima_put(proxima_client* client, uint64_t profile_id, size_t n,
                           const uint8_t* keys, const void* const* blocks,
                           int32_t* outcomes_out);

/* Reads n blocks into out[i] (block_bytes each); found_out[i] is 1 for a hit, 0 for a miss. */
PROXIMA_EXPORT proxima_status proxima_get(proxima_client* client, uint64_t profile_id, size_t n,
                           const uint8_t* keys, void* const* out, uint8_t* found_out);

/* Number of leading keys of the chain (n keys) that are stored. */
PROXIMA_EXPORT proxima_status proxima_lookup(proxima_client* client, uint64_t profile_id, size_t n,
                              const uint8_t* keys, size_t* num_present_out);

PROXIMA_EXPORT proxima_status proxima_delete(proxima_client* client, uint64_t profile_id, size_t n,
                              const uint8_t* keys, size_t* num_deleted_out);

/* The daemon's stats as a JSON object; free it with proxima_free_string(). */
PROXIMA_EXPORT proxima_status proxima_stats_json(proxima_client* client, char** json_out);

PROXIMA_EXPORT void proxima_free_string(char* s);

#ifdef __cplusplus
}
#endif

#endif /* PROXIMA_CLIENT_PROXIMA_H_ */
