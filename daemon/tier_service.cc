#include "daemon/tier_service.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/bytes.h"
#include "common/crc32c.h"
#include "common/credentials.h"
#include "common/log.h"
#include "common/parallel.h"
#include "common/status_macros.h"
#include "kernels/codec.h"
#include "kernels/device.h"

namespace proxima::daemon {
namespace {

// Adds `o` to a PutResponse; returns 1 when the block was stored (for the puts counter).
uint64_t AppendOutcome(PutOutcome o, v1::PutResponse* response) {
  switch (o) {
    case PutOutcome::kStored:
      response->add_outcomes(v1::PUT_OUTCOME_STORED);
      return 1;
    case PutOutcome::kAlreadyPresent:
      response->add_outcomes(v1::PUT_OUTCOME_ALREADY_PRESENT);
      return 0;
    case PutOutcome::kNoSpace:
      response->add_outcomes(v1::PUT_OUTCOME_NO_SPACE);
      return 0;
  }
  return 0;
}

constexpr size_t kMaxFingerprintBytes = 256;

absl::Status CheckDim(const char* field, uint64_t value, uint64_t max) {
  if (value == 0 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile.", field, " is ", value, "; expected 1..", max));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> ProfileBlockBytes(const v1::ModelProfile& p) {
  PROXIMA_RETURN_IF_ERROR(CheckDim("num_layers", p.num_layers(), 1024));
  PROXIMA_RETURN_IF_ERROR(CheckDim("num_kv_heads", p.num_kv_heads(), 1024));
  PROXIMA_RETURN_IF_ERROR(CheckDim("head_dim", p.head_dim(), 4096));
  PROXIMA_RETURN_IF_ERROR(CheckDim("tokens_per_block", p.tokens_per_block(), 65536));
  uint64_t elem = 0;
  switch (p.dtype()) {
    case v1::DTYPE_FP16:
    case v1::DTYPE_BF16:
      elem = 2;
      break;
    case v1::DTYPE_FP8_E4M3:
      elem = 1;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "profile.dtype is ",
          v1::DType_Name(p.dtype()).empty() ? std::to_string(p.dtype()) : v1::DType_Name(p.dtype()),
          "; expected DTYPE_FP16, DTYPE_BF16 or DTYPE_FP8_E4M3"));
  }
  if (p.fingerprint().size() > kMaxFingerprintBytes) {
    return absl::InvalidArgumentError(absl::StrCat("profile.fingerprint is ",
                                                   p.fingerprint().size(), " bytes; at most ",
                                                   kMaxFingerprintBytes));
  }
  if (!codec::RopeThetaValid(p.rope_theta())) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile.rope_theta is ", p.rope_theta(),
                     "; expected 0 (unknown) or the model's RoPE base, ", codec::kMinRopeTheta,
                     " to ", codec::kMaxRopeTheta));
  }
  return 2ull * p.num_layers() * p.tokens_per_block() * p.num_kv_heads() * p.head_dim() * elem;
}

absl::Status CheckStoredSize(uint32_t level, uint64_t size, uint64_t block_bytes) {
  if (level == 0 ? size == block_bytes : size > 0 && size <= block_bytes + kMessageOverhead) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("is ", size, " bytes at level ", level, "; expected ",
                   level == 0 ? absl::StrCat("exactly block_bytes = ", block_bytes)
                              : absl::StrCat("1 to block_bytes + ", kMessageOverhead, " = ",
                                             block_bytes + kMessageOverhead)));
}

absl::Status CheckStoredContainer(uint32_t level, std::span<const std::byte> bytes,
                                  uint64_t block_bytes) {
  if (level == 0) return absl::OkStatus();
  absl::StatusOr<codec::BlockHeaderInfo> info = codec::InspectBlock(bytes);
  if (!info.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("is at level ", level,
                                                   " but is not a valid STAR-KV block (",
                                                   info.status().message(), ")"));
  }
  if (info->raw_bytes != block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("decodes to ", info->raw_bytes,
                                                   " bytes; expected block_bytes = ", block_bytes));
  }
  return absl::OkStatus();
}

uint64_t ProfileId(const v1::ModelProfile& p) {
  // FNV-1a over a fixed little-endian encoding of the fields: stable across builds and hosts,
  // unlike absl::Hash (seeded per process).
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](const void* data, size_t n) {
    const auto* b = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  };
  for (uint32_t v : {p.num_layers(), p.num_kv_heads(), p.head_dim(), p.tokens_per_block(),
                     static_cast<uint32_t>(p.dtype())}) {
    uint8_t le[4] = {static_cast<uint8_t>(v), static_cast<uint8_t>(v >> 8),
                     static_cast<uint8_t>(v >> 16), static_cast<uint8_t>(v >> 24)};
    mix(le, 4);
  }
  mix(p.fingerprint().data(), p.fingerprint().size());
  if (p.rope_theta() != 0.0) {  // absent from the ids of profiles registered without one
    const double theta = p.rope_theta();
    uint64_t bits;
    std::memcpy(&bits, &theta, 8);
    uint8_t le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<uint8_t>(bits >> (8 * i));
    mix(le, 8);
  }
  return h == 0 ? 1 : h;
}

