#include "engine/peer/peer_client.h"

#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace engine_internal {
namespace {

using handshake::Frame;
using handshake::MessageType;

// The fake networks below only call.
class ClientOnlyNetwork : public handshake::Network {
 public:
  absl::StatusOr<std::unique_ptr<handshake::Server>> Serve(const handshake::ServeOptions&,
                                                           handshake::Handler) override {
    return absl::UnimplementedError("client only");
  }
};

// A scripted peer's answers to a link request: each link's parameters with
// "!" appended, or kNotFound for parameters "refuse".
absl::StatusOr<handshake::ConnectLinksReply> AnswerLinks(const Frame& request) {
  absl::StatusOr<handshake::ConnectLinksRequest> batch =
      handshake::DecodeConnectLinksRequest(request.payload);
  if (!batch.ok()) return batch.status();
  handshake::ConnectLinksReply reply;
  for (const handshake::ConnectRequest& c : batch->links) {
    if (c.params == "refuse") {
      reply.links.emplace_back(absl::NotFoundError("no such NIC"));
    } else {
      reply.links.emplace_back(c.params + "!");
    }
  }
  return reply;
}

// A peer on a scripted network: answers connects by appending "!" to the
// offered parameters, and kConnectLinks the way `mode` says.
class ScriptedNetwork final : public ClientOnlyNetwork {
 public:
  enum class Mode { kBatch, kOldPeer, kWrongCount, kDown };
  explicit ScriptedNetwork(Mode mode) : mode_(mode) {}

  absl::StatusOr<Frame> Call(const std::string&, const Frame& request, absl::Duration) override {
    calls.push_back(request.type);
    if (mode_ == Mode::kDown) return absl::UnavailableError("connection refused");
    if (request.type == MessageType::kConnect) {
      absl::StatusOr<handshake::ConnectRequest> c =
          handshake::DecodeConnectRequest(request.payload);
      if (!c.ok()) return c.status();
      return Frame{MessageType::kConnectReply,
                   handshake::Encode(handshake::ConnectReply{c->params + "!"})};
    }
    if (request.type != MessageType::kConnectLinks) {
      return absl::InvalidArgumentError("unexpected request");
    }
    // An engine from before kConnectLinks: the handshake server refuses the
    // unknown type as malformed.
    if (mode_ == Mode::kOldPeer) return absl::DataLossError("unknown message type 16");
    absl::StatusOr<handshake::ConnectLinksReply> reply = AnswerLinks(request);
    if (!reply.ok()) return reply.status();
    if (mode_ == Mode::kWrongCount) reply->links.pop_back();
    return Frame{MessageType::kConnectLinksReply, handshake::Encode(*reply)};
  }

  std::vector<MessageType> calls;

