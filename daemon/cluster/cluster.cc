#include "daemon/cluster/cluster.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <span>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/credentials.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "daemon/cluster/recent_deletes.h"
#include "daemon/placement.h"
#include "proxima/v1/peer.grpc.pb.h"

namespace proxima::daemon::cluster {
namespace {

// Location records a home keeps at most (about 80 bytes each).
constexpr size_t kMaxRecords = 4u << 20;
// Keys waiting in the record sender's queue at most; past it new records are dropped (counted):
// a lost record is a miss, and a put never waits for peers.
constexpr size_t kMaxQueuedKeys = 1u << 20;
// Block bytes one spill round takes at most (copied into the StoreBlocks requests).
constexpr uint64_t kMaxSpillRoundBytes = 64ull << 20;
// How long a peer that answered full (or failed a StoreBlocks) is left alone.
constexpr absl::Duration kPeerFullBackoff = absl::Seconds(1);
// How long a peer whose UCX worker failed a spill gets its spilled blocks inline instead.
constexpr absl::Duration kUcxRetryAfter = absl::Seconds(30);
// The spiller's wake-up period when no put wakes it.
constexpr auto kSpillPeriod = std::chrono::milliseconds(250);
// How often the record sender looks for blocks that left the local tiers (evicted, spilled)
// when no put or delete wakes it: the longest a home may go on naming this node for them.
constexpr auto kDeparturePeriod = std::chrono::milliseconds(100);
// How long a peer whose call failed or timed out is left alone (its calls answer as misses at
// once) before it is tried again; health checks take a dead one out of the live set meanwhile.
constexpr absl::Duration kSuspectFor = absl::Seconds(1);
// Keys queued before a re-announcement (a live-set change) sends a round mid-walk.
constexpr size_t kReannounceRoundKeys = 64u << 10;
// A failed record or forget (or a Delete a peer missed) is sent again after kRecordRetryFirst,
// then after twice as long each time up to kRecordRetryMax, and dropped (counted) once it first
// failed kRecordRetryFor ago: a peer that fails calls that long is not going to answer.
constexpr absl::Duration kRecordRetryFirst = absl::Milliseconds(250);
constexpr absl::Duration kRecordRetryMax = absl::Seconds(8);
constexpr absl::Duration kRecordRetryFor = absl::Seconds(60);

// How long a node declines a peer's spill or hand-off of a key deleted here unless the sender saw
// that Delete (RecentDeletes): as long as a node that missed the Delete may still send a copy
// older than it. A node missed it either because it hung (this node's peers send the Delete
// again for kRecordRetryFor) or because it was leaving (its peers no longer send it Deletes while
// it drains, for up to server.shutdown_grace_seconds, and hands off, for up to
// cluster.spill.handoff); plus a Delete's skew between the nodes and a spill call (twice
// peer_deadline, the slack RecentDeletes is given), and a second. The rest of a cluster is taken
// to share this node's settings.
absl::Duration RecentDeleteWindow(const DaemonConfig& config) {
  const ClusterConfig& c = config.cluster;
  const absl::Duration leaving = absl::Seconds(config.server.shutdown_grace_seconds) +
                                 absl::Seconds(c.spill_enabled ? c.spill_handoff_seconds : 0);
  return std::max(kRecordRetryFor, leaving) + 2 * absl::Seconds(c.peer_deadline_seconds) +
         absl::Seconds(1);
}

// A tenant holding a peer token could read every namespace through proxima.v1.Peer.
absl::Status CheckNotANamespaceToken(const TierService& core,
                                     const std::vector<std::string>& tokens) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    absl::StatusOr<Caller> as_tenant = core.Authenticate("Bearer " + tokens[i]);
    if (as_tenant.ok() && as_tenant->namespace_index >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cluster.peer_token's token ", i + 1, " is the same as namespace token '",
          as_tenant->token_name, "'; a peer token must be a secret of the daemons alone"));
    }
  }
  return absl::OkStatus();
}

// A record or delete call that failed so that the next one may not: the peer did not answer in
// time, could not be reached, or was too busy. Not a refusal (a bad token, an unknown namespace).
bool RetryPeerCall(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::UNKNOWN:
      return true;
    default:
      return false;
  }
}

// At most one line per this period about a peer's bad answers or bytes, per kind: a broken peer
// sends them on every call.
constexpr std::chrono::seconds kBadPeerLogEvery(10);

// Whether a peer's answer to `call` holds one entry of `field` per key asked about. One that does
// not comes from a broken peer (or one that is no proximad of this protocol): logged through
// `limiter`, naming the peer and the counts, and the caller ignores the answer as a failed call.
bool AnswerFits(log::Limiter& limiter, const std::string& peer, std::string_view call,
                std::string_view field, int entries, size_t keys) {
  if (entries >= 0 && static_cast<size_t>(entries) == keys) return true;
  PROXIMA_LOG_LIMITED(kWarning, limiter)
      << "a peer answered with other than one entry per key; answer ignored"
      << log::Kv("peer", peer) << log::Kv("call", call) << log::Kv("field", field)
      << log::Kv("entries", entries) << log::Kv("expected", keys);
  return false;
}

void FillSet(const TierService& core, const RemoteBlockSet& blocks, std::span<const size_t> which,
             v1::PeerBlockSet* out) {
  out->set_namespace_name(blocks.namespace_name);
  NamePartition(core, blocks.namespace_index, blocks.partition, out);
  out->set_profile_id(blocks.profile_id);
  for (size_t i : which) {
    out->add_keys(reinterpret_cast<const char*>(blocks.keys[i].data()), kKeyBytes);
  }
}

BlockId IdOf(const RemoteBlockSet& blocks, size_t i) {
  return BlockId{blocks.namespace_index, blocks.profile_id, blocks.keys[i], blocks.partition};
}

// One unary peer call, run in parallel with others by RunAll().
template <typename Req, typename Resp>
struct PeerCall {
  std::string peer;
  std::vector<size_t> which;  // indices into the caller's keys
  std::unique_ptr<v1::Peer::Stub> stub;
  grpc::ClientContext context;
  Req request;
  Resp response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> reader;
};

// Starts every call (`prepare(call, cq)` returns its PrepareAsync* reader) on a completion queue
// that this thread drives itself, and returns once all have finished; each call carries a
// deadline, so that is bounded. Not gRPC's callback API: its completions run on gRPC's own
// threads, which the blocked request handlers of this very daemon may all be holding.
template <typename Call, typename Prepare>
void RunAll(const std::vector<Call*>& calls, Prepare prepare) {
  if (calls.empty()) return;
  grpc::CompletionQueue cq;
  for (Call* call : calls) {
    call->reader = prepare(call, &cq);
    call->reader->StartCall();
    call->reader->Finish(&call->response, &call->status, call);
  }
  void* tag = nullptr;
  bool ok = false;
  for (size_t done = 0; done < calls.size() && cq.Next(&tag, &ok); ++done) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

// Calls to `peer` about the keys `which` (indices into the caller's keys), at most `per_call`
// keys a call, their block sets filled, appended to `calls`.
template <typename Call>
void AppendCalls(const TierService& core, const RemoteBlockSet& blocks, const std::string& peer,
                 std::span<const size_t> which, size_t per_call,
                 std::vector<std::unique_ptr<Call>>* calls) {
  for (size_t first = 0; first < which.size(); first += per_call) {
    auto call = std::make_unique<Call>();
    call->peer = peer;
    call->which.assign(which.begin() + first,
                       which.begin() + std::min(which.size(), first + per_call));
    FillSet(core, blocks, call->which, call->request.mutable_blocks());
    calls->push_back(std::move(call));
  }
}

// One call per holder (other than `self`) that `holders` names, of at most `per_call` keys
// each: their indices into the caller's keys in `which`, their block set filled.
template <typename Call>
std::vector<std::unique_ptr<Call>> CallsPerHolder(const TierService& core,
                                                  const RemoteBlockSet& blocks,
                                                  const std::vector<std::string>& holders,
                                                  const std::string& self, size_t per_call) {
  absl::flat_hash_map<std::string, std::vector<size_t>> per_holder;
  for (size_t i = 0; i < holders.size(); ++i) {
    if (!holders[i].empty() && holders[i] != self) per_holder[holders[i]].push_back(i);
  }
  std::vector<std::unique_ptr<Call>> calls;
  for (auto& [holder, which] : per_holder) {
    AppendCalls(core, blocks, holder, which, per_call, &calls);
  }
  return calls;
}

// Calls to each of `peers`, each asking about every key, at most `per_call` keys a call.
template <typename Call>
std::vector<std::unique_ptr<Call>> CallsToPeers(const TierService& core,
                                                const RemoteBlockSet& blocks,
                                                std::span<const std::string> peers,
                                                size_t per_call) {
  std::vector<size_t> all(blocks.keys.size());
  std::iota(all.begin(), all.end(), size_t{0});
  std::vector<std::unique_ptr<Call>> calls;
  for (const std::string& peer : peers) AppendCalls(core, blocks, peer, all, per_call, &calls);
  return calls;
}

}  // namespace

