// kvferry.TransferEngine: every method of Mooncake's Python TransferEngine
// (mooncake.engine), with its argument names, defaults and return
// conventions: 0 on success and a negative number on failure (the reason is
// logged and kept for get_last_error(), which a later success clears), batch
// ids from the async calls, Mooncake's fallbacks at initialize ("rdma"
// without a usable RDMA device becomes TCP, a device that does not exist
// becomes automatic discovery; each with one warning, both errors under
// KVFERRY_REQUIRE_RDMA=1 or MC_FORCE_HCA) and the MC_* environment
// (docs/migrating-from-mooncake.md). The native C++ API keeps its strict
// errors: all of this lives here.
#include "python/mooncake_engine.h"

#include <pybind11/stl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "python/module_util.h"
#include "python/mooncake_config.h"
#include "transport/verbs/discovery.h"

namespace py = pybind11;

namespace kvferry {
namespace python {
namespace {

// A notification sent with transfer_sync(..., notify=TransferNotify(name,
// msg)) travels as this tag, the name, a NUL and the message.
constexpr absl::string_view kNotifyTag = "\x01mooncake-notify\x01";

}  // namespace

MooncakeEngine::~MooncakeEngine() {
  if (engine_ == nullptr) return;
  py::gil_scoped_release release;  // the waits below touch no Python object
  // Async batches nobody collected: give them a moment, then let go.
  for (const auto& [id, pending] : batches_) {
    (void)pending;
    if (engine_->Wait(id, absl::Seconds(1)).ok()) (void)engine_->Release(id);
  }
  // A managed buffer is unmapped only once the engine forgot it (a buffer
  // still in use stays mapped rather than have a transfer touch freed memory).
  for (const auto& [addr, length] : managed_) {
    if (engine_->UnregisterMemory(reinterpret_cast<void*>(addr)).ok()) {
      munmap(reinterpret_cast<void*>(addr), length);
    }
  }
}

int MooncakeEngine::initialize(const std::string& local_hostname,
                               const std::string& metadata_server, const std::string& protocol,
                               const std::string& device_name) {
  return initialize_ext(local_hostname, metadata_server, protocol, device_name, "");
}

absl::StatusOr<std::unique_ptr<TransferEngine>> MooncakeEngine::CreateWithFallbacks(
    EngineOptions o) {
  const bool strict = EnvOn("KVFERRY_REQUIRE_RDMA") || EnvOn("MC_FORCE_HCA");
  auto create = [](const EngineOptions& opts) {
    py::gil_scoped_release release;
    return TransferEngine::Create(opts);
  };
  absl::StatusOr<std::unique_ptr<TransferEngine>> e = create(o);
  if (e.ok() || strict || o.transport == "tcp") return e;
  if (!o.devices.empty()) {
    KVF_LOG(WARNING) << "kvferry: device(s) '" << absl::StrJoin(o.devices, ",")
                     << "': " << e.status().message()
                     << "; using the RDMA devices discovery finds instead (Mooncake's "
                        "fallback; KVFERRY_REQUIRE_RDMA=1 makes this an error)";
    o.devices.clear();
    e = create(o);
    if (e.ok()) return e;
  }
  if (o.transport != "rdma") return e;
  KVF_LOG(WARNING) << "kvferry: protocol rdma: " << e.status().message()
                   << "; using TCP instead (Mooncake's fallback; KVFERRY_REQUIRE_RDMA=1 "
                      "makes this an error)";
  o.transport = "tcp";
  return create(o);
}

int MooncakeEngine::initialize_ext(const std::string& local_hostname,
                                   const std::string& metadata_server,
                                   const std::string& protocol, const std::string& device_name,
                                   const std::string& metadata_type) {
  Begin();
  if (engine_ != nullptr) return Fail(absl::FailedPreconditionError("already initialized"));
  if (!metadata_server.empty() && metadata_server != "P2PHANDSHAKE") {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "metadata server '", metadata_server, "'",
        metadata_type.empty() ? "" : absl::StrCat(" (", metadata_type, ")"),
        ": kvferry needs none; pass \"P2PHANDSHAKE\" (peers are named host:port)")));
  }
  EngineOptions o;
  absl::StatusOr<net::HostPort> local = SplitHostPort(local_hostname);
  if (!local.ok()) return Fail(local.status());
  o.local_host = local->host == "localhost" ? "127.0.0.1" : local->host;
  o.port = local->port;
  if (absl::Status s = ApplyMooncakeEnvironment(&o); !s.ok()) return Fail(s);
  absl::StatusOr<absl::Duration> timeout = TransferTimeout();
  if (!timeout.ok()) return Fail(timeout.status());
  if (protocol != "rdma" && protocol != "tcp" && !protocol.empty()) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "protocol '", protocol, "': kvferry speaks \"rdma\" and \"tcp\" (empty: either)")));
  }
  o.transport = protocol.empty() ? "auto" : protocol;
  if (EnvOn("MC_FORCE_TCP")) {
    if (EnvOn("KVFERRY_REQUIRE_RDMA") || EnvOn("MC_FORCE_HCA")) {
      return Fail(absl::InvalidArgumentError(
          "MC_FORCE_TCP contradicts KVFERRY_REQUIRE_RDMA / MC_FORCE_HCA"));
    }
    if (o.transport != "tcp") KVF_LOG(WARNING) << "kvferry: MC_FORCE_TCP is set: using TCP";
    o.transport = "tcp";
  }
  for (absl::string_view d : absl::StrSplit(device_name, ',', absl::SkipEmpty())) {
    o.devices.emplace_back(absl::StripAsciiWhitespace(d));
  }
  if (o.transport == "tcp") o.devices.clear();
  absl::StatusOr<std::unique_ptr<TransferEngine>> e = CreateWithFallbacks(o);
  if (!e.ok()) return Fail(e.status());
  engine_ = std::shared_ptr<TransferEngine>(std::move(*e));
  transfer_timeout_ = *timeout;
  return 0;
}

