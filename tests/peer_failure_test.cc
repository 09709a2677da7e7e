// Peers that fail for real, in their own processes, over TCP: frozen
// (SIGSTOP: sockets stay open, nothing answers), killed (SIGKILL) and
// restarted on the same port with new keys and a new buffer.
#include <algorithm>
#include <atomic>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/prepared/prepared.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "kv/kv_cache.h"
#include "tests/peer_process.h"
#include "tests/test_kv_layout.h"

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
  auto peer = PeerProcess::StartOnStablePort(kBytes);  // restarted on its port below
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

// The same with a prepared transfer that nothing but State polls (no
// notification, no Wait): State still runs the liveness checks, so the
// frozen peer fails it within peer_timeout.
TEST(PeerFailure, FrozenPeerFailsAPreparedTransferThatOnlyStatePolls) {
  auto peer = PeerProcess::Start(0, kBytes);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const absl::Duration kPeerTimeout = absl::Seconds(1);
  auto e = Initiator(kPeerTimeout);
  std::vector<char> src(kBytes, 's');
  ASSERT_TRUE(e->RegisterMemory(src.data(), src.size()).ok());
  auto seg = e->OpenSegment(peer->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  uint64_t remote = 0, length = 0;
  ASSERT_TRUE(ParseBuffer(e->FetchMetadata(*seg, "buffer").value_or(""), &remote, &length));
  std::vector<Descriptor> mine, theirs;
  std::vector<int64_t> idx;
  for (uint64_t off = 0; off < kBytes; off += kBlock) {
    mine.push_back({reinterpret_cast<uint64_t>(src.data()) + off, kBlock});
    theirs.push_back({remote + off, kBlock});
    idx.push_back(static_cast<int64_t>(idx.size()));
  }
  PreparedTransfers& p = e->prepared();
  auto l = p.PrepareLocal(mine);
  auto r = p.PrepareRemote(*seg, theirs);
  ASSERT_TRUE(l.ok() && r.ok()) << l.status() << r.status();
  auto x = p.Make(Opcode::kWrite, *l, idx, *r, idx);
  ASSERT_TRUE(x.ok()) << x.status();
  ASSERT_TRUE(p.Post(*x).ok());
  peer->Freeze();  // 32 MiB cannot fit in the socket buffers
  const absl::Time frozen = absl::Now();
  absl::StatusOr<XferState> s = XferState::kInProgress;
  while (s.ok() && *s == XferState::kInProgress && absl::Now() - frozen < absl::Seconds(30)) {
    s = p.State(*x);
  }
  const absl::Duration took = absl::Now() - frozen;
  EXPECT_FALSE(s.ok()) << "the transfer finished against a frozen peer";
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s.status();
  EXPECT_LT(took, kPeerTimeout + absl::Seconds(2)) << "took " << took;
  EXPECT_GE(e->GetCounters().probes_failed, 1u);
  peer->Kill();
}

TEST(PeerFailure, ConcurrentCallersShareOneReconnectAfterARestart) {
  auto peer = PeerProcess::StartOnStablePort(kBytes);  // restarted on its port below
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

// ---------------------------------------------------------------- KV layer
//
// A decode (this process) expects a request from a prefill in another
// process (peer_main --kv_prefill_to), which sends one layer every 300 ms.
// The prefill dies or freezes just after layer 0 has landed; the decode's
// KvReceiver reports the request failed within peer_timeout, and nothing
// lands in its pool afterwards even when a frozen prefill resumes.

struct Decode {
  std::unique_ptr<TransferEngine> engine;
  KvPool pool;
  std::unique_ptr<KvReceiver> receiver;
};

Decode StartDecode(absl::Duration peer_timeout) {
  Decode d;
  d.engine = Initiator(peer_timeout);
  auto pool = KvPool::Allocate(TestKvLayout());
  EXPECT_TRUE(pool.ok()) << pool.status();
  d.pool = *pool;
  KvReceiver::Options o;
  o.peer_timeout = peer_timeout;
  auto r = KvReceiver::Create(d.engine.get(), d.pool, o);
  EXPECT_TRUE(r.ok()) << r.status();
  d.receiver = std::move(*r);
  return d;
}

absl::StatusOr<PeerProcess> StartPrefill(const Decode& d, const std::string& request,
                                         std::vector<std::string> extra = {}) {
  std::vector<std::string> flags = {absl::StrCat("--kv_prefill_to=", d.engine->address()),
                                    absl::StrCat("--kv_request=", request),
                                    "--kv_layer_delay_ms=300"};
  for (std::string& f : extra) flags.push_back(std::move(f));
  return PeerProcess::Start(0, 0, absl::Seconds(20), std::move(flags));
}

#if defined(__SANITIZE_THREAD__)
// The TSan runtime's annotations: LayerLanded peeks at memory a transport
// thread is writing, on purpose.
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#define PEEK_BEGIN() AnnotateIgnoreReadsBegin(__FILE__, __LINE__)
#define PEEK_END() AnnotateIgnoreReadsEnd(__FILE__, __LINE__)
#else
#define PEEK_BEGIN()
#define PEEK_END()
#endif

// Waits until the first byte of `layer`'s K buffer holds the prefill's
// value for it (peeking while the transport writes).
bool LayerLanded(const Decode& d, uint32_t layer, absl::Duration within) {
  const absl::Time deadline = absl::Now() + within;
  const volatile char* p = d.pool.page(layer, 0, 0);
  while (absl::Now() < deadline) {
    PEEK_BEGIN();
    const bool landed = *p == static_cast<char>(layer + 1);
    PEEK_END();
    if (landed) return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

std::string Snapshot(const KvPool& pool) {
  const KvLayout& l = pool.layout();
  std::string out;
  for (uint32_t b = 0; b < l.buffer_count(); ++b) out.append(pool.buffer(b), l.buffer_bytes());
  return out;
}

constexpr absl::Duration kKvPeerTimeout = absl::Seconds(1);
// peer_timeout plus scheduling slack (sanitizer builds are slow).
const absl::Duration kReportBound = kKvPeerTimeout + absl::Milliseconds(1500);

// Starts a prefill sending request `id` to `d`, stops it with `stop` just
// after layer 0 landed, and returns what the decode then reported (checked:
// failed with kUnavailable naming the prefill, within kReportBound).
KvReceiver::Status StopAfterLayer0(Decode& d, const std::string& id, const char* how,
                                   const std::function<void(PeerProcess&)>& stop,
                                   absl::StatusOr<PeerProcess>* prefill,
                                   std::vector<std::string> extra = {}) {
  *prefill = StartPrefill(d, id, std::move(extra));
  EXPECT_TRUE(prefill->ok()) << prefill->status();
  if (!prefill->ok()) return {};
  EXPECT_TRUE(d.receiver->Expect(id, (*prefill)->address()).ok());
  EXPECT_TRUE(LayerLanded(d, 0, absl::Seconds(10)));
  stop(**prefill);
  const absl::Time stopped = absl::Now();
  auto s = d.receiver->Wait(id, absl::Seconds(15));
  const absl::Duration took = absl::Now() - stopped;
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return {};
  EXPECT_EQ(s->state, KvReceiver::State::kFailed);
  EXPECT_EQ(s->error.code(), absl::StatusCode::kUnavailable) << s->error;
  EXPECT_NE(s->error.message().find((*prefill)->address()), std::string::npos) << s->error;
  EXPECT_LT(took, kReportBound) << "took " << took;
  std::printf("%s prefill: decode reported the request failed %s after it stopped\n", how,
              absl::FormatDuration(took).c_str());
  return *s;
}

// Serving code that forgets Expect: the decode only waits. It learned its
// prefill from the sender's begin word (confirmed with the engine at the
// address the word names) and watches it: the kill is reported within
// peer_timeout, not when the Wait times out.
TEST(PeerFailure, AKilledPrefillIsReportedToADecodeThatOnlyWaits) {
  Decode d = StartDecode(kKvPeerTimeout);
  auto prefill = StartPrefill(d, "wait-only");
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  ASSERT_TRUE(LayerLanded(d, 0, absl::Seconds(10)));
  // Its word is in: a Poll asks for the request (and adopts its prefill).
  EXPECT_EQ(d.receiver->Poll("wait-only").state, KvReceiver::State::kPending);
  prefill->Kill();
  const absl::Time killed = absl::Now();
  auto s = d.receiver->Wait("wait-only", absl::Seconds(15));
  const absl::Duration took = absl::Now() - killed;
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->state, KvReceiver::State::kFailed);
  EXPECT_NE(s->error.message().find(prefill->address()), std::string::npos) << s->error;
  EXPECT_LT(took, kReportBound) << "took " << took;
  std::printf("killed prefill, decode without Expect: reported %s after the kill\n",
              absl::FormatDuration(took).c_str());
}

TEST(PeerFailure, KvPrefillKilledMidRequestFailsItAtTheDecodeWithinPeerTimeout) {
  Decode d = StartDecode(kKvPeerTimeout);
  absl::StatusOr<PeerProcess> prefill;
  StopAfterLayer0(
      d, "killed", "killed", [](PeerProcess& p) { p.Kill(); }, &prefill);
  if (HasFailure()) return;
  // The decode goes on: a new prefill's request completes.
  auto next = StartPrefill(d, "next");
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE(d.receiver->Expect("next", next->address()).ok());
  auto done = d.receiver->Wait("next", absl::Seconds(20));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state, KvReceiver::State::kComplete) << done->error;
  EXPECT_EQ(done->aux, "aux");
  for (uint32_t layer = 0; layer < TestKvLayout().layers; ++layer) {
    EXPECT_EQ(*d.pool.page(layer, 1, TestKvLayout().pages - 1), static_cast<char>(layer + 1));
  }
}

// The frozen prefill is fenced at its epoch (0). Thawed, it finds its
// writes refused, learns the fence from the refusal, and sends its next
// request (4 s after the first ended) at epoch 1: that one completes, from
// the same process.
TEST(PeerFailure, KvPrefillFrozenMidRequestIsFailedAndFencedBeforeItResumes) {
  Decode d = StartDecode(kKvPeerTimeout);
  absl::StatusOr<PeerProcess> prefill;
  const KvReceiver::Status s =
      StopAfterLayer0(d, "frozen", "frozen", [](PeerProcess& p) { p.Freeze(); }, &prefill,
                      {"--kv_then=frozen-next", "--kv_then_after_ms=4000"});
  if (HasFailure()) return;
  EXPECT_NE(s.error.message().find("has not answered"), std::string::npos) << s.error;
  EXPECT_EQ(d.engine->GetCounters().peers_fenced, 1u);
  // Fenced: the prefill resumes and tries to send layers 1-3 (one every
  // 300 ms) and its completion; none of it lands, nor is it reported.
  const std::string at_report = Snapshot(d.pool);
  prefill->Thaw();
  absl::SleepFor(absl::Seconds(2));
  EXPECT_TRUE(Snapshot(d.pool) == at_report) << "bytes landed after the failure was reported";
  EXPECT_EQ(d.receiver->Poll("frozen").state, KvReceiver::State::kFailed);
  // Its next request, at the next epoch, is served.
  ASSERT_TRUE(d.receiver->Expect("frozen-next", prefill->address()).ok());
  auto next = d.receiver->Wait("frozen-next", absl::Seconds(20));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->state, KvReceiver::State::kComplete) << next->error;
  EXPECT_EQ(next->aux, "aux2");
  for (uint32_t layer = 0; layer < TestKvLayout().layers; ++layer) {
    EXPECT_EQ(*d.pool.page(layer, 1, TestKvLayout().pages - 1), static_cast<char>(layer + 101));
  }
  EXPECT_EQ(d.receiver->Poll("frozen").state, KvReceiver::State::kFailed);
}

// A prefill whose port refuses connections is gone for certain: reported at
// the first probe, well within peer_timeout.
TEST(PeerFailure, KvRequestFromAPrefillWhosePortRefusesFailsAtOnce) {
  Decode d = StartDecode(kKvPeerTimeout);
  // An address where nothing listens any more.
  auto gone = PeerProcess::Start(0, 4096);
  ASSERT_TRUE(gone.ok()) << gone.status();
  const std::string address = gone->address();
  gone->Kill();
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(d.receiver->Expect("never", address).ok());
  auto s = d.receiver->Wait("never", absl::Seconds(15));
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->state, KvReceiver::State::kFailed);
  EXPECT_LT(took, absl::Milliseconds(100)) << "took " << took;
  EXPECT_NE(s->error.message().find("refuses connections"), std::string::npos) << s->error;
  EXPECT_EQ(d.receiver->Expect("bad", "no-port").code(), absl::StatusCode::kInvalidArgument);
  // Declared again after it failed: it stays failed.
  EXPECT_TRUE(d.receiver->Expect("never", address).ok());
  EXPECT_EQ(d.receiver->Poll("never").state, KvReceiver::State::kFailed);
}

