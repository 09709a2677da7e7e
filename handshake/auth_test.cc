// The authenticated handshake over real TCP: only holders of the secret get
// answers, every refusal is counted, nonces are single-use, and a client
// never accepts an unauthenticated reply.
#include "handshake/auth.h"

#include <atomic>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "gtest/gtest.h"
#include "handshake/hand_over.h"
#include "handshake/tcp_network.h"
#include "net/socket.h"

namespace kvferry {
namespace handshake {
namespace {

const std::string kSecret = "0123456789abcdef-shared-secret";

absl::StatusOr<std::unique_ptr<AuthenticatedNetwork>> Auth(std::string secret = kSecret) {
  AuthOptions o;
  o.secret = std::move(secret);
  return AuthenticatedNetwork::Create(NewTcpNetwork(), o);
}

// A loopback address of this test's own (127.0.0.0/8 is all loopback): a
// test run beside it (Bazel runs several at once) that still sends to a
// port it used before, now this server's, reaches 127.0.0.1, not this one,
// so the refusals a case counts are its own.
ServeOptions Loopback() {
  const uint64_t r = net::RandomU64();
  ServeOptions s;
  s.bind_host = absl::StrCat("127.", 1 + r % 254, ".", (r >> 8) % 256, ".", 1 + (r >> 16) % 254);
  return s;
}

// Answers describe with a "descriptor" holding secret keys.
Frame KeysHandler(const Frame& f) {
  if (f.type == MessageType::kDescribe) return Frame{MessageType::kDescriptor, "KEYS:" + f.payload};
  return ErrorFrame(absl::NotFoundError("nothing here"));
}

TEST(Auth, HmacMatchesRfc4231) {
  // RFC 4231 test case 2.
  const std::string tag = HmacSha256("Jefe", "what do ya want for nothing?");
  std::string hex;
  for (unsigned char c : tag) hex += absl::StrFormat("%02x", c);
  EXPECT_EQ(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(Auth, HoldersOfTheSecretTalk) {
  auto server_net = Auth();
  ASSERT_TRUE(server_net.ok()) << server_net.status();
  auto server = (*server_net)->Serve(Loopback(), KeysHandler);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Auth();
  ASSERT_TRUE(client.ok());
  auto reply =
      (*client)->Call((*server)->address(), Frame{MessageType::kDescribe, "x"}, absl::Seconds(5));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->type, MessageType::kDescriptor);
  EXPECT_EQ(reply->payload, "KEYS:x");
  // An error reply of the handler comes back as its status, authenticated.
  auto err =
      (*client)->Call((*server)->address(), Frame{MessageType::kProbe, ""}, absl::Seconds(5));
  EXPECT_EQ(err.status().code(), absl::StatusCode::kNotFound) << err.status();
  EXPECT_EQ((*server_net)->rejected(), 0u);
}

TEST(Auth, WithoutTheSecretNothingIsAnsweredAndEachAttemptCounts) {
  auto server_net = Auth();
  ASSERT_TRUE(server_net.ok());
  auto server = (*server_net)->Serve(Loopback(), KeysHandler);
  ASSERT_TRUE(server.ok());
  const std::string addr = (*server)->address();
  // A plain client: refused, no keys.
  auto plain = NewTcpNetwork()->Call(addr, Frame{MessageType::kDescribe, "x"}, absl::Seconds(5));
  ASSERT_FALSE(plain.ok());
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kUnauthenticated) << plain.status();
  EXPECT_EQ(plain.status().message().find("KEYS"), std::string::npos);
  for (MessageType t : {MessageType::kConnect, MessageType::kNotify, MessageType::kGetMetadata}) {
    EXPECT_EQ(NewTcpNetwork()->Call(addr, Frame{t, ""}, absl::Seconds(5)).status().code(),
              absl::StatusCode::kUnauthenticated);
  }
  // A client with another secret: refused too.
  auto wrong = Auth("another-secret-of-enough-length");
  ASSERT_TRUE(wrong.ok());
  auto bad = (*wrong)->Call(addr, Frame{MessageType::kDescribe, "x"}, absl::Seconds(5));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnauthenticated) << bad.status();
  // Five refused attempts. The last one went over the connection its
  // challenge used (pooled): if that connection broke, the client sent it
  // once more on a fresh one, which counts again (seen once under ASan in
  // CI).
  EXPECT_GE((*server_net)->rejected(), 5u);
  EXPECT_LE((*server_net)->rejected(), 6u);
}

// A client network that keeps the last frame it sent (an eavesdropper's
// recording of it).
struct Recorder : Network {
  std::unique_ptr<Network> inner = NewTcpNetwork();
  Frame last;
  absl::StatusOr<std::unique_ptr<Server>> Serve(const ServeOptions&, Handler) override {
    return absl::UnimplementedError("client only");
  }
  absl::StatusOr<Frame> Call(const std::string& peer, const Frame& f,
                             absl::Duration timeout) override {
    last = f;
    return inner->Call(peer, f, timeout);
  }
};

// An authenticated client over a Recorder (*rec: what it sends).
absl::StatusOr<std::unique_ptr<AuthenticatedNetwork>> RecordingClient(Recorder** rec) {
  auto recorder = std::make_unique<Recorder>();
  *rec = recorder.get();
  AuthOptions o;
  o.secret = kSecret;
  return AuthenticatedNetwork::Create(std::move(recorder), o);
}

TEST(Auth, ANonceIsGoodOnceAndATamperedRequestFails) {
  auto server_net = Auth();
  ASSERT_TRUE(server_net.ok());
  auto server = (*server_net)->Serve(Loopback(), KeysHandler);
  ASSERT_TRUE(server.ok());
  const std::string addr = (*server)->address();
  // Anyone gets a challenge (it reveals nothing).
  auto plain = NewTcpNetwork();
  auto nonce = plain->Call(addr, Frame{MessageType::kChallenge, ""}, absl::Seconds(5));
  ASSERT_TRUE(nonce.ok()) << nonce.status();
  ASSERT_EQ(nonce->payload.size(), 32u);
  // A real client's authenticated request, recorded on its way out, is
  // accepted once and refused when an eavesdropper replays it.
  Recorder* rec = nullptr;
  auto client = RecordingClient(&rec);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Call(addr, Frame{MessageType::kDescribe, "y"}, absl::Seconds(5)).ok());
  const Frame captured = rec->last;
  ASSERT_EQ(captured.type, MessageType::kAuthenticated);
  // Replayed as is: the nonce was used.
  auto replay = plain->Call(addr, captured, absl::Seconds(5));
  EXPECT_EQ(replay.status().code(), absl::StatusCode::kUnauthenticated);
  // One flipped payload byte under a fresh nonce fails the tag.
  ASSERT_TRUE((*client)->Call(addr, Frame{MessageType::kDescribe, "z"}, absl::Seconds(5)).ok());
  Frame tampered = rec->last;
  tampered.payload[tampered.payload.size() - 37] ^= 1;  // the payload byte
  EXPECT_EQ(plain->Call(addr, tampered, absl::Seconds(5)).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*server_net)->rejected(), 2u);
}

