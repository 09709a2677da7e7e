// BatchPipeline: the composition of its units, and waiting for batches.
#include "engine/pipeline/batch_pipeline.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvferry {
namespace engine_internal {

using transport::Completion;

BatchPipeline::BatchPipeline(PipelineConfig config, uint64_t engine_id,
                             std::vector<transport::Transport*> transports,
                             const LocalRegions* regions, const PeerClient* client, Clock* clock,
                             HostFacts facts)
    : config_(config),
      vias_(MakeVias(transports, config_)),
      regions_(regions),
      clock_(clock),
      pump_(clock),
      lanes_(NicsOf(vias_).size(), &pump_),
      segments_(config_, engine_id, &vias_, NicsOf(vias_), client, clock, std::move(facts),
                &lanes_),
      planner_(&vias_, regions, config_.retries),
      poster_(&vias_, &segments_, &lanes_, clock),
      delivery_(&segments_, &lanes_, &poster_, clock),
      liveness_(config_, engine_id, &vias_, &segments_, &lanes_, client, clock),
      source_(&vias_) {}

void BatchPipeline::Pump(absl::Duration timeout) {
  // A per-thread buffer, not one built and destroyed on every call
  // (docs/performance.md, the control path). Only the pump's driver runs
  // this, so it never nests.
  constexpr size_t kDone = kPollBatch;
  thread_local std::unique_ptr<Completion[]> buffer(new Completion[kDone]);
  Completion* done = buffer.get();
  const size_t n = source_.WaitAll(absl::MakeSpan(done, kDone), timeout);
  const absl::Time now = clock_->Now();  // one reading for every completion
  if (delivery_.DeliverAll(absl::MakeSpan(done, n), now)) delivery_.RefreshAndRepost();
  poster_.DrainBacklogs();
  // Not while completions are still pouring in: they are signs of life.
  if (n < kDone) liveness_.Check(now);
}

bool BatchPipeline::PollNow() {
  thread_local std::unique_ptr<Completion[]> buffer(new Completion[kPollBatch]);
  Completion* done = buffer.get();
  const size_t n = source_.PollAll(absl::MakeSpan(done, kPollBatch));
  if (n == 0) return false;
  const bool retries = delivery_.DeliverAll(absl::MakeSpan(done, n), clock_->Now());
  if (pump_.Delivered()) {
    // The driver may be waiting for one of these: it looks again (and
    // takes the retries, if any).
    source_.InterruptWaits();
  } else if (retries) {
    pump_.TryDrive([this] { delivery_.RefreshAndRepost(); });
  }
  poster_.DrainBacklogs();
  return true;
}

absl::StatusOr<BatchStatus> BatchPipeline::Poll(BatchId id) {
  pump_.TryDrive([this] { Pump(absl::ZeroDuration()); });
  return lanes_.StatusOf(id);
}

absl::StatusOr<bool> BatchPipeline::FinishIfDone(BatchId id, absl::Status* first, bool release) {
  // What the transports have now, delivered as Wait's first look does: no
  // driver's turn, and when there is nothing only a coarse clock read (a
  // caller that polls in a loop sees a completion one cheap look after it
  // came). The driver's whole pump (liveness checks, backlogs) runs once
  // the coarse clock has moved kFullPollEvery past its last run (about once
  // a kernel tick while a caller keeps polling), so a caller that only
  // polls still sees a silent peer fail its batches.
  if (!PollNow()) {
    const int64_t now = absl::ToUnixNanos(CoarseNow());
    if (now >= next_full_poll_ns_.load(std::memory_order_relaxed)) {
      next_full_poll_ns_.store(now + absl::ToInt64Nanoseconds(kFullPollEvery),
                               std::memory_order_relaxed);
      pump_.TryDrive([this] { Pump(absl::ZeroDuration()); });
    }
  }
  return lanes_.FirstErrorIfDone(id, first, release);
}

bool BatchPipeline::Drive(absl::FunctionRef<bool()> ready, absl::Duration timeout) {
  return pump_.Await(
      ready, timeout,
      [&](absl::Time until) {
        const absl::Duration check = config_.peer_timeout / 4;
        Pump(std::max(absl::ZeroDuration(), std::min(until - clock_->Now(), check)));
      },
      [&] { return PollNow(); }, Lanes::kHookLane);
}

absl::Status BatchPipeline::Wait(BatchId id, absl::Duration timeout, BatchStatus* out) {
  absl::Status result;
  bool known = true;
  Lane& lane = lanes_.Of(id);
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

}  // namespace engine_internal
}  // namespace kvferry
