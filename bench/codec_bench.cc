// STAR-KV codec benchmark: encode/decode throughput per codec (one thread and all threads) as a
// ratio to memcpy measured in the same run, compression ratio with every metadata byte
// counted, and reconstruction error (kernels/error_metrics.h) when real KV is given.
//
//   codec_bench --kv_file=smollm2.pkv [--tokens_per_block=64] [--threads=N] [--min_time_s=0.3]
//               [--working_set_mb=64] [--codecs="int8;int4,group=64;..."]
//               [--paths=avx512,avx2,scalar] [--head_dim=N]
//
// Single-thread encode/decode is measured on every CPU path in --paths that this machine can run
// (default: all of avx512, avx2 and scalar; a path it cannot run prints a "skipped_path" line),
// each as a ratio to the same memcpy figure. Multi-thread figures use the auto-selected path.
//
// Output: JSON lines, one object per result: metric, value, unit, baseline, ratio, plus codec,
// threads, path, data ("file:<name>" or "synthetic"). Single-thread throughput is measured in
// thread CPU time (memcpy too), multi-thread throughput in wall time. Without --kv_file the blocks
// are synthetic and no error figures are printed (synthetic error numbers say nothing about real
// KV). --head_dim=N reads each token's channels of all KV heads as heads of N channels (the same
// bytes; e.g. 96 for SmolLM2's 3 heads of 64 as 2 of 96): a head dim the file's model lacks,
// measured on its real values (the data field then says so).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench/timing.h"
#include "kernels/codec.h"
#include "kernels/error_metrics.h"
#include "kernels/internal/test_blocks.h"
#include "kernels/kv_file.h"

