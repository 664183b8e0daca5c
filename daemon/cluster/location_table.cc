#include "daemon/cluster/location_table.h"

namespace proxima::daemon::cluster {

uint32_t LocationTable::Intern(const std::string& holder) {
  auto [it, inserted] = holder_index_.emplace(holder, static_cast<uint32_t>(holders_.size()));
  if (inserted) holders_.push_back(holder);
  return it->second;
}

void LocationTable::Record(std::span<const BlockId> ids, const std::string& holder) {
  proxima::MutexLock lock(&mu_);
  const uint32_t h = Intern(holder);
  for (const BlockId& id : ids) {
    auto it = records_.find(id);
    if (it != records_.end()) {
      it->second = h;
      continue;
    }
    if (records_.size() >= max_records_ && !records_.empty()) {
      records_.erase(records_.begin());
      ++overflows_;
    }
    records_.emplace(id, h);
  }
}

size_t LocationTable::Forget(std::span<const BlockId> ids, const std::string& holder) {
  proxima::MutexLock lock(&mu_);
  auto h = holder_index_.find(holder);
  if (h == holder_index_.end()) return 0;
  size_t dropped = 0;
  for (const BlockId& id : ids) {
    auto it = records_.find(id);
    if (it != records_.end() && it->second == h->second) {
      records_.erase(it);
      ++dropped;
    }
  }
  return dropped;
}

size_t LocationTable::DropHolder(const std::string& holder) {
  proxima::MutexLock lock(&mu_);
  auto h = holder_index_.find(holder);
  if (h == holder_index_.end()) return 0;
  const uint32_t index = h->second;
  return absl::erase_if(records_, [index](const auto& r) { return r.second == index; });
}

std::vector<std::string> LocationTable::Find(std::span<const BlockId> ids) const {
  std::vector<std::string> out(ids.size());
  proxima::MutexLock lock(&mu_);
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = records_.find(ids[i]);
    if (it != records_.end()) out[i] = holders_[it->second];
  }
  return out;
}

size_t LocationTable::size() const {
  proxima::MutexLock lock(&mu_);
  return records_.size();
}

uint64_t LocationTable::overflows() const {
  proxima::MutexLock lock(&mu_);
  return overflows_;
}

}  // namespace proxima::daemon::cluster
