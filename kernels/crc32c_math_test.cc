// The arithmetic of the batched GPU CRC32C (kernels/internal/crc32c_math.h) on the CPU, against
// common/crc32c.h: tables, the slicing-by-16 update, the shift/combine operator, and the whole
// chunk/lane decomposition the kernels run, simulated lane by lane on host memory. Runs without
// a GPU.
#include "kernels/internal/crc32c_math.h"

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "common/crc32c.h"
#include "gtest/gtest.h"

namespace proxima::gpu::crc32c_math {
namespace {

struct Tables {
  Tables() { MakeTables(t); }
  uint32_t t[kTables][256];
};

const Tables& T() {
  static const Tables* tables = new Tables();
  return *tables;
}

const ShiftPowers& Pow() {
  static const ShiftPowers powers = MakeShiftPowers();
  return powers;
}

std::vector<std::byte> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

uint32_t Crc(const std::byte* p, size_t n) { return Crc32c(std::span<const std::byte>(p, n)); }

struct ShiftTables {
  ShiftTables() {
    for (int l = 0; l < kLevels; ++l) MakeShiftTable(Pow().p[kTreeLog2 + l], level[l]);
    MakeShiftTable(Pow().p[kStripeLog2], stripe[0]);
    MakeShiftTable(Pow().p[kPowCount - 1], chunk[0]);
  }
  uint32_t level[kLevels][4][256];
  uint32_t stripe[1][4][256];
  uint32_t chunk[1][4][256];
};

const ShiftTables& S() {
  static const ShiftTables* tables = new ShiftTables();
  return *tables;
}

// The shuffle tree of the kernels for a whole chunk, on 32 lane values.
uint32_t TreeCombine(uint32_t (&v)[kLanes]) {
  for (int l = 0; l < kLevels; ++l) {
    const uint32_t step = 1u << l;
    for (uint32_t lane = 0; lane + step < kLanes; lane += 2 * step) {
      v[lane] = ShiftByTable(v[lane], S().level[l]) ^ v[lane + step];
    }
  }
  return v[0];
}

// What the warp computes for the whole chunk at `window` (a multiple of kChunkBytes).
uint32_t WholeChunkRaw(uint64_t window, bool starts_span) {
  uint32_t v[kLanes];
  for (uint32_t lane = 0; lane < kLanes; ++lane) {
    const uint32_t init = lane == 0 && starts_span ? ~0u : 0u;
    v[lane] = StripeLaneRaw(window, lane, init, T().t, S().stripe[0]);
  }
  return TreeCombine(v);
}

// The kernels' algorithm on host memory: pass 1 (every lane of every chunk; the tree for whole
// chunks, the per-lane shifts for partial ones, as the kernel chooses), then pass 2.
uint32_t SimulatedCrc(const std::byte* data, size_t size) {
  const uint64_t begin = reinterpret_cast<uintptr_t>(data);
  std::vector<uint32_t> chunk_raw(NumChunks(begin, size));
  for (uint64_t k = 0; k < chunk_raw.size(); ++k) {
    const ByteRange chunk = ChunkRange(begin, size, k);
    uint32_t x = 0;
    if (chunk.end - chunk.begin == kChunkBytes) {
      x = WholeChunkRaw(chunk.begin, chunk.begin == begin);
    } else {
      for (uint32_t lane = 0; lane < kLanes; ++lane) {
        x ^= LaneShare(begin, chunk, lane, T().t, Pow().p);
      }
    }
    chunk_raw[k] = x;
  }
  return CombineChunks(begin, size, chunk_raw.data(), Pow().p, S().chunk[0]);
}

TEST(Crc32cMathTest, TableZeroIsTheByteWiseCrc) {
  for (uint32_t b = 0; b < 256; ++b) {
    const std::byte byte{static_cast<unsigned char>(b)};
    // Crc32c(b) = ~raw(~0, b) = ~((~0 >> 8) ^ T0[(~0 ^ b) & 0xFF]).
    EXPECT_EQ(Crc(&byte, 1), ~((0xFFFFFFFFu >> 8) ^ T().t[0][(0xFFu ^ b) & 0xFFu])) << b;
  }
  EXPECT_EQ(T().t[0][128], kPolyReflected);  // the top bit shifted out once: P itself
}

TEST(Crc32cMathTest, ExtendRawMatchesCrc32cAtEveryAlignmentAndLength) {
  std::mt19937_64 rng(1);
  const std::vector<std::byte> buf = RandomBytes(rng, 4096 + 64);
  for (size_t offset = 0; offset < 33; ++offset) {
    for (size_t n : {0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 47, 48, 63, 100, 511, 512, 513,
                     4095, 4096}) {
      const auto* p = reinterpret_cast<const uint8_t*>(buf.data() + offset);
      EXPECT_EQ(~ExtendRaw(~0u, p, n, T().t), Crc(buf.data() + offset, n))
          << "offset " << offset << " n " << n;
    }
  }
}

TEST(Crc32cMathTest, MulModPIsMultiplication) {
  std::mt19937_64 rng(2);
  for (int i = 0; i < 1000; ++i) {
    const uint32_t a = static_cast<uint32_t>(rng()), b = static_cast<uint32_t>(rng()),
                   c = static_cast<uint32_t>(rng());
    EXPECT_EQ(MulModP(a, kOne), a);
    EXPECT_EQ(MulModP(kOne, a), a);
    EXPECT_EQ(MulModP(a, 0), 0u);
    EXPECT_EQ(MulModP(a, b), MulModP(b, a));
    EXPECT_EQ(MulModP(a, b ^ c), MulModP(a, b) ^ MulModP(a, c));
    EXPECT_EQ(MulModP(MulModP(a, b), c), MulModP(a, MulModP(b, c)));
  }
}

TEST(Crc32cMathTest, ShiftBytesFeedsZeroBytes) {
  std::mt19937_64 rng(3);
  const std::vector<uint8_t> zeros(1u << kPowCount, 0);
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{8}, uint64_t{496},
                     uint64_t{512}, uint64_t{12345}, kChunkBytes, kChunkBytes + 1,
                     (uint64_t{1} << kPowCount) - 1}) {
    for (int i = 0; i < 20; ++i) {
      const uint32_t v = static_cast<uint32_t>(rng());
      EXPECT_EQ(ShiftBytes(v, n, Pow().p), ExtendRaw(v, zeros.data(), n, T().t)) << n;
    }
  }
}

