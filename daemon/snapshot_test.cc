#include "daemon/snapshot.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/bytes.h"
#include "common/crc32c.h"
#include "common/testing/status_matchers.h"
#include "common/testing/tiny_profile.h"
#include "common/testing/tmpfs.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "proxima/v1/snapshot.pb.h"

namespace proxima::daemon {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kAlice[] = "alice-snapshot-token-0123456789";
constexpr char kBob[] = "bob-snapshot-token-0123456789";

// A raw profile of 512 KiB blocks (8 layers x 8 heads x 128 dim x 16 tokens x bf16 x K, V).
v1::ModelProfile LargeProfile() {
  v1::ModelProfile p;
  p.set_num_layers(8);
  p.set_num_kv_heads(8);
  p.set_head_dim(128);
  p.set_tokens_per_block(16);
  p.set_dtype(v1::DTYPE_BF16);
  p.set_fingerprint("snapshot-large");
  return p;
}

BlockKey Key(int n) {
  BlockKey k{};
  k[0] = static_cast<uint8_t>(n);
  k[31] = 0x5a;
  return k;
}

// Bytes of block `n` of `size`: a pattern no other n repeats.
std::string Pattern(int n, size_t size) {
  std::string s(size, '\0');
  uint32_t x = 0x9e3779b9u * static_cast<uint32_t>(n + 1);
  for (char& c : s) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  return s;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

bool Exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

class SnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/proxima-snapshot-test-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/snapshot";
    setenv("PXT_SNAP_ALICE", kAlice, 1);
    setenv("PXT_SNAP_BOB", kBob, 1);
  }
  void TearDown() override {
    ::unlink(path_.c_str());
    ::unlink((path_ + ".tmp").c_str());
    ::unlink((path_ + ".lock").c_str());
    ::rmdir(dir_.c_str());
  }

  // Namespaces "a" (open; compressed down the hierarchy `a_levels`, plan texts, when given) and
  // "p" (private prefixes: scopes alice and bob, partitions 1 and 2, or 2 and 1 with
  // `bob_first`).
  std::unique_ptr<TierService> Service(uint64_t capacity, bool bob_first = false,
                                       const std::vector<std::string>& a_levels = {},
                                       uint64_t a_max_bytes = 0, uint32_t index_shards = 64) {
    DaemonConfig config;
    config.host_tier.capacity_bytes = capacity;
    config.index_shards = index_shards;
    TokenConfig alice{"alice", "", "PXT_SNAP_ALICE", TokenAccess::kReadWrite, ""};
    TokenConfig bob{"bob", "", "PXT_SNAP_BOB", TokenAccess::kReadWrite, ""};
    config.namespaces = {{"a"},
                         {"p", bob_first ? std::vector{bob, alice} : std::vector{alice, bob},
                          /*private_prefixes=*/true}};
    config.namespaces[0].max_bytes = a_max_bytes;
    CompressionConfig& c = config.namespaces[0].compression;
    c.enabled = !a_levels.empty();
    c.levels = a_levels;
    for (const std::string& text : a_levels) {
      absl::StatusOr<codec::CodecPlan> plan = codec::ParseCodecPlan(text);
      EXPECT_OK(plan.status());
      if (plan.ok()) c.plans.push_back(*plan);
    }
    registries_.push_back(std::make_unique<metrics::Registry>());
    absl::StatusOr<std::unique_ptr<TierService>> s =
        TierService::Create(config, registries_.back().get());
    EXPECT_OK(s.status());
    return s.ok() ? *std::move(s) : nullptr;
  }

  // Stores `bytes` under `id` at `level` with `attributes`.
  static void Store(TierService& core, const BlockId& id, const std::string& bytes,
                    uint8_t level = 0, BlockAttributes attributes = {}) {
    std::optional<BlockStore::PendingBlock> p = core.store().Reserve(bytes.size());
    ASSERT_TRUE(p.has_value());
    std::memcpy(p->bytes().data(), bytes.data(), bytes.size());
    ASSERT_EQ(core.store().Commit(id, *std::move(p), Crc32c(AsBytes(bytes)), attributes, level),
              PutOutcome::kStored);
  }

  // The stored bytes and level of `id`, or nullopt.
  static std::optional<std::pair<std::string, uint8_t>> Stored(TierService& core,
                                                               const BlockId& id) {
    std::optional<BlockStore::ReadBlock> r = core.store().Read(id);
    if (!r) return std::nullopt;
    return std::make_pair(
        std::string(reinterpret_cast<const char*>(r->bytes.data()), r->bytes.size()), r->level);
  }

