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
    if (!fabric->HasNic(nic)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown fabric NIC ", nic));
    }
    if (fabric->node_of(nic) != fabric->node_of(options.nics[0])) {
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
    : fabric_(fabric),
      sched_(fabric->scheduler()),
      options_(std::move(options)),
      prng_(seed),
      owner_(sched_->NewOwner()),
      keys_by_nic_(options_.nics.size()) {
  for (NicIndex i = 0; i < options_.nics.size(); ++i) {
    fabric_->Attach(options_.nics[i],
                    [this, i](sim::Message&& msg) { OnMessage(i, std::move(msg)); });
  }
}

SimTransport::~SimTransport() {
  *alive_ = false;
  for (sim::NicId nic : options_.nics) fabric_->Detach(nic);
  sched_->CancelOwner(owner_);
}

absl::Duration SimTransport::PeerLossBound() const {
  absl::Duration rtt;
  for (sim::NicId nic : options_.nics) {
    rtt = std::max(rtt, 4 * fabric_->nic_spec(nic).latency);
  }
  return (options_.retry_count + 1) * options_.ack_timeout + rtt;
}

EndpointDescription SimTransport::LocalEndpoint() const {
  EndpointDescription d;
  d.kind = kind::kSim;
  for (NicIndex i = 0; i < options_.nics.size(); ++i) {
    const sim::NicId nic = options_.nics[i];
    const sim::NicSpec& spec = fabric_->nic_spec(nic);
    NicInfo info;
    info.name = absl::StrCat(fabric_->node_name(fabric_->node_of(nic)), "/nic", i);
    info.address = absl::StrCat(kAddressPrefix, nic);
    info.link_bits_per_sec = spec.bits_per_sec;
    if (i < options_.numa_nodes.size()) info.numa_node = options_.numa_nodes[i];
    info.mtu = spec.mtu;
    d.nics.push_back(std::move(info));
  }
  return d;
}

Limits SimTransport::GetLimits() const {
  return Limits{options_.max_outstanding_per_link, options_.max_request_bytes,
                options_.max_region_bytes};
}

absl::StatusOr<Region> SimTransport::RegisterMemory(void* addr, uint64_t length, Access access) {
  if (addr == nullptr) {
    return absl::InvalidArgumentError("RegisterMemory: null address");
  }
  if (length == 0) {
    return absl::InvalidArgumentError("RegisterMemory: zero length");
  }
  if (length > options_.max_region_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "RegisterMemory: ", length, " bytes exceeds the limit of ", options_.max_region_bytes));
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  if (base + length < base) {
    return absl::InvalidArgumentError("RegisterMemory: range wraps around");
  }
  auto state = std::make_unique<RegionState>();
  Region& r = state->region;
  r.id = ++last_region_id_;
  r.addr = base;
  r.length = length;
  r.access = access;
  for (auto& keys : keys_by_nic_) {
    RemoteKey key;
    do {
      key = prng_.Next64();
    } while (key == 0 || keys.contains(key));
    keys.emplace(key, r.id);
    r.keys.push_back(key);
  }
  Region out = r;
  regions_.emplace(r.id, std::move(state));
  return out;
}

absl::Status SimTransport::UnregisterMemory(RegionId region) {
  auto it = regions_.find(region);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown region ", region));
  }
  if (it->second->local_uses != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "region ", region, " is used by ", it->second->local_uses, " outstanding request(s)"));
  }
  const Region& r = it->second->region;
  for (size_t i = 0; i < keys_by_nic_.size(); ++i) keys_by_nic_[i].erase(r.keys[i]);
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<sim::NicId> SimTransport::ParsePeerNic(const NicInfo& peer_nic) const {
  absl::string_view addr = peer_nic.address;
  uint32_t nic;
  if (!absl::ConsumePrefix(&addr, kAddressPrefix) || !absl::SimpleAtoi(addr, &nic) ||
      !fabric_->HasNic(nic)) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a sim NIC address: '", peer_nic.address, "'"));
  }
  return nic;
}

SimTransport::Link& SimTransport::NewLink(NicIndex local_nic, sim::NicId remote_nic) {
  auto link = std::make_unique<Link>();
  link->id = ++last_link_id_;
  link->local_nic = local_nic;
  link->remote_nic = remote_nic;
  link->qpn = fabric_->NextSerial();
  link->retries_left = options_.retry_count;
  link->segment_bytes =
      std::min(fabric_->nic_spec(options_.nics[local_nic]).mtu, fabric_->nic_spec(remote_nic).mtu);
  Link& ref = *link;
  links_by_qpn_.emplace(ref.qpn, &ref);
  links_.emplace(ref.id, std::move(link));
  return ref;
}

