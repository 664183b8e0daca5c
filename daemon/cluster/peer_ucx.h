// PeerUcx: block bytes of fetches between daemons of a cluster over UCX (docs/cluster.md), on
// the daemon's own UCX worker (UcxTransport's), the control plane staying proxima.v1.Peer on
// gRPC. The bytes move as UCX messages (ucx::Worker::Send / Collect), not one-sided operations:
// over tcp, the target of a one-sided operation answers its initiator from inside UCX, and UCX
// aborts the whole process when that initiator has died (tools/ucx_repro/ucx_dead_peer_repro);
// a message to or from a dead peer only fails or goes uncollected.
//
//   reader   names its worker, a fresh transfer id and the largest block it takes this way in its
//            FetchBlocks request;
//   holder   pins the found blocks, sends each as one message (slot = its index in the request)
//            straight from the tier arena, waits until UCX is done with the bytes, and answers
//            sizes and CRC32Cs instead of bytes;
//   reader   collects the slots the answer names (by the call's deadline) and serves each block
//            from the message it arrived in, after checking its CRC32C as for bytes that came
//            inline.
//   spill    the same the other way round: a receiver names its worker in its StoreBlocks
//            answers; the sender's later rounds to it send each block as a message of a
//            transfer of the sender's choosing (Push) before the StoreBlocks call that names
//            the transfer, and the receiver collects them and checks them as inline bytes.
//
// A worker address from a peer is parsed by this process's UCX only once a child process
// survived parsing it (ucx::AddressCheck, ucx.check_worker_addresses): a holder waits for that
// verdict during half the call's time at most, as does a spill sender (whose check starts when
// the receiver's answer names the address); both move the blocks inline until it is in, and
// for good when the address was refused.
// A holder that cannot reach the reader's worker answers inline; a send that fails or runs past
// the call's deadline fails the call (UNAVAILABLE), and the reader counts its blocks as misses.
// Endpoints to peers are kept and reused, and dropped once they fail.
//
// Thread-safe.
#ifndef PROXIMA_DAEMON_CLUSTER_PEER_UCX_H_
#define PROXIMA_DAEMON_CLUSTER_PEER_UCX_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/ucx.h"
#include "daemon/block_store.h"
#include "daemon/metrics.h"
#include "proxima/v1/peer.pb.h"

namespace proxima::daemon::cluster {

class PeerUcx {
 public:
  // Endpoints to readers kept at most (the least recently opened goes first past it).
  static constexpr size_t kMaxEndpoints = 256;

  // `worker` must outlive this object and every Parcel it hands out.
  PeerUcx(ucx::Worker* worker, metrics::Registry* registry);

  // Reader side: names this worker and a fresh transfer in `request` (the ucx_* fields), for
  // blocks of at most `max_block_bytes`. Returns the transfer id.
  uint64_t Describe(uint64_t max_block_bytes, v1::FetchBlocksRequest* request);
  // Reader side, once the holder answered: the blocks it sent at `slots` of `transfer` (one
  // entry per slot, null for one that did not arrive by `deadline`). Also after a failed call
  // (no slots): its transfer's messages are dropped.
  std::vector<std::shared_ptr<const ucx::Parcel>> Collect(uint64_t transfer,
                                                          std::span<const uint32_t> slots,
                                                          absl::Time deadline) {
    return worker_->Collect(transfer, slots, deadline);
  }

  // Holder side: sends `blocks[i]` (pinned, in the tier arena) as slot i of the request's
  // transfer, for every i with `send[i]`, by `deadline`. INVALID_ARGUMENT for malformed ucx_*
  // fields, FAILED_PRECONDITION when the reader's worker cannot be reached (answer inline then),
  // UNAVAILABLE when the sends failed.
  absl::Status Write(const v1::FetchBlocksRequest& request,
                     std::shared_ptr<const std::vector<std::optional<BlockStore::ReadBlock>>> blocks,
                     const std::vector<bool>& send, absl::Time deadline);

  // Spill receiver: this daemon's worker address (StoreBlocksResponse.ucx_worker).
  const std::string& address() const { return worker_->address(); }
  // Spill sender: sends `blocks[j]` (pinned by the caller until this returns) as slot j of a
  // new transfer to the worker at `address`, by `deadline`, and returns the transfer's id
  // (sequential from a random start: unique at the receiver, whose own ids start elsewhere).
  // Errors as Write().
  absl::StatusOr<uint64_t> Push(const std::string& address,
                                std::span<const std::span<const std::byte>> blocks,
                                absl::Time deadline);

  // Spill sender: the verdict so far of ucx.check_worker_addresses on a receiver's worker
  // `address` (from its answer), without waiting: OK, UNAVAILABLE while there is none yet (the
  // check is started if it was not), or the refusal.
  absl::Status Verdict(const std::string& address);

  // Counts bytes that arrived as messages.
  void CountIn(uint64_t bytes) { bytes_in_->Increment(bytes); }

 private:
  absl::StatusOr<std::shared_ptr<ucx::Endpoint>> EndpointTo(const std::string& address,
                                                            absl::Time deadline);
  void Drop(const std::string& address);
  // Sends `messages` for `transfer` to the worker at `address` (Write and Push).
  absl::Status SendTo(const std::string& address, uint64_t transfer,
                      std::vector<ucx::Message> messages, std::shared_ptr<const void> keep_alive,
                      absl::Time deadline);

  ucx::Worker* const worker_;
  metrics::Counter* bytes_in_ = nullptr;
  metrics::Counter* bytes_out_ = nullptr;

  proxima::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<ucx::Endpoint>> endpoints_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> opened_ ABSL_GUARDED_BY(mu_);  // endpoint addresses, oldest first
};

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_PEER_UCX_H_
