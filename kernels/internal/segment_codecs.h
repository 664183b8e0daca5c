// Per-segment codecs: one (layer, K|V) matrix [token][head][dim] of dtype values to and from its
// payload (docs/format.md section 3). The scalar functions here are the reference that defines
// the arithmetic; kernels/internal/simd_avx2.cc, simd_avx512.cc and the CUDA kernels reproduce
// them bit for bit.
// Callers (kernels/codec.cc) validate sizes before calling; decoders still validate every
// metadata value they read. Thread-safety: pure functions.
#ifndef PROXIMA_KERNELS_INTERNAL_SEGMENT_CODECS_H_
#define PROXIMA_KERNELS_INTERNAL_SEGMENT_CODECS_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/codec.h"
#include "kernels/internal/numeric.h"

namespace proxima::codec::internal {

struct SegmentShape {
  uint32_t tokens = 0;
  uint32_t heads = 0;
  uint32_t dim = 0;
  uint8_t dtype = 2;      // numeric::kDtypeFp16 / kDtypeBf16
  bool is_value = false;  // V segment (odd index); K otherwise
  uint32_t group = 0;     // int4/int2 group size (32/64/128), else 0
  size_t Elements() const { return size_t{tokens} * heads * dim; }
};

// Shape of segment `segment` (layer * 2 + {0: K, 1: V}) of a block of geometry `g`, with the
// int4/int2 group size `group` (0 for other codecs).
inline SegmentShape SegmentShapeFor(const BlockGeometry& g, uint32_t segment, uint32_t group) {
  SegmentShape s;
  s.tokens = g.tokens_per_block;
  s.heads = g.num_kv_heads;
  s.dim = g.head_dim;
  s.dtype = static_cast<uint8_t>(g.dtype);
  s.is_value = (segment & 1u) != 0;
  s.group = group;
  return s;
}

// int4/int2 group geometry of one segment (docs/format.md: int4/int2).
struct IntNLayout {
  uint32_t bits = 4;
  uint32_t group_len = 0;   // g = min(G, T) for K, min(G, D) for V
  uint32_t num_groups = 0;  // NG
  size_t meta_count = 0;    // scales (and as many minimums)
  size_t packed_bytes = 0;
};
IntNLayout IntNLayoutFor(const SegmentShape& shape, uint32_t bits);

struct StarLayout {
  uint32_t centroids = 1;  // C, a power of two
  uint32_t index_bits = 0;
  uint32_t important = 1;  // M
  size_t per_head_bytes = 0;
};
StarLayout StarLayoutFor(const SegmentShape& shape);

// Scale of one symmetric int8 row (int8 codec, star centroids and important tokens) from the
// largest finite |x|: the stored dtype scale, and the divisor the encoder uses (1 for scale 0).
struct Int8Row {
  uint16_t scale;
  float divisor;
};
inline Int8Row Int8RowScale(uint8_t dtype, float amax) {
  uint16_t scale = numeric::RoundUpDtype(dtype, amax / 127.0f);
  float f = numeric::DtypeToFloat(dtype, scale);
  return {scale, f == 0.0f ? 1.0f : f};
}

// Parameters of one int4/int2 group from its finite min and max (both 0 when it has none).
struct IntNGroup {
  uint16_t scale;
  uint16_t min;
  float min_f;    // float(min)
  float divisor;  // float(scale), or 1 when scale is 0
};
inline IntNGroup IntNGroupParams(uint8_t dtype, float mn, float mx, float qmax) {
  IntNGroup g;
  // Adding +0 turns a -0 extreme into +0, so the result does not depend on the order in which
  // the SIMD and scalar paths visit equal zeros.
  mn = mn + 0.0f;
  mx = mx + 0.0f;
  g.min = numeric::FloatToDtype(dtype, mn);
  g.scale = numeric::RoundUpDtype(dtype, (mx - mn) / qmax);
  g.min_f = numeric::DtypeToFloat(dtype, g.min);
  float s = numeric::DtypeToFloat(dtype, g.scale);
  g.divisor = s == 0.0f ? 1.0f : s;
  return g;
}

// Payload size of a fixed-size codec (every codec but lossless).
size_t FixedPayloadBytes(CodecId codec, const SegmentShape& shape);
// How many bytes at the start of a segment's payload its Validate* function reads (the scales,
// minimums and RoPE frequencies before the codes); 0 where the checks read elsewhere (star's are
// spread over its heads) or nothing (raw, lossless). For fetching them ahead of the checks.
size_t LeadingMetadataBytes(CodecId codec, const SegmentShape& shape);

// Unaligned little-endian access; payloads sit at arbitrary offsets.
inline uint16_t Load16(const std::byte* p, size_t i) {
  uint16_t v;
  std::memcpy(&v, p + 2 * i, 2);
  return v;
}
inline void Store16(std::byte* p, size_t i, uint16_t v) { std::memcpy(p + 2 * i, &v, 2); }
inline float LoadF32(const std::byte* p, size_t i) {
  float v;
  std::memcpy(&v, p + 4 * i, 4);
  return v;
}
inline void StoreF32(std::byte* p, size_t i, float v) { std::memcpy(p + 4 * i, &v, 4); }

// ---- Metadata validation shared by every decoder path (scalar, AVX2, AVX-512, CUDA host
// wrapper).
// `payload` has exactly FixedPayloadBytes() bytes.
absl::Status ValidateFp8(const SegmentShape& shape, const std::byte* payload);
absl::Status ValidateInt8(const SegmentShape& shape, const std::byte* payload);
absl::Status ValidateIntN(const SegmentShape& shape, uint32_t bits, const std::byte* payload);
absl::Status ValidateStar(const SegmentShape& shape, const std::byte* payload);

// ---- Scalar reference. `in`/`out` segments: Elements() dtype values, [token][head][dim].
// Encoders write exactly FixedPayloadBytes() bytes; decoders assume validated metadata.
void EncodeFp8Scalar(const SegmentShape& shape, const std::byte* in, std::byte* payload);
void DecodeFp8Scalar(const SegmentShape& shape, const std::byte* payload, std::byte* out);
void EncodeInt8Scalar(const SegmentShape& shape, const std::byte* in, std::byte* payload);
void DecodeInt8Scalar(const SegmentShape& shape, const std::byte* payload, std::byte* out);
void EncodeIntNScalar(const SegmentShape& shape, uint32_t bits, const std::byte* in,
                      std::byte* payload);
void DecodeIntNScalar(const SegmentShape& shape, uint32_t bits, const std::byte* payload,
                      std::byte* out);

// star: `important[h]` lists the StarLayout::important token indices of head h (the caller
// ranks tokens by importance or key norm).
void EncodeStar(const SegmentShape& shape, const std::byte* in,
                const std::vector<std::vector<uint32_t>>& important, std::byte* payload);
void DecodeStar(const SegmentShape& shape, const std::byte* payload, std::byte* out);

// lossless: variable size; the encoder appends to `payload`. `bmi2` (only when CpuHasBmi2())
// runs the same code compiled with BMI2: identical bytes, faster (kernels/internal/lossless.cc).
void EncodeLossless(const SegmentShape& shape, const std::byte* in, std::string* payload,
                    bool bmi2 = false);
absl::Status DecodeLossless(const SegmentShape& shape, std::span<const std::byte> payload,
                            std::byte* out, bool bmi2 = false);

// ---- k4v3 (segment_codecs.cc): K at 4 bits in the block's own RoPE frame, V at 3 bits
// after a signed Hadamard rotation (docs/format.md: k4v3). The K part quantizes with the int4
// kernels of the caller's CPU path, so it runs at their speed and gives their bytes; K's pair
// turns and V's rows run on that path's k4v3 kernels (K4v3Kernels), every one bit-identical to
// the scalar ones.
inline constexpr size_t kK4v3KHeaderBytes = 8;  // f32 omega0, f32 ratio

// The RoPE frequencies a K segment is un-rotated with: pair j turns by omega0 * ratio^j radians
// per token. From the plan's rope_theta (0: no rotation, omega0 = 0).
struct K4v3Rope {
  float omega0 = 0.0f;
  float ratio = 1.0f;
};
K4v3Rope K4v3RopeFor(double rope_theta, uint32_t head_dim);
// V's normalisation: 1/sqrt(dim), rounded once from double.
float K4v3HadamardNorm(uint32_t dim);

using IntNEncodeFn = void (*)(const SegmentShape&, uint32_t, const std::byte*, std::byte*);
// Turns every pair (j, j + dim/2) of a K segment's (token t, head) vectors by the angle whose
// cosine is cos[t * dim/2 + j] and sine sin[t * dim/2 + j] (negated when `inverse`: back out of
// the block's frame), k4v3::TurnPairF32 rounded to the dtype. REQUIRES: dim even.
using K4v3TurnFn = void (*)(const SegmentShape& shape, const float* cos, const float* sin,
                            bool inverse, const std::byte* in, std::byte* out);
// A V segment: its row scales and 3-bit codes (payload), or back.
using K4v3ValueEncodeFn = void (*)(const SegmentShape&, const std::byte* in, std::byte* payload);
using K4v3ValueDecodeFn = void (*)(const SegmentShape&, const std::byte* payload, std::byte* out);
// A K segment's decode: int4's decoder of `payload` (the int4 payload after the K header), then
// the turn back out of the block's frame (K4v3TurnFn with `inverse`), the bytes those two give
// (the SIMD paths do both in one pass, rounding to the dtype in between). REQUIRES: dim even.
using K4v3KeyDecodeFn = void (*)(const SegmentShape& shape, const float* cos, const float* sin,
                                 const std::byte* payload, std::byte* out);
struct K4v3Kernels {
  IntNEncodeFn encode_int4;
  K4v3TurnFn turn;
  K4v3ValueEncodeFn encode_value;
  K4v3ValueDecodeFn decode_value;
  K4v3KeyDecodeFn decode_key;
};
void EncodeK4v3(const SegmentShape& shape, const K4v3Rope& rope, const K4v3Kernels& kernels,
                const std::byte* in, std::byte* payload);
void DecodeK4v3(const SegmentShape& shape, const K4v3Kernels& kernels, const std::byte* payload,
                std::byte* out);
// The scalar k4v3 kernels (the reference), and the AVX2 ones (simd_avx2.cc; only call when
// CpuHasAvx2(); dims they do not take whole vectors of go to the scalar ones).
void TurnK4v3Scalar(const SegmentShape& shape, const float* cos, const float* sin, bool inverse,
                    const std::byte* in, std::byte* out);
void EncodeK4v3ValueScalar(const SegmentShape& shape, const std::byte* in, std::byte* payload);
void DecodeK4v3ValueScalar(const SegmentShape& shape, const std::byte* payload, std::byte* out);
void DecodeK4v3KeyScalar(const SegmentShape& shape, const float* cos, const float* sin,
                         const std::byte* payload, std::byte* out);
void TurnK4v3Avx2(const SegmentShape& shape, const float* cos, const float* sin, bool inverse,
                  const std::byte* in, std::byte* out);
void EncodeK4v3ValueAvx2(const SegmentShape& shape, const std::byte* in, std::byte* payload);
void DecodeK4v3ValueAvx2(const SegmentShape& shape, const std::byte* payload, std::byte* out);
void DecodeK4v3KeyAvx2(const SegmentShape& shape, const float* cos, const float* sin,
                       const std::byte* payload, std::byte* out);
// The AVX-512 ones (simd_avx512.cc; only call when CpuHasAvx512(); the dims they do not take
// whole 16-lane vectors of go to the AVX2 ones).
void TurnK4v3Avx512(const SegmentShape& shape, const float* cos, const float* sin, bool inverse,
                    const std::byte* in, std::byte* out);
void EncodeK4v3ValueAvx512(const SegmentShape& shape, const std::byte* in, std::byte* payload);
void DecodeK4v3ValueAvx512(const SegmentShape& shape, const std::byte* payload, std::byte* out);
void DecodeK4v3KeyAvx512(const SegmentShape& shape, const float* cos, const float* sin,
                         const std::byte* payload, std::byte* out);
absl::Status ValidateK4v3(const SegmentShape& shape, const std::byte* payload);

// ---- ISA isolation of the SIMD paths. simd_avx2.cc and simd_avx512.cc are compiled with
// -mavx2/-mavx512*; they must not emit link-once copies of inline functions of shared headers
// (such as the inline helpers above): the linker may pick any copy, also for scalar callers, and
// an AVX-512 copy would fault on a CPU without it. So each SIMD file computes its per-group
// scales with vector code of its own (internal linkage) that performs the scalar helpers'
// operations lane by lane, and calls nothing inline from here. kernels_simd_isolation_test checks
// the SIMD objects define no such symbol.

// ---- CPU features (kernels/internal/cpu_features.cc, compiled for the baseline ISA).
// AVX2 + F16C usable.
bool CpuHasAvx2();
// BMI2 usable (the lossless codec's fast build; the SIMD paths use it when present).
bool CpuHasBmi2();
// AVX-512 F + BW + VL usable (and CpuHasAvx2()): the CPUID bits, and the OS saves the opmask and
// zmm state (XCR0 read with xgetbv).
bool CpuHasAvx512();
// The AVX-512 decision from raw CPUID leaf 1 ECX, leaf 7 (subleaf 0) EBX and XCR0 (0 when
// OSXSAVE is clear); CpuHasAvx512() applies it to this CPU. Exposed for tests.
bool Avx512Usable(uint32_t leaf1_ecx, uint32_t leaf7_ebx, uint64_t xcr0);

// ---- AVX2 + F16C fast path (kernels/internal/simd_avx2.cc). Only call when CpuHasAvx2().
// Segments whose head_dim is not a multiple of 8 take the scalar path.
void EncodeFp8Avx2(const SegmentShape& shape, const std::byte* in, std::byte* payload);
void DecodeFp8Avx2(const SegmentShape& shape, const std::byte* payload, std::byte* out);
void EncodeInt8Avx2(const SegmentShape& shape, const std::byte* in, std::byte* payload);
void DecodeInt8Avx2(const SegmentShape& shape, const std::byte* payload, std::byte* out);
void EncodeIntNAvx2(const SegmentShape& shape, uint32_t bits, const std::byte* in,
                    std::byte* payload);
void DecodeIntNAvx2(const SegmentShape& shape, uint32_t bits, const std::byte* payload,
                    std::byte* out);

// ---- AVX-512 (F + BW + VL) fast path, 16 lanes (kernels/internal/simd_avx512.cc). Only call
// when CpuHasAvx512(). Segments whose head_dim is not a multiple of 16 take the AVX2 path.
void EncodeFp8Avx512(const SegmentShape& shape, const std::byte* in, std::byte* payload);
void DecodeFp8Avx512(const SegmentShape& shape, const std::byte* payload, std::byte* out);
void EncodeInt8Avx512(const SegmentShape& shape, const std::byte* in, std::byte* payload);
void DecodeInt8Avx512(const SegmentShape& shape, const std::byte* payload, std::byte* out);
void EncodeIntNAvx512(const SegmentShape& shape, uint32_t bits, const std::byte* in,
                      std::byte* payload);
void DecodeIntNAvx512(const SegmentShape& shape, uint32_t bits, const std::byte* payload,
                      std::byte* out);

}  // namespace proxima::codec::internal

#endif  // PROXIMA_KERNELS_INTERNAL_SEGMENT_CODECS_H_
