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
#include "kernels/codec.h"

namespace proxima::daemon {

// TLS for gRPC over TCP (the Unix socket is protected by its file mode instead). Files are PEM;
// they are read and checked when the daemon starts (daemon/security.h), not while parsing.
struct TlsConfig {
  std::string cert_file;       // server certificate chain; "" = plaintext TCP
  std::string key_file;        // its private key (unencrypted PEM)
  std::string client_ca_file;  // CA bundle; set = mTLS: clients must present a cert it signed
  // How often the files above (and cluster.tls's) are read again: a certificate renewed in place
  // is in force from the next read, without a restart.
  double reload_interval_seconds = 60;
  bool enabled() const { return !cert_file.empty(); }
};

struct ServerConfig {
  std::string listen = "127.0.0.1:50051";  // host:port for gRPC over TCP; "" disables; port 0 picks
  std::string unix_socket = "/run/proxima/proximad.sock";  // gRPC over a Unix socket; "" disables
  uint32_t unix_socket_mode = 0660;                // file mode of the socket (octal in YAML: 0660)
  uint64_t unix_socket_send_buffer = 4ull << 20;  // SO_SNDBUF of each Unix-socket connection;
                                                  // 0 = the kernel's default
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
  uint32_t decode_threads = 4;      // threads one Get or Decompress decodes stored blocks with
  // Decoded-block buffers kept for the next Get once a response is sent (daemon/buffer_cache.h).
  uint64_t decode_buffer_cache_bytes = 128ull << 20;
};

// Whether the host tier's arena is page-locked and registered with CUDA at start.
enum class PinForGpu {
  kAuto,  // when a GPU is visible; otherwise logged and left unpinned
  kOn,    // always; a daemon that cannot pin does not start
  kOff,   // never
};

struct HostTierConfig {
  uint64_t capacity_bytes = 1ull << 30;  // hard limit on bytes of stored blocks
  PinForGpu pin_for_gpu = PinForGpu::kAuto;
  // Warm restart (daemon/snapshot.h): on SIGTERM the tier's blocks are written to this file,
  // hottest first, for at most `snapshot_seconds`; the next start loads them back and removes
  // the file. "" (the default) turns it off. Refused with cluster.enabled (docs/decisions.md).
  std::string snapshot_file;
  double snapshot_seconds = 20;
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

// A namespace's compression policy (docs/configuration.md, "Compression per namespace"). The
// keys keep DESIGN.md section 4's shape; `levels` is the hierarchy the tierer walks down, as
// codec plan strings (kernels/codec.h ParseCodecPlan), safest first. When `levels` is not given
// it is derived from `strategy`, `quantization`, `star_kv`, `per_layer` and `first_block`.
struct CompressionConfig {
  bool enabled = false;                // off: blocks stay raw, the coldest are evicted
  std::string strategy = "hybrid";     // none | quantize | star | hybrid
  std::vector<std::string> levels;     // explicit hierarchy (plan strings); empty: derived
  std::string per_layer;               // "layers[0:2]=int8,...": prepended to derived levels
  std::string first_block = "int8";    // codec floor for a sequence's first block ("" = none)
  uint32_t k_bits = 8;                 // quantization.k_bits: 8, 4 or 2
  uint32_t v_bits = 8;                 // quantization.v_bits: must equal k_bits
  uint32_t group_size = 64;            // quantization.group_size: 32, 64 or 128 (int4/int2)
  uint32_t hierarchy_levels = 2;       // star_kv.hierarchy_levels: derived levels, 1..3
  double memory_pressure_threshold = 0.8;  // trigger: compress when tier use / capacity exceeds
  uint64_t min_seq_len_to_compress = 0;    // trigger: tokens a sequence needs up to a block
  double max_attention_error = 0.12;   // quality.max_attention_error: budget (relative L2)
  uint32_t sample_one_in = 64;         // quality.sample_one_in: encodings measured, 1 in N
  uint32_t high_priority_max_level = 1;  // priority.high_max_level: deepest level, high puts

