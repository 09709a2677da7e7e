// TransferEngine: the facade that wires the engine's units together.
//
//   local_regions     registered memory and the NICs near it
//   batch_pipeline    segments, links, batches, slices, completions,
//                     retries and liveness (submit.cc, completions.cc,
//                     liveness.cc, link_set, segment_table, batch_table,
//                     completion_pump, retry_policy)
//   peer_service      answers peers' handshake requests
//   peer_client       typed handshake calls to peers
//   notifications     the inbox and the published metadata
//   create.cc         zero-configuration Create (its own target)
#include "engine/transfer_engine.h"

#include <cstdlib>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "engine/engine_options.h"
#include "engine/memory/local_regions.h"
#include "engine/memory/memory_location.h"
#include "engine/metrics/metrics_server.h"
#include "engine/peer/notifications.h"
#include "engine/peer/peer_client.h"
#include "engine/peer/peer_service.h"
#include "engine/peer/secret.h"
#include "engine/pipeline/batch_pipeline.h"
#include "engine/prepared/prepared_internal.h"
#include "engine/stream_order.h"
#include "handshake/auth.h"
#include "net/socket.h"
#include "topology/location.h"

namespace kvferry {

using engine_internal::CheckLocation;
using engine_internal::MemoryLocation;
using engine_internal::NicMask;
using engine_internal::SameNumaNode;
using transport::Access;
using transport::NicIndex;

namespace {

engine_internal::PipelineConfig ConfigOf(const EngineOptions& o) {
  engine_internal::PipelineConfig c;
  c.slice_bytes = o.slice_bytes;
  c.retries = o.retries;
  c.links_per_peer = o.links_per_peer;
  c.peer_timeout = o.peer_timeout;
  c.idle_segment_timeout = o.idle_segment_timeout;
  return c;
}

}  // namespace

class TransferEngine::Impl {
 public:
  Impl(EngineOptions options, EngineParts parts)
      : options_(std::move(options)),
        transport_(std::move(parts.transport)),
        fallback_(std::move(parts.fallback)),
        same_host_(std::move(parts.same_host)),
        network_(std::move(parts.network)),
        detection_(std::move(parts.detection)),
        clock_(parts.clock != nullptr ? parts.clock : RealClock()),
        engine_id_(parts.engine_id != 0 ? parts.engine_id : net::RandomU64()),
        near_nics_(std::move(parts.near_nics)),
        regions_(Transports()),
        inbox_(std::move(parts.wait)),
        client_(network_.get(), engine_id_, options_.handshake_timeout),
        service_(engine_id_, Transports(), &regions_, &inbox_, &metadata_, &sent_),
        pipeline_(ConfigOf(options_), engine_id_, Transports(), &regions_, &client_, clock_,
                  engine_internal::HostFacts::OfThisHost()),
        streams_([this](SegmentId segment, const std::vector<TransferRequest>& requests,
                        absl::Duration timeout,
                        BatchId* running) { return RunToEnd(segment, requests, timeout, running); },
                 [this](BatchId batch) { return pipeline_.Release(batch); }) {
    client_.OnFenced([this](const std::string& peer, uint64_t epoch) {
      pipeline_.segments().FencedBy(peer, epoch);
    });
    engine_internal::PreparedDeps deps;
    deps.pipeline = &pipeline_;
    deps.regions = &regions_;
    deps.finished = &finished_;
    deps.clock = clock_;
    deps.notify = [this](uint64_t segment, const std::string& message, uint64_t target) {
      return NotifyInstance(segment, message, target);
    };
    prepared_ = std::make_unique<PreparedTransfers>(deps);
    if (!near_nics_) {
      near_nics_ = [t = transport_.get()](const std::string& location) {
        return absl::StatusOr<std::vector<NicIndex>>(SameNumaNode(*t, location));
      };
    }
  }
  ~Impl() {
    metrics_server_.reset();
    server_.reset();  // no more handler calls
  }

