#include "common/crc32c.h"

#include <array>
#include <cstring>
#include <vector>

#include "common/crc32c_poly.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#elif defined(__aarch64__)
#include <arm_acle.h>
#include <sys/auxv.h>
#endif

namespace proxima {
namespace {

using crc32c_poly::kPolyReflected;

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

// The CRC register's update is linear over GF(2): extending state s by L zero bytes is a fixed
// 32x32 matrix M_L applied to s. Three independent lanes of L bytes then combine as
//   crc(s, A|B|C) = M_L(M_L(crc(s, A)) ^ crc(0, B)) ^ crc(0, C),
// which lets the CPU run three crc32 chains at once (the instruction has 3-cycle latency but
// 1-cycle throughput). kShiftTables[k][v] = M_L applied to (v << 8k).
constexpr size_t kLane = 8192;

struct ShiftTables {
  uint32_t t[4][256];
};

ShiftTables MakeShiftTables() {
  std::vector<uint8_t> zeros(kLane, 0);
  uint32_t basis[32];
  for (int bit = 0; bit < 32; ++bit) basis[bit] = ExtendRawPortable(1u << bit, zeros.data(), kLane);
  ShiftTables st{};
  for (int k = 0; k < 4; ++k) {
    for (uint32_t v = 0; v < 256; ++v) {
      uint32_t r = 0;
      for (int bit = 0; bit < 8; ++bit) {
        if (v & (1u << bit)) r ^= basis[8 * k + bit];
      }
      st.t[k][v] = r;
    }
  }
  return st;
}

const ShiftTables kShift = MakeShiftTables();

inline uint32_t ShiftLane(uint32_t c) {
  return kShift.t[0][c & 0xFF] ^ kShift.t[1][(c >> 8) & 0xFF] ^ kShift.t[2][(c >> 16) & 0xFF] ^
         kShift.t[3][c >> 24];
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t ExtendRawSse42(uint32_t crc, const uint8_t* p,
                                                           size_t n) {
  while (n >= 3 * kLane) {
    uint64_t a = crc, b = 0, c = 0;
    const uint8_t* pa = p;
    const uint8_t* pb = p + kLane;
    const uint8_t* pc = p + 2 * kLane;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t wa, wb, wc;
      std::memcpy(&wa, pa + i, 8);
      std::memcpy(&wb, pb + i, 8);
      std::memcpy(&wc, pc + i, 8);
      a = _mm_crc32_u64(a, wa);
      b = _mm_crc32_u64(b, wb);
      c = _mm_crc32_u64(c, wc);
    }
    crc = ShiftLane(ShiftLane(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^
          static_cast<uint32_t>(c);
    p += 3 * kLane;
    n -= 3 * kLane;
  }
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

bool DetectHardware() { return __builtin_cpu_supports("sse4.2"); }
#elif defined(__aarch64__)
// ARMv8's CRC32 extension (every ARMv8.1 and later core: Neoverse, Grace), 8 bytes per
// instruction in one chain; its throughput is well above a core's share of memory bandwidth, so
// the lanes above are not repeated here.
__attribute__((target("+crc"))) uint32_t ExtendRawArmCrc(uint32_t crc, const uint8_t* p, size_t n) {
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    crc = __crc32cd(crc, word);
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = __crc32cb(crc, *p++);
  return crc;
}

bool DetectHardware() {
#if defined(HWCAP_CRC32)
  return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
#else
  return false;
#endif
}
#else
bool DetectHardware() { return false; }
#endif

using ExtendFn = uint32_t (*)(uint32_t, const uint8_t*, size_t);

ExtendFn ChooseExtend() {
  if (DetectHardware()) {
#if defined(__x86_64__)
    return &ExtendRawSse42;
#elif defined(__aarch64__)
    return &ExtendRawArmCrc;
#endif
  }
  return &ExtendRawPortable;
}

const ExtendFn kExtend = ChooseExtend();

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, std::span<const std::byte> data) {
  return ~kExtend(~crc, reinterpret_cast<const uint8_t*>(data.data()), data.size());
}

uint32_t Crc32c(std::span<const std::byte> data) { return Crc32cExtend(0, data); }

uint32_t Crc32cCopy(std::span<std::byte> dst, std::span<const std::byte> src, uint32_t crc_in) {
  // Chunks of three lanes: each chunk is checksummed right after it is copied, while it is still
  // in cache, so the bytes cross the memory bus once for both jobs.
  constexpr size_t kChunk = 3 * kLane;
  uint32_t crc = ~crc_in;
  const uint8_t* s = reinterpret_cast<const uint8_t*>(src.data());
  uint8_t* d = reinterpret_cast<uint8_t*>(dst.data());
  size_t n = src.size();
  while (n > 0) {
    size_t len = n < kChunk ? n : kChunk;
    std::memcpy(d, s, len);
    crc = kExtend(crc, d, len);
    s += len;
    d += len;
    n -= len;
  }
  return ~crc;
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // Crc32c(a ++ b) = crc_a * x^(8 |b|) mod P ^ crc_b (the conditioning of the two CRCs cancels:
  // see kernels/internal/crc32c_math.h). kPow[k] = x^(8 * 2^k) mod P.
  static const std::array<uint32_t, 64> kPow = [] {
    std::array<uint32_t, 64> p{};
    p[0] = crc32c_poly::kOne >> 8;  // x^8
    for (size_t k = 1; k < p.size(); ++k) p[k] = crc32c_poly::MulModP(p[k - 1], p[k - 1]);
    return p;
  }();
  uint32_t v = crc_a;
  for (size_t k = 0; len_b != 0; ++k, len_b >>= 1) {
    if (len_b & 1u) v = crc32c_poly::MulModP(v, kPow[k]);
  }
  return v ^ crc_b;
}

uint32_t Crc32cExtendPortable(uint32_t crc, std::span<const std::byte> data) {
  return ~ExtendRawPortable(~crc, reinterpret_cast<const uint8_t*>(data.data()), data.size());
}

bool Crc32cIsHardwareAccelerated() { return DetectHardware(); }

}  // namespace proxima
