// CPU gather/scatter between paged KV tensors and canonical blocks, and the validation shared
// with the CUDA path (kernels/kv_layout_cuda.cc).
#include "kernels/kv_layout.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace proxima::kv_layout {
namespace {

using u128 = unsigned __int128;

// Beyond this a layout is certainly a caller error (and products stay far from overflow).
constexpr uint64_t kMaxDimension = uint64_t{1} << 32;
constexpr u128 kMaxBytes = u128{1} << 62;

struct Axis {
  const char* name;
  int64_t stride;
  uint64_t size;
};

std::string AddressString(const void* p) {
  return absl::StrCat("0x", absl::Hex(reinterpret_cast<uintptr_t>(p)));
}

// Bytes spanned by one tensor: from element 0 to one past the last addressed element.
u128 ExtentBytes(const std::vector<Axis>& axes, uint32_t element_size) {
  u128 last = 0;
  for (const Axis& a : axes) last += static_cast<u128>(a.stride) * (a.size - 1);
  return (last + 1) * element_size;
}

// Injective when, with the axes sorted by stride, each stride steps past everything the smaller
// axes can reach. (Sufficient; it is how every dense or padded layout is built.)
absl::Status CheckNoOverlap(std::vector<Axis> axes) {
  std::erase_if(axes, [](const Axis& a) { return a.size == 1; });
  std::sort(axes.begin(), axes.end(),
            [](const Axis& a, const Axis& b) { return a.stride < b.stride; });
  u128 reach = 0;  // largest offset reachable with the axes so far
  const Axis* previous = nullptr;
  for (const Axis& a : axes) {
    if (static_cast<u128>(a.stride) <= reach || a.stride == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv layout: stride ", a.stride, " of axis '", a.name, "' (size ", a.size, ") overlaps ",
          previous ? absl::StrCat("axis '", previous->name, "'") : "itself",
          ": positions would share elements; expected a stride > ", static_cast<uint64_t>(reach)));
    }
    reach += static_cast<u128>(a.stride) * (a.size - 1);
    previous = &a;
  }
  return absl::OkStatus();
}

template <bool kScatter>
void CopySegment(const PagedLayout& l, uint64_t run, std::byte* paged, std::byte* canonical) {
  const size_t es = l.element_size;
  const uint64_t T = l.tokens_per_block, H = l.num_kv_heads, D = l.head_dim;
  const int64_t st = l.strides.token * static_cast<int64_t>(es);
  const int64_t sh = l.strides.head * static_cast<int64_t>(es);
  const int64_t sd = l.strides.dim * static_cast<int64_t>(es);
  auto copy = [](std::byte* p, std::byte* c, size_t n) {
    if constexpr (kScatter) {
      std::memcpy(p, c, n);
    } else {
      std::memcpy(c, p, n);
    }
  };
  if (run == T * H * D) {
    copy(paged, canonical, run * es);
    return;
  }
  if (run >= D) {  // whole rows of head_dim (or of all heads) at a time
    const uint64_t heads_per_run = run / D;
    for (uint64_t t = 0; t < T; ++t) {
      for (uint64_t h = 0; h < H; h += heads_per_run) {
        copy(paged + t * st + h * sh, canonical + (t * H + h) * D * es, run * es);
      }
    }
    return;
  }
  // General strides: element by element, with a fixed-size copy the compiler inlines.
  auto elements = [&]<size_t kEs>() {
    for (uint64_t t = 0; t < T; ++t) {
      for (uint64_t h = 0; h < H; ++h) {
        std::byte* p = paged + t * st + h * sh;
        std::byte* c = canonical + (t * H + h) * D * kEs;
        for (uint64_t d = 0; d < D; ++d) copy(p + d * sd, c + d * kEs, kEs);
      }
    }
  };
  switch (es) {
    case 1:
      elements.template operator()<1>();
      break;
    case 2:
      elements.template operator()<2>();
      break;
    default:
      elements.template operator()<4>();  // Validate() allows 1, 2 or 4
      break;
  }
}

template <bool kScatter>
void CopyBlocks(const PagedLayout& l, std::span<const uint64_t> ids,
                std::span<const std::byte* const> blocks) {
  const uint64_t run = internal::ContiguousRun(l);
  const uint32_t n = l.blocks_per_canonical;
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::byte* canonical = const_cast<std::byte*>(blocks[i]);
    for (uint32_t part = 0; part < n; ++part) {
      const uint64_t id = ids[i * n + part];
      if (id == kNoBlock) continue;
      for (size_t layer = 0; layer < l.layers.size(); ++layer) {
        for (int kv = 0; kv < 2; ++kv) {
          CopySegment<kScatter>(l, run, internal::SegmentBase(l, layer, kv, id),
                                internal::CanonicalSegment(l, canonical, layer, kv, part));
        }
      }
    }
  }
}

}  // namespace

