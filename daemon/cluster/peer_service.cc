#include "daemon/cluster/peer_service.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/bytes.h"
#include "common/crc32c.h"
#include "common/credentials.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kernels/codec.h"

namespace proxima::daemon::cluster {
namespace {

// How long before a call's deadline a StoreBlocks still waiting for UCX messages gives up, to
// answer in time (at most a quarter of the time left).
constexpr absl::Duration kAnswerMargin = absl::Milliseconds(200);
// The most keys a node remembers recent Deletes of (RecentDeletes), and so the most a Rejoin
// answer carries.
constexpr size_t kMaxRecentDeletes = 1u << 16;

// A peer call's deadline: every call between daemons carries one (cluster.peer_deadline); one
// without is held to a minute.
absl::Time CallDeadline(const grpc::ServerContext& context) {
  return std::min(absl::FromChrono(context.deadline()), absl::Now() + absl::Minutes(1));
}

// An encoded block a peer spills here must be a whole STAR-KV container (header, segment table
// and both CRC32Cs check out) of a block of `block_bytes` raw bytes, or this node would keep a
// block that no reader can decode. Raw blocks (level 0) pass.
// The node id a Rejoin or Leave names: a peer's cluster.advertise, not this daemon's own.
absl::Status CheckCallerNode(const char* call, const std::string& node, const std::string& self) {
  constexpr size_t kMaxNodeId = 1024;
  if (node.empty() || node.size() > kMaxNodeId) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, " node is ", node.size(), " bytes; expected a node id of 1 to ", kMaxNodeId));
  }
  if (node == self) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, " node '", node, "' is this daemon's own id; expected a peer's"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<BlockId>> ResolveBlockSet(const TierService& core,
                                                     const v1::PeerBlockSet& set,
                                                     size_t max_keys) {
  PROXIMA_ASSIGN_OR_RETURN(uint32_t ns, core.NamespaceIndex(set.namespace_name()));
  if (static_cast<size_t>(set.keys_size()) > max_keys) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer call has ", set.keys_size(), " keys; at most ", max_keys));
  }
  // Partition numbers are per config; scopes are what the nodes share.
  uint32_t partition = set.partition();
  if (set.has_scope()) {
    std::optional<uint32_t> here = core.ScopePartition(ns, set.scope());
    if (!here) {
      return absl::NotFoundError(absl::StrCat(
          "peer call names token scope '", set.scope().substr(0, 64), "' of namespace '",
          set.namespace_name(), "', which is not one of its scopes on this daemon (the nodes' ",
          "namespace configs differ: private_prefixes, or the tokens)"));
    }
    partition = *here;
  } else if (!core.PartitionScope(ns, partition)) {
    return absl::InvalidArgumentError(absl::StrCat("peer call names partition ", partition,
                                                   " of namespace '", set.namespace_name(),
                                                   "', which this daemon does not have"));
  }
  std::vector<BlockId> ids(set.keys_size());
  for (int i = 0; i < set.keys_size(); ++i) {
    if (set.keys(i).size() != kKeyBytes) {
      return absl::InvalidArgumentError(absl::StrCat("peer call keys[", i, "] is ",
                                                     set.keys(i).size(), " bytes; keys are ",
                                                     kKeyBytes));
    }
    ids[i].namespace_index = ns;
    ids[i].partition = partition;
    ids[i].profile_id = set.profile_id();
    std::memcpy(ids[i].key.data(), set.keys(i).data(), kKeyBytes);
  }
  return ids;
}

void NamePartition(const TierService& core, uint32_t ns, uint32_t partition,
                   v1::PeerBlockSet* set) {
  set->set_partition(partition);
  if (std::optional<std::string> scope = core.PartitionScope(ns, partition)) {
    set->set_scope(*std::move(scope));
  }
}

