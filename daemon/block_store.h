// BlockStore: the daemon's block index over its host tier. Maps (namespace, profile, key) to
// checksummed bytes in the HostTier, evicts the coldest blocks to make room, and pins
// blocks while they are read so that eviction or deletion never frees bytes under a reader.
//
// Index: `num_shards` hash-map shards, each with its own mutex and recency lists, so unrelated
// keys never contend. Global recency order comes from one logical clock: every access stamps the
// block, and eviction takes the tail of the shard whose tail is oldest.
//
// Temperature: segmented LRU. A block enters the probation segment; used again (a Get, or a Put
// of a key already stored) it moves to the protected segment, which holds at most
// `protected_share` of the tier's bytes: when it overflows, its least recent blocks go back to
// the front of probation. Eviction takes probation's least recent block, and the protected
// segment's only when probation has nothing to give. A prefix read once is then evicted before
// a prefix read twice, however recent the single read. With protected_share = 0 nothing is ever
// protected and the store is a plain LRU. docs/decisions.md has the trace replay that chose it.
//
// Visibility: a block enters the index only after its bytes are written and its CRC32C computed;
// readers never see a partial block. Every read re-checks the CRC32C; a block that fails is
// dropped, counted, and reported as a miss.
//
// Encodings: every block has a hierarchy level (0 = raw, as put; k = the k-th level of its
// namespace's compression hierarchy) and a deepest level it may reach (BlockAttributes). Blocks
// that can still go deeper are also kept in a per-namespace list in recency order, so the tierer
// (daemon/tierer.h) finds the coldest compressible block in O(shards x namespaces). Replace()
// swaps a block's stored bytes for an encoded version atomically under the shard lock: readers
// that pinned the old bytes keep them until they unpin, and new readers see only the complete
// new version. The store itself never encodes; it only holds bytes and their level.
//
// GPU tier: with device pools (device_pool.h), a block may also live in a GPU's memory, raw, as
// put (TryReserveOnDevice). Device blocks keep a recency list of their own per device, outside the
// host tier's segments, compressible lists and eviction: the tierer takes the coldest of them
// (ColdestOnDevice) and moves them down to the host tier (MoveToHost), where they join the
// host's recency order as its newest blocks. Read() of a device block copies it to host memory
// that the returned pin owns, and checks that copy's CRC32C. Every other call (Contains, Touch,
// Delete, Commit of a key already stored) sees one index whichever memory holds the bytes.
//
// Compaction: encoded blocks come in many sizes, so a tier with enough free bytes in all can lack
// one free region large enough for a raw block. Reserve() and ReserveCompacting() then move the
// blocks out of the window of the arena that holds the fewest bytes (HostTier::FindWindow) into
// free space elsewhere and hand the window out, rather than evicting blocks until a hole appears.
// A block is moved only while nobody reads, encodes or spills it; readers that pin it afterwards
// see the moved copy, and one that pinned it first keeps the old bytes (the window is then given
// up). No block is ever lost or changed by a move.
//
// Departures: with TrackDepartures() on (the cluster turns it on), every block that leaves the
// index other than by Delete() (an eviction, a spill to a peer, a CRC failure) is logged for
// TakeDepartures(), so that the homes that recorded this node as its holder can be told.
//
// Thread-safe. Lock order: a shard mutex may be held while HostTier's (internal) mutex,
// `located_mu_` or `departures_mu_` is taken; never the reverse, and never two shard mutexes at
// once. One compaction runs at a time (`compact_mu_`, taken before any shard mutex).
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
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "daemon/device_pool.h"
#include "daemon/host_tier.h"

