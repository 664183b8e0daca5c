// kernels/kv_layout.h on the CPU: randomised paged layouts (every axis order, joint and separate
// K/V, padded strides, strided dim) against the element-by-element reference, scatter/gather
// round trips byte for byte (padding and other blocks untouched), and every bad input.
#include "kernels/kv_layout.h"

#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/internal/kv_layout_testing.h"

namespace proxima::kv_layout {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::HasSubstr;
using testing::kBlock;
using testing::kDim;
using testing::kHead;
using testing::kKv;
using testing::kToken;
using testing::PagedKv;
using testing::Spec;

std::vector<std::byte*> Pointers(std::vector<std::byte>& buffer, size_t n, size_t block_bytes) {
  std::vector<std::byte*> out;
  for (size_t i = 0; i < n; ++i) out.push_back(buffer.data() + i * block_bytes);
  return out;
}

std::vector<const std::byte*> Const(const std::vector<std::byte*>& p) {
  return {p.begin(), p.end()};
}

// Up to `n` distinct ids in random order.
std::vector<uint64_t> RandomIds(std::mt19937_64& rng, uint64_t num_blocks, size_t n) {
  std::vector<uint64_t> ids(num_blocks);
  for (uint64_t i = 0; i < num_blocks; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(std::min<size_t>(n, num_blocks));
  return ids;
}

// The vLLM layouts by name, plus what the random specs cover beyond them.
std::vector<Spec> NamedSpecs() {
  std::vector<Spec> specs;
  for (uint32_t es : {1u, 2u}) {
    Spec nhd;  // FlashAttention: [kv][block][token][head][dim]
    nhd.element_size = es;
    Spec block_first = nhd;  // FlashInfer: [block][kv][token][head][dim]
    block_first.order = {kBlock, kKv, kToken, kHead, kDim};
    Spec hnd = nhd;  // [kv][block][head][token][dim]
    hnd.order = {kKv, kBlock, kHead, kToken, kDim};
    Spec hnd_block_first = nhd;
    hnd_block_first.order = {kBlock, kKv, kHead, kToken, kDim};
    Spec separate = nhd;  // K and V as two tensors [block][token][head][dim]
    separate.separate_kv = true;
    Spec padded = hnd;  // row padding on the head and block axes
    padded.padding = {0, 16, 0, 3, 0};
    Spec strided = nhd;  // dim not contiguous
    strided.dim_stride = 2;
    for (const Spec& s : {nhd, block_first, hnd, hnd_block_first, separate, padded, strided}) {
      specs.push_back(s);
    }
  }
  return specs;
}

std::vector<Spec> AllSpecs() {
  std::vector<Spec> specs = NamedSpecs();
  std::mt19937_64 rng(7);
  for (int i = 0; i < 300; ++i) specs.push_back(testing::RandomSpec(rng));
  return specs;
}

TEST(KvLayoutTest, GatherMatchesElementByElementReference) {
  std::mt19937_64 rng(1);
  for (const Spec& spec : AllSpecs()) {
    SCOPED_TRACE(spec.ToString());
    PagedKv kv(spec);
    ASSERT_OK(kv.layout.Validate());
    const size_t bb = kv.layout.BlockBytes();
    std::vector<uint64_t> ids = RandomIds(rng, spec.num_blocks, 5);
    ids.push_back(ids.front());  // gather may read one block twice
    std::vector<std::byte> got(ids.size() * bb, std::byte{0xAA});
    std::vector<std::byte> want(ids.size() * bb, std::byte{0x55});
    ASSERT_OK(GatherBlocks(kv.layout, ids, Pointers(got, ids.size(), bb)));
    testing::NaiveCopy(kv.layout, ids, Pointers(want, ids.size(), bb), /*scatter=*/false);
    ASSERT_EQ(got, want);
  }
}

TEST(KvLayoutTest, ScatterWritesExactlyTheReferenceElements) {
  std::mt19937_64 rng(2);
  for (const Spec& spec : AllSpecs()) {
    SCOPED_TRACE(spec.ToString());
    PagedKv ours(spec);
    PagedKv reference(spec);  // same seed: same bytes
    ASSERT_EQ(ours.buffers, reference.buffers);
    const size_t bb = ours.layout.BlockBytes();
    const std::vector<uint64_t> ids = RandomIds(rng, spec.num_blocks, 4);
    std::vector<std::byte> src(ids.size() * bb);
    for (std::byte& b : src) b = static_cast<std::byte>(rng());
    ASSERT_OK(ScatterBlocks(ours.layout, ids, Const(Pointers(src, ids.size(), bb))));
    testing::NaiveCopy(reference.layout, ids, Pointers(src, ids.size(), bb), /*scatter=*/true);
    // Every byte of every tensor, padding and other blocks included.
    ASSERT_EQ(ours.buffers, reference.buffers);
  }
}

TEST(KvLayoutTest, GatherThenScatterRoundTripsByteExact) {
  std::mt19937_64 rng(3);
  for (const Spec& spec : AllSpecs()) {
    SCOPED_TRACE(spec.ToString());
    PagedKv from(spec);
    PagedKv to(spec);
    for (auto& buffer : to.buffers) std::fill(buffer.begin(), buffer.end(), std::byte{0});
    const size_t bb = from.layout.BlockBytes();
    const std::vector<uint64_t> ids = RandomIds(rng, spec.num_blocks, 6);
    std::vector<std::byte> staging(ids.size() * bb);
    ASSERT_OK(GatherBlocks(from.layout, ids, Pointers(staging, ids.size(), bb)));
    // Into other block slots of the second tensors, then back out: the canonical bytes survive.
    std::vector<uint64_t> moved(ids.rbegin(), ids.rend());
    ASSERT_OK(ScatterBlocks(to.layout, moved, Const(Pointers(staging, ids.size(), bb))));
    std::vector<std::byte> again(ids.size() * bb);
    ASSERT_OK(GatherBlocks(to.layout, moved, Pointers(again, ids.size(), bb)));
    ASSERT_EQ(again, staging);
    // And element for element, the paged values themselves moved.
    for (size_t i = 0; i < ids.size(); ++i) {
      for (size_t layer = 0; layer < spec.layers; ++layer) {
        for (int k = 0; k < 2; ++k) {
          for (uint64_t t = 0; t < spec.tokens; ++t) {
            const std::byte* a =
                testing::ElementAddress(from.layout, layer, k, ids[i], t, spec.heads - 1, 0);
            const std::byte* b =
                testing::ElementAddress(to.layout, layer, k, moved[i], t, spec.heads - 1, 0);
            ASSERT_EQ(std::memcmp(a, b, spec.element_size), 0);
          }
        }
      }
    }
  }
}

TEST(KvLayoutTest, OneBufferOfBlocksEqualsAPointerPerBlock) {
  std::mt19937_64 rng(4);
  for (const Spec& spec : NamedSpecs()) {
    SCOPED_TRACE(spec.ToString());
    PagedKv kv(spec);
    const size_t bb = kv.layout.BlockBytes();
    const std::vector<uint64_t> ids = RandomIds(rng, spec.num_blocks, 3);
    std::vector<std::byte> one(ids.size() * bb), each(ids.size() * bb);
    ASSERT_OK(GatherBlocksToBuffer(kv.layout, ids, std::span<std::byte>(one)));
    ASSERT_OK(GatherBlocks(kv.layout, ids, Pointers(each, ids.size(), bb)));
    ASSERT_EQ(one, each);
    for (std::byte& b : one) b = static_cast<std::byte>(rng());
    PagedKv reference(spec);
    ASSERT_OK(ScatterBlocksFromBuffer(kv.layout, ids, std::span<const std::byte>(one)));
    ASSERT_OK(ScatterBlocks(reference.layout, ids, Const(Pointers(one, ids.size(), bb))));
    ASSERT_EQ(kv.buffers, reference.buffers);
  }
}

// Canonical block i of a grouped layout (blocks_per_canonical = n) as the one-block layout's
// blocks of its n ids make it: segment (layer, kv) of each in turn, tokens one after the other.
// kNoBlock parts keep `fill`.
std::vector<std::byte> GroupedByHand(const PagedLayout& one, std::span<const uint64_t> ids,
                                     uint32_t n, std::byte fill) {
  const size_t bb = one.BlockBytes(), seg = internal::SegmentBytes(one);
  const size_t blocks = ids.size() / n;
  std::vector<std::byte> out(blocks * n * bb, fill);
  std::vector<std::byte> each(bb);
  std::vector<std::byte*> dst = {each.data()};
  for (size_t i = 0; i < blocks; ++i) {
    for (uint32_t part = 0; part < n; ++part) {
      const uint64_t id = ids[i * n + part];
      if (id == kNoBlock) continue;
      EXPECT_OK(GatherBlocks(one, std::span<const uint64_t>(&id, 1), dst));
      for (size_t s = 0; s < 2 * one.layers.size(); ++s) {  // (layer, kv) segments in order
        std::memcpy(out.data() + i * n * bb + (s * n + part) * seg, each.data() + s * seg, seg);
      }
    }
  }
  return out;
}

TEST(KvLayoutTest, GroupedGatherLaysEachPagedBlockAtItsTokensOfTheCanonicalBlock) {
  std::mt19937_64 rng(5);
  for (const Spec& spec : AllSpecs()) {
    SCOPED_TRACE(spec.ToString());
    PagedKv kv(spec);
    for (uint32_t n : {2u, 3u}) {
      PagedLayout l = kv.layout;
      l.blocks_per_canonical = n;
      ASSERT_EQ(l.BlockBytes(), n * kv.layout.BlockBytes());
      // Two canonical blocks of random ids (repeats allowed in a gather), one part not read.
      std::vector<uint64_t> ids(2 * n);
      for (uint64_t& id : ids) id = rng() % spec.num_blocks;
      ids[rng() % ids.size()] = kNoBlock;
      std::vector<std::byte> got(2 * l.BlockBytes(), std::byte{0xAA});
      ASSERT_OK(GatherBlocks(l, ids, Pointers(got, 2, l.BlockBytes())));
      ASSERT_EQ(got, GroupedByHand(kv.layout, ids, n, std::byte{0xAA})) << "n=" << n;
    }
  }
}

TEST(KvLayoutTest, GroupedScatterWritesBackWhatGatherReadAndSkipsNoBlock) {
  std::mt19937_64 rng(6);
  for (const Spec& spec : AllSpecs()) {
    if (spec.num_blocks < 4) continue;
    SCOPED_TRACE(spec.ToString());
    PagedKv from(spec);
    PagedKv to(spec);
    for (auto& buffer : to.buffers) std::fill(buffer.begin(), buffer.end(), std::byte{0});
    PagedLayout src = from.layout, dst = to.layout;
    src.blocks_per_canonical = dst.blocks_per_canonical = 2;
    const size_t bb = src.BlockBytes();
    const std::vector<uint64_t> ids = RandomIds(rng, spec.num_blocks, 4);
    std::vector<std::byte> staging(2 * bb);
    ASSERT_OK(GatherBlocksToBuffer(src, ids, std::span<std::byte>(staging)));
    // The first part of the first canonical block is one the engine already has: not written.
    std::vector<uint64_t> into = {kNoBlock, ids[1], ids[2], ids[3]};
    ASSERT_OK(ScatterBlocksFromBuffer(dst, into, std::span<const std::byte>(staging)));
    std::vector<std::byte> again(2 * bb, std::byte{0x77});
    ASSERT_OK(GatherBlocksToBuffer(dst, into, std::span<std::byte>(again)));
    const size_t seg = internal::SegmentBytes(src);
    for (size_t i = 0; i < 2 * bb; ++i) {
      const bool skipped = i < bb && (i / seg) % 2 == 0;  // part 0 of the first block
      ASSERT_EQ(again[i], skipped ? std::byte{0x77} : staging[i]) << "byte " << i;
    }
    // Block ids[0] of the target tensors was never written: still all zeros.
    std::vector<std::byte> first(to.layout.BlockBytes(), std::byte{0x77});
    ASSERT_OK(GatherBlocksToBuffer(to.layout, std::span<const uint64_t>(ids.data(), 1),
                                   std::span<std::byte>(first)));
    ASSERT_EQ(first, std::vector<std::byte>(first.size(), std::byte{0}));
  }
}

TEST(KvLayoutTest, EmptyBatchIsANoOp) {
  PagedKv kv(Spec{});
  EXPECT_OK(GatherBlocks(kv.layout, {}, {}));
  EXPECT_OK(ScatterBlocks(kv.layout, {}, {}));
}

TEST(KvLayoutTest, ContiguousRunFollowsTheStrides) {
  Spec s;  // NHD, dense: a whole segment is one run
  EXPECT_EQ(internal::ContiguousRun(PagedKv(s).layout), 4u * 2 * 8);
  s.order = {kKv, kBlock, kHead, kToken, kDim};  // HND: one head_dim row
  EXPECT_EQ(internal::ContiguousRun(PagedKv(s).layout), 8u);
  s.order = {kKv, kBlock, kToken, kHead, kDim};
  s.padding[kToken] = 1;  // heads contiguous, tokens padded
  EXPECT_EQ(internal::ContiguousRun(PagedKv(s).layout), 2u * 8);
  s.dim_stride = 2;
  EXPECT_EQ(internal::ContiguousRun(PagedKv(s).layout), 1u);
}

// ---- bad input: each names the offending value

class KvLayoutBadInputTest : public ::testing::Test {
 protected:
  KvLayoutBadInputTest() : kv_(Spec{}) {}
  absl::Status Gather(const PagedLayout& l, std::vector<uint64_t> ids = {0, 1}) {
    std::vector<std::byte> out(ids.size() * kv_.layout.BlockBytes());
    return GatherBlocks(l, ids, Pointers(out, ids.size(), kv_.layout.BlockBytes()));
  }
  PagedKv kv_;
};

TEST_F(KvLayoutBadInputTest, ElementSize) {
  PagedLayout l = kv_.layout;
  l.element_size = 3;
  EXPECT_THAT(Gather(l), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element_size 3")));
}

TEST_F(KvLayoutBadInputTest, ZeroDimensions) {
  for (auto field :
       {&PagedLayout::num_kv_heads, &PagedLayout::head_dim, &PagedLayout::tokens_per_block}) {
    PagedLayout l = kv_.layout;
    l.*field = 0;
    EXPECT_THAT(Gather(l), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(" 0:")));
  }
  PagedLayout l = kv_.layout;
  l.num_blocks = 0;
  EXPECT_THAT(Gather(l), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_blocks 0")));
  l = kv_.layout;
  l.layers.clear();
  EXPECT_THAT(Gather(l), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layers 0")));
}

TEST_F(KvLayoutBadInputTest, NegativeStride) {
  PagedLayout l = kv_.layout;
  l.strides.token = -16;
  EXPECT_THAT(Gather(l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("axis 'token' -16")));
}

TEST_F(KvLayoutBadInputTest, OverlappingStrides) {
  PagedLayout l = kv_.layout;  // dense NHD: dim 1, head 8, token 16, block 64, kv 384
  l.strides.head = 4;          // heads 4 elements apart but rows are 8 long
  EXPECT_THAT(Gather(l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stride 4 of axis 'head'")));
  l = kv_.layout;
  l.strides.block = 0;  // every block on the same memory
  EXPECT_THAT(Gather(l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stride 0 of axis 'block'")));
  l = kv_.layout;
  l.strides.kv = l.strides.block;  // V of block 0 is K of block 1
  EXPECT_THAT(Gather(l), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("axis 'kv'")));
}

TEST_F(KvLayoutBadInputTest, ExtentPastTheTensorSize) {
  PagedLayout l = kv_.layout;
  l.layers[1].size_bytes -= 1;
  EXPECT_THAT(Gather(l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1: strides reach")));
  Spec s;
  s.order = {kBlock, kKv, kToken, kHead, kDim};
  PagedKv block_first(s);
  l = block_first.layout;
  l.num_blocks += 1;  // one block more than the tensors hold
  EXPECT_THAT(Gather(l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 0: strides reach")));
  s = Spec{};
  s.separate_kv = true;
  PagedKv sep(s);
  l = sep.layout;
  l.layers[0].v_size_bytes = 100;
  EXPECT_THAT(Gather(l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past its v_size_bytes 100")));
}

TEST_F(KvLayoutBadInputTest, SeparateKAndVThatOverlapOrMix) {
  Spec s;
  s.separate_kv = true;
  PagedKv sep(s);
  PagedLayout l = sep.layout;
  l.layers[0].v_data = l.layers[0].data + 2;
  l.layers[0].size_bytes = l.layers[0].v_size_bytes = 0;
  EXPECT_THAT(Gather(l), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
  l = sep.layout;
  l.layers[1].v_data = nullptr;
  EXPECT_THAT(Gather(l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1: v_data 0x0")));
}

TEST_F(KvLayoutBadInputTest, NullPointers) {
  PagedLayout l = kv_.layout;
  l.layers[1].data = nullptr;
  EXPECT_THAT(Gather(l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1: null data")));
  std::vector<std::byte> out(kv_.layout.BlockBytes());
  std::vector<std::byte*> dst = {out.data(), nullptr};
  std::vector<uint64_t> ids = {0, 3};
  EXPECT_THAT(GatherBlocks(kv_.layout, ids, dst),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("block pointer 1 (block id 3) is null")));
  EXPECT_THAT(ScatterBlocks(kv_.layout, ids, Const(dst)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block pointer 1")));
}

TEST_F(KvLayoutBadInputTest, BlockIdsOutOfRangeOrMismatched) {
  EXPECT_THAT(Gather(kv_.layout, {0, 6}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("block id 6 (index 1): expected < num_blocks 6 or kNoBlock")));
  std::vector<std::byte> out(kv_.layout.BlockBytes());
  std::vector<std::byte*> dst = {out.data()};
  std::vector<uint64_t> ids = {0, 1};
  EXPECT_THAT(GatherBlocks(kv_.layout, ids, dst),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("2 block ids for 1 block pointers: expected 1 ids per pointer")));
  // Three paged blocks per canonical block: ids come in threes.
  PagedLayout l = kv_.layout;
  l.blocks_per_canonical = 3;
  std::vector<std::byte> big(l.BlockBytes());
  std::vector<std::byte*> one = {big.data()};
  std::vector<uint64_t> four = {0, 1, 2, 3};
  EXPECT_THAT(GatherBlocks(l, four, one),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("4 block ids for 1 block pointers: expected 3 ids per pointer "
                                 "(blocks_per_canonical)")));
  std::vector<std::byte> buffer(2 * l.BlockBytes());
  EXPECT_THAT(GatherBlocksToBuffer(l, four, std::span<std::byte>(buffer)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("4 block ids for 1")));
  l.blocks_per_canonical = 0;
  EXPECT_THAT(Gather(l), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("blocks_per_canonical 0: expected 1 to 2^32-1")));
}

TEST_F(KvLayoutBadInputTest, BlockBufferTooSmallOrNull) {
  const size_t bb = kv_.layout.BlockBytes();
  std::vector<std::byte> buf(2 * bb - 1);
  std::vector<uint64_t> ids = {0, 1};
  EXPECT_THAT(GatherBlocksToBuffer(kv_.layout, ids, std::span<std::byte>(buf)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("block buffer of ", 2 * bb - 1, " bytes"))));
  EXPECT_THAT(ScatterBlocksFromBuffer(kv_.layout, ids, std::span<const std::byte>(buf)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("for 2 blocks")));
  EXPECT_THAT(GatherBlocksToBuffer(kv_.layout, ids, std::span<std::byte>()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at 0x0")));
}

TEST_F(KvLayoutBadInputTest, ScatterOfOneBlockTwice) {
  const size_t bb = kv_.layout.BlockBytes();
  std::vector<std::byte> src(2 * bb);
  std::vector<uint64_t> ids = {4, 4};
  const std::vector<std::vector<std::byte>> before = kv_.buffers;
  EXPECT_THAT(ScatterBlocks(kv_.layout, ids, Const(Pointers(src, 2, bb))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block id 4 appears twice")));
  EXPECT_EQ(kv_.buffers, before);  // nothing written
  // kNoBlock may appear any number of times; a real id twice is still refused.
  PagedLayout l = kv_.layout;
  l.blocks_per_canonical = 2;
  std::vector<std::byte> grouped(2 * l.BlockBytes());
  std::vector<uint64_t> skips = {kNoBlock, 1, kNoBlock, 2};
  EXPECT_OK(ScatterBlocks(l, skips, Const(Pointers(grouped, 2, l.BlockBytes()))));
  std::vector<uint64_t> twice = {kNoBlock, 3, 3, kNoBlock};
  EXPECT_THAT(ScatterBlocks(l, twice, Const(Pointers(grouped, 2, l.BlockBytes()))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block id 3 appears twice")));
}

TEST_F(KvLayoutBadInputTest, CudaPathValidatesTheSameOrSaysWhyNot) {
  PagedLayout l = kv_.layout;
  l.element_size = 3;
  std::vector<std::byte> out(kv_.layout.BlockBytes());
  std::vector<std::byte*> dst = {out.data()};
  std::vector<uint64_t> ids = {0};
  absl::Status s = GatherBlocksCuda(l, ids, dst, nullptr);
#if PROXIMA_WITH_CUDA
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element_size 3")));
  // Checked on the host before any CUDA call, so it runs without a device too.
  Spec strided;
  strided.dim_stride = 2;
  PagedKv kv(strided);
  l = kv.layout;
  for (PagedTensor& t : l.layers) {
    t.data += 1;
    t.size_bytes = 0;
  }
  EXPECT_THAT(
      GatherBlocksCuda(l, ids, dst, nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a multiple of element_size 2")));
#else
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("without CUDA")));
#endif
}

}  // namespace
}  // namespace proxima::kv_layout
