// The seam over libibverbs and librdmacm: every ibv_* and rdma_* call the
// verbs transport makes goes through here. Neither library is linked: both
// are loaded at run time, on first use, with dlopen ("libibverbs.so.1" and
// "librdmacm.so.1", or the files KVFERRY_IBVERBS_LIBRARY and
// KVFERRY_RDMACM_LIBRARY name), so a host without rdma-core runs the engine
// over TCP. Each entry point is bound to the symbol version its header
// declares (dlvsym), never to libibverbs' IBVERBS_1.0 compatibility entry
// points, whose contexts have no operations. Calls return Status with the call and its context in
// the message and the errno mapped to the matching code (ENOMEM -> kResourceExhausted, EINVAL ->
// kInvalidArgument, EPERM/EACCES -> kPermissionDenied, ENODEV -> kNotFound, ETIMEDOUT ->
// kDeadlineExceeded,
// ...; base/errno_status.h). Objects are held by RAII owners whose
// destruction releases them; declare owners so that QPs and MRs go before
// their CQ, PD and device context.
#ifndef KVFERRY_TRANSPORT_VERBS_IBV_H_
#define KVFERRY_TRANSPORT_VERBS_IBV_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvferry {
namespace transport {
namespace ibv {

// Loads libibverbs (once; later calls return the first answer). OK when
// every entry point the transport uses was found; otherwise kUnavailable:
// "libibverbs.so.1 not found: RDMA unavailable (<dlerror>)". The other
// functions below may be called only after Load() returned OK.
absl::Status Load();
// The same for librdmacm (route-aware pairing); it needs Load() first.
absl::Status LoadRdmacm();
// The library names Load() and LoadRdmacm() open.
std::string LibraryName();
std::string RdmacmLibraryName();

// libibverbs reports failure as an errno value, or -1 (or null) with errno
// set: `rc` is what the call returned (0 or -1 means "read errno").
absl::Status Error(int rc, absl::string_view what);

struct Deleter {
  void operator()(ibv_context* c) const;
  void operator()(ibv_pd* p) const;
  void operator()(ibv_comp_channel* c) const;
  void operator()(ibv_cq* c) const;
  void operator()(ibv_qp* q) const;
  void operator()(ibv_mr* m) const;
};
using Context = std::unique_ptr<ibv_context, Deleter>;
using Pd = std::unique_ptr<ibv_pd, Deleter>;
using CompChannel = std::unique_ptr<ibv_comp_channel, Deleter>;
using Cq = std::unique_ptr<ibv_cq, Deleter>;
using Qp = std::unique_ptr<ibv_qp, Deleter>;
using Mr = std::unique_ptr<ibv_mr, Deleter>;

// Opens the device named `name` (kNotFound when there is none).
absl::StatusOr<Context> OpenDevice(const std::string& name);
absl::Status QueryPort(ibv_context* c, uint8_t port, ibv_port_attr* out, absl::string_view where);
absl::Status QueryGid(ibv_context* c, uint8_t port, int index, ibv_gid* out,
                      absl::string_view where);
absl::Status QueryDevice(ibv_context* c, ibv_device_attr* out, absl::string_view where);
absl::StatusOr<Pd> AllocPd(ibv_context* c, absl::string_view where);
absl::StatusOr<CompChannel> CreateCompChannel(ibv_context* c, absl::string_view where);
absl::StatusOr<Cq> CreateCq(ibv_context* c, int entries, ibv_comp_channel* channel,
                            absl::string_view where);
absl::Status ResizeCq(ibv_cq* cq, int entries, absl::string_view where);
// Requests an event for the next completion on `cq`.
absl::Status ReqNotifyCq(ibv_cq* cq, absl::string_view where);
// Creates a QP; when the device refuses the inline size asked for, again
// without inline data (init->cap.max_inline_data says what it got).
absl::StatusOr<Qp> CreateQp(ibv_pd* pd, ibv_qp_init_attr* init, absl::string_view where);
absl::Status ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask, absl::string_view what);
// Moves the QP to the error state: the NIC touches none of its buffers
// any more and its outstanding work requests flush.
absl::Status ResetToError(ibv_qp* qp);
absl::StatusOr<Mr> RegMr(ibv_pd* pd, void* addr, uint64_t length, int access,
                         absl::string_view where);
// Registers `length` bytes at `offset` of a dma-buf, addressed by peers from
// `iova` on (device memory without nvidia-peermem).
absl::StatusOr<Mr> RegDmaBufMr(ibv_pd* pd, uint64_t offset, uint64_t length, uint64_t iova, int fd,
                               int access, absl::string_view where);
// Posts the chain; `*bad` is the first work request not posted.
absl::Status PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad);
// Up to `max` completions into `wc`; how many, or the CQ's error.
inline absl::StatusOr<int> PollCq(ibv_cq* cq, int max, ibv_wc* wc) {
  const int n = ibv_poll_cq(cq, max, wc);
  if (n < 0) return Error(-n, "ibv_poll_cq");
  return n;
}
const char* WcStatusStr(ibv_wc_status status);
const char* PortStateStr(ibv_port_state state);
const char* DeviceName(ibv_device* device);

// librdmacm's entry points (after LoadRdmacm() returned OK).
struct Rdmacm {
  rdma_event_channel* (*create_event_channel)();
  void (*destroy_event_channel)(rdma_event_channel*);
  int (*create_id)(rdma_event_channel*, rdma_cm_id**, void*, rdma_port_space);
  int (*destroy_id)(rdma_cm_id*);
  int (*resolve_addr)(rdma_cm_id*, sockaddr*, sockaddr*, int);
  int (*resolve_route)(rdma_cm_id*, int);
  int (*get_cm_event)(rdma_event_channel*, rdma_cm_event**);
  int (*ack_cm_event)(rdma_cm_event*);
  const char* (*event_str)(rdma_cm_event_type);
  // rdma_get_local_addr is inline in rdma_cma.h: no entry point.
};
const Rdmacm& Cm();

// The CQ whose completion event is waiting on `channel` (its event is
// acknowledged at once).
absl::StatusOr<ibv_cq*> GetCqEvent(ibv_comp_channel* channel);

}  // namespace ibv
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_VERBS_IBV_H_
