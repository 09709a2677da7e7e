// TransferEngine inside the deterministic simulator: the handshake runs on
// SimNetwork, data on SimTransport, one thread drives everything. The same
// scenarios as over TCP: pages verified, notification after data, a peer
// restarted on the same port, and a replayable trace.
#include <cstring>
#include <memory>
#include <vector>

#include "engine/testing/sim_world.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "handshake/sim_network.h"
#include "sim/fabric.h"
#include "sim/prng.h"
#include "sim/scheduler.h"
#include "sim/seed.h"
#include "transport/sim/sim_transport.h"

namespace kvferry {
namespace {

using transport::Opcode;

constexpr size_t kLayers = 4, kPages = 32, kPage = 4096;

// Sends every page of every layer prefill -> decode (scattered), one batch
// per layer, then a notification; checks the pages when it is seen.
void MovePages(SimWorld& w, TransferEngine& prefill, TransferEngine& decode, std::vector<char>& src,
               std::vector<char>& dst, int round) {
  auto seg = prefill.OpenSegment(decode.address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7 + round);
  std::vector<BatchId> batches;
  for (size_t layer = 0; layer < kLayers; ++layer) {
    std::vector<TransferRequest> reqs;
    for (size_t p = 0; p < kPages; ++p) {
      const size_t from = (layer * kPages + p) * kPage;
      const size_t to = (layer * kPages + (p * 5 + 3) % kPages) * kPage;  // scattered
      reqs.push_back(
          {Opcode::kWrite, src.data() + from, reinterpret_cast<uintptr_t>(dst.data()) + to, kPage});
    }
    auto b = prefill.Submit(*seg, reqs);
    ASSERT_TRUE(b.ok()) << b.status();
    batches.push_back(*b);
  }
  for (BatchId b : batches) {
    auto st = prefill.Wait(b, absl::Seconds(1));
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_TRUE(st->ok()) << st->requests[0];
  }
  ASSERT_TRUE(
      prefill.NotifyAfter(batches.back(), "round " + std::to_string(round), absl::Seconds(1)).ok());
  auto note = decode.WaitNotification(absl::Seconds(1));
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(note->message, "round " + std::to_string(round));
  for (size_t layer = 0; layer < kLayers; ++layer) {
    for (size_t p = 0; p < kPages; ++p) {
      const size_t from = (layer * kPages + p) * kPage;
      const size_t to = (layer * kPages + (p * 5 + 3) % kPages) * kPage;
      ASSERT_EQ(std::memcmp(src.data() + from, dst.data() + to, kPage), 0)
          << "layer " << layer << " page " << p;
    }
  }
}

uint64_t RunScenario(uint64_t seed, sim::FaultOptions faults) {
  SimWorld w(seed, faults);
  const int a = w.AddHost(), b = w.AddHost();
  auto prefill = w.StartEngine(a);
  auto decode = w.StartEngine(b);
  EXPECT_TRUE(prefill.ok() && decode.ok());
  std::vector<char> src(kLayers * kPages * kPage), dst(src.size(), 0);
  EXPECT_TRUE((*prefill)->RegisterMemory(src.data(), src.size()).ok());
  EXPECT_TRUE((*decode)->RegisterMemory(dst.data(), dst.size()).ok());
  for (int round = 1; round <= 3; ++round) {
    MovePages(w, **prefill, **decode, src, dst, round);
  }
  return w.sched().trace_hash();
}

TEST(SimEngine, PagesArriveAndNotificationsFollowTheirData) { RunScenario(1, {}); }

TEST(SimEngine, LossyFabricStillDeliversAndReplaysBitForBit) {
  sim::FaultOptions lossy;
  lossy.drop = {1, 200};
  lossy.delay = {1, 20};
  lossy.max_delay = absl::Microseconds(20);
  for (uint64_t seed : sim::SweepSeeds(1, 5)) {
    SCOPED_TRACE(sim::ReplayCommand(seed));
    EXPECT_EQ(RunScenario(seed, lossy), RunScenario(seed, lossy));
  }
  EXPECT_NE(RunScenario(1, lossy), RunScenario(2, lossy));
}

TEST(SimEngine, PeerRestartedOnTheSamePortWorksAfterRefresh) {
  SimWorld w(3);
  const int a = w.AddHost(), b = w.AddHost();
  auto prefill = w.StartEngine(a);
  auto decode = w.StartEngine(b, 15123);
  ASSERT_TRUE(prefill.ok() && decode.ok());
  const std::string address = (*decode)->address();
  std::vector<char> src(kLayers * kPages * kPage), dst(src.size(), 0);
  ASSERT_TRUE((*prefill)->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE((*decode)->RegisterMemory(dst.data(), dst.size()).ok());
  MovePages(w, **prefill, **decode, src, dst, 1);
  decode->reset();  // the decode process dies...
  w.sched().SleepFor(absl::Milliseconds(1));
  auto again = w.StartEngine(b, 15123);  // ...and comes back on its port
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->address(), address);
  std::fill(dst.begin(), dst.end(), 0);
  ASSERT_TRUE((*again)->RegisterMemory(dst.data(), dst.size()).ok());
  MovePages(w, **prefill, **again, src, dst, 2);
}

TEST(SimEngine, PeerThatIsGoneFailsInBoundedSimulatedTime) {
  SimWorld w(4);
  const int a = w.AddHost(), b = w.AddHost();
  auto prefill = w.StartEngine(a);
  auto decode = w.StartEngine(b);
  std::vector<char> src(kPage), dst(kPage);
  ASSERT_TRUE((*prefill)->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE((*decode)->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = (*prefill)->OpenSegment((*decode)->address());
  ASSERT_TRUE(seg.ok());
  w.fabric().topology().SetNodeUp(1, false);  // the decode host vanishes
  TransferRequest r{Opcode::kWrite, src.data(), reinterpret_cast<uintptr_t>(dst.data()), kPage};
  const sim::SimTime start = w.sched().now();
  auto batch = (*prefill)->Submit(*seg, {&r, 1});
  ASSERT_TRUE(batch.ok());
  auto st = (*prefill)->Wait(*batch, absl::Seconds(60));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->failed, 1u);
  EXPECT_EQ(st->requests[0].code(), absl::StatusCode::kUnavailable) << st->requests[0];
  // Retries include a handshake attempt each; all within simulated seconds.
  EXPECT_LT(w.sched().now() - start, sim::ToSimTime(absl::Seconds(30)));
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

// Four NICs per host, two per NUMA node. Moves `count` blocks from a buffer
// registered at `location` and returns the slices each local NIC carried.
std::vector<uint64_t> StripeOnce(const std::string& location, uint32_t link_capacity,
                                 size_t count) {
  SimWorld w(17);
  const int a = w.AddMultiNicHost({0, 0, 1, 1});
  const int b = w.AddMultiNicHost({0, 0, 1, 1});
  auto prefill = w.StartEngine(a, 0, link_capacity);
  auto decode = w.StartEngine(b, 0, link_capacity);
  EXPECT_TRUE(prefill.ok() && decode.ok());
  if (!prefill.ok() || !decode.ok()) return {};
  const size_t kBlock = 16 << 10;  // one slice each
  std::vector<char> src(count * kBlock), dst(count * kBlock, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 13 + (i >> 12));
  EXPECT_TRUE(
      (*prefill)->RegisterMemory(src.data(), src.size(), transport::Access::kNone, location).ok());
  EXPECT_TRUE((*decode)->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = (*prefill)->OpenSegment((*decode)->address());
  EXPECT_TRUE(seg.ok()) << seg.status();
  if (!seg.ok()) return {};
  std::vector<TransferRequest> reqs;
  for (size_t i = 0; i < count; ++i) {
    reqs.push_back({Opcode::kWrite, src.data() + i * kBlock,
                    reinterpret_cast<uintptr_t>(dst.data()) + i * kBlock, kBlock});
  }
  auto batch = (*prefill)->Submit(*seg, reqs);
  EXPECT_TRUE(batch.ok()) << batch.status();
  if (!batch.ok()) return {};
  auto st = (*prefill)->Wait(*batch, absl::Seconds(1));
  EXPECT_TRUE(st.ok() && st->ok());
  EXPECT_EQ(src, dst);
  std::vector<uint64_t> slices;
  uint64_t bytes = 0;
  for (const NicCounters& c : (*prefill)->GetNicCounters()) {
    slices.push_back(c.slices);
    bytes += c.bytes;
  }
  EXPECT_EQ(bytes, src.size());
  return slices;
}

TEST(SimEngineStriping, SlicesGoOverTheNicsNearTheBuffer) {
  // A buffer on NUMA node 1: only NICs 2 and 3 carry it, evenly.
  std::vector<uint64_t> near = StripeOnce("cpu:1", 1024, 64);
  ASSERT_EQ(near.size(), 4u);
  EXPECT_EQ(near[0] + near[1], 0u);
  EXPECT_EQ(near[2] + near[3], 64u);
  EXPECT_GE(near[2], 16u);
  EXPECT_GE(near[3], 16u);
  // No location: all four NICs share the work.
  std::vector<uint64_t> all = StripeOnce("", 1024, 64);
  ASSERT_EQ(all.size(), 4u);
  for (uint64_t n : all) EXPECT_GE(n, 8u);
}

TEST(SimEngineStriping, FarNicsTakeOverWhenTheNearOnesAreFull) {
  // Each link holds 4 slices: 64 at once overflow NICs 2 and 3 (8 slots),
  // and the rest go over NICs 0 and 1 instead of waiting.
  std::vector<uint64_t> spill = StripeOnce("cpu:1", 4, 64);
  ASSERT_EQ(spill.size(), 4u);
  EXPECT_GT(spill[0] + spill[1], 0u);
  EXPECT_GE(spill[2] + spill[3], spill[0] + spill[1]);
  EXPECT_EQ(spill[0] + spill[1] + spill[2] + spill[3], 64u);
}

TEST(SimEngineStriping, BadLocationsAreRefused) {
  SimWorld w(18);
  const int a = w.AddMultiNicHost({0, 1});
  auto e = w.StartEngine(a);
  ASSERT_TRUE(e.ok());
  std::vector<char> buf(4096);
  for (const char* bad : {"gpu:0", "cpu:", "cpu:-1", "cuda:x", "cpu0"}) {
    absl::Status s = (*e)->RegisterMemory(buf.data(), buf.size(), transport::Access::kNone, bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(bad), std::string::npos) << s;
  }
  // Still usable, and a location with no NIC on it means no preference.
  EXPECT_TRUE((*e)->RegisterMemory(buf.data(), buf.size(), transport::Access::kNone, "cpu:7").ok());
}

// A NIC goes down in the middle of a batch: its slices move to the other
// NICs' links and every request still succeeds, bytes intact.
// Two hosts with a data NIC per entry of `numa`, a prefill and a decode
// engine, a segment between them, and `count` 16 KiB WRITEs from src to dst.
struct NicPair {
  NicPair(uint64_t seed, const std::vector<int32_t>& numa, size_t count)
      : w(seed), a(w.AddMultiNicHost(numa)), b(w.AddMultiNicHost(numa)) {
    auto p = w.StartEngine(a);
    auto d = w.StartEngine(b);
    EXPECT_TRUE(p.ok() && d.ok());
    if (!p.ok() || !d.ok()) return;
    prefill = std::move(*p);
    decode = std::move(*d);
    const size_t kBlock = 16 << 10;
    src.resize(count * kBlock);
    dst.assign(count * kBlock, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 29 + (i >> 10));
    EXPECT_TRUE(prefill->RegisterMemory(src.data(), src.size()).ok());
    EXPECT_TRUE(decode->RegisterMemory(dst.data(), dst.size()).ok());
    auto s = prefill->OpenSegment(decode->address());
    EXPECT_TRUE(s.ok()) << s.status();
    seg = s.ok() ? *s : 0;
    for (size_t i = 0; i < count; ++i) {
      reqs.push_back({Opcode::kWrite, src.data() + i * kBlock,
                      reinterpret_cast<uintptr_t>(dst.data()) + i * kBlock, kBlock});
    }
  }
  SimWorld w;
  const int a, b;
  std::unique_ptr<TransferEngine> prefill, decode;
  std::vector<char> src, dst;
  SegmentId seg = 0;
  std::vector<TransferRequest> reqs;
};

TEST(SimEngineStriping, ANicGoingDownMovesItsSlicesToTheOthers) {
  NicPair p(19, {0, 0, 1, 1}, 256);
  ASSERT_TRUE(p.prefill && p.seg != 0);
  auto batch = p.prefill->Submit(p.seg, p.reqs);
  ASSERT_TRUE(batch.ok()) << batch.status();
  // Let part of it go, then take the sender's NIC 1 down for good.
  p.w.sched().RunUntil(p.w.sched().now() + sim::ToSimTime(absl::Microseconds(50)));
  auto early = p.prefill->Poll(*batch);
  ASSERT_TRUE(early.ok());
  EXPECT_GT(early->pending, 0u) << "the batch finished before the NIC went down";
  p.w.fabric().topology().SetNicUp(p.w.data_nic(p.a, 1), false);
  auto st = p.prefill->Wait(*batch, absl::Seconds(1));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->ok()) << st->requests[0];
  EXPECT_EQ(p.src, p.dst);
  const EngineCounters c = p.prefill->GetCounters();
  EXPECT_GT(c.link_failovers, 0u);
  EXPECT_EQ(c.reconnects, 0u) << "healthy links were torn down";
  // The metrics put the failures and the re-posts on NIC 1.
  const NicMetrics nic1 = p.prefill->GetMetrics().nics[1];
  EXPECT_GT(nic1.errors, 0u);
  EXPECT_GT(nic1.retries, 0u);
  EXPECT_FALSE(nic1.errors_by_code.empty());
  EXPECT_EQ(p.prefill->GetMetrics().nics[0].errors, 0u);
  // New batches keep flowing over the three NICs left, none over NIC 1.
  const uint64_t nic1_before = p.prefill->GetNicCounters()[1].slices;
  std::fill(p.dst.begin(), p.dst.end(), 0);
  auto again = p.prefill->Submit(p.seg, p.reqs);
  ASSERT_TRUE(again.ok()) << again.status();
  auto st2 = p.prefill->Wait(*again, absl::Seconds(1));
  ASSERT_TRUE(st2.ok() && st2->ok());
  EXPECT_EQ(p.src, p.dst);
  EXPECT_EQ(p.prefill->GetNicCounters()[1].slices, nic1_before);
}

// A WRITE whose link timed out is sent again on another link; its first
// copy was only held up (a stuck NIC queue) and reaches the peer later,
// after the same page was written again. The peer closed the failed link's
// half before the second copy went (handshake close-links), so the late
// first copy lands nowhere: the page keeps the newer bytes.
TEST(SimEngineStriping, ALateFirstCopyOfARetriedWriteNeverLands) {
  NicPair p(29, {0, 0}, 1);
  ASSERT_TRUE(p.prefill && p.seg != 0);
  const std::vector<char> first = p.src;
  p.w.fabric().HoldNic(p.w.data_nic(p.a, 0), absl::Milliseconds(50));
  auto batch = p.prefill->Submit(p.seg, p.reqs);
  ASSERT_TRUE(batch.ok()) << batch.status();
  auto st = p.prefill->Wait(*batch, absl::Seconds(1));
  ASSERT_TRUE(st.ok() && st->ok()) << (st.ok() ? st->requests[0] : st.status());
  EXPECT_EQ(p.dst, first);
  ASSERT_GT(p.prefill->GetNicCounters()[0].slices, 0u) << "the first copy did not go on NIC 0";
  ASSERT_GT(p.prefill->GetCounters().link_failovers, 0u);
  // The page again, with new bytes, before the held copy is released.
  for (char& c : p.src) c = static_cast<char>(~c);
  auto again = p.prefill->Submit(p.seg, p.reqs);
  ASSERT_TRUE(again.ok()) << again.status();
  auto st2 = p.prefill->Wait(*again, absl::Seconds(1));
  ASSERT_TRUE(st2.ok() && st2->ok());
  EXPECT_EQ(p.dst, p.src);
  ASSERT_LT(p.w.sched().now(), sim::ToSimTime(absl::Milliseconds(50)));
  // The hold ends: the first copy and its retransmissions arrive.
  p.w.sched().RunUntil(p.w.sched().now() + sim::ToSimTime(absl::Milliseconds(100)));
  EXPECT_EQ(p.dst, p.src) << "a late copy of the first write landed after the second";
}

TEST(SimEngineStriping, ANicThatComesBackIsUsedAgain) {
  NicPair p(23, {0, 0}, 128);
  ASSERT_TRUE(p.prefill && p.seg != 0);
  auto move_all = [&] {
    std::fill(p.dst.begin(), p.dst.end(), 0);
    auto batch = p.prefill->Submit(p.seg, p.reqs);
    ASSERT_TRUE(batch.ok()) << batch.status();
    auto st = p.prefill->Wait(*batch, absl::Seconds(1));
    ASSERT_TRUE(st.ok() && st->ok());
    EXPECT_EQ(p.src, p.dst);
  };
  // NIC 1 goes down mid-batch: its slices move to NIC 0.
  auto batch = p.prefill->Submit(p.seg, p.reqs);
  ASSERT_TRUE(batch.ok());
  p.w.sched().RunUntil(p.w.sched().now() + sim::ToSimTime(absl::Microseconds(20)));
  p.w.fabric().topology().SetNicUp(p.w.data_nic(p.a, 1), false);
  auto st = p.prefill->Wait(*batch, absl::Seconds(1));
  ASSERT_TRUE(st.ok() && st->ok());
  ASSERT_GT(p.prefill->GetCounters().link_failovers, 0u);
  move_all();  // NIC 0 alone
  const uint64_t nic1_down = p.prefill->GetNicCounters()[1].slices;
  EXPECT_EQ(p.prefill->GetCounters().links_repaired, 0u);
  // It comes back; after the repair interval (peer_timeout / 4) a batch
  // finds the failed link rebuilt on NIC 1 and the next uses it.
  p.w.fabric().topology().SetNicUp(p.w.data_nic(p.a, 1), true);
  p.w.sched().RunUntil(p.w.sched().now() + sim::ToSimTime(absl::Seconds(3)));
  move_all();
  move_all();
  EXPECT_EQ(p.prefill->GetCounters().links_repaired, 1u);
  EXPECT_EQ(p.prefill->GetCounters().reconnects, 0u) << "the healthy link was torn down";
  EXPECT_GT(p.prefill->GetNicCounters()[1].slices, nic1_down);
}

}  // namespace
}  // namespace kvferry
