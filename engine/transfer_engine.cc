#include "engine/transfer_engine.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <map>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/scratch.h"
#include "base/status_macros.h"
#include "engine/metrics_server.h"
#include "handshake/auth.h"
#include "handshake/messages.h"
#include "handshake/tcp_network.h"
#include "net/interfaces.h"
#include "net/socket.h"
#include "transport/checks.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/verbs/discovery.h"
#include "transport/verbs/verbs_transport.h"

namespace kvferry {

using handshake::EngineDescriptor;
using handshake::Frame;
using handshake::MessageType;
using handshake::RegionDescriptor;
using transport::Access;
using transport::Completion;
using transport::LinkId;
using transport::NicIndex;
using transport::Opcode;
using transport::WorkRequest;

namespace {

// A slice's final error when the peer cannot be reached again: the
// reconnect's (kUnavailable for a dead peer), whatever the slice saw first.
absl::Status RetryImpossible(const absl::Status& reconnect, const absl::Status& first) {
  if (first.ok()) return reconnect;
  return absl::Status(reconnect.code(), absl::StrCat(reconnect.message(), " (retrying after: ",
                                                     first.message(), ")"));
}

bool Retryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kAborted ||
         code == absl::StatusCode::kCancelled || code == absl::StatusCode::kPermissionDenied;
}

}  // namespace

class TransferEngine::Impl {
 public:
  using RemoteRegion = TransferEngine::RemoteRegion;
  Impl(EngineOptions options, EngineParts parts)
      : options_(std::move(options)),
        transport_(std::move(parts.transport)),
        network_(std::move(parts.network)),
        detection_(std::move(parts.detection)),
        wait_(std::move(parts.wait)),
        clock_(parts.clock != nullptr ? parts.clock : RealClock()),
        engine_id_(parts.engine_id != 0 ? parts.engine_id : net::RandomU64()),
        near_nics_(std::move(parts.near_nics)),
        link_capacity_(std::max<uint32_t>(1, transport_->GetLimits().max_outstanding_per_link)) {
    for (const transport::NicInfo& nic : transport_->LocalEndpoint().nics) {
      nic_counters_.push_back(NicCounters{nic.name, 0, 0});
    }
    if (!near_nics_) {
      near_nics_ = [this](const std::string& location) {
        std::vector<NicIndex> out;
        int node;
        if (absl::StartsWith(location, "cpu:") && absl::SimpleAtoi(location.substr(4), &node)) {
          const std::vector<transport::NicInfo> nics = LocalNics();
          for (NicIndex i = 0; i < nics.size(); ++i) {
            if (nics[i].numa_node == node) out.push_back(i);
          }
        }
        return absl::StatusOr<std::vector<NicIndex>>(out);
      };
    }
  }

  ~Impl() {
    server_.reset();  // no more handler calls
  }

  absl::Status Start(const handshake::ServeOptions& serve) {
    ASSIGN_OR_RETURN(server_, network_->Serve(serve, [this](const Frame& f) {
                       return Handle(f);
                     }));
    address_ = server_->address();
    absl::StatusOr<net::HostPort> hp = net::ParseHostPort(address_);
    if (hp.ok()) detection_.port = hp->port;
    return absl::OkStatus();
  }

  const std::string& address() const { return address_; }
  std::vector<transport::NicInfo> LocalNics() const { return transport_->LocalEndpoint().nics; }
  const Detection& detection() const { return detection_; }
  uint64_t engine_id() const { return engine_id_; }
  Clock* clock() const { return clock_; }

  absl::Status RegisterMemory(void* addr, uint64_t length, Access access,
                              const std::string& location);
  std::vector<NicCounters> GetNicCounters() const {
    MutexLock lock(&mu_);
    return nic_counters_;
  }
  void set_auth(const handshake::AuthenticatedNetwork* auth) { auth_ = auth; }
  EngineMetrics GetMetrics() const {
    EngineMetrics m;
    MutexLock lock(&mu_);
    for (const auto& [id, seg] : segments_) m.peers.push_back(seg.metrics);
    std::sort(m.peers.begin(), m.peers.end(),
              [](const PeerMetrics& a, const PeerMetrics& b) { return a.peer < b.peer; });
    m.nics = nic_counters_;
    m.handshakes_refused = auth_ == nullptr ? 0 : auth_->rejected();
    m.link_failovers = counters_.link_failovers;
    m.probes = counters_.probes;
    m.probes_failed = counters_.probes_failed;
    return m;
  }
  absl::Status StartMetrics(const std::string& host, int port) {
    if (port < 0) return absl::OkStatus();
    if (port > 65535) return absl::InvalidArgumentError(absl::StrCat("metrics_port ", port));
    ASSIGN_OR_RETURN(metrics_server_,
                     MetricsServer::Start(host, static_cast<uint16_t>(port), [this] {
                       return PrometheusText(GetMetrics(), address_);
                     }));
    KVF_LOG(INFO) << "metrics at http://" << metrics_server_->address() << "/metrics";
    return absl::OkStatus();
  }
  std::string metrics_address() const {
    return metrics_server_ == nullptr ? "" : metrics_server_->address();
  }
  EngineCounters GetCounters() const {
    MutexLock lock(&mu_);
    EngineCounters c = counters_;
    c.handshakes_refused = auth_ == nullptr ? 0 : auth_->rejected();
    return c;
  }
  absl::Status UnregisterMemory(void* addr);
  absl::StatusOr<SegmentId> OpenSegment(const std::string& peer);
  absl::StatusOr<std::vector<RemoteRegion>> SegmentRegions(SegmentId id) {
    MutexLock lock(&mu_);
    auto it = segments_.find(id);
    if (it == segments_.end()) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
    std::vector<RemoteRegion> out;
    for (const RegionDescriptor& r : it->second.descriptor.regions) {
      out.push_back(RemoteRegion{r.addr, r.length, r.access});
    }
    return out;
  }
  absl::StatusOr<BatchId> Submit(SegmentId id, absl::Span<const TransferRequest> requests,
                                 uint64_t peer_engine_id);
  absl::StatusOr<BatchStatus> Poll(BatchId id);
  absl::StatusOr<BatchStatus> Wait(BatchId id, absl::Duration timeout);
  absl::Status Wait(BatchId id, absl::Duration timeout, BatchStatus* out);
  absl::Status Release(BatchId id);
  absl::Status Notify(SegmentId id, const std::string& message);
  absl::StatusOr<uint64_t> PeerEngineId(SegmentId id) {
    MutexLock lock(&mu_);
    auto it = segments_.find(id);
    if (it == segments_.end()) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
    return it->second.descriptor.engine_id;
  }
  absl::StatusOr<uint64_t> BatchPeerEngineId(BatchId id) {
    MutexLock lock(&mu_);
    auto it = batches_.find(id);
    if (it == batches_.end()) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
    return it->second.peer_engine_id;
  }
  // Notify, refused by the peer unless it is the instance `target` (0: any).
  absl::Status NotifyInstance(SegmentId id, const std::string& message, uint64_t target);
  absl::Status NotifyAfter(BatchId id, const std::string& message, absl::Duration timeout);
  std::vector<Notification> TakeNotifications();
  absl::StatusOr<Notification> WaitNotification(absl::Duration timeout);
  absl::Status PublishMetadata(const std::string& key, std::string value);
  absl::StatusOr<std::string> FetchMetadata(SegmentId id, const std::string& key);

