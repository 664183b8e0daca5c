// Integration tests of the UCX data plane: the real proximad, real UCX between two processes on
// loopback, over TCP (UCX_TLS=tcp) and over shared memory (UCX_TLS=posix,self). Driven through
// libproxima, raw gRPC stubs with this process's own ucx::Worker, and proximactl. UcxAuthTest:
// the UCX calls under bearer tokens (authentication, read-only tokens, session ownership,
// private prefixes).
#include "common/ucx.h"

#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
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
#include "common/status_macros.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_blocks.h"

namespace proxima {
namespace {

using ::proxima::client::BlockKey;
using ::proxima::client::Client;
using ::proxima::client::ClientOptions;
using ::proxima::client::Profile;
using ::proxima::client::PutOutcome;
using ::proxima::client::Transport;
using ::proxima::testing::DaemonProcess;
using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;

// 4 layers x 16 tokens x 8 heads x 128 dim x bf16 x (K, V) = 256 KiB blocks; 64 KiB per layer.
v1::ModelProfile TestModel(uint32_t tokens = 16) {
  return ::proxima::testing::TestModel(tokens, "ucx-it-model");
}

using ::proxima::testing::MetricValue;

double Metric(const DaemonProcess& d, const std::string& series) {
  absl::StatusOr<std::string> m = d.ScrapeMetrics();
  return m.ok() ? MetricValue(*m, series) : -2;
}

// Waits (bounded) until `series` reads `value`; returns the last value read.
double WaitForMetric(const DaemonProcess& d, const std::string& series, double value,
                     absl::Duration timeout = absl::Seconds(10)) {
  absl::Time end = absl::Now() + timeout;
  double v = Metric(d, series);
  while (v != value && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(20));
    v = Metric(d, series);
  }
  return v;
}

int OpenFds(pid_t pid) {
  DIR* dir = opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n;
}

// The pid of a running process (other than this one) with `argument` among its arguments, or -1.
pid_t ProcessWithArgument(const std::string& argument) {
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return -1;
  pid_t found = -1;
  while (dirent* e = readdir(proc)) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(e->d_name, &pid) || pid == getpid()) continue;
    std::ifstream in(absl::StrCat("/proc/", pid, "/cmdline"), std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (absl::string_view arg : absl::StrSplit(cmdline, '\0')) {
      if (arg == argument) found = pid;
    }
    if (found > 0) break;
  }
  closedir(proc);
  return found;
}

// `rounds` rounds of Put and Get of `blocks` blocks, chains first_seed, first_seed + 1, ..., in
// memory `c` allocated with UCX (Client::AllocateMemory), every byte checked.
void RoundTripAllocatedBlocks(Client& c, const Profile& p, size_t blocks, int rounds,
                              uint64_t first_seed) {
  std::vector<client::MemoryRegion> regions;
  std::vector<std::span<std::byte>> buffers;
  for (size_t i = 0; i < blocks; ++i) {
    ASSERT_OK_AND_ASSIGN(client::MemoryRegion r, c.AllocateMemory(p.block_bytes));
    ASSERT_EQ(r.bytes().size(), p.block_bytes);
    buffers.push_back(r.bytes());
    regions.push_back(std::move(r));
  }
  for (int round = 0; round < rounds; ++round) {
    const uint64_t seed = first_seed + round;
    const std::vector<BlockKey> keys = client::TestKeyChain(seed, 0, blocks);
    std::vector<std::span<const std::byte>> in;
    for (size_t i = 0; i < blocks; ++i) {
      client::FillTestBlock(seed, i, buffers[i]);
      in.push_back(buffers[i]);
    }
    ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> outcomes, c.Put(p, keys, in));
    EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
    for (auto& b : buffers) std::fill(b.begin(), b.end(), std::byte{0});
    ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c.Get(p, keys, buffers));
    for (size_t i = 0; i < blocks; ++i) {
      EXPECT_TRUE(found[i] && client::IsTestBlock(seed, i, buffers[i])) << round << " " << i;
    }
  }
}

// The parameter: UCX_TLS, then optionally ":shm_open" or ":dir", the posix transport's other
// two ways of naming a segment (UCX_POSIX_USE_PROC_LINK=n; with ":dir", segments are files in a
// directory of the test's own, UCX_POSIX_DIR, not in /dev/shm). By default a posix key names the
// segment as /proc/PID/fd/FD.
class UcxIntegrationTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    // Both processes pick their transports from the environment.
    const std::string param = GetParam();
    const size_t colon = param.find(':');
    setenv("UCX_TLS", param.substr(0, colon).c_str(), 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    if (colon != std::string::npos) {
      posix_mode_ = param.substr(colon + 1);
      setenv("UCX_POSIX_USE_PROC_LINK", "n", 1);
      if (posix_mode_ == "dir") {
        char tmpl[] = "/tmp/proxima-ucx-posix-XXXXXX";
        ASSERT_NE(mkdtemp(tmpl), nullptr) << std::strerror(errno);
        posix_dir_ = tmpl;
        setenv("UCX_POSIX_DIR", tmpl, 1);
      }
    }
    auto d =
        DaemonProcess::Start({"tiers.host.capacity_bytes=256MiB", "server.max_batch_blocks=8"});
    ASSERT_OK(d.status());
    daemon_ = *std::move(d);
  }
  // Without procfs links a segment's file stays until UCX frees the segment, so the daemon stops
  // by SIGTERM here, which frees its own. Then nothing may be left in the test's directory: no
  // segment of this process's workers (freed by now) and none of the daemon's address-check
  // children, which end without freeing theirs.
  void TearDown() override {
    unsetenv("UCX_TLS");
    if (posix_mode_.empty()) return;
    unsetenv("UCX_POSIX_USE_PROC_LINK");
    unsetenv("UCX_POSIX_DIR");
    if (daemon_ != nullptr && daemon_->pid() > 0) {
      daemon_->Signal(SIGTERM);
      EXPECT_EQ(daemon_->WaitExit(absl::Seconds(15)), 0) << daemon_->Log();
    }
    if (posix_dir_.empty()) return;
    std::vector<std::string> left;
    for (const auto& entry : std::filesystem::directory_iterator(posix_dir_)) {
      left.push_back(entry.path().filename().string());
    }
    EXPECT_THAT(left, ::testing::IsEmpty()) << "shared-memory segment files left in " << posix_dir_;
    std::filesystem::remove_all(posix_dir_);
  }

  std::unique_ptr<Client> Connect(Transport transport) {
    ClientOptions options;
    options.target = daemon_->tcp_target();
    options.transport = transport;
    options.call_timeout = absl::Seconds(20);
    auto c = Client::Connect(options);
    EXPECT_OK(c.status());
    return c.ok() ? *std::move(c) : nullptr;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::string posix_mode_;  // "", "shm_open" or "dir"
  std::string posix_dir_;   // UCX_POSIX_DIR in "dir" mode
};

TEST_P(UcxIntegrationTest, BatchRoundTripsAreByteExactAndInteroperateWithInline) {
  auto c = Connect(Transport::kAuto);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->transport(), Transport::kUcx) << c->transport_detail();
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_sessions"), 1);

  // 20 blocks in one registered buffer: 3 calls of at most 8 blocks.
  constexpr size_t kBlocks = 20;
  std::vector<std::byte> cache(kBlocks * p.block_bytes);
  ASSERT_OK_AND_ASSIGN(client::MemoryRegion region, c->RegisterMemory(cache.data(), cache.size()));
  std::vector<BlockKey> keys = client::TestKeyChain(1, 0, kBlocks);
  std::vector<std::span<const std::byte>> in;
  for (size_t i = 0; i < kBlocks; ++i) {
    std::span<std::byte> b(cache.data() + i * p.block_bytes, p.block_bytes);
    client::FillTestBlock(1, i, b);
    in.push_back(b);
  }
  ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> outcomes, c->Put(p, keys, in));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  ASSERT_OK_AND_ASSIGN(outcomes, c->Put(p, keys, in));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kAlreadyPresent));

  std::fill(cache.begin(), cache.end(), std::byte{0});
  std::vector<std::span<std::byte>> out;
  for (size_t i = 0; i < kBlocks; ++i)
    out.emplace_back(cache.data() + i * p.block_bytes, p.block_bytes);
  std::vector<BlockKey> with_miss = keys;
  with_miss[7] = client::TestKeyChain(99, 0, 1)[0];
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->Get(p, with_miss, out));
  for (size_t i = 0; i < kBlocks; ++i) {
    EXPECT_EQ(found[i], i != 7) << i;
    if (i != 7) {
      EXPECT_TRUE(client::IsTestBlock(1, i, out[i])) << i;
    }
  }

  // Blocks stored over UCX read back inline, and the other way round.
  auto inline_client = Connect(Transport::kInline);
  ASSERT_NE(inline_client, nullptr);
  EXPECT_EQ(inline_client->transport(), Transport::kInline);
  std::vector<std::byte> one(p.block_bytes);
  std::vector<std::span<std::byte>> one_out = {one};
  ASSERT_OK_AND_ASSIGN(found, inline_client->Get(p, std::span(keys).subspan(13, 1), one_out));
  EXPECT_TRUE(found[0] && client::IsTestBlock(1, 13, one));
  std::vector<BlockKey> other = client::TestKeyChain(2, 0, 1);
  client::FillTestBlock(2, 0, one);
  std::vector<std::span<const std::byte>> one_in = {one};
  ASSERT_OK(inline_client->Put(p, other, one_in).status());
  std::vector<std::byte> back(p.block_bytes);  // not registered: registered for the call
  std::vector<std::span<std::byte>> back_out = {back};
  ASSERT_OK_AND_ASSIGN(found, c->Get(p, other, back_out));
  EXPECT_TRUE(found[0] && client::IsTestBlock(2, 0, back));

  ASSERT_OK_AND_ASSIGN(std::string m, daemon_->ScrapeMetrics());
  EXPECT_EQ(MetricValue(m, "proxima_transfer_bytes_total{transport=\"ucx\",direction=\"in\"}"),
            kBlocks * p.block_bytes);
  EXPECT_EQ(MetricValue(m, "proxima_transfer_bytes_total{transport=\"ucx\",direction=\"out\"}"),
            (kBlocks - 1 + 1) * p.block_bytes);
  EXPECT_EQ(MetricValue(m, "proxima_requests_total{method=\"PutUcx\",code=\"OK\"}"), 6);
  // Over tcp every call's bytes moved as messages (the daemon never the initiator of a one-sided
  // operation on the client); over shared memory the client staged them in memory UCX allocated,
  // which the daemon copied itself.
  const bool tcp = std::string(GetParam()) == "tcp";
  EXPECT_EQ(MetricValue(m, "proxima_ucx_calls_by_messages_total{op=\"put\"}"), tcp ? 6 : 0);
  EXPECT_EQ(MetricValue(m, "proxima_ucx_calls_by_messages_total{op=\"get\"}"), tcp ? 4 : 0);

  // Closing the client closes its session and endpoint; the arena stays registered.
  region = client::MemoryRegion();
  c.reset();
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_sessions", 0), 0);
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_endpoints", 0), 0);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_registrations"), 1);
}

// Buffers from Client::AllocateMemory (over shared memory: segments UCX allocated, which the
// daemon maps and copies into directly) round-trip byte-exact, and the daemon unpacks each
// buffer's key once for the session however many calls name it.
TEST_P(UcxIntegrationTest, AllocatedBuffersRoundTripAndEachKeyIsUnpackedOnce) {
  auto c = Connect(Transport::kUcx);
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  constexpr size_t kBlocks = 4;
  const double unpacked_before = Metric(*daemon_, "proxima_ucx_rkeys_unpacked_total");
  const double direct_before = Metric(*daemon_, "proxima_ucx_direct_transfers_total");
  constexpr int kRounds = 5;
  ASSERT_NO_FATAL_FAILURE(RoundTripAllocatedBlocks(*c, p, kBlocks, kRounds, 40));
  // One unpack per buffer, not per call.
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_rkeys_unpacked_total") - unpacked_before, kBlocks);
  // Over shared memory the daemon copied every put and get itself through the mapped segments
  // (puts checksummed as they were copied); over tcp UCX moved them.
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_direct_transfers_total") - direct_before,
            std::string(GetParam()) == "tcp" ? 0 : 2 * kRounds);
  c.reset();
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_sessions", 0), 0);
}

