// Tierer: the policy half of the tiers. BlockStore holds bytes; the Tierer decides what to do
// when memory runs short. It keeps the tier under each namespace's pressure threshold by taking
// the coldest blocks that may still go deeper in their namespace's compression hierarchy,
// encoding them at the next level (CPU codec, kernels/codec.h) and swapping the stored bytes in
// place (BlockStore::Replace: readers holding a pin keep the old bytes). A put that finds no room
// makes it synchronously the same way, and evicts the least recently used block once nothing
// can be compressed any more, so a put fails only when every block is pinned by a reader.
//
// GPU tier: puts land in a device pool when one has room (ReserveOnDevice). When a pool is over
// `tiers.gpu.pressure_threshold` (in the background) or full (a put), its coldest blocks move down
// to the host tier (MoveDown): encoded on the device, in batches, at the first level of their
// namespace's hierarchy (raw when the namespace does not compress), copied to host memory found
// by the host tier's own Reserve (which compresses or evicts host blocks as for a put), and
// committed there as the host's newest blocks.
//
// Quality guard: one encoding in `sample_one_in` of each model (registered profile) of a
// namespace is decoded again and its error measured against the bytes it was encoded from
// (kernels/error_metrics.h). The errors are aggregated per (namespace, model, level): models that
// share a namespace compress differently, and a pooled figure would let one model's large error
// hide behind another's small one (or step back a model that is within budget). When a level's
// attention-output error exceeds the namespace's budget, that model's deepest level drops below
// it: its new encodings stop one level earlier (logged and counted), its blocks already there
// stay until evicted, and the namespace's other models keep their levels.
//
// Thread-safe. The background workers (`tierer.threads`) run between Start() and Stop() (or
// destruction); Reserve() may be called from any thread. Lock order: `mu_` is never held while
// calling the store.
#ifndef PROXIMA_DAEMON_TIERER_H_
#define PROXIMA_DAEMON_TIERER_H_

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "daemon/block_store.h"
#include "daemon/config.h"
#include "daemon/metrics.h"
#include "kernels/codec.h"
#include "kernels/error_metrics.h"

namespace proxima::daemon {

class Tierer {
 public:
  // What encoding a profile's blocks needs of it: the codec geometry, and the model's RoPE base
  // (0: unknown), which the namespace's plans take through codec::CodecPlan::ForModel.
  struct ProfileCodec {
    codec::BlockGeometry geometry;
    double rope_theta = 0.0;
    std::string model;  // the profile's fingerprint (may be empty): the guard's logs and metrics
  };
  // The ProfileCodec of (namespace, profile id), or nullopt when its blocks cannot be encoded
  // (an unknown profile, or a dtype the codec does not take).
  using ProfileLookup =
      std::function<std::optional<ProfileCodec>(uint32_t ns, uint64_t profile_id)>;

  // `store`, `registry` outlive the Tierer. `config.namespaces[i]` is namespace index i.
  Tierer(BlockStore* store, const DaemonConfig& config, ProfileLookup profile,
         metrics::Registry* registry);
  ~Tierer();

  Tierer(const Tierer&) = delete;
  Tierer& operator=(const Tierer&) = delete;

  // Starts / stops the background workers (`tierer.threads` of them; each takes its own coldest
  // block, so they encode in parallel). One, the watcher, checks the pressure every
  // `interval_seconds`; the others sleep until it, or a put that finds the tier full, calls
  // them. Stop() waits for them.
  void Start();
  void Stop();

  // Attributes of a new block of namespace `ns`: how deep it may be encoded. `position` is the
  // block's index in its sequence (-1 unknown), `high_priority` holds it at a safer level.
  // `importance` > 0 (the worker's hint) gives the block one pass-over when it is coldest.
  BlockAttributes AttributesFor(uint32_t ns, uint32_t tokens_per_block, bool codec_ok,
                                int64_t position, bool high_priority,
                                float importance = 0) const;

  // Tier memory for a put of `bytes`: allocates; when enough bytes are free but scattered, moves
  // blocks to make them contiguous (BlockStore::ReserveCompacting); when the tier is full,
  // compresses the coldest blocks, then (when `make_room` is given) asks it to move blocks
  // elsewhere (the cluster's spill: true when some left, and the allocation is tried again), and
  // evicts the least recently used blocks last. nullopt when nothing can give way.
  std::optional<BlockStore::PendingBlock> Reserve(
      uint64_t bytes, const std::function<bool()>& make_room = nullptr);