template <typename Call, typename Method>
void Cluster::CallAll(std::vector<std::unique_ptr<Call>>& calls, absl::Time deadline, Method method,
                      bool skip_suspects, bool wait_for_ready) {
  const absl::Time start = absl::Now();
  std::vector<Call*> started;
  {
    proxima::MutexLock lock(&suspects_mu_);
    for (auto& call : calls) {
      auto it = suspect_until_.find(call->peer);
      if (skip_suspects && it != suspect_until_.end() && start < it->second) {
        call->status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                    absl::StrCat("peer ", call->peer,
                                                 " left alone: a call to it failed or timed out "
                                                 "less than ",
                                                 absl::FormatDuration(kSuspectFor), " ago"));
        skipped_calls_->Increment();
      } else {
        started.push_back(call.get());
      }
    }
  }
  RunAll(started, [&](Call* call, grpc::CompletionQueue* cq) {
    call->stub = v1::Peer::NewStub(membership_->Channel(call->peer));
    AddAuth(&call->context, deadline);
    // The peer's channel may still be backing off from its restart when health checks
    // already count it live again.
    if (wait_for_ready) call->context.set_wait_for_ready(true);
    return ((*call->stub).*method)(&call->context, call->request, cq);
  });
  // A peer that did not answer in time (with at least half the peer deadline to do it), or
  // could not be reached, is left alone for a while: the calls after this one answer at once
  // instead of each waiting for it until health checks take it out of the live set.
  const bool had_time = deadline - start >= peer_deadline_ / 2;
  const absl::Time until = absl::Now() + kSuspectFor;
  proxima::MutexLock lock(&suspects_mu_);
  for (Call* call : started) {
    const grpc::StatusCode code = call->status.error_code();
    if (code == grpc::StatusCode::UNAVAILABLE ||
        (code == grpc::StatusCode::DEADLINE_EXCEEDED && had_time)) {
      auto [it, added] = suspect_until_.try_emplace(call->peer, until);
      if (added || it->second < start) {
        PROXIMA_LOG(kWarning) << "a peer call failed; calls to the peer answer as misses for a "
                                 "while"
                              << log::Kv("peer", call->peer)
                              << log::Kv("error", call->status.error_message())
                              << log::Kv("for", absl::FormatDuration(kSuspectFor));
      }
      it->second = std::max(it->second, until);
    } else if (call->status.ok()) {
      suspect_until_.erase(call->peer);
    }
  }
}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Create(const DaemonConfig& config,
                                                         TierService* core, UcxTransport* ucx,
                                                         metrics::Registry* registry) {
  const ClusterConfig& c = config.cluster;
  std::unique_ptr<Cluster> cluster(new Cluster(config, core, registry));
  PROXIMA_ASSIGN_OR_RETURN(std::vector<std::string> tokens, PeerTokens::Read(c));
  PROXIMA_RETURN_IF_ERROR(CheckNotANamespaceToken(*core, tokens));
  cluster->tokens_ = std::make_unique<PeerTokens>(std::move(tokens));
  PROXIMA_ASSIGN_OR_RETURN(cluster->membership_,
                           Membership::Create(MembershipOptions::FromConfig(config), registry));
  Cluster* self = cluster.get();
  cluster->membership_->OnChange([self](const std::string& peer, bool live) {
    if (live) {
      {
        std::lock_guard<std::mutex> lock(self->queue_mu_);
        // It may have kept this node's records as their home until it restarted, unnoticed.
        self->rejoin_to_.push_back(peer);
        // It may have left and come back while the sender was busy, unseen by Reannounce.
        self->announce_to_.push_back(peer);
      }
      self->queue_cv_.notify_one();
      return;
    }
    const size_t dropped = self->records_.DropHolder(peer);
    self->records_dropped_->Increment(dropped);
    PROXIMA_LOG(kInfo) << "location records of a lost peer dropped" << log::Kv("peer", peer)
                       << log::Kv("records", dropped);
  });
  if (c.transport == "ucx" && ucx == nullptr) {
    return absl::InvalidArgumentError(
        "cluster.transport is 'ucx' but this daemon runs no UCX data plane (ucx.enabled: false)");
  }
  // UCX does not encrypt: with server.tls, block bytes between daemons stay inside TLS unless
  // the operator asks for UCX by name.
  if (ucx != nullptr &&
      (c.transport == "ucx" || (c.transport == "auto" && !config.server.tls.enabled()))) {
    cluster->ucx_ = std::make_unique<PeerUcx>(ucx->mutable_worker(), registry);
  }
  cluster->service_ = std::make_unique<PeerService>(
      core, &cluster->records_, cluster.get(), cluster->ucx_.get(), c.advertise,
      cluster->tokens_.get(), config.server.max_message_bytes,
      PeerService::Acceptance{c.spill_enabled ? c.spill_accept_below : 0.0,
                              c.spill_enabled && c.spill_handoff_evicts},
      registry, RecentDeleteWindow(config), 2 * cluster->peer_deadline_ + absl::Seconds(1));
  cluster->service_->SetIsLive(
      [self](const std::string& node) { return self->membership_->Live()->Contains(node); });
  cluster->service_->OnLeave(
      [self](const std::string& node) { return self->membership_->MarkLeft(node); });
  cluster->service_->OnRejoin([self](const std::string& node) {
    if (self->membership_->Live()->Contains(node)) {
      // It may have restarted empty, faster than health checks notice: the records naming it
      // are of blocks it may no longer hold, and lookups would count them until a get missed
      // each. It sends the records of what it holds after its Rejoin calls (RunSender).
      const size_t dropped = self->records_.DropHolder(node);
      self->records_dropped_->Increment(dropped);
      PROXIMA_LOG(kInfo) << "a peer rejoined; the location records naming it dropped until it "
                            "sends them again"
                         << log::Kv("peer", node) << log::Kv("records", dropped);
    }
    {
      std::lock_guard<std::mutex> lock(self->queue_mu_);
      self->announce_to_.push_back(node);
    }
    self->queue_cv_.notify_one();
  });
  return cluster;
}

Cluster::Cluster(const DaemonConfig& config, TierService* core, metrics::Registry* registry)
    : config_(config),
      self_(config.cluster.advertise),
      peer_deadline_(absl::Seconds(config.cluster.peer_deadline_seconds)),
      core_(core),
      records_(kMaxRecords) {
  remote_lookup_hits_ = registry->AddCounter(
      "proxima_cluster_remote_lookup_hits_total",
      "Keys a Lookup found on other nodes (after its local prefix)");
  remote_get_hits_ = registry->AddCounter("proxima_cluster_remote_get_hits_total",
                                          "Blocks a Get read from other nodes");
  peer_token_reloads_ = registry->AddCounter(
      "proxima_cluster_peer_token_reloads_total",
      "Successful re-reads of cluster.peer_token (SIGHUP); a failed one keeps the tokens in force "
      "and is logged");
  remote_get_misses_ = registry->AddCounter(
      "proxima_cluster_remote_get_misses_total",
      "Local Get misses that no other node served either (no record, holder down, late, or "
      "evicted there)");
  crc_failures_ = registry->AddCounter(
      "proxima_cluster_fetch_crc_failures_total",
      "Blocks fetched from a peer whose bytes failed their CRC32C or size check (dropped)");
  peer_call_failures_ = registry->AddCounter(
      "proxima_cluster_peer_call_failures_total",
      "Peer calls that failed or missed their deadline, or were not made (a peer left alone "
      "after a failure); each answered as misses");
  skipped_calls_ = registry->AddCounter(
      "proxima_cluster_peer_calls_skipped_total",
      "Peer calls not made because a call to that peer failed or timed out less than 1 s "
      "before (answered as misses at once)");
  records_sent_ = registry->AddCounter("proxima_cluster_location_records_sent_total",
                                       "Location records sent to home nodes after local puts");
  reannounced_ = registry->AddCounter(
      "proxima_cluster_location_records_reannounced_total",
      "Records of local blocks queued for their new home after the live set changed");
  forgets_sent_ = registry->AddCounter(
      "proxima_cluster_location_forgets_sent_total",
      "Keys whose location records this node asked their homes to drop: blocks deleted, "
      "evicted, spilled or dropped here, or found gone by a fetch");
  records_dropped_ = registry->AddCounter(
      "proxima_cluster_location_records_dropped_total",
      "Location records dropped: holder left the live set or rejoined it (it sends its records "
      "again), a fetch missed, a queue or the table was full, or their home failed every call "
      "for 60 s");
  records_retried_ = registry->AddCounter(
      "proxima_cluster_location_records_retried_total",
      "Location records and forgets sent again because their call to the home failed (timed "
      "out, could not connect)");
  deletes_retried_ = registry->AddCounter(
      "proxima_cluster_deletes_retried_total",
      "Keys of Deletes sent again to a peer that missed them (its call failed, or it was out of "
      "the live set when the Delete ran)");
  deletes_dropped_ = registry->AddCounter(
      "proxima_cluster_deletes_dropped_total",
      "Keys of Deletes given up on for a peer: no call reached it within 60 s, or the queues "
      "were full");
  bytes_in_ = metrics::TransferBytes(registry, "peer_grpc", "in");
  spilled_blocks_ = registry->AddCounter("proxima_cluster_spill_sent_blocks_total",
                                         "Cold blocks this node spilled to peers, by outcome",
                                         {{"outcome", "moved"}});
  spill_no_room_ = registry->AddCounter(
      "proxima_cluster_spill_sent_blocks_total",
      "Cold blocks this node spilled to peers, by outcome",
      {{"outcome", "no_peer_room"}});  // no candidate peer had room (or answered)
  // The peer had seen a Delete of the key that this node had not: the copy was dropped here.
  spill_deleted_on_peer_ = registry->AddCounter(
      "proxima_cluster_spill_sent_blocks_total",
      "Cold blocks this node spilled to peers, by outcome", {{"outcome", "deleted_on_peer"}});
  spill_withdrawn_ = registry->AddCounter(
      "proxima_cluster_spill_withdrawn_blocks_total",
      "Spilled blocks whose key was deleted here while they were on the way: the peer was asked "
      "to delete its copy");
  for (auto [counter, outcome] : {std::pair{&put_waits_room_, "room"},
                                   std::pair{&put_waits_none_, "no_room"},
                                   std::pair{&put_waits_timeout_, "timeout"}}) {
    *counter = registry->AddCounter(
        "proxima_cluster_spill_put_waits_total",
        "Puts that found the host tier full and waited for a spill round before evicting, by "
        "outcome (room: blocks left for peers; no_room: none could; timeout: "
        "cluster.spill.put_wait ran out)",
        {{"outcome", outcome}});
  }
  spill_bytes_out_ = registry->AddCounter("proxima_cluster_spill_bytes_total",
                                          "Block bytes spilled between daemons, by direction",
                                          {{"direction", "out"}});
  LocationTable* records = &records_;
  registry->AddGauge("proxima_cluster_location_records",
                     "Location records this node keeps as home", {},
                     [records] { return static_cast<double>(records->size()); });
}

