// GPU discovery and copies for builds without CUDA: no device, every request refused.
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

bool IsDeviceMemory(const void*) { return false; }

absl::StatusOr<std::unique_ptr<PinnedBuffer>> PinnedBuffer::Allocate(size_t) {
  return absl::FailedPreconditionError("built without CUDA");
}
PinnedBuffer::~PinnedBuffer() = default;

struct CopyQueue::Impl {};
CopyQueue::CopyQueue(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CopyQueue::~CopyQueue() = default;
absl::StatusOr<std::unique_ptr<CopyQueue>> CopyQueue::Create(int) {
  return absl::FailedPreconditionError("built without CUDA");
}
absl::Status CopyQueue::Copy(void*, const void*, size_t) {
  return absl::FailedPreconditionError("built without CUDA");
}
absl::Status CopyQueue::Mark(int) { return absl::FailedPreconditionError("built without CUDA"); }
absl::Status CopyQueue::Wait(int) { return absl::FailedPreconditionError("built without CUDA"); }
absl::Status CopyQueue::Drain() { return absl::FailedPreconditionError("built without CUDA"); }

absl::Status UseDevice(int) { return absl::FailedPreconditionError("built without CUDA"); }

absl::StatusOr<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Allocate(int, size_t) {
  return absl::FailedPreconditionError("built without CUDA");
}
DeviceBuffer::~DeviceBuffer() = default;
absl::Status DeviceBuffer::CopyIn(size_t, std::span<const std::byte>) {
  return absl::FailedPreconditionError("built without CUDA");
}
absl::Status DeviceBuffer::CopyOut(size_t, std::span<std::byte>) const {
  return absl::FailedPreconditionError("built without CUDA");
}

}  // namespace proxima::gpu