// Blocks in ordinary memory (registered or not) move through the client's UCX-allocated host
// staging when the daemon reaches the client over posix (ClientOptions::host_staging = auto),
// and as they are over tcp; forced either way, both round-trip byte-exact, scattered over many
// buffers, in batches larger than one staging half, with a miss among them. Staging shows in
// the daemon's key unpacks: one staging region for every call, against a fresh registration
// per call for unregistered memory.
TEST_P(UcxIntegrationTest, OrdinaryMemoryMovesThroughHostStagingOverSharedMemory) {
  const bool shm = std::string(GetParam()) != "tcp";
  auto connect = [&](client::HostStaging staging) -> std::unique_ptr<Client> {
    ClientOptions options;
    options.target = daemon_->tcp_target();
    options.transport = Transport::kUcx;
    options.call_timeout = absl::Seconds(20);
    options.host_staging = staging;
    options.host_staging_bytes = size_t{1} << 20;  // halves of 2 blocks of 256 KiB
    auto c = Client::Connect(options);
    EXPECT_OK(c.status());
    return c.ok() ? *std::move(c) : nullptr;
  };
  {
    auto c = connect(client::HostStaging::kAuto);
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(absl::StrContains(c->transport_detail(), "over posix"), shm) << c->transport_detail();
    EXPECT_EQ(absl::StrContains(c->transport_detail(), "host staging"), shm)
        << c->transport_detail();
  }
  int seed = 60;
  for (client::HostStaging staging : {client::HostStaging::kAlways, client::HostStaging::kNever}) {
    SCOPED_TRACE(client::HostStagingName(staging));
    auto c = connect(staging);
    ASSERT_NE(c, nullptr);
    ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
    constexpr size_t kBlocks = 7;  // 4 chunks of 2, 2, 2 and 1 blocks when staged
    const size_t layer_bytes = p.block_bytes / 4;
    std::vector<std::vector<std::byte>> layers(4, std::vector<std::byte>(kBlocks * layer_bytes));
    ASSERT_OK_AND_ASSIGN(client::MemoryRegion r0,
                         c->RegisterMemory(layers[0].data(), layers[0].size()));
    ++seed;
    std::vector<BlockKey> keys = client::TestKeyChain(seed, 0, kBlocks);
    std::vector<std::vector<std::byte>> expected(kBlocks, std::vector<std::byte>(p.block_bytes));
    std::vector<client::ConstSegments> in(kBlocks);
    std::vector<client::Segments> out(kBlocks);
    for (size_t b = 0; b < kBlocks; ++b) {
      client::FillTestBlock(seed, b, expected[b]);
      for (size_t l = 0; l < 4; ++l) {
        std::byte* slice = layers[l].data() + b * layer_bytes;
        std::memcpy(slice, expected[b].data() + l * layer_bytes, layer_bytes);
        in[b].push_back({slice, 777});
        in[b].push_back({slice + 777, layer_bytes - 777});
        out[b].push_back({slice, layer_bytes});
      }
    }
    const double unpacked_before = Metric(*daemon_, "proxima_ucx_rkeys_unpacked_total");
    ASSERT_OK_AND_ASSIGN(auto outcomes, c->PutScattered(p, keys, in));
    EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
    for (auto& l : layers) std::fill(l.begin(), l.end(), std::byte{0});
    std::vector<BlockKey> with_miss = keys;
    with_miss[4] = client::TestKeyChain(seed + 100, 0, 1)[0];
    ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->GetScattered(p, with_miss, out));
    for (size_t b = 0; b < kBlocks; ++b) {
      ASSERT_EQ(found[b], b != 4) << b;
      if (b == 4) continue;
      for (size_t l = 0; l < 4; ++l) {
        EXPECT_EQ(0, std::memcmp(layers[l].data() + b * layer_bytes,
                                 expected[b].data() + l * layer_bytes, layer_bytes))
            << "block " << b << " layer " << l;
      }
    }
    // Contiguous blocks in one unregistered buffer, several calls.
    std::vector<std::byte> flat(3 * p.block_bytes);
    std::vector<std::span<std::byte>> flat_out;
    for (size_t b = 0; b < 3; ++b)
      flat_out.emplace_back(flat.data() + b * p.block_bytes, p.block_bytes);
    for (int call = 0; call < 3; ++call) {
      std::fill(flat.begin(), flat.end(), std::byte{0});
      ASSERT_OK_AND_ASSIGN(found, c->Get(p, std::span(keys).subspan(0, 3), flat_out));
      for (size_t b = 0; b < 3; ++b)
        EXPECT_TRUE(found[b] && flat_out[b].size() == p.block_bytes &&
                    std::memcmp(flat_out[b].data(), expected[b].data(), p.block_bytes) == 0)
            << b;
    }
    const double unpacked = Metric(*daemon_, "proxima_ucx_rkeys_unpacked_total") - unpacked_before;
    if (staging == client::HostStaging::kAlways) {
      EXPECT_EQ(unpacked, 1);  // the staging region, named by every call
    } else {
      // Unregistered layers and the flat buffer: registered anew for each call.
      EXPECT_GE(unpacked, 5);
    }
  }
}

// Host-staged calls from several threads of one client run at once, each through halves of
// its own (an engine's prefetch and backup threads share a client), byte-exact; the halves are
// kept for later calls, so the daemon unpacks at most one key per concurrent call.
TEST_P(UcxIntegrationTest, ConcurrentHostStagedCallsOfOneClientEachGetTheirOwnHalves) {
  ClientOptions options;
  options.target = daemon_->tcp_target();
  options.transport = Transport::kUcx;
  options.call_timeout = absl::Seconds(20);
  options.host_staging = client::HostStaging::kAlways;
  options.host_staging_bytes = size_t{1} << 20;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  constexpr int kThreads = 3, kRounds = 6;
  constexpr size_t kBlocks = 3;
  const double unpacked_before = Metric(*daemon_, "proxima_ucx_rkeys_unpacked_total");
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::byte> buf(kBlocks * p.block_bytes);  // not registered
      std::vector<std::span<std::byte>> out;
      std::vector<std::span<const std::byte>> in;
      for (size_t b = 0; b < kBlocks; ++b) {
        out.emplace_back(buf.data() + b * p.block_bytes, p.block_bytes);
        in.emplace_back(out.back());
      }
      for (int r = 0; r < kRounds; ++r) {
        const int seed = 200 + t * kRounds + r;
        std::vector<BlockKey> keys = client::TestKeyChain(seed, 0, kBlocks);
        for (size_t b = 0; b < kBlocks; ++b) client::FillTestBlock(seed, b, out[b]);
        if (!c->Put(p, keys, in).ok()) ++failed;
        std::fill(buf.begin(), buf.end(), std::byte{0});
        absl::StatusOr<std::vector<bool>> found = c->Get(p, keys, out);
        if (!found.ok()) {
          ++failed;
          continue;
        }
        for (size_t b = 0; b < kBlocks; ++b) {
          if (!(*found)[b] || !client::IsTestBlock(seed, b, out[b])) ++wrong;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  const double unpacked = Metric(*daemon_, "proxima_ucx_rkeys_unpacked_total") - unpacked_before;
  EXPECT_GE(unpacked, 1);
  EXPECT_LE(unpacked, kThreads);  // one pair of halves per call running at once, reused after
}

// Put hints travel over UCX as they do inline: a high-priority put is held at its level (0 here:
// raw), and a block's chain position reaches the encoder (position 0 is encoded as the first
// block, with the attention-sink codec). The high-priority blocks are the coldest, so without
// their priority the tierer would compress them first.
TEST_P(UcxIntegrationTest, PutHintsTravelOverUcx) {
  auto d = DaemonProcess::Start(
      {"tiers.host.capacity_bytes=4MiB",
       "namespaces=[{name: default, compression: {enabled: true, levels: [int8], "
       "trigger: {memory_pressure_threshold: 0.7}, priority: {high_max_level: 0}}}]"});
  ASSERT_OK(d.status());
  ClientOptions options;
  options.target = (*d)->tcp_target();
  options.transport = Transport::kUcx;
  options.call_timeout = absl::Seconds(20);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(options));
  ASSERT_EQ(c->transport(), Transport::kUcx) << c->transport_detail();
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  constexpr size_t kHigh = 6, kNormal = 6;  // 12 x 256 KiB = 3 MiB, over 0.7 x 4 MiB
  std::vector<std::byte> cache((kHigh + kNormal) * p.block_bytes);
  ASSERT_OK_AND_ASSIGN(client::MemoryRegion region, c->RegisterMemory(cache.data(), cache.size()));
  std::vector<BlockKey> keys = client::TestKeyChain(5, 0, kHigh + kNormal);
  std::vector<std::span<const std::byte>> blocks;
  for (size_t i = 0; i < kHigh + kNormal; ++i) {
    std::span<std::byte> b(cache.data() + i * p.block_bytes, p.block_bytes);
    client::FillTestBlock(5, i, b);
    blocks.push_back(b);
  }
  client::PutOptions high;
  high.high_priority = true;
  ASSERT_OK_AND_ASSIGN(
      std::vector<PutOutcome> out,
      c->Put(p, std::span(keys).subspan(0, kHigh), std::span(blocks).subspan(0, kHigh), high));
  EXPECT_THAT(out, ::testing::Each(PutOutcome::kStored));
  std::vector<int64_t> positions(kNormal);
  std::vector<float> importance(kNormal, 0.0f);
  for (size_t i = 0; i < kNormal; ++i) positions[i] = static_cast<int64_t>(i);
  client::PutOptions normal;
  normal.positions = positions;
  normal.importance = importance;
  ASSERT_OK_AND_ASSIGN(
      out, c->Put(p, std::span(keys).subspan(kHigh), std::span(blocks).subspan(kHigh), normal));
  EXPECT_THAT(out, ::testing::Each(PutOutcome::kStored));
  ASSERT_OK_AND_ASSIGN(std::string m, (*d)->ScrapeMetrics());
  EXPECT_EQ(MetricValue(m, "proxima_requests_total{method=\"PutUcx\",code=\"OK\"}"), 2);
  EXPECT_LE(MetricValue(m, "proxima_requests_total{method=\"Put\",code=\"OK\"}"), 0)
      << "a put with hints went inline";

  // The tierer compresses the coldest blocks it may until the tier is under 70%: the first
  // normal blocks, not the (colder) high-priority ones.
  // Waits on Stats, which reads counters only: reading the blocks would pin them under the
  // tierer's feet.
  uint64_t encoded = 0;
  for (int attempt = 0; attempt < 200; ++attempt) {
    ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, c->Stats());
    encoded = 0;
    for (const v1::LevelStats& l : stats.tiers(0).levels())
      encoded += l.level() > 0 ? l.blocks() : 0;
    if (encoded >= 2) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_GE(encoded, 2u) << "the tierer did not encode two blocks within 10 s";
  ASSERT_OK_AND_ASSIGN(std::vector<std::optional<client::StoredBlock>> stored,
                       c->GetStored(p, keys));
  for (size_t i = 0; i < kHigh; ++i) {
    ASSERT_TRUE(stored[i].has_value()) << i;
    EXPECT_EQ(stored[i]->level, 0u) << "high-priority block " << i << " was compressed";
  }
  ASSERT_TRUE(stored[kHigh].has_value() && stored[kHigh]->level > 0)
      << "the coldest normal block (position 0) was not compressed";
  for (size_t i = kHigh; i < kHigh + kNormal; ++i) {
    if (!stored[i].has_value() || stored[i]->level == 0) continue;
    ASSERT_OK_AND_ASSIGN(codec::BlockHeaderInfo info,
                         codec::InspectBlock(std::as_bytes(
                             std::span(stored[i]->bytes.data(), stored[i]->bytes.size()))));
    EXPECT_EQ(info.is_first_block, i == kHigh) << "block at position " << i - kHigh;
  }
}

TEST_P(UcxIntegrationTest, ScatterGatherBlocksSpanManyBuffers) {
  auto c = Connect(Transport::kUcx);
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  // vLLM-like layout: one buffer per layer, each holding that layer's slice of every block.
  // Layer slices are uneven on purpose (K and V of a layer split at an odd offset).
  constexpr size_t kBlocks = 6;
  const size_t layer_bytes = p.block_bytes / 4;
  std::vector<std::vector<std::byte>> layers(4, std::vector<std::byte>(kBlocks * layer_bytes));
  ASSERT_OK_AND_ASSIGN(client::MemoryRegion r0,
                       c->RegisterMemory(layers[0].data(), layers[0].size()));
  ASSERT_OK_AND_ASSIGN(client::MemoryRegion r1,
                       c->RegisterMemory(layers[1].data(), layers[1].size()));
  // layers[2] and [3] are not registered: registered for each call.
  std::vector<BlockKey> keys = client::TestKeyChain(7, 0, kBlocks);
  std::vector<std::vector<std::byte>> expected(kBlocks, std::vector<std::byte>(p.block_bytes));
  std::vector<client::ConstSegments> in(kBlocks);
  for (size_t b = 0; b < kBlocks; ++b) {
    client::FillTestBlock(7, b, expected[b]);
    for (size_t l = 0; l < 4; ++l) {
      std::byte* slice = layers[l].data() + b * layer_bytes;
      std::memcpy(slice, expected[b].data() + l * layer_bytes, layer_bytes);
      in[b].push_back({slice, 1000});
      in[b].push_back({slice + 1000, layer_bytes - 1000});
    }
  }
  ASSERT_OK_AND_ASSIGN(auto outcomes, c->PutScattered(p, keys, in));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  // Contiguous reads give the gathered bytes...
  std::vector<std::vector<std::byte>> whole(kBlocks, std::vector<std::byte>(p.block_bytes));
  std::vector<std::span<std::byte>> whole_out(whole.begin(), whole.end());
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->Get(p, keys, whole_out));
  for (size_t b = 0; b < kBlocks; ++b) EXPECT_TRUE(found[b] && whole[b] == expected[b]) << b;
  // ...and scattered reads land each slice in its layer buffer.
  for (auto& l : layers) std::fill(l.begin(), l.end(), std::byte{0});
  std::vector<client::Segments> out(kBlocks);
  for (size_t b = 0; b < kBlocks; ++b) {
    for (size_t l = 0; l < 4; ++l)
      out[b].push_back({layers[l].data() + b * layer_bytes, layer_bytes});
  }
  ASSERT_OK_AND_ASSIGN(found, c->GetScattered(p, keys, out));
  for (size_t b = 0; b < kBlocks; ++b) {
    ASSERT_TRUE(found[b]);
    for (size_t l = 0; l < 4; ++l) {
      EXPECT_EQ(0, std::memcmp(layers[l].data() + b * layer_bytes,
                               expected[b].data() + l * layer_bytes, layer_bytes))
          << "block " << b << " layer " << l;
    }
  }
  // Segments that do not add up to a block are refused before anything moves.
  std::vector<client::Segments> short_out(1);
  short_out[0].push_back({layers[0].data(), layer_bytes});
  EXPECT_THAT(c->GetScattered(p, std::span(keys).first(1), short_out).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("add up to")));
}

