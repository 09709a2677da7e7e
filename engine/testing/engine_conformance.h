// The engine conformance suite: the same TransferEngine behaviour checked on
// every transport an engine can run on. A harness builds engines (on TCP
// sockets, TCP with the in-process shortcut, verbs, the simulator) and says
// how time passes; every case is written once against it.
//
//   INSTANTIATE_TEST_SUITE_P(Tcp, EngineConformanceTest,
//       ::testing::Values(EngineParam{"tcp", [] { return MakeTcpHarness(false); }}),
//       EngineParamName);
#ifndef KVFERRY_ENGINE_TESTING_ENGINE_CONFORMANCE_H_
#define KVFERRY_ENGINE_TESTING_ENGINE_CONFORMANCE_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace testing {

class EngineHarness {
 public:
  virtual ~EngineHarness() = default;
  // A new engine (on a host of its own where the harness has hosts) with
  // `options`; `max_outstanding_per_link` limits its transport's links.
  virtual absl::StatusOr<std::unique_ptr<TransferEngine>> Start(
      EngineOptions options, uint32_t max_outstanding_per_link = 1024) = 0;
  // Lets `d` pass on the engines' clock.
  virtual void Sleep(absl::Duration d) = 0;
  // Whether engines may be used from several threads at once (real
  // transports); the simulator is driven by one thread.
  virtual bool threads() const = 0;
  // Non-empty: why every case is skipped (no RDMA port, say).
  virtual std::string SkipReason() { return ""; }
};

struct EngineParam {
  std::string name;
  std::function<std::unique_ptr<EngineHarness>()> make;
};
std::string EngineParamName(const ::testing::TestParamInfo<EngineParam>& info);

// A harness over TCP sockets on 127.0.0.1; `in_process` keeps the shortcut
// that copies between two engines of one process without sockets.
std::unique_ptr<EngineHarness> MakeTcpHarness(bool in_process);
// A harness over the RDMA ports discovery finds (TransferEngine::Create
// with transport "rdma"); skipped where there is none, unless
// KVFERRY_REQUIRE_RDMA=1.
std::unique_ptr<EngineHarness> MakeVerbsHarness();

class EngineConformanceTest : public ::testing::TestWithParam<EngineParam> {
 protected:
  void SetUp() override;
  std::unique_ptr<TransferEngine> Start(EngineOptions options = {},
                                        uint32_t max_outstanding_per_link = 1024);
  std::unique_ptr<EngineHarness> harness_;
};

}  // namespace testing
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_TESTING_ENGINE_CONFORMANCE_H_