namespace proxima::daemon {

inline constexpr size_t kKeyBytes = 32;
using BlockKey = std::array<uint8_t, kKeyBytes>;

// How logs, errors and metric labels name a profile id: "0x" and 16 hex digits.
std::string ProfileName(uint64_t profile_id);

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

// Hierarchy levels a block can be at: 0 (raw) .. kMaxLevels - 1.
inline constexpr int kMaxLevels = 8;

// What the tierer may do with a block, fixed when it is put.
struct BlockAttributes {
  uint8_t max_level = 0;        // deepest hierarchy level it may be encoded to; 0 = stays raw
  bool is_first_block = false;  // the first block of its sequence (attention sinks)
  bool second_chance = false;   // the worker's importance hint: passed over once when coldest
  bool from_peer = false;       // spilled here by a peer (cluster): never spilled on again, and
                                // committed as the coldest block (the first to be evicted)
  bool handed_off = false;      // with from_peer: handed off by a peer that shut down, committed
                                // as recently used (its workers go on reading it from here)
  // The put's own hints, from which the fields above were derived (Tierer::AttributesFor), kept
  // so that a daemon configured otherwise derives them again (a snapshot read at its start).
  int64_t position = -1;  // the block's index in its sequence; -1 unknown
  bool high_priority = false;
};

struct StoredBlock;

class BlockStore {
 public:
  // `counters[i]` tracks namespace i; it must outlive the store. `protected_share`: the share of
  // the tier's capacity that the protected segment may hold (segmented LRU, below); 0 makes the
  // store a plain LRU. `devices`: the GPU tier's pools (none: the host tier alone).
  BlockStore(std::unique_ptr<HostTier> tier, uint32_t num_shards,
             std::span<NamespaceCounters> counters, double protected_share = 0,
             std::vector<std::unique_ptr<DevicePool>> devices = {});
  ~BlockStore();

  BlockStore(const BlockStore&) = delete;
  BlockStore& operator=(const BlockStore&) = delete;

  // Tier memory for one block being written: not visible to readers until Commit(). Freed when
  // dropped uncommitted.
  class PendingBlock {
   public:
    PendingBlock(PendingBlock&&) = default;
    PendingBlock& operator=(PendingBlock&&) = default;
    // The tier memory to write the block into. REQUIRES: !on_device().
    std::span<std::byte> bytes() const;
    // True for device memory (TryReserveOnDevice), which host code writes only through Write().
    bool on_device() const;
    // Writes `data` (exactly the reserved size) into the block's memory, host or device.
    // InvalidArgument for another size; a device copy's error as the device reports it.
    absl::Status Write(std::span<const std::byte> data) const;

   private:
    friend class BlockStore;
    explicit PendingBlock(std::shared_ptr<StoredBlock> block) : block_(std::move(block)) {}
    std::shared_ptr<StoredBlock> block_;
  };

  // Reserves `bytes` bytes in the tier, evicting least recently used blocks as needed; nullopt
  // when nothing more can be evicted (the rest is pinned by readers).
  std::optional<PendingBlock> Reserve(uint64_t bytes);

  // Makes a written block visible under `id`. `crc32c` is the CRC32C of its bytes, `level` their
  // hierarchy level (0: the raw block; a block spilled by a peer may arrive encoded). When `id`
  // is already stored, the stored block is kept (keys name content), marked recently used, and
  // `block` is freed.
  PutOutcome Commit(const BlockId& id, PendingBlock block, uint32_t crc32c,
                    BlockAttributes attributes = {}, uint8_t level = 0);

  // Like Reserve(), but never evicts: nullopt when no free extent is large enough now.
  // (Reserve() compacts before it evicts; see ReserveCompacting.)
  // `placement`: kHigh for encoded blocks (see HostTier::Placement).
  std::optional<PendingBlock> TryReserve(uint64_t bytes,
                                         HostTier::Placement placement = HostTier::Placement::kLow);

  // Like TryReserve(), and when at least `bytes` are free in all but in no single region, moves
  // the blocks out of the window of the tier that holds the fewest bytes and returns the window.
  // nullopt when fewer bytes are free, or when a block in the window is being read, written,
  // encoded or spilled. Never evicts.
  std::optional<PendingBlock> ReserveCompacting(uint64_t bytes);

  // Device memory for one raw block (GPU tier): a free region of the pool with the most free
  // bytes that has one, or nullopt when no pool has (never moves or evicts anything).
  std::optional<PendingBlock> TryReserveOnDevice(uint64_t bytes);

  // Reserve + copy + Commit.
  PutOutcome Put(const BlockId& id, std::span<const std::byte> data, uint32_t crc32c);

  // A block being read: `bytes` stay valid and unchanged while `pin` is held, even if the block
  // is evicted or deleted meanwhile.
  struct ReadBlock {
    std::shared_ptr<const void> pin;
    std::span<const std::byte> bytes;
    uint32_t crc32c = 0;
    uint8_t level = 0;  // 0: `bytes` is the raw block; else a STAR-KV container at that level
  };

  // Who checks a block's bytes against its CRC32C on a read.
  enum class CrcCheck {
    kHere,       // Read() checks; a block that fails is dropped, counted and reported absent
    kByCaller,   // the caller checks `bytes` against `crc32c` (the stored one) end to end, and
                 // reads again with kHere when its check fails, so the block is dropped then
  };

