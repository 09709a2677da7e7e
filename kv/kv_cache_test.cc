#include "kv/kv_cache.h"

#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "handshake/messages.h"
#include "handshake/tcp_network.h"
#include "net/socket.h"
#include "sim/prng.h"
#include "sim/seed.h"

namespace kvferry {
namespace {

// ---------------------------------------------------------------- layout

TEST(KvLayout, SizesEncodingAndValidation) {
  KvLayout l{32, false, 16, 8 * 128 * 2, 256};
  ASSERT_TRUE(l.Validate().ok());
  EXPECT_EQ(l.buffers_per_layer(), 2u);
  EXPECT_EQ(l.buffer_count(), 64u);
  EXPECT_EQ(l.page_bytes(), 32768u);
  EXPECT_EQ(l.buffer_bytes(), 32768u * 256);
  auto back = KvLayout::Decode(l.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->Encode(), l.Encode());
  KvLayout mla{61, true, 64, 576 * 2, 100};
  EXPECT_EQ(mla.buffer_count(), 61u);
  EXPECT_EQ(KvLayout::Decode(mla.Encode())->combined_kv, true);
  EXPECT_EQ((KvLayout{0, false, 16, 4, 4}).Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvLayout::Decode("kv1 layers=x").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(KvPool::Wrap(l, {nullptr}).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- coalescing

// The fewest runs, by brute force: a pair starts a run exactly when the pair
// one page earlier on both sides is absent.
size_t MinimalRuns(const std::vector<uint32_t>& src, const std::vector<uint32_t>& dst) {
  size_t starts = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    bool has_predecessor = false;
    for (size_t j = 0; j < src.size(); ++j) {
      has_predecessor |= src[i] > 0 && dst[i] > 0 && src[j] + 1 == src[i] && dst[j] + 1 == dst[i];
    }
    starts += !has_predecessor;
  }
  return starts;
}

TEST(CoalescePages, MatchesTheBruteForceMinimumAndCoversExactly) {
  const uint64_t seed = sim::TestSeed(5);
  SCOPED_TRACE(sim::ReplayCommand(seed));
  sim::Prng prng(seed);
  for (int trial = 0; trial < 400; ++trial) {
    // Build lists out of random runs so that merging really happens, then
    // shuffle the pairs: order must not matter.
    const uint32_t pool = 64 + prng.Uniform(200);
    std::vector<uint32_t> free_dst(pool);
    for (uint32_t i = 0; i < pool; ++i) free_dst[i] = i;
    std::vector<uint32_t> src, dst;
    std::set<uint32_t> used_dst;
    const int runs = 1 + prng.Uniform(12);
    for (int r = 0; r < runs; ++r) {
      const uint32_t len = 1 + prng.Uniform(8);
      const uint32_t s0 = prng.Uniform(pool), d0 = prng.Uniform(pool);
      for (uint32_t k = 0; k < len && d0 + k < pool && s0 + k < pool; ++k) {
        if (!used_dst.insert(d0 + k).second) break;
        src.push_back(s0 + k);
        dst.push_back(d0 + k);
      }
    }
    for (size_t i = src.size(); i > 1; --i) {
      const size_t j = prng.Uniform(i);
      std::swap(src[i - 1], src[j]);
      std::swap(dst[i - 1], dst[j]);
    }
    auto coalesced = CoalescePages(src, dst);
    ASSERT_TRUE(coalesced.ok()) << coalesced.status();
    std::multiset<std::pair<uint32_t, uint32_t>> want, got;
    for (size_t i = 0; i < src.size(); ++i) want.insert({src[i], dst[i]});
    for (const PageRun& run : *coalesced) {
      ASSERT_GT(run.count, 0u);
      for (uint32_t k = 0; k < run.count; ++k) got.insert({run.src + k, run.dst + k});
    }
    ASSERT_EQ(got, want) << "trial " << trial;
    ASSERT_EQ(coalesced->size(), MinimalRuns(src, dst)) << "trial " << trial;
  }
}

TEST(CoalescePages, SimpleCasesAndErrors) {
  EXPECT_EQ(*CoalescePages({3, 4, 5, 9}, {10, 11, 12, 0}),
            (std::vector<PageRun>{{3, 10, 3}, {9, 0, 1}}));
  EXPECT_EQ(*CoalescePages({5, 3, 4}, {12, 10, 11}), (std::vector<PageRun>{{3, 10, 3}}));
  EXPECT_TRUE(CoalescePages({}, {})->empty());
  EXPECT_EQ(CoalescePages({1, 2}, {1}).status().code(), absl::StatusCode::kInvalidArgument);
  auto dup = CoalescePages({1, 2}, {7, 7});
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("destination page 7"), std::string::npos);
}

// ---------------------------------------------------------------- end to end (TCP)

std::unique_ptr<TransferEngine> Engine(const std::string& transport = "") {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  if (!transport.empty()) o.transport = transport;
  auto e = TransferEngine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

void Fill(const KvPool& pool, int seed) {
  const KvLayout& l = pool.layout();
  for (uint32_t b = 0; b < l.buffer_count(); ++b) {
    for (uint64_t i = 0; i < l.buffer_bytes(); ++i) {
      pool.buffer(b)[i] = static_cast<char>(i * 31 + b * 7 + seed);
    }
  }
}

// Every (src -> dst) page of every layer and buffer is identical.
bool PagesMatch(const KvPool& a, const KvPool& b, const std::vector<uint32_t>& src,
                const std::vector<uint32_t>& dst) {
  const KvLayout& l = a.layout();
  for (uint32_t layer = 0; layer < l.layers; ++layer) {
    for (uint32_t kv = 0; kv < l.buffers_per_layer(); ++kv) {
      for (size_t i = 0; i < src.size(); ++i) {
        if (std::memcmp(a.page(layer, kv, src[i]), b.page(layer, kv, dst[i]), l.page_bytes())) {
          return false;
        }
      }
    }
  }
  return true;
}

struct Pair {
  std::unique_ptr<TransferEngine> prefill_engine, decode_engine;
  std::unique_ptr<KvSender> sender;
  std::unique_ptr<KvReceiver> receiver;
  Pair(KvPool src, KvPool dst, KvSender::Options so = {}, KvReceiver::Options ro = {},
       const std::string& transport = "")
      : prefill_engine(Engine(transport)), decode_engine(Engine(transport)) {
    sender = *KvSender::Create(prefill_engine.get(), std::move(src), so);
    receiver = *KvReceiver::Create(decode_engine.get(), std::move(dst), ro);
  }
};

std::vector<std::vector<char>> SeparateBuffers(const KvLayout& l) {
  return std::vector<std::vector<char>>(l.buffer_count(), std::vector<char>(l.buffer_bytes()));
}

TEST(KvCache, WholeAndLayerWiseRequestsArriveWithAuxAfterTheData) {
  for (bool combined : {false, true}) {
    SCOPED_TRACE(combined ? "MLA (combined)" : "GQA (K and V)");
    const KvLayout l{6, combined, 16, 512, 48};
    // The prefill pool is one allocation; the decode pool separate buffers.
    KvPool src = *KvPool::Allocate(l);
    Fill(src, 1);
    auto storage = SeparateBuffers(l);
    std::vector<void*> ptrs;
    for (auto& b : storage) ptrs.push_back(b.data());
    KvPool dst = *KvPool::Wrap(l, ptrs);
    Pair p(src, dst);
    const std::string peer = p.decode_engine->address();
    std::vector<uint32_t> s = {3, 4, 5, 6, 20, 21, 40, 7}, d = {10, 11, 12, 13, 0, 1, 47, 30};
    // Whole-request mode, with the decode side waiting in another thread.
    std::thread waiter([&] {
      auto st = p.receiver->Wait("req-whole", absl::Seconds(10));
      ASSERT_TRUE(st.ok()) << st.status();
      ASSERT_EQ(st->state, KvReceiver::State::kComplete);
      EXPECT_EQ(st->aux, std::string("first token \0 42", 16));
      // Seen complete: every byte is already there.
      EXPECT_TRUE(PagesMatch(src, dst, s, d));
    });
    ASSERT_TRUE(p.sender->Send("req-whole", peer, s, d, std::string("first token \0 42", 16)).ok());
    waiter.join();
    // Layer-wise mode.
    Fill(src, 2);
    auto h = p.sender->Begin("req-layers", peer, s, d);
    ASSERT_TRUE(h.ok()) << h.status();
    for (uint32_t layer = 0; layer < l.layers; ++layer) {
      ASSERT_TRUE(p.sender->SendLayer(*h, layer).ok());
    }
    ASSERT_TRUE(p.sender->Finish(*h, "").ok());
    auto st = p.receiver->Wait("req-layers", absl::Seconds(10));
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->state, KvReceiver::State::kComplete);
    EXPECT_TRUE(PagesMatch(src, dst, s, d));
    EXPECT_EQ(p.receiver->Poll("never-sent").state, KvReceiver::State::kPending);
  }
}

TEST(KvCache, CancelFailsTheRequestOnBothSidesAndTheEngineStaysUsable) {
  const KvLayout l{8, false, 16, 256, 32};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  Fill(src, 3);
  Pair p(src, dst);
  const std::string peer = p.decode_engine->address();
  std::vector<uint32_t> s = {1, 2, 3}, d = {4, 5, 6};
  auto h = p.sender->Begin("doomed", peer, s, d);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(p.sender->SendLayer(*h, 0).ok());
  ASSERT_TRUE(p.sender->Cancel(*h, "client went away").ok());
  EXPECT_EQ(p.sender->SendLayer(*h, 1).code(), absl::StatusCode::kNotFound);
  auto st = p.receiver->Wait("doomed", absl::Seconds(5));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, KvReceiver::State::kFailed);
  EXPECT_NE(st->error.message().find("cancelled: client went away"), std::string::npos);
  // Layers after the cancel were never sent.
  EXPECT_TRUE(std::memcmp(dst.page(7, 0, 4), std::vector<char>(l.page_bytes(), 0).data(),
                          l.page_bytes()) == 0);
  ASSERT_TRUE(p.sender->Send("next", peer, s, d, "ok").ok());
  EXPECT_EQ(p.receiver->Wait("next", absl::Seconds(5))->state, KvReceiver::State::kComplete);
  EXPECT_TRUE(PagesMatch(src, dst, s, d));
}

// With checksums the receiver checks every page before reporting the
// request complete: intact pages pass (and the aux payload survives), a
// page changed between landing and the check fails the request with
// kDataLoss and is counted.
TEST(KvCache, ChecksumsDetectACorruptedPage) {
  const KvLayout l{4, false, 16, 128, 16};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  Fill(src, 5);
  KvSender::Options so;
  so.checksums = true;
  Pair p(src, dst, so);
  auto& sender = p.sender;
  auto& receiver = p.receiver;
  const std::string peer = p.decode_engine->address();
  std::vector<uint32_t> s = {0, 1, 2, 9}, d = {5, 6, 7, 3};
  ASSERT_TRUE(sender->Send("intact", peer, s, d, std::string("aux\0bytes", 9)).ok());
  auto ok = receiver->Wait("intact", absl::Seconds(10));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->state, KvReceiver::State::kComplete) << ok->error;
  EXPECT_EQ(ok->aux, std::string("aux\0bytes", 9));
  EXPECT_TRUE(PagesMatch(src, dst, s, d));

