// The same-host GPU transport (kind "cuda_ipc"): links only between two
// engines on this host, over which device memory is copied GPU to GPU
// (NVLink or PCIe) by the responder, through CUDA IPC handles
// (cudaMalloc memory) and VMM fds (cuMemCreate memory) that the request
// names instead of carrying its bytes. Nothing but the request and its
// answer crosses the socket.
//
// Its control channel is the TCP transport's stream (transport/tcp: links,
// pairing, keys, bounds and access checks, the error state, flow control),
// which carries a reference where this transport's share names the local
// buffer (transport/host_share.h). Host memory, and device memory the peer
// cannot open (another user's process, a driver without IPC), goes as
// bytes on the same links, so a segment over this transport moves any
// registered memory. The mechanism (what a reference is, how it is opened,
// the copy) is cuda_share.h's; the engine's path choice sends peers on this
// host here when a CUDA driver is loaded (engine/pipeline/path_choice.h).
//
// Thread-safe, as the TCP transport is. A link to a peer on another host
// is refused at setup (kFailedPrecondition).
#ifndef KVFERRY_TRANSPORT_CUDA_IPC_CUDA_IPC_TRANSPORT_H_
#define KVFERRY_TRANSPORT_CUDA_IPC_CUDA_IPC_TRANSPORT_H_

#include <memory>

#include "absl/status/statusor.h"
#include "transport/cuda_ipc/cuda_share.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {

struct CudaIpcTransportOptions {
  // The control stream: where it listens, its limits, the secret. Its
  // `kind`, `host_share` and `same_host_only` are set by the factory.
  TcpTransportOptions stream;
  CudaShareOptions share;
};

// kFailedPrecondition when no CUDA driver is loaded (cuda::Driver::Get());
// otherwise as CreateTcpTransport.
absl::StatusOr<std::unique_ptr<Transport>> CreateCudaIpcTransport(CudaIpcTransportOptions options);

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_CUDA_IPC_CUDA_IPC_TRANSPORT_H_
