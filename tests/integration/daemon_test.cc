// Integration tests: the real proximad binary on loopback, driven through libproxima, raw gRPC
// stubs and proximactl.
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/crc32c.h"
#include "common/testing/status_matchers.h"
#include "common/testing/tmpfs.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_blocks.h"

namespace proxima {
namespace {

using ::proxima::client::BlockKey;
using ::proxima::client::Client;
using ::proxima::client::ClientOptions;
using ::proxima::client::Profile;
using ::proxima::client::PutOutcome;
using ::proxima::testing::DaemonProcess;
using ::proxima::testing::IsOkAndHolds;
using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using ::proxima::testing::Blocks;
using ::proxima::testing::GetAndCheck;
using ::proxima::testing::MakeBlocks;
using ::proxima::testing::MetricValue;
using ::proxima::testing::MustConnect;
using ::proxima::testing::TestModel;

TEST(DaemonIntegrationTest, RoundTripsAreByteExactOverTcpAndUnixSocket) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start());
  for (const std::string& target : {daemon->tcp_target(), daemon->unix_target()}) {
    SCOPED_TRACE(target);
    auto c = MustConnect(target);
    ASSERT_NE(c, nullptr);
    ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
    EXPECT_EQ(p.block_bytes, 256u << 10);
    uint64_t seed = target.size();  // a different chain per transport
    Blocks b = MakeBlocks(seed, 0, 24, p.block_bytes);
    ASSERT_OK_AND_ASSIGN(auto outcomes, c->Put(p, b.keys, b.spans()));
    EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
    EXPECT_EQ(GetAndCheck(*c, p, seed, 0, 24), 24u);
    ASSERT_OK_AND_ASSIGN(outcomes, c->Put(p, b.keys, b.spans()));
    EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kAlreadyPresent));
  }
}

// Opens `n` TCP connections to 127.0.0.1:`port` that say nothing (the server holds each until
// its handshake times out); returns their descriptors.
std::vector<int> HoldConnections(int port, int n) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) break;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      break;
    }
    fds.push_back(fd);
  }
  return fds;
}

// gRPC 1.51's TCP listener accepts nothing more, until a restart, once one accept finds the
// open-file limit reached (daemon/file_limit.h). A daemon started with a soft limit of 96 under a
// hard one of 8192 (systemd's and containerd's 1024 under 512Ki, scaled down) raises the soft one
// at start, so 300 idle connections held open at once leave its TCP listener serving: a client
// that connects over TCP while they are open, and one after they close, put and get byte-exact.
TEST(DaemonIntegrationTest, ALowSoftOpenFileLimitIsRaisedSoAFloodOfConnectionsLeavesTcpServing) {
  ASSERT_OK_AND_ASSIGN(auto daemon,
                       DaemonProcess::Start({}, {"/usr/bin/prlimit", "--nofile=96:8192", "--"}));
  EXPECT_THAT(daemon->Log(), HasSubstr("raised the open-file limit (RLIMIT_NOFILE) to the hard "
                                       "limit from=96 to=8192"));
  std::ifstream limits(absl::StrCat("/proc/", daemon->pid(), "/limits"));
  std::string line;
  bool seen = false;
  while (std::getline(limits, line)) {
    if (!line.starts_with("Max open files")) continue;
    seen = true;
    EXPECT_THAT(std::vector<std::string>(absl::StrSplit(line, ' ', absl::SkipEmpty())),
                ::testing::ElementsAre("Max", "open", "files", "8192", "8192", "files"));
  }
  EXPECT_TRUE(seen);

  std::vector<int> held = HoldConnections(daemon->tcp_port(), 300);
  absl::Cleanup close_held = [&] {
    for (int fd : held) close(fd);
  };
  ASSERT_EQ(held.size(), 300u);
  for (uint64_t seed : {41, 42}) {
    SCOPED_TRACE(seed == 41 ? "while 300 connections are open" : "after they closed");
    auto c = MustConnect(daemon->tcp_target());
    ASSERT_NE(c, nullptr);
    ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
    Blocks b = MakeBlocks(seed, 0, 4, p.block_bytes);
    ASSERT_OK(c->Put(p, b.keys, b.spans()).status());
    EXPECT_EQ(GetAndCheck(*c, p, seed, 0, 4), 4u);
    if (seed == 41) {
      ASSERT_OK_AND_ASSIGN(std::string metrics, daemon->ScrapeMetrics());
      EXPECT_GT(MetricValue(metrics, "process_open_fds"), 300);
      EXPECT_EQ(MetricValue(metrics, "process_max_fds"), 8192);
      for (int fd : held) close(fd);
      held.clear();
    }
  }
  EXPECT_THAT(daemon->Log(), ::testing::Not(HasSubstr("Failed accept4")));
}

// CPU time (user + system) the process `pid` has used, in clock ticks; -1 when unreadable.
int64_t CpuTicks(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces), from field 3: utime and stime are
  // fields 14 and 15.
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(paren + 2), ' ');
  int64_t user = 0;
  int64_t system = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &user) ||
      !absl::SimpleAtoi(fields[12], &system)) {
    return -1;
  }
  return user + system;
}