PeerService::PeerService(TierService* core, LocationTable* records, RemoteBlocks* remote,
                         PeerUcx* ucx, std::string self, const PeerTokens* tokens,
                         uint64_t max_message_bytes, Acceptance accept, metrics::Registry* registry,
                         absl::Duration recent_delete_window, absl::Duration recent_delete_slack)
    : core_(core),
      records_(records),
      remote_(remote),
      ucx_(ucx),
      self_(std::move(self)),
      tokens_(tokens),
      max_message_bytes_(max_message_bytes),
      accept_(accept),
      // Deletes are rare; 64K keys bound the set to a few MiB.
      recent_deletes_(recent_delete_window, kMaxRecentDeletes, recent_delete_slack) {
  unauthenticated_ = registry->AddCounter(
      "proxima_cluster_peer_calls_unauthenticated_total",
      "Peer calls refused for a missing or wrong cluster.peer_token");
  records_refused_ = registry->AddCounter(
      "proxima_cluster_location_records_refused_total",
      "Location records not kept here as home: their holder was not in this node's live set "
      "(leaving, or not yet seen to join; it sends them again when it is)");
  served_bytes_ = metrics::TransferBytes(registry, "peer_grpc", "out");
  spill_kept_ = registry->AddCounter("proxima_cluster_spill_received_blocks_total",
                                     "Blocks peers spilled to this node, by outcome",
                                     {{"outcome", "kept"}});
  spill_refused_ = registry->AddCounter("proxima_cluster_spill_received_blocks_total",
                                        "Blocks peers spilled to this node, by outcome",
                                        {{"outcome", "no_room"}});
  spill_declined_deleted_ = registry->AddCounter("proxima_cluster_spill_received_blocks_total",
                                                 "Blocks peers spilled to this node, by outcome",
                                                 {{"outcome", "deleted_recently"}});
  spill_decoded_ = registry->AddCounter(
      "proxima_cluster_spill_decoded_blocks_total",
      "Encoded blocks peers spilled or handed off to this node whose level's codec plan is no "
      "level of this node's hierarchy (nodes on different configs): kept decoded, raw, for this "
      "node's tierer to encode");
  deletes_learned_ = registry->AddCounter(
      "proxima_cluster_recent_deletes_learned_total",
      "Keys of recent Deletes this node learned from its peers after it started (Deletes made "
      "while it was down, so that its blocks put again after them are not declined as older)");
  spill_bytes_in_ = registry->AddCounter("proxima_cluster_spill_bytes_total",
                                         "Block bytes spilled between daemons, by direction",
                                         {{"direction", "in"}});
}

absl::Status PeerService::Authenticate(const grpc::ServerContext& context) const {
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  const std::string presented =
      it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
  if (!tokens_->Accepts(presented)) {
    unauthenticated_->Increment();
    return absl::UnauthenticatedError(
        "proxima.v1.Peer needs the cluster's peer token (cluster.peer_token)");
  }
  return absl::OkStatus();
}

