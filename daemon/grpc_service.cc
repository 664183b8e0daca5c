#include "daemon/grpc_service.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <type_traits>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/wire.h"

namespace proxima::daemon {
namespace {

constexpr const char* kMethodNames[] = {"GetServerInfo", "RegisterProfile", "Put",
                                        "Get",           "Lookup",          "Delete",
                                        "Stats",         "Decompress",      "ConnectUcx",
                                        "DisconnectUcx", "PutUcx",          "GetUcx"};

// Sends pinned (or freshly decoded) blocks without copying them.
grpc::ByteBuffer WriteBlocks(std::vector<std::optional<BlockStore::ReadBlock>>& blocks) {
  wire::GetResponseWriter writer;
  for (auto& b : blocks) {
    if (b) {
      writer.AddHit(b->bytes, b->crc32c, std::move(b->pin), b->level);
    } else {
      writer.AddMiss();
    }
  }
  return writer.Finish();
}

}  // namespace

// Finishes one call; when gRPC is done with it (response sent, or the call cancelled) ends the
// call in its peer's account (if it was admitted) and deletes itself (the callback API's
// contract). Outside the anonymous namespace: the lambdas of the member template Handle capture
// it, and GCC warns (-Wsubobject-linkage) where this file is compiled inside a unity batch.
class AccountedReactor final : public grpc::ServerUnaryReactor {
 public:
  // Finishes the call with `status`; once gRPC is done with it, `bytes` leave `peer`'s account
  // in `ledger` (null: nothing was admitted).
  void Finish(InflightLedger* ledger, std::string peer, uint64_t bytes, grpc::Status status) {
    ledger_ = ledger;
    peer_ = std::move(peer);
    bytes_ = bytes;
    ServerUnaryReactor::Finish(std::move(status));
  }
  void OnDone() override {
    if (ledger_ != nullptr) ledger_->End(peer_, bytes_);
    delete this;
  }

 private:
  InflightLedger* ledger_ = nullptr;
  std::string peer_;
  uint64_t bytes_ = 0;
};

namespace {

absl::string_view AuthorizationOf(const grpc::CallbackServerContext& context) {
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return {};
  return absl::string_view(it->second.data(), it->second.size());
}

}  // namespace

absl::Status InflightLedger::OverBytes(const std::string& peer, uint64_t held, uint64_t more,
                                       absl::string_view what, uint64_t own) const {
  absl::Status status = absl::ResourceExhaustedError(absl::StrCat(
      "client ", peer, " would hold ",
      held + std::min(more, std::numeric_limits<uint64_t>::max() - held), " bytes in proximad (",
      held, " in calls still running, ", more, " for this call's ", what,
      "); the limit is server.max_inflight_bytes_per_client = ", max_bytes_,
      "; send smaller batches or wait for running calls"));
  // Fits once the peer's other calls have released theirs (`own` of `held` is this call's):
  // worth sending again.
  if (held > own && Fits(own, more)) {
    status.SetPayload(kRetryWhenReleased, absl::Cord("1"));
  }
  return status;
}

absl::Status InflightLedger::Begin(const std::string& peer, uint64_t request_bytes) {
  proxima::MutexLock lock(&mu_);
  auto it = accounts_.find(peer);
  if (it == accounts_.end()) {
    if (!Fits(0, request_bytes)) return OverBytes(peer, 0, request_bytes, "request");
    if (accounts_.size() >= max_peers_) {
      absl::Status status = absl::ResourceExhaustedError(absl::StrCat(
          "client ", peer, " refused: ", accounts_.size(),
          " connections already have calls running; the limit is server.max_connections = ",
          max_peers_, "; retry shortly"));
      // Admitted once another connection's calls have ended: libproxima sends it again.
      status.SetPayload(kRetryWhenReleased, absl::Cord("1"));
      return status;
    }
    it = accounts_.emplace(peer, Account()).first;
  } else if (!Fits(it->second.bytes, request_bytes)) {
    return OverBytes(peer, it->second.bytes, request_bytes, "request");
  }
  it->second.bytes += request_bytes;
  ++it->second.calls;
  return absl::OkStatus();
}

absl::Status InflightLedger::AddResponse(const std::string& peer, uint64_t request_bytes,
                                         uint64_t response_bytes) {
  proxima::MutexLock lock(&mu_);
  Account& a = accounts_[peer];  // exists: Begin() admitted a call of this peer
  if (!Fits(a.bytes, response_bytes)) {
    return OverBytes(peer, a.bytes, response_bytes, "response", request_bytes);
  }
  a.bytes += response_bytes;
  return absl::OkStatus();
}

void InflightLedger::End(const std::string& peer, uint64_t bytes) {
  proxima::MutexLock lock(&mu_);
  auto it = accounts_.find(peer);
  if (it == accounts_.end()) return;
  it->second.bytes -= std::min(it->second.bytes, bytes);
  if (--it->second.calls == 0) accounts_.erase(it);
}

uint64_t InflightLedger::held_bytes(const std::string& peer) const {
  proxima::MutexLock lock(&mu_);
  auto it = accounts_.find(peer);
  return it == accounts_.end() ? 0 : it->second.bytes;
}

size_t InflightLedger::active_peers() const {
  proxima::MutexLock lock(&mu_);
  return accounts_.size();
}

HandlerThreads::~HandlerThreads() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (std::thread& t : threads) t.join();
}

