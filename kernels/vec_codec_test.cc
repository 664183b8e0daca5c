// The 8-element arithmetic of the CUDA fast path (kernels/internal/vec_codec.h) run on the CPU,
// phase by phase as the kernels run it, against the scalar reference: DecodeVec gives the bytes
// DecodeBlock gives, and the fused encode phases write the payload EncodeBlock writes, for every
// codec the fast path takes, both dtypes, several geometries and adversarial inputs. The GPU run
// of the same functions is checked by kernels_codec_cuda_test on a machine with a GPU.
#include "kernels/internal/vec_codec.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/internal/k4v3_math.h"
#include "kernels/internal/make_segment_job.h"
#include "kernels/internal/numeric.h"
#include "kernels/internal/segment_codecs.h"
#include "kernels/internal/test_blocks.h"

namespace proxima::codec {
namespace {

using internal::MakeBlock;
using internal::Pattern;
using internal::SegmentJob;

std::vector<BlockGeometry> Geometries(DType dtype) {
  // All with head_dim a multiple of 8 (the fast path); tokens not a multiple of any group size.
  return {BlockGeometry{3, 3, 64, 16, dtype}, BlockGeometry{2, 2, 24, 100, dtype},
          BlockGeometry{2, 8, 128, 64, dtype}, BlockGeometry{1, 4, 16, 33, dtype},
          BlockGeometry{1, 1, 80, 20, dtype}};
}

template <uint8_t kDt, uint8_t kCodec>
void DecodeAllAs(const SegmentJob& j, uint16_t* out) {
  for (uint32_t v = 0; v < j.elements / 8; ++v) {
    uint32_t w[4];
    vec::DecodeVec<kDt, kCodec>(j, v, w);
    std::memcpy(out + 8 * v, w, sizeof(w));  // element 2k in the low half: little-endian order
  }
}

// As DecodeVecsKernel runs it: the instantiation for the job's codec.
template <uint8_t kDt>
void DecodeAll(const SegmentJob& j, uint16_t* out) {
  switch (j.codec) {
    case vec::kRaw:
      return DecodeAllAs<kDt, vec::kRaw>(j, out);
    case vec::kFp8:
      return DecodeAllAs<kDt, vec::kFp8>(j, out);
    case vec::kInt8:
      return DecodeAllAs<kDt, vec::kInt8>(j, out);
    case vec::kInt4:
      return DecodeAllAs<kDt, vec::kInt4>(j, out);
    case vec::kInt2:
      return DecodeAllAs<kDt, vec::kInt2>(j, out);
    case vec::kStar:
      return DecodeAllAs<kDt, vec::kStar>(j, out);
    default:
      FAIL() << "codec " << int{j.codec} << " has no fast path";
  }
}

// Decodes every segment of `enc` with the fast path into `got` (RawBytes() / 2 values).
void DecodeBlockByVecs(const BlockGeometry& g, std::string& enc, std::vector<uint16_t>& got) {
  ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info,
                       InspectBlock(std::as_bytes(std::span<const char>(enc))));
  const size_t seg_elems = g.SegmentElements();
  for (uint32_t s = 0; s < info.segments.size(); ++s) {
    const SegmentJob j = internal::MakeSegmentJob(
        info.segments[s].codec, internal::SegmentShapeFor(g, s, info.segments[s].group_size),
        reinterpret_cast<uint8_t*>(enc.data() + info.segments[s].offset),
        got.data() + s * seg_elems);
    ASSERT_EQ(j.vec, 1) << "segment " << s;
    if (g.dtype == DType::kBf16) {
      DecodeAll<numeric::kDtypeBf16>(j, got.data() + s * seg_elems);
    } else {
      DecodeAll<numeric::kDtypeFp16>(j, got.data() + s * seg_elems);
    }
  }
}

template <uint8_t kDt>
void EncodeAll(const SegmentJob& j) {
  for (uint32_t h = 0; h < j.heads; ++h) {
    std::vector<int32_t> stats(vec::StatsWords(j) + 1);
    for (uint32_t w = 0; w < vec::StatsWords(j); ++w) stats[w] = vec::InitStat(j, w);
    for (uint32_t u = 0; u < vec::HeadVecs(j); ++u) {
      vec::AccumulateVec<kDt>(j, h, u, true, vec::StatLaneBits(j), stats.data());
    }
    for (uint32_t w = 0; w < vec::FinalizeCount(j); ++w) {
      vec::FinalizeStat<kDt>(j, h, w, stats.data());
    }
    for (uint32_t u = 0; u < vec::HeadVecs(j); ++u) vec::QuantizeVec<kDt>(j, h, u, stats.data());
  }
}

class VecCodecTest : public ::testing::TestWithParam<const char*> {};

TEST_P(VecCodecTest, DecodeVecMatchesTheScalarDecoder) {
  ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(GetParam()));
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (const BlockGeometry& g : Geometries(dtype)) {
      for (Pattern pattern : {Pattern::kKvLike, Pattern::kAdversarial, Pattern::kRandomBits}) {
        SCOPED_TRACE(::testing::Message()
                     << GetParam() << " layers=" << g.num_layers << " heads=" << g.num_kv_heads
                     << " dim=" << g.head_dim << " tokens=" << g.tokens_per_block);
        const std::vector<std::byte> raw = MakeBlock(g, pattern, 7);
        std::string enc;
        ASSERT_OK(EncodeBlock(g, plan, /*is_first_block=*/true, raw, {}, &enc));
        std::vector<std::byte> want(g.RawBytes());
        ASSERT_OK(DecodeBlock(std::as_bytes(std::span<const char>(enc)), want));
        std::vector<uint16_t> got(g.RawBytes() / 2, 0xDEAD);
        ASSERT_NO_FATAL_FAILURE(DecodeBlockByVecs(g, enc, got));
        ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0);
      }
    }
  }
}

