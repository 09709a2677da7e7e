#include "engine/testing/engine_conformance.h"

#include <atomic>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "handshake/tcp_network.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/verbs/test_ports.h"
#include "transport/verbs/verbs_transport.h"

namespace kvferry {
namespace testing {

using transport::Opcode;

std::string EngineParamName(const ::testing::TestParamInfo<EngineParam>& info) {
  return info.param.name;
}

namespace {

// An engine on `made` (a new transport of `kind`), its handshake on 127.0.0.1.
absl::StatusOr<std::unique_ptr<TransferEngine>> OnLoopback(
    absl::StatusOr<std::unique_ptr<transport::Transport>> made, const char* kind,
    const EngineOptions& options) {
  if (!made.ok()) return made.status();
  EngineParts parts;
  parts.transport = std::move(*made);
  parts.network = handshake::NewTcpNetwork();
  parts.detection.host = "127.0.0.1";
  parts.detection.transport = kind;
  return TransferEngine::CreateWith(options, std::move(parts));
}

class TcpHarness : public EngineHarness {
 public:
  explicit TcpHarness(bool in_process) : in_process_(in_process) {}
  absl::StatusOr<std::unique_ptr<TransferEngine>> Start(EngineOptions options,
                                                        uint32_t max_outstanding) override {
    transport::TcpTransportOptions t;
    t.bind_host = "127.0.0.1";
    t.in_process_shortcut = in_process_;
    t.max_outstanding_per_link = max_outstanding;
    return OnLoopback(transport::CreateTcpTransport(t), "tcp", options);
  }
  void Sleep(absl::Duration d) override { absl::SleepFor(d); }
  bool threads() const override { return true; }

 private:
  const bool in_process_;
};

class VerbsHarness : public EngineHarness {
 public:
  absl::StatusOr<std::unique_ptr<TransferEngine>> Start(EngineOptions options,
                                                        uint32_t max_outstanding) override {
    transport::VerbsTransportOptions v;
    v.ports = ports_.ports();
    v.max_outstanding_per_link = max_outstanding;
    return OnLoopback(transport::CreateVerbsTransport(v), "rdma", options);
  }
  void Sleep(absl::Duration d) override { absl::SleepFor(d); }
  bool threads() const override { return true; }
  std::string SkipReason() override { return ports_.SkipReason(); }

