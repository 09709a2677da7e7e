// The handshake network on the simulated fabric, so whole clusters of
// engines handshake inside the deterministic simulator.
//
// Each SimNetwork owns one fabric NIC (a node's management NIC; data NICs
// belong to the SimTransport). Addresses are "nic<N>.sim:<port>". A call is
// a request message and a reply message; requests are re-sent every
// `resend_interval` until answered (the server answers duplicates from a
// cache, so a handler runs once per call), and a call with no answer within
// its timeout fails with kUnavailable. A request to a port nobody serves is
// refused at once (like a TCP reset).
//
// Not thread-safe: runs on the simulator's thread. Call() runs the
// scheduler until the reply arrives.
#ifndef KVFERRY_HANDSHAKE_SIM_NETWORK_H_
#define KVFERRY_HANDSHAKE_SIM_NETWORK_H_

#include <map>
#include <atomic>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "handshake/network.h"
#include "sim/fabric.h"

namespace kvferry {
namespace handshake {

class SimNetwork final : public Network {
 public:
  SimNetwork(sim::Fabric* fabric, sim::NicId nic,
             absl::Duration resend_interval = absl::Microseconds(500));
  ~SimNetwork() override;

  // The host part of this network's addresses, "nic<N>.sim".
  std::string host() const;

  absl::StatusOr<std::unique_ptr<Server>> Serve(const ServeOptions& options,
                                                Handler handler) override;
  absl::StatusOr<Frame> Call(const std::string& peer, const Frame& request,
                             absl::Duration timeout) override;

 private:
  class SimServer;
  struct Reply {
    bool answered = false;
    bool refused = false;
    Frame frame;
  };
  void OnMessage(sim::Message&& msg);
  void Send(sim::NicId to, uint8_t kind, uint16_t port, uint64_t id, const std::string& body);

  sim::Fabric* const fabric_;
  const sim::NicId nic_;
  const absl::Duration resend_interval_;
  std::map<uint16_t, Handler> servers_;                   // by port
  std::map<uint64_t, Reply> replies_;                      // by call id
  std::map<std::pair<sim::NicId, uint64_t>, std::string> answered_;  // dedup cache
  uint64_t next_call_ = 0;
  const uint64_t instance_ = NextInstance();
  static uint64_t NextInstance() {
    static std::atomic<uint64_t> instances{0};
    return ++instances;
  }
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_SIM_NETWORK_H_
