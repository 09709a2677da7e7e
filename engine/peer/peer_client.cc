#include "engine/peer/peer_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"

namespace kvferry {
namespace engine_internal {

using handshake::Frame;
using handshake::MessageType;

absl::StatusOr<Frame> PeerClient::Expect(const std::string& peer, MessageType sent,
                                         absl::StatusOr<Frame> reply, MessageType expected) {
  if (reply.ok() && reply->type != expected) {
    return absl::DataLossError(absl::StrCat("peer ", peer, " answered ",
                                            handshake::MessageTypeName(sent), " with ",
                                            handshake::MessageTypeName(reply->type)));
  }
  return reply;
}

absl::StatusOr<Frame> PeerClient::Call(const std::string& peer, Frame request, MessageType expected,
                                       absl::Duration timeout) const {
  const MessageType sent = request.type;
  return Expect(peer, sent, network_->Call(peer, request, timeout), expected);
}

absl::StatusOr<handshake::EngineDescriptor> PeerClient::DecodeDescriptor(const Frame& reply) {
  absl::StatusOr<handshake::EngineDescriptor> d = reply.type == MessageType::kDescriptorV2
                                                      ? handshake::DecodeDescriptorV2(reply.payload)
                                                      : handshake::DecodeDescriptor(reply.payload);
  if (!d.ok()) return d.status();
  std::sort(d->regions.begin(), d->regions.end(),
            [](const handshake::RegionDescriptor& a, const handshake::RegionDescriptor& b) {
              return a.addr < b.addr;
            });
  return d;
}

bool PeerClient::RefusedAsUnknown(const absl::Status& status) {
  // How a version 1 peer answers a message type it does not know: the
  // frame as malformed (kDataLoss) or, inside an authenticated frame, the
  // request as unexpected (kInvalidArgument). Read only where the peer's
  // version is not known yet.
  return status.code() == absl::StatusCode::kDataLoss ||
         status.code() == absl::StatusCode::kInvalidArgument;
}

absl::StatusOr<handshake::EngineDescriptor> PeerClient::Describe(const std::string& peer,
                                                                 const std::string& kind) const {
  absl::StatusOr<Frame> reply =
      Call(peer, Frame{MessageType::kDescribeV2, kind}, MessageType::kDescriptorV2, timeout_);
  if (reply.ok()) return DecodeDescriptor(*reply);
  if (!RefusedAsUnknown(reply.status())) return reply.status();
  ASSIGN_OR_RETURN(Frame old, Call(peer, Frame{MessageType::kDescribe, kind},
                                   MessageType::kDescriptor, timeout_));
  return DecodeDescriptor(old);  // version 1: capabilities unknown
}

absl::StatusOr<PeerClient::LinkAnswers> PeerClient::DecodeLinks(const std::string& peer,
                                                                const Frame& reply, size_t count) {
  ASSIGN_OR_RETURN(handshake::ConnectLinksReply answer,
                   handshake::DecodeConnectLinksReply(reply.payload));
  if (answer.links.size() != count) {
    return absl::DataLossError(
        absl::StrCat("peer ", peer, " answered ", answer.links.size(), " of ", count, " links"));
  }
  return std::move(answer.links);
}

absl::StatusOr<PeerClient::Described> PeerClient::DescribeAndConnect(
    const std::string& peer, const std::string& kind,
    std::vector<handshake::ConnectRequest> requests,
    absl::FunctionRef<bool(const handshake::EngineDescriptor&)> on_descriptor,
    const Ride& ride) const {
  const size_t count = requests.size();
  const bool here = ride != nullptr && count > 0 && CanRide();
  const MessageType sent = here ? MessageType::kConnectLinksHere : MessageType::kConnectLinks;
  std::vector<Frame> frames = {
      Frame{MessageType::kDescribeV2, kind},
      Frame{sent, handshake::Encode(handshake::ConnectLinksRequest{std::move(requests)})}};
  absl::StatusOr<Described> out = absl::UnknownError("no reply");
  // After every reply: the connection is the first link's once the peer
  // accepted it there (never back to the pool, whatever `ride` says).
  auto take = [&](net::Fd& connection) {
    if (!out.ok() || !out->links.ok() || !(*out->links)[0].ok()) return false;
    absl::Status rode = ride(std::move(connection));
    if (!rode.ok()) (*out->links)[0] = rode;
    return true;
  };
  auto on_reply = [&](size_t i, absl::StatusOr<Frame> reply) {
    if (i == 0) {
      reply = Expect(peer, MessageType::kDescribeV2, std::move(reply), MessageType::kDescriptorV2);
      absl::StatusOr<handshake::EngineDescriptor> d =
          reply.ok() ? DecodeDescriptor(*reply) : reply.status();
      if (!d.ok()) {
        out =
            !reply.ok() && RefusedAsUnknown(reply.status())
                ? absl::UnimplementedError(absl::StrCat(
                      "peer ", peer, " speaks protocol version 1 (", reply.status().message(), ")"))
                : d.status();
        return false;
      }
      out = Described{std::move(*d)};
      return on_descriptor(out->descriptor);
    }
    reply = Expect(peer, sent, std::move(reply), MessageType::kConnectLinksReply);
    out->links = reply.ok() ? DecodeLinks(peer, *reply, count) : reply.status();
    LearnFrom(peer, out->links);
    return true;
  };
  if (here) {
    hand_over_->CallThenTake(peer, frames, timeout_, on_reply, take);
  } else {
    network_->CallPipelined(peer, frames, timeout_, on_reply);
  }
  return out;
}

absl::StatusOr<std::string> PeerClient::Connect(const std::string& peer,
                                                const handshake::ConnectRequest& request) const {
  ASSIGN_OR_RETURN(
      Frame reply,
      Learned(peer, Call(peer, Frame{MessageType::kConnect, handshake::Encode(request)},
                         MessageType::kConnectReply, timeout_)));
  ASSIGN_OR_RETURN(handshake::ConnectReply answer, handshake::DecodeConnectReply(reply.payload));
  return std::move(answer.params);
}

absl::StatusOr<PeerClient::LinkAnswers> PeerClient::ConnectLinks(
    const std::string& peer, std::vector<handshake::ConnectRequest> requests,
    std::optional<uint64_t> capabilities) const {
  const size_t count = requests.size();
  handshake::ConnectLinksRequest batch{std::move(requests)};
  const bool one_trip = !capabilities.has_value() || (*capabilities & handshake::kCapConnectLinks);
  if (one_trip) {
    absl::StatusOr<Frame> reply =
        Call(peer, Frame{MessageType::kConnectLinks, handshake::Encode(batch)},
             MessageType::kConnectLinksReply, timeout_);
    if (reply.ok()) {
      absl::StatusOr<LinkAnswers> answers = DecodeLinks(peer, *reply, count);
      LearnFrom(peer, answers);
      return answers;
    }
    Learn(peer, reply.status());
    // Only a peer that states nothing may be one that does not know it.
    if (capabilities.has_value() || !RefusedAsUnknown(reply.status())) return reply.status();
  }
  std::vector<absl::StatusOr<std::string>> one_by_one;
  for (const handshake::ConnectRequest& r : batch.links) one_by_one.push_back(Connect(peer, r));
  return one_by_one;
}

absl::Status PeerClient::CloseLinks(const std::string& peer, std::vector<std::string> links,
                                    std::optional<uint64_t> capabilities) const {
  if (capabilities.has_value() && !(*capabilities & handshake::kCapCloseLinks)) {
    return absl::OkStatus();
  }
  absl::StatusOr<Frame> reply =
      Call(peer,
           Frame{MessageType::kCloseLinks,
                 handshake::Encode(handshake::CloseLinksRequest{engine_id_, std::move(links)})},
           MessageType::kCloseLinksReply, timeout_);
  // A version 1 peer from before kCloseLinks refuses the type.
  if (!reply.ok() && !capabilities.has_value() && RefusedAsUnknown(reply.status())) {
    return absl::OkStatus();
  }
  return reply.status();
}

absl::StatusOr<handshake::ConfirmReply> PeerClient::Confirm(const std::string& peer,
                                                            uint64_t digest,
                                                            absl::Duration timeout) const {
  ASSIGN_OR_RETURN(
      Frame reply,
      Call(peer,
           Frame{MessageType::kConfirm, handshake::Encode(handshake::Confirm{engine_id_, digest})},
           MessageType::kConfirmReply, timeout));
  return handshake::DecodeConfirmReply(reply.payload);
}

absl::StatusOr<uint64_t> PeerClient::Probe(const std::string& peer, absl::Duration timeout) const {
  ASSIGN_OR_RETURN(
      Frame reply,
      Call(peer, Frame{MessageType::kProbe, handshake::Encode(handshake::Probe{engine_id_, 0})},
           MessageType::kProbeReply, timeout));
  ASSIGN_OR_RETURN(handshake::Probe answer, handshake::DecodeProbe(reply.payload));
  return answer.engine_id;
}

absl::Status PeerClient::Notify(const std::string& peer, const std::string& message,
                                uint64_t target, absl::Duration timeout) const {
  if (message.size() > handshake::kMaxNotifyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("notification of ", message.size(),
                                                   " bytes exceeds the limit of ",
                                                   handshake::kMaxNotifyBytes));
  }
  const absl::Status sent =
      Call(peer,
           Frame{MessageType::kNotify, handshake::Encode(handshake::Notify{
                                           engine_id_, message, target, EpochWith(peer)})},
           MessageType::kNotifyAck, timeout > absl::ZeroDuration() ? timeout : timeout_)
          .status();
  Learn(peer, sent);
  return sent;
}

void PeerClient::LearnFrom(const std::string& peer,
                           const absl::StatusOr<LinkAnswers>& answers) const {
  if (!answers.ok()) return Learn(peer, answers.status());
  for (const absl::StatusOr<std::string>& link : *answers) Learned(peer, link);
}

uint64_t PeerClient::EpochWith(const std::string& peer) const {
  MutexLock lock(&epochs_mu_);
  const uint64_t* epoch = epochs_.Find(peer);
  return epoch == nullptr ? 0 : *epoch;
}

void PeerClient::Learn(const std::string& peer, const absl::Status& status) const {
  const std::optional<uint64_t> fenced = handshake::FencedEpoch(status);
  if (!fenced.has_value()) return;
  {
    MutexLock lock(&epochs_mu_);
    uint64_t& epoch = epochs_[peer];
    if (epoch > *fenced) return;  // learned already
    KVF_LOG(WARNING) << "the engine at " << peer << " fenced this engine off (epoch " << *fenced
                     << "): what was in flight to it is lost; new requests go at epoch "
                     << *fenced + 1;
    epoch = *fenced + 1;
  }
  if (on_fenced_) on_fenced_(peer, *fenced + 1);
}

absl::StatusOr<handshake::Metadata> PeerClient::GetMetadata(const std::string& peer,
                                                            const std::string& key,
                                                            absl::Duration timeout) const {
  absl::StatusOr<Frame> reply = Call(
      peer, Frame{MessageType::kGetMetadata, handshake::Encode(handshake::MetadataRequest{key})},
      MessageType::kMetadata, timeout > absl::ZeroDuration() ? timeout : timeout_);
  if (!reply.ok()) return Annotate(reply.status(), absl::StrCat("metadata '", key, "' of ", peer));
  return handshake::DecodeMetadata(reply->payload);
}

}  // namespace engine_internal
}  // namespace kvferry