  // A raw block of the tiny profile: small bf16 values (a random pattern's bytes would hold NaNs
  // and infinities), varied by `seed`.
  static std::string TinyRaw(int seed) {
    std::string raw(proxima::testing::kTinyBlockBytes, '\0');
    for (size_t i = 0; i < raw.size(); i += 2) {
      raw[i] = static_cast<char>(i * 7 + seed);
      raw[i + 1] = static_cast<char>(0x3f);
    }
    return raw;
  }
  // `raw` (a block of the tiny profile) encoded with `plan_text`, and an encoded block decoded.
  static std::string TinyEncoded(const std::string& raw, const char* plan_text, bool first) {
    codec::BlockGeometry g;
    g.num_layers = 2;
    g.num_kv_heads = 2;
    g.head_dim = 8;
    g.tokens_per_block = 4;
    g.dtype = codec::DType::kBf16;
    absl::StatusOr<codec::CodecPlan> plan = codec::ParseCodecPlan(plan_text);
    EXPECT_OK(plan.status());
    std::string encoded;
    if (plan.ok()) EXPECT_OK(codec::EncodeBlock(g, *plan, first, AsBytes(raw), {}, &encoded));
    return encoded;
  }
  static std::string Decoded(const std::string& encoded) {
    std::string raw(proxima::testing::kTinyBlockBytes, '\0');
    EXPECT_OK(codec::DecodeBlock(AsBytes(encoded),
                                 std::as_writable_bytes(std::span(raw.data(), raw.size()))));
    return raw;
  }

  // A service holding the blocks of `blocks_`: 4 raw and 2 encoded (int8, int4) in "a", one of
  // alice's and one of bob's in "p"; returns it.
  std::unique_ptr<TierService> Filled() {
    std::unique_ptr<TierService> core = Service(4 << 20);
    const uint32_t a = core->NamespaceIndex("a").value();
    const uint32_t p = core->NamespaceIndex("p").value();
    const v1::ModelProfile tiny = proxima::testing::TinyProfile("snapshot-tiny");
    EXPECT_OK(core->AddProfile(a, tiny).status());
    EXPECT_OK(core->AddProfile(p, tiny).status());
    const uint64_t profile = ProfileId(tiny);
    blocks_.clear();
    for (int n = 0; n < 4; ++n) {
      blocks_.push_back(
          {{a, profile, Key(n), 0}, Pattern(n, proxima::testing::kTinyBlockBytes), 0, {}});
    }
    int n = 4;
    for (const char* plan_text : {"int8", "int4"}) {
      const std::string encoded = TinyEncoded(TinyRaw(n), plan_text, n == 4);
      BlockAttributes attributes;
      attributes.max_level = 2;
      attributes.is_first_block = n == 4;
      blocks_.push_back(
          {{a, profile, Key(n), 0}, encoded, static_cast<uint8_t>(n - 3), attributes});
      ++n;
    }
    blocks_.push_back(
        {{p, profile, Key(n), 1}, Pattern(n, proxima::testing::kTinyBlockBytes), 0, {}});
    ++n;
    blocks_.push_back(
        {{p, profile, Key(n), 2}, Pattern(n, proxima::testing::kTinyBlockBytes), 0, {}});
    for (const Block& b : blocks_) Store(*core, b.id, b.bytes, b.level, b.attributes);
    return core;
  }

  // Fails the test when `core` holds any block of blocks_ with other bytes or level than put;
  // returns how many of them it holds.
  size_t CheckHeld(TierService& core) {
    size_t held = 0;
    for (const Block& b : blocks_) {
      std::optional<std::pair<std::string, uint8_t>> s = Stored(core, b.id);
      if (!s) continue;
      ++held;
      EXPECT_EQ(s->first, b.bytes) << "block " << static_cast<int>(b.id.key[0]);
      EXPECT_EQ(s->second, b.level) << "block " << static_cast<int>(b.id.key[0]);
    }
    return held;
  }

  struct Block {
    BlockId id;
    std::string bytes;
    uint8_t level = 0;
    BlockAttributes attributes;
  };
  std::vector<Block> blocks_;
  std::string dir_;
  std::string path_;
  std::vector<std::unique_ptr<metrics::Registry>> registries_;
};

