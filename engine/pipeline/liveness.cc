// Liveness: probes of silent peers, repairs of failed links.
#include "engine/pipeline/liveness.h"

#include <deque>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/logging.h"

namespace kvferry {
namespace engine_internal {

Liveness::Liveness(const PipelineConfig& config, uint64_t engine_id, const std::vector<Via>* vias,
                   SegmentRegistry* segments, Lanes* lanes, const PeerClient* client, Clock* clock)
    : config_(config),
      engine_id_(engine_id),
      vias_(*vias),
      segments_(segments),
      lanes_(lanes),
      client_(client),
      clock_(clock) {}

void Liveness::Check(absl::Time now) {
  if (absl::ToUnixNanos(now) < next_check_ns_.load(std::memory_order_relaxed)) return;
  const absl::Duration half = config_.peer_timeout / 2;
  std::vector<std::pair<SegmentId, std::string>> silent;
  std::vector<Repair> repairs;
  {
    MutexLock lock(&segments_->books());
    if (absl::ToUnixNanos(now) < next_check_ns_.load(std::memory_order_relaxed)) return;
    next_check_ns_.store(absl::ToUnixNanos(now + config_.peer_timeout / 4),
                         std::memory_order_relaxed);
    segments_->ExpireIdle(now);
    FindRepairs(now, &repairs);
    segments_->table().ForEach([&](SegmentId id, Segment& seg) {
      if (seg.probing || seg.state == SegmentState::kRefreshing) return;
      for (const Link& l : seg.links) {
        // Failed links are already closed (or closing): nothing to learn.
        if (!l.failed && l.inflight() > 0 && now - l.progress() >= half) {
          seg.probing = true;
          silent.emplace_back(id, seg.peer);
          return;
        }
      }
    });
  }
  for (const auto& [id, peer] : silent) ProbeResult(id, peer, client_->Probe(peer, half));
  for (const Repair& r : repairs) RepairLink(r);
}

void Liveness::FindRepairs(absl::Time now, std::vector<Repair>* out) {
  const absl::Duration interval = config_.peer_timeout / 4;
  segments_->table().ForEach([&](SegmentId id, Segment& seg) {
    segments_->books().AssertHeld();  // as the caller
    if (seg.state != SegmentState::kReady || seg.probing) return;
    for (Link& l : seg.links) {
      if (!l.failed || l.repairing || l.inflight() > 0 || now - l.failed_at < interval ||
          l.remote_nic >= seg.descriptor.nics.size()) {
        continue;
      }
      l.repairing = true;
      out->push_back(Repair{id, seg.generation, seg.via, seg.peer, l,
                            seg.descriptor.nics[l.remote_nic], seg.descriptor.capabilities});
    }
  });
}

void Liveness::RepairLink(const Repair& r) {
  transport::Transport* t = vias_[r.via].transport;
  const transport::NicInfo local = t->LocalEndpoint().nics.at(r.old.local_nic);
  // The failed link's half at the peer goes too (a QP there otherwise).
  if (!r.old.peer_closed && !r.old.peer_params.empty()) {
    (void)client_->CloseLinks(r.peer, {r.old.peer_params}, r.capabilities);
  }
  absl::StatusOr<Link> made =
      ConnectLink(t, *client_, engine_id_, r.peer, local, r.peer_nic, r.old);
  MutexLock lock(&segments_->books());
  const absl::Time now = clock_->Now();
  Segment* seg = segments_->table().Find(r.segment);
  Link* old = nullptr;
  if (seg != nullptr && seg->generation == r.generation && seg->via == r.via) {
    for (Link& l : seg->links) {
      if (l.id == r.old.id) old = &l;
    }
  }
  if (old == nullptr) {  // the segment was refreshed or closed meanwhile
    if (made.ok()) (void)t->CloseLink(made->id);
    return;
  }
  if (!made.ok()) {
    old->repairing = false;
    old->failed_at = now;  // again after another interval
    return;
  }
  KVF_LOG(INFO) << "peer " << r.peer << ": local NIC " << r.old.local_nic << " to peer NIC "
                << r.old.remote_nic << " rebuilt and back in use";
  (void)t->CloseLink(old->id);  // nothing in flight on it
  *old = *made;                 // with a load of its own (ConnectLink)
  old->set_progress(now);
  seg->Publish();
  ++segments_->counters().links_repaired;
}

void Liveness::ProbeResult(SegmentId id, const std::string& peer,
                           const absl::StatusOr<uint64_t>& answer) {
  std::vector<transport::LinkId> close;
  size_t via = 0;
  {
    MutexLock lock(&segments_->books());
    ++segments_->counters().probes;
    Segment* found = segments_->table().Find(id);
    if (found == nullptr) return;
    Segment& seg = *found;
    seg.probing = false;
    if (answer.ok() && *answer == seg.descriptor.engine_id) {
      // Alive, only slow: give its links another period.
      for (Link& l : seg.links) l.set_progress(clock_->Now());
      return;
    }
    if (answer.ok()) {
      KVF_LOG(INFO) << "peer " << peer << " restarted (probe answered by a new engine id)";
    } else {
      ++segments_->counters().probes_failed;
      seg.dead = absl::UnavailableError(
          absl::StrCat("peer ", peer, " stopped answering: no completion for ",
                       absl::FormatDuration(config_.peer_timeout / 2),
                       " and no answer to a probe (", answer.status().message(), ")"));
      KVF_LOG(WARNING) << seg.dead.message();
    }
    // Either way the links are useless now: closing them completes their
    // slices (kCancelled), which then fail with `dead` or are retried on
    // the restarted peer. Waiting slices of the backlog fail likewise.
    if (seg.state != SegmentState::kRefreshing) seg.state = SegmentState::kStale;
    via = seg.via;
    for (Link& l : seg.links) {
      l.failed = true;
      close.push_back(l.id);
    }
    seg.Publish();
    if (!seg.dead.ok()) {
      const absl::Time now = clock_->Now();
      std::deque<uint64_t> backlog;
      backlog.swap(seg.backlog);
      for (uint64_t sid : backlog) lanes_->Finish(sid, seg.dead, now);
    }
  }
  for (transport::LinkId l : close) (void)vias_[via].transport->CloseLink(l);
}

}  // namespace engine_internal
}  // namespace kvferry
