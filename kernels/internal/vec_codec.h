// The STAR-KV codecs eight elements at a time: the arithmetic of the CUDA fast path
// (kernels/codec_kernels.cuh), written once for host and device so that the CPU unit tests
// (kernels/vec_codec_test.cc) check it against the scalar reference without a GPU.
//
// A "vec" is 8 consecutive elements [8v, 8v + 8) of a segment in its natural [token][head][dim]
// order. The fast path applies to segments whose dim is a multiple of 8 (every real model's),
// so a vec never straddles a (token, head) row, its sign and index bits start on a byte boundary,
// and an int4/int2 value group (a multiple of 8 channels) never splits it. Payload fields sit at
// arbitrary byte offsets: loads take the wide path only when the address is aligned.
// Every pointer comes from a SegmentJob whose sizes and metadata the host validated.
// Thread-safety: pure functions of their arguments.
#ifndef PROXIMA_KERNELS_INTERNAL_VEC_CODEC_H_
#define PROXIMA_KERNELS_INTERNAL_VEC_CODEC_H_

#include <cstdint>
#include <cstring>

#include "kernels/internal/numeric.h"
#include "kernels/internal/segment_job.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace proxima::codec::vec {

namespace nm = ::proxima::codec::numeric;
using internal::SegmentJob;

// Codec ids (CodecId values, docs/format.md section 1).
constexpr uint8_t kRaw = 0, kFp8 = 2, kInt8 = 3, kInt4 = 4, kInt2 = 5, kStar = 6;

// Little-endian loads and stores of `n` <= 8 bytes at any address. Loads are bytewise on the
// device: LoadLe8 below takes the wide paths for 8-byte fields.
PXK_HD uint64_t LoadLe(const uint8_t* p, uint32_t n) {
#if defined(__CUDA_ARCH__)
  uint64_t v = 0;
  for (uint32_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(p[k]) << (8 * k);
  return v;
#else
  uint64_t v = 0;
  std::memcpy(&v, p, n);  // the host is little-endian (x86-64, aarch64)
  return v;
#endif
}
PXK_HD void StoreLe(uint8_t* p, uint64_t v, uint32_t n) {
#if defined(__CUDA_ARCH__)
  // The widest stores the address allows (n is 2, 4 or 8 on the fast path; bytes otherwise).
  const uint32_t a = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p));
  if (n == 8 && (a & 7u) == 0) {
    *reinterpret_cast<uint64_t*>(p) = v;
  } else if (n % 4 == 0 && (a & 3u) == 0) {
    for (uint32_t k = 0; k < n / 4; ++k) {
      reinterpret_cast<uint32_t*>(p)[k] = static_cast<uint32_t>(v >> (32 * k));
    }
  } else if (n % 2 == 0 && (a & 1u) == 0) {
    for (uint32_t k = 0; k < n / 2; ++k) {
      reinterpret_cast<uint16_t*>(p)[k] = static_cast<uint16_t>(v >> (16 * k));
    }
  } else {
    for (uint32_t k = 0; k < n; ++k) p[k] = static_cast<uint8_t>(v >> (8 * k));
  }
#else
  std::memcpy(p, &v, n);
#endif
}
PXK_HD uint16_t Ld16(const uint8_t* p, uint64_t i) {
  return static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
}
PXK_HD void St16(uint8_t* p, uint64_t i, uint16_t v) {
  p[2 * i] = static_cast<uint8_t>(v);
  p[2 * i + 1] = static_cast<uint8_t>(v >> 8);
}
PXK_HD float LdF32(const uint8_t* p, uint64_t i) {
  return nm::BitsFloat(static_cast<uint32_t>(LoadLe(p + 4 * i, 4)));
}
// Eight bytes at p, inside a payload ending at `end`. On the device an unaligned p takes the two
// aligned 8-byte words around it when both lie before `end` (they start at most 7 bytes before
// p, still inside the block: the payload follows its header), instead of eight byte loads.
PXK_HD uint64_t LoadLe8(const uint8_t* p, const uint8_t* end) {
#if defined(__CUDA_ARCH__)
  const uint32_t off = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) & 7u);
  if (off == 0) return *reinterpret_cast<const uint64_t*>(p);
  if (end - p >= 16) {
    const uint64_t* w = reinterpret_cast<const uint64_t*>(p - off);
    return (w[0] >> (8 * off)) | (w[1] << (64 - 8 * off));
  }