// Out of file descriptors (a hard limit of 64 it cannot raise, and 100 idle connections), the
// metrics endpoint's accepts fail: the daemon pauses them instead of spinning on the readable
// listener (it used a whole core, 301 ticks in 3 s, before), and serves scrapes again once
// descriptors are free.
TEST(DaemonIntegrationTest, OutOfDescriptorsTheMetricsListenerWaitsInsteadOfSpinning) {
  ASSERT_OK_AND_ASSIGN(auto daemon,
                       DaemonProcess::Start({}, {"/usr/bin/prlimit", "--nofile=64:64", "--"}));
  std::vector<int> held = HoldConnections(daemon->tcp_port(), 100);
  absl::Cleanup close_held = [&] {
    for (int fd : held) close(fd);
  };
  ASSERT_EQ(held.size(), 100u);
  // The kernel completes those connections; gRPC accepts them after, on a thread of its own.
  // Only once it ran out (its accept failed) is the metrics listener sure to find no
  // descriptor: connected before, a scrape could take one first (a flake in a loaded ctest run).
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!absl::StrContains(daemon->Log(), "Failed accept4: Too many open files") &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_THAT(daemon->Log(), HasSubstr("Failed accept4: Too many open files"));
  std::vector<int> waiting = HoldConnections(daemon->metrics_port(), 1);
  ASSERT_EQ(waiting.size(), 1u);
  const std::string get = "GET /metrics HTTP/1.1\r\n\r\n";
  ASSERT_EQ(send(waiting[0], get.data(), get.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(get.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int64_t before = CpuTicks(daemon->pid());
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const int64_t used = CpuTicks(daemon->pid()) - before;
  ASSERT_GE(before, 0);
  EXPECT_LT(used, sysconf(_SC_CLK_TCK) / 2) << "ticks used in 2 s, out of descriptors";
  EXPECT_THAT(daemon->Log(), HasSubstr("metrics: cannot accept a connection now error=\"Too "
                                       "many open files\""));
  for (int fd : held) close(fd);
  held.clear();
  // The waiting scrape is answered once descriptors are free.
  timeval timeout{10, 0};
  setsockopt(waiting[0], SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  std::string answer;
  char buf[4096];
  ssize_t n;
  while ((n = recv(waiting[0], buf, sizeof(buf), 0)) > 0) answer.append(buf, n);
  close(waiting[0]);
  EXPECT_THAT(answer, HasSubstr("process_max_fds 64"));
}

// A hard limit too low for server.max_connections (1024 by default) plus room for the rest is
// said at start.
TEST(DaemonIntegrationTest, AnOpenFileLimitWithLittleRoomIsWarnedAboutAtStart) {
  ASSERT_OK_AND_ASSIGN(auto daemon,
                       DaemonProcess::Start({}, {"/usr/bin/prlimit", "--nofile=512:512", "--"}));
  EXPECT_THAT(daemon->Log(), AllOf(HasSubstr("the open-file limit leaves little room"),
                                   HasSubstr("open_file_limit=512 max_connections=1024")));
  ASSERT_OK_AND_ASSIGN(std::string metrics, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "process_max_fds"), 512);
}

TEST(DaemonIntegrationTest, LookupCountsLeadingPresentBlocks) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start());
  auto c = MustConnect(daemon->unix_target());
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  Blocks first5 = MakeBlocks(7, 0, 5, p.block_bytes);
  ASSERT_OK(c->Put(p, first5.keys, first5.spans()).status());
  Blocks seventh = MakeBlocks(7, 6, 1, p.block_bytes);
  ASSERT_OK(c->Put(p, seventh.keys, seventh.spans()).status());
  std::vector<BlockKey> chain = client::TestKeyChain(7, 0, 10);
  EXPECT_THAT(c->Lookup(p, chain), IsOkAndHolds(5u));  // block 5 missing: stops there
  EXPECT_THAT(c->Lookup(p, std::span(chain).first(3)), IsOkAndHolds(3u));
  EXPECT_THAT(c->Lookup(p, client::TestKeyChain(8, 0, 4)), IsOkAndHolds(0u));
  ASSERT_OK_AND_ASSIGN(size_t deleted, c->Delete(p, std::span(chain).subspan(2, 1)));
  EXPECT_EQ(deleted, 1u);
  EXPECT_THAT(c->Lookup(p, chain), IsOkAndHolds(2u));
  // Another model's profile does not see these blocks even with the same keys.
  ASSERT_OK_AND_ASSIGN(Profile other, c->RegisterProfile(TestModel(16, "another-model")));
  EXPECT_THAT(c->Lookup(other, chain), IsOkAndHolds(0u));
}

TEST(DaemonIntegrationTest, EvictsAtCapacityAndNeverGoesAbove) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start({"tiers.host.capacity_bytes=4MiB"}));
  auto c = MustConnect(daemon->tcp_target());
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));  // 256 KiB: 16 fit
  for (size_t round = 0; round < 5; ++round) {
    Blocks b = MakeBlocks(1, round * 8, 8, p.block_bytes);
    ASSERT_OK_AND_ASSIGN(auto outcomes, c->Put(p, b.keys, b.spans()));
    EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
    ASSERT_OK_AND_ASSIGN(auto stats, c->Stats());
    ASSERT_EQ(stats.tiers_size(), 1);
    EXPECT_LE(stats.tiers(0).used_bytes(), stats.tiers(0).capacity_bytes());
    ASSERT_OK_AND_ASSIGN(std::string metrics, daemon->ScrapeMetrics());
    EXPECT_LE(MetricValue(metrics, "proxima_tier_used_bytes{tier=\"host\"}"), 4 << 20);
  }
  ASSERT_OK_AND_ASSIGN(auto stats, c->Stats());
  EXPECT_EQ(stats.tiers(0).blocks(), 16u);
  EXPECT_EQ(stats.tiers(0).evictions(), 24u);
  EXPECT_EQ(GetAndCheck(*c, p, 1, 24, 16), 16u);  // the newest 16 are kept, intact
  EXPECT_EQ(GetAndCheck(*c, p, 1, 0, 24), 0u);    // the oldest went first
}

