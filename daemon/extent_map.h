// ExtentMap: the bookkeeping of one region of memory of `capacity_bytes`, sub-allocated into
// extents (offsets and sizes only; it never touches the memory). The host tier (host_tier.h) and
// each GPU's device pool (device_pool.h) are an ExtentMap over their own memory.
//
// Extents are 64-byte aligned and found best-fit; freed neighbours coalesce. used_bytes() counts
// the extents handed out (sizes rounded up to 64 bytes) and can never exceed capacity_bytes().
//
// Compaction: when enough bytes are free in all but no single region is large enough (encoded
// blocks of many sizes leave holes), FindWindow() names the window whose extents hold the fewest
// bytes, BeginClaim() takes its free space and every extent freed into it afterwards, the owner
// (BlockStore) moves the extents in it elsewhere, and EndClaim() hands the window out as one
// extent, or gives the claimed parts back when something could not move.
//
// Thread-safe: all methods may be called concurrently.
#ifndef PROXIMA_DAEMON_EXTENT_MAP_H_
#define PROXIMA_DAEMON_EXTENT_MAP_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace proxima::daemon {

// A region of the memory: [offset, offset + size).
struct Extent {
  uint64_t offset = 0;
  uint64_t size = 0;  // rounded up to kAlignment
};

class ExtentMap {
 public:
  static constexpr uint64_t kAlignment = 64;

  // REQUIRES: capacity_bytes is a positive multiple of kAlignment.
  explicit ExtentMap(uint64_t capacity_bytes);
  ExtentMap(const ExtentMap&) = delete;
  ExtentMap& operator=(const ExtentMap&) = delete;

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

  uint64_t capacity_bytes() const { return capacity_; }
  uint64_t used_bytes() const;

  // Largest single extent Allocate() could return now (shows fragmentation).
  uint64_t largest_free_bytes() const;

  // A range of the memory that an allocation of `range.size` bytes could take once the extents
  // overlapping it (`occupied`, largest first: the order to move them in; `occupied_bytes` in
  // all) moved elsewhere.
  struct Window {
    Extent range;
    std::vector<Extent> occupied;
    uint64_t occupied_bytes = 0;
  };
  // The window of `bytes` (rounded up to kAlignment) whose overlapping extents hold the fewest
  // bytes, among windows that begin or end at a free region and whose extents can each be
  // placed, largest first and best fit, in the free regions outside it (`occupied` is in that
  // order, for the owner to move them in). nullopt when fewer than `bytes` are free, when one
  // free region already fits (Allocate instead), or when no window among the cheapest few can
  // be emptied.
  std::optional<Window> FindWindow(uint64_t bytes) const;
  // Takes the free space inside `range` now, and the part inside it of every extent freed later,
  // until EndClaim(): Allocate() never returns memory of the range meanwhile. Claimed bytes count
  // as used. One claim at a time. REQUIRES: `range` lies in the memory, kAlignment-aligned.
  void BeginClaim(const Extent& range);
  // Ends the claim. When the whole range was claimed it becomes one allocated extent and is
  // returned; otherwise the claimed parts go back to the free space and nullopt is returned.
  std::optional<Extent> EndClaim();

 private:
  // Adds [offset, offset + size) to the free lists, merged with its free neighbours. Does not
  // touch used_.
  void AddFree(uint64_t offset, uint64_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `occupied` (the extents overlapping `range`) can each go, in that order and best
  // fit, into the free space outside `range` (FindWindow's check).
  bool FitsOutside(const Extent& range, std::span<const Extent> occupied) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t capacity_;

  mutable proxima::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, uint64_t> free_by_offset_ ABSL_GUARDED_BY(mu_);           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_ ABSL_GUARDED_BY(mu_);  // (size, offset)
  std::map<uint64_t, uint64_t> used_by_offset_ ABSL_GUARDED_BY(mu_);  // allocated: offset -> size
  std::optional<Extent> claim_ ABSL_GUARDED_BY(mu_);   // the range being claimed, if any
  std::vector<Extent> claimed_ ABSL_GUARDED_BY(mu_);   // its parts claimed so far (disjoint)
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_EXTENT_MAP_H_
