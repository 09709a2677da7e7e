#include "transport/verbs/ibv.h"

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errno_status.h"

namespace kvferry {
namespace transport {
namespace ibv {

absl::Status Error(int rc, absl::string_view what) {
  const int code = rc > 0 ? rc : (errno != 0 ? errno : EIO);
  return ErrnoError(code, what);
}

absl::StatusOr<Context> OpenDevice(const std::string& name) {
  int count = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (list == nullptr) {
    // ENOSYS: the kernel has no RDMA at all.
    return Error(0, "ibv_get_device_list");
  }
  ibv_device* found = nullptr;
  for (int i = 0; i < count; ++i) {
    if (name == ibv_get_device_name(list[i])) found = list[i];
  }
  errno = 0;
  Context context(found != nullptr ? ibv_open_device(found) : nullptr);
  const int err = errno;
  ibv_free_device_list(list);
  if (found == nullptr) return absl::NotFoundError(absl::StrCat("no RDMA device ", name));
  if (context == nullptr) return Error(err, absl::StrCat("ibv_open_device ", name));
  return context;
}

absl::Status QueryPort(ibv_context* c, uint8_t port, ibv_port_attr* out, absl::string_view where) {
  if (int rc = ibv_query_port(c, port, out); rc != 0) {
    return Error(rc, absl::StrCat("ibv_query_port ", where));
  }
  return absl::OkStatus();
}

absl::Status QueryGid(ibv_context* c, uint8_t port, int index, ibv_gid* out,
                      absl::string_view where) {
  if (int rc = ibv_query_gid(c, port, index, out); rc != 0) {
    return Error(rc, absl::StrCat("ibv_query_gid ", where, " index ", index));
  }
  return absl::OkStatus();
}

absl::Status QueryDevice(ibv_context* c, ibv_device_attr* out, absl::string_view where) {
  if (int rc = ibv_query_device(c, out); rc != 0) {
    return Error(rc, absl::StrCat("ibv_query_device ", where));
  }
  return absl::OkStatus();
}

absl::StatusOr<Pd> AllocPd(ibv_context* c, absl::string_view where) {
  errno = 0;
  Pd pd(ibv_alloc_pd(c));
  if (pd == nullptr) return Error(0, absl::StrCat("ibv_alloc_pd ", where));
  return pd;
}

absl::StatusOr<CompChannel> CreateCompChannel(ibv_context* c, absl::string_view where) {
  errno = 0;
  CompChannel ch(ibv_create_comp_channel(c));
  if (ch == nullptr) return Error(0, absl::StrCat("ibv_create_comp_channel ", where));
  return ch;
}

absl::StatusOr<Cq> CreateCq(ibv_context* c, int entries, ibv_comp_channel* channel,
                            absl::string_view where) {
  errno = 0;
  Cq cq(ibv_create_cq(c, entries, nullptr, channel, 0));
  if (cq == nullptr) return Error(0, absl::StrCat("ibv_create_cq ", where, " (", entries, ")"));
  return cq;
}

absl::Status ResizeCq(ibv_cq* cq, int entries, absl::string_view where) {
  if (int rc = ibv_resize_cq(cq, entries); rc != 0) {
    return Error(rc, absl::StrCat("ibv_resize_cq ", where, " to ", entries));
  }
  return absl::OkStatus();
}

absl::Status ReqNotifyCq(ibv_cq* cq, absl::string_view where) {
  if (int rc = ibv_req_notify_cq(cq, 0); rc != 0) {
    return Error(rc, absl::StrCat("ibv_req_notify_cq ", where));
  }
  return absl::OkStatus();
}

absl::StatusOr<Qp> CreateQp(ibv_pd* pd, ibv_qp_init_attr* init, absl::string_view where) {
  errno = 0;
  Qp qp(ibv_create_qp(pd, init));
  if (qp == nullptr && init->cap.max_inline_data > 0) {
    // A device that takes less inline data (or none): without it.
    init->cap.max_inline_data = 0;
    errno = 0;
    qp.reset(ibv_create_qp(pd, init));
  }
  if (qp == nullptr) return Error(0, absl::StrCat("ibv_create_qp on ", where));
  return qp;
}

absl::Status ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask, absl::string_view what) {
  if (int rc = ibv_modify_qp(qp, attr, mask); rc != 0) return Error(rc, what);
  return absl::OkStatus();
}

absl::Status ResetToError(ibv_qp* qp) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  return ModifyQp(qp, &attr, IBV_QP_STATE, absl::StrFormat("modify QP %#x to ERR", qp->qp_num));
}

absl::StatusOr<Mr> RegMr(ibv_pd* pd, void* addr, uint64_t length, int access,
                         absl::string_view where) {
  errno = 0;
  Mr mr(ibv_reg_mr(pd, addr, length, access));
  if (mr == nullptr) {
    return Error(0, absl::StrFormat("ibv_reg_mr %s [%p, +%u)", where, addr, length));
  }
  return mr;
}

absl::StatusOr<Mr> RegDmaBufMr(ibv_pd* pd, uint64_t offset, uint64_t length, uint64_t iova,
                               int fd, int access, absl::string_view where) {
  errno = 0;
  Mr mr(ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access));
  if (mr == nullptr) {
    return Error(0, absl::StrFormat("ibv_reg_dmabuf_mr %s [%#x, +%u)", where, iova, length));
  }
  return mr;
}

absl::Status PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  if (int rc = ibv_post_send(qp, wr, bad); rc != 0) {
    return Error(rc, absl::StrFormat("ibv_post_send on QP %#x", qp->qp_num));
  }
  return absl::OkStatus();
}

absl::StatusOr<ibv_cq*> GetCqEvent(ibv_comp_channel* channel) {
  ibv_cq* cq = nullptr;
  void* context = nullptr;
  errno = 0;
  if (ibv_get_cq_event(channel, &cq, &context) != 0) return Error(0, "ibv_get_cq_event");
  ibv_ack_cq_events(cq, 1);
  return cq;
}

}  // namespace ibv
}  // namespace transport
}  // namespace kvferry