int MooncakeEngine::get_rpc_port() {
  if (!Ready()) return -1;
  const std::string a = engine_->address();
  uint32_t port = 0;
  return absl::SimpleAtoi(a.substr(a.rfind(':') + 1), &port) ? static_cast<int>(port) : -1;
}

uintptr_t MooncakeEngine::allocate_managed_buffer(uint64_t length) {
  if (!Ready()) return 0;
  if (length == 0) return Fail(absl::InvalidArgumentError("allocate_managed_buffer: length 0")), 0;
  void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    Fail(absl::ResourceExhaustedError(
        absl::StrCat("allocate_managed_buffer: ", length, " bytes: ", std::strerror(errno))));
    return 0;
  }
  if (register_memory(reinterpret_cast<uintptr_t>(p), length, "*", "") != 0) {
    munmap(p, length);
    return 0;
  }
  std::lock_guard<std::mutex> lock(mu_);
  managed_[reinterpret_cast<uintptr_t>(p)] = length;
  return reinterpret_cast<uintptr_t>(p);
}

int MooncakeEngine::free_managed_buffer(uintptr_t buffer_addr, uint64_t length) {
  Begin();
  uint64_t size = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = managed_.find(buffer_addr);
    if (it == managed_.end()) {
      return Fail(absl::NotFoundError(absl::StrCat(
          "free_managed_buffer: ", buffer_addr, " is not from allocate_managed_buffer")));
    }
    size = it->second;
    managed_.erase(it);
  }
  if (length != size) {
    KVF_LOG(WARNING) << "kvferry: free_managed_buffer: length " << length
                     << " differs from the allocation's " << size << "; freeing the allocation";
  }
  absl::Status s;
  {
    py::gil_scoped_release release;
    s = engine_->UnregisterMemory(reinterpret_cast<void*>(buffer_addr));
  }
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    managed_[buffer_addr] = size;  // still registered (in use): kept, not unmapped
    return Fail(s);
  }
  munmap(reinterpret_cast<void*>(buffer_addr), size);
  return 0;
}

