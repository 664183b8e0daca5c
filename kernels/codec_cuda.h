// Batched CUDA encode/decode of STAR-KV blocks: one kernel launch covers every segment of every
// block in the batch. The kernels follow docs/format.md with the same arithmetic as the CPU
// scalar reference (kernels/internal/numeric.h is shared), so decoding gives bytes identical to
// DecodeBlock(), and encoding fp8/int8/int4/int2/raw gives bytes identical to EncodeBlock().
//
// Not on the GPU (kUnimplemented, use the CPU entry points): `lossless` and `k4v3` encode and
// decode.
// `star` encodes on the GPU with one thread per (segment, head) running the CPU algorithm; its
// bytes may differ from the CPU encoder's (docs/format.md allows it), its decode is bit-exact.
// Segments whose head_dim is a multiple of 8 (with 16-byte aligned raw buffers) take the fast
// path of kernels/internal/vec_codec.h: 8 elements per thread, and encode fused per
// (segment, head) in one kernel; others take a per-element path with the same results.
//
// Hostile input: headers, sizes and every metadata value are validated from a host copy of each
// block before any kernel runs; the payload CRC32C is checked on the GPU over the device copy
// that is decoded, and a mismatch fails the call. The kernels address memory only through the
// validated sizes, so no device byte can make them read or write out of bounds.
// Builds without CUDA get these functions too; they return kFailedPrecondition.
// Thread-safety: functions are reentrant; concurrent calls on distinct buffers are safe.
#ifndef PROXIMA_KERNELS_CODEC_CUDA_H_
#define PROXIMA_KERNELS_CODEC_CUDA_H_

#include <cstddef>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "kernels/codec.h"

// The CUDA runtime's stream handle type (cudaStream_t is `CUstream_st*`), declared here so that
// this header compiles without the CUDA toolkit.
struct CUstream_st;

namespace proxima::codec {

// Where the time of one call went, when the caller asks (the `timing` arguments below): the codec
// kernels and the payload CRC pass (its kernels and the upload of its span list), each timed with
// CUDA events around their launches, and the rest of the call's wall time (header and metadata
// validation, building and uploading the segment jobs; for encode also the copy back). Asking
// costs three events.
struct CudaCallTiming {
  double host_ms = 0;
  double kernel_ms = 0;
  double crc_ms = 0;
};

struct CudaDecodeJob {
  std::span<const std::byte> encoded_host;    // the block in host memory (validated here)
  const std::byte* encoded_device = nullptr;  // the same bytes in device memory
  std::byte* raw_device = nullptr;            // RawBytes() bytes of device memory
};

// Validates every block's header and metadata on the host, decodes all of them on `stream`
// (a cudaStream_t; nullptr = the legacy default stream) with their payload CRCs checked on the
// GPU, and waits for the stream: kDataLoss naming the block when a device copy's CRC does not
// match its header (the outputs are then not valid), OK when every output holds its block.
absl::Status DecodeBlocksCuda(std::span<const CudaDecodeJob> jobs, CUstream_st* stream,
                              CudaCallTiming* timing = nullptr);

struct CudaEncodeJob {
  const std::byte* raw_device = nullptr;  // RawBytes() bytes of device memory, canonical layout
  bool is_first_block = false;
  std::string* out = nullptr;  // receives the encoded block (host memory)
  // `star` only: tokens_per_block importance values in device memory, or null for key norms.
  const float* importance_device = nullptr;
};

// Encodes every block with the same geometry and plan on `stream`, computes the payload CRCs on
// the GPU, copies the results back and synchronises the stream. kUnimplemented when the
// plan selects `lossless` or `k4v3` for any segment.
absl::Status EncodeBlocksCuda(const BlockGeometry& geometry, const CodecPlan& plan,
                              std::span<const CudaEncodeJob> jobs, CUstream_st* stream,
                              CudaCallTiming* timing = nullptr);

}  // namespace proxima::codec

#endif  // PROXIMA_KERNELS_CODEC_CUDA_H_
