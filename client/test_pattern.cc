#include "client/test_pattern.h"

#include <cstring>

namespace proxima::client {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

BlockKey NextKey(const BlockKey& parent, uint64_t seed, size_t index) {
  uint64_t state = seed ^ (0xA5A5A5A5ull * (index + 1));
  for (size_t i = 0; i < kKeyBytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, parent.data() + i, 8);
    state ^= word;
    SplitMix64(state);
  }
  BlockKey key;
  for (size_t i = 0; i < kKeyBytes; i += 8) {
    uint64_t word = SplitMix64(state);
    std::memcpy(key.data() + i, &word, 8);
  }
  return key;
}

uint64_t BlockState(uint64_t seed, size_t index) {
  uint64_t s = seed * 0x2545F4914F6CDD1Dull + index;
  return SplitMix64(s);
}

}  // namespace

std::vector<BlockKey> TestKeyChain(uint64_t seed, size_t first, size_t count) {
  std::vector<BlockKey> keys;
  keys.reserve(count);
  BlockKey key{};
  for (size_t i = 0; i < first + count; ++i) {
    key = NextKey(key, seed, i);
    if (i >= first) keys.push_back(key);
  }
  return keys;
}

void FillTestBlock(uint64_t seed, size_t index, std::span<std::byte> out) {
  uint64_t state = BlockState(seed, index);
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    uint64_t word = SplitMix64(state);
    std::memcpy(out.data() + i, &word, 8);
  }
  uint64_t word = SplitMix64(state);
  std::memcpy(out.data() + i, &word, out.size() - i);
}

bool IsTestBlock(uint64_t seed, size_t index, std::span<const std::byte> data) {
  uint64_t state = BlockState(seed, index);
  size_t i = 0;
  for (; i + 8 <= data.size(); i += 8) {
    uint64_t word = SplitMix64(state);
    if (std::memcmp(data.data() + i, &word, 8) != 0) return false;
  }
  uint64_t word = SplitMix64(state);
  return std::memcmp(data.data() + i, &word, data.size() - i) == 0;
}

absl::StatusOr<TestBuffer> MakeTestBuffer(Client& client, size_t bytes, bool ucx_allocated) {
  TestBuffer b;
  if (ucx_allocated) {
    absl::StatusOr<MemoryRegion> r = client.AllocateMemory(bytes);
    if (!r.ok()) return r.status();
    b.region = *std::move(r);
    b.bytes = b.region.bytes();
    return b;
  }
  b.heap.resize(bytes);
  b.bytes = b.heap;  // a vector's buffer stays put when the TestBuffer moves
  absl::StatusOr<MemoryRegion> r = client.RegisterMemory(b.heap.data(), bytes);
  if (r.ok()) b.region = *std::move(r);  // unregistered: registered per call instead
  return b;
}

}  // namespace proxima::client