void HandlerThreads::Run(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    if (idle_ < tasks_.size() && threads_.size() < max_threads_) {
      threads_.emplace_back([this] { Loop(); });
      return;  // the new thread takes a task as it starts
    }
  }
  cv_.notify_one();
}

size_t HandlerThreads::threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return threads_.size();
}

void HandlerThreads::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    ++idle_;
    cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
    --idle_;
    if (tasks_.empty()) return;  // stopping, nothing left
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // its captures go before this thread counts as idle
    lock.lock();
  }
}

KvTierGrpcService::KvTierGrpcService(TierService* core, metrics::Registry* registry,
                                     uint64_t max_inflight_bytes_per_client,
                                     uint32_t max_connections, UcxTransport* ucx, bool offload)
    : core_(core),
      inflight_(max_inflight_bytes_per_client, max_connections),
      ucx_(ucx),
      offload_peer_waits_(offload),
      registry_(registry) {
  if (offload || ucx != nullptr) {
    // A thread per call running; past this many, calls wait for a thread (each is bounded by
    // its deadline, and a peer's wait by cluster.peer_deadline).
    constexpr size_t kMaxHandlerThreads = 256;
    threads_ = std::make_unique<HandlerThreads>(kMaxHandlerThreads);
    HandlerThreads* threads = threads_.get();
    registry->AddGauge("proxima_handler_threads",
                       "Threads of the daemon's own that run calls which may wait: UCX "
                       "transfers, and with the cluster on the calls that may ask peers",
                       {}, [threads] { return static_cast<double>(threads->threads()); });
  }
  for (int m = 0; m < kMethods; ++m) {
    latency_[m] = registry->AddHistogram("proxima_request_duration_seconds",
                                         "Time to handle a KVTier call in the daemon",
                                         {{"method", kMethodNames[m]}}, metrics::LatencyBuckets());
  }
}

bool KvTierGrpcService::MayWaitOnPeers(Method method) const {
  switch (method) {
    case kPut:  // a spill round (cluster.spill.put_wait)
    case kPutUcx:
    case kGet:  // the rest of the batch from other nodes (cluster.peer_deadline)
    case kGetUcx:
    case kLookup:
    case kDelete:
      return offload_peer_waits_;
    default:
      return false;
  }
}

