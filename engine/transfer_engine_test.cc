#include "engine/transfer_engine.h"

#include <dirent.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "engine/testing/local_engines.h"
#include "gtest/gtest.h"
#include "handshake/messages.h"
#include "handshake/tcp_network.h"
#include "net/socket.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace {

using testing_local::EphemeralPort;
using testing_local::Local;
using testing_local::MakeEngine;
using transport::Opcode;

std::vector<char> Pattern(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(i * 131 + seed * 7 + (i >> 9));
  return v;
}

// An engine on a port of its own choosing, which `fixed` then names, so
// MakeEngine(*fixed) restarts it on the same port (with new keys).
std::unique_ptr<TransferEngine> MakeRestartable(EngineOptions* fixed) {
  fixed->port = EphemeralPort();
  if (fixed->port == 0) return nullptr;
  return MakeEngine(*fixed);
}

uint64_t Addr(const std::vector<char>& v, size_t off = 0) {
  return reinterpret_cast<uintptr_t>(v.data()) + off;
}

TEST(TransferEngine, WritesAndReadsAcrossEnginesWithSlicing) {
  EngineOptions sliced = Local();
  sliced.slice_bytes = 64 << 10;
  auto prefill = MakeEngine(sliced);
  auto decode = MakeEngine();
  ASSERT_TRUE(prefill && decode);
  EXPECT_EQ(prefill->detection().host, "127.0.0.1");
  // TCP on a host without RDMA; RDMA inside the Soft-RoCE VM.
  EXPECT_EQ(prefill->detection().transport,
            std::getenv("KVFERRY_REQUIRE_RDMA") != nullptr ? "rdma" : "tcp");
  std::vector<char> src = Pattern(1 << 20, 1);
  std::vector<char> dst(1 << 20, 0);
  ASSERT_TRUE(prefill->RegisterMemory(src.data(), src.size()).ok());
  // Two adjacent regions at the peer: a request may span both.
  // Written, then read back: readable by peers.
  const transport::Access rw = transport::Access::kRemoteReadWrite;
  ASSERT_TRUE(decode->RegisterMemory(dst.data(), 1 << 19, rw).ok());
  ASSERT_TRUE(decode->RegisterMemory(dst.data() + (1 << 19), 1 << 19, rw).ok());
  auto seg = prefill->OpenSegment(decode->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ(*prefill->OpenSegment(decode->address()), *seg);  // cached
  std::vector<TransferRequest> reqs = {
      {Opcode::kWrite, src.data(), Addr(dst), 300000},                   // 5 slices
      {Opcode::kWrite, src.data() + 300000, Addr(dst, 300000), 448576},  // spans regions
      {Opcode::kWrite, src.data() + 748576, Addr(dst, 748576), 300000},
  };
  auto batch = prefill->Submit(*seg, reqs);
  ASSERT_TRUE(batch.ok()) << batch.status();
  auto status = prefill->Wait(*batch, absl::Seconds(10));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(status->ok());
  EXPECT_EQ(status->succeeded, 3u);
  EXPECT_EQ(src, dst);
  EXPECT_TRUE(prefill->Release(*batch).ok());
  EXPECT_EQ(prefill->Poll(*batch).status().code(), absl::StatusCode::kNotFound);

  std::vector<char> back(1 << 20, 0);
  ASSERT_TRUE(prefill->RegisterMemory(back.data(), back.size()).ok());
  TransferRequest read{Opcode::kRead, back.data(), Addr(dst), dst.size()};
  auto rb = prefill->Submit(*seg, {&read, 1});
  ASSERT_TRUE(rb.ok()) << rb.status();
  ASSERT_TRUE(prefill->Wait(*rb, absl::Seconds(10))->ok());
  EXPECT_EQ(back, src);
}

// Slices of 1 MiB over TCP, 64 KiB over RDMA (inside the Soft-RoCE VM),
// unless the options name a size; never past a region's end.
TEST(TransferEngine, SliceSizeIsTheTransportsUnlessNamed) {
  const bool rdma = std::getenv("KVFERRY_REQUIRE_RDMA") != nullptr;
  std::vector<char> src = Pattern(3 << 20, 2);
  std::vector<char> dst(3 << 20, 0);
  auto decode = MakeEngine();
  ASSERT_TRUE(decode);
  ASSERT_TRUE(decode->RegisterMemory(dst.data(), dst.size()).ok());
  for (uint64_t named : {uint64_t{0}, uint64_t{64 << 10}, uint64_t{300000}}) {
    EngineOptions o = Local();
    o.slice_bytes = named;
    auto prefill = MakeEngine(o);
    ASSERT_TRUE(prefill);
    ASSERT_TRUE(prefill->RegisterMemory(src.data(), src.size()).ok());
    auto seg = prefill->OpenSegment(decode->address());
    ASSERT_TRUE(seg.ok()) << seg.status();
    std::fill(dst.begin(), dst.end(), 0);
    TransferRequest r{Opcode::kWrite, src.data(), Addr(dst), src.size()};
    auto batch = prefill->Submit(*seg, {&r, 1});
    ASSERT_TRUE(batch.ok()) << batch.status();
    auto status = prefill->Wait(*batch, absl::Seconds(10));
    ASSERT_TRUE(status.ok() && status->ok()) << named;
    EXPECT_EQ(src, dst) << named;
    const uint64_t size = named != 0 ? named : rdma ? (64 << 10) : (1 << 20);
    const EngineMetrics m = prefill->GetMetrics();
    ASSERT_EQ(m.peers.size(), 1u);
    EXPECT_EQ(m.peers[0].slices, (src.size() + size - 1) / size) << "slice_bytes " << named;
  }
}

// Requests whose bytes follow each other on both ends travel as one slice
// (up to the slice size), never across a peer region's end or between a
// WRITE and a READ; each request still gets its own status.
TEST(TransferEngine, AdjacentRequestsShareSlices) {
  constexpr uint64_t kSlice = 64 << 10, kPage = 4 << 10, kHalf = 256 << 10;
  std::vector<char> src = Pattern(2 * kHalf, 5);
  std::vector<char> dst(2 * kHalf, 0);
  auto decode = MakeEngine();
  ASSERT_TRUE(decode);
  // Two peer regions that touch: dst[0, kHalf) and dst[kHalf, 2 kHalf).
  const transport::Access rw = transport::Access::kRemoteReadWrite;
  ASSERT_TRUE(decode->RegisterMemory(dst.data(), kHalf, rw).ok());
  ASSERT_TRUE(decode->RegisterMemory(dst.data() + kHalf, kHalf, rw).ok());
  EngineOptions o = Local();
  o.slice_bytes = kSlice;
  auto prefill = MakeEngine(o);
  ASSERT_TRUE(prefill);
  ASSERT_TRUE(prefill->RegisterMemory(src.data(), src.size()).ok());
  auto seg = prefill->OpenSegment(decode->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  uint64_t slices_before = 0;
  // Moves `reqs` and returns how many slices they took.
  auto run = [&](const std::vector<TransferRequest>& reqs) -> uint64_t {
    auto batch = prefill->Submit(*seg, reqs);
    EXPECT_TRUE(batch.ok()) << batch.status();
    if (!batch.ok()) return 0;
    auto status = prefill->Wait(*batch, absl::Seconds(10));
    EXPECT_TRUE(status.ok()) << status.status();
    if (!status.ok()) return 0;
    EXPECT_EQ(status->succeeded, reqs.size());
    EXPECT_EQ(status->pending, 0u);
    const uint64_t now = prefill->GetMetrics().peers.at(0).slices;
    const uint64_t used = now - slices_before;
    slices_before = now;
    return used;
  };
  auto pages = [&](uint64_t first, uint64_t count, uint64_t stride, Opcode op) {
    std::vector<TransferRequest> reqs;
    for (uint64_t k = 0; k < count; ++k) {
      const uint64_t off = first + k * stride;
      reqs.push_back({op, src.data() + off, Addr(dst, off), kPage});
    }
    return reqs;
  };
  // 16 adjacent pages: one slice; 32: two (64 KiB each).
  EXPECT_EQ(run(pages(0, 16, kPage, Opcode::kWrite)), 1u);
  EXPECT_EQ(run(pages(0, 32, kPage, Opcode::kWrite)), 2u);
  EXPECT_EQ(std::vector<char>(dst.begin(), dst.begin() + 32 * kPage),
            std::vector<char>(src.begin(), src.begin() + 32 * kPage));
  // Pages with gaps: one slice each.
  EXPECT_EQ(run(pages(0, 8, 2 * kPage, Opcode::kWrite)), 8u);
  // Adjacent pages on both sides of the peer regions' boundary: two slices.
  EXPECT_EQ(run(pages(kHalf - 2 * kPage, 4, kPage, Opcode::kWrite)), 2u);
  // A WRITE then a READ of the next bytes: two slices. The READ brings
  // back what the first WRITEs put there.
  std::vector<TransferRequest> mixed = pages(0, 2, kPage, Opcode::kWrite);
  std::fill(src.begin() + 2 * kPage, src.begin() + 3 * kPage, 'z');
  mixed.push_back({Opcode::kRead, src.data() + 2 * kPage, Addr(dst, 2 * kPage), kPage});
  EXPECT_EQ(run(mixed), 2u);
  EXPECT_EQ(src, Pattern(2 * kHalf, 5));
  // A request larger than a slice is cut as before, and the adjacent page
  // after it goes in a slice of its own.
  std::vector<TransferRequest> big = {
      {Opcode::kWrite, src.data() + kHalf, Addr(dst, kHalf), kSlice + kPage},
      {Opcode::kWrite, src.data() + kHalf + kSlice + kPage, Addr(dst, kHalf + kSlice + kPage),
       kPage}};
  EXPECT_EQ(run(big), 3u);
  EXPECT_EQ(std::vector<char>(dst.begin() + kHalf, dst.begin() + kHalf + kSlice + 2 * kPage),
            std::vector<char>(src.begin() + kHalf, src.begin() + kHalf + kSlice + 2 * kPage));
}

// Links per peer: the transport's choice unless named. Over TCP one link on
// a host where this process may use fewer than 4 CPUs (each link keeps two
// threads busy at each end), else two; over RDMA (inside the Soft-RoCE VM)
// two. At least one per local NIC either way.
TEST(TransferEngine, LinkCountIsTheTransportsUnlessNamed) {
  const bool rdma = std::getenv("KVFERRY_REQUIRE_RDMA") != nullptr;
  cpu_set_t cpus;
  ASSERT_EQ(sched_getaffinity(0, sizeof cpus, &cpus), 0);
  auto decode = MakeEngine();
  ASSERT_TRUE(decode);
  for (uint32_t named : {0u, 3u}) {
    EngineOptions o = Local();
    o.links_per_peer = named;
    auto prefill = MakeEngine(o);
    ASSERT_TRUE(prefill);
    auto seg = prefill->OpenSegment(decode->address());
    ASSERT_TRUE(seg.ok()) << seg.status();
    const uint32_t nics = static_cast<uint32_t>(prefill->GetMetrics().nics.size());
    const uint32_t chosen = named != 0 ? named : rdma ? 2 : CPU_COUNT(&cpus) < 4 ? 1 : 2;
    const EngineMetrics m = prefill->GetMetrics();
    ASSERT_EQ(m.peers.size(), 1u);
    EXPECT_EQ(m.peers[0].links, std::max(chosen, nics)) << "links_per_peer " << named;
  }
}

TEST(TransferEngine, OutOfRegionRequestsAreRefusedBeforeAnythingIsSent) {
  auto a = MakeEngine();
  auto b = MakeEngine();
  std::vector<char> src = Pattern(8192, 2), dst(8192, 'd');
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), 4096).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  std::vector<TransferRequest> reqs = {
      {Opcode::kWrite, src.data(), Addr(dst), 100},        // fine on its own
      {Opcode::kWrite, src.data(), Addr(dst, 4000), 200},  // runs past the region
  };
  auto batch = a->Submit(*seg, reqs);
  EXPECT_EQ(batch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(batch.status().message().find("request 1"), std::string::npos);
  EXPECT_NE(batch.status().message().find(b->address()), std::string::npos);
  // Unregistered local memory.
  std::vector<char> stray(64);
  TransferRequest bad_local{Opcode::kWrite, stray.data(), Addr(dst), 64};
  EXPECT_EQ(a->Submit(*seg, {&bad_local, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(dst, std::vector<char>(8192, 'd'));  // nothing was sent
  // The engine is still usable.
  auto ok = a->Submit(*seg, {reqs.data(), 1});
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(a->Wait(*ok, absl::Seconds(5))->ok());
}

// A thread remembers the registered piece its last request used (no lock
// while nothing changed); an unregistration is seen at once, by the same
// engine only.
TEST(TransferEngine, UnregisteredMemoryIsRefusedAtOnce) {
  auto a = MakeEngine();
  auto b = MakeEngine();
  std::vector<char> src = Pattern(8192, 4), dst(8192, 'd');
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size(), transport::Access::kRemoteReadWrite).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  auto to_a = b->OpenSegment(a->address());
  ASSERT_TRUE(to_a.ok());
  TransferRequest w{Opcode::kWrite, src.data() + 100, Addr(dst), 1000};
  for (int i = 0; i < 2; ++i) {  // the second one from the remembered piece
    auto batch = a->Submit(*seg, {&w, 1});
    ASSERT_TRUE(batch.ok()) << batch.status();
    ASSERT_TRUE(a->Wait(*batch, absl::Seconds(5))->ok());
    ASSERT_TRUE(a->Release(*batch).ok());
  }
  // Not registered on b: b refuses it although this thread just used it on a.
  TransferRequest from_src{Opcode::kWrite, src.data() + 100, Addr(src), 1000};
  EXPECT_EQ(b->Submit(*to_a, {&from_src, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  // Past the registration's end, though it starts inside.
  TransferRequest past{Opcode::kWrite, src.data() + 8000, Addr(dst), 1000};
  EXPECT_EQ(a->Submit(*seg, {&past, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(a->UnregisterMemory(src.data()).ok());
  auto gone = a->Submit(*seg, {&w, 1});
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(gone.status().message().find("not inside memory registered on this engine"),
            std::string::npos)
      << gone.status();
  // Registered again (new regions, new keys): served again.
  ASSERT_TRUE(a->RegisterMemory(src.data(), 4096).ok());
  auto again = a->Submit(*seg, {&w, 1});
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(a->Wait(*again, absl::Seconds(5))->ok());
  EXPECT_EQ(std::vector<char>(dst.begin(), dst.begin() + 1000),
            std::vector<char>(src.begin() + 100, src.begin() + 1100));
}

// Wait(batch, timeout, &out) fills a caller's BatchStatus, replacing what
// an earlier batch left in it; recycled batches start clean.
TEST(TransferEngine, WaitIntoAReusedStatus) {
  auto a = MakeEngine();
  auto b = MakeEngine();
  std::vector<char> src = Pattern(8192, 3), dst(4096, 'd');
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size(), transport::Access::kRemoteReadWrite).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  BatchStatus status;
  status.failed = 7;  // stale contents are replaced
  status.requests.resize(9, absl::InternalError("stale"));
  std::vector<TransferRequest> three = {{Opcode::kWrite, src.data(), Addr(dst), 1000},
                                        {Opcode::kWrite, src.data() + 1000, Addr(dst, 1000), 1000},
                                        {Opcode::kRead, src.data() + 4096, Addr(dst), 100}};
  auto first = a->Submit(*seg, three);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(a->Wait(*first, absl::Seconds(5), &status).ok());
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(status.requests.size(), 3u);
  EXPECT_EQ(status.succeeded, 3u);
  EXPECT_EQ(status.failed, 0u);
  for (const absl::Status& r : status.requests) EXPECT_TRUE(r.ok()) << r;
  ASSERT_TRUE(a->Release(*first).ok());
  for (int i = 0; i < 3; ++i) {
    auto next = a->Submit(*seg, {three.data(), 1});
    ASSERT_TRUE(next.ok());
    ASSERT_TRUE(a->Wait(*next, absl::Seconds(5), &status).ok());
    EXPECT_TRUE(status.ok());
    EXPECT_EQ(status.requests.size(), 1u);
    EXPECT_EQ(status.succeeded, 1u);
    EXPECT_EQ(status.failed, 0u);
    ASSERT_TRUE(a->Release(*next).ok());
  }
  EXPECT_EQ(std::vector<char>(dst.begin(), dst.begin() + 2000),
            std::vector<char>(src.begin(), src.begin() + 2000));
  EXPECT_EQ(a->Wait(*first, absl::Seconds(1), &status).code(), absl::StatusCode::kNotFound);
}

TEST(TransferEngine, RemoteAccessRightsAreCheckedBeforePosting) {
  auto a = MakeEngine();
  auto b = MakeEngine();
  std::vector<char> src(64), ro(64), hidden(64);
  ASSERT_TRUE(a->RegisterMemory(src.data(), 64).ok());
  ASSERT_TRUE(b->RegisterMemory(ro.data(), 64, transport::Access::kRemoteRead).ok());
  ASSERT_TRUE(b->RegisterMemory(hidden.data(), 64, transport::Access::kNone).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  TransferRequest w{Opcode::kWrite, src.data(), Addr(ro), 64};
  EXPECT_EQ(a->Submit(*seg, {&w, 1}).status().code(), absl::StatusCode::kPermissionDenied);
  TransferRequest h{Opcode::kRead, src.data(), Addr(hidden), 64};
  EXPECT_EQ(a->Submit(*seg, {&h, 1}).status().code(), absl::StatusCode::kInvalidArgument);
}

// Without an access argument a region is writable by peers and not
// readable: a peer cannot read a buffer its owner did not offer for reading.
TEST(TransferEngine, RegistrationDefaultsToRemoteWriteOnly) {
  auto a = MakeEngine();
  auto b = MakeEngine();
  std::vector<char> src = Pattern(64, 4), dst(64, 's');
  ASSERT_TRUE(a->RegisterMemory(src.data(), 64).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), 64).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  auto regions = a->SegmentRegions(*seg);
  ASSERT_TRUE(regions.ok());
  ASSERT_EQ(regions->size(), 1u);
  EXPECT_EQ((*regions)[0].access, transport::Access::kRemoteWrite);
  TransferRequest r{Opcode::kRead, src.data(), Addr(dst), 64};
  EXPECT_EQ(a->Submit(*seg, {&r, 1}).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(src, Pattern(64, 4));
  TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), 64};
  auto batch = a->Submit(*seg, {&w, 1});
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(a->Wait(*batch, absl::Seconds(5))->ok());
  EXPECT_EQ(dst, src);
}

// A read-only mapping offered for remote writes: refused at registration
// (a peer's WRITE would otherwise kill this process with SIGSEGV). Offered
// for reading it is fine, and peers read it.
TEST(TransferEngine, ReadOnlyMemoryIsRefusedForRemoteWrites) {
  auto a = MakeEngine();
  auto b = MakeEngine();
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* ro = ::mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(ro, MAP_FAILED);
  std::memset(ro, 'r', 2 * page);
  ASSERT_EQ(::mprotect(static_cast<char*>(ro) + page, page, PROT_READ), 0);  // the second page
  auto refused = b->RegisterMemory(ro, 2 * page, transport::Access::kRemoteReadWrite);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("read-only"), std::string::npos) << refused;
  EXPECT_EQ(b->RegisterMemory(ro, 2 * page, transport::Access::kRemoteWrite).code(),
            absl::StatusCode::kInvalidArgument);
  // The first page alone is writable; the whole is fine for reading, where
  // the transport does not pin memory for writing (verbs registers every
  // region for local writes, the sink of a READ: the NIC refuses a
  // read-only mapping whatever the access).
  absl::Status readable = b->RegisterMemory(ro, 2 * page, transport::Access::kRemoteRead);
  if (b->detection().transport != "tcp") {
    EXPECT_FALSE(readable.ok());
    ::munmap(ro, 2 * page);
    return;
  }
  ASSERT_TRUE(readable.ok()) << readable;
  std::vector<char> got(2 * page, 0);
  ASSERT_TRUE(a->RegisterMemory(got.data(), got.size(), transport::Access::kNone).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  TransferRequest r{Opcode::kRead, got.data(), reinterpret_cast<uint64_t>(ro), got.size()};
  auto batch = a->Submit(*seg, {&r, 1});
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_TRUE(a->Wait(*batch, absl::Seconds(5))->ok());
  EXPECT_EQ(got, std::vector<char>(2 * page, 'r'));
  ASSERT_TRUE(a->Release(*batch).ok());
  ASSERT_TRUE(b->UnregisterMemory(ro).ok());
  ASSERT_TRUE(b->RegisterMemory(ro, page, transport::Access::kRemoteWrite).ok());
  ASSERT_TRUE(b->UnregisterMemory(ro).ok());
  ::munmap(ro, 2 * page);
}

TEST(TransferEngine, PeerNotListeningIsUnavailableInBoundedTime) {
  const uint16_t port = EphemeralPort();  // nobody listens there
  ASSERT_NE(port, 0);
  auto a = MakeEngine();
  const absl::Time start = absl::Now();
  auto seg = a->OpenSegment("127.0.0.1:" + std::to_string(port));
  EXPECT_EQ(seg.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(a->OpenSegment("no-port").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TransferEngine, PeerWithNothingRegisteredYetFailsClearlyThenWorks) {
  auto a = MakeEngine();
  auto b = MakeEngine();
  std::vector<char> src = Pattern(4096, 3), dst(4096, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), 4096};
  auto early = a->Submit(*seg, {&w, 1});
  EXPECT_EQ(early.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(early.status().message().find(b->address()), std::string::npos);
  EXPECT_NE(early.status().message().find("0 region"), std::string::npos);
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto later = a->Submit(*seg, {&w, 1});  // the miss refreshes the descriptor
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_TRUE(a->Wait(*later, absl::Seconds(5))->ok());
  EXPECT_EQ(src, dst);
}

TEST(TransferEngine, PeerRestartedOnTheSamePortWorksAfterRefresh) {
  auto a = MakeEngine();
  EngineOptions fixed = Local();
  auto b = MakeRestartable(&fixed);
  const std::string address = b->address();
  std::vector<char> src = Pattern(200000, 4), dst(200000, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(address);
  ASSERT_TRUE(seg.ok());
  TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), src.size()};
  auto first = a->Submit(*seg, {&w, 1});
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(a->Wait(*first, absl::Seconds(5))->ok());
  // The peer restarts on the same port, with new keys (same buffer).
  const uint64_t old_id = b->engine_id();
  b.reset();
  std::fill(dst.begin(), dst.end(), 0);
  b = MakeEngine(fixed);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->address(), address);
  EXPECT_NE(b->engine_id(), old_id);
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto second = a->Submit(*seg, {&w, 1});
  ASSERT_TRUE(second.ok()) << second.status();
  // Over TCP the dead links are noticed at once; over Soft-RoCE only after
  // the verbs transport's request_timeout (10 s), then the retry refreshes.
  auto status = a->Wait(*second, absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(status->ok()) << status->requests[0];
  EXPECT_EQ(src, dst);
}

// The peer dies while a batch is in flight: the batch ends (every request
// OK or kUnavailable, none pending) in bounded time, and once the peer is back
// the next batch handshakes again over new links and succeeds.
TEST(TransferEngine, PeerDiesMidBatchFailsInBoundedTimeThenNextBatchReconnects) {
  auto a = MakeEngine();
  EngineOptions fixed = Local();
  auto b = MakeRestartable(&fixed);
  const std::string address = b->address();
  const size_t kBlock = 64 << 10, kCount = 64;
  std::vector<char> src = Pattern(kBlock * kCount, 9), dst(kBlock * kCount, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(address);
  ASSERT_TRUE(seg.ok()) << seg.status();
  std::vector<TransferRequest> batch;
  for (size_t i = 0; i < kCount; ++i) {
    batch.push_back({Opcode::kWrite, src.data() + i * kBlock, Addr(dst, i * kBlock), kBlock});
  }
  auto doomed = a->Submit(*seg, batch);
  ASSERT_TRUE(doomed.ok()) << doomed.status();
  b.reset();  // mid-batch: its links and keys are gone
  const absl::Time start = absl::Now();
  // Bound: the verbs transport's request_timeout backstop (10 s on
  // Soft-RoCE, which never fails a request to a vanished QP) plus a retry
  // that finds nobody listening.
  auto ended = a->Wait(*doomed, absl::Seconds(30));
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->pending, 0u) << "requests to a dead peer still pending after 30 s";
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  for (const absl::Status& s : ended->requests) {
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kUnavailable) << s;
  }
  ASSERT_TRUE(a->Release(*doomed).ok());

  b = MakeEngine(fixed);
  ASSERT_TRUE(b);
  std::fill(dst.begin(), dst.end(), 0);
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto next = a->Submit(*seg, batch);
  ASSERT_TRUE(next.ok()) << next.status();
  auto status = a->Wait(*next, absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(status->ok()) << status->requests[0];
  EXPECT_EQ(src, dst);
}

// With a shared secret, an engine answers only peers that hold it: no
// descriptor (so no keys), no link, no notification for anyone else, and
// each refused attempt is counted. Peers with the secret work as usual.
TEST(TransferEngine, UnauthenticatedClientsReceiveNoKeys) {
  EngineOptions locked = Local();
  locked.secret = "kvferry-test-secret-0123456789";
  auto b = MakeEngine(locked);
  std::vector<char> src = Pattern(65536, 5), dst(65536, 0);
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());

  EngineOptions plain = Local();  // no secret
  plain.transport = "tcp";        // (the count below, also where RDMA is)
  auto stranger = MakeEngine(plain);
  auto seg = stranger->OpenSegment(b->address());
  EXPECT_EQ(seg.status().code(), absl::StatusCode::kUnauthenticated) << seg.status();
  EXPECT_NE(seg.status().message().find("secret"), std::string::npos);
  // Raw requests get nothing either: no descriptor, no notification.
  auto raw = handshake::NewTcpNetwork();
  auto describe = raw->Call(b->address(), handshake::Frame{handshake::MessageType::kDescribe, ""},
                            absl::Seconds(5));
  EXPECT_EQ(describe.status().code(), absl::StatusCode::kUnauthenticated);
  auto notify = raw->Call(b->address(),
                          handshake::Frame{handshake::MessageType::kNotify,
                                           handshake::Encode(handshake::Notify{7, "forged"})},
                          absl::Seconds(5));
  EXPECT_EQ(notify.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(b->TakeNotifications().empty());
  EngineOptions wrong = Local();
  wrong.secret = "some-other-secret-of-enough-bytes";
  EXPECT_EQ(MakeEngine(wrong)->OpenSegment(b->address()).status().code(),
            absl::StatusCode::kUnauthenticated);
  // The stranger sent its link offers with its describe request (one round
  // trip for both): both refused, 2 + 1 + 1 + 1.
  EXPECT_EQ(b->GetCounters().handshakes_refused, 5u);

  // A holder of the secret handshakes, writes, and notifies.
  auto friend_engine = MakeEngine(locked);
  ASSERT_TRUE(friend_engine->RegisterMemory(src.data(), src.size()).ok());
  auto ok = friend_engine->OpenSegment(b->address());
  ASSERT_TRUE(ok.ok()) << ok.status();
  TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), src.size()};
  auto batch = friend_engine->Submit(*ok, {&w, 1});
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_TRUE(friend_engine->NotifyAfter(*batch, "done", absl::Seconds(5)).ok());
  auto note = b->WaitNotification(absl::Seconds(5));
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(note->message, "done");
  EXPECT_EQ(src, dst);
  EXPECT_EQ(b->GetCounters().handshakes_refused, 5u);
  // And an engine with a secret never talks to one without (no downgrade).
  EXPECT_EQ(friend_engine->OpenSegment(stranger->address()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// Established TCP connections this process opened to a port it listens on
// itself, but for `except_port` (from /proc: the connecting ends, counted as
// soon as they are connected).
int ConnectionsToOwnListeners(int except_port) {
  std::set<std::string> mine;  // socket inodes
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) {
    char target[64];
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = ::readlink(path.c_str(), target, sizeof target - 1);
    if (n <= 0) continue;
    const std::string link(target, n);
    if (link.rfind("socket:[", 0) == 0) mine.insert(link.substr(8, link.size() - 9));
  }
  ::closedir(d);
  auto port_of = [](const std::string& address) {
    return static_cast<int>(
        std::strtol(address.substr(address.find(':') + 1).c_str(), nullptr, 16));
  };
  std::set<int> listening;
  std::vector<int> remote_ports;  // of established sockets
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (mine.count(inode) == 0) continue;
      if (state == "0A") listening.insert(port_of(local));         // TCP_LISTEN
      if (state == "01") remote_ports.push_back(port_of(remote));  // TCP_ESTABLISHED
    }
  }
  int count = 0;
  for (int port : remote_ports) count += port != except_port && listening.count(port) > 0;
  return count;
}

// The first link to a TCP peer rides the handshake's own connection
// (kConnectLinksHere): with one link per peer, opening a segment and moving
// data connects nothing to the peer's data port (the handshake's
// connection is replaced in the background, for the calls that follow).
// Further links connect to the data port. With a secret, the handshake's
// connections carry authenticated frames, and every link connects the
// usual way.
TEST(TransferEngine, TheFirstLinkRidesTheHandshakeConnection) {
  struct Case {
    uint32_t links;
    bool secret;
    int data_connections;  // to the peer's data port
  };
  for (const Case& c : {Case{1, false, 0}, Case{2, false, 1}, Case{1, true, 1}}) {
    SCOPED_TRACE(::testing::Message() << c.links << " link(s), secret " << c.secret);
    EngineOptions o = Local();
    o.transport = "tcp";  // an RDMA host (the Soft-RoCE VM) would use verbs
    o.links_per_peer = c.links;
    if (c.secret) o.secret = "kvferry-test-secret-0123456789";
    auto a = MakeEngine(o);
    auto b = MakeEngine(o);
    const int handshake_port = std::stoi(b->address().substr(b->address().rfind(':') + 1));
    const int before = ConnectionsToOwnListeners(handshake_port);
    std::vector<char> src = Pattern(64 << 10, 4), dst(64 << 10, 0);
    ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
    ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
    auto seg = a->OpenSegment(b->address());
    ASSERT_TRUE(seg.ok()) << seg.status();
    std::vector<TransferRequest> reqs;
    for (size_t off = 0; off < src.size(); off += 4096) {
      reqs.push_back({Opcode::kWrite, src.data() + off, Addr(dst) + off, 4096});
    }
    auto batch = a->Submit(*seg, reqs);
    ASSERT_TRUE(batch.ok()) << batch.status();
    auto st = a->Wait(*batch, absl::Seconds(10));
    ASSERT_TRUE(st.ok() && st->ok()) << (st.ok() ? st->requests[0] : st.status());
    EXPECT_EQ(src, dst);
    EXPECT_EQ(a->GetMetrics().peers[0].links, c.links);
    // Those to the handshake port (a spare for later calls, say) do not
    // count.
    EXPECT_EQ(ConnectionsToOwnListeners(handshake_port) - before, c.data_connections);
  }
}

// An engine of protocol version 1 from before connect-links-here refuses
// that type and describe-v2 (unknown message types): the requester then
// describes it with the version 1 describe and opens the segment the usual
// way, its link connecting to the peer's data port. The "older peer" here
// is a handshake proxy in front of a current engine that refuses types 20
// to 22 and forwards everything else.
TEST(TransferEngine, APeerThatPredatesConnectLinksHereIsAskedTheUsualWay) {
  EngineOptions o = Local();
  o.transport = "tcp";  // an RDMA host (the Soft-RoCE VM) would use verbs
  o.links_per_peer = 1;
  auto a = MakeEngine(o);
  auto b = MakeEngine(o);
  auto forward = handshake::NewTcpNetwork();
  auto network = handshake::NewTcpNetwork();
  handshake::ServeOptions serve;
  serve.bind_host = "127.0.0.1";
  std::atomic<int> refused{0}, forwarded{0};
  auto proxy = network->Serve(serve, [&](const handshake::Frame& f) {
    if (static_cast<int>(f.type) >= 20) {
      ++refused;
      return handshake::ErrorFrame(
          absl::DataLossError(absl::StrCat("unknown message type ", static_cast<int>(f.type))));
    }
    ++forwarded;
    absl::StatusOr<handshake::Frame> reply = forward->Call(b->address(), f, absl::Seconds(5));
    return reply.ok() ? *reply : handshake::ErrorFrame(reply.status());
  });
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  std::vector<char> src = Pattern(16384, 8), dst(16384, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment((*proxy)->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  // describe-v2 and connect-links-here in one round trip, then describe-v2
  // again before the version 1 describe.
  EXPECT_EQ(refused.load(), 3);
  EXPECT_GE(forwarded.load(), 2);  // describe, connect-links
  TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), src.size()};
  auto batch = a->Submit(*seg, {&w, 1});
  ASSERT_TRUE(batch.ok()) << batch.status();
  auto st = a->Wait(*batch, absl::Seconds(10));
  ASSERT_TRUE(st.ok() && st->ok()) << (st.ok() ? st->requests[0] : st.status());
  EXPECT_EQ(src, dst);
  EXPECT_EQ(a->GetMetrics().peers[0].links, 1u);
}

// Every link to a peer comes up in one kConnectLinks round trip, answered
// without waiting for the links' data connections (the TCP transport
// attaches each when it arrives). A request full of tokens whose
// connections never arrive holds no thread: it is answered at once, its
// links end after the data port's claim wait (2 s, counted; sooner than
// the 5 s connect timeout), and the engine keeps serving.
TEST(TransferEngine, BogusLinkBatchHoldsNothing) {
  EngineOptions o = Local();
  o.connect_timeout = absl::Seconds(5);
  auto b = MakeEngine(o);
  std::vector<char> src = Pattern(8192, 3), dst(8192, 0);
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  handshake::ConnectLinksRequest bogus;
  for (uint64_t token = 1; token <= handshake::kMaxLinksPerConnect; ++token) {
    bogus.links.push_back(
        handshake::ConnectRequest{42,
                                  0,
                                  {"lo", "127.0.0.1:1", 0, 0, 0},
                                  0,
                                  transport::tcp_wire::EncodeLinkParams(token, 0, 0)});
  }
  auto raw = handshake::NewTcpNetwork();
  const absl::Time t0 = absl::Now();
  auto reply =
      raw->Call(b->address(),
                handshake::Frame{handshake::MessageType::kConnectLinks, handshake::Encode(bogus)},
                absl::Seconds(10));
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(reply.ok()) << reply.status();
  auto answers = handshake::DecodeConnectLinksReply(reply->payload);
  ASSERT_TRUE(answers.ok()) << answers.status();
  ASSERT_EQ(answers->links.size(), bogus.links.size());
  for (const auto& link : answers->links) EXPECT_TRUE(link.ok()) << link.status();
  EXPECT_LT(took, o.connect_timeout) << "answered without waiting for the connections";
  // Each ends once the claim wait has passed without its connection.
  auto never_came = [&] {
    for (const auto& [reason, count] : b->GetMetrics().refused_input) {
      if (reason == "data_connection_never_came") return count;
    }
    return uint64_t{0};
  };
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (never_came() < bogus.links.size() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(never_came(), bogus.links.size());
  EXPECT_GE(absl::Now() - t0, absl::Seconds(2));
  EXPECT_LT(absl::Now() - t0, o.connect_timeout);
  // More links than the cap are refused unread.
  bogus.links.push_back(bogus.links.back());
  auto too_many =
      raw->Call(b->address(),
                handshake::Frame{handshake::MessageType::kConnectLinks, handshake::Encode(bogus)},
                absl::Seconds(10));
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument) << too_many.status();

  // A real engine's links (links_per_peer = 3) all come up, in one request.
  EngineOptions three = Local();
  three.links_per_peer = 3;
  auto a = MakeEngine(three);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), src.size()};
  auto batch = a->Submit(*seg, {&w, 1});
  ASSERT_TRUE(batch.ok()) << batch.status();
  auto st = a->Wait(*batch, absl::Seconds(5));
  ASSERT_TRUE(st.ok() && st->ok()) << (st.ok() ? st->requests[0] : st.status());
  EXPECT_EQ(src, dst);
}

// Work meant for one instance of a peer never lands at its successor: a
// batch bound to the old instance and a notification addressed to it are
// refused after a restart, while unbound work follows host:port.
TEST(TransferEngine, WorkForARestartedPeersPredecessorIsRefused) {
  auto a = MakeEngine();
  EngineOptions fixed = Local();
  auto b = MakeRestartable(&fixed);
  const std::string address = b->address();
  std::vector<char> src = Pattern(4096, 6), dst(4096, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(address);
  ASSERT_TRUE(seg.ok());
  auto old_id = a->PeerEngineId(*seg);
  ASSERT_TRUE(old_id.ok());
  EXPECT_EQ(*old_id, b->engine_id());
  b.reset();
  b = MakeEngine(fixed);
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  // Addressed to the predecessor: refused by the new instance.
  absl::Status note = a->Notify(*seg, "for the old one", *old_id);
  EXPECT_EQ(note.code(), absl::StatusCode::kFailedPrecondition) << note;
  EXPECT_TRUE(b->TakeNotifications().empty());
  // Fetching a value handshakes again (values and segment must describe
  // the same instance) and learns the new id.
  ASSERT_TRUE(b->PublishMetadata("pool", "at dst").ok());
  EXPECT_EQ(a->FetchMetadata(*seg, "pool").value_or(""), "at dst");
  auto new_id = a->PeerEngineId(*seg);
  ASSERT_TRUE(new_id.ok());
  EXPECT_EQ(*new_id, b->engine_id());
  // A batch bound to the old instance fails before anything is sent.
  TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), src.size()};
  auto bound = a->Submit(*seg, {&w, 1}, *old_id);
  EXPECT_EQ(bound.status().code(), absl::StatusCode::kUnavailable) << bound.status();
  EXPECT_NE(dst, src);
  // Bound to the current one, or unbound: it goes.
  auto ok = a->Submit(*seg, {&w, 1}, *new_id);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(a->BatchPeerEngineId(*ok).value_or(0), *new_id);
  ASSERT_TRUE(a->NotifyAfter(*ok, "for the new one", absl::Seconds(5)).ok());
  auto got = b->WaitNotification(absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->message, "for the new one");
  EXPECT_EQ(dst, src);
}

TEST(TransferEngine, NotificationIsNeverObservedBeforeItsData) {
  auto prefill = MakeEngine();
  auto decode = MakeEngine();
  const size_t kPage = 64 << 10, kPages = 16;
  std::vector<char> src(kPage * kPages), dst(kPage * kPages, 0);
  ASSERT_TRUE(prefill->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(decode->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = prefill->OpenSegment(decode->address());
  ASSERT_TRUE(seg.ok());
  for (int round = 1; round <= 20; ++round) {
    std::fill(src.begin(), src.end(), static_cast<char>(round));
    std::vector<TransferRequest> reqs;
    for (size_t p = 0; p < kPages; ++p) {
      reqs.push_back({Opcode::kWrite, src.data() + p * kPage, Addr(dst, p * kPage), kPage});
    }
    auto batch = prefill->Submit(*seg, reqs);
    ASSERT_TRUE(batch.ok());
    std::thread sender([&] {
      EXPECT_TRUE(
          prefill->NotifyAfter(*batch, "round " + std::to_string(round), absl::Seconds(10)).ok());
    });
    auto n = decode->WaitNotification(absl::Seconds(10));
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(n->message, "round " + std::to_string(round));
    EXPECT_EQ(n->engine_id, prefill->engine_id());
    // The moment the notification is seen, every byte is there.
    size_t wrong = 0;
    for (char c : dst) wrong += c != static_cast<char>(round);
    EXPECT_EQ(wrong, 0u) << "round " << round;
    sender.join();
    ASSERT_TRUE(prefill->Release(*batch).ok());
  }
  EXPECT_TRUE(decode->TakeNotifications().empty());
  EXPECT_EQ(decode->WaitNotification(absl::Milliseconds(20)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

// Without a CUDA driver (this test binary loads none), memory the CPU cannot
// read is refused at registration: GPU memory, or a buffer already freed,
// would otherwise crash the transport later.
TEST(TransferEngine, MemoryTheCpuCannotReadIsRefusedWithoutACudaDriver) {
  auto e = MakeEngine();
  ASSERT_NE(e, nullptr);
  void* p = mmap(nullptr, 1 << 16, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  absl::Status st = e->RegisterMemory(p, 1 << 16);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("CUDA driver"), std::string::npos) << st;
  ASSERT_EQ(munmap(p, 1 << 16), 0);
  // Unmapped: refused. Another thread of the process may map the hole again
  // meanwhile (seen under TSan); the check counts only where it stayed a
  // hole throughout, and a few fresh holes are tried.
  bool checked = false;
  for (int attempt = 0; attempt < 5 && !checked; ++attempt) {
    void* hole = mmap(nullptr, 1 << 16, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(hole, MAP_FAILED);
    ASSERT_EQ(munmap(hole, 1 << 16), 0);
    const absl::Status unmapped = e->RegisterMemory(hole, 1 << 16);
    unsigned char pages[16];
    checked = mincore(hole, 1 << 16, pages) != 0 && errno == ENOMEM;
    if (checked) EXPECT_EQ(unmapped.code(), absl::StatusCode::kInvalidArgument) << unmapped;
    if (unmapped.ok()) ASSERT_TRUE(e->UnregisterMemory(hole).ok());
  }
  EXPECT_TRUE(checked) << "no unmapped range stayed unmapped for the check";
  std::vector<char> host(1 << 16);
  EXPECT_TRUE(e->RegisterMemory(host.data(), host.size()).ok());  // still usable
}

TEST(TransferEngine, FailedBatchSendsNoNotification) {
  auto a = MakeEngine();
  EngineOptions fixed = Local();
  auto b = MakeRestartable(&fixed);  // its port stays free once it is gone
  std::vector<char> src(4096), dst(4096);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), 4096};
  auto batch = a->Submit(*seg, {&w, 1});
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(a->Wait(*batch, absl::Seconds(5)).ok());
  // Now the peer goes away: a new batch fails, and so does its notification.
  b.reset();
  auto doomed = a->Submit(*seg, {&w, 1});
  if (doomed.ok()) {
    absl::Status n = a->NotifyAfter(*doomed, "must not arrive", absl::Seconds(20));
    EXPECT_FALSE(n.ok());
  } else {
    EXPECT_EQ(doomed.status().code(), absl::StatusCode::kUnavailable) << doomed.status();
  }
}

TEST(TransferEngine, HundredEnginesGetDistinctPorts) {
  std::vector<std::unique_ptr<TransferEngine>> engines;
  std::set<std::string> addresses;
  EngineOptions o = Local();
  o.first_port = 15000;
  o.last_port = 17000;
  for (int i = 0; i < 100; ++i) {
    auto e = TransferEngine::Create(o);
    ASSERT_TRUE(e.ok()) << e.status();
    addresses.insert((*e)->address());
    engines.push_back(std::move(*e));
  }
  EXPECT_EQ(addresses.size(), 100u);
}

TEST(TransferEngine, Ipv6LoopbackPeer) {
  EngineOptions o;
  o.local_host = "::1";
  auto a = MakeEngine(o);
  auto b = MakeEngine(o);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(b->address().rfind("[::1]:", 0), 0u);
  std::vector<char> src = Pattern(10000, 5), dst(10000, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), src.size()};
  auto batch = a->Submit(*seg, {&w, 1});
  ASSERT_TRUE(batch.ok());
  EXPECT_TRUE(a->Wait(*batch, absl::Seconds(5))->ok());
  EXPECT_EQ(src, dst);
}

// An IPv6 host may be given in brackets, as the engine's own address()
// writes it.
TEST(TransferEngine, AnIpv6HostInBracketsIsTheSameHost) {
  EngineOptions o;
  o.local_host = "[::1]";
  o.bind_host = "[::1]";
  auto a = TransferEngine::Create(o);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->address().rfind("[::1]:", 0), 0u) << (*a)->address();
  EXPECT_EQ((*a)->detection().bind_host, "::1");
  o.local_host = "[::1";
  o.bind_host = "";
  auto bad = TransferEngine::Create(o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
}

// local_host "0.0.0.0" or "::" (what a server is often given): every
// interface is bound, and the address peers are told is a real one.
TEST(TransferEngine, AnUnspecifiedLocalHostBindsEverywhereAndAdvertisesARealAddress) {
  for (const char* any : {"0.0.0.0", "::"}) {
    EngineOptions o;
    o.local_host = any;
    o.transport = "tcp";
    auto a = TransferEngine::Create(o);
    if (!a.ok() && std::string(any) == "::") GTEST_SKIP() << "no IPv6: " << a.status();
    ASSERT_TRUE(a.ok()) << any << ": " << a.status();
    EXPECT_EQ((*a)->detection().bind_host, any);
    const std::string advertised = (*a)->address();
    EXPECT_NE(advertised.rfind("0.0.0.0:", 0), 0u) << advertised;
    EXPECT_NE(advertised.rfind("[::]:", 0), 0u) << advertised;
    auto b = MakeEngine();
    ASSERT_TRUE(b);
    std::vector<char> src = Pattern(4096, 3), dst(4096, 0);
    ASSERT_TRUE((*a)->RegisterMemory(dst.data(), dst.size()).ok());
    ASSERT_TRUE(b->RegisterMemory(src.data(), src.size()).ok());
    auto seg = b->OpenSegment(advertised);
    ASSERT_TRUE(seg.ok()) << advertised << ": " << seg.status();
    TransferRequest w{Opcode::kWrite, src.data(), Addr(dst), src.size()};
    auto batch = b->Submit(*seg, {&w, 1});
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_TRUE(b->Wait(*batch, absl::Seconds(5))->ok());
    EXPECT_EQ(src, dst);
  }
}

TEST(TransferEngine, BindsEveryInterfaceOnlyWhenAskedAndShowsPeerRegions) {
  EngineOptions all = Local();
  all.bind_host = "0.0.0.0";
  auto a = MakeEngine(all);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->detection().bind_host, "0.0.0.0");
  EXPECT_EQ(a->address().rfind("127.0.0.1:", 0), 0u);  // advertised, not 0.0.0.0
  auto b = MakeEngine();
  EXPECT_EQ(b->detection().bind_host, "127.0.0.1");
  std::vector<char> buf(8192);
  ASSERT_TRUE(a->RegisterMemory(buf.data(), 4096, transport::Access::kRemoteRead).ok());
  ASSERT_TRUE(a->RegisterMemory(buf.data() + 4096, 4096, transport::Access::kNone).ok());
  auto seg = b->OpenSegment(a->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  auto regions = b->SegmentRegions(*seg);
  ASSERT_TRUE(regions.ok());
  ASSERT_EQ(regions->size(), 1u);  // the private region is not advertised
  EXPECT_EQ((*regions)[0].addr, Addr(buf));
  EXPECT_EQ((*regions)[0].length, 4096u);
  EXPECT_EQ((*regions)[0].access, transport::Access::kRemoteRead);
  EXPECT_EQ(b->SegmentRegions(999).status().code(), absl::StatusCode::kNotFound);
}

TEST(TransferEngine, MetadataIsPublishedAndFetchedByPeers) {
  auto a = MakeEngine();
  auto b = MakeEngine();
  ASSERT_TRUE(b->PublishMetadata("kv_pool", "layout-v1").ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  auto v = a->FetchMetadata(*seg, "kv_pool");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "layout-v1");
  ASSERT_TRUE(b->PublishMetadata("kv_pool", "layout-v2").ok());
  EXPECT_EQ(*a->FetchMetadata(*seg, "kv_pool"), "layout-v2");
  auto missing = a->FetchMetadata(*seg, "nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
  EXPECT_EQ(b->PublishMetadata("", "x").code(), absl::StatusCode::kInvalidArgument);
}

// CloseSegment, idle segments, slices beyond the links' limit and threads
// waiting on their own batches: engine/testing/engine_conformance.cc, on
// every transport.

// Inside the Soft-RoCE VM: an engine with RDMA (and TCP beside it) and an
// engine limited to TCP move data both ways over TCP, while two RDMA engines
// use RDMA; each says which transport it chose and why. Skipped on hosts
// without an RDMA port.
TEST(TransferEngine, EachPeerGoesOverTheBestTransportBothEndsHave) {
  auto rdma = MakeEngine();
  ASSERT_TRUE(rdma);
  if (rdma->detection().transport != "rdma") GTEST_SKIP() << "no RDMA port on this host";
  EngineOptions tcp_only = Local();
  tcp_only.transport = "tcp";
  auto tcp = MakeEngine(tcp_only);
  auto rdma2 = MakeEngine();
  ASSERT_TRUE(tcp && rdma2);
  std::vector<char> a = Pattern(1 << 20, 11), b = Pattern(1 << 20, 12), c(1 << 20, 0);
  ASSERT_TRUE(rdma->RegisterMemory(a.data(), a.size()).ok());
  ASSERT_TRUE(tcp->RegisterMemory(b.data(), b.size()).ok());
  ASSERT_TRUE(rdma2->RegisterMemory(c.data(), c.size()).ok());
  auto move = [](TransferEngine& from, TransferEngine& to, std::vector<char>& src,
                 std::vector<char>& dst, size_t off) {
    auto seg = from.OpenSegment(to.address());
    ASSERT_TRUE(seg.ok()) << seg.status();
    TransferRequest w{Opcode::kWrite, src.data() + off, Addr(dst, off), 256 << 10};
    auto batch = from.Submit(*seg, {&w, 1});
    ASSERT_TRUE(batch.ok()) << batch.status();
    auto st = from.Wait(*batch, absl::Seconds(30));
    ASSERT_TRUE(st.ok() && st->ok()) << (st.ok() ? st->requests[0] : st.status());
    ASSERT_EQ(std::memcmp(src.data() + off, dst.data() + off, 256 << 10), 0);
  };
  auto transport_to = [](TransferEngine& e, const std::string& peer) {
    for (const PeerMetrics& p : e.GetMetrics().peers) {
      if (p.peer == peer) return p.transport + " (" + p.transport_reason + ")";
    }
    return std::string("none");
  };
  move(*rdma, *tcp, a, b, 0);          // RDMA engine -> TCP-only engine
  move(*tcp, *rdma, b, a, 256 << 10);  // and back
  move(*rdma, *rdma2, a, c, 512 << 10);
  const std::string r_to_t = transport_to(*rdma, tcp->address());
  const std::string t_to_r = transport_to(*tcp, rdma->address());
  const std::string r_to_r = transport_to(*rdma, rdma2->address());
  EXPECT_EQ(r_to_t.rfind("tcp (", 0), 0u) << r_to_t;
  EXPECT_NE(r_to_t.find("primary transport is tcp"), std::string::npos) << r_to_t;
  EXPECT_EQ(t_to_r.rfind("tcp (", 0), 0u) << t_to_r;
  EXPECT_EQ(r_to_r.rfind("verbs (both ends have verbs)", 0), 0u) << r_to_r;
  std::printf("rdma -> tcp-only: %s\ntcp-only -> rdma: %s\nrdma -> rdma: %s\n", r_to_t.c_str(),
              t_to_r.c_str(), r_to_r.c_str());
}

// An engine holding two transports waits on both (their completion
// notifiers): here both are TCP, so every peer goes over the first, and
// batches from several threads finish as with one. (Which transport a peer
// gets when kinds differ: the test above, inside the Soft-RoCE VM.)
TEST(TransferEngine, AnEngineWithTwoTransportsWaitsOnBoth) {
  auto make = [](bool two) {
    EngineParts parts;
    transport::TcpTransportOptions t;
    t.bind_host = "127.0.0.1";
    t.in_process_shortcut = false;  // real sockets: completions from other threads
    parts.transport = *transport::CreateTcpTransport(t);
    if (two) parts.fallback = *transport::CreateTcpTransport(t);
    parts.network = handshake::NewTcpNetwork();
    parts.detection.host = "127.0.0.1";
    // The driver's liveness wake-ups 150 s apart: a completion the
    // notifiers failed to report would run the 20 s waits out.
    EngineOptions o = Local();
    o.peer_timeout = absl::Minutes(10);
    return std::move(*TransferEngine::CreateWith(o, std::move(parts)));
  };
  auto a = make(true);
  auto b = make(false);
  EXPECT_EQ(a->GetNicCounters().size(), 2u);  // the first transport's NIC, then the second's
  std::vector<char> src = Pattern(1 << 20, 13), dst(1 << 20, 0), back(1 << 20, 0);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(a->RegisterMemory(back.data(), back.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto to_b = a->OpenSegment(b->address());
  auto to_a = b->OpenSegment(a->address());
  ASSERT_TRUE(to_b.ok() && to_a.ok());
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const size_t off = t * (256 << 10);
      TransferRequest w{Opcode::kWrite, src.data() + off, Addr(dst, off), 256 << 10};
      auto batch = a->Submit(*to_b, {&w, 1});
      absl::StatusOr<BatchStatus> st = batch.ok() ? a->Wait(*batch, absl::Seconds(20))
                                                  : absl::StatusOr<BatchStatus>(batch.status());
      results[t] = !st.ok() ? st.status() : st->ok() ? absl::OkStatus() : st->requests[0];
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& r : results) EXPECT_TRUE(r.ok()) << r;
  EXPECT_EQ(src, dst);
  // b writes into a's second region: a's descriptor for b is its first transport's.
  TransferRequest w{Opcode::kWrite, dst.data(), Addr(back), back.size()};
  auto batch = b->Submit(*to_a, {&w, 1});
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_TRUE(b->Wait(*batch, absl::Seconds(20))->ok());
  EXPECT_EQ(back, src);
  EXPECT_EQ(a->GetMetrics().peers[0].transport, "tcp");
}

// Memory larger than a transport's largest region (a NIC's max_mr_size) is
// registered in pieces, each its own region in the descriptor; requests
// across piece boundaries, local and remote (here of different sizes), are
// cut there and move every byte.
TEST(TransferEngine, MemoryLargerThanATransportsLargestRegionGoesInPieces) {
  auto make = [](uint64_t max_region, bool shortcut) {
    EngineParts parts;
    transport::TcpTransportOptions t;
    t.bind_host = "127.0.0.1";
    t.in_process_shortcut = shortcut;
    t.max_region_bytes = max_region;
    parts.transport = *transport::CreateTcpTransport(t);
    parts.network = handshake::NewTcpNetwork();
    parts.detection.host = "127.0.0.1";
    return std::move(*TransferEngine::CreateWith(Local(), std::move(parts)));
  };
  for (bool shortcut : {false, true}) {
    SCOPED_TRACE(shortcut ? "in-process shortcut" : "sockets");
    auto a = make(1 << 20, shortcut);
    auto b = make(768 << 10, shortcut);
    const size_t n = (5 << 20) + 1000;
    std::vector<char> src = Pattern(n, 29), dst(n, 0), back(n, 0);
    ASSERT_TRUE(a->RegisterMemory(src.data(), n).ok());
    ASSERT_TRUE(a->RegisterMemory(back.data(), n).ok());
    ASSERT_TRUE(b->RegisterMemory(dst.data(), n, transport::Access::kRemoteReadWrite).ok());
    auto to_b = a->OpenSegment(b->address());
    ASSERT_TRUE(to_b.ok()) << to_b.status();
    auto regions = a->SegmentRegions(*to_b);
    ASSERT_TRUE(regions.ok());
    EXPECT_EQ(regions->size(), (n + (768 << 10) - 1) / (768 << 10));  // b's pieces
    // The whole buffer in one request, and one from inside a piece of each.
    TransferRequest whole{Opcode::kWrite, src.data(), Addr(dst), n};
    auto batch = a->Submit(*to_b, {&whole, 1});
    ASSERT_TRUE(batch.ok()) << batch.status();
    auto st = a->Wait(*batch, absl::Seconds(20));
    ASSERT_TRUE(st.ok() && st->ok()) << (st.ok() ? st->requests[0] : st.status());
    EXPECT_TRUE(dst == src);
    const size_t off = (1 << 20) - 333, len = 3 << 20;
    TransferRequest read{Opcode::kRead, back.data() + off, Addr(dst, off), len};
    batch = a->Submit(*to_b, {&read, 1});
    ASSERT_TRUE(batch.ok()) << batch.status();
    st = a->Wait(*batch, absl::Seconds(20));
    ASSERT_TRUE(st.ok() && st->ok()) << (st.ok() ? st->requests[0] : st.status());
    EXPECT_TRUE(std::equal(back.begin() + off, back.begin() + off + len, src.begin() + off));
    EXPECT_EQ(back[off - 1], 0);
    EXPECT_EQ(back[off + len], 0);
    // Unregistered: every piece goes, on both ends.
    ASSERT_TRUE(a->UnregisterMemory(src.data()).ok());
    EXPECT_EQ(a->Submit(*to_b, {&whole, 1}).status().code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(a->RegisterMemory(src.data() + 4096, 1 << 20).ok());  // nothing left over
    ASSERT_TRUE(b->UnregisterMemory(dst.data()).ok());
    TransferRequest again{Opcode::kWrite, src.data() + 4096, Addr(dst), 4096};
    // a's cached descriptor still lists b's pieces: b refuses the WRITE.
    auto refused = a->Submit(*to_b, {&again, 1});
    if (refused.ok()) {
      auto done = a->Wait(*refused, absl::Seconds(20));
      ASSERT_TRUE(done.ok()) << done.status();
      EXPECT_FALSE(done->requests[0].ok());
    }
  }
}

TEST(TransferEngine, BadOptionsAndRegistrations) {
  EngineOptions o = Local();
  o.transport = "carrier-pigeon";
  EXPECT_EQ(TransferEngine::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.transport = "rdma";
  if (std::getenv("KVFERRY_REQUIRE_RDMA") == nullptr) {  // a host without RDMA
    auto rdma = TransferEngine::Create(o);
    EXPECT_EQ(rdma.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(rdma.status().message().find("//tools:devices"), std::string::npos);
  }
  o.transport = "auto";
  o.devices = {"no_such_nic0"};
  EXPECT_EQ(TransferEngine::Create(o).status().code(), absl::StatusCode::kNotFound);
  o = Local();
  o.links_per_peer = 65;
  EXPECT_EQ(TransferEngine::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  auto e = MakeEngine();
  std::vector<char> buf(4096);
  EXPECT_EQ(e->RegisterMemory(nullptr, 10).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(e->RegisterMemory(buf.data(), 4096).ok());
  EXPECT_EQ(e->RegisterMemory(buf.data() + 100, 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->UnregisterMemory(buf.data() + 1).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(e->UnregisterMemory(buf.data()).ok());
  EXPECT_TRUE(e->RegisterMemory(buf.data() + 100, 10).ok());
}

}  // namespace
}  // namespace kvferry