int MooncakeEngine::register_memory(uintptr_t addr, uint64_t length, const std::string& location,
                                    const std::string& access) {
  if (!Ready()) return -1;
  absl::StatusOr<transport::Access> a = ParseAccess(access.empty() ? DefaultAccess() : access);
  if (!a.ok()) return Fail(a.status());
  absl::Status s;
  {
    py::gil_scoped_release release;  // pinning a large buffer takes a while
    s = engine_->RegisterMemory(reinterpret_cast<void*>(addr), length, *a,
                                location == "*" ? "" : location);
  }
  return Result(s);
}

int MooncakeEngine::unregister_memory(uintptr_t addr) {
  if (!Ready()) return -1;
  absl::Status s;
  {
    py::gil_scoped_release release;  // waits for peer writes in progress
    s = engine_->UnregisterMemory(reinterpret_cast<void*>(addr));
  }
  return Result(s);
}

int MooncakeEngine::batch_register_memory(const std::vector<uintptr_t>& addrs,
                                          const std::vector<uint64_t>& lengths,
                                          const std::string& location) {
  if (!Ready()) return -1;
  if (addrs.size() != lengths.size()) {
    return Fail(absl::InvalidArgumentError("addresses and capacities differ in count"));
  }
  for (size_t i = 0; i < addrs.size(); ++i) {
    if (register_memory(addrs[i], lengths[i], location, "") != 0) {
      for (size_t j = 0; j < i; ++j) (void)engine_->UnregisterMemory(reinterpret_cast<void*>(addrs[j]));
      return -1;  // none of them stays registered
    }
  }
  return 0;
}

int MooncakeEngine::batch_unregister_memory(const std::vector<uintptr_t>& addrs) {
  if (!Ready()) return -1;
  int result = 0;
  for (uintptr_t a : addrs) {
    if (unregister_memory(a) != 0) result = -1;  // the rest are still unregistered
  }
  return result;
}

std::string MooncakeEngine::DefaultAccess() {
  const char* env = std::getenv("KVFERRY_REMOTE_ACCESS");
  return env != nullptr && *env != '\0' ? env : "w";
}

absl::StatusOr<std::vector<TransferRequest>> MooncakeEngine::Requests(
    Opcode op, const std::vector<uintptr_t>& local, const std::vector<uint64_t>& remote,
    const std::vector<uint64_t>& lengths) {
  if (local.size() != remote.size() || local.size() != lengths.size()) {
    return absl::InvalidArgumentError("buffers, peer addresses and lengths differ in count");
  }
  if (local.empty()) return absl::InvalidArgumentError("no buffers to transfer");
  std::vector<TransferRequest> requests;
  for (size_t i = 0; i < local.size(); ++i) {
    requests.push_back({op == Opcode::kWrite ? transport::Opcode::kWrite : transport::Opcode::kRead,
                        reinterpret_cast<void*>(local[i]), remote[i], lengths[i]});
  }
  return requests;
}

int MooncakeEngine::Sync(const std::string& target, Opcode op, const std::vector<uintptr_t>& local,
                         const std::vector<uint64_t>& remote,
                         const std::vector<uint64_t>& lengths, const Notify* notify) {
  if (!Ready()) return -1;
  absl::StatusOr<std::vector<TransferRequest>> requests = Requests(op, local, remote, lengths);
  if (!requests.ok()) return Fail(requests.status());
  uint64_t bytes = 0;
  for (uint64_t l : lengths) bytes += l;
  const std::string peer = PeerName(target);
  if (absl::Status s = RunBatch(*engine_, peer, *requests, Timeout(bytes)); !s.ok()) return Fail(s);
  if (notify == nullptr) return 0;
  const std::string message =
      absl::StrCat(kNotifyTag, notify->name, std::string(1, '\0'), notify->msg);
  absl::Status sent;
  {
    py::gil_scoped_release release;
    absl::StatusOr<SegmentId> seg = engine_->OpenSegment(peer);
    sent = seg.ok() ? engine_->Notify(*seg, message) : seg.status();
  }
  return Result(sent);
}

