// Builds without CUDA: the batch GPU entry points exist and say why they cannot run.
#include "kernels/codec_cuda.h"

namespace proxima::codec {

absl::Status DecodeBlocksCuda(std::span<const CudaDecodeJob>, CUstream_st*, CudaCallTiming*) {
  return absl::FailedPreconditionError("built without CUDA");
}

absl::Status EncodeBlocksCuda(const BlockGeometry&, const CodecPlan&,
                              std::span<const CudaEncodeJob>, CUstream_st*, CudaCallTiming*) {
  return absl::FailedPreconditionError("built without CUDA");
}

}  // namespace proxima::codec
