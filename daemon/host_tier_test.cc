#include "daemon/host_tier.h"

#include <algorithm>
#include <cstring>
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

// Units of 4 KiB: [0 1 2 3 4 _ _ 7 8 _ 10 ... 15] with 5, 6 and 9 free.
std::vector<Extent> FragmentedTier(HostTier& tier) {
  std::vector<Extent> units;
  for (int i = 0; i < 16; ++i) units.push_back(*tier.Allocate(4096));
  for (int i : {5, 6, 9}) tier.Free(units[i]);
  return units;
}

TEST(HostTierTest, FindWindowPicksTheWindowWithTheFewestBytesToMove) {
  ASSERT_OK_AND_ASSIGN(auto tier, HostTier::Create(16 * 4096));
  std::vector<Extent> units = FragmentedTier(*tier);
  EXPECT_FALSE(tier->FindWindow(4096).has_value());      // a free region fits: no window
  EXPECT_FALSE(tier->FindWindow(4 * 4096).has_value());  // only 3 units free in all
  std::optional<HostTier::Window> w = tier->FindWindow(3 * 4096);
  ASSERT_TRUE(w.has_value());
  // [5, 8) or [4, 7) hold one unit to move; [9, 12) would hold two.
  EXPECT_EQ(w->occupied_bytes, 4096u);
  ASSERT_EQ(w->occupied.size(), 1u);
  EXPECT_TRUE(w->range.offset == 5 * 4096 || w->range.offset == 4 * 4096) << w->range.offset;
  EXPECT_EQ(w->range.size, 3 * 4096u);
}

// Enough free bytes outside a window is not enough: each of its extents needs a free region of
// its own size. The cheapest window here holds one 2-unit extent, and only single units are free
// elsewhere; emptying it would move nothing and give up (before 2026-12-01 it was chosen, and
// the put that asked copied blocks for nothing). A window of three single units is taken instead.
TEST(HostTierTest, FindWindowSkipsAWindowWhoseExtentsFitNowhereOutsideIt) {
  constexpr uint64_t kUnit = 4096;
  ASSERT_OK_AND_ASSIGN(auto tier, HostTier::Create(16 * kUnit));
  // Units: [_ X X _ 4 5 6 7 8 _ 10 11 12 _ 14 15], X one extent of two units.
  std::vector<Extent> units(16);
  units[0] = *tier->Allocate(kUnit);
  const Extent x = *tier->Allocate(2 * kUnit);
  ASSERT_EQ(x.offset, kUnit);
  for (int i = 3; i < 16; ++i) units[i] = *tier->Allocate(kUnit);
  for (int i : {0, 3, 9, 13}) tier->Free(units[i]);
  std::optional<HostTier::Window> w = tier->FindWindow(4 * kUnit);
  ASSERT_TRUE(w.has_value());
  EXPECT_GE(w->range.offset, x.offset + x.size);  // not one that holds X
  EXPECT_EQ(w->occupied_bytes, 3 * kUnit);
  ASSERT_EQ(w->occupied.size(), 3u);
  // And it can be emptied: each occupant finds a free unit outside the claimed window.
  tier->BeginClaim(w->range);
  for (const Extent& o : w->occupied) {
    EXPECT_EQ(o.size, kUnit);
    std::optional<Extent> moved = tier->Allocate(o.size);
    ASSERT_TRUE(moved.has_value());
    EXPECT_TRUE(moved->offset + moved->size <= w->range.offset ||
                moved->offset >= w->range.offset + w->range.size);
    tier->Free(o);
  }
  std::optional<Extent> window = tier->EndClaim();
  ASSERT_TRUE(window.has_value());
  EXPECT_EQ(window->size, 4 * kUnit);
  // With X's only way out taken too, no window can be emptied: none is offered.
  ASSERT_OK_AND_ASSIGN(auto small, HostTier::Create(6 * kUnit));
  // Units: [_ X X _ 4 5]
  const Extent a = *small->Allocate(kUnit);
  ASSERT_TRUE(small->Allocate(2 * kUnit).has_value());
  const Extent b = *small->Allocate(kUnit);
  ASSERT_TRUE(small->Allocate(2 * kUnit).has_value());
  small->Free(a);
  small->Free(b);
  EXPECT_FALSE(small->FindWindow(2 * kUnit).has_value());
}

