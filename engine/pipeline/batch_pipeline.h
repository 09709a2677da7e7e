// The data path: batches cut into slices, posted on the links of a peer's
// segment, their completions delivered, retried after link or peer
// failures, and waited for. The pipeline is the composition of its units,
// each owning its state and, where it has one, its lock:
//
//   SegmentRegistry  segments, links, counters      the books (kBooksLock)
//   Lanes            batches and slices, per thread  a lane's (kLaneLock)
//   Planner          requests into checked slices    none: reads its input
//   Poster           slices onto links, backlogs     the books'
//   Delivery         completions, the retry queue    the queue's (kRetryLock)
//   Liveness         probes of silent peers, repairs the books'
//   CompletionPump   who waits in the transports     the pump's (kPumpLock)
//   CompletionSource the transports' completions     events' (kEventsLock)
//
// Locks are taken in that order (lock_order.h), none across a handshake or a
// transport wait. Registered memory (LocalRegions) has its own lock, taken
// alone or under a lane's. Submitting a batch to a ready segment, a
// successful completion and waiting take the caller's lane's lock alone.
#ifndef KVFERRY_ENGINE_PIPELINE_BATCH_PIPELINE_H_
#define KVFERRY_ENGINE_PIPELINE_BATCH_PIPELINE_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/clock.h"
#include "engine/memory/local_regions.h"
#include "engine/peer/peer_client.h"
#include "engine/pipeline/completion_pump.h"
#include "engine/pipeline/completion_source.h"
#include "engine/pipeline/delivery.h"
#include "engine/pipeline/lanes.h"
#include "engine/pipeline/liveness.h"
#include "engine/pipeline/path_choice.h"
#include "engine/pipeline/planner.h"
#include "engine/pipeline/poster.h"
#include "engine/pipeline/segment_registry.h"
#include "engine/pipeline/vias.h"
#include "engine/types.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

class BatchPipeline {
 public:
  // Every pointer outlives the pipeline. `transports`: the primary first,
  // then the fallback, if any (LocalRegions' order); each peer goes over
  // the one path_choice.h picks.
  BatchPipeline(PipelineConfig config, uint64_t engine_id,
                std::vector<transport::Transport*> transports, const LocalRegions* regions,
                const PeerClient* client, Clock* clock, HostFacts facts);

  // Opening, refreshing and closing segments; the peers' metrics.
  SegmentRegistry& segments() { return segments_; }
  const SegmentRegistry& segments() const { return segments_; }

  // Thread-safe, any thread; none blocks while holding a lock. Submit may
  // handshake (a segment not ready); Wait blocks up to `timeout`.
  // With `cache` (the same requests each time, and one caller at a time per
  // cache), their planned slices are reused while nothing they were
  // planned on changed.
  // `submitted` (when not null) gets the time the batch counts as
  // submitted from (read before its first doorbell).
  absl::StatusOr<BatchId> Submit(SegmentId id, absl::Span<const TransferRequest> requests,
                                 const PeerBinding& bound, PlanCache* cache = nullptr,
                                 absl::Time* submitted = nullptr);
  absl::StatusOr<BatchStatus> Poll(BatchId id);
  // Poll for a caller that needs only the outcome once the batch is done
  // (delivering completions when it is not): false while it runs; true
  // with its first failed request's error (OK if none) in `first`, and
  // the batch released if `release`.
  absl::StatusOr<bool> FinishIfDone(BatchId id, absl::Status* first, bool release);
  absl::Status Wait(BatchId id, absl::Duration timeout, BatchStatus* out);
  absl::Status Release(BatchId id) { return lanes_.Release(id); }
  // Who is told when a batch submitted with PeerBinding::announce finishes.
  void SetFinishedHook(FinishedBatches* hook) { lanes_.SetHook(hook); }
  // Delivers the transports' completions, waiting in them, until ready()
  // holds or `timeout` passed; woken at once when an announced batch
  // finishes (the hook's thread waits here while nobody else may).
  bool Drive(absl::FunctionRef<bool()> ready, absl::Duration timeout);
  // The segment and peer instance a batch goes to.
  absl::StatusOr<std::pair<SegmentId, uint64_t>> Target(BatchId id) const {
    return lanes_.Target(id);
  }

