// GPU discovery for Proxima. Every binary is built to run with or without a GPU: when the CUDA
// kernels were not built, or no device/driver is present at run time, VisibleGpuCount() is 0 and
// callers take the CPU path. Thread-safe.
#ifndef PROXIMA_KERNELS_DEVICE_H_
#define PROXIMA_KERNELS_DEVICE_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace proxima::gpu {

struct DeviceInfo {
  int ordinal = 0;
  std::string name;            // e.g. "NVIDIA H200"
  size_t total_bytes = 0;      // device memory
  int compute_capability = 0;  // major * 10 + minor, e.g. 90
};

// True when this binary was built with the CUDA kernels.
bool BuiltWithCuda();

// Devices usable now; empty without CUDA, driver or device. `why_none` (optional) receives the
// reason when the list is empty, e.g. "built without CUDA" or "cudaGetDeviceCount: no CUDA-capable
// device is detected".
std::vector<DeviceInfo> VisibleDevices(std::string* why_none = nullptr);

// Page-locks host memory [data, data + bytes) and registers it with the CUDA driver
// (cudaHostRegister, portable to every device), so that copies between it and device memory run
// at full DMA speed with no staging copy. Every page of the range is committed and locked.
// FailedPrecondition naming the reason when the binary has no CUDA or no device is visible;
// ResourceExhausted/Internal with the driver's message when registration fails. The memory
// stays usable either way.
absl::Status PinHostMemory(void* data, size_t bytes);
// Undoes PinHostMemory. REQUIRES: `data` was pinned by it and is still mapped.
void UnpinHostMemory(void* data);

}  // namespace proxima::gpu

#endif  // PROXIMA_KERNELS_DEVICE_H_
