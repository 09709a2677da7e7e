// Retry rules of the batch pipeline: which slice errors are worth a retry on
// new links, and what a slice reports when no retry is possible.
#ifndef KVFERRY_ENGINE_PIPELINE_RETRY_POLICY_H_
#define KVFERRY_ENGINE_PIPELINE_RETRY_POLICY_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvferry {
namespace engine_internal {

// A link or peer failure (peer gone, link flushed or closed, stale key):
// the slice may succeed on rebuilt links.
inline bool Retryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kAborted ||
         code == absl::StatusCode::kCancelled || code == absl::StatusCode::kPermissionDenied;
}

// A slice's final error when the peer cannot be reached again: the
// reconnect's (kUnavailable for a dead peer), with what the slice saw first.
inline absl::Status RetryImpossible(const absl::Status& reconnect, const absl::Status& first) {
  if (first.ok()) return reconnect;
  return absl::Status(reconnect.code(), absl::StrCat(reconnect.message(),
                                                     " (retrying after: ", first.message(), ")"));
}

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_RETRY_POLICY_H_