// A decode that freezes: the prefill's next Begin fails within the
// sender's peer_timeout plus its tell_timeout (1 s each here: it tries to
// tell the decode), not after the engine's handshake timeouts (11 s with
// the defaults) as it did.
TEST(PeerFailure, AKvSenderLearnsOfAFrozenDecodeWithinItsPeerTimeout) {
  auto decode = PeerProcess::Start(0, 4096);  // an engine without a KV pool
  ASSERT_TRUE(decode.ok()) << decode.status();
  auto engine = Initiator(absl::Seconds(4));
  auto pool = KvPool::Allocate(TestKvLayout());
  ASSERT_TRUE(pool.ok());
  KvSender::Options so;
  so.peer_timeout = absl::Seconds(1);
  so.tell_timeout = absl::Seconds(1);
  auto sender = KvSender::Create(engine.get(), *pool, so);
  ASSERT_TRUE(sender.ok()) << sender.status();
  // Alive: it answers at once that it has no KV pool (and the segment is open).
  auto first = (*sender)->Begin("a", decode->address(), {0}, {0});
  EXPECT_EQ(first.status().code(), absl::StatusCode::kNotFound) << first.status();
  decode->Freeze();
  const absl::Time start = absl::Now();
  auto frozen = (*sender)->Begin("b", decode->address(), {0}, {0});
  const absl::Duration took = absl::Now() - start;
  decode->Thaw();
  EXPECT_FALSE(frozen.ok());
  EXPECT_TRUE(frozen.status().code() == absl::StatusCode::kDeadlineExceeded ||
              frozen.status().code() == absl::StatusCode::kUnavailable)
      << frozen.status();
  std::printf("frozen decode: Begin failed after %s\n", absl::FormatDuration(took).c_str());
  EXPECT_LT(took, absl::Seconds(3));
}

