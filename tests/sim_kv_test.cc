// The KV layer inside the simulator: pages verified, and layer-wise mode
// overlapping transfer with (modelled) compute.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/testing/sim_world.h"
#include "gtest/gtest.h"
#include "kv/kv_cache.h"
#include "sim/fabric.h"

namespace kvferry {
namespace {

constexpr uint64_t kGbps = 10'000'000'000;  // 1.25 GB/s data NICs

struct KvWorld {
  explicit KvWorld(const KvLayout& layout) : w(7) {
    const sim::NicSpec nic{kGbps, absl::Microseconds(2), 4096};
    const int a = w.AddHost(nic), b = w.AddHost(nic);
    prefill = *w.StartEngine(a);
    decode = *w.StartEngine(b);
    src = *KvPool::Allocate(layout);
    dst = *KvPool::Allocate(layout);
    for (uint32_t buf = 0; buf < layout.buffer_count(); ++buf) {
      for (uint64_t i = 0; i < layout.buffer_bytes(); ++i) {
        src.buffer(buf)[i] = static_cast<char>(i * 13 + buf);
      }
    }
    sender = *KvSender::Create(prefill.get(), src);
    receiver = *KvReceiver::Create(decode.get(), dst);
  }
  SimWorld w;
  std::unique_ptr<TransferEngine> prefill, decode;
  KvPool src, dst;
  std::unique_ptr<KvSender> sender;
  std::unique_ptr<KvReceiver> receiver;
};

TEST(SimKv, PagesArriveAndAuxFollows) {
  const KvLayout l{4, false, 16, 256, 64};
  KvWorld k(l);
  std::vector<uint32_t> s = {0, 1, 2, 9, 33, 34}, d = {63, 20, 21, 22, 5, 6};
  ASSERT_TRUE(k.sender->Send("r1", k.decode->address(), s, d, "token:7").ok());
  auto st = k.receiver->Wait("r1", absl::Seconds(1));
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->state, KvReceiver::State::kComplete);
  EXPECT_EQ(st->aux, "token:7");
  for (uint32_t layer = 0; layer < l.layers; ++layer) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (size_t i = 0; i < s.size(); ++i) {
        ASSERT_EQ(
            std::memcmp(k.src.page(layer, kv, s[i]), k.dst.page(layer, kv, d[i]), l.page_bytes()),
            0);
      }
    }
  }
}

TEST(SimKv, CancelFailsOnBothSidesAndThePairStaysUsable) {
  const KvLayout l{4, true, 64, 1152, 16};  // MLA-shaped
  KvWorld k(l);
  auto h = k.sender->Begin("cancelled", k.decode->address(), {1, 2}, {3, 4});
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(k.sender->SendLayer(*h, 0).ok());
  ASSERT_TRUE(k.sender->Cancel(*h, "preempted").ok());
  auto st = k.receiver->Wait("cancelled", absl::Seconds(1));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, KvReceiver::State::kFailed);
  EXPECT_NE(st->error.message().find("cancelled: preempted"), std::string::npos);
  // Layer 3 was never sent.
  EXPECT_EQ(
      std::memcmp(k.dst.page(3, 0, 3), std::string(l.page_bytes(), '\0').data(), l.page_bytes()),
      0);
  ASSERT_TRUE(k.sender->Send("after", k.decode->address(), {1, 2}, {3, 4}, "aux").ok());
  auto after = k.receiver->Wait("after", absl::Seconds(1));
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->state, KvReceiver::State::kComplete);
  EXPECT_EQ(after->aux, "aux");
  EXPECT_EQ(std::memcmp(k.dst.page(3, 0, 3), k.src.page(3, 0, 1), 2 * l.page_bytes()), 0);
}

