// The `lossless` codec (docs/format.md: lossless): byte planes, the exponent plane (plane A)
// entropy-coded. The encoder writes mode 2: a canonical Huffman code (lengths <= 11 bits) over
// four bit streams, symbol i in stream i % 4, so the decoder runs four independent table-lookup
// chains at once and the encoder needs no division or multiply per symbol (docs/decisions.md:
// "lossless: Huffman instead of rANS"). Mode 1 (4-way interleaved order-0 rANS, what the
// encoder wrote before) is still decoded, so stored blocks stay readable.
//
// Encoder builds (the same bytes from each): generic (SSE2 split that also counts plane A,
// scalar stream writer), BMI2 (the same source with BMI2), and on AVX2 CPUs, for plane ranges
// of at most 32 symbols (nearly every KV segment), AVX2 compare counting and an AVX2 writer
// that codes 16 symbols per step (CountNarrowAvx2, EncodeStreamsAvx2).
#include <algorithm>
#include <array>
#include <cstring>
#include <memory>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "kernels/internal/numeric.h"
#include "kernels/internal/segment_codecs.h"

namespace proxima::codec::internal {
namespace {

constexpr uint32_t kProbBits = 12;
constexpr uint32_t kProbScale = 1u << kProbBits;
constexpr uint32_t kRansL = 1u << 16;  // states live in [2^16, 2^32): one 16-bit renorm max
constexpr int kStates = 4;
constexpr uint32_t kMaxCodeBits = 11;  // Huffman code lengths 1..11; decode table 2^11 entries
constexpr int kStreams = 4;            // symbol i goes to stream i % 4

struct PlaneRange {
  uint32_t lo = 255, hi = 0;  // smallest and largest plane A byte (lo > hi when n == 0)
};

constexpr int kHistTables = 8;  // symbol i counted in table i % 8

// Splits the values into the two planes and returns plane A's range (so that the encoder's
// per-symbol loops only run over the symbols that occur). With kCount, also counts plane A's
// symbols (symbol i into hist[i % kHistTables], which must be zero on entry): counting right
// after each split step overlaps it with the input's (usually cold) loads, and eight tables
// rather than one because KV exponents are peaked (the top symbol is about a quarter of them)
// and each increment of a run of one symbol waits for the previous one to the same counter.
// Without kCount the caller counts plane A afterwards (CountNarrowAvx2, from L1). One copy per
// dtype and mode so that the loop does not test them per step.
template <bool bf16, bool kCount>
PlaneRange SplitPlanesImpl(size_t n, const std::byte* in, uint8_t* a, uint8_t* b,
                           uint32_t (*hist)[256]) {
  PlaneRange r;
  size_t i = 0;
#if defined(__SSE2__)
  // 16 values per step with baseline SSE2 (every x86-64 CPU has it, so no dispatch is needed);
  // GCC -O2 leaves the scalar loop below unvectorised.
  __m128i vmin = _mm_set1_epi8(-1), vmax = _mm_setzero_si128();
  const __m128i m7f = _mm_set1_epi16(0x7F), m80 = _mm_set1_epi16(0x80), mff = _mm_set1_epi16(0xFF);
  auto planes = [&](__m128i v, __m128i* hi, __m128i* lo) {
    if constexpr (bf16) {
      *hi = _mm_and_si128(_mm_srli_epi16(v, 7), mff);
      *lo = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 8), m80), _mm_and_si128(v, m7f));
    } else {
      *hi = _mm_srli_epi16(v, 8);
      *lo = _mm_and_si128(v, mff);
    }
  };
  for (; i + 16 <= n; i += 16) {
    // The input 2 KiB ahead (the next segment's near the end; prefetches never fault, and the
    // address is formed as an integer): 8-14% less encode time with AVX2 on a cold 64 MiB
    // working set (paired A/B), where the split's loads were the encoder's main stall.
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(in + 2 * i) + 2048),
                 _MM_HINT_T0);
    __m128i h0, l0, h1, l1;
    planes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i)), &h0, &l0);
    planes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i + 16)), &h1, &l1);
    const __m128i va = _mm_packus_epi16(h0, h1);
    vmin = _mm_min_epu8(vmin, va);
    vmax = _mm_max_epu8(vmax, va);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + i), va);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b + i), _mm_packus_epi16(l0, l1));
    if constexpr (kCount) {
      // The symbols from the register, not reloaded from `a`: byte loads of a 16-byte store
      // that is still in flight cost more than shifts.
      const uint64_t w0 = static_cast<uint64_t>(_mm_cvtsi128_si64(va));
      const uint64_t w1 = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_unpackhi_epi64(va, va)));
      for (int j = 0; j < 8; ++j) ++hist[j][(w0 >> (8 * j)) & 0xFF];
      for (int j = 0; j < 8; ++j) ++hist[j][(w1 >> (8 * j)) & 0xFF];
    }
  }
  if (i != 0) {
    alignas(16) uint8_t mn[16], mx[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(mn), vmin);
    _mm_store_si128(reinterpret_cast<__m128i*>(mx), vmax);
    for (int j = 0; j < 16; ++j) {
      r.lo = std::min<uint32_t>(r.lo, mn[j]);
      r.hi = std::max<uint32_t>(r.hi, mx[j]);
    }
  }
#endif
  for (; i < n; ++i) {
    const uint16_t v = Load16(in, i);
    a[i] = static_cast<uint8_t>(bf16 ? v >> 7 : v >> 8);
    b[i] = static_cast<uint8_t>(bf16 ? ((v >> 8) & 0x80) | (v & 0x7F) : v);
    r.lo = std::min<uint32_t>(r.lo, a[i]);
    r.hi = std::max<uint32_t>(r.hi, a[i]);
    if constexpr (kCount) ++hist[i % kHistTables][a[i]];
  }
  return r;
}

// Counts into `hist` when it is not null (see SplitPlanesImpl).
PlaneRange SplitPlanes(const SegmentShape& shape, const std::byte* in, uint8_t* a, uint8_t* b,
                       uint32_t (*hist)[256]) {
  const size_t n = shape.Elements();
  const bool bf16 = shape.dtype == numeric::kDtypeBf16;
  if (hist == nullptr) {
    return bf16 ? SplitPlanesImpl<true, false>(n, in, a, b, hist)
                : SplitPlanesImpl<false, false>(n, in, a, b, hist);
  }
  return bf16 ? SplitPlanesImpl<true, true>(n, in, a, b, hist)
              : SplitPlanesImpl<false, true>(n, in, a, b, hist);
}

