#include "daemon/cluster/membership.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace proxima::daemon::cluster {
namespace {

constexpr char kHealthService[] = "proxima.v1.KVTier";

}  // namespace

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
  std::unique_ptr<Membership> m(new Membership(std::move(options)));
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
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 4 << 20);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  // gRPC's default reconnect backoff grows to 2 minutes: a restarted peer would stay unreachable
  // long after it serves again. Retry about as often as it is health-checked.
  const int backoff_ms =
      std::max(100, static_cast<int>(absl::ToInt64Milliseconds(options_.health_interval)));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, backoff_ms);
  // A separate connection per peer channel even when two point at the same address.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(peer, grpc::InsecureChannelCredentials(), args);
}

void Membership::SetKnown(const std::vector<std::string>& dns_peers) {
  std::vector<std::string> known = options_.static_peers;
  known.insert(known.end(), dns_peers.begin(), dns_peers.end());
  std::vector<std::string> gone;
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
      if (!next.contains(id) && peer.live) gone.push_back(id);
    }
    peers_ = std::move(next);
    Publish();
  }
  for (const std::string& id : gone) {
    PROXIMA_LOG(kInfo) << "peer no longer in cluster.peers or DNS; left the live set"
                       << log::Kv("peer", id);
    if (on_change_) on_change_(id, false);
  }
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

std::shared_ptr<grpc::Channel> Membership::Channel(const std::string& peer) {
  proxima::MutexLock lock(&mu_);
  auto it = peers_.find(peer);
  if (it != peers_.end()) return it->second.channel;
  return NewChannel(peer);  // not (or no longer) known: a channel for this call only
}

void Membership::CheckOnce() {
  struct Check {
    std::string id;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<grpc::health::v1::Health::Stub> stub;
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckResponse response;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<grpc::health::v1::HealthCheckResponse>>
        reader;
  };
  std::vector<std::unique_ptr<Check>> checks;
  {
    proxima::MutexLock lock(&mu_);
    for (const auto& [id, peer] : peers_) {
      auto c = std::make_unique<Check>();
      c->id = id;
      c->channel = peer.channel;
      checks.push_back(std::move(c));
    }
  }
  if (checks.empty()) return;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(kHealthService);
  // A completion queue this thread drives (see Cluster's RunAll for why not the callback API).
  grpc::CompletionQueue cq;
  for (auto& c : checks) {
    c->context.set_deadline(absl::ToChronoTime(absl::Now() + options_.health_timeout));
    // Wait (until the deadline) for a connection rather than fail at once while the channel
    // backs off after a failure: a restarted peer rejoins on the first round it answers.
    c->context.set_wait_for_ready(true);
    c->stub = grpc::health::v1::Health::NewStub(c->channel);
    c->reader = c->stub->PrepareAsyncCheck(&c->context, request, &cq);
    c->reader->StartCall();
    c->reader->Finish(&c->response, &c->status, c.get());
  }
  void* tag = nullptr;
  bool ok = false;
  // Bounded: every check has the health_timeout deadline.
  for (size_t done = 0; done < checks.size() && cq.Next(&tag, &ok); ++done) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  std::vector<std::pair<std::string, bool>> changes;
  {
    proxima::MutexLock lock(&mu_);
    for (const auto& c : checks) {
      auto it = peers_.find(c->id);
      if (it == peers_.end()) continue;  // dropped by DNS meanwhile
      Peer& peer = it->second;
      const bool ok = c->status.ok() &&
                      c->response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
      if (ok) {
        peer.failures = 0;
        if (!peer.live) {
          peer.live = true;
          changes.emplace_back(c->id, true);
        }
        continue;
      }
      check_failures_->Increment();
      ++peer.failures;
      if (peer.live && peer.failures >= options_.failures_before_down) {
        peer.live = false;
        changes.emplace_back(c->id, false);
      }
    }
    if (!changes.empty()) Publish();
  }
  for (const auto& [id, live] : changes) {
    (live ? came_up_ : went_down_)->Increment();
    PROXIMA_LOG(kInfo) << (live ? "peer joined the live set" : "peer left the live set")
                       << log::Kv("peer", id);
    if (on_change_) on_change_(id, live);
  }
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
                     << log::Kv("known_peers", KnownPeers().size());
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