  // The resolved hierarchy, `levels` parsed (or derived), safest first. Empty when disabled.
  std::vector<codec::CodecPlan> plans;
};

struct NamespaceConfig {
  std::string name;  // [A-Za-z0-9_.-]{1,64}
  // Calls must present one of these tokens; none configured = an open namespace.
  std::vector<TokenConfig> tokens;
  // Blocks are visible only to tokens of the scope that stored them, so one token holder cannot
  // learn from a hit (a fast prefill) that another sent the same prefix. Needs tokens.
  bool private_prefixes = false;
  // The most bytes the namespace's blocks may take in the tiers together (what
  // proxima_namespace_bytes counts: stored bytes, encoded ones at their encoded size); 0: no
  // limit of its own, only the tiers' capacity. A put that would pass it makes room among the
  // namespace's own blocks (compressing, then evicting its least recently used), never
  // another namespace's.
  uint64_t max_bytes = 0;
  CompressionConfig compression;
};

// The tierer: the background worker that keeps tiers under their pressure thresholds.
struct TiererConfig {
  // Which block is coldest: "slru" (segmented LRU, block_store.h) or "lru".
  std::string temperature_policy = "slru";
  double protected_share = 0.2;    // slru: share of a tier's bytes the protected segment holds
  uint32_t threads = 1;            // encoder threads of the background worker
  double interval_seconds = 0.01;  // how often it checks the pressure when idle
};

// The GPU tier: one device-memory pool per visible GPU; absent without a GPU.
struct GpuTierConfig {
  uint64_t capacity_bytes_per_device = 0;  // 0 disables the GPU tier
  // Above this share of a pool's capacity, the tierer moves the pool's coldest blocks down to the
  // host tier in the background (puts that find a pool full move them at once).
  double pressure_threshold = 0.8;
};

struct UcxConfig {
  bool enabled = true;          // serve the UCX data plane
  uint32_t max_sessions = 1024;  // UCX sessions (endpoints to clients) open at once
  // Threads that help a call copy its blocks over shared memory (common/copy_pool.h); -1 is
  // "auto" (one fewer than the cores, at most 3).
  int copy_threads = -1;
  // Most bytes of found blocks pinned for GetUcx rendezvous messages their clients have not taken
  // yet, over all sessions (UcxTransport); a get that would pass it sends eager. 0: every get
  // eager.
  uint64_t rendezvous_get_max_bytes = uint64_t{1} << 30;
  // Whether a child process parses each new worker address of a client (ConnectUcx)
  // before the daemon's UCX does (common/ucx_address_check.h). Off only where proximad cannot run
  // itself, e.g. under an emulator; UCX then aborts the daemon on some lying addresses.
  bool check_worker_addresses = true;
};

// TLS of the calls this daemon makes to its cluster peers (cluster.tls). Peers are reached at
// their server.listen, so TLS to them is on exactly when this daemon's own server.tls is (every
// daemon of a cluster runs one configuration). ParseConfig resolves the defaults: with the cluster
// and server.tls on, ca_file, cert_file and key_file are never empty; otherwise all fields are.
// Files are read and checked when the daemon starts (daemon/cluster/membership.h).
struct PeerTlsConfig {
  std::string ca_file;      // CA bundle the peers' server certificates must chain to
                            // ("" in YAML = server.tls.client_ca_file)
  std::string cert_file;    // client certificate presented to peers ("" = server.tls.cert_file)
  std::string key_file;     // its private key ("" = server.tls.key_file)
  std::string server_name;  // name checked in peers' certificates ("" = the peer's host)
  bool enabled() const { return !ca_file.empty(); }
};

// The cluster: daemons on many nodes sharing their tiers (docs/cluster.md). Off by default; with
// it off nothing of it runs and every call is served from the local tiers alone.
struct ClusterConfig {
  bool enabled = false;
  // host:port peers use to reach this daemon's gRPC server; its node id for placement, so it
  // must be unique in the cluster and spelled as the other daemons' peers lists (or DNS) spell it.
  std::string advertise;
  std::vector<std::string> peers;  // static host:port list; may include this daemon's advertise
  std::string dns_name;            // headless Service name: every A/AAAA record is a peer
  uint32_t dns_port = 50051;       // port of the peers found through dns_name
  double dns_refresh_seconds = 10;      // how often dns_name is resolved again
  double health_interval_seconds = 1;   // how often every peer is health-checked
  double health_timeout_seconds = 0.5;  // deadline of one health check
  uint32_t failures_before_down = 3;    // consecutive failed checks before a peer leaves
  double peer_deadline_seconds = 2;     // budget of a call's remote work (every peer call)
  // The bearer token daemons present to each other: read from a file or an environment
  // variable (exactly one), never written in the config. Required when enabled.
  std::string peer_token_file;
  std::string peer_token_env;
  PeerTlsConfig tls;  // how this daemon calls its peers when server.tls is set
  // How fetched and spilled block bytes move between daemons: "auto" (the default: as UCX
  // messages when this daemon runs the UCX data plane, ucx.enabled, without server.tls, and the
  // other daemon can reach it; inline otherwise), "grpc" (always inline in the gRPC messages) or
  // "ucx" (UCX also with server.tls: UCX does not encrypt, for a trusted data network).
  std::string transport = "auto";
  // Spill (docs/cluster.md): while the host tier is fuller than `spill_threshold` (a share of
  // its capacity), its coldest blocks move to peers; a peer keeps them only while it stays at
  // or below `spill_accept_below`. A block goes to the first of its key's `spill_candidates`
  // best rendezvous nodes (other than this one) that has room. A put that finds the host tier
  // full (nothing left to compress) waits up to `spill_put_wait_seconds` for a spill round to
  // move cold blocks to peers before it evicts any; 0 = puts never wait (they evict at once,
  // and a burst faster than the spiller evicts blocks a peer had room for).
  // A node that shuts down (SIGTERM) spends up to `spill_handoff_seconds`, once its calls have
  // finished, sending its blocks to peers with room, most recently used first, so that they
  // outlive it (a rolling upgrade, a drain); 0 = it leaves them behind. With
  // `spill_handoff_evicts`, this node makes room for a peer's hand-off by evicting its own least
  // recently used blocks (as for a local put); without, it keeps them only below
  // `spill_accept_below`.
  bool spill_enabled = true;
  double spill_threshold = 0.9;
  double spill_accept_below = 0.75;
  uint32_t spill_candidates = 3;
  double spill_put_wait_seconds = 0.5;
  double spill_handoff_seconds = 10;
  bool spill_handoff_evicts = true;
};

struct DaemonConfig {
  ServerConfig server;
  HostTierConfig host_tier;
  GpuTierConfig gpu_tier;
  TiererConfig tierer;
  uint32_t index_shards = 64;  // block index shards (power of two); more shards, less contention
  std::vector<NamespaceConfig> namespaces = {{"default"}};
  std::string log_level = "info";  // debug | info | warning | error
  UcxConfig ucx;
  ClusterConfig cluster;
};

// "auto", "on" or "off", as the config spells it.
std::string PinForGpuName(PinForGpu mode);

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

// Resolves a namespace's compression policy: validates it and fills `compression->plans`.
// `path` names it in errors (e.g. "namespaces[0].compression"). ParseConfig calls it.
absl::Status ResolveCompressionLevels(absl::string_view source, absl::string_view path,
                                      CompressionConfig* compression);

// Renders `config` back as YAML (what the daemon runs with; proximad --print_config).
std::string ConfigToYaml(const DaemonConfig& config);

// The keys whose values differ between `a` and `b`, named as the config's errors name them
// ("server.listen", "namespaces[1].max_bytes"), in ConfigToYaml's order: each differing leaf
// once, and a list whose length differs as one key ("namespaces"). Empty when they are equal.
std::vector<std::string> ConfigDifferences(const DaemonConfig& a, const DaemonConfig& b);

// Settings that are valid but will not do what they appear to ask, one sentence each naming the
// keys (e.g. a k4v3 level under a quality budget its own error exceeds, so the guard would step
// every encoding back). proximad logs them at start and --check_config prints them.
std::vector<std::string> ConfigWarnings(const DaemonConfig& config);

// k4v3's attention-output error on real KV (relative L2, docs/quality.md): about 0.20.
inline constexpr double kK4v3TypicalAttentionError = 0.2;

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_CONFIG_H_