namespace {

// The scope of each partition of namespace `ns`: "" (partition 0, the namespace's shared
// blocks), then with private_prefixes each distinct token scope (a token's `scope`, else its
// name) in config order, as partitions 1, 2, ...
std::vector<std::string> ScopesOf(const NamespaceConfig& ns) {
  std::vector<std::string> scopes = {""};
  if (!ns.private_prefixes) return scopes;
  for (const TokenConfig& t : ns.tokens) {
    const std::string& scope = t.scope.empty() ? t.name : t.scope;
    if (std::find(scopes.begin() + 1, scopes.end(), scope) == scopes.end()) {
      scopes.push_back(scope);
    }
  }
  return scopes;
}

// The host tier's arena, page-locked for GPU copies as tiers.host.pin_for_gpu says.
absl::StatusOr<std::unique_ptr<HostTier>> MakeHostTier(const DaemonConfig& config) {
  PROXIMA_ASSIGN_OR_RETURN(std::unique_ptr<HostTier> tier,
                           HostTier::Create(config.host_tier.capacity_bytes));
  if (config.host_tier.pin_for_gpu != PinForGpu::kOff) {
    absl::Status pinned = tier->PinForGpu();
    if (pinned.ok()) {
      PROXIMA_LOG(kInfo) << "host tier pinned for GPU transfers"
                         << log::Kv("bytes", tier->capacity_bytes());
    } else if (config.host_tier.pin_for_gpu == PinForGpu::kOn) {
      return absl::FailedPreconditionError(
          absl::StrCat("tiers.host.pin_for_gpu is on but the host tier (", tier->capacity_bytes(),
                       " bytes) cannot be pinned: ", pinned.message(), "; set it to auto or off"));
    } else {
      PROXIMA_LOG(kInfo) << "host tier not pinned for GPU transfers"
                         << log::Kv("reason", pinned.message());
    }
  }
  return tier;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TierService>> TierService::Create(const DaemonConfig& config,
                                                                 metrics::Registry* registry) {
  std::vector<std::unique_ptr<DeviceMemory>> devices;
  if (const uint64_t bytes = config.gpu_tier.capacity_bytes_per_device; bytes > 0) {
    std::string why_none;
    std::vector<gpu::DeviceInfo> gpus = gpu::VisibleDevices(&why_none);
    if (gpus.empty()) {
      PROXIMA_LOG(kWarning) << "GPU tier configured but no GPU is visible; running with the host "
                               "tier alone"
                            << log::Kv("tiers.gpu.capacity_bytes_per_device", bytes)
                            << log::Kv("reason", why_none);
    }
    for (const gpu::DeviceInfo& g : gpus) {
      absl::StatusOr<std::unique_ptr<DeviceMemory>> memory = AllocateCudaMemory(g.ordinal, bytes);
      if (!memory.ok()) {
        return absl::Status(
            memory.status().code(),
            absl::StrCat("tiers.gpu.capacity_bytes_per_device is ", bytes, " but CUDA device ",
                         g.ordinal, " (", g.name, ", ", g.total_bytes,
                         " bytes of memory) cannot give the GPU tier that much: ",
                         memory.status().message(), "; lower it, or 0 turns the GPU tier off"));
      }
      PROXIMA_LOG(kInfo) << "GPU tier pool allocated" << log::Kv("device", g.ordinal)
                         << log::Kv("name", g.name) << log::Kv("bytes", bytes);
      devices.push_back(*std::move(memory));
    }
  }
  return CreateWithDevices(config, registry, std::move(devices));
}

absl::StatusOr<std::unique_ptr<TierService>> TierService::CreateWithDevices(
    const DaemonConfig& config, metrics::Registry* registry,
    std::vector<std::unique_ptr<DeviceMemory>> devices) {
  PROXIMA_ASSIGN_OR_RETURN(std::unique_ptr<HostTier> tier, MakeHostTier(config));
  std::unique_ptr<TierService> service(
      new TierService(config, std::move(tier), std::move(devices), registry));
  PROXIMA_RETURN_IF_ERROR(service->LoadTokens(config));
  service->tierer_->Start();
  return service;
}

absl::Status TierService::LoadTokens(const DaemonConfig& config) {
  for (size_t n = 0; n < config.namespaces.size(); ++n) {
    namespaces_[n]->open = config.namespaces[n].tokens.empty();
    any_protected_ |= !config.namespaces[n].tokens.empty();
  }
  PROXIMA_ASSIGN_OR_RETURN(std::vector<Token> tokens, ReadTokens(config));
  tokens_.store(std::make_shared<const std::vector<Token>>(std::move(tokens)));
  return absl::OkStatus();
}

absl::StatusOr<size_t> TierService::ReloadTokens(std::span<const std::string> reserved) {
  absl::StatusOr<std::vector<Token>> tokens = ReadTokens(config_, reserved);
  if (!tokens.ok()) {
    PROXIMA_LOG(kError) << "token reload failed; the previous tokens stay in force"
                        << log::Kv("error", tokens.status().message());
    return tokens.status();
  }
  const size_t n = tokens->size();
  tokens_.store(std::make_shared<const std::vector<Token>>(*std::move(tokens)));
  token_reloads_->Increment();
  PROXIMA_LOG(kInfo) << "tokens reloaded" << log::Kv("tokens", n);
  return n;
}

absl::StatusOr<std::vector<TierService::Token>> TierService::ReadTokens(
    const DaemonConfig& config, std::span<const std::string> reserved) const {
  std::vector<Token> tokens;
  std::vector<std::string> where;  // config key of each token, for duplicate errors
  for (size_t n = 0; n < config.namespaces.size(); ++n) {
    const NamespaceConfig& ns = config.namespaces[n];
    for (size_t i = 0; i < ns.tokens.size(); ++i) {
      const TokenConfig& t = ns.tokens[i];
      const std::string key = absl::StrCat("namespaces[", n, "].tokens[", i, "]");
      absl::StatusOr<std::string> secret =
          t.file.empty() ? ReadTokenEnv(key + ".env", t.env) : ReadTokenFile(key + ".file", t.file);
      if (!secret.ok()) return secret.status();
      if (std::find(reserved.begin(), reserved.end(), *secret) != reserved.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            key,
            " holds the same token as cluster.peer_token; a peer token must be a secret of "
            "the daemons alone"));
      }
      for (size_t j = 0; j < tokens.size(); ++j) {
        if (tokens[j].secret == *secret) {
          return absl::InvalidArgumentError(absl::StrCat(
              key, " holds the same token as ", where[j],
              "; every token must be distinct (a token names exactly one namespace and access)"));
        }
      }
      Token token{*std::move(secret), Caller{}};
      token.caller.namespace_index = static_cast<int>(n);
      token.caller.access = t.access;
      token.caller.token_name = t.name;
      if (ns.private_prefixes) {
        const std::string& scope = t.scope.empty() ? t.name : t.scope;
        token.caller.partition = *ScopePartition(static_cast<uint32_t>(n), scope);
      }
      tokens.push_back(std::move(token));
      where.push_back(key);
    }
  }
  return tokens;
}

absl::StatusOr<Caller> TierService::Authenticate(absl::string_view authorization) const {
  if (authorization.empty()) return Caller::Anonymous();
  constexpr absl::string_view kBearer = "Bearer ";
  if (authorization.size() <= kBearer.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kBearer.size()), kBearer)) {
    return absl::UnauthenticatedError(
        "the 'authorization' metadata is not of the form 'Bearer <token>'");
  }
  const absl::string_view presented = authorization.substr(kBearer.size());
  // Compare against every token without stopping at a match: the time taken says nothing about
  // which token (or how much of one) was right.
  const std::shared_ptr<const std::vector<Token>> tokens = tokens_.load();
  int match = -1;
  for (size_t i = 0; i < tokens->size(); ++i) {
    const bool equal = ConstantTimeEquals(presented, (*tokens)[i].secret);
    match = equal ? static_cast<int>(i) : match;
  }
  if (match < 0) {
    return absl::UnauthenticatedError(
        "the bearer token is not valid on this daemon (revoked, mistyped, or for another "
        "daemon)");
  }
  return (*tokens)[match].caller;
}

absl::StatusOr<TierService::Scope> TierService::Authorize(const Caller& caller,
                                                          const std::string& name, Need need,
                                                          absl::string_view method) const {
  if (name.empty()) return absl::InvalidArgumentError("namespace_name is empty");
  if (caller.namespace_index >= 0) {
    const Namespace& own = *namespaces_[caller.namespace_index];
    // The same answer whether `name` exists or not: a token holder learns nothing about other
    // namespaces.
    if (own.name != name) {
      return absl::PermissionDeniedError(
          absl::StrCat("token '", caller.token_name, "' is not valid for namespace '",
                       name.substr(0, 64), "'; it grants namespace '", own.name, "' only"));
    }
    if (need == Need::kWrite && caller.access == TokenAccess::kReadOnly) {
      return absl::PermissionDeniedError(
          absl::StrCat("token '", caller.token_name, "' of namespace '", own.name,
                       "' is read_only; ", method, " needs a read_write token"));
    }
    return Scope{static_cast<uint32_t>(caller.namespace_index), caller.partition};
  }
  absl::StatusOr<uint32_t> ns = FindNamespace(name);
  if (!ns.ok() && any_protected_) {
    // Without a token, an unknown namespace and a protected one look alike.
    return absl::UnauthenticatedError(
        absl::StrCat("namespace '", name.substr(0, 64),
                     "' needs a bearer token ('authorization: Bearer <token>' metadata)"));
  }
  if (!ns.ok()) return ns.status();
  if (!namespaces_[*ns]->open) {
    return absl::UnauthenticatedError(absl::StrCat(
        "namespace '", name, "' needs a bearer token ('authorization: Bearer <token>' metadata)"));
  }
  return Scope{*ns, 0};
}