template <typename Call>
grpc::ServerUnaryReactor* KvTierGrpcService::Handle(Method method,
                                                    grpc::CallbackServerContext* context,
                                                    uint64_t request_bytes,
                                                    grpc::ByteBuffer* response, Call&& call,
                                                    bool held_until_sent, bool may_wait) {
  auto start = std::chrono::steady_clock::now();
  in_flight_.fetch_add(1);
  auto* reactor = new AccountedReactor();
  // Explicit captures (GCC 12's UBSan misreads an implicit `this` capture in these handlers).
  auto run = [this, method, context, request_bytes, response, held_until_sent, start, reactor,
              call = std::forward<Call>(call)]() mutable {
    const std::string peer = context->peer();
    bool admitted = false;  // counted in the peer's account; ended when gRPC is done with the call
    uint64_t held = 0;      // bytes charged to the peer
    absl::Status status = [this, context, response, request_bytes, &peer, &admitted, &held,
                           &call]() -> absl::Status {
      if (draining_.load())
        return absl::UnavailableError("proximad is shutting down; retry elsewhere");
      PROXIMA_ASSIGN_OR_RETURN(Caller caller, core_->Authenticate(AuthorizationOf(*context)));
      // Every connection is a client of its own: TCP peers by address, Unix-socket connections
      // as "fd:N" (UnixListener hands them to gRPC one by one). A "unix:" peer would be one
      // gRPC listened for itself, which names every client alike: those are not limited.
      const bool accounted = !absl::StartsWith(peer, "unix:");
      if (accounted) {
        PROXIMA_RETURN_IF_ERROR(inflight_.Begin(peer, request_bytes));
        admitted = true;
        held = request_bytes;
      }
      PROXIMA_RETURN_IF_ERROR(call(caller));
      if (accounted && response != nullptr) {
        // The response stays in memory (or pins tier memory) until sent: it counts too.
        const uint64_t response_bytes = response->Length();
        absl::Status charged = inflight_.AddResponse(peer, request_bytes, response_bytes);
        if (!charged.ok()) {
          response->Clear();  // drops the pins of a Get's blocks now
          return charged;
        }
        held += response_bytes;
      }
      return absl::OkStatus();
    }();
    in_flight_.fetch_sub(1);
    latency_[method]->Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    int code = static_cast<int>(status.code());
    if (code < 0 || code >= kCodes) code = static_cast<int>(absl::StatusCode::kUnknown);
    metrics::Counter* counter = requests_[method][code].load(std::memory_order_acquire);
    if (counter == nullptr) {
      counter = registry_->AddCounter(
          "proxima_requests_total", "KVTier calls handled, by method and status code",
          {{"method", kMethodNames[method]},
           {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(code))}});
      requests_[method][code].store(counter, std::memory_order_release);
    }
    counter->Increment();
    if (admitted && !held_until_sent) {
      inflight_.End(peer, held);
      admitted = false;
    }
    if (status.GetPayload(InflightLedger::kRetryWhenReleased).has_value()) {
      context->AddTrailingMetadata(wire::kRetryWhenReleasedMetadata, "1");
    }
    reactor->Finish(
        admitted ? &inflight_ : nullptr, peer, held,
        grpc::Status(static_cast<grpc::StatusCode>(code), std::string(status.message())));
  };
  if (threads_ != nullptr && (may_wait || MayWaitOnPeers(method))) {
    threads_->Run(std::move(run));
  } else {
    run();
  }
  return reactor;
}

template <typename Req, typename Resp>
grpc::ServerUnaryReactor* KvTierGrpcService::HandleProto(
    Method method, grpc::CallbackServerContext* context, const Req* request, Resp* response,
    absl::Status (TierService::*call)(const Caller&, const Req&, Resp*)) {
  // Explicit captures: GCC 12's UBSan misreads `this` through an implicit [&] capture here.
  TierService* core = core_;
  return Handle(method, context, request->ByteSizeLong(), nullptr,
                [core, call, request, response](const Caller& caller) {
                  absl::Status status = (core->*call)(caller, *request, response);
                  if (!status.ok()) response->Clear();  // a failed call returns no partial results
                  return status;
                });
}