  // The data lands, then one bit of destination page 6 (V of layer 2)
  // flips before the receiver looks at the completion.
  auto h = sender->Begin("flipped", peer, s, d);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(sender->SendAll(*h).ok());
  ASSERT_TRUE(sender->Finish(*h, "aux").ok());
  dst.page(2, 1, 6)[100] ^= 0x10;
  auto bad = receiver->Wait("flipped", absl::Seconds(10));
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->state, KvReceiver::State::kFailed);
  EXPECT_EQ(bad->error.code(), absl::StatusCode::kDataLoss) << bad->error;
  EXPECT_NE(bad->error.message().find("page 6"), std::string::npos) << bad->error;
  EXPECT_EQ(receiver->checksum_failures(), 1u);

  // Too many pages for one checksummed completion is refused up front.
  const KvLayout big{1, true, 1, 64, KvSender::kMaxChecksumPages + 1};
  KvPool big_src = *KvPool::Allocate(big), big_dst = *KvPool::Allocate(big);
  auto big_decode = Engine();
  auto big_receiver = *KvReceiver::Create(big_decode.get(), big_dst);
  auto big_sender = *KvSender::Create(p.prefill_engine.get(), big_src, so);
  std::vector<uint32_t> all(big.pages);
  for (uint32_t i = 0; i < big.pages; ++i) all[i] = i;
  EXPECT_EQ(big_sender->Begin("huge", big_decode->address(), all, all).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A request expected from one prefill instance ignores words about it from
// any other engine (a dead prefill's successor reusing the id, a stray
// sender); a word that came before Expect stands.
TEST(KvCache, WordsFromAnotherEngineAreIgnoredForAnExpectedRequest) {
  const KvLayout l{2, false, 16, 256, 16};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  Fill(src, 7);
  Pair p(src, dst);
  auto stray_engine = Engine();
  auto stray = *KvSender::Create(stray_engine.get(), *KvPool::Allocate(l));
  const std::string peer = p.decode_engine->address();
  ASSERT_TRUE(
      p.receiver->Expect("x", p.prefill_engine->address(), p.prefill_engine->engine_id()).ok());
  ASSERT_TRUE(stray->Send("x", peer, {1}, {1}, "from the stray").ok());
  EXPECT_EQ(p.receiver->Poll("x").state, KvReceiver::State::kPending);
  EXPECT_EQ(p.receiver->ignored_words(), 1u);
  ASSERT_TRUE(p.sender->Send("x", peer, {2}, {3}, "from the prefill").ok());
  auto st = p.receiver->Wait("x", absl::Seconds(5));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, KvReceiver::State::kComplete);
  EXPECT_EQ(st->aux, "from the prefill");
  // Finished before it was declared: Expect leaves it complete.
  ASSERT_TRUE(p.sender->Send("early", peer, {4}, {5}, "quick").ok());
  ASSERT_TRUE(p.receiver->Expect("early", p.prefill_engine->address()).ok());
  EXPECT_EQ(p.receiver->Wait("early", absl::Seconds(5))->state, KvReceiver::State::kComplete);
}

// A word said twice (its first reply was lost) or late, about an attempt
// at a request the decode finished and forgot, never finishes the request
// the id is reused for. The words are sent raw here, as a sender's retry
// would resend them.
TEST(KvCache, AWordFromAForgottenAttemptDoesNotFinishTheIdsReuse) {
  const KvLayout l{2, false, 16, 256, 16};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  Fill(src, 9);
  Pair p(src, dst);
  const std::string peer = p.decode_engine->address();
  auto seg = p.prefill_engine->OpenSegment(peer);
  ASSERT_TRUE(seg.ok()) << seg.status();
  const std::string sep(1, '\0');
  auto word = [&](const std::string& token, const std::string& aux) {
    return absl::StrCat("kv2", sep, "done", sep, "r", sep, token, sep, aux);
  };
  ASSERT_TRUE(p.prefill_engine->Notify(*seg, word("00000000000000a1", "first")).ok());
  auto first = p.receiver->Wait("r", absl::Seconds(5));
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->aux, "first");
  p.receiver->Forget("r");
  ASSERT_TRUE(
      p.receiver->Expect("r", p.prefill_engine->address(), p.prefill_engine->engine_id()).ok());
  // The first attempt's word again: ignored.
  ASSERT_TRUE(p.prefill_engine->Notify(*seg, word("00000000000000a1", "first")).ok());
  EXPECT_EQ(p.receiver->Wait("r", absl::Milliseconds(200)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(p.receiver->ignored_words(), 1u);
  // The new attempt finishes it, bytes and all.
  ASSERT_TRUE(p.sender->Send("r", peer, {1, 2}, {3, 4}, "second").ok());
  auto second = p.receiver->Wait("r", absl::Seconds(5));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->state, KvReceiver::State::kComplete);
  EXPECT_EQ(second->aux, "second");
  EXPECT_TRUE(PagesMatch(src, dst, {1, 2}, {3, 4}));
  // A sender from before attempt tokens ("kv1" words) is still understood.
  ASSERT_TRUE(
      p.prefill_engine->Notify(*seg, absl::StrCat("kv1", sep, "fail", sep, "old", sep, "why"))
          .ok());
  auto old = p.receiver->Wait("old", absl::Seconds(5));
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(old->state, KvReceiver::State::kFailed);
  EXPECT_NE(old->error.message().find("why"), std::string::npos);
}

// Words about requests nobody expects (a prefill quicker than its decode's
// Expect, or a peer sending words for made-up ids) are kept, but bounded:
// at most kMaxEarlyWords of them and kMaxEarlyBytes of aux, the oldest
// dropped first, and none longer than early_word_ttl. A request expected or
// waited for later still finds its word.
TEST(KvCache, WordsNobodyExpectsAreKeptWithinBounds) {
  const KvLayout l{2, false, 16, 256, 16};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  KvReceiver::Options ro;
  ro.early_word_ttl = absl::Seconds(2);
  Pair p(src, dst, {}, ro);
  const std::string peer = p.decode_engine->address();
  auto seg = p.prefill_engine->OpenSegment(peer);
  ASSERT_TRUE(seg.ok()) << seg.status();
  const std::string sep(1, '\0');
  auto word = [&](const std::string& id, const std::string& aux) {
    return absl::StrCat("kv2", sep, "done", sep, id, sep, "00000000000000b1", sep, aux);
  };
  // Sent as the KV layer sends its words: confirmable.
  TransferEngine::NotifyOptions as_word;
  as_word.confirmable = true;
  // Eight words with 1 MiB of aux each (under the engine's inbox limit):
  // only what fits in kMaxEarlyBytes stays, the newest.
  const std::string mib((1 << 20) - 64, 'a');
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(p.prefill_engine->Notify(*seg, word(absl::StrCat("big", i), mib), as_word).ok());
  }
  // Then more small words than kMaxEarlyWords.
  const int small = static_cast<int>(KvReceiver::kMaxEarlyWords) + 100;
  for (int i = 0; i < small; ++i) {
    ASSERT_TRUE(p.prefill_engine->Notify(*seg, word(absl::StrCat("s", i), "x"), as_word).ok());
  }
  // Notify returns once the decode's engine has the word: a Poll of an
  // unrelated id takes them all in.
  (void)p.receiver->Poll("unrelated");
  // Four big words fit in kMaxEarlyBytes and four were pushed out; then the
  // small ones pushed out the other four, and 100 of their own.
  EXPECT_EQ(p.receiver->dropped_early_words(), 8u + 100u);
  EXPECT_EQ(p.receiver->Poll("big7").state, KvReceiver::State::kPending);
  EXPECT_EQ(p.receiver->Poll("s99").state, KvReceiver::State::kPending);
  // The newest are still there for a decode that asks later.
  auto last = p.receiver->Wait(absl::StrCat("s", small - 1), absl::Seconds(1));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->state, KvReceiver::State::kComplete);
  EXPECT_EQ(last->aux, "x");
  ASSERT_TRUE(p.receiver->Expect("s100", p.prefill_engine->address()).ok());
  EXPECT_EQ(p.receiver->Poll("s100").state, KvReceiver::State::kComplete);
  // After early_word_ttl the rest are gone.
  absl::SleepFor(absl::Milliseconds(2100));
  (void)p.receiver->Poll("unrelated");
  EXPECT_EQ(p.receiver->dropped_early_words(), 8u + small - 2);  // all but the two claimed
  EXPECT_EQ(p.receiver->Poll("s200").state, KvReceiver::State::kPending);
}

