#include "daemon/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/testing/status_matchers.h"
#include "daemon/metrics_http.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::metrics {
namespace {

using ::testing::HasSubstr;

TEST(MetricsTest, RendersPrometheusTextFormat) {
  Registry r;
  Counter* c = r.AddCounter("proxima_things_total", "Things", {{"namespace", "a\"b"}});
  c->Increment(3);
  EXPECT_EQ(r.AddCounter("proxima_things_total", "Things", {{"namespace", "a\"b"}}), c);
  r.AddGauge("proxima_level", "Level", {}, [] { return 2.5; });
  Histogram* h = r.AddHistogram("proxima_seconds", "Time", {{"method", "Get"}}, {0.1, 1});
  h->Observe(0.05);
  h->Observe(0.5);
  h->Observe(5);
  std::string text = r.RenderText();
  EXPECT_THAT(text, HasSubstr("# TYPE proxima_things_total counter\n"));
  EXPECT_THAT(text, HasSubstr("proxima_things_total{namespace=\"a\\\"b\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("proxima_level 2.5\n"));
  EXPECT_THAT(text, HasSubstr("proxima_seconds_bucket{method=\"Get\",le=\"0.1\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("proxima_seconds_bucket{method=\"Get\",le=\"1\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("proxima_seconds_bucket{method=\"Get\",le=\"+Inf\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("proxima_seconds_count{method=\"Get\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("proxima_seconds_sum{method=\"Get\"} 5.55"));
}

std::string HttpGet(int port, const std::string& request) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return "connect failed";
  send(fd, request.data(), request.size(), 0);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, n);
  close(fd);
  return out;
}

TEST(MetricsTest, HttpServerServesMetricsAndRejectsOtherPaths) {
  Registry r;
  r.AddCounter("proxima_x_total", "X")->Increment();
  ASSERT_OK_AND_ASSIGN(auto server, MetricsHttpServer::Start("127.0.0.1:0", &r));
  ASSERT_GT(server->port(), 0);
  std::string ok = HttpGet(server->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_THAT(ok, HasSubstr("200 OK"));
  EXPECT_THAT(ok, HasSubstr("proxima_x_total 1\n"));
  EXPECT_THAT(HttpGet(server->port(), "GET /nope HTTP/1.1\r\n\r\n"), HasSubstr("404"));
  EXPECT_THAT(HttpGet(server->port(), "POST /metrics HTTP/1.1\r\n\r\n"), HasSubstr("405"));
  EXPECT_THAT(HttpGet(server->port(), "GET /healthz HTTP/1.1\r\n\r\n"), HasSubstr("ok"));
  server->Stop();
}

TEST(MetricsTest, BusyPortIsAClearError) {
  Registry r;
  ASSERT_OK_AND_ASSIGN(auto first, MetricsHttpServer::Start("127.0.0.1:0", &r));
  auto second = MetricsHttpServer::Start("127.0.0.1:" + std::to_string(first->port()), &r);
  EXPECT_THAT(second, proxima::testing::StatusIs(absl::StatusCode::kUnavailable,
                                                 HasSubstr("cannot listen for metrics")));
}

}  // namespace
}  // namespace proxima::metrics
