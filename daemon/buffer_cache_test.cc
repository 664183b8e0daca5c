#include "daemon/buffer_cache.h"

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace proxima::daemon {
namespace {

TEST(BufferCacheTest, ABufferGivenBackIsTheOneTheNextTakeOfItsSizeGets) {
  BufferCache cache(1 << 20);
  std::byte* first = nullptr;
  {
    std::shared_ptr<std::byte[]> a = cache.Take(4096);
    first = a.get();
    std::memset(a.get(), 0x5A, 4096);
    EXPECT_EQ(cache.kept_bytes(), 0u);
  }
  EXPECT_EQ(cache.kept_bytes(), 4096u);
  std::shared_ptr<std::byte[]> b = cache.Take(4096);
  EXPECT_EQ(b.get(), first);
  EXPECT_EQ(cache.kept_bytes(), 0u);
  EXPECT_EQ(cache.reused(), 1u);
  EXPECT_EQ(cache.allocated(), 1u);
  // Another size is never handed a kept buffer of the wrong size.
  std::shared_ptr<std::byte[]> c = cache.Take(8192);
  EXPECT_NE(c.get(), first);
  EXPECT_EQ(cache.allocated(), 2u);
}

TEST(BufferCacheTest, KeepsNoMoreThanItsCapAndMakesRoomFromOtherSizes) {
  BufferCache cache(3 * 1000);
  {
    std::vector<std::shared_ptr<std::byte[]>> out;
    for (int i = 0; i < 5; ++i) out.push_back(cache.Take(1000));
  }
  EXPECT_EQ(cache.kept_bytes(), 3000u);  // two of the five were freed
  {
    // A 2000-byte buffer given back makes room by freeing 1000-byte ones (a profile no longer
    // read); a buffer larger than the cap is never kept.
    std::shared_ptr<std::byte[]> big = cache.Take(2000);
    std::shared_ptr<std::byte[]> huge = cache.Take(5000);
  }
  EXPECT_EQ(cache.kept_bytes(), 3000u);
  EXPECT_EQ(cache.Take(2000).get() != nullptr, true);
  EXPECT_EQ(cache.reused(), 1u);  // the 2000-byte one came back
  std::shared_ptr<std::byte[]> again = cache.Take(1000);
  EXPECT_EQ(cache.reused(), 2u);  // one 1000-byte buffer was still kept
}

TEST(BufferCacheTest, ACapOfZeroKeepsNothing) {
  BufferCache cache(0);
  { auto a = cache.Take(64); }
  EXPECT_EQ(cache.kept_bytes(), 0u);
  { auto b = cache.Take(64); }
  EXPECT_EQ(cache.reused(), 0u);
  EXPECT_EQ(cache.allocated(), 2u);
}

TEST(BufferCacheTest, BuffersOutliveTheCache) {
  std::shared_ptr<std::byte[]> out;
  {
    BufferCache cache(1 << 20);
    { auto kept = cache.Take(128); }
    out = cache.Take(256);
  }
  std::memset(out.get(), 1, 256);  // still valid; freed (not kept) when released (ASan checks)
  out.reset();
}

TEST(BufferCacheTest, ConcurrentTakesNeverShareABuffer) {
  BufferCache cache(64 * 1024);
  constexpr int kThreads = 4, kRounds = 2000;
  std::vector<std::thread> threads;
  std::atomic<int> clobbered{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&cache, &clobbered, t] {
      for (int r = 0; r < kRounds; ++r) {
        std::shared_ptr<std::byte[]> b = cache.Take(r % 2 == 0 ? 4096 : 1024);
        const size_t n = r % 2 == 0 ? 4096 : 1024;
        std::memset(b.get(), t + 1, n);
        std::this_thread::yield();
        for (size_t i = 0; i < n; ++i) {
          if (b[i] != std::byte(t + 1)) {
            clobbered.fetch_add(1);
            break;
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(clobbered.load(), 0);
  EXPECT_EQ(cache.reused() + cache.allocated(), uint64_t{kThreads} * kRounds);
  EXPECT_LE(cache.kept_bytes(), 64u * 1024);
}

}  // namespace
}  // namespace proxima::daemon