  // The coldest block that may still be encoded deeper, pinned and marked busy (no other
  // Candidate is handed out for it until Replace() or Release()). Only namespaces with
  // `level_caps[ns] > 0` are considered; a block is compressible when its level is below both
  // its own max_level and level_caps[ns]. nullopt when there is none.
  struct Candidate {
    BlockId id;
    ReadBlock block;  // for a device block (ColdestOnDevice): the pin alone, `bytes` empty
    BlockAttributes attributes;
    int device = -1;             // >= 0: the block is raw in that device pool (devices order)
    uint64_t device_offset = 0;  // ... at this offset of its memory
    uint64_t device_bytes = 0;   // ... of this many bytes
    uint64_t stamp = 0;          // its recency (ColdestOnDevice; larger: used more recently)
    bool reused = false;         // in the protected segment (ColdestSpillable, HottestForHandoff)
  };
  std::optional<Candidate> ColdestCompressible(std::span<const uint8_t> level_caps);

  // Swaps the candidate's bytes for `encoded` (written, with CRC32C `crc32c`) at `level`,
  // keeping its recency. False (and `encoded` freed) when the block changed or went meanwhile.
  // Clears the busy mark either way.
  bool Replace(const Candidate& candidate, PendingBlock encoded, uint32_t crc32c, uint8_t level);
  // For a full tier, where the encoded copy cannot be allocated beside the old bytes: when no
  // reader pins the candidate, frees its old bytes and stores `encoded` in their place, all
  // under the shard lock (no reader sees the block in between). Takes the candidate's pin.
  enum class InPlace { kReplaced, kGone, kPinned, kEvicted };
  InPlace ReplaceInPlace(Candidate candidate, std::span<const std::byte> encoded, uint8_t level);
  // Clears the busy mark of a candidate that is not replaced.
  void Release(const Candidate& candidate);
  // Clears the busy mark and makes the candidate's current level its last: it is never handed
  // out by ColdestCompressible() again (the next level would not shrink it). It stays in the
  // LRU order like any block.
  void KeepAtLevel(const Candidate& candidate);
  // Evicts the candidate's block (when it still holds the same bytes and no reader pins it);
  // true when it did. When a reader pins it, clears the busy mark and returns false.
  // `count`: false for a block that left for another node (a spill), not counted in evictions().
  bool EvictCandidate(const Candidate& candidate, bool count = true);
  // Whether the index still holds the candidate's very block (not deleted, nor deleted and put
  // again as another block).
  bool Indexed(const Candidate& candidate);

  // The least recently used block in pool `device`'s memory, not being moved already, pinned
  // and marked busy as ColdestCompressible's are: hand it back with MoveToHost(),
  // EvictCandidate() or Release(). nullopt when the pool holds none.
  std::optional<Candidate> ColdestOnDevice(size_t device);
  // The recency stamp of the block ColdestOnDevice(device) would take now (smaller: used less
  // recently), without taking it; nullopt when the pool holds none it could take.
  std::optional<uint64_t> ColdestStampOnDevice(size_t device) const;
  // Moves a device candidate's block down to the host tier: its bytes become `host` (written,
  // with CRC32C `crc32c`, at hierarchy `level`), it joins the host tier's recency lists at the
  // front (the protected segment when it was used again on the device), and its device extent
  // is freed once no reader pins it. False (and `host` freed) when the block changed or went
  // meanwhile, or `host` is not host memory. Clears the busy mark when it moves the block.
  bool MoveToHost(const Candidate& candidate, PendingBlock host, uint32_t crc32c, uint8_t level);

  // The least recently used block that may be spilled to a peer (not itself spilled here by
  // one, not pinned by a reader, not busy), probation first, pinned and marked busy as
  // ColdestCompressible's are: hand it back with EvictCandidate() or Release(). nullopt when
  // there is none near the tails.
  std::optional<Candidate> ColdestSpillable();
  // For a node that is leaving (cluster.spill.handoff): the most recently used host block no
  // reader pins and none has taken, protected first, blocks peers spilled here included; taken
  // as ColdestSpillable's are. nullopt when there is none.
  std::optional<Candidate> HottestForHandoff();
  // For a snapshot of the whole host tier: its blocks in the order HottestForHandoff would hand
  // them out (protected first, each segment most recently used first across the shards), in
  // one pass (n log n). Repeated HottestForHandoff calls rescan the blocks already taken, which
  // stay busy at the hot end (quadratic), and look only 4096 deep per list.
  std::vector<BlockId> HostBlocksHottestFirst() const;
  // Takes `id` as HottestForHandoff would (busy, pinned: hand it back with Release()); nullopt
  // when it is no longer in the host tier, a reader pins it or another has taken it.
  std::optional<Candidate> TakeHostBlock(const BlockId& id);

