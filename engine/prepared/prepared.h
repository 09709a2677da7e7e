// Prepared transfers (docs/nixl.md): descriptor lists checked once, and
// transfers made from index pairs into them, posted again and again.
//
//   PrepareLocal / PrepareRemote  a list of (address, length): every entry
//                                 inside memory registered here / at the
//                                 segment's peer; stored as stride runs
//   Make                          a transfer from index pairs into a local
//                                 and a remote list: counts, bounds and
//                                 lengths checked, adjacent pairs merged,
//                                 an optional notification
//   Post, State                   run it; poll it (sticky last result)
//   Release, ReleaseList          forget a transfer, a list
//
// A transfer is bound to the peer instance its remote list was prepared
// against: once that peer restarted, posting it fails instead of writing
// the new instance's memory at the old one's addresses. It holds addresses,
// not keys: the keys are those of the segment's current view when it is
// posted, so a refresh or a failover never posts stale ones.
//
// A transfer's notification goes to the peer after all its bytes landed
// (WRITE) or were read (READ), sent by the engine when the last one
// completes, whether or not the caller polls then; State reports kDone
// only once it was sent. A failed transfer sends none.
//
// Thread-safe: any thread, any call, at once (one transfer's Post and
// State calls are serialized).
#ifndef KVFERRY_ENGINE_PREPARED_PREPARED_H_
#define KVFERRY_ENGINE_PREPARED_PREPARED_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/transport.h"

namespace kvferry {

// One entry of a list to prepare.
struct Descriptor {
  uint64_t addr = 0;
  uint64_t length = 0;
};

enum class XferState {
  kNotPosted,   // made, never posted
  kInProgress,  // posted, not finished
  kDone,        // every byte in place (and the notification sent)
};

struct MakeOptions {
  // Sent to the peer after the data (see above); none when unset.
  std::optional<std::string> notification;
  // Adjacent pairs (local and remote both contiguous, in one registration)
  // become one request.
  bool merge = true;
};

// What the last post of a transfer took, once State saw it finish.
struct XferTelemetry {
  absl::Time start;         // when Post was called
  absl::Duration post;      // inside Post
  absl::Duration transfer;  // from Post to the State call that saw it end
  uint64_t bytes = 0;
  uint64_t descriptors = 0;  // requests after merging
};

class PreparedTransfers {
 public:
  struct Deps;  // what the engine gives it (prepared_internal.h)
  explicit PreparedTransfers(const Deps& deps);
  ~PreparedTransfers();
  PreparedTransfers(const PreparedTransfers&) = delete;
  PreparedTransfers& operator=(const PreparedTransfers&) = delete;

  // kNotFound (naming the entry) when an entry is empty or not inside one
  // registration here; an empty list is kInvalidArgument.
  absl::StatusOr<uint64_t> PrepareLocal(absl::Span<const Descriptor> descriptors);
  // The same against the regions `segment`'s peer advertises (an entry may
  // span adjacent ones). kNotFound also for an unknown segment.
  absl::StatusOr<uint64_t> PrepareRemote(uint64_t segment,
                                         absl::Span<const Descriptor> descriptors);
  // Transfers made from the list keep what they need: they stay valid.
  absl::Status ReleaseList(uint64_t list);
  // The list's entries and the runs that store them.
  absl::StatusOr<std::pair<uint64_t, size_t>> ListSize(uint64_t list) const;

  // kInvalidArgument for lists of the wrong side, index lists of different
  // or zero lengths, an index out of range, or a pair of unequal lengths.
  absl::StatusOr<uint64_t> Make(transport::Opcode op, uint64_t local_list,
                                absl::Span<const int64_t> local_indices, uint64_t remote_list,
                                absl::Span<const int64_t> remote_indices,
                                const MakeOptions& options = {});
  // Posts it (again): kInProgress, or an error (which also sticks: State
  // reports it). kAlreadyExists while the previous post is in progress.
  // With `notification`, it replaces the transfer's from now on.
  absl::StatusOr<XferState> Post(uint64_t xfer,
                                 const std::optional<std::string>& notification = std::nullopt);
  // Its state; the error of a failed post, again on every call until the
  // next post.
  absl::StatusOr<XferState> State(uint64_t xfer);
  // The last finished post's figures; its error if it failed;
  // kFailedPrecondition before one finished.
  absl::StatusOr<XferTelemetry> Telemetry(uint64_t xfer);
  // Forgets it. kAlreadyExists while a post is in progress (it stays).
  absl::Status Release(uint64_t xfer);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PREPARED_PREPARED_H_
