// The handshake network over TCP. Served connections live on one event
// loop (tcp_server.h: bounded connections, buffers and time, no thread per
// connection); a malformed frame closes that connection (the reason is
// logged, rate limited) while the listener keeps serving. Calls reuse idle
// connections to the same peer.
#ifndef KVFERRY_HANDSHAKE_TCP_NETWORK_H_
#define KVFERRY_HANDSHAKE_TCP_NETWORK_H_

#include <memory>

#include "handshake/network.h"
#include "handshake/tcp_server.h"

namespace kvferry {
namespace handshake {

struct TcpNetworkOptions {
  // The largest reply a Call accepts (a descriptor with many regions).
  uint32_t max_frame_bytes = kDefaultMaxFrameBytes;
  // What a served connection may make the server hold.
  TcpServerOptions server;
};

std::unique_ptr<Network> NewTcpNetwork(TcpNetworkOptions options = {});

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_TCP_NETWORK_H_
