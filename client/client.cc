#include "client/client.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/credentials.h"
#include "common/grpc_channel.h"
#include "common/grpc_tls.h"
#include "common/log.h"
#include "common/mutex.h"
#include "common/status_macros.h"
#include "common/ucx.h"
#include "kernels/device.h"
#include "proto/wire.h"

namespace proxima::client {
namespace {

// Mirrors the daemon's accounting of a response (tier_service.cc): per-block framing and
// message headroom, so that a batch the client sends never exceeds max_message_bytes.
constexpr uint64_t kPerBlockOverhead = 64;
constexpr uint64_t kMessageOverhead = 4096;

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

absl::Status CheckSizes(const char* what, size_t keys, size_t buffers, const Profile& profile,
                        std::span<const size_t> sizes) {
  if (keys != buffers) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", keys, " keys but ", buffers, " buffers"));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] != profile.block_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": buffer ", i, " is ", sizes[i],
                                                     " bytes; the profile's blocks are ",
                                                     profile.block_bytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

std::string KeyString(const BlockKey& k) {
  return std::string(reinterpret_cast<const char*>(k.data()), k.size());
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientOptions& o) {
  if (o.tls_ca_file.empty() && o.tls_cert_file.empty() && o.tls_key_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  if (o.tls_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert_file/tls_key_file are set but tls_ca_file is not; expected the CA that "
        "signed the daemon's certificate");
  }
  return WatchedTlsChannelCredentials({.ca = {"tls_ca_file", o.tls_ca_file},
                                       .cert = {"tls_cert_file", o.tls_cert_file},
                                       .key = {"tls_key_file", o.tls_key_file}},
                                      o.tls_reload_interval);
}

const char* TransportName(Transport t) {
  switch (t) {
    case Transport::kAuto:
      return "auto";
    case Transport::kUcx:
      return "ucx";
    case Transport::kInline:
      return "inline";
  }
  return "unknown";
}

absl::StatusOr<Transport> ParseTransport(const std::string& name) {
  if (name == "auto") return Transport::kAuto;
  if (name == "ucx") return Transport::kUcx;
  if (name == "inline") return Transport::kInline;
  return absl::InvalidArgumentError(
      absl::StrCat("transport '", name, "' is unknown; expected auto, ucx or inline"));
}

const char* HostStagingName(HostStaging h) {
  switch (h) {
    case HostStaging::kAuto:
      return "auto";
    case HostStaging::kAlways:
      return "always";
    case HostStaging::kNever:
      return "never";
  }
  return "unknown";
}

absl::StatusOr<HostStaging> ParseHostStaging(const std::string& name) {
  if (name == "auto") return HostStaging::kAuto;
  if (name == "always") return HostStaging::kAlways;
  if (name == "never") return HostStaging::kNever;
  return absl::InvalidArgumentError(
      absl::StrCat("host_staging '", name, "' is unknown; expected auto, always or never"));
}

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  if (status.error_code() == grpc::StatusCode::CANCELLED) {
    // This client never cancels its calls, so CANCELLED means the daemon dropped the call
    // (it stopped while the request was in transit): retryable, like any unavailability.
    return absl::UnavailableError(
        absl::StrCat("proximad cancelled the call (shutting down?): ", status.error_message()));
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  // The daemon is local and enforces its own message limit.
  grpc::ChannelArguments args =
      ProximaChannelArguments({.max_message_bytes = -1,
                               .max_reconnect_backoff = absl::Seconds(1),
                               .tls_server_name = options.tls_server_name});
  PROXIMA_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                           ChannelCredentialsFor(options));
  std::string token = options.token;
  if (!options.token_file.empty()) {
    if (!options.token.empty()) {
      return absl::InvalidArgumentError(
          "token and token_file are both set; give the token one way");
    }
    PROXIMA_ASSIGN_OR_RETURN(token, ReadTokenFile("token_file", options.token_file));
  }
  auto channel = grpc::CreateCustomChannel(options.target, credentials, args);
  if (!channel->WaitForConnected(Deadline(options.connect_timeout))) {
    const bool tls = !options.tls_ca_file.empty();
    return absl::UnavailableError(absl::StrCat(
        "cannot reach proximad at '", options.target, "' within ",
        absl::FormatDuration(options.connect_timeout),
        tls ? " over TLS (daemon down, plaintext-only, or it rejected our certificate / we "
              "rejected its certificate)"
            : " over plaintext (daemon down, or it expects TLS: set tls_ca_file)"));
  }
  std::unique_ptr<Client> client(new Client(options, std::move(channel)));
  {
    proxima::MutexLock lock(&client->token_mu_);
    client->token_ = std::move(token);
    client->next_token_read_ = absl::Now() + options.token_reload_interval;
  }
  v1::GetServerInfoResponse info;
  PROXIMA_RETURN_IF_ERROR(client->CallDaemon(
      absl::Now() + options.call_timeout, client->Token(), [&](grpc::ClientContext* context) {
        return client->stub_->GetServerInfo(context, v1::GetServerInfoRequest(), &info);
      }));
  client->server_info_ = ServerInfo{info.version(),          info.max_message_bytes(),
                                    info.max_batch_blocks(), info.max_lookup_keys(),
                                    info.ucx_enabled(),      info.max_inflight_bytes_per_client()};
  if (info.key_bytes() != kKeyBytes || info.max_batch_blocks() == 0 ||
      info.max_lookup_keys() == 0 || info.max_message_bytes() <= kMessageOverhead) {
    return absl::FailedPreconditionError(
        absl::StrCat("proximad at '", options.target,
                     "' reports limits this client cannot use: ", info.ShortDebugString()));
  }
  client->check_device_memory_ = options.device_memory && !gpu::VisibleDevices().empty();
  client->transport_detail_ = "inline: chosen by the caller";
  if (options.transport != Transport::kInline) {
    absl::Status ucx = client->server_info_.ucx_enabled
                           ? client->StartUcx()
                           : absl::FailedPreconditionError("proximad has UCX disabled");
    if (!ucx.ok()) {
      if (options.transport == Transport::kUcx) {
        return absl::Status(ucx.code(),
                            absl::StrCat("transport ucx requested, but: ", ucx.message()));
      }
      client->ucx_probe_.reset();  // registrations go before their worker
      client->ucx_worker_.reset();
      client->transport_detail_ = absl::StrCat("inline: ", ucx.message());
      // Once per process: a worker with a client per GPU (or a load generator) would repeat it.
      static std::atomic<bool> logged{false};
      if (!logged.exchange(true)) {
        PROXIMA_LOG(kInfo) << "UCX data plane not available; moving blocks inline"
                           << log::Kv("target", options.target) << log::Kv("reason", ucx.message());
      }
    }
  }
  return client;
}

absl::Status Client::StartUcx() {
  PROXIMA_ASSIGN_OR_RETURN(ucx_worker_, ucx::Worker::Create("libproxima"));
  // The probe the daemon reads in every ConnectUcx: bytes that differ from offset to offset, so
  // a transfer that moved nothing or the wrong range fails its CRC32C.
  for (size_t i = 0; i < ucx_probe_bytes_.size(); ++i) {
    ucx_probe_bytes_[i] = static_cast<std::byte>(i * 37 + 11);
  }
  PROXIMA_ASSIGN_OR_RETURN(ucx_probe_,
                           ucx_worker_->Register(ucx_probe_bytes_.data(), ucx_probe_bytes_.size()));
  std::string shared_memory;
  PROXIMA_RETURN_IF_ERROR(OpenUcxSession(
      absl::Now() + std::min(options_.call_timeout, options_.connect_timeout), &shared_memory));
  transport_ = Transport::kUcx;
  transport_detail_ = absl::StrFormat("ucx: session %016x", ucx_session_.load());
  if (!shared_memory.empty()) absl::StrAppend(&transport_detail_, " over ", shared_memory);
  if (stage_host_memory_.load()) {
    absl::StrAppend(&transport_detail_, "; blocks in ordinary memory move through host staging");
  }
  return absl::OkStatus();
}

template <typename Call>
absl::Status Client::CallWithSession(Call&& call) {
  // One deadline for the whole call: re-establishing the session and the call itself.
  const absl::Time deadline = absl::Now() + options_.call_timeout;
  Token();  // a token file due to be read is read now: a new token re-opens the session first
  if (ucx_session_stale_.load() || !SessionTokenIsCurrent()) {
    PROXIMA_RETURN_IF_ERROR(ReopenUcxSession(deadline));
  }
  const uint64_t session = ucx_session_.load();  // the one the call uses (unless replaced)
  absl::Status status = call(deadline);
  if (absl::IsUnavailable(status)) {
    // The daemon or the path to it failed (killed, restarted, network): this call fails, and the
    // next one re-establishes the connection and the session before it runs.
    ucx_session_stale_.store(true);
    return status;
  }
  if (status.code() == absl::StatusCode::kPermissionDenied &&
      absl::StrContains(status.message(), "UCX session") && !SessionTokenIsCurrent()) {
    // Another thread read a new token between this call's check and its call: the session is
    // the old token's. Re-open it for the new one and call again.
    status = ReopenUcxSession(deadline);
    if (status.ok()) status = call(deadline);
    if (absl::IsUnavailable(status)) ucx_session_stale_.store(true);
    return status;
  }
  if (status.code() != absl::StatusCode::kNotFound ||
      !absl::StrContains(status.message(), "UCX session")) {
    return status;
  }
  PROXIMA_LOG(kInfo) << "proximad forgot this client's UCX session (restart?), or this client's "
                        "endpoint to it failed; opening a new one"
                     << log::Kv("target", options_.target);
  status = ReplaceUcxSession(session, deadline);
  if (status.ok()) status = call(deadline);
  if (absl::IsUnavailable(status)) ucx_session_stale_.store(true);
  return status;
}

template <typename Req, typename Resp, typename Method>
absl::Status Client::CallUcx(const Profile& profile, Req& request, Resp* response, Method method,
                             const std::function<absl::Status(Req&, absl::Time)>& prepare) {
  return CallWithSession([&](absl::Time deadline) {
    return CallWithProfile(profile, [&] {
      if (prepare) PROXIMA_RETURN_IF_ERROR(prepare(request, deadline));
      request.set_session_id(ucx_session_.load());
      return CallDaemon(deadline, Token(), [&](grpc::ClientContext* context) {
        response->Clear();
        return (stub_.get()->*method)(context, request, response);
      });
    });
  });
}

absl::Status Client::ReopenUcxSession(absl::Time deadline) {
  // One thread re-establishes the session; the others find it fresh when they get the lock.
  proxima::MutexLock lock(&ucx_reopen_mu_);
  if (!ucx_session_stale_.load() && SessionTokenIsCurrent()) return absl::OkStatus();
  // As gRPC treats a call that is not wait_for_ready: wait while the channel connects, fail at
  // once while its last attempt failed (reconnector_ goes on trying: a later call finds it
  // READY). Waiting out the whole deadline instead held every call of a worker whose daemon was
  // down for call_timeout (30 s by default), where inline calls failed in microseconds.
  grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/true);
  while (state == GRPC_CHANNEL_IDLE || state == GRPC_CHANNEL_CONNECTING) {
    if (!channel_->WaitForStateChange(state, absl::ToChronoTime(deadline))) {
      reconnector_.Wake();
      return absl::UnavailableError(
          absl::StrCat("proximad at '", options_.target,
                       "' is not reachable: no connection within the call's deadline (",
                       absl::FormatDuration(options_.call_timeout), ")"));
    }
    state = channel_->GetState(/*try_to_connect=*/true);
  }
  // A daemon that did not restart may still hold the old session (the failure was on the path):
  // close it, best effort (closing a session the daemon no longer knows is not an error).
  // Without a connection (TRANSIENT_FAILURE), OpenUcxSession below fails at once with gRPC's
  // reason (refused, TLS handshake, ...), as an inline call does, and wakes reconnector_.
  if (state == GRPC_CHANNEL_READY) CloseUcxSession(ucx_session_.load(), deadline - absl::Now());
  const bool after_failure = ucx_session_stale_.load();
  PROXIMA_RETURN_IF_ERROR(OpenUcxSession(deadline));
  PROXIMA_LOG(kInfo) << (after_failure ? "UCX session re-established after a failure"
                                       : "UCX session re-established for a new token")
                     << log::Kv("target", options_.target);
  return absl::OkStatus();
}

absl::Status Client::ReplaceUcxSession(uint64_t failed, absl::Time deadline) {
  proxima::MutexLock lock(&ucx_reopen_mu_);
  // Another thread whose call failed the same way has replaced it already.
  if (ucx_session_.load() != failed) return absl::OkStatus();
  // A daemon that did not restart still holds it when the failure was this side's (its endpoint
  // to the daemon's worker closed by force after a send missed its deadline): close it, best
  // effort, or it stays open until this client goes, one more each time (ucx.max_sessions).
  CloseUcxSession(failed, deadline - absl::Now());
  return OpenUcxSession(deadline);
}

absl::Status Client::OpenUcxSession(absl::Time deadline, std::string* shared_memory) {
  v1::ConnectUcxRequest request;
  request.set_worker_address(ucx_worker_->address());
  v1::UcxRegion* probe = request.mutable_probe();
  probe->set_rkey(ucx_probe_->packed_rkey());
  probe->set_address(reinterpret_cast<uint64_t>(ucx_probe_bytes_.data()));
  probe->set_length(ucx_probe_bytes_.size());
  request.set_probe_crc32c(Crc32c(ucx_probe_bytes_));
  v1::ConnectUcxResponse response;
  const std::string token = Token();
  PROXIMA_RETURN_IF_ERROR(CallDaemon(deadline, token, [&](grpc::ClientContext* context) {
    return stub_->ConnectUcx(context, request, &response);
  }));
  // PutUcx messages go over an endpoint of this worker's own to the daemon's worker. Without
  // one (an older daemon, or its worker not reachable from here) the daemon pulls the bytes.
  std::shared_ptr<ucx::Endpoint> daemon_ep;
  // Not over shared memory, where the daemon maps this client's UCX-allocated memory itself
  // (host staging) and where UCX 1.13 cannot open a second endpoint between the two workers:
  // the daemon's endpoint here runs without peer error handling, and one of this worker's own
  // with it breaks UCX's endpoint matching ("asymmetric endpoint configuration").
  if (!response.worker_address().empty() && response.shared_memory_transport().empty()) {
    absl::StatusOr<std::shared_ptr<ucx::Endpoint>> ep =
        ucx_worker_->Connect(response.worker_address(), deadline);
    if (ep.ok()) {
      daemon_ep = *std::move(ep);
    } else {
      PROXIMA_LOG(kWarning) << "cannot reach proximad's UCX worker; it pulls this client's puts"
                            << log::Kv("target", options_.target)
                            << log::Kv("reason", ep.status().message());
    }
  }
  {
    proxima::MutexLock lock(&daemon_ep_mu_);
    daemon_ep_.swap(daemon_ep);  // the old one (if any) is closed as `daemon_ep` goes
  }
  ucx_session_.store(response.session_id());
  {
    proxima::MutexLock lock(&token_mu_);
    session_token_ = token;
  }
  ucx_shared_memory_.store(!response.shared_memory_transport().empty());
  ucx_without_posix_.store(response.pid_namespace() != 0 &&
                           response.pid_namespace() != ucx::PidNamespace());
  ucx_without_sysv_.store(response.ipc_namespace() != 0 &&
                          response.ipc_namespace() != ucx::IpcNamespace());
  ucx_session_stale_.store(false);
  stage_host_memory_.store(
      options_.host_staging == HostStaging::kAlways ||
      (options_.host_staging == HostStaging::kAuto && !response.shared_memory_transport().empty()));
  if (shared_memory != nullptr) *shared_memory = response.shared_memory_transport();
  return absl::OkStatus();
}

void Client::CloseUcxSession(uint64_t session_id, absl::Duration timeout) {
  if (session_id == 0) return;
  const absl::Time deadline = absl::Now() + timeout;
  std::string opened_with;
  {
    proxima::MutexLock lock(&token_mu_);
    opened_with = session_token_;
  }
  // The session is its token's: present the token that opened it. When the daemon no longer
  // accepts that one (its entry's secret was replaced before this client read the new one),
  // present the token in force, which belongs to the same entry in that case.
  for (int attempt = 0; attempt < 2; ++attempt) {
    const std::string token = attempt == 0 ? opened_with : Token();
    if (attempt == 1 && token == opened_with) break;
    v1::DisconnectUcxRequest request;
    request.set_session_id(session_id);
    v1::DisconnectUcxResponse response;
    // Best effort: the daemon also notices a client that goes.
    const absl::Status status = CallDaemon(deadline, token, [&](grpc::ClientContext* context) {
      return stub_->DisconnectUcx(context, request, &response);
    });
    if (!absl::IsUnauthenticated(status)) break;
  }
}

Client::~Client() {
  CloseUcxSession(ucx_session_.load(), absl::Seconds(2));
  proxima::MutexLock lock(&daemon_ep_mu_);
  daemon_ep_.reset();  // before the worker
}

template <typename Seg>
std::shared_ptr<ucx::Endpoint> Client::MessageEndpointFor(std::span<const Seg> blocks, size_t begin,
                                                          size_t end) {
  if (!options_.ucx_messages) return nullptr;
  std::shared_ptr<ucx::Endpoint> ep;
  {
    proxima::MutexLock lock(&daemon_ep_mu_);
    ep = daemon_ep_;
  }
  if (ep == nullptr || !ucx_shared_memory_.load()) return ep;
  // Over shared memory the daemon copies out of memory UCX allocated (mapped into it) itself,
  // faster than messages and without any UCX operation on this process's memory.
  for (size_t i = begin; i < end; ++i) {
    for (const auto& seg : blocks[i]) {
      std::shared_ptr<ucx::Registration> r = FindRegistration(seg.data(), seg.size());
      if (r == nullptr || !r->allocated()) return ep;
    }
  }
  return nullptr;
}

absl::StatusOr<MemoryRegion> Client::RegisterMemory(void* data, size_t size) {
  if (transport_ != Transport::kUcx) return MemoryRegion();
  // Device memory moves through the staging halves, which are registered themselves.
  if (check_device_memory_ && gpu::IsDeviceMemory(data)) return MemoryRegion();
  PROXIMA_ASSIGN_OR_RETURN(std::shared_ptr<ucx::Registration> r, ucx_worker_->Register(data, size));
  return KeepRegion(std::move(r));
}

absl::StatusOr<MemoryRegion> Client::AllocateMemory(size_t size) {
  if (size == 0) return absl::InvalidArgumentError("AllocateMemory of 0 bytes");
  // A size beyond the machine's memory is refused before anything is touched: UCX would start
  // filling a shared-memory segment (and the zeroing below every page) until the process dies.
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0 && size / static_cast<size_t>(page) >= static_cast<size_t>(pages)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AllocateMemory of ", size, " bytes: expected less than this machine's ",
        static_cast<uint64_t>(pages) * static_cast<uint64_t>(page), " bytes of memory"));
  }
  if (transport_ != Transport::kUcx) {
    MemoryRegion region;
    region.heap_.reset(new (std::nothrow) std::byte[size]());
    if (region.heap_ == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", size, " bytes"));
    }
    region.bytes_ = {region.heap_.get(), size};
    return region;
  }
  PROXIMA_ASSIGN_OR_RETURN(std::shared_ptr<ucx::Registration> r, ucx_worker_->Allocate(size));
  std::memset(r->address(), 0, size);
  std::span<std::byte> bytes(static_cast<std::byte*>(r->address()), size);
  MemoryRegion region = KeepRegion(std::move(r));
  region.bytes_ = bytes;
  return region;
}