// The split's histogram tables, per thread and all zero between calls. Not inline: the caller
// keeps the address in a register instead of recomputing the thread-local address inside its
// loops.
__attribute__((noinline)) uint32_t (*HistTables())[256] {
  thread_local uint32_t hist[kHistTables][256] = {};
  return hist;
}

#define PROXIMA_LOSSLESS_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__)
// With AVX2, plane ranges of at most this many symbols are counted after the split with vector
// compares (CountNarrowAvx2) instead of by the split's table increments: real bf16 KV's
// exponent planes span 12-21 symbols per segment (smollm2 test file, T = 16 and 64; a few
// segments with zeros span up to 130), so nearly every segment takes that path.
constexpr uint32_t kNarrowRange = 32;
// Symbols counted per pass over plane A: 6 counters and 6 comparands stay in registers.
constexpr uint32_t kPassSymbols = 6;

// Adds to counts[s] the occurrences in a[0, n) of each s in [lo, lo + w) (w <= kNarrowRange),
// kPassSymbols symbols per pass, 32 bytes per step: per step a load and two vector operations
// per symbol instead of a memory increment per byte (with SSE2's 16-byte vectors this was
// slower than the split's increments, so the generic build keeps those). Written with GCC's
// generic vectors, compiled to AVX2 in its target("avx2") caller. The byte counters are summed
// before they can wrap, every 255 steps. A pass's comparands past lo + w (which may wrap to
// other symbols) are counted and dropped.
PROXIMA_LOSSLESS_INLINE void CountNarrowImpl(const uint8_t* a, size_t n, uint32_t lo, uint32_t w,
                                             uint64_t* counts) {
  constexpr size_t kBytes = 32;
  typedef uint8_t V __attribute__((vector_size(kBytes)));
  constexpr size_t kChunk = 255 * kBytes;
  const size_t body = n - n % kBytes;
  for (uint32_t s0 = 0; s0 < w; s0 += kPassSymbols) {
    V sym[kPassSymbols];
    for (uint32_t g = 0; g < kPassSymbols; ++g) {
      uint8_t splat[kBytes];
      std::memset(splat, static_cast<int>((lo + s0 + g) & 0xFF), kBytes);
      std::memcpy(&sym[g], splat, kBytes);
    }
    for (size_t c0 = 0; c0 < body; c0 += kChunk) {
      const size_t c1 = body - c0 < kChunk ? body : c0 + kChunk;
      V cnt[kPassSymbols] = {};
      for (size_t i = c0; i < c1; i += kBytes) {
        V v;
        std::memcpy(&v, a + i, kBytes);
        // A true lane compares as -1.
        for (uint32_t g = 0; g < kPassSymbols; ++g) cnt[g] -= reinterpret_cast<V>(v == sym[g]);
      }
      for (uint32_t g = 0; g < kPassSymbols && s0 + g < w; ++g) {
        uint64_t word[kBytes / 8];
        std::memcpy(word, &cnt[g], kBytes);
        uint64_t sum = 0;
        for (uint64_t x : word) {  // bytes to 16-bit lanes, then the four lanes (< 2^11 each)
          x = (x & 0x00FF00FF00FF00FFu) + ((x >> 8) & 0x00FF00FF00FF00FFu);
          sum += (x * 0x0001000100010001u) >> 48;
        }
        counts[lo + s0 + g] += sum;
      }
    }
  }
  for (size_t i = body; i < n; ++i) ++counts[a[i]];
}

// Only when CpuHasAvx2().
__attribute__((target("avx2"))) void CountNarrowAvx2(const uint8_t* a, size_t n, uint32_t lo,
                                                     uint32_t w, uint64_t* counts) {
  CountNarrowImpl(a, n, lo, w, counts);
}
#endif

// counts[lo..hi] = the occurrences of each symbol in a[0, n) (lo <= hi: n > 0), for the AVX2
// encoder, whose split does not count.
void CountSymbolsAvx2(const uint8_t* a, size_t n, uint32_t lo, uint32_t hi, uint64_t* counts) {
  for (uint32_t s = lo; s <= hi; ++s) counts[s] = 0;
#if defined(__x86_64__)
  if (hi - lo < kNarrowRange) return CountNarrowAvx2(a, n, lo, hi - lo + 1, counts);
#endif
  // Wide ranges (rare in KV data): four tables, so that a run of one symbol is not one chain
  // of dependent increments.
  uint32_t t[4][256];
  for (auto& row : t) std::fill(row + lo, row + hi + 1, 0u);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++t[0][a[i]];
    ++t[1][a[i + 1]];
    ++t[2][a[i + 2]];
    ++t[3][a[i + 3]];
  }
  for (; i < n; ++i) ++t[0][a[i]];
  for (uint32_t s = lo; s <= hi; ++s) counts[s] = uint64_t{t[0][s]} + t[1][s] + t[2][s] + t[3][s];
}

// Writes value i from a[i] and b[i]. Also correct in place with `a` at byte n of `out` (the
// Huffman decoder puts plane A there): each step reads its a bytes before it writes, and its
// writes (bytes [2i, 2i + 32)) stay below the next unread a byte (n + i + 16) while i + 16 <= n.
void MergePlanes(const SegmentShape& shape, const uint8_t* a, const uint8_t* b, std::byte* out) {
  const size_t n = shape.Elements();
  const bool bf16 = shape.dtype == numeric::kDtypeBf16;
  size_t i = 0;
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  for (; i + 16 <= n; i += 16) {
    const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i));
    const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i));
    __m128i v0, v1;
    if (bf16) {
      const __m128i a0 = _mm_unpacklo_epi8(va, zero), a1 = _mm_unpackhi_epi8(va, zero);
      const __m128i b0 = _mm_unpacklo_epi8(vb, zero), b1 = _mm_unpackhi_epi8(vb, zero);
      const __m128i m7f = _mm_set1_epi16(0x7F), m80 = _mm_set1_epi16(0x80);
      v0 = _mm_or_si128(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(b0, m80), 8), _mm_slli_epi16(a0, 7)),
                        _mm_and_si128(b0, m7f));
      v1 = _mm_or_si128(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(b1, m80), 8), _mm_slli_epi16(a1, 7)),
                        _mm_and_si128(b1, m7f));
    } else {
      v0 = _mm_unpacklo_epi8(vb, va);
      v1 = _mm_unpackhi_epi8(vb, va);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), v0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i + 16), v1);
  }
