// Lanes: finishing slices into their batches, and what the lanes count.
#include "engine/pipeline/lanes.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvferry {
namespace engine_internal {

using transport::Opcode;

Lanes::Lanes(size_t nics, CompletionPump* pump) : pump_(pump) {
  for (size_t i = 0; i < kLanes; ++i) {
    lanes_.push_back(std::make_unique<Lane>(static_cast<uint8_t>(i)));
    MutexLock lock(&lanes_.back()->mu);
    lanes_.back()->nics.resize(nics);
  }
}

uint64_t Lanes::SlicesOf(SegmentId id, absl::Time* last_used) const {
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

void Lanes::Forget(SegmentId id) {
  for (const auto& lane : lanes_) {
    MutexLock lane_lock(&lane->mu);
    lane->Erase(id);
  }
}

void Lanes::AddCounts(SegmentId id, PeerMetrics* out) const {
  for (const auto& lane : lanes_) {
    MutexLock lane_lock(&lane->mu);
    auto it = lane->segments.find(id);
    if (it != lane->segments.end()) kvferry::AddCounts(it->second.metrics, out);
  }
}

void Lanes::AddTallies(std::vector<NicCounters>* out) const {
  for (const auto& lane : lanes_) {
    MutexLock lane_lock(&lane->mu);
    for (size_t i = 0; i < out->size() && i < lane->nics.size(); ++i) {
      (*out)[i].slices += lane->nics[i].slices;
      (*out)[i].bytes += lane->nics[i].bytes;
    }
  }
}

void Lanes::Finish(Lane& lane, uint64_t sid, absl::Status status, absl::Time now,
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
    Batch::Request& r = batch->requests[k];
    if (!status.ok() && r.status.ok()) r.status = status;
    if (--r.slices_left != 0) continue;
    if (--batch->pending == 0) {
      pump_->Wake(lane.index);  // its waiter may sleep
      if (batch->announce) {
        if (FinishedBatches* hook = hook_.load(std::memory_order_acquire)) {
          hook->Finished(batch_id);
          if (lane.index != kHookLane) pump_->Wake(kHookLane);
        }
      }
    }
    if (entry == nullptr) continue;
    PeerMetrics& m = entry->metrics;
    lane.latency.Record(m.latency, batch->submitted, now);
    const absl::Status& result = r.status;
    if (result.ok()) {
      ++m.requests_ok;
      (r.op == Opcode::kWrite ? m.bytes_written : m.bytes_read) += r.length;
    } else {
      ++m.errors[absl::StatusCodeToString(result.code())];
    }
  }
}

void Lanes::Finish(uint64_t sid, absl::Status status, absl::Time now) {
  Lane& lane = Of(sid);
  MutexLock lane_lock(&lane.mu);
  Finish(lane, sid, std::move(status), now);
}

absl::StatusOr<std::pair<SegmentId, uint64_t>> Lanes::Target(BatchId id) const {
  Lane& lane = Of(id);
  MutexLock lane_lock(&lane.mu);
  const Batch* b = lane.batches.Find(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
  return std::make_pair(b->segment, b->peer_engine_id);
}

absl::StatusOr<BatchStatus> Lanes::StatusOf(BatchId id) const {
  Lane& lane = Of(id);
  MutexLock lane_lock(&lane.mu);
  const Batch* b = lane.batches.Find(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
  BatchStatus out;
  b->StatusTo(&out);
  return out;
}

absl::StatusOr<bool> Lanes::FirstErrorIfDone(BatchId id, absl::Status* first, bool release) {
  Lane& lane = Of(id);
  MutexLock lane_lock(&lane.mu);
  const Batch* b = lane.batches.Find(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
  if (b->pending != 0) return false;
  *first = absl::OkStatus();
  for (size_t i = 0; i < b->requests.size(); ++i) {
    const absl::Status& s = b->requests[i].status;
    if (s.ok()) continue;
    *first = absl::Status(s.code(), absl::StrCat("request ", i, ": ", s.message()));
    break;
  }
  if (release) lane.batches.Recycle(id);
  return true;
}

absl::Status Lanes::Release(BatchId id) {
  Lane& lane = Of(id);
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
