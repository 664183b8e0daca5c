#include "daemon/block_store.h"

#include <cstring>
#include <algorithm>
#include <iterator>
#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "common/crc32c.h"
#include "common/log.h"

namespace proxima::daemon {

// The bytes of one block in the tier. Freed when the last reference goes: the index holds one,
// and each reader holds one while it copies (the pin).
struct StoredBlock {
  StoredBlock(HostTier* tier, Extent extent, uint64_t size)
      : tier(tier), extent(extent), size(size) {}
  ~StoredBlock() { tier->Free(extent); }
  std::span<std::byte> bytes() const { return tier->Bytes(extent).first(size); }

  HostTier* const tier;
  const Extent extent;
  const uint64_t size;  // bytes of block data (extent.size is rounded up)
  uint32_t crc32c = 0;  // set once by Commit()/Replace(), before the block becomes visible
  uint8_t level = 0;    // likewise: hierarchy level of the bytes (0 = raw)
};

std::span<std::byte> BlockStore::PendingBlock::bytes() const { return block_->bytes(); }

BlockStore::BlockStore(std::unique_ptr<HostTier> tier, uint32_t num_shards,
                       std::span<NamespaceCounters> counters, double protected_share)
    : tier_(std::move(tier)),
      counters_(counters),
      protected_max_bytes_(static_cast<uint64_t>(
          std::llround(static_cast<double>(tier_->capacity_bytes()) * protected_share))) {
  shards_.reserve(num_shards);
  for (uint32_t i = 0; i < num_shards; ++i) {
    shards_.push_back(std::make_unique<Shard>(counters.size()));
  }
}

BlockStore::~BlockStore() {
  // Blocks free their extents into tier_, so they must go first.
  for (auto& shard : shards_) {
    proxima::MutexLock lock(&shard->mu);
    shard->map.clear();
    for (auto& list : shard->lru) list.clear();
    for (auto& list : shard->compressible) list.clear();
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
  Unlocate(*block);
  if (it->second.in_compressible) shard.compressible[id.namespace_index].erase(it->second.cold);
  shard.map.erase(it);
  CountLevel(block->level, -1, -static_cast<int64_t>(block->size));
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
}  // namespace

void BlockStore::UnlinkFromSegment(Shard& shard, Shard::Entry& entry, uint64_t size) {
  shard.lru[entry.segment].erase(entry.lru);
  if (entry.segment == kProtected) protected_bytes_.fetch_sub(size, std::memory_order_relaxed);
}

void BlockStore::Resized(const Shard::Entry& entry, uint64_t old_size) {
  if (entry.segment != kProtected) return;
  protected_bytes_.fetch_add(entry.block->size - old_size, std::memory_order_relaxed);
}

std::optional<BlockId> BlockStore::UnpinnedTail(const Shard& shard, uint8_t segment,
                                                uint64_t* stamp, bool for_spill) const {
  int scanned = 0;
  const std::list<BlockId>& list = shard.lru[segment];
  for (auto it = list.rbegin(); it != list.rend() && scanned < kEvictionScan; ++it, ++scanned) {
    const Shard::Entry& entry = shard.map.find(*it)->second;
    if (for_spill && (entry.busy || entry.attributes.from_peer)) continue;
    // The index holds one reference; readers take theirs under the shard lock held here.
    if (entry.block.use_count() == 1) {
      *stamp = entry.stamp;
      return *it;
    }
  }
  return std::nullopt;
}

bool BlockStore::EvictOne() { return EvictOneFrom(kProbation) || EvictOneFrom(kProtected); }

bool BlockStore::EvictOneFrom(uint8_t segment) {
  // Find the shard whose oldest unpinned block is oldest. Stamps can move between this scan and
  // the lock below; evicting a slightly-less-old block then is harmless.
  Shard* victim = nullptr;
  uint64_t oldest = std::numeric_limits<uint64_t>::max();
  for (auto& shard : shards_) {
    proxima::MutexLock lock(&shard->mu);
    uint64_t stamp = 0;
    if (UnpinnedTail(*shard, segment, &stamp) && stamp < oldest) {
      oldest = stamp;
      victim = shard.get();
    }
  }
  if (victim == nullptr) return false;  // empty, or everything near the tails is being read
  BlockRef evicted;
  {
    proxima::MutexLock lock(&victim->mu);
    uint64_t stamp = 0;
    std::optional<BlockId> id = UnpinnedTail(*victim, segment, &stamp);
    if (!id) return true;  // raced with a delete or a reader; the caller retries
    Shard::Entry& e = victim->map.find(*id)->second;
    if (e.attributes.second_chance) {  // an important block: passed over once
      e.attributes.second_chance = false;
      (void)MarkUsed(*victim, e, /*reused=*/false);
      return true;
    }
    evicted = Unlink(*victim, *id, nullptr);
  }
  evictions_.fetch_add(1, std::memory_order_relaxed);
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
    if (it == shard.map.end() || it->second.block->extent.offset != offset) return false;
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
  entry.stamp = clock_.fetch_add(1, std::memory_order_relaxed);
  return over;
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
    shard.map.erase(it);
    blocks_.fetch_sub(1, std::memory_order_relaxed);
    c.blocks.fetch_sub(1, std::memory_order_relaxed);
    c.bytes.fetch_sub(old_size, std::memory_order_relaxed);
    evictions_.fetch_add(1, std::memory_order_relaxed);
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
  }
  if (evicted == nullptr) return false;
  if (count) evictions_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::optional<BlockStore::Candidate> BlockStore::ColdestSpillable() {
  for (uint8_t segment : {kProbation, kProtected}) {
    // As EvictOneFrom: the shard whose oldest eligible block is oldest, then that block again
    // under its lock (it may have moved meanwhile: the caller asks again).
    Shard* best = nullptr;
    uint64_t oldest = std::numeric_limits<uint64_t>::max();
    for (auto& shard : shards_) {
      proxima::MutexLock lock(&shard->mu);
      uint64_t stamp = 0;
      if (UnpinnedTail(*shard, segment, &stamp, /*for_spill=*/true) && stamp < oldest) {
        oldest = stamp;
        best = shard.get();
      }
    }
    if (best == nullptr) continue;
    proxima::MutexLock lock(&best->mu);
    uint64_t stamp = 0;
    std::optional<BlockId> id = UnpinnedTail(*best, segment, &stamp, /*for_spill=*/true);
    if (!id) return std::nullopt;
    Shard::Entry& e = best->map.find(*id)->second;
    e.busy = true;
    const StoredBlock& b = *e.block;
    return Candidate{*id, ReadBlock{e.block, b.bytes(), b.crc32c, b.level}, e.attributes};
  }
  return std::nullopt;
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
    if (inserted) {
      const uint64_t size = block->size;
      CountLevel(block->level, 1, static_cast<int64_t>(size));
      Shard::Entry& e = it->second;
      e.block = std::move(block);
      Locate(*e.block, id);
      std::list<BlockId>& probation = shard.lru[kProbation];
      if (attributes.from_peer) {
        // A peer's coldest block, kept in room this node has to spare: the first to go when
        // this node needs the room, unless it is read here first.
        probation.push_back(id);
        e.lru = std::prev(probation.end());
        e.stamp = 0;
      } else {
        probation.push_front(id);
        e.lru = probation.begin();
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
  crc_failures_.fetch_add(1, std::memory_order_relaxed);
  PROXIMA_LOG(kError) << "stored block failed its CRC32C check; dropped"
                      << log::Kv("namespace_index", id.namespace_index)
                      << log::Kv("profile_id", id.profile_id)
                      << log::Kv("key", absl::BytesToHexString(absl::string_view(
                                            reinterpret_cast<const char*>(id.key.data()), 8)))
                      << log::Kv("stored_crc", block->crc32c) << log::Kv("read_crc", crc);
  BlockRef dropped;
  {
    proxima::MutexLock lock(&shard.mu);
    dropped = Unlink(shard, id, block.get());
  }
  return std::nullopt;
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

bool BlockStore::CorruptForTesting(const BlockId& id, size_t byte_offset) {
  Shard& shard = ShardFor(id);
  proxima::MutexLock lock(&shard.mu);
  auto it = shard.map.find(id);
  if (it == shard.map.end() || byte_offset >= it->second.block->size) return false;
  it->second.block->bytes()[byte_offset] ^= std::byte{0x01};
  return true;
}

}  // namespace proxima::daemon
