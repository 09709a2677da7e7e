// Time goes through Clock so the simulator can replace it. Real code takes a
// Clock* (never owned) and defaults to RealClock().
#ifndef KVFERRY_BASE_CLOCK_H_
#define KVFERRY_BASE_CLOCK_H_

#include "absl/time/time.h"

namespace kvferry {

class Clock {
 public:
  virtual ~Clock() = default;
  // The current time.
  virtual absl::Time Now() const = 0;
  // Blocks the caller (real clock) or advances simulated time (sim clock).
  virtual void SleepFor(absl::Duration d) = 0;
};

// The process-wide wall clock (FastNow, absl::SleepFor). Thread-safe.
Clock* RealClock();

// The wall-clock time, as absl::Now() but straight from clock_gettime (the
// vDSO): about 4x cheaper than this Abseil's absl::Now(), which hot paths
// (every request's submit and completion) notice.
absl::Time FastNow();

// The wall-clock time to within a few milliseconds (CLOCK_REALTIME_COARSE,
// the kernel's last tick): cheaper still, for timeouts of seconds.
absl::Time CoarseNow();

}  // namespace kvferry

#endif  // KVFERRY_BASE_CLOCK_H_
