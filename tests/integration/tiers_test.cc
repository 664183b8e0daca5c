// Integration tests of the tierer through the real proximad: a namespace with a compression
// hierarchy holds more real KV blocks (SmolLM2-135M) than its host tier holds raw, and Get,
// GetStored and Decompress give back what the codec promises.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/bytes.h"
#include "common/status_macros.h"
#include "common/testing/free_port.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/device.h"
#include "kernels/error_metrics.h"
#include "kernels/kv_file.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_blocks.h"

namespace proxima {
namespace {

using ::proxima::client::BlockKey;
using ::proxima::client::Client;
using ::proxima::client::ClientOptions;
using ::proxima::client::Profile;
using ::proxima::client::PutOutcome;
using ::proxima::testing::CommandResult;
using ::proxima::testing::DaemonProcess;
using ::proxima::testing::LogValue;
using ::proxima::testing::MetricValue;
using ::proxima::testing::ProximactlPath;
using ::proxima::testing::ProximadPath;
using ::proxima::testing::RunCommand;
using ::proxima::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint32_t kTokens = 16;

class TiersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The environment's PROXIMA_TEST_KV_FILE first: the GPU machine runs this binary from another
    // checkout path than the one the build compiled in.
    const char* env = std::getenv("PROXIMA_TEST_KV_FILE");
    absl::StatusOr<codec::KvTensor> t =
        codec::ReadKvFile(env != nullptr && env[0] != '\0' ? env : PROXIMA_TEST_KV_FILE);
    ASSERT_OK(t.status());
    tensor_ = *std::move(t);
    geometry_ = tensor_.BlockShape(kTokens);
    model_.set_num_layers(geometry_.num_layers);
    model_.set_num_kv_heads(geometry_.num_kv_heads);
    model_.set_head_dim(geometry_.head_dim);
    model_.set_tokens_per_block(kTokens);
    model_.set_dtype(v1::DTYPE_BF16);
    model_.set_fingerprint("HuggingFaceTB/SmolLM2-135M");
  }

  // Block n of the test sequence: tokens [n, n + 16) of the real KV dump (blocks overlap, so
  // there are 241 distinct ones in the 256 tokens).
  std::vector<std::byte> Block(uint32_t n) const {
    std::vector<std::byte> raw(geometry_.RawBytes());
    EXPECT_OK(tensor_.ExtractBlock(n, kTokens, raw));
    return raw;
  }

  // Puts blocks Block(n * stride + offset) under keys[n], one call per block as a worker's steps
  // would, each of which must be stored; returns the blocks put.
  std::vector<std::vector<std::byte>> PutOneByOne(Client& c, const Profile& p,
                                                  std::span<const BlockKey> keys, uint32_t stride,
                                                  uint32_t offset) const {
    std::vector<std::vector<std::byte>> data;
    for (uint32_t n = 0; n < keys.size(); ++n) data.push_back(Block(n * stride + offset));
    for (uint32_t n = 0; n < keys.size(); ++n) {
      std::vector<std::span<const std::byte>> one = {data[n]};
      absl::StatusOr<std::vector<PutOutcome>> out = c.Put(p, keys.subspan(n, 1), one);
      EXPECT_TRUE(out.ok() && (*out)[0] == PutOutcome::kStored)
          << "block " << n << ": " << out.status();
    }
    return data;
  }

