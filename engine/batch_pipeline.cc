// BatchPipeline: segments (open, refresh, close, idle expiry) and metrics.
#include "engine/batch_pipeline.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"

namespace kvferry {
namespace engine_internal {

BatchPipeline::BatchPipeline(PipelineConfig config, uint64_t engine_id,
                             transport::Transport* transport, const LocalRegions* regions,
                             const PeerClient* client, Clock* clock)
    : config_(config),
      engine_id_(engine_id),
      transport_(transport),
      regions_(regions),
      client_(client),
      clock_(clock),
      link_capacity_(std::max<uint32_t>(1, transport->GetLimits().max_outstanding_per_link)),
      pump_(clock) {
  for (const transport::NicInfo& nic : transport_->LocalEndpoint().nics) {
    nic_counters_.push_back(NicCounters{nic.name, 0, 0});
  }
}

absl::StatusOr<handshake::EngineDescriptor> BatchPipeline::Describe(
    const std::string& peer) const {
  ASSIGN_OR_RETURN(handshake::EngineDescriptor d, client_->Describe(peer));
  const std::string mine = transport_->LocalEndpoint().kind;
  if (d.transport_kind != mine) {
    return absl::FailedPreconditionError(absl::StrCat(
        "peer ", peer, " uses the ", d.transport_kind, " transport; this engine uses ", mine));
  }
  return d;
}

void BatchPipeline::CloseLinks(const std::vector<Link>& links) const {
  for (const Link& l : links) (void)transport_->CloseLink(l.id);
}

absl::StatusOr<SegmentId> BatchPipeline::Open(const std::string& peer) {
  const absl::Time now = clock_->Now();
  {
    MutexLock lock(&mu_);
    if (SegmentId id = segments_.ByPeer(peer); id != 0) {
      segments_.Find(id)->last_used = now;
      return id;
    }
    ExpireIdle(now);
  }
  ASSIGN_OR_RETURN(handshake::EngineDescriptor d, Describe(peer));
  ASSIGN_OR_RETURN(std::vector<Link> links, ConnectLinks(transport_, *client_, engine_id_, peer, d,
                                                         config_.links_per_peer, now));
  MutexLock lock(&mu_);
  if (SegmentId id = segments_.ByPeer(peer); id != 0) {  // another thread won the race
    CloseLinks(links);
    return id;
  }
  Segment seg;
  seg.peer = peer;
  seg.metrics.peer = peer;
  seg.descriptor = std::move(d);
  seg.links = std::move(links);
  seg.last_used = now;
  const SegmentId id = segments_.Add(std::move(seg));
  const Segment& s = *segments_.Find(id);
  KVF_LOG(INFO) << "opened segment " << id << " to " << peer << ": "
                << s.descriptor.regions.size() << " region(s), " << s.links.size()
                << " link(s) over " << s.descriptor.transport_kind;
  return id;
}

absl::Status BatchPipeline::Close(SegmentId id) {
  std::vector<Link> links;
  {
    MutexLock lock(&mu_);
    Segment* seg = segments_.Find(id);
    if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
    if (seg->slices > 0 || seg->state == SegmentState::kRefreshing || seg->probing) {
      return absl::FailedPreconditionError(absl::StrCat(
          "segment ", id, " to ", seg->peer, " is in use (", seg->slices,
          " slice(s) in flight); wait for its batches first"));
    }
    links = std::move(seg->links);
    KVF_LOG(INFO) << "closed segment " << id << " to " << seg->peer;
    segments_.Remove(id);
  }
  CloseLinks(links);
  return absl::OkStatus();
}

void BatchPipeline::ExpireIdle(absl::Time now) {
  // The handle stays valid (callers keep segment ids): only the links go,
  // and the next Submit handshakes again.
  segments_.ForEach([&](SegmentId id, Segment& seg) {
    if (seg.slices > 0 || seg.state != SegmentState::kReady || seg.probing ||
        seg.links.empty() || now - seg.last_used < config_.idle_segment_timeout) {
      return;
    }
    KVF_LOG(INFO) << "segment " << id << " to " << seg.peer << " idle for "
                  << absl::FormatDuration(now - seg.last_used) << ": links closed";
    CloseLinks(seg.links);  // no slice in flight: nothing completes
    seg.links.clear();
    seg.state = SegmentState::kStale;
  });
}

absl::StatusOr<std::vector<TransferEngine::RemoteRegion>> BatchPipeline::Regions(
    SegmentId id) const {
  MutexLock lock(&mu_);
  const Segment* seg = segments_.Find(id);
  if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
  std::vector<TransferEngine::RemoteRegion> out;
  for (const handshake::RegionDescriptor& r : seg->descriptor.regions) {
    out.push_back(TransferEngine::RemoteRegion{r.addr, r.length, r.access});
  }
  return out;
}

absl::StatusOr<BatchPipeline::PeerView> BatchPipeline::View(SegmentId id) const {
  MutexLock lock(&mu_);
  const Segment* seg = segments_.Find(id);
  if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
  return PeerView{seg->peer, seg->descriptor.engine_id, seg->generation};
}

// Re-reads the peer's descriptor and rebuilds the links. One refresh per
// segment at a time; callers that arrive meanwhile wait for it, and there is
// nothing to do when the links the caller found broken (`seen_generation`,
// UINT64_MAX: the current ones) were replaced since. Sets *changed when the
// peer's engine id changed.
absl::Status BatchPipeline::Refresh(SegmentId id, bool* changed, uint64_t seen_generation) {
  *changed = false;
  std::string peer;
  {
    MutexLock lock(&mu_);
    Segment* seg = segments_.Find(id);
    if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
    const uint64_t generation = seen_generation == UINT64_MAX ? seg->generation : seen_generation;
    while (seg != nullptr && seg->state == SegmentState::kRefreshing) {
      refreshed_.Wait(&mu_);
      seg = segments_.Find(id);
    }
    if (seg == nullptr) return absl::NotFoundError(absl::StrCat("segment ", id, " was closed"));
    if (seg->generation != generation) return absl::OkStatus();  // someone did it
    seg->state = SegmentState::kRefreshing;
    peer = seg->peer;
  }
  absl::StatusOr<handshake::EngineDescriptor> d = Describe(peer);
  absl::StatusOr<std::vector<Link>> links =
      d.ok() ? ConnectLinks(transport_, *client_, engine_id_, peer, *d, config_.links_per_peer,
                            clock_->Now())
             : absl::StatusOr<std::vector<Link>>(d.status());
  MutexLock lock(&mu_);
  Segment& seg = *segments_.Find(id);  // not closed: Close refuses while refreshing
  refreshed_.SignalAll();
  if (!links.ok()) {
    seg.state = SegmentState::kStale;
    return links.status();
  }
  *changed = d->engine_id != seg.descriptor.engine_id;
  if (*changed) {
    KVF_LOG(INFO) << "peer " << peer << " restarted (new engine id); descriptor refreshed";
  }
  CloseLinks(seg.links);
  seg.descriptor = std::move(*d);
  seg.links = std::move(*links);
  seg.state = SegmentState::kReady;
  seg.dead = absl::OkStatus();
  ++seg.generation;
  ++counters_.reconnects;
  ++seg.metrics.reconnects;
  return absl::OkStatus();
}

absl::StatusOr<std::pair<SegmentId, uint64_t>> BatchPipeline::Target(BatchId id) {
  MutexLock lock(&mu_);
  const Batch* b = batches_.Find(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
  return std::make_pair(b->segment, b->peer_engine_id);
}

std::vector<NicCounters> BatchPipeline::NicCountersNow() const {
  MutexLock lock(&mu_);
  return nic_counters_;
}

EngineCounters BatchPipeline::Counters() const {
  MutexLock lock(&mu_);
  return counters_;
}

std::vector<PeerMetrics> BatchPipeline::Peers() const {
  std::vector<PeerMetrics> out;
  {
    MutexLock lock(&mu_);
    const_cast<SegmentTable&>(segments_).ForEach(
        [&](SegmentId, Segment& seg) { out.push_back(seg.metrics); });
  }
  std::sort(out.begin(), out.end(),
            [](const PeerMetrics& a, const PeerMetrics& b) { return a.peer < b.peer; });
  return out;
}

}  // namespace engine_internal
}  // namespace kvferry
