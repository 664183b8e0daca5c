#include "common/log.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::log {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;

// What `write` writes to stderr, read back through a pipe.
template <typename F>
std::string Stderr(F write) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const int saved = dup(STDERR_FILENO);
  dup2(fds[1], STDERR_FILENO);
  write();
  dup2(saved, STDERR_FILENO);
  close(saved);
  close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  return out;
}

TEST(LimiterTest, LetsOneLineThroughPerPeriodAndCountsTheRest) {
  Limiter limiter(std::chrono::milliseconds(200));
  HeldBack held{99};
  EXPECT_TRUE(limiter.Allow(&held));
  EXPECT_EQ(held.lines, 0u);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(limiter.Allow(&held)) << i;
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_TRUE(limiter.Allow(&held));
  EXPECT_EQ(held.lines, 3u);
  EXPECT_FALSE(limiter.Allow(&held));
}

TEST(LimiterTest, ALineSaysHowManyWereHeldBackBeforeIt) {
  const std::string none =
      Stderr([] { PROXIMA_LOG(kWarning) << "x" << HeldBack{0} << Kv("k", 1); });
  EXPECT_THAT(none, EndsWith(" x k=1\n"));
  EXPECT_THAT(none, HasSubstr(" WARN common/log_test.cc:"));
  const std::string some =
      Stderr([] { PROXIMA_LOG(kWarning) << "x" << HeldBack{7} << Kv("k", 1); });
  EXPECT_THAT(some, EndsWith(" x k=1 held_back=7\n"));
}

TEST(LimiterTest, LogEveryWritesOnceFromAStatementRunMany) {
  const std::string out = Stderr([] {
    for (int i = 0; i < 5; ++i) PROXIMA_LOG_EVERY(kError, 3600) << "repeated" << Kv("i", i);
    PROXIMA_LOG_EVERY(kError, 3600) << "another statement";
  });
  EXPECT_THAT(out, HasSubstr("repeated i=0\n"));
  EXPECT_THAT(out, Not(HasSubstr("i=1")));
  EXPECT_THAT(out, HasSubstr("another statement\n"));
}

}  // namespace
}  // namespace proxima::log
