// A simulated world for engine-level tests: hosts with a data NIC and a
// management NIC on one fabric, and TransferEngines built on SimTransport
// and SimNetwork, all driven by one scheduler.
#ifndef KVFERRY_ENGINE_TESTING_SIM_WORLD_H_
#define KVFERRY_ENGINE_TESTING_SIM_WORLD_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/transfer_engine.h"
#include "handshake/sim_network.h"
#include "sim/fabric.h"
#include "sim/prng.h"
#include "sim/scheduler.h"
#include "transport/sim/sim_transport.h"

namespace kvferry {

class SimWorld {
 public:
  explicit SimWorld(uint64_t seed, sim::FaultOptions faults = {})
      : root_(seed), fabric_(&sched_, root_.Next64(), faults) {}

  // A host with a data NIC and a management NIC.
  int AddHost(sim::NicSpec data_nic = {}) { return AddMultiNicHost({-1}, data_nic); }

  // A host with one data NIC per entry of `numa_nodes` (each NIC on that
  // NUMA node) and a management NIC.
  int AddMultiNicHost(const std::vector<int32_t>& numa_nodes, sim::NicSpec data_nic = {}) {
    const sim::NodeId node = fabric_.topology().AddNode("host" + std::to_string(hosts_.size()));
    Host h;
    for (size_t i = 0; i < numa_nodes.size(); ++i)
      h.data.push_back(*fabric_.topology().AddNic(node, data_nic));
    h.numa = numa_nodes;
    h.mgmt = *fabric_.topology().AddNic(node, {});
    hosts_.push_back(std::move(h));
    return static_cast<int>(hosts_.size()) - 1;
  }

  absl::StatusOr<std::unique_ptr<TransferEngine>> StartEngine(
      int host, uint16_t port = 0, uint32_t max_outstanding_per_link = 1024) {
    transport::SimTransportOptions o;
    o.nics = hosts_[host].data;
    o.numa_nodes = hosts_[host].numa;
    o.max_outstanding_per_link = max_outstanding_per_link;
    auto t = transport::SimTransport::Create(&fabric_, o, root_.Next64());
    if (!t.ok()) return t.status();
    auto network = std::make_unique<handshake::SimNetwork>(&fabric_, hosts_[host].mgmt);
    EngineParts parts;
    parts.detection.host = network->host();
    parts.detection.transport = "sim";
    parts.detection.transport_reason = "simulated fabric";
    parts.transport = std::move(*t);
    parts.network = std::move(network);
    parts.engine_id = root_.Next64() | 1;
    parts.clock = &sched_;
    parts.wait = [this](const std::function<bool()>& ready, absl::Duration timeout) {
      return sched_.RunUntilCondition(ready, sched_.now() + sim::ToSimTime(timeout));
    };
    parts.near_nics = near_nics_;
    EngineOptions options = engine_options_;
    options.port = port;
    return TransferEngine::CreateWith(options, std::move(parts));
  }

  // Options every engine started from now on gets (port aside).
  void set_engine_options(const EngineOptions& o) { engine_options_ = o; }
  // Which NICs are near a buffer location ("cuda:N", ...) for engines started
  // from now on (EngineParts::near_nics); unset: the engine's default.
  void set_near_nics(
      std::function<absl::StatusOr<std::vector<transport::NicIndex>>(const std::string&)> f) {
    near_nics_ = std::move(f);
  }
  sim::NodeId node(int host) const { return fabric_.topology().node_of(hosts_[host].mgmt); }
  sim::Scheduler& sched() { return sched_; }
  // The fabric NIC behind data NIC `index` of `host`.
  sim::NicId data_nic(int host, size_t index) const { return hosts_[host].data[index]; }
  sim::Fabric& fabric() { return fabric_; }

 private:
  struct Host {
    std::vector<sim::NicId> data;
    std::vector<int32_t> numa;
    sim::NicId mgmt = 0;
  };
  sim::Prng root_;
  sim::Scheduler sched_;
  sim::Fabric fabric_;
  std::vector<Host> hosts_;
  std::function<absl::StatusOr<std::vector<transport::NicIndex>>(const std::string&)> near_nics_;
  EngineOptions engine_options_ = [] {
    EngineOptions o;
    o.slice_bytes = 16 << 10;
    return o;
  }();
};

}  // namespace kvferry

#endif  // KVFERRY_ENGINE_TESTING_SIM_WORLD_H_
