#include "daemon/tierer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/bytes.h"
#include "common/crc32c.h"
#include "common/log.h"

namespace proxima::daemon {
namespace {

// Samples a level needs before the guard acts on its aggregate error: one unlucky block must
// not step a namespace back.
constexpr uint64_t kMinQualitySamples = 3;

}  // namespace

Tierer::Tierer(BlockStore* store, const DaemonConfig& config, ProfileLookup profile,
               metrics::Registry* registry)
    : store_(store),
      profile_(std::move(profile)),
      config_(config.tierer),
      gpu_config_(config.gpu_tier),
      registry_(registry) {
  for (size_t i = 0; i < config.namespaces.size(); ++i) {
    auto ns = std::make_unique<NamespaceState>();
    ns->name = config.namespaces[i].name;
    ns->policy = config.namespaces[i].compression;
    ns->depth = static_cast<uint8_t>(std::min<size_t>(ns->policy.plans.size(), kMaxLevels - 1));
    ns->max_bytes.store(config.namespaces[i].max_bytes);
    caps_.push_back(std::make_unique<std::atomic<uint8_t>>(ns->depth));
    NamespaceState* state = ns.get();
    metrics::Labels labels = {{"namespace", ns->name}};
    registry->AddCounterFunction("proxima_quality_step_backs_total",
                                 "Times the quality guard lowered the deepest level of one of "
                                 "the namespace's models",
                                 labels, [state] { return double(state->step_backs.load()); });
    std::atomic<uint8_t>* cap_ptr = caps_.back().get();
    registry->AddGauge("proxima_compression_level_cap",
                       "Deepest hierarchy level new encodings of every model of the namespace may "
                       "reach (the lowest of proxima_compression_model_level_cap)",
                       labels, [cap_ptr] { return double(cap_ptr->load()); });
    namespaces_.push_back(std::move(ns));
  }
  for (int level = 1; level < kMaxLevels; ++level) {
    encoded_blocks_[level] = registry->AddCounter(
        "proxima_tierer_encodes_total", "Blocks the tierer encoded, by target hierarchy level",
        {{"level", absl::StrCat(level)}});
  }
  encode_bytes_in_ =
      registry->AddCounter("proxima_tierer_encode_bytes_total",
                           "Bytes the tierer encoded, before and after", {{"side", "in"}});
  encode_bytes_out_ =
      registry->AddCounter("proxima_tierer_encode_bytes_total",
                           "Bytes the tierer encoded, before and after", {{"side", "out"}});
  encode_seconds_ = registry->AddCounter("proxima_tierer_encode_microseconds_total",
                                         "Time the tierer spent decoding and encoding blocks");
  evictions_for_put_ =
      registry->AddCounter("proxima_tierer_put_evictions_total",
                           "Blocks evicted on the put path because nothing could be compressed");
  no_gain_ = registry->AddCounter(
      "proxima_tierer_no_gain_total",
      "Encodings discarded because the next level was no smaller than the block's current bytes "
      "(the block keeps its level)");
  levels_passed_over_ = registry->AddCounter(
      "proxima_tierer_levels_passed_over_total",
      "Intermediate hierarchy levels not encoded because a block went straight to a deeper "
      "one (the room needed was more than the next level frees)");
  const char* moves_help =
      "Blocks the tierer moved from a GPU pool down to the host tier, by the "
      "encoding they went down in";
  device_moves_raw_ =
      registry->AddCounter("proxima_tierer_gpu_moves_total", moves_help, {{"encoding", "raw"}});
  device_moves_encoded_ =
      registry->AddCounter("proxima_tierer_gpu_moves_total", moves_help, {{"encoding", "encoded"}});
  device_move_drops_ = registry->AddCounter(
      "proxima_tierer_gpu_move_drops_total",
      "Blocks dropped on their way down from a GPU pool: the host tier could not take them, or "
      "their device bytes could not be read back intact");
  const char* bytes_help =
      "Bytes the tierer moved from GPU pools to the host tier (in: device "
      "bytes; out: host bytes, after encoding)";
  device_move_bytes_in_ =
      registry->AddCounter("proxima_tierer_gpu_move_bytes_total", bytes_help, {{"side", "in"}});
  device_move_bytes_out_ =
      registry->AddCounter("proxima_tierer_gpu_move_bytes_total", bytes_help, {{"side", "out"}});
  device_encode_microseconds_ =
      registry->AddCounter("proxima_tierer_gpu_encode_microseconds_total",
                           "Time the tierer spent encoding blocks on GPUs (device calls, waited)");
}

Tierer::~Tierer() { Stop(); }

void Tierer::Start() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = false;
  }
  bool any = store_->num_devices() > 0;  // the GPU tier's pools need watching
  for (const auto& ns : namespaces_) any |= !ns->policy.plans.empty();
  if (!any) return;  // nothing to compress or move: no worker needed
  const uint32_t n = std::max<uint32_t>(config_.threads, 1);
  helpers_.store(n - 1, std::memory_order_relaxed);
  for (uint32_t i = 0; i < n; ++i) {
    workers_.emplace_back([this, i] { Run(i); });
  }
  PROXIMA_LOG(kInfo) << "tierer started" << log::Kv("workers", workers_.size())
                     << log::Kv("interval_seconds", config_.interval_seconds);
}