Cluster::~Cluster() { Stop(); }

void Cluster::Start() {
  core_->store().TrackDepartures(kMaxQueuedKeys);
  membership_->Start();
  sender_ = std::thread([this] { RunSender(); });
  if (config_.cluster.spill_enabled) spiller_ = std::thread([this] { RunSpiller(); });
}

void Cluster::Stop() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  spill_cv_.notify_all();
  spill_done_cv_.notify_all();
  if (sender_.joinable()) sender_.join();
  if (spiller_.joinable()) spiller_.join();
  if (membership_) membership_->Stop();
}

absl::Status Cluster::ReloadPeerTokens(absl::StatusOr<std::vector<std::string>> tokens) {
  absl::Status status = tokens.status();
  if (status.ok()) status = CheckNotANamespaceToken(*core_, *tokens);
  if (!status.ok()) {
    PROXIMA_LOG(kError) << "peer token reload failed; the previous peer tokens stay in force"
                        << log::Kv("error", status.message());
    return status;
  }
  const size_t n = tokens->size();
  tokens_->Set(*std::move(tokens));
  peer_token_reloads_->Increment();
  PROXIMA_LOG(kInfo) << "peer tokens reloaded" << log::Kv("tokens", n);
  return absl::OkStatus();
}

void Cluster::AddAuth(grpc::ClientContext* context, absl::Time deadline) const {
  context->AddMetadata("authorization", tokens_->Authorization());
  context->set_deadline(absl::ToChronoTime(deadline));
}

void Cluster::Stored(const RemoteBlockSet& blocks) {
  std::vector<Batch> batches = BatchesFor(blocks, /*forget=*/false);
  {
    // A key evicted before this put stored it again: its forget is queued first, so the record
    // queued now is the one that stays.
    std::lock_guard<std::mutex> lock(tell_mu_);
    ForgetDepartures();
    for (const Batch& batch : batches) Enqueue(batch, batch.keys);
  }
  WakeSpillerIfFull();
}

void Cluster::Removed(const RemoteBlockSet& blocks) {
  for (const Batch& batch : BatchesFor(blocks, /*forget=*/true)) Enqueue(batch, batch.keys);
}

void Cluster::ForgetDepartures() {
  BlockStore::Departures gone = core_->store().TakeDepartures();
  records_dropped_->Increment(gone.not_logged);  // their records stay until a fetch misses
  if (gone.ids.empty()) return;
  // Consecutive departures mostly share namespace, partition and profile: one set per run.
  std::vector<BlockKey> keys;
  for (size_t i = 0; i < gone.ids.size();) {
    const BlockId& first = gone.ids[i];
    keys.clear();
    for (; i < gone.ids.size() && gone.ids[i].namespace_index == first.namespace_index &&
           gone.ids[i].partition == first.partition && gone.ids[i].profile_id == first.profile_id;
         ++i) {
      keys.push_back(gone.ids[i].key);
    }
    const RemoteBlockSet set{first.namespace_index, core_->NamespaceName(first.namespace_index),
                             first.partition, first.profile_id, keys};
    for (const Batch& batch : BatchesFor(set, /*forget=*/true)) Enqueue(batch, batch.keys);
  }
}

std::vector<Cluster::Batch> Cluster::BatchesFor(const RemoteBlockSet& blocks, bool forget) const {
  std::shared_ptr<const LiveSet> live = membership_->Live();
  if (live->nodes.size() < 2) return {};  // alone: this node is every key's home
  absl::flat_hash_map<size_t, std::vector<BlockKey>> per_home;
  for (const BlockKey& key : blocks.keys) {
    const size_t home = HomeNode(live->nodes, PlacementHash(blocks.namespace_name, key));
    if (home == live->self || home >= live->nodes.size()) continue;  // its own store answers
    per_home[home].push_back(key);
  }
  std::vector<Batch> batches;
  for (auto& [home, keys] : per_home) {
    batches.push_back(Batch{live->id(home), blocks.namespace_name, blocks.partition,
                            blocks.profile_id, forget, self_, std::move(keys)});
  }
  return batches;
}

void Cluster::Enqueue(const Batch& batch, std::span<const BlockKey> keys) {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    // Leaving: its peers dropped this node and the records naming it; one naming it now would
    // outlive it, and could replace the record of the peer its hand-off gives the block to.
    if (stopping_ || (leaving_ && !batch.forget)) return;
    if (!RoomForKeys(keys.size())) {
      records_dropped_->Increment(keys.size());
      return;
    }
    // The latest intent for a key replaces what is queued for it: a forget queued after a
    // record (or the reverse) must not race it in the same round, nor a retry of the earlier.
    const BatchKey batch_key{batch.home, batch.namespace_name, batch.partition, batch.profile_id,
                             batch.holder};
    Intents& q = queue_[batch_key];
    const size_t before = q.size();
    for (const BlockKey& key : keys) q[key] = batch.forget;
    queued_keys_ += q.size() - before;
    if (auto retry = retry_.find(batch_key); retry != retry_.end()) {
      for (const BlockKey& key : keys) retry_keys_ -= retry->second.intents.erase(key);
      if (retry->second.intents.empty()) retry_.erase(retry);
    }
  }
  queue_cv_.notify_one();
}

void Cluster::RunSender() {
  while (true) {
    std::vector<std::string> rejoin_to, announce_to;
    bool leaving = false;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait_for(lock, kDeparturePeriod, [this] {
        return stopping_ || !queue_.empty() || !rejoin_to_.empty() || !announce_to_.empty();
      });
      if (stopping_) return;
      rejoin_to.swap(rejoin_to_);
      announce_to.swap(announce_to_);
      leaving = leaving_;
    }
    {
      std::lock_guard<std::mutex> lock(tell_mu_);
      ForgetDepartures();
    }
    if (leaving) {  // no more records of this node's blocks, nor asking peers for theirs
      SendQueued();
      SendDeleteRetries();  // a Delete made here still reaches the peers that missed it
      continue;
    }
    // Rejoins first: a peer drops the records naming this node when it takes one, so those this
    // round sends it must come after.
    if (!rejoin_to.empty()) SendRejoins(rejoin_to);
    std::shared_ptr<const LiveSet> live = membership_->Live();
    const std::vector<PlacementNode> before = announced_for_;
    const bool changed =
        !std::equal(live->nodes.begin(), live->nodes.end(), before.begin(), before.end(),
                    [](const PlacementNode& a, const PlacementNode& b) { return a.id == b.id; });
    if (changed) Reannounce(*live);
    for (const std::string& node : announce_to) {
      // A node Reannounce just saw join has had its records; one in both sets may have left
      // and come back between two rounds (or restarted unnoticed: its Rejoin).
      const bool covered =
          changed && std::none_of(before.begin(), before.end(),
                                  [&node](const PlacementNode& n) { return n.id == node; });
      if (!covered) AnnounceTo(*live, node);
    }
    SendQueued();
    SendDeleteRetries();
  }
}

bool Cluster::RoomForKeys(size_t keys) const {
  return queued_keys_ + retry_keys_ + delete_retry_keys_ + keys <= kMaxQueuedKeys;
}

void Cluster::QueueDeleteRetry(DeleteRetry retry) {
  const size_t keys = static_cast<size_t>(retry.request.blocks().keys_size());
  const absl::Time now = absl::Now();
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (!stopping_ && now - retry.first_failed < kRecordRetryFor && RoomForKeys(keys)) {
      delete_retry_keys_ += keys;
      delete_retries_.push_back(std::move(retry));
      return;
    }
  }
  DropDeleteRetry(retry, now);
}

void Cluster::DropDeleteRetry(const DeleteRetry& retry, absl::Time now) {
  const size_t keys = static_cast<size_t>(retry.request.blocks().keys_size());
  deletes_dropped_->Increment(keys);
  // A warning when the peer is live (it answers health checks, not Deletes); a peer that has
  // been gone all along comes back empty, if at all.
  log::Line(membership_->Live()->Contains(retry.peer) ? log::Level::kWarning : log::Level::kInfo,
            __FILE__, __LINE__)
      << "a Delete did not reach a peer; its copies of the keys may stay there"
      << log::Kv("peer", retry.peer) << log::Kv("keys", keys)
      << log::Kv("for", absl::FormatDuration(now - retry.first_failed));
}

