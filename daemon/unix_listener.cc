#include "daemon/unix_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace proxima::daemon {
namespace {

// Prepares `path` for bind(): creates its directory, and removes a stale socket left by a daemon
// that died, but refuses to take over a socket that a live server still answers on.
absl::Status PrepareSocketPath(const std::string& path) {
  std::error_code ec;
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat(
        "server.unix_socket '", path, "': cannot create directory '", dir.string(), "': ",
        ec.message()));
  }
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();  // nothing there
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("server.unix_socket '", path, "' exists and is not a socket"));
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  bool live = fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  if (fd >= 0) close(fd);
  if (live) {
    return absl::FailedPreconditionError(absl::StrCat(
        "server.unix_socket '", path, "' is in use by a running server; stop it or pick "
        "another path"));
  }
  unlink(path.c_str());
  return absl::OkStatus();
}

absl::Status SocketError(const std::string& path, const char* what) {
  return absl::UnavailableError(
      absl::StrCat("server.unix_socket '", path, "': ", what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Create(const Options& options) {
  if (absl::Status s = PrepareSocketPath(options.path); !s.ok()) return s;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return SocketError(options.path, "socket");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, options.path.c_str(), sizeof(addr.sun_path) - 1);
  // bind() creates the file: a umask for just that moment makes it born with the configured
  // mode, with no window in which others could connect; chmod then sets what umask cannot
  // express (e.g. setgid bits).
  const mode_t old_umask = umask(0777 & ~options.mode);
  const int bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  umask(old_umask);
  if (bound != 0) {
    absl::Status s = SocketError(options.path, "bind");
    close(fd);
    return s;
  }
  if (chmod(options.path.c_str(), options.mode) != 0) {
    absl::Status s = absl::FailedPreconditionError(absl::StrCat(
        "chmod of server.unix_socket '", options.path, "': ", std::strerror(errno)));
    close(fd);
    unlink(options.path.c_str());
    return s;
  }
  if (listen(fd, SOMAXCONN) != 0) {
    absl::Status s = SocketError(options.path, "listen");
    close(fd);
    unlink(options.path.c_str());
    return s;
  }
  int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    absl::Status s = SocketError(options.path, "eventfd");
    close(fd);
    unlink(options.path.c_str());
    return s;
  }
  return std::unique_ptr<UnixListener>(new UnixListener(options, fd, wake));
}

UnixListener::UnixListener(Options options, int listen_fd, int wake_fd)
    : options_(std::move(options)), listen_fd_(listen_fd), wake_fd_(wake_fd) {}

UnixListener::~UnixListener() {
  Stop();
  close(wake_fd_);
  unlink(options_.path.c_str());
}

void UnixListener::Start(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixListener::Stop() {
  if (stopped_.exchange(true)) return;
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    PROXIMA_LOG(kError) << "cannot wake the Unix socket's accept thread"
                        << log::Kv("error", std::strerror(errno));
  }
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);  // from now on connecting clients are refused
  listen_fd_ = -1;
}

void UnixListener::AcceptLoop(grpc::Server* server) {
  const int wanted = static_cast<int>(std::min<uint64_t>(options_.send_buffer_bytes, INT_MAX / 2));
  bool told_effective = false;
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      PROXIMA_LOG(kError) << "Unix socket: poll failed; no longer accepting"
                          << log::Kv("error", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;  // Stop()
    while (true) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          // EMFILE and the like: the connection waits in the backlog; try again shortly
          // instead of spinning on a listener that stays readable.
          const int err = errno;
          PROXIMA_LOG_EVERY(kWarning, 10) << "Unix socket: cannot accept a connection now"
                                          << log::Kv("error", std::strerror(err));
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        break;
      }
      if (wanted > 0) {
        // SO_SNDBUFFORCE passes net.core.wmem_max when the daemon may (CAP_NET_ADMIN);
        // otherwise SO_SNDBUF, which the kernel caps there.
        if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &wanted, sizeof(wanted)) != 0) {
          setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &wanted, sizeof(wanted));
        }
      }
      int effective = 0;
      socklen_t len = sizeof(effective);
      if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &effective, &len) == 0) {
        // Linux reports twice the usable size (it counts its bookkeeping too).
        effective_send_buffer_.store(static_cast<uint64_t>(effective) / 2);
        if (!told_effective && wanted > 0 && effective / 2 < wanted) {
          PROXIMA_LOG(kWarning)
              << "Unix socket connections get a smaller send buffer than "
                 "server.unix_socket_send_buffer asks for (raise net.core.wmem_max, or give "
                 "proximad CAP_NET_ADMIN)"
              << log::Kv("requested_bytes", wanted) << log::Kv("granted_bytes", effective / 2);
        }
        told_effective = true;
      }
      accepted_.fetch_add(1);
      grpc::AddInsecureChannelFromFd(server, fd);  // gRPC owns `fd` from here
    }
  }
}

}  // namespace proxima::daemon
