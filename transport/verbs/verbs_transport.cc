#include "transport/verbs/verbs_transport.h"

#include <infiniband/verbs.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/clock.h"
#include "base/thread.h"
#include "base/errno_status.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/scratch.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "net/socket.h"
#include "transport/checks.h"
#include "transport/completion_queue.h"
#include "transport/link_params.h"
#include "transport/verbs/ibv.h"
#include "transport/verbs/route.h"

namespace kvferry {
namespace transport {
namespace {

int MtuBytes(ibv_mtu mtu) {
  switch (mtu) {
    case IBV_MTU_256: return 256;
    case IBV_MTU_512: return 512;
    case IBV_MTU_1024: return 1024;
    case IBV_MTU_2048: return 2048;
    case IBV_MTU_4096: return 4096;
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
    case IBV_WC_SUCCESS: return absl::StatusCode::kOk;
    case IBV_WC_REM_ACCESS_ERR: return absl::StatusCode::kPermissionDenied;
    case IBV_WC_WR_FLUSH_ERR: return absl::StatusCode::kAborted;
    default: return absl::StatusCode::kUnavailable;
  }
}

// Link parameters exchanged through the handshake (little-endian hosts).
struct Params {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  uint8_t gid[16] = {};
  uint32_t mtu = 0;  // enum ibv_mtu
};

// As transport/link_params.h encodes them.
enum : uint8_t { kQpnField = 1, kPsnField = 2, kLidField = 3, kGidField = 4, kMtuField = 5 };

std::string EncodeParams(const Params& p) {
  return LinkParams("verbs")
      .Put(kQpnField, p.qpn)
      .Put(kPsnField, p.psn)
      .Put(kLidField, p.lid)
      .PutBytes(kGidField, absl::string_view(reinterpret_cast<const char*>(p.gid), 16))
      .Put(kMtuField, p.mtu)
      .Encode();
}

absl::StatusOr<Params> DecodeParams(absl::string_view bytes) {
  ASSIGN_OR_RETURN(LinkParams in, LinkParams::Decode(bytes, "verbs"));
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

class VerbsTransport final : public Transport {
 public:
  explicit VerbsTransport(VerbsTransportOptions options) : options_(std::move(options)) {}
  ~VerbsTransport() override;
  absl::Status Open();

  EndpointDescription LocalEndpoint() const override;
  Limits GetLimits() const override {
    return Limits{options_.max_outstanding_per_link, max_request_bytes_, max_region_bytes_};
  }
  absl::StatusOr<Region> RegisterMemory(void* addr, uint64_t length, Access access) override;
  absl::Status UnregisterMemory(RegionId region) override;
  absl::StatusOr<LinkOffer> CreateLink(NicIndex local_nic, const NicInfo& peer_nic) override;
  absl::StatusOr<LinkOffer> AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                       absl::string_view peer_params) override;
  absl::Status CompleteLink(LinkId link, absl::string_view peer_params) override;
  absl::StatusOr<NicIndex> RouteTo(const NicInfo& peer_nic) override;
  absl::Status CloseLink(LinkId link) override;
  bool HasLink(LinkId link) override {
    MutexLock lock(&mu_);
    return links_.count(link) != 0;
  }
  absl::Status Post(absl::Span<const WorkRequest> batch) override;
  size_t PollCompletions(absl::Span<Completion> out) override;
  size_t WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) override;
  void InterruptWait() override;
  bool SetCompletionNotifier(std::function<void()> notify) override {
    MutexLock lock(&mu_);
    const bool had = static_cast<bool>(notify_);
    notify_ = std::move(notify);
    // A caller that waits on its own event needs the poller to drain the
    // CQs: completion events stay requested for good (see sleepers_).
    if (!had && notify_) {
      ++sleepers_;
      for (Nic& nic : nics_) (void)ibv::ReqNotifyCq(nic.cq.get(), nic.port.device);
    } else if (had && !notify_) {
      --sleepers_;
    }
    return true;
  }

