// Every SIMD path (AVX2, AVX-512) against the scalar reference (bit identity), the run-time CPU
// checks, and the shared numeric conversions against hardware (F16C) and exhaustive checks.
// A path this CPU lacks is skipped with a message naming it: on a machine without AVX-512 the
// avx512 cases print "skipped: ... avx512" and the rest still run.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <tuple>

#include "common/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/internal/container.h"
#include "kernels/internal/numeric.h"
#include "kernels/internal/segment_codecs.h"
#include "kernels/internal/test_blocks.h"

namespace proxima::codec {

// Test names and failure messages say "avx512", not a byte dump.
void PrintTo(CpuPath path, std::ostream* os) { *os << CpuPathName(path); }

namespace {

using internal::MakeBlock;
using internal::Pattern;

// The SIMD paths under test.
constexpr CpuPath kSimdPaths[] = {CpuPath::kAvx2, CpuPath::kAvx512};

#define SKIP_WITHOUT_PATH(path)                                                             \
  if (!CpuPathAvailable(path)) {                                                            \
    std::printf("skipped: this CPU (or its OS) cannot run the %s path\n",                   \
                std::string(CpuPathName(path)).c_str());                                    \
    GTEST_SKIP() << "this CPU (or its OS) cannot run the " << CpuPathName(path) << " path"; \
  }

// The widest path the CPU runs, unless PROXIMA_CODEC_AVX512=0 declines AVX-512.
TEST(CpuPathTest, BestPathIsTheWidestAvailable) {
  const CpuPath best = BestCpuPath();
  std::printf("best CPU path here: %s (avx2 %s, avx512 %s)\n",
              std::string(CpuPathName(best)).c_str(),
              CpuPathAvailable(CpuPath::kAvx2) ? "yes" : "no",
              CpuPathAvailable(CpuPath::kAvx512) ? "yes" : "no");
  EXPECT_TRUE(CpuPathAvailable(best));
  EXPECT_TRUE(CpuPathAvailable(CpuPath::kScalar));
  const char* env = std::getenv("PROXIMA_CODEC_AVX512");
  const bool declined = env != nullptr && std::string_view(env) == "0";
  if (CpuPathAvailable(CpuPath::kAvx512) && !declined) {
    EXPECT_EQ(best, CpuPath::kAvx512);
    EXPECT_TRUE(CpuPathAvailable(CpuPath::kAvx2));  // the AVX-512 path hands odd dims to AVX2
  } else if (CpuPathAvailable(CpuPath::kAvx2)) {
    EXPECT_EQ(best, CpuPath::kAvx2);
  } else {
    EXPECT_EQ(best, CpuPath::kScalar);
  }
}

TEST(CpuPathTest, NamesRoundTripAndUnavailablePathsAreRefused) {
  for (CpuPath p : {CpuPath::kAuto, CpuPath::kScalar, CpuPath::kAvx2, CpuPath::kAvx512}) {
    ASSERT_OK_AND_ASSIGN(CpuPath parsed, ParseCpuPath(CpuPathName(p)));
    EXPECT_EQ(parsed, p);
  }
  EXPECT_EQ(CpuPathName(CpuPath::kAvx512), "avx512");
  EXPECT_FALSE(ParseCpuPath("avx-512").ok());
  BlockGeometry g{1, 1, 16, 16, DType::kBf16};
  std::vector<std::byte> raw(g.RawBytes());
  ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan("int8"));
  for (CpuPath p : kSimdPaths) {
    std::string out;
    absl::Status s = EncodeBlockWithPath(p, g, plan, false, raw, {}, &out);
    if (CpuPathAvailable(p)) {
      EXPECT_OK(s);
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    }
  }
}

TEST(CpuFeaturesTest, Avx512NeedsEveryCpuidBitAndTheOsSavingZmmState) {
  constexpr uint32_t kLeaf1 = (1u << 27) | (1u << 29);               // OSXSAVE, F16C
  constexpr uint32_t kLeaf7 = (1u << 16) | (1u << 30) | (1u << 31);  // F, BW, VL
  constexpr uint64_t kXcr0 = 0xE6;                                   // SSE AVX opmask zmm
  EXPECT_TRUE(internal::Avx512Usable(kLeaf1, kLeaf7, kXcr0));
  EXPECT_TRUE(internal::Avx512Usable(kLeaf1, kLeaf7 | (1u << 17), kXcr0 | 0x1 | (1u << 9)));
  EXPECT_FALSE(internal::Avx512Usable(kLeaf1 & ~(1u << 27), kLeaf7, kXcr0));  // no OSXSAVE
  EXPECT_FALSE(internal::Avx512Usable(kLeaf1 & ~(1u << 29), kLeaf7, kXcr0));  // no F16C
  for (uint32_t bit : {16u, 30u, 31u}) {
    EXPECT_FALSE(internal::Avx512Usable(kLeaf1, kLeaf7 & ~(1u << bit), kXcr0)) << bit;
  }
  for (uint32_t bit : {1u, 2u, 5u, 6u, 7u}) {  // an OS that does not save one component
    EXPECT_FALSE(internal::Avx512Usable(kLeaf1, kLeaf7, kXcr0 & ~(uint64_t{1} << bit))) << bit;
  }
  EXPECT_FALSE(internal::Avx512Usable(kLeaf1, kLeaf7, 0x7));  // AVX state only (AVX2 machine)
}

TEST(NumericTest, Fp16RoundTripsEveryNonNanValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = numeric::Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(numeric::FloatToFp16(f), h) << std::hex << h;
  }
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("f16c"))) uint16_t HardwareFp16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float HardwareFp16ToFloat(uint16_t h) { return _cvtsh_ss(h); }

