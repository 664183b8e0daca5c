// TierService: the transport-independent core of proximad. It validates proxima.v1 requests,
// resolves namespaces and model profiles, and runs them against the BlockStore. The gRPC layer
// (grpc_service.h) only decodes, calls this, and converts the Status at the edge, so the same core
// can be driven in-process by tests and fuzzers.
//
// Every error is an absl::Status whose code carries the gRPC meaning and whose message names the
// offending field and value: INVALID_ARGUMENT (malformed), NOT_FOUND (unknown namespace or
// profile), RESOURCE_EXHAUSTED (over a configured limit), UNAUTHENTICATED (no valid token for a
// namespace that needs one), PERMISSION_DENIED (a token of another namespace, or a read-only
// token asked to write). A rejected request changes nothing.
//
// Tenant isolation: every call runs as a Caller, established once per call by Authenticate()
// from its bearer token. A token belongs to one namespace; every namespace check goes through
// Authorize(), so no call can name, read, count or delete another namespace's blocks, and an
// error never says whether a block exists outside the caller's namespace.
//
// Thread-safe: every method may be called concurrently.
#ifndef PROXIMA_DAEMON_TIER_SERVICE_H_
#define PROXIMA_DAEMON_TIER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/status_macros.h"
#include "daemon/block_store.h"
#include "daemon/buffer_cache.h"
#include "daemon/cluster/remote_blocks.h"
#include "daemon/config.h"
#include "daemon/metrics.h"
#include "daemon/tierer.h"
#include "proto/wire.h"
#include "proxima/v1/kvtier.pb.h"

namespace proxima::daemon {

// Bytes a response message (KVTier's Get, Peer's FetchBlocks) needs beyond its blocks' data:
// per-block framing, and headroom for the rest of the message.
inline constexpr uint64_t kPerBlockOverhead = 64;
inline constexpr uint64_t kMessageOverhead = 4096;

// Whether `size` bytes stored at hierarchy `level` can be a block of a profile whose raw blocks
// are `block_bytes`: exactly that at level 0, else 1 to block_bytes + kMessageOverhead (an
// encoded container). INVALID_ARGUMENT reading "is N bytes at level L; expected ...".
absl::Status CheckStoredSize(uint32_t level, uint64_t size, uint64_t block_bytes);
// For level > 0: whether `bytes` is a STAR-KV container that decodes to `block_bytes` bytes
// (its header only; decoding checks the rest). INVALID_ARGUMENT reading "is at level L but ...".
absl::Status CheckStoredContainer(uint32_t level, std::span<const std::byte> bytes,
                                  uint64_t block_bytes);

// Geometry and raw block size of a registered profile.
struct RegisteredProfile {
  v1::ModelProfile profile;
  uint64_t block_bytes = 0;
};

// Raw block size of `profile` (2 * L * T * H * D * sizeof(dtype)), or INVALID_ARGUMENT naming
// the field that is zero, out of range or unknown.
absl::StatusOr<uint64_t> ProfileBlockBytes(const v1::ModelProfile& profile);

// The profile's id: a stable 64-bit FNV-1a hash of its fields (never 0), the same on every
// daemon and across restarts.
uint64_t ProfileId(const v1::ModelProfile& profile);

// Who is calling, as Authenticate() established it from the call's bearer token.
struct Caller {
  int namespace_index = -1;  // the token's namespace; -1: no token was presented
  TokenAccess access = TokenAccess::kReadWrite;
  uint32_t partition = 0;  // BlockId::partition of the token's scope
  std::string token_name;  // config name of the token, for errors and logs (never the token)

  // A call that presented no token: it may use open namespaces (those without tokens) only.
  static Caller Anonymous() { return Caller(); }
};

class TierService {
 public:
  // `registry` receives the daemon's metrics and must outlive the service.
  // Reads every namespace's tokens (files, environment variables): errors name the config key
  // and the file or variable, never a token.
  // With `tiers.gpu.capacity_bytes_per_device` set, a device pool of that size is allocated on
  // every visible GPU (none visible: logged, the host tier alone); a GPU that refuses it fails
  // the start with an error naming the key, the device and the size.
  static absl::StatusOr<std::unique_ptr<TierService>> Create(const DaemonConfig& config,
                                                             metrics::Registry* registry);
  // As Create, with the GPU tier's memory given (one pool per entry, whatever
  // tiers.gpu.capacity_bytes_per_device says): for tests of the GPU tier, on machines without a
  // GPU too (tier_testing.h).
  static absl::StatusOr<std::unique_ptr<TierService>> CreateWithDevices(
      const DaemonConfig& config, metrics::Registry* registry,
      std::vector<std::unique_ptr<DeviceMemory>> devices);
  ~TierService();

