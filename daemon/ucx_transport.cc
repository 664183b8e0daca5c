#include "daemon/ucx_transport.h"

#include <algorithm>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/copy_pool.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace proxima::daemon {
namespace {

// Transfers stop this much before the call's deadline (at most), so the answer still arrives.
constexpr absl::Duration kAnswerMargin = absl::Milliseconds(500);

absl::Time TransferDeadline(absl::Time call_deadline) {
  absl::Duration left = call_deadline - absl::Now();
  return call_deadline - std::min(kAnswerMargin, left / 10);
}

struct Segment {
  uint32_t region;
  uint64_t address;
  uint64_t length;
};

// Checks a request's regions and each block's scatter/gather list against `block_bytes`; fills
// `segments` (one list per block), `rkeys` and their `registration_ids`.
absl::Status PlanBlocks(const char* method,
                        const google::protobuf::RepeatedPtrField<v1::UcxRegion>& regions,
                        const google::protobuf::RepeatedPtrField<v1::UcxBlock>& blocks,
                        uint32_t max_blocks, uint64_t block_bytes,
                        std::vector<std::vector<Segment>>* segments,
                        std::vector<std::string>* rkeys, std::vector<uint64_t>* registration_ids) {
  if (blocks.empty()) return absl::InvalidArgumentError(absl::StrCat(method, " has no blocks"));
  if (static_cast<uint32_t>(blocks.size()) > max_blocks) {
    return absl::ResourceExhaustedError(absl::StrCat(
        method, " has ", blocks.size(), " blocks; the limit is ", max_blocks, " per call"));
  }
  if (regions.empty() || regions.size() > UcxTransport::kMaxRegions) {
    return absl::InvalidArgumentError(absl::StrCat(
        method, " has ", regions.size(), " regions; expected 1..", UcxTransport::kMaxRegions));
  }
  for (int r = 0; r < regions.size(); ++r) {
    const v1::UcxRegion& region = regions[r];
    if (region.length() == 0 || region.address() + region.length() < region.address()) {
      return absl::InvalidArgumentError(
          absl::StrCat(method, " regions[", r, "] has address ", region.address(), " and length ",
                       region.length(), "; expected a non-empty range"));
    }
    if (region.rkey().empty() || region.rkey().size() > ucx::kMaxPackedRkeyBytes) {
      return absl::InvalidArgumentError(absl::StrCat(method, " regions[", r, "].rkey is ",
                                                     region.rkey().size(), " bytes; expected 1..",
                                                     ucx::kMaxPackedRkeyBytes));
    }
    rkeys->push_back(region.rkey());
    registration_ids->push_back(region.registration_id());
  }
  segments->resize(blocks.size());
  for (int b = 0; b < blocks.size(); ++b) {
    const v1::UcxBlock& block = blocks[b];
    if (block.key().size() != kKeyBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(method, " blocks[", b, "].key is ", block.key().size(),
                       " bytes; keys are exactly ", kKeyBytes, " bytes"));
    }
    if (block.segments().empty() || block.segments_size() > UcxTransport::kMaxSegmentsPerBlock) {
      return absl::InvalidArgumentError(
          absl::StrCat(method, " blocks[", b, "] has ", block.segments_size(),
                       " segments; expected 1..", UcxTransport::kMaxSegmentsPerBlock));
    }
    uint64_t total = 0;
    for (int s = 0; s < block.segments_size(); ++s) {
      const v1::UcxSegment& seg = block.segments(s);
      if (seg.region() >= static_cast<uint32_t>(regions.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat(method, " blocks[", b, "].segments[", s, "].region is ", seg.region(),
                         "; the request has ", regions.size(), " regions"));
      }
      const v1::UcxRegion& region = regions[seg.region()];
      const uint64_t end = seg.address() + seg.length();
      if (seg.length() == 0 || end < seg.address() || seg.address() < region.address() ||
          end > region.address() + region.length()) {
        return absl::InvalidArgumentError(
            absl::StrCat(method, " blocks[", b, "].segments[", s, "] is [", seg.address(), ", +",
                         seg.length(), "); expected a non-empty range inside regions[",
                         seg.region(), "] [", region.address(), ", +", region.length(), ")"));
      }
      total += seg.length();
      if (total > block_bytes) break;
      (*segments)[b].push_back(Segment{seg.region(), seg.address(), seg.length()});
    }
    if (total != block_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(method, " blocks[", b, "] segments add up to ",
                                                     total, " bytes; the profile's blocks are ",
                                                     block_bytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

// Checks a PutUcx request whose bytes came as messages: keys only, no regions or segments.
absl::Status PlanMessageBlocks(const v1::PutUcxRequest& request, uint32_t max_blocks) {
  const auto& blocks = request.blocks();
  if (blocks.empty()) return absl::InvalidArgumentError("PutUcx has no blocks");
  if (static_cast<uint32_t>(blocks.size()) > max_blocks) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "PutUcx has ", blocks.size(), " blocks; the limit is ", max_blocks, " per call"));
  }
  if (!request.regions().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PutUcx names ucx_transfer ", request.ucx_transfer(), " and ", request.regions_size(),
        " regions; blocks sent as messages come with no regions"));
  }
  for (int b = 0; b < blocks.size(); ++b) {
    if (blocks[b].key().size() != kKeyBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("PutUcx blocks[", b, "].key is ", blocks[b].key().size(),
                       " bytes; keys are exactly ", kKeyBytes, " bytes"));
    }
    if (!blocks[b].segments().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("PutUcx blocks[", b, "] has ", blocks[b].segments_size(),
                       " segments and the request names ucx_transfer ", request.ucx_transfer(),
                       "; blocks sent as messages come with no segments"));
    }
  }
  return absl::OkStatus();
}

