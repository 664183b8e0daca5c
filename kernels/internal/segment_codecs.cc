// Scalar reference for the fixed-size codecs (fp8, int8, int4/int2, star): it gives the results
// docs/format.md section 3 defines, and the SIMD and CUDA paths reproduce them bit for bit.
#include "kernels/internal/segment_codecs.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/dtype_dispatch.h"
#include "kernels/internal/k4v3_math.h"
#include "kernels/internal/numeric.h"

namespace proxima::codec::internal {
namespace {

using numeric::ClampQ;
using numeric::DtypeToFloat;
using numeric::FloatToDtype;
using numeric::IsFiniteFloat;
using numeric::RoundNearestEven;
using numeric::RoundUpDtype;

size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

// A dtype value is non-finite exactly when its exponent bits are all ones (bf16 and fp16 alike),
// so one branch-free pass over the bits (which the compiler vectorises) checks the common case;
// the index of the first bad value is looked up only on failure.
absl::Status CheckFiniteDtype(const SegmentShape& shape, const std::byte* p, size_t count,
                              const char* what) {
  const uint16_t exp_mask = shape.dtype == numeric::kDtypeBf16 ? 0x7F80 : 0x7C00;
  uint32_t bad = 0;
  for (size_t i = 0; i < count; ++i) bad |= (Load16(p, i) & exp_mask) == exp_mask;
  if (bad == 0) return absl::OkStatus();
  for (size_t i = 0; i < count; ++i) {
    if ((Load16(p, i) & exp_mask) == exp_mask) {
      return absl::InvalidArgumentError(absl::StrCat("non-finite ", what, " at index ", i));
    }
  }
  return absl::OkStatus();  // unreachable
}

// Writes a `bits`-wide value (bits <= 8) LSB-first into a zeroed buffer: one byte, or two when
// the value straddles a byte boundary (star's 3-bit indices).
void PutBits(std::byte* buf, size_t index, uint32_t bits, uint32_t value) {
  const size_t pos = index * bits;
  const uint32_t v = value << (pos % 8);
  buf[pos / 8] |= std::byte{static_cast<uint8_t>(v)};
  if (pos % 8 + bits > 8) buf[pos / 8 + 1] |= std::byte{static_cast<uint8_t>(v >> 8)};
}
uint32_t GetBits(const std::byte* buf, size_t index, uint32_t bits) {
  const size_t pos = index * bits;
  uint32_t w = static_cast<uint32_t>(buf[pos / 8]);
  if (pos % 8 + bits > 8) w |= static_cast<uint32_t>(buf[pos / 8 + 1]) << 8;
  return (w >> (pos % 8)) & ((1u << bits) - 1u);
}

// Packs n codes of `bits` bits (1, 2 or 4) that belong at value indices [first, first + n) into a
// zeroed buffer: whole bytes at a time once `first + k` reaches a byte boundary.
void PackCodes(std::byte* buf, size_t first, uint32_t bits, const uint8_t* codes, size_t n) {
  const uint32_t per = 8 / bits;
  size_t k = 0;
  for (; k < n && (first + k) % per != 0; ++k) PutBits(buf, first + k, bits, codes[k]);
  std::byte* out = buf + (first + k) / per;
  for (; k + per <= n; k += per) {
    uint32_t b = 0;
    for (uint32_t m = 0; m < per; ++m) b |= uint32_t{codes[k + m]} << (m * bits);
    *out++ = std::byte{static_cast<uint8_t>(b)};
  }
  for (; k < n; ++k) PutBits(buf, first + k, bits, codes[k]);
}
// The inverse: codes of value indices [first, first + n).
void UnpackCodes(const std::byte* buf, size_t first, uint32_t bits, uint8_t* codes, size_t n) {
  const uint32_t per = 8 / bits, mask = (1u << bits) - 1u;
  size_t k = 0;
  for (; k < n && (first + k) % per != 0; ++k) codes[k] = GetBits(buf, first + k, bits);
  const std::byte* in = buf + (first + k) / per;
  for (; k + per <= n; k += per) {
    const uint32_t b = static_cast<uint32_t>(*in++);
    for (uint32_t m = 0; m < per; ++m)
      codes[k + m] = static_cast<uint8_t>((b >> (m * bits)) & mask);
  }
  for (; k < n; ++k) codes[k] = GetBits(buf, first + k, bits);
}

// The format rounds the clamped quotient: RoundNearestEven(ClampQ(v, lo, hi)). With integer
// bounds, clamping the rounded value gives the same integer for every v (rounding is monotonic
// and leaves integers alone; NaN becomes 0 either way; only the sign of a zero can differ,
// which the conversion to an integer drops), and in this order the compiler vectorises the
// loops: rounding after the clamp lets it thread the clamped constants through the rounding
// into branches.
float RoundThenClamp(float v, float lo, float hi) { return ClampQ(RoundNearestEven(v), lo, hi); }

int8_t QuantizeInt8(float x, float divisor) {
  return static_cast<int8_t>(RoundThenClamp(x / divisor, -127.0f, 127.0f));
}
}  // namespace

IntNLayout IntNLayoutFor(const SegmentShape& shape, uint32_t bits) {
  IntNLayout l;
  l.bits = bits;
  if (!shape.is_value) {
    l.group_len = std::min(shape.group, shape.tokens);
    l.num_groups = static_cast<uint32_t>(CeilDiv(shape.tokens, l.group_len));
    l.meta_count = size_t{l.num_groups} * shape.heads * shape.dim;
  } else {
    l.group_len = std::min(shape.group, shape.dim);
    l.num_groups = static_cast<uint32_t>(CeilDiv(shape.dim, l.group_len));
    l.meta_count = size_t{shape.tokens} * shape.heads * l.num_groups;
  }
  l.packed_bytes = CeilDiv(shape.Elements() * bits, 8);
  return l;
}

StarLayout StarLayoutFor(const SegmentShape& shape) {
  StarLayout l;
  uint32_t c = 1;
  while (c * 2 <= shape.tokens / 16 && c * 2 <= 16) c *= 2;
  l.centroids = c;
  l.index_bits = 0;
  while ((1u << l.index_bits) < c) ++l.index_bits;
  l.important = std::max<uint32_t>(1, shape.tokens / 32);
  const size_t t = shape.tokens, d = shape.dim, m = l.important;
  l.per_head_bytes = 2 * c + c * d + 2 * m + 2 * m + m * d + CeilDiv(t * l.index_bits, 8) + 2 * t +
                     CeilDiv(t * d, 8);
  return l;
}

size_t FixedPayloadBytes(CodecId codec, const SegmentShape& shape) {
  const size_t n = shape.Elements();
  switch (codec) {
    case CodecId::kRaw:
      return 2 * n;
    case CodecId::kFp8:
      return 4 * size_t{shape.heads} + n;
    case CodecId::kInt8:
      return 2 * (shape.is_value ? size_t{shape.tokens} * shape.heads
                                 : size_t{shape.heads} * shape.dim) +
             n;
    case CodecId::kInt4:
    case CodecId::kInt2: {
      IntNLayout l = IntNLayoutFor(shape, codec == CodecId::kInt4 ? 4 : 2);
      return 4 * l.meta_count + l.packed_bytes;
    }
    case CodecId::kStar:
      return StarLayoutFor(shape).per_head_bytes * shape.heads;
    case CodecId::kK4v3:
      if (!shape.is_value) return kK4v3KHeaderBytes + FixedPayloadBytes(CodecId::kInt4, shape);
      return 2 * size_t{shape.tokens} * shape.heads + CeilDiv(3 * n, 8);
    case CodecId::kLossless:
      return 0;
  }
  return 0;
}

size_t LeadingMetadataBytes(CodecId codec, const SegmentShape& shape) {
  switch (codec) {
    case CodecId::kFp8:
    case CodecId::kInt8:
      return FixedPayloadBytes(codec, shape) - shape.Elements();
    case CodecId::kInt4:
    case CodecId::kInt2:
      return 4 * IntNLayoutFor(shape, codec == CodecId::kInt4 ? 4 : 2).meta_count;
    case CodecId::kK4v3:
      return shape.is_value ? 2 * size_t{shape.tokens} * shape.heads
                            : kK4v3KHeaderBytes + LeadingMetadataBytes(CodecId::kInt4, shape);
    case CodecId::kRaw:
    case CodecId::kLossless:
    case CodecId::kStar:
      return 0;
  }
  return 0;
}

// ---------------------------------------------------------------- validation

absl::Status ValidateFp8(const SegmentShape& shape, const std::byte* payload) {
  for (uint32_t h = 0; h < shape.heads; ++h) {
    if (!IsFiniteFloat(LoadF32(payload, h))) {
      return absl::InvalidArgumentError(absl::StrCat("fp8: non-finite scale for head ", h));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateInt8(const SegmentShape& shape, const std::byte* payload) {
  size_t count =
      shape.is_value ? size_t{shape.tokens} * shape.heads : size_t{shape.heads} * shape.dim;
  return CheckFiniteDtype(shape, payload, count, "int8 scale");
}

absl::Status ValidateIntN(const SegmentShape& shape, uint32_t bits, const std::byte* payload) {
  IntNLayout l = IntNLayoutFor(shape, bits);
  if (absl::Status s = CheckFiniteDtype(shape, payload, 2 * l.meta_count, "int4/int2 scale or min");
      !s.ok()) {
    return s;
  }
  size_t used_bits = shape.Elements() * bits % 8;
  if (used_bits != 0) {
    uint8_t last = static_cast<uint8_t>(payload[4 * l.meta_count + l.packed_bytes - 1]);
    if ((last >> used_bits) != 0) {
      return absl::InvalidArgumentError("int4/int2: nonzero padding bits");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateStar(const SegmentShape& shape, const std::byte* payload) {
  StarLayout l = StarLayoutFor(shape);
  const size_t c = l.centroids, d = shape.dim, m = l.important, t = shape.tokens;
  for (uint32_t h = 0; h < shape.heads; ++h) {
    const std::byte* p = payload + h * l.per_head_bytes;
    if (absl::Status s = CheckFiniteDtype(shape, p, c, "star centroid scale"); !s.ok()) return s;
    p += 2 * c + c * d;
    for (size_t i = 0; i < m; ++i) {
      if (Load16(p, i) >= t) {
        return absl::InvalidArgumentError(
            absl::StrCat("star: important token index ", Load16(p, i), " >= ", t));
      }
    }
    p += 2 * m;
    if (absl::Status s = CheckFiniteDtype(shape, p, m, "star important scale"); !s.ok()) return s;
    p += 2 * m + m * d + CeilDiv(t * l.index_bits, 8);
    if (absl::Status s = CheckFiniteDtype(shape, p, t, "star residual scale"); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// The scalar codecs below are templated on the dtype (kDt) so that the conversions inline
// without a per-value branch, and walk the segment row by row ([token][head][dim] order, with
// per-channel state in small arrays for K) so that the inner loops run over contiguous values.
// Each value gets the result docs/format.md defines. Where the operations differ from its
// wording (a maximum taken per channel first, RoundThenClamp, numeric::ClampE4m3) the comment
// there says why the result cannot; GoldenTest and the SIMD identity tests hold the bytes.

// ---------------------------------------------------------------- fp8

namespace {

template <uint8_t kDt>
void EncodeFp8T(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  std::byte* codes = payload + 4 * size_t{H};
  // The largest finite |x| per head: first per (head, channel) over tokens, element-wise (the
  // compiler vectorises it), then over channels. The maximum of non-negative finite values does
  // not depend on the order it is taken in.
  const size_t HD = size_t{H} * D;
  std::vector<float> lane_max(HD, 0.0f), amax(H, 0.0f);
  for (uint32_t t = 0; t < T; ++t) {
    for (size_t c = 0; c < HD; ++c) {
      const float a = std::fabs(DtypeToFloat(kDt, Load16(in, t * HD + c)));
      lane_max[c] = IsFiniteFloat(a) & (a > lane_max[c]) ? a : lane_max[c];
    }
  }
  for (uint32_t h = 0; h < H; ++h) {
    for (uint32_t d = 0; d < D; ++d) amax[h] = std::max(amax[h], lane_max[size_t{h} * D + d]);
  }
  std::vector<float> divisor(H);
  for (uint32_t h = 0; h < H; ++h) {
    float scale = amax[h] / 448.0f;
    StoreF32(payload, h, scale);
    divisor[h] = scale == 0.0f ? 1.0f : scale;
  }
  for (uint32_t t = 0; t < T; ++t) {
    for (uint32_t h = 0; h < H; ++h) {
      const size_t base = (size_t{t} * H + h) * D;
      const float div = divisor[h];
      for (uint32_t d = 0; d < D; ++d) {
        const float y = numeric::ClampE4m3(DtypeToFloat(kDt, Load16(in, base + d)) / div);
        codes[base + d] = std::byte{numeric::FloatToE4m3(y)};
      }
    }
  }
}

// numeric::E4m3ToFloat of every code, built from it once: a load per value instead of its branch.
const float* E4m3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (uint32_t c = 0; c < 256; ++c) t[c] = numeric::E4m3ToFloat(static_cast<uint8_t>(c));
    return t;
  }();
  return table.data();
}

template <uint8_t kDt>
void DecodeFp8T(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const std::byte* codes = payload + 4 * size_t{H};
  const float* e4m3 = E4m3Table();
  for (uint32_t t = 0; t < T; ++t) {
    for (uint32_t h = 0; h < H; ++h) {
      const size_t base = (size_t{t} * H + h) * D;
      const float scale = LoadF32(payload, h);
      for (uint32_t d = 0; d < D; ++d) {
        const float x = e4m3[static_cast<uint8_t>(codes[base + d])] * scale;
        Store16(out, base + d, FloatToDtype(kDt, x));
      }
    }
  }
}

}  // namespace

void EncodeFp8Scalar(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, return, EncodeFp8T<kDt>(shape, in, payload));
}

void DecodeFp8Scalar(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, return, DecodeFp8T<kDt>(shape, payload, out));
}

// ---------------------------------------------------------------- int8

namespace {

float FiniteAbs(float x) {
  const float a = std::fabs(x);
  return IsFiniteFloat(a) ? a : 0.0f;
}

template <uint8_t kDt>
void EncodeInt8T(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const size_t HD = size_t{H} * D;
  if (!shape.is_value) {  // K: one scale per channel (h, d) over tokens
    std::byte* q = payload + 2 * HD;
    std::vector<float> amax(HD, 0.0f), divisor(HD);
    for (uint32_t t = 0; t < T; ++t) {
      for (size_t c = 0; c < HD; ++c) {
        amax[c] = std::max(amax[c], FiniteAbs(DtypeToFloat(kDt, Load16(in, t * HD + c))));
      }
    }
    for (size_t c = 0; c < HD; ++c) {
      const Int8Row row = Int8RowScale(kDt, amax[c]);
      Store16(payload, c, row.scale);
      divisor[c] = row.divisor;
    }
    for (uint32_t t = 0; t < T; ++t) {
      for (size_t c = 0; c < HD; ++c) {
        const size_t i = t * HD + c;
        q[i] = std::byte(
            static_cast<uint8_t>(QuantizeInt8(DtypeToFloat(kDt, Load16(in, i)), divisor[c])));
      }
    }
  } else {  // V: one scale per token (t, h) over channels
    std::byte* q = payload + 2 * size_t{T} * H;
    for (size_t row_index = 0; row_index < size_t{T} * H; ++row_index) {
      const size_t base = row_index * D;
      float amax = 0.0f;
      for (uint32_t d = 0; d < D; ++d) {
        amax = std::max(amax, FiniteAbs(DtypeToFloat(kDt, Load16(in, base + d))));
      }
      const Int8Row row = Int8RowScale(kDt, amax);
      Store16(payload, row_index, row.scale);
      for (uint32_t d = 0; d < D; ++d) {
        q[base + d] = std::byte(static_cast<uint8_t>(
            QuantizeInt8(DtypeToFloat(kDt, Load16(in, base + d)), row.divisor)));
      }
    }
  }
}

template <uint8_t kDt>
void DecodeInt8T(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const size_t HD = size_t{H} * D;
  if (!shape.is_value) {
    const std::byte* q = payload + 2 * HD;
    std::vector<float> scale(HD);
    for (size_t c = 0; c < HD; ++c) scale[c] = DtypeToFloat(kDt, Load16(payload, c));
    for (uint32_t t = 0; t < T; ++t) {
      for (size_t c = 0; c < HD; ++c) {
        const size_t i = t * HD + c;
        const float x = static_cast<float>(static_cast<int8_t>(q[i])) * scale[c];
        Store16(out, i, FloatToDtype(kDt, x));
      }
    }
  } else {
    const std::byte* q = payload + 2 * size_t{T} * H;
    for (size_t row_index = 0; row_index < size_t{T} * H; ++row_index) {
      const size_t base = row_index * D;
      const float scale = DtypeToFloat(kDt, Load16(payload, row_index));
      for (uint32_t d = 0; d < D; ++d) {
        const float x = static_cast<float>(static_cast<int8_t>(q[base + d])) * scale;
        Store16(out, base + d, FloatToDtype(kDt, x));
      }
    }
  }
}

}  // namespace

void EncodeInt8Scalar(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, return, EncodeInt8T<kDt>(shape, in, payload));
}

void DecodeInt8Scalar(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, return, DecodeInt8T<kDt>(shape, payload, out));
}

// ---------------------------------------------------------------- int4 / int2

namespace {

template <uint8_t kDt>
void EncodeIntNT(const SegmentShape& shape, uint32_t bits, const std::byte* in,
                 std::byte* payload) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const size_t HD = size_t{H} * D;
  const IntNLayout l = IntNLayoutFor(shape, bits);
  const float qmax = static_cast<float>((1u << bits) - 1);
  std::byte* scales = payload;
  std::byte* mins = payload + 2 * l.meta_count;
  std::byte* packed = payload + 4 * l.meta_count;
  std::memset(packed, 0, l.packed_bytes);
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<uint8_t> codes(shape.is_value ? D : HD);  // one row's codes, packed together
  // The finite min and max of one group, element by element in index order.
  auto extend = [](float x, float& mn, float& mx) {
    const bool finite = IsFiniteFloat(x);
    mn = finite & (x < mn) ? x : mn;  // std::min(mn, x) and std::max(mx, x), as selects
    mx = finite & (mx < x) ? x : mx;
  };
  auto params = [&](float mn, float mx, size_t meta_index) {
    if (mn > mx) mn = mx = 0.0f;  // no finite value
    const IntNGroup g = IntNGroupParams(kDt, mn, mx, qmax);
    Store16(scales, meta_index, g.scale);
    Store16(mins, meta_index, g.min);
    return g;
  };
  auto quantize = [&](size_t i, float min_f, float divisor) {
    const float x = DtypeToFloat(kDt, Load16(in, i));
    return static_cast<uint8_t>(RoundThenClamp((x - min_f) / divisor, 0.0f, qmax));
  };
  if (!shape.is_value) {  // K: groups of group_len tokens per channel
    std::vector<float> mn(HD), mx(HD), min_f(HD), divisor(HD);
    for (uint32_t j = 0; j < l.num_groups; ++j) {
      const uint32_t t0 = j * l.group_len, t1 = std::min(t0 + l.group_len, T);
      std::fill(mn.begin(), mn.end(), inf);
      std::fill(mx.begin(), mx.end(), -inf);
      for (uint32_t t = t0; t < t1; ++t) {
        for (size_t c = 0; c < HD; ++c) {
          extend(DtypeToFloat(kDt, Load16(in, t * HD + c)), mn[c], mx[c]);
        }
      }
      for (size_t c = 0; c < HD; ++c) {
        const IntNGroup g = params(mn[c], mx[c], j * HD + c);
        min_f[c] = g.min_f;
        divisor[c] = g.divisor;
      }
      for (uint32_t t = t0; t < t1; ++t) {
        for (size_t c = 0; c < HD; ++c) codes[c] = quantize(t * HD + c, min_f[c], divisor[c]);
        PackCodes(packed, t * HD, bits, codes.data(), HD);
      }
    }
  } else {  // V: groups of group_len channels per token
    for (size_t row = 0; row < size_t{T} * H; ++row) {
      for (uint32_t j = 0; j < l.num_groups; ++j) {
        const size_t d0 = row * D + j * l.group_len;
        const size_t d1 = row * D + std::min(j * l.group_len + l.group_len, D);
        float mn = inf, mx = -inf;
        for (size_t i = d0; i < d1; ++i) extend(DtypeToFloat(kDt, Load16(in, i)), mn, mx);
        const IntNGroup g = params(mn, mx, row * l.num_groups + j);
        for (size_t i = d0; i < d1; ++i) codes[i - row * D] = quantize(i, g.min_f, g.divisor);
      }
      PackCodes(packed, row * D, bits, codes.data(), D);
    }
  }
}

template <uint8_t kDt>
void DecodeIntNT(const SegmentShape& shape, uint32_t bits, const std::byte* payload,
                 std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const size_t HD = size_t{H} * D;
  const IntNLayout l = IntNLayoutFor(shape, bits);
  const std::byte* scales = payload;
  const std::byte* mins = payload + 2 * l.meta_count;
  const std::byte* packed = payload + 4 * l.meta_count;
  std::vector<uint8_t> codes(shape.is_value ? D : HD);  // one row's codes, unpacked together
  auto dequantize = [&](size_t i, uint8_t code, float scale, float mn) {
    const float x = static_cast<float>(code) * scale + mn;
    Store16(out, i, FloatToDtype(kDt, x));
  };
  if (!shape.is_value) {
    std::vector<float> scale(HD), mn(HD);
    for (uint32_t t = 0; t < T; ++t) {
      if (t % l.group_len == 0) {
        const size_t m0 = size_t{t / l.group_len} * HD;
        for (size_t c = 0; c < HD; ++c) {
          scale[c] = DtypeToFloat(kDt, Load16(scales, m0 + c));
          mn[c] = DtypeToFloat(kDt, Load16(mins, m0 + c));
        }
      }
      UnpackCodes(packed, t * HD, bits, codes.data(), HD);
      for (size_t c = 0; c < HD; ++c) dequantize(t * HD + c, codes[c], scale[c], mn[c]);
    }
  } else {
    for (size_t row = 0; row < size_t{T} * H; ++row) {
      UnpackCodes(packed, row * D, bits, codes.data(), D);
      for (uint32_t j = 0; j < l.num_groups; ++j) {
        const size_t m = row * l.num_groups + j;
        const float scale = DtypeToFloat(kDt, Load16(scales, m));
        const float mn = DtypeToFloat(kDt, Load16(mins, m));
        const size_t d0 = row * D + j * l.group_len;
        const size_t d1 = row * D + std::min(j * l.group_len + l.group_len, D);
        for (size_t i = d0; i < d1; ++i) dequantize(i, codes[i - row * D], scale, mn);
      }
    }
  }
}

}  // namespace

void EncodeIntNScalar(const SegmentShape& shape, uint32_t bits, const std::byte* in,
                      std::byte* payload) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, return, EncodeIntNT<kDt>(shape, bits, in, payload));
}

void DecodeIntNScalar(const SegmentShape& shape, uint32_t bits, const std::byte* payload,
                      std::byte* out) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, return, DecodeIntNT<kDt>(shape, bits, payload, out));
}

