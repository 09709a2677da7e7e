#include "engine/completion_pump.h"

#include <thread>

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
  epoch_.fetch_add(1);
  cv_.SignalAll();
}

bool CompletionPump::TryDrive(absl::FunctionRef<void()> drive) {
  if (!Claim()) return false;
  drive();
  Leave();
  return true;
}

bool CompletionPump::Delivered() {
  MutexLock lock(&mu_);
  epoch_.fetch_add(1);
  if (sleepers_.load(std::memory_order_acquire) > 0) cv_.SignalAll();
  return driving_;
}

void CompletionPump::Wake() {
  if (sleepers_.load(std::memory_order_acquire) == 0) return;
  MutexLock lock(&mu_);
  epoch_.fetch_add(1);
  cv_.SignalAll();
}

void CompletionPump::AwaitEpochPast(uint64_t seen, absl::Time deadline) {
  // Real time: only real threads wait for another. A completion usually
  // comes within microseconds: look for a while before sleeping (a sleep
  // and its wake-up cost more than that).
  const absl::Time spin_until = FastNow() + kSpin;
  while (epoch_.load() == seen && FastNow() < spin_until) std::this_thread::yield();
  MutexLock lock(&mu_);
  cv_.AwaitWithDeadline(&mu_, deadline, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return epoch_.load() != seen;
  });
}

bool CompletionPump::Await(absl::FunctionRef<bool()> ready, absl::Time deadline,
                           absl::FunctionRef<void(absl::Time)> drive,
                           absl::FunctionRef<bool()> poll) {
  int polled = 0;  // rounds in which poll() delivered something
  for (;;) {
    const uint64_t seen = epoch_.load();
    // Counted as a sleeper before looking, so a Wake after the look is not
    // lost: it either sees the count or bumps the epoch checked below.
    sleepers_.fetch_add(1, std::memory_order_acq_rel);
    if (ready()) {
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      return true;
    }
    // What the transport has now, without waiting (and without the
    // driver's turn: several threads may do this at once). Other threads'
    // completions may keep coming: the deadline still holds (looked at
    // from the second round on; the first costs no clock reading).
    if (poll()) {
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      if (polled++ > 0 && clock_->Now() >= deadline) return ready();
      continue;
    }
    if (clock_->Now() >= deadline) {
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      return false;
    }
    bool claimed = false, another_drives = false;
    {
      MutexLock lock(&mu_);
      if (epoch_.load() != seen) {
        // Something finished (or a driver left) since ready() looked: look
        // again before driving, or the new driver would wait in the
        // transport for completions that were already delivered.
      } else if (!driving_) {
        driving_ = claimed = true;
      } else {
        another_drives = true;
      }
    }
    if (another_drives) AwaitEpochPast(seen, deadline);
    sleepers_.fetch_sub(1, std::memory_order_acq_rel);
    if (!claimed) continue;
    // Drives until its own wait is over; hands over only then (a hand-over
    // per transport wait would wake the others for nothing).
    bool is_ready = false;
    do {
      drive(deadline);
      is_ready = ready();
    } while (!is_ready && clock_->Now() < deadline);
    Leave();
    return is_ready;
  }
}

}  // namespace engine_internal
}  // namespace kvferry