// Collect's margin: messages are waited for until this much before the transfer deadline, so a
// missing one is reported as such rather than as a missed deadline.
absl::Time CollectDeadline(absl::Time transfer_deadline) {
  const absl::Duration left = transfer_deadline - absl::Now();
  return transfer_deadline - std::min(absl::Milliseconds(200), left / 4);
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(
    const UcxConfig& config, TierService* core, metrics::Registry* registry,
    const std::vector<std::string>& address_check_command) {
  std::unique_ptr<UcxTransport> t(new UcxTransport(config, core));
  std::function<absl::Status(const std::string&, absl::Time)> check;
  if (config.check_worker_addresses) {
    if (address_check_command.empty()) {
      return absl::FailedPreconditionError(
          "ucx.check_worker_addresses is true but this process has no command to check worker "
          "addresses with (proximad runs itself); set it false to embed the daemon");
    }
    t->address_check_ = std::make_unique<ucx::AddressCheck>(address_check_command);
    check = [c = t->address_check_.get()](const std::string& address, absl::Time deadline) {
      return c->Check(address, deadline);
    };
  }
  PROXIMA_ASSIGN_OR_RETURN(
      t->worker_,
      ucx::Worker::Create("proximad", CopyPool::HelpersFor(config.copy_threads), std::move(check)));
  if (t->address_check_ != nullptr) {
    // The check itself must work here (the command runs, its UCX opens and accepts a good
    // address): found now, not at the first client's ConnectUcx.
    const absl::Status own =
        t->address_check_->Check(t->worker_->address(), absl::Now() + absl::Seconds(30));
    if (!own.ok()) {
      return absl::Status(own.code(),
                          absl::StrCat("ucx.check_worker_addresses: checking this daemon's own "
                                       "worker address failed: ",
                                       own.message()));
    }
    ucx::AddressCheck* c = t->address_check_.get();
    registry->AddCounterFunction(
        "proxima_ucx_address_checks_total",
        "New UCX worker addresses of clients and cluster peers that a child process parsed "
        "before the daemon's UCX did (ucx.check_worker_addresses; monotonic)",
        {}, [c] { return static_cast<double>(c->children_run()); });
    registry->AddCounterFunction(
        "proxima_ucx_addresses_refused_total",
        "UCX worker addresses refused because UCX could not parse them without failing in the "
        "child process that tried (monotonic)",
        {}, [c] { return static_cast<double>(c->refused()); });
  }
  std::span<std::byte> arena = core->store().arena();
  PROXIMA_ASSIGN_OR_RETURN(t->arena_, t->worker_->Register(arena.data(), arena.size()));
  t->session_ids_.seed(std::random_device{}());
  UcxTransport* raw = t.get();
  const ucx::Worker* w = t->worker_.get();
  registry->AddGauge("proxima_ucx_sessions", "UCX sessions (client endpoints) open", {},
                     [raw] { return static_cast<double>(raw->sessions()); });
  registry->AddGauge("proxima_ucx_endpoints", "UCX endpoints alive in the daemon's worker", {},
                     [w] { return static_cast<double>(w->live_endpoints()); });
  registry->AddGauge("proxima_ucx_registrations",
                     "UCX memory registrations alive in the daemon (the host tier arena)",
                     {}, [w] { return static_cast<double>(w->live_registrations()); });
  registry->AddCounterFunction("proxima_ucx_peer_failures_total",
                               "UCX endpoints that failed because their peer did (monotonic)", {},
                               [w] { return static_cast<double>(w->peer_failures()); });
  registry->AddCounterFunction(
      "proxima_ucx_rkeys_unpacked_total",
      "Remote keys of client (and peer daemon) buffers the daemon unpacked; each endpoint keeps "
      "the ones it uses, "
      "so this grows with new buffers, not with calls",
      {}, [w] { return static_cast<double>(w->rkeys_unpacked()); });
  registry->AddCounterFunction(
      "proxima_ucx_direct_transfers_total",
      "UCX transfers whose bytes the daemon copied itself through a client's (or peer's) shared "
      "memory segment mapped into it, instead of one-sided UCX operations (monotonic)",
      {}, [w] { return static_cast<double>(w->direct_transfers()); });
  registry->AddCounterFunction(
      "proxima_ucx_copy_pieces_by_helpers_total",
      "256 KiB pieces of such copies that the daemon's copy helpers (ucx.copy_threads) made "
      "beside the call's own thread (monotonic)",
      {}, [w] { return static_cast<double>(w->pieces_copied_by_helpers()); });
  // Messages from clients (PutUcx) and from peer daemons (fetches, spills) wait in the worker
  // until a call collects them.
  registry->AddGauge("proxima_ucx_parked_bytes",
                     "Bytes of blocks that arrived as UCX messages (from clients' puts, or peers' "
                     "fetch answers and spills) and wait for their call to collect them; a "
                     "rendezvous message, whose bytes are still at its sender, counts 256",
                     {}, [w] { return static_cast<double>(w->parked_bytes()); });
  registry->AddCounterFunction(
      "proxima_ucx_rendezvous_bytes_total",
      "Bytes of rendezvous UCX messages (clients' puts of blocks of at least "
      "ucx_rendezvous_bytes) that UCX moved straight into the memory the daemon reserved for "
      "them; eager messages' bytes are not counted (monotonic)",
      {}, [w] { return static_cast<double>(w->rendezvous_bytes()); });
  registry->AddCounterFunction(
      "proxima_ucx_rendezvous_sent_bytes_total",
      "Bytes of blocks GetUcx sent as rendezvous UCX messages (clients' gets of blocks of at "
      "least their ucx_rendezvous_get_bytes, over tcp) whose sends ended without error: the "
      "client had UCX move them from the daemon's memory into its own, or dropped them unread "
      "(monotonic)",
      {}, [w] { return static_cast<double>(w->rendezvous_sent_bytes()); });
  registry->AddGauge(
      "proxima_ucx_rendezvous_get_held_bytes",
      "Bytes of found blocks the daemon keeps pinned for GetUcx rendezvous messages their client "
      "has not taken or dropped yet",
      {}, [held = t->rendezvous_get_held_] { return static_cast<double>(held->load()); });
  registry->AddCounterFunction(
      "proxima_ucx_messages_dropped_total",
      "UCX messages dropped: malformed, late (their call had ended), a slot sent twice, never "
      "collected within 30 s, or past the worker's limit of uncollected bytes (monotonic)",
      {}, [w] { return static_cast<double>(w->messages_dropped()); });
  const std::string by_messages_help =
      "PutUcx / GetUcx calls whose bytes moved as UCX messages between the client's worker and "
      "the daemon's rather than by one-sided operations or copies through mapped memory "
      "(monotonic)";
  t->put_by_messages_ = registry->AddCounter("proxima_ucx_calls_by_messages_total",
                                             by_messages_help, {{"op", "put"}});
  t->get_by_messages_ = registry->AddCounter("proxima_ucx_calls_by_messages_total",
                                             by_messages_help, {{"op", "get"}});
  t->bytes_in_ = metrics::TransferBytes(registry, "ucx", "in");
  t->bytes_out_ = metrics::TransferBytes(registry, "ucx", "out");
  PROXIMA_LOG(kInfo) << "UCX data plane ready" << log::Kv("arena_bytes", arena.size())
                     << log::Kv("max_sessions", config.max_sessions)
                     << log::Kv("copy_threads", t->worker_->copy_helpers());
  return t;
}

UcxTransport::~UcxTransport() {
  absl::flat_hash_map<uint64_t, Session> sessions;
  {
    proxima::MutexLock lock(&mu_);
    sessions.swap(sessions_);
  }
  sessions.clear();
  arena_.reset();
  worker_.reset();
}

int64_t UcxTransport::sessions() const {
  proxima::MutexLock lock(&mu_);
  return static_cast<int64_t>(sessions_.size());
}

void UcxTransport::DropSession(uint64_t session_id) {
  std::shared_ptr<ucx::Endpoint> dropped;  // released outside the lock
  proxima::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return;
  dropped = std::move(it->second.endpoint);
  sessions_.erase(it);
}

absl::StatusOr<std::shared_ptr<ucx::Endpoint>> UcxTransport::FindSession(const Caller& caller,
                                                                         uint64_t session_id) {
  proxima::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("UCX session ", session_id,
                                            " is not open (closed, or its client failed); "
                                            "call ConnectUcx again"));
  }
  const Session& session = it->second;
  if (session.owner_namespace != caller.namespace_index ||
      session.owner_token != caller.token_name) {
    return absl::PermissionDeniedError(absl::StrCat(
        "UCX session ", session_id,
        " was opened by another caller; a session is used only with the bearer token that "
        "opened it (call ConnectUcx with ",
        caller.token_name.empty() ? std::string("no token")
                                  : absl::StrCat("token '", caller.token_name, "'"),
        ")"));
  }
  return session.endpoint;
}