// The receiver takes only the KV layer's words from the engine's inbox: an
// application's own notifications, sent around a KV request while a
// decode thread waits on the receiver, stay in the engine for the
// application, in order, and no KV word reaches it.
TEST(KvCache, TheReceiverLeavesTheApplicationsNotificationsInTheEngine) {
  const KvLayout l{2, false, 16, 256, 16};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  Fill(src, 5);
  Pair p(src, dst);
  const std::string peer = p.decode_engine->address();
  auto seg = p.prefill_engine->OpenSegment(peer);
  ASSERT_TRUE(seg.ok()) << seg.status();
  ASSERT_TRUE(p.prefill_engine->Notify(*seg, "app: before").ok());
  std::thread waiter([&] {
    auto st = p.receiver->Wait("r", absl::Seconds(10));
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->state, KvReceiver::State::kComplete);
  });
  ASSERT_TRUE(p.sender->Send("r", peer, {1}, {2}, "aux").ok());
  ASSERT_TRUE(p.prefill_engine->Notify(*seg, "app: after").ok());
  waiter.join();
  std::vector<std::string> seen;
  for (const Notification& n : p.decode_engine->TakeNotifications()) seen.push_back(n.message);
  EXPECT_EQ(seen, (std::vector<std::string>{"app: before", "app: after"}));
  EXPECT_EQ(p.receiver->Poll("r").state, KvReceiver::State::kComplete);
  EXPECT_TRUE(p.receiver->TakeOtherNotifications().empty());
}

