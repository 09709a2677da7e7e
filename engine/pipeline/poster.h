// The poster: puts planned slices on links. It assigns each slice a link
// with room (or the segment's backlog, drained as places come back), fills
// its work request and posts it; a post the transport refuses rebuilds the
// links once and tries again, and what cannot go is failed. A slice of a
// batch bound to a peer instance never goes to its successor.
//
// Its state: the segments' backlogs and links' places (the books), and
// whether any backlog may hold a slice (an atomic). Lock order: the books,
// then a lane (lanes.h).
#ifndef KVFERRY_ENGINE_PIPELINE_POSTER_H_
#define KVFERRY_ENGINE_PIPELINE_POSTER_H_

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "base/clock.h"
#include "engine/pipeline/lanes.h"
#include "engine/pipeline/segment_registry.h"
#include "engine/pipeline/vias.h"

namespace kvferry {
namespace engine_internal {

class Poster {
 public:
  // Every pointer outlives it.
  Poster(const std::vector<Via>* vias, SegmentRegistry* segments, Lanes* lanes, Clock* clock)
      : vias_(*vias), segments_(segments), lanes_(lanes), clock_(clock) {}

  // Posts slices `ids` of segment `id`; those that find no room wait in its
  // backlog. `now`: the caller's reading of the clock. `assigned` (when not
  // null): work requests for every slice, on links already taken for
  // transport `via` (AssignNow, AssignLink): posted as they are first,
  // assigned again (in a buffer of Post's own) only when the post is
  // refused.
  absl::Status Post(SegmentId id, absl::Span<const uint64_t> ids, absl::Time now,
                    const std::vector<transport::WorkRequest>* assigned = nullptr, size_t via = 0)
      ABSL_LOCKS_EXCLUDED(segments_->books());
  // Submit's fast path: links for every slice of a new batch when the
  // segment has room for them all (else false, nothing assigned: Post
  // decides).
  // `per_link` (when not null, LinkPlan::kMaxLinks of them) gets how many
  // it put on each of seg.links.
  bool AssignNow(Lane& lane, LaneSegment& ls, const SegmentCore& seg,
                 absl::Span<const uint64_t> ids, absl::Time now,
                 std::vector<transport::WorkRequest>* wrs, uint32_t* per_link = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // A link for `slice` from `seg`'s (taking a place on it) and its work
  // request; false when all are full or failed.
  bool AssignLink(const SegmentCore& seg, Lane& lane, LaneSegment& ls, Slice& slice,
                  transport::WorkRequest* wr, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // Gives slice `sid`'s place on its link back.
  void Unassign(uint64_t sid, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(segments_->books());
  // The same for `slice` of segment `seg` whose lane the caller holds (links
  // of older generations are gone: nothing to give back).
  static void Unassign(const SegmentCore& seg, const Slice& slice, absl::Time now);
  // Posts what waits in the backlogs; cheap when nothing does.
  void DrainBacklogs() ABSL_LOCKS_EXCLUDED(segments_->books());
  // Whether a backlog may hold a slice (new slices then queue behind it).
  bool MaybeBacklog() const { return maybe_backlog_.load(std::memory_order_acquire); }

 private:
  // Assigns links to the slices under the books; false when no link is
  // usable. `via`: the transport the work requests are for.
  // Once no link has room, the rest wait in the backlog at once, in order:
  // at its front when they came from it (`from_backlog`), else at its end.
  bool AssignAll(SegmentId id, absl::Span<const uint64_t> ids, absl::Time now,
                 std::vector<transport::WorkRequest>* wrs, absl::Status* bad, size_t* via,
                 bool from_backlog) ABSL_LOCKS_EXCLUDED(segments_->books());
  // Post, for slices new (`from_backlog` false) or taken from the backlog.
  absl::Status PostSlices(SegmentId id, absl::Span<const uint64_t> ids, absl::Time now,
                          const std::vector<transport::WorkRequest>* assigned, size_t via,
                          bool from_backlog) ABSL_LOCKS_EXCLUDED(segments_->books());
  // The work request of `slice` on `link` (whose place is taken), and what
  // it adds to the counters.
  void Fill(const SegmentCore& seg, Lane& lane, LaneSegment& ls, const Link& link, Slice& slice,
            transport::WorkRequest* wr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  void FailAll(absl::Span<const uint64_t> ids, const absl::Status& status, bool after_retry)
      ABSL_LOCKS_EXCLUDED(segments_->books());

  const std::vector<Via>& vias_;
  SegmentRegistry* const segments_;
  Lanes* const lanes_;
  Clock* const clock_;
  // Set when a slice goes to a backlog; DrainBacklogs locks only then.
  std::atomic<bool> maybe_backlog_{false};
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_POSTER_H_
