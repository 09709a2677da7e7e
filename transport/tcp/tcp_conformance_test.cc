// The transport conformance suite over real TCP sockets on loopback.
#include <memory>

#include "base/clock.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/testing/conformance.h"

namespace kvferry {
namespace transport {
namespace {

class TcpHarness : public testing::TransportHarness {
 public:
  absl::StatusOr<std::unique_ptr<Transport>> NewTransport() override {
    TcpTransportOptions o;
    o.bind_host = "127.0.0.1";
    o.max_outstanding_per_link = 1024;
    return CreateTcpTransport(o);
  }
  Clock* clock() override { return RealClock(); }
  absl::Duration PeerLossBound() override { return absl::Seconds(5); }
};

using testing::TransportConformanceTest;

INSTANTIATE_TEST_SUITE_P(
    Tcp, TransportConformanceTest,
    ::testing::Values(testing::ConformanceParam{
        "tcp", [] { return std::make_unique<TcpHarness>(); }}),
    testing::ConformanceParamName);

}  // namespace
}  // namespace transport
}  // namespace kvferry
