// End to end: bytes corrupted in the daemon's tier memory never reach a caller. The daemon runs
// in this process (the only way to flip bits in its arena) but serves real gRPC on loopback,
// and the real client library talks to it, inline and over UCX. The client asks the daemon to
// skip its own CRC32C check (GetRequest / GetUcxRequest.client_verifies_crc32c) and checks
// every block itself; a block that fails is asked for again with the daemon checking, which
// drops and counts it: the caller sees a miss, the other blocks of the batch arrive intact, and
// nothing else is lost. Also over UCX's shared memory with the caller's ordinary buffers, which
// move through host staging: there the client checks each block while copying it out.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <stdlib.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/testing/status_matchers.h"
#include "common/ucx_address_check.h"
#include "daemon/config.h"
#include "daemon/daemon.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace proxima {
namespace {

using client::BlockKey;
using client::Client;

// 2 layers x 16 tokens x 4 heads x 64 dim x fp16 x (K, V) = 32 KiB blocks.
v1::ModelProfile SmallModel() {
  v1::ModelProfile p;
  p.set_num_layers(2);
  p.set_num_kv_heads(4);
  p.set_head_dim(64);
  p.set_tokens_per_block(16);
  p.set_dtype(v1::DTYPE_FP16);
  p.set_fingerprint("corruption-test");
  return p;
}

struct Path {
  client::Transport transport;
  const char* ucx_tls;  // UCX_TLS for the daemon and the client (both in this process), or null
  const char* name;
  // The caller's ordinary buffers move through host staging (UCX over shared memory).
  bool staged = false;
  // Every get's blocks come as rendezvous messages (ClientOptions::ucx_rendezvous_get_bytes 0),
  // moved straight into the caller's buffers and checked there.
  bool rendezvous_gets = false;
};

void PrintTo(const Path& path, std::ostream* os) { *os << path.name; }

class CorruptionTest : public ::testing::TestWithParam<Path> {
 protected:
  void SetUp() override {
    if (GetParam().ucx_tls != nullptr) {
      setenv("UCX_TLS", GetParam().ucx_tls, 1);
      setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    }
    daemon::DaemonConfig config;
    config.server.listen = "127.0.0.1:0";
    config.server.unix_socket = "";
    config.server.metrics_listen = "";
    config.host_tier.capacity_bytes = 64ull << 20;
    // In process, the daemon checks its clients' worker addresses with the real proximad.
    ASSERT_OK_AND_ASSIGN(
        daemon_, daemon::Daemon::Start(config, {testing::ProximadPath(), ucx::kAddressCheckFlag}));
    client::ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", daemon_->tcp_port());
    options.transport = GetParam().transport;
    if (GetParam().rendezvous_gets) options.ucx_rendezvous_get_bytes = 0;
    ASSERT_OK_AND_ASSIGN(client_, Client::Connect(options));
    ASSERT_EQ(client_->transport(), GetParam().transport) << client_->transport_detail();
    if (GetParam().staged) {
      ASSERT_THAT(client_->transport_detail(), ::testing::HasSubstr("host staging"));
    }
    ASSERT_OK_AND_ASSIGN(profile_, client_->RegisterProfile(SmallModel()));
  }

  void TearDown() override {
    client_.reset();
    daemon_.reset();
    if (GetParam().ucx_tls != nullptr) unsetenv("UCX_TLS");
  }

  // Flips one bit of the stored block under `key` (namespace "default" is index 0).
  void Corrupt(const BlockKey& key, size_t byte_offset) {
    daemon::BlockId id{.namespace_index = 0, .profile_id = profile_.id, .key = key};
    ASSERT_TRUE(daemon_->core().store().CorruptForTesting(id, byte_offset));
  }

