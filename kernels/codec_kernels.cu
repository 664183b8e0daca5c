// Launchers for the STAR-KV kernels (device code in kernels/codec_kernels.cuh).
#include <algorithm>

#include "kernels/codec_kernels.cuh"
#include "kernels/dtype_dispatch.h"
#include "kernels/internal/codec_launch.h"

namespace proxima::codec::cuda {
namespace {

// grid.y cap: enough blocks to fill a large GPU many times over, far below the 65535 limit.
constexpr uint64_t kMaxBlocksPerJob = 4096;

dim3 Grid(uint32_t num_jobs, uint64_t max_work) {
  uint64_t y = std::min<uint64_t>(kMaxBlocksPerJob,
                                  std::max<uint64_t>(1, (max_work + kThreads - 1) / kThreads));
  return dim3(num_jobs, static_cast<uint32_t>(y));
}

template <uint8_t kDt>
cudaError_t LaunchDecodeRun(const internal::SegmentJob* jobs, const DecodeRun& run,
                            cudaStream_t stream) {
  if (run.count == 0) return cudaSuccess;
  jobs += run.first;
  if (!run.vec) {
    DecodeSegmentsKernel<kDt><<<Grid(run.count, run.max_work), kThreads, 0, stream>>>(jobs);
    return cudaGetLastError();
  }
  // Fast-path threads take kDecodeVecsPerThread vecs per round.
  const dim3 grid = Grid(run.count, (run.max_work + kDecodeVecsPerThread - 1) / kDecodeVecsPerThread);
  switch (run.codec) {
    case vec::kRaw:
      DecodeVecsKernel<kDt, vec::kRaw><<<grid, kThreads, 0, stream>>>(jobs);
      break;
    case vec::kFp8:
      DecodeVecsKernel<kDt, vec::kFp8><<<grid, kThreads, 0, stream>>>(jobs);
      break;
    case vec::kInt8:
      DecodeVecsKernel<kDt, vec::kInt8><<<grid, kThreads, 0, stream>>>(jobs);
      break;
    case vec::kInt4:
      DecodeVecsKernel<kDt, vec::kInt4><<<grid, kThreads, 0, stream>>>(jobs);
      break;
    case vec::kInt2:
      DecodeVecsKernel<kDt, vec::kInt2><<<grid, kThreads, 0, stream>>>(jobs);
      break;
    case vec::kStar:
      DecodeVecsKernel<kDt, vec::kStar><<<grid, kThreads, 0, stream>>>(jobs);
      break;
    default:
      return cudaErrorInvalidValue;  // the host builds runs only of these codecs
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchDecodeSegments(const internal::SegmentJob* jobs, const DecodeRun* runs,
                                 uint32_t num_runs, uint8_t dtype, cudaStream_t stream) {
  for (uint32_t r = 0; r < num_runs; ++r) {
    cudaError_t err = cudaSuccess;
    PROXIMA_DISPATCH_DTYPE(dtype, kDt, return cudaErrorInvalidValue,
                           { err = LaunchDecodeRun<kDt>(jobs, runs[r], stream); });
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t LaunchEncodeSegments(const internal::SegmentJob* jobs, uint32_t num_jobs,
                                 const EncodeLaunch& launch, uint8_t dtype, cudaStream_t stream) {
  if (num_jobs == 0) return cudaSuccess;
  PROXIMA_DISPATCH_DTYPE(dtype, kDt, return cudaErrorInvalidValue, {
    if (launch.fused_heads > 0) {
      EncodeHeadsKernel<kDt><<<dim3(num_jobs, launch.fused_heads), kThreads,
                               launch.fused_smem_bytes, stream>>>(jobs);
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    if (launch.max_groups > 0 || launch.max_units > 0) {
      EncodeGroupsKernel<kDt><<<Grid(num_jobs, launch.max_groups), kThreads, 0, stream>>>(jobs);
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      EncodeUnitsKernel<kDt><<<Grid(num_jobs, launch.max_units), kThreads, 0, stream>>>(jobs);
    }
  });
  return cudaGetLastError();
}

cudaError_t LaunchK4v3(const internal::SegmentJob* jobs, uint32_t num_jobs, uint64_t max_threads,
                       K4v3Step step, uint8_t dtype, cudaStream_t stream) {
  if (num_jobs == 0) return cudaSuccess;
  const dim3 grid = Grid(num_jobs, max_threads);
  PROXIMA_DISPATCH_DTYPE(dtype, kDt, return cudaErrorInvalidValue, {
    switch (step) {
      case K4v3Step::kTurnIn:
        K4v3TurnKernel<kDt, false><<<grid, kThreads, 0, stream>>>(jobs);
        break;
      case K4v3Step::kTurnBack:
        K4v3TurnKernel<kDt, true><<<grid, kThreads, 0, stream>>>(jobs);
        break;
      case K4v3Step::kEncodeValues:
        K4v3ValuesKernel<kDt, true><<<grid, kThreads, 0, stream>>>(jobs);
        break;
      case K4v3Step::kDecodeValues:
        K4v3ValuesKernel<kDt, false><<<grid, kThreads, 0, stream>>>(jobs);
        break;
    }
  });
  return cudaGetLastError();
}

}  // namespace proxima::codec::cuda
