// TransferEngine with CUDA device memory, through the fake driver
// (//cuda/testing: device memory PROT_NONE to the CPU), over TCP sockets
// and the in-process shortcut.
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda/driver.h"
#include "cuda/testing/fake_driver.h"
#include "engine/testing/engine_conformance.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "handshake/tcp_network.h"
#include "kv/kv_cache.h"
#include "transport/tcp/tcp_transport.h"

namespace kvferry {
namespace {

using transport::Opcode;

class EngineDeviceMemoryTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    d_ = cuda::UseFakeDriver();
    ASSERT_NE(d_, nullptr);
    harness_ = testing::MakeTcpHarness(/*in_process=*/GetParam());
    auto a = harness_->Start(EngineOptions{});
    auto b = harness_->Start(EngineOptions{});
    ASSERT_TRUE(a.ok() && b.ok());
    prefill_ = std::move(*a);
    decode_ = std::move(*b);
  }
  void* Device(int ordinal, size_t n) {
    auto p = d_->AllocDevice(ordinal, n);
    EXPECT_TRUE(p.ok()) << p.status();
    allocated_.push_back({p.value_or(nullptr), ordinal});
    return p.value_or(nullptr);
  }
  void TearDown() override {
    prefill_.reset();
    decode_.reset();
    for (auto [p, ordinal] : allocated_) {
      if (p != nullptr) {
        EXPECT_TRUE(d_->FreeDevice(p, ordinal).ok());
      }
    }
  }
  std::vector<char> Get(const void* p, size_t n, int ordinal) {
    std::vector<char> v(n);
    EXPECT_TRUE(d_->Copy(v.data(), p, n, ordinal).ok());
    return v;
  }
  const cuda::Driver* d_ = nullptr;
  std::unique_ptr<testing::EngineHarness> harness_;
  std::unique_ptr<TransferEngine> prefill_, decode_;
  std::vector<std::pair<void*, int>> allocated_;
};