TierService::TierService(const DaemonConfig& config, std::unique_ptr<HostTier> tier,
                         std::vector<std::unique_ptr<DeviceMemory>> devices,
                         metrics::Registry* registry)
    : config_(config),
      start_time_(absl::Now()),
      decode_buffers_(config.server.decode_buffer_cache_bytes) {
  token_reloads_ = registry->AddCounter(
      "proxima_token_reloads_total",
      "Successful re-reads of the token files and variables (SIGHUP); a failed one keeps the "
      "previous tokens and is logged",
      {});
  counters_ = std::make_unique<NamespaceCounters[]>(config.namespaces.size());
  for (size_t i = 0; i < config.namespaces.size(); ++i) {
    auto ns = std::make_unique<Namespace>();
    ns->name = config.namespaces[i].name;
    metrics::Labels labels = {{"namespace", ns->name}};
    ns->puts = registry->AddCounter("proxima_blocks_put_total",
                                    "Blocks stored by Put (new blocks only)", labels);
    ns->get_hits = registry->AddCounter("proxima_get_hits_total", "Blocks returned by Get", labels);
    ns->get_misses = registry->AddCounter("proxima_get_misses_total",
                                          "Keys asked for by Get and not found", labels);
    ns->lookup_hits =
        registry->AddCounter("proxima_lookup_hits_total", "Keys counted present by Lookup", labels);
    ns->lookup_misses =
        registry->AddCounter("proxima_lookup_misses_total",
                             "Lookup calls that stopped before the end of their chain", labels);
    ns->max_bytes.store(config.namespaces[i].max_bytes);
    for (const codec::CodecPlan& plan : config.namespaces[i].compression.plans) {
      ns->plan_texts.push_back(plan.ToString());
    }
    // Registered for every namespace: a limit set by a reload (SIGHUP) shows without a restart.
    const std::atomic<uint64_t>* limit = &ns->max_bytes;
    registry->AddGauge("proxima_namespace_max_bytes",
                       "namespaces[].max_bytes: the most bytes the namespace's blocks may take "
                       "(0: no limit of its own)",
                       labels, [limit] { return static_cast<double>(limit->load()); });
    ns->limit_evictions = registry->AddCounter(
        "proxima_namespace_limit_evictions_total",
        "The namespace's blocks evicted to keep it within its max_bytes (its puts made room "
        "among its own blocks)",
        labels);
    ns->limit_refusals = registry->AddCounter(
        "proxima_namespace_limit_refusals_total",
        "Blocks of the namespace not stored because they would pass its max_bytes and none of "
        "its blocks could give way (a block larger than the limit, or all of them being read)",
        labels);
    NamespaceCounters* c = &counters_[i];
    registry->AddGauge("proxima_namespace_blocks", "Blocks stored in the namespace", labels,
                       [c] { return static_cast<double>(c->blocks.load()); });
    registry->AddGauge("proxima_namespace_bytes", "Bytes of blocks stored in the namespace", labels,
                       [c] { return static_cast<double>(c->bytes.load()); });
    namespaces_.push_back(std::move(ns));
    partition_scopes_.push_back(ScopesOf(config.namespaces[i]));
  }
  std::vector<std::unique_ptr<DevicePool>> pools;
  for (std::unique_ptr<DeviceMemory>& memory : devices) {
    pools.push_back(std::make_unique<DevicePool>(std::move(memory)));
  }
  store_ = std::make_unique<BlockStore>(
      std::move(tier), config.index_shards,
      std::span<NamespaceCounters>(counters_.get(), config.namespaces.size()),
      config.tierer.temperature_policy == "slru" ? config.tierer.protected_share : 0.0,
      std::move(pools));
  BlockStore* s = store_.get();
  for (size_t d = 0; d < s->num_devices(); ++d) {
    metrics::Labels gpu = {{"tier", absl::StrCat("gpu:", d)}};
    const DevicePool* pool = &s->device_pool(d);
    registry->AddGauge("proxima_tier_capacity_bytes", "Hard capacity of the tier", gpu,
                       [pool] { return static_cast<double>(pool->capacity_bytes()); });
    registry->AddGauge("proxima_tier_used_bytes",
                       "Bytes allocated to blocks in the tier, including blocks pinned by readers",
                       gpu, [pool] { return static_cast<double>(pool->used_bytes()); });
    registry->AddGauge("proxima_tier_blocks", "Blocks resident in the tier", gpu,
                       [s, d] { return static_cast<double>(s->device_blocks(d)); });
  }
  metrics::Labels host = {{"tier", "host"}};
  registry->AddGauge("proxima_tier_capacity_bytes", "Hard capacity of the tier", host,
                     [s] { return static_cast<double>(s->capacity_bytes()); });
  registry->AddGauge("proxima_tier_used_bytes",
                     "Bytes allocated to blocks in the tier, including blocks pinned by readers",
                     host, [s] { return static_cast<double>(s->used_bytes()); });
  registry->AddGauge("proxima_tier_blocks", "Blocks resident in the tier", host,
                     [s] { return static_cast<double>(s->host_blocks()); });
  registry->AddGauge("proxima_tier_pinned_for_gpu",
                     "1 when the tier's memory is page-locked and registered with CUDA", host,
                     [pinned = s->pinned_for_gpu()] { return pinned ? 1.0 : 0.0; });
  registry->AddGauge("proxima_tier_protected_bytes",
                     "Bytes of blocks in the protected (used at least twice) segment of the "
                     "segmented LRU; at most tierer.protected_share of the capacity",
                     host, [s] { return static_cast<double>(s->protected_bytes()); });
  registry->AddCounterFunction("proxima_tier_evictions_total",
                               "Blocks evicted from the tier to make room (monotonic)", host,
                               [s] { return static_cast<double>(s->evictions()); });
  for (const char* outcome : {"made_room", "gave_up"}) {
    const bool made = outcome[0] == 'm';
    registry->AddCounterFunction(
        "proxima_tier_compactions_total",
        "Puts that found enough free bytes but no region large enough, by whether moving blocks "
        "made one (gave_up: a block in the way could not move: being read, written or "
        "encoded, or no free region outside the window could take it)",
        {{"tier", "host"}, {"outcome", outcome}}, [s, made] {
          return static_cast<double>(made ? s->compactions() : s->compactions_given_up());
        });
  }
  registry->AddCounterFunction("proxima_tier_compaction_moved_bytes_total",
                               "Bytes of blocks moved within the tier to make room for a put",
                               host,
                               [s] { return static_cast<double>(s->compaction_moved_bytes()); });
  size_t deepest = 0;  // series only for levels some namespace can reach
  for (const NamespaceConfig& n : config.namespaces) {
    deepest = std::max(deepest, n.compression.plans.size());
  }
  for (int level = 0; level < kMaxLevels && static_cast<size_t>(level) <= deepest; ++level) {
    metrics::Labels labels = {{"tier", "host"}, {"level", absl::StrCat(level)}};
    registry->AddGauge("proxima_tier_level_blocks",
                       "Blocks resident in the tier by hierarchy level (0 = raw)", labels,
                       [s, level] { return static_cast<double>(s->level_blocks(level)); });
    registry->AddGauge("proxima_tier_level_bytes",
                       "Bytes of blocks resident in the tier by hierarchy level (0 = raw)", labels,
                       [s, level] { return static_cast<double>(s->level_bytes(level)); });
  }
  tierer_ = std::make_unique<Tierer>(
      s, config,
      [this](uint32_t ns, uint64_t profile_id) { return ProfileCodecOf(ns, profile_id); },
      registry);
  decodes_ = registry->AddCounter("proxima_get_decodes_total",
                                  "Encoded blocks decoded by the daemon for Get or Decompress");
  decode_microseconds_ = registry->AddCounter("proxima_get_decode_microseconds_total",
                                              "Time spent decoding blocks for Get or Decompress");
  decode_failures_ =
      registry->AddCounter("proxima_get_decode_failures_total",
                           "Stored encoded blocks that failed to decode (served as misses)");
  BufferCache* buffers = &decode_buffers_;
  registry->AddGauge("proxima_get_decode_buffers_kept_bytes",
                     "Decoded-block buffers kept for reuse by later Gets "
                     "(server.decode_buffer_cache_bytes)",
                     {}, [buffers] { return static_cast<double>(buffers->kept_bytes()); });
  registry->AddCounterFunction(
      "proxima_get_decode_buffers_total",
      "Output buffers of the daemon's decodes: reused (kept from an earlier Get) or allocated",
      {{"source", "reused"}}, [buffers] { return static_cast<double>(buffers->reused()); });
  registry->AddCounterFunction(
      "proxima_get_decode_buffers_total",
      "Output buffers of the daemon's decodes: reused (kept from an earlier Get) or allocated",
      {{"source", "allocated"}}, [buffers] { return static_cast<double>(buffers->allocated()); });
  registry->AddCounterFunction(
      "proxima_crc_failures_total",
      "Stored blocks that failed their CRC32C check on read (dropped; monotonic)", {},
      [s] { return static_cast<double>(s->crc_failures()); });
  absl::Time start = start_time_;
  registry->AddGauge("proxima_uptime_seconds", "Seconds since proximad started", {},
                     [start] { return absl::ToDoubleSeconds(absl::Now() - start); });
  bytes_in_ = metrics::TransferBytes(registry, "grpc_inline", "in");
  bytes_out_ = metrics::TransferBytes(registry, "grpc_inline", "out");
}

