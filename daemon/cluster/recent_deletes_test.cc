#include "daemon/cluster/recent_deletes.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace proxima::daemon::cluster {
namespace {

BlockId KeyId(uint32_t n) {
  BlockId id{0, 7, {}, 0};
  std::memcpy(id.key.data(), &n, sizeof(n));
  return id;
}

TEST(RecentDeletesTest, AKeyStaysForTheWindowAndADeleteAgainRenewsIt) {
  RecentDeletes recent(absl::Seconds(4), 100);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  const std::vector<BlockId> first = {KeyId(1), KeyId(2)};
  recent.Add(first, t0);
  EXPECT_TRUE(recent.Contains(KeyId(1), t0 + absl::Seconds(3)));
  EXPECT_FALSE(recent.Contains(KeyId(3), t0 + absl::Seconds(1)));
  const std::vector<BlockId> again = {KeyId(1)};
  recent.Add(again, t0 + absl::Seconds(3));
  EXPECT_FALSE(recent.Contains(KeyId(2), t0 + absl::Seconds(4)));
  EXPECT_TRUE(recent.Contains(KeyId(1), t0 + absl::Seconds(5)));  // renewed at t0 + 3
  const std::vector<BlockId> later = {KeyId(9)};
  recent.Add(later, t0 + absl::Seconds(6));  // trims 1's first entry, keeps its second
  EXPECT_TRUE(recent.Contains(KeyId(1), t0 + absl::Seconds(6)));
  EXPECT_EQ(recent.size(), 2u);
  recent.Add(later, t0 + absl::Seconds(8));
  EXPECT_FALSE(recent.Contains(KeyId(1), t0 + absl::Seconds(8)));
  EXPECT_EQ(recent.size(), 1u);
}

TEST(RecentDeletesTest, PastItsBoundTheOldestKeysLeaveFirst) {
  RecentDeletes recent(absl::Hours(1), 3);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (uint32_t n = 0; n < 5; ++n) {
    const std::vector<BlockId> one = {KeyId(n)};
    recent.Add(one, t0 + absl::Seconds(n));
  }
  EXPECT_EQ(recent.size(), 3u);
  EXPECT_FALSE(recent.Contains(KeyId(0), t0 + absl::Seconds(5)));
  EXPECT_FALSE(recent.Contains(KeyId(1), t0 + absl::Seconds(5)));
  EXPECT_TRUE(recent.Contains(KeyId(4), t0 + absl::Seconds(5)));
}

}  // namespace
}  // namespace proxima::daemon::cluster
