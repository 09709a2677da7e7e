#include "sim/fault_injector.h"

#include <utility>

namespace kvferry {
namespace sim {

FaultInjector::FaultInjector(Fabric* fabric, uint64_t seed, FaultSchedule schedule, NodeFn on_crash,
                             NodeFn on_restart)
    : fabric_(fabric),
      sched_(fabric->scheduler()),
      prng_(seed),
      schedule_(schedule),
      phase_(ToSimTime(schedule.fault_phase)),
      max_outage_(ToSimTime(schedule.max_outage)),
      on_crash_(std::move(on_crash)),
      on_restart_(std::move(on_restart)),
      owner_(sched_->NewOwner()) {}

FaultInjector::~FaultInjector() { sched_->CancelOwner(owner_); }

void FaultInjector::Start() {
  start_ = sched_->now();
  sched_->After(
      0, [this] { Tick(); }, owner_);
  if (schedule_.clear_message_faults_after) {
    sched_->After(
        phase_, [this] { fabric_->set_faults(FaultOptions{}); }, owner_);
  }
}

SimTime FaultInjector::Outage() {
  const SimTime lo = ToSimTime(schedule_.min_outage);
  return prng_.UniformIn(lo, max_outage_ > lo ? max_outage_ : lo);
}

void FaultInjector::Tick() {
  if (sched_->now() - start_ >= phase_) return;
  const size_t nodes = fabric_->topology().node_count();
  const size_t nics = fabric_->topology().nic_count();
  // Draws happen in a fixed order whatever the outcome, so one decision
  // never shifts the randomness of another.
  const bool partition = prng_.Chance(schedule_.partition);
  const NodeId pa = nodes ? static_cast<NodeId>(prng_.Uniform(nodes)) : 0;
  const NodeId pb = nodes ? static_cast<NodeId>(prng_.Uniform(nodes)) : 0;
  const SimTime partition_outage = Outage();
  const bool nic_down = prng_.Chance(schedule_.nic_down);
  const NicId nic = nics ? static_cast<NicId>(prng_.Uniform(nics)) : 0;
  const SimTime nic_outage = Outage();
  const bool crash = prng_.Chance(schedule_.crash);
  const NodeId victim = nodes ? static_cast<NodeId>(prng_.Uniform(nodes)) : 0;
  const SimTime crash_outage = Outage();

  if (partition && pa != pb) {
    ++counts_.partitions;
    fabric_->topology().Partition({pa}, {pb});
    sched_->After(
        partition_outage,
        [this, pa, pb] {
          fabric_->topology().HealPair(pa, pb);
          ++counts_.repairs;
        },
        owner_);
  }
  if (nic_down && nics && fabric_->topology().IsNicUp(nic)) {
    ++counts_.nic_downs;
    fabric_->topology().SetNicUp(nic, false);
    sched_->After(
        nic_outage,
        [this, nic] {
          fabric_->topology().SetNicUp(nic, true);
          ++counts_.repairs;
        },
        owner_);
  }
  if (crash && nodes && fabric_->topology().IsNodeUp(victim)) {
    ++counts_.crashes;
    fabric_->topology().SetNodeUp(victim, false);
    if (on_crash_) on_crash_(victim);
    sched_->After(
        crash_outage,
        [this, victim] {
          fabric_->topology().SetNodeUp(victim, true);
          ++counts_.repairs;
          if (on_restart_) on_restart_(victim);
        },
        owner_);
  }
  sched_->After(
      ToSimTime(schedule_.tick), [this] { Tick(); }, owner_);
}

}  // namespace sim
}  // namespace kvferry
