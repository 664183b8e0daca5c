// AVX-512 fast path for fp8, int8, int4/int2 and k4v3's own kernels, 16 lanes (compiled with
// -mavx512f -mavx512bw -mavx512vl -mf16c, called only after CpuHasAvx512() said yes at run time).
// Like the AVX2 path (simd_avx2.cc), every lane performs the scalar reference's operations in the
// same order (no contracted FMA: this file is built with -ffp-contract=off; the one explicit FMA,
// k4v3's in-vector transform stages, multiplies by +-1, exactly, so it rounds once as the scalar
// add or subtract does), the per-group scales included (16 groups or rows at a time, with mask
// registers where the AVX2 path blends), so the bytes are identical to the scalar path. Segments
// whose head_dim is not a multiple of 16 go to the AVX2 entry points wholesale.
//
// Lane order by construction: every narrowing is a vpmov* truncation (whole register, lane order
// kept), int4/int2 packing combines neighbouring elements with vpmaddubsw/vpmaddwd inside one
// 128-bit register, and the cross-lane permutes (int4 unpacking, Pack64's reordering after its
// per-128-bit-lane packs) name their source dwords explicitly.
//
// ISA isolation: everything but the entry points has internal linkage, and this file calls no
// inline function of the shared headers and no std template, so it emits no link-once code that
// the linker could hand to callers on CPUs without AVX-512 (segment_codecs.h, "ISA isolation
// of the SIMD paths"; kernels_simd_isolation_test checks the object file).
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#include "kernels/dtype_dispatch.h"
#include "kernels/internal/k4v3_math.h"
#include "kernels/internal/segment_codecs.h"
#include "kernels/internal/simd_bytes.h"

namespace proxima::codec::internal {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
namespace {

constexpr uint32_t kLanes = 16;
// Heads whose per-head fp8 maxima are accumulated in registers at once (2 KiB of stack).
constexpr uint32_t kHeadChunk = 32;
constexpr float kInf = __builtin_huge_valf();
constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// Loads 16 dtype values (any alignment) as floats (numeric::DtypeToFloat per lane).
template <uint8_t kDt>
inline __m512 Load16(const std::byte* p, size_t i) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i));
  if constexpr (kDt == numeric::kDtypeBf16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(h);
  }
}

// One dtype value as a float in every lane.
template <uint8_t kDt>
inline __m512 Broadcast(uint16_t v) {
  if constexpr (kDt == numeric::kDtypeBf16) {
    return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(uint32_t{v} << 16)));
  } else {
    return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(v)));
  }
}

// numeric::FloatToDtype of 16 non-NaN floats, as 32-bit lanes.
template <uint8_t kDt>
inline __m512i ToDtype16(__m512 v) {
  if constexpr (kDt == numeric::kDtypeBf16) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb),
                             16);
  } else {
    return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// Stores 16 floats as dtype values, rounding exactly like numeric::FloatToDtype. None may be NaN:
// the stores are the decoders', whose values never are (the validated metadata is finite, every
// code stands for a finite level).
template <uint8_t kDt>
inline void Store16(std::byte* p, size_t i, __m512 v) {
  __m256i out;
  if constexpr (kDt == numeric::kDtypeBf16) {
    // Every lane is below 2^16, so vpmovdw's truncation is exact; it keeps lane order.
    out = _mm512_cvtepi32_epi16(ToDtype16<kDt>(v));
  } else {
    out = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 2 * i), out);
}

// The low byte of each 32-bit lane, in lane order (vpmovdb), to p[0..15].
inline void StoreLowBytes(std::byte* p, __m512i v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
}

inline __m512 Abs(__m512 v) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)));
}

// |x| where finite, else +0.
inline __m512 FiniteAbs(__m512 v) {
  const __m512 a = Abs(v);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(kInf), _CMP_LT_OQ), a);
}

// NaN -> 0 (a -0 stays -0, as in numeric::ClampQ).
inline __m512 NanToZero(__m512 v) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
}

// numeric::ClampQ then round to nearest even, as int32 lanes.
inline __m512i ClampRound(__m512 v, __m512 lo, __m512 hi) {
  v = _mm512_min_ps(_mm512_max_ps(NanToZero(v), lo), hi);
  return _mm512_cvt_roundps_epi32(v, kRoundNearest);
}

// numeric::E4m3ToFloat of 16 codes: each code's exponent and mantissa fields moved into an fp16's
// are its value times 2^-8 exactly (fp16's exponent bias is 15 against e4m3's 7: every normal
// and subnormal code, 0x7F/0xFF's +-480 included); F16C converts exactly, and the factor of 2^8
// is exact too. The AVX2 path's E4m3AsFp16, on 16 lanes of 16 bits.
inline __m512 E4m3ToFloat(__m128i codes) {
  const __m256i w = _mm256_cvtepu8_epi16(codes);
  const __m256i h =
      _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(-0x8000)),
                      _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3F80)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

// numeric::FloatToE4m3 per lane (y clamped, not NaN); the code is in the low byte of each lane.
inline __m512i FloatToE4m3(__m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sub = _mm512_cvt_roundps_epi32(
      _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f)), kRoundNearest);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF)), lsb);
  const __m512i exp = _mm512_sub_epi32(_mm512_srli_epi32(r, 23), _mm512_set1_epi32(120));
  const __m512i man = _mm512_and_si512(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(7));
  const __m512i normal = _mm512_or_si512(_mm512_slli_epi32(exp, 3), man);
  const __mmask16 is_sub = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(0x3C800000), a);
  return _mm512_or_si512(sign, _mm512_mask_blend_epi32(is_sub, normal, sub));
}

// Packs 16 lanes of `bits`-bit values (0 <= q < 2^bits) LSB first, element 0 in the lowest bits:
// 8 bytes for int4, 4 for int2, written to p.
template <uint32_t bits>
inline void PackLanes(std::byte* p, __m512i q) {
  const __m128i b = _mm512_cvtepi32_epi8(q);  // byte k = element k
  if constexpr (bits == 4) {
    // 16-bit lane j = b[2j] + 16 * b[2j+1] (vpmaddubsw: unsigned b times signed {1, 16}).
    const __m128i w = _mm_maddubs_epi16(b, _mm_set1_epi16(0x1001));
    const uint64_t out =
        static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_cvtepi16_epi8(w)));  // word j -> byte j
    std::memcpy(p, &out, 8);
  } else {
    // 16-bit lane j = b[2j] + 4 * b[2j+1]; then 32-bit lane k = w[2k] + 16 * w[2k+1].
    const __m128i w = _mm_maddubs_epi16(b, _mm_set1_epi16(0x0401));
    const __m128i d = _mm_madd_epi16(w, _mm_set1_epi32(0x00100001));
    const uint32_t out =
        static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_cvtepi32_epi8(d)));  // dword k -> byte k
    std::memcpy(p, &out, 4);
  }
}