  absl::Status Start(handshake::ServeOptions serve) {
    // Where the network can hand a connection over, the first link from a
    // new peer runs on the handshake's connection (kConnectLinksHere).
    if (auto* hand_over = handshake::ExtensionOf<handshake::HandOver>(network_.get())) {
      ASSIGN_OR_RETURN(
          server_, hand_over->ServeHandingOver(
                       serve, [this](const handshake::Frame& f) { return service_.Handle(f); }));
    } else {
      ASSIGN_OR_RETURN(server_, network_->Serve(serve, [this](const handshake::Frame& f) {
        return service_.Handle(f).reply;
      }));
    }
    address_ = server_->address();
    absl::StatusOr<net::HostPort> hp = net::ParseHostPort(address_);
    if (hp.ok()) detection_.port = hp->port;
    return absl::OkStatus();
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
  void set_auth(const handshake::AuthenticatedNetwork* auth) { auth_ = auth; }

  absl::Status RegisterMemory(void* addr, uint64_t length, Access access,
                              const std::string& location) {
    NicMask near = 0;
    if (!location.empty()) RETURN_IF_ERROR(CheckLocation(location));
    bool derived = false, device = false;
    ASSIGN_OR_RETURN(const std::string where,
                     MemoryLocation(addr, length, location, &derived, &device));
    if (!device && addr != nullptr && length > 0 && transport::AllowsRemoteWrite(access)) {
      // A remote WRITE into a read-only mapping would kill this process.
      if (absl::Status w = cuda::CheckHostWritable(addr, length); !w.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("RegisterMemory: ", w.message(),
                         "; peers may not write it (register it with kRemoteRead or kNone)"));
      }
    }
    if (!where.empty()) {
      absl::StatusOr<std::vector<NicIndex>> nics = near_nics_(where);
      // A GPU the RDMA discovery does not list: no preference.
      if (!nics.ok() && derived && nics.status().code() == absl::StatusCode::kNotFound) {
        KVF_LOG(WARNING) << "RegisterMemory: " << nics.status().message()
                         << "; no NIC preference for this buffer";
        nics = std::vector<NicIndex>{};
      }
      if (!nics.ok()) return Annotate(nics.status(), "RegisterMemory");
      for (NicIndex i : *nics) {
        if (i < 64) near |= NicMask{1} << i;
      }
    }
    return regions_.Register(addr, length, access, near, device);
  }
  absl::StatusOr<SegmentId> OpenSegment(const std::string& peer_text) {
    ASSIGN_OR_RETURN(net::HostPort hp, net::ParseHostPort(peer_text));
    return pipeline_.segments().Open(hp.ToString());
  }
  // Notify, refused by the peer unless it is the instance `target` (0: any).
  absl::Status NotifyInstance(SegmentId id, const std::string& message, uint64_t target,
                              absl::Duration timeout = {}, bool confirmable = false) {
    if (timeout > absl::ZeroDuration()) timeout = std::min(timeout, options_.handshake_timeout);
    ASSIGN_OR_RETURN(engine_internal::SegmentRegistry::PeerView v, pipeline_.segments().View(id));
    if (confirmable) sent_.Add(engine_internal::NotificationDigest(message));
    return client_.Notify(v.peer, message, target, timeout);
  }
  absl::Status NotifyAfter(BatchId id, const std::string& message, absl::Duration timeout);
  // A stream-ordered batch, run on StreamOrder's thread.
  absl::StatusOr<BatchStatus> RunToEnd(SegmentId segment,
                                       const std::vector<TransferRequest>& requests,
                                       absl::Duration timeout, BatchId* running) {
    ASSIGN_OR_RETURN(BatchId batch,
                     pipeline_.Submit(segment, requests, engine_internal::PeerBinding{}));
    BatchStatus status;
    RETURN_IF_ERROR(pipeline_.Wait(batch, timeout, &status));
    if (!status.done()) {
      *running = batch;
      return absl::DeadlineExceededError(
          absl::StrCat("stream-ordered transfer not done within ", absl::FormatDuration(timeout)));
    }
    (void)pipeline_.Release(batch);
    return status;
  }
  // The device whose context a stream-ordered batch's stream belongs to.
  static int StreamDevice(absl::Span<const TransferRequest> requests, int device) {
    if (device >= 0 || requests.empty()) return device < 0 ? 0 : device;
    const cuda::Driver* driver = cuda::Driver::Get();
    if (driver == nullptr) return 0;
    absl::StatusOr<cuda::MemoryInfo> where = driver->Classify(requests[0].local, 1);
    return where.ok() && where->device ? where->ordinal : 0;
  }
  absl::StatusOr<std::string> FetchMetadata(SegmentId id, const std::string& key,
                                            absl::Duration timeout = {});
  EngineMetrics GetMetrics() const {
    EngineMetrics m;
    m.peers = pipeline_.segments().Peers();
    m.nics = pipeline_.segments().NicCountersNow();
    const EngineCounters c = GetCounters();
    m.handshakes_refused = c.handshakes_refused;
    m.link_failovers = c.link_failovers;
    m.probes = c.probes;
    m.probes_failed = c.probes_failed;
    m.peers_fenced = c.peers_fenced;
    if (server_ != nullptr) m.refused_input = server_->RefusedInput();
    for (transport::Transport* t : Transports()) {
      for (auto& entry : t->RefusedInput()) m.refused_input.push_back(std::move(entry));
    }
    return m;
  }
  EngineCounters GetCounters() const {
    EngineCounters c = pipeline_.segments().Counters();
    c.handshakes_refused = auth_ == nullptr ? 0 : auth_->rejected();
    c.peers_fenced = service_.fences();
    return c;
  }
  std::vector<transport::Transport*> Transports() const {
    std::vector<transport::Transport*> out = {transport_.get()};
    if (fallback_ != nullptr) out.push_back(fallback_.get());
    if (same_host_ != nullptr) out.push_back(same_host_.get());
    return out;
  }
  std::vector<transport::NicInfo> LocalNics() const {
    std::vector<transport::NicInfo> out;
    for (transport::Transport* t : Transports()) {
      for (transport::NicInfo& nic : t->LocalEndpoint().nics) out.push_back(std::move(nic));
    }
    return out;
  }
  std::string metrics_address() const {
    return metrics_server_ == nullptr ? "" : metrics_server_->address();
  }

