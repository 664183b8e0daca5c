#include "daemon/block_store.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/log.h"

namespace proxima::daemon {

std::string ProfileName(uint64_t profile_id) { return absl::StrFormat("0x%016x", profile_id); }

// The bytes of one block in the tier. Freed when the last reference goes: the index holds one,
// and each reader holds one while it copies (the pin).
struct StoredBlock {
  StoredBlock(HostTier* tier, Extent extent, uint64_t size)
      : tier(tier), extent(extent), size(size) {}
  // In device pool number `device` (the store's order).
  StoredBlock(DevicePool* pool, int device, Extent extent, uint64_t size)
      : pool(pool), device(device), extent(extent), size(size) {}
  ~StoredBlock() {
    if (pool != nullptr) {
      pool->Free(extent);
    } else {
      tier->Free(extent);
    }
  }
  // REQUIRES: a host block (pool == nullptr).
  std::span<std::byte> bytes() const { return tier->Bytes(extent).first(size); }

  HostTier* const tier = nullptr;    // a host block's tier, or
  DevicePool* const pool = nullptr;  // a device block's pool
  const int device = -1;
  const Extent extent;
  const uint64_t size;  // bytes of block data (extent.size is rounded up)
  uint32_t crc32c = 0;  // set once by Commit()/Replace(), before the block becomes visible
  uint8_t level = 0;    // likewise: hierarchy level of the bytes (0 = raw)
};

std::span<std::byte> BlockStore::PendingBlock::bytes() const { return block_->bytes(); }

bool BlockStore::PendingBlock::on_device() const { return block_->pool != nullptr; }

absl::Status BlockStore::PendingBlock::Write(std::span<const std::byte> data) const {
  if (data.size() != block_->size) {
    return absl::InvalidArgumentError(
        absl::StrCat("a write of ", data.size(), " bytes into a block of ", block_->size));
  }
  if (block_->pool != nullptr) return block_->pool->memory().CopyIn(block_->extent.offset, data);
  std::memcpy(block_->bytes().data(), data.data(), data.size());
  return absl::OkStatus();
}

BlockStore::BlockStore(std::unique_ptr<HostTier> tier, uint32_t num_shards,
                       std::span<NamespaceCounters> counters, double protected_share,
                       std::vector<std::unique_ptr<DevicePool>> devices)
    : tier_(std::move(tier)),
      devices_(std::move(devices)),
      counters_(counters),
      protected_max_bytes_(static_cast<uint64_t>(
          std::llround(static_cast<double>(tier_->capacity_bytes()) * protected_share))) {
  shards_.reserve(num_shards);
  for (uint32_t i = 0; i < num_shards; ++i) {
    shards_.push_back(std::make_unique<Shard>(counters.size(), devices_.size()));
  }
  for (size_t d = 0; d < devices_.size(); ++d) {
    device_blocks_.push_back(std::make_unique<std::atomic<uint64_t>>(0));
  }
}

BlockStore::~BlockStore() {
  // Blocks free their extents into tier_ and devices_, so they must go first.
  for (auto& shard : shards_) {
    proxima::MutexLock lock(&shard->mu);
    shard->map.clear();
    for (auto& list : shard->lru) list.clear();
    for (auto& list : shard->compressible) list.clear();
    for (auto& list : shard->on_device) list.clear();
    for (auto& list : shard->by_namespace) list.clear();
  }
}

BlockStore::Shard& BlockStore::ShardFor(const BlockId& id) const {
  size_t h = absl::Hash<BlockId>{}(id);
  return *shards_[h & (shards_.size() - 1)];
}

BlockStore::BlockRef BlockStore::Unlink(Shard& shard, const BlockId& id,
                                        const StoredBlock* expected) {
  auto it = shard.map.find(id);
  if (it == shard.map.end()) return nullptr;
  if (expected != nullptr && it->second.block.get() != expected) return nullptr;
  UnlinkFromSegment(shard, it->second, it->second.block->size);
  BlockRef block = std::move(it->second.block);
  if (it->second.in_compressible) shard.compressible[id.namespace_index].erase(it->second.cold);
  shard.by_namespace[id.namespace_index].erase(it->second.in_namespace);
  shard.map.erase(it);
  if (block->pool != nullptr) {
    device_blocks_[block->device]->fetch_sub(1, std::memory_order_relaxed);
  } else {
    Unlocate(*block);
    CountLevel(block->level, -1, -static_cast<int64_t>(block->size));
  }
  blocks_.fetch_sub(1, std::memory_order_relaxed);
  NamespaceCounters& c = counters_[id.namespace_index];
  c.blocks.fetch_sub(1, std::memory_order_relaxed);
  c.bytes.fetch_sub(block->size, std::memory_order_relaxed);
  return block;
}

namespace {
// How far from an LRU list's tail eviction looks for a block no reader pins. Evicting a pinned
// block frees nothing until its reader is done, so it would only lose the block.
constexpr int kEvictionScan = 8;
// How far a hand-off scan looks from a list's hot end (past the blocks it could not place).
constexpr int kHandoffScan = 4096;
}  // namespace

void BlockStore::UnlinkFromSegment(Shard& shard, Shard::Entry& entry, uint64_t size) {
  if (entry.device >= 0) {
    shard.on_device[entry.device].erase(entry.lru);
    return;
  }
  shard.lru[entry.segment].erase(entry.lru);
  if (entry.segment == kProtected) protected_bytes_.fetch_sub(size, std::memory_order_relaxed);
}

void BlockStore::Resized(const Shard::Entry& entry, uint64_t old_size) {
  if (entry.segment != kProtected) return;
  protected_bytes_.fetch_add(entry.block->size - old_size, std::memory_order_relaxed);
}

std::optional<BlockId> BlockStore::Unpinned(const Shard& shard, uint8_t segment, Take take,
                                            uint64_t* stamp) const {
  const std::list<BlockId>& list = shard.lru[segment];
  auto usable = [&](const BlockId& id) {
    const Shard::Entry& entry = shard.map.find(id)->second;
    if (take != Take::kEvict && entry.busy) return false;
    if (take == Take::kSpill && entry.attributes.from_peer) return false;
    // The index holds one reference; readers take theirs under the shard lock held here.
    if (entry.block.use_count() != 1) return false;
    *stamp = entry.stamp;
    return true;
  };
  if (take == Take::kHandoff) {
    // Blocks a hand-off could not place stay busy at the hot end until it ends: look past them.
    int scanned = 0;
    for (auto it = list.begin(); it != list.end() && scanned < kHandoffScan; ++it, ++scanned) {
      if (usable(*it)) return *it;
    }
    return std::nullopt;
  }
  int scanned = 0;
  for (auto it = list.rbegin(); it != list.rend() && scanned < kEvictionScan; ++it, ++scanned) {
    if (usable(*it)) return *it;
  }
  return std::nullopt;
}

bool BlockStore::EvictOne() { return EvictOneFrom(kProbation) || EvictOneFrom(kProtected); }

bool BlockStore::EvictOneFrom(uint8_t segment) {
  return EvictColdest(
      [&](const Shard& shard, uint64_t* stamp) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return Unpinned(shard, segment, Take::kEvict, stamp);
      },
      nullptr);
}