  // Every key read back three ways: Get (the daemon decodes), Decompress, and GetStored (the
  // encoding as stored, for the caller to decode).
  struct ReadBack {
    std::vector<std::vector<std::byte>> got, decompressed;
    std::vector<bool> found, found_decompressed;
    std::vector<std::optional<client::StoredBlock>> stored;
  };
  // The tierer works in the background: a block it re-encodes between two of the reads would
  // come back raw from one and decoded from another. So the reads wait until the host tier's
  // blocks per level have not changed for 200 ms (at most 30 s).
  static absl::StatusOr<ReadBack> ReadThreeWays(Client& c, const Profile& p,
                                                std::span<const BlockKey> keys) {
    std::string last;
    int same = 0;
    for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
         same < 4 && absl::Now() < deadline; absl::SleepFor(absl::Milliseconds(50))) {
      PROXIMA_ASSIGN_OR_RETURN(v1::StatsResponse stats, c.Stats());
      std::string levels;
      for (const v1::LevelStats& l : stats.tiers(0).levels()) {
        absl::StrAppend(&levels, l.level(), ":", l.blocks(), ";");
      }
      same = levels == last ? same + 1 : 0;
      last = levels;
    }
    ReadBack r;
    r.got.assign(keys.size(), std::vector<std::byte>(p.block_bytes));
    r.decompressed.assign(keys.size(), std::vector<std::byte>(p.block_bytes));
    std::vector<std::span<std::byte>> got(r.got.begin(), r.got.end());
    std::vector<std::span<std::byte>> dec(r.decompressed.begin(), r.decompressed.end());
    PROXIMA_ASSIGN_OR_RETURN(r.found, c.Get(p, keys, got));
    PROXIMA_ASSIGN_OR_RETURN(r.found_decompressed, c.Decompress(p, keys, dec));
    PROXIMA_ASSIGN_OR_RETURN(r.stored, c.GetStored(p, keys));
    return r;
  }

  // Puts Block(n * 11) under keys[n] one by one, the even ones with high priority; returns the
  // blocks put.
  std::vector<std::vector<std::byte>> PutEveryOtherHighPriority(Client& c, const Profile& p,
                                                                std::span<const BlockKey> keys) {
    std::vector<std::vector<std::byte>> data;
    for (uint32_t n = 0; n < keys.size(); ++n) {
      data.push_back(Block(n * 11));
      std::vector<std::span<const std::byte>> one = {data[n]};
      client::PutOptions options;
      options.high_priority = n % 2 == 0;
      absl::StatusOr<std::vector<PutOutcome>> out = c.Put(p, keys.subspan(n, 1), one, options);
      EXPECT_TRUE(out.ok() && (*out)[0] == PutOutcome::kStored)
          << "block " << n << ": " << out.status();
    }
    return data;
  }

  // Reads the keys back (ReadThreeWays) until every block is stored at level 1 when its index is
  // even, 2 when odd (the tierer works in the background); DEADLINE_EXCEEDED, with the levels
  // seen, after 60 s.
  static absl::StatusOr<ReadBack> WaitForLevelsOneAndTwo(Client& c, const Profile& p,
                                                         std::span<const BlockKey> keys) {
    for (const absl::Time deadline = absl::Now() + absl::Seconds(60);;) {
      PROXIMA_ASSIGN_OR_RETURN(ReadBack r, ReadThreeWays(c, p, keys));
      bool all = true;
      std::string levels;
      for (uint32_t n = 0; n < keys.size(); ++n) {
        const int level = r.stored[n] ? static_cast<int>(r.stored[n]->level) : -1;
        all = all && level == (n % 2 == 0 ? 1 : 2);
        absl::StrAppend(&levels, " ", level);
      }
      if (all) return r;
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "the tierer did not take every block to its level; levels (-1: not found):", levels));
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
  }

  // Starts proximad with `sets` (kept in daemon_) and returns a client of it (kept in client_);
  // null, with the test failed, when either cannot be had.
  Client* StartWithClient(std::vector<std::string> sets) {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(std::move(sets));
    EXPECT_OK(d.status());
    if (!d.ok()) return nullptr;
    daemon_ = *std::move(d);
    client_ = Connect(*daemon_);
    return client_.get();
  }

  std::unique_ptr<Client> Connect(const DaemonProcess& d) {
    ClientOptions o;
    o.target = d.tcp_target();
    o.call_timeout = absl::Seconds(20);
    auto c = Client::Connect(o);
    EXPECT_OK(c.status());
    return c.ok() ? *std::move(c) : nullptr;
  }

  codec::KvTensor tensor_;
  codec::BlockGeometry geometry_;
  v1::ModelProfile model_;
  std::unique_ptr<DaemonProcess> daemon_;  // StartWithClient's
  std::unique_ptr<Client> client_;
};

TEST_F(TiersTest, CompressedNamespaceHoldsMoreBlocksThanItsRawCapacity) {
  // 4 MiB holds 11 raw blocks of 368,640 bytes.
  Client* c = StartWithClient(
      {"tiers.host.capacity_bytes=4MiB",
       "namespaces=[{name: default, compression: {enabled: true, levels: [int8, "
       "'layers[0:2]=int8,default=int4,sink=int8'], trigger: {memory_pressure_threshold: 0.7}}}]"});
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(model_));
  ASSERT_EQ(p.block_bytes, geometry_.RawBytes());
  const uint64_t raw_capacity_blocks = (4ull << 20) / p.block_bytes;

  constexpr uint32_t kBlocks = 30;
  std::vector<BlockKey> keys = client::TestKeyChain(7, 0, kBlocks);
  std::vector<std::vector<std::byte>> data;
  std::vector<int64_t> positions;
  for (uint32_t n = 0; n < kBlocks; ++n) {
    data.push_back(Block(n * 7));  // mostly distinct tokens
    positions.push_back(n);
  }
  for (uint32_t n = 0; n < kBlocks; ++n) {  // one by one, as a worker's steps would
    std::vector<std::span<const std::byte>> one = {data[n]};
    client::PutOptions options;
    options.positions = std::span<const int64_t>(&positions[n], 1);
    ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> out,
                         c->Put(p, std::span<const BlockKey>(&keys[n], 1), one, options));
    ASSERT_EQ(out[0], PutOutcome::kStored) << n;
  }
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, c->Stats());
  const v1::TierStats& host = stats.tiers(0);
  EXPECT_LE(host.used_bytes(), host.capacity_bytes());
  // The deepest level is ~2.9x smaller than raw; extents of mixed sizes fragment the arena
  // (docs/decisions.md), so the tier holds about twice its raw count here, not 2.9x.
  EXPECT_GE(host.blocks(), raw_capacity_blocks * 3 / 2) << stats.DebugString();
  uint64_t encoded = 0;
  for (const v1::LevelStats& l : host.levels()) encoded += l.level() > 0 ? l.blocks() : 0;
  EXPECT_GT(encoded, 0u);

  // The background tierer may still be taking blocks down a level (slowly under an emulator or
  // a sanitizer); the three reads below must see the same encodings, so wait until the levels
  // have stayed the same for a second.
  auto levels_now = [&]() -> std::string {
    absl::StatusOr<v1::StatsResponse> s = c->Stats();
    if (!s.ok()) return s.status().ToString();
    std::string text;
    for (const v1::LevelStats& l : s->tiers(0).levels()) {
      absl::StrAppend(&text, l.level(), ":", l.blocks(), ":", l.bytes(), " ");
    }
    return text;
  };
  std::string settled = levels_now();
  for (absl::Time start = absl::Now(); absl::Now() - start < absl::Seconds(60);) {
    absl::SleepFor(absl::Seconds(1));
    std::string now = levels_now();
    if (now == settled) break;
    settled = now;
  }

  // What the tier holds once settled (the first Stats above may predate the tierer's last
  // evictions).
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse settled_stats, c->Stats());

  // Three ways back: daemon-decoded raw, Decompress, and the stored encoding decoded here.
  ASSERT_OK_AND_ASSIGN(ReadBack back, ReadThreeWays(*c, p, keys));
  auto& [got, dec, found, found2, stored] = back;
  int hits = 0, levels_seen = 0;
  for (uint32_t n = 0; n < kBlocks; ++n) {
    if (!found[n]) continue;  // evicted (the oldest go first)
    ++hits;
    ASSERT_TRUE(found2[n]);
    ASSERT_TRUE(stored[n].has_value());
    EXPECT_EQ(got[n], dec[n]) << n;
    std::vector<std::byte> local(p.block_bytes);
    if (stored[n]->level == 0) {
      EXPECT_EQ(stored[n]->bytes.size(), p.block_bytes);
      std::memcpy(local.data(), stored[n]->bytes.data(), p.block_bytes);
      EXPECT_EQ(got[n], data[n]) << "a raw block comes back byte-exact";
    } else {
      ++levels_seen;
      EXPECT_LT(stored[n]->bytes.size(), p.block_bytes * 6 / 10) << n;  // int8 is ~1.85x
      ASSERT_OK(codec::DecodeBlock(
          std::as_bytes(std::span(stored[n]->bytes.data(), stored[n]->bytes.size())), local));
    }
    EXPECT_EQ(local, got[n]) << "the client's decode equals the daemon's, block " << n;
    ASSERT_OK_AND_ASSIGN(codec::ErrorSums sums,
                         codec::MeasureBlockError(geometry_, data[n], got[n]));
    EXPECT_LT(codec::Finish(sums).attn_rel_l2, 0.15) << "block " << n;
  }
  EXPECT_EQ(hits, static_cast<int>(settled_stats.tiers(0).blocks()))
      << settled_stats.DebugString();
  EXPECT_GT(levels_seen, 0);

  ASSERT_OK_AND_ASSIGN(std::string metrics, daemon_->ScrapeMetrics());
  EXPECT_THAT(metrics, HasSubstr("proxima_tier_level_blocks{tier=\"host\",level=\"2\"}"));
  EXPECT_THAT(metrics, HasSubstr("proxima_tierer_encodes_total{level=\"1\"}"));
  EXPECT_THAT(metrics, HasSubstr("proxima_quality_attention_error{namespace=\"default\""));
  EXPECT_THAT(metrics, HasSubstr("proxima_get_decodes_total"));
}

