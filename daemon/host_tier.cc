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

HostTier::HostTier(std::byte* base, uint64_t capacity) : base_(base), capacity_(capacity) {
  free_by_offset_.emplace(0, capacity);
  free_by_size_.emplace(capacity, 0);
}

HostTier::~HostTier() {
  if (pinned_) gpu::UnpinHostMemory(base_);
  munmap(base_, capacity_);
}

absl::Status HostTier::PinForGpu() {
  if (pinned_) return absl::OkStatus();
  PROXIMA_RETURN_IF_ERROR(gpu::PinHostMemory(base_, capacity_));
  pinned_ = true;
  return absl::OkStatus();
}

std::optional<Extent> HostTier::Allocate(uint64_t bytes, Placement placement) {
  uint64_t size = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  proxima::MutexLock lock(&mu_);
  if (placement == Placement::kHigh) {
    // The highest region that fits, scanned from the top (bounded; best fit beyond that).
    constexpr int kMaxScan = 256;
    int scanned = 0;
    for (auto r = free_by_offset_.rbegin(); r != free_by_offset_.rend() && scanned < kMaxScan;
         ++r, ++scanned) {
      if (r->second < size) continue;
      const uint64_t offset = r->first;
      const uint64_t region_size = r->second;
      free_by_size_.erase({region_size, offset});
      if (region_size > size) {
        r->second = region_size - size;  // the low part stays free
        free_by_size_.emplace(region_size - size, offset);
      } else {
        free_by_offset_.erase(offset);
      }
      used_ += size;
      return Extent{offset + region_size - size, size};
    }
  }
  auto it = free_by_size_.lower_bound({size, 0});  // best fit: smallest region that fits
  if (it == free_by_size_.end()) return std::nullopt;
  auto [region_size, offset] = *it;
  free_by_size_.erase(it);
  free_by_offset_.erase(offset);
  if (region_size > size) {
    free_by_offset_.emplace(offset + size, region_size - size);
    free_by_size_.emplace(region_size - size, offset + size);
  }
  used_ += size;
  return Extent{offset, size};
}

void HostTier::Free(const Extent& extent) {
  proxima::MutexLock lock(&mu_);
  uint64_t offset = extent.offset;
  uint64_t size = extent.size;
  used_ -= size;
  auto next = free_by_offset_.lower_bound(offset);
  if (next != free_by_offset_.end() && offset + size == next->first) {  // merge right
    free_by_size_.erase({next->second, next->first});
    size += next->second;
    next = free_by_offset_.erase(next);
  }
  if (next != free_by_offset_.begin()) {  // merge left
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      free_by_size_.erase({prev->second, prev->first});
      offset = prev->first;
      size += prev->second;
      free_by_offset_.erase(prev);
    }
  }
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

uint64_t HostTier::used_bytes() const {
  proxima::MutexLock lock(&mu_);
  return used_;
}

uint64_t HostTier::largest_free_bytes() const {
  proxima::MutexLock lock(&mu_);
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

}  // namespace proxima::daemon
