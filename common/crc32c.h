// CRC32C (Castagnoli), the checksum every stored Proxima block carries.
//
// Uses the CPU's CRC32C instruction when it has one (SSE4.2 on x86-64, the CRC32 extension on
// aarch64; checked once at run time, never assumed from the build machine) and a slicing-by-8
// table otherwise; all give identical results.
// Thread-safe: pure functions.
#ifndef PROXIMA_COMMON_CRC32C_H_
#define PROXIMA_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <span>

namespace proxima {

// Returns the CRC32C of `data`.
uint32_t Crc32c(std::span<const std::byte> data);

// Continues a CRC32C: Crc32cExtend(Crc32c(a), b) == Crc32c(a ++ b). Crc32cExtend(0, x) == Crc32c(x).
uint32_t Crc32cExtend(uint32_t crc, std::span<const std::byte> data);

// Copies src into dst (REQUIRES: dst.size() == src.size()) and returns Crc32c(dst), touching
// each byte once while it is in cache. Checksums what was written, not what was read.
// Crc32cCopy(dst, src, crc) continues `crc` like Crc32cExtend.
uint32_t Crc32cCopy(std::span<std::byte> dst, std::span<const std::byte> src, uint32_t crc = 0);

// Crc32c(a ++ b) from crc_a = Crc32c(a), crc_b = Crc32c(b) and len_b = b.size(): lets pieces of
// one span be checksummed apart (on several threads) and joined in order. About 0.1-0.5 us.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// The portable path, exposed so tests can compare it with the hardware path.
uint32_t Crc32cExtendPortable(uint32_t crc, std::span<const std::byte> data);

// True when the CPU's CRC32C instruction is in use (SSE4.2 or aarch64 CRC32).
bool Crc32cIsHardwareAccelerated();

}  // namespace proxima

#endif  // PROXIMA_COMMON_CRC32C_H_
