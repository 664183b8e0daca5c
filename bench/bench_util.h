// Shared pieces of the benchmarks that drive proximad and Redis from several clients
// (put_get_bench, transfer_bench): child processes on free loopback ports, client threads,
// the Redis and proximad put/get loops (every byte checked), medians.
#ifndef PROXIMA_BENCH_BENCH_UTIL_H_
#define PROXIMA_BENCH_BENCH_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "client/client.h"

namespace proxima::bench {

// A free TCP port on 127.0.0.1 (bound and released).
int FreePort();
// Starts argv[0] with stdout and stderr appended to `log`; the child inherits the environment.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& log);
// Runs `fn(client_index)` on every client thread at once; returns the wall seconds.
double RunClients(int clients, const std::function<void(int)>& fn);

// What every client does: store `blocks_per_client` blocks of `block_bytes` in calls of
// `batch`, then read them all back `rounds` times.
struct LoadShape {
  int clients = 4;
  int batch = 4;
  int rounds = 3;
  uint64_t block_bytes = 0;
  size_t blocks_per_client = 0;
};

struct Result {
  double put_gbps = 0, get_gbps = 0;  // aggregate over clients, 1e9 bytes per second
  uint64_t errors = 0;                // failed calls and blocks that came back wrong
};

// Redis on 127.0.0.1:port: SET/GET pipelined `batch` deep.
Result RunRedis(int port, const LoadShape& shape);
// proximad at `target` with `transport`. Over UCX each client registers its buffers once.
Result RunProxima(const std::string& target, const LoadShape& shape, client::Transport transport);
// Per-metric median over repeated runs; errors add up.
Result Median(std::vector<Result> runs);
// A profile whose raw block is exactly block_bytes (a multiple of 64 KiB).
v1::ModelProfile BenchModel(uint64_t block_bytes);

}  // namespace proxima::bench

#endif  // PROXIMA_BENCH_BENCH_UTIL_H_
