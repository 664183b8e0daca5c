#include "kernels/codec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>

#include "common/bytes.h"
#include "common/crc32c.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/error_metrics.h"
#include "kernels/internal/container.h"
#include "kernels/internal/numeric.h"
#include "kernels/internal/test_blocks.h"

namespace proxima::codec {
namespace {

using ::proxima::codec::internal::MakeBlock;
using ::proxima::codec::internal::Pattern;
using ::proxima::testing::IsOk;
using ::proxima::testing::StatusIs;
using ::testing::HasSubstr;

BlockGeometry Geo(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t tokens,
                  DType dtype = DType::kBf16) {
  return BlockGeometry{layers, heads, dim, tokens, dtype};
}

CodecPlan Plan(std::string_view text) {
  absl::StatusOr<CodecPlan> plan = ParseCodecPlan(text);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : CodecPlan{};
}

std::string Encode(const BlockGeometry& g, const CodecPlan& plan, const std::vector<std::byte>& raw,
                   bool first = false) {
  std::string out;
  EXPECT_OK(EncodeBlock(g, plan, first, raw, {}, &out));
  return out;
}

std::vector<std::byte> Decode(const std::string& enc, size_t raw_bytes) {
  std::vector<std::byte> out(raw_bytes);
  EXPECT_OK(DecodeBlock(AsBytes(enc), out));
  return out;
}

// ---------------------------------------------------------------------------- plans

TEST(CodecPlanTest, ParsesTheIssueExample) {
  ASSERT_OK_AND_ASSIGN(CodecPlan plan,
                       ParseCodecPlan("layers[0:4]=int8,default=int4,sink=int8,group=64"));
  EXPECT_EQ(plan.default_codec, CodecId::kInt4);
  ASSERT_EQ(plan.layer_ranges.size(), 1u);
  EXPECT_EQ(plan.layer_ranges[0].end, 4u);
  EXPECT_EQ(plan.CodecFor(0, false), CodecId::kInt8);
  EXPECT_EQ(plan.CodecFor(3, false), CodecId::kInt8);
  EXPECT_EQ(plan.CodecFor(4, false), CodecId::kInt4);
  EXPECT_EQ(plan.CodecFor(4, true), CodecId::kInt8);  // sink block: safer level
  ASSERT_OK_AND_ASSIGN(CodecPlan again, ParseCodecPlan(plan.ToString()));
  EXPECT_EQ(again.ToString(), plan.ToString());
}

TEST(CodecPlanTest, SinkNeverLowersFidelity) {
  CodecPlan plan = Plan("layers[0:2]=raw,default=int2,sink=fp8");
  EXPECT_EQ(plan.CodecFor(0, true), CodecId::kRaw);
  EXPECT_EQ(plan.CodecFor(5, true), CodecId::kFp8);
  EXPECT_EQ(plan.CodecFor(5, false), CodecId::kInt2);
}

TEST(CodecPlanTest, BareCodecIsTheDefault) {
  CodecPlan plan = Plan("star");
  EXPECT_EQ(plan.default_codec, CodecId::kStar);
  EXPECT_EQ(plan.group_size, 64u);
}

TEST(CodecPlanTest, RejectsMalformedItemsByName) {
  for (const char* bad : {"", "int3", "default=int4,default=int8", "group=48", "layers[4:2]=int8",
                          "layers[a:2]=int8", "layers[0:2=int8", "sink=zip", "foo=int4"}) {
    EXPECT_THAT(ParseCodecPlan(bad), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_))
        << bad;
  }
  EXPECT_THAT(ParseCodecPlan("group=48"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group=48")));
}

// ---------------------------------------------------------------------------- exact codecs

class ExactRoundTripTest : public ::testing::TestWithParam<std::tuple<CodecId, DType>> {};

TEST_P(ExactRoundTripTest, IsBitExactForEveryBitPattern) {
  auto [codec, dtype] = GetParam();
  CodecPlan plan;
  plan.default_codec = codec;
  // The odd geometry leaves tails after every 4- and 8-element fast path.
  for (BlockGeometry g :
       {Geo(3, 2, 64, 16, dtype), Geo(2, 1, 5, 3, dtype), Geo(1, 3, 7, 37, dtype)}) {
    for (Pattern p : {Pattern::kKvLike, Pattern::kRandomBits, Pattern::kAdversarial}) {
      std::vector<std::byte> raw = MakeBlock(g, p, 7);
      std::string enc = Encode(g, plan, raw);
      EXPECT_EQ(Decode(enc, g.RawBytes()), raw) << g.head_dim;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllExact, ExactRoundTripTest,
                         ::testing::Combine(::testing::Values(CodecId::kRaw, CodecId::kLossless),
                                            ::testing::Values(DType::kBf16, DType::kFp16)));

TEST(LosslessTest, CompressesKvLikeBf16) {
  BlockGeometry g = Geo(4, 3, 64, 64);
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 3);
  std::string enc = Encode(g, Plan("lossless"), raw);
  const double ratio = static_cast<double>(g.RawBytes()) / enc.size();
  // Synthetic Gaussian data; the >= 1.4x target is about real KV (docs/benchmarks.md).
  EXPECT_GT(ratio, 1.25) << ratio;
  EXPECT_EQ(Decode(enc, g.RawBytes()), raw);
}

TEST(LosslessTest, FallsBackToStoredWhenIncompressible) {
  BlockGeometry g = Geo(1, 1, 64, 16);
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kRandomBits, 9);
  std::string enc = Encode(g, Plan("lossless"), raw);
  EXPECT_LE(enc.size(), g.RawBytes() + 48 + 32 + 2);
  EXPECT_EQ(Decode(enc, g.RawBytes()), raw);
}

// ---------------------------------------------------------------------------- lossy codecs

struct LossyCase {
  const char* plan;
  double max_rel_l2;  // on the synthetic KV-like data
  double min_ratio;   // at the geometry of the test
};

class LossyRoundTripTest : public ::testing::TestWithParam<LossyCase> {};

TEST_P(LossyRoundTripTest, StaysWithinErrorAndRatio) {
  const LossyCase& c = GetParam();
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    BlockGeometry g = Geo(2, 3, 64, 64, dtype);
    std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 11);
    std::string enc = Encode(g, Plan(c.plan), raw);
    std::vector<std::byte> dec = Decode(enc, g.RawBytes());
    ASSERT_OK_AND_ASSIGN(ErrorSums sums, MeasureBlockError(g, raw, dec));
    ErrorFigures f = Finish(sums);
    EXPECT_LT(f.k_rel_l2, c.max_rel_l2) << c.plan;
    EXPECT_LT(f.v_rel_l2, c.max_rel_l2) << c.plan;
    // The synthetic keys have outlier channels, so attention is sharp and amplifies key error.
    EXPECT_LT(f.attn_rel_l2, 3 * c.max_rel_l2) << c.plan;
    std::printf("%s %s: K %.4f V %.4f attn %.4f ratio %.2f (synthetic)\n", c.plan,
                dtype == DType::kBf16 ? "bf16" : "fp16", f.k_rel_l2, f.v_rel_l2, f.attn_rel_l2,
                static_cast<double>(g.RawBytes()) / enc.size());
    EXPECT_GT(f.k_rel_l2, 0.0) << c.plan;  // lossy: a zero would mean the codec did nothing
    const double ratio = static_cast<double>(g.RawBytes()) / enc.size();
    EXPECT_GE(ratio, c.min_ratio) << c.plan;
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllLossy, LossyRoundTripTest,
    ::testing::Values(LossyCase{"int8", 0.01, 1.9}, LossyCase{"fp8", 0.05, 1.99},
                      LossyCase{"int4,group=64", 0.12, 3.5}, LossyCase{"int4,group=32", 0.10, 3.1},
                      LossyCase{"int4,group=128", 0.12, 3.5}, LossyCase{"int2,group=64", 0.5, 5.0},
                      LossyCase{"int2,group=128", 0.5, 5.0}, LossyCase{"star", 0.75, 6.0},
                      LossyCase{"k4v3,rope_theta=10000", 0.25, 4.0},
                      LossyCase{"k4v3,group=32", 0.25, 3.4}));

// Per element: |x' - x| <= scale / 2 of the element's group, plus the dtype's output rounding.
TEST(Int4Test, EveryElementWithinHalfAStep) {
  BlockGeometry g = Geo(1, 2, 64, 100);  // 100 tokens: a partial last K group
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 5);
  std::vector<std::byte> dec = Decode(Encode(g, Plan("int4,group=32"), raw), g.RawBytes());
  auto val = [&](const std::vector<std::byte>& b, size_t i) {
    uint16_t v;
    std::memcpy(&v, b.data() + 2 * i, 2);
    return numeric::Bf16ToFloat(v);
  };
  const size_t hd = 2 * 64, n = g.SegmentElements();
  for (size_t c = 0; c < hd; ++c) {  // K: groups of 32 tokens per channel
    for (size_t t0 = 0; t0 < 100; t0 += 32) {
      float mn = INFINITY, mx = -INFINITY;
      for (size_t t = t0; t < std::min<size_t>(t0 + 32, 100); ++t) {
        mn = std::min(mn, val(raw, t * hd + c));
        mx = std::max(mx, val(raw, t * hd + c));
      }
      const float step = (mx - mn) / 15.0f;
      for (size_t t = t0; t < std::min<size_t>(t0 + 32, 100); ++t) {
        float x = val(raw, t * hd + c), y = val(dec, t * hd + c);
        ASSERT_LE(std::fabs(x - y), step * 0.5f * 1.01f + std::fabs(y) / 128.0f + 1e-30f)
            << "channel " << c << " token " << t;
      }
    }
  }
  for (size_t row = 0; row < 100 * 2; ++row) {  // V: one group of 32 channels
    for (size_t d0 = 0; d0 < 64; d0 += 32) {
      float mn = INFINITY, mx = -INFINITY;
      for (size_t d = d0; d < d0 + 32; ++d) {
        mn = std::min(mn, val(raw, n + row * 64 + d));
        mx = std::max(mx, val(raw, n + row * 64 + d));
      }
      const float step = (mx - mn) / 15.0f;
      for (size_t d = d0; d < d0 + 32; ++d) {
        float x = val(raw, n + row * 64 + d), y = val(dec, n + row * 64 + d);
        ASSERT_LE(std::fabs(x - y), step * 0.5f * 1.01f + std::fabs(y) / 128.0f + 1e-30f);
      }
    }
  }
}

// NaN inputs never come back as NaN (lossy codecs do not carry NaN; docs/format.md section 2).
// Outputs may be +-Inf where a bf16 group spans more than float's range.
TEST(LossyTest, NonFiniteInputsNeverDecodeToNaN) {
  for (const char* plan : {"int8", "fp8", "int4", "int2", "star", "k4v3"}) {
    for (DType dtype : {DType::kBf16, DType::kFp16}) {
      BlockGeometry g = Geo(2, 2, 64, 32, dtype);
      std::vector<std::byte> raw = MakeBlock(g, Pattern::kAdversarial, 13);
      std::vector<std::byte> dec = Decode(Encode(g, Plan(plan), raw), g.RawBytes());
      for (size_t i = 0; i < dec.size() / 2; ++i) {
        uint16_t v;
        std::memcpy(&v, dec.data() + 2 * i, 2);
        ASSERT_FALSE(std::isnan(numeric::DtypeToFloat(static_cast<uint8_t>(dtype), v)))
            << plan << " element " << i;
      }
    }
  }
}

TEST(StarTest, ImportantTokenKeepsInt8Accuracy) {
  BlockGeometry g = Geo(1, 1, 64, 64);
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 17);
  std::vector<float> importance(64, 0.0f);
  importance[41] = 10.0f;
  std::string enc;
  ASSERT_OK(EncodeBlock(g, Plan("star"), false, raw, importance, &enc));
  std::vector<std::byte> dec = Decode(enc, g.RawBytes());
  double err = 0, ref = 0, err_other = 0, ref_other = 0;
  for (size_t d = 0; d < 64; ++d) {
    for (size_t t : {size_t{41}, size_t{3}}) {
      uint16_t a, b;
      std::memcpy(&a, raw.data() + 2 * (t * 64 + d), 2);
      std::memcpy(&b, dec.data() + 2 * (t * 64 + d), 2);
      double x = numeric::Bf16ToFloat(a), y = numeric::Bf16ToFloat(b);
      (t == 41 ? err : err_other) += (x - y) * (x - y);
      (t == 41 ? ref : ref_other) += x * x;
    }
  }
  EXPECT_LT(std::sqrt(err / ref), 0.03);  // int8 with an outlier channel, then bf16 rounding
  EXPECT_GT(std::sqrt(err_other / ref_other), 0.1);
  EXPECT_THAT(EncodeBlock(g, Plan("star"), false, raw, std::vector<float>(3), &enc),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("importance")));
}