void Cluster::SendDeleteRetries() {
  const absl::Time now = absl::Now();
  std::shared_ptr<const LiveSet> live = membership_->Live();
  std::vector<DeleteRetry> due, expired;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    // Due, and to a peer that is live now; one out of the live set waits for it to come back,
    // or for its time to run out.
    for (auto it = delete_retries_.begin(); it != delete_retries_.end();) {
      const bool out_of_time = now - it->first_failed >= kRecordRetryFor;
      if (!out_of_time && (it->due > now || !live->Contains(it->peer))) {
        ++it;
        continue;
      }
      delete_retry_keys_ -= static_cast<size_t>(it->request.blocks().keys_size());
      (out_of_time ? expired : due).push_back(std::move(*it));
      it = delete_retries_.erase(it);
    }
  }
  for (const DeleteRetry& retry : expired) DropDeleteRetry(retry, now);
  if (due.empty()) return;
  using Call = PeerCall<v1::DeleteBlocksRequest, v1::DeleteBlocksResponse>;
  std::vector<std::unique_ptr<Call>> calls;
  for (DeleteRetry& retry : due) {
    auto call = std::make_unique<Call>();
    call->peer = retry.peer;
    call->request = std::move(retry.request);
    // The Delete was made when it first failed; the peer notes it as of then.
    call->request.set_age_ms(static_cast<uint64_t>(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(now - retry.first_failed))));
    calls.push_back(std::move(call));
  }
  CallAll(calls, now + peer_deadline_, &v1::Peer::Stub::PrepareAsyncDeleteBlocks,
          /*skip_suspects=*/false, /*wait_for_ready=*/true);
  for (size_t k = 0; k < calls.size(); ++k) {
    Call& call = *calls[k];
    deletes_retried_->Increment(static_cast<uint64_t>(call.request.blocks().keys_size()));
    if (call.status.ok()) continue;
    peer_call_failures_->Increment();
    // A refusal (a peer restarted empty, which no longer knows the profile) will not change.
    if (!RetryPeerCall(call.status.error_code())) continue;
    DeleteRetry& retry = due[k];
    retry.request = std::move(call.request);
    retry.backoff = std::min(2 * retry.backoff, kRecordRetryMax);
    retry.due = absl::Now() + retry.backoff;
    QueueDeleteRetry(std::move(retry));
  }
}

void Cluster::SendQueued() {
  absl::flat_hash_map<BatchKey, Intents> batches;
  absl::flat_hash_map<BatchKey, Retry> retried;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    batches.swap(queue_);
    queued_keys_ = 0;
    const absl::Time now = absl::Now();
    for (auto it = retry_.begin(); it != retry_.end();) {
      if (it->second.due > now) {
        ++it;
        continue;
      }
      retry_keys_ -= it->second.intents.size();
      retried.insert(retry_.extract(it++));
    }
  }
  if (!retried.empty()) {
    // A home that left the live set gets this node's records again when it comes back
    // (Reannounce, AnnounceTo); until then they would only wait on it.
    std::shared_ptr<const LiveSet> live = membership_->Live();
    uint64_t sent_again = 0;
    for (const auto& [key, retry] : retried) {
      if (!live->Contains(std::get<0>(key))) {
        records_dropped_->Increment(retry.intents.size());
        continue;
      }
      // Enqueue removed every key with a newer intent: none is in `batches`.
      batches[key].insert(retry.intents.begin(), retry.intents.end());
      sent_again += retry.intents.size();
    }
    records_retried_->Increment(sent_again);
  }
  if (batches.empty()) return;
  absl::flat_hash_map<BatchKey, Intents> failed = SendAll(batches);
  if (!failed.empty()) QueueRetries(std::move(failed), retried);
}

void Cluster::QueueRetries(absl::flat_hash_map<BatchKey, Intents> failed,
                           const absl::flat_hash_map<BatchKey, Retry>& retried) {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(queue_mu_);
  if (stopping_) return;
  for (auto& [key, intents] : failed) {
    auto before = retried.find(key);
    Retry next{{}, now, now + kRecordRetryFirst, kRecordRetryFirst};
    if (before != retried.end()) {
      next.first_failed = before->second.first_failed;
      next.backoff = std::min(2 * before->second.backoff, kRecordRetryMax);
      next.due = now + next.backoff;
    }
    if (now - next.first_failed >= kRecordRetryFor) {
      records_dropped_->Increment(intents.size());
      PROXIMA_LOG(kWarning) << "location records not delivered: their home failed every call"
                            << log::Kv("home", std::get<0>(key)) << log::Kv("keys", intents.size())
                            << log::Kv("for", absl::FormatDuration(now - next.first_failed));
      continue;
    }
    // A newer intent queued meanwhile replaces the failed one; leaving, this node sends no
    // record naming itself (TellPeersLeaving).
    auto queued = queue_.find(key);
    absl::erase_if(intents, [&](const auto& intent) {
      return (queued != queue_.end() && queued->second.contains(intent.first)) ||
             (leaving_ && !intent.second);
    });
    if (intents.empty()) continue;
    if (!RoomForKeys(intents.size())) {
      records_dropped_->Increment(intents.size());
      continue;
    }
    auto [it, added] = retry_.try_emplace(key, std::move(next));
    if (!added) {  // failed in an earlier round too, and not due yet: the earliest failure counts
      it->second.first_failed = std::min(it->second.first_failed, next.first_failed);
    }
    const size_t had = it->second.intents.size();
    for (const auto& [k, forget] : intents) it->second.intents.insert_or_assign(k, forget);
    retry_keys_ += it->second.intents.size() - had;
  }
}

void Cluster::Reannounce(const LiveSet& live) {
  const std::vector<PlacementNode> before = std::exchange(announced_for_, live.nodes);
  if (live.nodes.size() < 2) return;  // alone: every key's home is here, nothing to tell
  const uint64_t records = AnnounceChanged(live, before);
  if (records > 0) {
    PROXIMA_LOG(kInfo) << "live set changed; location records sent to the blocks' new homes"
                       << log::Kv("live_nodes", live.nodes.size()) << log::Kv("records", records);
  }
}

void Cluster::AnnounceTo(const LiveSet& live, const std::string& node) {
  if (node == self_ || !live.Contains(node)) return;  // not live here: Reannounce will do it
  // As if `node` had left and come back: the keys whose home it is are the ones whose home
  // differs without it.
  std::vector<PlacementNode> without;
  for (const PlacementNode& n : live.nodes) {
    if (n.id != node) without.push_back(n);
  }
  const uint64_t records = AnnounceChanged(live, without);
  if (records > 0) {
    PROXIMA_LOG(kInfo) << "a peer rejoined; location records of the blocks it is home to sent "
                          "to it"
                       << log::Kv("peer", node) << log::Kv("records", records);
  }
}

void Cluster::Describe(v1::ClusterStats* out) const {
  out->set_self(self_);
  for (const Membership::PeerState& state : membership_->Peers()) {
    v1::PeerStats* peer = out->add_peers();
    peer->set_id(state.id);
    peer->set_live(state.live);
    peer->set_failed_checks(state.failures);
    peer->set_last_error(state.last_error);
  }
  out->set_location_records(records_.size());
}

Cluster::Leaving Cluster::TellPeersLeaving() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    leaving_ = true;
    // The records queued name this node (see Enqueue); its forgets may still go.
    // Keeps a batch's forgets and drops its records; returns how many intents it still holds.
    auto keep_only_forgets = [](Intents& intents) {
      absl::erase_if(intents, [](const auto& intent) { return !intent.second; });
      return intents.size();
    };
    queued_keys_ = 0;
    for (auto& [batch, intents] : queue_) queued_keys_ += keep_only_forgets(intents);
    absl::erase_if(queue_, [](const auto& batch) { return batch.second.empty(); });
    retry_keys_ = 0;
    for (auto& [batch, retry] : retry_) retry_keys_ += keep_only_forgets(retry.intents);
    absl::erase_if(retry_, [](const auto& batch) { return batch.second.intents.empty(); });
  }
  using Call = PeerCall<v1::LeaveRequest, v1::LeaveResponse>;
  std::vector<std::unique_ptr<Call>> calls;
  std::shared_ptr<const LiveSet> live = membership_->Live();
  for (size_t i = 0; i < live->nodes.size(); ++i) {
    if (i == live->self) continue;
    auto call = std::make_unique<Call>();
    call->peer = live->id(i);
    call->request.set_node(self_);
    calls.push_back(std::move(call));
  }
  // Fails fast on a peer that cannot be reached: its health checks will tell it instead.
  CallAll(calls, absl::Now() + peer_deadline_, &v1::Peer::Stub::PrepareAsyncLeave);
  Leaving result;
  for (const auto& call : calls) {
    if (call->status.ok()) {
      ++result.told;
    } else {
      ++result.failed;
      peer_call_failures_->Increment();
      PROXIMA_LOG(kWarning) << "could not tell a peer this node is leaving"
                            << log::Kv("peer", call->peer)
                            << log::Kv("error", call->status.error_message());
    }
  }
  return result;
}

void Cluster::SendRejoins(const std::vector<std::string>& peers) {
  using Call = PeerCall<v1::RejoinRequest, v1::RejoinResponse>;
  std::vector<std::unique_ptr<Call>> calls;
  for (const std::string& peer : peers) {
    auto call = std::make_unique<Call>();
    call->peer = peer;
    call->request.set_node(self_);
    // Started within the window: the Deletes made while this node was down, so that its
    // blocks put again after them say so, and are not declined as older.
    call->request.set_want_recent_deletes(service_->WantsRecentDeletes());
    calls.push_back(std::move(call));
  }
  CallAll(calls, absl::Now() + peer_deadline_, &v1::Peer::Stub::PrepareAsyncRejoin,
          /*skip_suspects=*/false, /*wait_for_ready=*/true);
  for (const auto& call : calls) {
    if (!call->status.ok()) {
      peer_call_failures_->Increment();
    } else if (call->request.want_recent_deletes()) {
      service_->LearnDeletes(call->peer, call->response);
    }
  }
}