absl::Status UcxTransport::Connect(const Caller& caller, const v1::ConnectUcxRequest& request,
                                   v1::ConnectUcxResponse* response, absl::Time deadline) {
  uint64_t id = 0;
  {
    proxima::MutexLock lock(&mu_);
    if (sessions_.size() >= config_.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "proximad has ", sessions_.size(),
          " UCX sessions open; the limit is ucx.max_sessions = ", config_.max_sessions));
    }
    while (id == 0 || sessions_.contains(id)) id = session_ids_();
  }
  UcxTransport* self = this;
  absl::StatusOr<std::shared_ptr<ucx::Endpoint>> ep = worker_->Connect(
      request.worker_address(), TransferDeadline(deadline), [self, id] { self->DropSession(id); },
      /*untrusted=*/true);
  if (!ep.ok()) {
    return absl::Status(ep.status().code(),
                        absl::StrCat("ConnectUcx worker_address: ", ep.status().message()));
  }
  {
    proxima::MutexLock lock(&mu_);
    sessions_[id] = Session{*ep, caller.namespace_index, caller.token_name};
  }
  if (!(*ep)->health().ok()) {
    DropSession(id);
    return (*ep)->health();
  }
  if (request.has_probe()) {
    absl::Status probe = Probe(**ep, request, TransferDeadline(deadline));
    if (!probe.ok()) {
      DropSession(id);
      return probe;
    }
  }
  // After the probe's transfer the endpoint's lanes are wired up. Only advice to the client:
  // when UCX cannot describe them, the client moves its memory as it is.
  absl::StatusOr<std::string> shm =
      worker_->SharedMemoryTransport(**ep, TransferDeadline(deadline));
  if (shm.ok()) response->set_shared_memory_transport(*shm);
  response->set_worker_address(worker_->address());
  response->set_pid_namespace(ucx::PidNamespace());
  response->set_ipc_namespace(ucx::IpcNamespace());
  if (shm.ok() && !shm->empty()) {
    proxima::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it != sessions_.end()) it->second.shared_memory = true;
  }
  response->set_session_id(id);
  return absl::OkStatus();
}

