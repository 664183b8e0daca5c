#include "daemon/placement.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace proxima::daemon {
namespace {

std::array<uint8_t, 32> Key(uint64_t i) {
  std::array<uint8_t, 32> key{};
  for (int b = 0; b < 8; ++b) key[b] = static_cast<uint8_t>(i >> (8 * b));
  return key;
}

std::vector<PlacementNode> Nodes(int n) {
  std::vector<PlacementNode> nodes;
  for (int i = 0; i < n; ++i) nodes.push_back({"10.0.0." + std::to_string(i + 1) + ":50051", 1.0});
  return nodes;
}

TEST(PlacementTest, HashIsStableAcrossBuildsAndProcesses) {
  // Pinned values: a change here moves every block's home in a running cluster (a rolling
  // upgrade would then miss until the blocks are put again), so it must be deliberate.
  const uint64_t a = StableHash64(std::string_view("10.0.0.1:50051"));
  const uint64_t b = StableHash64(std::string_view("10.0.0.1:50051"));
  EXPECT_EQ(a, b);
  EXPECT_NE(a, StableHash64(std::string_view("10.0.0.1:50052")));
  EXPECT_EQ(PlacementHash("tenant-a", Key(7)), PlacementHash("tenant-a", Key(7)));
  EXPECT_NE(PlacementHash("tenant-a", Key(7)), PlacementHash("tenant-b", Key(7)));
  EXPECT_NE(PlacementHash("tenant-a", Key(7)), PlacementHash("tenant-a", Key(8)));
}

TEST(PlacementTest, HashValuesArePinned) {
  constexpr uint64_t kPinnedProxima = 0x3968990683dbea55ull;
  constexpr uint64_t kPinnedKey1 = 0xbccff198f920b04bull;
  EXPECT_EQ(StableHash64(std::string_view("proxima")), kPinnedProxima);
  EXPECT_EQ(PlacementHash("ns", Key(1)), kPinnedKey1);
}

TEST(PlacementTest, KeysSpreadEvenlyOverEqualNodes) {
  const std::vector<PlacementNode> nodes = Nodes(10);
  std::vector<int> count(nodes.size());
  const int kKeys = 100000;
  for (int i = 0; i < kKeys; ++i) ++count[HomeNode(nodes, PlacementHash("ns", Key(i)))];
  for (int c : count) {
    EXPECT_GT(c, kKeys / 10 * 0.95);
    EXPECT_LT(c, kKeys / 10 * 1.05);
  }
}

TEST(PlacementTest, WeightsAreHonoured) {
  std::vector<PlacementNode> nodes = Nodes(3);
  nodes[0].weight = 2.0;  // twice the memory: twice the keys
  std::vector<int> count(nodes.size());
  const int kKeys = 100000;
  for (int i = 0; i < kKeys; ++i) ++count[HomeNode(nodes, PlacementHash("ns", Key(i)))];
  EXPECT_NEAR(static_cast<double>(count[0]) / kKeys, 0.5, 0.02);
  EXPECT_NEAR(static_cast<double>(count[1]) / kKeys, 0.25, 0.02);
  nodes[1].weight = 0;  // a zero-weight node is never chosen
  for (int i = 0; i < 1000; ++i) EXPECT_NE(HomeNode(nodes, PlacementHash("ns", Key(i))), 1u);
}

TEST(PlacementTest, LeavingNodeMovesOnlyItsOwnKeys) {
  const std::vector<PlacementNode> all = Nodes(8);
  std::vector<PlacementNode> without(all.begin(), all.end() - 1);  // node 7 leaves
  int moved = 0;
  const int kKeys = 50000;
  for (int i = 0; i < kKeys; ++i) {
    const uint64_t h = PlacementHash("ns", Key(i));
    const size_t before = HomeNode(all, h), after = HomeNode(without, h);
    if (before != 7) {
      EXPECT_EQ(after, before) << "key " << i << " moved although its home stayed";
    } else {
      ++moved;
      // It goes to its second choice in the full set.
      EXPECT_EQ(after, RankNodes(all, h, 2)[1]);
    }
  }
  EXPECT_NEAR(static_cast<double>(moved) / kKeys, 1.0 / 8, 0.01);
}

TEST(PlacementTest, RankNodesIsDistinctAndOrderedAndBounded) {
  const std::vector<PlacementNode> nodes = Nodes(5);
  const uint64_t h = PlacementHash("ns", Key(3));
  std::vector<size_t> ranked = RankNodes(nodes, h, 10);
  ASSERT_EQ(ranked.size(), 5u);
  for (size_t i = 1; i < ranked.size(); ++i) {
    EXPECT_GT(RendezvousScore(StableHash64(nodes[ranked[i - 1]].id), 1.0, h),
              RendezvousScore(StableHash64(nodes[ranked[i]].id), 1.0, h));
  }
  EXPECT_EQ(ranked[0], HomeNode(nodes, h));
  EXPECT_TRUE(RankNodes({}, h, 3).empty());
  EXPECT_EQ(HomeNode({}, h), 0u);
}

}  // namespace
}  // namespace proxima::daemon
