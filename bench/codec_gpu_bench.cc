// codec_gpu_bench: STAR-KV CUDA decode and encode throughput over a batch of real KV blocks, as a
// ratio to the same device's device-to-device copy bandwidth measured in the same run.
//
//   codec_gpu_bench [--kv_file=tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv]
//                   [--batch_mb=256] [--tokens_per_block=64] [--codecs=fp8;int8;int4;int2]
//
// JSON lines out: {"bench":"codec_gpu","metric":"decode_throughput","codec":"int4","value":..,
// "unit":"GB/s","baseline":"cudaMemcpy D2D","baseline_value":..,"ratio":..}. Throughput counts
// raw (decoded) bytes. Each call is timed through its CudaCallTiming (kernels/codec_cuda.h):
// `*_kernel_throughput` is the codec kernels alone (CUDA events around their launches),
// `*_verified_kernel_throughput` those plus the payload CRC pass on the GPU (the CRC check of a
// decode, the CRC stamp of an encode), `*_throughput` the whole call (also host-side header and
// metadata validation, building and uploading the jobs; for encode the copy back into host
// strings), each the median of five calls after a warm-up.
// Without a GPU it prints one line saying so and exits 0. Run by scripts/gpu-check.sh.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_split.h"
#include "bench/gpu_bench.h"
#include "kernels/codec.h"
#include "kernels/codec_cuda.h"
#include "kernels/device.h"
#include "kernels/kv_file.h"

