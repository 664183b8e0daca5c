// AVX2 + F16C fast path for fp8, int8, int4/int2 and k4v3's own kernels (compiled with -mavx2
// -mf16c, called only after CpuHasAvx2() said yes at run time). Every lane performs the scalar
// reference's operations in the same order (no FMA: this file is built with -ffp-contract=off), the
// per-group scales included (8 groups or rows at a time), so the bytes are identical to the
// scalar path. Segments whose head_dim is not a multiple of 8 take the scalar
// path wholesale.
//
// ISA isolation: everything but the entry points has internal linkage, and this file calls no
// inline function of the shared headers and no std template, so it emits no link-once code that
// the linker could hand to callers on CPUs without AVX2 (segment_codecs.h, "ISA isolation
// of the SIMD paths"; kernels_simd_isolation_test checks the object file). CpuHasAvx2() lives in
// cpu_features.cc, compiled for the baseline ISA.
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

#if defined(__AVX2__) && defined(__F16C__)
namespace {

// Heads whose per-head fp8 maxima are accumulated in registers at once (1 KiB of stack).
constexpr uint32_t kHeadChunk = 32;
constexpr float kInf = __builtin_huge_valf();

// Asks for the cache line kPrefetchAhead bytes past p (input that a pass over cold KV reads
// soon; past the end of the segment it is the next one's, or nothing: prefetches never fault).
// Integer arithmetic, so that no out-of-range pointer is formed.
constexpr uintptr_t kPrefetchAhead = 2048;
inline void PrefetchAhead(const std::byte* p) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kPrefetchAhead),
               _MM_HINT_T0);
}


// Loads 8 dtype values (any alignment) as floats.
template <uint8_t kDt>
inline __m256 Load8(const std::byte* p, size_t i) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
  if constexpr (kDt == numeric::kDtypeBf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_cvtph_ps(h);
}

// numeric::FloatToDtype of 8 non-NaN floats, as 32-bit lanes.
template <uint8_t kDt>
inline __m256i ToDtype8(__m256 v) {
  if constexpr (kDt == numeric::kDtypeBf16) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb),
                             16);
  } else {
    return _mm256_cvtepu16_epi32(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// Stores 8 floats as dtype values, rounding exactly like numeric::FloatToDtype. None may be NaN:
// the stores are the decoders', whose values never are (the validated metadata is finite, every
// code stands for a finite level).
template <uint8_t kDt>
inline void Store8(std::byte* p, size_t i, __m256 v) {
  __m128i out;
  if constexpr (kDt == numeric::kDtypeBf16) {
    __m256i r = ToDtype8<kDt>(v);
    __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: r0..3 r0..3 | r4..7 r4..7
    out = _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
  } else {
    out = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 2 * i), out);
}

// Stores 16 floats (lo: the first 8, none NaN) as dtype values with one 32-byte store, as Store8
// rounds.
template <uint8_t kDt>
inline void Store16(std::byte* p, size_t i, __m256 lo, __m256 hi) {
  __m256i out;
  if constexpr (kDt == numeric::kDtypeBf16) {
    // packus interleaves the halves by 128-bit lane (lo0-3 hi0-3 | lo4-7 hi4-7); 0xD8 reorders.
    out = _mm256_permute4x64_epi64(_mm256_packus_epi32(ToDtype8<kDt>(lo), ToDtype8<kDt>(hi)), 0xD8);
  } else {
    out = _mm256_set_m128i(_mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                           _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 2 * i), out);
}

// One dtype value as a float in every lane.
template <uint8_t kDt>
inline __m256 Broadcast(uint16_t v) {
  if constexpr (kDt == numeric::kDtypeBf16) {
    return _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(uint32_t{v} << 16)));
  } else {
    return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(v)));
  }
}

// Low byte of each 32-bit lane, in lane order, as 8 bytes.
inline uint64_t LowBytes(__m256i v) {
  const __m256i pick =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  __m256i b = _mm256_shuffle_epi8(v, pick);
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  return static_cast<uint64_t>(_mm_cvtsi128_si64(_mm256_castsi256_si128(b)));
}

inline __m256 FiniteAbs(__m256 v) {
  __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  __m256 finite = _mm256_cmp_ps(a, _mm256_set1_ps(kInf), _CMP_LT_OQ);
  return _mm256_and_ps(a, finite);
}

// numeric::ClampQ then round to nearest even, as int32 lanes.
inline __m256i ClampRound(__m256 v, __m256 lo, __m256 hi) {
  v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));  // NaN -> 0
  v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
  return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// ClampRound(v, 0, hi) without the NaN mask: maxps answers its second operand when one is NaN,
// so a NaN lane becomes the lower bound 0, as ClampQ's NaN -> 0 has it.
inline __m256i ClampRoundFromZero(__m256 v, __m256 hi) {
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), hi);
  return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// |x| of 16 dtype values as bits in 16-bit lanes, Inf and NaN lanes as 0: non-negative finite
// bf16 and fp16 values order as their bits do, so integer maxima of these are the float maxima
// FiniteAbs finds, 16 lanes at a time and without widening.
template <uint8_t kDt>
inline __m256i NotFinite16(__m256i abs_bits) {  // all ones where |x|'s bits are Inf or NaN
  return _mm256_cmpgt_epi16(abs_bits,
                            _mm256_set1_epi16(kDt == numeric::kDtypeBf16 ? 0x7F7F : 0x7BFF));
}
template <uint8_t kDt>
inline __m256i FiniteAbsBits16(__m256i v) {
  const __m256i a = _mm256_and_si256(v, _mm256_set1_epi16(0x7FFF));
  return _mm256_andnot_si256(NotFinite16<kDt>(a), a);
}

