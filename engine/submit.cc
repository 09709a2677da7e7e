// BatchPipeline: planning a batch into slices and posting them on links.
#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/scratch.h"
#include "base/status_macros.h"
#include "engine/batch_pipeline.h"
#include "engine/retry_policy.h"
#include "transport/checks.h"

namespace kvferry {
namespace engine_internal {

using transport::Opcode;
using transport::WorkRequest;

namespace {
// Rounds of Submit that find the segment's view changed before it gives up.
constexpr int kMaxSubmitRounds = 64;
}  // namespace

bool BatchPipeline::Extend(const SegmentCore& seg, const TransferRequest& r, const LocalUse& local,
                           Slice* last) const {
  const uint64_t end = last->length + r.length;
  if (r.opcode != last->opcode || r.length == 0 || end > vias_[seg.via].slice_bytes ||
      r.local != static_cast<char*>(last->local) + last->length ||
      r.remote != last->remote + last->length || local.region != last->local_use.region ||
      reinterpret_cast<uintptr_t>(last->local) + end > last->local_use.until) {
    return false;
  }
  // The same peer region (whose access the first request was checked for).
  const handshake::RegionDescriptor& reg = seg.descriptor.regions[last->region];
  if (!transport::RangeInside(last->remote, end, reg.addr, reg.length)) return false;
  last->length = end;
  ++last->requests;
  return true;
}

// Cuts every request into slices that never cross the end of a peer region
// or of a local piece, and checks them all; `why` says what was wrong.
absl::Status BatchPipeline::PlanSlices(const SegmentCore& seg, SegmentId id,
                                       absl::Span<const TransferRequest> requests,
                                       absl::Span<const LocalUse> local,
                                       std::vector<Slice>* planned, SliceCheck* why) const {
  bool whole = false;  // planned->back() holds whole requests only
  // The peer region of the last slice: the next often lies in it too.
  const handshake::RegionDescriptor* reg = nullptr;
  for (size_t i = 0; i < requests.size(); ++i) {
    const TransferRequest& r = requests[i];
    const LocalUse& first_piece = UseOf(local, i);
    if (first_piece.region[seg.via] == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "request ", i, ": its local buffer is GPU memory the ", vias_[seg.via].kind,
          " NICs could not register (see the RegisterMemory warning), and peer ", seg.peer,
          " is reached over ", vias_[seg.via].kind));
    }
    const bool write = r.opcode == Opcode::kWrite;
    if (whole && Extend(seg, r, first_piece, &planned->back())) continue;
    LocalUse use = first_piece;
    for (uint64_t off = 0; off < r.length;) {
      const uint64_t remote = r.remote + off;
      const uint64_t at = reinterpret_cast<uintptr_t>(r.local) + off;
      // The region of the previous slice goes on until its end.
      if (reg == nullptr || remote - reg->addr >= reg->length) reg = seg.FindRemote(remote);
      // Likewise the local piece (memory registered in pieces, see
      // LocalRegions); a buffer unregistered meanwhile is refused.
      if (at >= use.until && !regions_->FindPiece(at, &use)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "request %u: local buffer [%p, +%u) is no longer registered", i, r.local, r.length));
      }
      uint64_t len = std::min<uint64_t>(vias_[seg.via].slice_bytes, r.length - off);
      len = std::min<uint64_t>(len, use.until - at);
      if (reg != nullptr) len = std::min<uint64_t>(len, reg->addr + reg->length - remote);
      absl::Status bad;
      *why = CheckRegion(seg, reg, remote, len, write, &bad);
      if (*why != SliceCheck::kOk) return Annotate(bad, absl::StrCat("request ", i));
      planned->push_back(MakeSlice(seg, id, r, i, off, len, use, reg, config_.retries));
      whole = off == 0 && len == r.length;
      off += len;
    }
  }
  return absl::OkStatus();
}

