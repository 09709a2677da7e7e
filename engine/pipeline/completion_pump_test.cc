#include "engine/pipeline/completion_pump.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace engine_internal {
namespace {

// A one-shot event on std primitives (visible to ThreadSanitizer).
class Event {
 public:
  void Notify() {
    std::lock_guard<std::mutex> l(mu_);
    set_ = true;
    cv_.notify_all();
  }
  void WaitForNotification() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return set_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

// A poll that finds nothing in the transport.
bool kNothing() { return false; }

// A thread whose wait another thread satisfies is woken by Wake while the
// driver is still inside the transport: it never waits out a timer (the
// deadline here is an hour; without the wake-up the test times out).
TEST(CompletionPump, WaiterIsWokenWhileAnotherThreadDrives) {
  CompletionPump pump(RealClock());
  Event driving, release_driver;
  std::atomic<bool> driver_ready{false}, waiter_ready{false};
  std::atomic<int> drives{0};
  std::thread driver([&] {
    EXPECT_TRUE(pump.Await([&] { return driver_ready.load(); }, absl::Hours(1),
                           [&](absl::Time) {
                             ++drives;
                             driving.Notify();
                             release_driver.WaitForNotification();  // "in the transport"
                             driver_ready = true;
                           },
                           kNothing));
  });
  driving.WaitForNotification();
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    EXPECT_TRUE(pump.Await([&] { return waiter_ready.load(); }, absl::Hours(1),
                           [&](absl::Time) { ADD_FAILURE() << "a second driver ran"; }, kNothing));
    returned = true;
  });
  waiter_ready = true;  // its batch completed, collected by the driver
  pump.Wake();
  waiter.join();  // returns although the driver has not left
  EXPECT_TRUE(returned);
  EXPECT_FALSE(driver_ready);
  release_driver.Notify();
  driver.join();
  EXPECT_EQ(drives.load(), 1);
}

// Waiters are woken by lane: a Wake of the waiter's lane wakes it while the
// driver is still inside the transport (a Wake of another lane would not:
// the waiter would sleep until the driver left, which it does only after
// the waiter returned, and the test would time out).
TEST(CompletionPump, WakeReachesTheWaitersOfItsLane) {
  CompletionPump pump(RealClock());
  Event driving, release_driver;
  std::atomic<bool> driver_ready{false}, waiter_ready{false};
  std::thread driver([&] {
    EXPECT_TRUE(pump.Await([&] { return driver_ready.load(); }, absl::Hours(1),
                           [&](absl::Time) {
                             driving.Notify();
                             release_driver.WaitForNotification();
                             driver_ready = true;
                           },
                           kNothing, /*lane=*/2));
  });
  driving.WaitForNotification();
  std::thread waiter([&] {
    EXPECT_TRUE(pump.Await([&] { return waiter_ready.load(); }, absl::Hours(1),
                           [&](absl::Time) { ADD_FAILURE() << "a second driver ran"; }, kNothing,
                           /*lane=*/5));
  });
  absl::SleepFor(absl::Milliseconds(50));  // asleep by now, most likely
  waiter_ready = true;
  pump.Wake(5);
  waiter.join();
  EXPECT_FALSE(driver_ready);
  release_driver.Notify();
  driver.join();
}

// When the driver leaves (its own batch done), a waiter takes over driving.
TEST(CompletionPump, WaiterTakesOverWhenTheDriverLeaves) {
  CompletionPump pump(RealClock());
  Event driving, release_driver;
  std::atomic<bool> first_done{false}, second_done{false};
  std::atomic<int> second_drove{0};
  std::thread first([&] {
    pump.Await([&] { return first_done.load(); }, absl::Hours(1),
               [&](absl::Time) {
                 driving.Notify();
                 release_driver.WaitForNotification();
                 first_done = true;
               },
               kNothing);
  });
  driving.WaitForNotification();
  std::thread second([&] {
    pump.Await([&] { return second_done.load(); }, absl::Hours(1),
               [&](absl::Time) {
                 ++second_drove;
                 second_done = true;
               },
               kNothing);
  });
  release_driver.Notify();
  first.join();
  second.join();
  EXPECT_EQ(second_drove.load(), 1);
}

TEST(CompletionPump, DeadlinePassesWithoutReady) {
  CompletionPump pump(RealClock());
  int drives = 0;
  EXPECT_FALSE(pump.Await([] { return false; }, absl::Milliseconds(20),
                          [&](absl::Time until) {
                            ++drives;
                            absl::SleepFor(std::max(absl::ZeroDuration(), until - absl::Now()));
                          },
                          kNothing));
  EXPECT_GE(drives, 1);
  EXPECT_TRUE(pump.TryDrive([] {}));
}

