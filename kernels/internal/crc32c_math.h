// The arithmetic of the batched GPU CRC32C (kernels/crc32c_cuda.h), shared verbatim by the CUDA
// kernels and the CPU unit test: table generation, the table-driven update, the "shift by n zero
// bytes" operator that combines CRCs of adjacent pieces, and how a span is cut into chunks and
// lane pieces. Every function is pure and thread-safe. Device code is C++17 (no std::span here).
//
// CRC32C as common/crc32c.cc defines it: reflected polynomial 0x82F63B78, register starts at ~0,
// result is the register's complement. "Raw" below means the register without that
// conditioning: raw(s, M) is the register after feeding M into a register holding s, so
// Crc32c(M) == ~raw(~0, M).
//
// The register update is linear over GF(2). Reading the reflected register as a polynomial of
// degree < 32 (bit 31 is x^0, bit 0 is x^31), feeding n zero bytes multiplies it by x^(8n) mod P,
// hence
//   raw(s, A ++ B) = ShiftBytes(raw(s, A), |B|) ^ raw(0, B)
//   Crc32c(A ++ B) = ShiftBytes(Crc32c(A), |B|) ^ Crc32c(B)        (CombineCrc32c)
// which lets pieces of one span be checksummed in parallel and combined afterwards.
#ifndef PROXIMA_KERNELS_INTERNAL_CRC32C_MATH_H_
#define PROXIMA_KERNELS_INTERNAL_CRC32C_MATH_H_

#include <cstdint>
#include <cstring>

#include "common/crc32c_poly.h"

#if defined(__CUDACC__)
#define PXC_HD __host__ __device__ __forceinline__
#else
#define PXC_HD inline
#endif

namespace proxima::gpu::crc32c_math {

using crc32c_poly::kOne;            // x^0, the multiplicative identity
using crc32c_poly::kPolyReflected;  // P, reflected
using crc32c_poly::MulModP;         // a * b mod P

// The batch is cut into chunks of kChunkBytes aligned to absolute addresses (so every chunk but a
// span's first and last is whole and aligned), one warp per chunk. A whole chunk is read in
// coalesced stripes (StripeLaneRaw below); in a partial one lane j takes the j-th kLaneBytes of
// the chunk window (LaneRange). Chunk CRCs are then combined per span (CombineChunks).
inline constexpr uint64_t kChunkBytes = 16384;
inline constexpr uint32_t kLanes = 32;
inline constexpr uint64_t kLaneBytes = kChunkBytes / kLanes;
// Slicing-by-16: kTables tables of 256 entries; table k holds the contribution of a byte followed
// by k zero bytes.
inline constexpr int kTables = 16;
// ShiftBytes handles n < 2^kPowCount, which covers every shift the kernels make (<= kChunkBytes).
inline constexpr int kPowCount = 15;
static_assert((uint64_t{1} << (kPowCount - 1)) == kChunkBytes, "pow[kPowCount - 1] shifts a chunk");
static_assert(kChunkBytes % (16 * kLanes) == 0, "lane pieces must be 16-byte aligned");

// x^(8 * 2^k) mod P for k < kPowCount.
struct ShiftPowers {
  uint32_t p[kPowCount];
};

// Entry b of table 0: the raw CRC of the single byte b from a zero register.
PXC_HD uint32_t TableEntry0(uint32_t b) {
  uint32_t crc = b;
  for (int i = 0; i < 8; ++i) crc = (crc >> 1) ^ ((crc & 1u) ? kPolyReflected : 0u);
  return crc;
}

// Entry of table k from the same entry of table k-1 (one more zero byte after it).
PXC_HD uint32_t NextTableEntry(uint32_t prev, const uint32_t* table0) {
  return (prev >> 8) ^ table0[prev & 0xFFu];
}

// Fills tables[0..kTables) (host side; the kernels build theirs in shared memory the same way).
inline void MakeTables(uint32_t (*tables)[256]) {
  for (uint32_t b = 0; b < 256; ++b) tables[0][b] = TableEntry0(b);
  for (int k = 1; k < kTables; ++k) {
    for (uint32_t b = 0; b < 256; ++b) tables[k][b] = NextTableEntry(tables[k - 1][b], tables[0]);
  }
}

PXC_HD uint32_t ExtendByte(uint32_t crc, uint8_t byte, const uint32_t* table0) {
  return (crc >> 8) ^ table0[(crc ^ byte) & 0xFFu];
}

// Feeds 16 bytes, given as four little-endian words, into the raw register.
PXC_HD uint32_t Extend16(uint32_t crc, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3,
                         const uint32_t (*t)[256]) {
  w0 ^= crc;
  return t[15][w0 & 0xFFu] ^ t[14][(w0 >> 8) & 0xFFu] ^ t[13][(w0 >> 16) & 0xFFu] ^
         t[12][w0 >> 24] ^ t[11][w1 & 0xFFu] ^ t[10][(w1 >> 8) & 0xFFu] ^
         t[9][(w1 >> 16) & 0xFFu] ^ t[8][w1 >> 24] ^ t[7][w2 & 0xFFu] ^ t[6][(w2 >> 8) & 0xFFu] ^
         t[5][(w2 >> 16) & 0xFFu] ^ t[4][w2 >> 24] ^ t[3][w3 & 0xFFu] ^ t[2][(w3 >> 8) & 0xFFu] ^
         t[1][(w3 >> 16) & 0xFFu] ^ t[0][w3 >> 24];
}

// Reads 16 bytes at p (REQUIRES: p is 16-byte aligned) as four little-endian words.
PXC_HD void Load16(const uint8_t* p, uint32_t* w) {
#if defined(__CUDA_ARCH__)
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
#else
  std::memcpy(w, p, 16);  // little-endian hosts only, like common/crc32c.cc
#endif
}

// raw(crc, [p, p + n)): bytes one at a time up to a 16-byte boundary, then aligned 16-byte loads
// (never past p + n), then the remaining bytes one at a time. Reads exactly [p, p + n).
PXC_HD uint32_t ExtendRaw(uint32_t crc, const uint8_t* p, uint64_t n, const uint32_t (*t)[256]) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 15u) != 0) {
    crc = ExtendByte(crc, *p++, t[0]);
    --n;
  }