// SIGHUP with --config: proximad reads its config file again. A lowered namespaces[].max_bytes
// holds at once (the namespace's oldest blocks go, no other namespace's) and for later puts; a
// changed key that needs a restart is named in the log and counted, its old value kept; a file
// that no longer parses, or is gone, changes nothing and says why; a limit removed lets the
// namespace grow.
// The --set overrides of the start still apply on top of the file.
TEST(DaemonIntegrationTest, SighupPutsAChangedNamespaceLimitInForceAndNamesKeysNeedingARestart) {
  char tmpl[] = "/tmp/proxima-reload-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string config = std::string(tmpl) + "/proximad.yaml";
  auto write = [&](const std::string& text) {
    // Replaced whole, as a ConfigMap update does: the daemon never reads half a file.
    std::ofstream(config + ".tmp") << text;
    std::filesystem::rename(config + ".tmp", config);
  };
  write("namespaces: [{name: prod}, {name: bulk, max_bytes: 4MiB}]\n");
  ASSERT_OK_AND_ASSIGN(
      auto daemon, DaemonProcess::Start({"--config=" + config, "tiers.host.capacity_bytes=16MiB"}));
  auto prod = MustConnect(daemon->unix_target(), "prod");
  auto bulk = MustConnect(daemon->unix_target(), "bulk");
  ASSERT_NE(prod, nullptr);
  ASSERT_NE(bulk, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile pp, prod->RegisterProfile(TestModel()));
  ASSERT_OK_AND_ASSIGN(Profile bp, bulk->RegisterProfile(TestModel()));
  ASSERT_EQ(bp.block_bytes, 256u << 10);
  Blocks kept = MakeBlocks(41, 0, 8, pp.block_bytes);
  ASSERT_OK_AND_ASSIGN(auto outcomes, prod->Put(pp, kept.keys, kept.spans()));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  Blocks first = MakeBlocks(42, 0, 16, bp.block_bytes);  // 4 MiB: bulk at its limit
  ASSERT_OK_AND_ASSIGN(outcomes, bulk->Put(bp, first.keys, first.spans()));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));

  // Waits for the daemon's log to hold `message` `count` times (each reload logs one line).
  auto await_log = [&](const std::string& message, size_t count) {
    for (int i = 0; i < 200; ++i) {
      const std::string log = daemon->Log();
      size_t n = 0;
      for (size_t at = log.find(message); at != std::string::npos; at = log.find(message, at + 1)) {
        ++n;
      }
      if (n >= count) return true;
      absl::SleepFor(absl::Milliseconds(25));
    }
    return false;
  };
  write(
      "namespaces: [{name: prod}, {name: bulk, max_bytes: 1MiB}]\n"
      "server: {max_batch_blocks: 64}\n");
  daemon->Signal(SIGHUP);
  ASSERT_TRUE(await_log("config reloaded", 1)) << daemon->Log();
  EXPECT_EQ(testing::LogValue(daemon->Log(), "namespace limit changed", "namespace"), "bulk");
  EXPECT_EQ(testing::LogValue(daemon->Log(), "namespace limit changed", "max_bytes"), "1048576");
  EXPECT_EQ(testing::LogValue(daemon->Log(), "config reloaded", "keys"), "server.max_batch_blocks");
  EXPECT_EQ(GetAndCheck(*bulk, bp, 42, 0, 12), 0u) << "bulk's oldest blocks go at once";
  EXPECT_EQ(GetAndCheck(*bulk, bp, 42, 12, 4), 4u) << "its newest 1 MiB stays, intact";
  EXPECT_EQ(GetAndCheck(*prod, pp, 41, 0, 8), 8u) << "the other namespace lost blocks";
  ASSERT_OK_AND_ASSIGN(std::string metrics, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_max_bytes{namespace=\"bulk\"}"), 1 << 20);
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_bytes{namespace=\"bulk\"}"), 1 << 20);
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_limit_evictions_total{namespace=\"bulk\"}"),
            12);
  EXPECT_EQ(MetricValue(metrics, "proxima_config_reloads_total"), 1);
  EXPECT_EQ(MetricValue(metrics, "proxima_config_restart_pending"), 1);
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, bulk->Stats());
  for (const v1::NamespaceStats& n : stats.namespaces()) {
    EXPECT_EQ(n.max_bytes(), n.name() == "bulk" ? 1u << 20 : 0u) << n.name();
  }
  // The key that needs a restart kept its value in force: a client connecting now is told 256.
  auto later = MustConnect(daemon->tcp_target(), "bulk");
  ASSERT_NE(later, nullptr);
  EXPECT_EQ(later->server_info().max_batch_blocks, 256u);
  Blocks more = MakeBlocks(43, 0, 4, bp.block_bytes);
  ASSERT_OK_AND_ASSIGN(outcomes, bulk->Put(bp, more.keys, more.spans()));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  EXPECT_EQ(GetAndCheck(*bulk, bp, 43, 0, 4), 4u);
  EXPECT_EQ(GetAndCheck(*bulk, bp, 42, 12, 4), 0u) << "later puts are held to the new limit";

  // A file that no longer parses: the error names the key and value, nothing changes.
  write("namespaces: [{name: prod}, {name: bulk, max_bytes: lots}]\n");
  daemon->Signal(SIGHUP);
  ASSERT_TRUE(await_log("config reload failed", 1)) << daemon->Log();
  EXPECT_THAT(testing::LogValue(daemon->Log(), "config reload failed", "error"),
              ::testing::Optional(AllOf(HasSubstr("namespaces[1].max_bytes"), HasSubstr("lots"))));
  ASSERT_OK_AND_ASSIGN(metrics, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_config_reload_failures_total"), 1);
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_max_bytes{namespace=\"bulk\"}"), 1 << 20);
  EXPECT_EQ(GetAndCheck(*bulk, bp, 43, 0, 4), 4u);
  EXPECT_EQ(GetAndCheck(*prod, pp, 41, 0, 8), 8u);

  // The file gone (a ConfigMap unmounted, a volume not there yet): the same, naming the path;
  // the daemon serves on with the configuration in force.
  std::filesystem::remove(config);
  daemon->Signal(SIGHUP);
  ASSERT_TRUE(await_log("config reload failed", 2)) << daemon->Log();
  EXPECT_THAT(testing::LogValue(daemon->Log(), "config reload failed", "error"),
              ::testing::Optional(HasSubstr(config)));
  ASSERT_OK_AND_ASSIGN(metrics, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_config_reload_failures_total"), 2);
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_max_bytes{namespace=\"bulk\"}"), 1 << 20);
  EXPECT_EQ(GetAndCheck(*bulk, bp, 43, 0, 4), 4u);
  EXPECT_EQ(GetAndCheck(*prod, pp, 41, 0, 8), 8u);

  // A namespace renamed: which blocks its limit is for is no longer clear, so the limit waits for
  // the restart with the name.
  write("namespaces: [{name: prod}, {name: batch, max_bytes: 512KiB}]\n");
  daemon->Signal(SIGHUP);
  ASSERT_TRUE(await_log("config reloaded", 2)) << daemon->Log();
  EXPECT_EQ(testing::LogValue(daemon->Log(), "config reloaded", "keys"),
            "namespaces[1].name,namespaces[1].max_bytes");
  ASSERT_OK_AND_ASSIGN(metrics, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_max_bytes{namespace=\"bulk\"}"), 1 << 20);
  EXPECT_EQ(MetricValue(metrics, "proxima_config_restart_pending"), 2);
  EXPECT_EQ(GetAndCheck(*bulk, bp, 43, 0, 4), 4u);

  // The limit removed: bulk grows past 1 MiB; nothing waits for a restart any more.
  write("namespaces: [{name: prod}, {name: bulk}]\n");
  daemon->Signal(SIGHUP);
  ASSERT_TRUE(await_log("config reloaded", 3)) << daemon->Log();
  Blocks last = MakeBlocks(44, 0, 8, bp.block_bytes);
  ASSERT_OK_AND_ASSIGN(outcomes, bulk->Put(bp, last.keys, last.spans()));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  EXPECT_EQ(GetAndCheck(*bulk, bp, 43, 0, 4), 4u);
  EXPECT_EQ(GetAndCheck(*bulk, bp, 44, 0, 8), 8u);
  ASSERT_OK_AND_ASSIGN(metrics, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_max_bytes{namespace=\"bulk\"}"), 0);
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_bytes{namespace=\"bulk\"}"), 3 << 20);
  EXPECT_EQ(MetricValue(metrics, "proxima_config_reloads_total"), 3);
  EXPECT_EQ(MetricValue(metrics, "proxima_config_restart_pending"), 0);
  std::filesystem::remove_all(tmpl);
}

