// Propagation helpers for absl::Status / absl::StatusOr, the error currency across modules.
#ifndef MOBIUS_COMMON_STATUS_MACROS_H_
#define MOBIUS_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MOBIUS_CONCAT_INNER_(a, b) a##b
#define MOBIUS_CONCAT_(a, b) MOBIUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status mobius_status_ = (expr);          \
    if (!mobius_status_.ok()) return mobius_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` declares x from an OK StatusOr or returns its error.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  ASSIGN_OR_RETURN_IMPL_(MOBIUS_CONCAT_(mobius_statusor_, __LINE__), lhs, rexpr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr)  \
  auto tmp = (rexpr);                            \
  if (!tmp.ok()) return std::move(tmp).status(); \
  lhs = std::move(tmp).value()

#endif  // MOBIUS_COMMON_STATUS_MACROS_H_
