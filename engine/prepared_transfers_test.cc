// Prepared transfers between two engines (TCP here; inside the Soft-RoCE VM
// over verbs): lists, index pairs, posts again and again, the notification
// after the data, and a peer that restarts or dies.
#include <atomic>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "engine/testing/local_engines.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace {

using testing_local::EphemeralPort;
using testing_local::Local;
using testing_local::MakeEngine;
using transport::Opcode;

void Fill(std::vector<char>* v, int seed) {
  for (size_t i = 0; i < v->size(); ++i) (*v)[i] = static_cast<char>(i * 131 + seed * 7 + (i >> 9));
}

uint64_t Addr(const std::vector<char>& v, size_t off = 0) {
  return reinterpret_cast<uintptr_t>(v.data()) + off;
}

// A pool of `blocks` blocks of `block` bytes as a list of its blocks.
std::vector<Descriptor> Blocks(const std::vector<char>& pool, size_t block) {
  std::vector<Descriptor> out;
  for (size_t off = 0; off + block <= pool.size(); off += block)
    out.push_back({Addr(pool, off), block});
  return out;
}

// Polls until the transfer is no longer in progress (or 30 s passed).
absl::StatusOr<XferState> Finish(PreparedTransfers& p, uint64_t xfer) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (;;) {
    absl::StatusOr<XferState> s = p.State(xfer);
    if (!s.ok() || *s != XferState::kInProgress || absl::Now() > deadline) return s;
    absl::SleepFor(absl::Microseconds(50));
  }
}

struct Pair {
  std::unique_ptr<TransferEngine> a, b;  // a initiates
  uint64_t segment = 0;
};

class PreparedTest : public ::testing::Test {
 protected:
  static constexpr size_t kBlock = 4096, kBlocks = 256;
  void SetUp() override {
    p_.a = MakeEngine();
    p_.b = MakeEngine();
    ASSERT_TRUE(p_.a && p_.b);
    local_.resize(kBlock * kBlocks);
    remote_.resize(kBlock * kBlocks);
    Fill(&local_, 1);
    Fill(&remote_, 2);
    ASSERT_TRUE(p_.a->RegisterMemory(local_.data(), local_.size()).ok());
    ASSERT_TRUE(
        p_.b->RegisterMemory(remote_.data(), remote_.size(), transport::Access::kRemoteReadWrite)
            .ok());
    auto seg = p_.a->OpenSegment(p_.b->address());
    ASSERT_TRUE(seg.ok()) << seg.status();
    p_.segment = *seg;
    auto l = prepared().PrepareLocal(Blocks(local_, kBlock));
    ASSERT_TRUE(l.ok()) << l.status();
    auto r = prepared().PrepareRemote(p_.segment, Blocks(remote_, kBlock));
    ASSERT_TRUE(r.ok()) << r.status();
    llist_ = *l;
    rlist_ = *r;
  }
  PreparedTransfers& prepared() { return p_.a->prepared(); }
  // Posts `x` (pairs li, ri) four times, checking the bytes and that each
  // post adds what the first added to the engine's counters.
  void PostCountsAsTheFirst(uint64_t x, const std::vector<int64_t>& li,
                            const std::vector<int64_t>& ri);
  // Posts (pairs li, ri) twice, unregisters the local pool (the next post
  // is refused, nothing sent), registers it again (the post works).
  void ChangeRegistrationBetweenPosts(const std::vector<int64_t>& li,
                                      const std::vector<int64_t>& ri);
  Pair p_;
  std::vector<char> local_, remote_;
  uint64_t llist_ = 0, rlist_ = 0;
};

