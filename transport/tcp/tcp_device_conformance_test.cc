// The transport conformance suite over the TCP transport with its buffers
// in CUDA device memory, through the fake driver (//cuda/testing, whose
// device memory the CPU cannot touch): on one end of each link or on both,
// over sockets (staged through pinned buffers; CUDA IPC is off, the two
// transports sharing this process) and through the in-process shortcut
// (the driver's copies).
#include <memory>
#include <string>

#include "base/clock.h"
#include "cuda/testing/fake_driver.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/testing/conformance.h"

namespace kvferry {
namespace transport {
namespace {

class TcpDeviceHarness : public testing::TransportHarness {
 public:
  TcpDeviceHarness(bool shortcut, bool both) : shortcut_(shortcut), both_(both) {
    driver_ = cuda::UseFakeDriver();
  }
  absl::StatusOr<std::unique_ptr<Transport>> NewTransport() override {
    TcpTransportOptions o;
    o.bind_host = "127.0.0.1";
    o.in_process_shortcut = shortcut_;
    o.max_outstanding_per_link = 1024;
    return CreateTcpTransport(o);
  }
  Clock* clock() override { return RealClock(); }
  absl::Duration PeerLossBound() override { return absl::Seconds(5); }
  std::string SkipReason() override {
    return driver_ == nullptr ? "the fake CUDA driver did not load" : "";
  }
  // The first transport's buffers on device 0 (both) or the host (one end);
  // the second's on device 1.
  int BufferDevice(int n) override { return n == 0 ? (both_ ? 0 : -1) : 1; }

 private:
  const bool shortcut_, both_;
  const cuda::Driver* driver_ = nullptr;
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
