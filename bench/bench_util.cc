#include "bench/bench_util.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/test_pattern.h"

extern char** environ;

namespace proxima::bench {

using Clock = std::chrono::steady_clock;
using proxima::client::BlockKey;

sockaddr_in LoopbackAddress(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
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

double ProcessCpuSeconds(pid_t pid) {
  // /proc/PID/stat: fields 14 and 15 are utime and stime in clock ticks; field 2 (comm) is in
  // parentheses and may hold spaces, so count fields after its closing parenthesis.
  std::ifstream in(pid > 0 ? absl::StrCat("/proc/", pid, "/stat") : std::string("/proc/self/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

PhaseTime RunClientsTimed(int clients, pid_t server, const std::function<void(int)>& fn) {
  auto server_cpu = [server] { return server > 0 ? ProcessCpuSeconds(server) : 0.0; };
  const double self0 = ProcessCpuSeconds(0), server0 = server_cpu();
  PhaseTime t;
  t.wall_s = RunClients(clients, fn);
  t.server_cpu_s = server_cpu() - server0;
  t.cpu_s = ProcessCpuSeconds(0) - self0 + t.server_cpu_s;
  return t;
}

Result PhasesResult(const PhaseTime& put, const PhaseTime& get, double bytes_per_pass, int rounds,
                    uint64_t errors) {
  const double got = bytes_per_pass * rounds;
  return {bytes_per_pass / put.wall_s / 1e9,  got / get.wall_s / 1e9,
          put.cpu_s / (bytes_per_pass / 1e9), get.cpu_s / (got / 1e9),
          get.server_cpu_s / (got / 1e9),     errors};
}

std::string RedisKey(int client, size_t i) { return absl::StrCat("c", client, ":", i); }

Result RunRedis(int port, pid_t server, const LoadShape& shape) {
  const int clients = shape.clients, batch = shape.batch, rounds = shape.rounds;
  const uint64_t block_bytes = shape.block_bytes;
  const size_t blocks_per_client = shape.blocks_per_client;
  std::atomic<uint64_t> errors{0};
  auto connect = [&] { return redisConnect("127.0.0.1", port); };
  {
    redisContext* c = connect();
    redisReply* r = static_cast<redisReply*>(redisCommand(c, "FLUSHALL"));
    if (r) freeReplyObject(r);
    redisFree(c);
  }
  // Every client's blocks are in memory before the clock starts, and what comes back is compared
  // with them, as for proximad below.
  std::vector<std::vector<char>> data(clients);
  for (int id = 0; id < clients; ++id) {
    data[id].resize(blocks_per_client * block_bytes);
    for (size_t i = 0; i < blocks_per_client; ++i) {
      proxima::client::FillTestBlock(
          id, i, std::as_writable_bytes(std::span(data[id]).subspan(i * block_bytes, block_bytes)));
    }
  }
  const PhaseTime put = RunClientsTimed(clients, server, [&](int id) {
    redisContext* c = connect();
    for (size_t b = 0; b < blocks_per_client; b += batch) {
      size_t n = std::min<size_t>(batch, blocks_per_client - b);
      for (size_t i = b; i < b + n; ++i) {
        std::string key = RedisKey(id, i);
        redisAppendCommand(c, "SET %b %b", key.data(), key.size(),
                           data[id].data() + i * block_bytes, static_cast<size_t>(block_bytes));
      }
      for (size_t i = 0; i < n; ++i) {
        void* reply = nullptr;
        if (redisGetReply(c, &reply) != REDIS_OK) ++errors;
        if (reply) freeReplyObject(reply);
      }
    }
    redisFree(c);
  });
  const PhaseTime get = RunClientsTimed(clients, server, [&](int id) {
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
          if (r->type != REDIS_REPLY_STRING || static_cast<uint64_t>(r->len) != block_bytes ||
              std::memcmp(r->str, data[id].data() + i * block_bytes, block_bytes) != 0) {
            ++errors;
          }
          freeReplyObject(r);
        }
      }
    }
    redisFree(c);
  });
  return PhasesResult(put, get, static_cast<double>(clients) * blocks_per_client * block_bytes,
                      rounds, errors.load());
}

v1::ModelProfile BenchModel(uint64_t block_bytes) {
  // 16 tokens x 8 heads x 128 dim x bf16 x K,V is 64 KiB per layer.
  proxima::v1::ModelProfile model;
  model.set_num_kv_heads(8);
  model.set_head_dim(128);
  model.set_tokens_per_block(16);
  model.set_num_layers(static_cast<uint32_t>(block_bytes / (64 << 10)));
  model.set_dtype(proxima::v1::DTYPE_BF16);
  model.set_fingerprint(absl::StrCat("bench-", block_bytes));
  return model;
}

namespace {

// Each block cut into `pieces` equal consecutive spans (the last takes the remainder).
template <typename Byte>
std::vector<std::vector<std::span<Byte>>> CutInPieces(std::span<const std::span<Byte>> blocks,
                                                      int pieces) {
  std::vector<std::vector<std::span<Byte>>> out;
  for (std::span<Byte> block : blocks) {
    std::vector<std::span<Byte>>& cut = out.emplace_back();
    const size_t each = block.size() / pieces;
    for (int k = 0; k < pieces; ++k) {
      cut.push_back(block.subspan(k * each, k + 1 < pieces ? each : block.size() - k * each));
    }
  }
  return out;
}

}  // namespace

Result RunProxima(const std::string& target, pid_t server, const LoadShape& shape,
                  client::Transport transport) {
  const int clients = shape.clients, batch = shape.batch, rounds = shape.rounds;
  const int pieces = std::max(shape.segments_per_block, 1);
  const uint64_t block_bytes = shape.block_bytes;
  const size_t blocks_per_client = shape.blocks_per_client;
  std::atomic<uint64_t> errors{0};
  const proxima::v1::ModelProfile model = BenchModel(block_bytes);
  std::vector<std::unique_ptr<proxima::client::Client>> conns(clients);
  proxima::client::Profile profile;
  for (int c = 0; c < clients; ++c) {
    auto client = proxima::client::Client::Connect(
        {.target = target,
         .transport = transport,
         .host_staging = shape.host_staging,
         .ucx_messages = shape.ucx_messages,
         .ucx_rendezvous_bytes = shape.ucx_rendezvous_bytes,
         .ucx_rendezvous_get_bytes = shape.ucx_rendezvous_get_bytes});
    if (!client.ok()) {
      std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
      std::exit(1);
    }
    conns[c] = *std::move(client);
    profile = *conns[c]->RegisterProfile(model);
  }
  // Each client's buffers, registered once for UCX (as a worker registers its staging buffer), or
  // allocated by UCX: one per block of a call, reused call after call.
  std::vector<std::vector<client::TestBuffer>> owned(clients);
  std::vector<std::vector<std::span<std::byte>>> buffers(clients);
  for (int c = 0; c < clients; ++c) {
    for (int i = 0; i < batch; ++i) {
      auto b = client::MakeTestBuffer(*conns[c], block_bytes, shape.ucx_buffers);
      if (!b.ok()) {
        std::fprintf(stderr, "block buffer: %s\n", b.status().ToString().c_str());
        std::exit(1);
      }
      buffers[c].push_back(b->bytes);
      owned[c].push_back(*std::move(b));
    }
  }
  // The blocks' bytes are made before the clock starts (the test pattern's generator runs at about
  // the speed being measured; timing it would count it against every system alike): a put copies
  // them into its buffers, as a worker gathers blocks into its staging buffer, and a get's bytes
  // are compared with them.
  auto chain_of = [&shape](int id) { return (shape.key_seed << 16) | static_cast<uint64_t>(id); };
  std::vector<std::vector<BlockKey>> keys(clients);
  std::vector<std::vector<std::byte>> blocks(clients);
  for (int c = 0; c < clients; ++c) {
    keys[c] = proxima::client::TestKeyChain(chain_of(c), 0, blocks_per_client);
    blocks[c].resize(blocks_per_client * block_bytes);
    for (size_t i = 0; i < blocks_per_client; ++i) {
      proxima::client::FillTestBlock(chain_of(c), i,
                                     std::span(blocks[c]).subspan(i * block_bytes, block_bytes));
    }
  }
  const PhaseTime put = RunClientsTimed(clients, server, [&](int id) {
    std::vector<std::span<std::byte>>& data = buffers[id];
    for (size_t b = 0; b < blocks_per_client; b += batch) {
      size_t n = std::min<size_t>(batch, blocks_per_client - b);
      std::vector<std::span<const std::byte>> spans;
      for (size_t i = 0; i < n; ++i) {
        std::memcpy(data[i].data(), blocks[id].data() + (b + i) * block_bytes, block_bytes);
        spans.emplace_back(data[i]);
      }
      auto r = pieces > 1 ? conns[id]->PutScattered(profile, std::span(keys[id]).subspan(b, n),
                                                    CutInPieces<const std::byte>(spans, pieces))
                          : conns[id]->Put(profile, std::span(keys[id]).subspan(b, n), spans);
      if (!r.ok()) ++errors;
    }
  });
  const PhaseTime get = RunClientsTimed(clients, server, [&](int id) {
    std::vector<std::span<std::byte>>& data = buffers[id];
    for (int round = 0; round < rounds; ++round) {
      for (size_t b = 0; b < blocks_per_client; b += batch) {
        size_t n = std::min<size_t>(batch, blocks_per_client - b);
        std::vector<std::span<std::byte>> spans(data.begin(), data.begin() + n);
        auto found = pieces > 1
                         ? conns[id]->GetScattered(profile, std::span(keys[id]).subspan(b, n),
                                                   CutInPieces<std::byte>(spans, pieces))
                         : conns[id]->Get(profile, std::span(keys[id]).subspan(b, n), spans);
        if (!found.ok()) {
          ++errors;
          continue;
        }
        for (size_t i = 0; i < n; ++i) {
          if (!(*found)[i] || std::memcmp(data[i].data(), blocks[id].data() + (b + i) * block_bytes,
                                          block_bytes) != 0) {
            ++errors;
          }
        }
      }
    }
  });
  // Untimed: the run's blocks go, so every run starts from the same occupancy (and no run pays
  // for evicting an earlier run's blocks; Redis never evicts here).
  for (int id = 0; id < clients; ++id) {
    for (size_t b = 0; b < blocks_per_client; b += 64) {
      const size_t n = std::min<size_t>(64, blocks_per_client - b);
      if (!conns[id]->Delete(profile, std::span(keys[id]).subspan(b, n)).ok()) ++errors;
    }
  }
  owned.clear();  // before the clients
  return PhasesResult(put, get, static_cast<double>(clients) * blocks_per_client * block_bytes,
                      rounds, errors.load());
}

Result RunMemcpy(const LoadShape& shape) {
  const int clients = shape.clients, rounds = shape.rounds;
  const size_t bytes = shape.blocks_per_client * shape.block_bytes;
  // A client's blocks and the store's copy of them, both touched before the clocks start.
  std::vector<std::vector<char>> blocks(clients, std::vector<char>(bytes, 1));
  std::vector<std::vector<char>> store(clients, std::vector<char>(bytes, 2));
  auto pass = [&](char* to, const char* from) {
    for (size_t off = 0; off < bytes; off += shape.block_bytes) {
      std::memcpy(to + off, from + off, std::min<size_t>(shape.block_bytes, bytes - off));
    }
  };
  // One untimed round trip first, as the other systems' connections and arenas are warm.
  RunClients(clients, [&](int id) {
    pass(store[id].data(), blocks[id].data());
    pass(blocks[id].data(), store[id].data());
  });
  const PhaseTime put =
      RunClientsTimed(clients, 0, [&](int id) { pass(store[id].data(), blocks[id].data()); });
  const PhaseTime get = RunClientsTimed(clients, 0, [&](int id) {
    for (int r = 0; r < rounds; ++r) pass(blocks[id].data(), store[id].data());
  });
  uint64_t errors = 0;
  for (int id = 0; id < clients; ++id) errors += blocks[id] != store[id] ? 1 : 0;
  return PhasesResult(put, get, static_cast<double>(clients) * bytes, rounds, errors);
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
  m.put_cpu_s_per_gb = median(&Result::put_cpu_s_per_gb);
  m.get_cpu_s_per_gb = median(&Result::get_cpu_s_per_gb);
  m.get_server_cpu_s_per_gb = median(&Result::get_server_cpu_s_per_gb);
  for (const Result& r : runs) m.errors += r.errors;
  return m;
}

}  // namespace proxima::bench
