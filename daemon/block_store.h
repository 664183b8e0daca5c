// BlockStore: the daemon's block index over its host tier. Maps (namespace, profile, key) to
// checksummed bytes in the HostTier, evicts least-recently-used blocks to make room, and pins
// blocks while they are read so that eviction or deletion never frees bytes under a reader.
//
// Index: `num_shards` hash-map shards, each with its own mutex and LRU list, so unrelated keys
// never contend. Global LRU order comes from one logical clock: every access stamps the block,
// and eviction takes the tail of the shard whose tail is oldest.
//
// Visibility: a block enters the index only after its bytes are written and its CRC32C computed;
// readers never see a partial block. Every read re-checks the CRC32C; a block that fails is
// dropped, counted, and reported as a miss.
//
// Thread-safe. Lock order: a shard mutex may be held while HostTier's (internal) mutex is
// taken; never the reverse, and never two shard mutexes at once.
#ifndef PROXIMA_DAEMON_BLOCK_STORE_H_
#define PROXIMA_DAEMON_BLOCK_STORE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "daemon/host_tier.h"

namespace proxima::daemon {

inline constexpr size_t kKeyBytes = 32;
using BlockKey = std::array<uint8_t, kKeyBytes>;

struct BlockId {
  uint32_t namespace_index = 0;  // position in the daemon's namespace list
  uint64_t profile_id = 0;
  BlockKey key{};
  // Which scope of the namespace owns the block: 0 shared by the whole namespace, or one per
  // token scope of a namespace with private_prefixes (tier_service.h).
  uint32_t partition = 0;

  friend bool operator==(const BlockId&, const BlockId&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const BlockId& id) {
    return H::combine(std::move(h), id.namespace_index, id.partition, id.profile_id,
                      std::string_view(reinterpret_cast<const char*>(id.key.data()), kKeyBytes));
  }
};

// Per-namespace counters, owned by the caller; BlockStore keeps blocks/bytes current.
struct NamespaceCounters {
  std::atomic<uint64_t> blocks{0};
  std::atomic<uint64_t> bytes{0};
};

enum class PutOutcome { kStored, kAlreadyPresent, kNoSpace };

struct StoredBlock;

class BlockStore {
 public:
  // `counters[i]` tracks namespace i; it must outlive the store.
  BlockStore(std::unique_ptr<HostTier> tier, uint32_t num_shards,
             std::span<NamespaceCounters> counters);
  ~BlockStore();

  BlockStore(const BlockStore&) = delete;
  BlockStore& operator=(const BlockStore&) = delete;

  // Tier memory for one block being written: not visible to readers until Commit(). Freed when
  // dropped uncommitted.
  class PendingBlock {
   public:
    PendingBlock(PendingBlock&&) = default;
    PendingBlock& operator=(PendingBlock&&) = default;
    std::span<std::byte> bytes() const;

   private:
    friend class BlockStore;
    explicit PendingBlock(std::shared_ptr<StoredBlock> block) : block_(std::move(block)) {}
    std::shared_ptr<StoredBlock> block_;
  };

  // Reserves `bytes` bytes in the tier, evicting least recently used blocks as needed; nullopt
  // when nothing more can be evicted (the rest is pinned by readers).
  std::optional<PendingBlock> Reserve(uint64_t bytes);

  // Makes a written block visible under `id`. `crc32c` is the CRC32C of its bytes. When `id`
  // is already stored, the stored block is kept (keys name content), marked recently used, and
  // `block` is freed.
  PutOutcome Commit(const BlockId& id, PendingBlock block, uint32_t crc32c);

  // Reserve + copy + Commit.
  PutOutcome Put(const BlockId& id, std::span<const std::byte> data, uint32_t crc32c);

  // A block being read: `bytes` stay valid and unchanged while `pin` is held, even if the block
  // is evicted or deleted meanwhile.
  struct ReadBlock {
    std::shared_ptr<const void> pin;
    std::span<const std::byte> bytes;
    uint32_t crc32c = 0;
  };

  // Who checks a block's bytes against its CRC32C on a read.
  enum class CrcCheck {
    kHere,       // Read() checks; a block that fails is dropped, counted and reported absent
    kByCaller,   // the caller checks `bytes` against `crc32c` (the stored one) end to end, and
                 // reads again with kHere when its check fails, so the block is dropped then
  };

  // Pins the block. nullopt when absent, or (kHere) when its CRC32C check fails: the block is
  // then dropped from the index and counted in crc_failures().
  std::optional<ReadBlock> Read(const BlockId& id, CrcCheck check = CrcCheck::kHere);

  bool Contains(const BlockId& id) const;
  // Marks the block recently used; false when absent.
  bool Touch(const BlockId& id);

  // Removes the block; returns whether it was present. A reader holding it finishes first.
  bool Delete(const BlockId& id);

  // The tier's whole arena: every block's bytes lie in it (registered once with UCX).
  std::span<std::byte> arena() const { return tier_->arena(); }
  uint64_t capacity_bytes() const { return tier_->capacity_bytes(); }
  uint64_t used_bytes() const { return tier_->used_bytes(); }
  uint64_t blocks() const { return blocks_.load(std::memory_order_relaxed); }
  uint64_t evictions() const { return evictions_.load(std::memory_order_relaxed); }
  uint64_t crc_failures() const { return crc_failures_.load(std::memory_order_relaxed); }

  // For tests of corruption handling: flips one bit of a stored block's bytes in place.
  // Returns false when the block is absent.
  bool CorruptForTesting(const BlockId& id, size_t byte_offset);

 private:
  using BlockRef = std::shared_ptr<StoredBlock>;
  struct Shard {
    mutable proxima::Mutex mu;
    // LRU order: front is most recent. Each entry's `lru` iterator points into this list.
    std::list<BlockId> lru ABSL_GUARDED_BY(mu);
    struct Entry {
      BlockRef block;
      std::list<BlockId>::iterator lru;
      uint64_t stamp;  // logical time of the last access
    };
    absl::flat_hash_map<BlockId, Entry> map ABSL_GUARDED_BY(mu);
  };

  Shard& ShardFor(const BlockId& id) const;
  // Removes `id` from its shard's index (if present, and if `expected` is null or matches);
  // returns the removed block so the caller drops it outside the lock.
  BlockRef Unlink(Shard& shard, const BlockId& id, const StoredBlock* expected)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // The least recently used block among the last few of `shard`'s LRU list that no reader
  // pins, and its stamp; nullopt when there is none.
  std::optional<BlockId> UnpinnedTail(const Shard& shard, uint64_t* stamp) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // Evicts the globally least recently used block that no reader pins. False when there is
  // none (the index is empty, or every block near the LRU tails is being read).
  bool EvictOne();
  std::optional<Extent> AllocateEvicting(uint64_t bytes);

  std::unique_ptr<HostTier> tier_;
  std::span<NamespaceCounters> counters_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::atomic<uint64_t> clock_{0};
  std::atomic<uint64_t> blocks_{0};
  std::atomic<uint64_t> evictions_{0};
  std::atomic<uint64_t> crc_failures_{0};
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_BLOCK_STORE_H_
