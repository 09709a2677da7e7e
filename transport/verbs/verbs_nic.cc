// The verbs transport's NICs and queue pairs (verbs_nic.h).
#include "transport/verbs/verbs_nic.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "base/thread.h"
#include "transport/kinds.h"
#include "transport/link_params.h"

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

absl::Status OpenNic(Nic& nic) {
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

absl::Status ReserveCq(Nic& nic, uint32_t entries) {
  const uint64_t need = uint64_t{nic.cq_reserved} + entries;
  if (need > nic.cq_capacity) {
    const uint64_t want = std::min<uint64_t>(std::max<uint64_t>(need, 2 * nic.cq_capacity),
                                             static_cast<uint64_t>(std::max(nic.max_cqe, 0)));
    if (want < need) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s: a new link needs %u more completion queue entries; %u are in use and the device "
          "allows %d (fewer links, or a smaller max_outstanding_per_link)",
          nic.port.device, entries, nic.cq_reserved, nic.max_cqe));
    }
    // The caller excludes polling (the transport's lock, Drain's too).
    RETURN_IF_ERROR(ibv::ResizeCq(nic.cq.get(), static_cast<int>(want), nic.port.device));
    nic.cq_capacity = static_cast<uint32_t>(nic.cq->cqe);
  }
  nic.cq_reserved += entries;
  return absl::OkStatus();
}

absl::StatusOr<ibv::Mr> RegisterOn(const Nic& nic, const Registration& r) {
  const std::string& name = nic.port.device;
  if (r.device < 0) return ibv::RegMr(nic.pd.get(), r.addr, r.length, r.flags, name);
  absl::Status by_dmabuf = r.dmabuf->status();
  if (r.dmabuf->ok()) {
    absl::StatusOr<ibv::Mr> mr =
        ibv::RegDmaBufMr(nic.pd.get(), (*r.dmabuf)->offset, r.length,
                         reinterpret_cast<uintptr_t>(r.addr), (*r.dmabuf)->fd, r.flags, name);
    if (mr.ok()) return mr;
    by_dmabuf = mr.status();
  }
  absl::StatusOr<ibv::Mr> mr = ibv::RegMr(nic.pd.get(), r.addr, r.length, r.flags, name);
  if (mr.ok()) return mr;
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot register memory of CUDA device ", r.device, " on ", name,
      ": by dma-buf: ", by_dmabuf.message(), "; by ibv_reg_mr: ", mr.status().message(),
      ". Enable one: dma-buf (CUDA driver 11.7+, Linux 5.12+, rdma-core 34+, a GPU and NIC "
      "that support it) or the nvidia-peermem kernel module"));
}

std::vector<absl::StatusOr<ibv::Mr>> RegisterOnEveryNic(absl::Span<const Nic> nics,
                                                        const Registration& r,
                                                        uint64_t parallel_bytes) {
  // One registration per NIC. Registering pins and maps every page once per
  // NIC, which for a large buffer takes long: with several NICs they
  // register in parallel, one thread each.
  std::vector<absl::StatusOr<ibv::Mr>> mrs;
  for (size_t i = 0; i < nics.size(); ++i) mrs.emplace_back(absl::UnknownError("not registered"));
  if (nics.size() > 1 && r.length >= parallel_bytes) {
    std::vector<std::thread> threads;
    for (size_t i = 1; i < nics.size(); ++i) {
      absl::StatusOr<std::thread> t =
          StartThread("a registration", [&nics, &mrs, &r, i] { mrs[i] = RegisterOn(nics[i], r); });
      if (t.ok()) {
        threads.push_back(std::move(*t));
      } else {
        mrs[i] = RegisterOn(nics[i], r);  // no thread to spare: this one does it
      }
    }
    mrs[0] = RegisterOn(nics[0], r);
    for (std::thread& t : threads) t.join();
  } else {
    for (size_t i = 0; i < nics.size() && (i == 0 || mrs[i - 1].ok()); ++i) {
      mrs[i] = RegisterOn(nics[i], r);
    }
  }
  return mrs;
}

absl::StatusOr<ibv::Qp> NewQp(const Nic& nic, uint32_t max_wr, uint32_t max_inline,
                              uint32_t* inline_out) {
  ibv_qp_init_attr init{};
  init.send_cq = nic.cq.get();
  init.recv_cq = nic.cq.get();
  init.cap.max_send_wr = max_wr;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = max_inline;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signaling: the transport signals each chain's last
  ASSIGN_OR_RETURN(ibv::Qp qp, ibv::CreateQp(nic.pd.get(), &init, nic.port.device));
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = nic.port.port;
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  RETURN_IF_ERROR(ibv::ModifyQp(
      qp.get(), &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
      absl::StrFormat("modify QP %#x to INIT (port %u)", qp->qp_num, nic.port.port)));
  *inline_out = std::min(init.cap.max_inline_data, max_inline);
  return qp;
}

Params LocalParams(const Nic& nic, const ibv_qp& qp, uint32_t psn) {
  Params p;
  p.qpn = qp.qp_num;
  p.psn = psn;
  p.lid = nic.attr.lid;
  std::memcpy(p.gid, nic.gid.raw, 16);
  p.mtu = nic.attr.active_mtu;
  return p;
}

absl::Status ToRtr(const Nic& nic, ibv_qp* qp, const Params& peer) {
  ibv_gid dgid;
  std::memcpy(dgid.raw, peer.gid, 16);
  const ibv_mtu mtu = static_cast<ibv_mtu>(std::min<uint32_t>(peer.mtu, nic.attr.active_mtu));
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = mtu;
  attr.dest_qp_num = peer.qpn;
  attr.rq_psn = peer.psn;
  attr.max_dest_rd_atomic = nic.max_rd_atomic;
  attr.min_rnr_timer = 12;
  attr.ah_attr.is_global = 1;
  attr.ah_attr.grh.dgid = dgid;
  attr.ah_attr.grh.sgid_index = nic.port.gid_index;
  attr.ah_attr.grh.hop_limit = 64;
  attr.ah_attr.dlid = peer.lid;
  attr.ah_attr.port_num = nic.port.port;
  return ibv::ModifyQp(qp, &attr,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                       absl::StrFormat("modify QP %#x to RTR (peer QP %#x, gid %s, mtu %d)",
                                       qp->qp_num, peer.qpn, GidText(dgid), MtuBytes(mtu)));
}

absl::Status ToRts(const Nic& nic, ibv_qp* qp, uint32_t psn, uint8_t timeout, uint8_t retry_count) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = timeout;
  attr.retry_cnt = retry_count;
  attr.rnr_retry = 7;
  attr.sq_psn = psn;
  attr.max_rd_atomic = nic.max_rd_atomic;
  return ibv::ModifyQp(qp, &attr,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
                       absl::StrFormat("modify QP %#x to RTS", qp->qp_num));
}

}  // namespace verbs_internal
}  // namespace transport
}  // namespace kvferry