std::optional<BlockId> BlockStore::UnpinnedOf(const Shard& shard, uint32_t ns,
                                              uint64_t* stamp) const {
  const std::list<BlockId>& list = shard.by_namespace[ns];
  int scanned = 0;
  for (auto it = list.rbegin(); it != list.rend() && scanned < kEvictionScan; ++it, ++scanned) {
    const Shard::Entry& entry = shard.map.find(*it)->second;
    if (entry.block.use_count() != 1) continue;  // a reader holds it
    *stamp = entry.stamp;
    return *it;
  }
  return std::nullopt;
}

bool BlockStore::EvictOneOf(uint32_t ns, bool* evicted) {
  return EvictColdest(
      [&](const Shard& shard, uint64_t* stamp) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return UnpinnedOf(shard, ns, stamp);
      },
      evicted);
}

bool BlockStore::EvictColdest(
    absl::FunctionRef<std::optional<BlockId>(const Shard&, uint64_t*)> find, bool* evicted_one) {
  if (evicted_one != nullptr) *evicted_one = false;
  // Find the shard whose candidate is oldest. Stamps can move between this scan and the lock
  // below; evicting a slightly-less-old block then is harmless.
  Shard* victim = nullptr;
  uint64_t oldest = std::numeric_limits<uint64_t>::max();
  for (auto& shard : shards_) {
    proxima::MutexLock lock(&shard->mu);
    uint64_t stamp = 0;
    if (find(*shard, &stamp) && stamp < oldest) {
      oldest = stamp;
      victim = shard.get();
    }
  }
  if (victim == nullptr) return false;  // none, or everything near the tails is being read
  BlockRef evicted;
  {
    proxima::MutexLock lock(&victim->mu);
    uint64_t stamp = 0;
    std::optional<BlockId> id = find(*victim, &stamp);
    if (!id) return true;  // raced with a delete or a reader; the caller retries
    Shard::Entry& e = victim->map.find(*id)->second;
    if (e.attributes.second_chance) {  // an important block: passed over once
      e.attributes.second_chance = false;
      (void)MarkUsed(*victim, e, /*reused=*/false);
      return true;
    }
    evicted = Unlink(*victim, *id, nullptr);
    if (evicted != nullptr) Depart(*id);
  }
  if (evicted != nullptr && evicted_one != nullptr) *evicted_one = true;
  // A host block is a host tier eviction; a device pool's is not (as for its moves down).
  if (evicted != nullptr && evicted->pool == nullptr) {
    evictions_.fetch_add(1, std::memory_order_relaxed);
  }
  return true;  // `evicted` frees its extent here
}

std::optional<Extent> BlockStore::AllocateEvicting(uint64_t bytes) {
  while (true) {
    if (std::optional<Extent> e = AllocateCompacting(bytes)) return e;
    // Nothing evictable; a reader may have released bytes meanwhile.
    if (!EvictOne()) return tier_->Allocate(bytes);
  }
}

void BlockStore::Locate(const StoredBlock& block, const BlockId& id) {
  proxima::MutexLock lock(&located_mu_);
  located_[block.extent.offset] = id;
}

void BlockStore::Unlocate(const StoredBlock& block) {
  proxima::MutexLock lock(&located_mu_);
  located_.erase(block.extent.offset);
}

std::optional<BlockStore::PendingBlock> BlockStore::ReserveCompacting(uint64_t bytes) {
  std::optional<Extent> extent = AllocateCompacting(bytes);
  if (!extent) return std::nullopt;
  return PendingBlock(std::make_shared<StoredBlock>(tier_.get(), *extent, bytes));
}

std::optional<Extent> BlockStore::AllocateCompacting(uint64_t bytes) {
  if (std::optional<Extent> e = tier_->Allocate(bytes)) return e;
  proxima::MutexLock lock(&compact_mu_);
  std::optional<HostTier::Window> window = tier_->FindWindow(bytes);
  if (!window) return std::nullopt;
  tier_->BeginClaim(window->range);
  // In FindWindow's order (largest first), each to the best fit: what it checked.
  for (const Extent& occupied : window->occupied) {
    if (!Relocate(occupied.offset)) break;
  }
  // Complete unless a block could not move, or a reader pinned one before it moved (its old
  // bytes are then still in use).
  std::optional<Extent> extent = tier_->EndClaim();
  (extent ? compactions_ : compactions_given_up_).fetch_add(1, std::memory_order_relaxed);
  return extent;
}

