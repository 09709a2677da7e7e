// BatchPipeline: finding peers that stopped answering while requests to
// them are in flight (EngineOptions::peer_timeout).
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "engine/batch_pipeline.h"

namespace kvferry {
namespace engine_internal {

void BatchPipeline::CheckPeers(absl::Time now) {
  if (absl::ToUnixNanos(now) < next_peer_check_ns_.load(std::memory_order_relaxed)) return;
  const absl::Duration half = config_.peer_timeout / 2;
  std::vector<std::pair<SegmentId, std::string>> silent;
  {
    MutexLock lock(&mu_);
    if (absl::ToUnixNanos(now) < next_peer_check_ns_.load(std::memory_order_relaxed)) return;
    next_peer_check_ns_.store(absl::ToUnixNanos(now + config_.peer_timeout / 4),
                              std::memory_order_relaxed);
    ExpireIdle(now);
    segments_.ForEach([&](SegmentId id, Segment& seg) {
      if (seg.probing || seg.state == SegmentState::kRefreshing) return;
      for (const Link& l : seg.links) {
        // Failed links are already closed (or closing): nothing to learn.
        if (!l.failed && l.inflight > 0 && now - l.progress >= half) {
          seg.probing = true;
          silent.emplace_back(id, seg.peer);
          return;
        }
      }
    });
  }
  for (const auto& [id, peer] : silent) ProbeResult(id, peer, client_->Probe(peer, half));
}

void BatchPipeline::ProbeResult(SegmentId id, const std::string& peer,
                                const absl::StatusOr<uint64_t>& answer) {
  std::vector<transport::LinkId> close;
  {
    MutexLock lock(&mu_);
    ++counters_.probes;
    Segment* found = segments_.Find(id);
    if (found == nullptr) return;
    Segment& seg = *found;
    seg.probing = false;
    if (answer.ok() && *answer == seg.descriptor.engine_id) {
      // Alive, only slow: give its links another period.
      for (Link& l : seg.links) l.progress = clock_->Now();
      return;
    }
    if (answer.ok()) {
      KVF_LOG(INFO) << "peer " << peer << " restarted (probe answered by a new engine id)";
    } else {
      ++counters_.probes_failed;
      seg.dead = absl::UnavailableError(absl::StrCat(
          "peer ", peer, " stopped answering: no completion for ",
          absl::FormatDuration(config_.peer_timeout / 2), " and no answer to a probe (",
          answer.status().message(), ")"));
      KVF_LOG(WARNING) << seg.dead.message();
    }
    // Either way the links are useless now: closing them completes their
    // slices (kCancelled), which then fail with `dead` or are retried on
    // the restarted peer. Waiting slices of the backlog fail likewise.
    if (seg.state != SegmentState::kRefreshing) seg.state = SegmentState::kStale;
    for (Link& l : seg.links) {
      l.failed = true;
      close.push_back(l.id);
    }
    if (!seg.dead.ok()) {
      const absl::Time now = clock_->Now();
      std::deque<uint64_t> backlog;
      backlog.swap(seg.backlog);
      for (uint64_t sid : backlog) FinishSlice(sid, seg.dead, now);
    }
  }
  for (transport::LinkId l : close) (void)transport_->CloseLink(l);
}

}  // namespace engine_internal
}  // namespace kvferry