uint64_t MooncakeEngine::Async(const std::string& target, Opcode op,
                               const std::vector<uintptr_t>& local,
                               const std::vector<uint64_t>& remote,
                               const std::vector<uint64_t>& lengths) {
  if (!Ready()) return 0;
  absl::StatusOr<std::vector<TransferRequest>> requests = Requests(op, local, remote, lengths);
  if (!requests.ok()) return Fail(requests.status()), 0;
  uint64_t bytes = 0;
  for (uint64_t l : lengths) bytes += l;
  absl::StatusOr<BatchId> batch;
  {
    py::gil_scoped_release release;
    absl::StatusOr<SegmentId> seg = engine_->OpenSegment(PeerName(target));
    batch = seg.ok() ? engine_->Submit(*seg, *requests) : seg.status();
  }
  if (!batch.ok()) return Fail(batch.status()), 0;
  std::lock_guard<std::mutex> lock(mu_);
  batches_[*batch] = Pending{absl::Now(), Timeout(bytes)};
  return *batch;
}

void MooncakeEngine::OnCuda(const std::string& target, Opcode op,
                            const std::vector<uintptr_t>& local,
                            const std::vector<uint64_t>& remote,
                            const std::vector<uint64_t>& lengths, uintptr_t stream) {
  if (!Ready()) throw std::runtime_error(last_error_);
  absl::StatusOr<std::vector<TransferRequest>> requests = Requests(op, local, remote, lengths);
  if (!requests.ok()) throw std::runtime_error((Fail(requests.status()), last_error_));
  uint64_t bytes = 0;
  for (uint64_t l : lengths) bytes += l;
  StreamOptions options;
  options.timeout = Timeout(bytes);
  options.keep_result = false;  // Mooncake's calls return nothing to wait on
  absl::StatusOr<uint64_t> id;
  {
    py::gil_scoped_release release;
    absl::StatusOr<SegmentId> seg = engine_->OpenSegment(PeerName(target));
    id = seg.ok() ? engine_->SubmitOnStream(*seg, *requests, reinterpret_cast<void*>(stream),
                                            options)
                  : seg.status();
  }
  if (!id.ok()) throw std::runtime_error((Fail(id.status()), last_error_));
}

absl::Duration MooncakeEngine::Timeout(uint64_t bytes) const {
  // Mooncake's: MC_TRANSFER_TIMEOUT plus one second per GiB.
  return transfer_timeout_ + absl::Nanoseconds(static_cast<int64_t>(bytes));
}

int MooncakeEngine::get_batch_transfer_status(const std::vector<uint64_t>& batch_ids) {
  if (!Ready()) return -1;
  absl::Status first;
  for (uint64_t id : batch_ids) {
    Pending p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = batches_.find(id);
      if (it == batches_.end()) {
        if (first.ok()) first = absl::NotFoundError(absl::StrCat("unknown batch ", id));
        continue;
      }
      p = it->second;
    }
    const absl::Duration left = std::max(absl::ZeroDuration(), p.start + p.timeout - absl::Now());
    absl::StatusOr<BatchStatus> st;
    {
      py::gil_scoped_release release;
      st = engine_->Wait(id, left);
    }
    absl::Status s = st.ok() ? absl::OkStatus() : st.status();
    for (size_t i = 0; s.ok() && i < st->requests.size(); ++i) s = st->requests[i];
    if (st.ok()) Forget(id);
    if (!s.ok() && first.ok()) first = s;
  }
  return Result(first);
}

uint64_t MooncakeEngine::transfer_submit_write(const std::string& target, uintptr_t buffer,
                                               uint64_t peer_buffer_address, uint64_t length,
                                               const std::string& transport_hint) {
  (void)transport_hint;
  // 0 when it cannot start, as Mooncake's: batch ids are never 0.
  return Async(target, Opcode::kWrite, {buffer}, {peer_buffer_address}, {length});
}