bool BlockStore::Relocate(uint64_t offset) {
  BlockId id;
  {
    proxima::MutexLock lock(&located_mu_);
    auto it = located_.find(offset);
    if (it == located_.end()) return false;  // being written, or read after it left the index
    id = it->second;
  }
  Shard& shard = ShardFor(id);
  BlockRef old;
  {
    proxima::MutexLock lock(&shard.mu);
    auto it = shard.map.find(id);
    // Deleted and put again meanwhile, maybe into a device pool at the same offset.
    if (it == shard.map.end() || it->second.device >= 0 ||
        it->second.block->extent.offset != offset) {
      return false;
    }
    Shard::Entry& e = it->second;
    // Pins are taken under this lock: one reference is the index's alone.
    if (e.busy || e.block.use_count() > 1) return false;  // being encoded, spilled or read
    e.busy = true;  // no encoding or spill starts on it while it is copied
    old = e.block;
  }
  // Outside the window (its free space is claimed), to the best fit: a moved block fills the
  // smallest hole that takes it, as FindWindow planned.
  std::optional<Extent> destination = tier_->Allocate(old->size, HostTier::Placement::kLow);
  BlockRef moved;
  if (destination) {
    moved = std::make_shared<StoredBlock>(tier_.get(), *destination, old->size);
    std::memcpy(moved->bytes().data(), old->bytes().data(), old->size);
    moved->crc32c = old->crc32c;
    moved->level = old->level;
  }
  bool out_of_window = false;
  {
    proxima::MutexLock lock(&shard.mu);
    auto it = shard.map.find(id);
    if (it != shard.map.end() && it->second.block == old) {
      Shard::Entry& e = it->second;
      e.busy = false;
      if (moved != nullptr) {
        Unlocate(*old);
        e.block = std::move(moved);
        Locate(*e.block, id);
        compaction_moved_bytes_.fetch_add(old->size, std::memory_order_relaxed);
        out_of_window = true;
      }
    } else {
      out_of_window = true;  // evicted or deleted meanwhile: its bytes go with `old` below
    }
  }
  // `old` frees its extent into the claimed window here, unless a reader pins it.
  return out_of_window;
}

void BlockStore::CountLevel(uint8_t level, int64_t blocks, int64_t bytes) {
  level_blocks_[level].fetch_add(static_cast<uint64_t>(blocks), std::memory_order_relaxed);
  level_bytes_[level].fetch_add(static_cast<uint64_t>(bytes), std::memory_order_relaxed);
}

