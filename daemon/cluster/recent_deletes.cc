#include "daemon/cluster/recent_deletes.h"

namespace proxima::daemon::cluster {

void RecentDeletes::Add(std::span<const BlockId> ids, absl::Time now) {
  proxima::MutexLock lock(&mu_);
  for (const BlockId& id : ids) {
    order_.emplace_back(now, id);
    latest_[id] = now;
  }
  Trim(now);
}

bool RecentDeletes::Contains(const BlockId& id, absl::Time now) const {
  proxima::MutexLock lock(&mu_);
  auto it = latest_.find(id);
  return it != latest_.end() && now - it->second < window_;
}

size_t RecentDeletes::size() const {
  proxima::MutexLock lock(&mu_);
  return latest_.size();
}

void RecentDeletes::Trim(absl::Time now) {
  while (!order_.empty() && (now - order_.front().first >= window_ || order_.size() > max_keys_)) {
    auto it = latest_.find(order_.front().second);
    // A key deleted again later keeps its newer entry.
    if (it != latest_.end() && it->second == order_.front().first) latest_.erase(it);
    order_.pop_front();
  }
}

}  // namespace proxima::daemon::cluster
