// SimTransport's private types: the wire header between simulated
// transports, and the state of links, requests and segments.
#ifndef KVFERRY_TRANSPORT_SIM_SIM_TRANSPORT_INTERNAL_H_
#define KVFERRY_TRANSPORT_SIM_SIM_TRANSPORT_INTERNAL_H_

#include <cstdint>
#include <map>
#include <set>

#include "absl/status/status.h"
#include "transport/checks.h"
#include "transport/sim/sim_transport.h"

namespace kvferry {
namespace transport {

// Message types on the simulated wire.
constexpr uint8_t kSimRequest = 1;
constexpr uint8_t kSimResponse = 2;

// Fixed-size header of every message between sim transports (in-process,
// so host byte order). A request segment names the whole request's remote
// range so the target can check all of it on every segment.
struct SimTransport::WireHeader {
  uint8_t type = 0;
  uint8_t opcode = 0;
  uint8_t status_code = 0;  // absl::StatusCode of a response
  uint8_t pad[5] = {};
  uint64_t dst_qpn = 0;
  uint64_t src_qpn = 0;
  uint64_t psn = 0;
  uint64_t remote_addr = 0;  // of the whole request
  uint64_t rkey = 0;
  uint64_t length = 0;          // of the whole request
  uint64_t segment_offset = 0;  // within the request
  uint64_t segment_length = 0;
};

struct SimTransport::RegionState {
  Region region;
  uint64_t local_uses = 0;  // outstanding requests using it locally
};

// A posted request and how many of its segments are still unacknowledged.
struct SimTransport::Request {
  WorkRequest wr;
  uint64_t segments_left = 0;
};

// One segment in flight: which request, which part, when it last left.
struct SimTransport::Segment {
  uint64_t request = 0;  // key in Link::requests
  uint64_t offset = 0;
  uint64_t length = 0;
  sim::SimTime deadline = 0;  // retransmit if unacknowledged by then
};

struct SimTransport::Link {
  using State = LinkState;  // transport/checks.h
  LinkId id = 0;
  NicIndex local_nic = 0;
  sim::NicId remote_nic = 0;
  uint64_t qpn = 0;
  uint64_t remote_qpn = 0;
  uint64_t segment_bytes = 0;  // path MTU
  State state = State::kPending;
  // Requester side. Ordered maps: iteration order feeds the trace.
  uint64_t next_request = 0;
  uint64_t next_psn = 0;
  std::map<uint64_t, Request> requests;
  std::map<uint64_t, Segment> segments;  // by PSN, unacknowledged only
  uint32_t retries_left = 0;
  bool progressed = false;  // an answer arrived since the last timer round
  uint64_t timer_generation = 0;
  sim::SimTime timer_at = -1;  // -1: no timer armed
  // Responder side: every PSN below `executed_below` ran, and so did those
  // in `executed_above`; `errors` keeps refused PSNs' answers.
  uint64_t executed_below = 0;
  std::set<uint64_t> executed_above;
  std::map<uint64_t, absl::Status> errors;
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_SIM_SIM_TRANSPORT_INTERNAL_H_
