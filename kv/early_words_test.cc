// The early and begin words a KvReceiver keeps: bounded in number, bytes and
// age, the oldest dropped first and counted; what the application forgets
// or the receiver takes is not a drop.
#include "kv/early_words.h"

#include <string>

#include "gtest/gtest.h"

namespace kvferry {
namespace kv_internal {
namespace {

class ManualClock : public Clock {
 public:
  absl::Time Now() const override { return now_; }
  void SleepFor(absl::Duration d) override { now_ += d; }

 private:
  absl::Time now_ = absl::UnixEpoch() + absl::Hours(1);
};

EarlyWord WordWith(std::string aux, uint64_t engine_id = 7) {
  EarlyWord w;
  w.status.state = KvRequestState::kComplete;
  w.status.aux = std::move(aux);
  w.engine_id = engine_id;
  return w;
}

TEST(EarlyWords, KeptUntilTakenAndTakingIsNotADrop) {
  ManualClock clock;
  EarlyWords words(&clock, absl::Seconds(60));
  words.Keep("r1", WordWith("aux", 9));
  ASSERT_NE(words.Find("r1"), nullptr);
  EXPECT_EQ(words.Find("r1")->engine_id, 9u);
  std::optional<EarlyWord> w = words.Take("r1");
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->status.aux, "aux");
  EXPECT_EQ(words.Find("r1"), nullptr);
  EXPECT_FALSE(words.Take("r1").has_value());
  words.Keep("r2", WordWith(""));
  words.Forget("r2");
  EXPECT_EQ(words.Find("r2"), nullptr);
  EXPECT_EQ(words.dropped(), 0u);
}

TEST(EarlyWords, TheOldestGoFirstPastTheCountBound) {
  ManualClock clock;
  EarlyWords words(&clock, absl::Seconds(60));
  for (size_t i = 0; i < kMaxEarlyWords + 3; ++i) {
    words.Keep("r" + std::to_string(i), WordWith(""));
  }
  EXPECT_EQ(words.dropped(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(words.Find("r" + std::to_string(i)), nullptr) << i;
  EXPECT_NE(words.Find("r3"), nullptr);
  EXPECT_NE(words.Find("r" + std::to_string(kMaxEarlyWords + 2)), nullptr);
}

TEST(EarlyWords, TheOldestGoFirstPastTheByteBound) {
  ManualClock clock;
  EarlyWords words(&clock, absl::Seconds(60));
  const std::string third(kMaxEarlyBytes / 3 - 16, 'x');  // three fit, ids and all
  words.Keep("a", WordWith(third));
  words.Keep("b", WordWith(third));
  words.Keep("c", WordWith(third));
  EXPECT_EQ(words.dropped(), 0u);
  words.Keep("d", WordWith(third));  // "a" makes room
  EXPECT_EQ(words.dropped(), 1u);
  EXPECT_EQ(words.Find("a"), nullptr);
  EXPECT_NE(words.Find("d"), nullptr);
  // Taking one frees its bytes: the next fits without a drop.
  ASSERT_TRUE(words.Take("b").has_value());
  words.Keep("e", WordWith(third));
  EXPECT_EQ(words.dropped(), 1u);
  // One larger than the bound alone is dropped, and nothing else.
  words.Keep("huge", WordWith(std::string(kMaxEarlyBytes + 1, 'y')));
  EXPECT_EQ(words.dropped(), 2u);
  EXPECT_EQ(words.Find("huge"), nullptr);
  EXPECT_NE(words.Find("e"), nullptr);
}

TEST(EarlyWords, OldWordsExpire) {
  ManualClock clock;
  EarlyWords words(&clock, absl::Seconds(60));
  words.Keep("old", WordWith(""));
  clock.SleepFor(absl::Seconds(30));
  words.Keep("young", WordWith(""));
  words.Announce("begun", BegunWord{"10.0.0.1:5000", 3, {}});
  clock.SleepFor(absl::Seconds(30));
  words.Expire();
  EXPECT_EQ(words.Find("old"), nullptr);
  EXPECT_NE(words.Find("young"), nullptr);
  EXPECT_EQ(words.dropped(), 1u);
  // A begin word as old as the ttl is not handed out.
  clock.SleepFor(absl::Seconds(30));
  EXPECT_TRUE(words.Announced("begun"));
  EXPECT_FALSE(words.TakeBegun("begun").has_value());
  EXPECT_FALSE(words.Announced("begun"));
}

TEST(EarlyWords, BeginWordsAreBoundedToo) {
  ManualClock clock;
  EarlyWords words(&clock, absl::Seconds(60));
  for (size_t i = 0; i < kMaxEarlyWords; ++i) {
    words.Announce("r" + std::to_string(i), BegunWord{"h:1", i, {}});
    clock.SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(words.dropped(), 0u);
  words.Announce("r0", BegunWord{"h:2", 99, {}});  // the same request: replaced, not a drop
  EXPECT_EQ(words.dropped(), 0u);
  words.Announce("new", BegunWord{"h:3", 100, {}});  // the oldest (r1 now) goes
  EXPECT_EQ(words.dropped(), 1u);
  EXPECT_FALSE(words.Announced("r1"));
  std::optional<BegunWord> r0 = words.TakeBegun("r0");
  ASSERT_TRUE(r0.has_value());
  EXPECT_EQ(r0->prefill, "h:2");
  EXPECT_EQ(r0->engine_id, 99u);
}

}  // namespace
}  // namespace kv_internal
}  // namespace kvferry
