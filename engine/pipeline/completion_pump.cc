#include "engine/pipeline/completion_pump.h"

#include <thread>

namespace kvferry {
namespace engine_internal {

bool CompletionPump::Claim() {
  // No lock: claims are compare-and-swaps (Await's too, under the lock).
  bool idle = false;
  return driving_.compare_exchange_strong(idle, true);
}

void CompletionPump::Leave() {
  driving_.store(false);
  // Sequentially consistent, as the sleeper's count and look in
  // AwaitEpochPast: either it sees this bump or this sees it counted. The
  // lock only to wake sleepers (a thread polling State alone has none).
  epoch_.fetch_add(1);
  if (sleepers_.load() == 0) return;
  MutexLock lock(&mu_);
  cv_.SignalAll();
}

bool CompletionPump::TryDrive(absl::FunctionRef<void()> drive) {
  if (!Claim()) return false;
  drive();
  Leave();
  return true;
}

bool CompletionPump::Delivered() {
  // Sequentially consistent, as the claim in Await: the Wake of what was
  // delivered came before this look, so a driver that claimed before it is
  // seen here, and one that claims after it sees the Wake and looks again.
  return driving_.load();
}

void CompletionPump::Wake(size_t lane) {
  Lane& l = lanes_[lane % kLanes];
  // Sequentially consistent, as the sleeper's count and look in
  // AwaitEpochPast: either it sees this bump or this sees it counted.
  l.epoch.fetch_add(1);
  if (l.sleepers.load() == 0) return;
  MutexLock lock(&mu_);
  cv_.SignalAll();
}

void CompletionPump::AwaitEpochPast(size_t lane, uint64_t seen, absl::Time deadline) {
  // Real time: only real threads wait for another. A completion usually
  // comes within microseconds: look for a while before sleeping (a sleep
  // and its wake-up cost more than that).
  const absl::Time spin_until = FastNow() + kSpin;
  while (Seen(lane) == seen && FastNow() < spin_until) std::this_thread::yield();
  MutexLock lock(&mu_);
  lanes_[lane].sleepers.fetch_add(1);  // before the look below: see Wake
  sleepers_.fetch_add(1);              // and Leave
  cv_.AwaitWithDeadline(&mu_, deadline,
                        [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return Seen(lane) != seen; });
  sleepers_.fetch_sub(1);
  lanes_[lane].sleepers.fetch_sub(1);
}

namespace {

// `timeout` from the first reading of the clock (see Await).
class LazyDeadline {
 public:
  LazyDeadline(Clock* clock, absl::Duration timeout) : clock_(clock), timeout_(timeout) {}
  bool Expired() {
    const absl::Time now = clock_->Now();
    if (!started_) {
      started_ = true;
      deadline_ = now + timeout_;
    }
    return now >= deadline_;
  }
  // Once Expired has been called.
  absl::Time get() const { return deadline_; }

 private:
  Clock* const clock_;
  const absl::Duration timeout_;
  bool started_ = false;
  absl::Time deadline_ = absl::InfiniteFuture();
};

}  // namespace

bool CompletionPump::Await(absl::FunctionRef<bool()> ready, absl::Duration timeout,
                           absl::FunctionRef<void(absl::Time)> drive,
                           absl::FunctionRef<bool()> poll, size_t lane) {
  lane %= kLanes;
  LazyDeadline deadline(clock_, timeout);
  int polled = 0;  // rounds in which poll() delivered something
  for (;;) {
    // Read before looking: whatever finishes after the look bumps the
    // epoch (Wake), which the claim below or AwaitEpochPast sees.
    const uint64_t seen = Seen(lane);
    if (ready()) return true;
    // What the transport has now, without waiting (and without the
    // driver's turn: several threads may do this at once). Other threads'
    // completions may keep coming: the deadline still holds (looked at
    // from the second round on; the first costs no clock reading).
    if (poll()) {
      if (polled++ > 0 && deadline.Expired()) return ready();
      continue;
    }
    if (deadline.Expired()) return false;
    bool claimed = false, another_drives = false;
    {
      MutexLock lock(&mu_);
      bool idle = false;  // a compare-and-swap: TryDrive claims without the lock
      if (!driving_.compare_exchange_strong(idle, true)) {
        another_drives = true;
      } else {
        // Claimed before the epoch is looked at, as a poller's Wake bumps
        // it before Delivered looks for a driver: a poller's delivery is
        // either seen here or interrupts this driver's wait.
        if (Seen(lane) == seen) {
          claimed = true;
        } else {
          // Something finished (or a driver left) since ready() looked:
          // look again before driving, or the new driver would wait in the
          // transport for completions that were already delivered.
          driving_.store(false);
        }
      }
    }
    if (another_drives) AwaitEpochPast(lane, seen, deadline.get());
    if (!claimed) continue;
    // Drives until its own wait is over; hands over only then (a hand-over
    // per transport wait would wake the others for nothing).
    bool is_ready = false;
    do {
      drive(deadline.get());
      is_ready = ready();
    } while (!is_ready && !deadline.Expired());
    Leave();
    return is_ready;
  }
}

}  // namespace engine_internal
}  // namespace kvferry