TEST(NumericTest, FloatToFp16MatchesF16c) {
  SKIP_WITHOUT_PATH(CpuPath::kAvx2);
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
#endif  // x86: the F16C instructions are the reference for FloatToFp16

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

// The branch-free fp8 quantisation against the plain definitions it replaced (kept here as the
// reference): ClampQ(v, -448, 448), then the subnormal grid below 2^-6 or the float's rounded
// exponent and top mantissa bits above. Every bit pattern in steps of 61 (70 million, NaN and
// Inf included) and every float within 2^16 ulps of the subnormal boundary, 448 and 480.
uint8_t ReferenceE4m3(float y) {
  const uint32_t u = numeric::FloatBits(y), a = u & 0x7FFFFFFFu;
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (a < 0x3C800000u) {
    return static_cast<uint8_t>(
        sign | static_cast<uint8_t>(std::nearbyint(numeric::BitsFloat(a) * 512.0f)));
  }
  const uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
  return static_cast<uint8_t>(sign | (((r >> 23) - 120u) << 3) | ((r >> 20) & 0x7u));
}

TEST(NumericTest, Fp8QuantisationMatchesItsPlainDefinition) {
  auto check = [](uint32_t bits) {
    const float v = numeric::BitsFloat(bits);
    const float want = numeric::ClampQ(v, -448.0f, 448.0f), got = numeric::ClampE4m3(v);
    ASSERT_EQ(numeric::FloatBits(got), numeric::FloatBits(want)) << std::hex << bits;
    ASSERT_EQ(numeric::FloatToE4m3(got), ReferenceE4m3(want)) << std::hex << bits;
  };
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += 61) check(static_cast<uint32_t>(bits));
  for (uint32_t center : {0x3C800000u, 0x43E00000u, 0x43F00000u, 0x7F800000u}) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (uint32_t k = 0; k < 65536; ++k) {
        check((center + k) | sign);
        check((center - k) | sign);
      }
    }
  }
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

// The inline rounding the CPU reference uses gives std::nearbyint's result bit for bit (in the
// default rounding mode): every bit pattern in steps of 251 (17 million, all exponents, both
// signs, NaNs and infinities), every float within 2^12 ulps of the integers and halves below 2^24
// where ties and the 2^23 boundary sit, and the special values.
TEST(NumericTest, RoundNearestEvenMatchesNearbyint) {
  auto check = [](float f) {
    const float want = std::nearbyint(f), got = numeric::RoundNearestEven(f);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << f;
    } else {
      ASSERT_EQ(numeric::FloatBits(got), numeric::FloatBits(want)) << std::hexfloat << f;
    }
  };
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += 251) {
    check(numeric::BitsFloat(static_cast<uint32_t>(bits)));
  }
  for (float base :
       {0.5f, 1.5f, 2.5f, 127.5f, 4194303.5f, 4194304.5f, 8388607.5f, 8388608.0f, 16777216.0f}) {
    for (float sign : {1.0f, -1.0f}) {
      uint32_t center = numeric::FloatBits(sign * base);
      for (uint32_t k = 0; k < 4096; ++k) {
        check(numeric::BitsFloat(center + k));
        check(numeric::BitsFloat(center - k));
      }
    }
  }
  for (float f : {0.0f, -0.0f, 0.49999997f, -0.49999997f, 0.5f, -0.5f, 1e-45f, -1e-45f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max()}) {
    check(f);
  }
}