TEST_F(SnapshotTest, AWrittenSnapshotLoadsBackEveryBlockByteExactInItsOwnScope) {
  std::unique_ptr<TierService> before = Filled();
  ASSERT_OK_AND_ASSIGN(snapshot::Written w,
                       snapshot::Write(*before, path_, absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(w.blocks, blocks_.size());
  EXPECT_EQ(w.profiles, 2u);
  EXPECT_EQ(w.left_blocks, 0u);
  EXPECT_FALSE(Exists(path_ + ".tmp"));
  // Writing leaves the blocks where they were.
  EXPECT_EQ(CheckHeld(*before), blocks_.size());

  // The next daemon numbers alice's and bob's partitions the other way round (its config lists
  // bob's token first): the blocks follow their scopes, not the numbers.
  std::unique_ptr<TierService> after = Service(4 << 20, /*bob_first=*/true);
  ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
  EXPECT_TRUE(l.found);
  EXPECT_TRUE(l.complete);
  EXPECT_EQ(l.blocks, blocks_.size());
  EXPECT_EQ(l.profiles, 2u);
  EXPECT_EQ(l.skipped, 0u);
  EXPECT_TRUE(l.problems.empty()) << l.problems[0];
  EXPECT_FALSE(Exists(path_)) << "a snapshot is read once";
  for (Block& b : blocks_) {
    if (b.id.partition != 0) b.id.partition = 3 - b.id.partition;
  }
  EXPECT_EQ(CheckHeld(*after), blocks_.size());
  EXPECT_OK(
      after->RegisteredBlockBytes(after->NamespaceIndex("p").value(), blocks_[0].id.profile_id)
          .status());
  // And a second Load finds nothing.
  ASSERT_OK_AND_ASSIGN(l, snapshot::Load(*after, path_));
  EXPECT_FALSE(l.found);
}

TEST_F(SnapshotTest, TheMostRecentlyUsedComeBackMostRecentlyUsedAndFirstWhenTheTierIsSmaller) {
  std::unique_ptr<TierService> before = Service(8 << 20);
  const uint32_t a = before->NamespaceIndex("a").value();
  ASSERT_OK(before->AddProfile(a, LargeProfile()).status());
  const uint64_t profile = ProfileId(LargeProfile());
  const uint64_t block_bytes = before->RegisteredBlockBytes(a, profile).value();
  ASSERT_EQ(block_bytes, 512u << 10);
  for (int n = 0; n < 8; ++n) Store(*before, {a, profile, Key(n), 0}, Pattern(n, block_bytes));
  // Most recently used first: 1, 0, 7, 6, 5, 4, 3, 2.
  ASSERT_TRUE(before->store().Touch({a, profile, Key(0), 0}));
  ASSERT_TRUE(before->store().Touch({a, profile, Key(1), 0}));
  ASSERT_OK(snapshot::Write(*before, path_, absl::Now() + absl::Seconds(30)).status());

  // Room for 4 of the 8.
  std::unique_ptr<TierService> after = Service(2 << 20);
  ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
  EXPECT_EQ(l.blocks, 4u);
  EXPECT_EQ(l.no_room, 4u);
  for (int n : {1, 0, 7, 6}) EXPECT_TRUE(after->store().Contains({a, profile, Key(n), 0})) << n;
  for (int n : {5, 4, 3, 2}) EXPECT_FALSE(after->store().Contains({a, profile, Key(n), 0})) << n;
  // Their order came back too: a new block pushes out the least recently used of them, 6.
  Store(*after, {a, profile, Key(8), 0}, Pattern(8, block_bytes));
  EXPECT_FALSE(after->store().Contains({a, profile, Key(6), 0}));
  for (int n : {1, 0, 7}) {
    std::optional<std::pair<std::string, uint8_t>> s = Stored(*after, {a, profile, Key(n), 0});
    ASSERT_TRUE(s.has_value()) << "block " << n;
    EXPECT_EQ(s->first, Pattern(n, block_bytes)) << "block " << n;
  }
}

// A namespace whose max_bytes is now lower than what it held gets its hottest blocks within it;
// the rest are left out (no_room), and nothing of another namespace is.
TEST_F(SnapshotTest, TensOfThousandsOfBlocksInOneShardAreAllWrittenHottestFirst) {
  // Before, each block was found by a scan from its list's hot end past every block already
  // written (they stay taken there): at most 4096 per list and shard were ever written, and the
  // work grew with the square of the blocks.
  constexpr int kBlocks = 20000;
  std::unique_ptr<TierService> before = Service(16 << 20, false, {}, 0, /*index_shards=*/1);
  const uint32_t a = before->NamespaceIndex("a").value();
  const v1::ModelProfile tiny = proxima::testing::TinyProfile("snapshot-many");
  ASSERT_OK(before->AddProfile(a, tiny).status());
  const uint64_t profile = ProfileId(tiny);
  auto id = [&](int n) {
    BlockId b{a, profile, {}, 0};
    std::memcpy(b.key.data(), &n, sizeof(n));
    return b;
  };
  for (int n = 0; n < kBlocks; ++n) {
    ASSERT_NO_FATAL_FAILURE(Store(*before, id(n), Pattern(n, proxima::testing::kTinyBlockBytes)));
  }
  for (int n = 0; n < kBlocks; n += 2) ASSERT_TRUE(before->store().Touch(id(n)));  // protected
  const absl::Time start = absl::Now();
  ASSERT_OK_AND_ASSIGN(snapshot::Written w,
                       snapshot::Write(*before, path_, absl::Now() + absl::Seconds(60)));
  std::cout << "wrote " << w.blocks << " blocks in " << absl::Now() - start << "\n";
  EXPECT_EQ(w.blocks, static_cast<uint64_t>(kBlocks));
  EXPECT_EQ(w.left_blocks, 0u);
  // Room for a quarter: the even ones, touched last, most recently used first.
  std::unique_ptr<TierService> after =
      Service(kBlocks / 4 * proxima::testing::kTinyBlockBytes + (1 << 20), false, {}, 0, 1);
  ASSERT_OK(after->AddProfile(a, tiny).status());
  ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
  EXPECT_EQ(l.blocks + l.no_room, static_cast<uint64_t>(kBlocks));
  ASSERT_GE(l.blocks, static_cast<uint64_t>(kBlocks / 4));
  for (int n = kBlocks - 2; n >= kBlocks - kBlocks / 2; n -= 2) {
    ASSERT_TRUE(after->store().Contains(id(n))) << n;
  }
  std::optional<std::pair<std::string, uint8_t>> s = Stored(*after, id(kBlocks - 2));
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->first, Pattern(kBlocks - 2, proxima::testing::kTinyBlockBytes));
}

TEST_F(SnapshotTest, ANamespaceGetsItsHottestBlocksWithinItsMaxBytes) {
  std::unique_ptr<TierService> before = Service(8 << 20);
  const uint32_t a = before->NamespaceIndex("a").value();
  const uint32_t p = before->NamespaceIndex("p").value();
  ASSERT_OK(before->AddProfile(a, LargeProfile()).status());
  ASSERT_OK(before->AddProfile(p, LargeProfile()).status());
  const uint64_t profile = ProfileId(LargeProfile());
  const uint64_t block_bytes = 512u << 10;
  for (int n = 0; n < 6; ++n) Store(*before, {a, profile, Key(n), 0}, Pattern(n, block_bytes));
  Store(*before, {p, profile, Key(20), 1}, Pattern(20, block_bytes));  // the coldest of all
  ASSERT_TRUE(before->store().Touch({a, profile, Key(0), 0}));         // a's hottest: 0, 5, 4, ...
  ASSERT_OK(snapshot::Write(*before, path_, absl::Now() + absl::Seconds(30)).status());

  std::unique_ptr<TierService> after = Service(8 << 20, false, {}, /*a_max_bytes=*/3 * block_bytes);
  ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
  EXPECT_EQ(l.blocks, 4u);
  EXPECT_EQ(l.no_room, 3u);
  for (int n : {0, 5, 4}) EXPECT_TRUE(after->store().Contains({a, profile, Key(n), 0})) << n;
  for (int n : {3, 2, 1}) EXPECT_FALSE(after->store().Contains({a, profile, Key(n), 0})) << n;
  EXPECT_TRUE(after->store().Contains({p, profile, Key(20), 1}));
  EXPECT_EQ(after->store().namespace_bytes(a), 3 * block_bytes);
}

TEST_F(SnapshotTest, BlocksUsedAgainGoBackToTheProtectedSegmentAndOutliveAScanOfNewOnes) {
  std::unique_ptr<TierService> before = Service(8 << 20);  // 16 blocks; protected: 3 (0.2)
  const uint32_t a = before->NamespaceIndex("a").value();
  ASSERT_OK(before->AddProfile(a, LargeProfile()).status());
  const uint64_t profile = ProfileId(LargeProfile());
  const uint64_t block_bytes = before->RegisteredBlockBytes(a, profile).value();
  for (int n = 0; n < 8; ++n) Store(*before, {a, profile, Key(n), 0}, Pattern(n, block_bytes));
  for (int n : {0, 1, 2}) ASSERT_TRUE(before->store().Touch({a, profile, Key(n), 0}));
  ASSERT_EQ(before->store().protected_bytes(), 3 * block_bytes);
  ASSERT_OK(snapshot::Write(*before, path_, absl::Now() + absl::Seconds(30)).status());

  std::unique_ptr<TierService> after = Service(8 << 20);
  ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
  EXPECT_EQ(l.blocks, 8u);
  EXPECT_EQ(after->store().protected_bytes(), 3 * block_bytes);
  // 16 new blocks, each put once (a long prompt nobody reads again): as before the restart, they
  // push out the blocks used once, not the three used again.
  for (int n = 100; n < 116; ++n) {
    Store(*after, {a, profile, Key(n), 0}, Pattern(n, block_bytes));
  }
  for (int n : {0, 1, 2}) {
    std::optional<std::pair<std::string, uint8_t>> s = Stored(*after, {a, profile, Key(n), 0});
    ASSERT_TRUE(s.has_value()) << "block " << n << " was used again before the restart";
    EXPECT_EQ(s->first, Pattern(n, block_bytes)) << "block " << n;
  }
  for (int n = 3; n < 8; ++n) EXPECT_FALSE(after->store().Contains({a, profile, Key(n), 0})) << n;
}

TEST_F(SnapshotTest, AfterAHierarchyChangeABlockKeepsItsEncodingOnlyWhereItsPlanIsStillALevel) {
  // Written by a daemon whose "a" compresses int8, then int4; read by one that compresses int4,
  // then int2, and by one that does not compress.
  std::unique_ptr<TierService> before = Service(4 << 20, false, {"int8", "int4"});
  const uint32_t a = before->NamespaceIndex("a").value();
  const v1::ModelProfile tiny = proxima::testing::TinyProfile("snapshot-tiny");
  ASSERT_OK(before->AddProfile(a, tiny).status());
  const uint64_t profile = ProfileId(tiny);
  const std::string raw = TinyRaw(1);
  const std::string int8 = TinyEncoded(raw, "int8", false);
  const std::string int4 = TinyEncoded(raw, "int4", false);
  const std::string int8_decoded = Decoded(int8);
  const std::string int4_decoded = Decoded(int4);
  BlockAttributes attributes;
  attributes.max_level = 2;
  const BlockId raw_id{a, profile, Key(0), 0}, int8_id{a, profile, Key(1), 0},
      int4_id{a, profile, Key(2), 0};
  Store(*before, raw_id, raw, 0, attributes);
  Store(*before, int8_id, int8, 1, attributes);
  Store(*before, int4_id, int4, 2, attributes);
  ASSERT_OK(snapshot::Write(*before, path_, absl::InfiniteFuture()).status());
  const std::string file = ReadFile(path_);

  {
    std::unique_ptr<TierService> after = Service(4 << 20, false, {"int4", "int2"});
    ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
    EXPECT_EQ(l.blocks, 3u);
    EXPECT_EQ(l.decoded, 1u);
    EXPECT_EQ(l.skipped, 0u);
    // int4 is level 1 here: the same bytes, under that level.
    EXPECT_EQ(Stored(*after, int4_id), std::make_pair(int4, uint8_t{1}));
    // int8 is no level here: the block, decoded, raw (the tierer takes it down int4 and int2).
    EXPECT_EQ(Stored(*after, int8_id), std::make_pair(int8_decoded, uint8_t{0}));
    EXPECT_EQ(Stored(*after, raw_id), std::make_pair(raw, uint8_t{0}));
    EXPECT_EQ(after->store().level_blocks(1), 1u);
    EXPECT_EQ(after->store().level_blocks(2), 0u);
  }
  {
    WriteFile(path_, file);
    std::unique_ptr<TierService> after = Service(4 << 20);  // no compression
    ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
    EXPECT_EQ(l.blocks, 3u);
    EXPECT_EQ(l.decoded, 2u);
    EXPECT_EQ(l.bytes, 3 * raw.size());
    EXPECT_EQ(Stored(*after, int8_id), std::make_pair(int8_decoded, uint8_t{0}));
    EXPECT_EQ(Stored(*after, int4_id), std::make_pair(int4_decoded, uint8_t{0}));
  }
  {
    // The same hierarchy: every block as it was.
    WriteFile(path_, file);
    std::unique_ptr<TierService> after = Service(4 << 20, false, {"int8", "int4"});
    ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
    EXPECT_EQ(l.decoded, 0u);
    EXPECT_EQ(Stored(*after, int8_id), std::make_pair(int8, uint8_t{1}));
    EXPECT_EQ(Stored(*after, int4_id), std::make_pair(int4, uint8_t{2}));
  }
}

TEST_F(SnapshotTest, AfterAConfigChangeTheBlocksMayReachTheNewHierarchysLevels) {
  // Each block's attributes are derived again from its put's hints: the deepest level it may
  // reach follows the new hierarchy, and a high-priority put's cap still holds.
  const v1::ModelProfile tiny = proxima::testing::TinyProfile("snapshot-tiny");
  const uint64_t profile = ProfileId(tiny);
  auto max_levels = [&](TierService& core) {
    std::map<int, int> out;  // key byte -> max_level
    std::vector<BlockStore::Candidate> taken;
    while (std::optional<BlockStore::Candidate> c = core.store().HottestForHandoff()) {
      out[c->id.key[0]] = c->attributes.max_level;
      taken.push_back(*c);
    }
    for (const BlockStore::Candidate& c : taken) core.store().Release(c);
    return out;
  };
  for (const std::vector<std::string>& levels_before :
       {std::vector<std::string>{"int8"}, std::vector<std::string>{}}) {
    std::unique_ptr<TierService> before = Service(4 << 20, false, levels_before);
    const uint32_t a = before->NamespaceIndex("a").value();
    ASSERT_OK(before->AddProfile(a, tiny).status());
    const BlockAttributes normal = before->tierer().AttributesFor(a, 4, true, 5, false);
    const BlockAttributes high = before->tierer().AttributesFor(a, 4, true, 6, true);
    ASSERT_EQ(normal.max_level, levels_before.size());
    Store(*before, {a, profile, Key(0), 0}, TinyRaw(0), 0, normal);
    Store(*before, {a, profile, Key(1), 0}, TinyRaw(1), 0, high);
    ASSERT_OK(snapshot::Write(*before, path_, absl::InfiniteFuture()).status());

    std::unique_ptr<TierService> after = Service(4 << 20, false, {"int8", "int4", "int2"});
    ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
    ASSERT_EQ(l.blocks, 2u);
    const std::map<int, int> got = max_levels(*after);
    EXPECT_EQ(got.at(Key(0)[0]), 3) << levels_before.size() << " levels before";
    EXPECT_EQ(got.at(Key(1)[0]), 1) << "priority.high_max_level (1) still caps it";
  }
}

TEST_F(SnapshotTest, ADeadlineThatHasPassedWritesTheProfilesAndNoBlock) {
  std::unique_ptr<TierService> before = Filled();
  ASSERT_OK_AND_ASSIGN(snapshot::Written w, snapshot::Write(*before, path_, absl::InfinitePast()));
  EXPECT_EQ(w.blocks, 0u);
  EXPECT_EQ(w.left_blocks, blocks_.size());
  std::unique_ptr<TierService> after = Service(4 << 20);
  ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
  EXPECT_TRUE(l.complete);
  EXPECT_EQ(l.profiles, 2u);
  EXPECT_EQ(l.blocks, 0u);
}

TEST_F(SnapshotTest, AnUnwritableDirectoryIsAnErrorNamingThePathAndLeavesNoFile) {
  std::unique_ptr<TierService> before = Filled();
  EXPECT_THAT(snapshot::Write(*before, dir_ + "/no-such-dir/snapshot", absl::InfiniteFuture()),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("no-such-dir/snapshot.tmp"), HasSubstr("No such file"))));
  EXPECT_EQ(CheckHeld(*before), blocks_.size());
}