bool BlockStore::MarkUsed(Shard& shard, Shard::Entry& entry, bool reused) {
  if (entry.device >= 0) {
    // The GPU tier has no segments; a block used there joins the protected one on the host.
    auto& list = shard.on_device[entry.device];
    list.splice(list.begin(), list, entry.lru);
    MarkUsedInNamespace(shard, entry);
    entry.used_on_device |= reused;
    entry.stamp = clock_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  bool over = false;
  if (reused && entry.segment == kProbation && protected_max_bytes_ > 0) {
    auto& from = shard.lru[kProbation];
    auto& to = shard.lru[kProtected];
    to.splice(to.begin(), from, entry.lru);
    entry.segment = kProtected;
    over = protected_bytes_.fetch_add(entry.block->size, std::memory_order_relaxed) +
               entry.block->size >
           protected_max_bytes_;
  } else {
    auto& list = shard.lru[entry.segment];
    list.splice(list.begin(), list, entry.lru);
  }
  if (entry.in_compressible) {
    auto& list = shard.compressible[entry.cold->namespace_index];
    list.splice(list.begin(), list, entry.cold);
  }
  MarkUsedInNamespace(shard, entry);
  entry.stamp = clock_.fetch_add(1, std::memory_order_relaxed);
  return over;
}

void BlockStore::MarkUsedInNamespace(Shard& shard, Shard::Entry& entry) {
  auto& list = shard.by_namespace[entry.in_namespace->namespace_index];
  list.splice(list.begin(), list, entry.in_namespace);
}

void BlockStore::DemoteOverflow() {
  while (protected_bytes_.load(std::memory_order_relaxed) > protected_max_bytes_) {
    // The shard whose least recent protected block is oldest; stamps may move before the lock
    // below, and demoting a slightly-less-old block then is harmless.
    Shard* victim = nullptr;
    uint64_t oldest = std::numeric_limits<uint64_t>::max();
    for (auto& shard : shards_) {
      proxima::MutexLock lock(&shard->mu);
      const auto& list = shard->lru[kProtected];
      if (list.empty()) continue;
      const uint64_t stamp = shard->map.find(list.back())->second.stamp;
      if (stamp < oldest) {
        oldest = stamp;
        victim = shard.get();
      }
    }
    if (victim == nullptr) return;  // emptied meanwhile
    proxima::MutexLock lock(&victim->mu);
    auto& from = victim->lru[kProtected];
    if (from.empty()) continue;
    Shard::Entry& e = victim->map.find(from.back())->second;
    auto& to = victim->lru[kProbation];
    to.splice(to.begin(), from, e.lru);
    e.segment = kProbation;
    e.stamp = clock_.fetch_add(1, std::memory_order_relaxed);
    protected_bytes_.fetch_sub(e.block->size, std::memory_order_relaxed);
  }
}

std::optional<BlockStore::PendingBlock> BlockStore::TryReserve(uint64_t bytes,
                                                               HostTier::Placement placement) {
  std::optional<Extent> extent = tier_->Allocate(bytes, placement);
  if (!extent) return std::nullopt;
  return PendingBlock(std::make_shared<StoredBlock>(tier_.get(), *extent, bytes));
}

std::optional<std::pair<BlockStore::Shard*, BlockId>> BlockStore::ScanColdestCompressible(
    std::span<const uint8_t> level_caps) {
  // Scan the tails; the few busy entries at a tail (being encoded by another thread) are
  // stepped over. Blocks whose namespace cap has dropped to their level leave the list.
  constexpr int kMaxSkipped = 8;
  Shard* best_shard = nullptr;
  BlockId best_id;
  uint64_t oldest = std::numeric_limits<uint64_t>::max();
  for (auto& shard : shards_) {
    proxima::MutexLock lock(&shard->mu);
    for (size_t ns = 0; ns < shard->compressible.size() && ns < level_caps.size(); ++ns) {
      if (level_caps[ns] == 0) continue;
      auto& list = shard->compressible[ns];
      int skipped = 0;
      for (auto it = list.rbegin(); it != list.rend() && skipped < kMaxSkipped;) {
        Shard::Entry& e = shard->map.find(*it)->second;
        if (e.block->level >= level_caps[ns]) {  // capped by the quality guard
          e.in_compressible = false;
          it = std::make_reverse_iterator(list.erase(std::next(it).base()));
          continue;
        }
        if (e.busy) {
          ++skipped;
          ++it;
          continue;
        }
        if (e.attributes.second_chance) {  // an important block: once more to the front
          e.attributes.second_chance = false;
          (void)MarkUsed(*shard, e, /*reused=*/false);
          it = list.rbegin();
          continue;
        }
        if (e.stamp < oldest) {
          oldest = e.stamp;
          best_shard = shard.get();
          best_id = *it;
        }
        break;
      }
    }
  }
  if (best_shard == nullptr) return std::nullopt;
  return std::make_pair(best_shard, best_id);
}

std::optional<BlockStore::Candidate> BlockStore::ColdestCompressible(
    std::span<const uint8_t> level_caps) {
  // Another thread may claim the block found between the scan and the claim (two workers, or a
  // worker and a put, scan for the same coldest block); then scan again, so that a caller never
  // hears "none" while compressible blocks remain. Each lost race means another thread claimed
  // a block; the bound is only a guard.
  constexpr int kMaxRaces = 64;
  for (int race = 0; race < kMaxRaces; ++race) {
    std::optional<std::pair<Shard*, BlockId>> found = ScanColdestCompressible(level_caps);
    if (!found) return std::nullopt;
    auto [best_shard, best_id] = *found;
    proxima::MutexLock lock(&best_shard->mu);
    auto it = best_shard->map.find(best_id);
    if (it == best_shard->map.end() || it->second.busy || !it->second.in_compressible) {
      continue;  // raced: claimed, evicted or capped since the scan
    }
    Shard::Entry& e = it->second;
    e.busy = true;
    const StoredBlock& b = *e.block;
    return Candidate{best_id, ReadBlock{e.block, b.bytes(), b.crc32c, b.level}, e.attributes};
  }
  return std::nullopt;
}

bool BlockStore::Replace(const Candidate& candidate, PendingBlock encoded, uint32_t crc32c,
                         uint8_t level) {
  BlockRef block = std::move(encoded.block_);
  block->crc32c = crc32c;
  block->level = level;
  BlockRef old;
  Shard& shard = ShardFor(candidate.id);
  {
    proxima::MutexLock lock(&shard.mu);
    auto it = shard.map.find(candidate.id);
    if (it == shard.map.end() || it->second.block.get() != candidate.block.pin.get()) {
      return false;  // deleted, or evicted and put again; `block` is freed after the lock
    }
    Shard::Entry& e = it->second;
    e.busy = false;
    old = std::exchange(e.block, std::move(block));
    Unlocate(*old);
    Locate(*e.block, candidate.id);
    Resized(e, old->size);
    if (level >= e.attributes.max_level) LeaveCompressible(shard, e, candidate.id.namespace_index);
    NamespaceCounters& c = counters_[candidate.id.namespace_index];
    c.bytes.fetch_add(e.block->size - old->size, std::memory_order_relaxed);
    CountLevel(old->level, -1, -static_cast<int64_t>(old->size));
    CountLevel(level, 1, static_cast<int64_t>(e.block->size));
  }
  return true;  // `old` is freed here, unless a reader still pins it
}

BlockStore::InPlace BlockStore::ReplaceInPlace(Candidate candidate,
                                               std::span<const std::byte> encoded,
                                               uint8_t level) {
  Shard& shard = ShardFor(candidate.id);
  BlockRef evicted;  // dropped after the lock
  proxima::MutexLock lock(&shard.mu);
  auto it = shard.map.find(candidate.id);
  if (it == shard.map.end() || it->second.block.get() != candidate.block.pin.get()) {
    return InPlace::kGone;
  }
  Shard::Entry& e = it->second;
  // Pins are taken only under this lock, so the count cannot grow while it is held: two means
  // the index and this candidate.
  if (e.block.use_count() > 2) {
    e.busy = false;
    return InPlace::kPinned;
  }
  const uint64_t old_size = e.block->size;
  const uint8_t old_level = e.block->level;
  candidate.block = {};
  Unlocate(*e.block);
  e.block.reset();  // frees the old extent (shard lock -> tier lock, the allowed order)
  CountLevel(old_level, -1, -static_cast<int64_t>(old_size));
  NamespaceCounters& c = counters_[candidate.id.namespace_index];
  std::optional<Extent> extent = tier_->Allocate(encoded.size(), HostTier::Placement::kHigh);
  if (!extent) {
    // Another thread took the freed room: the block is gone, as if evicted.
    UnlinkFromSegment(shard, e, old_size);
    if (e.in_compressible) shard.compressible[candidate.id.namespace_index].erase(e.cold);
    shard.by_namespace[candidate.id.namespace_index].erase(e.in_namespace);
    shard.map.erase(it);
    blocks_.fetch_sub(1, std::memory_order_relaxed);
    c.blocks.fetch_sub(1, std::memory_order_relaxed);
    c.bytes.fetch_sub(old_size, std::memory_order_relaxed);
    evictions_.fetch_add(1, std::memory_order_relaxed);
    Depart(candidate.id);
    return InPlace::kEvicted;
  }
  auto block = std::make_shared<StoredBlock>(tier_.get(), *extent, encoded.size());
  std::memcpy(block->bytes().data(), encoded.data(), encoded.size());
  block->crc32c = Crc32c(block->bytes());
  block->level = level;
  e.block = std::move(block);
  Locate(*e.block, candidate.id);
  Resized(e, old_size);
  e.busy = false;
  if (level >= e.attributes.max_level) LeaveCompressible(shard, e, candidate.id.namespace_index);
  c.bytes.fetch_add(encoded.size() - old_size, std::memory_order_relaxed);
  CountLevel(level, 1, static_cast<int64_t>(encoded.size()));
  return InPlace::kReplaced;
}

void BlockStore::Release(const Candidate& candidate) {
  Shard& shard = ShardFor(candidate.id);
  proxima::MutexLock lock(&shard.mu);
  auto it = shard.map.find(candidate.id);
  if (it != shard.map.end() && it->second.block.get() == candidate.block.pin.get()) {
    it->second.busy = false;
  }
}

void BlockStore::KeepAtLevel(const Candidate& candidate) {
  Shard& shard = ShardFor(candidate.id);
  proxima::MutexLock lock(&shard.mu);
  auto it = shard.map.find(candidate.id);
  if (it == shard.map.end() || it->second.block.get() != candidate.block.pin.get()) return;
  Shard::Entry& e = it->second;
  e.busy = false;
  e.attributes.max_level = e.block->level;
  LeaveCompressible(shard, e, candidate.id.namespace_index);
}

void BlockStore::LeaveCompressible(Shard& shard, Shard::Entry& entry, uint32_t namespace_index) {
  if (!entry.in_compressible) return;
  shard.compressible[namespace_index].erase(entry.cold);
  entry.in_compressible = false;
}

bool BlockStore::EvictCandidate(const Candidate& candidate, bool count) {
  Shard& shard = ShardFor(candidate.id);
  BlockRef evicted;
  {
    proxima::MutexLock lock(&shard.mu);
    auto it = shard.map.find(candidate.id);
    if (it == shard.map.end() || it->second.block.get() != candidate.block.pin.get()) {
      return false;  // deleted, or evicted and put again
    }
    // As in EvictOne: a block a reader pins is not evicted (it would free nothing until the
    // reader is done, and only lose the block). Pins are taken under this lock; two means the
    // index and this candidate.
    if (it->second.block.use_count() > 2) {
      it->second.busy = false;
      return false;
    }
    evicted = Unlink(shard, candidate.id, static_cast<const StoredBlock*>(candidate.block.pin.get()));
    if (evicted != nullptr) Depart(candidate.id);
  }
  if (evicted == nullptr) return false;
  if (count) evictions_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool BlockStore::Indexed(const Candidate& candidate) {
  Shard& shard = ShardFor(candidate.id);
  proxima::MutexLock lock(&shard.mu);
  auto it = shard.map.find(candidate.id);
  return it != shard.map.end() && it->second.block.get() == candidate.block.pin.get();
}

std::optional<BlockStore::Candidate> BlockStore::ColdestSpillable() {
  return TakeCandidate(Take::kSpill);
}

std::optional<BlockStore::Candidate> BlockStore::HottestForHandoff() {
  return TakeCandidate(Take::kHandoff);
}

std::optional<BlockStore::Candidate> BlockStore::TakeCandidate(Take take) {
  const bool hottest = take == Take::kHandoff;
  const std::array<uint8_t, 2> segments = hottest ? std::array<uint8_t, 2>{kProtected, kProbation}
                                                  : std::array<uint8_t, 2>{kProbation, kProtected};
  for (uint8_t segment : segments) {
    // As EvictOneFrom: the shard whose eligible block at that end is the oldest (the newest for
    // a hand-off), then that block again under its lock (it may have moved meanwhile: the
    // caller asks again).
    Shard* best = nullptr;
    uint64_t best_stamp = 0;
    for (auto& shard : shards_) {
      proxima::MutexLock lock(&shard->mu);
      uint64_t stamp = 0;
      if (!Unpinned(*shard, segment, take, &stamp)) continue;
      if (best == nullptr || (hottest ? stamp > best_stamp : stamp < best_stamp)) {
        best_stamp = stamp;
        best = shard.get();
      }
    }
    if (best == nullptr) continue;
    proxima::MutexLock lock(&best->mu);
    uint64_t stamp = 0;
    std::optional<BlockId> id = Unpinned(*best, segment, take, &stamp);
    if (!id) return std::nullopt;
    return Taken(*id, best->map.find(*id)->second);
  }
  return std::nullopt;
}

std::vector<BlockId> BlockStore::HostBlocksHottestFirst() const {
  struct Ranked {
    uint8_t segment_rank;  // 0: protected, 1: probation
    uint64_t stamp;
    BlockId id;
  };
  std::vector<Ranked> all;
  for (const auto& shard : shards_) {
    proxima::MutexLock lock(&shard->mu);
    for (uint8_t segment : {kProtected, kProbation}) {
      const uint8_t rank = segment == kProtected ? 0 : 1;
      for (const BlockId& id : shard->lru[segment]) {
        all.push_back({rank, shard->map.find(id)->second.stamp, id});
      }
    }
  }
  std::sort(all.begin(), all.end(), [](const Ranked& a, const Ranked& b) {
    return a.segment_rank != b.segment_rank ? a.segment_rank < b.segment_rank : a.stamp > b.stamp;
  });
  std::vector<BlockId> out;
  out.reserve(all.size());
  for (const Ranked& r : all) out.push_back(r.id);
  return out;
}

std::optional<BlockStore::Candidate> BlockStore::TakeHostBlock(const BlockId& id) {
  Shard& shard = ShardFor(id);
  proxima::MutexLock lock(&shard.mu);
  auto it = shard.map.find(id);
  if (it == shard.map.end()) return std::nullopt;
  Shard::Entry& e = it->second;
  // As Unpinned's kHandoff: not on a device, not taken, not pinned by a reader.
  if (e.device >= 0 || e.busy || e.block.use_count() != 1) return std::nullopt;
  return Taken(id, e);
}

BlockStore::Candidate BlockStore::Taken(const BlockId& id, Shard::Entry& entry) {
  entry.busy = true;
  const StoredBlock& b = *entry.block;
  Candidate c{id, ReadBlock{entry.block, b.bytes(), b.crc32c, b.level}, entry.attributes};
  c.reused = entry.segment == kProtected;
  return c;
}

uint64_t BlockStore::host_blocks() const {
  uint64_t on_devices = 0;
  for (const auto& n : device_blocks_) on_devices += n->load(std::memory_order_relaxed);
  const uint64_t all = blocks_.load(std::memory_order_relaxed);
  return all - std::min(all, on_devices);  // the counters move one at a time
}

std::optional<BlockStore::PendingBlock> BlockStore::TryReserveOnDevice(uint64_t bytes) {
  std::vector<uint64_t> free(devices_.size());
  std::vector<size_t> order(devices_.size());
  for (size_t d = 0; d < devices_.size(); ++d) {
    free[d] = devices_[d]->capacity_bytes() - devices_[d]->used_bytes();
  }
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return free[a] > free[b]; });
  for (size_t d : order) {
    if (std::optional<Extent> extent = devices_[d]->Allocate(bytes)) {
      return PendingBlock(
          std::make_shared<StoredBlock>(devices_[d].get(), static_cast<int>(d), *extent, bytes));
    }
  }
  return std::nullopt;
}

