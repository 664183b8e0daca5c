// Device code of the STAR-KV CUDA backend: per-element decode, per-group encode statistics and
// per-unit quantisation, all written with the shared scalar arithmetic of
// kernels/internal/numeric.h so the results match the CPU reference bit for bit. Payloads sit
// at arbitrary byte offsets, so every multi-byte payload field is read and written bytewise.
// Every pointer here comes from a SegmentJob whose sizes the host validated.
// Thread-safety: each GPU thread writes only its own elements, groups or head slices.
#ifndef PROXIMA_KERNELS_CODEC_KERNELS_CUH_
#define PROXIMA_KERNELS_CODEC_KERNELS_CUH_

#include <cstdint>

#include "kernels/internal/k4v3_math.h"
#include "kernels/internal/numeric.h"
#include "kernels/internal/segment_job.h"
#include "kernels/internal/vec_codec.h"

namespace proxima::codec::cuda {

using internal::SegmentJob;
namespace nm = ::proxima::codec::numeric;

using vec::FiniteAbs, vec::Ld16, vec::LdF32, vec::St16;
using vec::kFp8, vec::kInt2, vec::kInt4, vec::kInt8, vec::kRaw, vec::kStar;

__device__ __forceinline__ void StF32(uint8_t* p, uint64_t i, float f) {
  vec::StoreLe(p + 4 * i, nm::FloatBits(f), 4);
}
__device__ __forceinline__ uint32_t GetBits(const uint8_t* p, uint64_t index, uint32_t bits) {
  uint64_t pos = index * bits;
  uint32_t v = 0;
  for (uint32_t b = 0; b < bits; ++b, ++pos) v |= ((p[pos / 8] >> (pos % 8)) & 1u) << b;
  return v;
}

template <uint8_t kDt>
__device__ __forceinline__ float ToF(uint16_t v) {
  return nm::DtypeToFloat(kDt, v);
}

// ----------------------------------------------------------------------------------- decode

// Value of element `i` (natural order [token][head][dim]) of a validated segment.
template <uint8_t kDt>
__device__ uint16_t DecodeElement(const SegmentJob& j, uint64_t i) {
  const uint8_t* p = j.payload;
  const uint64_t D = j.dim, H = j.heads;
  switch (j.codec) {
    case kRaw:
      return Ld16(p, i);
    case kFp8: {
      float scale = LdF32(p, (i / D) % H);
      return nm::FloatToDtype(kDt, PXK_MUL(nm::E4m3ToFloat(p[4 * H + i]), scale));
    }
    case kInt8: {
      uint64_t s = j.is_value ? i / D : i % (H * D);
      uint64_t meta = j.is_value ? uint64_t{j.tokens} * H : H * D;
      float q = static_cast<float>(static_cast<int8_t>(p[2 * meta + i]));
      return nm::FloatToDtype(kDt, PXK_MUL(q, ToF<kDt>(Ld16(p, s))));
    }
    case kInt4:
    case kInt2: {
      uint64_t m;
      if (!j.is_value) {
        m = (i / (H * D)) / j.group_len * (H * D) + i % (H * D);
      } else {
        m = (i / D) * j.num_groups + (i % D) / j.group_len;
      }
      float scale = ToF<kDt>(Ld16(p, m));
      float mn = ToF<kDt>(Ld16(p + 2 * j.meta_count, m));
      float q = static_cast<float>(GetBits(p + 4 * j.meta_count, i, j.bits));
      return nm::FloatToDtype(kDt, PXK_ADD(PXK_MUL(q, scale), mn));
    }
    case kStar: {
      const uint64_t d = i % D, h = (i / D) % H, t = i / (D * H);
      const vec::StarHead sh = vec::StarHeadAt(j, h);
      const int64_t found = vec::StarImportantSlot(j, sh, t);
      if (found >= 0) {
        float q = static_cast<float>(static_cast<int8_t>(sh.iq[found * D + d]));
        return nm::FloatToDtype(kDt, PXK_MUL(q, ToF<kDt>(Ld16(sh.iscale, found))));
      }
      uint32_t k = GetBits(sh.idx, t, j.index_bits);
      float c = PXK_MUL(static_cast<float>(static_cast<int8_t>(sh.cq[k * D + d])),
                        ToF<kDt>(Ld16(sh.cscale, k)));
      float rs = ToF<kDt>(Ld16(sh.rscale, t));
      float r = GetBits(sh.rsign, t * D + d, 1) ? rs : -rs;
      return nm::FloatToDtype(kDt, PXK_ADD(c, r));
    }
    default:
      return 0;  // unreachable: the host rejects other codecs
  }
}

// Threads per block of every decode and encode kernel.
constexpr uint32_t kThreads = 256;
// Vecs each thread of the fast path decodes per round: their loads are all issued before the
// first store, so the memory system sees several independent requests per thread.
constexpr uint32_t kDecodeVecsPerThread = 4;

// The fast path for the `vec` jobs of one codec: grid.x: job, grid.y * blockDim.x threads over
// the job's vecs (8 elements, one 16-byte store each; kernels/internal/vec_codec.h),
// kDecodeVecsPerThread per round. One instantiation per codec keeps the others' code and
// registers out (occupancy). The job is copied to registers: the stores could otherwise alias
// it and force reloads.
// Resident blocks per multiprocessor asked of the register allocator: 6 (40 registers) where a
// codec fits without spilling, 5 (48) for the grouped and clustered codecs (ptxas -v, sm_90).
constexpr uint32_t DecodeMinBlocks(uint8_t codec) {
  return codec == vec::kInt4 || codec == vec::kInt2 || codec == vec::kStar ? 5 : 6;
}

template <uint8_t kDt, uint8_t kCodec>
__global__ void __launch_bounds__(kThreads, DecodeMinBlocks(kCodec))
    DecodeVecsKernel(const SegmentJob* jobs) {
  const SegmentJob j = jobs[blockIdx.x];
  const uint32_t threads = gridDim.y * blockDim.x;
  const uint32_t vecs = static_cast<uint32_t>(j.elements / 8);
  uint4* out = reinterpret_cast<uint4*>(j.raw);
  for (uint32_t base = blockIdx.y * blockDim.x + threadIdx.x; base < vecs;
       base += threads * kDecodeVecsPerThread) {
    uint4 w[kDecodeVecsPerThread];
#pragma unroll
    for (uint32_t k = 0; k < kDecodeVecsPerThread; ++k) {
      const uint32_t v = base + k * threads;
      if (v >= vecs) break;
      uint32_t o[4];
      vec::DecodeVec<kDt, kCodec>(j, v, o);
      w[k] = make_uint4(o[0], o[1], o[2], o[3]);
    }
#pragma unroll
    for (uint32_t k = 0; k < kDecodeVecsPerThread; ++k) {
      const uint32_t v = base + k * threads;
      if (v >= vecs) break;
      out[v] = w[k];
    }
  }
}

// The per-element path, for jobs the fast path does not take (dims not a multiple of 8):
// grid.x: job, grid.y * blockDim.x threads over its elements.
template <uint8_t kDt>
__global__ void __launch_bounds__(kThreads) DecodeSegmentsKernel(const SegmentJob* jobs) {
  const SegmentJob j = jobs[blockIdx.x];
  const uint32_t threads = gridDim.y * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.y} * blockDim.x + threadIdx.x; i < j.elements; i += threads) {
    j.raw[i] = DecodeElement<kDt>(j, i);
  }
}

