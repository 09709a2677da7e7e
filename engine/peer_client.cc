#include "engine/peer_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvferry {
namespace engine_internal {

using handshake::Frame;
using handshake::MessageType;

absl::StatusOr<Frame> PeerClient::Call(const std::string& peer, Frame request,
                                       MessageType expected, absl::Duration timeout) const {
  const MessageType sent = request.type;
  ASSIGN_OR_RETURN(Frame reply, network_->Call(peer, request, timeout));
  if (reply.type != expected) {
    return absl::DataLossError(absl::StrCat("peer ", peer, " answered ",
                                            handshake::MessageTypeName(sent), " with ",
                                            handshake::MessageTypeName(reply.type)));
  }
  return reply;
}

absl::StatusOr<handshake::EngineDescriptor> PeerClient::Describe(const std::string& peer,
                                                                 const std::string& kind) const {
  ASSIGN_OR_RETURN(Frame reply, Call(peer, Frame{MessageType::kDescribe, kind},
                                     MessageType::kDescriptor, timeout_));
  ASSIGN_OR_RETURN(handshake::EngineDescriptor d, handshake::DecodeDescriptor(reply.payload));
  std::sort(d.regions.begin(), d.regions.end(),
            [](const handshake::RegionDescriptor& a, const handshake::RegionDescriptor& b) {
              return a.addr < b.addr;
            });
  return d;
}

absl::StatusOr<std::string> PeerClient::Connect(const std::string& peer,
                                                const handshake::ConnectRequest& request) const {
  ASSIGN_OR_RETURN(Frame reply, Call(peer, Frame{MessageType::kConnect, handshake::Encode(request)},
                                     MessageType::kConnectReply, timeout_));
  ASSIGN_OR_RETURN(handshake::ConnectReply answer, handshake::DecodeConnectReply(reply.payload));
  return std::move(answer.params);
}

absl::StatusOr<std::vector<absl::StatusOr<std::string>>> PeerClient::ConnectLinks(
    const std::string& peer, std::vector<handshake::ConnectRequest> requests) const {
  const size_t count = requests.size();
  handshake::ConnectLinksRequest batch{std::move(requests)};
  absl::StatusOr<Frame> reply =
      Call(peer, Frame{MessageType::kConnectLinks, handshake::Encode(batch)},
           MessageType::kConnectLinksReply, timeout_);
  if (reply.ok()) {
    ASSIGN_OR_RETURN(handshake::ConnectLinksReply answer,
                     handshake::DecodeConnectLinksReply(reply->payload));
    if (answer.links.size() != count) {
      return absl::DataLossError(absl::StrCat("peer ", peer, " answered ", answer.links.size(),
                                              " of ", count, " links"));
    }
    return std::move(answer.links);
  }
  // An engine from before kConnectLinks refuses the type as malformed or
  // unexpected (kDataLoss, kInvalidArgument); anything else is the answer.
  if (reply.status().code() != absl::StatusCode::kDataLoss &&
      reply.status().code() != absl::StatusCode::kInvalidArgument) {
    return reply.status();
  }
  std::vector<absl::StatusOr<std::string>> one_by_one;
  for (const handshake::ConnectRequest& r : batch.links) one_by_one.push_back(Connect(peer, r));
  return one_by_one;
}

absl::Status PeerClient::CloseLinks(const std::string& peer,
                                    std::vector<std::string> links) const {
  absl::StatusOr<Frame> reply = Call(
      peer,
      Frame{MessageType::kCloseLinks,
            handshake::Encode(handshake::CloseLinksRequest{engine_id_, std::move(links)})},
      MessageType::kCloseLinksReply, timeout_);
  // A peer from before kCloseLinks refuses the type as unexpected
  // (kInvalidArgument; this engine never sends it anything malformed).
  if (!reply.ok() && reply.status().code() == absl::StatusCode::kInvalidArgument) {
    return absl::OkStatus();
  }
  return reply.status();
}

absl::StatusOr<uint64_t> PeerClient::Probe(const std::string& peer,
                                           absl::Duration timeout) const {
  ASSIGN_OR_RETURN(Frame reply,
                   Call(peer,
                        Frame{MessageType::kProbe,
                              handshake::Encode(handshake::Probe{engine_id_, 0})},
                        MessageType::kProbeReply, timeout));
  ASSIGN_OR_RETURN(handshake::Probe answer, handshake::DecodeProbe(reply.payload));
  return answer.engine_id;
}

absl::Status PeerClient::Notify(const std::string& peer, const std::string& message,
                                uint64_t target) const {
  if (message.size() > handshake::kMaxNotifyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("notification of ", message.size(),
                                                   " bytes exceeds the limit of ",
                                                   handshake::kMaxNotifyBytes));
  }
  return Call(peer,
              Frame{MessageType::kNotify,
                    handshake::Encode(handshake::Notify{engine_id_, message, target})},
              MessageType::kNotifyAck, timeout_)
      .status();
}

absl::StatusOr<handshake::Metadata> PeerClient::GetMetadata(const std::string& peer,
                                                            const std::string& key) const {
  absl::StatusOr<Frame> reply =
      Call(peer,
           Frame{MessageType::kGetMetadata, handshake::Encode(handshake::MetadataRequest{key})},
           MessageType::kMetadata, timeout_);
  if (!reply.ok()) return Annotate(reply.status(), absl::StrCat("metadata '", key, "' of ", peer));
  return handshake::DecodeMetadata(reply->payload);
}

}  // namespace engine_internal
}  // namespace kvferry