namespace {

using proxima::codec::BlockGeometry;

bool Check(cudaError_t err, const char* what) {
  return proxima::bench::CudaOk(err, "codec_gpu_bench", what);
}
using proxima::bench::Arg;

void Print(const char* metric, const std::string& codec, double value, double baseline) {
  std::printf(
      "{\"bench\":\"codec_gpu\",\"metric\":\"%s\",\"codec\":\"%s\",\"value\":%.2f,\"unit\":"
      "\"GB/s\",\"baseline\":\"cudaMemcpy D2D\",\"baseline_value\":%.2f,\"ratio\":%.3f}\n",
      metric, codec.c_str(), value, baseline, value / baseline);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string why;
  if (proxima::gpu::VisibleDevices(&why).empty()) {
    std::printf("{\"bench\":\"codec_gpu\",\"skipped\":\"%s\"}\n", why.c_str());
    return 0;
  }
  const std::string kv_path =
      Arg(argc, argv, "kv_file", "tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv");
  const uint32_t tokens = std::stoul(Arg(argc, argv, "tokens_per_block", "64"));
  const size_t batch_bytes = std::stoull(Arg(argc, argv, "batch_mb", "256")) << 20;
  auto kv = proxima::codec::ReadKvFile(kv_path);
  if (!kv.ok()) {
    std::fprintf(stderr, "codec_gpu_bench: %s\n", kv.status().ToString().c_str());
    return 1;
  }
  const BlockGeometry geometry = kv->BlockShape(tokens);
  const size_t raw_bytes = geometry.RawBytes();
  const size_t distinct = kv->num_tokens / tokens;
  const size_t blocks = std::max<size_t>(1, batch_bytes / raw_bytes);
  std::vector<std::vector<std::byte>> raw(distinct, std::vector<std::byte>(raw_bytes));
  for (size_t b = 0; b < distinct; ++b) {
    if (!kv->ExtractBlock(static_cast<uint32_t>(b * tokens), tokens, raw[b]).ok()) return 1;
  }
  // Device buffers: raw input blocks, decoded output, and a copy target for the baseline.
  std::byte *d_raw = nullptr, *d_out = nullptr;
  if (!Check(cudaMalloc(reinterpret_cast<void**>(&d_raw), blocks * raw_bytes), "cudaMalloc") ||
      !Check(cudaMalloc(reinterpret_cast<void**>(&d_out), blocks * raw_bytes), "cudaMalloc")) {
    return 1;
  }
  for (size_t b = 0; b < blocks; ++b) {
    cudaMemcpy(d_raw + b * raw_bytes, raw[b % distinct].data(), raw_bytes, cudaMemcpyHostToDevice);
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  auto time_ms = [&](auto&& enqueue) {
    enqueue();  // warm-up
    cudaDeviceSynchronize();
    cudaEventRecord(start);
    const int reps = 5;
    for (int i = 0; i < reps; ++i) enqueue();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    return ms / reps;
  };
  const double total = static_cast<double>(blocks) * raw_bytes;
  const double copy_ms =
      time_ms([&] { cudaMemcpyAsync(d_out, d_raw, blocks * raw_bytes, cudaMemcpyDeviceToDevice); });
  // A D2D copy reads and writes every byte, like a decode reads (less) and writes every byte.
  const double copy_gbps = total / (copy_ms * 1e-3) / 1e9;

  for (absl::string_view name :
       absl::StrSplit(Arg(argc, argv, "codecs", "fp8;int8;int4;int2"), ';')) {
    auto plan = proxima::codec::ParseCodecPlan(std::string(name));
    if (!plan.ok()) {
      std::fprintf(stderr, "codec_gpu_bench: %s\n", plan.status().ToString().c_str());
      return 1;
    }
    // Encode on the GPU (wall clock: results come back to the host).
    std::vector<std::string> encoded(blocks);
    std::vector<proxima::codec::CudaEncodeJob> ejobs(blocks);
    for (size_t b = 0; b < blocks; ++b) {
      ejobs[b] = {d_raw + b * raw_bytes, b == 0, &encoded[b], nullptr};
    }
    // One warm-up call (module load, allocations), then the median of five timed ones.
    struct Times {
      double whole = -1, kernels = -1, verified = -1;  // ms: see the file comment
    };
    auto median_of_five = [](auto&& call) -> Times {
      std::vector<double> whole, kernels, verified;
      for (int rep = 0; rep < 6; ++rep) {
        proxima::codec::CudaCallTiming t;
        if (!call(&t)) return {};
        if (rep == 0) continue;
        whole.push_back(t.host_ms + t.kernel_ms + t.crc_ms);
        kernels.push_back(t.kernel_ms);
        verified.push_back(t.kernel_ms + t.crc_ms);
      }
      auto median = [](std::vector<double>& v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      return {median(whole), median(kernels), median(verified)};
    };
    auto print_times = [&](const char* op, const std::string& codec, const Times& t) {
      const std::string o(op);
      Print((o + "_throughput").c_str(), codec, total / (t.whole * 1e-3) / 1e9, copy_gbps);
      Print((o + "_kernel_throughput").c_str(), codec, total / (t.kernels * 1e-3) / 1e9, copy_gbps);
      Print((o + "_verified_kernel_throughput").c_str(), codec,
            total / (t.verified * 1e-3) / 1e9, copy_gbps);
    };
    const Times enc = median_of_five([&](proxima::codec::CudaCallTiming* t) {
      absl::Status es = proxima::codec::EncodeBlocksCuda(geometry, *plan, ejobs, nullptr, t);
      if (!es.ok()) {
        std::fprintf(stderr, "codec_gpu_bench: encode %s: %s\n", std::string(name).c_str(),
                     es.ToString().c_str());
      }
      return es.ok();
    });
    if (enc.whole < 0) return 1;
    print_times("encode", std::string(name), enc);
    // Decode on the GPU from device copies of the encoded blocks.
    size_t enc_total = 0;
    for (const auto& e : encoded) enc_total += e.size();
    std::byte* d_enc = nullptr;
    if (!Check(cudaMalloc(reinterpret_cast<void**>(&d_enc), enc_total), "cudaMalloc")) return 1;
    std::vector<proxima::codec::CudaDecodeJob> djobs(blocks);
    size_t off = 0;
    for (size_t b = 0; b < blocks; ++b) {
      cudaMemcpy(d_enc + off, encoded[b].data(), encoded[b].size(), cudaMemcpyHostToDevice);
      djobs[b] = {std::as_bytes(std::span(encoded[b].data(), encoded[b].size())), d_enc + off,
                  d_out + b * raw_bytes};
      off += encoded[b].size();
    }
    const Times dec = median_of_five([&](proxima::codec::CudaCallTiming* t) {
      absl::Status ds = proxima::codec::DecodeBlocksCuda(djobs, nullptr, t);
      if (!ds.ok()) std::fprintf(stderr, "codec_gpu_bench: decode: %s\n", ds.ToString().c_str());
      return ds.ok();
    });
    if (dec.whole < 0) return 1;
    print_times("decode", std::string(name), dec);
    // The decoded bytes must equal the CPU decoder's (docs/format.md: decode is bit-identical).
    std::vector<std::byte> gpu(raw_bytes), cpu(raw_bytes);
    cudaMemcpy(gpu.data(), d_out, raw_bytes, cudaMemcpyDeviceToHost);
    if (!proxima::codec::DecodeBlock(std::as_bytes(std::span(encoded[0].data(), encoded[0].size())),
                                     cpu)
             .ok() ||
        std::memcmp(gpu.data(), cpu.data(), raw_bytes) != 0) {
      std::fprintf(stderr, "codec_gpu_bench: GPU decode of %s differs from the CPU's\n",
                   std::string(name).c_str());
      return 1;
    }
    cudaFree(d_enc);
  }
  cudaFree(d_raw);
  cudaFree(d_out);
  return 0;
}
