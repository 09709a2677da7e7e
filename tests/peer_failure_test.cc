// Peers that fail for real, in their own processes, over TCP: frozen
// (SIGSTOP: sockets stay open, nothing answers), killed (SIGKILL) and
// restarted on the same port with new keys and a new buffer.
#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "tests/peer_process.h"

namespace kvferry {
namespace {

using transport::Opcode;

constexpr uint64_t kBytes = 32 << 20;
constexpr uint64_t kBlock = 64 << 10;

std::unique_ptr<TransferEngine> Initiator(absl::Duration peer_timeout) {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.transport = "tcp";
  o.peer_timeout = peer_timeout;
  auto e = TransferEngine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

std::vector<TransferRequest> Writes(std::vector<char>& src, uint64_t remote, uint64_t bytes) {
  std::vector<TransferRequest> r;
  for (uint64_t off = 0; off < bytes; off += kBlock) {
    r.push_back({Opcode::kWrite, src.data() + off, remote + off, kBlock});
  }
  return r;
}

// Writes `bytes` to the peer and reads them back into `check`; true if the
// bytes came back equal.
bool RoundTrip(TransferEngine& e, SegmentId seg, std::vector<char>& src, std::vector<char>& check,
               uint64_t remote, uint64_t bytes) {
  auto w = e.Submit(seg, Writes(src, remote, bytes));
  if (!w.ok() || !e.Wait(*w, absl::Seconds(20)).value_or(BatchStatus{}).ok()) return false;
  std::vector<TransferRequest> reads = Writes(check, remote, bytes);
  for (TransferRequest& r : reads) r.opcode = Opcode::kRead;
  auto r = e.Submit(seg, reads);
  if (!r.ok() || !e.Wait(*r, absl::Seconds(20)).value_or(BatchStatus{}).ok()) return false;
  return std::equal(src.begin(), src.begin() + bytes, check.begin());
}

TEST(PeerFailure, FrozenPeerFailsInFlightRequestsWithinPeerTimeoutThenRestartWorks) {
  auto peer = PeerProcess::Start(0, kBytes);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const absl::Duration kPeerTimeout = absl::Seconds(1);
  auto e = Initiator(kPeerTimeout);
  std::vector<char> src(kBytes), check(kBytes);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7 + (i >> 13));
  ASSERT_TRUE(e->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(e->RegisterMemory(check.data(), check.size()).ok());
  auto seg = e->OpenSegment(peer->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  uint64_t remote = 0, length = 0;
  ASSERT_TRUE(ParseBuffer(e->FetchMetadata(*seg, "buffer").value_or(""), &remote, &length));
  ASSERT_TRUE(RoundTrip(*e, *seg, src, check, remote, 1 << 20));

  // Frozen mid-batch: 32 MiB cannot fit in the socket buffers.
  auto doomed = e->Submit(*seg, Writes(src, remote, kBytes));
  ASSERT_TRUE(doomed.ok()) << doomed.status();
  peer->Freeze();
  const absl::Time frozen = absl::Now();
  auto ended = e->Wait(*doomed, absl::Seconds(30));
  const absl::Duration took = absl::Now() - frozen;
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->pending, 0u);
  EXPECT_GT(ended->failed, 0u);
  for (const absl::Status& s : ended->requests) {
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kUnavailable) << s;
  }
  // The bound: peer_timeout (silence for half, the probe for the other
  // half), plus scheduling slack.
  EXPECT_LT(took, kPeerTimeout + absl::Seconds(2)) << "took " << took;
  std::printf("frozen peer: batch failed %s after the freeze\n",
              absl::FormatDuration(took).c_str());
  EXPECT_GE(e->GetCounters().probes_failed, 1u);

  // Killed and restarted on the same port: new keys, new buffer address.
  const uint16_t port = peer->port();
  peer->Kill();
  peer = PeerProcess::Start(port, kBytes);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto value = e->FetchMetadata(*seg, "buffer");  // handshakes again
  ASSERT_TRUE(value.ok()) << value.status();
  ASSERT_TRUE(ParseBuffer(*value, &remote, &length));
  EXPECT_TRUE(RoundTrip(*e, *seg, src, check, remote, 4 << 20));
}

TEST(PeerFailure, ConcurrentCallersShareOneReconnectAfterARestart) {
  auto peer = PeerProcess::Start(0, kBytes);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto e = Initiator(absl::Seconds(5));
  std::vector<char> src(kBytes);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 11 + 3);
  ASSERT_TRUE(e->RegisterMemory(src.data(), src.size()).ok());
  auto seg = e->OpenSegment(peer->address());
  ASSERT_TRUE(seg.ok());
  uint64_t remote = 0, length = 0;
  ASSERT_TRUE(ParseBuffer(e->FetchMetadata(*seg, "buffer").value_or(""), &remote, &length));
  const uint16_t port = peer->port();
  peer->Kill();
  peer = PeerProcess::Start(port, kBytes);
  ASSERT_TRUE(peer.ok()) << peer.status();
  // The restarted peer's buffer may sit elsewhere: learn it first, which
  // itself handshakes once.
  const uint64_t reconnects_before = e->GetCounters().reconnects;
  // Eight threads race on the stale segment: one reconnect serves them all,
  // and nobody writes with the dead peer's keys.
  std::atomic<uint64_t> new_remote{0};
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto v = e->FetchMetadata(*seg, "buffer");
      uint64_t r = 0, len = 0;
      if (!v.ok() || !ParseBuffer(*v, &r, &len)) return;
      new_remote = r;  // same value from every thread
      const uint64_t off = t * (1 << 20);
      TransferRequest w{Opcode::kWrite, src.data() + off, r + off, 1 << 20};
      auto b = e->Submit(*seg, {&w, 1});
      if (b.ok() && e->Wait(*b, absl::Seconds(20)).value_or(BatchStatus{}).ok()) ++ok;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok.load(), 8);
  EXPECT_NE(new_remote.load(), 0u);
  EXPECT_EQ(e->GetCounters().reconnects - reconnects_before, 1u);
}

}  // namespace
}  // namespace kvferry