// Packs 64 lanes of `bits`-bit values (q0: elements 0-15, .., q3: 48-63; 0 <= q < 2^bits) LSB
// first, as PackLanes does 16 at a time: 32 bytes for int4, 16 for int2, written to p. The packs
// work per 128-bit lane (lane k of the bytes holds elements 4k..4k+3 of q0, then of q1, q2, q3);
// the permute puts the dwords back in element order.
template <uint32_t bits>
inline void Pack64(std::byte* p, __m512i q0, __m512i q1, __m512i q2, __m512i q3) {
  static_assert(bits == 4 || bits == 2);
  const __m512i b = _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
      _mm512_packus_epi16(_mm512_packus_epi32(q0, q1), _mm512_packus_epi32(q2, q3)));
  if constexpr (bits == 4) {
    const __m512i w = _mm512_maddubs_epi16(b, _mm512_set1_epi16(0x1001));  // 32 x (b0 + 16 b1)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi16_epi8(w));
  } else {
    const __m512i w = _mm512_maddubs_epi16(b, _mm512_set1_epi16(0x0401));   // 32 x (b0 + 4 b1)
    const __m512i d = _mm512_madd_epi16(w, _mm512_set1_epi32(0x00100001));  // 16 x (w0 + 16 w1)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(d));
  }
}

// The 16 `bits`-bit values starting at element i (a multiple of 16) as floats.
template <uint32_t bits>
inline __m512 UnpackLanes(const std::byte* packed, size_t i) {
  __m512i word, shifts;
  if constexpr (bits == 4) {
    uint64_t w;
    std::memcpy(&w, packed + i / 2, 8);
    // Lanes 0-7 take dword 0, lanes 8-15 dword 1, each shifted to its nibble.
    word = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_castsi128_si512(_mm_cvtsi64_si128(static_cast<long long>(w))));
    shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  } else {
    uint32_t w;
    std::memcpy(&w, packed + i / 4, 4);
    word = _mm512_set1_epi32(static_cast<int>(w));
    shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  }
  const __m512i q =
      _mm512_and_si512(_mm512_srlv_epi32(word, shifts), _mm512_set1_epi32((1 << bits) - 1));
  return _mm512_cvtepi32_ps(q);
}

// Running min/max over finite lanes, with the scalar reference's std::min(mn, x) and
// std::max(mx, x) semantics (vminps/vmaxps return the second operand unless the first is
// strictly smaller/larger).
inline void Accumulate(__m512 x, __m512& mn, __m512& mx) {
  const __mmask16 finite = _mm512_cmp_ps_mask(Abs(x), _mm512_set1_ps(kInf), _CMP_LT_OQ);
  mn = _mm512_mask_min_ps(mn, finite, x, mn);
  mx = _mm512_mask_max_ps(mx, finite, x, mx);
}

// numeric::DtypeToFloat of 16 dtype values held in 32-bit lanes.
template <uint8_t kDt>
inline __m512 FromDtype16(__m512i v) {
  if constexpr (kDt == numeric::kDtypeBf16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
  }
}

// numeric::RoundUpDtype of 16 non-negative floats (NaN and Inf lanes too), as 32-bit lanes: the
// AVX2 path's RoundUpDtype8 with mask registers.
template <uint8_t kDt>
inline __m512i RoundUpDtype16(__m512 x) {
  constexpr bool kBf16 = kDt == numeric::kDtypeBf16;
  // Also the largest finite magnitude: (v & 0x7FFF) above it is Inf or NaN.
  const __m512i max_finite = _mm512_set1_epi32(kBf16 ? 0x7F7F : 0x7BFF);
  const __m512i abs16 = _mm512_set1_epi32(0x7FFF);
  const __mmask16 not_finite = _mm512_cmpgt_epi32_mask(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)),
      _mm512_set1_epi32(0x7F7FFFFF));
  // NaN lanes are not_finite; keep them out of the conversions (0 in their place).
  const __m512 xs = _mm512_maskz_mov_ps(static_cast<__mmask16>(~not_finite), x);
  __m512i v = ToDtype16<kDt>(xs);
  __mmask16 over = _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, abs16), max_finite);
  // One ulp up where rounding went down.
  const __mmask16 down = _mm512_cmp_ps_mask(FromDtype16<kDt>(v), xs, _CMP_LT_OQ);
  v = _mm512_mask_add_epi32(v, down, v, _mm512_set1_epi32(1));
  over |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, abs16), max_finite);
  v = _mm512_mask_mov_epi32(v, over, max_finite);
  const __mmask16 not_positive = _mm512_cmp_ps_mask(xs, _mm512_setzero_ps(), _CMP_LE_OQ);
  v = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~not_positive), v);
  return _mm512_mask_mov_epi32(v, not_finite, max_finite);
}

// IntNGroupParams of 16 groups (lanes) from their finite minimum and maximum (+Inf and -Inf for
// a group without a finite value, which gets min = max = 0), bit for bit as the scalar step.
struct IntNParams16 {
  __m256i scale, min;  // dtype bits, 16 x 16
  __m512 min_f, divisor;
};
template <uint8_t kDt>
inline IntNParams16 IntNGroupParams16(__m512 mn, __m512 mx, __m512 qmax) {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 filled = static_cast<__mmask16>(~_mm512_cmp_ps_mask(mn, mx, _CMP_GT_OQ));
  mn = _mm512_add_ps(_mm512_maskz_mov_ps(filled, mn), zero);  // + 0: a -0 extreme becomes +0
  mx = _mm512_add_ps(_mm512_maskz_mov_ps(filled, mx), zero);
  const __m512i min = ToDtype16<kDt>(mn);
  const __m512i scale = RoundUpDtype16<kDt>(_mm512_div_ps(_mm512_sub_ps(mx, mn), qmax));
  const __m512 s = FromDtype16<kDt>(scale);
  IntNParams16 p;
  p.scale = _mm512_cvtepi32_epi16(scale);
  p.min = _mm512_cvtepi32_epi16(min);
  p.min_f = FromDtype16<kDt>(min);
  p.divisor = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(s, zero, _CMP_EQ_OQ), _mm512_set1_ps(1.0f));
  return p;
}

