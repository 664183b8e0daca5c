#include "tools/sim/hops_sim.h"

#include <set>
#include <vector>

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/sim/placement_sim.h"

namespace proxima::sim {
namespace {

using ::proxima::testing::IsOk;
using ::proxima::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

replay::TraceRequest Request(std::vector<uint64_t> ids) {
  replay::TraceRequest r;
  r.hash_ids = std::move(ids);
  return r;
}

// The first trace id at or after `from` whose home (namespace "default") is `home`.
uint64_t IdWithHome(const std::vector<daemon::PlacementNode>& nodes, size_t home,
                    uint64_t from = 0) {
  for (uint64_t id = from;; ++id) {
    if (daemon::HomeNode(nodes, TraceBlockHash("default", id)) == home) return id;
  }
}

TEST(Routing, NamesRoundTrip) {
  for (Routing r : {Routing::kRoundRobin, Routing::kPrefixFamily}) {
    auto parsed = ParseRouting(RoutingName(r));
    ASSERT_THAT(parsed.status(), IsOk());
    EXPECT_EQ(*parsed, r);
  }
  EXPECT_THAT(ParseRouting("random").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'random' is unknown")));
}

TEST(WorkerNode, RoundRobinAndPrefixFamily) {
  EXPECT_EQ(WorkerNode(Request({0, 1}), 7, 3, Routing::kRoundRobin), 1u);
  // Same second id: same node, whatever the first id and the tail.
  const size_t a = WorkerNode(Request({0, 42, 43}), 0, 16, Routing::kPrefixFamily);
  EXPECT_EQ(WorkerNode(Request({0, 42, 99, 100}), 5, 16, Routing::kPrefixFamily), a);
  EXPECT_EQ(WorkerNode(Request({42}), 9, 16, Routing::kPrefixFamily), a);  // one id: the first
  // Families spread over every node.
  std::set<size_t> used;
  for (uint64_t f = 0; f < 200; ++f) {
    used.insert(WorkerNode(Request({0, f}), 0, 8, Routing::kPrefixFamily));
  }
  EXPECT_EQ(used.size(), 8u);
}

// Block x has home 2 and is produced on node 0; then nodes 1, 2 and 0 read it.
TEST(SimulateHops, ReadHopsFollowHolderAndHome) {
  const auto nodes = MakeNodes(3);
  const uint64_t x = IdWithHome(nodes, 2);
  std::vector<replay::TraceRequest> requests(4, Request({x}));  // round robin: 0, 1, 2, 0
  auto r = SimulateHops(nodes, requests, {});
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->misses, 1u);
  EXPECT_THAT(r->miss_locate_hops, ElementsAre(0u, 1u));  // node 0 asked home 2
  EXPECT_EQ(r->hits, 3u);
  // node 1: record on 2, bytes on 0 -> 2; node 2: record local -> 1; node 0: local -> 0.
  EXPECT_THAT(r->read_hops, ElementsAre(1u, 1u, 1u));
  EXPECT_THAT(r->locate_hops, ElementsAre(2u, 1u));
  EXPECT_DOUBLE_EQ(r->mean_read_hops(), 1.0);
  // Put at home: nodes 1 and 0 read remotely, node 2 locally.
  EXPECT_EQ(r->baseline_remote_hits, 2u);
  EXPECT_DOUBLE_EQ(r->baseline_mean_read_hops(), 2.0 / 3);
}

// Block y is produced on its home node 0: any other node reads it in one hop.
TEST(SimulateHops, HomeHoldingTheBlockIsOneHop) {
  const auto nodes = MakeNodes(3);
  const uint64_t y = IdWithHome(nodes, 0);
  std::vector<replay::TraceRequest> requests(3, Request({y}));
  auto r = SimulateHops(nodes, requests, {});
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_THAT(r->miss_locate_hops, ElementsAre(1u, 0u));
  EXPECT_THAT(r->read_hops, ElementsAre(0u, 2u, 0u));
  EXPECT_THAT(r->locate_hops, ElementsAre(0u, 2u));
}

// Two nodes of one block each, spilling to one candidate.
TEST(SimulateHops, FullNodeSpillsItsColdBlockThenEvicts) {
  const auto nodes = MakeNodes(2);
  HopsOptions options;
  options.capacity_blocks = 1;
  options.spill_candidates = 1;
  std::vector<replay::TraceRequest> requests = {
      Request({100, 101}),  // node 0: 100 stored, then 101 spills 100 to node 1
      Request({100}),       // node 1: local hit on the spilled block
      Request({102}),       // node 0: full, node 1 full too: 101 is evicted
      Request({101}),       // node 1: miss; its only block (100) is a guest: evicted
  };
  auto r = SimulateHops(nodes, requests, options);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->spills, 1u);
  EXPECT_EQ(r->evictions, 2u);
  EXPECT_EQ(r->hits, 1u);
  EXPECT_EQ(r->hits_on_spilled, 1u);
  EXPECT_THAT(r->read_hops, ElementsAre(1u, 0u, 0u));
  EXPECT_EQ(r->misses, 4u);
  EXPECT_EQ(r->puts, 4u);

  options.spill_candidates = 0;  // never spill: 100 is evicted and node 1 misses it
  r = SimulateHops(nodes, {requests[0], requests[1]}, options);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->spills, 0u);
  EXPECT_EQ(r->evictions, 1u);
  EXPECT_EQ(r->hits, 0u);
}

TEST(SimulateHops, EvictsTheLeastRecentlyUsed) {
  const auto nodes = MakeNodes(1, 1.0);
  HopsOptions options;
  options.capacity_blocks = 2;
  // 1 and 2 stored; 1 read again; 3 evicts 2 (not 1); 1 hits; 2 misses (evicting 3).
  auto r = SimulateHops(
      nodes, {Request({1, 2}), Request({1}), Request({3}), Request({1}), Request({2})}, options);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->hits, 2u);
  EXPECT_EQ(r->misses, 4u);
  EXPECT_EQ(r->evictions, 2u);
  EXPECT_EQ(r->spills, 0u);  // one node: nowhere to spill
}

TEST(SimulateHops, OneNodeReadsEverythingLocally) {
  auto r = SimulateHops(MakeNodes(1), {Request({1, 2}), Request({1, 2, 3})}, {});
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->block_refs, 5u);
  EXPECT_EQ(r->hits, 2u);
  EXPECT_DOUBLE_EQ(r->hit_ratio(), 0.4);
  EXPECT_THAT(r->read_hops, ElementsAre(2u, 0u, 0u));
  EXPECT_DOUBLE_EQ(r->mean_read_hops(), 0);
}

TEST(SimulateHops, BadInputIsAnError) {
  EXPECT_THAT(SimulateHops({}, {Request({1})}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no nodes")));
  std::vector<daemon::PlacementNode> zero = {{"a", 1.0}, {"b", 0.0}};
  EXPECT_THAT(SimulateHops(zero, {Request({1})}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node 1 (b) has weight 0")));
  EXPECT_THAT(SimulateHops(MakeNodes(2), {Request({})}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("request 0 has no hash_ids")));
}

}  // namespace
}  // namespace proxima::sim
