// The data path: segments (peers) and their links, batches cut into slices,
// posting slices on links (with a backlog when links are full), delivering
// completions, retrying slices after link or peer failures, and probing
// peers that fell silent.
//
// Locking: batches, their slices and what they count live in lanes, one
// per submitting thread, each with its own lock (lanes.h): submitting a
// batch to a ready segment, a successful completion and waiting take that
// lane's lock alone. The pipeline's lock (mu_) guards the segment table,
// links' state, retries and the engine's counters; it is held only for
// bookkeeping, never across a transport wait or a handshake call, and
// taken before a lane's lock when both are held. Waiting for batches goes
// through the CompletionPump (its own lock, taken last). Registered memory
// (LocalRegions) is looked up before any of them.
//
// Files: batch_pipeline.cc (segments: open, refresh, close, expiry),
// submit.cc (planning and posting slices), completions.cc (delivering
// completions, retries, waiting), liveness.cc (probing silent peers).
#ifndef KVFERRY_ENGINE_BATCH_PIPELINE_H_
#define KVFERRY_ENGINE_BATCH_PIPELINE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "engine/batch_table.h"
#include "engine/completion_pump.h"
#include "engine/lanes.h"
#include "engine/local_regions.h"
#include "engine/path_choice.h"
#include "engine/peer_client.h"
#include "engine/segment_table.h"
#include "engine/transfer_engine.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

// The slice size over a transport that states no preference.
constexpr uint64_t kDefaultSliceBytes = 64 << 10;
// Links per peer over a transport that states no preference.
constexpr uint32_t kDefaultLinks = 2;

struct PipelineConfig {
  uint64_t slice_bytes = 0;  // 0: each transport's preferred request size
  uint32_t retries = 2;
  uint32_t links_per_peer = 0;  // 0: each transport's preferred link count
  absl::Duration peer_timeout = absl::Seconds(10);
  absl::Duration idle_segment_timeout = absl::Minutes(10);
};

class BatchPipeline {
 public:
  // Every pointer outlives the pipeline. `transports`: the primary first,
  // then the fallback, if any (LocalRegions' order); each peer goes over the
  // best one both ends have (see Open).
  BatchPipeline(PipelineConfig config, uint64_t engine_id,
                std::vector<transport::Transport*> transports, const LocalRegions* regions,
                const PeerClient* client, Clock* clock, HostFacts facts);
  ~BatchPipeline();

  // ---- segments (batch_pipeline.cc)
  // `peer` in canonical "host:port" form. The transport is chosen as
  // path_choice.h says; the choice and its reason are logged and kept in
  // the peer's metrics.
  absl::StatusOr<SegmentId> Open(const std::string& peer);
  absl::Status Close(SegmentId id);
  absl::StatusOr<std::vector<TransferEngine::RemoteRegion>> Regions(SegmentId id) const;
  // The peer's address, its instance and the links' generation.
  struct PeerView {
    std::string peer;
    uint64_t engine_id = 0;
    uint64_t generation = 0;
  };
  absl::StatusOr<PeerView> View(SegmentId id) const;
  // Handshakes again; see Refresh in batch_pipeline.cc.
  absl::Status Refresh(SegmentId id, bool* changed, uint64_t seen_generation = UINT64_MAX);

  // ---- batches (submit.cc, completions.cc)
  absl::StatusOr<BatchId> Submit(SegmentId id, absl::Span<const TransferRequest> requests,
                                 uint64_t peer_engine_id);
  absl::StatusOr<BatchStatus> Poll(BatchId id);
  absl::Status Wait(BatchId id, absl::Duration timeout, BatchStatus* out);
  absl::Status Release(BatchId id);
  // The segment and peer instance a batch goes to.
  absl::StatusOr<std::pair<SegmentId, uint64_t>> Target(BatchId id);

  // ---- metrics
  std::vector<NicCounters> NicCountersNow() const;
  EngineCounters Counters() const;
  std::vector<PeerMetrics> Peers() const;

