// Host side of the CUDA gather/scatter: validates on the host (the same checks as the CPU path),
// lists every (block, layer, K|V) segment, picks the widest copy unit every address and stride
// allows, and launches one kernel for the batch.
#include <cuda_runtime_api.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/internal/kv_layout_launch.h"
#include "kernels/kv_layout.h"

namespace proxima::kv_layout {
namespace {

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

absl::Status CopyCuda(const PagedLayout& l, std::span<const uint64_t> ids,
                      std::span<const std::byte* const> blocks, bool scatter, cudaStream_t stream) {
  PROXIMA_RETURN_IF_ERROR(internal::ValidateCall(l, ids, blocks, scatter));
  const uint64_t es = l.element_size;
  const uint32_t n = l.blocks_per_canonical;
  std::vector<cuda::SegmentPair> pairs;
  pairs.reserve(ids.size() * l.layers.size() * 2);
  // OR of every address and byte stride: its lowest bit bounds the unit. The canonical segments
  // follow each other SegmentBytes() apart.
  uint64_t alignment = internal::SegmentBytes(l);
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto* canonical = const_cast<std::byte*>(blocks[i]);
    alignment |= reinterpret_cast<uintptr_t>(canonical);
    for (uint32_t part = 0; part < n; ++part) {
      const uint64_t id = ids[i * n + part];
      if (id == kNoBlock) continue;
      for (size_t layer = 0; layer < l.layers.size(); ++layer) {
        for (int kv = 0; kv < 2; ++kv) {
          auto* paged = reinterpret_cast<unsigned char*>(internal::SegmentBase(l, layer, kv, id));
          alignment |= reinterpret_cast<uintptr_t>(paged);
          pairs.push_back({paged, reinterpret_cast<unsigned char*>(
                                      internal::CanonicalSegment(l, canonical, layer, kv, part))});
        }
      }
    }
  }
  cuda::SegmentShape shape;
  shape.tokens = l.tokens_per_block;
  shape.heads = l.num_kv_heads;
  shape.token_stride = l.strides.token * static_cast<int64_t>(es);
  shape.head_stride = l.strides.head * static_cast<int64_t>(es);
  if (l.strides.dim == 1 || l.head_dim == 1) {
    // A head_dim row is contiguous: copy it in the widest unit that divides it and every offset.
    const uint64_t row_bytes = l.head_dim * es;
    alignment |= row_bytes | static_cast<uint64_t>(shape.token_stride) |
                 static_cast<uint64_t>(shape.head_stride);
    uint64_t unit = 16;
    while (alignment % unit != 0) unit /= 2;
    shape.unit_bytes = static_cast<uint32_t>(unit);
    shape.units_per_row = row_bytes / unit;
    shape.unit_stride = static_cast<int64_t>(unit);
  } else {
    // Strided dim: element by element, each element one aligned load and store.
    if (alignment % es != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv layout: an address is not a multiple of element_size ", es,
                       " (the CUDA path loads whole elements when the dim axis is strided)"));
    }
    shape.unit_bytes = static_cast<uint32_t>(es);
    shape.units_per_row = l.head_dim;
    shape.unit_stride = l.strides.dim * static_cast<int64_t>(es);
  }
  if (pairs.empty()) return absl::OkStatus();  // no ids, or only kNoBlock
  void* dev = nullptr;
  const size_t bytes = pairs.size() * sizeof(cuda::SegmentPair);
  PROXIMA_RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(&dev, bytes, stream), "cudaMallocAsync"));
  // From pageable memory the copy is staged before the call returns, so `pairs` may go away.
  cudaError_t err = cudaMemcpyAsync(dev, pairs.data(), bytes, cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) {
    err = cuda::LaunchCopySegments(static_cast<const cuda::SegmentPair*>(dev), pairs.size(), shape,
                                   scatter, stream);
  }
  cudaFreeAsync(dev, stream);
  return CudaStatus(err, scatter ? "kv scatter kernel" : "kv gather kernel");
}

}  // namespace

absl::Status GatherBlocksCuda(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                              std::span<std::byte* const> dst_blocks, CUstream_st* stream) {
  std::span<const std::byte* const> blocks(const_cast<const std::byte* const*>(dst_blocks.data()),
                                           dst_blocks.size());
  return CopyCuda(layout, block_ids, blocks, false, stream);
}

absl::Status ScatterBlocksCuda(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                               std::span<const std::byte* const> src_blocks, CUstream_st* stream) {
  return CopyCuda(layout, block_ids, src_blocks, true, stream);
}

}  // namespace proxima::kv_layout
