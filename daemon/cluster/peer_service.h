// PeerService: this daemon's side of proxima.v1.Peer (proto/proxima/v1/peer.proto), what the
// other daemons of the cluster call. Every call must carry the cluster's peer token; the callers
// have authenticated and authorized their own workers already, so the service acts on any
// namespace (by name) and partition it is asked about, and nothing else.
//
// A synchronous gRPC service on purpose: the worker-facing handlers (callback API) block while
// they wait for peers, and may hold every callback thread of the daemon; peer calls are served
// by the sync server's own threads, so two daemons waiting on each other always make progress.
//
// Thread-safe: gRPC calls the handlers concurrently.
#ifndef PROXIMA_DAEMON_CLUSTER_PEER_SERVICE_H_
#define PROXIMA_DAEMON_CLUSTER_PEER_SERVICE_H_

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/cluster/location_table.h"
#include "daemon/cluster/peer_tokens.h"
#include "daemon/cluster/peer_ucx.h"
#include "daemon/cluster/recent_deletes.h"
#include "daemon/cluster/remote_blocks.h"
#include "daemon/metrics.h"
#include "daemon/tier_service.h"
#include "proxima/v1/peer.grpc.pb.h"

namespace proxima::daemon::cluster {

// The BlockIds a PeerBlockSet names on this daemon, its scope resolved by name. INVALID_ARGUMENT
// for a malformed key, more than `max_keys` keys, or (from an older sender, which names no
// scope) a partition number the namespace does not have here; NOT_FOUND for a namespace, or a
// token scope of it, this daemon does not have.
absl::StatusOr<std::vector<BlockId>> ResolveBlockSet(const TierService& core,
                                                     const v1::PeerBlockSet& set,
                                                     size_t max_keys);
// Names namespace `ns`'s partition `partition` in `set` as peers resolve it: the partition's
// token scope, and its number here for older receivers.
void NamePartition(const TierService& core, uint32_t ns, uint32_t partition, v1::PeerBlockSet* set);

class PeerService final : public v1::Peer::Service {
 public:
  // Which blocks peers spill here this node keeps: while its host tier stays at or below
  // `below` of its capacity (0: none); and blocks a peer hands off as it shuts down, as
  // recently used, in room made by evicting this node's least recently used blocks when
  // `handoff_evicts` (otherwise only below `below`, as spills).
  struct Acceptance {
    double below = 0;
    bool handoff_evicts = false;
  };
  // `core`, `records`, `remote` and `registry` must outlive the service. `self` is this daemon's
  // node id. Blocks peers spill here are kept as `accept` says, and `remote` tells their homes
  // (Stored).
  // `ucx` (null without the UCX data plane) sends fetched blocks to readers as UCX messages, and
  // takes spilled blocks that come as UCX messages.
  // `recent_delete_window`: how long a deleted key's spills are declined (NoteDeleted): as long
  // as a peer that missed the Delete may still send a copy older than it (Cluster's
  // RecentDeleteWindow). `recent_delete_slack`: a Delete's skew between the nodes plus a spill
  // call's transit (RecentDeletes).
  PeerService(TierService* core, LocationTable* records, RemoteBlocks* remote, PeerUcx* ucx,
              std::string self, const PeerTokens* tokens, uint64_t max_message_bytes,
              Acceptance accept, metrics::Registry* registry,
              absl::Duration recent_delete_window = absl::Seconds(5),
              absl::Duration recent_delete_slack = absl::Seconds(5));

  grpc::Status RecordLocations(grpc::ServerContext* context,
                               const v1::RecordLocationsRequest* request,
                               v1::RecordLocationsResponse* response) override;
  grpc::Status LookupLocations(grpc::ServerContext* context,
                               const v1::LookupLocationsRequest* request,
                               v1::LookupLocationsResponse* response) override;
  grpc::Status FetchBlocks(grpc::ServerContext* context, const v1::FetchBlocksRequest* request,
                           v1::FetchBlocksResponse* response) override;
  grpc::Status StoreBlocks(grpc::ServerContext* context, const v1::StoreBlocksRequest* request,
                           v1::StoreBlocksResponse* response) override;
  grpc::Status DeleteBlocks(grpc::ServerContext* context, const v1::DeleteBlocksRequest* request,
                            v1::DeleteBlocksResponse* response) override;
  grpc::Status Rejoin(grpc::ServerContext* context, const v1::RejoinRequest* request,
                      v1::RejoinResponse* response) override;

  grpc::Status Leave(grpc::ServerContext* context, const v1::LeaveRequest* request,
                     v1::LeaveResponse* response) override;