// ---------------------------------------------------------------- star

namespace {

// The index of the centroid nearest to v (D floats) among kC given transposed, cs_t[d * kC + k]:
// the squared distances to all kC are summed at once, each over d in order (the additions of
// one centroid at a time, so the same sums), in kC independent chains the compiler keeps in
// registers and vectorises across k. Ties go to the lowest k.
template <uint32_t kC>
uint32_t NearestCentroid(const float* v, const float* cs_t, uint32_t D) {
  float dist[kC] = {};
  for (uint32_t d = 0; d < D; ++d) {
    const float x = v[d];
    for (uint32_t k = 0; k < kC; ++k) {
      const float e = x - cs_t[size_t{d} * kC + k];
      dist[k] += e * e;
    }
  }
  uint32_t best = 0;
  float best_d = std::numeric_limits<float>::infinity();
  for (uint32_t k = 0; k < kC; ++k) {
    if (dist[k] < best_d) best_d = dist[k], best = k;
  }
  return best;
}

}  // namespace

void EncodeStar(const SegmentShape& shape, const std::byte* in,
                const std::vector<std::vector<uint32_t>>& important, std::byte* payload) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const StarLayout l = StarLayoutFor(shape);
  const uint32_t C = l.centroids, M = l.important;
  std::memset(payload, 0, l.per_head_bytes * H);
  std::vector<float> x(size_t{T} * D);
  std::vector<float> cent(size_t{C} * D), cdeq(size_t{C} * D), sums(size_t{C} * D);
  std::vector<uint32_t> counts(C), assign(T);
  std::vector<uint8_t> is_imp(T);
  std::vector<uint32_t> members;
  // The nearest of C centroids given transposed ([d][k], see `transpose`): NearestCentroid.
  std::vector<float> cent_t(size_t{D} * C), cdeq_t(size_t{D} * C);
  std::vector<uint8_t> signs(D);  // one token's residual signs, packed together
  auto transpose = [&](const std::vector<float>& cs, std::vector<float>& t) {
    for (uint32_t k = 0; k < C; ++k) {
      for (uint32_t d = 0; d < D; ++d) t[size_t{d} * C + k] = cs[size_t{k} * D + d];
    }
  };
  auto nearest = [&](const float* v, const std::vector<float>& cs_t) -> uint32_t {
    switch (C) {  // StarLayoutFor: a power of two <= 16
      case 1:
        return 0;
      case 2:
        return NearestCentroid<2>(v, cs_t.data(), D);
      case 4:
        return NearestCentroid<4>(v, cs_t.data(), D);
      case 8:
        return NearestCentroid<8>(v, cs_t.data(), D);
      default:
        return NearestCentroid<16>(v, cs_t.data(), D);
    }
  };
  for (uint32_t h = 0; h < H; ++h) {
    std::byte* p = payload + h * l.per_head_bytes;
    for (uint32_t t = 0; t < T; ++t) {
      for (uint32_t d = 0; d < D; ++d) {
        float v = DtypeToFloat(shape.dtype, Load16(in, (size_t{t} * H + h) * D + d));
        x[size_t{t} * D + d] = IsFiniteFloat(v) ? v : 0.0f;
      }
    }
    std::fill(is_imp.begin(), is_imp.end(), 0);
    for (uint32_t i = 0; i < M; ++i) is_imp[important[h][i]] = 1;
    members.clear();
    for (uint32_t t = 0; t < T; ++t) {
      if (!is_imp[t]) members.push_back(t);
    }
    if (members.empty()) {
      for (uint32_t t = 0; t < T; ++t) members.push_back(t);
    }
    const size_t n = members.size();
    for (uint32_t k = 0; k < C; ++k) {
      const float* src = &x[size_t{members[k * n / C]} * D];
      std::copy(src, src + D, &cent[size_t{k} * D]);
    }
    for (int iter = 0; iter < 4; ++iter) {
      std::fill(sums.begin(), sums.end(), 0.0f);
      std::fill(counts.begin(), counts.end(), 0);
      transpose(cent, cent_t);
      for (uint32_t t : members) {
        uint32_t k = nearest(&x[size_t{t} * D], cent_t);
        ++counts[k];
        for (uint32_t d = 0; d < D; ++d) sums[size_t{k} * D + d] += x[size_t{t} * D + d];
      }
      for (uint32_t k = 0; k < C; ++k) {
        if (counts[k] == 0) continue;  // an empty cluster keeps its centroid
        for (uint32_t d = 0; d < D; ++d) {
          cent[size_t{k} * D + d] = sums[size_t{k} * D + d] / static_cast<float>(counts[k]);
        }
      }
    }
    // Centroids at int8, one scale per centroid.
    std::byte* cscale = p;
    std::byte* cq = p + 2 * size_t{C};
    for (uint32_t k = 0; k < C; ++k) {
      float amax = 0.0f;
      for (uint32_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(cent[size_t{k} * D + d]));
      Int8Row row = Int8RowScale(shape.dtype, amax);
      Store16(cscale, k, row.scale);
      float s = DtypeToFloat(shape.dtype, row.scale);
      for (uint32_t d = 0; d < D; ++d) {
        int8_t q = QuantizeInt8(cent[size_t{k} * D + d], row.divisor);
        cq[size_t{k} * D + d] = std::byte(static_cast<uint8_t>(q));
        cdeq[size_t{k} * D + d] = static_cast<float>(q) * s;
      }
    }
    // Important tokens at int8, one scale per token.
    std::byte* imp_idx = cq + size_t{C} * D;
    std::byte* iscale = imp_idx + 2 * size_t{M};
    std::byte* iq = iscale + 2 * size_t{M};
    for (uint32_t i = 0; i < M; ++i) {
      uint32_t t = important[h][i];
      Store16(imp_idx, i, static_cast<uint16_t>(t));
      float amax = 0.0f;
      for (uint32_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[size_t{t} * D + d]));
      Int8Row row = Int8RowScale(shape.dtype, amax);
      Store16(iscale, i, row.scale);
      for (uint32_t d = 0; d < D; ++d) {
        iq[size_t{i} * D + d] =
            std::byte(static_cast<uint8_t>(QuantizeInt8(x[size_t{t} * D + d], row.divisor)));
      }
    }
    // Index, residual magnitude and residual signs of every other token.
    std::byte* idx = iq + size_t{M} * D;
    std::byte* rscale = idx + CeilDiv(size_t{T} * l.index_bits, 8);
    std::byte* rsign = rscale + 2 * size_t{T};
    transpose(cdeq, cdeq_t);
    for (uint32_t t = 0; t < T; ++t) {
      if (is_imp[t]) continue;
      const float* v = &x[size_t{t} * D];
      uint32_t k = nearest(v, cdeq_t);
      PutBits(idx, t, l.index_bits, k);
      float sum_abs = 0.0f;
      for (uint32_t d = 0; d < D; ++d) {
        float r = v[d] - cdeq[size_t{k} * D + d];
        sum_abs += std::fabs(r);
        signs[d] = r >= 0.0f;
      }
      PackCodes(rsign, size_t{t} * D, 1, signs.data(), D);
      Store16(rscale, t, RoundUpDtype(shape.dtype, sum_abs / static_cast<float>(D)));
    }
  }
}

