// The batch pipeline's lanes: per-thread shards of its batch state, so that
// threads that each submit, complete and wait for their own batches write
// nothing in common (no engine-wide lock on that path).
//
// A thread submits into its own lane (ThisThreadsLane): the lane holds the
// batch and its slices (their ids carry the lane, BatchTable's tag), what
// they add to the peer's and the NICs' counters, and the thread's copy of
// each segment's published view (SegmentShared), read without the
// pipeline's lock while its version holds. Links are chosen from that view;
// their loads are atomic (LinkLoad). A completion goes to the lane its
// slice id names, under that lane's lock alone when it succeeded on a link
// of the view the lane holds; anything else (a failure, a retry, a backlog)
// takes the pipeline's lock first, then the lane's.
#ifndef KVFERRY_ENGINE_PIPELINE_LANES_H_
#define KVFERRY_ENGINE_PIPELINE_LANES_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "engine/metrics/metrics.h"
#include "engine/pipeline/batch_table.h"
#include "engine/pipeline/completion_pump.h"
#include "engine/pipeline/link_set.h"
#include "engine/pipeline/lock_order.h"
#include "engine/pipeline/segment_table.h"

namespace kvferry {
namespace engine_internal {

// Slices and bytes posted on one NIC.
struct NicTally {
  uint64_t slices = 0;
  uint64_t bytes = 0;
};

// What a caller that submits the same requests again and again (a prepared
// transfer, engine/prepared) keeps between submits: the slices they were
// planned into, valid while the segment's view is `view` and local
// registrations are at `local_generation`. Used under the caller's own
// serialization.
struct PlanCache {
  std::shared_ptr<const SegmentCore> view;
  uint64_t local_generation = 0;
  size_t requests = 0;
  std::vector<Slice> slices;
  // Once a submit found room for every slice at once (Poster::AssignNow):
  // the links it took, so that the next submit on the same view takes the
  // same places in one step per link and posts the same work requests
  // (their cookies, the slice ids, aside) with no choice or look-up.
  struct Assigned {
    bool valid = false;
    std::vector<transport::WorkRequest> wrs;  // one per slice, in order
    std::vector<Batch::Request> made;         // the batch's requests as made
    uint32_t per_link[LinkPlan::kMaxLinks] = {};
    size_t links = 0;
    std::vector<std::pair<size_t, NicTally>> nics;  // a lane's tallies to add
    void AddTallies(std::vector<NicTally>* to) const {
      for (const auto& [nic, tally] : nics) {
        if (nic >= to->size()) continue;
        (*to)[nic].slices += tally.slices;
        (*to)[nic].bytes += tally.bytes;
      }
    }
  } assigned;
};

// A lane's part of one segment.
struct LaneSegment {
  uint64_t slices = 0;   // the lane's slices of it not yet finished
  absl::Time last_used;  // the lane's last batch to it
  // What the lane's batches added: requests, slices, results, latency (the
  // segment's own PeerMetrics holds the rest).
  PeerMetrics metrics;
  // The segment's view as the lane last read it.
  std::shared_ptr<SegmentShared> shared;
  std::shared_ptr<const SegmentCore> view;
  uint64_t version = 0;
  // Where the lane's link choice starts (ChooseLink's `start`): lanes that
  // use the segment start at different links.
  uint32_t home = 0;

