// Helpers shared by the GPU benchmarks (codec_gpu_bench, crc32c_gpu_bench, kv_layout_bench
// --device=cuda): CUDA error reporting, and `--name=value` arguments (bench/args.h). Include only
// where the CUDA runtime headers are available.
#ifndef PROXIMA_BENCH_GPU_BENCH_H_
#define PROXIMA_BENCH_GPU_BENCH_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "bench/args.h"

namespace proxima::bench {

// True on cudaSuccess; otherwise prints "program: what: error" to stderr and returns false.
inline bool CudaOk(cudaError_t err, const char* program, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s: %s\n", program, what, cudaGetErrorString(err));
  return false;
}

}  // namespace proxima::bench

#endif  // PROXIMA_BENCH_GPU_BENCH_H_