TEST_F(SnapshotTest, OneDaemonAtATimeHoldsTheFileAndAnotherIsToldWhich) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<snapshot::Claim> first, snapshot::ClaimFile(path_));
  const std::string pid = absl::StrCat(::getpid());
  EXPECT_EQ(ReadFile(path_ + ".lock"), pid + "\n");
  // flock locks belong to the open file, so a second claim in this process conflicts as another
  // process's would.
  EXPECT_THAT(snapshot::ClaimFile(path_),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("tiers.host.snapshot_file '" + path_ + "'"),
                             HasSubstr("in use by another proximad (pid " + pid + ","),
                             HasSubstr("'" + path_ + ".lock'"))));
  first.reset();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<snapshot::Claim> second, snapshot::ClaimFile(path_));
  EXPECT_THAT(snapshot::ClaimFile(dir_ + "/no-such-dir/snapshot"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("its directory '" + dir_ + "/no-such-dir'"),
                             HasSubstr("is not one this process can write to"))));
}

TEST_F(SnapshotTest, AHeaderThatIsNotThisVersionsSnapshotLoadsNothingAndSaysWhy) {
  std::unique_ptr<TierService> before = Filled();
  ASSERT_OK(snapshot::Write(*before, path_, absl::InfiniteFuture()).status());
  const std::string good = ReadFile(path_);
  struct Case {
    std::string bytes;
    std::string says;
  };
  std::string magic = good;
  magic[0] = 'X';
  std::string version = good;
  version[8] = 2;  // and a header CRC32C that matches
  const uint32_t crc = Crc32c(AsBytes(std::string_view(version.data(), 28)));
  std::memcpy(version.data() + 28, &crc, 4);
  std::string header_crc = good;
  header_crc[16] ^= 1;
  for (const Case& c :
       {Case{"", "is 0 bytes; expected at least its 32-byte header"},
        Case{good.substr(0, 20), "is 20 bytes"}, Case{magic, "magic \"PROXSNAP\""},
        Case{version, "version 2 with a 32-byte header; this proximad reads version 1"},
        Case{header_crc, "header has CRC32C"}}) {
    WriteFile(path_, c.bytes);
    std::unique_ptr<TierService> after = Service(4 << 20);
    EXPECT_THAT(
        snapshot::Load(*after, path_),
        StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr(path_), HasSubstr(c.says))));
    EXPECT_EQ(after->store().blocks(), 0u);
    EXPECT_FALSE(Exists(path_));
  }
}