 private:
  struct LocalRegion {
    transport::Region region;
  };
  struct Link {
    LinkId id = 0;
    NicIndex local_nic = 0;
    NicIndex remote_nic = 0;
    uint32_t inflight = 0;  // slices posted and not yet completed
    bool failed = false;    // an error completion came: no new slices
    // Last sign of life: a completion, or the post that made it busy.
    absl::Time progress;
  };
  struct Segment {
    std::string peer;
    EngineDescriptor descriptor;  // regions sorted by address
    std::vector<Link> links;
    uint64_t generation = 0;      // bumped by every refresh
    bool stale = false;
    bool refreshing = false;
    bool probing = false;
    // Set when the peer did not answer a probe: slices of this generation
    // fail with it instead of being retried.
    absl::Status dead;
    // Slices waiting for room on a link (each link takes at most the
    // transport's max_outstanding_per_link), in submission order.
    std::deque<uint64_t> backlog;
    PeerMetrics metrics;
  };
  // One slice in flight.
  struct Slice {
    BatchId batch = 0;
    size_t request = 0;
    SegmentId segment = 0;
    Opcode opcode = Opcode::kWrite;
    void* local = nullptr;
    transport::RegionId local_region = 0;
    uint64_t remote = 0;
    uint64_t length = 0;
    uint32_t retries_left = 0;
    uint64_t generation = 0;  // of the segment's links it was last posted on
    LinkId link = 0;          // the link it was last posted on
    absl::Status last_error;
  };
  struct Batch {
    SegmentId segment = 0;
    // The peer instance (engine id) the batch writes to or reads from. A
    // slice is never retried on another instance: its bytes would be split
    // between a dead peer and its successor.
    uint64_t peer_engine_id = 0;
    bool bound = false;   // the caller named the instance
    uint64_t landed = 0;  // slices completed OK
    absl::Time submitted;
    std::vector<Opcode> op;        // per request
    std::vector<uint64_t> length;  // per request
    std::vector<uint64_t> slices_left;  // per request
    std::vector<absl::Status> status;   // first error per request
    size_t pending = 0;
    // Empties it for reuse, keeping the vectors' capacity.
    void Reset() {
      segment = 0;
      peer_engine_id = 0;
      bound = false;
      landed = 0;
      submitted = absl::Time();
      op.clear();
      length.clear();
      slices_left.clear();
      status.clear();
      pending = 0;
    }
  };

  Frame Handle(const Frame& request);
  EngineDescriptor LocalDescriptor();
  absl::StatusOr<EngineDescriptor> FetchDescriptor(const std::string& peer);
  absl::StatusOr<std::vector<Link>> ConnectLinks(const std::string& peer,
                                                 const EngineDescriptor& d);
  // Re-reads the peer's descriptor and rebuilds the links if the peer
  // restarted or a link failed. One refresh per segment at a time; callers
  // that arrive meanwhile wait for it. Sets *changed when the peer's engine
  // id changed.
  // `seen_generation`: the links the caller found broken; if they were
  // replaced since, there is nothing to do (UINT64_MAX: the current ones).
  absl::Status Refresh(SegmentId id, bool* changed, uint64_t seen_generation = UINT64_MAX);
  // Checks a slice against the peer's advertised regions.
  absl::Status CheckSlice(const Segment& seg, const Slice& slice) const;
  // Puts the slice on the least loaded link with room and fills `wr`; false
  // when every link is full.
  // `now`: the time the caller read (a clock read per slice is dear).
  bool AssignLink(Segment& seg, Slice& slice, WorkRequest* wr, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A slice's link has one fewer in flight.
  void Unassign(const Slice& slice, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A slice failed on its link's NIC.
  void CountNicError(const Slice& slice, absl::StatusCode code) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The local NIC of the link a slice was last posted on, or -1.
  int NicOf(const Slice& slice) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Posts slices (already in slices_) on segment `id`; those that find no
  // room wait in the segment's backlog.
  // `now`: the caller's reading of the clock, if it has one.
  absl::Status PostSlices(SegmentId id, const std::vector<uint64_t>& slice_ids,
                          absl::Time now = absl::InfinitePast());
  // Posts what waits in backlogs, as far as the links have room.
  void DrainBacklogs();
  // Delivers transport completions into batches; re-posts retryable slices.
  void Pump(absl::Duration timeout);
  // Probes peers whose busy links have been silent for peer_timeout / 2
  // (see EngineOptions::peer_timeout); at most every peer_timeout / 4.
  void CheckPeers(absl::Time now);
  // `now`: the caller's reading of the clock, if it has one.
  void FinishSlice(uint64_t slice_id, absl::Status status,
                   absl::Time now = absl::InfinitePast()) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StatusOf(const Batch& b, BatchStatus* out) const;
  BatchStatus StatusOf(const Batch& b) const {
    BatchStatus out;
    StatusOf(b, &out);
    return out;
  }
  // The peer region containing `addr`, if any (regions sorted by address).
  static const RegionDescriptor* FindRemote(const Segment& seg, uint64_t addr);
  const transport::Region* FindLocal(const void* addr, uint64_t length) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const EngineOptions options_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<handshake::Network> network_;
  Detection detection_;
  const std::function<bool(const std::function<bool()>&, absl::Duration)> wait_;
  Clock* const clock_;
  const uint64_t engine_id_;
  std::function<absl::StatusOr<std::vector<NicIndex>>(const std::string&)> near_nics_;
  const uint32_t link_capacity_;
  std::unique_ptr<handshake::Server> server_;
  std::string address_;
  const handshake::AuthenticatedNetwork* auth_ = nullptr;  // inside network_, if any
  std::unique_ptr<MetricsServer> metrics_server_;  // last member: stops first

  mutable Mutex mu_;
  CondVar cv_;  // refresh finished, notification arrived
  std::map<uint64_t, transport::Region> regions_ ABSL_GUARDED_BY(mu_);  // by address
  // Per local region with a location: which local NICs are near it.
  absl::flat_hash_map<transport::RegionId, std::vector<bool>> near_ ABSL_GUARDED_BY(mu_);
  std::vector<NicCounters> nic_counters_ ABSL_GUARDED_BY(mu_);
  EngineCounters counters_ ABSL_GUARDED_BY(mu_);
  // When CheckPeers looks next, Unix nanoseconds; read without the lock
  // (most Pumps have nothing to check), claimed under it.
  std::atomic<int64_t> next_peer_check_ns_{0};
  // Set when a slice goes to a backlog; DrainBacklogs takes the lock only
  // then.
  std::atomic<bool> maybe_backlog_{false};
  absl::flat_hash_map<std::string, SegmentId> segment_by_peer_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SegmentId, Segment> segments_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<BatchId, Batch> batches_ ABSL_GUARDED_BY(mu_);
  // Released batches, reused by Submit (at most kSpareBatches).
  static constexpr size_t kSpareBatches = 64;
  std::vector<Batch> spare_batches_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Slice> slices_ ABSL_GUARDED_BY(mu_);
  std::deque<Notification> inbox_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> metadata_ ABSL_GUARDED_BY(mu_);
  SegmentId last_segment_ ABSL_GUARDED_BY(mu_) = 0;
  BatchId last_batch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_slice_ ABSL_GUARDED_BY(mu_) = 0;
};

// ---------------------------------------------------------------- serving

EngineDescriptor TransferEngine::Impl::LocalDescriptor() {
  const transport::EndpointDescription endpoint = transport_->LocalEndpoint();
  EngineDescriptor d;
  d.engine_id = engine_id_;
  d.transport_kind = endpoint.kind;
  d.nics = endpoint.nics;
  MutexLock lock(&mu_);
  for (const auto& [addr, r] : regions_) {
    if (r.access == Access::kNone) continue;  // private: never advertised
    d.regions.push_back(RegionDescriptor{r.addr, r.length, r.access, r.keys});
  }
  return d;
}

Frame TransferEngine::Impl::Handle(const Frame& request) {
  switch (request.type) {
    case MessageType::kDescribe:
      return Frame{MessageType::kDescriptor, handshake::Encode(LocalDescriptor())};
    case MessageType::kConnect: {
      absl::StatusOr<handshake::ConnectRequest> c =
          handshake::DecodeConnectRequest(request.payload);
      if (!c.ok()) return handshake::ErrorFrame(c.status());
      absl::StatusOr<transport::LinkOffer> offer =
          transport_->AcceptLink(c->target_nic, c->requester_nic_info, c->params);
      if (!offer.ok()) return handshake::ErrorFrame(offer.status());
      return Frame{MessageType::kConnectReply,
                   handshake::Encode(handshake::ConnectReply{offer->params})};
    }
    case MessageType::kNotify: {
      absl::StatusOr<handshake::Notify> n = handshake::DecodeNotify(request.payload);
      if (!n.ok()) return handshake::ErrorFrame(n.status());
      if (n->target_engine_id != 0 && n->target_engine_id != engine_id_) {
        return handshake::ErrorFrame(absl::FailedPreconditionError(absl::StrFormat(
            "notification meant for engine %#x, but this is engine %#x (the peer restarted; "
            "what the notification is about went to its predecessor)",
            n->target_engine_id, engine_id_)));
      }
      MutexLock lock(&mu_);
      inbox_.push_back(Notification{n->engine_id, std::move(n->payload)});
      cv_.SignalAll();
      return Frame{MessageType::kNotifyAck, ""};
    }
    case MessageType::kProbe: {
      absl::StatusOr<handshake::Probe> p = handshake::DecodeProbe(request.payload);
      if (!p.ok()) return handshake::ErrorFrame(p.status());
      return Frame{MessageType::kProbeReply,
                   handshake::Encode(handshake::Probe{engine_id_, p->nonce})};
    }
    case MessageType::kGetMetadata: {
      absl::StatusOr<handshake::MetadataRequest> m =
          handshake::DecodeMetadataRequest(request.payload);
      if (!m.ok()) return handshake::ErrorFrame(m.status());
      MutexLock lock(&mu_);
      auto it = metadata_.find(m->key);
      if (it == metadata_.end()) {
        return handshake::ErrorFrame(absl::NotFoundError(
            absl::StrCat("the peer has published no '", m->key, "'")));
      }
      return Frame{MessageType::kMetadata,
                   handshake::Encode(handshake::Metadata{m->key, it->second, engine_id_})};
    }
    case MessageType::kChallenge:
    case MessageType::kAuthenticated:
      // Never downgrade: a peer with a secret must not talk to us without.
      return handshake::ErrorFrame(absl::FailedPreconditionError(
          "this engine has no handshake secret, and its peers must not use one"));
    default:
      return handshake::ErrorFrame(absl::InvalidArgumentError(absl::StrCat(
          "unexpected ", handshake::MessageTypeName(request.type), " request")));
  }
}

// ---------------------------------------------------------------- memory

absl::Status TransferEngine::Impl::RegisterMemory(void* addr, uint64_t length,
                                                  Access access, const std::string& location) {
  if (addr == nullptr || length == 0) {
    return absl::InvalidArgumentError("RegisterMemory: null address or zero length");
  }
  std::vector<bool> near;
  if (!location.empty()) {
    int n;
    const size_t colon = location.find(':');
    const std::string kind = location.substr(0, colon);
    if (colon == std::string::npos || (kind != "cpu" && kind != "cuda") ||
        !absl::SimpleAtoi(location.substr(colon + 1), &n) || n < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "RegisterMemory: bad location '", location, "' (expected cpu:N or cuda:N)"));
    }
    absl::StatusOr<std::vector<NicIndex>> nics = near_nics_(location);
    if (!nics.ok()) return Annotate(nics.status(), "RegisterMemory");
    if (!nics->empty()) {
      near.assign(transport_->LocalEndpoint().nics.size(), false);
      for (NicIndex i : *nics) {
        if (i < near.size()) near[i] = true;
      }
    }
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  {
    MutexLock lock(&mu_);
    auto next = regions_.lower_bound(base);
    const bool overlaps_next = next != regions_.end() && next->first < base + length;
    const bool overlaps_prev =
        next != regions_.begin() &&
        std::prev(next)->second.addr + std::prev(next)->second.length > base;
    if (overlaps_next || overlaps_prev) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "RegisterMemory: [%#x, +%u) overlaps a registered region", base, length));
    }
  }
  ASSIGN_OR_RETURN(transport::Region region, transport_->RegisterMemory(addr, length, access));
  MutexLock lock(&mu_);
  regions_.emplace(base, region);
  if (!near.empty()) near_[region.id] = std::move(near);
  return absl::OkStatus();
}

