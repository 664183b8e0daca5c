#include "daemon/cluster/membership.h"

#include <arpa/inet.h>
#include <grpcpp/security/credentials.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_channel.h"
#include "common/grpc_tls.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace proxima::daemon::cluster {
namespace {

constexpr char kHealthService[] = "proxima.v1.KVTier";

// The credentials of every peer channel: TLS that verifies the peer's server certificate against
// cluster.tls.ca_file and presents this daemon's certificate as a client certificate (for peers
// with mTLS), or plaintext when cluster.tls is off. The files are checked now (a bad one stops
// the start naming the key) and read again every `reload_interval` by gRPC, so that a renewed
// certificate or CA bundle is presented and trusted on the next connections without a restart.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerCredentials(
    const PeerTlsConfig& tls, bool require_client_certificate, absl::Duration reload_interval) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  if (tls.cert_file.empty()) {
    return absl::InvalidArgumentError(
        "cluster.tls.cert_file is empty; a daemon presents its certificate to its peers");
  }
  // The peer's certificate must name the host called (or cluster.tls.server_name, the channel's
  // target name override), as well as chain to the CA.
  return WatchedTlsChannelCredentials({.ca = {"cluster.tls.ca_file", tls.ca_file},
                                       .cert = {"cluster.tls.cert_file", tls.cert_file},
                                       .key = {"cluster.tls.key_file", tls.key_file},
                                       .cert_must_allow_client_auth = require_client_certificate},
                                      reload_interval);
}

}  // namespace

bool HealthCall::serving() const {
  return status.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

void RunHealthCalls(std::vector<std::unique_ptr<HealthCall>>& calls, absl::Duration timeout,
                    bool wait_for_ready) {
  if (calls.empty()) return;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(kHealthService);
  // A completion queue this thread drives (see Cluster's RunAll for why not the callback API).
  grpc::CompletionQueue cq;
  for (auto& c : calls) {
    c->context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    c->context.set_wait_for_ready(wait_for_ready);
    c->stub = grpc::health::v1::Health::NewStub(c->channel);
    c->reader = c->stub->PrepareAsyncCheck(&c->context, request, &cq);
    c->reader->StartCall();
    c->reader->Finish(&c->response, &c->status, c.get());
  }
  void* tag = nullptr;
  bool ok = false;
  // Bounded: every call has the deadline.
  for (size_t done = 0; done < calls.size() && cq.Next(&tag, &ok); ++done) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

MembershipOptions MembershipOptions::FromConfig(const DaemonConfig& config) {
  const ClusterConfig& c = config.cluster;
  MembershipOptions o;
  o.self = c.advertise;
  o.static_peers = c.peers;
  o.dns_name = c.dns_name;
  o.dns_port = c.dns_port;
  o.dns_refresh = absl::Seconds(c.dns_refresh_seconds);
  o.health_interval = absl::Seconds(c.health_interval_seconds);
  o.health_timeout = absl::Seconds(c.health_timeout_seconds);
  o.failures_before_down = c.failures_before_down;
  o.max_message_bytes = config.server.max_message_bytes;
  o.tls = c.tls;
  o.peers_require_client_certificate = !config.server.tls.client_ca_file.empty();
  o.tls_reload_interval = absl::Seconds(config.server.tls.reload_interval_seconds);
  return o;
}

bool LiveSet::Contains(const std::string& id) const {
  return std::any_of(nodes.begin(), nodes.end(),
                     [&id](const PlacementNode& n) { return n.id == id; });
}

absl::StatusOr<std::vector<std::string>> ResolvePeers(const std::string& name, uint32_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(name.c_str(), nullptr, &hints, &result);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("cluster.dns_name '", name,
                                               "' does not resolve: ", gai_strerror(rc)));
  }
  std::vector<std::string> peers;
  for (addrinfo* a = result; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, text,
                sizeof(text));
      peers.push_back(absl::StrCat(text, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                sizeof(text));
      peers.push_back(absl::StrCat("[", text, "]:", port));
    }
  }
  freeaddrinfo(result);
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

