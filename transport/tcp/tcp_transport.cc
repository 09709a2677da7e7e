#include "transport/tcp/tcp_transport.h"

#include "transport/kinds.h"
#include "transport/tcp/tcp_transport_internal.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

uint32_t UsableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return static_cast<uint32_t>(CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

absl::Status TcpTransport::Start() {
  ASSIGN_OR_RETURN(listener_, net::Listen(options_.bind_host, options_.port, options_.port_range));
  std::string host = options_.advertise_host;
  if (host.empty()) {
    if (options_.bind_host == "0.0.0.0" || options_.bind_host == "::") {
      return absl::InvalidArgumentError(
          "the TCP transport binds every interface; say which address to "
          "advertise (advertise_host)");
    }
    host = options_.bind_host;
  }
  advertised_ = net::HostPort{host, listener_.address.port()}.ToString();
  if (options_.in_process_shortcut) {
    Shortcuts::Member m;
    m.regions = &regions_;
    m.gate = [this](uint64_t token, bool passive) -> std::shared_ptr<DirectGate> {
      MutexLock lock(&mu_);
      for (const auto& [id, link] : links_) {
        if (link->token == token && link->passive == passive && !link->stopping) return link->gate;
      }
      return nullptr;
    };
    key_ = Shortcuts::Get().Join(std::move(m));
  }
  HelloAcceptorOptions hello;
  hello.secret = options_.secret;
  ASSIGN_OR_RETURN(acceptor_, HelloAcceptor::Start(listener_.fd.get(), hello));
  // A new peer's first links take warm threads instead of starting four.
  threads_.Prestart(options_.warm_threads);
  KVF_LOG(DEBUG) << "tcp transport listening on " << listener_.address.ToString()
                 << ", advertised as " << advertised_;
  return absl::OkStatus();
}

TcpTransport::~TcpTransport() {
  // Waits for peers' shortcut copies into this transport's regions.
  if (key_ != 0) Shortcuts::Get().Leave(key_);
  stopping_ = true;
  acceptor_.reset();
  std::vector<std::shared_ptr<Link>> links;
  {
    MutexLock lock(&mu_);
    for (auto& [id, link] : links_) links.push_back(link);
    links_.clear();
  }
  for (auto& link : links) StopAndJoin(link);
}

EndpointDescription TcpTransport::LocalEndpoint() const {
  EndpointDescription d;
  d.kind = options_.kind;
  NicInfo nic;
  nic.name = options_.kind;
  nic.address = advertised_;
  d.nics.push_back(nic);
  return d;
}

namespace {

absl::StatusOr<net::HostPort> TcpNicAddress(const NicInfo& nic) {
  absl::StatusOr<net::HostPort> peer = net::ParseHostPort(nic.address);
  if (!peer.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a TCP NIC address: ", peer.status().message()));
  }
  return peer;
}

}  // namespace

absl::StatusOr<LinkOffer> TcpTransport::CreateLink(NicIndex local_nic, const NicInfo& peer_nic) {
  RETURN_IF_ERROR(TcpNicAddress(peer_nic).status());
  ASSIGN_OR_RETURN(LinkOffer offer, OfferLink(local_nic));
  if (absl::Status connected = ConnectOffered(offer.link, peer_nic); !connected.ok()) {
    (void)CloseLink(offer.link);
    return connected;
  }
  return offer;
}

absl::StatusOr<LinkOffer> TcpTransport::OfferLink(NicIndex local_nic) {
  if (local_nic != 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", local_nic));
  }
  auto link = std::make_shared<Link>();
  link->token = net::RandomU64();
  if (key_ != 0) link->gate = std::make_shared<DirectGate>();
  MutexLock lock(&mu_);
  if (links_.size() >= options_.max_links) return TooManyLinks();
  link->id = ++last_link_;
  links_[link->id] = link;
  return LinkOffer{link->id,
                   EncodeLinkParams(link->token, key_, refs_.host(), refs_.word(), options_.kind)};
}

absl::Status TcpTransport::ConnectOffered(LinkId id, const NicInfo& peer_nic) {
  ASSIGN_OR_RETURN(net::HostPort peer, TcpNicAddress(peer_nic));
  uint64_t token = 0;
  {
    MutexLock lock(&mu_);
    auto it = links_.find(id);
    if (it == links_.end()) return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
    const Link& link = *it->second;
    if (link.passive || link.state != Link::State::kPending || link.fd.valid()) {
      return absl::FailedPreconditionError(absl::StrCat("link ", id, " is already connected"));
    }
    token = link.token;
  }
  ASSIGN_OR_RETURN(net::Fd fd, net::Connect(peer, options_.connect_timeout));
  RETURN_IF_ERROR(net::SetNoDelay(fd.get()));
  RETURN_IF_ERROR(net::SetKeepAlive(fd.get(), options_.dead_peer_timeout));
  const std::string hello = EncodeHello(token, options_.secret);
  RETURN_IF_ERROR(
      net::WriteFull(fd.get(), hello.data(), hello.size(), absl::Now() + options_.connect_timeout));
  return Install(id, std::move(fd));
}

absl::Status TcpTransport::Install(LinkId id, net::Fd fd) {
  MutexLock lock(&mu_);
  auto it = links_.find(id);
  if (it == links_.end() || it->second->stopping || it->second->fd.valid()) {
    return absl::CancelledError(absl::StrCat("link ", id, " was closed meanwhile"));
  }
  it->second->fd = std::move(fd);
  return absl::OkStatus();
}

absl::Status TcpTransport::AdoptConnection(LinkId id, net::Fd connection) {
  uint64_t token = 0;
  bool passive = false;
  {
    MutexLock lock(&mu_);
    auto it = links_.find(id);
    if (it == links_.end()) return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
    const Link& link = *it->second;
    if (link.state != (link.passive ? Link::State::kReady : Link::State::kPending) ||
        link.fd.valid() || link.stopping) {
      return absl::FailedPreconditionError(absl::StrCat("link ", id, " is already connected"));
    }
    token = link.token;
    passive = link.passive;
  }
  RETURN_IF_ERROR(net::SetBlocking(connection.get()));  // the link threads block
  // An accepted link waits for its connection at the data port (AcceptLink).
  if (passive) return Annotate(acceptor_->Deliver(token, std::move(connection)), "AdoptConnection");
  RETURN_IF_ERROR(net::SetNoDelay(connection.get()));
  RETURN_IF_ERROR(net::SetKeepAlive(connection.get(), options_.dead_peer_timeout));
  return Install(id, std::move(connection));
}

absl::StatusOr<LinkOffer> TcpTransport::AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                                   absl::string_view peer_params) {
  (void)peer_nic;
  if (local_nic != 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", local_nic));
  }
  absl::StatusOr<PeerParams> params = DecodeLinkParams(peer_params, options_.kind);
  if (!params.ok()) return Annotate(params.status(), "AcceptLink");
  RETURN_IF_ERROR(Annotate(refs_.CheckPeer(params->host), "AcceptLink"));
  const uint64_t token = params->token;
  ReapDeadPassiveLinks();
  auto link = std::make_shared<Link>();
  if (key_ != 0) {
    link->gate = std::make_shared<DirectGate>();
    link->peer_gate = Shortcuts::Get().GateOf(params->key, token, /*passive=*/false);
    if (link->peer_gate != nullptr) link->peer_key = params->key;
  }
  {
    MutexLock lock(&mu_);
    if (links_.size() >= options_.max_links) return TooManyLinks();
    link->token = token;
    link->id = ++last_link_;
    link->state = Link::State::kReady;
    link->passive = true;
    link->share = refs_.Learn(params->host, params->share);
    links_[link->id] = link;
  }
  // Never waits: the requester sent its hello before asking, so the
  // connection is usually in; if not, it is attached when it arrives, and
  // the link ends if it does not come within the connect timeout.
  std::weak_ptr<Link> later = link;
  absl::StatusOr<net::Fd> fd = acceptor_->ClaimOrAwait(
      token, absl::Now() + options_.connect_timeout, [this, later](absl::StatusOr<net::Fd> fd) {
        if (std::shared_ptr<Link> l = later.lock()) (void)Attach(l, std::move(fd));
      });
  absl::Status attached = !fd.ok()      ? fd.status()
                          : fd->valid() ? Attach(link, std::move(*fd))
                                        : absl::OkStatus();
  if (!attached.ok()) {
    MutexLock lock(&mu_);
    links_.erase(link->id);
    return Annotate(attached, "AcceptLink");
  }
  return LinkOffer{link->id,
                   EncodeLinkParams(token, key_, refs_.host(), refs_.word(), options_.kind)};
}