std::optional<BlockStore::DeviceTail> BlockStore::OldestOnDevice(size_t device) const {
  constexpr int kMaxSkipped = 8;
  std::optional<DeviceTail> oldest;
  for (const auto& shard : shards_) {
    proxima::MutexLock lock(&shard->mu);
    const std::list<BlockId>& list = shard->on_device[device];
    int skipped = 0;
    for (auto it = list.rbegin(); it != list.rend() && skipped < kMaxSkipped; ++it) {
      const Shard::Entry& e = shard->map.find(*it)->second;
      if (e.busy) {
        ++skipped;
        continue;
      }
      if (!oldest || e.stamp < oldest->stamp) oldest = DeviceTail{shard.get(), *it, e.stamp};
      break;
    }
  }
  return oldest;
}

std::optional<uint64_t> BlockStore::ColdestStampOnDevice(size_t device) const {
  std::optional<DeviceTail> tail = OldestOnDevice(device);
  if (!tail) return std::nullopt;
  return tail->stamp;
}

std::optional<BlockStore::Candidate> BlockStore::ColdestOnDevice(size_t device) {
  // As ColdestCompressible: scan the tails for the oldest block not being moved, claim it under
  // its shard's lock, and scan again when another thread claimed it first.
  constexpr int kMaxRaces = 64;
  for (int race = 0; race < kMaxRaces; ++race) {
    std::optional<DeviceTail> tail = OldestOnDevice(device);
    if (!tail) return std::nullopt;
    Shard* best = tail->shard;
    const BlockId& best_id = tail->id;
    proxima::MutexLock lock(&best->mu);
    auto it = best->map.find(best_id);
    if (it == best->map.end() || it->second.busy || it->second.device != static_cast<int>(device)) {
      continue;  // raced: claimed, moved or deleted since the scan
    }
    Shard::Entry& e = it->second;
    e.busy = true;
    const StoredBlock& b = *e.block;
    return Candidate{best_id,         ReadBlock{e.block, {}, b.crc32c, b.level},
                     e.attributes,    e.device,
                     b.extent.offset, b.size,
                     e.stamp};
  }
  return std::nullopt;
}

