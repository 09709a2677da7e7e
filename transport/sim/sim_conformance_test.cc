// The transport conformance suite on the simulated fabric: once on a clean
// fabric, once on a lossy, jittery one (retransmission must hide the loss).
#include <memory>

#include "transport/sim/sim_harness.h"
#include "transport/testing/conformance.h"

namespace kvferry {
namespace transport {
namespace {

using testing::ConformanceParam;
using testing::TransportConformanceTest;

sim::FaultOptions Lossy() {
  sim::FaultOptions f;
  f.drop = {1, 50};
  f.delay = {1, 10};
  f.max_delay = absl::Microseconds(20);
  return f;
}

INSTANTIATE_TEST_SUITE_P(
    Sim, TransportConformanceTest,
    ::testing::Values(ConformanceParam{"sim", [] { return std::make_unique<SimHarness>(1); }},
                      ConformanceParam{"sim_lossy",
                                       [] { return std::make_unique<SimHarness>(2, Lossy()); }}),
    testing::ConformanceParamName);

}  // namespace
}  // namespace transport
}  // namespace kvferry