// A watched prefill (Expect, and it answered a probe) that is killed: the
// kernel closes its sockets, the receiver's watch connection sees it at
// once, and the probe that follows finds its port refusing. Reported well
// before its probe's turn (peer_timeout 2 s: every 500 ms).
TEST(PeerFailure, AWatchedPrefillThatIsKilledIsReportedWithin100ms) {
  const absl::Duration peer_timeout = absl::Seconds(2);
  Decode d = StartDecode(peer_timeout);
  auto prefill = PeerProcess::Start(0, 4096);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  ASSERT_TRUE(d.receiver->Expect("killed", prefill->address()).ok());
  absl::SleepFor(peer_timeout / 4 + absl::Milliseconds(400));  // probed, and watched
  EXPECT_EQ(d.receiver->Poll("killed").state, KvReceiver::State::kPending);
  prefill->Kill();
  const absl::Time killed = absl::Now();
  auto s = d.receiver->Wait("killed", absl::Seconds(5));
  const absl::Duration took = absl::Now() - killed;
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->state, KvReceiver::State::kFailed);
  EXPECT_NE(s->error.message().find("refuses connections"), std::string::npos) << s->error;
  std::printf("killed, watched prefill: reported %s after the kill\n",
              absl::FormatDuration(took).c_str());
  EXPECT_LT(took, absl::Milliseconds(100));
}

