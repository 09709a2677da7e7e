// The transport conformance suite over the TCP transport: over real sockets
// on loopback ("tcp": the in-process shortcut off, since both transports of
// a test live in this process), and through the in-process shortcut.
#include <memory>

#include "base/clock.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/testing/conformance.h"

namespace kvferry {
namespace transport {
namespace {

class TcpHarness : public testing::TransportHarness {
 public:
  explicit TcpHarness(bool shortcut) : shortcut_(shortcut) {}
  absl::StatusOr<std::unique_ptr<Transport>> NewTransport() override {
    TcpTransportOptions o;
    o.bind_host = "127.0.0.1";
    o.in_process_shortcut = shortcut_;
    o.max_outstanding_per_link = 1024;
    return CreateTcpTransport(o);
  }
  Clock* clock() override { return RealClock(); }
  absl::Duration PeerLossBound() override { return absl::Seconds(5); }

 private:
  const bool shortcut_;
};

using testing::TransportConformanceTest;

INSTANTIATE_TEST_SUITE_P(
    Tcp, TransportConformanceTest,
    ::testing::Values(testing::ConformanceParam{"tcp",
                                                [] { return std::make_unique<TcpHarness>(false); }},
                      testing::ConformanceParam{"tcp_in_process",
                                                [] { return std::make_unique<TcpHarness>(true); }}),
    testing::ConformanceParamName);

}  // namespace
}  // namespace transport
}  // namespace kvferry
