#include "daemon/grpc_service.h"

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::daemon {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(InflightLedgerTest, BytesPerPeerAreCappedAndReleased) {
  InflightLedger ledger(/*max_bytes_per_peer=*/1000, /*max_peers=*/8);
  ASSERT_OK(ledger.Begin("ipv4:1.2.3.4:5", 600));
  ASSERT_OK(ledger.AddResponse("ipv4:1.2.3.4:5", 300));
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
  EXPECT_THAT(ledger.AddResponse("ipv4:1.2.3.4:5", 1),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("response")));
}

TEST(InflightLedgerTest, ConnectionsWithCallsRunningAreCapped) {
  InflightLedger ledger(1 << 20, /*max_peers=*/2);
  ASSERT_OK(ledger.Begin("a", 0));
  ASSERT_OK(ledger.Begin("b", 10));
  ASSERT_OK(ledger.Begin("a", 0));  // a second call on a known connection is fine
  EXPECT_THAT(ledger.Begin("c", 0),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("client c"), HasSubstr("server.max_connections = 2"))));
  ledger.End("a", 0);
  EXPECT_EQ(ledger.active_peers(), 2u);  // a still has a call running
  ledger.End("a", 0);
  EXPECT_EQ(ledger.active_peers(), 1u);  // zero-byte calls leave no account behind
  ASSERT_OK(ledger.Begin("c", 0));
}

}  // namespace
}  // namespace proxima::daemon