bool UcxTransport::OverSharedMemory(uint64_t session_id) const {
  proxima::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  return it != sessions_.end() && it->second.shared_memory;
}

absl::Status UcxTransport::Probe(ucx::Endpoint& endpoint, const v1::ConnectUcxRequest& request,
                                 absl::Time deadline) {
  const v1::UcxRegion& probe = request.probe();
  if (probe.length() == 0 || probe.length() > kMaxProbeBytes ||
      probe.address() + probe.length() < probe.address()) {
    return absl::InvalidArgumentError(absl::StrCat("ConnectUcx probe.length is ", probe.length(),
                                                   "; expected 1..", kMaxProbeBytes));
  }
  auto bytes = std::make_shared<std::vector<std::byte>>(probe.length());
  std::vector<ucx::Op> ops = {
      ucx::Op{ucx::Op::kGet, bytes->data(), bytes->size(), probe.address(), 0, nullptr}};
  std::vector<std::string> rkeys = {probe.rkey()};
  absl::Status moved = worker_->Transfer(endpoint, rkeys, std::move(ops), bytes, deadline);
  if (!moved.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("ConnectUcx probe: proximad cannot read the client's memory over UCX (",
                     moved.message(), "); the two sides' UCX_TLS must offer the same transports"));
  }
  if (Crc32c(*bytes) != request.probe_crc32c()) {
    return absl::FailedPreconditionError(
        absl::StrCat("ConnectUcx probe: the ", bytes->size(), " bytes read over UCX have CRC32C ",
                     Crc32c(*bytes), "; the client sent ", request.probe_crc32c()));
  }
  return absl::OkStatus();
}

