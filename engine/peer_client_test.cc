#include "engine/peer_client.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace engine_internal {
namespace {

using handshake::Frame;
using handshake::MessageType;

// A peer on a scripted network: answers connects by appending "!" to the
// offered parameters, and kConnectLinks the way `mode` says.
class ScriptedNetwork final : public handshake::Network {
 public:
  enum class Mode { kBatch, kOldPeer, kWrongCount, kDown };
  explicit ScriptedNetwork(Mode mode) : mode_(mode) {}

  absl::StatusOr<std::unique_ptr<handshake::Server>> Serve(const handshake::ServeOptions&,
                                                           handshake::Handler) override {
    return absl::UnimplementedError("client only");
  }
  absl::StatusOr<Frame> Call(const std::string&, const Frame& request,
                             absl::Duration) override {
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
    if (mode_ == Mode::kWrongCount) reply.links.pop_back();
    return Frame{MessageType::kConnectLinksReply, handshake::Encode(reply)};
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
  auto answers = client.ConnectLinks("peer:1", Requests({"a", "refuse", "c"}));
  ASSERT_TRUE(answers.ok()) << answers.status();
  ASSERT_EQ(answers->size(), 3u);
  EXPECT_EQ(*(*answers)[0], "a!");
  EXPECT_EQ((*answers)[1].status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*(*answers)[2], "c!");
  EXPECT_EQ(net.calls, std::vector<MessageType>{MessageType::kConnectLinks});
}

TEST(PeerClient, ConnectLinksFallsBackToOneLinkAtATimeForAnOlderPeer) {
  ScriptedNetwork net(ScriptedNetwork::Mode::kOldPeer);
  PeerClient client(&net, 1, absl::Seconds(1));
  auto answers = client.ConnectLinks("peer:1", Requests({"a", "b"}));
  ASSERT_TRUE(answers.ok()) << answers.status();
  ASSERT_EQ(answers->size(), 2u);
  EXPECT_EQ(*(*answers)[0], "a!");
  EXPECT_EQ(*(*answers)[1], "b!");
  EXPECT_EQ(net.calls, (std::vector<MessageType>{MessageType::kConnectLinks,
                                                 MessageType::kConnect, MessageType::kConnect}));
}

TEST(PeerClient, ConnectLinksRefusesAReplyForAnotherNumberOfLinks) {
  ScriptedNetwork net(ScriptedNetwork::Mode::kWrongCount);
  PeerClient client(&net, 1, absl::Seconds(1));
  auto answers = client.ConnectLinks("peer:1", Requests({"a", "b"}));
  EXPECT_EQ(answers.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(answers.status().message().find("1 of 2"), std::string::npos) << answers.status();
}

TEST(PeerClient, ConnectLinksToAnUnreachablePeerFailsOnceWithoutRetrying) {
  ScriptedNetwork net(ScriptedNetwork::Mode::kDown);
  PeerClient client(&net, 1, absl::Seconds(1));
  auto answers = client.ConnectLinks("peer:1", Requests({"a", "b"}));
  EXPECT_EQ(answers.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(net.calls.size(), 1u);
}

}  // namespace
}  // namespace engine_internal
}  // namespace kvferry
