// TransferEngine inside the deterministic simulator: the handshake runs on
// SimNetwork, data on SimTransport, one thread drives everything. The same
// scenarios as over TCP: pages verified, notification after data, a peer
// restarted on the same port, and a replayable trace.
#include <cstring>
#include <memory>
#include <vector>

#include "engine/transfer_engine.h"
#include "tests/sim_world.h"
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
void MovePages(SimWorld& w, TransferEngine& prefill, TransferEngine& decode,
               std::vector<char>& src, std::vector<char>& dst, int round) {
  auto seg = prefill.OpenSegment(decode.address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7 + round);
  std::vector<BatchId> batches;
  for (size_t layer = 0; layer < kLayers; ++layer) {
    std::vector<TransferRequest> reqs;
    for (size_t p = 0; p < kPages; ++p) {
      const size_t from = (layer * kPages + p) * kPage;
      const size_t to = (layer * kPages + (p * 5 + 3) % kPages) * kPage;  // scattered
      reqs.push_back({Opcode::kWrite, src.data() + from,
                      reinterpret_cast<uintptr_t>(dst.data()) + to, kPage});
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
  ASSERT_TRUE(prefill.NotifyAfter(batches.back(), "round " + std::to_string(round),
                                  absl::Seconds(1)).ok());
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

TEST(SimEngine, PagesArriveAndNotificationsFollowTheirData) {
  RunScenario(1, {});
}

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
  w.fabric().SetNodeUp(1, false);  // the decode host vanishes
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
