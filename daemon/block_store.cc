#include "daemon/block_store.h"

#include <cstring>
#include <limits>

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
  uint32_t crc32c = 0;  // set once by Commit(), before the block becomes visible
};

std::span<std::byte> BlockStore::PendingBlock::bytes() const { return block_->bytes(); }

BlockStore::BlockStore(std::unique_ptr<HostTier> tier, uint32_t num_shards,
                       std::span<NamespaceCounters> counters)
    : tier_(std::move(tier)), counters_(counters) {
  shards_.reserve(num_shards);
  for (uint32_t i = 0; i < num_shards; ++i) shards_.push_back(std::make_unique<Shard>());
}

BlockStore::~BlockStore() {
  // Blocks free their extents into tier_, so they must go first.
  for (auto& shard : shards_) {
    proxima::MutexLock lock(&shard->mu);
    shard->map.clear();
    shard->lru.clear();
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
  BlockRef block = std::move(it->second.block);
  shard.lru.erase(it->second.lru);
  shard.map.erase(it);
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

std::optional<BlockId> BlockStore::UnpinnedTail(const Shard& shard, uint64_t* stamp) const {
  int scanned = 0;
  for (auto it = shard.lru.rbegin(); it != shard.lru.rend() && scanned < kEvictionScan;
       ++it, ++scanned) {
    const Shard::Entry& entry = shard.map.find(*it)->second;
    // The index holds one reference; readers take theirs under the shard lock held here.
    if (entry.block.use_count() == 1) {
      *stamp = entry.stamp;
      return *it;
    }
  }
  return std::nullopt;
}

bool BlockStore::EvictOne() {
  // Find the shard whose oldest unpinned block is oldest. Stamps can move between this scan and
  // the lock below; evicting a slightly-less-old block then is harmless.
  Shard* victim = nullptr;
  uint64_t oldest = std::numeric_limits<uint64_t>::max();
  for (auto& shard : shards_) {
    proxima::MutexLock lock(&shard->mu);
    uint64_t stamp = 0;
    if (UnpinnedTail(*shard, &stamp) && stamp < oldest) {
      oldest = stamp;
      victim = shard.get();
    }
  }
  if (victim == nullptr) return false;  // empty, or everything near the tails is being read
  BlockRef evicted;
  {
    proxima::MutexLock lock(&victim->mu);
    uint64_t stamp = 0;
    std::optional<BlockId> id = UnpinnedTail(*victim, &stamp);
    if (!id) return true;  // raced with a delete or a reader; the caller retries
    evicted = Unlink(*victim, *id, nullptr);
  }
  evictions_.fetch_add(1, std::memory_order_relaxed);
  return true;  // `evicted` frees its extent here
}

std::optional<Extent> BlockStore::AllocateEvicting(uint64_t bytes) {
  while (true) {
    if (std::optional<Extent> e = tier_->Allocate(bytes)) return e;
    // Nothing evictable; a reader may have released bytes meanwhile.
    if (!EvictOne()) return tier_->Allocate(bytes);
  }
}

std::optional<BlockStore::PendingBlock> BlockStore::Reserve(uint64_t bytes) {
  std::optional<Extent> extent = AllocateEvicting(bytes);
  if (!extent) return std::nullopt;
  return PendingBlock(std::make_shared<StoredBlock>(tier_.get(), *extent, bytes));
}

PutOutcome BlockStore::Commit(const BlockId& id, PendingBlock pending, uint32_t crc32c) {
  BlockRef block = std::move(pending.block_);
  block->crc32c = crc32c;
  Shard& shard = ShardFor(id);
  proxima::MutexLock lock(&shard.mu);
  auto [it, inserted] = shard.map.try_emplace(id);
  if (!inserted) {
    shard.lru.splice(shard.lru.begin(), shard.lru, it->second.lru);
    it->second.stamp = clock_.fetch_add(1, std::memory_order_relaxed);
    return PutOutcome::kAlreadyPresent;  // `block` is freed after the lock is released
  }
  const uint64_t size = block->size;
  shard.lru.push_front(id);
  it->second = Shard::Entry{std::move(block), shard.lru.begin(),
                            clock_.fetch_add(1, std::memory_order_relaxed)};
  blocks_.fetch_add(1, std::memory_order_relaxed);
  NamespaceCounters& c = counters_[id.namespace_index];
  c.blocks.fetch_add(1, std::memory_order_relaxed);
  c.bytes.fetch_add(size, std::memory_order_relaxed);
  return PutOutcome::kStored;
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
  {
    proxima::MutexLock lock(&shard.mu);
    auto it = shard.map.find(id);
    if (it == shard.map.end()) return std::nullopt;
    shard.lru.splice(shard.lru.begin(), shard.lru, it->second.lru);
    it->second.stamp = clock_.fetch_add(1, std::memory_order_relaxed);
    block = it->second.block;  // pin
  }
  if (check == CrcCheck::kByCaller) {
    std::span<const std::byte> bytes = block->bytes();
    uint32_t stored = block->crc32c;
    return ReadBlock{std::move(block), bytes, stored};
  }
  uint32_t crc = Crc32c(block->bytes());
  if (crc == block->crc32c) {
    std::span<const std::byte> bytes = block->bytes();
    return ReadBlock{std::move(block), bytes, crc};
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
  proxima::MutexLock lock(&shard.mu);
  auto it = shard.map.find(id);
  if (it == shard.map.end()) return false;
  shard.lru.splice(shard.lru.begin(), shard.lru, it->second.lru);
  it->second.stamp = clock_.fetch_add(1, std::memory_order_relaxed);
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
