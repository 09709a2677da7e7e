// The message types' names and the payload each may claim (messages.h).
#include <cstdint>

#include "handshake/messages.h"

namespace kvferry {
namespace handshake {

const char* MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kDescribe:
      return "describe";
    case MessageType::kDescriptor:
      return "descriptor";
    case MessageType::kConnect:
      return "connect";
    case MessageType::kConnectReply:
      return "connect-reply";
    case MessageType::kNotify:
      return "notify";
    case MessageType::kNotifyAck:
      return "notify-ack";
    case MessageType::kProbe:
      return "probe";
    case MessageType::kProbeReply:
      return "probe-reply";
    case MessageType::kError:
      return "error";
    case MessageType::kGetMetadata:
      return "get-metadata";
    case MessageType::kChallenge:
      return "challenge";
    case MessageType::kChallengeReply:
      return "challenge-reply";
    case MessageType::kAuthenticated:
      return "authenticated";
    case MessageType::kAuthenticatedReply:
      return "authenticated-reply";
    case MessageType::kConnectLinksHere:
      return "connect-links-here";
    case MessageType::kMetadata:
      return "metadata";
    case MessageType::kConnectLinks:
      return "connect-links";
    case MessageType::kConnectLinksReply:
      return "connect-links-reply";
    case MessageType::kCloseLinks:
      return "close-links";
    case MessageType::kCloseLinksReply:
      return "close-links-reply";
    case MessageType::kDescribeV2:
      return "describe-v2";
    case MessageType::kDescriptorV2:
      return "descriptor-v2";
    case MessageType::kConfirm:
      return "confirm";
    case MessageType::kConfirmReply:
      return "confirm-reply";
  }
  return "unknown";
}

uint32_t MaxRequestPayloadBytes(MessageType type) {
  constexpr uint32_t kSmall = kMaxStringBytes + 64;  // a string and fixed fields
  switch (type) {
    case MessageType::kConnect:
      return kMaxConnectRequestBytes;
    case MessageType::kConnectLinks:
    case MessageType::kConnectLinksHere:
      return 64 + kMaxLinksPerConnect * (4 + kMaxConnectRequestBytes);
    case MessageType::kCloseLinks:
      return 64 + kMaxLinksPerConnect * (4 + kMaxStringBytes);
    case MessageType::kNotify:
      return kMaxNotifyBytes + kSmall;
    case MessageType::kAuthenticated:
      return kMaxNotifyBytes + (64 << 10);  // the envelope around any request
    default:
      return kSmall;
  }
}

}  // namespace handshake
}  // namespace kvferry
