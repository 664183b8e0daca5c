#include "tools/sim/placement_sim.h"

#include <algorithm>
#include <cmath>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace proxima::sim {
namespace {

using daemon::PlacementNode;

// Homes by modulo hashing: nodes[hash % nodes.size()].
std::vector<uint32_t> ModuloHomes(std::span<const PlacementNode> nodes,
                                  std::span<const uint64_t> placement_hashes) {
  std::vector<uint32_t> homes(placement_hashes.size());
  for (size_t i = 0; i < placement_hashes.size(); ++i) {
    homes[i] = static_cast<uint32_t>(placement_hashes[i] % nodes.size());
  }
  return homes;
}

// Compares two assignments of the same keys by node id; `changed` is the id that joined or left.
Moved Compare(std::span<const PlacementNode> before_nodes, const std::vector<uint32_t>& before,
              std::span<const PlacementNode> after_nodes, const std::vector<uint32_t>& after,
              const std::string& changed) {
  Moved m;
  m.keys = before.size();
  for (size_t i = 0; i < before.size(); ++i) {
    const std::string& from = before_nodes[before[i]].id;
    const std::string& to = after_nodes[after[i]].id;
    if (from == to) continue;
    ++m.moved;
    if (from != changed && to != changed) ++m.moved_between_others;
  }
  return m;
}

std::vector<PlacementNode> Joined(std::span<const PlacementNode> nodes, double new_weight) {
  std::vector<PlacementNode> out(nodes.begin(), nodes.end());
  out.push_back({SimNodeId(nodes.size()), new_weight});
  return out;
}

std::vector<PlacementNode> Without(std::span<const PlacementNode> nodes, size_t leaving) {
  std::vector<PlacementNode> out(nodes.begin(), nodes.end());
  out.erase(out.begin() + static_cast<std::ptrdiff_t>(leaving));
  return out;
}

}  // namespace

std::vector<uint8_t> TraceBlockKey(uint64_t hash_id) {
  std::vector<uint8_t> key(32, 0);
  for (int b = 0; b < 8; ++b) key[b] = static_cast<uint8_t>(hash_id >> (8 * b));
  return key;
}

uint64_t TraceBlockHash(std::string_view name_space, uint64_t hash_id) {
  return daemon::PlacementHash(name_space, TraceBlockKey(hash_id));
}

std::vector<uint64_t> DistinctBlocks(const std::vector<replay::TraceRequest>& requests) {
  std::vector<uint64_t> out;
  absl::flat_hash_set<uint64_t> seen;
  for (const replay::TraceRequest& r : requests) {
    for (uint64_t id : r.hash_ids) {
      if (seen.insert(id).second) out.push_back(id);
    }
  }
  return out;
}

std::string SimNodeId(size_t index) {
  const size_t n = index + 1;
  return absl::StrCat("10.", (n >> 16) & 0xff, ".", (n >> 8) & 0xff, ".", n & 0xff, ":50051");
}

std::vector<PlacementNode> MakeNodes(size_t count, double heavy_weight) {
  std::vector<PlacementNode> nodes;
  nodes.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    nodes.push_back({SimNodeId(i), i % 2 == 1 ? heavy_weight : 1.0});
  }
  return nodes;
}

std::vector<uint32_t> Homes(std::span<const PlacementNode> nodes,
                            std::span<const uint64_t> placement_hashes) {
  std::vector<uint32_t> homes(placement_hashes.size());
  for (size_t i = 0; i < placement_hashes.size(); ++i) {
    homes[i] = static_cast<uint32_t>(daemon::HomeNode(nodes, placement_hashes[i]));
  }
  return homes;
}

absl::StatusOr<Balance> MeasureBalance(std::span<const double> load,
                                       std::span<const double> weight) {
  if (load.size() != weight.size() || load.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("balance over ", load.size(), " loads and ",
                                                   weight.size(),
                                                   " weights; expected the same non-zero count"));
  }
  double total = 0, total_weight = 0;
  for (size_t i = 0; i < load.size(); ++i) {
    if (!(weight[i] > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("weight[", i, "] is ", weight[i], "; expected > 0"));
    }
    total += load[i];
    total_weight += weight[i];
  }
  if (!(total > 0)) return absl::InvalidArgumentError("total load is 0; nothing to balance");
  std::vector<double> normalized(load.size());
  for (size_t i = 0; i < load.size(); ++i) {
    normalized[i] = load[i] / (total * weight[i] / total_weight);
  }
  // A node's fair share is 1 (for equal weights, the mean), so max, p99 and min of the
  // normalized loads are the "over mean" figures; the spread is over nodes, as an operator sees
  // it.
  const double n = static_cast<double>(normalized.size());
  double sum = 0, sum_sq = 0;
  for (double x : normalized) {
    sum += x;
    sum_sq += x * x;
  }
  const double mean = sum / n;
  const double variance = std::max(0.0, sum_sq / n - mean * mean);
  std::sort(normalized.begin(), normalized.end());
  const size_t p99_rank = static_cast<size_t>(std::ceil(0.99 * n));  // nearest rank, 1-based
  Balance b;
  b.max_over_mean = normalized.back();
  b.min_over_mean = normalized.front();
  b.p99_over_mean = normalized[std::max<size_t>(p99_rank, 1) - 1];
  b.cv = std::sqrt(variance) / mean;
  return b;
}

Moved RendezvousMovedOnJoin(std::span<const PlacementNode> nodes,
                            std::span<const uint64_t> placement_hashes, double new_weight) {
  const std::vector<PlacementNode> after = Joined(nodes, new_weight);
  return Compare(nodes, Homes(nodes, placement_hashes), after, Homes(after, placement_hashes),
                 after.back().id);
}

Moved RendezvousMovedOnLeave(std::span<const PlacementNode> nodes,
                             std::span<const uint64_t> placement_hashes, size_t leaving) {
  const std::vector<PlacementNode> after = Without(nodes, leaving);
  return Compare(nodes, Homes(nodes, placement_hashes), after, Homes(after, placement_hashes),
                 nodes[leaving].id);
}

Moved ModuloMovedOnJoin(std::span<const PlacementNode> nodes,
                        std::span<const uint64_t> placement_hashes) {
  const std::vector<PlacementNode> after = Joined(nodes, 1.0);
  return Compare(nodes, ModuloHomes(nodes, placement_hashes), after,
                 ModuloHomes(after, placement_hashes), after.back().id);
}

Moved ModuloMovedOnLeave(std::span<const PlacementNode> nodes,
                         std::span<const uint64_t> placement_hashes, size_t leaving) {
  const std::vector<PlacementNode> after = Without(nodes, leaving);
  return Compare(nodes, ModuloHomes(nodes, placement_hashes), after,
                 ModuloHomes(after, placement_hashes), nodes[leaving].id);
}

absl::Status CheckMovedFraction(const Moved& moved, double p, double z) {
  const double keys = static_cast<double>(moved.keys);
  const double expected = keys * p;
  const double sigma = std::sqrt(keys * p * (1 - p));
  const double deviation = std::abs(static_cast<double>(moved.moved) - expected);
  if (moved.keys == 0 || deviation > z * sigma) {
    return absl::OutOfRangeError(absl::StrFormat(
        "%d of %d keys moved (fraction %.6f); ideal %.6f expects %.1f +- %.1f (%.1f sigma)",
        moved.moved, moved.keys, moved.fraction(), p, expected, z * sigma, z));
  }
  return absl::OkStatus();
}

}  // namespace proxima::sim
