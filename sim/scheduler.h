// The simulator's single-threaded event scheduler and simulated clock.
//
// Events run in (time, sequence) order; the sequence number is the order in
// which they were scheduled, so ties are broken deterministically. Time only
// moves when the scheduler runs an event or is told to advance, and it jumps
// straight to the next event: a simulated second of idle costs nothing.
//
// Every executed event, and every value a component passes to Trace(), is
// folded into a 64-bit trace hash. Two runs of the same scenario with the
// same seed must produce the same hash; tests compare it.
//
// Not thread-safe: one thread drives a scheduler and everything attached to it.
#ifndef KVFERRY_SIM_SCHEDULER_H_
#define KVFERRY_SIM_SCHEDULER_H_

#include <cstdint>
#include <functional>
#include <queue>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/clock.h"

namespace kvferry {
namespace sim {

// Simulated time in nanoseconds since the start of the simulation.
using SimTime = int64_t;

inline SimTime ToSimTime(absl::Duration d) { return absl::ToInt64Nanoseconds(d); }

class Scheduler final : public Clock {
 public:
  using EventFn = std::function<void()>;
  // Groups events so a component can cancel all of its pending events when
  // it is destroyed. 0 is "no owner".
  using OwnerId = uint64_t;

  Scheduler() = default;
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  SimTime now() const { return now_; }
  // Clock: absl::UnixEpoch() + simulated time.
  absl::Time Now() const override;
  // Clock: runs every event due in the next `d` of simulated time.
  void SleepFor(absl::Duration d) override;

  // Schedules `fn` at now() + delay (a negative delay counts as 0).
  void After(SimTime delay, EventFn fn, OwnerId owner = 0);
  // Schedules `fn` at `time` (a time in the past counts as now()).
  void At(SimTime time, EventFn fn, OwnerId owner = 0);

  // A fresh owner id (never reused by this scheduler).
  OwnerId NewOwner() { return ++last_owner_; }
  // Drops every pending event of `owner`; they will never run.
  void CancelOwner(OwnerId owner);

  // Runs the earliest event. False when none is pending.
  bool Step();
  // Runs every event due at or before `time`, then sets now() to `time`
  // (if later).
  void RunUntil(SimTime time);
  // Runs events until `done()` holds (checked before each event) or the next
  // event lies after `deadline`; then advances now() to `deadline` if `done`
  // still does not hold. Returns done().
  bool RunUntilCondition(const std::function<bool()>& done, SimTime deadline);
  // Runs until no event is pending or `max_events` ran. Returns events run.
  uint64_t RunUntilIdle(uint64_t max_events = UINT64_MAX);

  // True when no (uncancelled) event is pending.
  bool idle();
  uint64_t events_run() const { return events_run_; }

  // Folds `value` (or the bytes of `text`) into the trace hash.
  void Trace(uint64_t value);
  void Trace(absl::string_view text);
  uint64_t trace_hash() const { return trace_hash_; }

 private:
  struct Event {
    SimTime time;
    uint64_t seq;
    OwnerId owner;
    EventFn fn;
  };
  struct Later {
    bool operator()(const Event& a, const Event& b) const {
      return a.time != b.time ? a.time > b.time : a.seq > b.seq;
    }
  };

  // Pops cancelled events off the top of the queue.
  void DropCancelledTop();
  // True if an event is due at or before `time`.
  bool NextDueBy(SimTime time);

  SimTime now_ = 0;
  uint64_t next_seq_ = 0;
  uint64_t events_run_ = 0;
  OwnerId last_owner_ = 0;
  uint64_t trace_hash_ = 0x6b7666657272795fULL;  // "kvferry_"
  std::priority_queue<Event, std::vector<Event>, Later> queue_;
  absl::flat_hash_set<OwnerId> cancelled_owners_;
};

}  // namespace sim
}  // namespace kvferry

#endif  // KVFERRY_SIM_SCHEDULER_H_