// Int8RowScale of 16 rows or channels (lanes) from their largest finite |x|: the dtype scales
// (16 x 16 bits) and the divisors, bit for bit.
template <uint8_t kDt>
inline __m256i Int8Scales16(__m512 amax, __m512* divisor) {
  const __m512i scale = RoundUpDtype16<kDt>(_mm512_div_ps(amax, _mm512_set1_ps(127.0f)));
  const __m512 f = FromDtype16<kDt>(scale);
  *divisor = _mm512_mask_mov_ps(f, _mm512_cmp_ps_mask(f, _mm512_setzero_ps(), _CMP_EQ_OQ),
                                _mm512_set1_ps(1.0f));
  return _mm512_cvtepi32_epi16(scale);
}

// Stores the first n (1..16) of 16 dtype values at p.
inline void Store16Partial(std::byte* p, __m256i v, uint32_t n) {
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), v);
}

// ---------------------------------------------------------------- fp8

template <uint8_t kDt>
void EncodeFp8Impl(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  // Each head's max |x|, kHeadChunk heads at a time in registers: a token's rows of those heads
  // are contiguous, so cold input streams from memory once when H <= kHeadChunk.
  for (uint32_t h0 = 0; h0 < H; h0 += kHeadChunk) {
    const uint32_t nh = MinU32(kHeadChunk, H - h0);
    __m512 acc[kHeadChunk];
    for (uint32_t k = 0; k < nh; ++k) acc[k] = _mm512_setzero_ps();
    for (uint32_t t = 0; t < T; ++t) {
      for (uint32_t k = 0; k < nh; ++k) {
        const size_t base = (size_t{t} * H + h0 + k) * D;
        __m512 m = acc[k];
        for (uint32_t d = 0; d < D; d += kLanes) {
          m = _mm512_max_ps(m, FiniteAbs(Load16<kDt>(in, base + d)));
        }
        acc[k] = m;
      }
    }
    for (uint32_t k = 0; k < nh; ++k) {
      PutF32(payload, h0 + k, _mm512_reduce_max_ps(acc[k]) / 448.0f);
    }
  }
  std::byte* codes = payload + 4 * size_t{H};
  const __m512 lo = _mm512_set1_ps(-448.0f), hi = _mm512_set1_ps(448.0f);
  for (size_t row = 0; row < size_t{T} * H; ++row) {
    const float scale = GetF32(payload, row % H);
    const __m512 div = _mm512_set1_ps(scale == 0.0f ? 1.0f : scale);
    for (uint32_t d = 0; d < D; d += kLanes) {
      __m512 y = _mm512_div_ps(Load16<kDt>(in, row * D + d), div);
      y = _mm512_min_ps(_mm512_max_ps(NanToZero(y), lo), hi);
      StoreLowBytes(codes + row * D + d, FloatToE4m3(y));
    }
  }
}

template <uint8_t kDt>
void DecodeFp8Impl(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const std::byte* codes = payload + 4 * size_t{H};
  for (size_t row = 0; row < size_t{T} * H; ++row) {
    const __m512 scale = _mm512_set1_ps(GetF32(payload, row % H));
    for (uint32_t d = 0; d < D; d += kLanes) {
      const __m128i c8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + row * D + d));
      Store16<kDt>(out, row * D + d, _mm512_mul_ps(E4m3ToFloat(c8), scale));
    }
  }
}

// ---------------------------------------------------------------- int8

template <uint8_t kDt>
void EncodeInt8Impl(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  if (!shape.is_value) {  // K: one scale per channel (h, d), 16 channels at a time
    std::byte* q = payload + 2 * size_t{H} * D;
    for (uint32_t h = 0; h < H; ++h) {
      for (uint32_t d = 0; d < D; d += kLanes) {
        __m512 m = _mm512_setzero_ps();
        for (uint32_t t = 0; t < T; ++t) {
          m = _mm512_max_ps(m, FiniteAbs(Load16<kDt>(in, (size_t{t} * H + h) * D + d)));
        }
        __m512 div;
        const __m256i scales = Int8Scales16<kDt>(m, &div);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(payload + 2 * (size_t{h} * D + d)), scales);
        for (uint32_t t = 0; t < T; ++t) {
          const size_t i = (size_t{t} * H + h) * D + d;
          StoreLowBytes(q + i, ClampRound(_mm512_div_ps(Load16<kDt>(in, i), div), lo, hi));
        }
      }
    }
  } else {  // V: one scale per row (t, h); the scales of 16 rows are computed together
    std::byte* q = payload + 2 * size_t{T} * H;
    const size_t rows = size_t{T} * H;
    alignas(64) float amax[kLanes], divisor[kLanes];
    for (size_t r0 = 0; r0 < rows; r0 += kLanes) {
      const uint32_t nr = static_cast<uint32_t>(rows - r0 < kLanes ? rows - r0 : kLanes);
      for (uint32_t k = 0; k < kLanes; ++k) {
        __m512 m = _mm512_setzero_ps();
        if (k < nr) {
          for (uint32_t d = 0; d < D; d += kLanes) {
            m = _mm512_max_ps(m, FiniteAbs(Load16<kDt>(in, (r0 + k) * D + d)));
          }
        }
        amax[k] = _mm512_reduce_max_ps(m);
      }
      __m512 div16;
      Store16Partial(payload + 2 * r0, Int8Scales16<kDt>(_mm512_load_ps(amax), &div16), nr);
      _mm512_store_ps(divisor, div16);
      for (uint32_t k = 0; k < nr; ++k) {
        const __m512 div = _mm512_set1_ps(divisor[k]);
        for (uint32_t d = 0; d < D; d += kLanes) {
          const size_t i = (r0 + k) * D + d;
          StoreLowBytes(q + i, ClampRound(_mm512_div_ps(Load16<kDt>(in, i), div), lo, hi));
        }
      }
    }
  }
}

template <uint8_t kDt>
void DecodeInt8Impl(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const std::byte* q = payload + 2 * (shape.is_value ? size_t{T} * H : size_t{H} * D);
  for (size_t row = 0; row < size_t{T} * H; ++row) {
    const uint32_t h = static_cast<uint32_t>(row % H);
    const __m512 vscale =
        shape.is_value ? Broadcast<kDt>(Get16(payload, row)) : _mm512_setzero_ps();
    for (uint32_t d = 0; d < D; d += kLanes) {
      const size_t i = row * D + d;
      const __m512 scale = shape.is_value ? vscale : Load16<kDt>(payload, size_t{h} * D + d);
      const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
      Store16<kDt>(out, i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)), scale));
    }
  }
}