  // Evicts the least recently used block of namespace `ns` (in any tier) that no reader pins,
  // or passes over an important one once, as EvictOne() does; false when the namespace has
  // none that may go. `*evicted` (when given) says whether a block left. For
  // namespaces[].max_bytes: another namespace's blocks never go.
  bool EvictOneOf(uint32_t ns, bool* evicted = nullptr);
  // Bytes the blocks of namespace `ns` take in the tiers (proxima_namespace_bytes).
  uint64_t namespace_bytes(uint32_t ns) const {
    return counters_[ns].bytes.load(std::memory_order_relaxed);
  }

  // Evicts the globally least recently used probation block that no reader pins (a protected
  // one when probation has none), or passes over an important block once. False when there is
  // none (the index is empty, or every block near the tails is being read).
  bool EvictOne();

  // The GPU tier's pools, in the order given at construction, and the blocks in each.
  size_t num_devices() const { return devices_.size(); }
  const DevicePool& device_pool(size_t device) const { return *devices_[device]; }
  uint64_t device_blocks(size_t device) const {
    return device_blocks_[device]->load(std::memory_order_relaxed);
  }

  // Blocks and stored bytes of the host tier at each hierarchy level (0 = raw).
  uint64_t level_blocks(int level) const {
    return level_blocks_[level].load(std::memory_order_relaxed);
  }
  uint64_t level_bytes(int level) const {
    return level_bytes_[level].load(std::memory_order_relaxed);
  }

  // Pins the block. nullopt when absent, or (kHere) when its CRC32C check fails: the block is
  // then dropped from the index and counted in crc_failures().
  std::optional<ReadBlock> Read(const BlockId& id, CrcCheck check = CrcCheck::kHere);

  bool Contains(const BlockId& id) const;
  // Marks the block recently used; false when absent.
  bool Touch(const BlockId& id);

  // Removes the block; returns whether it was present. A reader holding it finishes first.
  // Not a departure (the caller that deletes tells whom it must).
  bool Delete(const BlockId& id);

  // The index's shards, and the ids of the blocks one of them holds now (any tier), in no
  // order: for walking every stored block a shard at a time (the cluster's re-announcement).
  size_t num_shards() const { return shards_.size(); }
  std::vector<BlockId> ShardIds(size_t shard) const;

  // From now on, logs the blocks that leave the index other than by Delete(): evicted (also
  // from the tierer's last level), spilled to a peer, or dropped for a failed CRC32C check. At
  // most `max_logged` wait for TakeDepartures(); past that they are counted, not logged.
  void TrackDepartures(size_t max_logged);
  // The departures logged since the last call (oldest first), and how many were not logged
  // because the log was full (since the last call).
  struct Departures {
    std::vector<BlockId> ids;
    uint64_t not_logged = 0;
  };
  Departures TakeDepartures();

  // The host tier's whole arena: every host block's bytes lie in it (registered once with UCX).
  std::span<std::byte> arena() const { return tier_->arena(); }
  uint64_t capacity_bytes() const { return tier_->capacity_bytes(); }
  uint64_t used_bytes() const { return tier_->used_bytes(); }
  bool pinned_for_gpu() const { return tier_->pinned_for_gpu(); }
  // Blocks in the index, in every tier, and in the host tier alone.
  uint64_t blocks() const { return blocks_.load(std::memory_order_relaxed); }
  uint64_t host_blocks() const;
  uint64_t evictions() const { return evictions_.load(std::memory_order_relaxed); }
  // Bytes of blocks in the protected segment (segmented LRU) and its limit.
  uint64_t protected_bytes() const { return protected_bytes_.load(std::memory_order_relaxed); }
  uint64_t protected_max_bytes() const { return protected_max_bytes_; }
  uint64_t crc_failures() const { return crc_failures_.load(std::memory_order_relaxed); }
  // Compactions that made room, ones that gave up (a block in the window could not move), and
  // the bytes of the blocks moved.
  uint64_t compactions() const { return compactions_.load(std::memory_order_relaxed); }
  uint64_t compactions_given_up() const {
    return compactions_given_up_.load(std::memory_order_relaxed);
  }
  uint64_t compaction_moved_bytes() const {
    return compaction_moved_bytes_.load(std::memory_order_relaxed);
  }

