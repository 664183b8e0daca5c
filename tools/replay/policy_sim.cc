#include "tools/replay/policy_sim.h"

#include <algorithm>
#include <list>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace proxima::replay {
namespace {

// An ordered set of ids with O(1) membership, front = newest.
class IdQueue {
 public:
  bool Contains(uint64_t id) const { return where_.contains(id); }
  size_t size() const { return order_.size(); }
  bool empty() const { return order_.empty(); }
  void PushFront(uint64_t id) {
    order_.push_front(id);
    where_[id] = order_.begin();
  }
  void MoveToFront(uint64_t id) { order_.splice(order_.begin(), order_, where_.at(id)); }
  uint64_t Back() const { return order_.back(); }
  uint64_t PopBack() {
    const uint64_t id = order_.back();
    order_.pop_back();
    where_.erase(id);
    return id;
  }
  void Erase(uint64_t id) {
    auto it = where_.find(id);
    order_.erase(it->second);
    where_.erase(it);
  }

 private:
  std::list<uint64_t> order_;
  absl::flat_hash_map<uint64_t, std::list<uint64_t>::iterator> where_;
};

// LRU (a use moves the id to the front) or FIFO (a use changes nothing): the tail is evicted.
class RecencyQueue : public CachePolicy {
 public:
  RecencyQueue(size_t capacity, bool move_on_use)
      : capacity_(capacity), move_on_use_(move_on_use) {}
  bool Contains(uint64_t id) const override { return queue_.Contains(id); }
  void Touch(uint64_t id) override {
    if (move_on_use_) queue_.MoveToFront(id);
  }
  void Insert(uint64_t id) override {
    if (queue_.size() == capacity_) {
      queue_.PopBack();
      ++evictions_;
    }
    queue_.PushFront(id);
  }
  size_t size() const override { return queue_.size(); }

 private:
  const size_t capacity_;
  const bool move_on_use_;
  IdQueue queue_;
};

// S3-FIFO: new ids enter a small FIFO (10% of the slots); one that was used while there moves
// to the main FIFO when it reaches the small queue's tail, one that was not leaves (its id is
// remembered in a ghost FIFO as long as the main queue). An id inserted while remembered goes to
// the main queue directly. The main queue reinserts a used id at its head (using up one of its
// at most 3 recorded uses) instead of evicting it.
class S3Fifo : public CachePolicy {
 public:
  explicit S3Fifo(size_t capacity)
      : capacity_(capacity), small_target_(std::max<size_t>(1, capacity / 10)) {}
  bool Contains(uint64_t id) const override { return uses_.contains(id); }
  void Touch(uint64_t id) override {
    uint8_t& uses = uses_.at(id);
    uses = std::min<uint8_t>(uses + 1, 3);
  }
  void Insert(uint64_t id) override {
    while (size() >= capacity_) EvictOne();
    uses_[id] = 0;
    if (ghost_.Contains(id)) {
      ghost_.Erase(id);
      main_.PushFront(id);
    } else {
      small_.PushFront(id);
    }
  }
  size_t size() const override { return small_.size() + main_.size(); }

 private:
  void EvictOne() {
    if (small_.size() >= small_target_ || main_.empty()) {
      EvictFromSmall();
    } else {
      EvictFromMain();
    }
  }
  void EvictFromSmall() {
    while (!small_.empty()) {
      const uint64_t id = small_.PopBack();
      if (uses_.at(id) > 0) {
        uses_.at(id) = 0;
        main_.PushFront(id);
        if (main_.size() > capacity_ - small_target_) EvictFromMain();
        if (size() < capacity_) return;
        continue;
      }
      uses_.erase(id);
      ++evictions_;
      ghost_.PushFront(id);
      if (ghost_.size() > capacity_ - small_target_) ghost_.PopBack();
      return;
    }
    EvictFromMain();
  }
  void EvictFromMain() {
    while (!main_.empty()) {
      const uint64_t id = main_.PopBack();
      uint8_t& uses = uses_.at(id);
      if (uses > 0) {
        --uses;
        main_.PushFront(id);
        continue;
      }
      uses_.erase(id);
      ++evictions_;
      return;
    }
  }

  const size_t capacity_;
  const size_t small_target_;
  IdQueue small_, main_, ghost_;
  absl::flat_hash_map<uint64_t, uint8_t> uses_;  // resident ids and their recorded uses
};

// ARC: recency list T1 and frequency list T2 share the slots; ghost lists B1 and B2 remember
// what each recently evicted, and a hit in a ghost list moves the target size p of T1 towards the
// list that would have kept it.
class Arc : public CachePolicy {
 public:
  explicit Arc(size_t capacity) : c_(capacity) {}
  bool Contains(uint64_t id) const override { return t1_.Contains(id) || t2_.Contains(id); }
  void Touch(uint64_t id) override {
    if (t1_.Contains(id)) {
      t1_.Erase(id);
      t2_.PushFront(id);
    } else {
      t2_.MoveToFront(id);
    }
  }
  void Insert(uint64_t id) override {
    if (b1_.Contains(id)) {
      p_ = std::min(c_, p_ + std::max<size_t>(1, b2_.size() / b1_.size()));
      Replace(/*in_b2=*/false);
      b1_.Erase(id);
      t2_.PushFront(id);
      return;
    }
    if (b2_.Contains(id)) {
      const size_t step = std::max<size_t>(1, b1_.size() / b2_.size());
      p_ = p_ > step ? p_ - step : 0;
      Replace(/*in_b2=*/true);
      b2_.Erase(id);
      t2_.PushFront(id);
      return;
    }
    const size_t l1 = t1_.size() + b1_.size();
    const size_t total = l1 + t2_.size() + b2_.size();
    if (l1 == c_) {
      if (t1_.size() < c_) {
        b1_.PopBack();
        Replace(false);
      } else {
        t1_.PopBack();
        ++evictions_;
      }
    } else if (total >= c_) {
      if (total == 2 * c_) b2_.PopBack();
      if (size() == c_) Replace(false);
    }
    t1_.PushFront(id);
  }
  size_t size() const override { return t1_.size() + t2_.size(); }