int MooncakeEngine::transfer_check_status(uint64_t batch_id) {
  if (!Ready()) return -1;
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = batches_.find(batch_id);
    if (it == batches_.end()) {
      return Fail(absl::NotFoundError(absl::StrCat("unknown batch ", batch_id)));
    }
    p = it->second;
  }
  absl::StatusOr<BatchStatus> st;
  {
    py::gil_scoped_release release;  // a poll may drive the engine's retries
    st = engine_->Poll(batch_id);
  }
  if (!st.ok()) return Fail(st.status());
  if (st->pending > 0) return absl::Now() - p.start > p.timeout ? -2 : 0;
  Forget(batch_id);
  for (const absl::Status& s : st->requests) {
    if (!s.ok()) return Fail(s);
  }
  return 1;
}

void MooncakeEngine::Forget(uint64_t batch_id) {
  (void)engine_->Release(batch_id);
  std::lock_guard<std::mutex> lock(mu_);
  batches_.erase(batch_id);
}

int MooncakeEngine::write_bytes_to_buffer(uintptr_t dest_address, const py::bytes& src,
                                          uint64_t length) {
  Begin();
  const std::string_view bytes(src);
  if (length > bytes.size()) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "write_bytes_to_buffer: length ", length, " exceeds the ", bytes.size(), " bytes given")));
  }
  std::memcpy(reinterpret_cast<void*>(dest_address), bytes.data(), length);
  return 0;
}

py::bytes MooncakeEngine::read_bytes_from_buffer(uintptr_t source_address, uint64_t length) {
  Begin();
  return py::bytes(reinterpret_cast<const char*>(source_address), length);
}

std::string MooncakeEngine::get_local_topology(const std::optional<std::string>& device_name) {
  Begin();
  transport::verbs::DiscoveryOptions d;
  if (device_name.has_value()) {
    for (absl::string_view n : absl::StrSplit(*device_name, ',', absl::SkipEmpty())) {
      d.devices.emplace_back(n);
    }
  }
  transport::verbs::ApplyEnvironment(&d);
  absl::StatusOr<transport::verbs::Discovery> found = transport::verbs::Discover(d);
  if (!found.ok()) {
    Fail(found.status());
    return "{}";
  }
  return transport::verbs::TopologyJson(*found);
}

uintptr_t MooncakeEngine::get_first_buffer_address(const std::string& segment_name) {
  if (!Ready()) return 0;
  absl::StatusOr<std::vector<TransferEngine::RemoteRegion>> regions;
  {
    py::gil_scoped_release release;
    absl::StatusOr<SegmentId> seg = engine_->OpenSegment(PeerName(segment_name));
    regions = seg.ok() ? engine_->SegmentRegions(*seg) : seg.status();
  }
  if (!regions.ok()) return Fail(regions.status()), 0;
  if (regions->empty()) {
    Fail(absl::NotFoundError(absl::StrCat(segment_name, " has registered no memory")));
    return 0;
  }
  return regions->front().addr;
}

int MooncakeEngine::warmup_efa_segment(const std::string& segment_name) {
  if (!Ready()) return -1;
  absl::StatusOr<SegmentId> seg;
  {
    py::gil_scoped_release release;
    seg = engine_->OpenSegment(PeerName(segment_name));  // handshake and links now
  }
  return Result(seg.status());
}

std::vector<MooncakeEngine::Notify> MooncakeEngine::get_notifies() {
  std::vector<Notify> out;
  if (!Ready()) return out;
  for (Notification& n : engine_->TakeNotifications()) {
    absl::string_view m(n.message);
    if (absl::ConsumePrefix(&m, kNotifyTag) && m.find('\0') != absl::string_view::npos) {
      const size_t nul = m.find('\0');
      out.push_back(Notify{std::string(m.substr(0, nul)), std::string(m.substr(nul + 1))});
    } else {
      out.push_back(Notify{"", std::move(n.message)});  // from a native Notify
    }
  }
  return out;
}

int MooncakeEngine::send_probe(const std::string& peer_server_name) {
  if (!Ready()) return -1;
  absl::StatusOr<uint64_t> id;
  {
    py::gil_scoped_release release;
    id = engine_->ProbePeer(PeerName(peer_server_name), absl::Seconds(5));
  }
  return Result(id.status());
}

