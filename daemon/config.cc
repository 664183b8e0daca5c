#include "daemon/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/status_macros.h"

namespace proxima::daemon {
namespace {

constexpr absl::string_view kDefaultYaml =
    R"(# proximad configuration. Every key is optional; these are the defaults.
server:
  listen: "127.0.0.1:50051"        # gRPC over TCP, host:port ("" disables, port 0 picks one)
  unix_socket: "/run/proxima/proximad.sock"  # gRPC over a Unix socket ("" disables)
  unix_socket_mode: "0660"         # file mode of the socket, octal
  unix_socket_send_buffer: 4MiB    # send buffer of each Unix-socket connection (0: kernel default)
  metrics_listen: "127.0.0.1:9464" # Prometheus text endpoint, GET /metrics ("" disables)
  max_message_bytes: 64MiB         # largest gRPC request or response
  max_batch_blocks: 256            # most blocks per Put, Get or Delete
  max_lookup_keys: 16384           # most keys per Lookup
  max_profiles_per_namespace: 64   # model profiles one namespace may register
  shutdown_grace_seconds: 10       # on SIGTERM, time in-flight calls get to finish
  max_inflight_bytes_per_client: 256MiB  # request + response bytes one peer may hold at once
  max_connections: 1024            # client connections with calls running at once
  decode_threads: 4                # threads one Get or Decompress decodes compressed blocks with
  decode_buffer_cache_bytes: 128MiB  # decoded-block buffers kept for reuse by later Gets (0: none)
  tls:                             # TLS for server.listen (PEM files; "" = plaintext TCP)
    cert_file: ""                  # server certificate chain
    key_file: ""                   # its private key
    client_ca_file: ""             # set: mTLS, clients need a certificate signed by this CA
    reload_interval: 60s           # how often these files (and cluster.tls's) are read again
tiers:
  host:
    capacity_bytes: 1GiB           # hard limit on stored block bytes in host memory
    pin_for_gpu: auto              # page-lock the arena for GPU copies: auto (if a GPU), on, off
    snapshot_file: ""              # warm restart: blocks written here on SIGTERM, loaded at start
    snapshot_seconds: 20s          # most time SIGTERM spends writing the snapshot (hottest first)
  gpu:
    capacity_bytes_per_device: 0   # device pool per visible GPU; 0 disables the GPU tier
    pressure_threshold: 0.8        # above it, a pool's coldest blocks move down to the host tier
tierer:
  temperature_policy: slru         # which block is coldest: slru (segmented LRU) or lru
  protected_share: 0.2             # slru: share of the tier that blocks used twice may hold
  threads: 1                       # encoder threads of the background tierer
  interval_seconds: 0.01           # how often the tierer checks tier pressure when idle
index:
  shards: 64                       # block index shards, a power of two in [1, 4096]
namespaces:                        # tenants; a call naming another namespace gets NOT_FOUND
  - name: default
    # tokens:                      # bearer tokens; none = an open namespace (docs/security.md)
    #   - {name: worker, file: /etc/proxima/tokens/default, access: read_write}
    #   - {name: reader, env: PROXIMA_TOKEN_READER, access: read_only}
    # private_prefixes: false      # true: a token sees only blocks stored with its own scope
    # max_bytes: 0                 # most bytes of blocks this namespace may hold; 0 = no limit
    compression:                   # what the tierer does with this namespace's cold blocks
      enabled: false               # off: blocks stay raw and the coldest are evicted
      strategy: hybrid             # none | quantize | star | hybrid (derives `levels`)
      levels: []                   # explicit hierarchy of codec plans, safest first
      per_layer: ""                # layer ranges prepended to derived levels, e.g. layers[0:2]=int8
      first_block: int8            # codec floor for a sequence's first block ("" = none)
      quantization: {k_bits: 8, v_bits: 8, per_channel: true, group_size: 64}
      star_kv: {cluster_size: 16, hierarchy_levels: 2}
      trigger: {memory_pressure_threshold: 0.8, min_seq_len_to_compress: 0}
      quality: {max_attention_error: 0.12, sample_one_in: 64}
      priority: {high_max_level: 1} # deepest level a high-priority put's blocks go to
log:
  level: info                      # debug | info | warning | error
ucx:
  enabled: true                    # serve the UCX data plane (ConnectUcx, PutUcx, GetUcx)
  max_sessions: 1024               # UCX sessions (client endpoints) open at once
  copy_threads: auto               # helpers of a shared-memory call's copy: auto | 0-64
  rendezvous_get_max_bytes: 1GiB   # blocks pinned for rendezvous gets not yet taken; 0: eager
  check_worker_addresses: true     # a child process parses each new client's or peer's
                                   # worker address first (UCX aborts on some lying ones);
                                   # docs/security.md
cluster:                           # daemons of many nodes sharing their tiers (docs/cluster.md)
  enabled: false                   # off: this daemon serves from its own tiers only
  advertise: ""                    # host:port peers reach this daemon at; its unique node id
  peers: []                        # static peers, host:port (may include advertise)
  dns_name: ""                     # headless Service: every A/AAAA record is a peer
  dns_port: 50051                  # gRPC port of the peers found through dns_name
  dns_refresh: 10s                 # how often dns_name is resolved again
  health_interval: 1s              # how often each peer is health-checked (gRPC health)
  health_timeout: 500ms            # deadline of one health check
  failures_before_down: 3          # consecutive failed checks before a peer leaves the live set
  peer_deadline: 2s                # budget of the remote part of any call (every peer call)
  peer_token: {}                   # {file: PATH} or {env: VAR}: the token daemons present
                                   # to each other; required when enabled (docs/security.md)
  tls:                             # calls to peers, TLS when server.tls is set (else unused)
    ca_file: ""                    # CA of the peers' server certs; "" = server.tls.client_ca_file
    cert_file: ""                  # client cert presented to peers; "" = server.tls.cert_file
    key_file: ""                   # its private key; "" = server.tls.key_file
    server_name: ""                # name checked in peers' certs; "" = the peer address's host
  transport: auto                  # fetched and spilled block bytes between daemons: auto
                                   # (UCX messages when ucx.enabled and no server.tls) | grpc
                                   # | ucx (also with TLS)
  spill:                           # cold blocks move to peers with room when this node is full
    enabled: true
    threshold: 0.9                 # spill the coldest blocks while the host tier is fuller
    accept_below: 0.75             # keep peers' spilled blocks only up to this fill
    candidates: 3                  # a block goes to the first of its key's N best nodes with room
    put_wait: 500ms                # a put into a full tier waits this long at most for a spill
                                   # round before it evicts; 0 = evict at once
    handoff: 10s                   # at shutdown, after the drain, send blocks to peers with
                                   # room for up to this long, hottest first; 0 = off
)";

// Walks a YAML tree and produces errors that name the full dotted key.
class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  absl::Status Error(absl::string_view key, absl::string_view value, absl::string_view expected) {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": config key '", key,
                                                   "' has value '", value, "'; expected ",
                                                   expected));
  }

  // Fails on keys of `node` (a map, or absent) that are not in `allowed`.
  absl::Status CheckKeys(const YAML::Node& node, absl::string_view path,
                         std::initializer_list<absl::string_view> allowed) {
    if (!node || node.IsNull()) return absl::OkStatus();
    if (!node.IsMap()) return Error(path, Dump(node), "a mapping of keys to values");
    for (const auto& item : node) {
      if (!item.first.IsScalar()) {  // a complex key ("? [a, b]"), or null ("? " alone)
        return absl::InvalidArgumentError(absl::StrCat(
            source_, ": a key under '", path.empty() ? "<top level>" : std::string(path),
            "' is ", Dump(item.first), "; expected a plain name, one of: ",
            absl::StrJoin(allowed, ", ")));
      }
      std::string key = item.first.Scalar();
      bool known = false;
      for (absl::string_view a : allowed) known |= (a == key);
      if (!known) {
        return absl::InvalidArgumentError(
            absl::StrCat(source_, ": config key '", Join(path, key), "' is unknown; allowed keys",
                         path.empty() ? "" : absl::StrCat(" under '", path, "'"), ": ",
                         absl::StrJoin(allowed, ", ")));
      }
    }
    return absl::OkStatus();
  }

  absl::Status String(const YAML::Node& node, absl::string_view key, std::string* out) {
    if (!node) return absl::OkStatus();
    if (node.IsNull()) {  // "key:" with no value, or "~"
      out->clear();
      return absl::OkStatus();
    }
    if (!node.IsScalar()) return Error(key, Dump(node), "a string");
    *out = node.as<std::string>();
    return absl::OkStatus();
  }

  absl::Status Uint(const YAML::Node& node, absl::string_view key, uint64_t min, uint64_t max,
                    uint64_t* out) {
    if (!node) return absl::OkStatus();
    uint64_t v = 0;
    if (!node.IsScalar() || !absl::SimpleAtoi(node.Scalar(), &v) || v < min || v > max) {
      return Error(key, Dump(node), absl::StrCat("an integer in [", min, ", ", max, "]"));
    }
    *out = v;
    return absl::OkStatus();
  }

  absl::Status Size(const YAML::Node& node, absl::string_view key, uint64_t min, uint64_t max,
                    uint64_t* out) {
    if (!node) return absl::OkStatus();
    std::string text = node.IsScalar() ? node.Scalar() : Dump(node);
    absl::StatusOr<uint64_t> v = ParseByteSize(text);
    if (!node.IsScalar() || !v.ok() || *v < min || *v > max) {
      return Error(key, text,
                   absl::StrCat("a size such as 1073741824, 512MiB or 4GiB, in [", min, ", ", max,
                                "] bytes"));
    }
    *out = *v;
    return absl::OkStatus();
  }

  absl::Status Double(const YAML::Node& node, absl::string_view key, double min, double max,
                      double* out) {
    if (!node) return absl::OkStatus();
    double v = 0;
    if (!node.IsScalar() || !absl::SimpleAtod(node.Scalar(), &v) || !(v >= min && v <= max)) {
      return Error(key, Dump(node), absl::StrCat("a number in [", min, ", ", max, "]"));
    }
    *out = v;
    return absl::OkStatus();
  }

  absl::Status Bool(const YAML::Node& node, absl::string_view key, bool* out) {
    if (!node) return absl::OkStatus();
    if (node.IsScalar() && (node.Scalar() == "true" || node.Scalar() == "false")) {
      *out = node.Scalar() == "true";
      return absl::OkStatus();
    }
    return Error(key, Dump(node), "true or false");
  }

  const std::string& source() const { return source_; }

  static std::string Join(absl::string_view path, absl::string_view key) {
    return path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
  }

  static std::string Dump(const YAML::Node& node) {
    if (node.IsScalar()) return node.Scalar();
    YAML::Emitter e;
    e << YAML::Flow << node;
    return e.c_str();
  }

 private:
  std::string source_;
};

