#include "daemon/cluster/recent_deletes.h"

#include <algorithm>
#include <random>

namespace proxima::daemon::cluster {

uint64_t RecentDeletes::NewId() {
  static proxima::Mutex mu;
  static std::mt19937_64* gen =
      new std::mt19937_64(std::random_device{}() | (uint64_t{std::random_device{}()} << 32));
  proxima::MutexLock lock(&mu);
  uint64_t id = 0;
  while (id == 0) id = (*gen)();
  return id;
}

void RecentDeletes::Add(std::span<const BlockId> ids, uint64_t delete_id, absl::Time now,
                        absl::Duration age) {
  const absl::Time at = now - std::max(age, absl::ZeroDuration());
  proxima::MutexLock lock(&mu_);
  for (const BlockId& id : ids) {
    auto [it, added] = latest_.try_emplace(id, Entry{at, delete_id});
    if (!added) {
      if (it->second.at > at) continue;  // a later Delete is noted already
      it->second = Entry{at, delete_id};
    }
    order_.emplace_back(at, id);
  }
  Trim(now);
}

uint64_t RecentDeletes::Last(const BlockId& id, absl::Time now) const {
  proxima::MutexLock lock(&mu_);
  auto it = latest_.find(id);
  return it != latest_.end() && now - it->second.at < window_ ? it->second.delete_id : 0;
}

bool RecentDeletes::Stale(const BlockId& id, uint64_t after_delete, absl::Duration sender_reach,
                          absl::Time now) const {
  proxima::MutexLock lock(&mu_);
  auto it = latest_.find(id);
  if (it == latest_.end()) return false;
  const absl::Duration age = now - it->second.at;
  return age < window_ && age <= sender_reach + slack_ && it->second.delete_id != after_delete;
}

absl::Duration RecentDeletes::Reach(absl::Time now) const {
  proxima::MutexLock lock(&mu_);
  return std::min(window_, now - known_since_);
}

std::vector<RecentDeletes::Noted> RecentDeletes::Snapshot(absl::Time now) const {
  proxima::MutexLock lock(&mu_);
  std::vector<Noted> out;
  out.reserve(latest_.size());
  for (const auto& [id, entry] : latest_) {
    if (now - entry.at < window_) out.push_back({id, entry.delete_id, now - entry.at});
  }
  return out;
}

void RecentDeletes::Learn(std::span<const Noted> noted, absl::Duration reach, absl::Time now) {
  proxima::MutexLock lock(&mu_);
  for (const Noted& n : noted) {
    if (n.delete_id == 0 || n.age < absl::ZeroDuration() || n.age >= window_) continue;
    const absl::Time at = now - n.age;
    auto [it, added] = latest_.try_emplace(n.id, Entry{at, n.delete_id});
    if (!added) {
      if (it->second.at >= at) continue;  // this node's own is newer
      it->second = Entry{at, n.delete_id};
    }
    // Out of time order in order_: Trim may keep an entry a little past the window (Last and
    // Stale look at its time), or drop it early when max_keys_ is reached.
    order_.emplace_back(at, n.id);
  }
  known_since_ = std::min(known_since_, now - std::min(reach, window_));
  Trim(now);
}

size_t RecentDeletes::size() const {
  proxima::MutexLock lock(&mu_);
  return latest_.size();
}

void RecentDeletes::Trim(absl::Time now) {
  while (!order_.empty() && (now - order_.front().first >= window_ || order_.size() > max_keys_)) {
    auto it = latest_.find(order_.front().second);
    // A key deleted again later keeps its newer entry.
    if (it != latest_.end() && it->second.at == order_.front().first) latest_.erase(it);
    order_.pop_front();
  }
}

}  // namespace proxima::daemon::cluster
