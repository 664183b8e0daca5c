// One segment of work for the CUDA kernels, filled in by the host wrapper (kernels/codec_cuda.cc)
// from a validated header. Plain data shared by host and device code; no CUDA types.
// Thread-safety: a plain value.
#ifndef PROXIMA_KERNELS_INTERNAL_SEGMENT_JOB_H_
#define PROXIMA_KERNELS_INTERNAL_SEGMENT_JOB_H_

#include <cstdint>

namespace proxima::codec::internal {

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
  uint32_t tokens = 0, heads = 0, dim = 0;
  uint32_t group_len = 0, num_groups = 0;                 // int4/int2
  uint32_t centroids = 0, index_bits = 0, important = 0;  // star
  uint8_t codec = 0;                                      // CodecId value
  uint8_t bits = 0;                                       // 4 or 2 for int4/int2
  uint8_t is_value = 0;
  uint8_t vec = 0;  // 1: the 8-element fast path takes this job (kernels/internal/vec_codec.h)
};

}  // namespace proxima::codec::internal

#endif  // PROXIMA_KERNELS_INTERNAL_SEGMENT_JOB_H_
