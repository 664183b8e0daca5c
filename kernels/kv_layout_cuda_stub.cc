// Builds without CUDA: the GPU gather/scatter entry points exist and say why they cannot run.
#include "kernels/kv_layout.h"

namespace proxima::kv_layout {

absl::Status GatherBlocksCuda(const PagedLayout&, std::span<const uint64_t>,
                              std::span<std::byte* const>, CUstream_st*) {
  return absl::FailedPreconditionError("built without CUDA");
}

absl::Status ScatterBlocksCuda(const PagedLayout&, std::span<const uint64_t>,
                               std::span<const std::byte* const>, CUstream_st*) {
  return absl::FailedPreconditionError("built without CUDA");
}

}  // namespace proxima::kv_layout