TierService::~TierService() {
  if (tierer_) tierer_->Stop();  // before the store and the profiles it reads go
}

std::optional<Tierer::ProfileCodec> TierService::ProfileCodecOf(uint32_t ns, uint64_t profile_id) {
  absl::StatusOr<RegisteredProfile> p = FindProfile(ns, profile_id);
  if (!p.ok()) return std::nullopt;
  codec::BlockGeometry g;
  g.num_layers = p->profile.num_layers();
  g.num_kv_heads = p->profile.num_kv_heads();
  g.head_dim = p->profile.head_dim();
  g.tokens_per_block = p->profile.tokens_per_block();
  switch (p->profile.dtype()) {
    case v1::DTYPE_FP16:
      g.dtype = codec::DType::kFp16;
      break;
    case v1::DTYPE_BF16:
      g.dtype = codec::DType::kBf16;
      break;
    default:
      return std::nullopt;  // fp8 blocks stay raw: the codec takes 16-bit inputs
  }
  if (!g.Validate().ok()) return std::nullopt;
  return Tierer::ProfileCodec{g, p->profile.rope_theta(), p->profile.fingerprint()};
}

BlockAttributes TierService::AttributesAgain(uint32_t ns, uint64_t profile_id,
                                             const BlockAttributes& put) {
  // Tokens per block matter only to a profile the codec takes (AttributesFor returns first
  // otherwise): one lookup.
  const std::optional<Tierer::ProfileCodec> codec = ProfileCodecOf(ns, profile_id);
  return tierer_->AttributesFor(ns, codec ? codec->geometry.tokens_per_block : 0, codec.has_value(),
                                put.position, put.high_priority, put.second_chance ? 1.0f : 0.0f);
}

const std::string& TierService::LevelPlanText(uint32_t ns, uint8_t level) const {
  static const std::string* const kNone = new std::string();
  const std::vector<std::string>& texts = namespaces_[ns]->plan_texts;
  return level > 0 && level <= texts.size() ? texts[level - 1] : *kNone;
}

std::optional<uint8_t> TierService::LevelOfPlan(uint32_t ns, uint8_t level,
                                                absl::string_view plan) const {
  if (level == 0 || plan.empty()) return level;
  const std::vector<std::string>& texts = namespaces_[ns]->plan_texts;
  for (size_t i = 0; i < texts.size(); ++i) {
    if (texts[i] == plan) return static_cast<uint8_t>(i + 1);
  }
  return std::nullopt;
}

absl::StatusOr<uint32_t> TierService::FindNamespace(const std::string& name) const {
  if (name.empty()) return absl::InvalidArgumentError("namespace_name is empty");
  for (uint32_t i = 0; i < namespaces_.size(); ++i) {
    if (namespaces_[i]->name == name) return i;
  }
  return absl::NotFoundError(
      absl::StrCat("namespace '", name.substr(0, 64), "' is not configured on this daemon"));
}

absl::StatusOr<RegisteredProfile> TierService::FindProfile(uint32_t ns, uint64_t profile_id) {
  Namespace& n = *namespaces_[ns];
  proxima::MutexLock lock(&n.mu);
  auto it = n.profiles.find(profile_id);
  if (it == n.profiles.end()) {
    return absl::NotFoundError(absl::StrCat("profile ", ProfileName(profile_id),
                                            " is not registered in namespace '", n.name,
                                            "'; call RegisterProfile first"));
  }
  return it->second;
}

absl::Status TierService::ResolveKeys(const Caller& caller, Need need, const std::string& method,
                                      const std::string& namespace_name, uint64_t profile_id,
                                      const google::protobuf::RepeatedPtrField<std::string>& keys,
                                      uint32_t max_keys, RegisteredProfile* profile,
                                      std::vector<BlockId>* ids) {
  PROXIMA_ASSIGN_OR_RETURN(Scope scope, Authorize(caller, namespace_name, need, method));
  const uint32_t ns = scope.namespace_index;
  PROXIMA_ASSIGN_OR_RETURN(*profile, FindProfile(ns, profile_id));
  if (keys.empty()) return absl::InvalidArgumentError(absl::StrCat(method, " has no keys"));
  if (static_cast<uint32_t>(keys.size()) > max_keys) {
    return absl::ResourceExhaustedError(absl::StrCat(
        method, " has ", keys.size(), " keys; the limit is ", max_keys, " per call (",
        method == "Lookup" ? "server.max_lookup_keys" : "server.max_batch_blocks", ")"));
  }
  ids->resize(keys.size());
  for (int i = 0; i < keys.size(); ++i) {
    if (keys[i].size() != kKeyBytes) {
      return absl::InvalidArgumentError(absl::StrCat(method, " keys[", i, "] is ", keys[i].size(),
                                                     " bytes; keys are exactly ", kKeyBytes,
                                                     " bytes"));
    }
    BlockId& id = (*ids)[i];
    id.namespace_index = ns;
    id.partition = scope.partition;
    id.profile_id = profile_id;
    std::memcpy(id.key.data(), keys[i].data(), kKeyBytes);
  }
  return absl::OkStatus();
}

absl::Status TierService::GetServerInfo(const Caller&, const v1::GetServerInfoRequest&,
                                        v1::GetServerInfoResponse* response) {
  response->set_version(PROXIMA_VERSION);
  response->set_max_message_bytes(config_.server.max_message_bytes);
  response->set_max_batch_blocks(config_.server.max_batch_blocks);
  response->set_max_lookup_keys(config_.server.max_lookup_keys);
  response->set_key_bytes(kKeyBytes);
  response->set_max_inflight_bytes_per_client(config_.server.max_inflight_bytes_per_client);
  return absl::OkStatus();
}