absl::Status TcpTransport::Attach(const std::shared_ptr<Link>& link, absl::StatusOr<net::Fd> fd) {
  {
    MutexLock lock(&mu_);
    if (!fd.ok() || link->stopping) {
      // No reader will run: gone for its peer; what was posted on it fails.
      if (!fd.ok()) FailLink(*link, fd.status(), 0);
      link->reader_done = true;
      return fd.ok() ? absl::CancelledError("the link was closed") : fd.status();
    }
    link->fd = std::move(*fd);
    link->attaching = true;
  }
  (void)net::SetNoDelay(link->fd.get());
  (void)net::SetKeepAlive(link->fd.get(), options_.dead_peer_timeout);
  absl::Status started = StartLinkThreads(link);
  MutexLock lock(&mu_);
  link->attaching = false;
  if (!started.ok()) {
    FailLink(*link, started, 0);
    link->reader_done = true;
  }
  link->cv.SignalAll();
  return started;
}

absl::Status TcpTransport::CompleteLink(LinkId id, absl::string_view peer_params) {
  // The link's state is checked before and again after the parameters are
  // read and the peer's gate looked up (GateOf takes a peer's mu_, maybe
  // this one's, so not under mu_).
  auto usable = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<std::shared_ptr<Link>> {
    auto it = links_.find(id);
    if (it == links_.end()) return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
    if (it->second->state != Link::State::kPending) {
      return absl::FailedPreconditionError(absl::StrCat("link ", id, " is already complete"));
    }
    if (!it->second->fd.valid()) {
      return absl::FailedPreconditionError(
          absl::StrCat("link ", id, " has no connection yet (ConnectOffered first)"));
    }
    return it->second;
  };
  {
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(usable().status());
  }
  absl::StatusOr<PeerParams> params = DecodeLinkParams(peer_params, options_.kind);
  if (!params.ok()) return Annotate(params.status(), "CompleteLink");
  RETURN_IF_ERROR(Annotate(refs_.CheckPeer(params->host), "CompleteLink"));
  std::shared_ptr<DirectGate> peer_gate =
      key_ != 0 ? Shortcuts::Get().GateOf(params->key, params->token, /*passive=*/true) : nullptr;
  std::shared_ptr<Link> link;
  {
    MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(link, usable());
    if (params->token != link->token) {
      return absl::InvalidArgumentError("CompleteLink: the peer answered for another link");
    }
    link->state = Link::State::kReady;
    if (peer_gate != nullptr) {
      link->peer_key = params->key;
      link->peer_gate = std::move(peer_gate);
    }
    link->share = refs_.Learn(params->host, params->share);
  }
  if (absl::Status started = StartLinkThreads(link); !started.ok()) {
    MutexLock lock(&mu_);
    links_.erase(link->id);
    return started;
  }
  return absl::OkStatus();
}