  // Called with the node id of each Rejoin (set before the service serves).
  using RejoinFn = std::function<void(const std::string& node)>;
  void OnRejoin(RejoinFn fn) { on_rejoin_ = std::move(fn); }
  // Whether `node` is in this daemon's live set: a record naming a holder that is not is not
  // kept (set before the service serves; unset, every record is). A holder this daemon does not
  // count live is never read from, and its record could replace a live holder's; one that has
  // just joined sends its records again when this daemon sees it join (Peer.Rejoin).
  using IsLiveFn = std::function<bool(const std::string& node)>;
  void SetIsLive(IsLiveFn fn) { is_live_ = std::move(fn); }
  // Called with the node id of each Leave; its error is the call's (set before the service
  // serves).
  using LeaveFn = std::function<absl::Status(const std::string& node)>;
  void OnLeave(LeaveFn fn) { on_leave_ = std::move(fn); }

  // The bodies, transport aside (the handlers authenticate, then call these).
  absl::Status ServeRecord(const v1::RecordLocationsRequest& request,
                           v1::RecordLocationsResponse* response);
  absl::Status ServeLookup(const v1::LookupLocationsRequest& request,
                           v1::LookupLocationsResponse* response);
  // `deadline`: the call's (UCX sends must be done before it).
  absl::Status ServeFetch(const v1::FetchBlocksRequest& request,
                          v1::FetchBlocksResponse* response,
                          absl::Time deadline = absl::InfiniteFuture());
  absl::Status ServeDelete(const v1::DeleteBlocksRequest& request,
                           v1::DeleteBlocksResponse* response);
  absl::Status ServeRejoin(const v1::RejoinRequest& request, v1::RejoinResponse* response);
  absl::Status ServeLeave(const v1::LeaveRequest& request);
  // `deadline`: the call's (a spill's UCX messages must have arrived by then).
  absl::Status ServeStore(const v1::StoreBlocksRequest& request, v1::StoreBlocksResponse* response,
                          absl::Time deadline = absl::InfiniteFuture());

  // Keys a worker's Delete on this node just removed (or asked every node to), by the Delete
  // `delete_id`: a peer's spill of one of them that arrives within the recent-delete window is
  // declined unless its sender saw that Delete too (RecentDeletes). Deletes that peers send
  // (DeleteBlocks) are noted by ServeDelete itself.
  void NoteDeleted(std::span<const BlockId> ids, uint64_t delete_id) {
    recent_deletes_.Add(ids, delete_id);
  }
  // The last Delete of `id` this node saw within the window (0: none), which a spill of this
  // node's copy names (SpilledBlock.after_delete).
  uint64_t LastDelete(const BlockId& id) const { return recent_deletes_.Last(id); }
  // How far back this node's memory of Deletes reaches now (StoreBlocksRequest.deletes_known_ms).
  absl::Duration DeletesKnownFor() const { return recent_deletes_.Reach(); }
  // Whether this node started less than its recent-delete window ago and has not learned the
  // Deletes from before its start from a peer (RejoinRequest.want_recent_deletes).
  bool WantsRecentDeletes() const { return recent_deletes_.Reach() < recent_deletes_.window(); }
  // Takes in the Deletes a peer's Rejoin answer carries; returns how many keys it learned of.
  // A set naming a namespace this node does not serve, or malformed, is skipped (logged).
  size_t LearnDeletes(const std::string& peer, const v1::RejoinResponse& response);

  // Peer calls being served now (a draining daemon waits for them; Daemon::Shutdown).
  int in_flight() const { return in_flight_.load(); }

 private:
  absl::Status Authenticate(const grpc::ServerContext& context) const;
  template <typename Req, typename Resp, typename Serve>
  grpc::Status Handle(grpc::ServerContext* context, const Req* request, Resp* response,
                      Serve serve);

  std::atomic<int> in_flight_{0};
  TierService* const core_;
  LocationTable* const records_;
  RemoteBlocks* const remote_;
  PeerUcx* const ucx_;
  const std::string self_;
  const PeerTokens* const tokens_;
  const uint64_t max_message_bytes_;
  const Acceptance accept_;
  metrics::Counter* unauthenticated_ = nullptr;
  metrics::Counter* records_refused_ = nullptr;
  metrics::Counter* served_bytes_ = nullptr;
  metrics::Counter* spill_kept_ = nullptr;
  metrics::Counter* spill_refused_ = nullptr;
  metrics::Counter* spill_declined_deleted_ = nullptr;
  metrics::Counter* spill_decoded_ = nullptr;
  metrics::Counter* deletes_learned_ = nullptr;
  metrics::Counter* spill_bytes_in_ = nullptr;
  RecentDeletes recent_deletes_;
  RejoinFn on_rejoin_;
  LeaveFn on_leave_;
  IsLiveFn is_live_;
};

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_PEER_SERVICE_H_