TEST_P(EngineDeviceMemoryTest, KvPagesMoveBetweenGpusWithoutTheCpuTouchingThem) {
  constexpr size_t kBytes = (2 << 20) + 3 * 4096;  // many slices, a short last one
  void* src = Device(0, kBytes);
  void* dst = Device(1, kBytes);
  std::vector<char> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<char>(i * 31 + (i >> 13));
  ASSERT_TRUE(d_->Copy(src, pattern.data(), kBytes, 0).ok());
  // No location: the memory says where it is.
  ASSERT_TRUE(prefill_->RegisterMemory(src, kBytes).ok());
  ASSERT_TRUE(
      decode_->RegisterMemory(dst, kBytes, transport::Access::kRemoteReadWrite, "cuda:1").ok());
  auto seg = prefill_->OpenSegment(decode_->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  // Scattered pages, as a KV layer sends them.
  std::vector<TransferRequest> pages;
  for (size_t off = 0; off + 12288 <= kBytes; off += 3 * 12288) {
    pages.push_back({Opcode::kWrite, static_cast<char*>(src) + off,
                     reinterpret_cast<uintptr_t>(dst) + off, 12288});
  }
  auto batch = prefill_->Submit(*seg, pages);
  ASSERT_TRUE(batch.ok()) << batch.status();
  auto st = prefill_->Wait(*batch, absl::Seconds(20));
  ASSERT_TRUE(st.ok() && st->ok()) << (st.ok() ? st->requests[0] : st.status());
  const std::vector<char> got = Get(dst, kBytes, 1);
  for (const TransferRequest& p : pages) {
    const size_t off = static_cast<char*>(p.local) - static_cast<char*>(src);
    ASSERT_EQ(std::memcmp(got.data() + off, pattern.data() + off, p.length), 0) << off;
  }
  // And a READ of the whole range back into fresh device memory.
  void* back = Device(0, kBytes);
  ASSERT_TRUE(prefill_->RegisterMemory(back, kBytes, transport::Access::kNone).ok());
  TransferRequest r{Opcode::kRead, back, reinterpret_cast<uintptr_t>(dst), kBytes};
  auto read = prefill_->Submit(*seg, {&r, 1});
  ASSERT_TRUE(read.ok());
  auto rs = prefill_->Wait(*read, absl::Seconds(20));
  ASSERT_TRUE(rs.ok() && rs->ok());
  EXPECT_TRUE(Get(back, kBytes, 0) == got);
}

TEST_P(EngineDeviceMemoryTest, ALocationThatContradictsTheMemoryIsRefused) {
  void* dev = Device(1, 1 << 16);
  std::vector<char> host(1 << 16);
  auto code = [](const absl::Status& s) { return s.code(); };
  EXPECT_EQ(
      code(prefill_->RegisterMemory(dev, 1 << 16, transport::Access::kRemoteReadWrite, "cuda:0")),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      code(prefill_->RegisterMemory(dev, 1 << 16, transport::Access::kRemoteReadWrite, "cpu:0")),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(prefill_->RegisterMemory(host.data(), host.size(),
                                          transport::Access::kRemoteReadWrite, "cuda:1")),
            absl::StatusCode::kInvalidArgument);
  // Past the allocation's end.
  EXPECT_EQ(code(prefill_->RegisterMemory(dev, (1 << 16) + 1)), absl::StatusCode::kInvalidArgument);
  // A freed device pointer.
  void* freed = Device(0, 4096);
  ASSERT_TRUE(d_->FreeDevice(freed, 0).ok());
  allocated_.back().first = nullptr;
  absl::Status gone = prefill_->RegisterMemory(freed, 4096);
  EXPECT_EQ(gone.code(), absl::StatusCode::kInvalidArgument) << gone;
  // The engine is still usable: the right location works.
  EXPECT_TRUE(
      prefill_->RegisterMemory(dev, 1 << 16, transport::Access::kRemoteReadWrite, "cuda:1").ok());
  EXPECT_TRUE(prefill_->RegisterMemory(host.data(), host.size()).ok());
}

// One batch whose requests come from host and from device memory: each is
// staged (or not) by its own region, and all land.
TEST_P(EngineDeviceMemoryTest, ABatchMixingHostAndDeviceMemoryLandsWhole) {
  constexpr size_t kBytes = 256 << 10;
  void* dev_src = Device(0, kBytes);
  void* dev_dst = Device(1, 2 * kBytes);
  std::vector<char> host_src(kBytes), pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) {
    host_src[i] = static_cast<char>(i * 3 + 1);
    pattern[i] = static_cast<char>(i * 5 + 2);
  }
  ASSERT_TRUE(d_->Copy(dev_src, pattern.data(), kBytes, 0).ok());
  ASSERT_TRUE(prefill_->RegisterMemory(dev_src, kBytes).ok());
  ASSERT_TRUE(prefill_->RegisterMemory(host_src.data(), kBytes).ok());
  ASSERT_TRUE(decode_->RegisterMemory(dev_dst, 2 * kBytes).ok());
  auto seg = prefill_->OpenSegment(decode_->address());
  ASSERT_TRUE(seg.ok());
  const uintptr_t dst = reinterpret_cast<uintptr_t>(dev_dst);
  std::vector<TransferRequest> mixed = {{Opcode::kWrite, host_src.data(), dst, kBytes},
                                        {Opcode::kWrite, dev_src, dst + kBytes, kBytes}};
  auto batch = prefill_->Submit(*seg, mixed);
  ASSERT_TRUE(batch.ok()) << batch.status();
  auto st = prefill_->Wait(*batch, absl::Seconds(20));
  ASSERT_TRUE(st.ok() && st->ok());
  const std::vector<char> got = Get(dev_dst, 2 * kBytes, 1);
  EXPECT_EQ(std::memcmp(got.data(), host_src.data(), kBytes), 0);
  EXPECT_EQ(std::memcmp(got.data() + kBytes, pattern.data(), kBytes), 0);
}

