// Container constants, the plan rules every encoder applies, and a test/fuzz hook. Internal to
// kernels/; the format is docs/format.md. Thread-safety: constants and pure functions (one writes
// caller-owned memory).
#ifndef PROXIMA_KERNELS_INTERNAL_CONTAINER_H_
#define PROXIMA_KERNELS_INTERNAL_CONTAINER_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "kernels/codec.h"

namespace proxima::codec::internal {

inline constexpr char kBlockMagic[8] = {'P', 'X', 'S', 'T', 'A', 'R', 'K', 'V'};
inline constexpr uint16_t kFormatVersion = 1;
inline constexpr size_t kHeaderBytes = 48;
inline constexpr size_t kSegmentEntryBytes = 16;
inline constexpr size_t kHeaderCrcOffset = 40;
inline constexpr size_t kPayloadCrcOffset = 44;
inline constexpr uint32_t kMaxDim = 1024;
inline constexpr uint32_t kMaxTokens = 65536;
inline constexpr size_t kMaxRawBytes = size_t{1} << 30;

// Codecs whose segment table entries carry a group size (k4v3: both segments; its V ignores it).
bool IsGroupedCodec(CodecId c);

// What every encoder (CPU and CUDA) needs of a plan: a group size of 32, 64 or 128. (Every codec
// takes every geometry that Validate() takes.)
absl::Status ValidPlan(const CodecPlan& plan);

// Recomputes both CRC fields of `block` in place when it is long enough to hold the header and
// the segment table its header claims (otherwise leaves it alone). Lets the fuzzer reach the
// payload decoders past the CRC check; never used on the production path.
void ResealBlockForFuzzing(std::span<std::byte> block);

}  // namespace proxima::codec::internal

#endif  // PROXIMA_KERNELS_INTERNAL_CONTAINER_H_
