#include "base/clock.h"

#include "absl/time/clock.h"

namespace kvferry {
namespace {

class RealClockImpl final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  void SleepFor(absl::Duration d) override { absl::SleepFor(d); }
};

}  // namespace

Clock* RealClock() {
  static RealClockImpl* const clock = new RealClockImpl;
  return clock;
}

}  // namespace kvferry