absl::StatusOr<LinkOffer> SimTransport::CreateLink(NicIndex local_nic, const NicInfo& peer_nic) {
  if (local_nic >= options_.nics.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", local_nic));
  }
  ASSIGN_OR_RETURN(sim::NicId remote, ParsePeerNic(peer_nic));
  Link& link = NewLink(local_nic, remote);
  return LinkOffer{link.id, EncodeParams(link.qpn, options_.nics[local_nic])};
}

absl::StatusOr<LinkOffer> SimTransport::AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                                   absl::string_view peer_params) {
  if (local_nic >= options_.nics.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", local_nic));
  }
  ASSIGN_OR_RETURN(sim::NicId remote, ParsePeerNic(peer_nic));
  uint64_t remote_qpn;
  sim::NicId params_nic;
  if (!DecodeParams(peer_params, &remote_qpn, &params_nic) || params_nic != remote) {
    return absl::InvalidArgumentError("AcceptLink: malformed link parameters");
  }
  Link& link = NewLink(local_nic, remote);
  link.remote_qpn = remote_qpn;
  link.state = Link::State::kReady;
  return LinkOffer{link.id, EncodeParams(link.qpn, options_.nics[local_nic])};
}

absl::Status SimTransport::CompleteLink(LinkId id, absl::string_view peer_params) {
  auto it = links_.find(id);
  if (it == links_.end()) {
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

absl::Status SimTransport::CloseLink(LinkId id) {
  auto it = links_.find(id);
  if (it == links_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown link ", id));
  }
  std::unique_ptr<Link> link = std::move(it->second);
  links_.erase(it);
  links_by_qpn_.erase(link->qpn);
  for (const auto& entry : link->requests) {
    Complete(entry.second.wr, absl::CancelledError(absl::StrCat("link ", id, " was closed")));
  }
  return absl::OkStatus();
}

absl::Status SimTransport::ValidateRequest(const WorkRequest& wr) const {
  auto link = links_.find(wr.link);
  RETURN_IF_ERROR(CheckLinkUsable(wr.link, link == links_.end() ? nullptr : &link->second->state));
  auto region = regions_.find(wr.local_region);
  if (region == regions_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local region ", wr.local_region));
  }
  return CheckLocal(wr, region->second->region, options_.max_request_bytes);
}

absl::Status SimTransport::Post(absl::Span<const WorkRequest> batch) {
  // Validate everything first: Post is all or nothing.
  for (const WorkRequest& wr : batch) RETURN_IF_ERROR(ValidateRequest(wr));
  RETURN_IF_ERROR(CheckLinkCapacity(
      batch, [this](LinkId id) { return links_.at(id)->requests.size(); },
      options_.max_outstanding_per_link));
  for (const WorkRequest& wr : batch) {
    Link& link = *links_.at(wr.link);
    ++regions_.at(wr.local_region)->local_uses;
    const uint64_t id = link.next_request++;
    const uint64_t count =
        wr.length == 0 ? 1 : (wr.length + link.segment_bytes - 1) / link.segment_bytes;
    link.requests.emplace(id, Request{wr, count});
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t offset = i * link.segment_bytes;
      const uint64_t psn = link.next_psn++;
      Segment& seg = link.segments[psn];
      seg = Segment{id, offset, std::min(link.segment_bytes, wr.length - offset), 0};
      Transmit(link, psn, seg);
    }
  }
  return absl::OkStatus();
}

void SimTransport::Transmit(Link& link, uint64_t psn, Segment& seg) {
  const WorkRequest& wr = link.requests.at(seg.request).wr;
  WireHeader h;
  h.type = kSimRequest;
  h.opcode = static_cast<uint8_t>(wr.opcode);
  h.dst_qpn = link.remote_qpn;
  h.src_qpn = link.qpn;
  h.psn = psn;
  h.remote_addr = wr.remote_addr;
  h.rkey = wr.remote_key;
  h.length = wr.length;
  h.segment_offset = seg.offset;
  h.segment_length = seg.length;
  const bool carries_data = wr.opcode == Opcode::kWrite;
  const uint64_t data = carries_data ? seg.length : 0;
  std::string bytes(sizeof h + data, '\0');
  std::memcpy(&bytes[0], &h, sizeof h);
  if (data > 0) {
    std::memcpy(&bytes[sizeof h], static_cast<const char*>(wr.local_addr) + seg.offset, data);
  }
  const SimTime tx_end = fabric_->Send(options_.nics[link.local_nic], link.remote_nic,
                                       options_.header_bytes + data, std::move(bytes));
  seg.deadline = tx_end + sim::ToSimTime(options_.ack_timeout);
  if (link.timer_at < 0 || seg.deadline < link.timer_at) ArmTimer(link, seg.deadline);
}

void SimTransport::ArmTimer(Link& link, SimTime at) {
  const uint64_t generation = ++link.timer_generation;
  link.timer_at = at;
  const LinkId id = link.id;
  sched_->At(
      at, [this, id, generation] { OnTimer(id, generation); }, owner_);
}

void SimTransport::OnTimer(LinkId id, uint64_t generation) {
  auto it = links_.find(id);
  if (it == links_.end()) return;
  Link& link = *it->second;
  if (link.timer_generation != generation) return;
  link.timer_at = -1;
  if (link.segments.empty() || link.state != Link::State::kReady) return;
  const SimTime now = sched_->now();
  if (link.progressed) {
    // Answers are still flowing: nothing is declared lost while the peer
    // keeps acknowledging (its answers may just be queued behind others).
    link.progressed = false;
    ArmTimer(link, now + sim::ToSimTime(options_.ack_timeout));
    return;
  }
  SimTime next = INT64_MAX;
  bool overdue = false;
  for (const auto& entry : link.segments) {
    overdue |= entry.second.deadline <= now;
    next = std::min(next, entry.second.deadline);
  }
  if (overdue) {
    if (link.retries_left == 0) {
      FailLink(link, link.requests.begin()->first,
               absl::UnavailableError(absl::StrFormat(
                   "no response from peer on link %u after %u retries "
                   "(ack timeout %s): transport retry counter exceeded",
                   id, options_.retry_count, absl::FormatDuration(options_.ack_timeout))));
      return;
    }
    --link.retries_left;
    sched_->Trace(uint64_t{0x7e7} ^ id);
    next = INT64_MAX;
    for (auto& [psn, seg] : link.segments) {
      if (seg.deadline <= now) Transmit(link, psn, seg);  // may arm a timer
      next = std::min(next, seg.deadline);
    }
  }
  if (link.timer_at < 0 || next < link.timer_at) ArmTimer(link, next);
}

void SimTransport::FailLink(Link& link, uint64_t first_request, absl::Status first) {
  link.state = Link::State::kError;
  ++link.timer_generation;  // disarm
  link.timer_at = -1;
  const std::string reason(first.message());
  Complete(link.requests.at(first_request).wr, std::move(first));
  for (const auto& [id, request] : link.requests) {
    if (id == first_request) continue;
    Complete(request.wr, absl::AbortedError(
                             absl::StrCat("flushed: link ", link.id, " failed earlier: ", reason)));
  }
  link.requests.clear();
  link.segments.clear();
}

void SimTransport::Complete(const WorkRequest& wr, absl::Status status) {
  sched_->Trace(wr.cookie ^ (static_cast<uint64_t>(status.code()) << 56));
  cq_.Push(wr, std::move(status));
}

size_t SimTransport::PollCompletions(absl::Span<Completion> out) {
  return cq_.Pop(out, [this](RegionId id) {
    auto region = regions_.find(id);
    if (region != regions_.end()) --region->second->local_uses;
  });
}

size_t SimTransport::WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) {
  if (cq_.empty() && timeout > absl::ZeroDuration()) {
    // Running simulated time may run a simulated crash that destroys this
    // very transport; `alive` outlives it and stops the loop before any
    // member is touched again.
    std::shared_ptr<const bool> alive = alive_;
    auto ready = [this, &alive] { return !*alive || !cq_.empty(); };
    if (timeout == absl::InfiniteDuration()) {
      // Run until something completes or nothing is left to happen; never
      // jump the clock to the end of time.
      while (!ready() && sched_->Step()) {
      }
    } else {
      sched_->RunUntilCondition(ready, sched_->now() + sim::ToSimTime(timeout));
    }
    if (!*alive) return 0;
  }
  return PollCompletions(out);
}

}  // namespace transport
}  // namespace kvferry
