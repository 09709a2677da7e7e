// The TCP transport with CUDA device memory on either end or both, through
// the fake driver (//cuda/testing): its device memory is PROT_NONE to the
// CPU, so a byte of it read or written anywhere but through the driver's
// copies crashes the test. Over sockets (bytes staged through pinned
// buffers) and through the in-process shortcut (the driver's copies).
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/driver.h"
#include "cuda/testing/fake_driver.h"
#include "gtest/gtest.h"
#include "transport/in_process.h"
#include "transport/tcp/tcp_transport.h"

namespace kvferry {
namespace transport {
namespace {

// A buffer on a device (ordinal >= 0) or on the host (-1).
class Buffer {
 public:
  Buffer(const cuda::Driver* d, int device, size_t size) : d_(d), device_(device), size_(size) {
    if (device < 0) {
      host_.resize(size);
      p_ = host_.data();
    } else {
      auto p = d->AllocDevice(device, size);
      EXPECT_TRUE(p.ok()) << p.status();
      p_ = p.value_or(nullptr);
    }
  }
  ~Buffer() {
    if (device_ >= 0 && p_ != nullptr) {
      EXPECT_TRUE(d_->FreeDevice(p_, device_).ok());
    }
  }
  char* data() const { return static_cast<char*>(p_); }
  size_t size() const { return size_; }
  void Fill(int seed) {
    std::vector<char> v(size_);
    for (size_t i = 0; i < size_; ++i) v[i] = static_cast<char>(i * 131 + seed * 7 + (i >> 11));
    Put(v);
  }
  void Put(const std::vector<char>& v) {
    ASSERT_TRUE(d_->Copy(p_, v.data(), v.size(), std::max(device_, 0)).ok());
  }
  std::vector<char> Get() const {
    std::vector<char> v(size_);
    EXPECT_TRUE(d_->Copy(v.data(), p_, size_, std::max(device_, 0)).ok());
    return v;
  }

