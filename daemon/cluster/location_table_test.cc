#include "daemon/cluster/location_table.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::daemon::cluster {
namespace {

using ::testing::ElementsAre;

BlockId Id(uint8_t k, uint32_t ns = 0, uint32_t partition = 0) {
  BlockId id;
  id.namespace_index = ns;
  id.partition = partition;
  id.profile_id = 7;
  id.key[0] = k;
  return id;
}

TEST(LocationTableTest, RecordsFindForgetAndDropByHolder) {
  LocationTable t(100);
  std::vector<BlockId> ab = {Id(1), Id(2)};
  t.Record(ab, "10.0.0.1:50051");
  std::vector<BlockId> c = {Id(3)};
  t.Record(c, "10.0.0.2:50051");
  std::vector<BlockId> all = {Id(1), Id(2), Id(3), Id(4), Id(1, 1), Id(1, 0, 1)};
  EXPECT_THAT(t.Find(all), ElementsAre("10.0.0.1:50051", "10.0.0.1:50051", "10.0.0.2:50051", "",
                                       "", ""));  // another namespace or partition: no record
  // Forget drops only records naming that holder.
  std::vector<BlockId> one_and_three = {Id(1), Id(3)};
  EXPECT_EQ(t.Forget(one_and_three, "10.0.0.1:50051"), 1u);
  EXPECT_THAT(t.Find(all), ElementsAre("", "10.0.0.1:50051", "10.0.0.2:50051", "", "", ""));
  // A newer record replaces an older one.
  t.Record(c, "10.0.0.1:50051");
  EXPECT_EQ(t.DropHolder("10.0.0.1:50051"), 2u);
  EXPECT_EQ(t.size(), 0u);
  EXPECT_EQ(t.DropHolder("never-seen:1"), 0u);
}

TEST(LocationTableTest, StaysWithinItsBound) {
  LocationTable t(10);
  std::vector<BlockId> ids;
  for (uint8_t k = 0; k < 25; ++k) ids.push_back(Id(k));
  t.Record(ids, "h:1");
  EXPECT_EQ(t.size(), 10u);
  EXPECT_EQ(t.overflows(), 15u);
}

}  // namespace
}  // namespace proxima::daemon::cluster