 private:
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
  struct RegionState {
    Region region;
    std::vector<ibv::Mr> mrs;  // per NIC
    uint64_t local_uses = 0;
  };
  struct Link {
    using State = LinkState;  // transport/checks.h
    LinkId id = 0;
    NicIndex nic = 0;
    ibv::Qp qp;
    uint32_t psn = 0;
    State state = State::kPending;
    size_t outstanding = 0;
    uint32_t max_inline = 0;  // what the QP accepts inline
    // Selective signaling: only the last work request of each chain is
    // signaled. Its completion means every earlier one on the QP completed
    // (RC completes in order), so the QP's work requests are kept in post
    // order: `posted` is a ring of their ids, oldest at `head`.
    std::vector<uint64_t> posted;
    size_t head = 0;
    size_t count = 0;
    // The NIC's CQ entries this link holds (see Nic::cq_reserved).
    uint32_t* reserved_in = nullptr;
    uint32_t cq_entries = 0;
    Link() = default;
    Link(const Link&) = delete;
    Link& operator=(const Link&) = delete;
    ~Link() {
      qp.reset();  // before giving its CQ entries back
      if (reserved_in != nullptr) *reserved_in -= cq_entries;
    }
    void Push(uint64_t wr_id) {
      posted[(head + count++) % posted.size()] = wr_id;
    }
    uint64_t Pop() {
      const uint64_t id = posted[head];
      head = (head + 1) % posted.size();
      --count;
      return id;
    }
  };
  struct Pending {
    LinkId link;
    WorkRequest wr;
    absl::Time posted;
  };

