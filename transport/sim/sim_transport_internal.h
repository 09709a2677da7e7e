// SimTransport's units and their types: the wire header between simulated
// transports; the state of regions, links, requests and segments; and the
// units over them:
//   SimCore       what the units share: the fabric, options, regions, links
//                 and completions (single-threaded: the scheduler's thread);
//   SimRegions    registered memory and its keys per NIC;
//   SimRequester  a request's segments, retransmission and answers
//                 (sim_requester.cc);
//   SimResponder  executing each PSN once and answering (sim_wire.cc).
// SimTransport (sim_transport.cc) keeps the Transport interface, links and
// the dispatch of arriving messages.
#ifndef KVFERRY_TRANSPORT_SIM_SIM_TRANSPORT_INTERNAL_H_
#define KVFERRY_TRANSPORT_SIM_SIM_TRANSPORT_INTERNAL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "sim/fabric.h"
#include "sim/prng.h"
#include "sim/scheduler.h"
#include "transport/checks.h"
#include "transport/completion_queue.h"
#include "transport/sim/sim_transport.h"

namespace kvferry {
namespace transport {
namespace sim_internal {

// Message types on the simulated wire.
constexpr uint8_t kSimRequest = 1;
constexpr uint8_t kSimResponse = 2;

// Fixed-size header of every message between sim transports (in-process,
// so host byte order). A request segment names the whole request's remote
// range so the target can check all of it on every segment.
struct WireHeader {
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

struct RegionState {
  Region region;
  uint64_t local_uses = 0;  // outstanding requests using it locally
};

// A posted request and how many of its segments are still unacknowledged.
struct Request {
  WorkRequest wr;
  uint64_t segments_left = 0;
};

// One segment in flight: which request, which part, when it last left.
struct Segment {
  uint64_t request = 0;  // key in Link::requests
  uint64_t offset = 0;
  uint64_t length = 0;
  sim::SimTime deadline = 0;  // retransmit if unacknowledged by then
};

struct Link {
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

// Registered memory: regions by id, and each NIC's keys for them.
class SimRegions {
 public:
  SimRegions(size_t nics, sim::Prng& prng) : keys_by_nic_(nics), prng_(prng) {}

  absl::StatusOr<Region> Add(void* addr, uint64_t length, Access access, uint64_t max_bytes);
  absl::Status Remove(RegionId id);
  RegionState* Find(RegionId id);
  // The bytes request `h` (one segment of it) touches at this end through
  // NIC `nic`: its key and whole range checked, as a NIC checks them.
  absl::StatusOr<char*> Target(NicIndex nic, const WireHeader& h) const;

 private:
  RegionId last_id_ = 0;
  absl::flat_hash_map<RegionId, std::unique_ptr<RegionState>> regions_;
  std::vector<absl::flat_hash_map<RemoteKey, RegionId>> keys_by_nic_;
  sim::Prng& prng_;
};

struct SimCore {
  SimCore(sim::Fabric* f, SimTransportOptions o, uint64_t seed)
      : fabric(f),
        sched(f->scheduler()),
        options(std::move(o)),
        prng(seed),
        owner(sched->NewOwner()),
        regions(options.nics.size(), prng) {}

  // Queues a completion (traced).
  void Complete(const WorkRequest& wr, absl::Status status) {
    sched->Trace(wr.cookie ^ (static_cast<uint64_t>(status.code()) << 56));
    cq.Push(wr, std::move(status));
  }

  sim::Fabric* const fabric;
  sim::Scheduler* const sched;
  const SimTransportOptions options;
  sim::Prng prng;
  const sim::Scheduler::OwnerId owner;
  SimRegions regions;
  absl::flat_hash_map<LinkId, std::unique_ptr<Link>> links;
  absl::flat_hash_map<uint64_t, Link*> links_by_qpn;
  CompletionQueue cq;
};

// The requester's side of the links: requests cut into segments, sent,
// retransmitted when unacknowledged, and completed by their answers.
class SimRequester {
 public:
  explicit SimRequester(SimCore& core) : core_(core) {}

  // Sends `wr` (checked) on `link`.
  void Start(Link& link, const WorkRequest& wr);
  void OnResponse(Link& link, const WireHeader& h, absl::string_view payload);
  // The link enters the error state: `first_request` fails with `first`,
  // the others are flushed.
  void FailLink(Link& link, uint64_t first_request, absl::Status first);

 private:
  void Transmit(Link& link, uint64_t psn, Segment& seg);
  void ArmTimer(Link& link, sim::SimTime at);
  void OnTimer(LinkId id, uint64_t generation);

  SimCore& core_;
};

// The responder's side: each PSN executed at most once against registered
// memory, and answered (again, for a duplicate).
class SimResponder {
 public:
  explicit SimResponder(SimCore& core) : core_(core) {}

  void OnRequest(NicIndex nic, Link& link, const WireHeader& h, absl::string_view payload);

 private:
  absl::Status Execute(NicIndex nic, const WireHeader& h, absl::string_view data,
                       std::string* read_out);
  void Respond(Link& link, const WireHeader& request, absl::StatusCode code,
               absl::string_view payload);

  SimCore& core_;
};

}  // namespace sim_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_SIM_SIM_TRANSPORT_INTERNAL_H_
