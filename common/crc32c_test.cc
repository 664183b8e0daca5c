#include "common/crc32c.h"

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace proxima {
namespace {

std::span<const std::byte> Bytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

TEST(Crc32cTest, MatchesPublishedCheckValues) {
  // RFC 3720 (iSCSI) appendix B.4 and the standard "123456789" check value.
  EXPECT_EQ(Crc32c(Bytes("123456789")), 0xE3069283u);
  EXPECT_EQ(Crc32c(Bytes(std::string(32, '\0'))), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(Bytes(std::string(32, '\xFF'))), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(Bytes("")), 0u);
}

TEST(Crc32cTest, ExtendEqualsWholeAndHardwareEqualsPortable) {
  std::mt19937 rng(7);
  for (size_t len : {1u, 7u, 8u, 9u, 63u, 4096u, 100003u}) {
    std::vector<std::byte> data(len);
    for (auto& b : data) b = static_cast<std::byte>(rng());
    std::span<const std::byte> all(data);
    uint32_t whole = Crc32c(all);
    for (size_t split : {size_t{0}, len / 3, len}) {
      EXPECT_EQ(Crc32cExtend(Crc32c(all.first(split)), all.subspan(split)), whole) << len;
    }
    EXPECT_EQ(Crc32cExtendPortable(0, all), whole) << len;
  }
}

TEST(Crc32cTest, InterleavedLanesAndCopyMatchTheScalarDefinition) {
  std::mt19937 rng(11);
  for (size_t len : {24575u, 24576u, 24577u, 49152u + 13u, 2u << 20}) {
    std::vector<std::byte> data(len), copy(len);
    for (auto& b : data) b = static_cast<std::byte>(rng());
    uint32_t expected = Crc32cExtendPortable(0, data);
    EXPECT_EQ(Crc32c(data), expected) << len;
    EXPECT_EQ(Crc32cExtend(0x12345678, data), Crc32cExtendPortable(0x12345678, data)) << len;
    EXPECT_EQ(Crc32cCopy(copy, data), expected) << len;
    EXPECT_EQ(copy, data);
  }
}

// Which path the tests above compared with the portable one (the aarch64 build runs under qemu,
// whose CPU has the CRC32 extension).
TEST(Crc32cTest, ReportsItsPath) {
  std::printf("crc32c path: %s\n", Crc32cIsHardwareAccelerated() ? "hardware" : "portable");
#if defined(__x86_64__) || defined(__aarch64__)
  if (std::getenv("PROXIMA_EXPECT_HW_CRC32C") != nullptr) {
    EXPECT_TRUE(Crc32cIsHardwareAccelerated());
  }
#endif
}

TEST(Crc32cTest, DetectsSingleBitFlip) {
  std::vector<std::byte> data(1 << 16, std::byte{0x5A});
  uint32_t before = Crc32c(data);
  data[12345] ^= std::byte{0x04};
  EXPECT_NE(Crc32c(data), before);
}

}  // namespace
}  // namespace proxima