// ---------------------------------------------------------------- int4 / int2

template <uint8_t kDt, uint32_t bits>
void EncodeIntNImpl(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const IntNLayout l = IntNLayoutFor(shape, bits);
  const float qmax_f = static_cast<float>((1u << bits) - 1);
  const __m512 zero = _mm512_setzero_ps(), qmax = _mm512_set1_ps(qmax_f);
  const __m512 inf = _mm512_set1_ps(kInf), ninf = _mm512_set1_ps(-kInf);
  std::byte* scales = payload;
  std::byte* mins = payload + 2 * l.meta_count;
  std::byte* packed = payload + 4 * l.meta_count;
  // Every element is written: 16 elements fill whole bytes, and every row holds whole vectors.
  auto quantize16 = [&](size_t i, __m512 min_f, __m512 div) {
    const __m512 v = _mm512_div_ps(_mm512_sub_ps(Load16<kDt>(in, i), min_f), div);
    PackLanes<bits>(packed + i * bits / 8, ClampRound(v, zero, qmax));
  };
  if (!shape.is_value) {
    // K: groups along tokens. Per group of tokens and head, the extremes and parameters of each
    // 16-channel column (four columns' running extremes at once: independent chains), then the
    // group's token rows quantized whole, 64 contiguous channels per Pack64; kColumns columns
    // (256 channels) at a time.
    constexpr uint32_t kColumns = 16;
    __m512 col_min[kColumns], col_div[kColumns];
    for (uint32_t j = 0; j < l.num_groups; ++j) {
      const uint32_t t0 = j * l.group_len, len = MinU32(l.group_len, T - t0);
      for (uint32_t h = 0; h < H; ++h) {
        for (uint32_t d0 = 0; d0 < D; d0 += kLanes * kColumns) {
          const uint32_t columns = MinU32(kColumns, (D - d0) / kLanes);
          for (uint32_t c0 = 0; c0 < columns; c0 += 4) {
            const uint32_t n = MinU32(4, columns - c0);
            __m512 mn[4] = {inf, inf, inf, inf}, mx[4] = {ninf, ninf, ninf, ninf};
            for (uint32_t t = t0; t < t0 + len; ++t) {
              const size_t row = (size_t{t} * H + h) * D + d0 + kLanes * c0;
              for (uint32_t c = 0; c < n; ++c) {
                Accumulate(Load16<kDt>(in, row + kLanes * c), mn[c], mx[c]);
              }
            }
            for (uint32_t c = 0; c < n; ++c) {
              const IntNParams16 p = IntNGroupParams16<kDt>(mn[c], mx[c], qmax);
              const size_t m = (size_t{j} * H + h) * D + d0 + kLanes * (c0 + c);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(scales + 2 * m), p.scale);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(mins + 2 * m), p.min);
              col_min[c0 + c] = p.min_f;
              col_div[c0 + c] = p.divisor;
            }
          }
          for (uint32_t t = t0; t < t0 + len; ++t) {
            const size_t i = (size_t{t} * H + h) * D + d0;
            auto q = [&](uint32_t c) {  // column c's codes
              const __m512 v = _mm512_div_ps(
                  _mm512_sub_ps(Load16<kDt>(in, i + kLanes * c), col_min[c]), col_div[c]);
              return ClampRound(v, zero, qmax);
            };
            uint32_t c = 0;
            for (; c + 4 <= columns; c += 4) {
              Pack64<bits>(packed + (i + kLanes * c) * bits / 8, q(c), q(c + 1), q(c + 2),
                           q(c + 3));
            }
            for (; c < columns; ++c) PackLanes<bits>(packed + (i + kLanes * c) * bits / 8, q(c));
          }
        }
      }
    }
  } else {
    // V: groups along channels; group_len = min(G, D) is a multiple of 16. Groups (index
    // m = row * NG + j, the order of their metadata) 16 at a time: each group's extremes reduced
    // to one lane, the 16 groups' parameters computed together, then each group quantized with
    // its lane broadcast.
    const uint32_t g_len = l.group_len;
    const size_t groups = l.meta_count;  // T * H * NG
    alignas(64) float mnv[kLanes], mxv[kLanes], minf[kLanes], divv[kLanes];
    size_t row = 0;
    uint32_t j = 0;  // group m0's row and index in it
    for (size_t m0 = 0; m0 < groups; m0 += kLanes) {
      const uint32_t lanes = static_cast<uint32_t>(groups - m0 < kLanes ? groups - m0 : kLanes);
      size_t r = row;
      uint32_t jj = j;
      for (uint32_t k = 0; k < kLanes; ++k) {
        __m512 mn = inf, mx = ninf;
        if (k < lanes) {
          const uint32_t d0 = jj * g_len, len = MinU32(g_len, D - d0);
          for (uint32_t d = d0; d < d0 + len; d += kLanes) {
            Accumulate(Load16<kDt>(in, r * D + d), mn, mx);
          }
          if (++jj == l.num_groups) jj = 0, ++r;
        }
        mnv[k] = _mm512_reduce_min_ps(mn);
        mxv[k] = _mm512_reduce_max_ps(mx);
      }
      const IntNParams16 p = IntNGroupParams16<kDt>(_mm512_load_ps(mnv), _mm512_load_ps(mxv), qmax);
      Store16Partial(scales + 2 * m0, p.scale, lanes);
      Store16Partial(mins + 2 * m0, p.min, lanes);
      _mm512_store_ps(minf, p.min_f);
      _mm512_store_ps(divv, p.divisor);
      for (uint32_t k = 0; k < lanes; ++k) {
        const uint32_t d0 = j * g_len, len = MinU32(g_len, D - d0);
        const __m512 mf = _mm512_set1_ps(minf[k]), dv = _mm512_set1_ps(divv[k]);
        for (uint32_t d = d0; d < d0 + len; d += kLanes) quantize16(row * D + d, mf, dv);
        if (++j == l.num_groups) j = 0, ++row;
      }
    }
  }
}