#endif
  if (bf16) {
    for (; i < n; ++i) {
      uint16_t v =
          static_cast<uint16_t>(((b[i] & 0x80u) << 8) | (uint32_t{a[i]} << 7) | (b[i] & 0x7Fu));
      Store16(out, i, v);
    }
  } else {
    for (; i < n; ++i) Store16(out, i, static_cast<uint16_t>((a[i] << 8) | b[i]));
  }
}

// Mode 1 (rANS, written by encoders before mode 2; decoded for stored blocks): `p` is just past
// the mode byte, `pend` the end of the payload.
absl::Status DecodeRans(const SegmentShape& shape, const uint8_t* p, const uint8_t* const pend,
                        std::byte* out) {
  const size_t n = shape.Elements();
  auto need = [&](size_t bytes) { return static_cast<size_t>(pend - p) >= bytes; };
  if (!need(2)) return absl::InvalidArgumentError("lossless: truncated symbol table");
  uint16_t n_sym;
  std::memcpy(&n_sym, p, 2);
  p += 2;
  if (n_sym == 0 || n_sym > 256 || !need(3 * size_t{n_sym})) {
    return absl::InvalidArgumentError("lossless: bad symbol count");
  }
  // Per slot: symbol (bits 0-7), offset inside the symbol's range (8-19), frequency - 1 (20-31).
  std::vector<uint32_t> slot(kProbScale);
  uint32_t total = 0;
  int prev = -1;
  for (uint32_t k = 0; k < n_sym; ++k, p += 3) {
    uint8_t sym = p[0];
    uint16_t f;
    std::memcpy(&f, p + 1, 2);
    if (static_cast<int>(sym) <= prev || f == 0 || total + f > kProbScale) {
      return absl::InvalidArgumentError("lossless: bad symbol table");
    }
    prev = sym;
    // Two slots per 64-bit store: this fill runs once per segment and is not negligible.
    const uint32_t base = sym | ((f - 1u) << 20);
    uint32_t j = 0;
    uint64_t pair = base | (uint64_t{base | (1u << 8)} << 32);
    for (; j + 2 <= f; j += 2, pair += (uint64_t{2u << 8} << 32) | (2u << 8)) {
      std::memcpy(&slot[total + j], &pair, 8);
    }
    if (j < f) slot[total + j] = base | (j << 8);
    total += f;
  }
  if (total != kProbScale) return absl::InvalidArgumentError("lossless: frequencies do not sum");
  if (!need(4)) return absl::InvalidArgumentError("lossless: truncated stream size");
  uint32_t rans_bytes;
  std::memcpy(&rans_bytes, p, 4);
  p += 4;
  if (static_cast<size_t>(pend - p) != size_t{rans_bytes} + n || rans_bytes < 4 * kStates) {
    return absl::InvalidArgumentError("lossless: stream sizes do not add up");
  }
  const uint8_t* s = p;
  const uint8_t* const send = p + rans_bytes;
  const uint8_t* plane_b = send;
  uint32_t x[kStates];
  for (int k = 0; k < kStates; ++k, s += 4) std::memcpy(&x[k], s, 4);

  // Output value = (symbol << shift) | lo[plane B byte], merging the planes as symbols decode.
  const bool bf16 = shape.dtype == numeric::kDtypeBf16;
  const uint32_t shift = bf16 ? 7 : 8;
  uint16_t lo[256];
  for (uint32_t b = 0; b < 256; ++b) {
    lo[b] = static_cast<uint16_t>(bf16 ? ((b & 0x80u) << 8) | (b & 0x7Fu) : b);
  }
  const uint32_t* tab = slot.data();
  // Decodes symbol i from state st, writes output value i, returns the new (unrefilled) state.
  auto step = [tab, &lo, plane_b, out, shift](uint32_t st, size_t i) -> uint32_t {
    const uint32_t e = tab[st & (kProbScale - 1)];
    Store16(out, i, static_cast<uint16_t>(((e & 0xFFu) << shift) | lo[plane_b[i]]));
    return ((e >> 20) + 1) * (st >> kProbBits) + ((e >> 8) & 0xFFFu);
  };
  // Branch-free refill of at most one 16-bit word (`p` has at least 2 bytes left).
  // Written with masks rather than ?: because GCC turns the conditional form back into branches.
  auto refill = [](uint32_t st, const uint8_t*& p) -> uint32_t {
    uint16_t w;
    std::memcpy(&w, p, 2);
    const uint32_t r = st < kRansL;  // 0 or 1
    p += 2 * r;
    return (st << (16 * r)) | (w & (0u - r));
  };
  size_t i = 0;
  {
    // Fast path: a symbol refills at most one word, so with 8 bytes left a group of 4 symbols
    // cannot overrun. States and the stream pointer live in locals so that the output stores
    // (std::byte, which may alias anything) do not force them through memory.
    uint32_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
    const uint8_t* sp = s;
    while (i + kStates <= n && send - sp >= 2 * kStates) {
      x0 = step(x0, i);
      x1 = step(x1, i + 1);
      x2 = step(x2, i + 2);
      x3 = step(x3, i + 3);
      x0 = refill(x0, sp);
      x1 = refill(x1, sp);
      x2 = refill(x2, sp);
      x3 = refill(x3, sp);
      i += kStates;
    }
    x[0] = x0, x[1] = x1, x[2] = x2, x[3] = x3;
    s = sp;
  }
  for (; i < n; ++i) {
    uint32_t& st = x[i & (kStates - 1)];
    st = step(st, i);
    if (st < kRansL) {
      if (send - s < 2) return absl::InvalidArgumentError("lossless: rANS stream overrun");
      uint16_t w;
      std::memcpy(&w, s, 2);
      st = (st << 16) | w;
      s += 2;
    }
  }
  if (s != send) return absl::InvalidArgumentError("lossless: rANS stream has trailing bytes");
  for (int k = 0; k < kStates; ++k) {
    if (x[k] != kRansL) return absl::InvalidArgumentError("lossless: rANS final state mismatch");
  }
  return absl::OkStatus();
}