absl::StatusOr<std::unique_ptr<Membership>> Membership::Create(MembershipOptions options,
                                                               metrics::Registry* registry) {
  if (options.self.empty()) {
    return absl::InvalidArgumentError("cluster.advertise is empty: a node needs an id");
  }
  PROXIMA_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                           PeerCredentials(options.tls, options.peers_require_client_certificate,
                                           options.tls_reload_interval));
  std::unique_ptr<Membership> m(new Membership(std::move(options)));
  m->credentials_ = std::move(credentials);
  m->check_failures_ = registry->AddCounter(
      "proxima_cluster_health_check_failures_total",
      "Health checks of peers that failed (no answer in time, an error, or NOT_SERVING)");
  m->went_down_ = registry->AddCounter("proxima_cluster_peer_transitions_total",
                                       "Peers leaving or joining the live set", {{"to", "down"}});
  m->came_up_ = registry->AddCounter("proxima_cluster_peer_transitions_total",
                                     "Peers leaving or joining the live set", {{"to", "up"}});
  Membership* self = m.get();
  registry->AddGauge("proxima_cluster_live_nodes",
                     "Nodes in the live set placement runs on, this daemon included", {},
                     [self] { return static_cast<double>(self->Live()->nodes.size()); });
  registry->AddGauge("proxima_cluster_known_peers",
                     "Peers known from cluster.peers and cluster.dns_name, this daemon excluded",
                     {}, [self] { return static_cast<double>(self->KnownPeers().size()); });
  m->SetKnown({});
  return m;
}

Membership::~Membership() { Stop(); }

std::shared_ptr<grpc::Channel> Membership::NewChannel(const std::string& peer) const {
  // Blocks travel on these channels; a restarted peer is reconnected to about as often as it is
  // health-checked. The server name: peers advertised by address (a pod IP) whose certificates
  // name a shared DNS name instead.
  const grpc::ChannelArguments args =
      ProximaChannelArguments({.max_message_bytes = static_cast<int>(options_.max_message_bytes),
                               .max_reconnect_backoff = options_.health_interval,
                               .tls_server_name = options_.tls.server_name});
  return grpc::CreateCustomChannel(peer, credentials_, args);
}

void Membership::SetKnown(const std::vector<std::string>& dns_peers) {
  std::vector<std::string> known = options_.static_peers;
  known.insert(known.end(), dns_peers.begin(), dns_peers.end());
  std::vector<std::pair<std::string, bool>> gone;
  {
    proxima::MutexLock lock(&mu_);
    absl::flat_hash_map<std::string, Peer> next;
    for (const std::string& id : known) {
      if (id == options_.self || next.contains(id)) continue;
      auto it = peers_.find(id);
      if (it != peers_.end()) {
        next.emplace(id, std::move(it->second));
      } else {
        next.emplace(id, Peer{NewChannel(id), 0, false});
      }
    }
    for (const auto& [id, peer] : peers_) {
      if (!next.contains(id) && peer.live) gone.emplace_back(id, false);
    }
    peers_ = std::move(next);
    Publish();
  }
  ReportChanges(gone, "no longer in cluster.peers or DNS");
}

void Membership::Publish() {
  auto live = std::make_shared<LiveSet>();
  live->nodes.push_back({options_.self, 1.0});
  for (const auto& [id, peer] : peers_) {
    if (peer.live) live->nodes.push_back({id, 1.0});
  }
  std::sort(live->nodes.begin(), live->nodes.end(),
            [](const PlacementNode& a, const PlacementNode& b) { return a.id < b.id; });
  for (size_t i = 0; i < live->nodes.size(); ++i) {
    if (live->nodes[i].id == options_.self) live->self = i;
  }
  live_ = std::move(live);
}

std::shared_ptr<const LiveSet> Membership::Live() const {
  proxima::MutexLock lock(&mu_);
  return live_;
}