absl::Status UcxTransport::Disconnect(const Caller& caller, const v1::DisconnectUcxRequest& request,
                                      v1::DisconnectUcxResponse*) {
  absl::StatusOr<std::shared_ptr<ucx::Endpoint>> session =
      FindSession(caller, request.session_id());
  if (absl::IsNotFound(session.status())) return absl::OkStatus();  // already closed: idempotent
  PROXIMA_RETURN_IF_ERROR(session.status());                        // another caller's: left open
  session->reset();
  DropSession(request.session_id());
  return absl::OkStatus();
}

absl::Status UcxTransport::Put(const Caller& caller, const v1::PutUcxRequest& request,
                               v1::PutResponse* response, absl::Time deadline) {
  const uint64_t transfer = request.ucx_transfer();
  // However the call ends, the messages of its transfer that no step took are dropped now
  // (and any arriving later on arrival), not held until they expire.
  bool collected = false;
  absl::Cleanup drop_uncollected = [this, transfer, &collected] {
    if (transfer != 0 && !collected) DropMessages(transfer);
  };
  PROXIMA_ASSIGN_OR_RETURN(
      TierService::ResolvedProfile target,
      core_->ResolveProfile(caller, request.namespace_name(), request.profile_id(),
                            TierService::Need::kWrite, "PutUcx"));
  const RegisteredProfile& profile = target.profile;
  std::vector<std::vector<Segment>> segments;
  std::vector<std::string> rkeys;
  std::vector<uint64_t> registration_ids;
  if (transfer != 0) {
    PROXIMA_RETURN_IF_ERROR(PlanMessageBlocks(request, core_->max_batch_blocks()));
    if (request.message_block_bytes() != profile.block_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("PutUcx message_block_bytes is ", request.message_block_bytes(),
                       "; the profile's blocks are ", profile.block_bytes, " bytes"));
    }
  } else {
    PROXIMA_RETURN_IF_ERROR(PlanBlocks("PutUcx", request.regions(), request.blocks(),
                                       core_->max_batch_blocks(), profile.block_bytes, &segments,
                                       &rkeys, &registration_ids));
  }
  PROXIMA_ASSIGN_OR_RETURN(std::shared_ptr<ucx::Endpoint> ep,
                           FindSession(caller, request.session_id()));
  std::vector<BlockKey> keys(request.blocks_size());
  std::vector<uint32_t> crcs(request.blocks_size());
  std::vector<int64_t> positions(request.blocks_size());
  std::vector<float> importance(request.blocks_size());
  for (int b = 0; b < request.blocks_size(); ++b) {
    const v1::UcxBlock& block = request.blocks(b);
    std::memcpy(keys[b].data(), block.key().data(), kKeyBytes);
    crcs[b] = block.crc32c();
    positions[b] = block.has_position() ? static_cast<int64_t>(block.position()) : -1;
    importance[b] = block.importance();
  }
  const TierService::PulledHints hints{positions, importance,
                                       request.priority() == v1::PRIORITY_HIGH};
  const absl::Time transfer_deadline = TransferDeadline(deadline);
  uint64_t pulled = 0;
  // The bytes came as messages: each block is copied out of its message (checked as it is
  // copied) into the memory reserved for it, or, sent as a rendezvous message, moved there by
  // UCX from the client's memory and checked where it landed.
  // Waiting for messages ends early when the client's endpoint fails: a client killed after
  // its call left but before all its messages did holds no reservation until the deadline.
  auto take = [this, &pulled, &collected, &ep, transfer, transfer_deadline](
                  std::span<const size_t> blocks, std::span<const std::span<std::byte>> dst,
                  std::span<uint32_t> crcs, std::shared_ptr<const void> owner) -> absl::Status {
    std::vector<uint32_t> slots(blocks.begin(), blocks.end());
    std::vector<std::shared_ptr<const ucx::Parcel>> parcels =
        worker_->Collect(transfer, slots, CollectDeadline(transfer_deadline), ep.get());
    collected = true;
    std::vector<std::shared_ptr<const ucx::Parcel>> pending;
    std::vector<ucx::Destination> pending_dst;
    for (size_t j = 0; j < blocks.size(); ++j) {
      if (parcels[j] == nullptr) {
        const absl::Status health = ep->health();
        return absl::UnavailableError(absl::StrCat(
            "PutUcx blocks[", blocks[j], "] (of ucx_transfer ", transfer,
            "): its UCX message did not arrive ",
            health.ok() ? "before the call's deadline"
                        : absl::StrCat("before the client's endpoint failed (", health.message(),
                                       ")"),
            "; nothing was stored"));
      }
      if (parcels[j]->size() != dst[j].size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "PutUcx blocks[", blocks[j], "] arrived as a UCX message of ", parcels[j]->size(),
            " bytes; the profile's blocks are ", dst[j].size(), " bytes; nothing was stored"));
      }
      if (parcels[j]->pending()) {
        pending.push_back(parcels[j]);
        // A block bound for a GPU pool lands in host memory of the call's own, outside the
        // arena's registration (TierService::PutPulled).
        pending_dst.push_back({{dst[j]}, ArenaCovering(dst[j])});
      }
    }
    if (!pending.empty()) {
      absl::Status received =
          worker_->Receive(pending, pending_dst, std::move(owner), transfer_deadline);
      if (!received.ok()) {
        return absl::Status(received.code(),
                            absl::StrCat("PutUcx ucx_transfer ", transfer, ": ", received.message(),
                                         "; nothing was stored"));
      }
    }
    for (size_t j = 0; j < blocks.size(); ++j) {
      crcs[j] = parcels[j]->pending() ? Crc32c(dst[j]) : parcels[j]->CopyTo(dst[j]);
      pulled += dst[j].size();
    }
    return absl::OkStatus();
  };
  auto pull = [this, &segments, &pulled, &ep, &rkeys, &registration_ids, transfer_deadline](
                  std::span<const size_t> blocks, std::span<const std::span<std::byte>> dst,
                  std::span<uint32_t> crcs, std::shared_ptr<const void> owner) -> absl::Status {
    std::vector<ucx::Op> ops;
    for (size_t j = 0; j < blocks.size(); ++j) {
      // A block bound for a GPU pool lands in host memory of the call's own, outside the arena's
      // registration (TierService::PutPulled).
      const ucx::Registration* memh = ArenaCovering(dst[j]);
      size_t offset = 0;
      for (const Segment& s : segments[blocks[j]]) {
        ops.push_back(ucx::Op{ucx::Op::kGet, dst[j].data() + offset, s.length, s.address, s.region,
                              memh, &crcs[j]});
        offset += s.length;
      }
      pulled += dst[j].size();
    }
    return worker_->Transfer(*ep, rkeys, std::move(ops), std::move(owner), transfer_deadline,
                             registration_ids);
  };
  absl::Status status;
  if (transfer != 0) {
    status = core_->PutPulled(target, keys, crcs, hints, take, response);
    if (status.ok()) put_by_messages_->Increment();
  } else {
    status = core_->PutPulled(target, keys, crcs, hints, pull, response);
    if (absl::IsUnavailable(status)) DropSession(request.session_id());
  }
  if (status.ok()) bytes_in_->Increment(pulled);
  return status;
}