// namespaces[].max_bytes through a real proximad: a tenant that floods the node with puts
// (here 100 blocks, 25 MiB, into a 16 MiB tier) keeps within its 2 MiB limit by evicting its
// own oldest blocks, and another tenant's 40 blocks all stay; its puts go over UCX (the
// client's default where it reaches the daemon) and inline in turn: each path keeps the limit.
TEST(DaemonIntegrationTest, AFloodingTenantStaysWithinItsMaxBytesAndOthersKeepTheirBlocks) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start({"tiers.host.capacity_bytes=16MiB",
                                                          "namespaces=[{name: prod}, {name: bulk, "
                                                          "max_bytes: 2MiB}]"}));
  auto prod = MustConnect(daemon->unix_target(), "prod");
  auto bulk = MustConnect(daemon->tcp_target(), "bulk");
  ClientOptions inline_options;
  inline_options.target = daemon->tcp_target();
  inline_options.namespace_name = "bulk";
  inline_options.transport = client::Transport::kInline;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> bulk_inline, Client::Connect(inline_options));
  ASSERT_NE(prod, nullptr);
  ASSERT_NE(bulk, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile pp, prod->RegisterProfile(TestModel()));
  ASSERT_OK_AND_ASSIGN(Profile bp, bulk->RegisterProfile(TestModel()));
  ASSERT_EQ(pp.block_bytes, 256u << 10);
  Blocks kept = MakeBlocks(31, 0, 40, pp.block_bytes);
  ASSERT_OK_AND_ASSIGN(auto outcomes, prod->Put(pp, kept.keys, kept.spans()));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  for (size_t first = 0; first < 100; first += 4) {
    Blocks flood = MakeBlocks(32, first, 4, bp.block_bytes);
    Client& c = first % 8 == 0 ? *bulk_inline : *bulk;  // the inline and the UCX put paths
    ASSERT_OK_AND_ASSIGN(outcomes, c.Put(bp, flood.keys, flood.spans()));
    EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored)) << first;
  }
  EXPECT_EQ(GetAndCheck(*prod, pp, 31, 0, 40), 40u) << "the other tenant lost blocks";
  EXPECT_EQ(GetAndCheck(*bulk, bp, 32, 0, 92), 0u);
  EXPECT_EQ(GetAndCheck(*bulk, bp, 32, 92, 8), 8u) << "the flooding tenant's newest 8 stay";
  ASSERT_OK_AND_ASSIGN(std::string metrics, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_bytes{namespace=\"bulk\"}"), 2 << 20);
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_max_bytes{namespace=\"bulk\"}"), 2 << 20);
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_limit_evictions_total{namespace=\"bulk\"}"),
            92);
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_limit_refusals_total{namespace=\"bulk\"}"), 0);
  EXPECT_EQ(MetricValue(metrics, "proxima_namespace_max_bytes{namespace=\"prod\"}"), 0);
  // A tenant sees its own limit in Stats, and the operator in proximactl stats.
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, bulk->Stats());
  ASSERT_EQ(stats.namespaces_size(), 2);  // open namespaces: both
  for (const v1::NamespaceStats& n : stats.namespaces()) {
    EXPECT_EQ(n.max_bytes(), n.name() == "bulk" ? 2u << 20 : 0u) << n.name();
    if (n.name() == "bulk") EXPECT_EQ(n.bytes(), 2u << 20);
  }
  testing::CommandResult ctl = testing::RunCommand(
      {testing::ProximactlPath(), "stats", "--target=" + daemon->unix_target()});
  EXPECT_EQ(ctl.exit_code, 0) << ctl.err;
  EXPECT_THAT(ctl.out, AllOf(HasSubstr("max_bytes"),
                             ::testing::ContainsRegex("bulk +8 +2097152 +2097152 ")));
  // Both put paths ran, and each kept the limit.
  EXPECT_GT(MetricValue(metrics,
                        "proxima_transfer_bytes_total{transport=\"grpc_inline\",direction=\"in\"}"),
            0);
  EXPECT_GT(
      MetricValue(metrics, "proxima_transfer_bytes_total{transport=\"ucx\",direction=\"in\"}"), 0);
}

TEST(DaemonIntegrationTest, ConcurrentClientsEachGetTheirOwnBytes) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start({"tiers.host.capacity_bytes=256MiB"}));
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto c = MustConnect(t % 2 ? daemon->tcp_target() : daemon->unix_target());
      if (c == nullptr) return void(++failures);
      auto p = c->RegisterProfile(TestModel());
      if (!p.ok()) return void(++failures);
      for (int round = 0; round < 10; ++round) {
        Blocks b = MakeBlocks(100 + t, round * 4, 4, p->block_bytes);
        if (!c->Put(*p, b.keys, b.spans()).ok()) ++failures;
        if (GetAndCheck(*c, *p, 100 + t, round * 4, 4) != 4) ++failures;
        auto present = c->Lookup(*p, client::TestKeyChain(100 + t, 0, (round + 1) * 4));
        if (!present.ok() || *present != static_cast<size_t>((round + 1) * 4)) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(DaemonIntegrationTest, TheHarnessRestartWaitsOutAPortHeldForAWhileAndNamesItsHolder) {
  // DaemonProcess::Restart (the tests' harness) on a port something else listens on until the
  // restarted daemon has failed to bind it once: it logs the holder (its /proc/net/tcp line)
  // and starts once the port is free.
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start());
  const int port = daemon->tcp_port();
  daemon->Signal(SIGKILL);
  ASSERT_EQ(daemon->WaitExit(absl::Seconds(10)), -1);
  const int holder = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(holder, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << errno;
  ASSERT_EQ(listen(holder, 1), 0) << errno;
  // Released a second after the daemon's log shows a failed bind, not after a fixed time from
  // now: under qemu a daemon can take longer to start than such a time (a run with 1.2 s never
  // saw the port in use).
  DaemonProcess* d = daemon.get();
  std::thread release([holder, d] {
    const absl::Time deadline = absl::Now() + absl::Seconds(8);
    while (absl::Now() < deadline && !absl::StrContains(d->Log(), "address in use")) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // The harness lists the port's sockets right after that failure: held a while longer.
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    close(holder);
  });
  ::testing::internal::CaptureStderr();
  const absl::Status restarted = daemon->Restart();
  const std::string log = ::testing::internal::GetCapturedStderr();
  release.join();
  ASSERT_OK(restarted);
  EXPECT_EQ(daemon->tcp_port(), port);
  EXPECT_THAT(log, AllOf(HasSubstr(absl::StrCat("port ", port, " in use")), HasSubstr("LISTEN")));
  auto c = MustConnect(daemon->tcp_target());
  ASSERT_NE(c, nullptr);
  EXPECT_OK(c->RegisterProfile(TestModel()).status());
}

TEST(DaemonIntegrationTest, RestartForgetsBlocksAndClientsCarryOn) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start());
  auto c = MustConnect(daemon->tcp_target());
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  Blocks b = MakeBlocks(3, 0, 4, p.block_bytes);
  ASSERT_OK(c->Put(p, b.keys, b.spans()).status());
  ASSERT_OK(daemon->Restart());  // SIGKILL, then start again on the same port and socket
  // The same Client keeps working: the channel reconnects and the profile is re-registered.
  absl::StatusOr<size_t> present;
  for (int attempt = 0; attempt < 50; ++attempt) {
    present = c->Lookup(p, b.keys);
    if (present.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_OK(present.status());
  EXPECT_EQ(*present, 0u);  // blocks live in memory only
  ASSERT_OK(c->Put(p, b.keys, b.spans()).status());
  EXPECT_EQ(GetAndCheck(*c, p, 3, 0, 4), 4u);
  EXPECT_THAT(daemon->Log(), HasSubstr("proximad serving"));
}

TEST(DaemonIntegrationTest, WhileItsDaemonIsDownAClientFailsAtOnceAndServesSoonAfterItReturns) {
  // A worker's calls while its daemon is down (SIGKILL, a crash, an upgrade) fail UNAVAILABLE at
  // once, as misses, whatever the call deadline, and succeed again within about the reconnect
  // backoff (1 s at most) of the daemon serving, with no call needed in between. Before: calls
  // over UCX each waited out their deadline while it was down, and a client whose calls failed
  // fast (inline) went on failing for 3.9-8.9 s after the daemon served (until gRPC's backup
  // poller moved its reconnection on).
  constexpr absl::Duration kCallTimeout = absl::Seconds(20);
  const int slow = testing::EmulationFactor();  // bounds x5 under qemu
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start());
  for (client::Transport transport : {client::Transport::kInline, client::Transport::kUcx}) {
    for (bool unix_socket : {true, false}) {
      SCOPED_TRACE(absl::StrCat(client::TransportName(transport), unix_socket ? " unix" : " tcp"));
      ClientOptions options;
      options.target = unix_socket ? daemon->unix_target() : daemon->tcp_target();
      options.transport = transport;
      options.call_timeout = kCallTimeout;
      ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(options));
      ASSERT_EQ(c->transport(), transport);
      ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
      Blocks b = MakeBlocks(31, 0, 4, p.block_bytes);
      ASSERT_OK(c->Put(p, b.keys, b.spans()).status());

      daemon->Signal(SIGKILL);
      ASSERT_EQ(daemon->WaitExit(absl::Seconds(10)), -1);
      // Down for 1.5 s, long enough for the reconnect backoff to reach its 1 s maximum.
      const absl::Time down = absl::Now();
      int calls = 0;
      absl::Status last;
      while (absl::Now() - down < absl::Milliseconds(1500)) {
        const absl::Time start = absl::Now();
        last = c->Lookup(p, b.keys).status();
        EXPECT_THAT(last, StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
        EXPECT_LE(absl::Now() - start, absl::Milliseconds(500) * slow) << "call " << calls;
        ++calls;
        absl::SleepFor(absl::Milliseconds(100));
      }
      EXPECT_GE(calls, 5 / slow);
      // Over either transport the failure says why: gRPC's own reason (the daemon refused).
      EXPECT_THAT(last.message(), HasSubstr("failed to connect")) << last;

      ASSERT_OK(daemon->Restart());  // on the same port and socket, serving when it returns
      const absl::Time up = absl::Now();
      absl::StatusOr<size_t> present;
      do {
        absl::SleepFor(absl::Milliseconds(20));
        present = c->Lookup(p, b.keys);
      } while (!present.ok() && absl::Now() - up < absl::Seconds(10) * slow);
      const absl::Duration back_after = absl::Now() - up;
      ASSERT_OK(present.status());
      EXPECT_EQ(*present, 0u);  // blocks live in memory only
      // The backoff's 1 s, its 20% jitter, and room for a loaded machine.
      EXPECT_LE(back_after, absl::Milliseconds(2500) * slow);
      ASSERT_OK(c->Put(p, b.keys, b.spans()).status());
      EXPECT_EQ(GetAndCheck(*c, p, 31, 0, 4), 4u);
      EXPECT_EQ(c->transport(), transport);
      std::cerr << client::TransportName(transport) << (unix_socket ? " unix" : " tcp") << ": "
                << calls << " calls failed while down; served again "
                << absl::FormatDuration(back_after) << " after the daemon did\n";
    }
  }
}

