#include "daemon/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <string>
#include <vector>

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

// A connection to 127.0.0.1:`port` that has sent `request` (maybe nothing), with a receive
// buffer of `receive_buffer` bytes (0: the kernel's) and reads that give up after 10 s; -1 when
// it cannot connect.
int Connect(int port, const std::string& request, int receive_buffer = 0) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (receive_buffer > 0) {
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
  }
  timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  if (!request.empty()) send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  return fd;
}

std::string HttpGet(int port, const std::string& request) {
  const int fd = Connect(port, request);
  if (fd < 0) return "connect failed";
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, n);
  if (n < 0) out += "[no more within 10 s]";
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

// Connections are served together: clients that send nothing, and clients that asked for an
// answer larger than the socket buffers and never read it, delay no other scrape (served one at a
// time, each silent client held the next scrape for its 2 s read deadline, and one that did not
// read held the server for good). Past its deadline a silent client's connection is closed.
TEST(MetricsTest, SilentAndNonReadingClientsDelayNoScrape) {
  Registry r;
  for (int i = 0; i < 20000; ++i) {
    r.AddGauge("proxima_series", "Many series", {{"n", std::to_string(i)}}, [] { return 1.0; });
  }
  const std::string last = "proxima_series{n=\"19999\"} 1\n";
  ASSERT_GT(r.RenderText().size(), 400u << 10);
  ASSERT_OK_AND_ASSIGN(auto server, MetricsHttpServer::Start("127.0.0.1:0", &r));
  std::vector<int> held;
  for (int i = 0; i < 20; ++i) held.push_back(Connect(server->port(), ""));
  for (int i = 0; i < 4; ++i) {
    held.push_back(Connect(server->port(), "GET /metrics HTTP/1.1\r\n\r\n", 4096));
  }
  for (int fd : held) ASSERT_GE(fd, 0);
  for (int scrape = 0; scrape < 3; ++scrape) {
    const std::string answer = HttpGet(server->port(), "GET /metrics HTTP/1.1\r\n\r\n");
    EXPECT_THAT(answer, HasSubstr("200 OK"));
    EXPECT_THAT(answer, HasSubstr(last)) << "scrape " << scrape << " came back short";
  }
  // The first silent client: closed by the server after its 2 s (this read gives up after 10).
  char byte;
  EXPECT_EQ(recv(held[0], &byte, 1, 0), 0);
  for (int fd : held) close(fd);
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