template <uint8_t kDt, uint32_t bits>
void DecodeIntNImpl(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  const IntNLayout l = IntNLayoutFor(shape, bits);
  const std::byte* scales = payload;
  const std::byte* mins = payload + 2 * l.meta_count;
  const std::byte* packed = payload + 4 * l.meta_count;
  if (!shape.is_value) {
    for (uint32_t t = 0; t < T; ++t) {
      const size_t mbase = size_t{t / l.group_len} * H * D;
      for (uint32_t h = 0; h < H; ++h) {
        for (uint32_t d = 0; d < D; d += kLanes) {
          const size_t i = (size_t{t} * H + h) * D + d;
          const size_t m = mbase + size_t{h} * D + d;
          const __m512 x =
              _mm512_add_ps(_mm512_mul_ps(UnpackLanes<bits>(packed, i), Load16<kDt>(scales, m)),
                            Load16<kDt>(mins, m));
          Store16<kDt>(out, i, x);
        }
      }
    }
  } else {
    for (size_t row = 0; row < size_t{T} * H; ++row) {
      for (uint32_t j = 0; j < l.num_groups; ++j) {
        const uint32_t d0 = j * l.group_len, len = MinU32(l.group_len, D - d0);
        const size_t m = row * l.num_groups + j;
        const __m512 scale = Broadcast<kDt>(Get16(scales, m));
        const __m512 mn = Broadcast<kDt>(Get16(mins, m));
        for (uint32_t d = d0; d < d0 + len; d += kLanes) {
          const size_t i = row * D + d;
          Store16<kDt>(out, i,
                       _mm512_add_ps(_mm512_mul_ps(UnpackLanes<bits>(packed, i), scale), mn));
        }
      }
    }
  }
}

// Shapes the 16-lane loops cover: whole vectors per row, and (int4/int2) per group.
bool Fits(const SegmentShape& shape) {
  return shape.dim % kLanes == 0 && shape.group % kLanes == 0;
}

// ---------------------------------------------------------------- k4v3

// k4v3::Flip for elements d0 .. d0 + 15 as sign bits: bit 31 set where Flip is -1 (bit 31 of
// d * 0x9E3779B1). XOR with them is the multiplication by Flip for every float but NaN, which
// neither V kernel flips (encode zeroes non-finite values first; decode never makes a NaN).
inline __m512 FlipBits16(uint32_t d0) {
  const __m512i d =
      _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(d0)),
                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i m = _mm512_mullo_epi32(d, _mm512_set1_epi32(static_cast<int>(0x9E3779B1u)));
  return _mm512_castsi512_ps(_mm512_and_si512(m, _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}

// The FlipBits16 of a row of D = 16 * kN elements, made once per segment.
template <uint32_t kN>
struct FlipRow {
  FlipRow() {
    for (uint32_t k = 0; k < kN; ++k) bits[k] = FlipBits16(16 * k);
  }
  __m512 bits[kN];
};

// x with the sign bits of `bits` flipped (vpxord: vxorps on 512 bits needs AVX512DQ).
inline __m512 XorBits(__m512 x, __m512 bits) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_castps_si512(bits)));
}

// One stage of k4v3::Fwht inside a vector: `partner` holds each lane's partner (the lane whose
// index differs in bit `len`); lanes without that bit get a + b, the others a - b (a the lane
// without the bit, b the one with). As x * sign + partner with sign = -1 in the lanes with the
// bit: the product is exact (a sign flip), so the FMA's one rounding is that of a + b or a - b.
inline __m512 FwhtLanes(__m512 x, __m512 partner, __mmask16 with_bit) {
  const __m512 sign = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), with_bit, _mm512_set1_ps(-1.0f));
  return _mm512_fmadd_ps(x, sign, partner);
}

// The first four stages of k4v3::Fwht (len 1, 2, 4, 8) on the 16 elements of one vector.
inline __m512 FwhtIn16(__m512 x) {
  x = FwhtLanes(x, _mm512_permute_ps(x, 0xB1), 0xAAAA);           // lanes 1 0 3 2 in each 128 bits
  x = FwhtLanes(x, _mm512_permute_ps(x, 0x4E), 0xCCCC);           // lanes 2 3 0 1 in each 128 bits
  x = FwhtLanes(x, _mm512_shuffle_f32x4(x, x, 0xB1), 0xF0F0);     // 128-bit blocks 1 0 3 2
  return FwhtLanes(x, _mm512_shuffle_f32x4(x, x, 0x4E), 0xFF00);  // 128-bit blocks 2 3 0 1
}

// k4v3::ChunkAt, restated here with internal linkage (this file calls nothing inline from the
// shared headers: "ISA isolation" in segment_codecs.h): the length of the chunk of an n-long row
// that starts at `offset`, the largest power of two <= n - offset.
constexpr uint32_t ChunkAt(uint32_t n, uint32_t offset) {
  uint32_t len = 1;
  while (len <= (n - offset) / 2) len <<= 1;
  return len;
}

// k4v3's V transform of a row of 16 * kN floats held in registers: k4v3::Fwht on each chunk of
// the row (ChunkAt: kN's binary decomposition in vectors, 16 times it in elements, for the dims
// K4v3ValueFits takes), the stages inside each vector, then those across the chunk's vectors
// (len 16, 32, ..).
template <uint32_t kN>
inline void FwhtRow(__m512 (&v)[kN]) {
  for (uint32_t k = 0; k < kN; ++k) v[k] = FwhtIn16(v[k]);
  for (uint32_t c = 0, len = 0; c < kN; c += len) {
    len = ChunkAt(kN, c);
    for (uint32_t m = 1; m < len; m <<= 1) {
      for (uint32_t i = c; i < c + len; i += 2 * m) {
        for (uint32_t k = i; k < i + m; ++k) {
          const __m512 a = v[k], b = v[k + m];
          v[k] = _mm512_add_ps(a, b);
          v[k + m] = _mm512_sub_ps(a, b);
        }
      }
    }
  }
}

// The normalisation of each vector of a row of 16 * kN elements: K4v3HadamardNorm of the length
// of the chunk that holds it, made once per segment.
template <uint32_t kN>
struct NormRow {
  NormRow() {
    for (uint32_t c = 0, len = 0; c < kN; c += len) {
      len = ChunkAt(kN, c);
      for (uint32_t k = c; k < c + len; ++k) norm[k] = _mm512_set1_ps(K4v3HadamardNorm(16 * len));
    }
  }
  __m512 norm[kN];
};

// The V kernels take dims 16 * kN for the powers of two kN = 1, 2, 4, 8, 16 and for the head
// dims 48, 80, 96 and 112 (kN = 3, 5, 6, 7; in chunks of at least 16); a row lives in kN
// registers. The AVX2 path takes the others it can.
bool K4v3ValueFits(uint32_t dim) {
  switch (dim) {
    case 16:
    case 32:
    case 64:
    case 128:
    case 256:
    case 48:
    case 80:
    case 96:
    case 112:
      return true;
    default:
      return false;
  }
}