TEST(KvCache, BadRequestsAreRefusedBeforeSending) {
  const KvLayout l{2, false, 16, 256, 16};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  Pair p(src, dst);
  const std::string peer = p.decode_engine->address();
  EXPECT_EQ(p.sender->Begin("r", peer, {1}, {16}).status().code(),
            absl::StatusCode::kInvalidArgument);  // past the decode pool
  EXPECT_EQ(p.sender->Begin("r", peer, {1, 2}, {3, 3}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.sender->Begin("", peer, {1}, {1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A decode engine with a differently shaped pool.
  auto other_engine = Engine();
  auto other = KvReceiver::Create(other_engine.get(), *KvPool::Allocate({2, false, 16, 128, 16}));
  ASSERT_TRUE(other.ok());
  auto mismatch = p.sender->Begin("r", other_engine->address(), {1}, {1});
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kFailedPrecondition);
  // An engine that has no KV receiver at all.
  auto bare = Engine();
  EXPECT_EQ(p.sender->Begin("r", bare->address(), {1}, {1}).status().code(),
            absl::StatusCode::kNotFound);
  // Nothing was sent, but a decode expecting the request is told it will
  // not come (and why).
  const KvReceiver::Status told = p.receiver->Poll("r");
  EXPECT_EQ(told.state, KvReceiver::State::kFailed);
  EXPECT_NE(told.error.message().find("not started"), std::string::npos) << told.error;
  EXPECT_EQ(p.receiver->Poll("never-begun").state, KvReceiver::State::kPending);
}

std::string Snapshot(const KvPool& pool) {
  const KvLayout& l = pool.layout();
  std::string out;
  for (uint32_t b = 0; b < l.buffer_count(); ++b) out.append(pool.buffer(b), l.buffer_bytes());
  return out;
}

// Words forged in the prefill's name (its engine id is public: any probe
// of it tells) by another engine: a "done" for pages that never landed, a
// "fail" and an "abrt" for a request expected from the prefill. The prefill,
// asked at its address, did not send them: all are ignored, its links stay
// up, and its own words then finish the request.
TEST(KvCache, WordsForgedInThePrefillsNameAreIgnored) {
  const KvLayout l{2, false, 16, 256, 16};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  Fill(src, 5);
  Pair p(src, dst);
  const std::string peer = p.decode_engine->address();
  const uint64_t prefill_id = p.prefill_engine->engine_id();
  ASSERT_TRUE(p.sender->Send("warm", peer, {0}, {0}, "").ok());  // the prefill's links are up
  ASSERT_EQ(p.receiver->Wait("warm", absl::Seconds(5))->state, KvReceiver::State::kComplete);
  ASSERT_TRUE(p.receiver->Expect("x", p.prefill_engine->address(), prefill_id).ok());
  const std::string sep(1, '\0');
  auto forge = [&](const std::string& kind, const std::string& body) {
    const std::string word =
        absl::StrCat("kv2", sep, kind, sep, "x", sep, "00000000000000f0", sep, body);
    auto reply = handshake::NewTcpNetwork()->Call(
        peer,
        handshake::Frame{handshake::MessageType::kNotify,
                         handshake::Encode(handshake::Notify{prefill_id, word, 0})},
        absl::Seconds(5));
    ASSERT_TRUE(reply.ok()) << reply.status();
  };
  forge("done", "forged aux");
  EXPECT_EQ(p.receiver->Poll("x").state, KvReceiver::State::kPending);
  forge("fail", "forged failure");
  forge("abrt", "forged abort");
  EXPECT_EQ(p.receiver->Poll("x").state, KvReceiver::State::kPending);
  EXPECT_EQ(p.receiver->unconfirmed_words(), 3u);
  EXPECT_TRUE(p.decode_engine->HasLinksFrom(prefill_id)) << "a forged abort cut its links";
  ASSERT_TRUE(p.sender->Send("x", peer, {1, 2}, {3, 4}, "real aux").ok());
  auto st = p.receiver->Wait("x", absl::Seconds(5));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->state, KvReceiver::State::kComplete) << st->error;
  EXPECT_EQ(st->aux, "real aux");
  EXPECT_TRUE(PagesMatch(src, dst, {1, 2}, {3, 4}));
}

// A TCP proxy in front of `target` that can stop forwarding (the
// handshake of a peer starved or cut off, while its other paths work).
class PausableProxy {
 public:
  explicit PausableProxy(const std::string& target) : target_(*net::ParseHostPort(target)) {
    auto l = net::Listen("127.0.0.1", 0, {0, 0});
    listener_ = std::move(l->fd);
    address_ = absl::StrCat("127.0.0.1:", l->address.port());
    acceptor_ = std::thread([this] { Accept(); });
  }
  ~PausableProxy() {
    stop_ = true;
    ::shutdown(listener_.get(), SHUT_RDWR);
    acceptor_.join();  // then nothing adds to threads_
    for (std::thread& t : threads_) t.join();
  }
  const std::string& address() const { return address_; }
  void Pause() { paused_ = true; }
  void Resume() { paused_ = false; }

 private:
  void Accept() {
    while (!stop_) {
      auto c = net::Accept(listener_.get(), absl::Milliseconds(50));
      if (!c.ok()) continue;
      auto up = net::Connect(target_, absl::Seconds(2));
      if (!up.ok()) continue;
      auto a = std::make_shared<net::Fd>(std::move(*c)),
           b = std::make_shared<net::Fd>(std::move(*up));
      threads_.emplace_back([this, a, b] { Pump(a->get(), b->get()); });
      threads_.emplace_back([this, a, b] { Pump(b->get(), a->get()); });
    }
  }
  void Pump(int from, int to) {
    char buf[16 << 10];
    while (!stop_) {
      if (paused_) {
        absl::SleepFor(absl::Milliseconds(5));
        continue;
      }
      pollfd p{from, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const ssize_t n = ::recv(from, buf, sizeof buf, 0);
      if (n <= 0 || !net::WriteFull(to, buf, n, absl::Now() + absl::Seconds(2)).ok()) {
        ::shutdown(to, SHUT_RDWR);
        return;
      }
    }
  }
  net::HostPort target_;
  net::Fd listener_;
  std::string address_;
  std::atomic<bool> stop_{false}, paused_{false};
  std::thread acceptor_;
  std::vector<std::thread> threads_;  // the pumps (only the acceptor adds)
};

// The prefill's handshake goes silent (its probes time out) while its
// layers keep landing: it is alive, and is neither declared dead nor
// fenced. Its request completes once its handshake answers again (its
// word is confirmed then). Before data links counted, it was fenced after
// ¾ of peer_timeout and its next layer refused.
TEST(KvCache, APrefillWhoseWritesArriveIsAliveWhileItsHandshakeIsSilent) {
  const KvLayout l{10, false, 16, 256, 16};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  Fill(src, 11);
  KvReceiver::Options ro;
  ro.peer_timeout = absl::Seconds(1);
  // Over TCP: the decode sees the prefill's writes arrive. One-sided RDMA
  // WRITEs never reach its CPU (Transport::InputCount is 0 there).
  Pair p(src, dst, {}, ro, "tcp");
  PausableProxy proxy(p.prefill_engine->address());
  const std::string peer = p.decode_engine->address();
  ASSERT_TRUE(p.receiver->Expect("x", proxy.address()).ok());  // presents itself through it
  auto h = p.sender->Begin("x", peer, {1, 2}, {5, 6});
  ASSERT_TRUE(h.ok()) << h.status();
  proxy.Pause();
  for (uint32_t layer = 0; layer < l.layers; ++layer) {  // 2 s of layers: twice peer_timeout
    absl::SleepFor(absl::Milliseconds(200));
    ASSERT_TRUE(p.sender->SendLayer(*h, layer).ok()) << "layer " << layer;
  }
  EXPECT_FALSE(p.decode_engine->PeerFenced(p.prefill_engine->engine_id()));
  EXPECT_EQ(p.receiver->Poll("x").state, KvReceiver::State::kPending);
  proxy.Resume();
  ASSERT_TRUE(p.sender->Finish(*h, "alive").ok());
  auto st = p.receiver->Wait("x", absl::Seconds(5));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->state, KvReceiver::State::kComplete) << st->error;
  EXPECT_TRUE(PagesMatch(src, dst, {1, 2}, {5, 6}));
}

// Expect(request, X's address, V's engine id): the engine answering at X
// presents X's id, not V's. The request fails (the named instance is not
// there), but V, which never presented itself at X, is not fenced: it still
// delivers to this decode.
TEST(KvCache, AnIdTheAddressDidNotPresentIsNeverFenced) {
  const KvLayout l{2, false, 16, 256, 16};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  Fill(src, 3);
  KvReceiver::Options ro;
  ro.peer_timeout = absl::Seconds(1);
  Pair p(src, dst, {}, ro);
  auto x = Engine();
  const std::string peer = p.decode_engine->address();
  ASSERT_TRUE(p.receiver->Expect("r", x->address(), p.prefill_engine->engine_id()).ok());
  auto st = p.receiver->Wait("r", absl::Seconds(5));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->state, KvReceiver::State::kFailed);
  EXPECT_NE(st->error.message().find("not the engine named"), std::string::npos) << st->error;
  EXPECT_FALSE(p.decode_engine->PeerFenced(p.prefill_engine->engine_id()));
  EXPECT_EQ(p.decode_engine->GetCounters().peers_fenced, 0u);
  ASSERT_TRUE(p.sender->Send("v", peer, {1}, {1}, "from v").ok());
  auto v = p.receiver->Wait("v", absl::Seconds(5));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->state, KvReceiver::State::kComplete);
}