// A config change is a reason to restart: across a SIGTERM restart with its snapshot, a block
// keeps its encoding only where the new hierarchy still has its level's codec plan (at that
// plan's level now), and comes back decoded, raw, where it has none; the start's metrics count
// both. Blocks put with high priority stop at level 1 (int8) and the others go to level 2 (int4)
// under a pressure threshold that compresses everything; the next start's hierarchy is int4 then
// int2, in a tier with room to spare, so its tierer leaves the loaded blocks as they are.
TEST_F(TiersTest, ARestartWithAnotherHierarchyKeepsOnlyTheEncodingsItStillHas) {
  char dir[] = "/tmp/proxima-it-hierarchy-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string file = std::string(dir) + "/snapshot";
  Client* c = StartWithClient(
      {"tiers.host.capacity_bytes=8MiB", "tiers.host.snapshot_file=" + file,
       "namespaces=[{name: default, compression: {enabled: true, levels: [int8, int4], trigger: "
       "{memory_pressure_threshold: 0.05}, quality: {max_attention_error: 0.9}}}]"});
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(model_));
  constexpr uint32_t kBlocks = 12;  // 4.4 MB raw: no eviction in 8 MiB
  std::vector<BlockKey> keys = client::TestKeyChain(13, 0, kBlocks);
  PutEveryOtherHighPriority(*c, p, keys);
  // Every block at the deepest level it may reach.
  ASSERT_OK_AND_ASSIGN(const ReadBack before, WaitForLevelsOneAndTwo(*c, p, keys));

  daemon_->Signal(SIGTERM);
  ASSERT_EQ(daemon_->WaitExit(absl::Seconds(30)), 0);
  ASSERT_OK(daemon_->Restart(
      {"tiers.host.capacity_bytes=64MiB",
       "namespaces=[{name: default, compression: {enabled: true, levels: [int4, int2], quality: "
       "{max_attention_error: 0.9}}}]"}));
  constexpr char kLoaded[] = "loaded the blocks of the snapshot the last run wrote";
  EXPECT_EQ(LogValue(daemon_->Log(), kLoaded, "blocks"), absl::StrCat(kBlocks));
  EXPECT_EQ(LogValue(daemon_->Log(), kLoaded, "decoded_blocks"), absl::StrCat(kBlocks / 2));
  client_ = Connect(*daemon_);
  ASSERT_NE(client_, nullptr);
  ASSERT_OK(client_->RegisterProfile(model_).status());
  ASSERT_OK_AND_ASSIGN(ReadBack after, ReadThreeWays(*client_, p, keys));
  for (uint32_t n = 0; n < kBlocks; ++n) {
    ASSERT_TRUE(after.found[n]) << n;
    ASSERT_TRUE(after.stored[n].has_value()) << n;
    const std::string& old_bytes = before.stored[n]->bytes;
    if (n % 2 == 1) {  // int4: level 1 of the new hierarchy, the same container
      EXPECT_EQ(after.stored[n]->level, 1u) << n;
      EXPECT_EQ(after.stored[n]->bytes, old_bytes) << n;
    } else {  // int8: no level of the new hierarchy, so raw: the int8 encoding decoded
      EXPECT_EQ(after.stored[n]->level, 0u) << n;
      std::vector<std::byte> decoded(p.block_bytes);
      ASSERT_OK(codec::DecodeBlock(std::as_bytes(std::span(old_bytes.data(), old_bytes.size())),
                                   decoded));
      EXPECT_EQ(after.got[n], decoded) << n;
    }
    EXPECT_EQ(after.got[n], before.got[n]) << "the same values as before the restart, " << n;
  }
  ASSERT_OK_AND_ASSIGN(std::string metrics, daemon_->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_load_state{state=\"loaded\"}"), 1);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_load_state{state=\"none\"}"), 0);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_loaded_blocks"), kBlocks);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_decoded_blocks"), kBlocks / 2);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_skipped_records"), 0);
  EXPECT_EQ(MetricValue(metrics, "proxima_tier_level_blocks{tier=\"host\",level=\"1\"}"),
            kBlocks / 2);

  // A SIGKILL writes nothing: the next start finds no file, and says so.
  ASSERT_OK(daemon_->Restart());
  ASSERT_OK_AND_ASSIGN(metrics, daemon_->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_load_state{state=\"none\"}"), 1);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_load_state{state=\"loaded\"}"), 0);
  EXPECT_EQ(MetricValue(metrics, "proxima_snapshot_loaded_blocks"), 0);
  daemon_.reset();
  unlink((file + ".lock").c_str());
  rmdir(dir);
}

