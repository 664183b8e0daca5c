// Status propagation helpers used across Proxima.
//
// Debian's Abseil (20220623) ships absl::Status and absl::StatusOr but not the RETURN_IF_ERROR /
// ASSIGN_OR_RETURN macros, so they are defined here, once. Every module boundary in Proxima
// returns absl::Status or absl::StatusOr<T>; these macros keep the call sites short.
#ifndef PROXIMA_COMMON_STATUS_MACROS_H_
#define PROXIMA_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PROXIMA_STATUS_CONCAT_INNER_(a, b) a##b
#define PROXIMA_STATUS_CONCAT_(a, b) PROXIMA_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function when not OK.
#define PROXIMA_RETURN_IF_ERROR(expr)                \
  do {                                               \
    ::absl::Status proxima_status_ = (expr);         \
    if (!proxima_status_.ok()) return proxima_status_; \
  } while (0)

// `lhs = value of rexpr` (an absl::StatusOr<T>), or returns its status when not OK.
// `lhs` may be a declaration: PROXIMA_ASSIGN_OR_RETURN(auto x, MakeX());
#define PROXIMA_ASSIGN_OR_RETURN(lhs, rexpr) \
  PROXIMA_ASSIGN_OR_RETURN_IMPL_(PROXIMA_STATUS_CONCAT_(proxima_statusor_, __LINE__), lhs, rexpr)

#define PROXIMA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = *std::move(statusor)

#endif  // PROXIMA_COMMON_STATUS_MACROS_H_
