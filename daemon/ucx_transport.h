// UcxTransport: proximad's UCX data plane (DESIGN.md section 3). The control plane stays gRPC:
// a client opens a session (ConnectUcx, its worker address and a probe buffer the daemon reads
// before it answers, so a session exists only where bytes move), then PutUcx / GetUcx name its
// registered buffers (packed rkeys, addresses, scatter/gather lists) and the daemon moves the
// bytes on its own ucx::Worker:
//
//  - put: tier memory is reserved for each new block and filled, every block's size and CRC32C
//    are checked, and only then are the blocks committed (visible). The bytes come as UCX
//    messages the client sent before the call (PutUcxRequest.ucx_transfer: the libproxima
//    default wherever the daemon does not map the client's memory), or the daemon copies them
//    out of client memory it maps over shared memory, or (older clients) pulls them with UCX
//    gets;
//  - get: each found block (pinned) is copied into the client's segments where the daemon maps
//    them, else sent as one UCX message per block when the client asked for that
//    (GetUcxRequest.ucx_transfer), else (older clients) written with UCX puts; only then does
//    the call answer. Large blocks' messages go rendezvous (GetUcxRequest.ucx_rendezvous_bytes):
//    the call answers first and the blocks stay pinned until the client has taken them, within
//    bounds of time (kRendezvousGetGrace) and bytes (ucx.rendezvous_get_max_bytes).
//
// Messages keep the daemon from being the initiator of a one-sided operation on a client's
// memory: over tcp, UCX 1.13 aborts the target of such an operation (the client) when the
// initiator (this daemon) dies mid-operation (docs/operations.md).
//
// Every call is authenticated by the gRPC layer and runs as its Caller: PutUcx and GetUcx pass
// through TierService's Authorize() like Put and Get (namespace, read-only tokens, private
// prefixes), and a session belongs to the caller that opened it (same namespace and token): any
// other caller presenting its id is refused (PERMISSION_DENIED) and cannot close it.
//
// The host tier's arena is registered once, at start. Sessions end on DisconnectUcx, when the
// client's worker fails (peer error handling, where the transports support it), or when a
// transfer misses the call's deadline; the daemon's metrics count live sessions, endpoints and
// registrations.
//
// Thread-safe. Never calls into the worker while holding its own mutex.
#ifndef PROXIMA_DAEMON_UCX_TRANSPORT_H_
#define PROXIMA_DAEMON_UCX_TRANSPORT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/ucx.h"
#include "common/ucx_address_check.h"
#include "daemon/config.h"
#include "daemon/metrics.h"
#include "daemon/tier_service.h"
#include "proxima/v1/kvtier.pb.h"

namespace proxima::daemon {

class UcxTransport {
 public:
  // Most regions and segments per request: bounds the work a request can ask for.
  static constexpr int kMaxRegions = 256;
  static constexpr int kMaxSegmentsPerBlock = 4096;
  // Largest ConnectUcx probe buffer.
  static constexpr uint64_t kMaxProbeBytes = 4096;
  // A GetUcx's blocks sent as rendezvous messages stay pinned until the client takes or drops
  // them; past the call's deadline (at most kParkedFor from the call) and this grace, the
  // session's endpoint is closed by force, which releases them. How many bytes may be pinned so
  // at once: UcxConfig::rendezvous_get_max_bytes (past it gets go eager).
  static constexpr absl::Duration kRendezvousGetGrace = absl::Seconds(5);

  // Starts the worker and registers the arena of `core`'s host tier. `core` and `registry` must
  // outlive the transport. With config.check_worker_addresses, `address_check_command` runs a
  // child that parses each new client or peer address first (ucx::AddressCheck; proximad:
  // {"/proc/self/exe", ucx::kAddressCheckFlag}); it is tried on the worker's own address here,
  // so a command that cannot run on this host stops the start with the reason.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(
      const UcxConfig& config, TierService* core, metrics::Registry* registry,
      const std::vector<std::string>& address_check_command);
  ~UcxTransport();

  // `deadline`: the call's; transfers stop short of it so the answer still arrives in time.
  absl::Status Connect(const Caller& caller, const v1::ConnectUcxRequest& request,
                       v1::ConnectUcxResponse* response, absl::Time deadline);
  absl::Status Disconnect(const Caller& caller, const v1::DisconnectUcxRequest& request,
                          v1::DisconnectUcxResponse* response);
  absl::Status Put(const Caller& caller, const v1::PutUcxRequest& request,
                   v1::PutResponse* response, absl::Time deadline);
  absl::Status Get(const Caller& caller, const v1::GetUcxRequest& request,
                   v1::GetUcxResponse* response, absl::Time deadline);

