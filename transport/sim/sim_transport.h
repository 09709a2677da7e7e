// A Transport on the simulated fabric (sim/fabric.h): the reference
// implementation of transport/transport.h, used by deterministic cluster
// simulations and as the model the real transports are tested against.
//
// It behaves like an RDMA NIC's reliable connection, with selective repeat:
//  * a request is cut into segments of the path MTU (the smaller MTU of the
//    two NICs), each with its own packet sequence number (PSN) and its own
//    acknowledgement; real bytes move between registered regions at the
//    simulated time the fabric's model says (a WRITE segment's bytes land
//    when it arrives, a READ segment's when its response arrives);
//  * the target checks key, bounds and access for the whole request on every
//    segment, exactly as a NIC would; a refused request changes no byte and
//    completes with kPermissionDenied;
//  * the responder executes each PSN at most once (a late duplicate WRITE
//    never overwrites newer data) and answers duplicates again;
//  * when a link has heard nothing from its peer for `ack_timeout`, every
//    segment unacknowledged `ack_timeout` after it left the NIC is sent
//    again; after `retry_count` such rounds in a row the oldest request fails
//    with kUnavailable and the link enters the error state (the others are
//    flushed with kAborted);
//  * the fabric's `error_completion` fault turns a request's success into an
//    error completion (kUnavailable; data state unknown, as on hardware).
// Segments of one request may be placed in any order, which the Transport
// contract allows (it promises no order between or within requests).
//
// Keys and queue pair numbers come from the transport's seed and the fabric,
// so a transport re-created after a simulated crash has new keys and never
// accepts messages meant for its previous life.
//
// Threading: NOT thread-safe. All calls must come from the thread that
// drives the simulator's Scheduler. WaitCompletions() runs the scheduler
// (advancing simulated time) until a completion is ready or the timeout, in
// simulated time, has passed. If an event it runs destroys this transport (a
// simulated crash), WaitCompletions returns 0 without touching it again.
#ifndef KVFERRY_TRANSPORT_SIM_SIM_TRANSPORT_H_
#define KVFERRY_TRANSPORT_SIM_SIM_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "sim/fabric.h"
#include "sim/prng.h"
#include "sim/scheduler.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {
namespace sim_internal {
struct Link;
struct SimCore;
class SimRequester;
class SimResponder;
}  // namespace sim_internal

struct SimTransportOptions {
  // The fabric NICs this transport owns, in NicIndex order. Each fabric NIC
  // belongs to at most one live transport.
  std::vector<sim::NicId> nics;
  // NUMA node of each NIC (advertised in NicInfo); empty: unknown (-1).
  std::vector<int32_t> numa_nodes;
  absl::Duration ack_timeout = absl::Milliseconds(1);
  uint32_t retry_count = 7;
  uint32_t max_outstanding_per_link = 1024;
  uint64_t max_request_bytes = uint64_t{1} << 30;
  uint64_t max_region_bytes = uint64_t{1} << 40;
  // Bytes the timing model charges per message on top of the payload.
  uint32_t header_bytes = 64;
};

class SimTransport final : public Transport {
 public:
  // `fabric` (and its scheduler) must outlive the transport. `seed` drives
  // keys and injected error completions. kInvalidArgument for no NICs, an
  // unknown NIC, NICs on different nodes, or zero limits.
  static absl::StatusOr<std::unique_ptr<SimTransport>> Create(sim::Fabric* fabric,
                                                              SimTransportOptions options,
                                                              uint64_t seed);
  ~SimTransport() override;

  // Simulated time within which a request to a peer that stopped answering
  // fails, when the link carries no backlog: (retry_count + 1) * ack_timeout
  // plus one round trip.
  absl::Duration PeerLossBound() const;

  EndpointDescription LocalEndpoint() const override;
  Limits GetLimits() const override;
  absl::StatusOr<Region> RegisterMemory(void* addr, uint64_t length, Access access) override;
  absl::Status UnregisterMemory(RegionId region) override;
  absl::StatusOr<LinkOffer> CreateLink(NicIndex local_nic, const NicInfo& peer_nic) override;
  absl::StatusOr<LinkOffer> AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                       absl::string_view peer_params) override;
  absl::Status CompleteLink(LinkId link, absl::string_view peer_params) override;
  absl::Status CloseLink(LinkId link) override;
  bool HasLink(LinkId link) override;
  absl::Status Post(absl::Span<const WorkRequest> batch) override;
  size_t PollCompletions(absl::Span<Completion> out) override;
  size_t WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) override;

 private:
  SimTransport(sim::Fabric* fabric, SimTransportOptions options, uint64_t seed);

  sim_internal::Link& NewLink(NicIndex local_nic, sim::NicId remote_nic);
  absl::Status ValidateRequest(const WorkRequest& wr) const;
  void OnMessage(NicIndex nic, sim::Message&& msg);

  // Its units (sim_transport_internal.h): the state they share, the
  // requester's side (segments, retransmission, answers) and the
  // responder's (executing each PSN once, answering).
  std::unique_ptr<sim_internal::SimCore> core_;
  std::unique_ptr<sim_internal::SimRequester> requester_;
  std::unique_ptr<sim_internal::SimResponder> responder_;
  LinkId last_link_id_ = 0;
  const std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_SIM_SIM_TRANSPORT_H_