// Fencing on whatever transport the engines have (TCP here, verbs inside
// the Soft-RoCE VM): once the decode fences the prefill instance, nothing
// it sends lands, over the links it already had or new ones, and its words
// are refused.
TEST(KvCache, AFencedPrefillLandsNothingMore) {
  const KvLayout l{2, false, 16, 256, 16};
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  Fill(src, 9);
  KvSender::Options so;
  so.timeout = absl::Seconds(1);
  so.tell_timeout = absl::Milliseconds(200);
  Pair p(src, dst, so);
  auto& sender = p.sender;
  auto& receiver = p.receiver;
  const auto& prefill = p.prefill_engine;
  const auto& decode = p.decode_engine;
  const std::string peer = decode->address();
  ASSERT_TRUE(sender->Send("before", peer, {0, 1}, {0, 1}, "").ok());  // links are up
  ASSERT_EQ(receiver->Wait("before", absl::Seconds(5))->state, KvReceiver::State::kComplete);

  EXPECT_EQ(decode->GetCounters().peers_fenced, 0u);
  decode->FencePeer(prefill->engine_id(), "the test fences it");
  decode->FencePeer(prefill->engine_id(), "twice");  // counted (and logged) once
  EXPECT_TRUE(decode->PeerFenced(prefill->engine_id()));
  EXPECT_EQ(decode->GetCounters().peers_fenced, 1u);
  const std::string fenced = Snapshot(dst);
  Fill(src, 10);  // different bytes, so a landing write would show
  auto h = sender->Begin("after", peer, {2, 3}, {2, 3});
  if (h.ok()) {
    (void)sender->SendLayer(*h, 0);
    (void)sender->SendLayer(*h, 1);
    EXPECT_FALSE(sender->Finish(*h, "").ok());  // nothing arrived, no word accepted
  }
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(Snapshot(dst) == fenced) << "a fenced prefill's write landed";
  EXPECT_NE(receiver->Poll("after").state, KvReceiver::State::kComplete);
  // The prefill, alive all along, learned of the fence from the refusals:
  // its next request goes at the next epoch, and completes, without a
  // restart. What it sent at the fenced epoch stays refused.
  EXPECT_EQ(prefill->PeerEpoch(*prefill->OpenSegment(peer)).value_or(0), 1u);
  ASSERT_TRUE(receiver->Expect("again", prefill->address()).ok());
  ASSERT_TRUE(sender->Send("again", peer, {2, 3}, {2, 3}, "back").ok());
  auto again = receiver->Wait("again", absl::Seconds(5));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->state, KvReceiver::State::kComplete) << again->error;
  EXPECT_EQ(again->aux, "back");
  EXPECT_TRUE(PagesMatch(src, dst, {2, 3}, {2, 3}));
  EXPECT_NE(receiver->Poll("after").state, KvReceiver::State::kComplete);
  EXPECT_FALSE(decode->PeerFenced(prefill->engine_id()));
  // Fenced again (at epoch 1): counted again.
  decode->FencePeer(prefill->engine_id(), "once more");
  EXPECT_EQ(decode->GetCounters().peers_fenced, 2u);
  // Another prefill is not affected.
  auto other_engine = Engine();
  auto other = *KvSender::Create(other_engine.get(), src);
  ASSERT_TRUE(other->Send("other", peer, {4}, {4}, "").ok());
  EXPECT_EQ(receiver->Wait("other", absl::Seconds(5))->state, KvReceiver::State::kComplete);
}

