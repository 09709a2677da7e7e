// Registering CUDA device memory with the verbs transport, through the fake
// driver (//cuda/testing), on the RDMA ports of this host (Soft-RoCE inside
// tools/softroce/vm.sh; skipped where there are none). The fake has no
// dma-buf export and its device memory is not host memory a NIC can pin, so
// both registration paths fail: the error must name both and what to enable,
// and host memory must still register. The peermem success path runs in
// tests/gpu_verbs_test.cc. Whether this kernel's rxe takes dma-buf memory
// regions at all is probed the way NCCL and UCX do (fd -1: EOPNOTSUPP or
// EPROTONOSUPPORT means no, EBADF means yes), and with a real dma-buf made
// by udmabuf over a memfd where the kernel has /dev/udmabuf.
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <linux/udmabuf.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
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

// A dma-buf of `bytes` of a sealed memfd (udmabuf); -1 with the reason in
// *why where the kernel cannot make one.
int UdmabufFd(size_t bytes, std::string* why) {
  const int dev = open("/dev/udmabuf", O_RDWR | O_CLOEXEC);
  if (dev < 0) {
    *why = std::string("/dev/udmabuf: ") + std::strerror(errno);
    return -1;
  }
  const int mem = memfd_create("kvferry-udmabuf", MFD_ALLOW_SEALING | MFD_CLOEXEC);
  int fd = -1;
  if (mem >= 0 && ftruncate(mem, static_cast<off_t>(bytes)) == 0 &&
      fcntl(mem, F_ADD_SEALS, F_SEAL_SHRINK) == 0) {
    udmabuf_create create{};
    create.memfd = static_cast<__u32>(mem);
    create.flags = UDMABUF_FLAGS_CLOEXEC;
    create.size = bytes;
    fd = ioctl(dev, UDMABUF_CREATE, &create);
  }
  if (fd < 0) *why = std::string("UDMABUF_CREATE: ") + std::strerror(errno);
  if (mem >= 0) close(mem);
  close(dev);
  return fd;
}

TEST(VerbsDeviceMemoryTest, WhetherThisKernelsRxeTakesDmaBufMemoryRegions) {
  transport::verbs::TestPorts ports;
  if (!ports.SkipReason().empty()) GTEST_SKIP() << ports.SkipReason();
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ASSERT_NE(list, nullptr);
  ASSERT_GT(n, 0);
  ibv_context* ctx = ibv_open_device(list[0]);
  ASSERT_NE(ctx, nullptr);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ASSERT_NE(pd, nullptr);
  errno = 0;
  ibv_mr* mr = ibv_reg_dmabuf_mr(pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE);
  const int err = errno;
  EXPECT_EQ(mr, nullptr);  // fd -1 is never a dma-buf
  std::printf("ibv_reg_dmabuf_mr(fd=-1) on %s: errno %d (%s)\n", ibv_get_device_name(list[0]), err,
              std::strerror(err));
  // And with a real dma-buf, where the kernel can make one.
  std::string why;
  const int dmabuf = UdmabufFd(4096, &why);
  int dmabuf_err = 0;
  if (dmabuf >= 0) {
    errno = 0;
    ibv_mr* real = ibv_reg_dmabuf_mr(pd, 0, 4096, 0, dmabuf, IBV_ACCESS_LOCAL_WRITE);
    dmabuf_err = real == nullptr ? errno : 0;
    std::printf("ibv_reg_dmabuf_mr(a udmabuf fd) on %s: %s\n", ibv_get_device_name(list[0]),
                real != nullptr ? "registered" : std::strerror(dmabuf_err));
    if (real != nullptr) ibv_dereg_mr(real);
    close(dmabuf);
  } else {
    std::printf("no udmabuf to try: %s\n", why.c_str());
  }
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(list);
  // A driver without the verb refuses a real dma-buf as it refuses fd -1.
  if (dmabuf >= 0 && err != EBADF) EXPECT_NE(dmabuf_err, 0) << "fd -1 said no, a real one worked";
  // The answers NCCL's and UCX's probes tell apart; anything else is a
  // change worth a look.
  ASSERT_TRUE(err == EOPNOTSUPP || err == EPROTONOSUPPORT || err == EBADF) << std::strerror(err);
  if (err != EBADF) {
    GTEST_SKIP() << "this kernel's rxe registers no dma-buf memory regions (errno " << err << ", "
                 << std::strerror(err)
                 << "): the dma-buf path cannot run under Soft-RoCE; the peermem path does";
  }
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