void Tierer::Stop() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  for (std::thread& w : workers_) w.join();
  workers_.clear();
  helpers_.store(0, std::memory_order_relaxed);
}

void Tierer::Wake() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    ++work_epoch_;
  }
  stop_cv_.notify_all();
}

bool Tierer::OverAnyThreshold() const {
  const double pressure =
      static_cast<double>(store_->used_bytes()) / static_cast<double>(store_->capacity_bytes());
  std::vector<uint8_t> caps = CapsUnderPressure(pressure);
  return std::any_of(caps.begin(), caps.end(), [](uint8_t c) { return c != 0; });
}

void Tierer::Run(uint32_t index) {
  const auto interval = std::chrono::duration<double>(config_.interval_seconds);
  uint64_t seen = 0;
  while (true) {
    RelieveDevicePressure();  // first: moving blocks down adds to the host tier's pressure
    RelievePressure();
    if (index == 0) {
      // The watcher checks the pressure every interval and calls the helpers when there is
      // work, so that idle helpers cost nothing.
      {
        std::unique_lock<std::mutex> lock(stop_mu_);
        if (stop_cv_.wait_for(lock, interval, [this] { return stop_; })) return;
      }
      if (helpers_.load(std::memory_order_relaxed) > 0 && OverAnyThreshold()) Wake();
    } else {
      // A helper sleeps until the watcher or a put that found the tier full calls it.
      std::unique_lock<std::mutex> lock(stop_mu_);
      stop_cv_.wait(lock, [&] { return stop_ || work_epoch_ != seen; });
      if (stop_) return;
      seen = work_epoch_;
    }
  }
}

bool Tierer::Stopping() {
  std::lock_guard<std::mutex> lock(stop_mu_);
  return stop_;
}

void Tierer::RelievePressure() {
  while (true) {
    if (Stopping()) return;
    const double pressure =
        static_cast<double>(store_->used_bytes()) / static_cast<double>(store_->capacity_bytes());
    uint64_t room = 0;
    std::vector<uint8_t> caps = CapsUnderPressure(pressure, &room);
    if (std::all_of(caps.begin(), caps.end(), [](uint8_t c) { return c == 0; })) return;
    if (!CompressOne(caps, room)) return;
  }
}

BlockAttributes Tierer::AttributesFor(uint32_t ns, uint32_t tokens_per_block, bool codec_ok,
                                      int64_t position, bool high_priority,
                                      float importance) const {
  BlockAttributes a;
  a.is_first_block = position == 0;
  a.second_chance = importance > 0;
  a.position = position;
  a.high_priority = high_priority;
  const CompressionConfig& p = namespaces_[ns]->policy;
  if (!codec_ok || p.plans.empty()) return a;
  if (position >= 0 &&
      static_cast<uint64_t>(position + 1) * tokens_per_block < p.min_seq_len_to_compress) {
    return a;
  }
  size_t max = std::min<size_t>(p.plans.size(), kMaxLevels - 1);
  if (high_priority) max = std::min<size_t>(max, p.high_priority_max_level);
  a.max_level = static_cast<uint8_t>(max);
  return a;
}

std::vector<uint8_t> Tierer::AllCaps() const {
  std::vector<uint8_t> caps(namespaces_.size());
  for (size_t i = 0; i < caps.size(); ++i) caps[i] = namespaces_[i]->depth;
  return caps;
}

