#include "base/clock.h"

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace {

// The coarse clock is the same wall clock, a few milliseconds behind at
// most, and never goes back.
TEST(Clock, CoarseNowFollowsFastNow) {
  absl::Time last = CoarseNow();
  for (int i = 0; i < 1000; ++i) {
    const absl::Time coarse = CoarseNow();
    const absl::Time fine = FastNow();
    EXPECT_GE(coarse, last);
    EXPECT_LE(coarse, fine + absl::Milliseconds(1));
    EXPECT_GE(coarse, fine - absl::Milliseconds(50));
    last = coarse;
  }
  EXPECT_LE(absl::AbsDuration(RealClock()->Now() - absl::Now()), absl::Milliseconds(50));
}

// The fine clock keeps sub-second precision (nanoseconds, not seconds).
TEST(Clock, FastNowHasSubSecondPrecision) {
  const absl::Time a = FastNow();
  absl::Time b = FastNow();
  while (b == a) b = FastNow();
  EXPECT_LT(b - a, absl::Milliseconds(10));
  EXPECT_LE(absl::AbsDuration(FastNow() - absl::Now()), absl::Milliseconds(5));
}

}  // namespace
}  // namespace kvferry
