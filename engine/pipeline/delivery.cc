// Delivery: completions into batches, and slices retried after a link or
// peer failure.
#include "engine/pipeline/delivery.h"

#include <algorithm>
#include <utility>

#include "engine/pipeline/retry_policy.h"

namespace kvferry {
namespace engine_internal {

using transport::Completion;

void Delivery::CountNicError(const Slice& slice, absl::StatusCode code) {
  if (slice.link == 0 || slice.nic >= segments_->nic_counters().size()) return;
  ++segments_->nic_counters()[slice.nic].errors;
  ++segments_->nic_counters()[slice.nic].errors_by_code[absl::StatusCodeToString(code)];
}

bool Delivery::DeliverOnLane(Lane& lane, const Completion& done, absl::Time now, LaneLookup* last,
                             LoadReturns* returns) {
  const Slice* s = lane.batches.FindSlice(done.cookie);
  if (s == nullptr) return true;  // finished already (its batch failed)
  if (s->segment != last->segment || last->entry == nullptr) {
    auto it = lane.segments.find(s->segment);
    last->segment = s->segment;
    last->entry = it == lane.segments.end() ? nullptr : &it->second;
  }
  const SegmentCore* seg = last->entry == nullptr ? nullptr : last->entry->view.get();
  // The lane's view, current or not, while it is of the slice's links
  // (their loads are the segment's; a link replaced since is not in it).
  if (seg == nullptr || seg->generation != s->generation) return false;
  for (const Link& l : seg->links) {
    if (l.id != s->link) continue;
    returns->Add(l.load.get(), now);
    lanes_->Finish(lane, done.cookie, absl::OkStatus(), now, last->entry);
    return true;
  }
  return false;
}

void Delivery::Deliver(Completion& done, absl::Time now) {
  Lane& lane = lanes_->Of(done.cookie);
  MutexLock lane_lock(&lane.mu);
  Slice* s = lane.batches.FindSlice(done.cookie);
  if (s == nullptr) return;
  Segment& seg = *segments_->table().Find(s->segment);  // a segment with slices is never removed
  Poster::Unassign(seg, *s, now);
  if (!done.status.ok()) CountNicError(*s, done.status.code());
  if (done.status.ok() || !Retryable(done.status.code())) {
    lanes_->Finish(lane, done.cookie, std::move(done.status), now);
    return;
  }
  s->last_error = done.status;
  const Link* link = nullptr;
  for (const Link& l : seg.links) {
    if (l.id == s->link && !l.peer_closed && !l.peer_params.empty()) link = &l;
  }
  auto retry = [&](bool refresh) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    QueueRetry(s->segment, seg.generation, refresh, done.cookie, link);
  };
  if (s->generation < seg.generation) return retry(false);  // its links were replaced
  if (!seg.dead.ok()) return lanes_->Finish(lane, done.cookie, seg.dead, now);  // no probe answer
  if (s->retries_left == 0) return lanes_->Finish(lane, done.cookie, std::move(done.status), now);
  --s->retries_left;
  // The link is in error (RC semantics): no new slices on it. Move the
  // slice to a healthy link of the segment if there is one (another NIC
  // pair, say); rebuild the links only when none is left, or when the
  // peer's keys may have changed.
  bool healthy = false, newly_failed = false;
  for (Link& l : seg.links) {
    if (l.id == s->link && !l.failed) {
      l.failed = true;
      l.failed_at = now;
      newly_failed = true;
    }
    healthy = healthy || !l.failed;
  }
  ++seg.metrics.retries;
  if (s->link != 0 && s->nic < segments_->nic_counters().size())
    ++segments_->nic_counters()[s->nic].retries;
  if (healthy && done.status.code() != absl::StatusCode::kPermissionDenied) {
    if (newly_failed) seg.Publish();  // the view without the failed link
    ++segments_->counters().link_failovers;
    return retry(false);
  }
  // Published once per change (the slices of a dead link fail by the
  // thousand): the view goes while the segment waits for its refresh.
  if (newly_failed || seg.state == SegmentState::kReady) {
    seg.state = seg.state == SegmentState::kRefreshing ? seg.state : SegmentState::kStale;
    seg.Publish();
  }
  retry(true);
}

void Delivery::QueueRetry(SegmentId segment, uint64_t generation, bool refresh, uint64_t slice,
                          const Link* link) {
  MutexLock lock(&retry_mu_);
  auto it = std::find_if(retry_.begin(), retry_.end(), [&](const Retry& r) {
    return r.segment == segment && r.refresh == refresh;
  });
  if (it == retry_.end()) {
    it = retry_.insert(retry_.end(), Retry{segment, generation, refresh, {}, {}});
  }
  it->slices.push_back(slice);
  retries_queued_.store(true, std::memory_order_release);
  if (link != nullptr && std::none_of(it->close.begin(), it->close.end(),
                                      [&](const auto& c) { return c.first == link->id; })) {
    it->close.emplace_back(link->id, link->peer_params);
  }
}

void Delivery::RefreshAndRepost() {
  std::vector<Retry> work;
  {
    MutexLock lock(&retry_mu_);
    work.swap(retry_);
    retries_queued_.store(false, std::memory_order_relaxed);
  }
  // Refreshes first, so that re-posts go on the new links.
  std::stable_sort(work.begin(), work.end(),
                   [](const Retry& a, const Retry& b) { return a.refresh > b.refresh; });
  // A slice goes again only once the peer closed the failed link's half:
  // a first copy still in the network then lands nowhere (a refresh closes
  // every old link's half itself).
  for (Retry& r : work) {
    if (r.refresh || r.close.empty()) continue;
    const absl::Status closed = segments_->ClosePeerHalves(r.segment, r.close);
    if (closed.ok()) continue;
    MutexLock lock(&segments_->books());
    const absl::Time now = clock_->Now();
    for (uint64_t sid : r.slices) lanes_->Finish(sid, closed, now);
    r.slices.clear();
  }
  for (Retry& r : work) {
    if (!r.refresh) continue;
    bool changed = false;
    const absl::Status refreshed = segments_->Refresh(r.segment, &changed, r.broken_generation);
    MutexLock lock(&segments_->books());
    const absl::Time now = clock_->Now();
    std::vector<uint64_t> keep;
    for (uint64_t sid : r.slices) {
      Lane& lane = lanes_->Of(sid);
      MutexLock lane_lock(&lane.mu);
      Slice* s = lane.batches.FindSlice(sid);
      if (s == nullptr) continue;
      if (!refreshed.ok()) {
        lanes_->Finish(lane, sid, RetryImpossible(refreshed, s->last_error), now);
      } else if (!changed && s->last_error.code() == absl::StatusCode::kPermissionDenied) {
        lanes_->Finish(lane, sid, s->last_error, now);  // same keys: retrying cannot help
      } else {
        keep.push_back(sid);
      }
    }
    r.slices = std::move(keep);
  }
  for (const Retry& r : work) {
    if (!r.slices.empty()) (void)poster_->Post(r.segment, r.slices, clock_->Now());
  }
}

bool Delivery::DeliverAll(absl::Span<Completion> done, absl::Time now) {
  // Successes on their lanes alone (one taking of a lane's lock for each
  // run of its completions); the rest under the pipeline's lock.
  size_t rest = 0;
  for (size_t i = 0; i < done.size();) {
    Lane& lane = lanes_->Of(done[i].cookie);
    MutexLock lane_lock(&lane.mu);
    LaneLookup last;
    LoadReturns returns;
    for (; i < done.size() && &lanes_->Of(done[i].cookie) == &lane; ++i) {
      Completion& c = done[i];
      if (c.status.ok() && DeliverOnLane(lane, c, now, &last, &returns)) continue;
      if (rest != i) done[rest] = std::move(c);
      ++rest;
    }
    // Before the lane's lock goes: a waiter of a batch finished here looks
    // (under that lock) only once its links have their places back.
    returns.Flush(now);
  }
  if (rest > 0) {
    MutexLock lock(&segments_->books());
    for (Completion& c : done.first(rest)) Deliver(c, now);
  }
  return retries_queued_.load(std::memory_order_acquire);
}

}  // namespace engine_internal
}  // namespace kvferry