#if defined(__CUDA_ARCH__)
#pragma unroll 4
#endif
  for (; n >= 16; n -= 16, p += 16) {
    uint32_t w[4];
    Load16(p, w);
    crc = Extend16(crc, w[0], w[1], w[2], w[3], t);
  }
  while (n > 0) {
    crc = ExtendByte(crc, *p++, t[0]);
    --n;
  }
  return crc;
}

inline ShiftPowers MakeShiftPowers() {
  ShiftPowers pw{};
  pw.p[0] = kOne >> 8;  // x^8
  for (int k = 1; k < kPowCount; ++k) pw.p[k] = MulModP(pw.p[k - 1], pw.p[k - 1]);
  return pw;
}

// v * x^(8n) mod P: the raw register v after n more zero bytes. REQUIRES: n < 2^kPowCount.
PXC_HD uint32_t ShiftBytes(uint32_t v, uint64_t n, const uint32_t* pow) {
  for (int k = 0; n != 0; ++k, n >>= 1) {
    if (n & 1u) v = MulModP(v, pow[k]);
  }
  return v;
}

// Multiplication by one fixed power X = x^(8n) as four table lookups (one per byte of v), for the
// shifts the kernels make over and over: t[k][b] = (b << 8k) * X mod P. Since the product is
// linear in v, each entry is an XOR of the 32 products basis[i] = (1 << i) * X.
PXC_HD uint32_t ShiftTableEntry(int k, uint32_t b, const uint32_t* basis) {
  uint32_t r = 0;
  for (int i = 0; i < 8; ++i) r ^= (0u - ((b >> i) & 1u)) & basis[8 * k + i];
  return r;
}

