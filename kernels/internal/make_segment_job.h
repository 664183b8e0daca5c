// Builds the SegmentJob of one segment for the CUDA kernels from its validated shape (used by the
// host wrapper kernels/codec_cuda.cc, and by the CPU tests of kernels/internal/vec_codec.h).
// Thread-safety: a pure function.
#ifndef PROXIMA_KERNELS_INTERNAL_MAKE_SEGMENT_JOB_H_
#define PROXIMA_KERNELS_INTERNAL_MAKE_SEGMENT_JOB_H_

#include <cstdint>

#include "kernels/codec.h"
#include "kernels/internal/k4v3_math.h"
#include "kernels/internal/segment_codecs.h"
#include "kernels/internal/segment_job.h"

namespace proxima::codec::internal {

// `payload`: the segment's payload; `raw`: its raw [tokens][heads][dim] values. Sets `vec` when
// the 8-element fast path applies (the encoder further requires the codec to have one).
inline SegmentJob MakeSegmentJob(CodecId codec, const SegmentShape& sh, uint8_t* payload,
                                 uint16_t* raw) {
  SegmentJob j;
  j.payload = payload;
  j.payload_bytes = codec == CodecId::kLossless ? 0 : FixedPayloadBytes(codec, sh);
  j.raw = raw;
  j.elements = sh.Elements();
  j.tokens = sh.tokens;
  j.heads = sh.heads;
  j.dim = sh.dim;
  j.codec = static_cast<uint8_t>(codec);
  j.is_value = sh.is_value ? 1 : 0;
  j.units = j.elements;
  switch (codec) {
    case CodecId::kFp8:
      j.groups = sh.heads;
      break;
    case CodecId::kInt8:
      j.groups = sh.is_value ? uint64_t{sh.tokens} * sh.heads : uint64_t{sh.heads} * sh.dim;
      break;
    case CodecId::kInt4:
    case CodecId::kInt2: {
      j.bits = codec == CodecId::kInt4 ? 4 : 2;
      internal::IntNLayout l = internal::IntNLayoutFor(sh, j.bits);
      j.group_len = l.group_len;
      j.num_groups = l.num_groups;
      j.meta_count = l.meta_count;
      j.groups = l.meta_count;
      j.units = l.packed_bytes;
      break;
    }
    case CodecId::kStar: {
      internal::StarLayout l = internal::StarLayoutFor(sh);
      j.centroids = l.centroids;
      j.index_bits = l.index_bits;
      j.important = l.important;
      j.star_head_bytes = l.per_head_bytes;
      j.groups = sh.heads;  // encode: one thread per head
      j.units = 0;
      // Scratch per head (encode): centroids, dequantized centroids, sums ([C][D] each),
      // scores [T], counts [C], important list [M], important flags [T] bytes.
      j.star_scratch_floats = 3 * uint64_t{l.centroids} * sh.dim + sh.tokens + l.centroids +
                              l.important + (sh.tokens + 3) / 4;
      break;
    }
    default:
      break;
  }
  j.by_dim = MakeFastDiv(sh.dim > 0 ? sh.dim : 1);
  j.by_heads = MakeFastDiv(sh.heads > 0 ? sh.heads : 1);
  j.by_row_vecs = MakeFastDiv(sh.dim >= 8 ? sh.dim / 8 : 1);
  j.by_group = MakeFastDiv(j.group_len > 0 ? j.group_len : 1);
  // The 8-element fast path: dim a multiple of 8, 16-byte aligned raw rows, 32-bit indices.
  j.vec = sh.dim % 8 == 0 && reinterpret_cast<uintptr_t>(raw) % 16 == 0 &&
                  j.elements < (uint64_t{1} << 31)
              ? 1
              : 0;
  return j;
}

// k4v3 on the GPU (kernels/internal/k4v3_math.h) takes head_dim a power of two from 8 (so V's rows
// of codes start on byte boundaries, and a row is one transform chunk) to k4v3::kMaxRowDim; the
// CPU codec takes the others.
inline bool K4v3GpuDimOk(uint32_t head_dim) {
  return (head_dim & (head_dim - 1)) == 0 && head_dim >= 8 && head_dim <= k4v3::kMaxRowDim;
}

// The jobs of one k4v3 segment. V: `main` alone codes rows between `raw` and `payload`. K: `main`
// turns `raw` into `turned` (encode; back on decode) with `rope`'s frequencies and owns the
// payload's 8-byte header, and `int4` codes `turned` into the rest of the payload, as int4 would
// (its own kernels). `turned` holds Elements() values; 16-byte aligned for int4's fast path.
struct K4v3Jobs {
  SegmentJob main;
  SegmentJob int4;  // K only
};
inline K4v3Jobs MakeK4v3Jobs(const SegmentShape& sh, const K4v3Rope& rope, uint8_t* payload,
                             uint16_t* raw, uint16_t* turned) {
  K4v3Jobs jobs;
  SegmentJob& j = jobs.main;
  j.payload = payload;
  j.payload_bytes = FixedPayloadBytes(CodecId::kK4v3, sh);
  j.raw = raw;
  j.elements = sh.Elements();
  j.tokens = sh.tokens;
  j.heads = sh.heads;
  j.dim = sh.dim;
  j.codec = static_cast<uint8_t>(CodecId::kK4v3);
  j.is_value = sh.is_value ? 1 : 0;
  if (sh.is_value) {
    j.hadamard_norm = K4v3HadamardNorm(sh.dim);
    j.units = uint64_t{sh.tokens} * sh.heads;  // rows
    return jobs;
  }
  j.turned = turned;
  j.omega0 = rope.omega0;
  j.ratio = rope.ratio;
  j.units = j.elements / 2;  // pairs
  jobs.int4 = MakeSegmentJob(CodecId::kInt4, sh, payload + kK4v3KHeaderBytes, turned);
  return jobs;
}

}  // namespace proxima::codec::internal

#endif  // PROXIMA_KERNELS_INTERNAL_MAKE_SEGMENT_JOB_H_
