// Seeds for simulation tests. A test reads its seed (or a sweep range) from
// the environment so any failure can be replayed exactly:
//
//   ./bazelw test //sim:fabric_test --test_env=KVFERRY_SEED=1234
//
// and prints that command with ReplayCommand() when an assertion fails
// (use it in SCOPED_TRACE).
#ifndef KVFERRY_SIM_SEED_H_
#define KVFERRY_SIM_SEED_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace kvferry {
namespace sim {

// KVFERRY_SEED if set (decimal), else `default_seed`.
uint64_t TestSeed(uint64_t default_seed);

// The seeds a sweep test runs: {KVFERRY_SEED} if set; otherwise
// `default_count` consecutive seeds from `first` (KVFERRY_SEEDS overrides
// the count, for longer sweeps).
std::vector<uint64_t> SweepSeeds(uint64_t first, uint64_t default_count);

// "replay: ./bazelw test <target> --test_env=KVFERRY_SEED=<seed>".
// The target is taken from Bazel's TEST_TARGET when running under it.
std::string ReplayCommand(uint64_t seed);

}  // namespace sim
}  // namespace kvferry

#endif  // KVFERRY_SIM_SEED_H_