size_t PagedLayout::BlockBytes() const {
  return 2 * layers.size() * size_t{blocks_per_canonical} * internal::SegmentBytes(*this);
}

absl::Status PagedLayout::Validate() const {
  if (element_size != 1 && element_size != 2 && element_size != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv layout: element_size ", element_size, ": expected 1, 2 or 4 bytes"));
  }
  const std::pair<const char*, uint64_t> dims[] = {{"num_kv_heads", num_kv_heads},
                                                   {"head_dim", head_dim},
                                                   {"tokens_per_block", tokens_per_block},
                                                   {"num_blocks", num_blocks},
                                                   {"layers", layers.size()},
                                                   {"blocks_per_canonical", blocks_per_canonical}};
  for (const auto& [name, value] : dims) {
    if (value == 0 || value >= kMaxDimension) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv layout: ", name, " ", value, ": expected 1 to 2^32-1"));
    }
  }
  if (u128{2} * layers.size() * blocks_per_canonical * tokens_per_block * num_kv_heads * head_dim *
          element_size >
      kMaxBytes) {
    return absl::InvalidArgumentError("kv layout: block size exceeds 2^62 bytes");
  }
  const bool separate = std::any_of(layers.begin(), layers.end(),
                                    [](const PagedTensor& t) { return t.v_data != nullptr; });
  const std::pair<const char*, int64_t> strides_named[] = {{"kv", strides.kv},
                                                           {"block", strides.block},
                                                           {"token", strides.token},
                                                           {"head", strides.head},
                                                           {"dim", strides.dim}};
  for (const auto& [name, value] : strides_named) {
    if (value < 0 || static_cast<u128>(value) > kMaxBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv layout: stride of axis '", name, "' ", value, ": expected 0 to 2^62"));
    }
  }
  std::vector<Axis> axes = {{"block", strides.block, num_blocks},
                            {"token", strides.token, tokens_per_block},
                            {"head", strides.head, num_kv_heads},
                            {"dim", strides.dim, head_dim}};
  if (!separate) axes.push_back({"kv", strides.kv, 2});
  PROXIMA_RETURN_IF_ERROR(CheckNoOverlap(axes));
  const u128 extent = ExtentBytes(axes, element_size);
  if (extent > kMaxBytes) {
    return absl::InvalidArgumentError("kv layout: tensor extent exceeds 2^62 bytes");
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    const PagedTensor& t = layers[i];
    if (t.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("kv layout: layer ", i, ": null data"));
    }
    if (separate != (t.v_data != nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv layout: layer ", i, ": v_data ", AddressString(t.v_data),
                       ": every layer must have separate K and V tensors or none"));
    }
    if (t.size_bytes != 0 && extent > t.size_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv layout: layer ", i, ": strides reach ", static_cast<uint64_t>(extent),
                       " bytes from data, past its size_bytes ", t.size_bytes));
    }
    if (separate) {
      if (t.v_size_bytes != 0 && extent > t.v_size_bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("kv layout: layer ", i, ": strides reach ", static_cast<uint64_t>(extent),
                         " bytes from v_data, past its v_size_bytes ", t.v_size_bytes));
      }
      const uintptr_t k = reinterpret_cast<uintptr_t>(t.data);
      const uintptr_t v = reinterpret_cast<uintptr_t>(t.v_data);
      if ((k <= v && v - k < extent) || (v < k && k - v < extent)) {
        return absl::InvalidArgumentError(
            absl::StrCat("kv layout: layer ", i, ": K at ", AddressString(t.data), " and V at ",
                         AddressString(t.v_data), " overlap (each spans ",
                         static_cast<uint64_t>(extent), " bytes)"));
      }
    }
  }
  return absl::OkStatus();
}

