// The AVX2 path against the scalar reference (bit identity), and the shared numeric
// conversions against hardware (F16C) and exhaustive checks.
#include <immintrin.h>

#include <cstring>
#include <random>

#include "common/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/internal/container.h"
#include "kernels/internal/numeric.h"
#include "kernels/internal/segment_codecs.h"
#include "kernels/internal/test_blocks.h"

namespace proxima::codec {
namespace {

using internal::MakeBlock;
using internal::Pattern;

#define SKIP_WITHOUT_AVX2()                                                         \
  if (BestCpuPath() != CpuPath::kAvx2) {                                            \
    std::printf("skipped: this CPU has no AVX2/F16C, only the scalar path runs\n"); \
    GTEST_SKIP();                                                                   \
  }

TEST(NumericTest, Fp16RoundTripsEveryNonNanValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = numeric::Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(numeric::FloatToFp16(f), h) << std::hex << h;
  }
}

__attribute__((target("f16c"))) uint16_t HardwareFp16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float HardwareFp16ToFloat(uint16_t h) { return _cvtsh_ss(h); }

TEST(NumericTest, FloatToFp16MatchesF16c) {
  SKIP_WITHOUT_AVX2();
  std::mt19937 rng(1);
  for (int i = 0; i < 2000000; ++i) {
    uint32_t bits = rng();
    if (i % 4 == 0) bits = (bits & 0x80FFFFFFu) | ((100u + rng() % 45u) << 23);  // near half range
    float f;
    std::memcpy(&f, &bits, 4);
    ASSERT_EQ(numeric::FloatToFp16(f), HardwareFp16(f)) << std::hex << bits;
  }
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float a = numeric::Fp16ToFloat(static_cast<uint16_t>(h)), b = HardwareFp16ToFloat(h);
    ASSERT_EQ(std::memcmp(&a, &b, 4), 0) << std::hex << h;
  }
}

TEST(NumericTest, E4m3EncodesEveryCodeBackToItself) {
  for (uint32_t c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) {
      EXPECT_EQ(std::fabs(numeric::E4m3ToFloat(static_cast<uint8_t>(c))), 480.0f);
      continue;
    }
    float f = numeric::E4m3ToFloat(static_cast<uint8_t>(c));
    ASSERT_EQ(numeric::FloatToE4m3(f), c) << c;
  }
  EXPECT_EQ(numeric::E4m3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(numeric::E4m3ToFloat(0x01), 0.001953125f);
  EXPECT_EQ(numeric::FloatToE4m3(0.0009765625f), 0x00);  // half of the smallest: ties to even
  EXPECT_EQ(numeric::FloatToE4m3(0.0029296875f), 0x02);  // 1.5 * 2^-9: ties to even
}

TEST(NumericTest, RoundUpDtypeNeverRoundsDown) {
  std::mt19937 rng(2);
  for (uint8_t dt : {numeric::kDtypeBf16, numeric::kDtypeFp16}) {
    for (int i = 0; i < 100000; ++i) {
      uint32_t bits = rng() & 0x7FFFFFFFu;
      float f;
      std::memcpy(&f, &bits, 4);
      if (!std::isfinite(f)) continue;
      float r = numeric::DtypeToFloat(dt, numeric::RoundUpDtype(dt, f));
      ASSERT_TRUE(std::isfinite(r));
      if (r != numeric::DtypeToFloat(dt, numeric::DtypeMaxFinite(dt))) {
        ASSERT_GE(r, f) << f;
      }
    }
  }
}

struct SimdCase {
  uint32_t heads, dim, tokens;
};

class SimdIdentityTest : public ::testing::TestWithParam<SimdCase> {};

TEST_P(SimdIdentityTest, EncodeAndDecodeMatchScalarBitForBit) {
  SKIP_WITHOUT_AVX2();
  const SimdCase c = GetParam();
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    BlockGeometry g{2, c.heads, c.dim, c.tokens, dtype};
    for (Pattern p : {Pattern::kKvLike, Pattern::kAdversarial, Pattern::kRandomBits}) {
      std::vector<std::byte> raw = MakeBlock(g, p, c.dim * 31 + c.tokens);
      for (const char* text : {"fp8", "int8", "int4,group=32", "int4,group=64", "int4,group=128",
                               "int2,group=32", "int2,group=128"}) {
        ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
        std::string scalar, avx2;
        ASSERT_OK(EncodeBlockWithPath(CpuPath::kScalar, g, plan, false, raw, {}, &scalar));
        ASSERT_OK(EncodeBlockWithPath(CpuPath::kAvx2, g, plan, false, raw, {}, &avx2));
        ASSERT_EQ(scalar, avx2) << text << " dim " << c.dim << " tokens " << c.tokens;
        // Decode the encoder's output, and the same payload with random quantized bytes (the
        // metadata stays finite so the decoder accepts it).
        for (int variant = 0; variant < 2; ++variant) {
          std::string enc = scalar;
          if (variant == 1) {
            ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info,
                                 InspectBlock(std::as_bytes(std::span<const char>(enc))));
            std::mt19937 rng(5);
            for (size_t s = 0; s < info.segments.size(); ++s) {
              const SegmentInfo& seg = info.segments[s];
              size_t meta = seg.bytes - g.SegmentElements() *
                                            (seg.codec == CodecId::kInt4   ? 4
                                             : seg.codec == CodecId::kInt2 ? 2
                                                                           : 8) /
                                            8;
              for (size_t i = seg.offset + meta; i < seg.offset + seg.bytes; ++i) {
                enc[i] = static_cast<char>(rng());
              }
            }
            internal::ResealBlockForFuzzing(
                std::as_writable_bytes(std::span<char>(enc.data(), enc.size())));
          }
          std::vector<std::byte> a(g.RawBytes()), b(g.RawBytes());
          auto bytes = std::as_bytes(std::span<const char>(enc));
          ASSERT_OK(DecodeBlockWithPath(CpuPath::kScalar, bytes, a));
          ASSERT_OK(DecodeBlockWithPath(CpuPath::kAvx2, bytes, b));
          ASSERT_EQ(a, b) << text << " variant " << variant;
        }
      }
    }
  }
}

// dim 24 is not a multiple of 8: the AVX2 entry points fall back to scalar for that segment.
INSTANTIATE_TEST_SUITE_P(Shapes, SimdIdentityTest,
                         ::testing::Values(SimdCase{3, 64, 16}, SimdCase{2, 128, 64},
                                           SimdCase{1, 64, 100}, SimdCase{2, 8, 33},
                                           SimdCase{1, 24, 16}));

}  // namespace
}  // namespace proxima::codec
