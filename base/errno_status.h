// errno -> absl::Status with context, so a failed system call reads
// "bind 0.0.0.0:15000: Address already in use (errno 98)". (absl has an
// ErrnoToStatus; ours maps network errors to kUnavailable and keeps the
// errno number in the message.)
#ifndef KVFERRY_BASE_ERRNO_STATUS_H_
#define KVFERRY_BASE_ERRNO_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvferry {

// Maps `errno_value` to the most specific absl::StatusCode and builds a
// status whose message is "<context>: <strerror text> (errno N)".
// `errno_value == 0` yields an kUnknown status (a caller bug, not OK).
absl::Status ErrnoError(int errno_value, absl::string_view context);

// Same as ErrnoError(errno, context); read errno right after the failed call.
absl::Status LastErrnoError(absl::string_view context);

// The status code an errno value maps to.
absl::StatusCode ErrnoToCode(int errno_value);

}  // namespace kvferry

#endif  // KVFERRY_BASE_ERRNO_STATUS_H_