// ---------------------------------------------------------------------------- container

TEST(ContainerTest, MixedPlanRecordsCodecsPerSegment) {
  BlockGeometry g = Geo(6, 2, 64, 32);
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 19);
  CodecPlan plan = Plan("layers[0:2]=raw,layers[2:3]=lossless,default=int4,sink=int8,group=32");
  for (bool first : {false, true}) {
    std::string enc = Encode(g, plan, raw, first);
    ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info, InspectBlock(AsBytes(enc)));
    EXPECT_EQ(info.geometry, g);
    EXPECT_EQ(info.is_first_block, first);
    EXPECT_EQ(info.raw_bytes, g.RawBytes());
    EXPECT_EQ(info.encoded_bytes, enc.size());
    ASSERT_EQ(info.segments.size(), 12u);
    EXPECT_EQ(info.segments[0].codec, CodecId::kRaw);
    EXPECT_EQ(info.segments[5].codec, CodecId::kLossless);
    EXPECT_EQ(info.segments[6].codec, first ? CodecId::kInt8 : CodecId::kInt4);
    EXPECT_EQ(info.segments[6].group_size, first ? 0u : 32u);
    std::vector<std::byte> dec = Decode(enc, g.RawBytes());
    // Exact layers come back exactly.
    EXPECT_EQ(std::memcmp(dec.data(), raw.data(), 6 * g.SegmentElements() * 2), 0);
  }
}

