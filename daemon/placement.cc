#include "daemon/placement.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace proxima::daemon {
namespace {

// The splitmix64 finalizer: a bijection on 64 bits with full avalanche.
uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

uint64_t LoadLittleEndian(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

uint64_t StableHash64(std::span<const uint8_t> bytes, uint64_t seed) {
  // Word-at-a-time with a full mix per word; bytes are read little-endian explicitly so that
  // big- and little-endian machines agree.
  uint64_t h = Mix64(seed ^ (0x9e3779b97f4a7c15ull * (bytes.size() + 1)));
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) h = Mix64(h ^ Mix64(LoadLittleEndian(&bytes[i], 8)));
  if (i < bytes.size()) {
    h = Mix64(h ^ Mix64(LoadLittleEndian(&bytes[i], bytes.size() - i) ^ 0xff00000000000000ull));
  }
  return h;
}

uint64_t StableHash64(std::string_view bytes, uint64_t seed) {
  return StableHash64(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()),
      seed);
}

uint64_t PlacementHash(std::string_view name_space, std::span<const uint8_t> key) {
  return StableHash64(key, StableHash64(name_space));
}

double RendezvousScore(uint64_t node_hash, double weight, uint64_t placement_hash) {
  if (!(weight > 0)) return -std::numeric_limits<double>::infinity();
  // u uniform in (0, 1): the top 53 bits, offset by half a step so that neither 0 nor 1 occurs.
  const uint64_t bits = Mix64(node_hash ^ Mix64(placement_hash)) >> 11;
  const double u = (static_cast<double>(bits) + 0.5) * 0x1.0p-53;
  return -weight / std::log(u);
}

std::vector<size_t> RankNodes(std::span<const PlacementNode> nodes, uint64_t placement_hash,
                              size_t count) {
  struct Scored {
    double score;
    size_t index;
  };
  std::vector<Scored> scored;
  scored.reserve(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (!(nodes[i].weight > 0)) continue;
    scored.push_back({RendezvousScore(StableHash64(nodes[i].id), nodes[i].weight,
                                      placement_hash),
                      i});
  }
  count = std::min(count, scored.size());
  auto better = [](const Scored& a, const Scored& b) {
    return a.score != b.score ? a.score > b.score : a.index < b.index;
  };
  std::partial_sort(scored.begin(), scored.begin() + static_cast<std::ptrdiff_t>(count),
                    scored.end(), better);
  std::vector<size_t> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = scored[i].index;
  return out;
}

size_t HomeNode(std::span<const PlacementNode> nodes, uint64_t placement_hash) {
  std::vector<size_t> best = RankNodes(nodes, placement_hash, 1);
  return best.empty() ? nodes.size() : best[0];
}

}  // namespace proxima::daemon