// Finite minimum and maximum of 16 dtype lanes at a time on the dtype's bits: a bf16 or fp16
// value with its magnitude bits flipped when negative orders as a signed 16-bit integer does as
// a float (-0 just below +0, which IntNGroupParams8's "+ 0" makes one). Lanes that never saw a
// finite value come out as +Inf / -Inf, as the float accumulation leaves them.
template <uint8_t kDt>
struct Extremes16 {
  __m256i mn = _mm256_set1_epi16(0x7FFF), mx = _mm256_set1_epi16(-0x8000);
  void Add(__m256i v) {
    const __m256i not_finite = NotFinite16<kDt>(_mm256_and_si256(v, _mm256_set1_epi16(0x7FFF)));
    const __m256i s = Sortable(v);
    mn = _mm256_min_epi16(mn, _mm256_blendv_epi8(s, _mm256_set1_epi16(0x7FFF), not_finite));
    mx = _mm256_max_epi16(mx, _mm256_blendv_epi8(s, _mm256_set1_epi16(-0x8000), not_finite));
  }
  // The minimum and maximum over all 16 lanes as floats.
  void GetAll(float* mn_f, float* mx_f) const {
    __m128i a = _mm_min_epi16(_mm256_castsi256_si128(mn), _mm256_extracti128_si256(mn, 1));
    __m128i b = _mm_max_epi16(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
    a = _mm_min_epi16(a, _mm_srli_si128(a, 8));
    b = _mm_max_epi16(b, _mm_srli_si128(b, 8));
    a = _mm_min_epi16(a, _mm_srli_si128(a, 4));
    b = _mm_max_epi16(b, _mm_srli_si128(b, 4));
    a = _mm_min_epi16(a, _mm_srli_si128(a, 2));
    b = _mm_max_epi16(b, _mm_srli_si128(b, 2));
    const int16_t lo = static_cast<int16_t>(_mm_extract_epi16(a, 0));
    const int16_t hi = static_cast<int16_t>(_mm_extract_epi16(b, 0));
    if (lo > hi) {  // no finite value
      *mn_f = kInf;
      *mx_f = -kInf;
      return;
    }
    auto to_float = [](int16_t v) {
      const uint16_t bits = static_cast<uint16_t>(v ^ ((v >> 15) & 0x7FFF));
      return _mm256_cvtss_f32(Broadcast<kDt>(bits));
    };
    *mn_f = to_float(lo);
    *mx_f = to_float(hi);
  }
  // Lanes 0-7 (half 0) or 8-15 (half 1) of the minimum and maximum as floats.
  void Get(int half, __m256* mn_f, __m256* mx_f) const {
    const __m256i empty = _mm256_cmpgt_epi16(mn, mx);
    *mn_f = ToFloat(Sortable(mn), empty, half, kInf);
    *mx_f = ToFloat(Sortable(mx), empty, half, -kInf);
  }

 private:
  // Its own inverse.
  static __m256i Sortable(__m256i v) {
    return _mm256_xor_si256(v,
                            _mm256_and_si256(_mm256_srai_epi16(v, 15), _mm256_set1_epi16(0x7FFF)));
  }
  static __m256 ToFloat(__m256i bits, __m256i empty, int half, float if_empty) {
    const __m128i b = half == 0 ? _mm256_castsi256_si128(bits) : _mm256_extracti128_si256(bits, 1);
    const __m128i e =
        half == 0 ? _mm256_castsi256_si128(empty) : _mm256_extracti128_si256(empty, 1);
    __m256 f;
    if constexpr (kDt == numeric::kDtypeBf16) {
      f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    } else {
      f = _mm256_cvtph_ps(b);
    }
    return _mm256_blendv_ps(f, _mm256_set1_ps(if_empty),
                            _mm256_castsi256_ps(_mm256_cvtepi16_epi32(e)));
  }
};

// Largest of 16 unsigned 16-bit lanes.
inline uint16_t HorizontalMaxU16(__m256i v) {
  __m128i m = _mm_max_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 8));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 4));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 2));
  return static_cast<uint16_t>(_mm_extract_epi16(m, 0));
}

// Largest lane (no NaN lanes: the order of the maxima does not matter).
inline float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// e4m3 codes (16-bit lanes) as the fp16 bit patterns of their values / 256: the code's exponent
// and mantissa fields moved into fp16's (exponent bias 15 against e4m3's 7, so every normal and
// subnormal code, 0x7F/0xFF's +-480 included, is its value times 2^-8 exactly).
inline __m256i E4m3AsFp16(__m256i w) {
  return _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(-0x8000)),
                         _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3F80)));
}

// numeric::E4m3ToFloat of 16 codes (lo: the first 8; a caller with 8 codes uses lo alone): F16C
// converts exactly, and the factor of 2^8 is exact too.
inline void E4m3ToFloat16(__m128i codes, __m256* lo, __m256* hi) {
  const __m256i h = E4m3AsFp16(_mm256_cvtepu8_epi16(codes));
  const __m256 k = _mm256_set1_ps(256.0f);
  *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k);
  *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k);
}

// numeric::FloatToE4m3 of 8 clamped, non-NaN floats, as 32-bit lanes. The subnormal code
// round(|y| * 512) is |y| + 2^14 (whose ulp is 2^-9) less 2^14's bits; the normal code
// ((exp - 120) << 3) | mantissa is the rounded bits >> 20, less 120 << 3.
inline __m256i FloatToE4m3x8(__m256 y) {
  __m256i u = _mm256_castps_si256(y);
  __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(16384.0f))),
      _mm256_set1_epi32(0x46800000));
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7FFFF)), lsb);
  __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(120 << 3));
  __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), a);
  return _mm256_or_si256(sign, _mm256_blendv_epi8(normal, sub, is_sub));
}

// Lane k's bit offset in 8 packed `bits`-bit values: k * bits.
template <uint32_t bits>
inline __m256i LaneShifts() {
  return _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits);
}

// Packs 8 lanes of `bits`-bit values into bits bytes (8 * bits / 8), LSB first.
template <uint32_t bits>
inline uint32_t PackLanes(__m256i q) {
  __m256i s = _mm256_sllv_epi32(q, LaneShifts<bits>());
  __m128i x = _mm_or_si128(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  x = _mm_or_si128(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_or_si128(x, _mm_shuffle_epi32(x, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(x));
}

// Packs 32 lanes of `bits`-bit values (q0: elements 0-7, ..., q3: 24-31) into 32 * bits / 8
// bytes at dst, LSB first as PackLanes does: narrowed to bytes, then adjacent bytes merged by
// multiply-adds (b0 + 16 b1 for 4 bits; b0 + 4 b1, then pairs of those + 16x, for 2 bits).
template <uint32_t bits>
inline void Pack32(std::byte* dst, __m256i q0, __m256i q1, __m256i q2, __m256i q3) {
  static_assert(bits == 4 || bits == 2);
  // packus keeps each 128-bit lane's order: bytes come out as 4-element groups 0 2 4 6 1 3 5 7.
  const __m256i b = _mm256_permutevar8x32_epi32(
      _mm256_packus_epi16(_mm256_packus_epi32(q0, q1), _mm256_packus_epi32(q2, q3)),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if constexpr (bits == 4) {
    const __m256i w = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x1001));  // 16 x (b0 + 16 b1)
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(p));
  } else {
    const __m256i w = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x0401));   // 16 x (b0 + 4 b1)
    const __m256i d = _mm256_madd_epi16(w, _mm256_set1_epi32(0x00100001));  // 8 x (w0 + 16 w1)
    const __m256i n = _mm256_packus_epi16(_mm256_packus_epi32(d, d), _mm256_setzero_si256());
    // Bytes 0-3 of each 128-bit lane are 4 output bytes (4 codes each).
    const uint64_t lo = static_cast<uint32_t>(_mm256_extract_epi32(n, 0));
    const uint64_t hi = static_cast<uint32_t>(_mm256_extract_epi32(n, 4));
    const uint64_t out = lo | hi << 32;
    std::memcpy(dst, &out, 8);
  }
}

// The 8 `bits`-bit values packed at element i (a multiple of 8) as floats.
template <uint32_t bits>
inline __m256 UnpackLanes(const std::byte* packed, size_t i) {
  uint32_t word = 0;
  if constexpr (bits == 3) {
    // Three bytes into a register directly: a 3-byte memcpy into a word read back at once stalls
    // on store forwarding (most of k4v3's decode loop, in perf).
    const auto* b = reinterpret_cast<const uint8_t*>(packed + i * bits / 8);
    word = uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16;
  } else {
    std::memcpy(&word, packed + i * bits / 8, bits);  // 8 lanes * bits / 8 bytes
  }
  __m256i q = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), LaneShifts<bits>()),
      _mm256_set1_epi32((1 << bits) - 1));
  return _mm256_cvtepi32_ps(q);
}

// The 16 `bits`-bit values packed at element i (a multiple of 8) as floats (lo: the first 8).
// 4 bits: the 8 bytes widened to 32-bit lanes, their low and high nibbles interleaved.
template <uint32_t bits>
inline void Unpack16(const std::byte* packed, size_t i, __m256* lo, __m256* hi) {
  if constexpr (bits == 4) {
    const __m256i w =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + i / 2)));
    const __m256i even = _mm256_and_si256(w, _mm256_set1_epi32(0xF));  // codes 0 2 4 .. 14
    const __m256i odd = _mm256_srli_epi32(w, 4);                       // codes 1 3 5 .. 15
    const __m256i a = _mm256_unpacklo_epi32(even, odd);                // 0-3 | 8-11
    const __m256i b = _mm256_unpackhi_epi32(even, odd);                // 4-7 | 12-15
    *lo = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a, b, 0x20));
    *hi = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a, b, 0x31));
  } else {
    *lo = UnpackLanes<bits>(packed, i);
    *hi = UnpackLanes<bits>(packed, i + 8);
  }
}

