// Put and Get through staging halves, double-buffered, so that the copies into or out of one
// half overlap the transfer (UCX or inline) of the other:
//  - blocks in GPU memory move through two pinned host halves. Over UCX the halves are memory
//    the UCX worker allocated (AllocateMemory), page-locked with cudaHostRegister: over shared
//    memory the daemon copies into and out of them directly (docs/operations.md);
//    cudaMallocHost memory otherwise. Copies run on a CUDA stream.
//  - blocks in ordinary host memory, when the daemon reaches this process over a shared-memory
//    transport that maps only memory UCX allocated (ClientOptions::host_staging), move through
//    two UCX-allocated halves; the copies are plain memcpy on the caller's thread.
// Every transfer itself is a plain host-memory Put or Get of the staged blocks, with its CRC32C
// checks and limits.
#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/ucx.h"
#include "kernels/device.h"

namespace proxima::client {

template <typename Seg>
bool Client::AnyDeviceMemory(std::span<const Seg> blocks) const {
  if (!check_device_memory_) return false;
  for (const auto& block : blocks) {
    for (const auto& seg : block) {
      if (!seg.empty() && gpu::IsDeviceMemory(seg.data())) return true;
    }
  }
  return false;
}
template bool Client::AnyDeviceMemory(std::span<const ConstSegments>) const;
template bool Client::AnyDeviceMemory(std::span<const Segments>) const;

// The halves of one staged call and how bytes are copied into and out of them: through the
// CUDA copy queue (asynchronous, with fences), or with memcpy at once (`queue` null).
class Client::Stage {
 public:
  Stage(std::byte* data, size_t half, gpu::CopyQueue* queue)
      : data_(data), half_(half), queue_(queue) {}
  std::byte* half(size_t c) const { return data_ + (c % 2) * half_; }
  size_t half_bytes() const { return half_; }
  absl::Status Copy(void* dst, const void* src, size_t n) {
    if (queue_ != nullptr) return queue_->Copy(dst, src, n);
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }
  // Whether copies are memcpy at once (host staging), so that a Put can take each block's CRC32C
  // while copying it into a half (Crc32cCopy) rather than by reading the half again.
  bool copies_at_once() const { return queue_ == nullptr; }
  absl::Status Mark(int f) { return queue_ != nullptr ? queue_->Mark(f) : absl::OkStatus(); }
  absl::Status Wait(int f) { return queue_ != nullptr ? queue_->Wait(f) : absl::OkStatus(); }
  absl::Status Drain() { return queue_ != nullptr ? queue_->Drain() : absl::OkStatus(); }

