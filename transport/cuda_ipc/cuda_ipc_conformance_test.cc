// The transport conformance suite over the cuda_ipc transport, through the
// fake CUDA driver (//cuda/testing, whose device memory the CPU cannot
// touch). The fake is told to let this process open its own IPC handles
// (KVFERRY_FAKE_CUDA_IPC_IN_PROCESS), as another process on the host would,
// so that the two transports of a case, both in this process, really send
// references and copy GPU to GPU instead of taking the in-process shortcut
// or falling back to bytes. Buffers on both ends on devices, and on one
// end only (host memory goes as bytes over the same links).
#include <cstdlib>
#include <memory>
#include <string>

#include "base/clock.h"
#include "cuda/testing/fake_driver.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"
#include "transport/testing/conformance.h"

namespace kvferry {
namespace transport {
namespace {

class CudaIpcHarness : public testing::TransportHarness {
 public:
  explicit CudaIpcHarness(bool both) : both_(both) {
    ::setenv("KVFERRY_FAKE_CUDA_IPC_IN_PROCESS", "1", 1);
    driver_ = cuda::UseFakeDriver();
  }
  absl::StatusOr<std::unique_ptr<Transport>> NewTransport() override {
    CudaIpcTransportOptions o;
    o.stream.bind_host = "127.0.0.1";
    o.stream.in_process_shortcut = false;  // as between two processes
    o.stream.max_outstanding_per_link = 1024;
    return CreateCudaIpcTransport(o);
  }
  Clock* clock() override { return RealClock(); }
  absl::Duration PeerLossBound() override { return absl::Seconds(5); }
  std::string SkipReason() override {
    return driver_ == nullptr ? "the fake CUDA driver did not load" : "";
  }
  // The first transport's buffers on device 0 (both) or the host (one
  // end); the second's on device 1.
  int BufferDevice(int n) override { return n == 0 ? (both_ ? 0 : -1) : 1; }

 private:
  const bool both_;
  const cuda::Driver* driver_ = nullptr;
};

using testing::TransportConformanceTest;

INSTANTIATE_TEST_SUITE_P(
    CudaIpc, TransportConformanceTest,
    ::testing::Values(
        testing::ConformanceParam{"cuda_ipc_both",
                                  [] { return std::make_unique<CudaIpcHarness>(true); }},
        testing::ConformanceParam{"cuda_ipc_one_end",
                                  [] { return std::make_unique<CudaIpcHarness>(false); }}),
    testing::ConformanceParamName);

}  // namespace
}  // namespace transport
}  // namespace kvferry
