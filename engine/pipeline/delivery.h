// Delivery: completions into their batches, and retries. A successful
// completion on a link of the view its lane holds finishes its slice under
// that lane's lock alone; anything else (a failure, a retry, a link of
// another view) takes the books first. A failed slice that may go again
// waits in the retry queue (its own lock) until RefreshAndRepost: the
// failed link's half at the peer closes first, or the whole segment is
// refreshed, and then the slice is posted again.
#ifndef KVFERRY_ENGINE_PIPELINE_DELIVERY_H_
#define KVFERRY_ENGINE_PIPELINE_DELIVERY_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "engine/pipeline/lanes.h"
#include "engine/pipeline/link_set.h"
#include "engine/pipeline/poster.h"
#include "engine/pipeline/segment_registry.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

class Delivery {
 public:
  // Every pointer outlives it.
  Delivery(SegmentRegistry* segments, Lanes* lanes, Poster* poster, Clock* clock)
      : segments_(segments), lanes_(lanes), poster_(poster), clock_(clock) {}

  // Delivers `done` (completed at `now`); true when slices wait for a
  // retry. Any number of threads at once.
  bool DeliverAll(absl::Span<transport::Completion> done, absl::Time now)
      ABSL_LOCKS_EXCLUDED(segments_->books());
  // Closes failed links' peer halves or refreshes segments, then posts the
  // waiting slices again. Blocks for the handshakes it needs.
  void RefreshAndRepost() ABSL_LOCKS_EXCLUDED(segments_->books(), retry_mu_);

 private:
  // The lane's part of the segment its previous completion went to.
  struct LaneLookup {
    SegmentId segment = 0;
    LaneSegment* entry = nullptr;
  };
  // A successful completion under its lane's lock alone: false (nothing
  // done) when its link is not in the lane's view (Deliver then).
  bool DeliverOnLane(Lane& lane, const transport::Completion& done, absl::Time now,
                     LaneLookup* last, LoadReturns* returns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // One completion; the slice goes to the retry queue, or finishes.
  void Deliver(transport::Completion& done, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(segments_->books());
  // Queues a failed slice; `link` (when not null) is the failed link whose
  // peer half must close before the slice goes again.
  void QueueRetry(SegmentId segment, uint64_t generation, bool refresh, uint64_t slice,
                  const Link* link) ABSL_LOCKS_EXCLUDED(retry_mu_);
  void CountNicError(const Slice& slice, absl::StatusCode code)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(segments_->books());

  SegmentRegistry* const segments_;
  Lanes* const lanes_;
  Poster* const poster_;
  Clock* const clock_;
  // Slices whose link failed, by segment: refreshed first, or just re-posted
  // (their links were replaced already).
  struct Retry {
    SegmentId segment = 0;
    uint64_t broken_generation = 0;
    bool refresh = false;
    std::vector<uint64_t> slices;
    // Failed links whose peer halves close first: a first copy of a slice
    // still in the network must not land after its second (docs/reliability.md).
    std::vector<std::pair<transport::LinkId, std::string>> close;
  };
  Mutex retry_mu_{kRetryLock};
  std::vector<Retry> retry_ ABSL_GUARDED_BY(retry_mu_);
  // Whether retry_ has something: read without the lock by DeliverAll.
  std::atomic<bool> retries_queued_{false};
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_DELIVERY_H_