absl::Status TierService::RegisterProfile(const Caller& caller,
                                          const v1::RegisterProfileRequest& request,
                                          v1::RegisterProfileResponse* response) {
  // Reading needs a profile id too, so read-only tokens may register (it is idempotent).
  PROXIMA_ASSIGN_OR_RETURN(
      Scope scope, Authorize(caller, request.namespace_name(), Need::kRead, "RegisterProfile"));
  PROXIMA_ASSIGN_OR_RETURN(const uint64_t id, AddProfile(scope.namespace_index, request.profile()));
  PROXIMA_ASSIGN_OR_RETURN(const uint64_t block_bytes, ProfileBlockBytes(request.profile()));
  response->set_profile_id(id);
  response->set_block_bytes(block_bytes);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> TierService::AddProfile(uint32_t ns, const v1::ModelProfile& profile) {
  PROXIMA_ASSIGN_OR_RETURN(uint64_t block_bytes, ProfileBlockBytes(profile));
  // As GetBlocks counts an inline Get's response: a block that fits one alone. (Before, the
  // per-block overhead was left out: a profile 64 bytes short of that was taken, and every
  // inline Get of its blocks refused, "ask for at most 0 blocks per call".)
  const uint64_t max_block =
      config_.server.max_message_bytes - kMessageOverhead - kPerBlockOverhead;
  if (block_bytes > max_block || block_bytes > store_->capacity_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "profile's block is ", block_bytes, " bytes; this daemon takes blocks of at most ",
        std::min(max_block, store_->capacity_bytes()),
        " bytes (server.max_message_bytes and tiers.host.capacity_bytes)"));
  }
  const uint64_t id = ProfileId(profile);
  Namespace& n = *namespaces_[ns];
  bool added = false;
  {
    proxima::MutexLock lock(&n.mu);
    if (!n.profiles.contains(id)) {
      if (n.profiles.size() >= config_.server.max_profiles_per_namespace) {
        return absl::ResourceExhaustedError(
            absl::StrCat("namespace '", n.name, "' already has ", n.profiles.size(),
                         " profiles; the limit is server.max_profiles_per_namespace = ",
                         config_.server.max_profiles_per_namespace));
      }
      n.profiles.emplace(id, RegisteredProfile{profile, block_bytes});
      added = true;
      PROXIMA_LOG(kInfo) << "profile registered" << log::Kv("namespace", n.name)
                         << log::Kv("profile_id", ProfileName(id))
                         << log::Kv("block_bytes", block_bytes)
                         << log::Kv("fingerprint", profile.fingerprint());
    }
  }
  if (added) {  // its quality guard's series show from now on (outside n.mu: the lookup takes it)
    if (std::optional<Tierer::ProfileCodec> codec = ProfileCodecOf(ns, id)) {
      tierer_->AddModel(ns, id, *codec);
    }
  }
  return id;
}

std::vector<std::pair<uint32_t, v1::ModelProfile>> TierService::Profiles() {
  std::vector<std::pair<uint32_t, v1::ModelProfile>> out;
  for (uint32_t ns = 0; ns < namespaces_.size(); ++ns) {
    proxima::MutexLock lock(&namespaces_[ns]->mu);
    for (const auto& [id, p] : namespaces_[ns]->profiles) out.emplace_back(ns, p.profile);
  }
  return out;
}

std::optional<std::string> TierService::PartitionScope(uint32_t ns, uint32_t partition) const {
  if (ns >= partition_scopes_.size() || partition >= partition_scopes_[ns].size()) {
    return std::nullopt;
  }
  return partition_scopes_[ns][partition];
}

std::optional<uint32_t> TierService::ScopePartition(uint32_t ns, const std::string& scope) const {
  if (ns >= partition_scopes_.size()) return std::nullopt;
  const std::vector<std::string>& scopes = partition_scopes_[ns];
  const auto it = std::find(scopes.begin(), scopes.end(), scope);
  if (it == scopes.end()) return std::nullopt;
  return static_cast<uint32_t>(it - scopes.begin());
}

absl::Status TierService::Put(const Caller& caller, const v1::PutRequest& request,
                              v1::PutResponse* response) {
  std::vector<PutSource> sources;
  sources.reserve(request.blocks_size());
  for (const v1::PutBlock& b : request.blocks()) {
    const std::string* data = &b.data();
    sources.push_back(PutSource{
        &b.key(), data->size(), b.has_crc32c(), b.crc32c(),
        b.has_position() ? static_cast<int64_t>(b.position()) : -1, b.importance(),
        [data] { return Crc32c(AsBytes(*data)); },
        [data](std::span<std::byte> dst) { std::memcpy(dst.data(), data->data(), dst.size()); }});
  }
  return PutBlocks(caller, request.namespace_name(), request.profile_id(), sources,
                   request.priority() == v1::PRIORITY_HIGH, response);
}

absl::Status TierService::Put(const Caller& caller, const wire::PutRequestReader& request,
                              v1::PutResponse* response) {
  std::vector<PutSource> sources;
  sources.reserve(request.blocks().size());
  for (size_t i = 0; i < request.blocks().size(); ++i) {
    const wire::PutRequestReader::Block& b = request.blocks()[i];
    sources.push_back(
        PutSource{&b.key, b.data_size, b.has_crc32c, b.crc32c,
                  b.has_position ? static_cast<int64_t>(b.position) : -1, b.importance,
                  [&request, i] { return request.DataCrc32c(i); },
                  [&request, i](std::span<std::byte> dst) { request.CopyData(i, dst); }});
  }
  return PutBlocks(caller, request.namespace_name(), request.profile_id(), sources,
                   request.priority() == v1::PRIORITY_HIGH, response);
}

absl::Status TierService::PutBlocks(const Caller& caller, const std::string& namespace_name,
                                    uint64_t profile_id, std::span<const PutSource> blocks,
                                    bool high_priority, v1::PutResponse* response) {
  PROXIMA_ASSIGN_OR_RETURN(Scope scope, Authorize(caller, namespace_name, Need::kWrite, "Put"));
  const uint32_t ns = scope.namespace_index;
  PROXIMA_ASSIGN_OR_RETURN(RegisteredProfile profile, FindProfile(ns, profile_id));
  if (blocks.empty()) return absl::InvalidArgumentError("Put has no blocks");
  if (blocks.size() > config_.server.max_batch_blocks) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Put has ", blocks.size(), " blocks; the limit is ",
                     config_.server.max_batch_blocks, " per call (server.max_batch_blocks)"));
  }
  // Validate everything before storing anything: a rejected request changes nothing (and
  // evicts nothing to make room for itself).
  std::vector<uint32_t> crcs(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    const PutSource& b = blocks[i];
    if (b.key->size() != kKeyBytes) {
      return absl::InvalidArgumentError(absl::StrCat("Put blocks[", i, "].key is ", b.key->size(),
                                                     " bytes; keys are exactly ", kKeyBytes,
                                                     " bytes"));
    }
    if (b.data_size != profile.block_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Put blocks[", i, "].data is ", b.data_size, " bytes; profile ", ProfileName(profile_id),
          " needs ", profile.block_bytes, " bytes per block"));
    }
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    crcs[i] = blocks[i].data_crc32c();
    if (blocks[i].has_crc32c && blocks[i].crc32c != crcs[i]) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Put blocks[%d].crc32c is 0x%08x but the received data has CRC32C 0x%08x "
                          "(corrupted in transit?)",
                          i, blocks[i].crc32c, crcs[i]));
    }
  }
  Namespace& n = *namespaces_[ns];
  const bool codec_ok = ProfileCodecOf(ns, profile_id).has_value();
  uint64_t stored = 0;
  std::vector<BlockKey> held;  // keys the local tiers hold now, for the cluster's records
  std::string staging;         // a block on its way to a GPU pool
  for (size_t i = 0; i < blocks.size(); ++i) {
    BlockId id{ns, profile_id, {}, scope.partition};
    std::memcpy(id.key.data(), blocks[i].key->data(), kKeyBytes);
    PutOutcome outcome = PutOutcome::kAlreadyPresent;
    if (!store_->Touch(id)) {
      std::optional<BlockStore::PendingBlock> pending;
      if (!RoomInNamespace(ns, profile.block_bytes)) {
        // Over the namespace's max_bytes, and none of its blocks could give way.
      } else if (store_->num_devices() > 0) {
        staging.resize(profile.block_bytes);
        std::span<std::byte> bytes =
            std::as_writable_bytes(std::span<char>(staging.data(), staging.size()));
        blocks[i].copy_data(bytes);
        pending = Land(tierer_->ReserveOnDevice(bytes.size()), bytes);
      } else if ((pending = ReserveForPut(profile.block_bytes))) {
        blocks[i].copy_data(pending->bytes());
      }
      if (!pending) {
        outcome = PutOutcome::kNoSpace;
      } else {
        outcome = store_->Commit(
            id, *std::move(pending), crcs[i],
            tierer_->AttributesFor(ns, profile.profile.tokens_per_block(), codec_ok,
                                   blocks[i].position, high_priority, blocks[i].importance));
      }
    }
    if (outcome != PutOutcome::kNoSpace) held.push_back(id.key);
    stored += AppendOutcome(outcome, response);
  }
  // Puts of the namespace running at once may each have found room that only one had.
  (void)RoomInNamespace(ns, 0);
  n.puts->Increment(stored);
  TellRemote(ns, scope.partition, profile_id, held);
  bytes_in_->Increment(static_cast<uint64_t>(blocks.size()) * profile.block_bytes);
  return absl::OkStatus();
}