std::vector<std::string> Membership::KnownPeers() const {
  std::vector<std::string> out;
  {
    proxima::MutexLock lock(&mu_);
    for (const auto& [id, peer] : peers_) out.push_back(id);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<Membership::PeerState> Membership::Peers() const {
  std::vector<PeerState> out;
  {
    proxima::MutexLock lock(&mu_);
    for (const auto& [id, peer] : peers_) {
      out.push_back({id, peer.live, peer.failures, peer.last_error});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const PeerState& a, const PeerState& b) { return a.id < b.id; });
  return out;
}

std::shared_ptr<grpc::Channel> Membership::Channel(const std::string& peer) {
  proxima::MutexLock lock(&mu_);
  auto it = peers_.find(peer);
  if (it != peers_.end()) return it->second.channel;
  return NewChannel(peer);  // not (or no longer) known: a channel for this call only
}

void Membership::CheckOnce() {
  std::vector<std::unique_ptr<HealthCall>> checks;
  std::vector<uint64_t> epochs;  // of each check's peer when it started
  {
    proxima::MutexLock lock(&mu_);
    for (const auto& [id, peer] : peers_) {
      auto c = std::make_unique<HealthCall>();
      c->id = id;
      c->channel = peer.channel;
      checks.push_back(std::move(c));
      epochs.push_back(peer.epoch);
    }
  }
  if (checks.empty()) return;
  // Wait (until the deadline) for a connection rather than fail at once while the channel
  // backs off after a failure: a restarted peer rejoins on the first round it answers.
  RunHealthCalls(checks, options_.health_timeout, /*wait_for_ready=*/true);
  std::vector<std::pair<std::string, bool>> changes;
  std::vector<const HealthCall*> to_explain;  // failed checks whose cause is looked into
  {
    proxima::MutexLock lock(&mu_);
    for (size_t i = 0; i < checks.size(); ++i) {
      const auto& c = checks[i];
      auto it = peers_.find(c->id);
      if (it == peers_.end()) continue;  // dropped by DNS meanwhile
      Peer& peer = it->second;
      // It said it is leaving since: an answer from before says nothing of the next process.
      if (peer.epoch != epochs[i]) continue;
      if (c->serving()) {
        peer.failures = 0;
        peer.last_error.clear();
        peer.said_leaving = false;
        if (!peer.live) {
          peer.live = true;
          changes.emplace_back(c->id, true);
        }
        continue;
      }
      check_failures_->Increment();
      ++peer.failures;
      // At the 1st, 2nd, 4th, 8th... failure of a run: often enough to see a cause change (a
      // peer that was down now fails TLS), rarely enough to cost nothing for a long-dead peer.
      // Not for a peer that said it is leaving: its checks fail until it is back, as expected.
      if (!peer.said_leaving && (peer.failures & (peer.failures - 1)) == 0) {
        to_explain.push_back(c.get());
      }
      if (peer.live && peer.failures >= options_.failures_before_down) {
        peer.live = false;
        changes.emplace_back(c->id, false);
      }
    }
    if (!changes.empty()) Publish();
  }
  // Logged when the cause changes, not every round: a peer that stays unreachable (down, or
  // refused by TLS) is reported once per cause, then only counted.
  std::vector<std::pair<std::string, std::string>> reasons = ExplainFailures(to_explain);
  {
    proxima::MutexLock lock(&mu_);
    for (auto& [id, reason] : reasons) {
      auto it = peers_.find(id);
      if (it == peers_.end() || it->second.last_error == reason) {
        reason.clear();  // reported already
      } else {
        it->second.last_error = reason;
      }
    }
  }
  for (const auto& [id, reason] : reasons) {
    if (reason.empty()) continue;
    PROXIMA_LOG(kWarning) << "peer health check failed" << log::Kv("peer", id)
                          << log::Kv("error", reason)
                          << log::Kv("tls", options_.tls.enabled() ? "on" : "off");
  }
  ReportChanges(changes, "failed its health checks");
}

absl::Status Membership::MarkLeft(const std::string& peer) {
  std::vector<std::pair<std::string, bool>> changes;
  {
    proxima::MutexLock lock(&mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) {
      return absl::NotFoundError(absl::StrCat(
          "node '", peer, "' is not a peer of this daemon (cluster.peers, cluster.dns_name)"));
    }
    Peer& p = it->second;
    ++p.epoch;
    p.last_error = "said it is shutting down";
    p.said_leaving = true;
    if (p.live) {
      p.live = false;
      changes.emplace_back(peer, false);
      Publish();
    }
  }
  ReportChanges(changes, "said it is shutting down");
  return absl::OkStatus();
}

void Membership::ReportChanges(const std::vector<std::pair<std::string, bool>>& changes,
                               const char* why_left) {
  for (const auto& [id, live] : changes) {
    (live ? came_up_ : went_down_)->Increment();
    if (live) {
      PROXIMA_LOG(kInfo) << "peer joined the live set" << log::Kv("peer", id);
    } else {
      PROXIMA_LOG(kInfo) << "peer left the live set" << log::Kv("peer", id)
                         << log::Kv("reason", why_left);
    }
    if (on_change_) on_change_(id, live);
  }
}

std::vector<std::pair<std::string, std::string>> Membership::ExplainFailures(
    const std::vector<const HealthCall*>& failed) const {
  // A check waits for a connection until its deadline, so a peer that cannot be connected to
  // (refused, or a TLS handshake that failed: an untrusted certificate, a wrong name, no client
  // certificate for an mTLS peer) ends in DEADLINE_EXCEEDED, which says nothing; and the peer's
  // channel keeps reporting the error that first put it in TRANSIENT_FAILURE. A fresh channel
  // that does not wait fails with the error of this very connection attempt. Only for channels
  // that failed to connect: a peer that accepts connections but never answers would keep the
  // probe until its deadline too, and a round must cost one health timeout.
  std::vector<std::unique_ptr<HealthCall>> probes;
  std::vector<const HealthCall*> probe_of(failed.size(), nullptr);  // by index in `failed`
  for (size_t i = 0; i < failed.size(); ++i) {
    const HealthCall& c = *failed[i];
    if (c.status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED ||
        c.channel->GetState(false) != GRPC_CHANNEL_TRANSIENT_FAILURE) {
      continue;
    }
    auto probe = std::make_unique<HealthCall>();
    probe->id = c.id;
    probe->channel = NewChannel(c.id);
    probe_of[i] = probe.get();
    probes.push_back(std::move(probe));
  }
  RunHealthCalls(probes, options_.health_timeout, /*wait_for_ready=*/false);
  std::vector<std::pair<std::string, std::string>> reasons;
  for (size_t i = 0; i < failed.size(); ++i) {
    const HealthCall* c = failed[i];
    std::string reason =
        c->status.ok() ? "answered NOT_SERVING (draining)"
                       : absl::StrCat("gRPC code ", c->status.error_code(), ": ",
                                      c->status.error_message());
    if (const HealthCall* probe = probe_of[i]; probe != nullptr) {
      if (probe->status.error_code() == grpc::StatusCode::UNAVAILABLE) {
        reason = absl::StrCat("cannot connect: ", probe->status.error_message());
        // What an mTLS peer that refuses this daemon's client certificate looks like from here.
        if (options_.tls.enabled() && (absl::StrContains(reason, "Socket closed") ||
                                       absl::StrContains(reason, "reset by peer"))) {
          absl::StrAppend(&reason,
                          " (with TLS: does the peer's server.tls.client_ca_file trust this "
                          "daemon's cluster.tls.cert_file?)");
        }
      }
    }
    reasons.emplace_back(c->id, std::move(reason));
  }
  return reasons;
}

void Membership::ResolveOnce() {
  if (options_.dns_name.empty()) return;
  absl::StatusOr<std::vector<std::string>> peers =
      ResolvePeers(options_.dns_name, options_.dns_port);
  if (!peers.ok()) {
    PROXIMA_LOG(kWarning) << "DNS resolution failed; keeping the previous peers"
                          << log::Kv("error", peers.status().message());
    return;
  }
  SetKnown(*peers);
}

void Membership::Start() {
  ResolveOnce();
  checker_ = std::thread([this] { RunChecker(); });
  if (!options_.dns_name.empty()) resolver_ = std::thread([this] { RunResolver(); });
  PROXIMA_LOG(kInfo) << "cluster membership started" << log::Kv("self", options_.self)
                     << log::Kv("known_peers", KnownPeers().size())
                     << log::Kv("peer_tls", !options_.tls.enabled() ? std::string("off")
                                            : options_.tls.server_name.empty()
                                                ? std::string("on")
                                                : "on, checking " + options_.tls.server_name);
}

void Membership::Stop() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (checker_.joinable()) checker_.join();
  if (resolver_.joinable()) resolver_.join();
}

void Membership::RunChecker() {
  while (true) {
    const absl::Time next = absl::Now() + options_.health_interval;
    CheckOnce();
    std::unique_lock<std::mutex> lock(stop_mu_);
    if (stop_cv_.wait_until(lock, absl::ToChronoTime(next), [this] { return stopping_; })) return;
  }
}

void Membership::RunResolver() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(stop_mu_);
      if (stop_cv_.wait_until(lock, absl::ToChronoTime(absl::Now() + options_.dns_refresh),
                              [this] { return stopping_; })) {
        return;
      }
    }
    ResolveOnce();
  }
}

}  // namespace proxima::daemon::cluster