  // GPU tier. Device memory for a put of a raw block of `bytes`: a free region of a pool, or
  // room made there by moving the pool's coldest blocks down to the host tier. nullopt when the
  // node has no GPU tier, the block is larger than every pool, or nothing could move (the caller
  // then puts it into the host tier).
  std::optional<BlockStore::PendingBlock> ReserveOnDevice(uint64_t bytes);
  // Moves pool `device`'s coldest blocks down to the host tier (see the class comment): at least
  // one, at most `max_blocks`, no more once `room` bytes have left (0: `max_blocks`), and after
  // the first none used more recently than `up_to_stamp`. A block that the host tier cannot take
  // (every host block pinned) is dropped. Returns how many blocks left the pool.
  size_t MoveDown(size_t device, uint64_t room, size_t max_blocks,
                  uint64_t up_to_stamp = std::numeric_limits<uint64_t>::max());
  // At shutdown, before the blocks are handed off to peers (which reads the host tier alone):
  // moves every pool's blocks down to the host tier as MoveDown does, the pools in turn, a batch
  // at a time, coldest first (the hottest become the host tier's most recently used, the first a
  // hand-off sends), until the pools are empty, nothing more can move, or `deadline`. Returns
  // how many blocks left the pools.
  size_t DrainDevices(absl::Time deadline);
  // Moves blocks down until every pool is under its pressure threshold (what the watcher does
  // each interval). For tests.
  void RelieveDevicePressure();
  // Blocks that moved from a device pool to the host tier, and those dropped because the host
  // tier could not take them or their device bytes were unreadable.
  uint64_t device_moves() const {
    return device_moves_raw_->value() + device_moves_encoded_->value();
  }
  uint64_t device_move_drops() const { return device_move_drops_->value(); }

  // One compression step over namespaces whose cap is above 0 in `caps` (see
  // BlockStore::ColdestCompressible). True when a block moved down (or, when it could not be
  // re-stored, was evicted). For tests and the background worker.
  //
  // `room`: the bytes the caller needs freed (0: unknown). The coldest block goes one level
  // down, or, when that frees less than `room`, straight to the shallowest deeper level that
  // frees it (the deepest it may reach at most): where successive steps would take the same
  // block down level after level (it stays the coldest), one encode from its current bytes does
  // it, and deeper levels are no longer encoded from an earlier level's lossy output. Levels
  // passed over need sizes known before encoding (codec::EncodedBytes), each smaller than the
  // last.
  bool CompressOne(std::span<const uint8_t> caps, uint64_t room = 0);
  // CompressOne over namespace `ns` alone (its own coldest compressible block): room for a put
  // that would take the namespace over namespaces[].max_bytes.
  bool CompressOneOf(uint32_t ns, uint64_t room);
  // Namespace `ns`'s max_bytes, changed while the daemon runs (TierService::SetNamespaceLimit):
  // its own pressure is measured against `max_bytes` (0: none) from the next pass.
  void SetNamespaceLimit(uint32_t ns, uint64_t max_bytes) {
    namespaces_[ns]->max_bytes.store(max_bytes, std::memory_order_relaxed);
  }
  // Runs background passes until the tier is under every namespace's threshold or nothing can
  // be compressed (what each worker does each wake-up). For tests.
  void RelievePressure();

  // Starts the quality guard of a newly registered profile of namespace `ns`, so that its metric
  // series show before its first encoding (otherwise it starts at that encoding). Nothing for a
  // namespace that does not compress.
  void AddModel(uint32_t ns, uint64_t profile_id, const ProfileCodec& profile);
  // The deepest level new encodings of every model of namespace `ns` may reach now: the lowest
  // of its models' caps (the quality guard lowers them; 0 = none).
  uint8_t level_cap(uint32_t ns) const { return caps_[ns]->load(std::memory_order_relaxed); }
  // The deepest level new encodings of profile `profile_id` of namespace `ns` may reach now.
  uint8_t level_cap(uint32_t ns, uint64_t profile_id) const;
  // Aggregated attention-output error of profile `profile_id`'s sampled encodings at `level` in
  // namespace `ns`, or nullopt when none was sampled.
  std::optional<double> sampled_attention_error(uint32_t ns, uint64_t profile_id, int level) const;
  // Times the quality guard lowered the cap of one of the namespace's models.
  uint64_t step_backs(uint32_t ns) const;
  uint64_t encodes() const { return encodes_.load(std::memory_order_relaxed); }
  uint64_t encode_failures() const { return encode_failures_.load(std::memory_order_relaxed); }
  // Encodings discarded because they were no smaller than the block's current bytes.
  uint64_t no_gain() const { return no_gain_->value(); }
  // Intermediate levels passed over by encoding blocks straight to a deeper one.
  uint64_t levels_passed_over() const { return levels_passed_over_->value(); }
  // Background workers running now (0 before Start(), after Stop(), and when no namespace
  // compresses). Call from the thread that calls Start() and Stop().
  size_t workers() const { return workers_.size(); }

 private:
  struct Quality {
    codec::ErrorSums sums;
    uint64_t samples = 0;
  };
  struct NamespaceState {
    std::string name;
    CompressionConfig policy;
    uint8_t depth = 0;  // levels of its hierarchy (kMaxLevels - 1 at most)
    std::atomic<uint64_t> max_bytes{0};  // namespaces[].max_bytes (0: none); SetNamespaceLimit
    std::atomic<uint64_t> step_backs{0};
    std::atomic<bool> warned_no_gain{false};
  };