// Smallest lane (no NaN lanes; which of -0 and +0 comes out does not matter to the callers,
// which add +0 before using it).
inline float HorizontalMin(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  m = _mm_min_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 32-bit lanes holding 16-bit values -> 8 packed 16-bit values.
inline __m128i Narrow16(__m256i v) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08));
}

// numeric::DtypeToFloat of 8 dtype values held in 32-bit lanes.
template <uint8_t kDt>
inline __m256 FromDtype8(__m256i v) {
  if constexpr (kDt == numeric::kDtypeBf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  } else {
    return _mm256_cvtph_ps(Narrow16(v));
  }
}

// numeric::RoundUpDtype of 8 non-negative floats (NaN and Inf lanes too), as 32-bit lanes. (For
// int4/int2 ranges a finite x never rounds past the largest finite value: a finite mx - mn is
// at most FLT_MAX, divided by qmax >= 3. The check is kept so that this is RoundUpDtype.)
template <uint8_t kDt>
inline __m256i RoundUpDtype8(__m256 x) {
  constexpr bool kBf16 = kDt == numeric::kDtypeBf16;
  // Also the largest finite magnitude: (v & 0x7FFF) above it is Inf or NaN.
  const __m256i max_finite = _mm256_set1_epi32(kBf16 ? 0x7F7F : 0x7BFF);
  const __m256i abs16 = _mm256_set1_epi32(0x7FFF);
  const __m256i xb = _mm256_castps_si256(x);
  const __m256i not_finite = _mm256_cmpgt_epi32(
      _mm256_and_si256(xb, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F7FFFFF));
  // NaN lanes are not_finite; keep them out of the conversions (0 in their place).
  const __m256 xs = _mm256_andnot_ps(_mm256_castsi256_ps(not_finite), x);
  __m256i v = ToDtype8<kDt>(xs);
  __m256i over = _mm256_cmpgt_epi32(_mm256_and_si256(v, abs16), max_finite);
  // One ulp up where rounding went down (the lane is -1 there).
  v = _mm256_sub_epi32(v, _mm256_castps_si256(_mm256_cmp_ps(FromDtype8<kDt>(v), xs, _CMP_LT_OQ)));
  over = _mm256_or_si256(over, _mm256_cmpgt_epi32(_mm256_and_si256(v, abs16), max_finite));
  v = _mm256_blendv_epi8(v, max_finite, over);
  v = _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(xs, _mm256_setzero_ps(), _CMP_LE_OQ)),
                          v);
  return _mm256_blendv_epi8(v, max_finite, not_finite);
}

// IntNGroupParams of 8 groups (lanes) from their finite minimum and maximum (+Inf and -Inf for a
// group without a finite value, which gets min = max = 0 as in EncodeIntNScalar), bit for bit:
// the same operations in the same order, the dtype roundings above matching numeric.h.
struct IntNParams8 {
  __m128i scale, min;  // dtype bits, 8 x 16
  __m256 min_f, divisor;
};
template <uint8_t kDt>
inline IntNParams8 IntNGroupParams8(__m256 mn, __m256 mx, __m256 qmax) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 empty = _mm256_cmp_ps(mn, mx, _CMP_GT_OQ);
  mn = _mm256_add_ps(_mm256_andnot_ps(empty, mn), zero);  // + 0: a -0 extreme becomes +0
  mx = _mm256_add_ps(_mm256_andnot_ps(empty, mx), zero);
  const __m256i min = ToDtype8<kDt>(mn);
  const __m256i scale = RoundUpDtype8<kDt>(_mm256_div_ps(_mm256_sub_ps(mx, mn), qmax));
  const __m256 s = FromDtype8<kDt>(scale);
  IntNParams8 p;
  p.scale = Narrow16(scale);
  p.min = Narrow16(min);
  p.min_f = FromDtype8<kDt>(min);
  p.divisor = _mm256_blendv_ps(s, _mm256_set1_ps(1.0f), _mm256_cmp_ps(s, zero, _CMP_EQ_OQ));
  return p;
}

// Int8RowScale of 8 rows or channels (lanes) from their largest finite |x|: the dtype scales
// (8 x 16 bits) and the divisors, bit for bit.
template <uint8_t kDt>
inline __m128i Int8Scales8(__m256 amax, __m256* divisor) {
  const __m256i scale = RoundUpDtype8<kDt>(_mm256_div_ps(amax, _mm256_set1_ps(127.0f)));
  const __m256 f = FromDtype8<kDt>(scale);
  *divisor = _mm256_blendv_ps(f, _mm256_set1_ps(1.0f),
                              _mm256_cmp_ps(f, _mm256_setzero_ps(), _CMP_EQ_OQ));
  return Narrow16(scale);
}

// ---------------------------------------------------------------- fp8

template <uint8_t kDt>
void EncodeFp8Impl(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  if (D % 8 != 0) return EncodeFp8Scalar(shape, in, payload);
  // Each head's max |x|, kHeadChunk heads at a time in registers: a token's rows of those heads
  // are contiguous, so cold input streams from memory once when H <= kHeadChunk. Its lines are
  // prefetched 2 KiB ahead (4-7% less encode time on a cold 64 MiB working set, paired A/B).
  // The maxima are taken on the dtype's bits (FiniteAbsBits16), 16 values per step.
  for (uint32_t h0 = 0; h0 < H; h0 += kHeadChunk) {
    const uint32_t nh = MinU32(kHeadChunk, H - h0);
    __m256i acc[kHeadChunk];
    for (uint32_t k = 0; k < nh; ++k) acc[k] = _mm256_setzero_si256();
    for (uint32_t t = 0; t < T; ++t) {
      for (uint32_t k = 0; k < nh; ++k) {
        const std::byte* row = in + 2 * ((size_t{t} * H + h0 + k) * D);
        __m256i m = acc[k];
        for (uint32_t d = 0; d < D; d += 32) PrefetchAhead(row + 2 * d);
        uint32_t d = 0;
        for (; d + 16 <= D; d += 16) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * d));
          m = _mm256_max_epu16(m, FiniteAbsBits16<kDt>(v));
        }
        if (d < D) {  // D % 16 == 8; the zeroed upper lanes leave the maximum alone
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d));
          m = _mm256_max_epu16(m, FiniteAbsBits16<kDt>(_mm256_zextsi128_si256(v)));
        }
        acc[k] = m;
      }
    }
    for (uint32_t k = 0; k < nh; ++k) {
      const float amax = _mm256_cvtss_f32(Broadcast<kDt>(HorizontalMaxU16(acc[k])));
      PutF32(payload, h0 + k, amax / 448.0f);
    }
  }
  std::byte* codes = payload + 4 * size_t{H};
  const __m256 lo = _mm256_set1_ps(-448.0f), hi = _mm256_set1_ps(448.0f);
  auto code8 = [&](size_t i, __m256 div) {
    __m256 y = _mm256_div_ps(Load8<kDt>(in, i), div);
    y = _mm256_and_ps(y, _mm256_cmp_ps(y, y, _CMP_ORD_Q));
    y = _mm256_min_ps(_mm256_max_ps(y, lo), hi);
    return FloatToE4m3x8(y);
  };
  // Rows by token and head (no division per row to find the head), 32 codes per store when D
  // allows: two packs and a lane permute instead of a shuffle, a permute and a store per 8.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  size_t row = 0;
  for (uint32_t t = 0; t < T; ++t) {
    for (uint32_t h = 0; h < H; ++h, ++row) {
      const float scale = GetF32(payload, h);
      const __m256 div = _mm256_set1_ps(scale == 0.0f ? 1.0f : scale);
      const size_t base = row * D;
      uint32_t d = 0;
      for (; d + 32 <= D; d += 32) {
        // Codes are 0..255 in 32-bit lanes; the packs keep each 128-bit lane's order, so
        // bytes come out as 4-code groups in the order 0 2 4 6 1 3 5 7 and `order` fixes that.
        const __m256i c01 = _mm256_packus_epi32(code8(base + d, div), code8(base + d + 8, div));
        const __m256i c23 =
            _mm256_packus_epi32(code8(base + d + 16, div), code8(base + d + 24, div));
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(c01, c23), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + base + d), bytes);
      }
      for (; d < D; d += 8) {
        uint64_t b = LowBytes(code8(base + d, div));
        std::memcpy(codes + base + d, &b, 8);
      }
    }
  }
}

