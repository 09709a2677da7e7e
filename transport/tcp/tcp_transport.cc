#include "transport/tcp/tcp_transport.h"

#include <poll.h>
#include <sys/eventfd.h>

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
  ASSIGN_OR_RETURN(listener_, net::Listen(core_.options.bind_host, core_.options.port,
                                          core_.options.port_range));
  std::string host = core_.options.advertise_host;
  if (host.empty()) {
    if (core_.options.bind_host == "0.0.0.0" || core_.options.bind_host == "::") {
      return absl::InvalidArgumentError(
          "the TCP transport binds every interface; say which address to "
          "advertise (advertise_host)");
    }
    host = core_.options.bind_host;
  }
  advertised_ = net::HostPort{host, listener_.address.port()}.ToString();
  // Without it waiters never read links themselves (Link::park).
  core_.wake_fd = net::Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (core_.options.in_process_shortcut) {
    Shortcuts::Member m;
    m.regions = &core_.regions;
    m.gate = [this](uint64_t token, bool passive) -> std::shared_ptr<DirectGate> {
      MutexLock lock(&core_.mu);
      for (const auto& [id, link] : core_.links) {
        if (link->token == token && link->passive == passive && !link->stopping) return link->gate;
      }
      return nullptr;
    };
    core_.key = Shortcuts::Get().Join(std::move(m));
  }
  HelloAcceptorOptions hello;
  hello.secret = core_.options.secret;
  ASSIGN_OR_RETURN(acceptor_, HelloAcceptor::Start(listener_.fd.get(), hello));
  // A new peer's first links take warm threads instead of starting four.
  threads_.Prestart(core_.options.warm_threads);
  KVF_LOG(DEBUG) << "tcp transport listening on " << listener_.address.ToString()
                 << ", advertised as " << advertised_;
  return absl::OkStatus();
}

TcpTransport::~TcpTransport() {
  // Waits for peers' shortcut copies into this transport's regions.
  if (core_.key != 0) Shortcuts::Get().Leave(core_.key);
  acceptor_.reset();
  std::vector<std::shared_ptr<Link>> links;
  {
    MutexLock lock(&core_.mu);
    for (auto& [id, link] : core_.links) links.push_back(link);
    core_.links.clear();
  }
  for (auto& link : links) threads_.StopAndJoin(link);
}