bool ValidHostPort(absl::string_view text) {
  size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return false;
  uint32_t port = 0;
  return absl::SimpleAtoi(text.substr(colon + 1), &port) && port <= 65535;
}

bool ValidNamespaceName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.') {
      return false;
    }
  }
  return true;
}

absl::Status ApplyOverride(YAML::Node root, const std::string& override_text) {
  size_t eq = override_text.find('=');
  if (eq == std::string::npos || eq == 0) {
    return absl::InvalidArgumentError(absl::StrCat("override '", override_text,
                                                   "' is not of the form dotted.key=value"));
  }
  std::vector<std::string> parts = absl::StrSplit(override_text.substr(0, eq), '.');
  YAML::Node value;
  try {
    // "--set key=" means the empty string (YAML would read it as null).
    std::string text = override_text.substr(eq + 1);
    value = text.empty() ? YAML::Node(std::string()) : YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("override '", override_text, "': value is not valid YAML: ", e.msg));
  }
  // yaml-cpp nodes are handles: walking with operator[] on a copy descends in place.
  std::vector<YAML::Node> chain = {root};
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node next = chain.back()[parts[i]];
    if (next && !next.IsMap() && !next.IsNull()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "override '", override_text, "': '", parts[i], "' is not a mapping in the config"));
    }
    chain.push_back(next);
  }
  chain.back()[parts.back()] = value;
  return absl::OkStatus();
}

absl::Status Duration(Reader& r, const YAML::Node& node, absl::string_view key, double min,
                      double max, double* out);

absl::Status ParseTls(Reader& r, const YAML::Node& node, TlsConfig* tls) {
  PROXIMA_RETURN_IF_ERROR(r.CheckKeys(
      node, "server.tls", {"cert_file", "key_file", "client_ca_file", "reload_interval"}));
  if (!node || !node.IsMap()) return absl::OkStatus();
  PROXIMA_RETURN_IF_ERROR(Duration(r, node["reload_interval"], "server.tls.reload_interval", 1,
                                   86400, &tls->reload_interval_seconds));
  PROXIMA_RETURN_IF_ERROR(r.String(node["cert_file"], "server.tls.cert_file", &tls->cert_file));
  PROXIMA_RETURN_IF_ERROR(r.String(node["key_file"], "server.tls.key_file", &tls->key_file));
  PROXIMA_RETURN_IF_ERROR(
      r.String(node["client_ca_file"], "server.tls.client_ca_file", &tls->client_ca_file));
  if (tls->cert_file.empty() != tls->key_file.empty()) {
    return tls->cert_file.empty()
               ? r.Error("server.tls.cert_file", "",
                         "a certificate file, since server.tls.key_file is set")
               : r.Error("server.tls.key_file", "",
                         "a private key file, since server.tls.cert_file is set");
  }
  if (!tls->client_ca_file.empty() && tls->cert_file.empty()) {
    return r.Error("server.tls.cert_file", "",
                   "a certificate file, since server.tls.client_ca_file (mTLS) is set");
  }
  return absl::OkStatus();
}

absl::Status ParseTokens(Reader& r, const YAML::Node& node, const std::string& ns_path,
                         std::vector<TokenConfig>* tokens) {
  if (!node || node.IsNull()) return absl::OkStatus();
  const std::string key = ns_path + ".tokens";
  if (!node.IsSequence()) {
    return r.Error(key, Reader::Dump(node), "a list such as [{name: worker, file: /path}]");
  }
  absl::flat_hash_set<std::string> names;
  for (size_t i = 0; i < node.size(); ++i) {
    const std::string path = absl::StrCat(key, "[", i, "]");
    const YAML::Node t = node[i];
    PROXIMA_RETURN_IF_ERROR(r.CheckKeys(t, path, {"name", "file", "env", "access", "scope"}));
    if (!t.IsMap()) return r.Error(path, Reader::Dump(t), "a mapping {name, file | env, access}");
    TokenConfig token;
    PROXIMA_RETURN_IF_ERROR(r.String(t["name"], path + ".name", &token.name));
    if (!ValidNamespaceName(token.name)) {
      return r.Error(path + ".name", token.name, "a token name of 1-64 characters [A-Za-z0-9_.-]");
    }
    if (!names.insert(token.name).second) {
      return r.Error(path + ".name", token.name, "a name not used by an earlier token");
    }
    PROXIMA_RETURN_IF_ERROR(r.String(t["file"], path + ".file", &token.file));
    PROXIMA_RETURN_IF_ERROR(r.String(t["env"], path + ".env", &token.env));
    if (token.file.empty() == token.env.empty()) {
      return r.Error(path, Reader::Dump(t),
                     "exactly one of 'file' (a path) or 'env' (a variable name); tokens are "
                     "never written in the config itself");
    }
    std::string access = "read_write";
    PROXIMA_RETURN_IF_ERROR(r.String(t["access"], path + ".access", &access));
    if (access == "read_write") {
      token.access = TokenAccess::kReadWrite;
    } else if (access == "read_only") {
      token.access = TokenAccess::kReadOnly;
    } else {
      return r.Error(path + ".access", access, "read_write or read_only");
    }
    PROXIMA_RETURN_IF_ERROR(r.String(t["scope"], path + ".scope", &token.scope));
    if (!token.scope.empty() && !ValidNamespaceName(token.scope)) {
      return r.Error(path + ".scope", token.scope, "a scope of 1-64 characters [A-Za-z0-9_.-]");
    }
    tokens->push_back(std::move(token));
  }
  return absl::OkStatus();
}

absl::Status Uint32(Reader& r, const YAML::Node& node, absl::string_view key, uint32_t min,
                    uint32_t max, uint32_t* out) {
  uint64_t v = *out;
  PROXIMA_RETURN_IF_ERROR(r.Uint(node, key, min, max, &v));
  *out = static_cast<uint32_t>(v);
  return absl::OkStatus();
}

absl::Status ParseGpuTier(Reader& r, const YAML::Node& gpu, GpuTierConfig* out) {
  PROXIMA_RETURN_IF_ERROR(
      r.CheckKeys(gpu, "tiers.gpu", {"capacity_bytes_per_device", "pressure_threshold"}));
  if (!gpu || !gpu.IsMap()) return absl::OkStatus();
  PROXIMA_RETURN_IF_ERROR(r.Double(gpu["pressure_threshold"], "tiers.gpu.pressure_threshold", 0.1,
                                   1.0, &out->pressure_threshold));
  const YAML::Node n = gpu["capacity_bytes_per_device"];
  if (n && n.IsScalar() && n.Scalar() == "0") {
    out->capacity_bytes_per_device = 0;
    return absl::OkStatus();
  }
  return r.Size(n, "tiers.gpu.capacity_bytes_per_device", 1 << 20, 1ull << 50,
                &out->capacity_bytes_per_device);
}

absl::Status ParseTierer(Reader& r, const YAML::Node& t, TiererConfig* out) {
  PROXIMA_RETURN_IF_ERROR(r.CheckKeys(
      t, "tierer", {"temperature_policy", "protected_share", "threads", "interval_seconds"}));
  if (!t || !t.IsMap()) return absl::OkStatus();
  PROXIMA_RETURN_IF_ERROR(
      r.String(t["temperature_policy"], "tierer.temperature_policy", &out->temperature_policy));
  if (out->temperature_policy != "slru" && out->temperature_policy != "lru") {
    return r.Error("tierer.temperature_policy", out->temperature_policy,
                   "slru or lru (docs/decisions.md compares them on the Mooncake trace)");
  }
  PROXIMA_RETURN_IF_ERROR(
      r.Double(t["protected_share"], "tierer.protected_share", 0.01, 0.9, &out->protected_share));
  PROXIMA_RETURN_IF_ERROR(Uint32(r, t["threads"], "tierer.threads", 1, 64, &out->threads));
  return r.Double(t["interval_seconds"], "tierer.interval_seconds", 0.001, 10,
                  &out->interval_seconds);
}

