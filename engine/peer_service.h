// The engine's side of the peer protocol that answers: describes this
// engine, accepts links, takes notifications, answers probes and metadata
// requests. Runs on the handshake server's threads; holds no state of its
// own, only the units it answers from (which outlive it).
#ifndef KVFERRY_ENGINE_PEER_SERVICE_H_
#define KVFERRY_ENGINE_PEER_SERVICE_H_

#include <cstdint>
#include <vector>

#include "engine/local_regions.h"
#include "engine/notifications.h"
#include "handshake/messages.h"
#include "handshake/network.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

class PeerService {
 public:
  // `transports`: the primary first (LocalRegions' order).
  PeerService(uint64_t engine_id, std::vector<transport::Transport*> transports,
              const LocalRegions* regions, Inbox* inbox, const MetadataStore* metadata)
      : engine_id_(engine_id),
        transports_(std::move(transports)),
        regions_(regions),
        inbox_(inbox),
        metadata_(metadata) {}

  // This engine as peers see it through the transport of `kind` (empty:
  // the primary): NICs and the regions they may use. kNotFound when this
  // engine has no such transport.
  absl::StatusOr<handshake::EngineDescriptor> Describe(absl::string_view kind) const;
  // Whether answering a request of `type` may wait (accepting a link waits
  // for its data connection); the others answer at once, and the handshake
  // server runs them on its event loop.
  static bool MayBlock(handshake::MessageType type) {
    return type == handshake::MessageType::kConnect ||
           type == handshake::MessageType::kConnectLinks;
  }
  // Answers one request (an error frame for anything malformed).
  handshake::Frame Handle(const handshake::Frame& request);

 private:
  // One link: the accepting transport's parameters.
  absl::StatusOr<std::string> Accept(const handshake::ConnectRequest& c);
  handshake::Frame Connect(const handshake::Frame& request);
  handshake::Frame ConnectLinks(const handshake::Frame& request);
  handshake::Frame Notify(const handshake::Frame& request);

  const uint64_t engine_id_;
  const std::vector<transport::Transport*> transports_;
  const LocalRegions* const regions_;
  Inbox* const inbox_;
  const MetadataStore* const metadata_;
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PEER_SERVICE_H_
