// TierService: the transport-independent core of proximad. It validates proxima.v1 requests,
// resolves namespaces and model profiles, and runs them against the BlockStore. The gRPC layer
// (grpc_service.h) only decodes, calls this, and converts the Status at the edge, so the same core
// can be driven in-process by tests and fuzzers.
//
// Every error is an absl::Status whose code carries the gRPC meaning and whose message names the
// offending field and value: INVALID_ARGUMENT (malformed), NOT_FOUND (unknown namespace or
// profile), RESOURCE_EXHAUSTED (over a configured limit). A rejected request changes nothing.
//
// Thread-safe: every method may be called concurrently.
#ifndef PROXIMA_DAEMON_TIER_SERVICE_H_
#define PROXIMA_DAEMON_TIER_SERVICE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "absl/time/time.h"
#include "daemon/block_store.h"
#include "daemon/config.h"
#include "daemon/metrics.h"
#include "proto/wire.h"
#include "proxima/v1/kvtier.pb.h"

namespace proxima::daemon {

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

class TierService {
 public:
  // `registry` receives the daemon's metrics and must outlive the service.
  static absl::StatusOr<std::unique_ptr<TierService>> Create(const DaemonConfig& config,
                                                             metrics::Registry* registry);
  ~TierService();

  absl::Status GetServerInfo(const v1::GetServerInfoRequest& request,
                             v1::GetServerInfoResponse* response);
  absl::Status RegisterProfile(const v1::RegisterProfileRequest& request,
                               v1::RegisterProfileResponse* response);
  absl::Status Put(const v1::PutRequest& request, v1::PutResponse* response);
  // Put from a request still in its received buffers: block bytes are copied once, from the
  // network buffers into tier memory.
  absl::Status Put(const wire::PutRequestReader& request, v1::PutResponse* response);
  // Get, without copying: `blocks` receives one entry per key (nullopt for a miss), each pinned
  // until the caller drops it. The gRPC layer sends the bytes straight from tier memory.
  // `inline_response`: the bytes go back in the gRPC response, which must fit
  // server.max_message_bytes (and they are counted as inline transfer bytes).
  absl::Status GetBlocks(const v1::GetRequest& request,
                         std::vector<std::optional<BlockStore::ReadBlock>>* blocks,
                         bool inline_response = true);
  // Get into a GetResponse message (a copy of each block; for in-process callers).
  absl::Status Get(const v1::GetRequest& request, v1::GetResponse* response);
  absl::Status Lookup(const v1::LookupRequest& request, v1::LookupResponse* response);
  absl::Status Delete(const v1::DeleteRequest& request, v1::DeleteResponse* response);
  absl::Status Stats(const v1::StatsRequest& request, v1::StatsResponse* response);

  // The namespace index and registered profile a call names (NOT_FOUND / INVALID_ARGUMENT as
  // for every other call).
  absl::StatusOr<std::pair<uint32_t, RegisteredProfile>> ResolveProfile(
      const std::string& namespace_name, uint64_t profile_id);

  // Fills destinations with the bytes of the blocks to store: dst[j] receives the block whose
  // index is blocks[j]. Returns once nothing writes into dst anymore, or with an error (then
  // `owner`, which owns dst, may be kept until writes stop).
  using PullFn = std::function<absl::Status(std::span<const size_t> blocks,
                                            std::span<const std::span<std::byte>> dst,
                                            std::shared_ptr<const void> owner)>;
  // Put whose bytes are pulled by the caller (UCX data plane): reserves tier memory for every
  // key not yet stored, lets `pull` fill it, checks each block against crcs[i], and only then
  // commits. A failed pull or CRC check stores nothing. REQUIRES: keys.size() == crcs.size(),
  // 1 .. max_batch_blocks keys.
  absl::Status PutPulled(uint32_t ns, uint64_t profile_id, const RegisteredProfile& profile,
                         std::span<const BlockKey> keys, std::span<const uint32_t> crcs,
                         const PullFn& pull, v1::PutResponse* response);

  BlockStore& store() { return *store_; }
  uint32_t max_batch_blocks() const { return config_.server.max_batch_blocks; }
  uint32_t max_lookup_keys() const { return config_.server.max_lookup_keys; }

 private:
  struct Namespace {
    std::string name;
    metrics::Counter* puts = nullptr;
    metrics::Counter* get_hits = nullptr;
    metrics::Counter* get_misses = nullptr;
    metrics::Counter* lookup_hits = nullptr;
    metrics::Counter* lookup_misses = nullptr;
    proxima::Mutex mu;
    absl::flat_hash_map<uint64_t, RegisteredProfile> profiles ABSL_GUARDED_BY(mu);
  };

  TierService(const DaemonConfig& config, std::unique_ptr<HostTier> tier,
              metrics::Registry* registry);

  // One block of a Put, wherever its bytes are.
  struct PutSource {
    const std::string* key;
    uint64_t data_size;
    bool has_crc32c;
    uint32_t crc32c;
    std::function<uint32_t()> data_crc32c;                // CRC32C of the data, read in place
    std::function<void(std::span<std::byte>)> copy_data;  // copies the data out
  };
  absl::Status PutBlocks(const std::string& namespace_name, uint64_t profile_id,
                         std::span<const PutSource> blocks, v1::PutResponse* response);

  absl::StatusOr<uint32_t> FindNamespace(const std::string& name) const;
  absl::StatusOr<RegisteredProfile> FindProfile(uint32_t ns, uint64_t profile_id);
  // Validates namespace, profile and keys of a keyed request; fills `ids`.
  absl::Status ResolveKeys(const std::string& method, const std::string& namespace_name,
                           uint64_t profile_id,
                           const google::protobuf::RepeatedPtrField<std::string>& keys,
                           uint32_t max_keys, RegisteredProfile* profile,
                           std::vector<BlockId>* ids);

  const DaemonConfig config_;
  const absl::Time start_time_;
  std::vector<std::unique_ptr<Namespace>> namespaces_;
  std::unique_ptr<NamespaceCounters[]> counters_;
  std::unique_ptr<BlockStore> store_;
  metrics::Counter* bytes_in_ = nullptr;
  metrics::Counter* bytes_out_ = nullptr;
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_TIER_SERVICE_H_
