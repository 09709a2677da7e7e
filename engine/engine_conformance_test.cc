// The engine conformance suite over TCP sockets, TCP with the in-process
// shortcut, and verbs (skipped without an RDMA port; run for real inside
// tools/softroce/vm.sh). The simulator's instance is
// //tests:sim_engine_conformance_test.
#include "engine/testing/engine_conformance.h"

namespace kvferry {
namespace testing {
namespace {

INSTANTIATE_TEST_SUITE_P(
    Transports, EngineConformanceTest,
    ::testing::Values(EngineParam{"tcp", [] { return MakeTcpHarness(/*in_process=*/false); }},
                      EngineParam{"tcp_in_process", [] { return MakeTcpHarness(true); }},
                      EngineParam{"verbs", [] { return MakeVerbsHarness(); }}),
    EngineParamName);

}  // namespace
}  // namespace testing
}  // namespace kvferry