template <typename Req, typename Resp, typename Serve>
grpc::Status PeerService::Handle(grpc::ServerContext* context, const Req* request,
                                 Resp* response, Serve serve) {
  in_flight_.fetch_add(1);
  absl::Cleanup served = [this] { in_flight_.fetch_sub(1); };
  absl::Status status = Authenticate(*context);
  if (status.ok()) status = serve(*request, response);
  if (!status.ok()) response->Clear();
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status PeerService::ServeRecord(const v1::RecordLocationsRequest& request,
                                      v1::RecordLocationsResponse* response) {
  if (request.holder().empty()) return absl::InvalidArgumentError("holder is empty");
  PROXIMA_ASSIGN_OR_RETURN(std::vector<BlockId> ids,
                           ResolveBlockSet(*core_, request.blocks(), core_->max_lookup_keys()));
  if (request.forget()) {
    response->set_changed(static_cast<uint32_t>(records_->Forget(ids, request.holder())));
  } else if (!is_live_ || is_live_(request.holder())) {
    records_->Record(ids, request.holder());
    response->set_changed(static_cast<uint32_t>(ids.size()));
  } else {
    records_refused_->Increment(ids.size());
  }
  return absl::OkStatus();
}

absl::Status PeerService::ServeLookup(const v1::LookupLocationsRequest& request,
                                      v1::LookupLocationsResponse* response) {
  PROXIMA_ASSIGN_OR_RETURN(std::vector<BlockId> ids,
                           ResolveBlockSet(*core_, request.blocks(), core_->max_lookup_keys()));
  std::vector<std::string> holders = records_->Find(ids);
  for (size_t i = 0; i < ids.size(); ++i) {
    // This node's own tiers first: the block may be here whatever the records say.
    response->add_holders(core_->store().Contains(ids[i]) ? self_ : holders[i]);
  }
  return absl::OkStatus();
}

absl::Status PeerService::ServeFetch(const v1::FetchBlocksRequest& request,
                                     v1::FetchBlocksResponse* response, absl::Time deadline) {
  PROXIMA_ASSIGN_OR_RETURN(std::vector<BlockId> ids,
                           ResolveBlockSet(*core_, request.blocks(), core_->max_batch_blocks()));
  // Pinned until sent: eviction cannot free the bytes under the transfer. Checked against their
  // CRC32C here (a block that fails is dropped and not sent), and again by the receiver.
  auto blocks = std::make_shared<std::vector<std::optional<BlockStore::ReadBlock>>>(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    (*blocks)[i] = core_->store().Read(ids[i], BlockStore::CrcCheck::kHere);
  }
  // Over UCX when the reader names its worker and this daemon runs the UCX data plane: every
  // found block no larger than the reader takes; the others (and all of them when the reader's
  // worker cannot be reached) inline.
  std::vector<bool> by_ucx(ids.size(), false);
  if (ucx_ != nullptr && !request.ucx_worker().empty()) {
    for (size_t i = 0; i < ids.size(); ++i) {
      by_ucx[i] = (*blocks)[i] && !(*blocks)[i]->bytes.empty() &&
                  (*blocks)[i]->bytes.size() <= request.ucx_max_block_bytes();
    }
    absl::Status sent = ucx_->Write(request, blocks, by_ucx, deadline);
    if (absl::IsFailedPrecondition(sent)) {
      PROXIMA_LOG(kDebug) << "answering a fetch inline" << log::Kv("error", sent.ToString());
      std::fill(by_ucx.begin(), by_ucx.end(), false);
    } else if (!sent.ok()) {
      return sent;
    } else {
      response->set_ucx_sent(true);
    }
  }
  uint64_t bytes = kMessageOverhead;
  uint64_t sent = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    v1::FetchedBlock* out = response->add_blocks();
    const std::optional<BlockStore::ReadBlock>& b = (*blocks)[i];
    if (!b) continue;
    if (by_ucx[i]) {
      out->set_size(b->bytes.size());
    } else {
      if (bytes + b->bytes.size() + kPerBlockOverhead > max_message_bytes_) continue;
      bytes += b->bytes.size() + kPerBlockOverhead;
      out->set_data(reinterpret_cast<const char*>(b->bytes.data()), b->bytes.size());
      sent += b->bytes.size();
    }
    out->set_found(true);
    out->set_crc32c(b->crc32c);
    out->set_level(b->level);
  }
  served_bytes_->Increment(sent);
  return absl::OkStatus();
}