namespace {

template <uint8_t kDt>
void DecodeStarT(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const StarLayout l = StarLayoutFor(shape);
  const uint32_t C = l.centroids, M = l.important;
  std::vector<float> cdeq(size_t{C} * D);  // one head's dequantised centroids
  std::vector<uint8_t> signs(D);           // one token's residual signs, unpacked together
  for (uint32_t h = 0; h < H; ++h) {
    const std::byte* cscale = payload + h * l.per_head_bytes;
    const std::byte* cq = cscale + 2 * size_t{C};
    const std::byte* imp_idx = cq + size_t{C} * D;
    const std::byte* iscale = imp_idx + 2 * size_t{M};
    const std::byte* iq = iscale + 2 * size_t{M};
    const std::byte* idx = iq + size_t{M} * D;
    const std::byte* rscale = idx + CeilDiv(size_t{T} * l.index_bits, 8);
    const std::byte* rsign = rscale + 2 * size_t{T};
    for (uint32_t k = 0; k < C; ++k) {
      const float cs = DtypeToFloat(kDt, Load16(cscale, k));
      for (uint32_t d = 0; d < D; ++d) {
        cdeq[size_t{k} * D + d] =
            static_cast<float>(static_cast<int8_t>(cq[size_t{k} * D + d])) * cs;
      }
    }
    for (uint32_t t = 0; t < T; ++t) {
      const float* c = &cdeq[size_t{GetBits(idx, t, l.index_bits)} * D];
      const float rs = DtypeToFloat(kDt, Load16(rscale, t));
      const size_t base = (size_t{t} * H + h) * D;
      UnpackCodes(rsign, size_t{t} * D, 1, signs.data(), D);
      for (uint32_t d = 0; d < D; ++d) {
        Store16(out, base + d, FloatToDtype(kDt, c[d] + (signs[d] != 0 ? rs : -rs)));
      }
    }
    for (uint32_t i = 0; i < M; ++i) {
      const uint32_t t = Load16(imp_idx, i);
      const float s = DtypeToFloat(kDt, Load16(iscale, i));
      for (uint32_t d = 0; d < D; ++d) {
        const float x = static_cast<float>(static_cast<int8_t>(iq[size_t{i} * D + d])) * s;
        Store16(out, (size_t{t} * H + h) * D + d, FloatToDtype(kDt, x));
      }
    }
  }
}

}  // namespace