// Cut short anywhere, or with any one byte changed, a snapshot loads only blocks whose bytes
// and level are those written, and says what it left.
TEST_F(SnapshotTest, ACutOrChangedFileLoadsOnlyExactBlocks) {
  std::unique_ptr<TierService> before = Filled();
  ASSERT_OK(snapshot::Write(*before, path_, absl::InfiniteFuture()).status());
  const std::string good = ReadFile(path_);
  size_t incomplete = 0;
  for (size_t cut = 32; cut < good.size(); cut += 37) {
    WriteFile(path_, good.substr(0, cut));
    std::unique_ptr<TierService> after = Service(4 << 20);
    ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
    EXPECT_FALSE(l.complete) << "cut at " << cut;
    EXPECT_EQ(CheckHeld(*after), l.blocks) << "cut at " << cut;
    EXPECT_LE(l.blocks, blocks_.size()) << "cut at " << cut;
    incomplete += l.problems.empty() ? 0 : 1;
  }
  EXPECT_GT(incomplete, 0u);

  std::mt19937 rng(7);
  size_t fewer = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string bad = good;
    const size_t at = 32 + rng() % (good.size() - 32);
    bad[at] = static_cast<char>(bad[at] ^ (1 + rng() % 255));
    WriteFile(path_, bad);
    std::unique_ptr<TierService> after = Service(4 << 20);
    ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
    EXPECT_EQ(CheckHeld(*after), l.blocks) << "byte " << at;
    if (l.blocks < blocks_.size()) {
      ++fewer;
      EXPECT_FALSE(l.problems.empty()) << "byte " << at;
    }
  }
  EXPECT_GT(fewer, 250u);  // a changed end record is the only harmless change

  // A changed byte in the last block's bytes loses that block alone.
  v1::SnapshotEnd end;
  end.set_blocks(blocks_.size());
  uint64_t bytes = 0;
  for (const Block& b : blocks_) bytes += b.bytes.size();
  end.set_block_bytes(bytes);
  std::string bad = good;
  bad[good.size() - 24 - end.ByteSizeLong() - 1] ^= 0x40;
  WriteFile(path_, bad);
  std::unique_ptr<TierService> after = Service(4 << 20);
  ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
  EXPECT_TRUE(l.complete);
  EXPECT_EQ(l.blocks, blocks_.size() - 1);
  EXPECT_EQ(l.skipped, 1u);
  ASSERT_EQ(l.problems.size(), 1u);
  EXPECT_THAT(l.problems[0], AllOf(HasSubstr("namespace 'a'"), HasSubstr("its bytes have CRC32C")));
  EXPECT_EQ(CheckHeld(*after), blocks_.size() - 1);
}

