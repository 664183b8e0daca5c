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
  recent.Add(first, 11, t0);
  EXPECT_EQ(recent.Last(KeyId(1), t0 + absl::Seconds(3)), 11u);
  EXPECT_EQ(recent.Last(KeyId(3), t0 + absl::Seconds(1)), 0u);
  const std::vector<BlockId> again = {KeyId(1)};
  recent.Add(again, 12, t0 + absl::Seconds(3));
  EXPECT_EQ(recent.Last(KeyId(2), t0 + absl::Seconds(4)), 0u);
  EXPECT_EQ(recent.Last(KeyId(1), t0 + absl::Seconds(5)), 12u);  // renewed at t0 + 3
  const std::vector<BlockId> later = {KeyId(9)};
  recent.Add(later, 13, t0 + absl::Seconds(6));  // trims 1's first entry, keeps its second
  EXPECT_EQ(recent.Last(KeyId(1), t0 + absl::Seconds(6)), 12u);
  EXPECT_EQ(recent.size(), 2u);
  recent.Add(later, 14, t0 + absl::Seconds(8));
  EXPECT_EQ(recent.Last(KeyId(1), t0 + absl::Seconds(8)), 0u);
  EXPECT_EQ(recent.size(), 1u);
}

TEST(RecentDeletesTest, PastItsBoundTheOldestKeysLeaveFirst) {
  RecentDeletes recent(absl::Hours(1), 3);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (uint32_t n = 0; n < 5; ++n) {
    const std::vector<BlockId> one = {KeyId(n)};
    recent.Add(one, 100 + n, t0 + absl::Seconds(n));
  }
  EXPECT_EQ(recent.size(), 3u);
  EXPECT_EQ(recent.Last(KeyId(0), t0 + absl::Seconds(5)), 0u);
  EXPECT_EQ(recent.Last(KeyId(1), t0 + absl::Seconds(5)), 0u);
  EXPECT_EQ(recent.Last(KeyId(4), t0 + absl::Seconds(5)), 104u);
}

// A copy is stale only against a Delete its sender had not seen: none seen here keeps it, the
// same last Delete keeps it (the copy was put after it), another one (or a sender that names
// none) declines it.
TEST(RecentDeletesTest, ACopyIsStaleOnlyAgainstADeleteItsSenderHadNotSeen) {
  RecentDeletes recent(absl::Seconds(4), 100);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  const absl::Duration any = absl::InfiniteDuration();  // a sender whose reach is not known
  EXPECT_FALSE(recent.Stale(KeyId(1), 0, any, t0));
  EXPECT_FALSE(recent.Stale(KeyId(1), 21, any, t0));
  const std::vector<BlockId> one = {KeyId(1)};
  recent.Add(one, 21, t0);
  EXPECT_FALSE(recent.Stale(KeyId(1), 21, any, t0 + absl::Seconds(1)));
  EXPECT_TRUE(recent.Stale(KeyId(1), 0, any, t0 + absl::Seconds(1)));
  EXPECT_TRUE(recent.Stale(KeyId(1), 20, any, t0 + absl::Seconds(1)));
  recent.Add(one, 22, t0 + absl::Seconds(2));  // deleted again: the sender saw only the first
  EXPECT_TRUE(recent.Stale(KeyId(1), 21, any, t0 + absl::Seconds(3)));
  EXPECT_FALSE(recent.Stale(KeyId(1), 0, any, t0 + absl::Seconds(7)));  // the window is over
}

// A sender that started after the Delete never saw it, and its copy is newer than it: kept. One
// that was up then (its memory reaches back past the Delete, give or take the slack) missed it:
// declined.
TEST(RecentDeletesTest, ADeleteFromBeforeTheSenderStartedDoesNotMakeItsCopyStale) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  RecentDeletes recent(absl::Seconds(60), 100, /*slack=*/absl::Seconds(2), t0);
  const std::vector<BlockId> one = {KeyId(1)};
  recent.Add(one, 31, t0 + absl::Seconds(10));
  const absl::Time now = t0 + absl::Seconds(30);                    // the Delete was 20 s ago
  EXPECT_FALSE(recent.Stale(KeyId(1), 0, absl::Seconds(5), now));   // up for 5 s
  EXPECT_FALSE(recent.Stale(KeyId(1), 0, absl::Seconds(17), now));  // 17 + 2 < 20
  EXPECT_TRUE(recent.Stale(KeyId(1), 0, absl::Seconds(18), now));   // within the slack
  EXPECT_TRUE(recent.Stale(KeyId(1), 0, absl::Seconds(60), now));
  EXPECT_FALSE(recent.Stale(KeyId(1), 31, absl::Seconds(60), now));  // it saw the Delete
  // This node's own reach: since its start, up to the window.
  EXPECT_EQ(recent.Reach(t0 + absl::Seconds(30)), absl::Seconds(30));
  EXPECT_EQ(recent.Reach(t0 + absl::Seconds(90)), absl::Seconds(60));
}

