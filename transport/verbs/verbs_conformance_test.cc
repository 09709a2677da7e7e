// The transport conformance suite over libibverbs. On a host without an
// active RDMA port every case is skipped with the reason; inside the
// Soft-RoCE VM (tools/softroce/vm.sh) they run for real, and
// KVFERRY_REQUIRE_RDMA=1 turns a missing device into a failure.
#include <cstdlib>
#include <memory>

#include "base/clock.h"
#include "transport/testing/conformance.h"
#include "transport/verbs/discovery.h"
#include "transport/verbs/verbs_transport.h"

namespace kvferry {
namespace transport {
namespace {

using testing::TransportConformanceTest;

class VerbsHarness : public testing::TransportHarness {
 public:
  VerbsHarness() {
    verbs::DiscoveryOptions o;
    verbs::ApplyEnvironment(&o);
    auto d = verbs::Discover(o);
    if (d.ok()) ports_ = d->selected;
    if (ports_.empty()) {
      skip_ = d.ok() ? "no active RDMA port on this host (run inside tools/softroce/vm.sh)"
                     : std::string(d.status().message());
    }
  }
  absl::StatusOr<std::unique_ptr<Transport>> NewTransport() override {
    VerbsTransportOptions o;
    o.ports = {ports_[0]};
    o.request_timeout = absl::Seconds(3);
    return CreateVerbsTransport(o);
  }
  Clock* clock() override { return RealClock(); }
  absl::Duration PeerLossBound() override { return absl::Seconds(5); }
  std::string SkipReason() override {
    const char* require = std::getenv("KVFERRY_REQUIRE_RDMA");
    if (!skip_.empty() && require != nullptr && std::string(require) == "1") {
      ADD_FAILURE() << "KVFERRY_REQUIRE_RDMA=1 but: " << skip_;
    }
    return skip_;
  }

 private:
  std::vector<verbs::SelectedPort> ports_;
  std::string skip_;
};

INSTANTIATE_TEST_SUITE_P(
    Verbs, TransportConformanceTest,
    ::testing::Values(testing::ConformanceParam{
        "verbs", [] { return std::make_unique<VerbsHarness>(); }}),
    testing::ConformanceParamName);

}  // namespace
}  // namespace transport
}  // namespace kvferry
