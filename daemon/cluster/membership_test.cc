#include "daemon/cluster/membership.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/testing/metric_value.h"
#include "common/testing/slow_link.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proxima/v1/kvtier.grpc.pb.h"

namespace proxima::daemon::cluster {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;

// A real gRPC server on loopback serving only the standard health service, as proximad does.
class HealthServer {
 public:
  explicit HealthServer(int port = 0) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(),
                             &port_);
    // gRPC will not start a server without a service of its own; every method is UNIMPLEMENTED.
    builder.RegisterService(&unimplemented_);
    server_ = builder.BuildAndStart();
    if (server_ != nullptr) SetServing(true);
  }
  ~HealthServer() { Stop(); }
  bool ok() const { return server_ != nullptr && port_ > 0; }
  int port() const { return port_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  void SetServing(bool serving) {
    server_->GetHealthCheckService()->SetServingStatus("proxima.v1.KVTier", serving);
  }
  void Stop() {
    if (server_ == nullptr) return;
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
    server_.reset();
  }

 private:
  int port_ = 0;
  v1::KVTier::CallbackService unimplemented_;
  std::unique_ptr<grpc::Server> server_;
};

std::vector<std::string> LiveIds(const Membership& m) {
  std::vector<std::string> ids;
  for (const PlacementNode& n : m.Live()->nodes) ids.push_back(n.id);
  return ids;
}

double Metric(const metrics::Registry& registry, const std::string& series) {
  return proxima::testing::MetricValue(registry.RenderText(), series);
}

MembershipOptions Options(std::vector<std::string> peers, uint32_t failures = 3) {
  MembershipOptions o;
  o.self = "127.0.0.1:1";  // this test's node id; never dialled
  o.static_peers = std::move(peers);
  // Generous: a check of a live local server must not time out on a slow machine (aarch64 under
  // qemu in CI). Tests of a peer that never answers set their own, shorter deadline.
  o.health_timeout = absl::Seconds(1);
  o.failures_before_down = failures;
  return o;
}

TEST(MembershipTest, PeersJoinLeaveAfterNFailuresAndRejoin) {
  HealthServer a, b;
  ASSERT_TRUE(a.ok() && b.ok());
  metrics::Registry registry;
  ASSERT_OK_AND_ASSIGN(auto m, Membership::Create(
                                   Options({"127.0.0.1:1", a.address(), b.address()}), &registry));
  std::vector<std::pair<std::string, bool>> changes;
  m->OnChange([&changes](const std::string& peer, bool live) { changes.emplace_back(peer, live); });
  // Self is always live; peers join only once they have answered.
  EXPECT_THAT(LiveIds(*m), ElementsAre("127.0.0.1:1"));
  EXPECT_EQ(m->KnownPeers().size(), 2u);  // self is not a peer of itself
  m->CheckOnce();
  EXPECT_EQ(m->Live()->nodes.size(), 3u);
  EXPECT_TRUE(m->Live()->Contains(b.address()));
  EXPECT_EQ(Metric(registry, "proxima_cluster_live_nodes"), 3);
  const int b_port = b.port();
  b.Stop();
  m->CheckOnce();
  m->CheckOnce();
  EXPECT_TRUE(m->Live()->Contains(b.address())) << "left before failures_before_down";
  m->CheckOnce();
  EXPECT_FALSE(m->Live()->Contains(b.address()));
  EXPECT_TRUE(m->Live()->Contains(a.address()));
  EXPECT_EQ(Metric(registry, "proxima_cluster_live_nodes"), 2);
  EXPECT_EQ(Metric(registry, "proxima_cluster_health_check_failures_total"), 3);
  EXPECT_EQ(Metric(registry, "proxima_cluster_peer_transitions_total{to=\"down\"}"), 1);
  // The same address serves again: the peer rejoins on its first success.
  HealthServer b2(b_port);
  ASSERT_TRUE(b2.ok());
  // Within the channel's reconnect backoff (at most health_interval), a round or a few.
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  do {
    m->CheckOnce();
  } while (!m->Live()->Contains(b2.address()) && absl::Now() < deadline &&
           (absl::SleepFor(absl::Milliseconds(20)), true));
  EXPECT_TRUE(m->Live()->Contains(b2.address()));
  EXPECT_EQ(Metric(registry, "proxima_cluster_live_nodes"), 3);
  EXPECT_THAT(changes, Contains(Pair(b2.address(), false)));
  EXPECT_EQ(changes.back(), std::make_pair(b2.address(), true));
}

