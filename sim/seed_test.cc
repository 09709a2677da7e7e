#include "sim/seed.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace kvferry {
namespace sim {
namespace {

TEST(Seed, EnvironmentOverridesAndReplayCommandNamesIt) {
  unsetenv("KVFERRY_SEED");
  unsetenv("KVFERRY_SEEDS");
  EXPECT_EQ(TestSeed(5), 5u);
  EXPECT_EQ(SweepSeeds(10, 3), (std::vector<uint64_t>{10, 11, 12}));
  setenv("KVFERRY_SEEDS", "5", 1);
  EXPECT_EQ(SweepSeeds(10, 3).size(), 5u);
  setenv("KVFERRY_SEED", "1234", 1);
  EXPECT_EQ(TestSeed(5), 1234u);
  EXPECT_EQ(SweepSeeds(10, 3), (std::vector<uint64_t>{1234}));
  setenv("TEST_TARGET", "//sim:x_test", 1);
  EXPECT_EQ(ReplayCommand(1234),
            "replay: ./bazelw test //sim:x_test --test_env=KVFERRY_SEED=1234");
  setenv("KVFERRY_SEED", "not a number", 1);
  EXPECT_EQ(TestSeed(5), 5u);
  unsetenv("KVFERRY_SEED");
  unsetenv("KVFERRY_SEEDS");
}

}  // namespace
}  // namespace sim
}  // namespace kvferry