Slice BatchPipeline::MakeSlice(const SegmentCore& seg, SegmentId id, const TransferRequest& r,
                               size_t i, uint64_t off, uint64_t len, const LocalUse& use,
                               const handshake::RegionDescriptor* reg, uint32_t retries) {
  Slice s;
  s.request = i;
  s.segment = id;
  s.opcode = r.opcode;
  s.local = static_cast<char*>(r.local) + off;
  s.local_use = use;
  s.remote = r.remote + off;
  s.length = len;
  s.retries_left = retries;
  s.checked = seg.generation + 1;
  s.region = static_cast<uint32_t>(reg - seg.descriptor.regions.data());
  return s;
}

BatchId BatchPipeline::CreateBatch(Lane& lane, LaneSegment& ls, SegmentId id,
                                   absl::Span<const TransferRequest> requests,
                                   uint64_t peer_engine_id, absl::Span<Slice> planned,
                                   uint64_t* slice_ids, absl::Time now) {
  Batch* b;
  const BatchId batch_id = lane.batches.Create(&b);
  b->segment = id;
  b->peer_engine_id = ls.view->descriptor.engine_id;
  b->bound = peer_engine_id != 0;
  b->slices_left.assign(requests.size(), 0);
  b->submitted = now;
  for (const TransferRequest& r : requests) {
    b->op.push_back(r.opcode);
    b->length.push_back(r.length);
  }
  b->status.assign(requests.size(), absl::OkStatus());
  b->pending = requests.size();
  ls.metrics.requests += requests.size();
  ls.slices += planned.size();
  ls.last_used = now;
  for (Slice& s : planned) {
    s.batch = batch_id;
    for (size_t k = s.request; k < s.request + s.requests; ++k) ++b->slices_left[k];
    *slice_ids++ = lane.batches.AddSlice(s);
  }
  return batch_id;
}

absl::Status BatchPipeline::ReadView(Lane& lane, SegmentId id) {
  MutexLock lock(&mu_);
  Segment* seg = segments_.Find(id);
  if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
  if (seg->state != SegmentState::kReady) {
    return absl::FailedPreconditionError(absl::StrCat("segment ", id, " is not ready"));
  }
  MutexLock lane_lock(&lane.mu);
  lane.segments[id].Read(*seg);
  return absl::OkStatus();
}

absl::StatusOr<BatchId> BatchPipeline::SubmitOnLane(Lane& lane, LaneSegment& ls,
                                                    const SegmentCore& seg, SegmentId id,
                                                    absl::Span<const TransferRequest> requests,
                                                    absl::Span<const LocalUse> local,
                                                    uint64_t peer_engine_id, SliceCheck* why,
                                                    Submission* out) {
  Scratch<Slice> planned_scratch;
  std::vector<Slice>& planned = *planned_scratch;
  RETURN_IF_ERROR(PlanSlices(seg, id, requests, local, &planned, why));
  if (peer_engine_id != 0 && peer_engine_id != seg.descriptor.engine_id) {
    return absl::UnavailableError(absl::StrCat(
        "peer ", seg.peer, " restarted: the addresses of this batch belong to its predecessor"));
  }
  out->now = clock_->Now();
  out->via = seg.via;
  out->slice_ids->resize(planned.size());
  const BatchId batch = CreateBatch(lane, ls, id, requests, peer_engine_id,
                                    absl::MakeSpan(planned), out->slice_ids->data(), out->now);
  // Slices waiting in a backlog go first (PostSlices).
  out->assigned = !maybe_backlog_.load(std::memory_order_acquire) &&
                  AssignNow(lane, ls, seg, *out->slice_ids, out->now, out->wrs);
  return batch;
}