std::vector<uint8_t> Tierer::CapsUnderPressure(double pressure, uint64_t* room) const {
  std::vector<uint8_t> caps = AllCaps();
  double lowest = 1;
  uint64_t own_room = 0;  // the most any namespace is over its share of its own max_bytes
  for (size_t i = 0; i < caps.size(); ++i) {
    const NamespaceState& ns = *namespaces_[i];
    const double threshold = ns.policy.memory_pressure_threshold;
    // A namespace with max_bytes is also under pressure of its own: its bytes against its limit
    // (encoded ahead of its puts, as the tier's are ahead of every put).
    const uint64_t limit = ns.max_bytes.load(std::memory_order_relaxed);
    const double own_over =
        limit == 0 ? 0
                   : static_cast<double>(store_->namespace_bytes(static_cast<uint32_t>(i))) -
                         threshold * static_cast<double>(limit);
    if (pressure <= threshold && own_over <= 0) {
      caps[i] = 0;
    } else if (caps[i] != 0) {
      if (pressure > threshold) lowest = std::min(lowest, threshold);
      if (own_over > 0) own_room = std::max(own_room, static_cast<uint64_t>(std::ceil(own_over)));
    }
  }
  if (room != nullptr) {
    const double over = (pressure - lowest) * static_cast<double>(store_->capacity_bytes());
    *room = std::max(over > 0 ? static_cast<uint64_t>(std::ceil(over)) : 0, own_room);
  }
  return caps;
}

std::optional<BlockStore::PendingBlock> Tierer::Reserve(uint64_t bytes,
                                                       const std::function<bool()>& make_room) {
  // make_room may say "try again" without having freed this put's room (another put took it);
  // a few times, then eviction.
  constexpr int kMaxRoomAsks = 8;
  int room_asks = 0;
  bool woke = false;
  while (true) {
    // A free region, or (enough bytes free but scattered) blocks moved to make one, before any
    // block is encoded or evicted.
    if (std::optional<BlockStore::PendingBlock> p = store_->ReserveCompacting(bytes)) return p;
    // The tier is full: the helpers join in at once (the watcher would only see it at its next
    // check), while this put compresses too.
    if (!woke && helpers_.load(std::memory_order_relaxed) > 0) {
      Wake();
      woke = true;
    }
    // The room this put lacks: the bytes beyond what is free, or, when enough bytes are free
    // but scattered (compaction could not gather them), a whole region of its size. A block
    // that moves out of its extent frees that extent whole; a level's few saved bytes at the
    // end of an extent seldom join a region the put can use.
    const uint64_t free =
        store_->capacity_bytes() - std::min(store_->used_bytes(), store_->capacity_bytes());
    if (CompressOne(AllCaps(), bytes > free ? bytes - free : bytes)) continue;
    if (make_room && room_asks++ < kMaxRoomAsks && make_room()) continue;
    const uint64_t evicted_before = store_->evictions();
    if (store_->EvictOne()) {  // may pass over an important block instead of evicting it
      evictions_for_put_->Increment(store_->evictions() - evicted_before);
      continue;
    }
    return store_->TryReserve(bytes);  // index empty; pinned bytes may have gone meanwhile
  }
}

bool Tierer::CompressOneOf(uint32_t ns, uint64_t room) {
  std::vector<uint8_t> caps(namespaces_.size(), 0);
  caps[ns] = namespaces_[ns]->depth;
  if (caps[ns] == 0) return false;
  return CompressOne(caps, room);
}

codec::CodecPlan Tierer::PlanFor(uint32_t ns, uint8_t level, const ProfileCodec& profile) const {
  return namespaces_[ns]->policy.plans[level - 1].ForModel(profile.rope_theta);
}

uint8_t Tierer::TargetLevel(const BlockStore::Candidate& c, const ProfileCodec& profile,
                            uint8_t deepest, uint64_t room) const {
  const uint32_t ns = c.id.namespace_index;
  const codec::BlockGeometry& geometry = profile.geometry;
  const bool first = c.attributes.is_first_block;
  const uint64_t now = c.block.bytes.size();
  uint8_t to = c.block.level + 1;
  if (room == 0) return to;
  std::optional<size_t> at = codec::EncodedBytes(geometry, PlanFor(ns, to, profile), first);
  while (to < deepest && at && *at < now && now - *at < room) {
    // Level `to` shrinks the block but would not free the room; the next one is taken only when
    // it is smaller still (one level at a time otherwise, so that the no-gain check sees each
    // level as successive steps would).
    std::optional<size_t> next = codec::EncodedBytes(geometry, PlanFor(ns, to + 1, profile), first);
    if (!next || *next >= *at) break;
    ++to;
    at = next;
  }
  return to;
}