// Sixteen 3-bit codes (int32 lanes) as 48 bits, LSB first (k4v3::Pack8 twice).
inline uint64_t Pack3x16(__m512i q) {
  const __m512i s = _mm512_sllv_epi32(
      q, _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21));
  // OR of lanes 0-7 and of lanes 8-15: fold the 128-bit blocks, then within each.
  const __m256i x = _mm512_castsi512_si256(s), h = _mm512_extracti64x4_epi64(s, 1);
  __m128i a = _mm_or_si128(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  __m128i b = _mm_or_si128(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  a = _mm_or_si128(a, _mm_shuffle_epi32(a, 0x4E));
  b = _mm_or_si128(b, _mm_shuffle_epi32(b, 0x4E));
  a = _mm_or_si128(a, _mm_shuffle_epi32(a, 0xB1));
  b = _mm_or_si128(b, _mm_shuffle_epi32(b, 0xB1));
  return static_cast<uint64_t>(static_cast<uint32_t>(_mm_cvtsi128_si32(a))) |
         static_cast<uint64_t>(static_cast<uint32_t>(_mm_cvtsi128_si32(b))) << 24;
}

// The sixteen 3-bit codes whose 6 bytes start at p, as floats, reading those 6 bytes only.
inline __m512 Unpack3x16(const std::byte* p) {
  uint32_t lo;
  uint16_t hi;
  std::memcpy(&lo, p, 4);  // one load each: no store-forwarding stall
  std::memcpy(&hi, p + 4, 2);
  const uint64_t w = lo | uint64_t{hi} << 32;
  const __m512i word =
      _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(w & 0xFFFFFF))),
                         _mm256_set1_epi32(static_cast<int>(w >> 24)), 1);
  const __m512i q = _mm512_and_si512(
      _mm512_srlv_epi32(word,
                        _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21)),
      _mm512_set1_epi32(7));
  return _mm512_cvtepi32_ps(q);
}

// Unpack3x16 from one 16-byte load (16 bytes must be readable at p): the load sits in every
// 128-bit block, each lane picks the two bytes holding its code (code j is at bit 3j: byte
// 3j / 8) and shifts it down by 3j % 8.
inline __m512 Unpack3x16Wide(const std::byte* p) {
  const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // Lane j: bytes b, b + 1 of the load, then two zero bytes (index 0x80), b = 3j / 8.
  auto pick = [](int b) { return static_cast<int>(0x80800000u | (b + 1) << 8 | b); };
  const __m512i picks =
      _mm512_setr_epi32(pick(0), pick(0), pick(0), pick(1), pick(1), pick(1), pick(2), pick(2),
                        pick(3), pick(3), pick(3), pick(4), pick(4), pick(4), pick(5), pick(5));
  const __m512i q =
      _mm512_srlv_epi32(_mm512_shuffle_epi8(v, picks),
                        _mm512_setr_epi32(0, 3, 6, 1, 4, 7, 2, 5, 0, 3, 6, 1, 4, 7, 2, 5));
  return _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(7)));
}

// EncodeK4v3ValueScalar for rows of D = 16 * kN: each row in kN registers from its load to its
// transform's end, the row scales of 16 rows at once (RoundUpDtype16), then each row's codes.
template <uint8_t kDt, uint32_t kN>
void EncodeK4v3ValueRows(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  constexpr uint32_t D = kLanes * kN;
  constexpr size_t code_bytes = 3 * D / 8;  // per row
  const size_t rows = size_t{shape.tokens} * shape.heads;
  const NormRow<kN> norms;
  const __m512 inf = _mm512_set1_ps(kInf);
  const FlipRow<kN> flips;
  std::byte* codes = payload + 2 * rows;
  alignas(64) float u[kLanes * D];
  for (size_t r0 = 0; r0 < rows; r0 += kLanes) {
    const uint32_t g = rows - r0 < kLanes ? static_cast<uint32_t>(rows - r0) : kLanes;
    alignas(64) int32_t amax_bits[kLanes] = {};
    for (uint32_t l = 0; l < g; ++l) {
      const std::byte* row = in + 2 * (r0 + l) * D;
      __m512 v[kN];
      for (uint32_t k = 0; k < kN; ++k) {
        // k4v3::ValueIn: non-finite -> 0, then the flip.
        const __m512 x = Load16<kDt>(row, kLanes * k);
        const __m512 finite = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(Abs(x), inf, _CMP_LT_OQ), x);
        v[k] = XorBits(finite, flips.bits[k]);
      }
      FwhtRow(v);
      __m512i mx = _mm512_setzero_si512();
      for (uint32_t k = 0; k < kN; ++k) {
        const __m512 y = _mm512_mul_ps(v[k], norms.norm[k]);
        _mm512_store_ps(u + l * D + kLanes * k, y);
        const __m512i a = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7FFFFFFF));
        const __mmask16 finite = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(0x7F800000), a);
        mx = _mm512_max_epi32(mx, _mm512_maskz_mov_epi32(finite, a));
      }
      amax_bits[l] = _mm512_reduce_max_epi32(mx);
    }
    // k4v3::ScaleFromMaxBits of the group's rows (lanes past g: scale 0, unused).
    const __m512 amax = _mm512_castsi512_ps(_mm512_load_si512(amax_bits));
    const __m512i scale =
        RoundUpDtype16<kDt>(_mm512_div_ps(amax, _mm512_set1_ps(k4v3::kScaleDivisor)));
    const __m512 f = FromDtype16<kDt>(scale);
    alignas(64) float divisor[kLanes];
    _mm512_store_ps(divisor,
                    _mm512_mask_mov_ps(f, _mm512_cmp_ps_mask(f, _mm512_setzero_ps(), _CMP_EQ_OQ),
                                       _mm512_set1_ps(1.0f)));
    Store16Partial(payload + 2 * r0, _mm512_cvtepi32_epi16(scale), g);
    for (uint32_t l = 0; l < g; ++l) {
      const float* v = u + l * D;
      const __m512 div = _mm512_set1_ps(divisor[l]);
      std::byte* out = codes + (r0 + l) * code_bytes;
      for (uint32_t k = 0; k < kN; ++k) {
        const __m512 q =
            _mm512_add_ps(_mm512_div_ps(_mm512_load_ps(v + kLanes * k), div), _mm512_set1_ps(3.5f));
        const uint64_t w = Pack3x16(ClampRound(q, _mm512_setzero_ps(), _mm512_set1_ps(7.0f)));
        std::memcpy(out + 6 * k, &w, 6);  // little-endian: the low 6 bytes
      }
    }
  }
}