absl::StatusOr<BatchId> BatchPipeline::CreateOnLane(Lane& lane, SegmentId id,
                                                    absl::Span<const TransferRequest> requests,
                                                    absl::Span<const LocalUse> local,
                                                    uint64_t peer_engine_id, Submission* out) {
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
            SubmitOnLane(lane, it->second, *seg, id, requests, local, peer_engine_id, &why, out);
        // A request outside the cached descriptor: the peer may have
        // registered more memory since; look once more before refusing.
        if (batch.ok() || why != SliceCheck::kOutsideRegions || looked_again) return batch;
        looked_again = true;
      }
    }
    bool changed;
    if (why == SliceCheck::kOutsideRegions) RETURN_IF_ERROR(Refresh(id, &changed));
    if (round >= kMaxSubmitRounds) {
      return absl::UnavailableError(absl::StrCat("segment ", id, " changed ", round,
                                                 " times while a batch was submitted to it"));
    }
    absl::Status read = ReadView(lane, id);
    if (read.code() == absl::StatusCode::kFailedPrecondition) {  // not ready
      RETURN_IF_ERROR(Refresh(id, &changed));
    } else if (!read.ok()) {
      return read;
    }
  }
}

absl::StatusOr<BatchId> BatchPipeline::Submit(SegmentId id,
                                              absl::Span<const TransferRequest> requests,
                                              uint64_t peer_engine_id) {
  // Local buffers first (under the regions' own lock, or a thread's last piece).
  LocalUse one;
  std::optional<Scratch<LocalUse>> local_scratch;  // for more than one
  absl::Span<const LocalUse> local;
  if (requests.size() == 1) {
    RETURN_IF_ERROR(regions_->FindOne(requests[0], &one));
    if (auto done = SubmitOne(id, requests[0], one, peer_engine_id)) return *std::move(done);
    local = {&one, 1};
  } else {
    std::vector<LocalUse>& all = *local_scratch.emplace();
    RETURN_IF_ERROR(regions_->FindAll(requests, &all));
    local = all;
  }
  Scratch<uint64_t> ids_scratch;
  Scratch<WorkRequest> wrs_scratch;
  Submission sub{&*ids_scratch, &*wrs_scratch};
  Lane& lane = *lanes_[ThisThreadsLane()];
  ASSIGN_OR_RETURN(const BatchId batch,
                   CreateOnLane(lane, id, requests, local, peer_engine_id, &sub));
  absl::Status posted =
      PostSlices(id, *sub.slice_ids, sub.now, sub.assigned ? sub.wrs : nullptr, sub.via);
  if (!posted.ok()) {
    MutexLock lane_lock(&lane.mu);
    lane.batches.Recycle(batch);  // nothing of it runs; the caller gets no id
    return posted;
  }
  return batch;
}

bool BatchPipeline::AssignNow(Lane& lane, LaneSegment& ls, const SegmentCore& seg,
                              absl::Span<const uint64_t> ids, absl::Time now,
                              std::vector<WorkRequest>* wrs) {
  LinkPlan plan;
  if (!plan.Begin(&seg.links, vias_[seg.via].link_capacity, ls.home)) return false;
  // Near NICs are the primary transport's.
  for (uint64_t sid : ids) {
    const int k = plan.Next(seg.via == 0 ? lane.batches.FindSlice(sid)->local_use.near : 0);
    if (k < 0) {  // no room for them all: PostSlices decides
      wrs->clear();
      return false;
    }
    WorkRequest wr;
    wr.cookie = sid;
    wr.link = static_cast<transport::LinkId>(k);  // the link's index until Take
    wrs->push_back(wr);
  }
  if (!plan.Take(now)) {
    wrs->clear();
    return false;
  }
  for (WorkRequest& wr : *wrs) {
    FillRequest(seg, lane, ls, seg.links[wr.link], *lane.batches.FindSlice(wr.cookie), &wr);
  }
  return true;
}

bool BatchPipeline::AssignLink(const SegmentCore& seg, Lane& lane, LaneSegment& ls, Slice& slice,
                               WorkRequest* wr, absl::Time now) {
  // Near NICs are the primary transport's.
  const Link* best = ChooseLink(seg.links, seg.via == 0 ? slice.local_use.near : 0,
                                vias_[seg.via].link_capacity, ls.home, now);
  if (best == nullptr) return false;
  FillRequest(seg, lane, ls, *best, slice, wr);
  return true;
}