template <uint8_t kDt>
void DecodeFp8Impl(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  if (D % 8 != 0) return DecodeFp8Scalar(shape, payload, out);
  const std::byte* codes = payload + 4 * size_t{H};
  size_t row = 0;
  for (uint32_t t = 0; t < T; ++t) {
    for (uint32_t h = 0; h < H; ++h, ++row) {
      const __m256 scale = _mm256_set1_ps(GetF32(payload, h));
      const size_t base = row * D;
      uint32_t d = 0;
      for (; d + 16 <= D; d += 16) {
        __m256 lo, hi;
        E4m3ToFloat16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + base + d)), &lo,
                      &hi);
        Store16<kDt>(out, base + d, _mm256_mul_ps(lo, scale), _mm256_mul_ps(hi, scale));
      }
      if (d < D) {  // D % 16 == 8
        __m256 lo, unused;
        E4m3ToFloat16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + base + d)), &lo,
                      &unused);
        Store8<kDt>(out, base + d, _mm256_mul_ps(lo, scale));
      }
    }
  }
}

// ---------------------------------------------------------------- int8

template <uint8_t kDt>
void EncodeInt8Impl(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  if (D % 8 != 0) return EncodeInt8Scalar(shape, in, payload);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  if (!shape.is_value) {
    std::byte* q = payload + 2 * size_t{H} * D;
    for (uint32_t h = 0; h < H; ++h) {
      for (uint32_t d = 0; d < D; d += 8) {
        __m256 m = _mm256_setzero_ps();
        for (uint32_t t = 0; t < T; ++t) {
          m = _mm256_max_ps(m, FiniteAbs(Load8<kDt>(in, (size_t{t} * H + h) * D + d)));
        }
        __m256 div;
        const __m128i scales = Int8Scales8<kDt>(m, &div);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(payload + 2 * (size_t{h} * D + d)), scales);
        for (uint32_t t = 0; t < T; ++t) {
          size_t i = (size_t{t} * H + h) * D + d;
          uint64_t b = LowBytes(ClampRound(_mm256_div_ps(Load8<kDt>(in, i), div), lo, hi));
          std::memcpy(q + i, &b, 8);
        }
      }
    }
  } else {
    // Rows 8 at a time: the 8 scales are computed together (one row at a time, the scalar
    // scale step cost about as much as the row's quantization).
    std::byte* q = payload + 2 * size_t{T} * H;
    const size_t rows = size_t{T} * H;
    for (size_t r0 = 0; r0 < rows; r0 += 8) {
      const size_t nr = rows - r0 < 8 ? rows - r0 : 8;
      alignas(32) float amax[8] = {}, divisor[8];
      for (size_t k = 0; k < nr; ++k) {
        __m256 m = _mm256_setzero_ps();
        for (uint32_t d = 0; d < D; d += 8) {
          m = _mm256_max_ps(m, FiniteAbs(Load8<kDt>(in, (r0 + k) * D + d)));
        }
        amax[k] = HorizontalMax(m);
      }
      __m256 div8;
      const __m128i scales = Int8Scales8<kDt>(_mm256_load_ps(amax), &div8);
      if (nr == 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(payload + 2 * r0), scales);
      } else {
        alignas(16) uint16_t sc[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(sc), scales);
        std::memcpy(payload + 2 * r0, sc, 2 * nr);
      }
      _mm256_store_ps(divisor, div8);
      for (size_t k = 0; k < nr; ++k) {
        const __m256 div = _mm256_set1_ps(divisor[k]);
        for (uint32_t d = 0; d < D; d += 8) {
          size_t i = (r0 + k) * D + d;
          uint64_t b = LowBytes(ClampRound(_mm256_div_ps(Load8<kDt>(in, i), div), lo, hi));
          std::memcpy(q + i, &b, 8);
        }
      }
    }
  }
}

template <uint8_t kDt>
void DecodeInt8Impl(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  if (D % 8 != 0) return DecodeInt8Scalar(shape, payload, out);
  const std::byte* q = payload + 2 * (shape.is_value ? size_t{T} * H : size_t{H} * D);
  for (size_t row = 0; row < size_t{T} * H; ++row) {
    const uint32_t h = static_cast<uint32_t>(row % H);
    __m256 vscale = _mm256_setzero_ps();
    if (shape.is_value) {
      vscale = Broadcast<kDt>(Get16(payload, row));
    }
    for (uint32_t d = 0; d < D; d += 8) {
      size_t i = row * D + d;
      __m256 scale = shape.is_value ? vscale : Load8<kDt>(payload, size_t{h} * D + d);
      __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
      __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), scale);
      Store8<kDt>(out, i, x);
    }
  }
}

// ---------------------------------------------------------------- int4 / int2