absl::Status TransferEngine::Impl::UnregisterMemory(void* addr) {
  MutexLock lock(&mu_);
  auto it = regions_.find(reinterpret_cast<uintptr_t>(addr));
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrFormat("no registered region starts at %p", addr));
  }
  RETURN_IF_ERROR(transport_->UnregisterMemory(it->second.id));
  near_.erase(it->second.id);
  regions_.erase(it);
  return absl::OkStatus();
}

const transport::Region* TransferEngine::Impl::FindLocal(const void* addr,
                                                         uint64_t length) const {
  const uint64_t a = reinterpret_cast<uintptr_t>(addr);
  auto it = regions_.upper_bound(a);
  if (it == regions_.begin()) return nullptr;
  --it;
  return transport::RangeInside(a, length, it->second.addr, it->second.length) ? &it->second : nullptr;
}

// ---------------------------------------------------------------- segments

absl::StatusOr<EngineDescriptor> TransferEngine::Impl::FetchDescriptor(
    const std::string& peer) {
  ASSIGN_OR_RETURN(Frame reply, network_->Call(peer, Frame{MessageType::kDescribe, ""},
                                               options_.handshake_timeout));
  if (reply.type != MessageType::kDescriptor) {
    return absl::DataLossError(absl::StrCat("peer ", peer, " answered describe with ",
                                            handshake::MessageTypeName(reply.type)));
  }
  ASSIGN_OR_RETURN(EngineDescriptor d, handshake::DecodeDescriptor(reply.payload));
  const std::string mine = transport_->LocalEndpoint().kind;
  if (d.transport_kind != mine) {
    return absl::FailedPreconditionError(absl::StrCat(
        "peer ", peer, " uses the ", d.transport_kind, " transport; this engine uses ", mine));
  }
  std::sort(d.regions.begin(), d.regions.end(),
            [](const RegionDescriptor& a, const RegionDescriptor& b) { return a.addr < b.addr; });
  return d;
}

absl::StatusOr<std::vector<TransferEngine::Impl::Link>> TransferEngine::Impl::ConnectLinks(
    const std::string& peer, const EngineDescriptor& d) {
  const transport::EndpointDescription local = transport_->LocalEndpoint();
  std::vector<Link> links;
  // At least one link per local NIC, so every NIC can carry slices.
  const uint32_t count = std::max<uint32_t>({1, options_.links_per_peer,
                                             static_cast<uint32_t>(local.nics.size())});
  for (uint32_t k = 0; k < count; ++k) {
    Link link;
    link.remote_nic = k % d.nics.size();
    // The local NIC the host's routes say reaches that peer NIC (verbs with
    // rdma_cm), else the NICs in order.
    absl::StatusOr<NicIndex> routed = transport_->RouteTo(d.nics[link.remote_nic]);
    link.local_nic = routed.ok() && *routed < local.nics.size()
                         ? *routed
                         : static_cast<NicIndex>(k % local.nics.size());
    absl::StatusOr<transport::LinkOffer> offer =
        transport_->CreateLink(link.local_nic, d.nics[link.remote_nic]);
    absl::StatusOr<Frame> reply =
        offer.ok() ? network_->Call(peer,
                                    Frame{MessageType::kConnect,
                                          handshake::Encode(handshake::ConnectRequest{
                                              engine_id_, link.local_nic,
                                              local.nics[link.local_nic], link.remote_nic,
                                              offer->params})},
                                    options_.handshake_timeout)
                   : absl::StatusOr<Frame>(offer.status());
    absl::StatusOr<handshake::ConnectReply> answer =
        reply.ok() ? handshake::DecodeConnectReply(reply->payload)
                   : absl::StatusOr<handshake::ConnectReply>(reply.status());
    absl::Status done = answer.ok() ? transport_->CompleteLink(offer->link, answer->params)
                                    : answer.status();
    if (!done.ok()) {
      if (offer.ok()) (void)transport_->CloseLink(offer->link);
      const bool unreachable = !reply.ok() && (reply.status().code() == absl::StatusCode::kUnavailable ||
                                              reply.status().code() ==
                                                  absl::StatusCode::kDeadlineExceeded);
      if (unreachable || k + 1 == count) {
        if (!links.empty() && !unreachable) break;  // keep the NIC pairs that work
        for (const Link& l : links) (void)transport_->CloseLink(l.id);
        return Annotate(done, absl::StrCat("connecting to ", peer));
      }
      // One NIC pair failing (a NIC down on either side) must not cost the
      // others: go on without it.
      KVF_LOG(WARNING) << "connecting to " << peer << ": no link from local NIC "
                       << link.local_nic << " to peer NIC " << link.remote_nic << ": "
                       << done.message();
      continue;
    }
    link.id = offer->link;
    link.progress = clock_->Now();
    links.push_back(link);
  }
  return links;
}

