// put_get_bench: inline-gRPC put/get throughput of proximad against Redis, same values, same
// client concurrency, same loopback TCP, measured in one run.
//
// Starts redis-server (persistence off) and proximad on free loopback ports, then for each block
// size: every client stores its own set of blocks (batches of --batch, pipelined for Redis),
// then reads them back --rounds times, checking every byte. Prints one JSON object per result:
//   {"bench":"put_get","metric":"get_throughput","block_bytes":2097152,"clients":4,
//    "value":1.9,"unit":"GB/s","baseline":"redis","baseline_value":1.2,"ratio":1.58}
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "client/client.h"
#include "common/log.h"
#include "common/testing/free_port.h"

ABSL_FLAG(int, clients, 4, "concurrent clients, one connection each");
ABSL_FLAG(std::string, sizes, "262144,2097152", "block sizes in bytes, comma-separated");
ABSL_FLAG(int64_t, bytes_per_client, 64ll << 20, "bytes each client stores per block size");
ABSL_FLAG(int, batch, 4, "blocks per call (Redis: commands per pipeline)");
ABSL_FLAG(int, rounds, 3, "times each client reads its whole set back");
ABSL_FLAG(int, repeats, 3,
          "measurements of each system, interleaved (Redis, proximad, Redis, ...); the median "
          "is reported, so that a noisy machine slows both sides alike");
ABSL_FLAG(std::string, proximad, PROXIMAD_PATH, "proximad binary");
ABSL_FLAG(std::string, redis_server, "/usr/bin/redis-server", "redis-server binary");


namespace {

using proxima::bench::LoadShape;
using proxima::bench::Median;
using proxima::bench::Result;

// `cpu` and `baseline_cpu`: client + server CPU seconds per GB moved (lower is better); they show
// what each side costs when the machine's load makes wall-clock throughput noisy.
void Print(const char* metric, uint64_t block_bytes, const std::string& transport, double value,
           double baseline, double cpu, double baseline_cpu) {
  std::printf(
      "{\"bench\":\"put_get\",\"metric\":\"%s\",\"block_bytes\":%llu,\"clients\":%d,"
      "\"transport\":\"%s\",\"value\":%.3f,\"unit\":\"GB/s\",\"baseline\":\"redis\","
      "\"baseline_value\":%.3f,\"ratio\":%.3f,\"cpu_s_per_gb\":%.3f,"
      "\"baseline_cpu_s_per_gb\":%.3f}\n",
      metric, static_cast<unsigned long long>(block_bytes), absl::GetFlag(FLAGS_clients),
      transport.c_str(), value, baseline, value / baseline, cpu, baseline_cpu);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  proxima::log::SetMinLevel(proxima::log::Level::kWarning);
  signal(SIGPIPE, SIG_IGN);
  char tmpl[] = "/tmp/proxima-bench-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  const std::vector<int> ports = proxima::testing::FreeLoopbackPorts(2);
  const int redis_port = ports[0], proxima_port = ports[1];
  pid_t redis = proxima::bench::Spawn(
      {absl::GetFlag(FLAGS_redis_server), "--port", std::to_string(redis_port), "--bind",
       "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir},
      dir + "/redis.log");
  const int64_t per_client = absl::GetFlag(FLAGS_bytes_per_client);
  const uint64_t capacity = static_cast<uint64_t>(per_client) * absl::GetFlag(FLAGS_clients) * 2;
  pid_t daemon = proxima::bench::Spawn({absl::GetFlag(FLAGS_proximad),
                        "--set=server.listen=127.0.0.1:" + std::to_string(proxima_port),
                        "--set=server.unix_socket=" + dir + "/proximad.sock",
                        "--set=server.metrics_listen=",
                        "--set=tiers.host.capacity_bytes=" + std::to_string(capacity)},
                       dir + "/proximad.log");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  int exit_code = 0;
  uint64_t runs = 0;  // RunProxima calls so far: each stores its own chains
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',')) {
    uint64_t block_bytes = std::stoull(std::string(s));
    size_t blocks = static_cast<size_t>(per_client / static_cast<int64_t>(block_bytes));
    std::vector<Result> redis_runs, tcp_runs, uds_runs;
    const LoadShape shape{absl::GetFlag(FLAGS_clients), absl::GetFlag(FLAGS_batch),
                          absl::GetFlag(FLAGS_rounds), block_bytes, blocks};
    // The inline gRPC path (transfer_bench measures the UCX data plane).
    const auto kInline = proxima::client::Transport::kInline;
    for (int rep = 0; rep < absl::GetFlag(FLAGS_repeats); ++rep) {
      redis_runs.push_back(proxima::bench::RunRedis(redis_port, redis, shape));
      // Every run stores chains of its own: a put of blocks already stored copies nothing into
      // the tier, while Redis's SETs of the same keys overwrite them in full.
      LoadShape tcp_shape = shape, uds_shape = shape;
      tcp_shape.key_seed = ++runs;
      uds_shape.key_seed = ++runs;
      tcp_runs.push_back(proxima::bench::RunProxima(absl::StrCat("127.0.0.1:", proxima_port),
                                                    daemon, tcp_shape, kInline));
      uds_runs.push_back(proxima::bench::RunProxima("unix:" + dir + "/proximad.sock", daemon,
                                                    uds_shape, kInline));
    }
    Result redis_r = Median(redis_runs), tcp = Median(tcp_runs), uds = Median(uds_runs);
    Print("put_throughput", block_bytes, "tcp", tcp.put_gbps, redis_r.put_gbps,
          tcp.put_cpu_s_per_gb, redis_r.put_cpu_s_per_gb);
    Print("get_throughput", block_bytes, "tcp", tcp.get_gbps, redis_r.get_gbps,
          tcp.get_cpu_s_per_gb, redis_r.get_cpu_s_per_gb);
    std::fprintf(stderr, "get server cpu s/GB: proximad tcp %.3f unix %.3f, redis %.3f\n",
                 tcp.get_server_cpu_s_per_gb, uds.get_server_cpu_s_per_gb,
                 redis_r.get_server_cpu_s_per_gb);
    Print("put_throughput", block_bytes, "unix", uds.put_gbps, redis_r.put_gbps,
          uds.put_cpu_s_per_gb, redis_r.put_cpu_s_per_gb);
    Print("get_throughput", block_bytes, "unix", uds.get_gbps, redis_r.get_gbps,
          uds.get_cpu_s_per_gb, redis_r.get_cpu_s_per_gb);
    if (redis_r.errors + tcp.errors + uds.errors > 0) {
      std::fprintf(stderr, "errors: redis %llu, proxima tcp %llu, unix %llu\n",
                   static_cast<unsigned long long>(redis_r.errors),
                   static_cast<unsigned long long>(tcp.errors),
                   static_cast<unsigned long long>(uds.errors));
      exit_code = 1;
    }
  }
  kill(daemon, SIGTERM);
  kill(redis, SIGTERM);
  waitpid(daemon, nullptr, 0);
  waitpid(redis, nullptr, 0);
  std::filesystem::remove_all(dir);
  return exit_code;
}