bool BlockStore::MoveToHost(const Candidate& candidate, PendingBlock host, uint32_t crc32c,
                            uint8_t level) {
  BlockRef block = std::move(host.block_);
  if (block->pool != nullptr) return false;  // not host memory
  block->crc32c = crc32c;
  block->level = std::min<uint8_t>(level, kMaxLevels - 1);
  BlockRef old;  // the device extent, freed after the lock unless a reader pins it
  bool demote = false;
  Shard& shard = ShardFor(candidate.id);
  {
    proxima::MutexLock lock(&shard.mu);
    auto it = shard.map.find(candidate.id);
    if (it == shard.map.end() || it->second.block.get() != candidate.block.pin.get() ||
        it->second.device < 0) {
      return false;  // deleted, or evicted and put again; `block` is freed after the lock
    }
    Shard::Entry& e = it->second;
    shard.on_device[e.device].erase(e.lru);
    device_blocks_[e.device]->fetch_sub(1, std::memory_order_relaxed);
    e.device = -1;
    e.busy = false;
    old = std::exchange(e.block, std::move(block));
    const uint64_t size = e.block->size;
    // The newest of the host tier's blocks: the device held the node's hottest.
    e.segment = e.used_on_device && protected_max_bytes_ > 0 ? kProtected : kProbation;
    e.used_on_device = false;
    std::list<BlockId>& list = shard.lru[e.segment];
    list.push_front(candidate.id);
    e.lru = list.begin();
    e.stamp = clock_.fetch_add(1, std::memory_order_relaxed);
    if (e.segment == kProtected) {
      demote =
          protected_bytes_.fetch_add(size, std::memory_order_relaxed) + size > protected_max_bytes_;
    }
    Locate(*e.block, candidate.id);
    if (e.attributes.max_level > e.block->level) {
      auto& cold = shard.compressible[candidate.id.namespace_index];
      cold.push_front(candidate.id);
      e.cold = cold.begin();
      e.in_compressible = true;
    }
    CountLevel(e.block->level, 1, static_cast<int64_t>(size));
    counters_[candidate.id.namespace_index].bytes.fetch_add(size - old->size,
                                                            std::memory_order_relaxed);
  }
  if (demote) DemoteOverflow();
  return true;
}

