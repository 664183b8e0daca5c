// Test and benchmark helpers for kernels/kv_layout.h: paged KV tensors in host memory with any
// axis order, separate or joint K/V and padded strides, and the element-by-element reference.
// Not part of the library.
#ifndef PROXIMA_KERNELS_INTERNAL_KV_LAYOUT_TESTING_H_
#define PROXIMA_KERNELS_INTERNAL_KV_LAYOUT_TESTING_H_

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/kv_layout.h"

namespace proxima::kv_layout::testing {

enum AxisId { kKv = 0, kBlock = 1, kToken = 2, kHead = 3, kDim = 4 };
inline constexpr const char* kAxisNames[] = {"kv", "block", "token", "head", "dim"};

struct Spec {
  uint32_t element_size = 2;
  uint32_t layers = 2, heads = 2, head_dim = 8, tokens = 4;
  uint64_t num_blocks = 6;
  bool separate_kv = false;
  std::vector<int> order = {kKv, kBlock, kToken, kHead, kDim};  // outermost first
  std::array<int64_t, 5> padding = {};  // extra elements added to each axis' natural stride
  int64_t dim_stride = 1;               // > 1: the dim axis is strided (general path)

  std::string ToString() const {
    std::vector<std::string> names;
    for (int a : order) names.push_back(kAxisNames[a]);
    return absl::StrCat("es=", element_size, " L=", layers, " H=", heads, " D=", head_dim,
                        " T=", tokens, " blocks=", num_blocks, " separate=", separate_kv,
                        " order=", absl::StrJoin(names, ","), " pad=", absl::StrJoin(padding, ","),
                        " dim_stride=", dim_stride);
  }
};

// Owns the paged tensors of one Spec (one host buffer per layer, two with separate K/V).
struct PagedKv {
  Spec spec;
  PagedLayout layout;
  std::vector<std::vector<std::byte>> buffers;

  explicit PagedKv(const Spec& s) : spec(s) {
    const uint64_t sizes[] = {2, s.num_blocks, s.tokens, s.heads, s.head_dim};
    int64_t strides[5] = {};
    int64_t stride = 1;  // innermost axis first
    for (auto it = s.order.rbegin(); it != s.order.rend(); ++it) {
      const int a = *it;
      if (a == kKv && s.separate_kv) continue;
      if (a == kDim) stride *= s.dim_stride;
      stride += s.padding[a];
      strides[a] = stride;
      stride *= static_cast<int64_t>(sizes[a]);
    }
    const size_t tensor_bytes = static_cast<size_t>(stride) * s.element_size;
    layout.element_size = s.element_size;
    layout.num_kv_heads = s.heads;
    layout.head_dim = s.head_dim;
    layout.tokens_per_block = s.tokens;
    layout.num_blocks = s.num_blocks;
    layout.strides = {strides[kKv], strides[kBlock], strides[kToken], strides[kHead],
                      strides[kDim]};
    std::mt19937_64 rng(s.layers * 7919 + tensor_bytes);
    for (uint32_t l = 0; l < s.layers; ++l) {
      for (int t = 0; t < (s.separate_kv ? 2 : 1); ++t) {
        buffers.emplace_back(tensor_bytes);
        for (std::byte& b : buffers.back()) b = static_cast<std::byte>(rng());
      }
      PagedTensor pt;
      const size_t k = buffers.size() - (s.separate_kv ? 2 : 1);
      pt.data = buffers[k].data();
      pt.size_bytes = tensor_bytes;
      if (s.separate_kv) {
        pt.v_data = buffers[k + 1].data();
        pt.v_size_bytes = tensor_bytes;
      }
      layout.layers.push_back(pt);
    }
  }
  PagedKv(const PagedKv&) = delete;
};

// A random Spec: any axis order, separate K/V a third of the time, padding and a strided dim
// axis now and then.
inline Spec RandomSpec(std::mt19937_64& rng) {
  auto pick = [&rng](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  Spec s;
  const uint32_t sizes[] = {1, 2, 4};
  s.element_size = sizes[pick(0, 2)];
  s.layers = static_cast<uint32_t>(pick(1, 4));
  s.heads = static_cast<uint32_t>(pick(1, 4));
  s.head_dim = static_cast<uint32_t>(pick(1, 3) == 1 ? pick(1, 9) : 8 * pick(1, 4));
  s.tokens = static_cast<uint32_t>(pick(1, 8));
  s.num_blocks = pick(1, 12);
  s.separate_kv = pick(0, 2) == 0;
  std::shuffle(s.order.begin(), s.order.end(), rng);
  for (int64_t& p : s.padding) p = pick(0, 3) == 0 ? static_cast<int64_t>(pick(1, 5)) : 0;
  s.dim_stride = pick(0, 4) == 0 ? static_cast<int64_t>(pick(2, 3)) : 1;
  return s;
}

// Byte offset of element (kv, block, token, head, dim) of layer `layer` from the layout.
inline const std::byte* ElementAddress(const PagedLayout& l, size_t layer, int kv, uint64_t b,
                                       uint64_t t, uint64_t h, uint64_t d) {
  const PagedTensor& pt = l.layers[layer];
  const std::byte* base = pt.v_data != nullptr && kv == 1 ? pt.v_data : pt.data;
  const int64_t kv_off = pt.v_data != nullptr ? 0 : kv * l.strides.kv;
  const int64_t e = kv_off + static_cast<int64_t>(b) * l.strides.block +
                    static_cast<int64_t>(t) * l.strides.token +
                    static_cast<int64_t>(h) * l.strides.head +
                    static_cast<int64_t>(d) * l.strides.dim;
  return base + e * l.element_size;
}

// The reference: every element copied on its own, addresses computed from scratch.
// scatter = false: paged -> canonical.
inline void NaiveCopy(const PagedLayout& l, const std::vector<uint64_t>& ids,
                      const std::vector<std::byte*>& blocks, bool scatter) {
  const size_t es = l.element_size;
  for (size_t i = 0; i < ids.size(); ++i) {
    size_t c = 0;
    for (size_t layer = 0; layer < l.layers.size(); ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (uint64_t t = 0; t < l.tokens_per_block; ++t) {
          for (uint64_t h = 0; h < l.num_kv_heads; ++h) {
            for (uint64_t d = 0; d < l.head_dim; ++d, c += es) {
              auto* p = const_cast<std::byte*>(ElementAddress(l, layer, kv, ids[i], t, h, d));
              if (scatter) {
                std::memcpy(p, blocks[i] + c, es);
              } else {
                std::memcpy(blocks[i] + c, p, es);
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace proxima::kv_layout::testing

#endif  // PROXIMA_KERNELS_INTERNAL_KV_LAYOUT_TESTING_H_
