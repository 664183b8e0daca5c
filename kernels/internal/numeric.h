// Scalar arithmetic of the STAR-KV format (docs/format.md section 2), shared verbatim by the CPU
// reference and the CUDA kernels so that both round exactly alike: dtype <-> float conversions,
// e4m3 conversions, clamping and rounding. Every function is pure and thread-safe.
//
// Rules that keep backends bit-identical: one IEEE rounding per operation (no FMA contraction:
// the CPU build uses -ffp-contract=off, CUDA code uses the explicit __f*_rn intrinsics through
// the PXK_MUL/PXK_ADD/PXK_DIV macros), round-to-nearest-even everywhere, no flush-to-zero.
#ifndef PROXIMA_KERNELS_INTERNAL_NUMERIC_H_
#define PROXIMA_KERNELS_INTERNAL_NUMERIC_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PXK_HD __host__ __device__ __forceinline__
#else
#define PXK_HD inline
#endif
// Full unrolling of a loop with a constant trip count in device code (its array indices become
// registers); nothing on the host, whose compilers decide for themselves.
#if defined(__CUDA_ARCH__)
#define PXK_UNROLL _Pragma("unroll")
#else
#define PXK_UNROLL
#endif

namespace proxima::codec::numeric {

#if defined(__CUDA_ARCH__)
#define PXK_MUL(a, b) __fmul_rn((a), (b))
#define PXK_ADD(a, b) __fadd_rn((a), (b))
#define PXK_SUB(a, b) __fsub_rn((a), (b))
#define PXK_DIV(a, b) __fdiv_rn((a), (b))
#else
#define PXK_MUL(a, b) ((a) * (b))
#define PXK_ADD(a, b) ((a) + (b))
#define PXK_SUB(a, b) ((a) - (b))
#define PXK_DIV(a, b) ((a) / (b))
#endif

// dtype codes as stored in the header (values of proxima::codec::DType).
inline constexpr uint8_t kDtypeFp16 = 1;
inline constexpr uint8_t kDtypeBf16 = 2;

PXK_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

PXK_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

PXK_HD float Bf16ToFloat(uint16_t v) { return BitsFloat(static_cast<uint32_t>(v) << 16); }

PXK_HD uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  const uint32_t nan = (u >> 16) | 0x0040u;  // NaN: quiet, payload truncated
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded >> 16);
}

PXK_HD float Fp16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) {  // Inf, or NaN made quiet as F16C vcvtph2ps does
    return BitsFloat(sign | 0x7F800000u | (man << 13) | (man != 0 ? 0x400000u : 0u));
  }
  if (exp != 0) return BitsFloat(sign | ((exp + 112u) << 23) | (man << 13));
  // Subnormal: man * 2^-24, exact in float.
  float mag = PXK_MUL(static_cast<float>(man), 5.9604644775390625e-8f);
  return sign ? -mag : mag;
}