// Raw protocol: this process's own worker and a generated stub, to send what libproxima never
// would.
class RawUcxTest : public UcxIntegrationTest {
 protected:
  void SetUp() override {
    UcxIntegrationTest::SetUp();
    if (HasFatalFailure()) return;
    auto w = ucx::Worker::Create("raw-test");
    ASSERT_OK(w.status());
    worker_ = *std::move(w);
    stub_ = v1::KVTier::NewStub(
        grpc::CreateChannel(daemon_->tcp_target(), grpc::InsecureChannelCredentials()));
    v1::RegisterProfileRequest rp;
    rp.set_namespace_name("default");
    *rp.mutable_profile() = TestModel();
    v1::RegisterProfileResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->RegisterProfile(&ctx, rp, &resp).ok());
    profile_id_ = resp.profile_id();
    block_bytes_ = resp.block_bytes();
  }
  void TearDown() override {
    reg_.reset();
    worker_.reset();
    // An idle gRPC channel would hold a SIGTERMed daemon (UcxIntegrationTest::TearDown) for up
    // to 5 s: gRPC 1.51's client reads the daemon's GOAWAY on an idle channel only when its
    // backup poller next runs.
    stub_.reset();
    UcxIntegrationTest::TearDown();
  }

  // `daemon_worker` (may be null): the daemon's worker address from the answer.
  absl::StatusOr<uint64_t> OpenSession(const std::string& address,
                                       std::string* daemon_worker = nullptr) {
    v1::ConnectUcxRequest req;
    req.set_worker_address(address);
    v1::ConnectUcxResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    PROXIMA_RETURN_IF_ERROR(client::FromGrpc(stub_->ConnectUcx(&ctx, req, &resp)));
    if (daemon_worker != nullptr) *daemon_worker = resp.worker_address();
    return resp.session_id();
  }
  absl::Status CloseSession(uint64_t id) {
    v1::DisconnectUcxRequest req;
    req.set_session_id(id);
    v1::DisconnectUcxResponse resp;
    grpc::ClientContext ctx;
    return client::FromGrpc(stub_->DisconnectUcx(&ctx, req, &resp));
  }

  // A PutUcx of one block from `src_` (registered), with one segment.
  v1::PutUcxRequest OneBlockPut(uint64_t session, const BlockKey& key) {
    return OneBlockPut(session, key, reg_->packed_rkey(), src_.data(), src_.size());
  }
  // A PutUcx of the one block at `base` of a region of `region_bytes` that `rkey` names.
  v1::PutUcxRequest OneBlockPut(uint64_t session, const BlockKey& key, const std::string& rkey,
                                const std::byte* base, size_t region_bytes) {
    v1::PutUcxRequest req;
    req.set_namespace_name("default");
    req.set_profile_id(profile_id_);
    req.set_session_id(session);
    v1::UcxRegion* r = req.add_regions();
    r->set_rkey(rkey);
    r->set_address(reinterpret_cast<uint64_t>(base));
    r->set_length(region_bytes);
    v1::UcxBlock* b = req.add_blocks();
    b->set_key(std::string(reinterpret_cast<const char*>(key.data()), key.size()));
    v1::UcxSegment* s = b->add_segments();
    s->set_region(0);
    s->set_address(reinterpret_cast<uint64_t>(base));
    s->set_length(block_bytes_);
    b->set_crc32c(Crc32c(std::span(base, block_bytes_)));
    return req;
  }
  absl::Status Put(const v1::PutUcxRequest& req, int deadline_seconds = 20) {
    v1::PutResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_seconds));
    return client::FromGrpc(stub_->PutUcx(&ctx, req, &resp));
  }
  uint32_t Present(const BlockKey& key) {
    v1::LookupRequest req;
    req.set_namespace_name("default");
    req.set_profile_id(profile_id_);
    req.add_keys(std::string(reinterpret_cast<const char*>(key.data()), key.size()));
    v1::LookupResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub_->Lookup(&ctx, req, &resp).ok());
    return resp.num_prefix_present();
  }
  // Whether proximad still serves: a Lookup is answered and the process has not ended (a daemon
  // that crashed may take a moment to end; the Lookup waits for that).
  bool DaemonServes() {
    v1::LookupRequest req;
    req.set_namespace_name("default");
    req.set_profile_id(profile_id_);
    const BlockKey probe = client::TestKeyChain(99, 0, 1)[0];
    req.add_keys(std::string(reinterpret_cast<const char*>(probe.data()), probe.size()));
    v1::LookupResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const bool answered = stub_->Lookup(&ctx, req, &resp).ok();
    int wait_status = 0;
    return answered && waitpid(daemon_->pid(), &wait_status, WNOHANG) == 0;
  }
  void RegisterSource(size_t blocks) {
    src_.resize(blocks * block_bytes_);
    for (size_t i = 0; i < blocks; ++i) {
      client::FillTestBlock(3, i, std::span(src_).subspan(i * block_bytes_, block_bytes_));
    }
    auto r = worker_->Register(src_.data(), src_.size());
    ASSERT_OK(r.status());
    reg_ = *std::move(r);
  }

  std::unique_ptr<ucx::Worker> worker_;
  std::unique_ptr<v1::KVTier::Stub> stub_;
  uint64_t profile_id_ = 0;
  uint64_t block_bytes_ = 0;
  std::vector<std::byte> src_;
  std::shared_ptr<ucx::Registration> reg_;
};

TEST_P(RawUcxTest, BadInputGetsClearErrorsAndStoresNothing) {
  RegisterSource(1);
  ASSERT_OK_AND_ASSIGN(uint64_t session, OpenSession(worker_->address()));
  const BlockKey key = client::TestKeyChain(3, 0, 1)[0];

  v1::PutUcxRequest req = OneBlockPut(session, key);
  req.mutable_regions(0)->set_rkey(std::string(40, '\xa5'));
  EXPECT_THAT(Put(req),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rkeys[0] does not unpack")));
  req = OneBlockPut(session, key);
  req.mutable_regions(0)->set_rkey(reg_->packed_rkey().substr(0, reg_->packed_rkey().size() - 1));
  EXPECT_THAT(Put(req),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rkeys[0] does not unpack")));

  req = OneBlockPut(session, key);
  req.mutable_blocks(0)->mutable_segments(0)->set_length(block_bytes_ - 64);
  EXPECT_THAT(Put(req),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("segments add up to")));
  req = OneBlockPut(session, key);
  req.mutable_blocks(0)->mutable_segments(0)->set_address(reinterpret_cast<uint64_t>(src_.data()) +
                                                          64);  // runs past the end of the region
  EXPECT_THAT(Put(req), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("expected a non-empty range inside regions[0]")));
  req = OneBlockPut(session, key);
  req.mutable_blocks(0)->mutable_segments(0)->set_region(3);
  EXPECT_THAT(Put(req), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(".region is 3")));

  // The bytes pulled do not match the CRC32C the client declared (changed mid-transfer).
  req = OneBlockPut(session, key);
  req.mutable_blocks(0)->set_crc32c(req.blocks(0).crc32c() ^ 1);
  EXPECT_THAT(Put(req),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nothing was stored")));

  req = OneBlockPut(session ^ 0x5a5a, key);
  EXPECT_THAT(Put(req), StatusIs(absl::StatusCode::kNotFound, HasSubstr("UCX session")));

  EXPECT_THAT(OpenSession("").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("worker_address")));
  for (std::string garbage : {std::string(64, '\x11'), std::string(3, '\xff')}) {
    EXPECT_THAT(OpenSession(garbage).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown header")));
  }
  EXPECT_EQ(Present(key), 0u);  // none of the above stored anything

  // The daemon is fine: the well-formed request stores the block, byte-exact.
  ASSERT_OK(Put(OneBlockPut(session, key)));
  EXPECT_EQ(Present(key), 1u);
  auto c = Connect(Transport::kInline);
  std::vector<std::byte> back(block_bytes_);
  std::vector<std::span<std::byte>> out = {back};
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found,
                       c->Get(Profile{profile_id_, block_bytes_}, std::span(&key, 1), out));
  EXPECT_TRUE(found[0] && client::IsTestBlock(3, 0, back));
  EXPECT_OK(CloseSession(session));
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_sessions", 0), 0);
}

// UCX parses a worker address without a length and trusts the transport attributes it carries:
// with a negative float written over 4 bytes of a good address, ucp_ep_create ends in an
// assertion or a segmentation fault for some offsets (a lane's bandwidth or latency; over tcp
// and shared memory alike), which would end proximad and every block it holds. The daemon has a
// child process parse each new address first (ucx.check_worker_addresses) and refuses the ones
// it dies on; every other lie fails its own way (UCX's error status, an unreachable peer) or
// connects to this worker after all. Every offset is tried: which ones are fatal depends on the
// transports' layout, not on chance.
TEST_P(RawUcxTest, LyingWorkerAddressesAreRefusedAndTheDaemonLives) {
  const std::string good = worker_->address();
  int refused = 0;
  int other_errors = 0;
  int connected = 0;
  for (size_t at = 1; at + sizeof(float) <= good.size(); ++at) {
    std::string lie = good;
    const float minus_one = -1.0f;
    std::memcpy(lie.data() + at, &minus_one, sizeof(minus_one));
    const absl::Time start = absl::Now();
    absl::StatusOr<uint64_t> session = OpenSession(lie);
    if (session.ok()) {
      ++connected;
      EXPECT_OK(CloseSession(*session));
    } else if (absl::StrContains(session.status().message(), "creating an endpoint to it")) {
      ++refused;
      EXPECT_THAT(session.status(),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           AllOf(HasSubstr("worker_address"), HasSubstr("signal"))))
          << "offset " << at;
    } else {
      ++other_errors;
      EXPECT_THAT(session.status().code(),
                  AnyOf(absl::StatusCode::kInvalidArgument, absl::StatusCode::kUnavailable))
          << "offset " << at << ": " << session.status();
    }
    ASSERT_TRUE(DaemonServes()) << "proximad ended after the address with -1.0f at offset " << at
                                << " (" << good.size() << " bytes; " << session.status() << ", "
                                << absl::Now() - start << "): " << daemon_->Log();
  }
  std::printf("%zu-byte address: %d lies refused by the check, %d failed otherwise, %d connected\n",
              good.size(), refused, other_errors, connected);
  EXPECT_GT(refused, 0) << "no lie ended the checking process: the test tests nothing here";
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_addresses_refused_total", refused), refused);

  // The daemon serves: the true address connects and a put lands, byte-exact.
  RegisterSource(1);
  ASSERT_OK_AND_ASSIGN(uint64_t session, OpenSession(good));
  const BlockKey key = client::TestKeyChain(3, 0, 1)[0];
  ASSERT_OK(Put(OneBlockPut(session, key)));
  EXPECT_EQ(Present(key), 1u);
  EXPECT_OK(CloseSession(session));
}

// The packed remote keys of a put's regions lie the same way (-1.0f, then 0xff bytes, over each
// offset in turn), for memory UCX allocated (over shared memory its keys name the segment the
// daemon maps: posix or sysv) and for ordinary registered memory: framing checks refuse what
// they can, UCX's unpacking or the segment check the rest, and whatever the daemon then reads is
// checked against the block's CRC32C. No lie ends the daemon or stores a wrong block.
TEST_P(RawUcxTest, LyingRkeysFailTheirCallsAndTheDaemonLives) {
  ASSERT_OK_AND_ASSIGN(uint64_t session, OpenSession(worker_->address()));
  const BlockKey key = client::TestKeyChain(3, 0, 1)[0];
  auto c = Connect(Transport::kInline);
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  int failed = 0;
  int tried = 0;
  for (const bool allocated : {true, false}) {
    std::shared_ptr<ucx::Registration> region;
    std::vector<std::byte> own(block_bytes_);
    if (allocated) {
      ASSERT_OK_AND_ASSIGN(region, worker_->Allocate(block_bytes_));
    } else {
      ASSERT_OK_AND_ASSIGN(region, worker_->Register(own.data(), own.size()));
    }
    auto* base = static_cast<std::byte*>(region->address());
    client::FillTestBlock(3, 0, std::span(base, block_bytes_));
    const std::string good = region->packed_rkey();
    for (const bool as_float : {true, false}) {
      for (size_t at = 0; at + sizeof(float) <= good.size(); ++at) {
        std::string lie = good;
        const float minus_one = -1.0f;
        if (as_float) {
          std::memcpy(lie.data() + at, &minus_one, sizeof(minus_one));
        } else {
          lie[at] = '\xff';
        }
        if (lie == good) continue;
        ++tried;
        const v1::PutUcxRequest req = OneBlockPut(session, key, lie, base, block_bytes_);
        const absl::Status put = Put(req, /*deadline_seconds=*/5);
        ASSERT_TRUE(DaemonServes())
            << "proximad ended after the " << good.size() << "-byte rkey of "
            << (allocated ? "allocated" : "registered") << " memory with "
            << (as_float ? "-1.0f" : "0xff") << " at offset " << at << " (" << put
            << "): " << daemon_->Log();
        if (put.ok()) {
          // Accepted: the lie was in a byte that did not change what the key names, so the
          // block is this buffer's, byte-exact.
          std::vector<std::byte> back(block_bytes_);
          std::vector<std::span<std::byte>> out = {back};
          ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->Get(p, std::span(&key, 1), out));
          EXPECT_TRUE(found[0] && client::IsTestBlock(3, 0, back)) << "offset " << at;
          ASSERT_OK(c->Delete(p, std::span(&key, 1)).status());
        } else {
          ++failed;
          EXPECT_EQ(Present(key), 0u) << "offset " << at << ": " << put;
        }
        // A failed transfer may have closed the session: the next try gets a new one.
        EXPECT_OK(CloseSession(session).code() == absl::StatusCode::kNotFound
                      ? absl::OkStatus()
                      : CloseSession(session));
        ASSERT_OK_AND_ASSIGN(session, OpenSession(worker_->address()));
      }
    }
  }
  std::printf("%d lying rkeys: %d failed their put, the rest named the same memory\n", tried,
              failed);
  EXPECT_GT(failed, 0);
  RegisterSource(1);
  ASSERT_OK(Put(OneBlockPut(session, key)));
  EXPECT_EQ(Present(key), 1u);
}

// A client that frees a UCX-allocated buffer while a call naming it is on the way (here: before
// sending it): over shared memory the daemon cannot open the segment the key names any more.
// UCX 1.13 would end the daemon inside ucp_ep_rkey_unpack; the daemon finds it first, fails the
// call, and serves on.
TEST_P(RawUcxTest, AKeyOfABufferTheClientFreedFailsItsCallAndTheDaemonLives) {
  if (std::string(GetParam()) == "tcp") {
    GTEST_SKIP() << "over tcp the daemon maps nothing: the client's own UCX would serve the "
                    "daemon's reads from the freed pages, and fault in this test process";
  }
  ASSERT_OK_AND_ASSIGN(uint64_t session, OpenSession(worker_->address()));
  const BlockKey key = client::TestKeyChain(5, 0, 1)[0];
  v1::PutUcxRequest req;
  {
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<ucx::Registration> freed, worker_->Allocate(block_bytes_));
    auto* base = static_cast<std::byte*>(freed->address());
    client::FillTestBlock(5, 0, std::span(base, block_bytes_));
    req = OneBlockPut(session, key, freed->packed_rkey(), base, block_bytes_);
  }  // the buffer is freed: UCX unmaps it and closes its segment
  const absl::Status put = Put(req);
  ASSERT_TRUE(DaemonServes()) << "proximad ended on a key of a freed buffer (" << put
                              << "): " << daemon_->Log();
  EXPECT_THAT(
      put, StatusIs(absl::StatusCode::kInvalidArgument,
                    AllOf(HasSubstr("rkeys[0] does not unpack"), HasSubstr("cannot be opened"))));
  // The key named the segment the way this mode's UCX does, and the daemon looked there.
  const std::string where = posix_mode_.empty()         ? "(/proc/"
                            : posix_mode_ == "shm_open" ? "(/ucx_shm_posix_"
                                                        : "(" + posix_dir_ + "/ucx_shm_posix_";
  EXPECT_THAT(put.message(), HasSubstr(where));
  EXPECT_EQ(Present(key), 0u);
  RegisterSource(1);
  absl::StatusOr<uint64_t> again = OpenSession(worker_->address());
  ASSERT_OK(again.status());
  ASSERT_OK(Put(OneBlockPut(*again, key)));
  EXPECT_EQ(Present(key), 1u);
}

