#include "cuda/driver.h"

#include <dlfcn.h>
#include <sys/mman.h>

#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/testing/fake_driver.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace cuda {
namespace {

// The numbers are NVIDIA's (cuda.h of CUDA 12.6 and 13.0), written out here
// rather than taken from any header of the project or of the fake.
TEST(DriverApiTest, ValuesAreTheDriversOwn) {
  EXPECT_EQ(api::kErrorInvalidValue, 1);
  EXPECT_EQ(api::kErrorNotInitialized, 3);
  EXPECT_EQ(api::kErrorStubLibrary, 34);
  EXPECT_EQ(api::kErrorNoDevice, 100);
  EXPECT_EQ(api::kErrorInvalidContext, 201);
  EXPECT_EQ(api::kErrorNotFound, 500);
  EXPECT_EQ(api::kErrorNotSupported, 801);
  EXPECT_EQ(api::kPointerAttributeMemoryType, 2);
  EXPECT_EQ(api::kPointerAttributeDeviceOrdinal, 9);
  EXPECT_EQ(api::kPointerAttributeRangeStartAddr, 11);
  EXPECT_EQ(api::kPointerAttributeRangeSize, 12);
  EXPECT_EQ(api::kMemoryTypeHost, 1u);
  EXPECT_EQ(api::kMemoryTypeDevice, 2u);
  EXPECT_EQ(api::kDeviceAttributeGpuDirectRdmaSupported, 116);
  EXPECT_EQ(api::kDeviceAttributeDmaBufSupported, 124);
  EXPECT_EQ(api::kMemRangeHandleTypeDmaBufFd, 1);
  EXPECT_EQ(sizeof(api::CUdeviceptr), 8u);
  EXPECT_EQ(sizeof(api::CUdevice), 4u);
  EXPECT_EQ(api::kPointerAttributeAllowedHandleTypes, 14);
  EXPECT_EQ(api::kMemHandleTypePosixFileDescriptor, 1);
  EXPECT_EQ(api::kMemLocationTypeDevice, 1);
  EXPECT_EQ(api::kMemAccessFlagsProtReadWrite, 3);
  EXPECT_EQ(api::kMemAllocationTypePinned, 1);
  EXPECT_EQ(sizeof(api::CUmemLocation), 8u);
  EXPECT_EQ(sizeof(api::CUmemAccessDesc), 12u);
  EXPECT_EQ(offsetof(api::CUmemAccessDesc, flags), 8u);
  EXPECT_EQ(sizeof(api::CUmemAllocationProp), 32u);
  EXPECT_EQ(offsetof(api::CUmemAllocationProp, location), 8u);
  EXPECT_EQ(offsetof(api::CUmemAllocationProp, win32HandleMetaData), 16u);
  EXPECT_EQ(offsetof(api::CUmemAllocationProp, allocFlags), 24u);
}

class FakeDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    d_ = UseFakeDriver();
    ASSERT_NE(d_, nullptr);
  }
  const Driver* d_ = nullptr;
};