// The KV layer with both pools on GPUs (per-layer K and V buffers, as a
// serving framework's tensors are), a whole request of scattered pages.
TEST_P(EngineDeviceMemoryTest, KvPagesOnDevicePoolsArriveWhole) {
  const KvLayout l{4, false, 16, 256, 32};  // 4 KiB pages
  std::vector<void*> src_buffers, dst_buffers;
  for (uint32_t b = 0; b < l.buffer_count(); ++b) {
    src_buffers.push_back(Device(0, l.buffer_bytes()));
    dst_buffers.push_back(Device(1, l.buffer_bytes()));
    std::vector<char> fill(l.buffer_bytes());
    for (size_t i = 0; i < fill.size(); ++i) fill[i] = static_cast<char>(b * 37 + i * 13);
    ASSERT_TRUE(d_->Copy(src_buffers.back(), fill.data(), fill.size(), 0).ok());
  }
  auto src = KvPool::Wrap(l, src_buffers);
  auto dst = KvPool::Wrap(l, dst_buffers);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto sender = KvSender::Create(prefill_.get(), *src);
  auto receiver = KvReceiver::Create(decode_.get(), *dst);
  ASSERT_TRUE(sender.ok()) << sender.status();
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  const std::vector<uint32_t> s = {3, 4, 5, 20, 9}, d = {0, 1, 2, 31, 17};
  ASSERT_TRUE((*sender)->Send("gpu-req", decode_->address(), s, d, "aux").ok());
  auto st = (*receiver)->Wait("gpu-req", absl::Seconds(20));
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->state, KvReceiver::State::kComplete);
  for (uint32_t b = 0; b < l.buffer_count(); ++b) {
    const std::vector<char> from = Get(src_buffers[b], l.buffer_bytes(), 0);
    const std::vector<char> to = Get(dst_buffers[b], l.buffer_bytes(), 1);
    for (size_t i = 0; i < s.size(); ++i) {
      ASSERT_EQ(std::memcmp(to.data() + d[i] * l.page_bytes(), from.data() + s[i] * l.page_bytes(),
                            l.page_bytes()),
                0)
          << "buffer " << b << " page " << s[i];
    }
  }
}

// Checksums over device pools: the CRCs are computed on both sides through
// the driver (the fake's device memory is PROT_NONE: a CPU read would
// crash). Intact pages pass; a bit flipped in a landed device page before
// the receiver looks fails the request with kDataLoss.
TEST_P(EngineDeviceMemoryTest, ChecksumsOnDevicePoolsPassAndCatchAFlippedBit) {
  const KvLayout l{3, false, 16, 128, 24};  // 2 KiB pages
  std::vector<void*> src_buffers, dst_buffers;
  for (uint32_t b = 0; b < l.buffer_count(); ++b) {
    src_buffers.push_back(Device(0, l.buffer_bytes()));
    dst_buffers.push_back(Device(1, l.buffer_bytes()));
    std::vector<char> fill(l.buffer_bytes());
    for (size_t i = 0; i < fill.size(); ++i) fill[i] = static_cast<char>(b * 11 + i * 7 + (i >> 9));
    ASSERT_TRUE(d_->Copy(src_buffers.back(), fill.data(), fill.size(), 0).ok());
  }
  auto src = KvPool::Wrap(l, src_buffers);
  auto dst = KvPool::Wrap(l, dst_buffers);
  ASSERT_TRUE(src.ok() && dst.ok());
  EXPECT_EQ(src->device(0), 0);
  EXPECT_EQ(dst->device(l.buffer_count() - 1), 1);
  KvSender::Options so;
  so.checksums = true;
  auto sender = KvSender::Create(prefill_.get(), *src, so);
  auto receiver = KvReceiver::Create(decode_.get(), *dst);
  ASSERT_TRUE(sender.ok()) << sender.status();
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  const std::vector<uint32_t> s = {3, 4, 5, 20, 9}, d = {0, 1, 2, 23, 17};
  ASSERT_TRUE((*sender)->Send("intact", decode_->address(), s, d, "aux").ok());
  auto ok = (*receiver)->Wait("intact", absl::Seconds(20));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->state, KvReceiver::State::kComplete) << ok->error;
  EXPECT_EQ(ok->aux, "aux");

  auto h = (*sender)->Begin("flipped", decode_->address(), s, d);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE((*sender)->SendAll(*h).ok());
  ASSERT_TRUE((*sender)->Finish(*h, "aux").ok());
  // One bit of destination page 17 in V of layer 1 (buffer 3), on the GPU.
  char* at = static_cast<char*>(dst_buffers[3]) + 17 * l.page_bytes() + 1000;
  char byte = 0;
  ASSERT_TRUE(d_->Copy(&byte, at, 1, 1).ok());
  byte ^= 0x04;
  ASSERT_TRUE(d_->Copy(at, &byte, 1, 1).ok());
  auto bad = (*receiver)->Wait("flipped", absl::Seconds(20));
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->state, KvReceiver::State::kFailed);
  EXPECT_EQ(bad->error.code(), absl::StatusCode::kDataLoss) << bad->error;
  EXPECT_NE(bad->error.message().find("page 17"), std::string::npos) << bad->error;
  EXPECT_EQ((*receiver)->checksum_failures(), 1u);
}

