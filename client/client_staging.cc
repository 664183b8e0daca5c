// Put and Get of blocks in GPU memory: the bytes move through two pinned host staging halves,
// double-buffered, so that the copies between device and host memory of one half overlap the
// transfer (UCX or inline) of the other. Over UCX the halves are memory the UCX worker allocated
// (AllocateMemory), page-locked with cudaHostRegister: over shared memory the daemon copies into
// and out of them directly (docs/operations.md); cudaMallocHost memory otherwise. Every transfer
// itself is a plain host-memory Put or Get of the staged blocks, with its CRC32C checks and limits.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/log.h"
#include "common/status_macros.h"
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

absl::StatusOr<size_t> Client::PrepareStaging(uint64_t block_bytes) {
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
  return staging_->size / 2;
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

absl::StatusOr<std::vector<PutOutcome>> Client::PutStaged(const Profile& profile,
                                                          std::span<const BlockKey> keys,
                                                          std::span<const ConstSegments> blocks,
                                                          const PutOptions& options) {
  proxima::MutexLock lock(&staging_mu_);
  PROXIMA_ASSIGN_OR_RETURN(const size_t half, PrepareStaging(profile.block_bytes));
  const size_t per_chunk = half / profile.block_bytes;
  const size_t chunks = (keys.size() + per_chunk - 1) / per_chunk;
  auto slot = [&](size_t chunk, size_t i) {  // block i of `chunk` in its half
    return staging_->data + (chunk % 2) * half + i * profile.block_bytes;
  };
  // Gathers chunk c's blocks into its half and marks the half's fence.
  auto stage = [&](size_t c) -> absl::Status {
    const size_t begin = c * per_chunk, end = std::min(keys.size(), begin + per_chunk);
    for (size_t b = begin; b < end; ++b) {
      std::byte* dst = slot(c, b - begin);
      for (const auto& seg : blocks[b]) {
        PROXIMA_RETURN_IF_ERROR(copies_->Copy(dst, seg.data(), seg.size()));
        dst += seg.size();
      }
    }
    return copies_->Mark(static_cast<int>(c % 2));
  };
  std::vector<PutOutcome> outcomes;
  outcomes.reserve(keys.size());
  absl::Status status = chunks > 0 ? stage(0) : absl::OkStatus();
  for (size_t c = 0; c < chunks && status.ok(); ++c) {
    // The next chunk's copies run while this one is sent; its half was last read by the Put of
    // chunk c - 1, which has returned.
    if (c + 1 < chunks) status = stage(c + 1);
    if (status.ok()) status = copies_->Wait(static_cast<int>(c % 2));
    if (!status.ok()) break;
    const size_t begin = c * per_chunk, end = std::min(keys.size(), begin + per_chunk);
    std::vector<std::span<const std::byte>> staged;
    for (size_t b = begin; b < end; ++b) staged.emplace_back(slot(c, b - begin), profile.block_bytes);
    PutOptions chunk_options = options;
    if (!options.positions.empty()) chunk_options.positions = options.positions.subspan(begin, end - begin);
    if (!options.importance.empty()) {
      chunk_options.importance = options.importance.subspan(begin, end - begin);
    }
    absl::StatusOr<std::vector<PutOutcome>> sent =
        Put(profile, keys.subspan(begin, end - begin), staged, chunk_options);
    if (!sent.ok()) {
      status = sent.status();
      break;
    }
    outcomes.insert(outcomes.end(), sent->begin(), sent->end());
  }
  // Nothing may still be copying into a half when the next call reuses it.
  const absl::Status drained = copies_->Drain();
  PROXIMA_RETURN_IF_ERROR(status);
  PROXIMA_RETURN_IF_ERROR(drained);
  return outcomes;
}

absl::StatusOr<std::vector<bool>> Client::GetStaged(const char* method, const Profile& profile,
                                                    std::span<const BlockKey> keys,
                                                    std::span<const Segments> out) {
  proxima::MutexLock lock(&staging_mu_);
  PROXIMA_ASSIGN_OR_RETURN(const size_t half, PrepareStaging(profile.block_bytes));
  const size_t per_chunk = half / profile.block_bytes;
  std::vector<bool> found(keys.size(), false);
  absl::Status status;
  for (size_t begin = 0, c = 0; begin < keys.size() && status.ok(); begin += per_chunk, ++c) {
    const size_t end = std::min(keys.size(), begin + per_chunk);
    std::byte* base = staging_->data + (c % 2) * half;
    // The copies out of this half (chunk c - 2) must be done before the Get overwrites it; those
    // of chunk c - 1 run on meanwhile, during this Get.
    if (c >= 2) status = copies_->Wait(static_cast<int>(c % 2));
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
        status = copies_->Copy(seg.data(), src, seg.size());
        if (!status.ok()) break;
        src += seg.size();
      }
    }
    if (status.ok()) status = copies_->Mark(static_cast<int>(c % 2));
  }
  const absl::Status drained = copies_->Drain();  // every block is in place before we answer
  PROXIMA_RETURN_IF_ERROR(status);
  PROXIMA_RETURN_IF_ERROR(drained);
  return found;
}

}  // namespace proxima::client
