#include "kernels/device.h"

#include "gtest/gtest.h"

namespace proxima::gpu {
namespace {

TEST(DeviceTest, EmptyListAlwaysComesWithAReason) {
  std::string why;
  std::vector<DeviceInfo> devices = VisibleDevices(&why);
  if (devices.empty()) {
    EXPECT_FALSE(why.empty());
  } else {
    for (const DeviceInfo& d : devices) {
      EXPECT_GT(d.total_bytes, 0u);
      EXPECT_GE(d.compute_capability, 50);
    }
  }
  if (!BuiltWithCuda()) {
    EXPECT_TRUE(devices.empty());
  }
}

}  // namespace
}  // namespace proxima::gpu