// ----------------------------------------------------------------------------------- encode

// star encode of head `h` by one thread, a direct port of the CPU encoder (EncodeStar and the
// importance ranking in codec.cc). docs/format.md allows backends to differ here; the GPU test
// bounds the error instead of comparing bytes.
template <uint8_t kDt>
__device__ void EncodeStarHead(const SegmentJob& j, uint64_t h) {
  const uint64_t T = j.tokens, H = j.heads, D = j.dim, C = j.centroids, M = j.important;
  uint8_t* p = j.payload + h * j.star_head_bytes;
  for (uint64_t b = 0; b < j.star_head_bytes; ++b) p[b] = 0;
  float* cent = j.star_scratch + h * j.star_scratch_floats;   // [C][D]
  float* cdeq = cent + C * D;                                 // [C][D]
  float* sums = cdeq + C * D;                                 // [C][D]
  float* score = sums + C * D;                                // [T]
  uint32_t* counts = reinterpret_cast<uint32_t*>(score + T);  // [C]
  uint32_t* imp = counts + C;                                 // [M]
  uint8_t* is_imp = reinterpret_cast<uint8_t*>(imp + M);      // [T]
  auto x_at = [&](uint64_t t, uint64_t d) {
    float v = ToF<kDt>(j.raw[(t * H + h) * D + d]);
    return nm::IsFiniteFloat(v) ? v : 0.0f;
  };
  // Importance: worker's vector, else the key norm of this head; top M, ties to lower index.
  for (uint64_t t = 0; t < T; ++t) {
    float sc;
    if (j.importance != nullptr) {
      sc = j.importance[t];
    } else {
      sc = 0.0f;
      for (uint64_t d = 0; d < D; ++d) {
        float k = ToF<kDt>(j.layer_k[(t * H + h) * D + d]);
        if (nm::IsFiniteFloat(k)) sc = PXK_ADD(sc, PXK_MUL(k, k));
      }
    }
    score[t] = sc == sc ? sc : -__int_as_float(0x7F800000);
    is_imp[t] = 0;
  }
  for (uint64_t m = 0; m < M; ++m) {
    int64_t best = -1;
    for (uint64_t t = 0; t < T; ++t) {
      if (!is_imp[t] && (best < 0 || score[t] > score[best])) best = static_cast<int64_t>(t);
    }
    imp[m] = static_cast<uint32_t>(best);
    is_imp[best] = 1;
  }
  uint64_t n = 0;
  for (uint64_t t = 0; t < T; ++t) n += !is_imp[t];
  const bool all = n == 0;
  if (all) n = T;
  auto member = [&](uint64_t idx) {  // idx-th clustered token
    for (uint64_t t = 0; t < T; ++t) {
      if (all || !is_imp[t]) {
        if (idx == 0) return t;
        --idx;
      }
    }
    return uint64_t{0};
  };
  auto nearest = [&](uint64_t t, const float* cs) {
    uint32_t best = 0;
    float best_d = __int_as_float(0x7F800000);
    for (uint64_t k = 0; k < C; ++k) {
      float dist = 0.0f;
      for (uint64_t d = 0; d < D; ++d) {
        float e = PXK_SUB(x_at(t, d), cs[k * D + d]);
        dist = PXK_ADD(dist, PXK_MUL(e, e));
      }
      if (dist < best_d) best_d = dist, best = static_cast<uint32_t>(k);
    }
    return best;
  };
  for (uint64_t k = 0; k < C; ++k) {
    uint64_t t = member(k * n / C);
    for (uint64_t d = 0; d < D; ++d) cent[k * D + d] = x_at(t, d);
  }
  for (int iter = 0; iter < 4; ++iter) {
    for (uint64_t i = 0; i < C * D; ++i) sums[i] = 0.0f;
    for (uint64_t k = 0; k < C; ++k) counts[k] = 0;
    for (uint64_t t = 0; t < T; ++t) {
      if (!all && is_imp[t]) continue;
      uint32_t k = nearest(t, cent);
      ++counts[k];
      for (uint64_t d = 0; d < D; ++d) sums[k * D + d] = PXK_ADD(sums[k * D + d], x_at(t, d));
    }
    for (uint64_t k = 0; k < C; ++k) {
      if (counts[k] == 0) continue;
      for (uint64_t d = 0; d < D; ++d) {
        cent[k * D + d] = PXK_DIV(sums[k * D + d], static_cast<float>(counts[k]));
      }
    }
  }
  uint8_t* cscale = p;
  uint8_t* cq = p + 2 * C;
  for (uint64_t k = 0; k < C; ++k) {
    float amax = 0.0f;
    for (uint64_t d = 0; d < D; ++d) amax = fmaxf(amax, fabsf(cent[k * D + d]));
    uint16_t scale = nm::RoundUpDtype(kDt, PXK_DIV(amax, 127.0f));
    float s = ToF<kDt>(scale);
    float div = s == 0.0f ? 1.0f : s;
    St16(cscale, k, scale);
    for (uint64_t d = 0; d < D; ++d) {
      float q = nm::RoundNearestEven(nm::ClampQ(PXK_DIV(cent[k * D + d], div), -127.0f, 127.0f));
      cq[k * D + d] = static_cast<uint8_t>(static_cast<int8_t>(q));
      cdeq[k * D + d] = PXK_MUL(q, s);
    }
  }
  uint8_t* imp_idx = cq + C * D;
  uint8_t* iscale = imp_idx + 2 * M;
  uint8_t* iq = iscale + 2 * M;
  for (uint64_t m = 0; m < M; ++m) {
    const uint64_t t = imp[m];
    St16(imp_idx, m, static_cast<uint16_t>(t));
    float amax = 0.0f;
    for (uint64_t d = 0; d < D; ++d) amax = fmaxf(amax, fabsf(x_at(t, d)));
    uint16_t scale = nm::RoundUpDtype(kDt, PXK_DIV(amax, 127.0f));
    float s = ToF<kDt>(scale);
    float div = s == 0.0f ? 1.0f : s;
    St16(iscale, m, scale);
    for (uint64_t d = 0; d < D; ++d) {
      float q = nm::RoundNearestEven(nm::ClampQ(PXK_DIV(x_at(t, d), div), -127.0f, 127.0f));
      iq[m * D + d] = static_cast<uint8_t>(static_cast<int8_t>(q));
    }
  }
  uint8_t* idx = iq + M * D;
  uint8_t* rscale = idx + (T * j.index_bits + 7) / 8;
  uint8_t* rsign = rscale + 2 * T;
  for (uint64_t t = 0; t < T; ++t) {
    if (is_imp[t]) continue;
    const uint32_t k = nearest(t, cdeq);
    for (uint32_t b = 0; b < j.index_bits; ++b) {
      const uint64_t pos = t * j.index_bits + b;
      if ((k >> b) & 1u) idx[pos / 8] |= static_cast<uint8_t>(1u << (pos % 8));
    }
    float sum_abs = 0.0f;
    for (uint64_t d = 0; d < D; ++d) {
      float r = PXK_SUB(x_at(t, d), cdeq[k * D + d]);
      sum_abs = PXK_ADD(sum_abs, fabsf(r));
      if (r >= 0.0f) {
        const uint64_t pos = t * D + d;
        rsign[pos / 8] |= static_cast<uint8_t>(1u << (pos % 8));
      }
    }
    St16(rscale, t, nm::RoundUpDtype(kDt, PXK_DIV(sum_abs, static_cast<float>(D))));
  }
}

