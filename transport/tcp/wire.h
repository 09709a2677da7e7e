// The TCP transport's wire format: the data header every request and
// answer starts with, and the link parameters exchanged in the handshake.
// Shared by the transport and the tests that speak to it as a peer would.
#ifndef KVFERRY_TRANSPORT_TCP_WIRE_H_
#define KVFERRY_TRANSPORT_TCP_WIRE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "transport/kinds.h"
#include "transport/link_params.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the TCP transport's wire format assumes little-endian hosts");

namespace kvferry {
namespace transport {
namespace tcp_wire {

enum MsgType : uint8_t { kWriteReq = 1, kReadReq = 2, kWriteAck = 3, kReadResp = 4 };
// DataHeader::flags of a request.
constexpr uint16_t kAckNow = 1;  // the last of its Post on the link: answer now
// Requests: no data follows but a ShareRef naming the requester's memory
// (transport/host_share.h), for the responder to copy from (WRITE) or into
// (READ) itself. Answers: a READ done that way (no data follows), or a
// request by reference the responder could not serve (status set: the
// requester sends it again with its bytes).
constexpr uint16_t kViaRef = 2;
// With kViaRef: the reference is of the share's second kind
// (HostShare::Name's second_kind).
constexpr uint16_t kRefSecondKind = 4;

// A kWriteAck answers a run of WRITEs: ids `id` .. `id + remote_addr - 1`
// (consecutive on the link, so no READ among them) all landed. An ack that
// reports an error answers the one request `id` (remote_addr 1).
struct DataHeader {
  uint8_t type = 0;
  uint8_t status = 0;     // absl::StatusCode of an answer
  uint16_t flags = 0;     // requests: kAckNow
  uint32_t text_len = 0;  // error text following an answer that failed
  uint64_t id = 0;
  uint64_t remote_addr = 0;
  uint64_t rkey = 0;
  uint64_t length = 0;  // data bytes following (WRITE request, READ answer)
};
static_assert(sizeof(DataHeader) == 40, "wire header size");

// Link parameters (transport/link_params.h): the pairing token, the
// transport's in-process key (0: no shortcut), the host's identity (HostId:
// 0 without a host share), and the share's link word (optional; absent or
// 0: none, as older peers send).
enum : uint8_t { kTokenField = 1, kKeyField = 2, kHostField = 3, kShareField = 4 };
// `kind`: TcpTransportOptions::kind.
inline std::string EncodeLinkParams(uint64_t token, uint64_t key, uint64_t host, uint64_t share = 0,
                                    absl::string_view kind = kind::kTcp) {
  LinkParams p{std::string(kind)};
  p.Put(kTokenField, token).Put(kKeyField, key).Put(kHostField, host);
  if (share != 0) p.Put(kShareField, share);
  return p.Encode();
}
struct PeerParams {
  uint64_t token = 0;
  uint64_t key = 0;
  uint64_t host = 0;
  uint64_t share = 0;
};
inline absl::StatusOr<PeerParams> DecodeLinkParams(absl::string_view bytes,
                                                   absl::string_view kind = kind::kTcp) {
  ASSIGN_OR_RETURN(LinkParams p, LinkParams::Decode(bytes, kind));
  PeerParams out;
  ASSIGN_OR_RETURN(out.token, p.Get(kTokenField, "pairing token"));
  ASSIGN_OR_RETURN(out.key, p.Get(kKeyField, "in-process key"));
  ASSIGN_OR_RETURN(out.host, p.Get(kHostField, "host identity"));
  out.share = p.Get(kShareField, "host share word").value_or(0);
  return out;
}

}  // namespace tcp_wire
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_WIRE_H_