// A request authenticated for one engine is refused by another engine with
// the same secret (and by the same engine restarted): the server's nonce
// verifies only where it was made.
TEST(Auth, ARequestAuthenticatedForOneEngineIsRefusedByAnother) {
  auto a_net = Auth(), b_net = Auth();
  ASSERT_TRUE(a_net.ok() && b_net.ok());
  auto a = (*a_net)->Serve(Loopback(), KeysHandler);
  auto b = (*b_net)->Serve(Loopback(), KeysHandler);
  ASSERT_TRUE(a.ok() && b.ok());
  Recorder* rec = nullptr;
  auto client = RecordingClient(&rec);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE(
      (*client)->Call((*a)->address(), Frame{MessageType::kDescribe, "a"}, absl::Seconds(5)).ok());
  const Frame for_a = rec->last;
  auto replayed = NewTcpNetwork()->Call((*b)->address(), for_a, absl::Seconds(5));
  EXPECT_EQ(replayed.status().code(), absl::StatusCode::kUnauthenticated) << replayed.status();
  EXPECT_EQ((*b_net)->rejected(), 1u);
  // B itself still serves holders of the secret.
  EXPECT_TRUE(
      (*client)->Call((*b)->address(), Frame{MessageType::kDescribe, "b"}, absl::Seconds(5)).ok());
}

