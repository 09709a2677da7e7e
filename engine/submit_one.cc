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

std::optional<absl::StatusOr<BatchId>> BatchPipeline::SubmitOne(SegmentId id,
                                                                const TransferRequest& r,
                                                                const LocalUse& local,
                                                                uint64_t peer_engine_id) {
  Lane& lane = *lanes_[ThisThreadsLane()];
  WorkRequest wr;
  BatchId batch;
  uint64_t sid;
  size_t via;
  absl::Time now;
  {
    MutexLock lane_lock(&lane.mu);
    auto it = lane.segments.find(id);
    if (it == lane.segments.end()) return std::nullopt;
    LaneSegment& ls = it->second;
    const SegmentCore* seg = ls.Current();
    if (seg == nullptr || maybe_backlog_.load(std::memory_order_acquire) ||
        (peer_engine_id != 0 && peer_engine_id != seg->descriptor.engine_id)) {
      return std::nullopt;
    }
    via = seg->via;
    const uint64_t at = reinterpret_cast<uintptr_t>(r.local);
    // One slice, in one local piece (as PlanSlices would cut it; FindOne
    // refused an empty request).
    if (local.region[via] == 0 || r.length > vias_[via].slice_bytes ||
        at >= local.until || r.length > local.until - at) {
      return std::nullopt;
    }
    const handshake::RegionDescriptor* reg;
    absl::Status bad;
    if (CheckRemote(*seg, r.remote, r.length, r.opcode == Opcode::kWrite, &bad, &reg) !=
        SliceCheck::kOk) {
      return std::nullopt;  // the general path says what is wrong (or looks again)
    }
    now = clock_->Now();
    const Link* link = ChooseLink(seg->links, via == 0 ? local.near : 0,
                                  vias_[via].link_capacity, ls.home, now);
    if (link == nullptr) return std::nullopt;  // no room: the general path queues it
    Slice slice = MakeSlice(*seg, id, r, 0, 0, r.length, local, reg, config_.retries);
    batch = CreateBatch(lane, ls, id, {&r, 1}, peer_engine_id, {&slice, 1}, &sid, now);
    wr.cookie = sid;
    FillRequest(*seg, lane, ls, *link, *lane.batches.FindSlice(sid), &wr);
  }
  absl::Status posted = vias_[via].transport->Post({&wr, 1});
  if (!posted.ok()) {
    // As the general path handles a refused post (the place given back,
    // the links rebuilt and the post tried again, or the slice failed).
    std::vector<WorkRequest> assigned{wr};
    posted = PostSlices(id, {&sid, 1}, now, &assigned, via);
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