EndpointDescription TcpTransport::LocalEndpoint() const {
  EndpointDescription d;
  d.kind = core_.options.kind;
  NicInfo nic;
  nic.name = core_.options.kind;
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

absl::Status TooManyLinks(size_t max_links) {
  return absl::ResourceExhaustedError(
      absl::StrCat("this transport has its maximum of ", max_links, " links"));
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
  if (core_.key != 0) link->gate = std::make_shared<DirectGate>();
  MutexLock lock(&core_.mu);
  if (core_.links.size() >= core_.options.max_links) return TooManyLinks(core_.options.max_links);
  link->id = ++last_link_;
  core_.links[link->id] = link;
  return LinkOffer{link->id, EncodeLinkParams(link->token, core_.key, core_.refs.host(),
                                              core_.refs.word(), core_.options.kind)};
}

absl::Status TcpTransport::ConnectOffered(LinkId id, const NicInfo& peer_nic) {
  ASSIGN_OR_RETURN(net::HostPort peer, TcpNicAddress(peer_nic));
  uint64_t token = 0;
  {
    MutexLock lock(&core_.mu);
    auto it = core_.links.find(id);
    if (it == core_.links.end())
      return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
    const Link& link = *it->second;
    if (link.passive || link.state != Link::State::kPending || link.fd.valid()) {
      return absl::FailedPreconditionError(absl::StrCat("link ", id, " is already connected"));
    }
    token = link.token;
  }
  ASSIGN_OR_RETURN(net::Fd fd, net::Connect(peer, core_.options.connect_timeout));
  RETURN_IF_ERROR(net::SetNoDelay(fd.get()));
  RETURN_IF_ERROR(net::SetKeepAlive(fd.get(), core_.options.dead_peer_timeout));
  const std::string hello = EncodeHello(token, core_.options.secret);
  RETURN_IF_ERROR(net::WriteFull(fd.get(), hello.data(), hello.size(),
                                 absl::Now() + core_.options.connect_timeout));
  return core_.Install(id, std::move(fd));
}

absl::Status TcpTransport::AdoptConnection(LinkId id, net::Fd connection) {
  uint64_t token = 0;
  bool passive = false;
  {
    MutexLock lock(&core_.mu);
    auto it = core_.links.find(id);
    if (it == core_.links.end())
      return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
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
  RETURN_IF_ERROR(net::SetKeepAlive(connection.get(), core_.options.dead_peer_timeout));
  return core_.Install(id, std::move(connection));
}

absl::StatusOr<LinkOffer> TcpTransport::AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                                   absl::string_view peer_params) {
  (void)peer_nic;
  if (local_nic != 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", local_nic));
  }
  absl::StatusOr<PeerParams> params = DecodeLinkParams(peer_params, core_.options.kind);
  if (!params.ok()) return Annotate(params.status(), "AcceptLink");
  RETURN_IF_ERROR(Annotate(core_.refs.CheckPeer(params->host), "AcceptLink"));
  const uint64_t token = params->token;
  threads_.ReapDeadPassive();
  auto link = std::make_shared<Link>();
  if (core_.key != 0) {
    link->gate = std::make_shared<DirectGate>();
    link->peer_gate = Shortcuts::Get().GateOf(params->key, token, /*passive=*/false);
    if (link->peer_gate != nullptr) link->peer_key = params->key;
  }
  {
    MutexLock lock(&core_.mu);
    if (core_.links.size() >= core_.options.max_links) return TooManyLinks(core_.options.max_links);
    link->token = token;
    link->id = ++last_link_;
    link->state = Link::State::kReady;
    link->passive = true;
    link->share = core_.refs.Learn(params->host, params->share);
    core_.links[link->id] = link;
  }
  // Never waits: the requester sent its hello before asking, so the
  // connection is usually in; if not, it is attached when it arrives, and
  // the link ends if it does not come within the connect timeout.
  std::weak_ptr<Link> later = link;
  absl::StatusOr<net::Fd> fd =
      acceptor_->ClaimOrAwait(token, absl::Now() + core_.options.connect_timeout,
                              [this, later](absl::StatusOr<net::Fd> fd) {
                                if (std::shared_ptr<Link> l = later.lock())
                                  (void)threads_.Attach(l, std::move(fd));
                              });
  absl::Status attached = !fd.ok()      ? fd.status()
                          : fd->valid() ? threads_.Attach(link, std::move(*fd))
                                        : absl::OkStatus();
  if (!attached.ok()) {
    MutexLock lock(&core_.mu);
    core_.links.erase(link->id);
    return Annotate(attached, "AcceptLink");
  }
  return LinkOffer{link->id, EncodeLinkParams(token, core_.key, core_.refs.host(),
                                              core_.refs.word(), core_.options.kind)};
}

absl::Status TcpTransport::CompleteLink(LinkId id, absl::string_view peer_params) {
  // The link's state is checked before and again after the parameters are
  // read and the peer's gate looked up (GateOf takes a peer's core_.mu, maybe
  // this one's, so not under core_.mu).
  auto usable =
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu) -> absl::StatusOr<std::shared_ptr<Link>> {
    auto it = core_.links.find(id);
    if (it == core_.links.end())
      return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
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
    MutexLock lock(&core_.mu);
    RETURN_IF_ERROR(usable().status());
  }
  absl::StatusOr<PeerParams> params = DecodeLinkParams(peer_params, core_.options.kind);
  if (!params.ok()) return Annotate(params.status(), "CompleteLink");
  RETURN_IF_ERROR(Annotate(core_.refs.CheckPeer(params->host), "CompleteLink"));
  std::shared_ptr<DirectGate> peer_gate =
      core_.key != 0 ? Shortcuts::Get().GateOf(params->key, params->token, /*passive=*/true)
                     : nullptr;
  std::shared_ptr<Link> link;
  {
    MutexLock lock(&core_.mu);
    ASSIGN_OR_RETURN(link, usable());
    if (params->token != link->token) {
      return absl::InvalidArgumentError("CompleteLink: the peer answered for another link");
    }
    link->state = Link::State::kReady;
    if (peer_gate != nullptr) {
      link->peer_key = params->key;
      link->peer_gate = std::move(peer_gate);
    }
    link->share = core_.refs.Learn(params->host, params->share);
  }
  if (absl::Status started = threads_.Start(link); !started.ok()) {
    MutexLock lock(&core_.mu);
    core_.links.erase(link->id);
    return started;
  }
  return absl::OkStatus();
}