// Challenges cost the server no state: a flood of them between a client's
// challenge and its authenticated request does not push its nonce out.
TEST(Auth, AFloodOfChallengesCannotEvictAClientsNonce) {
  auto server_net = Auth();
  ASSERT_TRUE(server_net.ok());
  auto server = (*server_net)->Serve(Loopback(), [](const Frame& f) { return f; });
  ASSERT_TRUE(server.ok());
  const std::string addr = (*server)->address();
  struct Flooder : Network {
    std::unique_ptr<Network> inner = NewTcpNetwork();
    std::unique_ptr<Network> attacker = NewTcpNetwork();
    int floods = 0;
    absl::StatusOr<std::unique_ptr<Server>> Serve(const ServeOptions&, Handler) override {
      return absl::UnimplementedError("client only");
    }
    absl::StatusOr<Frame> Call(const std::string& peer, const Frame& f,
                               absl::Duration timeout) override {
      if (f.type == MessageType::kAuthenticated) {
        for (int i = 0; i < 10000; ++i) {
          if (attacker->Call(peer, Frame{MessageType::kChallenge, ""}, timeout).ok()) ++floods;
        }
      }
      return inner->Call(peer, f, timeout);
    }
  };
  auto flooder = std::make_unique<Flooder>();
  Flooder* flood = flooder.get();
  AuthOptions o;
  o.secret = kSecret;
  auto client = AuthenticatedNetwork::Create(std::move(flooder), o);
  ASSERT_TRUE(client.ok());
  auto reply = (*client)->Call(addr, Frame{MessageType::kProbe, "ok"}, absl::Seconds(30));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->payload, "ok");
  EXPECT_EQ(flood->floods, 10000);
}

// Payloads cross the network encrypted: what is on the wire, either way,
// contains neither the request's nor the reply's bytes.
TEST(Auth, PayloadsAreEncryptedOnTheWire) {
  auto server_net = Auth();
  ASSERT_TRUE(server_net.ok());
  auto server = (*server_net)->Serve(Loopback(), [](const Frame& f) {
    return Frame{MessageType::kProbeReply, f.payload + "|reply-marker-9f3a"};
  });
  ASSERT_TRUE(server.ok());
  struct Wiretap : Network {
    std::unique_ptr<Network> inner = NewTcpNetwork();
    std::string seen;
    absl::StatusOr<std::unique_ptr<Server>> Serve(const ServeOptions&, Handler) override {
      return absl::UnimplementedError("client only");
    }
    absl::StatusOr<Frame> Call(const std::string& peer, const Frame& f,
                               absl::Duration timeout) override {
      seen += f.payload;
      auto reply = inner->Call(peer, f, timeout);
      if (reply.ok()) seen += reply->payload;
      return reply;
    }
  };
  auto tap = std::make_unique<Wiretap>();
  Wiretap* wire = tap.get();
  AuthOptions o;
  o.secret = kSecret;
  auto client = AuthenticatedNetwork::Create(std::move(tap), o);
  ASSERT_TRUE(client.ok());
  auto reply = (*client)->Call((*server)->address(),
                               Frame{MessageType::kProbe, "request-marker-51c2"}, absl::Seconds(5));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->payload, "request-marker-51c2|reply-marker-9f3a");
  EXPECT_EQ(wire->seen.find("request-marker"), std::string::npos);
  EXPECT_EQ(wire->seen.find("reply-marker"), std::string::npos);
  EXPECT_GT(wire->seen.size(), 40u);
}

