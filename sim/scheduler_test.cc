#include "sim/scheduler.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvferry {
namespace sim {
namespace {

TEST(Scheduler, RunsInTimeThenScheduleOrder) {
  Scheduler s;
  std::vector<std::string> order;
  s.At(30, [&] { order.push_back("c@30"); });
  s.At(10, [&] { order.push_back("a@10"); });
  s.At(10, [&] { order.push_back("b@10"); });  // same time: FIFO
  s.After(20, [&] {
    order.push_back("d@20");
    s.After(0, [&] { order.push_back("e@20"); });  // runs before c@30
  });
  EXPECT_EQ(s.RunUntilIdle(), 5u);
  EXPECT_EQ(order, (std::vector<std::string>{"a@10", "b@10", "d@20", "e@20",
                                             "c@30"}));
  EXPECT_EQ(s.now(), 30);
  EXPECT_TRUE(s.idle());
}

TEST(Scheduler, PastTimesRunNowAndTimeNeverGoesBack) {
  Scheduler s;
  s.RunUntil(100);
  SimTime seen = -1;
  s.At(5, [&] { seen = s.now(); });
  s.Step();
  EXPECT_EQ(seen, 100);
}

TEST(Scheduler, RunUntilStopsAtTimeAndJumpsWhenIdle) {
  Scheduler s;
  int ran = 0;
  s.At(50, [&] { ++ran; });
  s.At(150, [&] { ++ran; });
  s.RunUntil(100);
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(s.now(), 100);
  s.SleepFor(absl::Nanoseconds(1000));
  EXPECT_EQ(ran, 2);
  EXPECT_EQ(s.now(), 1100);
  EXPECT_EQ(s.Now(), absl::UnixEpoch() + absl::Nanoseconds(1100));
}

TEST(Scheduler, CancelledOwnerEventsNeverRun) {
  Scheduler s;
  Scheduler::OwnerId owner = s.NewOwner();
  int ran = 0;
  s.At(10, [&] { ran += 1; }, owner);
  s.At(20, [&] { ran += 10; });
  s.At(30, [&] { ran += 100; }, owner);
  s.CancelOwner(owner);
  s.RunUntil(25);
  EXPECT_EQ(ran, 10);
  EXPECT_TRUE(s.idle());  // the cancelled event at 30 does not count
  EXPECT_NE(s.NewOwner(), owner);
}

TEST(Scheduler, RunUntilConditionStopsEarlyOrAtDeadline) {
  Scheduler s;
  int count = 0;
  for (int i = 1; i <= 10; ++i) s.At(i * 10, [&] { ++count; });
  EXPECT_TRUE(s.RunUntilCondition([&] { return count == 3; }, 1000));
  EXPECT_EQ(s.now(), 30);
  EXPECT_FALSE(s.RunUntilCondition([&] { return count == 100; }, 75));
  EXPECT_EQ(count, 7);
  EXPECT_EQ(s.now(), 75);
}

uint64_t RunScenario(uint64_t salt) {
  Scheduler s;
  for (int i = 0; i < 20; ++i) {
    s.At((i * 7919) % 97, [&s, i, salt] { s.Trace(uint64_t(i) * salt); });
  }
  s.Trace("done");
  s.RunUntilIdle();
  return s.trace_hash();
}

TEST(Scheduler, TraceHashIsReproducibleAndSensitive) {
  EXPECT_EQ(RunScenario(3), RunScenario(3));
  EXPECT_NE(RunScenario(3), RunScenario(4));
}

}  // namespace
}  // namespace sim
}  // namespace kvferry
