// The `lossless` codec (docs/format.md: lossless): byte planes, the exponent plane coded with a
// 4-way interleaved order-0 rANS. Interleaving four states hides the latency of the dependent
// multiply/divide chain of one state; the byte-wise renormalisation keeps the decoder simple
// enough to check every read against the end of the stream.
#include <algorithm>
#include <array>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/internal/numeric.h"
#include "kernels/internal/segment_codecs.h"

namespace proxima::codec::internal {
namespace {

constexpr uint32_t kProbBits = 12;
constexpr uint32_t kProbScale = 1u << kProbBits;
constexpr uint32_t kRansL = 1u << 23;
constexpr int kStates = 4;

void SplitPlanes(const SegmentShape& shape, const std::byte* in, uint8_t* a, uint8_t* b) {
  const size_t n = shape.Elements();
  if (shape.dtype == numeric::kDtypeBf16) {
    for (size_t i = 0; i < n; ++i) {
      uint16_t v = Load16(in, i);
      a[i] = static_cast<uint8_t>(v >> 7);
      b[i] = static_cast<uint8_t>(((v >> 8) & 0x80) | (v & 0x7F));
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
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
  payload->clear();

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
  // rANS writes backwards; a symbol costs at most kProbBits bits plus renormalisation slack.
  std::vector<uint8_t> buf(2 * n + 64);
  uint8_t* end = buf.data() + buf.size();
  uint8_t* ptr = end;
  uint32_t x[kStates] = {kRansL, kRansL, kRansL, kRansL};
  for (size_t i = n; i-- > 0;) {
    uint32_t& st = x[i % kStates];
    uint32_t f = freq[a[i]];
    uint32_t x_max = ((kRansL >> kProbBits) << 8) * f;
    while (st >= x_max) {
      *--ptr = static_cast<uint8_t>(st);
      st >>= 8;
    }
    st = ((st / f) << kProbBits) + (st % f) + start[a[i]];
  }
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
    payload->reserve(1 + coded + n);
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
  // Per slot: frequency and offset inside the symbol's range (low/high 16 bits), and the symbol.
  std::vector<uint32_t> slot_fo(kProbScale);
  std::vector<uint8_t> slot_sym(kProbScale);
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
    for (uint32_t j = 0; j < f; ++j) {
      slot_fo[total + j] = f | (j << 16);
      slot_sym[total + j] = sym;
    }
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

  std::vector<uint8_t> a(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t& st = x[i % kStates];
    uint32_t slot = st & (kProbScale - 1);
    uint32_t fo = slot_fo[slot];
    a[i] = slot_sym[slot];
    st = (fo & 0xFFFFu) * (st >> kProbBits) + (fo >> 16);
    while (st < kRansL) {
      if (s == send) return absl::InvalidArgumentError("lossless: rANS stream overrun");
      st = (st << 8) | *s++;
    }
  }
  if (s != send) return absl::InvalidArgumentError("lossless: rANS stream has trailing bytes");
  for (int k = 0; k < kStates; ++k) {
    if (x[k] != kRansL) return absl::InvalidArgumentError("lossless: rANS final state mismatch");
  }
  MergePlanes(shape, a.data(), plane_b, out);
  return absl::OkStatus();
}

}  // namespace proxima::codec::internal
