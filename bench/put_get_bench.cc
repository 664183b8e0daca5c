// put_get_bench: inline-gRPC put/get throughput of proximad against Redis, same values, same
// client concurrency, same loopback TCP, measured in one run.
//
// Starts redis-server (persistence off) and proximad on free loopback ports, then for each block
// size: every client stores its own set of blocks (batches of --batch, pipelined for Redis),
// then reads them back --rounds times, checking every byte. Prints one JSON object per result:
//   {"bench":"put_get","metric":"get_throughput","block_bytes":2097152,"clients":4,
//    "value":1.9,"unit":"GB/s","baseline":"redis","baseline_value":1.2,"ratio":1.58}
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fcntl.h>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/log.h"

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

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using proxima::client::BlockKey;

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

pid_t Spawn(const std::vector<std::string>& argv, const std::string& log) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

// Runs `fn(client_index)` on every client thread at once; returns the wall seconds.
double RunClients(int clients, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  auto t0 = Clock::now();
  for (int c = 0; c < clients; ++c) threads.emplace_back(fn, c);
  for (auto& t : threads) t.join();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Result {
  double put_gbps = 0, get_gbps = 0;
  uint64_t errors = 0;
};

std::string RedisKey(int client, size_t i) { return absl::StrCat("c", client, ":", i); }

Result RunRedis(int port, uint64_t block_bytes, size_t blocks_per_client) {
  const int clients = absl::GetFlag(FLAGS_clients), batch = absl::GetFlag(FLAGS_batch);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  std::atomic<uint64_t> errors{0};
  auto connect = [&] { return redisConnect("127.0.0.1", port); };
  {
    redisContext* c = connect();
    redisReply* r = static_cast<redisReply*>(redisCommand(c, "FLUSHALL"));
    if (r) freeReplyObject(r);
    redisFree(c);
  }
  double put_s = RunClients(clients, [&](int id) {
    redisContext* c = connect();
    std::vector<char> block(block_bytes);
    for (size_t b = 0; b < blocks_per_client; b += batch) {
      size_t n = std::min<size_t>(batch, blocks_per_client - b);
      for (size_t i = b; i < b + n; ++i) {
        proxima::client::FillTestBlock(id, i, std::as_writable_bytes(std::span(block)));
        std::string key = RedisKey(id, i);
        redisAppendCommand(c, "SET %b %b", key.data(), key.size(), block.data(), block.size());
      }
      for (size_t i = 0; i < n; ++i) {
        void* reply = nullptr;
        if (redisGetReply(c, &reply) != REDIS_OK) ++errors;
        if (reply) freeReplyObject(reply);
      }
    }
    redisFree(c);
  });
  double get_s = RunClients(clients, [&](int id) {
    redisContext* c = connect();
    for (int round = 0; round < rounds; ++round) {
      for (size_t b = 0; b < blocks_per_client; b += batch) {
        size_t n = std::min<size_t>(batch, blocks_per_client - b);
        for (size_t i = b; i < b + n; ++i) {
          std::string key = RedisKey(id, i);
          redisAppendCommand(c, "GET %b", key.data(), key.size());
        }
        for (size_t i = b; i < b + n; ++i) {
          void* reply = nullptr;
          if (redisGetReply(c, &reply) != REDIS_OK) {
            ++errors;
            continue;
          }
          auto* r = static_cast<redisReply*>(reply);
          if (r->type != REDIS_REPLY_STRING ||
              !proxima::client::IsTestBlock(
                  id, i, std::as_bytes(std::span(r->str, static_cast<size_t>(r->len))))) {
            ++errors;
          }
          freeReplyObject(r);
        }
      }
    }
    redisFree(c);
  });
  double total = static_cast<double>(clients) * blocks_per_client * block_bytes;
  return {total / put_s / 1e9, total * rounds / get_s / 1e9, errors.load()};
}

Result RunProxima(const std::string& target, uint64_t block_bytes, size_t blocks_per_client) {
  const int clients = absl::GetFlag(FLAGS_clients), batch = absl::GetFlag(FLAGS_batch);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  std::atomic<uint64_t> errors{0};
  // A profile whose raw block is exactly block_bytes: 16 tokens x 8 heads x 128 dim x bf16 x K,V
  // is 64 KiB per layer.
  proxima::v1::ModelProfile model;
  model.set_num_kv_heads(8);
  model.set_head_dim(128);
  model.set_tokens_per_block(16);
  model.set_num_layers(static_cast<uint32_t>(block_bytes / (64 << 10)));
  model.set_dtype(proxima::v1::DTYPE_BF16);
  model.set_fingerprint(absl::StrCat("bench-", block_bytes));
  std::vector<std::unique_ptr<proxima::client::Client>> conns(clients);
  proxima::client::Profile profile;
  for (int c = 0; c < clients; ++c) {
    auto client = proxima::client::Client::Connect({.target = target});
    if (!client.ok()) {
      std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
      std::exit(1);
    }
    conns[c] = *std::move(client);
    profile = *conns[c]->RegisterProfile(model);
  }
  double put_s = RunClients(clients, [&](int id) {
    std::vector<std::vector<std::byte>> data(batch, std::vector<std::byte>(block_bytes));
    std::vector<BlockKey> keys = proxima::client::TestKeyChain(id, 0, blocks_per_client);
    for (size_t b = 0; b < blocks_per_client; b += batch) {
      size_t n = std::min<size_t>(batch, blocks_per_client - b);
      std::vector<std::span<const std::byte>> spans;
      for (size_t i = 0; i < n; ++i) {
        proxima::client::FillTestBlock(id, b + i, data[i]);
        spans.emplace_back(data[i]);
      }
      auto r = conns[id]->Put(profile, std::span(keys).subspan(b, n), spans);
      if (!r.ok()) ++errors;
    }
  });
  double get_s = RunClients(clients, [&](int id) {
    std::vector<std::vector<std::byte>> data(batch, std::vector<std::byte>(block_bytes));
    std::vector<BlockKey> keys = proxima::client::TestKeyChain(id, 0, blocks_per_client);
    for (int round = 0; round < rounds; ++round) {
      for (size_t b = 0; b < blocks_per_client; b += batch) {
        size_t n = std::min<size_t>(batch, blocks_per_client - b);
        std::vector<std::span<std::byte>> spans(data.begin(), data.begin() + n);
        auto found = conns[id]->Get(profile, std::span(keys).subspan(b, n), spans);
        if (!found.ok()) {
          ++errors;
          continue;
        }
        for (size_t i = 0; i < n; ++i) {
          if (!(*found)[i] || !proxima::client::IsTestBlock(id, b + i, data[i])) ++errors;
        }
      }
    }
  });
  double total = static_cast<double>(clients) * blocks_per_client * block_bytes;
  return {total / put_s / 1e9, total * rounds / get_s / 1e9, errors.load()};
}

// Per-metric median over repeated runs; errors add up.
Result Median(std::vector<Result> runs) {
  Result m;
  auto median = [&](double Result::*field) {
    std::vector<double> v;
    for (const Result& r : runs) v.push_back(r.*field);
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  m.put_gbps = median(&Result::put_gbps);
  m.get_gbps = median(&Result::get_gbps);
  for (const Result& r : runs) m.errors += r.errors;
  return m;
}

void Print(const char* metric, uint64_t block_bytes, const std::string& transport, double value,
           double baseline) {
  std::printf(
      "{\"bench\":\"put_get\",\"metric\":\"%s\",\"block_bytes\":%llu,\"clients\":%d,"
      "\"transport\":\"%s\",\"value\":%.3f,\"unit\":\"GB/s\",\"baseline\":\"redis\","
      "\"baseline_value\":%.3f,\"ratio\":%.3f}\n",
      metric, static_cast<unsigned long long>(block_bytes), absl::GetFlag(FLAGS_clients),
      transport.c_str(), value, baseline, value / baseline);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  proxima::log::SetMinLevel(proxima::log::Level::kWarning);
  signal(SIGPIPE, SIG_IGN);
  char tmpl[] = "/tmp/proxima-bench-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  const int redis_port = FreePort(), proxima_port = FreePort();
  pid_t redis = Spawn({absl::GetFlag(FLAGS_redis_server), "--port", std::to_string(redis_port),
                       "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir},
                      dir + "/redis.log");
  const int64_t per_client = absl::GetFlag(FLAGS_bytes_per_client);
  const uint64_t capacity = static_cast<uint64_t>(per_client) * absl::GetFlag(FLAGS_clients) * 2;
  pid_t daemon = Spawn({absl::GetFlag(FLAGS_proximad),
                        "--set=server.listen=127.0.0.1:" + std::to_string(proxima_port),
                        "--set=server.unix_socket=" + dir + "/proximad.sock",
                        "--set=server.metrics_listen=",
                        "--set=tiers.host.capacity_bytes=" + std::to_string(capacity)},
                       dir + "/proximad.log");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  int exit_code = 0;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',')) {
    uint64_t block_bytes = std::stoull(std::string(s));
    size_t blocks = static_cast<size_t>(per_client / static_cast<int64_t>(block_bytes));
    std::vector<Result> redis_runs, tcp_runs, uds_runs;
    for (int rep = 0; rep < absl::GetFlag(FLAGS_repeats); ++rep) {
      redis_runs.push_back(RunRedis(redis_port, block_bytes, blocks));
      tcp_runs.push_back(RunProxima(absl::StrCat("127.0.0.1:", proxima_port), block_bytes, blocks));
      uds_runs.push_back(RunProxima("unix:" + dir + "/proximad.sock", block_bytes, blocks));
    }
    Result redis_r = Median(redis_runs), tcp = Median(tcp_runs), uds = Median(uds_runs);
    Print("put_throughput", block_bytes, "tcp", tcp.put_gbps, redis_r.put_gbps);
    Print("get_throughput", block_bytes, "tcp", tcp.get_gbps, redis_r.get_gbps);
    Print("put_throughput", block_bytes, "unix", uds.put_gbps, redis_r.put_gbps);
    Print("get_throughput", block_bytes, "unix", uds.get_gbps, redis_r.get_gbps);
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
