// The 8-element arithmetic of the CUDA fast path (kernels/internal/vec_codec.h) run on the CPU,
// phase by phase as the kernels run it, against the scalar reference: DecodeVec gives the bytes
// DecodeBlock gives, and the fused encode phases write the payload EncodeBlock writes, for every
// codec the fast path takes, both dtypes, several geometries and adversarial inputs. The GPU run
// of the same functions is checked by kernels_codec_cuda_test on a machine with a GPU.
#include "kernels/internal/vec_codec.h"

#include <cstring>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
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

template <uint8_t kDt>
void DecodeAll(const SegmentJob& j, uint16_t* out) {
  for (uint32_t v = 0; v < j.elements / 8; ++v) vec::DecodeVec<kDt>(j, v, out + 8 * v);
}

template <uint8_t kDt>
void EncodeAll(const SegmentJob& j) {
  for (uint32_t h = 0; h < j.heads; ++h) {
    std::vector<int32_t> stats(vec::StatsWords(j) + 1);
    for (uint32_t w = 0; w < vec::StatsWords(j); ++w) stats[w] = vec::InitStat(j, w);
    for (uint32_t u = 0; u < vec::HeadVecs(j); ++u) vec::AccumulateVec<kDt>(j, h, u, stats.data());
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
        ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info,
                             InspectBlock(std::as_bytes(std::span<const char>(enc))));
        std::vector<uint16_t> got(g.RawBytes() / 2, 0xDEAD);
        const size_t seg_elems = g.SegmentElements();
        for (uint32_t s = 0; s < info.segments.size(); ++s) {
          const SegmentJob j = internal::MakeSegmentJob(
              info.segments[s].codec, internal::SegmentShapeFor(g, s, info.segments[s].group_size),
              reinterpret_cast<uint8_t*>(enc.data() + info.segments[s].offset),
              got.data() + s * seg_elems);
          ASSERT_EQ(j.vec, 1) << "segment " << s;
          if (dtype == DType::kBf16) {
            DecodeAll<numeric::kDtypeBf16>(j, got.data() + s * seg_elems);
          } else {
            DecodeAll<numeric::kDtypeFp16>(j, got.data() + s * seg_elems);
          }
        }
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

INSTANTIATE_TEST_SUITE_P(Plans, VecCodecTest,
                         ::testing::Values("raw", "fp8", "int8", "int4,group=32", "int4,group=64",
                                           "int4,group=128", "int2,group=32", "int2,group=64",
                                           "int2,group=128",
                                           "layers[0:1]=int8,default=int4,sink=fp8", "star"));

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
