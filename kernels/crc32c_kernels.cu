// The batched CRC32C kernels. Pass 1: one warp per chunk (crc32c_math::kChunkBytes, aligned to
// absolute addresses); each lane checksums its kLaneBytes piece with slicing-by-16 tables in
// shared memory (aligned 16-byte loads in the middle, single bytes at unaligned edges); a whole
// chunk's lanes combine in a 5-level shuffle tree of table-driven shifts, a partial chunk's lanes
// each shift their piece to the chunk's end (ShiftBytes) and XOR. Pass 2: one thread per span
// folds its chunks' raw CRCs in order (Horner; a table-driven shift per whole chunk).
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
  __shared__ uint32_t level[m::kLevels][4][256];  // the lane tree's shift tables
  __shared__ uint32_t basis[m::kLevels][32];
  __shared__ uint32_t pow[m::kPowCount];
  const uint32_t tid = threadIdx.x;
  for (uint32_t b = tid; b < 256; b += blockDim.x) tables[0][b] = m::TableEntry0(b);
  if (tid < m::kPowCount) pow[tid] = powers.p[tid];
  for (uint32_t e = tid; e < m::kLevels * 32; e += blockDim.x) {
    basis[e / 32][e % 32] = m::MulModP(1u << (e % 32), powers.p[m::kLaneLog2 + e / 32]);
  }
  __syncthreads();
  for (uint32_t e = tid; e < m::kLevels * 1024; e += blockDim.x) {
    level[e / 1024][(e / 256) % 4][e % 256] =
        m::ShiftTableEntry(static_cast<int>((e / 256) % 4), e % 256, basis[e / 1024]);
  }
  for (int k = 1; k < m::kTables; ++k) {
    for (uint32_t b = tid; b < 256; b += blockDim.x) {
      tables[k][b] = m::NextTableEntry(tables[k - 1][b], tables[0]);
    }
    __syncthreads();
  }
  const uint32_t lane = tid % m::kLanes;
  const uint64_t warps = uint64_t{gridDim.x} * kWarpsPerBlock;
  for (uint64_t g = uint64_t{blockIdx.x} * kWarpsPerBlock + tid / m::kLanes; g < num_chunks;
       g += warps) {
    const SpanDesc s = spans[chunk_span[g]];
    const m::ByteRange chunk = m::ChunkRange(s.begin, s.size, g - s.first_chunk);
    uint32_t v;
    if (chunk.end - chunk.begin == m::kChunkBytes) {  // warp-uniform
      // Whole chunk: every lane has kLaneBytes; combine the pieces in a tree of table shifts.
      v = m::LaneRaw(s.begin, chunk, lane, tables);
      for (int l = 0; l < m::kLevels; ++l) {
        const uint32_t right = __shfl_down_sync(0xFFFFFFFFu, v, 1u << l);
        v = m::ShiftByTable(v, level[l]) ^ right;  // meaningful on multiples of 2^(l+1)
      }
    } else {
      // A span's partial first or last chunk: each lane moves its piece to the chunk's end.
      v = m::LaneShare(s.begin, chunk, lane, tables, pow);
      for (int offset = m::kLanes / 2; offset > 0; offset /= 2) {
        v ^= __shfl_xor_sync(0xFFFFFFFFu, v, offset);
      }
    }
    if (lane == 0) chunk_raw[g] = v;
  }
}

__global__ void __launch_bounds__(kThreads)
    CombineKernel(const SpanDesc* spans, uint32_t num_spans, const uint32_t* chunk_raw,
                  uint32_t* crcs, m::ShiftPowers powers) {
  __shared__ uint32_t chunk_shift[4][256];
  __shared__ uint32_t basis[32];
  __shared__ uint32_t pow[m::kPowCount];
  const uint32_t tid = threadIdx.x;
  if (tid < 32) basis[tid] = m::MulModP(1u << tid, powers.p[m::kPowCount - 1]);
  if (tid < m::kPowCount) pow[tid] = powers.p[tid];
  __syncthreads();
  for (uint32_t e = tid; e < 1024; e += blockDim.x) {
    chunk_shift[e / 256][e % 256] = m::ShiftTableEntry(static_cast<int>(e / 256), e % 256, basis);
  }
  __syncthreads();
  const uint64_t i = uint64_t{blockIdx.x} * blockDim.x + tid;
  if (i >= num_spans) return;
  const SpanDesc s = spans[i];
  crcs[i] = m::CombineChunks(s.begin, s.size, chunk_raw + s.first_chunk, pow, chunk_shift);
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
