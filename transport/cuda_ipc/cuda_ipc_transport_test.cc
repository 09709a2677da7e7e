// The cuda_ipc transport through the fake CUDA driver (//cuda/testing): its
// links stay on this host, device memory goes by reference and is copied
// GPU to GPU by the responder, and a link keeps a bounded number of the
// peer's allocations open.
#include "transport/cuda_ipc/cuda_ipc_transport.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda/driver.h"
#include "cuda/testing/fake_driver.h"
#include "gtest/gtest.h"
#include "transport/in_process.h"
#include "transport/kinds.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace transport {
namespace {

// A counter the fake driver exports for tests (fake_cuda.cc).
uint64_t FakeCounter(const char* name) {
  void* lib = ::dlopen(std::getenv("KVFERRY_CUDA_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
  auto fn = lib == nullptr ? nullptr : reinterpret_cast<uint64_t (*)()>(::dlsym(lib, name));
  EXPECT_NE(fn, nullptr) << name;
  return fn == nullptr ? 0 : fn();
}

class CudaIpcTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Two processes' transports in one: let the fake open this process's
    // own handles, as another process would.
    ::setenv("KVFERRY_FAKE_CUDA_IPC_IN_PROCESS", "1", 1);
    d_ = cuda::UseFakeDriver();
    ASSERT_NE(d_, nullptr);
  }
  std::unique_ptr<Transport> Make(size_t max_imports = 64) {
    CudaIpcTransportOptions o;
    o.stream.in_process_shortcut = false;
    o.share.max_imports = max_imports;
    auto t = CreateCudaIpcTransport(o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }
  // Posts one request on `link` of `t` and returns its status.
  static absl::Status Run(Transport& t, LinkId link, Opcode op, const Region& local,
                          const Region& remote, uint64_t length) {
    WorkRequest wr;
    wr.opcode = op;
    wr.link = link;
    wr.local_region = local.id;
    wr.local_addr = reinterpret_cast<void*>(local.addr);
    wr.length = length;
    wr.remote_addr = remote.addr;
    wr.remote_key = remote.keys[0];
    wr.cookie = 7;
    absl::Status posted = t.Post({&wr, 1});
    if (!posted.ok()) return posted;
    Completion c;
    if (t.WaitCompletions({&c, 1}, absl::Seconds(10)) != 1) {
      return absl::DeadlineExceededError("no completion");
    }
    EXPECT_EQ(c.cookie, 7u);
    return c.status;
  }
  const cuda::Driver* d_ = nullptr;
};

TEST_F(CudaIpcTransportTest, ItsKindIsItsOwn) {
  auto t = Make();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->LocalEndpoint().kind, kind::kCudaIpc);
  // A TCP transport's link parameters are not this transport's.
  auto offer = t->AcceptLink(0, NicInfo{}, tcp_wire::EncodeLinkParams(1, 0, 0));
  EXPECT_EQ(offer.status().code(), absl::StatusCode::kInvalidArgument) << offer.status();
}

TEST_F(CudaIpcTransportTest, ALinkToAnotherHostIsRefused) {
  auto t = Make();
  ASSERT_NE(t, nullptr);
  auto offer = t->AcceptLink(0, NicInfo{},
                             tcp_wire::EncodeLinkParams(1, 0, /*host=*/0x1234, 0, kind::kCudaIpc));
  EXPECT_EQ(offer.status().code(), absl::StatusCode::kFailedPrecondition) << offer.status();
  EXPECT_NE(offer.status().message().find("one host"), absl::string_view::npos) << offer.status();
}

TEST_F(CudaIpcTransportTest, DeviceMemoryGoesByReferenceAndLands) {
  auto a = Make();
  auto b = Make();
  ASSERT_TRUE(a != nullptr && b != nullptr);
  auto links = ConnectInProcess(*a, *b);
  ASSERT_TRUE(links.ok()) << links.status();
  constexpr size_t kSize = 1 << 16;
  void* src = d_->AllocDevice(0, kSize).value_or(nullptr);
  void* dst = d_->AllocDevice(1, kSize).value_or(nullptr);
  ASSERT_TRUE(src != nullptr && dst != nullptr);
  std::vector<char> bytes(kSize), zero(kSize, 0), back(kSize);
  for (size_t i = 0; i < kSize; ++i) bytes[i] = static_cast<char>(i * 37 + 11);
  ASSERT_TRUE(d_->Copy(src, bytes.data(), kSize, 0).ok());
  ASSERT_TRUE(d_->Copy(dst, zero.data(), kSize, 1).ok());
  auto rs = a->RegisterMemory(src, kSize, Access::kRemoteReadWrite);
  auto rd = b->RegisterMemory(dst, kSize, Access::kRemoteReadWrite);
  ASSERT_TRUE(rs.ok() && rd.ok());
  const uint64_t opens = FakeCounter("kvferry_fake_cuda_ipc_opens");
  // WRITE: b opens a's allocation and copies; done means landed.
  ASSERT_TRUE(Run(*a, links->first, Opcode::kWrite, *rs, *rd, kSize).ok());
  ASSERT_TRUE(d_->Copy(back.data(), dst, kSize, 1).ok());
  EXPECT_EQ(back, bytes);
  EXPECT_EQ(FakeCounter("kvferry_fake_cuda_ipc_opens") - opens, 1u);
  // READ back into a zeroed source: the same allocation, opened already.
  ASSERT_TRUE(d_->Copy(src, zero.data(), kSize, 0).ok());
  ASSERT_TRUE(Run(*a, links->first, Opcode::kRead, *rs, *rd, kSize).ok());
  ASSERT_TRUE(d_->Copy(back.data(), src, kSize, 0).ok());
  EXPECT_EQ(back, bytes);
  EXPECT_EQ(FakeCounter("kvferry_fake_cuda_ipc_opens") - opens, 1u);
  ASSERT_TRUE(a->UnregisterMemory(rs->id).ok());
  ASSERT_TRUE(b->UnregisterMemory(rd->id).ok());
  EXPECT_TRUE(d_->FreeDevice(src, 0).ok());
  EXPECT_TRUE(d_->FreeDevice(dst, 1).ok());
}

// VMM memory (the fake maps a process's own exported fds again, as another
// process would): the responder maps the requester's regions, keeps at
// most CudaShareOptions::max_imports of them per link, and maps one it
// dropped again when it comes back.
TEST_F(CudaIpcTransportTest, ALinkKeepsAtMostMaxImportsMapped) {
  auto a = Make(/*max_imports=*/1);
  auto b = Make(/*max_imports=*/1);
  ASSERT_TRUE(a != nullptr && b != nullptr);
  auto links = ConnectInProcess(*a, *b);
  ASSERT_TRUE(links.ok()) << links.status();
  const uint64_t chunk = d_->VmmGranularity(0).value_or(0);
  ASSERT_GT(chunk, 0u);
  void* one = d_->AllocVmm(0, chunk, 1).value_or(nullptr);
  void* two = d_->AllocVmm(0, chunk, 1).value_or(nullptr);
  void* dst = d_->AllocDevice(1, 8192).value_or(nullptr);
  ASSERT_TRUE(one != nullptr && two != nullptr && dst != nullptr);
  auto r1 = a->RegisterMemory(one, chunk, Access::kRemoteReadWrite);
  auto r2 = a->RegisterMemory(two, chunk, Access::kRemoteReadWrite);
  auto rd = b->RegisterMemory(dst, 8192, Access::kRemoteReadWrite);
  ASSERT_TRUE(r1.ok() && r2.ok() && rd.ok());
  auto write = [&](const Region& from) {
    EXPECT_TRUE(Run(*a, links->first, Opcode::kWrite, from, *rd, 4096).ok());
  };
  const uint64_t before = FakeCounter("kvferry_fake_cuda_vmm_imports");
  write(*r1);
  write(*r1);  // kept
  EXPECT_EQ(FakeCounter("kvferry_fake_cuda_vmm_imports") - before, 1u);
  write(*r2);  // r1 dropped to make room
  write(*r1);  // mapped again
  EXPECT_EQ(FakeCounter("kvferry_fake_cuda_vmm_imports") - before, 3u);
  ASSERT_TRUE(a->UnregisterMemory(r1->id).ok());
  ASSERT_TRUE(a->UnregisterMemory(r2->id).ok());
  ASSERT_TRUE(b->UnregisterMemory(rd->id).ok());
  EXPECT_TRUE(d_->FreeVmm(one, chunk, 1, 0).ok());
  EXPECT_TRUE(d_->FreeVmm(two, chunk, 1, 0).ok());
  EXPECT_TRUE(d_->FreeDevice(dst, 1).ok());
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
