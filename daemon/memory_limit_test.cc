// ProcessMemoryLimit over trees of /proc and /sys files written as the kernel writes them
// (cgroup v2, v1, hybrid, containers that see only their own cgroup), the real system's, and
// the capacity check's message.
#include "daemon/memory_limit.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::daemon {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

class MemoryLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = std::filesystem::path(::testing::TempDir()) /
            ("memlimit-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    Write("proc/meminfo", "MemTotal:       16384000 kB\nMemFree:         1000 kB\n");
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  void Write(const std::string& path, const std::string& text) {
    const std::filesystem::path p = root_ / path;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  MemoryLimit Limit() { return ProcessMemoryLimit(root_.string()); }

  std::filesystem::path root_;
};

constexpr uint64_t kPhysical = uint64_t{16384000} * 1024;

TEST_F(MemoryLimitTest, PhysicalMemoryWithoutCgroupLimits) {
  Write("proc/self/cgroup", "0::/user.slice/session-1.scope\n");
  Write("sys/fs/cgroup/user.slice/session-1.scope/memory.max", "max\n");
  MemoryLimit m = Limit();
  EXPECT_EQ(m.bytes, kPhysical);
  EXPECT_THAT(m.source, HasSubstr("MemTotal"));
}

TEST_F(MemoryLimitTest, CgroupV2TakesTheSmallestLimitAlongThePath) {
  Write("proc/self/cgroup", "0::/kubepods/burstable/pod1/ctr\n");
  Write("sys/fs/cgroup/kubepods/burstable/pod1/ctr/memory.max", "max\n");
  Write("sys/fs/cgroup/kubepods/burstable/pod1/memory.max", "10737418240\n");  // the pod: 10 GiB
  Write("sys/fs/cgroup/kubepods/memory.max", "12884901888\n");
  MemoryLimit m = Limit();
  EXPECT_EQ(m.bytes, uint64_t{10} << 30);
  EXPECT_EQ(m.source, "cgroup v2 memory.max of /kubepods/burstable/pod1");
}

TEST_F(MemoryLimitTest, ContainerWithItsOwnCgroupNamespaceSeesItsLimitAtTheRoot) {
  Write("proc/self/cgroup", "0::/\n");
  Write("sys/fs/cgroup/memory.max", "4294967296\n");
  EXPECT_EQ(Limit().bytes, uint64_t{4} << 30);
}

TEST_F(MemoryLimitTest, CgroupV1HierarchyAndItsNoLimitValue) {
  // Hybrid, as on this build machine: v1 memory controller, v2 mounted without it.
  Write("proc/self/cgroup", "9:name=systemd:/\n4:cpu,memory:/docker/abc\n1:cpu:/\n0::/\n");
  Write("sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  Write("sys/fs/cgroup/memory/docker/memory.limit_in_bytes", "2147483648\n");
  Write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  MemoryLimit m = Limit();
  EXPECT_EQ(m.bytes, uint64_t{2} << 30);
  EXPECT_EQ(m.source, "cgroup v1 memory.limit_in_bytes of /docker");
}

TEST_F(MemoryLimitTest, ContainerWithoutNamespaceFindsItsLimitWalkingUp) {
  // /proc/self/cgroup names the host's path, but the container's own cgroup is mounted at the
  // root of /sys/fs/cgroup/memory: the walk up reaches it.
  Write("proc/self/cgroup", "5:memory:/docker/abc\n");
  Write("sys/fs/cgroup/memory/memory.limit_in_bytes", "1073741824\n");
  EXPECT_EQ(Limit().bytes, uint64_t{1} << 30);
}

TEST_F(MemoryLimitTest, MalformedOrMissingFilesImposeNothing) {
  Write("proc/self/cgroup", "garbage\n0::relative/path\n3:memory\n0::/a\n");
  Write("sys/fs/cgroup/a/memory.max", "lots\n");
  Write("sys/fs/cgroup/memory.max", "\n");
  EXPECT_EQ(Limit().bytes, kPhysical);
  std::filesystem::remove(root_ / "proc/meminfo");
  EXPECT_EQ(Limit().bytes, UINT64_MAX);  // nothing known: nothing refused
}

TEST(ProcessMemoryLimitTest, TheRealSystemsLimitIsAtMostItsPhysicalMemory) {
  const MemoryLimit m = ProcessMemoryLimit();
  const uint64_t physical =
      static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  EXPECT_GT(m.bytes, 0u);
  EXPECT_LE(m.bytes, physical);
  EXPECT_FALSE(m.source.empty());
}

TEST(CheckHostCapacityTest, RefusesACapacityAboveTheLimitNamingBoth) {
  const MemoryLimit limit{uint64_t{8} << 30, "cgroup v2 memory.max of /pod"};
  EXPECT_OK(CheckHostCapacity(uint64_t{8} << 30, limit));
  EXPECT_THAT(CheckHostCapacity(uint64_t{9} << 30, limit),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("tiers.host.capacity_bytes is 9663676416 bytes (9.0 GiB)"),
                             HasSubstr("at most 8589934592 bytes (8.0 GiB: cgroup v2 memory.max "
                                       "of /pod)"))));
}

}  // namespace
}  // namespace proxima::daemon
