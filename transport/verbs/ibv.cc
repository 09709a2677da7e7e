#include "transport/verbs/ibv.h"

#include <dlfcn.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/status_macros.h"

namespace kvferry {
namespace transport {
namespace ibv {
namespace {

// libibverbs' entry points, each at the symbol version verbs.h declares.
struct Verbs {
  ibv_device** (*get_device_list)(int*);
  void (*free_device_list)(ibv_device**);
  const char* (*get_device_name)(ibv_device*);
  ibv_context* (*open_device)(ibv_device*);
  int (*close_device)(ibv_context*);
  int (*query_port)(ibv_context*, uint8_t, ibv_port_attr*);  // the compat layout
  int (*query_gid)(ibv_context*, uint8_t, int, ibv_gid*);
  int (*query_device)(ibv_context*, ibv_device_attr*);
  ibv_pd* (*alloc_pd)(ibv_context*);
  int (*dealloc_pd)(ibv_pd*);
  ibv_comp_channel* (*create_comp_channel)(ibv_context*);
  int (*destroy_comp_channel)(ibv_comp_channel*);
  ibv_cq* (*create_cq)(ibv_context*, int, void*, ibv_comp_channel*, int);
  int (*resize_cq)(ibv_cq*, int);
  int (*destroy_cq)(ibv_cq*);
  int (*get_cq_event)(ibv_comp_channel*, ibv_cq**, void**);
  void (*ack_cq_events)(ibv_cq*, unsigned int);
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*);
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int);
  int (*destroy_qp)(ibv_qp*);
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int);
  ibv_mr* (*reg_mr_iova2)(ibv_pd*, void*, size_t, uint64_t, unsigned int);  // may be null
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd*, uint64_t, size_t, uint64_t, int, int);  // may be null
  int (*dereg_mr)(ibv_mr*);
  const char* (*wc_status_str)(ibv_wc_status);
  const char* (*port_state_str)(ibv_port_state);
};

std::string Named(const char* variable, const char* fallback) {
  const char* named = std::getenv(variable);
  return named != nullptr && *named != '\0' ? named : fallback;
}

// Binds `slot` to `name`@`version` in `handle`; appends the name to
// `missing` when it is absent and `required`.
template <typename Slot>
void Bind(void* handle, Slot& slot, const char* name, const char* version, bool required,
          std::string* missing) {
  void* sym = ::dlvsym(handle, name, version);
  slot = reinterpret_cast<Slot>(sym);
  if (sym == nullptr && required) absl::StrAppend(missing, missing->empty() ? "" : ", ", name);
}

absl::Status Open(const std::string& library, void** handle) {
  *handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (*handle != nullptr) return absl::OkStatus();
  const char* why = ::dlerror();
  return absl::UnavailableError(absl::StrCat(library, " not found: RDMA unavailable (",
                                             why != nullptr ? why : "dlopen failed", ")"));
}

Verbs verbs;
Rdmacm rdmacm;

absl::Status LoadVerbs() {
  const std::string library = LibraryName();
  void* h = nullptr;
  if (absl::Status s = Open(library, &h); !s.ok()) return s;
  std::string missing;
  constexpr const char* k10 = "IBVERBS_1.0";
  constexpr const char* k11 = "IBVERBS_1.1";
  Verbs& v = verbs;
  Bind(h, v.get_device_list, "ibv_get_device_list", k11, true, &missing);
  Bind(h, v.free_device_list, "ibv_free_device_list", k11, true, &missing);
  Bind(h, v.get_device_name, "ibv_get_device_name", k11, true, &missing);
  Bind(h, v.open_device, "ibv_open_device", k11, true, &missing);
  Bind(h, v.close_device, "ibv_close_device", k11, true, &missing);
  Bind(h, v.query_port, "ibv_query_port", k11, true, &missing);
  Bind(h, v.query_gid, "ibv_query_gid", k11, true, &missing);
  Bind(h, v.query_device, "ibv_query_device", k11, true, &missing);
  Bind(h, v.alloc_pd, "ibv_alloc_pd", k11, true, &missing);
  Bind(h, v.dealloc_pd, "ibv_dealloc_pd", k11, true, &missing);
  Bind(h, v.create_comp_channel, "ibv_create_comp_channel", k10, true, &missing);
  Bind(h, v.destroy_comp_channel, "ibv_destroy_comp_channel", k10, true, &missing);
  Bind(h, v.create_cq, "ibv_create_cq", k11, true, &missing);
  Bind(h, v.resize_cq, "ibv_resize_cq", k11, true, &missing);
  Bind(h, v.destroy_cq, "ibv_destroy_cq", k11, true, &missing);
  Bind(h, v.get_cq_event, "ibv_get_cq_event", k11, true, &missing);
  Bind(h, v.ack_cq_events, "ibv_ack_cq_events", k11, true, &missing);
  Bind(h, v.create_qp, "ibv_create_qp", k11, true, &missing);
  Bind(h, v.modify_qp, "ibv_modify_qp", k11, true, &missing);
  Bind(h, v.destroy_qp, "ibv_destroy_qp", k11, true, &missing);
  Bind(h, v.reg_mr, "ibv_reg_mr", k11, true, &missing);
  Bind(h, v.reg_mr_iova2, "ibv_reg_mr_iova2", "IBVERBS_1.8", false, &missing);
  Bind(h, v.reg_dmabuf_mr, "ibv_reg_dmabuf_mr", "IBVERBS_1.12", false, &missing);
  Bind(h, v.dereg_mr, "ibv_dereg_mr", k11, true, &missing);
  Bind(h, v.wc_status_str, "ibv_wc_status_str", k11, true, &missing);
  Bind(h, v.port_state_str, "ibv_port_state_str", k11, true, &missing);
  if (!missing.empty()) {
    return absl::UnavailableError(
        absl::StrCat(library, " lacks ", missing, ": RDMA unavailable (rdma-core too old?)"));
  }
  return absl::OkStatus();
}

