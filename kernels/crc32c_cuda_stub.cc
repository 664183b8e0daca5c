// Builds without CUDA: the batched GPU CRC32C entry points exist and say why they cannot run.
#include "kernels/crc32c_cuda.h"

namespace proxima::gpu {

absl::Status Crc32cBatchCuda(std::span<const DeviceSpan>, uint32_t*, CUstream_st*) {
  return absl::FailedPreconditionError("built without CUDA");
}

absl::Status Crc32cBatchCudaToHost(std::span<const DeviceSpan>, std::span<uint32_t>,
                                   CUstream_st*) {
  return absl::FailedPreconditionError("built without CUDA");
}

}  // namespace proxima::gpu
