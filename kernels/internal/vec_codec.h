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

// Where vec `v` sits: element index, (token, head) row, and coordinates.
struct VecPos {
  uint32_t i0, row, t, h, d0;
};
PXK_HD VecPos Locate(const SegmentJob& j, uint32_t v) {
  VecPos p;
  p.i0 = 8 * v;
  p.row = p.i0 / j.dim;
  p.d0 = p.i0 - p.row * j.dim;
  p.t = p.row / j.heads;
  p.h = p.row - p.t * j.heads;
  return p;
}

// Decodes vec `v` of a validated segment into out[0..8) (dtype bit patterns); bit-identical to
// the scalar decoder (DecodeElement in codec_kernels.cuh, DecodeSegment on the CPU).
template <uint8_t kDt>
PXK_HD void DecodeVec(const SegmentJob& j, uint32_t v, uint16_t out[8]) {
  const uint8_t* p = j.payload;
  const uint8_t* end = p + j.payload_bytes;
  const VecPos at = Locate(j, v);
  const uint32_t H = j.heads, D = j.dim, HD = H * D;
  switch (j.codec) {
    case kRaw:
      Load8x16(p + 2 * uint64_t{at.i0}, end, out);
      return;
    case kFp8: {
      const float scale = LdF32(p, at.h);
      const uint64_t codes = LoadLe8(p + 4 * uint64_t{H} + at.i0, end);
      for (int k = 0; k < 8; ++k) {
        out[k] = nm::FloatToDtype(
            kDt, PXK_MUL(nm::E4m3ToFloat(static_cast<uint8_t>(codes >> (8 * k))), scale));
      }
      return;
    }
    case kInt8: {
      const uint64_t meta = j.is_value ? uint64_t{j.tokens} * H : HD;
      const uint64_t codes = LoadLe8(p + 2 * meta + at.i0, end);
      uint16_t scales[8];
      if (j.is_value) {
        const uint16_t s = Ld16(p, at.row);
        for (int k = 0; k < 8; ++k) scales[k] = s;
      } else {
        Load8x16(p + 2 * uint64_t{at.i0 % HD}, end, scales);
      }
      for (int k = 0; k < 8; ++k) {
        const float q = static_cast<float>(static_cast<int8_t>(codes >> (8 * k)));
        out[k] = nm::FloatToDtype(kDt, PXK_MUL(q, nm::DtypeToFloat(kDt, scales[k])));
      }
      return;
    }
    case kInt4:
    case kInt2: {
      uint16_t scales[8], mins[8];
      if (!j.is_value) {  // K: one group of tokens, eight consecutive channels
        const uint64_t m0 = uint64_t{at.t / j.group_len} * HD + at.i0 % HD;
        Load8x16(p + 2 * m0, end, scales);
        Load8x16(p + 2 * j.meta_count + 2 * m0, end, mins);
      } else {  // V: one group of channels of one row
        const uint64_t m = uint64_t{at.row} * j.num_groups + at.d0 / j.group_len;
        const uint16_t s = Ld16(p, m), mn = Ld16(p + 2 * j.meta_count, m);
        for (int k = 0; k < 8; ++k) scales[k] = s, mins[k] = mn;
      }
      const uint64_t bits = LoadLe(p + 4 * j.meta_count + uint64_t{at.i0} * j.bits / 8, j.bits);
      const uint32_t mask = (1u << j.bits) - 1u;
      for (int k = 0; k < 8; ++k) {
        const float q = static_cast<float>((bits >> (k * j.bits)) & mask);
        out[k] = nm::FloatToDtype(kDt, PXK_ADD(PXK_MUL(q, nm::DtypeToFloat(kDt, scales[k])),
                                               nm::DtypeToFloat(kDt, mins[k])));
      }
      return;
    }
    case kStar: {
      const StarHead sh = StarHeadAt(j, at.h);
      const int64_t found = StarImportantSlot(j, sh, at.t);
      if (found >= 0) {
        const uint64_t codes = LoadLe8(sh.iq + found * D + at.d0, end);
        const float s = nm::DtypeToFloat(kDt, Ld16(sh.iscale, found));
        for (int k = 0; k < 8; ++k) {
          const float q = static_cast<float>(static_cast<int8_t>(codes >> (8 * k)));
          out[k] = nm::FloatToDtype(kDt, PXK_MUL(q, s));
        }
        return;
      }
      uint32_t c = 0;
      for (uint32_t b = 0; b < j.index_bits; ++b) {
        const uint64_t pos = uint64_t{at.t} * j.index_bits + b;
        c |= ((sh.idx[pos / 8] >> (pos % 8)) & 1u) << b;
      }
      const uint64_t codes = LoadLe8(sh.cq + c * D + at.d0, end);
      const float cs = nm::DtypeToFloat(kDt, Ld16(sh.cscale, c));
      const float rs = nm::DtypeToFloat(kDt, Ld16(sh.rscale, at.t));
      const uint8_t signs = sh.rsign[(uint64_t{at.t} * D + at.d0) / 8];
      for (int k = 0; k < 8; ++k) {
        const float cv = PXK_MUL(static_cast<float>(static_cast<int8_t>(codes >> (8 * k))), cs);
        out[k] = nm::FloatToDtype(kDt, PXK_ADD(cv, ((signs >> k) & 1u) ? rs : -rs));
      }
      return;
    }
    default:
      for (int k = 0; k < 8; ++k) out[k] = 0;  // unreachable: the host rejects other codecs
      return;
  }
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
PXK_HD uint8_t QuantFp8(float x, float scale) {
  return nm::FloatToE4m3(nm::ClampQ(PXK_DIV(x, scale == 0.0f ? 1.0f : scale), -448.0f, 448.0f));
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

// Atomic min/max on the device, plain on the host (where the phases run sequentially).
PXK_HD void AtomicMaxInt(int32_t* a, int32_t v) {
#if defined(__CUDA_ARCH__)
  atomicMax(a, v);
#else
  if (v > *a) *a = v;
#endif
}
PXK_HD void AtomicMinInt(int32_t* a, int32_t v) {
#if defined(__CUDA_ARCH__)
  atomicMin(a, v);
#else
  if (v < *a) *a = v;
#endif
}

// Vecs of one head: T rows of dim/8.
PXK_HD uint32_t HeadVecs(const SegmentJob& j) { return j.tokens * (j.dim / 8); }
// Element index of the first element of vec `u` of head `h`, and its token and channel.
struct HeadVecPos {
  uint64_t i0;
  uint32_t t, d0;
};
PXK_HD HeadVecPos LocateInHead(const SegmentJob& j, uint32_t h, uint32_t u) {
  HeadVecPos p;
  const uint32_t per_row = j.dim / 8;
  p.t = u / per_row;
  p.d0 = 8 * (u - p.t * per_row);
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

PXK_HD int32_t InitStat(const SegmentJob& j, uint32_t w) {
  if (j.codec == kInt4 || j.codec == kInt2) {  // even words: minimum, odd: maximum
    return OrderedInt(nm::BitsFloat((w & 1u) ? 0xFF800000u : 0x7F800000u));  // -inf : +inf
  }
  return 0;  // largest |x| so far: +0
}

template <uint8_t kDt>
PXK_HD void AccumulateVec(const SegmentJob& j, uint32_t h, uint32_t u, int32_t* stats) {
  const HeadVecPos at = LocateInHead(j, h, u);
  uint16_t raw[8];
  LoadRawVec(j.raw, at.i0, raw);
  float x[8];
  for (int k = 0; k < 8; ++k) x[k] = nm::DtypeToFloat(kDt, raw[k]);
  switch (j.codec) {
    case kFp8:
    case kInt8: {
      if (j.codec == kInt8 && !j.is_value) {  // K: one scale per channel
        for (int k = 0; k < 8; ++k) AtomicMaxInt(&stats[at.d0 + k], OrderedInt(FiniteAbs(x[k])));
        return;
      }
      float a = 0.0f;
      for (int k = 0; k < 8; ++k) a = fmaxf(a, FiniteAbs(x[k]));
      AtomicMaxInt(&stats[j.codec == kFp8 ? 0 : at.t], OrderedInt(a));
      return;
    }
    case kInt4:
    case kInt2: {
      if (!j.is_value) {  // K: group of tokens, per channel
        const uint32_t w0 = at.t / j.group_len * j.dim + at.d0;
        for (int k = 0; k < 8; ++k) {
          if (!nm::IsFiniteFloat(x[k])) continue;
          AtomicMinInt(&stats[2 * (w0 + k)], OrderedInt(x[k]));
          AtomicMaxInt(&stats[2 * (w0 + k) + 1], OrderedInt(x[k]));
        }
        return;
      }
      float mn = nm::BitsFloat(0x7F800000u), mx = -mn;
      for (int k = 0; k < 8; ++k) {
        if (!nm::IsFiniteFloat(x[k])) continue;
        mn = x[k] < mn ? x[k] : mn;
        mx = mx < x[k] ? x[k] : mx;
      }
      if (mn > mx) return;  // nothing finite here
      const uint32_t w = at.t * j.num_groups + at.d0 / j.group_len;
      AtomicMinInt(&stats[2 * w], OrderedInt(mn));
      AtomicMaxInt(&stats[2 * w + 1], OrderedInt(mx));
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
      const IntNGroup g = IntNGroupFrom<kDt>(FromOrderedInt(stats[2 * w]),
                                             FromOrderedInt(stats[2 * w + 1]), j.bits);
      uint64_t m;
      if (!j.is_value) {  // w = token group * D + channel
        m = uint64_t{w / j.dim} * H * D + h * D + w % j.dim;
      } else {  // w = token * num_groups + group
        m = (uint64_t{w / j.num_groups} * H + h) * j.num_groups + w % j.num_groups;
      }
      St16(p, m, g.scale);
      St16(p + 2 * j.meta_count, m, g.min);
      stats[2 * w] = static_cast<int32_t>(nm::FloatBits(g.minf));
      stats[2 * w + 1] = static_cast<int32_t>(nm::FloatBits(g.div));
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
      for (int k = 0; k < 8; ++k) {
        codes |= uint64_t{QuantFp8(nm::DtypeToFloat(kDt, raw[k]), scale)} << (8 * k);
      }
      StoreLe(p + 4 * uint64_t{j.heads} + at.i0, codes, 8);
      return;
    }
    case kInt8: {
      const uint64_t meta = j.is_value ? uint64_t{j.tokens} * j.heads : uint64_t{j.heads} * j.dim;
      uint64_t codes = 0;
      for (int k = 0; k < 8; ++k) {
        const float div = f(stats[j.is_value ? at.t : at.d0 + k]);
        codes |= uint64_t{QuantInt8(nm::DtypeToFloat(kDt, raw[k]), div)} << (8 * k);
      }
      StoreLe(p + 2 * meta + at.i0, codes, 8);
      return;
    }
    case kInt4:
    case kInt2: {
      uint64_t packed = 0;
      for (int k = 0; k < 8; ++k) {
        const uint32_t w = j.is_value ? at.t * j.num_groups + at.d0 / j.group_len
                                      : at.t / j.group_len * j.dim + at.d0 + k;
        packed |= uint64_t{QuantIntN(nm::DtypeToFloat(kDt, raw[k]), f(stats[2 * w]),
                                     f(stats[2 * w + 1]), j.bits)}
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
