// TcpTransport: registering memory (the table itself: region_table.h).
#include "transport/tcp/tcp_transport_internal.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

absl::StatusOr<Region> TcpTransport::RegisterMemory(void* addr, uint64_t length, Access access) {
  if (addr == nullptr) return absl::InvalidArgumentError("RegisterMemory: null address");
  if (length == 0) return absl::InvalidArgumentError("RegisterMemory: zero length");
  if (length > core_.options.max_region_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("RegisterMemory: ", length,
                                                     " bytes exceeds the limit of ",
                                                     core_.options.max_region_bytes));
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  if (base + length < base) return absl::InvalidArgumentError("RegisterMemory: range wraps");
  // Device memory is never touched by the CPU: its bytes go through pinned
  // staging buffers (see Staging).
  int device = -1;
  if (const cuda::Driver* driver = cuda::Driver::Get()) {
    ASSIGN_OR_RETURN(cuda::MemoryInfo where, driver->Classify(addr, length));
    if (where.device) device = where.ordinal;
  }
  std::unique_ptr<HostShare::Export> share =
      core_.options.host_share != nullptr ? core_.options.host_share->Share(addr, length, device)
                                          : nullptr;
  return core_.regions.Add(base, length, access, device, std::move(share));
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
