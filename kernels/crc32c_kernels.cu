// The batched CRC32C kernels. Pass 1: one warp per chunk (crc32c_math::kChunkBytes, aligned to
// absolute addresses); each lane checksums its kLaneBytes piece with slicing-by-16 tables in
// shared memory (aligned 16-byte loads in the middle, single bytes at unaligned edges), moves
// it to the chunk's end with the shift operator, and the warp XORs the shares. Pass 2: one thread
// per span folds its chunks' raw CRCs in order (Horner with the shift operator).
#include <algorithm>

#include "kernels/internal/crc32c_launch.h"
#include "kernels/internal/crc32c_math.h"

namespace proxima::gpu::crc32c_cuda {
namespace {

namespace m = ::proxima::gpu::crc32c_math;

constexpr uint32_t kThreads = 256;  // 8 warps per block
constexpr uint32_t kWarpsPerBlock = kThreads / m::kLanes;

// Pass 1's grid: as many blocks as fit on the device at once (each builds its tables once and
// then loops over chunks), fewer when the batch has fewer chunks.
uint64_t ChunkBlocks(uint64_t num_chunks, const void* kernel) {
  const uint64_t wanted = (num_chunks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess ||
      sms <= 0 || per_sm <= 0) {
    cudaGetLastError();  // clear it: the launch reports its own errors
    return std::min<uint64_t>(wanted, 1024);
  }
  return std::min<uint64_t>(wanted, uint64_t{static_cast<uint32_t>(sms)} * per_sm);
}

__global__ void __launch_bounds__(kThreads)
    ChunkKernel(const SpanDesc* spans, const uint32_t* chunk_span, uint64_t num_chunks,
                uint32_t* chunk_raw, m::ShiftPowers powers) {
  __shared__ uint32_t tables[m::kTables][256];
  __shared__ uint32_t pow[m::kPowCount];
  for (uint32_t b = threadIdx.x; b < 256; b += blockDim.x) tables[0][b] = m::TableEntry0(b);
  if (threadIdx.x < m::kPowCount) pow[threadIdx.x] = powers.p[threadIdx.x];
  __syncthreads();
  for (int k = 1; k < m::kTables; ++k) {
    for (uint32_t b = threadIdx.x; b < 256; b += blockDim.x) {
      tables[k][b] = m::NextTableEntry(tables[k - 1][b], tables[0]);
    }
    __syncthreads();
  }
  const uint32_t lane = threadIdx.x % m::kLanes;
  const uint64_t warps = uint64_t{gridDim.x} * kWarpsPerBlock;
  for (uint64_t g = uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / m::kLanes;
       g < num_chunks; g += warps) {
    const SpanDesc s = spans[chunk_span[g]];
    const m::ByteRange chunk = m::ChunkRange(s.begin, s.size, g - s.first_chunk);
    uint32_t share = m::LaneShare(s.begin, chunk, lane, tables, pow);
    for (int offset = m::kLanes / 2; offset > 0; offset /= 2) {
      share ^= __shfl_xor_sync(0xFFFFFFFFu, share, offset);
    }
    if (lane == 0) chunk_raw[g] = share;
  }
}

__global__ void CombineKernel(const SpanDesc* spans, uint32_t num_spans,
                              const uint32_t* chunk_raw, uint32_t* crcs, m::ShiftPowers powers) {
  const uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= num_spans) return;
  const SpanDesc s = spans[i];
  crcs[i] = m::CombineChunks(s.begin, s.size, chunk_raw + s.first_chunk, powers.p);
}

}  // namespace

cudaError_t LaunchCrc32cBatch(const SpanDesc* spans, uint32_t num_spans, const uint32_t* chunk_span,
                              uint64_t num_chunks, uint32_t* chunk_raw, uint32_t* crcs,
                              const m::ShiftPowers& powers, cudaStream_t stream) {
  if (num_spans == 0) return cudaSuccess;
  if (num_chunks > 0) {
    const uint64_t blocks = ChunkBlocks(num_chunks, reinterpret_cast<const void*>(&ChunkKernel));
    ChunkKernel<<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(spans, chunk_span,
                                                                        num_chunks, chunk_raw,
                                                                        powers);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const uint32_t blocks = (num_spans + kThreads - 1) / kThreads;
  CombineKernel<<<blocks, kThreads, 0, stream>>>(spans, num_spans, chunk_raw, crcs, powers);
  return cudaGetLastError();
}

}  // namespace proxima::gpu::crc32c_cuda