  // Full caps: every namespace at its hierarchy's depth (the put path may compress any; the
  // quality guard's caps, per model, are applied to each candidate by CompressOne).
  std::vector<uint8_t> AllCaps() const;
  // Caps for namespaces over their pressure threshold at `pressure`, or (with max_bytes) whose
  // own bytes are over that share of their max_bytes, else 0. `room`, when given, is set to the
  // most bytes any of them is above its threshold.
  std::vector<uint8_t> CapsUnderPressure(double pressure, uint64_t* room = nullptr) const;
  // The plan that blocks of `profile` in namespace `ns` are encoded with at `level` (1 = the
  // first of the hierarchy): the level's plan with the model's RoPE base.
  codec::CodecPlan PlanFor(uint32_t ns, uint8_t level, const ProfileCodec& profile) const;
  // The level CompressOne encodes the candidate to: see CompressOne's `room`.
  uint8_t TargetLevel(const BlockStore::Candidate& c, const ProfileCodec& profile, uint8_t deepest,
                      uint64_t room) const;
  // The quality guard's state for one model of a namespace: its samples per level (under `mu_`),
  // the deepest level its new encodings may reach, and its count toward sampling.
  struct ModelGuard {
    uint32_t ns = 0;
    uint64_t profile_id = 0;
    std::string model;
    std::array<Quality, kMaxLevels> quality;
    std::atomic<uint8_t> cap{0};
    std::atomic<uint64_t> encodings{0};
  };
  // The guard of (ns, profile_id), made (with its metric series) the first time the profile's
  // blocks are encoded. Guards live as long as the Tierer (profiles are never unregistered, and
  // a namespace holds at most server.max_profiles_per_namespace).
  ModelGuard& GuardFor(uint32_t ns, uint64_t profile_id, const ProfileCodec& profile);
  void RecordQuality(ModelGuard& guard, uint8_t level, const codec::ErrorSums& sums);
  // The quality guard's sample: one encoding in the namespace's `sample_one_in` of the model is
  // decoded and measured against its source. `source` gives the raw bytes (called only when
  // sampled).
  void SampleQuality(ModelGuard& guard, uint8_t level, const codec::BlockGeometry& geometry,
                     const std::function<std::optional<std::span<const std::byte>>()>& source,
                     const std::string& encoded);
  // MoveDown's candidates, encoded on their device where their namespace compresses: `encoded`
  // receives each one's encoding (empty: it goes down raw) and `levels` its level.
  void EncodeForMove(size_t device, std::span<const BlockStore::Candidate> candidates,
                     std::vector<std::string>* encoded, std::vector<uint8_t>* levels);
  bool Stopping();
  // True when the tier is over some compressing namespace's pressure threshold.
  bool OverAnyThreshold() const;
  // Calls the helper workers to a background pass.
  void Wake();
  // Worker `index`: 0 is the watcher, which polls the pressure every interval; the others are
  // helpers that sleep until woken (Wake()).
  void Run(uint32_t index);

  BlockStore* const store_;
  const ProfileLookup profile_;
  const TiererConfig config_;
  const GpuTierConfig gpu_config_;
  metrics::Registry* const registry_;
  std::vector<std::unique_ptr<NamespaceState>> namespaces_;
  // Per namespace: the lowest cap of its models (level_cap(ns)); only ever lowered.
  std::vector<std::unique_ptr<std::atomic<uint8_t>>> caps_;

  mutable proxima::Mutex mu_;
  absl::flat_hash_map<std::pair<uint32_t, uint64_t>, std::unique_ptr<ModelGuard>> guards_
      ABSL_GUARDED_BY(mu_);

  // Metrics.
  std::atomic<uint64_t> encodes_{0};
  std::atomic<uint64_t> encode_failures_{0};
  std::array<metrics::Counter*, kMaxLevels> encoded_blocks_{};  // by target level
  metrics::Counter* encode_bytes_in_ = nullptr;
  metrics::Counter* encode_bytes_out_ = nullptr;
  metrics::Counter* encode_seconds_ = nullptr;
  metrics::Counter* evictions_for_put_ = nullptr;
  metrics::Counter* no_gain_ = nullptr;
  metrics::Counter* levels_passed_over_ = nullptr;
  metrics::Counter* device_moves_raw_ = nullptr;
  metrics::Counter* device_moves_encoded_ = nullptr;
  metrics::Counter* device_move_drops_ = nullptr;
  metrics::Counter* device_move_bytes_in_ = nullptr;
  metrics::Counter* device_move_bytes_out_ = nullptr;
  metrics::Counter* device_encode_microseconds_ = nullptr;

  // Background workers. std::mutex + condition_variable only for the stop signal and its timed
  // wait (proxima::Mutex has no condition variable).
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  uint64_t work_epoch_ = 0;           // guarded by stop_mu_: bumped by Wake()
  std::atomic<uint32_t> helpers_{0};  // workers beyond the watcher (Start() sets it; puts read it)
  std::vector<std::thread> workers_;
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_TIERER_H_
