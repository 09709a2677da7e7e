// The conformance suite every Transport implementation must pass.
//
// An implementation's test instantiates it with a harness that makes fresh
// transports (each standing for a separate process on its own host):
//
//   INSTANTIATE_TEST_SUITE_P(
//       Sim, TransportConformanceTest,
//       ::testing::Values(ConformanceParam{"sim", [] { return MakeHarness(); }}),
//       ConformanceParamName);
//
// Cases assert bytes and status codes: WRITE/READ round trips, zero-length,
// unaligned, many outstanding, large, exactly-once completion, wrong key /
// out of bounds / access rights / deregistered regions rejected with the
// target untouched, link error semantics, local validation, and a peer that
// disappears failing requests in bounded time instead of hanging.
#ifndef KVFERRY_TRANSPORT_TESTING_CONFORMANCE_H_
#define KVFERRY_TRANSPORT_TESTING_CONFORMANCE_H_

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "gtest/gtest.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {
namespace testing {

class TransportHarness {
 public:
  virtual ~TransportHarness() = default;
  // A new transport, as a new process on its own host would have. The
  // harness outlives every transport it makes.
  virtual absl::StatusOr<std::unique_ptr<Transport>> NewTransport() = 0;
  // The clock WaitCompletions' timeouts are measured on (simulated time for
  // sim, wall time otherwise).
  virtual Clock* clock() = 0;
  // How long a request to a peer that disappeared may take to fail.
  virtual absl::Duration PeerLossBound() = 0;
  // How long any other request may take.
  virtual absl::Duration OperationTimeout() { return absl::Seconds(30); }
  // Non-empty: the transport cannot run here (e.g. no RDMA port); every
  // case is skipped with this reason.
  virtual std::string SkipReason() { return ""; }
  // Where the buffers registered on the n-th transport of a case (in the
  // order the case first registers memory on them) live: -1 host memory
  // (the default), else that CUDA device, through the CUDA driver (the fake
  // one in tests, whose device memory the CPU cannot touch).
  virtual int BufferDevice(int n) {
    (void)n;
    return -1;
  }
};

struct ConformanceParam {
  std::string name;
  std::function<std::unique_ptr<TransportHarness>()> make;
};

// Prints the parameter's name in test output.
inline void PrintTo(const ConformanceParam& param, std::ostream* os) {
  *os << param.name;
}

// For INSTANTIATE_TEST_SUITE_P's name generator.
std::string ConformanceParamName(
    const ::testing::TestParamInfo<ConformanceParam>& info);

class TransportConformanceTest
    : public ::testing::TestWithParam<ConformanceParam> {
 protected:
  // Two connected transports and a link each way (link_a on a, link_b on b).
  struct Pair {
    std::unique_ptr<Transport> a;
    std::unique_ptr<Transport> b;
    LinkId link_a = 0;
    LinkId link_b = 0;
  };
  // A buffer on a CUDA device (see TransportHarness::BufferDevice): freed
  // with the last Buffer that holds it.
  struct DeviceCopy {
    uint8_t* base = nullptr;  // guard | data | guard, on the device
    int ordinal = -1;
    uint8_t* mirror = nullptr;  // the Buffer's bytes (stable across moves)
    size_t length = 0;
    ~DeviceCopy();
  };
  // A buffer with guard bytes on both sides of the registered middle. Host
  // memory, or device memory whose bytes `bytes` mirrors: refreshed from the
  // device after every WaitFor, so the cases read it alike.
  struct Buffer {
    std::vector<uint8_t> bytes;  // guard | data | guard
    size_t guard = 0;
    Region region;
    std::shared_ptr<DeviceCopy> device;  // null: host memory
    uint8_t* data() { return bytes.data() + guard; }
    size_t size() const { return bytes.size() - 2 * guard; }
    // The address requests and registrations use.
    uint8_t* addr() { return device ? device->base + guard : data(); }
  };

  void SetUp() override;

  // Connects a's NIC na to b's NIC nb; both ends are usable afterwards.
  absl::StatusOr<std::pair<LinkId, LinkId>> Connect(Transport& a,
                                                    Transport& b,
                                                    NicIndex na = 0,
                                                    NicIndex nb = 0);
  Pair MakePair();
  // Allocates `size` bytes of seeded random data framed by guards, and
  // registers the data part on `t` with `access`.
  Buffer MakeBuffer(Transport& t, size_t size, uint64_t seed,
                    Access access = Access::kRemoteReadWrite);
  // Waits until `count` completions arrived or `timeout` passed on the
  // harness clock.
  std::vector<Completion> WaitFor(Transport& t, size_t count,
                                  absl::Duration timeout);
  std::vector<Completion> WaitFor(Transport& t, size_t count) {
    return WaitFor(t, count, harness_->OperationTimeout());
  }
  // Posts one request and returns its completion status.
  absl::Status RunOne(Transport& t, const WorkRequest& wr);
  static WorkRequest Write(LinkId link, Buffer& src, size_t src_off,
                           const Buffer& dst, size_t dst_off, size_t len,
                           NicIndex dst_nic = 0, uint64_t cookie = 1);
  static WorkRequest Read(LinkId link, Buffer& dst, size_t dst_off,
                          const Buffer& src, size_t src_off, size_t len,
                          NicIndex src_nic = 0, uint64_t cookie = 1);

  std::unique_ptr<TransportHarness> harness_;

 private:
  // Copies every live device buffer into its mirror.
  void RefreshDeviceBuffers();
  std::vector<std::weak_ptr<DeviceCopy>> device_buffers_;
  std::vector<const Transport*> buffer_owners_;  // in order of first MakeBuffer
};

}  // namespace testing
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TESTING_CONFORMANCE_H_