// Statistics of group `g`, visited in the scalar reference's order, written as metadata.
template <uint8_t kDt>
__device__ void EncodeGroup(const SegmentJob& j, uint64_t g) {
  uint8_t* p = j.payload;
  const uint64_t T = j.tokens, H = j.heads, D = j.dim;
  auto x_at = [&](uint64_t i) { return ToF<kDt>(j.raw[i]); };
  switch (j.codec) {
    case kFp8: {
      float amax = 0.0f;
      for (uint64_t t = 0; t < T; ++t) {
        for (uint64_t d = 0; d < D; ++d) {
          float a = FiniteAbs(x_at((t * H + g) * D + d));
          if (a > amax) amax = a;
        }
      }
      StF32(p, g, PXK_DIV(amax, 448.0f));
      return;
    }
    case kInt8: {
      float amax = 0.0f;
      if (!j.is_value) {
        for (uint64_t t = 0; t < T; ++t) amax = fmaxf(amax, FiniteAbs(x_at(t * H * D + g)));
      } else {
        for (uint64_t d = 0; d < D; ++d) amax = fmaxf(amax, FiniteAbs(x_at(g * D + d)));
      }
      St16(p, g, nm::RoundUpDtype(kDt, PXK_DIV(amax, 127.0f)));
      return;
    }
    case kInt4:
    case kInt2: {
      uint64_t base, stride, len;
      if (!j.is_value) {  // g = group * H * D + channel
        uint64_t grp = g / (H * D), c = g % (H * D);
        uint64_t t0 = grp * j.group_len;
        base = t0 * H * D + c;
        stride = H * D;
        len = T - t0 < j.group_len ? T - t0 : j.group_len;
      } else {  // g = row * num_groups + group
        uint64_t row = g / j.num_groups, grp = g % j.num_groups;
        uint64_t d0 = grp * j.group_len;
        base = row * D + d0;
        stride = 1;
        len = D - d0 < j.group_len ? D - d0 : j.group_len;
      }
      float mn = __int_as_float(0x7F800000), mx = -mn;
      for (uint64_t k = 0; k < len; ++k) {
        float x = x_at(base + k * stride);
        if (!nm::IsFiniteFloat(x)) continue;
        mn = x < mn ? x : mn;
        mx = mx < x ? x : mx;
      }
      if (mn > mx) mn = mx = 0.0f;
      mn = PXK_ADD(mn, 0.0f);
      mx = PXK_ADD(mx, 0.0f);
      const float qmax = static_cast<float>((1u << j.bits) - 1);
      St16(p, g, nm::RoundUpDtype(kDt, PXK_DIV(PXK_SUB(mx, mn), qmax)));
      St16(p + 2 * j.meta_count, g, nm::FloatToDtype(kDt, mn));
      return;
    }
    case kStar:
      EncodeStarHead<kDt>(j, g);
      return;
    default:
      return;
  }
}

