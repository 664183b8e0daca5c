// tierer_bench: what the tierer buys in capacity, and what it costs puts. Streams real KV blocks
// (SmolLM2-135M, tools/eval/testdata) through the daemon's core (TierService, in process, the
// same Put path the gRPC layer calls) into a host tier of fixed size, once with compression off
// (the baseline: raw blocks, LRU eviction) and once per hierarchy, and prints JSON lines:
//   blocks_held / baseline_blocks_held   how many more blocks the same memory holds
//   puts_per_s / baseline_puts_per_s     put throughput with encoding on the put path
//   recent_hit_ratio                     of the last --recent blocks put, how many are still held
//
//   tierer_bench --kv_file=tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv
//       --capacity_mb=64 --blocks=600 --levels='int8|int8;layers[0:2]=int8,default=int4,sink=int8'
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/tier_service.h"
#include "kernels/kv_file.h"

namespace {

using proxima::daemon::DaemonConfig;
using proxima::daemon::TierService;

std::string Arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--" + name + "=", 0) == 0) return a.substr(name.size() + 3);
  }
  return fallback;
}

struct Result {
  uint64_t held = 0;
  uint64_t evictions = 0;
  double puts_per_s = 0;
  double recent_hit_ratio = 0;
  uint64_t used_bytes = 0;
};

// One run: `levels` empty = compression off.
Result Run(const proxima::codec::KvTensor& kv, uint64_t capacity, uint32_t blocks, uint32_t recent,
           const std::vector<std::string>& levels) {
  DaemonConfig config;
  config.host_tier.capacity_bytes = capacity;
  config.server.max_message_bytes = 64 << 20;
  auto& z = config.namespaces[0].compression;
  z.enabled = !levels.empty();
  z.levels = levels;
  if (auto s = proxima::daemon::ResolveCompressionLevels("bench", "compression", &z); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::exit(2);
  }
  proxima::metrics::Registry registry;
  auto service = TierService::Create(config, &registry);
  if (!service.ok()) std::exit(2);
  constexpr uint32_t kTokens = 16;
  proxima::v1::RegisterProfileRequest reg;
  reg.set_namespace_name("default");
  auto* p = reg.mutable_profile();
  p->set_num_layers(kv.num_layers);
  p->set_num_kv_heads(kv.num_kv_heads);
  p->set_head_dim(kv.head_dim);
  p->set_tokens_per_block(kTokens);
  p->set_dtype(proxima::v1::DTYPE_BF16);
  proxima::v1::RegisterProfileResponse profile;
  const proxima::daemon::Caller anonymous = proxima::daemon::Caller::Anonymous();
  if (!(*service)->RegisterProfile(anonymous, reg, &profile).ok()) std::exit(2);

  const uint32_t distinct = kv.num_tokens - kTokens + 1;
  std::vector<std::string> data(distinct, std::string(profile.block_bytes(), '\0'));
  for (uint32_t t = 0; t < distinct; ++t) {
    (void)kv.ExtractBlock(t, kTokens,
                          std::as_writable_bytes(std::span(data[t].data(), data[t].size())));
  }
  auto key = [](uint32_t n) {
    std::string k(32, '\0');
    std::memcpy(k.data(), &n, sizeof(n));
    return k;
  };
  auto start = std::chrono::steady_clock::now();
  for (uint32_t n = 0; n < blocks; ++n) {
    proxima::v1::PutRequest put;
    put.set_namespace_name("default");
    put.set_profile_id(profile.profile_id());
    auto* b = put.add_blocks();
    b->set_key(key(n));
    b->set_data(data[(n * 7) % distinct]);
    b->set_position(n % 64);
    proxima::v1::PutResponse out;
    if (!(*service)->Put(anonymous, put, &out).ok()) std::exit(3);
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Result r;
  r.held = (*service)->store().blocks();
  r.evictions = (*service)->store().evictions();
  r.used_bytes = (*service)->store().used_bytes();
  r.puts_per_s = blocks / secs;
  uint32_t hits = 0;
  for (uint32_t n = blocks - recent; n < blocks; ++n) {
    proxima::daemon::BlockId id{0, profile.profile_id(), {}};
    std::memcpy(id.key.data(), &n, sizeof(n));
    hits += (*service)->store().Contains(id) ? 1 : 0;
  }
  r.recent_hit_ratio = static_cast<double>(hits) / recent;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path =
      Arg(argc, argv, "kv_file", "tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv");
  auto kv = proxima::codec::ReadKvFile(path);
  if (!kv.ok()) {
    std::fprintf(stderr, "%s\n", kv.status().ToString().c_str());
    return 2;
  }
  const uint64_t capacity = std::stoull(Arg(argc, argv, "capacity_mb", "64")) << 20;
  const uint32_t blocks = std::stoul(Arg(argc, argv, "blocks", "600"));
  const uint32_t recent = std::stoul(Arg(argc, argv, "recent", "300"));
  const std::string hierarchies =
      Arg(argc, argv, "levels", "int8|int8;layers[0:2]=int8,default=int4,sink=int8|int8;int4");
  const Result base = Run(*kv, capacity, blocks, recent, {});
  auto print = [&](const std::string& name, const Result& r) {
    std::printf(
        "{\"bench\":\"tierer\",\"levels\":\"%s\",\"capacity_bytes\":%llu,\"blocks_put\":%u,"
        "\"blocks_held\":%llu,\"used_bytes\":%llu,\"evictions\":%llu,\"puts_per_s\":%.1f,"
        "\"recent_hit_ratio\":%.3f,\"held_vs_raw\":%.3f,\"puts_per_s_vs_raw\":%.3f}\n",
        name.c_str(), static_cast<unsigned long long>(capacity), blocks,
        static_cast<unsigned long long>(r.held), static_cast<unsigned long long>(r.used_bytes),
        static_cast<unsigned long long>(r.evictions), r.puts_per_s, r.recent_hit_ratio,
        static_cast<double>(r.held) / base.held, r.puts_per_s / base.puts_per_s);
    std::fflush(stdout);
  };
  print("raw", base);
  for (absl::string_view h : absl::StrSplit(hierarchies, '|')) {
    std::vector<std::string> levels = absl::StrSplit(h, ';');
    print(absl::StrJoin(levels, " > "), Run(*kv, capacity, blocks, recent, levels));
  }
  return 0;
}
