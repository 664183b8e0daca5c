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

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "common/log.h"

namespace proxima::metrics {
namespace {

constexpr int kReadDeadlineMs = 2000;
constexpr size_t kMaxRequestBytes = 8192;

void WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
}

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
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
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
  while (!stopping_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    int ready = ::poll(&p, 1, 100);  // wake up regularly to notice Stop()
    if (ready <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    HandleConnection(fd);
    ::close(fd);
  }
}

void MetricsHttpServer::HandleConnection(int fd) {
  std::string request;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kReadDeadlineMs);
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    deadline - std::chrono::steady_clock::now())
                    .count();
    if (left <= 0) return;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) return;
    char buf[2048];
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  absl::string_view line(request);
  line = line.substr(0, line.find("\r\n"));
  if (!absl::StartsWith(line, "GET ")) {
    WriteAll(fd, Response("405 Method Not Allowed", "text/plain", "only GET is served\n"));
    return;
  }
  absl::string_view path = line.substr(4, line.find(' ', 4) - 4);
  path = path.substr(0, path.find('?'));
  if (path == "/metrics") {
    WriteAll(fd, Response("200 OK", "text/plain; version=0.0.4; charset=utf-8",
                          registry_->RenderText()));
  } else if (path == "/healthz") {
    WriteAll(fd, Response("200 OK", "text/plain", "ok\n"));
  } else {
    WriteAll(fd, Response("404 Not Found", "text/plain", "try /metrics or /healthz\n"));
  }
}

}  // namespace proxima::metrics