bool TcpTransport::HasLink(LinkId id) {
  // A passive link whose reader ended is gone for its peer (it is reaped at
  // the next AcceptLink).
  MutexLock lock(&core_.mu);
  auto it = core_.links.find(id);
  return it != core_.links.end() && !(it->second->passive && it->second->reader_done);
}

uint64_t TcpTransport::InputCount(LinkId id) {
  MutexLock lock(&core_.mu);
  auto it = core_.links.find(id);
  if (it == core_.links.end()) return 0;
  const Link& l = *it->second;
  // Over the socket, and through the shortcut when the peer is in this process.
  return l.inputs.load(std::memory_order_relaxed) + (l.gate != nullptr ? l.gate->entries() : 0);
}

absl::Status TcpTransport::CloseLink(LinkId id) {
  std::shared_ptr<Link> link;
  {
    MutexLock lock(&core_.mu);
    auto it = core_.links.find(id);
    if (it == core_.links.end()) return absl::NotFoundError(absl::StrCat("unknown link ", id));
    link = it->second;
    core_.links.erase(it);
  }
  // Nothing touches request buffers once both threads are gone.
  threads_.StopAndJoin(link);
  MutexLock lock(&core_.mu);
  core_.WaitLinkIdle(*link);
  link->outstanding.ForEach([&](uint64_t, const WorkRequest& wr) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    core_.Complete(wr, absl::CancelledError(absl::StrCat("link ", id, " was closed")));
  });
  link->outstanding.Clear();
  core_.WakeWaiters();
  return absl::OkStatus();
}

size_t TcpTransport::PollCompletions(absl::Span<Completion> out) {
  MutexLock lock(&core_.mu);
  return PopLocked(out);
}

size_t TcpTransport::PopLocked(absl::Span<Completion> out) {
  if (core_.cq.empty()) return 0;
  ReaderMutexLock regions(&core_.regions.mu());
  // A run of completions from one region (a batch's, mostly) looks it up
  // and releases its uses once.
  RegionId run_id = 0;
  RegionTable::Entry* run = nullptr;
  uint64_t uses = 0;
  const size_t n =
      core_.cq.Pop(out, [&](RegionId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {  // regions.mu() held
        if (run == nullptr || id != run_id) {
          if (run != nullptr) run->local_uses.fetch_sub(uses);
          run = core_.regions.Find(id);
          run_id = id;
          uses = 0;
        }
        ++uses;
      });
  if (run != nullptr) run->local_uses.fetch_sub(uses);
  return n;
}

size_t TcpTransport::WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) {
  // The links a turn polled: let go after the lock (the last reference to
  // a link closed meanwhile destroys it).
  std::shared_ptr<Link> polled[kMaxPolled];
  // What arrived is taken under the same lock the wait ended with.
  MutexLock lock(&core_.mu);
  const absl::Time deadline = FastNow() + timeout;
  auto readable = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (const std::shared_ptr<Link>& link : core_.parked) {
      if (Claimable(*link)) return true;
    }
    return false;
  };
  while (core_.cq.empty() && !core_.interrupted) {
    if (readable()) {
      ReadParkedLocked(deadline, polled);
    } else {
      ++core_.cq_waiters;
      core_.cq_cv.AwaitWithDeadline(&core_.mu, deadline, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return !core_.cq.empty() || core_.interrupted || readable();
      });
      --core_.cq_waiters;
    }
    if (core_.cq.empty() && FastNow() >= deadline) break;
  }
  core_.interrupted = false;
  return PopLocked(out);
}

