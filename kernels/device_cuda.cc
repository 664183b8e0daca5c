// GPU discovery and copies for builds with CUDA: asks the CUDA runtime (linked statically, so the
// binary runs on machines without the toolkit; it loads the driver at run time if there is one).
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
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

namespace {

absl::Status CudaError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear it, as above
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorString(err));
  return err == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(message)
                                          : absl::InternalError(message);
}

absl::Status NeedDevice() {
  std::string why_none;
  if (VisibleDevices(&why_none).empty()) return absl::FailedPreconditionError(why_none);
  return absl::OkStatus();
}

}  // namespace

bool IsDeviceMemory(const void* p) {
  if (p == nullptr) return false;
  cudaPointerAttributes attrs;
  if (cudaPointerGetAttributes(&attrs, p) != cudaSuccess) {
    cudaGetLastError();  // no driver or device: host memory
    return false;
  }
  return attrs.type == cudaMemoryTypeDevice || attrs.type == cudaMemoryTypeManaged;
}

absl::StatusOr<std::unique_ptr<PinnedBuffer>> PinnedBuffer::Allocate(size_t bytes) {
  if (absl::Status s = NeedDevice(); !s.ok()) return s;
  void* p = nullptr;
  if (absl::Status s = CudaError(cudaMallocHost(&p, bytes > 0 ? bytes : 1),
                                 absl::StrCat("cudaMallocHost of ", bytes, " bytes").c_str());
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<PinnedBuffer>(new PinnedBuffer(static_cast<std::byte*>(p), bytes));
}

PinnedBuffer::~PinnedBuffer() {
  if (cudaFreeHost(data_) != cudaSuccess) cudaGetLastError();
}

struct CopyQueue::Impl {
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> fences;
  ~Impl() {
    for (cudaEvent_t e : fences) cudaEventDestroy(e);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

CopyQueue::CopyQueue(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CopyQueue::~CopyQueue() {
  if (impl_->stream != nullptr && cudaStreamSynchronize(impl_->stream) != cudaSuccess) {
    cudaGetLastError();
  }
}

absl::StatusOr<std::unique_ptr<CopyQueue>> CopyQueue::Create(int fences) {
  if (absl::Status s = NeedDevice(); !s.ok()) return s;
  auto impl = std::make_unique<Impl>();
  if (absl::Status s = CudaError(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking),
                                 "cudaStreamCreate");
      !s.ok()) {
    return s;
  }
  for (int f = 0; f < fences; ++f) {
    cudaEvent_t e = nullptr;
    if (absl::Status s = CudaError(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                                   "cudaEventCreate");
        !s.ok()) {
      return s;
    }
    impl->fences.push_back(e);
  }
  return std::unique_ptr<CopyQueue>(new CopyQueue(std::move(impl)));
}

absl::Status CopyQueue::Copy(void* dst, const void* src, size_t n) {
  if (n == 0) return absl::OkStatus();
  return CudaError(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, impl_->stream),
                   "cudaMemcpyAsync");
}

absl::Status CopyQueue::Mark(int f) {
  if (f < 0 || f >= static_cast<int>(impl_->fences.size())) {
    return absl::InvalidArgumentError(absl::StrCat("fence ", f, " of ", impl_->fences.size()));
  }
  return CudaError(cudaEventRecord(impl_->fences[f], impl_->stream), "cudaEventRecord");
}

absl::Status CopyQueue::Wait(int f) {
  if (f < 0 || f >= static_cast<int>(impl_->fences.size())) {
    return absl::InvalidArgumentError(absl::StrCat("fence ", f, " of ", impl_->fences.size()));
  }
  return CudaError(cudaEventSynchronize(impl_->fences[f]), "cudaEventSynchronize");
}

absl::Status CopyQueue::Drain() {
  return CudaError(cudaStreamSynchronize(impl_->stream), "cudaStreamSynchronize");
}

absl::Status UseDevice(int device) {
  int count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    cudaGetLastError();  // clear it, as above
    return absl::FailedPreconditionError(absl::StrCat("cudaGetDeviceCount: ",
                                                      cudaGetErrorString(err)));
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " is not visible (", count, " visible)"));
  }
  return CudaError(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")").c_str());
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Allocate(int device, size_t bytes) {
  PROXIMA_RETURN_IF_ERROR(UseDevice(device));
  void* p = nullptr;
  PROXIMA_RETURN_IF_ERROR(CudaError(
      cudaMalloc(&p, bytes > 0 ? bytes : 1),
      absl::StrCat("cudaMalloc of ", bytes, " bytes on CUDA device ", device).c_str()));
  return std::unique_ptr<DeviceBuffer>(new DeviceBuffer(device, static_cast<std::byte*>(p), bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (cudaSetDevice(device_) != cudaSuccess || cudaFree(data_) != cudaSuccess) cudaGetLastError();
}

namespace {

absl::Status CheckRange(const char* what, size_t offset, size_t n, size_t size) {
  if (offset > size || n > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(what, " of ", n, " bytes at offset ", offset,
                                                   " does not lie in a device buffer of ", size,
                                                   " bytes"));
  }
  return absl::OkStatus();
}

// One copy on the calling thread's stream of `device` (the buffer's: its own stream on another
// GPU would copy through that one), waited for.
absl::Status CopyAndWait(int device, void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                         const char* what) {
  if (n == 0) return absl::OkStatus();
  PROXIMA_RETURN_IF_ERROR(CudaError(cudaSetDevice(device), "cudaSetDevice"));
  PROXIMA_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(dst, src, n, kind, cudaStreamPerThread), what));
  return CudaError(cudaStreamSynchronize(cudaStreamPerThread), what);
}

}  // namespace

absl::Status DeviceBuffer::CopyIn(size_t offset, std::span<const std::byte> src) {
  PROXIMA_RETURN_IF_ERROR(CheckRange("DeviceBuffer::CopyIn", offset, src.size(), size_));
  return CopyAndWait(device_, data_ + offset, src.data(), src.size(), cudaMemcpyHostToDevice,
                     "cudaMemcpyAsync host to device");
}

absl::Status DeviceBuffer::CopyOut(size_t offset, std::span<std::byte> dst) const {
  PROXIMA_RETURN_IF_ERROR(CheckRange("DeviceBuffer::CopyOut", offset, dst.size(), size_));
  return CopyAndWait(device_, dst.data(), data_ + offset, dst.size(), cudaMemcpyDeviceToHost,
                     "cudaMemcpyAsync device to host");
}

}  // namespace proxima::gpu
