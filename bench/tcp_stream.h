// transfer_bench's bare TCP stream: what a request/response mover that does nothing but hand
// bytes to the kernel and take them back reaches over 127.0.0.1, at the same block size, batch
// and client count as the systems measured beside it. A put sends a small header and the batch's
// bytes and waits for a one-byte answer; a get sends a header and reads the batch's bytes. No
// checksum, no copy of its own, no check of what comes back, one connection per client: what a
// TCP-based data path (Redis, inline gRPC, UCX's tcp transport) pays the kernel alone.
#ifndef PROXIMA_BENCH_TCP_STREAM_H_
#define PROXIMA_BENCH_TCP_STREAM_H_

#include <sys/types.h>

#include "bench/bench_util.h"

namespace proxima::bench {

// Serves the stream protocol on 127.0.0.1:port, one thread per connection, until killed. Each
// connection keeps its own store, sized by the client's first header. Never returns; exits 1 if
// the port cannot be bound.
[[noreturn]] void ServeTcpStream(int port);

// Drives the server at 127.0.0.1:port (process `server`) with `shape`: every client stores
// blocks_per_client blocks in calls of `batch`, then reads them back `rounds` times. Result as
// RunRedis gives it; `errors` counts connections that failed.
Result RunTcpStream(int port, pid_t server, const LoadShape& shape);

}  // namespace proxima::bench

#endif  // PROXIMA_BENCH_TCP_STREAM_H_
