// gpu_tier_bench: the GPU tier's three paths on a GPU, each as a ratio to the device's own copy
// bandwidth measured in the same run (scripts/gpu-check.sh runs it; without a GPU it prints one
// "skipped" line and exits 0). Real KV blocks (SmolLM2-135M, tools/eval/testdata, 16 tokens,
// 368,640 bytes raw) go through the daemon's core in process (TierService, the Put/Get the gRPC
// layer calls), with a pool of --pool_mb on GPU 0:
//   put   blocks put into the pool (a staging copy, then host -> device), batches of --batch,
//         against cudaMemcpy host -> device of the same bytes from ordinary memory
//   get   blocks read back out of the pool (device -> host copy and CRC32C check), against
//         cudaMemcpy device -> host into ordinary memory
//   move  every block moved down to the host tier by Tierer::MoveDown (batches of 64: encoded on
//         the GPU at the namespace's first level, copied into the pinned host arena), for each
//         of --levels ("raw" = a namespace without compression), in raw bytes per second,
//         against cudaMemcpy device -> pinned host
// JSON lines, one per measurement: {"bench":"gpu_tier","path":...,"gb_per_s":...,
// "baseline_gb_per_s":...,"ratio":...}.
//
//   gpu_tier_bench --kv_file=tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv
//       --pool_mb=1024 --batch=16 --levels='raw;int8;int4'
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "bench/args.h"
#include "daemon/tier_service.h"
#include "kernels/device.h"
#include "kernels/kv_file.h"
#include "proto/model_profile.h"

namespace {

using proxima::bench::Arg;
using proxima::daemon::Caller;
using proxima::daemon::DaemonConfig;
using proxima::daemon::TierService;

constexpr uint32_t kTokens = 16;

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// `encoded`: how many blocks the tierer encoded during a move (Tierer::encodes(), which would
// count host-tier encodes too; this bench's host tier is never under pressure), so the blocks a
// move sent down raw (a level that does not shrink them, a failed encode) show; 0 for puts and
// gets.
void Print(const char* path, const std::string& level, uint64_t bytes, double seconds,
           double baseline_gb_per_s, uint64_t blocks, uint64_t encoded = 0) {
  const double gb_per_s = static_cast<double>(bytes) / seconds / 1e9;
  std::printf(
      "{\"bench\":\"gpu_tier\",\"path\":\"%s\",\"level\":\"%s\",\"blocks\":%llu,\"bytes\":%llu,"
      "\"encoded_blocks\":%llu,\"seconds\":%.4f,\"gb_per_s\":%.3f,\"baseline_gb_per_s\":%.3f,"
      "\"ratio\":%.3f}\n",
      path, level.c_str(), static_cast<unsigned long long>(blocks),
      static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(encoded), seconds,
      gb_per_s, baseline_gb_per_s, gb_per_s / baseline_gb_per_s);
  std::fflush(stdout);
}

[[noreturn]] void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "gpu_tier_bench: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(2);
}

// The copy bandwidth of the device for `bytes` moved as `n` blocks of `block` bytes: host ->
// device from ordinary memory, device -> host into ordinary memory, device -> pinned host.
struct Baselines {
  double h2d = 0, d2h = 0, d2h_pinned = 0;
};

Baselines MeasureCopies(size_t block, size_t n) {
  auto device = proxima::gpu::DeviceBuffer::Allocate(0, block * n);
  if (!device.ok()) Die("device buffer", device.status());
  auto pinned = proxima::gpu::PinnedBuffer::Allocate(block * n);
  if (!pinned.ok()) Die("pinned buffer", pinned.status());
  std::vector<std::byte> host(block * n, std::byte{1});
  auto time = [&](auto copy) {
    copy();  // warm up
    auto start = std::chrono::steady_clock::now();
    copy();
    return static_cast<double>(block * n) / Seconds(start) / 1e9;
  };
  Baselines b;
  b.h2d = time([&] {
    for (size_t i = 0; i < n; ++i) {
      if (auto s = (*device)->CopyIn(i * block, std::span(host).subspan(i * block, block));
          !s.ok()) {
        Die("copy in", s);
      }
    }
  });
  b.d2h = time([&] {
    for (size_t i = 0; i < n; ++i) {
      if (auto s = (*device)->CopyOut(i * block, std::span(host).subspan(i * block, block));
          !s.ok()) {
        Die("copy out", s);
      }
    }
  });
  b.d2h_pinned = time([&] {
    for (size_t i = 0; i < n; ++i) {
      if (auto s = (*device)->CopyOut(i * block, std::span((*pinned)->data() + i * block, block));
          !s.ok()) {
        Die("copy out (pinned)", s);
      }
    }
  });
  return b;
}

std::unique_ptr<TierService> MakeService(uint64_t pool, uint64_t host, const std::string& level,
                                         proxima::metrics::Registry* registry) {
  DaemonConfig config;
  config.host_tier.capacity_bytes = host;
  config.gpu_tier.capacity_bytes_per_device = pool;
  config.gpu_tier.pressure_threshold = 1.0;  // no background moves: the bench moves blocks itself
  config.server.max_message_bytes = 256 << 20;
  config.server.max_batch_blocks = 1024;
  auto& z = config.namespaces[0].compression;
  z.enabled = level != "raw";
  if (z.enabled) z.levels = {level};
  if (auto s = proxima::daemon::ResolveCompressionLevels("bench", "compression", &z); !s.ok()) {
    Die("levels", s);
  }
  auto service = TierService::Create(config, registry);
  if (!service.ok()) Die("service", service.status());
  if ((*service)->store().num_devices() == 0) Die("service", absl::InternalError("no GPU pool"));
  return *std::move(service);
}

}  // namespace