TEST_P(VecCodecTest, FusedEncodePhasesWriteTheScalarEncodersPayload) {
  ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(GetParam()));
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (const BlockGeometry& g : Geometries(dtype)) {
      for (Pattern pattern : {Pattern::kKvLike, Pattern::kAdversarial, Pattern::kRandomBits}) {
        for (bool first : {true, false}) {
          SCOPED_TRACE(::testing::Message() << GetParam() << " dim=" << g.head_dim << " tokens="
                                            << g.tokens_per_block << " first=" << first);
          std::vector<std::byte> raw = MakeBlock(g, pattern, 9);
          std::string want;
          ASSERT_OK(EncodeBlock(g, plan, first, raw, {}, &want));
          ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info,
                               InspectBlock(std::as_bytes(std::span<const char>(want))));
          std::string got = want;
          const size_t header = info.segments.empty() ? want.size() : info.segments[0].offset;
          std::memset(got.data() + header, 0xA5, got.size() - header);  // poison the payload
          for (uint32_t s = 0; s < info.segments.size(); ++s) {
            if (info.segments[s].codec == CodecId::kStar) continue;  // per-element path on GPU
            const SegmentJob j = internal::MakeSegmentJob(
                info.segments[s].codec,
                internal::SegmentShapeFor(g, s, info.segments[s].group_size),
                reinterpret_cast<uint8_t*>(got.data() + info.segments[s].offset),
                reinterpret_cast<uint16_t*>(raw.data()) + s * g.SegmentElements());
            ASSERT_EQ(j.vec, 1) << "segment " << s;
            if (dtype == DType::kBf16) {
              EncodeAll<numeric::kDtypeBf16>(j);
            } else {
              EncodeAll<numeric::kDtypeFp16>(j);
            }
          }
          if (plan.ToString().find("star") != std::string::npos) continue;
          ASSERT_EQ(got, want);
        }
      }
    }
  }
}