template <uint8_t kDt, uint32_t bits>
void EncodeIntNImpl(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  if (D % 8 != 0) return EncodeIntNScalar(shape, bits, in, payload);
  const IntNLayout l = IntNLayoutFor(shape, bits);
  const float qmax_f = static_cast<float>((1u << bits) - 1);
  const __m256 qmax = _mm256_set1_ps(qmax_f);
  const __m256 inf = _mm256_set1_ps(kInf), ninf = _mm256_set1_ps(-kInf);
  std::byte* scales = payload;
  std::byte* mins = payload + 2 * l.meta_count;
  std::byte* packed = payload + 4 * l.meta_count;
  if (l.packed_bytes > 0) packed[l.packed_bytes - 1] = std::byte{0};
  auto quantize8 = [&](size_t i, __m256 min_f, __m256 div) {
    __m256 v = _mm256_div_ps(_mm256_sub_ps(Load8<kDt>(in, i), min_f), div);
    uint32_t word = PackLanes<bits>(ClampRoundFromZero(v, qmax));
    std::memcpy(packed + i * bits / 8, &word, bits);
  };
  // Running min/max over finite lanes, argument order matching std::min(mn, x)/std::max(mx, x).
  auto accumulate = [&](__m256 x, __m256& mn, __m256& mx) {
    __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), inf, _CMP_LT_OQ);
    mn = _mm256_min_ps(_mm256_blendv_ps(inf, x, finite), mn);
    mx = _mm256_max_ps(_mm256_blendv_ps(ninf, x, finite), mx);
  };
  // Quantizes the contiguous elements [i, i + n) (n a multiple of 8) whose 8-lane blocks take
  // their minimum and divisor from mf[c] and dv[c] (c counted from 0 at i; `step` 1) or all from
  // mf[0] and dv[0] (`step` 0): 32 at a time through Pack32, the rest 8 at a time.
  auto quantize_run = [&](size_t i, uint32_t n, const __m256* mf, const __m256* dv, uint32_t step) {
    uint32_t k = 0;
    for (; k + 32 <= n; k += 32) {
      const uint32_t c = (k / 8) * step;
      // The v-th 8 lanes (a lambda called four times: an array of the four went to the stack).
      auto q = [&](uint32_t v) {
        const __m256 x = _mm256_div_ps(
            _mm256_sub_ps(Load8<kDt>(in, i + k + 8 * v), mf[c + v * step]), dv[c + v * step]);
        return ClampRoundFromZero(x, qmax);
      };
      Pack32<bits>(packed + (i + k) * bits / 8, q(0), q(1), q(2), q(3));
    }
    for (; k < n; k += 8) quantize8(i + k, mf[(k / 8) * step], dv[(k / 8) * step]);
  };
  if (!shape.is_value) {
    // Per group of tokens and head: each 8-channel column's extremes and parameters, then the
    // group's rows quantized whole (contiguous channels, so Pack32 applies), kColumns columns
    // (256 channels) at a time.
    constexpr uint32_t kColumns = 32;
    __m256 col_min[kColumns], col_div[kColumns];
    for (uint32_t j = 0; j < l.num_groups; ++j) {
      const uint32_t t0 = j * l.group_len, len = MinU32(l.group_len, T - t0);
      for (uint32_t h = 0; h < H; ++h) {
        for (uint32_t d0 = 0; d0 < D; d0 += 8 * kColumns) {
          const uint32_t width = MinU32(8 * kColumns, D - d0);
          // The column of 8 channels at d from its extremes.
          auto column = [&](uint32_t d, __m256 mn, __m256 mx) {
            const IntNParams8 p = IntNGroupParams8<kDt>(mn, mx, qmax);
            const size_t m = (size_t{j} * H + h) * D + d;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + 2 * m), p.scale);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(mins + 2 * m), p.min);
            col_min[(d - d0) / 8] = p.min_f;
            col_div[(d - d0) / 8] = p.divisor;
          };
          uint32_t d = d0;
          for (; d + 16 <= d0 + width; d += 16) {  // two columns from 16-lane extremes
            Extremes16<kDt> e;
            for (uint32_t t = t0; t < t0 + len; ++t) {
              e.Add(_mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(in + 2 * ((size_t{t} * H + h) * D + d))));
            }
            __m256 mn, mx;
            e.Get(0, &mn, &mx);
            column(d, mn, mx);
            e.Get(1, &mn, &mx);
            column(d + 8, mn, mx);
          }
          if (d < d0 + width) {  // width % 16 == 8
            __m256 mn = inf, mx = ninf;
            for (uint32_t t = t0; t < t0 + len; ++t) {
              accumulate(Load8<kDt>(in, (size_t{t} * H + h) * D + d), mn, mx);
            }
            column(d, mn, mx);
          }
          for (uint32_t t = t0; t < t0 + len; ++t) {
            quantize_run((size_t{t} * H + h) * D + d0, width, col_min, col_div, 1);
          }
        }
      }
    }
  } else {
    // Groups (index m = row * NG + j, the order of their metadata) 8 at a time: each group's
    // extremes reduced to one lane, the 8 groups' parameters computed together, then each
    // group quantized with its lane broadcast (the one-group-at-a-time scalar parameter step
    // cost as much as the group's quantization).
    const uint32_t g_len = l.group_len;  // a multiple of 8: min(G, D), both multiples of 8
    const size_t groups = l.meta_count;  // T * H * NG
    size_t row = 0;
    uint32_t j = 0;  // group m0's row and index in it
    for (size_t m0 = 0; m0 < groups; m0 += 8) {
      const int lanes = static_cast<int>(groups - m0 < 8 ? groups - m0 : 8);
      alignas(32) float mnv[8], mxv[8], minf[8], divv[8];
      size_t r = row;
      uint32_t jj = j;
      for (int k = 0; k < 8; ++k) {
        const uint32_t len = k < lanes ? MinU32(g_len, D - jj * g_len) : 0;
        if (len > 0 && len % 16 == 0) {
          Extremes16<kDt> e;
          const std::byte* group = in + 2 * (r * D + size_t{jj} * g_len);
          for (uint32_t d = 0; d < len; d += 16) {
            e.Add(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 2 * d)));
          }
          e.GetAll(&mnv[k], &mxv[k]);
          if (++jj == l.num_groups) jj = 0, ++r;
          continue;
        }
        __m256 mn = inf, mx = ninf;
        if (k < lanes) {
          const uint32_t d0 = jj * g_len;
          for (uint32_t d = d0; d < d0 + len; d += 8) accumulate(Load8<kDt>(in, r * D + d), mn, mx);
          if (++jj == l.num_groups) jj = 0, ++r;
        }
        mnv[k] = HorizontalMin(mn);
        mxv[k] = HorizontalMax(mx);
      }
      const IntNParams8 p =
          IntNGroupParams8<kDt>(_mm256_load_ps(mnv), _mm256_load_ps(mxv), qmax);
      if (lanes == 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + 2 * m0), p.scale);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(mins + 2 * m0), p.min);
      } else {
        alignas(16) uint16_t sc[8], mi[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(sc), p.scale);
        _mm_store_si128(reinterpret_cast<__m128i*>(mi), p.min);
        std::memcpy(scales + 2 * m0, sc, 2 * static_cast<size_t>(lanes));
        std::memcpy(mins + 2 * m0, mi, 2 * static_cast<size_t>(lanes));
      }
      _mm256_store_ps(minf, p.min_f);
      _mm256_store_ps(divv, p.divisor);
      for (int k = 0; k < lanes; ++k) {
        const uint32_t d0 = j * g_len, len = MinU32(g_len, D - d0);
        const __m256 mf = _mm256_set1_ps(minf[k]), dv = _mm256_set1_ps(divv[k]);
        quantize_run(row * D + d0, len, &mf, &dv, 0);
        if (++j == l.num_groups) j = 0, ++row;
      }
    }
  }
}

