#include "base/thread_cache.h"

#include <algorithm>
#include <utility>

#include "base/thread.h"

namespace kvferry {

struct ThreadCache::Task::Done {
  Mutex mu;
  CondVar cv;
  bool done ABSL_GUARDED_BY(mu) = false;
};

void ThreadCache::Task::Join() {
  if (done_ == nullptr) return;
  {
    MutexLock lock(&done_->mu);
    while (!done_->done) done_->cv.Wait(&done_->mu);
  }
  done_.reset();
}

struct ThreadCache::Worker {
  std::thread thread;
  CondVar cv;
  std::function<void()> task;  // guarded by the cache's mu_
  bool idle = false;           // in idle_; guarded by the cache's mu_
};

ThreadCache::ThreadCache(std::string name, size_t max_idle)
    : name_(std::move(name)), max_idle_(max_idle) {}

ThreadCache::~ThreadCache() {
  std::vector<std::thread> threads;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& w : workers_) {
      w->cv.Signal();
      threads.push_back(std::move(w->thread));
    }
    for (auto& t : exited_) threads.push_back(std::move(t));
    exited_.clear();
  }
  for (auto& t : threads) {
    if (t.joinable()) t.join();
  }
}

void ThreadCache::JoinExited() {
  // Threads that have left Main (they only wait to be joined).
  for (auto& t : exited_) t.join();
  exited_.clear();
}

absl::Status ThreadCache::StartWorker(std::function<void()> first) {
  auto w = std::make_unique<Worker>();
  Worker* raw = w.get();
  raw->task = std::move(first);
  absl::StatusOr<std::thread> t = StartThread(name_, [this, raw] { Main(raw); });
  if (!t.ok()) return t.status();
  raw->thread = std::move(*t);
  workers_.push_back(std::move(w));
  return absl::OkStatus();
}

void ThreadCache::Prestart(size_t n) {
  MutexLock lock(&mu_);
  for (size_t i = 0; i < n && idle_.size() < max_idle_; ++i) {
    if (!StartWorker(nullptr).ok()) return;
    // Idle from now on, even before the thread first runs: a Run at once
    // hands it its task instead of starting another thread.
    Worker* w = workers_.back().get();
    w->idle = true;
    idle_.push_back(w);
  }
}

absl::StatusOr<ThreadCache::Task> ThreadCache::Run(std::function<void()> fn) {
  Task task;
  task.done_ = std::make_shared<Task::Done>();
  auto body = [fn = std::move(fn), done = task.done_] {
    fn();
    MutexLock lock(&done->mu);
    done->done = true;
    done->cv.SignalAll();
  };
  MutexLock lock(&mu_);
  JoinExited();
  if (!idle_.empty()) {
    Worker* w = idle_.back();
    idle_.pop_back();
    w->idle = false;
    w->task = std::move(body);
    w->cv.Signal();
    return task;
  }
  absl::Status started = StartWorker(std::move(body));
  if (!started.ok()) return started;
  return task;
}

size_t ThreadCache::idle() const {
  MutexLock lock(&mu_);
  return idle_.size();
}

void ThreadCache::Main(Worker* self) {
  mu_.Lock();
  for (;;) {
    while (!self->task && !stopping_) {
      if (!self->idle) {
        if (idle_.size() >= max_idle_) {
          // Enough idle threads: this one leaves, and is joined later.
          auto it = std::find_if(
              workers_.begin(), workers_.end(),
              [&](const std::unique_ptr<Worker>& w) { return w.get() == self; });
          exited_.push_back(std::move(self->thread));
          workers_.erase(it);  // deletes *self: touch nothing of it after
          mu_.Unlock();
          return;
        }
        idle_.push_back(self);
        self->idle = true;
      }
      self->cv.Wait(&mu_);
    }
    if (!self->task) break;  // stopping
    std::function<void()> task = std::move(self->task);
    self->task = nullptr;
    mu_.Unlock();
    task();
    task = nullptr;  // its captures die outside the lock
    mu_.Lock();
  }
  mu_.Unlock();
}

}  // namespace kvferry
