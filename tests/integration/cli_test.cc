// Integration tests of the binaries' command lines: proximad's config validation and start-up
// failures, proximactl's commands and JSON output, and the C ABI from a C program.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace proxima::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/proxima-cfg-XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& yaml) {
    std::string path = dir_ + "/c" + std::to_string(n_++) + ".yaml";
    std::ofstream(path) << yaml;
    return path;
  }
  std::string dir_;
  int n_ = 0;
};

TEST_F(ConfigFileTest, InvalidConfigsExitNonZeroNamingKeyValueAndAllowed) {
  struct Case {
    std::string yaml;
    std::vector<std::string> mentions;
  };
  const Case cases[] = {
      {"server:\n  listen: 127.0.0.1:50051\n  max_batch: 5\n",
       {"server.max_batch", "unknown", "max_batch_blocks"}},
      {"tiers:\n  host:\n    capacity_bytes: 2 potatoes\n",
       {"tiers.host.capacity_bytes", "2 potatoes", "512MiB"}},
      {"log: {level: chatty}\n", {"log.level", "chatty", "debug, info, warning, error"}},
      {"namespaces: [{name: 'has space'}]\n", {"namespaces[0].name", "has space"}},
      {"server: {listen: [oops\n", {"not valid YAML"}},
  };
  for (const Case& c : cases) {
    std::string path = Write(c.yaml);
    CommandResult r = RunCommand({ProximadPath(), "--config=" + path});
    EXPECT_EQ(r.exit_code, 2) << c.yaml << r.err;
    EXPECT_THAT(r.err, HasSubstr(path)) << c.yaml;
    for (const std::string& m : c.mentions) EXPECT_THAT(r.err, HasSubstr(m)) << c.yaml;
  }
  CommandResult bad_set = RunCommand({ProximadPath(), "--set=index.shards=3"});
  EXPECT_EQ(bad_set.exit_code, 2);
  EXPECT_THAT(bad_set.err, AllOf(HasSubstr("index.shards"), HasSubstr("power of two")));
  CommandResult missing = RunCommand({ProximadPath(), "--config=/nonexistent.yaml"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.err, HasSubstr("/nonexistent.yaml"));
}

TEST_F(ConfigFileTest, CheckConfigPrintsWhatWouldRun) {
  std::string path = Write("tiers: {host: {capacity_bytes: 2GiB}}\n");
  CommandResult r = RunCommand(
      {ProximadPath(), "--config=" + path, "--check_config", "--set=server.listen=0.0.0.0:6000"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("capacity_bytes: 2147483648"), HasSubstr("0.0.0.0:6000")));
  CommandResult d = RunCommand({ProximadPath(), "--print_default_config"});
  EXPECT_EQ(d.exit_code, 0);
  EXPECT_THAT(d.out, HasSubstr("capacity_bytes: 1GiB"));
  // The printed default is itself a valid config file.
  std::string defaults = Write(d.out);
  EXPECT_EQ(RunCommand({ProximadPath(), "--config=" + defaults, "--check_config"}).exit_code, 0);
}

TEST(StartupTest, SocketOfALiveDaemonIsNotTakenOver) {
  ASSERT_OK_AND_ASSIGN(auto first, DaemonProcess::Start());
  struct stat st;
  ASSERT_EQ(stat(first->socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  CommandResult r = RunCommand({ProximadPath(), "--set=server.listen=127.0.0.1:0",
                                "--set=server.metrics_listen=",
                                "--set=server.unix_socket=" + first->socket_path()},
                               absl::Seconds(20));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("in use by a running server"));
  CommandResult port = RunCommand({ProximadPath(), "--set=server.unix_socket=",
                                   "--set=server.metrics_listen=",
                                   "--set=server.listen=127.0.0.1:" +
                                       std::to_string(first->tcp_port())},
                                  absl::Seconds(20));
  EXPECT_EQ(port.exit_code, 1);
  EXPECT_THAT(port.err, HasSubstr("cannot start the gRPC server"));
}

// A capacity the machine cannot give is refused at start (it would start, fill, and be killed
// by the OOM killer), naming the key, the value and the limit.
TEST(StartupTest, CapacityBeyondThisMachinesMemoryIsRefused) {
  const uint64_t physical =
      static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t capacity = 2 * physical;
  CommandResult r = RunCommand({ProximadPath(), "--set=server.listen=127.0.0.1:0",
                                "--set=server.metrics_listen=", "--set=server.unix_socket=",
                                "--set=tiers.host.capacity_bytes=" + std::to_string(capacity)},
                               absl::Seconds(20));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, AllOf(HasSubstr("tiers.host.capacity_bytes is " + std::to_string(capacity)),
                           HasSubstr("this process may use at most"),
                           HasSubstr("killed for lack of memory")));
}

TEST(ProximactlTest, CommandsWorkAndSpeakJson) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start());
  const std::string t = "--target=" + daemon->unix_target();
  CommandResult put = RunCommand({ProximactlPath(), "put", t, "--count=6", "--json"});
  EXPECT_EQ(put.exit_code, 0) << put.err;
  EXPECT_THAT(put.out, AllOf(HasSubstr("\"ok\":true"), HasSubstr("\"stored\":6")));
  CommandResult lookup = RunCommand({ProximactlPath(), "lookup", t, "--count=9", "--json"});
  EXPECT_THAT(lookup.out, HasSubstr("\"prefix_present\":6"));
  CommandResult get = RunCommand({ProximactlPath(), "get", t, "--count=8", "--json"});
  EXPECT_EQ(get.exit_code, 0);
  EXPECT_THAT(get.out, AllOf(HasSubstr("\"hits\":6"), HasSubstr("\"misses\":2"),
                             HasSubstr("\"wrong_bytes\":0")));
  CommandResult stats = RunCommand({ProximactlPath(), "stats", t, "--json"});
  EXPECT_THAT(stats.out, AllOf(HasSubstr("\"name\":\"host\""), HasSubstr("\"puts\":\"6\"")));
  CommandResult info = RunCommand({ProximactlPath(), "info", t});
  EXPECT_THAT(info.out, HasSubstr("transport: ucx (ucx: session "));
  CommandResult inline_info = RunCommand({ProximactlPath(), "info", t, "--transport=inline"});
  EXPECT_THAT(inline_info.out, HasSubstr("transport: inline (inline: chosen by the caller)"));
  CommandResult bad_transport = RunCommand({ProximactlPath(), "info", t, "--transport=rdma"});
  EXPECT_NE(bad_transport.exit_code, 0);
  EXPECT_THAT(bad_transport.err, HasSubstr("transport 'rdma' is unknown"));
  CommandResult load = RunCommand(
      {ProximactlPath(), "load", t, "--duration=1", "--clients=2", "--json"});
  EXPECT_EQ(load.exit_code, 0) << load.out << load.err;
  EXPECT_THAT(load.out, AllOf(HasSubstr("\"errors\":0"), HasSubstr("\"wrong_bytes\":0")));
  EXPECT_THAT(load.err, HasSubstr("calls"));  // progress lines
  CommandResult del = RunCommand({ProximactlPath(), "delete", t, "--count=6", "--json"});
  EXPECT_THAT(del.out, HasSubstr("\"deleted\":6"));
  // The test profile's RoPE base (for k4v3 levels) is part of its identity, and checked: the
  // same blocks put again under a RoPE base are another profile's, stored again.
  CommandResult plain = RunCommand({ProximactlPath(), "put", t, "--count=2", "--json"});
  EXPECT_THAT(plain.out, HasSubstr("\"stored\":2"));
  CommandResult with_base =
      RunCommand({ProximactlPath(), "put", t, "--count=2", "--rope_theta=500000", "--json"});
  EXPECT_EQ(with_base.exit_code, 0) << with_base.err;
  EXPECT_THAT(with_base.out, HasSubstr("\"stored\":2"));
  CommandResult bad_base =
      RunCommand({ProximactlPath(), "put", t, "--count=2", "--rope_theta=0.5", "--json"});
  EXPECT_NE(bad_base.exit_code, 0);
  EXPECT_THAT(bad_base.out + bad_base.err, HasSubstr("profile.rope_theta is 0.5"));
}

