#include "daemon/metrics_http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/log.h"

namespace proxima::metrics {
namespace {

// A client has this long to send its request, and then this long to read the answer; past it
// the connection is closed. Connections are served together, so a slow or silent one delays no
// other.
constexpr auto kReadDeadline = std::chrono::seconds(2);
constexpr auto kSendDeadline = std::chrono::seconds(10);
constexpr size_t kMaxRequestBytes = 8192;
// Connections served at once; more wait in the listen backlog.
constexpr size_t kMaxConnections = 64;

std::string Response(absl::string_view status, absl::string_view content_type,
                     absl::string_view body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host_port, const Registry* registry) {
  size_t colon = host_port.rfind(':');
  std::string host = host_port.substr(0, colon);
  std::string port_text = host_port.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", host_port, "': ", gai_strerror(rc)));
  }
  // Non-blocking: the server accepts until the backlog is empty.
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return absl::InternalError(absl::StrCat("socket(): ", std::strerror(errno)));
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, 16) != 0) {
    int err = errno;
    freeaddrinfo(res);
    ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen for metrics on '", host_port, "': ", std::strerror(err)));
  }
  freeaddrinfo(res);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  int port = bound.ss_family == AF_INET6
                 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                 : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  auto server = std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(fd, port, registry));
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

MetricsHttpServer::MetricsHttpServer(int listen_fd, int port, const Registry* registry)
    : listen_fd_(listen_fd), port_(port), registry_(registry) {}

MetricsHttpServer::~MetricsHttpServer() {
  Stop();
  ::close(listen_fd_);
}

void MetricsHttpServer::Stop() {
  stopping_.store(true);
  if (thread_.joinable()) thread_.join();
}

void MetricsHttpServer::Serve() {
  using Clock = std::chrono::steady_clock;
  struct Connection {
    int fd;
    Clock::time_point deadline;  // to read the request; once answered, to send the answer
    std::string request;
    std::string answer;  // empty until the request is read
    size_t sent = 0;
  };
  std::vector<Connection> connections;
  Clock::time_point accept_after{};  // after an accept that failed (EMFILE): not before
  std::vector<pollfd> fds;
  while (!stopping_.load()) {
    Clock::time_point now = Clock::now();
    const bool accepting = connections.size() < kMaxConnections && now >= accept_after;
    fds.clear();
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});  // poll skips a negative fd
    for (const Connection& c : connections) {
      fds.push_back({c.fd, static_cast<short>(c.answer.empty() ? POLLIN : POLLOUT), 0});
    }
    // Wakes up regularly to notice Stop(), deadlines and the end of an accept pause.
    if (::poll(fds.data(), fds.size(), 100) < 0 && errno != EINTR) {
      PROXIMA_LOG_EVERY(kError, 10)
          << "metrics: poll failed" << log::Kv("error", std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    now = Clock::now();
    // Backwards, so that removing one (the last moves into its place) leaves those still to
    // visit where they were.
    for (size_t i = connections.size(); i-- > 0;) {
      Connection& c = connections[i];
      bool done = now >= c.deadline;
      if (!done && fds[i + 1].revents != 0 && c.answer.empty()) {
        char buf[2048];
        const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
        if (n > 0) {
          c.request.append(buf, static_cast<size_t>(n));
          if (c.request.find("\r\n\r\n") != std::string::npos ||
              c.request.size() >= kMaxRequestBytes) {
            c.answer = Answer(c.request);
            c.deadline = now + kSendDeadline;
          }
        } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          done = true;  // closed or failed before a whole request
        }
      }
      if (!done && !c.answer.empty()) {
        const ssize_t n =
            ::send(c.fd, c.answer.data() + c.sent, c.answer.size() - c.sent, MSG_NOSIGNAL);
        if (n > 0) {
          c.sent += static_cast<size_t>(n);
          done = c.sent == c.answer.size();
        } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          done = true;
        }
      }
      if (done) {
        ::close(c.fd);
        if (i + 1 != connections.size()) c = std::move(connections.back());
        connections.pop_back();
      }
    }
    if (!accepting || (fds[0].revents & POLLIN) == 0) continue;
    while (connections.size() < kMaxConnections) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          // EMFILE and the like: the connection waits in the backlog. Pause accepting, or the
          // listener, readable all along, would have this thread spin.
          const int err = errno;
          PROXIMA_LOG_EVERY(kWarning, 10)
              << "metrics: cannot accept a connection now" << log::Kv("error", std::strerror(err));
          accept_after = now + std::chrono::milliseconds(100);
        }
        break;
      }
      connections.push_back({fd, now + kReadDeadline, {}, {}, 0});
    }
  }
  for (const Connection& c : connections) ::close(c.fd);
}

std::string MetricsHttpServer::Answer(absl::string_view request) const {
  absl::string_view line(request);
  line = line.substr(0, line.find("\r\n"));
  if (!absl::StartsWith(line, "GET ")) {
    return Response("405 Method Not Allowed", "text/plain", "only GET is served\n");
  }
  absl::string_view path = line.substr(4, line.find(' ', 4) - 4);
  path = path.substr(0, path.find('?'));
  if (path == "/metrics") {
    return Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", registry_->RenderText());
  }
  if (path == "/healthz") return Response("200 OK", "text/plain", "ok\n");
  return Response("404 Not Found", "text/plain", "try /metrics or /healthz\n");
}

}  // namespace proxima::metrics
