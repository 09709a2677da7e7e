#include "transport/sim/sim_transport.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "transport/checks.h"
#include "transport/kinds.h"
#include "transport/link_params.h"
#include "transport/sim/sim_transport_internal.h"

namespace kvferry {
namespace transport {

using sim_internal::Link;
using sim_internal::RegionState;
using sim_internal::SimCore;
using sim_internal::SimRequester;
using sim_internal::SimResponder;

using sim::SimTime;

namespace {

constexpr absl::string_view kAddressPrefix = "sim-nic:";

// As transport/link_params.h encodes them.
enum : uint8_t { kQpnField = 1, kNicField = 2 };

std::string EncodeParams(uint64_t qpn, sim::NicId nic) {
  return LinkParams(kind::kSim).Put(kQpnField, qpn).Put(kNicField, nic).Encode();
}

bool DecodeParams(absl::string_view in, uint64_t* qpn, sim::NicId* nic) {
  absl::StatusOr<LinkParams> p = LinkParams::Decode(in, kind::kSim);
  if (!p.ok()) return false;
  absl::StatusOr<uint64_t> q = p->Get(kQpnField, "QP number");
  absl::StatusOr<uint64_t> n = p->Get(kNicField, "NIC");
  if (!q.ok() || !n.ok() || *q == 0 || *n > UINT32_MAX) return false;
  *qpn = *q;
  *nic = static_cast<sim::NicId>(*n);
  return true;
}

absl::StatusOr<sim::NicId> ParsePeerNic(const sim::Fabric& fabric, const NicInfo& peer_nic) {
  absl::string_view addr = peer_nic.address;
  uint32_t nic;
  if (!absl::ConsumePrefix(&addr, kAddressPrefix) || !absl::SimpleAtoi(addr, &nic) ||
      !fabric.topology().HasNic(nic)) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a sim NIC address: '", peer_nic.address, "'"));
  }
  return nic;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SimTransport>> SimTransport::Create(sim::Fabric* fabric,
                                                                   SimTransportOptions options,
                                                                   uint64_t seed) {
  if (fabric == nullptr) return absl::InvalidArgumentError("no fabric");
  if (options.nics.empty()) {
    return absl::InvalidArgumentError("a sim transport needs at least one NIC");
  }
  if (!options.numa_nodes.empty() && options.numa_nodes.size() != options.nics.size()) {
    return absl::InvalidArgumentError("numa_nodes must be empty or name one node per NIC");
  }
  for (sim::NicId nic : options.nics) {
    if (!fabric->topology().HasNic(nic)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown fabric NIC ", nic));
    }
    if (fabric->topology().node_of(nic) != fabric->topology().node_of(options.nics[0])) {
      return absl::InvalidArgumentError("all NICs of a sim transport must be on one node");
    }
  }
  if (options.max_outstanding_per_link == 0 || options.max_request_bytes == 0 ||
      options.max_region_bytes == 0 || options.ack_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("limits and ack_timeout of a sim transport must be positive");
  }
  return std::unique_ptr<SimTransport>(new SimTransport(fabric, std::move(options), seed));
}

SimTransport::SimTransport(sim::Fabric* fabric, SimTransportOptions options, uint64_t seed)
    : core_(std::make_unique<SimCore>(fabric, std::move(options), seed)),
      requester_(std::make_unique<SimRequester>(*core_)),
      responder_(std::make_unique<SimResponder>(*core_)) {
  for (NicIndex i = 0; i < core_->options.nics.size(); ++i) {
    core_->fabric->Attach(core_->options.nics[i],
                          [this, i](sim::Message&& msg) { OnMessage(i, std::move(msg)); });
  }
}

SimTransport::~SimTransport() {
  *alive_ = false;
  for (sim::NicId nic : core_->options.nics) core_->fabric->Detach(nic);
  core_->sched->CancelOwner(core_->owner);
}

absl::Duration SimTransport::PeerLossBound() const {
  absl::Duration rtt;
  for (sim::NicId nic : core_->options.nics) {
    rtt = std::max(rtt, 4 * core_->fabric->topology().nic_spec(nic).latency);
  }
  return (core_->options.retry_count + 1) * core_->options.ack_timeout + rtt;
}

EndpointDescription SimTransport::LocalEndpoint() const {
  EndpointDescription d;
  d.kind = kind::kSim;
  for (NicIndex i = 0; i < core_->options.nics.size(); ++i) {
    const sim::NicId nic = core_->options.nics[i];
    const sim::NicSpec& spec = core_->fabric->topology().nic_spec(nic);
    NicInfo info;
    info.name = absl::StrCat(
        core_->fabric->topology().node_name(core_->fabric->topology().node_of(nic)), "/nic", i);
    info.address = absl::StrCat(kAddressPrefix, nic);
    info.link_bits_per_sec = spec.bits_per_sec;
    if (i < core_->options.numa_nodes.size()) info.numa_node = core_->options.numa_nodes[i];
    info.mtu = spec.mtu;
    d.nics.push_back(std::move(info));
  }
  return d;
}

Limits SimTransport::GetLimits() const {
  return Limits{core_->options.max_outstanding_per_link, core_->options.max_request_bytes,
                core_->options.max_region_bytes};
}

Link& SimTransport::NewLink(NicIndex local_nic, sim::NicId remote_nic) {
  auto link = std::make_unique<Link>();
  link->id = ++last_link_id_;
  link->local_nic = local_nic;
  link->remote_nic = remote_nic;
  link->qpn = core_->fabric->NextSerial();
  link->retries_left = core_->options.retry_count;
  link->segment_bytes =
      std::min(core_->fabric->topology().nic_spec(core_->options.nics[local_nic]).mtu,
               core_->fabric->topology().nic_spec(remote_nic).mtu);
  Link& ref = *link;
  core_->links_by_qpn.emplace(ref.qpn, &ref);
  core_->links.emplace(ref.id, std::move(link));
  return ref;
}

absl::StatusOr<LinkOffer> SimTransport::CreateLink(NicIndex local_nic, const NicInfo& peer_nic) {
  if (local_nic >= core_->options.nics.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", local_nic));
  }
  ASSIGN_OR_RETURN(sim::NicId remote, ParsePeerNic(*core_->fabric, peer_nic));
  Link& link = NewLink(local_nic, remote);
  return LinkOffer{link.id, EncodeParams(link.qpn, core_->options.nics[local_nic])};
}

absl::StatusOr<LinkOffer> SimTransport::AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                                   absl::string_view peer_params) {
  if (local_nic >= core_->options.nics.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", local_nic));
  }
  ASSIGN_OR_RETURN(sim::NicId remote, ParsePeerNic(*core_->fabric, peer_nic));
  uint64_t remote_qpn;
  sim::NicId params_nic;
  if (!DecodeParams(peer_params, &remote_qpn, &params_nic) || params_nic != remote) {
    return absl::InvalidArgumentError("AcceptLink: malformed link parameters");
  }
  Link& link = NewLink(local_nic, remote);
  link.remote_qpn = remote_qpn;
  link.state = Link::State::kReady;
  return LinkOffer{link.id, EncodeParams(link.qpn, core_->options.nics[local_nic])};
}

absl::Status SimTransport::CompleteLink(LinkId id, absl::string_view peer_params) {
  auto it = core_->links.find(id);
  if (it == core_->links.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
  }
  Link& link = *it->second;
  if (link.state != Link::State::kPending) {
    return absl::FailedPreconditionError(absl::StrCat("link ", id, " is already complete"));
  }
  uint64_t remote_qpn;
  sim::NicId params_nic;
  if (!DecodeParams(peer_params, &remote_qpn, &params_nic) || params_nic != link.remote_nic) {
    return absl::InvalidArgumentError("CompleteLink: malformed link parameters");
  }
  link.remote_qpn = remote_qpn;
  link.state = Link::State::kReady;
  return absl::OkStatus();
}

absl::Status SimTransport::Post(absl::Span<const WorkRequest> batch) {
  // Validate everything first: Post is all or nothing.
  for (const WorkRequest& wr : batch) RETURN_IF_ERROR(ValidateRequest(wr));
  RETURN_IF_ERROR(CheckLinkCapacity(
      batch, [this](LinkId id) { return core_->links.at(id)->requests.size(); },
      core_->options.max_outstanding_per_link));
  for (const WorkRequest& wr : batch) {
    ++core_->regions.Find(wr.local_region)->local_uses;  // validated above
    requester_->Start(*core_->links.at(wr.link), wr);
  }
  return absl::OkStatus();
}

absl::Status SimTransport::CloseLink(LinkId id) {
  auto it = core_->links.find(id);
  if (it == core_->links.end()) {
    return absl::NotFoundError(absl::StrCat("unknown link ", id));
  }
  std::unique_ptr<Link> link = std::move(it->second);
  core_->links.erase(it);
  core_->links_by_qpn.erase(link->qpn);
  for (const auto& entry : link->requests) {
    core_->Complete(entry.second.wr,
                    absl::CancelledError(absl::StrCat("link ", id, " was closed")));
  }
  return absl::OkStatus();
}

void SimTransport::OnMessage(NicIndex nic, sim::Message&& msg) {
  sim_internal::WireHeader h;
  if (msg.bytes.size() < sizeof h) return;  // not ours: drop
  std::memcpy(&h, msg.bytes.data(), sizeof h);
  auto it = core_->links_by_qpn.find(h.dst_qpn);
  if (it == core_->links_by_qpn.end()) return;  // stale QP (e.g. before a restart)
  sim_internal::Link& link = *it->second;
  if (link.state != sim_internal::Link::State::kReady || link.local_nic != nic ||
      link.remote_qpn != h.src_qpn || link.remote_nic != msg.from) {
    return;
  }
  absl::string_view payload(msg.bytes);
  payload.remove_prefix(sizeof h);
  if (h.type == sim_internal::kSimRequest) {
    responder_->OnRequest(nic, link, h, payload);
  } else if (h.type == sim_internal::kSimResponse) {
    requester_->OnResponse(link, h, payload);
  }
}

absl::StatusOr<Region> SimTransport::RegisterMemory(void* addr, uint64_t length, Access access) {
  return core_->regions.Add(addr, length, access, core_->options.max_region_bytes);
}

absl::Status SimTransport::UnregisterMemory(RegionId region) {
  return core_->regions.Remove(region);
}

bool SimTransport::HasLink(LinkId link) { return core_->links.count(link) != 0; }

absl::Status SimTransport::ValidateRequest(const WorkRequest& wr) const {
  auto link = core_->links.find(wr.link);
  RETURN_IF_ERROR(
      CheckLinkUsable(wr.link, link == core_->links.end() ? nullptr : &link->second->state));
  const RegionState* region = core_->regions.Find(wr.local_region);
  if (region == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local region ", wr.local_region));
  }
  return CheckLocal(wr, region->region, core_->options.max_request_bytes);
}

size_t SimTransport::PollCompletions(absl::Span<Completion> out) {
  return core_->cq.Pop(out, [this](RegionId id) {
    if (RegionState* region = core_->regions.Find(id)) --region->local_uses;
  });
}

size_t SimTransport::WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) {
  if (core_->cq.empty() && timeout > absl::ZeroDuration()) {
    // Running simulated time may run a simulated crash that destroys this
    // very transport; `alive` outlives it and stops the loop before any
    // member is touched again.
    std::shared_ptr<const bool> alive = alive_;
    auto ready = [this, &alive] { return !*alive || !core_->cq.empty(); };
    if (timeout == absl::InfiniteDuration()) {
      // Run until something completes or nothing is left to happen; never
      // jump the clock to the end of time.
      while (!ready() && core_->sched->Step()) {
      }
    } else {
      core_->sched->RunUntilCondition(ready, core_->sched->now() + sim::ToSimTime(timeout));
    }
    if (!*alive) return 0;
  }
  return PollCompletions(out);
}

}  // namespace transport
}  // namespace kvferry
