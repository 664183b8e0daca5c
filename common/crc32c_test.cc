#include "common/crc32c.h"

#include <algorithm>
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

TEST(Crc32cTest, CombiningThePiecesOfASpanGivesTheWholeSpansCrc) {
  std::mt19937 rng(13);
  std::vector<std::byte> data(3u << 20);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  std::span<const std::byte> all(data);
  // Empty pieces, single bytes, odd sizes, and pieces longer than 2^20 (every bit of the length
  // up to the 22nd is exercised).
  for (size_t split :
       {size_t{0}, size_t{1}, size_t{4095}, size_t{1} << 20, data.size() - 1, data.size()}) {
    const uint64_t len_b = data.size() - split;
    EXPECT_EQ(Crc32cCombine(Crc32c(all.first(split)), Crc32c(all.subspan(split)), len_b),
              Crc32c(all))
        << split;
  }
  // Many pieces folded left to right, as a batch copied in parallel is.
  uint32_t folded = 0;
  for (size_t at = 0; at < data.size();) {
    const size_t len = std::min<size_t>(data.size() - at, 1 + rng() % (300u << 10));
    folded = Crc32cCombine(folded, Crc32c(all.subspan(at, len)), len);
    at += len;
  }
  EXPECT_EQ(folded, Crc32c(all));
  // Lengths past any buffer here: Combine(c, 0, n) shifts c by n zero bytes, and two shifts
  // compose, so shifting by 2^40 twice must equal shifting by 2^41 (and 3 * 2^40 + 5 is the
  // shift by 2^41 and by 2^40 + 5 in turn).
  const uint32_t c = Crc32c(all.first(100));
  const uint64_t t40 = uint64_t{1} << 40;
  EXPECT_EQ(Crc32cCombine(Crc32cCombine(c, 0, t40), 0, t40), Crc32cCombine(c, 0, 2 * t40));
  EXPECT_EQ(Crc32cCombine(Crc32cCombine(c, 0, 2 * t40), 0, t40 + 5),
            Crc32cCombine(c, 0, 3 * t40 + 5));
  EXPECT_NE(Crc32cCombine(c, 0, t40), c);
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