namespace proxima::codec {
namespace {

struct Options {
  std::string kv_file;
  uint32_t tokens_per_block = 64;
  int threads = 0;
  double min_time_s = 0.3;
  uint32_t max_blocks = 64;
  // Blocks are repeated (as distinct copies) until the data set is at least this large, so that
  // throughput is measured out of cache, as a tier daemon sees cold blocks. 0: no repetition.
  uint32_t working_set_mb = 0;
  std::string codecs =
      "raw;lossless;fp8;int8;int4,group=32;int4,group=64;int4,group=128;"
      "int2,group=32;int2,group=64;int2,group=128;star;"
      "layers[0:4]=int8,default=int4,sink=int8,group=64;"
      // The default KV file is SmolLM2-135M's, whose RoPE base is 100000.
      "k4v3,rope_theta=100000";
  std::string paths = "avx512,avx2,scalar";
  uint32_t head_dim = 0;  // 0: the file's
};

bool Flag(const char* arg, const char* name, std::string* value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  *value = arg + n + 1;
  return true;
}

using bench::TimePerCall;

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

void Emit(const char* metric, double value, const char* unit, double baseline,
          const std::string& codec, int threads, const std::string& path, const std::string& data) {
  std::printf(
      "{\"metric\":\"%s\",\"value\":%.6g,\"unit\":\"%s\",\"baseline\":%.6g,\"ratio\":%.6g,"
      "\"codec\":\"%s\",\"threads\":%d,\"path\":\"%s\",\"data\":\"%s\"}\n",
      metric, value, unit, baseline, baseline > 0 ? value / baseline : 0.0,
      JsonEscape(codec).c_str(), threads, path.c_str(), JsonEscape(data).c_str());
  std::fflush(stdout);
}

// memcpy of `bytes` per thread-share with `threads` threads; returns GB/s.
double MemcpyGbps(const std::vector<std::vector<std::byte>>& src,
                  std::vector<std::vector<std::byte>>& dst, int threads, double min_time_s) {
  size_t total = 0;
  for (const auto& b : src) total += b.size();
  double t = TimePerCall(min_time_s, threads <= 1, [&] {
    if (threads <= 1) {
      for (size_t i = 0; i < src.size(); ++i)
        std::memcpy(dst[i].data(), src[i].data(), src[i].size());
      return;
    }
    std::vector<std::thread> ts;
    for (int k = 0; k < threads; ++k) {
      ts.emplace_back([&, k] {
        for (size_t i = k; i < src.size(); i += threads) {
          std::memcpy(dst[i].data(), src[i].data(), src[i].size());
        }
      });
    }
    for (auto& th : ts) th.join();
  });
  return total / t / 1e9;
}

int Run(const Options& opt) {
  // The single-thread paths to measure: those named in --paths that this CPU can run.
  std::vector<CpuPath> paths;
  for (size_t pos = 0; pos <= opt.paths.size();) {
    size_t end = opt.paths.find(',', pos);
    if (end == std::string::npos) end = opt.paths.size();
    const std::string name = opt.paths.substr(pos, end - pos);
    pos = end + 1;
    if (name.empty()) continue;
    absl::StatusOr<CpuPath> path = ParseCpuPath(name);
    if (!path.ok()) {
      std::fprintf(stderr, "codec_bench: %s\n", std::string(path.status().message()).c_str());
      return 2;
    }
    if (!CpuPathAvailable(*path)) {
      std::printf(
          "{\"metric\":\"skipped_path\",\"value\":0,\"unit\":\"\",\"baseline\":0,\"ratio\":0,"
          "\"codec\":\"\",\"threads\":0,\"path\":\"%s\",\"data\":\"\",\"note\":"
          "\"this CPU (or its OS) cannot run this path\"}\n",
          name.c_str());
      continue;
    }
    paths.push_back(*path);
  }
  const int all_threads = opt.threads > 0
                              ? opt.threads
                              : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  BlockGeometry g;
  std::vector<std::vector<std::byte>> blocks;
  std::string data;
  if (!opt.kv_file.empty()) {
    absl::StatusOr<KvTensor> kv = ReadKvFile(opt.kv_file);
    if (!kv.ok()) {
      std::fprintf(stderr, "codec_bench: %s\n", std::string(kv.status().message()).c_str());
      return 1;
    }
    g = kv->BlockShape(opt.tokens_per_block);
    const uint32_t n = std::min(opt.max_blocks, kv->num_tokens / opt.tokens_per_block);
    if (n == 0) {
      std::fprintf(stderr, "codec_bench: the file has fewer than %u tokens\n",
                   opt.tokens_per_block);
      return 1;
    }
    for (uint32_t b = 0; b < n; ++b) {
      blocks.emplace_back(g.RawBytes());
      if (!kv->ExtractBlock(b * opt.tokens_per_block, opt.tokens_per_block, blocks.back()).ok())
        return 1;
    }
    data = "file:" + opt.kv_file.substr(opt.kv_file.find_last_of('/') + 1);
    if (opt.head_dim != 0 && opt.head_dim != g.head_dim) {
      const uint32_t channels = g.num_kv_heads * g.head_dim;
      if (channels % opt.head_dim != 0) {
        std::fprintf(stderr,
                     "codec_bench: --head_dim=%u: the file's %u heads of %u channels "
                     "cannot be read as heads of %u\n",
                     opt.head_dim, g.num_kv_heads, g.head_dim, opt.head_dim);
        return 1;
      }
      g.num_kv_heads = channels / opt.head_dim;
      g.head_dim = opt.head_dim;
      data += ", heads of " + std::to_string(opt.head_dim);
    }
  } else {
    // SmolLM2-135M geometry, synthetic values.
    g = BlockGeometry{30, 3, 64, opt.tokens_per_block, DType::kBf16};
    for (uint32_t b = 0; b < 16; ++b) {
      blocks.push_back(internal::MakeBlock(g, internal::Pattern::kKvLike, b));
    }
    data = "synthetic";
    std::printf(
        "{\"metric\":\"note\",\"value\":0,\"unit\":\"\",\"baseline\":0,\"ratio\":0,"
        "\"codec\":\"\",\"threads\":0,\"path\":\"\",\"data\":\"synthetic\",\"note\":"
        "\"no --kv_file: synthetic blocks, throughput and ratio only, no error figures\"}\n");
  }
  const size_t distinct = blocks.size();
  while (opt.working_set_mb > 0 &&
         blocks.size() * g.RawBytes() < (size_t{opt.working_set_mb} << 20)) {
    blocks.push_back(blocks[blocks.size() % distinct]);
  }
  std::printf(
      "{\"metric\":\"setup\",\"value\":%zu,\"unit\":\"blocks\",\"baseline\":0,\"ratio\":0,"
      "\"codec\":\"\",\"threads\":%d,\"path\":\"%s\",\"data\":\"%s\",\"distinct_blocks\":%zu,"
      "\"block_bytes\":%zu,"
      "\"layers\":%u,\"heads\":%u,\"head_dim\":%u,\"tokens_per_block\":%u}\n",
      blocks.size(), all_threads, std::string(CpuPathName(BestCpuPath())).c_str(),
      JsonEscape(data).c_str(), distinct, g.RawBytes(), g.num_layers, g.num_kv_heads, g.head_dim,
      g.tokens_per_block);
  size_t total_raw = 0;
  for (const auto& b : blocks) total_raw += b.size();
  std::vector<std::vector<std::byte>> out(blocks.size(), std::vector<std::byte>(g.RawBytes()));
  const double memcpy1 = MemcpyGbps(blocks, out, 1, opt.min_time_s);
  const double memcpyN = MemcpyGbps(blocks, out, all_threads, opt.min_time_s);
  Emit("memcpy_throughput", memcpy1, "GB/s", memcpy1, "memcpy", 1, "", data);
  Emit("memcpy_throughput", memcpyN, "GB/s", memcpyN, "memcpy", all_threads, "", data);

  size_t pos = 0;
  while (pos <= opt.codecs.size()) {
    size_t end = opt.codecs.find(';', pos);
    if (end == std::string::npos) end = opt.codecs.size();
    const std::string text = opt.codecs.substr(pos, end - pos);
    pos = end + 1;
    if (text.empty()) continue;
    absl::StatusOr<CodecPlan> plan = ParseCodecPlan(text);
    if (!plan.ok()) {
      std::fprintf(stderr, "codec_bench: %s\n", std::string(plan.status().message()).c_str());
      return 1;
    }
    std::vector<std::string> enc(blocks.size());
    size_t distinct_raw = 0, distinct_enc = 0;  // the ratio counts each distinct block once
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (!EncodeBlock(g, *plan, i == 0, blocks[i], {}, &enc[i]).ok()) return 1;
      if (i < distinct) {
        distinct_raw += blocks[i].size();
        distinct_enc += enc[i].size();
      }
    }
    Emit("compression_ratio", static_cast<double>(distinct_raw) / distinct_enc, "x", 1.0, text, 0,
         "", data);
    for (CpuPath path : paths) {
      const std::string path_name(CpuPathName(path));
      double te = TimePerCall(opt.min_time_s, true, [&] {
        for (size_t i = 0; i < blocks.size(); ++i) {
          (void)EncodeBlockWithPath(path, g, *plan, i == 0, blocks[i], {}, &enc[i]);
        }
      });
      double td = TimePerCall(opt.min_time_s, true, [&] {
        for (size_t i = 0; i < blocks.size(); ++i) {
          (void)DecodeBlockWithPath(path, std::as_bytes(std::span<const char>(enc[i])), out[i]);
        }
      });
      Emit("encode_throughput", total_raw / te / 1e9, "GB/s", memcpy1, text, 1, path_name, data);
      Emit("decode_throughput", total_raw / td / 1e9, "GB/s", memcpy1, text, 1, path_name, data);
    }
    if (all_threads > 1) {
      std::vector<EncodeRequest> ereq;
      std::vector<DecodeRequest> dreq;
      for (size_t i = 0; i < blocks.size(); ++i) {
        ereq.push_back({blocks[i], {}, i == 0, &enc[i]});
        dreq.push_back({std::as_bytes(std::span<const char>(enc[i])), out[i]});
      }
      double te =
          TimePerCall(opt.min_time_s, false, [&] { EncodeBlocks(g, *plan, ereq, all_threads); });
      // Re-point the decode requests: encoding replaced the strings.
      for (size_t i = 0; i < blocks.size(); ++i) {
        dreq[i].encoded = std::as_bytes(std::span<const char>(enc[i]));
      }
      double td = TimePerCall(opt.min_time_s, false, [&] { DecodeBlocks(dreq, all_threads); });
      const std::string p(CpuPathName(BestCpuPath()));
      Emit("encode_throughput", total_raw / te / 1e9, "GB/s", memcpyN, text, all_threads, p, data);
      Emit("decode_throughput", total_raw / td / 1e9, "GB/s", memcpyN, text, all_threads, p, data);
    }
    if (!opt.kv_file.empty()) {
      ErrorSums sums;
      for (size_t i = 0; i < distinct; ++i) {
        if (!DecodeBlock(std::as_bytes(std::span<const char>(enc[i])), out[i]).ok()) return 1;
        absl::StatusOr<ErrorSums> s = MeasureBlockError(g, blocks[i], out[i]);
        if (!s.ok()) return 1;
        sums.Add(*s);
      }
      ErrorFigures f = Finish(sums);
      Emit("k_rel_l2", f.k_rel_l2, "", 0, text, 0, "", data);
      Emit("v_rel_l2", f.v_rel_l2, "", 0, text, 0, "", data);
      Emit("attn_rel_l2", f.attn_rel_l2, "", 0, text, 0, "", data);
    }
  }
  return 0;
}

}  // namespace
}  // namespace proxima::codec