std::shared_ptr<TransferEngine> MooncakeEngine::get_engine() {
  Begin();
  if (engine_ == nullptr) Fail(absl::FailedPreconditionError("call initialize() first"));
  return engine_;
}

uintptr_t MooncakeEngine::get_engine_ptr() {
  Begin();
  return reinterpret_cast<uintptr_t>(engine_.get());
}

bool MooncakeEngine::Ready() {
  Begin();
  if (engine_ != nullptr) return true;
  Fail(absl::FailedPreconditionError("call initialize() first"));
  return false;
}

int MooncakeEngine::Fail(const absl::Status& s) {
  last_error_ = s.ToString();
  KVF_LOG(WARNING) << "kvferry: " << last_error_;
  return -1;
}

void BindMooncake(py::module_& m) {
  using E = MooncakeEngine;
  for (const char* flag : {"SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_MNNVL", "SUPPORT_INTRA_NVLINK"}) {
    m.attr(flag) = false;  // no EFA/HIP/MNNVL transports
  }
  // The stream-ordered *_on_cuda calls work where a CUDA driver loads.
  m.attr("SUPPORT_CUDA") = cuda::Driver::Get() != nullptr;
  py::enum_<E::Opcode> opcode(m, "TransferOpcode", py::arithmetic());
  opcode.value("Read", E::Opcode::kRead).value("Write", E::Opcode::kWrite).export_values();
  py::class_<E::Notify>(m, "TransferNotify")
      .def(py::init<>())
      .def(py::init<const std::string&, const std::string&>(), py::arg("name"), py::arg("msg"))
      .def_readwrite("name", &E::Notify::name)
      .def_readwrite("msg", &E::Notify::msg)
      .def("__repr__", [](const E::Notify& n) {
        return absl::StrCat("TransferNotify(name=", py::repr(py::str(n.name)).cast<std::string>(),
                            ", msg=", py::repr(py::str(n.msg)).cast<std::string>(), ")");
      });
  py::class_<TransferEngine, std::shared_ptr<TransferEngine>>(
      m, "InnerTransferEngine", "The kvferry engine behind a TransferEngine (get_engine()).")
      .def_property_readonly("address", &TransferEngine::address)
      .def_property_readonly("transport",
                             [](const TransferEngine& e) { return e.detection().transport; });

  const auto target = py::arg("target_hostname");
  const auto hint = py::arg("transport_hint") = "";
  auto cls = py::class_<E>(m, "TransferEngine",
                           "Mooncake's Python TransferEngine (mooncake.engine), P2PHANDSHAKE "
                           "mode: the same methods, arguments and return values.");
  cls.def(py::init<>())
      .def("initialize", &E::initialize, py::arg("local_hostname"), py::arg("metadata_server"),
           py::arg("protocol"), py::arg("device_name"))
      .def("initialize_ext", &E::initialize_ext, py::arg("local_hostname"),
           py::arg("metadata_server"), py::arg("protocol"), py::arg("device_name"),
           py::arg("metadata_type"))
      .def("get_rpc_port", &E::get_rpc_port)
      .def("allocate_managed_buffer", &E::allocate_managed_buffer, py::arg("length"))
      .def("free_managed_buffer", &E::free_managed_buffer, py::arg("buffer_addr"),
           py::arg("length"))
      .def("transfer_sync_write", &E::transfer_sync_write, target, py::arg("buffer"),
           py::arg("peer_buffer_address"), py::arg("length"), hint)
      .def("transfer_sync_read", &E::transfer_sync_read, target, py::arg("buffer"),
           py::arg("peer_buffer_address"), py::arg("length"), hint)
      .def("batch_transfer_sync_write", &E::batch_transfer_sync_write, target, py::arg("buffers"),
           py::arg("peer_buffer_addresses"), py::arg("lengths"), hint)
      .def("batch_transfer_sync_read", &E::batch_transfer_sync_read, target, py::arg("buffers"),
           py::arg("peer_buffer_addresses"), py::arg("lengths"), hint)
      .def("batch_transfer_async_write", &E::batch_transfer_async_write, target,
           py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"), hint)
      .def("batch_transfer_async_read", &E::batch_transfer_async_read, target, py::arg("buffers"),
           py::arg("peer_buffer_addresses"), py::arg("lengths"), hint)
      .def("transfer_sync", &E::transfer_sync, target, py::arg("buffer"),
           py::arg("peer_buffer_address"), py::arg("length"), py::arg("opcode"),
           py::arg("notify") = nullptr, hint)
      .def("batch_transfer_sync", &E::batch_transfer_sync, target, py::arg("buffers"),
           py::arg("peer_buffer_addresses"), py::arg("lengths"), py::arg("opcode"),
           py::arg("notify") = nullptr, hint)
      .def("batch_transfer_async", &E::batch_transfer_async, target, py::arg("buffers"),
           py::arg("peer_buffer_addresses"), py::arg("lengths"), py::arg("opcode"), hint)
      .def("transfer_write_on_cuda", &E::transfer_write_on_cuda, target, py::arg("buffer"),
           py::arg("peer_buffer_address"), py::arg("length"), py::arg("stream_ptr") = 0, hint)
      .def("transfer_read_on_cuda", &E::transfer_read_on_cuda, target, py::arg("buffer"),
           py::arg("peer_buffer_address"), py::arg("length"), py::arg("stream_ptr") = 0, hint)
      .def("batch_transfer_write_on_cuda", &E::batch_transfer_write_on_cuda, target,
           py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"),
           py::arg("stream_ptr") = 0, hint)
      .def("batch_transfer_read_on_cuda", &E::batch_transfer_read_on_cuda, target,
           py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"),
           py::arg("stream_ptr") = 0, hint)
      .def("get_batch_transfer_status", &E::get_batch_transfer_status, py::arg("batch_ids"))
      .def("transfer_submit_write", &E::transfer_submit_write, target, py::arg("buffer"),
           py::arg("peer_buffer_address"), py::arg("length"), hint)
      .def("transfer_check_status", &E::transfer_check_status, py::arg("batch_id"))
      .def("write_bytes_to_buffer", &E::write_bytes_to_buffer, py::arg("dest_address"),
           py::arg("src_ptr"), py::arg("length"))
      .def("read_bytes_from_buffer", &E::read_bytes_from_buffer, py::arg("source_address"),
           py::arg("length"))
      .def("register_memory", &E::register_memory, py::arg("buffer_addr"), py::arg("capacity"),
           py::arg("location") = "*", py::arg("access") = "",
           "Registers [buffer_addr, +capacity). access (kvferry's): \"w\" (peers may write "
           "into it; the default, or KVFERRY_REMOTE_ACCESS), \"r\", \"rw\" or \"none\". 0 or -1.")
      .def("unregister_memory", &E::unregister_memory, py::arg("buffer_addr"))
      .def("batch_register_memory", &E::batch_register_memory, py::arg("buffer_addresses"),
           py::arg("capacities"), py::arg("location") = "*")
      .def("batch_unregister_memory", &E::batch_unregister_memory, py::arg("buffer_addresses"))
      .def("get_local_topology", &E::get_local_topology, py::arg("device_name") = py::none())
      .def("get_first_buffer_address", &E::get_first_buffer_address, py::arg("segment_name"))
      .def("warmup_efa_segment", &E::warmup_efa_segment, py::arg("segment_name"))
      .def("get_notifies", &E::get_notifies)
      .def("send_probe", &E::send_probe, py::arg("peer_server_name"))
      .def("get_engine", &E::get_engine)
      .def("get_engine_ptr", &E::get_engine_ptr)
      .def("get_last_error", &E::get_last_error,
           "kvferry's: why the last call failed; empty after a call that succeeded.")
      .def("get_local_address", &E::get_local_address);
  cls.attr("TransferOpcode") = opcode;
}

}  // namespace python
}  // namespace kvferry
