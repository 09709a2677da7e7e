#include "base/clock.h"

#include <time.h>

#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvferry {
namespace {

class RealClockImpl final : public Clock {
 public:
  absl::Time Now() const override { return FastNow(); }
  void SleepFor(absl::Duration d) override { absl::SleepFor(d); }
};

}  // namespace

namespace {
// absl::FromUnixNanos is inline; TimeFromTimespec is two calls into the
// Abseil library (a hot path's clock reads are worth the difference).
absl::Time FromTimespec(const timespec& ts) {
  return absl::FromUnixNanos(int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec);
}
}  // namespace

absl::Time FastNow() {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return FromTimespec(ts);
}

absl::Time CoarseNow() {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME_COARSE, &ts);
  return FromTimespec(ts);
}

Clock* RealClock() {
  static RealClockImpl* const clock = new RealClockImpl;
  return clock;
}

}  // namespace kvferry