// A decode that only waits (no Expect) learns its prefill from the begin
// word, confirmed by the engine at the address the word names, and is told
// of its death within peer_timeout. A begin word forged in that prefill's
// name by another engine is not confirmed there, and adopts nothing.
TEST(KvCache, ADecodeThatOnlyWaitsWatchesThePrefillItsBeginWordNamed) {
  const KvLayout l{2, false, 16, 256, 16};
  KvReceiver::Options ro;
  ro.peer_timeout = absl::Seconds(1);
  Pair p(*KvPool::Allocate(l), *KvPool::Allocate(l), {}, ro);
  const std::string peer = p.decode_engine->address();
  // Forged: "begn" for "f" in the prefill's name, naming its address.
  const std::string sep(1, '\0');
  const std::string forged = absl::StrCat("kv2", sep, "begn", sep, "f", sep, "00000000000000f1",
                                          sep, p.prefill_engine->address());
  auto reply = handshake::NewTcpNetwork()->Call(
      peer,
      handshake::Frame{
          handshake::MessageType::kNotify,
          handshake::Encode(handshake::Notify{p.prefill_engine->engine_id(), forged, 0})},
      absl::Seconds(5));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(p.receiver->Poll("f").state, KvReceiver::State::kPending);
  EXPECT_EQ(p.receiver->unconfirmed_words(), 1u);

  auto h = p.sender->Begin("w", peer, {1}, {1});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(p.sender->SendLayer(*h, 0).ok());
  EXPECT_EQ(p.receiver->Poll("w").state, KvReceiver::State::kPending);  // adopted
  p.sender.reset();
  p.prefill_engine.reset();  // dies without a word
  const absl::Time died = absl::Now();
  auto st = p.receiver->Wait("w", absl::Seconds(10));
  const absl::Duration took = absl::Now() - died;
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->state, KvReceiver::State::kFailed);
  EXPECT_EQ(st->error.code(), absl::StatusCode::kUnavailable) << st->error;
  EXPECT_LT(took, absl::Seconds(1) + absl::Milliseconds(1500));
  // The forged one's request stays as it was: nothing watched it.
  EXPECT_EQ(p.receiver->Poll("f").state, KvReceiver::State::kPending);
}

