#include "transport/cuda_ipc/cuda_ipc_transport.h"

#include <utility>

#include "transport/kinds.h"

namespace kvferry {
namespace transport {

absl::StatusOr<std::unique_ptr<Transport>> CreateCudaIpcTransport(CudaIpcTransportOptions options) {
  std::shared_ptr<HostShare> share = NewCudaShare(options.share);
  if (share == nullptr) {
    return absl::FailedPreconditionError(
        "the cuda_ipc transport needs a CUDA driver, and none is loaded");
  }
  TcpTransportOptions& t = options.stream;
  t.kind = kind::kCudaIpc;
  t.host_share = std::move(share);
  t.same_host_only = true;
  return CreateTcpTransport(std::move(t));
}

}  // namespace transport
}  // namespace kvferry
