// HostTier: the host-memory tier, one arena of `capacity_bytes` reserved once at start and
// sub-allocated into extents that hold block bytes.
//
// The arena is one anonymous mapping so that later it can be registered once with UCX (and
// pinned with cudaHostRegister) instead of registering every block. Extents are 64-byte aligned
// and found best-fit; freed neighbours coalesce. used_bytes() counts the extents handed out
// (sizes rounded up to 64 bytes) and can never exceed capacity_bytes(): there is no other memory.
//
// Thread-safe: all methods may be called concurrently.
#ifndef PROXIMA_DAEMON_HOST_TIER_H_
#define PROXIMA_DAEMON_HOST_TIER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"

namespace proxima::daemon {

// A region of the arena: [offset, offset + size).
struct Extent {
  uint64_t offset = 0;
  uint64_t size = 0;  // rounded up to kAlignment
};

class HostTier {
 public:
  static constexpr uint64_t kAlignment = 64;

  // Reserves the arena. Pages are committed by the kernel on first touch.
  static absl::StatusOr<std::unique_ptr<HostTier>> Create(uint64_t capacity_bytes);
  ~HostTier();

  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // Where an extent goes. Raw blocks (all of one size per profile) take the best fit, from the
  // low end; encoded blocks (smaller, of varying sizes) take the highest free region that fits,
  // from its top. Keeping the two apart leaves room for raw blocks in one piece instead of
  // scattering small encoded extents through it.
  enum class Placement { kLow, kHigh };

  // Returns an extent of at least `bytes` bytes, or nullopt when no free region is large enough.
  // REQUIRES: bytes > 0.
  std::optional<Extent> Allocate(uint64_t bytes, Placement placement = Placement::kLow);

  // Returns `extent` to the free space. REQUIRES: `extent` came from Allocate() and is live.
  void Free(const Extent& extent);

  // The bytes of a live extent.
  std::span<std::byte> Bytes(const Extent& extent) const {
    return {base_ + extent.offset, static_cast<size_t>(extent.size)};
  }

  // The whole arena (for registering it once with UCX).
  std::span<std::byte> arena() const { return {base_, static_cast<size_t>(capacity_)}; }

  uint64_t capacity_bytes() const { return capacity_; }
  uint64_t used_bytes() const;

  // Pins the whole arena for GPU transfers (gpu::PinHostMemory; commits every page now). Call
  // once, before the tier is shared. Unpinned again when the tier is destroyed.
  absl::Status PinForGpu();
  bool pinned_for_gpu() const { return pinned_; }
  // Largest single extent Allocate() could return now (shows fragmentation).
  uint64_t largest_free_bytes() const;

 private:
  HostTier(std::byte* base, uint64_t capacity);

  std::byte* const base_;
  const uint64_t capacity_;
  bool pinned_ = false;

  mutable proxima::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, uint64_t> free_by_offset_ ABSL_GUARDED_BY(mu_);           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_ ABSL_GUARDED_BY(mu_);  // (size, offset)
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_HOST_TIER_H_