void DecodeStar(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, return, DecodeStarT<kDt>(shape, payload, out));
}

// ---------------------------------------------------------------- k4v3

namespace {

// Pair j of a K vector is (j, j + D/2) (rotate-half RoPE layout); an odd head_dim has no pairs.
uint32_t RopePairs(uint32_t dim) { return dim % 2 == 0 ? dim / 2 : 0; }

// sin and cos of t * w_j (k4v3::Angle, k4v3::Omega) for every token t < T and pair j < half of a
// K segment: [t][j]. The same for every K segment of a block, and usually of every
// block a thread encodes, so the last table is kept per thread, up to kMaxKeptRopeEntries
// (1 MiB: 64-token blocks of head_dim 2048 would fit); a larger one is built in `local` each
// time rather than held by every thread for good.
struct RopeTable {
  uint32_t tokens = 0, half = 0;
  float omega0 = -1.0f, ratio = -1.0f;
  std::vector<float> sin, cos;
};
constexpr size_t kMaxKeptRopeEntries = size_t{1} << 17;
const RopeTable& RopeTableFor(uint32_t tokens, uint32_t half, const K4v3Rope& rope,
                              RopeTable* local) {
  thread_local RopeTable kept;
  RopeTable& table = size_t{tokens} * half <= kMaxKeptRopeEntries ? kept : *local;
  if (table.tokens == tokens && table.half == half &&
      numeric::FloatBits(table.omega0) == numeric::FloatBits(rope.omega0) &&
      numeric::FloatBits(table.ratio) == numeric::FloatBits(rope.ratio)) {
    return table;
  }
  table.tokens = tokens;
  table.half = half;
  table.omega0 = rope.omega0;
  table.ratio = rope.ratio;
  std::vector<float> w(half);
  for (uint32_t j = 0; j < half; ++j) w[j] = k4v3::Omega(rope.omega0, rope.ratio, j);
  table.sin.resize(size_t{tokens} * half);
  table.cos.resize(size_t{tokens} * half);
  for (uint32_t t = 0; t < tokens; ++t) {
    for (uint32_t j = 0; j < half; ++j) {
      numeric::SinCosF32(k4v3::Angle(t, w[j]), &table.sin[size_t{t} * half + j],
                         &table.cos[size_t{t} * half + j]);
    }
  }
  return table;
}

// Turns every (token, head) vector of a K segment: pair j of token t by -t * w_j (into the
// block's RoPE frame), with the path's turn kernel over the table's sines and cosines.
void RotateKPairs(const SegmentShape& shape, const K4v3Rope& rope, K4v3TurnFn turn,
                  const std::byte* in, std::byte* out) {
  const uint32_t half = RopePairs(shape.dim);
  if (half == 0) {
    std::memcpy(out, in, 2 * shape.Elements());
    return;
  }
  RopeTable local;
  const RopeTable& table = RopeTableFor(shape.tokens, half, rope, &local);
  turn(shape, table.cos.data(), table.sin.data(), /*inverse=*/false, in, out);
}

template <uint8_t kDt>
void TurnK4v3T(const SegmentShape& shape, const float* cos, const float* sin, bool inverse,
               const std::byte* in, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim, half = D / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  for (uint32_t t = 0; t < T; ++t) {
    const float* sn = sin + size_t{t} * half;
    const float* cs = cos + size_t{t} * half;
    for (uint32_t h = 0; h < H; ++h) {
      const size_t base = (size_t{t} * H + h) * D;
      for (uint32_t j = 0; j < half; ++j) {
        float y1, y2;
        k4v3::TurnPairF32(DtypeToFloat(kDt, Load16(in, base + j)),
                          DtypeToFloat(kDt, Load16(in, base + j + half)), cs[j],
                          sn[j] * sign /* exact: a sign flip */, &y1, &y2);
        Store16(out, base + j, FloatToDtype(kDt, y1));
        Store16(out, base + j + half, FloatToDtype(kDt, y2));
      }
    }
  }
}

// 3-bit codes of one vector of D values, D a multiple of 8 or not: whole groups of 8 codes are
// 3 bytes (k4v3::Pack8, LSB-first as PutBits writes them), the rest go one by one.
void Pack3(const uint8_t* codes, size_t first, uint32_t n, std::byte* buf) {
  uint32_t d = 0;
  if (first % 8 == 0) {
    auto* p = reinterpret_cast<uint8_t*>(buf + first / 8 * 3);
    for (; d + 8 <= n; d += 8, p += 3) k4v3::Pack8(codes + d, p);
  }
  for (; d < n; ++d) PutBits(buf, first + d, 3, codes[d]);
}
void Unpack3(const std::byte* buf, size_t first, uint32_t n, uint8_t* codes) {
  uint32_t d = 0;
  if (first % 8 == 0) {
    const auto* p = reinterpret_cast<const uint8_t*>(buf + first / 8 * 3);
    for (; d + 8 <= n; d += 8, p += 3) k4v3::Unpack8(p, codes + d);
  }
  for (; d < n; ++d) codes[d] = static_cast<uint8_t>(GetBits(buf, first + d, 3));
}

// One vector's scratch (floats, 3-bit codes) for V's encoder and decoder, and the chunks of its
// transform (k4v3::ChunkAt) with their normalisations (K4v3HadamardNorm of each chunk's length).
struct K4v3Rows {
  explicit K4v3Rows(uint32_t dim) : u(dim), codes(dim) {
    for (uint32_t o = 0; o < dim; o += chunks.back().len) {
      const uint32_t len = k4v3::ChunkAt(dim, o);
      chunks.push_back({o, len, K4v3HadamardNorm(len)});
    }
  }
  struct Chunk {
    uint32_t offset;
    uint32_t len;
    float norm;
  };
  std::vector<float> u;
  std::vector<uint8_t> codes;
  std::vector<Chunk> chunks;
};

// V, one (token, head) vector at a time through a float row (the payload and the segment may sit
// at any byte offset: Load16/Store16), with the arithmetic of kernels/internal/k4v3_math.h, chunk
// by chunk (one chunk, the whole row, for a power-of-two head_dim).
template <uint8_t kDt>
void EncodeK4v3ValueT(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  const uint32_t D = shape.dim;
  const size_t rows = size_t{shape.tokens} * shape.heads;
  std::byte* codes = payload + 2 * rows;
  std::memset(codes, 0, CeilDiv(3 * rows * D, 8));
  K4v3Rows w(D);
  for (size_t r = 0; r < rows; ++r) {
    const std::byte* row = in + 2 * r * D;
    for (uint32_t d = 0; d < D; ++d) w.u[d] = k4v3::ValueIn<kDt>(Load16(row, d), d);
    int32_t amax_bits = 0;
    for (const K4v3Rows::Chunk& c : w.chunks) {
      k4v3::Fwht(w.u.data() + c.offset, c.len);
      for (uint32_t d = c.offset; d < c.offset + c.len; ++d) {
        amax_bits = std::max(amax_bits, k4v3::NormaliseAbsBits(&w.u[d], c.norm));
      }
    }
    float divisor;
    Store16(payload, r, k4v3::ScaleFromMaxBits<kDt>(amax_bits, &divisor));
    for (uint32_t d = 0; d < D; ++d) w.codes[d] = k4v3::Code(w.u[d], divisor);
    Pack3(w.codes.data(), r * D, D, codes);
  }
}

template <uint8_t kDt>
void DecodeK4v3ValueT(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  const uint32_t D = shape.dim;
  const size_t rows = size_t{shape.tokens} * shape.heads;
  const std::byte* codes = payload + 2 * rows;
  K4v3Rows w(D);
  for (size_t r = 0; r < rows; ++r) {
    const float scale = DtypeToFloat(kDt, Load16(payload, r));
    Unpack3(codes, r * D, D, w.codes.data());
    for (uint32_t d = 0; d < D; ++d) w.u[d] = k4v3::Level(w.codes[d]);
    std::byte* row = out + 2 * r * D;
    for (const K4v3Rows::Chunk& c : w.chunks) {
      k4v3::Fwht(w.u.data() + c.offset, c.len);
      const float step = scale * c.norm;
      for (uint32_t d = c.offset; d < c.offset + c.len; ++d) {
        Store16(row, d, k4v3::ValueOut<kDt>(w.u[d], step, d));
      }
    }
  }
}

}  // namespace