// Lengths of a Huffman code for counts[lo..hi] (at least two nonzero), every length <=
// kMaxCodeBits; len[lo..hi] is written (0 for absent symbols). A code that comes out longer is
// rebuilt from the halved counts (each kept >= 1), as bzip2 does; a flat code over 256 symbols
// has length 8, so this ends.
void HuffmanLengths(const uint64_t* counts, uint32_t lo, uint32_t hi, uint8_t* len) {
  std::array<uint64_t, 256> w;
  std::array<uint16_t, 256> sym;  // leaves by (weight, symbol)
  int m = 0;
  for (uint32_t s = lo; s <= hi; ++s) {
    w[s] = counts[s];
    len[s] = 0;
    if (w[s] != 0) sym[m++] = static_cast<uint16_t>(s);
  }
  if (m < 2) return;  // not called so; keeps the indexing below obviously in range
  for (;;) {
    std::sort(sym.begin(), sym.begin() + m,
              [&w](uint16_t x, uint16_t y) { return w[x] != w[y] ? w[x] < w[y] : x < y; });
    // Two-queue construction: nodes [0, m) are the leaves in order, [m, 2m - 1) the inner nodes
    // in creation order (their weights never decrease), the last one the root.
    std::array<uint64_t, 511> weight;
    std::array<uint16_t, 511> parent;
    std::array<uint8_t, 511> depth;
    for (int j = 0; j < m; ++j) weight[j] = w[sym[j]];
    int leaf = 0, inner = m;
    for (int next = m; next < 2 * m - 1; ++next) {
      int pick[2];
      for (int& p : pick) {
        p = (leaf < m && (inner >= next || weight[leaf] <= weight[inner])) ? leaf++ : inner++;
      }
      weight[next] = weight[pick[0]] + weight[pick[1]];
      parent[pick[0]] = parent[pick[1]] = static_cast<uint16_t>(next);
    }
    depth[2 * m - 2] = 0;
    uint32_t max_depth = 0;
    for (int j = 2 * m - 3; j >= 0; --j) {
      depth[j] = static_cast<uint8_t>(depth[parent[j]] + 1);
      if (j < m) max_depth = std::max<uint32_t>(max_depth, depth[j]);
    }
    if (max_depth <= kMaxCodeBits) {
      for (int j = 0; j < m; ++j) len[sym[j]] = depth[j];
      return;
    }
    for (int j = 0; j < m; ++j) w[sym[j]] = (w[sym[j]] >> 1) | 1;
  }
}

// Canonical code (MSB first) for len[lo..hi]: codes of one length are consecutive in symbol
// order, shorter lengths first (the DEFLATE rule). Writes code[s] and len32[s] (the length
// widened, for the encoder's table) for s in [lo, hi].
void CanonicalCodes(const uint8_t* len, uint32_t lo, uint32_t hi, uint32_t* code,
                    uint32_t* len32) {
  uint32_t count[kMaxCodeBits + 1] = {};
  for (uint32_t s = lo; s <= hi; ++s) ++count[len[s]];
  uint32_t next[kMaxCodeBits + 2] = {};
  for (uint32_t l = 1; l <= kMaxCodeBits; ++l) next[l + 1] = (next[l] + count[l]) << 1;
  for (uint32_t s = lo; s <= hi; ++s) {
    code[s] = len[s] != 0 ? next[len[s]]++ : 0;
    len32[s] = len[s];
  }
}

// One stream's bit writer: MSB first, `acc` holds the pending bits in its low `bits` bits (bits
// above are stale), fewer than 8 between flushes.
struct BitWriter {
  uint64_t acc = 0;
  uint32_t bits = 0;
  uint8_t* dst = nullptr;
};

// Appends symbol s (the low len[s] bits of code[s]).
PROXIMA_LOSSLESS_INLINE void Put(BitWriter& w, uint32_t s, const uint32_t* code,
                                 const uint32_t* len) {
  w.acc = (w.acc << len[s]) | code[s];
  w.bits += len[s];
}

// Stores the whole pending bytes (bits in [1, 63]) with one 8-byte store that may reach up to
// 8 bytes past them.
PROXIMA_LOSSLESS_INLINE void Flush(BitWriter& w) {
  const uint64_t word = __builtin_bswap64(w.acc << (64 - w.bits));
  std::memcpy(w.dst, &word, 8);
  w.dst += w.bits >> 3;
  w.bits &= 7;
}

// Writes the four streams in one pass over plane A: symbol i to stream i % 4, stream k from
// w[k].dst on; on return w[k].dst is stream k's end (its partial last byte, low bits zero,
// included). Each stream may write up to 8 bytes past its end, so the streams need that gap
// between them. One 4-byte load per round of four symbols, and four independent bit chains
// (the writer of one stream at a time was one chain through `acc`, a stride-4 byte load per
// symbol and a pass over plane A per stream).
//
// `start` (a multiple of 4) is where to begin: the AVX2 writer hands its tail over.
PROXIMA_LOSSLESS_INLINE void EncodeStreamsImpl(const uint8_t* a, size_t n, const uint32_t* code,
                                               const uint32_t* len, BitWriter* w,
                                               size_t start = 0) {
  BitWriter w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];  // locals: the stores may alias
  size_t i = start;
  for (; i + 20 <= n; i += 20) {  // 5 codes of <= 11 bits + 7 left over < 64 per stream
    // Not unrolled: unrolled, GCC 12 hoists all 20 table loads and spills them to the stack.
#pragma GCC unroll 1
    for (size_t j = i; j < i + 20; j += 4) {
      uint32_t q;
      std::memcpy(&q, a + j, 4);
      Put(w0, q & 0xFF, code, len);
      Put(w1, (q >> 8) & 0xFF, code, len);
      Put(w2, (q >> 16) & 0xFF, code, len);
      Put(w3, q >> 24, code, len);
    }
    Flush(w0);
    Flush(w1);
    Flush(w2);
    Flush(w3);
  }
  w[0] = w0, w[1] = w1, w[2] = w2, w[3] = w3;
  for (; i < n; ++i) {
    BitWriter& wi = w[i % kStreams];
    Put(wi, a[i], code, len);
    Flush(wi);
  }
  for (int k = 0; k < kStreams; ++k) {
    if (w[k].bits != 0) {
      Flush(w[k]);
      ++w[k].dst;  // the partial last byte, its low bits zero
    }
  }
}