  const EngineOptions options_;
  const std::unique_ptr<transport::Transport> transport_;
  const std::unique_ptr<transport::Transport> fallback_;   // may be null
  const std::unique_ptr<transport::Transport> same_host_;  // may be null
  const std::unique_ptr<handshake::Network> network_;
  Detection detection_;
  Clock* const clock_;
  const uint64_t engine_id_;
  std::function<absl::StatusOr<std::vector<NicIndex>>(const std::string&)> near_nics_;
  engine_internal::LocalRegions regions_;
  engine_internal::Inbox inbox_;
  engine_internal::SentLog sent_;
  engine_internal::MetadataStore metadata_;
  engine_internal::PeerClient client_;
  engine_internal::PeerService service_;
  engine_internal::FinishedQueue finished_;  // the pipeline's hook: after it in destruction
  engine_internal::BatchPipeline pipeline_;
  engine_internal::StreamOrder streams_;  // before pipeline_ in destruction
  std::unique_ptr<PreparedTransfers> prepared_;  // before pipeline_ in destruction
  std::string address_;
  const handshake::AuthenticatedNetwork* auth_ = nullptr;  // inside network_, if any
  std::unique_ptr<handshake::Server> server_;
  std::unique_ptr<MetricsServer> metrics_server_;
};

absl::Status TransferEngine::Impl::NotifyAfter(BatchId id, const std::string& message,
                                               absl::Duration timeout) {
  BatchStatus status;
  RETURN_IF_ERROR(pipeline_.Wait(id, timeout, &status));
  for (size_t i = 0; i < status.requests.size(); ++i) {
    if (!status.requests[i].ok()) {
      return absl::Status(status.requests[i].code(),
                          absl::StrCat("batch ", id, " failed, notification not sent: request ", i,
                                       ": ", status.requests[i].message()));
    }
  }
  ASSIGN_OR_RETURN(auto target, pipeline_.Target(id));
  // Only to the instance that holds the batch's bytes.
  return NotifyInstance(target.first, message, target.second);
}

absl::StatusOr<std::string> TransferEngine::Impl::FetchMetadata(SegmentId id,
                                                                const std::string& key,
                                                                absl::Duration timeout) {
  // Never longer than the engine's own bound for a handshake call.
  if (timeout > absl::ZeroDuration()) timeout = std::min(timeout, options_.handshake_timeout);
  for (int attempt = 0;; ++attempt) {
    ASSIGN_OR_RETURN(engine_internal::SegmentRegistry::PeerView v, pipeline_.segments().View(id));
    ASSIGN_OR_RETURN(handshake::Metadata m, client_.GetMetadata(v.peer, key, timeout));
    if (m.engine_id == v.engine_id) return std::move(m.value);
    // The peer restarted since the last handshake: values and segment must
    // describe the same instance, so handshake again first.
    if (attempt > 0) {
      return absl::UnavailableError(absl::StrCat("peer ", v.peer, " keeps restarting"));
    }
    bool changed;
    RETURN_IF_ERROR(pipeline_.segments().Refresh(id, &changed, v.generation));
  }
}

absl::StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::CreateWith(EngineOptions options,
                                                                           EngineParts parts) {
  RETURN_IF_ERROR(engine_internal::CheckOptions(options));
  if (parts.transport == nullptr || parts.network == nullptr) {
    return absl::InvalidArgumentError("CreateWith needs a transport and a network");
  }
  ASSIGN_OR_RETURN(options.secret, engine_internal::ResolveSecret(options.secret));
  handshake::AuthenticatedNetwork* auth = nullptr;
  if (!options.secret.empty()) {
    handshake::AuthOptions a;
    a.secret = options.secret;
    a.clock = parts.clock;
    ASSIGN_OR_RETURN(
        std::unique_ptr<handshake::AuthenticatedNetwork> wrapped,
        handshake::AuthenticatedNetwork::Create(std::move(parts.network), std::move(a)));
    auth = wrapped.get();
    parts.network = std::move(wrapped);
    KVF_LOG(INFO) << "handshake authenticated with a shared secret";
  }
  options.secret.clear();  // kept only inside the authenticated network
  handshake::ServeOptions serve;
  serve.bind_host =
      parts.detection.bind_host.empty() ? parts.detection.host : parts.detection.bind_host;
  serve.advertise_host = parts.detection.host;
  serve.port = options.port;
  serve.first_port = options.first_port;
  serve.last_port = options.last_port;
  bool accept_waits = false;
  for (const auto* t : {&parts.transport, &parts.fallback, &parts.same_host}) {
    accept_waits = accept_waits || (*t != nullptr && (*t)->GetLimits().accept_waits);
  }
  serve.may_block = [accept_waits](const handshake::Frame& f) {
    return engine_internal::PeerService::MayBlock(f.type, accept_waits);
  };
  const int metrics_port = options.metrics_port;
  const std::string metrics_host = options.metrics_host;
  engine_internal::WarnIfUnauthenticated(auth != nullptr, serve.bind_host);
  auto impl = std::make_unique<Impl>(std::move(options), std::move(parts));
  impl->set_auth(auth);
  RETURN_IF_ERROR(impl->Start(serve));
  RETURN_IF_ERROR(
      impl->StartMetrics(metrics_host.empty() ? serve.bind_host : metrics_host, metrics_port));
  KVF_LOG(INFO) << "handshake listening on " << serve.bind_host << ":" << impl->detection_.port
                << ", peers reach this engine at " << impl->address_;
  for (const transport::NicInfo& nic : impl->LocalNics()) {
    KVF_LOG(INFO) << "data on " << nic.name << " at " << nic.address;
  }
  return std::unique_ptr<TransferEngine>(new TransferEngine(std::move(impl)));
}

// ---------------------------------------------------------------- forwarding

TransferEngine::TransferEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferEngine::~TransferEngine() = default;
std::string TransferEngine::address() const { return impl_->address_; }
const Detection& TransferEngine::detection() const { return impl_->detection_; }
uint64_t TransferEngine::engine_id() const { return impl_->engine_id_; }
Clock* TransferEngine::clock() const { return impl_->clock_; }
absl::Status TransferEngine::RegisterMemory(void* addr, uint64_t length, Access access,
                                            const std::string& location) {
  return impl_->RegisterMemory(addr, length, access, location);
}
absl::Status TransferEngine::UnregisterMemory(void* addr) {
  return impl_->regions_.Unregister(addr);
}
std::vector<NicCounters> TransferEngine::GetNicCounters() const {
  return impl_->pipeline_.segments().NicCountersNow();
}
EngineCounters TransferEngine::GetCounters() const { return impl_->GetCounters(); }
EngineMetrics TransferEngine::GetMetrics() const { return impl_->GetMetrics(); }
std::string TransferEngine::metrics_address() const { return impl_->metrics_address(); }
absl::StatusOr<SegmentId> TransferEngine::OpenSegment(const std::string& peer) {
  return impl_->OpenSegment(peer);
}
absl::Status TransferEngine::CloseSegment(SegmentId segment) {
  return impl_->pipeline_.segments().Close(segment);
}
absl::StatusOr<std::vector<TransferEngine::RemoteRegion>> TransferEngine::SegmentRegions(
    SegmentId segment) {
  return impl_->pipeline_.segments().Regions(segment);
}
absl::StatusOr<BatchId> TransferEngine::Submit(SegmentId segment,
                                               absl::Span<const TransferRequest> requests,
                                               uint64_t peer_engine_id,
                                               std::optional<uint64_t> peer_epoch) {
  return impl_->pipeline_.Submit(segment, requests,
                                 engine_internal::PeerBinding{peer_engine_id, peer_epoch});
}
PreparedTransfers& TransferEngine::prepared() { return *impl_->prepared_; }
absl::StatusOr<BatchStatus> TransferEngine::Poll(BatchId batch) {
  return impl_->pipeline_.Poll(batch);
}
absl::Status TransferEngine::Wait(BatchId batch, absl::Duration timeout, BatchStatus* out) {
  return impl_->pipeline_.Wait(batch, timeout, out);
}
absl::StatusOr<BatchStatus> TransferEngine::Wait(BatchId batch, absl::Duration timeout) {
  BatchStatus out;
  RETURN_IF_ERROR(impl_->pipeline_.Wait(batch, timeout, &out));
  return out;
}
absl::Status TransferEngine::Release(BatchId batch) { return impl_->pipeline_.Release(batch); }
absl::StatusOr<uint64_t> TransferEngine::SubmitOnStream(SegmentId segment,
                                                        absl::Span<const TransferRequest> requests,
                                                        void* stream,
                                                        const StreamOptions& options) {
  return impl_->streams_.Submit(segment, requests, stream,
                                Impl::StreamDevice(requests, options.device), options);
}
absl::StatusOr<BatchStatus> TransferEngine::WaitOnStream(uint64_t id, absl::Duration timeout) {
  return impl_->streams_.Wait(id, timeout);
}
absl::Status TransferEngine::Notify(SegmentId segment, const std::string& message,
                                    uint64_t peer_engine_id) {
  return impl_->NotifyInstance(segment, message, peer_engine_id);
}
absl::Status TransferEngine::Notify(SegmentId segment, const std::string& message,
                                    const NotifyOptions& options) {
  return impl_->NotifyInstance(segment, message, options.peer_engine_id, options.timeout,
                               options.confirmable);
}
absl::StatusOr<uint64_t> TransferEngine::PeerEngineId(SegmentId segment) {
  ASSIGN_OR_RETURN(engine_internal::SegmentRegistry::PeerView v,
                   impl_->pipeline_.segments().View(segment));
  return v.engine_id;
}
absl::StatusOr<uint64_t> TransferEngine::PeerEpoch(SegmentId segment) {
  ASSIGN_OR_RETURN(engine_internal::SegmentRegistry::PeerView v,
                   impl_->pipeline_.segments().View(segment));
  return v.epoch;
}
absl::StatusOr<uint64_t> TransferEngine::BatchPeerEngineId(BatchId batch) {
  ASSIGN_OR_RETURN(auto target, impl_->pipeline_.Target(batch));
  return target.second;
}
absl::Status TransferEngine::NotifyAfter(BatchId batch, const std::string& message,
                                         absl::Duration timeout) {
  return impl_->NotifyAfter(batch, message, timeout);
}
absl::Status TransferEngine::PublishMetadata(const std::string& key, std::string value) {
  return impl_->metadata_.Publish(key, std::move(value));
}
absl::StatusOr<std::string> TransferEngine::FetchMetadata(SegmentId segment,
                                                          const std::string& key) {
  return impl_->FetchMetadata(segment, key);
}
absl::StatusOr<std::string> TransferEngine::FetchMetadata(SegmentId segment, const std::string& key,
                                                          absl::Duration timeout) {
  return impl_->FetchMetadata(segment, key, timeout);
}
absl::StatusOr<bool> TransferEngine::ConfirmSent(const std::string& peer, uint64_t engine_id,
                                                 uint64_t digest, absl::Duration timeout) {
  ASSIGN_OR_RETURN(net::HostPort hp, net::ParseHostPort(peer));
  ASSIGN_OR_RETURN(handshake::ConfirmReply r,
                   impl_->client_.Confirm(hp.ToString(), digest, timeout));
  return r.sent && r.engine_id == engine_id;
}
uint64_t TransferEngine::NotificationDigest(absl::string_view message) {
  return engine_internal::NotificationDigest(message);
}

absl::StatusOr<uint64_t> TransferEngine::ProbePeer(const std::string& peer,
                                                   absl::Duration timeout) {
  ASSIGN_OR_RETURN(net::HostPort hp, net::ParseHostPort(peer));
  return impl_->client_.Probe(hp.ToString(), timeout);
}
bool TransferEngine::PeerAnswered(const absl::Status& status) {
  return handshake::PeerAnswered(status);
}
void TransferEngine::FencePeer(uint64_t engine_id, absl::string_view reason) {
  impl_->service_.Fence(engine_id, reason);
}
bool TransferEngine::PeerFenced(uint64_t engine_id) const {
  return impl_->service_.Fenced(engine_id);
}
uint64_t TransferEngine::DataInputsFrom(uint64_t engine_id) const {
  return impl_->service_.InputsFrom(engine_id);
}
bool TransferEngine::HasLinksFrom(uint64_t engine_id, absl::string_view source) const {
  return impl_->service_.HasLinksOf(engine_id, source);
}
void TransferEngine::DropLinksFrom(uint64_t engine_id, absl::string_view source) {
  impl_->service_.CloseLinksOf(engine_id, source);
}
std::vector<Notification> TransferEngine::TakeNotifications() { return impl_->inbox_.TakeAll(); }
std::vector<Notification> TransferEngine::TakeNotifications(const NotificationFilter& which) {
  return impl_->inbox_.TakeAll(which);
}
absl::StatusOr<Notification> TransferEngine::WaitNotification(absl::Duration timeout,
                                                              const NotificationFilter& which) {
  return impl_->inbox_.Next(timeout, which);
}
absl::StatusOr<Notification> TransferEngine::WaitNotification(absl::Duration timeout) {
  return impl_->inbox_.Next(timeout);
}

}  // namespace kvferry