uint64_t Cluster::AnnounceChanged(const LiveSet& live, const std::vector<PlacementNode>& before) {
  BlockStore& store = core_->store();
  uint64_t records = 0;
  for (size_t shard = 0; shard < store.num_shards(); ++shard) {
    // Homes are computed outside the locks; the queueing below is ordered with the store's
    // departures (see Stored): a block evicted after this snapshot has its forget queued after
    // the record queued here, and a block put again has its own record queued after that.
    std::vector<Batch> batches;
    absl::flat_hash_map<std::tuple<std::string, uint32_t, uint64_t, uint32_t, bool>, size_t>
        batch_of;  // (home, namespace, profile, partition, forget) -> index in batches
    for (const BlockId& id : store.ShardIds(shard)) {
      const std::string& ns = core_->NamespaceName(id.namespace_index);
      const uint64_t hash = PlacementHash(ns, id.key);
      const size_t home = HomeNode(live.nodes, hash);
      const size_t old_home = HomeNode(before, hash);  // before.size() when there was none
      const std::string old_id = old_home < before.size() ? before[old_home].id : std::string();
      if (home >= live.nodes.size() || live.id(home) == old_id) continue;
      auto add = [&](const std::string& to, bool forget) {
        auto [it, added] = batch_of.try_emplace(
            std::tuple{to, id.namespace_index, id.profile_id, id.partition, forget},
            batches.size());
        if (added) {
          batches.push_back(Batch{to, ns, id.partition, id.profile_id, forget, self_, {}});
        }
        batches[it->second].keys.push_back(id.key);
      };
      if (home != live.self) {
        add(live.id(home), /*forget=*/false);
        ++records;
      }
      // The old home, still live, would answer for it if the set changed back.
      if (!old_id.empty() && old_id != self_ && live.Contains(old_id)) add(old_id, true);
    }
    if (batches.empty()) continue;
    {
      std::lock_guard<std::mutex> lock(tell_mu_);
      for (const Batch& batch : batches) Enqueue(batch, batch.keys);
      ForgetDepartures();
    }
    // Rounds of at least kReannounceRoundKeys keys: each round waits for its slowest home (up
    // to peer_deadline), so not one per shard; the rest goes with the sender's next round.
    bool full = false;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      full = queued_keys_ >= kReannounceRoundKeys;
    }
    if (full) SendQueued();
  }
  reannounced_->Increment(records);
  return records;
}

absl::flat_hash_map<Cluster::BatchKey, Cluster::Intents> Cluster::SendAll(
    const absl::flat_hash_map<BatchKey, Intents>& batches) {
  using Call = PeerCall<v1::RecordLocationsRequest, v1::RecordLocationsResponse>;
  std::vector<std::unique_ptr<Call>> calls;
  std::vector<const BatchKey*> batch_of;  // each call's
  const size_t max_keys = core_->max_lookup_keys();
  const absl::Time deadline = absl::Now() + peer_deadline_;
  for (const auto& [key, intents] : batches) {
    const auto& [home, ns, partition, profile_id, holder] = key;
    for (const bool forget : {false, true}) {
      std::vector<const BlockKey*> keys;
      for (const auto& [k, f] : intents) {
        if (f == forget) keys.push_back(&k);
      }
      for (size_t first = 0; first < keys.size(); first += max_keys) {
        auto call = std::make_unique<Call>();
        call->peer = home;
        call->request.set_holder(holder);
        call->request.set_forget(forget);
        v1::PeerBlockSet* set = call->request.mutable_blocks();
        set->set_namespace_name(ns);
        if (absl::StatusOr<uint32_t> index = core_->NamespaceIndex(ns); index.ok()) {
          NamePartition(*core_, *index, partition, set);
        } else {
          set->set_partition(partition);
        }
        set->set_profile_id(profile_id);
        for (size_t i = first; i < std::min(keys.size(), first + max_keys); ++i) {
          set->add_keys(reinterpret_cast<const char*>(keys[i]->data()), kKeyBytes);
        }
        calls.push_back(std::move(call));
        batch_of.push_back(&key);
      }
    }
  }
  CallAll(calls, deadline, &v1::Peer::Stub::PrepareAsyncRecordLocations, /*skip_suspects=*/false,
          /*wait_for_ready=*/true);
  absl::flat_hash_map<BatchKey, Intents> failed;
  for (size_t c = 0; c < calls.size(); ++c) {
    const Call& call = *calls[c];
    if (call.status.ok()) {
      (call.request.forget() ? forgets_sent_ : records_sent_)
          ->Increment(call.request.blocks().keys_size());
      continue;
    }
    peer_call_failures_->Increment();
    if (!RetryPeerCall(call.status.error_code())) {
      PROXIMA_LOG(kWarning) << "location records refused by their home"
                            << log::Kv("home", call.peer)
                            << log::Kv("error", call.status.error_message());
      continue;
    }
    PROXIMA_LOG(kDebug) << "location records not delivered; sent again later"
                        << log::Kv("home", call.peer)
                        << log::Kv("error", call.status.error_message());
    Intents& again = failed[*batch_of[c]];
    for (const std::string& k : call.request.blocks().keys()) {
      BlockKey key;
      std::memcpy(key.data(), k.data(), kKeyBytes);
      again.emplace(key, call.request.forget());
    }
  }
  return failed;
}

std::vector<std::string> Cluster::Locate(const RemoteBlockSet& blocks, const LiveSet& live,
                                         absl::Time deadline) {
  std::vector<std::string> holders(blocks.keys.size());
  absl::flat_hash_map<size_t, std::vector<size_t>> per_home;  // home node -> key indices
  std::vector<size_t> at_self;
  for (size_t i = 0; i < blocks.keys.size(); ++i) {
    const size_t home =
        HomeNode(live.nodes, PlacementHash(blocks.namespace_name, blocks.keys[i]));
    if (home >= live.nodes.size()) continue;
    if (home == live.self) {
      at_self.push_back(i);
    } else {
      per_home[home].push_back(i);
    }
  }
  if (!at_self.empty()) {
    // As a home answers a peer (PeerService::ServeLookup): its own tiers first, then its
    // records. A block of a chain may be here after earlier ones have spilled elsewhere.
    std::vector<BlockId> ids;
    for (size_t i : at_self) ids.push_back(IdOf(blocks, i));
    std::vector<std::string> found = records_.Find(ids);
    for (size_t j = 0; j < at_self.size(); ++j) {
      holders[at_self[j]] = core_->store().Contains(ids[j]) ? self_ : std::move(found[j]);
    }
  }
  using Call = PeerCall<v1::LookupLocationsRequest, v1::LookupLocationsResponse>;
  std::vector<std::unique_ptr<Call>> calls;
  // A home refuses more keys per call than its server.max_lookup_keys (this node's is taken as
  // theirs), which a Get's batch (server.max_batch_blocks) may exceed: every key of the call
  // was then a miss.
  const size_t per_call = std::max<size_t>(1, core_->max_lookup_keys());
  for (auto& [home, which] : per_home) {
    for (size_t first = 0; first < which.size(); first += per_call) {
      auto call = std::make_unique<Call>();
      call->peer = live.id(home);
      call->which.assign(
          which.begin() + static_cast<std::ptrdiff_t>(first),
          which.begin() + static_cast<std::ptrdiff_t>(std::min(which.size(), first + per_call)));
      FillSet(*core_, blocks, call->which, call->request.mutable_blocks());
      calls.push_back(std::move(call));
    }
  }
  CallAll(calls, deadline, &v1::Peer::Stub::PrepareAsyncLookupLocations, /*skip_suspects=*/true);
  for (const auto& call : calls) {
    static log::Limiter bad_answers(kBadPeerLogEvery);
    if (!call->status.ok() || !AnswerFits(bad_answers, call->peer, "LookupLocations", "holders",
                                          call->response.holders_size(), call->which.size())) {
      peer_call_failures_->Increment();
      continue;  // its keys stay misses
    }
    for (size_t j = 0; j < call->which.size(); ++j) holders[call->which[j]] = call->response.holders(j);
  }
  for (std::string& h : holders) {
    if (!h.empty() && !live.Contains(h)) h.clear();  // a holder that is down holds nothing
  }
  return holders;
}