// The same change, rolled out node by node: a node still on the old hierarchy (int8, int4) hands
// its blocks off at SIGTERM to a peer already on the new one (int4, int2). Levels are numbered
// per config, so a block travels with its level's codec plan and its put's hints: the peer keeps
// an int4 block at its own level 1 (the same container) and decodes an int8 one (no level there)
// to raw, and its tierer takes each as deep as the worker allowed under its config: the
// high-priority blocks to level 1 (int4), the others to level 2 (int2). Before, the blocks came
// with their level numbers and no hints: the int8 blocks sat at level 1 as int8 and the int4
// ones at level 2 as int4, and the peer's tierer never encoded them further.
TEST_F(TiersTest, AHandOffToANodeWithAnotherHierarchyKeepsEachEncodingWhereItBelongs) {
  char dir[] = "/tmp/proxima-it-handoff-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string token_file = std::string(dir) + "/peer-token";
  {
    FILE* f = fopen(token_file.c_str(), "w");
    ASSERT_NE(f, nullptr);
    fputs("tiers-test-peer-token-0123456789abcdef\n", f);
    fclose(f);
  }
  const std::vector<int> ports = testing::FreeLoopbackPorts(2);
  auto node = [&](size_t i, const char* levels) {
    std::vector<std::string> sets =
        testing::ClusterSets(ports, i, token_file, absl::Milliseconds(1000));
    sets.insert(
        sets.end(),
        {"tiers.host.capacity_bytes=8MiB",
         "cluster.spill={threshold: 0.9, accept_below: 0.75, handoff: 10s}",
         absl::StrCat("namespaces=[{name: default, compression: {enabled: true, levels: ", levels,
                      ", trigger: {memory_pressure_threshold: 0.05}, quality: "
                      "{max_attention_error: 0.9}}}]")});
    return sets;
  };
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DaemonProcess> old_node,
                       DaemonProcess::Start(node(0, "[int8, int4]")));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DaemonProcess> new_node,
                       DaemonProcess::Start(node(1, "[int4, int2]")));
  std::unique_ptr<Client> a = Connect(*old_node), b = Connect(*new_node);
  ASSERT_TRUE(a && b);
  ASSERT_OK_AND_ASSIGN(Profile p, a->RegisterProfile(model_));
  ASSERT_OK(b->RegisterProfile(model_).status());
  for (const absl::Time until = absl::Now() + absl::Seconds(15);;) {
    ASSERT_OK_AND_ASSIGN(std::string metrics, old_node->ScrapeMetrics());
    if (MetricValue(metrics, "proxima_cluster_live_nodes") == 2) break;
    ASSERT_LT(absl::Now(), until) << "the nodes did not see each other";
    absl::SleepFor(absl::Milliseconds(20));
  }

  constexpr uint32_t kBlocks = 12;
  std::vector<BlockKey> keys = client::TestKeyChain(17, 0, kBlocks);
  const std::vector<std::vector<std::byte>> data = PutEveryOtherHighPriority(*a, p, keys);
  // Every block at its deepest level on the old node: int8 (high priority), int4 (the others).
  ASSERT_OK_AND_ASSIGN(const ReadBack before, WaitForLevelsOneAndTwo(*a, p, keys));
  a.reset();
  old_node->Signal(SIGTERM);
  ASSERT_EQ(old_node->WaitExit(absl::Seconds(30)), 0) << old_node->Log();
  EXPECT_EQ(LogValue(old_node->Log(), "handed blocks off to peers before exit", "blocks"),
            absl::StrCat(kBlocks))
      << old_node->Log();

  // What the new node's tierer makes of each block: the old encoding, decoded, encoded at the
  // level it may reach here (quantizing encoders are deterministic).
  auto expected = [&](uint32_t n) -> absl::StatusOr<std::string> {
    // int4, at level 1 here: on to int2. int8, no level here: decoded, then int4 (a
    // high-priority put stops at level 1).
    PROXIMA_ASSIGN_OR_RETURN(codec::CodecPlan plan, codec::ParseCodecPlan(n % 2 ? "int2" : "int4"));
    std::vector<std::byte> decoded(p.block_bytes);
    PROXIMA_RETURN_IF_ERROR(codec::DecodeBlock(AsBytes(before.stored[n]->bytes), decoded));
    std::string out;
    PROXIMA_RETURN_IF_ERROR(codec::EncodeBlock(geometry_, plan, false, decoded, {}, &out));
    return out;
  };
  absl::StatusOr<ReadBack> after = WaitForLevelsOneAndTwo(*b, p, keys);
  ASSERT_OK(after.status()) << new_node->Log();
  ASSERT_OK_AND_ASSIGN(std::string metrics, new_node->ScrapeMetrics());
  EXPECT_EQ(MetricValue(metrics, "proxima_cluster_spill_decoded_blocks_total"), kBlocks / 2);
  for (uint32_t n = 0; n < kBlocks; ++n) {
    ASSERT_OK_AND_ASSIGN(std::string want, expected(n));
    EXPECT_EQ(after->stored[n]->bytes, want) << "block " << n;
    ASSERT_OK_AND_ASSIGN(codec::ErrorSums sums,
                         codec::MeasureBlockError(geometry_, data[n], after->got[n]));
    EXPECT_LT(codec::Finish(sums).attn_rel_l2, 0.5) << "block " << n;
  }
  b.reset();
  new_node.reset();
  old_node.reset();
  unlink(token_file.c_str());
  rmdir(dir);
}

