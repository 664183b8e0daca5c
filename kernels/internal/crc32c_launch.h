// Launcher of the batched CRC32C kernels (kernels/crc32c_kernels.cu), for the host wrapper
// kernels/crc32c_cuda.cc. It enqueues on `stream` and returns the launch error; it never
// synchronises. Thread-safety: callable from any host thread.
#ifndef PROXIMA_KERNELS_INTERNAL_CRC32C_LAUNCH_H_
#define PROXIMA_KERNELS_INTERNAL_CRC32C_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/internal/crc32c_math.h"

namespace proxima::gpu::crc32c_cuda {

// One span of device memory and the index of its first chunk in the batch's chunk list
// (crc32c_math::NumChunks chunks each, in span order).
struct SpanDesc {
  uint64_t begin = 0;  // device address
  uint64_t size = 0;
  uint64_t first_chunk = 0;
};

// Device arrays: `spans` (num_spans), `chunk_span` (num_chunks: the span of every chunk),
// `chunk_raw` (num_chunks scratch words). Writes the num_spans CRCs to `crcs`. Two kernels: one
// warp per chunk, then one warp per span.
cudaError_t LaunchCrc32cBatch(const SpanDesc* spans, uint32_t num_spans, const uint32_t* chunk_span,
                              uint64_t num_chunks, uint32_t* chunk_raw, uint32_t* crcs,
                              const crc32c_math::ShiftPowers& powers, cudaStream_t stream);

}  // namespace proxima::gpu::crc32c_cuda

#endif  // PROXIMA_KERNELS_INTERNAL_CRC32C_LAUNCH_H_