TEST(ProximactlTest, HealthServiceAnswersForTheServerAndForKVTier) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start());
  for (const char* service : {"--service=proxima.v1.KVTier", "--service="}) {
    CommandResult r = RunCommand(
        {ProximactlPath(), "health", "--target=" + daemon->tcp_target(), service, "--json"});
    EXPECT_EQ(r.exit_code, 0) << service << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("\"status\":\"SERVING\"")) << service;
  }
  CommandResult unknown = RunCommand({ProximactlPath(), "health",
                                      "--target=" + daemon->unix_target(), "--service=nope",
                                      "--json"});
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.out, HasSubstr("NOT_FOUND"));
}

TEST(ProximactlTest, HelpForEveryCommandAndClearErrors) {
  for (const char* cmd : {"info", "health", "stats", "put", "get", "lookup", "delete", "load"}) {
    CommandResult r = RunCommand({ProximactlPath(), cmd, "--help"});
    EXPECT_EQ(r.exit_code, 0) << cmd;
    EXPECT_THAT(r.out, AllOf(HasSubstr(std::string("proximactl ") + cmd), HasSubstr("--target")))
        << cmd;
  }
  CommandResult unknown = RunCommand({ProximactlPath(), "frobnicate"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("unknown command 'frobnicate'"));
  CommandResult dead = RunCommand({ProximactlPath(), "stats", "--target=127.0.0.1:1",
                                   "--timeout=1", "--json"},
                                  absl::Seconds(10));
  EXPECT_EQ(dead.exit_code, 1);
  EXPECT_THAT(dead.out, AllOf(HasSubstr("\"ok\":false"), HasSubstr("UNAVAILABLE")));
}

TEST(CAbiTest, CProgramRoundTripsThroughTheSharedLibrary) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start());
  CommandResult r = RunCommand({C_ABI_TEST_PATH, daemon->unix_target()});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("c abi ok"));
}

}  // namespace
}  // namespace proxima::testing
