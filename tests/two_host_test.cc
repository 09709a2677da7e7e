// Two engines on two hosts over RDMA: run by `tools/softroce/vm.sh --pair`,
// which boots two VMs wired by a QEMU socket netdev, each with Soft-RoCE on
// its virtio NIC, and runs this binary in both. The environment says which
// side this is:
//   KVFERRY_VM_ROLE  a (target) or b (initiator)
//   KVFERRY_VM_IP    this host's address, KVFERRY_VM_PEER_IP the other's
// Outside such a pair the test skips (it is tagged manual).
//
// The target registers a source and a zeroed destination, publishes their
// addresses as metadata and waits. The initiator finds the target by
// host:port alone (no configuration), WRITEs 4 MiB in 64 KiB requests and
// READs 4 MiB back, checks what it read, and notifies the target once the
// write batch is complete. The target checks every byte it received and
// answers over its own handshake to the initiator.
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace {

using transport::Opcode;

constexpr uint16_t kPort = 17100;
constexpr size_t kBytes = 4 << 20, kBlock = 64 << 10;

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

std::vector<char> Pattern(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(i * 151 + seed * 13 + (i >> 11));
  return v;
}

class TwoHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    role_ = Env("KVFERRY_VM_ROLE");
    ip_ = Env("KVFERRY_VM_IP");
    peer_ip_ = Env("KVFERRY_VM_PEER_IP");
    if (role_.empty() || ip_.empty() || peer_ip_.empty()) {
      GTEST_SKIP() << "not inside a VM pair (run tools/softroce/vm.sh --pair)";
    }
    EngineOptions o;
    o.port = kPort;
    o.transport = "rdma";  // a silent fall back to TCP would prove nothing
    auto e = TransferEngine::Create(o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
    // Zero configuration: the engine must have found this host's address
    // (the RDMA netdev's) by itself.
    EXPECT_EQ(engine_->address(), absl::StrCat(ip_, ":", kPort));
    EXPECT_EQ(engine_->detection().transport, "rdma") << engine_->detection().transport_reason;
  }

  std::string role_, ip_, peer_ip_;
  std::unique_ptr<TransferEngine> engine_;
};

TEST_F(TwoHostTest, WriteAndReadBetweenHostsOverRdma) {
  std::vector<char> src = Pattern(kBytes, role_ == "a" ? 1 : 2);
  std::vector<char> dst(kBytes, 0);
  // The other host reads `src` and writes `dst`.
  ASSERT_TRUE(engine_->RegisterMemory(src.data(), src.size(), transport::Access::kRemoteRead).ok());
  ASSERT_TRUE(engine_->RegisterMemory(dst.data(), dst.size(), transport::Access::kRemoteWrite).ok());
  if (role_ == "a") {
    ASSERT_TRUE(engine_
                    ->PublishMetadata("buffers",
                                      absl::StrCat(reinterpret_cast<uintptr_t>(src.data()), " ",
                                                   reinterpret_cast<uintptr_t>(dst.data())))
                    .ok());
    auto n = engine_->WaitNotification(absl::Seconds(240));
    ASSERT_TRUE(n.ok()) << n.status();
    std::vector<std::string> words = absl::StrSplit(n->message, ' ');
    ASSERT_EQ(words.size(), 2u) << n->message;
    EXPECT_EQ(words[0], "written");
    const bool same = dst == Pattern(kBytes, 2);
    EXPECT_TRUE(same) << "bytes written by the other host differ";
    auto back = engine_->OpenSegment(words[1]);
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_TRUE(engine_->Notify(*back, same ? "verified" : "corrupt").ok());
    // Stay up until the initiator has read the answer and said goodbye.
    auto bye = engine_->WaitNotification(absl::Seconds(60));
    EXPECT_TRUE(bye.ok() && bye->message == "bye") << bye.status();
    return;
  }
  // Initiator: the target may still be booting; try for a while.
  const std::string target = absl::StrCat(peer_ip_, ":", kPort);
  absl::StatusOr<SegmentId> seg;
  const absl::Time give_up = absl::Now() + absl::Seconds(120);
  do {
    seg = engine_->OpenSegment(target);
    if (!seg.ok()) absl::SleepFor(absl::Milliseconds(500));
  } while (!seg.ok() && absl::Now() < give_up);
  ASSERT_TRUE(seg.ok()) << seg.status();
  absl::StatusOr<std::string> buffers;
  do {  // published right after the target registered its memory
    buffers = engine_->FetchMetadata(*seg, "buffers");
    if (!buffers.ok()) absl::SleepFor(absl::Milliseconds(200));
  } while (!buffers.ok() && absl::Now() < give_up);
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  std::vector<std::string> words = absl::StrSplit(*buffers, ' ');
  ASSERT_EQ(words.size(), 2u);
  uint64_t remote_src = 0, remote_dst = 0;
  ASSERT_TRUE(absl::SimpleAtoi(words[0], &remote_src) && absl::SimpleAtoi(words[1], &remote_dst));

  std::vector<TransferRequest> writes, reads;
  for (size_t off = 0; off < kBytes; off += kBlock) {
    writes.push_back({Opcode::kWrite, src.data() + off, remote_dst + off, kBlock});
    reads.push_back({Opcode::kRead, dst.data() + off, remote_src + off, kBlock});
  }
  const absl::Time start = absl::Now();
  auto w = engine_->Submit(*seg, writes);
  ASSERT_TRUE(w.ok()) << w.status();
  auto r = engine_->Submit(*seg, reads);
  ASSERT_TRUE(r.ok()) << r.status();
  auto rs = engine_->Wait(*r, absl::Seconds(60));
  ASSERT_TRUE(rs.ok() && rs->ok()) << (rs.ok() ? rs->requests[0] : rs.status());
  EXPECT_TRUE(dst == Pattern(kBytes, 1)) << "bytes read from the other host differ";
  ASSERT_TRUE(
      engine_->NotifyAfter(*w, absl::StrCat("written ", engine_->address()), absl::Seconds(60))
          .ok());
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("two hosts: %zu MiB written + %zu MiB read over %s in %.3f s (%.1f MB/s)\n",
              kBytes >> 20, kBytes >> 20, engine_->detection().devices.c_str(), seconds,
              2.0 * kBytes / seconds / 1e6);
  auto answer = engine_->WaitNotification(absl::Seconds(60));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->message, "verified");
  EXPECT_TRUE(engine_->Notify(*seg, "bye").ok());
}

}  // namespace
}  // namespace kvferry
