// An extension of Transport (Transport::QueryExtension) for transports whose
// links are stream connections (TCP). It lets the engine save a connection
// and a round trip per new peer:
//   - a link is offered before the peer's NICs are known, so that the offer
//     travels with the request for the peer's description (OfferLink), and
//     is connected once they are (ConnectOffered);
//   - a link may run on a connection someone else opened: the first link to
//     a peer rides the handshake's connection (AdoptConnection).
// Only the code that built both the transport and the handshake network
// knows whether both sides can do this; the engine asks for the extension
// and does without it where it is absent. Transport and handshake::Network
// themselves carry no file descriptors.
#ifndef KVFERRY_TRANSPORT_STREAM_LINKS_H_
#define KVFERRY_TRANSPORT_STREAM_LINKS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "net/socket.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {

class StreamLinks {
 public:
  static constexpr absl::string_view kName = "kvferry.transport.stream_links";

  // CreateLink in two steps: the local half of a link on `local_nic`,
  // without touching the network. kInvalidArgument for an unknown NIC,
  // kResourceExhausted at the link limit.
  virtual absl::StatusOr<LinkOffer> OfferLink(NicIndex local_nic) = 0;
  // Reaches `peer_nic` for an offered link (before CompleteLink, and before
  // or after the peer's AcceptLink). kFailedPrecondition when the link is
  // connected already.
  virtual absl::Status ConnectOffered(LinkId link, const NicInfo& peer_nic) = 0;
  // `connection`, on which the peer's handshake answered the request for
  // this link, becomes the link's connection: as if an offered link had
  // connected to the peer (before CompleteLink), or as if the peer's
  // connection had arrived for an accepted link still waiting for it.
  // kFailedPrecondition when the link has a connection already.
  virtual absl::Status AdoptConnection(LinkId link, net::Fd connection) = 0;

 protected:
  ~StreamLinks() = default;
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_STREAM_LINKS_H_
