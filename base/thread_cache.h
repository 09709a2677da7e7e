// Threads kept warm for long-running tasks (a TCP link's reader and writer):
// starting a thread costs 50-200 us on a small VM, which a new peer's first
// transfer would otherwise pay several times. Run hands a task to an idle
// thread when there is one and starts a thread only when there is none; a
// thread whose task ends waits for the next one, up to `max_idle` idle
// threads (the rest exit).
#ifndef KVFERRY_BASE_THREAD_CACHE_H_
#define KVFERRY_BASE_THREAD_CACHE_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "base/mutex.h"

namespace kvferry {

class ThreadCache {
 public:
  // One task's end: Join waits for it.
  class Task {
   public:
    Task() = default;
    bool joinable() const { return done_ != nullptr; }
    void Join();

   private:
    friend class ThreadCache;
    struct Done;
    std::shared_ptr<Done> done_;
  };

  ThreadCache(std::string name, size_t max_idle);
  // Every task must have ended; stops and joins the threads.
  ~ThreadCache();
  ThreadCache(const ThreadCache&) = delete;
  ThreadCache& operator=(const ThreadCache&) = delete;

  // Starts up to `n` idle threads now (best effort: stops at the first
  // refusal).
  void Prestart(size_t n);
  // Runs `fn` on an idle thread, or a new one. kResourceExhausted when a
  // thread is needed and the system refuses it.
  absl::StatusOr<Task> Run(std::function<void()> fn);
  size_t idle() const;

 private:
  struct Worker;
  absl::Status StartWorker(std::function<void()> first) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Main(Worker* self);
  void JoinExited() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string name_;
  const size_t max_idle_;
  mutable Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<Worker>> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<Worker*> idle_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> exited_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvferry

#endif  // KVFERRY_BASE_THREAD_CACHE_H_