// A clock that counts its readings and moves on by `step` at each.
class CountingClock : public Clock {
 public:
  explicit CountingClock(absl::Duration step) : step_(step) {}
  absl::Time Now() const override {
    ++reads;
    return now_ += step_;
  }
  void SleepFor(absl::Duration d) override { now_ += d; }
  mutable int reads = 0;

 private:
  const absl::Duration step_;
  mutable absl::Time now_ = absl::UnixEpoch();
};

// What is done at the first look, or found by the first poll, costs no
// reading of the clock (the deadline is set when the clock is first read);
// the timeout still counts from then.
TEST(CompletionPump, ReadsTheClockOnlyWhenItMustWait) {
  CountingClock clock(absl::Milliseconds(1));
  CompletionPump pump(&clock);
  auto no_drive = [](absl::Time) { ADD_FAILURE() << "drove"; };
  EXPECT_TRUE(pump.Await([] { return true; }, absl::Seconds(1), no_drive, kNothing));
  EXPECT_EQ(clock.reads, 0);
  bool ready = false;
  EXPECT_TRUE(pump.Await([&] { return ready; }, absl::Seconds(1), no_drive,
                         [&] {
                           ready = true;
                           return true;
                         }));
  EXPECT_EQ(clock.reads, 0);
  // Nothing comes: the driver waits until the deadline, 5 ms of this clock
  // after its first reading.
  int drives = 0;
  EXPECT_FALSE(pump.Await([] { return false; }, absl::Milliseconds(5),
                          [&](absl::Time) { ++drives; }, kNothing));
  EXPECT_GE(clock.reads, 5);
  EXPECT_LE(clock.reads, 7);
  EXPECT_GE(drives, 3);
}

// What a poll finds is delivered without the driver's turn: the waiter
// never drives, and returns while another thread drives.
TEST(CompletionPump, PollDeliversWithoutDriving) {
  CompletionPump pump(RealClock());
  EXPECT_FALSE(pump.Delivered());  // no driver
  bool ready = false;
  int polls = 0;
  EXPECT_TRUE(pump.Await([&] { return ready; }, absl::Hours(1),
                         [&](absl::Time) { ADD_FAILURE() << "drove"; },
                         [&] {
                           ++polls;
                           ready = true;  // "its completion was in the transport"
                           pump.Delivered();
                           return true;
                         }));
  EXPECT_EQ(polls, 1);
}

// A poller that delivered what the driver waits for learns that a driver
// waits (and interrupts its wait in the transport): the driver returns
// without another completion coming.
TEST(CompletionPump, PollerInterruptsTheDriversWait) {
  CompletionPump pump(RealClock());
  Event driving, interrupted;
  std::atomic<bool> driver_ready{false}, waiter_ready{false};
  std::thread driver([&] {
    EXPECT_TRUE(pump.Await([&] { return driver_ready.load(); }, absl::Hours(1),
                           [&](absl::Time) {
                             driving.Notify();
                             interrupted.WaitForNotification();  // "in the transport"
                           },
                           kNothing));
  });
  driving.WaitForNotification();
  std::atomic<int> interrupts{0};
  EXPECT_TRUE(pump.Await([&] { return waiter_ready.load(); }, absl::Hours(1),
                         [&](absl::Time) { ADD_FAILURE() << "a second driver ran"; },
                         [&] {
                           // Takes both completions, the driver's and its own.
                           driver_ready = true;
                           waiter_ready = true;
                           if (pump.Delivered()) {
                             ++interrupts;
                             interrupted.Notify();
                           }
                           return true;
                         }));
  driver.join();  // returns: without the interrupt it would wait for ever
  EXPECT_EQ(interrupts.load(), 1);
  EXPECT_FALSE(pump.Delivered());  // the driver left
}

// Completions of other batches that keep coming do not keep a waiter past
// its deadline (without the bound this test never returns).
TEST(CompletionPump, DeadlineHoldsWhilePollsDeliverOthers) {
  CompletionPump pump(RealClock());
  int polls = 0;
  const absl::Time start = absl::Now();
  EXPECT_FALSE(pump.Await([] { return false; }, absl::Milliseconds(20),
                          [&](absl::Time) { ADD_FAILURE() << "drove"; },
                          [&] {
                            ++polls;
                            pump.Delivered();  // someone else's completion
                            return true;
                          }));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(20));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_GT(polls, 1);
}

}  // namespace
}  // namespace engine_internal
}  // namespace kvferry
