#include "base/mutex.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "base/clock.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace {

TEST(Mutex, SerialisesIncrements) {
  Mutex mu;
  long counter = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        MutexLock lock(&mu);
        ++counter;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter, 40000);
}

TEST(SharedMutex, ReadersShareWritersExclude) {
  SharedMutex mu;
  long value = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 5000; ++i) {
        WriterMutexLock lock(&mu);
        ++value;
      }
    });
    threads.emplace_back([&] {
      for (int i = 0; i < 5000; ++i) {
        ReaderMutexLock lock(&mu);
        EXPECT_GE(value, 0);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(value, 10000);
}

TEST(CondVar, WakesWaiterAndTimesOut) {
  Mutex mu;
  CondVar cv;
  bool ready = false;
  std::thread producer([&] {
    MutexLock lock(&mu);
    ready = true;
    cv.SignalAll();
  });
  {
    MutexLock lock(&mu);
    while (!ready) cv.Wait(&mu);
  }
  producer.join();
  MutexLock lock(&mu);
  EXPECT_TRUE(cv.WaitWithTimeout(&mu, absl::Milliseconds(1)));
}

TEST(CondVar, AwaitWithDeadlineReturnsWhenReadyOrLate) {
  Mutex mu;
  CondVar cv;
  bool ready = false;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(5));
    MutexLock lock(&mu);
    ready = true;
    cv.SignalAll();
  });
  {
    MutexLock lock(&mu);
    EXPECT_TRUE(cv.AwaitWithDeadline(&mu, absl::Now() + absl::Seconds(10),
                                     [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return ready; }));
  }
  setter.join();
  MutexLock lock(&mu);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(cv.AwaitWithDeadline(&mu, start + absl::Milliseconds(20), []() { return false; }));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(20));
}

TEST(Clock, RealClockAdvancesBySleep) {
  Clock* clock = RealClock();
  absl::Time before = clock->Now();
  clock->SleepFor(absl::Milliseconds(2));
  EXPECT_GE(clock->Now() - before, absl::Milliseconds(2));
  EXPECT_EQ(RealClock(), clock);
}

}  // namespace
// A waiter may free the mutex as soon as the signaller unlocks it: Unlock
// touches nothing of the mutex after the release (TSan saw a read of the
// level after it, when the lock order was checked after unlocking).
TEST(MutexTest, AWaiterMayFreeTheMutexOnceItIsUnlocked) {
  for (int round = 0; round < 200; ++round) {
    auto mu = std::make_unique<Mutex>(3);
    CondVar cv;
    bool done = false;
    std::thread signaller([&] {
      MutexLock lock(mu.get());
      done = true;
      cv.SignalAll();
    });
    {
      MutexLock lock(mu.get());
      while (!done) cv.Wait(mu.get());
    }
    mu.reset();
    signaller.join();
  }
}

#ifndef NDEBUG
// Taking ordered locks out of order on purpose: not for the analysis.
void TakeHighThenLow(Mutex* high, Mutex* low) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  MutexLock b(high);
  MutexLock a(low);
}
void TakeTwice(Mutex* mu) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  MutexLock a(mu);
  MutexLock again(mu);  // the same level twice: also out of order
}

// Ordered locks: taken in their levels' order they work; a lower level
// taken while a higher one is held aborts, with the levels named.
TEST(MutexTest, LocksOfALevelComeInOrder) {
  Mutex low(1), high(2), unordered;
  {
    MutexLock a(&low);
    MutexLock b(&high);
    MutexLock c(&unordered);
  }
  {
    MutexLock b(&high);  // alone: fine
  }
  if (low.TryLock()) {
    low.Unlock();
  } else {
    ADD_FAILURE() << "an unheld ordered lock refused TryLock";
  }
  EXPECT_DEATH(TakeHighThenLow(&high, &low), "lock order: a lock of level 1 taken while holding");
  EXPECT_DEATH(TakeTwice(&low), "lock order");
}
#endif

}  // namespace kvferry
