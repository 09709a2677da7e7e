#include "sim/fault_injector.h"

#include <vector>

#include "gtest/gtest.h"
#include "sim/seed.h"

namespace kvferry {
namespace sim {
namespace {

struct Outcome {
  FaultCounts counts;
  std::vector<std::pair<SimTime, NodeId>> crashes, restarts;
  uint64_t hash = 0;
};

Outcome RunFaults(uint64_t seed) {
  Scheduler sched;
  Fabric fabric(&sched, seed);
  for (int n = 0; n < 4; ++n) {
    NodeId node = fabric.topology().AddNode("n");
    for (int i = 0; i < 2; ++i) EXPECT_TRUE(fabric.topology().AddNic(node, {}).ok());
  }
  FaultSchedule s;
  s.partition = {1, 4};
  s.nic_down = {1, 4};
  s.crash = {1, 10};
  s.fault_phase = absl::Milliseconds(20);
  s.max_outage = absl::Milliseconds(2);
  Outcome out;
  FaultInjector inj(
      &fabric, seed, s,
      [&](NodeId n) {
        EXPECT_FALSE(fabric.topology().IsNodeUp(n));
        out.crashes.emplace_back(sched.now(), n);
      },
      [&](NodeId n) {
        EXPECT_TRUE(fabric.topology().IsNodeUp(n));
        out.restarts.emplace_back(sched.now(), n);
      });
  inj.Start();
  // Mid-phase some fault is active at least once.
  bool saw_fault = false;
  while (sched.now() < ToSimTime(absl::Milliseconds(20))) {
    sched.RunUntil(sched.now() + ToSimTime(absl::Microseconds(100)));
    const Topology& t = fabric.topology();
    for (NicId nic = 0; nic < t.nic_count(); ++nic) saw_fault |= !t.IsNicUp(nic);
    saw_fault |= t.IsPartitioned();
  }
  EXPECT_TRUE(saw_fault);
  sched.RunUntil(inj.healed_at());
  // Healed: every NIC and node up, no partition, nothing left to run.
  const Topology& t = fabric.topology();
  for (NicId nic = 0; nic < t.nic_count(); ++nic) EXPECT_TRUE(t.IsNicUp(nic));
  EXPECT_FALSE(t.IsPartitioned());
  EXPECT_TRUE(sched.idle());
  out.counts = inj.counts();
  out.hash = sched.trace_hash();
  return out;
}

TEST(FaultInjector, SchedulesRepairsEverythingAndReplays) {
  for (uint64_t seed : SweepSeeds(1, 10)) {
    SCOPED_TRACE(ReplayCommand(seed));
    Outcome a = RunFaults(seed), b = RunFaults(seed);
    EXPECT_EQ(a.hash, b.hash);
    EXPECT_EQ(a.crashes, b.crashes);
    EXPECT_EQ(a.restarts, b.restarts);
    EXPECT_GT(a.counts.partitions + a.counts.nic_downs, 0u);
    EXPECT_EQ(a.counts.repairs, a.counts.partitions + a.counts.nic_downs + a.counts.crashes);
    EXPECT_EQ(a.crashes.size(), a.counts.crashes);
    EXPECT_EQ(a.restarts.size(), a.crashes.size());
  }
  EXPECT_NE(RunFaults(1).hash, RunFaults(2).hash);
}

TEST(FaultInjector, ClearsMessageFaultsAfterThePhase) {
  Scheduler sched;
  FaultOptions f;
  f.drop = {1, 2};
  Fabric fabric(&sched, 1, f);
  fabric.topology().AddNode("a");
  FaultSchedule s;
  s.fault_phase = absl::Milliseconds(1);
  FaultInjector inj(&fabric, 1, s);
  inj.Start();
  sched.RunUntil(ToSimTime(absl::Microseconds(500)));
  EXPECT_EQ(fabric.faults().drop.num, 1u);
  sched.RunUntil(inj.healed_at());
  EXPECT_EQ(fabric.faults().drop.num, 0u);
}

}  // namespace
}  // namespace sim
}  // namespace kvferry
