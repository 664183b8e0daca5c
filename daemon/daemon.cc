#include "daemon/daemon.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <string_view>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/credentials.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "daemon/file_limit.h"
#include "daemon/memory_limit.h"
#include "daemon/metrics.h"
#include "daemon/snapshot.h"
#include "kernels/device.h"

namespace proxima::daemon {
namespace {

constexpr char kServiceName[] = "proxima.v1.KVTier";

// Credentials of the TCP listener: TLS (mTLS with a client CA) when server.tls is set, else
// plaintext. Every file is read and checked now, so a bad one stops the start with an error that
// names the key and the path. From then on gRPC reads the files again every
// server.tls.reload_interval: a certificate renewed in place (a Secret update, cert-manager)
// serves the next handshakes without a restart.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(const TlsConfig& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  PROXIMA_ASSIGN_OR_RETURN(
      std::string cert, ReadPemFile("server.tls.cert_file", tls.cert_file, PemKind::kCertificates));
  PROXIMA_ASSIGN_OR_RETURN(
      std::string key, ReadPemFile("server.tls.key_file", tls.key_file, PemKind::kPrivateKey));
  PROXIMA_RETURN_IF_ERROR(
      CheckKeyMatchesCertificate("server.tls.cert_file", "server.tls.key_file", cert, key));
  if (!tls.client_ca_file.empty()) {
    PROXIMA_RETURN_IF_ERROR(
        ReadPemFile("server.tls.client_ca_file", tls.client_ca_file, PemKind::kCertificates)
            .status());
  }
  auto files = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      tls.key_file, tls.cert_file, tls.client_ca_file,
      static_cast<unsigned>(tls.reload_interval_seconds));
  grpc::experimental::TlsServerCredentialsOptions options(files);
  options.watch_identity_key_cert_pairs();
  if (!tls.client_ca_file.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

// What this start took from the snapshot, as metrics: the restart of a daemon that was to come
// back warm and came back cold (no file, an unreadable one, records refused) is an event an
// operator alerts on, and the log line of the start has long scrolled away by then.
void ExportSnapshotLoad(metrics::Registry& registry, std::string_view state,
                        const snapshot::Loaded& loaded, double seconds) {
  for (std::string_view s : {"loaded", "partial", "none", "failed"}) {
    const double value = s == state ? 1 : 0;
    registry.AddGauge("proxima_snapshot_load_state",
                      "How this run's start read tiers.host.snapshot_file: 1 for the state it "
                      "ended in (loaded: all of it; partial: records refused or no end record; "
                      "none: no file; failed: unreadable, nothing loaded), 0 for the others",
                      {{"state", std::string(s)}}, [value] { return value; });
  }
  const std::pair<const char*, const char*> kCounts[] = {
      {"proxima_snapshot_loaded_blocks", "Blocks this run's start stored from the snapshot"},
      {"proxima_snapshot_loaded_bytes",
       "Tier bytes of the blocks this run's start stored from "
       "the snapshot"},
      {"proxima_snapshot_loaded_profiles",
       "Model profiles this run's start registered from the "
       "snapshot"},
      {"proxima_snapshot_decoded_blocks",
       "Of the loaded blocks, those stored decoded because their level's codec plan is no longer "
       "a level of their namespace's hierarchy"},
      {"proxima_snapshot_skipped_records",
       "Block or profile records of the snapshot this run's start refused (the log names each)"},
      {"proxima_snapshot_no_room_blocks",
       "Blocks of the snapshot left out because the hotter ones filled the host tier"},
  };
  const double values[] = {
      static_cast<double>(loaded.blocks),   static_cast<double>(loaded.bytes),
      static_cast<double>(loaded.profiles), static_cast<double>(loaded.decoded),
      static_cast<double>(loaded.skipped),  static_cast<double>(loaded.no_room)};
  for (size_t i = 0; i < std::size(kCounts); ++i) {
    const double value = values[i];
    registry.AddGauge(kCounts[i].first, kCounts[i].second, {}, [value] { return value; });
  }
  registry.AddGauge("proxima_snapshot_load_seconds",
                    "Seconds this run's start took to read the snapshot", {},
                    [seconds] { return seconds; });
}

// Loads the snapshot the previous run left (if any). A snapshot that cannot be read is logged and
// the daemon starts empty: it is a cache. Returns whether it read one.
bool LoadSnapshot(TierService& core, const std::string& file, metrics::Registry& registry) {
  const absl::Time start = absl::Now();
  absl::StatusOr<snapshot::Loaded> loaded = snapshot::Load(core, file);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!loaded.ok()) {
    PROXIMA_LOG(kError) << "snapshot not loaded: starting with empty tiers" << log::Kv("file", file)
                        << log::Kv("error", loaded.status().ToString());
    ExportSnapshotLoad(registry, "failed", {}, seconds);
    return false;
  }
  if (!loaded->found) {
    PROXIMA_LOG(kInfo) << "no snapshot to load: starting with empty tiers" << log::Kv("file", file);
    ExportSnapshotLoad(registry, "none", *loaded, seconds);
    return false;
  }
  const bool whole = loaded->complete && loaded->skipped == 0;
  ExportSnapshotLoad(registry, whole ? "loaded" : "partial", *loaded, seconds);
  log::Line(whole ? log::Level::kInfo : log::Level::kWarning, __FILE__, __LINE__)
      << "loaded the blocks of the snapshot the last run wrote" << log::Kv("file", file)
      << log::Kv("blocks", loaded->blocks) << log::Kv("bytes", loaded->bytes)
      << log::Kv("profiles", loaded->profiles) << log::Kv("skipped", loaded->skipped)
      << log::Kv("no_room_blocks", loaded->no_room) << log::Kv("complete", loaded->complete)
      << log::Kv("decoded_blocks", loaded->decoded) << log::Kv("seconds", seconds);
  for (const std::string& p : loaded->problems) {
    PROXIMA_LOG(kWarning) << "snapshot record not loaded" << log::Kv("file", file)
                          << log::Kv("problem", p);
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(
    const DaemonConfig& config, const std::vector<std::string>& ucx_address_check_command) {
  std::unique_ptr<Daemon> d(new Daemon());
  d->config_ = config;
  // Before any connection: gRPC's TCP listener stops for good at the first accept that finds
  // the open-file limit reached (daemon/file_limit.h).
  const FileLimit files = RaiseOpenFileLimit();
  if (!files.error.empty()) {
    PROXIMA_LOG(kWarning) << "cannot raise the open-file limit to the hard limit"
                          << log::Kv("soft", files.soft) << log::Kv("hard", files.hard)
                          << log::Kv("error", files.error);
  } else if (files.soft != files.soft_at_start) {
    PROXIMA_LOG(kInfo) << "raised the open-file limit (RLIMIT_NOFILE) to the hard limit"
                       << log::Kv("from", files.soft_at_start) << log::Kv("to", files.soft);
  }
  if (files.soft < config.server.max_connections + kFileHeadroom) {
    PROXIMA_LOG(kWarning)
        << "the open-file limit leaves little room: each client connection, UCX endpoint and "
           "peer takes descriptors, and once an accept finds none left gRPC's TCP listener "
           "(server.listen) accepts no more connections until a restart; raise the hard limit "
           "(LimitNOFILE=, the container runtime's nofile ulimit) to at least "
           "server.max_connections + 1024"
        << log::Kv("open_file_limit", files.soft)
        << log::Kv("max_connections", config.server.max_connections);
  }
  // The host tier fills its capacity as blocks arrive: one larger than this process may use
  // would end in the OOM killer, not an error.
  const MemoryLimit memory = ProcessMemoryLimit();
  PROXIMA_RETURN_IF_ERROR(CheckHostCapacity(config.host_tier.capacity_bytes, memory));
  if (config.host_tier.capacity_bytes + kMemoryHeadroomBytes > memory.bytes) {
    PROXIMA_LOG(kWarning) << "tiers.host.capacity_bytes leaves less than 1 GiB of this process's "
                             "memory for the block index, gRPC buffers and calls in flight"
                          << log::Kv("capacity_bytes", config.host_tier.capacity_bytes)
                          << log::Kv("memory_limit_bytes", memory.bytes)
                          << log::Kv("limit_source", memory.source);
  }
  for (const std::string& w : ConfigWarnings(config)) PROXIMA_LOG(kWarning) << w;
  PROXIMA_ASSIGN_OR_RETURN(d->core_, TierService::Create(config, &d->registry_));
  if (!config.host_tier.snapshot_file.empty()) {
    // Written at shutdown: a directory it cannot be written to, or a file another daemon
    // holds, stops the start, not the exit.
    PROXIMA_ASSIGN_OR_RETURN(d->snapshot_claim_,
                             snapshot::ClaimFile(config.host_tier.snapshot_file));
  }
  if (config.ucx.enabled) {
    PROXIMA_ASSIGN_OR_RETURN(
        d->ucx_,
        UcxTransport::Create(config.ucx, d->core_.get(), &d->registry_, ucx_address_check_command));
  }
  d->service_ = std::make_unique<KvTierGrpcService>(
      d->core_.get(), &d->registry_, config.server.max_inflight_bytes_per_client,
      config.server.max_connections, d->ucx_.get(), /*offload=*/config.cluster.enabled);
  PROXIMA_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> tcp_credentials,
                           TcpCredentials(config.server.tls));

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // Without this, gRPC sets SO_REUSEPORT and a second daemon could bind the same port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Blocks are megabytes: large HTTP/2 frames and a deep flow-control window (as in the client).
  // The TCP listener needs no socket-buffer setting like the Unix socket's: the kernel grows its
  // connections' send buffers to net.ipv4.tcp_wmem's maximum (4 MiB) during a get (run 8 in
  // docs/benchmarks.md, where the knobs tried for 256 KiB gets over TCP are listed).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 4 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.server.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.server.max_message_bytes));
  if (!config.server.listen.empty()) {
    builder.AddListeningPort(config.server.listen, tcp_credentials, &d->tcp_port_);
  }
  if (!config.server.unix_socket.empty()) {
    // Bound and listening now (so a socket in use stops the start here); connections are
    // accepted once the server runs.
    PROXIMA_ASSIGN_OR_RETURN(
        d->unix_listener_,
        UnixListener::Create({config.server.unix_socket, config.server.unix_socket_mode,
                              config.server.unix_socket_send_buffer}));
  }
  builder.RegisterService(d->service_.get());
  if (config.cluster.enabled) {
    PROXIMA_ASSIGN_OR_RETURN(d->cluster_,
                             cluster::Cluster::Create(config, d->core_.get(), d->ucx_.get(),
                                                      &d->registry_));
    builder.RegisterService(d->cluster_->service());
  }
  // The snapshot is read as late as can be before serving: a start that fails before this point
  // (a bad certificate, a socket in use) leaves the file for the next one.
  const bool loaded = !config.host_tier.snapshot_file.empty() &&
                      LoadSnapshot(*d->core_, config.host_tier.snapshot_file, d->registry_);
  d->server_ = builder.BuildAndStart();
  if (d->server_ == nullptr || (!config.server.listen.empty() && d->tcp_port_ == 0)) {
    // The file is gone: the blocks it held go back into it (nothing was served). A server that
    // did start is shut down by ~Daemon, which writes them.
    if (loaded && d->server_ == nullptr) d->WriteSnapshot("for the next start (this one failed)");
    return absl::UnavailableError(absl::StrCat(
        "cannot start the gRPC server on server.listen '", config.server.listen,
        "' (address in use, or not an address of this host?)"));
  }
  if (d->unix_listener_) d->unix_listener_->Start(d->server_.get());
  grpc::HealthCheckServiceInterface* health = d->server_->GetHealthCheckService();
  health->SetServingStatus(kServiceName, true);
  health->SetServingStatus(true);
  if (d->cluster_) {
    d->core_->SetRemote(d->cluster_.get());
    d->cluster_->Start();
  }

  if (!config.server.metrics_listen.empty()) {
    auto metrics = metrics::MetricsHttpServer::Start(config.server.metrics_listen, &d->registry_);
    if (!metrics.ok()) {
      d->core_->SetRemote(nullptr);
      if (d->cluster_) d->cluster_->Stop();
      d->server_->Shutdown();
      return metrics.status();
    }
    d->metrics_ = *std::move(metrics);
  }

  // Prometheus's usual names for them, for an alert before the limit stops the TCP listener.
  d->registry_.AddGauge("process_open_fds", "File descriptors this process has open", {},
                        [] { return static_cast<double>(OpenFileDescriptors()); });
  d->registry_.AddGauge("process_max_fds",
                        "This process's open-file limit (soft RLIMIT_NOFILE, raised at start to "
                        "the hard limit)",
                        {}, [] { return static_cast<double>(OpenFileLimit()); });
  // The limit the host tier's capacity was checked against at start, for alerts on the
  // headroom (capacity vs limit) and on the process's resident memory.
  const double memory_limit = static_cast<double>(memory.bytes);
  d->registry_.AddGauge("proxima_memory_limit_bytes",
                        "Memory this process may use, as found at start (the smallest of physical "
                        "memory and its cgroups' limits)",
                        {{"source", memory.source}}, [memory_limit] { return memory_limit; });
  d->config_reloads_ = d->registry_.AddCounter(
      "proxima_config_reloads_total",
      "Config files read again (SIGHUP with --config) and valid; what could change while "
      "serving was put in force",
      {});
  d->config_reload_failures_ = d->registry_.AddCounter(
      "proxima_config_reload_failures_total",
      "Config files read again (SIGHUP) that could not be read or were not valid; the "
      "configuration in force stayed",
      {});
  const std::atomic<int64_t>* pending = &d->restart_pending_;
  d->registry_.AddGauge("proxima_config_restart_pending",
                        "Keys of the config file, as last read again, whose values differ from "
                        "those in force and take effect only at the next start",
                        {}, [pending] { return static_cast<double>(pending->load()); });
  std::string why_no_gpu;
  std::vector<gpu::DeviceInfo> gpus = gpu::VisibleDevices(&why_no_gpu);
  d->registry_.AddGauge("proxima_build_info", "Build and runtime facts (value is always 1)",
                        {{"version", PROXIMA_VERSION},
                         {"cuda", gpu::BuiltWithCuda() ? "yes" : "no"},
                         {"gpus", std::to_string(gpus.size())}},
                        [] { return 1.0; });
  if (gpus.empty()) {
    PROXIMA_LOG(kInfo) << "no GPU tier: running with the host tier alone"
                       << log::Kv("reason", why_no_gpu);
  } else {
    for (const gpu::DeviceInfo& g : gpus) {
      PROXIMA_LOG(kInfo) << "GPU visible" << log::Kv("ordinal", g.ordinal)
                         << log::Kv("name", g.name) << log::Kv("bytes", g.total_bytes);
    }
    if (config.gpu_tier.capacity_bytes_per_device == 0) {
      PROXIMA_LOG(kInfo) << "GPU tier off (tiers.gpu.capacity_bytes_per_device is 0)";
    }
  }
  const bool tokens = std::any_of(config.namespaces.begin(), config.namespaces.end(),
                                  [](const NamespaceConfig& n) { return !n.tokens.empty(); });
  const bool loopback = absl::StartsWith(config.server.listen, "127.") ||
                        absl::StartsWith(config.server.listen, "localhost:") ||
                        absl::StartsWith(config.server.listen, "[::1]:");
  if (tokens && !config.server.listen.empty() && !config.server.tls.enabled() && !loopback) {
    PROXIMA_LOG(kWarning) << "bearer tokens are configured but server.listen is plaintext TCP: "
                             "tokens and blocks cross the network unencrypted; set server.tls"
                          << log::Kv("listen", config.server.listen);
  }
  PROXIMA_LOG(kInfo) << "proximad serving" << log::Kv("version", PROXIMA_VERSION)
                     << log::Kv("tcp_port", d->tcp_port_)
                     << log::Kv("unix_socket", config.server.unix_socket)
                     << log::Kv("metrics_port", d->metrics_port())
                     << log::Kv("tls", !config.server.tls.enabled()         ? "off"
                                       : config.server.tls.client_ca_file.empty() ? "tls"
                                                                                  : "mtls")
                     << log::Kv("host_capacity_bytes", config.host_tier.capacity_bytes)
                     << log::Kv("namespaces", config.namespaces.size())
                     << log::Kv("cluster", config.cluster.enabled ? config.cluster.advertise
                                                                  : std::string("off"));
  return d;
}

Daemon::~Daemon() { Shutdown(); }

absl::Status Daemon::ReloadTokens() {
  if (cluster_ == nullptr) return core_->ReloadTokens().status();
  absl::StatusOr<std::vector<std::string>> peer = cluster::PeerTokens::Read(config_.cluster);
  // The namespace tokens may take no peer token, those read now or those in force.
  const std::shared_ptr<const std::vector<std::string>> in_force = cluster_->peer_tokens();
  std::vector<std::string> reserved = peer.ok() ? *peer : *in_force;
  if (peer.ok()) reserved.insert(reserved.end(), in_force->begin(), in_force->end());
  absl::Status tokens = core_->ReloadTokens(reserved).status();
  absl::Status peer_tokens = cluster_->ReloadPeerTokens(std::move(peer));
  return tokens.ok() ? peer_tokens : tokens;
}

std::vector<std::string> Daemon::Reconfigure(const absl::StatusOr<DaemonConfig>& next) {
  if (!next.ok()) {
    config_reload_failures_->Increment();
    PROXIMA_LOG(kError) << "config reload failed; the configuration in force stays"
                        << log::Kv("error", next.status().message());
    return {};
  }
  // What will be in force: the running configuration with the keys that can change while
  // serving taken from `next`. Namespaces are matched by position and name: a list reordered,
  // renamed or resized changes which blocks a limit would apply to, so it waits for a restart,
  // its limits with it.
  DaemonConfig live = config_;
  live.log_level = next->log_level;
  bool same_namespaces = next->namespaces.size() == live.namespaces.size();
  for (size_t i = 0; same_namespaces && i < live.namespaces.size(); ++i) {
    same_namespaces = next->namespaces[i].name == live.namespaces[i].name;
  }
  for (size_t i = 0; same_namespaces && i < live.namespaces.size(); ++i) {
    live.namespaces[i].max_bytes = next->namespaces[i].max_bytes;
  }
  // Whatever still differs waits for the next start.
  const std::vector<std::string> restart = ConfigDifferences(live, *next);
  if (live.log_level != config_.log_level) {
    log::Level level;
    log::ParseLevel(live.log_level, &level);  // validated with the config
    PROXIMA_LOG(kInfo) << "log level changed" << log::Kv("was", config_.log_level)
                       << log::Kv("now", live.log_level);
    log::SetMinLevel(level);
  }
  for (uint32_t ns = 0; ns < live.namespaces.size(); ++ns) {
    const uint64_t was = config_.namespaces[ns].max_bytes;
    const uint64_t now = live.namespaces[ns].max_bytes;
    if (now == was) continue;
    const bool within = core_->SetNamespaceLimit(ns, now);
    PROXIMA_LOG(kInfo) << "namespace limit changed"
                       << log::Kv("namespace", live.namespaces[ns].name) << log::Kv("was", was)
                       << log::Kv("max_bytes", now)
                       << log::Kv("bytes", core_->store().namespace_bytes(ns));
    if (!within) {
      PROXIMA_LOG(kWarning) << "namespace still above its lowered limit: its blocks being read "
                               "could not give way; its next puts make room"
                            << log::Kv("namespace", live.namespaces[ns].name);
    }
  }
  config_ = std::move(live);
  config_reloads_->Increment();
  restart_pending_.store(static_cast<int64_t>(restart.size()));
  if (restart.empty()) {
    PROXIMA_LOG(kInfo) << "config reloaded";
  } else {
    PROXIMA_LOG(kWarning) << "config reloaded; changed keys that take effect only at the next "
                             "start kept their values in force"
                          << log::Kv("keys", absl::StrJoin(restart, ","));
  }
  return restart;
}

void Daemon::Shutdown() {
  proxima::MutexLock lock(&shutdown_mu_);
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  PROXIMA_LOG(kInfo) << "draining: refusing new calls, finishing in-flight ones"
                     << log::Kv("grace_seconds", config_.server.shutdown_grace_seconds);
  server_->GetHealthCheckService()->SetServingStatus(false);
  // Phase 1: answer new calls UNAVAILABLE (a clear, retryable status) while the running ones
  // finish. Phase 2: stop the gRPC server, which cancels whatever is still left at the deadline.
  service_->StartDraining();
  const auto deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(config_.server.shutdown_grace_seconds * 1000));
  if (cluster_) {
    // Peers stop placing keys here now; what this node kept for them moves to the keys' next
    // homes while it drains. Within the grace: a peer that hangs costs drain time, not more.
    const cluster::Cluster::Leaving told = cluster_->TellPeersLeaving();
    if (told.told + told.failed > 0) {
      PROXIMA_LOG(kInfo) << "told peers this node is leaving" << log::Kv("peers", told.told)
                         << log::Kv("failed", told.failed);
    }
  }
  auto busy = [this] {
    return service_->in_flight() > 0 || (cluster_ && cluster_->service()->in_flight() > 0);
  };
  while (busy() && std::chrono::system_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // New Unix-socket connections were still accepted during the drain (and answered
  // UNAVAILABLE, as over TCP); from here on they are refused.
  if (unix_listener_) unix_listener_->Stop();
  // With nothing left to finish, the rest of the grace would only wait for idle clients to close
  // their connections after the server's GOAWAY, which an idle gRPC client reads only when its
  // backup poller next runs (every 5 s in gRPC 1.51): such connections are closed at once.
  server_->Shutdown(busy() ? deadline
                           : std::min(deadline, std::chrono::system_clock::now() +
                                                    std::chrono::milliseconds(100)));
  server_->Wait();
  if (cluster_) {  // no call runs anymore: the core may let go of the cluster
    if (config_.cluster.spill_enabled && config_.cluster.spill_handoff_seconds > 0) {
      // The blocks outlive this process on peers with room (a rolling upgrade, a drain).
      const absl::Time start = absl::Now();
      const absl::Duration budget = absl::Seconds(config_.cluster.spill_handoff_seconds);
      DrainGpuTier(start + budget, "to hand them off");
      const cluster::Cluster::Handoff h =
          cluster_->HandOff(std::max(absl::ZeroDuration(), budget - (absl::Now() - start)));
      PROXIMA_LOG(kInfo) << "handed blocks off to peers before exit" << log::Kv("blocks", h.blocks)
                         << log::Kv("bytes", h.bytes) << log::Kv("left_blocks", h.left_blocks)
                         << log::Kv("deleted_blocks", h.deleted_blocks)
                         << log::Kv("rounds", h.rounds) << log::Kv("ended", h.ended)
                         << log::Kv("seconds", absl::ToDoubleSeconds(absl::Now() - start));
    }
    core_->SetRemote(nullptr);
    cluster_->Stop();
  }
  if (!config_.host_tier.snapshot_file.empty()) WriteSnapshot("for the next start");
  if (metrics_) metrics_->Stop();
  unix_listener_.reset();  // removes the socket file
  PROXIMA_LOG(kInfo) << "shutdown complete";
}

void Daemon::WriteSnapshot(absl::string_view why) {
  // Never with a cluster (the config refuses it): a peer's Deletes would be missed.
  const std::string& file = config_.host_tier.snapshot_file;
  const absl::Time start = absl::Now();
  const absl::Time until = start + absl::Seconds(config_.host_tier.snapshot_seconds);
  DrainGpuTier(until, "to write them to the snapshot");
  // The blocks hold still while they are written (one the tierer were encoding would be
  // passed over).
  core_->tierer().Stop();
  absl::StatusOr<snapshot::Written> w = snapshot::Write(*core_, file, until);
  if (w.ok()) {
    log::Line line(w->left_blocks == 0 ? log::Level::kInfo : log::Level::kWarning, __FILE__,
                   __LINE__);
    line << "wrote the blocks to the snapshot " << why << log::Kv("file", file)
         << log::Kv("blocks", w->blocks) << log::Kv("bytes", w->bytes)
         << log::Kv("profiles", w->profiles) << log::Kv("left_blocks", w->left_blocks)
         << log::Kv("seconds", absl::ToDoubleSeconds(absl::Now() - start));
    // The file system filled: the file holds the hottest blocks that fit.
    if (!w->full.empty()) line << log::Kv("file_system_full", w->full);
  } else {
    PROXIMA_LOG(kError) << "snapshot not written: the next start begins with empty tiers"
                        << log::Kv("file", file) << log::Kv("error", w.status().ToString());
  }
}

void Daemon::DrainGpuTier(absl::Time deadline, absl::string_view why) {
  if (core_->store().num_devices() == 0) return;
  const absl::Time start = absl::Now();
  const size_t moved = core_->tierer().DrainDevices(deadline);
  uint64_t left = 0;
  for (size_t d = 0; d < core_->store().num_devices(); ++d) {
    left += core_->store().device_blocks(d);
  }
  PROXIMA_LOG(kInfo) << "moved the GPU tier's blocks to the host tier " << why
                     << log::Kv("blocks", moved) << log::Kv("left_blocks", left)
                     << log::Kv("seconds", absl::ToDoubleSeconds(absl::Now() - start));
}

}  // namespace proxima::daemon
