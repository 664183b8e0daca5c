// The body of the codec_encode fuzz target, shared by the libFuzzer harness and by the unit test
// that replays the checked-in corpus in ordinary builds.
//
// The daemon encodes whatever bytes a worker put (its tierer compresses them later), so the
// encoders see hostile values as surely as the decoder sees hostile blocks. An input picks a
// block's geometry, dtype and codec plan and supplies its values; the harness encodes the block
// on every CPU path this machine runs and aborts unless:
//   - the encoder succeeds exactly when the geometry and plan are valid (on every path alike);
//   - every path writes the same bytes, of the size EncodedBytes() announces (lossless aside);
//   - the block it wrote passes InspectBlock and decodes, on every path, to identical bytes;
//   - raw and lossless give back the input bit for bit; the lossy codecs never give NaN, give
//     finite values for a segment of moderate finite values, and keep each element within a
//     bound of its codec's step (below: loose, derived from docs/format.md's rules, so that only
//     a wrong grid, a wrong group or a wrong rotation can break them).
//
// Input: 8 bytes that choose the block, then the values (cycled to fill it; zeros when absent).
//   [0] bit 0: fp16 (else bf16); bit 1: the sequence's first block; bit 2: an importance vector
//       (raw float bits from the values, NaN and Inf included); bits 3-4: how values are read:
//       0 every 16-bit pattern as is, 1 moderate finite values (2^-14 <= |x| < 2^10 and zeros),
//       2 the same with NaN, +-Inf, subnormals and extremes mixed in, 3 values near 1 (narrow
//       and constant groups).
//   [1] default codec (id mod 8); [2] codec of layers [0:1) (mod 9, 8 = none);
//   [3] sink codec (mod 9, 8 = none), then the group (32 << (byte / 9 % 3));
//   [4] RoPE base (mod 5: unknown, 1, 1e4, 1e5, 1e12), then the head dim (byte / 5, from kDims);
//   [5] tokens (1 + byte mod 130); [6] heads (1 + byte mod 4); [7] layers (1 + byte mod 3).
// Thread-safety: pure.
#ifndef PROXIMA_TESTS_FUZZ_CODEC_ENCODE_FUZZ_BODY_H_
#define PROXIMA_TESTS_FUZZ_CODEC_ENCODE_FUZZ_BODY_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/internal/container.h"
#include "kernels/internal/numeric.h"