// Matches F16C vcvtps2ph with round-to-nearest-even (imm 0), including NaN payloads.
PXK_HD uint16_t FloatToFp16(float f) {
  uint32_t u = FloatBits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u)
    return static_cast<uint16_t>(sign | 0x7C00u | 0x0200u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: Inf
  if (a >= 0x38800000u) {                                              // normal half (>= 2^-14)
    uint32_t r = a + 0x0FFFu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
  }
  if (a < 0x33000000u) return sign;  // below half of the smallest subnormal (2^-25): zero
  // Subnormal half: shift the 24-bit significand right so the result is in units of 2^-24.
  uint32_t exp = a >> 23;  // 102..112
  uint32_t man = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t shift = 126u - exp;  // 14..24
  uint32_t q = man >> shift;
  uint32_t rem = man & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

PXK_HD float DtypeToFloat(uint8_t dtype, uint16_t v) {
  return dtype == kDtypeBf16 ? Bf16ToFloat(v) : Fp16ToFloat(v);
}
PXK_HD uint16_t FloatToDtype(uint8_t dtype, float f) {
  return dtype == kDtypeBf16 ? FloatToBf16(f) : FloatToFp16(f);
}

PXK_HD bool IsFiniteFloat(float f) { return (FloatBits(f) & 0x7F800000u) != 0x7F800000u; }

PXK_HD uint16_t DtypeMaxFinite(uint8_t dtype) { return dtype == kDtypeBf16 ? 0x7F7F : 0x7BFF; }

// Rounds a non-negative float to the dtype, never below x (one ulp up when rounding went down).
// Non-finite or overflowing results become the dtype's largest finite value.
PXK_HD uint16_t RoundUpDtype(uint8_t dtype, float x) {
  if (!IsFiniteFloat(x)) return DtypeMaxFinite(dtype);
  if (x <= 0.0f) return 0;
  uint16_t v = FloatToDtype(dtype, x);
  if ((v & 0x7FFFu) >= (dtype == kDtypeBf16 ? 0x7F80u : 0x7C00u)) return DtypeMaxFinite(dtype);
  if (DtypeToFloat(dtype, v) < x) {
    ++v;  // positive values: the next bit pattern is the next representable value
    if ((v & 0x7FFFu) >= (dtype == kDtypeBf16 ? 0x7F80u : 0x7C00u)) return DtypeMaxFinite(dtype);
  }
  return v;
}

// Rounds to an integer, ties to even. On the host: for |x| < 2^23, adding and then subtracting
// 2^23 leaves the nearest integer, ties to even (the default rounding mode, which the codec
// assumes everywhere; the build forbids reassociation); larger values, Inf and NaN are integral
// or pass through; the sign is put back so -0.3 gives -0 as nearbyint does. Inline and
// vectorisable on every CPU, where std::nearbyint is a libm call on baseline x86-64.
PXK_HD float RoundNearestEven(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  const uint32_t bits = FloatBits(x), abs_bits = bits & 0x7FFFFFFFu;
  const uint32_t r =
      FloatBits((BitsFloat(abs_bits) + 8388608.0f) - 8388608.0f) | (bits & 0x80000000u);
  // |x| < 2^23 (NaN's bits compare above): an integer select, so loops over it vectorise.
  const uint32_t small = 0u - static_cast<uint32_t>(abs_bits < 0x4B000000u);
  return BitsFloat((r & small) | (bits & ~small));
#endif
}

// NaN -> 0, then clamp to [lo, hi].
PXK_HD float ClampQ(float v, float lo, float hi) {
  v = v == v ? v : 0.0f;  // selects, not branches: loops over it vectorise
  v = v < lo ? lo : v;
  return v > hi ? hi : v;
}

// e4m3fn code -> float. 0x7F/0xFF decode as +-480 (docs/format.md: fp8).
PXK_HD float E4m3ToFloat(uint8_t c) {
  uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  uint32_t exp = (c >> 3) & 0xFu;
  uint32_t man = c & 0x7u;
  if (exp == 0) {
    float mag = PXK_MUL(static_cast<float>(man), 0.001953125f);  // man * 2^-9
    return BitsFloat(FloatBits(mag) | sign);
  }
  return BitsFloat(sign | ((exp + 120u) << 23) | (man << 20));
}

// ClampQ(v, -448.0f, 448.0f) computed on the bits, the same float for every v (NaN -> +0,
// |v| > 448 -> +-448 with v's sign, -0 stays -0): integer selects, so loops over it vectorise
// where the compiler turns the float compares of ClampQ into branches.
PXK_HD float ClampE4m3(float v) {
  const uint32_t u = FloatBits(v), abs_bits = u & 0x7FFFFFFFu;
  const uint32_t a = abs_bits < 0x43E00000u ? abs_bits : 0x43E00000u;  // 448
  const uint32_t keep = 0u - static_cast<uint32_t>(abs_bits <= 0x7F800000u);
  return BitsFloat((a | (u & 0x80000000u)) & keep);
}

// float (already clamped to [-448, 448], not NaN) -> e4m3fn, round to nearest even. Below 2^-6
// the value is on the subnormal grid of 2^-9 (codes 0..8; 8 is 2^-6): round(|y| * 512); above,
// the float's exponent and top 3 mantissa bits rounded to nearest even. Both are computed and
// one is picked with a mask (no branch, so loops over it vectorise).
PXK_HD uint8_t FloatToE4m3(float y) {
  const uint32_t u = FloatBits(y);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t sub =
      static_cast<uint32_t>(static_cast<int32_t>(RoundNearestEven(PXK_MUL(BitsFloat(a), 512.0f))));
  const uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
  const uint32_t normal = (((r >> 23) - 120u) << 3) | ((r >> 20) & 0x7u);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < 0x3C800000u);
  return static_cast<uint8_t>(sign | (sub & is_sub) | (normal & ~is_sub));
}

// sin and cos of 0 <= x <= 2^20 from binary32 multiplies and adds alone (no libm, whose results
// differ between C libraries and CUDA), so every backend rotates by the same bits
// (docs/format.md: k4v3). Cody-Waite reduction by pi/2 (three-part constant), then the minimax
// polynomials of Cephes' sinf/cosf on [-pi/4, pi/4]. Error below 1e-6 for x < 2^16; above, the
// reduction loses bits but stays deterministic, which is all the codec needs (it undoes its own
// rotation with the same numbers).
PXK_HD void SinCosF32(float x, float* sin_out, float* cos_out) {
  const float k = RoundNearestEven(PXK_MUL(x, 0.636619772f));  // 2/pi
  float r = PXK_SUB(x, PXK_MUL(k, 1.5703125f));
  r = PXK_SUB(r, PXK_MUL(k, 4.837512969970703125e-4f));
  r = PXK_SUB(r, PXK_MUL(k, 7.54978995489188216e-8f));
  const float r2 = PXK_MUL(r, r);
  float ps = PXK_ADD(8.3321608736e-3f, PXK_MUL(r2, -1.9515295891e-4f));
  ps = PXK_ADD(-1.6666654611e-1f, PXK_MUL(r2, ps));
  const float sr = PXK_ADD(r, PXK_MUL(PXK_MUL(r, r2), ps));
  float pc = PXK_ADD(-1.388731625493765e-3f, PXK_MUL(r2, 2.443315711809948e-5f));
  pc = PXK_ADD(4.166664568298827e-2f, PXK_MUL(r2, pc));
  const float cr = PXK_ADD(PXK_SUB(1.0f, PXK_MUL(0.5f, r2)), PXK_MUL(PXK_MUL(r2, r2), pc));
  const uint32_t q = static_cast<uint32_t>(k) & 3u;
  const float s = (q & 1u) ? cr : sr;
  const float c = (q & 1u) ? sr : cr;
  *sin_out = (q & 2u) ? -s : s;
  *cos_out = ((q + 1u) & 2u) ? -c : c;
}

}  // namespace proxima::codec::numeric

#endif  // PROXIMA_KERNELS_INTERNAL_NUMERIC_H_
