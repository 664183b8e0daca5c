#include "daemon/host_tier.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/device.h"

namespace proxima::daemon {

absl::StatusOr<std::unique_ptr<HostTier>> HostTier::Create(uint64_t capacity_bytes) {
  uint64_t capacity = capacity_bytes / kAlignment * kAlignment;
  if (capacity == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host tier capacity ", capacity_bytes, " is below ", kAlignment, " bytes"));
  }
  // MAP_NORESERVE: capacity is a limit, not a commitment; pages fill as blocks arrive.
  void* p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot reserve ", capacity,
                                                     " bytes for the host tier: ",
                                                     std::strerror(errno)));
  }
  return std::unique_ptr<HostTier>(new HostTier(static_cast<std::byte*>(p), capacity));
}

HostTier::HostTier(std::byte* base, uint64_t capacity) : ExtentMap(capacity), base_(base) {}

HostTier::~HostTier() {
  if (pinned_) gpu::UnpinHostMemory(base_);
  munmap(base_, capacity_bytes());
}

absl::Status HostTier::PinForGpu() {
  if (pinned_) return absl::OkStatus();
  PROXIMA_RETURN_IF_ERROR(gpu::PinHostMemory(base_, capacity_bytes()));
  pinned_ = true;
  return absl::OkStatus();
}

}  // namespace proxima::daemon
