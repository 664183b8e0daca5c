#include "daemon/device_pool.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/codec_cuda.h"
#include "kernels/crc32c_cuda.h"
#include "kernels/device.h"

namespace proxima::daemon {
namespace {

// Device memory from the CUDA runtime: one gpu::DeviceBuffer, encoded by the batched kernels.
class CudaMemory final : public DeviceMemory {
 public:
  explicit CudaMemory(std::unique_ptr<gpu::DeviceBuffer> buffer) : buffer_(std::move(buffer)) {}

  int device() const override { return buffer_->device(); }
  uint64_t size_bytes() const override { return buffer_->size(); }

  absl::Status CopyIn(uint64_t offset, std::span<const std::byte> src) override {
    return buffer_->CopyIn(offset, src);
  }
  absl::Status CopyOut(uint64_t offset, std::span<std::byte> dst) override {
    return buffer_->CopyOut(offset, dst);
  }

  absl::Status Checksum(std::span<const uint64_t> offsets, uint64_t bytes,
                        std::span<uint32_t> crcs) override {
    std::vector<gpu::DeviceSpan> spans;
    spans.reserve(offsets.size());
    for (const uint64_t offset : offsets) {
      PROXIMA_RETURN_IF_ERROR(InPool(offset, bytes, "checksum"));
      spans.push_back({buffer_->data() + offset, bytes});
    }
    PROXIMA_RETURN_IF_ERROR(gpu::UseDevice(buffer_->device()));
    return gpu::Crc32cBatchCudaToHost(spans, crcs, /*stream=*/nullptr);
  }

  absl::Status Encode(const codec::BlockGeometry& geometry, const codec::CodecPlan& plan,
                      std::span<const EncodeJob> jobs) override {
    const uint64_t raw_bytes = geometry.RawBytes();
    std::vector<codec::CudaEncodeJob> cuda_jobs;
    cuda_jobs.reserve(jobs.size());
    for (const EncodeJob& job : jobs) {
      PROXIMA_RETURN_IF_ERROR(InPool(job.offset, raw_bytes, "encode"));
      cuda_jobs.push_back(
          codec::CudaEncodeJob{buffer_->data() + job.offset, job.is_first_block, job.out, nullptr});
    }
    // The kernels run on the calling thread's current device.
    PROXIMA_RETURN_IF_ERROR(gpu::UseDevice(buffer_->device()));
    return codec::EncodeBlocksCuda(geometry, plan, cuda_jobs, /*stream=*/nullptr);
  }

 private:
  absl::Status InPool(uint64_t offset, uint64_t bytes, const char* what) const {
    if (offset > buffer_->size() || bytes > buffer_->size() - offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " of a ", bytes, "-byte block at offset ", offset, " does not lie in the ",
          buffer_->size(), "-byte pool of CUDA device ", buffer_->device()));
    }
    return absl::OkStatus();
  }

  const std::unique_ptr<gpu::DeviceBuffer> buffer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMemory>> AllocateCudaMemory(int device, uint64_t bytes) {
  PROXIMA_ASSIGN_OR_RETURN(std::unique_ptr<gpu::DeviceBuffer> buffer,
                           gpu::DeviceBuffer::Allocate(device, bytes));
  return std::make_unique<CudaMemory>(std::move(buffer));
}

DevicePool::DevicePool(std::unique_ptr<DeviceMemory> memory)
    : ExtentMap(memory->size_bytes() / kAlignment * kAlignment), memory_(std::move(memory)) {}

}  // namespace proxima::daemon
