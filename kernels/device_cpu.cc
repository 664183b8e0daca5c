// VisibleDevices() for builds without CUDA.
#include "kernels/device.h"

namespace proxima::gpu {

bool BuiltWithCuda() { return false; }

std::vector<DeviceInfo> VisibleDevices(std::string* why_none) {
  if (why_none != nullptr) *why_none = "built without CUDA";
  return {};
}

absl::Status PinHostMemory(void*, size_t) {
  return absl::FailedPreconditionError("built without CUDA");
}

void UnpinHostMemory(void*) {}

}  // namespace proxima::gpu
