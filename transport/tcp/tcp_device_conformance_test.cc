// The transport conformance suite over the TCP transport with its buffers
// in CUDA device memory, through the fake driver (//cuda/testing, whose
// device memory the CPU cannot touch): on one end of each link or on both,
// over sockets (staged through pinned buffers: the TCP transport carries
// no references) and through the in-process shortcut (the driver's copies).
#include <memory>

#include "transport/tcp/tcp_transport.h"
#include "transport/testing/conformance.h"
#include "transport/testing/fake_device_harness.h"

namespace kvferry {
namespace transport {
namespace {

class TcpDeviceHarness : public testing::FakeDeviceHarness {
 public:
  TcpDeviceHarness(bool shortcut, bool both) : FakeDeviceHarness(both), shortcut_(shortcut) {}
  absl::StatusOr<std::unique_ptr<Transport>> NewTransport() override {
    TcpTransportOptions o;
    o.bind_host = "127.0.0.1";
    o.in_process_shortcut = shortcut_;
    o.max_outstanding_per_link = 1024;
    return CreateTcpTransport(o);
  }

 private:
  const bool shortcut_;
};

using testing::TransportConformanceTest;

INSTANTIATE_TEST_SUITE_P(
    TcpDevice, TransportConformanceTest,
    ::testing::Values(
        testing::ConformanceParam{"tcp_device_one_end",
                                  [] { return std::make_unique<TcpDeviceHarness>(false, false); }},
        testing::ConformanceParam{"tcp_device_both",
                                  [] { return std::make_unique<TcpDeviceHarness>(false, true); }},
        testing::ConformanceParam{"tcp_in_process_device_one_end",
                                  [] { return std::make_unique<TcpDeviceHarness>(true, false); }},
        testing::ConformanceParam{"tcp_in_process_device_both",
                                  [] { return std::make_unique<TcpDeviceHarness>(true, true); }}),
    testing::ConformanceParamName);

}  // namespace
}  // namespace transport
}  // namespace kvferry
