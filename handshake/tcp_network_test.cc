#include "handshake/tcp_network.h"

#include <sys/socket.h>

#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "gtest/gtest.h"
#include "handshake/hand_over.h"
#include "handshake/tcp_server.h"
#include "net/socket.h"
#include "sim/prng.h"
#include "sim/seed.h"

namespace kvferry {
namespace handshake {
namespace {

ServeOptions Loopback() {
  ServeOptions o;
  o.bind_host = "127.0.0.1";
  o.first_port = 15000;
  o.last_port = 17000;
  return o;
}

// Echoes probes; refuses everything else with kNotFound.
Frame EchoHandler(const Frame& request) {
  if (request.type != MessageType::kProbe) {
    return ErrorFrame(absl::NotFoundError("only probes here"));
  }
  return Frame{MessageType::kProbeReply, request.payload};
}

TEST(TcpNetwork, CallGetsTheReplyAndErrorsAsStatus) {
  auto network = NewTcpNetwork();
  auto server = network->Serve(Loopback(), EchoHandler);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->address().rfind("127.0.0.1:", 0), 0u);
  for (int i = 0; i < 3; ++i) {  // the second and third reuse the connection
    auto reply =
        network->Call((*server)->address(),
                      Frame{MessageType::kProbe, Encode(Probe{1, uint64_t(i)})}, absl::Seconds(2));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->type, MessageType::kProbeReply);
    EXPECT_EQ(DecodeProbe(reply->payload)->nonce, uint64_t(i));
  }
  auto refused =
      network->Call((*server)->address(), Frame{MessageType::kDescribe, ""}, absl::Seconds(2));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(refused.status().message(), "only probes here");
}

// Pipelined requests go out together before any reply is read: a peer
// that answers only once it has both requests still answers both (one
// after the other would wait forever for the first reply). An error reply
// comes as its status, in its place.
TEST(TcpNetwork, PipelinedRequestsTravelTogether) {
  auto listener = net::Listen("127.0.0.1", 0, {0, 0});
  ASSERT_TRUE(listener.ok()) << listener.status();
  const std::string address = absl::StrCat("127.0.0.1:", listener->address.port());
  std::thread peer([&] {
    const int fd = ::accept(listener->fd.get(), nullptr, nullptr);
    ASSERT_GE(fd, 0);
    net::Fd conn(fd);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    std::vector<uint64_t> nonces;
    for (int i = 0; i < 2; ++i) {
      char header[kFrameHeaderBytes];
      ASSERT_TRUE(net::ReadFull(fd, header, sizeof header, deadline).ok());
      auto h = ParseFrameHeader(absl::string_view(header, sizeof header), 1 << 20);
      ASSERT_TRUE(h.ok()) << h.status();
      std::string payload(h->payload_bytes, '\0');
      ASSERT_TRUE(net::ReadFull(fd, payload.data(), payload.size(), deadline).ok());
      nonces.push_back(DecodeProbe(payload)->nonce);
    }
    const std::string replies =
        EncodeFrame(MessageType::kProbeReply, Encode(Probe{9, nonces[0]})) +
        EncodeFrame(MessageType::kError, EncodeError(absl::NotFoundError("second refused")));
    ASSERT_TRUE(net::WriteFull(fd, replies.data(), replies.size(), deadline).ok());
  });
  auto network = NewTcpNetwork();
  std::vector<absl::StatusOr<Frame>> got;
  network->CallPipelined(address,
                         {Frame{MessageType::kProbe, Encode(Probe{1, 41})},
                          Frame{MessageType::kProbe, Encode(Probe{1, 42})}},
                         absl::Seconds(5), [&](size_t i, absl::StatusOr<Frame> reply) {
                           EXPECT_EQ(i, got.size());
                           got.push_back(std::move(reply));
                           return true;
                         });
  peer.join();
  ASSERT_EQ(got.size(), 2u);
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(DecodeProbe(got[0]->payload)->nonce, 41u);
  EXPECT_EQ(got[1].status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(got[1].status().message(), "second refused");
}

// A caller that stops after the first reply gets no more; the server
// answers the next call on a fresh connection.
TEST(TcpNetwork, APipelineStopsWhereTheCallerSays) {
  auto network = NewTcpNetwork();
  auto server = network->Serve(Loopback(), EchoHandler);
  ASSERT_TRUE(server.ok()) << server.status();
  int calls = 0;
  network->CallPipelined((*server)->address(),
                         {Frame{MessageType::kProbe, Encode(Probe{1, 1})},
                          Frame{MessageType::kProbe, Encode(Probe{1, 2})}},
                         absl::Seconds(5), [&](size_t, absl::StatusOr<Frame> reply) {
                           EXPECT_TRUE(reply.ok()) << reply.status();
                           ++calls;
                           return false;
                         });
  EXPECT_EQ(calls, 1);
  auto next = network->Call((*server)->address(), Frame{MessageType::kProbe, Encode(Probe{1, 3})},
                            absl::Seconds(2));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(DecodeProbe(next->payload)->nonce, 3u);
}

// A connection handed over after its last reply (kConnectLinksHere): the
// server gives its end to the answer's `take` once the reply is out, the
// caller's `take` gets the other, and the two ends then carry bytes of their
// own, outside the handshake; a second connection, started while the peer
// answered, serves the calls that follow. A request that hands nothing
// over leaves the connection with the handshake (pooled, reused by the
// next call).
TEST(TcpNetwork, ACallsConnectionCanBeHandedOverAtBothEnds) {
  auto network_owner = NewTcpNetwork();
  HandOver* network = ExtensionOf<HandOver>(network_owner.get());
  ASSERT_NE(network, nullptr);
  std::mutex mu;
  std::vector<net::Fd> taken;  // the server's ends
  auto server = network->ServeHandingOver(Loopback(), [&](const Frame& request) -> Answer {
    if (request.type == MessageType::kProbe)
      return Frame{MessageType::kProbeReply, request.payload};
    return Answer(Frame{MessageType::kConnectLinksReply, "ok"}, [&](net::Fd fd) {
      std::lock_guard<std::mutex> lock(mu);
      taken.push_back(std::move(fd));
    });
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string at = (*server)->address();
  // Taken at both ends.
  net::Fd mine;
  std::vector<MessageType> replies;
  network->CallThenTake(
      at,
      {Frame{MessageType::kProbe, Encode(Probe{1, 5})}, Frame{MessageType::kConnectLinksHere, ""}},
      absl::Seconds(5),
      [&](size_t, absl::StatusOr<Frame> reply) {
        EXPECT_TRUE(reply.ok()) << reply.status();
        if (reply.ok()) replies.push_back(reply->type);
        return true;
      },
      [&](net::Fd& fd) {
        mine = std::move(fd);
        return true;
      });
  EXPECT_EQ(replies,
            (std::vector<MessageType>{MessageType::kProbeReply, MessageType::kConnectLinksReply}));
  ASSERT_TRUE(mine.valid());
  net::Fd theirs;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(5);
       !theirs.valid() && absl::Now() < give_up;) {
    std::lock_guard<std::mutex> lock(mu);
    if (!taken.empty()) theirs = std::move(taken[0]);
  }
  ASSERT_TRUE(theirs.valid()) << "the server never handed its end over";
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  // The statuses are printed: a failure here names its cause (a closed or
  // reset connection, a bad descriptor, a timeout) and which end saw it.
  absl::Status step = net::WriteFull(mine.get(), "ping", 4, deadline);
  ASSERT_TRUE(step.ok()) << "the caller's end, fd " << mine.get() << ": " << step;
  char got[4];
  step = net::ReadFull(theirs.get(), got, 4, deadline);
  ASSERT_TRUE(step.ok()) << "the server's end, fd " << theirs.get() << " (the caller's "
                         << mine.get() << "): " << step;
  EXPECT_EQ(std::string(got, 4), "ping");
  step = net::WriteFull(theirs.get(), "pong", 4, deadline);
  ASSERT_TRUE(step.ok()) << "the server's end, fd " << theirs.get() << ": " << step;
  step = net::ReadFull(mine.get(), got, 4, deadline);
  ASSERT_TRUE(step.ok()) << "the caller's end, fd " << mine.get() << ": " << step;
  EXPECT_EQ(std::string(got, 4), "pong");
  // The taken connection is not the handshake's any more: a second one,
  // started while the peer answered, is there for the next calls. The same
  // request whose connection is not taken leaves it pooled (with a spare
  // of its own).
  auto* tcp = dynamic_cast<TcpServer*>(server->get());
  ASSERT_NE(tcp, nullptr);
  for (const absl::Time give_up = absl::Now() + absl::Seconds(5);
       tcp->stats().accepted < 2 && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(tcp->stats().accepted, 2u) << "no second connection was started";
  bool asked = false;
  network->CallThenTake(
      at, {Frame{MessageType::kProbe, Encode(Probe{1, 6})}}, absl::Seconds(5),
      [&](size_t, absl::StatusOr<Frame> reply) {
        EXPECT_TRUE(reply.ok()) << reply.status();
        return true;
      },
      [&](net::Fd&) {
        asked = true;
        return false;
      });
  EXPECT_TRUE(asked);
  auto again =
      network_owner->Call(at, Frame{MessageType::kProbe, Encode(Probe{1, 7})}, absl::Seconds(5));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(DecodeProbe(again->payload)->nonce, 7u);
  // The handed-over one, the first spare (which both calls used) and the
  // second call's spare: nothing connected for the last call.
  EXPECT_EQ(tcp->stats().accepted, 3u);
  EXPECT_EQ(tcp->stats().handed_over, 1u);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(taken.size(), 1u);
}

// A peer that restarted closed every connection the network keeps idle for
// it: the first that fails sends the call to a fresh connection, whatever
// else is in the pool (here two: a call's own and the one started beside
// it).
TEST(TcpNetwork, AfterAPeerRestartsTheNextCallConnectsAfresh) {
  auto network = NewTcpNetwork();
  auto first = network->Serve(Loopback(), EchoHandler);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string at = (*first)->address();
  ExtensionOf<HandOver>(network.get())
      ->CallThenTake(
          at, {Frame{MessageType::kProbe, Encode(Probe{1, 1})}}, absl::Seconds(5),
          [](size_t, absl::StatusOr<Frame> reply) {
            EXPECT_TRUE(reply.ok()) << reply.status();
            return true;
          },
          [](net::Fd&) { return false; });  // both kept idle
  ServeOptions same = Loopback();
  same.port = static_cast<uint16_t>(std::stoi(at.substr(at.rfind(':') + 1)));
  first->reset();  // the peer goes away, closing both
  auto second = network->Serve(same, EchoHandler);
  ASSERT_TRUE(second.ok()) << second.status();
  auto reply = network->Call(at, Frame{MessageType::kProbe, Encode(Probe{1, 2})}, absl::Seconds(5));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(DecodeProbe(reply->payload)->nonce, 2u);
}

TEST(TcpNetwork, Ipv6Loopback) {
  auto network = NewTcpNetwork();
  ServeOptions o = Loopback();
  o.bind_host = "::1";
  auto server = network->Serve(o, EchoHandler);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->address().rfind("[::1]:", 0), 0u);
  auto reply = network->Call((*server)->address(), Frame{MessageType::kProbe, Encode(Probe{1, 2})},
                             absl::Seconds(2));
  ASSERT_TRUE(reply.ok()) << reply.status();
}

TEST(TcpNetwork, PeerNotListeningIsUnavailableWithinTheTimeout) {
  uint16_t port;
  {
    auto s = net::Listen("127.0.0.1", 0, {16900, 16999});
    ASSERT_TRUE(s.ok());
    port = s->address.port();
  }
  auto network = NewTcpNetwork();
  const absl::Time start = absl::Now();
  auto r = network->Call("127.0.0.1:" + std::to_string(port), Frame{MessageType::kProbe, ""},
                         absl::Seconds(2));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find(std::to_string(port)), std::string::npos);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(TcpNetwork, SilentPeerTimesOut) {
  // Accepts (the kernel does) but never answers.
  auto silent = net::Listen("127.0.0.1", 0, {16900, 16999});
  ASSERT_TRUE(silent.ok());
  auto network = NewTcpNetwork();
  const absl::Time start = absl::Now();
  auto r = network->Call(silent->address.ToString(),
                         Frame{MessageType::kProbe, Encode(Probe{1, 1})}, absl::Milliseconds(300));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

// Sends raw bytes on a fresh connection and returns what comes back (until
// the server closes or 1 s passes).
std::string RawExchange(const std::string& address, const std::string& bytes) {
  auto hp = net::ParseHostPort(address);
  auto fd = net::Connect(*hp, absl::Seconds(1));
  if (!fd.ok()) return "connect failed";
  (void)net::WriteFull(fd->get(), bytes.data(), bytes.size(), absl::Now() + absl::Seconds(1));
  ::shutdown(fd->get(), SHUT_WR);
  std::string out;
  char buf[256];
  for (;;) {
    absl::Status s = net::ReadFull(fd->get(), buf, 1, absl::Now() + absl::Seconds(1));
    if (!s.ok()) break;
    out.push_back(buf[0]);
  }
  return out;
}

TEST(TcpNetwork, MalformedFramesAreRefusedAndTheServerKeepsServing) {
  std::vector<std::string> logged;
  SetLogSink([&](LogSeverity, absl::string_view line) { logged.emplace_back(line); });
  auto network = NewTcpNetwork();
  auto server = network->Serve(Loopback(), EchoHandler);
  ASSERT_TRUE(server.ok());
  const std::string address = (*server)->address();

  // Bad magic: an error reply naming the problem, then the connection ends.
  std::string reply = RawExchange(address, "GET / HTTP/1.1\r\n\r\n");
  ASSERT_GE(reply.size(), kFrameHeaderBytes);
  auto header = ParseFrameHeader(reply, kDefaultMaxFrameBytes);
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(header->type, MessageType::kError);
  absl::Status carried = DecodeError(reply.substr(kFrameHeaderBytes));
  EXPECT_EQ(carried.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(carried.message().find("not a kvferry handshake frame"), std::string::npos);

  // A frame claiming 1 GiB is refused before anything is allocated.
  std::string huge = EncodeFrame(MessageType::kProbe, "");
  huge[4] = huge[5] = huge[6] = '\0';
  huge[7] = 0x40;
  reply = RawExchange(address, huge);
  ASSERT_GE(reply.size(), kFrameHeaderBytes);
  EXPECT_EQ(DecodeError(reply.substr(kFrameHeaderBytes)).code(),
            absl::StatusCode::kResourceExhausted);

  // A seeded corpus of mutated and truncated frames.
  const uint64_t seed = sim::TestSeed(7);
  SCOPED_TRACE(sim::ReplayCommand(seed));
  sim::Prng prng(seed);
  const std::string good = EncodeFrame(MessageType::kProbe, Encode(Probe{3, 4}));
  for (int i = 0; i < 2000; ++i) {
    std::string m = good;
    switch (prng.Uniform(3)) {
      case 0:
        m[prng.Uniform(m.size())] ^= char(1 << prng.Uniform(8));
        break;
      case 1:
        m.resize(prng.Uniform(m.size()));
        break;
      case 2:
        for (int k = 0; k < 4; ++k) m[prng.Uniform(m.size())] = char(prng.Next64());
        break;
    }
    (void)RawExchange(address, m);
    if (i % 500 == 0) {
      auto ok =
          network->Call(address, Frame{MessageType::kProbe, Encode(Probe{1, 2})}, absl::Seconds(2));
      ASSERT_TRUE(ok.ok()) << "server stopped serving after " << i
                           << " bad frames: " << ok.status();
    }
  }
  auto ok =
      network->Call(address, Frame{MessageType::kProbe, Encode(Probe{1, 2})}, absl::Seconds(2));
  EXPECT_TRUE(ok.ok()) << ok.status();
  SetLogSink(nullptr);
  bool reason_logged = false;
  for (const auto& line : logged) {
    reason_logged |= line.find("closing a connection: DATA_LOSS") != std::string::npos;
  }
  EXPECT_TRUE(reason_logged);
}

}  // namespace
}  // namespace handshake
}  // namespace kvferry