struct SimdCase {
  uint32_t heads, dim, tokens;
};

void PrintTo(const SimdCase& c, std::ostream* os) {
  *os << "heads " << c.heads << " dim " << c.dim << " tokens " << c.tokens;
}

using SimdParam = std::tuple<CpuPath, SimdCase>;

class SimdIdentityTest : public ::testing::TestWithParam<SimdParam> {};

TEST_P(SimdIdentityTest, EncodeAndDecodeMatchScalarBitForBit) {
  const auto [path, c] = GetParam();
  SKIP_WITHOUT_PATH(path);
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    BlockGeometry g{2, c.heads, c.dim, c.tokens, dtype};
    for (Pattern p : {Pattern::kKvLike, Pattern::kAdversarial, Pattern::kRandomBits}) {
      std::vector<std::byte> raw = MakeBlock(g, p, c.dim * 31 + c.tokens);
      for (const char* text :
           {"fp8", "int8", "int4,group=32", "int4,group=64", "int4,group=128", "int2,group=32",
            "int2,group=128", "lossless", "k4v3,rope_theta=10000", "k4v3,group=32"}) {
        ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
        std::string scalar, simd;
        ASSERT_OK(EncodeBlockWithPath(CpuPath::kScalar, g, plan, false, raw, {}, &scalar));
        ASSERT_OK(EncodeBlockWithPath(path, g, plan, false, raw, {}, &simd));
        ASSERT_EQ(scalar, simd) << text << " dim " << c.dim << " tokens " << c.tokens;
        // Decode the encoder's output, and the same payload with random quantized bytes (the
        // metadata stays finite so the decoder accepts it; for lossless the last N bytes are
        // plane B, stored verbatim).
        for (int variant = 0; variant < 2; ++variant) {
          std::string enc = scalar;
          if (variant == 1) {
            ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info,
                                 InspectBlock(std::as_bytes(std::span<const char>(enc))));
            std::mt19937 rng(5);
            for (size_t s = 0; s < info.segments.size(); ++s) {
              const SegmentInfo& seg = info.segments[s];
              // k4v3: K holds int4 codes, V 3-bit codes. Whole bytes of codes only: a last
              // byte's padding bits must stay 0.
              const size_t bits = seg.codec == CodecId::kInt4   ? 4
                                  : seg.codec == CodecId::kInt2 ? 2
                                  : seg.codec == CodecId::kK4v3 ? (s % 2 == 0 ? 4 : 3)
                                                                : 8;
              const size_t code_bits = g.SegmentElements() * bits;
              const size_t meta = seg.bytes - (code_bits + 7) / 8;
              for (size_t i = seg.offset + meta; i < seg.offset + meta + code_bits / 8; ++i) {
                enc[i] = static_cast<char>(rng());
              }
            }
            internal::ResealBlockForFuzzing(
                std::as_writable_bytes(std::span<char>(enc.data(), enc.size())));
          }
          std::vector<std::byte> a(g.RawBytes()), b(g.RawBytes());
          auto bytes = std::as_bytes(std::span<const char>(enc));
          ASSERT_OK(DecodeBlockWithPath(CpuPath::kScalar, bytes, a));
          ASSERT_OK(DecodeBlockWithPath(path, bytes, b));
          ASSERT_EQ(a, b) << text << " variant " << variant;
        }
      }
    }
  }
}

// Shapes: dims that fill whole 16-lane vectors (16, 48, 64, 80, 128), dims the AVX-512 path hands
// to the AVX2 path (8, 24, 40: multiples of 8 only), token counts with a partial last int4/int2
// group (33, 100), more heads than the fp8 encoders keep in registers at once (40 > 32), and a
// dim past the 256 channels whose K parameters the AVX2 int4/int2 encoder holds at once (264);
// every row length of the AVX-512 k4v3 V kernels, which keep a row in registers (16 to 256); a
// dim past the 256 channels whose K parameters the AVX-512 int4/int2 encoder holds (272); and
// the dims that are not powers of two whose k4v3 V rows the AVX2 kernels transform in chunks
// (48, 80, 96, 112).
INSTANTIATE_TEST_SUITE_P(
    Shapes, SimdIdentityTest,
    ::testing::Combine(::testing::ValuesIn(kSimdPaths),
                       ::testing::Values(SimdCase{3, 64, 16}, SimdCase{2, 128, 64},
                                         SimdCase{1, 64, 100}, SimdCase{2, 8, 33},
                                         SimdCase{1, 24, 16}, SimdCase{2, 16, 33},
                                         SimdCase{1, 48, 40}, SimdCase{2, 80, 32},
                                         SimdCase{1, 40, 16}, SimdCase{40, 16, 8},
                                         SimdCase{2, 264, 20}, SimdCase{3, 32, 12},
                                         SimdCase{1, 256, 9}, SimdCase{1, 272, 9},
                                         SimdCase{2, 96, 16}, SimdCase{1, 112, 9})),
    [](const ::testing::TestParamInfo<SimdParam>& info) {
      const SimdCase c = std::get<1>(info.param);  // no structured binding: macro argument
      return std::string(CpuPathName(std::get<0>(info.param))) + "_h" + std::to_string(c.heads) +
             "_d" + std::to_string(c.dim) + "_t" + std::to_string(c.tokens);
    });

