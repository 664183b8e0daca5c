// Paged-KV gather/scatter (kernels/kv_layout.h, CPU path) throughput against memcpy of the same
// bytes measured in the same run, for the layouts vLLM uses.
//
//   kv_layout_bench [--layers=32] [--heads=8] [--head_dim=128] [--tokens=16] [--num_blocks=128]
//                   [--batch=32] [--min_time_s=0.3] [--rounds=3]
//
// Defaults: a Llama-3-8B-like bf16 cache (2 MiB canonical blocks), 128 paged blocks per layer
// (256 MiB of paged tensors) and 32 random distinct blocks per call (64 MiB), so every call runs
// out of cache. Output: JSON lines {metric, value, unit, baseline, ratio, layout, path}; value
// and baseline in GB/s (1e9 bytes of canonical block per second), measured in this thread's CPU
// time, one thread, the best of `rounds` rounds that alternate memcpy, gather and scatter.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/timing.h"
#include "kernels/internal/kv_layout_testing.h"
#include "kernels/kv_layout.h"

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

int Run(const Options& o) {
  struct Case {
    const char* name;
    std::vector<int> order;
    bool separate = false;
    int64_t dim_stride = 1;
  };
  const Case cases[] = {
      {"nhd_kv_first", {kKv, kBlock, kToken, kHead, kDim}},     // FlashAttention
      {"nhd_block_first", {kBlock, kKv, kToken, kHead, kDim}},  // FlashInfer NHD
      {"hnd_kv_first", {kKv, kBlock, kHead, kToken, kDim}},     // HND, CPU attention
      {"hnd_block_first", {kBlock, kKv, kHead, kToken, kDim}},  // FlashInfer HND
      {"nhd_separate_kv", {kKv, kBlock, kToken, kHead, kDim}, true},
      {"strided_dim", {kKv, kBlock, kToken, kHead, kDim}, false, 2},  // general path
  };
  std::mt19937_64 rng(1);
  std::vector<uint64_t> ids(o.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(std::min<size_t>(o.batch, ids.size()));
  for (const Case& c : cases) {
    testing::Spec s;
    s.layers = o.layers;
    s.heads = o.heads;
    s.head_dim = o.head_dim;
    s.tokens = o.tokens;
    s.num_blocks = o.num_blocks;
    s.order = c.order;
    s.separate_kv = c.separate;
    s.dim_stride = c.dim_stride;
    testing::PagedKv kv(s);
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
    } else {
      std::fprintf(stderr,
                   "unknown flag '%s' (--layers --heads --head_dim --tokens --num_blocks "
                   "--batch --min_time_s --rounds)\n",
                   argv[i]);
      return 2;
    }
  }
  return Run(o);
}

}  // namespace
}  // namespace proxima::kv_layout

int main(int argc, char** argv) { return proxima::kv_layout::Main(argc, argv); }
