// KvTierGrpcService: the gRPC face of proximad (proxima.v1.KVTier, callback API). Each handler is
// thin: it calls TierService, records the call's latency and status code, and converts the
// absl::Status to a grpc::Status at the edge (the codes map one to one).
//
// Thread-safe: gRPC calls handlers concurrently.
#ifndef PROXIMA_DAEMON_GRPC_SERVICE_H_
#define PROXIMA_DAEMON_GRPC_SERVICE_H_

#include <array>
#include <atomic>

#include "daemon/metrics.h"
#include "daemon/tier_service.h"
#include "daemon/ucx_transport.h"
#include "proxima/v1/kvtier.grpc.pb.h"

namespace proxima::daemon {

// Every method on the callback API. Put and Get are "raw": they read the request and write the
// response in wire format themselves, so block bytes move between the network buffers and tier
// memory without protobuf copies (see proto/wire.h). Lookup and Delete are raw too, so that their
// key lists are bounded while parsing, not after protobuf has allocated them.
// The UCX data-plane calls carry no block bytes and use the generated messages.
using KvTierCallbackBase = v1::KVTier::WithCallbackMethod_GetServerInfo<
    v1::KVTier::WithCallbackMethod_RegisterProfile<v1::KVTier::WithRawCallbackMethod_Put<
        v1::KVTier::WithRawCallbackMethod_Get<v1::KVTier::WithRawCallbackMethod_Lookup<
            v1::KVTier::WithRawCallbackMethod_Delete<v1::KVTier::WithCallbackMethod_Stats<
                v1::KVTier::WithCallbackMethod_ConnectUcx<
                    v1::KVTier::WithCallbackMethod_DisconnectUcx<
                        v1::KVTier::WithCallbackMethod_PutUcx<
                            v1::KVTier::WithCallbackMethod_GetUcx<v1::KVTier::Service>>>>>>>>>>>;

class KvTierGrpcService final : public KvTierCallbackBase {
 public:
  // `core`, `registry` and `ucx` (null when the daemon runs without UCX) must outlive the
  // service.
  KvTierGrpcService(TierService* core, metrics::Registry* registry, UcxTransport* ucx = nullptr);

  // From now on every call is answered UNAVAILABLE ("draining"); calls already running finish.
  void StartDraining() { draining_.store(true); }
  // Calls whose handler is running now.
  int in_flight() const { return in_flight_.load(); }

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::GetServerInfoResponse* response) override;
  grpc::ServerUnaryReactor* RegisterProfile(grpc::CallbackServerContext* context,
                                            const v1::RegisterProfileRequest* request,
                                            v1::RegisterProfileResponse* response) override;
  grpc::ServerUnaryReactor* Put(grpc::CallbackServerContext* context,
                                const grpc::ByteBuffer* request,
                                grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context,
                                const grpc::ByteBuffer* request,
                                grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Lookup(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context,
                                  const v1::StatsRequest* request,
                                  v1::StatsResponse* response) override;
  grpc::ServerUnaryReactor* ConnectUcx(grpc::CallbackServerContext* context,
                                       const v1::ConnectUcxRequest* request,
                                       v1::ConnectUcxResponse* response) override;
  grpc::ServerUnaryReactor* DisconnectUcx(grpc::CallbackServerContext* context,
                                          const v1::DisconnectUcxRequest* request,
                                          v1::DisconnectUcxResponse* response) override;
  grpc::ServerUnaryReactor* PutUcx(grpc::CallbackServerContext* context,
                                   const v1::PutUcxRequest* request,
                                   v1::PutResponse* response) override;
  grpc::ServerUnaryReactor* GetUcx(grpc::CallbackServerContext* context,
                                   const v1::GetUcxRequest* request,
                                   v1::GetUcxResponse* response) override;

 private:
  enum Method {
    kGetServerInfo,
    kRegisterProfile,
    kPut,
    kGet,
    kLookup,
    kDelete,
    kStats,
    kConnectUcx,
    kDisconnectUcx,
    kPutUcx,
    kGetUcx,
    kMethods
  };
  // A UCX data-plane call: FAILED_PRECONDITION without UCX; `call(transport, deadline)`.
  template <typename Resp, typename Call>
  grpc::ServerUnaryReactor* HandleUcx(Method method, grpc::CallbackServerContext* context,
                                      Resp* response, Call&& call);
  static constexpr int kCodes = 17;  // absl/gRPC status codes 0..16

  // Runs `call` (returning absl::Status) unless draining, records latency and status code,
  // and finishes the call.
  template <typename Call>
  grpc::ServerUnaryReactor* Handle(Method method, grpc::CallbackServerContext* context,
                                   Call&& call);
  // A keyed call (Lookup, Delete) in raw form: bounded parse into Req, core call, serialized Resp.
  template <typename Req, typename Resp>
  grpc::ServerUnaryReactor* HandleKeyed(Method method, grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response, size_t max_keys,
                                        absl::Status (TierService::*call)(const Req&, Resp*));
  template <typename Req, typename Resp>
  grpc::ServerUnaryReactor* HandleProto(Method method, grpc::CallbackServerContext* context,
                                        const Req* request, Resp* response,
                                        absl::Status (TierService::*call)(const Req&, Resp*));

  TierService* const core_;
  UcxTransport* const ucx_;
  std::atomic<bool> draining_{false};
  std::atomic<int> in_flight_{0};
  metrics::Registry* const registry_;
  std::array<metrics::Histogram*, kMethods> latency_{};
  // Request counters per (method, code), created on first use.
  std::array<std::array<std::atomic<metrics::Counter*>, kCodes>, kMethods> requests_{};
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_GRPC_SERVICE_H_
