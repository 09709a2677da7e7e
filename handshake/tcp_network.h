// The handshake network over TCP. Each served connection is handled by its
// own thread, one request at a time; a malformed frame closes that
// connection (the reason is logged) while the listener keeps serving.
// Calls reuse idle connections to the same peer.
#ifndef KVFERRY_HANDSHAKE_TCP_NETWORK_H_
#define KVFERRY_HANDSHAKE_TCP_NETWORK_H_

#include <memory>

#include "handshake/network.h"

namespace kvferry {
namespace handshake {

struct TcpNetworkOptions {
  uint32_t max_frame_bytes = kDefaultMaxFrameBytes;
  // How long a served connection may stay silent before it is closed.
  absl::Duration idle_timeout = absl::Seconds(60);
};

std::unique_ptr<Network> NewTcpNetwork(TcpNetworkOptions options = {});

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_TCP_NETWORK_H_