namespace proxima::codec::fuzz {

// Head dims an input can choose: odd and even, below and past the SIMD paths' vector widths and
// register budgets (256 / 264 / 272), powers of two (k4v3's V transform in one chunk) and others
// (in several).
inline constexpr uint32_t kEncodeFuzzDims[] = {1,  2,  3,   4,   5,   6,   7,   8,   9,   12, 15,
                                               16, 17, 24,  31,  32,  33,  40,  48,  63,  64, 65,
                                               80, 96, 100, 127, 128, 129, 255, 256, 264, 272};
// Raw block size above which the token count is cut (keeps each input fast).
inline constexpr size_t kMaxEncodeFuzzRawBytes = size_t{512} << 10;
// Segments whose largest finite magnitude is at most this get the finiteness and error checks.
inline constexpr float kModerate = 2048.0f;

namespace encode_fuzz_internal {

inline uint16_t ValueAt(std::span<const uint8_t> values, size_t i) {
  if (values.empty()) return 0;
  const size_t n = values.size();
  return static_cast<uint16_t>(values[(2 * i) % n] | (values[(2 * i + 1) % n] << 8));
}

// Element i of the block, read from the fuzzer's bits in `mode`.
inline uint16_t MakeValue(uint8_t dtype, int mode, uint16_t bits) {
  if (mode == 0) return bits;
  const float sign = (bits & 0x8000) ? -1.0f : 1.0f;
  if (mode == 2 && (bits & 0x7000) == 0x7000) {
    switch ((bits >> 8) & 7) {
      case 0:
        return dtype == numeric::kDtypeBf16 ? 0x7FC1 : 0x7E01;  // NaN
      case 1:
        return dtype == numeric::kDtypeBf16 ? 0x7F80 : 0x7C00;  // +Inf
      case 2:
        return dtype == numeric::kDtypeBf16 ? 0xFF80 : 0xFC00;  // -Inf
      case 3:
        return static_cast<uint16_t>(bits & 0x807F);  // subnormal or zero
      case 4:
        return static_cast<uint16_t>((bits & 0x8000) | numeric::DtypeMaxFinite(dtype));
      default:
        break;
    }
  }
  if (mode == 3) {  // 1 +- a few ulps of bf16: narrow and constant groups
    return numeric::FloatToDtype(dtype, sign * (1.0f + static_cast<float>(bits & 7) / 128.0f));
  }
  if ((bits & 0x3F) == 0) return static_cast<uint16_t>(bits & 0x8000);  // +-0
  const int exp = static_cast<int>((bits >> 8) % 24) - 14;              // 2^-14 .. 2^9
  const float mant = 1.0f + static_cast<float>(bits & 0xFF) / 256.0f;
  return numeric::FloatToDtype(dtype, sign * std::ldexp(mant, exp));
}

[[noreturn]] inline void Fail() { std::abort(); }

// The checks of the decoded segment `out` of codec `codec` against its input `in`, `n` elements
// as [t][h][d]; D = head dim.
inline void CheckSegment(CodecId codec, bool is_k, uint8_t dtype, uint32_t D,
                         std::span<const uint16_t> in, std::span<const uint16_t> out) {
  using numeric::DtypeToFloat;
  const size_t n = in.size();
  if (IsExact(codec)) {
    if (!std::equal(in.begin(), in.end(), out.begin())) Fail();  // exact codec, other bytes
    return;
  }
  float m = 0.0f;  // largest finite magnitude
  bool all_finite = true;
  for (size_t i = 0; i < n; ++i) {
    const float x = DtypeToFloat(dtype, in[i]);
    if (!numeric::IsFiniteFloat(x)) {
      all_finite = false;
    } else {
      m = std::max(m, std::fabs(x));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(DtypeToFloat(dtype, out[i]))) Fail();  // the lossy codecs never decode NaN
  }
  if (m > kModerate) return;
  // Slack added to every bound: the rounding of a value to the dtype (half an ulp, at most 2^-8
  // of it for bf16; fp16 is finer), doubled, and a floor for subnormal steps.
  const float rel = 1.0f / 128.0f, floor = 1e-5f;
  auto near = [&](float x, float y, float bound) {
    return std::fabs(x - y) <= bound + rel * std::fabs(x) + floor;
  };
  if (codec == CodecId::kK4v3) {
    if (!all_finite) return;  // the rotations mix an element with its pair or its whole vector
    if (is_k) {
      // The turned values are within sqrt(2)*m, so an int4 group's range is at most 2*sqrt(2)*m
      // and half its step (the scale rounded up by an ulp) 0.095*m; with the turned values
      // rounded to the dtype before and after, 0.106*m; turned back, a pair's error vector keeps
      // its length, so each element is off by at most sqrt(2) times that: 0.150*m.
      for (size_t i = 0; i < n; ++i) {
        if (!near(DtypeToFloat(dtype, in[i]), DtypeToFloat(dtype, out[i]), 0.16f * m)) Fail();
      }
      return;
    }
    // V: each rotated element within half a step, scale = amax(u) / 4 <= |x|_2 / 4 (rounded up
    // by an ulp), so the vector's error is at most sqrt(D) * |x|_2 / 8 (the rotation keeps
    // lengths), plus the output's rounding to the dtype.
    for (size_t v = 0; v < n / D; ++v) {
      double err = 0.0, len = 0.0;
      for (size_t d = 0; d < D; ++d) {
        const double x = DtypeToFloat(dtype, in[v * D + d]);
        const double e = DtypeToFloat(dtype, out[v * D + d]) - x;
        err += e * e;
        len += x * x;
      }
      const double bound = std::sqrt(static_cast<double>(D)) * std::sqrt(len) / 8.0;
      if (std::sqrt(err) > bound * (1.0 + 2.0 * rel) + rel * (std::sqrt(len) + bound) +
                               std::sqrt(static_cast<double>(D)) * floor) {
        Fail();
      }
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const float x = DtypeToFloat(dtype, in[i]), y = DtypeToFloat(dtype, out[i]);
    if (!numeric::IsFiniteFloat(x)) continue;  // saturates to its group's extreme
    if (!numeric::IsFiniteFloat(y)) Fail();    // a finite moderate value decoded as Inf
    float bound = 0.0f;
    switch (codec) {
      // Half a step (the scale rounded up by an ulp: 1.008 times the exact one).
      case CodecId::kInt8:
        bound = m / 250.0f;
        break;  // steps of m / 127
      case CodecId::kInt4:
        bound = m / 14.8f;
        break;  // a group's range up to 2m, 15 steps
      case CodecId::kInt2:
        bound = m / 2.9f;
        break;  // 3 steps
      // e4m3: half an ulp is 2^-4 of the value, and the subnormal steps of the scaled values
      // (2^-9 of a scale of m / 448) add at most m / 400000.
      case CodecId::kFp8:
        bound = std::fabs(x) / 15.0f + m / 100000.0f;
        break;
      case CodecId::kStar:
        bound = 5.0f * m;
        break;  // centroid + residual: only finiteness
      default:
        Fail();
    }
    if (!near(x, y, bound)) Fail();
  }
}

}  // namespace encode_fuzz_internal

// The block an input chooses (the layout above), or nullopt for an input shorter than 8 bytes.
struct EncodeCase {
  BlockGeometry geometry;
  CodecPlan plan;
  bool is_first_block = false;
  std::vector<uint16_t> raw;      // RawBytes() / 2 values, [layer][k|v][token][head][dim]
  std::vector<float> importance;  // empty, or one per token
  bool valid = false;             // the geometry and the plan are ones EncodeBlock takes