 private:
  transport::verbs::TestPorts ports_;
};

std::vector<char> Pattern(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(i * 131 + seed * 7 + (i >> 9));
  return v;
}

uint64_t Addr(const std::vector<char>& v, size_t off = 0) {
  return reinterpret_cast<uintptr_t>(v.data()) + off;
}

// Submits `reqs` and waits for the batch; every request must succeed.
void RunBatch(TransferEngine& e, SegmentId seg, const std::vector<TransferRequest>& reqs) {
  absl::StatusOr<BatchId> batch = e.Submit(seg, reqs);
  ASSERT_TRUE(batch.ok()) << batch.status();
  absl::StatusOr<BatchStatus> st = e.Wait(*batch, absl::Seconds(20));
  ASSERT_TRUE(st.ok()) << st.status();
  for (const absl::Status& r : st->requests) ASSERT_TRUE(r.ok()) << r;
  ASSERT_TRUE(e.Release(*batch).ok());
}

}  // namespace

std::unique_ptr<EngineHarness> MakeTcpHarness(bool in_process) {
  return std::make_unique<TcpHarness>(in_process);
}

std::unique_ptr<EngineHarness> MakeVerbsHarness() { return std::make_unique<VerbsHarness>(); }

void EngineConformanceTest::SetUp() {
  harness_ = GetParam().make();
  ASSERT_NE(harness_, nullptr);
  const std::string skip = harness_->SkipReason();
  if (!skip.empty()) GTEST_SKIP() << skip;
}

std::unique_ptr<TransferEngine> EngineConformanceTest::Start(EngineOptions options,
                                                             uint32_t max_outstanding) {
  absl::StatusOr<std::unique_ptr<TransferEngine>> e = harness_->Start(options, max_outstanding);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

// Binaries that link the suite only for its harnesses need not instantiate it.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(EngineConformanceTest);

TEST_P(EngineConformanceTest, WritesAndReadsWithSlicesAcrossRegions) {
  EngineOptions o;
  o.slice_bytes = 16 << 10;
  auto a = Start(o);
  auto b = Start(o);
  ASSERT_TRUE(a && b);
  std::vector<char> src = Pattern(256 << 10, 1), dst(256 << 10, 0), back(256 << 10, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(a->RegisterMemory(back.data(), back.size()).ok());
  // Two adjacent regions at the peer: a request may span both.
  const transport::Access rw = transport::Access::kRemoteReadWrite;
  ASSERT_TRUE(b->RegisterMemory(dst.data(), 128 << 10, rw).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data() + (128 << 10), 128 << 10, rw).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ(*a->OpenSegment(b->address()), *seg);
  RunBatch(*a, *seg,
           {{Opcode::kWrite, src.data(), Addr(dst), 100000},
            {Opcode::kWrite, src.data() + 100000, Addr(dst, 100000), 100000},  // spans both
            {Opcode::kWrite, src.data() + 200000, Addr(dst, 200000), src.size() - 200000}});
  EXPECT_EQ(src, dst);
  RunBatch(*a, *seg, {{Opcode::kRead, back.data(), Addr(dst), back.size()}});
  EXPECT_EQ(back, src);
}

TEST_P(EngineConformanceTest, BadRequestsAreRefusedBeforeAnythingMoves) {
  auto a = Start();
  auto b = Start();
  ASSERT_TRUE(a && b);
  std::vector<char> src = Pattern(8192, 2), dst(8192, 0), ro(4096, 0), unregistered(4096);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(ro.data(), ro.size(), transport::Access::kRemoteRead).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  const std::vector<char> before = dst;
  // The second request of each batch is bad: nothing of the batch moves.
  const std::vector<std::pair<TransferRequest, absl::StatusCode>> bad = {
      {{Opcode::kWrite, src.data(), Addr(dst, 8000), 4096}, absl::StatusCode::kInvalidArgument},
      {{Opcode::kWrite, unregistered.data(), Addr(dst), 4096}, absl::StatusCode::kInvalidArgument},
      {{Opcode::kWrite, src.data(), Addr(ro), 4096}, absl::StatusCode::kPermissionDenied},
      {{Opcode::kWrite, src.data(), Addr(dst), 0}, absl::StatusCode::kInvalidArgument},
  };
  for (const auto& [req, code] : bad) {
    std::vector<TransferRequest> batch = {{Opcode::kWrite, src.data(), Addr(dst), 4096}, req};
    absl::StatusOr<BatchId> id = a->Submit(*seg, batch);
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), code) << id.status();
    EXPECT_NE(id.status().message().find("request 1"), std::string::npos) << id.status();
  }
  harness_->Sleep(absl::Milliseconds(20));
  EXPECT_EQ(dst, before);
  // The engine stays usable.
  RunBatch(*a, *seg, {{Opcode::kWrite, src.data(), Addr(dst), 4096}});
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), 4096), 0);
}

// Batches of one request (after the first, the thread's lane holds the
// segment's view: Submit's short way): bytes, metrics, a request larger
// than a slice, and bad requests refused with the same errors as in a
// larger batch, the engine usable after each.
TEST_P(EngineConformanceTest, LoneRequestsMoveAndCountLikeAnyBatch) {
  EngineOptions o;
  o.slice_bytes = 16 << 10;
  auto a = Start(o);
  auto b = Start(o);
  ASSERT_TRUE(a && b);
  constexpr int kLone = 6, kPage = 4096;
  std::vector<char> src = Pattern(64 << 10, 5), dst(64 << 10, 0), back(kPage, 0),
                    ro(kPage, 0), unregistered(kPage);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(a->RegisterMemory(back.data(), back.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size(), transport::Access::kRemoteReadWrite).ok());
  ASSERT_TRUE(b->RegisterMemory(ro.data(), ro.size(), transport::Access::kRemoteRead).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  for (int i = 0; i < kLone; ++i) {
    RunBatch(*a, *seg, {{Opcode::kWrite, src.data() + i * kPage, Addr(dst, i * kPage), kPage}});
  }
  // Two slices' worth: the general path cuts it.
  RunBatch(*a, *seg, {{Opcode::kWrite, src.data() + 32768, Addr(dst, 32768), 32768}});
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), kLone * kPage), 0);
  EXPECT_EQ(std::memcmp(dst.data() + 32768, src.data() + 32768, 32768), 0);
  RunBatch(*a, *seg, {{Opcode::kRead, back.data(), Addr(dst, kPage), kPage}});
  EXPECT_EQ(std::memcmp(back.data(), src.data() + kPage, kPage), 0);
  const std::vector<std::pair<TransferRequest, absl::StatusCode>> bad = {
      {{Opcode::kWrite, src.data(), Addr(dst, dst.size() - 100), 4096},
       absl::StatusCode::kInvalidArgument},
      {{Opcode::kWrite, unregistered.data(), Addr(dst), 4096}, absl::StatusCode::kInvalidArgument},
      {{Opcode::kWrite, src.data(), Addr(ro), 4096}, absl::StatusCode::kPermissionDenied},
      {{Opcode::kWrite, src.data(), Addr(dst), 0}, absl::StatusCode::kInvalidArgument},
  };
  const std::vector<char> before = dst;
  for (const auto& [req, code] : bad) {
    absl::StatusOr<BatchId> id = a->Submit(*seg, {&req, 1});
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), code) << id.status();
    EXPECT_NE(id.status().message().find("request 0"), std::string::npos) << id.status();
    RunBatch(*a, *seg, {{Opcode::kWrite, src.data(), Addr(dst), kPage}});  // still usable
  }
  EXPECT_EQ(dst, before);
  const uint64_t batches = kLone + 2 + bad.size();
  const EngineMetrics m = a->GetMetrics();
  ASSERT_EQ(m.peers.size(), 1u);
  EXPECT_EQ(m.peers[0].requests, batches);
  EXPECT_EQ(m.peers[0].requests_ok, batches);
  EXPECT_EQ(m.peers[0].bytes_written, uint64_t{kLone + bad.size()} * kPage + 32768);
  EXPECT_EQ(m.peers[0].bytes_read, uint64_t{kPage});
  EXPECT_EQ(m.peers[0].latency.count(), batches);
  uint64_t nic_bytes = 0;
  for (const NicMetrics& n : m.nics) nic_bytes += n.bytes;
  EXPECT_EQ(nic_bytes, uint64_t{kLone + bad.size() + 1} * kPage + 32768);
  EXPECT_TRUE(a->CloseSegment(*seg).ok());
}