absl::StatusOr<SegmentId> TransferEngine::Impl::OpenSegment(const std::string& peer_text) {
  ASSIGN_OR_RETURN(net::HostPort hp, net::ParseHostPort(peer_text));
  const std::string peer = hp.ToString();
  {
    MutexLock lock(&mu_);
    auto it = segment_by_peer_.find(peer);
    if (it != segment_by_peer_.end()) return it->second;
  }
  ASSIGN_OR_RETURN(EngineDescriptor d, FetchDescriptor(peer));
  ASSIGN_OR_RETURN(std::vector<Link> links, ConnectLinks(peer, d));
  MutexLock lock(&mu_);
  auto it = segment_by_peer_.find(peer);
  if (it != segment_by_peer_.end()) {  // another thread won the race
    for (const Link& l : links) (void)transport_->CloseLink(l.id);
    return it->second;
  }
  const SegmentId id = ++last_segment_;
  Segment& seg = segments_[id];
  seg.peer = peer;
  seg.metrics.peer = peer;
  seg.descriptor = std::move(d);
  seg.links = std::move(links);
  segment_by_peer_[peer] = id;
  KVF_LOG(INFO) << "opened segment " << id << " to " << peer << ": "
                << seg.descriptor.regions.size() << " region(s), " << seg.links.size()
                << " link(s) over " << seg.descriptor.transport_kind;
  return id;
}

absl::Status TransferEngine::Impl::Refresh(SegmentId id, bool* changed,
                                           uint64_t seen_generation) {
  *changed = false;
  std::string peer;
  uint64_t generation;
  {
    MutexLock lock(&mu_);
    auto it = segments_.find(id);
    if (it == segments_.end()) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
    generation = seen_generation == UINT64_MAX ? it->second.generation : seen_generation;
    while (it->second.refreshing) {
      cv_.Wait(&mu_);
      it = segments_.find(id);
    }
    if (it->second.generation != generation) return absl::OkStatus();  // someone did it
    it->second.refreshing = true;
    peer = it->second.peer;
  }
  absl::StatusOr<EngineDescriptor> d = FetchDescriptor(peer);
  absl::StatusOr<std::vector<Link>> links =
      d.ok() ? ConnectLinks(peer, *d) : absl::StatusOr<std::vector<Link>>(d.status());
  MutexLock lock(&mu_);
  Segment& seg = segments_.at(id);
  seg.refreshing = false;
  cv_.SignalAll();
  if (!links.ok()) {
    seg.stale = true;
    return links.status();
  }
  *changed = d->engine_id != seg.descriptor.engine_id;
  if (*changed) {
    KVF_LOG(INFO) << "peer " << peer << " restarted (new engine id); descriptor refreshed";
  }
  for (const Link& l : seg.links) (void)transport_->CloseLink(l.id);
  seg.descriptor = std::move(*d);
  seg.links = std::move(*links);
  seg.stale = false;
  seg.dead = absl::OkStatus();
  ++seg.generation;
  ++counters_.reconnects;
  ++seg.metrics.reconnects;
  return absl::OkStatus();
}

// ---------------------------------------------------------------- transfers

const RegionDescriptor* TransferEngine::Impl::FindRemote(const Segment& seg, uint64_t addr) {
  const auto& regions = seg.descriptor.regions;
  auto it = std::upper_bound(regions.begin(), regions.end(), addr,
                             [](uint64_t a, const RegionDescriptor& r) { return a < r.addr; });
  if (it == regions.begin()) return nullptr;
  --it;
  return addr - it->addr < it->length ? &*it : nullptr;
}

absl::Status TransferEngine::Impl::CheckSlice(const Segment& seg, const Slice& slice) const {
  const RegionDescriptor* found = FindRemote(seg, slice.remote);
  if (found == nullptr ||
      !transport::RangeInside(slice.remote, slice.length, found->addr, found->length)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "peer %s has no registered region covering [%#x, +%u) (it advertises %u region(s))",
        seg.peer, slice.remote, slice.length, seg.descriptor.regions.size()));
  }
  const bool write = slice.opcode == Opcode::kWrite;
  if (write ? !transport::AllowsRemoteWrite(found->access)
            : !transport::AllowsRemoteRead(found->access)) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "peer %s does not allow remote %s of [%#x, +%u)", seg.peer, write ? "write" : "read",
        slice.remote, slice.length));
  }
  if (seg.links.empty()) return absl::UnavailableError(absl::StrCat("no links to ", seg.peer));
  return absl::OkStatus();
}

bool TransferEngine::Impl::AssignLink(Segment& seg, Slice& slice, WorkRequest* wr,
                                      absl::Time now) {
  // The least loaded link with room on a NIC near the buffer; on another
  // NIC only when the near ones are full.
  auto near = near_.find(slice.local_region);
  Link* best = nullptr;
  Link* best_far = nullptr;
  for (Link& l : seg.links) {
    if (l.failed || l.inflight >= link_capacity_) continue;
    const bool is_near = near == near_.end() ||
                         (l.local_nic < near->second.size() && near->second[l.local_nic]);
    Link*& slot = is_near ? best : best_far;
    if (slot == nullptr || l.inflight < slot->inflight) slot = &l;
  }
  if (best == nullptr) best = best_far;
  if (best == nullptr) return false;
  if (best->inflight++ == 0) best->progress = now;
  if (best->local_nic < nic_counters_.size()) {
    ++nic_counters_[best->local_nic].slices;
    nic_counters_[best->local_nic].bytes += slice.length;
  }
  ++seg.metrics.slices;
  const RegionDescriptor& r = *FindRemote(seg, slice.remote);
  slice.generation = seg.generation;
  slice.link = best->id;
  wr->opcode = slice.opcode;
  wr->link = best->id;
  wr->local_region = slice.local_region;
  wr->local_addr = slice.local;
  wr->length = slice.length;
  wr->remote_addr = slice.remote;
  wr->remote_key = r.keys[best->remote_nic];
  return true;
}

int TransferEngine::Impl::NicOf(const Slice& slice) const {
  auto seg = segments_.find(slice.segment);
  if (seg == segments_.end()) return -1;
  for (const Link& l : seg->second.links) {
    if (l.id == slice.link && l.local_nic < nic_counters_.size()) return static_cast<int>(l.local_nic);
  }
  return -1;
}

void TransferEngine::Impl::CountNicError(const Slice& slice, absl::StatusCode code) {
  const int nic = NicOf(slice);
  if (nic < 0) return;
  ++nic_counters_[nic].errors;
  ++nic_counters_[nic].errors_by_code[absl::StatusCodeToString(code)];
}

void TransferEngine::Impl::Unassign(const Slice& slice, absl::Time now) {
  auto seg = segments_.find(slice.segment);
  if (seg == segments_.end()) return;
  for (Link& l : seg->second.links) {
    if (l.id == slice.link && l.inflight > 0) {  // links of older generations are gone
      --l.inflight;
      l.progress = now;
    }
  }
}