absl::Status ParseCompression(Reader& r, const YAML::Node& node, const std::string& path,
                              CompressionConfig* c) {
  PROXIMA_RETURN_IF_ERROR(r.CheckKeys(
      node, path,
      {"enabled", "strategy", "levels", "per_layer", "first_block", "quantization",
       "sparsification", "star_kv", "trigger", "quality", "priority"}));
  auto key = [&](absl::string_view k) { return absl::StrCat(path, ".", k); };
  if (node && node.IsMap()) {
    PROXIMA_RETURN_IF_ERROR(r.Bool(node["enabled"], key("enabled"), &c->enabled));
    PROXIMA_RETURN_IF_ERROR(r.String(node["strategy"], key("strategy"), &c->strategy));
    if (const YAML::Node levels = node["levels"]) {
      if (!levels.IsSequence()) {
        return r.Error(key("levels"), Reader::Dump(levels),
                       "a list of codec plans such as [int8, \"layers[0:2]=int8,default=int4\"]");
      }
      c->levels.clear();
      for (size_t i = 0; i < levels.size(); ++i) {
        std::string item;
        PROXIMA_RETURN_IF_ERROR(
            r.String(levels[i], absl::StrCat(path, ".levels[", i, "]"), &item));
        c->levels.push_back(std::move(item));
      }
    }
    PROXIMA_RETURN_IF_ERROR(r.String(node["per_layer"], key("per_layer"), &c->per_layer));
    PROXIMA_RETURN_IF_ERROR(r.String(node["first_block"], key("first_block"), &c->first_block));

    const YAML::Node q = node["quantization"];
    const std::string qp = key("quantization");
    PROXIMA_RETURN_IF_ERROR(r.CheckKeys(q, qp, {"k_bits", "v_bits", "per_channel", "group_size"}));
    if (q && q.IsMap()) {
      for (auto [name, field] : {std::pair{"k_bits", &c->k_bits}, std::pair{"v_bits", &c->v_bits}}) {
        PROXIMA_RETURN_IF_ERROR(Uint32(r, q[name], absl::StrCat(qp, ".", name), 2, 8, field));
        if (*field != 8 && *field != 4 && *field != 2) {
          return r.Error(absl::StrCat(qp, ".", name), absl::StrCat(*field), "8, 4 or 2");
        }
      }
      if (c->k_bits != c->v_bits) {
        return r.Error(qp + ".v_bits", absl::StrCat(c->v_bits),
                       absl::StrCat("the same as k_bits (", c->k_bits,
                                    "): a codec level applies to K and V of a layer alike"));
      }
      bool per_channel = true;
      PROXIMA_RETURN_IF_ERROR(r.Bool(q["per_channel"], qp + ".per_channel", &per_channel));
      if (!per_channel) {
        return r.Error(qp + ".per_channel", "false",
                       "true (the codecs quantize K per channel; there is no per-token K mode)");
      }
      PROXIMA_RETURN_IF_ERROR(Uint32(r, q["group_size"], qp + ".group_size", 32, 128,
                                     &c->group_size));
      if (c->group_size != 32 && c->group_size != 64 && c->group_size != 128) {
        return r.Error(qp + ".group_size", absl::StrCat(c->group_size), "32, 64 or 128");
      }
    }

    const YAML::Node sp = node["sparsification"];
    PROXIMA_RETURN_IF_ERROR(r.CheckKeys(sp, key("sparsification"),
                                        {"keep_ratio", "importance_metric"}));
    if (sp && sp.IsMap() && sp.size() > 0) {
      return r.Error(key("sparsification"), Reader::Dump(sp),
                     "no value: token dropping is not implemented by the codec; the `star` codec "
                     "keeps every token (clustered), use strategy star or hybrid");
    }

    const YAML::Node star = node["star_kv"];
    const std::string sk = key("star_kv");
    PROXIMA_RETURN_IF_ERROR(r.CheckKeys(star, sk, {"cluster_size", "hierarchy_levels"}));
    if (star && star.IsMap()) {
      uint32_t cluster = 16;
      PROXIMA_RETURN_IF_ERROR(Uint32(r, star["cluster_size"], sk + ".cluster_size", 1, 1 << 20,
                                     &cluster));
      if (cluster != 16) {
        return r.Error(sk + ".cluster_size", absl::StrCat(cluster),
                       "16 (the star format fixes about 16 tokens per centroid, docs/format.md)");
      }
      PROXIMA_RETURN_IF_ERROR(Uint32(r, star["hierarchy_levels"], sk + ".hierarchy_levels", 1, 3,
                                     &c->hierarchy_levels));
    }

    const YAML::Node trig = node["trigger"];
    const std::string tp = key("trigger");
    PROXIMA_RETURN_IF_ERROR(
        r.CheckKeys(trig, tp, {"memory_pressure_threshold", "min_seq_len_to_compress"}));
    if (trig && trig.IsMap()) {
      PROXIMA_RETURN_IF_ERROR(r.Double(trig["memory_pressure_threshold"],
                                       tp + ".memory_pressure_threshold", 0.05, 1.0,
                                       &c->memory_pressure_threshold));
      PROXIMA_RETURN_IF_ERROR(r.Uint(trig["min_seq_len_to_compress"],
                                     tp + ".min_seq_len_to_compress", 0, 1u << 30,
                                     &c->min_seq_len_to_compress));
    }

    const YAML::Node qual = node["quality"];
    const std::string qlp = key("quality");
    PROXIMA_RETURN_IF_ERROR(r.CheckKeys(qual, qlp, {"max_attention_error", "sample_one_in"}));
    if (qual && qual.IsMap()) {
      PROXIMA_RETURN_IF_ERROR(r.Double(qual["max_attention_error"], qlp + ".max_attention_error",
                                       0, 10, &c->max_attention_error));
      PROXIMA_RETURN_IF_ERROR(Uint32(r, qual["sample_one_in"], qlp + ".sample_one_in", 1,
                                     1000000, &c->sample_one_in));
    }

    const YAML::Node prio = node["priority"];
    PROXIMA_RETURN_IF_ERROR(r.CheckKeys(prio, key("priority"), {"high_max_level"}));
    if (prio && prio.IsMap()) {
      PROXIMA_RETURN_IF_ERROR(Uint32(r, prio["high_max_level"], key("priority.high_max_level"), 0,
                                     16, &c->high_priority_max_level));
    }
  }
  return ResolveCompressionLevels(r.source(), path, c);
}

// The `ucx` section (UCX data plane).
absl::Status ParseUcxConfig(Reader& r, const YAML::Node& ucx, UcxConfig* out) {
  PROXIMA_RETURN_IF_ERROR(r.CheckKeys(ucx, "ucx",
                                      {"enabled", "max_sessions", "copy_threads",
                                       "rendezvous_get_max_bytes", "check_worker_addresses"}));
  if (!ucx || !ucx.IsMap()) return absl::OkStatus();
  if (const YAML::Node enabled = ucx["enabled"]) {
    const std::string text = enabled.IsScalar() ? enabled.Scalar() : Reader::Dump(enabled);
    if (text == "true") {
      out->enabled = true;
    } else if (text == "false") {
      out->enabled = false;
    } else {
      return r.Error("ucx.enabled", text, "true or false");
    }
  }
  uint64_t v = out->max_sessions;
  PROXIMA_RETURN_IF_ERROR(r.Uint(ucx["max_sessions"], "ucx.max_sessions", 1, 65536, &v));
  out->max_sessions = static_cast<uint32_t>(v);
  if (const YAML::Node threads = ucx["copy_threads"]) {
    if (threads.IsScalar() && threads.Scalar() == "auto") {
      out->copy_threads = -1;
    } else {
      uint64_t n = 0;
      const absl::Status st = r.Uint(threads, "ucx.copy_threads", 0, 64, &n);
      if (!st.ok()) {
        return r.Error("ucx.copy_threads",
                       threads.IsScalar() ? threads.Scalar() : Reader::Dump(threads),
                       "auto or a number of threads 0..64");
      }
      out->copy_threads = static_cast<int>(n);
    }
  }
  PROXIMA_RETURN_IF_ERROR(r.Size(ucx["rendezvous_get_max_bytes"], "ucx.rendezvous_get_max_bytes", 0,
                                 uint64_t{1} << 50, &out->rendezvous_get_max_bytes));
  PROXIMA_RETURN_IF_ERROR(r.Bool(ucx["check_worker_addresses"], "ucx.check_worker_addresses",
                                 &out->check_worker_addresses));
  return absl::OkStatus();
}

