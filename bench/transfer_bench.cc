// transfer_bench: the UCX data plane's put/get throughput, against UCX's own ucx_perftest at the
// same sizes and transports, against proximad's inline gRPC path, against Redis, and against
// what moving the bytes alone costs on the transport (a bare TCP stream over tcp, memcpy over
// shared memory), all measured in one run (bench_util.h holds the client loops shared with
// put_get_bench).
//
// For each transport (UCX_TLS value, e.g. "tcp" and "posix,self"), a proximad is started with
// that UCX_TLS, and ucx_perftest is run between two processes with the same UCX_TLS: its
// `ucp_get` bandwidth is the baseline of Put (the daemon pulls with gets), `ucp_put_bw` of Get
// (the daemon writes with puts). An untimed warm-up run first touches the daemon's arena. Then
// for each block size and client count: UCX put/get with each kind of client buffer (--buffers:
// "heap", ordinary memory registered once, moved through the client's host staging where it
// applies (over posix/sysv); "heap-direct", the same memory with host staging off; and "ucx",
// Client::AllocateMemory), inline put/get (same daemon, gRPC over TCP), Redis and the bare move:
// for tcp, a request/response stream over loopback TCP with the same sizes, batch and clients
// (what the kernel's loopback copy alone moves at that pattern: tcp_stream.h); for shared
// memory, memcpy of the same blocks by as many threads (RunMemcpy in bench_util.h). Last, the
// p50/p99 latency of a single 2 MiB Get over UCX (each buffer kind) and inline. One JSON object
// per line:
//   {"bench":"transfer","metric":"get_throughput","transport":"tcp","buffers":"heap",
//    "block_bytes":2097152,"segments_per_block":1,"clients":1,"value":1.1,"unit":"GB/s",
//    "baselines":{"ucx_perftest":1.3,
//    "inline":0.5,"redis":0.7,"tcp_stream":1.5},"ratio_perftest":0.85,"ratio_inline":2.2,
//    "ratio_redis":1.6,"ratio_tcp_stream":0.73}
// (tcp_stream on tcp lines; memcpy and ratio_memcpy in their place on shared-memory lines).
// --segments_per_block=N hands the UCX clients' blocks over in N pieces each (the baselines move
// whole blocks).
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/tcp_stream.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/log.h"
#include "common/testing/free_port.h"

ABSL_FLAG(std::string, transports, "tcp,posix+self",
          "UCX_TLS values to measure, comma-separated ('+' stands for ',' inside one value)");
ABSL_FLAG(std::string, sizes, "262144,2097152,16777216", "block sizes in bytes");
ABSL_FLAG(std::string, clients, "1,4", "client counts");
ABSL_FLAG(int64_t, bytes_per_client, 64ll << 20, "bytes each client stores per size");
ABSL_FLAG(int, batch, 4, "blocks per call (Redis: commands per pipeline)");
ABSL_FLAG(int, rounds, 2, "times each client reads its whole set back");
ABSL_FLAG(int, repeats, 1, "measurements of each system (median reported)");
ABSL_FLAG(int, latency_gets, 200,
          "single 2 MiB gets timed for the latency percentiles (0: no latency lines)");
ABSL_FLAG(std::string, proximad, PROXIMAD_PATH, "proximad binary");
ABSL_FLAG(std::string, redis_server, "/usr/bin/redis-server", "redis-server binary");
ABSL_FLAG(std::string, ucx_perftest, "/usr/bin/ucx_perftest", "ucx_perftest binary");
ABSL_FLAG(bool, ucx_messages, true,
          "the clients' ClientOptions::ucx_messages: false makes the daemon move their bytes with "
          "one-sided operations, as before 2026-12-04 (for an A/B)");
ABSL_FLAG(int64_t, ucx_rendezvous_bytes, -1,
          "the clients' ClientOptions::ucx_rendezvous_bytes (-1: the default): puts of blocks of "
          "at least this size go as rendezvous messages, smaller ones eager (for an A/B)");