bool Tierer::CompressOne(std::span<const uint8_t> caps, uint64_t room) {
  std::optional<BlockStore::Candidate> c = store_->ColdestCompressible(caps);
  if (!c) return false;
  if (Crc32c(c->block.bytes) != c->block.crc32c) {
    // Corrupt in tier memory: encoding it would give wrong bytes a valid CRC32C. A checked read
    // drops it and counts it, as a Get would.
    store_->Release(*c);
    store_->Read(c->id, BlockStore::CrcCheck::kHere);
    return true;
  }
  const uint32_t ns = c->id.namespace_index;
  NamespaceState& state = *namespaces_[ns];
  const uint8_t from = c->block.level;
  const std::optional<ProfileCodec> profile = profile_(ns, c->id.profile_id);
  std::optional<codec::BlockGeometry> geometry;
  ModelGuard* guard = nullptr;
  if (profile) {
    geometry = profile->geometry;
    guard = &GuardFor(ns, c->id.profile_id, *profile);
  }
  // ColdestCompressible hands out only blocks below both their own deepest level and the
  // namespace's cap; the quality guard may hold the block's model at a shallower level.
  uint8_t deepest = std::min(c->attributes.max_level, caps[ns]);
  if (guard != nullptr) {
    deepest = std::min(deepest, guard->cap.load(std::memory_order_relaxed));
    if (from >= deepest) {
      // Its model was stepped back to this block's level or above it: the block stays here
      // for good (caps are never raised) and leaves by eviction in its turn.
      store_->KeepAtLevel(*c);
      return true;
    }
  }
  const uint8_t to = geometry ? TargetLevel(*c, *profile, deepest, room) : from + 1;
  auto start = std::chrono::steady_clock::now();
  // The source: the raw block, or the previous level decoded.
  std::string decoded;
  std::span<const std::byte> source = c->block.bytes;
  absl::Status status;
  if (!geometry) {
    status = absl::FailedPreconditionError("profile no longer known");
  } else if (from > 0) {
    decoded.resize(geometry->RawBytes());
    status = codec::DecodeBlock(
        c->block.bytes, std::as_writable_bytes(std::span<char>(decoded.data(), decoded.size())));
    source = AsBytes(decoded);
  }
  std::string encoded;
  if (status.ok()) {
    status = codec::EncodeBlock(*geometry, PlanFor(ns, to, *profile), c->attributes.is_first_block,
                                source, {}, &encoded);
  }
  if (status.ok() && encoded.size() >= c->block.bytes.size()) {
    // The next level does not shrink this block: with few tokens per block, per-group metadata
    // can outweigh the narrower codes (int4 is larger than int8 at 2 tokens). Storing it would
    // cost quality for no room, and on a full tier the larger bytes would not fit where the old
    // ones were, losing a block out of LRU order. The block keeps its level for good; it leaves
    // by eviction in its turn, like any block.
    no_gain_->Increment();
    if (!state.warned_no_gain.exchange(true, std::memory_order_relaxed)) {
      PROXIMA_LOG(kWarning) << "tierer: a hierarchy level does not shrink this namespace's "
                               "blocks; they stay at the level before it (logged once)"
                            << log::Kv("namespace", state.name) << log::Kv("level", int(to))
                            << log::Kv("bytes_at_level", encoded.size())
                            << log::Kv("bytes_now", c->block.bytes.size())
                            << log::Kv("raw_bytes", geometry->RawBytes());
    }
    store_->KeepAtLevel(*c);
    return true;
  }
  if (!status.ok()) {
    // A block the codec refuses cannot shrink; it leaves the way it came in, by eviction.
    encode_failures_.fetch_add(1, std::memory_order_relaxed);
    PROXIMA_LOG(kWarning) << "tierer: cannot encode block; evicting it"
                          << log::Kv("namespace", state.name) << log::Kv("level", int(to))
                          << log::Kv("error", status.ToString());
    store_->EvictCandidate(*c);
    return true;
  }
  SampleQuality(
      *guard, to, *geometry, [&] { return std::optional(source); }, encoded);
  auto elapsed = std::chrono::steady_clock::now() - start;
  encode_seconds_->Increment(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(elapsed).count()));
  encodes_.fetch_add(1, std::memory_order_relaxed);
  encoded_blocks_[to]->Increment();
  if (to > from + 1) levels_passed_over_->Increment(to - from - 1);
  encode_bytes_in_->Increment(source.size());
  encode_bytes_out_->Increment(encoded.size());

  std::optional<BlockStore::PendingBlock> pending =
      store_->TryReserve(encoded.size(), HostTier::Placement::kHigh);
  if (!pending) {
    // The tier is full: swap in place (the old bytes make the room), unless a reader pins them.
    switch (store_->ReplaceInPlace(*std::move(c), AsBytes(encoded), to)) {
      case BlockStore::InPlace::kReplaced:
      case BlockStore::InPlace::kGone:
      case BlockStore::InPlace::kEvicted:
        return true;
      case BlockStore::InPlace::kPinned:
        return false;  // nothing freed now; the caller evicts instead
    }
  }
  std::memcpy(pending->bytes().data(), encoded.data(), encoded.size());
  const uint32_t crc = Crc32c(pending->bytes());
  if (!store_->Replace(*c, *std::move(pending), crc, to)) {
    store_->Release(*c);
  }
  return true;
}