// A duration: "500ms", "2s", "1.5s", "1m" (absl::ParseDuration units) or a plain number of
// seconds, in [min, max] seconds.
absl::Status Duration(Reader& r, const YAML::Node& node, absl::string_view key, double min,
                      double max, double* out) {
  if (!node) return absl::OkStatus();
  const std::string text = node.IsScalar() ? node.Scalar() : Reader::Dump(node);
  double seconds = -1;
  absl::Duration d;
  if (!node.IsScalar()) {
    seconds = -1;
  } else if (absl::SimpleAtod(text, &seconds)) {
    // a plain number of seconds
  } else if (absl::ParseDuration(text, &d)) {
    seconds = absl::ToDoubleSeconds(d);
  } else {
    seconds = -1;
  }
  if (!(seconds >= min && seconds <= max)) {
    return r.Error(key, text,
                   absl::StrCat("a duration such as 500ms, 2s or 1m, in [", min, "s, ", max,
                                "s]"));
  }
  *out = seconds;
  return absl::OkStatus();
}

// `cluster.tls`: read always; the defaults are resolved (and the keys checked against
// server.tls) only when the cluster is on, by ResolvePeerTls.
absl::Status ParsePeerTls(Reader& r, const YAML::Node& node, PeerTlsConfig* out) {
  PROXIMA_RETURN_IF_ERROR(
      r.CheckKeys(node, "cluster.tls", {"ca_file", "cert_file", "key_file", "server_name"}));
  if (!node || !node.IsMap()) return absl::OkStatus();
  PROXIMA_RETURN_IF_ERROR(r.String(node["ca_file"], "cluster.tls.ca_file", &out->ca_file));
  PROXIMA_RETURN_IF_ERROR(r.String(node["cert_file"], "cluster.tls.cert_file", &out->cert_file));
  PROXIMA_RETURN_IF_ERROR(r.String(node["key_file"], "cluster.tls.key_file", &out->key_file));
  PROXIMA_RETURN_IF_ERROR(
      r.String(node["server_name"], "cluster.tls.server_name", &out->server_name));
  // A port would be "host:port" (one colon); an IPv6 address has several.
  if (out->server_name.size() > 253 ||
      out->server_name.find_first_of(" \t/@[]") != std::string::npos ||
      std::count(out->server_name.begin(), out->server_name.end(), ':') == 1) {
    return r.Error("cluster.tls.server_name", out->server_name,
                   "a DNS name or IP address that the peers' certificates carry (no port), "
                   "such as proxima.proxima-system.svc, or \"\"");
  }
  return absl::OkStatus();
}

// TLS to the peers is on exactly when server.tls is: the peers are called at their server.listen.
// Fills the defaults from server.tls; with server.tls off, every cluster.tls key must be empty.
absl::Status ResolvePeerTls(Reader& r, const TlsConfig& server, PeerTlsConfig* tls) {
  if (!server.enabled()) {
    for (const auto& [key, value] :
         {std::pair<const char*, const std::string*>{"cluster.tls.ca_file", &tls->ca_file},
          {"cluster.tls.cert_file", &tls->cert_file},
          {"cluster.tls.key_file", &tls->key_file},
          {"cluster.tls.server_name", &tls->server_name}}) {
      if (!value->empty()) {
        return r.Error(key, *value,
                       "\"\" while server.tls is not set: peers are called at their "
                       "server.listen, over TLS exactly when server.tls is set (docs/cluster.md)");
      }
    }
    return absl::OkStatus();
  }
  if (tls->cert_file.empty() != tls->key_file.empty()) {
    return tls->cert_file.empty()
               ? r.Error("cluster.tls.cert_file", "",
                         "a client certificate file, since cluster.tls.key_file is set (or "
                         "leave both empty to present server.tls.cert_file)")
               : r.Error("cluster.tls.key_file", "",
                         "a private key file, since cluster.tls.cert_file is set (or leave "
                         "both empty to use server.tls.key_file)");
  }
  if (tls->cert_file.empty()) {
    tls->cert_file = server.cert_file;
    tls->key_file = server.key_file;
  }
  if (tls->ca_file.empty()) tls->ca_file = server.client_ca_file;
  if (tls->ca_file.empty()) {
    return r.Error("cluster.tls.ca_file", "",
                   "a PEM CA bundle that signed the peers' server certificates, since "
                   "cluster.enabled and server.tls are set and its default, "
                   "server.tls.client_ca_file, is empty");
  }
  return absl::OkStatus();
}

// The `cluster` section.
absl::Status ParseCluster(Reader& r, const YAML::Node& node, const TlsConfig& tls,
                          ClusterConfig* out) {
  PROXIMA_RETURN_IF_ERROR(
      r.CheckKeys(node, "cluster",
                  {"enabled", "advertise", "peers", "dns_name", "dns_port", "dns_refresh",
                   "health_interval", "health_timeout", "failures_before_down", "peer_deadline",
                   "peer_token", "spill", "transport", "receive_pool_bytes", "tls"}));
  if (!node || !node.IsMap()) return absl::OkStatus();
  PROXIMA_RETURN_IF_ERROR(r.Bool(node["enabled"], "cluster.enabled", &out->enabled));
  PROXIMA_RETURN_IF_ERROR(r.String(node["advertise"], "cluster.advertise", &out->advertise));
  if (!out->advertise.empty() &&
      (!ValidHostPort(out->advertise) || absl::EndsWith(out->advertise, ":0"))) {
    return r.Error("cluster.advertise", out->advertise,
                   "host:port with a fixed port, such as 10.0.0.7:50051, or \"\"");
  }
  if (const YAML::Node peers = node["peers"]) {
    if (!peers.IsSequence() && !peers.IsNull()) {
      return r.Error("cluster.peers", Reader::Dump(peers),
                     "a list of host:port such as [\"10.0.0.7:50051\", \"10.0.0.8:50051\"]");
    }
    out->peers.clear();
    absl::flat_hash_set<std::string> seen;
    for (size_t i = 0; peers.IsSequence() && i < peers.size(); ++i) {
      const std::string key = absl::StrCat("cluster.peers[", i, "]");
      std::string peer;
      PROXIMA_RETURN_IF_ERROR(r.String(peers[i], key, &peer));
      if (!ValidHostPort(peer) || absl::EndsWith(peer, ":0")) {
        return r.Error(key, peer, "host:port with a fixed port, such as 10.0.0.7:50051");
      }
      if (!seen.insert(peer).second) {
        return r.Error(key, peer, "an address not listed earlier in cluster.peers");
      }
      out->peers.push_back(std::move(peer));
    }
  }
  PROXIMA_RETURN_IF_ERROR(r.String(node["dns_name"], "cluster.dns_name", &out->dns_name));
  if (out->dns_name.find_first_of(" :/") != std::string::npos) {
    return r.Error("cluster.dns_name", out->dns_name,
                   "a DNS name such as proxima.proxima-system.svc.cluster.local (no port: "
                   "cluster.dns_port), or \"\"");
  }
  PROXIMA_RETURN_IF_ERROR(Uint32(r, node["dns_port"], "cluster.dns_port", 1, 65535,
                                 &out->dns_port));
  PROXIMA_RETURN_IF_ERROR(Duration(r, node["dns_refresh"], "cluster.dns_refresh", 1, 3600,
                                   &out->dns_refresh_seconds));
  PROXIMA_RETURN_IF_ERROR(Duration(r, node["health_interval"], "cluster.health_interval", 0.01,
                                   600, &out->health_interval_seconds));
  PROXIMA_RETURN_IF_ERROR(Duration(r, node["health_timeout"], "cluster.health_timeout", 0.001,
                                   60, &out->health_timeout_seconds));
  if (out->health_timeout_seconds > out->health_interval_seconds) {
    return r.Error("cluster.health_timeout", absl::StrCat(out->health_timeout_seconds, "s"),
                   absl::StrCat("a duration no longer than cluster.health_interval (",
                                out->health_interval_seconds, "s)"));
  }
  PROXIMA_RETURN_IF_ERROR(Uint32(r, node["failures_before_down"], "cluster.failures_before_down",
                                 1, 100, &out->failures_before_down));
  PROXIMA_RETURN_IF_ERROR(Duration(r, node["peer_deadline"], "cluster.peer_deadline", 0.01, 60,
                                   &out->peer_deadline_seconds));
  if (const YAML::Node token = node["peer_token"]) {
    PROXIMA_RETURN_IF_ERROR(r.CheckKeys(token, "cluster.peer_token", {"file", "env"}));
    if (token.IsMap()) {
      PROXIMA_RETURN_IF_ERROR(
          r.String(token["file"], "cluster.peer_token.file", &out->peer_token_file));
      PROXIMA_RETURN_IF_ERROR(
          r.String(token["env"], "cluster.peer_token.env", &out->peer_token_env));
      if (!out->peer_token_file.empty() && !out->peer_token_env.empty()) {
        return r.Error("cluster.peer_token", Reader::Dump(token),
                       "exactly one of 'file' (a path) or 'env' (a variable name)");
      }
    }
  }
  PROXIMA_RETURN_IF_ERROR(ParsePeerTls(r, node["tls"], &out->tls));
  PROXIMA_RETURN_IF_ERROR(r.String(node["transport"], "cluster.transport", &out->transport));
  if (out->transport != "auto" && out->transport != "grpc" && out->transport != "ucx") {
    return r.Error("cluster.transport", out->transport,
                   "auto (UCX between daemons when ucx.enabled and no server.tls), grpc or ucx");
  }
  // receive_pool_bytes (registered receive buffers of one-sided UCX fetches) is accepted and
  // ignored, so that configs written for older versions still load.
  if (const YAML::Node spill = node["spill"]) {
    PROXIMA_RETURN_IF_ERROR(r.CheckKeys(spill, "cluster.spill",
                                        {"enabled", "threshold", "accept_below", "candidates",
                                         "put_wait", "handoff", "handoff_evicts"}));
    if (spill.IsMap()) {
      PROXIMA_RETURN_IF_ERROR(
          r.Bool(spill["enabled"], "cluster.spill.enabled", &out->spill_enabled));
      PROXIMA_RETURN_IF_ERROR(r.Double(spill["threshold"], "cluster.spill.threshold", 0.05, 1.0,
                                       &out->spill_threshold));
      PROXIMA_RETURN_IF_ERROR(r.Double(spill["accept_below"], "cluster.spill.accept_below", 0.0,
                                       1.0, &out->spill_accept_below));
      PROXIMA_RETURN_IF_ERROR(Uint32(r, spill["candidates"], "cluster.spill.candidates", 1, 64,
                                     &out->spill_candidates));
      PROXIMA_RETURN_IF_ERROR(Duration(r, spill["put_wait"], "cluster.spill.put_wait", 0, 60,
                                       &out->spill_put_wait_seconds));
      PROXIMA_RETURN_IF_ERROR(Duration(r, spill["handoff"], "cluster.spill.handoff", 0, 600,
                                       &out->spill_handoff_seconds));
      PROXIMA_RETURN_IF_ERROR(r.Bool(spill["handoff_evicts"], "cluster.spill.handoff_evicts",
                                     &out->spill_handoff_evicts));
    }
  }
  if (out->spill_accept_below >= out->spill_threshold) {
    // A node that kept blocks up to its own spill threshold would push its own blocks out to
    // make room for its peers'.
    return r.Error("cluster.spill.accept_below", absl::StrCat(out->spill_accept_below),
                   absl::StrCat("a share below cluster.spill.threshold (",
                                out->spill_threshold, ")"));
  }
  if (!out->enabled) return absl::OkStatus();
  if (out->advertise.empty()) {
    return r.Error("cluster.advertise", "",
                   "host:port that the other daemons reach this one at (its node id), since "
                   "cluster.enabled is true");
  }
  if (out->peers.empty() && out->dns_name.empty()) {
    return r.Error("cluster.peers", "[]",
                   "at least one peer (or cluster.dns_name), since cluster.enabled is true");
  }
  if (out->peer_token_file.empty() && out->peer_token_env.empty()) {
    return r.Error("cluster.peer_token", "{}",
                   "{file: PATH} or {env: VARIABLE}, since cluster.enabled is true: peers "
                   "read every tenant's blocks, so they must authenticate");
  }
  return ResolvePeerTls(r, tls, &out->tls);
}

}  // namespace

