// Gather/scatter between an engine's paged KV cache (vLLM's: one tensor per layer, blocks of
// `tokens_per_block` tokens, any order of the kv/block/token/head/dim axes) and Proxima's
// canonical block layout [layer][k|v][token][head][dim] (docs/format.md, kernels/codec.h).
//
// The paged tensors are described framework-free, by each tensor's base address and element
// strides, exactly as the engine reports them (torch's data_ptr() and stride()): no shape is
// assumed, so a layout change in the engine needs no change here. K and V may share a tensor
// (a `kv` axis of size 2) or live in two tensors with the same strides.
//
// Every entry point validates its input first and returns kInvalidArgument naming the offending
// value (null pointer, zero dimension, element size, overlapping strides, an extent past the
// tensor's size when the caller gives it, a block id out of range) before touching memory.
//
// CPU: GatherBlocks / ScatterBlocks (memcpy of the longest contiguous run: head_dim elements when
// the dim axis has stride 1, more when heads and tokens follow contiguously; element by element
// otherwise). CUDA: GatherBlocksCuda / ScatterBlocksCuda (kernels/kv_layout_kernels.cu), the
// same semantics on device memory, enqueued on a stream; builds without CUDA return
// kFailedPrecondition from them.
// Thread-safety: functions are reentrant; concurrent calls on distinct destinations are safe.
#ifndef PROXIMA_KERNELS_KV_LAYOUT_H_
#define PROXIMA_KERNELS_KV_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"

// The CUDA runtime's stream handle type (cudaStream_t is `CUstream_st*`), declared here so that
// this header compiles without the CUDA toolkit.
struct CUstream_st;

namespace proxima::kv_layout {

// Element strides of the five logical axes, in elements (not bytes), as torch reports them.
struct AxisStrides {
  int64_t kv = 0;  // ignored when K and V are separate tensors
  int64_t block = 0;
  int64_t token = 0;
  int64_t head = 0;
  int64_t dim = 0;
};

// One layer's paged KV.
struct PagedTensor {
  // Element (kv=0, block=0, token=0, head=0, dim=0): the tensor's data pointer.
  std::byte* data = nullptr;
  // Null: K and V are in `data`, V at `strides.kv` elements from K. Non-null: V is a separate
  // tensor with the same strides, its element (block=0, token=0, head=0, dim=0) here.
  std::byte* v_data = nullptr;
  // Bytes of the allocation from `data` (and from `v_data`); 0 = unknown, not checked.
  size_t size_bytes = 0;
  size_t v_size_bytes = 0;
};

// A paged block id that names no block: in a call, the part of a canonical block it stands for
// is neither read nor written (a gather leaves those canonical bytes as they were; a scatter
// does not write them anywhere). For a canonical block that spans several paged blocks of which
// the engine already holds some (blocks_per_canonical).
inline constexpr uint64_t kNoBlock = ~uint64_t{0};

struct PagedLayout {
  uint32_t element_size = 2;  // bytes: 2 (bf16/fp16), 1 (fp8), 4 (fp32)
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t tokens_per_block = 0;
  uint64_t num_blocks = 0;  // blocks in each paged tensor: valid ids are [0, num_blocks)
  AxisStrides strides;      // shared by every layer (vLLM allocates them alike)
  std::vector<PagedTensor> layers;
  // Paged blocks per canonical block, n >= 1: canonical block i is made of the paged blocks
  // block_ids[i * n], ..., block_ids[i * n + n - 1] of a call, its tokens
  // n * tokens_per_block long, token t of the j-th of them at canonical token
  // j * tokens_per_block + t. An engine's small pages (vLLM's 16 tokens) stored as one larger
  // Proxima block, whose codec metadata weighs less per token.
  uint32_t blocks_per_canonical = 1;

  // Bytes of one canonical block: 2 * layers * blocks_per_canonical * tokens_per_block *
  // num_kv_heads * head_dim * element_size.
  size_t BlockBytes() const;
  // OK when every field is usable: non-zero dimensions, element size 1, 2 or 4, non-negative
  // strides with no two (kv, block, token, head, dim) positions on the same element, non-null
  // data pointers, every addressed element inside size_bytes when it is given, and K and V
  // tensors that do not overlap when separate.
  absl::Status Validate() const;
};

// Copies the paged blocks of every layer into canonical blocks (BlockBytes() bytes each):
// `dst_blocks[i]` gets block_ids[i * n .. i * n + n - 1] (n = blocks_per_canonical; n = 1: block
// `block_ids[i]`). Validates the layout, the ids (< num_blocks, or kNoBlock), their count
// (dst_blocks.size() * n) and the pointers first.
absl::Status GatherBlocks(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                          std::span<std::byte* const> dst_blocks);
// The reverse: canonical `src_blocks[i]` into its paged blocks of every layer. Ids other than
// kNoBlock must be distinct (two writes to one block would race on the GPU and be
// order-dependent here).
absl::Status ScatterBlocks(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                           std::span<const std::byte* const> src_blocks);

// The same with the canonical blocks back to back in one buffer: block i at i * BlockBytes(),
// block_ids.size() / n of them. kInvalidArgument when the buffer is smaller.
absl::Status GatherBlocksToBuffer(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                                  std::span<std::byte> dst);
absl::Status ScatterBlocksFromBuffer(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                                     std::span<const std::byte> src);

// The same on the GPU: `data`/`v_data` and the block pointers are device-accessible addresses
// (device memory, or page-locked host memory under unified addressing). Validation is done on
// the host; the copy is enqueued on `stream` (nullptr = legacy default stream) and the call
// returns without synchronising. kFailedPrecondition in builds without CUDA.
absl::Status GatherBlocksCuda(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                              std::span<std::byte* const> dst_blocks, CUstream_st* stream);
absl::Status ScatterBlocksCuda(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                               std::span<const std::byte* const> src_blocks, CUstream_st* stream);

// Whether the *Cuda entry points were built: gpu::BuiltWithCuda() (kernels/device.h).

namespace internal {
// Checks shared by the CPU and CUDA paths: the layout, the ids and their count, the pointers,
// distinct ids for scatter.
absl::Status ValidateCall(const PagedLayout& layout, std::span<const uint64_t> block_ids,
                          std::span<const std::byte* const> blocks, bool scatter);
// Bytes of one (layer, K|V) segment of one paged block: tokens_per_block * num_kv_heads *
// head_dim * element_size.
size_t SegmentBytes(const PagedLayout& layout);
// Where segment (layer, kv) of the `part`-th paged block of a canonical block starts in it.
std::byte* CanonicalSegment(const PagedLayout& layout, std::byte* canonical, size_t layer, int kv,
                            uint32_t part);
// Elements, in canonical [token][head][dim] order, that are contiguous in the paged tensor from
// every (token, head, 0) run start: head_dim when the dim stride is 1, times num_kv_heads when
// heads follow contiguously, times tokens_per_block when tokens do too; 1 otherwise.
uint64_t ContiguousRun(const PagedLayout& layout);
// Byte address of segment (layer, kv) of block `block_id`: element (token=0, head=0, dim=0).
std::byte* SegmentBase(const PagedLayout& layout, size_t layer, int kv, uint64_t block_id);
}  // namespace internal

}  // namespace proxima::kv_layout

#endif  // PROXIMA_KERNELS_KV_LAYOUT_H_