TEST(MembershipTest, NotServingIsAFailure) {
  HealthServer a;
  ASSERT_TRUE(a.ok());
  metrics::Registry registry;
  ASSERT_OK_AND_ASSIGN(auto m, Membership::Create(Options({a.address()}, 1), &registry));
  m->CheckOnce();
  EXPECT_TRUE(m->Live()->Contains(a.address()));
  a.SetServing(false);  // a draining proximad answers NOT_SERVING
  m->CheckOnce();
  EXPECT_FALSE(m->Live()->Contains(a.address()));
}

// A listening socket that never speaks HTTP/2: connections are accepted by the kernel, and
// every health check of it ends at its deadline.
class SilentListener {
 public:
  SilentListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(fd_, 16) != 0 || getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return;
    }
    address_ = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  }
  ~SilentListener() {
    if (fd_ >= 0) close(fd_);
  }
  bool ok() const { return !address_.empty(); }
  const std::string& address() const { return address_; }

 private:
  int fd_ = -1;
  std::string address_;
};

TEST(MembershipTest, APeerThatNeverAnswersCostsOneTimeoutPerRound) {
  SilentListener silent;
  ASSERT_TRUE(silent.ok());
  HealthServer a;
  ASSERT_TRUE(a.ok());
  metrics::Registry registry;
  MembershipOptions o = Options({silent.address(), a.address()});
  o.health_timeout = absl::Milliseconds(300);
  ASSERT_OK_AND_ASSIGN(auto m, Membership::Create(o, &registry));
  for (int round = 0; round < 2; ++round) {
    const absl::Time start = absl::Now();
    m->CheckOnce();
    const absl::Duration took = absl::Now() - start;
    EXPECT_LT(took, absl::Milliseconds(300 + 400)) << "round " << round;
  }
  EXPECT_FALSE(m->Live()->Contains(silent.address()));
  EXPECT_TRUE(m->Live()->Contains(a.address()));
}

// A peer a round trip of 1.2 s away (another region, a congested link): connecting to it takes
// longer than the channel's reconnect backoff (at most health_interval). gRPC gives a connection
// attempt max(backoff, GRPC_ARG_MIN_RECONNECT_BACKOFF_MS); set to 100 ms, the attempt was given up
// before the peer's first HTTP/2 frame arrived, every time, and the peer was never live.
TEST(MembershipTest, APeerWhoseConnectionTakesLongerThanTheBackoffJoins) {
  HealthServer a;
  ASSERT_TRUE(a.ok());
  proxima::testing::SlowLink link(a.port(), std::chrono::milliseconds(600));
  ASSERT_TRUE(link.ok());
  metrics::Registry registry;
  MembershipOptions o = Options({link.address()});
  o.health_interval = absl::Milliseconds(200);
  o.health_timeout = absl::Seconds(5);
  ASSERT_OK_AND_ASSIGN(auto m, Membership::Create(o, &registry));
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  do {
    m->CheckOnce();
  } while (!m->Live()->Contains(link.address()) && absl::Now() < deadline &&
           (absl::SleepFor(absl::Milliseconds(200)), true));
  EXPECT_TRUE(m->Live()->Contains(link.address()))
      << link.connections() << " connection attempts over the slow link";
}

TEST(MembershipTest, APeerThatSaysItIsLeavingLeavesAtOnceAndRejoinsOnItsNextCheck) {
  HealthServer a, b;
  ASSERT_TRUE(a.ok() && b.ok());
  metrics::Registry registry;
  ASSERT_OK_AND_ASSIGN(auto m, Membership::Create(Options({a.address(), b.address()}), &registry));
  std::vector<std::pair<std::string, bool>> changes;
  m->OnChange([&changes](const std::string& peer, bool live) { changes.emplace_back(peer, live); });
  m->CheckOnce();
  ASSERT_EQ(m->Live()->nodes.size(), 3u);
  changes.clear();
  ASSERT_OK(m->MarkLeft(a.address()));
  EXPECT_FALSE(m->Live()->Contains(a.address()));
  EXPECT_TRUE(m->Live()->Contains(b.address()));
  EXPECT_THAT(changes, ElementsAre(Pair(a.address(), false)));
  EXPECT_EQ(Metric(registry, "proxima_cluster_peer_transitions_total{to=\"down\"}"), 1);
  // Saying it twice changes nothing more.
  ASSERT_OK(m->MarkLeft(a.address()));
  EXPECT_EQ(changes.size(), 1u);
  EXPECT_THAT(m->MarkLeft("127.0.0.1:9"),
              ::proxima::testing::StatusIs(absl::StatusCode::kNotFound,
                                           HasSubstr("'127.0.0.1:9' is not a peer")));
  std::vector<Membership::PeerState> peers = m->Peers();
  ASSERT_EQ(peers.size(), 2u);
  const bool a_first = peers[0].id == a.address();
  EXPECT_FALSE(peers[a_first ? 0 : 1].live);
  EXPECT_EQ(peers[a_first ? 0 : 1].last_error, "said it is shutting down");
  EXPECT_TRUE(peers[a_first ? 1 : 0].live);
  EXPECT_EQ(peers[a_first ? 1 : 0].last_error, "");
  // The next process at that address answers its checks: back at once.
  m->CheckOnce();
  EXPECT_TRUE(m->Live()->Contains(a.address()));
  EXPECT_EQ(changes.back(), std::make_pair(a.address(), true));
  // One that is gone after it said so fails its checks quietly, keeping its reason.
  ASSERT_OK(m->MarkLeft(b.address()));
  b.Stop();
  m->CheckOnce();
  for (const Membership::PeerState& peer : m->Peers()) {
    if (peer.id != b.address()) continue;
    EXPECT_FALSE(peer.live);
    EXPECT_EQ(peer.failures, 1u);
    EXPECT_EQ(peer.last_error, "said it is shutting down");
  }
}