namespace internal {

absl::Status ValidateCall(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                          std::span<const std::byte* const> blocks, bool scatter) {
  PROXIMA_RETURN_IF_ERROR(layout.Validate());
  const uint32_t n = layout.blocks_per_canonical;
  if (u128{blocks.size()} * n != block_ids.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv layout: ", block_ids.size(), " block ids for ", blocks.size(),
                     " block pointers: expected ", n, " ids per pointer (blocks_per_canonical)"));
  }
  for (size_t i = 0; i < block_ids.size(); ++i) {
    if (block_ids[i] >= layout.num_blocks && block_ids[i] != kNoBlock) {
      return absl::InvalidArgumentError(absl::StrCat("kv layout: block id ", block_ids[i],
                                                     " (index ", i, "): expected < num_blocks ",
                                                     layout.num_blocks, " or kNoBlock"));
    }
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("kv layout: block pointer ", i, " (block id ",
                                                     block_ids[i * n], n > 1 ? ", ..." : "",
                                                     ") is null"));
    }
  }
  if (scatter) {
    std::vector<uint64_t> sorted(block_ids.begin(), block_ids.end());
    std::erase(sorted, kNoBlock);
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    if (dup != sorted.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv layout: block id ", *dup, " appears twice in one scatter"));
    }
  }
  return absl::OkStatus();
}

uint64_t ContiguousRun(const PagedLayout& l) {
  if (l.strides.dim != 1 && l.head_dim != 1) return 1;
  uint64_t run = l.head_dim;
  if (l.num_kv_heads > 1 && l.strides.head != static_cast<int64_t>(run)) return run;
  run *= l.num_kv_heads;
  if (l.tokens_per_block > 1 && l.strides.token != static_cast<int64_t>(run)) return run;
  return run * l.tokens_per_block;
}

size_t SegmentBytes(const PagedLayout& l) {
  return size_t{l.tokens_per_block} * l.num_kv_heads * l.head_dim * l.element_size;
}

std::byte* CanonicalSegment(const PagedLayout& l, std::byte* canonical, size_t layer, int kv,
                            uint32_t part) {
  return canonical + ((2 * layer + kv) * l.blocks_per_canonical + part) * SegmentBytes(l);
}

std::byte* SegmentBase(const PagedLayout& l, size_t layer, int kv, uint64_t block_id) {
  const PagedTensor& t = l.layers[layer];
  std::byte* base = t.data;
  if (kv == 1) base = t.v_data != nullptr ? t.v_data : t.data + l.strides.kv * l.element_size;
  return base + block_id * static_cast<uint64_t>(l.strides.block) * l.element_size;
}

}  // namespace internal

absl::Status GatherBlocks(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                          std::span<std::byte* const> dst_blocks) {
  std::span<const std::byte* const> blocks(const_cast<const std::byte* const*>(dst_blocks.data()),
                                           dst_blocks.size());
  PROXIMA_RETURN_IF_ERROR(internal::ValidateCall(layout, block_ids, blocks, false));
  CopyBlocks<false>(layout, block_ids, blocks);
  return absl::OkStatus();
}

absl::Status ScatterBlocks(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                           std::span<const std::byte* const> src_blocks) {
  PROXIMA_RETURN_IF_ERROR(internal::ValidateCall(layout, block_ids, src_blocks, true));
  CopyBlocks<true>(layout, block_ids, src_blocks);
  return absl::OkStatus();
}

namespace {

// Pointers to the canonical blocks of a back-to-back buffer for `ids` paged block ids, after
// checking its size (a count of ids that is not a multiple of blocks_per_canonical is refused
// by ValidateCall after).
absl::StatusOr<std::vector<std::byte*>> BlocksOf(const PagedLayout& layout, size_t ids,
                                                 const std::byte* data, size_t size) {
  PROXIMA_RETURN_IF_ERROR(layout.Validate());  // BlockBytes() is meaningful
  const size_t bb = layout.BlockBytes();
  const size_t n = ids / layout.blocks_per_canonical;
  if (n > 0 && (data == nullptr || size / bb < n)) {
    return absl::InvalidArgumentError(absl::StrCat("kv layout: block buffer of ", size,
                                                   " bytes at ", AddressString(data), " for ", n,
                                                   " blocks of ", bb, " bytes"));
  }
  std::vector<std::byte*> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = const_cast<std::byte*>(data) + i * bb;
  return out;
}

}  // namespace

absl::Status GatherBlocksToBuffer(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                                  std::span<std::byte> dst) {
  PROXIMA_ASSIGN_OR_RETURN(std::vector<std::byte*> blocks,
                           BlocksOf(layout, block_ids.size(), dst.data(), dst.size()));
  return GatherBlocks(layout, block_ids, blocks);
}

absl::Status ScatterBlocksFromBuffer(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                                     std::span<const std::byte> src) {
  PROXIMA_ASSIGN_OR_RETURN(std::vector<std::byte*> blocks,
                           BlocksOf(layout, block_ids.size(), src.data(), src.size()));
  return ScatterBlocks(layout, block_ids,
                       std::vector<const std::byte*>(blocks.begin(), blocks.end()));
}

}  // namespace proxima::kv_layout