  std::span<const std::byte> raw_bytes() const {
    return std::as_bytes(std::span<const uint16_t>(raw));
  }
};

inline std::optional<EncodeCase> MakeEncodeCase(const uint8_t* data, size_t size) {
  using namespace encode_fuzz_internal;
  if (size < 8) return std::nullopt;
  const uint8_t* h = data;
  const std::span<const uint8_t> values(data + 8, size - 8);
  EncodeCase c;
  BlockGeometry& g = c.geometry;
  g.dtype = (h[0] & 1) ? DType::kFp16 : DType::kBf16;
  const uint8_t dtype = static_cast<uint8_t>(g.dtype);
  c.is_first_block = (h[0] & 2) != 0;
  const bool with_importance = (h[0] & 4) != 0;
  const int mode = (h[0] >> 3) & 3;
  CodecPlan& plan = c.plan;
  plan.default_codec = static_cast<CodecId>(h[1] % kNumCodecs);
  if (h[2] % 9 != 8) plan.layer_ranges.push_back({0, 1, static_cast<CodecId>(h[2] % 9)});
  if (h[3] % 9 != 8) plan.sink_codec = static_cast<CodecId>(h[3] % 9);
  plan.group_size = 32u << (h[3] / 9 % 3);
  constexpr double kThetas[] = {0.0, 1.0, 1e4, 1e5, 1e12};
  plan.rope_theta = kThetas[h[4] % 5];
  constexpr size_t kNumDims = sizeof(kEncodeFuzzDims) / sizeof(kEncodeFuzzDims[0]);
  g.head_dim = kEncodeFuzzDims[(h[4] / 5) % kNumDims];
  g.tokens_per_block = 1 + h[5] % 130;
  g.num_kv_heads = 1 + h[6] % 4;
  g.num_layers = 1 + h[7] % 3;
  while (g.RawBytes() > kMaxEncodeFuzzRawBytes && g.tokens_per_block > 1) {
    g.tokens_per_block /= 2;
  }
  c.raw.resize(g.RawBytes() / 2);
  for (size_t i = 0; i < c.raw.size(); ++i) c.raw[i] = MakeValue(dtype, mode, ValueAt(values, i));
  if (with_importance) {
    c.importance.resize(g.tokens_per_block);
    for (size_t t = 0; t < c.importance.size(); ++t) {
      const uint32_t bits = ValueAt(values, 2 * t) | (uint32_t{ValueAt(values, 2 * t + 1)} << 16);
      std::memcpy(&c.importance[t], &bits, 4);
    }
  }
  c.valid = g.Validate().ok() && internal::ValidPlan(plan).ok();
  return c;
}

// Returns true when the input chose a valid block and plan (and so was encoded).
inline bool RunCodecEncodeInput(const uint8_t* data, size_t size) {
  using namespace encode_fuzz_internal;
  const std::optional<EncodeCase> c = MakeEncodeCase(data, size);
  if (!c.has_value()) return false;
  const BlockGeometry& g = c->geometry;
  const CodecPlan& plan = c->plan;
  const bool first = c->is_first_block;
  const bool valid = c->valid;
  const std::vector<uint16_t>& raw = c->raw;
  const std::span<const std::byte> raw_bytes = c->raw_bytes();
  const std::vector<float>& importance = c->importance;
  const uint8_t dtype = static_cast<uint8_t>(g.dtype);
  const size_t n = raw.size();

  std::string scalar;
  const absl::Status st =
      EncodeBlockWithPath(CpuPath::kScalar, g, plan, first, raw_bytes, importance, &scalar);
  if (st.ok() != valid) Fail();  // refused a valid block, or took an invalid one
  for (CpuPath path : {CpuPath::kAvx2, CpuPath::kAvx512}) {
    if (!CpuPathAvailable(path)) continue;
    std::string simd;
    const absl::Status s = EncodeBlockWithPath(path, g, plan, first, raw_bytes, importance, &simd);
    if (s.code() != st.code() || simd != scalar) Fail();  // the paths disagree
  }
  if (!valid) return false;
  if (const std::optional<size_t> size = EncodedBytes(g, plan, first);
      size.has_value() && *size != scalar.size()) {
    Fail();  // the announced size is not the written one
  }

  const auto enc = std::as_bytes(std::span<const char>(scalar));
  absl::StatusOr<BlockHeaderInfo> info = InspectBlock(enc);
  if (!info.ok() || info->geometry != g || info->is_first_block != first) Fail();
  std::vector<uint16_t> out(n), again(n);
  const auto out_bytes = std::as_writable_bytes(std::span<uint16_t>(out));
  if (!DecodeBlockWithPath(CpuPath::kScalar, enc, out_bytes).ok()) Fail();  // own block refused
  for (CpuPath path : {CpuPath::kAvx2, CpuPath::kAvx512}) {
    if (!CpuPathAvailable(path)) continue;
    std::fill(again.begin(), again.end(), uint16_t{0});
    if (!DecodeBlockWithPath(path, enc, std::as_writable_bytes(std::span<uint16_t>(again))).ok() ||
        again != out) {
      Fail();
    }
  }
  const size_t seg = g.SegmentElements();
  for (size_t s = 0; s < 2 * size_t{g.num_layers}; ++s) {
    const CodecId codec = plan.CodecFor(static_cast<uint32_t>(s / 2), first);
    if (info->segments[s].codec != codec) Fail();
    CheckSegment(codec, s % 2 == 0, dtype, g.head_dim,
                 std::span<const uint16_t>(raw).subspan(s * seg, seg),
                 std::span<const uint16_t>(out).subspan(s * seg, seg));
  }
  return true;
}

}  // namespace proxima::codec::fuzz

#endif  // PROXIMA_TESTS_FUZZ_CODEC_ENCODE_FUZZ_BODY_H_