  // Maps the value of a call's `authorization` metadata ("Bearer <token>", or "" when absent) to
  // its Caller. Every configured token is compared, in constant time, whatever matches first.
  // UNAUTHENTICATED for a malformed header or a token this daemon does not know.
  absl::StatusOr<Caller> Authenticate(absl::string_view authorization) const;

  // Re-reads every configured token from its file or environment variable (token rotation,
  // proximad's SIGHUP) and puts the new set in force for every later call; calls in flight keep
  // the caller they were authenticated as. Which namespaces need a token, and each token's
  // namespace, access and scope, stay as configured. On any error (a file gone, empty, two
  // tokens equal, or one equal to one of `reserved`: the cluster's peer tokens) the previous
  // tokens stay in force and the error names the config key. Returns how many tokens are in
  // force.
  absl::StatusOr<size_t> ReloadTokens(std::span<const std::string> reserved = {});

  absl::Status GetServerInfo(const Caller& caller, const v1::GetServerInfoRequest& request,
                             v1::GetServerInfoResponse* response);
  absl::Status RegisterProfile(const Caller& caller, const v1::RegisterProfileRequest& request,
                               v1::RegisterProfileResponse* response);
  absl::Status Put(const Caller& caller, const v1::PutRequest& request, v1::PutResponse* response);
  // Put from a request still in its received buffers: block bytes are copied once, from the
  // network buffers into tier memory.
  absl::Status Put(const Caller& caller, const wire::PutRequestReader& request,
                   v1::PutResponse* response);
  // Get, without copying: `blocks` receives one entry per key (nullopt for a miss), each pinned
  // until the caller drops it. The gRPC layer sends the bytes straight from tier memory. With
  // BLOCK_FORMAT_RAW, encoded blocks are decoded into buffers the entries own (level 0), after
  // the daemon checked their stored bytes against their CRC32C (even with
  // client_verifies_crc32c: the client only sees the decoded bytes).
  // `inline_response`: the bytes go back in the gRPC response, which must fit
  // server.max_message_bytes (and they are counted as inline transfer bytes).
  absl::Status GetBlocks(const Caller& caller, const v1::GetRequest& request,
                         std::vector<std::optional<BlockStore::ReadBlock>>* blocks,
                         bool inline_response = true);
  // Decompress: GetBlocks with BLOCK_FORMAT_RAW.
  absl::Status DecompressBlocks(const Caller& caller, const v1::DecompressRequest& request,
                                std::vector<std::optional<BlockStore::ReadBlock>>* blocks,
                                bool inline_response = true);
  // Get into a GetResponse message (a copy of each block; for in-process callers).
  absl::Status Get(const Caller& caller, const v1::GetRequest& request, v1::GetResponse* response);
  absl::Status Lookup(const Caller& caller, const v1::LookupRequest& request,
                      v1::LookupResponse* response);
  absl::Status Delete(const Caller& caller, const v1::DeleteRequest& request,
                      v1::DeleteResponse* response);
  // The namespaces the caller may see (its token's, or the open ones without a token). Tier-wide
  // figures (usage, blocks, evictions, CRC failures) count every tenant's blocks, so they are
  // reported only when the daemon has no token-protected namespace.
  absl::Status Stats(const Caller& caller, const v1::StatsRequest& request,
                     v1::StatsResponse* response);

  // What a call may do to a namespace: read (Get, Lookup, ...) or write (Put, Delete).
  enum class Need { kRead, kWrite };
  // Where a call's blocks live once Authorize() has let `caller` in: its namespace, its token's
  // partition, and the registered profile it names.
  struct ResolvedProfile {
    uint32_t namespace_index = 0;
    uint32_t partition = 0;
    uint64_t profile_id = 0;
    RegisteredProfile profile;
  };
  // Authorizes `caller` for `need` on the namespace a call names (`method` names the call in
  // errors) and finds its registered profile: UNAUTHENTICATED / PERMISSION_DENIED / NOT_FOUND /
  // INVALID_ARGUMENT as for every other call.
  absl::StatusOr<ResolvedProfile> ResolveProfile(const Caller& caller,
                                                 const std::string& namespace_name,
                                                 uint64_t profile_id, Need need,
                                                 absl::string_view method);

