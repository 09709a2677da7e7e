// SimTransport's responder side (SimResponder: executing requests against
// registered memory, answering once per PSN) and its registered memory
// (SimRegions).
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "transport/checks.h"
#include "transport/sim/sim_transport.h"
#include "transport/sim/sim_transport_internal.h"

namespace kvferry {
namespace transport {
namespace sim_internal {

using sim::SimTime;

absl::Status SimResponder::Execute(NicIndex nic, const WireHeader& h, absl::string_view data,
                                   std::string* read_out) {
  if (h.length == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(char* target, core_.regions.Target(nic, h));
  const bool write = h.opcode == static_cast<uint8_t>(Opcode::kWrite);
  if (write) {
    std::memcpy(target, data.data(), h.segment_length);
    if (h.segment_length > 0 && core_.prng.Chance(core_.fabric->faults().corrupt_write)) {
      target[core_.prng.Uniform(h.segment_length)] ^=
          static_cast<char>(1u << core_.prng.Uniform(8));
    }
  } else {
    read_out->assign(target, h.segment_length);
  }
  return absl::OkStatus();
}

void SimResponder::Respond(Link& link, const WireHeader& request, absl::StatusCode code,
                           absl::string_view payload) {
  WireHeader h = request;
  h.type = kSimResponse;
  h.status_code = static_cast<uint8_t>(code);
  h.dst_qpn = link.remote_qpn;
  h.src_qpn = link.qpn;
  std::string bytes(sizeof h + payload.size(), '\0');
  std::memcpy(&bytes[0], &h, sizeof h);
  if (!payload.empty()) std::memcpy(&bytes[sizeof h], payload.data(), payload.size());
  const uint64_t wire =
      core_.options.header_bytes + (code == absl::StatusCode::kOk ? payload.size() : 0);
  core_.fabric->Send(core_.options.nics[link.local_nic], link.remote_nic, wire, std::move(bytes));
}

void SimResponder::OnRequest(NicIndex nic, Link& link, const WireHeader& h,
                             absl::string_view payload) {
  const bool write = h.opcode == static_cast<uint8_t>(Opcode::kWrite);
  if (h.segment_offset > h.length || h.segment_length > h.length - h.segment_offset ||
      (write && payload.size() != h.segment_length)) {
    return;  // malformed: drop
  }
  const bool duplicate = h.psn < link.executed_below || link.executed_above.count(h.psn) != 0;
  if (duplicate) {
    auto error = link.errors.find(h.psn);
    if (error != link.errors.end()) {
      Respond(link, h, error->second.code(), error->second.message());
      return;
    }
    if (write) {  // never execute a WRITE twice
      Respond(link, h, absl::StatusCode::kOk, "");
      return;
    }
    // A READ is idempotent: read again below.
  }
  std::string read_data;
  absl::Status status = Execute(nic, h, payload, &read_data);
  if (!duplicate) {
    link.executed_above.insert(h.psn);
    while (!link.executed_above.empty() && *link.executed_above.begin() == link.executed_below) {
      link.executed_above.erase(link.executed_above.begin());
      ++link.executed_below;
    }
    if (!status.ok()) link.errors.emplace(h.psn, status);
  }
  core_.sched->Trace(h.psn ^ (uint64_t{status.ok()} << 63));
  Respond(link, h, status.code(), status.ok() ? read_data : status.message());
}

absl::StatusOr<Region> SimRegions::Add(void* addr, uint64_t length, Access access,
                                       uint64_t max_bytes) {
  if (addr == nullptr) {
    return absl::InvalidArgumentError("RegisterMemory: null address");
  }
  if (length == 0) {
    return absl::InvalidArgumentError("RegisterMemory: zero length");
  }
  if (length > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("RegisterMemory: ", length, " bytes exceeds the limit of ", max_bytes));
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  if (base + length < base) {
    return absl::InvalidArgumentError("RegisterMemory: range wraps around");
  }
  auto state = std::make_unique<RegionState>();
  Region& r = state->region;
  r.id = ++last_id_;
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

absl::Status SimRegions::Remove(RegionId region) {
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

RegionState* SimRegions::Find(RegionId id) {
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second.get();
}

absl::StatusOr<char*> SimRegions::Target(NicIndex nic, const WireHeader& h) const {
  auto key = keys_by_nic_[nic].find(h.rkey);
  if (key == keys_by_nic_[nic].end()) return UnknownKeyError(h.rkey);
  const bool write = h.opcode == static_cast<uint8_t>(Opcode::kWrite);
  // The whole request's range, checked on every segment.
  RETURN_IF_ERROR(CheckRemoteAccess(regions_.at(key->second)->region,
                                    write ? Opcode::kWrite : Opcode::kRead, h.remote_addr,
                                    h.length));
  return reinterpret_cast<char*>(h.remote_addr + h.segment_offset);
}

}  // namespace sim_internal
}  // namespace transport
}  // namespace kvferry