// Stream order: a WRITE queued behind a copy still pending on the caller's
// stream sends what that copy writes, not what the buffer held before; with
// hold_stream the stream's synchronization comes after the transfer.
TEST_P(EngineDeviceMemoryTest, AStreamOrderedWriteWaitsForTheStreamsEarlierWork) {
  constexpr size_t kBytes = 256 << 10;
  void* src = Device(0, kBytes);
  void* dst = Device(1, kBytes);
  const std::vector<char> before(kBytes, 'A');
  ASSERT_TRUE(d_->Copy(src, before.data(), kBytes, 0).ok());
  ASSERT_TRUE(prefill_->RegisterMemory(src, kBytes).ok());
  ASSERT_TRUE(decode_->RegisterMemory(dst, kBytes).ok());
  auto seg = prefill_->OpenSegment(decode_->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  auto stream = d_->CreateStream(0);
  auto pinned = d_->AllocPinned(kBytes);
  ASSERT_TRUE(stream.ok() && pinned.ok());
  std::vector<char> after(kBytes);
  for (size_t i = 0; i < kBytes; ++i) after[i] = static_cast<char>(i * 29 + 5);
  std::memcpy(*pinned, after.data(), kBytes);
  // The layer is still being written on the stream (the fake lands it at
  // the stream's synchronization, or a latency later).
  ASSERT_TRUE(d_->CopyAsync(src, *pinned, kBytes, *stream, 0).ok());
  const TransferRequest req{Opcode::kWrite, src, reinterpret_cast<uintptr_t>(dst), kBytes};
  auto id = prefill_->SubmitOnStream(*seg, {&req, 1}, *stream);
  ASSERT_TRUE(id.ok()) << id.status();
  // Synchronizing the stream waits for the transfer too (hold_stream).
  ASSERT_TRUE(d_->Synchronize(*stream, 0).ok());
  EXPECT_EQ(Get(dst, kBytes, 1), after);
  auto st = prefill_->WaitOnStream(*id, absl::Seconds(20));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->ok());
  EXPECT_EQ(prefill_->WaitOnStream(*id, absl::Seconds(1)).status().code(),
            absl::StatusCode::kNotFound);  // collected

  // A request outside registered memory fails in WaitOnStream, and the
  // stream goes on.
  const TransferRequest bad{Opcode::kWrite, src, reinterpret_cast<uintptr_t>(dst) + kBytes, 16};
  auto bad_id = prefill_->SubmitOnStream(*seg, {&bad, 1}, *stream);
  ASSERT_TRUE(bad_id.ok()) << bad_id.status();
  auto bad_st = prefill_->WaitOnStream(*bad_id, absl::Seconds(20));
  EXPECT_EQ(bad_st.status().code(), absl::StatusCode::kInvalidArgument) << bad_st.status();
  ASSERT_TRUE(d_->Synchronize(*stream, 0).ok());
  d_->DestroyStream(*stream, 0);
  d_->FreePinned(*pinned);
}