  // Fills destinations with the bytes of the blocks to store: dst[j] receives the block whose
  // index is blocks[j], and crcs[j] the CRC32C of the bytes written there (the UCX worker
  // computes it while copying where it can). Returns once nothing writes into dst anymore, or
  // with an error (then `owner`, which owns dst, may be kept until writes stop).
  using PullFn = std::function<absl::Status(
      std::span<const size_t> blocks, std::span<const std::span<std::byte>> dst,
      std::span<uint32_t> crcs, std::shared_ptr<const void> owner)>;
  // Put whose bytes are pulled by the caller (UCX data plane): reserves tier memory for every
  // key not yet stored, lets `pull` fill it, checks each block against crcs[i], and only then
  // commits. A failed pull or CRC check stores nothing. REQUIRES: keys.size() == crcs.size(),
  // 1 .. max_batch_blocks keys.
  // `target` comes from ResolveProfile(..., Need::kWrite, ...). `hints` carries what a PutBlock
  // and PutRequest carry besides the bytes, with the same meaning.
  struct PulledHints {
    std::span<const int64_t> positions;  // empty, or one per key (negative: unknown)
    std::span<const float> importance;   // empty, or one per key
    bool high_priority = false;
  };
  absl::Status PutPulled(const ResolvedProfile& target, std::span<const BlockKey> keys,
                         std::span<const uint32_t> crcs, const PulledHints& hints,
                         const PullFn& pull, v1::PutResponse* response);

  // With the cluster on: Lookup and Get continue a local miss at the other nodes (one hop to the
  // key's home, then the holder), and puts tell the keys' homes where they are. Null (the
  // default) serves from the local tiers alone. `remote` must stay valid until SetRemote(nullptr)
  // returns and no call is running (Daemon sets it before serving and clears it after draining).
  void SetRemote(RemoteBlocks* remote) { remote_.store(remote); }

  // The index of the namespace configured as `name` (the cluster names namespaces by name
  // between daemons), or NOT_FOUND. No authorization: for peers that act for a caller another
  // daemon has authorized.
  absl::StatusOr<uint32_t> NamespaceIndex(const std::string& name) const {
    return FindNamespace(name);
  }

  // The name of namespace `ns` (an index from NamespaceIndex() or a BlockId).
  const std::string& NamespaceName(uint32_t ns) const { return namespaces_[ns]->name; }

  // The raw block size of profile `profile_id` in namespace `ns`, or NOT_FOUND when it is not
  // registered there. No authorization (for the cluster, like NamespaceIndex).
  absl::StatusOr<uint64_t> RegisteredBlockBytes(uint32_t ns, uint64_t profile_id) {
    PROXIMA_ASSIGN_OR_RETURN(RegisteredProfile p, FindProfile(ns, profile_id));
    return p.block_bytes;
  }

  // Registers `profile` in namespace `ns` as RegisterProfile does (same checks and limit), with
  // no caller to authorize: for profiles read back from a snapshot (daemon/snapshot.h). Returns
  // its id.
  absl::StatusOr<uint64_t> AddProfile(uint32_t ns, const v1::ModelProfile& profile);
  // Every registered profile: (namespace index, profile).
  std::vector<std::pair<uint32_t, v1::ModelProfile>> Profiles();

  // The token scope that partition `partition` of namespace `ns` stands for ("" for partition
  // 0, the namespace's shared blocks), or nullopt for a partition the config does not have; and
  // back. Partition numbers follow the order of the config's tokens, so a snapshot names scopes.
  std::optional<std::string> PartitionScope(uint32_t ns, uint32_t partition) const;
  std::optional<uint32_t> ScopePartition(uint32_t ns, const std::string& scope) const;

