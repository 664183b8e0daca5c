#include "tools/sim/hops_sim.h"

#include <list>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "tools/sim/placement_sim.h"

namespace proxima::sim {
namespace {

constexpr uint32_t kNowhere = UINT32_MAX;

struct Block {
  uint64_t placement_hash = 0;
  uint32_t home = 0;
  uint32_t holder = kNowhere;              // kNowhere: not stored
  bool guest = false;                      // spilled in from the node that produced it
  std::list<uint64_t>::iterator position;  // in holders[holder], valid while stored
};

class Cluster {
 public:
  Cluster(std::span<const daemon::PlacementNode> nodes, const HopsOptions& options)
      : nodes_(nodes), options_(options), lru_(nodes.size()) {}

  void Serve(const replay::TraceRequest& request, size_t index, HopsResult& result) {
    const uint32_t worker =
        static_cast<uint32_t>(WorkerNode(request, index, nodes_.size(), options_.routing));
    for (uint64_t id : request.hash_ids) {
      ++result.block_refs;
      Block& block = Find(id);
      if (block.holder != kNowhere) {
        ++result.hits;
        const bool local = block.holder == worker;
        const bool record_local = block.home == worker;
        ++result.locate_hops[local || record_local ? 0 : 1];
        ++result.read_hops[local ? 0 : (record_local || block.holder == block.home) ? 1 : 2];
        if (block.guest) ++result.hits_on_spilled;
        if (!record_local) ++result.baseline_remote_hits;
        std::list<uint64_t>& list = lru_[block.holder];
        list.splice(list.begin(), list, block.position);  // most recent first
        continue;
      }
      ++result.misses;
      ++result.miss_locate_hops[block.home == worker ? 0 : 1];
      ++result.puts;
      if (options_.capacity_blocks > 0 && lru_[worker].size() >= options_.capacity_blocks) {
        MakeRoom(worker, result);
      }
      Store(id, block, worker, /*guest=*/false, /*coldest=*/false);
    }
  }

 private:
  Block& Find(uint64_t id) {
    auto [it, inserted] = blocks_.try_emplace(id);
    if (inserted) {
      it->second.placement_hash = TraceBlockHash(options_.name_space, id);
      it->second.home = static_cast<uint32_t>(daemon::HomeNode(nodes_, it->second.placement_hash));
    }
    return it->second;
  }

  void Store(uint64_t id, Block& block, uint32_t node, bool guest, bool coldest) {
    std::list<uint64_t>& list = lru_[node];
    block.position = list.insert(coldest ? list.end() : list.begin(), id);
    block.holder = node;
    block.guest = guest;
  }

  void Remove(Block& block) {
    lru_[block.holder].erase(block.position);
    block.holder = kNowhere;
    block.guest = false;
  }

  // Frees one slot on `node` (full): spills or evicts its least recently used block.
  void MakeRoom(uint32_t node, HopsResult& result) {
    const uint64_t victim_id = lru_[node].back();
    Block& victim = blocks_.find(victim_id)->second;
    Remove(victim);
    if (!victim.guest && options_.spill_candidates > 0) {
      const std::vector<size_t> ranked =
          daemon::RankNodes(nodes_, victim.placement_hash, options_.spill_candidates + 1);
      size_t tried = 0;
      for (size_t candidate : ranked) {
        if (candidate == node) continue;
        if (tried++ == options_.spill_candidates) break;
        if (lru_[candidate].size() < options_.capacity_blocks) {
          ++result.spills;
          Store(victim_id, victim, static_cast<uint32_t>(candidate), /*guest=*/true,
                /*coldest=*/true);
          return;
        }
      }
    }
    ++result.evictions;
  }

  std::span<const daemon::PlacementNode> nodes_;
  const HopsOptions& options_;
  std::vector<std::list<uint64_t>> lru_;  // per node, most recently used first
  absl::flat_hash_map<uint64_t, Block> blocks_;
};

}  // namespace

std::string_view RoutingName(Routing routing) {
  return routing == Routing::kRoundRobin ? "round_robin" : "prefix_family";
}

absl::StatusOr<Routing> ParseRouting(std::string_view name) {
  if (name == "round_robin") return Routing::kRoundRobin;
  if (name == "prefix_family") return Routing::kPrefixFamily;
  return absl::InvalidArgumentError(absl::StrCat(
      "routing '", std::string(name), "' is unknown; expected round_robin or prefix_family"));
}

size_t WorkerNode(const replay::TraceRequest& request, size_t index, size_t nodes,
                  Routing routing) {
  if (routing == Routing::kRoundRobin) return index % nodes;
  const uint64_t family = request.hash_ids.size() > 1 ? request.hash_ids[1] : request.hash_ids[0];
  uint8_t bytes[8];
  for (int b = 0; b < 8; ++b) bytes[b] = static_cast<uint8_t>(family >> (8 * b));
  return daemon::StableHash64(std::span<const uint8_t>(bytes, 8)) % nodes;
}

double HopsResult::mean_read_hops() const {
  return hits == 0 ? 0 : static_cast<double>(read_hops[1] + 2 * read_hops[2]) / hits;
}

double HopsResult::baseline_mean_read_hops() const {
  return hits == 0 ? 0 : static_cast<double>(baseline_remote_hits) / hits;
}

absl::StatusOr<HopsResult> SimulateHops(std::span<const daemon::PlacementNode> nodes,
                                        const std::vector<replay::TraceRequest>& requests,
                                        const HopsOptions& options) {
  if (nodes.empty()) return absl::InvalidArgumentError("no nodes; expected at least one");
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (!(nodes[i].weight > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("node ", i, " (", nodes[i].id, ") has weight ",
                                                     nodes[i].weight, "; expected > 0"));
    }
  }
  HopsResult result;
  Cluster cluster(nodes, options);
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i].hash_ids.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("request ", i, " has no hash_ids"));
    }
    cluster.Serve(requests[i], i, result);
  }
  return result;
}

}  // namespace proxima::sim