 private:
  void Replace(bool in_b2) {
    if (size() < c_) return;
    if (!t1_.empty() && (t1_.size() > p_ || (in_b2 && t1_.size() == p_))) {
      b1_.PushFront(t1_.PopBack());
    } else {
      b2_.PushFront(t2_.PopBack());
    }
    ++evictions_;
  }

  const size_t c_;
  size_t p_ = 0;
  IdQueue t1_, t2_, b1_, b2_;
};

// Segmented LRU, as proximad's BlockStore implements it (daemon/block_store.h): a block enters the
// probation segment and moves to the protected segment (at most `protected_share` of the slots)
// when it is used again; the protected segment's least recent block drops back to probation's front
// when it overflows. Eviction takes probation's least recent block (protected's when probation is
// empty).
class Slru : public CachePolicy {
 public:
  Slru(size_t capacity, double protected_share)
      : capacity_(capacity),
        protected_max_(std::max<size_t>(1, static_cast<size_t>(capacity * protected_share))) {}
  bool Contains(uint64_t id) const override {
    return probation_.Contains(id) || protected_.Contains(id);
  }
  void Touch(uint64_t id) override {
    if (protected_.Contains(id)) {
      protected_.MoveToFront(id);
      return;
    }
    probation_.Erase(id);
    protected_.PushFront(id);
    if (protected_.size() > protected_max_) probation_.PushFront(protected_.PopBack());
  }
  void Insert(uint64_t id) override {
    if (size() == capacity_) {
      (probation_.empty() ? protected_ : probation_).PopBack();
      ++evictions_;
    }
    probation_.PushFront(id);
  }
  size_t size() const override { return probation_.size() + protected_.size(); }

 private:
  const size_t capacity_;
  const size_t protected_max_;
  IdQueue probation_, protected_;
};

}  // namespace

const std::vector<std::string>& CachePolicyNames() {
  static const std::vector<std::string> names = {"lru", "fifo", "s3fifo", "arc", "slru"};
  return names;
}

absl::StatusOr<std::unique_ptr<CachePolicy>> MakeCachePolicy(std::string_view policy,
                                                             size_t capacity) {
  absl::string_view name(policy.data(), policy.size());
  if (capacity == 0) return absl::InvalidArgumentError("cache capacity must be at least 1 block");
  if (name == "lru") return std::make_unique<RecencyQueue>(capacity, /*move_on_use=*/true);
  if (name == "fifo") return std::make_unique<RecencyQueue>(capacity, /*move_on_use=*/false);
  if (name == "s3fifo") return std::make_unique<S3Fifo>(capacity);
  if (name == "arc") return std::make_unique<Arc>(capacity);
  if (name == "slru") return std::make_unique<Slru>(capacity, kDefaultProtectedShare);
  if (absl::ConsumePrefix(&name, "slru:")) {
    double share = 0;
    if (!absl::SimpleAtod(name, &share) || !(share > 0 && share < 1)) {
      return absl::InvalidArgumentError(absl::StrCat("slru protected share \"", std::string(name),
                                                     "\" is not a number in (0, 1)"));
    }
    return std::make_unique<Slru>(capacity, share);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown cache policy \"", std::string(name),
                                                 "\"; expected one of ",
                                                 absl::StrJoin(CachePolicyNames(), ", ")));
}

SimulatedCounts Simulate(const std::vector<TraceRequest>& requests, CachePolicy& cache,
                         TouchOrder order) {
  SimulatedCounts r;
  const uint64_t evictions_before = cache.evictions();
  // `hit`: counted at lookup, now read. With kChainHeadLast a put of a deeper block may have
  // evicted it in between; it is then put again, as an engine would after a failed read.
  auto use = [&](uint64_t id, bool hit) {
    if (cache.Contains(id)) {
      cache.Touch(id);
      if (!hit) ++r.puts_already_present;
    } else {
      cache.Insert(id);
      ++r.puts_stored;
    }
  };
  for (const TraceRequest& request : requests) {
    const std::vector<uint64_t>& ids = request.hash_ids;
    ++r.requests;
    r.block_refs += ids.size();
    size_t h = 0;
    while (h < ids.size() && cache.Contains(ids[h])) ++h;  // Lookup
    r.hits += h;
    if (order == TouchOrder::kChainOrder) {
      for (size_t i = 0; i < ids.size(); ++i) use(ids[i], i < h);  // Get, then Put
    } else {
      for (size_t i = ids.size(); i-- > 0;) use(ids[i], i < h);
    }
  }
  r.evictions = cache.evictions() - evictions_before;
  r.held = cache.size();
  return r;
}

}  // namespace proxima::replay