// StatLaneBits's promise, which the GPU's warp reductions rely on: in every warp of a head's vecs,
// lanes that differ only in those bits feed the same statistics word with every element.
TEST_P(VecCodecTest, LanesThatStatLaneBitsGroupFeedTheSameWords) {
  ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(GetParam()));
  std::vector<BlockGeometry> geometries = Geometries(DType::kBf16);
  geometries.push_back(BlockGeometry{1, 2, 256, 40, DType::kBf16});  // 32 vecs per row
  geometries.push_back(BlockGeometry{1, 2, 512, 8, DType::kBf16});   // 64 vecs per row
  for (const BlockGeometry& g : geometries) {
    std::string enc;
    ASSERT_OK(EncodeBlock(g, plan, true, MakeBlock(g, Pattern::kKvLike, 1), {}, &enc));
    ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info,
                         InspectBlock(std::as_bytes(std::span<const char>(enc))));
    for (uint32_t s = 0; s < info.segments.size(); ++s) {
      std::vector<uint16_t> raw(g.SegmentElements());
      const SegmentJob j = internal::MakeSegmentJob(
          info.segments[s].codec, internal::SegmentShapeFor(g, s, info.segments[s].group_size),
          reinterpret_cast<uint8_t*>(enc.data() + info.segments[s].offset), raw.data());
      if (vec::StatsWords(j) == 0) continue;
      const uint32_t bits = vec::StatLaneBits(j), vecs = vec::HeadVecs(j);
      for (uint32_t u = 0; u < vecs; ++u) {
        for (uint32_t lane = 0; lane < 32; ++lane) {
          const uint32_t peer = (u & ~31u) | lane;
          if (peer >= vecs || ((peer ^ u) & ~bits) != 0) continue;
          for (uint32_t k = 0; k < 8; ++k) {
            ASSERT_EQ(vec::StatWord(j, vec::LocateInHead(j, 0, u), k),
                      vec::StatWord(j, vec::LocateInHead(j, 0, peer), k))
                << GetParam() << " dim=" << g.head_dim << " segment " << s << " bits " << bits
                << " vec " << u << " lane " << lane << " element " << k;
          }
        }
      }
    }
  }
}

