// BatchPipeline: submitting a batch (planned by the Planner, posted by the
// Poster), and the short way for a lone request.
#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/scratch.h"
#include "base/status_macros.h"
#include "engine/pipeline/batch_pipeline.h"

namespace kvferry {
namespace engine_internal {

using transport::WorkRequest;

namespace {
// Rounds of Submit that find the segment's view changed before it gives up.
constexpr int kMaxSubmitRounds = 64;
absl::Status FencedSince(const SegmentCore& seg) {
  return absl::FailedPreconditionError(absl::StrCat(
      "peer ", seg.peer,
      " fenced this engine off (declared it failed) after the batch's peer instance was "
      "bound: what was in flight to it then is lost, and nothing more of it is sent"));
}

}  // namespace

// A new batch of `lane` to the view `ls` holds, its requests still to add.
inline BatchId StartBatch(Lane& lane, LaneSegment& ls, SegmentId id, const PeerBinding& bound,
                          absl::Time now, Batch** out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu) {
  Batch* b;
  const BatchId batch_id = lane.batches.Create(&b);
  b->segment = id;
  b->peer_engine_id = ls.view->descriptor.engine_id;
  b->epoch = ls.view->epoch;
  b->bound = bound.engine_id != 0;
  b->announce = bound.announce;
  b->submitted = now;
  *out = b;
  return batch_id;
}

BatchId BatchPipeline::CreateBatch(Lane& lane, LaneSegment& ls, SegmentId id,
                                   absl::Span<const TransferRequest> requests,
                                   const PeerBinding& bound, absl::Span<const uint64_t> reserved,
                                   absl::Time now) {
  Batch* b;
  const BatchId batch_id = StartBatch(lane, ls, id, bound, now, &b);
  b->requests.resize(requests.size());  // emptied by Reset: all fresh
  for (size_t k = 0; k < requests.size(); ++k) {
    b->requests[k].op = requests[k].opcode;
    b->requests[k].length = requests[k].length;
  }
  b->pending = requests.size();
  ls.metrics.requests += requests.size();
  ls.slices += reserved.size();
  ls.last_used = now;
  for (uint64_t sid : reserved) {
    Slice& s = *lane.batches.FindSlice(sid);
    s.batch = batch_id;
    for (size_t k = s.request; k < s.request + s.requests; ++k) ++b->requests[k].slices_left;
  }
  return batch_id;
}

BatchId BatchPipeline::CreateLone(Lane& lane, LaneSegment& ls, SegmentId id,
                                  const TransferRequest& r, const PeerBinding& bound, Slice* slice,
                                  absl::Time now) {
  Batch* b;
  const BatchId batch_id = StartBatch(lane, ls, id, bound, now, &b);
  Batch::Request& q = b->requests.emplace_back();  // emptied by Reset: fresh
  q.op = r.opcode;
  q.length = r.length;
  q.slices_left = 1;
  b->pending = 1;
  ++ls.metrics.requests;
  ++ls.slices;
  ls.last_used = now;
  slice->batch = batch_id;
  return batch_id;
}

absl::StatusOr<BatchId> BatchPipeline::SubmitOnLane(Lane& lane, LaneSegment& ls,
                                                    const SegmentCore& seg, SegmentId id,
                                                    absl::Span<const TransferRequest> requests,
                                                    absl::Span<const LocalUse> local,
                                                    const PeerBinding& bound, SliceCheck* why,
                                                    Submission* out) {
  Scratch<Slice> planned_scratch;
  const std::vector<Slice>* plan = &*planned_scratch;
  PlanCache* const cache = out->cache;
  if (cache != nullptr && cache->view.get() == &seg &&
      cache->local_generation == out->local_generation && cache->requests == requests.size()) {
    plan = &cache->slices;  // planned before, on this view
  } else {
    std::optional<Scratch<LocalUse>> looked_up;
    if (local.empty()) {
      // Submit skipped the local look-up for the cache, which no longer
      // holds (LocalRegions' lock may be taken under a lane's).
      RETURN_IF_ERROR(regions_->FindAll(requests, &*looked_up.emplace()));
      local = **looked_up;
    }
    RETURN_IF_ERROR(planner_.Plan(seg, id, requests, local, &*planned_scratch, why));
    if (cache != nullptr) {
      cache->view = ls.view;
      cache->local_generation = out->local_generation;
      cache->requests = requests.size();
      cache->slices = *planned_scratch;
      cache->assigned.valid = false;
    }
  }
  const std::vector<Slice>& planned = *plan;
  if (bound.engine_id != 0 && bound.engine_id != seg.descriptor.engine_id) {
    return absl::UnavailableError(absl::StrCat(
        "peer ", seg.peer, " restarted: the addresses of this batch belong to its predecessor"));
  }
  if (bound.epoch.has_value() && *bound.epoch != seg.epoch) return FencedSince(seg);
  out->now = clock_->Now();
  out->via = seg.via;
  out->slice_ids->clear();
  // Slices waiting in a backlog go first (PostSlices).
  const bool backlog = poster_.MaybeBacklog();
  if (cache != nullptr && plan == &cache->slices && !backlog) {
    if (std::optional<BatchId> batch = SubmitAssigned(lane, ls, seg, id, requests, bound, out)) {
      return *batch;
    }
  }
  for (const Slice& s : planned) out->slice_ids->push_back(lane.batches.AddSlice(s));
  const BatchId batch = CreateBatch(lane, ls, id, requests, bound, *out->slice_ids, out->now);
  uint32_t per_link[LinkPlan::kMaxLinks];
  out->assigned = !backlog && poster_.AssignNow(lane, ls, seg, *out->slice_ids, out->now, out->wrs,
                                                cache != nullptr ? per_link : nullptr);
  if (out->assigned && cache != nullptr) KeepAssigned(lane, seg, batch, per_link, out);
  return batch;
}

// The slices of a cached plan on the links its last assigned submit took
// (PlanCache::Assigned); none when those links lack room now.
std::optional<BatchId> BatchPipeline::SubmitAssigned(Lane& lane, LaneSegment& ls,
                                                     const SegmentCore& seg, SegmentId id,
                                                     absl::Span<const TransferRequest> requests,
                                                     const PeerBinding& bound, Submission* out) {
  PlanCache& cache = *out->cache;
  PlanCache::Assigned& a = cache.assigned;
  if (!a.valid ||
      !TakePlaces(seg.links, a.per_link, a.links, vias_[seg.via].link_capacity, out->now)) {
    return std::nullopt;
  }
  Batch* b;
  const BatchId batch = StartBatch(lane, ls, id, bound, out->now, &b);
  b->requests = a.made;
  b->pending = requests.size();
  const size_t n = cache.slices.size();
  ls.metrics.requests += requests.size();
  ls.metrics.slices += n;
  ls.slices += n;
  ls.last_used = out->now;
  a.AddTallies(&lane.nics);
  // Posted from the cache itself (Poster never changes what it is given),
  // with this batch's slice ids as cookies.
  out->slice_ids->resize(n);
  uint64_t* const ids = out->slice_ids->data();
  WorkRequest* const wrs = a.wrs.data();
  for (size_t k = 0; k < n; ++k) {
    ids[k] = lane.batches.AddSlice(cache.slices[k], batch);
    wrs[k].cookie = ids[k];
  }
  out->wrs = &a.wrs;
  out->assigned = true;
  return batch;
}

// Keeps what AssignNow did for `out->cache`'s plan: the slices as assigned,
// their work requests, the places per link and the NIC tallies.
void BatchPipeline::KeepAssigned(Lane& lane, const SegmentCore& seg, BatchId batch,
                                 const uint32_t* per_link, const Submission* out) {
  PlanCache::Assigned& a = out->cache->assigned;
  const std::vector<uint64_t>& ids = *out->slice_ids;
  a.wrs = *out->wrs;
  a.made = lane.batches.Find(batch)->requests;
  a.links = seg.links.size();
  std::copy(per_link, per_link + a.links, a.per_link);
  a.nics.clear();
  for (size_t k = 0; k < ids.size(); ++k) {
    const Slice& s = *lane.batches.FindSlice(ids[k]);
    out->cache->slices[k] = s;
    auto it =
        std::find_if(a.nics.begin(), a.nics.end(), [&](const auto& t) { return t.first == s.nic; });
    if (it == a.nics.end()) it = a.nics.insert(a.nics.end(), {s.nic, NicTally{}});
    ++it->second.slices;
    it->second.bytes += s.length;
  }
  a.valid = true;
}

absl::StatusOr<BatchId> BatchPipeline::CreateOnLane(Lane& lane, SegmentId id,
                                                    absl::Span<const TransferRequest> requests,
                                                    absl::Span<const LocalUse> local,
                                                    const PeerBinding& bound, Submission* out) {
  bool looked_again = false;  // refreshed once for a request outside the regions
  // Each round either submits on the lane's view of the segment, or finds
  // that view out of date and reads it again (refreshing the segment first
  // when it is not ready).
  for (int round = 0;; ++round) {
    SliceCheck why = SliceCheck::kOk;
    {
      MutexLock lane_lock(&lane.mu);
      auto it = lane.segments.find(id);
      if (const SegmentCore* seg = it == lane.segments.end() ? nullptr : it->second.Current()) {
        absl::StatusOr<BatchId> batch =
            SubmitOnLane(lane, it->second, *seg, id, requests, local, bound, &why, out);
        // A request outside the cached descriptor: the peer may have
        // registered more memory since; look once more before refusing.
        if (batch.ok() || why != SliceCheck::kOutsideRegions || looked_again) return batch;
        looked_again = true;
      }
    }
    bool changed;
    if (why == SliceCheck::kOutsideRegions) RETURN_IF_ERROR(segments_.Refresh(id, &changed));
    if (round >= kMaxSubmitRounds) {
      return absl::UnavailableError(absl::StrCat("segment ", id, " changed ", round,
                                                 " times while a batch was submitted to it"));
    }
    absl::Status read = segments_.ReadView(lane, id);
    if (read.code() == absl::StatusCode::kFailedPrecondition) {  // not ready
      RETURN_IF_ERROR(segments_.Refresh(id, &changed));
    } else if (!read.ok()) {
      return read;
    }
  }
}

absl::StatusOr<BatchId> BatchPipeline::Submit(SegmentId id,
                                              absl::Span<const TransferRequest> requests,
                                              const PeerBinding& bound, PlanCache* cache,
                                              absl::Time* submitted) {
  absl::Time unused;
  if (submitted == nullptr) submitted = &unused;
  if (requests.size() == 1 && cache == nullptr) {
    // The lone request: its local buffer (a thread's last piece, or under
    // the regions' own lock), then the short path if it can.
    LocalUse one;
    RETURN_IF_ERROR(regions_->FindOne(requests[0], &one));
    if (auto done = SubmitOne(id, requests[0], one, bound, submitted)) return *std::move(done);
    return SubmitGeneral(id, requests, bound, nullptr, {&one, 1}, submitted);
  }
  if (requests.size() == 1 && cache->assigned.valid && cache->slices.size() == 1) {
    if (auto done = SubmitOneCached(id, requests[0], bound, *cache, submitted)) {
      return *std::move(done);
    }
  }
  return SubmitGeneral(id, requests, bound, cache, {}, submitted);
}

absl::StatusOr<BatchId> BatchPipeline::SubmitGeneral(SegmentId id,
                                                     absl::Span<const TransferRequest> requests,
                                                     const PeerBinding& bound, PlanCache* cache,
                                                     absl::Span<const LocalUse> local,
                                                     absl::Time* submitted) {
  // Before the look-up (only a cache needs it).
  const uint64_t local_generation = cache != nullptr ? regions_->generation() : 0;
  std::optional<Scratch<LocalUse>> local_scratch;
  if (local.empty() && (cache == nullptr || cache->local_generation != local_generation ||
                        cache->requests != requests.size())) {
    // (A cache planned with these registrations holds every local use.)
    std::vector<LocalUse>& all = *local_scratch.emplace();
    RETURN_IF_ERROR(regions_->FindAll(requests, &all));
    local = all;
  }
  Scratch<uint64_t> ids_scratch;
  Scratch<WorkRequest> wrs_scratch;
  Submission sub{&*ids_scratch, &*wrs_scratch};
  sub.cache = cache;
  sub.local_generation = local_generation;
  Lane& lane = lanes_.Mine();
  ASSIGN_OR_RETURN(const BatchId batch, CreateOnLane(lane, id, requests, local, bound, &sub));
  *submitted = sub.now;
  absl::Status posted =
      poster_.Post(id, *sub.slice_ids, sub.now, sub.assigned ? sub.wrs : nullptr, sub.via);
  if (!posted.ok()) {
    MutexLock lane_lock(&lane.mu);
    lane.batches.Recycle(batch);  // nothing of it runs; the caller gets no id
    return posted;
  }
  return batch;
}

const SegmentCore* BatchPipeline::LoneView(Lane& lane, SegmentId id, const PeerBinding& bound,
                                           LaneSegment** entry) {
  *entry = lane.Find(id);
  if (*entry == nullptr) return nullptr;
  const SegmentCore* seg = (*entry)->Current();
  if (seg == nullptr || poster_.MaybeBacklog() ||
      (bound.engine_id != 0 && bound.engine_id != seg->descriptor.engine_id) ||
      (bound.epoch.has_value() && *bound.epoch != seg->epoch)) {
    return nullptr;
  }
  return seg;
}

std::optional<absl::StatusOr<BatchId>> BatchPipeline::SubmitOne(SegmentId id,
                                                                const TransferRequest& r,
                                                                const LocalUse& local,
                                                                const PeerBinding& bound,
                                                                absl::Time* submitted) {
  Lane& lane = lanes_.Mine();
  WorkRequest wr;
  size_t via;
  absl::Time now;
  BatchId batch;
  absl::Status posted;
  {
    MutexLock lane_lock(&lane.mu);
    LaneSegment* entry;
    const SegmentCore* seg = LoneView(lane, id, bound, &entry);
    if (seg == nullptr) return std::nullopt;
    LaneSegment& ls = *entry;
    // Planned in its place in the lane's table (no copy), and given back
    // when anything is unusual.
    Slice* slice;
    const uint64_t sid = lane.batches.NewSlice(&slice);
    if (!planner_.PlanLone(*seg, id, r, local, slice)) {
      lane.batches.EraseSlice(sid);
      return std::nullopt;
    }
    now = clock_->Now();
    via = seg->via;
    // No room: the general path queues it. Reserved once it has a link:
    // the work request carries the slice's id, its batch is committed
    // after the doorbell.
    if (!poster_.AssignLink(*seg, lane, ls, *slice, &wr, now)) {
      lane.batches.EraseSlice(sid);
      return std::nullopt;
    }
    wr.cookie = sid;
    // The doorbell first, the batch's books after: a completion cannot be
    // delivered before they are kept, as delivery takes the lane's lock.
    // (A transport's Post takes its own lock and never the pipeline's.)
    posted = vias_[via].transport->Post({&wr, 1});
    batch = CreateLone(lane, ls, id, r, bound, slice, now);
  }
  *submitted = now;
  return AfterLoneDoorbell(lane, id, wr, via, now, batch, std::move(posted));
}

std::optional<absl::StatusOr<BatchId>> BatchPipeline::SubmitOneCached(SegmentId id,
                                                                      const TransferRequest& r,
                                                                      const PeerBinding& bound,
                                                                      const PlanCache& cache,
                                                                      absl::Time* submitted) {
  const PlanCache::Assigned& a = cache.assigned;
  if (cache.local_generation != regions_->generation()) return std::nullopt;  // replan
  Lane& lane = lanes_.Mine();
  WorkRequest wr;
  size_t via;
  absl::Time now;
  BatchId batch;
  absl::Status posted;
  {
    MutexLock lane_lock(&lane.mu);
    LaneSegment* entry;
    const SegmentCore* seg = LoneView(lane, id, bound, &entry);
    if (seg == nullptr || seg != cache.view.get()) return std::nullopt;
    LaneSegment& ls = *entry;
    now = clock_->Now();
    via = seg->via;
    if (!TakePlaces(seg->links, a.per_link, a.links, vias_[via].link_capacity, now)) {
      return std::nullopt;
    }
    Slice* slice;
    const uint64_t sid = lane.batches.NewSlice(&slice);
    *slice = cache.slices[0];
    slice->batch = 0;  // committed by CreateLone
    wr = a.wrs[0];
    wr.cookie = sid;
    ++ls.metrics.slices;
    a.AddTallies(&lane.nics);
    // The doorbell first, the batch's books after (as SubmitOne).
    posted = vias_[via].transport->Post({&wr, 1});
    batch = CreateLone(lane, ls, id, r, bound, slice, now);
  }
  *submitted = now;
  return AfterLoneDoorbell(lane, id, wr, via, now, batch, std::move(posted));
}

absl::StatusOr<BatchId> BatchPipeline::AfterLoneDoorbell(Lane& lane, SegmentId id,
                                                         const WorkRequest& wr, size_t via,
                                                         absl::Time now, BatchId batch,
                                                         absl::Status posted) {
  if (!posted.ok()) {
    // As the general path handles a refused post (the place given back,
    // the links rebuilt and the post tried again, or the slice failed).
    std::vector<WorkRequest> assigned{wr};
    posted = poster_.Post(id, {&wr.cookie, 1}, now, &assigned, via);
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
