// GoogleMock matchers for absl::Status and absl::StatusOr<T>, for Proxima's tests.
//
//   EXPECT_THAT(DoIt(), IsOk());
//   EXPECT_THAT(DoIt(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
//   EXPECT_THAT(Count(), IsOkAndHolds(3));
//   ASSERT_OK_AND_ASSIGN(auto value, MakeValue());
#ifndef PROXIMA_COMMON_TESTING_STATUS_MATCHERS_H_
#define PROXIMA_COMMON_TESTING_STATUS_MATCHERS_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::testing {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

MATCHER_P2(StatusIs, code, message_matcher,
           "has code " + absl::StatusCodeToString(code) + " and a message that " +
               ::testing::DescribeMatcher<std::string>(message_matcher)) {
  const absl::Status& status = ::proxima::testing::GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(status.message()),
                                       result_listener);
}

MATCHER(IsOk, "is OK") {
  const absl::Status& status = ::proxima::testing::GetStatus(arg);
  *result_listener << "status is " << status;
  return status.ok();
}

MATCHER_P(IsOkAndHolds, value_matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

}  // namespace proxima::testing

#define PROXIMA_TESTING_CONCAT_INNER_(a, b) a##b
#define PROXIMA_TESTING_CONCAT_(a, b) PROXIMA_TESTING_CONCAT_INNER_(a, b)

#define ASSERT_OK(expr) ASSERT_THAT((expr), ::proxima::testing::IsOk())
#define EXPECT_OK(expr) EXPECT_THAT((expr), ::proxima::testing::IsOk())

#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  ASSERT_OK_AND_ASSIGN_IMPL_(PROXIMA_TESTING_CONCAT_(proxima_statusor_, __LINE__), lhs, rexpr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, rexpr)                    \
  auto statusor = (rexpr);                                                  \
  ASSERT_TRUE(statusor.ok()) << "status is " << statusor.status();          \
  lhs = *std::move(statusor)

#endif  // PROXIMA_COMMON_TESTING_STATUS_MATCHERS_H_