// The tierer plans how deep to encode a block from these sizes before encoding it, so they must
// be the encoder's exact output sizes, metadata and container included.
TEST(ContainerTest, EncodedBytesIsTheEncodersSizeWithoutEncoding) {
  const std::vector<std::string_view> plans = {
      "raw",
      "fp8",
      "int8",
      "int4",
      "int2,group=32",
      "int4,group=128",
      "star",
      "layers[0:2]=int8,default=int4,sink=int8",
      "layers[0:1]=raw,default=int2,sink=fp8,group=32",
      "k4v3,rope_theta=10000",
      "layers[0:1]=int8,default=k4v3,sink=int4,group=128",
  };
  // Odd shapes: tokens not a multiple of the group, one head, 2 tokens (int4 larger than int8).
  for (const BlockGeometry& g :
       {Geo(6, 2, 64, 32), Geo(3, 1, 16, 5, DType::kFp16), Geo(4, 3, 64, 2), Geo(2, 4, 128, 96)}) {
    std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 31);
    for (std::string_view text : plans) {
      for (bool first : {false, true}) {
        std::optional<size_t> predicted = EncodedBytes(g, Plan(text), first);
        ASSERT_TRUE(predicted.has_value()) << text;
        EXPECT_EQ(*predicted, Encode(g, Plan(text), raw, first).size())
            << text << " first=" << first << " layers=" << g.num_layers
            << " tokens=" << g.tokens_per_block;
      }
    }
  }
  // Lossless sizes depend on the data: unknown, also when only the first block has it.
  BlockGeometry g = Geo(2, 2, 16, 8);
  EXPECT_FALSE(EncodedBytes(g, Plan("lossless"), false).has_value());
  EXPECT_FALSE(EncodedBytes(g, Plan("layers[0:1]=lossless,default=int4"), false).has_value());
  EXPECT_FALSE(EncodedBytes(g, Plan("int4,sink=lossless"), true).has_value());
  EXPECT_TRUE(EncodedBytes(g, Plan("int4,sink=lossless"), false).has_value());
  // What EncodeBlock refuses has no size.
  EXPECT_FALSE(EncodedBytes(Geo(0, 1, 8, 4), Plan("int8"), false).has_value());
  CodecPlan bad_group = Plan("int4");
  bad_group.group_size = 48;
  EXPECT_FALSE(EncodedBytes(g, bad_group, false).has_value());
  // k4v3 takes a head_dim that is not a power of two (V's transform runs on its chunks).
  EXPECT_TRUE(EncodedBytes(Geo(2, 2, 48, 8), Plan("k4v3"), false).has_value());
}