void BatchPipeline::FillRequest(const SegmentCore& seg, Lane& lane, LaneSegment& ls,
                                const Link& link, Slice& slice, WorkRequest* wr) {
  const size_t nic = vias_[seg.via].nic_offset + link.local_nic;
  if (nic < lane.nics.size()) {
    ++lane.nics[nic].slices;
    lane.nics[nic].bytes += slice.length;
  }
  ++ls.metrics.slices;
  const handshake::RegionDescriptor& r = seg.descriptor.regions[slice.region];
  slice.generation = seg.generation;
  slice.link = link.id;
  slice.nic = static_cast<transport::NicIndex>(nic);
  wr->opcode = slice.opcode;
  wr->link = link.id;
  wr->local_region = slice.local_use.region[seg.via];
  wr->local_addr = slice.local;
  wr->length = slice.length;
  wr->remote_addr = slice.remote;
  wr->remote_key = r.keys[link.remote_nic];
}

void BatchPipeline::Unassign(const SegmentCore& seg, const Slice& slice, absl::Time now) {
  if (slice.generation != seg.generation) return;  // its links are gone
  for (const Link& l : seg.links) {
    if (l.id == slice.link) l.load->Give(now);
  }
}

void BatchPipeline::Unassign(uint64_t sid, absl::Time now) {
  Lane& lane = LaneOf(sid);
  MutexLock lane_lock(&lane.mu);
  const Slice* s = lane.batches.FindSlice(sid);
  if (s == nullptr) return;
  if (const Segment* seg = segments_.Find(s->segment)) Unassign(*seg, *s, now);
}

uint64_t BatchPipeline::SlicesOf(SegmentId id, absl::Time* last_used) const {
  uint64_t n = 0;
  for (const auto& lane : lanes_) {
    MutexLock lane_lock(&lane->mu);
    auto it = lane->segments.find(id);
    if (it == lane->segments.end()) continue;
    n += it->second.slices;
    if (last_used != nullptr) *last_used = std::max(*last_used, it->second.last_used);
  }
  return n;
}

// Under the lock: fails slices bound to a restarted peer, checks the rest
// against the descriptor and assigns links (or the backlog). False when the
// segment has no usable link; `bad` gets a check's error.
bool BatchPipeline::AssignAll(SegmentId id, absl::Span<const uint64_t> ids, absl::Time now,
                              std::vector<WorkRequest>* wrs, absl::Status* bad, size_t* via) {
  MutexLock lock(&mu_);
  Segment& seg = *segments_.Find(id);  // a segment with slices is never removed
  *via = seg.via;
  bool usable = false;
  for (const Link& l : seg.links) usable = usable || !l.failed;
  // With every link failed, slices would wait for room that never comes.
  if (!usable) return false;
  for (uint64_t sid : ids) {
    Lane& lane = LaneOf(sid);
    MutexLock lane_lock(&lane.mu);
    Slice* s = lane.batches.FindSlice(sid);
    if (s == nullptr) continue;
    Batch* b = lane.batches.Find(s->batch);
    if (b != nullptr && b->peer_engine_id != seg.descriptor.engine_id) {
      if (b->bound || b->landed > 0) {
        FinishSlice(lane, sid,
                    absl::UnavailableError(absl::StrCat(
                        "peer ", seg.peer, " restarted during the batch; ",
                        b->landed > 0 ? "part of it went to the previous instance"
                                      : "its addresses belong to the previous instance")),
                    now);
        continue;
      }
      b->peer_engine_id = seg.descriptor.engine_id;  // nothing landed: move it whole
    }
    // Checked against this descriptor when planned; again after a refresh.
    if (s->checked != seg.generation + 1) {
      const handshake::RegionDescriptor* reg;
      if (CheckRemote(seg, s->remote, s->length, s->opcode == Opcode::kWrite, bad, &reg) !=
          SliceCheck::kOk) {
        break;
      }
      s->checked = seg.generation + 1;
      s->region = static_cast<uint32_t>(reg - seg.descriptor.regions.data());
    }
    WorkRequest wr;
    if (!AssignLink(seg, lane, lane.segments[id], *s, &wr, now)) {
      seg.backlog.push_back(sid);  // posted when a link has room
      maybe_backlog_.store(true, std::memory_order_release);
      continue;
    }
    wr.cookie = sid;
    wrs->push_back(wr);
  }
  if (!bad->ok()) {
    for (const WorkRequest& wr : *wrs) Unassign(wr.cookie, now);
  }
  return true;
}