  // The view, while it is the segment's current one; else null.
  const SegmentCore* Current() const {
    if (view == nullptr || shared->version.load(std::memory_order_acquire) != version) {
      return nullptr;
    }
    return view.get();
  }
  // Reads the segment's view (under the pipeline's lock).
  void Read(const Segment& seg) {
    if (shared != seg.shared) home = seg.shared->lanes.fetch_add(1, std::memory_order_relaxed);
    shared = seg.shared;
    view = seg.shared->view;
    version = seg.shared->version.load(std::memory_order_relaxed);
  }
};

struct Lane {
  explicit Lane(uint8_t i) : index(i), batches(i) {}
  const uint8_t index;
  Mutex mu{kLaneLock};
  BatchTable batches ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<SegmentId, LaneSegment> segments ABSL_GUARDED_BY(mu);
  std::vector<NicTally> nics ABSL_GUARDED_BY(mu);  // by the engine's NIC index
  // The lane's part of segment `id`, null when it has none. The last one
  // found is kept: what adds to or erases from `segments` (which may move
  // its entries) goes through Entry or Erase, which forget it.
  LaneSegment* Find(SegmentId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (last_entry != nullptr && last_id == id) return last_entry;
    auto it = segments.find(id);
    if (it == segments.end()) return nullptr;
    last_id = id;
    last_entry = &it->second;
    return last_entry;
  }
  LaneSegment& Entry(SegmentId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    last_entry = nullptr;
    return segments[id];
  }
  void Erase(SegmentId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    last_entry = nullptr;
    segments.erase(id);
  }
  SegmentId last_id ABSL_GUARDED_BY(mu) = 0;
  LaneSegment* last_entry ABSL_GUARDED_BY(mu) = nullptr;
  // The requests' latencies recorded (Lanes::Finish), once worked out per
  // batch and poll.
  LatencyMemo latency ABSL_GUARDED_BY(mu);
  char pad[64];  // the next lane's lock is on a line of its own
};

constexpr size_t kLanes = CompletionPump::kLanes;

// The calling thread's lane: threads take lanes in turn, so the first
// kLanes threads that submit each have their own. Hidden, as Scratch's
// pools (base/scratch.h).
__attribute__((visibility("hidden"))) inline size_t ThisThreadsLane() {
  static std::atomic<size_t> next{0};
  thread_local const size_t mine = next.fetch_add(1, std::memory_order_relaxed) % kLanes;
  return mine;
}

// Told of each batch submitted with PeerBinding::announce when it finishes
// (its last request done, failed or not), under the batch's lane's lock:
// Finished must only take locks of its own that nothing holds while
// calling into the pipeline, and must not block.
class FinishedBatches {
 public:
  virtual void Finished(BatchId batch) = 0;

 protected:
  ~FinishedBatches() = default;
};

// Every lane, created with the pipeline and never changed; what is done to
// a lane's batches and slices as a whole. Each method takes the lanes'
// locks it needs (one at a time) unless it says that its caller holds one.
class Lanes {
 public:
  // `nics`: the engine's NIC count (each lane tallies by NIC); `pump` is
  // woken for every batch that finishes.
  Lanes(size_t nics, CompletionPump* pump);

  // The lane holding batch or slice `id`.
  Lane& Of(uint64_t id) const { return *lanes_[BatchTable::TagOf(id) % kLanes]; }
  // The calling thread's lane (ThisThreadsLane).
  Lane& Mine() const { return *lanes_[ThisThreadsLane()]; }

  // Slices of segment `id` not yet finished, in every lane; the latest use
  // of it (`last_used`, when not null).
  uint64_t SlicesOf(SegmentId id, absl::Time* last_used = nullptr) const;
  // Drops every lane's part of a closed segment.
  void Forget(SegmentId id);
  // Adds what the lanes counted of segment `id` to `out`.
  void AddCounts(SegmentId id, PeerMetrics* out) const;
  // Adds the slices and bytes the lanes posted per NIC to `out`.
  void AddTallies(std::vector<NicCounters>* out) const;

  // Finishes slice `sid` of `lane` with `status`; `entry`: the lane's part
  // of the slice's segment when the caller has it (saves a lookup).
  void Finish(Lane& lane, uint64_t sid, absl::Status status, absl::Time now,
              LaneSegment* entry = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // The same for a slice of any lane.
  void Finish(uint64_t sid, absl::Status status, absl::Time now);

  // Who is told of announced batches (null: nobody); set before any such
  // batch is submitted, and outliving the lanes' use of it. The pump's
  // waiters on kHookLane are woken too.
  static constexpr size_t kHookLane = 0;
  void SetHook(FinishedBatches* hook) { hook_.store(hook, std::memory_order_release); }

  // A batch's segment and peer instance; its status; releasing it.
  absl::StatusOr<std::pair<SegmentId, uint64_t>> Target(BatchId id) const;
  absl::StatusOr<BatchStatus> StatusOf(BatchId id) const;
  // Whether it finished; only then its first failed request's error (OK
  // when none failed, the request named) into `first`, and, with
  // `release`, the batch released. Cheap while it runs, whatever its size.
  absl::StatusOr<bool> FirstErrorIfDone(BatchId id, absl::Status* first, bool release);
  absl::Status Release(BatchId id);

 private:
  CompletionPump* const pump_;
  std::atomic<FinishedBatches*> hook_{nullptr};
  std::vector<std::unique_ptr<Lane>> lanes_;
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_LANES_H_