TEST(ContainerTest, RejectsBadArguments) {
  BlockGeometry g = Geo(1, 1, 8, 4);
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 1);
  std::string enc;
  EXPECT_THAT(EncodeBlock(g, Plan("int8"), false, std::span(raw).subspan(1), {}, &enc),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("raw block")));
  EXPECT_THAT(EncodeBlock(Geo(0, 1, 8, 4), Plan("int8"), false, raw, {}, &enc),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("geometry")));
  enc = Encode(g, Plan("int8"), raw);
  std::vector<std::byte> small(g.RawBytes() - 2);
  EXPECT_THAT(DecodeBlock(AsBytes(enc), small),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("output")));
}

class HostileInputTest : public ::testing::TestWithParam<const char*> {};

// Every truncation and every single-byte corruption is an error, never a crash (ASan/UBSan
// builds and the fuzzer check the "never out of bounds" half).
TEST_P(HostileInputTest, TruncationAndCorruptionAreErrors) {
  BlockGeometry g = Geo(2, 2, 16, 8);
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 23);
  const std::string enc = Encode(g, Plan(GetParam()), raw);
  std::vector<std::byte> out(g.RawBytes());
  for (size_t len = 0; len < enc.size(); ++len) {
    ASSERT_FALSE(DecodeBlock(AsBytes(enc).subspan(0, len), out).ok()) << len;
  }
  for (size_t i = 0; i < enc.size(); ++i) {
    std::string bad = enc;
    bad[i] = static_cast<char>(bad[i] ^ 0x5A);
    absl::Status s = DecodeBlock(AsBytes(bad), out);
    ASSERT_FALSE(s.ok()) << "byte " << i;
    if (i >= internal::kHeaderBytes) {  // past the fixed header: the CRCs catch it
      ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << "byte " << i << ": " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, HostileInputTest,
                         ::testing::Values("raw", "lossless", "fp8", "int8", "int4", "int2", "star",
                                           "k4v3,rope_theta=10000"));

// InspectBlockHeader checks everything InspectBlock does except the payload CRC, and reports the
// stored payload CRC so that another checker (the GPU) can compare it.
TEST(HostileInputTest, InspectBlockHeaderLeavesOnlyThePayloadCrcToTheCaller) {
  BlockGeometry g = Geo(2, 2, 16, 8);
  const std::string enc = Encode(g, Plan("int4"), MakeBlock(g, Pattern::kKvLike, 5));
  ASSERT_OK_AND_ASSIGN(BlockHeaderInfo whole, InspectBlock(AsBytes(enc)));
  ASSERT_OK_AND_ASSIGN(BlockHeaderInfo header, InspectBlockHeader(AsBytes(enc)));
  const size_t payload = whole.segments[0].offset;
  EXPECT_EQ(header.payload_crc, Crc32c(AsBytes(enc).subspan(payload)));
  EXPECT_EQ(whole.payload_crc, header.payload_crc);
  std::string bad_payload = enc;
  bad_payload[payload + 3] ^= 0x10;
  EXPECT_THAT(InspectBlock(AsBytes(bad_payload)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("payload")));
  ASSERT_OK_AND_ASSIGN(BlockHeaderInfo still, InspectBlockHeader(AsBytes(bad_payload)));
  EXPECT_NE(Crc32c(AsBytes(bad_payload).subspan(payload)), still.payload_crc);
  std::string bad_table = enc;
  bad_table[internal::kHeaderBytes + 8] ^= 0x01;  // a segment size in the table
  EXPECT_FALSE(InspectBlockHeader(AsBytes(bad_table)).ok());
}

TEST(HostileInputTest, WrongVersionIsUnimplemented) {
  BlockGeometry g = Geo(1, 1, 8, 4);
  std::string enc = Encode(g, Plan("int8"), MakeBlock(g, Pattern::kKvLike, 1));
  enc[8] = 2;
  internal::ResealBlockForFuzzing(std::as_writable_bytes(std::span<char>(enc.data(), enc.size())));
  EXPECT_THAT(InspectBlock(AsBytes(enc)),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("version")));
}

