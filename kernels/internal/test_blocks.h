// Synthetic KV blocks for tests, the fuzz seed generator and the benchmark's no-file mode. Not
// real model data: never report error figures measured on these as real. Thread-safety: pure
// (each call seeds its own generator).
#ifndef PROXIMA_KERNELS_INTERNAL_TEST_BLOCKS_H_
#define PROXIMA_KERNELS_INTERNAL_TEST_BLOCKS_H_

#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/internal/container.h"
#include "kernels/internal/numeric.h"

namespace proxima::codec::internal {

enum class Pattern {
  kKvLike,       // K with per-channel offsets and a few outlier channels, V Gaussian
  kRandomBits,   // any 16-bit pattern, NaN and Inf included
  kAdversarial,  // NaN, Inf, subnormals, all-equal groups, huge outliers, signed zeros
};

// Returns RawBytes() bytes of dtype values, layout [layer][k|v][token][head][dim].
inline std::vector<std::byte> MakeBlock(const BlockGeometry& g, Pattern pattern, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t n = g.SegmentElements();
  const uint8_t dt = static_cast<uint8_t>(g.dtype);
  std::vector<std::byte> raw(g.RawBytes());
  auto put = [&](size_t i, uint16_t v) { std::memcpy(raw.data() + 2 * i, &v, 2); };
  const size_t hd = size_t{g.num_kv_heads} * g.head_dim;
  std::vector<float> offset(hd), spread(hd);
  for (size_t c = 0; c < hd; ++c) {
    offset[c] = normal(rng) * 0.5f;
    spread[c] = (rng() % 16 == 0) ? 8.0f : 1.0f;  // outlier channels, as real keys have
  }
  for (size_t s = 0; s < 2 * size_t{g.num_layers}; ++s) {
    const bool is_k = s % 2 == 0;
    for (size_t i = 0; i < n; ++i) {
      const size_t idx = s * n + i;
      float x = 0.0f;
      switch (pattern) {
        case Pattern::kKvLike:
          x = is_k ? offset[i % hd] + spread[i % hd] * normal(rng) : normal(rng) * 0.7f;
          put(idx, numeric::FloatToDtype(dt, x));
          continue;
        case Pattern::kRandomBits:
          put(idx, static_cast<uint16_t>(rng()));
          continue;
        case Pattern::kAdversarial: {
          const uint32_t r = rng() % 16;
          const size_t row = i / g.head_dim;
          if (row % 7 == 3) {
            x = 1.5f;  // an all-equal row (V groups) and, across tokens, repeated values
          } else if (r == 0) {
            put(idx, dt == 2 ? 0x7FC1 : 0x7E01);  // NaN
            continue;
          } else if (r == 1) {
            put(idx, dt == 2 ? 0xFF80 : 0xFC00);  // -Inf
            continue;
          } else if (r == 2) {
            put(idx, static_cast<uint16_t>(rng() % 0x7F));  // subnormal
            continue;
          } else if (r == 3) {
            x = (rng() % 2 ? 1.0f : -1.0f) * (dt == 2 ? 3.0e38f : 65000.0f);
          } else if (r == 4) {
            x = (rng() % 2) ? 0.0f : -0.0f;
          } else {
            x = normal(rng);
          }
          put(idx, numeric::FloatToDtype(dt, x));
          continue;
        }
      }
    }
  }
  return raw;
}

// Overwrites the code bytes of every fp8 and int8 segment of the encoded block `enc` (geometry
// g) with every byte value in turn, codes no encoder writes included (fp8 0x7F/0xFF, int8 -128),
// and reseals the block (both CRCs), so that a decoder reaches them. Other segments stay.
inline void FillEveryCodeByte(const BlockGeometry& g, std::string& enc) {
  auto info = InspectBlock(std::as_bytes(std::span<const char>(enc)));
  if (!info.ok()) return;
  const uint64_t T = g.tokens_per_block, H = g.num_kv_heads, D = g.head_dim;
  for (uint32_t s = 0; s < info->segments.size(); ++s) {
    const CodecId codec = info->segments[s].codec;
    if (codec != CodecId::kFp8 && codec != CodecId::kInt8) continue;
    const bool value = s % 2 == 1;
    const uint64_t codes_at = codec == CodecId::kFp8 ? 4 * H : 2 * (value ? T * H : H * D);
    for (uint64_t i = 0; i < T * H * D; ++i) {
      enc[info->segments[s].offset + codes_at + i] = static_cast<char>((i * 37 + s) & 0xFF);
    }
  }
  ResealBlockForFuzzing(std::as_writable_bytes(std::span<char>(enc)));
}

}  // namespace proxima::codec::internal

#endif  // PROXIMA_KERNELS_INTERNAL_TEST_BLOCKS_H_