absl::Status LoadCm() {
  const std::string library = RdmacmLibraryName();
  void* h = nullptr;
  if (absl::Status s = Open(library, &h); !s.ok()) return s;
  std::string missing;
  constexpr const char* k = "RDMACM_1.0";
  Rdmacm& c = rdmacm;
  Bind(h, c.create_event_channel, "rdma_create_event_channel", k, true, &missing);
  Bind(h, c.destroy_event_channel, "rdma_destroy_event_channel", k, true, &missing);
  Bind(h, c.create_id, "rdma_create_id", k, true, &missing);
  Bind(h, c.destroy_id, "rdma_destroy_id", k, true, &missing);
  Bind(h, c.resolve_addr, "rdma_resolve_addr", k, true, &missing);
  Bind(h, c.resolve_route, "rdma_resolve_route", k, true, &missing);
  Bind(h, c.get_cm_event, "rdma_get_cm_event", k, true, &missing);
  Bind(h, c.ack_cm_event, "rdma_ack_cm_event", k, true, &missing);
  Bind(h, c.event_str, "rdma_event_str", k, true, &missing);
  if (!missing.empty()) return absl::UnavailableError(absl::StrCat(library, " lacks ", missing));
  return absl::OkStatus();
}

}  // namespace

std::string LibraryName() { return Named("KVFERRY_IBVERBS_LIBRARY", "libibverbs.so.1"); }
std::string RdmacmLibraryName() { return Named("KVFERRY_RDMACM_LIBRARY", "librdmacm.so.1"); }

absl::Status Load() {
  static const absl::Status* loaded = new absl::Status(LoadVerbs());
  return *loaded;
}

absl::Status LoadRdmacm() {
  static const absl::Status* loaded = new absl::Status([] {
    absl::Status s = Load();
    return s.ok() ? LoadCm() : s;
  }());
  return *loaded;
}

const Rdmacm& Cm() { return rdmacm; }

void Deleter::operator()(ibv_context* c) const { verbs.close_device(c); }
void Deleter::operator()(ibv_pd* p) const { verbs.dealloc_pd(p); }
void Deleter::operator()(ibv_comp_channel* c) const { verbs.destroy_comp_channel(c); }
void Deleter::operator()(ibv_cq* c) const { verbs.destroy_cq(c); }
void Deleter::operator()(ibv_qp* q) const { verbs.destroy_qp(q); }
void Deleter::operator()(ibv_mr* m) const { verbs.dereg_mr(m); }

const char* WcStatusStr(ibv_wc_status status) { return verbs.wc_status_str(status); }
const char* PortStateStr(ibv_port_state state) { return verbs.port_state_str(state); }
const char* DeviceName(ibv_device* device) { return verbs.get_device_name(device); }

absl::Status Error(int rc, absl::string_view what) {
  const int code = rc > 0 ? rc : (errno != 0 ? errno : EIO);
  return ErrnoError(code, what);
}

absl::StatusOr<Context> OpenDevice(const std::string& name) {
  RETURN_IF_ERROR(Load());
  int count = 0;
  errno = 0;
  ibv_device** list = verbs.get_device_list(&count);
  if (list == nullptr) {
    // ENOSYS: the kernel has no RDMA at all.
    return Error(0, "ibv_get_device_list");
  }
  ibv_device* found = nullptr;
  for (int i = 0; i < count; ++i) {
    if (name == verbs.get_device_name(list[i])) found = list[i];
  }
  errno = 0;
  Context context(found != nullptr ? verbs.open_device(found) : nullptr);
  const int err = errno;
  verbs.free_device_list(list);
  if (found == nullptr) return absl::NotFoundError(absl::StrCat("no RDMA device ", name));
  if (context == nullptr) return Error(err, absl::StrCat("ibv_open_device ", name));
  return context;
}