std::optional<BlockStore::PendingBlock> BlockStore::Reserve(uint64_t bytes) {
  std::optional<Extent> extent = AllocateEvicting(bytes);
  if (!extent) return std::nullopt;
  return PendingBlock(std::make_shared<StoredBlock>(tier_.get(), *extent, bytes));
}

PutOutcome BlockStore::Commit(const BlockId& id, PendingBlock pending, uint32_t crc32c,
                              BlockAttributes attributes, uint8_t level) {
  BlockRef block = std::move(pending.block_);
  block->crc32c = crc32c;
  block->level = std::min<uint8_t>(level, kMaxLevels - 1);
  attributes.max_level = std::min<uint8_t>(attributes.max_level, kMaxLevels - 1);
  Shard& shard = ShardFor(id);
  bool demote = false;
  {
    proxima::MutexLock lock(&shard.mu);
    auto [it, inserted] = shard.map.try_emplace(id);
    if (inserted && block->pool != nullptr) {
      Shard::Entry& e = it->second;
      e.device = block->device;
      e.block = std::move(block);
      std::list<BlockId>& list = shard.on_device[e.device];
      list.push_front(id);
      e.lru = list.begin();
      std::list<BlockId>& mine = shard.by_namespace[id.namespace_index];
      mine.push_front(id);
      e.in_namespace = mine.begin();
      e.stamp = clock_.fetch_add(1, std::memory_order_relaxed);
      e.attributes = attributes;
      device_blocks_[e.device]->fetch_add(1, std::memory_order_relaxed);
      blocks_.fetch_add(1, std::memory_order_relaxed);
      NamespaceCounters& c = counters_[id.namespace_index];
      c.blocks.fetch_add(1, std::memory_order_relaxed);
      c.bytes.fetch_add(e.block->size, std::memory_order_relaxed);
      return PutOutcome::kStored;
    }
    if (inserted) {
      const uint64_t size = block->size;
      CountLevel(block->level, 1, static_cast<int64_t>(size));
      Shard::Entry& e = it->second;
      e.block = std::move(block);
      Locate(*e.block, id);
      std::list<BlockId>& probation = shard.lru[kProbation];
      std::list<BlockId>& mine = shard.by_namespace[id.namespace_index];
      if (attributes.from_peer && !attributes.handed_off) {
        // A peer's coldest block, kept in room this node has to spare: the first to go when
        // this node needs the room, unless it is read here first.
        probation.push_back(id);
        e.lru = std::prev(probation.end());
        mine.push_back(id);
        e.in_namespace = std::prev(mine.end());
        e.stamp = 0;
      } else {
        probation.push_front(id);
        e.lru = probation.begin();
        mine.push_front(id);
        e.in_namespace = mine.begin();
        e.stamp = clock_.fetch_add(1, std::memory_order_relaxed);
      }
      e.attributes = attributes;
      if (attributes.max_level > e.block->level) {
        auto& list = shard.compressible[id.namespace_index];
        list.push_front(id);
        e.cold = list.begin();
        e.in_compressible = true;
      }
      blocks_.fetch_add(1, std::memory_order_relaxed);
      NamespaceCounters& c = counters_[id.namespace_index];
      c.blocks.fetch_add(1, std::memory_order_relaxed);
      c.bytes.fetch_add(size, std::memory_order_relaxed);
      return PutOutcome::kStored;
    }
    demote = MarkUsed(shard, it->second, /*reused=*/true);
  }
  if (demote) DemoteOverflow();
  return PutOutcome::kAlreadyPresent;  // `block` is freed on return, outside the lock
}

PutOutcome BlockStore::Put(const BlockId& id, std::span<const std::byte> data, uint32_t crc32c) {
  if (Touch(id)) return PutOutcome::kAlreadyPresent;
  std::optional<PendingBlock> pending = Reserve(data.size());
  if (!pending) return PutOutcome::kNoSpace;
  std::memcpy(pending->bytes().data(), data.data(), data.size());
  return Commit(id, *std::move(pending), crc32c);
}

