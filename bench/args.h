// `--name=value` arguments for the benchmarks that take them without absl flags (the GPU
// benchmarks, tierer_bench, gpu_tier_bench). No CUDA headers: benchmarks built without CUDA use
// it too.
#ifndef PROXIMA_BENCH_ARGS_H_
#define PROXIMA_BENCH_ARGS_H_

#include <string>

namespace proxima::bench {

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

#endif  // PROXIMA_BENCH_ARGS_H_