// GetUcx says crc32c_checked exactly where the daemon copied the block into the caller's memory
// itself (UCX-allocated memory over shared memory, mapped into the daemon) and the bytes matched
// as it copied them; where UCX moved them (tcp, or ordinary memory) the caller checks them.
// Truncates to 0 bytes the shared-memory segment that backs `address` in this process: a UCX
// posix segment, through this process's descriptor of it (procfs mode, UCX's default: the file is
// already unlinked) or by its name (UCX_POSIX_USE_PROC_LINK=n: a file in /dev/shm or in
// UCX_POSIX_DIR, whose descriptor UCX closed once it had mapped it).
absl::Status TruncateSegment(const void* address) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  std::ifstream maps("/proc/self/maps");
  std::string path;
  for (std::string line; std::getline(maps, line);) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) != 2 || at < lo || at >= hi) continue;
    const size_t slash = line.find('/');
    if (slash != std::string::npos) path = line.substr(slash);
    break;
  }
  if (path.empty()) return absl::NotFoundError("no file backs the mapping");
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(entry.path(), ec).string() == path && !ec) {
      if (ftruncate(std::atoi(entry.path().filename().c_str()), 0) != 0) {
        return absl::InternalError(std::strerror(errno));
      }
      return absl::OkStatus();
    }
  }
  if (truncate(path.c_str(), 0) != 0) {
    return absl::InternalError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// A client that truncates its own shared-memory segment while the daemon holds it mapped (the
// segment's pages are gone: the daemon's next access raises SIGBUS). The daemon must answer the
// calls that touch it with an error and keep serving; the block of the failed put must not be
// stored.
TEST_P(RawUcxTest, ASegmentTheClientTruncatesFailsItsCallsAndTheDaemonLives) {
  if (std::string(GetParam()) == "tcp") {
    GTEST_SKIP() << "over tcp UCX moves the bytes; the daemon maps no client memory";
  }
  ASSERT_OK_AND_ASSIGN(uint64_t session, OpenSession(worker_->address()));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<ucx::Registration> seg, worker_->Allocate(2 * block_bytes_));
  auto* base = static_cast<std::byte*>(seg->address());
  const std::vector<BlockKey> keys = client::TestKeyChain(77, 0, 2);
  std::vector<uint32_t> crcs;
  for (size_t i = 0; i < 2; ++i) {
    std::span<std::byte> block(base + i * block_bytes_, block_bytes_);
    client::FillTestBlock(77, i, block);
    crcs.push_back(Crc32c(block));
  }
  // One block of the segment: a PutUcx or GetUcx (`get`) of keys[i] at block i.
  auto call = [&](size_t i, bool get) {
    v1::UcxRegion region;
    region.set_rkey(seg->packed_rkey());
    region.set_address(reinterpret_cast<uint64_t>(base));
    region.set_length(seg->length());
    region.set_registration_id(seg->id());  // the daemon keeps it mapped between calls
    v1::UcxBlock block;
    block.set_key(std::string(reinterpret_cast<const char*>(keys[i].data()), keys[i].size()));
    v1::UcxSegment* s = block.add_segments();
    s->set_region(0);
    s->set_address(reinterpret_cast<uint64_t>(base + i * block_bytes_));
    s->set_length(block_bytes_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (get) {
      v1::GetUcxRequest req;
      req.set_namespace_name("default");
      req.set_profile_id(profile_id_);
      req.set_session_id(session);
      *req.add_regions() = region;
      *req.add_blocks() = block;
      v1::GetUcxResponse resp;
      return client::FromGrpc(stub_->GetUcx(&ctx, req, &resp));
    }
    v1::PutUcxRequest req;
    req.set_namespace_name("default");
    req.set_profile_id(profile_id_);
    req.set_session_id(session);
    *req.add_regions() = region;
    block.set_crc32c(crcs[i]);
    *req.add_blocks() = block;
    v1::PutResponse resp;
    return client::FromGrpc(stub_->PutUcx(&ctx, req, &resp));
  };
  ASSERT_OK(call(0, /*get=*/false));  // the daemon maps the segment and keeps it
  ASSERT_EQ(Present(keys[0]), 1u);

  // From here on, never touch `base`.
  ASSERT_OK(TruncateSegment(base)) << "the UCX segment at " << seg->address();

  EXPECT_THAT(call(1, /*get=*/false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("SIGBUS")));
  EXPECT_THAT(call(0, /*get=*/true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("SIGBUS")));
  // The daemon lives, the failed put stored nothing, the earlier block is intact.
  EXPECT_EQ(Present(keys[1]), 0u);
  EXPECT_EQ(Present(keys[0]), 1u);
  auto c = Connect(Transport::kInline);
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  std::vector<std::byte> back(block_bytes_);
  std::vector<std::span<std::byte>> out = {back};
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->Get(p, std::span(keys).first(1), out));
  EXPECT_TRUE(found[0] && client::IsTestBlock(77, 0, back));
}

// A client that declares its region to start far below its real segment and names a block
// there: UCX's posix and sysv transports would translate that address into the daemon's own
// memory without a bounds check (to nothing mapped, here; to another client's blocks,
// elsewhere). The daemon must refuse the call before copying, and keep serving. (Blocks that
// straddle a segment's end: UcxTest.OperationsOutsideTheSegmentAKeyNamesAreRefused.)
TEST_P(RawUcxTest, AnAddressOutsideTheClientsSegmentFailsItsCallAndTheDaemonLives) {
  if (std::string(GetParam()) == "tcp") {
    GTEST_SKIP() << "over tcp UCX moves the bytes; the daemon maps no client memory";
  }
  ASSERT_OK_AND_ASSIGN(uint64_t session, OpenSession(worker_->address()));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<ucx::Registration> seg, worker_->Allocate(block_bytes_));
  auto* base = static_cast<std::byte*>(seg->address());
  client::FillTestBlock(78, 0, std::span(base, block_bytes_));
  const uint32_t crc = Crc32c(std::span(base, block_bytes_));
  const BlockKey key = client::TestKeyChain(78, 0, 1)[0];
  // Far below the segment: 1 TiB, or half the segment's address where mappings sit lower (qemu's
  // aarch64 guests), page-aligned.
  const uint64_t kBelow =
      std::min<uint64_t>(uint64_t{1} << 40, reinterpret_cast<uint64_t>(base) / 2) & ~uint64_t{4095};
  const uint64_t lie = reinterpret_cast<uint64_t>(base) - kBelow;
  auto call = [&](uint64_t block_address, bool get) {
    v1::UcxRegion region;
    region.set_rkey(seg->packed_rkey());
    region.set_address(lie);
    region.set_length(kBelow + seg->length());  // ends where the segment does
    region.set_registration_id(seg->id());
    v1::UcxBlock block;
    block.set_key(std::string(reinterpret_cast<const char*>(key.data()), key.size()));
    v1::UcxSegment* s = block.add_segments();
    s->set_region(0);
    s->set_address(block_address);
    s->set_length(block_bytes_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (get) {
      v1::GetUcxRequest req;
      req.set_namespace_name("default");
      req.set_profile_id(profile_id_);
      req.set_session_id(session);
      *req.add_regions() = region;
      *req.add_blocks() = block;
      v1::GetUcxResponse resp;
      return client::FromGrpc(stub_->GetUcx(&ctx, req, &resp));
    }
    v1::PutUcxRequest req;
    req.set_namespace_name("default");
    req.set_profile_id(profile_id_);
    req.set_session_id(session);
    *req.add_regions() = region;
    block.set_crc32c(crc);
    *req.add_blocks() = block;
    v1::PutResponse resp;
    return client::FromGrpc(stub_->PutUcx(&ctx, req, &resp));
  };
  EXPECT_THAT(call(lie, /*get=*/false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lies outside the shared-memory segment")));
  EXPECT_EQ(Present(key), 0u);

  // The same region, the block where it really is: stored, and the daemon answers a get that
  // names the hole with an error too.
  ASSERT_OK(call(reinterpret_cast<uint64_t>(base), /*get=*/false));
  EXPECT_EQ(Present(key), 1u);
  EXPECT_THAT(call(lie, /*get=*/true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lies outside the shared-memory segment")));
  std::fill(base, base + block_bytes_, std::byte{0});
  ASSERT_OK(call(reinterpret_cast<uint64_t>(base), /*get=*/true));
  EXPECT_TRUE(client::IsTestBlock(78, 0, std::span(base, block_bytes_)));
}

TEST_P(RawUcxTest, GetSaysTheCrcWasCheckedOnlyWhereTheDaemonCopiedTheBlockItself) {
  const bool shared_memory = std::string(GetParam()) != "tcp";
  RegisterSource(1);
  ASSERT_OK_AND_ASSIGN(uint64_t session, OpenSession(worker_->address()));
  const BlockKey key = client::TestKeyChain(3, 0, 1)[0];
  ASSERT_OK(Put(OneBlockPut(session, key)));
  const uint32_t crc = Crc32c(std::span(src_).first(block_bytes_));
  // Gets `key` into [dst, dst + block_bytes_) of `reg` twice (the second through the session's
  // kept key); the results.
  auto get_into = [&](const ucx::Registration& reg, std::byte* dst) {
    std::vector<v1::GetUcxResult> results;
    for (int round = 0; round < 2; ++round) {
      std::memset(dst, 0, block_bytes_);
      v1::GetUcxRequest req;
      req.set_namespace_name("default");
      req.set_profile_id(profile_id_);
      req.set_session_id(session);
      req.set_client_verifies_crc32c(true);
      v1::UcxRegion* r = req.add_regions();
      r->set_rkey(reg.packed_rkey());
      r->set_address(reinterpret_cast<uint64_t>(reg.address()));
      r->set_length(reg.length());
      r->set_registration_id(reg.id());
      v1::UcxBlock* b = req.add_blocks();
      b->set_key(std::string(reinterpret_cast<const char*>(key.data()), key.size()));
      v1::UcxSegment* seg = b->add_segments();
      seg->set_region(0);
      seg->set_address(reinterpret_cast<uint64_t>(dst));
      seg->set_length(block_bytes_);
      v1::GetUcxResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
      EXPECT_OK(client::FromGrpc(stub_->GetUcx(&ctx, req, &resp)));
      EXPECT_EQ(resp.results_size(), 1);
      if (resp.results_size() == 1) results.push_back(resp.results(0));
      EXPECT_EQ(std::memcmp(dst, src_.data(), block_bytes_), 0) << "round " << round;
    }
    return results;
  };

  // Ordinary memory: UCX moves the bytes (emulated over shared memory), nothing is checked.
  std::vector<std::byte> heap(block_bytes_);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<ucx::Registration> heap_reg,
                       worker_->Register(heap.data(), heap.size()));
  for (const v1::GetUcxResult& r : get_into(*heap_reg, heap.data())) {
    EXPECT_TRUE(r.found());
    EXPECT_EQ(r.crc32c(), crc);
    EXPECT_FALSE(r.crc32c_checked());
  }
  // Memory UCX allocated: mapped into the daemon over shared memory, which copies and checks.
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<ucx::Registration> allocated,
                       worker_->Allocate(block_bytes_));
  for (const v1::GetUcxResult& r :
       get_into(*allocated, static_cast<std::byte*>(allocated->address()))) {
    EXPECT_TRUE(r.found());
    EXPECT_EQ(r.crc32c(), crc);
    EXPECT_EQ(r.crc32c_checked(), shared_memory);
  }
  ASSERT_OK(CloseSession(session));
}

TEST_P(RawUcxTest, BlocksSentAsMessagesAreCheckedAndABadOneStoresNothing) {
  // PutUcx with ucx_transfer: the client sends each block as a UCX message to the daemon's
  // worker first (eager: the bytes travel at once; rendezvous: the daemon has UCX move them into
  // the memory it reserved once the call names them). Every way such a call can be wrong gets a
  // clear error and stores nothing; a block already stored stays intact; a good call stores
  // byte-exact blocks; every rendezvous send ends promptly, taken or not.
  if (std::string(GetParam()) != "tcp") {
    GTEST_SKIP() << "over shared memory a client does not open its own endpoint to the daemon's "
                    "worker (UCX 1.13 cannot match it with the daemon's, which runs without peer "
                    "error handling there); the daemon maps the client's memory instead";
  }
  RegisterSource(3);
  std::string daemon_worker;
  ASSERT_OK_AND_ASSIGN(uint64_t session, OpenSession(worker_->address(), &daemon_worker));
  ASSERT_FALSE(daemon_worker.empty());
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<ucx::Endpoint> ep,
                       worker_->Connect(daemon_worker, absl::Now() + absl::Seconds(10)));
  const std::vector<BlockKey> keys = client::TestKeyChain(3, 0, 3);
  auto block = [&](size_t i) {
    return std::span<const std::byte>(src_).subspan(i * block_bytes_, block_bytes_);
  };
  // A PutUcx naming a fresh transfer for blocks `which` of the source (no regions, no segments).
  auto request = [&](std::vector<size_t> which, uint64_t transfer) {
    v1::PutUcxRequest req;
    req.set_namespace_name("default");
    req.set_profile_id(profile_id_);
    req.set_session_id(session);
    req.set_ucx_transfer(transfer);
    req.set_message_block_bytes(block_bytes_);
    for (size_t i : which) {
      v1::UcxBlock* b = req.add_blocks();
      b->set_key(std::string(reinterpret_cast<const char*>(keys[i].data()), keys[i].size()));
      b->set_crc32c(Crc32c(block(i)));
    }
    return req;
  };
  auto send = [&](uint64_t transfer, std::vector<ucx::Message> messages) {
    return worker_->Send(*ep, transfer, std::move(messages), nullptr,
                         absl::Now() + absl::Seconds(10));
  };
  const uint64_t message_calls_before =
      Metric(*daemon_, "proxima_ucx_calls_by_messages_total{op=\"put\"}");

  // Block 0 stored the right way first: nothing below may disturb it.
  uint64_t t = worker_->NewTransferId();
  ASSERT_OK(send(t, {{0, block(0)}}));
  ASSERT_OK(Put(request({0}, t)));
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_calls_by_messages_total{op=\"put\"}"),
            message_calls_before + 1);

  // Never sent: the daemon waits until shortly before the deadline and says which block.
  const absl::Time start = absl::Now();
  EXPECT_THAT(Put(request({1}, worker_->NewTransferId()), 2),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("blocks[0] (of ucx_transfer")));
  EXPECT_LE(absl::Now() - start, absl::Seconds(3));
  // One of two arrived.
  t = worker_->NewTransferId();
  ASSERT_OK(send(t, {{0, block(1)}}));
  EXPECT_THAT(Put(request({1, 2}, t), 2),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("blocks[1] (of ucx_transfer")));
  // A message shorter than a block.
  t = worker_->NewTransferId();
  ASSERT_OK(send(t, {{0, block(1).first(block_bytes_ - 8)}}));
  EXPECT_THAT(Put(request({1}, t)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("message of ", block_bytes_ - 8, " bytes"))));
  // Bytes that do not match the declared CRC32C (block 2's bytes under block 1's key and CRC).
  t = worker_->NewTransferId();
  ASSERT_OK(send(t, {{0, block(2)}}));
  EXPECT_THAT(Put(request({1}, t)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nothing was stored")));
  // The same slot twice: the first copy counts, the second is dropped on arrival.
  t = worker_->NewTransferId();
  ASSERT_OK(send(t, {{0, block(2)}, {0, block(1)}}));
  EXPECT_THAT(Put(request({1}, t)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nothing was stored")));
  // Malformed requests, refused before anything is collected.
  v1::PutUcxRequest req = request({1}, worker_->NewTransferId());
  req.set_message_block_bytes(block_bytes_ / 2);
  EXPECT_THAT(Put(req),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("message_block_bytes is")));
  req = OneBlockPut(session, keys[1]);
  req.set_ucx_transfer(worker_->NewTransferId());
  req.set_message_block_bytes(block_bytes_);
  EXPECT_THAT(Put(req), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("blocks sent as messages come with no regions")));
  EXPECT_EQ(Present(keys[1]), 0u);
  EXPECT_EQ(Present(keys[2]), 0u);

  // Rendezvous: the send ends once the daemon took the bytes or dropped the message, never
  // later, and the endpoint stays usable.
  auto start_rendezvous = [&](uint64_t transfer, std::vector<ucx::Message> messages) {
    for (ucx::Message& m : messages) m.rendezvous = true;
    return worker_->StartSend(*ep, transfer, std::move(messages), nullptr);
  };
  auto ends_promptly = [&](ucx::Sending& sending) {
    const absl::Time begin = absl::Now();
    EXPECT_OK(sending.Wait(absl::Now() + absl::Seconds(20)));
    EXPECT_LE(absl::Now() - begin, absl::Seconds(3));
  };
  // Bytes that do not match the declared CRC32C: taken into the reserved memory, found wrong
  // there, nothing stored.
  t = worker_->NewTransferId();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ucx::Sending> sending,
                       start_rendezvous(t, {{0, block(2)}}));
  EXPECT_THAT(Put(request({1}, t)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nothing was stored")));
  ends_promptly(*sending);
  // A call refused before anything is collected: its messages are dropped and their senders
  // told.
  t = worker_->NewTransferId();
  ASSERT_OK_AND_ASSIGN(sending, start_rendezvous(t, {{0, block(1)}}));
  req = request({1}, t);
  req.set_message_block_bytes(block_bytes_ / 2);
  EXPECT_THAT(Put(req),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("message_block_bytes is")));
  ends_promptly(*sending);
  // A message shorter than a block: refused before its bytes move.
  t = worker_->NewTransferId();
  ASSERT_OK_AND_ASSIGN(sending, start_rendezvous(t, {{0, block(1).first(block_bytes_ - 8)}}));
  EXPECT_THAT(Put(request({1}, t)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("message of ", block_bytes_ - 8, " bytes"))));
  ends_promptly(*sending);
  EXPECT_OK(ep->health());
  EXPECT_EQ(Present(keys[1]), 0u);
  EXPECT_EQ(Present(keys[2]), 0u);

  // Then both the right way, rendezvous, with block 0 again (already present: its message is
  // dropped unreceived).
  t = worker_->NewTransferId();
  ASSERT_OK_AND_ASSIGN(sending,
                       start_rendezvous(t, {{0, block(0)}, {1, block(1)}, {2, block(2)}}));
  v1::PutResponse resp;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    ASSERT_OK(client::FromGrpc(stub_->PutUcx(&ctx, request({0, 1, 2}, t), &resp)));
  }
  ends_promptly(*sending);
  ASSERT_EQ(resp.outcomes_size(), 3);
  EXPECT_EQ(resp.outcomes(0), v1::PUT_OUTCOME_ALREADY_PRESENT);
  EXPECT_EQ(resp.outcomes(1), v1::PUT_OUTCOME_STORED);
  EXPECT_EQ(resp.outcomes(2), v1::PUT_OUTCOME_STORED);

  // Read back as messages (GetUcx with ucx_transfer): every byte as stored.
  v1::GetUcxRequest get;
  get.set_namespace_name("default");
  get.set_profile_id(profile_id_);
  get.set_session_id(session);
  std::vector<std::byte> dst(3 * block_bytes_);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<ucx::Registration> dst_reg,
                       worker_->Register(dst.data(), dst.size()));
  v1::UcxRegion* r = get.add_regions();
  r->set_rkey(dst_reg->packed_rkey());
  r->set_address(reinterpret_cast<uint64_t>(dst.data()));
  r->set_length(dst.size());
  for (size_t i = 0; i < 3; ++i) {
    v1::UcxBlock* b = get.add_blocks();
    b->set_key(std::string(reinterpret_cast<const char*>(keys[i].data()), keys[i].size()));
    v1::UcxSegment* seg = b->add_segments();
    seg->set_address(reinterpret_cast<uint64_t>(dst.data() + i * block_bytes_));
    seg->set_length(block_bytes_);
  }
  const uint64_t get_transfer = worker_->NewTransferId();
  get.set_ucx_transfer(get_transfer);
  v1::GetUcxResponse got;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    ASSERT_OK(client::FromGrpc(stub_->GetUcx(&ctx, get, &got)));
  }
  EXPECT_TRUE(got.sent_as_messages());
  const std::vector<uint32_t> slots = {0, 1, 2};
  std::vector<std::shared_ptr<const ucx::Parcel>> parcels =
      worker_->Collect(get_transfer, slots, absl::Now() + absl::Seconds(10));
  ASSERT_EQ(got.results_size(), 3);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(got.results(i).found());
    EXPECT_FALSE(got.results(i).crc32c_checked());
    EXPECT_EQ(got.results(i).crc32c(), Crc32c(block(i)));
    ASSERT_NE(parcels[i], nullptr) << i;
    ASSERT_EQ(parcels[i]->bytes().size(), block_bytes_);
    EXPECT_EQ(std::memcmp(parcels[i]->bytes().data(), block(i).data(), block_bytes_), 0) << i;
  }
  // Nothing was written into the segments: the bytes came as messages only.
  EXPECT_EQ(std::count(dst.begin(), dst.end(), std::byte{0}), static_cast<ptrdiff_t>(dst.size()));
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_calls_by_messages_total{op=\"get\"}"), 1);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_parked_bytes"), 0);  // nothing left behind
  parcels.clear();

  // Read back as rendezvous messages (ucx_rendezvous_bytes): the answer comes first, then UCX
  // moves each block straight into the segment this side names, byte-exact; the daemon holds the
  // blocks until then and no longer.
  auto rendezvous_get =
      [&](int deadline_seconds) -> std::vector<std::shared_ptr<const ucx::Parcel>> {
    const uint64_t transfer = worker_->NewTransferId();
    get.set_ucx_transfer(transfer);
    get.set_ucx_rendezvous_bytes(1);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_seconds));
    EXPECT_OK(client::FromGrpc(stub_->GetUcx(&ctx, get, &got)));
    EXPECT_TRUE(got.sent_as_messages());
    return worker_->Collect(transfer, slots, absl::Now() + absl::Seconds(10));
  };
  const uint64_t rendezvous_sent_before =
      Metric(*daemon_, "proxima_ucx_rendezvous_sent_bytes_total");
  parcels = rendezvous_get(20);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_rendezvous_get_held_bytes"), 3 * block_bytes_);
  std::vector<ucx::Destination> spans;
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_NE(parcels[i], nullptr) << i;
    EXPECT_TRUE(parcels[i]->pending()) << i;
    spans.push_back({{std::span(dst).subspan(i * block_bytes_, block_bytes_)}});
  }
  ASSERT_OK(worker_->Receive(parcels, spans, nullptr, absl::Now() + absl::Seconds(10)));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(std::memcmp(dst.data() + i * block_bytes_, block(i).data(), block_bytes_), 0) << i;
    EXPECT_EQ(got.results(i).crc32c(), Crc32c(block(i)));
  }
  parcels.clear();
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_rendezvous_get_held_bytes", 0), 0);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_rendezvous_sent_bytes_total"),
            rendezvous_sent_before + 3 * block_bytes_);
  // Collected and held but never taken: the daemon lets go of the blocks once the call's
  // deadline and kRendezvousGetGrace (5 s) have passed, closing the session's endpoint.
  const absl::Time held_from = absl::Now();
  parcels = rendezvous_get(1);
  ASSERT_NE(parcels[0], nullptr);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_rendezvous_get_held_bytes"), 3 * block_bytes_);
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_rendezvous_get_held_bytes", 0, absl::Seconds(20)),
            0);
  EXPECT_GE(absl::Now() - held_from, absl::Seconds(5));
  parcels.clear();
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_rendezvous_sent_bytes_total"),
            rendezvous_sent_before + 3 * block_bytes_);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(Present(keys[i]), 1u) << i;  // still stored
  // That session's endpoint is closed: its next call fails and drops it (the client library
  // then opens a new one).
  {
    get.set_ucx_transfer(worker_->NewTransferId());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    EXPECT_THAT(client::FromGrpc(stub_->GetUcx(&ctx, get, &got)),
                StatusIs(absl::StatusCode::kUnavailable, HasSubstr("deadline")));
  }
  EXPECT_THAT(Put(request({0}, worker_->NewTransferId())),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("UCX session")));
  // A daemon stopped (SIGTERM) while a client holds rendezvous messages it has not taken shuts
  // down cleanly: the worker closes the endpoint by force, which ends the sends.
  ASSERT_OK_AND_ASSIGN(session, OpenSession(worker_->address()));
  get.set_session_id(session);
  parcels = rendezvous_get(20);
  ASSERT_NE(parcels[0], nullptr);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_rendezvous_get_held_bytes"), 3 * block_bytes_);
  daemon_->Signal(SIGTERM);
  EXPECT_EQ(daemon_->WaitExit(absl::Seconds(30)), 0) << daemon_->Log();
  EXPECT_THAT(daemon_->Log(), Not(HasSubstr("Assertion")));
  parcels.clear();
  dst_reg.reset();
  ep.reset();
}