absl::StatusOr<BatchId> TransferEngine::Impl::Submit(SegmentId id,
                                                     absl::Span<const TransferRequest> requests,
                                                     uint64_t peer_engine_id) {
  Scratch<uint64_t> slice_ids_scratch;
  std::vector<uint64_t>& slice_ids = *slice_ids_scratch;
  BatchId batch_id;
  absl::Time submitted;
  bool refresh_first = false;
  for (int attempt = 0;; ++attempt) {
    if (refresh_first) {
      bool changed;
      RETURN_IF_ERROR(Refresh(id, &changed));
      refresh_first = false;
    }
    MutexLock lock(&mu_);
    auto found = segments_.find(id);
    if (found == segments_.end()) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
    Segment& seg = found->second;
    if (seg.stale) {  // the descriptor needs a refresh first (outside the lock)
      refresh_first = true;
      continue;
    }
    // Cut every request into slices and check them all before posting.
    Scratch<Slice> planned_scratch;
    std::vector<Slice>& planned = *planned_scratch;
    absl::Status bad;
    for (size_t i = 0; i < requests.size() && bad.ok(); ++i) {
      const TransferRequest& r = requests[i];
      const transport::Region* local = FindLocal(r.local, r.length);
      if (local == nullptr || r.length == 0) {
        bad = absl::InvalidArgumentError(absl::StrFormat(
            "request %u: local buffer [%p, +%u) is %s", i, r.local, r.length,
            r.length == 0 ? "empty" : "not inside memory registered on this engine"));
        break;
      }
      for (uint64_t off = 0; off < r.length;) {
        uint64_t len = std::min<uint64_t>(options_.slice_bytes, r.length - off);
        // Never cross the end of the peer region holding the slice start.
        if (const RegionDescriptor* reg = FindRemote(seg, r.remote + off)) {
          len = std::min<uint64_t>(len, reg->addr + reg->length - (r.remote + off));
        }
        Slice s;
        s.request = i;
        s.segment = id;
        s.opcode = r.opcode;
        s.local = static_cast<char*>(r.local) + off;
        s.local_region = local->id;
        s.remote = r.remote + off;
        s.length = len;
        s.retries_left = options_.retries;
        bad = CheckSlice(seg, s);
        if (!bad.ok()) {
          bad = Annotate(bad, absl::StrCat("request ", i));
          break;
        }
        planned.push_back(s);
        off += len;
      }
    }
    if (!bad.ok()) {
      // A request outside the cached descriptor: the peer may have
      // registered more memory since; look once more before refusing.
      if (attempt == 0 && bad.code() == absl::StatusCode::kInvalidArgument &&
          bad.message().find("no registered region") != absl::string_view::npos) {
        seg.stale = true;
        continue;
      }
      return bad;
    }
    batch_id = ++last_batch_;
    Batch& b = batches_[batch_id];
    if (!spare_batches_.empty()) {
      b = std::move(spare_batches_.back());  // vectors with capacity, emptied
      spare_batches_.pop_back();
    }
    b.segment = id;
    b.peer_engine_id = seg.descriptor.engine_id;
    b.bound = peer_engine_id != 0;
    if (b.bound && peer_engine_id != seg.descriptor.engine_id) {
      batches_.erase(batch_id);
      return absl::UnavailableError(absl::StrCat(
          "peer ", seg.peer, " restarted: the addresses of this batch belong to its predecessor"));
    }
    b.slices_left.assign(requests.size(), 0);
    b.submitted = submitted = clock_->Now();
    b.op.reserve(requests.size());
    b.length.reserve(requests.size());
    for (const TransferRequest& r : requests) {
      b.op.push_back(r.opcode);
      b.length.push_back(r.length);
    }
    seg.metrics.requests += requests.size();
    b.status.assign(requests.size(), absl::OkStatus());
    b.pending = requests.size();
    for (Slice& s : planned) {
      s.batch = batch_id;
      ++b.slices_left[s.request];
      const uint64_t sid = ++last_slice_;
      slices_.emplace(sid, s);
      slice_ids.push_back(sid);
    }
    break;
  }
  absl::Status posted = PostSlices(id, slice_ids, submitted);
  if (!posted.ok()) {
    MutexLock lock(&mu_);
    batches_.erase(batch_id);  // nothing of it runs; the caller gets no id
    return posted;
  }
  return batch_id;
}

absl::Status TransferEngine::Impl::PostSlices(SegmentId id, const std::vector<uint64_t>& ids,
                                             absl::Time now) {
  bool rebuilt = false;
  if (now == absl::InfinitePast()) now = clock_->Now();
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt > 0) now = clock_->Now();
    Scratch<WorkRequest> wrs_scratch;
    std::vector<WorkRequest>& wrs = *wrs_scratch;
    absl::Status planned;
    bool usable = false;
    {
      MutexLock lock(&mu_);
      Segment& seg = segments_.at(id);
      for (const Link& l : seg.links) usable = usable || !l.failed;
      // With every link failed, slices would wait for room that never
      // comes: rebuild the links first (below; a dead peer fails them).
      for (size_t i = 0; usable && i < ids.size(); ++i) {
        const uint64_t sid = ids[i];
        auto it = slices_.find(sid);
        if (it == slices_.end()) continue;
        auto batch = batches_.find(it->second.batch);
        if (batch != batches_.end() && batch->second.peer_engine_id != seg.descriptor.engine_id) {
          Batch& b = batch->second;
          if (b.bound || b.landed > 0) {
            FinishSlice(sid, absl::UnavailableError(absl::StrCat(
                                 "peer ", seg.peer, " restarted during the batch; ",
                                 b.landed > 0 ? "part of it went to the previous instance"
                                              : "its addresses belong to the previous instance")));
            continue;
          }
          b.peer_engine_id = seg.descriptor.engine_id;  // nothing landed: move it whole
        }
        planned = CheckSlice(seg, it->second);
        if (!planned.ok()) break;
        WorkRequest wr;
        if (!AssignLink(seg, it->second, &wr, now)) {
          seg.backlog.push_back(sid);  // posted when a link has room
          maybe_backlog_.store(true, std::memory_order_release);
          continue;
        }
        wr.cookie = sid;
        wrs.push_back(wr);
      }
      if (!planned.ok()) {
        for (const WorkRequest& wr : wrs) Unassign(slices_.at(wr.cookie), now);
      }
    }
    if (!usable) {
      bool changed;
      absl::Status refreshed = rebuilt ? absl::UnavailableError("every link to the peer failed, also after a rebuild")
                                       : Refresh(id, &changed);
      rebuilt = true;
      if (refreshed.ok()) {
        --attempt;  // rebuilding is not a failed attempt
        continue;
      }
      MutexLock lock(&mu_);
      for (uint64_t sid : ids) {
        auto it = slices_.find(sid);
        if (it == slices_.end()) continue;
        FinishSlice(sid, RetryImpossible(refreshed, it->second.last_error));
      }
      return refreshed;
    }
    absl::Status posted = planned.ok() ? transport_->Post(wrs) : planned;
    if (posted.ok()) return absl::OkStatus();
    {
      MutexLock lock(&mu_);
      for (const WorkRequest& wr : wrs) Unassign(slices_.at(wr.cookie), now);
    }
    // A link that failed since the last use: rebuild the links and retry.
    if (attempt == 0 && posted.code() == absl::StatusCode::kFailedPrecondition) {
      bool changed;
      absl::Status refreshed = Refresh(id, &changed);
      if (refreshed.ok()) continue;
      posted = refreshed;  // the peer is gone: say so, not "link in error"
    }
    MutexLock lock(&mu_);
    for (uint64_t sid : ids) {
      if (slices_.contains(sid)) FinishSlice(sid, posted);
    }
    return posted;
  }
  return absl::InternalError("unreachable");
}

void TransferEngine::Impl::DrainBacklogs() {
  // Cleared before looking, so a slice that goes to a backlog meanwhile
  // (or is put back below) sets it again for the next drain.
  if (!maybe_backlog_.exchange(false, std::memory_order_acquire)) return;
  std::vector<std::pair<SegmentId, std::vector<uint64_t>>> work;
  {
    MutexLock lock(&mu_);
    for (auto& [id, seg] : segments_) {
      if (seg.backlog.empty()) continue;
      work.emplace_back(id, std::vector<uint64_t>(seg.backlog.begin(), seg.backlog.end()));
      seg.backlog.clear();
    }
  }
  for (auto& [id, ids] : work) (void)PostSlices(id, ids);
}

void TransferEngine::Impl::FinishSlice(uint64_t sid, absl::Status status, absl::Time now) {
  auto it = slices_.find(sid);
  if (it == slices_.end()) return;
  const Slice s = it->second;
  slices_.erase(it);
  auto b = batches_.find(s.batch);
  if (b == batches_.end()) return;
  Batch& batch = b->second;
  if (status.ok()) ++batch.landed;
  if (!status.ok() && batch.status[s.request].ok()) batch.status[s.request] = status;
  if (--batch.slices_left[s.request] == 0) {
    --batch.pending;
    auto seg = segments_.find(batch.segment);
    if (seg != segments_.end()) {
      PeerMetrics& m = seg->second.metrics;
      if (now == absl::InfinitePast()) now = clock_->Now();
      m.latency.Record(now - batch.submitted);
      const absl::Status& result = batch.status[s.request];
      if (result.ok()) {
        ++m.requests_ok;
        (batch.op[s.request] == Opcode::kWrite ? m.bytes_written : m.bytes_read) +=
            batch.length[s.request];
      } else {
        ++m.errors[absl::StatusCodeToString(result.code())];
      }
    }
  }
}

