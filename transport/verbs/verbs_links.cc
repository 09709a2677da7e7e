// The verbs transport's links: queue pairs created, connected (RTR, RTS),
// closed, and the route to a peer's NIC.
#include "transport/verbs/verbs_transport_internal.h"

#include <infiniband/verbs.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "net/socket.h"
#include "transport/verbs/ibv.h"
#include "transport/verbs/route.h"

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

absl::Status VerbsTransport::ReserveCq(Nic& nic, uint32_t entries) {
  const uint64_t need = uint64_t{nic.cq_reserved} + entries;
  if (need > nic.cq_capacity) {
    const uint64_t want = std::min<uint64_t>(std::max<uint64_t>(need, 2 * nic.cq_capacity),
                                             static_cast<uint64_t>(std::max(nic.max_cqe, 0)));
    if (want < need) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s: a new link needs %u more completion queue entries; %u are in use and the device "
          "allows %d (fewer links, or a smaller max_outstanding_per_link)",
          nic.port.device, entries, nic.cq_reserved, nic.max_cqe));
    }
    // Under the transport's lock, which Drain polls under too.
    RETURN_IF_ERROR(ibv::ResizeCq(nic.cq.get(), static_cast<int>(want), nic.port.device));
    nic.cq_capacity = static_cast<uint32_t>(nic.cq->cqe);
  }
  nic.cq_reserved += entries;
  return absl::OkStatus();
}

absl::StatusOr<VerbsTransport::Link*> VerbsTransport::NewLink(NicIndex n) {
  if (n >= nics_.size()) return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", n));
  if (links_.size() >= options_.max_links) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this transport has its maximum of ", options_.max_links, " links"));
  }
  Nic& nic = nics_[n];
  RETURN_IF_ERROR(ReserveCq(nic, options_.max_outstanding_per_link));
  auto link = std::make_unique<Link>();
  link->nic = n;
  link->cq_entries = options_.max_outstanding_per_link;
  link->reserved_in = &nic.cq_reserved;  // released when the link goes
  ibv_qp_init_attr init{};
  init.send_cq = nic.cq.get();
  init.recv_cq = nic.cq.get();
  init.cap.max_send_wr = options_.max_outstanding_per_link;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = options_.max_inline_bytes;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signaling: see Link::posted
  ASSIGN_OR_RETURN(link->qp, ibv::CreateQp(nic.pd.get(), &init, nic.port.device));
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = nic.port.port;
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  RETURN_IF_ERROR(ibv::ModifyQp(
      link->qp.get(), &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
      absl::StrFormat("modify QP %#x to INIT (port %u)", link->qp->qp_num, nic.port.port)));
  link->id = ++last_link_;
  link->max_inline = std::min(init.cap.max_inline_data, options_.max_inline_bytes);
  link->psn = static_cast<uint32_t>(net::RandomU64()) & 0xffffff;
  link->posted.resize(options_.max_outstanding_per_link);
  Link* raw = link.get();
  by_qp_[QpKey(n, raw->qp->qp_num)] = raw;
  links_.emplace(raw->id, std::move(link));
  return raw;
}

Params VerbsTransport::LocalParams(const Link& link) const {
  const Nic& nic = nics_[link.nic];
  Params p;
  p.qpn = link.qp->qp_num;
  p.psn = link.psn;
  p.lid = nic.attr.lid;
  std::memcpy(p.gid, nic.gid.raw, 16);
  p.mtu = nic.attr.active_mtu;
  return p;
}

absl::Status VerbsTransport::ToRtr(Link& link, const Params& peer) {
  const Nic& nic = nics_[link.nic];
  ibv_gid dgid;
  std::memcpy(dgid.raw, peer.gid, 16);
  const ibv_mtu mtu = static_cast<ibv_mtu>(std::min<uint32_t>(peer.mtu, nic.attr.active_mtu));
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = mtu;
  attr.dest_qp_num = peer.qpn;
  attr.rq_psn = peer.psn;
  attr.max_dest_rd_atomic = nic.max_rd_atomic;
  attr.min_rnr_timer = 12;
  attr.ah_attr.is_global = 1;
  attr.ah_attr.grh.dgid = dgid;
  attr.ah_attr.grh.sgid_index = nic.port.gid_index;
  attr.ah_attr.grh.hop_limit = 64;
  attr.ah_attr.dlid = peer.lid;
  attr.ah_attr.port_num = nic.port.port;
  return ibv::ModifyQp(link.qp.get(), &attr,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                       absl::StrFormat("modify QP %#x to RTR (peer QP %#x, gid %s, mtu %d)",
                                       link.qp->qp_num, peer.qpn, GidText(dgid), MtuBytes(mtu)));
}

absl::Status VerbsTransport::ToRts(Link& link) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = options_.timeout;
  attr.retry_cnt = options_.retry_count;
  attr.rnr_retry = 7;
  attr.sq_psn = link.psn;
  attr.max_rd_atomic = nics_[link.nic].max_rd_atomic;
  RETURN_IF_ERROR(ibv::ModifyQp(link.qp.get(), &attr,
                                 IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
                                 absl::StrFormat("modify QP %#x to RTS", link.qp->qp_num)));
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
    for (const Nic& nic : nics_) ports.push_back(nic.port);
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
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Link * link, NewLink(local_nic));
  return LinkOffer{link->id, EncodeParams(LocalParams(*link))};
}

absl::StatusOr<LinkOffer> VerbsTransport::AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                                     absl::string_view peer_params) {
  RETURN_IF_ERROR(CheckPeerNic(peer_nic));
  absl::StatusOr<Params> decoded = DecodeParams(peer_params);
  if (!decoded.ok()) return Annotate(decoded.status(), "AcceptLink");
  const Params& peer = *decoded;
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Link * link, NewLink(local_nic));
  absl::Status ready = ToRtr(*link, peer);
  if (ready.ok()) ready = ToRts(*link);
  if (!ready.ok()) {
    by_qp_.erase(QpKey(link->nic, link->qp->qp_num));
    links_.erase(link->id);  // destroys the QP
    return ready;
  }
  return LinkOffer{link->id, EncodeParams(LocalParams(*link))};
}

absl::Status VerbsTransport::CompleteLink(LinkId id, absl::string_view peer_params) {
  MutexLock lock(&mu_);
  auto it = links_.find(id);
  if (it == links_.end()) return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
  Link& link = *it->second;
  if (link.state != Link::State::kPending) {
    return absl::FailedPreconditionError(absl::StrCat("link ", id, " is already complete"));
  }
  absl::StatusOr<Params> decoded = DecodeParams(peer_params);
  if (!decoded.ok()) return Annotate(decoded.status(), "CompleteLink");
  const Params& peer = *decoded;
  RETURN_IF_ERROR(ToRtr(link, peer));
  return ToRts(link);
}

absl::Status VerbsTransport::CloseLink(LinkId id) {
  MutexLock lock(&mu_);
  auto it = links_.find(id);
  if (it == links_.end()) return absl::NotFoundError(absl::StrCat("unknown link ", id));
  // The NIC stops touching request buffers once the QP is destroyed; its
  // requests are reported cancelled now and late completions are ignored.
  Link& link = *it->second;
  by_qp_.erase(QpKey(link.nic, link.qp->qp_num));
  link.qp.reset();
  while (link.count > 0) {
    Posted p = link.Pop();
    if (p.done) continue;
    CompleteLocked(p.wr, absl::CancelledError(absl::StrCat("link ", id, " was closed")));
  }
  links_.erase(it);
  return absl::OkStatus();
}


}  // namespace verbs_internal
}  // namespace transport
}  // namespace kvferry