// Codes no encoder writes still decode as the scalar decoder decodes them: every byte value in
// the code bytes of fp8 (0x7F and 0xFF are +-480) and int8 (-128) segments, with the block
// resealed (both CRCs) so the decoder reaches them.
TEST(VecCodecCodesTest, EveryCodeByteDecodesAsTheScalarDecoderDoes) {
  for (const char* text : {"fp8", "int8"}) {
    ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
    for (DType dtype : {DType::kBf16, DType::kFp16}) {
      SCOPED_TRACE(::testing::Message() << text << " dtype=" << static_cast<int>(dtype));
      const BlockGeometry g{2, 3, 64, 16, dtype};
      std::string enc;
      ASSERT_OK(EncodeBlock(g, plan, false, MakeBlock(g, Pattern::kKvLike, 3), {}, &enc));
      internal::FillEveryCodeByte(g, enc);
      std::vector<std::byte> want(g.RawBytes());
      ASSERT_OK(DecodeBlock(std::as_bytes(std::span<const char>(enc)), want));
      std::vector<uint16_t> got(g.RawBytes() / 2, 0xDEAD);
      ASSERT_NO_FATAL_FAILURE(DecodeBlockByVecs(g, enc, got));
      ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Plans, VecCodecTest,
                         ::testing::Values("raw", "fp8", "int8", "int4,group=32", "int4,group=64",
                                           "int4,group=128", "int2,group=32", "int2,group=64",
                                           "int2,group=128",
                                           "layers[0:1]=int8,default=int4,sink=fp8", "star"));

// ---- k4v3: the CUDA kernels' items (kernels/internal/k4v3_math.h) run on the CPU as the kernels
// run them, over the jobs the host wrapper builds (internal::MakeK4v3Jobs): K's turn then int4's
// fused encode phases, V's rows; and back. They give the CPU codec's bytes exactly.

std::vector<BlockGeometry> K4v3Geometries(DType dtype) {
  // Every head_dim the GPU takes (powers of two from 8 to 256); tokens not a multiple of any
  // group size too.
  return {BlockGeometry{2, 3, 64, 16, dtype}, BlockGeometry{1, 2, 128, 64, dtype},
          BlockGeometry{1, 4, 8, 33, dtype},  BlockGeometry{2, 1, 16, 100, dtype},
          BlockGeometry{1, 2, 32, 7, dtype},  BlockGeometry{1, 1, 256, 20, dtype}};
}

// Runs `fn(dtype constant)` for the block's dtype.
template <typename Fn>
void WithDtype(DType dtype, Fn fn) {
  if (dtype == DType::kBf16) {
    fn(std::integral_constant<uint8_t, numeric::kDtypeBf16>{});
  } else {
    fn(std::integral_constant<uint8_t, numeric::kDtypeFp16>{});
  }
}

// The transform as K4v3ValuesKernel's team runs it (TeamFwht), lane l's shuffle partner read
// from the lanes' values before the stage.
using Lanes = std::vector<std::array<float, k4v3::kMaxPerLane>>;
void TeamFwhtOverLanes(Lanes& u, uint32_t per_lane) {
  const auto T = static_cast<uint32_t>(u.size());
  for (uint32_t len = 1; len < T; len <<= 1) {
    const Lanes before = u;
    for (uint32_t l = 0; l < T; ++l) {
      for (uint32_t k = 0; k < per_lane; ++k) {
        u[l][k] = k4v3::TeamStage(before[l][k], before[l ^ len][k], l, len);
      }
    }
  }
  for (auto& lane : u) k4v3::LaneStages(lane.data(), per_lane);
}

// Row r of a V job encoded as the kernel's team encodes it: the maximum and the OR of codes over
// lanes that the kernel takes with shuffles.
template <uint8_t kDt>
void EncodeRowAsTeam(const internal::SegmentJob& j, uint64_t r) {
  const uint32_t T = k4v3::TeamSize(j.dim), per_lane = j.dim / T;
  Lanes u(T);
  for (uint32_t l = 0; l < T; ++l) k4v3::LoadValueLane<kDt>(j, r, l, T, per_lane, u[l].data());
  TeamFwhtOverLanes(u, per_lane);
  int32_t amax = 0;
  for (uint32_t l = 0; l < T; ++l) {
    amax = std::max(amax, k4v3::LaneAbsBits(u[l].data(), per_lane, j.hadamard_norm));
  }
  float divisor;
  k4v3::StoreRowScale(j, r, k4v3::ScaleFromMaxBits<kDt>(amax, &divisor));
  for (uint32_t k = 0; k < per_lane; ++k) {
    for (uint32_t first = 0; first < T; first += 8) {
      uint32_t w = 0;
      for (uint32_t l = first; l < first + 8; ++l) w |= k4v3::LaneCodeBits(u[l][k], divisor, l);
      k4v3::StoreCodeWord(j, r, j.dim, k4v3::LaneElement(first, T, k), w);
    }
  }
}

template <uint8_t kDt>
void DecodeRowAsTeam(const internal::SegmentJob& j, uint64_t r) {
  const uint32_t T = k4v3::TeamSize(j.dim), per_lane = j.dim / T;
  Lanes u(T);
  for (uint32_t l = 0; l < T; ++l) k4v3::LoadLevelsLane(j, r, l, T, per_lane, u[l].data());
  TeamFwhtOverLanes(u, per_lane);
  for (uint32_t l = 0; l < T; ++l) k4v3::StoreValueLane<kDt>(j, r, l, T, per_lane, u[l].data());
}

class K4v3ItemsTest : public ::testing::TestWithParam<const char*> {};

TEST_P(K4v3ItemsTest, EncodeItemsWriteTheCpuCodecsPayload) {
  ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(GetParam()));
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (const BlockGeometry& g : K4v3Geometries(dtype)) {
      for (Pattern pattern : {Pattern::kKvLike, Pattern::kAdversarial, Pattern::kRandomBits}) {
        SCOPED_TRACE(::testing::Message() << GetParam() << " heads=" << g.num_kv_heads << " dim="
                                          << g.head_dim << " tokens=" << g.tokens_per_block);
        ASSERT_TRUE(internal::K4v3GpuDimOk(g.head_dim));
        std::vector<std::byte> raw = MakeBlock(g, pattern, 11);
        std::string want;
        ASSERT_OK(EncodeBlock(g, plan, /*is_first_block=*/false, raw, {}, &want));
        ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info,
                             InspectBlock(std::as_bytes(std::span<const char>(want))));
        std::string got = want;
        const size_t header = info.segments[0].offset;
        std::memset(got.data() + header, 0xA5, got.size() - header);  // poison the payload
        const internal::K4v3Rope rope = internal::K4v3RopeFor(plan.rope_theta, g.head_dim);
        std::vector<uint16_t> turned(g.SegmentElements(), 0xDEAD);
        for (uint32_t s = 0; s < info.segments.size(); ++s) {
          ASSERT_EQ(info.segments[s].codec, CodecId::kK4v3);
          const internal::K4v3Jobs jobs = internal::MakeK4v3Jobs(
              internal::SegmentShapeFor(g, s, info.segments[s].group_size), rope,
              reinterpret_cast<uint8_t*>(got.data() + info.segments[s].offset),
              reinterpret_cast<uint16_t*>(raw.data()) + s * g.SegmentElements(), turned.data());
          ASSERT_EQ(jobs.main.payload_bytes, info.segments[s].bytes);
          WithDtype(dtype, [&](auto dt) {
            if (jobs.main.is_value) {
              for (uint64_t r = 0; r < jobs.main.units; ++r) EncodeRowAsTeam<dt()>(jobs.main, r);
              return;
            }
            k4v3::WriteKHeader(jobs.main);  // K4v3TurnKernel, then int4's fused kernel
            for (uint64_t q = 0; q < jobs.main.units / jobs.main.heads; ++q) {
              k4v3::TurnPairs<dt()>(jobs.main, q, /*inverse=*/false);
            }
            ASSERT_EQ(jobs.int4.vec, 1);
            EncodeAll<dt()>(jobs.int4);
          });
        }
        ASSERT_EQ(got, want);
      }
    }
  }
}

