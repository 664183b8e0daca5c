// RecentDeletes: the keys deleted on this node in the last `window`, so that a peer's spill of one
// of them that arrives after the Delete is declined instead of kept.
//
// A Delete reaches every live node in parallel (Cluster::DeleteRemote), and a spill is a call of
// its own: the Delete can reach the receiver before the spilled copy lands there and the sender
// after it let its copy go, and the copy would then outlive the Delete. Declined, the block
// stays with its sender, where the Delete removes it (or, when the key was put again since,
// keeps the new block). A late spill is the only thing the set turns away, so a key in it costs
// at most a spill declined; never a block lost. Entries leave after `window` (longer than any
// peer call), and the oldest first when more than `max_keys` are held.
//
// Thread-safe.
#ifndef PROXIMA_DAEMON_CLUSTER_RECENT_DELETES_H_
#define PROXIMA_DAEMON_CLUSTER_RECENT_DELETES_H_

#include <cstddef>
#include <deque>
#include <span>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "daemon/block_store.h"

namespace proxima::daemon::cluster {

class RecentDeletes {
 public:
  RecentDeletes(absl::Duration window, size_t max_keys) : window_(window), max_keys_(max_keys) {}

  // Notes `ids` as deleted at `now`.
  void Add(std::span<const BlockId> ids, absl::Time now = absl::Now());
  // Whether `id` was deleted within the window before `now`.
  bool Contains(const BlockId& id, absl::Time now = absl::Now()) const;
  size_t size() const;

 private:
  // Drops what is older than the window, and the oldest beyond max_keys_.
  void Trim(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration window_;
  const size_t max_keys_;
  mutable proxima::Mutex mu_;
  std::deque<std::pair<absl::Time, BlockId>> order_ ABSL_GUARDED_BY(mu_);  // oldest first
  absl::flat_hash_map<BlockId, absl::Time> latest_ ABSL_GUARDED_BY(mu_);   // last delete per key
};

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_RECENT_DELETES_H_
