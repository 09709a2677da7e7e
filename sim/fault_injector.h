// Seeded fault schedules for whole-cluster simulations.
//
// A run has a fault phase and a healed phase. During the fault phase, at
// every `tick` the injector draws, in a fixed order, whether to
//   * partition a random pair of nodes,
//   * take a random NIC down,
//   * crash a random node (the test's on_crash callback destroys what ran
//     there; the node is down until the restart),
// each with its own integer ratio, and schedules the matching repair
// (heal, NIC up, node up + on_restart callback) after an outage drawn
// uniformly from [min_outage, max_outage]. No fault starts after
// `fault_phase`; every fault is repaired by healed_at(). Message-level faults
// (drop, delay, error completions) are the fabric's FaultOptions; the
// injector can switch them off at the end of the fault phase.
//
// Not thread-safe: runs on the scheduler's thread.
#ifndef KVFERRY_SIM_FAULT_INJECTOR_H_
#define KVFERRY_SIM_FAULT_INJECTOR_H_

#include <cstdint>
#include <functional>

#include "absl/time/time.h"
#include "sim/fabric.h"
#include "sim/prng.h"
#include "sim/scheduler.h"

namespace kvferry {
namespace sim {

struct FaultSchedule {
  absl::Duration tick = absl::Microseconds(200);
  Ratio partition;  // per tick
  Ratio nic_down;   // per tick
  Ratio crash;      // per tick
  absl::Duration min_outage = absl::Microseconds(100);
  absl::Duration max_outage = absl::Milliseconds(5);
  absl::Duration fault_phase = absl::Milliseconds(50);
  // Turn the fabric's drop/delay/error faults off when the fault phase ends.
  bool clear_message_faults_after = true;
};

struct FaultCounts {
  uint64_t partitions = 0;
  uint64_t nic_downs = 0;
  uint64_t crashes = 0;
  uint64_t repairs = 0;
};

class FaultInjector {
 public:
  using NodeFn = std::function<void(NodeId)>;

  // `fabric` must outlive the injector. `on_crash` runs right after a node
  // goes down, `on_restart` right after it comes back; either may be empty.
  FaultInjector(Fabric* fabric, uint64_t seed, FaultSchedule schedule,
                NodeFn on_crash = nullptr, NodeFn on_restart = nullptr);
  ~FaultInjector();
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;

  // Schedules the first tick at now(); the fault phase runs from now().
  void Start();
  // The simulated time by which every fault is repaired.
  SimTime healed_at() const { return start_ + phase_ + max_outage_; }
  const FaultCounts& counts() const { return counts_; }

 private:
  void Tick();
  SimTime Outage();

  Fabric* const fabric_;
  Scheduler* const sched_;
  Prng prng_;
  const FaultSchedule schedule_;
  const SimTime phase_;
  const SimTime max_outage_;
  NodeFn on_crash_;
  NodeFn on_restart_;
  Scheduler::OwnerId owner_;
  SimTime start_ = 0;
  FaultCounts counts_;
};

}  // namespace sim
}  // namespace kvferry

#endif  // KVFERRY_SIM_FAULT_INJECTOR_H_
