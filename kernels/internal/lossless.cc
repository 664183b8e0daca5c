// The `lossless` codec (docs/format.md: lossless): byte planes, the exponent plane coded with a
// 4-way interleaved order-0 rANS. Interleaving four states hides the latency of the dependent
// multiply chain of one state; 16-bit renormalisation means at most one refill per symbol, done
// without a branch, so the decoder's speed does not hinge on branch prediction.
#include <algorithm>
#include <array>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
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

void SplitPlanes(const SegmentShape& shape, const std::byte* in, uint8_t* a, uint8_t* b) {
  const size_t n = shape.Elements();
  size_t i = 0;
#if defined(__SSE2__)
  // 8 values per step with baseline SSE2 (every x86-64 CPU has it, so no dispatch is needed);
  // GCC -O2 leaves the scalar loop below unvectorised.
  const bool bf16 = shape.dtype == numeric::kDtypeBf16;
  for (; i + 8 <= n; i += 8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i));
    __m128i hi, lo;
    if (bf16) {
      hi = _mm_and_si128(_mm_srli_epi16(v, 7), _mm_set1_epi16(0xFF));
      lo = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 8), _mm_set1_epi16(0x80)),
                        _mm_and_si128(v, _mm_set1_epi16(0x7F)));
    } else {
      hi = _mm_srli_epi16(v, 8);
      lo = _mm_and_si128(v, _mm_set1_epi16(0xFF));
    }
    _mm_storel_epi64(reinterpret_cast<__m128i*>(a + i), _mm_packus_epi16(hi, hi));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(b + i), _mm_packus_epi16(lo, lo));
  }
#endif
  if (shape.dtype == numeric::kDtypeBf16) {
    for (; i < n; ++i) {
      uint16_t v = Load16(in, i);
      a[i] = static_cast<uint8_t>(v >> 7);
      b[i] = static_cast<uint8_t>(((v >> 8) & 0x80) | (v & 0x7F));
    }
  } else {
    for (; i < n; ++i) {
      uint16_t v = Load16(in, i);
      a[i] = static_cast<uint8_t>(v >> 8);
      b[i] = static_cast<uint8_t>(v);
    }
  }
}

void MergePlanes(const SegmentShape& shape, const uint8_t* a, const uint8_t* b, std::byte* out) {
  const size_t n = shape.Elements();
  if (shape.dtype == numeric::kDtypeBf16) {
    for (size_t i = 0; i < n; ++i) {
      uint16_t v =
          static_cast<uint16_t>(((b[i] & 0x80u) << 8) | (uint32_t{a[i]} << 7) | (b[i] & 0x7Fu));
      Store16(out, i, v);
    }
  } else {
    for (size_t i = 0; i < n; ++i) Store16(out, i, static_cast<uint16_t>((a[i] << 8) | b[i]));
  }
}

// Normalises symbol counts to frequencies summing to kProbScale; every present symbol keeps >= 1.
std::array<uint32_t, 256> NormalizeFrequencies(const std::array<size_t, 256>& counts, size_t n) {
  std::array<uint32_t, 256> freq{};
  uint32_t sum = 0;
  for (int s = 0; s < 256; ++s) {
    if (counts[s] == 0) continue;
    freq[s] = std::max<uint32_t>(1, static_cast<uint32_t>(counts[s] * kProbScale / n));
    sum += freq[s];
  }
  while (sum != kProbScale) {
    int best = -1;
    for (int s = 0; s < 256; ++s) {
      if (freq[s] == 0 || (sum > kProbScale && freq[s] == 1)) continue;
      if (best < 0 || freq[s] > freq[best]) best = s;
    }
    if (sum > kProbScale) {
      --freq[best];
      --sum;
    } else {
      ++freq[best];
      ++sum;
    }
  }
  return freq;
}

void PutU16(std::string* out, uint16_t v) { out->append(reinterpret_cast<const char*>(&v), 2); }
void PutU32(std::string* out, uint32_t v) { out->append(reinterpret_cast<const char*>(&v), 4); }

}  // namespace