void TransferEngine::Impl::Pump(absl::Duration timeout) {
  // A per-thread buffer: 64 completions built and destroyed on every call
  // were a sixth of the cost of a one-request batch. Pump does not nest
  // today (none of the tests, simulations included, reaches it); should
  // it ever, the inner one gets a buffer of its own instead of
  // overwriting the outer one's.
  constexpr size_t kDone = 64;
  struct Buffer {
    Completion done[kDone];
    bool busy = false;
  };
  thread_local Buffer buffer;
  std::unique_ptr<Completion[]> nested;
  Completion* done = buffer.done;
  if (buffer.busy) {
    nested.reset(new Completion[kDone]);
    done = nested.get();
  } else {
    buffer.busy = true;
  }
  struct Unbusy {
    Buffer* b;
    ~Unbusy() {
      if (b != nullptr) b->busy = false;
    }
  } unbusy{nested ? nullptr : &buffer};
  const size_t n = transport_->WaitCompletions(absl::MakeSpan(done, kDone), timeout);
  const absl::Time now = clock_->Now();  // one reading for every completion
  // Slices whose link failed: on the segment's current links (refresh
  // first), or on links a refresh has already replaced (just re-post).
  std::map<SegmentId, std::vector<uint64_t>> refresh, repost;
  std::map<SegmentId, uint64_t> broken_generation;  // of the links that failed
  {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < n; ++i) {
      auto it = slices_.find(done[i].cookie);
      if (it == slices_.end()) continue;
      Slice& s = it->second;
      Unassign(s, now);
      if (!done[i].status.ok()) CountNicError(s, done[i].status.code());
      if (!done[i].status.ok() && Retryable(done[i].status.code())) {
        Segment& seg = segments_.at(s.segment);
        s.last_error = done[i].status;
        if (s.generation < seg.generation) {
          repost[s.segment].push_back(it->first);  // its links were replaced
          continue;
        }
        if (!seg.dead.ok()) {  // the peer did not answer a probe
          FinishSlice(done[i].cookie, seg.dead, now);
          continue;
        }
        if (s.retries_left > 0) {
          --s.retries_left;
          // The link is in error (RC semantics): no new slices on it. Move
          // the slice to a healthy link of the segment if there is one
          // (another NIC pair, say); rebuild the links only when none is
          // left, or when the peer's keys may have changed.
          bool healthy = false;
          for (Link& l : seg.links) {
            if (l.id == s.link) l.failed = true;
            healthy = healthy || !l.failed;
          }
          ++seg.metrics.retries;
          if (const int nic = NicOf(s); nic >= 0) ++nic_counters_[nic].retries;
          if (healthy && done[i].status.code() != absl::StatusCode::kPermissionDenied) {
            ++counters_.link_failovers;
            repost[s.segment].push_back(it->first);
          } else {
            seg.stale = true;
            refresh[s.segment].push_back(it->first);
            broken_generation[s.segment] = seg.generation;
          }
          continue;
        }
      }
      FinishSlice(done[i].cookie, std::move(done[i].status), now);
    }
  }
  for (auto& [segment, ids] : refresh) {
    bool changed = false;
    absl::Status refreshed = Refresh(segment, &changed, broken_generation[segment]);
    MutexLock lock(&mu_);
    std::vector<uint64_t>& keep = repost[segment];
    for (uint64_t sid : ids) {
      Slice& s = slices_.at(sid);
      if (!refreshed.ok()) {
        FinishSlice(sid, RetryImpossible(refreshed, s.last_error));
      } else if (!changed && s.last_error.code() == absl::StatusCode::kPermissionDenied) {
        FinishSlice(sid, s.last_error);  // same keys: retrying cannot help
      } else {
        keep.push_back(sid);
      }
    }
  }
  for (auto& [segment, ids] : repost) {
    if (!ids.empty()) (void)PostSlices(segment, ids);
  }
  DrainBacklogs();
  // Not while completions are still pouring in: they are signs of life.
  if (n < kDone) CheckPeers(now);
}

void TransferEngine::Impl::CheckPeers(absl::Time now) {
  if (absl::ToUnixNanos(now) < next_peer_check_ns_.load(std::memory_order_relaxed)) return;
  const absl::Duration half = options_.peer_timeout / 2;
  std::vector<std::pair<SegmentId, std::string>> silent;
  {
    MutexLock lock(&mu_);
    if (absl::ToUnixNanos(now) < next_peer_check_ns_.load(std::memory_order_relaxed)) return;
    next_peer_check_ns_.store(absl::ToUnixNanos(now + options_.peer_timeout / 4),
                              std::memory_order_relaxed);
    for (auto& [id, seg] : segments_) {
      if (seg.probing || seg.refreshing) continue;
      for (const Link& l : seg.links) {
        // Failed links are already closed (or closing): nothing to learn.
        if (!l.failed && l.inflight > 0 && now - l.progress >= half) {
          seg.probing = true;
          silent.emplace_back(id, seg.peer);
          break;
        }
      }
    }
  }
  for (const auto& [id, peer] : silent) {
    absl::StatusOr<Frame> reply = network_->Call(
        peer, Frame{MessageType::kProbe, handshake::Encode(handshake::Probe{engine_id_, 0})},
        half);
    absl::StatusOr<handshake::Probe> answer =
        reply.ok() ? handshake::DecodeProbe(reply->payload)
                   : absl::StatusOr<handshake::Probe>(reply.status());
    std::vector<LinkId> close;
    {
      MutexLock lock(&mu_);
      ++counters_.probes;
      auto it = segments_.find(id);
      if (it == segments_.end()) continue;
      Segment& seg = it->second;
      seg.probing = false;
      if (answer.ok() && answer->engine_id == seg.descriptor.engine_id) {
        // Alive, only slow: give its links another period.
        for (Link& l : seg.links) l.progress = clock_->Now();
        continue;
      }
      if (answer.ok()) {
        KVF_LOG(INFO) << "peer " << peer << " restarted (probe answered by a new engine id)";
      } else {
        ++counters_.probes_failed;
        seg.dead = absl::UnavailableError(absl::StrCat(
            "peer ", peer, " stopped answering: no completion for ",
            absl::FormatDuration(half), " and no answer to a probe (", answer.status().message(),
            ")"));
        KVF_LOG(WARNING) << seg.dead.message();
      }
      // Either way the links are useless now: closing them completes their
      // slices (kCancelled), which then fail with `dead` or are retried on
      // the restarted peer. Waiting slices of the backlog fail likewise.
      seg.stale = true;
      for (Link& l : seg.links) {
        l.failed = true;
        close.push_back(l.id);
      }
      if (!seg.dead.ok()) {
        for (uint64_t sid : seg.backlog) FinishSlice(sid, seg.dead);
        seg.backlog.clear();
      }
    }
    for (LinkId l : close) (void)transport_->CloseLink(l);
  }
}

void TransferEngine::Impl::StatusOf(const Batch& b, BatchStatus* out) const {
  out->pending = b.pending;
  out->succeeded = 0;
  out->failed = 0;
  out->requests.clear();
  out->requests.reserve(b.status.size());
  for (size_t i = 0; i < b.status.size(); ++i) {
    if (b.slices_left[i] > 0) {
      out->requests.push_back(absl::UnavailableError("pending"));
    } else {
      out->requests.push_back(b.status[i]);
      ++(b.status[i].ok() ? out->succeeded : out->failed);
    }
  }
}

absl::StatusOr<BatchStatus> TransferEngine::Impl::Poll(BatchId id) {
  Pump(absl::ZeroDuration());
  MutexLock lock(&mu_);
  auto it = batches_.find(id);
  if (it == batches_.end()) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
  return StatusOf(it->second);
}

absl::StatusOr<BatchStatus> TransferEngine::Impl::Wait(BatchId id, absl::Duration timeout) {
  BatchStatus out;
  RETURN_IF_ERROR(Wait(id, timeout, &out));
  return out;
}

absl::Status TransferEngine::Impl::Wait(BatchId id, absl::Duration timeout, BatchStatus* out) {
  absl::Time deadline = absl::InfiniteFuture();  // read the clock only when waiting
  for (;;) {
    absl::Time now;
    {
      MutexLock lock(&mu_);
      auto it = batches_.find(id);
      if (it == batches_.end()) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
      if (it->second.pending == 0) {
        StatusOf(it->second, out);
        return absl::OkStatus();
      }
      now = clock_->Now();
      if (deadline == absl::InfiniteFuture()) deadline = now + timeout;
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "batch ", id, " still has ", it->second.pending, " request(s) pending after ",
            absl::FormatDuration(timeout)));
      }
    }
    Pump(std::min(deadline - now, absl::Milliseconds(50)));
  }
}

