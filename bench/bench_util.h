// Shared pieces of the benchmarks that drive proximad and Redis from several clients
// (put_get_bench, transfer_bench): child processes on free loopback ports, client threads,
// the Redis and proximad put/get loops (every byte checked), medians.
#ifndef PROXIMA_BENCH_BENCH_UTIL_H_
#define PROXIMA_BENCH_BENCH_UTIL_H_

#include <netinet/in.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "client/client.h"

namespace proxima::bench {

// 127.0.0.1:port (port 0: any).
sockaddr_in LoopbackAddress(int port);
// Starts argv[0] with stdout and stderr appended to `log`; the child inherits the environment.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& log);
// Runs `fn(client_index)` on every client thread at once; returns the wall seconds.
double RunClients(int clients, const std::function<void(int)>& fn);

// Wall seconds of a phase, and the CPU seconds (user + system) that this process and the server
// process spent in it: the cost of moving the bytes, which a loaded machine changes far less
// than it changes wall time.
struct PhaseTime {
  double wall_s = 0;
  double cpu_s = 0;         // this process (the clients) + the server
  double server_cpu_s = 0;  // the server alone
};

// RunClients, also counting this process's and `server`'s CPU time (`server` <= 0: this process
// only).
PhaseTime RunClientsTimed(int clients, pid_t server, const std::function<void(int)>& fn);

// CPU seconds (user + system, all threads) that process `pid` has used; 0 if it cannot be read.
double ProcessCpuSeconds(pid_t pid);

// What every client does: store `blocks_per_client` blocks of `block_bytes` in calls of
// `batch`, then read them all back `rounds` times. The blocks' bytes are made before the clock
// starts; every byte that comes back is compared with them.
struct LoadShape {
  int clients = 4;
  int batch = 4;
  int rounds = 3;
  uint64_t block_bytes = 0;
  size_t blocks_per_client = 0;
  // RunProxima: the clients' block buffers come from Client::AllocateMemory (memory UCX chose)
  // instead of ordinary memory registered with RegisterMemory.
  bool ucx_buffers = false;
  // RunProxima over UCX: the clients' ClientOptions::host_staging (heap buffers only).
  client::HostStaging host_staging = client::HostStaging::kAuto;
  // RunProxima over UCX: the clients' ClientOptions::ucx_messages, ucx_rendezvous_bytes and
  // ucx_rendezvous_get_bytes.
  bool ucx_messages = true;
  size_t ucx_rendezvous_bytes = client::ClientOptions{}.ucx_rendezvous_bytes;
  size_t ucx_rendezvous_get_bytes = client::ClientOptions{}.ucx_rendezvous_get_bytes;
  // RunProxima: each block in this many equal pieces (PutScattered / GetScattered), as an engine
  // that keeps one buffer per layer hands its blocks over; 1: one span per block.
  int segments_per_block = 1;
  // RunProxima: which test chains the clients store (client i stores chain key_seed << 16 | i).
  // Give every run on one daemon its own: a put of blocks already stored moves no bytes.
  uint64_t key_seed = 0;
};

struct Result {
  double put_gbps = 0, get_gbps = 0;  // aggregate over clients, 1e9 bytes per second
  // Client and server CPU seconds per 1e9 block bytes moved.
  double put_cpu_s_per_gb = 0, get_cpu_s_per_gb = 0;
  double get_server_cpu_s_per_gb = 0;  // the server's share of get_cpu_s_per_gb
  uint64_t errors = 0;                // failed calls and blocks that came back wrong
};

// A Result from a put phase that moved `bytes_per_pass` and a get phase that moved it `rounds`
// times.
Result PhasesResult(const PhaseTime& put, const PhaseTime& get, double bytes_per_pass, int rounds,
                    uint64_t errors);
// Redis on 127.0.0.1:port (process `server`): SET/GET pipelined `batch` deep.
Result RunRedis(int port, pid_t server, const LoadShape& shape);
// proximad at `target` (process `server`) with `transport`. Over UCX each client registers its
// buffers once.
Result RunProxima(const std::string& target, pid_t server, const LoadShape& shape,
                  client::Transport transport);
// The shared-memory copy's baseline: each client thread memcpy's its blocks (made and touched
// before the clock starts) into a store of the same size block by block, then back `rounds`
// times: every byte moved once through memory, in this process, as the daemon's copy through
// a client's mapped segment moves it, with no checksum and no call. `errors` counts clients
// whose bytes did not come back equal.
Result RunMemcpy(const LoadShape& shape);
// Per-metric median over repeated runs; errors add up.
Result Median(std::vector<Result> runs);
// A profile whose raw block is exactly block_bytes (a multiple of 64 KiB).
v1::ModelProfile BenchModel(uint64_t block_bytes);

}  // namespace proxima::bench

#endif  // PROXIMA_BENCH_BENCH_UTIL_H_
