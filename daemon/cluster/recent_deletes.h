// RecentDeletes: the keys deleted on this node in the last `window`, each with the id of its last
// Delete, so that a peer's spill of one of them that arrives after the Delete is declined instead
// of kept.
//
// A Delete reaches every live node in parallel (Cluster::DeleteRemote), and a spill is a call of
// its own: the Delete can reach the receiver before the spilled copy lands there and the sender
// after it let its copy go, and the copy would then outlive the Delete. Declined, the block
// stays with its sender, where the Delete removes it (or the sender, told so, drops it).
//
// A key put again after its Delete is not stale: the sender names, per block, the last Delete of
// the key it saw (SpilledBlock.after_delete; its copy is newer, or that Delete would have removed
// it), and the receiver declines only when its own last Delete of the key is another one, which
// the sender had not seen. Without the ids, a block put again within the window was declined
// too: harmless for a spill (the sender keeps it) but lost in a hand-off, whose sender exits.
// A node can also miss a Delete: hung while it was sent (its peers send it again for a while),
// or leaving (its peers no longer send it Deletes while it drains and hands its blocks off).
// Its copies then name an older Delete, or none, and are declined for as long as entries stay:
// `window`, which covers both, and the oldest leave first when more than `max_keys` are held.
// A node that started after a Delete never saw it either, but holds no copy older than it: a
// sender says how far back its memory reaches (Reach), and only Deletes within that, give or
// take `slack`, decline its copies.
//
// Thread-safe.
#ifndef PROXIMA_DAEMON_CLUSTER_RECENT_DELETES_H_
#define PROXIMA_DAEMON_CLUSTER_RECENT_DELETES_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "daemon/block_store.h"

namespace proxima::daemon::cluster {

class RecentDeletes {
 public:
  // `slack`: how much longer ago than a sender's reach (Stale) a Delete may have been noted
  // here and still have reached the sender too (a Delete's skew between the nodes, a spill
  // call's transit). `started`: when this node's memory of Deletes began (its start).
  RecentDeletes(absl::Duration window, size_t max_keys, absl::Duration slack = absl::ZeroDuration(),
                absl::Time started = absl::Now())
      : window_(window), max_keys_(max_keys), slack_(slack), known_since_(started) {}

  // A fresh, random, non-zero id for a Delete.
  static uint64_t NewId();

  // Notes `ids` as deleted by the Delete `delete_id` (non-zero), made `age` before `now`; a key
  // whose last Delete noted here was made later keeps it (a Delete sent again may arrive after
  // a later one).
  void Add(std::span<const BlockId> ids, uint64_t delete_id, absl::Time now = absl::Now(),
           absl::Duration age = absl::ZeroDuration());
  // The id of the last Delete of `id` within the window before `now`; 0 when none.
  uint64_t Last(const BlockId& id, absl::Time now = absl::Now()) const;
  // How far back this node's memory of Deletes reaches at `now`: the window, or less when the
  // node started more recently (it never saw the Deletes from before its start) and has not
  // learned them from a peer since (Learn).
  absl::Duration Reach(absl::Time now = absl::Now()) const;

  // A Delete noted here: for a node that has just started, which learns them from its peers.
  struct Noted {
    BlockId id;
    uint64_t delete_id = 0;
    absl::Duration age;  // how long ago it was noted
  };
  // What this node remembers at `now`: each key's last Delete within the window.
  std::vector<Noted> Snapshot(absl::Time now = absl::Now()) const;
  // Takes in a peer's Snapshot(), taken when the peer's memory reached back `reach`: each key
  // whose Delete there is newer than the one noted here (or none) takes it, and this node's
  // memory reaches back as far as the peer's from then on. Ages are the peer's: its clock runs
  // at the same rate, and the call's transit makes them look younger by at most its deadline.
  void Learn(std::span<const Noted> noted, absl::Duration reach, absl::Time now = absl::Now());
  // Whether a copy of `id` whose sender last saw the Delete `after_delete` (0: none) may be stale
  // here: this node saw a Delete of it within the window, not that one, and recently enough for
  // the sender to have seen it: at most `sender_reach` (the sender's Reach() when it sent the
  // copy) plus the slack ago. A Delete from before the sender started is older than any copy it
  // made, and declining that copy would lose a block put again after the Delete.
  bool Stale(const BlockId& id, uint64_t after_delete,
             absl::Duration sender_reach = absl::InfiniteDuration(),
             absl::Time now = absl::Now()) const;
  size_t size() const;
  absl::Duration window() const { return window_; }

 private:
  struct Entry {
    absl::Time at;
    uint64_t delete_id = 0;
  };
  // Drops what is older than the window, and the oldest beyond max_keys_.
  void Trim(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration window_;
  const size_t max_keys_;
  const absl::Duration slack_;
  mutable proxima::Mutex mu_;
  std::deque<std::pair<absl::Time, BlockId>> order_ ABSL_GUARDED_BY(mu_);  // oldest first
  absl::flat_hash_map<BlockId, Entry> latest_ ABSL_GUARDED_BY(mu_);        // last delete per key
  absl::Time known_since_ ABSL_GUARDED_BY(mu_);  // Reach(): since its start or what it learned
};

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_RECENT_DELETES_H_
