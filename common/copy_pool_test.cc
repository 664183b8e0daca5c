#include "common/copy_pool.h"

#include <random>
#include <thread>
#include <vector>

#include "common/crc32c.h"
#include "gtest/gtest.h"

namespace proxima {
namespace {

std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// Cuts [0, src.size()) into pieces of the given sizes (cycled), every other one checksummed.
std::vector<CopyPiece> Cut(std::vector<std::byte>& dst, const std::vector<std::byte>& src,
                           const std::vector<size_t>& sizes) {
  std::vector<CopyPiece> pieces;
  for (size_t at = 0, i = 0; at < src.size(); ++i) {
    const size_t len = std::min(sizes[i % sizes.size()], src.size() - at);
    pieces.push_back(CopyPiece{dst.data() + at, src.data() + at, len, i % 2 == 0});
    at += len;
  }
  return pieces;
}

void ExpectCopied(const std::vector<CopyPiece>& pieces, const std::vector<std::byte>& dst,
                  const std::vector<std::byte>& src) {
  ASSERT_EQ(dst, src);
  for (const CopyPiece& p : pieces) {
    if (p.checksum) {
      EXPECT_EQ(p.crc, Crc32c(std::span<const std::byte>(p.src, p.size)));
    }
  }
}

TEST(CopyPoolTest, CopiesAndChecksumsEveryPieceWithAndWithoutHelpers) {
  const std::vector<std::byte> src = RandomBytes((5u << 20) + 333, 1);
  for (int helpers : {0, 1, 3}) {
    CopyPool pool(helpers);
    EXPECT_EQ(pool.helpers(), helpers);
    for (const std::vector<size_t>& sizes :
         {std::vector<size_t>{256u << 10}, std::vector<size_t>{1, 4095, 1u << 20, 0, 77}}) {
      std::vector<std::byte> dst(src.size());
      std::vector<CopyPiece> pieces = Cut(dst, src, sizes);
      pool.Run(pieces);
      ExpectCopied(pieces, dst, src);
    }
    if (helpers == 0) {
      EXPECT_EQ(pool.pieces_by_helpers(), 0u);
    }
  }
  CopyPool pool(1);
  pool.Run({});  // an empty batch returns at once
}

TEST(CopyPoolTest, IdleHelpersTakeAShareOfABatch) {
  // The point of the pool: the caller does not copy alone. A helper wakes in microseconds and a
  // batch of 64 pieces of 256 KiB takes about a millisecond, so it takes pieces in the first
  // batches on any machine; up to 100 batches leave room for a loaded one.
  const std::vector<std::byte> src = RandomBytes(16u << 20, 2);
  std::vector<std::byte> dst(src.size());
  CopyPool pool(1);
  for (int round = 0; round < 100 && pool.pieces_by_helpers() == 0; ++round) {
    std::vector<CopyPiece> pieces = Cut(dst, src, {256u << 10});
    pool.Run(pieces);
    ExpectCopied(pieces, dst, src);
  }
  EXPECT_GT(pool.pieces_by_helpers(), 0u);
}

TEST(CopyPoolTest, ManyCallersShareTheHelpers) {
  // More callers than helpers, each with its own batches: every batch completes, exactly.
  CopyPool pool(2);
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int c = 0; c < 6; ++c) {
    callers.emplace_back([&pool, &bad, c] {
      const std::vector<std::byte> src = RandomBytes((1u << 20) + 17 * c, 10 + c);
      for (int round = 0; round < 30; ++round) {
        std::vector<std::byte> dst(src.size());
        std::vector<CopyPiece> pieces = Cut(dst, src, {64u << 10, 3, 100000});
        pool.Run(pieces);
        if (dst != src) ++bad;
        for (const CopyPiece& p : pieces) {
          if (p.checksum && p.crc != Crc32c(std::span<const std::byte>(p.src, p.size))) ++bad;
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(CopyPoolTest, AutoMeansOneFewerThanTheCoresAtMostThree) {
  EXPECT_EQ(CopyPool::HelpersFor(0), 0);
  EXPECT_EQ(CopyPool::HelpersFor(5), 5);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(CopyPool::HelpersFor(-1), std::clamp(cores - 1, 0, 3));
}

}  // namespace
}  // namespace proxima