absl::Status PeerService::ServeStore(const v1::StoreBlocksRequest& request,
                                     v1::StoreBlocksResponse* response, absl::Time deadline) {
  PROXIMA_ASSIGN_OR_RETURN(std::vector<BlockId> ids,
                           ResolveBlockSet(*core_, request.blocks(), core_->max_batch_blocks()));
  if (request.data_size() != static_cast<int>(ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat("StoreBlocks has ", ids.size(), " keys but ",
                                                   request.data_size(), " blocks of data"));
  }
  if (request.block_bytes() == 0 || request.block_bytes() > max_message_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("StoreBlocks block_bytes is ",
                                                   request.block_bytes(), "; expected 1 to ",
                                                   max_message_bytes_));
  }
  // Peers name profiles by id, a hash of the profile's fields; when the profile is registered
  // here its block size is known, and a peer that states another one (a bug, another version
  // computing sizes differently) would have this node serve blocks of the wrong size.
  if (!ids.empty()) {
    absl::StatusOr<uint64_t> registered =
        core_->RegisteredBlockBytes(ids[0].namespace_index, request.blocks().profile_id());
    if (registered.ok() && *registered != request.block_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "StoreBlocks block_bytes is ", request.block_bytes(), " but profile ",
          absl::Hex(request.blocks().profile_id(), absl::kZeroPad16), " of namespace '",
          request.blocks().namespace_name(), "' is registered here with ", *registered,
          "-byte blocks; nothing was stored"));
    }
  }
  if (!request.ucx_worker_address().empty()) {
    // An older sender offering its arena for one-sided gets.
    return absl::FailedPreconditionError(
        "StoreBlocks names a UCX worker to pull from, but this daemon takes spilled blocks "
        "inline or as UCX messages only; send the bytes in the request");
  }
  const bool by_ucx = request.ucx_transfer() != 0;
  if (by_ucx && ucx_ == nullptr) {
    return absl::FailedPreconditionError(
        "StoreBlocks over UCX, but this daemon takes spilled blocks inline only (ucx.enabled, "
        "cluster.transport); send the bytes in the request");
  }
  // The blocks' bytes: inline, or the messages the sender sent for the transfer before this
  // call (kept alive by `parcels` until they are copied).
  std::vector<std::span<const std::byte>> data(ids.size());
  std::vector<std::shared_ptr<const ucx::Parcel>> parcels;
  if (by_ucx) {
    std::vector<uint32_t> slots(ids.size());
    std::iota(slots.begin(), slots.end(), 0u);
    // The sender sent them before it called: they are here or on their way. Waiting stops short
    // of the deadline, so that the sender hears why rather than a bare DEADLINE_EXCEEDED.
    const absl::Time now = absl::Now();
    const absl::Time wait_until =
        deadline - std::min(kAnswerMargin, std::max(deadline - now, absl::ZeroDuration()) / 4);
    parcels = ucx_->Collect(request.ucx_transfer(), slots, wait_until);
  }
  for (int i = 0; i < request.data_size(); ++i) {
    const v1::SpilledBlock& b = request.data(i);
    if (!by_ucx) {
      data[i] = AsBytes(b.data());
      continue;
    }
    if (!b.data().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("StoreBlocks data[", i, "] carries bytes in a request over UCX"));
    }
    if (parcels[i] == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("StoreBlocks data[", i, "] did not arrive as a UCX message of transfer ",
                       request.ucx_transfer(), " before the call's deadline; nothing was stored"));
    }
    if (parcels[i]->pending()) {
      return absl::InvalidArgumentError(
          absl::StrCat("StoreBlocks data[", i, "] arrived as a rendezvous UCX message; peers send "
                       "spilled blocks eager; nothing was stored"));
    }
    data[i] = parcels[i]->bytes();
    if (data[i].size() != b.ucx_size()) {
      return absl::InvalidArgumentError(absl::StrCat("StoreBlocks data[", i, "].ucx_size is ",
                                                     b.ucx_size(), " but its UCX message is ",
                                                     data[i].size(), " bytes; nothing was stored"));
    }
  }
  // Every block is checked before any is kept: a request with one bad block stores none.
  // level_here[i]: the level of this node's hierarchy with block i's plan; none: stored decoded.
  std::vector<std::optional<uint8_t>> level_here(ids.size());
  std::string scratch;
  for (int i = 0; i < request.data_size(); ++i) {
    const v1::SpilledBlock& b = request.data(i);
    if (b.level() >= static_cast<uint32_t>(kMaxLevels)) {
      return absl::InvalidArgumentError(absl::StrCat("StoreBlocks data[", i, "].level is ",
                                                     b.level(), "; levels are 0 to ",
                                                     kMaxLevels - 1));
    }
    const std::span<const std::byte> bytes = data[i];
    if (absl::Status s = CheckStoredSize(b.level(), bytes.size(), request.block_bytes()); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("StoreBlocks data[", i, "] ", s.message(), "; nothing was stored"));
    }
    const uint32_t crc = Crc32c(bytes);
    if (crc != b.crc32c()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "StoreBlocks data[%d].crc32c is 0x%08x but its bytes have CRC32C 0x%08x; nothing "
          "was stored",
          i, b.crc32c(), crc));
    }
    if (absl::Status s = CheckStoredContainer(b.level(), bytes, request.block_bytes()); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("StoreBlocks data[", i, "] ", s.message(), "; nothing was stored"));
    }
    level_here[i] =
        core_->LevelOfPlan(ids[i].namespace_index, static_cast<uint8_t>(b.level()), b.plan());
    if (!level_here[i]) {
      // Its plan is no level here: it is kept decoded, raw. Decoded once now, into a scratch
      // block, so that one that does not decode refuses the request before anything is
      // reserved (and a hand-off's reservation evicts); again into tier memory below.
      scratch.resize(request.block_bytes());
      if (absl::Status d = codec::DecodeBlock(bytes, AsWritableBytes(scratch)); !d.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "StoreBlocks data[", i, "] is at level ", b.level(), " with plan '",
            b.plan().substr(0, 200), "', which is no level here, and does not decode: ",
            d.message(), "; nothing was stored"));
      }
    }
  }
  // Which blocks to keep, in room this node has to spare (never evicting for spilled ones; for
  // a hand-off's as for a local put, when allowed), and their tier memory; visible only once
  // all of them are copied.
  BlockStore& store = core_->store();
  const double limit = accept_.below * static_cast<double>(store.capacity_bytes());
  const bool evict = request.handoff() && accept_.handoff_evicts;
  std::vector<BlockStore::PendingBlock> pending;
  std::vector<size_t> keep;        // request index of each pending block
  std::vector<uint32_t> kept_crc;  // CRC32C of each pending block's bytes
  uint64_t reserved = 0;           // tier bytes of the blocks kept
  uint64_t received = 0;           // their bytes as sent
  uint64_t declined = 0;
  // A hand-off's blocks already here, pinned until the end: the evictions that make room for the
  // others must not take a block this answer says is held.
  std::vector<BlockStore::ReadBlock> held;
  // Blocks answered as held because this node had them already: their homes may record another
  // holder (the sender, which drops its copy now), so they learn of this one as of those kept.
  std::vector<BlockKey> had;
  const absl::Duration sender_reach = request.deletes_known_ms() > 0
                                          ? absl::Milliseconds(request.deletes_known_ms())
                                          : absl::InfiniteDuration();
  for (size_t i = 0; i < ids.size(); ++i) {
    bool stored = false;
    if (evict) {
      std::optional<BlockStore::ReadBlock> here =
          store.Read(ids[i], BlockStore::CrcCheck::kByCaller);
      stored = here.has_value();
      if (here) held.push_back(*std::move(here));
    } else {
      stored = store.Contains(ids[i]);
    }
    if (stored) had.push_back(ids[i].key);
    if (!stored && recent_deletes_.Stale(ids[i], request.data(static_cast<int>(i)).after_delete(),
                                         sender_reach)) {
      // Deleted here by a Delete the sender had not seen when it sent the block: the sender
      // drops its copy (older than that Delete), as the Delete does when it reaches it. Not a
      // lack of room.
      response->add_stored(false);
      response->add_declined_deleted(static_cast<uint32_t>(i));
      ++declined;
      continue;
    }
    const uint64_t size = level_here[i] ? data[i].size() : request.block_bytes();
    std::optional<BlockStore::PendingBlock> p;
    if (!stored && !core_->FitsInNamespace(ids[i].namespace_index, reserved + size)) {
      // Past the namespace's max_bytes here: a peer's block never evicts the namespace's own.
    } else if (!stored && evict) {
      // The leaving peer's most recently used blocks, against this node's least recently used.
      p = store.Reserve(size);
    } else if (!stored && static_cast<double>(store.used_bytes() + size) <= limit) {
      // Never evicting for a peer's block; moving blocks to make free bytes contiguous is fine.
      p = store.ReserveCompacting(size);
    }
    if (p && level_here[i]) {
      std::memcpy(p->bytes().data(), data[i].data(), size);
      kept_crc.push_back(request.data(static_cast<int>(i)).crc32c());
    } else if (p) {
      // Decoded once already (above): this one does not fail.
      PROXIMA_RETURN_IF_ERROR(codec::DecodeBlock(data[i], p->bytes()));
      kept_crc.push_back(Crc32c(p->bytes()));
      spill_decoded_->Increment();
    }
    if (p) {
      pending.push_back(*std::move(p));
      keep.push_back(i);
      reserved += size;
      received += data[i].size();
      stored = true;
    }
    if (!stored) response->set_full(true);
    response->add_stored(stored);
  }
  std::vector<BlockKey> kept;
  for (size_t j = 0; j < keep.size(); ++j) {
    const v1::SpilledBlock& b = request.data(static_cast<int>(keep[j]));
    const BlockId& id = ids[keep[j]];
    BlockAttributes attributes;
    if (b.has_high_priority()) {
      // What the tierer may do with it here, as a put here would have it.
      BlockAttributes put;
      put.position = b.position();
      put.high_priority = b.high_priority();
      put.second_chance = b.second_chance();
      attributes = core_->AttributesAgain(id.namespace_index, id.profile_id, put);
    }
    attributes.from_peer = true;
    attributes.handed_off = request.handoff();
    store.Commit(id, std::move(pending[j]), kept_crc[j], attributes,
                 level_here[keep[j]].value_or(0));
    kept.push_back(ids[keep[j]].key);
  }
  const double room = evict ? static_cast<double>(store.capacity_bytes()) -
                                  static_cast<double>(store.protected_bytes())
                            : limit - static_cast<double>(store.used_bytes());
  response->set_room_bytes(room > 0 ? static_cast<uint64_t>(room) : 0);
  if (ucx_ != nullptr) response->set_ucx_worker(ucx_->address());
  spill_kept_->Increment(kept.size());
  spill_declined_deleted_->Increment(declined);
  spill_refused_->Increment(
      ids.size() - declined -
      static_cast<size_t>(std::count(response->stored().begin(), response->stored().end(), true)));
  spill_bytes_in_->Increment(received);
  if (by_ucx) ucx_->CountIn(received);
  if (!kept.empty() || !had.empty()) {
    // This node holds them now: their homes learn it as after a local put.
    std::vector<BlockKey> holds = std::move(kept);
    holds.insert(holds.end(), had.begin(), had.end());
    remote_->Stored({ids[0].namespace_index, request.blocks().namespace_name(), ids[0].partition,
                     ids[0].profile_id, std::move(holds), request.block_bytes()});
  }
  return absl::OkStatus();
}

