#include "kernels/error_metrics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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

// The header's definition written as plain nested loops, each sum in one loop: the reference
// that MeasureBlockError (whose loops are arranged for speed) must match bit for bit, so that
// every figure it gives stays the one tools/eval's Python port computes.
ErrorSums Reference(const BlockGeometry& g, std::span<const std::byte> a,
                    std::span<const std::byte> b, uint32_t num_probes) {
  const uint32_t T = g.tokens_per_block, H = g.num_kv_heads, D = g.head_dim;
  const uint32_t P = std::max<uint32_t>(1, std::min(num_probes, T));
  const size_t n = g.SegmentElements();
  const uint8_t dt = static_cast<uint8_t>(g.dtype);
  auto load = [&](std::span<const std::byte> x, size_t segment) {
    std::vector<double> out(n);
    for (size_t i = 0; i < n; ++i) {
      uint16_t u;
      std::memcpy(&u, x.data() + (segment * n + i) * 2, 2);
      const float f = numeric::DtypeToFloat(dt, u);
      out[i] = std::isfinite(f) ? f : 0.0;
    }
    return out;
  };
  ErrorSums s;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    const std::vector<double> k = load(a, 2 * l), v = load(a, 2 * l + 1);
    const std::vector<double> k2 = load(b, 2 * l), v2 = load(b, 2 * l + 1);
    for (size_t i = 0; i < n; ++i) {
      s.k_err += (k2[i] - k[i]) * (k2[i] - k[i]);
      s.k_ref += k[i] * k[i];
      s.v_err += (v2[i] - v[i]) * (v2[i] - v[i]);
      s.v_ref += v[i] * v[i];
    }
    for (uint32_t h = 0; h < H; ++h) {
      auto at = [&](uint32_t t) { return (size_t{t} * H + h) * D; };
      for (uint32_t j = 0; j < P; ++j) {
        const double* q = &k[at(static_cast<uint32_t>(uint64_t{j} * T / P))];
        std::vector<double> p(T), p2(T);
        double m = -INFINITY, m2 = -INFINITY, z = 0, z2 = 0;
        for (uint32_t t = 0; t < T; ++t) {
          double x = 0, y = 0;
          for (uint32_t d = 0; d < D; ++d) {
            x += q[d] * k[at(t) + d];
            y += q[d] * k2[at(t) + d];
          }
          p[t] = x * (1.0 / std::sqrt(static_cast<double>(D)));
          p2[t] = y * (1.0 / std::sqrt(static_cast<double>(D)));
          m = std::max(m, p[t]);
          m2 = std::max(m2, p2[t]);
        }
        for (uint32_t t = 0; t < T; ++t) {
          p[t] = std::exp(p[t] - m);
          p2[t] = std::exp(p2[t] - m2);
          z += p[t];
          z2 += p2[t];
        }
        for (uint32_t d = 0; d < D; ++d) {
          double o = 0, o2 = 0;
          for (uint32_t t = 0; t < T; ++t) {
            o += p[t] * v[at(t) + d];
            o2 += p2[t] * v2[at(t) + d];
          }
          o /= z;
          o2 /= z2;
          s.attn_err += (o2 - o) * (o2 - o);
          s.attn_ref += o * o;
        }
      }
    }
  }
  return s;
}

TEST(ErrorMetricsTest, EqualsThePlainLoopsOfItsDefinitionBitForBit) {
  // Token counts around the blocking of four (1, 3, 4, 5, 16, 67), head dims around it too, and
  // inputs with NaN, Inf, subnormals and outliers.
  // {layers, kv heads, head dim, tokens, dtype}
  for (BlockGeometry g :
       {BlockGeometry{2, 3, 64, 16, DType::kBf16}, BlockGeometry{1, 1, 8, 1, DType::kBf16},
        BlockGeometry{2, 2, 6, 3, DType::kFp16}, BlockGeometry{1, 2, 4, 5, DType::kBf16},
        BlockGeometry{1, 1, 130, 67, DType::kFp16}, BlockGeometry{3, 1, 9, 4, DType::kBf16}}) {
    for (Pattern pattern : {Pattern::kKvLike, Pattern::kRandomBits, Pattern::kAdversarial}) {
      const std::vector<std::byte> a = MakeBlock(g, Pattern::kKvLike, 7);
      const std::vector<std::byte> b = MakeBlock(g, pattern, 8);
      for (uint32_t probes : {1u, 8u, 1000u}) {
        ASSERT_OK_AND_ASSIGN(ErrorSums got, MeasureBlockError(g, a, b, probes));
        const ErrorSums want = Reference(g, a, b, probes);
        const double g6[] = {got.k_err, got.k_ref,    got.v_err,
                             got.v_ref, got.attn_err, got.attn_ref};
        const double w6[] = {want.k_err, want.k_ref,    want.v_err,
                             want.v_ref, want.attn_err, want.attn_ref};
        EXPECT_EQ(std::memcmp(g6, w6, sizeof(g6)), 0)
            << "T=" << g.tokens_per_block << " D=" << g.head_dim << " probes=" << probes
            << " pattern=" << static_cast<int>(pattern) << " attn " << got.attn_err << " vs "
            << want.attn_err;
      }
    }
  }
}

}  // namespace
}  // namespace proxima::codec