namespace {

// Fills a GetRequest, LookupRequest or DeleteRequest from its bounded wire parse.
template <typename Req>
absl::Status ParseKeyed(const grpc::ByteBuffer& buffer, size_t max_keys, const char* method,
                        Req* out) {
  wire::KeyedRequest keyed;
  PROXIMA_RETURN_IF_ERROR(wire::ParseKeyedRequest(buffer, max_keys, method, &keyed));
  out->set_namespace_name(std::move(keyed.namespace_name));
  out->set_profile_id(keyed.profile_id);
  for (std::string& k : keyed.keys) out->add_keys(std::move(k));
  if constexpr (std::is_same_v<Req, v1::GetRequest>) {
    out->set_client_verifies_crc32c(keyed.client_verifies_crc32c);
    out->set_format(static_cast<v1::BlockFormat>(keyed.format));
  }
  return absl::OkStatus();
}

template <typename Resp>
absl::Status SerializeTo(const Resp& message, grpc::ByteBuffer* out) {
  bool own_buffer = false;
  if (!grpc::SerializationTraits<Resp>::Serialize(message, out, &own_buffer).ok()) {
    return absl::InternalError("cannot serialize the response");
  }
  return absl::OkStatus();
}

// A request refused while parsing for holding too many items: name the config key of the limit.
absl::Status NameLimit(absl::Status status, absl::string_view key) {
  if (status.code() != absl::StatusCode::kResourceExhausted) return status;
  return absl::ResourceExhaustedError(absl::StrCat(status.message(), " (", key, ")"));
}

}  // namespace

absl::Status ServePut(TierService& core, const Caller& caller, const grpc::ByteBuffer& request,
                      grpc::ByteBuffer* response) {
  wire::PutRequestReader reader;
  PROXIMA_RETURN_IF_ERROR(
      NameLimit(reader.Parse(request, core.max_batch_blocks()), "server.max_batch_blocks"));
  v1::PutResponse resp;
  PROXIMA_RETURN_IF_ERROR(core.Put(caller, reader, &resp));
  return SerializeTo(resp, response);
}

absl::Status ServeGet(TierService& core, const Caller& caller, const grpc::ByteBuffer& request,
                      grpc::ByteBuffer* response) {
  v1::GetRequest req;
  PROXIMA_RETURN_IF_ERROR(NameLimit(ParseKeyed(request, core.max_batch_blocks(), "Get", &req),
                                    "server.max_batch_blocks"));
  if (req.format() != v1::BLOCK_FORMAT_RAW && req.format() != v1::BLOCK_FORMAT_STORED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Get format is ", static_cast<int>(req.format()),
        "; expected BLOCK_FORMAT_RAW (0) or BLOCK_FORMAT_STORED (1)"));
  }
  std::vector<std::optional<BlockStore::ReadBlock>> blocks;
  PROXIMA_RETURN_IF_ERROR(core.GetBlocks(caller, req, &blocks));
  *response = WriteBlocks(blocks);
  return absl::OkStatus();
}

absl::Status ServeDecompress(TierService& core, const Caller& caller,
                             const grpc::ByteBuffer& request, grpc::ByteBuffer* response) {
  v1::DecompressRequest req;
  PROXIMA_RETURN_IF_ERROR(NameLimit(
      ParseKeyed(request, core.max_batch_blocks(), "Decompress", &req), "server.max_batch_blocks"));
  std::vector<std::optional<BlockStore::ReadBlock>> blocks;
  PROXIMA_RETURN_IF_ERROR(core.DecompressBlocks(caller, req, &blocks));
  *response = WriteBlocks(blocks);
  return absl::OkStatus();
}

absl::Status ServeLookup(TierService& core, const Caller& caller, const grpc::ByteBuffer& request,
                         grpc::ByteBuffer* response) {
  v1::LookupRequest req;
  PROXIMA_RETURN_IF_ERROR(NameLimit(ParseKeyed(request, core.max_lookup_keys(), "Lookup", &req),
                                    "server.max_lookup_keys"));
  v1::LookupResponse resp;
  PROXIMA_RETURN_IF_ERROR(core.Lookup(caller, req, &resp));
  return SerializeTo(resp, response);
}

absl::Status ServeDelete(TierService& core, const Caller& caller, const grpc::ByteBuffer& request,
                         grpc::ByteBuffer* response) {
  v1::DeleteRequest req;
  PROXIMA_RETURN_IF_ERROR(NameLimit(ParseKeyed(request, core.max_batch_blocks(), "Delete", &req),
                                    "server.max_batch_blocks"));
  v1::DeleteResponse resp;
  PROXIMA_RETURN_IF_ERROR(core.Delete(caller, req, &resp));
  return SerializeTo(resp, response);
}