  std::unique_ptr<daemon::Daemon> daemon_;
  std::unique_ptr<Client> client_;
  client::Profile profile_;
};

TEST_P(CorruptionTest, CorruptBlockIsAMissTheRestOfTheBatchArrivesIntact) {
  constexpr uint64_t kSeed = 77;
  constexpr size_t kBlocks = 8;
  const std::vector<BlockKey> keys = client::TestKeyChain(kSeed, 0, kBlocks);
  std::vector<std::vector<std::byte>> blocks(kBlocks,
                                             std::vector<std::byte>(profile_.block_bytes));
  std::vector<std::span<const std::byte>> in;
  for (size_t i = 0; i < kBlocks; ++i) {
    client::FillTestBlock(kSeed, i, blocks[i]);
    in.push_back(blocks[i]);
  }
  ASSERT_OK(client_->Put(profile_, keys, in).status());
  Corrupt(keys[3], 12345);
  Corrupt(keys[6], 0);

  std::vector<std::vector<std::byte>> got(kBlocks, std::vector<std::byte>(profile_.block_bytes));
  std::vector<std::span<std::byte>> out(got.begin(), got.end());
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, client_->Get(profile_, keys, out));
  for (size_t i = 0; i < kBlocks; ++i) {
    if (i == 3 || i == 6) {
      EXPECT_FALSE(found[i]) << "corrupt block " << i << " was returned";
    } else {
      ASSERT_TRUE(found[i]) << "intact block " << i << " was lost";
      EXPECT_TRUE(client::IsTestBlock(kSeed, i, got[i])) << "wrong bytes for block " << i;
    }
  }
  // The first answer carried the stored bytes without the daemon's check (the client verifies):
  // written straight into the caller's buffers, the corrupt block's buffer holds them, one bit
  // off the block that was put (a rendezvous get's bytes land there too, and are checked there);
  // through host staging the client checks the half before copying out, so that buffer is never
  // written.
  std::vector<std::byte> expected(profile_.block_bytes);
  if (!GetParam().staged) {
    client::FillTestBlock(kSeed, 3, expected);
    expected[12345] ^= std::byte{0x01};
  }
  EXPECT_EQ(got[3], expected);
  // The daemon found both on the client's second ask, dropped and counted them; the client saw
  // no damage in transit.
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, client_->Stats());
  EXPECT_EQ(stats.crc_failures(), 2u);
  EXPECT_EQ(client_->crc_failures(), 0u);
  ASSERT_OK_AND_ASSIGN(size_t prefix, client_->Lookup(profile_, keys));
  EXPECT_EQ(prefix, 3u);  // block 3 is gone, so the chain's present prefix ends there
  if (GetParam().rendezvous_gets) {
    // The path under test was taken: the 8 blocks of the first ask came rendezvous (the second
    // ask sent nothing: the daemon found both blocks corrupt). The daemon counts a send once it
    // has seen it end, which can be just after the client's Get returned.
    const uint64_t expected_bytes = 8 * profile_.block_bytes;
    for (absl::Time end = absl::Now() + absl::Seconds(5);
         daemon_->ucx()->worker().rendezvous_sent_bytes() < expected_bytes && absl::Now() < end;) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(daemon_->ucx()->worker().rendezvous_sent_bytes(), expected_bytes);
  }

  // The dropped blocks can be stored again, and then read back intact.
  ASSERT_OK(client_->Put(profile_, std::span(keys).subspan(3, 1), std::span(in).subspan(3, 1))
                .status());
  ASSERT_OK_AND_ASSIGN(found, client_->Get(profile_, std::span(keys).subspan(3, 1),
                                           std::span(out).subspan(3, 1)));
  ASSERT_TRUE(found[0]);
  EXPECT_TRUE(client::IsTestBlock(kSeed, 3, got[3]));
}

TEST_P(CorruptionTest, ADaemonCheckedGetNeverSendsCorruptBytes) {
  // A gRPC client that leaves client_verifies_crc32c unset (any client but ours) gets the
  // daemon's check: the corrupt block is not sent at all.
  const std::vector<BlockKey> keys = client::TestKeyChain(5, 0, 1);
  std::vector<std::byte> block(profile_.block_bytes);
  client::FillTestBlock(5, 0, block);
  std::vector<std::span<const std::byte>> in = {block};
  ASSERT_OK(client_->Put(profile_, keys, in).status());
  Corrupt(keys[0], 100);

  v1::GetRequest request;
  request.set_namespace_name("default");
  request.set_profile_id(profile_.id);
  request.add_keys(std::string(reinterpret_cast<const char*>(keys[0].data()), keys[0].size()));
  auto stub = v1::KVTier::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", daemon_->tcp_port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::GetResponse response;
  grpc::Status status = stub->Get(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_FALSE(response.results(0).found());
  EXPECT_TRUE(response.results(0).data().empty());
  EXPECT_EQ(daemon_->core().store().crc_failures(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Transports, CorruptionTest,
                         ::testing::Values(Path{client::Transport::kInline, nullptr, "inline"},
                                           Path{client::Transport::kUcx, nullptr, "ucx"},
                                           Path{client::Transport::kUcx, "posix,self",
                                                "ucx_shm_host_staging", /*staged=*/true},
                                           Path{client::Transport::kUcx, "tcp",
                                                "ucx_tcp_rendezvous_gets", false,
                                                /*rendezvous_gets=*/true}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace proxima
