// proximad's configuration: one YAML document, overridable key by key from the command line,
// validated completely at start.
//
// Validation errors name the key, the value and what is allowed, e.g.
//   config key 'tiers.host.capacity_bytes' has value '12X'; expected a size such as 1073741824,
//   512MiB or 4GiB
// Every key has a default (DefaultConfigYaml() prints them all), so an empty document is valid and
// gives a daemon that needs no GPU. docs/configuration.md is the reference. Thread-compatible.
#ifndef PROXIMA_DAEMON_CONFIG_H_
#define PROXIMA_DAEMON_CONFIG_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace proxima::daemon {

// TLS for gRPC over TCP (the Unix socket is protected by its file mode instead). Files are PEM;
// they are read and checked when the daemon starts (daemon/security.h), not while parsing.
struct TlsConfig {
  std::string cert_file;       // server certificate chain; "" = plaintext TCP
  std::string key_file;        // its private key (unencrypted PEM)
  std::string client_ca_file;  // CA bundle; set = mTLS: clients must present a cert it signed
  bool enabled() const { return !cert_file.empty(); }
};

struct ServerConfig {
  std::string listen = "127.0.0.1:50051";  // host:port for gRPC over TCP; "" disables; port 0 picks
  std::string unix_socket = "/run/proxima/proximad.sock";  // gRPC over a Unix socket; "" disables
  uint32_t unix_socket_mode = 0660;                // file mode of the socket (octal in YAML: 0660)
  std::string metrics_listen = "127.0.0.1:9464";  // host:port of the Prometheus endpoint; "" off
  uint64_t max_message_bytes = 64ull << 20;       // largest gRPC request or response message
  uint32_t max_batch_blocks = 256;                 // most blocks per Put / Get / Delete
  uint32_t max_lookup_keys = 16384;                // most keys per Lookup
  uint32_t max_profiles_per_namespace = 64;        // registered model profiles per namespace
  double shutdown_grace_seconds = 10;              // SIGTERM: time in-flight calls get to finish
  TlsConfig tls;
  uint64_t max_inflight_bytes_per_client = 256ull << 20;  // request + response bytes one peer
                                                           // may hold in the daemon at once
  uint32_t max_connections = 1024;  // client connections with calls running at once
};

struct HostTierConfig {
  uint64_t capacity_bytes = 1ull << 30;  // hard limit on bytes of stored blocks
};

enum class TokenAccess { kReadWrite, kReadOnly };

// One bearer token of a namespace. The token itself is never in the config: it is read from a
// file or an environment variable when the daemon starts.
struct TokenConfig {
  std::string name;   // who holds it, for logs and errors: [A-Za-z0-9_.-]{1,64}, unique per ns
  std::string file;   // path of a file holding the token (exactly one of file, env)
  std::string env;    // name of an environment variable holding the token
  TokenAccess access = TokenAccess::kReadWrite;  // read_only: Lookup/Get/Stats, no Put/Delete
  std::string scope;  // with private_prefixes: tokens of one scope share blocks ("" = name)
};

struct NamespaceConfig {
  std::string name;  // [A-Za-z0-9_.-]{1,64}
  // Calls must present one of these tokens; none configured = an open namespace.
  std::vector<TokenConfig> tokens;
  // Blocks are visible only to tokens of the scope that stored them, so one token holder cannot
  // learn from a hit (a fast prefill) that another sent the same prefix. Needs tokens.
  bool private_prefixes = false;
};

struct UcxConfig {
  bool enabled = true;          // serve the UCX data plane
  uint32_t max_sessions = 1024;  // UCX sessions (endpoints to clients) open at once
};

struct DaemonConfig {
  ServerConfig server;
  HostTierConfig host_tier;
  uint32_t index_shards = 64;  // block index shards (power of two); more shards, less contention
  std::vector<NamespaceConfig> namespaces = {{"default"}};
  std::string log_level = "info";  // debug | info | warning | error
  UcxConfig ucx;
};

// The documented default configuration, as YAML. Loading it gives DaemonConfig{}.
absl::string_view DefaultConfigYaml();

// Parses `yaml_text`, applies `overrides` ("dotted.key=value", value in YAML syntax, e.g.
// "tiers.host.capacity_bytes=4GiB" or "namespaces=[{name: a}, {name: b}]") and validates the
// result. `source` names the text in error messages (a file path, or "<default>").
absl::StatusOr<DaemonConfig> ParseConfig(absl::string_view yaml_text, absl::string_view source,
                                         absl::Span<const std::string> overrides);

// Reads and parses the file at `path` (see ParseConfig).
absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path,
                                            absl::Span<const std::string> overrides);

// Parses a byte size: a plain integer, or a number with a unit B, KiB, MiB, GiB, TiB (powers of
// 1024) or KB, MB, GB, TB (powers of 1000). Fractions are allowed with a unit ("1.5GiB").
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// Renders `config` back as YAML (what the daemon runs with; proximad --print_config).
std::string ConfigToYaml(const DaemonConfig& config);

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_CONFIG_H_
