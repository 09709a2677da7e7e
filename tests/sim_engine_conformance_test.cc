// The engine conformance suite (engine/testing/engine_conformance.h) inside
// the deterministic simulator: every engine on a host of its own, one
// thread driving the scheduler.
#include <memory>

#include "engine/testing/engine_conformance.h"
#include "engine/testing/sim_world.h"

namespace kvferry {
namespace testing {
namespace {

class SimHarness : public EngineHarness {
 public:
  SimHarness() : world_(0x5eed) {}
  absl::StatusOr<std::unique_ptr<TransferEngine>> Start(EngineOptions options,
                                                        uint32_t max_outstanding) override {
    world_.set_engine_options(options);
    return world_.StartEngine(world_.AddHost(), 0, max_outstanding);
  }
  void Sleep(absl::Duration d) override {
    sim::Scheduler& s = world_.sched();
    s.RunUntilCondition([] { return false; }, s.now() + sim::ToSimTime(d));
  }
  bool threads() const override { return false; }

 private:
  SimWorld world_;
};

INSTANTIATE_TEST_SUITE_P(Sim, EngineConformanceTest,
                         ::testing::Values(EngineParam{
                             "sim", [] { return std::make_unique<SimHarness>(); }}),
                         EngineParamName);

}  // namespace
}  // namespace testing
}  // namespace kvferry