void Tierer::SampleQuality(ModelGuard& guard, uint8_t level, const codec::BlockGeometry& geometry,
                           const std::function<std::optional<std::span<const std::byte>>()>& source,
                           const std::string& encoded) {
  const NamespaceState& state = *namespaces_[guard.ns];
  if (guard.encodings.fetch_add(1, std::memory_order_relaxed) % state.policy.sample_one_in != 0) {
    return;
  }
  std::optional<std::span<const std::byte>> from = source();
  if (!from) return;
  std::string check(from->size(), '\0');
  std::span<std::byte> out = std::as_writable_bytes(std::span<char>(check.data(), check.size()));
  if (!codec::DecodeBlock(AsBytes(encoded), out).ok()) return;
  absl::StatusOr<codec::ErrorSums> sums = codec::MeasureBlockError(geometry, *from, out);
  if (sums.ok()) RecordQuality(guard, level, *sums);
}

std::optional<BlockStore::PendingBlock> Tierer::ReserveOnDevice(uint64_t bytes) {
  // A put waits for a few small batches at most; the background workers keep the pools under
  // their threshold, so that puts seldom wait at all.
  constexpr int kMaxRounds = 4;
  constexpr size_t kPutBatch = 8;
  if (store_->num_devices() == 0) return std::nullopt;
  for (int round = 0;; ++round) {
    if (std::optional<BlockStore::PendingBlock> p = store_->TryReserveOnDevice(bytes)) return p;
    if (round == kMaxRounds) return std::nullopt;
    // Room in the pool with the most free bytes, among those the block fits in at all.
    std::optional<size_t> best;
    uint64_t best_free = 0;
    for (size_t d = 0; d < store_->num_devices(); ++d) {
      const DevicePool& pool = store_->device_pool(d);
      if (pool.capacity_bytes() < bytes) continue;
      const uint64_t free =
          pool.capacity_bytes() - std::min(pool.used_bytes(), pool.capacity_bytes());
      if (!best || free > best_free) {
        best = d;
        best_free = free;
      }
    }
    if (!best) return std::nullopt;
    if (helpers_.load(std::memory_order_relaxed) > 0) Wake();
    if (MoveDown(*best, bytes, kPutBatch) == 0) return std::nullopt;
  }
}

size_t Tierer::DrainDevices(absl::Time deadline) {
  // The pools' blocks in one order of recency across pools: next, from the pool whose coldest
  // block is the coldest, its blocks used before the other pools' coldest (a batch at most).
  constexpr size_t kBatch = 64;
  size_t left = 0;
  while (absl::Now() < deadline) {
    std::optional<size_t> next;
    uint64_t oldest = 0;
    uint64_t second = std::numeric_limits<uint64_t>::max();
    for (size_t d = 0; d < store_->num_devices(); ++d) {
      const std::optional<uint64_t> stamp = store_->ColdestStampOnDevice(d);
      if (!stamp) continue;
      if (!next || *stamp < oldest) {
        if (next) second = oldest;
        next = d;
        oldest = *stamp;
      } else {
        second = std::min(second, *stamp);
      }
    }
    if (!next) break;
    const size_t n = MoveDown(*next, 0, kBatch, second);
    if (n == 0) break;  // nothing could move (a reader holds what is left)
    left += n;
  }
  return left;
}

void Tierer::RelieveDevicePressure() {
  constexpr size_t kBatch = 64;  // blocks per device encode call in the background
  for (size_t d = 0; d < store_->num_devices(); ++d) {
    const DevicePool& pool = store_->device_pool(d);
    const auto limit = static_cast<uint64_t>(gpu_config_.pressure_threshold *
                                             static_cast<double>(pool.capacity_bytes()));
    while (!Stopping()) {
      const uint64_t used = pool.used_bytes();
      if (used <= limit || MoveDown(d, used - limit, kBatch) == 0) break;
    }
  }
}