TEST_P(K4v3ItemsTest, DecodeItemsGiveTheCpuDecodersValues) {
  ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(GetParam()));
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (const BlockGeometry& g : K4v3Geometries(dtype)) {
      for (Pattern pattern : {Pattern::kKvLike, Pattern::kAdversarial, Pattern::kRandomBits}) {
        SCOPED_TRACE(::testing::Message() << GetParam() << " heads=" << g.num_kv_heads << " dim="
                                          << g.head_dim << " tokens=" << g.tokens_per_block);
        std::string enc;
        ASSERT_OK(EncodeBlock(g, plan, true, MakeBlock(g, pattern, 13), {}, &enc));
        std::vector<std::byte> want(g.RawBytes());
        ASSERT_OK(DecodeBlock(std::as_bytes(std::span<const char>(enc)), want));
        ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info,
                             InspectBlock(std::as_bytes(std::span<const char>(enc))));
        std::vector<uint16_t> got(g.RawBytes() / 2, 0xDEAD);
        std::vector<uint16_t> turned(g.SegmentElements(), 0xDEAD);
        for (uint32_t s = 0; s < info.segments.size(); ++s) {
          const internal::SegmentShape sh =
              internal::SegmentShapeFor(g, s, info.segments[s].group_size);
          const auto* host =
              reinterpret_cast<const std::byte*>(enc.data() + info.segments[s].offset);
          ASSERT_OK(internal::ValidateK4v3(sh, host));  // as the host wrapper does
          const internal::K4v3Rope rope{internal::LoadF32(host, 0), internal::LoadF32(host, 1)};
          const internal::K4v3Jobs jobs = internal::MakeK4v3Jobs(
              sh, sh.is_value ? internal::K4v3Rope{} : rope,
              reinterpret_cast<uint8_t*>(enc.data() + info.segments[s].offset),
              got.data() + s * g.SegmentElements(), turned.data());
          WithDtype(dtype, [&](auto dt) {
            if (jobs.main.is_value) {
              for (uint64_t r = 0; r < jobs.main.units; ++r) DecodeRowAsTeam<dt()>(jobs.main, r);
              return;
            }
            ASSERT_EQ(jobs.int4.vec, 1);
            DecodeAll<dt()>(jobs.int4, turned.data());  // int4's kernel, then the turn back
            for (uint64_t q = 0; q < jobs.main.units / jobs.main.heads; ++q) {
              k4v3::TurnPairs<dt()>(jobs.main, q, /*inverse=*/true);
            }
          });
        }
        ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Plans, K4v3ItemsTest,
                         ::testing::Values("k4v3", "k4v3,rope_theta=10000",
                                           "k4v3,rope_theta=500000,group=32",
                                           "k4v3,rope_theta=100000,group=128"));

