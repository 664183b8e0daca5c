#include "daemon/grpc_service.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <limits>
#include <mutex>
#include <thread>

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::daemon {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::_;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(InflightLedgerTest, BytesPerPeerAreCappedAndReleased) {
  InflightLedger ledger(/*max_bytes_per_peer=*/1000, /*max_peers=*/8);
  ASSERT_OK(ledger.Begin("ipv4:1.2.3.4:5", 600));
  ASSERT_OK(ledger.AddResponse("ipv4:1.2.3.4:5", 600, 300));
  EXPECT_EQ(ledger.held_bytes("ipv4:1.2.3.4:5"), 900u);
  EXPECT_THAT(ledger.Begin("ipv4:1.2.3.4:5", 200),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("ipv4:1.2.3.4:5"), HasSubstr("1100"),
                             HasSubstr("server.max_inflight_bytes_per_client = 1000"))));
  // Another peer has its own account.
  ASSERT_OK(ledger.Begin("ipv4:1.2.3.4:6", 1000));
  ledger.End("ipv4:1.2.3.4:5", 900);
  EXPECT_EQ(ledger.held_bytes("ipv4:1.2.3.4:5"), 0u);
  ASSERT_OK(ledger.Begin("ipv4:1.2.3.4:5", 1000));
  EXPECT_THAT(ledger.AddResponse("ipv4:1.2.3.4:5", 1000, 1),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("response")));
}

// A UCX call's declared lengths add up (saturating) to as much as 2^64 - 1: refused as too large
// beside a running call, never wrapped around into an admission that then zeroes the account.
TEST(InflightLedgerTest, AHugeDeclaredSizeIsRefusedNotWrappedAround) {
  InflightLedger ledger(/*max_bytes_per_peer=*/1000, /*max_peers=*/8);
  constexpr uint64_t kHuge = std::numeric_limits<uint64_t>::max();
  ASSERT_OK(ledger.Begin("p", 10));
  EXPECT_THAT(ledger.Begin("p", kHuge),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("would hold 18446744073709551615 bytes"),
                             HasSubstr("server.max_inflight_bytes_per_client = 1000"))));
  EXPECT_THAT(ledger.Begin("p", kHuge - 5), StatusIs(absl::StatusCode::kResourceExhausted, _));
  EXPECT_THAT(ledger.AddResponse("p", 10, kHuge),
              StatusIs(absl::StatusCode::kResourceExhausted, _));
  EXPECT_FALSE(ledger.Begin("p", kHuge).GetPayload(InflightLedger::kRetryWhenReleased));
  EXPECT_EQ(ledger.held_bytes("p"), 10u);
  EXPECT_THAT(ledger.Begin("q", kHuge), StatusIs(absl::StatusCode::kResourceExhausted, _));
  EXPECT_EQ(ledger.held_bytes("q"), 0u);
}

// A refusal says whether the call would fit once the peer's other calls are released: only then
// may the client send it again (libproxima does, within the call's deadline).
TEST(InflightLedgerTest, ARefusalSaysWhetherTheCallFitsOnceOtherCallsAreReleased) {
  const auto retryable = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kResourceExhausted &&
           s.GetPayload(InflightLedger::kRetryWhenReleased).has_value();
  };
  InflightLedger ledger(/*max_bytes_per_peer=*/1000, /*max_peers=*/8);
  EXPECT_FALSE(retryable(ledger.Begin("p", 1001))) << "over the limit alone: never fits";
  ASSERT_OK(ledger.Begin("p", 700));  // another call of p, running
  EXPECT_TRUE(retryable(ledger.Begin("p", 400)));
  EXPECT_FALSE(retryable(ledger.Begin("p", 1001)));
  ASSERT_OK(ledger.Begin("p", 200));  // this call's request
  EXPECT_TRUE(retryable(ledger.AddResponse("p", 200, 500))) << "200 + 500 fit alone";
  EXPECT_FALSE(retryable(ledger.AddResponse("p", 200, 900))) << "200 + 900 never fit";
  ledger.End("p", 700);
  EXPECT_FALSE(retryable(ledger.AddResponse("p", 200, 900)));
  ASSERT_OK(ledger.AddResponse("p", 200, 500));
}

TEST(InflightLedgerTest, ConnectionsWithCallsRunningAreCapped) {
  InflightLedger ledger(1 << 20, /*max_peers=*/2);
  ASSERT_OK(ledger.Begin("a", 0));
  ASSERT_OK(ledger.Begin("b", 10));
  ASSERT_OK(ledger.Begin("a", 0));  // a second call on a known connection is fine
  const absl::Status refused = ledger.Begin("c", 0);
  EXPECT_THAT(refused,
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("client c"), HasSubstr("server.max_connections = 2"))));
  // It fits once another connection's calls end: the client may send it again.
  EXPECT_TRUE(refused.GetPayload(InflightLedger::kRetryWhenReleased).has_value());
  // One over the byte limit alone never fits, wherever the connection count is.
  EXPECT_THAT(ledger.Begin("c", (1 << 20) + 1),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("server.max_inflight_bytes_per_client")));
  EXPECT_FALSE(
      ledger.Begin("c", (1 << 20) + 1).GetPayload(InflightLedger::kRetryWhenReleased).has_value());
  ledger.End("a", 0);
  EXPECT_EQ(ledger.active_peers(), 2u);  // a still has a call running
  ledger.End("a", 0);
  EXPECT_EQ(ledger.active_peers(), 1u);  // zero-byte calls leave no account behind
  ASSERT_OK(ledger.Begin("c", 0));
}

}  // namespace
}  // namespace proxima::daemon

namespace proxima::daemon {
namespace {

// Calls that wait (for peers) each get a thread: eight tasks that wait for one another all run at
// once, and a thread left idle is reused, never more than the limit started.
TEST(HandlerThreadsTest, WaitingTasksRunAtOnceAndThreadsAreReused) {
  HandlerThreads threads(/*max_threads=*/64);
  std::mutex mu;
  std::condition_variable cv;
  int started = 0;
  int finished = 0;
  for (int i = 0; i < 8; ++i) {
    threads.Run([&] {
      std::unique_lock<std::mutex> lock(mu);
      ++started;
      cv.notify_all();
      // Each waits until all eight have started: with fewer threads this never ends.
      EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return started == 8; }));
      ++finished;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return finished == 8; }));
  }
  EXPECT_EQ(threads.threads(), 8u);
  // One at a time now: the idle threads take them.
  for (int i = 0; i < 20; ++i) {
    std::promise<void> done;
    threads.Run([&] { done.set_value(); });
    done.get_future().wait();
  }
  EXPECT_LE(threads.threads(), 12u) << "idle threads were not reused";
}

TEST(HandlerThreadsTest, PastTheLimitTasksWaitAndTheDestructorRunsWhatIsQueued) {
  std::atomic<int> ran{0};
  {
    HandlerThreads threads(/*max_threads=*/2);
    for (int i = 0; i < 50; ++i) {
      threads.Run([&ran] {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        ++ran;
      });
    }
    EXPECT_LE(threads.threads(), 2u);
  }
  EXPECT_EQ(ran.load(), 50);
}

}  // namespace
}  // namespace proxima::daemon