void TcpTransport::ReadParkedLocked(absl::Time deadline,
                                    std::shared_ptr<Link> (&links)[kMaxPolled]) {
  pollfd fds[kMaxPolled + 1];
  Link* chosen[kMaxPolled];
  nfds_t n = 0;
  // A small run was last on one of them, and no other thread waits (the
  // CPU a poll keeps busy may be the one they need).
  bool spin = false;
  for (const std::shared_ptr<Link>& link : core_.parked) {
    if (n == kMaxPolled) break;
    if (!Claimable(*link)) continue;
    // Held in `links` for the whole wait: a slot is never reassigned here,
    // where letting a link go could destroy it under the lock.
    size_t slot = 0;
    while (slot < kMaxPolled && links[slot] != nullptr && links[slot] != link) ++slot;
    if (slot == kMaxPolled) continue;  // the next wait polls it
    if (links[slot] == nullptr) links[slot] = link;
    link->waiter_reading = true;
    link->read_in_turn = true;
    spin = spin || link->spin;
    fds[n] = {link->fd.get(), POLLIN, 0};
    chosen[n++] = link.get();
  }
  fds[n] = {core_.wake_fd.get(), POLLIN, 0};
  ++core_.pollers;
  core_.waiter_turns += n;
  spin = spin && core_.cq_waiters == 0;
  core_.mu.Unlock();
  const absl::Duration left = std::max(deadline - FastNow(), absl::ZeroDuration());
  int ready = 0;
  if (spin && left > absl::ZeroDuration()) {
    ++core_.spin_waits;
    timespec now{0, 0};
    for (int i = 0; i < kSpinPolls && ready == 0; ++i) ready = ::ppoll(fds, n + 1, &now, nullptr);
  }
  if (ready <= 0) {
    timespec ts = absl::ToTimespec(std::min(left, absl::Hours(1)));
    ready = ::ppoll(fds, n + 1, &ts, nullptr);
  }
  // Before delivering: this thread's own completions wake no poller.
  --core_.pollers;
  if (ready > 0 && fds[n].revents != 0) {
    uint64_t count;
    (void)!::read(core_.wake_fd.get(), &count, sizeof count);
  }
  bool give_back[kMaxPolled] = {};
  absl::Status errors[kMaxPolled];
  for (nfds_t i = 0; i < n && ready > 0; ++i) {
    if (fds[i].revents != 0) give_back[i] = !requester_.TakeAcks(*chosen[i], &errors[i]);
    if (give_back[i]) ++core_.turns_given_back;
  }
  core_.mu.Lock();
  for (nfds_t i = 0; i < n; ++i) {
    Link& link = *chosen[i];
    link.waiter_reading = false;
    if (give_back[i]) {
      link.park = false;
      link.handed_error = std::move(errors[i]);
    }
    if (!link.park || link.stopping) link.reader_cv.Signal();
  }
  // Another waiter may read what this one leaves.
  if (core_.cq_waiters > 0) core_.cq_cv.SignalAll();
}

void TcpTransport::InterruptWait() {
  MutexLock lock(&core_.mu);
  core_.interrupted = true;
  core_.cq_cv.SignalAll();
  core_.WakePollers();
}

}  // namespace tcp_internal

TcpWaiterReads GetTcpWaiterReads(Transport& transport) {
  auto* tcp = static_cast<tcp_internal::TcpTransport*>(
      transport.QueryExtension(tcp_internal::TcpTransport::kSelf));
  if (tcp == nullptr) return {};
  return tcp->waiter_reads();
}

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
