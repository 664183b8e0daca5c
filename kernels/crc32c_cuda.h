// Batched CRC32C of device memory on the GPU: one checksum per span, for verifying and stamping
// the payload CRC of stored blocks (docs/format.md) without bringing the bytes to the host. The
// results equal common/crc32c.h's Crc32c() bit for bit (Castagnoli, reflected, init ~0, final ~0;
// an empty span's CRC is 0).
//
// Contract:
//  - Spans are any device (or managed) memory the current device can read: any byte address,
//    any length including 0; spans may overlap or repeat. Only [data, data + size) is read.
//  - Crc32cBatchCuda validates the arguments on the host, stages the span list with one
//    host-to-device copy, and enqueues on `stream` (a cudaStream_t; nullptr = the legacy default
//    stream) two kernel launches for the whole batch, whatever the span count, plus a
//    stream-ordered allocation and free of its scratch (cudaMallocAsync / cudaFreeAsync). It
//    never synchronises. The spans' bytes must be ready when the stream reaches the kernels and
//    stay valid until they finish; the host `spans` array may go away when the call returns.
//  - Cost: reads every byte once (pass 1: one warp per 16 KiB aligned chunk, slicing-by-16
//    tables in shared memory); pass 2 folds each span's chunks in order on one warp, a few
//    shared-memory lookups per chunk.
//  - Thread-safety: reentrant; concurrent calls on distinct output arrays are safe.
//  - Builds without CUDA get these functions too; they return kFailedPrecondition.
#ifndef PROXIMA_KERNELS_CRC32C_CUDA_H_
#define PROXIMA_KERNELS_CRC32C_CUDA_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/status.h"

// The CUDA runtime's stream handle type (cudaStream_t is `CUstream_st*`), declared here so that
// this header compiles without the CUDA toolkit.
struct CUstream_st;

namespace proxima::gpu {

// `size` bytes of device memory at `data` (data may be null when size is 0).
struct DeviceSpan {
  const std::byte* data = nullptr;
  size_t size = 0;
};

// Enqueues the CRC32C of every span; crcs_device[i] (device memory, spans.size() words, any
// 4-byte-aligned address) receives Crc32c(spans[i]) when the stream gets there. An empty batch
// enqueues nothing. InvalidArgument when crcs_device is null for a non-empty batch, a span has
// null data and a non-zero size, or a span wraps the address space; Internal with the CUDA
// error when an allocation, copy or launch fails.
absl::Status Crc32cBatchCuda(std::span<const DeviceSpan> spans, uint32_t* crcs_device,
                             CUstream_st* stream);

// Convenience for callers that want the CRCs on the host: Crc32cBatchCuda into a scratch device
// array, copied into crcs_host (REQUIRES: crcs_host.size() == spans.size()); synchronises
// `stream` before returning.
absl::Status Crc32cBatchCudaToHost(std::span<const DeviceSpan> spans, std::span<uint32_t> crcs_host,
                                   CUstream_st* stream);

}  // namespace proxima::gpu

#endif  // PROXIMA_KERNELS_CRC32C_CUDA_H_