#else
  (void)end;
#endif
  return LoadLe(p, 8);
}
// Eight 16-bit values at p (any alignment), inside a payload ending at `end`.
PXK_HD void Load8x16(const uint8_t* p, const uint8_t* end, uint16_t out[8]) {
  const uint64_t lo = LoadLe8(p, end), hi = LoadLe8(p + 8, end);
  for (int k = 0; k < 4; ++k) {
    out[k] = static_cast<uint16_t>(lo >> (16 * k));
    out[4 + k] = static_cast<uint16_t>(hi >> (16 * k));
  }
}

// The fields of one head of a star segment (docs/format.md: star), and the important-token slot
// of token t (-1: clustered), shared by both decode paths.
struct StarHead {
  const uint8_t *cscale, *cq, *imp_idx, *iscale, *iq, *idx, *rscale, *rsign;
};
PXK_HD StarHead StarHeadAt(const SegmentJob& j, uint64_t h) {
  const uint64_t C = j.centroids, M = j.important, T = j.tokens, D = j.dim;
  StarHead s;
  s.cscale = j.payload + h * j.star_head_bytes;
  s.cq = s.cscale + 2 * C;
  s.imp_idx = s.cq + C * D;
  s.iscale = s.imp_idx + 2 * M;
  s.iq = s.iscale + 2 * M;
  s.idx = s.iq + M * D;
  s.rscale = s.idx + (T * j.index_bits + 7) / 8;
  s.rsign = s.rscale + 2 * T;
  return s;
}
PXK_HD int64_t StarImportantSlot(const SegmentJob& j, const StarHead& s, uint64_t t) {
  int64_t found = -1;
  for (uint64_t m = 0; m < j.important; ++m) {
    if (Ld16(s.imp_idx, m) == t) found = static_cast<int64_t>(m);  // the last match wins
  }
  return found;
}

// ---- exact shortcuts of the scalar conversions, for the decoders' inner loops. Each gives the
// scalar function's result bit for bit on the inputs named; the CPU tests run them too.