TEST_F(TiersTest, ProximactlGetsInEveryFormat) {
  auto d = DaemonProcess::Start({"namespaces=[{name: default, compression: {enabled: true}}]"});
  ASSERT_OK(d.status());
  const std::string target = "--target=" + (*d)->tcp_target();
  CommandResult put = RunCommand({ProximactlPath(), "put", target, "--count=4", "--json"});
  ASSERT_EQ(put.exit_code, 0) << put.err;
  for (const char* format : {"raw", "stored", "decompress"}) {
    CommandResult get = RunCommand({ProximactlPath(), "get", target, "--count=4", "--json",
                                    std::string("--format=") + format});
    EXPECT_EQ(get.exit_code, 0) << format << ": " << get.out << get.err;
    EXPECT_THAT(get.out, HasSubstr("\"hits\":4")) << format;
    EXPECT_THAT(get.out, HasSubstr(std::string("\"format\":\"") + format + "\"")) << format;
  }
  CommandResult bad = RunCommand({ProximactlPath(), "get", target, "--format=zip"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err + bad.out, HasSubstr("raw, stored or decompress"));
}

// The GPU tier through the real proximad: with a pool configured it serves from the GPU where one
// is visible (the pool fills and its coldest blocks move down to the host tier), and with the host
// tier alone, saying why, where none is; every block comes back byte-exact either way. On the GPU
// machine this runs with the pool (scripts/gpu-check.sh).
TEST_F(TiersTest, AConfiguredGpuTierServesFromTheGpuOrSaysWhyNot) {
  std::string why;
  const bool gpu = !gpu::VisibleDevices(&why).empty();
  // 4 MiB holds 11 blocks of 368,640 bytes.
  ASSERT_OK_AND_ASSIGN(auto d, DaemonProcess::Start({"tiers.gpu.capacity_bytes_per_device=4MiB"}));
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(model_));
  constexpr uint32_t kBlocks = 40;
  std::vector<BlockKey> keys = client::TestKeyChain(11, 0, kBlocks);
  std::vector<std::vector<std::byte>> data;
  for (uint32_t n = 0; n < kBlocks; ++n) data.push_back(Block(n * 5));
  for (uint32_t first = 0; first < kBlocks; first += 8) {
    std::vector<std::span<const std::byte>> spans(data.begin() + first, data.begin() + first + 8);
    ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> out,
                         c->Put(p, std::span<const BlockKey>(keys).subspan(first, 8), spans));
    EXPECT_THAT(out, ::testing::Each(PutOutcome::kStored));
  }
  std::vector<std::vector<std::byte>> got(kBlocks, std::vector<std::byte>(p.block_bytes));
  std::vector<std::span<std::byte>> got_spans(got.begin(), got.end());
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c->Get(p, keys, got_spans));
  for (uint32_t n = 0; n < kBlocks; ++n) {
    ASSERT_TRUE(found[n]) << n;
    EXPECT_TRUE(got[n] == data[n]) << "block " << n << " came back with other bytes";
  }
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, c->Stats());
  ASSERT_OK_AND_ASSIGN(std::string metrics, d->ScrapeMetrics());
  if (gpu) {
    ASSERT_GE(stats.tiers_size(), 2) << stats.DebugString();
    EXPECT_EQ(stats.tiers(1).name(), "gpu:0");
    EXPECT_GT(stats.tiers(1).blocks(), 0u);
    EXPECT_LE(stats.tiers(1).used_bytes(), stats.tiers(1).capacity_bytes());
    EXPECT_GT(MetricValue(metrics, "proxima_tierer_gpu_moves_total{encoding=\"raw\"}"), 0);
  } else {
    EXPECT_EQ(stats.tiers_size(), 1) << stats.DebugString();
    EXPECT_EQ(stats.tiers(0).blocks(), kBlocks);
    EXPECT_THAT(d->Log(), HasSubstr("GPU tier configured but no GPU is visible"));
    EXPECT_THAT(d->Log(), HasSubstr(why));
    EXPECT_THAT(metrics, ::testing::Not(HasSubstr("tier=\"gpu:0\"")));
  }
}

