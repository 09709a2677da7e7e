#include "sim/seed.h"

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvferry {
namespace sim {
namespace {

bool EnvNumber(const char* name, uint64_t* out) {
  const char* v = std::getenv(name);
  return v != nullptr && absl::SimpleAtoi(v, out);
}

}  // namespace

uint64_t TestSeed(uint64_t default_seed) {
  uint64_t seed;
  return EnvNumber("KVFERRY_SEED", &seed) ? seed : default_seed;
}

std::vector<uint64_t> SweepSeeds(uint64_t first, uint64_t default_count) {
  uint64_t seed;
  if (EnvNumber("KVFERRY_SEED", &seed)) return {seed};
  uint64_t count = default_count;
  EnvNumber("KVFERRY_SEEDS", &count);
  std::vector<uint64_t> seeds;
  seeds.reserve(count);
  for (uint64_t i = 0; i < count; ++i) seeds.push_back(first + i);
  return seeds;
}

std::string ReplayCommand(uint64_t seed) {
  const char* target = std::getenv("TEST_TARGET");
  return absl::StrCat("replay: ./bazelw test ",
                      target != nullptr ? target : "<this test>",
                      " --test_env=KVFERRY_SEED=", seed);
}

}  // namespace sim
}  // namespace kvferry
