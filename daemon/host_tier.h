// HostTier: the host-memory tier, one arena of `capacity_bytes` reserved once at start and
// sub-allocated into extents that hold block bytes (the ExtentMap it is: best fit, coalescing,
// compaction windows; extent_map.h).
//
// The arena is one anonymous mapping so that it is registered once with UCX (and pinned with
// cudaHostRegister) instead of registering every block. used_bytes() can never exceed
// capacity_bytes(): there is no other memory.
//
// Thread-safe: all methods may be called concurrently.
#ifndef PROXIMA_DAEMON_HOST_TIER_H_
#define PROXIMA_DAEMON_HOST_TIER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/extent_map.h"

namespace proxima::daemon {

class HostTier : public ExtentMap {
 public:
  // Reserves the arena. Pages are committed by the kernel on first touch.
  static absl::StatusOr<std::unique_ptr<HostTier>> Create(uint64_t capacity_bytes);
  ~HostTier();

  // The bytes of a live extent.
  std::span<std::byte> Bytes(const Extent& extent) const {
    return {base_ + extent.offset, static_cast<size_t>(extent.size)};
  }

  // The whole arena (for registering it once with UCX).
  std::span<std::byte> arena() const { return {base_, static_cast<size_t>(capacity_bytes())}; }

  // Pins the whole arena for GPU transfers (gpu::PinHostMemory; commits every page now). Call
  // once, before the tier is shared. Unpinned again when the tier is destroyed.
  absl::Status PinForGpu();
  bool pinned_for_gpu() const { return pinned_; }

 private:
  HostTier(std::byte* base, uint64_t capacity);

  std::byte* const base_;
  bool pinned_ = false;
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_HOST_TIER_H_
