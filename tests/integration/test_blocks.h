// Test blocks, clients and metric parsing shared by the integration tests (real proximad on
// loopback, driven through libproxima).
#ifndef PROXIMA_TESTS_INTEGRATION_TEST_BLOCKS_H_
#define PROXIMA_TESTS_INTEGRATION_TEST_BLOCKS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/testing/metric_value.h"  // MetricValue, for the tests that include this

namespace proxima::testing {

// 4 layers x `tokens` tokens x 8 heads x 128 dim x bf16 x (K, V): 256 KiB blocks at 16 tokens.
v1::ModelProfile TestModel(uint32_t tokens = 16, std::string fingerprint = "it-model");

// Connects with a 20 s call deadline; fails the test (and returns null) when it cannot.
std::unique_ptr<client::Client> MustConnect(const std::string& target,
                                            const std::string& ns = "default",
                                            const std::string& token = "");

// Blocks [first, first + count) of the test chain `seed` (client/test_pattern.h).
struct Blocks {
  std::vector<client::BlockKey> keys;
  std::vector<std::vector<std::byte>> data;
  std::vector<std::span<const std::byte>> spans() const { return {data.begin(), data.end()}; }
};
Blocks MakeBlocks(uint64_t seed, size_t first, size_t count, uint64_t block_bytes);

// Gets blocks [first, first+count) of chain `seed`; returns how many came back, and fails the
// test if any came back wrong.
size_t GetAndCheck(client::Client& c, const client::Profile& p, uint64_t seed, size_t first,
                   size_t count);

}  // namespace proxima::testing

#endif  // PROXIMA_TESTS_INTEGRATION_TEST_BLOCKS_H_