absl::Status PeerService::ServeDelete(const v1::DeleteBlocksRequest& request,
                                      v1::DeleteBlocksResponse* response) {
  PROXIMA_ASSIGN_OR_RETURN(std::vector<BlockId> ids,
                           ResolveBlockSet(*core_, request.blocks(), core_->max_batch_blocks()));
  // Present here or not: a spill of them may still be on its way. A caller that names no
  // Delete (a spill's withdrawal) gets an id of its own, which no spill names.
  recent_deletes_.Add(ids, request.delete_id() != 0 ? request.delete_id() : RecentDeletes::NewId(),
                      absl::Now(),
                      absl::Milliseconds(std::min<uint64_t>(request.age_ms(), INT64_MAX / 2)));
  std::vector<BlockKey> gone;
  for (const BlockId& id : ids) {
    const bool deleted = core_->store().Delete(id);
    response->add_deleted(deleted);
    if (deleted) gone.push_back(id.key);
  }
  if (!gone.empty()) {
    // Their homes drop the records naming this node, as after a local Delete.
    remote_->Removed({ids[0].namespace_index, request.blocks().namespace_name(), ids[0].partition,
                      ids[0].profile_id, gone});
  }
  return absl::OkStatus();
}

absl::Status PeerService::ServeRejoin(const v1::RejoinRequest& request,
                                      v1::RejoinResponse* response) {
  PROXIMA_RETURN_IF_ERROR(CheckCallerNode("Rejoin", request.node(), self_));
  if (on_rejoin_) on_rejoin_(request.node());
  if (!request.want_recent_deletes()) return absl::OkStatus();
  const absl::Time now = absl::Now();
  response->set_deletes_known_ms(
      static_cast<uint64_t>(absl::ToInt64Milliseconds(recent_deletes_.Reach(now))));
  // One set per (namespace, partition, profile).
  absl::flat_hash_map<std::tuple<uint32_t, uint32_t, uint64_t>, v1::RecentDeleteSet*> sets;
  for (const RecentDeletes::Noted& n : recent_deletes_.Snapshot(now)) {
    v1::RecentDeleteSet*& set = sets[{n.id.namespace_index, n.id.partition, n.id.profile_id}];
    if (set == nullptr) {
      set = response->add_recent_deletes();
      set->mutable_blocks()->set_namespace_name(core_->NamespaceName(n.id.namespace_index));
      NamePartition(*core_, n.id.namespace_index, n.id.partition, set->mutable_blocks());
      set->mutable_blocks()->set_profile_id(n.id.profile_id);
    }
    set->mutable_blocks()->add_keys(reinterpret_cast<const char*>(n.id.key.data()), kKeyBytes);
    set->add_delete_ids(n.delete_id);
    set->add_age_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(n.age)));
  }
  return absl::OkStatus();
}