std::optional<BlockStore::ReadBlock> BlockStore::Read(const BlockId& id, CrcCheck check) {
  Shard& shard = ShardFor(id);
  BlockRef block;
  bool demote = false;
  {
    proxima::MutexLock lock(&shard.mu);
    auto it = shard.map.find(id);
    if (it == shard.map.end()) return std::nullopt;
    demote = MarkUsed(shard, it->second, /*reused=*/true);
    block = it->second.block;  // pin
  }
  if (demote) DemoteOverflow();
  if (block->pool != nullptr) return ReadFromDevice(id, std::move(block), check);
  if (check == CrcCheck::kByCaller) {
    std::span<const std::byte> bytes = block->bytes();
    const uint32_t stored = block->crc32c;
    const uint8_t level = block->level;
    return ReadBlock{std::move(block), bytes, stored, level};
  }
  uint32_t crc = Crc32c(block->bytes());
  if (crc == block->crc32c) {
    std::span<const std::byte> bytes = block->bytes();
    const uint8_t level = block->level;
    return ReadBlock{std::move(block), bytes, crc, level};
  }
  DropCorrupt(id, *block, crc);
  return std::nullopt;
}

std::optional<BlockStore::ReadBlock> BlockStore::ReadFromDevice(const BlockId& id, BlockRef block,
                                                                CrcCheck check) {
  // The copy is the caller's; `block` (the device extent) is pinned only while it is made.
  std::shared_ptr<std::byte[]> copy(new std::byte[block->size]);
  std::span<std::byte> bytes(copy.get(), block->size);
  if (absl::Status s = block->pool->memory().CopyOut(block->extent.offset, bytes); !s.ok()) {
    PROXIMA_LOG(kError) << "cannot copy a block out of GPU memory; served as a miss"
                        << log::Kv("device", block->pool->device())
                        << log::Kv("error", s.ToString());
    return std::nullopt;
  }
  if (check == CrcCheck::kHere) {
    if (const uint32_t crc = Crc32c(bytes); crc != block->crc32c) {
      DropCorrupt(id, *block, crc);
      return std::nullopt;
    }
  }
  return ReadBlock{std::move(copy), bytes, block->crc32c, block->level};
}

void BlockStore::DropCorrupt(const BlockId& id, const StoredBlock& block, uint32_t read_crc) {
  crc_failures_.fetch_add(1, std::memory_order_relaxed);
  PROXIMA_LOG(kError) << "stored block failed its CRC32C check; dropped"
                      << log::Kv("namespace_index", id.namespace_index)
                      << log::Kv("profile_id", id.profile_id)
                      << log::Kv("key", absl::BytesToHexString(absl::string_view(
                                            reinterpret_cast<const char*>(id.key.data()), 8)))
                      << log::Kv("tier", block.pool != nullptr ? "gpu" : "host")
                      << log::Kv("stored_crc", block.crc32c) << log::Kv("read_crc", read_crc);
  Shard& shard = ShardFor(id);
  BlockRef dropped;  // freed after the lock
  proxima::MutexLock lock(&shard.mu);
  dropped = Unlink(shard, id, &block);
  if (dropped != nullptr) Depart(id);
}

bool BlockStore::Touch(const BlockId& id) {
  Shard& shard = ShardFor(id);
  bool demote = false;
  {
    proxima::MutexLock lock(&shard.mu);
    auto it = shard.map.find(id);
    if (it == shard.map.end()) return false;
    demote = MarkUsed(shard, it->second, /*reused=*/true);
  }
  if (demote) DemoteOverflow();
  return true;
}

bool BlockStore::Contains(const BlockId& id) const {
  Shard& shard = ShardFor(id);
  proxima::MutexLock lock(&shard.mu);
  return shard.map.contains(id);
}

bool BlockStore::Delete(const BlockId& id) {
  Shard& shard = ShardFor(id);
  BlockRef removed;
  {
    proxima::MutexLock lock(&shard.mu);
    removed = Unlink(shard, id, nullptr);
  }
  return removed != nullptr;
}

std::vector<BlockId> BlockStore::ShardIds(size_t shard) const {
  const Shard& s = *shards_[shard];
  proxima::MutexLock lock(&s.mu);
  std::vector<BlockId> ids;
  ids.reserve(s.map.size());
  for (const auto& [id, entry] : s.map) ids.push_back(id);
  return ids;
}

void BlockStore::TrackDepartures(size_t max_logged) {
  proxima::MutexLock lock(&departures_mu_);
  max_departures_ = max_logged;
  tracking_departures_.store(true, std::memory_order_release);
}

BlockStore::Departures BlockStore::TakeDepartures() {
  proxima::MutexLock lock(&departures_mu_);
  Departures taken;
  std::swap(taken, departures_);
  return taken;
}

void BlockStore::Depart(const BlockId& id) {
  if (!tracking_departures_.load(std::memory_order_acquire)) return;
  proxima::MutexLock lock(&departures_mu_);
  if (departures_.ids.size() < max_departures_) {
    departures_.ids.push_back(id);
  } else {
    ++departures_.not_logged;
  }
}

bool BlockStore::CorruptForTesting(const BlockId& id, size_t byte_offset) {
  Shard& shard = ShardFor(id);
  proxima::MutexLock lock(&shard.mu);
  auto it = shard.map.find(id);
  if (it == shard.map.end() || byte_offset >= it->second.block->size) return false;
  const StoredBlock& b = *it->second.block;
  if (b.pool != nullptr) {
    std::byte one[1];
    if (!b.pool->memory().CopyOut(b.extent.offset + byte_offset, one).ok()) return false;
    one[0] ^= std::byte{0x01};
    return b.pool->memory().CopyIn(b.extent.offset + byte_offset, one).ok();
  }
  b.bytes()[byte_offset] ^= std::byte{0x01};
  return true;
}

}  // namespace proxima::daemon
