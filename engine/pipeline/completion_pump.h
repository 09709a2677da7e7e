// Who drives the transport's completions. A thread waiting for its batch
// first takes what the transport has without waiting (poll; any number of
// threads at once: a completion goes to whichever thread finds it first).
// When there is nothing, threads take turns at waiting in the transport:
// one at a time (the driver) waits there and delivers every completion it
// gets, until its own wait is over; the others look for ~20 us, then sleep
// until something finishes (Wake) or the driver leaves, and one of them
// takes over. A poller that delivered something while a driver waits in the
// transport interrupts that wait (Delivered), so the driver looks at its
// batch again. No thread sleeps on a timer while its batch is done.
#ifndef KVFERRY_ENGINE_PIPELINE_COMPLETION_PUMP_H_
#define KVFERRY_ENGINE_PIPELINE_COMPLETION_PUMP_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "engine/pipeline/lock_order.h"

namespace kvferry {
namespace engine_internal {

class CompletionPump {
 public:
  explicit CompletionPump(Clock* clock) : clock_(clock) {}

  // Returns true once ready() holds, false once `timeout` has passed.
  // Meanwhile calls poll() (which delivers what the transport has without
  // waiting, calling Delivered when it delivered something, and returns
  // whether it did); when that finds nothing and no other thread drives,
  // drive(deadline) (which waits in the transport and delivers completions,
  // calling Wake for what finished); otherwise sleeps until Wake, the
  // driver leaving, or the deadline. The deadline is `timeout` from the
  // first time the clock is read, after the first look and poll: what is
  // done by then costs no clock reading. ready() and poll() are never
  // called with the pump's lock held.
  // `lane`: the lane whose Wake says the caller's batch may be ready.
  bool Await(absl::FunctionRef<bool()> ready, absl::Duration timeout,
             absl::FunctionRef<void(absl::Time)> drive, absl::FunctionRef<bool()> poll,
             size_t lane = 0);
  // A poller delivered completions (and called Wake for the lanes of what
  // finished). Returns whether a driver is waiting in the transport
  // meanwhile (the caller interrupts that wait: what it waits for may be
  // among what was delivered).
  bool Delivered();
  // Runs drive() if no other thread drives; false when one does.
  bool TryDrive(absl::FunctionRef<void()> drive);
  // Something of `lane` finished: its waiters look again. Cheap when none
  // sleeps.
  void Wake(size_t lane = 0);
  static constexpr size_t kLanes = 16;

 private:
  bool Claim();
  void Leave();
  // What a waiter of `lane` compares: its lane's epoch plus the pump's
  // (both only grow, so the sum changes whenever either does).
  uint64_t Seen(size_t lane) const { return lanes_[lane].epoch.load() + epoch_.load(); }
  // A waiter whose batch another thread drives: until Seen(lane) is past
  // `seen` (a completion of its lane delivered, or the driver left) or
  // `deadline`.
  void AwaitEpochPast(size_t lane, uint64_t seen, absl::Time deadline);
  // How long a waiter whose batch another thread drives looks before it
  // sleeps.
  static constexpr absl::Duration kSpin = absl::Microseconds(20);
  Clock* const clock_;
  Mutex mu_{kPumpLock};
  CondVar cv_;
  // Whether a thread drives (one driver at a time): claimed by a
  // compare-and-swap (Await's under mu_, TryDrive's without it), read
  // without the lock by Delivered.
  std::atomic<bool> driving_{false};
  // Bumped by Leave; read without the lock.
  std::atomic<uint64_t> epoch_{0};
  // Threads in AwaitEpochPast, all lanes: Leave takes the lock to wake them
  // only when there are some.
  std::atomic<int> sleepers_{0};
  struct Lane {
    char before[64];
    std::atomic<uint64_t> epoch{0};  // bumped by Wake
    // Threads asleep (or about to sleep) in AwaitEpochPast: Wake takes the
    // lock to wake them only when there are some.
    std::atomic<int> sleepers{0};
    char after[64];
  };
  Lane lanes_[kLanes];
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_COMPLETION_PUMP_H_