absl::Status TransferEngine::Impl::Release(BatchId id) {
  MutexLock lock(&mu_);
  auto it = batches_.find(id);
  if (it == batches_.end()) return absl::NotFoundError(absl::StrCat("unknown batch ", id));
  if (it->second.pending != 0) {
    return absl::FailedPreconditionError(absl::StrCat("batch ", id, " is still running"));
  }
  // Kept for the next Submit: its vectors' capacity saves allocations.
  if (spare_batches_.size() < kSpareBatches) {
    it->second.Reset();
    spare_batches_.push_back(std::move(it->second));
  }
  batches_.erase(it);
  return absl::OkStatus();
}

// ---------------------------------------------------------------- notifications

absl::Status TransferEngine::Impl::Notify(SegmentId id, const std::string& message) {
  return NotifyInstance(id, message, 0);
}

absl::Status TransferEngine::Impl::NotifyInstance(SegmentId id, const std::string& message,
                                                  uint64_t target) {
  std::string peer;
  {
    MutexLock lock(&mu_);
    auto it = segments_.find(id);
    if (it == segments_.end()) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
    peer = it->second.peer;
  }
  if (message.size() > handshake::kMaxNotifyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("notification of ", message.size(),
                                                   " bytes exceeds the limit of ",
                                                   handshake::kMaxNotifyBytes));
  }
  ASSIGN_OR_RETURN(Frame reply,
                   network_->Call(peer,
                                  Frame{MessageType::kNotify,
                                        handshake::Encode(
                                            handshake::Notify{engine_id_, message, target})},
                                  options_.handshake_timeout));
  if (reply.type != MessageType::kNotifyAck) {
    return absl::DataLossError(absl::StrCat("peer ", peer, " answered notify with ",
                                            handshake::MessageTypeName(reply.type)));
  }
  return absl::OkStatus();
}

absl::Status TransferEngine::Impl::NotifyAfter(BatchId id, const std::string& message,
                                               absl::Duration timeout) {
  ASSIGN_OR_RETURN(BatchStatus status, Wait(id, timeout));
  if (!status.ok()) {
    for (size_t i = 0; i < status.requests.size(); ++i) {
      if (!status.requests[i].ok()) {
        return absl::Status(status.requests[i].code(),
                            absl::StrCat("batch ", id, " failed, notification not sent: request ",
                                         i, ": ", status.requests[i].message()));
      }
    }
  }
  SegmentId segment;
  uint64_t target;
  {
    MutexLock lock(&mu_);
    segment = batches_.at(id).segment;
    target = batches_.at(id).peer_engine_id;
  }
  // Only to the instance that holds the batch's bytes.
  return NotifyInstance(segment, message, target);
}

std::vector<Notification> TransferEngine::Impl::TakeNotifications() {
  MutexLock lock(&mu_);
  std::vector<Notification> out(inbox_.begin(), inbox_.end());
  inbox_.clear();
  return out;
}

absl::StatusOr<Notification> TransferEngine::Impl::WaitNotification(absl::Duration timeout) {
  if (wait_) {
    wait_([this] {
      MutexLock lock(&mu_);
      return !inbox_.empty();
    }, timeout);
  }
  MutexLock lock(&mu_);
  if (!wait_) {
    cv_.AwaitWithDeadline(&mu_, absl::Now() + timeout,
                          [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return !inbox_.empty(); });
  }
  if (inbox_.empty()) {
    return absl::DeadlineExceededError(
        absl::StrCat("no notification within ", absl::FormatDuration(timeout)));
  }
  Notification n = std::move(inbox_.front());
  inbox_.pop_front();
  return n;
}