void Tierer::EncodeForMove(size_t device, std::span<const BlockStore::Candidate> candidates,
                           std::vector<std::string>* encoded, std::vector<uint8_t>* levels) {
  DeviceMemory& memory = store_->device_pool(device).memory();
  // One device call per (namespace, profile): one geometry and one plan (the namespace's first
  // level) for all of its blocks.
  std::map<std::pair<uint32_t, uint64_t>, std::vector<size_t>> groups;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const BlockStore::Candidate& c = candidates[i];
    const uint32_t ns = c.id.namespace_index;
    if (c.attributes.max_level == 0 || namespaces_[ns]->depth == 0) continue;  // stays raw
    groups[{ns, c.id.profile_id}].push_back(i);
  }
  for (const auto& [key, members] : groups) {
    const uint32_t ns = key.first;
    NamespaceState& state = *namespaces_[ns];
    const std::optional<ProfileCodec> profile = profile_(ns, key.second);
    if (!profile) continue;  // profile no longer known: raw
    ModelGuard& guard = GuardFor(ns, key.second, *profile);
    if (guard.cap.load(std::memory_order_relaxed) == 0) continue;  // stepped back to raw
    const codec::BlockGeometry* geometry = &profile->geometry;
    const codec::CodecPlan plan = PlanFor(ns, 1, *profile);
    std::vector<DeviceMemory::EncodeJob> jobs;
    for (size_t i : members) {
      if (candidates[i].device_bytes != geometry->RawBytes()) continue;  // not a raw block: raw
      jobs.push_back(
          {candidates[i].device_offset, candidates[i].attributes.is_first_block, &(*encoded)[i]});
    }
    // The candidate a job encodes.
    auto candidate_of = [&](const DeviceMemory::EncodeJob& job) -> const BlockStore::Candidate& {
      return candidates[static_cast<size_t>(job.out - encoded->data())];
    };
    const auto start = std::chrono::steady_clock::now();
    // Bytes that no longer match their CRC32C (a flipped bit in device memory) must not be
    // encoded: the container would carry a CRC of its own and be served as good. Checked on the
    // device first; a block that fails stays unencoded, and MoveDown, reading it back raw, finds
    // the mismatch and drops it as a corrupt block.
    std::vector<uint64_t> offsets;
    for (const DeviceMemory::EncodeJob& job : jobs) offsets.push_back(job.offset);
    std::vector<uint32_t> crcs(offsets.size());
    absl::Status status = memory.Checksum(offsets, geometry->RawBytes(), std::span(crcs));
    if (status.ok()) {
      size_t kept = 0;
      for (size_t j = 0; j < jobs.size(); ++j) {
        if (crcs[j] == candidate_of(jobs[j]).block.crc32c) jobs[kept++] = jobs[j];
      }
      jobs.resize(kept);
      status = memory.Encode(*geometry, plan, jobs);
    }
    device_encode_microseconds_->Increment(
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                  std::chrono::steady_clock::now() - start)
                                  .count()));
    // The raw bytes of job `j`, copied out of the device (for the CPU codec and the guard).
    auto copy_out = [&](const DeviceMemory::EncodeJob& job, std::string* raw) {
      raw->resize(geometry->RawBytes());
      return memory.CopyOut(job.offset,
                            std::as_writable_bytes(std::span<char>(raw->data(), raw->size())));
    };
    if (!status.ok()) {
      // What the device does not encode (lossless) or could not: the CPU codec, from a copy.
      if (!absl::IsUnimplemented(status)) {
        PROXIMA_LOG(kWarning) << "tierer: GPU checksum or encode failed; encoding on the CPU"
                              << log::Kv("device", memory.device())
                              << log::Kv("namespace", state.name)
                              << log::Kv("error", status.ToString());
      }
      for (const DeviceMemory::EncodeJob& job : jobs) {
        std::string raw;
        absl::Status s = copy_out(job, &raw);
        if (s.ok() && Crc32c(AsBytes(raw)) != candidate_of(job).block.crc32c) {
          s = absl::DataLossError("corrupt");  // dropped by MoveDown, as above
        }
        if (s.ok())
          s = codec::EncodeBlock(*geometry, plan, job.is_first_block, AsBytes(raw), {}, job.out);
        if (!s.ok()) job.out->clear();
      }
    }
    for (const DeviceMemory::EncodeJob& job : jobs) {
      const size_t i = static_cast<size_t>(job.out - encoded->data());
      if (job.out->empty()) continue;
      if (job.out->size() >= candidates[i].device_bytes) {
        no_gain_->Increment();  // the level does not shrink this block: it goes down raw
        job.out->clear();
        continue;
      }
      (*levels)[i] = 1;
      encodes_.fetch_add(1, std::memory_order_relaxed);
      encoded_blocks_[1]->Increment();
      encode_bytes_in_->Increment(candidates[i].device_bytes);
      encode_bytes_out_->Increment(job.out->size());
      std::string raw;
      SampleQuality(
          guard, 1, *geometry,
          [&]() -> std::optional<std::span<const std::byte>> {
            if (!copy_out(job, &raw).ok()) return std::nullopt;
            return AsBytes(raw);
          },
          *job.out);
    }
  }
}