  // The attributes a block of profile `profile_id` put into namespace `ns` with the hints of
  // `put` (position, high priority, importance: second_chance) gets under this daemon's config,
  // as a Put derives them; for blocks read back from a snapshot written under another config.
  BlockAttributes AttributesAgain(uint32_t ns, uint64_t profile_id, const BlockAttributes& put);
  // namespaces[].max_bytes: whether namespace `ns` may take `bytes` more now, making room among
  // its own blocks first (its coldest compressed a level, then its least recently used evicted)
  // when they would pass its limit. False (counted) when `bytes` alone pass it or none of its
  // blocks can give way (all being read). Always true for a namespace without a limit. With
  // `bytes` 0, brings the namespace back within its limit (after puts that ran at once).
  bool RoomInNamespace(uint32_t ns, uint64_t bytes);
  // SIGHUP with a changed config file (Daemon::Reconfigure): namespace `ns`'s max_bytes becomes
  // `max_bytes` (0: no limit) for later puts, the tierer's pressure, Stats and the metrics. A
  // lowered limit is reached at once, by making room among the namespace's blocks as a put would
  // (its coldest encoded, then its least recently used evicted); false when some could not give
  // way yet (being read), and later puts go on making room.
  bool SetNamespaceLimit(uint32_t ns, uint64_t max_bytes);
  // namespaces[].max_bytes: whether namespace `ns` holds `bytes` more without making room (a
  // peer's spilled or handed-off blocks never evict the namespace's own).
  bool FitsInNamespace(uint32_t ns, uint64_t bytes) const {
    const uint64_t limit = namespaces_[ns]->max_bytes.load(std::memory_order_relaxed);
    return limit == 0 || store_->namespace_bytes(ns) + bytes <= limit;
  }

  // How a block's level is named outside this daemon (to a peer it is spilled or handed off to,
  // and to the next start, in the snapshot): the text of that level's codec plan
  // (CodecPlan::ToString) in namespace `ns`'s hierarchy; "" for level 0 or a level it lacks.
  const std::string& LevelPlanText(uint32_t ns, uint8_t level) const;
  // The level of namespace `ns`'s hierarchy whose plan has the text `plan`, for a block at
  // `level` of another hierarchy (a peer's, or this daemon's under its last config); nullopt
  // when this hierarchy has no such plan: the block is to be decoded to raw (level 0), and the
  // tierer encodes it down this hierarchy. `level` as it is when it is 0 or `plan` is empty (a
  // writer from before plans were named).
  std::optional<uint8_t> LevelOfPlan(uint32_t ns, uint8_t level, absl::string_view plan) const;

  BlockStore& store() { return *store_; }
  Tierer& tierer() { return *tierer_; }
  uint32_t max_batch_blocks() const { return config_.server.max_batch_blocks; }
  uint32_t max_lookup_keys() const { return config_.server.max_lookup_keys; }

 private:
  struct Namespace {
    std::string name;
    bool open = true;  // no tokens configured: any caller may use it
    metrics::Counter* puts = nullptr;
    metrics::Counter* get_hits = nullptr;
    metrics::Counter* get_misses = nullptr;
    metrics::Counter* lookup_hits = nullptr;
    metrics::Counter* lookup_misses = nullptr;
    // namespaces[].max_bytes; 0: no limit of its own. Changed by SetNamespaceLimit.
    std::atomic<uint64_t> max_bytes{0};
    std::vector<std::string> plan_texts;  // LevelPlanText of each level, [level - 1]
    // Its blocks evicted, and its puts refused, to keep it within max_bytes.
    metrics::Counter* limit_evictions = nullptr;
    metrics::Counter* limit_refusals = nullptr;
    proxima::Mutex mu;
    absl::flat_hash_map<uint64_t, RegisteredProfile> profiles ABSL_GUARDED_BY(mu);
  };

  TierService(const DaemonConfig& config, std::unique_ptr<HostTier> tier,
              std::vector<std::unique_ptr<DeviceMemory>> devices, metrics::Registry* registry);

