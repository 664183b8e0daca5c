// ReceivePool with a real ucx::Worker (UCX's default transports in this process), and a second
// worker as the holder writing into the pooled buffers.
#include "daemon/cluster/receive_pool.h"

#include <cstring>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::daemon::cluster {
namespace {

using ::proxima::testing::StatusIs;

class ReceivePoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto w = ucx::Worker::Create("receive-pool-test");
    ASSERT_OK(w.status());
    worker_ = *std::move(w);
  }

  std::unique_ptr<ucx::Worker> worker_;
};

TEST_F(ReceivePoolTest, BuffersOfAClassAreReusedAndSizedUpToAPowerOfTwoSlots) {
  metrics::Registry registry;
  ReceivePool pool(worker_.get(), 1 << 20, &registry);
  const int64_t registrations = worker_->live_registrations();
  constexpr size_t kSlot = 4096;
  const std::byte* first = nullptr;
  for (int i = 0; i < 10; ++i) {
    ASSERT_OK_AND_ASSIGN(auto b, pool.Get(5, kSlot));
    EXPECT_EQ(b->slots(), 8u);  // 5 rounded up
    EXPECT_EQ(b->slot_bytes(), kSlot);
    EXPECT_NE(b->registration_id(), 0u);
    if (first == nullptr) first = b->data();
    EXPECT_EQ(b->data(), first);
  }
  // 7 and 8 slots share the class; 3 slots and another slot size do not.
  {
    ASSERT_OK_AND_ASSIGN(auto b, pool.Get(7, kSlot));
    EXPECT_EQ(b->data(), first);
  }
  {
    ASSERT_OK_AND_ASSIGN(auto b, pool.Get(3, kSlot));
    EXPECT_EQ(b->slots(), 4u);
  }
  {
    ASSERT_OK_AND_ASSIGN(auto b, pool.Get(8, kSlot + 8));
    EXPECT_NE(b->data(), first);
  }
  EXPECT_EQ(pool.allocated(), 3u);  // one per class
  EXPECT_EQ(pool.reused(), 10u);
  EXPECT_EQ(pool.idle_bytes(), 8 * kSlot + 4 * kSlot + 8 * (kSlot + 8));
  EXPECT_EQ(worker_->live_registrations(), registrations + 3);
  const std::string text = registry.RenderText();
  EXPECT_THAT(
      text, ::testing::HasSubstr("proxima_cluster_receive_buffers_total{outcome=\"allocated\"} 3"));
  EXPECT_THAT(text,
              ::testing::HasSubstr("proxima_cluster_receive_buffers_total{outcome=\"reused\"} 10"));
  EXPECT_THAT(text, ::testing::HasSubstr(absl::StrCat("proxima_cluster_receive_pool_idle_bytes ",
                                                      pool.idle_bytes())));

  // Two calls at once get two buffers; both come back.
  {
    ASSERT_OK_AND_ASSIGN(auto a, pool.Get(8, kSlot));
    ASSERT_OK_AND_ASSIGN(auto b, pool.Get(8, kSlot));
    EXPECT_NE(a->data(), b->data());
  }
  EXPECT_EQ(pool.allocated(), 4u);
  EXPECT_THAT(pool.Get(0, kSlot), StatusIs(absl::StatusCode::kInvalidArgument,
                                           ::testing::HasSubstr("receive buffer of")));
  EXPECT_THAT(
      pool.Get(1 << 20, size_t{1} << 50),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("receive buffer of")));
}

