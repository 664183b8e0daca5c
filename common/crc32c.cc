#include "common/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace proxima {
namespace {

constexpr uint32_t kPolyReflected = 0x82F63B78u;

// kTables[k][b]: CRC contribution of byte b followed by k zero bytes (slicing-by-8).
using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables MakeTables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t crc = b;
    for (int i = 0; i < 8; ++i) crc = (crc >> 1) ^ ((crc & 1u) ? kPolyReflected : 0u);
    t[0][b] = crc;
  }
  for (uint32_t b = 0; b < 256; ++b) {
    for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
  return t;
}

constexpr Tables kTables = MakeTables();

uint32_t ExtendRawPortable(uint32_t crc, const uint8_t* p, size_t n) {
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian hosts only (x86-64, aarch64)
    word ^= crc;
    crc = kTables[7][word & 0xFF] ^ kTables[6][(word >> 8) & 0xFF] ^
          kTables[5][(word >> 16) & 0xFF] ^ kTables[4][(word >> 24) & 0xFF] ^
          kTables[3][(word >> 32) & 0xFF] ^ kTables[2][(word >> 40) & 0xFF] ^
          kTables[1][(word >> 48) & 0xFF] ^ kTables[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ kTables[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t ExtendRawSse42(uint32_t crc, const uint8_t* p,
                                                           size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

bool DetectSse42() { return __builtin_cpu_supports("sse4.2"); }
#else
bool DetectSse42() { return false; }
#endif

using ExtendFn = uint32_t (*)(uint32_t, const uint8_t*, size_t);

ExtendFn ChooseExtend() {
#if defined(__x86_64__)
  if (DetectSse42()) return &ExtendRawSse42;
#endif
  return &ExtendRawPortable;
}

const ExtendFn kExtend = ChooseExtend();

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, std::span<const std::byte> data) {
  return ~kExtend(~crc, reinterpret_cast<const uint8_t*>(data.data()), data.size());
}

uint32_t Crc32c(std::span<const std::byte> data) { return Crc32cExtend(0, data); }

uint32_t Crc32cExtendPortable(uint32_t crc, std::span<const std::byte> data) {
  return ~ExtendRawPortable(~crc, reinterpret_cast<const uint8_t*>(data.data()), data.size());
}

bool Crc32cIsHardwareAccelerated() { return DetectSse42(); }

}  // namespace proxima
