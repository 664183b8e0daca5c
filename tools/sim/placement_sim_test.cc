#include "tools/sim/placement_sim.h"

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::sim {
namespace {

using ::proxima::testing::IsOk;
using ::proxima::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<uint64_t> Hashes(size_t count) {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < count; ++i) out.push_back(TraceBlockHash("ns", i));
  return out;
}

TEST(TraceBlockKey, HoldsTheIdLittleEndianInThirtyTwoBytes) {
  std::vector<uint8_t> key = TraceBlockKey(0x0102030405060708ull);
  ASSERT_EQ(key.size(), 32u);
  EXPECT_EQ(key[0], 0x08);
  EXPECT_EQ(key[7], 0x01);
  for (size_t i = 8; i < 32; ++i) EXPECT_EQ(key[i], 0) << i;
  EXPECT_EQ(TraceBlockHash("ns", 5), daemon::PlacementHash("ns", TraceBlockKey(5)));
  EXPECT_NE(TraceBlockHash("ns", 5), TraceBlockHash("other", 5));
}

TEST(DistinctBlocks, KeepsFirstReferenceOrder) {
  std::vector<replay::TraceRequest> requests(2);
  requests[0].hash_ids = {0, 4, 2};
  requests[1].hash_ids = {0, 4, 9, 2, 1};
  EXPECT_THAT(DistinctBlocks(requests), ElementsAre(0u, 4u, 2u, 9u, 1u));
}

TEST(SimNodeId, IsAnAddressAndDistinct) {
  EXPECT_EQ(SimNodeId(0), "10.0.0.1:50051");
  EXPECT_EQ(SimNodeId(255), "10.0.1.0:50051");
  EXPECT_EQ(SimNodeId(65535), "10.1.0.0:50051");
  std::set<std::string> ids;
  for (size_t i = 0; i < 70000; ++i) ids.insert(SimNodeId(i));
  EXPECT_EQ(ids.size(), 70000u);
}

TEST(MakeNodes, HalfHeavyWhenAsked) {
  auto equal = MakeNodes(3);
  ASSERT_EQ(equal.size(), 3u);
  for (const auto& n : equal) EXPECT_EQ(n.weight, 1.0);
  auto mixed = MakeNodes(4, 2.5);
  EXPECT_EQ(mixed[0].weight, 1.0);
  EXPECT_EQ(mixed[1].weight, 2.5);
  EXPECT_EQ(mixed[2].weight, 1.0);
  EXPECT_EQ(mixed[3].weight, 2.5);
  EXPECT_EQ(mixed[3].id, SimNodeId(3));
}

TEST(MeasureBalance, KnownSpreads) {
  std::vector<double> even = {3, 3, 3, 3}, ones = {1, 1, 1, 1};
  auto b = MeasureBalance(even, ones);
  ASSERT_THAT(b.status(), IsOk());
  EXPECT_DOUBLE_EQ(b->max_over_mean, 1);
  EXPECT_DOUBLE_EQ(b->cv, 0);

  // Mean 1; deviations 1, 0, 0, -1: population stddev sqrt(2/4).
  std::vector<double> skewed = {2, 1, 1, 0};
  b = MeasureBalance(skewed, ones);
  ASSERT_THAT(b.status(), IsOk());
  EXPECT_DOUBLE_EQ(b->max_over_mean, 2);
  EXPECT_DOUBLE_EQ(b->p99_over_mean, 2);  // nearest rank ceil(0.99 * 4) = 4: the largest
  EXPECT_DOUBLE_EQ(b->min_over_mean, 0);
  EXPECT_NEAR(b->cv, std::sqrt(0.5), 1e-12);

  // Loads in proportion to weights are perfectly balanced.
  std::vector<double> load = {10, 20, 10}, weight = {1, 2, 1};
  b = MeasureBalance(load, weight);
  ASSERT_THAT(b.status(), IsOk());
  EXPECT_DOUBLE_EQ(b->max_over_mean, 1);
  EXPECT_NEAR(b->cv, 0, 1e-12);
  // Equal loads on unequal nodes: the light node carries 20 / (40 / 4) = 2x its fair share.
  std::vector<double> flat = {20, 20};
  std::vector<double> one_three = {1, 3};
  b = MeasureBalance(flat, one_three);
  ASSERT_THAT(b.status(), IsOk());
  EXPECT_DOUBLE_EQ(b->max_over_mean, 2);
  EXPECT_DOUBLE_EQ(b->min_over_mean, 20.0 / 30.0);

  // p99 over 200 nodes is the 198th smallest, not the maximum.
  std::vector<double> many(200, 1.0), many_w(200, 1.0);
  many[199] = 100;
  many[198] = 50;
  b = MeasureBalance(many, many_w);
  ASSERT_THAT(b.status(), IsOk());
  const double mean = (198 + 150) / 200.0;
  EXPECT_DOUBLE_EQ(b->max_over_mean, 100 / mean);
  EXPECT_DOUBLE_EQ(b->p99_over_mean, 1 / mean);
}

TEST(MeasureBalance, BadInputIsAnError) {
  std::vector<double> two = {1, 1}, three = {1, 1, 1}, zero_w = {1, 0}, zeros = {0, 0};
  EXPECT_THAT(MeasureBalance(two, three).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("same non-zero count")));
  EXPECT_THAT(MeasureBalance(two, zero_w).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight[1] is 0")));
  EXPECT_THAT(MeasureBalance(zeros, two).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("total load is 0")));
}

