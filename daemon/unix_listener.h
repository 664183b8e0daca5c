// UnixListener: proximad's Unix-domain socket, accepted by the daemon itself and handed to the
// gRPC server one connection at a time (grpc::AddInsecureChannelFromFd).
//
// gRPC's own Unix listener gives every connection the kernel's default send buffer
// (net.core.wmem_default, 208 KiB on most hosts). A Get answer of megabytes then leaves the
// daemon 100 KiB at a time, each followed by a sleep until the worker has read it; the daemon
// spent about half again as much CPU per GB over the socket as over loopback TCP, whose buffers
// grow on their own. Accepting here lets the daemon size each connection's send buffer
// (server.unix_socket_send_buffer) before gRPC sees it.
//
// The socket file is created with server.unix_socket_mode from the start (umask during bind),
// a stale file of a dead daemon is replaced, a live daemon's socket is never taken over, and the
// file is removed when the listener is destroyed.
//
// Thread-safe: Start and Stop may be called from any thread, once each.
#ifndef PROXIMA_DAEMON_UNIX_LISTENER_H_
#define PROXIMA_DAEMON_UNIX_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace grpc {
class Server;
}

namespace proxima::daemon {

class UnixListener {
 public:
  struct Options {
    std::string path;                // absolute path of the socket file
    mode_t mode = 0660;              // its file mode
    uint64_t send_buffer_bytes = 0;  // SO_SNDBUF of each connection; 0 = the kernel's default
  };

  // Binds and listens; nothing is accepted before Start(). Errors name server.unix_socket.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Create(const Options& options);
  ~UnixListener();  // Stop(), then the socket file is removed

  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Accepts connections on a thread of its own and adds each to `server`, which must be started
  // and outlive Stop().
  void Start(grpc::Server* server);
  // Stops accepting (connecting clients are refused from now on); connections already handed to
  // gRPC stay with it. Returns once the accept thread has ended.
  void Stop();

  // The send buffer the kernel actually gave the last accepted connection (it caps requests at
  // net.core.wmem_max unless the daemon may override it); 0 before the first connection.
  uint64_t effective_send_buffer_bytes() const { return effective_send_buffer_.load(); }
  uint64_t connections_accepted() const { return accepted_.load(); }

 private:
  UnixListener(Options options, int listen_fd, int wake_fd);
  void AcceptLoop(grpc::Server* server);

  const Options options_;
  int listen_fd_;
  const int wake_fd_;  // an eventfd: written by Stop() to end the accept thread's poll
  std::thread thread_;
  std::atomic<bool> stopped_{false};
  std::atomic<uint64_t> effective_send_buffer_{0};
  std::atomic<uint64_t> accepted_{0};
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_UNIX_LISTENER_H_
