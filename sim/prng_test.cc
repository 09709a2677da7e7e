#include "sim/prng.h"

#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace kvferry {
namespace sim {
namespace {

TEST(SplitMix64, MatchesReferenceOutput) {
  // First output of the published reference implementation for seed 0.
  SplitMix64 sm(0);
  EXPECT_EQ(sm.Next(), 0xe220a8397b1dcdafULL);
}

TEST(Prng, GoldenSequenceIsStableAcrossBuilds) {
  // Computed independently (a Python transcription of xoshiro256** seeded
  // through SplitMix64). If this changes, every recorded seed replays
  // differently: do not change the generator.
  Prng p(42);
  EXPECT_EQ(p.Next64(), 0x15780b2e0c2ec716ULL);
  EXPECT_EQ(p.Next64(), 0x6104d9866d113a7eULL);
  EXPECT_EQ(p.Next64(), 0xae17533239e499a1ULL);
}

TEST(Prng, SameSeedSameSequenceDifferentSeedDiffers) {
  Prng a(7), b(7), c(8);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    uint64_t x = a.Next64();
    EXPECT_EQ(x, b.Next64());
    differs |= x != c.Next64();
  }
  EXPECT_TRUE(differs);
}

TEST(Prng, UniformStaysInRangeAndCoversIt) {
  Prng p(1);
  std::vector<int> hist(10);
  for (int i = 0; i < 10000; ++i) {
    uint64_t x = p.Uniform(10);
    ASSERT_LT(x, 10u);
    ++hist[x];
  }
  for (int count : hist) {
    EXPECT_GT(count, 800);  // expected 1000 each
    EXPECT_LT(count, 1200);
  }
  EXPECT_EQ(p.Uniform(1), 0u);
  for (int i = 0; i < 100; ++i) {
    int64_t y = p.UniformIn(-3, 3);
    EXPECT_GE(y, -3);
    EXPECT_LE(y, 3);
  }
}

TEST(Prng, ChanceHonoursRatioAndSkipsDrawsAtExtremes) {
  Prng p(3);
  int hits = 0;
  for (int i = 0; i < 10000; ++i) hits += p.Chance(Ratio{1, 4});
  EXPECT_GT(hits, 2200);
  EXPECT_LT(hits, 2800);

  Prng q(5), r(5);
  EXPECT_FALSE(q.Chance(Ratio::Never()));
  EXPECT_TRUE(q.Chance(Ratio::Always()));
  EXPECT_EQ(q.Next64(), r.Next64());  // no draw was consumed
}

TEST(Prng, ForksAreDeterministicAndDistinct) {
  Prng a(11), b(11);
  Prng a1 = a.Fork(), a2 = a.Fork();
  Prng b1 = b.Fork();
  uint64_t x1 = a1.Next64();
  EXPECT_EQ(x1, b1.Next64());
  EXPECT_NE(x1, a2.Next64());
}

}  // namespace
}  // namespace sim
}  // namespace kvferry