TEST_F(FakeDriverTest, LoadsAndDescribesTheDevices) {
  EXPECT_EQ(d_->device_count(), 2);
  EXPECT_GE(d_->version(), 11000);
  EXPECT_NE(d_->library().find("libfakecuda.so"), std::string::npos);
  EXPECT_EQ(d_->PciBusId(0).value_or(""), "0000:1b:00.0");  // lower-cased
  EXPECT_EQ(d_->PciBusId(1).value_or(""), "0000:3d:00.0");
  EXPECT_EQ(d_->PciBusId(7).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(d_->Attribute(0, api::kDeviceAttributeDmaBufSupported), 0);
}

TEST_F(FakeDriverTest, ClassifiesHostAndDeviceMemory) {
  std::vector<char> heap(4096);
  char stack[64];
  EXPECT_FALSE(d_->Classify(heap.data(), heap.size())->device);
  EXPECT_FALSE(d_->Classify(stack, sizeof stack)->device);
  auto pinned = d_->AllocPinned(8192);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_FALSE(d_->Classify(*pinned, 8192)->device);  // pinned host memory is host memory
  d_->FreePinned(*pinned);

  auto dev = d_->AllocDevice(1, 1 << 20);
  ASSERT_TRUE(dev.ok()) << dev.status();
  auto info = d_->Classify(static_cast<char*>(*dev) + 100, 4096);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->device);
  EXPECT_EQ(info->ordinal, 1);
  // Past the end of the allocation: refused, naming the byte.
  auto over = d_->Classify(*dev, (1 << 20) + 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(over.status().message().find("offset 1048576"), std::string::npos) << over.status();
  ASSERT_TRUE(d_->FreeDevice(*dev, 1).ok());
  // Freed: the driver no longer knows it, and the CPU cannot read it.
  auto freed = d_->Classify(*dev, 4096);
  EXPECT_EQ(freed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(freed.status().message().find("freed device pointer"), std::string::npos)
      << freed.status();
}

TEST_F(FakeDriverTest, CopiesInEveryDirectionAndTheCpuCannotTouchDeviceMemory) {
  auto a = d_->AllocDevice(0, 4096);
  auto b = d_->AllocDevice(0, 4096);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<char> src(4096), dst(4096, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7 + 3);
  ASSERT_TRUE(d_->Copy(*a, src.data(), src.size(), 0).ok());  // host to device
  ASSERT_TRUE(d_->Copy(*b, *a, 4096, 0).ok());                // device to device
  ASSERT_TRUE(d_->Copy(dst.data(), *b, 4096, 0).ok());        // device to host
  EXPECT_EQ(src, dst);
  // Out of the allocation: an error, not a wild copy.
  EXPECT_FALSE(d_->Copy(dst.data(), static_cast<char*>(*b) + 1, 4096, 0).ok());
  EXPECT_DEATH(std::memcpy(dst.data(), *a, 16), "");
  ASSERT_TRUE(d_->FreeDevice(*a, 0).ok());
  ASSERT_TRUE(d_->FreeDevice(*b, 0).ok());
  // Freed: no longer device memory the driver knows.
  EXPECT_FALSE(d_->Copy(dst.data(), *a, 16, 0).ok());
}

TEST_F(FakeDriverTest, LeavesTheCallersContextAsItWas) {
  // A thread with no current context gets none after the driver's calls
  // (Bound restores it), while the calls themselves work. The current
  // context, asked of the loaded library itself:
  void* lib = dlopen(d_->library().c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(lib, nullptr);
  auto get_current = reinterpret_cast<api::CUresult (*)(void**)>(dlsym(lib, "cuCtxGetCurrent"));
  ASSERT_NE(get_current, nullptr);
  std::thread([&] {
    void* ctx = reinterpret_cast<void*>(1);
    ASSERT_EQ(get_current(&ctx), api::kSuccess);
    EXPECT_EQ(ctx, nullptr);  // a new thread has none
    auto dev = d_->AllocDevice(1, 4096);
    ASSERT_TRUE(dev.ok());
    std::vector<char> host(16, 'x');
    EXPECT_TRUE(d_->Copy(*dev, host.data(), host.size(), 1).ok());
    ASSERT_EQ(get_current(&ctx), api::kSuccess);
    EXPECT_EQ(ctx, nullptr) << "the driver left its context current on the caller's thread";
    ASSERT_TRUE(d_->FreeDevice(*dev, 1).ok());
  }).join();
  EXPECT_EQ(d_->AllocDevice(5, 16).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cuda
}  // namespace kvferry

namespace kvferry {
namespace cuda {
namespace {

// VMM memory as PyTorch's expandable segments make it: chunks of their own
// allocation mapped back to back. It is device memory, has no IPC memory
// handle, and is shared chunk by chunk as POSIX fds that map it again.
TEST_F(FakeDriverTest, VmmMemoryIsExportedChunkByChunkAndMapsAgain) {
  const uint64_t chunk = d_->VmmGranularity(1).value_or(0);
  ASSERT_GT(chunk, 0u);
  auto vmm = d_->AllocVmm(1, chunk, 3);
  ASSERT_TRUE(vmm.ok()) << vmm.status();
  auto plain = d_->AllocDevice(1, 1 << 20);
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(d_->IsVmm(*vmm, 1));
  EXPECT_TRUE(d_->IsVmm(static_cast<char*>(*vmm) + 2 * chunk + 5, 1));
  EXPECT_FALSE(d_->IsVmm(*plain, 1));
  std::vector<char> host(64);
  EXPECT_FALSE(d_->IsVmm(host.data(), 1));
  // Classified as device memory across its chunks; no IPC memory handle.
  auto where = d_->Classify(*vmm, 3 * chunk);
  ASSERT_TRUE(where.ok()) << where.status();
  EXPECT_TRUE(where->device);
  EXPECT_EQ(where->ordinal, 1);
  EXPECT_FALSE(d_->IpcExportOf(*vmm, 1).ok());

  std::vector<char> pattern(3 * chunk);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<char>(i * 7 + (i >> 20));
  ASSERT_TRUE(d_->Copy(*vmm, pattern.data(), pattern.size(), 1).ok());
  // From the middle of the first chunk into the last: three chunks, three fds.
  char* from = static_cast<char*>(*vmm) + chunk / 2;
  auto exported = d_->ExportVmm(from, 2 * chunk, 1);
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_EQ(exported->chunks.size(), 3u);
  EXPECT_EQ(exported->offset, chunk / 2);
  for (const Driver::VmmChunk& c : exported->chunks) {
    EXPECT_GE(c.fd, 0);
    EXPECT_EQ(c.size, chunk);
  }
  // Mapped again (here in the same process, as another would) on device 0:
  // the same bytes, through the driver's copies only.
  auto mapped = d_->ImportVmm(exported->chunks, 0);
  for (const Driver::VmmChunk& c : exported->chunks) close(c.fd);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  std::vector<char> got(3 * chunk);
  ASSERT_TRUE(d_->Copy(got.data(), *mapped, got.size(), 0).ok());
  EXPECT_TRUE(got == pattern);
  // Writes through the second mapping land in the first.
  const char mark[4] = {'v', 'm', 'm', '!'};
  ASSERT_TRUE(d_->Copy(static_cast<char*>(*mapped) + chunk + 3, mark, 4, 0).ok());
  char seen[4] = {};
  ASSERT_TRUE(d_->Copy(seen, static_cast<char*>(*vmm) + chunk + 3, 4, 1).ok());
  EXPECT_EQ(std::memcmp(seen, mark, 4), 0);
  d_->VmmUnmap(*mapped, 3 * chunk, 0);
  // Unmapped and freed: neither device memory nor readable host memory.
  EXPECT_FALSE(d_->IsVmm(*mapped, 0));
  EXPECT_FALSE(d_->Classify(*mapped, 4).ok());
  EXPECT_TRUE(d_->FreeVmm(*vmm, chunk, 3, 1).ok());
  EXPECT_FALSE(d_->Classify(*vmm, 4).ok());
  EXPECT_TRUE(d_->FreeDevice(*plain, 1).ok());
}

TEST_F(FakeDriverTest, ImportingSomethingThatIsNotAnAllocationFails) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  auto mapped = d_->ImportVmm({Driver::VmmChunk{pipe_fds[0], 2 << 20}}, 0);
  EXPECT_FALSE(mapped.ok());
  EXPECT_NE(mapped.status().message().find("cuMemImportFromShareableHandle"), std::string::npos)
      << mapped.status();
  EXPECT_FALSE(d_->ImportVmm({}, 0).ok());
  close(pipe_fds[0]);
  close(pipe_fds[1]);
}

}  // namespace
}  // namespace cuda
}  // namespace kvferry