std::atomic<bool> blocker_open{false};
void Blocker(void*) {
  while (!blocker_open) absl::SleepFor(absl::Milliseconds(1));
}

// A stream-ordered batch the stream has not reached when the engine goes
// away ends cancelled, and its gate (run later by the driver) touches
// nothing of the engine: the stream goes on.
TEST_P(EngineDeviceMemoryTest, AnEngineDestroyedBeforeTheStreamReachedItsBatch) {
  void* src = Device(0, 4096);
  void* dst = Device(1, 4096);
  ASSERT_TRUE(prefill_->RegisterMemory(src, 4096).ok());
  ASSERT_TRUE(decode_->RegisterMemory(dst, 4096).ok());
  auto seg = prefill_->OpenSegment(decode_->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  auto stream = d_->CreateStream(0);
  ASSERT_TRUE(stream.ok());
  blocker_open = false;
  ASSERT_TRUE(d_->LaunchHostFunc(*stream, 0, &Blocker, nullptr).ok());
  const TransferRequest req{Opcode::kWrite, src, reinterpret_cast<uintptr_t>(dst), 4096};
  auto id = prefill_->SubmitOnStream(*seg, {&req, 1}, *stream);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(prefill_->WaitOnStream(*id, absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  prefill_.reset();
  blocker_open = true;
  ASSERT_TRUE(d_->Synchronize(*stream, 0).ok());
  d_->DestroyStream(*stream, 0);
}

// A fenced prefill writes no more device memory: over the socket and over
// the in-process shortcut alike, its next WRITE fails and lands nothing.
TEST_P(EngineDeviceMemoryTest, AFencedPrefillWritesNoMoreDeviceMemory) {
  constexpr size_t kBytes = 64 << 10;
  void* src = Device(0, kBytes);
  void* dst = Device(1, kBytes);
  const std::vector<char> first(kBytes, 'f'), second(kBytes, 's');
  ASSERT_TRUE(d_->Copy(src, first.data(), kBytes, 0).ok());
  ASSERT_TRUE(prefill_->RegisterMemory(src, kBytes).ok());
  ASSERT_TRUE(decode_->RegisterMemory(dst, kBytes).ok());
  auto seg = prefill_->OpenSegment(decode_->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  const TransferRequest req{Opcode::kWrite, src, reinterpret_cast<uintptr_t>(dst), kBytes};
  auto run = [&] {
    auto batch = prefill_->Submit(*seg, {&req, 1});
    if (!batch.ok()) return batch.status();
    auto st = prefill_->Wait(*batch, absl::Seconds(20));
    if (!st.ok()) return st.status();
    return st->ok() ? absl::OkStatus() : st->requests[0];
  };
  ASSERT_TRUE(run().ok());
  EXPECT_EQ(Get(dst, kBytes, 1), first);
  decode_->FencePeer(prefill_->engine_id());
  ASSERT_TRUE(d_->Copy(src, second.data(), kBytes, 0).ok());
  // The batch the prefill made before it learned of the fence fails.
  const absl::Status refused = run();
  EXPECT_FALSE(refused.ok());
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("fenced this engine off"), std::string::npos) << refused;
  EXPECT_EQ(Get(dst, kBytes, 1), first);
  // The prefill, alive, comes back at the next epoch: its next batch lands.
  EXPECT_EQ(prefill_->PeerEpoch(*seg).value_or(0), 1u);
  ASSERT_TRUE(run().ok());
  EXPECT_EQ(Get(dst, kBytes, 1), second);
  EXPECT_FALSE(decode_->PeerFenced(prefill_->engine_id()));
}

// A TCP transport whose "NICs" cannot register GPU memory, as RDMA NICs
// without dma-buf or nvidia-peermem: kFailedPrecondition, like the verbs
// transport's.
class NoGpuNics final : public transport::Transport {
 public:
  explicit NoGpuNics(std::unique_ptr<transport::Transport> t) : t_(std::move(t)) {}
  transport::EndpointDescription LocalEndpoint() const override { return t_->LocalEndpoint(); }
  transport::Limits GetLimits() const override { return t_->GetLimits(); }
  absl::StatusOr<transport::Region> RegisterMemory(void* addr, uint64_t length,
                                                   transport::Access access) override {
    if (cuda::Driver::Get()->Classify(addr, length)->device) {
      return absl::FailedPreconditionError("cannot register memory of a CUDA device here");
    }
    return t_->RegisterMemory(addr, length, access);
  }
  absl::Status UnregisterMemory(transport::RegionId r) override { return t_->UnregisterMemory(r); }
  absl::StatusOr<transport::LinkOffer> CreateLink(transport::NicIndex n,
                                                  const transport::NicInfo& p) override {
    return t_->CreateLink(n, p);
  }
  absl::StatusOr<transport::LinkOffer> AcceptLink(transport::NicIndex n,
                                                  const transport::NicInfo& p,
                                                  absl::string_view params) override {
    return t_->AcceptLink(n, p, params);
  }
  absl::Status CompleteLink(transport::LinkId l, absl::string_view params) override {
    return t_->CompleteLink(l, params);
  }
  absl::Status CloseLink(transport::LinkId l) override { return t_->CloseLink(l); }
  bool HasLink(transport::LinkId l) override { return t_->HasLink(l); }
  absl::Status Post(absl::Span<const transport::WorkRequest> b) override { return t_->Post(b); }
  size_t PollCompletions(absl::Span<transport::Completion> out) override {
    return t_->PollCompletions(out);
  }
  size_t WaitCompletions(absl::Span<transport::Completion> out, absl::Duration d) override {
    return t_->WaitCompletions(out, d);
  }
  bool SetCompletionNotifier(std::function<void()> n) override {
    return t_->SetCompletionNotifier(std::move(n));
  }

 private:
  std::unique_ptr<transport::Transport> t_;
};

// GPU memory the primary transport cannot register stays on the fallback;
// a request from it over the primary is refused, naming why.
TEST(EngineDeviceMemoryFallbackTest, GpuMemoryThePrimaryCannotRegisterStaysOnTheFallback) {
  const cuda::Driver* d = cuda::UseFakeDriver();
  ASSERT_NE(d, nullptr);
  auto engine = [] {
    transport::TcpTransportOptions t;
    t.bind_host = "127.0.0.1";
    EngineParts parts;
    parts.transport = std::make_unique<NoGpuNics>(*transport::CreateTcpTransport(t));
    parts.fallback = *transport::CreateTcpTransport(t);
    parts.network = handshake::NewTcpNetwork();
    parts.detection.host = "127.0.0.1";
    EngineOptions o;
    o.local_host = "127.0.0.1";
    return *TransferEngine::CreateWith(o, std::move(parts));
  };
  auto a = engine(), b = engine();
  auto dev = d->AllocDevice(0, 1 << 16);
  ASSERT_TRUE(dev.ok());
  ASSERT_TRUE(a->RegisterMemory(*dev, 1 << 16).ok());  // kept on the fallback
  std::vector<char> dst(1 << 16);
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(b->address());  // over the primary (both ends have it)
  ASSERT_TRUE(seg.ok()) << seg.status();
  TransferRequest w{Opcode::kWrite, *dev, reinterpret_cast<uintptr_t>(dst.data()), 1 << 16};
  auto batch = a->Submit(*seg, {&w, 1});
  EXPECT_EQ(batch.status().code(), absl::StatusCode::kFailedPrecondition) << batch.status();
  EXPECT_NE(batch.status().message().find("could not register"), std::string::npos)
      << batch.status();
  // Unregistering works with the primary's part absent.
  EXPECT_TRUE(a->UnregisterMemory(*dev).ok());
  EXPECT_TRUE(a->RegisterMemory(*dev, 1 << 16).ok());
  ASSERT_TRUE(a->UnregisterMemory(*dev).ok());
  ASSERT_TRUE(d->FreeDevice(*dev, 0).ok());
}

INSTANTIATE_TEST_SUITE_P(Tcp, EngineDeviceMemoryTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "tcp_in_process" : "tcp");
                         });

}  // namespace
}  // namespace kvferry
