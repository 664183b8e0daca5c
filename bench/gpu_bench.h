// Helpers shared by the GPU benchmarks (codec_gpu_bench, crc32c_gpu_bench, kv_layout_bench
// --device=cuda): CUDA error reporting and `--name=value` arguments. Include only where the CUDA
// runtime headers are available.
#ifndef PROXIMA_BENCH_GPU_BENCH_H_
#define PROXIMA_BENCH_GPU_BENCH_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

namespace proxima::bench {

// True on cudaSuccess; otherwise prints "program: what: error" to stderr and returns false.
inline bool CudaOk(cudaError_t err, const char* program, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s: %s\n", program, what, cudaGetErrorString(err));
  return false;
}

// The value of --name=value among the arguments, or `fallback`.
inline std::string Arg(int argc, char** argv, const std::string& name,
                       const std::string& fallback) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--" + name + "=", 0) == 0) return a.substr(name.size() + 3);
  }
  return fallback;
}

}  // namespace proxima::bench

#endif  // PROXIMA_BENCH_GPU_BENCH_H_
