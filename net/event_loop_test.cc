#include "net/event_loop.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <vector>

#include "absl/time/clock.h"
#include "base/mutex.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace net {
namespace {

TEST(EventLoopTest, RunsPostedWorkOnItsThreadAndRunWaits) {
  auto loop = EventLoop::Start("test");
  ASSERT_TRUE(loop.ok()) << loop.status();
  bool in_loop = false;
  (*loop)->Run([&] { in_loop = (*loop)->InLoopThread(); });
  EXPECT_TRUE(in_loop);
  EXPECT_FALSE((*loop)->InLoopThread());
}

TEST(EventLoopTest, DeliversReadinessUntilUnwatched) {
  auto loop = EventLoop::Start("test");
  ASSERT_TRUE(loop.ok());
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
  Fd a(sv[0]), b(sv[1]);
  std::atomic<int> bytes{0};
  std::atomic<int> calls{0};
  (*loop)->Run([&] {
    ASSERT_TRUE((*loop)
                    ->Watch(a.get(), EPOLLIN,
                            [&](uint32_t) {
                              char buf[16];
                              ++calls;
                              ssize_t n = ::read(a.get(), buf, sizeof buf);
                              if (n > 0) bytes += static_cast<int>(n);
                              // Unwatch from inside its own callback.
                              if (bytes >= 6) (*loop)->Unwatch(a.get());
                            })
                    .ok());
  });
  ASSERT_EQ(::write(b.get(), "abc", 3), 3);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (bytes < 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(bytes, 3);
  ASSERT_EQ(::write(b.get(), "def", 3), 3);
  while (bytes < 6 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(bytes, 6);
  const int calls_then = calls;
  ASSERT_EQ(::write(b.get(), "ghi", 3), 3);
  // Unwatched: the loop does not call back, so the bytes stay unread.
  (*loop)->Run([] {});
  absl::SleepFor(absl::Milliseconds(20));
  (*loop)->Run([] {});
  EXPECT_EQ(calls, calls_then);
  char buf[8];
  EXPECT_EQ(::read(a.get(), buf, sizeof buf), 3);
  // Watching an fd twice is an error, not a silent replacement.
  (*loop)->Run([&] {
    ASSERT_TRUE((*loop)->Watch(a.get(), EPOLLIN, [](uint32_t) {}).ok());
    EXPECT_FALSE((*loop)->Watch(a.get(), EPOLLIN, [](uint32_t) {}).ok());
    (*loop)->Unwatch(a.get());
  });
}

TEST(EventLoopTest, TimersRunInOrderAndCancelledOnesNever) {
  auto loop = EventLoop::Start("test");
  ASSERT_TRUE(loop.ok());
  Mutex mu;
  std::vector<int> order;
  const absl::Time start = absl::Now();
  absl::Time ran_at;
  (*loop)->Run([&] {
    (*loop)->After(absl::Milliseconds(30), [&] {
      MutexLock l(&mu);
      order.push_back(3);
      ran_at = absl::Now();
    });
    (*loop)->After(absl::Milliseconds(10), [&] {
      MutexLock l(&mu);
      order.push_back(1);
    });
    const uint64_t never = (*loop)->After(absl::Milliseconds(20), [&] {
      MutexLock l(&mu);
      order.push_back(2);
    });
    (*loop)->Cancel(never);
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (;;) {
    {
      MutexLock l(&mu);
      if (order.size() >= 2 || absl::Now() > deadline) break;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  absl::SleepFor(absl::Milliseconds(20));
  MutexLock l(&mu);
  EXPECT_EQ(order, (std::vector<int>{1, 3}));
  EXPECT_GE(ran_at - start, absl::Milliseconds(30));
}

}  // namespace
}  // namespace net
}  // namespace kvferry
