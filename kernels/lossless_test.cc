// The `lossless` segment codec (kernels/internal/lossless.cc) on its own: round trips of
// adversarial planes through both builds (generic and BMI2, which must write identical bytes;
// on AVX2 CPUs the BMI2 build also counts plane A and writes narrow-range streams with AVX2),
// the mode each input gets, hostile mode-2 payloads, and blocks written by the earlier rANS
// encoder (mode 1), which must still decode.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/bytes.h"
#include "common/crc32c.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/internal/segment_codecs.h"
#include "kernels/internal/test_blocks.h"

namespace proxima::codec {
namespace {

using ::proxima::codec::internal::DecodeLossless;
using ::proxima::codec::internal::EncodeLossless;
using ::proxima::codec::internal::SegmentShape;
using ::proxima::testing::StatusIs;
using ::testing::HasSubstr;

SegmentShape Shape(size_t n, uint8_t dtype = numeric::kDtypeBf16) {
  SegmentShape s;
  s.tokens = static_cast<uint32_t>(n);
  s.heads = 1;
  s.dim = 1;
  s.dtype = dtype;
  return s;
}

// The BMI2 build only where this CPU has it (else both runs take the generic build).
bool Bmi2() { return internal::CpuHasBmi2(); }

// Encodes with both builds (identical bytes required), decodes with both, returns the payload.
std::string RoundTrip(const SegmentShape& shape, const std::vector<uint16_t>& values) {
  const std::byte* in = reinterpret_cast<const std::byte*>(values.data());
  std::string generic, bmi2;
  EncodeLossless(shape, in, &generic, false);
  EncodeLossless(shape, in, &bmi2, Bmi2());
  EXPECT_EQ(generic, bmi2) << "the two builds wrote different bytes";
  for (bool use_bmi2 : {false, true}) {
    std::vector<uint16_t> out(values.size(), 0xDEAD);
    EXPECT_OK(DecodeLossless(shape, AsBytes(generic), reinterpret_cast<std::byte*>(out.data()),
                             use_bmi2 && Bmi2()));
    EXPECT_EQ(out, values) << "n " << values.size() << " bmi2 " << use_bmi2;
  }
  return generic;
}

// Values whose plane A (bf16: bits 7-14, fp16: bits 8-15) is `a` and whose other bits are noise.
uint16_t WithPlaneA(uint8_t dtype, uint8_t a, uint32_t noise) {
  if (dtype == numeric::kDtypeBf16) {
    return static_cast<uint16_t>((uint32_t{a} << 7) | (noise & 0x807Fu));
  }
  return static_cast<uint16_t>((uint32_t{a} << 8) | (noise & 0xFFu));
}

TEST(LosslessSegmentTest, AdversarialPlanesRoundTripInBothBuilds) {
  std::mt19937 rng(17);
  for (uint8_t dtype : {numeric::kDtypeBf16, numeric::kDtypeFp16}) {
    for (size_t n : {1, 2, 3, 4, 5, 7, 19, 20, 21, 39, 55, 56, 57, 63, 64, 65, 127, 255, 1001,
                     4099, 12288}) {
      const SegmentShape shape = Shape(n, dtype);
      std::vector<uint16_t> v(n);
      // All equal (mode 3 from n = 2).
      for (auto& x : v) x = 0x3F80;
      std::string p = RoundTrip(shape, v);
      EXPECT_EQ(p[0], n > 1 ? 3 : 0) << n;
      // Two values.
      for (size_t i = 0; i < n; ++i) v[i] = i % 3 ? 0x3F80 : 0xC000;
      RoundTrip(shape, v);
      // Every byte value in plane A (and so every code length the limit allows).
      for (size_t i = 0; i < n; ++i) v[i] = WithPlaneA(dtype, static_cast<uint8_t>(i * 7), rng());
      RoundTrip(shape, v);
      // Any 16-bit pattern: NaN payloads, Inf, subnormals, both zeros.
      for (auto& x : v) x = static_cast<uint16_t>(rng());
      RoundTrip(shape, v);
      for (size_t i = 0; i < n; ++i) {
        static constexpr uint16_t kSpecial[] = {0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF,
                                                0x0000, 0x8000, 0x0001, 0x7C00, 0xFE00};
        v[i] = kSpecial[rng() % 10];
      }
      RoundTrip(shape, v);
      // KV-like: a peaked exponent distribution (what real data looks like).
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (auto& x : v) x = numeric::FloatToDtype(dtype, normal(rng));
      RoundTrip(shape, v);
    }
  }
}

// Counts that grow like Fibonacci numbers give a Huffman tree one level deeper per symbol; the
// encoder must cut it to 11 bits (the decoder rejects longer codes) and still round-trip.
TEST(LosslessSegmentTest, SkewedCountsAreLengthLimited) {
  std::vector<uint16_t> v;
  uint64_t f0 = 1, f1 = 1;
  for (int s = 0; s < 24; ++s) {
    for (uint64_t j = 0; j < f0; ++j) v.push_back(WithPlaneA(numeric::kDtypeBf16, 100 + s, j));
    const uint64_t f2 = f0 + f1;
    f0 = f1;
    f1 = f2;
  }
  std::string p = RoundTrip(Shape(v.size()), v);
  EXPECT_EQ(p[0], 2);
  const int lo = static_cast<uint8_t>(p[1]), hi = static_cast<uint8_t>(p[2]);
  ASSERT_EQ(hi - lo, 23);
  int longest = 0;
  for (int j = 0; j <= hi - lo; ++j) {
    longest = std::max(longest, (static_cast<uint8_t>(p[3 + j / 2]) >> (4 * (j & 1))) & 0xF);
  }
  EXPECT_EQ(longest, 11);  // unlimited Huffman would use 23 bits
}

TEST(LosslessSegmentTest, ModesFollowTheData) {
  const SegmentShape shape = Shape(4096);
  std::vector<uint16_t> v(4096);
  std::mt19937 rng(3);
  for (auto& x : v) x = static_cast<uint16_t>(rng());  // plane A uniform: Huffman cannot win
  EXPECT_EQ(RoundTrip(shape, v)[0], 0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : v) x = numeric::FloatToDtype(numeric::kDtypeBf16, normal(rng));
  std::string p = RoundTrip(shape, v);
  EXPECT_EQ(p[0], 2);
  EXPECT_LT(p.size(), 4096u * 2 * 10 / 14);  // Gaussian bf16: about 1.5x
}

// The encoder's exact bytes, pinned: CRC32C over the payloads of many inputs per pattern, both
// dtypes, sizes around the stream writer's 20-symbol rounds and the histogram's 16-value steps.
// The expected values were written by the encoder of commit 1baf374 (before the single-pass
// stream writer and the 8-table histogram): a faster encoder must write the same bytes (the
// decoder accepts other encodings of the same values, so round trips alone would not notice).
// Inputs come from std::mt19937's raw output only (no std distribution, whose output the
// standard leaves to the library).
TEST(LosslessSegmentTest, EncodedBytesMatchThePinnedEncoder) {
  // The kinds from kWidth32 on were added with the encoder that counts plane A with vector
  // compares when its range spans at most 32 symbols (their CRCs written by the encoder before
  // it, commit 621ed35): ranges of exactly 32 and 33 symbols, ranges at both ends of the byte
  // (Inf/NaN exponents, zeros and subnormals), and sizes where the mode-2 size lands next to n.
  enum Kind {
    kPeaked, kEveryByte, kFibonacci, kRandom, kTwoValues, kWithZeros,
    kWidth32, kWidth33, kTopEnd, kBottomEnd, kNearStored,
  };
  struct Expected {
    Kind kind;
    const char* name;
    uint32_t crc;
  };
  const Expected kExpected[] = {
      {kPeaked, "peaked", 4294598034u},    {kEveryByte, "every byte", 2748740228u},
      {kFibonacci, "fibonacci", 3905524103u}, {kRandom, "random", 2239792657u},
      {kTwoValues, "two values", 3211122732u}, {kWithZeros, "zeros", 853976269u},
      {kWidth32, "32 symbols", 1252862660u},  {kWidth33, "33 symbols", 576778032u},
      {kTopEnd, "top end", 678882542u},       {kBottomEnd, "bottom end", 180645928u},
      {kNearStored, "near stored", 2767861462u},
  };
  for (const Expected& e : kExpected) {
    std::mt19937 rng(5 + static_cast<uint32_t>(e.kind));
    uint32_t crc = 0;
    for (uint8_t dtype : {numeric::kDtypeBf16, numeric::kDtypeFp16}) {
      std::vector<size_t> sizes = {1,  2,  3,  5,  15,  16,   17,   19,   20,    21,    31,   39, 40,
                                   41, 57, 63, 64, 65, 99, 255, 1001, 3072, 4099, 12288, 12289, 50000};
      if (e.kind >= kWidth32) {
        // More small sizes. Two-symbol planes (kNearStored) are mode 0 up to n = 23 (at 23
        // only the exact per-stream sizes say so: the total bits alone would allow mode 2) and
        // mode 2 from 24.
        for (size_t n : {22, 23, 24, 25, 26, 32, 33, 47, 48, 49}) sizes.push_back(n);
      }
      for (size_t n : sizes) {
        std::vector<uint16_t> v(n);
        uint64_t f0 = 1, f1 = 1, left = 1;
        uint8_t fib_sym = 90;
        for (size_t i = 0; i < n; ++i) {
          const uint32_t r = rng();
          uint8_t a = 0;
          switch (e.kind) {
            case kPeaked:  // binomial around 124: 13 symbols, the middle ones frequent
              a = static_cast<uint8_t>(118 + __builtin_popcount(r & 0xFFF));
              break;
            case kEveryByte:
              a = static_cast<uint8_t>(i * 7 + (r & 1));
              break;
            case kFibonacci:  // code lengths up to the 11-bit limit
              if (--left == 0) {
                const uint64_t f2 = f0 + f1;
                f0 = f1;
                f1 = f2;
                left = f0;
                ++fib_sym;
              }
              a = fib_sym;
              break;
            case kRandom:
              a = static_cast<uint8_t>(r >> 24);
              break;
            case kTwoValues:
              a = (r >> 8) % 5 == 0 ? 127 : 126;
              break;
            case kWithZeros:  // zero values (plane A 0) next to a peaked range
              a = (r >> 20) % 4 == 0 ? 0 : static_cast<uint8_t>(120 + __builtin_popcount(r & 0xFF));
              break;
            case kWidth32:  // 200..231, every one present from a few hundred values on
              a = static_cast<uint8_t>(200 + (r >> 27));
              break;
            case kWidth33:
              a = static_cast<uint8_t>(200 + (r >> 8) % 33);
              break;
            case kTopEnd:  // 255 (bf16 Inf/NaN) down to 224, peaked near the top
              a = (r >> 28) == 0 ? 224 : static_cast<uint8_t>(255 - __builtin_popcount(r & 0x3FF));
              break;
            case kBottomEnd:  // 0 (zeros, subnormals) up to 31
              a = (r >> 28) == 0 ? 31 : static_cast<uint8_t>(__builtin_popcount(r & 0x3FF));
              break;
            case kNearStored:
              a = (r >> 8) % 2 == 0 ? 127 : 126;
              break;
          }
          v[i] = WithPlaneA(dtype, a, r);
        }
        std::string p = RoundTrip(Shape(n, dtype), v);
        if (e.kind == kNearStored && (n == 23 || n == 24)) {
          EXPECT_EQ(p[0], n == 23 ? 0 : 2) << "n " << n;
        }
        crc = Crc32cExtend(crc, AsBytes(p));
      }
    }
    EXPECT_EQ(crc, e.crc) << e.name << ": the encoder writes different bytes";
  }
}

// A valid mode-2 payload of KV-like values and its layout offsets.
struct Mode2 {
  SegmentShape shape;
  std::string payload;
  size_t sizes_at = 0;  // the four u32 stream sizes
};

Mode2 MakeMode2(size_t n = 1000) {
  Mode2 m;
  m.shape = Shape(n);
  std::vector<uint16_t> v(n);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : v) x = numeric::FloatToDtype(numeric::kDtypeBf16, normal(rng));
  EncodeLossless(m.shape, reinterpret_cast<const std::byte*>(v.data()), &m.payload);
  const size_t range = static_cast<uint8_t>(m.payload[2]) - static_cast<uint8_t>(m.payload[1]) + 1;
  m.sizes_at = 3 + (range + 1) / 2;
  return m;
}

absl::Status DecodeMode2(const Mode2& m, const std::string& payload) {
  std::vector<std::byte> out(2 * m.shape.Elements());
  absl::Status generic = DecodeLossless(m.shape, AsBytes(payload), out.data(), false);
  absl::Status bmi2 = DecodeLossless(m.shape, AsBytes(payload), out.data(), Bmi2());
  EXPECT_EQ(generic, bmi2);
  return generic;
}

TEST(LosslessSegmentTest, HostileMode2PayloadsAreRejected) {
  const Mode2 m = MakeMode2();
  ASSERT_EQ(m.payload[0], 2);
  ASSERT_OK(DecodeMode2(m, m.payload));
  auto with = [&](auto edit) {
    std::string p = m.payload;
    edit(p);
    return DecodeMode2(m, p);
  };
  // Every code length changed alone breaks the Kraft sum (or goes over 11).
  for (size_t i = 3; i < m.sizes_at; ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      EXPECT_THAT(with([&](std::string& p) { p[i] ^= static_cast<char>(1 << bit); }),
                  StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_))
          << "byte " << i << " bit " << bit;
    }
  }
  EXPECT_THAT(with([&](std::string& p) { p[3] = static_cast<char>(0xCC); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("over 11")));
  // lo > hi.
  EXPECT_THAT(with([&](std::string& p) { std::swap(p[1], p[2]); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("range")));
  // Sizes that do not add up, or that move bytes from one stream to the next.
  auto size_at = [&](const std::string& p, int k) {
    uint32_t v;
    std::memcpy(&v, p.data() + m.sizes_at + 4 * k, 4);
    return v;
  };
  auto set_size = [&](std::string& p, int k, uint32_t v) {
    std::memcpy(p.data() + m.sizes_at + 4 * k, &v, 4);
  };
  EXPECT_THAT(with([&](std::string& p) { set_size(p, 0, size_at(p, 0) + 1); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("add up")));
  EXPECT_THAT(with([&](std::string& p) {
                set_size(p, 0, size_at(p, 0) + 1);
                set_size(p, 1, size_at(p, 1) - 1);
              }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stream size mismatch")));
  EXPECT_THAT(with([&](std::string& p) {
                set_size(p, 3, size_at(p, 3) + 0x10000);
                set_size(p, 2, size_at(p, 2) - 0x10000);  // wraps: a huge stream 2
              }),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  // Truncation anywhere.
  for (size_t len = 0; len < m.payload.size(); len += 7) {
    EXPECT_THAT(with([&](std::string& p) { p.resize(len); }),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_))
        << len;
  }
  EXPECT_THAT(with([&](std::string& p) { p[0] = 4; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown mode 4")));
  EXPECT_THAT(with([&](std::string& p) { p[0] = 3; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("constant plane")));
}

// Random bytes in the streams: the decoder must stay inside the payload (ASan builds check the
// reads) and both builds must agree on the outcome and on the output.
TEST(LosslessSegmentTest, RandomStreamBytesNeverEscapeThePayload) {
  for (size_t n : {64, 65, 100, 1000}) {  // sizes where Huffman wins (mode 2)
    const Mode2 m = MakeMode2(n);
    ASSERT_EQ(m.payload[0], 2) << n;
    std::mt19937 rng(static_cast<uint32_t>(n));
    int accepted = 0;
    for (int trial = 0; trial < 200; ++trial) {
      std::string p = m.payload;
      for (size_t i = m.sizes_at + 16; i < p.size() - n; ++i) p[i] = static_cast<char>(rng());
      // Exact-size copy so that a read past the end is a heap overflow.
      std::vector<std::byte> exact(p.size());
      std::memcpy(exact.data(), p.data(), p.size());
      std::vector<std::byte> a(2 * n), b(2 * n);
      absl::Status sa = DecodeLossless(m.shape, exact, a.data(), false);
      absl::Status sb = DecodeLossless(m.shape, exact, b.data(), Bmi2());
      ASSERT_EQ(sa, sb);
      if (sa.ok()) {
        ASSERT_EQ(a, b);
        ++accepted;
      }
    }
    // Random bits decode to some symbols; what catches most is the exact stream sizes.
    EXPECT_LT(accepted, 150) << n;
  }
}

// Blocks written by the rANS encoder (mode 1) before mode 2 existed (generated at commit
// c94ed17 with MakeBlock(geometry below, kKvLike, 41), first block of a sequence).
TEST(LosslessSegmentTest, RansBlocksFromTheEarlierEncoderStillDecode) {
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    const std::filesystem::path path =
        std::filesystem::path(PROXIMA_KERNELS_TESTDATA_DIR) /
        (std::string("lossless_v1_rans_") + (dtype == DType::kBf16 ? "bf16" : "fp16") + ".block");
    std::ifstream f(path, std::ios::binary);
    ASSERT_TRUE(f) << path;
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string enc = ss.str();
    const BlockGeometry g{2, 3, 32, 16, dtype};
    ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info, InspectBlock(AsBytes(enc)));
    for (const SegmentInfo& seg : info.segments) {
      ASSERT_EQ(seg.codec, CodecId::kLossless);
      EXPECT_EQ(enc[seg.offset], 1) << "expected an rANS segment";
    }
    std::vector<std::byte> out(g.RawBytes());
    for (CpuPath path_id : {CpuPath::kScalar, BestCpuPath()}) {
      ASSERT_OK(DecodeBlockWithPath(path_id, AsBytes(enc), out));
      EXPECT_EQ(out, internal::MakeBlock(g, internal::Pattern::kKvLike, 41));
    }
    // Re-encoding today gives Huffman segments that decode to the same values.
    ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan("lossless"));
    std::string again;
    ASSERT_OK(EncodeBlock(g, plan, true, out, {}, &again));
    ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info2, InspectBlock(AsBytes(again)));
    EXPECT_EQ(again[info2.segments[0].offset], 2);
    std::vector<std::byte> out2(g.RawBytes());
    ASSERT_OK(DecodeBlock(AsBytes(again), out2));
    EXPECT_EQ(out2, out);
  }
}

}  // namespace
}  // namespace proxima::codec