TEST(HostTierTest, AClaimTakesTheWindowsFreeSpaceAndWhatIsFreedIntoIt) {
  ASSERT_OK_AND_ASSIGN(auto tier, HostTier::Create(16 * 4096));
  std::vector<Extent> units = FragmentedTier(*tier);
  std::memset(tier->arena().data(), 0x5a, tier->capacity_bytes());
  std::optional<HostTier::Window> w = tier->FindWindow(3 * 4096);
  ASSERT_TRUE(w.has_value());
  tier->BeginClaim(w->range);
  EXPECT_EQ(tier->used_bytes(), 15 * 4096u);  // the two free units in the window are claimed
  // Allocations meanwhile never land in the window: only unit 9 is free outside it.
  std::optional<Extent> moved = tier->Allocate(4096);
  ASSERT_TRUE(moved.has_value());
  EXPECT_EQ(moved->offset, 9 * 4096u);
  EXPECT_FALSE(tier->Allocate(4096).has_value());
  tier->Free(w->occupied[0]);  // the occupant "moved": its unit joins the claim
  std::optional<Extent> window = tier->EndClaim();
  ASSERT_TRUE(window.has_value());
  EXPECT_EQ(window->offset, w->range.offset);
  EXPECT_EQ(window->size, 3 * 4096u);
  EXPECT_EQ(tier->used_bytes(), tier->capacity_bytes());
  // Every extent frees back to one region.
  tier->Free(*window);
  tier->Free(*moved);
  for (size_t i = 0; i < units.size(); ++i) {
    const uint64_t o = units[i].offset;
    if (i == 9 || (o >= window->offset && o < window->offset + window->size)) continue;
    tier->Free(units[i]);
  }
  EXPECT_EQ(tier->used_bytes(), 0u);
  EXPECT_EQ(tier->largest_free_bytes(), tier->capacity_bytes());
}

TEST(HostTierTest, AnIncompleteClaimGivesItsPartsBack) {
  ASSERT_OK_AND_ASSIGN(auto tier, HostTier::Create(16 * 4096));
  FragmentedTier(*tier);
  std::optional<HostTier::Window> w = tier->FindWindow(3 * 4096);
  ASSERT_TRUE(w.has_value());
  tier->BeginClaim(w->range);
  EXPECT_FALSE(tier->EndClaim().has_value());  // the occupant never left
  EXPECT_EQ(tier->used_bytes(), 13 * 4096u);
  EXPECT_EQ(tier->largest_free_bytes(), 2 * 4096u);
  EXPECT_TRUE(tier->FindWindow(3 * 4096).has_value());  // and can be found again
}

// Random allocations and frees, with a compaction whenever a large allocation finds no region:
// extents never overlap, bytes of extents that did not move never change, used bytes add up.
TEST(HostTierTest, CompactionsAmidRandomTrafficKeepEveryExtentIntact) {
  ASSERT_OK_AND_ASSIGN(auto tier, HostTier::Create(1 << 20));
  std::mt19937 rng(11);
  struct Live {
    Extent e;
    uint8_t fill;
  };
  std::vector<Live> live;
  auto check = [&](const Live& l) {
    for (std::byte b : tier->Bytes(l.e)) ASSERT_EQ(b, std::byte{l.fill});
  };
  int compactions = 0;
  for (int step = 0; step < 3000; ++step) {
    if (!live.empty() && rng() % 3 == 0) {  // fills up, then churns
      size_t i = rng() % live.size();
      check(live[i]);
      tier->Free(live[i].e);
      live.erase(live.begin() + i);
      continue;
    }
    const uint64_t size = 64 * (1 + rng() % 512);  // 64 B .. 32 KiB
    std::optional<Extent> e = tier->Allocate(size);
    if (!e) {
      std::optional<HostTier::Window> w = tier->FindWindow(size);
      if (!w) continue;
      tier->BeginClaim(w->range);
      bool all_moved = true;
      for (const Extent& o : w->occupied) {
        auto it = std::find_if(live.begin(), live.end(),
                               [&](const Live& l) { return l.e.offset == o.offset; });
        ASSERT_NE(it, live.end());
        std::optional<Extent> to = tier->Allocate(o.size);
        if (!to) {
          all_moved = false;
          break;
        }
        ASSERT_TRUE(to->offset + to->size <= w->range.offset ||
                    to->offset >= w->range.offset + w->range.size);
        check(*it);
        std::memcpy(tier->Bytes(*to).data(), tier->Bytes(o).data(), o.size);
        tier->Free(o);
        it->e = *to;
      }
      e = tier->EndClaim();
      ASSERT_EQ(e.has_value(), all_moved);
      if (!e) continue;
      ++compactions;
    }
    Live l{*e, static_cast<uint8_t>(rng())};
    std::memset(tier->Bytes(l.e).data(), l.fill, l.e.size);
    live.push_back(l);
    uint64_t used = 0;
    for (const Live& x : live) used += x.e.size;
    ASSERT_EQ(tier->used_bytes(), used);
  }
  EXPECT_GT(compactions, 0);
  for (const Live& l : live) {
    check(l);
    tier->Free(l.e);
  }
  EXPECT_EQ(tier->largest_free_bytes(), tier->capacity_bytes());
}

TEST(HostTierTest, RejectsCapacityBelowOneExtent) {
  EXPECT_THAT(HostTier::Create(10),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("10")));
}

}  // namespace
}  // namespace proxima::daemon