template <uint8_t kDt>
__device__ __forceinline__ float Divisor(uint16_t scale) {
  float s = ToF<kDt>(scale);
  return s == 0.0f ? 1.0f : s;
}

// Quantises work item `u`: element `u` (raw, fp8, int8) or packed byte `u` (int4/int2).
template <uint8_t kDt>
__device__ void EncodeUnit(const SegmentJob& j, uint64_t u) {
  uint8_t* p = j.payload;
  const uint64_t H = j.heads, D = j.dim;
  switch (j.codec) {
    case kRaw:
      St16(p, u, j.raw[u]);
      return;
    case kFp8: {
      float s = LdF32(p, (u / D) % H);
      float y = nm::ClampQ(PXK_DIV(ToF<kDt>(j.raw[u]), s == 0.0f ? 1.0f : s), -448.0f, 448.0f);
      p[4 * H + u] = nm::FloatToE4m3(y);
      return;
    }
    case kInt8: {
      uint64_t s = j.is_value ? u / D : u % (H * D);
      uint64_t meta = j.is_value ? uint64_t{j.tokens} * H : H * D;
      float q = nm::RoundNearestEven(
          nm::ClampQ(PXK_DIV(ToF<kDt>(j.raw[u]), Divisor<kDt>(Ld16(p, s))), -127.0f, 127.0f));
      p[2 * meta + u] = static_cast<uint8_t>(static_cast<int8_t>(q));
      return;
    }
    case kInt4:
    case kInt2: {
      const uint32_t per_byte = 8 / j.bits;
      const float qmax = static_cast<float>((1u << j.bits) - 1);
      uint32_t byte = 0;
      for (uint32_t k = 0; k < per_byte; ++k) {
        uint64_t i = u * per_byte + k;
        if (i >= j.elements) break;
        uint64_t m = !j.is_value ? (i / (H * D)) / j.group_len * (H * D) + i % (H * D)
                                 : (i / D) * j.num_groups + (i % D) / j.group_len;
        float minf = ToF<kDt>(Ld16(p + 2 * j.meta_count, m));
        float div = Divisor<kDt>(Ld16(p, m));
        float q = nm::RoundNearestEven(
            nm::ClampQ(PXK_DIV(PXK_SUB(ToF<kDt>(j.raw[i]), minf), div), 0.0f, qmax));
        byte |= static_cast<uint32_t>(q) << (k * j.bits);
      }
      p[4 * j.meta_count + u] = static_cast<uint8_t>(byte);
      return;
    }
    default:
      return;
  }
}

