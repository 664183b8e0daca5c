// Host side of the batched GPU CRC32C: validates the spans, lists their chunks, stages the span
// and chunk lists in one stream-ordered allocation with one copy, and launches the two kernels.
#include "kernels/crc32c_cuda.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/internal/crc32c_launch.h"
#include "kernels/internal/crc32c_math.h"

namespace proxima::gpu {
namespace {

namespace m = crc32c_math;
using crc32c_cuda::SpanDesc;

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("crc32c: ", what, ": ", cudaGetErrorString(err)));
}

const m::ShiftPowers& Powers() {
  static const m::ShiftPowers powers = m::MakeShiftPowers();
  return powers;
}

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

absl::Status Crc32cBatchCuda(std::span<const DeviceSpan> spans, uint32_t* crcs_device,
                             CUstream_st* stream) {
  if (spans.empty()) return absl::OkStatus();
  if (crcs_device == nullptr) return absl::InvalidArgumentError("crc32c: null output array");
  if (spans.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("crc32c: ", spans.size(), " spans (max 2^32-1)"));
  }
  std::vector<SpanDesc> descs(spans.size());
  uint64_t num_chunks = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const uint64_t begin = reinterpret_cast<uintptr_t>(spans[i].data);
    const uint64_t size = spans[i].size;
    if (size > 0 && begin == 0) {
      return absl::InvalidArgumentError(absl::StrCat("crc32c: span ", i, " has null data"));
    }
    if (size > std::numeric_limits<uint64_t>::max() - begin) {
      return absl::InvalidArgumentError(absl::StrCat("crc32c: span ", i, " wraps the address space"));
    }
    descs[i] = {begin, size, num_chunks};
    num_chunks += m::NumChunks(begin, size);
  }
  // One host buffer (span list, then the span of every chunk) copied with one call; the device
  // allocation also holds the chunk scratch after them.
  const size_t desc_bytes = descs.size() * sizeof(SpanDesc);
  const size_t map_offset = AlignUp(desc_bytes, 16);
  const size_t map_bytes = num_chunks * sizeof(uint32_t);
  const size_t scratch_offset = AlignUp(map_offset + map_bytes, 16);
  const size_t total_bytes = scratch_offset + AlignUp(map_bytes, 16);
  std::vector<unsigned char> staging(scratch_offset);
  std::memcpy(staging.data(), descs.data(), desc_bytes);
  auto* map = reinterpret_cast<uint32_t*>(staging.data() + map_offset);
  for (size_t i = 0; i < descs.size(); ++i) {
    const uint64_t n = m::NumChunks(descs[i].begin, descs[i].size);
    for (uint64_t k = 0; k < n; ++k) map[descs[i].first_chunk + k] = static_cast<uint32_t>(i);
  }
  void* dev = nullptr;
  cudaStream_t s = stream;
  PROXIMA_RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(&dev, total_bytes, s), "cudaMallocAsync"));
  auto* base = static_cast<unsigned char*>(dev);
  // From pageable memory the copy is staged before the call returns, so `staging` may go away.
  cudaError_t err = cudaMemcpyAsync(dev, staging.data(), staging.size(), cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess) {
    err = crc32c_cuda::LaunchCrc32cBatch(
        reinterpret_cast<const SpanDesc*>(base), static_cast<uint32_t>(descs.size()),
        reinterpret_cast<const uint32_t*>(base + map_offset), num_chunks,
        reinterpret_cast<uint32_t*>(base + scratch_offset), crcs_device, Powers(), s);
  }
  cudaFreeAsync(dev, s);
  return CudaStatus(err, "kernels");
}

absl::Status Crc32cBatchCudaToHost(std::span<const DeviceSpan> spans, std::span<uint32_t> crcs_host,
                                   CUstream_st* stream) {
  if (crcs_host.size() != spans.size()) {
    return absl::InvalidArgumentError(absl::StrCat("crc32c: ", crcs_host.size(),
                                                   " output words for ", spans.size(), " spans"));
  }
  if (spans.empty()) return absl::OkStatus();
  void* dev = nullptr;
  const size_t bytes = spans.size() * sizeof(uint32_t);
  PROXIMA_RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(&dev, bytes, stream), "cudaMallocAsync"));
  absl::Status st = Crc32cBatchCuda(spans, static_cast<uint32_t*>(dev), stream);
  if (st.ok()) {
    st = CudaStatus(cudaMemcpyAsync(crcs_host.data(), dev, bytes, cudaMemcpyDeviceToHost, stream),
                    "cudaMemcpyAsync");
  }
  cudaFreeAsync(dev, stream);
  const absl::Status sync = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return st.ok() ? sync : st;
}

}  // namespace proxima::gpu