TEST_P(RawUcxTest, BufferRewrittenDuringTheTransferIsNeverVisibleHalfWritten) {
  // A client that deregisters and reuses its buffer while the daemon pulls it: the daemon
  // either pulled the old bytes completely (stored, byte-exact) or refuses the request.
  constexpr size_t kBlocks = 8;
  RegisterSource(kBlocks);
  ASSERT_OK_AND_ASSIGN(uint64_t session, OpenSession(worker_->address()));
  std::vector<BlockKey> keys = client::TestKeyChain(3, 0, kBlocks);
  v1::PutUcxRequest req = OneBlockPut(session, keys[0]);
  for (size_t i = 1; i < kBlocks; ++i) {
    v1::UcxBlock* b = req.add_blocks();
    b->set_key(std::string(reinterpret_cast<const char*>(keys[i].data()), 32));
    v1::UcxSegment* s = b->add_segments();
    s->set_address(reinterpret_cast<uint64_t>(src_.data()) + i * block_bytes_);
    s->set_length(block_bytes_);
    b->set_crc32c(Crc32c(std::span(src_).subspan(i * block_bytes_, block_bytes_)));
  }
  std::atomic<bool> started{false};
  std::thread scribbler([&] {
    while (!started.load()) std::this_thread::yield();
    for (size_t i = 0; i < src_.size(); i += 4096) src_[i] = std::byte{0xee};
  });
  started = true;
  absl::Status s = Put(req);
  scribbler.join();
  size_t present = 0;
  for (const BlockKey& k : keys) present += Present(k);
  if (s.ok()) {
    auto c = Connect(Transport::kInline);
    std::vector<std::vector<std::byte>> back(kBlocks, std::vector<std::byte>(block_bytes_));
    std::vector<std::span<std::byte>> out(back.begin(), back.end());
    ASSERT_OK_AND_ASSIGN(std::vector<bool> found,
                         c->Get(Profile{profile_id_, block_bytes_}, keys, out));
    for (size_t i = 0; i < kBlocks; ++i)
      EXPECT_TRUE(found[i] && client::IsTestBlock(3, i, back[i]));
  } else {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nothing was stored")));
    EXPECT_EQ(present, 0u);
  }
}

TEST_P(UcxIntegrationTest, DroppingARegionMidTransferWaitsForTheTransfer) {
  auto c = Connect(Transport::kUcx);
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel(64)));  // 1 MiB blocks
  constexpr size_t kBlocks = 32;
  std::vector<std::byte> cache(kBlocks * p.block_bytes);
  std::vector<BlockKey> keys = client::TestKeyChain(11, 0, kBlocks);
  std::vector<std::span<const std::byte>> in;
  for (size_t i = 0; i < kBlocks; ++i) {
    std::span<std::byte> b(cache.data() + i * p.block_bytes, p.block_bytes);
    client::FillTestBlock(11, i, b);
    in.push_back(b);
  }
  auto region = std::make_unique<client::MemoryRegion>();
  ASSERT_OK_AND_ASSIGN(*region, c->RegisterMemory(cache.data(), cache.size()));
  absl::StatusOr<std::vector<PutOutcome>> outcomes;
  std::thread putter([&] { outcomes = c->Put(p, keys, in); });
  absl::SleepFor(absl::Milliseconds(2));
  region.reset();  // the caller deregisters while the daemon may be pulling
  putter.join();
  ASSERT_OK(outcomes.status());
  std::vector<std::vector<std::byte>> back(kBlocks, std::vector<std::byte>(p.block_bytes));
  std::vector<std::span<std::byte>> out(back.begin(), back.end());
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->Get(p, keys, out));
  for (size_t i = 0; i < kBlocks; ++i) EXPECT_TRUE(found[i] && client::IsTestBlock(11, i, back[i]));
}

TEST_P(RawUcxTest, ConnectDisconnectCyclesLeakNothing) {
  // Sessions (endpoints) opened and closed again and again: the daemon's own metrics and its
  // open file descriptors return to where they were. 10,000 cycles over shared memory; over tcp
  // every cycle is a new TCP connection (10,000 took 28 s alone and 104 s under the full suite's
  // load), so 2,000 there keep the test well under a minute.
  const int cycles = std::string(GetParam()) == "tcp" ? 2000 : 10000;
  ASSERT_OK_AND_ASSIGN(uint64_t first, OpenSession(worker_->address()));
  ASSERT_OK(CloseSession(first));
  ASSERT_EQ(WaitForMetric(*daemon_, "proxima_ucx_endpoints", 0), 0);
  const int fds_before = OpenFds(daemon_->pid());
  const absl::Time start = absl::Now();
  for (int i = 0; i < cycles; ++i) {
    absl::StatusOr<uint64_t> session = OpenSession(worker_->address());
    ASSERT_OK(session.status()) << "cycle " << i;
    ASSERT_OK(CloseSession(*session));
  }
  const absl::Duration took = absl::Now() - start;
  std::fprintf(stderr, "%d connect/disconnect cycles over %s in %s\n", cycles, GetParam(),
               absl::FormatDuration(took).c_str());
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_sessions", 0), 0);
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_endpoints", 0), 0);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_registrations"), 1);  // the arena, nothing else
  // A few descriptors may still be closing (TCP teardown); none per cycle.
  EXPECT_LE(OpenFds(daemon_->pid()), fds_before + 8);
  EXPECT_GT(OpenFds(daemon_->pid()), 0);
}