// The prefill's NIC holds layer 0's WRITEs (a stuck queue) while the
// prefill cancels the request: the decode reports it cancelled before they
// reach it, and when they do, they land nowhere (the decode dropped the
// prefill's links before reporting).
TEST(SimKv, WritesHeldPastACancelNeverLand) {
  const KvLayout l{4, false, 16, 256, 64};
  KvWorld k(l);
  k.w.fabric().HoldNic(k.w.data_nic(0, 0), absl::Milliseconds(50));
  const std::string zero(l.page_bytes(), '\0');
  auto h = k.sender->Begin("held", k.decode->address(), {1, 2}, {3, 4});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(k.sender->SendLayer(*h, 0).ok());
  ASSERT_TRUE(k.sender->Cancel(*h, "preempted").ok());
  auto st = k.receiver->Wait("held", absl::Seconds(1));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, KvReceiver::State::kFailed);
  ASSERT_LT(k.w.sched().now(), sim::ToSimTime(absl::Milliseconds(50)))
      << "reported only after the held writes were released";
  k.w.sched().RunUntil(sim::ToSimTime(absl::Milliseconds(150)));
  for (uint32_t kv = 0; kv < 2; ++kv) {
    EXPECT_EQ(std::memcmp(k.dst.page(0, kv, 3), zero.data(), l.page_bytes()), 0)
        << "a WRITE of the cancelled request landed after the report";
  }
}

// Runs one request with `compute` per layer before each layer is ready;
// returns the simulated time from the first layer's compute to completion.
absl::Duration RunRequest(KvWorld& k, const std::vector<uint32_t>& pages, absl::Duration compute,
                          bool layer_wise, const std::string& id) {
  const KvLayout& l = k.src.layout();
  sim::Scheduler& sched = k.w.sched();
  auto h = k.sender->Begin(id, k.decode->address(), pages, pages);
  EXPECT_TRUE(h.ok()) << h.status();
  const absl::Time start = sched.Now();
  for (uint32_t layer = 0; layer < l.layers; ++layer) {
    sched.SleepFor(compute);  // the model computes this layer
    if (layer_wise) {
      EXPECT_TRUE(k.sender->SendLayer(*h, layer).ok());
    }
  }
  EXPECT_TRUE(k.sender->Finish(*h, "").ok());
  EXPECT_EQ(k.receiver->Wait(id, absl::Seconds(1))->state, KvReceiver::State::kComplete);
  return sched.Now() - start;
}

TEST(SimKv, LayerWiseModeOverlapsTransferWithCompute) {
  // 8 layers; per layer K and V of 16 pages of 64 KiB = 2 MiB, which takes
  // about 1.7 ms at 1.25 GB/s; compute takes 2 ms per layer.
  const KvLayout l{8, false, 64, 1024, 32};
  KvWorld k(l);
  std::vector<uint32_t> pages;
  for (uint32_t i = 0; i < 16; ++i) pages.push_back(i * 2);  // scattered
  const absl::Duration compute = absl::Milliseconds(2);
  const double layer_bytes = 2.0 * 16 * l.page_bytes();
  const absl::Duration layer_transfer = absl::Seconds(layer_bytes * 8 / kGbps);
  const absl::Duration compute_total = l.layers * compute;
  const absl::Duration transfer_total = l.layers * layer_transfer;

  const absl::Duration whole = RunRequest(k, pages, compute, false, "whole");
  const absl::Duration overlapped = RunRequest(k, pages, compute, true, "layers");
  const absl::Duration expected = std::max(compute_total, transfer_total) + layer_transfer;
  // Whole-request mode pays the sum; layer-wise pays the max plus one layer.
  EXPECT_GE(whole, compute_total + transfer_total * 0.95);
  EXPECT_LE(overlapped, expected * 1.15) << "overlapped " << overlapped << " expected " << expected;
  EXPECT_GE(overlapped, expected * 0.95);
  EXPECT_LT(overlapped, whole * 0.75);
  std::printf("layer-wise %s, whole %s, max(compute, transfer) + one layer %s\n",
              absl::FormatDuration(overlapped).c_str(), absl::FormatDuration(whole).c_str(),
              absl::FormatDuration(expected).c_str());
}

}  // namespace
}  // namespace kvferry