  // One block of a Put, wherever its bytes are.
  struct PutSource {
    const std::string* key;
    uint64_t data_size;
    bool has_crc32c;
    uint32_t crc32c;
    int64_t position;                                     // PutBlock.position, -1 when unset
    float importance;                                     // PutBlock.importance
    std::function<uint32_t()> data_crc32c;                // CRC32C of the data, read in place
    std::function<void(std::span<std::byte>)> copy_data;  // copies the data out
  };
  absl::Status PutBlocks(const Caller& caller, const std::string& namespace_name,
                         uint64_t profile_id, std::span<const PutSource> blocks, bool high_priority,
                         v1::PutResponse* response);
  // Tier memory for a block a worker puts: the tierer's Reserve, with the cluster (if on) asked
  // to spill cold blocks to peers before anything is evicted.
  std::optional<BlockStore::PendingBlock> ReserveForPut(uint64_t bytes);
  // Tier memory holding a copy of `bytes` (a raw block): `device` (a GPU pool's reservation, from
  // Tierer::ReserveOnDevice) when given and the copy into it succeeds, else host memory from
  // ReserveForPut (a failed device copy is logged); nullopt when neither has room.
  std::optional<BlockStore::PendingBlock> Land(std::optional<BlockStore::PendingBlock> device,
                                               std::span<const std::byte> bytes);
  // Tells the cluster (if on) that the local tiers hold `keys` of namespace `ns`.
  void TellRemote(uint32_t ns, uint32_t partition, uint64_t profile_id,
                  std::span<const BlockKey> keys);
  // The codec geometry of a registered profile; nullopt when unknown or not encodable (fp8).
  std::optional<Tierer::ProfileCodec> ProfileCodecOf(uint32_t ns, uint64_t profile_id);
  // GetBlocks' decode: found[i] for each i in `which` (stored encoded, checked) becomes its raw
  // bytes (level 0, a buffer of its own from decode_buffers_) or, where it fails to decode, a
  // miss (counted and logged; from_peer[i]: fetched from a peer, not stored here). On up to
  // server.decode_threads threads.
  void DecodeFound(std::span<const BlockId> ids, uint64_t block_bytes,
                   std::span<const size_t> which, const std::vector<bool>& from_peer,
                   std::vector<std::optional<BlockStore::ReadBlock>>& found);

  // One configured token and who presenting it makes you.
  struct Token {
    std::string secret;
    Caller caller;
  };
  // The namespace and partition a call may act on, or why not.
  struct Scope {
    uint32_t namespace_index = 0;
    uint32_t partition = 0;
  };
  // The only gate between a call and a namespace: checks that `caller` may use `name` for
  // `need` (`method` names the call in errors).
  absl::StatusOr<Scope> Authorize(const Caller& caller, const std::string& name, Need need,
                                  absl::string_view method) const;
  // At start: which namespaces need a token, and their tokens.
  absl::Status LoadTokens(const DaemonConfig& config);
  // Reads every configured token from its file or variable; errors name the config key.
  absl::StatusOr<std::vector<Token>> ReadTokens(const DaemonConfig& config,
                                                std::span<const std::string> reserved = {}) const;
  absl::StatusOr<uint32_t> FindNamespace(const std::string& name) const;
  absl::StatusOr<RegisteredProfile> FindProfile(uint32_t ns, uint64_t profile_id);
  // Validates namespace, profile and keys of a keyed request; fills `ids`.
  absl::Status ResolveKeys(const Caller& caller, Need need, const std::string& method,
                           const std::string& namespace_name, uint64_t profile_id,
                           const google::protobuf::RepeatedPtrField<std::string>& keys,
                           uint32_t max_keys, RegisteredProfile* profile,
                           std::vector<BlockId>* ids);

  const DaemonConfig config_;
  const absl::Time start_time_;
  std::vector<std::unique_ptr<Namespace>> namespaces_;
  // Per namespace, the scope of each partition (index): "" for 0, then the token scopes of a
  // namespace with private_prefixes in config order (ScopesOf).
  std::vector<std::vector<std::string>> partition_scopes_;
  // Replaced whole by ReloadTokens(); every call reads the current table.
  std::atomic<std::shared_ptr<const std::vector<Token>>> tokens_;
  metrics::Counter* token_reloads_ = nullptr;
  bool any_protected_ = false;  // some namespace needs a token
  std::unique_ptr<NamespaceCounters[]> counters_;
  std::unique_ptr<BlockStore> store_;
  std::unique_ptr<Tierer> tierer_;  // after store_: stopped and destroyed before it
  metrics::Counter* decodes_ = nullptr;
  metrics::Counter* decode_microseconds_ = nullptr;
  metrics::Counter* decode_failures_ = nullptr;
  BufferCache decode_buffers_;  // DecodeFound's output buffers, reused once responses are sent
  metrics::Counter* bytes_in_ = nullptr;
  metrics::Counter* bytes_out_ = nullptr;
  std::atomic<RemoteBlocks*> remote_{nullptr};
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_TIER_SERVICE_H_
