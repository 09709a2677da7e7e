#include "sim/fabric.h"

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "sim/seed.h"

namespace kvferry {
namespace sim {
namespace {

struct Arrival {
  SimTime time;
  NicId from;
  std::string bytes;
};

class FabricTest : public ::testing::Test {
 protected:
  NicId AddNic(NodeId node, NicSpec spec = {}) {
    absl::StatusOr<NicId> nic = fabric_.topology().AddNic(node, spec);
    EXPECT_TRUE(nic.ok()) << nic.status();
    return *nic;
  }
  void Record(NicId nic) {
    fabric_.Attach(nic, [this](Message&& m) {
      arrivals_.push_back({sched_.now(), m.from, std::move(m.bytes)});
    });
  }

  Scheduler sched_;
  Fabric fabric_{&sched_, /*seed=*/1};
  std::vector<Arrival> arrivals_;
};

TEST_F(FabricTest, ArrivalTimeFollowsBandwidthAndLatency) {
  // 1 MiB over 8 Gb/s (1 GB/s) links with 3 us per NIC: the message arrives
  // after 2 * 3 us of latency plus 1048576 ns of serialisation.
  NicSpec spec{8'000'000'000, absl::Microseconds(3), 4096};
  NicId a = AddNic(fabric_.topology().AddNode("a"), spec);
  NicId b = AddNic(fabric_.topology().AddNode("b"), spec);
  Record(b);
  const uint64_t n = 1 << 20;
  SimTime tx_end = fabric_.Send(a, b, n, std::string("payload"));
  EXPECT_EQ(tx_end, 1048576);
  sched_.RunUntilIdle();
  ASSERT_EQ(arrivals_.size(), 1u);
  EXPECT_EQ(arrivals_[0].time, 6000 + 1048576);
  EXPECT_EQ(arrivals_[0].bytes, "payload");
  EXPECT_EQ(arrivals_[0].from, a);
}

TEST_F(FabricTest, SenderSerialisesBackToBackMessages) {
  NicSpec spec{8'000'000'000, absl::ZeroDuration(), 4096};
  NicId a = AddNic(fabric_.topology().AddNode("a"), spec);
  NicId b = AddNic(fabric_.topology().AddNode("b"), spec);
  Record(b);
  fabric_.Send(a, b, 1000, "1");
  fabric_.Send(a, b, 1000, "2");
  sched_.RunUntilIdle();
  ASSERT_EQ(arrivals_.size(), 2u);
  EXPECT_EQ(arrivals_[0].time, 1000);
  EXPECT_EQ(arrivals_[1].time, 2000);
}

TEST_F(FabricTest, TwoSendersShareOneReceiver) {
  NicSpec spec{8'000'000'000, absl::ZeroDuration(), 4096};
  NicId a = AddNic(fabric_.topology().AddNode("a"), spec);
  NicId c = AddNic(fabric_.topology().AddNode("c"), spec);
  NicId b = AddNic(fabric_.topology().AddNode("b"), spec);
  Record(b);
  fabric_.Send(a, b, 10000, "a");
  fabric_.Send(c, b, 10000, "c");
  sched_.RunUntilIdle();
  ASSERT_EQ(arrivals_.size(), 2u);
  EXPECT_EQ(arrivals_[0].time, 10000);
  EXPECT_EQ(arrivals_[1].time, 20000);  // the receiver's link is the limit
}

TEST_F(FabricTest, SlowReceiverLimitsRate) {
  NicId a = AddNic(fabric_.topology().AddNode("a"), {16'000'000'000, absl::ZeroDuration(), 4096});
  NicId b = AddNic(fabric_.topology().AddNode("b"), {8'000'000'000, absl::ZeroDuration(), 4096});
  Record(b);
  fabric_.Send(a, b, 4000, "x");
  sched_.RunUntilIdle();
  ASSERT_EQ(arrivals_.size(), 1u);
  EXPECT_EQ(arrivals_[0].time, 4000);
}

TEST_F(FabricTest, RejectsBadNics) {
  EXPECT_FALSE(fabric_.topology().AddNic(99, {}).ok());
  NodeId n = fabric_.topology().AddNode("n");
  EXPECT_EQ(fabric_.topology().AddNic(n, {0, absl::ZeroDuration(), 4096}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fabric_.topology().AddNic(n, {1000, absl::ZeroDuration(), 100}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(FabricTest, DownNicsNodesAndPartitionsDropUntilRestored) {
  NodeId na = fabric_.topology().AddNode("a");
  NodeId nb = fabric_.topology().AddNode("b");
  NicId a = AddNic(na);
  NicId b = AddNic(nb);
  Record(b);
  fabric_.topology().SetNicUp(b, false);
  fabric_.Send(a, b, 10, "nic-down");
  fabric_.topology().SetNicUp(b, true);
  fabric_.topology().SetNodeUp(na, false);
  fabric_.Send(a, b, 10, "node-down");
  fabric_.topology().SetNodeUp(na, true);
  fabric_.topology().Partition({na}, {nb});
  fabric_.Send(a, b, 10, "partitioned");
  sched_.RunUntilIdle();
  EXPECT_TRUE(arrivals_.empty());
  fabric_.topology().Heal();
  fabric_.Send(a, b, 10, "healed");
  // In flight when the receiver goes down: lost.
  fabric_.Send(a, b, 10, "lost-in-flight");
  sched_.Step();
  fabric_.topology().SetNicUp(b, false);
  sched_.RunUntilIdle();
  ASSERT_EQ(arrivals_.size(), 1u);
  EXPECT_EQ(arrivals_[0].bytes, "healed");
  EXPECT_EQ(fabric_.stats().dropped, 4u);
  EXPECT_EQ(fabric_.stats().delivered, 1u);
}

TEST_F(FabricTest, UnattachedNicDropsMessages) {
  NicId a = AddNic(fabric_.topology().AddNode("a"));
  NicId b = AddNic(fabric_.topology().AddNode("b"));
  fabric_.Send(a, b, 10, "nobody home");
  sched_.RunUntilIdle();
  EXPECT_EQ(fabric_.stats().dropped, 1u);
}

// Runs 200 messages through a lossy, jittery fabric; returns the trace hash.
uint64_t LossyRun(uint64_t seed, std::vector<std::string>* got) {
  Scheduler sched;
  FaultOptions faults;
  faults.drop = {1, 10};
  faults.delay = {1, 3};
  faults.max_delay = absl::Microseconds(50);
  Fabric fabric(&sched, seed, faults);
  NicId a = *fabric.topology().AddNic(fabric.topology().AddNode("a"), {});
  NicId b = *fabric.topology().AddNic(fabric.topology().AddNode("b"), {});
  fabric.Attach(b, [&](Message&& m) { got->push_back(std::move(m.bytes)); });
  for (int i = 0; i < 200; ++i) {
    sched.After(i * 100,
                [&fabric, a, b, i] { fabric.Send(a, b, 64 + i * 100, std::to_string(i)); });
  }
  sched.RunUntilIdle();
  return sched.trace_hash();
}

TEST(FabricFaults, SameSeedSameTraceAndLossesInRange) {
  for (uint64_t seed : SweepSeeds(100, 20)) {
    SCOPED_TRACE(ReplayCommand(seed));
    std::vector<std::string> first, second;
    uint64_t h1 = LossyRun(seed, &first);
    uint64_t h2 = LossyRun(seed, &second);
    EXPECT_EQ(h1, h2);
    EXPECT_EQ(first, second);
    // With a 1/10 per-packet drop, some but not all of 200 messages are lost.
    EXPECT_LT(first.size(), 200u);
    EXPECT_GT(first.size(), 60u);
  }
  std::vector<std::string> x, y;
  EXPECT_NE(LossyRun(1, &x), LossyRun(2, &y));
}

}  // namespace
}  // namespace sim
}  // namespace kvferry