template <uint8_t kDt, uint32_t bits>
void DecodeIntNImpl(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  if (D % 8 != 0) return DecodeIntNScalar(shape, bits, payload, out);
  const IntNLayout l = IntNLayoutFor(shape, bits);
  const std::byte* scales = payload;
  const std::byte* mins = payload + 2 * l.meta_count;
  const std::byte* packed = payload + 4 * l.meta_count;
  if (!shape.is_value) {
    for (uint32_t t = 0; t < T; ++t) {
      const size_t mbase = size_t{t / l.group_len} * H * D;
      for (uint32_t h = 0; h < H; ++h) {
        uint32_t d = 0;
        for (; d + 16 <= D; d += 16) {
          const size_t i = (size_t{t} * H + h) * D + d;
          const size_t m = mbase + size_t{h} * D + d;
          __m256 lo, hi;
          Unpack16<bits>(packed, i, &lo, &hi);
          Store16<kDt>(
              out, i, _mm256_add_ps(_mm256_mul_ps(lo, Load8<kDt>(scales, m)), Load8<kDt>(mins, m)),
              _mm256_add_ps(_mm256_mul_ps(hi, Load8<kDt>(scales, m + 8)), Load8<kDt>(mins, m + 8)));
        }
        if (d < D) {  // D % 16 == 8
          const size_t i = (size_t{t} * H + h) * D + d;
          const size_t m = mbase + size_t{h} * D + d;
          __m256 x =
              _mm256_add_ps(_mm256_mul_ps(UnpackLanes<bits>(packed, i), Load8<kDt>(scales, m)),
                            Load8<kDt>(mins, m));
          Store8<kDt>(out, i, x);
        }
      }
    }
  } else {
    for (size_t row = 0; row < size_t{T} * H; ++row) {
      for (uint32_t j = 0; j < l.num_groups; ++j) {
        const uint32_t d0 = j * l.group_len, len = MinU32(l.group_len, D - d0);
        const size_t m = row * l.num_groups + j;
        const __m256 scale = Broadcast<kDt>(Get16(scales, m));
        const __m256 mn = Broadcast<kDt>(Get16(mins, m));
        uint32_t d = d0;
        for (; d + 16 <= d0 + len; d += 16) {
          const size_t i = row * D + d;
          __m256 lo, hi;
          Unpack16<bits>(packed, i, &lo, &hi);
          Store16<kDt>(out, i, _mm256_add_ps(_mm256_mul_ps(lo, scale), mn),
                       _mm256_add_ps(_mm256_mul_ps(hi, scale), mn));
        }
        if (d < d0 + len) {  // len % 16 == 8
          const size_t i = row * D + d;
          Store8<kDt>(out, i,
                      _mm256_add_ps(_mm256_mul_ps(UnpackLanes<bits>(packed, i), scale), mn));
        }
      }
    }
  }
}

// ---------------------------------------------------------------- k4v3

// k4v3::Flip for elements d0 .. d0 + 7 as sign bits: bit 31 set where Flip is -1 (bit 31 of
// d * 0x9E3779B1). XOR with them is the multiplication by Flip for every float but NaN, which
// neither V kernel flips (encode zeroes non-finite values first; decode never makes a NaN).
inline __m256 FlipBits8(uint32_t d0) {
  const __m256i d = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(d0)),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i m = _mm256_mullo_epi32(d, _mm256_set1_epi32(static_cast<int>(0x9E3779B1u)));
  return _mm256_castsi256_ps(_mm256_and_si256(m, _mm256_set1_epi32(static_cast<int>(0x80000000u))));
}

// The FlipBits8 of a row of D = 8 * kN elements, made once per segment.
template <uint32_t kN>
struct FlipRow {
  FlipRow() {
    for (uint32_t k = 0; k < kN; ++k) bits[k] = FlipBits8(8 * k);
  }
  __m256 bits[kN];
};

// One stage of k4v3::Fwht inside a vector: `partner` holds each lane's partner (the lane whose
// index differs in bit `len`), `with_bit` the sign bit in the lanes with that bit. Lanes without
// it get a + b, the others (-b) + a = a - b (a the lane without the bit, b the one with): the
// same rounding as k4v3::Fwht's.
inline __m256 FwhtLanes(__m256 x, __m256 partner, __m256 with_bit) {
  return _mm256_add_ps(_mm256_xor_ps(x, with_bit), partner);
}

// The first three stages of k4v3::Fwht (len 1, 2, 4) on the 8 elements of one vector.
inline __m256 FwhtIn8(__m256 x) {
  const __m256 m = _mm256_set1_ps(-0.0f), z = _mm256_setzero_ps();
  x = FwhtLanes(x, _mm256_permute_ps(x, 0xB1), _mm256_blend_ps(z, m, 0xAA));  // lanes 1 0 3 2
  x = FwhtLanes(x, _mm256_permute_ps(x, 0x4E), _mm256_blend_ps(z, m, 0xCC));  // lanes 2 3 0 1
  return FwhtLanes(x, _mm256_permute2f128_ps(x, x, 0x01), _mm256_blend_ps(z, m, 0xF0));
}

// k4v3::ChunkAt, restated here with internal linkage (this file calls nothing inline from the
// shared headers: "ISA isolation" in segment_codecs.h): the length of the chunk of an n-long row
// that starts at `offset`, the largest power of two <= n - offset.
constexpr uint32_t ChunkAt(uint32_t n, uint32_t offset) {
  uint32_t len = 1;
  while (len <= (n - offset) / 2) len <<= 1;
  return len;
}

// k4v3's V transform of a row of 8 * kN floats held in registers (as far as they go): k4v3::Fwht
// on each chunk of the row (ChunkAt: kN's binary decomposition in vectors, as 8 * kN's in
// elements is 8 times it), the stages inside each vector, then those across the chunk's vectors
// (len 8, 16, ..).
template <uint32_t kN>
inline void FwhtRow(__m256 (&v)[kN]) {
  for (uint32_t k = 0; k < kN; ++k) v[k] = FwhtIn8(v[k]);
  for (uint32_t c = 0, len = 0; c < kN; c += len) {
    len = ChunkAt(kN, c);
    for (uint32_t m = 1; m < len; m <<= 1) {
      for (uint32_t i = c; i < c + len; i += 2 * m) {
        for (uint32_t k = i; k < i + m; ++k) {
          const __m256 a = v[k], b = v[k + m];
          v[k] = _mm256_add_ps(a, b);
          v[k + m] = _mm256_sub_ps(a, b);
        }
      }
    }
  }
}

// The normalisation of each vector of a row of 8 * kN elements: K4v3HadamardNorm of the length
// of the chunk that holds it, made once per segment.
template <uint32_t kN>
struct NormRow {
  NormRow() {
    for (uint32_t c = 0, len = 0; c < kN; c += len) {
      len = ChunkAt(kN, c);
      for (uint32_t k = c; k < c + len; ++k) norm[k] = _mm256_set1_ps(K4v3HadamardNorm(8 * len));
    }
  }
  __m256 norm[kN];
};

// UnpackLanes<3> of the group of 8 codes whose 3 bytes start at p, from a 16-byte load (16
// bytes must be readable there): each lane takes the one or two bytes holding its code and
// shifts it down.
inline __m256 Unpack3Wide(const std::byte* p) {
  const __m256i v =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // Code j sits at bit 3j: byte 3j / 8, shifted down by 3j % 8.
  const __m256i pick = _mm256_setr_epi8(0, 1, -1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 1, 2, -1, -1, 1,
                                        2, -1, -1, 1, 2, -1, -1, 2, -1, -1, -1, 2, -1, -1, -1);
  const __m256i q =
      _mm256_srlv_epi32(_mm256_shuffle_epi8(v, pick), _mm256_setr_epi32(0, 3, 6, 1, 4, 7, 2, 5));
  return _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(7)));
}

// The V kernels take dims 8 * kN for the powers of two kN = 1, 2, .., 32 and for the head dims
// 48, 80, 96 and 112 (kN = 6, 10, 12, 14; in chunks); a row lives in kN registers as far as they
// go. The scalar path takes the others.
bool K4v3ValueFits(uint32_t dim) {
  switch (dim) {
    case 8:
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
// Rows whose scales are computed together (one lane each).
constexpr uint32_t kK4v3RowGroup = 8;

// Largest int32 lane.
inline int32_t HorizontalMaxInt(__m256i v) {
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));
  return _mm_cvtsi128_si32(m);
}

