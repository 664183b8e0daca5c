#include "kernels/error_metrics.h"

#include <cmath>
#include <cstring>

#include "common/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/internal/numeric.h"
#include "kernels/internal/test_blocks.h"

namespace proxima::codec {
namespace {

using internal::MakeBlock;
using internal::Pattern;

// Applies f(value, is_k) to every element.
template <typename F>
std::vector<std::byte> Transform(const BlockGeometry& g, std::vector<std::byte> raw, F f) {
  const size_t n = g.SegmentElements();
  for (size_t i = 0; i < raw.size() / 2; ++i) {
    uint16_t v;
    std::memcpy(&v, raw.data() + 2 * i, 2);
    v = numeric::FloatToBf16(f(numeric::Bf16ToFloat(v), (i / n) % 2 == 0));
    std::memcpy(raw.data() + 2 * i, &v, 2);
  }
  return raw;
}

TEST(ErrorMetricsTest, IdenticalBlocksHaveZeroError) {
  BlockGeometry g{2, 2, 16, 8, DType::kBf16};
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 1);
  ASSERT_OK_AND_ASSIGN(ErrorSums s, MeasureBlockError(g, raw, raw));
  ErrorFigures f = Finish(s);
  EXPECT_EQ(f.k_rel_l2, 0.0);
  EXPECT_EQ(f.v_rel_l2, 0.0);
  EXPECT_EQ(f.attn_rel_l2, 0.0);
}

TEST(ErrorMetricsTest, ScaledValuesGiveExactRelativeErrors) {
  BlockGeometry g{2, 2, 16, 8, DType::kBf16};
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 2);
  // V * 2 (exact in bf16): V error 1, attention output error 1 (output is linear in V), K 0.
  ASSERT_OK_AND_ASSIGN(
      ErrorSums s,
      MeasureBlockError(g, raw, Transform(g, raw, [](float x, bool k) { return k ? x : 2 * x; })));
  ErrorFigures f = Finish(s);
  EXPECT_EQ(f.k_rel_l2, 0.0);
  EXPECT_NEAR(f.v_rel_l2, 1.0, 1e-12);
  EXPECT_NEAR(f.attn_rel_l2, 1.0, 1e-12);
  // K zeroed: K error 1; attention becomes uniform, which changes the output.
  ASSERT_OK_AND_ASSIGN(
      s,
      MeasureBlockError(g, raw, Transform(g, raw, [](float x, bool k) { return k ? 0.0f : x; })));
  f = Finish(s);
  EXPECT_NEAR(f.k_rel_l2, 1.0, 1e-12);
  EXPECT_EQ(f.v_rel_l2, 0.0);
  EXPECT_GT(f.attn_rel_l2, 0.01);
}

TEST(ErrorMetricsTest, SumsAggregateAcrossBlocks) {
  BlockGeometry g{1, 1, 8, 4, DType::kBf16};
  std::vector<std::byte> a = MakeBlock(g, Pattern::kKvLike, 3);
  auto doubled = Transform(g, a, [](float x, bool) { return 2 * x; });
  ASSERT_OK_AND_ASSIGN(ErrorSums s1, MeasureBlockError(g, a, doubled));
  ErrorSums total = s1;
  total.Add(s1);
  EXPECT_DOUBLE_EQ(Finish(total).k_rel_l2, Finish(s1).k_rel_l2);
  EXPECT_FALSE(MeasureBlockError(g, a, std::span(doubled).subspan(2)).ok());
}

}  // namespace
}  // namespace proxima::codec
