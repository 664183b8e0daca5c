// Membership: which proximad peers of a cluster are alive right now.
//
// The peers come from a static list (cluster.peers) and/or the A/AAAA records of a DNS name
// (cluster.dns_name, a Kubernetes headless Service), resolved again every cluster.dns_refresh.
// Every cluster.health_interval each known peer gets one standard gRPC health check
// (grpc.health.v1, service "proxima.v1.KVTier"), all in parallel, each with the
// cluster.health_timeout deadline. A peer joins the live set on its first SERVING answer and
// leaves it after cluster.failures_before_down consecutive failures (no answer, an error, or
// NOT_SERVING from a draining daemon); it rejoins on its next success. A peer that says it is
// shutting down (Peer.Leave: MarkLeft) leaves at once, and checks that were under way then do not
// bring it back. This daemon (cluster.advertise) is always live and never checked.
//
// Live() is the snapshot placement runs on: the same live set on two daemons gives every key the
// same home. Membership also owns the one gRPC channel per peer that every peer call uses.
//
// Metrics: proxima_cluster_live_nodes, proxima_cluster_known_peers,
// proxima_cluster_health_check_failures_total, proxima_cluster_peer_transitions_total{to}.
//
// Thread-safe. Two background threads after Start(): the health checker and the DNS resolver
// (getaddrinfo may block for seconds, so it never delays the checks).
#ifndef PROXIMA_DAEMON_CLUSTER_MEMBERSHIP_H_
#define PROXIMA_DAEMON_CLUSTER_MEMBERSHIP_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "daemon/config.h"
#include "daemon/metrics.h"
#include "daemon/placement.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace proxima::daemon::cluster {

struct MembershipOptions {
  std::string self;                       // this daemon's node id (cluster.advertise)
  std::vector<std::string> static_peers;  // host:port; may include self
  std::string dns_name;                   // "" = no DNS discovery
  uint32_t dns_port = 50051;
  absl::Duration dns_refresh = absl::Seconds(10);
  absl::Duration health_interval = absl::Seconds(1);
  absl::Duration health_timeout = absl::Milliseconds(500);
  uint32_t failures_before_down = 3;
  uint64_t max_message_bytes = 64ull << 20;  // of the peer channels (blocks travel on them)
  // TLS of the peer channels (resolved cluster.tls; disabled = plaintext). Create() reads and
  // checks its files once; every channel shares the credentials built from them.
  PeerTlsConfig tls;
  absl::Duration tls_reload_interval = absl::Seconds(60);  // server.tls.reload_interval
  // The peers ask for client certificates (mTLS: this daemon's server.tls.client_ca_file is set,
  // and a cluster shares one configuration): Create() checks that tls.cert_file may be one.
  bool peers_require_client_certificate = false;

  static MembershipOptions FromConfig(const DaemonConfig& config);
};

// The live nodes at one moment, this daemon included, sorted by id (so that every daemon ranks
// the same nodes in the same order).
struct LiveSet {
  std::vector<PlacementNode> nodes;
  size_t self = 0;  // index of this daemon in `nodes`

  bool Contains(const std::string& id) const;
  const std::string& id(size_t i) const { return nodes[i].id; }
};

// One gRPC health check of a peer (grpc.health.v1, service proxima.v1.KVTier), run with others
// by RunHealthCalls.
struct HealthCall {
  std::string id;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::health::v1::Health::Stub> stub;
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<grpc::health::v1::HealthCheckResponse>> reader;

  bool serving() const;  // answered SERVING
};

// Runs every call at once, each with the `timeout` deadline, and returns when all have ended.
// Without `wait_for_ready`, a call on a channel that cannot connect fails at once, UNAVAILABLE.
void RunHealthCalls(std::vector<std::unique_ptr<HealthCall>>& calls, absl::Duration timeout,
                    bool wait_for_ready);

class Membership {
 public:
  // Called (from the checker thread) when a peer leaves (`live` false) or joins the live set.
  using ChangeFn = std::function<void(const std::string& peer, bool live)>;