// 16 prefills, 12 of them frozen at once: their probes run at once, so the
// frozen ones' timeouts do not add up, and each is reported within
// peer_timeout of its freeze. The four alive ones stay pending.
TEST(PeerFailure, TwelveOfSixteenFrozenPrefillsAreEachReportedWithinPeerTimeout) {
  const absl::Duration peer_timeout = absl::Seconds(2);
  Decode d = StartDecode(peer_timeout);
  std::vector<PeerProcess> prefills;
  for (int i = 0; i < 16; ++i) {
    auto p = PeerProcess::Start(0, 4096);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(d.receiver->Expect(absl::StrCat("r", i), p->address()).ok());
    prefills.push_back(std::move(*p));
  }
  absl::SleepFor(absl::Seconds(1));  // every one probed and answering
  for (int i = 0; i < 12; ++i) prefills[i].Freeze();
  const absl::Time frozen = absl::Now();
  std::vector<absl::Duration> took(12, absl::InfiniteDuration());
  for (int round = 0; round < 400; ++round) {
    bool all = true;
    for (int i = 0; i < 12; ++i) {
      if (took[i] != absl::InfiniteDuration()) continue;
      if (d.receiver->Poll(absl::StrCat("r", i)).state == KvReceiver::State::kFailed) {
        took[i] = absl::Now() - frozen;
      } else {
        all = false;
      }
    }
    if (all) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  const absl::Duration worst = *std::max_element(took.begin(), took.end());
  const absl::Duration best = *std::min_element(took.begin(), took.end());
  std::printf("12 of 16 prefills frozen: reported after %s to %s (peer_timeout %s)\n",
              absl::FormatDuration(best).c_str(), absl::FormatDuration(worst).c_str(),
              absl::FormatDuration(peer_timeout).c_str());
  EXPECT_LE(worst, peer_timeout);
  for (int i = 12; i < 16; ++i) {
    EXPECT_EQ(d.receiver->Poll(absl::StrCat("r", i)).state, KvReceiver::State::kPending) << i;
  }
  for (int i = 0; i < 12; ++i) prefills[i].Thaw();
}

}  // namespace
}  // namespace kvferry