size_t PeerService::LearnDeletes(const std::string& peer, const v1::RejoinResponse& response) {
  std::vector<RecentDeletes::Noted> noted;
  for (const v1::RecentDeleteSet& set : response.recent_deletes()) {
    absl::StatusOr<std::vector<BlockId>> ids =
        ResolveBlockSet(*core_, set.blocks(), kMaxRecentDeletes);
    if (ids.ok() && (set.delete_ids_size() != static_cast<int>(ids->size()) ||
                     set.age_ms_size() != static_cast<int>(ids->size()))) {
      ids = absl::InvalidArgumentError(absl::StrCat(
          "recent_deletes has ", ids->size(), " keys but ", set.delete_ids_size(),
          " delete_ids and ", set.age_ms_size(), " age_ms; expected one of each per key"));
    }
    if (!ids.ok()) {
      PROXIMA_LOG(kWarning) << "a peer's recent Deletes not taken in" << log::Kv("peer", peer)
                            << log::Kv("error", ids.status().ToString());
      continue;
    }
    for (size_t i = 0; i < ids->size(); ++i) {
      const int k = static_cast<int>(i);
      noted.push_back({(*ids)[i], set.delete_ids(k),
                       absl::Milliseconds(std::min<uint64_t>(set.age_ms(k), INT64_MAX / 2))});
    }
  }
  recent_deletes_.Learn(
      noted, absl::Milliseconds(std::min<uint64_t>(response.deletes_known_ms(), INT64_MAX / 2)));
  deletes_learned_->Increment(noted.size());
  return noted.size();
}

