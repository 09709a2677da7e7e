#include "cuda/driver.h"

#include <dlfcn.h>
#include <sys/mman.h>

#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
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
    // Queued copies land only when synchronized (not after a latency), so
    // that what a test sees before a synchronization is certain.
    setenv("KVFERRY_FAKE_CUDA_LATENCY_MS", "never", 1);
    d_ = UseFakeDriver();
    ASSERT_NE(d_, nullptr);
  }
  // An entry point of the loaded fake, called on a thread whose current
  // context is device `ordinal`'s primary one.
  template <class F>
  F Entry(const char* name) {
    void* lib = dlopen(d_->library().c_str(), RTLD_NOW | RTLD_NOLOAD);
    return lib == nullptr ? nullptr : reinterpret_cast<F>(dlsym(lib, name));
  }
  void MakeCurrent(int ordinal) {
    auto retain = Entry<api::CUresult (*)(void**, int)>("cuDevicePrimaryCtxRetain");
    auto set = Entry<api::CUresult (*)(void*)>("cuCtxSetCurrent");
    void* ctx = nullptr;
    ASSERT_EQ(retain(&ctx, ordinal), 0);
    ASSERT_EQ(set(ctx), 0);
  }
  std::vector<char> Read(void* device, size_t n, int ordinal) {
    std::vector<char> out(n);
    EXPECT_TRUE(d_->Copy(out.data(), device, n, ordinal).ok());
    return out;
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


// NVIDIA's rules, which the fake keeps: a copy queued on a stream lands when
// the stream is synchronized, not when the call returns; Copy waits for its
// own copy only.
TEST_F(FakeDriverTest, AQueuedCopyLandsOnlyWhenItsStreamIsSynchronized) {
  auto dev = d_->AllocDevice(0, 4096);
  auto pinned = d_->AllocPinned(4096);
  auto stream = d_->CreateStream(0);
  ASSERT_TRUE(dev.ok() && pinned.ok() && stream.ok());
  const std::vector<char> zeros(4096, 0);
  ASSERT_TRUE(d_->Copy(*dev, zeros.data(), zeros.size(), 0).ok());
  std::vector<char> pattern(4096);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<char>(i * 13 + 1);
  std::memcpy(*pinned, pattern.data(), pattern.size());
  ASSERT_TRUE(d_->CopyAsync(*dev, *pinned, 4096, *stream, 0).ok());
  EXPECT_EQ(Read(*dev, 4096, 0), zeros);  // queued, not landed
  ASSERT_TRUE(d_->Synchronize(*stream, 0).ok());
  EXPECT_EQ(Read(*dev, 4096, 0), pattern);
  // Device to pinned host: not there before the synchronization either.
  std::memset(*pinned, 0, 4096);
  ASSERT_TRUE(d_->CopyAsync(*pinned, *dev, 4096, *stream, 0).ok());
  EXPECT_EQ(std::memcmp(*pinned, zeros.data(), 4096), 0);
  ASSERT_TRUE(d_->Synchronize(*stream, 0).ok());
  EXPECT_EQ(std::memcmp(*pinned, pattern.data(), 4096), 0);
  d_->DestroyStream(*stream, 0);
  d_->FreePinned(*pinned);
  ASSERT_TRUE(d_->FreeDevice(*dev, 0).ok());
}

// A plain cuMemcpy device to device, or from pageable host memory to the
// device, may return before the copy ran; from pinned memory, and anything
// to the host, it returns once landed.
TEST_F(FakeDriverTest, APlainCuMemcpyMayReturnBeforeItsBytesLanded) {
  auto a = d_->AllocDevice(0, 4096);
  auto b = d_->AllocDevice(0, 4096);
  auto pinned = d_->AllocPinned(4096);
  ASSERT_TRUE(a.ok() && b.ok() && pinned.ok());
  std::vector<char> pattern(4096), zeros(4096, 0), other(4096, 'x');
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<char>(i * 7 + 3);
  ASSERT_TRUE(d_->Copy(*a, pattern.data(), 4096, 0).ok());
  ASSERT_TRUE(d_->Copy(*b, zeros.data(), 4096, 0).ok());
  auto memcpy_ = Entry<api::CUresult (*)(uint64_t, uint64_t, size_t)>("cuMemcpy");
  auto ctx_sync = Entry<api::CUresult (*)()>("cuCtxSynchronize");
  ASSERT_NE(memcpy_, nullptr);
  ASSERT_NE(ctx_sync, nullptr);
  std::thread([&] {
    MakeCurrent(0);
    const auto at = [](const void* p) { return reinterpret_cast<uint64_t>(p); };
    ASSERT_EQ(memcpy_(at(*b), at(*a), 4096), 0);  // device to device
    EXPECT_EQ(Read(*b, 4096, 0), zeros);
    ASSERT_EQ(ctx_sync(), 0);
    EXPECT_EQ(Read(*b, 4096, 0), pattern);
    // Pageable host to device: the source is staged at once (changing it
    // afterwards changes nothing), the bytes land later.
    std::vector<char> pageable = other;
    ASSERT_EQ(memcpy_(at(*b), at(pageable.data()), 4096), 0);
    pageable.assign(4096, 'y');
    EXPECT_EQ(Read(*b, 4096, 0), pattern);
    ASSERT_EQ(ctx_sync(), 0);
    EXPECT_EQ(Read(*b, 4096, 0), other);
    // Pinned host to device: landed on return.
    std::memcpy(*pinned, pattern.data(), 4096);
    ASSERT_EQ(memcpy_(at(*b), at(*pinned), 4096), 0);
    EXPECT_EQ(Read(*b, 4096, 0), pattern);
    // To the host, after the stream's earlier work.
    ASSERT_EQ(memcpy_(at(*b), at(other.data()), 4096), 0);
    std::vector<char> back(4096);
    ASSERT_EQ(memcpy_(at(back.data()), at(*b), 4096), 0);
    EXPECT_EQ(back, other);
  }).join();
  d_->FreePinned(*pinned);
  ASSERT_TRUE(d_->FreeDevice(*a, 0).ok());
  ASSERT_TRUE(d_->FreeDevice(*b, 0).ok());
}

struct HostFuncSeen {
  const char* pinned = nullptr;
  std::vector<char> bytes;
  std::atomic<bool> ran{false};
};

void SeeHostBytes(void* p) {
  auto* seen = static_cast<HostFuncSeen*>(p);
  seen->bytes.assign(seen->pinned, seen->pinned + 4096);
  seen->ran = true;
}

// A host function runs once the stream's earlier work landed; an event says
// when the stream reached it.
TEST_F(FakeDriverTest, HostFunctionsAndEventsFollowTheStreamsOrder) {
  auto dev = d_->AllocDevice(1, 4096);
  auto pinned = d_->AllocPinned(4096);
  auto stream = d_->CreateStream(1);
  ASSERT_TRUE(dev.ok() && pinned.ok() && stream.ok());
  std::vector<char> pattern(4096);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<char>(i * 5 + 2);
  ASSERT_TRUE(d_->Copy(*dev, pattern.data(), 4096, 1).ok());
  std::memset(*pinned, 0, 4096);
  ASSERT_TRUE(d_->CopyAsync(*pinned, *dev, 4096, *stream, 1).ok());
  HostFuncSeen seen;
  seen.pinned = static_cast<const char*>(*pinned);
  ASSERT_TRUE(d_->LaunchHostFunc(*stream, 1, &SeeHostBytes, &seen).ok());
  auto event = d_->RecordEvent(*stream, 1);
  ASSERT_TRUE(event.ok()) << event.status();
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(seen.ran);  // the copy before it has not landed
  EXPECT_FALSE(d_->EventDone(*event, 1).value_or(true));
  ASSERT_TRUE(d_->WaitEvent(*event, 1).ok());
  EXPECT_TRUE(d_->EventDone(*event, 1).value_or(false));
  ASSERT_TRUE(seen.ran);
  EXPECT_EQ(seen.bytes, pattern);  // it ran after the copy
  d_->DestroyEvent(*event, 1);
  d_->DestroyStream(*stream, 1);
  d_->FreePinned(*pinned);
  ASSERT_TRUE(d_->FreeDevice(*dev, 1).ok());
}

}  // namespace
}  // namespace cuda
}  // namespace kvferry
