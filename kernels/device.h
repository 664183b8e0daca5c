// GPU discovery and host<->device copies for Proxima. Every binary is built to run with or
// without a GPU: when the CUDA kernels were not built, or no device/driver is present at run time,
// VisibleDevices() is empty and callers take the CPU path. The free functions are thread-safe.
#ifndef PROXIMA_KERNELS_DEVICE_H_
#define PROXIMA_KERNELS_DEVICE_H_

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

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

// True when `p` is memory of a CUDA device (device or managed allocations, which host code
// cannot be trusted to read); false for host memory (pageable or pinned), without CUDA and
// without a device.
bool IsDeviceMemory(const void* p);

// Page-locked host memory from the CUDA driver (cudaMallocHost), for copies to and from device
// memory at full DMA speed; freed when destroyed. Not thread-safe: one owner.
class PinnedBuffer {
 public:
  // FailedPrecondition without CUDA or a device, ResourceExhausted when the driver refuses.
  static absl::StatusOr<std::unique_ptr<PinnedBuffer>> Allocate(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  PinnedBuffer(std::byte* data, size_t size) : data_(data), size_(size) {}
  std::byte* data_;
  size_t size_;
};

// An in-order queue of copies between any two memories of the process (a CUDA stream of its
// own; the runtime's unified addressing tells each pointer's kind), with `fences` numbered
// points the host can wait for. Not thread-safe: one owner.
class CopyQueue {
 public:
  // FailedPrecondition without CUDA or a device.
  static absl::StatusOr<std::unique_ptr<CopyQueue>> Create(int fences);
  ~CopyQueue();
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;
  // Enqueues a copy of n bytes from src to dst (device or host memory, either way).
  absl::Status Copy(void* dst, const void* src, size_t n);
  // Fence `f` (0 <= f < fences) is passed once every copy enqueued so far has finished.
  absl::Status Mark(int f);
  // Blocks until fence `f` is passed (at once if it was never marked).
  absl::Status Wait(int f);
  // Blocks until every copy enqueued so far has finished.
  absl::Status Drain();

 private:
  struct Impl;
  explicit CopyQueue(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Makes `device` the calling thread's current CUDA device, for the kernels and allocations it
// starts next. FailedPrecondition without CUDA or when `device` is not visible.
absl::Status UseDevice(int device);

// Memory of one CUDA device (cudaMalloc once), freed when destroyed. Host code never dereferences
// data(): bytes move in and out with CopyIn/CopyOut, which make the buffer's device the calling
// thread's current one, run on that thread's own stream (cudaStreamPerThread) and return once
// the copy is done, so threads may copy to and from distinct ranges at once. Thread-safe.
class DeviceBuffer {
 public:
  // FailedPrecondition without CUDA or when `device` is not visible; ResourceExhausted naming the
  // device and the size when the driver refuses the allocation.
  static absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(int device, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  int device() const { return device_; }
  std::byte* data() const { return data_; }  // device memory
  size_t size() const { return size_; }

  // Copies `src` (host memory) to [offset, offset + src.size()) of the buffer. InvalidArgument
  // when the range does not lie in the buffer; Internal with the driver's message on failure.
  absl::Status CopyIn(size_t offset, std::span<const std::byte> src);
  // Copies [offset, offset + dst.size()) of the buffer to `dst` (host memory).
  absl::Status CopyOut(size_t offset, std::span<std::byte> dst) const;

 private:
  DeviceBuffer(int device, std::byte* data, size_t size)
      : device_(device), data_(data), size_(size) {}
  const int device_;
  std::byte* const data_;
  const size_t size_;
};

}  // namespace proxima::gpu

#endif  // PROXIMA_KERNELS_DEVICE_H_