TEST_F(TiersTest, AnUnknownCodecInALevelStopsTheDaemonAtStart) {
  CommandResult r = RunCommand(
      {ProximadPath(), "--check_config",
       "--set=namespaces=[{name: a, compression: {enabled: true, levels: [int8, int3]}}]"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("namespaces[0].compression.levels[1]"));
  EXPECT_THAT(r.err, HasSubstr("int3"));
  EXPECT_THAT(r.err, HasSubstr("int4"));
  // A k4v3 level with a RoPE base that is no RoPE base: the key, the value, what is expected.
  r = RunCommand({ProximadPath(), "--check_config",
                  "--set=namespaces=[{name: a, compression: {enabled: true, levels: [int8, "
                  "'k4v3,rope_theta=0']}}]"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("namespaces[0].compression.levels[1]"));
  EXPECT_THAT(r.err, HasSubstr("rope_theta=0"));
  EXPECT_THAT(r.err, HasSubstr("from 1 to 1e12"));
  // Valid but self-defeating: a k4v3 level under the default quality budget starts, with a
  // warning that the guard will step it back.
  r = RunCommand({ProximadPath(), "--check_config",
                  "--set=namespaces=[{name: a, compression: {enabled: true, levels: [k4v3]}}]"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("warning: namespaces[0].compression.levels[0] is k4v3"));
}

// The default namespace with one k4v3 level (SmolLM2's RoPE base) and a quality budget it keeps.
constexpr char kK4v3Namespace[] =
    "namespaces=[{name: default, compression: {enabled: true, levels: "
    "['k4v3,rope_theta=100000'], quality: {max_attention_error: 0.3}}}]";

// k4v3 through the real daemon: the tierer encodes it on the CPU (no CUDA kernel), each stored
// block is smaller than int4's encoding of it, and the blocks come back through Get,
// Decompress and the stored encoding alike, within k4v3's error.
TEST_F(TiersTest, AK4v3LevelStoresLessThanInt4AndComesBackWithinItsError) {
  // 4 MiB holds 11 raw blocks of 368,640 bytes.
  Client* c = StartWithClient({"tiers.host.capacity_bytes=4MiB", kK4v3Namespace});
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(model_));
  constexpr uint32_t kBlocks = 40;
  std::vector<BlockKey> keys = client::TestKeyChain(9, 0, kBlocks);
  const std::vector<std::vector<std::byte>> data = PutOneByOne(*c, p, keys, 5, 1);
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, c->Stats());
  EXPECT_LE(stats.tiers(0).used_bytes(), stats.tiers(0).capacity_bytes());
  EXPECT_GE(stats.tiers(0).blocks(), 2 * ((4ull << 20) / p.block_bytes)) << stats.DebugString();

  ASSERT_OK_AND_ASSIGN(codec::CodecPlan int4_plan, codec::ParseCodecPlan("int4"));
  ASSERT_OK_AND_ASSIGN(codec::CodecPlan k4v3_plan, codec::ParseCodecPlan("k4v3"));
  const std::optional<size_t> int4_bytes = codec::EncodedBytes(geometry_, int4_plan, false);
  const std::optional<size_t> k4v3_bytes = codec::EncodedBytes(geometry_, k4v3_plan, false);
  ASSERT_TRUE(int4_bytes.has_value() && k4v3_bytes.has_value());
  EXPECT_LT(*k4v3_bytes, *int4_bytes * 9 / 10);

  ASSERT_OK_AND_ASSIGN(ReadBack back, ReadThreeWays(*c, p, keys));
  auto& [got, dec, found, found2, stored] = back;
  int k4v3_blocks = 0;
  for (uint32_t n = 0; n < kBlocks; ++n) {
    if (!found[n] || !found2[n] || !stored[n].has_value()) continue;  // evicted meanwhile
    EXPECT_EQ(dec[n], got[n]) << n;
    const auto& bytes = stored[n]->bytes;
    if (stored[n]->level == 0) continue;  // still raw
    ++k4v3_blocks;
    EXPECT_EQ(bytes.size(), *k4v3_bytes) << n;
    std::vector<std::byte> local(p.block_bytes);
    ASSERT_OK(codec::DecodeBlock(std::as_bytes(std::span(bytes.data(), bytes.size())), local));
    EXPECT_EQ(local, got[n]) << "the client's decode equals the daemon's, block " << n;
    ASSERT_OK_AND_ASSIGN(codec::ErrorSums sums,
                         codec::MeasureBlockError(geometry_, data[n], got[n]));
    EXPECT_LT(codec::Finish(sums).attn_rel_l2, 0.4) << "block " << n;
  }
  EXPECT_GT(k4v3_blocks, 0);
}

// A model whose head dim is not a power of two (the same real bytes registered as 2 heads of 96
// instead of 3 of 64) in a namespace with a k4v3 level: the daemon stores k4v3 (V's transform on
// 96's chunks, 64 and 32), the client decodes what it reads as the daemon does, and the blocks
// come back within k4v3's error. No RoPE base: these channels' RoPE pairs are not 96's. (Before
// stop 49 the daemon stored int4 in k4v3's place; before stop 46 it evicted each such block.)
TEST_F(TiersTest, AK4v3LevelStoresK4v3ForAHeadDimThatIsNotAPowerOfTwo) {
  Client* c = StartWithClient(
      {"tiers.host.capacity_bytes=4MiB",
       "namespaces=[{name: default, compression: {enabled: true, levels: [k4v3], quality: "
       "{max_attention_error: 0.3}}}]"});
  ASSERT_NE(c, nullptr);
  v1::ModelProfile wide = model_;
  wide.set_num_kv_heads(2);
  wide.set_head_dim(96);
  wide.clear_rope_theta();
  codec::BlockGeometry g = geometry_;
  g.num_kv_heads = 2;
  g.head_dim = 96;
  ASSERT_EQ(g.RawBytes(), geometry_.RawBytes());
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(wide));
  constexpr uint32_t kBlocks = 30;
  std::vector<BlockKey> keys = client::TestKeyChain(11, 0, kBlocks);
  const std::vector<std::vector<std::byte>> data = PutOneByOne(*c, p, keys, 5, 2);
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, c->Stats());
  // 4 MiB holds 11 raw blocks; at k4v3 (about a quarter of one) all 30 stay.
  EXPECT_EQ(stats.tiers(0).blocks(), kBlocks) << stats.DebugString();

  ASSERT_OK_AND_ASSIGN(ReadBack back, ReadThreeWays(*c, p, keys));
  auto& [got, dec, found, found2, stored] = back;
  int k4v3_blocks = 0;
  for (uint32_t n = 0; n < kBlocks; ++n) {
    if (!found[n] || !found2[n] || !stored[n].has_value()) continue;  // evicted meanwhile
    EXPECT_EQ(dec[n], got[n]) << n;
    if (stored[n]->level == 0) continue;  // still raw
    ++k4v3_blocks;
    const auto& bytes = stored[n]->bytes;
    const auto encoded = std::as_bytes(std::span(bytes.data(), bytes.size()));
    ASSERT_OK_AND_ASSIGN(codec::BlockHeaderInfo info, codec::InspectBlock(encoded));
    EXPECT_EQ(info.geometry, g);
    for (const codec::SegmentInfo& seg : info.segments) {
      EXPECT_EQ(seg.codec, codec::CodecId::kK4v3) << n;
    }
    std::vector<std::byte> local(p.block_bytes);
    ASSERT_OK(codec::DecodeBlock(encoded, local));
    EXPECT_EQ(local, got[n]) << "the client's decode equals the daemon's, block " << n;
    ASSERT_OK_AND_ASSIGN(codec::ErrorSums sums, codec::MeasureBlockError(g, data[n], got[n]));
    EXPECT_LT(codec::Finish(sums).attn_rel_l2, 0.3) << "block " << n;
  }
  EXPECT_GT(k4v3_blocks, 0);
}

