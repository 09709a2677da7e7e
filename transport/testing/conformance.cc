#include "transport/testing/conformance.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cuda/driver.h"
#include "sim/prng.h"
#include "transport/in_process.h"
#include "transport/stream_links.h"

namespace kvferry {
namespace transport {
namespace testing {

std::string ConformanceParamName(const ::testing::TestParamInfo<ConformanceParam>& info) {
  return info.param.name;
}

void TransportConformanceTest::SetUp() {
  harness_ = GetParam().make();
  ASSERT_NE(harness_, nullptr);
  std::string skip = harness_->SkipReason();
  if (!skip.empty()) GTEST_SKIP() << skip;
}

absl::StatusOr<std::pair<LinkId, LinkId>> TransportConformanceTest::Connect(Transport& a,
                                                                            Transport& b,
                                                                            NicIndex na,
                                                                            NicIndex nb) {
  return ConnectInProcess(a, b, na, nb);
}

TransportConformanceTest::Pair TransportConformanceTest::MakePair() {
  Pair p;
  auto a = harness_->NewTransport();
  auto b = harness_->NewTransport();
  EXPECT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(b.ok()) << b.status();
  if (!a.ok() || !b.ok()) return p;
  p.a = std::move(*a);
  p.b = std::move(*b);
  auto links = Connect(*p.a, *p.b);
  EXPECT_TRUE(links.ok()) << links.status();
  if (links.ok()) std::tie(p.link_a, p.link_b) = *links;
  return p;
}

TransportConformanceTest::DeviceCopy::~DeviceCopy() {
  if (base != nullptr) (void)cuda::Driver::Get()->FreeDevice(base, ordinal);
}

void TransportConformanceTest::RefreshDeviceBuffers() {
  for (const std::weak_ptr<DeviceCopy>& w : device_buffers_) {
    if (std::shared_ptr<DeviceCopy> d = w.lock()) {
      EXPECT_TRUE(cuda::Driver::Get()->Copy(d->mirror, d->base, d->length, d->ordinal).ok());
    }
  }
}

TransportConformanceTest::Buffer TransportConformanceTest::MakeBuffer(Transport& t, size_t size,
                                                                      uint64_t seed,
                                                                      Access access) {
  Buffer buf;
  buf.guard = 64;
  buf.bytes.resize(size + 2 * buf.guard);
  sim::Prng prng(seed);
  for (size_t i = 0; i < buf.bytes.size(); i += 8) {
    const uint64_t word = prng.Next64();
    std::memcpy(buf.bytes.data() + i, &word, std::min<size_t>(8, buf.bytes.size() - i));
  }
  auto owner = std::find(buffer_owners_.begin(), buffer_owners_.end(), &t);
  if (owner == buffer_owners_.end()) owner = buffer_owners_.insert(owner, &t);
  const int ordinal = harness_->BufferDevice(static_cast<int>(owner - buffer_owners_.begin()));
  if (ordinal >= 0) {
    const cuda::Driver* driver = cuda::Driver::Get();
    auto copy = std::make_shared<DeviceCopy>();
    absl::StatusOr<void*> mem = driver == nullptr ? absl::UnavailableError("no CUDA driver")
                                                  : driver->AllocDevice(ordinal, buf.bytes.size());
    EXPECT_TRUE(mem.ok()) << mem.status();
    if (mem.ok()) {
      copy->base = static_cast<uint8_t*>(*mem);
      copy->ordinal = ordinal;
      copy->mirror = buf.bytes.data();
      copy->length = buf.bytes.size();
      EXPECT_TRUE(driver->Copy(copy->base, buf.bytes.data(), buf.bytes.size(), ordinal).ok());
      buf.device = copy;
      device_buffers_.push_back(copy);
    }
  }
  absl::StatusOr<Region> region = t.RegisterMemory(buf.addr(), size, access);
  EXPECT_TRUE(region.ok()) << region.status();
  if (region.ok()) buf.region = *region;
  return buf;
}

std::vector<Completion> TransportConformanceTest::WaitFor(Transport& t, size_t count,
                                                          absl::Duration timeout) {
  std::vector<Completion> got;
  Clock* clock = harness_->clock();
  const absl::Time deadline = clock->Now() + timeout;
  Completion batch[64];
  while (got.size() < count) {
    const absl::Duration left = deadline - clock->Now();
    if (left <= absl::ZeroDuration()) break;
    size_t n = t.WaitCompletions(absl::MakeSpan(batch), left);
    for (size_t i = 0; i < n; ++i) got.push_back(std::move(batch[i]));
  }
  RefreshDeviceBuffers();
  return got;
}

absl::Status TransportConformanceTest::RunOne(Transport& t, const WorkRequest& wr) {
  absl::Status posted = t.Post({&wr, 1});
  if (!posted.ok()) return posted;
  std::vector<Completion> c = WaitFor(t, 1);
  if (c.size() != 1) return absl::DeadlineExceededError("no completion");
  EXPECT_EQ(c[0].cookie, wr.cookie);
  return c[0].status;
}

WorkRequest TransportConformanceTest::Write(LinkId link, Buffer& src, size_t src_off,
                                            const Buffer& dst, size_t dst_off, size_t len,
                                            NicIndex dst_nic, uint64_t cookie) {
  WorkRequest wr;
  wr.opcode = Opcode::kWrite;
  wr.link = link;
  wr.local_region = src.region.id;
  wr.local_addr = src.addr() + src_off;
  wr.length = len;
  wr.remote_addr = dst.region.addr + dst_off;
  wr.remote_key = dst.region.keys.empty() ? 0 : dst.region.keys[dst_nic];
  wr.cookie = cookie;
  return wr;
}

WorkRequest TransportConformanceTest::Read(LinkId link, Buffer& dst, size_t dst_off,
                                           const Buffer& src, size_t src_off, size_t len,
                                           NicIndex src_nic, uint64_t cookie) {
  WorkRequest wr = Write(link, dst, dst_off, src, src_off, len, src_nic, cookie);
  wr.opcode = Opcode::kRead;
  return wr;
}

namespace {

bool SameBytes(const uint8_t* a, const uint8_t* b, size_t n) { return std::memcmp(a, b, n) == 0; }

}  // namespace

// Binaries that link the suite only for its helpers need not instantiate it.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(TransportConformanceTest);

TEST_P(TransportConformanceTest, WriteMovesBytesAndNothingElse) {
  Pair p = MakePair();
  Buffer src = MakeBuffer(*p.a, 64 << 10, 1);
  Buffer dst = MakeBuffer(*p.b, 64 << 10, 2);
  const std::vector<uint8_t> before = dst.bytes;
  ASSERT_TRUE(RunOne(*p.a, Write(p.link_a, src, 0, dst, 0, 64 << 10)).ok());
  EXPECT_TRUE(SameBytes(dst.data(), src.data(), 64 << 10));
  // The guards around the destination region are untouched.
  EXPECT_TRUE(SameBytes(dst.bytes.data(), before.data(), dst.guard));
  EXPECT_TRUE(
      SameBytes(dst.data() + dst.size(), before.data() + dst.guard + dst.size(), dst.guard));
}

// InterruptWait ends a thread's wait in WaitCompletions at once; with no
// thread waiting, it ends the next wait (once).
TEST_P(TransportConformanceTest, InterruptWaitEndsAWait) {
  Pair p = MakePair();
  std::vector<Completion> out(4);
  p.a->InterruptWait();
  const absl::Time start = absl::Now();
  EXPECT_EQ(p.a->WaitCompletions(absl::MakeSpan(out), absl::Seconds(60)), 0u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  // Used up: the next wait runs its course (on the transport's clock).
  const absl::Time before = harness_->clock()->Now();
  EXPECT_EQ(p.a->WaitCompletions(absl::MakeSpan(out), absl::Milliseconds(100)), 0u);
  EXPECT_GE(harness_->clock()->Now() - before, absl::Milliseconds(90));
  // A thread already waiting.
  std::atomic<size_t> got{99};
  const absl::Time waiting = absl::Now();
  std::thread waiter([&] { got = p.a->WaitCompletions(absl::MakeSpan(out), absl::Seconds(60)); });
  absl::SleepFor(absl::Milliseconds(50));
  p.a->InterruptWait();
  waiter.join();
  EXPECT_EQ(got.load(), 0u);
  EXPECT_LT(absl::Now() - waiting, absl::Seconds(20));
}

TEST_P(TransportConformanceTest, ReadMovesBytes) {
  Pair p = MakePair();
  Buffer local = MakeBuffer(*p.a, 32 << 10, 3);
  Buffer remote = MakeBuffer(*p.b, 32 << 10, 4);
  const std::vector<uint8_t> remote_before = remote.bytes;
  ASSERT_TRUE(RunOne(*p.a, Read(p.link_a, local, 0, remote, 0, 32 << 10)).ok());
  EXPECT_TRUE(SameBytes(local.data(), remote.data(), 32 << 10));
  EXPECT_EQ(remote.bytes, remote_before);  // a READ changes nothing remote
}

TEST_P(TransportConformanceTest, BothEndsOfALinkCanPost) {
  Pair p = MakePair();
  Buffer a_buf = MakeBuffer(*p.a, 4096, 5);
  Buffer b_buf = MakeBuffer(*p.b, 4096, 6);
  ASSERT_TRUE(RunOne(*p.b, Write(p.link_b, b_buf, 0, a_buf, 0, 1000)).ok());
  EXPECT_TRUE(SameBytes(a_buf.data(), b_buf.data(), 1000));
}

TEST_P(TransportConformanceTest, ZeroLengthCompletesAndTouchesNothing) {
  Pair p = MakePair();
  Buffer src = MakeBuffer(*p.a, 128, 7);
  Buffer dst = MakeBuffer(*p.b, 128, 8);
  const std::vector<uint8_t> src_before = src.bytes, dst_before = dst.bytes;
  EXPECT_TRUE(RunOne(*p.a, Write(p.link_a, src, 0, dst, 0, 0)).ok());
  EXPECT_TRUE(RunOne(*p.a, Read(p.link_a, src, 0, dst, 0, 0)).ok());
  EXPECT_EQ(src.bytes, src_before);
  EXPECT_EQ(dst.bytes, dst_before);
}

TEST_P(TransportConformanceTest, UnalignedOffsetsAndLengths) {
  Pair p = MakePair();
  Buffer src = MakeBuffer(*p.a, 10000, 9);
  Buffer dst = MakeBuffer(*p.b, 10000, 10);
  std::vector<uint8_t> expect(dst.data(), dst.data() + dst.size());
  struct Case {
    size_t src_off, dst_off, len;
  };
  const Case cases[] = {{3, 7, 1001}, {1, 4095, 1}, {9999, 0, 1}, {13, 5000, 4997}};
  for (const Case& c : cases) {
    ASSERT_TRUE(RunOne(*p.a, Write(p.link_a, src, c.src_off, dst, c.dst_off, c.len)).ok());
    std::memcpy(expect.data() + c.dst_off, src.data() + c.src_off, c.len);
  }
  EXPECT_TRUE(SameBytes(dst.data(), expect.data(), dst.size()));
  // And back the other way, into an odd local offset.
  ASSERT_TRUE(RunOne(*p.a, Read(p.link_a, src, 5, dst, 4093, 777)).ok());
  EXPECT_TRUE(SameBytes(src.data() + 5, dst.data() + 4093, 777));
}

TEST_P(TransportConformanceTest, ManyOutstandingCompleteExactlyOnce) {
  Pair p = MakePair();
  const uint32_t limit = p.a->GetLimits().max_outstanding_per_link;
  const size_t count = std::min<size_t>(500, limit);
  const size_t chunk = 4096;
  Buffer src = MakeBuffer(*p.a, count * chunk, 11);
  Buffer dst = MakeBuffer(*p.b, count * chunk, 12);
  // Posted in batches of varying size, alternating WRITE targets.
  std::vector<WorkRequest> batch;
  size_t posted = 0;
  while (posted < count) {
    batch.clear();
    const size_t n = std::min<size_t>(1 + posted % 37, count - posted);
    for (size_t i = 0; i < n; ++i, ++posted) {
      batch.push_back(
          Write(p.link_a, src, posted * chunk, dst, posted * chunk, chunk, 0, 1000 + posted));
    }
    ASSERT_TRUE(p.a->Post(batch).ok());
  }
  std::vector<Completion> done = WaitFor(*p.a, count);
  ASSERT_EQ(done.size(), count);
  std::set<uint64_t> cookies;
  for (const Completion& c : done) {
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_TRUE(cookies.insert(c.cookie).second) << "duplicate " << c.cookie;
    EXPECT_GE(c.cookie, 1000u);
    EXPECT_LT(c.cookie, 1000u + count);
  }
  EXPECT_TRUE(SameBytes(dst.data(), src.data(), count * chunk));
  // Nothing more arrives: each request completed exactly once.
  Completion extra[4];
  EXPECT_EQ(p.a->PollCompletions(absl::MakeSpan(extra)), 0u);
  EXPECT_EQ(p.a->WaitCompletions(absl::MakeSpan(extra), absl::Milliseconds(50)), 0u);
}

TEST_P(TransportConformanceTest, LargeWriteAndRead) {
  Pair p = MakePair();
  const size_t size = std::min<uint64_t>(32 << 20, p.a->GetLimits().max_request_bytes);
  Buffer src = MakeBuffer(*p.a, size, 13);
  Buffer dst = MakeBuffer(*p.b, size, 14);
  ASSERT_TRUE(RunOne(*p.a, Write(p.link_a, src, 0, dst, 0, size)).ok());
  EXPECT_TRUE(SameBytes(dst.data(), src.data(), size));
  Buffer back = MakeBuffer(*p.a, size, 15);
  ASSERT_TRUE(RunOne(*p.a, Read(p.link_a, back, 0, dst, 0, size)).ok());
  EXPECT_TRUE(SameBytes(back.data(), src.data(), size));
}

TEST_P(TransportConformanceTest, WrongKeyIsRejectedAndTargetUntouched) {
  Pair p = MakePair();
  Buffer src = MakeBuffer(*p.a, 4096, 16);
  Buffer dst = MakeBuffer(*p.b, 4096, 17);
  const std::vector<uint8_t> before = dst.bytes;
  WorkRequest wr = Write(p.link_a, src, 0, dst, 0, 4096);
  wr.remote_key ^= 0x5a5a;
  EXPECT_EQ(RunOne(*p.a, wr).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(dst.bytes, before);
}

// A wrong key inside a batch fails that request with kPermissionDenied and
// no other: requests before it on the link complete, the ones after it are
// flushed (kAborted) or complete, and another link is not disturbed.
TEST_P(TransportConformanceTest, WrongKeyInABatchFailsThatRequestOnly) {
  Pair p = MakePair();
  auto second = Connect(*p.a, *p.b);
  ASSERT_TRUE(second.ok()) << second.status();
  const size_t kCount = 8, kBad = 3, kBlock = 4096;
  Buffer src = MakeBuffer(*p.a, (kCount + 1) * kBlock, 18);
  Buffer dst = MakeBuffer(*p.b, (kCount + 1) * kBlock, 19);
  const std::vector<uint8_t> before = dst.bytes;
  std::vector<WorkRequest> batch;
  for (size_t i = 0; i < kCount; ++i) {
    batch.push_back(Write(p.link_a, src, i * kBlock, dst, i * kBlock, kBlock, 0, i));
  }
  batch[kBad].remote_key ^= 0x5a5a;
  ASSERT_TRUE(p.a->Post(batch).ok());
  WorkRequest other =
      Write(second->first, src, kCount * kBlock, dst, kCount * kBlock, kBlock, 0, 100);
  ASSERT_TRUE(p.a->Post({&other, 1}).ok());
  std::vector<Completion> c = WaitFor(*p.a, kCount + 1);
  ASSERT_EQ(c.size(), kCount + 1);
  size_t denied = 0;
  for (const Completion& done : c) {
    const size_t i = done.cookie;
    if (i == 100) {
      EXPECT_TRUE(done.status.ok()) << "the other link was disturbed: " << done.status;
      EXPECT_TRUE(SameBytes(dst.data() + kCount * kBlock, src.data() + kCount * kBlock, kBlock));
      continue;
    }
    ASSERT_LT(i, kCount);
    if (i == kBad) {
      EXPECT_EQ(done.status.code(), absl::StatusCode::kPermissionDenied) << done.status;
      ++denied;
      EXPECT_TRUE(
          SameBytes(dst.data() + i * kBlock, before.data() + dst.guard + i * kBlock, kBlock))
          << "the rejected write landed";
    } else if (done.status.ok()) {
      EXPECT_TRUE(SameBytes(dst.data() + i * kBlock, src.data() + i * kBlock, kBlock)) << i;
    } else {
      EXPECT_EQ(done.status.code(), absl::StatusCode::kAborted)
          << "request " << i << " got the error of request " << kBad << ": " << done.status;
      EXPECT_GT(i, kBad) << "a request posted before the bad one was flushed";
    }
  }
  EXPECT_EQ(denied, 1u);
}

TEST_P(TransportConformanceTest, OutOfBoundsIsRejectedAndTargetUntouched) {
  struct Case {
    size_t off, len;
  };
  // One byte past the end, from the start and from the last byte.
  for (Case c : {Case{1, 4096}, Case{4095, 2}}) {
    Pair p = MakePair();
    Buffer src = MakeBuffer(*p.a, 8192, 18);
    Buffer dst = MakeBuffer(*p.b, 4096, 19);
    const std::vector<uint8_t> before = dst.bytes;
    EXPECT_EQ(RunOne(*p.a, Write(p.link_a, src, 0, dst, c.off, c.len)).code(),
              absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(dst.bytes, before);
  }
  {
    Pair p = MakePair();
    Buffer src = MakeBuffer(*p.a, 4096, 20);
    Buffer dst = MakeBuffer(*p.b, 4096, 21);
    const std::vector<uint8_t> before = dst.bytes;
    WorkRequest wr = Write(p.link_a, src, 0, dst, 0, 16);
    wr.remote_addr = dst.region.addr - 8;  // starts before the region
    EXPECT_EQ(RunOne(*p.a, wr).code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(dst.bytes, before);
  }
  {
    // A READ past the end leaves the local buffer as it was.
    Pair p = MakePair();
    Buffer local = MakeBuffer(*p.a, 4096, 22);
    Buffer remote = MakeBuffer(*p.b, 4096, 23);
    const std::vector<uint8_t> before = local.bytes;
    EXPECT_EQ(RunOne(*p.a, Read(p.link_a, local, 0, remote, 100, 4000)).code(),
              absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(local.bytes, before);
  }
}

TEST_P(TransportConformanceTest, AccessRightsAreEnforced) {
  Pair p = MakePair();
  Buffer src = MakeBuffer(*p.a, 4096, 24);
  Buffer read_only = MakeBuffer(*p.b, 4096, 25, Access::kRemoteRead);
  const std::vector<uint8_t> before = read_only.bytes;
  EXPECT_EQ(RunOne(*p.a, Write(p.link_a, src, 0, read_only, 0, 64)).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(read_only.bytes, before);

  // The link failed with the error; a fresh link reads the region fine.
  auto links = Connect(*p.a, *p.b);
  ASSERT_TRUE(links.ok()) << links.status();
  ASSERT_TRUE(RunOne(*p.a, Read(links->first, src, 0, read_only, 0, 64)).ok());
  EXPECT_TRUE(SameBytes(src.data(), read_only.data(), 64));

  Buffer write_only = MakeBuffer(*p.b, 4096, 26, Access::kRemoteWrite);
  Buffer local = MakeBuffer(*p.a, 4096, 27);
  const std::vector<uint8_t> local_before = local.bytes;
  EXPECT_EQ(RunOne(*p.a, Read(links->first, local, 0, write_only, 0, 64)).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(local.bytes, local_before);

  Buffer private_region = MakeBuffer(*p.b, 4096, 28, Access::kNone);
  auto links2 = Connect(*p.a, *p.b);
  ASSERT_TRUE(links2.ok());
  EXPECT_EQ(RunOne(*p.a, Read(links2->first, local, 0, private_region, 0, 64)).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_P(TransportConformanceTest, DeregisteredRegionIsRejected) {
  Pair p = MakePair();
  Buffer src = MakeBuffer(*p.a, 4096, 29);
  Buffer dst = MakeBuffer(*p.b, 4096, 30);
  ASSERT_TRUE(RunOne(*p.a, Write(p.link_a, src, 0, dst, 0, 16)).ok());
  ASSERT_TRUE(p.b->UnregisterMemory(dst.region.id).ok());
  const std::vector<uint8_t> before = dst.bytes;
  EXPECT_EQ(RunOne(*p.a, Write(p.link_a, src, 16, dst, 16, 64)).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(dst.bytes, before);
  EXPECT_EQ(p.b->UnregisterMemory(dst.region.id).code(), absl::StatusCode::kNotFound);
}

TEST_P(TransportConformanceTest, ErrorPutsLinkInErrorStateOthersKeepWorking) {
  Pair p = MakePair();
  auto second = Connect(*p.a, *p.b);
  ASSERT_TRUE(second.ok());
  Buffer src = MakeBuffer(*p.a, 4096, 31);
  Buffer dst = MakeBuffer(*p.b, 4096, 32);
  WorkRequest bad = Write(p.link_a, src, 0, dst, 0, 64);
  bad.remote_key ^= 1;
  EXPECT_EQ(RunOne(*p.a, bad).code(), absl::StatusCode::kPermissionDenied);
  WorkRequest good = Write(p.link_a, src, 0, dst, 0, 64);
  EXPECT_EQ(p.a->Post({&good, 1}).code(), absl::StatusCode::kFailedPrecondition);
  good.link = second->first;
  EXPECT_TRUE(RunOne(*p.a, good).ok());
  EXPECT_TRUE(SameBytes(dst.data(), src.data(), 64));
  EXPECT_TRUE(p.a->CloseLink(p.link_a).ok());
  EXPECT_EQ(p.a->CloseLink(p.link_a).code(), absl::StatusCode::kNotFound);
}

TEST_P(TransportConformanceTest, PostValidatesLocallyAllOrNothing) {
  Pair p = MakePair();
  Buffer src = MakeBuffer(*p.a, 4096, 33);
  Buffer dst = MakeBuffer(*p.b, 4096, 34);
  const std::vector<uint8_t> before = dst.bytes;
  WorkRequest ok = Write(p.link_a, src, 0, dst, 0, 64, 0, 1);
  WorkRequest outside = Write(p.link_a, src, 4090, dst, 0, 64, 0, 2);
  WorkRequest no_link = Write(p.link_a + 1000, src, 0, dst, 0, 64, 0, 3);
  WorkRequest no_region = ok;
  no_region.local_region += 1000;
  for (const WorkRequest& bad : {outside, no_link, no_region}) {
    std::vector<WorkRequest> batch = {ok, bad};
    EXPECT_EQ(p.a->Post(batch).code(), absl::StatusCode::kInvalidArgument);
  }
  // Nothing of the refused batches ran.
  Completion c[4];
  EXPECT_EQ(p.a->WaitCompletions(absl::MakeSpan(c), absl::Milliseconds(50)), 0u);
  EXPECT_EQ(dst.bytes, before);
  // Too many at once for one link.
  const uint32_t limit = p.a->GetLimits().max_outstanding_per_link;
  std::vector<WorkRequest> flood(limit + 1, ok);
  EXPECT_EQ(p.a->Post(flood).code(), absl::StatusCode::kResourceExhausted);
  // The transport is still usable.
  EXPECT_TRUE(RunOne(*p.a, ok).ok());
}

TEST_P(TransportConformanceTest, LinkSetupValidatesInput) {
  auto a = harness_->NewTransport();
  auto b = harness_->NewTransport();
  ASSERT_TRUE(a.ok() && b.ok());
  const EndpointDescription eb = (*b)->LocalEndpoint();
  ASSERT_FALSE(eb.nics.empty());
  EXPECT_FALSE(eb.kind.empty());
  EXPECT_EQ((*a)->CreateLink(999, eb.nics[0]).status().code(), absl::StatusCode::kInvalidArgument);
  NicInfo bogus = eb.nics[0];
  bogus.address = "definitely not an address";
  EXPECT_EQ((*a)->CreateLink(0, bogus).status().code(), absl::StatusCode::kInvalidArgument);
  auto offer = (*a)->CreateLink(0, eb.nics[0]);
  ASSERT_TRUE(offer.ok());
  EXPECT_EQ((*b)->AcceptLink(0, (*a)->LocalEndpoint().nics[0], "garbage").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*a)->CompleteLink(offer->link, "garbage").code(), absl::StatusCode::kInvalidArgument);
  // A link that is not complete refuses requests.
  Buffer src = MakeBuffer(**a, 64, 35);
  WorkRequest wr;
  wr.link = offer->link;
  wr.local_region = src.region.id;
  wr.local_addr = src.addr();
  wr.length = 8;
  EXPECT_EQ((*a)->Post({&wr, 1}).code(), absl::StatusCode::kFailedPrecondition);
}

// A link offered before the peer NIC is known (StreamLinks::OfferLink),
// accepted by the peer before it is connected (ConnectOffered), then
// completed: it moves bytes like any other. Refuses what is out of order.
// Transports without the extension skip.
TEST_P(TransportConformanceTest, OfferedLinksAcceptedBeforeTheyConnectCarryData) {
  auto a = harness_->NewTransport();
  auto b = harness_->NewTransport();
  ASSERT_TRUE(a.ok() && b.ok());
  StreamLinks* streams = ExtensionOf<StreamLinks>(a->get());
  if (streams == nullptr) {
    EXPECT_EQ((*a)->QueryExtension("no.such.extension"), nullptr);
    GTEST_SKIP() << "this transport's links are not stream connections";
  }
  EXPECT_EQ((*a)->QueryExtension("no.such.extension"), nullptr);
  absl::StatusOr<LinkOffer> offer = streams->OfferLink(0);
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_EQ(streams->OfferLink(999).status().code(), absl::StatusCode::kInvalidArgument);
  // Not connected yet: it cannot complete.
  EXPECT_EQ((*a)->CompleteLink(offer->link, "whatever").code(),
            absl::StatusCode::kFailedPrecondition);
  auto accepted = (*b)->AcceptLink(0, (*a)->LocalEndpoint().nics[0], offer->params);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  ASSERT_TRUE(streams->ConnectOffered(offer->link, (*b)->LocalEndpoint().nics[0]).ok());
  EXPECT_EQ(streams->ConnectOffered(offer->link, (*b)->LocalEndpoint().nics[0]).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*a)->CompleteLink(offer->link, accepted->params).ok());
  Buffer src = MakeBuffer(**a, 4096, 36);
  Buffer dst = MakeBuffer(**b, 4096, 37);
  ASSERT_TRUE(RunOne(**a, Write(offer->link, src, 0, dst, 0, 4096)).ok());
  EXPECT_TRUE(SameBytes(dst.data(), src.data(), 4096));
  // One offered and never connected closes cleanly.
  absl::StatusOr<LinkOffer> unused = streams->OfferLink(0);
  ASSERT_TRUE(unused.ok());
  EXPECT_TRUE((*a)->CloseLink(unused->link).ok());
}

TEST_P(TransportConformanceTest, RegistrationValidatesInput) {
  auto t = harness_->NewTransport();
  ASSERT_TRUE(t.ok());
  char byte = 0;
  EXPECT_EQ((*t)->RegisterMemory(nullptr, 64, Access::kRemoteReadWrite).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*t)->RegisterMemory(&byte, 0, Access::kRemoteReadWrite).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*t)->UnregisterMemory(424242).code(), absl::StatusCode::kNotFound);
  auto r = (*t)->RegisterMemory(&byte, 1, Access::kRemoteRead);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->keys.size(), (*t)->LocalEndpoint().nics.size());
  EXPECT_EQ(r->addr, reinterpret_cast<uintptr_t>(&byte));
  EXPECT_EQ(r->length, 1u);
  // Overlapping registrations are allowed and get their own keys.
  auto r2 = (*t)->RegisterMemory(&byte, 1, Access::kRemoteRead);
  ASSERT_TRUE(r2.ok());
  EXPECT_NE(r->id, r2->id);
  EXPECT_NE(r->keys[0], r2->keys[0]);
}

TEST_P(TransportConformanceTest, RegionInUseCannotBeUnregistered) {
  Pair p = MakePair();
  Buffer src = MakeBuffer(*p.a, 4096, 36);
  Buffer dst = MakeBuffer(*p.b, 4096, 37);
  WorkRequest wr = Write(p.link_a, src, 0, dst, 0, 4096);
  ASSERT_TRUE(p.a->Post({&wr, 1}).ok());
  // Outstanding until its completion is delivered.
  EXPECT_EQ(p.a->UnregisterMemory(src.region.id).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(WaitFor(*p.a, 1).size(), 1u);
  EXPECT_TRUE(p.a->UnregisterMemory(src.region.id).ok());
}

TEST_P(TransportConformanceTest, PeerGoneFailsRequestsInBoundedTime) {
  Pair p = MakePair();
  Buffer src = MakeBuffer(*p.a, 1 << 20, 38);
  Buffer dst = MakeBuffer(*p.b, 1 << 20, 39);
  ASSERT_TRUE(RunOne(*p.a, Write(p.link_a, src, 0, dst, 0, 4096)).ok());
  // The peer process goes away; its memory stays (as a crashed host's would
  // be unreachable) so a late write would be visible.
  const std::vector<uint8_t> before = dst.bytes;
  p.b.reset();
  WorkRequest wr = Write(p.link_a, src, 0, dst, 0, 4096, 0, 77);
  absl::Status posted = p.a->Post({&wr, 1});
  if (!posted.ok()) {
    // The transport already noticed (e.g. the connection closed): the link
    // is in the error state and says so.
    EXPECT_EQ(posted.code(), absl::StatusCode::kFailedPrecondition) << posted;
    EXPECT_EQ(dst.bytes, before);
    return;
  }
  const absl::Time start = harness_->clock()->Now();
  std::vector<Completion> c = WaitFor(*p.a, 1, harness_->PeerLossBound());
  ASSERT_EQ(c.size(), 1u) << "no completion within the peer-loss bound";
  EXPECT_LE(harness_->clock()->Now() - start, harness_->PeerLossBound());
  EXPECT_EQ(c[0].cookie, 77u);
  EXPECT_EQ(c[0].status.code(), absl::StatusCode::kUnavailable) << c[0].status;
  EXPECT_EQ(dst.bytes, before);
}

TEST_P(TransportConformanceTest, PeerGoneWithManyOutstandingEachCompletesOnce) {
  Pair p = MakePair();
  const size_t count = 64;
  Buffer src = MakeBuffer(*p.a, count * 4096, 40);
  Buffer dst = MakeBuffer(*p.b, count * 4096, 41);
  std::vector<WorkRequest> batch;
  for (size_t i = 0; i < count; ++i) {
    batch.push_back(Write(p.link_a, src, i * 4096, dst, i * 4096, 4096, 0, i));
  }
  ASSERT_TRUE(p.a->Post(batch).ok());
  p.b.reset();
  std::vector<Completion> c =
      WaitFor(*p.a, count, harness_->PeerLossBound() + harness_->OperationTimeout());
  ASSERT_EQ(c.size(), count);
  std::set<uint64_t> cookies;
  size_t failed = 0;
  for (const Completion& done : c) {
    EXPECT_TRUE(cookies.insert(done.cookie).second);
    if (!done.status.ok()) {
      ++failed;
      EXPECT_TRUE(done.status.code() == absl::StatusCode::kUnavailable ||
                  done.status.code() == absl::StatusCode::kAborted)
          << done.status;
    }
  }
  EXPECT_EQ(cookies.size(), count);
  Completion extra[4];
  EXPECT_EQ(p.a->WaitCompletions(absl::MakeSpan(extra), absl::Milliseconds(50)), 0u);
}

// The peer destroys its end of a link (its QP) while a batch is in flight:
// every request completes exactly once within the peer-loss bound, and a new
// link to the same peer works at once.
TEST_P(TransportConformanceTest, PeerClosesLinkMidBatchThenANewLinkWorks) {
  Pair p = MakePair();
  const size_t count = 64, block = 16384;
  Buffer src = MakeBuffer(*p.a, count * block, 44);
  Buffer dst = MakeBuffer(*p.b, count * block, 45);
  std::vector<WorkRequest> batch;
  for (size_t i = 0; i < count; ++i) {
    batch.push_back(Write(p.link_a, src, i * block, dst, i * block, block, 0, i));
  }
  ASSERT_TRUE(p.a->Post(batch).ok());
  ASSERT_TRUE(p.b->CloseLink(p.link_b).ok());
  const absl::Time start = harness_->clock()->Now();
  std::vector<Completion> c =
      WaitFor(*p.a, count, harness_->PeerLossBound() + harness_->OperationTimeout());
  ASSERT_EQ(c.size(), count) << "requests to a closed peer link never completed";
  EXPECT_LE(harness_->clock()->Now() - start,
            harness_->PeerLossBound() + harness_->OperationTimeout());
  std::set<uint64_t> cookies;
  for (const Completion& done : c) {
    EXPECT_TRUE(cookies.insert(done.cookie).second);
    EXPECT_TRUE(done.status.ok() || done.status.code() == absl::StatusCode::kUnavailable ||
                done.status.code() == absl::StatusCode::kAborted)
        << done.status;
    if (done.status.ok()) {
      EXPECT_TRUE(
          SameBytes(dst.data() + done.cookie * block, src.data() + done.cookie * block, block));
    }
  }
  // The next batch goes over a new link and succeeds.
  auto fresh = Connect(*p.a, *p.b);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  Buffer src2 = MakeBuffer(*p.a, count * block, 46);
  for (size_t i = 0; i < count; ++i) {
    batch[i] = Write(fresh->first, src2, i * block, dst, i * block, block, 0, 1000 + i);
  }
  ASSERT_TRUE(p.a->Post(batch).ok());
  c = WaitFor(*p.a, count);
  ASSERT_EQ(c.size(), count);
  for (const Completion& done : c) EXPECT_TRUE(done.status.ok()) << done.status;
  EXPECT_TRUE(SameBytes(dst.data(), src2.data(), count * block));
  (void)p.a->CloseLink(p.link_a);
}

TEST_P(TransportConformanceTest, CloseLinkCancelsOutstanding) {
  Pair p = MakePair();
  Buffer src = MakeBuffer(*p.a, 64 * 4096, 42);
  Buffer dst = MakeBuffer(*p.b, 64 * 4096, 43);
  std::vector<WorkRequest> batch;
  for (size_t i = 0; i < 64; ++i) {
    batch.push_back(Write(p.link_a, src, i * 4096, dst, i * 4096, 4096, 0, i));
  }
  ASSERT_TRUE(p.a->Post(batch).ok());
  ASSERT_TRUE(p.a->CloseLink(p.link_a).ok());
  std::vector<Completion> c = WaitFor(*p.a, 64);
  ASSERT_EQ(c.size(), 64u);
  for (const Completion& done : c) {
    EXPECT_TRUE(done.status.ok() || done.status.code() == absl::StatusCode::kCancelled)
        << done.status;
  }
  // Requests cancelled here may still be landing at the peer: its region is
  // safe to free only once the peer has unregistered it (which waits for
  // writes in progress).
  EXPECT_TRUE(p.b->UnregisterMemory(dst.region.id).ok());
}

}  // namespace testing
}  // namespace transport
}  // namespace kvferry