size_t Tierer::MoveDown(size_t device, uint64_t room, size_t max_blocks, uint64_t up_to_stamp) {
  std::vector<BlockStore::Candidate> batch;
  uint64_t taken = 0;
  while (batch.size() < max_blocks && (room == 0 || batch.empty() || taken < room)) {
    std::optional<BlockStore::Candidate> c = store_->ColdestOnDevice(device);
    if (!c) break;
    if (!batch.empty() && c->stamp > up_to_stamp) {
      store_->Release(*c);
      break;
    }
    taken += c->device_bytes;
    batch.push_back(*std::move(c));
  }
  if (batch.empty()) return 0;
  std::vector<std::string> encoded(batch.size());
  std::vector<uint8_t> levels(batch.size(), 0);
  EncodeForMove(device, batch, &encoded, &levels);
  DeviceMemory& memory = store_->device_pool(device).memory();
  size_t left = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const BlockStore::Candidate& c = batch[i];
    const bool raw = encoded[i].empty();
    const uint64_t size = raw ? c.device_bytes : encoded[i].size();
    // Room in the host tier as a put gets it: compressing or evicting its coldest blocks.
    std::optional<BlockStore::PendingBlock> host = Reserve(size);
    absl::Status read = absl::OkStatus();
    uint32_t crc = 0;
    if (host && raw) {
      read = memory.CopyOut(c.device_offset, host->bytes());
      crc = read.ok() ? Crc32c(host->bytes()) : 0;
      if (read.ok() && crc != c.block.crc32c) {
        read = absl::DataLossError(absl::StrFormat(
            "CRC32C 0x%08x read back from the device, 0x%08x stored", crc, c.block.crc32c));
      }
    } else if (host) {
      std::memcpy(host->bytes().data(), encoded[i].data(), size);
      crc = Crc32c(host->bytes());
    }
    if (absl::IsDataLoss(read)) {
      // Corrupt in device memory: a checked read drops it and counts it, as a Get would (a
      // reader that pinned it meanwhile gets a miss the same way).
      host.reset();
      store_->Release(c);
      store_->Read(c.id, BlockStore::CrcCheck::kHere);
      device_move_drops_->Increment();
      ++left;
      continue;
    }
    if (!host || !read.ok()) {
      // Nowhere to go (every host block pinned by a reader), or bytes that could not be read:
      // the block leaves the cache, unless a reader holds it now (then it stays for a later try).
      if (!read.ok()) {
        PROXIMA_LOG(kError) << "tierer: a GPU block could not be read back; dropped"
                            << log::Kv("device", memory.device())
                            << log::Kv("error", read.ToString());
      }
      if (store_->EvictCandidate(c, /*count=*/false)) {  // not a host tier eviction
        device_move_drops_->Increment();
        ++left;
      }
      continue;
    }
    if (!store_->MoveToHost(c, *std::move(host), crc, levels[i])) continue;  // deleted meanwhile
    ++left;
    (raw ? device_moves_raw_ : device_moves_encoded_)->Increment();
    device_move_bytes_in_->Increment(c.device_bytes);
    device_move_bytes_out_->Increment(size);
  }
  return left;
}