// The GPU takes k4v3 for head_dim a power of two from 8 to k4v3::kMaxRowDim.
TEST(K4v3ItemsDimTest, TheGpuTakesPowersOfTwoFrom8To256) {
  for (uint32_t d : {8u, 16u, 64u, 128u, 256u}) EXPECT_TRUE(internal::K4v3GpuDimOk(d)) << d;
  for (uint32_t d : {0u, 1u, 2u, 4u, 24u, 80u, 96u, 512u, 1024u}) {
    EXPECT_FALSE(internal::K4v3GpuDimOk(d)) << d;
  }
}

// vec::Div with internal::MakeFastDiv is n / d for every 32-bit n: small, power-of-two, odd and
// huge divisors against numerators at and around multiples of them and at the extremes.
TEST(VecCodecDivTest, FastDivisionIsExact) {
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 1100; ++d) divisors.push_back(d);
  for (uint32_t k = 10; k < 32; ++k) {
    for (int64_t e : {-1, 0, 1}) divisors.push_back(static_cast<uint32_t>((int64_t{1} << k) + e));
  }
  divisors.push_back(0xFFFFFFFFu);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint32_t d : divisors) {
    const internal::FastDiv f = internal::MakeFastDiv(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 2 * d - 1, 0x7FFFFFFFu, 0x80000000u,
                                0xFFFFFFFEu, 0xFFFFFFFFu, 0xFFFFFFFFu / d * d,
                                0xFFFFFFFFu / d * d - 1};
    for (int r = 0; r < 64; ++r) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      ns.push_back(static_cast<uint32_t>(x >> 32));
      ns.push_back(static_cast<uint32_t>(x >> 45) * d);
    }
    for (uint32_t n : ns) ASSERT_EQ(vec::Div(n, f), n / d) << n << " / " << d;
  }
}

// A raw row that is not 16-byte aligned, or a dim that is not a multiple of 8, leaves the job to
// the per-element path.
TEST(VecCodecJobTest, FastPathNeedsDimMultipleOf8AndAlignedRows) {
  internal::SegmentShape sh;
  sh.tokens = 16;
  sh.heads = 2;
  sh.dim = 64;
  alignas(16) static uint16_t buf[16 * 2 * 64 + 8];
  uint8_t payload[8];
  EXPECT_EQ(internal::MakeSegmentJob(CodecId::kFp8, sh, payload, buf).vec, 1);
  EXPECT_EQ(internal::MakeSegmentJob(CodecId::kFp8, sh, payload, buf + 1).vec, 0);
  sh.dim = 20;
  EXPECT_EQ(internal::MakeSegmentJob(CodecId::kFp8, sh, payload, buf).vec, 0);
}

}  // namespace
}  // namespace proxima::codec
