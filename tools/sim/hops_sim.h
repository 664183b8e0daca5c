// Read hops under the put-local + home-record design (DESIGN.md section 6), replayed on the trace.
//
// Model, one event at a time in trace order:
// - Request r is served by worker node WorkerNode(r) (routing below) and walks its hash_ids.
// - A block already stored somewhere is a hit. Its read costs:
//     locate hops: 0 when the worker holds the block or is its home (the location record is
//                  local), else 1 (ask the home);
//     read hops:   remote nodes contacted to get the bytes: 0 when the worker holds the block;
//                  1 when the worker is the home (record local, fetch from the holder) or the
//                  home holds the block itself; 2 when the home (record) and the holder are two
//                  other nodes.
//   The hit refreshes the block's recency on its holder; no second copy is made.
// - A block stored nowhere is a miss (its lookup costs 0 hops when the worker is its home, else
//   1); the worker computes it and puts it locally.
// - Capacity pressure (capacity_blocks > 0): a put into a full node first makes room. The
//   node's least recently used block goes: a block the node produced spills to the first of
//   its key's top `spill_candidates` rendezvous nodes (other than this one) with free room,
//   entering that node as its coldest block; a block that had already spilled in, or one that
//   finds no room, is evicted (dropped, and with it its location record).
// - Homes use the same nodes and weights as placement (HomeNode).
//
// Baseline in the same pass: the same hits if every block lived on its home node (put at home,
// no location record): 0 hops when the worker is the home, else 1.
//
// Thread-safety: pure function.
#ifndef PROXIMA_TOOLS_SIM_HOPS_SIM_H_
#define PROXIMA_TOOLS_SIM_HOPS_SIM_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/placement.h"
#include "tools/replay/trace.h"

namespace proxima::sim {

// How requests are spread over worker nodes.
enum class Routing {
  // Request i goes to node i % N: a load balancer without prefix affinity, the worst case for
  // locality (a conversation's turns land on different nodes).
  kRoundRobin,
  // By a stable hash of the request's prefix family (its second hash_id, or its first when it
  // has one; trace.h's families): a prefix-aware router keeps a conversation on one node. The
  // first hash_id is not used: every request of the Mooncake trace starts with id 0.
  kPrefixFamily,
};
std::string_view RoutingName(Routing routing);
absl::StatusOr<Routing> ParseRouting(std::string_view name);

// The worker node (< nodes) of request number `index`, `request`.
size_t WorkerNode(const replay::TraceRequest& request, size_t index, size_t nodes, Routing routing);

struct HopsOptions {
  Routing routing = Routing::kRoundRobin;
  size_t capacity_blocks = 0;   // per node; 0: unlimited (no pressure)
  size_t spill_candidates = 3;  // 0: never spill, evict
  std::string name_space = "default";
};

struct HopsResult {
  uint64_t block_refs = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  std::array<uint64_t, 3> read_hops{};         // hits by read hops 0, 1, 2
  std::array<uint64_t, 2> locate_hops{};       // hits by locate hops 0, 1
  std::array<uint64_t, 2> miss_locate_hops{};  // misses by lookup hops 0, 1
  uint64_t hits_on_spilled = 0;                // hits whose block had spilled to a peer
  uint64_t puts = 0;
  uint64_t spills = 0;
  uint64_t evictions = 0;
  uint64_t baseline_remote_hits = 0;  // hits whose worker is not the home (put-at-home: 1 hop)

  double hit_ratio() const { return block_refs == 0 ? 0 : static_cast<double>(hits) / block_refs; }
  double mean_read_hops() const;
  double baseline_mean_read_hops() const;
};

// kInvalidArgument when `nodes` is empty or has a node that cannot be a home (weight <= 0).
absl::StatusOr<HopsResult> SimulateHops(std::span<const daemon::PlacementNode> nodes,
                                        const std::vector<replay::TraceRequest>& requests,
                                        const HopsOptions& options);

}  // namespace proxima::sim

#endif  // PROXIMA_TOOLS_SIM_HOPS_SIM_H_
