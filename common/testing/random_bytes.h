// RandomBytes: reproducible random test data (a seeded Mersenne twister), for tests that need
// bytes with no structure a codec or copy could lean on.
#ifndef PROXIMA_COMMON_TESTING_RANDOM_BYTES_H_
#define PROXIMA_COMMON_TESTING_RANDOM_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace proxima::testing {

inline std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

}  // namespace proxima::testing

#endif  // PROXIMA_COMMON_TESTING_RANDOM_BYTES_H_