void EncodeStreamsGeneric(const uint8_t* a, size_t n, const uint32_t* code, const uint32_t* len,
                          BitWriter* w) {
  EncodeStreamsImpl(a, n, code, len, w);
}

// Scratch for the encoder's two planes: kept per thread up to kKeptScratch bytes (segments are
// encoded one at a time per thread, usually tens of KiB), allocated per call above that.
constexpr size_t kKeptScratch = size_t{4} << 20;
uint8_t* EncoderScratch(size_t bytes, std::unique_ptr<uint8_t[]>* big) {
  if (bytes > kKeptScratch) {
    *big = std::make_unique_for_overwrite<uint8_t[]>(bytes);
    return big->get();
  }
  thread_local std::unique_ptr<uint8_t[]> buf;
  thread_local size_t cap = 0;
  if (cap < bytes) {
    buf = std::make_unique_for_overwrite<uint8_t[]>(bytes);
    cap = bytes;
  }
  return buf.get();
}

// MSB-first bit reader. `bit` is the absolute bit position in the payload of the next unread
// bit; `buf` holds the bits from there on at its top (at least 56 valid after a refill, enough
// for 5 codes of <= 11 bits). Two values per reader keep four readers in registers.
struct BitReader {
  uint64_t buf = 0;
  uint64_t bit = 0;
};

// Reads the 8 bytes at bit / 8 and drops the bits before `bit`: only where those 8 bytes are
// inside the payload.
PROXIMA_LOSSLESS_INLINE void RefillUnchecked(BitReader& r, const uint8_t* base) {
  uint64_t w;
  std::memcpy(&w, base + (r.bit >> 3), 8);
  r.buf = __builtin_bswap64(w) << (r.bit & 7);
}

// The same with zeros for the bytes at or past `size`.
PROXIMA_LOSSLESS_INLINE void RefillChecked(BitReader& r, const uint8_t* base, size_t size) {
  uint64_t w = 0;
  const size_t at = r.bit >> 3;
  for (size_t j = 0; j < 8 && at + j < size; ++j) w |= uint64_t{base[at + j]} << (56 - 8 * j);
  r.buf = w << (r.bit & 7);
}

// Table entry: length | symbol << 8 (shifting by the entry is shifting by the length: x86
// masks shift counts to 6 bits and a length is <= 11). Returns the entry.
PROXIMA_LOSSLESS_INLINE uint32_t DecodeOne(BitReader& r, const uint16_t* tab) {
  const uint32_t e = tab[r.buf >> (64 - kMaxCodeBits)];
  r.buf <<= e & 63;
  r.bit += e & 0xFF;
  return e;
}

// Decodes symbols [0, n) into dst, symbol i from reader i % 4; `size` is the payload size.
//
// Why the fast loop may read without bounds checks: between refills a reader consumes at most
// 5 x 11 bits, so each refill reads at most 7 bytes further on than the one before; the fast
// loop refills each reader at most n / 20 times, so reader k reads below
// start[k] + 7 * n / 20 + 8 bytes, and the caller has checked that the streams are followed by
// plane B's n bytes inside the payload: start[k] <= size - n. With n >= 20 that is below
// size. Hostile stream contents cannot move a reader faster.
PROXIMA_LOSSLESS_INLINE void DecodeSymbolsImpl(BitReader* r, size_t n, const uint16_t* tab,
                                               const uint8_t* base, size_t size, uint8_t* dst) {
  size_t i = 0;
  {
    // Readers in locals so that the byte stores (which may alias anything) leave them in
    // registers; 5 rounds of 4 symbols per refill.
    BitReader r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
    for (; i + 20 <= n; i += 20) {
      RefillUnchecked(r0, base);
      RefillUnchecked(r1, base);
      RefillUnchecked(r2, base);
      RefillUnchecked(r3, base);
      // Not unrolled: unrolling all 5 rounds made GCC 12 spill the entries to the stack.
#pragma GCC unroll 1
      for (size_t j = i; j < i + 20; j += 4) {  // one 4-byte store per round
        uint32_t word = DecodeOne(r0, tab) >> 8;
        word |= DecodeOne(r1, tab) & 0xFF00;
        word |= (DecodeOne(r2, tab) & 0xFF00) << 8;
        word |= (DecodeOne(r3, tab) & 0xFF00) << 16;
        std::memcpy(dst + j, &word, 4);
      }
    }
    r[0] = r0, r[1] = r1, r[2] = r2, r[3] = r3;
  }
  for (; i < n; ++i) {
    BitReader& ri = r[i % kStreams];
    RefillChecked(ri, base, size);
    dst[i] = static_cast<uint8_t>(DecodeOne(ri, tab) >> 8);
  }
}

void DecodeSymbolsGeneric(BitReader* r, size_t n, const uint16_t* tab, const uint8_t* base,
                          size_t size, uint8_t* dst) {
  DecodeSymbolsImpl(r, n, tab, base, size, dst);
}

#if defined(__x86_64__)
// The same code compiled with BMI2 (shlx/shrx take the count from any register, which frees
// the register allocator from rcx). Same source, so the same bytes as the generic versions.
__attribute__((target("bmi2"))) void EncodeStreamsBmi2(const uint8_t* a, size_t n,
                                                       const uint32_t* code, const uint32_t* len,
                                                       BitWriter* w) {
  EncodeStreamsImpl(a, n, code, len, w);
}
__attribute__((target("bmi2"))) void DecodeSymbolsBmi2(BitReader* r, size_t n,
                                                       const uint16_t* tab, const uint8_t* base,
                                                       size_t size, uint8_t* dst) {
  DecodeSymbolsImpl(r, n, tab, base, size, dst);
}
#else
void EncodeStreamsBmi2(const uint8_t* a, size_t n, const uint32_t* code, const uint32_t* len,
                       BitWriter* w) {
  EncodeStreamsImpl(a, n, code, len, w);
}
void DecodeSymbolsBmi2(BitReader* r, size_t n, const uint16_t* tab, const uint8_t* base,
                       size_t size, uint8_t* dst) {
  DecodeSymbolsImpl(r, n, tab, base, size, dst);
}
#endif