TEST(HostileInputTest, LyingSizesAreRejectedEvenWithValidCrcs) {
  BlockGeometry g = Geo(2, 1, 8, 4);
  const std::string good = Encode(g, Plan("int4"), MakeBlock(g, Pattern::kKvLike, 1));
  auto reseal = [](std::string* s) {
    internal::ResealBlockForFuzzing(std::as_writable_bytes(std::span<char>(s->data(), s->size())));
  };
  std::vector<std::byte> out(g.RawBytes());
  {  // segment 0 claims one byte more, segment 1 one byte less: the sum still matches
    std::string bad = good;
    uint64_t a, b;
    std::memcpy(&a, bad.data() + 48 + 8, 8);
    std::memcpy(&b, bad.data() + 64 + 8, 8);
    ++a;
    --b;
    std::memcpy(bad.data() + 48 + 8, &a, 8);
    std::memcpy(bad.data() + 64 + 8, &b, 8);
    reseal(&bad);
    EXPECT_THAT(DecodeBlock(AsBytes(bad), out),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected")));
  }
  {  // a huge geometry with a tiny body
    std::string bad = good;
    uint32_t tokens = 65536;
    std::memcpy(bad.data() + 24, &tokens, 4);
    reseal(&bad);
    EXPECT_THAT(InspectBlock(AsBytes(bad)),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  }
  {  // a NaN scale that passes the CRC
    std::string bad = good;
    const uint16_t nan = 0x7FC0;
    std::memcpy(bad.data() + 48 + 4 * 16, &nan, 2);  // first scale of segment 0
    reseal(&bad);
    EXPECT_THAT(DecodeBlock(AsBytes(bad), out),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-finite")));
  }
  {  // an unknown codec id
    std::string bad = good;
    bad[48] = 42;
    reseal(&bad);
    EXPECT_THAT(InspectBlock(AsBytes(bad)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown codec")));
  }
}

TEST(HostileInputTest, CorruptLosslessStreamIsAnError) {
  BlockGeometry g = Geo(1, 2, 64, 32);
  std::string enc = Encode(g, Plan("lossless"), MakeBlock(g, Pattern::kKvLike, 29));
  const size_t payload0 = 48 + 2 * 16;
  ASSERT_EQ(enc[payload0], 2) << "expected a Huffman-coded segment";
  // Code lengths (nibbles from payload0 + 3) and the four stream sizes after them.
  const size_t range = static_cast<uint8_t>(enc[payload0 + 2]) -
                       static_cast<uint8_t>(enc[payload0 + 1]) + 1;
  const size_t body = payload0 + 3 + (range + 1) / 2 + 16;
  std::vector<std::byte> out(g.RawBytes());
  int rejected_header = 0, rejected_body = 0;
  for (size_t i = payload0 + 2; i < body + 200; ++i) {
    std::string bad = enc;
    bad[i] = static_cast<char>(bad[i] ^ 0x21);
    internal::ResealBlockForFuzzing(
        std::as_writable_bytes(std::span<char>(bad.data(), bad.size())));
    absl::Status s = DecodeBlock(AsBytes(bad), out);
    (i < body ? rejected_header : rejected_body) += !s.ok();
  }
  // Every flip of the last symbol, a code length or a stream size is caught; inside the streams
  // a flip changes which codes follow, and the exact stream sizes catch most (the payload
  // CRC is what catches corruption; these checks keep the decoder within the data).
  EXPECT_EQ(rejected_header, static_cast<int>(body - payload0 - 2));
  EXPECT_GT(rejected_body, 100);
}

// ---------------------------------------------------------------------------- batch API

// ---------------------------------------------------------------------------- k4v3

TEST(K4v3Test, PlanCarriesTheRopeBaseThroughItsTextForm) {
  ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan("int8,layers[4:30]=k4v3,rope_theta=100000"));
  EXPECT_EQ(plan.CodecFor(5, false), CodecId::kK4v3);
  EXPECT_EQ(plan.rope_theta, 100000.0);
  ASSERT_OK_AND_ASSIGN(CodecPlan again, ParseCodecPlan(plan.ToString()));
  EXPECT_EQ(again.rope_theta, 100000.0);
  EXPECT_EQ(again.ToString(), plan.ToString());
  ASSERT_OK_AND_ASSIGN(CodecPlan odd, ParseCodecPlan("k4v3,rope_theta=123456.789"));
  ASSERT_OK_AND_ASSIGN(CodecPlan odd_again, ParseCodecPlan(odd.ToString()));
  EXPECT_EQ(odd_again.rope_theta, 123456.789);
  EXPECT_EQ(Plan("k4v3").rope_theta, 0.0);
  EXPECT_EQ(Plan("k4v3").ToString().find("rope_theta"), std::string::npos);
  for (const char* bad :
       {"k4v3,rope_theta=0", "k4v3,rope_theta=-5", "k4v3,rope_theta=nan", "k4v3,rope_theta=1e13",
        "k4v3,rope_theta=x", "k4v3,rope_theta=10000,rope_theta=10000"}) {
    EXPECT_THAT(ParseCodecPlan(bad).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rope_theta")))
        << bad;
  }
  EXPECT_GT(Fidelity(CodecId::kInt4), Fidelity(CodecId::kK4v3));
  EXPECT_GT(Fidelity(CodecId::kK4v3), Fidelity(CodecId::kStar));
}

// A plan for a model: the plan's own rope_theta wins; without one, the model's (0: unknown).
TEST(K4v3Test, APlanTakesTheModelsRopeBaseOnlyWhenItNamesNone) {
  EXPECT_EQ(Plan("k4v3").ForModel(500000).rope_theta, 500000.0);
  EXPECT_EQ(Plan("k4v3").ForModel(0).rope_theta, 0.0);
  EXPECT_EQ(Plan("k4v3,rope_theta=10000").ForModel(500000).rope_theta, 10000.0);
  EXPECT_EQ(Plan("layers[0:2]=int8,default=k4v3").ForModel(1e6).ToString(),
            "layers[0:2]=int8,default=k4v3,group=64,rope_theta=1000000");
  for (double ok : {0.0, 1.0, 10000.0, 1e12}) EXPECT_TRUE(RopeThetaValid(ok)) << ok;
  for (double bad : {-1.0, 0.5, 1.000001e12, std::nan(""), HUGE_VAL}) {
    EXPECT_FALSE(RopeThetaValid(bad)) << bad;
  }
}

TEST(K4v3Test, SinCosIsCloseToLibmAndExactAtZero) {
  float s, c;
  numeric::SinCosF32(0.0f, &s, &c);
  EXPECT_EQ(s, 0.0f);
  EXPECT_EQ(c, 1.0f);
  double worst = 0.0;
  for (float x = 0.0f; x < 65536.0f; x = x * 1.01f + 0.013f) {
    numeric::SinCosF32(x, &s, &c);
    worst =
        std::max({worst, std::fabs(s - std::sin(double{x})), std::fabs(c - std::cos(double{x}))});
  }
  EXPECT_LT(worst, 2e-6);
}

// Keys as a model writes them: one fixed pre-RoPE vector per head (with an outlier channel),
// turned by RoPE at each token's absolute position. In the block's own frame every channel is
// constant along the tokens, so k4v3 given the model's RoPE base keeps K far more exactly than
// int4 does (and than k4v3 without the base, which quantizes K as int4 does), wherever the block
// starts in its sequence.
TEST(K4v3Test, KeysInTheirRopeFrameQuantizeAlmostExactly) {
  const double theta = 10000.0;
  BlockGeometry g = Geo(1, 2, 64, 64);
  for (uint32_t start : {0u, 16u, 4096u}) {
    std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 3);
    const uint32_t D = g.head_dim, half = D / 2;
    for (uint32_t t = 0; t < g.tokens_per_block; ++t) {
      for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
        for (uint32_t j = 0; j < half; ++j) {
          const double a = (start + t) * std::pow(theta, -2.0 * j / D);
          const double x1 = std::sin(j + 3.0 * h) + (j == 5 ? 12.0 : 0.0);
          const double x2 = std::cos(1.7 * j - h);
          const size_t i = (size_t{t} * g.num_kv_heads + h) * D + j;
          const uint16_t y1 =
              numeric::FloatToBf16(static_cast<float>(x1 * std::cos(a) - x2 * std::sin(a)));
          const uint16_t y2 =
              numeric::FloatToBf16(static_cast<float>(x2 * std::cos(a) + x1 * std::sin(a)));
          std::memcpy(raw.data() + 2 * i, &y1, 2);
          std::memcpy(raw.data() + 2 * (i + half), &y2, 2);
        }
      }
    }
    auto k_error = [&](const char* plan) {
      std::vector<std::byte> dec = Decode(Encode(g, Plan(plan), raw), g.RawBytes());
      absl::StatusOr<ErrorSums> sums = MeasureBlockError(g, raw, dec);
      EXPECT_OK(sums.status());
      return sums.ok() ? Finish(*sums).k_rel_l2 : 1.0;
    };
    const double framed = k_error("k4v3,rope_theta=10000");
    const double unframed = k_error("k4v3");
    const double int4 = k_error("int4");
    EXPECT_LT(framed, 0.25 * int4) << "start " << start;
    EXPECT_LT(framed, 0.25 * unframed) << "start " << start;
    EXPECT_NEAR(unframed, int4, 0.1 * int4) << "start " << start;
  }
}

// A K segment whose rotation table is too large to keep per thread (4096 tokens x 64 pairs)
// builds it for each call: the same bytes every time, and a round trip within the usual error.
TEST(K4v3Test, LargeRopeTablesAreBuiltPerCallWithTheSameResult) {
  BlockGeometry g = Geo(1, 1, 128, 4096);
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 12);
  const std::string a = Encode(g, Plan("k4v3,rope_theta=10000"), raw);
  EXPECT_EQ(Encode(g, Plan("k4v3,rope_theta=10000"), raw), a);
  std::vector<std::byte> dec = Decode(a, g.RawBytes());
  ASSERT_OK_AND_ASSIGN(ErrorSums sums, MeasureBlockError(g, raw, dec));
  EXPECT_LT(Finish(sums).k_rel_l2, 0.12);
  EXPECT_LT(Finish(sums).v_rel_l2, 0.25);
}

// V's 3-bit codes after the signed Hadamard rotation: one scale per (token, head), every element
// within half a step of the rotated value (checked through the decoder, which rotates back:
// the error's L2 norm per vector is at most half a step times sqrt(D), plus output rounding).
TEST(K4v3Test, ValueErrorPerVectorIsBoundedByItsStep) {
  // Powers of two (one transform chunk) and other dims (several: 96 is 64 + 32, 100 is
  // 64 + 32 + 4, 5 is 4 + 1), each chunk orthonormal, so the bound is the same.
  for (auto [dtype, dim] :
       {std::pair{DType::kBf16, 64u}, std::pair{DType::kFp16, 64u}, std::pair{DType::kBf16, 96u},
        std::pair{DType::kFp16, 80u}, std::pair{DType::kBf16, 100u}, std::pair{DType::kBf16, 5u}}) {
    SCOPED_TRACE(dim);
    BlockGeometry g = Geo(1, 3, dim, 16, dtype);
    std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 9);
    std::string enc = Encode(g, Plan("k4v3"), raw);
    std::vector<std::byte> dec = Decode(enc, g.RawBytes());
    ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info, InspectBlock(AsBytes(enc)));
    const SegmentInfo& v = info.segments[1];
    const size_t n = g.SegmentElements(), D = g.head_dim;
    for (size_t row = 0; row < size_t{g.tokens_per_block} * g.num_kv_heads; ++row) {
      uint16_t sbits;
      std::memcpy(&sbits, enc.data() + v.offset + 2 * row, 2);
      const double step = numeric::DtypeToFloat(static_cast<uint8_t>(dtype), sbits);
      double err2 = 0.0, norm2 = 0.0;
      for (size_t d = 0; d < D; ++d) {
        uint16_t a, b;
        std::memcpy(&a, raw.data() + 2 * (n + row * D + d), 2);
        std::memcpy(&b, dec.data() + 2 * (n + row * D + d), 2);
        const double x = numeric::DtypeToFloat(static_cast<uint8_t>(dtype), a);
        const double y = numeric::DtypeToFloat(static_cast<uint8_t>(dtype), b);
        err2 += (x - y) * (x - y);
        norm2 += x * x;
      }
      ASSERT_LE(std::sqrt(err2),
                0.5 * step * std::sqrt(double(D)) * 1.01 + std::sqrt(norm2) / 128.0)
          << "row " << row;
    }
  }
}