void TurnK4v3Scalar(const SegmentShape& shape, const float* cos, const float* sin, bool inverse,
                    const std::byte* in, std::byte* out) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, return,
                         TurnK4v3T<kDt>(shape, cos, sin, inverse, in, out));
}
void EncodeK4v3ValueScalar(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, return, EncodeK4v3ValueT<kDt>(shape, in, payload));
}
void DecodeK4v3ValueScalar(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, return, DecodeK4v3ValueT<kDt>(shape, payload, out));
}
void DecodeK4v3KeyScalar(const SegmentShape& shape, const float* cos, const float* sin,
                         const std::byte* payload, std::byte* out) {
  // Scratch every element of which int4's decoder writes first.
  const auto decoded = std::make_unique_for_overwrite<uint16_t[]>(shape.Elements());
  auto* t = reinterpret_cast<std::byte*>(decoded.get());
  DecodeIntNScalar(shape, 4, payload, t);
  TurnK4v3Scalar(shape, cos, sin, /*inverse=*/true, t, out);
}

K4v3Rope K4v3RopeFor(double rope_theta, uint32_t head_dim) {
  K4v3Rope r;
  if (rope_theta > 0.0 && RopePairs(head_dim) > 0) {
    r.omega0 = 1.0f;
    r.ratio = static_cast<float>(std::pow(rope_theta, -2.0 / head_dim));
  }
  return r;
}