TEST(Crc32cMathTest, ShiftTablesMatchShiftBytes) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 1000; ++i) {
    const uint32_t v = static_cast<uint32_t>(rng());
    for (int l = 0; l < kLevels; ++l) {
      EXPECT_EQ(ShiftByTable(v, S().level[l]), ShiftBytes(v, kSlotBytes << l, Pow().p)) << l;
    }
    EXPECT_EQ(ShiftByTable(v, S().stripe[0]), ShiftBytes(v, kStripeBytes, Pow().p));
    EXPECT_EQ(ShiftByTable(v, S().chunk[0]), ShiftBytes(v, kChunkBytes, Pow().p));
  }
}

TEST(Crc32cMathTest, StripesOfAWholeChunkEqualItsRawCrc) {
  std::mt19937_64 rng(8);
  std::vector<std::byte> buf = RandomBytes(rng, 3 * kChunkBytes);
  const uint64_t base = reinterpret_cast<uintptr_t>(buf.data());
  const uint64_t window = (base + kChunkBytes - 1) / kChunkBytes * kChunkBytes;
  const ByteRange chunk{window, window + kChunkBytes};
  for (bool starts_span : {true, false}) {
    const uint64_t span_begin = starts_span ? window : window - 1;
    uint32_t sum = 0;  // the partial-chunk path on the same bytes
    for (uint32_t lane = 0; lane < kLanes; ++lane) {
      sum ^= LaneShare(span_begin, chunk, lane, T().t, Pow().p);
    }
    const uint32_t init = starts_span ? ~0u : 0u;
    const uint32_t want =
        ExtendRaw(init, reinterpret_cast<const uint8_t*>(window), kChunkBytes, T().t);
    EXPECT_EQ(WholeChunkRaw(window, starts_span), want) << starts_span;
    EXPECT_EQ(sum, want) << starts_span;
  }
}