std::vector<bool> Cluster::DeleteRemote(const RemoteBlockSet& blocks) {
  std::vector<bool> deleted(blocks.keys.size(), false);
  std::vector<BlockId> ids;
  for (size_t i = 0; i < blocks.keys.size(); ++i) ids.push_back(IdOf(blocks, i));
  // One id for this Delete on every node: a spill of a key put again after it names it, and is
  // kept; a spill that was on its way here when it happened is declined.
  const uint64_t delete_id = RecentDeletes::NewId();
  service_->NoteDeleted(ids, delete_id);
  if (blocks.keys.empty()) return deleted;
  std::shared_ptr<const LiveSet> live = membership_->Live();
  const absl::Time now = absl::Now();
  const absl::Time deadline = now + peer_deadline_;
  using Call = PeerCall<v1::DeleteBlocksRequest, v1::DeleteBlocksResponse>;
  // Every live peer, not only the holders the homes name: a home learns of a holder's copy in
  // the background after its put, so a delete right after a put (or of a block a peer took
  // from a spill just now) would find no record and leave the copy to be read again
  // (docs/decisions.md, "A delete reaches every live peer"). Known peers out of the live set
  // get it once they are back in it (within kRecordRetryFor): one cut off from this node alone
  // may still serve other nodes.
  std::vector<std::string> live_peers, absent;
  for (std::string& peer : membership_->KnownPeers()) {
    if (peer != self_) (live->Contains(peer) ? live_peers : absent).push_back(std::move(peer));
  }
  for (auto& call : CallsToPeers<Call>(*core_, blocks, absent, core_->max_batch_blocks())) {
    call->request.set_delete_id(delete_id);
    QueueDeleteRetry({call->peer, std::move(call->request), now, now, kRecordRetryFirst});
  }
  std::vector<std::unique_ptr<Call>> calls =
      CallsToPeers<Call>(*core_, blocks, live_peers, core_->max_batch_blocks());
  for (const auto& call : calls) call->request.set_delete_id(delete_id);
  CallAll(calls, deadline, &v1::Peer::Stub::PrepareAsyncDeleteBlocks, /*skip_suspects=*/true);
  for (const auto& call : calls) {
    static log::Limiter bad_answers(kBadPeerLogEvery);
    if (!call->status.ok() || !AnswerFits(bad_answers, call->peer, "DeleteBlocks", "deleted",
                                          call->response.deleted_size(), call->which.size())) {
      peer_call_failures_->Increment();
      // Sent again in the background; the worker's answer counts what was deleted by now.
      if (RetryPeerCall(call->status.error_code())) {
        QueueDeleteRetry({call->peer, std::move(call->request), now,
                          absl::Now() + kRecordRetryFirst, kRecordRetryFirst});
      }
      continue;
    }
    for (size_t j = 0; j < call->which.size(); ++j) {
      if (call->response.deleted(static_cast<int>(j))) deleted[call->which[j]] = true;
    }
  }
  return deleted;
}

size_t Cluster::LookupChain(const RemoteBlockSet& blocks) {
  std::shared_ptr<const LiveSet> live = membership_->Live();
  if (live->nodes.size() < 2 || blocks.keys.empty()) return 0;
  const absl::Time deadline = absl::Now() + peer_deadline_;
  std::vector<std::string> holders = Locate(blocks, *live, deadline);
  size_t present = 0;
  while (present < holders.size() && !holders[present].empty() &&
         (holders[present] != self_ ||
          core_->store().Contains(IdOf(blocks, present)))) {
    ++present;
  }
  remote_lookup_hits_->Increment(present);
  return present;
}

std::vector<std::optional<RemoteBlock>> Cluster::Fetch(const RemoteBlockSet& blocks) {
  std::vector<std::optional<RemoteBlock>> out(blocks.keys.size());
  std::shared_ptr<const LiveSet> live = membership_->Live();
  if (live->nodes.size() < 2 || blocks.keys.empty()) return out;
  const absl::Time now = absl::Now();
  const absl::Time deadline = now + peer_deadline_;
  // The homes get half the budget: a home that hangs then costs its own keys, and the blocks
  // whose homes answered are still fetched in the half left.
  std::vector<std::string> holders = Locate(blocks, *live, now + peer_deadline_ / 2);

  using Call = PeerCall<v1::FetchBlocksRequest, v1::FetchBlocksResponse>;
  // Requests sized so that each answer fits server.max_message_bytes (stored bytes are at most
  // the raw size, plus a container header).
  const uint64_t per_block = blocks.block_bytes + 4096;
  const size_t per_call = std::max<size_t>(
      1, std::min<uint64_t>(core_->max_batch_blocks(),
                            (config_.server.max_message_bytes - 4096) / per_block));
  std::vector<std::unique_ptr<Call>> calls =
      CallsPerHolder<Call>(*core_, blocks, holders, self_, per_call);
  // With UCX: the holders send the blocks as messages of one transfer per call, a slot per block.
  std::vector<uint64_t> transfers(calls.size(), 0);
  for (size_t k = 0; k < calls.size() && ucx_ != nullptr; ++k) {
    transfers[k] = ucx_->Describe(per_block, &calls[k]->request);
  }
  CallAll(calls, deadline, &v1::Peer::Stub::PrepareAsyncFetchBlocks, /*skip_suspects=*/true);
  uint64_t hits = 0;
  uint64_t bytes = 0;
  uint64_t ucx_bytes = 0;
  for (size_t k = 0; k < calls.size(); ++k) {
    const auto& call = calls[k];
    static log::Limiter bad_answers(kBadPeerLogEvery);
    const bool answered =
        call->status.ok() && AnswerFits(bad_answers, call->peer, "FetchBlocks", "blocks",
                                        call->response.blocks_size(), call->which.size());
    // The blocks sent as messages: collected by the deadline (they left before the answer did).
    // A failed call's transfer is closed, so that what its holder sent is dropped.
    const bool by_ucx = answered && call->response.ucx_sent() && transfers[k] != 0;
    std::vector<uint32_t> slots;
    for (int j = 0; by_ucx && j < call->response.blocks_size(); ++j) {
      const v1::FetchedBlock& b = call->response.blocks(j);
      if (b.found() && b.data().empty() && b.size() > 0) slots.push_back(static_cast<uint32_t>(j));
    }
    std::vector<std::shared_ptr<const ucx::Parcel>> parcels;
    if (transfers[k] != 0) parcels = ucx_->Collect(transfers[k], slots, deadline);
    if (!answered) {
      peer_call_failures_->Increment();
      continue;
    }
    std::vector<BlockKey> missed;
    for (size_t j = 0; j < call->which.size(); ++j) {
      v1::FetchedBlock* b = call->response.mutable_blocks(static_cast<int>(j));
      const size_t i = call->which[j];
      if (!b->found()) {
        missed.push_back(blocks.keys[i]);
        continue;
      }
      // The bytes: inline in the answer, or (empty `data`) in the message sent for its slot. The
      // holder's word for the size is checked against the message.
      const bool in_message = by_ucx && b->data().empty() && b->size() > 0;
      std::shared_ptr<const ucx::Parcel> parcel;
      if (in_message) {
        auto at = std::lower_bound(slots.begin(), slots.end(), static_cast<uint32_t>(j));
        parcel = parcels[at - slots.begin()];
      }
      const uint64_t size = in_message ? b->size() : b->data().size();
      const bool size_ok = b->level() < static_cast<uint32_t>(kMaxLevels) &&
                           (b->level() > 0 ? size <= per_block : size == blocks.block_bytes) &&
                           (!in_message || (parcel != nullptr && parcel->bytes().size() == size));
      std::span<const std::byte> got;
      if (size_ok) {
        got = in_message ? parcel->bytes()
                         : std::as_bytes(std::span<const char>(b->data().data(), size));
      }
      if (!size_ok || Crc32c(got) != b->crc32c()) {
        crc_failures_->Increment();
        static log::Limiter bad_blocks(kBadPeerLogEvery);
        PROXIMA_LOG_LIMITED(kError, bad_blocks)
            << "block fetched from a peer failed its CRC32C or size check (or "
               "its UCX message did not arrive); served as a miss"
            << log::Kv("peer", call->peer) << log::Kv("level", b->level()) << log::Kv("bytes", size)
            << log::Kv("ucx", in_message) << log::Kv("arrived", parcel != nullptr);
        continue;
      }
      if (in_message) {
        out[i] = RemoteBlock{parcel, got, b->crc32c(), static_cast<uint8_t>(b->level())};
        ucx_bytes += size;
      } else {
        auto data = std::make_shared<const std::string>(std::move(*b->mutable_data()));
        out[i] = RemoteBlock{data, std::as_bytes(std::span<const char>(data->data(), data->size())),
                             b->crc32c(), static_cast<uint8_t>(b->level())};
        bytes += size;
      }
      ++hits;
    }
    if (!missed.empty()) {
      // The holder no longer has them (evicted, deleted): drop the records at their homes.
      absl::flat_hash_map<size_t, std::vector<BlockKey>> per_home;
      for (const BlockKey& key : missed) {
        per_home[HomeNode(live->nodes, PlacementHash(blocks.namespace_name, key))].push_back(key);
      }
      for (const auto& [home, keys] : per_home) {
        if (home == live->self) {
          std::vector<BlockId> ids;
          for (const BlockKey& k : keys) {
            ids.push_back(BlockId{blocks.namespace_index, blocks.profile_id, k, blocks.partition});
          }
          records_dropped_->Increment(records_.Forget(ids, call->peer));
        } else if (home < live->nodes.size()) {
          Enqueue(Batch{live->id(home),
                        blocks.namespace_name,
                        blocks.partition,
                        blocks.profile_id,
                        true,
                        call->peer,
                        {}},
                  keys);
        }
      }
    }
  }
  remote_get_hits_->Increment(hits);
  remote_get_misses_->Increment(blocks.keys.size() - hits);
  bytes_in_->Increment(bytes);
  if (ucx_bytes > 0) ucx_->CountIn(ucx_bytes);
  return out;
}

void Cluster::WakeSpillerIfFull() {
  if (!config_.cluster.spill_enabled) return;
  const BlockStore& store = core_->store();
  if (static_cast<double>(store.used_bytes()) <=
      config_.cluster.spill_threshold * static_cast<double>(store.capacity_bytes())) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    spill_wanted_ = true;
  }
  spill_cv_.notify_one();
}

