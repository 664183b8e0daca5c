// MetricsHttpServer: serves GET /metrics (Prometheus text format) and GET /healthz over plain
// HTTP/1.1 on one listening socket, from one thread. Scrapes are infrequent and small, so
// connections are handled one at a time, each with a short read deadline so that a slow or
// silent client cannot stall the next scrape for long.
//
// Thread-safe: Start() and Stop() from any thread; the server thread only reads the registry.
#ifndef PROXIMA_DAEMON_METRICS_HTTP_H_
#define PROXIMA_DAEMON_METRICS_HTTP_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
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
  void HandleConnection(int fd);

  const int listen_fd_;
  const int port_;
  const Registry* registry_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace proxima::metrics

#endif  // PROXIMA_DAEMON_METRICS_HTTP_H_