absl::string_view DefaultConfigYaml() { return kDefaultYaml; }

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  size_t split = 0;
  while (split < t.size() && (absl::ascii_isdigit(static_cast<unsigned char>(t[split])) ||
                              t[split] == '.')) {
    ++split;
  }
  absl::string_view number = t.substr(0, split);
  absl::string_view unit = absl::StripAsciiWhitespace(t.substr(split));
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a size; expected e.g. 1073741824, 512MiB or 4GiB"));
  };
  if (number.empty()) return bad();
  struct Unit {
    absl::string_view name;
    double factor;
  };
  static constexpr Unit kUnits[] = {{"", 1},           {"B", 1},
                                    {"KiB", 1024.0},   {"MiB", 1048576.0},
                                    {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
                                    {"KB", 1e3},       {"MB", 1e6},
                                    {"GB", 1e9},       {"TB", 1e12}};
  for (const Unit& u : kUnits) {
    if (unit != u.name) continue;
    if (u.name.empty() || u.name == "B") {
      uint64_t v = 0;
      if (!absl::SimpleAtoi(number, &v)) return bad();
      return v;
    }
    double v = 0;
    if (!absl::SimpleAtod(number, &v)) return bad();
    double bytes = std::round(v * u.factor);
    if (!(bytes >= 0) || bytes > 1.8e19) return bad();
    return static_cast<uint64_t>(bytes);
  }
  return bad();
}

