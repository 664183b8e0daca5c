#include "daemon/cluster/receive_pool.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <limits>
#include <list>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "common/status_macros.h"

namespace proxima::daemon::cluster {

struct ReceivePool::State {
  ucx::Worker* worker = nullptr;
  uint64_t max_idle_bytes = 0;
  std::atomic<uint64_t> reused{0};
  std::atomic<uint64_t> allocated{0};

  mutable proxima::Mutex mu;
  std::list<std::unique_ptr<Buffer>> idle ABSL_GUARDED_BY(mu);  // least recently returned first
  uint64_t idle_bytes ABSL_GUARDED_BY(mu) = 0;
  std::vector<std::pair<absl::Time, std::shared_ptr<const Buffer>>> quarantine ABSL_GUARDED_BY(mu);
  uint64_t quarantined_bytes ABSL_GUARDED_BY(mu) = 0;

  // The deleter of every handle: a pooled buffer goes back to `idle` (evicting the least
  // recently returned ones past max_idle_bytes); others, or any once the pool is gone, are freed.
  static void Release(const std::weak_ptr<State>& weak, Buffer* buffer) {
    std::unique_ptr<Buffer> owned(buffer);
    std::shared_ptr<State> s = weak.lock();
    if (s == nullptr || !buffer->pooled_) return;
    std::vector<std::unique_ptr<Buffer>> freed;  // unregistered outside the lock
    proxima::MutexLock lock(&s->mu);
    while (!s->idle.empty() && s->idle_bytes + buffer->bytes() > s->max_idle_bytes) {
      s->idle_bytes -= s->idle.front()->bytes();
      freed.push_back(std::move(s->idle.front()));
      s->idle.pop_front();
    }
    s->idle_bytes += buffer->bytes();
    s->idle.push_back(std::move(owned));
  }

  // Takes the quarantined buffers whose time is over; the caller drops them outside the lock.
  std::vector<std::shared_ptr<const Buffer>> TakeExpired(absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<std::shared_ptr<const Buffer>> out;
    auto keep = std::partition(quarantine.begin(), quarantine.end(),
                               [now](const auto& q) { return q.first > now; });
    for (auto it = keep; it != quarantine.end(); ++it) {
      quarantined_bytes -= it->second->bytes();
      out.push_back(std::move(it->second));
    }
    quarantine.erase(keep, quarantine.end());
    return out;
  }
};

ReceivePool::ReceivePool(ucx::Worker* worker, uint64_t max_idle_bytes, metrics::Registry* registry)
    : state_(std::make_shared<State>()) {
  state_->worker = worker;
  state_->max_idle_bytes = max_idle_bytes;
  if (registry == nullptr) return;
  // The registry may outlive the pool: its readers hold the state weakly.
  std::weak_ptr<State> weak = state_;
  auto read = [weak](auto field) {
    return [weak, field] {
      std::shared_ptr<State> s = weak.lock();
      return s == nullptr ? 0.0 : static_cast<double>(field(*s));
    };
  };
  registry->AddCounterFunction(
      "proxima_cluster_receive_buffers_total",
      "UCX receive buffers of remote gets (FetchBlocks calls): reused from the receive pool, or "
      "allocated and registered (pool misses, and buffers larger than cluster.receive_pool_bytes)",
      {{"outcome", "reused"}}, read([](const State& s) { return s.reused.load(); }));
  registry->AddCounterFunction("proxima_cluster_receive_buffers_total", "",
                               {{"outcome", "allocated"}},
                               read([](const State& s) { return s.allocated.load(); }));
  registry->AddGauge("proxima_cluster_receive_pool_idle_bytes",
                     "Bytes of registered UCX receive buffers kept idle for reuse (at most "
                     "cluster.receive_pool_bytes)",
                     {}, read([](const State& s) {
                       proxima::MutexLock lock(&s.mu);
                       return s.idle_bytes;
                     }));
  registry->AddGauge("proxima_cluster_receive_pool_quarantined_bytes",
                     "Bytes of UCX receive buffers of failed remote gets, held until the holder "
                     "can no longer write into them",
                     {}, read([](const State& s) {
                       proxima::MutexLock lock(&s.mu);
                       return s.quarantined_bytes;
                     }));
}

ReceivePool::~ReceivePool() = default;

absl::StatusOr<std::shared_ptr<const ReceivePool::Buffer>> ReceivePool::Get(size_t slots,
                                                                            size_t slot_bytes) {
  constexpr size_t kMax = std::numeric_limits<size_t>::max();
  if (slots == 0 || slot_bytes == 0 || slots > kMax / 2 || slot_bytes > kMax / slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("receive buffer of ", slots, " slots of ", slot_bytes, " bytes"));
  }
  const size_t class_slots = std::bit_ceil(slots);
  const bool pooled = class_slots <= state_->max_idle_bytes / slot_bytes;
  std::weak_ptr<State> weak = state_;
  auto handle = [&weak](std::unique_ptr<Buffer> b) {
    return std::shared_ptr<const Buffer>(
        b.release(), [weak](const Buffer* p) { State::Release(weak, const_cast<Buffer*>(p)); });
  };

