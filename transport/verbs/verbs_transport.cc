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

int MtuBytes(ibv_mtu mtu) {
  switch (mtu) {
    case IBV_MTU_256:
      return 256;
    case IBV_MTU_512:
      return 512;
    case IBV_MTU_1024:
      return 1024;
    case IBV_MTU_2048:
      return 2048;
    case IBV_MTU_4096:
      return 4096;
  }
  return 0;
}

std::string GidText(const ibv_gid& g) {
  std::string out;
  for (int i = 0; i < 16; i += 2) {
    absl::StrAppendFormat(&out, "%s%02x%02x", i ? ":" : "", g.raw[i], g.raw[i + 1]);
  }
  return out;
}

absl::StatusCode CodeOf(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS:
      return absl::StatusCode::kOk;
    case IBV_WC_REM_ACCESS_ERR:
      return absl::StatusCode::kPermissionDenied;
    case IBV_WC_WR_FLUSH_ERR:
      return absl::StatusCode::kAborted;
    default:
      return absl::StatusCode::kUnavailable;
  }
}

// As transport/link_params.h encodes them.
enum : uint8_t { kQpnField = 1, kPsnField = 2, kLidField = 3, kGidField = 4, kMtuField = 5 };

std::string EncodeParams(const Params& p) {
  return LinkParams(kind::kVerbs)
      .Put(kQpnField, p.qpn)
      .Put(kPsnField, p.psn)
      .Put(kLidField, p.lid)
      .PutBytes(kGidField, absl::string_view(reinterpret_cast<const char*>(p.gid), 16))
      .Put(kMtuField, p.mtu)
      .Encode();
}

absl::StatusOr<Params> DecodeParams(absl::string_view bytes) {
  ASSIGN_OR_RETURN(LinkParams in, LinkParams::Decode(bytes, kind::kVerbs));
  Params p;
  ASSIGN_OR_RETURN(uint64_t qpn, in.Get(kQpnField, "QP number"));
  ASSIGN_OR_RETURN(uint64_t psn, in.Get(kPsnField, "PSN"));
  ASSIGN_OR_RETURN(uint64_t lid, in.Get(kLidField, "LID"));
  ASSIGN_OR_RETURN(std::string gid, in.GetBytes(kGidField, 16, "GID"));
  ASSIGN_OR_RETURN(uint64_t mtu, in.Get(kMtuField, "MTU"));
  if (qpn == 0 || qpn > 0xffffff || psn > 0xffffff || lid > 0xffff || mtu < IBV_MTU_256 ||
      mtu > IBV_MTU_4096) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "link parameters out of range: QP %#x, PSN %#x, LID %u, MTU enum %u", qpn, psn, lid, mtu));
  }
  p.qpn = static_cast<uint32_t>(qpn);
  p.psn = static_cast<uint32_t>(psn);
  p.lid = static_cast<uint16_t>(lid);
  std::memcpy(p.gid, gid.data(), 16);
  p.mtu = static_cast<uint32_t>(mtu);
  return p;
}

absl::Status VerbsTransport::OpenNic(Nic& nic) {
  ASSIGN_OR_RETURN(nic.context, ibv::OpenDevice(nic.port.device));
  const std::string where = absl::StrCat(nic.port.device, ":", nic.port.port);
  ibv_context* c = nic.context.get();
  RETURN_IF_ERROR(ibv::QueryPort(c, nic.port.port, &nic.attr, where));
  if (nic.attr.state != IBV_PORT_ACTIVE) {
    return absl::UnavailableError(
        absl::StrCat(where, " is not ACTIVE (state ", ibv::PortStateStr(nic.attr.state), ")"));
  }
  RETURN_IF_ERROR(ibv::QueryGid(c, nic.port.port, nic.port.gid_index, &nic.gid, where));
  ibv_device_attr dev{};
  RETURN_IF_ERROR(ibv::QueryDevice(c, &dev, nic.port.device));
  nic.max_rd_atomic = std::max(1, std::min(16, dev.max_qp_rd_atom));
  nic.max_cqe = dev.max_cqe;
  nic.max_mr_size = dev.max_mr_size;
  if (dev.max_mr_size > 0)
    max_region_bytes_ = std::min<uint64_t>(max_region_bytes_, dev.max_mr_size);
  max_request_bytes_ = max_request_bytes_ == 0
                           ? std::min<uint64_t>(options_.max_request_bytes, nic.attr.max_msg_sz)
                           : std::min<uint64_t>(max_request_bytes_, nic.attr.max_msg_sz);
  ASSIGN_OR_RETURN(nic.pd, ibv::AllocPd(c, where));
  ASSIGN_OR_RETURN(nic.channel, ibv::CreateCompChannel(c, where));
  ASSIGN_OR_RETURN(
      nic.cq, ibv::CreateCq(c, std::min(8192, std::max(dev.max_cqe, 1)), nic.channel.get(), where));
  nic.cq_capacity = static_cast<uint32_t>(nic.cq->cqe);
  RETURN_IF_ERROR(ibv::ReqNotifyCq(nic.cq.get(), where));
  KVF_LOG(INFO) << "verbs: " << where << " GID " << nic.port.gid_index << " " << GidText(nic.gid)
                << ", active MTU " << MtuBytes(nic.attr.active_mtu) << " (" << nic.port.why << ")";
  return absl::OkStatus();
}

