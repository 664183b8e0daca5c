// One segment of work for the CUDA kernels, filled in by the host wrapper (kernels/codec_cuda.cc)
// from a validated header. Plain data shared by host and device code; no CUDA types.
// Thread-safety: a plain value.
#ifndef PROXIMA_KERNELS_INTERNAL_SEGMENT_JOB_H_
#define PROXIMA_KERNELS_INTERNAL_SEGMENT_JOB_H_

#include <cstdint>

namespace proxima::codec::internal {

// n / d for a divisor d >= 1 fixed per job, as a multiply-high, a subtraction and two shifts
// (Granlund and Montgomery's method, exact for every 32-bit n; vec::Div applies it): the kernels
// divide indices by dim, heads and group lengths per vec, and a 32-bit division has no instruction
// on a GPU (about twenty).
struct FastDiv {
  uint32_t mul = 1;
  uint8_t shift1 = 0, shift2 = 0;
};
inline FastDiv MakeFastDiv(uint32_t d) {
  uint32_t l = 0;  // ceil(log2(d))
  while (l < 32 && (uint64_t{1} << l) < d) ++l;
  FastDiv f;
  f.mul = static_cast<uint32_t>((((uint64_t{1} << l) - d) << 32) / d + 1);
  f.shift1 = l < 1 ? static_cast<uint8_t>(l) : 1;
  f.shift2 = l < 1 ? 0 : static_cast<uint8_t>(l - 1);
  return f;
}

struct SegmentJob {
  uint8_t* payload = nullptr;  // device: segment payload (decode input, encode output)
  uint64_t payload_bytes = 0;  // its size (FixedPayloadBytes)
  uint16_t* raw = nullptr;     // device: [tokens][heads][dim] dtype values (decode output,
                               // encode input); 2-byte aligned
  uint64_t elements = 0;       // tokens * heads * dim
  uint64_t groups = 0;         // encode: statistics groups (fp8 heads, int8 rows/channels, ...)
  uint64_t units = 0;          // encode: quantize work items (elements, or packed bytes)
  uint64_t meta_count = 0;     // int4/int2: scales (and as many minimums)
  uint64_t star_head_bytes = 0;
  // star encode only: the layer's K segment (importance by key norm when `importance` is null),
  // the worker's per-token importance (device, `tokens` floats, may be null), and per-head
  // scratch of `star_scratch_floats` floats each (device).
  const uint16_t* layer_k = nullptr;
  const float* importance = nullptr;
  float* star_scratch = nullptr;
  uint64_t star_scratch_floats = 0;
  // k4v3 (kernels/internal/k4v3_math.h): a K job's values in the block's RoPE frame (device,
  // `elements` values: int4's input on encode, its output on decode) and its frequencies; a V
  // job's Hadamard normalisation 1/sqrt(dim).
  uint16_t* turned = nullptr;
  float omega0 = 0.0f, ratio = 1.0f, hadamard_norm = 0.0f;
  uint32_t tokens = 0, heads = 0, dim = 0;
  uint32_t group_len = 0, num_groups = 0;                 // int4/int2
  uint32_t centroids = 0, index_bits = 0, important = 0;  // star
  uint8_t codec = 0;                                      // CodecId value
  uint8_t bits = 0;                                       // 4 or 2 for int4/int2
  uint8_t is_value = 0;
  uint8_t vec = 0;  // 1: the 8-element fast path takes this job (kernels/internal/vec_codec.h)
  // Divisors of the fast path: dim, heads, dim / 8 (vecs per row), group_len (int4/int2).
  FastDiv by_dim, by_heads, by_row_vecs, by_group;
};

}  // namespace proxima::codec::internal

#endif  // PROXIMA_KERNELS_INTERNAL_SEGMENT_JOB_H_
