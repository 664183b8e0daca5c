// Daemon: one running proximad. Builds the tier, the core service, the gRPC server (TCP and/or
// Unix socket, with the standard gRPC health service) and the metrics endpoint from a validated
// DaemonConfig, and drains them in order on Shutdown().
//
// Thread-safe: Shutdown() may be called from any thread, more than once.
#ifndef PROXIMA_DAEMON_DAEMON_H_
#define PROXIMA_DAEMON_DAEMON_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "daemon/cluster/cluster.h"
#include "daemon/config.h"
#include "daemon/grpc_service.h"
#include "daemon/metrics.h"
#include "daemon/metrics_http.h"
#include "daemon/snapshot.h"
#include "daemon/tier_service.h"
#include "daemon/ucx_transport.h"
#include "daemon/unix_listener.h"

namespace grpc {
class Server;
}

namespace proxima::daemon {

class Daemon {
 public:
  // Starts serving. Fails (and leaves nothing running) when an address cannot be bound, the Unix
  // socket is in use by a live server, or the tier cannot be reserved.
  // `ucx_address_check_command`: the command that parses a peer's UCX worker address in a child
  // process (UcxTransport::Create); proximad's main passes itself. Needed when ucx.enabled and
  // ucx.check_worker_addresses.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(
      const DaemonConfig& config, const std::vector<std::string>& ucx_address_check_command = {});
  ~Daemon();  // Shuts down if still running.

  // TCP port actually bound (useful with port 0), or 0 without TCP.
  int tcp_port() const { return tcp_port_; }
  // Metrics port actually bound, or 0 without a metrics endpoint.
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }

  // Marks the health service NOT_SERVING, refuses new calls (UNAVAILABLE), gives in-flight calls
  // up to server.shutdown_grace_seconds to finish, then cancels the rest and stops; then hands
  // the blocks off to peers (cluster.spill.handoff) or writes them to tiers.host.snapshot_file.
  void Shutdown();

  // SIGHUP: re-reads the namespaces' tokens and, in a cluster, the peer tokens
  // (cluster.peer_token), together: neither may take a value of the other. Each set that reads
  // back valid replaces its old one; an error is logged, and the old set stays in force.
  // Returns the first error.
  absl::Status ReloadTokens();

  // SIGHUP with --config: `next` is the config file read again with the --set overrides
  // applied (or why it could not be: logged, counted, and the configuration in force stays).
  // Puts in force what changed and can change while serving: namespaces[].max_bytes (a lowered
  // limit is reached at once) and log.level. Every other changed key is logged as taking effect
  // at the next start, its value in force kept, and counted in proxima_config_restart_pending.
  // Returns those keys.
  std::vector<std::string> Reconfigure(const absl::StatusOr<DaemonConfig>& next);

  // The core the gRPC service calls (for in-process tests, e.g. of corruption in tier memory).
  TierService& core() { return *core_; }
  // The UCX data plane, or null with ucx.enabled: false (for in-process tests).
  UcxTransport* ucx() { return ucx_.get(); }
  // The cluster part, or null when cluster.enabled is false.
  cluster::Cluster* cluster() { return cluster_.get(); }

 private:
  Daemon() = default;
  // Moves the GPU tier's blocks down to the host tier before they are handed off or written to
  // the snapshot (both read the host tier alone), until `deadline`, and logs what it did.
  void DrainGpuTier(absl::Time deadline, absl::string_view why);
  // Writes the tiers' blocks to tiers.host.snapshot_file (within tiers.host.snapshot_seconds)
  // and logs it, `why` saying for what. REQUIRES: no call runs.
  void WriteSnapshot(absl::string_view why);

  DaemonConfig config_;  // as started, with what Reconfigure put in force since
  metrics::Counter* config_reloads_ = nullptr;
  metrics::Counter* config_reload_failures_ = nullptr;
  std::atomic<int64_t> restart_pending_{0};  // keys of the file not in force (Reconfigure)
  // Held from the start to the end (after the snapshot is written); null without
  // tiers.host.snapshot_file.
  std::unique_ptr<snapshot::Claim> snapshot_claim_;
  metrics::Registry registry_;
  std::unique_ptr<TierService> core_;
  std::unique_ptr<UcxTransport> ucx_;  // null with ucx.enabled: false; outlived by core_
  std::unique_ptr<cluster::Cluster> cluster_;  // null with cluster.enabled: false
  std::unique_ptr<KvTierGrpcService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<UnixListener> unix_listener_;  // null without server.unix_socket; hands
                                                 // connections to server_, so destroyed first
  std::unique_ptr<metrics::MetricsHttpServer> metrics_;
  int tcp_port_ = 0;
  proxima::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_DAEMON_H_