// The V transform of a head_dim that is not a power of two, as docs/format.md defines it: on
// the chunks of the dim's binary decomposition, largest first (96: [0, 64) and [64, 96)), each
// normalised by 1/sqrt of its own length. A hand-made V payload (a scale and codes) decodes to
// what this test computes from the definition, element for element; a change that moves a chunk
// boundary, reorders the chunks or shares one normalisation fails it.
TEST(K4v3Test, ValueTransformOfADimThatIsNotAPowerOfTwoIsTheChunkedOneOfTheFormat) {
  for (uint32_t D : {96u, 80u, 100u, 12u, 5u}) {
    SCOPED_TRACE(D);
    const BlockGeometry g = Geo(1, 1, D, 2);
    std::string enc = Encode(g, Plan("k4v3"), MakeBlock(g, Pattern::kKvLike, 6));
    ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info, InspectBlock(AsBytes(enc)));
    const SegmentInfo& v = info.segments[1];
    // Rows' scales 1.5 and -0.25 (bf16 0x3FC0, 0xBE80), then random 3-bit codes.
    const uint16_t scales[2] = {0x3FC0, 0xBE80};
    std::memcpy(enc.data() + v.offset, scales, 4);
    std::mt19937 rng(D);
    std::vector<uint8_t> codes(2 * D);
    for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() % 8);
    std::vector<uint8_t> packed((3 * codes.size() + 7) / 8, 0);
    for (size_t i = 0; i < codes.size(); ++i) {
      for (int b = 0; b < 3; ++b) {
        if ((codes[i] >> b) & 1)
          packed[(3 * i + b) / 8] |= static_cast<uint8_t>(1u << ((3 * i + b) % 8));
      }
    }
    ASSERT_EQ(v.bytes, 4 + packed.size());
    std::memcpy(enc.data() + v.offset + 4, packed.data(), packed.size());
    internal::ResealBlockForFuzzing(
        std::as_writable_bytes(std::span<char>(enc.data(), enc.size())));
    const std::vector<std::byte> dec = Decode(enc, g.RawBytes());
    for (uint32_t row = 0; row < 2; ++row) {
      const float scale = numeric::Bf16ToFloat(scales[row]);
      for (uint32_t o = 0, len = 0; o < D; o += len) {
        len = 1;
        while (2 * len <= D - o) len *= 2;  // the largest power of two that fits what is left
        std::vector<float> u(len);
        for (uint32_t k = 0; k < len; ++k) u[k] = static_cast<float>(codes[row * D + o + k]) - 3.5f;
        for (uint32_t h = 1; h < len; h *= 2) {  // unnormalised Walsh-Hadamard (exact here)
          for (uint32_t i = 0; i < len; i += 2 * h) {
            for (uint32_t k = i; k < i + h; ++k) {
              const float a = u[k], b = u[k + h];
              u[k] = a + b;
              u[k + h] = a - b;
            }
          }
        }
        const float step = scale * static_cast<float>(1.0 / std::sqrt(static_cast<double>(len)));
        for (uint32_t k = 0; k < len; ++k) {
          const uint32_t d = o + k;
          const float flip = ((d * 0x9E3779B1u) >> 31) != 0 ? -1.0f : 1.0f;
          const uint16_t want = numeric::FloatToBf16((u[k] * step) * flip);
          uint16_t got;
          std::memcpy(&got, dec.data() + 2 * (size_t{g.SegmentElements()} + row * D + d), 2);
          ASSERT_EQ(got, want) << "row " << row << " element " << d << " (chunk at " << o << ")";
        }
      }
    }
  }
}

