#include "tools/replay/policy_sim.h"

#include <random>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::replay {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::HasSubstr;

std::unique_ptr<CachePolicy> Make(const std::string& name, size_t capacity) {
  auto policy = MakeCachePolicy(name, capacity);
  EXPECT_TRUE(policy.ok()) << policy.status();
  return *std::move(policy);
}

TEST(CachePolicy, UnknownNamesAndZeroCapacityAreErrors) {
  EXPECT_THAT(MakeCachePolicy("clock", 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown cache policy \"clock\"; expected one of lru, fifo")));
  EXPECT_THAT(MakeCachePolicy("slru:2", 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("slru protected share \"2\" is not a number in (0, 1)")));
  EXPECT_OK(MakeCachePolicy("slru:0.5", 10).status());
  EXPECT_THAT(MakeCachePolicy("lru", 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least 1 block")));
}

TEST(CachePolicy, LruEvictsTheLeastRecentlyUsedAndFifoTheOldest) {
  for (const std::string name : {"lru", "fifo"}) {
    auto cache = Make(name, 2);
    cache->Insert(1);
    cache->Insert(2);
    cache->Touch(1);
    cache->Insert(3);
    EXPECT_EQ(cache->evictions(), 1u) << name;
    EXPECT_TRUE(cache->Contains(3)) << name;
    EXPECT_EQ(cache->Contains(1), name == "lru") << name;
    EXPECT_EQ(cache->Contains(2), name == "fifo") << name;
  }
}

// Ten blocks, five of them used again, then a scan of 100 blocks used once: S3-FIFO and ARC keep
// the five that were used twice; LRU loses them to the scan.
TEST(CachePolicy, S3FifoAndArcKeepReusedBlocksThroughAScan) {
  for (const std::string name : {"lru", "s3fifo", "arc"}) {
    auto cache = Make(name, 10);
    for (uint64_t id = 1; id <= 10; ++id) cache->Insert(id);
    for (uint64_t id = 1; id <= 5; ++id) cache->Touch(id);
    for (uint64_t id = 100; id < 200; ++id) cache->Insert(id);
    for (uint64_t id = 1; id <= 5; ++id) {
      EXPECT_EQ(cache->Contains(id), name != "lru") << name << " block " << id;
    }
    EXPECT_EQ(cache->size(), 10u) << name;
  }
}

// S3-FIFO remembers what its small queue evicted: such a block, put again soon, goes straight to
// the main queue and then survives a scan of new blocks.
TEST(CachePolicy, S3FifoAdmitsARecentlyEvictedBlockToItsMainQueue) {
  auto cache = Make("s3fifo", 10);
  for (uint64_t id = 1; id <= 10; ++id) cache->Insert(id);
  cache->Insert(11);  // evicts block 1 from the small queue (never used) into the ghost
  ASSERT_FALSE(cache->Contains(1));
  cache->Insert(1);  // remembered: main queue
  for (uint64_t id = 100; id < 130; ++id) cache->Insert(id);
  EXPECT_TRUE(cache->Contains(1));
  EXPECT_FALSE(cache->Contains(2));
}

// No policy ever holds more than its capacity, and a block just inserted is present.
TEST(CachePolicy, NeverExceedsCapacityOnRandomTraffic) {
  for (const std::string& name : CachePolicyNames()) {
    for (size_t capacity : {1, 7, 64}) {
      auto cache = Make(name, capacity);
      std::mt19937_64 rng(capacity);
      uint64_t inserts = 0;
      for (int i = 0; i < 20000; ++i) {
        const uint64_t id = rng() % (capacity * 4);
        if (cache->Contains(id)) {
          cache->Touch(id);
        } else {
          cache->Insert(id);
          ++inserts;
          ASSERT_TRUE(cache->Contains(id)) << name << " " << capacity;
        }
        ASSERT_LE(cache->size(), capacity) << name << " " << capacity;
      }
      EXPECT_EQ(cache->size() + cache->evictions(), inserts) << name << " " << capacity;
    }
  }
}

std::vector<TraceRequest> Requests(std::vector<std::vector<uint64_t>> chains) {
  std::vector<TraceRequest> requests;
  for (auto& chain : chains) requests.push_back({.hash_ids = std::move(chain)});
  return requests;
}

TEST(Simulate, CountsLeadingHitsAndPutsAsTheReplayDoes) {
  auto cache = Make("lru", 10);
  // Second request: 0 and 1 lead (2 hits), 3 is new. Third: 0 leads, 4 is new. Fourth: 9 is new,
  // so 1 (present) counts as already present and not as a hit.
  SimulatedCounts c = Simulate(Requests({{0, 1, 2}, {0, 1, 3}, {0, 4}, {9, 1}}), *cache);
  EXPECT_EQ(c.requests, 4u);
  EXPECT_EQ(c.block_refs, 10u);
  EXPECT_EQ(c.hits, 3u);
  EXPECT_EQ(c.puts_stored, 6u);
  EXPECT_EQ(c.puts_already_present, 1u);
  EXPECT_EQ(c.evictions, 0u);
  EXPECT_EQ(c.held, 6u);
  EXPECT_DOUBLE_EQ(c.hit_ratio(), 0.3);
}

// With the chain's head touched last, LRU evicts the end of a chain instead of its head, so the
// chain keeps its leading hits.
TEST(Simulate, HeadLastOrderKeepsTheLeadingBlocksOfAChain) {
  const auto requests = Requests({{0, 1, 2}, {5}, {0, 1, 2}});
  auto in_order = Make("lru", 3);
  EXPECT_EQ(Simulate(requests, *in_order, TouchOrder::kChainOrder).hits, 0u);
  auto head_last = Make("lru", 3);
  EXPECT_EQ(Simulate(requests, *head_last, TouchOrder::kChainHeadLast).hits, 2u);
}

}  // namespace
}  // namespace proxima::replay