float K4v3HadamardNorm(uint32_t dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim)));
}

void EncodeK4v3(const SegmentShape& shape, const K4v3Rope& rope, const K4v3Kernels& kernels,
                const std::byte* in, std::byte* payload) {
  if (shape.is_value) {
    kernels.encode_value(shape, in, payload);
    return;
  }
  StoreF32(payload, 0, rope.omega0);
  StoreF32(payload, 1, rope.ratio);
  // Scratch every element of which the turn writes first.
  const auto turned = std::make_unique_for_overwrite<uint16_t[]>(shape.Elements());
  auto* t = reinterpret_cast<std::byte*>(turned.get());
  RotateKPairs(shape, rope, kernels.turn, in, t);
  kernels.encode_int4(shape, 4, t, payload + kK4v3KHeaderBytes);
}

void DecodeK4v3(const SegmentShape& shape, const K4v3Kernels& kernels, const std::byte* payload,
                std::byte* out) {
  if (shape.is_value) {
    kernels.decode_value(shape, payload, out);
    return;
  }
  const std::byte* int4 = payload + kK4v3KHeaderBytes;
  const uint32_t half = RopePairs(shape.dim);
  if (half == 0) {  // nothing to turn back
    DecodeIntNScalar(shape, 4, int4, out);
    return;
  }
  const K4v3Rope rope{LoadF32(payload, 0), LoadF32(payload, 1)};
  RopeTable local;
  const RopeTable& table = RopeTableFor(shape.tokens, half, rope, &local);
  kernels.decode_key(shape, table.cos.data(), table.sin.data(), int4, out);
}

