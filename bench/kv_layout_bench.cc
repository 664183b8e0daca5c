// Paged-KV gather/scatter (kernels/kv_layout.h) throughput against a copy of the same bytes
// measured in the same run, for the layouts vLLM uses: the CPU path against memcpy, or with
// --device=cuda the CUDA kernels against a device-to-device cudaMemcpy (paged tensors and
// canonical blocks both in device memory).
//
//   kv_layout_bench [--device=cpu|cuda] [--layers=32] [--heads=8] [--head_dim=128] [--tokens=16]
//                   [--num_blocks=128] [--batch=32] [--min_time_s=0.3] [--rounds=3]
//
// Defaults: a Llama-3-8B-like bf16 cache (2 MiB canonical blocks), 128 paged blocks per layer
// (256 MiB of paged tensors) and 32 random distinct blocks per call (64 MiB), so every call runs
// out of cache. Output: JSON lines {metric, value, unit, baseline, ratio, layout, path}; value
// and baseline in GB/s (1e9 bytes of canonical block per second), measured in this thread's CPU
// time, one thread, the best of `rounds` rounds that alternate memcpy, gather and scatter. On
// CUDA, each figure is timed with CUDA events over 20 calls after a warm-up, the best of `rounds`;
// without a visible GPU it prints one line saying so and exits 0.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/timing.h"
#include "kernels/device.h"
#include "kernels/internal/kv_layout_testing.h"
#include "kernels/kv_layout.h"

#if PROXIMA_WITH_CUDA
#include <cuda_runtime_api.h>

#include "bench/gpu_bench.h"
#endif

