#include "daemon/host_tier.h"

#include <random>
#include <vector>

#include "common/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace proxima::daemon {
namespace {

TEST(HostTierTest, AllocatesUpToCapacityAndNeverBeyond) {
  ASSERT_OK_AND_ASSIGN(auto tier, HostTier::Create(1 << 20));
  std::vector<Extent> extents;
  while (auto e = tier->Allocate(1000)) extents.push_back(*e);
  EXPECT_EQ(extents.size(), (1u << 20) / 1024);  // 1000 rounds up to 1024
  EXPECT_EQ(tier->used_bytes(), 1u << 20);
  EXPECT_FALSE(tier->Allocate(1).has_value());
  for (const Extent& e : extents) tier->Free(e);
  EXPECT_EQ(tier->used_bytes(), 0u);
  EXPECT_EQ(tier->largest_free_bytes(), 1u << 20);  // everything coalesced back
}

TEST(HostTierTest, ExtentsDoNotOverlapAndHoldTheirBytes) {
  ASSERT_OK_AND_ASSIGN(auto tier, HostTier::Create(4 << 20));
  std::mt19937 rng(3);
  std::vector<std::pair<Extent, uint8_t>> live;
  for (int step = 0; step < 4000; ++step) {
    if (!live.empty() && (rng() % 3 == 0)) {
      size_t i = rng() % live.size();
      auto [e, fill] = live[i];
      for (std::byte b : tier->Bytes(e)) ASSERT_EQ(b, std::byte{fill});
      tier->Free(e);
      live.erase(live.begin() + i);
      continue;
    }
    uint64_t size = 1 + rng() % 60000;
    if (auto e = tier->Allocate(size)) {
      uint8_t fill = static_cast<uint8_t>(rng());
      std::memset(tier->Bytes(*e).data(), fill, e->size);
      EXPECT_EQ(e->offset % HostTier::kAlignment, 0u);
      EXPECT_GE(e->size, size);
      EXPECT_LE(e->offset + e->size, tier->capacity_bytes());
      live.emplace_back(*e, fill);
    }
    EXPECT_LE(tier->used_bytes(), tier->capacity_bytes());
  }
  for (auto& [e, fill] : live) tier->Free(e);
  EXPECT_EQ(tier->largest_free_bytes(), tier->capacity_bytes());
}

TEST(HostTierTest, RejectsCapacityBelowOneExtent) {
  EXPECT_THAT(HostTier::Create(10),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("10")));
}

}  // namespace
}  // namespace proxima::daemon
