// tierer_bench: what the tierer buys in capacity, and what it costs puts. Streams real KV blocks
// (SmolLM2-135M, tools/eval/testdata) through the daemon's core (TierService, in process, the
// same Put path the gRPC layer calls) into a host tier of fixed size, once with compression off
// (the baseline: raw blocks, LRU eviction) and once per hierarchy, and prints JSON lines:
//   blocks_held / baseline_blocks_held   how many more blocks the same memory holds
//   puts_per_s / baseline_puts_per_s     put throughput with encoding on the put path
//   recent_hit_ratio                     of the last --recent blocks put, how many are still held
//   compactions, compactions_given_up    windows of the tier emptied for a put, and given up
//   moved_per_put_byte                   bytes the compactions copied per byte put
//
//   tierer_bench --kv_file=tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv
//       --capacity_mb=64 --blocks=600 --levels='int8|int8;layers[0:2]=int8,default=int4,sink=int8'
//
// With --drain_threads=1,2,... it measures the background workers instead (`tierer.threads`):
// --blocks raw blocks are put, with the workers stopped, into a tier with room for all of them
// and a pressure threshold of 0.05; then the workers start and alone take every block down the
// hierarchy. The time until every block is at the deepest level gives their encode throughput
// (raw bytes per second), printed as a ratio to the first thread count's. --sample_one_in sets
// the quality guard's sampling (default 16, the daemon's), to see what its measurements cost.
//
// With --get_decode_threads=1,2,... it measures a Get of compressed blocks (`server.
// decode_threads`): --blocks blocks are put and taken down to the deepest level as above, then
// one Get asks for all of them raw (the daemon decodes each), --gets times, through the daemon's
// own Get handler (ServeGet, without gRPC's transport); the median Get time per thread count,
// and the throughput as a ratio to the first line's. --decode_buffer_cache_mb=0,128 runs each
// thread count without and with reused output buffers (server.decode_buffer_cache_bytes).
// Linked with jemalloc, as proximad is.
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/args.h"
#include "common/crc32c.h"
#include "daemon/grpc_service.h"
#include "daemon/tier_service.h"
#include "kernels/kv_file.h"
#include "proto/model_profile.h"

namespace {

using proxima::bench::Arg;
using proxima::daemon::DaemonConfig;
using proxima::daemon::TierService;

struct Result {
  uint64_t held = 0;
  uint64_t evictions = 0;
  double puts_per_s = 0;
  double recent_hit_ratio = 0;
  uint64_t used_bytes = 0;
  // Compaction (BlockStore::ReserveCompacting): windows handed to puts, windows given up, and
  // the bytes of the blocks moved, over the bytes put.
  uint64_t compactions = 0;
  uint64_t compactions_given_up = 0;
  double moved_per_put_byte = 0;
};

constexpr uint32_t kTokens = 16;

// A service over a host tier of `capacity` bytes with `levels` (empty = compression off).
// `sample_one_in`: the quality guard's sampling (the daemon's default unless --sample_one_in).
uint32_t g_sample_one_in = 16;
// The quality guard's budget (--max_attention_error; the daemon's default unless given). k4v3
// needs about 0.3 (docs/quality.md), or the guard steps every new encoding back.
double g_max_attention_error = 0.12;
// server.decode_buffer_cache_bytes (the daemon's default unless --decode_buffer_cache_mb).
uint64_t g_decode_buffer_cache_bytes = proxima::daemon::ServerConfig().decode_buffer_cache_bytes;

std::unique_ptr<TierService> MakeService(uint64_t capacity, const std::vector<std::string>& levels,
                                         double threshold, uint32_t threads,
                                         proxima::metrics::Registry* registry,
                                         uint32_t decode_threads = 4) {
  DaemonConfig config;
  config.server.decode_threads = decode_threads;
  config.server.decode_buffer_cache_bytes = g_decode_buffer_cache_bytes;
  config.host_tier.capacity_bytes = capacity;
  config.server.max_message_bytes = 64 << 20;
  config.tierer.threads = threads;
  auto& z = config.namespaces[0].compression;
  z.enabled = !levels.empty();
  z.levels = levels;
  z.memory_pressure_threshold = threshold;
  z.sample_one_in = g_sample_one_in;
  z.max_attention_error = g_max_attention_error;
  if (auto s = proxima::daemon::ResolveCompressionLevels("bench", "compression", &z); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::exit(2);
  }
  auto service = TierService::Create(config, registry);
  if (!service.ok()) {
    std::fprintf(stderr, "%s\n", service.status().ToString().c_str());
    std::exit(2);
  }
  return *std::move(service);
}

// A registered profile of `kv`'s geometry in `service`, and the distinct real blocks to put.
struct Stream {
  TierService* service;
  uint64_t profile_id = 0;
  std::vector<std::string> data;
  const proxima::daemon::Caller caller = proxima::daemon::Caller::Anonymous();

