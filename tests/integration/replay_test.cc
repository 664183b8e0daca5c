// proxima_replay against a real proximad: the hit counts the tool reports for raw storage must
// equal those of an exact model of the daemon's host tier and temperature policy (LRU and
// segmented LRU), replaying the same trace.
//
// The model is replay::Simulate (tools/replay/policy_sim.h), the same code that compares
// temperature policies offline (docs/decisions.md). Why it is exact: with raw storage every block
// has the same size (a multiple of the tier's 64-byte alignment), so a host tier of
// C * block_bytes holds exactly C blocks (and the protected segment exactly share * C); Lookup
// does not touch a block, Get touches each block it returns in order, and Put touches a present
// block or inserts a new one, in chain order.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/kv_file.h"
#include "tests/integration/daemon_process.h"
#include "tools/replay/policy_sim.h"
#include "tools/replay/trace.h"

namespace proxima {
namespace {

using testing::DaemonProcess;
using testing::RunCommand;

// The smoke replay: 300 requests of a 1-in-16 family sample, 2-token blocks of real KV.
constexpr uint32_t kSampleOneIn = 16;
constexpr size_t kRequests = 300;
constexpr uint32_t kTokensPerBlock = 2;
constexpr uint64_t kBlockBytes = 2ull * 30 * kTokensPerBlock * 3 * 64 * 2;  // SmolLM2-135M bf16

double Field(const google::protobuf::Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  EXPECT_NE(it, s.fields().end()) << "no field " << key;
  return it == s.fields().end() ? -1 : it->second.number_value();
}

class ReplayTest : public ::testing::TestWithParam<std::tuple<std::string, size_t>> {};

TEST_P(ReplayTest, RawHitCountsEqualAnExactModelOfTheTemperaturePolicy) {
  const std::string policy = std::get<0>(GetParam());
  const size_t capacity_blocks = std::get<1>(GetParam());
  auto trace = replay::ReadTrace(PROXIMA_TRACE_PATH,
                                 {.sample_one_in = kSampleOneIn, .max_requests = kRequests});
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->requests.size(), kRequests);
  auto cache = replay::MakeCachePolicy(policy, capacity_blocks);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const replay::SimulatedCounts model = replay::Simulate(trace->requests, **cache);
  // The capacities are chosen so that the model evicts and still hits: a test that exercises
  // both paths, not one where every count is trivially 0 or maximal.
  ASSERT_GT(model.evictions, 0u);
  ASSERT_GT(model.hits, 0u);

  auto daemon = DaemonProcess::Start(
      {absl::StrCat("tiers.host.capacity_bytes=", capacity_blocks * kBlockBytes),
       "tierer.temperature_policy=" + policy,
       absl::StrCat("tierer.protected_share=", replay::kDefaultProtectedShare)});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  testing::CommandResult run = RunCommand(
      {PROXIMA_REPLAY_PATH, "--target=" + (*daemon)->tcp_target(),
       std::string("--trace=") + PROXIMA_TRACE_PATH, std::string("--kv_file=") + PROXIMA_KV_PATH,
       absl::StrCat("--tokens_per_block=", kTokensPerBlock),
       absl::StrCat("--sample_one_in=", kSampleOneIn), absl::StrCat("--max_requests=", kRequests),
       "--label=smoke"},
      absl::Seconds(50));
  ASSERT_EQ(run.exit_code, 0) << run.err << run.out << (*daemon)->Log();