// tiers.host.snapshot_file, in a directory of the test's own.
class SnapshotIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/proxima-it-snapshot-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    file_ = dir_ + "/snapshot";
  }
  void TearDown() override {
    unlink(file_.c_str());
    unlink((file_ + ".lock").c_str());
    rmdir(dir_.c_str());
  }

  // Starts a daemon with the snapshot file and `sets`.
  std::unique_ptr<DaemonProcess> StartDaemon(std::vector<std::string> sets = {}) {
    sets.push_back("tiers.host.snapshot_file=" + file_);
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(sets);
    EXPECT_OK(d.status());
    return d.ok() ? *std::move(d) : nullptr;
  }

  // Puts blocks [0, count) of chain `seed` through `daemon`; returns their profile.
  static Profile Put(DaemonProcess& daemon, uint64_t seed, size_t count) {
    auto c = MustConnect(daemon.tcp_target());
    absl::StatusOr<Profile> p = c->RegisterProfile(TestModel());
    EXPECT_OK(p.status());
    Blocks b = MakeBlocks(seed, 0, count, p->block_bytes);
    EXPECT_OK(c->Put(*p, b.keys, b.spans()).status());
    return *p;
  }

  // Stops `daemon` with SIGTERM; it must exit 0.
  static void Stop(DaemonProcess& daemon) {
    daemon.Signal(SIGTERM);
    EXPECT_EQ(daemon.WaitExit(absl::Seconds(30)), 0);
  }

  // How many of blocks [0, count) of chain `seed` `daemon` serves (every byte checked).
  static size_t Served(DaemonProcess& daemon, const Profile& p, uint64_t seed, size_t count) {
    auto c = MustConnect(daemon.tcp_target());
    EXPECT_OK(c->RegisterProfile(TestModel()).status());
    return GetAndCheck(*c, p, seed, 0, count);
  }

  std::string dir_;
  std::string file_;
};

// What a daemon held when SIGTERM stopped it, the next start serves (profiles included); after a
// SIGKILL nothing, since a snapshot is read once.
TEST_F(SnapshotIntegrationTest, ARestartAfterSigtermKeepsTheBlocks) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  const Profile p = Put(*daemon, 5, 24);
  Stop(*daemon);
  EXPECT_THAT(daemon->Log(), HasSubstr("wrote the blocks to the snapshot for the next start"));
  ASSERT_EQ(access(file_.c_str(), F_OK), 0);

  ASSERT_OK(daemon->Restart());
  EXPECT_NE(access(file_.c_str(), F_OK), 0) << "a snapshot is read once";
  EXPECT_THAT(daemon->Log(),
              HasSubstr(absl::StrCat("loaded the blocks of the snapshot the last run wrote file=",
                                     file_, " blocks=24 bytes=", 24 * p.block_bytes,
                                     " profiles=1 skipped=0 no_room_blocks=0 complete=1")));
  EXPECT_EQ(Served(*daemon, p, 5, 24), 24u);

  ASSERT_OK(daemon->Restart());  // SIGKILL: no snapshot
  EXPECT_THAT(daemon->Log(), HasSubstr("no snapshot to load: starting with empty tiers"));
  EXPECT_EQ(Served(*daemon, p, 5, 24), 0u);
}