absl::Status TransferEngine::Impl::PublishMetadata(const std::string& key, std::string value) {
  if (key.empty() || key.size() > handshake::kMaxStringBytes ||
      value.size() > handshake::kMaxNotifyBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata key must be 1 to ", handshake::kMaxStringBytes, " bytes and the value at most ",
        handshake::kMaxNotifyBytes));
  }
  MutexLock lock(&mu_);
  metadata_[key] = std::move(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> TransferEngine::Impl::FetchMetadata(SegmentId id,
                                                                const std::string& key) {
  for (int attempt = 0;; ++attempt) {
    std::string peer;
    uint64_t instance, generation;
    {
      MutexLock lock(&mu_);
      auto it = segments_.find(id);
      if (it == segments_.end()) return absl::NotFoundError(absl::StrCat("unknown segment ", id));
      peer = it->second.peer;
      instance = it->second.descriptor.engine_id;
      generation = it->second.generation;
    }
    absl::StatusOr<Frame> answer = network_->Call(
        peer, Frame{MessageType::kGetMetadata, handshake::Encode(handshake::MetadataRequest{key})},
        options_.handshake_timeout);
    if (!answer.ok()) {
      return Annotate(answer.status(), absl::StrCat("metadata '", key, "' of ", peer));
    }
    Frame& reply = *answer;
    ASSIGN_OR_RETURN(handshake::Metadata m, handshake::DecodeMetadata(reply.payload));
    if (m.engine_id == instance) return std::move(m.value);
    // The peer restarted since the last handshake: values and segment must
    // describe the same instance, so handshake again first.
    if (attempt > 0) {
      return absl::UnavailableError(absl::StrCat("peer ", peer, " keeps restarting"));
    }
    bool changed;
    RETURN_IF_ERROR(Refresh(id, &changed, generation));
  }
}

// ---------------------------------------------------------------- creation

namespace {

// What Create decided, plus the RDMA ports when it chose RDMA.
struct Decision {
  Detection detection;
  std::vector<transport::verbs::SelectedPort> ports;
  transport::verbs::Discovery discovery;  // when RDMA was looked for
};

// The selected ports (NIC indices of the verbs transport) nearest to
// `location`: every port at the smallest distance.
absl::StatusOr<std::vector<NicIndex>> NearestNics(const transport::verbs::Discovery& d,
                                                  const std::string& location) {
  std::vector<int> distance;
  ASSIGN_OR_RETURN(std::vector<transport::verbs::SelectedPort> ports,
                   transport::verbs::NearestPorts(d, location, &distance));
  std::vector<NicIndex> out;
  for (size_t i = 0; i < ports.size() && distance[i] == distance[0]; ++i) {
    for (NicIndex n = 0; n < d.selected.size(); ++n) {
      if (d.selected[n].device == ports[i].device && d.selected[n].port == ports[i].port) {
        out.push_back(n);
      }
    }
  }
  return out;
}

absl::StatusOr<Decision> Detect(const EngineOptions& options) {
  Decision out;
  Detection& d = out.detection;
  if (options.transport != "auto" && options.transport != "tcp" &&
      options.transport != "rdma" && options.transport != "sim") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown transport '", options.transport, "' (expected auto, tcp, rdma or sim)"));
  }
  if (options.transport == "sim") {
    return absl::InvalidArgumentError(
        "transport=sim needs a simulated fabric: build the engine with CreateWith");
  }
  std::string rdma_netdev;
  if (options.transport != "tcp") {
    transport::verbs::DiscoveryOptions discovery;
    discovery.devices = options.devices;
    if (options.gid_index >= 0) {
      discovery.gid_index = options.gid_index;
      discovery.gid_index_source = "EngineOptions::gid_index";
    }
    transport::verbs::ApplyEnvironment(&discovery);
    absl::StatusOr<transport::verbs::Discovery> found = transport::verbs::Discover(discovery);
    if (!found.ok()) return found.status();  // e.g. a named device that does not exist
    for (const std::string& note : found->notes) KVF_LOG(INFO) << "rdma discovery: " << note;
    out.ports = found->selected;
    out.discovery = *found;
    if (!out.ports.empty()) {
      d.transport = "rdma";
      std::vector<std::string> names;
      for (const auto& p : out.ports) names.push_back(absl::StrCat(p.device, ":", p.port));
      d.devices = absl::StrJoin(names, ",");
      d.transport_reason = absl::StrCat(options.transport == "rdma" ? "set explicitly; " : "",
                                        out.ports.size(), " active RDMA port(s); ",
                                        out.ports[0].device, ":", out.ports[0].port, " ",
                                        out.ports[0].why);
      rdma_netdev = out.ports[0].netdev;
    } else if (options.transport == "rdma") {
      return absl::FailedPreconditionError(absl::StrCat(
          "transport=rdma but no usable RDMA port was found (",
          found->devices.empty() ? "no RDMA devices"
                                 : absl::StrJoin(found->notes, "; "),
          "); ./bazelw run //tools:devices explains"));
    } else {
      d.transport = "tcp";
      d.transport_reason = found->devices.empty()
                               ? "no RDMA devices on this host"
                               : absl::StrCat("no usable RDMA port (",
                                              absl::StrJoin(found->notes, "; "), ")");
    }
  } else {
    d.transport = "tcp";
    d.transport_reason = "set explicitly";
  }
  if (d.devices.empty()) d.devices = "none (TCP)";
  absl::StatusOr<std::vector<net::InterfaceAddress>> addresses = net::ListInterfaceAddresses();
  const net::HostChoice host = net::ChooseLocalHost(
      options.local_host, rdma_netdev,
      addresses.ok() ? *addresses : std::vector<net::InterfaceAddress>{},
      net::DefaultRouteInterface());
  d.host = host.host;
  d.host_reason = host.reason;
  d.bind_host = options.bind_host.empty() ? host.host : options.bind_host;
  return out;
}

absl::Status CheckOptions(const EngineOptions& o) {
  if (o.slice_bytes == 0) return absl::InvalidArgumentError("slice_bytes must be positive");
  if (o.peer_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("peer_timeout must be positive");
  }
  if (o.links_per_peer == 0 || o.links_per_peer > 64) {
    return absl::InvalidArgumentError("links_per_peer must be 1 to 64");
  }
  if (o.port == 0 && (o.first_port == 0 || o.last_port < o.first_port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad port range ", o.first_port, "-", o.last_port));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(EngineOptions options) {
  RETURN_IF_ERROR(CheckOptions(options));
  ASSIGN_OR_RETURN(Decision decision, Detect(options));
  Detection& d = decision.detection;
  KVF_LOG(INFO) << "advertising " << d.host << " (" << d.host_reason << ")";
  KVF_LOG(INFO) << "transport " << d.transport << " (" << d.transport_reason << ")";
  std::unique_ptr<transport::Transport> data;
  if (d.transport == "rdma") {
    transport::VerbsTransportOptions v;
    v.ports = decision.ports;
    ASSIGN_OR_RETURN(data, transport::CreateVerbsTransport(v));
  } else {
    transport::TcpTransportOptions t;
    t.bind_host = d.bind_host;
    t.advertise_host = d.host;
    t.connect_timeout = options.connect_timeout;
    ASSIGN_OR_RETURN(data, transport::CreateTcpTransport(t));
  }
  EngineParts parts;
  parts.transport = std::move(data);
  parts.network = handshake::NewTcpNetwork();
  parts.detection = std::move(d);
  if (!decision.ports.empty()) {
    parts.near_nics = [discovery = std::move(decision.discovery)](const std::string& location) {
      return NearestNics(discovery, location);
    };
  }
  return CreateWith(std::move(options), std::move(parts));
}

absl::StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::CreateWith(EngineOptions options,
                                                                           EngineParts parts) {
  RETURN_IF_ERROR(CheckOptions(options));
  if (parts.transport == nullptr || parts.network == nullptr) {
    return absl::InvalidArgumentError("CreateWith needs a transport and a network");
  }
  if (options.secret.empty()) {
    if (const char* env = std::getenv(handshake::kSecretEnv); env != nullptr) options.secret = env;
  }
  handshake::AuthenticatedNetwork* auth = nullptr;
  if (!options.secret.empty()) {
    handshake::AuthOptions a;
    a.secret = options.secret;
    a.clock = parts.clock;
    absl::StatusOr<std::unique_ptr<handshake::AuthenticatedNetwork>> wrapped =
        handshake::AuthenticatedNetwork::Create(std::move(parts.network), std::move(a));
    if (!wrapped.ok()) return wrapped.status();
    auth = wrapped->get();
    parts.network = std::move(*wrapped);
    KVF_LOG(INFO) << "handshake authenticated with a shared secret";
  }
  options.secret.clear();  // kept only inside the authenticated network
  handshake::ServeOptions serve;
  serve.bind_host = parts.detection.bind_host.empty() ? parts.detection.host
                                                      : parts.detection.bind_host;
  serve.advertise_host = parts.detection.host;
  serve.port = options.port;
  serve.first_port = options.first_port;
  serve.last_port = options.last_port;
  const int options_metrics_port = options.metrics_port;
  auto impl = std::make_unique<Impl>(std::move(options), std::move(parts));
  impl->set_auth(auth);
  RETURN_IF_ERROR(impl->Start(serve));
  RETURN_IF_ERROR(impl->StartMetrics(serve.bind_host, options_metrics_port));
  KVF_LOG(INFO) << "handshake listening on " << serve.bind_host << ":"
                << impl->detection().port << ", peers reach this engine at "
                << impl->address();
  for (const transport::NicInfo& nic : impl->LocalNics()) {
    KVF_LOG(INFO) << "data on " << nic.name << " at " << nic.address;
  }
  return std::unique_ptr<TransferEngine>(new TransferEngine(std::move(impl)));
}

TransferEngine::TransferEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferEngine::~TransferEngine() = default;
std::string TransferEngine::address() const { return impl_->address(); }
const Detection& TransferEngine::detection() const { return impl_->detection(); }
uint64_t TransferEngine::engine_id() const { return impl_->engine_id(); }
Clock* TransferEngine::clock() const { return impl_->clock(); }
absl::Status TransferEngine::RegisterMemory(void* addr, uint64_t length, Access access,
                                            const std::string& location) {
  return impl_->RegisterMemory(addr, length, access, location);
}
std::vector<NicCounters> TransferEngine::GetNicCounters() const {
  return impl_->GetNicCounters();
}
EngineCounters TransferEngine::GetCounters() const { return impl_->GetCounters(); }
EngineMetrics TransferEngine::GetMetrics() const { return impl_->GetMetrics(); }
std::string TransferEngine::metrics_address() const { return impl_->metrics_address(); }
absl::Status TransferEngine::UnregisterMemory(void* addr) { return impl_->UnregisterMemory(addr); }
absl::StatusOr<SegmentId> TransferEngine::OpenSegment(const std::string& peer) {
  return impl_->OpenSegment(peer);
}
absl::StatusOr<std::vector<TransferEngine::RemoteRegion>> TransferEngine::SegmentRegions(
    SegmentId segment) {
  return impl_->SegmentRegions(segment);
}
absl::StatusOr<BatchId> TransferEngine::Submit(SegmentId segment,
                                               absl::Span<const TransferRequest> requests,
                                               uint64_t peer_engine_id) {
  return impl_->Submit(segment, requests, peer_engine_id);
}
absl::StatusOr<BatchStatus> TransferEngine::Poll(BatchId batch) { return impl_->Poll(batch); }
absl::Status TransferEngine::Wait(BatchId batch, absl::Duration timeout, BatchStatus* out) {
  return impl_->Wait(batch, timeout, out);
}
absl::StatusOr<BatchStatus> TransferEngine::Wait(BatchId batch, absl::Duration timeout) {
  return impl_->Wait(batch, timeout);
}
absl::Status TransferEngine::Release(BatchId batch) { return impl_->Release(batch); }
absl::Status TransferEngine::Notify(SegmentId segment, const std::string& message,
                                    uint64_t peer_engine_id) {
  return impl_->NotifyInstance(segment, message, peer_engine_id);
}
absl::StatusOr<uint64_t> TransferEngine::PeerEngineId(SegmentId segment) {
  return impl_->PeerEngineId(segment);
}
absl::StatusOr<uint64_t> TransferEngine::BatchPeerEngineId(BatchId batch) {
  return impl_->BatchPeerEngineId(batch);
}
absl::Status TransferEngine::NotifyAfter(BatchId batch, const std::string& message,
                                         absl::Duration timeout) {
  return impl_->NotifyAfter(batch, message, timeout);
}
absl::Status TransferEngine::PublishMetadata(const std::string& key, std::string value) {
  return impl_->PublishMetadata(key, std::move(value));
}
absl::StatusOr<std::string> TransferEngine::FetchMetadata(SegmentId segment,
                                                          const std::string& key) {
  return impl_->FetchMetadata(segment, key);
}
std::vector<Notification> TransferEngine::TakeNotifications() {
  return impl_->TakeNotifications();
}
absl::StatusOr<Notification> TransferEngine::WaitNotification(absl::Duration timeout) {
  return impl_->WaitNotification(timeout);
}

}  // namespace kvferry