  google::protobuf::Struct out;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(run.out, &out).ok()) << run.out;
  EXPECT_EQ(Field(out, "block_bytes"), kBlockBytes);
  EXPECT_EQ(Field(out, "requests"), kRequests);
  EXPECT_EQ(Field(out, "block_refs"), model.block_refs);
  EXPECT_EQ(Field(out, "hits"), model.hits);
  EXPECT_EQ(Field(out, "lookup_hits"), model.hits);
  EXPECT_DOUBLE_EQ(Field(out, "hit_ratio"), static_cast<double>(model.hits) / model.block_refs);
  EXPECT_EQ(Field(out, "prefill_tokens_saved"), model.hits * 512);
  EXPECT_EQ(Field(out, "puts_stored"), model.puts_stored);
  EXPECT_EQ(Field(out, "puts_already_present"), model.puts_already_present);
  EXPECT_EQ(Field(out, "evictions"), model.evictions);
  EXPECT_EQ(Field(out, "blocks_held"), model.held);
  // Raw storage: every hit came back byte-exact.
  EXPECT_EQ(Field(out, "exact"), model.hits);
  EXPECT_EQ(Field(out, "bad"), 0);
  EXPECT_EQ(Field(out, "get_missing"), 0);
  EXPECT_EQ(Field(out, "puts_no_space"), 0);
  EXPECT_EQ(Field(out, "capacity_bytes"), capacity_blocks * kBlockBytes);
}

// 150 blocks: well below the sample's working set (heavy eviction); 1200: most reuse fits.
INSTANTIATE_TEST_SUITE_P(PoliciesAndCapacities, ReplayTest,
                         ::testing::Combine(::testing::Values("lru", "slru"),
                                            ::testing::Values(150, 1200)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "_",
                                               std::get<1>(info.param));
                         });

// A block that comes back different must be caught: replaying again with payloads cut from a
// copy of the KV whose every element has its lowest mantissa bit flipped (a ~0.4% change) makes
// every hit differ from what was stored. Exact checking counts them as bad and exits 3; with a
// 1% error bound they count as lossy within bound.
TEST(ReplayTest, DifferentBytesAreCaught) {
  auto daemon = DaemonProcess::Start({"tiers.host.capacity_bytes=64MiB"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto run = [&](const std::string& kv_file, const std::string& bound) {
    return RunCommand({PROXIMA_REPLAY_PATH, "--target=" + (*daemon)->tcp_target(),
                       std::string("--trace=") + PROXIMA_TRACE_PATH, "--kv_file=" + kv_file,
                       absl::StrCat("--tokens_per_block=", kTokensPerBlock), "--sample_one_in=16",
                       "--max_requests=20", "--max_rel_l2=" + bound},
                      absl::Seconds(30));
  };
  testing::CommandResult first = run(PROXIMA_KV_PATH, "0");
  ASSERT_EQ(first.exit_code, 0) << first.err;

  auto kv = codec::ReadKvFile(PROXIMA_KV_PATH);
  ASSERT_TRUE(kv.ok()) << kv.status();
  for (uint16_t& x : kv->data) x ^= 1;
  const std::string altered = (*daemon)->dir() + "/altered.pkv";
  {
    std::ofstream out(altered, std::ios::binary);
    out << codec::SerializeKvFile(*kv);
  }
  google::protobuf::Struct out;
  testing::CommandResult exact = run(altered, "0");
  EXPECT_EQ(exact.exit_code, 3) << exact.err << exact.out;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(exact.out, &out).ok()) << exact.out;
  EXPECT_GT(Field(out, "hits"), 0);
  EXPECT_EQ(Field(out, "bad"), Field(out, "hits"));
  EXPECT_EQ(Field(out, "exact"), 0);

  testing::CommandResult bounded = run(altered, "0.01");
  EXPECT_EQ(bounded.exit_code, 0) << bounded.err << bounded.out;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(bounded.out, &out).ok()) << bounded.out;
  EXPECT_GT(Field(out, "lossy_within_bound"), 0);
  EXPECT_EQ(Field(out, "lossy_within_bound"), Field(out, "hits"));
  EXPECT_EQ(Field(out, "bad"), 0);
  EXPECT_GT(Field(out, "worst_k_rel_l2"), 0);
  EXPECT_LT(Field(out, "worst_k_rel_l2"), 0.01);
}

}  // namespace
}  // namespace proxima
