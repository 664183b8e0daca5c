// Offline simulation of cluster placement (DESIGN.md section 6) on the Mooncake trace: how evenly
// rendezvous hashing (daemon/placement.h) spreads blocks over N nodes, how many keys change home
// when one node joins or leaves (against modulo hashing measured on the same keys), and how many
// hops a read costs under the put-local + home-record design (hops_sim.h).
//
// Blocks are the trace's hash_ids (one 512-token prefix block each). A trace id becomes a 32-byte
// block key holding the id little-endian in its first 8 bytes (the rest zero); placement depends
// only on PlacementHash(namespace, key), which mixes every key bit, so any one-to-one mapping of
// ids to keys gives the same statistics as the clients' chain-hash keys.
//
// Every result is computed with the daemon's own functions (HomeNode, RankNodes): the simulation
// measures what proximad would do, it does not model it with a formula.
//
// Thread-safety: pure functions.
#ifndef PROXIMA_TOOLS_SIM_PLACEMENT_SIM_H_
#define PROXIMA_TOOLS_SIM_PLACEMENT_SIM_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/placement.h"
#include "tools/replay/trace.h"

namespace proxima::sim {

// The 32-byte block key the simulation gives trace id `hash_id`.
std::vector<uint8_t> TraceBlockKey(uint64_t hash_id);

// PlacementHash(name_space, TraceBlockKey(hash_id)).
uint64_t TraceBlockHash(std::string_view name_space, uint64_t hash_id);

// The trace's distinct hash_ids in order of first reference.
std::vector<uint64_t> DistinctBlocks(const std::vector<replay::TraceRequest>& requests);

// Node `index`'s id, as a peer's advertised address: "10.<b2>.<b1>.<b0>:50051" with the bytes of
// index + 1 (so 0 is "10.0.0.1:50051"); distinct for index < 2^24 - 1.
std::string SimNodeId(size_t index);

// `count` nodes SimNodeId(0..count-1). Node i has weight 1 when `heavy_weight` is 1, else weight
// 1 for even i and `heavy_weight` for odd i (a cluster of two machine sizes, half each).
std::vector<daemon::PlacementNode> MakeNodes(size_t count, double heavy_weight = 1.0);

// The home node (index into `nodes`) of each key; `nodes` must be able to choose one.
std::vector<uint32_t> Homes(std::span<const daemon::PlacementNode> nodes,
                            std::span<const uint64_t> placement_hashes);

// Spread of per-node load. Each load is normalized by the node's fair share for its weight,
// load_i / (total * weight_i / total_weight), so 1 is fair (with equal weights: the mean) and
// the figures below are "over fair share". Percentiles are nearest-rank over nodes.
struct Balance {
  double max_over_mean = 0;  // largest normalized load
  double p99_over_mean = 0;  // 99th percentile normalized load
  double min_over_mean = 0;  // smallest normalized load
  double cv = 0;  // coefficient of variation (population stddev / mean) of the normalized loads
};
// kInvalidArgument when the spans differ in size, are empty, or a weight is not > 0.
absl::StatusOr<Balance> MeasureBalance(std::span<const double> load,
                                       std::span<const double> weight);

// Keys whose home changed when one node joined or left; homes are compared by node id, so the
// index shift of a leave does not count as a move.
struct Moved {
  uint64_t keys = 0;
  uint64_t moved = 0;
  // Moved keys that neither came from nor went to the node that joined or left. Rendezvous
  // hashing promises 0; modulo hashing moves almost everything.
  uint64_t moved_between_others = 0;
  double fraction() const { return keys == 0 ? 0 : static_cast<double>(moved) / keys; }
};

// Join: `nodes` plus SimNodeId(nodes.size()) with weight `new_weight`, homes by rendezvous.
Moved RendezvousMovedOnJoin(std::span<const daemon::PlacementNode> nodes,
                            std::span<const uint64_t> placement_hashes, double new_weight = 1.0);
// Leave: `nodes` without nodes[leaving].
Moved RendezvousMovedOnLeave(std::span<const daemon::PlacementNode> nodes,
                             std::span<const uint64_t> placement_hashes, size_t leaving);
// The baseline on the same node lists: home = nodes[hash % nodes.size()].
Moved ModuloMovedOnJoin(std::span<const daemon::PlacementNode> nodes,
                        std::span<const uint64_t> placement_hashes);
Moved ModuloMovedOnLeave(std::span<const daemon::PlacementNode> nodes,
                         std::span<const uint64_t> placement_hashes, size_t leaving);

// True when `moved` of `keys` is within `z` binomial standard deviations of keys * p (each key
// moves independently with probability p under ideal hashing: p = 1/(N+1) for a join of an
// equal node, 1/N for a leave). Not OK names the numbers when it is not.
absl::Status CheckMovedFraction(const Moved& moved, double p, double z);

}  // namespace proxima::sim

#endif  // PROXIMA_TOOLS_SIM_PLACEMENT_SIM_H_
