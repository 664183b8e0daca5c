// Placement: which node is a block's home in a cluster of proximad peers.
//
// Rendezvous (highest-random-weight) hashing of (namespace, key) over the live peers: every node
// gets a pseudo-random score per key and the highest score wins. When a node joins or leaves,
// only the keys it wins (or won) move, about 1/N of them, and every daemon that sees the same
// live set computes the same home with no coordination. Scores are weighted by a node's
// capacity with the logarithmic method (score = -weight / ln(u), u uniform in (0, 1)), so a
// node with twice the memory is home to twice the keys.
//
// Everything here is a pure function of its arguments and stable across processes, builds and
// machines (no per-process hash seed), because two daemons must agree on a key's home.
// Thread-safe: no state.
#ifndef PROXIMA_DAEMON_PLACEMENT_H_
#define PROXIMA_DAEMON_PLACEMENT_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace proxima::daemon {

// A 64-bit hash of `bytes` that is the same in every process and on every machine.
uint64_t StableHash64(std::span<const uint8_t> bytes, uint64_t seed = 0);
uint64_t StableHash64(std::string_view bytes, uint64_t seed = 0);

// The hash a block is placed by: its namespace and its 32-byte key (keys are unique only inside
// a namespace, so the namespace takes part).
uint64_t PlacementHash(std::string_view name_space, std::span<const uint8_t> key);

// A candidate node. `id` must be the same string on every daemon (the peer's advertised
// address, e.g. "10.0.0.7:50051"); `weight` > 0, e.g. the node's capacity in GiB.
struct PlacementNode {
  std::string id;
  double weight = 1.0;
};

// The node's score for a key; higher wins. `node_hash` = StableHash64(node.id).
double RendezvousScore(uint64_t node_hash, double weight, uint64_t placement_hash);

// The `count` best nodes for a key, best first, as indices into `nodes` (fewer when `nodes` has
// fewer). Ties (equal scores, practically never) go to the lower index. Nodes with weight <= 0
// are never chosen.
std::vector<size_t> RankNodes(std::span<const PlacementNode> nodes, uint64_t placement_hash,
                              size_t count);

// The home node of a key: RankNodes(..., 1)[0]; nodes.size() when no node can be chosen.
size_t HomeNode(std::span<const PlacementNode> nodes, uint64_t placement_hash);

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_PLACEMENT_H_