absl::Status PeerService::ServeLeave(const v1::LeaveRequest& request) {
  PROXIMA_RETURN_IF_ERROR(CheckCallerNode("Leave", request.node(), self_));
  return on_leave_ ? on_leave_(request.node()) : absl::OkStatus();
}

grpc::Status PeerService::Rejoin(grpc::ServerContext* context, const v1::RejoinRequest* request,
                                 v1::RejoinResponse* response) {
  return Handle(context, request, response,
                [this](const auto& r, auto* out) { return ServeRejoin(r, out); });
}

grpc::Status PeerService::Leave(grpc::ServerContext* context, const v1::LeaveRequest* request,
                                v1::LeaveResponse* response) {
  return Handle(context, request, response, [this](const auto& r, auto*) { return ServeLeave(r); });
}

grpc::Status PeerService::RecordLocations(grpc::ServerContext* context,
                                                       const v1::RecordLocationsRequest* request,
                                                       v1::RecordLocationsResponse* response) {
  return Handle(context, request, response,
                [this](const auto& r, auto* out) { return ServeRecord(r, out); });
}

grpc::Status PeerService::LookupLocations(grpc::ServerContext* context,
                                                       const v1::LookupLocationsRequest* request,
                                                       v1::LookupLocationsResponse* response) {
  return Handle(context, request, response,
                [this](const auto& r, auto* out) { return ServeLookup(r, out); });
}

grpc::Status PeerService::FetchBlocks(grpc::ServerContext* context,
                                                   const v1::FetchBlocksRequest* request,
                                                   v1::FetchBlocksResponse* response) {
  const absl::Time deadline = CallDeadline(*context);
  return Handle(context, request, response, [this, deadline](const auto& r, auto* out) {
    return ServeFetch(r, out, deadline);
  });
}

grpc::Status PeerService::StoreBlocks(grpc::ServerContext* context,
                                      const v1::StoreBlocksRequest* request,
                                      v1::StoreBlocksResponse* response) {
  const absl::Time deadline = CallDeadline(*context);
  return Handle(context, request, response, [this, deadline](const auto& r, auto* out) {
    return ServeStore(r, out, deadline);
  });
}

grpc::Status PeerService::DeleteBlocks(grpc::ServerContext* context,
                                       const v1::DeleteBlocksRequest* request,
                                       v1::DeleteBlocksResponse* response) {
  return Handle(context, request, response,
                [this](const auto& r, auto* out) { return ServeDelete(r, out); });
}

}  // namespace proxima::daemon::cluster
