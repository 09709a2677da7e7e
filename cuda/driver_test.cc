#include "cuda/driver.h"

#include <dlfcn.h>
#include <sys/mman.h>

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