void Cluster::RunSpiller() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      spill_cv_.wait_for(lock, kSpillPeriod,
                         [this] { return stopping_ || spiller_stopping_ || spill_wanted_; });
      if (stopping_ || spiller_stopping_) return;
      spill_wanted_ = false;
    }
    SpillRound round = SpillRound::kMoved;
    while (round == SpillRound::kMoved) {
      {
        std::lock_guard<std::mutex> lock(queue_mu_);
        if (stopping_ || spiller_stopping_) return;
        spill_round_running_ = true;
      }
      round = SpillOnce();
      {
        std::lock_guard<std::mutex> lock(queue_mu_);
        spill_round_running_ = false;
        ++spill_rounds_;
        last_round_ = round;
        last_round_end_ = absl::Now();
      }
      spill_done_cv_.notify_all();
    }
  }
}

bool Cluster::MakeRoom() {
  if (!config_.cluster.spill_enabled || config_.cluster.spill_put_wait_seconds <= 0) return false;
  std::unique_lock<std::mutex> lock(queue_mu_);
  if (stopping_ || spiller_stopping_) return false;
  // The last round found no peer with room, and the spiller leaves full peers alone for a
  // while: evict now rather than wait for a round that cannot help.
  if (last_round_ == SpillRound::kStuck && !spill_round_running_ &&
      absl::Now() - last_round_end_ < kPeerFullBackoff) {
    put_waits_none_->Increment();
    return false;
  }
  // A round that is already running may have chosen its blocks before this put: wait for the
  // one after it.
  const uint64_t until = spill_rounds_ + (spill_round_running_ ? 2 : 1);
  spill_wanted_ = true;
  spill_cv_.notify_one();
  const bool done = spill_done_cv_.wait_for(
      lock, std::chrono::duration<double>(config_.cluster.spill_put_wait_seconds),
      [&] { return stopping_ || spiller_stopping_ || spill_rounds_ >= until; });
  if (!done || stopping_ || spiller_stopping_) {
    put_waits_timeout_->Increment();
    return false;
  }
  // kIdle: other rounds took the tier under the threshold meanwhile, so there is room to try.
  const bool room = last_round_ != SpillRound::kStuck;
  (room ? put_waits_room_ : put_waits_none_)->Increment();
  return room;
}

Cluster::Handoff Cluster::HandOff(absl::Duration budget) {
  BlockStore& store = core_->store();
  Handoff result;
  if (config_.cluster.spill_enabled && budget > absl::ZeroDuration()) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      spiller_stopping_ = true;
    }
    spill_cv_.notify_all();
    spill_done_cv_.notify_all();
    if (spiller_.joinable()) spiller_.join();  // its rooms_ are this thread's from here on
    // A peer's refusals of spills say nothing of its room for a hand-off, which it may make by
    // evicting (cluster.spill.handoff_evicts): each peer is sent one block first, as an unknown
    // one is, and its answer says how much more it takes. Its UCX worker stays known.
    for (auto& [peer, room] : rooms_) {
      room.bytes = 1;
      room.retry_at = absl::InfinitePast();
    }
    HandoffState state;
    state.until = absl::Now() + budget;
    SpillRound round = SpillRound::kMoved;
    while (absl::Now() < state.until && store.host_blocks() > 0 &&
           (round = SpillOnce(&state)) == SpillRound::kMoved) {
      ++state.moved.rounds;
    }
    result = state.moved;
    result.ended = store.host_blocks() == 0                ? "every block placed"
                   : membership_->Live()->nodes.size() < 2 ? "no live peer"
                   : round != SpillRound::kMoved           ? "no peer took more"
                                                           : "budget spent";
  }
  result.left_blocks = store.host_blocks();
  return result;
}