namespace proxima::kv_layout {
namespace {

using bench::TimePerCall;
using testing::kBlock;
using testing::kDim;
using testing::kHead;
using testing::kKv;
using testing::kToken;

struct Options {
  uint32_t layers = 32, heads = 8, head_dim = 128, tokens = 16;
  uint64_t num_blocks = 128;
  size_t batch = 32;
  double min_time_s = 0.3;
  int rounds = 3;
  bool cuda = false;
};

bool Flag(const char* arg, const char* name, double* value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  *value = std::strtod(arg + n + 1, nullptr);
  return true;
}

void Emit(const char* metric, double value, double baseline, const std::string& layout,
          const char* path) {
  std::printf(
      "{\"metric\":\"%s\",\"value\":%.4g,\"unit\":\"GB/s\",\"baseline\":%.4g,\"ratio\":%.3f,"
      "\"layout\":\"%s\",\"path\":\"%s\"}\n",
      metric, value, baseline, value / baseline, layout.c_str(), path);
  std::fflush(stdout);
}

struct Case {
  const char* name;
  std::vector<int> order;
  bool separate = false;
  int64_t dim_stride = 1;
};
const std::vector<Case>& Cases() {
  static const std::vector<Case> cases = {
      {"nhd_kv_first", {kKv, kBlock, kToken, kHead, kDim}},     // FlashAttention
      {"nhd_block_first", {kBlock, kKv, kToken, kHead, kDim}},  // FlashInfer NHD
      {"hnd_kv_first", {kKv, kBlock, kHead, kToken, kDim}},     // HND, CPU attention
      {"hnd_block_first", {kBlock, kKv, kHead, kToken, kDim}},  // FlashInfer HND
      {"nhd_separate_kv", {kKv, kBlock, kToken, kHead, kDim}, true},
      {"strided_dim", {kKv, kBlock, kToken, kHead, kDim}, false, 2},  // general path
  };
  return cases;
}

testing::Spec SpecFor(const Options& o, const Case& c) {
  testing::Spec s;
  s.layers = o.layers;
  s.heads = o.heads;
  s.head_dim = o.head_dim;
  s.tokens = o.tokens;
  s.num_blocks = o.num_blocks;
  s.order = c.order;
  s.separate_kv = c.separate;
  s.dim_stride = c.dim_stride;
  return s;
}

// `batch` distinct random block ids out of num_blocks.
std::vector<uint64_t> BlockIds(const Options& o) {
  std::mt19937_64 rng(1);
  std::vector<uint64_t> ids(o.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(std::min<size_t>(o.batch, ids.size()));
  return ids;
}

#if PROXIMA_WITH_CUDA
bool CudaOk(cudaError_t err, const char* what) {
  return bench::CudaOk(err, "kv_layout_bench", what);
}

int RunCuda(const Options& o) {
  const std::vector<uint64_t> ids = BlockIds(o);
  cudaEvent_t start, stop;
  if (!CudaOk(cudaEventCreate(&start), "cudaEventCreate") ||
      !CudaOk(cudaEventCreate(&stop), "cudaEventCreate")) {
    return 1;
  }
  // Milliseconds per call of `enqueue`, the best of o.rounds rounds of 20 calls after a warm-up.
  auto time_ms = [&](auto&& enqueue) {
    enqueue();
    cudaDeviceSynchronize();
    float best = 0;
    for (int round = 0; round < o.rounds; ++round) {
      cudaEventRecord(start);
      for (int i = 0; i < 20; ++i) enqueue();
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      if (round == 0 || ms < best) best = ms;
    }
    return best / 20;
  };
  for (const Case& c : Cases()) {
    testing::PagedKv kv(SpecFor(o, c));
    PagedLayout layout = kv.layout;
    std::vector<void*> device;  // every cudaMalloc of this case, freed at its end
    auto alloc = [&](size_t bytes) -> std::byte* {
      void* p = nullptr;
      if (!CudaOk(cudaMalloc(&p, bytes), "cudaMalloc")) return nullptr;
      device.push_back(p);
      return static_cast<std::byte*>(p);
    };
    const size_t per_layer = c.separate ? 2 : 1;
    bool ok = true;
    for (size_t i = 0; i < kv.buffers.size() && ok; ++i) {
      std::byte* d = alloc(kv.buffers[i].size());
      ok = d != nullptr &&
           CudaOk(cudaMemcpy(d, kv.buffers[i].data(), kv.buffers[i].size(), cudaMemcpyHostToDevice),
                  "cudaMemcpy");
      if (!ok) break;
      PagedTensor& t = layout.layers[i / per_layer];
      (i % per_layer == 0 ? t.data : t.v_data) = d;
    }
    const size_t bb = layout.BlockBytes();
    std::byte* canonical = ok ? alloc(ids.size() * bb) : nullptr;
    std::byte* copy = canonical != nullptr ? alloc(ids.size() * bb) : nullptr;
    if (copy == nullptr) return 1;
    std::vector<std::byte*> dst;
    for (size_t i = 0; i < ids.size(); ++i) dst.push_back(canonical + i * bb);
    std::vector<const std::byte*> src(dst.begin(), dst.end());
    absl::Status st;
    const double gb = static_cast<double>(ids.size() * bb) / 1e9;
    const double copy_ms = time_ms(
        [&] { cudaMemcpyAsync(copy, canonical, ids.size() * bb, cudaMemcpyDeviceToDevice); });
    const double gather_ms =
        time_ms([&] { st.Update(GatherBlocksCuda(layout, ids, dst, nullptr)); });
    const double scatter_ms =
        time_ms([&] { st.Update(ScatterBlocksCuda(layout, ids, src, nullptr)); });
    const bool launched = CudaOk(cudaDeviceSynchronize(), c.name);
    for (void* p : device) cudaFree(p);
    if (!st.ok() || !launched) {
      std::fprintf(stderr, "%s: %s\n", c.name, st.ToString().c_str());
      return 1;
    }
    const double copy_gbps = gb / (copy_ms * 1e-3);
    Emit("gather", gb / (gather_ms * 1e-3), copy_gbps, c.name, "cuda");
    Emit("scatter", gb / (scatter_ms * 1e-3), copy_gbps, c.name, "cuda");
  }
  return 0;
}
#endif

int Run(const Options& o) {
  const std::vector<uint64_t> ids = BlockIds(o);
  for (const Case& c : Cases()) {
    testing::PagedKv kv(SpecFor(o, c));
    const size_t bb = kv.layout.BlockBytes();
    std::vector<std::byte> canonical(ids.size() * bb), copy(ids.size() * bb);
    std::vector<std::byte*> dst;
    for (size_t i = 0; i < ids.size(); ++i) dst.push_back(canonical.data() + i * bb);
    std::vector<const std::byte*> src(dst.begin(), dst.end());
    const double gb = static_cast<double>(ids.size() * bb) / 1e9;
    // Rounds alternate memcpy, gather and scatter, and each keeps its best round: on a shared
    // machine the other load then weighs on the three alike.
    absl::Status st;
    double memcpy_gbps = 0, gather_gbps = 0, scatter_gbps = 0;
    for (int round = 0; round < o.rounds; ++round) {
      memcpy_gbps =
          std::max(memcpy_gbps, gb / TimePerCall(o.min_time_s, true, [&] {
                                  std::memcpy(copy.data(), canonical.data(), canonical.size());
                                }));
      gather_gbps = std::max(gather_gbps, gb / TimePerCall(o.min_time_s, true, [&] {
                                            st.Update(GatherBlocks(kv.layout, ids, dst));
                                          }));
      scatter_gbps = std::max(scatter_gbps, gb / TimePerCall(o.min_time_s, true, [&] {
                                              st.Update(ScatterBlocks(kv.layout, ids, src));
                                            }));
    }
    if (!st.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.name, st.ToString().c_str());
      return 1;
    }
    Emit("gather", gather_gbps, memcpy_gbps, c.name, "cpu");
    Emit("scatter", scatter_gbps, memcpy_gbps, c.name, "cpu");
  }
  return 0;
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    double v = 0;
    if (Flag(argv[i], "--layers", &v)) {
      o.layers = static_cast<uint32_t>(v);
    } else if (Flag(argv[i], "--heads", &v)) {
      o.heads = static_cast<uint32_t>(v);
    } else if (Flag(argv[i], "--head_dim", &v)) {
      o.head_dim = static_cast<uint32_t>(v);
    } else if (Flag(argv[i], "--tokens", &v)) {
      o.tokens = static_cast<uint32_t>(v);
    } else if (Flag(argv[i], "--num_blocks", &v)) {
      o.num_blocks = static_cast<uint64_t>(v);
    } else if (Flag(argv[i], "--batch", &v)) {
      o.batch = static_cast<size_t>(v);
    } else if (Flag(argv[i], "--min_time_s", &v)) {
      o.min_time_s = v;
    } else if (Flag(argv[i], "--rounds", &v)) {
      o.rounds = std::max(1, static_cast<int>(v));
    } else if (std::strcmp(argv[i], "--device=cuda") == 0) {
      o.cuda = true;
    } else if (std::strcmp(argv[i], "--device=cpu") == 0) {
      o.cuda = false;
    } else {
      std::fprintf(stderr,
                   "unknown flag '%s' (--device=cpu|cuda --layers --heads --head_dim --tokens "
                   "--num_blocks --batch --min_time_s --rounds)\n",
                   argv[i]);
      return 2;
    }
  }
  if (!o.cuda) return Run(o);
  std::string why;
  if (gpu::VisibleDevices(&why).empty()) {
    std::printf("{\"bench\":\"kv_layout\",\"path\":\"cuda\",\"skipped\":\"%s\"}\n", why.c_str());
    return 0;
  }
#if PROXIMA_WITH_CUDA
  return RunCuda(o);
#else
  return 0;  // unreachable: VisibleDevices is empty in builds without CUDA
#endif
}

}  // namespace
}  // namespace proxima::kv_layout

int main(int argc, char** argv) { return proxima::kv_layout::Main(argc, argv); }
