#include "kernels/device.h"

#include <numeric>
#include <vector>

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/internal/gpu_testing.h"

namespace proxima::gpu {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

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

TEST(DeviceBufferTest, WithoutADeviceAllocationIsRefusedWithTheReason) {
  std::string why;
  if (!VisibleDevices(&why).empty()) GTEST_SKIP() << "a CUDA device is visible";
  EXPECT_THAT(DeviceBuffer::Allocate(0, 1 << 20).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, Not(IsEmpty())));
  EXPECT_THAT(UseDevice(0), StatusIs(absl::StatusCode::kFailedPrecondition, Not(IsEmpty())));
}

// Label `gpu` (scripts/gpu-check.sh runs it on the GPU machine): skipped without a device.
TEST(DeviceBufferTest, BytesCopiedInComeBackOutAtTheirOffsets) {
  PROXIMA_SKIP_WITHOUT_GPU();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeviceBuffer> buffer, DeviceBuffer::Allocate(0, 1 << 20));
  EXPECT_EQ(buffer->device(), 0);
  EXPECT_EQ(buffer->size(), size_t{1} << 20);
  EXPECT_TRUE(IsDeviceMemory(buffer->data()));
  std::vector<std::byte> a(4096), b(100000);
  std::iota(reinterpret_cast<uint8_t*>(a.data()), reinterpret_cast<uint8_t*>(a.data()) + a.size(),
            uint8_t{1});
  for (size_t i = 0; i < b.size(); ++i) b[i] = std::byte(i * 7 + 3);
  ASSERT_OK(buffer->CopyIn(0, a));
  ASSERT_OK(buffer->CopyIn((1 << 20) - b.size(), b));
  std::vector<std::byte> a_out(a.size()), b_out(b.size());
  ASSERT_OK(buffer->CopyOut(0, a_out));
  ASSERT_OK(buffer->CopyOut((1 << 20) - b.size(), b_out));
  EXPECT_EQ(a_out, a);
  EXPECT_EQ(b_out, b);
}

TEST(DeviceBufferTest, RangesOutsideTheBufferAndUnknownDevicesAreRefused) {
  PROXIMA_SKIP_WITHOUT_GPU();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeviceBuffer> buffer, DeviceBuffer::Allocate(0, 4096));
  std::vector<std::byte> bytes(100);
  EXPECT_THAT(buffer->CopyIn(4000, bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("offset 4000")));
  EXPECT_THAT(buffer->CopyOut(uint64_t{1} << 40, bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("4096 bytes")));
  EXPECT_THAT(DeviceBuffer::Allocate(4096, 4096).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device 4096")));
  // More than the device has: the driver's refusal, named.
  const size_t too_much = VisibleDevices()[0].total_bytes * 2;
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> huge = DeviceBuffer::Allocate(0, too_much);
  EXPECT_THAT(huge.status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("cudaMalloc")));
}

}  // namespace
}  // namespace proxima::gpu