PXC_HD uint32_t ShiftByTable(uint32_t v, const uint32_t (*t)[256]) {
  return t[0][v & 0xFFu] ^ t[1][(v >> 8) & 0xFFu] ^ t[2][(v >> 16) & 0xFFu] ^ t[3][v >> 24];
}

// Host side: the table for X (the kernels build theirs in shared memory the same way).
inline void MakeShiftTable(uint32_t x, uint32_t (*t)[256]) {
  uint32_t basis[32];
  for (int i = 0; i < 32; ++i) basis[i] = MulModP(1u << i, x);
  for (int k = 0; k < 4; ++k) {
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = ShiftTableEntry(k, b, basis);
  }
}

// A whole chunk (kChunkBytes, aligned) is read in stripes so that a warp's loads are coalesced:
// lane j takes the 16-byte slots at chunk + i * kStripeBytes + 16 * j (i < kSlots), and keeps
// acc = ShiftByTable(acc, shift by kStripeBytes) ^ raw(0, slot): its bytes' raw CRC with the
// other lanes' bytes counted as zeros, positioned at the end of its last slot (StripeLaneRaw).
// The lanes then combine in a tree of kLevels steps: at level l, lane L (a multiple of
// 2^(l+1)) takes ShiftByTable(own, level l's table) ^ (lane L + 2^l's value), level l's table
// shifting by kSlotBytes * 2^l bytes = x^(8 * 2^(kTreeLog2 + l)) = pow[kTreeLog2 + l].
inline constexpr uint64_t kSlotBytes = 16;
inline constexpr uint64_t kStripeBytes = kSlotBytes * kLanes;
inline constexpr int kStripeLog2 = 9;  // kStripeBytes = 2^9: its shift is pow[kStripeLog2]
inline constexpr uint64_t kSlots = kChunkBytes / kStripeBytes;
inline constexpr int kLevels = 5;    // log2(kLanes)
inline constexpr int kTreeLog2 = 4;  // log2(kSlotBytes)
static_assert((uint32_t{1} << kLevels) == kLanes && (uint64_t{1} << kTreeLog2) == kSlotBytes &&
                  (uint64_t{1} << kStripeLog2) == kStripeBytes,
              "stripe geometry");

// Lane `lane`'s accumulator over its kSlots slots of the whole chunk at chunk_begin (REQUIRES:
// a multiple of kChunkBytes), starting from `init` (~0 for lane 0 when the chunk starts its span,
// else 0). `stripe_shift` is MakeShiftTable(pow[kStripeLog2]). Reads only the lane's slots.
PXC_HD uint32_t StripeLaneRaw(uint64_t chunk_begin, uint32_t lane, uint32_t init,
                              const uint32_t (*t)[256], const uint32_t (*stripe_shift)[256]) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(chunk_begin + lane * kSlotBytes);
  uint32_t w[4];
  Load16(p, w);
  uint32_t acc = Extend16(init, w[0], w[1], w[2], w[3], t);
#if defined(__CUDA_ARCH__)
#pragma unroll 4
#endif
  for (uint64_t i = 1; i < kSlots; ++i) {
    Load16(p + i * kStripeBytes, w);
    acc = ShiftByTable(acc, stripe_shift) ^ Extend16(0, w[0], w[1], w[2], w[3], t);
  }
  return acc;
}

// Crc32c(A ++ B) from Crc32c(A), Crc32c(B) and |B| (REQUIRES: len_b < 2^kPowCount).
PXC_HD uint32_t CombineCrc32c(uint32_t crc_a, uint32_t crc_b, uint64_t len_b, const uint32_t* pow) {
  return ShiftBytes(crc_a, len_b, pow) ^ crc_b;
}

// Byte addresses [begin, end).
struct ByteRange {
  uint64_t begin;
  uint64_t end;
};

// How many chunks the span [begin, begin + size) touches; 0 for an empty span.
PXC_HD uint64_t NumChunks(uint64_t begin, uint64_t size) {
  if (size == 0) return 0;
  return (begin + size - 1) / kChunkBytes - begin / kChunkBytes + 1;
}

