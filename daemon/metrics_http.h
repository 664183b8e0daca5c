// MetricsHttpServer: serves GET /metrics (Prometheus text format) and GET /healthz over plain
// HTTP/1.1 on one listening socket, from one thread. Its connections are served together (a poll
// loop over non-blocking sockets, 64 at a time), each with a deadline to send its request and
// one to read the answer, so a silent client, or one that never reads a large answer, delays no
// scrape; an accept that fails (out of file descriptors) pauses accepting briefly instead of
// spinning on the listener.
//
// Thread-safe: Start() and Stop() from any thread; the server thread only reads the registry.
#ifndef PROXIMA_DAEMON_METRICS_HTTP_H_
#define PROXIMA_DAEMON_METRICS_HTTP_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/metrics.h"

namespace proxima::metrics {

class MetricsHttpServer {
 public:
  // Binds `host_port` ("127.0.0.1:9464"; port 0 picks a free one) and starts serving `registry`,
  // which must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host_port,
                                                                  const Registry* registry);
  ~MetricsHttpServer();  // Stops.

  int port() const { return port_; }
  void Stop();

 private:
  MetricsHttpServer(int listen_fd, int port, const Registry* registry);
  void Serve();
  // The whole HTTP response to `request` (its bytes as read: a request line and headers).
  std::string Answer(absl::string_view request) const;

  const int listen_fd_;
  const int port_;
  const Registry* registry_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace proxima::metrics

#endif  // PROXIMA_DAEMON_METRICS_HTTP_H_
