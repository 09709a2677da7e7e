// Poster: assigning links to slices and posting them.
#include "engine/pipeline/poster.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/scratch.h"
#include "engine/pipeline/retry_policy.h"

namespace kvferry {
namespace engine_internal {

using transport::Opcode;
using transport::WorkRequest;

bool Poster::AssignNow(Lane& lane, LaneSegment& ls, const SegmentCore& seg,
                       absl::Span<const uint64_t> ids, absl::Time now,
                       std::vector<WorkRequest>* wrs, uint32_t* per_link) {
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
    Fill(seg, lane, ls, seg.links[wr.link], *lane.batches.FindSlice(wr.cookie), &wr);
  }
  if (per_link != nullptr) {
    for (size_t i = 0; i < seg.links.size(); ++i) per_link[i] = plan.added(i);
  }
  return true;
}

bool Poster::AssignLink(const SegmentCore& seg, Lane& lane, LaneSegment& ls, Slice& slice,
                        WorkRequest* wr, absl::Time now) {
  // Near NICs are the primary transport's.
  const Link* best = ChooseLink(seg.links, seg.via == 0 ? slice.local_use.near : 0,
                                vias_[seg.via].link_capacity, ls.home, now);
  if (best == nullptr) return false;
  Fill(seg, lane, ls, *best, slice, wr);
  return true;
}

// Inline: the lone request's path (AssignLink) pays no call for it.
inline void Poster::Fill(const SegmentCore& seg, Lane& lane, LaneSegment& ls, const Link& link,
                         Slice& slice, WorkRequest* wr) {
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

void Poster::Unassign(const SegmentCore& seg, const Slice& slice, absl::Time now) {
  if (slice.generation != seg.generation) return;  // its links are gone
  for (const Link& l : seg.links) {
    if (l.id == slice.link) l.load->Give(now);
  }
}

void Poster::Unassign(uint64_t sid, absl::Time now) {
  Lane& lane = lanes_->Of(sid);
  MutexLock lane_lock(&lane.mu);
  const Slice* s = lane.batches.FindSlice(sid);
  if (s == nullptr) return;
  if (const Segment* seg = segments_->table().Find(s->segment)) Unassign(*seg, *s, now);
}

// Under the lock: fails slices bound to a restarted peer, checks the rest
// against the descriptor and assigns links (or the backlog). False when the
// segment has no usable link; `bad` gets a check's error.
bool Poster::AssignAll(SegmentId id, absl::Span<const uint64_t> ids, absl::Time now,
                       std::vector<WorkRequest>* wrs, absl::Status* bad, size_t* via,
                       bool from_backlog) {
  MutexLock lock(&segments_->books());
  Segment& seg = *segments_->table().Find(id);  // a segment with slices is never removed
  *via = seg.via;
  bool usable = false;
  for (const Link& l : seg.links) usable = usable || !l.failed;
  // With every link failed, slices would wait for room that never comes.
  if (!usable) return false;
  for (size_t k = 0; k < ids.size(); ++k) {
    const uint64_t sid = ids[k];
    Lane& lane = lanes_->Of(sid);
    MutexLock lane_lock(&lane.mu);
    Slice* s = lane.batches.FindSlice(sid);
    if (s == nullptr) continue;
    Batch* b = lane.batches.Find(s->batch);
    if (b != nullptr && b->peer_engine_id != seg.descriptor.engine_id) {
      if (b->bound || b->landed > 0) {
        lanes_->Finish(lane, sid,
                       absl::UnavailableError(absl::StrCat(
                           "peer ", seg.peer, " restarted during the batch; ",
                           b->landed > 0 ? "part of it went to the previous instance"
                                         : "its addresses belong to the previous instance")),
                       now);
        continue;
      }
      b->peer_engine_id = seg.descriptor.engine_id;  // nothing landed: move it whole
    }
    if (b != nullptr && b->epoch != seg.epoch) {
      lanes_->Finish(lane, sid,
                     absl::FailedPreconditionError(absl::StrCat(
                         "peer ", seg.peer,
                         " fenced this engine off during the batch (declared it failed): what "
                         "was in flight to it then is lost, and is not sent again")),
                     now);
      continue;
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
    if (!AssignLink(seg, lane, lane.Entry(id), *s, &wr, now)) {
      // Every usable link is full, for the rest too: they wait, in order,
      // and are posted when a link has room (DrainBacklogs). Not tried one
      // by one: a backlog of thousands would cost each drain as much.
      seg.backlog.insert(from_backlog ? seg.backlog.begin() : seg.backlog.end(), ids.begin() + k,
                         ids.end());
      maybe_backlog_.store(true, std::memory_order_release);
      break;
    }
    wr.cookie = sid;
    wrs->push_back(wr);
  }
  if (!bad->ok()) {
    for (const WorkRequest& wr : *wrs) Unassign(wr.cookie, now);
  }
  return true;
}

void Poster::FailAll(absl::Span<const uint64_t> ids, const absl::Status& status, bool after_retry) {
  MutexLock lock(&segments_->books());
  const absl::Time now = clock_->Now();
  for (uint64_t sid : ids) {
    Lane& lane = lanes_->Of(sid);
    MutexLock lane_lock(&lane.mu);
    Slice* s = lane.batches.FindSlice(sid);
    if (s == nullptr) continue;
    lanes_->Finish(lane, sid, after_retry ? RetryImpossible(status, s->last_error) : status, now);
  }
}

absl::Status Poster::Post(SegmentId id, absl::Span<const uint64_t> ids, absl::Time now,
                          const std::vector<WorkRequest>* assigned, size_t via) {
  return PostSlices(id, ids, now, assigned, via, /*from_backlog=*/false);
}

absl::Status Poster::PostSlices(SegmentId id, absl::Span<const uint64_t> ids, absl::Time now,
                                const std::vector<WorkRequest>* assigned, size_t via,
                                bool from_backlog) {
  // The caller's work requests (never changed), then a per-thread buffer
  // (taken only then).
  std::optional<Scratch<WorkRequest>> wrs_scratch;
  const std::vector<WorkRequest>* wrs = assigned;
  bool preassigned = assigned != nullptr;  // the caller's links serve once
  bool rebuilt = false;                    // every link had failed and they were rebuilt
  bool reposted = false;                   // a refused post was followed by a rebuild
  // At most three rounds: each round but the last sets one of the two.
  for (;;) {
    absl::Status bad;
    if (!preassigned) {
      if (!wrs_scratch.has_value()) wrs_scratch.emplace();
      std::vector<WorkRequest>& mine = **wrs_scratch;
      mine.clear();
      wrs = &mine;
      if (!AssignAll(id, ids, now, &mine, &bad, &via, from_backlog)) {
        // Every link failed: rebuild them once (a dead peer fails the slices).
        bool changed;
        absl::Status refreshed =
            rebuilt ? absl::UnavailableError("every link to the peer failed, also after a rebuild")
                    : segments_->Refresh(id, &changed);
        if (!refreshed.ok()) {
          FailAll(ids, refreshed, /*after_retry=*/true);
          return refreshed;
        }
        rebuilt = true;
        now = clock_->Now();
        continue;
      }
    }
    preassigned = false;
    absl::Status posted = bad.ok() ? vias_[via].transport->Post(*wrs) : bad;
    if (posted.ok()) return absl::OkStatus();
    {
      MutexLock lock(&segments_->books());
      for (const WorkRequest& wr : *wrs) Unassign(wr.cookie, now);
    }
    // A link that failed since the last use: rebuild the links and retry.
    if (!reposted && posted.code() == absl::StatusCode::kFailedPrecondition) {
      reposted = true;
      bool changed;
      absl::Status refreshed = segments_->Refresh(id, &changed);
      if (refreshed.ok()) {
        now = clock_->Now();
        continue;
      }
      posted = refreshed;  // the peer is gone: say so, not "link in error"
    }
    FailAll(ids, posted, /*after_retry=*/false);
    return posted;
  }
}

void Poster::DrainBacklogs() {
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
    MutexLock lock(&segments_->books());
    segments_->table().ForEach([&](SegmentId id, Segment& seg) {
      if (seg.backlog.empty()) return;
      // As many as the links have room for (all of them when no link is
      // usable: Post then rebuilds the links or fails them).
      const uint32_t capacity = vias_[seg.via].link_capacity;
      size_t room = 0;
      bool usable = false;
      for (const Link& l : seg.links) {
        if (l.failed) continue;
        usable = true;
        room += capacity - std::min(capacity, l.inflight());
      }
      const size_t n = usable ? std::min(room, seg.backlog.size()) : seg.backlog.size();
      if (n < seg.backlog.size()) maybe_backlog_.store(true, std::memory_order_release);
      if (n == 0) return;
      work.emplace_back(id, std::vector<uint64_t>(seg.backlog.begin(), seg.backlog.begin() + n));
      seg.backlog.erase(seg.backlog.begin(), seg.backlog.begin() + n);
    });
  }
  for (auto& [id, ids] : work) {
    (void)PostSlices(id, ids, clock_->Now(), nullptr, 0, /*from_backlog=*/true);
  }
}

}  // namespace engine_internal
}  // namespace kvferry
