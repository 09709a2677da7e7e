#include "engine/link_set.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"

namespace kvferry {
namespace engine_internal {

using transport::NicIndex;

namespace {

uint64_t Weight(const transport::NicInfo& a, const transport::NicInfo& b) {
  uint64_t mbps = 0;
  for (uint64_t bits : {a.link_bits_per_sec, b.link_bits_per_sec}) {
    if (bits != 0) mbps = mbps == 0 ? bits / 1000000 : std::min(mbps, bits / 1000000);
  }
  return std::max<uint64_t>(1, mbps);
}

}  // namespace

absl::StatusOr<Link> ConnectLink(transport::Transport* transport, const PeerClient& client,
                                 uint64_t engine_id, const std::string& peer,
                                 const transport::NicInfo& local_nic_info,
                                 const transport::NicInfo& peer_nic_info, Link link) {
  ASSIGN_OR_RETURN(transport::LinkOffer offer,
                   transport->CreateLink(link.local_nic, peer_nic_info));
  absl::StatusOr<std::string> params = client.Connect(
      peer, handshake::ConnectRequest{engine_id, link.local_nic, local_nic_info, link.remote_nic,
                                      offer.params});
  absl::Status done = params.ok() ? transport->CompleteLink(offer.link, *params) : params.status();
  if (!done.ok()) {
    (void)transport->CloseLink(offer.link);
    return done;
  }
  link.id = offer.link;
  link.weight = Weight(local_nic_info, peer_nic_info);
  link.failed = false;
  link.repairing = false;
  link.inflight = 0;
  return link;
}

namespace {

bool Unreachable(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded;
}

}  // namespace

absl::StatusOr<std::vector<Link>> ConnectLinks(transport::Transport* transport,
                                               const PeerClient& client, uint64_t engine_id,
                                               const std::string& peer,
                                               const handshake::EngineDescriptor& d,
                                               uint32_t links_per_peer, absl::Time now) {
  const transport::EndpointDescription local = transport->LocalEndpoint();
  if (d.nics.empty() || local.nics.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("no NICs to reach ", peer, " with"));
  }
  std::vector<Link> links;
  // At least one link per local NIC, so every NIC can carry slices.
  const uint32_t count =
      std::max<uint32_t>({1, links_per_peer, static_cast<uint32_t>(local.nics.size())});
  for (uint32_t k = 0; k < count; ++k) {
    Link link;
    link.remote_nic = k % d.nics.size();
    // The local NIC the host's routes say reaches that peer NIC (verbs with
    // rdma_cm), else the NICs in order.
    absl::StatusOr<NicIndex> routed = transport->RouteTo(d.nics[link.remote_nic]);
    link.local_nic = routed.ok() && *routed < local.nics.size()
                         ? *routed
                         : static_cast<NicIndex>(k % local.nics.size());
    link.progress = now;
    absl::StatusOr<Link> made = ConnectLink(transport, client, engine_id, peer,
                                            local.nics[link.local_nic], d.nics[link.remote_nic],
                                            link);
    if (made.ok()) {
      links.push_back(*made);
      continue;
    }
    const bool unreachable = Unreachable(made.status());
    if (unreachable || k + 1 == count) {
      if (!links.empty() && !unreachable) break;  // keep the NIC pairs that work
      for (const Link& l : links) (void)transport->CloseLink(l.id);
      return Annotate(made.status(), absl::StrCat("connecting to ", peer));
    }
    // One NIC pair failing (a NIC down on either side) must not cost the
    // others: go on without it.
    KVF_LOG(WARNING) << "connecting to " << peer << ": no link from local NIC " << link.local_nic
                     << " to peer NIC " << link.remote_nic << ": " << made.status().message();
  }
  return links;
}

Link* ChooseLink(std::vector<Link>& links, NicMask near, uint32_t capacity) {
  Link* best = nullptr;
  Link* best_far = nullptr;
  for (Link& l : links) {
    if (l.failed || l.inflight >= capacity) continue;
    const bool is_near = near == 0 || (l.local_nic < 64 && (near >> l.local_nic) & 1);
    Link*& slot = is_near ? best : best_far;
    // Fewer in flight per unit of speed: a / wa < b / wb.
    if (slot == nullptr || uint64_t{l.inflight} * slot->weight < uint64_t{slot->inflight} * l.weight) {
      slot = &l;
    }
  }
  return best != nullptr ? best : best_far;
}

}  // namespace engine_internal
}  // namespace kvferry
