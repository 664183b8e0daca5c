// Deterministic test blocks and key chains, shared by proximactl, the benchmarks and the tests:
// anyone who knows (seed, index) can regenerate a block and check what came back byte for byte.
//
// Keys form a chain like an inference engine's: key[i] = H(key[i-1], seed, i), so a chain's
// keys are distinct, and two seeds never share keys. Thread-safe (pure functions).
#ifndef PROXIMA_CLIENT_TEST_PATTERN_H_
#define PROXIMA_CLIENT_TEST_PATTERN_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "client/client.h"

namespace proxima::client {

// Keys [first, first + count) of the chain named by `seed`.
std::vector<BlockKey> TestKeyChain(uint64_t seed, size_t first, size_t count);

// Fills `out` with the pseudo-random content of block `index` of chain `seed`.
void FillTestBlock(uint64_t seed, size_t index, std::span<std::byte> out);

// True when `data` is exactly block `index` of chain `seed`.
bool IsTestBlock(uint64_t seed, size_t index, std::span<const std::byte> data);

// A block buffer of a load client (proximactl load, the benchmarks): ordinary memory registered
// once with RegisterMemory, as a worker registers its KV cache, or memory UCX allocated
// (AllocateMemory). Drop it before `client`.
struct TestBuffer {
  std::vector<std::byte> heap;  // the memory, when not UCX-allocated
  MemoryRegion region;
  std::span<std::byte> bytes;
};
absl::StatusOr<TestBuffer> MakeTestBuffer(Client& client, size_t bytes, bool ucx_allocated);

}  // namespace proxima::client

#endif  // PROXIMA_CLIENT_TEST_PATTERN_H_