grpc::ServerUnaryReactor* KvTierGrpcService::HandleRaw(
    Method method, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response,
    absl::Status (*serve)(TierService&, const Caller&, const grpc::ByteBuffer&,
                          grpc::ByteBuffer*)) {
  return Handle(method, context, request->Length(), response,
                [core = core_, serve, request, response](const Caller& caller) {
                  return serve(*core, caller, *request, response);
                });
}

grpc::ServerUnaryReactor* KvTierGrpcService::Put(grpc::CallbackServerContext* c,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  return HandleRaw(kPut, c, request, response, &ServePut);
}

grpc::ServerUnaryReactor* KvTierGrpcService::Get(grpc::CallbackServerContext* c,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  return HandleRaw(kGet, c, request, response, &ServeGet);
}

grpc::ServerUnaryReactor* KvTierGrpcService::Decompress(grpc::CallbackServerContext* c,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return HandleRaw(kDecompress, c, request, response, &ServeDecompress);
}

grpc::ServerUnaryReactor* KvTierGrpcService::GetServerInfo(grpc::CallbackServerContext* c,
                                                           const v1::GetServerInfoRequest* req,
                                                           v1::GetServerInfoResponse* resp) {
  TierService* core = core_;
  const bool ucx = ucx_ != nullptr;
  return Handle(kGetServerInfo, c, req->ByteSizeLong(), nullptr,
                [core, req, resp, ucx](const Caller& caller) -> absl::Status {
                  absl::Status status = core->GetServerInfo(caller, *req, resp);
                  if (!status.ok()) {
                    resp->Clear();
                    return status;
                  }
                  resp->set_ucx_enabled(ucx);
                  return absl::OkStatus();
                });
}

namespace {
// The session a UCX data-plane call names (0: none, as ConnectUcx's).
template <typename Req>
uint64_t SessionOf(const Req& request) {
  if constexpr (requires { request.session_id(); }) {
    return request.session_id();
  } else {
    return 0;
  }
}
}  // namespace

template <typename Req, typename Resp, typename Call>
grpc::ServerUnaryReactor* KvTierGrpcService::HandleUcx(Method method,
                                                       grpc::CallbackServerContext* context,
                                                       const Req* request, Resp* response,
                                                       Call&& call) {
  UcxTransport* ucx = ucx_;
  const absl::Time deadline = context->deadline() == std::chrono::system_clock::time_point::max()
                                  ? absl::Now() + absl::Seconds(60)
                                  : absl::FromChrono(context->deadline());
  // Handle() authenticates the call first: the data plane is no way around the bearer tokens.
  // The block bytes a PutUcx or GetUcx moves are charged to the client's in-flight bytes like
  // an inline call's message: tier memory reserved for them (put) or pinned under the transfer
  // (get) until the call ends.
  uint64_t charged = request->ByteSizeLong();
  if constexpr (std::is_same_v<Req, v1::PutUcxRequest> || std::is_same_v<Req, v1::GetUcxRequest>) {
    for (const v1::UcxBlock& block : request->blocks()) {
      for (const v1::UcxSegment& segment : block.segments()) {
        // Saturating: a declared length near 2^64 is refused as too large, not wrapped around.
        charged += std::min(segment.length(), std::numeric_limits<uint64_t>::max() - charged);
      }
    }
  }
  if constexpr (std::is_same_v<Req, v1::PutUcxRequest>) {
    if (request->ucx_transfer() != 0) {  // blocks sent as messages: no segments to add up
      const uint64_t blocks = static_cast<uint64_t>(request->blocks_size());
      const uint64_t room = std::numeric_limits<uint64_t>::max() - charged;
      const uint64_t each = request->message_block_bytes();
      charged += blocks != 0 && each > room / blocks ? room : blocks * each;
    }
  }
  // A PutUcx's blocks sent as messages are on their way or parked here before the call runs: a
  // call refused before it runs (draining, authentication, the in-flight limit) drops them when
  // it ends, so that the client's rendezvous sends end then rather than at its deadline (a call
  // that ran has dropped what it did not take already; dropping again is a no-op).
  std::shared_ptr<void> drop_messages;
  if constexpr (std::is_same_v<Req, v1::PutUcxRequest>) {
    if (ucx != nullptr && request->ucx_transfer() != 0) {
      auto drop = [ucx, transfer = request->ucx_transfer()](void*) { ucx->DropMessages(transfer); };
      drop_messages.reset(static_cast<void*>(nullptr), drop);
    }
  }
  return Handle(
      method, context, charged, nullptr,
      [ucx, response, deadline, drop_messages = std::move(drop_messages),
       call = std::forward<Call>(call)](const Caller& caller) mutable -> absl::Status {
        if (ucx == nullptr) {
          return absl::FailedPreconditionError(
              "this proximad runs without the UCX data plane (ucx.enabled: false); "
              "use Put/Get");
        }
        absl::Status status = call(ucx, caller, deadline);
        if (!status.ok()) response->Clear();  // a failed call returns no partial results
        return status;
      },
      /*held_until_sent=*/false,
      /*may_wait=*/ucx != nullptr && !ucx->OverSharedMemory(SessionOf(*request)));
}

