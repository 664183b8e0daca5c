// The CRC32C polynomial's arithmetic, shared by the host CRC (common/crc32c.cc, which combines the
// CRCs of pieces checksummed apart) and the batched GPU CRC (kernels/internal/crc32c_math.h): the
// reflected polynomial and multiplication modulo it. Pure functions; compiles as device code
// under nvcc (C++17, no std::span).
//
// The CRC register read as a polynomial of degree < 32 over GF(2), reflected: bit 31 is x^0 and
// bit 0 is x^31. Feeding n zero bytes into a raw register v multiplies it by x^(8n) mod P.
#ifndef PROXIMA_COMMON_CRC32C_POLY_H_
#define PROXIMA_COMMON_CRC32C_POLY_H_

#include <cstdint>

#if defined(__CUDACC__)
#define PROXIMA_CRC_HD __host__ __device__ __forceinline__
#else
#define PROXIMA_CRC_HD inline
#endif

namespace proxima::crc32c_poly {

inline constexpr uint32_t kPolyReflected = 0x82F63B78u;
// x^0 in the reflected representation: the multiplicative identity.
inline constexpr uint32_t kOne = 0x80000000u;

// a * b mod P, both in the reflected representation.
PROXIMA_CRC_HD uint32_t MulModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (int i = 0; i < 32; ++i) {  // i: the power of x whose coefficient in a is bit 31 - i
    product ^= (0u - ((a >> (31 - i)) & 1u)) & b;
    b = (b >> 1) ^ ((0u - (b & 1u)) & kPolyReflected);  // b *= x
  }
  return product;
}

}  // namespace proxima::crc32c_poly

#endif  // PROXIMA_COMMON_CRC32C_POLY_H_