TEST_F(ReceivePoolTest, IdleBytesStayWithinTheCapAndLargerBuffersAreNotPooled) {
  constexpr size_t kSlot = 1024;
  ReceivePool pool(worker_.get(), 10 * kSlot, nullptr);
  const int64_t registrations = worker_->live_registrations();
  {
    ASSERT_OK_AND_ASSIGN(auto a, pool.Get(4, kSlot));
    ASSERT_OK_AND_ASSIGN(auto b, pool.Get(4, kSlot));
    ASSERT_OK_AND_ASSIGN(auto c, pool.Get(4, kSlot));
    EXPECT_EQ(worker_->live_registrations(), registrations + 3);
  }
  // The third 4 KiB buffer back would make 12 KiB idle: the least recently returned went.
  EXPECT_EQ(pool.idle_bytes(), 8 * kSlot);
  EXPECT_EQ(worker_->live_registrations(), registrations + 2);
  // 16 slots (16 KiB) cannot be kept under a 10 KiB cap: allocated at its exact size, not named
  // by registration id (the holder must not keep its key), freed when dropped.
  {
    ASSERT_OK_AND_ASSIGN(auto big, pool.Get(11, kSlot));
    EXPECT_EQ(big->slots(), 11u);
    EXPECT_EQ(big->registration_id(), 0u);
    EXPECT_EQ(worker_->live_registrations(), registrations + 3);
  }
  EXPECT_EQ(worker_->live_registrations(), registrations + 2);
  EXPECT_EQ(pool.idle_bytes(), 8 * kSlot);
  EXPECT_EQ(pool.allocated(), 4u);
  // A cap of 0: nothing is pooled.
  ReceivePool none(worker_.get(), 0, nullptr);
  for (int i = 0; i < 3; ++i) ASSERT_OK(none.Get(1, kSlot).status());
  EXPECT_EQ(none.allocated(), 3u);
  EXPECT_EQ(none.idle_bytes(), 0u);
}

TEST_F(ReceivePoolTest, AQuarantinedBufferIsNotReusedBeforeItsTimeEnds) {
  constexpr size_t kSlot = 2048;
  ReceivePool pool(worker_.get(), 1 << 20, nullptr);
  ASSERT_OK_AND_ASSIGN(auto failed, pool.Get(2, kSlot));
  const std::byte* quarantined = failed->data();
  pool.Quarantine(std::move(failed), absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(pool.quarantined_bytes(), 2 * kSlot);
  EXPECT_EQ(pool.idle_bytes(), 0u);
  {
    ASSERT_OK_AND_ASSIGN(auto b, pool.Get(2, kSlot));  // the class has no idle buffer
    EXPECT_NE(b->data(), quarantined);
    EXPECT_EQ(pool.allocated(), 2u);
    absl::SleepFor(absl::Milliseconds(350));
    ASSERT_OK_AND_ASSIGN(auto c, pool.Get(2, kSlot));  // the quarantine is over: reused
    EXPECT_EQ(c->data(), quarantined);
    EXPECT_EQ(pool.reused(), 1u);
    EXPECT_EQ(pool.quarantined_bytes(), 0u);
  }
  EXPECT_EQ(pool.idle_bytes(), 2 * 2 * kSlot);
}

TEST_F(ReceivePoolTest, AHolderUnpacksAPooledBuffersKeyOnceAcrossCalls) {
  auto h = ucx::Worker::Create("receive-pool-test-holder");
  ASSERT_OK(h.status());
  std::unique_ptr<ucx::Worker> holder = *std::move(h);
  ReceivePool pool(worker_.get(), 1 << 20, nullptr);
  ASSERT_OK_AND_ASSIGN(auto ep,
                       holder->Connect(worker_->address(), absl::Now() + absl::Seconds(10)));
  constexpr size_t kSlot = 64 << 10;
  constexpr int kCalls = 8;
  const uint64_t unpacked_before = holder->rkeys_unpacked();
  for (int call = 0; call < kCalls; ++call) {
    ASSERT_OK_AND_ASSIGN(auto b, pool.Get(3, kSlot));
    std::vector<std::byte> block(kSlot);
    for (size_t i = 0; i < block.size(); ++i) block[i] = std::byte(static_cast<uint8_t>(i + call));
    const std::string rkeys[] = {b->packed_rkey()};
    const uint64_t ids[] = {b->registration_id()};
    std::vector<ucx::Op> ops = {{ucx::Op::kPut, block.data(), block.size(),
                                 reinterpret_cast<uint64_t>(b->data()) + 2 * kSlot, 0, nullptr}};
    ASSERT_OK(holder->Transfer(*ep, rkeys, std::move(ops), nullptr, absl::Now() + absl::Seconds(10),
                               ids));
    std::span<const std::byte> got = b->Slot(2, kSlot);
    ASSERT_EQ(std::memcmp(got.data(), block.data(), kSlot), 0) << "call " << call;
  }
  EXPECT_EQ(pool.allocated(), 1u);
  EXPECT_EQ(holder->rkeys_unpacked() - unpacked_before, 1u);
  ep.reset();
}

}  // namespace
}  // namespace proxima::daemon::cluster
