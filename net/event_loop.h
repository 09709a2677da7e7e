// One thread that waits on many file descriptors (epoll) and timers, and runs
// their callbacks. The handshake server and the TCP data port's accept run on
// event loops instead of a thread per connection: a connection costs a few
// hundred bytes of state, not a thread, and no peer can make the process
// spawn.
//
// Threading: Watch/Modify/Unwatch/After/Cancel are called on the loop's own
// thread (from a callback, or through Post/Run from any other thread).
// Callbacks run on the loop thread and must not block.
#ifndef KVFERRY_NET_EVENT_LOOP_H_
#define KVFERRY_NET_EVENT_LOOP_H_

#include <sys/epoll.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "net/socket.h"

namespace kvferry {
namespace net {

class EventLoop {
 public:
  // Called with the epoll events (EPOLLIN, EPOLLOUT, EPOLLERR, EPOLLHUP…).
  using FdCallback = std::function<void(uint32_t events)>;

  // Starts the loop's thread. kResourceExhausted when the thread or the
  // epoll instance cannot be created (never a terminate).
  static absl::StatusOr<std::unique_ptr<EventLoop>> Start(std::string name);
  // Stops the thread; callbacks still registered are dropped unrun.
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Loop thread only. Level-triggered.
  absl::Status Watch(int fd, uint32_t events, FdCallback callback);
  absl::Status Modify(int fd, uint32_t events);
  // Safe inside the fd's own callback; no event for `fd` is delivered after.
  void Unwatch(int fd);

  // Loop thread only: runs `fn` once after `delay`. Returns an id for
  // Cancel (which is a no-op for a timer that ran).
  uint64_t After(absl::Duration delay, std::function<void()> fn);
  void Cancel(uint64_t timer);

  // Any thread: runs `fn` on the loop thread soon.
  void Post(std::function<void()> fn);
  // Any thread but the loop's: runs `fn` on the loop thread and returns when
  // it has run. On the loop thread itself it runs `fn` at once.
  void Run(std::function<void()> fn);
  bool InLoopThread() const { return std::this_thread::get_id() == thread_id_; }

 private:
  explicit EventLoop(std::string name);
  void Loop();
  void RunPosted();
  int NextTimeoutMs() const;
  void RunDueTimers();

  const std::string name_;
  Fd epoll_;
  Fd wake_;  // eventfd: Post wakes the loop
  std::thread thread_;
  std::thread::id thread_id_;
  bool stopping_ = false;  // loop thread only

  struct Watcher {
    uint32_t generation;
    std::shared_ptr<FdCallback> callback;
  };
  absl::flat_hash_map<int, Watcher> watchers_;  // loop thread only
  uint32_t next_generation_ = 1;
  // Timers by (due time, id).
  std::map<std::pair<absl::Time, uint64_t>, std::function<void()>> timers_;
  absl::flat_hash_map<uint64_t, absl::Time> timer_due_;
  uint64_t next_timer_ = 1;

  Mutex mu_;
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
};

// Loop thread only: accepts every connection that arrives on `listener`
// (made non-blocking here) as a non-blocking, close-on-exec fd and passes it
// to `admit`. When accept fails for want of descriptors or memory, the
// listener pauses for `pause` (no spinning on a listener that stays
// readable), and `paused` is told why.
absl::Status ServeListener(EventLoop* loop, int listener, std::function<void(Fd)> admit,
                           std::function<void(int error)> paused,
                           absl::Duration pause = absl::Milliseconds(100));

}  // namespace net
}  // namespace kvferry

#endif  // KVFERRY_NET_EVENT_LOOP_H_
