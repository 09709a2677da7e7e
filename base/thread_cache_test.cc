#include "base/thread_cache.h"

#include <atomic>
#include <set>
#include <thread>

#include "absl/time/clock.h"
#include "base/mutex.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace {

TEST(ThreadCacheTest, PrestartedThreadsRunTasksWithoutStartingNew) {
  ThreadCache cache("test", 4);
  cache.Prestart(2);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (cache.idle() < 2 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(cache.idle(), 2u);
  Mutex mu;
  std::set<std::thread::id> ids;
  for (int round = 0; round < 5; ++round) {
    auto task = cache.Run([&] {
      MutexLock l(&mu);
      ids.insert(std::this_thread::get_id());
    });
    ASSERT_TRUE(task.ok());
    task->Join();
    EXPECT_FALSE(task->joinable());
    // Joined means the task ended; its thread is back among the idle ones a
    // moment later (the next Run would otherwise start another).
    while (cache.idle() < 2 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  }
  // Each task went to a warm thread: at most the two prestarted ones ran them.
  EXPECT_LE(ids.size(), 2u);
  EXPECT_EQ(ids.count(std::this_thread::get_id()), 0u);
}

TEST(ThreadCacheTest, ConcurrentTasksGetTheirOwnThreadsAndIdleOnesAreCapped) {
  ThreadCache cache("test", 1);
  std::atomic<int> running{0};
  std::atomic<bool> release{false};
  std::vector<ThreadCache::Task> tasks;
  for (int i = 0; i < 3; ++i) {
    auto t = cache.Run([&] {
      ++running;
      while (!release) absl::SleepFor(absl::Milliseconds(1));
    });
    ASSERT_TRUE(t.ok());
    tasks.push_back(std::move(*t));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (running < 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(running, 3);  // all three at once: three threads
  release = true;
  for (auto& t : tasks) t.Join();
  while (cache.idle() < 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(cache.idle(), 1u);  // two of the three left
}

}  // namespace
}  // namespace kvferry