absl::Status VerbsTransport::Open() {
  if (options_.ports.empty()) return absl::InvalidArgumentError("no RDMA ports to use");
  nics_.resize(options_.ports.size());
  for (size_t i = 0; i < nics_.size(); ++i) {
    nics_[i].port = options_.ports[i];
    RETURN_IF_ERROR(OpenNic(nics_[i]));
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

absl::StatusOr<ibv::Mr> VerbsTransport::RegisterOn(size_t i, const Registration& r) const {
  const std::string& name = nics_[i].port.device;
  if (r.device < 0) return ibv::RegMr(nics_[i].pd.get(), r.addr, r.length, r.flags, name);
  absl::Status by_dmabuf = r.dmabuf->status();
  if (r.dmabuf->ok()) {
    absl::StatusOr<ibv::Mr> mr =
        ibv::RegDmaBufMr(nics_[i].pd.get(), (*r.dmabuf)->offset, r.length,
                         reinterpret_cast<uintptr_t>(r.addr), (*r.dmabuf)->fd, r.flags, name);
    if (mr.ok()) return mr;
    by_dmabuf = mr.status();
  }
  absl::StatusOr<ibv::Mr> mr = ibv::RegMr(nics_[i].pd.get(), r.addr, r.length, r.flags, name);
  if (mr.ok()) return mr;
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot register memory of CUDA device ", r.device, " on ", name,
      ": by dma-buf: ", by_dmabuf.message(), "; by ibv_reg_mr: ", mr.status().message(),
      ". Enable one: dma-buf (CUDA driver 11.7+, Linux 5.12+, rdma-core 34+, a GPU and NIC "
      "that support it) or the nvidia-peermem kernel module"));
}

std::vector<absl::StatusOr<ibv::Mr>> VerbsTransport::RegisterOnEveryNic(const Registration& r) {
  // One registration per NIC. Registering pins and maps every page once per
  // NIC, which for a large buffer takes long: with several NICs they
  // register in parallel, one thread each.
  std::vector<absl::StatusOr<ibv::Mr>> mrs;
  for (size_t i = 0; i < nics_.size(); ++i) mrs.emplace_back(absl::UnknownError("not registered"));
  if (nics_.size() > 1 && r.length >= options_.parallel_registration_bytes) {
    std::vector<std::thread> threads;
    for (size_t i = 1; i < nics_.size(); ++i) {
      absl::StatusOr<std::thread> t =
          StartThread("a registration", [this, &mrs, &r, i] { mrs[i] = RegisterOn(i, r); });
      if (t.ok()) {
        threads.push_back(std::move(*t));
      } else {
        mrs[i] = RegisterOn(i, r);  // no thread to spare: this one does it
      }
    }
    mrs[0] = RegisterOn(0, r);
    for (std::thread& t : threads) t.join();
  } else {
    for (size_t i = 0; i < nics_.size() && (i == 0 || mrs[i - 1].ok()); ++i) {
      mrs[i] = RegisterOn(i, r);
    }
  }
  return mrs;
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
  std::vector<absl::StatusOr<ibv::Mr>> mrs = RegisterOnEveryNic(what);
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