// e4m3fn code -> float, as nm::E4m3ToFloat: the code's exponent and mantissa placed under a
// float's (bits 20..26) read as a float of exponent e - 127, then scaled by 2^120 (exact: a power
// of two, no overflow) gives 2^(e-7) * 1.m for e > 0 and, through the float subnormal, m * 2^-9
// for e == 0; 0x7F is 480 like the reference's.
PXK_HD float E4m3ToFloatFast(uint32_t code) {
  const float mag = PXK_MUL(nm::BitsFloat((code & 0x7Fu) << 20), 1.329227995784916e36f);  // 2^120
  return nm::BitsFloat(nm::FloatBits(mag) | ((code & 0x80u) << 24));
}
// v (< 2^23) as a float, exactly: v's bits under the exponent of 2^23, minus 2^23.
PXK_HD float SmallUintToFloat(uint32_t v) {
  return PXK_SUB(nm::BitsFloat(0x4B000000u | v), 8388608.0f);
}
// The int8 code in byte 0 of `b` as a float, exactly (biased by 128 into SmallUintToFloat).
PXK_HD float Int8CodeToFloat(uint32_t b) {
  return PXK_SUB(nm::BitsFloat(0x4B000000u | ((b & 0xFFu) ^ 0x80u)), 8388736.0f);
}
// dtype value -> float. On the device fp16 takes the conversion instruction, exact for every
// non-NaN value (the callers' inputs are validated finite metadata or encode inputs whose NaNs
// only ever meet FiniteAbs or ClampQ, which map every NaN alike).
template <uint8_t kDt>
PXK_HD float ToFloat(uint16_t v) {
#if defined(__CUDA_ARCH__)
  if constexpr (kDt == nm::kDtypeFp16) return __half2float(__ushort_as_half(v));
#endif
  return nm::DtypeToFloat(kDt, v);
}
// Two floats as two dtype values (low half: `a`), rounded to nearest even: on the device one
// conversion instruction, identical to FloatToDtype for every input but NaN. The decoders never
// make a NaN: codes decode finite, and the host validated every scale and minimum finite, so a
// product or sum is finite or infinite.
template <uint8_t kDt>
PXK_HD uint32_t PackPair(float a, float b) {
#if defined(__CUDA_ARCH__)
  if constexpr (kDt == nm::kDtypeBf16) {
    const __nv_bfloat162 r = __float22bfloat162_rn(make_float2(a, b));
    return *reinterpret_cast<const uint32_t*>(&r);
  } else {
    const __half2 r = __float22half2_rn(make_float2(a, b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
#else
  return nm::FloatToDtype(kDt, a) | (uint32_t{nm::FloatToDtype(kDt, b)} << 16);
#endif
}
// Eight floats as a vec's four dtype pairs.
template <uint8_t kDt>
PXK_HD void PackVec(const float f[8], uint32_t out[4]) {
  for (int k = 0; k < 4; ++k) out[k] = PackPair<kDt>(f[2 * k], f[2 * k + 1]);
}

// n / d for the divisor `f` was made for (internal::MakeFastDiv).
PXK_HD uint32_t Div(uint32_t n, const internal::FastDiv& f) {
#if defined(__CUDA_ARCH__)
  const uint32_t t = __umulhi(n, f.mul);
#else
  const uint32_t t = static_cast<uint32_t>((uint64_t{n} * f.mul) >> 32);
#endif
  return (t + ((n - t) >> f.shift1)) >> f.shift2;
}

// Where vec `v` sits: element index, (token, head) row, and coordinates.
struct VecPos {
  uint32_t i0, row, t, h, d0;
};
PXK_HD VecPos Locate(const SegmentJob& j, uint32_t v) {
  VecPos p;
  p.i0 = 8 * v;
  p.row = Div(p.i0, j.by_dim);
  p.d0 = p.i0 - p.row * j.dim;
  p.t = Div(p.row, j.by_heads);
  p.h = p.row - p.t * j.heads;
  return p;
}

// Decodes vec `v` of a validated segment of codec kCodec (== j.codec) into out[0..4), element
// 2k in the low half of out[k] (dtype bit patterns); bit-identical to the scalar decoder
// (DecodeElement in codec_kernels.cuh, DecodeSegment on the CPU). The codec is a template
// argument so that a kernel holds one codec's code and registers only.
template <uint8_t kDt, uint8_t kCodec>
PXK_HD void DecodeVec(const SegmentJob& j, uint32_t v, uint32_t out[4]) {
  const uint8_t* p = j.payload;
  const uint8_t* end = p + j.payload_bytes;
  const VecPos at = Locate(j, v);
  const uint32_t H = j.heads, D = j.dim, HD = H * D;
  float f[8];
  switch (kCodec) {
    case kRaw: {
      const uint64_t lo = LoadLe8(p + 2 * uint64_t{at.i0}, end);
      const uint64_t hi = LoadLe8(p + 2 * uint64_t{at.i0} + 8, end);
      out[0] = static_cast<uint32_t>(lo), out[1] = static_cast<uint32_t>(lo >> 32);
      out[2] = static_cast<uint32_t>(hi), out[3] = static_cast<uint32_t>(hi >> 32);
      return;
    }
    case kFp8: {
      const float scale = LdF32(p, at.h);
      const uint64_t codes = LoadLe8(p + 4 * uint64_t{H} + at.i0, end);
      for (int k = 0; k < 8; ++k) {
        f[k] = PXK_MUL(E4m3ToFloatFast(static_cast<uint32_t>(codes >> (8 * k))), scale);
      }
      break;
    }
    case kInt8: {
      const uint64_t meta = j.is_value ? uint64_t{j.tokens} * H : HD;
      const uint64_t codes = LoadLe8(p + 2 * meta + at.i0, end);
      if (j.is_value) {
        const float s = ToFloat<kDt>(Ld16(p, at.row));
        for (int k = 0; k < 8; ++k) {
          f[k] = PXK_MUL(Int8CodeToFloat(static_cast<uint32_t>(codes >> (8 * k))), s);
        }
      } else {
        uint16_t scales[8];
        Load8x16(p + 2 * uint64_t{at.h * D + at.d0}, end, scales);  // at.i0 % HD
        for (int k = 0; k < 8; ++k) {
          f[k] = PXK_MUL(Int8CodeToFloat(static_cast<uint32_t>(codes >> (8 * k))),
                         ToFloat<kDt>(scales[k]));
        }
      }
      break;
    }
    case kInt4:
    case kInt2: {
      const uint32_t bits = kCodec == kInt4 ? 4 : 2;
      const uint64_t packed = LoadLe(p + 4 * j.meta_count + uint64_t{at.i0} * bits / 8, bits);
      const uint32_t mask = (1u << bits) - 1u;
      if (!j.is_value) {  // K: one group of tokens, eight consecutive channels
        uint16_t scales[8], mins[8];
        const uint64_t m0 = uint64_t{Div(at.t, j.by_group)} * HD + at.h * D + at.d0;
        Load8x16(p + 2 * m0, end, scales);
        Load8x16(p + 2 * j.meta_count + 2 * m0, end, mins);
        for (int k = 0; k < 8; ++k) {
          const float q = SmallUintToFloat(static_cast<uint32_t>(packed >> (k * bits)) & mask);
          f[k] = PXK_ADD(PXK_MUL(q, ToFloat<kDt>(scales[k])), ToFloat<kDt>(mins[k]));
        }
      } else {  // V: one group of channels of one row
        const uint64_t m = uint64_t{at.row} * j.num_groups + Div(at.d0, j.by_group);
        const float s = ToFloat<kDt>(Ld16(p, m)), mn = ToFloat<kDt>(Ld16(p + 2 * j.meta_count, m));
        for (int k = 0; k < 8; ++k) {
          const float q = SmallUintToFloat(static_cast<uint32_t>(packed >> (k * bits)) & mask);
          f[k] = PXK_ADD(PXK_MUL(q, s), mn);
        }
      }
      break;
    }
    case kStar: {
      const StarHead sh = StarHeadAt(j, at.h);
      const int64_t found = StarImportantSlot(j, sh, at.t);
      if (found >= 0) {
        const uint64_t codes = LoadLe8(sh.iq + found * D + at.d0, end);
        const float s = ToFloat<kDt>(Ld16(sh.iscale, found));
        for (int k = 0; k < 8; ++k) {
          f[k] = PXK_MUL(Int8CodeToFloat(static_cast<uint32_t>(codes >> (8 * k))), s);
        }
        break;
      }
      uint32_t c = 0;
      for (uint32_t b = 0; b < j.index_bits; ++b) {
        const uint64_t pos = uint64_t{at.t} * j.index_bits + b;
        c |= ((sh.idx[pos / 8] >> (pos % 8)) & 1u) << b;
      }
      const uint64_t codes = LoadLe8(sh.cq + c * D + at.d0, end);
      const float cs = ToFloat<kDt>(Ld16(sh.cscale, c));
      const float rs = ToFloat<kDt>(Ld16(sh.rscale, at.t));
      const uint8_t signs = sh.rsign[(uint64_t{at.t} * D + at.d0) / 8];
      for (int k = 0; k < 8; ++k) {
        const float cv = PXK_MUL(Int8CodeToFloat(static_cast<uint32_t>(codes >> (8 * k))), cs);
        f[k] = PXK_ADD(cv, ((signs >> k) & 1u) ? rs : -rs);
      }
      break;
    }
    default:
      for (int k = 0; k < 4; ++k) out[k] = 0;  // unreachable: the host rejects other codecs
      return;
  }
  PackVec<kDt>(f, out);
}

// ---- encode: the fused per-head path. A head's statistics reduce to these quantities.

// Order-preserving int encoding of a float, for atomic min/max of signed floats (-0 < +0).
PXK_HD int32_t OrderedInt(float f) {
  const int32_t b = static_cast<int32_t>(nm::FloatBits(f));
  return b >= 0 ? b : b ^ 0x7FFFFFFF;
}
PXK_HD float FromOrderedInt(int32_t o) {
  return nm::BitsFloat(static_cast<uint32_t>(o >= 0 ? o : o ^ 0x7FFFFFFF));
}
PXK_HD float FiniteAbs(float x) {
  const float a = fabsf(x);
  return nm::IsFiniteFloat(a) ? a : 0.0f;
}

// int4/int2 group metadata from the finite min and max seen (mn > mx when none was finite):
// the stored scale and minimum, and the float minimum and divisor quantisation uses.
struct IntNGroup {
  uint16_t scale, min;
  float minf, div;
};
template <uint8_t kDt>
PXK_HD IntNGroup IntNGroupFrom(float mn, float mx, uint32_t bits) {
  if (mn > mx) mn = mx = 0.0f;
  mn = PXK_ADD(mn, 0.0f);
  mx = PXK_ADD(mx, 0.0f);
  const float qmax = static_cast<float>((1u << bits) - 1);
  IntNGroup g;
  g.scale = nm::RoundUpDtype(kDt, PXK_DIV(PXK_SUB(mx, mn), qmax));
  g.min = nm::FloatToDtype(kDt, mn);
  g.minf = nm::DtypeToFloat(kDt, g.min);
  const float s = nm::DtypeToFloat(kDt, g.scale);
  g.div = s == 0.0f ? 1.0f : s;
  return g;
}

// int8 row/channel scale from the largest finite |x|, and its divisor.
template <uint8_t kDt>
PXK_HD uint16_t Int8ScaleFrom(float amax) {
  return nm::RoundUpDtype(kDt, PXK_DIV(amax, 127.0f));
}
template <uint8_t kDt>
PXK_HD float DivisorOf(uint16_t scale) {
  const float s = nm::DtypeToFloat(kDt, scale);
  return s == 0.0f ? 1.0f : s;
}

// Quantisers of one element, as the scalar encoder computes them.
PXK_HD float Fp8Scaled(float x, float scale) {  // clamped, never NaN: what FloatToE4m3 takes
  return nm::ClampQ(PXK_DIV(x, scale == 0.0f ? 1.0f : scale), -448.0f, 448.0f);
}
// Two Fp8Scaled values as e4m3 codes (low byte: `a`): on the device one conversion instruction
// (round to nearest even, as FloatToE4m3 rounds every value in [-448, 448]).
PXK_HD uint32_t E4m3Pair(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
#else
  return nm::FloatToE4m3(a) | (uint32_t{nm::FloatToE4m3(b)} << 8);
#endif
}
PXK_HD uint8_t QuantInt8(float x, float div) {
  const float q = nm::RoundNearestEven(nm::ClampQ(PXK_DIV(x, div), -127.0f, 127.0f));
  return static_cast<uint8_t>(static_cast<int8_t>(q));
}
PXK_HD uint32_t QuantIntN(float x, float minf, float div, uint32_t bits) {
  const float qmax = static_cast<float>((1u << bits) - 1);
  return static_cast<uint32_t>(
      nm::RoundNearestEven(nm::ClampQ(PXK_DIV(PXK_SUB(x, minf), div), 0.0f, qmax)));
}

// ---- encode, fused per (segment, head): one CUDA block owns head h of a segment and runs
// InitStat over the words of `stats` (shared memory, StatsWords(j) ints), AccumulateVec over
// the head's vecs, FinalizeStat over FinalizeCount(j) words (writes the metadata, leaves the
// quantisation parameters in `stats`), then QuantizeVec over the vecs again, with a barrier
// between phases. The CPU tests run the same phases one after the other.

// Vecs of one head: T rows of dim/8.
PXK_HD uint32_t HeadVecs(const SegmentJob& j) { return j.tokens * (j.dim / 8); }
// Element index of the first element of vec `u` of head `h`, and its token and channel.
struct HeadVecPos {
  uint64_t i0;
  uint32_t t, d0;
};
PXK_HD HeadVecPos LocateInHead(const SegmentJob& j, uint32_t h, uint32_t u) {
  HeadVecPos p;
  p.t = Div(u, j.by_row_vecs);
  p.d0 = 8 * (u - p.t * (j.dim / 8));
  p.i0 = (uint64_t{p.t} * j.heads + h) * j.dim + p.d0;
  return p;
}
PXK_HD void LoadRawVec(const uint16_t* raw, uint64_t i0, uint16_t out[8]) {
#if defined(__CUDA_ARCH__)
  const uint4 w = *reinterpret_cast<const uint4*>(raw + i0);  // 16-byte aligned (host-checked)
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = static_cast<uint16_t>(words[k]);
    out[2 * k + 1] = static_cast<uint16_t>(words[k] >> 16);
  }
#else
  std::memcpy(out, raw + i0, 16);
#endif
}

// Number of ints of statistics per head (0 for raw and for codecs the fused path skips).
PXK_HD uint32_t StatsWords(const SegmentJob& j) {
  switch (j.codec) {
    case kFp8:
      return 1;
    case kInt8:
      return j.is_value ? j.tokens : j.dim;
    case kInt4:
    case kInt2:
      return 2 * (j.is_value ? j.tokens * j.num_groups
                             : (j.tokens + j.group_len - 1) / j.group_len * j.dim);
    default:
      return 0;
  }
}
PXK_HD uint32_t FinalizeCount(const SegmentJob& j) {
  return j.codec == kInt4 || j.codec == kInt2 ? StatsWords(j) / 2 : StatsWords(j);
}

// int4/int2 keep FinalizeCount(j) minimums, then as many maximums (group g: words g and
// FinalizeCount(j) + g), so that lanes reading neighbouring groups' words hit different banks.
PXK_HD int32_t InitStat(const SegmentJob& j, uint32_t w) {
  if (j.codec == kInt4 || j.codec == kInt2) {
    return OrderedInt(nm::BitsFloat(w >= FinalizeCount(j) ? 0xFF800000u : 0x7F800000u));
  }
  return 0;  // largest |x| so far: +0
}

// The statistics word that element k of vec `at` of a head feeds (for int4/int2 the group, whose
// minimum is that word and maximum the word FinalizeCount(j) further).
PXK_HD uint32_t StatWord(const SegmentJob& j, const HeadVecPos& at, uint32_t k) {
  switch (j.codec) {
    case kFp8:
      return 0;
    case kInt8:
      return j.is_value ? at.t : at.d0 + k;
    case kInt4:
    case kInt2:
      return j.is_value ? at.t * j.num_groups + Div(at.d0, j.by_group)
                        : Div(at.t, j.by_group) * j.dim + at.d0 + k;
    default:
      return 0;
  }
}

// Which lanes of a warp feed the same statistics words, as a mask of lane-index bits: for every
// warp of a head's vecs (warps start at multiples of 32 vecs), lanes whose indices differ only in
// these bits feed the same word with each element k (StatWord). fp8: all lanes (one word); V
// statistics: lanes of one token row (int8) or one value group (int4/int2); K statistics: lanes of
// one channel slot across the warp's tokens. 0 where the pattern is irregular (dim / 8 not a
// power of two, value groups that do not tile the row, token groups that split a warp's tokens).
PXK_HD uint32_t StatLaneBits(const SegmentJob& j) {
  if (j.codec == kFp8) return 31;
  const uint32_t per_row = j.dim / 8;
  if ((per_row & (per_row - 1)) != 0) return 0;
  const uint32_t row_bits = per_row >= 32 ? 31 : per_row - 1;  // lanes of one token row
  const uint32_t slot_bits = 31 & ~row_bits;                    // lanes of one channel slot
  switch (j.codec) {
    case kInt8:
      return j.is_value ? row_bits : slot_bits;
    case kInt4:
    case kInt2:
      if (j.is_value) return j.dim % j.group_len == 0 ? (j.group_len / 8 - 1) & row_bits : 0;
      return per_row < 32 && j.group_len % (32 / per_row) == 0 ? slot_bits : 0;
    default:
      return 0;
  }
}

// Folds v into the statistics word *w (max or min). On the device every lane of the warp calls
// it together, with the same `lane_bits` (StatLaneBits): lanes that differ only in those bits
// feed the same word, reduce with shuffles first, and the lowest of them makes the one
// shared-memory atomic (atomics on one word serialise: fp8's single word is hit by every vec of
// a head). A lane that is not `valid` (past the head's vecs) brings an identity value and
// touches nothing; the lowest lane of a group is valid whenever any lane of it is (the valid
// lanes are a prefix of the warp). On the host, a plain update.
template <bool kMax>
PXK_HD void FoldStat(int32_t* w, int32_t v, bool valid, uint32_t lane_bits) {
#if defined(__CUDA_ARCH__)
  for (uint32_t o = 1; o < 32; o <<= 1) {
    if (lane_bits & o) {
      const int32_t other = __shfl_xor_sync(0xFFFFFFFFu, v, o);
      v = kMax ? max(v, other) : min(v, other);
    }
  }
  if (valid && (threadIdx.x & lane_bits) == 0) {
    if (kMax) {
      atomicMax(w, v);
    } else {
      atomicMin(w, v);
    }
  }
#else
  (void)lane_bits;
  if (valid) *w = kMax ? (v > *w ? v : *w) : (v < *w ? v : *w);
#endif
}

// Vec u of head h into the statistics (see FoldStat for `valid` and `lane_bits`). Non-finite
// elements feed nothing: they bring the identity of every statistic (|x| 0, min +inf, max -inf),
// and so does a lane that is not valid (its elements read as NaN).
template <uint8_t kDt>
PXK_HD void AccumulateVec(const SegmentJob& j, uint32_t h, uint32_t u, bool valid,
                          uint32_t lane_bits, int32_t* stats) {
  const HeadVecPos at = LocateInHead(j, h, u);
  float x[8];
  if (valid) {
    uint16_t raw[8];
    LoadRawVec(j.raw, at.i0, raw);
    for (int k = 0; k < 8; ++k) x[k] = ToFloat<kDt>(raw[k]);
  } else {
    for (int k = 0; k < 8; ++k) x[k] = nm::BitsFloat(0x7FC00000u);
  }
  const float inf = nm::BitsFloat(0x7F800000u);
  switch (j.codec) {
    case kFp8:
    case kInt8: {
      if (j.codec == kInt8 && !j.is_value) {  // K: one scale per channel
        for (uint32_t k = 0; k < 8; ++k) {
          FoldStat<true>(&stats[StatWord(j, at, k)], OrderedInt(FiniteAbs(x[k])), valid, lane_bits);
        }
        return;
      }
      float a = 0.0f;
      for (int k = 0; k < 8; ++k) a = fmaxf(a, FiniteAbs(x[k]));
      FoldStat<true>(&stats[StatWord(j, at, 0)], OrderedInt(a), valid, lane_bits);
      return;
    }
    case kInt4:
    case kInt2: {
      const uint32_t n = FinalizeCount(j);
      if (!j.is_value) {  // K: group of tokens, per channel
        for (uint32_t k = 0; k < 8; ++k) {
          const bool finite = nm::IsFiniteFloat(x[k]);
          const uint32_t w = StatWord(j, at, k);
          FoldStat<false>(&stats[w], OrderedInt(finite ? x[k] : inf), valid, lane_bits);
          FoldStat<true>(&stats[n + w], OrderedInt(finite ? x[k] : -inf), valid, lane_bits);
        }
        return;
      }
      float mn = inf, mx = -inf;
      for (int k = 0; k < 8; ++k) {
        if (!nm::IsFiniteFloat(x[k])) continue;
        mn = x[k] < mn ? x[k] : mn;
        mx = mx < x[k] ? x[k] : mx;
      }
      const uint32_t w = StatWord(j, at, 0);
      FoldStat<false>(&stats[w], OrderedInt(mn), valid, lane_bits);
      FoldStat<true>(&stats[n + w], OrderedInt(mx), valid, lane_bits);
      return;
    }
    default:
      return;
  }
}

template <uint8_t kDt>
PXK_HD void FinalizeStat(const SegmentJob& j, uint32_t h, uint32_t w, int32_t* stats) {
  uint8_t* p = j.payload;
  const uint64_t H = j.heads, D = j.dim;
  switch (j.codec) {
    case kFp8: {
      const float scale = PXK_DIV(FromOrderedInt(stats[0]), 448.0f);
      StoreLe(p + 4 * uint64_t{h}, nm::FloatBits(scale), 4);
      stats[0] = static_cast<int32_t>(nm::FloatBits(scale));
      return;
    }
    case kInt8: {
      const uint16_t scale = Int8ScaleFrom<kDt>(FromOrderedInt(stats[w]));
      St16(p, j.is_value ? uint64_t{w} * H + h : h * D + w, scale);
      stats[w] = static_cast<int32_t>(nm::FloatBits(DivisorOf<kDt>(scale)));
      return;
    }
    case kInt4:
    case kInt2: {
      const uint32_t n = FinalizeCount(j);
      const IntNGroup g = IntNGroupFrom<kDt>(FromOrderedInt(stats[w]),
                                             FromOrderedInt(stats[n + w]), j.bits);
      uint64_t m;
      if (!j.is_value) {  // w = token group * D + channel
        m = uint64_t{w / j.dim} * H * D + h * D + w % j.dim;
      } else {  // w = token * num_groups + group
        m = (uint64_t{w / j.num_groups} * H + h) * j.num_groups + w % j.num_groups;
      }
      St16(p, m, g.scale);
      St16(p + 2 * j.meta_count, m, g.min);
      stats[w] = static_cast<int32_t>(nm::FloatBits(g.minf));
      stats[n + w] = static_cast<int32_t>(nm::FloatBits(g.div));
      return;
    }
    default:
      return;
  }
}

template <uint8_t kDt>
PXK_HD void QuantizeVec(const SegmentJob& j, uint32_t h, uint32_t u, const int32_t* stats) {
  const HeadVecPos at = LocateInHead(j, h, u);
  uint8_t* p = j.payload;
  uint16_t raw[8];
  LoadRawVec(j.raw, at.i0, raw);
  auto f = [](int32_t bits) { return nm::BitsFloat(static_cast<uint32_t>(bits)); };
  switch (j.codec) {
    case kRaw: {
      uint64_t lo = 0, hi = 0;
      for (int k = 0; k < 4; ++k) {
        lo |= uint64_t{raw[k]} << (16 * k);
        hi |= uint64_t{raw[4 + k]} << (16 * k);
      }
      StoreLe(p + 2 * at.i0, lo, 8);
      StoreLe(p + 2 * at.i0 + 8, hi, 8);
      return;
    }
    case kFp8: {
      const float scale = f(stats[0]);
      uint64_t codes = 0;
      for (int k = 0; k < 4; ++k) {
        codes |= uint64_t{E4m3Pair(Fp8Scaled(ToFloat<kDt>(raw[2 * k]), scale),
                                   Fp8Scaled(ToFloat<kDt>(raw[2 * k + 1]), scale))}
                 << (16 * k);
      }
      StoreLe(p + 4 * uint64_t{j.heads} + at.i0, codes, 8);
      return;
    }
    case kInt8: {
      const uint64_t meta = j.is_value ? uint64_t{j.tokens} * j.heads : uint64_t{j.heads} * j.dim;
      uint64_t codes = 0;
      for (uint32_t k = 0; k < 8; ++k) {
        const float div = f(stats[StatWord(j, at, k)]);
        codes |= uint64_t{QuantInt8(ToFloat<kDt>(raw[k]), div)} << (8 * k);
      }
      StoreLe(p + 2 * meta + at.i0, codes, 8);
      return;
    }
    case kInt4:
    case kInt2: {
      const uint32_t n = FinalizeCount(j);
      uint64_t packed = 0;
      for (uint32_t k = 0; k < 8; ++k) {
        const uint32_t w = StatWord(j, at, k);
        packed |= uint64_t{QuantIntN(ToFloat<kDt>(raw[k]), f(stats[w]), f(stats[n + w]), j.bits)}
                  << (k * j.bits);
      }
      StoreLe(p + 4 * j.meta_count + at.i0 * j.bits / 8, packed, j.bits);
      return;
    }
    default:
      return;
  }
}

}  // namespace proxima::codec::vec

#endif  // PROXIMA_KERNELS_INTERNAL_VEC_CODEC_H_