// DecodeK4v3ValueScalar for rows of D = 16 * kN, each row in kN registers from its codes to its
// stores.
template <uint8_t kDt, uint32_t kN>
void DecodeK4v3ValueRows(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  constexpr uint32_t D = kLanes * kN;
  constexpr size_t code_bytes = 3 * D / 8;
  const size_t rows = size_t{shape.tokens} * shape.heads;
  const NormRow<kN> norms;
  const FlipRow<kN> flips;
  const std::byte* codes = payload + 2 * rows;
  // Rows whose codes are followed by at least 10 more bytes of codes: Unpack3x16Wide throughout.
  const size_t wide_rows = rows * code_bytes >= code_bytes + 10
                               ? (rows * code_bytes - 10 - code_bytes) / code_bytes + 1
                               : 0;
  for (size_t r = 0; r < rows; ++r) {
    uint16_t scale;
    std::memcpy(&scale, payload + 2 * r, 2);
    const __m512 scale_f = Broadcast<kDt>(scale);
    const std::byte* in = codes + r * code_bytes;
    __m512 v[kN];
    for (uint32_t k = 0; k < kN; ++k) {
      // k4v3::Level: the code minus 3.5.
      const __m512 c = r < wide_rows ? Unpack3x16Wide(in + 6 * k) : Unpack3x16(in + 6 * k);
      v[k] = _mm512_sub_ps(c, _mm512_set1_ps(3.5f));
    }
    FwhtRow(v);
    std::byte* row = out + 2 * r * D;
    for (uint32_t k = 0; k < kN; ++k) {
      // k4v3::ValueOut: times the step (the scale times the vector's chunk's norm), then the
      // flip. Never NaN: the levels' transform is finite, the step a finite scale times the norm.
      const __m512 step = _mm512_mul_ps(scale_f, norms.norm[k]);
      Store16<kDt>(row, kLanes * k, XorBits(_mm512_mul_ps(v[k], step), flips.bits[k]));
    }
  }
}

// Calls f.template operator()<kN>() for the row length D = 16 * kN (the dims K4v3ValueFits
// takes).
template <typename F>
void WithRowVectors(uint32_t dim, F&& f) {
  switch (dim / kLanes) {
    case 1:
      return f.template operator()<1>();
    case 2:
      return f.template operator()<2>();
    case 3:
      return f.template operator()<3>();
    case 4:
      return f.template operator()<4>();
    case 5:
      return f.template operator()<5>();
    case 6:
      return f.template operator()<6>();
    case 7:
      return f.template operator()<7>();
    case 8:
      return f.template operator()<8>();
    default:
      return f.template operator()<16>();
  }
}
template <uint8_t kDt>
void EncodeK4v3ValueImpl(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  WithRowVectors(shape.dim,
                 [&]<uint32_t kN>() { EncodeK4v3ValueRows<kDt, kN>(shape, in, payload); });
}
template <uint8_t kDt>
void DecodeK4v3ValueImpl(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  WithRowVectors(shape.dim,
                 [&]<uint32_t kN>() { DecodeK4v3ValueRows<kDt, kN>(shape, payload, out); });
}

// TurnK4v3Scalar for dims that are multiples of 32 (16 pairs per vector).
template <uint8_t kDt>
void TurnK4v3Impl(const SegmentShape& shape, const float* cos, const float* sin, bool inverse,
                  const std::byte* in, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim, half = D / 2;
  // The direction's sign on the sines (exact: a sign flip; the table holds no NaN).
  const __m512 sign =
      _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(inverse ? 0x80000000u : 0u)));
  const __m512 lo = _mm512_set1_ps(-3.40282347e+38f), hi = _mm512_set1_ps(3.40282347e+38f);
  // numeric::ClampQ(x, -FLT_MAX, FLT_MAX): NaN -> 0, +-Inf -> +-FLT_MAX.
  auto clamp = [&](__m512 x) {
    return _mm512_min_ps(_mm512_maskz_max_ps(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), x, lo), hi);
  };
  for (uint32_t t = 0; t < T; ++t) {
    const float* sn = sin + size_t{t} * half;
    const float* cs = cos + size_t{t} * half;
    for (uint32_t j = 0; j < half; j += kLanes) {
      // The angle depends on the token and the pair alone: the same c and s for every head.
      const __m512 c = _mm512_loadu_ps(cs + j);
      const __m512 s = XorBits(_mm512_loadu_ps(sn + j), sign);
      for (uint32_t h = 0; h < H; ++h) {
        const size_t i = (size_t{t} * H + h) * D + j;
        const __m512 x1 = clamp(Load16<kDt>(in, i));
        const __m512 x2 = clamp(Load16<kDt>(in, i + half));
        // k4v3::TurnPairF32 never makes a NaN (its inputs are clamped first).
        Store16<kDt>(out, i, _mm512_add_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)));
        Store16<kDt>(out, i + half, _mm512_sub_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)));
      }
    }
  }
}

// numeric::DtypeToFloat(numeric::FloatToDtype(x)) of 16 non-NaN floats: what a dtype store and
// load give back.
template <uint8_t kDt>
inline __m512 RoundToDtype16(__m512 x) {
  if constexpr (kDt == numeric::kDtypeBf16) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_castsi512_ps(
        _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// DecodeK4v3KeyScalar for dims that are multiples of 32 (16 pairs per vector), in one pass: each
// pair's two elements are dequantized as int4's decoder does (code * scale + min, rounded to the
// dtype), turned back and stored.
template <uint8_t kDt>
void DecodeK4v3KeyImpl(const SegmentShape& shape, const float* cos, const float* sin,
                       const std::byte* payload, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim, half = D / 2;
  const IntNLayout l = IntNLayoutFor(shape, 4);
  const std::byte* scales = payload;
  const std::byte* mins = payload + 2 * l.meta_count;
  const std::byte* packed = payload + 4 * l.meta_count;
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 lo = _mm512_set1_ps(-3.40282347e+38f), hi = _mm512_set1_ps(3.40282347e+38f);
  // Element i (parameters at m) as int4's decoder leaves it, then numeric::ClampQ(x, -FLT_MAX,
  // FLT_MAX) as k4v3::TurnPairF32 takes it (never NaN: the scale and minimum are finite).
  auto value = [&](size_t i, size_t m) {
    const __m512 x = _mm512_add_ps(_mm512_mul_ps(UnpackLanes<4>(packed, i), Load16<kDt>(scales, m)),
                                   Load16<kDt>(mins, m));
    return _mm512_min_ps(_mm512_max_ps(RoundToDtype16<kDt>(x), lo), hi);
  };
  for (uint32_t t = 0; t < T; ++t) {
    const size_t mbase = size_t{t / l.group_len} * H * D;
    const float* sn = sin + size_t{t} * half;
    const float* cs = cos + size_t{t} * half;
    for (uint32_t j = 0; j < half; j += kLanes) {
      const __m512 c = _mm512_loadu_ps(cs + j);
      const __m512 s = XorBits(_mm512_loadu_ps(sn + j), sign);  // back: the negated angle
      for (uint32_t h = 0; h < H; ++h) {
        const size_t i = (size_t{t} * H + h) * D + j, m = mbase + size_t{h} * D + j;
        const __m512 x1 = value(i, m), x2 = value(i + half, m + half);
        Store16<kDt>(out, i, _mm512_add_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)));
        Store16<kDt>(out, i + half, _mm512_sub_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)));
      }
    }
  }
}

}  // namespace