TEST(MembershipTest, AnAnswerFromBeforeAPeerLeftDoesNotBringItBack) {
  // A round of checks lasts until its silent peer's deadline (1 s); `a` answers SERVING at once,
  // then says it is leaving while the round still runs. That answer came from the process on its
  // way out: `a` stays out until a check that starts after the leave.
  SilentListener silent;
  HealthServer a;
  ASSERT_TRUE(silent.ok() && a.ok());
  metrics::Registry registry;
  MembershipOptions o = Options({silent.address(), a.address()});
  o.health_timeout = absl::Seconds(1);
  ASSERT_OK_AND_ASSIGN(auto m, Membership::Create(o, &registry));
  m->CheckOnce();
  ASSERT_TRUE(m->Live()->Contains(a.address()));
  std::thread round([&m] { m->CheckOnce(); });
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_OK(m->MarkLeft(a.address()));
  round.join();
  EXPECT_FALSE(m->Live()->Contains(a.address()));
  m->CheckOnce();
  EXPECT_TRUE(m->Live()->Contains(a.address()));
}

TEST(MembershipTest, DnsRecordsArePeersAndTheBackgroundThreadsCheckThem) {
  HealthServer a;
  ASSERT_TRUE(a.ok());
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> records, ResolvePeers("localhost", a.port()));
  EXPECT_THAT(records, Contains(a.address()));
  EXPECT_THAT(ResolvePeers("no-such-name.invalid", 1),
              ::proxima::testing::StatusIs(absl::StatusCode::kUnavailable,
                                           HasSubstr("no-such-name.invalid")));
  metrics::Registry registry;
  MembershipOptions o = Options({});
  o.dns_name = "localhost";
  o.dns_port = static_cast<uint32_t>(a.port());
  o.health_interval = absl::Milliseconds(50);
  o.health_timeout = absl::Milliseconds(40);
  ASSERT_OK_AND_ASSIGN(auto m, Membership::Create(o, &registry));
  EXPECT_THAT(m->KnownPeers(), IsEmpty());
  m->Start();
  EXPECT_THAT(m->KnownPeers(), Contains(a.address()));
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!m->Live()->Contains(a.address()) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(m->Live()->Contains(a.address()));
  m->Stop();
}

TEST(LiveSetTest, NodesAreSortedSoEveryDaemonRanksThemAlike) {
  HealthServer a, b;
  ASSERT_TRUE(a.ok() && b.ok());
  metrics::Registry r1, r2;
  MembershipOptions o1 = Options({b.address(), a.address()});
  MembershipOptions o2 = Options({a.address(), b.address()});
  o2.self = "127.0.0.1:1";
  ASSERT_OK_AND_ASSIGN(auto m1, Membership::Create(o1, &r1));
  ASSERT_OK_AND_ASSIGN(auto m2, Membership::Create(o2, &r2));
  // One round may see a health answer time out on a slow machine (qemu): check until each
  // membership holds itself and both servers, then compare the order.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  do {
    m1->CheckOnce();
    m2->CheckOnce();
  } while ((LiveIds(*m1).size() < 3 || LiveIds(*m2).size() < 3) && absl::Now() < deadline);
  ASSERT_EQ(LiveIds(*m1).size(), 3u);
  EXPECT_EQ(LiveIds(*m1), LiveIds(*m2));
  std::vector<std::string> ids = LiveIds(*m1);
  EXPECT_TRUE(std::is_sorted(ids.begin(), ids.end()));
  EXPECT_EQ(m1->Live()->id(m1->Live()->self), "127.0.0.1:1");
}

}  // namespace
}  // namespace proxima::daemon::cluster
