// The verbs transport: opening the NICs, registering memory, the
// link-parameter codec, and CreateVerbsTransport (see
// verbs_transport_internal.h for the other files).
#include <infiniband/verbs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "base/thread.h"
#include "cuda/driver.h"
#include "transport/kinds.h"
#include "transport/link_params.h"
#include "transport/verbs/ibv.h"
#include "transport/verbs/verbs_transport_internal.h"

namespace kvferry {
namespace transport {
namespace verbs_internal {

absl::Status VerbsTransport::Open() {
  if (options_.ports.empty()) return absl::InvalidArgumentError("no RDMA ports to use");
  nics_.resize(options_.ports.size());
  for (size_t i = 0; i < nics_.size(); ++i) {
    Nic& nic = nics_[i];
    nic.port = options_.ports[i];
    RETURN_IF_ERROR(OpenNic(nic));
    if (nic.max_mr_size > 0) max_region_bytes_ = std::min(max_region_bytes_, nic.max_mr_size);
    max_request_bytes_ = std::min<uint64_t>(
        max_request_bytes_ == 0 ? options_.max_request_bytes : max_request_bytes_,
        nic.attr.max_msg_sz);
  }
  ASSIGN_OR_RETURN(poller_, StartThread("the verbs completion poller", [this] { PollerLoop(); }));
  return absl::OkStatus();
}

VerbsTransport::~VerbsTransport() {
  stopping_ = true;
  if (poller_.joinable()) poller_.join();
  MutexLock lock(&mu_);
  // QPs and MRs before the NICs' CQs, PDs and devices.
  by_qp_.clear();
  links_.clear();
  regions_.clear();
  nics_.clear();
}

EndpointDescription VerbsTransport::LocalEndpoint() const {
  EndpointDescription d;
  d.kind = kind::kVerbs;
  for (const Nic& nic : nics_) {
    NicInfo info;
    info.name = absl::StrCat(nic.port.device, ":", nic.port.port);
    info.address = absl::StrCat("verbs:", GidText(nic.gid), "/", nic.attr.lid);
    info.numa_node = nic.port.numa_node;
    info.mtu = MtuBytes(nic.attr.active_mtu);
    d.nics.push_back(std::move(info));
  }
  return d;
}

absl::StatusOr<Region> VerbsTransport::RegisterMemory(void* addr, uint64_t length, Access access) {
  if (addr == nullptr) return absl::InvalidArgumentError("RegisterMemory: null address");
  if (length == 0) return absl::InvalidArgumentError("RegisterMemory: zero length");
  if (length > GetLimits().max_region_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "RegisterMemory: %u bytes exceed the largest region %s can register (%u)", length,
        nics_.empty() ? "the device" : nics_[0].port.device, GetLimits().max_region_bytes));
  }
  int flags = IBV_ACCESS_LOCAL_WRITE;
  if (AllowsRemoteWrite(access)) flags |= IBV_ACCESS_REMOTE_WRITE;
  if (AllowsRemoteRead(access)) flags |= IBV_ACCESS_REMOTE_READ;
  auto state = std::make_unique<RegionState>();
  // CUDA device memory: through a dma-buf of its pages first, then plain
  // ibv_reg_mr (which works on device memory where nvidia-peermem is loaded).
  int device = -1;
  std::optional<absl::StatusOr<cuda::Driver::DmaBuf>> dmabuf;
  if (const cuda::Driver* driver = cuda::Driver::Get()) {
    ASSIGN_OR_RETURN(cuda::MemoryInfo where, driver->Classify(addr, length));
    if (where.device) {
      device = where.ordinal;
      dmabuf = driver->ExportDmaBuf(addr, length, device);
    }
  }
  const Registration what{addr, length, flags, device, dmabuf.has_value() ? &*dmabuf : nullptr};
  std::vector<absl::StatusOr<ibv::Mr>> mrs =
      RegisterOnEveryNic(nics_, what, options_.parallel_registration_bytes);
  // The MRs hold their own reference to the dma-buf.
  if (dmabuf.has_value() && dmabuf->ok()) ::close((*dmabuf)->fd);
  // Any failure: the others deregister as `mrs` goes.
  for (absl::StatusOr<ibv::Mr>& mr : mrs) RETURN_IF_ERROR(mr.status());
  for (absl::StatusOr<ibv::Mr>& mr : mrs) {
    state->region.keys.push_back((*mr)->rkey);
    state->mrs.push_back(std::move(*mr));
  }
  MutexLock lock(&mu_);
  Region& r = state->region;
  r.id = ++last_region_;
  r.addr = reinterpret_cast<uintptr_t>(addr);
  r.length = length;
  r.access = access;
  Region out = r;
  regions_.emplace(r.id, std::move(state));
  return out;
}

absl::Status VerbsTransport::UnregisterMemory(RegionId region) {
  MutexLock lock(&mu_);
  auto it = regions_.find(region);
  if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("unknown region ", region));
  if (it->second->local_uses != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "region ", region, " is used by ", it->second->local_uses, " outstanding request(s)"));
  }
  regions_.erase(it);  // deregisters
  return absl::OkStatus();
}

}  // namespace verbs_internal

absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(VerbsTransportOptions options) {
  auto t = std::make_unique<verbs_internal::VerbsTransport>(std::move(options));
  RETURN_IF_ERROR(t->Open());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace transport
}  // namespace kvferry