namespace {

// Offset of the first byte of `text` that is not part of a well-formed UTF-8 sequence (overlong
// forms, surrogates and code points past U+10FFFF included), or nullopt when it is all valid.
std::optional<size_t> FirstInvalidUtf8(absl::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    size_t len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static constexpr uint32_t kMinForLength[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<DaemonConfig> ParseConfigOrThrow(absl::string_view yaml_text,
                                                absl::string_view source,
                                                absl::Span<const std::string> overrides);

std::string PinForGpuName(PinForGpu mode) {
  switch (mode) {
    case PinForGpu::kAuto:
      return "auto";
    case PinForGpu::kOn:
      return "on";
    case PinForGpu::kOff:
      return "off";
  }
  return "auto";
}

absl::StatusOr<DaemonConfig> ParseConfig(absl::string_view yaml_text, absl::string_view source,
                                         absl::Span<const std::string> overrides) {
  // yaml-cpp reports some shapes only by throwing (a conversion the walker did not expect):
  // whatever slips past the checks becomes an error naming the place, never a crash.
  try {
    return ParseConfigOrThrow(yaml_text, source, overrides);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": config not understood at line ",
                                                   e.mark.line + 1, ", column ",
                                                   e.mark.column + 1, ": ", e.msg));
  }
}

absl::StatusOr<DaemonConfig> ParseConfigOrThrow(absl::string_view yaml_text,
                                                absl::string_view source,
                                                absl::Span<const std::string> overrides) {
  // YAML text is UTF-8 by definition; a byte that is not would not survive being written back
  // out (ConfigToYaml), so it is refused here with its position.
  if (std::optional<size_t> bad = FirstInvalidUtf8(yaml_text)) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": not valid UTF-8 at byte ", *bad, " (a YAML config must be UTF-8 text)"));
  }
  for (const std::string& o : overrides) {
    if (std::optional<size_t> bad = FirstInvalidUtf8(o)) {
      return absl::InvalidArgumentError(absl::StrCat("--set '", absl::CHexEscape(o),
                                                     "': not valid UTF-8 at byte ", *bad));
    }
  }
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid YAML at line ",
                                                   e.mark.line + 1, ", column ",
                                                   e.mark.column + 1, ": ", e.msg));
  }
  if (!root || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": the config must be a mapping of keys to values"));
  }
  for (const std::string& o : overrides) PROXIMA_RETURN_IF_ERROR(ApplyOverride(root, o));

  Reader r{std::string(source)};
  DaemonConfig c;
  PROXIMA_RETURN_IF_ERROR(
      r.CheckKeys(root, "",
                  {"server", "tiers", "tierer", "index", "namespaces", "log", "ucx", "cluster"}));

  const YAML::Node server = root["server"];
  PROXIMA_RETURN_IF_ERROR(r.CheckKeys(
      server, "server",
      {"listen", "unix_socket", "unix_socket_mode", "unix_socket_send_buffer", "metrics_listen",
       "max_message_bytes", "max_batch_blocks", "max_lookup_keys", "max_profiles_per_namespace",
       "shutdown_grace_seconds", "max_inflight_bytes_per_client", "max_connections",
       "decode_threads", "decode_buffer_cache_bytes", "tls"}));
  if (server && server.IsMap()) {
    ServerConfig& s = c.server;
    PROXIMA_RETURN_IF_ERROR(r.String(server["listen"], "server.listen", &s.listen));
    if (!s.listen.empty() && !ValidHostPort(s.listen)) {
      return r.Error("server.listen", s.listen, "host:port such as 127.0.0.1:50051, or \"\"");
    }
    PROXIMA_RETURN_IF_ERROR(r.String(server["unix_socket"], "server.unix_socket", &s.unix_socket));
    if (!s.unix_socket.empty() && (s.unix_socket[0] != '/' || s.unix_socket.size() > 100)) {
      return r.Error("server.unix_socket", s.unix_socket,
                     "an absolute path of at most 100 characters, or \"\"");
    }
    if (const YAML::Node mode = server["unix_socket_mode"]) {
      uint32_t m = 0;
      std::string text = mode.IsScalar() ? mode.Scalar() : Reader::Dump(mode);
      if (!mode.IsScalar() || text.empty() || text.size() > 4 ||
          text.find_first_not_of("01234567") != std::string::npos ||
          (m = static_cast<uint32_t>(std::stoul(text, nullptr, 8))) > 0777) {
        return r.Error("server.unix_socket_mode", text, "an octal file mode such as 0660");
      }
      s.unix_socket_mode = m;
    }
    PROXIMA_RETURN_IF_ERROR(r.Size(server["unix_socket_send_buffer"],
                                   "server.unix_socket_send_buffer", 0, 1ull << 30,
                                   &s.unix_socket_send_buffer));
    PROXIMA_RETURN_IF_ERROR(
        r.String(server["metrics_listen"], "server.metrics_listen", &s.metrics_listen));
    if (!s.metrics_listen.empty() && !ValidHostPort(s.metrics_listen)) {
      return r.Error("server.metrics_listen", s.metrics_listen,
                     "host:port such as 127.0.0.1:9464, or \"\"");
    }
    PROXIMA_RETURN_IF_ERROR(r.Size(server["max_message_bytes"], "server.max_message_bytes",
                                   64 << 10, 2000ull << 20, &s.max_message_bytes));
    uint64_t v = s.max_batch_blocks;
    PROXIMA_RETURN_IF_ERROR(r.Uint(server["max_batch_blocks"], "server.max_batch_blocks", 1,
                                   65536, &v));
    s.max_batch_blocks = static_cast<uint32_t>(v);
    v = s.max_lookup_keys;
    PROXIMA_RETURN_IF_ERROR(
        r.Uint(server["max_lookup_keys"], "server.max_lookup_keys", 1, 1 << 20, &v));
    s.max_lookup_keys = static_cast<uint32_t>(v);
    v = s.max_profiles_per_namespace;
    PROXIMA_RETURN_IF_ERROR(r.Uint(server["max_profiles_per_namespace"],
                                   "server.max_profiles_per_namespace", 1, 4096, &v));
    s.max_profiles_per_namespace = static_cast<uint32_t>(v);
    PROXIMA_RETURN_IF_ERROR(r.Double(server["shutdown_grace_seconds"],
                                     "server.shutdown_grace_seconds", 0, 3600,
                                     &s.shutdown_grace_seconds));
    PROXIMA_RETURN_IF_ERROR(r.Size(server["max_inflight_bytes_per_client"],
                                   "server.max_inflight_bytes_per_client", 64 << 10, 1ull << 40,
                                   &s.max_inflight_bytes_per_client));
    v = s.max_connections;
    PROXIMA_RETURN_IF_ERROR(
        r.Uint(server["max_connections"], "server.max_connections", 1, 1 << 20, &v));
    s.max_connections = static_cast<uint32_t>(v);
    v = s.decode_threads;
    PROXIMA_RETURN_IF_ERROR(r.Uint(server["decode_threads"], "server.decode_threads", 1, 256, &v));
    s.decode_threads = static_cast<uint32_t>(v);
    PROXIMA_RETURN_IF_ERROR(r.Size(server["decode_buffer_cache_bytes"],
                                   "server.decode_buffer_cache_bytes", 0, 1ull << 40,
                                   &s.decode_buffer_cache_bytes));
    PROXIMA_RETURN_IF_ERROR(ParseTls(r, server["tls"], &s.tls));
  }
  if (c.server.listen.empty() && c.server.unix_socket.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": server.listen and server.unix_socket are both empty; set at least one"));
  }

  const YAML::Node tiers = root["tiers"];
  PROXIMA_RETURN_IF_ERROR(r.CheckKeys(tiers, "tiers", {"host", "gpu"}));
  if (tiers && tiers.IsMap()) {
    const YAML::Node host = tiers["host"];
    PROXIMA_RETURN_IF_ERROR(
        r.CheckKeys(host, "tiers.host",
                    {"capacity_bytes", "pin_for_gpu", "snapshot_file", "snapshot_seconds"}));
    if (host && host.IsMap()) {
      PROXIMA_RETURN_IF_ERROR(r.Size(host["capacity_bytes"], "tiers.host.capacity_bytes", 1 << 20,
                                     1ull << 50, &c.host_tier.capacity_bytes));
      std::string pin = PinForGpuName(c.host_tier.pin_for_gpu);
      PROXIMA_RETURN_IF_ERROR(r.String(host["pin_for_gpu"], "tiers.host.pin_for_gpu", &pin));
      if (pin == "auto") {
        c.host_tier.pin_for_gpu = PinForGpu::kAuto;
      } else if (pin == "on") {
        c.host_tier.pin_for_gpu = PinForGpu::kOn;
      } else if (pin == "off") {
        c.host_tier.pin_for_gpu = PinForGpu::kOff;
      } else {
        return r.Error("tiers.host.pin_for_gpu", pin, "auto, on or off");
      }
      PROXIMA_RETURN_IF_ERROR(
          r.String(host["snapshot_file"], "tiers.host.snapshot_file", &c.host_tier.snapshot_file));
      if (!c.host_tier.snapshot_file.empty() && c.host_tier.snapshot_file[0] != '/') {
        return r.Error("tiers.host.snapshot_file", c.host_tier.snapshot_file,
                       "an absolute path (a file in a directory only proximad may write), or \"\"");
      }
      PROXIMA_RETURN_IF_ERROR(Duration(r, host["snapshot_seconds"], "tiers.host.snapshot_seconds",
                                       0, 3600, &c.host_tier.snapshot_seconds));
    }
    PROXIMA_RETURN_IF_ERROR(ParseGpuTier(r, tiers["gpu"], &c.gpu_tier));
  }
  PROXIMA_RETURN_IF_ERROR(ParseTierer(r, root["tierer"], &c.tierer));

  const YAML::Node index = root["index"];
  PROXIMA_RETURN_IF_ERROR(r.CheckKeys(index, "index", {"shards"}));
  if (index && index.IsMap()) {
    uint64_t shards = c.index_shards;
    const YAML::Node n = index["shards"];
    PROXIMA_RETURN_IF_ERROR(r.Uint(n, "index.shards", 1, 4096, &shards));
    if ((shards & (shards - 1)) != 0) {
      return r.Error("index.shards", n.Scalar(), "a power of two in [1, 4096]");
    }
    c.index_shards = static_cast<uint32_t>(shards);
  }

  if (const YAML::Node ns = root["namespaces"]) {
    if (!ns.IsSequence() || ns.size() == 0) {
      return r.Error("namespaces", Reader::Dump(ns), "a non-empty list such as [{name: default}]");
    }
    c.namespaces.clear();
    absl::flat_hash_set<std::string> seen;
    for (size_t i = 0; i < ns.size(); ++i) {
      std::string path = absl::StrCat("namespaces[", i, "]");
      PROXIMA_RETURN_IF_ERROR(r.CheckKeys(
          ns[i], path, {"name", "tokens", "private_prefixes", "max_bytes", "compression"}));
      NamespaceConfig n;
      std::string name_key = path + ".name";
      if (!ns[i].IsMap() || !ns[i]["name"]) {
        return r.Error(name_key, "", "a namespace name of 1-64 characters [A-Za-z0-9_.-]");
      }
      PROXIMA_RETURN_IF_ERROR(r.String(ns[i]["name"], name_key, &n.name));
      if (!ValidNamespaceName(n.name)) {
        return r.Error(name_key, n.name, "a namespace name of 1-64 characters [A-Za-z0-9_.-]");
      }
      if (!seen.insert(n.name).second) {
        return r.Error(name_key, n.name, "a name not used by an earlier namespace");
      }
      PROXIMA_RETURN_IF_ERROR(ParseTokens(r, ns[i]["tokens"], path, &n.tokens));
      PROXIMA_RETURN_IF_ERROR(
          r.Bool(ns[i]["private_prefixes"], path + ".private_prefixes", &n.private_prefixes));
      if (n.private_prefixes && n.tokens.empty()) {
        return r.Error(path + ".private_prefixes", "true",
                       "false, or tokens to tell the callers apart (private_prefixes scopes "
                       "blocks by token)");
      }
      PROXIMA_RETURN_IF_ERROR(
          r.Size(ns[i]["max_bytes"], path + ".max_bytes", 0, 1ull << 50, &n.max_bytes));
      PROXIMA_RETURN_IF_ERROR(
          ParseCompression(r, ns[i]["compression"], path + ".compression", &n.compression));
      c.namespaces.push_back(std::move(n));
    }
  } else {
    for (NamespaceConfig& n : c.namespaces) {
      PROXIMA_RETURN_IF_ERROR(ResolveCompressionLevels(source, "namespaces[0].compression",
                                                       &n.compression));
    }
  }

  const YAML::Node log = root["log"];
  PROXIMA_RETURN_IF_ERROR(r.CheckKeys(log, "log", {"level"}));
  if (log && log.IsMap()) {
    PROXIMA_RETURN_IF_ERROR(r.String(log["level"], "log.level", &c.log_level));
    if (c.log_level != "debug" && c.log_level != "info" && c.log_level != "warning" &&
        c.log_level != "error") {
      return r.Error("log.level", c.log_level, "one of debug, info, warning, error");
    }
  }
  PROXIMA_RETURN_IF_ERROR(ParseUcxConfig(r, root["ucx"], &c.ucx));
  PROXIMA_RETURN_IF_ERROR(ParseCluster(r, root["cluster"], c.server.tls, &c.cluster));
  if (c.cluster.enabled && !c.host_tier.snapshot_file.empty()) {
    // Peers may delete keys while this node is down; its snapshot would bring them back. A
    // node of a cluster hands its blocks off to its peers instead (cluster.spill.handoff).
    return r.Error("tiers.host.snapshot_file", c.host_tier.snapshot_file,
                   "\"\" since cluster.enabled is true: a restarted node would serve blocks its "
                   "peers deleted while it was down (a cluster hands blocks off to peers at "
                   "shutdown instead: cluster.spill.handoff)");
  }
  return c;
}