  std::vector<std::shared_ptr<const Buffer>> expired;
  {
    proxima::MutexLock lock(&state_->mu);
    expired = state_->TakeExpired(absl::Now());
  }
  expired.clear();  // outside the lock: they go back to `idle` (or are freed)
  if (pooled) {
    std::unique_ptr<Buffer> found;
    {
      proxima::MutexLock lock(&state_->mu);
      auto& idle = state_->idle;
      for (auto it = idle.rbegin(); it != idle.rend(); ++it) {  // most recently returned first
        if ((*it)->slot_bytes_ == slot_bytes && (*it)->slots_ == class_slots) {
          found = std::move(*it);
          idle.erase(std::next(it).base());
          state_->idle_bytes -= found->bytes();
          break;
        }
      }
    }
    if (found != nullptr) {
      state_->reused.fetch_add(1);
      return handle(std::move(found));
    }
  }
  auto buffer = std::make_unique<Buffer>();
  buffer->slot_bytes_ = slot_bytes;
  buffer->slots_ = pooled ? class_slots : slots;
  buffer->pooled_ = pooled;
  if (pooled) {
    // Memory UCX chose: over shared memory the holder maps it once and then writes it directly
    // (with the unpacked key kept by registration id); heap memory would take UCX's slower
    // path there. Not for a buffer of one call, whose mapping would be paid per call.
    PROXIMA_ASSIGN_OR_RETURN(buffer->registration_, state_->worker->Allocate(buffer->bytes()));
    buffer->data_ = static_cast<std::byte*>(buffer->registration_->address());
  } else {
    buffer->heap_.reset(new std::byte[buffer->bytes()]);
    buffer->data_ = buffer->heap_.get();
    PROXIMA_ASSIGN_OR_RETURN(buffer->registration_,
                             state_->worker->Register(buffer->data_, buffer->bytes()));
  }
  state_->allocated.fetch_add(1);
  return handle(std::move(buffer));
}

void ReceivePool::Quarantine(std::shared_ptr<const Buffer> buffer, absl::Time until) {
  std::vector<std::shared_ptr<const Buffer>> expired;  // dropped after the lock is released
  proxima::MutexLock lock(&state_->mu);
  expired = state_->TakeExpired(absl::Now());
  state_->quarantined_bytes += buffer->bytes();
  state_->quarantine.emplace_back(until, std::move(buffer));
}

uint64_t ReceivePool::idle_bytes() const {
  proxima::MutexLock lock(&state_->mu);
  return state_->idle_bytes;
}

uint64_t ReceivePool::quarantined_bytes() const {
  proxima::MutexLock lock(&state_->mu);
  return state_->quarantined_bytes;
}

uint64_t ReceivePool::reused() const { return state_->reused.load(); }
uint64_t ReceivePool::allocated() const { return state_->allocated.load(); }

}  // namespace proxima::daemon::cluster