// Records that frame correctly but say what this daemon cannot take are skipped one by one,
// each with its reason; the good records around them load.
TEST_F(SnapshotTest, RecordsThisConfigCannotTakeAreSkippedEachWithItsReason) {
  std::unique_ptr<TierService> before = Filled();
  ASSERT_OK(snapshot::Write(*before, path_, absl::InfiniteFuture()).status());
  const std::string good = ReadFile(path_);
  // The format, framed here independently of the writer (docs/format.md).
  auto frame = [](uint32_t kind, const std::string& meta, const std::string& data) {
    std::string h;
    auto put = [&h](uint64_t v, int bytes) {
      for (int i = 0; i < bytes; ++i) h.push_back(static_cast<char>(v >> (8 * i)));
    };
    put(kind, 4);
    put(meta.size(), 4);
    put(data.size(), 8);
    put(0, 4);
    put(Crc32cExtend(Crc32c(AsBytes(h)), AsBytes(meta)), 4);
    return h + meta + data;
  };
  const Block& raw = blocks_[0];
  auto block = [&](auto change, const std::string& data) {
    v1::SnapshotBlock b;
    b.set_namespace_name("a");
    b.set_profile_id(raw.id.profile_id);
    b.set_key(std::string(reinterpret_cast<const char*>(raw.id.key.data()), 32));
    change(b);
    b.set_crc32c(Crc32c(AsBytes(data)));
    return frame(2, b.SerializeAsString(), data);
  };
  const std::string other(proxima::testing::kTinyBlockBytes, 'z');
  v1::SnapshotProfile unknown_ns;
  unknown_ns.set_namespace_name("gone");
  *unknown_ns.mutable_profile() = proxima::testing::TinyProfile("x");
  v1::SnapshotProfile zero_layers;
  zero_layers.set_namespace_name("a");
  *zero_layers.mutable_profile() = proxima::testing::TinyProfile("y");
  zero_layers.mutable_profile()->set_num_layers(0);
  const std::string hostile =
      frame(1, unknown_ns.SerializeAsString(), "") + frame(1, zero_layers.SerializeAsString(), "") +
      frame(7, "", "") + frame(2, "\xff\xff", "") +
      block([](v1::SnapshotBlock& b) { b.set_namespace_name("gone"); }, other) +
      block(
          [](v1::SnapshotBlock& b) {
            b.set_namespace_name("p");
            b.set_scope("carol");
          },
          other) +
      block([](v1::SnapshotBlock& b) { b.set_profile_id(12345); }, other) +
      block([](v1::SnapshotBlock& b) { b.set_key("short"); }, other) +
      block([](v1::SnapshotBlock& b) { b.set_level(99); }, other) +
      block([](v1::SnapshotBlock& b) {}, other.substr(0, 100)) +
      block([](v1::SnapshotBlock& b) { b.set_level(1); }, other);
  // After the profiles (which every block needs) and before the first block: the good file's
  // profile records are its first two.
  size_t offset = 32;
  for (int r = 0; r < 2; ++r) {
    uint32_t meta = 0;
    std::memcpy(&meta, good.data() + offset + 4, 4);
    offset += 24 + meta;
  }
  WriteFile(path_, good.substr(0, offset) + hostile + good.substr(offset));
  std::unique_ptr<TierService> after = Service(4 << 20);
  ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, path_));
  EXPECT_TRUE(l.complete);
  EXPECT_EQ(l.blocks, blocks_.size());
  EXPECT_EQ(l.skipped, 11u);
  EXPECT_EQ(CheckHeld(*after), blocks_.size());
  const std::vector<std::string> says = {
      "record 2 at offset",
      "namespace 'gone' is not configured",
      "profile.num_layers is 0",
      "kind is 7; expected 1 (profile), 2 (block) or 3 (end)",
      "metadata does not parse",
      "scope 'carol' is not a token scope of namespace 'p'",
      "0x0000000000003039",
      "key is 5 bytes; expected 32",
      "level is 99",
      "its data is 100 bytes at level 0; expected exactly block_bytes = 512",
      "at level 1 but is not a valid STAR-KV block"};
  std::string all;
  for (const std::string& p : l.problems) all += p + "\n";
  for (const std::string& s : says) EXPECT_THAT(all, HasSubstr(s));
  EXPECT_EQ(l.problems.size(), 11u);
}

