// FreeLoopbackPort: a TCP port on 127.0.0.1 for a server that a test or benchmark starts as a
// child process and must name before it starts (daemons that list each other as peers, Redis,
// proximad). Picked at random below the kernel's ephemeral range (net.ipv4.ip_local_port_range):
// a port from that range can be handed out, before its server binds it, to any process that
// binds port 0 (the servers of the tests running beside this one) or connects out (as its source
// port), and the server's bind then fails with "address in use" (seen once in CI, in
// ClusterTest.AfterOneCallTimesOutOnAHungPeerTheNextOnesDoNotWaitForIt). Falls back to a port
// from the ephemeral range when there is no room below it. A port is free when returned, not
// reserved: two calls can return the same one before either server binds it, so a caller that
// starts several servers takes their ports from one FreeLoopbackPorts call.
#ifndef PROXIMA_COMMON_TESTING_FREE_PORT_H_
#define PROXIMA_COMMON_TESTING_FREE_PORT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <random>
#include <vector>

namespace proxima::testing {

// Binds a loopback TCP socket to `port` (0: one the kernel picks), closes it and returns the port
// bound, or 0 when the bind fails.
inline int BindLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  int bound = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    socklen_t len = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    bound = ntohs(addr.sin_port);
  }
  close(fd);
  return bound;
}

inline int FreeLoopbackPort() {
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  if (low > 10000 + 1000) {
    thread_local std::mt19937 rng(std::random_device{}());
    std::uniform_int_distribution<int> pick(10000, low - 1);
    for (int attempt = 0; attempt < 100; ++attempt) {
      if (const int port = BindLoopback(pick(rng)); port != 0) return port;
    }
  }
  return BindLoopback(0);
}

// `n` distinct ports, each as FreeLoopbackPort picks it.
inline std::vector<int> FreeLoopbackPorts(int n) {
  std::vector<int> ports;
  while (static_cast<int>(ports.size()) < n) {
    const int port = FreeLoopbackPort();
    bool taken = false;
    for (int p : ports) taken |= p == port;
    if (!taken) ports.push_back(port);
  }
  return ports;
}

}  // namespace proxima::testing

#endif  // PROXIMA_COMMON_TESTING_FREE_PORT_H_
