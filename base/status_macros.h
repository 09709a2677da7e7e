// Status propagation macros. Debian's Abseil (20220623) ships none, so
// kvferry defines its own, in the style of the ones Abseil later published.
//
//   RETURN_IF_ERROR(DoThing());
//   ASSIGN_OR_RETURN(auto fd, OpenSocket(addr));
//   RETURN_IF_ERROR_CTX(Send(fd, frame), "sending header");
#ifndef KVFERRY_BASE_STATUS_MACROS_H_
#define KVFERRY_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvferry {

// Returns `status` with `context` prepended to its message ("context: msg"),
// keeping its code. OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace kvferry

#define KVFERRY_STATUS_CONCAT_INNER_(a, b) a##b
#define KVFERRY_STATUS_CONCAT_(a, b) KVFERRY_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function
// if it is not OK.
#define RETURN_IF_ERROR(expr)                                    \
  do {                                                           \
    ::absl::Status kvferry_status_ = (expr);                     \
    if (ABSL_PREDICT_FALSE(!kvferry_status_.ok())) {             \
      return kvferry_status_;                                    \
    }                                                            \
  } while (false)

// Like RETURN_IF_ERROR, but prefixes the returned status with `context`.
#define RETURN_IF_ERROR_CTX(expr, context)                       \
  do {                                                           \
    ::absl::Status kvferry_status_ = (expr);                     \
    if (ABSL_PREDICT_FALSE(!kvferry_status_.ok())) {             \
      return ::kvferry::Annotate(kvferry_status_, (context));    \
    }                                                            \
  } while (false)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status,
// otherwise move-assigns the value to `lhs` (which may be a declaration).
#define ASSIGN_OR_RETURN(lhs, rexpr)                                       \
  KVFERRY_ASSIGN_OR_RETURN_IMPL_(                                          \
      KVFERRY_STATUS_CONCAT_(kvferry_statusor_, __LINE__), lhs, rexpr)

#define KVFERRY_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (ABSL_PREDICT_FALSE(!statusor.ok())) {                  \
    return std::move(statusor).status();                     \
  }                                                          \
  lhs = *std::move(statusor)

#endif  // KVFERRY_BASE_STATUS_MACROS_H_
