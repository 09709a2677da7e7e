// The handshake protocol: framed, versioned, bounds-checked messages that
// engines exchange over their handshake port (TCP, or the simulated network).
//
// Frame: 8-byte header, then the payload.
//   u16 magic 0x464b ("KF")   u8 version (1)   u8 type   u32 payload length
// All integers little-endian; strings and byte blobs are u32 length + bytes.
//
// A connection carries requests from the side that opened it and one reply
// per request (the reply type, or kError with a status).
//
// Errors when decoding: bad magic or malformed payload -> kDataLoss;
// unknown version -> kUnimplemented (names both versions); frame above the
// limit, or more NICs/regions than allowed -> kResourceExhausted.
#ifndef KVFERRY_HANDSHAKE_MESSAGES_H_
#define KVFERRY_HANDSHAKE_MESSAGES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/transport.h"

namespace kvferry {
namespace handshake {

inline constexpr uint16_t kMagic = 0x464b;
// The framing's version, in every frame header: unchanged since the first
// release (a peer refuses frames of another).
inline constexpr uint8_t kVersion = 1;
// The protocol's version, exchanged in describe (kDescribeV2 and
// kDescriptorV2, which version 1 peers do not know). Version 2 added them
// and the capabilities they carry.
inline constexpr uint16_t kProtocolVersion = 2;
// What a peer speaks beyond version 1's first messages (1 to 15), so that a
// client knows before it asks. A version 1 peer states none: whether it
// knows messages 16 to 20 shows only in how it answers them.
enum Capability : uint64_t {
  kCapConnectLinks = uint64_t{1} << 0,      // kConnectLinks, kConnectLinksReply
  kCapCloseLinks = uint64_t{1} << 1,        // kCloseLinks, kCloseLinksReply
  kCapConnectLinksHere = uint64_t{1} << 2,  // kConnectLinksHere
  kCapConfirm = uint64_t{1} << 3,           // kConfirm, kConfirmReply
};
// What this build speaks.
inline constexpr uint64_t kCapabilities =
    kCapConnectLinks | kCapCloseLinks | kCapConnectLinksHere | kCapConfirm;
inline constexpr size_t kFrameHeaderBytes = 8;
inline constexpr uint32_t kDefaultMaxFrameBytes = 16 << 20;
inline constexpr uint32_t kMaxNics = 64;
inline constexpr uint32_t kMaxRegions = 1 << 16;
inline constexpr uint32_t kMaxStringBytes = 4096;
inline constexpr uint32_t kMaxNotifyBytes = 1 << 20;

enum class MessageType : uint8_t {
  kDescribe = 1,      // request: send me your descriptor
  kDescriptor = 2,    // reply: EngineDescriptor
  kConnect = 3,       // request: build a link (ConnectRequest)
  kConnectReply = 4,  // reply: the passive side's link parameters
  kNotify = 5,        // request: deliver a notification
  kNotifyAck = 6,     // reply: delivered
  kProbe = 7,         // request: are you there, who are you
  kProbeReply = 8,    // reply
  kError = 9,         // reply to any request: a status
  kGetMetadata = 10,  // request: the value published under a key
  kMetadata = 11,     // reply: that value
  // Authentication (auth.h): a fresh server nonce, then the real request
  // wrapped with an HMAC over it, and the reply wrapped likewise.
  kChallenge = 12,           // request: give me a nonce
  kChallengeReply = 13,      // reply: the nonce
  kAuthenticated = 14,       // request: AuthenticatedFrame
  kAuthenticatedReply = 15,  // reply: AuthenticatedFrame
  // Every link to a peer in one round trip (ConnectLinksRequest), and one
  // answer per link (ConnectLinksReply).
  kConnectLinks = 16,
  kConnectLinksReply = 17,
  // Close the passive halves of some of the requester's links
  // (CloseLinksRequest) before it sends their work again elsewhere; the
  // reply (empty) says they are closed.
  kCloseLinks = 18,
  kCloseLinksReply = 19,
  // kConnectLinks whose first link rides the connection the request came
  // on: when the reply (kConnectLinksReply) accepts that link, the
  // connection carries the link's data from the byte after the reply on,
  // and is no longer the handshake's. Only over a network whose calls run
  // on connections of their own (Network::CanHandOver); the requester sends
  // nothing after it until the reply.
  kConnectLinksHere = 20,
  // Protocol version 2: describe whose reply states the peer's version and
  // capabilities (EncodeDescriptorV2). A version 1 peer refuses the type as
  // unknown, and is described with kDescribe instead.
  kDescribeV2 = 21,
  kDescriptorV2 = 22,
  // Did you send this notification (Confirm: its digest)? The answer
  // (ConfirmReply) names the answering engine: a receiver takes a word
  // that fails, fences or completes something only once the engine it
  // names, at the address it expects, says it sent it.
  kConfirm = 23,
  kConfirmReply = 24,
};
inline constexpr uint8_t kLastMessageType = 24;
// The most links one kConnectLinks asks for (the engine's links_per_peer
// and NIC count are capped at 64 too).
inline constexpr uint32_t kMaxLinksPerConnect = 64;
// A ConnectRequest (alone, or one of kConnectLinks'): two NIC strings, the
// parameters and fixed fields.
inline constexpr uint32_t kMaxConnectRequestBytes = 3 * kMaxStringBytes + 64;
const char* MessageTypeName(MessageType type);

struct FrameHeader {
  MessageType type;
  uint32_t payload_bytes;
};

// The 8-byte header followed by `payload`.
std::string EncodeFrame(MessageType type, absl::string_view payload);
// Parses the first kFrameHeaderBytes of `header`.
absl::StatusOr<FrameHeader> ParseFrameHeader(absl::string_view header, uint32_t max_payload_bytes);
// The most a request of `type` can need by its own encoding: a describe,
// probe or challenge is never large, and only a notification or an
// authenticated frame (which may wrap one) reaches kMaxNotifyBytes. A server
// refuses a header that claims more (before its bytes arrive). Reply types
// never come as requests: a small bound.
uint32_t MaxRequestPayloadBytes(MessageType type);

// A region as a peer may use it.
struct RegionDescriptor {
  uint64_t addr = 0;
  uint64_t length = 0;
  transport::Access access = transport::Access::kNone;
  std::vector<transport::RemoteKey> keys;  // one per NIC of the descriptor
};

// Everything a peer needs: who the engine is (a random id that changes on
// every start, so a restarted peer is recognised), its transport, NICs and
// accessible regions.
struct EngineDescriptor {
  uint64_t engine_id = 0;
  std::string transport_kind;
  std::vector<transport::NicInfo> nics;
  std::vector<RegionDescriptor> regions;
  // As the peer stated them in kDescriptorV2; nullopt for a version 1
  // peer (described with kDescribe), which states nothing.
  uint16_t protocol_version = 1;
  std::optional<uint64_t> capabilities;