std::optional<BlockStore::PendingBlock> TierService::Land(
    std::optional<BlockStore::PendingBlock> device, std::span<const std::byte> bytes) {
  if (device) {
    absl::Status s = device->Write(bytes);
    if (s.ok()) return device;
    device.reset();  // the pool's room is freed; the block goes to the host tier instead
    PROXIMA_LOG(kError) << "cannot copy a block into GPU memory; storing it in host memory"
                        << log::Kv("error", s.ToString());
  }
  std::optional<BlockStore::PendingBlock> host = ReserveForPut(bytes.size());
  if (host) std::memcpy(host->bytes().data(), bytes.data(), bytes.size());
  return host;
}

std::optional<BlockStore::PendingBlock> TierService::ReserveForPut(uint64_t bytes) {
  return tierer_->Reserve(bytes, [this] {
    RemoteBlocks* remote = remote_.load();
    return remote != nullptr && remote->MakeRoom();
  });
}

bool TierService::RoomInNamespace(uint32_t ns, uint64_t bytes) {
  Namespace& n = *namespaces_[ns];
  const uint64_t limit = n.max_bytes.load(std::memory_order_relaxed);
  if (limit == 0) return true;
  // Each round encodes or evicts one of the namespace's blocks. Puts of the namespace running
  // at once may take the room made here first: a bounded number of rounds, then no.
  for (int round = 0; bytes <= limit && round < 1024; ++round) {
    const uint64_t used = store_->namespace_bytes(ns);
    if (used + bytes <= limit) return true;
    if (tierer_->CompressOneOf(ns, used + bytes - limit)) continue;
    bool evicted = false;
    if (!store_->EvictOneOf(ns, &evicted)) break;
    if (evicted) n.limit_evictions->Increment();
  }
  if (bytes > 0) n.limit_refusals->Increment();
  return false;
}

bool TierService::SetNamespaceLimit(uint32_t ns, uint64_t max_bytes) {
  namespaces_[ns]->max_bytes.store(max_bytes, std::memory_order_relaxed);
  tierer_->SetNamespaceLimit(ns, max_bytes);
  return RoomInNamespace(ns, 0);
}

void TierService::TellRemote(uint32_t ns, uint32_t partition, uint64_t profile_id,
                             std::span<const BlockKey> keys) {
  RemoteBlocks* remote = remote_.load();
  if (remote == nullptr || keys.empty()) return;
  remote->Stored({ns, namespaces_[ns]->name, partition, profile_id, keys});
}

void TierService::DecodeFound(std::span<const BlockId> ids, uint64_t block_bytes,
                              std::span<const size_t> which, const std::vector<bool>& from_peer,
                              std::vector<std::optional<BlockStore::ReadBlock>>& found) {
  // Each block decodes into a buffer of its own, reused from earlier Gets where one is kept (not
  // zero-filled: a decode that succeeds writes every byte, and a failed one's buffer is dropped);
  // the stored bytes' pin is dropped after.
  struct Decoded {
    std::shared_ptr<std::byte[]> raw;
    absl::Status status;
    uint32_t crc32c = 0;
    uint64_t microseconds = 0;
  };
  std::vector<Decoded> decoded(which.size());
  // Threads only where there is work enough to pay for starting them (tens of microseconds
  // each): at least two blocks and 2 MiB of raw bytes per thread.
  const uint64_t by_bytes = which.size() * block_bytes / (2ull << 20);
  const int threads = by_bytes < 2
                          ? 1
                          : static_cast<int>(std::min<uint64_t>(
                                {config_.server.decode_threads,
                                 std::max(1u, std::thread::hardware_concurrency()), by_bytes}));
  ParallelFor(which.size(), threads, [&](size_t j) {
    const auto start = std::chrono::steady_clock::now();
    Decoded& d = decoded[j];
    d.raw = decode_buffers_.Take(block_bytes);
    std::span<std::byte> out(d.raw.get(), block_bytes);
    d.status = codec::DecodeBlock(found[which[j]]->bytes, out);
    if (d.status.ok()) d.crc32c = Crc32c(out);
    d.microseconds = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                               std::chrono::steady_clock::now() - start)
                                               .count());
  });
  for (size_t j = 0; j < which.size(); ++j) {
    std::optional<BlockStore::ReadBlock>& b = found[which[j]];
    Decoded& d = decoded[j];
    if (d.status.ok()) {
      std::span<const std::byte> out(d.raw.get(), block_bytes);
      b = BlockStore::ReadBlock{std::move(d.raw), out, d.crc32c, 0};
      decodes_->Increment();
      decode_microseconds_->Increment(d.microseconds);
      continue;
    }
    decode_failures_->Increment();
    const BlockId& id = ids[which[j]];
    PROXIMA_LOG_EVERY(kError, 10) << "encoded block failed to decode; served as a miss"
                                  << log::Kv("namespace", namespaces_[id.namespace_index]->name)
                                  << log::Kv("profile_id", ProfileName(id.profile_id))
                                  << log::Kv("key",
                                             absl::BytesToHexString(absl::string_view(
                                                 reinterpret_cast<const char*>(id.key.data()), 8)))
                                  << log::Kv("from", from_peer[which[j]] ? "a peer" : "this node")
                                  << log::Kv("level", int(b->level))
                                  << log::Kv("error", d.status.ToString());
    b.reset();
  }
}

