// The simulated network fabric: nodes (hosts) with NICs, each NIC joined to
// an ideal non-blocking switch by a full-duplex link of its own bandwidth,
// latency and MTU. Messages are delivered by the Scheduler at the time the
// model gives; faults are drawn from one seeded Prng in a fixed order.
//
// Timing model, for a message of B bytes from NIC s to NIC d, sent at t:
//   tx_start = max(t, s.tx_free)            egress queueing at the sender
//   tx_end   = tx_start + B / s.rate        serialisation (s.tx_free = tx_end)
//   path     = s.latency + d.latency (+ injected delay)
//   rx_start = max(tx_start + path, d.rx_free)
//   arrival  = max(rx_start + B / d.rate, tx_end + path)   (d.rx_free = arrival)
// so one message alone on a path arrives at t + path + B / rate, and several
// senders into one receiver share its rate. Packets of up to `mtu` bytes are
// pipelined back to back; MTU matters for faults: each packet is dropped
// independently and a message is lost if any of its packets is.
//
// Faults (all off by default; ratios are exact integers):
//   drop              per packet
//   delay             per message, extra latency uniform in [0, max_delay]
//   NIC down / node down, partitions between node sets (until Heal)
//   error_completion  per request, applied by transports on the fabric
// A node or NIC that is down neither sends nor receives; messages in flight
// to it when it goes down are lost.
//
// Not thread-safe: driven by the scheduler's thread.
#ifndef KVFERRY_SIM_FABRIC_H_
#define KVFERRY_SIM_FABRIC_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "sim/prng.h"
#include "sim/scheduler.h"
#include "sim/topology.h"

namespace kvferry {
namespace sim {

struct FaultOptions {
  Ratio drop;   // per packet
  Ratio delay;  // per message
  absl::Duration max_delay = absl::ZeroDuration();
  Ratio error_completion;  // per request, applied by transports
  // Per WRITE segment as it lands, applied by transports: one bit of it
  // flipped (a NIC or link corrupting data without an error).
  Ratio corrupt_write;
};

// A message as the receiver gets it.
struct Message {
  NicId from = 0;
  NicId to = 0;
  std::string bytes;
};

struct FabricStats {
  uint64_t sent = 0;
  uint64_t delivered = 0;
  uint64_t dropped = 0;
  uint64_t bytes_delivered = 0;
};

class Fabric {
 public:
  using Receiver = std::function<void(Message&&)>;

  // `scheduler` must outlive the fabric; `seed` drives every fault draw.
  Fabric(Scheduler* scheduler, uint64_t seed, FaultOptions faults = {});
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  Scheduler* scheduler() const { return scheduler_; }
  // Its nodes and NICs, and their failures (NIC and node down,
  // partitions).
  Topology& topology() { return topology_; }
  const Topology& topology() const { return topology_; }

  // Installs the function that receives messages arriving at `nic`
  // (replacing any earlier one); Detach removes it. Messages arriving at a
  // NIC without a receiver are dropped, as a NIC without a listener would.
  void Attach(NicId nic, Receiver receiver);
  void Detach(NicId nic);

  // Sends `bytes` from NIC `from` to NIC `to`. `wire_bytes` is the size the
  // timing model charges (>= bytes.size() is not required: control messages
  // may be charged as headers only). Returns the simulated time at which
  // the message has left the sender (tx_end), whether or not it survives.
  SimTime Send(NicId from, NicId to, uint64_t wire_bytes, std::string bytes);

  // Holds what `nic` sends for `d` from now (a stuck transmit queue, a
  // congested switch port): those messages leave, in order, when the hold
  // ends. Retransmissions sent meanwhile are held as well.
  void HoldNic(NicId nic, absl::Duration d);
  void set_faults(const FaultOptions& faults) { faults_ = faults; }
  const FaultOptions& faults() const { return faults_; }

  const FabricStats& stats() const { return stats_; }

  // A number never handed out before by this fabric (queue pair numbers and
  // other identifiers that must not repeat across a peer's restart).
  uint64_t NextSerial() { return ++last_serial_; }

  // Serialisation time of `bytes` at `bits_per_sec`, rounded up to 1 ns.
  static SimTime SerializationTime(uint64_t bytes, uint64_t bits_per_sec);

 private:
  // A NIC's side of its link to the switch.
  struct Port {
    SimTime tx_free = 0;
    SimTime rx_free = 0;
    SimTime held_until = 0;
    Receiver receiver;
  };

  // NIC `nic`'s port (made on first use: NICs are added to the topology).
  Port& PortOf(NicId nic);
  bool DropsPacketOf(uint64_t wire_bytes, uint32_t mtu);
  void Deliver(Message&& msg);

  Scheduler* const scheduler_;
  Prng prng_;
  FaultOptions faults_;
  Topology topology_;
  std::vector<Port> ports_;  // by NicId
  FabricStats stats_;
  uint64_t last_serial_ = 0;
};

}  // namespace sim
}  // namespace kvferry

#endif  // KVFERRY_SIM_FABRIC_H_
