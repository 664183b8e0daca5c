// Launcher of the paged-KV gather/scatter kernel (kernels/kv_layout_kernels.cu), for the host
// wrapper kernels/kv_layout_cuda.cc. It enqueues on `stream` and returns the launch error; it
// never synchronises. Thread-safety: callable from any host thread.
#ifndef PROXIMA_KERNELS_INTERNAL_KV_LAYOUT_LAUNCH_H_
#define PROXIMA_KERNELS_INTERNAL_KV_LAYOUT_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace proxima::kv_layout::cuda {

// One (block, layer, K|V) segment: where it lives in the paged tensor (element token=0, head=0,
// dim=0) and in the canonical block.
struct SegmentPair {
  unsigned char* paged;
  unsigned char* canonical;
};

// Geometry of every segment, in units of `unit_bytes` (1, 2, 4, 8 or 16; every address and
// byte stride below is a multiple of it). A segment is tokens * heads rows of `units_per_row`
// units; unit k of row (t, h) is at paged + t * token_stride + h * head_stride + k * unit_stride
// bytes and at canonical + ((t * heads + h) * units_per_row + k) * unit_bytes.
struct SegmentShape {
  uint64_t tokens = 0;
  uint64_t heads = 0;
  uint64_t units_per_row = 0;
  int64_t token_stride = 0;  // bytes
  int64_t head_stride = 0;   // bytes
  int64_t unit_stride = 0;   // bytes
  uint32_t unit_bytes = 0;
};

// `segments`: device array of `num_segments` pairs. scatter = false copies paged -> canonical.
cudaError_t LaunchCopySegments(const SegmentPair* segments, uint64_t num_segments,
                               const SegmentShape& shape, bool scatter, cudaStream_t stream);

}  // namespace proxima::kv_layout::cuda

#endif  // PROXIMA_KERNELS_INTERNAL_KV_LAYOUT_LAUNCH_H_
