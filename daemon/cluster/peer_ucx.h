// PeerUcx: block bytes between daemons of a cluster over UCX (docs/cluster.md), on the daemon's
// own UCX worker (UcxTransport's), the control plane staying proxima.v1.Peer on gRPC.
//
//   reader   takes a registered receive buffer with a slot per requested block from its receive
//            pool (reused across calls, daemon/cluster/receive_pool.h) and names it in its
//            FetchBlocks request (worker address, packed rkey, registration id, address, slot
//            size);
//   holder   pins the found blocks, writes each into its slot with one-sided puts from the
//            registered tier arena, flushes, and answers sizes and CRC32Cs instead of bytes.
//   spill    the other way round: the sender names its worker, its arena's rkey and each cold
//            block's address; the receiver pulls the blocks it keeps straight into its own tier
//            memory with one-sided gets, and checks their CRC32Cs before they become visible.
//
// The reader checks every block against its CRC32C on arrival, as for bytes that came inline.
// A holder that cannot reach the reader's worker answers inline; a transfer that fails or runs
// past the call's deadline fails the call (UNAVAILABLE), and the reader counts its blocks as
// misses. Endpoints to readers are kept and reused, and dropped once they fail; so are the
// remote keys unpacked on them, for the buffers a reader names by registration id.
//
// Thread-safe.
#ifndef PROXIMA_DAEMON_CLUSTER_PEER_UCX_H_
#define PROXIMA_DAEMON_CLUSTER_PEER_UCX_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/ucx.h"
#include "daemon/block_store.h"
#include "daemon/cluster/receive_pool.h"
#include "daemon/metrics.h"
#include "proxima/v1/peer.pb.h"

namespace proxima::daemon::cluster {

class PeerUcx {
 public:
  // Endpoints to readers kept at most (the least recently opened goes first past it).
  static constexpr size_t kMaxEndpoints = 256;

  // `worker` and `arena` (the host tier's registration on it) must outlive this object and
  // every ReceiveBuffer it hands out. `receive_pool_bytes`: the most bytes of receive buffers
  // kept idle for reuse (cluster.receive_pool_bytes).
  PeerUcx(ucx::Worker* worker, const ucx::Registration* arena, uint64_t receive_pool_bytes,
          metrics::Registry* registry);

  // Reader side: at least `slots` slots of `slot_bytes`, registered for the holder's puts, from
  // the receive pool. The buffer returns to the pool when its last handle is dropped.
  using ReceiveBuffer = ReceivePool::Buffer;
  absl::StatusOr<std::shared_ptr<const ReceiveBuffer>> NewReceiveBuffer(size_t slots,
                                                                        size_t slot_bytes) {
    return pool_.Get(slots, slot_bytes);
  }
  // Keeps the buffer of a failed call out of the pool until `until` (ReceivePool::Quarantine).
  void Quarantine(std::shared_ptr<const ReceiveBuffer> buffer, absl::Time until) {
    pool_.Quarantine(std::move(buffer), until);
  }
  // Names `buffer` in `request` (the ucx_* fields).
  void Describe(const ReceiveBuffer& buffer, v1::FetchBlocksRequest* request) const;

  // Holder side: writes `blocks[i]` (pinned, in the tier arena) into slot i of the request's
  // receive buffer, for every i with `send[i]`, by `deadline`. INVALID_ARGUMENT for malformed
  // ucx_* fields, FAILED_PRECONDITION when the reader's worker cannot be reached (answer
  // inline then), UNAVAILABLE when the transfer failed.
  absl::Status Write(const v1::FetchBlocksRequest& request,
                     std::shared_ptr<const std::vector<std::optional<BlockStore::ReadBlock>>> blocks,
                     const std::vector<bool>& send, absl::Time deadline);

  // Sender side of a spill: names this worker and the tier arena in `request`.
  void DescribeArena(v1::StoreBlocksRequest* request) const;

  // Receiver side of a spill: pulls each (remote address, local destination) pair from the
  // sender's arena (`worker_address`, `rkey`, registered as `registration_id` there, 0 if
  // unknown) into this daemon's tier memory. `keep_alive` owns the destinations (released once
  // UCX no longer writes them). Errors as Write().
  struct Pull {
    uint64_t remote_address = 0;
    std::span<std::byte> local;
  };
  absl::Status Read(const std::string& worker_address, const std::string& rkey,
                    uint64_t registration_id, const std::vector<Pull>& pulls,
                    std::shared_ptr<const void> keep_alive, absl::Time deadline);

  // Counts bytes that arrived through a receive buffer (fetch) or a pull (spill).
  void CountIn(uint64_t bytes) { bytes_in_->Increment(bytes); }

 private:
  absl::StatusOr<std::shared_ptr<ucx::Endpoint>> EndpointTo(const std::string& address,
                                                            absl::Time deadline);
  // Runs `ops` against the worker at `address` with the one packed `rkey` (Write and Read);
  // a nonzero `registration_id` keeps the key unpacked on the endpoint for later calls.
  absl::Status Run(const std::string& address, const std::string& rkey, uint64_t registration_id,
                   std::vector<ucx::Op> ops, std::shared_ptr<const void> keep_alive,
                   absl::Time deadline);
  void Drop(const std::string& address);

  ucx::Worker* const worker_;
  const ucx::Registration* const arena_;
  metrics::Counter* bytes_in_ = nullptr;
  metrics::Counter* bytes_out_ = nullptr;
  ReceivePool pool_;

  proxima::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<ucx::Endpoint>> endpoints_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> opened_ ABSL_GUARDED_BY(mu_);  // endpoint addresses, oldest first
};

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_PEER_UCX_H_
