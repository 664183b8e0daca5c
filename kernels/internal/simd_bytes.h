// Unaligned little-endian payload access for the SIMD codec files (simd_avx2.cc,
// simd_avx512.cc), in an unnamed namespace on purpose: each of those files is compiled for its
// own instruction set, and these helpers must get internal linkage in each, never one link-once
// copy that the linker could hand to code running on a CPU without that instruction set (see
// the files' "ISA isolation" comments; kernels_simd_isolation_test checks the objects). Include
// only from those files. Thread-safety: pure functions.
#ifndef PROXIMA_KERNELS_INTERNAL_SIMD_BYTES_H_
#define PROXIMA_KERNELS_INTERNAL_SIMD_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace proxima::codec::internal {
namespace {  // NOLINT(build/namespaces): internal linkage per including file, see above

[[maybe_unused]] uint16_t Get16(const std::byte* p, size_t i) {
  uint16_t v;
  std::memcpy(&v, p + 2 * i, 2);
  return v;
}
[[maybe_unused]] float GetF32(const std::byte* p, size_t i) {
  float v;
  std::memcpy(&v, p + 4 * i, 4);
  return v;
}
[[maybe_unused]] void PutF32(std::byte* p, size_t i, float v) { std::memcpy(p + 4 * i, &v, 4); }
[[maybe_unused]] uint32_t MinU32(uint32_t a, uint32_t b) { return a < b ? a : b; }

}  // namespace
}  // namespace proxima::codec::internal

#endif  // PROXIMA_KERNELS_INTERNAL_SIMD_BYTES_H_
