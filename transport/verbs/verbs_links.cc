// The verbs transport's links: queue pairs created, connected (RTR, RTS),
// closed, and the route to a peer's NIC.
#include <infiniband/verbs.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "net/socket.h"
#include "transport/verbs/ibv.h"
#include "transport/verbs/route.h"
#include "transport/verbs/verbs_transport_internal.h"

namespace kvferry {
namespace transport {
namespace verbs_internal {
namespace {

absl::Status CheckPeerNic(const NicInfo& peer) {
  if (!absl::StartsWith(peer.address, "verbs:")) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a verbs NIC address: '", peer.address, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<VerbsTransport::Link*> VerbsTransport::NewLink(NicIndex n) {
  if (n >= core_.nics.size())
    return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", n));
  if (core_.links.size() >= core_.options.max_links) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this transport has its maximum of ", core_.options.max_links, " links"));
  }
  Nic& nic = core_.nics[n];
  RETURN_IF_ERROR(ReserveCq(nic, core_.options.max_outstanding_per_link));
  auto link = std::make_unique<Link>();
  link->nic = n;
  link->cq_entries = core_.options.max_outstanding_per_link;
  link->reserved_in = &nic.cq_reserved;  // released when the link goes
  ASSIGN_OR_RETURN(link->qp, NewQp(nic, core_.options.max_outstanding_per_link,
                                   core_.options.max_inline_bytes, &link->max_inline));
  link->id = ++last_link_;
  link->psn = static_cast<uint32_t>(net::RandomU64()) & 0xffffff;
  link->posted.resize(core_.options.max_outstanding_per_link);
  Link* raw = link.get();
  core_.by_qp[QpKey(n, raw->qp->qp_num)] = raw;
  core_.links.emplace(raw->id, std::move(link));
  return raw;
}

absl::Status VerbsTransport::Connect(Link& link, const Params& peer) {
  const Nic& nic = core_.nics[link.nic];
  RETURN_IF_ERROR(ToRtr(nic, link.qp.get(), peer));
  RETURN_IF_ERROR(
      ToRts(nic, link.qp.get(), link.psn, core_.options.timeout, core_.options.retry_count));
  link.state = Link::State::kReady;
  return absl::OkStatus();
}

absl::StatusOr<NicIndex> VerbsTransport::RouteTo(const NicInfo& peer_nic) {
  RETURN_IF_ERROR(CheckPeerNic(peer_nic));
  const std::string gid = peer_nic.address.substr(6, peer_nic.address.find('/') - 6);
  const std::string ip = verbs::Ipv4OfGid(gid);
  if (ip.empty()) {
    return absl::UnimplementedError(
        absl::StrCat("peer GID ", gid, " carries no IPv4 address to route to"));
  }
  MutexLock lock(&route_mu_);  // one resolution per peer address at a time
  const absl::Time now = FastNow();
  if (const absl::StatusOr<uint32_t>* cached = routes_.Find(ip, now)) return *cached;
  absl::StatusOr<NicIndex> answer = [&]() -> absl::StatusOr<NicIndex> {
    ASSIGN_OR_RETURN(verbs::Route route, verbs::ResolveRoute(ip));
    std::vector<verbs::SelectedPort> ports;
    for (const Nic& nic : core_.nics) ports.push_back(nic.port);
    ASSIGN_OR_RETURN(size_t index, verbs::PortForRoute(route, ports));
    KVF_LOG(INFO) << "verbs: rdma_cm routes " << ip << " via " << route.device << ":" << route.port
                  << " from " << route.source_ip;
    return static_cast<NicIndex>(index);
  }();
  if (!answer.ok()) {
    KVF_LOG(INFO) << "verbs: no route-aware pairing for " << ip << " (" << answer.status().message()
                  << "); pairing NICs in order";
  }
  routes_.Put(ip, answer, now);
  return answer;
}

absl::StatusOr<LinkOffer> VerbsTransport::CreateLink(NicIndex local_nic, const NicInfo& peer_nic) {
  RETURN_IF_ERROR(CheckPeerNic(peer_nic));
  MutexLock lock(&core_.mu);
  ASSIGN_OR_RETURN(Link * link, NewLink(local_nic));
  return LinkOffer{link->id,
                   EncodeParams(LocalParams(core_.nics[link->nic], *link->qp, link->psn))};
}

absl::StatusOr<LinkOffer> VerbsTransport::AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                                     absl::string_view peer_params) {
  RETURN_IF_ERROR(CheckPeerNic(peer_nic));
  absl::StatusOr<Params> decoded = DecodeParams(peer_params);
  if (!decoded.ok()) return Annotate(decoded.status(), "AcceptLink");
  const Params& peer = *decoded;
  MutexLock lock(&core_.mu);
  ASSIGN_OR_RETURN(Link * link, NewLink(local_nic));
  absl::Status ready = Connect(*link, peer);
  if (!ready.ok()) {
    core_.by_qp.erase(QpKey(link->nic, link->qp->qp_num));
    core_.links.erase(link->id);  // destroys the QP
    return ready;
  }
  return LinkOffer{link->id,
                   EncodeParams(LocalParams(core_.nics[link->nic], *link->qp, link->psn))};
}

absl::Status VerbsTransport::CompleteLink(LinkId id, absl::string_view peer_params) {
  MutexLock lock(&core_.mu);
  auto it = core_.links.find(id);
  if (it == core_.links.end()) return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
  Link& link = *it->second;
  if (link.state != Link::State::kPending) {
    return absl::FailedPreconditionError(absl::StrCat("link ", id, " is already complete"));
  }
  absl::StatusOr<Params> decoded = DecodeParams(peer_params);
  if (!decoded.ok()) return Annotate(decoded.status(), "CompleteLink");
  const Params& peer = *decoded;
  return Connect(link, peer);
}

absl::Status VerbsTransport::CloseLink(LinkId id) {
  MutexLock lock(&core_.mu);
  auto it = core_.links.find(id);
  if (it == core_.links.end()) return absl::NotFoundError(absl::StrCat("unknown link ", id));
  // The NIC stops touching request buffers once the QP is destroyed; its
  // requests are reported cancelled now and late completions are ignored.
  Link& link = *it->second;
  core_.by_qp.erase(QpKey(link.nic, link.qp->qp_num));
  link.qp.reset();
  while (link.count > 0) {
    Posted p = link.Pop();
    if (p.done) continue;
    core_.CompleteLocked(p.wr, absl::CancelledError(absl::StrCat("link ", id, " was closed")));
  }
  core_.links.erase(it);
  return absl::OkStatus();
}

}  // namespace verbs_internal
}  // namespace transport
}  // namespace kvferry
