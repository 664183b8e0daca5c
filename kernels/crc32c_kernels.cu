// The batched CRC32C kernels. Pass 1: one warp per chunk (crc32c_math::kChunkBytes, aligned to
// absolute addresses); each lane checksums its kLaneBytes piece with slicing-by-16 tables in
// shared memory. A whole chunk is read in coalesced 512-byte stripes (lane j: bytes 16j..16j+15
// of every stripe) and the lanes combine in a 5-level shuffle tree of table-driven shifts; a
// span's partial first or last chunk is cut into contiguous lane pieces (single bytes at
// unaligned edges, aligned 16-byte loads between), each shifted to the chunk's end and XORed.
// Pass 2: one warp per span folds its chunks' raw CRCs in order (a table-driven shift per
// whole chunk).
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

// Fills t (4 x 256) with the table that shifts by x = x^(8n), using `basis` (32 words of scratch
// shared memory); every thread of the block calls it.
__device__ void BuildShiftTable(uint32_t x, uint32_t* basis, uint32_t (*t)[256]) {
  if (threadIdx.x < 32) basis[threadIdx.x] = m::MulModP(1u << threadIdx.x, x);
  __syncthreads();
  for (uint32_t e = threadIdx.x; e < 1024; e += blockDim.x) {
    t[e / 256][e % 256] = m::ShiftTableEntry(static_cast<int>(e / 256), e % 256, basis);
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads)
    ChunkKernel(const SpanDesc* spans, const uint32_t* chunk_span, uint64_t num_chunks,
                uint32_t* chunk_raw, m::ShiftPowers powers) {
  __shared__ uint32_t tables[m::kTables][256];
  __shared__ uint32_t stripe_shift[4][256];
  __shared__ uint32_t level[m::kLevels][4][256];  // the lane tree's shift tables
  __shared__ uint32_t basis[m::kLevels + 1][32];
  __shared__ uint32_t pow[m::kPowCount];
  const uint32_t tid = threadIdx.x;
  for (uint32_t b = tid; b < 256; b += blockDim.x) tables[0][b] = m::TableEntry0(b);
  if (tid < m::kPowCount) pow[tid] = powers.p[tid];
  for (uint32_t e = tid; e < (m::kLevels + 1) * 32; e += blockDim.x) {
    const uint32_t x = e / 32 < m::kLevels ? powers.p[m::kTreeLog2 + e / 32]
                                           : powers.p[m::kStripeLog2];
    basis[e / 32][e % 32] = m::MulModP(1u << (e % 32), x);
  }
  __syncthreads();
  for (uint32_t e = tid; e < (m::kLevels + 1) * 1024; e += blockDim.x) {
    uint32_t(*t)[256] = e / 1024 < m::kLevels ? level[e / 1024] : stripe_shift;
    t[(e / 256) % 4][e % 256] =
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
      // Whole chunk: coalesced stripes, then a tree of table shifts over the lanes.
      const uint32_t init = lane == 0 && chunk.begin == s.begin ? ~0u : 0u;
      v = m::StripeLaneRaw(chunk.begin, lane, init, tables, stripe_shift);
      for (int l = 0; l < m::kLevels; ++l) {
        const uint32_t right = __shfl_down_sync(0xFFFFFFFFu, v, 1u << l);
        v = m::ShiftByTable(v, level[l]) ^ right;  // meaningful on multiples of 2^(l+1)
      }
    } else {
      // A span's partial first or last chunk: each lane takes a contiguous piece and moves its
      // raw CRC to the chunk's end.
      v = m::LaneShare(s.begin, chunk, lane, tables, pow);
      for (int offset = m::kLanes / 2; offset > 0; offset /= 2) {
        v ^= __shfl_xor_sync(0xFFFFFFFFu, v, offset);
      }
    }
    if (lane == 0) chunk_raw[g] = v;
  }
}

// One warp per span: the lanes load 32 chunk CRCs at a time, and every lane folds them in order
// (the same values, so the warp never diverges); lane 0 writes the result.
__global__ void __launch_bounds__(kThreads)
    CombineKernel(const SpanDesc* spans, uint32_t num_spans, const uint32_t* chunk_raw,
                  uint32_t* crcs, m::ShiftPowers powers) {
  __shared__ uint32_t chunk_shift[4][256];
  __shared__ uint32_t basis[32];
  __shared__ uint32_t pow[m::kPowCount];
  if (threadIdx.x < m::kPowCount) pow[threadIdx.x] = powers.p[threadIdx.x];
  BuildShiftTable(powers.p[m::kPowCount - 1], basis, chunk_shift);
  const uint32_t lane = threadIdx.x % m::kLanes;
  const uint64_t i = uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / m::kLanes;
  if (i >= num_spans) return;  // warp-uniform
  const SpanDesc s = spans[i];
  const uint64_t n = m::NumChunks(s.begin, s.size);
  uint32_t acc = 0;
  for (uint64_t base = 0; base < n; base += m::kLanes) {
    const uint32_t mine = base + lane < n ? chunk_raw[s.first_chunk + base + lane] : 0u;
    const uint32_t count = n - base < m::kLanes ? static_cast<uint32_t>(n - base) : m::kLanes;
    for (uint32_t t = 0; t < count; ++t) {
      const uint32_t v = __shfl_sync(0xFFFFFFFFu, mine, t);
      const uint64_t k = base + t;
      acc = k == 0 ? v : m::FoldChunk(acc, m::ChunkLength(s.begin, s.size, k), v, pow, chunk_shift);
    }
  }
  if (lane == 0) crcs[i] = n == 0 ? 0u : ~acc;
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
  const uint32_t blocks = (num_spans + kWarpsPerBlock - 1) / kWarpsPerBlock;
  CombineKernel<<<blocks, kThreads, 0, stream>>>(spans, num_spans, chunk_raw, crcs, powers);
  return cudaGetLastError();
}

}  // namespace proxima::gpu::crc32c_cuda