std::vector<std::string> ConfigWarnings(const DaemonConfig& config) {
  std::vector<std::string> out;
  for (size_t i = 0; i < config.namespaces.size(); ++i) {
    const CompressionConfig& z = config.namespaces[i].compression;
    if (!z.enabled) continue;
    for (size_t l = 0; l < z.plans.size(); ++l) {
      if (z.plans[l].default_codec != codec::CodecId::kK4v3 ||
          z.max_attention_error > kK4v3TypicalAttentionError * 1.25) {
        continue;
      }
      out.push_back(absl::StrCat("namespaces[", i, "].compression.levels[", l,
                                 "] is k4v3, whose attention-output error on "
                                 "real KV is about ",
                                 kK4v3TypicalAttentionError,
                                 ", but quality.max_attention_error is ", z.max_attention_error,
                                 ": the quality guard will step its encodings back to the level "
                                 "before; set quality.max_attention_error to about 0.3 to use it"));
    }
  }
  return out;
}

absl::Status ResolveCompressionLevels(absl::string_view source, absl::string_view path,
                                      CompressionConfig* c) {
  auto error = [&](absl::string_view key, absl::string_view value, absl::string_view expected) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": config key '", path, ".", key,
                                                   "' has value '", value, "'; expected ",
                                                   expected));
  };
  c->plans.clear();
  if (c->strategy != "none" && c->strategy != "quantize" && c->strategy != "star" &&
      c->strategy != "hybrid") {
    if (c->strategy == "sparse") {
      return error("strategy", c->strategy,
                   "one of none, quantize, star, hybrid (`sparse` token dropping is not "
                   "implemented by the codec; `star` clusters tokens instead)");
    }
    return error("strategy", c->strategy, "one of none, quantize, star, hybrid");
  }
  std::optional<codec::CodecId> sink;
  if (!c->first_block.empty()) {
    absl::StatusOr<codec::CodecId> id = codec::ParseCodecName(c->first_block);
    if (!id.ok()) {
      return error("first_block", c->first_block,
                   "a codec name: raw, lossless, fp8, int8, int4, int2, star or k4v3, or \"\"");
    }
    sink = *id;
  }
  std::vector<codec::CodecPlan::LayerRange> per_layer;
  if (!c->per_layer.empty()) {
    absl::StatusOr<codec::CodecPlan> p = codec::ParseCodecPlan(c->per_layer);
    if (!p.ok() || p->layer_ranges.empty() ||
        c->per_layer.find("default") != std::string::npos ||
        c->per_layer.find("sink") != std::string::npos) {
      return error("per_layer", c->per_layer,
                   absl::StrCat("layer ranges only, such as layers[0:2]=int8,layers[2:4]=fp8",
                                p.ok() ? "" : absl::StrCat(" (", p.status().message(), ")")));
    }
    per_layer = p->layer_ranges;
  }

  std::vector<codec::CodecPlan> plans;
  if (!c->levels.empty()) {
    for (size_t i = 0; i < c->levels.size(); ++i) {
      absl::StatusOr<codec::CodecPlan> p = codec::ParseCodecPlan(c->levels[i]);
      if (!p.ok()) {
        return error(absl::StrCat("levels[", i, "]"), c->levels[i],
                     absl::StrCat("a codec plan such as int8 or "
                                  "\"layers[0:4]=int8,default=int4,sink=int8\" with codecs raw, "
                                  "lossless, fp8, int8, int4, int2, star, k4v3 (",
                                  p.status().message(), ")"));
      }
      plans.push_back(*std::move(p));
    }
  } else if (c->strategy != "none") {
    // Derived ladders, safest first; the deepest level is the one evicted from.
    using codec::CodecId;
    std::vector<CodecId> ladder;
    if (c->strategy == "quantize") {
      if (c->k_bits >= 8) ladder.push_back(CodecId::kInt8);
      if (c->k_bits >= 4) ladder.push_back(CodecId::kInt4);
      ladder.push_back(CodecId::kInt2);
      if (ladder.size() > c->hierarchy_levels) ladder.resize(c->hierarchy_levels);
    } else {
      ladder = {CodecId::kInt8, CodecId::kInt4, CodecId::kStar};
      if (c->strategy == "star") {
        ladder.erase(ladder.begin(), ladder.end() - c->hierarchy_levels);
      } else {
        ladder.resize(c->hierarchy_levels);
      }
    }
    for (CodecId id : ladder) {
      codec::CodecPlan p;
      p.default_codec = id;
      p.layer_ranges = per_layer;
      p.sink_codec = sink;
      p.group_size = c->group_size;
      plans.push_back(std::move(p));
    }
  }
  if (plans.size() > 7) {
    return error("levels", absl::StrCat(plans.size(), " levels"), "at most 7 levels");
  }
  for (size_t i = 0; i < plans.size(); ++i) {
    const std::string key = c->levels.empty() ? std::string("strategy") : absl::StrCat("levels[", i, "]");
    const std::string value = c->levels.empty() ? c->strategy : c->levels[i];
    if (plans[i].default_codec == codec::CodecId::kRaw) {
      return error(key, value, "a level that encodes (raw is what a block is before level 1)");
    }
    if (i > 0 && codec::Fidelity(plans[i].default_codec) >
                     codec::Fidelity(plans[i - 1].default_codec)) {
      return error(key, value,
                   absl::StrCat("a default codec no more faithful than the level before (",
                                std::string(codec::CodecName(plans[i - 1].default_codec)),
                                "): levels go from safest to most compact"));
    }
    if (i > 0 && plans[i].ToString() == plans[i - 1].ToString()) {
      return error(key, value, "a level different from the one before");
    }
  }
  if (c->enabled) c->plans = std::move(plans);
  return absl::OkStatus();
}

absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path,
                                            absl::Span<const std::string> overrides) {
  std::ifstream in(path);
  if (!in) {
    const int error = errno;  // what the open failed on, e.g. no such file, permission denied
    return absl::NotFoundError(
        absl::StrCat("cannot read config file '", path, "': ", std::strerror(error)));
  }
  std::stringstream text;
  text << in.rdbuf();
  return ParseConfig(text.str(), path, overrides);
}

namespace {

// ConfigDifferences over two YAML trees, `path` naming `a` and `b`.
void AddDifferences(const YAML::Node& a, const YAML::Node& b, const std::string& path,
                    std::vector<std::string>* out) {
  if (a.IsMap() && b.IsMap()) {
    const auto key_path = [&](const std::string& key) {
      return path.empty() ? key : absl::StrCat(path, ".", key);
    };
    for (const auto& entry : a) {
      const std::string key = entry.first.as<std::string>();
      const YAML::Node other = b[key];
      if (other) {
        AddDifferences(entry.second, other, key_path(key), out);
      } else {
        out->push_back(key_path(key));  // written only when set (e.g. namespaces[].max_bytes)
      }
    }
    for (const auto& entry : b) {
      const std::string key = entry.first.as<std::string>();
      if (!a[key]) out->push_back(key_path(key));
    }
    return;
  }
  if (a.IsSequence() && b.IsSequence() && a.size() == b.size()) {
    for (size_t i = 0; i < a.size(); ++i) {
      AddDifferences(a[i], b[i], absl::StrCat(path, "[", i, "]"), out);
    }
    return;
  }
  if (YAML::Dump(a) != YAML::Dump(b)) out->push_back(path);
}

}  // namespace

std::vector<std::string> ConfigDifferences(const DaemonConfig& a, const DaemonConfig& b) {
  std::vector<std::string> out;
  AddDifferences(YAML::Load(ConfigToYaml(a)), YAML::Load(ConfigToYaml(b)), "", &out);
  return out;
}