grpc::ServerUnaryReactor* KvTierGrpcService::ConnectUcx(grpc::CallbackServerContext* c,
                                                        const v1::ConnectUcxRequest* req,
                                                        v1::ConnectUcxResponse* resp) {
  return HandleUcx(kConnectUcx, c, req, resp,
                   [req, resp](UcxTransport* ucx, const Caller& caller, absl::Time deadline) {
                     return ucx->Connect(caller, *req, resp, deadline);
                   });
}
grpc::ServerUnaryReactor* KvTierGrpcService::DisconnectUcx(grpc::CallbackServerContext* c,
                                                           const v1::DisconnectUcxRequest* req,
                                                           v1::DisconnectUcxResponse* resp) {
  return HandleUcx(kDisconnectUcx, c, req, resp,
                   [req, resp](UcxTransport* ucx, const Caller& caller, absl::Time) {
                     return ucx->Disconnect(caller, *req, resp);
                   });
}
grpc::ServerUnaryReactor* KvTierGrpcService::PutUcx(grpc::CallbackServerContext* c,
                                                    const v1::PutUcxRequest* req,
                                                    v1::PutResponse* resp) {
  return HandleUcx(kPutUcx, c, req, resp,
                   [req, resp](UcxTransport* ucx, const Caller& caller, absl::Time deadline) {
                     return ucx->Put(caller, *req, resp, deadline);
                   });
}
grpc::ServerUnaryReactor* KvTierGrpcService::GetUcx(grpc::CallbackServerContext* c,
                                                    const v1::GetUcxRequest* req,
                                                    v1::GetUcxResponse* resp) {
  return HandleUcx(kGetUcx, c, req, resp,
                   [req, resp](UcxTransport* ucx, const Caller& caller, absl::Time deadline) {
                     return ucx->Get(caller, *req, resp, deadline);
                   });
}
grpc::ServerUnaryReactor* KvTierGrpcService::RegisterProfile(grpc::CallbackServerContext* c,
                                                             const v1::RegisterProfileRequest* req,
                                                             v1::RegisterProfileResponse* resp) {
  return HandleProto(kRegisterProfile, c, req, resp, &TierService::RegisterProfile);
}
grpc::ServerUnaryReactor* KvTierGrpcService::Lookup(grpc::CallbackServerContext* c,
                                                    const grpc::ByteBuffer* req,
                                                    grpc::ByteBuffer* resp) {
  return HandleRaw(kLookup, c, req, resp, &ServeLookup);
}
grpc::ServerUnaryReactor* KvTierGrpcService::Delete(grpc::CallbackServerContext* c,
                                                    const grpc::ByteBuffer* req,
                                                    grpc::ByteBuffer* resp) {
  return HandleRaw(kDelete, c, req, resp, &ServeDelete);
}
grpc::ServerUnaryReactor* KvTierGrpcService::Stats(grpc::CallbackServerContext* c,
                                                   const v1::StatsRequest* req,
                                                   v1::StatsResponse* resp) {
  return HandleProto(kStats, c, req, resp, &TierService::Stats);
}

}  // namespace proxima::daemon
