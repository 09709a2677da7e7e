// SimTransport: the responder's side (executing requests against
// registered memory, answering once per PSN) and the requester's handling
// of answers.
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

using sim::SimTime;

void SimTransport::OnMessage(NicIndex nic, sim::Message&& msg) {
  WireHeader h;
  if (msg.bytes.size() < sizeof h) return;  // not ours: drop
  std::memcpy(&h, msg.bytes.data(), sizeof h);
  auto it = links_by_qpn_.find(h.dst_qpn);
  if (it == links_by_qpn_.end()) return;  // stale QP (e.g. before a restart)
  Link& link = *it->second;
  if (link.state != Link::State::kReady || link.local_nic != nic || link.remote_qpn != h.src_qpn ||
      link.remote_nic != msg.from) {
    return;
  }
  absl::string_view payload(msg.bytes);
  payload.remove_prefix(sizeof h);
  if (h.type == kSimRequest) {
    OnRequest(nic, link, h, payload);
  } else if (h.type == kSimResponse) {
    OnResponse(link, h, payload);
  }
}

absl::Status SimTransport::Execute(NicIndex nic, const WireHeader& h, absl::string_view data,
                                   std::string* read_out) {
  if (h.length == 0) return absl::OkStatus();
  auto key = keys_by_nic_[nic].find(h.rkey);
  if (key == keys_by_nic_[nic].end()) return UnknownKeyError(h.rkey);
  const bool write = h.opcode == static_cast<uint8_t>(Opcode::kWrite);
  // The whole request's range, checked on every segment.
  RETURN_IF_ERROR(CheckRemoteAccess(regions_.at(key->second)->region,
                                    write ? Opcode::kWrite : Opcode::kRead, h.remote_addr,
                                    h.length));
  char* target = reinterpret_cast<char*>(h.remote_addr + h.segment_offset);
  if (write) {
    std::memcpy(target, data.data(), h.segment_length);
    if (h.segment_length > 0 && prng_.Chance(fabric_->faults().corrupt_write)) {
      target[prng_.Uniform(h.segment_length)] ^= static_cast<char>(1u << prng_.Uniform(8));
    }
  } else {
    read_out->assign(target, h.segment_length);
  }
  return absl::OkStatus();
}

void SimTransport::Respond(Link& link, const WireHeader& request, absl::StatusCode code,
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
      options_.header_bytes + (code == absl::StatusCode::kOk ? payload.size() : 0);
  fabric_->Send(options_.nics[link.local_nic], link.remote_nic, wire, std::move(bytes));
}

void SimTransport::OnRequest(NicIndex nic, Link& link, const WireHeader& h,
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
  sched_->Trace(h.psn ^ (uint64_t{status.ok()} << 63));
  Respond(link, h, status.code(), status.ok() ? read_data : status.message());
}

void SimTransport::OnResponse(Link& link, const WireHeader& h, absl::string_view payload) {
  auto seg_it = link.segments.find(h.psn);
  if (seg_it == link.segments.end()) return;  // duplicate answer
  const Segment seg = seg_it->second;
  Request& request = link.requests.at(seg.request);
  const auto code = static_cast<absl::StatusCode>(h.status_code);
  if (code != absl::StatusCode::kOk) {
    FailLink(link, seg.request, absl::Status(code, payload));
    return;
  }
  if (request.wr.opcode == Opcode::kRead) {
    if (payload.size() != seg.length) return;  // malformed: wait for retry
    if (seg.length > 0) {
      std::memcpy(static_cast<char*>(request.wr.local_addr) + seg.offset, payload.data(),
                  seg.length);
    }
  }
  link.segments.erase(seg_it);
  link.progressed = true;
  link.retries_left = options_.retry_count;
  if (--request.segments_left > 0) return;
  if (prng_.Chance(fabric_->faults().error_completion)) {
    FailLink(link, seg.request,
             absl::UnavailableError("injected error completion (simulated fault)"));
    return;
  }
  Complete(request.wr, absl::OkStatus());
  link.requests.erase(seg.request);
  if (link.segments.empty()) {
    ++link.timer_generation;  // disarm
    link.timer_at = -1;
    link.progressed = false;
  }
}

}  // namespace transport
}  // namespace kvferry