TEST_F(PreparedTest, ListsAreStoredAsRunsAndChecked) {
  auto size = prepared().ListSize(llist_);
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(size->first, kBlocks);
  EXPECT_EQ(size->second, 1u);  // one run for the whole pool
  // Not registered here / not at the peer: kNotFound, naming the entry.
  std::vector<char> stray(kBlock);
  std::vector<Descriptor> bad = Blocks(local_, kBlock);
  bad[7] = {Addr(stray), kBlock};
  auto l = prepared().PrepareLocal(bad);
  EXPECT_EQ(l.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(l.status().message().find("entry 7"), std::string::npos) << l.status();
  std::vector<Descriptor> over = {{Addr(remote_, remote_.size() - 100), 200}};
  EXPECT_EQ(prepared().PrepareRemote(p_.segment, over).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(prepared().PrepareLocal({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(prepared().PrepareRemote(p_.segment + 999, over).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(PreparedTest, ScatteredPairsWriteAndReadEveryByteAndPostAgain) {
  // Block i of the local pool goes to block perm[i] at the peer.
  std::vector<int64_t> li(kBlocks), ri(kBlocks);
  std::iota(li.begin(), li.end(), 0);
  ri = li;
  std::shuffle(ri.begin(), ri.end(), std::mt19937(3));
  auto w = prepared().Make(Opcode::kWrite, llist_, li, rlist_, ri);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*prepared().State(*w), XferState::kNotPosted);
  EXPECT_EQ(prepared().Telemetry(*w).status().code(), absl::StatusCode::kFailedPrecondition);
  for (int round = 0; round < 3; ++round) {
    Fill(&local_, 10 + round);
    auto posted = prepared().Post(*w);
    ASSERT_TRUE(posted.ok()) << posted.status();
    ASSERT_EQ(*Finish(prepared(), *w), XferState::kDone) << "round " << round;
    EXPECT_EQ(*prepared().State(*w), XferState::kDone);  // sticky
    for (size_t i = 0; i < kBlocks; ++i) {
      ASSERT_EQ(std::memcmp(local_.data() + i * kBlock, remote_.data() + ri[i] * kBlock, kBlock), 0)
          << "round " << round << " block " << i;
    }
    auto t = prepared().Telemetry(*w);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->bytes, kBlock * kBlocks);
    EXPECT_GT(t->descriptors, kBlocks / 2);  // scattered: hardly any merge
    EXPECT_GE(t->transfer, t->post);
  }
  // Read back into the local pool, the other way round.
  std::fill(local_.begin(), local_.end(), 0);
  auto r = prepared().Make(Opcode::kRead, llist_, li, rlist_, ri);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(prepared().Post(*r).ok());
  ASSERT_EQ(*Finish(prepared(), *r), XferState::kDone);
  for (size_t i = 0; i < kBlocks; ++i) {
    ASSERT_EQ(std::memcmp(local_.data() + i * kBlock, remote_.data() + ri[i] * kBlock, kBlock), 0);
  }
  EXPECT_TRUE(prepared().Release(*w).ok());
  EXPECT_TRUE(prepared().Release(*r).ok());
  EXPECT_EQ(prepared().State(*w).status().code(), absl::StatusCode::kNotFound);
}

// A thread remembers the transfer it found last (no agent-wide lock for a
// serving loop that posts and polls one transfer): that memory never
// outlives a Release, and never answers for another agent's transfer of
// the same id.
TEST_F(PreparedTest, ATransferFoundLastIsForgottenOnReleaseAndNeverAnotherAgents) {
  const std::vector<int64_t> one = {0};
  auto w = prepared().Make(Opcode::kWrite, llist_, one, rlist_, one);
  ASSERT_TRUE(w.ok()) << w.status();
  // The same id at the other agent: its lists take the same ids as here.
  PreparedTransfers& other = p_.b->prepared();
  auto seg = p_.b->OpenSegment(p_.a->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  auto ol = other.PrepareLocal(Blocks(remote_, kBlock));
  auto orl = other.PrepareRemote(*seg, Blocks(local_, kBlock));
  ASSERT_TRUE(ol.ok() && orl.ok()) << ol.status() << orl.status();
  auto ow = other.Make(Opcode::kRead, *ol, one, *orl, one);
  ASSERT_TRUE(ow.ok()) << ow.status();
  ASSERT_EQ(*ow, *w) << "the test needs both agents to give the same id";
  ASSERT_TRUE(prepared().Post(*w).ok());
  ASSERT_EQ(*Finish(prepared(), *w), XferState::kDone);
  // This thread found *w here last: the other agent's transfer is its own.
  EXPECT_EQ(*other.State(*ow), XferState::kNotPosted);
  EXPECT_EQ(*prepared().State(*w), XferState::kDone);
  // Released while this thread last found it.
  ASSERT_TRUE(prepared().Release(*w).ok());
  EXPECT_EQ(prepared().State(*w).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(prepared().Post(*w).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(prepared().Telemetry(*w).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(prepared().Release(*w).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*other.State(*ow), XferState::kNotPosted);
  EXPECT_TRUE(other.Release(*ow).ok());
}

TEST_F(PreparedTest, AdjacentPairsMergeUnlessAskedNot) {
  std::vector<int64_t> li = {10, 11, 12, 13, 40, 41}, ri = {0, 1, 2, 3, 9, 10};
  auto merged = prepared().Make(Opcode::kWrite, llist_, li, rlist_, ri);
  MakeOptions apart;
  apart.merge = false;
  auto each = prepared().Make(Opcode::kWrite, llist_, li, rlist_, ri, apart);
  ASSERT_TRUE(merged.ok() && each.ok());
  for (uint64_t x : {*merged, *each}) {
    std::fill(remote_.begin(), remote_.end(), 0);
    ASSERT_TRUE(prepared().Post(x).ok());
    ASSERT_EQ(*Finish(prepared(), x), XferState::kDone);
    for (size_t k = 0; k < li.size(); ++k) {
      ASSERT_EQ(
          std::memcmp(local_.data() + li[k] * kBlock, remote_.data() + ri[k] * kBlock, kBlock), 0);
    }
  }
  EXPECT_EQ(prepared().Telemetry(*merged)->descriptors, 2u);
  EXPECT_EQ(prepared().Telemetry(*each)->descriptors, 6u);
}

TEST_F(PreparedTest, BadPairsAreRefusedWithNothingMade) {
  const std::vector<int64_t> one = {0}, two = {0, 1}, none = {};
  const std::vector<int64_t> past = {static_cast<int64_t>(kBlocks)}, negative = {-1};
  using Code = absl::StatusCode;
  EXPECT_EQ(prepared().Make(Opcode::kWrite, llist_, one, rlist_, two).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(prepared().Make(Opcode::kWrite, llist_, none, rlist_, none).status().code(),
            Code::kInvalidArgument);
  auto out = prepared().Make(Opcode::kWrite, llist_, one, rlist_, past);
  EXPECT_EQ(out.status().code(), Code::kInvalidArgument);
  EXPECT_NE(out.status().message().find("out of range"), std::string::npos) << out.status();
  EXPECT_EQ(prepared().Make(Opcode::kWrite, llist_, negative, rlist_, one).status().code(),
            Code::kInvalidArgument);
  // Sides swapped.
  EXPECT_EQ(prepared().Make(Opcode::kWrite, rlist_, one, llist_, one).status().code(),
            Code::kInvalidArgument);
  // Lengths differ.
  std::vector<Descriptor> halves = {{Addr(local_), kBlock / 2}};
  auto half = prepared().PrepareLocal(halves);
  ASSERT_TRUE(half.ok());
  auto unequal = prepared().Make(Opcode::kWrite, *half, one, rlist_, one);
  EXPECT_EQ(unequal.status().code(), Code::kInvalidArgument);
  EXPECT_NE(unequal.status().message().find("lengths"), std::string::npos);
  EXPECT_EQ(prepared().Post(12345).status().code(), Code::kNotFound);
  // A released list: transfers made from it stay usable.
  auto x = prepared().Make(Opcode::kWrite, llist_, one, rlist_, one);
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(prepared().ReleaseList(llist_).ok());
  EXPECT_EQ(prepared().ReleaseList(llist_).code(), Code::kNotFound);
  EXPECT_EQ(prepared().Make(Opcode::kWrite, llist_, one, rlist_, one).status().code(),
            Code::kNotFound);
  ASSERT_TRUE(prepared().Post(*x).ok());
  EXPECT_EQ(*Finish(prepared(), *x), XferState::kDone);
}

// A post reuses the slices the last one planned, but never past a change:
// memory unregistered here fails the next post (nothing is sent from it),
// and registered again, the post works again.
TEST_F(PreparedTest, ARegistrationChangeIsSeenByTheNextPost) {
  ChangeRegistrationBetweenPosts({1, 3, 5, 7}, {2, 4, 6, 8});
}
TEST_F(PreparedTest, ARegistrationChangeIsSeenByTheNextPostOfOne) {
  ChangeRegistrationBetweenPosts({9}, {10});
}

void PreparedTest::ChangeRegistrationBetweenPosts(const std::vector<int64_t>& li,
                                                  const std::vector<int64_t>& ri) {
  auto x = prepared().Make(Opcode::kWrite, llist_, li, rlist_, ri);
  ASSERT_TRUE(x.ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(prepared().Post(*x).ok());
    ASSERT_EQ(*Finish(prepared(), *x), XferState::kDone);
  }
  ASSERT_TRUE(p_.a->UnregisterMemory(local_.data()).ok());
  std::fill(remote_.begin(), remote_.end(), 0);
  auto refused = prepared().Post(*x);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_EQ(prepared().State(*x).status(), refused.status());
  EXPECT_EQ(std::count(remote_.begin(), remote_.end(), 0), static_cast<long>(remote_.size()));
  ASSERT_TRUE(p_.a->RegisterMemory(local_.data(), local_.size()).ok());
  ASSERT_TRUE(prepared().Post(*x).ok());
  ASSERT_EQ(*Finish(prepared(), *x), XferState::kDone);
  for (size_t k = 0; k < li.size(); ++k) {
    EXPECT_EQ(std::memcmp(local_.data() + li[k] * kBlock, remote_.data() + ri[k] * kBlock, kBlock),
              0);
  }
}

// What a post adds to the engine's counters. A post again takes the
// links its predecessor took (no choice, no look-up): it must count the
// same requests, slices, NIC slices and bytes as the first.
struct Counted {
  uint64_t requests = 0, slices = 0, nic_slices = 0, nic_bytes = 0;
};
Counted CountsOf(const TransferEngine& e) {
  Counted c;
  EngineMetrics m = e.GetMetrics();
  for (const PeerMetrics& p : m.peers) {
    c.requests += p.requests;
    c.slices += p.slices;
  }
  for (const NicMetrics& n : m.nics) {
    c.nic_slices += n.slices;
    c.nic_bytes += n.bytes;
  }
  return c;
}

// (One descriptor takes a path of its own: the lone request's, cached.)
TEST_F(PreparedTest, EveryPostCountsAsTheFirstDid) {
  for (int64_t pairs : {64, 1}) {
    SCOPED_TRACE(pairs);
    std::vector<int64_t> li, ri;
    for (int64_t i = 0; i < pairs; ++i) {  // every other block: none merge
      li.push_back(2 * i);
      ri.push_back(2 * i + 1);
    }
    auto x = prepared().Make(Opcode::kWrite, llist_, li, rlist_, ri);
    ASSERT_TRUE(x.ok());
    PostCountsAsTheFirst(*x, li, ri);
  }
}

void PreparedTest::PostCountsAsTheFirst(uint64_t x, const std::vector<int64_t>& li,
                                        const std::vector<int64_t>& ri) {
  Counted before = CountsOf(*p_.a);
  for (int round = 0; round < 4; ++round) {
    Fill(&local_, 20 + round);
    ASSERT_TRUE(prepared().Post(x).ok());
    ASSERT_EQ(*Finish(prepared(), x), XferState::kDone) << "round " << round;
    for (size_t k = 0; k < li.size(); ++k) {
      ASSERT_EQ(
          std::memcmp(local_.data() + li[k] * kBlock, remote_.data() + ri[k] * kBlock, kBlock), 0)
          << "round " << round << " pair " << k;
    }
    const Counted now = CountsOf(*p_.a);
    EXPECT_EQ(now.requests - before.requests, li.size()) << "round " << round;
    EXPECT_EQ(now.slices - before.slices, li.size()) << "round " << round;
    EXPECT_EQ(now.nic_slices - before.nic_slices, li.size()) << "round " << round;
    EXPECT_EQ(now.nic_bytes - before.nic_bytes, li.size() * kBlock) << "round " << round;
    before = now;
  }
}

// Posts again while another transfer holds the links' places: whether the
// repost finds room for its last places or goes the general way (a
// backlog), every byte of both lands.
TEST_F(PreparedTest, APostAgainBesideABusyTransferLandsEveryByte) {
  std::vector<int64_t> small_l = {0, 2, 4, 6}, small_r = {1, 3, 5, 7};
  std::vector<int64_t> big_l, big_r;
  for (int64_t i = 16; i < static_cast<int64_t>(kBlocks); i += 2) {
    big_l.push_back(i);
    big_r.push_back(i + 1);
  }
  auto small = prepared().Make(Opcode::kWrite, llist_, small_l, rlist_, small_r);
  auto big = prepared().Make(Opcode::kWrite, llist_, big_l, rlist_, big_r);
  ASSERT_TRUE(small.ok() && big.ok());
  ASSERT_TRUE(prepared().Post(*small).ok());
  ASSERT_EQ(*Finish(prepared(), *small), XferState::kDone);
  for (int round = 0; round < 20; ++round) {
    Fill(&local_, 40 + round);
    std::fill(remote_.begin(), remote_.end(), 0);
    ASSERT_TRUE(prepared().Post(*big).ok());
    ASSERT_TRUE(prepared().Post(*small).ok());
    ASSERT_EQ(*Finish(prepared(), *small), XferState::kDone) << "round " << round;
    ASSERT_EQ(*Finish(prepared(), *big), XferState::kDone) << "round " << round;
    for (const auto& [l, r] :
         {std::make_pair(&small_l, &small_r), std::make_pair(&big_l, &big_r)}) {
      for (size_t k = 0; k < l->size(); ++k) {
        ASSERT_EQ(std::memcmp(local_.data() + (*l)[k] * kBlock, remote_.data() + (*r)[k] * kBlock,
                              kBlock),
                  0)
            << "round " << round << " pair " << k;
      }
    }
  }
}

// The notification is sent by the engine once the data is in place, with
// nobody polling: the peer sees it, and the bytes are there when it does.
TEST_F(PreparedTest, NotificationFollowsTheDataWithoutPolling) {
  std::vector<int64_t> li(kBlocks), ri(kBlocks);
  std::iota(li.begin(), li.end(), 0);
  std::iota(ri.begin(), ri.end(), 0);
  std::reverse(ri.begin(), ri.end());
  MakeOptions o;
  o.notification = "req-1:1";
  auto w = prepared().Make(Opcode::kWrite, llist_, li, rlist_, ri, o);
  ASSERT_TRUE(w.ok());
  std::fill(remote_.begin(), remote_.end(), 0);
  ASSERT_TRUE(prepared().Post(*w).ok());
  auto n = p_.b->WaitNotification(absl::Seconds(20));  // no State call meanwhile
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->message, "req-1:1");
  EXPECT_EQ(n->engine_id, p_.a->engine_id());
  for (size_t i = 0; i < kBlocks; ++i) {
    ASSERT_EQ(std::memcmp(local_.data() + i * kBlock, remote_.data() + ri[i] * kBlock, kBlock), 0)
        << "notified before block " << i << " landed";
  }
  EXPECT_EQ(*Finish(prepared(), *w), XferState::kDone);
  // Posted again with another notification: that one from now on.
  ASSERT_TRUE(prepared().Post(*w, std::string("req-2:1")).ok());
  EXPECT_EQ(*Finish(prepared(), *w), XferState::kDone);
  ASSERT_TRUE(prepared().Post(*w).ok());
  EXPECT_EQ(*Finish(prepared(), *w), XferState::kDone);
  std::vector<std::string> got;
  for (int i = 0; i < 2; ++i) {
    auto m = p_.b->WaitNotification(absl::Seconds(20));
    ASSERT_TRUE(m.ok()) << m.status();
    got.push_back(m->message);
  }
  EXPECT_EQ(got, (std::vector<std::string>{"req-2:1", "req-2:1"}));
  // A READ notifies too (the peer learns its blocks were read).
  auto r = prepared().Make(Opcode::kRead, llist_, li, rlist_, ri, o);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(prepared().Post(*r).ok());
  EXPECT_EQ(*Finish(prepared(), *r), XferState::kDone);
  auto m = p_.b->WaitNotification(absl::Seconds(20));
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->message, "req-1:1");
}

// Three threads at once on one engine, as vLLM calls its agent: each
// makes, posts and polls its own transfers.
TEST_F(PreparedTest, ThreadsPostAndPollAtOnce) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        std::vector<int64_t> idx;
        for (size_t i = t; i < kBlocks; i += 3) idx.push_back(static_cast<int64_t>(i));
        MakeOptions o;
        o.notification = "t" + std::to_string(t);
        auto x = prepared().Make(Opcode::kWrite, llist_, idx, rlist_, idx, o);
        if (!x.ok() || !prepared().Post(*x).ok()) {
          ++failures;
          continue;
        }
        absl::StatusOr<XferState> s = Finish(prepared(), *x);
        if (!s.ok() || *s != XferState::kDone || !prepared().Release(*x).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(local_, remote_);
  size_t notes = 0;
  while (p_.b->WaitNotification(absl::Seconds(5)).ok()) {
    if (++notes == 60) break;
  }
  EXPECT_EQ(notes, 60u);
}

// A transfer is bound to the peer instance its remote list was prepared
// against: after the peer restarts, posting it fails; nothing reaches the
// new instance, and a list prepared again works.
TEST(Prepared, APeerRestartFailsTransfersMadeForItsPredecessor) {
  auto a = MakeEngine();
  EngineOptions fixed = Local();
  fixed.port = EphemeralPort();
  auto b = MakeEngine(fixed);
  ASSERT_TRUE(a && b);
  std::vector<char> src(1 << 16), dst(1 << 16, 0);
  Fill(&src, 5);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  PreparedTransfers& p = a->prepared();
  auto l = p.PrepareLocal(Blocks(src, 4096));
  auto r = p.PrepareRemote(*seg, Blocks(dst, 4096));
  ASSERT_TRUE(l.ok() && r.ok());
  const std::vector<int64_t> idx = {0, 3, 5};
  auto x = p.Make(Opcode::kWrite, *l, idx, *r, idx);
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(p.Post(*x).ok());
  ASSERT_EQ(*Finish(p, *x), XferState::kDone);

  b.reset();
  std::fill(dst.begin(), dst.end(), 0);
  b = MakeEngine(fixed);
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  absl::StatusOr<XferState> posted = p.Post(*x);
  if (posted.ok()) posted = Finish(p, *x);
  EXPECT_FALSE(posted.ok()) << "a transfer for the old instance ran at the new one";
  EXPECT_EQ(p.State(*x).status(), posted.status());  // sticky
  EXPECT_EQ(std::count(dst.begin(), dst.end(), 0), static_cast<long>(dst.size()));
  // Prepared again, against the new instance: it works.
  auto r2 = p.PrepareRemote(*seg, Blocks(dst, 4096));
  ASSERT_TRUE(r2.ok()) << r2.status();
  auto x2 = p.Make(Opcode::kWrite, *l, idx, *r2, idx);
  ASSERT_TRUE(x2.ok());
  ASSERT_TRUE(p.Post(*x2).ok());
  ASSERT_EQ(*Finish(p, *x2), XferState::kDone);
  EXPECT_EQ(std::memcmp(src.data() + 5 * 4096, dst.data() + 5 * 4096, 4096), 0);
}

// The peer dies while a transfer is in flight: it fails in bounded time,
// the failure sticks, and no notification claims the data arrived.
TEST(Prepared, APeerThatDiesFailsItsTransferInBoundedTime) {
  auto a = MakeEngine();
  auto b = MakeEngine();
  ASSERT_TRUE(a && b);
  const size_t kBlock = 64 << 10, kCount = 256;
  std::vector<char> src(kBlock * kCount), dst(kBlock * kCount, 0);
  Fill(&src, 6);
  ASSERT_TRUE(a->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(b->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = a->OpenSegment(b->address());
  ASSERT_TRUE(seg.ok());
  PreparedTransfers& p = a->prepared();
  auto l = p.PrepareLocal(Blocks(src, kBlock));
  auto r = p.PrepareRemote(*seg, Blocks(dst, kBlock));
  ASSERT_TRUE(l.ok() && r.ok());
  std::vector<int64_t> idx(kCount);
  std::iota(idx.begin(), idx.end(), 0);
  std::vector<int64_t> rev(idx.rbegin(), idx.rend());
  MakeOptions o;
  o.notification = "never";
  auto x = p.Make(Opcode::kWrite, *l, idx, *r, rev, o);
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(p.Post(*x).ok());
  b.reset();
  const absl::Time start = absl::Now();
  absl::StatusOr<XferState> s = Finish(p, *x);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  if (s.ok()) {
    // It may have finished before the peer went: then everything landed.
    EXPECT_EQ(*s, XferState::kDone);
  } else {
    EXPECT_EQ(p.State(*x).status(), s.status());
    EXPECT_EQ(p.Telemetry(*x).status(), s.status());
  }
  // Whichever it was, nothing but the first notification's absence: the
  // peer is gone, and the transfer stays failed or done.
  EXPECT_EQ(p.State(*x).ok(), s.ok());
  // Posted again with the peer gone (in one process the first post may
  // have copied everything before it went): it fails in bounded time, the
  // failure sticks, and telemetry reports it too.
  const absl::Time again = absl::Now();
  absl::StatusOr<XferState> second = p.Post(*x);
  if (second.ok()) second = Finish(p, *x);
  EXPECT_LT(absl::Now() - again, absl::Seconds(30));
  ASSERT_FALSE(second.ok()) << "a transfer to a dead peer succeeded";
  EXPECT_NE(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(p.State(*x).status(), second.status());
  EXPECT_EQ(p.Telemetry(*x).status(), second.status());
}

}  // namespace
}  // namespace kvferry