// A start that fails after reading the snapshot (its TCP port is taken) writes the blocks back:
// they wait for the next start that serves.
TEST_F(SnapshotIntegrationTest, ASnapshotOutlivesAStartThatFails) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  const Profile p = Put(*daemon, 8, 8);
  Stop(*daemon);

  const int held = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(held, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(held, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(held, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  testing::CommandResult r = testing::RunCommand(
      {testing::ProximadPath(),
       absl::StrCat("--set=server.listen=127.0.0.1:", ntohs(addr.sin_port)),
       "--set=server.unix_socket=", "--set=server.metrics_listen=",
       "--set=tiers.host.capacity_bytes=64MiB", "--set=tiers.host.snapshot_file=" + file_},
      absl::Seconds(30));
  close(held);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, AllOf(HasSubstr("loaded the blocks of the snapshot the last run wrote"),
                           HasSubstr("cannot start the gRPC server"),
                           HasSubstr("wrote the blocks to the snapshot for the next start (this "
                                     "one failed) file=" +
                                     file_ + " blocks=8")));
  EXPECT_EQ(access(file_.c_str(), F_OK), 0);

  ASSERT_OK(daemon->Restart());
  EXPECT_EQ(Served(*daemon, p, 8, 8), 8u);
}

// Two daemons given one snapshot file would write over each other's blocks: the second start is
// refused, naming the first's pid, for as long as the first runs (a SIGKILL frees the file too).
TEST_F(SnapshotIntegrationTest, ASecondDaemonGivenTheSameFileIsRefusedWhileTheFirstRuns) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  const Profile p = Put(*daemon, 9, 6);
  auto second = [&] {
    return testing::RunCommand(
        {testing::ProximadPath(), "--set=server.listen=127.0.0.1:0", "--set=server.unix_socket=",
         "--set=server.metrics_listen=", "--set=tiers.host.capacity_bytes=16MiB",
         "--set=tiers.host.snapshot_file=" + file_},
        absl::Seconds(20));
  };
  testing::CommandResult r = second();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("tiers.host.snapshot_file '", file_,
                                            "' is in use by another proximad (pid ", daemon->pid(),
                                            ", which holds the lock '", file_, ".lock')")));
  EXPECT_EQ(Served(*daemon, p, 9, 6), 6u) << "the first daemon is unharmed";
  // SIGKILL: its lock goes with it, so the next start takes the file; then that one holds it.
  ASSERT_OK(daemon->Restart());
  r = second();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("(pid ", daemon->pid(), ",")));
  Stop(*daemon);
  EXPECT_EQ(access(file_.c_str(), F_OK), 0) << "the holder's snapshot is written";
}

// How a start read the snapshot stays in its metrics for the whole run (the log line scrolls
// away): a snapshot cut short loads what it holds and says partial; one that is no snapshot loads
// nothing and says failed; the daemon serves either way.
TEST_F(SnapshotIntegrationTest, AStartThatCameBackShortOfWarmSaysSoInItsMetrics) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  const Profile p = Put(*daemon, 10, 6);
  Stop(*daemon);
  // Without its end record and the end of its last block record (the coldest block's).
  const off_t size = std::filesystem::file_size(file_);
  ASSERT_GT(size, 1000);
  ASSERT_EQ(truncate(file_.c_str(), size - 1000), 0);
  ASSERT_OK(daemon->Restart());
  ASSERT_OK_AND_ASSIGN(std::string metrics, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_load_state{state=\"partial\"}"), 1);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_load_state{state=\"loaded\"}"), 0);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_loaded_blocks"), 5);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_loaded_profiles"), 1);
  EXPECT_EQ(Served(*daemon, p, 10, 6), 5u);

  ASSERT_OK(daemon->Restart());  // SIGKILL: no snapshot of this run
  {
    std::ofstream garbage(file_, std::ios::binary | std::ios::trunc);
    garbage << "this is not a proximad snapshot";
  }
  ASSERT_OK(daemon->Restart());
  EXPECT_THAT(daemon->Log(), HasSubstr("snapshot not loaded: starting with empty tiers"));
  ASSERT_OK_AND_ASSIGN(metrics, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_load_state{state=\"failed\"}"), 1);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_load_state{state=\"partial\"}"), 0);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_loaded_blocks"), 0);
  EXPECT_EQ(Put(*daemon, 11, 2).block_bytes, p.block_bytes);
  EXPECT_EQ(Served(*daemon, p, 11, 2), 2u);
}

// A snapshot directory whose file system fills before every block is written (a tmpfs of 1.25
// MiB, room for a few of the 256 KiB blocks): the file keeps the hottest blocks that fit, the log
// says what the full disk left out, and the next start serves exactly those, byte-exact, and
// counts the start as loaded. Needs root and a mount namespace of its own (the ctest entry
// snapshot_disk_full_daemon runs it under unshare --mount); skips elsewhere.
TEST_F(SnapshotIntegrationTest, AFullDiskKeepsTheHottestBlocksThatFitForTheNextStart) {
  if (!testing::InMountNamespaceOfItsOwn()) {
    GTEST_SKIP() << "mounts a tmpfs: runs as root in a mount namespace of its own (the ctest "
                    "entry snapshot_disk_full_daemon runs it under unshare --mount)";
  }
  constexpr size_t kBlocks = 12;
  std::unique_ptr<testing::ScopedTmpfs> tmpfs;
  ASSERT_OK(testing::ScopedTmpfs::Mount(dir_, 1280 << 10, &tmpfs));
  std::unique_ptr<DaemonProcess> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  auto c = MustConnect(daemon->tcp_target());
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  for (size_t n = 0; n < kBlocks; ++n) {  // one call each: n + 1 is used more recently than n
    Blocks b = MakeBlocks(12, n, 1, p.block_bytes);
    ASSERT_OK(c->Put(p, b.keys, b.spans()).status());
  }
  c.reset();
  Stop(*daemon);
  const std::string stopped = daemon->Log();

  ASSERT_OK(daemon->Restart());
  ASSERT_OK_AND_ASSIGN(std::string metrics, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_load_state{state=\"loaded\"}"), 1);
  const size_t kept = static_cast<size_t>(MetricValue(metrics, "proxima_snapshot_loaded_blocks"));
  ASSERT_GT(kept, 0u);
  ASSERT_LT(kept, kBlocks);
  EXPECT_THAT(
      stopped,
      AllOf(HasSubstr(absl::StrCat("wrote the blocks to the snapshot for the next start file=",
                                   file_, " blocks=", kept, " bytes=", kept * p.block_bytes)),
            HasSubstr(absl::StrCat(" left_blocks=", kBlocks - kept, " ")),
            HasSubstr(absl::StrCat("file_system_full=\"cannot write the snapshot file '", file_,
                                   ".tmp': No space left on device\""))));
  c = MustConnect(daemon->tcp_target());
  ASSERT_OK(c->RegisterProfile(TestModel()).status());
  EXPECT_EQ(GetAndCheck(*c, p, 12, kBlocks - kept, kept), kept) << "the hottest come back";
  EXPECT_EQ(GetAndCheck(*c, p, 12, 0, kBlocks - kept), 0u) << "the coldest were left out";
}

TEST_F(SnapshotIntegrationTest, ASnapshotKeepsTheGpuTiersBlocksToo) {
  // The GPU tier holds a node's hottest blocks, and the snapshot reads the host tier: they go
  // down to it first. Needs a GPU (scripts/gpu-check.sh runs it on one).
  constexpr size_t kBlocks = 12;  // 3 MiB: all in the 16 MiB pool, under its 0.8 threshold
  std::unique_ptr<DaemonProcess> daemon =
      StartDaemon({"tiers.gpu.capacity_bytes_per_device=16MiB"});
  ASSERT_NE(daemon, nullptr);
  const std::string started = daemon->Log();
  if (const size_t at = started.find("no GPU tier"); at != std::string::npos) {
    GTEST_SKIP() << started.substr(at, started.find('\n', at) - at);
  }
  const Profile p = Put(*daemon, 6, kBlocks);
  {
    auto c = MustConnect(daemon->tcp_target());
    ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, c->Stats());
    ASSERT_GE(stats.tiers_size(), 2) << stats.DebugString();
    EXPECT_EQ(stats.tiers(1).blocks(), kBlocks) << stats.DebugString();
  }
  Stop(*daemon);
  EXPECT_THAT(daemon->Log(),
              HasSubstr(absl::StrCat("moved the GPU tier's blocks to the host tier to write them "
                                     "to the snapshot blocks=",
                                     kBlocks, " left_blocks=0")));
  ASSERT_OK(daemon->Restart());
  EXPECT_EQ(Served(*daemon, p, 6, kBlocks), kBlocks);
}