  Stream(TierService* s, const proxima::codec::KvTensor& kv) : service(s) {
    proxima::v1::RegisterProfileRequest reg;
    reg.set_namespace_name("default");
    *reg.mutable_profile() = proxima::ProfileOf(kv.BlockShape(kTokens));
    proxima::v1::RegisterProfileResponse profile;
    if (!service->RegisterProfile(caller, reg, &profile).ok()) std::exit(2);
    profile_id = profile.profile_id();
    const uint32_t distinct = kv.num_tokens - kTokens + 1;
    data.assign(distinct, std::string(profile.block_bytes(), '\0'));
    for (uint32_t t = 0; t < distinct; ++t) {
      (void)kv.ExtractBlock(t, kTokens,
                            std::as_writable_bytes(std::span(data[t].data(), data[t].size())));
    }
  }
  proxima::daemon::BlockId Id(uint32_t n) const {
    proxima::daemon::BlockId id{0, profile_id, {}};
    std::memcpy(id.key.data(), &n, sizeof(n));
    return id;
  }
  // Puts block n (one per call, as an engine that offloads each block when it fills).
  void Put(uint32_t n) {
    proxima::v1::PutRequest put;
    put.set_namespace_name("default");
    put.set_profile_id(profile_id);
    auto* b = put.add_blocks();
    const proxima::daemon::BlockId id = Id(n);
    b->set_key(id.key.data(), id.key.size());
    b->set_data(data[(n * 7) % data.size()]);
    b->set_position(n % 64);
    proxima::v1::PutResponse out;
    if (!service->Put(caller, put, &out).ok() ||
        out.outcomes(0) != proxima::v1::PUT_OUTCOME_STORED) {
      std::fprintf(stderr, "put %u was not stored\n", n);
      std::exit(3);
    }
  }
};

// One run: `levels` empty = compression off.
Result Run(const proxima::codec::KvTensor& kv, uint64_t capacity, uint32_t blocks, uint32_t recent,
           const std::vector<std::string>& levels) {
  proxima::metrics::Registry registry;
  std::unique_ptr<TierService> service = MakeService(capacity, levels, 0.8, 1, &registry);
  Stream stream(service.get(), kv);
  auto start = std::chrono::steady_clock::now();
  for (uint32_t n = 0; n < blocks; ++n) stream.Put(n);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Result r;
  r.held = service->store().blocks();
  r.evictions = service->store().evictions();
  r.used_bytes = service->store().used_bytes();
  r.compactions = service->store().compactions();
  r.compactions_given_up = service->store().compactions_given_up();
  r.moved_per_put_byte = static_cast<double>(service->store().compaction_moved_bytes()) /
                         (static_cast<double>(blocks) * kv.BlockShape(kTokens).RawBytes());
  r.puts_per_s = blocks / secs;
  uint32_t hits = 0;
  for (uint32_t n = blocks - recent; n < blocks; ++n) {
    hits += service->store().Contains(stream.Id(n)) ? 1 : 0;
  }
  r.recent_hit_ratio = static_cast<double>(hits) / recent;
  return r;
}

struct Drain {
  double seconds = 0;  // workers started until every block is at the deepest level
  uint64_t raw_bytes = 0;
};

// The background workers' throughput: `blocks` puts into room for all of them, threshold 0.05,
// then the workers start; the time until all `blocks` are at the hierarchy's deepest level.
// `decode_threads` and `after` (called with the drained service and its blocks, e.g. to time Gets):
// for RunGetDecode.
Drain RunDrain(const proxima::codec::KvTensor& kv, uint32_t blocks,
               const std::vector<std::string>& levels, uint32_t threads,
               uint32_t decode_threads = 4,
               const std::function<void(TierService&, const Stream&)>& after = nullptr) {
  proxima::metrics::Registry registry;
  const uint64_t raw = 2ull * kv.num_layers * kTokens * kv.num_kv_heads * kv.head_dim * 2;
  std::unique_ptr<TierService> service = MakeService(raw * blocks + (raw * blocks) / 8, levels,
                                                     0.05, threads, &registry, decode_threads);
  Stream stream(service.get(), kv);
  const proxima::daemon::BlockStore& store = service->store();
  const int deepest = static_cast<int>(levels.size());
  // The workers wait until every block is in, so that the puts' own work is not timed.
  service->tierer().Stop();
  for (uint32_t n = 0; n < blocks; ++n) stream.Put(n);
  const auto start = std::chrono::steady_clock::now();
  service->tierer().Start();
  while (store.level_blocks(deepest) < blocks) {
    if (std::chrono::steady_clock::now() - start > std::chrono::minutes(5)) {
      std::fprintf(stderr, "drain: %llu of %u blocks at level %d after 5 minutes\n",
                   static_cast<unsigned long long>(store.level_blocks(deepest)), blocks, deepest);
      std::exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  Drain d;
  d.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  d.raw_bytes = raw * blocks;
  if (store.evictions() != 0) {
    std::fprintf(stderr, "drain: %llu evictions; the tier was meant to hold every block\n",
                 static_cast<unsigned long long>(store.evictions()));
    std::exit(3);
  }
  if (after) after(*service, stream);
  return d;
}

// Serializes `message` into a gRPC byte buffer, as the channel delivers it to the daemon.
template <typename M>
grpc::ByteBuffer ToBuffer(const M& message) {
  grpc::ByteBuffer buffer;
  bool own = false;
  if (!grpc::SerializationTraits<M>::Serialize(message, &buffer, &own).ok()) std::exit(3);
  return buffer;
}

// One Get (raw) of every block of a drained tier, `gets` times with server.decode_threads =
// `decode_threads`: the median milliseconds per Get. What is timed is the daemon's own handler
// of a Get call (ServeGet: the request's parse, the reads, the decodes with their CRC32C, and the
// response's byte buffer, which references the decoded buffers without copying them), on a
// request as the channel delivers it; not timed: gRPC's transport. Every block must come back
// found and with the bytes a local decode of its stored encoding gives (checked on the first
// Get).
double RunGetDecode(const proxima::codec::KvTensor& kv, uint32_t blocks,
                    const std::vector<std::string>& levels, uint32_t decode_threads,
                    uint32_t gets) {
  std::vector<double> ms;
  RunDrain(kv, blocks, levels, 1, decode_threads, [&](TierService& service, const Stream& stream) {
    proxima::v1::GetRequest raw, stored;
    for (proxima::v1::GetRequest* r : {&raw, &stored}) {
      r->set_namespace_name("default");
      r->set_profile_id(stream.profile_id);
      for (uint32_t n = 0; n < blocks; ++n) {
        const proxima::daemon::BlockId id = stream.Id(n);
        r->add_keys(id.key.data(), id.key.size());
      }
    }
    stored.set_format(proxima::v1::BLOCK_FORMAT_STORED);
    proxima::v1::GetResponse want;
    if (!service.Get(stream.caller, stored, &want).ok()) std::exit(3);
    const grpc::ByteBuffer request = ToBuffer(raw);
    for (uint32_t g = 0; g < gets; ++g) {
      grpc::ByteBuffer response;
      const auto start = std::chrono::steady_clock::now();
      if (!proxima::daemon::ServeGet(service, stream.caller, request, &response).ok()) {
        std::exit(3);
      }
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
      if (g > 0) continue;
      proxima::v1::GetResponse got;
      if (!grpc::SerializationTraits<proxima::v1::GetResponse>::Deserialize(&response, &got).ok() ||
          got.results_size() != static_cast<int>(blocks)) {
        std::fprintf(stderr, "get_decode: the response does not parse as %u results\n", blocks);
        std::exit(3);
      }
      for (uint32_t n = 0; n < blocks; ++n) {
        std::string local(got.results(n).data().size(), '\0');
        const std::string& enc = want.results(n).data();
        if (!got.results(n).found() || got.results(n).level() != 0 ||
            !proxima::codec::DecodeBlock(
                 std::as_bytes(std::span(enc.data(), enc.size())),
                 std::as_writable_bytes(std::span(local.data(), local.size())))
                 .ok() ||
            local != got.results(n).data() ||
            proxima::Crc32c(std::as_bytes(std::span(local.data(), local.size()))) !=
                got.results(n).crc32c()) {
          std::fprintf(stderr, "get_decode: block %u came back wrong\n", n);
          std::exit(3);
        }
      }
    }
  });
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
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
  g_sample_one_in = std::stoul(Arg(argc, argv, "sample_one_in", "16"));
  g_max_attention_error = std::stod(Arg(argc, argv, "max_attention_error", "0.12"));
  const std::string drain_threads = Arg(argc, argv, "drain_threads", "");
  const std::string get_decode_threads = Arg(argc, argv, "get_decode_threads", "");
  if (!get_decode_threads.empty()) {
    // One hierarchy (the first of --levels), each server.decode_threads in turn, and for each
    // every --decode_buffer_cache_mb (server.decode_buffer_cache_bytes; default: the daemon's).
    std::vector<std::string> levels =
        absl::StrSplit(std::vector<std::string>(absl::StrSplit(hierarchies, '|'))[0], ';');
    const uint32_t gets = std::stoul(Arg(argc, argv, "gets", "9"));
    const std::string cache_mb =
        Arg(argc, argv, "decode_buffer_cache_mb",
            std::to_string(proxima::daemon::ServerConfig().decode_buffer_cache_bytes >> 20));
    const uint64_t raw = 2ull * kv->num_layers * kTokens * kv->num_kv_heads * kv->head_dim * 2;
    double base_ms = 0;
    for (absl::string_view t : absl::StrSplit(get_decode_threads, ',')) {
      for (absl::string_view c : absl::StrSplit(cache_mb, ',')) {
        const uint32_t threads = std::stoul(std::string(t));
        g_decode_buffer_cache_bytes = std::stoull(std::string(c)) << 20;
        const double ms = RunGetDecode(*kv, blocks, levels, threads, gets);
        if (base_ms == 0) base_ms = ms;
        std::printf(
            "{\"bench\":\"get_decode\",\"levels\":\"%s\",\"decode_threads\":%u,"
            "\"decode_buffer_cache_bytes\":%llu,\"blocks_per_get\":%u,"
            "\"raw_bytes_per_get\":%llu,\"get_ms_p50\":%.3f,\"raw_gb_per_s\":%.3f,"
            "\"speedup_vs_first\":%.3f}\n",
            absl::StrJoin(levels, " > ").c_str(), threads,
            static_cast<unsigned long long>(g_decode_buffer_cache_bytes), blocks,
            static_cast<unsigned long long>(raw * blocks), ms, raw * blocks / (ms * 1e-3) / 1e9,
            base_ms / ms);
        std::fflush(stdout);
      }
    }
    return 0;
  }
  if (!drain_threads.empty()) {
    // Background workers: one hierarchy (the first of --levels), each thread count in turn.
    std::vector<std::string> levels =
        absl::StrSplit(std::vector<std::string>(absl::StrSplit(hierarchies, '|'))[0], ';');
    double base_mb_s = 0;
    for (absl::string_view t : absl::StrSplit(drain_threads, ',')) {
      const uint32_t threads = std::stoul(std::string(t));
      const Drain d = RunDrain(*kv, blocks, levels, threads);
      const double mb_s = d.raw_bytes / d.seconds / 1e6;
      if (base_mb_s == 0) base_mb_s = mb_s;
      std::printf(
          "{\"bench\":\"tierer_drain\",\"levels\":\"%s\",\"threads\":%u,\"sample_one_in\":%u,"
          "\"blocks\":%u,"
          "\"raw_bytes\":%llu,\"seconds\":%.3f,\"raw_mb_per_s\":%.1f,\"vs_first\":%.3f}\n",
          absl::StrJoin(levels, " > ").c_str(), threads, g_sample_one_in, blocks,
          static_cast<unsigned long long>(d.raw_bytes), d.seconds, mb_s, mb_s / base_mb_s);
      std::fflush(stdout);
    }
    return 0;
  }
  const Result base = Run(*kv, capacity, blocks, recent, {});
  auto print = [&](const std::string& name, const Result& r) {
    std::printf(
        "{\"bench\":\"tierer\",\"levels\":\"%s\",\"capacity_bytes\":%llu,\"blocks_put\":%u,"
        "\"blocks_held\":%llu,\"used_bytes\":%llu,\"evictions\":%llu,\"puts_per_s\":%.1f,"
        "\"recent_hit_ratio\":%.3f,\"held_vs_raw\":%.3f,\"puts_per_s_vs_raw\":%.3f,"
        "\"compactions\":%llu,\"compactions_given_up\":%llu,\"moved_per_put_byte\":%.3f}\n",
        name.c_str(), static_cast<unsigned long long>(capacity), blocks,
        static_cast<unsigned long long>(r.held), static_cast<unsigned long long>(r.used_bytes),
        static_cast<unsigned long long>(r.evictions), r.puts_per_s, r.recent_hit_ratio,
        static_cast<double>(r.held) / base.held, r.puts_per_s / base.puts_per_s,
        static_cast<unsigned long long>(r.compactions),
        static_cast<unsigned long long>(r.compactions_given_up), r.moved_per_put_byte);
    std::fflush(stdout);
  };
  print("raw", base);
  for (absl::string_view h : absl::StrSplit(hierarchies, '|')) {
    std::vector<std::string> levels = absl::StrSplit(h, ';');
    print(absl::StrJoin(levels, " > "), Run(*kv, capacity, blocks, recent, levels));
  }
  return 0;
}