TEST_P(UcxIntegrationTest, ClientKilledMidTransferLeavesNoPartialBlockAndNoSession) {
  if (std::string(GetParam()) != "tcp") {
    GTEST_SKIP() << "UCX 1.13's shared-memory transports have no peer failure detection; a "
                    "killed shared-memory client is caught by its next transfer or deadline";
  }
  // proximactl load over UCX with 4 MiB blocks, killed (SIGKILL) while it moves bytes: 1.5 s
  // after its start, and not before the daemon has moved bytes for it over UCX (under qemu its
  // start alone can take longer than that; a fixed time then killed it before any transfer).
  // The second round's puts find their blocks stored: its bytes may all go out, as gets.
  auto moved = [this] {
    return Metric(*daemon_, "proxima_transfer_bytes_total{transport=\"ucx\",direction=\"in\"}") +
           Metric(*daemon_, "proxima_transfer_bytes_total{transport=\"ucx\",direction=\"out\"}");
  };
  for (int round = 0; round < 2; ++round) {
    const double before = moved();
    absl::Time next_check = absl::Now() + absl::Milliseconds(1500);
    testing::CommandResult r = testing::RunCommand(
        {testing::ProximactlPath(), "load", "--target=" + daemon_->tcp_target(), "--transport=ucx",
         "--clients=2", "--duration=60", "--tokens_per_block=256", "--batch=8", "--working_set=16",
         "--get_fraction=0.5"},
        absl::Seconds(55), [&] {
          if (absl::Now() < next_check) return false;
          next_check = absl::Now() + absl::Milliseconds(50);  // a scrape every 50 ms at most
          return moved() > before;
        });
    EXPECT_EQ(r.exit_code, -1) << r.out << r.err;  // killed, not finished
    EXPECT_GT(moved(), before) << "round " << round << ": killed before any transfer";
  }
  // The daemon notices the dead peers and drops their sessions and endpoints.
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_sessions", 0), 0);
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_endpoints", 0), 0);
  EXPECT_GT(Metric(*daemon_, "proxima_transfer_bytes_total{transport=\"ucx\",direction=\"in\"}"),
            0);
  // Every block that is visible is complete and intact (proximactl load's chains: seeds 1000+c).
  auto c = Connect(Transport::kUcx);
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile([] {
    v1::ModelProfile m = TestModel(256);
    m.set_fingerprint("proximactl-test");
    return m;
  }()));
  size_t visible = 0;
  for (uint64_t seed : {1000, 1001}) {
    std::vector<BlockKey> keys = client::TestKeyChain(seed, 0, 16);
    std::vector<std::vector<std::byte>> back(16, std::vector<std::byte>(p.block_bytes));
    std::vector<std::span<std::byte>> out(back.begin(), back.end());
    ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->Get(p, keys, out));
    for (size_t i = 0; i < 16; ++i) {
      if (!found[i]) continue;
      ++visible;
      EXPECT_TRUE(client::IsTestBlock(seed, i, back[i])) << seed << "/" << i;
    }
  }
  EXPECT_GT(visible, 0u);
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, c->Stats());
  EXPECT_EQ(stats.crc_failures(), 0u);
}

TEST_P(UcxIntegrationTest, DaemonKilledFailsCallsAtOnceAndOnceBackIsUsedOverUcxAgain) {
  // A client on UCX whose daemon is SIGKILLed: its calls fail UNAVAILABLE at once while it is
  // down, not at their deadline (they each waited it out before), and once proximad is back
  // (same port) the client has reconnected by itself within about the reconnect backoff and its
  // next call re-establishes the UCX session, still on UCX.
  constexpr absl::Duration kCallTimeout = absl::Seconds(20);
  const int slow = testing::EmulationFactor();  // bounds x5 under qemu
  ClientOptions options;
  options.target = daemon_->tcp_target();
  options.transport = Transport::kUcx;
  options.call_timeout = kCallTimeout;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  constexpr size_t kBlocks = 8;
  std::vector<std::byte> cache(3 * kBlocks * p.block_bytes);
  ASSERT_OK_AND_ASSIGN(client::MemoryRegion region, c->RegisterMemory(cache.data(), cache.size()));
  // Batch `round` of the test: blocks [round * kBlocks, +kBlocks) of the chain of seed 21.
  auto put = [&](size_t round) {
    std::vector<std::span<const std::byte>> in;
    for (size_t i = 0; i < kBlocks; ++i) {
      std::span<std::byte> b(cache.data() + (round * kBlocks + i) * p.block_bytes, p.block_bytes);
      client::FillTestBlock(21, round * kBlocks + i, b);
      in.push_back(b);
    }
    return c->Put(p, client::TestKeyChain(21, round * kBlocks, kBlocks), in).status();
  };
  ASSERT_OK(put(0));

  daemon_->Signal(SIGKILL);
  ASSERT_EQ(daemon_->WaitExit(absl::Seconds(10)), -1);
  for (int call = 0; call < 4; ++call) {  // the first finds the connection gone, the rest down
    const absl::Time start = absl::Now();
    EXPECT_THAT(put(1), StatusIs(absl::StatusCode::kUnavailable, ::testing::_)) << call;
    EXPECT_LE(absl::Now() - start, absl::Milliseconds(500) * slow) << call;
    absl::SleepFor(absl::Milliseconds(300));
  }

  ASSERT_OK(daemon_->Restart());
  const absl::Time up = absl::Now();
  absl::Status put2;
  do {
    absl::SleepFor(absl::Milliseconds(20));
    put2 = put(2);
  } while (!put2.ok() && absl::Now() - up < absl::Seconds(10) * slow);
  ASSERT_OK(put2);
  // The reconnect backoff's 1 s maximum, its 20% jitter, and room for a loaded machine.
  EXPECT_LE(absl::Now() - up, absl::Milliseconds(2500) * slow);
  EXPECT_EQ(c->transport(), Transport::kUcx);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_sessions"), 1);
  EXPECT_GT(Metric(*daemon_, "proxima_transfer_bytes_total{transport=\"ucx\",direction=\"in\"}"),
            0);
  std::vector<std::vector<std::byte>> back(kBlocks, std::vector<std::byte>(p.block_bytes));
  std::vector<std::span<std::byte>> out(back.begin(), back.end());
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found,
                       c->Get(p, client::TestKeyChain(21, 2 * kBlocks, kBlocks), out));
  for (size_t i = 0; i < kBlocks; ++i) {
    EXPECT_TRUE(found[i] && client::IsTestBlock(21, 2 * kBlocks + i, back[i])) << i;
  }
  // The restarted daemon holds only its arena's registration; the client's session closes with it.
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_registrations"), 1);
  region = client::MemoryRegion();  // REQUIRES of Client: regions go first
  c.reset();
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_sessions", 0), 0);
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_endpoints", 0), 0);
}

// Puts and gets six blocks of the chain of `seed` through a client with `options` (host staging
// never), over UCX, and checks every byte read back. Scattered: each block in two segments,
// the halves swapped in memory; else each block one segment of a registered buffer.
// `block_bytes` (may be null): set to the profile's block size.
void ScatteredRoundTrip(const std::string& target, ClientOptions options, uint64_t seed,
                        bool scattered, uint64_t* block_bytes = nullptr) {
  options.target = target;
  options.transport = Transport::kUcx;
  options.host_staging = client::HostStaging::kNever;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  if (block_bytes != nullptr) *block_bytes = p.block_bytes;
  constexpr size_t kBlocks = 6;
  std::vector<std::byte> cache(kBlocks * p.block_bytes);
  ASSERT_OK_AND_ASSIGN(client::MemoryRegion region, c->RegisterMemory(cache.data(), cache.size()));
  const std::vector<BlockKey> keys = client::TestKeyChain(seed, 0, kBlocks);
  const size_t half = scattered ? p.block_bytes / 2 : 0;
  std::vector<client::ConstSegments> put(kBlocks);
  std::vector<client::Segments> get(kBlocks);
  for (size_t i = 0; i < kBlocks; ++i) {
    std::vector<std::byte> block(p.block_bytes);
    client::FillTestBlock(seed, i, block);
    std::byte* at = cache.data() + i * p.block_bytes;
    std::memcpy(at + half, block.data(), half);
    std::memcpy(at, block.data() + half, p.block_bytes - half);
    if (scattered) {
      put[i] = {std::span<const std::byte>(at + half, half),
                std::span<const std::byte>(at, p.block_bytes - half)};
      get[i] = {std::span<std::byte>(at + half, half),
                std::span<std::byte>(at, p.block_bytes - half)};
    } else {
      put[i] = {std::span<const std::byte>(at, p.block_bytes)};
      get[i] = {std::span<std::byte>(at, p.block_bytes)};
    }
  }
  ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> outcomes, c->PutScattered(p, keys, put));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  std::fill(cache.begin(), cache.end(), std::byte{0});
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->GetScattered(p, keys, get));
  for (size_t i = 0; i < kBlocks; ++i) {
    std::vector<std::byte> back(p.block_bytes);
    std::memcpy(back.data(), cache.data() + i * p.block_bytes + half, p.block_bytes - half);
    std::memcpy(back.data() + (p.block_bytes - half), cache.data() + i * p.block_bytes, half);
    EXPECT_TRUE(found[i] && client::IsTestBlock(seed, i, back)) << i;
  }
}

TEST_P(UcxIntegrationTest, OneSidedTransfersRemainAnOptionAndStayByteExact) {
  // ClientOptions::ucx_messages = false: the daemon reads and writes this client's buffers with
  // one-sided operations (or copies through mapped memory), as before messages; no call moves
  // its bytes as messages, and every byte round-trips, scattered blocks included.
  ClientOptions options;
  options.ucx_messages = false;
  ScatteredRoundTrip(daemon_->tcp_target(), options, 31, /*scattered=*/true);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_calls_by_messages_total{op=\"put\"}"), 0);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_calls_by_messages_total{op=\"get\"}"), 0);
  EXPECT_GT(Metric(*daemon_, "proxima_transfer_bytes_total{transport=\"ucx\",direction=\"in\"}"),
            0);
}

TEST_P(UcxIntegrationTest, RendezvousPutsAndGetsLandByteExact) {
  // ClientOptions::ucx_rendezvous_bytes and ucx_rendezvous_get_bytes = 0: every put's blocks go
  // as rendezvous messages, which the daemon has UCX move into the tier memory it reserved (over
  // tcp; over shared memory the client sends no messages), and every get's come back so, moved
  // into the client's segments after the answer (over tcp; over shared memory the daemon sends
  // eager: its endpoints there cannot be closed by force should a client never take them):
  // scattered blocks (gathered into one message each, received into a buffer and scattered) and
  // blocks in one registered segment, every byte round-trips, nothing stays parked and no block
  // stays held.
  ClientOptions options;
  options.ucx_rendezvous_bytes = 0;
  options.ucx_rendezvous_get_bytes = 0;
  uint64_t block_bytes = 0;
  ScatteredRoundTrip(daemon_->tcp_target(), options, 32, /*scattered=*/true, &block_bytes);
  ScatteredRoundTrip(daemon_->tcp_target(), options, 33, /*scattered=*/false);
  const bool tcp = std::string(GetParam()) == "tcp";
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_calls_by_messages_total{op=\"put\"}"), tcp ? 2 : 0);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_rendezvous_bytes_total"), tcp ? 12 * block_bytes : 0);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_calls_by_messages_total{op=\"get\"}"), 2);
  // A send is counted when the daemon sees it end, before it lets go of the blocks: which can
  // be just after the client's get returned.
  EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_rendezvous_get_held_bytes", 0), 0);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_rendezvous_sent_bytes_total"),
            tcp ? 12 * block_bytes : 0);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_parked_bytes"), 0);
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_messages_dropped_total"), 0);
}

TEST_P(UcxIntegrationTest, AGetWhoseBytesStopMidWayFailsAndNothingLandsAfterIt) {
  // A rendezvous get whose daemon stops (SIGSTOP) after it answered, while the blocks move into
  // the caller's buffer: the Get fails UNAVAILABLE within the call's deadline plus the receive's
  // own, and once it has returned nothing more lands in that buffer, even after the daemon
  // resumes (the client closed its endpoint by force). The next Get re-opens the session and is
  // byte-exact.
  if (std::string(GetParam()) != "tcp") {
    GTEST_SKIP() << "over shared memory the daemon sends gets eager: their bytes have all "
                    "arrived before it answers";
  }
  ClientOptions options;
  options.target = daemon_->tcp_target();
  options.transport = Transport::kUcx;
  options.call_timeout = absl::Seconds(2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel(1024)));  // 16 MiB blocks
  ASSERT_GE(p.block_bytes, options.ucx_rendezvous_get_bytes);
  constexpr size_t kBlocks = 8;
  std::vector<std::byte> cache(kBlocks * p.block_bytes);
  ASSERT_OK_AND_ASSIGN(client::MemoryRegion region, c->RegisterMemory(cache.data(), cache.size()));
  const std::vector<BlockKey> keys = client::TestKeyChain(61, 0, kBlocks);
  std::vector<std::span<const std::byte>> in;
  std::vector<std::span<std::byte>> out;
  for (size_t i = 0; i < kBlocks; ++i) {
    std::span<std::byte> b(cache.data() + i * p.block_bytes, p.block_bytes);
    client::FillTestBlock(61, i, b);
    in.push_back(b);
    out.push_back(b);
  }
  ASSERT_OK(c->Put(p, keys, in).status());

  bool exercised = false;  // a round stopped the daemon while the client was receiving
  for (int round = 0; round < 5 && !exercised; ++round) {
    std::fill(cache.begin(), cache.end(), std::byte{0});
    // Stops the daemon as soon as it holds blocks for this get: it has answered, or is about to.
    std::atomic<bool> stopped{false};
    std::thread stopper([&] {
      const absl::Time end = absl::Now() + absl::Seconds(10);
      while (absl::Now() < end && Metric(*daemon_, "proxima_ucx_rendezvous_get_held_bytes") <= 0) {
      }
      if (absl::Now() < end) {
        daemon_->Signal(SIGSTOP);
        stopped = true;
      }
    });
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<bool>> got = c->Get(p, keys, out);
    stopper.join();
    ASSERT_TRUE(stopped) << "round " << round << ": the daemon never held blocks for the get";
    EXPECT_LE(absl::Now() - start, 2 * options.call_timeout + absl::Seconds(2)) << round;
    if (got.ok()) {  // every byte moved before the stop: not this round
      daemon_->Signal(SIGCONT);
      continue;
    }
    // Stopped before its answer left, the call itself misses its deadline; after, the receive
    // does (UNAVAILABLE, naming the rendezvous messages).
    EXPECT_TRUE(absl::IsUnavailable(got.status()) || absl::IsDeadlineExceeded(got.status()))
        << round << ": " << got.status();
    exercised = absl::IsUnavailable(got.status()) &&
                absl::StrContains(got.status().message(), "rendezvous");
    // Whatever the call left in the buffer is overwritten; the daemon resumes, and what it still
    // had to send must not reach the buffer any more.
    std::fill(cache.begin(), cache.end(), std::byte{0x5a});
    daemon_->Signal(SIGCONT);
    absl::SleepFor(absl::Seconds(1));
    EXPECT_EQ(std::count(cache.begin(), cache.end(), std::byte{0x5a}),
              static_cast<ptrdiff_t>(cache.size()))
        << "round " << round << ": bytes landed after the Get had returned";
    EXPECT_EQ(WaitForMetric(*daemon_, "proxima_ucx_rendezvous_get_held_bytes", 0), 0) << round;
  }
  EXPECT_TRUE(exercised) << "no round stopped the daemon while the client was receiving";
  // Back to normal: the session re-opens, and every block comes back byte-exact.
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->Get(p, keys, out));
  for (size_t i = 0; i < kBlocks; ++i) {
    EXPECT_TRUE(found[i] && client::IsTestBlock(61, i, out[i])) << i;
  }
}