// The snapshot is written at shutdown; a directory it cannot be written to stops the start.
TEST(DaemonIntegrationTest, ASnapshotFileInADirectoryThatCannotBeWrittenStopsTheStart) {
  testing::CommandResult r = testing::RunCommand(
      {testing::ProximadPath(), "--set=server.listen=127.0.0.1:0", "--set=server.unix_socket=",
       "--set=server.metrics_listen=", "--set=tiers.host.capacity_bytes=16MiB",
       "--set=tiers.host.snapshot_file=/proc/no-such-dir/snapshot"},
      absl::Seconds(20));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, AllOf(HasSubstr("tiers.host.snapshot_file '/proc/no-such-dir/snapshot'"),
                           HasSubstr("'/proc/no-such-dir' is not one this process can write to")));
}

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = DaemonProcess::Start({"server.max_message_bytes=4MiB", "server.max_batch_blocks=8",
                                   "server.max_lookup_keys=100",
                                   "namespaces=[{name: default}, {name: other}]"});
    ASSERT_OK(d.status());
    daemon_ = *std::move(d);
    client_ = MustConnect(daemon_->tcp_target());
    ASSERT_NE(client_, nullptr);
    auto p = client_->RegisterProfile(TestModel());
    ASSERT_OK(p.status());
    profile_ = *p;
    stored_ = MakeBlocks(42, 0, 4, profile_.block_bytes);
    ASSERT_OK(client_->Put(profile_, stored_.keys, stored_.spans()).status());
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    stub_ = v1::KVTier::NewStub(grpc::CreateCustomChannel(
        daemon_->tcp_target(), grpc::InsecureChannelCredentials(), args));
  }

  // After each bad input: the daemon still serves, and the blocks stored first are intact.
  void TearDown() override {
    if (client_ == nullptr) return;
    EXPECT_EQ(GetAndCheck(*client_, profile_, 42, 0, 4), 4u);
  }

  v1::PutRequest GoodPut(int n) {
    v1::PutRequest r;
    r.set_namespace_name("default");
    r.set_profile_id(profile_.id);
    Blocks b = MakeBlocks(77, 0, n, profile_.block_bytes);
    for (int i = 0; i < n; ++i) {
      v1::PutBlock* pb = r.add_blocks();
      pb->set_key(std::string(reinterpret_cast<const char*>(b.keys[i].data()), 32));
      pb->set_data(reinterpret_cast<const char*>(b.data[i].data()), b.data[i].size());
    }
    return r;
  }

  absl::Status Put(const v1::PutRequest& r) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::PutResponse resp;
    return client::FromGrpc(stub_->Put(&ctx, r, &resp));
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<v1::KVTier::Stub> stub_;
  Profile profile_;
  Blocks stored_;
};

TEST_F(BadInputTest, WrongBlockSize) {
  v1::PutRequest r = GoodPut(2);
  r.mutable_blocks(1)->mutable_data()->resize(1000);
  EXPECT_THAT(Put(r), StatusIs(absl::StatusCode::kInvalidArgument,
                               AllOf(HasSubstr("blocks[1].data is 1000 bytes"),
                                     HasSubstr("262144"))));
  // Nothing of the rejected batch was stored, not even its valid first block.
  EXPECT_THAT(client_->Lookup(profile_, client::TestKeyChain(77, 0, 1)), IsOkAndHolds(0u));
}

TEST_F(BadInputTest, UnknownProfileAndNamespace) {
  v1::PutRequest r = GoodPut(1);
  r.set_profile_id(0xdeadbeef);
  EXPECT_THAT(Put(r), StatusIs(absl::StatusCode::kNotFound,
                               AllOf(HasSubstr("0x00000000deadbeef"),
                                     HasSubstr("RegisterProfile"))));
  r = GoodPut(1);
  r.set_namespace_name("nope");
  EXPECT_THAT(Put(r), StatusIs(absl::StatusCode::kNotFound, HasSubstr("namespace 'nope'")));
  r = GoodPut(1);
  r.set_namespace_name("other");  // configured, but the profile was registered in "default"
  EXPECT_THAT(Put(r), StatusIs(absl::StatusCode::kNotFound, HasSubstr("namespace 'other'")));
}

TEST_F(BadInputTest, EmptyAndOversizedBatches) {
  EXPECT_THAT(Put(GoodPut(0)), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("no blocks")));
  v1::PutRequest big = GoodPut(9);  // over max_batch_blocks = 8; shrunk to stay under 4 MiB
  for (auto& b : *big.mutable_blocks()) b.mutable_data()->resize(profile_.block_bytes / 4);
  EXPECT_THAT(Put(big), StatusIs(absl::StatusCode::kResourceExhausted,
                                 AllOf(HasSubstr("limit is 8"),
                                       HasSubstr("server.max_batch_blocks"))));
  v1::LookupRequest lookup;
  lookup.set_namespace_name("default");
  lookup.set_profile_id(profile_.id);
  for (int i = 0; i < 101; ++i) lookup.add_keys(std::string(32, 'k'));
  grpc::ClientContext ctx;
  v1::LookupResponse resp;
  EXPECT_THAT(client::FromGrpc(stub_->Lookup(&ctx, lookup, &resp)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("limit is 100"), HasSubstr("server.max_lookup_keys"))));
}