// The per-element encode path (jobs the fused path does not take: star, dims not a multiple of 8,
// unaligned rows): statistics per group, then quantisation per unit.
template <uint8_t kDt>
__global__ void EncodeGroupsKernel(const SegmentJob* jobs) {
  const SegmentJob j = jobs[blockIdx.x];
  if (j.vec) return;
  for (uint64_t g = uint64_t{blockIdx.y} * blockDim.x + threadIdx.x; g < j.groups;
       g += uint64_t{gridDim.y} * blockDim.x) {
    EncodeGroup<kDt>(j, g);
  }
}

template <uint8_t kDt>
__global__ void EncodeUnitsKernel(const SegmentJob* jobs) {
  const SegmentJob j = jobs[blockIdx.x];
  if (j.vec) return;
  for (uint64_t u = uint64_t{blockIdx.y} * blockDim.x + threadIdx.x; u < j.units;
       u += uint64_t{gridDim.y} * blockDim.x) {
    EncodeUnit<kDt>(j, u);
  }
}

// The fused encode path: block (job, head) computes the head's statistics in shared memory
// (dynamic, StatsWords ints), writes the metadata, then quantises the head; its 16-byte rows are
// read twice, the second time mostly from L1. Jobs without `vec` and heads past a job's count
// leave at once (block-uniform, before any barrier).
template <uint8_t kDt>
__global__ void __launch_bounds__(kThreads, 6) EncodeHeadsKernel(const SegmentJob* jobs) {
  extern __shared__ int32_t stats[];
  const SegmentJob j = jobs[blockIdx.x];  // in registers: payload stores could alias it
  const uint32_t h = blockIdx.y;
  if (!j.vec || h >= j.heads) return;
  const uint32_t words = vec::StatsWords(j), vecs = vec::HeadVecs(j);
  for (uint32_t w = threadIdx.x; w < words; w += blockDim.x) stats[w] = vec::InitStat(j, w);
  __syncthreads();
  if (words > 0) {
    // Whole warps (vec::FoldStat reduces across all 32 lanes); lanes past `vecs` feed nothing.
    const uint32_t lane_bits = vec::StatLaneBits(j), padded = (vecs + 31) / 32 * 32;
    for (uint32_t u = threadIdx.x; u < padded; u += blockDim.x) {
      vec::AccumulateVec<kDt>(j, h, u, u < vecs, lane_bits, stats);
    }
    __syncthreads();
    const uint32_t finals = vec::FinalizeCount(j);
    for (uint32_t w = threadIdx.x; w < finals; w += blockDim.x) {
      vec::FinalizeStat<kDt>(j, h, w, stats);
    }
    __syncthreads();
  }
  for (uint32_t u = threadIdx.x; u < vecs; u += blockDim.x) vec::QuantizeVec<kDt>(j, h, u, stats);
}

