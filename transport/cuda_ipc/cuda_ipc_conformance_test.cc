// The transport conformance suite over the cuda_ipc transport, through the
// fake CUDA driver (//cuda/testing, whose device memory the CPU cannot
// touch). The fake is told to let this process open its own IPC handles
// (KVFERRY_FAKE_CUDA_IPC_IN_PROCESS), as another process on the host would,
// so that the two transports of a case, both in this process, really send
// references and copy GPU to GPU instead of taking the in-process shortcut
// or falling back to bytes. Buffers on both ends on devices, and on one
// end only (host memory goes as bytes over the same links).
#include <memory>

#include "transport/cuda_ipc/cuda_ipc_transport.h"
#include "transport/testing/conformance.h"
#include "transport/testing/fake_device_harness.h"

namespace kvferry {
namespace transport {
namespace {

class CudaIpcHarness : public testing::FakeDeviceHarness {
 public:
  explicit CudaIpcHarness(bool both) : FakeDeviceHarness(both, /*ipc_in_process=*/true) {}
  absl::StatusOr<std::unique_ptr<Transport>> NewTransport() override {
    CudaIpcTransportOptions o;
    o.stream.bind_host = "127.0.0.1";
    o.stream.in_process_shortcut = false;  // as between two processes
    o.stream.max_outstanding_per_link = 1024;
    return CreateCudaIpcTransport(o);
  }
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
