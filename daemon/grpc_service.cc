#include "daemon/grpc_service.h"

#include <chrono>

#include <grpcpp/support/proto_buffer_reader.h>

#include "common/status_macros.h"
#include "proto/wire.h"

namespace proxima::daemon {
namespace {

constexpr const char* kMethodNames[] = {"GetServerInfo", "RegisterProfile", "Put",
                                        "Get",           "Lookup",          "Delete",
                                        "Stats",         "ConnectUcx",      "DisconnectUcx",
                                        "PutUcx",        "GetUcx"};

}  // namespace

KvTierGrpcService::KvTierGrpcService(TierService* core, metrics::Registry* registry,
                                     UcxTransport* ucx)
    : core_(core), ucx_(ucx), registry_(registry) {
  for (int m = 0; m < kMethods; ++m) {
    latency_[m] = registry->AddHistogram("proxima_request_duration_seconds",
                                         "Time to handle a KVTier call in the daemon",
                                         {{"method", kMethodNames[m]}}, metrics::LatencyBuckets());
  }
}

template <typename Call>
grpc::ServerUnaryReactor* KvTierGrpcService::Handle(Method method,
                                                    grpc::CallbackServerContext* context,
                                                    Call&& call) {
  auto start = std::chrono::steady_clock::now();
  in_flight_.fetch_add(1);
  absl::Status status = draining_.load()
                            ? absl::UnavailableError("proximad is shutting down; retry elsewhere")
                            : call();
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
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status(static_cast<grpc::StatusCode>(code), std::string(status.message())));
  return reactor;
}

