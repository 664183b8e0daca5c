// Launchers of the STAR-KV CUDA kernels (kernels/codec_kernels.cu), for the host wrapper.
// `jobs` is a device array of `num_jobs` SegmentJob, all of one dtype; one launch covers them
// all. They enqueue on `stream` and return the launch error; they never synchronise.
// Thread-safety: callable from any host thread (the CUDA runtime serialises per stream).
#ifndef PROXIMA_KERNELS_INTERNAL_CODEC_LAUNCH_H_
#define PROXIMA_KERNELS_INTERNAL_CODEC_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/internal/segment_job.h"

namespace proxima::codec::cuda {

// Largest dynamic shared memory the fused encode path asks for (the default per-block limit).
inline constexpr uint32_t kMaxFusedSmemBytes = 48 * 1024;

// A run of decode jobs that one launch covers: jobs[first, first + count) of the device array,
// all `vec` jobs of `codec` (the fast path, a kernel instantiated for that codec) or all per-element
// jobs (vec == 0, any codec). `max_work`: the largest per-job count of work items of the run:
// elements / 8 for `vec` jobs, elements otherwise.
struct DecodeRun {
  uint32_t first = 0, count = 0;
  uint8_t vec = 0, codec = 0;
  uint64_t max_work = 0;
};
// One launch per run; `jobs` holds every run's jobs, all of `dtype`.
cudaError_t LaunchDecodeSegments(const internal::SegmentJob* jobs, const DecodeRun* runs,
                                 uint32_t num_runs, uint8_t dtype, cudaStream_t stream);

struct EncodeLaunch {
  // The fused path (`vec` jobs): the most heads of any such job (0: none) and the dynamic shared
  // memory it needs, at most kMaxFusedSmemBytes (4 * the largest StatsWords).
  uint32_t fused_heads = 0;
  uint32_t fused_smem_bytes = 0;
  // The per-element path (other jobs): largest groups and units of those jobs (both 0: none).
  uint64_t max_groups = 0, max_units = 0;
};
// Fused kernel for `vec` jobs, then statistics and quantisation passes for the others.
cudaError_t LaunchEncodeSegments(const internal::SegmentJob* jobs, uint32_t num_jobs,
                                 const EncodeLaunch& launch, uint8_t dtype, cudaStream_t stream);

// k4v3 (kernels/internal/k4v3_math.h), over jobs of internal::MakeK4v3Jobs: the K jobs' turn into
// the block's frame (before int4's encode kernels), or back (after int4's decode kernels); or the
// V jobs' rows. `max_threads`: the most threads a job needs (K4v3Batch in kernels/codec_cuda.cc).
enum class K4v3Step : uint8_t { kTurnIn, kTurnBack, kEncodeValues, kDecodeValues };
cudaError_t LaunchK4v3(const internal::SegmentJob* jobs, uint32_t num_jobs, uint64_t max_threads,
                       K4v3Step step, uint8_t dtype, cudaStream_t stream);

}  // namespace proxima::codec::cuda

#endif  // PROXIMA_KERNELS_INTERNAL_CODEC_LAUNCH_H_