TEST_F(BadInputTest, MillionsOfEmptyKeysAreRefusedWhileParsing) {
  // 1.5 million empty keys in a 3 MB message: refused at the 101st key, before any allocation
  // proportional to the count.
  v1::LookupRequest lookup;
  lookup.set_namespace_name("default");
  lookup.set_profile_id(profile_.id);
  for (int i = 0; i < 1500000; ++i) lookup.add_keys("");
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::LookupResponse resp;
  EXPECT_THAT(client::FromGrpc(stub_->Lookup(&ctx, lookup, &resp)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit is 100")));
  v1::DeleteRequest del;
  del.set_namespace_name("default");
  del.set_profile_id(profile_.id);
  for (int i = 0; i < 1500000; ++i) del.add_keys("");
  grpc::ClientContext ctx2;
  v1::DeleteResponse del_resp;
  EXPECT_THAT(client::FromGrpc(stub_->Delete(&ctx2, del, &del_resp)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit is 8")));
}

TEST_F(BadInputTest, MalformedKey) {
  v1::PutRequest r = GoodPut(3);
  r.mutable_blocks(2)->set_key(std::string(33, 'x'));
  EXPECT_THAT(Put(r), StatusIs(absl::StatusCode::kInvalidArgument,
                               AllOf(HasSubstr("blocks[2].key is 33 bytes"), HasSubstr("32"))));
  v1::GetRequest g;
  g.set_namespace_name("default");
  g.set_profile_id(profile_.id);
  g.add_keys("");
  grpc::ClientContext ctx;
  v1::GetResponse resp;
  EXPECT_THAT(client::FromGrpc(stub_->Get(&ctx, g, &resp)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("keys[0] is 0 bytes")));
}

TEST_F(BadInputTest, CorruptedInTransit) {
  v1::PutRequest r = GoodPut(1);
  r.mutable_blocks(0)->set_crc32c(Crc32c(std::as_bytes(std::span(r.blocks(0).data()))) ^ 1);
  EXPECT_THAT(Put(r), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("crc32c")));
}

TEST_F(BadInputTest, MessageOverTheSizeLimit) {
  v1::PutRequest r = GoodPut(8);  // 2 MiB of data...
  for (auto& b : *r.mutable_blocks()) b.mutable_data()->append(profile_.block_bytes, 'x');
  // ...now 4 MiB + framing: over server.max_message_bytes = 4 MiB.
  EXPECT_THAT(Put(r), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("larger than max")));
}

TEST_F(BadInputTest, ClientKilledMidCall) {
  // proximactl sends a large put; it is killed while its message is still in flight.
  for (int i = 0; i < 3; ++i) {
    testing::CommandResult r = testing::RunCommand(
        {"/usr/bin/timeout", "-s", "KILL", "0.15", testing::ProximactlPath(), "put",
         "--target=" + daemon_->tcp_target(), "--count=256", "--tokens_per_block=64",
         "--seed=9"},
        absl::Seconds(30));
    EXPECT_NE(r.exit_code, 0);
  }
  ASSERT_OK_AND_ASSIGN(auto stats, client_->Stats());
  EXPECT_LE(stats.tiers(0).used_bytes(), stats.tiers(0).capacity_bytes());
}

TEST(DaemonIntegrationTest, SigtermDrainsInFlightCallsAndRefusesNewOnes) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start({"tiers.host.capacity_bytes=128MiB"}));
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, unavailable{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto c = MustConnect(daemon->unix_target());
      if (c == nullptr) return void(++other);
      auto p = c->RegisterProfile(TestModel());
      if (!p.ok()) return void(++other);
      for (int i = 0; !stop && i < 100000; ++i) {
        Blocks b = MakeBlocks(500 + t, i * 4, 4, p->block_bytes);
        absl::Status s = c->Put(*p, b.keys, b.spans()).status();
        if (s.ok()) ++ok;
        else if (s.code() == absl::StatusCode::kUnavailable) ++unavailable;
        else {
          ++other;
          ADD_FAILURE() << "unexpected status during drain: " << s;
        }
        if (!s.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  daemon->Signal(SIGTERM);
  EXPECT_EQ(daemon->WaitExit(absl::Seconds(10)), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_GT(ok.load(), 0);
  EXPECT_GT(unavailable.load(), 0);  // calls after the drain began were refused...
  EXPECT_EQ(other.load(), 0);        // ...and nothing failed any other way
  EXPECT_THAT(daemon->Log(), HasSubstr("shutdown complete"));
}

// A SIGTERM with nothing in flight ends the drain at once, however many idle clients stay
// connected. gRPC's server would wait for each of them to close its connection after the
// GOAWAY, which an idle gRPC 1.51 client reads only when its backup poller runs (every 5 s by
// default; 60 s here, so that such a wait shows as the whole 20 s grace).
TEST(DaemonIntegrationTest, SigtermWithNothingInFlightDoesNotWaitForIdleClients) {
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "60000", 1);
  absl::Cleanup unset = [] { unsetenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS"); };
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start({"server.shutdown_grace_seconds=20"}));
  std::vector<std::unique_ptr<Client>> idle;
  for (const std::string& target : {daemon->tcp_target(), daemon->unix_target()}) {
    idle.push_back(MustConnect(target));
    ASSERT_NE(idle.back(), nullptr);
    ASSERT_OK_AND_ASSIGN(Profile p, idle.back()->RegisterProfile(TestModel()));
    Blocks b = MakeBlocks(77, 0, 1, p.block_bytes);
    ASSERT_OK(idle.back()->Put(p, b.keys, b.spans()).status());
  }
  const absl::Time signalled = absl::Now();
  daemon->Signal(SIGTERM);
  EXPECT_EQ(daemon->WaitExit(absl::Seconds(30)), 0) << daemon->Log();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(5)) << daemon->Log();
  EXPECT_THAT(daemon->Log(), HasSubstr("shutdown complete"));
}

TEST(DaemonIntegrationTest, MetricsEndpointExportsTheDocumentedSeries) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start());
  // The inline path's series (tests/integration/ucx_test.cc checks the UCX ones).
  ClientOptions options;
  options.target = daemon->tcp_target();
  options.transport = client::Transport::kInline;
  ASSERT_OK_AND_ASSIGN(auto c, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  Blocks b = MakeBlocks(5, 0, 3, p.block_bytes);
  ASSERT_OK(c->Put(p, b.keys, b.spans()).status());
  EXPECT_EQ(GetAndCheck(*c, p, 5, 0, 4), 3u);
  ASSERT_OK_AND_ASSIGN(std::string m, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(m, "proxima_tier_capacity_bytes{tier=\"host\"}"), 64 << 20);
  EXPECT_EQ(MetricValue(m, "proxima_tier_used_bytes{tier=\"host\"}"), 3 * (256 << 10));
  EXPECT_EQ(MetricValue(m, "proxima_blocks_put_total{namespace=\"default\"}"), 3);
  EXPECT_EQ(MetricValue(m, "proxima_get_hits_total{namespace=\"default\"}"), 3);
  EXPECT_EQ(MetricValue(m, "proxima_get_misses_total{namespace=\"default\"}"), 1);
  EXPECT_EQ(MetricValue(m, "proxima_requests_total{method=\"Put\",code=\"OK\"}"), 1);
  EXPECT_EQ(MetricValue(m, "proxima_transfer_bytes_total{transport=\"grpc_inline\",direction=\"in\"}"),
            3 * (256 << 10));
  EXPECT_GT(MetricValue(m, "proxima_request_duration_seconds_count{method=\"Get\"}"), 0);
  EXPECT_THAT(m, HasSubstr("proxima_build_info{"));
  // The memory limit the capacity was checked against: positive, at least the capacity.
  EXPECT_THAT(m, HasSubstr("proxima_memory_limit_bytes{source=\""));
  const size_t at = m.find("proxima_memory_limit_bytes{");
  const size_t value = m.find("} ", at);
  ASSERT_NE(value, std::string::npos);
  EXPECT_GE(std::stod(m.substr(value + 2)), 64 << 20);
}

}  // namespace
}  // namespace proxima
