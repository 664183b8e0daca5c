// ReceivePool: a reader daemon's registered receive buffers for UCX fetches (PeerUcx), reused
// across FetchBlocks calls instead of allocated and registered per call (docs/cluster.md).
//
// A buffer has `slots` slots of `slot_bytes`. Buffers come in size classes: the slot size as
// asked (the profile's), the slot count rounded up to a power of two, so a call of 5 blocks and
// one of 8 share a class. A buffer goes back to the pool when its last handle is dropped (the
// fetched blocks served from it are pinned by that handle), and is kept idle for the next call
// of its class while the pool's idle bytes stay within `max_idle_bytes`; past it the least
// recently returned idle buffers are freed. A class larger than `max_idle_bytes` is never
// pooled: such a buffer is allocated for its call alone (exact size) and freed after it.
//
// Because a pooled buffer keeps its registration, a holder can keep the reader's unpacked remote
// key across calls: registration_id() names it (0 for a buffer that is not reused).
//
// A buffer of a failed call may still be written by the holder; Quarantine() keeps it out of the
// pool until the holder surely stopped.
//
// Thread-safe. Buffers may outlive the pool (they are then freed when dropped), not the worker.
#ifndef PROXIMA_DAEMON_CLUSTER_RECEIVE_POOL_H_
#define PROXIMA_DAEMON_CLUSTER_RECEIVE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/ucx.h"
#include "daemon/metrics.h"

namespace proxima::daemon::cluster {

class ReceivePool {
 public:
  class Buffer {
   public:
    std::span<const std::byte> Slot(size_t i, size_t size) const {
      return {data_ + i * slot_bytes_, size};
    }
    const std::byte* data() const { return data_; }
    size_t slot_bytes() const { return slot_bytes_; }
    size_t slots() const { return slots_; }  // at least as many as asked for
    size_t bytes() const { return slots_ * slot_bytes_; }
    const std::string& packed_rkey() const { return registration_->packed_rkey(); }
    // The registration's id when the buffer is pooled (reused across calls), else 0.
    uint64_t registration_id() const { return pooled_ ? registration_->id() : 0; }

   private:
    friend class ReceivePool;
    std::byte* data_ = nullptr;
    std::unique_ptr<std::byte[]> heap_;  // data_ of a buffer that is not pooled
    size_t slot_bytes_ = 0;
    size_t slots_ = 0;
    bool pooled_ = false;
    std::shared_ptr<ucx::Registration> registration_;  // dropped before heap_
  };

  // `worker` must outlive every buffer. `registry` may be null (no metrics).
  ReceivePool(ucx::Worker* worker, uint64_t max_idle_bytes, metrics::Registry* registry);
  ~ReceivePool();
  ReceivePool(const ReceivePool&) = delete;
  ReceivePool& operator=(const ReceivePool&) = delete;

  // A buffer of at least `slots` slots of `slot_bytes`: an idle one of the class, or a new one.
  // INVALID_ARGUMENT for an empty or overflowing size; the worker's error when registering fails.
  absl::StatusOr<std::shared_ptr<const Buffer>> Get(size_t slots, size_t slot_bytes);

  // Keeps `buffer` (of a call that failed) until `until`: only then can it go back to the pool
  // (or be freed). Quarantined buffers are released by the next Get or Quarantine after `until`.
  void Quarantine(std::shared_ptr<const Buffer> buffer, absl::Time until);

  // Bytes of idle buffers kept for reuse (at most max_idle_bytes).
  uint64_t idle_bytes() const;
  // Bytes of quarantined buffers.
  uint64_t quarantined_bytes() const;
  // Get()s served by an idle buffer, and by a new allocation (pool misses), since start.
  uint64_t reused() const;
  uint64_t allocated() const;

 private:
  struct State;  // shared with the handles' deleters
  std::shared_ptr<State> state_;
};

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_RECEIVE_POOL_H_