absl::Status UcxTransport::SendGetMessages(
    ucx::Endpoint& ep, const v1::GetUcxRequest& request,
    std::shared_ptr<std::vector<std::optional<BlockStore::ReadBlock>>> blocks, uint64_t bytes,
    absl::Time deadline) {
  // Every block of a profile has the same size: the found blocks go all rendezvous or all eager.
  const uint64_t threshold = request.ucx_rendezvous_bytes();
  bool rendezvous = false;
  for (const auto& block : *blocks) {
    if (block) {
      rendezvous = threshold != 0 && block->bytes.size() >= threshold;
      break;
    }
  }
  // Rendezvous holds the blocks pinned after the answer: only where the endpoint can be closed
  // by force should the client never take them (not over UCX 1.13's shared memory, whose
  // endpoints run without peer error handling), and only while few bytes are held so.
  if (rendezvous && OverSharedMemory(request.session_id())) rendezvous = false;
  if (rendezvous &&
      rendezvous_get_held_->fetch_add(bytes) + bytes > config_.rendezvous_get_max_bytes) {
    rendezvous_get_held_->fetch_sub(bytes);
    rendezvous = false;
  }
  std::vector<ucx::Message> messages;
  for (size_t b = 0; b < blocks->size(); ++b) {
    if ((*blocks)[b]) {
      messages.push_back({static_cast<uint32_t>(b), (*blocks)[b]->bytes,
                          ArenaCovering((*blocks)[b]->bytes), rendezvous});
    }
  }
  if (!rendezvous) {
    return worker_->Send(ep, request.ucx_transfer(), std::move(messages), std::move(blocks),
                         TransferDeadline(deadline));
  }
  // The blocks stay pinned (and counted as held) until UCX lets go of them: each message taken
  // or dropped by the client, or its endpoint closed.
  struct Held {
    Held(std::shared_ptr<std::vector<std::optional<BlockStore::ReadBlock>>> b,
         std::shared_ptr<std::atomic<uint64_t>> c, uint64_t n)
        : blocks(std::move(b)), counter(std::move(c)), bytes(n) {}
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;
    ~Held() { counter->fetch_sub(bytes); }
    std::shared_ptr<std::vector<std::optional<BlockStore::ReadBlock>>> blocks;
    std::shared_ptr<std::atomic<uint64_t>> counter;
    uint64_t bytes;
  };
  auto held = std::make_shared<Held>(std::move(blocks), rendezvous_get_held_, bytes);
  PROXIMA_ASSIGN_OR_RETURN(
      std::unique_ptr<ucx::Sending> sending,
      worker_->StartSend(ep, request.ucx_transfer(), std::move(messages), std::move(held)));
  // The client takes the bytes once answered; it has until the call's deadline and the grace.
  sending->Detach(std::min(deadline, absl::Now() + ucx::Worker::kParkedFor) + kRendezvousGetGrace);
  return absl::OkStatus();
}