  // For tests of corruption handling: flips one bit of a stored block's bytes in place (host or
  // device memory).
  // Returns false when the block is absent.
  bool CorruptForTesting(const BlockId& id, size_t byte_offset);

 private:
  using BlockRef = std::shared_ptr<StoredBlock>;
  static constexpr uint8_t kProbation = 0;
  static constexpr uint8_t kProtected = 1;
  struct Shard {
    Shard(size_t num_namespaces, size_t num_devices)
        : compressible(num_namespaces), on_device(num_devices), by_namespace(num_namespaces) {}
    mutable proxima::Mutex mu;
    // Recency order of each segment, front most recent: probation ([0]) and protected ([1]).
    // Each entry's `lru` iterator points into the list of its segment.
    std::array<std::list<BlockId>, 2> lru ABSL_GUARDED_BY(mu);
    // Per namespace: the blocks whose level is below their max_level, in the same order.
    std::vector<std::list<BlockId>> compressible ABSL_GUARDED_BY(mu);
    // Per device pool: its blocks in recency order, front most recent (not in `lru`).
    std::vector<std::list<BlockId>> on_device ABSL_GUARDED_BY(mu);
    // Per namespace: all its blocks, in any tier, in recency order, front most recent (for
    // namespaces[].max_bytes: the namespace's own least recently used block).
    std::vector<std::list<BlockId>> by_namespace ABSL_GUARDED_BY(mu);
    struct Entry {
      BlockRef block;
      std::list<BlockId>::iterator lru;  // into lru[segment], or on_device[device]
      std::list<BlockId>::iterator in_namespace;  // into by_namespace[its namespace]
      uint64_t stamp;  // logical time of the last access
      BlockAttributes attributes;
      bool in_compressible = false;  // `cold` is valid
      std::list<BlockId>::iterator cold;
      bool busy = false;  // handed out as a Candidate
      uint8_t segment = kProbation;
      int device = -1;              // >= 0: the block's bytes are in that device pool
      bool used_on_device = false;  // read or put again there (protected once on the host)
    };
    absl::flat_hash_map<BlockId, Entry> map ABSL_GUARDED_BY(mu);
  };