// Where each record of snapshot file `bytes` ends (after the 32-byte file header; the framing
// of docs/format.md, 24-byte record headers).
std::vector<uint64_t> RecordEnds(const std::string& bytes) {
  std::vector<uint64_t> ends;
  uint64_t offset = 32;
  while (offset + 24 <= bytes.size()) {
    uint32_t meta = 0;
    uint64_t data = 0;
    std::memcpy(&meta, bytes.data() + offset + 4, 4);
    std::memcpy(&data, bytes.data() + offset + 8, 8);
    offset += 24 + meta + data;
    ends.push_back(offset);
  }
  return ends;
}

// A file system that fills while the snapshot is written (a tmpfs of 1 to 64 pages, mounted
// here): the file keeps the hottest blocks that fit, as the writer had them, ends with its end
// record and loads whole. It holds as many blocks as any such file could there: where the end
// record would not fit after the blocks that did, the coldest of them make room for it. Needs
// root and a mount namespace of its own (ctest entry snapshot_disk_full); skips elsewhere.
TEST_F(SnapshotTest, AFileSystemThatFillsKeepsTheHottestBlocksThatFitAndLoadsWhole) {
  if (!proxima::testing::InMountNamespaceOfItsOwn()) {
    GTEST_SKIP() << "mounts tmpfs file systems: runs as root in a mount namespace of its own "
                    "(the ctest entry snapshot_disk_full runs it under unshare --mount)";
  }
  constexpr int kBlocks = 600;  // records of about 580 bytes: about 85 pages in all
  std::unique_ptr<TierService> before = Service(4 << 20);
  const uint32_t a = before->NamespaceIndex("a").value();
  const v1::ModelProfile tiny = proxima::testing::TinyProfile("snapshot-full");
  ASSERT_OK(before->AddProfile(a, tiny).status());
  const uint64_t profile = ProfileId(tiny);
  auto id = [&](int n) {
    BlockKey k = Key(n % 256);
    k[1] = static_cast<uint8_t>(n / 256);
    return BlockId{a, profile, k, 0};
  };
  // Most recently used first: kBlocks - 1 down to 0.
  for (int n = 0; n < kBlocks; ++n) {
    Store(*before, id(n), Pattern(n, proxima::testing::kTinyBlockBytes));
  }
  const absl::Time far = absl::Now() + absl::Minutes(5);
  // The file with room for everything: the one profile record, then the blocks' records.
  ASSERT_OK_AND_ASSIGN(snapshot::Written all, snapshot::Write(*before, path_, far));
  ASSERT_EQ(all.blocks, static_cast<uint64_t>(kBlocks));
  EXPECT_TRUE(all.full.empty());
  const std::string whole = ReadFile(path_);
  ::unlink(path_.c_str());
  const std::vector<uint64_t> ends = RecordEnds(whole);
  ASSERT_EQ(ends.size(), kBlocks + 2u);  // profile, blocks, end

  const std::string mount = dir_ + "/small";
  ASSERT_EQ(::mkdir(mount.c_str(), 0700), 0);
  absl::Cleanup rmdir_mount = [&] { ::rmdir(mount.c_str()); };
  const std::string file = mount + "/snapshot";
  int end_made_room = 0;  // sizes where a block that fit was left out for the end record
  for (uint64_t pages = 1; pages <= 64; ++pages) {
    SCOPED_TRACE(absl::StrCat(pages, " pages"));
    const uint64_t room = pages * 4096;
    std::unique_ptr<proxima::testing::ScopedTmpfs> tmpfs;
    ASSERT_OK(proxima::testing::ScopedTmpfs::Mount(mount, room, &tmpfs));
    ASSERT_OK_AND_ASSIGN(snapshot::Written w, snapshot::Write(*before, file, far));
    EXPECT_THAT(w.full, AllOf(HasSubstr(file + ".tmp"), HasSubstr("No space left on device")));
    EXPECT_EQ(w.blocks + w.left_blocks, static_cast<uint64_t>(kBlocks));
    EXPECT_EQ(w.bytes, w.blocks * proxima::testing::kTinyBlockBytes);
    EXPECT_FALSE(Exists(file + ".tmp"));
    const std::string bytes = ReadFile(file);
    ASSERT_LE(bytes.size(), room);
    // The whole file's records up to its blocks (after the header, which holds the time it was
    // written), then an end record.
    const uint64_t blocks_end = ends[w.blocks];  // ends[0] is the profile's
    ASSERT_LT(blocks_end, bytes.size());
    EXPECT_TRUE(bytes.compare(32, blocks_end - 32, whole, 32, blocks_end - 32) == 0)
        << "the records differ from the whole file's";
    const uint64_t end_record = bytes.size() - blocks_end;
    uint32_t kind = 0;
    std::memcpy(&kind, bytes.data() + blocks_end, 4);
    EXPECT_EQ(kind, 3u);
    // One block more would not have fitted with an end record (as long as this one, or longer:
    // its counts are no shorter).
    ASSERT_LT(w.blocks, static_cast<uint64_t>(kBlocks));
    EXPECT_GT(ends[w.blocks + 1] + end_record, room);
    if (ends[w.blocks + 1] <= room) ++end_made_room;

    std::unique_ptr<TierService> after = Service(4 << 20);
    ASSERT_OK_AND_ASSIGN(snapshot::Loaded l, snapshot::Load(*after, file));
    EXPECT_TRUE(l.complete);
    EXPECT_EQ(l.skipped, 0u);
    EXPECT_EQ(l.blocks, w.blocks);
    for (int n = kBlocks - 1; n >= 0; --n) {
      const bool hot = n >= kBlocks - static_cast<int>(w.blocks);
      std::optional<std::pair<std::string, uint8_t>> held = Stored(*after, id(n));
      ASSERT_EQ(held.has_value(), hot) << "block " << n;
      if (hot) {
        ASSERT_EQ(held->first, Pattern(n, proxima::testing::kTinyBlockBytes)) << "block " << n;
      }
    }
  }
  // The sizes tried include ones where the end record took a block's place.
  EXPECT_GT(end_made_room, 0);
}

}  // namespace
}  // namespace proxima::daemon
