// Registering CUDA device memory with the verbs transport, through the fake
// driver (//cuda/testing), on the RDMA ports of this host (Soft-RoCE inside
// tools/softroce/vm.sh; skipped where there are none). The fake has no
// dma-buf export and its device memory is not host memory a NIC can pin, so
// both registration paths fail: the error must name both and what to enable,
// and host memory must still register.
#include <vector>

#include "cuda/driver.h"
#include "cuda/testing/fake_driver.h"
#include "gtest/gtest.h"
#include "transport/verbs/test_ports.h"
#include "transport/verbs/verbs_transport.h"

namespace kvferry {
namespace transport {
namespace {

TEST(VerbsDeviceMemoryTest, WithoutDmaBufOrPeermemTheErrorSaysWhatToEnable) {
  verbs::TestPorts ports;
  if (!ports.SkipReason().empty()) GTEST_SKIP() << ports.SkipReason();
  const cuda::Driver* d = cuda::UseFakeDriver();
  ASSERT_NE(d, nullptr);
  VerbsTransportOptions o;
  o.ports = ports.ports();
  auto t = CreateVerbsTransport(o);
  ASSERT_TRUE(t.ok()) << t.status();
  auto dev = d->AllocDevice(1, 1 << 20);
  ASSERT_TRUE(dev.ok());
  auto r = (*t)->RegisterMemory(*dev, 1 << 20, Access::kRemoteReadWrite);
  ASSERT_FALSE(r.ok());
  const std::string why(r.status().message());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << why;
  EXPECT_NE(why.find("CUDA device 1"), std::string::npos) << why;
  EXPECT_NE(why.find("by dma-buf: CUDA device 1 does not support dma-buf"), std::string::npos)
      << why;
  EXPECT_NE(why.find("by ibv_reg_mr"), std::string::npos) << why;
  EXPECT_NE(why.find("nvidia-peermem"), std::string::npos) << why;
  // Past the allocation: refused before any NIC is asked.
  EXPECT_EQ((*t)->RegisterMemory(*dev, (1 << 20) + 1, Access::kRemoteReadWrite).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Host memory is unaffected.
  std::vector<char> host(1 << 16);
  EXPECT_TRUE((*t)->RegisterMemory(host.data(), host.size(), Access::kRemoteReadWrite).ok());
  ASSERT_TRUE(d->FreeDevice(*dev, 1).ok());
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