// ---------------------------------------------------------------- entry points (dtype dispatch)

void EncodeFp8Avx512(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  if (!Fits(shape)) return EncodeFp8Avx2(shape, in, payload);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, EncodeFp8Scalar(shape, in, payload),
                         EncodeFp8Impl<kDt>(shape, in, payload));
}
void DecodeFp8Avx512(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  if (!Fits(shape)) return DecodeFp8Avx2(shape, payload, out);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, DecodeFp8Scalar(shape, payload, out),
                         DecodeFp8Impl<kDt>(shape, payload, out));
}
void EncodeInt8Avx512(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  if (!Fits(shape)) return EncodeInt8Avx2(shape, in, payload);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, EncodeInt8Scalar(shape, in, payload),
                         EncodeInt8Impl<kDt>(shape, in, payload));
}
void DecodeInt8Avx512(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  if (!Fits(shape)) return DecodeInt8Avx2(shape, payload, out);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, DecodeInt8Scalar(shape, payload, out),
                         DecodeInt8Impl<kDt>(shape, payload, out));
}
void EncodeIntNAvx512(const SegmentShape& shape, uint32_t bits, const std::byte* in,
                      std::byte* payload) {
  if (!Fits(shape)) return EncodeIntNAvx2(shape, bits, in, payload);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, EncodeIntNScalar(shape, bits, in, payload), {
    if (bits == 4) {
      EncodeIntNImpl<kDt, 4>(shape, in, payload);
    } else {
      EncodeIntNImpl<kDt, 2>(shape, in, payload);
    }
  });
}
void DecodeIntNAvx512(const SegmentShape& shape, uint32_t bits, const std::byte* payload,
                      std::byte* out) {
  if (!Fits(shape)) return DecodeIntNAvx2(shape, bits, payload, out);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, DecodeIntNScalar(shape, bits, payload, out), {
    if (bits == 4) {
      DecodeIntNImpl<kDt, 4>(shape, payload, out);
    } else {
      DecodeIntNImpl<kDt, 2>(shape, payload, out);
    }
  });
}

void TurnK4v3Avx512(const SegmentShape& shape, const float* cos, const float* sin, bool inverse,
                    const std::byte* in, std::byte* out) {
  if (shape.dim % (2 * kLanes) != 0) return TurnK4v3Avx2(shape, cos, sin, inverse, in, out);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, TurnK4v3Scalar(shape, cos, sin, inverse, in, out),
                         TurnK4v3Impl<kDt>(shape, cos, sin, inverse, in, out));
}
void DecodeK4v3KeyAvx512(const SegmentShape& shape, const float* cos, const float* sin,
                         const std::byte* payload, std::byte* out) {
  if (shape.dim % (2 * kLanes) != 0) return DecodeK4v3KeyAvx2(shape, cos, sin, payload, out);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, DecodeK4v3KeyScalar(shape, cos, sin, payload, out),
                         DecodeK4v3KeyImpl<kDt>(shape, cos, sin, payload, out));
}
void EncodeK4v3ValueAvx512(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  if (!K4v3ValueFits(shape.dim)) return EncodeK4v3ValueAvx2(shape, in, payload);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, EncodeK4v3ValueScalar(shape, in, payload),
                         EncodeK4v3ValueImpl<kDt>(shape, in, payload));
}
void DecodeK4v3ValueAvx512(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  if (!K4v3ValueFits(shape.dim)) return DecodeK4v3ValueAvx2(shape, payload, out);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, DecodeK4v3ValueScalar(shape, payload, out),
                         DecodeK4v3ValueImpl<kDt>(shape, payload, out));
}

#else  // built without AVX-512: CpuHasAvx512() may still say yes, so forward to the AVX2 path.

void EncodeFp8Avx512(const SegmentShape& s, const std::byte* in, std::byte* p) {
  EncodeFp8Avx2(s, in, p);
}
void DecodeFp8Avx512(const SegmentShape& s, const std::byte* p, std::byte* out) {
  DecodeFp8Avx2(s, p, out);
}
void EncodeInt8Avx512(const SegmentShape& s, const std::byte* in, std::byte* p) {
  EncodeInt8Avx2(s, in, p);
}
void DecodeInt8Avx512(const SegmentShape& s, const std::byte* p, std::byte* out) {
  DecodeInt8Avx2(s, p, out);
}
void EncodeIntNAvx512(const SegmentShape& s, uint32_t bits, const std::byte* in, std::byte* p) {
  EncodeIntNAvx2(s, bits, in, p);
}
void DecodeIntNAvx512(const SegmentShape& s, uint32_t bits, const std::byte* p, std::byte* out) {
  DecodeIntNAvx2(s, bits, p, out);
}
void TurnK4v3Avx512(const SegmentShape& s, const float* cos, const float* sin, bool inverse,
                    const std::byte* in, std::byte* out) {
  TurnK4v3Avx2(s, cos, sin, inverse, in, out);
}
void DecodeK4v3KeyAvx512(const SegmentShape& s, const float* cos, const float* sin,
                         const std::byte* p, std::byte* out) {
  DecodeK4v3KeyAvx2(s, cos, sin, p, out);
}
void EncodeK4v3ValueAvx512(const SegmentShape& s, const std::byte* in, std::byte* p) {
  EncodeK4v3ValueAvx2(s, in, p);
}
void DecodeK4v3ValueAvx512(const SegmentShape& s, const std::byte* p, std::byte* out) {
  DecodeK4v3ValueAvx2(s, p, out);
}

#endif

}  // namespace proxima::codec::internal
