// Offline cache simulation of a prefix-cache trace: which temperature policy keeps the most
// useful blocks in a fixed number of slots. Each simulated cache is driven exactly as
// proxima_replay drives proximad (replay.h): per request, a Lookup counts the leading ids
// present (the hits), a Get touches those, and a Put touches each later id that is present and
// inserts each one that is not, evicting as the policy says.
//
// This is how docs/decisions.md chooses the daemon's temperature policy: the same trace, the same
// capacities, several policies, hit ratios side by side. The "lru" simulation is also the exact
// model that tests/integration/replay_test.cc holds the real daemon's raw-storage counts to.
//
// Touch order: proximad touches the blocks of a batch in key order, so the first block of a
// chain (the one every later block depends on: a lookup stops at the first miss) ends up the
// least recent of its chain and is evicted first. `TouchOrder::kChainHeadLast` touches a
// request's blocks deepest first instead, which is what a prefix-aware store would do; the
// simulation measures what that is worth.
//
// Thread-compatible: a policy object is used by one thread.
#ifndef PROXIMA_TOOLS_REPLAY_POLICY_SIM_H_
#define PROXIMA_TOOLS_REPLAY_POLICY_SIM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/replay/trace.h"

namespace proxima::replay {

// A cache of at most `capacity` equal-size blocks, named by trace id.
class CachePolicy {
 public:
  virtual ~CachePolicy() = default;
  virtual bool Contains(uint64_t id) const = 0;
  // A hit: `id` is present and was just used.
  virtual void Touch(uint64_t id) = 0;
  // A miss being filled: `id` is absent; evicts first when the cache is full.
  virtual void Insert(uint64_t id) = 0;
  virtual size_t size() const = 0;
  uint64_t evictions() const { return evictions_; }

 protected:
  uint64_t evictions_ = 0;
};

// The protected share of "slru", the same as proximad's default tierer.protected_share.
inline constexpr double kDefaultProtectedShare = 0.2;

// "lru", "fifo", "s3fifo" (small FIFO of 10% with ghost-guided admission and lazy promotion,
// Yang et al., SOSP 2023), "arc" (Megiddo and Modha, FAST 2003), "slru" (segmented LRU with
// kDefaultProtectedShare of the slots protected, as proximad does) or "slru:SHARE".
// kInvalidArgument naming the policy otherwise, or when capacity is 0.
absl::StatusOr<std::unique_ptr<CachePolicy>> MakeCachePolicy(std::string_view policy,
                                                             size_t capacity);

// The policies MakeCachePolicy knows, in the order reports list them.
const std::vector<std::string>& CachePolicyNames();

enum class TouchOrder {
  kChainOrder,     // as proximad does today: first block of the chain touched first
  kChainHeadLast,  // deepest block first, so the chain's head is the most recent
};

struct SimulatedCounts {
  uint64_t requests = 0;
  uint64_t block_refs = 0;
  uint64_t hits = 0;  // leading ids present at lookup
  uint64_t puts_stored = 0;
  uint64_t puts_already_present = 0;
  uint64_t evictions = 0;
  uint64_t held = 0;  // blocks resident at the end

  double hit_ratio() const { return block_refs == 0 ? 0 : static_cast<double>(hits) / block_refs; }
};

SimulatedCounts Simulate(const std::vector<TraceRequest>& requests, CachePolicy& cache,
                         TouchOrder order = TouchOrder::kChainOrder);

}  // namespace proxima::replay

#endif  // PROXIMA_TOOLS_REPLAY_POLICY_SIM_H_