absl::Status TcpTransport::StartLinkThreads(const std::shared_ptr<Link>& link) {
  absl::StatusOr<ThreadCache::Task> reader = threads_.Run([this, link] { ReaderLoop(link); });
  absl::StatusOr<ThreadCache::Task> writer =
      reader.ok() ? threads_.Run([this, link] { WriterLoop(link); }) : reader;
  if (reader.ok()) link->reader = std::move(*reader);
  if (writer.ok()) {
    link->writer = std::move(*writer);
    return absl::OkStatus();
  }
  // Whatever started sees the link stopping and returns; the link fails.
  {
    MutexLock lock(&mu_);
    link->stopping = true;
    link->cv.SignalAll();
  }
  ::shutdown(link->fd.get(), SHUT_RDWR);
  return writer.status();
}

void TcpTransport::ReapDeadPassiveLinks() {
  std::vector<std::shared_ptr<Link>> dead;
  {
    MutexLock lock(&mu_);
    for (auto it = links_.begin(); it != links_.end();) {
      const Link& l = *it->second;
      if (l.passive && l.reader_done && l.outstanding.empty()) {
        dead.push_back(it->second);
        links_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (auto& link : dead) StopAndJoin(link);
}

void TcpTransport::StopAndJoin(const std::shared_ptr<Link>& link) {
  // A peer's shortcut copies through this link end before this returns.
  if (link->gate != nullptr) link->gate->Close(/*wait=*/true);
  {
    MutexLock lock(&mu_);
    link->stopping = true;
    link->cv.SignalAll();
    while (link->attaching) link->cv.Wait(&mu_);
  }
  ::shutdown(link->fd.get(), SHUT_RDWR);
  link->reader.Join();
  link->writer.Join();
}

bool TcpTransport::HasLink(LinkId id) {
  // A passive link whose reader ended is gone for its peer (it is reaped at
  // the next AcceptLink).
  MutexLock lock(&mu_);
  auto it = links_.find(id);
  return it != links_.end() && !(it->second->passive && it->second->reader_done);
}

uint64_t TcpTransport::InputCount(LinkId id) {
  MutexLock lock(&mu_);
  auto it = links_.find(id);
  if (it == links_.end()) return 0;
  const Link& l = *it->second;
  // Over the socket, and through the shortcut when the peer is in this process.
  return l.inputs.load(std::memory_order_relaxed) + (l.gate != nullptr ? l.gate->entries() : 0);
}

absl::Status TcpTransport::CloseLink(LinkId id) {
  std::shared_ptr<Link> link;
  {
    MutexLock lock(&mu_);
    auto it = links_.find(id);
    if (it == links_.end()) return absl::NotFoundError(absl::StrCat("unknown link ", id));
    link = it->second;
    links_.erase(it);
  }
  // Nothing touches request buffers once both threads are gone.
  StopAndJoin(link);
  MutexLock lock(&mu_);
  WaitLinkIdle(*link);
  link->outstanding.ForEach([&](uint64_t, const WorkRequest& wr) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    CompleteLocked(wr, absl::CancelledError(absl::StrCat("link ", id, " was closed")));
  });
  link->outstanding.Clear();
  WakeWaiters();
  return absl::OkStatus();
}

size_t TcpTransport::PollCompletions(absl::Span<Completion> out) {
  MutexLock lock(&mu_);
  ReaderMutexLock regions(&regions_.mu());
  return cq_.Pop(out, [this](RegionId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (RegionEntry* region = regions_.Find(id)) region->local_uses.fetch_sub(1);
  });
}

size_t TcpTransport::WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) {
  {
    MutexLock lock(&mu_);
    cq_cv_.AwaitWithDeadline(&mu_, FastNow() + timeout, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return !cq_.empty() || interrupted_;
    });
    interrupted_ = false;
  }
  return PollCompletions(out);
}

void TcpTransport::InterruptWait() {
  MutexLock lock(&mu_);
  interrupted_ = true;
  cq_cv_.SignalAll();
}

}  // namespace tcp_internal

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(TcpTransportOptions options) {
  if (options.max_outstanding_per_link == 0 || options.max_request_bytes == 0 ||
      options.max_region_bytes == 0) {
    return absl::InvalidArgumentError("TCP transport limits must be positive");
  }
  if (options.same_host_only && options.host_share == nullptr) {
    return absl::InvalidArgumentError("TcpTransportOptions::same_host_only needs a host_share");
  }
  auto t = std::make_unique<tcp_internal::TcpTransport>(std::move(options));
  RETURN_IF_ERROR(t->Start());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace transport
}  // namespace kvferry