 private:
  const cuda::Driver* d_;
  int device_;
  size_t size_;
  void* p_ = nullptr;
  std::vector<char> host_;
};

struct Case {
  std::string name;
  int src_device;  // -1: host
  int dst_device;
  bool shortcut;
};

class TcpDeviceMemoryTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    d_ = cuda::UseFakeDriver();
    ASSERT_NE(d_, nullptr);
    TcpTransportOptions o;
    o.in_process_shortcut = GetParam().shortcut;
    auto a = CreateTcpTransport(o);
    auto b = CreateTcpTransport(o);
    ASSERT_TRUE(a.ok() && b.ok());
    a_ = std::move(*a);
    b_ = std::move(*b);
    auto links = ConnectInProcess(*a_, *b_, 0, 0);
    ASSERT_TRUE(links.ok()) << links.status();
    link_ = links->first;
  }
  absl::Status Run(Opcode op, Buffer& local, const Region& local_region, size_t local_off,
                   const Region& remote, size_t remote_off, size_t len) {
    WorkRequest wr;
    wr.opcode = op;
    wr.link = link_;
    wr.local_region = local_region.id;
    wr.local_addr = local.data() + local_off;
    wr.length = len;
    wr.remote_addr = remote.addr + remote_off;
    wr.remote_key = remote.keys[0];
    wr.cookie = ++cookie_;
    absl::Status posted = a_->Post({&wr, 1});
    if (!posted.ok()) return posted;
    Completion c;
    for (int i = 0; i < 100; ++i) {
      if (a_->WaitCompletions({&c, 1}, absl::Seconds(1)) == 1) {
        EXPECT_EQ(c.cookie, wr.cookie);
        return c.status;
      }
    }
    return absl::DeadlineExceededError("no completion");
  }
  const cuda::Driver* d_ = nullptr;
  std::unique_ptr<Transport> a_, b_;
  LinkId link_ = 0;
  uint64_t cookie_ = 0;
};

TEST_P(TcpDeviceMemoryTest, WritesAndReadsMoveTheBytes) {
  // Larger than a staging buffer and at odd offsets, so a request takes
  // several chunks and a short last one.
  constexpr size_t kSize = (1 << 20) + 4096;
  Buffer src(d_, GetParam().src_device, kSize), dst(d_, GetParam().dst_device, kSize);
  src.Fill(1);
  dst.Fill(2);
  auto rs = a_->RegisterMemory(src.data(), kSize, Access::kRemoteReadWrite);
  auto rd = b_->RegisterMemory(dst.data(), kSize, Access::kRemoteReadWrite);
  ASSERT_TRUE(rs.ok()) << rs.status();
  ASSERT_TRUE(rd.ok()) << rd.status();
  const size_t len = kSize - 777;
  const std::vector<char> source = src.Get();
  std::vector<char> expect = dst.Get();
  std::memcpy(expect.data() + 11, source.data() + 3, len);
  ASSERT_TRUE(Run(Opcode::kWrite, src, *rs, 3, *rd, 11, len).ok());
  EXPECT_TRUE(dst.Get() == expect) << "the WRITE landed wrong bytes, or outside its range";
  // And READ them back into a third buffer on the source's side.
  Buffer back(d_, GetParam().src_device, kSize);
  back.Fill(3);
  auto rb = a_->RegisterMemory(back.data(), kSize, Access::kNone);
  ASSERT_TRUE(rb.ok()) << rb.status();
  ASSERT_TRUE(Run(Opcode::kRead, back, *rb, 0, *rd, 11, len).ok());
  EXPECT_EQ(std::memcmp(back.Get().data(), source.data() + 3, len), 0);
  ASSERT_TRUE(a_->UnregisterMemory(rs->id).ok());
  ASSERT_TRUE(a_->UnregisterMemory(rb->id).ok());
  ASSERT_TRUE(b_->UnregisterMemory(rd->id).ok());
}

TEST_P(TcpDeviceMemoryTest, ARefusedWriteLeavesTheTargetUntouched) {
  Buffer src(d_, GetParam().src_device, 8192), dst(d_, GetParam().dst_device, 8192);
  src.Fill(4);
  dst.Fill(5);
  const std::vector<char> before = dst.Get();
  auto rs = a_->RegisterMemory(src.data(), 8192, Access::kRemoteReadWrite);
  auto rd = b_->RegisterMemory(dst.data(), 4096, Access::kRemoteReadWrite);
  ASSERT_TRUE(rs.ok() && rd.ok());
  EXPECT_FALSE(Run(Opcode::kWrite, src, *rs, 0, *rd, 0, 8192).ok());  // past the region
  EXPECT_TRUE(dst.Get() == before);
}

INSTANTIATE_TEST_SUITE_P(
    Ends, TcpDeviceMemoryTest,
    ::testing::Values(Case{"device_to_host", 0, -1, false}, Case{"host_to_device", -1, 1, false},
                      Case{"device_to_device", 1, 0, false}, Case{"host_to_host", -1, -1, false},
                      Case{"in_process_device_to_host", 0, -1, true},
                      Case{"in_process_host_to_device", -1, 0, true},
                      Case{"in_process_device_to_device", 0, 1, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(TcpDeviceRegistrationTest, ARangePastTheAllocationIsRefused) {
  const cuda::Driver* d = cuda::UseFakeDriver();
  ASSERT_NE(d, nullptr);
  auto t = CreateTcpTransport(TcpTransportOptions{});
  ASSERT_TRUE(t.ok());
  auto p = d->AllocDevice(0, 1 << 20);
  ASSERT_TRUE(p.ok());
  auto r = (*t)->RegisterMemory(*p, (1 << 20) + 4096, Access::kRemoteReadWrite);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE((*t)->RegisterMemory(*p, 1 << 20, Access::kRemoteReadWrite).ok());
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
