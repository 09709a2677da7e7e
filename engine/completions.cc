// BatchPipeline: delivering completions into batches, retrying slices whose
// link or peer failed, and waiting for batches.
#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/batch_pipeline.h"
#include "engine/retry_policy.h"

namespace kvferry {
namespace engine_internal {

using transport::Completion;
using transport::Opcode;

void BatchPipeline::FinishSlice(Lane& lane, uint64_t sid, absl::Status status, absl::Time now,
                                LaneSegment* entry) {
  Slice* found = lane.batches.FindSlice(sid);
  if (found == nullptr) return;
  const BatchId batch_id = found->batch;
  const size_t first = found->request, end = found->request + found->requests;
  if (entry == nullptr) {
    auto it = lane.segments.find(found->segment);
    if (it != lane.segments.end()) entry = &it->second;
  }
  lane.batches.EraseSlice(sid);
  if (entry != nullptr) --entry->slices;
  Batch* batch = lane.batches.Find(batch_id);
  if (batch == nullptr) return;
  if (status.ok()) ++batch->landed;
  for (size_t k = first; k < end; ++k) {
    if (!status.ok() && batch->status[k].ok()) batch->status[k] = status;
    if (--batch->slices_left[k] != 0) continue;
    if (--batch->pending == 0) pump_.Wake(lane.index);  // its waiter may sleep
    if (entry == nullptr) continue;
    PeerMetrics& m = entry->metrics;
    m.latency.Record(now - batch->submitted);
    const absl::Status& result = batch->status[k];
    if (result.ok()) {
      ++m.requests_ok;
      (batch->op[k] == Opcode::kWrite ? m.bytes_written : m.bytes_read) += batch->length[k];
    } else {
      ++m.errors[absl::StatusCodeToString(result.code())];
    }
  }
}

void BatchPipeline::FinishSlice(uint64_t sid, absl::Status status, absl::Time now) {
  Lane& lane = LaneOf(sid);
  MutexLock lane_lock(&lane.mu);
  FinishSlice(lane, sid, std::move(status), now);
}

void BatchPipeline::CountNicError(const Slice& slice, absl::StatusCode code) {
  if (slice.link == 0 || slice.nic >= nic_counters_.size()) return;
  ++nic_counters_[slice.nic].errors;
  ++nic_counters_[slice.nic].errors_by_code[absl::StatusCodeToString(code)];
}

bool BatchPipeline::DeliverOnLane(Lane& lane, const Completion& done, absl::Time now,
                                  LaneLookup* last, LoadReturns* returns) {
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
    FinishSlice(lane, done.cookie, absl::OkStatus(), now, last->entry);
    return true;
  }
  return false;
}

void BatchPipeline::Deliver(Completion& done, absl::Time now) {
  Lane& lane = LaneOf(done.cookie);
  MutexLock lane_lock(&lane.mu);
  Slice* s = lane.batches.FindSlice(done.cookie);
  if (s == nullptr) return;
  Segment& seg = *segments_.Find(s->segment);  // a segment with slices is never removed
  Unassign(seg, *s, now);
  if (!done.status.ok()) CountNicError(*s, done.status.code());
  if (done.status.ok() || !Retryable(done.status.code())) {
    FinishSlice(lane, done.cookie, std::move(done.status), now);
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
  if (!seg.dead.ok()) return FinishSlice(lane, done.cookie, seg.dead, now);  // no probe answer
  if (s->retries_left == 0) return FinishSlice(lane, done.cookie, std::move(done.status), now);
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
  if (s->link != 0 && s->nic < nic_counters_.size()) ++nic_counters_[s->nic].retries;
  if (healthy && done.status.code() != absl::StatusCode::kPermissionDenied) {
    if (newly_failed) seg.Publish();  // the view without the failed link
    ++counters_.link_failovers;
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

void BatchPipeline::QueueRetry(SegmentId segment, uint64_t generation, bool refresh, uint64_t slice,
                               const Link* link) {
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

absl::Status BatchPipeline::ClosePeerHalves(
    SegmentId segment, const std::vector<std::pair<transport::LinkId, std::string>>& links) {
  std::string peer;
  {
    MutexLock lock(&mu_);
    const Segment* seg = segments_.Find(segment);
    if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", segment));
    peer = seg->peer;
  }
  std::vector<std::string> names;
  for (const auto& l : links) names.push_back(l.second);
  for (size_t i = 0; i < names.size(); i += handshake::kMaxLinksPerConnect) {
    const size_t end = std::min(names.size(), i + handshake::kMaxLinksPerConnect);
    absl::Status closed =
        client_->CloseLinks(peer, std::vector<std::string>(names.begin() + i, names.begin() + end));
    if (!closed.ok()) {
      return Annotate(
          closed, absl::StrCat("closing the peer's half of ", links.size(), " failed link(s) to ",
                               peer, ", so that nothing sent on them lands late"));
    }
  }
  MutexLock lock(&mu_);
  if (Segment* seg = segments_.Find(segment); seg != nullptr) {
    for (Link& l : seg->links) {
      for (const auto& c : links) l.peer_closed = l.peer_closed || l.id == c.first;
    }
  }
  return absl::OkStatus();
}

void BatchPipeline::RefreshAndRepost() {
  std::vector<Retry> work;
  {
    MutexLock lock(&mu_);
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
    const absl::Status closed = ClosePeerHalves(r.segment, r.close);
    if (closed.ok()) continue;
    MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    for (uint64_t sid : r.slices) FinishSlice(sid, closed, now);
    r.slices.clear();
  }
  for (Retry& r : work) {
    if (!r.refresh) continue;
    bool changed = false;
    const absl::Status refreshed = Refresh(r.segment, &changed, r.broken_generation);
    MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    std::vector<uint64_t> keep;
    for (uint64_t sid : r.slices) {
      Lane& lane = LaneOf(sid);
      MutexLock lane_lock(&lane.mu);
      Slice* s = lane.batches.FindSlice(sid);
      if (s == nullptr) continue;
      if (!refreshed.ok()) {
        FinishSlice(lane, sid, RetryImpossible(refreshed, s->last_error), now);
      } else if (!changed && s->last_error.code() == absl::StatusCode::kPermissionDenied) {
        FinishSlice(lane, sid, s->last_error, now);  // same keys: retrying cannot help
      } else {
        keep.push_back(sid);
      }
    }
    r.slices = std::move(keep);
  }
  for (const Retry& r : work) {
    if (!r.slices.empty()) (void)PostSlices(r.segment, r.slices, clock_->Now());
  }
}

size_t BatchPipeline::WaitAll(absl::Span<Completion> out, absl::Duration timeout) {
  if (vias_.size() == 1) return vias_[0].transport->WaitCompletions(out, timeout);
  uint64_t seen;
  {
    MutexLock lock(&event_mu_);
    seen = events_;
  }
  size_t n = PollAll(out);
  if (n > 0 || timeout <= absl::ZeroDuration()) return n;
  {
    // The transports' notifiers bump events_ after queueing completions.
    MutexLock lock(&event_mu_);
    event_cv_.AwaitWithDeadline(
        &event_mu_, FastNow() + timeout,
        [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return events_ != seen || interrupted_; });
    interrupted_ = false;
  }
  return PollAll(out);
}

size_t BatchPipeline::PollAll(absl::Span<Completion> out) {
  size_t n = 0;
  for (const Via& v : vias_) n += v.transport->PollCompletions(out.subspan(n));
  return n;
}

bool BatchPipeline::DeliverAll(absl::Span<Completion> done, absl::Time now) {
  // Successes on their lanes alone (one taking of a lane's lock for each
  // run of its completions); the rest under the pipeline's lock.
  size_t rest = 0;
  for (size_t i = 0; i < done.size();) {
    Lane& lane = LaneOf(done[i].cookie);
    MutexLock lane_lock(&lane.mu);
    LaneLookup last;
    LoadReturns returns;
    for (; i < done.size() && &LaneOf(done[i].cookie) == &lane; ++i) {
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
    MutexLock lock(&mu_);
    for (Completion& c : done.first(rest)) Deliver(c, now);
  }
  return retries_queued_.load(std::memory_order_acquire);
}

void BatchPipeline::Pump(absl::Duration timeout) {
  // A per-thread buffer, not one built and destroyed on every call
  // (docs/performance.md, the control path). Only the pump's driver runs
  // this, so it never nests.
  constexpr size_t kDone = kPollBatch;
  thread_local std::unique_ptr<Completion[]> buffer(new Completion[kDone]);
  Completion* done = buffer.get();
  const size_t n = WaitAll(absl::MakeSpan(done, kDone), timeout);
  const absl::Time now = clock_->Now();  // one reading for every completion
  if (DeliverAll(absl::MakeSpan(done, n), now)) RefreshAndRepost();
  DrainBacklogs();
  // Not while completions are still pouring in: they are signs of life.
  if (n < kDone) CheckPeers(now);
}

bool BatchPipeline::PollNow() {
  thread_local std::unique_ptr<Completion[]> buffer(new Completion[kPollBatch]);
  Completion* done = buffer.get();
  const size_t n = PollAll(absl::MakeSpan(done, kPollBatch));
  if (n == 0) return false;
  const bool retries = DeliverAll(absl::MakeSpan(done, n), clock_->Now());
  if (pump_.Delivered()) {
    // The driver may be waiting for one of these: it looks again (and
    // takes the retries, if any).
    InterruptWaits();
  } else if (retries) {
    pump_.TryDrive([this] { RefreshAndRepost(); });
  }
  DrainBacklogs();
  return true;
}

void BatchPipeline::InterruptWaits() {
  if (vias_.size() == 1) return vias_[0].transport->InterruptWait();
  MutexLock lock(&event_mu_);
  interrupted_ = true;
  event_cv_.SignalAll();
}

absl::StatusOr<BatchStatus> BatchPipeline::Poll(BatchId id) {
  pump_.TryDrive([this] { Pump(absl::ZeroDuration()); });
  Lane& lane = LaneOf(id);
  MutexLock lane_lock(&lane.mu);
  const Batch* b = lane.batches.Find(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
  BatchStatus out;
  b->StatusTo(&out);
  return out;
}

absl::Status BatchPipeline::Wait(BatchId id, absl::Duration timeout, BatchStatus* out) {
  absl::Status result;
  bool known = true;
  Lane& lane = LaneOf(id);
  auto ready = [&] {
    MutexLock lane_lock(&lane.mu);
    const Batch* b = lane.batches.Find(id);
    if (b == nullptr) {
      known = false;
      return true;
    }
    if (b->pending != 0) return false;
    b->StatusTo(out);
    return true;
  };
  const bool done = pump_.Await(
      ready, timeout,
      [&](absl::Time until) {
        // The driver wakes at least every peer_timeout / 4 to look for
        // silent peers; completions wake it at once.
        const absl::Duration check = config_.peer_timeout / 4;
        Pump(std::max(absl::ZeroDuration(), std::min(until - clock_->Now(), check)));
      },
      [&] { return PollNow(); }, lane.index);
  if (!known) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
  if (done) return absl::OkStatus();
  MutexLock lane_lock(&lane.mu);
  const Batch* b = lane.batches.Find(id);
  return absl::DeadlineExceededError(
      absl::StrCat("batch ", id, " still has ", b == nullptr ? 0 : b->pending,
                   " request(s) pending after ", absl::FormatDuration(timeout)));
}

absl::Status BatchPipeline::Release(BatchId id) {
  Lane& lane = LaneOf(id);
  MutexLock lane_lock(&lane.mu);
  const Batch* b = lane.batches.Find(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
  if (b->pending != 0) {
    return absl::FailedPreconditionError(absl::StrCat("batch ", id, " is still running"));
  }
  lane.batches.Recycle(id);  // its vectors' capacity saves allocations later
  return absl::OkStatus();
}

}  // namespace engine_internal
}  // namespace kvferry
