#include "daemon/buffer_cache.h"

#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "common/mutex.h"

namespace proxima::daemon {

struct BufferCache::State {
  // No destructor of its own: ~BufferCache frees what is kept and closes the state first, so
  // nothing is kept by the time the last buffer lets go of it.
  explicit State(uint64_t max) : max_bytes(max) {}

  // Keeps `p` (of `bytes` bytes) for reuse, or frees it.
  void GiveBack(std::byte* p, size_t bytes) {
    {
      MutexLock lock(&mu);
      if (!closed && bytes <= max_bytes) {
        // Room first from the buffers of other sizes, then keep it if it fits.
        for (auto it = kept.begin(); kept_bytes + bytes > max_bytes && it != kept.end(); ++it) {
          if (it->first == bytes) continue;
          std::vector<std::byte*>& other = it->second;
          while (!other.empty() && kept_bytes + bytes > max_bytes) {
            delete[] other.back();
            other.pop_back();
            kept_bytes -= it->first;
          }
        }
        if (kept_bytes + bytes <= max_bytes) {
          kept[bytes].push_back(p);
          kept_bytes += bytes;
          return;
        }
      }
    }
    delete[] p;
  }

  const uint64_t max_bytes;
  mutable Mutex mu;
  bool closed ABSL_GUARDED_BY(mu) = false;  // the cache is gone: buffers given back are freed
  absl::flat_hash_map<size_t, std::vector<std::byte*>> kept ABSL_GUARDED_BY(mu);
  uint64_t kept_bytes ABSL_GUARDED_BY(mu) = 0;
  uint64_t reused ABSL_GUARDED_BY(mu) = 0;
  uint64_t allocated ABSL_GUARDED_BY(mu) = 0;
};

BufferCache::BufferCache(uint64_t max_bytes) : state_(std::make_shared<State>(max_bytes)) {}

BufferCache::~BufferCache() {
  absl::flat_hash_map<size_t, std::vector<std::byte*>> kept;
  {
    MutexLock lock(&state_->mu);
    state_->closed = true;  // buffers still out are freed when their last owner lets go
    kept.swap(state_->kept);
    state_->kept_bytes = 0;
  }
  for (auto& [bytes, list] : kept) {
    for (std::byte* p : list) delete[] p;
  }
}

std::shared_ptr<std::byte[]> BufferCache::Take(size_t bytes) {
  std::byte* p = nullptr;
  {
    MutexLock lock(&state_->mu);
    auto it = state_->kept.find(bytes);
    if (it != state_->kept.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      state_->kept_bytes -= bytes;
      ++state_->reused;
    } else {
      ++state_->allocated;
    }
  }
  if (p == nullptr) p = new std::byte[bytes];  // default-initialised: not zero-filled
  return std::shared_ptr<std::byte[]>(
      p, [state = state_, bytes](std::byte* q) { state->GiveBack(q, bytes); });
}

uint64_t BufferCache::kept_bytes() const {
  MutexLock lock(&state_->mu);
  return state_->kept_bytes;
}
uint64_t BufferCache::reused() const {
  MutexLock lock(&state_->mu);
  return state_->reused;
}
uint64_t BufferCache::allocated() const {
  MutexLock lock(&state_->mu);
  return state_->allocated;
}

}  // namespace proxima::daemon