  absl::Status OpenNic(Nic& nic);
  absl::StatusOr<Link*> NewLink(NicIndex nic) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ToRtr(Link& link, const Params& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ToRts(Link& link) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Params LocalParams(const Link& link) const;
  void PollerLoop();
  // Delivers what `cq` holds; false if it held nothing.
  bool Drain(ibv_cq* cq);
  // Fails requests older than request_timeout (see the options).
  void ExpireOld();
  // RegisterMemory's parts: one NIC's registration of [addr, +length)
  // (device memory by dma-buf first, then plain), and every NIC's.
  struct Registration {
    void* addr = nullptr;
    uint64_t length = 0;
    int flags = 0;
    int device = -1;  // CUDA device ordinal; -1: host memory
    const absl::StatusOr<cuda::Driver::DmaBuf>* dmabuf = nullptr;  // device memory only
  };
  absl::StatusOr<ibv::Mr> RegisterOn(size_t nic, const Registration& r) const;
  std::vector<absl::StatusOr<ibv::Mr>> RegisterOnEveryNic(const Registration& r);
  // Post's parts: the batch checked whole; one link's chain of work
  // requests (`chain`: indices of `batch`) built and accounted; a chain the
  // QP refused (from `bad` on) failed, and the QP put in error.
  // What a request names, found by ValidateLocked for ChainLocked.
  struct Resolved {
    Link* link = nullptr;
    RegionState* region = nullptr;
  };
  absl::Status ValidateLocked(absl::Span<const WorkRequest> batch, absl::Span<Resolved> found)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ChainLocked(Link& link, absl::Span<const WorkRequest> batch, absl::Span<const size_t> chain,
                   absl::Span<const Resolved> found, absl::Span<ibv_send_wr> swrs,
                   absl::Span<ibv_sge> sges, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailChainLocked(Link& link, absl::Span<const WorkRequest> batch,
                       absl::Span<const size_t> chain, absl::Span<ibv_send_wr> swrs,
                       const ibv_send_wr* bad, const absl::Status& posted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteLocked(const WorkRequest& wr, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One work completion: it and the requests posted before it on its QP.
  void DeliverLocked(const ibv_wc& wc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes room in the NIC's CQ for `entries` more completions (resizing
  // it up to the device's limit), or kResourceExhausted.
  absl::Status ReserveCq(Nic& nic, uint32_t entries) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const VerbsTransportOptions options_;
  std::vector<Nic> nics_;
  uint64_t max_request_bytes_ = 0;
  uint64_t max_region_bytes_ = uint64_t{1} << 40;  // and each NIC's max_mr_size
  std::thread poller_;
  std::atomic<bool> stopping_{false};
  // Threads asleep in WaitCompletions. Completion events are requested only
  // while some thread sleeps: a thread that polls the CQs itself needs no
  // wake-up, and the poller's wake-ups would only steal its CPU.
  std::atomic<int> sleepers_{0};
  // Set by InterruptWait: the next (or current) WaitCompletions returns.
  std::atomic<bool> interrupted_{false};

  Mutex mu_;
  CondVar cq_cv_;
  RegionId last_region_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<RegionId, std::unique_ptr<RegionState>> regions_ ABSL_GUARDED_BY(mu_);
  LinkId last_link_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<LinkId, std::unique_ptr<Link>> links_ ABSL_GUARDED_BY(mu_);
  uint64_t last_wr_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  CompletionQueue cq_ ABSL_GUARDED_BY(mu_);
  std::function<void()> notify_ ABSL_GUARDED_BY(mu_);  // SetCompletionNotifier
  // RouteTo's answers by peer address (resolving can take a while).
  Mutex route_mu_;
  verbs::RouteCache routes_ ABSL_GUARDED_BY(route_mu_);
};

absl::Status VerbsTransport::OpenNic(Nic& nic) {
  ASSIGN_OR_RETURN(nic.context, ibv::OpenDevice(nic.port.device));
  const std::string where = absl::StrCat(nic.port.device, ":", nic.port.port);
  ibv_context* c = nic.context.get();
  RETURN_IF_ERROR(ibv::QueryPort(c, nic.port.port, &nic.attr, where));
  if (nic.attr.state != IBV_PORT_ACTIVE) {
    return absl::UnavailableError(absl::StrCat(where, " is not ACTIVE (state ",
                                               ibv_port_state_str(nic.attr.state), ")"));
  }
  RETURN_IF_ERROR(ibv::QueryGid(c, nic.port.port, nic.port.gid_index, &nic.gid, where));
  ibv_device_attr dev{};
  RETURN_IF_ERROR(ibv::QueryDevice(c, &dev, nic.port.device));
  nic.max_rd_atomic = std::max(1, std::min(16, dev.max_qp_rd_atom));
  nic.max_cqe = dev.max_cqe;
  nic.max_mr_size = dev.max_mr_size;
  if (dev.max_mr_size > 0) max_region_bytes_ = std::min<uint64_t>(max_region_bytes_, dev.max_mr_size);
  max_request_bytes_ = max_request_bytes_ == 0
                           ? std::min<uint64_t>(options_.max_request_bytes, nic.attr.max_msg_sz)
                           : std::min<uint64_t>(max_request_bytes_, nic.attr.max_msg_sz);
  ASSIGN_OR_RETURN(nic.pd, ibv::AllocPd(c, where));
  ASSIGN_OR_RETURN(nic.channel, ibv::CreateCompChannel(c, where));
  ASSIGN_OR_RETURN(nic.cq, ibv::CreateCq(c, std::min(8192, std::max(dev.max_cqe, 1)),
                                         nic.channel.get(), where));
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
  links_.clear();
  regions_.clear();
  nics_.clear();
}

EndpointDescription VerbsTransport::LocalEndpoint() const {
  EndpointDescription d;
  d.kind = "verbs";
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
      "cannot register memory of CUDA device ", r.device, " on ", name, ": by dma-buf: ",
      by_dmabuf.message(), "; by ibv_reg_mr: ", mr.status().message(),
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

absl::StatusOr<Region> VerbsTransport::RegisterMemory(void* addr, uint64_t length,
                                                      Access access) {
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
  const Registration what{addr, length, flags, device,
                          dmabuf.has_value() ? &*dmabuf : nullptr};
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

absl::Status VerbsTransport::ReserveCq(Nic& nic, uint32_t entries) {
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
    // Under the transport's lock, which Drain polls under too.
    RETURN_IF_ERROR(ibv::ResizeCq(nic.cq.get(), static_cast<int>(want), nic.port.device));
    nic.cq_capacity = static_cast<uint32_t>(nic.cq->cqe);
  }
  nic.cq_reserved += entries;
  return absl::OkStatus();
}

absl::StatusOr<VerbsTransport::Link*> VerbsTransport::NewLink(NicIndex n) {
  if (n >= nics_.size()) return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", n));
  if (links_.size() >= options_.max_links) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this transport has its maximum of ", options_.max_links, " links"));
  }
  Nic& nic = nics_[n];
  RETURN_IF_ERROR(ReserveCq(nic, options_.max_outstanding_per_link));
  auto link = std::make_unique<Link>();
  link->nic = n;
  link->cq_entries = options_.max_outstanding_per_link;
  link->reserved_in = &nic.cq_reserved;  // released when the link goes
  ibv_qp_init_attr init{};
  init.send_cq = nic.cq.get();
  init.recv_cq = nic.cq.get();
  init.cap.max_send_wr = options_.max_outstanding_per_link;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = options_.max_inline_bytes;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signaling: see Link::posted
  ASSIGN_OR_RETURN(link->qp, ibv::CreateQp(nic.pd.get(), &init, nic.port.device));
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = nic.port.port;
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  RETURN_IF_ERROR(ibv::ModifyQp(
      link->qp.get(), &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
      absl::StrFormat("modify QP %#x to INIT (port %u)", link->qp->qp_num, nic.port.port)));
  link->id = ++last_link_;
  link->max_inline = std::min(init.cap.max_inline_data, options_.max_inline_bytes);
  link->psn = static_cast<uint32_t>(net::RandomU64()) & 0xffffff;
  link->posted.assign(options_.max_outstanding_per_link, 0);
  Link* raw = link.get();
  links_.emplace(raw->id, std::move(link));
  return raw;
}

Params VerbsTransport::LocalParams(const Link& link) const {
  const Nic& nic = nics_[link.nic];
  Params p;
  p.qpn = link.qp->qp_num;
  p.psn = link.psn;
  p.lid = nic.attr.lid;
  std::memcpy(p.gid, nic.gid.raw, 16);
  p.mtu = nic.attr.active_mtu;
  return p;
}

absl::Status VerbsTransport::ToRtr(Link& link, const Params& peer) {
  const Nic& nic = nics_[link.nic];
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
  return ibv::ModifyQp(link.qp.get(), &attr,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                       absl::StrFormat("modify QP %#x to RTR (peer QP %#x, gid %s, mtu %d)",
                                       link.qp->qp_num, peer.qpn, GidText(dgid), MtuBytes(mtu)));
}

absl::Status VerbsTransport::ToRts(Link& link) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = options_.timeout;
  attr.retry_cnt = options_.retry_count;
  attr.rnr_retry = 7;
  attr.sq_psn = link.psn;
  attr.max_rd_atomic = nics_[link.nic].max_rd_atomic;
  RETURN_IF_ERROR(ibv::ModifyQp(link.qp.get(), &attr,
                                 IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
                                 absl::StrFormat("modify QP %#x to RTS", link.qp->qp_num)));
  link.state = Link::State::kReady;
  return absl::OkStatus();
}

absl::Status CheckPeerNic(const NicInfo& peer) {
  if (!absl::StartsWith(peer.address, "verbs:")) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a verbs NIC address: '", peer.address, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<NicIndex> VerbsTransport::RouteTo(const NicInfo& peer_nic) {
  RETURN_IF_ERROR(CheckPeerNic(peer_nic));
  const std::string gid = peer_nic.address.substr(6, peer_nic.address.find('/') - 6);
  const std::string ip = verbs::Ipv4OfGid(gid);
  if (ip.empty()) {
    return absl::UnimplementedError(
        absl::StrCat("peer GID ", gid, " carries no IPv4 address to route to"));
  }
  MutexLock lock(&route_mu_);  // one resolution per peer address at a time
  const absl::Time now = FastNow();
  if (const absl::StatusOr<uint32_t>* cached = routes_.Find(ip, now)) return *cached;
  absl::StatusOr<NicIndex> answer = [&]() -> absl::StatusOr<NicIndex> {
    ASSIGN_OR_RETURN(verbs::Route route, verbs::ResolveRoute(ip));
    std::vector<verbs::SelectedPort> ports;
    for (const Nic& nic : nics_) ports.push_back(nic.port);
    ASSIGN_OR_RETURN(size_t index, verbs::PortForRoute(route, ports));
    KVF_LOG(INFO) << "verbs: rdma_cm routes " << ip << " via " << route.device << ":" << route.port
                  << " from " << route.source_ip;
    return static_cast<NicIndex>(index);
  }();
  if (!answer.ok()) {
    KVF_LOG(INFO) << "verbs: no route-aware pairing for " << ip << " (" << answer.status().message()
                  << "); pairing NICs in order";
  }
  routes_.Put(ip, answer, now);
  return answer;
}

absl::StatusOr<LinkOffer> VerbsTransport::CreateLink(NicIndex local_nic, const NicInfo& peer_nic) {
  RETURN_IF_ERROR(CheckPeerNic(peer_nic));
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Link * link, NewLink(local_nic));
  return LinkOffer{link->id, EncodeParams(LocalParams(*link))};
}

absl::StatusOr<LinkOffer> VerbsTransport::AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                                     absl::string_view peer_params) {
  RETURN_IF_ERROR(CheckPeerNic(peer_nic));
  absl::StatusOr<Params> decoded = DecodeParams(peer_params);
  if (!decoded.ok()) return Annotate(decoded.status(), "AcceptLink");
  const Params& peer = *decoded;
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Link * link, NewLink(local_nic));
  absl::Status ready = ToRtr(*link, peer);
  if (ready.ok()) ready = ToRts(*link);
  if (!ready.ok()) {
    links_.erase(link->id);  // destroys the QP
    return ready;
  }
  return LinkOffer{link->id, EncodeParams(LocalParams(*link))};
}

absl::Status VerbsTransport::CompleteLink(LinkId id, absl::string_view peer_params) {
  MutexLock lock(&mu_);
  auto it = links_.find(id);
  if (it == links_.end()) return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
  Link& link = *it->second;
  if (link.state != Link::State::kPending) {
    return absl::FailedPreconditionError(absl::StrCat("link ", id, " is already complete"));
  }
  absl::StatusOr<Params> decoded = DecodeParams(peer_params);
  if (!decoded.ok()) return Annotate(decoded.status(), "CompleteLink");
  const Params& peer = *decoded;
  RETURN_IF_ERROR(ToRtr(link, peer));
  return ToRts(link);
}

absl::Status VerbsTransport::CloseLink(LinkId id) {
  MutexLock lock(&mu_);
  auto it = links_.find(id);
  if (it == links_.end()) return absl::NotFoundError(absl::StrCat("unknown link ", id));
  // The NIC stops touching request buffers once the QP is destroyed; its
  // requests are reported cancelled now and late completions are ignored.
  it->second->qp.reset();
  for (auto p = pending_.begin(); p != pending_.end();) {
    if (p->second.link == id) {
      CompleteLocked(p->second.wr, absl::CancelledError(absl::StrCat("link ", id, " was closed")));
      pending_.erase(p++);
    } else {
      ++p;
    }
  }
  links_.erase(it);
  return absl::OkStatus();
}

absl::Status VerbsTransport::ValidateLocked(absl::Span<const WorkRequest> batch,
                                           absl::Span<Resolved> found) {
  for (size_t i = 0; i < batch.size(); ++i) {
    const WorkRequest& wr = batch[i];
    auto link = links_.find(wr.link);
    RETURN_IF_ERROR(CheckLinkUsable(wr.link, link == links_.end() ? nullptr : &link->second->state));
    auto region = regions_.find(wr.local_region);
    if (region == regions_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown local region ", wr.local_region));
    }
    RETURN_IF_ERROR(CheckLocal(wr, region->second->region, max_request_bytes_));
    if (wr.remote_key > UINT32_MAX) {
      return absl::InvalidArgumentError(absl::StrFormat("remote key %#x is not a verbs rkey",
                                                        wr.remote_key));
    }
    found[i] = Resolved{link->second.get(), region->second.get()};
  }
  return CheckLinkCapacity(
      batch,
      [&](LinkId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        for (const Resolved& r : found) {
          if (r.link->id == id) return r.link->outstanding;
        }
        return size_t{0};  // not reached: every link of the batch was found above
      },
      options_.max_outstanding_per_link);
}

void VerbsTransport::ChainLocked(Link& link, absl::Span<const WorkRequest> batch,
                                 absl::Span<const size_t> chain, absl::Span<const Resolved> found,
                                 absl::Span<ibv_send_wr> swrs, absl::Span<ibv_sge> sges,
                                 absl::Time now) {
  for (size_t n = 0; n < chain.size(); ++n) {
    const size_t i = chain[n];
    const WorkRequest& wr = batch[i];
    RegionState& region = *found[i].region;
    ibv_sge& sge = sges[i];
    sge = ibv_sge{};
    sge.addr = reinterpret_cast<uintptr_t>(wr.local_addr);
    sge.length = static_cast<uint32_t>(wr.length);
    sge.lkey = region.mrs[link.nic]->lkey;
    ibv_send_wr& swr = swrs[i];
    swr = ibv_send_wr{};
    swr.wr_id = ++last_wr_;
    swr.sg_list = wr.length > 0 ? &sge : nullptr;
    swr.num_sge = wr.length > 0 ? 1 : 0;
    swr.opcode = wr.opcode == Opcode::kWrite ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
    // Only the chain's last one is signaled (selective signaling, see Link).
    swr.send_flags = n + 1 == chain.size() ? IBV_SEND_SIGNALED : 0;
    // Small WRITEs inline: the payload is copied into the work request
    // now, so the NIC fetches nothing (a DMA read saved per request).
    if (wr.opcode == Opcode::kWrite && wr.length > 0 && wr.length <= link.max_inline) {
      swr.send_flags |= IBV_SEND_INLINE;
    }
    swr.wr.rdma.remote_addr = wr.remote_addr;
    swr.wr.rdma.rkey = static_cast<uint32_t>(wr.remote_key);
    if (n > 0) swrs[chain[n - 1]].next = &swr;
    ++region.local_uses;
    ++link.outstanding;
    link.Push(swr.wr_id);
    pending_.emplace(swr.wr_id, Pending{wr.link, wr, now});
  }
}

void VerbsTransport::FailChainLocked(Link& link, absl::Span<const WorkRequest> batch,
                                     absl::Span<const size_t> chain,
                                     absl::Span<ibv_send_wr> swrs, const ibv_send_wr* bad,
                                     const absl::Status& posted) {
  // Validated before, so this is the QP failing: the requests from `bad`
  // on were not posted; report each of them.
  bool failed = false;
  for (const size_t i : chain) {
    ibv_send_wr& swr = swrs[i];
    failed = failed || &swr == bad || bad == nullptr;
    if (!failed) continue;
    pending_.erase(swr.wr_id);
    --link.outstanding;
    --link.count;  // the ring's newest entries are this chain's tail
    // The link is put in error below: retryable on a new one.
    CompleteLocked(batch[i], absl::UnavailableError(posted.message()));
  }
  // The chain's posted head is unsignaled and its signaled tail was
  // refused: put the QP in error so that its requests flush (errors always
  // complete) instead of waiting for a completion that never comes.
  link.state = Link::State::kError;
  if (absl::Status reset = ibv::ResetToError(link.qp.get()); !reset.ok()) {
    KVF_LOG(WARNING) << "verbs: " << reset;
  }
}

absl::Status VerbsTransport::Post(absl::Span<const WorkRequest> batch) {
  MutexLock lock(&mu_);
  constexpr size_t kOnStack = 4;
  Resolved found_stack[kOnStack];
  std::optional<Scratch<Resolved>> found_scratch;
  if (batch.size() > kOnStack) found_scratch.emplace()->resize(batch.size());
  const absl::Span<Resolved> found = batch.size() <= kOnStack
                                         ? absl::MakeSpan(found_stack, batch.size())
                                         : absl::MakeSpan(**found_scratch);
  RETURN_IF_ERROR(ValidateLocked(batch, found));
  // One ibv_post_send (one doorbell) per link: the batch's requests for a
  // link are chained. Each request is its own work request and completion,
  // so failures stay per request. A small batch builds them on the stack:
  // a one-request batch is what a latency-bound caller posts.
  ibv_send_wr swr_stack[kOnStack];
  ibv_sge sge_stack[kOnStack];
  size_t order_stack[kOnStack];
  // Larger ones in per-thread buffers (no allocation once warm).
  std::optional<Scratch<ibv_send_wr>> swrs_scratch;
  std::optional<Scratch<ibv_sge>> sges_scratch;
  std::optional<Scratch<size_t>> order_scratch;
  const bool small = batch.size() <= kOnStack;
  if (!small) {
    swrs_scratch.emplace()->resize(batch.size());
    sges_scratch.emplace()->resize(batch.size());
    order_scratch.emplace()->resize(batch.size());
  }
  const absl::Span<ibv_send_wr> swrs =
      small ? absl::MakeSpan(swr_stack, batch.size()) : absl::MakeSpan(**swrs_scratch);
  const absl::Span<ibv_sge> sges =
      small ? absl::MakeSpan(sge_stack, batch.size()) : absl::MakeSpan(**sges_scratch);
  // Batch indices grouped by link.
  const absl::Span<size_t> order =
      small ? absl::MakeSpan(order_stack, batch.size()) : absl::MakeSpan(**order_scratch);
  bool grouped = true;  // already in link order (one link, most often)
  for (size_t i = 0; i < batch.size(); ++i) {
    order[i] = i;
    grouped = grouped && (i == 0 || batch[i - 1].link <= batch[i].link);
  }
  // In batch order within a link. std::sort, not stable_sort: stable_sort
  // allocates a buffer on every call.
  if (!grouped) {
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return batch[a].link != batch[b].link ? batch[a].link < batch[b].link : a < b;
    });
  }
  const absl::Time now = FastNow();
  for (size_t k = 0; k < order.size();) {
    Link& link = *found[order[k]].link;
    size_t end = k;
    while (end < order.size() && batch[order[end]].link == link.id) ++end;
    const absl::Span<const size_t> chain(order.data() + k, end - k);
    ChainLocked(link, batch, chain, found, swrs, sges, now);
    ibv_send_wr* bad = nullptr;
    if (absl::Status posted = ibv::PostSend(link.qp.get(), &swrs[chain[0]], &bad); !posted.ok()) {
      FailChainLocked(link, batch, chain, swrs, bad, posted);
    }
    k = end;
  }
  return absl::OkStatus();
}

void VerbsTransport::CompleteLocked(const WorkRequest& wr, absl::Status status) {
  cq_.Push(wr, std::move(status));
  cq_cv_.SignalAll();
  if (notify_) notify_();
}

bool VerbsTransport::Drain(ibv_cq* cq) {
  ibv_wc wc[32];
  bool any = false;
  for (;;) {
    // Polled under the lock: ReserveCq may resize the CQ.
    MutexLock lock(&mu_);
    absl::StatusOr<int> polled = ibv::PollCq(cq, 32, wc);
    if (!polled.ok()) {
      KVF_LOG(WARNING) << "verbs: " << polled.status();
      return any;
    }
    const int n = *polled;
    if (n == 0) return any;
    any = true;
    for (int i = 0; i < n; ++i) DeliverLocked(wc[i]);
  }
}

void VerbsTransport::DeliverLocked(const ibv_wc& wc) {
  auto it = pending_.find(wc.wr_id);
  if (it == pending_.end()) return;  // its link was closed, or it expired
  auto link = links_.find(it->second.link);
  if (link == links_.end()) return;  // closed: its requests were cancelled
  Link& l = *link->second;
  // The work requests posted before this one on the QP are complete: RC
  // completes in order, and they were unsignaled (or their own completion
  // came already). An error completion also vouches for them: they
  // finished before the one that failed.
  while (l.count > 0) {
    const uint64_t id = l.Pop();
    auto p = pending_.find(id);
    if (p == pending_.end()) continue;  // expired meanwhile
    const WorkRequest wr = p->second.wr;
    pending_.erase(p);
    --l.outstanding;
    if (id == wc.wr_id) {
      absl::Status status;
      if (wc.status != IBV_WC_SUCCESS) {
        status = absl::Status(CodeOf(wc.status),
                              absl::StrFormat("%s (QP %#x, vendor error %#x)",
                                              ibv_wc_status_str(wc.status), wc.qp_num,
                                              wc.vendor_err));
        l.state = Link::State::kError;
      }
      CompleteLocked(wr, std::move(status));
      return;
    }
    CompleteLocked(wr, absl::OkStatus());
  }
}

void VerbsTransport::ExpireOld() {
  const absl::Time now = FastNow();
  MutexLock lock(&mu_);
  for (auto p = pending_.begin(); p != pending_.end();) {
    auto link = links_.find(p->second.link);
    if (now - p->second.posted < options_.request_timeout || link == links_.end()) {
      ++p;
      continue;
    }
    Link& l = *link->second;
    if (l.state == Link::State::kError) {
      // The QP is in the error state and touches no buffer; its flush
      // completion should have come. A NIC that never sends it (seen with
      // Soft-RoCE while it retransmits to a peer that drops everything)
      // must not hold the request forever.
      if (now - p->second.posted >= 2 * options_.request_timeout) {
        --l.outstanding;
        CompleteLocked(p->second.wr, absl::AbortedError(absl::StrFormat(
                                         "QP %#x is in the error state and its flush never came",
                                         l.qp->qp_num)));
        pending_.erase(p++);
      } else {
        ++p;
      }
      continue;
    }
    l.state = Link::State::kError;
    // In the error state the NIC touches no buffer of this QP any more; the
    // other requests come back as flush errors (kAborted).
    if (absl::Status reset = ibv::ResetToError(l.qp.get()); !reset.ok()) {
      KVF_LOG(WARNING) << "verbs: " << reset;
    }
    --l.outstanding;
    CompleteLocked(p->second.wr,
                   absl::UnavailableError(absl::StrFormat(
                       "no completion from the peer within %s on QP %#x: peer presumed gone",
                       absl::FormatDuration(options_.request_timeout), l.qp->qp_num)));
    pending_.erase(p++);
  }
}

void VerbsTransport::PollerLoop() {
  // Sleeps in the kernel until a CQ has news (or 100 ms pass, to check for
  // expired requests and shutdown), re-arms, then drains.
  std::vector<pollfd> fds;
  for (Nic& nic : nics_) fds.push_back(pollfd{nic.channel->fd, POLLIN, 0});
  absl::Time next_expiry_check = absl::Now();
  while (!stopping_) {
    if (absl::Now() >= next_expiry_check) {
      ExpireOld();
      next_expiry_check = absl::Now() + absl::Milliseconds(100);
    }
    if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
    for (size_t i = 0; i < nics_.size(); ++i) {
      if ((fds[i].revents & POLLIN) == 0) continue;
      absl::StatusOr<ibv_cq*> event = ibv::GetCqEvent(nics_[i].channel.get());
      if (!event.ok()) continue;  // poll() said readable; a failed read is skipped
      ibv_cq* cq = *event;
      // Re-arm first, so nothing is missed, but only for sleepers (see
      // sleepers_); a thread that goes to sleep later arms for itself.
      if (sleepers_.load() > 0) (void)ibv::ReqNotifyCq(cq, nics_[i].port.device);
      Drain(cq);
    }
  }
}

size_t VerbsTransport::PollCompletions(absl::Span<Completion> out) {
  // What the NICs have now, without waiting for the poller thread.
  for (Nic& nic : nics_) Drain(nic.cq.get());
  MutexLock lock(&mu_);
  return cq_.Pop(out, [this](RegionId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto region = regions_.find(id);
    if (region != regions_.end()) --region->second->local_uses;
  });
}

size_t VerbsTransport::WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) {
  if (size_t n = PollCompletions(out); n > 0 || timeout <= absl::ZeroDuration()) return n;
  // Poll the CQs from this thread for a moment (see busy_poll), then sleep.
  const absl::Time spin_until = FastNow() + std::min(timeout, options_.busy_poll);
  while (FastNow() < spin_until) {
    bool any = interrupted_.exchange(false);
    for (Nic& nic : nics_) any = Drain(nic.cq.get()) || any;
    if (any) return PollCompletions(out);
  }
  // Going to sleep: ask for completion events, then look once more (a
  // completion that came before the request raises no event).
  ++sleepers_;
  for (Nic& nic : nics_) (void)ibv::ReqNotifyCq(nic.cq.get(), nic.port.device);
  bool any = false;
  for (Nic& nic : nics_) any = Drain(nic.cq.get()) || any;
  if (!any) {
    MutexLock lock(&mu_);
    cq_cv_.AwaitWithDeadline(&mu_, FastNow() + timeout, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return !cq_.empty() || interrupted_.load();
    });
  }
  interrupted_.store(false);
  --sleepers_;
  return PollCompletions(out);
}

void VerbsTransport::InterruptWait() {
  MutexLock lock(&mu_);  // a waiter checks the flag under it before sleeping
  interrupted_.store(true);
  cq_cv_.SignalAll();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(VerbsTransportOptions options) {
  auto t = std::make_unique<VerbsTransport>(std::move(options));
  RETURN_IF_ERROR(t->Open());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace transport
}  // namespace kvferry
