#include "net/event_loop.h"

#include <sys/epoll.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/errno_status.h"
#include "base/thread.h"

namespace kvferry {
namespace net {

namespace {
constexpr int kMaxEvents = 64;
uint64_t Pack(uint32_t generation, int fd) {
  return (static_cast<uint64_t>(generation) << 32) | static_cast<uint32_t>(fd);
}
}  // namespace

EventLoop::EventLoop(std::string name) : name_(std::move(name)) {}

absl::StatusOr<std::unique_ptr<EventLoop>> EventLoop::Start(std::string name) {
  std::unique_ptr<EventLoop> loop(new EventLoop(std::move(name)));
  loop->epoll_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
  if (!loop->epoll_.valid()) return ErrnoError(errno, "epoll_create1");
  loop->wake_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!loop->wake_.valid()) return ErrnoError(errno, "eventfd");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = Pack(0, loop->wake_.get());
  if (::epoll_ctl(loop->epoll_.get(), EPOLL_CTL_ADD, loop->wake_.get(), &ev) != 0) {
    return ErrnoError(errno, "epoll_ctl");
  }
  EventLoop* raw = loop.get();
  absl::StatusOr<std::thread> thread =
      StartThread(absl::StrCat("event loop ", raw->name_), [raw] { raw->Loop(); });
  if (!thread.ok()) return thread.status();
  loop->thread_id_ = thread->get_id();
  loop->thread_ = std::move(*thread);
  return loop;
}

EventLoop::~EventLoop() {
  if (thread_.joinable()) {
    Post([this] { stopping_ = true; });
    thread_.join();
  }
}

absl::Status EventLoop::Watch(int fd, uint32_t events, FdCallback callback) {
  const uint32_t generation = next_generation_++;
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = Pack(generation, fd);
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
    return ErrnoError(errno, "epoll_ctl(ADD)");
  }
  watchers_[fd] = Watcher{generation, std::make_shared<FdCallback>(std::move(callback))};
  return absl::OkStatus();
}

absl::Status EventLoop::Modify(int fd, uint32_t events) {
  auto it = watchers_.find(fd);
  if (it == watchers_.end()) return absl::NotFoundError(absl::StrCat("fd ", fd, " not watched"));
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = Pack(it->second.generation, fd);
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, fd, &ev) != 0) {
    return ErrnoError(errno, "epoll_ctl(MOD)");
  }
  return absl::OkStatus();
}

void EventLoop::Unwatch(int fd) {
  if (watchers_.erase(fd) == 0) return;
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
}

uint64_t EventLoop::After(absl::Duration delay, std::function<void()> fn) {
  const uint64_t id = next_timer_++;
  const absl::Time due = absl::Now() + delay;
  timers_.emplace(std::make_pair(due, id), std::move(fn));
  timer_due_[id] = due;
  return id;
}

void EventLoop::Cancel(uint64_t timer) {
  auto it = timer_due_.find(timer);
  if (it == timer_due_.end()) return;
  timers_.erase(std::make_pair(it->second, timer));
  timer_due_.erase(it);
}

void EventLoop::Post(std::function<void()> fn) {
  {
    MutexLock lock(&mu_);
    posted_.push_back(std::move(fn));
  }
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void EventLoop::Run(std::function<void()> fn) {
  if (InLoopThread()) {
    fn();
    return;
  }
  Mutex done_mu;
  CondVar done_cv;
  bool done = false;
  Post([&] {
    fn();
    MutexLock lock(&done_mu);
    done = true;
    done_cv.SignalAll();
  });
  MutexLock lock(&done_mu);
  while (!done) done_cv.Wait(&done_mu);
}

void EventLoop::RunPosted() {
  uint64_t count;
  (void)!::read(wake_.get(), &count, sizeof count);
  std::vector<std::function<void()>> posted;
  {
    MutexLock lock(&mu_);
    posted.swap(posted_);
  }
  for (auto& fn : posted) fn();
}

int EventLoop::NextTimeoutMs() const {
  if (timers_.empty()) return -1;
  const absl::Duration left = timers_.begin()->first.first - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  // Round up so a timer never runs early.
  return static_cast<int>(
      std::min<int64_t>(absl::ToInt64Milliseconds(left + absl::Microseconds(999)), 60'000));
}

void EventLoop::RunDueTimers() {
  const absl::Time now = absl::Now();
  while (!timers_.empty() && timers_.begin()->first.first <= now) {
    auto node = timers_.extract(timers_.begin());
    timer_due_.erase(node.key().second);
    node.mapped()();
  }
}

void EventLoop::Loop() {
  epoll_event events[kMaxEvents];
  while (!stopping_) {
    const int n = ::epoll_wait(epoll_.get(), events, kMaxEvents, NextTimeoutMs());
    for (int i = 0; i < n && !stopping_; ++i) {
      const int fd = static_cast<int>(events[i].data.u64 & 0xffffffffu);
      const uint32_t generation = static_cast<uint32_t>(events[i].data.u64 >> 32);
      if (generation == 0 && fd == wake_.get()) {
        RunPosted();
        continue;
      }
      auto it = watchers_.find(fd);
      // Unwatched (and maybe the number reused) since epoll_wait returned.
      if (it == watchers_.end() || it->second.generation != generation) continue;
      std::shared_ptr<FdCallback> callback = it->second.callback;
      (*callback)(events[i].events);
    }
    if (!stopping_) RunDueTimers();
  }
}

absl::Status ServeListener(EventLoop* loop, int listener, std::function<void(Fd)> admit,
                           std::function<void(int error)> paused, absl::Duration pause) {
  const int flags = ::fcntl(listener, F_GETFL);
  if (flags < 0 || ::fcntl(listener, F_SETFL, flags | O_NONBLOCK) != 0) {
    return ErrnoError(errno, "fcntl(O_NONBLOCK) on a listener");
  }
  auto on_ready = [loop, listener, admit = std::move(admit), paused = std::move(paused),
                   pause](uint32_t) {
    for (int i = 0; i < 64; ++i) {
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        admit(Fd(fd));
        continue;
      }
      const int error = errno;
      if (error == EINTR || error == ECONNABORTED) continue;
      if (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) {
        paused(error);
        (void)loop->Modify(listener, 0);
        loop->After(pause, [loop, listener] { (void)loop->Modify(listener, EPOLLIN); });
      }
      return;  // EAGAIN: all taken; or paused
    }
  };
  return loop->Watch(listener, EPOLLIN, std::move(on_ready));
}

}  // namespace net
}  // namespace kvferry
