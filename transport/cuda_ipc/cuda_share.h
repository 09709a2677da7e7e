// Same-host GPU sharing (transport/host_share.h) through the CUDA driver:
// device memory with a CUDA IPC handle (cudaMalloc memory) is named by its
// allocation's handle, and VMM memory (cuMemCreate + cuMemMap, PyTorch's
// expandable segments) by an export id on this process's VmmServer
// (vmm_share.h), from which a peer fetches the chunks as fds. The
// responder opens the reference through its own device's context and the
// GPUs copy (NVLink or PCIe): nothing but the request crosses the socket.
//
// The cuda_ipc transport (cuda_ipc_transport.h) installs it on its control
// stream (TcpTransportOptions::host_share).
#ifndef KVFERRY_TRANSPORT_CUDA_IPC_CUDA_SHARE_H_
#define KVFERRY_TRANSPORT_CUDA_IPC_CUDA_SHARE_H_

#include <cstddef>
#include <memory>

#include "transport/host_share.h"

namespace kvferry {
namespace transport {

struct CudaShareOptions {
  // Another process's allocations (IPC handles, VMM regions) a link keeps
  // mapped at most; past that the least recently used is unmapped (so a
  // peer that registers and frees memory over and over pins at most this
  // many of its allocations here).
  size_t max_imports = 64;
};

// The share over the loaded CUDA driver; null when there is none.
std::shared_ptr<HostShare> NewCudaShare(const CudaShareOptions& options = {});

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_CUDA_IPC_CUDA_SHARE_H_