// A k4v3 level that names no RoPE base takes the profile's (ModelProfile.rope_theta, as the vLLM
// connector fills it from the model's config): the stored K segments carry that base's
// frequencies (omega0 1, ratio theta^(-2/head_dim)), and a profile without one stores K un-turned
// (omega0 0). Both come back within k4v3's error; the two are distinct profiles.
TEST_F(TiersTest, AK4v3LevelWithoutARopeBaseTakesTheProfilesOne) {
  Client* c = StartWithClient(
      {"tiers.host.capacity_bytes=4MiB",
       "namespaces=[{name: default, compression: {enabled: true, levels: [k4v3], quality: "
       "{max_attention_error: 0.3}}}]"});
  ASSERT_NE(c, nullptr);
  v1::ModelProfile with_base = model_;
  with_base.set_rope_theta(100000);  // SmolLM2's
  ASSERT_OK_AND_ASSIGN(Profile turned, c->RegisterProfile(with_base));
  ASSERT_OK_AND_ASSIGN(Profile plain, c->RegisterProfile(model_));
  EXPECT_NE(turned.id, plain.id);
  constexpr uint32_t kBlocks = 24;
  for (const Profile* p : {&turned, &plain}) {
    const bool has_base = p == &turned;
    SCOPED_TRACE(has_base ? "profile with rope_theta 100000" : "profile without rope_theta");
    std::vector<BlockKey> keys = client::TestKeyChain(has_base ? 21 : 22, 0, kBlocks);
    const std::vector<std::vector<std::byte>> data = PutOneByOne(*c, *p, keys, 3, 2);
    ASSERT_OK_AND_ASSIGN(ReadBack back, ReadThreeWays(*c, *p, keys));
    auto& [got, dec, found, found2, stored] = back;
    int encoded = 0;
    for (uint32_t n = 0; n < kBlocks; ++n) {
      if (!found[n] || !stored[n].has_value() || stored[n]->level == 0) continue;
      ++encoded;
      const auto& bytes = stored[n]->bytes;
      ASSERT_OK_AND_ASSIGN(
          codec::BlockHeaderInfo info,
          codec::InspectBlock(std::as_bytes(std::span(bytes.data(), bytes.size()))));
      ASSERT_EQ(info.segments[0].codec, codec::CodecId::kK4v3);
      float omega0, ratio;  // the K segment's payload header
      std::memcpy(&omega0, bytes.data() + info.segments[0].offset, 4);
      std::memcpy(&ratio, bytes.data() + info.segments[0].offset + 4, 4);
      if (has_base) {
        EXPECT_EQ(omega0, 1.0f) << n;
        EXPECT_EQ(ratio, static_cast<float>(std::pow(100000.0, -2.0 / geometry_.head_dim))) << n;
      } else {
        EXPECT_EQ(omega0, 0.0f) << n;
      }
      ASSERT_OK_AND_ASSIGN(codec::ErrorSums sums,
                           codec::MeasureBlockError(geometry_, data[n], got[n]));
      EXPECT_LT(codec::Finish(sums).attn_rel_l2, 0.4) << "block " << n;
    }
    EXPECT_GT(encoded, 0);
  }
  // A profile whose RoPE base is no RoPE base is refused, naming the field and the range.
  v1::ModelProfile bad = model_;
  bad.set_rope_theta(0.5);
  EXPECT_THAT(c->RegisterProfile(bad).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("profile.rope_theta is 0.5")));
}