  // Drops the messages of `transfer` that arrived (or arrive later) for a PutUcx that will not
  // take them; a rendezvous one's sender is told, and its send ends.
  void DropMessages(uint64_t transfer) { worker_->Collect(transfer, {}, absl::Now()); }

  int64_t sessions() const;
  const ucx::Worker& worker() const { return *worker_; }
  // The worker and the arena's registration, for the cluster's daemon-to-daemon transfers
  // (daemon/cluster). Valid while the transport lives.
  ucx::Worker* mutable_worker() { return worker_.get(); }
  const ucx::Registration* arena() const { return arena_.get(); }
  // The arena's registration when it covers all of `bytes`, else null (UCX then registers them for
  // the transfer).
  const ucx::Registration* ArenaCovering(std::span<const std::byte> bytes) const {
    return arena_->Contains(bytes.data(), bytes.size()) ? arena_.get() : nullptr;
  }

  // Whether session `session_id` moves bytes over shared memory. There the daemon copies mapped
  // client memory itself (UCX-allocated memory and the client's host staging, the defaults) and
  // waits for nothing of the client's; over tcp a transfer needs the client's UCX to progress,
  // and waits for a stopped client until the call's deadline. False for an unknown session.
  bool OverSharedMemory(uint64_t session_id) const;

 private:
  UcxTransport(const UcxConfig& config, TierService* core) : config_(config), core_(core) {}
  // An open session and who opened it: the namespace and name of the token it presented
  // (-1 and "" for a call without a token).
  struct Session {
    std::shared_ptr<ucx::Endpoint> endpoint;
    int owner_namespace = -1;
    std::string owner_token;
    bool shared_memory = false;  // its lanes are shared memory (ConnectUcx's advice)
  };
  // The endpoint of `caller`'s session `session_id`: NOT_FOUND when no such session is open,
  // PERMISSION_DENIED when another caller opened it.
  absl::StatusOr<std::shared_ptr<ucx::Endpoint>> FindSession(const Caller& caller,
                                                             uint64_t session_id);
  void DropSession(uint64_t session_id);
  // GetUcx's found `blocks` (`bytes` in all) as messages of request.ucx_transfer to the client's
  // worker at `ep`: eager, sent before this returns, or rendezvous (blocks of at least
  // request.ucx_rendezvous_bytes, while ucx.rendezvous_get_max_bytes allows), started and left to
  // the worker, which closes the endpoint if the client has not taken them in time.
  absl::Status SendGetMessages(
      ucx::Endpoint& ep, const v1::GetUcxRequest& request,
      std::shared_ptr<std::vector<std::optional<BlockStore::ReadBlock>>> blocks, uint64_t bytes,
      absl::Time deadline);
  // Reads the request's probe buffer over `endpoint` and checks its CRC32C: FAILED_PRECONDITION
  // when bytes do not move between the two sides (e.g. memory domains the other side lacks).
  absl::Status Probe(ucx::Endpoint& endpoint, const v1::ConnectUcxRequest& request,
                     absl::Time deadline);

  const UcxConfig config_;
  TierService* const core_;
  std::unique_ptr<ucx::AddressCheck> address_check_;  // null without check_worker_addresses
  std::unique_ptr<ucx::Worker> worker_;
  std::shared_ptr<ucx::Registration> arena_;
  metrics::Counter* put_by_messages_ = nullptr;
  metrics::Counter* get_by_messages_ = nullptr;
  metrics::Counter* bytes_in_ = nullptr;
  metrics::Counter* bytes_out_ = nullptr;
  // Bytes of blocks pinned for rendezvous gets not yet taken (ucx.rendezvous_get_max_bytes); shared
  // with the sends' keep-alives, which may be released after the transport.
  std::shared_ptr<std::atomic<uint64_t>> rendezvous_get_held_ =
      std::make_shared<std::atomic<uint64_t>>(0);

  mutable proxima::Mutex mu_;
  absl::flat_hash_map<uint64_t, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 session_ids_ ABSL_GUARDED_BY(mu_);
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_UCX_TRANSPORT_H_
