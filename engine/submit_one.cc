// BatchPipeline: the short way for a lone request (Submit's usual case
// for a latency-bound caller).
#include <optional>
#include <vector>

#include "base/mutex.h"
#include "engine/batch_pipeline.h"
#include "engine/lanes.h"
#include "engine/link_set.h"
#include "engine/segment_table.h"

namespace kvferry {
namespace engine_internal {

using transport::Opcode;
using transport::WorkRequest;

bool BatchPipeline::PlanOne(Lane& lane, SegmentId id, const TransferRequest& r,
                            const LocalUse& local, uint64_t peer_engine_id, LoneRequest* out) {
  auto it = lane.segments.find(id);
  if (it == lane.segments.end()) return false;
  LaneSegment& ls = it->second;
  const SegmentCore* seg = ls.Current();
  if (seg == nullptr || maybe_backlog_.load(std::memory_order_acquire) ||
      (peer_engine_id != 0 && peer_engine_id != seg->descriptor.engine_id)) {
    return false;
  }
  const size_t via = seg->via;
  const uint64_t at = reinterpret_cast<uintptr_t>(r.local);
  // One slice, in one local piece (as PlanSlices would cut it; FindOne
  // refused an empty request).
  if (local.region[via] == 0 || r.length > vias_[via].slice_bytes || at >= local.until ||
      r.length > local.until - at) {
    return false;
  }
  const handshake::RegionDescriptor* reg;
  absl::Status bad;
  if (CheckRemote(*seg, r.remote, r.length, r.opcode == Opcode::kWrite, &bad, &reg) !=
      SliceCheck::kOk) {
    return false;  // the general path says what is wrong (or looks again)
  }
  out->now = clock_->Now();
  const Link* link = ChooseLink(seg->links, via == 0 ? local.near : 0, vias_[via].link_capacity,
                                ls.home, out->now);
  if (link == nullptr) return false;  // no room: the general path queues it
  out->ls = &ls;
  out->via = via;
  out->slice = MakeSlice(*seg, id, r, 0, 0, r.length, local, reg, config_.retries);
  // The id CreateBatch will give the slice: the lane's lock is held until
  // then, so no other slice of the lane takes it.
  out->wr.cookie = lane.batches.NextSliceId();
  FillRequest(*seg, lane, ls, *link, out->slice, &out->wr);
  return true;
}

std::optional<absl::StatusOr<BatchId>> BatchPipeline::SubmitOne(SegmentId id,
                                                                const TransferRequest& r,
                                                                const LocalUse& local,
                                                                uint64_t peer_engine_id) {
  Lane& lane = *lanes_[ThisThreadsLane()];
  LoneRequest one;
  BatchId batch;
  absl::Status posted;
  {
    MutexLock lane_lock(&lane.mu);
    if (!PlanOne(lane, id, r, local, peer_engine_id, &one)) return std::nullopt;
    // The doorbell first, the batch's books after: a completion cannot be
    // delivered before they are kept, as delivery takes the lane's lock.
    // (A transport's Post takes its own lock and never the pipeline's.)
    posted = vias_[one.via].transport->Post({&one.wr, 1});
    uint64_t sid;  // one.wr.cookie (PlanOne)
    batch = CreateBatch(lane, *one.ls, id, {&r, 1}, peer_engine_id, {&one.slice, 1}, &sid, one.now);
  }
  if (!posted.ok()) {
    // As the general path handles a refused post (the place given back,
    // the links rebuilt and the post tried again, or the slice failed).
    std::vector<WorkRequest> assigned{one.wr};
    posted = PostSlices(id, {&one.wr.cookie, 1}, one.now, &assigned, one.via);
  }
  if (!posted.ok()) {
    MutexLock lane_lock(&lane.mu);
    lane.batches.Recycle(batch);  // nothing of it runs; the caller gets no id
    return posted;
  }
  return batch;
}

}  // namespace engine_internal
}  // namespace kvferry