 private:
  std::byte* data_;
  size_t half_;
  gpu::CopyQueue* queue_;
};

template <typename Seg>
Client::Staging Client::StagingFor(std::span<const Seg> blocks) {
  if (AnyDeviceMemory(blocks)) return Staging::kDevice;
  if (transport_ != Transport::kUcx || !stage_host_memory_.load(std::memory_order_relaxed)) {
    return Staging::kNone;
  }
  for (const auto& block : blocks) {
    for (const auto& seg : block) {
      if (seg.empty()) continue;
      std::shared_ptr<ucx::Registration> r = FindRegistration(seg.data(), seg.size());
      if (r == nullptr || !r->allocated()) return Staging::kHost;
    }
  }
  return Staging::kNone;
}
template Client::Staging Client::StagingFor(std::span<const ConstSegments>);
template Client::Staging Client::StagingFor(std::span<const Segments>);

absl::StatusOr<Client::Stage> Client::PrepareDeviceStaging(uint64_t block_bytes) {
  // Two halves of at least one block each; a block larger than half the configured staging
  // grows them.
  const size_t half = std::max<size_t>(options_.gpu_staging_bytes / 2, block_bytes);
  if (staging_ == nullptr || staging_->size < 2 * half) {
    staging_.reset();
    PROXIMA_ASSIGN_OR_RETURN(staging_, AllocateStaging(2 * half));
  }
  if (copies_ == nullptr) {
    PROXIMA_ASSIGN_OR_RETURN(copies_, gpu::CopyQueue::Create(2));
  }
  return Stage(staging_->data, staging_->size / 2, copies_.get());
}

std::optional<MemoryRegion> Client::LeaseHostStaging(uint64_t block_bytes) {
  const size_t bytes = 2 * std::max<size_t>(options_.host_staging_bytes / 2, block_bytes);
  {
    proxima::MutexLock lock(&host_staging_mu_);
    while (!host_staging_free_.empty()) {
      MemoryRegion region = std::move(host_staging_free_.back());
      host_staging_free_.pop_back();
      if (region.bytes().size() >= bytes) return region;  // smaller ones go (larger blocks now)
    }
  }
  absl::StatusOr<MemoryRegion> region = AllocateMemory(bytes);
  if (region.ok()) return *std::move(region);
  // Once: this and later calls move ordinary memory as it is.
  if (stage_host_memory_.exchange(false)) {
    PROXIMA_LOG(kWarning) << "cannot allocate host staging memory; blocks in ordinary memory "
                             "move without it (slower over shared memory)"
                          << log::Kv("bytes", bytes)
                          << log::Kv("status", region.status().ToString());
  }
  return std::nullopt;
}

void Client::ReturnHostStaging(MemoryRegion region) {
  proxima::MutexLock lock(&host_staging_mu_);
  // As many as calls ran at once, up to a bound; beyond it the memory is freed.
  if (host_staging_free_.size() < kMaxFreeHostStaging) {
    host_staging_free_.push_back(std::move(region));
  }
}

template <typename Body, typename Direct>
auto Client::WithStage(Staging staging, uint64_t block_bytes, Body&& body, Direct&& direct)
    -> decltype(direct()) {
  if (staging == Staging::kDevice) {
    proxima::MutexLock lock(&staging_mu_);
    PROXIMA_ASSIGN_OR_RETURN(Stage stage, PrepareDeviceStaging(block_bytes));
    return body(stage);
  }
  // Host staging: halves of this call's own, so concurrent calls never wait for each other.
  std::optional<MemoryRegion> lease = LeaseHostStaging(block_bytes);
  if (!lease) return direct();  // host staging given up
  Stage stage(lease->bytes().data(), lease->bytes().size() / 2, nullptr);
  auto result = body(stage);
  ReturnHostStaging(*std::move(lease));
  return result;
}

Client::StagingMemory::~StagingMemory() {
  if (host_registered) gpu::UnpinHostMemory(data);  // before `region` frees UCX's memory
}

absl::StatusOr<std::unique_ptr<Client::StagingMemory>> Client::AllocateStaging(size_t bytes) {
  auto staging = std::make_unique<StagingMemory>();
  staging->size = bytes;
  if (transport_ == Transport::kUcx) {
    // Memory of the UCX worker: over shared memory transports the daemon maps it and copies
    // directly, where ordinary memory is reached through emulated one-sided operations.
    absl::StatusOr<MemoryRegion> region = AllocateMemory(bytes);
    absl::Status pinned = region.status();
    if (region.ok()) pinned = gpu::PinHostMemory(region->bytes().data(), bytes);
    if (pinned.ok()) {
      staging->data = region->bytes().data();
      staging->region = *std::move(region);
      staging->host_registered = true;
      return staging;
    }
    // Once per allocation: the halves are made once, and again only to grow.
    PROXIMA_LOG(kWarning) << "GPU staging in UCX-allocated memory failed; staging in "
                             "cudaMallocHost memory instead"
                          << log::Kv("status", pinned.ToString());
  }
  PROXIMA_ASSIGN_OR_RETURN(staging->pinned, gpu::PinnedBuffer::Allocate(bytes));
  staging->data = staging->pinned->data();
  if (transport_ == Transport::kUcx) {
    // Registered once, so that staged transfers find it (FindRegistration) and register
    // nothing per call.
    PROXIMA_ASSIGN_OR_RETURN(staging->region, RegisterMemory(staging->data, bytes));
  }
  return staging;
}

absl::StatusOr<std::vector<PutOutcome>> Client::PutStaged(Staging staging, const Profile& profile,
                                                          std::span<const BlockKey> keys,
                                                          std::span<const ConstSegments> blocks,
                                                          const PutOptions& options) {
  return WithStage(
      staging, profile.block_bytes,
      [&](Stage& stage_memory) { return PutThrough(stage_memory, profile, keys, blocks, options); },
      [&] { return PutUcx(profile, keys, blocks, options); });
}

absl::StatusOr<std::vector<PutOutcome>> Client::PutThrough(Stage& stage_memory,
                                                           const Profile& profile,
                                                           std::span<const BlockKey> keys,
                                                           std::span<const ConstSegments> blocks,
                                                           const PutOptions& options) {
  const size_t per_chunk = stage_memory.half_bytes() / profile.block_bytes;
  const size_t chunks = (keys.size() + per_chunk - 1) / per_chunk;
  auto slot = [&](size_t chunk, size_t i) {  // block i of `chunk` in its half
    return stage_memory.half(chunk) + i * profile.block_bytes;
  };
  // Host staging over UCX sends each block's CRC32C taken while it was copied in.
  const bool crc_while_copying = stage_memory.copies_at_once() && transport_ == Transport::kUcx;
  std::vector<uint32_t> crcs(crc_while_copying ? keys.size() : 0);
  // Gathers chunk c's blocks into its half and marks the half's fence.
  auto stage = [&](size_t c) -> absl::Status {
    const size_t begin = c * per_chunk, end = std::min(keys.size(), begin + per_chunk);
    for (size_t b = begin; b < end; ++b) {
      std::byte* dst = slot(c, b - begin);
      for (const auto& seg : blocks[b]) {
        if (crc_while_copying) {
          crcs[b] = Crc32cCopy(std::span(dst, seg.size()), seg, crcs[b]);
        } else {
          PROXIMA_RETURN_IF_ERROR(stage_memory.Copy(dst, seg.data(), seg.size()));
        }
        dst += seg.size();
      }
    }
    return stage_memory.Mark(static_cast<int>(c % 2));
  };
  std::vector<PutOutcome> outcomes;
  outcomes.reserve(keys.size());
  absl::Status status = chunks > 0 ? stage(0) : absl::OkStatus();
  for (size_t c = 0; c < chunks && status.ok(); ++c) {
    // The next chunk's copies run while this one is sent; its half was last read by the Put of
    // chunk c - 1, which has returned.
    if (c + 1 < chunks) status = stage(c + 1);
    if (status.ok()) status = stage_memory.Wait(static_cast<int>(c % 2));
    if (!status.ok()) break;
    const size_t begin = c * per_chunk, end = std::min(keys.size(), begin + per_chunk);
    std::vector<std::span<const std::byte>> staged;
    for (size_t b = begin; b < end; ++b)
      staged.emplace_back(slot(c, b - begin), profile.block_bytes);
    PutOptions chunk_options = options;
    if (!options.positions.empty())
      chunk_options.positions = options.positions.subspan(begin, end - begin);
    if (!options.importance.empty()) {
      chunk_options.importance = options.importance.subspan(begin, end - begin);
    }
    absl::StatusOr<std::vector<PutOutcome>> sent =
        crc_while_copying
            ? PutUcx(profile, keys.subspan(begin, end - begin),
                     OneSegmentEach(std::span<const std::span<const std::byte>>(staged)),
                     chunk_options, std::span(crcs).subspan(begin, end - begin))
            : Put(profile, keys.subspan(begin, end - begin), staged, chunk_options);
    if (!sent.ok()) {
      status = sent.status();
      break;
    }
    outcomes.insert(outcomes.end(), sent->begin(), sent->end());
  }
  // Nothing may still be copying into a half when the next call reuses it.
  const absl::Status drained = stage_memory.Drain();
  PROXIMA_RETURN_IF_ERROR(status);
  PROXIMA_RETURN_IF_ERROR(drained);
  return outcomes;
}

absl::StatusOr<std::vector<bool>> Client::GetStaged(Staging staging, const char* method,
                                                    const Profile& profile,
                                                    std::span<const BlockKey> keys,
                                                    std::span<const Segments> out) {
  return WithStage(
      staging, profile.block_bytes,
      [&](Stage& stage_memory) { return GetThrough(stage_memory, method, profile, keys, out); },
      [&] { return GetUcx(profile, keys, out); });
}

absl::StatusOr<std::vector<bool>> Client::GetThrough(Stage& stage_memory, const char* method,
                                                     const Profile& profile,
                                                     std::span<const BlockKey> keys,
                                                     std::span<const Segments> out) {
  // The client's CRC32C check runs over the half before the blocks are copied out (GetInto).
  // Checking while copying out (as puts checksum while copying in) was measured slower: the
  // check's chunked copies into the caller's buffers ran at two thirds of one memcpy of each
  // segment (docs/benchmarks.md, UCX run 9).
  const size_t per_chunk = stage_memory.half_bytes() / profile.block_bytes;
  std::vector<bool> found(keys.size(), false);
  absl::Status status;
  for (size_t begin = 0, c = 0; begin < keys.size() && status.ok(); begin += per_chunk, ++c) {
    const size_t end = std::min(keys.size(), begin + per_chunk);
    std::byte* base = stage_memory.half(c);
    // The copies out of this half (chunk c - 2) must be done before the Get overwrites it; those
    // of chunk c - 1 run on meanwhile, during this Get.
    if (c >= 2) status = stage_memory.Wait(static_cast<int>(c % 2));
    if (!status.ok()) break;
    std::vector<std::span<std::byte>> staged;
    for (size_t b = begin; b < end; ++b) {
      staged.emplace_back(base + (b - begin) * profile.block_bytes, profile.block_bytes);
    }
    absl::StatusOr<std::vector<bool>> got =
        GetInto(method, profile, keys.subspan(begin, end - begin), staged);
    if (!got.ok()) {
      status = got.status();
      break;
    }
    for (size_t b = begin; b < end && status.ok(); ++b) {
      if (!(*got)[b - begin]) continue;
      found[b] = true;
      const std::byte* src = staged[b - begin].data();
      for (const auto& seg : out[b]) {
        status = stage_memory.Copy(seg.data(), src, seg.size());
        if (!status.ok()) break;
        src += seg.size();
      }
    }
    if (status.ok()) status = stage_memory.Mark(static_cast<int>(c % 2));
  }
  const absl::Status drained = stage_memory.Drain();  // every block is in place before we answer
  PROXIMA_RETURN_IF_ERROR(status);
  PROXIMA_RETURN_IF_ERROR(drained);
  return found;
}

}  // namespace proxima::client