#if defined(__x86_64__)
// The stream writer for narrow ranges (hi - lo < kNarrowRange) on AVX2 CPUs: 16 symbols per
// step, four of each stream, with the four streams' accumulators in the 64-bit lanes of one
// register. Codes and lengths come from 32-entry byte tables (pshufb on the low and high 16
// entries, blended on bit 4 of symbol - lo); each stream's four codes are joined into one of
// at most 44 bits (two variable shifts: pairs in 32-bit lanes, then pairs of pairs in 64-bit
// lanes), appended with one more shift, and flushed like Flush() (whole bytes, an 8-byte
// store per stream: at most 7 + 44 bits pending). The same bits as EncodeStreamsImpl, which
// writes the tail. Only when CpuHasAvx2() (and so BMI2).
PROXIMA_LOSSLESS_INLINE __m128i Load16Bytes(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Entry x (< 32) of the 32-byte table t0 ++ t1; `upper` is x > 15 per byte.
PROXIMA_LOSSLESS_INLINE __attribute__((target("avx2"))) __m128i Look32(__m128i t0, __m128i t1,
                                                                       __m128i x, __m128i upper) {
  return _mm_blendv_epi8(_mm_shuffle_epi8(t0, x), _mm_shuffle_epi8(t1, x), upper);
}

__attribute__((target("avx2,bmi2"))) void EncodeStreamsAvx2(const uint8_t* a, size_t n,
                                                            uint32_t lo, uint32_t hi,
                                                            const uint32_t* code,
                                                            const uint32_t* len, BitWriter* w) {
  alignas(16) uint8_t t_len[kNarrowRange] = {}, t_code_lo[kNarrowRange] = {},
                      t_code_hi[kNarrowRange] = {};
  for (uint32_t s = lo; s <= hi; ++s) {
    t_len[s - lo] = static_cast<uint8_t>(len[s]);
    t_code_lo[s - lo] = static_cast<uint8_t>(code[s]);
    t_code_hi[s - lo] = static_cast<uint8_t>(code[s] >> 8);
  }
  const __m128i len0 = Load16Bytes(t_len), len1 = Load16Bytes(t_len + 16);
  const __m128i clo0 = Load16Bytes(t_code_lo), clo1 = Load16Bytes(t_code_lo + 16);
  const __m128i chi0 = Load16Bytes(t_code_hi), chi1 = Load16Bytes(t_code_hi + 16);
  const __m128i bias = _mm_set1_epi8(static_cast<char>(lo)), fifteen = _mm_set1_epi8(15);
  // Reverses the bytes of each 64-bit lane (the MSB-first byte order of Flush's bswap).
  const __m256i bswap = _mm256_setr_epi8(7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8, 7,
                                         6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8);
  const __m256i sixty_four = _mm256_set1_epi64x(64), seven = _mm256_set1_epi64x(7);
  __m256i acc = _mm256_setr_epi64x(static_cast<int64_t>(w[0].acc), static_cast<int64_t>(w[1].acc),
                                   static_cast<int64_t>(w[2].acc), static_cast<int64_t>(w[3].acc));
  __m256i bits = _mm256_setr_epi64x(w[0].bits, w[1].bits, w[2].bits, w[3].bits);
  uint8_t *d0 = w[0].dst, *d1 = w[1].dst, *d2 = w[2].dst, *d3 = w[3].dst;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i x = _mm_sub_epi8(Load16Bytes(a + i), bias);  // 0..31
    const __m128i upper = _mm_cmpgt_epi8(x, fifteen);
    const __m128i l8 = Look32(len0, len1, x, upper);
    const __m128i clo = Look32(clo0, clo1, x, upper), chi = Look32(chi0, chi1, x, upper);
    // 32-bit lanes: symbols 0-7 (ca, la) and 8-15 (cb, lb).
    const __m256i ca = _mm256_cvtepu16_epi32(_mm_unpacklo_epi8(clo, chi));
    const __m256i cb = _mm256_cvtepu16_epi32(_mm_unpackhi_epi8(clo, chi));
    const __m256i la = _mm256_cvtepu8_epi32(l8);
    const __m256i lb = _mm256_cvtepu8_epi32(_mm_srli_si128(l8, 8));
    // Lane k < 4: symbols k then k + 4; lane 4 + k: symbols 8 + k then 12 + k (stream k).
    const __m256i c1 = _mm256_permute2x128_si256(ca, cb, 0x20);
    const __m256i c2 = _mm256_permute2x128_si256(ca, cb, 0x31);
    const __m256i l1 = _mm256_permute2x128_si256(la, lb, 0x20);
    const __m256i l2 = _mm256_permute2x128_si256(la, lb, 0x31);
    const __m256i pc = _mm256_or_si256(_mm256_sllv_epi32(c1, l2), c2);  // <= 22 bits
    const __m256i pl = _mm256_add_epi32(l1, l2);
    // 64-bit lane k: stream k's four codes in order.
    const __m256i pl_first = _mm256_cvtepu32_epi64(_mm256_castsi256_si128(pl));
    const __m256i pl_second = _mm256_cvtepu32_epi64(_mm256_extracti128_si256(pl, 1));
    const __m256i qc = _mm256_or_si256(
        _mm256_sllv_epi64(_mm256_cvtepu32_epi64(_mm256_castsi256_si128(pc)), pl_second),
        _mm256_cvtepu32_epi64(_mm256_extracti128_si256(pc, 1)));
    const __m256i ql = _mm256_add_epi64(pl_first, pl_second);
    acc = _mm256_or_si256(_mm256_sllv_epi64(acc, ql), qc);
    bits = _mm256_add_epi64(bits, ql);
    // Flush (a shift by 64 gives 0 here, where Flush's shift would be undefined).
    const __m256i out =
        _mm256_shuffle_epi8(_mm256_sllv_epi64(acc, _mm256_sub_epi64(sixty_four, bits)), bswap);
    const __m128i out01 = _mm256_castsi256_si128(out), out23 = _mm256_extracti128_si256(out, 1);
    const uint64_t o0 = static_cast<uint64_t>(_mm_cvtsi128_si64(out01));
    const uint64_t o1 = static_cast<uint64_t>(_mm_extract_epi64(out01, 1));
    const uint64_t o2 = static_cast<uint64_t>(_mm_cvtsi128_si64(out23));
    const uint64_t o3 = static_cast<uint64_t>(_mm_extract_epi64(out23, 1));
    std::memcpy(d0, &o0, 8);
    std::memcpy(d1, &o1, 8);
    std::memcpy(d2, &o2, 8);
    std::memcpy(d3, &o3, 8);
    const __m256i whole = _mm256_srli_epi64(bits, 3);
    const __m128i whole01 = _mm256_castsi256_si128(whole);
    const __m128i whole23 = _mm256_extracti128_si256(whole, 1);
    d0 += _mm_cvtsi128_si64(whole01);
    d1 += _mm_extract_epi64(whole01, 1);
    d2 += _mm_cvtsi128_si64(whole23);
    d3 += _mm_extract_epi64(whole23, 1);
    bits = _mm256_and_si256(bits, seven);
  }
  alignas(32) uint64_t acc_out[4], bits_out[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(acc_out), acc);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bits_out), bits);
  uint8_t* const d[kStreams] = {d0, d1, d2, d3};
  for (int k = 0; k < kStreams; ++k) {
    w[k].acc = acc_out[k];
    w[k].bits = static_cast<uint32_t>(bits_out[k]);
    w[k].dst = d[k];
  }
  EncodeStreamsImpl(a, n, code, len, w, i);
}
#endif