// EncodeK4v3ValueScalar for rows of D = 8 * kN: each row in registers from its load to its
// transform's end, the row scales of kK4v3RowGroup rows at once (RoundUpDtype8), then each row's
// codes.
template <uint8_t kDt, uint32_t kN>
void EncodeK4v3ValueRows(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  constexpr uint32_t D = 8 * kN;
  constexpr size_t code_bytes = 3 * kN;  // per row
  const size_t rows = size_t{shape.tokens} * shape.heads;
  const NormRow<kN> norms;
  const __m256 inf = _mm256_set1_ps(kInf);
  const FlipRow<kN> flips;
  std::byte* codes = payload + 2 * rows;
  alignas(32) float u[kK4v3RowGroup * D];
  for (size_t r0 = 0; r0 < rows; r0 += kK4v3RowGroup) {
    const uint32_t g = rows - r0 < kK4v3RowGroup ? static_cast<uint32_t>(rows - r0) : kK4v3RowGroup;
    alignas(32) int32_t amax_bits[kK4v3RowGroup] = {};
    for (uint32_t l = 0; l < g; ++l) {
      const std::byte* row = in + 2 * (r0 + l) * D;
      __m256 v[kN];
      for (uint32_t k = 0; k < kN; ++k) {
        // k4v3::ValueIn: non-finite -> 0, then the flip.
        const __m256 x = Load8<kDt>(row, 8 * k);
        const __m256 finite =
            _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), inf, _CMP_LT_OQ);
        v[k] = _mm256_xor_ps(_mm256_and_ps(x, finite), flips.bits[k]);
      }
      FwhtRow(v);
      __m256i mx = _mm256_setzero_si256();
      for (uint32_t k = 0; k < kN; ++k) {
        const __m256 y = _mm256_mul_ps(v[k], norms.norm[k]);
        _mm256_store_ps(u + l * D + 8 * k, y);
        __m256i a = _mm256_and_si256(_mm256_castps_si256(y), _mm256_set1_epi32(0x7FFFFFFF));
        a = _mm256_and_si256(a, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), a));
        mx = _mm256_max_epi32(mx, a);
      }
      amax_bits[l] = HorizontalMaxInt(mx);
    }
    // k4v3::ScaleFromMaxBits of the group's rows (lanes past g: scale 0, unused).
    const __m256 amax =
        _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(amax_bits)));
    const __m256i scale =
        RoundUpDtype8<kDt>(_mm256_div_ps(amax, _mm256_set1_ps(k4v3::kScaleDivisor)));
    const __m256 f = FromDtype8<kDt>(scale);
    alignas(32) float divisor[kK4v3RowGroup];
    _mm256_store_ps(divisor, _mm256_blendv_ps(f, _mm256_set1_ps(1.0f),
                                              _mm256_cmp_ps(f, _mm256_setzero_ps(), _CMP_EQ_OQ)));
    alignas(16) uint16_t scales[kK4v3RowGroup];
    _mm_store_si128(reinterpret_cast<__m128i*>(scales), Narrow16(scale));
    std::memcpy(payload + 2 * r0, scales, 2 * g);
    for (uint32_t l = 0; l < g; ++l) {
      const float* v = u + l * D;
      const __m256 div = _mm256_set1_ps(divisor[l]);
      std::byte* out = codes + (r0 + l) * code_bytes;
      for (uint32_t k = 0; k < kN; ++k) {
        const __m256 q =
            _mm256_add_ps(_mm256_div_ps(_mm256_load_ps(v + 8 * k), div), _mm256_set1_ps(3.5f));
        const uint32_t w = PackLanes<3>(ClampRoundFromZero(q, _mm256_set1_ps(7.0f)));
        std::memcpy(out + 3 * k, &w, 3);  // little-endian: the low 3 bytes
      }
    }
  }
}

// DecodeK4v3ValueScalar for rows of D = 8 * kN, each row in registers (as far as they go) from
// its codes to its stores.
template <uint8_t kDt, uint32_t kN>
void DecodeK4v3ValueRows(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  constexpr uint32_t D = 8 * kN;
  constexpr size_t code_bytes = 3 * kN;
  const size_t rows = size_t{shape.tokens} * shape.heads;
  const NormRow<kN> norms;
  const FlipRow<kN> flips;
  const std::byte* codes = payload + 2 * rows;
  const size_t code_total = rows * code_bytes;  // groups with 16 bytes left: Unpack3Wide
  for (size_t r = 0; r < rows; ++r) {
    uint16_t scale;
    std::memcpy(&scale, payload + 2 * r, 2);
    const __m256 scale_f = Broadcast<kDt>(scale);
    const std::byte* in = codes + r * code_bytes;
    __m256 v[kN];
    for (uint32_t k = 0; k < kN; ++k) {
      // k4v3::Level: the code minus 3.5.
      const size_t at = r * code_bytes + 3 * k;
      const __m256 c = at + 16 <= code_total ? Unpack3Wide(codes + at) : UnpackLanes<3>(in, 8 * k);
      v[k] = _mm256_sub_ps(c, _mm256_set1_ps(3.5f));
    }
    FwhtRow(v);
    // k4v3::ValueOut: times the step (the scale times the vector's chunk's norm), then the flip.
    // Never NaN: the levels' transform is finite, the step a finite scale times the norm.
    auto output = [&](uint32_t k) {
      const __m256 step = _mm256_mul_ps(scale_f, norms.norm[k]);
      return _mm256_xor_ps(_mm256_mul_ps(v[k], step), flips.bits[k]);
    };
    std::byte* row = out + 2 * r * D;
    if constexpr (kN == 1) {
      Store8<kDt>(row, 0, output(0));
    } else {
      for (uint32_t k = 0; k < kN; k += 2) Store16<kDt>(row, 8 * k, output(k), output(k + 1));
    }
  }
}

