// A Transport over TCP sockets, for machines without RDMA.
//
// One-sided semantics are emulated by the peer's transport: every link is a
// TCP connection with a reader and a writer thread at each end. The
// responder's reader checks key, bounds and access before touching memory,
// receives WRITE data straight into the target region, and its writer sends
// READ data straight from the region (no intermediate copies). Several links
// to one peer give several connections; the engine opens them.
//
// The transport has one NIC: the data listener it binds (`bind_host`,
// advertised as `advertise_host`, or the bound address when that is empty).
// Peers connect to it on CreateLink; the link parameters carry a random
// token that pairs the accepted connection with the peer's AcceptLink.
//
// After a remote access error the responder stops executing on that
// connection and closes it, as an RC queue pair would enter the error state.
// A dead peer is noticed by EOF/RST at once, or by TCP keepalive and
// TCP_USER_TIMEOUT within `dead_peer_timeout` when its host vanished.
//
// A link made by AcceptLink whose connection has ended, with nothing
// outstanding, is closed by the transport on a later AcceptLink (its id then
// reads as unknown), so peers that reconnect often leak no sockets.
//
// Between two transports in one process (in_process_shortcut) requests are
// memcpy, not socket I/O; see TcpTransportOptions.
//
// Thread-safe. Wire format: host byte order, little-endian hosts only.
#ifndef KVFERRY_TRANSPORT_TCP_TCP_TRANSPORT_H_
#define KVFERRY_TRANSPORT_TCP_TCP_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "net/socket.h"
#include "transport/host_share.h"
#include "transport/kinds.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {

struct TcpTransportOptions {
  // Address the data listener binds ("0.0.0.0"/"::" for every interface).
  std::string bind_host = "127.0.0.1";
  // Address peers are told to connect to; empty: the bound address (must
  // then not be a wildcard).
  std::string advertise_host;
  // Data port; 0 picks one in `port_range` ({0, 0}: any free port).
  uint16_t port = 0;
  net::PortRange port_range{0, 0};
  absl::Duration connect_timeout = absl::Seconds(5);
  absl::Duration dead_peer_timeout = absl::Seconds(10);
  uint32_t max_outstanding_per_link = 4096;
  uint64_t max_request_bytes = uint64_t{1} << 32;
  uint64_t max_region_bytes = uint64_t{1} << 44;
  // When both ends of a link are TCP transports in this process, requests
  // skip the socket: the requester copies straight between the regions
  // (with the same key, bounds and access checks) and completes at once.
  // The connection stays, to notice the peer closing the link.
  bool in_process_shortcut = true;
  // Memory peers on this host may copy themselves (transport/host_share.h;
  // transport/cuda_ipc's NewCudaShare: CUDA IPC and VMM device memory). When
  // both ends of a link are on this host and each has one, a request whose
  // local buffer the share names carries the reference instead of its
  // bytes, and the responder copies (for CUDA, GPU to GPU): nothing crosses
  // the socket. A responder that cannot open a reference says so; the link
  // then sends the bytes, and the reason is logged. Null: every request
  // carries its bytes.
  std::shared_ptr<HostShare> host_share;
  // The kind this transport reports (EndpointDescription::kind) and its
  // link parameters carry: kind::kTcp, or the kind of a transport built on
  // this stream (transport/cuda_ipc), so that peers route its links to
  // their transport of that kind.
  std::string kind = kind::kTcp;
  // Links only between two transports on this host (same HostId): a link
  // to a peer on another host is refused at setup with kFailedPrecondition.
  // Needs host_share.
  bool same_host_only = false;
  // Threads started with the transport for the first links' readers and
  // writers (two per link), so that a new peer's first transfer does not
  // wait for threads to start. Threads of closed links are kept for the
  // next ones, up to 16 idle.
  size_t warm_threads = 4;
  // Links this transport holds at most (each has a reader and a writer
  // thread); more are refused with kResourceExhausted (docs/security.md).
  size_t max_links = 512;
  // The handshake secret (empty: none). With one, a data connection opens
  // with an HMAC of its link's token under the secret, and connections
  // without it are refused (docs/security.md); both ends must agree.
  std::string secret;
};

// Creates a TCP transport and starts its listener. kInvalidArgument for a
// wildcard bind without an advertise address; errors from binding.
absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(TcpTransportOptions options);

// How often threads waiting in a TCP transport's WaitCompletions read their
// links themselves (docs/performance.md, "The waiting thread reads its
// link"): the turns they took at links whose reader was parked, the
// acknowledgements they read, and the turns they gave back to the reader
// for something else on the link. All 0 for another transport. For tests
// and benchmarks.
struct TcpWaiterReads {
  uint64_t turns = 0;
  uint64_t acks = 0;
  uint64_t given_back = 0;
  // Waits that polled without sleeping first (a link's last run was small:
  // kSpinMaxRunBytes).
  uint64_t spins = 0;
};
TcpWaiterReads GetTcpWaiterReads(Transport& transport);

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_TCP_TRANSPORT_H_