void EncodeLossless(const SegmentShape& shape, const std::byte* in, std::string* payload) {
  const size_t n = shape.Elements();
  std::vector<uint8_t> a(n), b(n);
  SplitPlanes(shape, in, a.data(), b.data());

  std::array<size_t, 256> counts{};
  for (uint8_t s : a) ++counts[s];
  std::array<uint32_t, 256> freq = NormalizeFrequencies(counts, n);
  std::array<uint32_t, 256> start{};
  uint32_t n_sym = 0;
  for (uint32_t s = 0, acc = 0; s < 256; ++s) {
    start[s] = acc;
    acc += freq[s];
    n_sym += freq[s] != 0;
  }
  // Division-free encoding (ryg's rANS reciprocal form): q = x / freq by a multiply.
  struct EncSymbol {
    uint32_t x_max, rcp_freq, bias, cmpl_freq, rcp_shift;
  };
  std::array<EncSymbol, 256> sym{};
  for (uint32_t v = 0; v < 256; ++v) {
    const uint32_t f = freq[v];
    if (f == 0) continue;
    EncSymbol& e = sym[v];
    e.x_max = ((kRansL >> kProbBits) << 16) * f;  // f << 20; wraps to 0 for f = 4096
    e.cmpl_freq = kProbScale - f;
    if (f < 2) {
      e.rcp_freq = ~0u;
      e.rcp_shift = 0;
      e.bias = start[v] + kProbScale - 1;
    } else {
      uint32_t shift = 0;
      while (f > (1u << shift)) ++shift;
      e.rcp_freq = static_cast<uint32_t>(((uint64_t{1} << (shift + 31)) + f - 1) / f);
      e.rcp_shift = shift - 1;
      e.bias = start[v];
    }
  }
  // rANS writes backwards, 16-bit words, at most one per symbol.
  std::vector<uint8_t> buf(2 * n + 64);
  uint8_t* end = buf.data() + buf.size();
  uint8_t* ptr = end;
  // Encodes symbol a[i] into state st (renormalising first); rANS runs backwards over the data.
  auto put = [&sym, &ptr, &a](uint32_t st, size_t i) -> uint32_t {
    const EncSymbol& e = sym[a[i]];
    // x_max = f << 20 wraps to 0 only for f = 4096 (a single symbol), whose state never grows.
    if (e.x_max != 0 && st >= e.x_max) {
      ptr -= 2;
      const uint16_t w = static_cast<uint16_t>(st);
      std::memcpy(ptr, &w, 2);
      st >>= 16;
    }
    const uint32_t q =
        static_cast<uint32_t>((static_cast<uint64_t>(st) * e.rcp_freq) >> 32) >> e.rcp_shift;
    return st + e.bias + q * e.cmpl_freq;
  };
  // States in named locals (not an indexed array) so they stay in registers.
  uint32_t x0 = kRansL, x1 = kRansL, x2 = kRansL, x3 = kRansL;
  size_t i = n;
  while (i % kStates != 0) {  // the tail: symbol i goes to state i % 4
    --i;
    switch (i % kStates) {
      case 0:
        x0 = put(x0, i);
        break;
      case 1:
        x1 = put(x1, i);
        break;
      case 2:
        x2 = put(x2, i);
        break;
      default:
        x3 = put(x3, i);
        break;
    }
  }
  while (i > 0) {
    i -= kStates;
    x3 = put(x3, i + 3);
    x2 = put(x2, i + 2);
    x1 = put(x1, i + 1);
    x0 = put(x0, i);
  }
  const uint32_t x[kStates] = {x0, x1, x2, x3};
  for (int k = kStates - 1; k >= 0; --k) {
    ptr -= 4;
    std::memcpy(ptr, &x[k], 4);
  }
  const size_t rans_bytes = static_cast<size_t>(end - ptr);
  const size_t coded = 2 + 3 * size_t{n_sym} + 4 + rans_bytes;
  if (coded >= n) {
    payload->push_back(0);
    payload->append(reinterpret_cast<const char*>(a.data()), n);
  } else {
    payload->reserve(payload->size() + 1 + coded + n);
    payload->push_back(1);
    PutU16(payload, static_cast<uint16_t>(n_sym));
    for (uint32_t s = 0; s < 256; ++s) {
      if (freq[s] == 0) continue;
      payload->push_back(static_cast<char>(s));
      PutU16(payload, static_cast<uint16_t>(freq[s]));
    }
    PutU32(payload, static_cast<uint32_t>(rans_bytes));
    payload->append(reinterpret_cast<const char*>(ptr), rans_bytes);
  }
  payload->append(reinterpret_cast<const char*>(b.data()), n);
}

absl::Status DecodeLossless(const SegmentShape& shape, std::span<const std::byte> payload,
                            std::byte* out) {
  const size_t n = shape.Elements();
  const uint8_t* p = reinterpret_cast<const uint8_t*>(payload.data());
  const uint8_t* const pend = p + payload.size();
  auto need = [&](size_t bytes) { return static_cast<size_t>(pend - p) >= bytes; };
  if (!need(1)) return absl::InvalidArgumentError("lossless: empty payload");
  const uint8_t mode = *p++;
  if (mode == 0) {
    if (static_cast<size_t>(pend - p) != 2 * n) {
      return absl::InvalidArgumentError("lossless: stored payload has the wrong size");
    }
    MergePlanes(shape, p, p + n, out);
    return absl::OkStatus();
  }
  if (mode != 1) return absl::InvalidArgumentError(absl::StrCat("lossless: unknown mode ", mode));

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

}  // namespace proxima::codec::internal
