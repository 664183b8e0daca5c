// GPU discovery for Proxima. Every binary is built to run with or without a GPU: when the CUDA
// kernels were not built, or no device/driver is present at run time, VisibleGpuCount() is 0 and
// callers take the CPU path. Thread-safe.
#ifndef PROXIMA_KERNELS_DEVICE_H_
#define PROXIMA_KERNELS_DEVICE_H_

#include <string>
#include <vector>

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

}  // namespace proxima::gpu

#endif  // PROXIMA_KERNELS_DEVICE_H_
