// crc32c_gpu_bench: batched GPU CRC32C (kernels/crc32c_cuda.h) throughput over a batch of spans
// of device memory, as a ratio to the same device's device-to-device copy measured in the same
// run.
//
//   crc32c_gpu_bench [--batch_mb=256] [--span_kb=700] [--reps=7]
//
// The batch is --batch_mb MiB of random bytes cut into back-to-back spans of about --span_kb KiB
// (each a few hundred bytes longer or shorter, so spans start at odd addresses). Both sides are
// timed with CUDA events on one stream: one warm-up, then the median of --reps runs.
// Crc32cBatchCuda is timed whole (host-side span list and its copy included, since a caller pays
// them too). Throughput counts every byte once: CRC = batch bytes / time (each byte read once);
// the D2D baseline = batch bytes / time of cudaMemcpyAsync of the batch (each byte read once and
// written once, so the copy moves twice the bytes over the memory bus). The CRCs are checked
// against common/crc32c.h on the host ("mismatches" must be 0).
//
// JSON lines out: {"bench":"crc32c_gpu","metric":"crc32c_throughput","spans":..,
// "span_bytes_avg":..,"value":..,"unit":"GB/s","baseline":"cudaMemcpy D2D","baseline_value":..,
// "ratio":..,"mismatches":0}. Without a GPU it prints one line saying so and exits 0. Run by
// scripts/gpu-check.sh.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/gpu_bench.h"
#include "common/crc32c.h"
#include "kernels/crc32c_cuda.h"
#include "kernels/device.h"

namespace {

bool Check(cudaError_t err, const char* what) {
  return proxima::bench::CudaOk(err, "crc32c_gpu_bench", what);
}
using proxima::bench::Arg;

}  // namespace

int main(int argc, char** argv) {
  std::string why;
  if (proxima::gpu::VisibleDevices(&why).empty()) {
    std::printf("{\"bench\":\"crc32c_gpu\",\"skipped\":\"%s\"}\n", why.c_str());
    return 0;
  }
  const size_t batch_bytes = std::stoull(Arg(argc, argv, "batch_mb", "256")) << 20;
  const size_t span_bytes = std::stoull(Arg(argc, argv, "span_kb", "700")) << 10;
  const int reps = std::max(1, std::stoi(Arg(argc, argv, "reps", "7")));
  std::vector<std::byte> host(batch_bytes);
  std::mt19937_64 rng(1);
  for (size_t i = 0; i + 8 <= host.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(host.data() + i, &v, 8);
  }
  std::byte *d_src = nullptr, *d_dst = nullptr;
  uint32_t* d_crcs = nullptr;
  if (!Check(cudaMalloc(reinterpret_cast<void**>(&d_src), batch_bytes), "cudaMalloc") ||
      !Check(cudaMalloc(reinterpret_cast<void**>(&d_dst), batch_bytes), "cudaMalloc") ||
      !Check(cudaMemcpy(d_src, host.data(), batch_bytes, cudaMemcpyHostToDevice), "cudaMemcpy")) {
    return 1;
  }
  std::vector<proxima::gpu::DeviceSpan> spans;
  for (size_t off = 0; off < batch_bytes;) {
    const size_t want = span_bytes + rng() % 1024 - 512;  // odd sizes, so odd start addresses
    const size_t len = std::min(std::max<size_t>(want, 1), batch_bytes - off);
    spans.push_back({d_src + off, len});
    off += len;
  }
  if (!Check(cudaMalloc(reinterpret_cast<void**>(&d_crcs), spans.size() * sizeof(uint32_t)),
             "cudaMalloc")) {
    return 1;
  }
  cudaStream_t stream;
  cudaEvent_t start, stop;
  if (!Check(cudaStreamCreate(&stream), "cudaStreamCreate") ||
      !Check(cudaEventCreate(&start), "cudaEventCreate") ||
      !Check(cudaEventCreate(&stop), "cudaEventCreate")) {
    return 1;
  }
  bool ok = true;
  auto median_ms = [&](auto&& enqueue) {
    enqueue();  // warm-up (module load, pool growth)
    ok = Check(cudaStreamSynchronize(stream), "warm-up") && ok;
    std::vector<float> times;
    for (int i = 0; i < reps; ++i) {
      cudaEventRecord(start, stream);
      enqueue();
      cudaEventRecord(stop, stream);
      ok = Check(cudaEventSynchronize(stop), "cudaEventSynchronize") && ok;
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    return static_cast<double>(times[times.size() / 2]);
  };
  const double copy_ms = median_ms([&] {
    ok = Check(cudaMemcpyAsync(d_dst, d_src, batch_bytes, cudaMemcpyDeviceToDevice, stream),
               "cudaMemcpyAsync") &&
         ok;
  });
  const double crc_ms = median_ms([&] {
    const absl::Status s = proxima::gpu::Crc32cBatchCuda(spans, d_crcs, stream);
    if (!s.ok()) {
      std::fprintf(stderr, "crc32c_gpu_bench: %s\n", s.ToString().c_str());
      ok = false;
    }
  });
  if (!ok) return 1;
  std::vector<uint32_t> got(spans.size());
  if (!Check(cudaMemcpy(got.data(), d_crcs, got.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost),
             "cudaMemcpy")) {
    return 1;
  }
  size_t mismatches = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const size_t off = static_cast<size_t>(spans[i].data - d_src);
    if (got[i] != proxima::Crc32c(std::span<const std::byte>(host.data() + off, spans[i].size))) {
      ++mismatches;
    }
  }
  const double copy_gbps = batch_bytes / (copy_ms * 1e-3) / 1e9;
  const double crc_gbps = batch_bytes / (crc_ms * 1e-3) / 1e9;
  std::printf(
      "{\"bench\":\"crc32c_gpu\",\"metric\":\"crc32c_throughput\",\"spans\":%zu,"
      "\"span_bytes_avg\":%zu,\"value\":%.2f,\"unit\":\"GB/s\",\"baseline\":\"cudaMemcpy D2D\","
      "\"baseline_value\":%.2f,\"ratio\":%.3f,\"mismatches\":%zu}\n",
      spans.size(), batch_bytes / spans.size(), crc_gbps, copy_gbps, crc_gbps / copy_gbps,
      mismatches);
  cudaFree(d_crcs);
  cudaFree(d_dst);
  cudaFree(d_src);
  return mismatches == 0 ? 0 : 1;
}
