// Test harness for SimTransport: one scheduler and fabric; every new
// transport is a new node with `nics_per_node` NICs. Used by the
// conformance suite and the sim transport's own tests.
#ifndef KVFERRY_TRANSPORT_SIM_SIM_HARNESS_H_
#define KVFERRY_TRANSPORT_SIM_SIM_HARNESS_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "sim/fabric.h"
#include "sim/prng.h"
#include "sim/scheduler.h"
#include "transport/sim/sim_transport.h"
#include "transport/testing/conformance.h"

namespace kvferry {
namespace transport {

class SimHarness : public testing::TransportHarness {
 public:
  explicit SimHarness(uint64_t seed, sim::FaultOptions faults = {}, int nics_per_node = 2)
      : root_(seed), fabric_(&sched_, root_.Next64(), faults), nics_per_node_(nics_per_node) {}

  // A transport on a new node (or on `node` when given, e.g. a restart).
  absl::StatusOr<std::unique_ptr<SimTransport>> NewSimTransport(int node = -1,
                                                                SimTransportOptions options = {}) {
    if (node < 0) {
      node = static_cast<int>(
          fabric_.topology().AddNode(absl::StrCat("n", fabric_.topology().node_count())));
      std::vector<sim::NicId> nics;
      for (int i = 0; i < nics_per_node_; ++i) {
        auto nic = fabric_.topology().AddNic(node, nic_spec_);
        if (!nic.ok()) return nic.status();
        nics.push_back(*nic);
      }
      node_nics_.push_back(std::move(nics));
    }
    options.nics = node_nics_.at(node);
    return SimTransport::Create(&fabric_, std::move(options), root_.Next64());
  }

  absl::StatusOr<std::unique_ptr<Transport>> NewTransport() override {
    auto t = NewSimTransport();
    if (!t.ok()) return t.status();
    peer_loss_bound_ = (*t)->PeerLossBound();
    return std::unique_ptr<Transport>(std::move(*t));
  }
  Clock* clock() override { return &sched_; }
  absl::Duration PeerLossBound() override { return peer_loss_bound_; }
  absl::Duration OperationTimeout() override { return absl::Seconds(10); }

  sim::Scheduler& scheduler() { return sched_; }
  sim::Fabric& fabric() { return fabric_; }
  const std::vector<sim::NicId>& nics_of(int node) const { return node_nics_.at(node); }
  void set_nic_spec(sim::NicSpec spec) { nic_spec_ = spec; }

 private:
  sim::Prng root_;
  sim::Scheduler sched_;
  sim::Fabric fabric_;
  int nics_per_node_;
  sim::NicSpec nic_spec_;
  std::vector<std::vector<sim::NicId>> node_nics_;
  absl::Duration peer_loss_bound_ = absl::Milliseconds(100);
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_SIM_SIM_HARNESS_H_