// A node that has just started takes in a peer's memory: each key's newer Delete (its own stays
// when newer), nothing malformed or past the window, and the peer's reach.
TEST(RecentDeletesTest, ANodeLearnsAPeersNewerDeletesAndHowFarBackItKnows) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  RecentDeletes recent(absl::Seconds(60), 100, absl::ZeroDuration(),
                       /*started=*/t0 + absl::Seconds(50));
  const std::vector<BlockId> one = {KeyId(1)};
  recent.Add(one, 5, t0 + absl::Seconds(50));
  const absl::Time now = t0 + absl::Seconds(55);
  EXPECT_EQ(recent.Reach(now), absl::Seconds(5));
  const std::vector<RecentDeletes::Noted> peer = {
      {KeyId(1), 4, absl::Seconds(20)},  // older than this node's own Delete of it
      {KeyId(2), 7, absl::Seconds(10)},
      {KeyId(3), 0, absl::Seconds(1)},   // no id
      {KeyId(4), 8, absl::Seconds(70)},  // past the window
  };
  recent.Learn(peer, absl::Seconds(40), now);
  EXPECT_EQ(recent.Last(KeyId(1), now), 5u);
  EXPECT_EQ(recent.Last(KeyId(2), now), 7u);
  EXPECT_EQ(recent.Last(KeyId(3), now), 0u);
  EXPECT_EQ(recent.Last(KeyId(4), now), 0u);
  EXPECT_EQ(recent.Reach(now), absl::Seconds(40));
  // Key 2's Delete keeps its age: it leaves 50 s after it was learned, not 60.
  EXPECT_EQ(recent.Last(KeyId(2), now + absl::Seconds(49)), 7u);
  EXPECT_EQ(recent.Last(KeyId(2), now + absl::Seconds(51)), 0u);
  const std::vector<RecentDeletes::Noted> snapshot = recent.Snapshot(now);
  ASSERT_EQ(snapshot.size(), 2u);
  for (const RecentDeletes::Noted& n : snapshot) {
    EXPECT_EQ(n.age, n.delete_id == 5 ? absl::Seconds(5) : absl::Seconds(10));
  }
}

// Two Deletes of a key sent again to a node that missed them go together and may arrive in
// either order: each is noted as of when it was made, and the later made stays the last.
TEST(RecentDeletesTest, ADeleteSentAgainArrivingAfterALaterOneDoesNotReplaceIt) {
  RecentDeletes recent(absl::Seconds(60), 100);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  const std::vector<BlockId> one = {KeyId(1)};
  recent.Add(one, 42, t0, /*age=*/absl::Seconds(1));  // made at t0 - 1 s
  recent.Add(one, 41, t0, /*age=*/absl::Seconds(3));  // made at t0 - 3 s, arrives after
  EXPECT_EQ(recent.Last(KeyId(1), t0), 42u);
  recent.Add(one, 43, t0 + absl::Seconds(1));  // a new Delete: the last
  EXPECT_EQ(recent.Last(KeyId(1), t0 + absl::Seconds(1)), 43u);
  // It leaves the window as of when it was made.
  const std::vector<BlockId> two = {KeyId(2)};
  recent.Add(two, 44, t0, /*age=*/absl::Seconds(50));
  EXPECT_EQ(recent.Last(KeyId(2), t0 + absl::Seconds(9)), 44u);
  EXPECT_EQ(recent.Last(KeyId(2), t0 + absl::Seconds(11)), 0u);
}

TEST(RecentDeletesTest, NewIdsAreNonZeroAndDistinct) {
  const uint64_t a = RecentDeletes::NewId();
  const uint64_t b = RecentDeletes::NewId();
  EXPECT_NE(a, 0u);
  EXPECT_NE(b, 0u);
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace proxima::daemon::cluster