absl::Status TierService::GetBlocks(const Caller& caller, const v1::GetRequest& request,
                                    std::vector<std::optional<BlockStore::ReadBlock>>* blocks,
                                    bool inline_response) {
  RegisteredProfile profile;
  std::vector<BlockId> ids;
  PROXIMA_RETURN_IF_ERROR(ResolveKeys(caller, Need::kRead, "Get", request.namespace_name(),
                                      request.profile_id(), request.keys(),
                                      config_.server.max_batch_blocks, &profile, &ids));
  uint64_t need = kMessageOverhead + ids.size() * (profile.block_bytes + kPerBlockOverhead);
  if (inline_response && need > config_.server.max_message_bytes) {
    uint64_t fit = (config_.server.max_message_bytes - kMessageOverhead) /
                   (profile.block_bytes + kPerBlockOverhead);
    return absl::ResourceExhaustedError(absl::StrCat(
        "Get of ", ids.size(), " blocks of ", profile.block_bytes,
        " bytes could need a response of ", need, " bytes, over server.max_message_bytes = ",
        config_.server.max_message_bytes, "; ask for at most ", fit, " blocks per call"));
  }
  Namespace& n = *namespaces_[ids[0].namespace_index];
  uint64_t hits = 0;
  uint64_t out_bytes = 0;
  blocks->clear();
  blocks->reserve(ids.size());
  const bool want_raw = request.format() != v1::BLOCK_FORMAT_STORED;
  const BlockStore::CrcCheck check = request.client_verifies_crc32c()
                                         ? BlockStore::CrcCheck::kByCaller
                                         : BlockStore::CrcCheck::kHere;
  std::vector<std::optional<BlockStore::ReadBlock>> found(ids.size());
  std::vector<bool> from_peer(ids.size(), false);  // already checked against its CRC32C
  std::vector<size_t> missed;
  for (size_t i = 0; i < ids.size(); ++i) {
    found[i] = store_->Read(ids[i], check);
    if (!found[i]) missed.push_back(i);
  }
  RemoteBlocks* remote = remote_.load();
  if (remote != nullptr && !missed.empty()) {
    // Local misses, from the nodes that hold them. Their bytes were checked against their
    // CRC32C on arrival; the entry owns them.
    std::vector<BlockKey> keys;
    keys.reserve(missed.size());
    for (size_t i : missed) keys.push_back(ids[i].key);
    std::vector<std::optional<RemoteBlock>> fetched =
        remote->Fetch({ids[0].namespace_index, namespaces_[ids[0].namespace_index]->name,
                       ids[0].partition, ids[0].profile_id, keys, profile.block_bytes});
    for (size_t j = 0; j < missed.size() && j < fetched.size(); ++j) {
      if (!fetched[j]) continue;
      found[missed[j]] = BlockStore::ReadBlock{fetched[j]->pin, fetched[j]->bytes,
                                               fetched[j]->crc32c, fetched[j]->level};
      from_peer[missed[j]] = true;
    }
  }
  // Stored encoded and asked for raw: decoded below, in parallel.
  std::vector<size_t> to_decode;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::optional<BlockStore::ReadBlock>& b = found[i];
    if (b && want_raw && b->level > 0 && check == BlockStore::CrcCheck::kByCaller &&
        !from_peer[i]) {
      // The client checks only the decoded bytes it receives, so the stored container is
      // checked here before it is decoded: read again with the daemon's check (a block that
      // fails is dropped, counted and reported as a miss).
      b = store_->Read(ids[i], BlockStore::CrcCheck::kHere);
    }
    if (b && want_raw && b->level > 0) to_decode.push_back(i);
  }
  DecodeFound(ids, profile.block_bytes, to_decode, from_peer, found);
  for (std::optional<BlockStore::ReadBlock>& b : found) {
    blocks->push_back(std::move(b));
    if (blocks->back()) {
      ++hits;
      out_bytes += blocks->back()->bytes.size();
    }
  }
  n.get_hits->Increment(hits);
  n.get_misses->Increment(ids.size() - hits);
  if (inline_response) bytes_out_->Increment(out_bytes);
  return absl::OkStatus();
}

absl::Status TierService::Get(const Caller& caller, const v1::GetRequest& request,
                              v1::GetResponse* response) {
  std::vector<std::optional<BlockStore::ReadBlock>> blocks;
  PROXIMA_RETURN_IF_ERROR(GetBlocks(caller, request, &blocks));
  for (const auto& b : blocks) {
    v1::GetResult* r = response->add_results();
    if (!b) continue;
    r->set_found(true);
    r->set_data(reinterpret_cast<const char*>(b->bytes.data()), b->bytes.size());
    r->set_crc32c(b->crc32c);
    r->set_level(b->level);
  }
  return absl::OkStatus();
}

absl::Status TierService::DecompressBlocks(
    const Caller& caller, const v1::DecompressRequest& request,
    std::vector<std::optional<BlockStore::ReadBlock>>* blocks, bool inline_response) {
  v1::GetRequest get;
  get.set_namespace_name(request.namespace_name());
  get.set_profile_id(request.profile_id());
  *get.mutable_keys() = request.keys();
  get.set_format(v1::BLOCK_FORMAT_RAW);
  // The same authorization as Get (Need::kRead).
  return GetBlocks(caller, get, blocks, inline_response);
}

absl::StatusOr<TierService::ResolvedProfile> TierService::ResolveProfile(
    const Caller& caller, const std::string& namespace_name, uint64_t profile_id, Need need,
    absl::string_view method) {
  PROXIMA_ASSIGN_OR_RETURN(Scope scope, Authorize(caller, namespace_name, need, method));
  ResolvedProfile resolved;
  resolved.namespace_index = scope.namespace_index;
  resolved.partition = scope.partition;
  resolved.profile_id = profile_id;
  PROXIMA_ASSIGN_OR_RETURN(resolved.profile, FindProfile(scope.namespace_index, profile_id));
  return resolved;
}

absl::Status TierService::PutPulled(const ResolvedProfile& target, std::span<const BlockKey> keys,
                                    std::span<const uint32_t> crcs, const PulledHints& hints,
                                    const PullFn& pull, v1::PutResponse* response) {
  const uint32_t ns = target.namespace_index;
  const RegisteredProfile& profile = target.profile;
  auto id_of = [&target](const BlockKey& key) {
    return BlockId{target.namespace_index, target.profile_id, key, target.partition};
  };
  std::vector<PutOutcome> outcomes(keys.size(), PutOutcome::kAlreadyPresent);
  // Where the pulled bytes land: the host tier's arena (memory UCX registered), or, for a block a
  // GPU pool has room for, a host buffer of this call's own, copied into the pool once checked;
  // such a block never takes (or evicts for) room in the host tier. Owned by `pull` while it
  // may still write.
  struct Landing {
    std::vector<BlockStore::PendingBlock> blocks;
    std::vector<bool> on_device;
    std::unique_ptr<std::byte[]> staging;  // not zeroed: every byte is pulled before it is read
  };
  auto landing = std::make_shared<Landing>();
  std::vector<size_t> to_pull;
  size_t device_blocks = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (store_->Touch(id_of(keys[i]))) continue;
    // Within the namespace's max_bytes with this call's blocks reserved so far (not yet in it).
    if (!RoomInNamespace(ns, (landing->blocks.size() + 1) * profile.block_bytes)) {
      outcomes[i] = PutOutcome::kNoSpace;
      continue;
    }
    std::optional<BlockStore::PendingBlock> p = tierer_->ReserveOnDevice(profile.block_bytes);
    const bool on_device = p.has_value();
    // As an inline Put: the tierer makes room by compressing before it evicts.
    if (!p) p = ReserveForPut(profile.block_bytes);
    if (!p) {
      outcomes[i] = PutOutcome::kNoSpace;
      continue;
    }
    landing->blocks.push_back(*std::move(p));
    landing->on_device.push_back(on_device);
    device_blocks += on_device ? 1 : 0;
    to_pull.push_back(i);
  }
  if (device_blocks > 0) {
    landing->staging.reset(new std::byte[device_blocks * profile.block_bytes]);
  }
  std::vector<std::span<std::byte>> dst;
  for (size_t j = 0, k = 0; j < to_pull.size(); ++j) {
    dst.push_back(
        landing->on_device[j]
            ? std::span(landing->staging.get() + k++ * profile.block_bytes, profile.block_bytes)
            : landing->blocks[j].bytes().subspan(0, profile.block_bytes));
  }
  std::vector<uint32_t> got(to_pull.size(), 0);
  if (!to_pull.empty()) {
    PROXIMA_RETURN_IF_ERROR(pull(to_pull, dst, got, landing));
  }
  // Every block is checked before any becomes visible: a request with one bad block stores none.
  for (size_t j = 0; j < to_pull.size(); ++j) {
    if (got[j] != crcs[to_pull[j]]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "blocks[%d].crc32c is 0x%08x but the bytes pulled from the client have CRC32C 0x%08x "
          "(buffer changed or deregistered during the transfer?); nothing was stored",
          to_pull[j], crcs[to_pull[j]], got[j]));
    }
  }
  const bool codec_ok = ProfileCodecOf(ns, target.profile_id).has_value();
  for (size_t j = 0; j < to_pull.size(); ++j) {
    const size_t i = to_pull[j];
    const BlockAttributes attributes = tierer_->AttributesFor(
        ns, profile.profile.tokens_per_block(), codec_ok,
        hints.positions.empty() ? -1 : hints.positions[i], hints.high_priority,
        hints.importance.empty() ? 0.0f : hints.importance[i]);
    std::optional<BlockStore::PendingBlock> landed =
        landing->on_device[j] ? Land(std::move(landing->blocks[j]), dst[j])
                              : std::move(landing->blocks[j]);
    outcomes[i] = landed ? store_->Commit(id_of(keys[i]), *std::move(landed), got[j], attributes)
                         : PutOutcome::kNoSpace;
  }
  (void)RoomInNamespace(ns, 0);  // as after an inline Put
  uint64_t stored = 0;
  std::vector<BlockKey> held;
  for (size_t i = 0; i < keys.size(); ++i) {
    stored += AppendOutcome(outcomes[i], response);
    if (outcomes[i] != PutOutcome::kNoSpace) held.push_back(keys[i]);
  }
  namespaces_[ns]->puts->Increment(stored);
  TellRemote(ns, target.partition, target.profile_id, held);
  return absl::OkStatus();
}