ABSL_FLAG(int, segments_per_block, 1,
          "each Proxima block handed over in this many equal pieces (PutScattered / "
          "GetScattered), as an engine with one buffer per layer does; 1: one span per block");
ABSL_FLAG(int64_t, ucx_rendezvous_get_bytes, -1,
          "the clients' ClientOptions::ucx_rendezvous_get_bytes (-1: the default): gets of "
          "blocks of at least this size come as rendezvous messages, smaller ones eager (A/B)");
ABSL_FLAG(std::string, buffers, "heap,heap-direct,ucx",
          "the UCX clients' block buffers, comma-separated: heap (ordinary memory registered "
          "with RegisterMemory, the client's default host_staging: staged over posix/sysv), "
          "heap-direct (the same with host_staging=never) and/or ucx (Client::AllocateMemory: "
          "memory UCX chose)");
ABSL_FLAG(int, serve_tcp_stream, 0,
          "internal: serve the bare TCP stream's protocol on this port and never return "
          "(transfer_bench starts itself so for its tcp_stream baseline)");

namespace {

using proxima::bench::LoadShape;
using proxima::bench::Result;
using proxima::client::Transport;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// ucx_perftest bandwidth in GB/s (1e9 bytes/s) of `test` at `size` bytes, or -1. Its "Final:"
// row holds: iterations, p50 latency, average latency, overall latency, average bandwidth,
// overall bandwidth (MB/s, 2^20 bytes), message rates.
double PerftestGbps(const std::string& dir, const std::string& test, uint64_t size) {
  const int port = proxima::testing::FreeLoopbackPort();
  const std::string server_log = dir + "/perftest-server.log";
  const std::string client_log = dir + "/perftest-client.log";
  pid_t server = proxima::bench::Spawn(
      {absl::GetFlag(FLAGS_ucx_perftest), "-p", std::to_string(port)}, server_log);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int64_t iters = std::max<int64_t>(20, (1ll << 30) / static_cast<int64_t>(size));
  pid_t client = proxima::bench::Spawn(
      {absl::GetFlag(FLAGS_ucx_perftest), "127.0.0.1", "-p", std::to_string(port), "-t", test, "-s",
       std::to_string(size), "-n", std::to_string(iters), "-w", std::to_string(iters / 10)},
      client_log);
  int status = 0;
  waitpid(client, &status, 0);
  kill(server, SIGTERM);
  waitpid(server, nullptr, 0);
  for (absl::string_view line : absl::StrSplit(ReadFile(client_log), '\n')) {
    if (!absl::StartsWith(line, "Final:")) continue;
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    double mbps = 0;
    if (f.size() >= 7 && absl::SimpleAtod(f[6], &mbps)) return mbps * (1 << 20) / 1e9;
  }
  std::fprintf(stderr, "ucx_perftest %s -s %llu gave no result:\n%s\n", test.c_str(),
               static_cast<unsigned long long>(size), ReadFile(client_log).c_str());
  return -1;
}

// The bare move measured beside a transport: a TCP stream over tcp, memcpy over shared memory.
// Printed as baselines.NAME and ratio_NAME.
struct BareMove {
  std::string name;
  double gbps = -1;  // < 0: not measured (the fields are left out)
};

void PrintThroughput(const char* metric, const std::string& transport, const std::string& buffers,
                     uint64_t block_bytes, int clients, double value, double perftest,
                     double inline_gbps, double redis, const BareMove& bare) {
  std::string baseline, ratio;
  if (bare.gbps >= 0) {
    baseline = absl::StrFormat(",\"%s\":%.3f", bare.name, bare.gbps);
    ratio = absl::StrFormat(",\"ratio_%s\":%.3f", bare.name, value / bare.gbps);
  }
  std::printf(
      "{\"bench\":\"transfer\",\"metric\":\"%s\",\"transport\":\"%s\",\"buffers\":\"%s\","
      "\"block_bytes\":%llu,\"segments_per_block\":%d,"
      "\"clients\":%d,\"value\":%.3f,\"unit\":\"GB/s\",\"baselines\":{\"ucx_perftest\":%.3f,"
      "\"inline\":%.3f,\"redis\":%.3f%s},\"ratio_perftest\":%.3f,\"ratio_inline\":%.3f,"
      "\"ratio_redis\":%.3f%s}\n",
      metric, transport.c_str(), buffers.c_str(), static_cast<unsigned long long>(block_bytes),
      absl::GetFlag(FLAGS_segments_per_block), clients, value, perftest, inline_gbps, redis,
      baseline.c_str(), value / perftest, value / inline_gbps, value / redis, ratio.c_str());
  std::fflush(stdout);
}

// p50 and p99 of single-block 2 MiB Gets, in microseconds.
// The client's host staging for a --buffers kind.
proxima::client::HostStaging StagingOf(const std::string& kind) {
  return kind == "heap-direct" ? proxima::client::HostStaging::kNever
                               : proxima::client::HostStaging::kAuto;
}

// A rendezvous threshold flag's value, or `default_bytes` for -1.
size_t RendezvousBytes(const absl::Flag<int64_t>& flag, size_t default_bytes) {
  const int64_t value = absl::GetFlag(flag);
  return value < 0 ? default_bytes : static_cast<size_t>(value);
}
size_t PutRendezvousBytes() {
  return RendezvousBytes(FLAGS_ucx_rendezvous_bytes,
                         proxima::client::ClientOptions{}.ucx_rendezvous_bytes);
}
size_t GetRendezvousBytes() {
  return RendezvousBytes(FLAGS_ucx_rendezvous_get_bytes,
                         proxima::client::ClientOptions{}.ucx_rendezvous_get_bytes);
}

std::pair<double, double> GetLatency(const std::string& target, Transport transport,
                                     bool ucx_buffer, proxima::client::HostStaging staging) {
  constexpr uint64_t kBytes = 2 << 20;
  auto c = proxima::client::Client::Connect({.target = target,
                                             .transport = transport,
                                             .host_staging = staging,
                                             .ucx_messages = absl::GetFlag(FLAGS_ucx_messages),
                                             .ucx_rendezvous_bytes = PutRendezvousBytes(),
                                             .ucx_rendezvous_get_bytes = GetRendezvousBytes()});
  if (!c.ok()) return {-1, -1};
  auto profile = (*c)->RegisterProfile(proxima::bench::BenchModel(kBytes));
  if (!profile.ok()) return {-1, -1};
  auto buffer = proxima::client::MakeTestBuffer(**c, kBytes, ucx_buffer);
  if (!buffer.ok()) return {-1, -1};
  std::span<std::byte> block = buffer->bytes;
  std::vector<proxima::client::BlockKey> key = proxima::client::TestKeyChain(424242, 0, 1);
  proxima::client::FillTestBlock(424242, 0, block);
  std::vector<std::span<const std::byte>> in = {block};
  (void)(*c)->Put(*profile, key, in);
  std::vector<std::span<std::byte>> out = {block};
  std::vector<double> us;
  for (int i = 0; i < absl::GetFlag(FLAGS_latency_gets); ++i) {
    auto t0 = std::chrono::steady_clock::now();
    auto found = (*c)->Get(*profile, key, out);
    us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    if (!found.ok() || !(*found)[0] || !proxima::client::IsTestBlock(424242, 0, block)) {
      return {-1, -1};
    }
  }
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)]};
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (const int port = absl::GetFlag(FLAGS_serve_tcp_stream); port > 0) {
    proxima::bench::ServeTcpStream(port);
  }
  proxima::log::SetMinLevel(proxima::log::Level::kWarning);
  signal(SIGPIPE, SIG_IGN);
  char tmpl[] = "/tmp/proxima-transfer-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  // Redis and the TCP stream server listen side by side: their ports from one call.
  const std::vector<int> ports = proxima::testing::FreeLoopbackPorts(2);
  const int redis_port = ports[0], stream_port = ports[1];
  pid_t redis = proxima::bench::Spawn(
      {absl::GetFlag(FLAGS_redis_server), "--port", std::to_string(redis_port), "--bind",
       "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir},
      dir + "/redis.log");
  pid_t stream_server =
      proxima::bench::Spawn({"/proc/self/exe", absl::StrCat("--serve_tcp_stream=", stream_port)},
                            dir + "/tcp_stream.log");
  const int64_t per_client = absl::GetFlag(FLAGS_bytes_per_client);
  std::vector<int> client_counts;
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_clients), ',')) {
    client_counts.push_back(std::stoi(std::string(c)));
  }
  const int max_clients = *std::max_element(client_counts.begin(), client_counts.end());
  std::vector<std::string> buffer_kinds;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_buffers), ',')) {
    if (b != "heap" && b != "heap-direct" && b != "ucx") {
      std::fprintf(stderr, "--buffers names '%s'; expected heap, heap-direct and/or ucx\n",
                   std::string(b).c_str());
      return 2;
    }
    buffer_kinds.emplace_back(b);
  }
  int exit_code = 0;
  uint64_t runs = 0;  // RunProxima calls so far: each stores its own chains
  for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_transports), ',')) {
    std::string tls(t);
    std::replace(tls.begin(), tls.end(), '+', ',');
    const std::string name = tls == "tcp" ? "tcp" : "shm:" + tls;
    // The bare move on this transport, chosen once: a TCP stream over tcp, memcpy otherwise.
    const bool over_tcp = name == "tcp";
    const std::string bare_name = over_tcp ? "tcp_stream" : "memcpy";
    auto run_bare = [&](const LoadShape& shape) {
      return over_tcp ? proxima::bench::RunTcpStream(stream_port, stream_server, shape)
                      : proxima::bench::RunMemcpy(shape);
    };
    setenv("UCX_TLS", tls.c_str(), 1);  // for proximad, ucx_perftest and this process's clients
    const int port = proxima::testing::FreeLoopbackPort();
    const uint64_t capacity = static_cast<uint64_t>(per_client) * max_clients * 2;
    pid_t daemon = proxima::bench::Spawn(
        {absl::GetFlag(FLAGS_proximad), "--set=server.listen=127.0.0.1:" + std::to_string(port),
         "--set=server.unix_socket=", "--set=server.metrics_listen=",
         "--set=tiers.host.capacity_bytes=" + std::to_string(capacity)},
        dir + "/proximad.log");
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const std::string target = absl::StrCat("127.0.0.1:", port);
    {
      auto probe = proxima::client::Client::Connect({.target = target});
      std::fprintf(
          stderr, "# UCX_TLS=%s: client transport %s\n", tls.c_str(),
          probe.ok() ? (*probe)->transport_detail().c_str() : probe.status().ToString().c_str());
    }
    {
      // Untimed warm-up: the largest footprint any run below has (every client's bytes), put
      // once and deleted, so that the daemon's first touch of its arena pages (a page fault and
      // a zeroed page each) is not charged to whichever buffer kind happens to run first.
      const uint64_t warm_block = 2 << 20;
      LoadShape warm{max_clients, absl::GetFlag(FLAGS_batch), 0, warm_block,
                     std::max<size_t>(1, static_cast<size_t>(per_client / warm_block))};
      warm.ucx_buffers = true;
      warm.key_seed = ++runs;
      (void)proxima::bench::RunProxima(target, daemon, warm, Transport::kUcx);
    }
    for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',')) {
      const uint64_t block_bytes = std::stoull(std::string(s));
      const double perf_get = PerftestGbps(dir, "ucp_get", block_bytes);
      const double perf_put = PerftestGbps(dir, "ucp_put_bw", block_bytes);
      for (int clients : client_counts) {
        const size_t blocks = std::max<size_t>(
            1, static_cast<size_t>(per_client / static_cast<int64_t>(block_bytes)));
        const LoadShape shape{clients, absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_rounds),
                              block_bytes, blocks};
        std::vector<Result> inline_runs, redis_runs, bare_runs;
        std::vector<std::vector<Result>> ucx_runs(buffer_kinds.size());
        for (int rep = 0; rep < absl::GetFlag(FLAGS_repeats); ++rep) {
          redis_runs.push_back(proxima::bench::RunRedis(redis_port, redis, shape));
          bare_runs.push_back(run_bare(shape));
          // Every run stores chains of its own: a put of blocks already stored moves no bytes.
          for (size_t k = 0; k < buffer_kinds.size(); ++k) {
            LoadShape s = shape;
            s.ucx_buffers = buffer_kinds[k] == "ucx";
            s.host_staging = StagingOf(buffer_kinds[k]);
            s.ucx_messages = absl::GetFlag(FLAGS_ucx_messages);
            s.ucx_rendezvous_bytes = PutRendezvousBytes();
            s.ucx_rendezvous_get_bytes = GetRendezvousBytes();
            s.segments_per_block = absl::GetFlag(FLAGS_segments_per_block);
            s.key_seed = ++runs;
            ucx_runs[k].push_back(proxima::bench::RunProxima(target, daemon, s, Transport::kUcx));
          }
          LoadShape s = shape;
          s.key_seed = ++runs;
          inline_runs.push_back(proxima::bench::RunProxima(target, daemon, s, Transport::kInline));
        }
        Result inl = proxima::bench::Median(inline_runs);
        Result red = proxima::bench::Median(redis_runs);
        const Result bare = proxima::bench::Median(bare_runs);
        uint64_t ucx_errors = 0;
        for (size_t k = 0; k < buffer_kinds.size(); ++k) {
          Result ucx = proxima::bench::Median(ucx_runs[k]);
          ucx_errors += ucx.errors;
          PrintThroughput("put_throughput", name, buffer_kinds[k], block_bytes, clients,
                          ucx.put_gbps, perf_get, inl.put_gbps, red.put_gbps,
                          BareMove{bare_name, bare.put_gbps});
          PrintThroughput("get_throughput", name, buffer_kinds[k], block_bytes, clients,
                          ucx.get_gbps, perf_put, inl.get_gbps, red.get_gbps,
                          BareMove{bare_name, bare.get_gbps});
        }
        if (ucx_errors + inl.errors + red.errors + bare.errors > 0) {
          std::fprintf(stderr, "errors: ucx %llu, inline %llu, redis %llu, %s %llu\n",
                       static_cast<unsigned long long>(ucx_errors),
                       static_cast<unsigned long long>(inl.errors),
                       static_cast<unsigned long long>(red.errors), bare_name.c_str(),
                       static_cast<unsigned long long>(bare.errors));
          exit_code = 1;
        }
      }
    }
    // --latency_gets=0 skips the latency lines.
    auto [ip50, ip99] =
        absl::GetFlag(FLAGS_latency_gets) > 0
            ? GetLatency(target, Transport::kInline, false, proxima::client::HostStaging::kAuto)
            : std::pair<double, double>{-1, -1};
    for (const std::string& kind : buffer_kinds) {
      if (absl::GetFlag(FLAGS_latency_gets) <= 0) break;
      auto [p50, p99] = GetLatency(target, Transport::kUcx, kind == "ucx", StagingOf(kind));
      std::printf(
          "{\"bench\":\"transfer\",\"metric\":\"get_latency_2mib\",\"transport\":\"%s\","
          "\"buffers\":\"%s\",\"p50_us\":%.1f,\"p99_us\":%.1f,\"baseline\":\"inline\","
          "\"baseline_p50_us\":%.1f,\"baseline_p99_us\":%.1f,\"ratio_p50\":%.3f}\n",
          name.c_str(), kind.c_str(), p50, p99, ip50, ip99, p50 / ip50);
      std::fflush(stdout);
    }
    kill(daemon, SIGTERM);
    waitpid(daemon, nullptr, 0);
  }
  kill(redis, SIGTERM);
  waitpid(redis, nullptr, 0);
  kill(stream_server, SIGTERM);
  waitpid(stream_server, nullptr, 0);
  std::filesystem::remove_all(dir);
  return exit_code;
}