// ------------------------------------------------------------------------------------ k4v3

// K jobs: every pair of the job turned (kInverse false: raw -> turned, and the payload's header
// written; true: turned -> raw). One thread per (token, pair), over every head; int4's kernels run
// before (decode) or after (encode) on the same stream.
template <uint8_t kDt, bool kInverse>
__global__ void __launch_bounds__(kThreads) K4v3TurnKernel(const SegmentJob* jobs) {
  const SegmentJob j = jobs[blockIdx.x];
  if (!kInverse && blockIdx.y == 0 && threadIdx.x == 0) k4v3::WriteKHeader(j);
  const uint64_t items = j.units / j.heads;
  for (uint64_t q = uint64_t{blockIdx.y} * blockDim.x + threadIdx.x; q < items;
       q += uint64_t{gridDim.y} * blockDim.x) {
    k4v3::TurnPairs<kDt>(j, q, kInverse);
  }
}

// The transform's stages over a team's lanes (k4v3_math.h: TeamStage, then LaneStages), the
// exchanges as shuffles among the team's lanes (`mask`, width kT).
template <uint32_t kT, uint32_t kPerLane>
__device__ __forceinline__ void TeamFwht(float* u, uint32_t lane, unsigned mask) {
#pragma unroll
  for (uint32_t len = 1; len < kT; len <<= 1) {
#pragma unroll
    for (uint32_t k = 0; k < kPerLane; ++k) {
      const float theirs = __shfl_xor_sync(mask, u[k], len, kT);
      u[k] = k4v3::TeamStage(u[k], theirs, lane, len);
    }
  }
  k4v3::LaneStages(u, kPerLane);
}

