// The verbs transport's NICs and queue pairs, as functions of one NIC: opening
// it (device, port, PD, completion channel and CQ), accounting its CQ's
// entries, registering memory on it (device memory by dma-buf first, then
// plain), and each QP state transition (INIT, RTR, RTS) with the link
// parameters that carry a QP to its peer. No transport state: the transport
// (verbs_transport_internal.h) holds the NICs and its links, and calls
// these under its lock where they touch what it shares (ReserveCq).
// Internal to //transport/verbs:verbs_transport.
#ifndef KVFERRY_TRANSPORT_VERBS_VERBS_NIC_H_
#define KVFERRY_TRANSPORT_VERBS_VERBS_NIC_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "cuda/driver.h"
#include "transport/verbs/discovery.h"
#include "transport/verbs/ibv.h"

namespace kvferry {
namespace transport {
namespace verbs_internal {

int MtuBytes(ibv_mtu mtu);
std::string GidText(const ibv_gid& g);
// A work completion's status as a Status code.
absl::StatusCode CodeOf(ibv_wc_status s);

// Link parameters exchanged through the handshake (little-endian hosts).
struct Params {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  uint8_t gid[16] = {};
  uint32_t mtu = 0;  // enum ibv_mtu
};
// As transport/link_params.h encodes them.
std::string EncodeParams(const Params& p);
absl::StatusOr<Params> DecodeParams(absl::string_view bytes);

struct Nic {
  verbs::SelectedPort port;
  // Owners, released in reverse: the CQ, the channel, the PD, the device.
  ibv::Context context;
  ibv::Pd pd;
  ibv::CompChannel channel;
  ibv::Cq cq;
  // CQ depth accounting: every work request outstanding on the NIC's QPs
  // may come back as a completion (an error flushes even unsignaled
  // ones), so the CQ holds at least the sum of its QPs' send queues.
  uint32_t cq_capacity = 0;
  uint32_t cq_reserved = 0;
  int max_cqe = 0;
  uint64_t max_mr_size = 0;  // the device's largest registration
  ibv_port_attr attr{};
  ibv_gid gid{};
  int max_rd_atomic = 1;
};

// Opens `nic.port`: the device, its port (which must be ACTIVE), its GID,
// a PD, a completion channel and a CQ that requests events.
absl::Status OpenNic(Nic& nic);
// Makes room in the NIC's CQ for `entries` more completions (resizing it
// up to the device's limit), or kResourceExhausted. The caller excludes
// polling of the CQ meanwhile.
absl::Status ReserveCq(Nic& nic, uint32_t entries);

// One registration of [addr, +length) with `flags`.
struct Registration {
  void* addr = nullptr;
  uint64_t length = 0;
  int flags = 0;
  int device = -1;  // CUDA device ordinal; -1: host memory
  const absl::StatusOr<cuda::Driver::DmaBuf>* dmabuf = nullptr;  // device memory only
};
// On one NIC: device memory by dma-buf first, then plain ibv_reg_mr
// (nvidia-peermem); kFailedPrecondition naming both reasons.
absl::StatusOr<ibv::Mr> RegisterOn(const Nic& nic, const Registration& r);
// On every NIC, in parallel (a thread each) from `parallel_bytes` on; else
// in order, stopping at the first failure (the rest say "not registered").
std::vector<absl::StatusOr<ibv::Mr>> RegisterOnEveryNic(absl::Span<const Nic> nics,
                                                        const Registration& r,
                                                        uint64_t parallel_bytes);

// A new RC QP on the NIC, moved to INIT: `max_wr` work requests, inline
// up to `max_inline` (*inline_out: what the QP accepts).
absl::StatusOr<ibv::Qp> NewQp(const Nic& nic, uint32_t max_wr, uint32_t max_inline,
                              uint32_t* inline_out);
// What the peer needs of this QP.
Params LocalParams(const Nic& nic, const ibv_qp& qp, uint32_t psn);
// INIT -> RTR, toward the peer's QP.
absl::Status ToRtr(const Nic& nic, ibv_qp* qp, const Params& peer);
// RTR -> RTS, with the RC `timeout` exponent and `retry_count`.
absl::Status ToRts(const Nic& nic, ibv_qp* qp, uint32_t psn, uint8_t timeout, uint8_t retry_count);

}  // namespace verbs_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_VERBS_VERBS_NIC_H_
