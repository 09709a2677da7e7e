#include "engine/completion_pump.h"

namespace kvferry {
namespace engine_internal {

bool CompletionPump::Claim() {
  MutexLock lock(&mu_);
  if (driving_) return false;
  driving_ = true;
  return true;
}

void CompletionPump::Leave() {
  MutexLock lock(&mu_);
  driving_ = false;
  ++epoch_;
  cv_.SignalAll();
}

bool CompletionPump::TryDrive(absl::FunctionRef<void()> drive) {
  if (!Claim()) return false;
  drive();
  Leave();
  return true;
}

void CompletionPump::Wake() {
  if (sleepers_.load(std::memory_order_acquire) == 0) return;
  MutexLock lock(&mu_);
  ++epoch_;
  cv_.SignalAll();
}

bool CompletionPump::Await(absl::FunctionRef<bool()> ready, absl::Time deadline,
                           absl::FunctionRef<void(absl::Time)> drive) {
  for (;;) {
    uint64_t seen;
    {
      MutexLock lock(&mu_);
      seen = epoch_;
    }
    // Counted as a sleeper before looking, so a Wake after the look is not
    // lost: it either sees the count or bumps the epoch checked below.
    sleepers_.fetch_add(1, std::memory_order_acq_rel);
    if (ready()) {
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      return true;
    }
    if (clock_->Now() >= deadline) {
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      return false;
    }
    bool claimed = false;
    {
      MutexLock lock(&mu_);
      if (epoch_ != seen) {
        // Something finished (or a driver left) since ready() looked: look
        // again before driving, or the new driver would wait in the
        // transport for completions that were already delivered.
      } else if (!driving_) {
        driving_ = claimed = true;
      } else {
        // Real time: another thread drives, and only real threads sleep.
        cv_.AwaitWithDeadline(&mu_, deadline, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return epoch_ != seen;
        });
      }
    }
    sleepers_.fetch_sub(1, std::memory_order_acq_rel);
    if (claimed) {
      drive(deadline);
      Leave();
    }
  }
}

}  // namespace engine_internal
}  // namespace kvferry