// Mode 2: `p` is just past the mode byte. Plane A is decoded into the upper half of `out` and
// merged with plane B in place.
absl::Status DecodeHuffman(const SegmentShape& shape, const uint8_t* const base, size_t p,
                           const size_t end, std::byte* out, bool bmi2) {
  const size_t n = shape.Elements();
  if (end - p < 2) return absl::InvalidArgumentError("lossless: truncated code table");
  const uint32_t lo = base[p], hi = base[p + 1];
  p += 2;
  const size_t nibble_bytes = (hi - lo + 2) / 2;
  if (hi < lo || end - p < nibble_bytes) {
    return absl::InvalidArgumentError("lossless: bad code table range");
  }
  uint8_t len[256] = {};
  uint32_t kraft = 0;
  for (uint32_t s = lo; s <= hi; ++s) {
    const uint32_t j = s - lo;
    len[s] = (base[p + j / 2] >> (4 * (j & 1))) & 0xF;
    if (len[s] > kMaxCodeBits) return absl::InvalidArgumentError("lossless: code length over 11");
    if (len[s] != 0) kraft += 1u << (kMaxCodeBits - len[s]);
  }
  if ((hi - lo) % 2 == 0 && (base[p + nibble_bytes - 1] >> 4) != 0) {
    return absl::InvalidArgumentError("lossless: unused code length nibble is not 0");
  }
  p += nibble_bytes;
  if (kraft != (1u << kMaxCodeBits)) {
    return absl::InvalidArgumentError("lossless: code lengths do not form a complete code");
  }
  // The code of s, read as the top len[s] of 11 bits, owns the table run starting at
  // code << (11 - len); a complete code tiles the table exactly.
  uint32_t code[256], len32[256];
  CanonicalCodes(len, lo, hi, code, len32);
  uint16_t tab[1u << kMaxCodeBits];
  for (uint32_t s = lo; s <= hi; ++s) {
    if (len[s] == 0) continue;
    const uint32_t shift = kMaxCodeBits - len[s];
    std::fill(tab + (code[s] << shift), tab + ((code[s] + 1) << shift),
              static_cast<uint16_t>(len[s] | (s << 8)));
  }
  if (end - p < 4 * kStreams) return absl::InvalidArgumentError("lossless: truncated stream sizes");
  uint64_t size[kStreams], total = 0;
  for (int k = 0; k < kStreams; ++k) {
    uint32_t v;
    std::memcpy(&v, base + p + 4 * k, 4);
    size[k] = v;
    total += v;
  }
  p += 4 * kStreams;
  if (end - p != total + n) return absl::InvalidArgumentError("lossless: stream sizes do not add up");
  BitReader r[kStreams];
  size_t start[kStreams];
  for (int k = 0; k < kStreams; ++k) {
    start[k] = p;
    r[k].bit = 8 * uint64_t{p};
    p += size[k];
  }
  const uint8_t* plane_b = base + p;
  uint8_t* dst = reinterpret_cast<uint8_t*>(out) + n;
  (bmi2 ? DecodeSymbolsBmi2 : DecodeSymbolsGeneric)(r, n, tab, base, end, dst);
  for (int k = 0; k < kStreams; ++k) {
    // Bits consumed must end in the stream's last byte: not before it, not past it.
    const uint64_t used = r[k].bit - 8 * uint64_t{start[k]};
    if (used > 8 * size[k] || 8 * size[k] - used >= 8) {
      return absl::InvalidArgumentError("lossless: Huffman stream size mismatch");
    }
    // The encoder pads the last byte with zero bits: one accepted encoding per stream.
    const uint32_t pad = static_cast<uint32_t>(8 * size[k] - used);
    if (pad != 0 && (base[start[k] + size[k] - 1] & ((1u << pad) - 1)) != 0) {
      return absl::InvalidArgumentError("lossless: Huffman stream padding is not 0");
    }
  }
  MergePlanes(shape, dst, plane_b, out);
  return absl::OkStatus();
}

}  // namespace

