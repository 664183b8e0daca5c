#include "daemon/extent_map.h"

#include <algorithm>
#include <iterator>
#include <limits>

namespace proxima::daemon {
namespace {

// The first region of an offset -> size map that reaches past `start`: the one containing it,
// else the first after it.
template <typename Map>
auto FirstReaching(Map& regions, uint64_t start) {
  auto it = regions.upper_bound(start);
  if (it != regions.begin() && std::prev(it)->first + std::prev(it)->second > start) --it;
  return it;
}

}  // namespace

ExtentMap::ExtentMap(uint64_t capacity_bytes) : capacity_(capacity_bytes) {
  free_by_offset_.emplace(0, capacity_bytes);
  free_by_size_.emplace(capacity_bytes, 0);
}

std::optional<Extent> ExtentMap::Allocate(uint64_t bytes, Placement placement) {
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
      used_by_offset_.emplace(offset + region_size - size, size);
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
  used_by_offset_.emplace(offset, size);
  return Extent{offset, size};
}

void ExtentMap::Free(const Extent& extent) {
  proxima::MutexLock lock(&mu_);
  used_by_offset_.erase(extent.offset);
  uint64_t begin = extent.offset;
  uint64_t end = extent.offset + extent.size;
  if (claim_) {
    // The part inside the claimed range stays used, as a claimed part.
    const uint64_t lo = std::max(begin, claim_->offset);
    const uint64_t hi = std::min(end, claim_->offset + claim_->size);
    if (lo < hi) {
      claimed_.push_back({lo, hi - lo});
      if (begin < lo) {
        used_ -= lo - begin;
        AddFree(begin, lo - begin);
      }
      if (hi < end) {
        used_ -= end - hi;
        AddFree(hi, end - hi);
      }
      return;
    }
  }
  used_ -= extent.size;
  AddFree(begin, extent.size);
}

void ExtentMap::AddFree(uint64_t offset, uint64_t size) {
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

std::optional<ExtentMap::Window> ExtentMap::FindWindow(uint64_t bytes) const {
  const uint64_t size = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  proxima::MutexLock lock(&mu_);
  if (size == 0 || size > capacity_ || claim_) return std::nullopt;
  const uint64_t free_total = capacity_ - used_;
  if (free_total < size) return std::nullopt;
  if (!free_by_size_.empty() && free_by_size_.rbegin()->first >= size) return std::nullopt;
  // Bytes of the extents overlapping [start, start + size) (whole extents: each moves whole),
  // and how much of the range they cover; stops early past `limit`.
  auto cost = [&](uint64_t start, uint64_t limit, uint64_t* covered) {
    uint64_t total = 0;
    *covered = 0;
    for (auto it = FirstReaching(used_by_offset_, start); it != used_by_offset_.end() && it->first < start + size && total <= limit; ++it) {
      total += it->second;
      *covered += std::min(it->first + it->second, start + size) - std::max(it->first, start);
    }
    return total;
  };
  // Windows that begin or end at a free region: the ones that can use it. Bounded scan; the
  // cheapest few are kept (the costliest of them bounds each cost's walk once they are full).
  constexpr int kMaxRegions = 4096;
  constexpr size_t kMaxCandidates = 16;
  std::vector<std::pair<uint64_t, uint64_t>> candidates;  // (cost, start), a max-heap
  int scanned = 0;
  for (auto r = free_by_offset_.begin(); r != free_by_offset_.end() && scanned < kMaxRegions;
       ++r, ++scanned) {
    const uint64_t region_end = r->first + r->second;
    for (uint64_t start : {r->first, region_end >= size ? region_end - size : uint64_t{0}}) {
      start = std::min(start, capacity_ - size);
      const bool full = candidates.size() == kMaxCandidates;
      const uint64_t limit = full ? candidates.front().first : std::numeric_limits<uint64_t>::max();
      uint64_t covered = 0;
      const uint64_t c = cost(start, limit, &covered);
      // What leaves the window must fit in the free space outside it.
      if (c >= limit || c > free_total - (size - covered)) continue;
      if (std::any_of(candidates.begin(), candidates.end(),
                      [&](const auto& cand) { return cand.second == start; })) {
        continue;
      }
      if (full) {
        std::pop_heap(candidates.begin(), candidates.end());
        candidates.pop_back();
      }
      candidates.emplace_back(c, start);
      std::push_heap(candidates.begin(), candidates.end());
    }
  }
  // The cheapest whose extents can each be placed outside it: enough free bytes in all is not
  // enough when they lie in holes smaller than the extents (a compaction would move some
  // blocks, copying their bytes, and then give up).
  std::sort_heap(candidates.begin(), candidates.end());
  for (const auto& [c, start] : candidates) {
    Window w;
    w.range = Extent{start, size};
    w.occupied_bytes = c;
    for (auto it = FirstReaching(used_by_offset_, start);
         it != used_by_offset_.end() && it->first < start + size; ++it) {
      w.occupied.push_back(Extent{it->first, it->second});
    }
    std::stable_sort(w.occupied.begin(), w.occupied.end(),
                     [](const Extent& a, const Extent& b) { return a.size > b.size; });
    if (FitsOutside(w.range, w.occupied)) return w;
  }
  return std::nullopt;
}

bool ExtentMap::FitsOutside(const Extent& range, std::span<const Extent> occupied) const {
  const uint64_t start = range.offset;
  const uint64_t end = range.offset + range.size;
  // Best fit, in the given order; `taken`: bytes placed in each region so far (by its offset).
  // A region the window overlaps offers its larger part outside it.
  std::vector<std::pair<uint64_t, uint64_t>> taken;
  constexpr int kMaxScan = 64;
  for (const Extent& extent : occupied) {
    const uint64_t need = extent.size;
    bool placed = false;
    int scanned = 0;
    for (auto it = free_by_size_.lower_bound({need, 0});
         it != free_by_size_.end() && scanned < kMaxScan; ++it, ++scanned) {
      // Not a structured binding: clang 14 (the fuzz build) cannot capture one in a lambda.
      const uint64_t region_size = it->first;
      const uint64_t offset = it->second;
      const uint64_t region_end = offset + region_size;
      uint64_t usable = region_size;
      if (offset < end && region_end > start) {
        usable =
            std::max(start > offset ? start - offset : 0, region_end > end ? region_end - end : 0);
      }
      auto t = std::find_if(taken.begin(), taken.end(),
                            [&](const auto& e) { return e.first == offset; });
      if (t != taken.end()) usable -= std::min(usable, t->second);
      if (usable < need) continue;
      if (t != taken.end()) {
        t->second += need;
      } else {
        taken.emplace_back(offset, need);
      }
      placed = true;
      break;
    }
    if (!placed) return false;
  }
  return true;
}

void ExtentMap::BeginClaim(const Extent& range) {
  proxima::MutexLock lock(&mu_);
  claim_ = range;
  claimed_.clear();
  const uint64_t begin = range.offset;
  const uint64_t end = range.offset + range.size;
  auto it = FirstReaching(free_by_offset_, begin);
  while (it != free_by_offset_.end() && it->first < end) {
    const auto [offset, region_size] = *it;
    free_by_size_.erase({region_size, offset});
    it = free_by_offset_.erase(it);
    const uint64_t lo = std::max(offset, begin);
    const uint64_t hi = std::min(offset + region_size, end);
    claimed_.push_back({lo, hi - lo});
    used_ += hi - lo;
    if (offset < lo) AddFree(offset, lo - offset);
    if (hi < offset + region_size) AddFree(hi, offset + region_size - hi);
    it = free_by_offset_.lower_bound(hi);
  }
}

std::optional<Extent> ExtentMap::EndClaim() {
  proxima::MutexLock lock(&mu_);
  if (!claim_) return std::nullopt;
  const Extent range = *claim_;
  claim_.reset();
  uint64_t claimed = 0;
  for (const Extent& part : claimed_) claimed += part.size;
  if (claimed == range.size) {
    claimed_.clear();
    used_by_offset_.emplace(range.offset, range.size);
    return range;
  }
  for (const Extent& part : claimed_) {
    used_ -= part.size;
    AddFree(part.offset, part.size);
  }
  claimed_.clear();
  return std::nullopt;
}

uint64_t ExtentMap::used_bytes() const {
  proxima::MutexLock lock(&mu_);
  return used_;
}

uint64_t ExtentMap::largest_free_bytes() const {
  proxima::MutexLock lock(&mu_);
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

}  // namespace proxima::daemon