// k4v3 at a head_dim that is not a power of two is smaller than int4 at the same group, as at
// a power of two (K: int4 in the RoPE frame; V: 3 bits and one scale per vector).
TEST(K4v3Test, ADimThatIsNotAPowerOfTwoCompressesBeyondInt4) {
  for (uint32_t D : {96u, 80u}) {
    const BlockGeometry g = Geo(4, 2, D, 64);
    const std::optional<size_t> k4v3 = EncodedBytes(g, Plan("k4v3,rope_theta=10000"), false);
    const std::optional<size_t> int4 = EncodedBytes(g, Plan("int4"), false);
    ASSERT_TRUE(k4v3.has_value() && int4.has_value()) << D;
    EXPECT_LT(static_cast<double>(*k4v3), 0.9 * static_cast<double>(*int4)) << D;
    EXPECT_GT(static_cast<double>(g.RawBytes()) / static_cast<double>(*k4v3), 4.0) << D;
  }
}

// Payload values a decoder must refuse even under valid CRCs: RoPE frequencies out of range or
// NaN, a non-finite V scale, nonzero padding bits. Nothing is written to the output then.
TEST(K4v3Test, HostilePayloadValuesAreRefusedByName) {
  BlockGeometry g = Geo(1, 1, 4, 2);       // V: 8 codes of 3 bits = 3 bytes, no padding
  BlockGeometry padded = Geo(1, 1, 2, 1);  // V: 2 codes = 6 bits, 2 padding bits
  for (const BlockGeometry& geo : {g, padded}) {
    std::vector<std::byte> raw = MakeBlock(geo, Pattern::kKvLike, 6);
    const std::string enc = Encode(geo, Plan("k4v3,rope_theta=10000"), raw);
    ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info, InspectBlock(AsBytes(enc)));
    const SegmentInfo& k = info.segments[0];
    const SegmentInfo& v = info.segments[1];
    auto decode_with = [&](size_t offset, std::span<const uint8_t> bytes) {
      std::string bad = enc;
      std::memcpy(bad.data() + offset, bytes.data(), bytes.size());
      internal::ResealBlockForFuzzing(
          std::as_writable_bytes(std::span<char>(bad.data(), bad.size())));
      std::vector<std::byte> out(geo.RawBytes(), std::byte{0x77});
      absl::Status s = DecodeBlock(AsBytes(bad), out);
      return s;
    };
    auto f32 = [](float f) {
      std::array<uint8_t, 4> b;
      std::memcpy(b.data(), &f, 4);
      return b;
    };
    for (float omega0 : {-1.0f, 1.5f, NAN, INFINITY}) {
      EXPECT_THAT(decode_with(k.offset, f32(omega0)),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("RoPE frequencies")))
          << omega0;
    }
    for (float ratio : {0.0f, -0.5f, 1.5f, NAN}) {
      EXPECT_THAT(decode_with(k.offset + 4, f32(ratio)),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("RoPE frequencies")))
          << ratio;
    }
    const uint8_t inf_bf16[2] = {0x80, 0x7F};
    EXPECT_THAT(decode_with(v.offset, inf_bf16),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("k4v3 V scale")));
    if (&geo == &padded) {
      const uint8_t last = static_cast<uint8_t>(enc[v.offset + v.bytes - 1]) | 0xC0;
      EXPECT_THAT(decode_with(v.offset + v.bytes - 1, std::span(&last, 1)),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("padding")));
    }
  }
}