Cluster::SpillRound Cluster::SpillOnce(HandoffState* handoff) {
  BlockStore& store = core_->store();
  const double capacity = static_cast<double>(store.capacity_bytes());
  const double limit = config_.cluster.spill_threshold * capacity;
  const uint64_t used = store.used_bytes();
  if (handoff == nullptr && static_cast<double>(used) <= limit) return SpillRound::kIdle;
  std::shared_ptr<const LiveSet> live = membership_->Live();
  // What was known of a peer that left the live set (its room, its UCX worker) is stale when it
  // comes back: it may have restarted empty, with another worker.
  absl::erase_if(rooms_, [&live](const auto& room) { return !live->Contains(room.first); });
  if (live->nodes.size() < 2) return SpillRound::kStuck;
  const absl::Time now = absl::Now();
  // The bytes each live peer may be sent this round: what it said it has room for; one block
  // after a refusal once its back-off has passed; nothing during the back-off.
  std::vector<uint64_t> budget(live->nodes.size(), 0);
  bool any_peer = false;
  for (size_t i = 0; i < live->nodes.size(); ++i) {
    if (i == live->self) continue;
    auto room = rooms_.find(live->id(i));
    if (room == rooms_.end()) {
      // Unknown: a spill sends what it has. A hand-off, which may move the whole tier, sends
      // one block first, so that the rest goes over UCX when the answer names a UCX worker.
      budget[i] = handoff != nullptr ? 1 : UINT64_MAX;
    } else if (room->second.retry_at <= now) {
      budget[i] = room->second.bytes > 0 ? room->second.bytes : 1;  // 1: a single block
    }
    any_peer |= budget[i] > 0;
  }
  if (!any_peer) return SpillRound::kStuck;
  // Down to a little under the threshold (1/64 of the tier), so that not every put starts a
  // round of its own.
  const uint64_t want = handoff != nullptr
                            ? kMaxSpillRoundBytes
                            : std::min<uint64_t>(kMaxSpillRoundBytes,
                                                 static_cast<uint64_t>(static_cast<double>(used) -
                                                                       limit + capacity / 64));
  const uint64_t max_call_bytes = config_.server.max_message_bytes - 64 * 1024;

  using Call = PeerCall<v1::StoreBlocksRequest, v1::StoreBlocksResponse>;
  struct Pending {
    std::unique_ptr<Call> call;
    std::vector<BlockStore::Candidate> blocks;
    uint64_t bytes = 0;
    std::string ucx_worker;  // the peer's, when the blocks go as UCX messages
  };
  // (target, namespace, partition, profile) -> the call being filled for it.
  absl::flat_hash_map<std::tuple<size_t, uint32_t, uint32_t, uint64_t>, size_t> open;
  std::vector<Pending> pending;
  std::vector<BlockStore::Candidate> stay;  // no peer takes them now: released at the end
  uint64_t taken = 0;
  while (taken < want) {
    std::optional<BlockStore::Candidate> c =
        handoff != nullptr ? store.HottestForHandoff() : store.ColdestSpillable();
    if (!c) break;
    taken += c->block.bytes.size();
    const BlockId& id = c->id;
    const std::string& ns_name = config_.namespaces[id.namespace_index].name;
    absl::StatusOr<uint64_t> block_bytes = core_->RegisteredBlockBytes(id.namespace_index,
                                                                    id.profile_id);
    size_t target = live->nodes.size();
    if (block_bytes.ok()) {
      for (size_t node : RankNodes(live->nodes, PlacementHash(ns_name, id.key),
                                   config_.cluster.spill_candidates + 1)) {
        if (node == live->self || budget[node] == 0) continue;
        target = node;
        // A budget of 1 (a probe after a refusal) takes one block; otherwise the bytes count.
        budget[node] = budget[node] == 1 ? 0
                                          : budget[node] - std::min<uint64_t>(
                                                               budget[node], c->block.bytes.size());
        break;
      }
    }
    if (target >= live->nodes.size()) {
      spill_no_room_->Increment();
      // A hand-off goes on past the blocks none of whose peers may take more this round (a
      // peer sent its first block, or full): the next round may place them.
      if (handoff != nullptr) taken -= c->block.bytes.size();
      stay.push_back(*std::move(c));
      if (handoff != nullptr &&
          std::all_of(budget.begin(), budget.end(), [](uint64_t b) { return b == 0; })) {
        break;  // no peer may take more this round
      }
      continue;
    }
    const auto key = std::make_tuple(target, id.namespace_index, id.partition, id.profile_id);
    auto it = open.find(key);
    if (it == open.end() ||
        pending[it->second].bytes + c->block.bytes.size() > max_call_bytes ||
        pending[it->second].blocks.size() >= core_->max_batch_blocks()) {
      Pending p;
      p.call = std::make_unique<Call>();
      p.call->peer = live->id(target);
      v1::PeerBlockSet* set = p.call->request.mutable_blocks();
      set->set_namespace_name(ns_name);
      NamePartition(*core_, id.namespace_index, id.partition, set);
      set->set_profile_id(id.profile_id);
      p.call->request.set_block_bytes(*block_bytes);
      p.call->request.set_handoff(handoff != nullptr);
      p.call->request.set_deletes_known_ms(static_cast<uint64_t>(
          std::max<int64_t>(1, absl::ToInt64Milliseconds(service_->DeletesKnownFor()))));
      // As UCX messages when the peer named its worker in an earlier answer.
      if (ucx_ != nullptr) {
        auto room = rooms_.find(p.call->peer);
        if (room != rooms_.end() && room->second.ucx_retry_at <= now) {
          p.ucx_worker = room->second.ucx_worker;
        }
      }
      pending.push_back(std::move(p));
      it = open.insert_or_assign(key, pending.size() - 1).first;
    }
    Pending& p = pending[it->second];
    p.call->request.mutable_blocks()->add_keys(reinterpret_cast<const char*>(id.key.data()),
                                               kKeyBytes);
    v1::SpilledBlock* b = p.call->request.add_data();
    if (p.ucx_worker.empty()) {
      b->set_data(reinterpret_cast<const char*>(c->block.bytes.data()), c->block.bytes.size());
    } else {
      b->set_ucx_size(c->block.bytes.size());
    }
    b->set_crc32c(c->block.crc32c);
    b->set_level(c->block.level);
    // The level by its plan, and the put's hints: the receiver may run another hierarchy.
    b->set_plan(core_->LevelPlanText(id.namespace_index, c->block.level));
    b->set_high_priority(c->attributes.high_priority);
    b->set_position(c->attributes.position);
    b->set_second_chance(c->attributes.second_chance);
    // This copy is newer than any Delete of the key seen here (that Delete would have removed
    // it): a receiver that saw the same last Delete keeps it.
    b->set_after_delete(service_->LastDelete(id));
    p.bytes += c->block.bytes.size();
    p.blocks.push_back(*std::move(c));
  }
  const absl::Time deadline =
      handoff != nullptr ? std::min(now + peer_deadline_, handoff->until) : now + peer_deadline_;
  // The blocks of UCX calls leave first, as messages of a transfer the call then names; a peer
  // whose worker cannot be reached gets them inline this round and for kUcxRetryAfter.
  for (Pending& p : pending) {
    if (p.ucx_worker.empty()) continue;
    std::vector<std::span<const std::byte>> bytes;
    for (const BlockStore::Candidate& c : p.blocks) bytes.push_back(c.block.bytes);
    absl::StatusOr<uint64_t> transfer = ucx_->Push(p.ucx_worker, bytes, deadline);
    if (transfer.ok()) {
      p.call->request.set_ucx_transfer(*transfer);
      continue;
    }
    PROXIMA_LOG(kInfo) << "spilling to a peer inline: its UCX worker did not take the blocks"
                       << log::Kv("peer", p.call->peer)
                       << log::Kv("error", transfer.status().ToString());
    // A worker whose address is still being checked is tried again next round.
    if (!absl::IsUnavailable(ucx_->Verdict(p.ucx_worker))) {
      rooms_[p.call->peer].ucx_retry_at = now + kUcxRetryAfter;
    }
    for (size_t j = 0; j < p.blocks.size(); ++j) {
      const std::span<const std::byte> b = p.blocks[j].block.bytes;
      p.call->request.mutable_data(static_cast<int>(j))
          ->set_data(reinterpret_cast<const char*>(b.data()), b.size());
    }
  }
  std::vector<std::unique_ptr<Call>> calls;
  for (Pending& p : pending) calls.push_back(std::move(p.call));
  // A spill that fails is tried again next round; a hand-off may have no next round.
  CallAll(calls, deadline, &v1::Peer::Stub::PrepareAsyncStoreBlocks, /*skip_suspects=*/false,
          /*wait_for_ready=*/handoff != nullptr);
  bool moved = false;
  // Per call, the keys deleted here while their blocks were on the way to the peer: the peer's
  // copies go too (a delete that reached the peer before they did found nothing there).
  using DeleteCall = PeerCall<v1::DeleteBlocksRequest, v1::DeleteBlocksResponse>;
  std::vector<std::unique_ptr<DeleteCall>> withdrawals;
  for (size_t k = 0; k < calls.size(); ++k) {
    const Call& call = *calls[k];
    std::vector<BlockStore::Candidate>& blocks = pending[k].blocks;
    // By the Delete each names (DeleteBlocksRequest.delete_id): the peer then declines older
    // copies of those keys, as that Delete would, and keeps copies put again after it.
    absl::flat_hash_map<uint64_t, DeleteCall*> withdrawal_of;
    static log::Limiter bad_answers(kBadPeerLogEvery);
    const bool answered =
        call.status.ok() && AnswerFits(bad_answers, call.peer, "StoreBlocks", "stored",
                                       call.response.stored_size(), blocks.size());
    if (!answered) {
      peer_call_failures_->Increment();
      if (handoff != nullptr) {  // worth a line each: the blocks may leave with the process
        PROXIMA_LOG(kWarning) << "hand-off to a peer failed" << log::Kv("peer", call.peer)
                              << log::Kv("error", call.status.error_message());
      } else {
        PROXIMA_LOG(kDebug) << "spill to a peer failed" << log::Kv("peer", call.peer)
                            << log::Kv("error", call.status.error_message());
      }
    }
    PeerRoom& room = rooms_[call.peer];
    room.bytes = answered ? call.response.room_bytes() : 0;
    if (answered) {
      // A peer that names another worker than before has restarted (between two health checks,
      // or the live set would have dropped its room): failing to reach its old worker says
      // nothing of the new one, so UCX is tried again from the next round.
      if (call.response.ucx_worker() != room.ucx_worker) {
        room.ucx_retry_at = absl::InfinitePast();
        // Its check (ucx.check_worker_addresses) starts now, so that the verdict is in by the
        // next round.
        if (ucx_ != nullptr && !call.response.ucx_worker().empty()) {
          ucx_->Verdict(call.response.ucx_worker()).IgnoreError();
        }
      }
      room.ucx_worker = call.response.ucx_worker();
    }
    if (!answered && call.request.ucx_transfer() != 0) {
      // Over UCX and refused (a receiver without UCX for peers) or lost: inline for a while.
      room.ucx_retry_at = now + kUcxRetryAfter;
    }
    if (!answered || call.response.full() || room.bytes == 0) {
      room.bytes = 0;
      room.retry_at = now + kPeerFullBackoff;
    }
    // The blocks the peer declined for a Delete this node had not seen: older than it, so
    // dropped here as that Delete would have done, not kept to be offered to another peer
    // (which may not know of the Delete and keep them).
    std::vector<bool> deleted_there(blocks.size(), false);
    if (answered) {
      uint32_t not_sent = 0, largest = 0;
      for (uint32_t j : call.response.declined_deleted()) {
        if (j < blocks.size()) {
          deleted_there[j] = true;
        } else {
          ++not_sent;
          largest = std::max(largest, j);
        }
      }
      if (not_sent > 0) {
        static log::Limiter bad_declines(kBadPeerLogEvery);
        PROXIMA_LOG_LIMITED(kWarning, bad_declines)
            << "a peer declined blocks it was not sent; ignored" << log::Kv("peer", call.peer)
            << log::Kv("indices", not_sent) << log::Kv("largest", largest)
            << log::Kv("sent", blocks.size());
      }
    }
    for (size_t j = 0; j < blocks.size(); ++j) {
      if (answered && deleted_there[j] && !call.response.stored(static_cast<int>(j))) {
        if (store.EvictCandidate(blocks[j], /*count=*/false)) {
          spill_deleted_on_peer_->Increment();
          if (handoff != nullptr) ++handoff->moved.deleted_blocks;
          moved = true;
        }
        continue;
      }
      if (!answered || !call.response.stored(static_cast<int>(j))) {
        spill_no_room_->Increment();
        stay.push_back(blocks[j]);
        continue;
      }
      // The peer holds it now and tells its home. A reader that pinned it meanwhile keeps this
      // copy here as well (both are the same bytes). A copy deleted here meanwhile (put again or
      // not) is withdrawn: the peer may have kept it as newer than that Delete (after_delete was
      // read after the block was taken).
      // It names the Delete this node saw (before, it named none, and the peer took it for a
      // Delete of its own that no spill names: it then declined, and the sender dropped, the
      // copies put again after that Delete, for the whole window).
      if (!store.EvictCandidate(blocks[j], /*count=*/false) && !store.Indexed(blocks[j])) {
        const uint64_t delete_id = service_->LastDelete(blocks[j].id);
        DeleteCall*& withdrawal = withdrawal_of[delete_id];
        if (withdrawal == nullptr) {
          withdrawal = withdrawals.emplace_back(std::make_unique<DeleteCall>()).get();
          withdrawal->peer = call.peer;
          *withdrawal->request.mutable_blocks() = call.request.blocks();
          withdrawal->request.mutable_blocks()->clear_keys();
          withdrawal->request.set_delete_id(delete_id);  // 0 (none seen): the peer makes one
        }
        withdrawal->request.mutable_blocks()->add_keys(
            reinterpret_cast<const char*>(blocks[j].id.key.data()), kKeyBytes);
      }
      spilled_blocks_->Increment();
      spill_bytes_out_->Increment(blocks[j].block.bytes.size());
      if (handoff != nullptr) {
        ++handoff->moved.blocks;
        handoff->moved.bytes += blocks[j].block.bytes.size();
      }
      moved = true;
    }
  }
  for (const BlockStore::Candidate& c : stay) store.Release(c);
  if (!withdrawals.empty()) {
    spill_withdrawn_->Increment(std::accumulate(
        withdrawals.begin(), withdrawals.end(), uint64_t{0},
        [](uint64_t n, const auto& w) { return n + w->request.blocks().keys_size(); }));
    CallAll(withdrawals, absl::Now() + peer_deadline_, &v1::Peer::Stub::PrepareAsyncDeleteBlocks,
            /*skip_suspects=*/false, /*wait_for_ready=*/true);
    for (const auto& w : withdrawals) {
      if (!w->status.ok()) peer_call_failures_->Increment();
    }
  }
  return moved ? SpillRound::kMoved : SpillRound::kStuck;
}

}  // namespace proxima::daemon::cluster
