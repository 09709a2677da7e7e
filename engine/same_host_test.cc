// On a host with a CUDA driver (the fake one, //cuda/testing), an engine
// reaches a peer on the same host over the cuda_ipc transport, whose links
// move device memory GPU to GPU (tests/cuda_ipc_test.cc between processes),
// rather than through the NIC or TCP, and says why in its metrics; host
// memory moves over the same links. With TCP as the primary transport
// everywhere, and with RDMA where there is an RDMA port (inside
// tools/softroce/vm.sh; skipped elsewhere).
#include <cstring>
#include <vector>

#include "cuda/driver.h"
#include "cuda/testing/fake_driver.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "transport/verbs/test_ports.h"

namespace kvferry {
namespace {

class SameHostTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SameHostTest, APeerOnThisHostGoesOverCudaIpc) {
  const bool rdma = GetParam() == "auto";
  transport::verbs::TestPorts ports;
  if (rdma && !ports.SkipReason().empty()) GTEST_SKIP() << ports.SkipReason();
  const cuda::Driver* d = cuda::UseFakeDriver();
  ASSERT_NE(d, nullptr);
  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.transport = GetParam();  // "auto": RDMA, and TCP beside it
  auto a = TransferEngine::Create(o);
  auto b = TransferEngine::Create(o);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ((*a)->detection().transport, rdma ? "rdma" : "tcp");
  std::vector<char> src(1 << 20), dst(1 << 20, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7 + 1);
  ASSERT_TRUE((*a)->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE((*b)->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = (*a)->OpenSegment((*b)->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  const EngineMetrics m = (*a)->GetMetrics();
  ASSERT_EQ(m.peers.size(), 1u);
  EXPECT_EQ(m.peers[0].transport, "cuda_ipc");
  EXPECT_NE(m.peers[0].transport_reason.find("on this host"), std::string::npos)
      << m.peers[0].transport_reason;
  // And the segment works.
  TransferRequest w{transport::Opcode::kWrite, src.data(), reinterpret_cast<uintptr_t>(dst.data()),
                    src.size()};
  auto batch = (*a)->Submit(*seg, {&w, 1});
  ASSERT_TRUE(batch.ok()) << batch.status();
  auto st = (*a)->Wait(*batch, absl::Seconds(20));
  ASSERT_TRUE(st.ok() && st->ok());
  EXPECT_TRUE(src == dst);
  // GPU memory (with RDMA: which the NICs cannot register, the fake having
  // neither dma-buf nor peermem) moves to this peer.
  constexpr size_t kBytes = 1 << 20;
  auto dev_src = d->AllocDevice(0, kBytes);
  auto dev_dst = d->AllocDevice(1, kBytes);
  ASSERT_TRUE(dev_src.ok() && dev_dst.ok());
  ASSERT_TRUE(d->Copy(*dev_src, src.data(), kBytes, 0).ok());
  ASSERT_TRUE((*a)->RegisterMemory(*dev_src, kBytes).ok());
  ASSERT_TRUE((*b)->RegisterMemory(*dev_dst, kBytes).ok());
  TransferRequest g{transport::Opcode::kWrite, *dev_src, reinterpret_cast<uintptr_t>(*dev_dst),
                    kBytes};
  auto gpu_batch = (*a)->Submit(*seg, {&g, 1});
  ASSERT_TRUE(gpu_batch.ok()) << gpu_batch.status();
  auto gst = (*a)->Wait(*gpu_batch, absl::Seconds(20));
  ASSERT_TRUE(gst.ok() && gst->ok());
  std::vector<char> got(kBytes);
  ASSERT_TRUE(d->Copy(got.data(), *dev_dst, kBytes, 1).ok());
  EXPECT_TRUE(got == src);
}

INSTANTIATE_TEST_SUITE_P(Primary, SameHostTest, ::testing::Values("tcp", "auto"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace kvferry
