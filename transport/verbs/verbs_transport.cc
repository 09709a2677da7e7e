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
#include "base/clock.h"
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
  if (core_.options.ports.empty()) return absl::InvalidArgumentError("no RDMA ports to use");
  core_.nics.resize(core_.options.ports.size());
  for (size_t i = 0; i < core_.nics.size(); ++i) {
    Nic& nic = core_.nics[i];
    nic.port = core_.options.ports[i];
    RETURN_IF_ERROR(OpenNic(nic));
    if (nic.max_mr_size > 0)
      core_.max_region_bytes = std::min(core_.max_region_bytes, nic.max_mr_size);
    core_.max_request_bytes = std::min<uint64_t>(
        core_.max_request_bytes == 0 ? core_.options.max_request_bytes : core_.max_request_bytes,
        nic.attr.max_msg_sz);
  }
  return poller_.Start();
}

VerbsTransport::~VerbsTransport() {
  poller_.Stop();
  MutexLock lock(&core_.mu);
  // QPs and MRs before the NICs' CQs, PDs and devices.
  core_.by_qp.clear();
  core_.links.clear();
  core_.regions.clear();
  core_.nics.clear();
}

EndpointDescription VerbsTransport::LocalEndpoint() const {
  EndpointDescription d;
  d.kind = kind::kVerbs;
  for (const Nic& nic : core_.nics) {
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
    return absl::ResourceExhaustedError(
        absl::StrFormat("RegisterMemory: %u bytes exceed the largest region %s can register (%u)",
                        length, core_.nics.empty() ? "the device" : core_.nics[0].port.device,
                        GetLimits().max_region_bytes));
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
      RegisterOnEveryNic(core_.nics, what, core_.options.parallel_registration_bytes);
  // The MRs hold their own reference to the dma-buf.
  if (dmabuf.has_value() && dmabuf->ok()) ::close((*dmabuf)->fd);
  // Any failure: the others deregister as `mrs` goes.
  for (absl::StatusOr<ibv::Mr>& mr : mrs) RETURN_IF_ERROR(mr.status());
  for (absl::StatusOr<ibv::Mr>& mr : mrs) {
    state->region.keys.push_back((*mr)->rkey);
    state->mrs.push_back(std::move(*mr));
  }
  MutexLock lock(&core_.mu);
  Region& r = state->region;
  r.id = ++last_region_;
  r.addr = reinterpret_cast<uintptr_t>(addr);
  r.length = length;
  r.access = access;
  Region out = r;
  core_.regions.emplace(r.id, std::move(state));
  return out;
}

absl::Status VerbsTransport::UnregisterMemory(RegionId region) {
  MutexLock lock(&core_.mu);
  auto it = core_.regions.find(region);
  if (it == core_.regions.end())
    return absl::NotFoundError(absl::StrCat("unknown region ", region));
  if (it->second->local_uses != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "region ", region, " is used by ", it->second->local_uses, " outstanding request(s)"));
  }
  core_.regions.erase(it);  // deregisters
  return absl::OkStatus();
}

size_t VerbsTransport::PollCompletions(absl::Span<Completion> out) {
  // What the NICs have now, without waiting for the poller thread.
  for (size_t i = 0; i < core_.nics.size(); ++i) poller_.Drain(i);
  MutexLock lock(&core_.mu);
  return core_.cq.Pop(out, [this](RegionId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto region = core_.regions.find(id);
    if (region != core_.regions.end()) --region->second->local_uses;
  });
}

size_t VerbsTransport::WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) {
  if (size_t n = PollCompletions(out); n > 0 || timeout <= absl::ZeroDuration()) return n;
  // Poll the CQs from this thread for a moment (see busy_poll), then sleep.
  const absl::Time spin_until = FastNow() + std::min(timeout, core_.options.busy_poll);
  while (FastNow() < spin_until) {
    bool any = core_.interrupted.exchange(false);
    for (size_t i = 0; i < core_.nics.size(); ++i) any = poller_.Drain(i) || any;
    if (any) return PollCompletions(out);
  }
  // Going to sleep: ask for completion events, then look once more (a
  // completion that came before the request raises no event).
  ++core_.sleepers;
  for (Nic& nic : core_.nics) (void)ibv::ReqNotifyCq(nic.cq.get(), nic.port.device);
  bool any = false;
  for (size_t i = 0; i < core_.nics.size(); ++i) any = poller_.Drain(i) || any;
  if (!any) {
    MutexLock lock(&core_.mu);
    core_.cq_cv.AwaitWithDeadline(&core_.mu, FastNow() + timeout,
                                  [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                    return !core_.cq.empty() || core_.interrupted.load();
                                  });
  }
  core_.interrupted.store(false);
  --core_.sleepers;
  return PollCompletions(out);
}

void VerbsTransport::InterruptWait() {
  MutexLock lock(&core_.mu);  // a waiter checks the flag under it before sleeping
  core_.interrupted.store(true);
  core_.cq_cv.SignalAll();
}

}  // namespace verbs_internal

absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(VerbsTransportOptions options) {
  auto t = std::make_unique<verbs_internal::VerbsTransport>(std::move(options));
  RETURN_IF_ERROR(t->Open());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace transport
}  // namespace kvferry
