// DeathOf from facts alone: when a probed prefill counts as dead.
#include "kv/prefill_probe.h"

#include <string>

#include "gtest/gtest.h"
#include "handshake/messages.h"
#include "net/socket.h"

namespace kvferry {
namespace kv_internal {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(4);  // a period of 1 s
const absl::Time kStart = absl::UnixEpoch() + absl::Hours(1);

PrefillState Known(uint64_t id, bool presented) {
  PrefillState p;
  p.engine_id = id;
  p.presented = presented;
  p.last_answer = kStart;
  return p;
}

bool Dead(const absl::Status& s, const std::string& says) {
  return s.code() == absl::StatusCode::kUnavailable &&
         s.message().find(says) != absl::string_view::npos;
}

TEST(DeathOf, AnAnswerFromTheSameInstanceOrAnyRefusalIsLife) {
  EXPECT_TRUE(
      DeathOf("h:1", Known(7, true), uint64_t{7}, kStart + absl::Hours(1), false, kTimeout).ok());
  // A refusal the peer sent (overloaded, fencing): its process answered.
  const absl::Status refusal =
      handshake::DecodeError(handshake::EncodeError(absl::ResourceExhaustedError("busy")));
  EXPECT_TRUE(
      DeathOf("h:1", Known(7, true), refusal, kStart + absl::Hours(1), false, kTimeout).ok());
}

TEST(DeathOf, AnotherInstanceAtTheAddressIsARestartOrAWrongName) {
  EXPECT_TRUE(Dead(DeathOf("h:1", Known(7, true), uint64_t{8}, kStart, false, kTimeout),
                   "the prefill at h:1 restarted"));
  EXPECT_TRUE(Dead(DeathOf("h:1", Known(7, false), uint64_t{8}, kStart, false, kTimeout),
                   "is not the engine named"));
  // Nothing known yet: whoever answers is it.
  EXPECT_TRUE(DeathOf("h:1", Known(0, false), uint64_t{8}, kStart, false, kTimeout).ok());
}

TEST(DeathOf, ARefusedPortIsDeathAtOnce) {
  const absl::Status refused = net::MarkRefused(absl::UnavailableError("connect: refused"));
  EXPECT_TRUE(Dead(DeathOf("h:1", Known(7, true), refused, kStart, false, kTimeout),
                   "is gone: its port refuses connections"));
}

TEST(DeathOf, SilenceIsDeathOnlyPastTheBoundAndWithQuietDataLinks) {
  const absl::Status silent = absl::DeadlineExceededError("no answer");
  // Within peer_timeout less a period: alive for now.
  EXPECT_TRUE(
      DeathOf("h:1", Known(7, true), silent, kStart + absl::Milliseconds(2999), false, kTimeout)
          .ok());
  EXPECT_TRUE(
      Dead(DeathOf("h:1", Known(7, true), silent, kStart + absl::Seconds(3), false, kTimeout),
           "has not answered for 3s"));
  // Its data links moved since the last probe: alive whatever the probe said.
  EXPECT_TRUE(
      DeathOf("h:1", Known(7, true), silent, kStart + absl::Seconds(30), true, kTimeout).ok());
}

}  // namespace
}  // namespace kv_internal
}  // namespace kvferry