TEST(Crc32cMathTest, CombineOfTwoCrcsIsTheCrcOfTheConcatenation) {
  std::mt19937_64 rng(4);
  for (int i = 0; i < 2000; ++i) {
    const size_t n = rng() % 40000;
    const std::vector<std::byte> buf = RandomBytes(rng, n);
    const size_t split = n == 0 ? 0 : rng() % (n + 1);
    const size_t len_b = n - split;
    if (len_b >= (size_t{1} << kPowCount)) continue;
    EXPECT_EQ(CombineCrc32c(Crc(buf.data(), split), Crc(buf.data() + split, len_b), len_b, Pow().p),
              Crc(buf.data(), n))
        << "n " << n << " split " << split;
  }
}

TEST(Crc32cMathTest, ChunkAndLaneRangesTileTheSpan) {
  std::mt19937_64 rng(5);
  for (int i = 0; i < 2000; ++i) {
    const uint64_t begin = rng() % (1u << 20) + 1;
    const uint64_t size = rng() % 3 == 0 ? rng() % 64 : rng() % (1u << 18);
    uint64_t next = begin;
    for (uint64_t k = 0; k < NumChunks(begin, size); ++k) {
      const ByteRange c = ChunkRange(begin, size, k);
      ASSERT_EQ(c.begin, next);
      ASSERT_LT(c.begin, c.end);
      ASSERT_LE(c.end - c.begin, kChunkBytes);
      ASSERT_EQ(c.begin / kChunkBytes, (c.end - 1) / kChunkBytes);  // inside one aligned window
      uint64_t lane_next = c.begin;
      for (uint32_t lane = 0; lane < kLanes; ++lane) {
        const ByteRange r = LaneRange(c, lane);
        if (r.begin == r.end) continue;
        ASSERT_EQ(r.begin, lane_next);
        ASSERT_LE(r.end, c.end);
        lane_next = r.end;
      }
      ASSERT_EQ(lane_next, c.end);
      next = c.end;
    }
    ASSERT_EQ(next, begin + size);
  }
}

TEST(Crc32cMathTest, SimulatedKernelsMatchCrc32c) {
  std::mt19937_64 rng(6);
  const size_t kBuf = (4u << 20) + 64;
  const std::vector<std::byte> buf = RandomBytes(rng, kBuf);
  std::vector<std::pair<size_t, size_t>> cases = {{0, 0},     {1, 0},      {3, 1},
                                                  {0, 1},     {17, 16},    {5, kChunkBytes},
                                                  {0, kChunkBytes}, {7, 4u << 20}, {64, 4u << 20}};
  // Spans that start and end at every position around chunk and lane boundaries.
  const uint64_t base = reinterpret_cast<uintptr_t>(buf.data());
  const size_t first_window = (kChunkBytes - base % kChunkBytes) % kChunkBytes;  // aligned offset
  for (int d : {-17, -16, -1, 0, 1, 15, 16, 33}) {
    for (size_t len : {size_t{1}, size_t{31}, kLaneBytes - 1, kLaneBytes, kChunkBytes - 1,
                       kChunkBytes + 1, 3 * kChunkBytes + 7}) {
      const size_t off = first_window + kChunkBytes + d;
      cases.push_back({off, len});
      cases.push_back({off + kLaneBytes * 5, len});
    }
  }
  for (int i = 0; i < 300; ++i) {
    const size_t len = rng() % 4 == 0 ? rng() % 100 : rng() % (200000);
    cases.push_back({rng() % (kBuf - len + 1), len});
  }
  for (const auto& [off, len] : cases) {
    ASSERT_LE(off + len, kBuf);
    EXPECT_EQ(SimulatedCrc(buf.data() + off, len), Crc(buf.data() + off, len))
        << "offset " << off << " length " << len;
  }
}

}  // namespace
}  // namespace proxima::gpu::crc32c_math