 private:
  // submit.cc
  absl::Status PlanSlices(const SegmentCore& seg, SegmentId id,
                          absl::Span<const TransferRequest> requests,
                          absl::Span<const LocalUse> local, std::vector<Slice>* planned,
                          SliceCheck* why) const;
  // Appends request `r` (whose local piece is `local`) to `last`, a slice
  // of whole requests, when its bytes follow the slice's on both ends, in
  // the same local piece and peer region, and the slice stays within the
  // slice size; false (nothing changed) otherwise.
  bool Extend(const SegmentCore& seg, const TransferRequest& r, const LocalUse& local,
              Slice* last) const;
  // What submitting a batch on a lane gives PostSlices.
  struct Submission {
    std::vector<uint64_t>* slice_ids;
    std::vector<transport::WorkRequest>* wrs;  // when `assigned`: one per slice
    bool assigned = false;
    absl::Time now;
    size_t via = 0;
  };
  // Creates the batch on `lane`: on the lane's view of the segment, read
  // again (and the segment refreshed) when it is out of date.
  absl::StatusOr<BatchId> CreateOnLane(Lane& lane, SegmentId id,
                                       absl::Span<const TransferRequest> requests,
                                       absl::Span<const LocalUse> local, uint64_t peer_engine_id,
                                       Submission* out);
  // The same while `ls` holds the segment's current view `seg`: plans,
  // creates the batch, and assigns links when the segment has room and no
  // backlog. kOutsideRegions in `why` when a request lies outside the
  // view's regions.
  absl::StatusOr<BatchId> SubmitOnLane(Lane& lane, LaneSegment& ls, const SegmentCore& seg,
                                       SegmentId id, absl::Span<const TransferRequest> requests,
                                       absl::Span<const LocalUse> local, uint64_t peer_engine_id,
                                       SliceCheck* why, Submission* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // The batch of `requests` in `lane`'s table with the slices `planned`;
  // their ids go to `slice_ids` (one per slice).
  BatchId CreateBatch(Lane& lane, LaneSegment& ls, SegmentId id,
                      absl::Span<const TransferRequest> requests, uint64_t peer_engine_id,
                      absl::Span<Slice> planned, uint64_t* slice_ids, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // The slice of request `i` (`r`) at `off`, `len` bytes, in local piece
  // `use` and peer region `reg` of `seg`.
  static Slice MakeSlice(const SegmentCore& seg, SegmentId id, const TransferRequest& r, size_t i,
                         uint64_t off, uint64_t len, const LocalUse& use,
                         const handshake::RegionDescriptor* reg, uint32_t retries);
  // Submit's path for a lone request that fits one slice, on a segment
  // whose current view this thread's lane holds, with no backlog and a
  // link with room: planned, assigned and posted with no scratch buffers
  // and no plan, and its batch created after the post (a latency-bound
  // caller's batch). nullopt, nothing changed, when anything is unusual
  // (the general path then decides).
  std::optional<absl::StatusOr<BatchId>> SubmitOne(SegmentId id, const TransferRequest& r,
                                                   const LocalUse& local, uint64_t peer_engine_id);
  // A lone request as SubmitOne posts it: its slice (not yet in the
  // lane's table), its work request (its cookie: the id the slice will
  // get) and the link whose place it took.
  struct LoneRequest {
    LaneSegment* ls = nullptr;
    size_t via = 0;
    absl::Time now;
    Slice slice;
    transport::WorkRequest wr;
  };
  // SubmitOne's checks and link choice; false, nothing changed, when the
  // general path must decide.
  bool PlanOne(Lane& lane, SegmentId id, const TransferRequest& r, const LocalUse& local,
               uint64_t peer_engine_id, LoneRequest* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // Reads the segment's current view into the caller's lane, under mu_:
  // OK, or why the segment cannot take slices now (kFailedPrecondition:
  // not ready, refresh it).
  absl::Status ReadView(Lane& lane, SegmentId id);
  // Posts slices of segment `id`; those that find no room wait in its
  // backlog. `now`: the caller's reading of the clock.
  // `assigned` (when not null): work requests for every slice, on links
  // already assigned (AssignNow) for transport `via`: posted as they are
  // first, assigned again only for a retry.
  absl::Status PostSlices(SegmentId id, absl::Span<const uint64_t> ids, absl::Time now,
                          std::vector<transport::WorkRequest>* assigned = nullptr, size_t via = 0);
  // Assigns links to the slices under the lock; false when no link is usable.
  // `via`: the transport the work requests are for.
  bool AssignAll(SegmentId id, absl::Span<const uint64_t> ids, absl::Time now,
                 std::vector<transport::WorkRequest>* wrs, absl::Status* bad, size_t* via);
  // Submit's fast path: links for every slice of a new batch when the
  // segment has room for them all and no backlog (else false, nothing
  // assigned: PostSlices decides).
  bool AssignNow(Lane& lane, LaneSegment& ls, const SegmentCore& seg,
                 absl::Span<const uint64_t> ids, absl::Time now,
                 std::vector<transport::WorkRequest>* wrs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // A link for `slice` from `seg`'s (taking a place on it); false when all
  // are full or failed.
  bool AssignLink(const SegmentCore& seg, Lane& lane, LaneSegment& ls, Slice& slice,
                  transport::WorkRequest* wr, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // The work request of `slice` on `link` (whose place is taken), and what
  // it adds to the counters.
  void FillRequest(const SegmentCore& seg, Lane& lane, LaneSegment& ls, const Link& link,
                   Slice& slice, transport::WorkRequest* wr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // A slice's link has one in flight less (`seg`: the slice's segment;
  // links of older generations are gone, nothing to give back).
  static void Unassign(const SegmentCore& seg, const Slice& slice, absl::Time now);
  // The same for slice `sid` of any lane, under mu_.
  void Unassign(uint64_t sid, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailAll(absl::Span<const uint64_t> ids, const absl::Status& status, bool after_retry);
  void DrainBacklogs();
  // The lane holding batch or slice `id`.
  Lane& LaneOf(uint64_t id) const { return *lanes_[BatchTable::TagOf(id) % kLanes]; }
  // Slices of segment `id` not yet finished, in every lane; the latest
  // use of it (`last_used`, when not null).
  uint64_t SlicesOf(SegmentId id, absl::Time* last_used = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // completions.cc
  // Waits in the transport up to `timeout` and delivers what completed.
  void Pump(absl::Duration timeout);
  // Delivers what the transports have now, without waiting; false when
  // they had nothing. Any number of threads at once (see CompletionPump).
  bool PollNow();
  // What every transport has now, without waiting.
  size_t PollAll(absl::Span<transport::Completion> out);
  // Delivers `done` (completed at `now`); true when slices wait for a
  // retry.
  bool DeliverAll(absl::Span<transport::Completion> done, absl::Time now);
  // Makes the pump's driver return from its wait in the transports.
  void InterruptWaits();
  // Completions taken from the transports per call.
  static constexpr size_t kPollBatch = 64;
  // A successful completion, under its lane's lock alone: false (nothing
  // done) when its link is not in the lane's view (Deliver then). `last`:
  // the segment the lane's previous completion went to.
  struct LaneLookup {
    SegmentId segment = 0;
    LaneSegment* entry = nullptr;
  };
  bool DeliverOnLane(Lane& lane, const transport::Completion& done, absl::Time now,
                     LaneLookup* last, LoadReturns* returns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // One completion; the slice goes to `refresh` or `repost`, or finishes.
  void Deliver(transport::Completion& done, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues a failed slice for RefreshAndRepost; `link` (when not null) is
  // the failed link whose peer half must close before the slice goes again.
  void QueueRetry(SegmentId segment, uint64_t generation, bool refresh, uint64_t slice,
                  const Link* link) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefreshAndRepost();
  // Asks the peer of `segment` to close its halves of `links` (ids and the
  // names the peer gave them) and marks them closed; an error when the
  // peer could not be asked or answered one.
  absl::Status ClosePeerHalves(SegmentId segment,
                               const std::vector<std::pair<transport::LinkId, std::string>>& links);
  // Finishes slice `sid` of `lane`; `entry`: the lane's part of the
  // slice's segment when the caller has it (saves a lookup).
  void FinishSlice(Lane& lane, uint64_t sid, absl::Status status, absl::Time now,
                   LaneSegment* entry = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // The same under mu_, for a slice of any lane.
  void FinishSlice(uint64_t sid, absl::Status status, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountNicError(const Slice& slice, absl::StatusCode code) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // liveness.cc
  // Probes peers whose busy links have been silent for peer_timeout / 2;
  // at most every peer_timeout / 4.
  void CheckPeers(absl::Time now);
  void ProbeResult(SegmentId id, const std::string& peer, const absl::StatusOr<uint64_t>& answer);
  // A failed link whose NIC pair is tried again: every peer_timeout / 4 at
  // most, once its slices have moved off it.
  struct Repair {
    SegmentId segment = 0;
    uint64_t generation = 0;
    size_t via = 0;
    std::string peer;
    Link old;
    transport::NicInfo peer_nic;
  };
  void FindRepairs(absl::Time now, std::vector<Repair>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RepairLink(const Repair& r);

  // batch_pipeline.cc
  // A transport of this engine.
  struct Via {
    transport::Transport* transport = nullptr;
    std::string kind;
    uint32_t link_capacity = 1;
    uint64_t slice_bytes = 0;  // the largest slice it gets
    uint32_t links = 0;        // links it opens per peer (at least one per NIC)
    size_t nic_offset = 0;     // its NICs' first index in nic_counters_
  };
  // Which transport a peer goes over, its descriptor for it, the links.
  struct Path {
    size_t via = 0;
    handshake::EngineDescriptor descriptor;
    std::vector<Link> links;
    std::string why;
  };
  // The path ChoosePath (path_choice.h) leads to, and why.
  absl::StatusOr<Path> FindPath(const std::string& peer) const;
  // Links offered with the request for the peer's descriptor of transport
  // `via`'s kind: one round trip for both (DescribeWithLinks). Nullopt when
  // the usual choice must be made.
  absl::StatusOr<std::optional<Path>> OneRoundTrip(const std::string& peer, size_t via) const;
  absl::StatusOr<Path> Connect(const std::string& peer, size_t via,
                               handshake::EngineDescriptor d) const;
  void ExpireIdle(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseLinks(size_t via, const std::vector<Link>& links) const;
  // Waits up to `timeout` for completions on every transport.
  size_t WaitAll(absl::Span<transport::Completion> out, absl::Duration timeout);

  const PipelineConfig config_;
  const uint64_t engine_id_;
  const HostFacts facts_;
  std::vector<Via> vias_;
  std::vector<std::string> kinds_;  // vias_' kinds, in order
  const LocalRegions* const regions_;
  const PeerClient* const client_;
  Clock* const clock_;
  CompletionPump pump_;
  // With several transports: their notifiers count completions here, and
  // the pump's driver waits on it instead of inside one transport.
  Mutex event_mu_;
  CondVar event_cv_;
  uint64_t events_ ABSL_GUARDED_BY(event_mu_) = 0;
  bool interrupted_ ABSL_GUARDED_BY(event_mu_) = false;  // see InterruptWaits

  mutable Mutex mu_;
  CondVar refreshed_;  // a refresh finished
  SegmentTable segments_ ABSL_GUARDED_BY(mu_);
  // Created with the pipeline, never changed: each lane has its own lock.
  std::vector<std::unique_ptr<Lane>> lanes_;
  // Errors and retries by NIC (slices and bytes count in the lanes).
  std::vector<NicCounters> nic_counters_ ABSL_GUARDED_BY(mu_);
  EngineCounters counters_ ABSL_GUARDED_BY(mu_);
  // Slices whose link failed, by segment: refreshed first, or just re-posted
  // (their links were replaced already). Filled by Deliver, emptied by
  // RefreshAndRepost on the thread whose turn the pump's is (its driver, or
  // a poller that found no driver: see PollNow).
  struct Retry {
    SegmentId segment = 0;
    uint64_t broken_generation = 0;
    bool refresh = false;
    std::vector<uint64_t> slices;
    // Failed links whose peer halves close first: a first copy of a slice
    // still in the network must not land after its second (docs/reliability.md).
    std::vector<std::pair<transport::LinkId, std::string>> close;
  };
  std::vector<Retry> retry_ ABSL_GUARDED_BY(mu_);
  // Whether retry_ has something: read without the lock by DeliverAll.
  std::atomic<bool> retries_queued_{false};
  // When CheckPeers looks next, Unix nanoseconds; read without the lock.
  std::atomic<int64_t> next_peer_check_ns_{0};
  // Set when a slice goes to a backlog; DrainBacklogs locks only then.
  std::atomic<bool> maybe_backlog_{false};
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_BATCH_PIPELINE_H_