std::string ConfigToYaml(const DaemonConfig& c) {
  YAML::Emitter e;
  e << YAML::BeginMap;
  e << YAML::Key << "server" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "listen" << YAML::Value << YAML::DoubleQuoted << c.server.listen;
  e << YAML::Key << "unix_socket" << YAML::Value << YAML::DoubleQuoted << c.server.unix_socket;
  char mode[8];
  std::snprintf(mode, sizeof(mode), "0%o", c.server.unix_socket_mode);
  e << YAML::Key << "unix_socket_mode" << YAML::Value << YAML::DoubleQuoted << mode;
  e << YAML::Key << "unix_socket_send_buffer" << YAML::Value
    << c.server.unix_socket_send_buffer;
  e << YAML::Key << "metrics_listen" << YAML::Value << YAML::DoubleQuoted
    << c.server.metrics_listen;
  e << YAML::Key << "max_message_bytes" << YAML::Value << c.server.max_message_bytes;
  e << YAML::Key << "max_batch_blocks" << YAML::Value << c.server.max_batch_blocks;
  e << YAML::Key << "max_lookup_keys" << YAML::Value << c.server.max_lookup_keys;
  e << YAML::Key << "max_profiles_per_namespace" << YAML::Value
    << c.server.max_profiles_per_namespace;
  e << YAML::Key << "shutdown_grace_seconds" << YAML::Value << c.server.shutdown_grace_seconds;
  e << YAML::Key << "max_inflight_bytes_per_client" << YAML::Value
    << c.server.max_inflight_bytes_per_client;
  e << YAML::Key << "max_connections" << YAML::Value << c.server.max_connections;
  e << YAML::Key << "decode_threads" << YAML::Value << c.server.decode_threads;
  e << YAML::Key << "decode_buffer_cache_bytes" << YAML::Value
    << c.server.decode_buffer_cache_bytes;
  e << YAML::Key << "tls" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "cert_file" << YAML::Value << YAML::DoubleQuoted << c.server.tls.cert_file;
  e << YAML::Key << "key_file" << YAML::Value << YAML::DoubleQuoted << c.server.tls.key_file;
  e << YAML::Key << "client_ca_file" << YAML::Value << YAML::DoubleQuoted
    << c.server.tls.client_ca_file;
  e << YAML::Key << "reload_interval" << YAML::Value
    << absl::StrCat(c.server.tls.reload_interval_seconds, "s");
  e << YAML::EndMap;
  e << YAML::EndMap;
  e << YAML::Key << "tiers" << YAML::Value << YAML::BeginMap << YAML::Key << "host" << YAML::Value
    << YAML::BeginMap << YAML::Key << "capacity_bytes" << YAML::Value << c.host_tier.capacity_bytes
    << YAML::Key << "pin_for_gpu" << YAML::Value << PinForGpuName(c.host_tier.pin_for_gpu)
    << YAML::Key << "snapshot_file" << YAML::Value << YAML::DoubleQuoted
    << c.host_tier.snapshot_file << YAML::Key << "snapshot_seconds" << YAML::Value
    << absl::StrCat(c.host_tier.snapshot_seconds, "s") << YAML::EndMap;
  e << YAML::Key << "gpu" << YAML::Value << YAML::BeginMap << YAML::Key
    << "capacity_bytes_per_device" << YAML::Value << c.gpu_tier.capacity_bytes_per_device
    << YAML::Key << "pressure_threshold" << YAML::Value << c.gpu_tier.pressure_threshold
    << YAML::EndMap << YAML::EndMap;
  e << YAML::Key << "tierer" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "temperature_policy" << YAML::Value << c.tierer.temperature_policy;
  e << YAML::Key << "protected_share" << YAML::Value << c.tierer.protected_share;
  e << YAML::Key << "threads" << YAML::Value << c.tierer.threads;
  e << YAML::Key << "interval_seconds" << YAML::Value << c.tierer.interval_seconds;
  e << YAML::EndMap;
  e << YAML::Key << "index" << YAML::Value << YAML::BeginMap << YAML::Key << "shards"
    << YAML::Value << c.index_shards << YAML::EndMap;
  e << YAML::Key << "namespaces" << YAML::Value << YAML::BeginSeq;
  for (const NamespaceConfig& n : c.namespaces) {
    e << YAML::BeginMap << YAML::Key << "name" << YAML::Value << n.name;
    if (!n.tokens.empty()) {
      e << YAML::Key << "tokens" << YAML::Value << YAML::BeginSeq;
      for (const TokenConfig& t : n.tokens) {
        e << YAML::Flow << YAML::BeginMap << YAML::Key << "name" << YAML::Value << t.name;
        // The path or variable name only: the token itself is never printed.
        if (!t.file.empty()) e << YAML::Key << "file" << YAML::Value << t.file;
        if (!t.env.empty()) e << YAML::Key << "env" << YAML::Value << t.env;
        e << YAML::Key << "access" << YAML::Value
          << (t.access == TokenAccess::kReadOnly ? "read_only" : "read_write");
        if (!t.scope.empty()) e << YAML::Key << "scope" << YAML::Value << t.scope;
        e << YAML::EndMap;
      }
      e << YAML::EndSeq;
    }
    if (n.private_prefixes) e << YAML::Key << "private_prefixes" << YAML::Value << true;
    if (n.max_bytes != 0) e << YAML::Key << "max_bytes" << YAML::Value << n.max_bytes;
    const CompressionConfig& z = n.compression;
    e << YAML::Key << "compression" << YAML::Value << YAML::BeginMap;
    e << YAML::Key << "enabled" << YAML::Value << z.enabled;
    e << YAML::Key << "strategy" << YAML::Value << z.strategy;
    e << YAML::Key << "levels" << YAML::Value << YAML::Flow << YAML::BeginSeq;
    for (const std::string& l : z.levels) e << YAML::DoubleQuoted << l;
    e << YAML::EndSeq;
    e << YAML::Key << "per_layer" << YAML::Value << YAML::DoubleQuoted << z.per_layer;
    e << YAML::Key << "first_block" << YAML::Value << YAML::DoubleQuoted << z.first_block;
    e << YAML::Key << "quantization" << YAML::Value << YAML::Flow << YAML::BeginMap
      << YAML::Key << "k_bits" << YAML::Value << z.k_bits << YAML::Key << "v_bits"
      << YAML::Value << z.v_bits << YAML::Key << "per_channel" << YAML::Value << true
      << YAML::Key << "group_size" << YAML::Value << z.group_size << YAML::EndMap;
    e << YAML::Key << "star_kv" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key
      << "cluster_size" << YAML::Value << 16 << YAML::Key << "hierarchy_levels" << YAML::Value
      << z.hierarchy_levels << YAML::EndMap;
    e << YAML::Key << "trigger" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key
      << "memory_pressure_threshold" << YAML::Value << z.memory_pressure_threshold << YAML::Key
      << "min_seq_len_to_compress" << YAML::Value << z.min_seq_len_to_compress << YAML::EndMap;
    e << YAML::Key << "quality" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key
      << "max_attention_error" << YAML::Value << z.max_attention_error << YAML::Key
      << "sample_one_in" << YAML::Value << z.sample_one_in << YAML::EndMap;
    e << YAML::Key << "priority" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key
      << "high_max_level" << YAML::Value << z.high_priority_max_level << YAML::EndMap;
    e << YAML::EndMap << YAML::EndMap;
  }
  e << YAML::EndSeq;
  e << YAML::Key << "log" << YAML::Value << YAML::BeginMap << YAML::Key << "level"
    << YAML::Value << c.log_level << YAML::EndMap;
  e << YAML::Key << "ucx" << YAML::Value << YAML::BeginMap << YAML::Key << "enabled" << YAML::Value
    << c.ucx.enabled << YAML::Key << "max_sessions" << YAML::Value << c.ucx.max_sessions
    << YAML::Key << "copy_threads" << YAML::Value
    << (c.ucx.copy_threads < 0 ? std::string("auto") : absl::StrCat(c.ucx.copy_threads))
    << YAML::Key << "rendezvous_get_max_bytes" << YAML::Value << c.ucx.rendezvous_get_max_bytes
    << YAML::Key << "check_worker_addresses" << YAML::Value << c.ucx.check_worker_addresses
    << YAML::EndMap;
  const ClusterConfig& k = c.cluster;
  auto seconds = [](double s) { return absl::StrCat(s, "s"); };
  e << YAML::Key << "cluster" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "enabled" << YAML::Value << k.enabled;
  e << YAML::Key << "advertise" << YAML::Value << YAML::DoubleQuoted << k.advertise;
  e << YAML::Key << "peers" << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (const std::string& p : k.peers) e << YAML::DoubleQuoted << p;
  e << YAML::EndSeq;
  e << YAML::Key << "dns_name" << YAML::Value << YAML::DoubleQuoted << k.dns_name;
  e << YAML::Key << "dns_port" << YAML::Value << k.dns_port;
  e << YAML::Key << "dns_refresh" << YAML::Value << seconds(k.dns_refresh_seconds);
  e << YAML::Key << "health_interval" << YAML::Value << seconds(k.health_interval_seconds);
  e << YAML::Key << "health_timeout" << YAML::Value << seconds(k.health_timeout_seconds);
  e << YAML::Key << "failures_before_down" << YAML::Value << k.failures_before_down;
  e << YAML::Key << "peer_deadline" << YAML::Value << seconds(k.peer_deadline_seconds);
  // The path or variable name only: the token itself is never printed.
  e << YAML::Key << "peer_token" << YAML::Value << YAML::Flow << YAML::BeginMap;
  if (!k.peer_token_file.empty()) e << YAML::Key << "file" << YAML::Value << k.peer_token_file;
  if (!k.peer_token_env.empty()) e << YAML::Key << "env" << YAML::Value << k.peer_token_env;
  e << YAML::EndMap;
  e << YAML::Key << "tls" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "ca_file" << YAML::Value << YAML::DoubleQuoted << k.tls.ca_file;
  e << YAML::Key << "cert_file" << YAML::Value << YAML::DoubleQuoted << k.tls.cert_file;
  e << YAML::Key << "key_file" << YAML::Value << YAML::DoubleQuoted << k.tls.key_file;
  e << YAML::Key << "server_name" << YAML::Value << YAML::DoubleQuoted << k.tls.server_name;
  e << YAML::EndMap;
  e << YAML::Key << "transport" << YAML::Value << k.transport;
  e << YAML::Key << "spill" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "enabled" << YAML::Value << k.spill_enabled;
  e << YAML::Key << "threshold" << YAML::Value << k.spill_threshold;
  e << YAML::Key << "accept_below" << YAML::Value << k.spill_accept_below;
  e << YAML::Key << "candidates" << YAML::Value << k.spill_candidates;
  e << YAML::Key << "put_wait" << YAML::Value << seconds(k.spill_put_wait_seconds);
  e << YAML::Key << "handoff" << YAML::Value << seconds(k.spill_handoff_seconds);
  e << YAML::Key << "handoff_evicts" << YAML::Value << k.spill_handoff_evicts;
  e << YAML::EndMap;
  e << YAML::EndMap;
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

}  // namespace proxima::daemon