int main(int argc, char** argv) {
  std::string why;
  if (proxima::gpu::VisibleDevices(&why).empty()) {
    std::printf("{\"bench\":\"gpu_tier\",\"skipped\":\"no CUDA device: %s\"}\n", why.c_str());
    return 0;
  }
  const std::string kv_file =
      Arg(argc, argv, "kv_file", "tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv");
  const uint64_t pool = std::stoull(Arg(argc, argv, "pool_mb", "1024")) << 20;
  const uint32_t batch = static_cast<uint32_t>(std::stoul(Arg(argc, argv, "batch", "16")));
  const std::vector<std::string> levels =
      absl::StrSplit(Arg(argc, argv, "levels", "raw;int8;int4"), ';');
  auto kv = proxima::codec::ReadKvFile(kv_file);
  if (!kv.ok()) Die(kv_file, kv.status());
  const proxima::codec::BlockGeometry g = kv->BlockShape(kTokens);
  const size_t raw = g.RawBytes();
  const uint32_t distinct = kv->num_tokens - kTokens + 1;
  std::vector<std::string> data(distinct, std::string(raw, '\0'));
  for (uint32_t t = 0; t < distinct; ++t) {
    if (auto s = kv->ExtractBlock(t, kTokens, std::as_writable_bytes(std::span(data[t]))); !s.ok()) {
      Die("block", s);
    }
  }
  // Nine in ten of the pool: the allocator's rounding leaves the rest.
  const uint32_t blocks = static_cast<uint32_t>(pool / raw * 9 / 10);
  const Baselines base = MeasureCopies(raw, blocks);

  for (const std::string& level : levels) {
    proxima::metrics::Registry registry;
    std::unique_ptr<TierService> service = MakeService(pool, 4 * pool, level, &registry);
    const Caller caller = Caller::Anonymous();
    proxima::v1::RegisterProfileRequest reg;
    reg.set_namespace_name("default");
    *reg.mutable_profile() = proxima::ProfileOf(g);
    proxima::v1::RegisterProfileResponse profile;
    if (auto s = service->RegisterProfile(caller, reg, &profile); !s.ok()) Die("register", s);
    // The requests first: building them is not the tier's work.
    std::vector<proxima::v1::PutRequest> puts;
    std::vector<proxima::v1::GetRequest> gets;
    for (uint32_t first = 0; first < blocks; first += batch) {
      proxima::v1::PutRequest& put = puts.emplace_back();
      proxima::v1::GetRequest& get = gets.emplace_back();
      put.set_namespace_name("default");
      put.set_profile_id(profile.profile_id());
      get.set_namespace_name("default");
      get.set_profile_id(profile.profile_id());
      for (uint32_t n = first; n < std::min(blocks, first + batch); ++n) {
        auto* b = put.add_blocks();
        std::string key(32, '\0');
        std::memcpy(key.data(), &n, sizeof(n));
        b->set_key(key);
        b->set_data(data[n % distinct]);
        get.add_keys(key);
      }
    }
    auto start = std::chrono::steady_clock::now();
    for (const auto& put : puts) {
      proxima::v1::PutResponse out;
      if (auto s = service->Put(caller, put, &out); !s.ok()) Die("put", s);
    }
    const double put_s = Seconds(start);
    const uint64_t on_gpu = service->store().device_blocks(0);
    if (on_gpu != blocks) {
      Die("put", absl::InternalError(std::to_string(on_gpu) + " of " + std::to_string(blocks) +
                                     " blocks in the pool"));
    }
    if (level == levels.front()) Print("put", "raw", uint64_t{blocks} * raw, put_s, base.h2d, blocks);
    start = std::chrono::steady_clock::now();
    uint64_t got = 0;
    for (const auto& get : gets) {
      std::vector<std::optional<proxima::daemon::BlockStore::ReadBlock>> found;
      if (auto s = service->GetBlocks(caller, get, &found, /*inline_response=*/false); !s.ok()) {
        Die("get", s);
      }
      for (const auto& b : found) got += b ? b->bytes.size() : 0;
    }
    const double get_s = Seconds(start);
    if (got != uint64_t{blocks} * raw) Die("get", absl::InternalError("a block came back short"));
    if (level == levels.front()) Print("get", "raw", got, get_s, base.d2h, blocks);
    const uint64_t encodes_before = service->tierer().encodes();
    start = std::chrono::steady_clock::now();
    uint64_t moved = 0;
    while (size_t n = service->tierer().MoveDown(0, 0, 64)) moved += n;
    const double move_s = Seconds(start);
    if (moved != blocks) {
      Die("move", absl::InternalError(std::to_string(moved) + " of " + std::to_string(blocks) +
                                      " blocks moved down"));
    }
    Print("move", level, uint64_t{blocks} * raw, move_s, base.d2h_pinned, blocks,
          service->tierer().encodes() - encodes_before);
  }
  return 0;
}
