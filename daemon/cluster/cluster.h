// Cluster: this daemon's part in a cluster of proximad peers (docs/cluster.md, DESIGN.md
// section 6). It implements RemoteBlocks for the core, serves proxima.v1.Peer to the other
// daemons (PeerService), and keeps the live set (Membership).
//
//   put      the block lands in the local tiers; afterwards its home node (rendezvous hashing
//            of (namespace, key) over the live set, daemon/placement.h) is told, in the
//            background and batched per home, that this node holds it.
//   lookup   the local prefix first; then the rest of the chain from the keys' homes, one
//            LookupLocations call per home, in parallel (one hop).
//   get      local first; then holders from the homes (within half of the call's peer budget,
//            so that a hung home costs only its own keys), then FetchBlocks from each holder,
//            in parallel; the bytes are checked against their CRC32C on arrival.
//   delete   local first; then DeleteBlocks at every live peer, in parallel (a home may not know
//            of a copy yet: records travel in the background). A spill whose key is deleted
//            here while its blocks are on the way asks the peer to delete its copies after.
//   evict    blocks that leave the local tiers otherwise (evicted, spilled, dropped for a bad
//            CRC32C) are logged by the store; the record sender tells their homes to drop the
//            records naming this node, so lookups elsewhere stop counting them.
//   change   when the live set changes, about 1/N of the keys change home: the record sender
//            walks the local tiers and sends each such block's record to its new home (and a
//            forget to the old one, when it is still live), so blocks stay findable from every
//            node across joins, leaves and restarts.
//   spill    while the host tier is fuller than cluster.spill.threshold, a spiller thread sends
//            its coldest blocks (StoreBlocks, batched per peer) to the first of each key's best
//            rendezvous nodes that has room; a peer keeps them below its accept_below share,
//            becomes their holder and tells their homes; then this node drops its copies. A put
//            that finds the tier full waits for a round (MakeRoom, cluster.spill.put_wait)
//            before it evicts.
//
// The remote part of any call shares one budget, cluster.peer_deadline: every peer call carries
// the call's absolute deadline. A peer that is down, slow, or answers wrongly is a miss. Records
// naming a node that leaves the live set are dropped, and so is a record whose fetch missed.
// The record sender keeps, per key, only the latest of "record" and "forget" queued for it, and
// sends one round at a time, so a home sees a key's changes in the order they happened. One
// whose call fails (the home did not answer in time or could not be reached) is sent again with
// a backoff while the home stays live, unless a newer one for the key replaces it.
//
// Block bytes of fetches and spills travel as UCX messages between daemons that both run the
// UCX data plane (PeerUcx; cluster.transport auto), inline in the gRPC messages otherwise.
//
// Thread-safe. Threads: Membership's, one record sender, and (cluster.spill.enabled) one spiller.
#ifndef PROXIMA_DAEMON_CLUSTER_CLUSTER_H_
#define PROXIMA_DAEMON_CLUSTER_CLUSTER_H_

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "daemon/cluster/location_table.h"
#include "daemon/cluster/membership.h"
#include "daemon/cluster/peer_service.h"
#include "daemon/cluster/peer_tokens.h"
#include "daemon/cluster/peer_ucx.h"
#include "daemon/cluster/remote_blocks.h"
#include "daemon/config.h"
#include "daemon/metrics.h"
#include "daemon/tier_service.h"
#include "daemon/ucx_transport.h"

namespace proxima::daemon::cluster {

class Cluster final : public RemoteBlocks {
 public:
  // Reads the peer token (cluster.peer_token), builds the membership and the peer service.
  // `core` and `registry` must outlive the cluster. Nothing runs until Start().
  // `ucx` (null without the UCX data plane): block bytes between daemons then move over UCX
  // (cluster.transport auto); it must outlive the cluster.
  static absl::StatusOr<std::unique_ptr<Cluster>> Create(const DaemonConfig& config,
                                                         TierService* core, UcxTransport* ucx,
                                                         metrics::Registry* registry);
  ~Cluster() override;  // Stop()s

  // The gRPC service to register on the daemon's server.
  PeerService* service() { return service_.get(); }
  Membership& membership() { return *membership_; }
  LocationTable& records() { return records_; }

  // SIGHUP: cluster.peer_token read again (`tokens`: PeerTokens::Read's result). They replace
  // the tokens in force when each is valid and none is a namespace token now in force;
  // otherwise the error is logged and returned, and the tokens in force stay.
  absl::Status ReloadPeerTokens(absl::StatusOr<std::vector<std::string>> tokens);
  // The peer tokens in force, the presented one first.
  std::shared_ptr<const std::vector<std::string>> peer_tokens() const { return tokens_->Get(); }

