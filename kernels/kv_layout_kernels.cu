// The paged-KV gather/scatter kernel: grid.x walks the (block, layer, K|V) segments, grid.y and
// the threads the units of one segment; each thread copies whole units (up to 16 bytes) so a
// contiguous head_dim row moves in vector loads and stores.
#include <algorithm>

#include "kernels/internal/kv_layout_launch.h"

namespace proxima::kv_layout::cuda {
namespace {

constexpr uint32_t kThreads = 256;
constexpr uint64_t kMaxGridX = 65535;      // segments per launch row (the kernel loops past it)
constexpr uint64_t kMaxBlocksPerSeg = 64;  // grid.y: a segment is at most a few MiB

template <typename Unit, bool kScatter>
__global__ void CopySegmentsKernel(const SegmentPair* segments, uint64_t num_segments,
                                   SegmentShape shape) {
  const uint64_t rows = shape.tokens * shape.heads;
  const uint64_t units = rows * shape.units_per_row;
  for (uint64_t s = blockIdx.x; s < num_segments; s += gridDim.x) {
    unsigned char* paged = segments[s].paged;
    Unit* canonical = reinterpret_cast<Unit*>(segments[s].canonical);
    for (uint64_t u = uint64_t{blockIdx.y} * blockDim.x + threadIdx.x; u < units;
         u += uint64_t{gridDim.y} * blockDim.x) {
      const uint64_t row = u / shape.units_per_row;
      const uint64_t k = u - row * shape.units_per_row;
      const uint64_t t = row / shape.heads;
      const uint64_t h = row - t * shape.heads;
      Unit* p = reinterpret_cast<Unit*>(paged + t * shape.token_stride + h * shape.head_stride +
                                        k * shape.unit_stride);
      if constexpr (kScatter) {
        *p = canonical[u];
      } else {
        canonical[u] = *p;
      }
    }
  }
}

template <typename Unit>
cudaError_t Launch(const SegmentPair* segments, uint64_t num_segments, const SegmentShape& shape,
                   bool scatter, cudaStream_t stream) {
  const uint64_t units = shape.tokens * shape.heads * shape.units_per_row;
  const dim3 grid(static_cast<uint32_t>(std::min(kMaxGridX, num_segments)),
                  static_cast<uint32_t>(std::min<uint64_t>(
                      kMaxBlocksPerSeg, std::max<uint64_t>(1, (units + kThreads - 1) / kThreads))));
  if (scatter) {
    CopySegmentsKernel<Unit, true><<<grid, kThreads, 0, stream>>>(segments, num_segments, shape);
  } else {
    CopySegmentsKernel<Unit, false><<<grid, kThreads, 0, stream>>>(segments, num_segments, shape);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCopySegments(const SegmentPair* segments, uint64_t num_segments,
                               const SegmentShape& shape, bool scatter, cudaStream_t stream) {
  if (num_segments == 0) return cudaSuccess;
  switch (shape.unit_bytes) {
    case 1:
      return Launch<uint8_t>(segments, num_segments, shape, scatter, stream);
    case 2:
      return Launch<uint16_t>(segments, num_segments, shape, scatter, stream);
    case 4:
      return Launch<uint32_t>(segments, num_segments, shape, scatter, stream);
    case 8:
      return Launch<uint2>(segments, num_segments, shape, scatter, stream);
    case 16:
      return Launch<uint4>(segments, num_segments, shape, scatter, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace proxima::kv_layout::cuda