TEST_P(EngineConformanceTest, NotificationFollowsItsDataAndMetadataIsServed) {
  auto a = Start();
  auto b = Start();
  ASSERT_TRUE(a && b);
  std::vector<char> src = Pattern(64 << 10, 3), dst(64 << 10, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  ASSERT_TRUE(b->PublishMetadata("pool", "64KiB").ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  auto meta = a->FetchMetadata(*seg, "pool");
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ(*meta, "64KiB");
  EXPECT_EQ(a->FetchMetadata(*seg, "nope").status().code(), absl::StatusCode::kNotFound);
  TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), src.size()};
  auto batch = a->Submit(*seg, {&w, 1});
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(a->NotifyAfter(*batch, "layer 0 done", absl::Seconds(20)).ok());
  auto note = b->WaitNotification(absl::Seconds(20));
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(note->message, "layer 0 done");
  EXPECT_EQ(note->engine_id, a->engine_id());
  EXPECT_EQ(src, dst);  // the data was in place before the notification
}

TEST_P(EngineConformanceTest, ClosedSegmentIsForgottenAndReopensAnew) {
  auto a = Start();
  auto b = Start();
  ASSERT_TRUE(a && b);
  std::vector<char> src = Pattern(8192, 4), dst(8192, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  RunBatch(*a, *seg, {{Opcode::kWrite, src.data(), Addr(dst), 4096}});
  ASSERT_TRUE(a->CloseSegment(*seg).ok());
  TransferRequest w{Opcode::kWrite, src.data() + 4096, Addr(dst, 4096), 4096};
  EXPECT_EQ(a->Submit(*seg, {&w, 1}).status().code(), absl::StatusCode::kNotFound);
  auto again = a->OpenSegment(b->address());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(*again, *seg);
  RunBatch(*a, *again, {w});
  EXPECT_EQ(src, dst);
}

TEST_P(EngineConformanceTest, IdleSegmentReconnectsOnUse) {
  EngineOptions o;
  o.idle_segment_timeout = absl::Milliseconds(50);
  auto a = Start(o);
  auto b = Start();
  auto c = Start();
  ASSERT_TRUE(a && b && c);
  std::vector<char> src = Pattern(8192, 5), dst(8192, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  RunBatch(*a, *seg, {{Opcode::kWrite, src.data(), Addr(dst), 4096}});
  EXPECT_EQ(a->GetCounters().reconnects, 0u);
  harness_->Sleep(absl::Milliseconds(100));
  ASSERT_TRUE(a->OpenSegment(c->address()).ok());  // looks for idle segments
  RunBatch(*a, *seg, {{Opcode::kWrite, src.data() + 4096, Addr(dst, 4096), 4096}});
  EXPECT_EQ(a->GetCounters().reconnects, 1u);
  EXPECT_EQ(src, dst);
}

TEST_P(EngineConformanceTest, SlicesBeyondTheLinksLimitWaitTheirTurn) {
  EngineOptions o;
  o.slice_bytes = 4096;
  auto a = Start(o, /*max_outstanding_per_link=*/4);
  auto b = Start(o, 4);
  ASSERT_TRUE(a && b);
  std::vector<char> src = Pattern(200 * 4096, 6), dst(src.size(), 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  std::vector<BatchId> batches;
  for (int i = 0; i < 4; ++i) {
    TransferRequest r{Opcode::kWrite, src.data() + i * 50 * 4096, Addr(dst, i * 50 * 4096),
                      50 * 4096};
    auto batch = a->Submit(*seg, {&r, 1});
    ASSERT_TRUE(batch.ok()) << batch.status();
    batches.push_back(*batch);
  }
  for (BatchId id : batches) {
    auto st = a->Wait(id, absl::Seconds(20));
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_TRUE(st->ok()) << st->requests[0];
  }
  EXPECT_EQ(src, dst);
}

TEST_P(EngineConformanceTest, ThreadsWaitingOnTheirOwnBatchesAllFinish) {
  if (!harness_->threads()) GTEST_SKIP() << "one thread drives this transport";
  auto a = Start();
  auto b = Start();
  ASSERT_TRUE(a && b);
  constexpr int kThreads = 4, kRounds = 20, kPages = 16, kPage = 2048;
  std::vector<char> src = Pattern(kThreads * kPages * 2 * kPage, 7), dst(src.size(), 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<TransferRequest> reqs;
      for (int p = 0; p < kPages; ++p) {
        const size_t off = (size_t(t) * kPages * 2 + 2 * p) * kPage;  // every other page
        reqs.push_back({Opcode::kWrite, src.data() + off, Addr(dst, off), kPage});
      }
      BatchStatus status;
      for (int round = 0; round < kRounds; ++round) {
        auto batch = a->Submit(*seg, reqs);
        if (!batch.ok() || !a->Wait(*batch, absl::Seconds(30), &status).ok() || !status.ok() ||
            !a->Release(*batch).ok()) {
          return;
        }
        ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads * kRounds);
  const std::vector<char> zero(kPage, 0);
  for (size_t off = 0; off < src.size(); off += kPage) {
    const char* want = (off / kPage) % 2 == 0 ? src.data() + off : zero.data();
    ASSERT_EQ(std::memcmp(dst.data() + off, want, kPage), 0) << "page at " << off;
  }
}

// A batch belongs to the thread that submitted it (its lane) but can be
// waited for and released from any other, and the peer's and the NICs'
// counters add up every thread's batches.
TEST_P(EngineConformanceTest, BatchesCrossThreadsAndEveryThreadIsCounted) {
  if (!harness_->threads()) GTEST_SKIP() << "one thread drives this transport";
  auto a = Start();
  auto b = Start();
  ASSERT_TRUE(a && b);
  constexpr int kThreads = 3, kPage = 4096;
  std::vector<char> src = Pattern(kThreads * 2 * kPage, 8), dst(src.size(), 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  std::vector<BatchId> batches(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      TransferRequest r{Opcode::kWrite, src.data() + 2 * t * kPage, Addr(dst, 2 * t * kPage),
                        kPage};
      absl::StatusOr<BatchId> batch = a->Submit(*seg, {&r, 1});
      ASSERT_TRUE(batch.ok()) << batch.status();
      batches[t] = *batch;
    });
  }
  for (auto& t : threads) t.join();
  for (BatchId id : batches) {  // this thread: none of them is its own
    absl::StatusOr<BatchStatus> st = a->Wait(id, absl::Seconds(20));
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_TRUE(st->ok()) << st->requests[0];
    EXPECT_TRUE(a->Release(id).ok());
    EXPECT_EQ(a->Release(id).code(), absl::StatusCode::kNotFound);
  }
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(std::memcmp(dst.data() + 2 * t * kPage, src.data() + 2 * t * kPage, kPage), 0);
  }
  const EngineMetrics m = a->GetMetrics();
  ASSERT_EQ(m.peers.size(), 1u);
  EXPECT_EQ(m.peers[0].requests, uint64_t{kThreads});
  EXPECT_EQ(m.peers[0].requests_ok, uint64_t{kThreads});
  EXPECT_EQ(m.peers[0].bytes_written, uint64_t{kThreads} * kPage);
  EXPECT_EQ(m.peers[0].latency.count(), uint64_t{kThreads});
  uint64_t nic_bytes = 0;
  for (const NicMetrics& n : m.nics) nic_bytes += n.bytes;
  EXPECT_EQ(nic_bytes, uint64_t{kThreads} * kPage);
  // Every slice finished: the segment can close.
  EXPECT_TRUE(a->CloseSegment(*seg).ok());
}

}  // namespace testing
}  // namespace kvferry
