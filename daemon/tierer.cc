#include "daemon/tierer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/log.h"

namespace proxima::daemon {
namespace {

// Samples a level needs before the guard acts on its aggregate error: one unlucky block must
// not step a namespace back.
constexpr uint64_t kMinQualitySamples = 3;

std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

}  // namespace

Tierer::Tierer(BlockStore* store, const DaemonConfig& config, GeometryLookup geometry,
               metrics::Registry* registry)
    : store_(store), geometry_(std::move(geometry)), config_(config.tierer) {
  quality_.resize(config.namespaces.size());
  for (size_t i = 0; i < config.namespaces.size(); ++i) {
    auto ns = std::make_unique<NamespaceState>();
    ns->name = config.namespaces[i].name;
    ns->policy = config.namespaces[i].compression;
    const uint8_t cap =
        static_cast<uint8_t>(std::min<size_t>(ns->policy.plans.size(), kMaxLevels - 1));
    caps_.push_back(std::make_unique<std::atomic<uint8_t>>(cap));
    NamespaceState* state = ns.get();
    metrics::Labels labels = {{"namespace", ns->name}};
    registry->AddCounterFunction("proxima_quality_step_backs_total",
                                 "Times the quality guard lowered the namespace's deepest level",
                                 labels, [state] { return double(state->step_backs.load()); });
    std::atomic<uint8_t>* cap_ptr = caps_.back().get();
    registry->AddGauge("proxima_compression_level_cap",
                       "Deepest hierarchy level new encodings of the namespace may reach", labels,
                       [cap_ptr] { return double(cap_ptr->load()); });
    for (size_t level = 1; level <= ns->policy.plans.size() && level < kMaxLevels; ++level) {
      const uint32_t n = static_cast<uint32_t>(i);
      const int l = static_cast<int>(level);
      registry->AddGauge(
          "proxima_quality_attention_error",
          "Relative L2 error of attention outputs over the sampled encodings (NaN: none yet)",
          {{"namespace", ns->name}, {"level", absl::StrCat(level)}}, [this, n, l] {
            std::optional<double> e = sampled_attention_error(n, l);
            return e ? *e : std::numeric_limits<double>::quiet_NaN();
          });
    }
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
}

Tierer::~Tierer() { Stop(); }

void Tierer::Start() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = false;
  }
  bool any = false;
  for (const auto& ns : namespaces_) any |= !ns->policy.plans.empty();
  if (!any) return;  // nothing to compress: no worker needed
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

void Tierer::RelievePressure() {
  while (true) {
    {
      std::lock_guard<std::mutex> lock(stop_mu_);
      if (stop_) return;
    }
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
  std::vector<uint8_t> caps(caps_.size());
  for (size_t i = 0; i < caps_.size(); ++i) caps[i] = caps_[i]->load(std::memory_order_relaxed);
  return caps;
}

std::vector<uint8_t> Tierer::CapsUnderPressure(double pressure, uint64_t* room) const {
  std::vector<uint8_t> caps = AllCaps();
  double lowest = 1;
  for (size_t i = 0; i < caps.size(); ++i) {
    const double threshold = namespaces_[i]->policy.memory_pressure_threshold;
    if (pressure <= threshold) {
      caps[i] = 0;
    } else if (caps[i] != 0) {
      lowest = std::min(lowest, threshold);
    }
  }
  if (room != nullptr) {
    const double over = (pressure - lowest) * static_cast<double>(store_->capacity_bytes());
    *room = over > 0 ? static_cast<uint64_t>(std::ceil(over)) : 0;
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

uint8_t Tierer::TargetLevel(const BlockStore::Candidate& c, const codec::BlockGeometry& geometry,
                            uint8_t deepest, uint64_t room) const {
  const std::vector<codec::CodecPlan>& plans = namespaces_[c.id.namespace_index]->policy.plans;
  const bool first = c.attributes.is_first_block;
  const uint64_t now = c.block.bytes.size();
  uint8_t to = c.block.level + 1;
  if (room == 0) return to;
  std::optional<size_t> at = codec::EncodedBytes(geometry, plans[to - 1], first);
  while (to < deepest && at && *at < now && now - *at < room) {
    // Level `to` shrinks the block but would not free the room; the next one is taken only when
    // it is smaller still (one level at a time otherwise, so that the no-gain check sees each
    // level as successive steps would).
    std::optional<size_t> next = codec::EncodedBytes(geometry, plans[to], first);
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
  std::optional<codec::BlockGeometry> geometry = geometry_(ns, c->id.profile_id);
  // ColdestCompressible hands out only blocks below both their own deepest level and the cap.
  const uint8_t deepest = std::min(c->attributes.max_level, caps[ns]);
  const uint8_t to = geometry ? TargetLevel(*c, *geometry, deepest, room) : from + 1;
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
    status = codec::EncodeBlock(*geometry, state.policy.plans[to - 1], c->attributes.is_first_block,
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
  // Quality guard: measure one encoding in N against its source.
  if (state.encodings.fetch_add(1, std::memory_order_relaxed) % state.policy.sample_one_in == 0) {
    std::string check(source.size(), '\0');
    std::span<std::byte> out = std::as_writable_bytes(std::span<char>(check.data(), check.size()));
    if (codec::DecodeBlock(AsBytes(encoded), out).ok()) {
      absl::StatusOr<codec::ErrorSums> sums = codec::MeasureBlockError(*geometry, source, out);
      if (sums.ok()) RecordQuality(ns, to, *sums);
    }
  }
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

void Tierer::RecordQuality(uint32_t ns, uint8_t level, const codec::ErrorSums& sums) {
  NamespaceState& state = *namespaces_[ns];
  double error = 0;
  {
    proxima::MutexLock lock(&mu_);
    Quality& q = quality_[ns][level];
    q.sums.Add(sums);
    ++q.samples;
    if (q.samples < kMinQualitySamples) return;
    error = codec::Finish(q.sums).attn_rel_l2;
  }
  if (error <= state.policy.max_attention_error) return;
  // Lower the cap below `level`, once (a concurrent sample may have done it already).
  uint8_t cap = caps_[ns]->load(std::memory_order_relaxed);
  while (cap >= level) {
    if (caps_[ns]->compare_exchange_weak(cap, level - 1, std::memory_order_relaxed)) {
      state.step_backs.fetch_add(1, std::memory_order_relaxed);
      PROXIMA_LOG(kWarning) << "quality guard: namespace over its error budget; new encodings "
                               "step back a level"
                            << log::Kv("namespace", state.name) << log::Kv("level", int(level))
                            << log::Kv("plan", state.policy.plans[level - 1].ToString())
                            << log::Kv("attention_error", error)
                            << log::Kv("budget", state.policy.max_attention_error)
                            << log::Kv("new_deepest_level", int(level - 1));
      break;
    }
  }
}

std::optional<double> Tierer::sampled_attention_error(uint32_t ns, int level) const {
  proxima::MutexLock lock(&mu_);
  const Quality& q = quality_[ns][level];
  if (q.samples == 0) return std::nullopt;
  return codec::Finish(q.sums).attn_rel_l2;
}

uint64_t Tierer::step_backs(uint32_t ns) const {
  return namespaces_[ns]->step_backs.load(std::memory_order_relaxed);
}

}  // namespace proxima::daemon