// int4/int2 group parameters (scale and minimum per group) and int8 scales, computed 8 groups,
// channels or rows at a time by the AVX2 path, on ranges chosen to hit every branch of the scalar rules: empty groups (no finite
// value), constant groups (scale 0), ranges that overflow float (scale = largest finite),
// exactly representable ranges, one-ulp ranges, subnormal ranges, signed zeros, and random
// finite pairs, each group built from its own two extremes. K groups run along tokens and V
// groups along channels, so the block is built for each group size.
class SimdGroupParamsTest : public ::testing::TestWithParam<CpuPath> {};

TEST_P(SimdGroupParamsTest, IntNGroupParametersMatchScalarOnHardRanges) {
  const CpuPath path = GetParam();
  SKIP_WITHOUT_PATH(path);
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    const uint8_t dt = static_cast<uint8_t>(dtype);
    const bool bf16 = dtype == DType::kBf16;
    const uint16_t exp_mask = bf16 ? 0x7F80 : 0x7C00, max_finite = numeric::DtypeMaxFinite(dt);
    for (const SimdCase& c : {SimdCase{2, 64, 64}, SimdCase{3, 80, 100}, SimdCase{1, 128, 16}}) {
      const BlockGeometry g{4, c.heads, c.dim, c.tokens, dtype};
      const size_t H = c.heads, D = c.dim, n = g.SegmentElements();
      for (uint32_t group : {32u, 64u, 128u}) {
        std::vector<std::byte> raw(g.RawBytes());
        std::mt19937 rng(group * 7 + c.dim + dt);
        auto finite = [&] {
          for (;;) {
            const uint16_t v = static_cast<uint16_t>(rng());
            if ((v & exp_mask) != exp_mask) return v;
          }
        };
        auto non_finite = [&] {
          return static_cast<uint16_t>(exp_mask | (rng() & 1 ? 0x8000 : 0) | (rng() % 3 == 0 ? 0 : 1));
        };
        for (size_t seg = 0; seg < 2 * size_t{g.num_layers}; ++seg) {
          const bool value = seg % 2 == 1;
          const size_t g_len = value ? std::min<size_t>(group, D) : std::min<size_t>(group, c.tokens);
          // One (kind, a, b) per group, drawn when the group's first element comes up.
          std::map<size_t, std::tuple<int, uint16_t, uint16_t>> groups;
          for (size_t i = 0; i < n; ++i) {
            const size_t t = i / (H * D), hd = i % (H * D), d = i % D;
            const size_t id = value ? (t * H + hd / D) * D + d / g_len : (t / g_len) * H * D + hd;
            const size_t pos = value ? d % g_len : t % g_len;
            auto it = groups.find(id);
            if (it == groups.end()) {
              const int kind = static_cast<int>(rng() % 10);
              uint16_t a = finite(), b = finite();
              const float qmax = 15.0f;  // int4; int2 (3) sees the same extremes
              switch (kind) {
                case 1: b = a; break;                                     // constant
                case 3: a = 0x8000 | max_finite; b = max_finite; break;   // overflows float
                case 4:                                                    // exact range
                  a = rng() & 1 ? 0x8000 : 0;
                  b = numeric::FloatToDtype(
                      dt, qmax * numeric::DtypeToFloat(dt, static_cast<uint16_t>(finite() & 0x3FFF)));
                  break;
                case 5: a = 0x8000; b = 0; break;                          // -0 and +0
                case 6:                                                    // subnormals
                  a = static_cast<uint16_t>(rng() & (bf16 ? 0x807F : 0x83FF));
                  b = static_cast<uint16_t>(rng() & (bf16 ? 0x807F : 0x83FF));
                  break;
                case 8:                                                    // one ulp apart
                  a = static_cast<uint16_t>(finite() & 0x7FFF);
                  b = static_cast<uint16_t>(a + 1 < exp_mask ? a + 1 : a);
                  break;
                default: break;  // 0, 9: random pair; 2 and 7: see below
              }
              it = groups.emplace(id, std::make_tuple(kind, a, b)).first;
            }
            const auto [kind, a, b] = it->second;
            uint16_t v;
            if (kind == 2) {
              v = non_finite();  // empty group
            } else if (kind == 7) {
              v = pos == 0 ? a : non_finite();  // one finite value
            } else {
              v = pos == 0 ? a : pos == 1 ? b : (rng() & 1 ? a : b);
            }
            std::memcpy(raw.data() + 2 * (seg * n + i), &v, 2);
          }
        }
        // int8 too: its per-channel (K) and per-row (V) scales, 8 at a time on AVX2, see the
        // same extremes whole when the group covers the channel or row (group >= T or >= D).
        for (const char* codec : {"int4", "int2", "int8"}) {
          const std::string text = std::string(codec) == "int8"
                                       ? std::string(codec)
                                       : std::string(codec) + ",group=" + std::to_string(group);
          ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
          std::string scalar, simd;
          ASSERT_OK(EncodeBlockWithPath(CpuPath::kScalar, g, plan, false, raw, {}, &scalar));
          ASSERT_OK(EncodeBlockWithPath(path, g, plan, false, raw, {}, &simd));
          ASSERT_EQ(scalar, simd) << text << " " << (bf16 ? "bf16" : "fp16") << " dim " << c.dim
                                  << " tokens " << c.tokens;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, SimdGroupParamsTest, ::testing::ValuesIn(kSimdPaths),
                         [](const ::testing::TestParamInfo<CpuPath>& info) {
                           return std::string(CpuPathName(info.param));
                         });

class SimdExhaustiveTest : public ::testing::TestWithParam<CpuPath> {};

// Every 16-bit input pattern (NaN payloads, Inf, subnormals, both zeros) through every encoder,
// and every code (all fp8 and int8 bytes, all int4/int2 bit patterns) through every decoder.
TEST_P(SimdExhaustiveTest, EveryInputValueAndEveryCodeMatchScalar) {
  const CpuPath path = GetParam();
  SKIP_WITHOUT_PATH(path);
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    BlockGeometry g{1, 2, 512, 64, dtype};  // one segment = 65536 elements
    std::vector<std::byte> raw(g.RawBytes());
    for (size_t i = 0; i < raw.size() / 2; ++i) {
      // An odd multiplier permutes 0..65535, so each segment holds every pattern once, mixed
      // across groups and channels.
      const uint16_t v = static_cast<uint16_t>(i * 40503u);
      std::memcpy(raw.data() + 2 * i, &v, 2);
    }
    for (const char* text :
         {"fp8", "int8", "int4,group=32", "int4,group=128", "int2,group=64", "lossless"}) {
      ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
      std::string scalar, simd;
      ASSERT_OK(EncodeBlockWithPath(CpuPath::kScalar, g, plan, false, raw, {}, &scalar));
      ASSERT_OK(EncodeBlockWithPath(path, g, plan, false, raw, {}, &simd));
      ASSERT_EQ(scalar, simd) << text;
      // Replace the codes with a byte ramp (every code value, in every lane position).
      ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info,
                           InspectBlock(std::as_bytes(std::span<const char>(scalar))));
      for (const SegmentInfo& seg : info.segments) {
        const size_t bits = seg.codec == CodecId::kInt4 ? 4 : seg.codec == CodecId::kInt2 ? 2 : 8;
        const size_t code_bytes = g.SegmentElements() * bits / 8;
        for (size_t i = 0; i < code_bytes; ++i) {
          scalar[seg.offset + seg.bytes - code_bytes + i] = static_cast<char>(i * 7 + i / 256);
        }
      }
      internal::ResealBlockForFuzzing(
          std::as_writable_bytes(std::span<char>(scalar.data(), scalar.size())));
      auto bytes = std::as_bytes(std::span<const char>(scalar));
      std::vector<std::byte> a(g.RawBytes()), b(g.RawBytes());
      ASSERT_OK(DecodeBlockWithPath(CpuPath::kScalar, bytes, a));
      ASSERT_OK(DecodeBlockWithPath(path, bytes, b));
      ASSERT_EQ(a, b) << text;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, SimdExhaustiveTest, ::testing::ValuesIn(kSimdPaths),
                         [](const ::testing::TestParamInfo<CpuPath>& info) {
                           return std::string(CpuPathName(info.param));
                         });

}  // namespace
}  // namespace proxima::codec