int main(int argc, char** argv) {
  proxima::codec::Options opt;
  for (int i = 1; i < argc; ++i) {
    std::string v;
    if (proxima::codec::Flag(argv[i], "--kv_file", &v)) {
      opt.kv_file = v;
    } else if (proxima::codec::Flag(argv[i], "--tokens_per_block", &v)) {
      opt.tokens_per_block = static_cast<uint32_t>(std::stoul(v));
    } else if (proxima::codec::Flag(argv[i], "--threads", &v)) {
      opt.threads = std::stoi(v);
    } else if (proxima::codec::Flag(argv[i], "--min_time_s", &v)) {
      opt.min_time_s = std::stod(v);
    } else if (proxima::codec::Flag(argv[i], "--max_blocks", &v)) {
      opt.max_blocks = static_cast<uint32_t>(std::stoul(v));
    } else if (proxima::codec::Flag(argv[i], "--working_set_mb", &v)) {
      opt.working_set_mb = static_cast<uint32_t>(std::stoul(v));
    } else if (proxima::codec::Flag(argv[i], "--codecs", &v)) {
      opt.codecs = v;
    } else if (proxima::codec::Flag(argv[i], "--paths", &v)) {
      opt.paths = v;
    } else if (proxima::codec::Flag(argv[i], "--head_dim", &v)) {
      opt.head_dim = static_cast<uint32_t>(std::stoul(v));
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--kv_file=PATH] [--tokens_per_block=64] [--threads=N] "
          "[--min_time_s=0.3] [--max_blocks=64] [--working_set_mb=0] [--codecs=PLAN;PLAN;...] "
          "[--paths=avx512,avx2,scalar] [--head_dim=N]\n",
          argv[0]);
      return 2;
    }
  }
  return proxima::codec::Run(opt);
}