  // Starts membership (health checks, DNS) and the record sender.
  void Start();
  // Stops the threads. Calls still running finish within their deadline.
  void Stop();

  // Peers told that this node is leaving, and those the call failed for.
  struct Leaving {
    uint64_t told = 0;
    uint64_t failed = 0;
  };
  // For a node starting to shut down: tells every live peer (Peer.Leave) to drop this node from
  // its live set now, rather than after its health checks fail. From here on this node sends no
  // location record naming itself (its peers dropped those; one sent now could replace the
  // record of the peer a hand-off moves the block to), only forgets. Waits at most
  // cluster.peer_deadline.
  Leaving TellPeersLeaving();

  // What a hand-off moved, and the host blocks it left behind.
  struct Handoff {
    uint64_t blocks = 0;
    uint64_t bytes = 0;
    uint64_t left_blocks = 0;
    // Blocks a peer declined because it had seen a Delete of them this node had not (this
    // node missed it, hung or leaving): dropped here, not left behind.
    uint64_t deleted_blocks = 0;
    uint64_t rounds = 0;
    // Why it stopped: "every block placed", "budget spent", "no peer took more" (every live
    // peer refused or failed its last call), "no live peer", "spill off".
    const char* ended = "spill off";
  };
  // For a node shutting down once its calls have finished (cluster.spill.handoff): stops the
  // spiller, then sends the host tier's blocks to peers (as spills, except that a peer with
  // cluster.spill.handoff_evicts makes room by evicting its least recently used blocks; each
  // tells the blocks' homes), most recently used first, blocks peers spilled here included,
  // until none is left, no peer takes any more, or `budget` has passed. GPU tier blocks stay.
  // Nothing is sent with spill off.
  Handoff HandOff(absl::Duration budget);

  void Stored(const RemoteBlockSet& blocks) override;
  void Removed(const RemoteBlockSet& blocks) override;
  size_t LookupChain(const RemoteBlockSet& blocks) override;
  std::vector<std::optional<RemoteBlock>> Fetch(const RemoteBlockSet& blocks) override;
  std::vector<bool> DeleteRemote(const RemoteBlockSet& blocks) override;
  bool MakeRoom() override;
  void Describe(v1::ClusterStats* out) const override;

 private:
  // Records (or forgets) for one home, one namespace/partition/profile.
  struct Batch {
    std::string home;
    std::string namespace_name;
    uint32_t partition = 0;
    uint64_t profile_id = 0;
    bool forget = false;
    std::string holder;          // the holder the records name (forget: whose records to drop)
    std::vector<BlockKey> keys;  // BatchesFor's: the keys whose home this is
  };
  // A batch without its `forget`: (home, namespace, partition, profile, holder).
  using BatchKey = std::tuple<std::string, std::string, uint32_t, uint64_t, std::string>;
  // The keys queued for one BatchKey, each with its latest intent: true = forget, false = record.
  using Intents = absl::flat_hash_map<BlockKey, bool>;