MemoryRegion Client::KeepRegion(std::shared_ptr<ucx::Registration> r) {
  proxima::MutexLock lock(&regions_mu_);
  regions_.erase(
      std::remove_if(regions_.begin(), regions_.end(), [](const auto& w) { return w.expired(); }),
      regions_.end());
  regions_.push_back(r);
  return MemoryRegion(std::move(r));
}

std::shared_ptr<ucx::Registration> Client::FindRegistration(const void* p, size_t n) {
  proxima::MutexLock lock(&regions_mu_);
  for (const auto& w : regions_) {
    std::shared_ptr<ucx::Registration> r = w.lock();
    if (r && r->Contains(p, n)) return r;
  }
  return nullptr;
}

template <typename Seg, typename Req>
absl::Status Client::BuildUcxRequest(std::span<const BlockKey> keys, std::span<const Seg> blocks,
                                     size_t begin, size_t end, bool with_crc,
                                     std::span<const uint32_t> crcs, Req* request,
                                     std::vector<std::shared_ptr<ucx::Registration>>* held) {
  request->set_namespace_name(options_.namespace_name);
  absl::flat_hash_map<const ucx::Registration*, uint32_t> region_index;
  for (size_t i = begin; i < end; ++i) {
    v1::UcxBlock* block = request->add_blocks();
    block->set_key(KeyString(keys[i]));
    uint32_t crc = 0;
    for (const auto& seg : blocks[i]) {
      std::shared_ptr<ucx::Registration> r = FindRegistration(seg.data(), seg.size());
      if (r == nullptr) {
        // Not inside a registered region: register it for this call.
        PROXIMA_ASSIGN_OR_RETURN(
            r, ucx_worker_->Register(const_cast<std::byte*>(seg.data()), seg.size()));
      }
      auto [it, inserted] = region_index.try_emplace(r.get(), request->regions_size());
      if (inserted) {
        v1::UcxRegion* region = request->add_regions();
        region->set_rkey(ucx_worker_->WithoutSegmentParts(
            r->packed_rkey(), ucx_without_posix_.load(), ucx_without_sysv_.load()));
        region->set_address(reinterpret_cast<uint64_t>(r->address()));
        region->set_length(r->length());
        region->set_registration_id(r->id());
        held->push_back(r);
      }
      v1::UcxSegment* s = block->add_segments();
      s->set_region(it->second);
      s->set_address(reinterpret_cast<uint64_t>(seg.data()));
      s->set_length(seg.size());
      if (with_crc && crcs.empty()) crc = Crc32cExtend(crc, seg);
    }
    if (with_crc) block->set_crc32c(crcs.empty() ? crc : crcs[i]);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PutOutcome>> Client::PutUcx(const Profile& profile,
                                                       std::span<const BlockKey> keys,
                                                       std::span<const ConstSegments> blocks,
                                                       const PutOptions& options,
                                                       std::span<const uint32_t> crcs) {
  if (keys.size() != blocks.size()) {
    return absl::InternalError(
        absl::StrCat("PutUcx: ", keys.size(), " keys but ", blocks.size(), " blocks"));
  }
  std::vector<PutOutcome> outcomes;
  outcomes.reserve(keys.size());
  for (size_t begin = 0, end = 0; begin < keys.size(); begin = end) {
    end = UcxBatchEnd(blocks, begin);
    v1::PutUcxRequest request;
    request.set_profile_id(profile.id);
    std::vector<std::shared_ptr<ucx::Registration>> held;  // until the daemon answered
    std::function<absl::Status(v1::PutUcxRequest&, absl::Time)> send_messages;
    // Rendezvous sends of each attempt of the call, and that attempt's deadline.
    std::vector<std::unique_ptr<ucx::Sending>> in_flight;
    absl::Time sends_deadline = absl::InfinitePast();
    if (MessageEndpointFor(blocks, begin, end) != nullptr) {
      request.set_namespace_name(options_.namespace_name);
      request.set_message_block_bytes(profile.block_bytes);
      for (size_t i = begin; i < end; ++i) {
        v1::UcxBlock* block = request.add_blocks();
        block->set_key(KeyString(keys[i]));
        uint32_t crc = 0;
        if (crcs.empty()) {
          for (const auto& seg : blocks[i]) crc = Crc32cExtend(crc, seg);
        }
        block->set_crc32c(crcs.empty() ? crc : crcs[i]);
      }
      send_messages = [this, blocks, begin, end, &in_flight, &sends_deadline](
                          v1::PutUcxRequest& r, absl::Time deadline) {
        sends_deadline = std::max(sends_deadline, deadline);
        return SendPutMessages(blocks, begin, end, &r, deadline, &in_flight);
      };
    } else {
      PROXIMA_RETURN_IF_ERROR(
          BuildUcxRequest(keys, blocks, begin, end, true, crcs, &request, &held));
    }
    if (options.high_priority) request.set_priority(v1::PRIORITY_HIGH);
    for (size_t i = begin; i < end; ++i) {
      v1::UcxBlock* block = request.mutable_blocks(static_cast<int>(i - begin));
      if (!options.positions.empty() && options.positions[i] >= 0) {
        block->set_position(static_cast<uint32_t>(options.positions[i]));
      }
      if (!options.importance.empty()) block->set_importance(options.importance[i]);
    }
    v1::PutResponse response;
    absl::Status called =
        CallUcx(profile, request, &response, &v1::KVTier::Stub::PutUcx, send_messages);
    // Whatever the call's outcome, UCX reads the blocks' bytes until each rendezvous send has
    // ended: the daemon took the bytes, dropped the message (a failed call drops its transfer's
    // messages at once) or is gone. A send that has not ended by its attempt's deadline has its
    // endpoint closed by force. The call's answer is what counts: the daemon stored a block only
    // once all its bytes had arrived and matched their CRC32C.
    for (auto& sending : in_flight) sending->Wait(sends_deadline).IgnoreError();
    PROXIMA_RETURN_IF_ERROR(called);
    if (response.outcomes_size() != static_cast<int>(end - begin)) {
      return absl::InternalError(absl::StrCat("proximad answered ", response.outcomes_size(),
                                              " outcomes for ", end - begin, " blocks"));
    }
    for (int o : response.outcomes()) {
      outcomes.push_back(o == v1::PUT_OUTCOME_STORED            ? PutOutcome::kStored
                         : o == v1::PUT_OUTCOME_ALREADY_PRESENT ? PutOutcome::kAlreadyPresent
                                                                : PutOutcome::kNoSpace);
    }
  }
  return outcomes;
}

absl::Status Client::SendPutMessages(std::span<const ConstSegments> blocks, size_t begin,
                                     size_t end, v1::PutUcxRequest* request, absl::Time deadline,
                                     std::vector<std::unique_ptr<ucx::Sending>>* in_flight) {
  std::shared_ptr<ucx::Endpoint> ep;
  {
    proxima::MutexLock lock(&daemon_ep_mu_);
    ep = daemon_ep_;
  }
  if (ep == nullptr) {  // the session was re-opened with a daemon that takes no messages
    return absl::UnavailableError(
        "proximad's UCX worker is not reachable from this client any more; the call is retried "
        "on the next session");
  }
  // One message per block: a block in several segments goes in pieces, which UCX gathers as it
  // sends. A block in registered memory is sent naming its registration.
  auto held = std::make_shared<std::vector<std::shared_ptr<ucx::Registration>>>();
  std::vector<ucx::Message> messages;
  messages.reserve(end - begin);
  for (size_t i = begin; i < end; ++i) {
    const uint32_t slot = static_cast<uint32_t>(i - begin);
    if (blocks[i].size() == 1) {
      std::shared_ptr<ucx::Registration> r =
          FindRegistration(blocks[i][0].data(), blocks[i][0].size());
      messages.push_back({slot, blocks[i][0], r.get()});
      if (r != nullptr) held->push_back(std::move(r));
      continue;
    }
    ucx::Message& m = messages.emplace_back();
    m.slot = slot;
    m.pieces.assign(blocks[i].begin(), blocks[i].end());
  }
  // Every block of a profile has the same size: the batch is all rendezvous or all eager.
  const bool rendezvous =
      !messages.empty() && messages.front().size() >= options_.ucx_rendezvous_bytes;
  for (ucx::Message& m : messages) m.rendezvous = rendezvous;
  const uint64_t transfer = ucx_worker_->NewTransferId();
  request->set_ucx_transfer(transfer);
  absl::StatusOr<std::unique_ptr<ucx::Sending>> sending =
      ucx_worker_->StartSend(*ep, transfer, std::move(messages), held);
  absl::Status sent = sending.status();
  if (sent.ok() && rendezvous) {
    in_flight->push_back(*std::move(sending));
  } else if (sent.ok()) {
    sent = (*sending)->Wait(deadline);
  }
  if (absl::IsUnavailable(sent)) {
    // The daemon's worker is gone: most often a daemon that restarted, which no longer knows this
    // session either. Said as the daemon would, so that the session is opened again (with an
    // endpoint to the new worker) and the call retried once (CallWithSession).
    return absl::NotFoundError(absl::StrCat("UCX session's endpoint to proximad's worker failed (",
                                            sent.message(), "); opening a new session"));
  }
  return sent;
}

absl::Status Client::GetUcxOnce(const Profile& profile, std::span<const BlockKey> keys,
                                std::span<const Segments> out, size_t begin, size_t end,
                                bool client_verifies, std::vector<bool>* found,
                                std::vector<size_t>* mismatched) {
  v1::GetUcxRequest request;
  request.set_profile_id(profile.id);
  request.set_client_verifies_crc32c(client_verifies);
  std::vector<std::shared_ptr<ucx::Registration>> held;
  PROXIMA_RETURN_IF_ERROR(BuildUcxRequest(keys, out, begin, end, false, {}, &request, &held));
  v1::GetUcxResponse response;
  // Where the daemon cannot copy into this memory itself, it sends the blocks as messages of a
  // transfer named afresh for each attempt of the call (only the last one's are collected).
  std::vector<uint64_t> transfers;
  absl::Status called = CallUcx(profile, request, &response, &v1::KVTier::Stub::GetUcx,
                                std::function<absl::Status(v1::GetUcxRequest&, absl::Time)>(
                                    [this, &transfers](v1::GetUcxRequest& r, absl::Time) {
                                      if (!options_.ucx_messages) return absl::OkStatus();
                                      transfers.push_back(ucx_worker_->NewTransferId());
                                      r.set_ucx_transfer(transfers.back());
                                      r.set_ucx_rendezvous_bytes(
                                          std::max<uint64_t>(1, options_.ucx_rendezvous_get_bytes));
                                      return absl::OkStatus();
                                    }));
  const bool as_messages = called.ok() && response.sent_as_messages();
  for (size_t t = 0; t + (as_messages ? 1 : 0) < transfers.size(); ++t) {
    ucx_worker_->Collect(transfers[t], {}, absl::Now());  // drops whatever came of them
  }
  PROXIMA_RETURN_IF_ERROR(called);
  if (response.results_size() != static_cast<int>(end - begin)) {
    if (as_messages) ucx_worker_->Collect(transfers.back(), {}, absl::Now());
    return absl::InternalError(absl::StrCat("proximad answered ", response.results_size(),
                                            " results for ", end - begin, " blocks"));
  }
  std::vector<std::shared_ptr<const ucx::Parcel>> parcels(end - begin);
  std::vector<uint32_t> received_crcs(end - begin, 0);  // of rendezvous messages, once received
  if (as_messages) {
    std::vector<uint32_t> slots;
    for (size_t i = begin; i < end; ++i) {
      if (response.results(static_cast<int>(i - begin)).found()) {
        slots.push_back(static_cast<uint32_t>(i - begin));
      }
    }
    std::vector<std::shared_ptr<const ucx::Parcel>> arrived =
        ucx_worker_->Collect(transfers.back(), slots, absl::Now() + options_.call_timeout);
    for (size_t k = 0; k < slots.size(); ++k) parcels[slots[k]] = std::move(arrived[k]);
    PROXIMA_RETURN_IF_ERROR(ReceiveGetMessages(profile, out, begin, parcels, received_crcs));
  }
  for (size_t i = begin; i < end; ++i) {
    const v1::GetUcxResult& r = response.results(static_cast<int>(i - begin));
    if (!r.found()) continue;
    if (r.crc32c_checked()) {  // the daemon copied it into this memory and checked it as it did
      (*found)[i] = true;
      continue;
    }
    uint32_t crc = 0;
    if (as_messages) {
      // A message that did not arrive or of the wrong size is asked for again like a block
      // damaged on its way. A rendezvous one (pending) has landed in the segments by now, and
      // its CRC32C was taken there.
      const ucx::Parcel* parcel = parcels[i - begin].get();
      if (parcel == nullptr || parcel->size() != profile.block_bytes) {
        mismatched->push_back(i);
        continue;
      }
      if (parcel->pending()) {
        crc = received_crcs[i - begin];
      } else {
        size_t offset = 0;
        for (const auto& seg : out[i]) {
          crc = parcel->CopyTo(seg, offset, crc);
          offset += seg.size();
        }
      }
    } else {
      for (const auto& seg : out[i]) crc = Crc32cExtend(crc, seg);
    }
    if (crc == r.crc32c()) {
      (*found)[i] = true;
    } else {
      mismatched->push_back(i);
    }
  }
  return absl::OkStatus();
}

absl::Status Client::ReceiveGetMessages(const Profile& profile, std::span<const Segments> out,
                                        size_t begin,
                                        std::span<std::shared_ptr<const ucx::Parcel>> parcels,
                                        std::span<uint32_t> crcs) {
  // Each rendezvous message's bytes move from the daemon's memory straight into the block's
  // segments (UCX scatters a block of several as the bytes arrive). A message of the wrong size
  // is left for the caller's check.
  auto held = std::make_shared<std::vector<std::shared_ptr<ucx::Registration>>>();
  std::vector<std::shared_ptr<const ucx::Parcel>> pending;
  std::vector<ucx::Destination> dst;
  std::vector<size_t> blocks;  // parcels' index of each pending one
  for (size_t k = 0; k < parcels.size(); ++k) {
    const std::shared_ptr<const ucx::Parcel>& parcel = parcels[k];
    if (parcel == nullptr || !parcel->pending() || parcel->size() != profile.block_bytes) continue;
    const Segments& segments = out[begin + k];
    ucx::Destination& d = dst.emplace_back();
    d.pieces.assign(segments.begin(), segments.end());
    if (segments.size() == 1) {
      std::shared_ptr<ucx::Registration> r =
          FindRegistration(segments[0].data(), segments[0].size());
      d.memh = r.get();
      if (r != nullptr) held->push_back(std::move(r));
    }
    pending.push_back(parcel);
    blocks.push_back(k);
  }
  if (pending.empty()) return absl::OkStatus();
  std::shared_ptr<ucx::Endpoint> ep;
  {
    proxima::MutexLock lock(&daemon_ep_mu_);
    ep = daemon_ep_;
  }
  // Past the deadline the endpoint to the daemon (where this client has one) is closed by force,
  // so that nothing more lands in the caller's memory once this returns.
  absl::Status received =
      ucx_worker_->Receive(pending, dst, held, absl::Now() + options_.call_timeout, ep.get());
  if (!received.ok()) {
    if (absl::IsUnavailable(received)) ucx_session_stale_.store(true);
    return absl::Status(received.code(), absl::StrCat("GetUcx: ", received.message()));
  }
  for (size_t j = 0; j < pending.size(); ++j) {
    uint32_t crc = 0;
    for (const auto& seg : out[begin + blocks[j]]) crc = Crc32cExtend(crc, seg);
    crcs[blocks[j]] = crc;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<bool>> Client::GetUcx(const Profile& profile,
                                                 std::span<const BlockKey> keys,
                                                 std::span<const Segments> out) {
  if (keys.size() != out.size()) {
    return absl::InternalError(
        absl::StrCat("GetUcx: ", keys.size(), " keys but ", out.size(), " blocks"));
  }
  std::vector<bool> found(keys.size(), false);
  for (size_t begin = 0, end = 0; begin < keys.size(); begin = end) {
    end = UcxBatchEnd(out, begin);
    // As an inline Get: this client checks every block written, so the daemon need not read it
    // once more first (GetUcxRequest.client_verifies_crc32c).
    std::vector<size_t> mismatched;
    PROXIMA_RETURN_IF_ERROR(
        GetUcxOnce(profile, keys, out, begin, end, /*client_verifies=*/true, &found, &mismatched));
    if (mismatched.empty()) continue;
    // Ask again with the daemon checking: a block corrupt in the daemon's memory is dropped and
    // counted there (and misses here); one damaged on its way arrives intact this time.
    std::vector<BlockKey> again_keys;
    std::vector<Segments> again_out;
    for (size_t i : mismatched) {
      again_keys.push_back(keys[i]);
      again_out.push_back(out[i]);
    }
    std::vector<bool> again(mismatched.size(), false);
    std::vector<size_t> still;
    PROXIMA_RETURN_IF_ERROR(GetUcxOnce(profile, again_keys, again_out, 0, again_keys.size(),
                                       /*client_verifies=*/false, &again, &still));
    for (size_t j = 0; j < mismatched.size(); ++j) {
      if (again[j]) found[mismatched[j]] = true;
    }
    for (size_t k = 0; k < still.size(); ++k) CountCrcFailure();  // damaged twice on its way
  }
  return found;
}

namespace {

absl::Status CheckSegmentSizes(const char* what, size_t keys, size_t blocks, const Profile& profile,
                               auto segments_of) {
  if (keys != blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", keys, " keys but ", blocks, " blocks"));
  }
  for (size_t i = 0; i < blocks; ++i) {
    uint64_t total = 0;
    for (const auto& seg : segments_of(i)) {
      if (seg.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": block ", i, " has an empty segment"));
      }
      total += seg.size();
    }
    if (total != profile.block_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": block ", i, "'s segments add up to ",
                                                     total, " bytes; the profile's blocks are ",
                                                     profile.block_bytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Client::CheckPutOptions(size_t keys, const PutOptions& options) {
  if (!options.importance.empty() && options.importance.size() != keys) {
    return absl::InvalidArgumentError(absl::StrCat("Put has ", keys, " keys but ",
                                                   options.importance.size(), " importance hints"));
  }
  if (!options.positions.empty() && options.positions.size() != keys) {
    return absl::InvalidArgumentError(
        absl::StrCat("Put has ", keys, " keys but ", options.positions.size(), " positions"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PutOutcome>> Client::PutScattered(const Profile& profile,
                                                             std::span<const BlockKey> keys,
                                                             std::span<const ConstSegments> blocks,
                                                             const PutOptions& options) {
  PROXIMA_RETURN_IF_ERROR(
      CheckSegmentSizes("PutScattered", keys.size(), blocks.size(), profile,
                        [&](size_t i) -> const ConstSegments& { return blocks[i]; }));
  PROXIMA_RETURN_IF_ERROR(CheckPutOptions(keys.size(), options));
  if (Staging staging = StagingFor(blocks); staging != Staging::kNone) {
    return PutStaged(staging, profile, keys, blocks, options);
  }
  if (transport_ == Transport::kUcx) return PutUcx(profile, keys, blocks, options);
  // Inline: a one-segment block goes as it is, others are gathered into one buffer each.
  std::vector<std::vector<std::byte>> gathered(blocks.size());
  std::vector<std::span<const std::byte>> spans;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].size() == 1) {
      spans.push_back(blocks[i][0]);
      continue;
    }
    gathered[i].reserve(profile.block_bytes);
    for (const auto& seg : blocks[i]) gathered[i].insert(gathered[i].end(), seg.begin(), seg.end());
    spans.push_back(gathered[i]);
  }
  return Put(profile, keys, spans, options);
}

absl::StatusOr<std::vector<bool>> Client::GetScattered(const Profile& profile,
                                                       std::span<const BlockKey> keys,
                                                       std::span<const Segments> out) {
  PROXIMA_RETURN_IF_ERROR(CheckSegmentSizes("GetScattered", keys.size(), out.size(), profile,
                                            [&](size_t i) -> const Segments& { return out[i]; }));
  if (Staging staging = StagingFor(out); staging != Staging::kNone) {
    return GetStaged(staging, "/proxima.v1.KVTier/Get", profile, keys, out);
  }
  if (transport_ == Transport::kUcx) return GetUcx(profile, keys, out);
  // Inline: a one-segment block is read in place, others through a contiguous buffer each.
  std::vector<std::vector<std::byte>> contiguous(out.size());
  std::vector<std::span<std::byte>> spans;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].size() == 1) {
      spans.push_back(out[i][0]);
      continue;
    }
    contiguous[i].resize(profile.block_bytes);
    spans.push_back(contiguous[i]);
  }
  PROXIMA_ASSIGN_OR_RETURN(std::vector<bool> found, Get(profile, keys, spans));
  for (size_t i = 0; i < out.size(); ++i) {
    if (!found[i] || out[i].size() == 1) continue;
    size_t offset = 0;
    for (const auto& seg : out[i]) {
      std::memcpy(seg.data(), contiguous[i].data() + offset, seg.size());
      offset += seg.size();
    }
  }
  return found;
}

Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::KVTier::NewStub(channel_)),
      generic_stub_(std::make_unique<grpc::GenericStub>(channel_)) {}

void Client::PrepareContextWith(grpc::ClientContext* context, absl::Duration timeout,
                                const std::string& token) {
  context->set_deadline(Deadline(timeout));
  if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
}

std::string Client::Token() const {
  proxima::MutexLock lock(&token_mu_);
  if (options_.token_file.empty() || absl::Now() < next_token_read_) return token_;
  next_token_read_ = absl::Now() + options_.token_reload_interval;
  absl::StatusOr<std::string> read = ReadTokenFile("token_file", options_.token_file);
  if (!read.ok()) {
    if (read.status().message() != token_read_error_) {
      token_read_error_ = std::string(read.status().message());
      PROXIMA_LOG(kWarning) << "cannot read the token file again; the token in force stays"
                            << log::Kv("reason", token_read_error_);
    }
    return token_;
  }
  token_read_error_.clear();
  if (*read != token_) {
    token_ = *std::move(read);
    PROXIMA_LOG(kInfo) << "the token file holds another token; calls present it from now on"
                       << log::Kv("token_file", options_.token_file);
  }
  return token_;
}

bool Client::SessionTokenIsCurrent() const {
  proxima::MutexLock lock(&token_mu_);
  return session_token_ == token_;
}

template <typename Blocks>
size_t Client::UcxBatchEnd(const Blocks& blocks, size_t begin) const {
  // Request bytes a block adds besides its data (key, CRC, hints; per segment its region, offset
  // and length), and the call's own (fixed fields, the packed remote keys of its regions): both
  // generous, so that the daemon's count never exceeds this one.
  constexpr uint64_t kBlockOverhead = 64, kSegmentOverhead = 32, kCallOverhead = 64 << 10;
  const size_t end = std::min(blocks.size(), begin + server_info_.max_batch_blocks);
  const uint64_t limit = server_info_.max_inflight_bytes;
  if (limit == 0) return end;
  uint64_t charged = kCallOverhead;
  for (size_t i = begin; i < end; ++i) {
    uint64_t bytes = kBlockOverhead;
    for (const auto& segment : blocks[i]) bytes += segment.size() + kSegmentOverhead;
    if (i > begin && charged + bytes > limit) return i;
    charged += bytes;
  }
  return end;
}

size_t Client::BlocksPerCall(uint64_t block_bytes) const {
  // The message must fit server.max_message_bytes and, since the daemon charges a call's request
  // and response to the client, server.max_inflight_bytes_per_client: half of it, as the daemon
  // releases a response's bytes once gRPC has sent them, which can be a moment after this client
  // has them and sent its next call. (A UCX call's bytes are released before it answers:
  // UcxBatchEnd uses the whole limit.)
  uint64_t budget = server_info_.max_message_bytes;
  if (server_info_.max_inflight_bytes != 0) {
    budget = std::min(budget, server_info_.max_inflight_bytes / 2);
  }
  const uint64_t by_bytes = budget > kMessageOverhead
                                ? (budget - kMessageOverhead) / (block_bytes + kPerBlockOverhead)
                                : 0;
  return static_cast<size_t>(
      std::max<uint64_t>(1, std::min<uint64_t>(by_bytes, server_info_.max_batch_blocks)));
}

absl::Status Client::CallDaemon(absl::Time deadline, const std::string& token,
                                absl::FunctionRef<grpc::Status(grpc::ClientContext*)> attempt) {
  // Refusals that say "retry when released" come from calls still running in the daemon: they
  // end a moment after their responses arrive (longer when the daemon is short of CPU).
  absl::Duration wait = absl::Milliseconds(1);
  while (true) {
    grpc::ClientContext context;
    PrepareContextWith(&context, deadline - absl::Now(), token);
    const grpc::Status status = attempt(&context);
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
        context.GetServerTrailingMetadata().count(wire::kRetryWhenReleasedMetadata) > 0 &&
        absl::Now() + wait < deadline) {
      absl::SleepFor(wait);
      wait = std::min(wait * 2, absl::Milliseconds(50));
      continue;
    }
    absl::Status result = FromGrpc(status);
    if (absl::IsUnavailable(result)) reconnector_.Wake();
    return result;
  }
}

absl::Status Client::CallRaw(const char* method, const grpc::ByteBuffer& request,
                             grpc::ByteBuffer* response) {
  return CallDaemon(absl::Now() + options_.call_timeout, Token(),
                    [&](grpc::ClientContext* context) {
                      // The calling thread drives its own completion queue, as gRPC's synchronous
                      // stubs do: the response is read from the socket on this thread, where its
                      // bytes are copied out next, instead of on a gRPC callback thread that would
                      // then have to wake this one.
                      grpc::CompletionQueue cq;
                      std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
                          generic_stub_->PrepareUnaryCall(context, method, request, &cq);
                      call->StartCall();
                      grpc::Status status;
                      call->Finish(response, &status, this);
                      void* tag = nullptr;
                      bool ok = false;
                      const bool got = cq.Next(&tag, &ok);  // the call's deadline bounds this wait
                      cq.Shutdown();
                      while (cq.Next(&tag, &ok)) {
                      }
                      if (!got)
                        return grpc::Status(grpc::StatusCode::INTERNAL,
                                            "gRPC completion queue shut down during a call");
                      return status;
                    });
}

template <typename Call>
absl::Status Client::CallWithProfile(const Profile& profile, Call&& call) {
  absl::Status status = call();
  if (status.code() != absl::StatusCode::kNotFound) return status;
  v1::ModelProfile known;
  {
    proxima::MutexLock lock(&mu_);
    auto it = profiles_.find(profile.id);
    if (it == profiles_.end()) return status;
    known = it->second;
  }
  absl::StatusOr<Profile> again = RegisterProfile(known);
  if (!again.ok() || again->id != profile.id) return status;
  PROXIMA_LOG(kInfo) << "re-registered model profile after the daemon forgot it (restart?)"
                     << log::Kv("target", options_.target) << log::Kv("profile_id", profile.id);
  return call();
}

absl::StatusOr<Profile> Client::RegisterProfile(const v1::ModelProfile& profile) {
  v1::RegisterProfileRequest request;
  request.set_namespace_name(options_.namespace_name);
  *request.mutable_profile() = profile;
  v1::RegisterProfileResponse response;
  PROXIMA_RETURN_IF_ERROR(
      CallDaemon(absl::Now() + options_.call_timeout, Token(), [&](grpc::ClientContext* context) {
        return stub_->RegisterProfile(context, request, &response);
      }));
  {
    proxima::MutexLock lock(&mu_);
    profiles_[response.profile_id()] = profile;
  }
  return Profile{response.profile_id(), response.block_bytes()};
}

absl::StatusOr<std::vector<PutOutcome>> Client::Put(
    const Profile& profile, std::span<const BlockKey> keys,
    std::span<const std::span<const std::byte>> blocks, const PutOptions& options) {
  std::vector<size_t> sizes;
  for (const auto& b : blocks) sizes.push_back(b.size());
  PROXIMA_RETURN_IF_ERROR(CheckSizes("Put", keys.size(), blocks.size(), profile, sizes));
  PROXIMA_RETURN_IF_ERROR(CheckPutOptions(keys.size(), options));
  if (transport_ == Transport::kUcx || check_device_memory_) {
    std::vector<ConstSegments> segments = OneSegmentEach(blocks);
    if (Staging staging = StagingFor(std::span<const ConstSegments>(segments));
        staging != Staging::kNone) {
      return PutStaged(staging, profile, keys, segments, options);
    }
    if (transport_ == Transport::kUcx) return PutUcx(profile, keys, segments, options);
  }
  std::vector<PutOutcome> outcomes;
  outcomes.reserve(keys.size());
  const size_t per_call = BlocksPerCall(profile.block_bytes);
  for (size_t begin = 0; begin < keys.size(); begin += per_call) {
    size_t end = std::min(keys.size(), begin + per_call);
    // Block bytes are copied once, into the request's own slices, with their CRC32C.
    grpc::ByteBuffer request = wire::EncodePutRequest(
        options_.namespace_name, profile.id, keys.subspan(begin, end - begin),
        blocks.subspan(begin, end - begin),
        options.positions.empty() ? options.positions
                                  : options.positions.subspan(begin, end - begin),
        options.high_priority,
        options.importance.empty() ? options.importance
                                   : options.importance.subspan(begin, end - begin));
    v1::PutResponse response;
    PROXIMA_RETURN_IF_ERROR(CallWithProfile(profile, [&]() -> absl::Status {
      grpc::ByteBuffer reply;
      PROXIMA_RETURN_IF_ERROR(CallRaw("/proxima.v1.KVTier/Put", request, &reply));
      if (!grpc::SerializationTraits<v1::PutResponse>::Deserialize(&reply, &response).ok()) {
        return absl::InternalError("malformed PutResponse from proximad");
      }
      return absl::OkStatus();
    }));
    if (response.outcomes_size() != static_cast<int>(end - begin)) {
      return absl::InternalError(absl::StrCat("proximad answered ", response.outcomes_size(),
                                              " outcomes for ", end - begin, " blocks"));
    }
    for (int o : response.outcomes()) {
      outcomes.push_back(o == v1::PUT_OUTCOME_STORED            ? PutOutcome::kStored
                         : o == v1::PUT_OUTCOME_ALREADY_PRESENT ? PutOutcome::kAlreadyPresent
                                                                : PutOutcome::kNoSpace);
    }
  }
  return outcomes;
}

absl::Status Client::GetOnce(const char* method, const Profile& profile,
                             std::span<const BlockKey> keys,
                             std::span<const std::span<std::byte>> out, bool client_verifies,
                             std::vector<wire::GetResult>* results) {
  // A DecompressRequest has the GetRequest layout without client_verifies_crc32c: the daemon
  // checks every block it decodes.
  v1::GetRequest request;
  request.set_namespace_name(options_.namespace_name);
  request.set_profile_id(profile.id);
  request.set_client_verifies_crc32c(client_verifies);
  for (const BlockKey& key : keys) request.add_keys(KeyString(key));
  grpc::ByteBuffer request_buffer;
  bool own_buffer = false;
  if (!grpc::SerializationTraits<v1::GetRequest>::Serialize(request, &request_buffer, &own_buffer)
           .ok()) {
    return absl::InternalError("cannot serialize GetRequest");
  }
  return CallWithProfile(profile, [&]() -> absl::Status {
    grpc::ByteBuffer response;
    PROXIMA_RETURN_IF_ERROR(CallRaw(method, request_buffer, &response));
    // Block bytes go from the received slices straight into the caller's buffers, checked
    // against their CRC32C on the way.
    return wire::ParseGetResponse(response, out, results);
  });
}

void Client::CountCrcFailure() {
  // Logged at the 1st, 2nd, 4th, 8th, ... failure: a burst of bad blocks must not flood the
  // worker's log.
  const uint64_t n = crc_failures_.fetch_add(1) + 1;
  if ((n & (n - 1)) == 0) {
    PROXIMA_LOG(kWarning) << "block from proximad failed its size or CRC32C check; "
                             "treated as a miss"
                          << log::Kv("target", options_.target) << log::Kv("failures", n);
  }
}

absl::StatusOr<std::vector<bool>> Client::Get(const Profile& profile,
                                              std::span<const BlockKey> keys,
                                              std::span<const std::span<std::byte>> out) {
  return GetInto("/proxima.v1.KVTier/Get", profile, keys, out);
}

absl::StatusOr<std::vector<bool>> Client::Decompress(const Profile& profile,
                                                     std::span<const BlockKey> keys,
                                                     std::span<const std::span<std::byte>> out) {
  return GetInto("/proxima.v1.KVTier/Decompress", profile, keys, out);
}

absl::StatusOr<std::vector<std::optional<StoredBlock>>> Client::GetStored(
    const Profile& profile, std::span<const BlockKey> keys) {
  std::vector<std::optional<StoredBlock>> blocks(keys.size());
  const size_t per_call = BlocksPerCall(profile.block_bytes);
  for (size_t begin = 0; begin < keys.size(); begin += per_call) {
    size_t end = std::min(keys.size(), begin + per_call);
    v1::GetRequest request;
    request.set_namespace_name(options_.namespace_name);
    request.set_profile_id(profile.id);
    request.set_format(v1::BLOCK_FORMAT_STORED);
    for (size_t i = begin; i < end; ++i) request.add_keys(KeyString(keys[i]));
    grpc::ByteBuffer request_buffer;
    bool own_buffer = false;
    if (!grpc::SerializationTraits<v1::GetRequest>::Serialize(request, &request_buffer, &own_buffer)
             .ok()) {
      return absl::InternalError("cannot serialize GetRequest");
    }
    // Encoded sizes are not known in advance, so this path parses with the generated class
    // (one copy per block; the stored encoding is the smaller of the two).
    v1::GetResponse response;
    PROXIMA_RETURN_IF_ERROR(CallWithProfile(profile, [&]() -> absl::Status {
      grpc::ByteBuffer reply;
      PROXIMA_RETURN_IF_ERROR(CallRaw("/proxima.v1.KVTier/Get", request_buffer, &reply));
      if (!grpc::SerializationTraits<v1::GetResponse>::Deserialize(&reply, &response).ok()) {
        return absl::InternalError("malformed GetResponse from proximad");
      }
      return absl::OkStatus();
    }));
    if (response.results_size() != static_cast<int>(end - begin)) {
      return absl::InternalError(absl::StrCat("proximad answered ", response.results_size(),
                                              " results for ", end - begin, " keys"));
    }
    for (size_t i = begin; i < end; ++i) {
      v1::GetResult* r = response.mutable_results(static_cast<int>(i - begin));
      if (!r->found()) continue;
      const std::string& data = r->data();
      const bool size_ok = r->level() > 0 || data.size() == profile.block_bytes;
      if (!size_ok || Crc32c(std::as_bytes(std::span(data.data(), data.size()))) != r->crc32c()) {
        CountCrcFailure();
        continue;
      }
      blocks[i] = StoredBlock{r->level(), std::move(*r->mutable_data())};
    }
  }
  return blocks;
}

absl::StatusOr<std::vector<bool>> Client::GetInto(const char* method, const Profile& profile,
                                                  std::span<const BlockKey> keys,
                                                  std::span<const std::span<std::byte>> out) {
  std::vector<size_t> sizes;
  for (const auto& b : out) sizes.push_back(b.size());
  PROXIMA_RETURN_IF_ERROR(CheckSizes("Get", keys.size(), out.size(), profile, sizes));
  if (transport_ == Transport::kUcx || check_device_memory_) {
    std::vector<Segments> segments = OneSegmentEach(out);
    if (Staging staging = StagingFor(std::span<const Segments>(segments));
        staging != Staging::kNone) {
      return GetStaged(staging, method, profile, keys, segments);
    }
    if (transport_ == Transport::kUcx) return GetUcx(profile, keys, segments);
  }
  std::vector<bool> found(keys.size(), false);
  const size_t per_call = BlocksPerCall(profile.block_bytes);
  for (size_t begin = 0; begin < keys.size(); begin += per_call) {
    const size_t end = std::min(keys.size(), begin + per_call);
    // This client checks every block's CRC32C as it copies it out, so the daemon need not read
    // the block once more before sending it (GetRequest.client_verifies_crc32c). Decompress
    // has no such field: the daemon checks what it decodes.
    const bool client_verifies = std::strcmp(method, "/proxima.v1.KVTier/Get") == 0;
    std::vector<wire::GetResult> results;
    PROXIMA_RETURN_IF_ERROR(GetOnce(method, profile, keys.subspan(begin, end - begin),
                                    out.subspan(begin, end - begin), client_verifies, &results));
    std::vector<BlockKey> failed_keys;
    std::vector<std::span<std::byte>> failed_out;
    std::vector<size_t> failed_index;
    for (size_t i = begin; i < end; ++i) {
      const wire::GetResult& r = results[i - begin];
      if (!r.found) continue;
      if (r.intact) {
        found[i] = true;
        continue;
      }
      if (!client_verifies) {  // the daemon checked it: damaged on its way here
        CountCrcFailure();
        continue;
      }
      failed_keys.push_back(keys[i]);
      failed_out.push_back(out[i]);
      failed_index.push_back(i);
    }
    if (failed_keys.empty()) continue;
    // Ask again with the daemon checking: a block corrupt in the daemon's memory is dropped and
    // counted there (and misses here); one damaged in transit arrives intact this time.
    PROXIMA_RETURN_IF_ERROR(GetOnce(method, profile, failed_keys, failed_out,
                                    /*client_verifies=*/false, &results));
    for (size_t j = 0; j < failed_keys.size(); ++j) {
      if (results[j].found && results[j].intact) {
        found[failed_index[j]] = true;
        continue;
      }
      if (!results[j].found) continue;  // the daemon found it corrupt and dropped it
      CountCrcFailure();                // damaged twice on its way here
    }
  }
  return found;
}

template <typename Request, typename Response, typename Rpc, typename OnResponse>
absl::Status Client::CallInKeyChunks(const Profile& profile, std::span<const BlockKey> keys,
                                     size_t per_call, Rpc rpc, OnResponse&& on_response) {
  for (size_t begin = 0; begin < keys.size(); begin += per_call) {
    const size_t end = std::min(keys.size(), begin + per_call);
    Request request;
    request.set_namespace_name(options_.namespace_name);
    request.set_profile_id(profile.id);
    for (size_t i = begin; i < end; ++i) request.add_keys(KeyString(keys[i]));
    Response response;
    PROXIMA_RETURN_IF_ERROR(CallWithProfile(profile, [&] {
      return CallDaemon(absl::Now() + options_.call_timeout, Token(),
                        [&](grpc::ClientContext* context) {
                          return ((*stub_).*rpc)(context, request, &response);
                        });
    }));
    if (!on_response(response, end - begin)) break;
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> Client::Lookup(const Profile& profile, std::span<const BlockKey> chain) {
  size_t present = 0;
  PROXIMA_RETURN_IF_ERROR((CallInKeyChunks<v1::LookupRequest, v1::LookupResponse>(
      profile, chain, server_info_.max_lookup_keys, &v1::KVTier::Stub::Lookup,
      [&](const v1::LookupResponse& response, size_t asked) {
        present += response.num_prefix_present();
        return response.num_prefix_present() == asked;  // else the prefix ended in this call
      })));
  return present;
}

absl::StatusOr<size_t> Client::Delete(const Profile& profile, std::span<const BlockKey> keys) {
  size_t deleted = 0;
  PROXIMA_RETURN_IF_ERROR((CallInKeyChunks<v1::DeleteRequest, v1::DeleteResponse>(
      profile, keys, server_info_.max_batch_blocks, &v1::KVTier::Stub::Delete,
      [&](const v1::DeleteResponse& response, size_t) {
        deleted += response.num_deleted();
        return true;
      })));
  return deleted;
}

absl::StatusOr<v1::StatsResponse> Client::Stats() {
  v1::StatsResponse response;
  PROXIMA_RETURN_IF_ERROR(
      CallDaemon(absl::Now() + options_.call_timeout, Token(), [&](grpc::ClientContext* context) {
        return stub_->Stats(context, v1::StatsRequest(), &response);
      }));
  return response;
}

absl::StatusOr<std::string> StatsToJson(const v1::StatsResponse& stats) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  auto status = google::protobuf::util::MessageToJsonString(stats, &json, options);
  if (!status.ok()) return absl::InternalError("stats to JSON: " + status.ToString());
  return json;
}

}  // namespace proxima::client