// The quality guard judges each model of a namespace on its own: SmolLM2's int2 error (about 0.5)
// is over the default budget (0.12), so its deepest level steps back to int8, while a second
// model in the same namespace, whose blocks int2 holds exactly, keeps int2.
TEST_F(TiersTest, TheQualityGuardStepsBackOnlyTheModelOverItsBudget) {
  Client* c = StartWithClient(
      {"tiers.host.capacity_bytes=4MiB",
       "namespaces=[{name: default, compression: {enabled: true, levels: [int8, int2], "
       "trigger: {memory_pressure_threshold: 0.3}, quality: {sample_one_in: 1}}}]"});
  ASSERT_NE(c, nullptr);
  v1::ModelProfile flat_model = model_;
  flat_model.set_fingerprint("test/every-element-16");
  ASSERT_OK_AND_ASSIGN(Profile smol, c->RegisterProfile(model_));
  ASSERT_OK_AND_ASSIGN(Profile flat, c->RegisterProfile(flat_model));
  std::vector<std::byte> flat_block(flat.block_bytes);
  for (size_t i = 0; i + 1 < flat_block.size(); i += 2) {  // bf16 16.0 = 0x4180, little-endian
    flat_block[i] = std::byte{0x80};
    flat_block[i + 1] = std::byte{0x41};
  }
  constexpr uint32_t kBlocks = 16;
  const std::vector<BlockKey> smol_keys = client::TestKeyChain(31, 0, kBlocks);
  const std::vector<BlockKey> flat_keys = client::TestKeyChain(32, 0, kBlocks);
  std::vector<std::vector<std::byte>> smol_data;
  for (uint32_t n = 0; n < kBlocks; ++n) smol_data.push_back(Block(n * 13));
  for (uint32_t n = 0; n < kBlocks; ++n) {  // interleaved, one block per call
    for (const Profile* p : {&smol, &flat}) {
      const std::vector<std::byte>& bytes = p == &smol ? smol_data[n] : flat_block;
      std::vector<std::span<const std::byte>> one = {bytes};
      const std::vector<BlockKey>& keys = p == &smol ? smol_keys : flat_keys;
      ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> out,
                           c->Put(*p, std::span<const BlockKey>(&keys[n], 1), one));
      ASSERT_EQ(out[0], PutOutcome::kStored) << n;
    }
  }
  ASSERT_OK_AND_ASSIGN(ReadBack smol_back, ReadThreeWays(*c, smol, smol_keys));
  ASSERT_OK_AND_ASSIGN(ReadBack flat_back, ReadThreeWays(*c, flat, flat_keys));
  ASSERT_OK_AND_ASSIGN(std::string metrics, daemon_->ScrapeMetrics());
  auto cap_of = [&](const Profile& p, const std::string& model) {
    return MetricValue(metrics, absl::StrFormat("proxima_compression_model_level_cap{namespace="
                                                "\"default\",profile=\"0x%016x\",model=\"%s\"}",
                                                p.id, model));
  };
  EXPECT_EQ(cap_of(smol, model_.fingerprint()), 1) << metrics;
  EXPECT_EQ(cap_of(flat, flat_model.fingerprint()), 2) << metrics;
  EXPECT_EQ(MetricValue(metrics, "proxima_compression_level_cap{namespace=\"default\"}"), 1);
  EXPECT_EQ(MetricValue(metrics, "proxima_quality_step_backs_total{namespace=\"default\"}"), 1);
  // What is stored agrees: every flat block still held is at int2 and comes back exact; SmolLM2
  // blocks at int2 are only those encoded before its third int2 sample tipped the guard.
  int flat_held = 0, smol_at_int2 = 0, smol_at_int8 = 0;
  for (uint32_t n = 0; n < kBlocks; ++n) {
    if (flat_back.found[n]) {
      ++flat_held;
      ASSERT_TRUE(flat_back.stored[n].has_value());
      EXPECT_EQ(flat_back.stored[n]->level, 2) << n;
      EXPECT_EQ(flat_back.got[n], flat_block) << n;
    }
    if (smol_back.found[n] && smol_back.stored[n].has_value()) {
      smol_at_int2 += smol_back.stored[n]->level == 2;
      smol_at_int8 += smol_back.stored[n]->level == 1;
      ASSERT_OK_AND_ASSIGN(codec::ErrorSums sums,
                           codec::MeasureBlockError(geometry_, smol_data[n], smol_back.got[n]));
      if (smol_back.stored[n]->level == 1) EXPECT_LT(codec::Finish(sums).attn_rel_l2, 0.05) << n;
    }
  }
  EXPECT_GT(flat_held, 0);
  // Three samples tip the guard (a block or two more may be in an encoder as they do).
  EXPECT_GT(smol_at_int8, smol_at_int2);
}

}  // namespace
}  // namespace proxima
