#include "handshake/fuzz/fuzz_targets.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "handshake/auth.h"
#include "handshake/fuzz/check.h"
#include "handshake/messages.h"
#include "transport/tcp/hello_acceptor.h"

namespace kvferry {
namespace handshake {
namespace {

bool SameNic(const transport::NicInfo& a, const transport::NicInfo& b) {
  return a.name == b.name && a.address == b.address && a.numa_node == b.numa_node &&
         a.link_bits_per_sec == b.link_bits_per_sec && a.mtu == b.mtu;
}

bool SameDescriptor(const EngineDescriptor& a, const EngineDescriptor& b) {
  if (a.engine_id != b.engine_id || a.transport_kind != b.transport_kind ||
      a.nics.size() != b.nics.size() || a.regions.size() != b.regions.size()) {
    return false;
  }
  for (size_t i = 0; i < a.nics.size(); ++i) {
    if (!SameNic(a.nics[i], b.nics[i])) return false;
  }
  for (size_t i = 0; i < a.regions.size(); ++i) {
    const RegionDescriptor &x = a.regions[i], &y = b.regions[i];
    if (x.addr != y.addr || x.length != y.length || x.access != y.access || x.keys != y.keys) {
      return false;
    }
  }
  return true;
}

// Decodes with `decode`; if it accepts, the re-encoding must decode equal.
template <typename T, typename Decode, typename Same>
void RoundTrip(absl::string_view payload, Decode decode, Same same) {
  absl::StatusOr<T> v = decode(payload);
  if (!v.ok()) return;
  absl::StatusOr<T> again = decode(Encode(*v));
  Check(again.ok(), "a decoded value does not decode after re-encoding");
  Check(same(*v, *again), "a decoded value changed through re-encoding");
}

}  // namespace

void FuzzDescriptor(const uint8_t* data, size_t size) {
  RoundTrip<EngineDescriptor>(
      absl::string_view(reinterpret_cast<const char*>(data), size),
      [](absl::string_view p) { return DecodeDescriptor(p); }, SameDescriptor);
}

void FuzzFrame(const uint8_t* data, size_t size) {
  const absl::string_view in(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<FrameHeader> h = ParseFrameHeader(in, 1 << 20);
  if (!h.ok()) return;
  Check(static_cast<uint8_t>(h->type) >= 1 && static_cast<uint8_t>(h->type) <= kLastMessageType,
        "header accepted an unknown type");
  Check(h->payload_bytes <= (1u << 20), "header accepted a payload above the limit");
  const absl::string_view payload = in.substr(kFrameHeaderBytes, h->payload_bytes);
  switch (h->type) {
    case MessageType::kDescriptor:
      FuzzDescriptor(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
      break;
    case MessageType::kConnect:
      RoundTrip<ConnectRequest>(
          payload, [](absl::string_view p) { return DecodeConnectRequest(p); },
          [](const ConnectRequest& a, const ConnectRequest& b) {
            return a.engine_id == b.engine_id && a.requester_nic == b.requester_nic &&
                   SameNic(a.requester_nic_info, b.requester_nic_info) &&
                   a.target_nic == b.target_nic && a.params == b.params;
          });
      break;
    case MessageType::kConnectReply:
      RoundTrip<ConnectReply>(
          payload, [](absl::string_view p) { return DecodeConnectReply(p); },
          [](const ConnectReply& a, const ConnectReply& b) { return a.params == b.params; });
      break;
    case MessageType::kConnectLinks:
      RoundTrip<ConnectLinksRequest>(
          payload, [](absl::string_view p) { return DecodeConnectLinksRequest(p); },
          [](const ConnectLinksRequest& a, const ConnectLinksRequest& b) {
            if (a.links.size() != b.links.size()) return false;
            for (size_t i = 0; i < a.links.size(); ++i) {
              if (a.links[i].params != b.links[i].params ||
                  a.links[i].target_nic != b.links[i].target_nic) {
                return false;
              }
            }
            return true;
          });
      break;
    case MessageType::kConnectLinksReply:
      RoundTrip<ConnectLinksReply>(
          payload, [](absl::string_view p) { return DecodeConnectLinksReply(p); },
          [](const ConnectLinksReply& a, const ConnectLinksReply& b) {
            if (a.links.size() != b.links.size()) return false;
            for (size_t i = 0; i < a.links.size(); ++i) {
              if (a.links[i].ok() != b.links[i].ok()) return false;
              if (a.links[i].ok() ? *a.links[i] != *b.links[i]
                                  : a.links[i].status() != b.links[i].status()) {
                return false;
              }
            }
            return true;
          });
      break;
    case MessageType::kCloseLinks:
      RoundTrip<CloseLinksRequest>(
          payload, [](absl::string_view p) { return DecodeCloseLinksRequest(p); },
          [](const CloseLinksRequest& a, const CloseLinksRequest& b) {
            return a.engine_id == b.engine_id && a.links == b.links;
          });
      break;
    case MessageType::kNotify:
      RoundTrip<Notify>(
          payload, [](absl::string_view p) { return DecodeNotify(p); },
          [](const Notify& a, const Notify& b) {
            return a.engine_id == b.engine_id && a.payload == b.payload &&
                   a.target_engine_id == b.target_engine_id;
          });
      break;
    case MessageType::kProbe:
    case MessageType::kProbeReply:
      RoundTrip<Probe>(
          payload, [](absl::string_view p) { return DecodeProbe(p); },
          [](const Probe& a, const Probe& b) {
            return a.engine_id == b.engine_id && a.nonce == b.nonce;
          });
      break;
    case MessageType::kGetMetadata:
      RoundTrip<MetadataRequest>(
          payload, [](absl::string_view p) { return DecodeMetadataRequest(p); },
          [](const MetadataRequest& a, const MetadataRequest& b) { return a.key == b.key; });
      break;
    case MessageType::kMetadata:
      RoundTrip<Metadata>(
          payload, [](absl::string_view p) { return DecodeMetadata(p); },
          [](const Metadata& a, const Metadata& b) {
            return a.key == b.key && a.value == b.value && a.engine_id == b.engine_id;
          });
      break;
    case MessageType::kConfirm:
      RoundTrip<Confirm>(
          payload, [](absl::string_view p) { return DecodeConfirm(p); },
          [](const Confirm& a, const Confirm& b) {
            return a.engine_id == b.engine_id && a.digest == b.digest;
          });
      break;
    case MessageType::kConfirmReply:
      RoundTrip<ConfirmReply>(
          payload, [](absl::string_view p) { return DecodeConfirmReply(p); },
          [](const ConfirmReply& a, const ConfirmReply& b) {
            return a.engine_id == b.engine_id && a.sent == b.sent;
          });
      break;
    case MessageType::kError: {
      absl::Status s = DecodeError(payload);
      Check(!s.ok(), "an error payload decoded to OK");
      break;
    }
    default:
      break;
  }
}

namespace {

// Captures the handler an authenticated network serves with.
class CaptureNetwork : public Network {
 public:
  Handler* captured;
  explicit CaptureNetwork(Handler* out) : captured(out) {}
  absl::StatusOr<std::unique_ptr<Server>> Serve(const ServeOptions&, Handler handler) override {
    *captured = std::move(handler);
    return absl::UnimplementedError("captured");
  }
  absl::StatusOr<Frame> Call(const std::string&, const Frame&, absl::Duration) override {
    return absl::UnimplementedError("server side only");
  }
};

}  // namespace

void FuzzAuthenticated(const uint8_t* data, size_t size) {
  // Made once; both destroyed at exit (the handler refers to the network's
  // state, which it shares).
  static Handler handler;
  static std::unique_ptr<AuthenticatedNetwork> network = [] {
    AuthOptions o;
    o.secret = "fuzz-secret-0123456789abcdef";
    auto net = AuthenticatedNetwork::Create(std::make_unique<CaptureNetwork>(&handler), o);
    Check(net.ok(), "no authenticated network");
    (void)(*net)->Serve(ServeOptions{}, [](const Frame&) -> Frame {
      Check(false, "a frame without the secret reached the engine's handler");
      return Frame{};
    });
    return std::move(*net);
  }();
  Handler* served = &handler;
  if (size == 0 || !*served) return;
  const Frame f{static_cast<MessageType>(data[0]),
                std::string(reinterpret_cast<const char*>(data) + 1, size - 1)};
  const Frame reply = (*served)(f);
  Check(reply.type == MessageType::kError || reply.type == MessageType::kChallengeReply,
        "an unauthenticated frame got an answer other than an error or a challenge");
}

void FuzzHello(const uint8_t* data, size_t size) {
  const absl::string_view in(reinterpret_cast<const char*>(data), size);
  for (const std::string& secret : {std::string(), std::string("fuzz-secret-0123456789abcdef")}) {
    const transport::HelloVerdict v = transport::CheckHello(in, secret);
    if (v.kind != transport::HelloVerdict::kAccept) continue;
    const std::string made = transport::EncodeHello(v.token, secret);
    Check(in.size() >= made.size() && in.substr(0, made.size()) == made,
          "a data hello was accepted that is not the one its token makes");
    Check(transport::CheckHello(made, secret).kind == transport::HelloVerdict::kAccept,
          "a made hello is not accepted");
  }
}

}  // namespace handshake
}  // namespace kvferry
