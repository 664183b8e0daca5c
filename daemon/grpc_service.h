// KvTierGrpcService: the gRPC face of proximad (proxima.v1.KVTier, callback API). Each handler is
// thin: it authenticates the call's bearer token (TierService::Authenticate), charges the bytes
// it holds to its peer's in-flight account, calls TierService, records the call's latency and
// status code, and converts the absl::Status to a grpc::Status at the edge (the codes map one to
// one).
//
// Handler threads: gRPC 1.51's callback API runs handlers on its own few threads (about two
// calls at once on the 2-core test machine), so a handler that waits holds up every other call.
// Calls that may wait run on threads of the service's own instead (HandlerThreads: one per call
// running, started as needed, kept): UCX transfers of sessions that are not over shared memory
// (over tcp a client stopped in the middle of one leaves it waiting until its deadline; over
// shared memory the daemon copies mapped client memory itself), and with `offload` (the daemon
// sets it when the cluster is on) Put, Get, Lookup, Delete and the UCX transfers, which may wait
// for peers up to cluster.peer_deadline or for a spill round.
//
// Thread-safe: gRPC calls handlers concurrently.
#ifndef PROXIMA_DAEMON_GRPC_SERVICE_H_
#define PROXIMA_DAEMON_GRPC_SERVICE_H_

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/mutex.h"
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
                v1::KVTier::WithRawCallbackMethod_Decompress<
                    v1::KVTier::WithCallbackMethod_ConnectUcx<
                        v1::KVTier::WithCallbackMethod_DisconnectUcx<
                            v1::KVTier::WithCallbackMethod_PutUcx<v1::KVTier::WithCallbackMethod_GetUcx<
                                v1::KVTier::Service>>>>>>>>>>>>;

// The bodies of the raw KVTier methods, transport aside: decode `request` (proto3 wire format,
// bounded while parsing), run it on `core` as `caller`, encode the response into `response`.
// The gRPC handlers below call them; so does the request fuzzer (tests/fuzz/).
absl::Status ServePut(TierService& core, const Caller& caller, const grpc::ByteBuffer& request,
                      grpc::ByteBuffer* response);
absl::Status ServeGet(TierService& core, const Caller& caller, const grpc::ByteBuffer& request,
                      grpc::ByteBuffer* response);
absl::Status ServeLookup(TierService& core, const Caller& caller,
                         const grpc::ByteBuffer& request, grpc::ByteBuffer* response);
absl::Status ServeDelete(TierService& core, const Caller& caller,
                         const grpc::ByteBuffer& request, grpc::ByteBuffer* response);
absl::Status ServeDecompress(TierService& core, const Caller& caller,
                             const grpc::ByteBuffer& request, grpc::ByteBuffer* response);

// What the calls of each peer (one client connection: "ipv4:10.0.0.5:41234") hold in the daemon
// right now: how many are running, and their bytes (each request, and each response until gRPC
// has sent it). A call is refused with RESOURCE_EXHAUSTED, naming the limit, when its peer would
// go over `max_bytes_per_peer`, or when it would make one peer more than `max_peers` have calls
// running at once. So one client cannot pin all of the daemon's memory in requests and unsent
// responses, and a flood of connections cannot all be served at once. Thread-safe.
class InflightLedger {
 public:
  InflightLedger(uint64_t max_bytes_per_peer, uint32_t max_peers)
      : max_bytes_(max_bytes_per_peer), max_peers_(max_peers) {}
  // The payload (type URL) of a refusal that holds only because calls still running hold what
  // the call needs (`peer`'s own calls its bytes, other connections' calls every slot of
  // server.max_connections): the call fits once they are released
  // (wire::kRetryWhenReleasedMetadata).
  static constexpr char kRetryWhenReleased[] = "proxima/inflight-retry-when-released";
  // Starts a call of `peer` holding `request_bytes`; on error nothing is counted.
  absl::Status Begin(const std::string& peer, uint64_t request_bytes);
  // Adds a running call's response bytes (the call was admitted with `request_bytes`); on error
  // nothing is added.
  absl::Status AddResponse(const std::string& peer, uint64_t request_bytes,
                           uint64_t response_bytes);
  // Ends a call that Begin() admitted, releasing the `bytes` it was charged in total.
  void End(const std::string& peer, uint64_t bytes);
  uint64_t held_bytes(const std::string& peer) const;
  size_t active_peers() const;

