// The arithmetic of the k4v3 codec (docs/format.md: k4v3), written once for host and device: the
// CPU codec (kernels/internal/segment_codecs.cc) and the CUDA kernels
// (kernels/codec_kernels.cuh) call these same functions, and kernels/vec_codec_test.cc runs the
// kernels' per-item functions on the CPU against the CPU codec's bytes.
//
// K: every pair (j, j + D/2) of a (token t, head) vector turns by -t * w_j into the block's RoPE
// frame (w_j = omega0 * ratio^j as a running product), and back by +t * w_j; the turned values
// are int4's input (encode) or output (decode). V: each (token, head) vector is sign-flipped,
// Hadamard-transformed, normalised by 1/sqrt(D), and quantised to 3-bit codes with one dtype
// scale; decoding runs the same transform on the levels (code - 3.5) and scales last.
// Thread-safety: pure functions of their arguments; an item function writes only its own pair
// or row.
#ifndef PROXIMA_KERNELS_INTERNAL_K4V3_MATH_H_
#define PROXIMA_KERNELS_INTERNAL_K4V3_MATH_H_

#include <cstdint>

#include "kernels/internal/numeric.h"
#include "kernels/internal/segment_job.h"
#include "kernels/internal/vec_codec.h"

namespace proxima::codec::k4v3 {

namespace nm = ::proxima::codec::numeric;
using internal::SegmentJob;

// The largest head_dim the V kernel takes (a team's lanes hold at most kMaxPerLane elements each,
// in registers); the CUDA host wrapper leaves larger ones to the CPU codec.
constexpr uint32_t kMaxRowDim = 256;

// Frequency of pair j: omega0 * ratio^j as the running product w_0 = omega0, w_j = w_(j-1) * ratio.
PXK_HD float Omega(float omega0, float ratio, uint32_t j) {
  float w = omega0;
  for (uint32_t k = 0; k < j; ++k) w = PXK_MUL(w, ratio);
  return w;
}

// The angle of token t's pair j: t * w_j, one rounding.
PXK_HD float Angle(uint32_t t, float w) { return PXK_MUL(static_cast<float>(t), w); }

// Turns the pair (x1, x2) by the angle whose cosine is c and whose sine is s (s already carries
// the direction's sign). Inputs are clamped first (NaN -> 0, +-Inf -> +-FLT_MAX), so both products
// are finite and the results are numbers or +-Inf, never NaN.
PXK_HD void TurnPairF32(float x1, float x2, float c, float s, float* y1, float* y2) {
  constexpr float kFltMax = 3.40282347e+38f;
  x1 = nm::ClampQ(x1, -kFltMax, kFltMax);
  x2 = nm::ClampQ(x2, -kFltMax, kFltMax);
  *y1 = PXK_ADD(PXK_MUL(x1, c), PXK_MUL(x2, s));
  *y2 = PXK_SUB(PXK_MUL(x2, c), PXK_MUL(x1, s));
}

// The sign V's element d is multiplied by before the transform: +-1.
PXK_HD float Flip(uint32_t d) { return ((d * 0x9E3779B1u) >> 31) != 0 ? -1.0f : 1.0f; }

// Unnormalised fast Walsh-Hadamard transform of n (a power of two) floats, in this order: for
// len = 1, 2, 4, .., (a, b) -> (a + b, a - b) over the halves of each block of 2 * len. The first
// two stages run in registers per 4 elements, the others as loops over two disjoint halves (which
// a CPU compiler vectorises); each element sees the same operations either way.
PXK_HD void Fwht(float* u, uint32_t n) {
  uint32_t len = 1;
  if (n >= 4) {
    for (uint32_t i = 0; i < n; i += 4) {
      const float s0 = PXK_ADD(u[i], u[i + 1]), d0 = PXK_SUB(u[i], u[i + 1]);
      const float s1 = PXK_ADD(u[i + 2], u[i + 3]), d1 = PXK_SUB(u[i + 2], u[i + 3]);
      u[i] = PXK_ADD(s0, s1);
      u[i + 1] = PXK_ADD(d0, d1);
      u[i + 2] = PXK_SUB(s0, s1);
      u[i + 3] = PXK_SUB(d0, d1);
    }
    len = 4;
  }
  for (; len < n; len <<= 1) {
    for (uint32_t i = 0; i < n; i += 2 * len) {
      float* __restrict a = u + i;
      float* __restrict b = u + i + len;
      for (uint32_t k = 0; k < len; ++k) {
        const float x = a[k], y = b[k];
        a[k] = PXK_ADD(x, y);
        b[k] = PXK_SUB(x, y);
      }
    }
  }
}

// V's transform runs on the chunks of a row's binary decomposition, largest first: D = 96 is
// [0, 64) and [64, 96), D = 100 is 64, 32 and 4; a power of two is one chunk, the whole row.
// The length of the chunk that starts at `offset` (the largest power of two <= D - offset).
PXK_HD uint32_t ChunkAt(uint32_t D, uint32_t offset) {
  const uint32_t rest = D - offset;
  uint32_t len = 1;
  while (len <= rest / 2) len <<= 1;
  return len;
}

// V encode, element d's input to the transform: the value (non-finite -> 0), sign-flipped.
template <uint8_t kDt>
PXK_HD float ValueIn(uint16_t v, uint32_t d) {
  const float x = nm::DtypeToFloat(kDt, v);
  return PXK_MUL(nm::IsFiniteFloat(x) ? x : 0.0f, Flip(d));  // exact: a sign flip
}

// V encode, element step after the transform: normalises *u and returns the bits of |*u| when it
// is finite, else 0. For non-negative floats the integer order of the bits is the float order, so
// a row's largest finite |u| is the integer maximum of these (which vectorises on every CPU).
PXK_HD int32_t NormaliseAbsBits(float* u, float norm) {
  *u = PXK_MUL(*u, norm);
  const int32_t a = static_cast<int32_t>(nm::FloatBits(*u) & 0x7FFFFFFFu);
  return a < 0x7F800000 ? a : 0;
}

// V encode: a row's scale is its largest finite |u| divided by this (then rounded up to the
// dtype). The outermost levels stand for +-3.5 scales, so with 4 rather than 3.5 a row's largest
// values (those beyond 3.5 of the 4 scales) clip to them, and every step is 7/8 as wide: on
// SmolLM2's real KV, V's relative L2 error 0.204 -> 0.183 and the model's KL 8.13e-3 -> 7.81e-3
// (docs/quality.md, "k4v3's V scale"); a wider clip (4.5) lowered the L2 error further but raised
// the KL. Encoder-only: the format stores each row's scale, and decoders read either rule's
// blocks alike.
constexpr float kScaleDivisor = 4.0f;

// V encode: a row's dtype scale from the largest NormaliseAbsBits of its elements; `divisor`
// receives what the codes divide by (1 when the scale is 0).
template <uint8_t kDt>
PXK_HD uint16_t ScaleFromMaxBits(int32_t amax_bits, float* divisor) {
  const float amax = nm::BitsFloat(static_cast<uint32_t>(amax_bits));
  const uint16_t scale = nm::RoundUpDtype(kDt, PXK_DIV(amax, kScaleDivisor));
  const float f = nm::DtypeToFloat(kDt, scale);
  *divisor = f == 0.0f ? 1.0f : f;
  return scale;
}

// The 3-bit code of a normalised element.
PXK_HD uint8_t Code(float u, float divisor) {
  // Through int32 (0..7 either way): float -> int32 conversions vectorise, float -> uint8 not.
  return static_cast<uint8_t>(static_cast<int32_t>(
      nm::RoundNearestEven(nm::ClampQ(PXK_ADD(PXK_DIV(u, divisor), 3.5f), 0.0f, 7.0f))));
}

// V decode: the level a code stands for (exact: halves).
PXK_HD float Level(uint8_t code) { return PXK_SUB(static_cast<float>(code), 3.5f); }
// V decode: element d of a transformed row of levels, given step = scale * norm. The scale comes
// last, so a huge scale gives +-Inf, never Inf - Inf = NaN.
template <uint8_t kDt>
PXK_HD uint16_t ValueOut(float u, float step, uint32_t d) {
  return nm::FloatToDtype(kDt, PXK_MUL(PXK_MUL(u, step), Flip(d)));
}

// Eight 3-bit codes in three bytes, LSB first (the order docs/format.md's bit packing gives).
PXK_HD void Pack8(const uint8_t* codes, uint8_t* p) {
  uint32_t w = 0;
  for (uint32_t k = 0; k < 8; ++k) w |= uint32_t{codes[k]} << (3 * k);
  p[0] = static_cast<uint8_t>(w);
  p[1] = static_cast<uint8_t>(w >> 8);
  p[2] = static_cast<uint8_t>(w >> 16);
}
PXK_HD void Unpack8(const uint8_t* p, uint8_t* codes) {
  const uint32_t w = uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16;
  for (uint32_t k = 0; k < 8; ++k) codes[k] = static_cast<uint8_t>((w >> (3 * k)) & 7u);
}

// ---- Items of the CUDA kernels. Jobs (internal::MakeK4v3Jobs): a K job has `raw` (the
// segment's values), `turned` (the values in the block's frame), omega0 and ratio; a V job has
// `raw`, `payload` and hadamard_norm, and a dim that is a power of two from 8 to kMaxRowDim.

// Writes a K job's payload header (omega0, ratio).
PXK_HD void WriteKHeader(const SegmentJob& j) {
  vec::StoreLe(j.payload, nm::FloatBits(j.omega0), 4);
  vec::StoreLe(j.payload + 4, nm::FloatBits(j.ratio), 4);
}

// Pair p of token t of a K job, in every head (the angle depends on t and p alone, so it is
// computed once for all heads): q = t * (dim / 2) + p < tokens * dim / 2. `inverse` false turns
// raw into turned (encode), true turned into raw (decode). Neighbouring q touch neighbouring
// elements of a row, so a warp's loads and stores are contiguous.
template <uint8_t kDt>
PXK_HD void TurnPairs(const SegmentJob& j, uint64_t q, bool inverse) {
  const uint32_t half = j.dim / 2;
  const uint32_t t = static_cast<uint32_t>(q / half);
  const uint32_t p = static_cast<uint32_t>(q % half);
  float s, c;
  nm::SinCosF32(Angle(t, Omega(j.omega0, j.ratio, p)), &s, &c);
  if (inverse) s = -s;
  const uint16_t* in = inverse ? j.turned : j.raw;
  uint16_t* out = inverse ? j.raw : j.turned;
  for (uint32_t h = 0; h < j.heads; ++h) {
    const uint64_t i = (uint64_t{t} * j.heads + h) * j.dim + p;
    float y1, y2;
    TurnPairF32(nm::DtypeToFloat(kDt, in[i]), nm::DtypeToFloat(kDt, in[i + half]), c, s, &y1, &y2);
    out[i] = nm::FloatToDtype(kDt, y1);
    out[i + half] = nm::FloatToDtype(kDt, y2);
  }
}

// ---- V rows by teams of lanes. A row (a (token, head) vector of D elements) is coded by a team
// of T = TeamSize(D) lanes of one warp; lane l holds elements d = l + T * k for k < D / T (at most
// kMaxPerLane), so the team's loads and stores of each k are contiguous. The transform is Fwht's
// butterfly network stage by stage: the stages of len < T pair lane l with lane l ^ len
// (exchanged between lanes: TeamStage), those of len >= T pair a lane's own elements
// (LaneStages). Every element sees the operations Fwht gives it, so the bytes are the CPU
// codec's. The kernels exchange with warp shuffles; kernels/vec_codec_test.cc runs the same
// functions over arrays of lanes.

constexpr uint32_t kMaxPerLane = kMaxRowDim / 32;

PXK_HD constexpr uint32_t TeamSize(uint32_t D) { return D < 32 ? D : 32; }

// Lane `lane`'s element k, and its element index in the row.
PXK_HD uint32_t LaneElement(uint32_t lane, uint32_t T, uint32_t k) { return lane + T * k; }

// Stage `len` < T of the transform for one value: `mine` is this lane's, `theirs` that of lane
// lane ^ len; the lower lane of the pair keeps the sum, the upper the difference.
PXK_HD float TeamStage(float mine, float theirs, uint32_t lane, uint32_t len) {
  return (lane & len) == 0 ? PXK_ADD(mine, theirs) : PXK_SUB(theirs, mine);
}

// The stages of len = T * m (m = 1, 2, 4, .. < per_lane) over one lane's elements, in order.
PXK_HD void LaneStages(float* u, uint32_t per_lane) {
  PXK_UNROLL
  for (uint32_t m = 1; m < kMaxPerLane; m <<= 1) {
    if (m >= per_lane) break;
    PXK_UNROLL
    for (uint32_t k = 0; k < kMaxPerLane; ++k) {
      if (k < per_lane && (k & m) == 0) {
        const float x = u[k], y = u[k | m];
        u[k] = PXK_ADD(x, y);
        u[k | m] = PXK_SUB(x, y);
      }
    }
  }
}

// The functions below take the team's shape (T lanes of per_lane elements: the row is T *
// per_lane = j.dim long) as arguments, so that a kernel specialised for one head_dim passes
// constants and its loops unroll without guards.

// V encode, before the transform: the lane's inputs (ValueIn) of row r.
template <uint8_t kDt>
PXK_HD void LoadValueLane(const SegmentJob& j, uint64_t r, uint32_t lane, uint32_t T,
                          uint32_t per_lane, float* u) {
  const uint16_t* in = j.raw + r * (T * per_lane);
  PXK_UNROLL
  for (uint32_t k = 0; k < kMaxPerLane; ++k) {
    if (k < per_lane) u[k] = ValueIn<kDt>(in[LaneElement(lane, T, k)], LaneElement(lane, T, k));
  }
}

// V encode, after the transform: normalises the lane's elements and returns the largest of their
// NormaliseAbsBits (the team's maximum of these is RowScale's).
PXK_HD int32_t LaneAbsBits(float* u, uint32_t per_lane, float norm) {
  int32_t amax_bits = 0;
  PXK_UNROLL
  for (uint32_t k = 0; k < kMaxPerLane; ++k) {
    if (k < per_lane) {
      const int32_t a = NormaliseAbsBits(&u[k], norm);
      amax_bits = a > amax_bits ? a : amax_bits;
    }
  }
  return amax_bits;
}

// V encode: element k's code, placed where Pack8 puts it in its group of eight's 24-bit word; the
// OR of the eight lanes lane & ~7 .. lane | 7 is the word (T is a multiple of 8).
PXK_HD uint32_t LaneCodeBits(float u, float divisor, uint32_t lane) {
  return uint32_t{Code(u, divisor)} << (3 * (lane % 8));
}

// V encode: row r's scale, and the word of the group of eight that starts at element d.
PXK_HD void StoreRowScale(const SegmentJob& j, uint64_t r, uint16_t scale) {
  vec::St16(j.payload, r, scale);
}
PXK_HD void StoreCodeWord(const SegmentJob& j, uint64_t r, uint32_t D, uint32_t d, uint32_t w) {
  const uint64_t rows = uint64_t{j.tokens} * j.heads;
  uint8_t* p = j.payload + 2 * rows + r * (3 * D / 8) + 3 * (d / 8);
  p[0] = static_cast<uint8_t>(w);
  p[1] = static_cast<uint8_t>(w >> 8);
  p[2] = static_cast<uint8_t>(w >> 16);
}

// V decode, before the transform: the levels of the lane's codes in row r.
PXK_HD void LoadLevelsLane(const SegmentJob& j, uint64_t r, uint32_t lane, uint32_t T,
                           uint32_t per_lane, float* u) {
  const uint64_t rows = uint64_t{j.tokens} * j.heads;
  const uint8_t* codes = j.payload + 2 * rows + r * (3 * (T * per_lane) / 8);
  PXK_UNROLL
  for (uint32_t k = 0; k < kMaxPerLane; ++k) {
    if (k < per_lane) {
      const uint32_t d = LaneElement(lane, T, k);
      const uint8_t* p = codes + 3 * (d / 8);
      const uint32_t w = uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16;
      u[k] = Level(static_cast<uint8_t>((w >> (3 * (d % 8))) & 7u));
    }
  }
}

// V decode, after the transform: the lane's values of row r (ValueOut).
template <uint8_t kDt>
PXK_HD void StoreValueLane(const SegmentJob& j, uint64_t r, uint32_t lane, uint32_t T,
                           uint32_t per_lane, const float* u) {
  const float step = PXK_MUL(nm::DtypeToFloat(kDt, vec::Ld16(j.payload, r)), j.hadamard_norm);
  uint16_t* out = j.raw + r * (T * per_lane);
  PXK_UNROLL
  for (uint32_t k = 0; k < kMaxPerLane; ++k) {
    if (k < per_lane) {
      const uint32_t d = LaneElement(lane, T, k);
      out[d] = ValueOut<kDt>(u[k], step, d);
    }
  }
}

}  // namespace proxima::codec::k4v3

#endif  // PROXIMA_KERNELS_INTERNAL_K4V3_MATH_H_