 private:
  // What submitting a batch on a lane gives Poster::Post.
  struct Submission {
    std::vector<uint64_t>* slice_ids;
    std::vector<transport::WorkRequest>* wrs;  // when `assigned`: one per slice
    bool assigned = false;
    absl::Time now;
    size_t via = 0;
    PlanCache* cache = nullptr;     // Submit's
    uint64_t local_generation = 0;  // read before the local uses were looked up
  };
  // Creates the batch on `lane`: on the lane's view of the segment, read
  // again (and the segment refreshed) when it is out of date.
  absl::StatusOr<BatchId> CreateOnLane(Lane& lane, SegmentId id,
                                       absl::Span<const TransferRequest> requests,
                                       absl::Span<const LocalUse> local, const PeerBinding& bound,
                                       Submission* out);
  // The same while `ls` holds the segment's current view `seg`: plans
  // (or takes Submission::cache's plan; `local` is empty when Submit
  // counted on it, and is looked up here if it does not hold), creates the
  // batch, and assigns links when the segment has room and no backlog. kOutsideRegions in `why`
  // when a request lies outside the view's regions.
  absl::StatusOr<BatchId> SubmitOnLane(Lane& lane, LaneSegment& ls, const SegmentCore& seg,
                                       SegmentId id, absl::Span<const TransferRequest> requests,
                                       absl::Span<const LocalUse> local, const PeerBinding& bound,
                                       SliceCheck* why, Submission* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // Commits the slices `reserved` (in `lane`'s table, see
  // BatchTable::AddSlice) to a new batch of `requests`.
  BatchId CreateBatch(Lane& lane, LaneSegment& ls, SegmentId id,
                      absl::Span<const TransferRequest> requests, const PeerBinding& bound,
                      absl::Span<const uint64_t> reserved, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // SubmitOnLane with `out->cache`'s plan: its slices on the links the
  // plan's last assigned submit took, when they have room (else none, and
  // nothing done).
  std::optional<BatchId> SubmitAssigned(Lane& lane, LaneSegment& ls, const SegmentCore& seg,
                                        SegmentId id, absl::Span<const TransferRequest> requests,
                                        const PeerBinding& bound, Submission* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // Keeps in `out->cache` what AssignNow took for batch `batch`'s slices.
  void KeepAssigned(Lane& lane, const SegmentCore& seg, BatchId batch, const uint32_t* per_link,
                    const Submission* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // Submit's general path; `local`: the requests' local uses when the
  // caller looked them up (a lone request's), else empty.
  absl::StatusOr<BatchId> SubmitGeneral(SegmentId id, absl::Span<const TransferRequest> requests,
                                        const PeerBinding& bound, PlanCache* cache,
                                        absl::Span<const LocalUse> local, absl::Time* submitted);
  // CreateBatch for a lone request `r` in one slice (in the lane's table).
  BatchId CreateLone(Lane& lane, LaneSegment& ls, SegmentId id, const TransferRequest& r,
                     const PeerBinding& bound, Slice* slice, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // Submit's path for a lone request that fits one slice, on a segment
  // whose current view this thread's lane holds, with no backlog and a
  // link with room: planned (Planner::PlanLone), its slice reserved,
  // posted, and its batch committed after the post (a latency-bound
  // caller's batch). nullopt, nothing changed, when anything is unusual
  // (the general path then decides).
  std::optional<absl::StatusOr<BatchId>> SubmitOne(SegmentId id, const TransferRequest& r,
                                                   const LocalUse& local, const PeerBinding& bound,
                                                   absl::Time* submitted);
  // The lane's current view of segment `id` (and its part of it in
  // `entry`) when a lone request may take the short way on it: no
  // backlog, and the peer instance and epoch `bound` names; else null.
  const SegmentCore* LoneView(Lane& lane, SegmentId id, const PeerBinding& bound,
                              LaneSegment** entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // The same for a lone request whose `cache` holds its one slice as last
  // assigned (PlanCache::Assigned) on the lane's current view: its place
  // taken on the same link and the cached work request posted, with no
  // look-up, planning or link choice.
  std::optional<absl::StatusOr<BatchId>> SubmitOneCached(SegmentId id, const TransferRequest& r,
                                                         const PeerBinding& bound,
                                                         const PlanCache& cache,
                                                         absl::Time* submitted);
  // A lone request's batch after its doorbell: a refused post handled as
  // the general path does (the place given back, the links rebuilt and
  // the post tried again, or the slice failed); the batch, or the error
  // with the batch recycled.
  absl::StatusOr<BatchId> AfterLoneDoorbell(Lane& lane, SegmentId id,
                                            const transport::WorkRequest& wr, size_t via,
                                            absl::Time now, BatchId batch, absl::Status posted);
  // Waits in the transports up to `timeout` and delivers what completed
  // (the pump's driver).
  void Pump(absl::Duration timeout);
  // Delivers what the transports have now, without waiting; false when
  // they had nothing. Any number of threads at once (see CompletionPump).
  bool PollNow();
  // Completions taken from the transports per call.
  static constexpr size_t kPollBatch = 64;
  // FinishIfDone runs the driver's whole pump when the coarse clock
  // (CoarseNow, ns; it moves by kernel ticks of 1-4 ms) reaches
  // next_full_poll_ns_, then sets it kFullPollEvery later.
  static constexpr absl::Duration kFullPollEvery = absl::Milliseconds(1);
  std::atomic<int64_t> next_full_poll_ns_{0};

  const PipelineConfig config_;
  const std::vector<Via> vias_;
  const LocalRegions* const regions_;
  Clock* const clock_;
  CompletionPump pump_;
  Lanes lanes_;
  SegmentRegistry segments_;
  Planner planner_;
  Poster poster_;
  Delivery delivery_;
  Liveness liveness_;
  CompletionSource source_;
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_BATCH_PIPELINE_H_