absl::Status UcxTransport::Get(const Caller& caller, const v1::GetUcxRequest& request,
                               v1::GetUcxResponse* response, absl::Time deadline) {
  PROXIMA_ASSIGN_OR_RETURN(
      TierService::ResolvedProfile target,
      core_->ResolveProfile(caller, request.namespace_name(), request.profile_id(),
                            TierService::Need::kRead, "GetUcx"));
  const RegisteredProfile& profile = target.profile;
  std::vector<std::vector<Segment>> segments;
  std::vector<std::string> rkeys;
  std::vector<uint64_t> registration_ids;
  PROXIMA_RETURN_IF_ERROR(PlanBlocks("GetUcx", request.regions(), request.blocks(),
                                     core_->max_batch_blocks(), profile.block_bytes, &segments,
                                     &rkeys, &registration_ids));
  PROXIMA_ASSIGN_OR_RETURN(std::shared_ptr<ucx::Endpoint> ep,
                           FindSession(caller, request.session_id()));
  v1::GetRequest get;
  get.set_namespace_name(request.namespace_name());
  get.set_profile_id(request.profile_id());
  get.set_client_verifies_crc32c(request.client_verifies_crc32c());
  for (const v1::UcxBlock& b : request.blocks()) get.add_keys(b.key());
  // Pinned until the puts are done: eviction cannot free the bytes under the transfer.
  auto blocks = std::make_shared<std::vector<std::optional<BlockStore::ReadBlock>>>();
  PROXIMA_RETURN_IF_ERROR(core_->GetBlocks(caller, get, blocks.get(), /*inline_response=*/false));
  std::vector<ucx::Op> ops;
  uint64_t pushed = 0;
  // Where the daemon copies into the caller's mapped memory itself, each block's CRC32C is taken
  // as it is copied (Crc32cCopy), so the caller need not read the block again to check it.
  std::vector<uint32_t> copied_crcs(blocks->size(), 0);
  for (size_t b = 0; b < blocks->size(); ++b) {
    const auto& block = (*blocks)[b];
    if (!block) continue;
    // The arena's registration covers a block read in place; a block decoded for the caller, or
    // copied out of a GPU pool, lies in memory of its own that UCX registers on the fly.
    const ucx::Registration* memh = ArenaCovering(block->bytes);
    size_t offset = 0;
    for (const Segment& s : segments[b]) {
      // The tier's bytes are only read; UCX's API takes a non-const pointer for both directions.
      ops.push_back(ucx::Op{ucx::Op::kPut, const_cast<std::byte*>(block->bytes.data()) + offset,
                            s.length, s.address, s.region, memh, &copied_crcs[b]});
      offset += s.length;
    }
    pushed += block->bytes.size();
  }
  bool copied_here = false;
  bool as_messages = false;
  const uint64_t transfer = request.ucx_transfer();
  if (!ops.empty()) {
    // A client that takes messages gets them wherever this daemon cannot copy into its memory
    // itself: the daemon is then never the initiator of a one-sided operation on a client, whose
    // UCX would abort if this daemon died mid-operation (docs/operations.md).
    absl::Status status =
        worker_->Transfer(*ep, rkeys, std::move(ops), blocks, TransferDeadline(deadline),
                          registration_ids, &copied_here, /*mapped_only=*/transfer != 0);
    if (status.ok() && transfer != 0 && !copied_here) {
      status = SendGetMessages(*ep, request, blocks, pushed, deadline);
      as_messages = true;
    }
    if (absl::IsUnavailable(status)) DropSession(request.session_id());
    PROXIMA_RETURN_IF_ERROR(status);
  }
  if (as_messages) {
    response->set_sent_as_messages(true);
    get_by_messages_->Increment();
  }
  for (size_t b = 0; b < blocks->size(); ++b) {
    const auto& block = (*blocks)[b];
    v1::GetUcxResult* r = response->add_results();
    if (!block) continue;
    r->set_found(true);
    r->set_crc32c(block->crc32c);
    // A mismatch is left to the caller's check, which asks again with the daemon verifying
    // (a block corrupt in tier memory is then dropped and counted).
    r->set_crc32c_checked(copied_here && copied_crcs[b] == block->crc32c);
  }
  bytes_out_->Increment(pushed);
  return absl::OkStatus();
}

}  // namespace proxima::daemon