// A join moves exactly the keys the new node wins, and nothing between the old nodes.
TEST(Moved, RendezvousJoinMovesOnlyToTheNewNode) {
  const auto nodes = MakeNodes(10);
  const auto hashes = Hashes(20000);
  std::vector<daemon::PlacementNode> joined = nodes;
  joined.push_back({SimNodeId(10), 1.0});
  uint64_t won = 0;
  for (uint64_t h : hashes) won += daemon::HomeNode(joined, h) == 10;
  const Moved m = RendezvousMovedOnJoin(nodes, hashes);
  EXPECT_EQ(m.keys, 20000u);
  EXPECT_EQ(m.moved, won);
  EXPECT_EQ(m.moved_between_others, 0u);
  EXPECT_NEAR(m.fraction(), 1.0 / 11, 0.01);
}

// A leave of the first node shifts every other node's index; only its own keys may move.
TEST(Moved, RendezvousLeaveMovesOnlyTheLeaversKeys) {
  const auto nodes = MakeNodes(10);
  const auto hashes = Hashes(20000);
  uint64_t owned = 0;
  for (uint64_t h : hashes) owned += daemon::HomeNode(nodes, h) == 0;
  const Moved m = RendezvousMovedOnLeave(nodes, hashes, 0);
  EXPECT_EQ(m.moved, owned);
  EXPECT_EQ(m.moved_between_others, 0u);
  EXPECT_NEAR(m.fraction(), 1.0 / 10, 0.01);
}

TEST(Moved, ModuloMovesAlmostEverything) {
  const auto nodes = MakeNodes(10);
  const auto hashes = Hashes(20000);
  uint64_t differ = 0;
  for (uint64_t h : hashes) differ += h % 10 != h % 11;
  const Moved join = ModuloMovedOnJoin(nodes, hashes);
  EXPECT_EQ(join.moved, differ);
  EXPECT_NEAR(join.fraction(), 10.0 / 11, 0.01);
  EXPECT_GT(join.moved_between_others, join.moved / 2);
  // Without the last node the other nodes keep their indices: a key stays iff h % 10 == h % 9.
  uint64_t stay = 0;
  for (uint64_t h : hashes) stay += h % 10 == h % 9;
  const Moved leave = ModuloMovedOnLeave(nodes, hashes, 9);
  EXPECT_EQ(leave.moved, hashes.size() - stay);
}

TEST(Moved, WeightedJoinTakesItsWeightShare) {
  const auto nodes = MakeNodes(10);  // total weight 10
  const Moved m = RendezvousMovedOnJoin(nodes, Hashes(40000), 5.0);
  EXPECT_NEAR(m.fraction(), 5.0 / 15, 0.015);
  EXPECT_EQ(m.moved_between_others, 0u);
}

TEST(CheckMovedFraction, AcceptsWithinAndRejectsOutsideTolerance) {
  // p = 0.1 over 10,000 keys: expect 1,000 +- 30 per sigma.
  EXPECT_THAT(CheckMovedFraction({.keys = 10000, .moved = 1050}, 0.1, 4), IsOk());
  EXPECT_THAT(CheckMovedFraction({.keys = 10000, .moved = 1150}, 0.1, 4),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("1150 of 10000 keys moved")));
  EXPECT_THAT(CheckMovedFraction({.keys = 10000, .moved = 850}, 0.1, 4),
              StatusIs(absl::StatusCode::kOutOfRange, ::testing::_));
  EXPECT_THAT(CheckMovedFraction({.keys = 0, .moved = 0}, 0.1, 4),
              StatusIs(absl::StatusCode::kOutOfRange, ::testing::_));
}

}  // namespace
}  // namespace proxima::sim
