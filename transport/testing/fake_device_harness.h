// A conformance harness (conformance.h) whose buffers lie in CUDA device
// memory through the fake driver (//cuda/testing; a test that uses it lists
// //cuda/testing:libfakecuda.so in its data): the first transport's on
// device 0 (`both`) or the host (one end), the second's on device 1. Wall
// time; every case is skipped when the fake does not load. Subclasses make
// the transports.
#ifndef KVFERRY_TRANSPORT_TESTING_FAKE_DEVICE_HARNESS_H_
#define KVFERRY_TRANSPORT_TESTING_FAKE_DEVICE_HARNESS_H_

#include <cstdlib>
#include <string>

#include "base/clock.h"
#include "cuda/testing/fake_driver.h"
#include "transport/testing/conformance.h"

namespace kvferry {
namespace transport {
namespace testing {

class FakeDeviceHarness : public TransportHarness {
 public:
  // `ipc_in_process`: the fake lets this process open its own CUDA IPC
  // handles, as another process would (KVFERRY_FAKE_CUDA_IPC_IN_PROCESS).
  explicit FakeDeviceHarness(bool both, bool ipc_in_process = false) : both_(both) {
    if (ipc_in_process) ::setenv("KVFERRY_FAKE_CUDA_IPC_IN_PROCESS", "1", 1);
    driver_ = cuda::UseFakeDriver();
  }
  Clock* clock() override { return RealClock(); }
  absl::Duration PeerLossBound() override { return absl::Seconds(5); }
  std::string SkipReason() override {
    return driver_ == nullptr ? "the fake CUDA driver did not load" : "";
  }
  int BufferDevice(int n) override { return n == 0 ? (both_ ? 0 : -1) : 1; }

 private:
  const bool both_;
  const cuda::Driver* driver_ = nullptr;
};

}  // namespace testing
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TESTING_FAKE_DEVICE_HARNESS_H_
