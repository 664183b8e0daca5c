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

// `max_elements`: the largest SegmentJob::elements in `jobs`.
cudaError_t LaunchDecodeSegments(const internal::SegmentJob* jobs, uint32_t num_jobs,
                                 uint64_t max_elements, uint8_t dtype, cudaStream_t stream);
// Statistics pass then quantisation pass; `max_groups`/`max_units` as above.
cudaError_t LaunchEncodeSegments(const internal::SegmentJob* jobs, uint32_t num_jobs,
                                 uint64_t max_groups, uint64_t max_units, uint8_t dtype,
                                 cudaStream_t stream);

}  // namespace proxima::codec::cuda

#endif  // PROXIMA_KERNELS_INTERNAL_CODEC_LAUNCH_H_