absl::Status QueryPort(ibv_context* c, uint8_t port, ibv_port_attr* out, absl::string_view where) {
  // As verbs.h's inline ibv_query_port: the context's own operation when it
  // has one, else the compat entry point into a zeroed struct.
  verbs_context* vctx = verbs_get_ctx_op(c, query_port);
  const int rc = vctx != nullptr
                     ? vctx->query_port(c, port, out, sizeof(*out))
                     : (std::memset(out, 0, sizeof(*out)), verbs.query_port(c, port, out));
  if (rc != 0) {
    return Error(rc, absl::StrCat("ibv_query_port ", where));
  }
  return absl::OkStatus();
}

absl::Status QueryGid(ibv_context* c, uint8_t port, int index, ibv_gid* out,
                      absl::string_view where) {
  if (int rc = verbs.query_gid(c, port, index, out); rc != 0) {
    return Error(rc, absl::StrCat("ibv_query_gid ", where, " index ", index));
  }
  return absl::OkStatus();
}

absl::Status QueryDevice(ibv_context* c, ibv_device_attr* out, absl::string_view where) {
  if (int rc = verbs.query_device(c, out); rc != 0) {
    return Error(rc, absl::StrCat("ibv_query_device ", where));
  }
  return absl::OkStatus();
}

absl::StatusOr<Pd> AllocPd(ibv_context* c, absl::string_view where) {
  errno = 0;
  Pd pd(verbs.alloc_pd(c));
  if (pd == nullptr) return Error(0, absl::StrCat("ibv_alloc_pd ", where));
  return pd;
}

absl::StatusOr<CompChannel> CreateCompChannel(ibv_context* c, absl::string_view where) {
  errno = 0;
  CompChannel ch(verbs.create_comp_channel(c));
  if (ch == nullptr) return Error(0, absl::StrCat("ibv_create_comp_channel ", where));
  return ch;
}

absl::StatusOr<Cq> CreateCq(ibv_context* c, int entries, ibv_comp_channel* channel,
                            absl::string_view where) {
  errno = 0;
  Cq cq(verbs.create_cq(c, entries, nullptr, channel, 0));
  if (cq == nullptr) return Error(0, absl::StrCat("ibv_create_cq ", where, " (", entries, ")"));
  return cq;
}

absl::Status ResizeCq(ibv_cq* cq, int entries, absl::string_view where) {
  if (int rc = verbs.resize_cq(cq, entries); rc != 0) {
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
  Qp qp(verbs.create_qp(pd, init));
  if (qp == nullptr && init->cap.max_inline_data > 0) {
    // A device that takes less inline data (or none): without it.
    init->cap.max_inline_data = 0;
    errno = 0;
    qp.reset(verbs.create_qp(pd, init));
  }
  if (qp == nullptr) return Error(0, absl::StrCat("ibv_create_qp on ", where));
  return qp;
}

absl::Status ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask, absl::string_view what) {
  if (int rc = verbs.modify_qp(qp, attr, mask); rc != 0) return Error(rc, what);
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
  // ibv_reg_mr_iova2 takes the optional access flags (relaxed ordering);
  // the old entry point would refuse them.
  Mr mr(verbs.reg_mr_iova2 != nullptr
            ? verbs.reg_mr_iova2(pd, addr, length, reinterpret_cast<uintptr_t>(addr),
                                 static_cast<unsigned int>(access))
            : verbs.reg_mr(pd, addr, length, access & ~IBV_ACCESS_OPTIONAL_RANGE));
  if (mr == nullptr) {
    return Error(0, absl::StrFormat("ibv_reg_mr %s [%p, +%u)", where, addr, length));
  }
  return mr;
}

absl::StatusOr<Mr> RegDmaBufMr(ibv_pd* pd, uint64_t offset, uint64_t length, uint64_t iova, int fd,
                               int access, absl::string_view where) {
  if (verbs.reg_dmabuf_mr == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat(LibraryName(), " has no ibv_reg_dmabuf_mr (rdma-core before v34)"));
  }
  errno = 0;
  Mr mr(verbs.reg_dmabuf_mr(pd, offset, length, iova, fd, access));
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
  if (verbs.get_cq_event(channel, &cq, &context) != 0) return Error(0, "ibv_get_cq_event");
  verbs.ack_cq_events(cq, 1);
  return cq;
}

}  // namespace ibv
}  // namespace transport
}  // namespace kvferry