template <typename Req, typename Resp>
grpc::ServerUnaryReactor* KvTierGrpcService::HandleProto(
    Method method, grpc::CallbackServerContext* context, const Req* request, Resp* response,
    absl::Status (TierService::*call)(const Req&, Resp*)) {
  // Explicit captures: GCC 12's UBSan misreads `this` through an implicit [&] capture here.
  TierService* core = core_;
  return Handle(method, context, [core, call, request, response] {
    absl::Status status = (core->*call)(*request, response);
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

}  // namespace

template <typename Req, typename Resp>
grpc::ServerUnaryReactor* KvTierGrpcService::HandleKeyed(
    Method method, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response, size_t max_keys,
    absl::Status (TierService::*call)(const Req&, Resp*)) {
  TierService* core = core_;
  const char* name = kMethodNames[method];
  return Handle(method, context,
                [core, call, request, response, max_keys, name]() -> absl::Status {
                  Req req;
                  PROXIMA_RETURN_IF_ERROR(ParseKeyed(*request, max_keys, name, &req));
                  Resp resp;
                  PROXIMA_RETURN_IF_ERROR((core->*call)(req, &resp));
                  return SerializeTo(resp, response);
                });
}

grpc::ServerUnaryReactor* KvTierGrpcService::Put(grpc::CallbackServerContext* c,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  return Handle(kPut, c, [core = core_, request, response]() -> absl::Status {
    wire::PutRequestReader reader;
    PROXIMA_RETURN_IF_ERROR(reader.Parse(*request, core->max_batch_blocks()));
    v1::PutResponse resp;
    PROXIMA_RETURN_IF_ERROR(core->Put(reader, &resp));
    return SerializeTo(resp, response);
  });
}

grpc::ServerUnaryReactor* KvTierGrpcService::Get(grpc::CallbackServerContext* c,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  return Handle(kGet, c, [core = core_, request, response]() -> absl::Status {
    v1::GetRequest req;
    PROXIMA_RETURN_IF_ERROR(ParseKeyed(*request, core->max_batch_blocks(), "Get", &req));
    std::vector<std::optional<BlockStore::ReadBlock>> blocks;
    PROXIMA_RETURN_IF_ERROR(core->GetBlocks(req, &blocks));
    wire::GetResponseWriter writer;
    for (auto& b : blocks) {
      if (b) {
        writer.AddHit(b->bytes, b->crc32c, std::move(b->pin));
      } else {
        writer.AddMiss();
      }
    }
    *response = writer.Finish();
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierGrpcService::GetServerInfo(grpc::CallbackServerContext* c,
                                                           const v1::GetServerInfoRequest* req,
                                                           v1::GetServerInfoResponse* resp) {
  TierService* core = core_;
  const bool ucx = ucx_ != nullptr;
  return Handle(kGetServerInfo, c, [core, req, resp, ucx]() -> absl::Status {
    PROXIMA_RETURN_IF_ERROR(core->GetServerInfo(*req, resp));
    resp->set_ucx_enabled(ucx);
    return absl::OkStatus();
  });
}

template <typename Resp, typename Call>
grpc::ServerUnaryReactor* KvTierGrpcService::HandleUcx(Method method,
                                                       grpc::CallbackServerContext* context,
                                                       Resp* response, Call&& call) {
  UcxTransport* ucx = ucx_;
  const absl::Time deadline = context->deadline() == std::chrono::system_clock::time_point::max()
                                  ? absl::Now() + absl::Seconds(60)
                                  : absl::FromChrono(context->deadline());
  return Handle(method, context, [ucx, response, deadline, &call]() -> absl::Status {
    if (ucx == nullptr) {
      return absl::FailedPreconditionError(
          "this proximad runs without the UCX data plane (ucx.enabled: false); use Put/Get");
    }
    absl::Status status = call(ucx, deadline);
    if (!status.ok()) response->Clear();  // a failed call returns no partial results
    return status;
  });
}

grpc::ServerUnaryReactor* KvTierGrpcService::ConnectUcx(grpc::CallbackServerContext* c,
                                                        const v1::ConnectUcxRequest* req,
                                                        v1::ConnectUcxResponse* resp) {
  return HandleUcx(kConnectUcx, c, resp, [req, resp](UcxTransport* ucx, absl::Time deadline) {
    return ucx->Connect(*req, resp, deadline);
  });
}
grpc::ServerUnaryReactor* KvTierGrpcService::DisconnectUcx(grpc::CallbackServerContext* c,
                                                           const v1::DisconnectUcxRequest* req,
                                                           v1::DisconnectUcxResponse* resp) {
  return HandleUcx(kDisconnectUcx, c, resp, [req, resp](UcxTransport* ucx, absl::Time) {
    return ucx->Disconnect(*req, resp);
  });
}
grpc::ServerUnaryReactor* KvTierGrpcService::PutUcx(grpc::CallbackServerContext* c,
                                                    const v1::PutUcxRequest* req,
                                                    v1::PutResponse* resp) {
  return HandleUcx(kPutUcx, c, resp, [req, resp](UcxTransport* ucx, absl::Time deadline) {
    return ucx->Put(*req, resp, deadline);
  });
}
grpc::ServerUnaryReactor* KvTierGrpcService::GetUcx(grpc::CallbackServerContext* c,
                                                    const v1::GetUcxRequest* req,
                                                    v1::GetUcxResponse* resp) {
  return HandleUcx(kGetUcx, c, resp, [req, resp](UcxTransport* ucx, absl::Time deadline) {
    return ucx->Get(*req, resp, deadline);
  });
}
grpc::ServerUnaryReactor* KvTierGrpcService::RegisterProfile(
    grpc::CallbackServerContext* c, const v1::RegisterProfileRequest* req,
    v1::RegisterProfileResponse* resp) {
  return HandleProto(kRegisterProfile, c, req, resp, &TierService::RegisterProfile);
}
grpc::ServerUnaryReactor* KvTierGrpcService::Lookup(grpc::CallbackServerContext* c,
                                                    const grpc::ByteBuffer* req,
                                                    grpc::ByteBuffer* resp) {
  return HandleKeyed<v1::LookupRequest, v1::LookupResponse>(
      kLookup, c, req, resp, core_->max_lookup_keys(), &TierService::Lookup);
}
grpc::ServerUnaryReactor* KvTierGrpcService::Delete(grpc::CallbackServerContext* c,
                                                    const grpc::ByteBuffer* req,
                                                    grpc::ByteBuffer* resp) {
  return HandleKeyed<v1::DeleteRequest, v1::DeleteResponse>(
      kDelete, c, req, resp, core_->max_batch_blocks(), &TierService::Delete);
}
grpc::ServerUnaryReactor* KvTierGrpcService::Stats(grpc::CallbackServerContext* c,
                                                   const v1::StatsRequest* req,
                                                   v1::StatsResponse* resp) {
  return HandleProto(kStats, c, req, resp, &TierService::Stats);
}

}  // namespace proxima::daemon
