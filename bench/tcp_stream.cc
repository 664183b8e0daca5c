#include "bench/tcp_stream.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace proxima::bench {
namespace {

// A header is three little-endian words: the operation, an offset into the connection's store
// and a byte count. kSize (re)sizes the store to `bytes`; kPut receives `bytes` at `offset` and
// answers one byte; kGet sends `bytes` from `offset`.
enum Op : uint64_t { kSize = 0, kPut = 1, kGet = 2 };
struct Header {
  uint64_t op = 0, offset = 0, bytes = 0;
};
constexpr uint64_t kMaxStore = uint64_t{16} << 30;

// Moves all of [p, p + n) through fd; false when the peer closed or the call failed.
bool Full(int fd, char* p, size_t n, bool send) {
  while (n > 0) {
    const ssize_t r = send ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void NoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void ServeConnection(int fd) {
  std::vector<char> store;
  Header h;
  while (Full(fd, reinterpret_cast<char*>(&h), sizeof(h), false)) {
    if (h.op == kSize) {
      if (h.bytes > kMaxStore) break;
      store.assign(h.bytes, 0);  // touched now, not in the timed phases
      continue;
    }
    if (h.offset > store.size() || h.bytes > store.size() - h.offset) break;
    char* at = store.data() + h.offset;
    if (h.op == kPut) {
      char ack = 1;
      if (!Full(fd, at, h.bytes, false) || !Full(fd, &ack, 1, true)) break;
    } else if (h.op == kGet) {
      if (!Full(fd, at, h.bytes, true)) break;
    } else {
      break;
    }
  }
  close(fd);
}

}  // namespace

void ServeTcpStream(int port) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const sockaddr_in a = LoopbackAddress(port);
  if (bind(listener, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0 ||
      listen(listener, 64) != 0) {
    std::perror("tcp stream server: bind/listen on 127.0.0.1");
    std::exit(1);
  }
  for (;;) {
    const int fd = accept(listener, nullptr, nullptr);
    if (fd < 0) continue;
    NoDelay(fd);
    std::thread(ServeConnection, fd).detach();
  }
}

Result RunTcpStream(int port, pid_t server, const LoadShape& shape) {
  const int clients = shape.clients, rounds = shape.rounds;
  const uint64_t block_bytes = shape.block_bytes;
  const size_t blocks = shape.blocks_per_client;
  const uint64_t store = blocks * block_bytes;
  std::atomic<uint64_t> errors{0};
  // Connections, stores and client buffers are set up before the clocks start.
  std::vector<int> fds(clients, -1);
  std::vector<std::vector<char>> data(clients, std::vector<char>(store, 1));
  for (int id = 0; id < clients; ++id) {
    fds[id] = socket(AF_INET, SOCK_STREAM, 0);
    const sockaddr_in a = LoopbackAddress(port);
    Header h{kSize, 0, store};
    if (connect(fds[id], reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0 ||
        !Full(fds[id], reinterpret_cast<char*>(&h), sizeof(h), true)) {
      ++errors;
      close(fds[id]);
      fds[id] = -1;
      continue;
    }
    NoDelay(fds[id]);
  }
  // Moves every block of client `id` once, `batch` blocks per request.
  auto pass = [&](int id, Op op) {
    const int fd = fds[id];
    if (fd < 0) return false;
    for (size_t b = 0; b < blocks; b += shape.batch) {
      const uint64_t n = std::min<size_t>(shape.batch, blocks - b) * block_bytes;
      Header h{op, b * block_bytes, n};
      char* at = data[id].data() + h.offset;
      char ack = 0;
      if (!Full(fd, reinterpret_cast<char*>(&h), sizeof(h), true) || !Full(fd, at, n, op == kPut) ||
          (op == kPut && !Full(fd, &ack, 1, false))) {
        return false;
      }
    }
    return true;
  };
  // One untimed round trip of every block first: loopback TCP grows a connection's buffers as
  // it carries data, and long-lived connections (UCX's, proximad's) have grown theirs.
  RunClients(clients, [&](int id) {
    if (!pass(id, kPut) || !pass(id, kGet)) ++errors;
  });
  const PhaseTime put = RunClientsTimed(clients, server, [&](int id) {
    if (!pass(id, kPut)) ++errors;
  });
  const PhaseTime get = RunClientsTimed(clients, server, [&](int id) {
    for (int r = 0; r < rounds; ++r) {
      if (!pass(id, kGet)) {
        ++errors;
        return;
      }
    }
  });
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
  return PhasesResult(put, get, static_cast<double>(clients) * store, rounds, errors.load());
}

}  // namespace proxima::bench
