#include "base/clock.h"

#include <time.h>

#include "absl/time/clock.h"

namespace kvferry {
namespace {

class RealClockImpl final : public Clock {
 public:
  absl::Time Now() const override { return FastNow(); }
  void SleepFor(absl::Duration d) override { absl::SleepFor(d); }
};

}  // namespace

absl::Time FastNow() {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return absl::TimeFromTimespec(ts);
}

absl::Time CoarseNow() {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME_COARSE, &ts);
  return absl::TimeFromTimespec(ts);
}

Clock* RealClock() {
  static RealClockImpl* const clock = new RealClockImpl;
  return clock;
}

}  // namespace kvferry