// The bytes of chunk k (< NumChunks) of the span.
PXC_HD ByteRange ChunkRange(uint64_t begin, uint64_t size, uint64_t k) {
  const uint64_t window = (begin / kChunkBytes + k) * kChunkBytes;
  const uint64_t end = begin + size;
  return {begin > window ? begin : window,
          end < window + kChunkBytes ? end : window + kChunkBytes};
}

// The bytes of `chunk` that lane `lane` checksums; begin == end when none.
PXC_HD ByteRange LaneRange(ByteRange chunk, uint32_t lane) {
  const uint64_t window = chunk.begin / kChunkBytes * kChunkBytes + lane * kLaneBytes;
  const uint64_t b = chunk.begin > window ? chunk.begin : window;
  const uint64_t e = chunk.end < window + kLaneBytes ? chunk.end : window + kLaneBytes;
  return b < e ? ByteRange{b, e} : ByteRange{b, b};
}

// The raw CRC of lane `lane`'s piece of `chunk`: from ~0 when the piece starts the span, else
// from 0; 0 when the lane has no bytes.
PXC_HD uint32_t LaneRaw(uint64_t span_begin, ByteRange chunk, uint32_t lane,
                        const uint32_t (*tables)[256]) {
  const ByteRange r = LaneRange(chunk, lane);
  if (r.begin == r.end) return 0;
  const uint32_t init = r.begin == span_begin ? ~0u : 0u;
  return ExtendRaw(init, reinterpret_cast<const uint8_t*>(r.begin), r.end - r.begin, tables);
}

// Lane `lane`'s share of the raw CRC of the span's chunk `chunk`: its piece's raw CRC (from ~0
// when the piece starts the span, else from 0) moved to the end of the chunk. The XOR of all
// lanes' shares is raw(~0, chunk) for a span's first chunk and raw(0, chunk) for the others.
PXC_HD uint32_t LaneShare(uint64_t span_begin, ByteRange chunk, uint32_t lane,
                          const uint32_t (*tables)[256], const uint32_t* pow) {
  const ByteRange r = LaneRange(chunk, lane);
  if (r.begin == r.end) return 0;
  return ShiftBytes(LaneRaw(span_begin, chunk, lane, tables), chunk.end - r.end, pow);
}

// The length of chunk k (< NumChunks) of the span.
PXC_HD uint64_t ChunkLength(uint64_t begin, uint64_t size, uint64_t k) {
  const ByteRange c = ChunkRange(begin, size, k);
  return c.end - c.begin;
}

// One step of folding a span's chunks in order: acc (raw CRC up to chunk k-1) followed by chunk
// k of length len with raw CRC `chunk`. `chunk_shift` is MakeShiftTable(pow[kPowCount - 1]),
// the shift by kChunkBytes that every whole chunk needs.
PXC_HD uint32_t FoldChunk(uint32_t acc, uint64_t len, uint32_t chunk, const uint32_t* pow,
                          const uint32_t (*chunk_shift)[256]) {
  return (len == kChunkBytes ? ShiftByTable(acc, chunk_shift) : ShiftBytes(acc, len, pow)) ^ chunk;
}

// Crc32c of the span from its chunks' raw CRCs (chunk_raw[k] for k < NumChunks: raw(~0, chunk)
// for the first, raw(0, chunk) for the others). 0 for an empty span.
PXC_HD uint32_t CombineChunks(uint64_t begin, uint64_t size, const uint32_t* chunk_raw,
                              const uint32_t* pow, const uint32_t (*chunk_shift)[256]) {
  const uint64_t n = NumChunks(begin, size);
  if (n == 0) return 0;
  uint32_t acc = chunk_raw[0];
  for (uint64_t k = 1; k < n; ++k) {
    acc = FoldChunk(acc, ChunkLength(begin, size, k), chunk_raw[k], pow, chunk_shift);
  }
  return ~acc;
}

}  // namespace proxima::gpu::crc32c_math

#endif  // PROXIMA_KERNELS_INTERNAL_CRC32C_MATH_H_