void BatchPipeline::FailAll(absl::Span<const uint64_t> ids, const absl::Status& status,
                            bool after_retry) {
  MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  for (uint64_t sid : ids) {
    Lane& lane = LaneOf(sid);
    MutexLock lane_lock(&lane.mu);
    Slice* s = lane.batches.FindSlice(sid);
    if (s == nullptr) continue;
    FinishSlice(lane, sid, after_retry ? RetryImpossible(status, s->last_error) : status, now);
  }
}

absl::Status BatchPipeline::PostSlices(SegmentId id, absl::Span<const uint64_t> ids,
                                       absl::Time now, std::vector<WorkRequest>* assigned,
                                       size_t via) {
  // The caller's work requests, or a per-thread buffer (taken only then).
  std::optional<Scratch<WorkRequest>> wrs_scratch;
  std::vector<WorkRequest>& wrs = assigned != nullptr ? *assigned : *wrs_scratch.emplace();
  bool rebuilt = false;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt > 0) now = clock_->Now();
    absl::Status bad;
    const bool preassigned = assigned != nullptr;
    assigned = nullptr;  // the caller's links serve once; a retry assigns again
    if (!preassigned) wrs.clear();
    if (!preassigned && !AssignAll(id, ids, now, &wrs, &bad, &via)) {
      // Every link failed: rebuild them once (a dead peer fails the slices).
      bool changed;
      absl::Status refreshed =
          rebuilt ? absl::UnavailableError("every link to the peer failed, also after a rebuild")
                  : Refresh(id, &changed);
      rebuilt = true;
      if (refreshed.ok()) {
        --attempt;  // rebuilding is not a failed attempt
        continue;
      }
      FailAll(ids, refreshed, /*after_retry=*/true);
      return refreshed;
    }
    absl::Status posted = bad.ok() ? vias_[via].transport->Post(wrs) : bad;
    if (posted.ok()) return absl::OkStatus();
    {
      MutexLock lock(&mu_);
      for (const WorkRequest& wr : wrs) Unassign(wr.cookie, now);
    }
    // A link that failed since the last use: rebuild the links and retry.
    if (attempt == 0 && posted.code() == absl::StatusCode::kFailedPrecondition) {
      bool changed;
      absl::Status refreshed = Refresh(id, &changed);
      if (refreshed.ok()) continue;
      posted = refreshed;  // the peer is gone: say so, not "link in error"
    }
    FailAll(ids, posted, /*after_retry=*/false);
    return posted;
  }
  return absl::InternalError("unreachable");
}

void BatchPipeline::DrainBacklogs() {
  // Cleared before looking, so a slice that goes to a backlog meanwhile
  // (or is put back below) sets it again for the next drain. Read first:
  // a write on every call would bounce its line between every thread that
  // delivers completions.
  if (!maybe_backlog_.load(std::memory_order_relaxed) ||
      !maybe_backlog_.exchange(false, std::memory_order_acquire)) {
    return;
  }
  std::vector<std::pair<SegmentId, std::vector<uint64_t>>> work;
  {
    MutexLock lock(&mu_);
    segments_.ForEach([&](SegmentId id, Segment& seg) {
      if (seg.backlog.empty()) return;
      work.emplace_back(id, std::vector<uint64_t>(seg.backlog.begin(), seg.backlog.end()));
      seg.backlog.clear();
    });
  }
  for (auto& [id, ids] : work) (void)PostSlices(id, ids, clock_->Now());
}

}  // namespace engine_internal
}  // namespace kvferry
