// An annotated mutex for the whole project. Debian's absl::Mutex is not
// instrumented for ThreadSanitizer, so kvferry locks through std::mutex
// (which TSan sees) wrapped with Clang's thread-safety annotations (which
// -Wthread-safety checks). Use it with ABSL_GUARDED_BY on the state it guards.
#ifndef KVFERRY_BASE_MUTEX_H_
#define KVFERRY_BASE_MUTEX_H_

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <shared_mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvferry {

// Tells the CPU that the caller is spinning (a no-op where there is no
// such hint).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  // A lock with a place in a lock order: a thread that holds a lock of
  // level L takes only locks of a higher level (1 to 31; the default, 0,
  // is outside any order). Debug builds (no NDEBUG: every test) abort on a
  // lock taken out of order, so the order a type declares is the order the
  // code keeps.
  explicit constexpr Mutex(int level) : level_(level) {}
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  // Tries for a moment before it sleeps: the project's critical sections
  // are short, and a futex sleep and wake-up (two system calls, costly in a
  // virtual machine) cost far more than waiting for the holder to leave.
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
    Enter();
    for (int i = 0; i < kSpins; ++i) {
      if (mu_.try_lock()) return;
      CpuRelax();
    }
    mu_.lock();
  }
  // Leave() reads level_ while the lock is still held: once unlocked, the
  // mutex may already be gone (a waiter that owns it returns and frees it).
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    Leave();
    mu_.unlock();
  }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) {
    Enter();
    if (mu_.try_lock()) return true;
    Leave();
    return false;
  }
  int level() const { return level_; }
  // Documents (for the analysis) that the caller holds the lock.
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  static constexpr int kSpins = 200;
#ifndef NDEBUG
  // The levels of the ordered locks this thread holds, one bit each.
  static uint32_t& Held() {
    thread_local uint32_t held = 0;
    return held;
  }
  void Enter() const {
    if (level_ == 0) return;
    const uint32_t bit = uint32_t{1} << level_;
    if ((Held() & ~(bit - 1)) != 0) {
      std::fprintf(stderr, "lock order: a lock of level %d taken while holding levels 0x%x\n",
                   level_, static_cast<unsigned>(Held()));
      std::abort();
    }
    Held() |= bit;
  }
  void Leave() const {
    if (level_ != 0) Held() &= ~(uint32_t{1} << level_);
  }
#else
  void Enter() const {}
  void Leave() const {}
#endif
  const int level_ = 0;
  std::mutex mu_;
};

// Scoped lock for Mutex.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A reader/writer lock (std::shared_mutex, which TSan sees) with
// annotations. Readers: ReaderMutexLock; writers: WriterMutexLock.
class ABSL_LOCKABLE SharedMutex {
 public:
  SharedMutex() = default;
  SharedMutex(const SharedMutex&) = delete;
  SharedMutex& operator=(const SharedMutex&) = delete;
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { mu_.lock_shared(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(SharedMutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->ReaderLock();
  }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  SharedMutex* const mu_;
};

class ABSL_SCOPED_LOCKABLE WriterMutexLock {
 public:
  explicit WriterMutexLock(SharedMutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~WriterMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  WriterMutexLock(const WriterMutexLock&) = delete;
  WriterMutexLock& operator=(const WriterMutexLock&) = delete;

 private:
  SharedMutex* const mu_;
};

// Condition variable bound to a Mutex held by the caller.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Atomically releases `mu`, waits for a signal, and reacquires `mu`.
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // Like Wait, but gives up after `timeout`. Returns true on timeout.
  bool WaitWithTimeout(Mutex* mu, absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    bool timed_out =
        cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout)) == std::cv_status::timeout;
    lock.release();
    return timed_out;
  }
  // Waits until ready() holds (checked with `mu` held) or `deadline`
  // passes; returns ready(). The one deadline loop the project uses.
  template <typename Ready>
  bool AwaitWithDeadline(Mutex* mu, absl::Time deadline, Ready ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (!ready()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      WaitWithTimeout(mu, std::min(left, absl::Hours(1)));
    }
    return true;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace kvferry

#endif  // KVFERRY_BASE_MUTEX_H_