TEST(BatchTest, MultiThreadedMatchesSingleBlockCalls) {
  BlockGeometry g = Geo(3, 2, 64, 16);
  CodecPlan plan = Plan("layers[0:1]=int8,default=int4,sink=fp8");
  std::vector<std::vector<std::byte>> raws;
  for (uint32_t i = 0; i < 9; ++i) raws.push_back(MakeBlock(g, Pattern::kKvLike, 100 + i));
  std::vector<std::string> encoded(raws.size());
  std::vector<EncodeRequest> reqs;
  for (size_t i = 0; i < raws.size(); ++i) {
    reqs.push_back(EncodeRequest{raws[i], {}, i == 0, &encoded[i]});
  }
  for (const absl::Status& s : EncodeBlocks(g, plan, reqs, 3)) ASSERT_OK(s);
  std::vector<std::vector<std::byte>> decoded(raws.size(), std::vector<std::byte>(g.RawBytes()));
  std::vector<DecodeRequest> dreqs;
  for (size_t i = 0; i < raws.size(); ++i)
    dreqs.push_back(DecodeRequest{AsBytes(encoded[i]), decoded[i]});
  encoded[4][100] ^= 1;  // one corrupted block fails alone
  std::vector<absl::Status> st = DecodeBlocks(dreqs, 4);
  for (size_t i = 0; i < raws.size(); ++i) {
    if (i == 4) {
      EXPECT_THAT(st[i], StatusIs(absl::StatusCode::kDataLoss, ::testing::_));
      continue;
    }
    ASSERT_OK(st[i]);
    EXPECT_EQ(encoded[i], Encode(g, plan, raws[i], i == 0));
    EXPECT_EQ(decoded[i], Decode(encoded[i], g.RawBytes()));
  }
}

}  // namespace
}  // namespace proxima::codec