void EncodeLossless(const SegmentShape& shape, const std::byte* in, std::string* payload,
                    bool bmi2) {
  const size_t n = shape.Elements();
  // Bytes one stream can take: ceil(n / 4) codes of <= kMaxCodeBits bits.
  const size_t stream_cap = ((n + kStreams - 1) / kStreams * kMaxCodeBits + 7) / 8;
  constexpr size_t kMaxHead = 3 + 128 + 4 * kStreams;  // mode, lo, hi, nibbles, stream sizes
  std::unique_ptr<uint8_t[]> big;
  // Plane A, plane B, the mode-2 header, then each stream's room plus 8 bytes for its writer's
  // word stores.
  uint8_t* const a = EncoderScratch(2 * n + kMaxHead + kStreams * (stream_cap + 8), &big);
  uint8_t* const b = a + n;
  // The BMI2 build goes with the SIMD paths (codec.cc: UseBmi2), so it counts plane A with
  // AVX2 where the CPU has it; the counts, and so the bytes, are the same either way.
  const bool avx2 = bmi2 && CpuHasAvx2();
  // Without AVX2 the split counts into histograms by position mod 8, per thread and zero
  // between calls: each call clears only the rows of its range, not all 8 KiB (which costs
  // something next to a 16-token segment's few thousand values).
  uint32_t (*const hist)[256] = avx2 ? nullptr : HistTables();
  const PlaneRange range = SplitPlanes(shape, in, a, b, hist);
  const uint32_t lo = range.lo, hi = range.hi;
  uint64_t counts[256];
  uint32_t present = 0;
  if (avx2 && lo <= hi) CountSymbolsAvx2(a, n, lo, hi, counts);
  for (uint32_t s = lo; s <= hi; ++s) {
    if (!avx2) {
      counts[s] = 0;
      for (int t = 0; t < kHistTables; ++t) {
        counts[s] += hist[t][s];
        hist[t][s] = 0;
      }
    }
    present += counts[s] != 0;
  }
  const size_t base = payload->size();
  if (present == 1 && n > 1) {  // mode 3: 1 byte instead of n
    payload->push_back(3);
    payload->push_back(static_cast<char>(lo));
    payload->append(reinterpret_cast<const char*>(b), n);
    return;
  }
  // Mode 2 unless its payload (after the mode byte) would take n bytes or more. Its stream
  // sizes are those the writer ends at; the total bits rule the mode out without writing when
  // even their sum's bytes are too many (the streams' byte sizes add up to at least that).
  const size_t head_bytes = 2 + (hi - lo + 2) / 2 + 4 * kStreams;
  uint32_t code[256], len32[256];
  uint8_t len[256];
  uint8_t* const head = b + n;
  BitWriter w[kStreams];
  size_t coded = 0;  // mode 2 bytes after the mode byte
  if (present >= 2) {
    HuffmanLengths(counts, lo, hi, len);
    uint64_t bits = 0;
    for (uint32_t s = lo; s <= hi; ++s) bits += counts[s] * len[s];
    if (head_bytes + (bits + 7) / 8 < n) {
      CanonicalCodes(len, lo, hi, code, len32);
      uint8_t* p = head + 1 + head_bytes;
      for (int k = 0; k < kStreams; ++k, p += stream_cap + 8) w[k].dst = p;
#if defined(__x86_64__)
      if (avx2 && hi - lo < kNarrowRange) {
        EncodeStreamsAvx2(a, n, lo, hi, code, len32, w);
      } else {
        (bmi2 ? EncodeStreamsBmi2 : EncodeStreamsGeneric)(a, n, code, len32, w);
      }
#else
      (bmi2 ? EncodeStreamsBmi2 : EncodeStreamsGeneric)(a, n, code, len32, w);
#endif
      coded = head_bytes;
      for (int k = 0; k < kStreams; ++k) {
        coded += w[k].dst - (head + 1 + head_bytes + k * (stream_cap + 8));
      }
    }
  }
  if (coded == 0 || coded >= n) {  // mode 0: plane A stored
    payload->reserve(base + 1 + 2 * n);
    payload->push_back(0);
    payload->append(reinterpret_cast<const char*>(a), 2 * n);  // a and b are adjacent
    return;
  }
  // The header goes to scratch and is appended with the streams and plane B: growing the
  // payload with resize() would first zero what is then overwritten.
  uint8_t* p = head;
  *p++ = 2;
  *p++ = static_cast<uint8_t>(lo);
  *p++ = static_cast<uint8_t>(hi);
  std::memset(p, 0, (hi - lo + 2) / 2);
  for (uint32_t s = lo; s <= hi; ++s) {
    p[(s - lo) / 2] |= static_cast<uint8_t>(len[s] << (4 * ((s - lo) & 1)));
  }
  p += (hi - lo + 2) / 2;
  const uint8_t* stream = head + 1 + head_bytes;
  size_t size[kStreams];
  for (int k = 0; k < kStreams; ++k, p += 4, stream += stream_cap + 8) {
    size[k] = w[k].dst - stream;
    const uint32_t v = static_cast<uint32_t>(size[k]);
    std::memcpy(p, &v, 4);
  }
  payload->reserve(base + 1 + coded + n);
  payload->append(reinterpret_cast<const char*>(head), p - head);
  stream = head + 1 + head_bytes;
  for (int k = 0; k < kStreams; ++k, stream += stream_cap + 8) {
    payload->append(reinterpret_cast<const char*>(stream), size[k]);
  }
  payload->append(reinterpret_cast<const char*>(b), n);
}

absl::Status DecodeLossless(const SegmentShape& shape, std::span<const std::byte> payload,
                            std::byte* out, bool bmi2) {
  const size_t n = shape.Elements();
  const uint8_t* const p = reinterpret_cast<const uint8_t*>(payload.data());
  const size_t size = payload.size();
  if (size < 1) return absl::InvalidArgumentError("lossless: empty payload");
  switch (p[0]) {
    case 0:
      if (size - 1 != 2 * n) {
        return absl::InvalidArgumentError("lossless: stored payload has the wrong size");
      }
      MergePlanes(shape, p + 1, p + 1 + n, out);
      return absl::OkStatus();
    case 1:
      return DecodeRans(shape, p + 1, p + size, out);
    case 2:
      return DecodeHuffman(shape, p, 1, size, out, bmi2);
    case 3: {
      if (size != 2 + n) return absl::InvalidArgumentError("lossless: constant plane has the wrong size");
      uint8_t* const a = reinterpret_cast<uint8_t*>(out) + n;
      std::memset(a, p[1], n);
      MergePlanes(shape, a, p + 2, out);
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("lossless: unknown mode ", p[0]));
  }
}
}  // namespace proxima::codec::internal