  // `registry` must outlive the membership. Resolves nothing yet (Start() does). With
  // options.tls enabled, reads its PEM files now: an error names the cluster.tls key and path.
  static absl::StatusOr<std::unique_ptr<Membership>> Create(MembershipOptions options,
                                                            metrics::Registry* registry);
  ~Membership();  // Stop()s

  // REQUIRES: before Start().
  void OnChange(ChangeFn fn) { on_change_ = std::move(fn); }
  // Starts the checker (and, with a DNS name, the resolver). Runs the first DNS resolution
  // before returning so that the first round checks every peer.
  void Start();
  // Stops the threads; waits at most one health timeout (or one running getaddrinfo).
  void Stop();

  std::shared_ptr<const LiveSet> Live() const;
  // Every peer currently known (static and DNS), self excluded, sorted.
  std::vector<std::string> KnownPeers() const;
  // The same peers with what the checks found of each.
  struct PeerState {
    std::string id;
    bool live = false;
    uint32_t failures = 0;   // consecutive failed checks
    std::string last_error;  // the last failure's cause, or why it left; "" after a success
  };
  std::vector<PeerState> Peers() const;
  // The channel to `peer` (created on first use, kept while it is known).
  std::shared_ptr<grpc::Channel> Channel(const std::string& peer);
  const std::string& self() const { return options_.self; }

  // One round of health checks, now (the checker thread calls it every health_interval).
  void CheckOnce();
  // `peer` said it is shutting down: it leaves the live set now (on_change runs, as after failed
  // checks) rather than after failures_before_down checks, and rejoins on the first check that
  // starts after this call and succeeds; until then its failed checks are counted, not logged,
  // and its last_error stays "said it is shutting down". NotFound when `peer` is not a known
  // peer.
  absl::Status MarkLeft(const std::string& peer);
  // One DNS resolution, now. Keeps the previous records when it fails.
  void ResolveOnce();

 private:
  struct Peer {
    std::shared_ptr<grpc::Channel> channel;
    uint32_t failures = 0;  // consecutive
    bool live = false;
    // The failure last logged, or "said it is shutting down" after MarkLeft; cleared by a success.
    std::string last_error;
    uint64_t epoch = 0;      // MarkLeft bumps it: a check started before counts for nothing
    bool said_leaving = false;  // MarkLeft: its failed checks are not logged until it is back
  };

  explicit Membership(MembershipOptions options) : options_(std::move(options)) {}
  void RunChecker();
  void RunResolver();
  // Rebuilds the known set from the static list and `dns_peers`.
  void SetKnown(const std::vector<std::string>& dns_peers);
  void Publish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts, logs and reports (on_change) peers that joined (true) or left the live set. Without
  // mu_ held: on_change may call back into Live().
  void ReportChanges(const std::vector<std::pair<std::string, bool>>& changes,
                     const char* why_left);
  std::shared_ptr<grpc::Channel> NewChannel(const std::string& peer) const;
  // Why each of these health checks failed, for the log: (peer, reason). A check that only says
  // that its deadline passed is explained by the error of a fresh connection attempt (a TLS
  // handshake that failed, a refused connection). Waits at most one health timeout.
  std::vector<std::pair<std::string, std::string>> ExplainFailures(
      const std::vector<const HealthCall*>& failed) const;

  const MembershipOptions options_;
  // TLS (with this daemon's client certificate) or plaintext; set by Create(), then constant.
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  ChangeFn on_change_;
  metrics::Counter* check_failures_ = nullptr;
  metrics::Counter* went_down_ = nullptr;
  metrics::Counter* came_up_ = nullptr;

  mutable proxima::Mutex mu_;
  absl::flat_hash_map<std::string, Peer> peers_ ABSL_GUARDED_BY(mu_);  // known, self excluded
  std::shared_ptr<const LiveSet> live_ ABSL_GUARDED_BY(mu_);

  // Wakes the threads' sleeps early on Stop() (a std::mutex: condition_variable needs one).
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;  // guarded by stop_mu_
  std::thread checker_;
  std::thread resolver_;
};

// The A/AAAA records of `name` as "ip:port" ("[ip6]:port"), sorted and without duplicates.
absl::StatusOr<std::vector<std::string>> ResolvePeers(const std::string& name, uint32_t port);

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_MEMBERSHIP_H_