 private:
  const Mode mode_;
};

std::vector<handshake::ConnectRequest> Requests(std::vector<std::string> params) {
  std::vector<handshake::ConnectRequest> out;
  for (uint32_t i = 0; i < params.size(); ++i) {
    out.push_back(handshake::ConnectRequest{1, 0, {"eth0", "10.0.0.1:9", 0, 0, 0}, i, params[i]});
  }
  return out;
}

TEST(PeerClient, ConnectLinksAsksForEveryLinkInOneCall) {
  ScriptedNetwork net(ScriptedNetwork::Mode::kBatch);
  PeerClient client(&net, 1, absl::Seconds(1));
  auto answers =
      client.ConnectLinks("peer:1", Requests({"a", "refuse", "c"}), handshake::kCapabilities);
  ASSERT_TRUE(answers.ok()) << answers.status();
  ASSERT_EQ(answers->size(), 3u);
  EXPECT_EQ(*(*answers)[0], "a!");
  EXPECT_EQ((*answers)[1].status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*(*answers)[2], "c!");
  EXPECT_EQ(net.calls, std::vector<MessageType>{MessageType::kConnectLinks});
}

// A version 1 peer states no capabilities: it is asked in one round trip,
// and one link at a time once it refuses the type.
TEST(PeerClient, ConnectLinksFallsBackToOneLinkAtATimeForAnOlderPeer) {
  ScriptedNetwork net(ScriptedNetwork::Mode::kOldPeer);
  PeerClient client(&net, 1, absl::Seconds(1));
  auto answers = client.ConnectLinks("peer:1", Requests({"a", "b"}), std::nullopt);
  ASSERT_TRUE(answers.ok()) << answers.status();
  ASSERT_EQ(answers->size(), 2u);
  EXPECT_EQ(*(*answers)[0], "a!");
  EXPECT_EQ(*(*answers)[1], "b!");
  EXPECT_EQ(net.calls, (std::vector<MessageType>{MessageType::kConnectLinks, MessageType::kConnect,
                                                 MessageType::kConnect}));
}

// A peer that states its capabilities is taken at its word: without
// kCapConnectLinks it is asked one link at a time from the start; with it,
// an error is the answer (never read as "an older peer").
TEST(PeerClient, ConnectLinksFollowsThePeersCapabilities) {
  {
    ScriptedNetwork net(ScriptedNetwork::Mode::kBatch);
    PeerClient client(&net, 1, absl::Seconds(1));
    auto answers = client.ConnectLinks("peer:1", Requests({"a", "b"}), uint64_t{0});
    ASSERT_TRUE(answers.ok()) << answers.status();
    EXPECT_EQ(*(*answers)[1], "b!");
    EXPECT_EQ(net.calls, (std::vector<MessageType>{MessageType::kConnect, MessageType::kConnect}));
  }
  ScriptedNetwork net(ScriptedNetwork::Mode::kOldPeer);  // answers kDataLoss
  PeerClient client(&net, 1, absl::Seconds(1));
  auto answers = client.ConnectLinks("peer:1", Requests({"a", "b"}), handshake::kCapabilities);
  EXPECT_EQ(answers.status().code(), absl::StatusCode::kDataLoss) << answers.status();
  EXPECT_EQ(net.calls, std::vector<MessageType>{MessageType::kConnectLinks});
}

TEST(PeerClient, ConnectLinksRefusesAReplyForAnotherNumberOfLinks) {
  ScriptedNetwork net(ScriptedNetwork::Mode::kWrongCount);
  PeerClient client(&net, 1, absl::Seconds(1));
  auto answers = client.ConnectLinks("peer:1", Requests({"a", "b"}), handshake::kCapabilities);
  EXPECT_EQ(answers.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(answers.status().message().find("1 of 2"), std::string::npos) << answers.status();
}

TEST(PeerClient, ConnectLinksToAnUnreachablePeerFailsOnceWithoutRetrying) {
  ScriptedNetwork net(ScriptedNetwork::Mode::kDown);
  PeerClient client(&net, 1, absl::Seconds(1));
  auto answers = client.ConnectLinks("peer:1", Requests({"a", "b"}), handshake::kCapabilities);
  EXPECT_EQ(answers.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(net.calls.size(), 1u);
}

// A network whose calls run on connections that can be handed over: the
// descriptor, then each link accepted unless its parameters say "refuse".
class HandingNetwork final : public ClientOnlyNetwork, public handshake::HandOver {
 public:
  absl::StatusOr<Frame> Call(const std::string&, const Frame& request, absl::Duration) override {
    calls.push_back(request.type);
    if (request.type == MessageType::kDescribeV2) {
      handshake::EngineDescriptor d;
      d.engine_id = 7;
      d.transport_kind = "tcp";
      d.nics.push_back(transport::NicInfo{"lo", "127.0.0.1:9", 0, 0, 0});
      d.protocol_version = 2;
      d.capabilities = handshake::kCapabilities;
      return Frame{MessageType::kDescriptorV2, handshake::EncodeDescriptorV2(d)};
    }
    absl::StatusOr<handshake::ConnectLinksReply> reply = AnswerLinks(request);
    if (!reply.ok()) return reply.status();
    return Frame{MessageType::kConnectLinksReply, handshake::Encode(*reply)};
  }
  void* QueryExtension(absl::string_view name) override {
    return name == HandOver::kName ? static_cast<HandOver*>(this) : nullptr;
  }
  absl::StatusOr<std::unique_ptr<handshake::Server>> ServeHandingOver(
      const handshake::ServeOptions&, handshake::HandingHandler) override {
    return absl::UnimplementedError("a client only");
  }
  void CallThenTake(const std::string& peer, const std::vector<Frame>& requests,
                    absl::Duration timeout, const ReplyFn& on_reply, const TakeFn& take) override {
    CallPipelined(peer, requests, timeout, on_reply);
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    ::close(fds[1]);
    net::Fd connection(fds[0]);
    taken = take(connection);
  }

  std::vector<MessageType> calls;
  bool taken = false;
};

// With a ride, the first link goes on the call's own connection
// (kConnectLinksHere): the connection goes to the ride once the peer has
// accepted that link, and the ride's verdict becomes its answer; a first
// link the peer refused leaves the connection to the network.
TEST(PeerClient, TheFirstLinkRidesTheCallsConnectionOnceThePeerAcceptsIt) {
  struct Case {
    std::string first;
    absl::Status ride;
    bool rides;
  };
  for (const Case& c :
       {Case{"a", absl::OkStatus(), true}, Case{"a", absl::FailedPreconditionError("closed"), true},
        Case{"refuse", absl::OkStatus(), false}}) {
    SCOPED_TRACE(c.first + " " + c.ride.ToString());
    HandingNetwork net;
    PeerClient client(&net, 1, absl::Seconds(1));
    ASSERT_TRUE(client.CanRide());
    int rode = 0;
    auto described = client.DescribeAndConnect(
        "peer:1", "tcp", Requests({c.first, "b"}),
        [](const handshake::EngineDescriptor& d) { return d.engine_id == 7; },
        [&](net::Fd connection) {
          EXPECT_TRUE(connection.valid());
          ++rode;
          return c.ride;
        });
    ASSERT_TRUE(described.ok()) << described.status();
    ASSERT_TRUE(described->links.ok()) << described->links.status();
    EXPECT_EQ(net.calls,
              (std::vector<MessageType>{MessageType::kDescribeV2, MessageType::kConnectLinksHere}));
    EXPECT_EQ(rode, c.rides ? 1 : 0);
    EXPECT_EQ(net.taken, c.rides);
    const absl::StatusOr<std::string>& first = (*described->links)[0];
    if (!c.rides) {
      EXPECT_EQ(first.status().code(), absl::StatusCode::kNotFound);
    } else if (c.ride.ok()) {
      EXPECT_EQ(*first, "a!");
    } else {
      EXPECT_EQ(first.status(), c.ride);
    }
    EXPECT_EQ(*(*described->links)[1], "b!");
  }
  // Without a ride: plain kConnectLinks, and the connection stays.
  HandingNetwork net;
  PeerClient client(&net, 1, absl::Seconds(1));
  auto described = client.DescribeAndConnect(
      "peer:1", "tcp", Requests({"a"}), [](const handshake::EngineDescriptor&) { return true; });
  ASSERT_TRUE(described.ok()) << described.status();
  EXPECT_EQ(net.calls,
            (std::vector<MessageType>{MessageType::kDescribeV2, MessageType::kConnectLinks}));
  EXPECT_FALSE(net.taken);
}

// Describing a peer: a current one states its protocol version and
// capabilities; a version 1 one refuses kDescribeV2 (an unknown type to
// it), is described with kDescribe, and states nothing. Asked in one round
// trip with links, a version 1 peer gives kUnimplemented (ask the usual
// way).
class VersionedNetwork final : public ClientOnlyNetwork {
 public:
  explicit VersionedNetwork(int version) : version_(version) {}
  absl::StatusOr<Frame> Call(const std::string&, const Frame& request, absl::Duration) override {
    calls.push_back(request.type);
    handshake::EngineDescriptor d;
    d.engine_id = 9;
    d.transport_kind = "tcp";
    d.nics.push_back(transport::NicInfo{"lo", "127.0.0.1:9", 0, 0, 0});
    if (request.type == MessageType::kDescribe) {
      return Frame{MessageType::kDescriptor, handshake::Encode(d)};
    }
    if (request.type == MessageType::kDescribeV2 && version_ >= 2) {
      d.protocol_version = 2;
      d.capabilities = handshake::kCapCloseLinks;
      return Frame{MessageType::kDescriptorV2, handshake::EncodeDescriptorV2(d)};
    }
    if (request.type == MessageType::kCloseLinks) {
      return absl::InvalidArgumentError("unexpected close-links request");
    }
    return absl::DataLossError(absl::StrCat("unknown message type ", int(request.type)));
  }
  std::vector<MessageType> calls;

 private:
  const int version_;
};

TEST(PeerClient, DescribeLearnsTheProtocolVersionAndCapabilities) {
  VersionedNetwork current(2);
  PeerClient a(&current, 1, absl::Seconds(1));
  auto d = a.Describe("peer:1");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->protocol_version, 2);
  EXPECT_EQ(d->capabilities, std::optional<uint64_t>(handshake::kCapCloseLinks));
  EXPECT_EQ(d->Speaks(handshake::kCapConnectLinks), std::optional<bool>(false));
  EXPECT_EQ(current.calls, std::vector<MessageType>{MessageType::kDescribeV2});

  VersionedNetwork old(1);
  PeerClient b(&old, 1, absl::Seconds(1));
  d = b.Describe("peer:1");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->engine_id, 9u);
  EXPECT_EQ(d->protocol_version, 1);
  EXPECT_FALSE(d->capabilities.has_value());
  EXPECT_EQ(old.calls,
            (std::vector<MessageType>{MessageType::kDescribeV2, MessageType::kDescribe}));

  VersionedNetwork old2(1);
  PeerClient c(&old2, 1, absl::Seconds(1));
  auto described = c.DescribeAndConnect("peer:1", "tcp", Requests({"a"}),
                                        [](const handshake::EngineDescriptor&) { return true; });
  EXPECT_EQ(described.status().code(), absl::StatusCode::kUnimplemented) << described.status();
}

// Closing links: a peer without kCapCloseLinks is not asked; one that
// states it is, and its error is the answer; a version 1 peer's refusal of
// the type means it cannot be asked (OK).
TEST(PeerClient, CloseLinksFollowsThePeersCapabilities) {
  VersionedNetwork net(2);
  PeerClient client(&net, 1, absl::Seconds(1));
  EXPECT_TRUE(client.CloseLinks("peer:1", {"x"}, uint64_t{0}).ok());
  EXPECT_TRUE(net.calls.empty());
  EXPECT_EQ(client.CloseLinks("peer:1", {"x"}, handshake::kCapCloseLinks).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(client.CloseLinks("peer:1", {"x"}, std::nullopt).ok());
  EXPECT_EQ(net.calls.size(), 2u);
}

}  // namespace
}  // namespace engine_internal
}  // namespace kvferry