  // Whether the peer says it speaks `cap`: nullopt when it says nothing
  // (version 1).
  std::optional<bool> Speaks(Capability cap) const {
    if (!capabilities.has_value()) return std::nullopt;
    return (*capabilities & cap) != 0;
  }
};

struct ConnectRequest {
  uint64_t engine_id = 0;      // the requester
  uint32_t requester_nic = 0;  // index in the requester's descriptor
  transport::NicInfo requester_nic_info;
  uint32_t target_nic = 0;  // index in the target's descriptor
  std::string params;       // from Transport::CreateLink
  // The requester's epoch with this peer: 0 until the peer fenced it, then
  // one past the epoch the peer's refusal named (FencedEpoch). Sent only
  // when not 0, so that peers that never fence by epoch read the frame as
  // they always have.
  uint64_t epoch = 0;
};

struct ConnectReply {
  std::string params;  // from Transport::AcceptLink
};

struct ConnectLinksRequest {
  std::vector<ConnectRequest> links;  // 1 to kMaxLinksPerConnect
};

// One answer per requested link, in order: its parameters from
// Transport::AcceptLink, or why it was refused.
struct ConnectLinksReply {
  std::vector<absl::StatusOr<std::string>> links;
};

// The links are named by the parameters the passive side answered when it
// accepted them (ConnectReply::params); only links the requesting engine
// opened are closed, and names that match none are ignored.
struct CloseLinksRequest {
  uint64_t engine_id = 0;          // the requester
  std::vector<std::string> links;  // 1 to kMaxLinksPerConnect
};

struct Notify {
  uint64_t engine_id = 0;  // the sender
  std::string payload;
  // The receiving engine it is meant for (0: whichever answers). A peer
  // that restarted has a new id and refuses notifications about data that
  // went to its predecessor.
  uint64_t target_engine_id = 0;
  uint64_t epoch = 0;  // the sender's epoch with this peer (as ConnectRequest's)
};

struct Probe {
  uint64_t engine_id = 0;
  uint64_t nonce = 0;
};

struct Confirm {
  uint64_t engine_id = 0;  // the asker
  uint64_t digest = 0;     // NotificationDigest of the message
};

struct ConfirmReply {
  uint64_t engine_id = 0;  // the answerer
  bool sent = false;       // it sent a notification of that digest lately
};

// Small named values an engine publishes for its peers (e.g. the layout of
// a KV pool): keys up to kMaxStringBytes, values up to kMaxNotifyBytes.
struct MetadataRequest {
  std::string key;
};
struct Metadata {
  std::string key;
  std::string value;
  uint64_t engine_id = 0;  // the engine that answered
};

std::string Encode(const EngineDescriptor& d);
std::string Encode(const ConnectRequest& r);
std::string Encode(const ConnectReply& r);
std::string Encode(const ConnectLinksRequest& r);
std::string Encode(const ConnectLinksReply& r);
std::string Encode(const CloseLinksRequest& r);
std::string Encode(const Notify& n);
std::string Encode(const Probe& p);
std::string Encode(const MetadataRequest& m);
std::string Encode(const Metadata& m);
// An error reply carries a status (never OK).
std::string EncodeError(const absl::Status& status);

absl::StatusOr<EngineDescriptor> DecodeDescriptor(absl::string_view payload);
// kDescriptorV2's payload: the protocol version (u16) and capabilities
// (u64), then the descriptor as Encode writes it.
std::string EncodeDescriptorV2(const EngineDescriptor& d);
absl::StatusOr<EngineDescriptor> DecodeDescriptorV2(absl::string_view payload);
absl::StatusOr<ConnectRequest> DecodeConnectRequest(absl::string_view payload);
absl::StatusOr<ConnectReply> DecodeConnectReply(absl::string_view payload);
absl::StatusOr<ConnectLinksRequest> DecodeConnectLinksRequest(absl::string_view payload);
absl::StatusOr<ConnectLinksReply> DecodeConnectLinksReply(absl::string_view payload);
absl::StatusOr<CloseLinksRequest> DecodeCloseLinksRequest(absl::string_view payload);
absl::StatusOr<Notify> DecodeNotify(absl::string_view payload);
absl::StatusOr<Probe> DecodeProbe(absl::string_view payload);
std::string Encode(const Confirm& c);
absl::StatusOr<Confirm> DecodeConfirm(absl::string_view payload);
std::string Encode(const ConfirmReply& c);
absl::StatusOr<ConfirmReply> DecodeConfirmReply(absl::string_view payload);
absl::StatusOr<MetadataRequest> DecodeMetadataRequest(absl::string_view payload);
absl::StatusOr<Metadata> DecodeMetadata(absl::string_view payload);
// Decodes an error payload into the status it carries (kDataLoss if the
// payload itself is malformed).
// The status a peer's kError frame carries; PeerAnswered() is true of it
// (and of a malformed one): the peer's process was there to answer.
absl::Status DecodeError(absl::string_view payload);
bool PeerAnswered(const absl::Status& status);

// A refusal of links or notifications from a peer instance this engine
// fenced (declared failed) at epochs up to `epoch`: kFailedPrecondition,
// with the epoch at the end of the message ("[fence epoch N]"), where the
// peer's client reads it (FencedEpoch) and takes epoch N + 1 with this
// engine. The message carries it because an error frame carries a code
// and a message only, and every version of the protocol reads those.
absl::Status FencedError(absl::string_view message, uint64_t epoch);
// The epoch a refusal from FencedError names, if it is one.
std::optional<uint64_t> FencedEpoch(const absl::Status& status);

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_MESSAGES_H_
