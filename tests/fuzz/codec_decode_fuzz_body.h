// The body of the codec_decode fuzz target, shared by the libFuzzer harness and by the unit
// test that replays the checked-in corpus in ordinary builds.
//
// Input: one mode byte, then a candidate block. Odd mode: the CRC fields are recomputed first,
// so mutations reach the segment decoders instead of stopping at the checksum. The decoder
// must return an error or decode, and every CPU path this machine runs (scalar, AVX2, AVX-512)
// must agree with the scalar reference: all fail, or all decode to identical bytes.
// Thread-safety: pure.
#ifndef PROXIMA_TESTS_FUZZ_CODEC_DECODE_FUZZ_BODY_H_
#define PROXIMA_TESTS_FUZZ_CODEC_DECODE_FUZZ_BODY_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/codec.h"
#include "kernels/internal/container.h"

namespace proxima::codec::fuzz {

// Decoded size above which an input is skipped (keeps the fuzzer's memory bounded; the size
// checks themselves are exercised all the same by InspectBlock).
inline constexpr size_t kMaxFuzzRawBytes = size_t{16} << 20;

// Returns true when the input decoded successfully.
inline bool RunCodecDecodeInput(const uint8_t* data, size_t size) {
  if (size < 1) return false;
  std::vector<std::byte> block(size - 1);
  if (size > 1) std::memcpy(block.data(), data + 1, size - 1);
  if (data[0] & 1) internal::ResealBlockForFuzzing(block);
  absl::StatusOr<BlockHeaderInfo> info = InspectBlock(block);
  if (!info.ok() || info->raw_bytes > kMaxFuzzRawBytes) return false;
  std::vector<std::byte> scalar(info->raw_bytes), simd(info->raw_bytes);
  const bool ok_scalar = DecodeBlockWithPath(CpuPath::kScalar, block, scalar).ok();
  for (CpuPath path : {CpuPath::kAvx2, CpuPath::kAvx512}) {
    if (!CpuPathAvailable(path)) continue;
    std::fill(simd.begin(), simd.end(), std::byte{0});
    const bool ok = DecodeBlockWithPath(path, block, simd).ok();
    if (ok != ok_scalar || (ok && simd != scalar)) std::abort();  // paths disagree
  }
  return ok_scalar;
}

}  // namespace proxima::codec::fuzz

#endif  // PROXIMA_TESTS_FUZZ_CODEC_DECODE_FUZZ_BODY_H_