  Cluster(const DaemonConfig& config, TierService* core, metrics::Registry* registry);
  // Records (or, with `forget`, their removal) of this node holding `blocks`, one batch per
  // home of the keys (none for keys whose home is this node, or when it is alone).
  std::vector<Batch> BatchesFor(const RemoteBlockSet& blocks, bool forget) const;
  // The holder of each key ("" = none known or not live), asking the keys' homes by `deadline`.
  std::vector<std::string> Locate(const RemoteBlockSet& blocks, const LiveSet& live,
                                  absl::Time deadline);
  void Enqueue(const Batch& batch, std::span<const BlockKey> keys);
  // Queues forgets for the blocks the store logged as gone since the last call (evicted,
  // spilled, dropped). REQUIRES: tell_mu_ held, so that a key's departure is queued before a
  // later put of it queues its record (Stored).
  void ForgetDepartures();
  void RunSender();
  // Sends what is queued now, and the retries that are due (one round).
  void SendQueued();
  // The live set differs from the one the local blocks were last announced for: records of the
  // blocks whose home changed go to their new homes (sender thread).
  void Reannounce(const LiveSet& live);
  // A peer rejoined (Peer.Rejoin) or joined the live set: the records of the local blocks whose
  // home `node` is go to it (sender thread). Nothing when it is not in `live` (its join, when
  // it comes, queues it again).
  void AnnounceTo(const LiveSet& live, const std::string& node);
  // Records of the local blocks whose home under `live` differs from their home under
  // `before`, to their new homes (and a forget to the old one while it is live); returns how
  // many records were queued.
  uint64_t AnnounceChanged(const LiveSet& live, const std::vector<PlacementNode>& before);
  // Tells `peers`, which just entered this node's live set, that this node rejoined.
  void SendRejoins(const std::vector<std::string>& peers);
  // Sends `batches` to their homes; returns the intents whose call failed in a way that a later
  // call may not (the home did not answer in time or could not be reached).
  absl::flat_hash_map<BatchKey, Intents> SendAll(
      const absl::flat_hash_map<BatchKey, Intents>& batches);
  // Records and forgets whose call failed, to be sent again: with a backoff, while their home
  // stays live, for kRecordRetryFor at most. A home that missed one would otherwise not learn of
  // it until the live set changes or the block is put again.
  struct Retry {
    Intents intents;
    absl::Time first_failed;
    absl::Time due;
    absl::Duration backoff;
  };
  // Queues `failed` (SendAll's) for a retry, but not the keys with a newer intent queued since;
  // `retried` holds the retries this round sent (their first failure and backoff carry over).
  void QueueRetries(absl::flat_hash_map<BatchKey, Intents> failed,
                    const absl::flat_hash_map<BatchKey, Retry>& retried);
  // A Delete that did not reach a peer (its call failed, or the peer was out of the live set),
  // sent again by the sender thread: at once when the peer is (back) in the live set, then with
  // the records' backoff, for kRecordRetryFor at most. A peer that hung past peer_deadline, or
  // was cut off from this node for a while, would otherwise go on serving the deleted blocks.
  struct DeleteRetry {
    std::string peer;
    v1::DeleteBlocksRequest request;  // keeps its delete_id
    absl::Time first_failed;          // when the Delete was made (its first calls)
    absl::Time due;
    absl::Duration backoff;
  };
  // Queues `retry` unless it has run out of time or the queues are full (then dropped).
  void QueueDeleteRetry(DeleteRetry retry);
  // Counts and logs a Delete given up on for its peer.
  void DropDeleteRetry(const DeleteRetry& retry, absl::Time now);
  // Sends the Delete retries that are due to peers now live (sender thread).
  void SendDeleteRetries();
  void AddAuth(grpc::ClientContext* context, absl::Time deadline) const;
  // Runs `calls` to their peers in parallel (each with the peer token and `deadline`), starting
  // each with the stub's PrepareAsync `method`; returns when all have finished. A peer whose
  // call fails or times out is suspect for kSuspectFor; with `skip_suspects` (the calls a
  // worker waits for: lookups, fetches, deletes) a call to a suspect peer is not made but
  // answered UNAVAILABLE at once. Records and spills are background work: they always try.
  // With `wait_for_ready`, a call waits for the peer's connection until its deadline instead of
  // failing at once while the channel is not connected: for the calls whose loss is not made
  // up by a later round (records, rejoins, a spill's withdrawals, a hand-off).
  template <typename Call, typename Method>
  void CallAll(std::vector<std::unique_ptr<Call>>& calls, absl::Time deadline, Method method,
               bool skip_suspects = false, bool wait_for_ready = false);
  // Wakes the spiller when the host tier is over cluster.spill.threshold.
  void WakeSpillerIfFull();
  void RunSpiller();
  // A hand-off in progress: its end, and what it moved.
  struct HandoffState {
    absl::Time until;
    Handoff moved;
  };
  // One spill round: up to kMaxSpillRoundBytes of the coldest blocks to peers with room.
  // kMoved when some block left (or was dropped, deleted on the peer) or a peer is to be sent
  // them inline next (the caller goes on while the tier is still over the threshold), kIdle
  // when the tier is not over it, kStuck when no peer took any. With `handoff`: the hottest
  // blocks, whatever the tier's fill, each call by handoff->until.
  enum class SpillRound { kIdle, kMoved, kStuck };
  SpillRound SpillOnce(HandoffState* handoff = nullptr);

  const DaemonConfig config_;
  const std::string self_;
  const absl::Duration peer_deadline_;
  TierService* const core_;
  std::unique_ptr<PeerTokens> tokens_;
  LocationTable records_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<PeerUcx> ucx_;  // null: fetched bytes come inline
  std::unique_ptr<PeerService> service_;