// A flood of refused requests is counted in full but logged a line a
// second at most, not a line per request.
TEST(Auth, RefusalsAreCountedButTheirLogIsRateLimited) {
  auto server_net = Auth();
  ASSERT_TRUE(server_net.ok());
  auto server = (*server_net)->Serve(Loopback(), [](const Frame& f) { return f; });
  ASSERT_TRUE(server.ok());
  std::atomic<int> lines{0};
  SetLogSink([&](LogSeverity severity, absl::string_view text) {
    if (severity == LogSeverity::kWarning && absl::StrContains(text, "refused")) ++lines;
  });
  auto plain = NewTcpNetwork();
  const absl::Time start = absl::Now();
  for (int i = 0; i < 2000; ++i) {
    (void)plain->Call((*server)->address(), Frame{MessageType::kDescribe, ""}, absl::Seconds(5));
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  SetLogSink(nullptr);
  EXPECT_EQ((*server_net)->rejected(), 2000u);
  EXPECT_LE(lines.load(), static_cast<int>(seconds) + 2);
}

TEST(Auth, AClientNeverAcceptsAnUnauthenticatedServer) {
  // A server without the secret that answers challenges anyway.
  auto server = NewTcpNetwork()->Serve(Loopback(), [](const Frame& f) {
    if (f.type == MessageType::kChallenge) {
      return Frame{MessageType::kChallengeReply, std::string(16, 'n')};
    }
    return Frame{MessageType::kAuthenticatedReply, "forged"};
  });
  ASSERT_TRUE(server.ok());
  auto client = Auth();
  ASSERT_TRUE(client.ok());
  auto reply =
      (*client)->Call((*server)->address(), Frame{MessageType::kDescribe, ""}, absl::Seconds(5));
  EXPECT_EQ(reply.status().code(), absl::StatusCode::kUnauthenticated) << reply.status();
}

// An authenticated network's connections carry wrapped frames: it offers
// no hand-over (the requester connects its links the usual way), though
// the TCP network inside it does, and its server answers kConnectLinksHere
// like any request, keeping the connection.
TEST(Auth, ConnectionsAreNeverHandedOver) {
  std::unique_ptr<Network> plain = NewTcpNetwork();
  ASSERT_NE(ExtensionOf<HandOver>(plain.get()), nullptr);
  auto server_net = Auth();
  ASSERT_TRUE(server_net.ok()) << server_net.status();
  EXPECT_EQ(ExtensionOf<HandOver>(server_net->get()), nullptr);
  EXPECT_EQ((*server_net)->QueryExtension(HandOver::kName), nullptr);
  auto server = (*server_net)->Serve(Loopback(), [](const Frame& f) {
    return Frame{f.type == MessageType::kConnectLinksHere ? MessageType::kConnectLinksReply
                                                          : MessageType::kProbeReply,
                 ""};
  });
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Auth();
  ASSERT_TRUE(client.ok());
  int replies = 0;
  (*client)->CallPipelined(
      (*server)->address(),
      {Frame{MessageType::kConnectLinksHere, ""}, Frame{MessageType::kProbe, ""}}, absl::Seconds(5),
      [&](size_t i, absl::StatusOr<Frame> reply) {
        EXPECT_TRUE(reply.ok()) << i << ": " << reply.status();
        ++replies;
        return true;
      });
  EXPECT_EQ(replies, 2);  // the second on the same connection, still served
}

TEST(Auth, ShortSecretsAreRefused) {
  AuthOptions o;
  o.secret = "short";
  auto n = AuthenticatedNetwork::Create(NewTcpNetwork(), o);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(n.status().message().find("short"), std::string::npos) << "the secret leaked";
}

}  // namespace
}  // namespace handshake
}  // namespace kvferry