absl::Status ValidateK4v3(const SegmentShape& shape, const std::byte* payload) {
  if (!shape.is_value) {
    const float omega0 = LoadF32(payload, 0), ratio = LoadF32(payload, 1);
    // Written as negations so that NaN fails them too.
    if (!(omega0 >= 0.0f && omega0 <= 1.0f) || !(ratio > 0.0f && ratio <= 1.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("k4v3: RoPE frequencies out of range (omega0 ", omega0, ", ratio ", ratio,
                       "; expected 0 <= omega0 <= 1 and 0 < ratio <= 1)"));
    }
    return ValidateIntN(shape, 4, payload + kK4v3KHeaderBytes);
  }
  const size_t rows = size_t{shape.tokens} * shape.heads;
  if (absl::Status s = CheckFiniteDtype(shape, payload, rows, "k4v3 V scale"); !s.ok()) return s;
  const size_t used_bits = 3 * shape.Elements() % 8;
  if (used_bits != 0) {
    const uint8_t last =
        static_cast<uint8_t>(payload[2 * rows + CeilDiv(3 * shape.Elements(), 8) - 1]);
    if ((last >> used_bits) != 0) return absl::InvalidArgumentError("k4v3: nonzero padding bits");
  }
  return absl::OkStatus();
}

}  // namespace proxima::codec::internal