// The V rows of one job with head_dim kDim, a team of TeamSize(kDim) lanes per (token, head) row,
// encoded (kEncode) or decoded. The team size divides 32, so a team never straddles warps; a
// team's lanes run its rows in step (their loop bound is the team's) and shuffle only among
// themselves.
template <uint8_t kDt, bool kEncode, uint32_t kDim>
__device__ __forceinline__ void K4v3Rows(const SegmentJob& j) {
  constexpr uint32_t kT = k4v3::TeamSize(kDim);
  constexpr uint32_t kPerLane = kDim / kT;
  const uint32_t lane = threadIdx.x % kT;
  const unsigned mask =
      kT == 32 ? 0xFFFFFFFFu : ((1u << kT) - 1u) << ((threadIdx.x % 32) & ~(kT - 1u));
  const uint32_t teams = blockDim.x / kT;
  float u[k4v3::kMaxPerLane];  // the first kPerLane used
  for (uint64_t r = uint64_t{blockIdx.y} * teams + threadIdx.x / kT; r < j.units;
       r += uint64_t{gridDim.y} * teams) {
    if constexpr (kEncode) {
      k4v3::LoadValueLane<kDt>(j, r, lane, kT, kPerLane, u);
      TeamFwht<kT, kPerLane>(u, lane, mask);
      int32_t amax = k4v3::LaneAbsBits(u, kPerLane, j.hadamard_norm);
#pragma unroll
      for (uint32_t len = 1; len < kT; len <<= 1) {
        const int32_t other = __shfl_xor_sync(mask, amax, len, kT);
        amax = other > amax ? other : amax;
      }
      float divisor;
      const uint16_t scale = k4v3::ScaleFromMaxBits<kDt>(amax, &divisor);
      if (lane == 0) k4v3::StoreRowScale(j, r, scale);
#pragma unroll
      for (uint32_t k = 0; k < kPerLane; ++k) {
        uint32_t w = k4v3::LaneCodeBits(u[k], divisor, lane);
#pragma unroll
        for (uint32_t len = 1; len < 8; len <<= 1) w |= __shfl_xor_sync(mask, w, len, kT);
        if (lane % 8 == 0) k4v3::StoreCodeWord(j, r, kDim, k4v3::LaneElement(lane, kT, k), w);
      }
    } else {
      k4v3::LoadLevelsLane(j, r, lane, kT, kPerLane, u);
      TeamFwht<kT, kPerLane>(u, lane, mask);
      k4v3::StoreValueLane<kDt>(j, r, lane, kT, kPerLane, u);
    }
  }
}

// V jobs, specialised per head_dim (a power of two from 8 to k4v3::kMaxRowDim, which the host
// wrapper checks; a job's dim is the same for its whole CUDA block).
template <uint8_t kDt, bool kEncode>
__global__ void __launch_bounds__(kThreads) K4v3ValuesKernel(const SegmentJob* jobs) {
  const SegmentJob j = jobs[blockIdx.x];
  switch (j.dim) {
    case 8: K4v3Rows<kDt, kEncode, 8>(j); break;
    case 16: K4v3Rows<kDt, kEncode, 16>(j); break;
    case 32: K4v3Rows<kDt, kEncode, 32>(j); break;
    case 64: K4v3Rows<kDt, kEncode, 64>(j); break;
    case 128: K4v3Rows<kDt, kEncode, 128>(j); break;
    case 256: K4v3Rows<kDt, kEncode, 256>(j); break;
    default: break;
  }
}

}  // namespace proxima::codec::cuda

#endif  // PROXIMA_KERNELS_CODEC_KERNELS_CUH_