Tierer::ModelGuard& Tierer::GuardFor(uint32_t ns, uint64_t profile_id,
                                     const ProfileCodec& profile) {
  ModelGuard* guard = nullptr;
  {
    proxima::MutexLock lock(&mu_);
    std::unique_ptr<ModelGuard>& slot = guards_[{ns, profile_id}];
    if (slot != nullptr) return *slot;
    slot = std::make_unique<ModelGuard>();
    guard = slot.get();
    guard->ns = ns;
    guard->profile_id = profile_id;
    guard->model = profile.model;
    guard->cap.store(namespaces_[ns]->depth, std::memory_order_relaxed);
  }
  // Its series, registered outside `mu_`: a scrape holds the registry's lock while it reads
  // gauges, which take `mu_`.
  const NamespaceState& state = *namespaces_[ns];
  const std::string profile_name = ProfileName(profile_id);
  registry_->AddGauge(
      "proxima_compression_model_level_cap",
      "Deepest hierarchy level new encodings of the model (registered profile) may reach: the "
      "namespace's depth, lowered by the quality guard",
      {{"namespace", state.name}, {"profile", profile_name}, {"model", guard->model}},
      [guard] { return double(guard->cap.load(std::memory_order_relaxed)); });
  for (int level = 1; level <= state.depth; ++level) {
    registry_->AddGauge(
        "proxima_quality_attention_error",
        "Relative L2 error of attention outputs over the model's sampled encodings at the level "
        "(NaN: none yet)",
        {{"namespace", state.name},
         {"profile", profile_name},
         {"model", guard->model},
         {"level", absl::StrCat(level)}},
        [this, ns, profile_id, level] {
          std::optional<double> e = sampled_attention_error(ns, profile_id, level);
          return e ? *e : std::numeric_limits<double>::quiet_NaN();
        });
  }
  return *guard;
}

void Tierer::RecordQuality(ModelGuard& guard, uint8_t level, const codec::ErrorSums& sums) {
  NamespaceState& state = *namespaces_[guard.ns];
  double error = 0;
  {
    proxima::MutexLock lock(&mu_);
    Quality& q = guard.quality[level];
    q.sums.Add(sums);
    ++q.samples;
    if (q.samples < kMinQualitySamples) return;
    error = codec::Finish(q.sums).attn_rel_l2;
  }
  if (error <= state.policy.max_attention_error) return;
  // Lower the model's cap below `level`, once (a concurrent sample may have done it already),
  // and the namespace's lowest cap with it.
  uint8_t cap = guard.cap.load(std::memory_order_relaxed);
  while (cap >= level) {
    if (guard.cap.compare_exchange_weak(cap, level - 1, std::memory_order_relaxed)) {
      state.step_backs.fetch_add(1, std::memory_order_relaxed);
      std::atomic<uint8_t>& lowest = *caps_[guard.ns];
      uint8_t now = lowest.load(std::memory_order_relaxed);
      while (now > level - 1 &&
             !lowest.compare_exchange_weak(now, level - 1, std::memory_order_relaxed)) {
      }
      PROXIMA_LOG(kWarning) << "quality guard: a model of the namespace is over its error "
                               "budget; its new encodings step back a level"
                            << log::Kv("namespace", state.name)
                            << log::Kv("profile_id", ProfileName(guard.profile_id))
                            << log::Kv("model", guard.model) << log::Kv("level", int(level))
                            << log::Kv("plan", state.policy.plans[level - 1].ToString())
                            << log::Kv("attention_error", error)
                            << log::Kv("budget", state.policy.max_attention_error)
                            << log::Kv("new_deepest_level", int(level - 1));
      break;
    }
  }
}

void Tierer::AddModel(uint32_t ns, uint64_t profile_id, const ProfileCodec& profile) {
  if (namespaces_[ns]->depth > 0) GuardFor(ns, profile_id, profile);
}

uint8_t Tierer::level_cap(uint32_t ns, uint64_t profile_id) const {
  proxima::MutexLock lock(&mu_);
  auto it = guards_.find({ns, profile_id});
  if (it == guards_.end()) return namespaces_[ns]->depth;
  return it->second->cap.load(std::memory_order_relaxed);
}

std::optional<double> Tierer::sampled_attention_error(uint32_t ns, uint64_t profile_id,
                                                      int level) const {
  proxima::MutexLock lock(&mu_);
  auto it = guards_.find({ns, profile_id});
  if (it == guards_.end()) return std::nullopt;
  const Quality& q = it->second->quality[level];
  if (q.samples == 0) return std::nullopt;
  return codec::Finish(q.sums).attn_rel_l2;
}

uint64_t Tierer::step_backs(uint32_t ns) const {
  return namespaces_[ns]->step_backs.load(std::memory_order_relaxed);
}

}  // namespace proxima::daemon