TEST_P(UcxIntegrationTest, ADaemonKilledMidTransferNeverTakesItsClientDown) {
  // The daemon SIGKILLed while a client moves blocks over UCX: the client's calls fail, and the
  // client lives on. Before blocks moved as messages, a daemon that died while it wrote a Get
  // into the client's buffer (one-sided puts, emulated over tcp) made the client's UCX abort the
  // whole process ("Endpoint timeout" answering the dead initiator). As in
  // tools/ucx_repro/ucx_dead_peer_repro, the client is stopped (SIGSTOP) while the daemon sends,
  // the daemon is killed, and the client continued: it then reads what was in flight and the
  // closed connection at once, the case that aborted.
  if (std::string(GetParam()) != "tcp") {
    GTEST_SKIP() << "UCX 1.13's shared-memory transports have no peer failure detection; over "
                    "them the daemon copies through mapped memory and posts no operation";
  }
  //
  // The stop comes a while after both clients' sessions are open and Gets flow, never at a fixed
  // time from the start: under qemu a fixed time could fall in the sessions' UCX wire-up, and
  // UCX 1.13 aborts a process whose endpoint fails with a wire-up reply still queued (an
  // assertion upstream removed; docs/operations.md), which is not the case this test is about.
  const std::string gets = "proxima_ucx_calls_by_messages_total{op=\"get\"}";
  for (int round = 0; round < 3; ++round) {
    if (round > 0) {
      ASSERT_OK(daemon_->Restart());
    }
    const std::string target = daemon_->tcp_target();
    const absl::Duration stop_after = absl::Milliseconds(100 + 250 * round);
    absl::Time flowing = absl::InfiniteFuture();  // when both sessions were open and Gets flowed
    absl::Time next_scrape = absl::InfinitePast();
    pid_t client = -1;
    bool done = false;
    testing::CommandResult r = testing::RunCommand(
        {testing::ProximactlPath(), "load", "--target=" + target, "--transport=ucx", "--clients=2",
         "--duration=3", "--timeout=2", "--tokens_per_block=512", "--batch=8", "--working_set=16",
         "--get_fraction=0.8"},
        absl::Seconds(40), [&] {
          if (done) return false;
          const absl::Time now = absl::Now();
          if (flowing == absl::InfiniteFuture()) {
            if (now < next_scrape) return false;
            next_scrape = now + absl::Milliseconds(20);
            if (Metric(*daemon_, "proxima_ucx_sessions") < 2 || Metric(*daemon_, gets) < 4) {
              return false;
            }
            flowing = now;
          }
          if (now - flowing < stop_after) return false;
          done = true;
          client = ProcessWithArgument("--target=" + target);
          if (client <= 0) return false;
          kill(client, SIGSTOP);
          absl::SleepFor(absl::Milliseconds(100));  // the daemon keeps sending meanwhile
          daemon_->Signal(SIGKILL);
          daemon_->WaitExit(absl::Seconds(10));
          absl::SleepFor(absl::Milliseconds(200));
          kill(client, SIGCONT);
          return false;
        });
    ASSERT_GT(client, 0) << "round " << round << ": proximactl load was not found running";
    // Exit status 1: its calls failed once the daemon was gone; -1 would be a signal (abort).
    EXPECT_EQ(r.exit_code, 1) << "round " << round << "\n" << r.out << r.err;
    EXPECT_THAT(r.err, Not(HasSubstr("Fatal"))) << "round " << round;
  }
}

TEST(UcxLimitsTest, RendezvousGetsStayWithinTheDaemonsLimit) {
  // ucx.rendezvous_get_max_bytes bounds the bytes of blocks pinned for rendezvous gets: a get
  // whose blocks would pass it comes eager instead (and still byte-exact); 0 turns rendezvous
  // gets off. 8 blocks of 256 KiB per get, every block rendezvous on the client's side.
  setenv("UCX_TLS", "tcp", 1);
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
  for (const char* limit : {"4MiB", "1MiB", "0"}) {
    ASSERT_OK_AND_ASSIGN(
        auto daemon,
        DaemonProcess::Start({"tiers.host.capacity_bytes=64MiB", "server.max_batch_blocks=8",
                              absl::StrCat("ucx.rendezvous_get_max_bytes=", limit)}));
    ClientOptions options;
    options.target = daemon->tcp_target();
    options.transport = Transport::kUcx;
    options.ucx_rendezvous_get_bytes = 0;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(options));
    ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
    constexpr size_t kBlocks = 8;  // 2 MiB a get
    std::vector<std::byte> cache(kBlocks * p.block_bytes);
    ASSERT_OK_AND_ASSIGN(client::MemoryRegion region,
                         c->RegisterMemory(cache.data(), cache.size()));
    std::vector<std::span<const std::byte>> in;
    std::vector<std::span<std::byte>> out;
    for (size_t i = 0; i < kBlocks; ++i) {
      std::span<std::byte> b(cache.data() + i * p.block_bytes, p.block_bytes);
      client::FillTestBlock(71, i, b);
      in.push_back(b);
      out.push_back(b);
    }
    const std::vector<BlockKey> keys = client::TestKeyChain(71, 0, kBlocks);
    ASSERT_OK(c->Put(p, keys, in).status());
    std::fill(cache.begin(), cache.end(), std::byte{0});
    ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->Get(p, keys, out));
    for (size_t i = 0; i < kBlocks; ++i) {
      EXPECT_TRUE(found[i] && client::IsTestBlock(71, i, out[i])) << limit << " " << i;
    }
    EXPECT_EQ(WaitForMetric(*daemon, "proxima_ucx_rendezvous_get_held_bytes", 0), 0) << limit;
    EXPECT_EQ(Metric(*daemon, "proxima_ucx_calls_by_messages_total{op=\"get\"}"), 1) << limit;
    // 4 MiB holds the get's 2 MiB: rendezvous. 1 MiB and 0 do not: eager.
    EXPECT_EQ(Metric(*daemon, "proxima_ucx_rendezvous_sent_bytes_total"),
              std::string(limit) == "4MiB" ? kBlocks * p.block_bytes : 0)
        << limit;
  }
  unsetenv("UCX_TLS");
}

TEST(UcxLimitsTest, UcxBlockBytesAreChargedToTheClientsInflightLimit) {
  // server.max_inflight_bytes_per_client bounds what one client holds in the daemon over UCX
  // too: a PutUcx or GetUcx is charged the block bytes it moves, like an inline call's message.
  // The client knows the limit (GetServerInfo) and cuts its UCX batches to fit it.
  setenv("UCX_TLS", "tcp", 1);
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
  ASSERT_OK_AND_ASSIGN(
      auto daemon,
      DaemonProcess::Start({"tiers.host.capacity_bytes=64MiB", "server.max_batch_blocks=8",
                            "server.max_inflight_bytes_per_client=1MiB"}));
  ClientOptions options;
  options.target = daemon->tcp_target();  // accounted per client (Unix-socket peers are not)
  options.transport = Transport::kUcx;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(options));
  EXPECT_EQ(c->server_info().max_inflight_bytes, uint64_t{1} << 20);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));  // 256 KiB blocks
  constexpr size_t kBlocks = 8;  // 2 MiB: within max_batch_blocks, twice the byte limit
  std::vector<std::byte> cache(kBlocks * p.block_bytes);
  std::vector<std::span<const std::byte>> in;
  std::vector<std::span<std::byte>> out;
  for (size_t i = 0; i < kBlocks; ++i) {
    std::span<std::byte> b(cache.data() + i * p.block_bytes, p.block_bytes);
    client::FillTestBlock(31, i, b);
    in.push_back(b);
    out.push_back(b);
  }
  std::vector<BlockKey> keys = client::TestKeyChain(31, 0, kBlocks);
  // Three blocks (768 KiB and the request) fit in one call, four do not: 3 + 3 + 2.
  ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> outcomes, c->Put(p, keys, in));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  std::fill(cache.begin(), cache.end(), std::byte{0});
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->Get(p, keys, out));
  EXPECT_THAT(found, ::testing::Each(true));
  for (size_t i = 0; i < kBlocks; ++i) EXPECT_TRUE(client::IsTestBlock(31, i, out[i])) << i;
  ASSERT_OK_AND_ASSIGN(std::string m, daemon->ScrapeMetrics());
  EXPECT_EQ(MetricValue(m, "proxima_requests_total{method=\"PutUcx\",code=\"OK\"}"), 3);
  EXPECT_EQ(MetricValue(m, "proxima_requests_total{method=\"GetUcx\",code=\"OK\"}"), 3);
  EXPECT_EQ(MetricValue(m, "proxima_transfer_bytes_total{transport=\"ucx\",direction=\"in\"}"),
            kBlocks * p.block_bytes);

  // One block larger than the limit cannot be cut: the daemon refuses it before moving a byte.
  ASSERT_OK_AND_ASSIGN(Profile big, c->RegisterProfile(TestModel(128)));  // 2 MiB blocks
  std::vector<std::byte> one(big.block_bytes);
  client::FillTestBlock(32, 0, one);
  std::vector<std::span<const std::byte>> one_in = {one};
  // Its rendezvous message (2 MiB) is dropped when the call is refused: the Put returns at once,
  // not when the client's wait for its send reaches the call's deadline (30 s).
  const absl::Time start = absl::Now();
  EXPECT_THAT(c->Put(big, client::TestKeyChain(32, 0, 1), one_in).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("server.max_inflight_bytes_per_client = 1048576")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(WaitForMetric(*daemon, "proxima_ucx_parked_bytes", 0), 0);
  EXPECT_EQ(Metric(*daemon, "proxima_transfer_bytes_total{transport=\"ucx\",direction=\"in\"}"),
            kBlocks * p.block_bytes);
  unsetenv("UCX_TLS");
}

TEST(UcxProbeTest, AutoPicksUcxOnlyWhenBytesMoveEndToEnd) {
  // The daemon's UCX offers tcp only; this client's offers tcp and cma. The endpoint connects
  // (both have tcp) but the client's rkeys name cma's memory domain, which the daemon cannot
  // unpack: every PutUcx would fail. ConnectUcx's probe read catches it, so `auto` moves blocks
  // inline and a forced `ucx` fails at Connect, naming the cause.
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
  setenv("UCX_TLS", "tcp", 1);
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start());
  setenv("UCX_TLS", "tcp,cma", 1);
  ClientOptions options;
  options.target = daemon->tcp_target();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(options));
  EXPECT_EQ(c->transport(), Transport::kInline);
  EXPECT_THAT(c->transport_detail(), HasSubstr("probe"));
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  std::vector<std::byte> block(p.block_bytes);
  client::FillTestBlock(41, 0, block);
  std::vector<BlockKey> keys = client::TestKeyChain(41, 0, 1);
  std::vector<std::span<const std::byte>> in = {block};
  ASSERT_OK(c->Put(p, keys, in).status());
  EXPECT_EQ(WaitForMetric(*daemon, "proxima_ucx_sessions", 0), 0);  // the probed one is gone

  options.transport = Transport::kUcx;
  EXPECT_THAT(Client::Connect(options).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ConnectUcx probe")));
  // With the same transports on both sides, `auto` is UCX.
  setenv("UCX_TLS", "tcp", 1);
  options.transport = Transport::kAuto;
  ASSERT_OK_AND_ASSIGN(c, Client::Connect(options));
  EXPECT_EQ(c->transport(), Transport::kUcx) << c->transport_detail();
  unsetenv("UCX_TLS");
}

TEST(UcxDisabledTest, AutoFallsBackToInlineAndForcedUcxFails) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start({"ucx.enabled=false"}));
  ClientOptions options;
  options.target = daemon->tcp_target();
  ASSERT_OK_AND_ASSIGN(auto c, Client::Connect(options));
  EXPECT_EQ(c->transport(), Transport::kInline);
  EXPECT_THAT(c->transport_detail(), HasSubstr("proximad has UCX disabled"));
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  std::vector<std::byte> block(p.block_bytes);
  client::FillTestBlock(4, 0, block);
  std::vector<std::span<const std::byte>> in = {block};
  std::vector<BlockKey> keys = client::TestKeyChain(4, 0, 1);
  ASSERT_OK(c->Put(p, keys, in).status());
  options.transport = Transport::kUcx;
  EXPECT_THAT(Client::Connect(options).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("transport ucx requested, but: proximad has UCX disabled")));
  testing::CommandResult info = testing::RunCommand(
      {testing::ProximactlPath(), "info", "--target=" + daemon->tcp_target(), "--json"});
  EXPECT_THAT(info.out, HasSubstr("\"transport\":\"inline\""));
  EXPECT_EQ(Metric(*daemon, "proxima_ucx_sessions"), -1);  // no UCX series at all
}

