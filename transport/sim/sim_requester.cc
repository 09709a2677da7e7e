// SimTransport's requester side (SimRequester): requests cut into
// segments, sent, retransmitted when unacknowledged, and completed by their
// answers.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "transport/sim/sim_transport_internal.h"

namespace kvferry {
namespace transport {
namespace sim_internal {

using sim::SimTime;

void SimRequester::Start(Link& link, const WorkRequest& wr) {
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

void SimRequester::Transmit(Link& link, uint64_t psn, Segment& seg) {
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
  const SimTime tx_end = core_.fabric->Send(core_.options.nics[link.local_nic], link.remote_nic,
                                            core_.options.header_bytes + data, std::move(bytes));
  seg.deadline = tx_end + sim::ToSimTime(core_.options.ack_timeout);
  if (link.timer_at < 0 || seg.deadline < link.timer_at) ArmTimer(link, seg.deadline);
}

void SimRequester::ArmTimer(Link& link, SimTime at) {
  const uint64_t generation = ++link.timer_generation;
  link.timer_at = at;
  const LinkId id = link.id;
  core_.sched->At(
      at, [this, id, generation] { OnTimer(id, generation); }, core_.owner);
}

void SimRequester::OnTimer(LinkId id, uint64_t generation) {
  auto it = core_.links.find(id);
  if (it == core_.links.end()) return;
  Link& link = *it->second;
  if (link.timer_generation != generation) return;
  link.timer_at = -1;
  if (link.segments.empty() || link.state != Link::State::kReady) return;
  const SimTime now = core_.sched->now();
  if (link.progressed) {
    // Answers are still flowing: nothing is declared lost while the peer
    // keeps acknowledging (its answers may just be queued behind others).
    link.progressed = false;
    ArmTimer(link, now + sim::ToSimTime(core_.options.ack_timeout));
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
      FailLink(
          link, link.requests.begin()->first,
          absl::UnavailableError(absl::StrFormat(
              "no response from peer on link %u after %u retries "
              "(ack timeout %s): transport retry counter exceeded",
              id, core_.options.retry_count, absl::FormatDuration(core_.options.ack_timeout))));
      return;
    }
    --link.retries_left;
    core_.sched->Trace(uint64_t{0x7e7} ^ id);
    next = INT64_MAX;
    for (auto& [psn, seg] : link.segments) {
      if (seg.deadline <= now) Transmit(link, psn, seg);  // may arm a timer
      next = std::min(next, seg.deadline);
    }
  }
  if (link.timer_at < 0 || next < link.timer_at) ArmTimer(link, next);
}

void SimRequester::OnResponse(Link& link, const WireHeader& h, absl::string_view payload) {
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
  link.retries_left = core_.options.retry_count;
  if (--request.segments_left > 0) return;
  if (core_.prng.Chance(core_.fabric->faults().error_completion)) {
    FailLink(link, seg.request,
             absl::UnavailableError("injected error completion (simulated fault)"));
    return;
  }
  core_.Complete(request.wr, absl::OkStatus());
  link.requests.erase(seg.request);
  if (link.segments.empty()) {
    ++link.timer_generation;  // disarm
    link.timer_at = -1;
    link.progressed = false;
  }
}

void SimRequester::FailLink(Link& link, uint64_t first_request, absl::Status first) {
  link.state = Link::State::kError;
  ++link.timer_generation;  // disarm
  link.timer_at = -1;
  const std::string reason(first.message());
  core_.Complete(link.requests.at(first_request).wr, std::move(first));
  for (const auto& [id, request] : link.requests) {
    if (id == first_request) continue;
    core_.Complete(request.wr, absl::AbortedError(absl::StrCat("flushed: link ", link.id,
                                                               " failed earlier: ", reason)));
  }
  link.requests.clear();
  link.segments.clear();
}

}  // namespace sim_internal
}  // namespace transport
}  // namespace kvferry
