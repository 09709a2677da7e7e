#include "base/errno_status.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvferry {

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok() || context.empty()) return status;
  absl::Status out(status.code(), absl::StrCat(context, ": ", status.message()));
  // What callers mark on statuses (net::ConnectionRefused, ...) survives.
  status.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

absl::StatusCode ErrnoToCode(int errno_value) {
  switch (errno_value) {
    case 0:
      return absl::StatusCode::kUnknown;
    case EINVAL:
    case EBADF:
    case EFAULT:
    case ENAMETOOLONG:
    case EDESTADDRREQ:
    case EAFNOSUPPORT:
    case EPROTONOSUPPORT:
      return absl::StatusCode::kInvalidArgument;
    case ENOENT:
    case ENODEV:
    case ENXIO:
    case ESRCH:
      return absl::StatusCode::kNotFound;
    case EEXIST:
    case EADDRINUSE:
    case EISCONN:
      return absl::StatusCode::kAlreadyExists;
    case EPERM:
    case EACCES:
      return absl::StatusCode::kPermissionDenied;
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case ENOBUFS:
    case EMSGSIZE:
      return absl::StatusCode::kResourceExhausted;
    case ETIMEDOUT:
      return absl::StatusCode::kDeadlineExceeded;
    case ECONNREFUSED:
    case ECONNRESET:
    case ECONNABORTED:
    case EPIPE:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ENETDOWN:
    case ENOTCONN:
    case EAGAIN:
    case EINTR:
    case EADDRNOTAVAIL:
      return absl::StatusCode::kUnavailable;
    case ENOSYS:
    case EOPNOTSUPP:
      return absl::StatusCode::kUnimplemented;
    case ECANCELED:
      return absl::StatusCode::kCancelled;
    case EBUSY:
    case ENOTEMPTY:
      return absl::StatusCode::kFailedPrecondition;
    case ERANGE:
    case EOVERFLOW:
      return absl::StatusCode::kOutOfRange;
    default:
      return absl::StatusCode::kUnknown;
  }
}

absl::Status ErrnoError(int errno_value, absl::string_view context) {
  char buf[128];
  // GNU strerror_r: thread-safe, returns a pointer to the text.
  const char* text = errno_value == 0 ? "no errno set" : strerror_r(errno_value, buf, sizeof buf);
  return absl::Status(ErrnoToCode(errno_value), absl::StrCat(context, context.empty() ? "" : ": ",
                                                             text, " (errno ", errno_value, ")"));
}

absl::Status LastErrnoError(absl::string_view context) { return ErrnoError(errno, context); }

}  // namespace kvferry