// The UCX calls under bearer tokens (docs/security.md, "UCX data plane"): raw stubs with this
// process's own worker, so that a test can present any token with any session id. Namespaces:
// a (worker: read-write, dashboard: read-only), b (worker), c (private_prefixes; alice, bob).
class UcxAuthTest : public ::testing::Test {
 protected:
  static constexpr char kA[] = "ucx-a-rw-5b0e1f2a3c4d5e6f";
  static constexpr char kAReadOnly[] = "ucx-a-ro-9a8b7c6d5e4f3a2b";
  static constexpr char kB[] = "ucx-b-rw-0f1e2d3c4b5a6978";
  static constexpr char kAlice[] = "ucx-c-alice-1122334455667788";
  static constexpr char kBob[] = "ucx-c-bob-8877665544332211";

  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    char tmpl[] = "/tmp/proxima-ucx-auth-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    auto file = [this](const char* name, const char* token) {
      const std::string path = dir_ + "/" + name;
      std::ofstream(path) << token << "\n";
      return path;
    };
    ASSERT_OK_AND_ASSIGN(
        daemon_,
        DaemonProcess::Start({absl::StrCat(
            "namespaces=[{name: a, tokens: [{name: worker, file: ", file("a", kA),
            "}, {name: dashboard, file: ", file("a-ro", kAReadOnly), ", access: read_only}]}, ",
            "{name: b, tokens: [{name: worker, file: ", file("b", kB), "}]}, ",
            "{name: c, private_prefixes: true, tokens: [{name: alice, file: ",
            file("alice", kAlice), "}, {name: bob, file: ", file("bob", kBob), "}]}]")}));
    ASSERT_OK_AND_ASSIGN(worker_, ucx::Worker::Create("auth-test"));
    stub_ = v1::KVTier::NewStub(
        grpc::CreateChannel(daemon_->unix_target(), grpc::InsecureChannelCredentials()));
    ASSERT_OK_AND_ASSIGN(profile_a_, RegisterProfile(kA, "a"));
    ASSERT_OK_AND_ASSIGN(profile_b_, RegisterProfile(kB, "b"));
    // Block 0: the source of puts (a test pattern); block 1: the destination of gets.
    buf_.resize(2 * block_bytes_);
    client::FillTestBlock(5, 0, std::span(buf_).first(block_bytes_));
    ASSERT_OK_AND_ASSIGN(reg_, worker_->Register(buf_.data(), buf_.size()));
  }
  void TearDown() override {
    reg_.reset();
    worker_.reset();
    daemon_.reset();
    std::filesystem::remove_all(dir_);
    unsetenv("UCX_TLS");
  }

  std::unique_ptr<grpc::ClientContext> Context(const std::string& token) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
    return ctx;
  }
  absl::StatusOr<uint64_t> RegisterProfile(const std::string& token, const std::string& ns) {
    v1::RegisterProfileRequest req;
    req.set_namespace_name(ns);
    *req.mutable_profile() = TestModel(4);
    v1::RegisterProfileResponse resp;
    PROXIMA_RETURN_IF_ERROR(
        client::FromGrpc(stub_->RegisterProfile(Context(token).get(), req, &resp)));
    block_bytes_ = resp.block_bytes();
    return resp.profile_id();
  }
  absl::StatusOr<uint64_t> Open(const std::string& token) {
    v1::ConnectUcxRequest req;
    req.set_worker_address(worker_->address());
    v1::ConnectUcxResponse resp;
    PROXIMA_RETURN_IF_ERROR(client::FromGrpc(stub_->ConnectUcx(Context(token).get(), req, &resp)));
    return resp.session_id();
  }
  absl::Status Close(const std::string& token, uint64_t session) {
    v1::DisconnectUcxRequest req;
    req.set_session_id(session);
    v1::DisconnectUcxResponse resp;
    return client::FromGrpc(stub_->DisconnectUcx(Context(token).get(), req, &resp));
  }
  // Fills the regions and the one block of a PutUcx / GetUcx naming buf_'s block `index`.
  template <typename Req>
  void Describe(Req* req, const std::string& ns, uint64_t profile, uint64_t session,
                const BlockKey& key, size_t index) {
    req->set_namespace_name(ns);
    req->set_profile_id(profile);
    req->set_session_id(session);
    v1::UcxRegion* r = req->add_regions();
    r->set_rkey(reg_->packed_rkey());
    r->set_address(reinterpret_cast<uint64_t>(buf_.data()));
    r->set_length(buf_.size());
    v1::UcxBlock* b = req->add_blocks();
    b->set_key(std::string(reinterpret_cast<const char*>(key.data()), key.size()));
    v1::UcxSegment* s = b->add_segments();
    s->set_region(0);
    s->set_address(reinterpret_cast<uint64_t>(buf_.data() + index * block_bytes_));
    s->set_length(block_bytes_);
    b->set_crc32c(Crc32c(std::span(buf_).subspan(index * block_bytes_, block_bytes_)));
  }
  absl::Status PutUcx(const std::string& token, const std::string& ns, uint64_t profile,
                      uint64_t session, const BlockKey& key) {
    v1::PutUcxRequest req;
    Describe(&req, ns, profile, session, key, 0);
    v1::PutResponse resp;
    return client::FromGrpc(stub_->PutUcx(Context(token).get(), req, &resp));
  }
  // Gets `key` into block 1 of buf_ (zeroed first); true when found.
  absl::StatusOr<bool> GetUcx(const std::string& token, const std::string& ns, uint64_t profile,
                              uint64_t session, const BlockKey& key) {
    std::fill(buf_.begin() + block_bytes_, buf_.end(), std::byte{0});
    v1::GetUcxRequest req;
    Describe(&req, ns, profile, session, key, 1);
    v1::GetUcxResponse resp;
    PROXIMA_RETURN_IF_ERROR(client::FromGrpc(stub_->GetUcx(Context(token).get(), req, &resp)));
    if (resp.results_size() != 1) return absl::InternalError("GetUcx: not one result");
    return resp.results(0).found();
  }
  uint32_t Present(const std::string& token, const std::string& ns, uint64_t profile,
                   const BlockKey& key) {
    v1::LookupRequest req;
    req.set_namespace_name(ns);
    req.set_profile_id(profile);
    req.add_keys(std::string(reinterpret_cast<const char*>(key.data()), key.size()));
    v1::LookupResponse resp;
    EXPECT_OK(client::FromGrpc(stub_->Lookup(Context(token).get(), req, &resp)));
    return resp.num_prefix_present();
  }
  bool GotSourceBlock() const {
    return client::IsTestBlock(5, 0, std::span(buf_).subspan(block_bytes_, block_bytes_));
  }

  std::string dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<ucx::Worker> worker_;
  std::unique_ptr<v1::KVTier::Stub> stub_;
  uint64_t profile_a_ = 0;
  uint64_t profile_b_ = 0;
  uint64_t block_bytes_ = 0;
  std::vector<std::byte> buf_;
  std::shared_ptr<ucx::Registration> reg_;
};

TEST_F(UcxAuthTest, WrongOrMissingTokenIsUnauthenticatedOnEveryUcxCall) {
  const std::string wrong = "ucx-not-a-configured-token-0000";
  const BlockKey key = client::TestKeyChain(21, 0, 1)[0];
  auto unauthenticated = StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("not valid"));
  EXPECT_THAT(Open(wrong), unauthenticated);
  ASSERT_OK_AND_ASSIGN(uint64_t session, Open(kA));
  EXPECT_THAT(PutUcx(wrong, "a", profile_a_, session, key), unauthenticated);
  EXPECT_THAT(GetUcx(wrong, "a", profile_a_, session, key), unauthenticated);
  EXPECT_THAT(Close(wrong, session), unauthenticated);
  // No token at all, naming the protected namespace.
  ASSERT_OK_AND_ASSIGN(uint64_t anonymous, Open(""));
  EXPECT_THAT(PutUcx("", "a", profile_a_, anonymous, key),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("needs a bearer token")));
  EXPECT_THAT(GetUcx("", "a", profile_a_, anonymous, key),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("needs a bearer token")));
  EXPECT_EQ(Present(kA, "a", profile_a_, key), 0u);  // nothing was stored
  // The control: the same calls with the right token move the bytes, and the session survived
  // the refused Close.
  ASSERT_OK(PutUcx(kA, "a", profile_a_, session, key));
  EXPECT_EQ(Present(kA, "a", profile_a_, key), 1u);
  ASSERT_OK_AND_ASSIGN(bool found, GetUcx(kA, "a", profile_a_, session, key));
  EXPECT_TRUE(found);
  EXPECT_TRUE(GotSourceBlock());
  ASSERT_OK(Close(kA, session));
  EXPECT_THAT(PutUcx(kA, "a", profile_a_, session, key),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("is not open")));
}

TEST_F(UcxAuthTest, ReadOnlyTokenGetsOverUcxButPutUcxIsPermissionDenied) {
  const std::vector<BlockKey> keys = client::TestKeyChain(22, 0, 2);
  ASSERT_OK_AND_ASSIGN(uint64_t writer, Open(kA));
  ASSERT_OK_AND_ASSIGN(uint64_t reader, Open(kAReadOnly));
  ASSERT_OK(PutUcx(kA, "a", profile_a_, writer, keys[0]));
  EXPECT_THAT(
      PutUcx(kAReadOnly, "a", profile_a_, reader, keys[1]),
      StatusIs(absl::StatusCode::kPermissionDenied,
               AllOf(HasSubstr("'dashboard'"), HasSubstr("read_only"), HasSubstr("PutUcx"))));
  EXPECT_EQ(Present(kA, "a", profile_a_, keys[1]), 0u);
  ASSERT_OK_AND_ASSIGN(bool found, GetUcx(kAReadOnly, "a", profile_a_, reader, keys[0]));
  EXPECT_TRUE(found);
  EXPECT_TRUE(GotSourceBlock());
}

TEST_F(UcxAuthTest, SessionOfAnotherCallerIsRefusedAndStaysOpen) {
  const BlockKey key = client::TestKeyChain(23, 0, 1)[0];
  ASSERT_OK_AND_ASSIGN(uint64_t session_a, Open(kA));
  ASSERT_OK(PutUcx(kA, "a", profile_a_, session_a, key));
  // B, in its own namespace, presents a's session id: every use is refused, nothing moves.
  auto foreign =
      StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("was opened by another caller"));
  EXPECT_THAT(PutUcx(kB, "b", profile_b_, session_a, key), foreign);
  EXPECT_THAT(GetUcx(kB, "b", profile_b_, session_a, key), foreign);
  EXPECT_THAT(Close(kB, session_a), foreign);
  EXPECT_EQ(Present(kB, "b", profile_b_, key), 0u);
  // Another token of the same namespace is another caller too.
  EXPECT_THAT(GetUcx(kAReadOnly, "a", profile_a_, session_a, key), foreign);
  // So is a call without a token.
  EXPECT_THAT(Close("", session_a), foreign);
  // The session is still a's.
  ASSERT_OK_AND_ASSIGN(bool found, GetUcx(kA, "a", profile_a_, session_a, key));
  EXPECT_TRUE(found);
  EXPECT_TRUE(GotSourceBlock());
  EXPECT_EQ(Metric(*daemon_, "proxima_ucx_sessions"), 1);
}

TEST_F(UcxAuthTest, PrivatePrefixesHoldOverUcx) {
  ASSERT_OK_AND_ASSIGN(uint64_t profile_c, RegisterProfile(kAlice, "c"));
  const BlockKey key = client::TestKeyChain(24, 0, 1)[0];
  ASSERT_OK_AND_ASSIGN(uint64_t alice, Open(kAlice));
  ASSERT_OK_AND_ASSIGN(uint64_t bob, Open(kBob));
  ASSERT_OK(PutUcx(kAlice, "c", profile_c, alice, key));
  EXPECT_EQ(Present(kAlice, "c", profile_c, key), 1u);
  EXPECT_EQ(Present(kBob, "c", profile_c, key), 0u);
  ASSERT_OK_AND_ASSIGN(bool found, GetUcx(kBob, "c", profile_c, bob, key));
  EXPECT_FALSE(found);
  ASSERT_OK_AND_ASSIGN(found, GetUcx(kAlice, "c", profile_c, alice, key));
  EXPECT_TRUE(found);
  EXPECT_TRUE(GotSourceBlock());
}

// A daemon in namespaces of its own, as in a Kubernetes pod without hostPID or hostIPC, and this
// client outside them (run directly: in the host's; run by the ctest entry ucx_namespaces_apart:
// in namespaces of its own). UCX's posix transport cannot reach across PID namespaces, and a
// System V segment id names a segment only in its IPC namespace, so the bytes move over tcp, and
// the client leaves those parts out of its memory keys (ConnectUcxResponse.pid_namespace,
// ipc_namespace). With them, the daemon refused the keys ("memory domain 2 key is 24 bytes;
// expected 32", "names System V segment N, which cannot be examined") or looked for the segment
// in its own namespace ("cannot be opened (/proc/1/fd/25)": a file of another process, had it
// existed), and every Get into such memory failed. `tls`: UCX_TLS, or null for UCX's default.
void AllocatedMemoryRoundTripsWithADaemonIn(const std::vector<std::string>& namespaces,
                                            const char* tls) {
  if (std::system("unshare --pid --ipc --fork --mount-proc true > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "cannot create PID and IPC namespaces here (unshare needs root or user "
                    "namespaces)";
  }
  if (tls != nullptr) setenv("UCX_TLS", tls, 1);
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
  absl::Cleanup unset = [] { unsetenv("UCX_TLS"); };
  std::vector<std::string> launcher = {"/usr/bin/unshare"};
  for (const std::string& ns : namespaces) launcher.push_back("--" + ns);
  launcher.insert(launcher.end(), {"--fork", "--mount-proc", "--kill-child", "--"});
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DaemonProcess> d,
                       DaemonProcess::Start({"tiers.host.capacity_bytes=256MiB"}, launcher));
  ClientOptions options;
  options.target = d->tcp_target();
  options.transport = Transport::kUcx;
  options.call_timeout = absl::Seconds(20);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  ASSERT_NO_FATAL_FAILURE(RoundTripAllocatedBlocks(*c, p, /*blocks=*/4, /*rounds=*/2, 60));
  // Nothing went through a mapping of the client's memory: UCX moved every byte.
  EXPECT_EQ(Metric(*d, "proxima_ucx_direct_transfers_total"), 0);
  EXPECT_THAT(c->transport_detail(), Not(HasSubstr(" over ")));
}

TEST(UcxNamespaceTest, AllocatedMemoryMovesByteExactToADaemonInAnotherPidNamespace) {
  AllocatedMemoryRoundTripsWithADaemonIn({"pid"}, "posix,self,tcp");
}

// UCX's default transports: its allocations are System V segments here.
TEST(UcxNamespaceTest, AllocatedMemoryMovesByteExactToADaemonInOtherPidAndIpcNamespaces) {
  AllocatedMemoryRoundTripsWithADaemonIn({"pid", "ipc"}, nullptr);
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxIntegrationTest, ::testing::Values("tcp", "posix,self"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) == "tcp" ? "tcp" : "shm";
                         });
INSTANTIATE_TEST_SUITE_P(Transports, RawUcxTest, ::testing::Values("tcp", "posix,self"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) == "tcp" ? "tcp" : "shm";
                         });
// The raw protocol's cases (lying keys, freed and truncated segments among them) with posix keys
// that name their segments by shm_open name and by a file in a directory.
INSTANTIATE_TEST_SUITE_P(PosixKeyModes, RawUcxTest,
                         ::testing::Values("posix,self:shm_open", "posix,self:dir"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param).substr(std::string("posix,self:").size());
                         });

}  // namespace
}  // namespace proxima