 private:
  // Whether `more` bytes fit beside `held` under the limit; no sum that could wrap around (a
  // UCX call's declared lengths add up, saturating, to as much as 2^64 - 1).
  bool Fits(uint64_t held, uint64_t more) const {
    return held <= max_bytes_ && more <= max_bytes_ - held;
  }
  struct Account {
    uint64_t bytes = 0;
    uint32_t calls = 0;
  };
  // The refusal of `more` bytes for `what` with `held` held already, `own` of them this call's.
  absl::Status OverBytes(const std::string& peer, uint64_t held, uint64_t more,
                         absl::string_view what, uint64_t own = 0) const;

  const uint64_t max_bytes_;
  const uint32_t max_peers_;
  mutable proxima::Mutex mu_;
  absl::flat_hash_map<std::string, Account> accounts_ ABSL_GUARDED_BY(mu_);
};

// Threads that run tasks, one per task running: a task finds an idle thread or starts a new one
// (up to `max_threads`; past that it waits for one). Threads stay once started. The destructor
// runs what is queued and joins them.
class HandlerThreads {
 public:
  explicit HandlerThreads(size_t max_threads) : max_threads_(max_threads) {}
  ~HandlerThreads();
  void Run(std::function<void()> task);
  size_t threads() const;

 private:
  void Loop();

  const size_t max_threads_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  size_t idle_ = 0;                          // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::vector<std::thread> threads_;         // guarded by mu_
};

class KvTierGrpcService final : public KvTierCallbackBase {
 public:
  // `core`, `registry` and `ucx` (null when the daemon runs without UCX) must outlive the
  // service. `offload`: run the calls that may wait for peers on the service's own threads
  // (the UCX transfers always run there).
  KvTierGrpcService(TierService* core, metrics::Registry* registry,
                    uint64_t max_inflight_bytes_per_client, uint32_t max_connections,
                    UcxTransport* ucx = nullptr, bool offload = false);

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
  grpc::ServerUnaryReactor* Decompress(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
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
    kDecompress,
    kConnectUcx,
    kDisconnectUcx,
    kPutUcx,
    kGetUcx,
    kMethods
  };
  // A UCX data-plane call, authenticated like every other call: FAILED_PRECONDITION without
  // UCX; `call(transport, caller, deadline)`.
  template <typename Req, typename Resp, typename Call>
  grpc::ServerUnaryReactor* HandleUcx(Method method, grpc::CallbackServerContext* context,
                                      const Req* request, Resp* response, Call&& call);
  static constexpr int kCodes = 17;  // absl/gRPC status codes 0..16
  // With `offload`: the calls that may wait for other daemons or a spill round (they run on
  // threads_).
  bool MayWaitOnPeers(Method method) const;

  // Authenticates the call and runs `call(caller)` (returning absl::Status) unless draining or
  // the peer is over its in-flight bytes, records latency and status code, and finishes the
  // call. `request_bytes` is the request's size; `response` (raw calls) its response buffer.
  template <typename Call>
  // `held_until_sent`: the charged bytes stay in the client's account until gRPC has sent the
  // response (an inline response holds or pins them until then); false for calls whose charged
  // bytes are done with when `call` returns (UCX transfers), so that the client's next call,
  // which may start as soon as it has the answer, never finds them still charged.
  // `may_wait`: the call may wait for its client (a UCX transfer over tcp): it runs on threads_.
  grpc::ServerUnaryReactor* Handle(Method method, grpc::CallbackServerContext* context,
                                   uint64_t request_bytes, grpc::ByteBuffer* response, Call&& call,
                                   bool held_until_sent = true, bool may_wait = false);
  // A raw call (Put, Get, Lookup, Delete, Decompress): `serve` is one of the Serve* functions
  // above.
  grpc::ServerUnaryReactor* HandleRaw(Method method, grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response,
                                      absl::Status (*serve)(TierService&, const Caller&,
                                                            const grpc::ByteBuffer&,
                                                            grpc::ByteBuffer*));
  template <typename Req, typename Resp>
  grpc::ServerUnaryReactor* HandleProto(Method method, grpc::CallbackServerContext* context,
                                        const Req* request, Resp* response,
                                        absl::Status (TierService::*call)(const Caller&,
                                                                          const Req&, Resp*));

  TierService* const core_;
  InflightLedger inflight_;
  UcxTransport* const ucx_;
  const bool offload_peer_waits_;
  std::atomic<bool> draining_{false};
  std::atomic<int> in_flight_{0};
  metrics::Registry* const registry_;
  std::array<metrics::Histogram*, kMethods> latency_{};
  // Request counters per (method, code), created on first use.
  std::array<std::array<std::atomic<metrics::Counter*>, kCodes>, kMethods> requests_{};
  // Null without `offload`. Declared last: destroyed (joined) first.
  std::unique_ptr<HandlerThreads> threads_;
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_GRPC_SERVICE_H_
