// SegmentRegistry: opening, refreshing, closing and expiring segments.
#include "engine/pipeline/segment_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "net/socket.h"

namespace kvferry {
namespace engine_internal {

SegmentRegistry::SegmentRegistry(const PipelineConfig& config, uint64_t engine_id,
                                 const std::vector<Via>* vias, std::vector<NicCounters> nics,
                                 const PeerClient* client, Clock* clock, HostFacts facts,
                                 Lanes* lanes)
    : config_(config),
      engine_id_(engine_id),
      vias_(*vias),
      client_(client),
      clock_(clock),
      facts_(std::move(facts)),
      lanes_(lanes),
      nic_counters_(std::move(nics)) {
  for (const Via& v : vias_) kinds_.push_back(v.kind);
}

void SegmentRegistry::CloseLinks(size_t via, const std::vector<Link>& links) const {
  for (const Link& l : links) (void)vias_[via].transport->CloseLink(l.id);
}

absl::StatusOr<SegmentRegistry::Path> SegmentRegistry::Connect(
    const std::string& peer, size_t via, handshake::EngineDescriptor d) const {
  Path p;
  p.via = via;
  ASSIGN_OR_RETURN(p.links, ConnectLinks(vias_[via].transport, *client_, engine_id_, peer, d,
                                         vias_[via].links, clock_->Now()));
  p.descriptor = std::move(d);
  return p;
}

absl::StatusOr<std::optional<SegmentRegistry::Path>> SegmentRegistry::OneRoundTrip(
    const std::string& peer, size_t via) const {
  absl::StatusOr<DescribedLinks> quick =
      DescribeWithLinks(vias_[via].transport, *client_, engine_id_, peer, vias_[via].kind,
                        vias_[via].links, clock_->Now());
  // No such transport at the peer (kNotFound): the usual choice says so; a
  // transport that cannot offer links early (kUnimplemented) takes it too.
  if (!quick.ok() && quick.status().code() != absl::StatusCode::kNotFound &&
      quick.status().code() != absl::StatusCode::kUnimplemented) {
    return quick.status();
  }
  if (!quick.ok() || quick->links.status().code() == absl::StatusCode::kUnimplemented) {
    return std::nullopt;
  }
  if (!quick->links.ok()) return quick->links.status();
  return Path{via, std::move(quick->descriptor), std::move(*quick->links), ""};
}

uint64_t SegmentRegistry::Path::epoch() const {
  uint64_t e = 0;
  for (const Link& l : links) e = std::max(e, l.epoch);
  return e;
}

absl::StatusOr<SegmentRegistry::Path> SegmentRegistry::FindPath(const std::string& peer) const {
  const uint64_t epoch = client_->EpochWith(peer);
  absl::StatusOr<Path> p = FindPathOnce(peer);
  if (!p.ok() && client_->EpochWith(peer) != epoch) p = FindPathOnce(peer);
  return p;
}

// Runs the steps ChoosePath (path_choice.h) gives until one succeeds or it
// says no: describing the peer and connecting links are the only I/O.
absl::StatusOr<SegmentRegistry::Path> SegmentRegistry::FindPathOnce(const std::string& peer) const {
  PeerFacts theirs;
  theirs.address = peer;
  absl::StatusOr<net::HostPort> hp = net::ParseHostPort(peer);
  theirs.host = hp.ok() ? hp->host : peer;
  std::optional<handshake::EngineDescriptor> primary;
  // Every step but the last adds a fact; this bounds a choice gone wrong.
  for (size_t steps = 0; steps < 4 + 2 * kinds_.size(); ++steps) {
    const PathStep step = ChoosePath(kinds_, theirs, facts_);
    switch (step.action) {
      case PathStep::Action::kFail:
        return step.error;
      case PathStep::Action::kDescribe: {
        ASSIGN_OR_RETURN(handshake::EngineDescriptor d, client_->Describe(peer));
        theirs.primary = d.transport_kind;
        primary = std::move(d);
        continue;
      }
      case PathStep::Action::kOneRoundTrip: {
        ASSIGN_OR_RETURN(std::optional<Path> quick, OneRoundTrip(peer, step.via));
        if (quick.has_value()) {
          quick->why = step.why;
          return std::move(*quick);
        }
        theirs.one_round_trip_tried = true;
        continue;
      }
      case PathStep::Action::kConnect:
        break;
    }
    // Before the peer is described, a connect step is the same-host one:
    // its failure leaves the usual choice.
    const bool same_host = theirs.primary.empty();
    absl::StatusOr<handshake::EngineDescriptor> d =
        primary.has_value() && primary->transport_kind == step.kind
            ? absl::StatusOr<handshake::EngineDescriptor>(*primary)
            : client_->Describe(peer, step.kind);
    // The peer has no such transport (an older peer answers with its
    // primary whatever is asked).
    if (!d.ok() || d->transport_kind != step.kind) {
      if (same_host) theirs.same_host_tried = true;
      if (!same_host) theirs.lacks.insert(step.kind);
      continue;
    }
    absl::StatusOr<Path> p = Connect(peer, step.via, std::move(*d));
    if (p.ok()) {
      p->why = step.why;
      return p;
    }
    if (same_host) theirs.same_host_tried = true;
    if (!same_host) theirs.failed.emplace_back(step.kind, p.status());
  }
  return absl::InternalError(absl::StrCat("no transport chosen for peer ", peer));
}

absl::StatusOr<SegmentId> SegmentRegistry::Open(const std::string& peer) {
  const absl::Time now = clock_->Now();
  {
    MutexLock lock(&mu_);
    if (SegmentId id = table_.ByPeer(peer); id != 0) {
      table_.Find(id)->last_used = now;
      return id;
    }
    ExpireIdle(now);
  }
  ASSIGN_OR_RETURN(Path path, FindPath(peer));
  MutexLock lock(&mu_);
  if (SegmentId id = table_.ByPeer(peer); id != 0) {  // another thread won the race
    CloseLinks(path.via, path.links);
    return id;
  }
  Segment seg;
  seg.peer = peer;
  seg.metrics.peer = peer;
  seg.metrics.transport = vias_[path.via].kind;
  seg.metrics.transport_reason = path.why;
  seg.via = path.via;
  seg.descriptor = std::move(path.descriptor);
  seg.epoch = path.epoch();
  seg.links = std::move(path.links);
  seg.last_used = now;
  const SegmentId id = table_.Add(std::move(seg));
  Segment& s = *table_.Find(id);
  s.Publish();
  KVF_LOG(INFO) << "opened segment " << id << " to " << peer << ": " << s.descriptor.regions.size()
                << " region(s), " << s.links.size() << " link(s) over "
                << s.descriptor.transport_kind << " (" << path.why << ")";
  return id;
}

absl::Status SegmentRegistry::Close(SegmentId id) {
  std::vector<Link> links;
  size_t via = 0;
  {
    MutexLock lock(&mu_);
    Segment* seg = table_.Find(id);
    if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
    // Unpublished before the lanes are counted: a thread submitting on the
    // lanes' view has its slices counted by then, and any later one finds
    // the view gone and asks here.
    const SegmentState state = seg->state;
    seg->state = SegmentState::kStale;
    seg->Publish();
    seg->state = state;
    const uint64_t slices = lanes_->SlicesOf(id);
    if (slices > 0 || seg->state == SegmentState::kRefreshing || seg->probing) {
      seg->Publish();
      return absl::FailedPreconditionError(
          absl::StrCat("segment ", id, " to ", seg->peer, " is in use (", slices,
                       " slice(s) in flight); wait for its batches first"));
    }
    links = std::move(seg->links);
    via = seg->via;
    KVF_LOG(INFO) << "closed segment " << id << " to " << seg->peer;
    table_.Remove(id);
    lanes_->Forget(id);
  }
  CloseLinks(via, links);
  return absl::OkStatus();
}

void SegmentRegistry::ExpireIdle(absl::Time now) {
  // The handle stays valid (callers keep segment ids): only the links go,
  // and the next Submit handshakes again.
  table_.ForEach([&](SegmentId id, Segment& seg) {
    mu_.AssertHeld();  // as the caller
    if (seg.state != SegmentState::kReady || seg.probing || seg.links.empty()) return;
    absl::Time last_used = seg.last_used;
    if (lanes_->SlicesOf(id, &last_used) > 0 || now - last_used < config_.idle_segment_timeout)
      return;
    // Unpublished first, then counted again (see Close).
    seg.state = SegmentState::kStale;
    seg.Publish();
    if (lanes_->SlicesOf(id, &last_used) > 0 || now - last_used < config_.idle_segment_timeout) {
      seg.state = SegmentState::kReady;
      seg.Publish();
      return;
    }
    KVF_LOG(INFO) << "segment " << id << " to " << seg.peer << " idle for "
                  << absl::FormatDuration(now - last_used) << ": links closed";
    CloseLinks(seg.via, seg.links);  // no slice in flight: nothing completes
    seg.links.clear();
    seg.Publish();
  });
}

absl::StatusOr<std::vector<RemoteRegion>> SegmentRegistry::Regions(SegmentId id) const {
  MutexLock lock(&mu_);
  const Segment* seg = table_.Find(id);
  if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
  std::vector<RemoteRegion> out;
  for (const handshake::RegionDescriptor& r : seg->descriptor.regions) {
    out.push_back(RemoteRegion{r.addr, r.length, r.access});
  }
  return out;
}

void SegmentRegistry::FencedBy(const std::string& peer, uint64_t epoch) {
  MutexLock lock(&mu_);
  const SegmentId id = table_.ByPeer(peer);
  Segment* seg = id == 0 ? nullptr : table_.Find(id);
  if (seg == nullptr || seg->state != SegmentState::kReady || seg->epoch >= epoch) return;
  seg->state = SegmentState::kStale;
  seg->Publish();
}

absl::StatusOr<SegmentRegistry::PeerView> SegmentRegistry::View(SegmentId id) const {
  MutexLock lock(&mu_);
  const Segment* seg = table_.Find(id);
  if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
  return PeerView{seg->peer, seg->descriptor.engine_id, seg->generation, seg->epoch};
}

// Re-reads the peer's descriptor and rebuilds the links. One refresh per
// segment at a time; callers that arrive meanwhile wait for it, and there is
// nothing to do when the links the caller found broken (`seen_generation`,
// UINT64_MAX: the current ones) were replaced since. Sets *changed when the
// peer's engine id changed.
absl::Status SegmentRegistry::Refresh(SegmentId id, bool* changed, uint64_t seen_generation) {
  *changed = false;
  std::string peer;
  std::vector<std::pair<transport::LinkId, std::string>> old;
  {
    MutexLock lock(&mu_);
    Segment* seg = table_.Find(id);
    if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
    const uint64_t generation = seen_generation == UINT64_MAX ? seg->generation : seen_generation;
    while (seg != nullptr && seg->state == SegmentState::kRefreshing) {
      refreshed_.Wait(&mu_);
      seg = table_.Find(id);
    }
    if (seg == nullptr) return absl::NotFoundError(absl::StrCat("segment ", id, " was closed"));
    if (seg->generation != generation) return absl::OkStatus();  // someone did it
    seg->state = SegmentState::kRefreshing;
    seg->Publish();
    peer = seg->peer;
    for (const Link& l : seg->links) {
      if (!l.peer_closed && !l.peer_params.empty()) old.emplace_back(l.id, l.peer_params);
    }
  }
  // The old links' peer halves close first: nothing posted on them lands
  // after what goes on the new ones (a restarted peer has none of them).
  absl::Status closed = old.empty() ? absl::OkStatus() : ClosePeerHalves(id, old);
  absl::StatusOr<Path> path = closed.ok() ? FindPath(peer) : closed;
  MutexLock lock(&mu_);
  Segment& seg = *table_.Find(id);  // not closed: Close refuses while refreshing
  refreshed_.SignalAll();
  if (!path.ok()) {
    seg.state = SegmentState::kStale;
    seg.Publish();
    return path.status();
  }
  *changed = path->descriptor.engine_id != seg.descriptor.engine_id;
  if (*changed) {
    KVF_LOG(INFO) << "peer " << peer << " restarted (new engine id); descriptor refreshed";
  }
  if (path->via != seg.via) {
    KVF_LOG(INFO) << "peer " << peer << " now over " << vias_[path->via].kind << " (" << path->why
                  << ")";
  }
  CloseLinks(seg.via, seg.links);
  seg.via = path->via;
  seg.metrics.transport = vias_[path->via].kind;
  seg.metrics.transport_reason = path->why;
  seg.descriptor = std::move(path->descriptor);
  seg.epoch = path->epoch();
  seg.links = std::move(path->links);
  seg.state = SegmentState::kReady;
  seg.dead = absl::OkStatus();
  ++seg.generation;
  seg.Publish();
  ++counters_.reconnects;
  ++seg.metrics.reconnects;
  return absl::OkStatus();
}

absl::Status SegmentRegistry::ClosePeerHalves(
    SegmentId segment, const std::vector<std::pair<transport::LinkId, std::string>>& links) {
  std::string peer;
  std::optional<uint64_t> capabilities;
  {
    MutexLock lock(&mu_);
    const Segment* seg = table_.Find(segment);
    if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", segment));
    peer = seg->peer;
    capabilities = seg->descriptor.capabilities;
  }
  std::vector<std::string> names;
  for (const auto& l : links) names.push_back(l.second);
  for (size_t i = 0; i < names.size(); i += handshake::kMaxLinksPerConnect) {
    const size_t end = std::min(names.size(), i + handshake::kMaxLinksPerConnect);
    absl::Status closed = client_->CloseLinks(
        peer, std::vector<std::string>(names.begin() + i, names.begin() + end), capabilities);
    if (!closed.ok()) {
      return Annotate(
          closed, absl::StrCat("closing the peer's half of ", links.size(), " failed link(s) to ",
                               peer, ", so that nothing sent on them lands late"));
    }
  }
  MutexLock lock(&mu_);
  if (Segment* seg = table_.Find(segment); seg != nullptr) {
    for (Link& l : seg->links) {
      for (const auto& c : links) l.peer_closed = l.peer_closed || l.id == c.first;
    }
  }
  return absl::OkStatus();
}

absl::Status SegmentRegistry::ReadView(Lane& lane, SegmentId id) {
  MutexLock lock(&mu_);
  Segment* seg = table_.Find(id);
  if (seg == nullptr) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
  if (seg->state != SegmentState::kReady) {
    return absl::FailedPreconditionError(absl::StrCat("segment ", id, " is not ready"));
  }
  MutexLock lane_lock(&lane.mu);
  lane.Entry(id).Read(*seg);
  return absl::OkStatus();
}

std::vector<NicCounters> SegmentRegistry::NicCountersNow() const {
  MutexLock lock(&mu_);
  std::vector<NicCounters> out = nic_counters_;
  lanes_->AddTallies(&out);
  return out;
}

EngineCounters SegmentRegistry::Counters() const {
  MutexLock lock(&mu_);
  return counters_;
}

std::vector<PeerMetrics> SegmentRegistry::Peers() const {
  std::vector<PeerMetrics> out;
  {
    MutexLock lock(&mu_);
    const_cast<SegmentTable&>(table_).ForEach([&](SegmentId id, Segment& seg) {
      out.push_back(seg.metrics);
      out.back().links = 0;
      for (const Link& l : seg.links) out.back().links += l.failed ? 0 : 1;
      lanes_->AddCounts(id, &out.back());
    });
  }
  std::sort(out.begin(), out.end(),
            [](const PeerMetrics& a, const PeerMetrics& b) { return a.peer < b.peer; });
  return out;
}

}  // namespace engine_internal
}  // namespace kvferry