  Shard& ShardFor(const BlockId& id) const;
  // The coldest compressible block's shard and id (ColdestCompressible's scan, which may drop
  // entries capped by the quality guard from the lists); nullopt when there is none.
  std::optional<std::pair<Shard*, BlockId>> ScanColdestCompressible(
      std::span<const uint8_t> level_caps);
  // Removes `id` from its shard's index (if present, and if `expected` is null or matches);
  // returns the removed block so the caller drops it outside the lock.
  BlockRef Unlink(Shard& shard, const BlockId& id, const StoredBlock* expected)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // Which blocks a scan of a segment's list looks for.
  enum class Take : uint8_t {
    kEvict,    // from the cold end, among the last few: any block no reader pins
    kSpill,    // the same, not busy and not spilled here by a peer
    kHandoff,  // from the hot end: not pinned, not busy (from a peer or not)
  };
  // The first block of `shard`'s `segment` list that `take` looks for, and its stamp; nullopt
  // when there is none.
  std::optional<BlockId> Unpinned(const Shard& shard, uint8_t segment, Take take,
                                  uint64_t* stamp) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // The block of namespace `ns` nearest the cold end of `shard`'s by_namespace list (among the
  // last few) that no reader pins, and its stamp.
  std::optional<BlockId> UnpinnedOf(const Shard& shard, uint32_t ns, uint64_t* stamp) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // ColdestSpillable (kSpill) and HottestForHandoff (kHandoff).
  std::optional<Candidate> TakeCandidate(Take take);
  // Marks the host block `entry` (of `id`) busy and hands it out as a candidate, pinned. The
  // caller holds its shard's lock.
  static Candidate Taken(const BlockId& id, Shard::Entry& entry);
  // The least recently used block of pool `device` not being moved (the last few of each
  // shard's list looked at), with its shard and stamp, as the shards' locks saw it one at a
  // time: ColdestOnDevice claims it, ColdestStampOnDevice reads its stamp.
  struct DeviceTail {
    Shard* shard;
    BlockId id;
    uint64_t stamp;
  };
  std::optional<DeviceTail> OldestOnDevice(size_t device) const;
  // Evicts the oldest unpinned block of `segment` across shards; false when there is none.
  bool EvictOneFrom(uint8_t segment);
  // Evicts the oldest of the blocks `find` names, one per shard (called under that shard's lock;
  // its stamp in `*stamp`), or passes over an important one once; false when it names none.
  // `*evicted_one` (when given) says whether a block left.
  bool EvictColdest(absl::FunctionRef<std::optional<BlockId>(const Shard&, uint64_t*)> find,
                    bool* evicted_one);
  std::optional<Extent> AllocateEvicting(uint64_t bytes);
  // A free extent, or the window of a compaction (ReserveCompacting).
  std::optional<Extent> AllocateCompacting(uint64_t bytes);
  // Moves the indexed block whose extent begins at `offset` to free space outside the claimed
  // window; false when there is none, or the block is being read, encoded or spilled.
  bool Relocate(uint64_t offset);
  // Where each indexed block's bytes lie (for compaction).
  void Locate(const StoredBlock& block, const BlockId& id) ABSL_LOCKS_EXCLUDED(located_mu_);
  void Unlocate(const StoredBlock& block) ABSL_LOCKS_EXCLUDED(located_mu_);
  // Moves an entry to the front of its lists with a new stamp. `reused`: a use that promotes a
  // probation block to the protected segment (a read or a repeated put, not a pass-over).
  // Returns true when the protected segment is now over its share: the caller then calls
  // DemoteOverflow() after releasing the shard lock.
  [[nodiscard]] bool MarkUsed(Shard& shard, Shard::Entry& entry, bool reused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // Moves an entry to the front of its namespace's list (by_namespace).
  void MarkUsedInNamespace(Shard& shard, Shard::Entry& entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // Takes the entry off its namespace's compressible list for good (it is at its last level).
  static void LeaveCompressible(Shard& shard, Shard::Entry& entry, uint32_t namespace_index)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // Moves the protected segment's least recent blocks to the front of probation until the
  // segment is within its share. Takes shard locks one at a time.
  void DemoteOverflow();
  // Takes an entry out of its recency list (its segment's, or its device's) and the protected
  // byte count. `size`: the bytes the entry counted at (its block may already be gone).
  void UnlinkFromSegment(Shard& shard, Shard::Entry& entry, uint64_t size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // Read() of a block in device memory: its bytes copied to host memory the result owns.
  std::optional<ReadBlock> ReadFromDevice(const BlockId& id, BlockRef block, CrcCheck check);
  // Drops `id` (if it still holds `block`) after its bytes failed their CRC32C check on a read.
  void DropCorrupt(const BlockId& id, const StoredBlock& block, uint32_t read_crc);
  // Logs a departure (TrackDepartures). Called under the shard lock that unlinked the block, so
  // that a departure is logged before the same key can be committed again.
  void Depart(const BlockId& id) ABSL_LOCKS_EXCLUDED(departures_mu_);
  // A stored block's size changed from `old_size` (an encoding swap).
  void Resized(const Shard::Entry& entry, uint64_t old_size);
  void CountLevel(uint8_t level, int64_t blocks, int64_t bytes);

  std::unique_ptr<HostTier> tier_;
  std::vector<std::unique_ptr<DevicePool>> devices_;
  std::vector<std::unique_ptr<std::atomic<uint64_t>>> device_blocks_;
  std::span<NamespaceCounters> counters_;
  std::vector<std::unique_ptr<Shard>> shards_;
  const uint64_t protected_max_bytes_;
  std::atomic<uint64_t> protected_bytes_{0};
  // Recency stamps of use; 0 is left to blocks peers spilled here (older than any use here).
  std::atomic<uint64_t> clock_{1};
  std::atomic<uint64_t> blocks_{0};
  std::atomic<uint64_t> evictions_{0};
  std::atomic<uint64_t> crc_failures_{0};
  std::atomic<uint64_t> compactions_{0};
  std::atomic<uint64_t> compactions_given_up_{0};
  std::atomic<uint64_t> compaction_moved_bytes_{0};
  proxima::Mutex compact_mu_;
  proxima::Mutex located_mu_;
  absl::flat_hash_map<uint64_t, BlockId> located_ ABSL_GUARDED_BY(located_mu_);  // offset -> id
  std::array<std::atomic<uint64_t>, kMaxLevels> level_blocks_{};
  std::array<std::atomic<uint64_t>, kMaxLevels> level_bytes_{};
  std::atomic<bool> tracking_departures_{false};
  proxima::Mutex departures_mu_;
  size_t max_departures_ ABSL_GUARDED_BY(departures_mu_) = 0;
  Departures departures_ ABSL_GUARDED_BY(departures_mu_);
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_BLOCK_STORE_H_