absl::Status TierService::Lookup(const Caller& caller, const v1::LookupRequest& request,
                                 v1::LookupResponse* response) {
  RegisteredProfile profile;
  std::vector<BlockId> ids;
  PROXIMA_RETURN_IF_ERROR(ResolveKeys(caller, Need::kRead, "Lookup", request.namespace_name(),
                                      request.profile_id(), request.keys(),
                                      config_.server.max_lookup_keys, &profile, &ids));
  uint32_t present = 0;
  while (present < ids.size() && store_->Contains(ids[present])) ++present;
  RemoteBlocks* remote = remote_.load();
  if (remote != nullptr && present < ids.size()) {
    // The rest of the chain, from the keys' home nodes (one hop, batched per home).
    std::vector<BlockKey> rest;
    rest.reserve(ids.size() - present);
    for (size_t i = present; i < ids.size(); ++i) rest.push_back(ids[i].key);
    present += static_cast<uint32_t>(
        remote->LookupChain({ids[0].namespace_index, namespaces_[ids[0].namespace_index]->name,
                             ids[0].partition, ids[0].profile_id, rest, profile.block_bytes}));
  }
  Namespace& n = *namespaces_[ids[0].namespace_index];
  n.lookup_hits->Increment(present);
  if (present < ids.size()) n.lookup_misses->Increment();
  response->set_num_prefix_present(present);
  return absl::OkStatus();
}

absl::Status TierService::Delete(const Caller& caller, const v1::DeleteRequest& request,
                                 v1::DeleteResponse* response) {
  RegisteredProfile profile;
  std::vector<BlockId> ids;
  PROXIMA_RETURN_IF_ERROR(ResolveKeys(caller, Need::kWrite, "Delete", request.namespace_name(),
                                      request.profile_id(), request.keys(),
                                      config_.server.max_batch_blocks, &profile, &ids));
  std::vector<bool> deleted(ids.size(), false);
  std::vector<BlockKey> gone;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!store_->Delete(ids[i])) continue;
    deleted[i] = true;
    gone.push_back(ids[i].key);
  }
  RemoteBlocks* remote = remote_.load();
  if (remote != nullptr) {
    const RemoteBlockSet set{ids[0].namespace_index, namespaces_[ids[0].namespace_index]->name,
                             ids[0].partition, ids[0].profile_id, {}};
    if (!gone.empty()) {
      RemoteBlockSet local = set;
      local.keys = gone;
      remote->Removed(local);
    }
    // Copies other nodes hold (put there, or spilled there by this node) go as well.
    std::vector<BlockKey> keys;
    keys.reserve(ids.size());
    for (const BlockId& id : ids) keys.push_back(id.key);
    RemoteBlockSet everywhere = set;
    everywhere.keys = keys;
    std::vector<bool> elsewhere = remote->DeleteRemote(everywhere);
    for (size_t i = 0; i < deleted.size() && i < elsewhere.size(); ++i) {
      deleted[i] = deleted[i] || elsewhere[i];
    }
  }
  response->set_num_deleted(static_cast<uint32_t>(std::count(deleted.begin(), deleted.end(), true)));
  return absl::OkStatus();
}

absl::Status TierService::Stats(const Caller& caller, const v1::StatsRequest&,
                                v1::StatsResponse* response) {
  response->set_version(PROXIMA_VERSION);
  response->set_uptime_seconds(
      static_cast<uint64_t>(absl::ToInt64Seconds(absl::Now() - start_time_)));
  if (!any_protected_) {  // one trust domain: the whole daemon's figures
    v1::TierStats* host = response->add_tiers();
    host->set_name("host");
    host->set_capacity_bytes(store_->capacity_bytes());
    host->set_used_bytes(store_->used_bytes());
    host->set_blocks(store_->host_blocks());
    host->set_evictions(store_->evictions());
    for (int level = 0; level < kMaxLevels; ++level) {
      if (level > 0 && store_->level_blocks(level) == 0) continue;
      v1::LevelStats* l = host->add_levels();
      l->set_level(level);
      l->set_blocks(store_->level_blocks(level));
      l->set_bytes(store_->level_bytes(level));
    }
    // The GPU tier's pools after the host tier (clients read tiers(0) as the host tier).
    for (size_t d = 0; d < store_->num_devices(); ++d) {
      v1::TierStats* gpu = response->add_tiers();
      gpu->set_name(absl::StrCat("gpu:", d));
      gpu->set_capacity_bytes(store_->device_pool(d).capacity_bytes());
      gpu->set_used_bytes(store_->device_pool(d).used_bytes());
      gpu->set_blocks(store_->device_blocks(d));
      v1::LevelStats* raw = gpu->add_levels();  // a GPU pool holds raw blocks only
      raw->set_level(0);
      raw->set_blocks(store_->device_blocks(d));
      raw->set_bytes(store_->device_pool(d).used_bytes());
    }
    response->set_crc_failures(store_->crc_failures());
    if (const RemoteBlocks* remote = remote_.load(); remote != nullptr) {
      remote->Describe(response->mutable_cluster());
    }
  }
  for (size_t i = 0; i < namespaces_.size(); ++i) {
    const Namespace& n = *namespaces_[i];
    const bool visible =
        caller.namespace_index >= 0 ? static_cast<size_t>(caller.namespace_index) == i : n.open;
    if (!visible) continue;
    v1::NamespaceStats* s = response->add_namespaces();
    s->set_name(n.name);
    s->set_blocks(counters_[i].blocks.load());
    s->set_bytes(counters_[i].bytes.load());
    s->set_max_bytes(n.max_bytes.load(std::memory_order_relaxed));
    s->set_puts(n.puts->value());
    s->set_get_hits(n.get_hits->value());
    s->set_get_misses(n.get_misses->value());
    s->set_lookup_hits(n.lookup_hits->value());
    s->set_lookup_misses(n.lookup_misses->value());
  }
  return absl::OkStatus();
}

}  // namespace proxima::daemon
