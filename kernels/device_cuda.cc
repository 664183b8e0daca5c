// VisibleDevices() for builds with CUDA: asks the CUDA runtime (linked statically, so the binary
// runs on machines without the toolkit; it loads the driver at run time if there is one).
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "kernels/device.h"

namespace proxima::gpu {

bool BuiltWithCuda() { return true; }

std::vector<DeviceInfo> VisibleDevices(std::string* why_none) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why_none != nullptr) {
      *why_none = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    }
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return {};
  }
  std::vector<DeviceInfo> devices;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    devices.push_back(DeviceInfo{i, prop.name, prop.totalGlobalMem, prop.major * 10 + prop.minor});
  }
  if (devices.empty() && why_none != nullptr) *why_none = "no CUDA device visible";
  return devices;
}

absl::Status PinHostMemory(void* data, size_t bytes) {
  std::string why_none;
  if (VisibleDevices(&why_none).empty()) return absl::FailedPreconditionError(why_none);
  cudaError_t err = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it, as above
    const std::string message =
        absl::StrCat("cudaHostRegister of ", bytes, " bytes: ", cudaGetErrorString(err));
    return err == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(message)
                                            : absl::InternalError(message);
  }
  return absl::OkStatus();
}

void UnpinHostMemory(void* data) {
  if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
}

}  // namespace proxima::gpu