// Calls f.template operator()<kN>() for the row length D = 8 * kN (the dims K4v3ValueFits takes).
template <typename F>
void WithRowVectors(uint32_t dim, F&& f) {
  switch (dim / 8) {
    case 1:
      return f.template operator()<1>();
    case 2:
      return f.template operator()<2>();
    case 4:
      return f.template operator()<4>();
    case 6:
      return f.template operator()<6>();
    case 10:
      return f.template operator()<10>();
    case 12:
      return f.template operator()<12>();
    case 14:
      return f.template operator()<14>();
    case 8:
      return f.template operator()<8>();
    case 16:
      return f.template operator()<16>();
    default:
      return f.template operator()<32>();
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

// TurnK4v3Scalar for dims that are multiples of 16 (8 pairs per vector).
template <uint8_t kDt>
void TurnK4v3Impl(const SegmentShape& shape, const float* cos, const float* sin, bool inverse,
                  const std::byte* in, std::byte* out) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim, half = D / 2;
  // The direction's sign on the sines (exact: a sign flip; the table holds no NaN).
  const __m256 sign = _mm256_set1_ps(inverse ? -0.0f : 0.0f);
  const __m256 lo = _mm256_set1_ps(-3.40282347e+38f), hi = _mm256_set1_ps(3.40282347e+38f);
  auto clamp = [&](__m256 x) {  // numeric::ClampQ(x, -FLT_MAX, FLT_MAX): NaN -> 0
    x = _mm256_and_ps(x, _mm256_cmp_ps(x, x, _CMP_ORD_Q));
    return _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  };
  for (uint32_t t = 0; t < T; ++t) {
    const float* sn = sin + size_t{t} * half;
    const float* cs = cos + size_t{t} * half;
    for (uint32_t j = 0; j < half; j += 8) {
      // The angle depends on the token and the pair alone: the same c and s for every head.
      const __m256 c = _mm256_loadu_ps(cs + j);
      const __m256 s = _mm256_xor_ps(_mm256_loadu_ps(sn + j), sign);
      for (uint32_t h = 0; h < H; ++h) {
        const size_t i = (size_t{t} * H + h) * D + j;
        const __m256 x1 = clamp(Load8<kDt>(in, i));
        const __m256 x2 = clamp(Load8<kDt>(in, i + half));
        // k4v3::TurnPairF32 never makes a NaN (its inputs are clamped first).
        Store8<kDt>(out, i, _mm256_add_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
        Store8<kDt>(out, i + half, _mm256_sub_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
      }
    }
  }
}

// numeric::DtypeToFloat(numeric::FloatToDtype(x)) of 8 non-NaN floats: what a dtype store and
// load give back.
template <uint8_t kDt>
inline __m256 RoundToDtype8(__m256 x) {
  if constexpr (kDt == numeric::kDtypeBf16) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    return _mm256_castsi256_ps(
        _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// DecodeK4v3KeyScalar for dims that are multiples of 16 (8 pairs per vector), in one pass: each
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
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 lo = _mm256_set1_ps(-3.40282347e+38f), hi = _mm256_set1_ps(3.40282347e+38f);
  // Element i (parameters at m) as int4's decoder leaves it, then numeric::ClampQ(x, -FLT_MAX,
  // FLT_MAX) as k4v3::TurnPairF32 takes it (never NaN: the scale and minimum are finite).
  auto value = [&](size_t i, size_t m) {
    const __m256 x = _mm256_add_ps(_mm256_mul_ps(UnpackLanes<4>(packed, i), Load8<kDt>(scales, m)),
                                   Load8<kDt>(mins, m));
    return _mm256_min_ps(_mm256_max_ps(RoundToDtype8<kDt>(x), lo), hi);
  };
  for (uint32_t t = 0; t < T; ++t) {
    const size_t mbase = size_t{t / l.group_len} * H * D;
    const float* sn = sin + size_t{t} * half;
    const float* cs = cos + size_t{t} * half;
    for (uint32_t j = 0; j < half; j += 8) {
      const __m256 c = _mm256_loadu_ps(cs + j);
      const __m256 s = _mm256_xor_ps(_mm256_loadu_ps(sn + j), sign);  // back: the negated angle
      for (uint32_t h = 0; h < H; ++h) {
        const size_t i = (size_t{t} * H + h) * D + j, m = mbase + size_t{h} * D + j;
        const __m256 x1 = value(i, m), x2 = value(i + half, m + half);
        Store8<kDt>(out, i, _mm256_add_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
        Store8<kDt>(out, i + half, _mm256_sub_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
      }
    }
  }
}

}  // namespace

// ---------------------------------------------------------------- entry points (dtype dispatch)

void EncodeFp8Avx2(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, EncodeFp8Scalar(shape, in, payload),
                         EncodeFp8Impl<kDt>(shape, in, payload));
}
void DecodeFp8Avx2(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, DecodeFp8Scalar(shape, payload, out),
                         DecodeFp8Impl<kDt>(shape, payload, out));
}
void EncodeInt8Avx2(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, EncodeInt8Scalar(shape, in, payload),
                         EncodeInt8Impl<kDt>(shape, in, payload));
}
void DecodeInt8Avx2(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, DecodeInt8Scalar(shape, payload, out),
                         DecodeInt8Impl<kDt>(shape, payload, out));
}
void EncodeIntNAvx2(const SegmentShape& shape, uint32_t bits, const std::byte* in,
                    std::byte* payload) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, EncodeIntNScalar(shape, bits, in, payload), {
    if (bits == 4) {
      EncodeIntNImpl<kDt, 4>(shape, in, payload);
    } else {
      EncodeIntNImpl<kDt, 2>(shape, in, payload);
    }
  });
}
void DecodeIntNAvx2(const SegmentShape& shape, uint32_t bits, const std::byte* payload,
                    std::byte* out) {
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, DecodeIntNScalar(shape, bits, payload, out), {
    if (bits == 4) {
      DecodeIntNImpl<kDt, 4>(shape, payload, out);
    } else {
      DecodeIntNImpl<kDt, 2>(shape, payload, out);
    }
  });
}

void TurnK4v3Avx2(const SegmentShape& shape, const float* cos, const float* sin, bool inverse,
                  const std::byte* in, std::byte* out) {
  if (shape.dim % 16 != 0) return TurnK4v3Scalar(shape, cos, sin, inverse, in, out);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, TurnK4v3Scalar(shape, cos, sin, inverse, in, out),
                         TurnK4v3Impl<kDt>(shape, cos, sin, inverse, in, out));
}
void DecodeK4v3KeyAvx2(const SegmentShape& shape, const float* cos, const float* sin,
                       const std::byte* payload, std::byte* out) {
  if (shape.dim % 16 != 0) return DecodeK4v3KeyScalar(shape, cos, sin, payload, out);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, DecodeK4v3KeyScalar(shape, cos, sin, payload, out),
                         DecodeK4v3KeyImpl<kDt>(shape, cos, sin, payload, out));
}
void EncodeK4v3ValueAvx2(const SegmentShape& shape, const std::byte* in, std::byte* payload) {
  if (!K4v3ValueFits(shape.dim)) return EncodeK4v3ValueScalar(shape, in, payload);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, EncodeK4v3ValueScalar(shape, in, payload),
                         EncodeK4v3ValueImpl<kDt>(shape, in, payload));
}
void DecodeK4v3ValueAvx2(const SegmentShape& shape, const std::byte* payload, std::byte* out) {
  if (!K4v3ValueFits(shape.dim)) return DecodeK4v3ValueScalar(shape, payload, out);
  PROXIMA_DISPATCH_DTYPE(shape.dtype, kDt, DecodeK4v3ValueScalar(shape, payload, out),
                         DecodeK4v3ValueImpl<kDt>(shape, payload, out));
}

#else  // built without AVX2: CpuHasAvx2() may still say yes, so forward to scalar.

void EncodeFp8Avx2(const SegmentShape& s, const std::byte* in, std::byte* p) {
  EncodeFp8Scalar(s, in, p);
}
void DecodeFp8Avx2(const SegmentShape& s, const std::byte* p, std::byte* out) {
  DecodeFp8Scalar(s, p, out);
}
void EncodeInt8Avx2(const SegmentShape& s, const std::byte* in, std::byte* p) {
  EncodeInt8Scalar(s, in, p);
}
void DecodeInt8Avx2(const SegmentShape& s, const std::byte* p, std::byte* out) {
  DecodeInt8Scalar(s, p, out);
}
void EncodeIntNAvx2(const SegmentShape& s, uint32_t bits, const std::byte* in, std::byte* p) {
  EncodeIntNScalar(s, bits, in, p);
}
void DecodeIntNAvx2(const SegmentShape& s, uint32_t bits, const std::byte* p, std::byte* out) {
  DecodeIntNScalar(s, bits, p, out);
}
void TurnK4v3Avx2(const SegmentShape& s, const float* cos, const float* sin, bool inverse,
                  const std::byte* in, std::byte* out) {
  TurnK4v3Scalar(s, cos, sin, inverse, in, out);
}
void DecodeK4v3KeyAvx2(const SegmentShape& s, const float* cos, const float* sin,
                       const std::byte* p, std::byte* out) {
  DecodeK4v3KeyScalar(s, cos, sin, p, out);
}
void EncodeK4v3ValueAvx2(const SegmentShape& s, const std::byte* in, std::byte* p) {
  EncodeK4v3ValueScalar(s, in, p);
}
void DecodeK4v3ValueAvx2(const SegmentShape& s, const std::byte* p, std::byte* out) {
  DecodeK4v3ValueScalar(s, p, out);
}

#endif

}  // namespace proxima::codec::internal