  metrics::Counter* remote_lookup_hits_ = nullptr;
  metrics::Counter* remote_get_hits_ = nullptr;
  metrics::Counter* remote_get_misses_ = nullptr;
  metrics::Counter* peer_token_reloads_ = nullptr;
  metrics::Counter* crc_failures_ = nullptr;
  metrics::Counter* peer_call_failures_ = nullptr;
  metrics::Counter* skipped_calls_ = nullptr;
  metrics::Counter* records_sent_ = nullptr;
  metrics::Counter* forgets_sent_ = nullptr;
  metrics::Counter* reannounced_ = nullptr;
  metrics::Counter* records_dropped_ = nullptr;
  metrics::Counter* records_retried_ = nullptr;
  metrics::Counter* bytes_in_ = nullptr;
  metrics::Counter* spilled_blocks_ = nullptr;
  metrics::Counter* spill_no_room_ = nullptr;
  metrics::Counter* spill_deleted_on_peer_ = nullptr;
  metrics::Counter* spill_withdrawn_ = nullptr;
  metrics::Counter* deletes_retried_ = nullptr;
  metrics::Counter* deletes_dropped_ = nullptr;
  metrics::Counter* spill_bytes_out_ = nullptr;
  metrics::Counter* put_waits_room_ = nullptr;
  metrics::Counter* put_waits_none_ = nullptr;
  metrics::Counter* put_waits_timeout_ = nullptr;

  // Held while the store's departures are drained and queued, and while a put's records are
  // queued (order: tell_mu_, then queue_mu_ or the store's departure log).
  std::mutex tell_mu_;
  // The record sender's queue: keys per batch, waiting to be sent.
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  absl::flat_hash_map<BatchKey, Intents> queue_;                 // guarded by queue_mu_
  size_t queued_keys_ = 0;                                       // guarded by queue_mu_
  // Failed records and forgets waiting to be sent again; a newer intent for a key queued in
  // queue_ removes it here (Enqueue). Their keys count in kMaxQueuedKeys too.
  absl::flat_hash_map<BatchKey, Retry> retry_;                   // guarded by queue_mu_
  size_t retry_keys_ = 0;                                        // guarded by queue_mu_
  // Deletes peers missed, and their keys (which count in kMaxQueuedKeys too).
  std::vector<DeleteRetry> delete_retries_;                      // guarded by queue_mu_
  size_t delete_retry_keys_ = 0;                                 // guarded by queue_mu_
  // Whether `keys` more fit in kMaxQueuedKeys beside the queued records, their retries and the
  // Delete retries; queue_mu_ held.
  bool RoomForKeys(size_t keys) const;
  bool stopping_ = false;                                        // guarded by queue_mu_
  bool leaving_ = false;  // TellPeersLeaving was called; guarded by queue_mu_
  // Peers that entered the live set, to be sent Rejoin; peers that entered it or whose Rejoin
  // came in, to be sent the records they are home to. Both guarded by queue_mu_, taken by the
  // sender thread.
  std::vector<std::string> rejoin_to_;
  std::vector<std::string> announce_to_;
  std::thread sender_;
  // The live set's node ids the local blocks' records were last sent for (sender thread only;
  // empty before the first round: every block put while alone is announced then).
  std::vector<PlacementNode> announced_for_;

  // The spiller: woken by puts that leave the tier over the threshold (and every 250 ms).
  std::condition_variable spill_cv_;  // with queue_mu_
  bool spill_wanted_ = false;         // guarded by queue_mu_
  bool spiller_stopping_ = false;     // HandOff: the spiller thread ends; guarded by queue_mu_
  // Spill rounds, for puts that wait on them (MakeRoom): each round's end is signalled on
  // spill_done_cv_ (with queue_mu_).
  std::condition_variable spill_done_cv_;
  uint64_t spill_rounds_ = 0;         // rounds finished; guarded by queue_mu_
  bool spill_round_running_ = false;  // guarded by queue_mu_
  SpillRound last_round_ = SpillRound::kIdle;  // guarded by queue_mu_
  absl::Time last_round_end_;         // guarded by queue_mu_
  std::thread spiller_;
  // What the spiller knows of a peer's room for spilled blocks. Spiller thread only.
  struct PeerRoom {
    uint64_t bytes = UINT64_MAX;  // what it said it would still keep (unknown: unlimited)
    absl::Time retry_at;          // after a refusal or a failed call: left alone until then,
                                  // then sent one block
    std::string ucx_worker;       // its UCX worker, when it takes spilled blocks as messages
    absl::Time ucx_retry_at;      // after a failed UCX spill: inline until then
  };
  absl::flat_hash_map<std::string, PeerRoom> rooms_;
  // Peers left alone after a failed or timed-out call, until when (CallAll).
  proxima::Mutex suspects_mu_;
  absl::flat_hash_map<std::string, absl::Time> suspect_until_ ABSL_GUARDED_BY(suspects_mu_);
};

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_CLUSTER_H_