// The time from a prefill's death (its engine gone) to the decode's report
// of an expected request, on this transport; printed for the record.
TEST(KvCache, AnExpectedRequestFailsWhenItsPrefillDies) {
  const KvLayout l{2, false, 16, 256, 16};
  KvReceiver::Options ro;
  ro.peer_timeout = absl::Seconds(1);
  Pair p(*KvPool::Allocate(l), *KvPool::Allocate(l), {}, ro);
  auto& receiver = p.receiver;
  const auto& decode = p.decode_engine;
  auto h = p.sender->Begin("orphan", decode->address(), {1}, {1});
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(
      receiver->Expect("orphan", p.prefill_engine->address(), p.prefill_engine->engine_id()).ok());
  ASSERT_TRUE(p.sender->SendLayer(*h, 0).ok());
  absl::SleepFor(absl::Milliseconds(50));
  p.sender.reset();
  p.prefill_engine.reset();  // dies without a word
  const absl::Time died = absl::Now();
  auto st = receiver->Wait("orphan", absl::Seconds(10));
  const absl::Duration took = absl::Now() - died;
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->state, KvReceiver::State::kFailed);
  EXPECT_EQ(st->error.code(), absl::StatusCode::kUnavailable) << st->error;
  EXPECT_LT(took, absl::Seconds(1) + absl::Milliseconds(1500));
  std::printf("prefill death to the decode's report over %s: %s (peer_timeout 1 s)\n",
              decode->detection().transport.c_str(), absl::FormatDuration(took).c_str());
}

TEST(KvCache, APeerFailureFailsOnlyItsRequests) {
  const KvLayout l{2, false, 16, 256, 16};
  KvPool src = *KvPool::Allocate(l);
  Pair p(src, *KvPool::Allocate(l));
  auto survivor_engine = Engine();
  KvPool survivor_pool = *KvPool::Allocate(l);
  auto survivor = KvReceiver::Create(survivor_engine.get(), survivor_pool);
  ASSERT_TRUE(survivor.ok());
  auto doomed = p.sender->Begin("to-dead-peer", p.decode_engine->address(), {1}, {1});
  ASSERT_TRUE(doomed.ok());
  p.receiver.reset();
  p.decode_engine.reset();  // the decode process dies
  EXPECT_FALSE(p.sender->Finish(*doomed, "").ok());
  ASSERT_TRUE(p.sender->Send("to-live-peer", survivor_engine->address(), {2}, {3}, "").ok());
  EXPECT_EQ((*survivor)->Wait("to-live-peer", absl::Seconds(5))->state,
            KvReceiver::State::kComplete);
}

}  // namespace
}  // namespace kvferry
