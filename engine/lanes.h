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
#ifndef KVFERRY_ENGINE_LANES_H_
#define KVFERRY_ENGINE_LANES_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "engine/batch_table.h"
#include "engine/completion_pump.h"
#include "engine/metrics.h"
#include "engine/segment_table.h"

namespace kvferry {
namespace engine_internal {

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

// Slices and bytes posted on one NIC.
struct NicTally {
  uint64_t slices = 0;
  uint64_t bytes = 0;
};

struct Lane {
  explicit Lane(uint8_t i) : index(i), batches(i) {}
  const uint8_t index;
  Mutex mu;
  BatchTable batches ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<SegmentId, LaneSegment> segments ABSL_GUARDED_BY(mu);
  std::vector<NicTally> nics ABSL_GUARDED_BY(mu);  // by the engine's NIC index
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

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_LANES_H_
