#include "transport/cuda_ipc/cuda_share.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "transport/cuda_ipc/vmm_share.h"

namespace kvferry {
namespace transport {
namespace {

static_assert(sizeof(cuda::api::CUipcMemHandle) == sizeof(ShareRef::bytes),
              "an IPC handle fills a reference");

// A registered region as peers on this host may open it: its allocation's
// IPC handle, or its export id on the VMM server.
class CudaExport final : public HostShare::Export {
 public:
  ~CudaExport() override {
    if (vmm_id != 0) VmmServer::Get()->Remove(vmm_id);
  }
  bool has_ipc = false;
  cuda::Driver::IpcExport ipc{};  // ipc.offset: the region's start in its allocation
  uint64_t vmm_id = 0;
};

// Another process's allocation, opened here.
struct Import {
  void* mapped = nullptr;
  uint64_t size = 0;  // of the allocation: requests must stay inside
  int ordinal = 0;    // opened through this device's context
  VmmMapping vmm{};   // VMM memory: unmapped, not IpcClose'd
  uint64_t used = 0;  // when last used (CudaImports::uses_)
};

void Close(const Import& imp) {
  if (imp.vmm.base != nullptr) {
    UnmapVmm(imp.vmm);
  } else {
    cuda::Driver::Get()->IpcClose(imp.mapped, imp.ordinal);
  }
}

class CudaImports final : public HostShare::Imports {
 public:
  CudaImports(uint64_t peer_server, size_t max) : peer_server_(peer_server), max_(max) {}
  ~CudaImports() override {
    for (const auto& [key, imp] : open_) Close(imp);
  }
  // The requester's bytes [ref.offset, +length) in the allocation `ref`
  // names, opened on first use through device `device`'s context.
  absl::StatusOr<char*> Open(const ShareRef& ref, bool vmm, uint64_t length, int device);

 private:
  absl::StatusOr<Import> OpenNew(const ShareRef& ref, bool vmm, int ordinal);

  const uint64_t peer_server_;  // the peer's VMM server; 0: none
  const size_t max_;
  uint64_t uses_ = 0;
  std::map<std::string, Import> open_;  // by reference bytes
};

absl::StatusOr<Import> CudaImports::OpenNew(const ShareRef& ref, bool vmm, int ordinal) {
  Import imp;
  imp.ordinal = ordinal;
  if (vmm) {
    if (peer_server_ == 0) return absl::UnavailableError("the peer has no VMM server");
    uint64_t id;
    std::memcpy(&id, ref.bytes, sizeof id);
    ASSIGN_OR_RETURN(imp.vmm, FetchVmm(peer_server_, id, ordinal));
    imp.mapped = imp.vmm.start;
    imp.size = imp.vmm.length;
    return imp;
  }
  cuda::api::CUipcMemHandle handle;
  std::memcpy(handle.reserved, ref.bytes, sizeof handle.reserved);
  ASSIGN_OR_RETURN(imp.mapped, cuda::Driver::Get()->IpcOpen(handle, ordinal, &imp.size));
  return imp;
}

absl::StatusOr<char*> CudaImports::Open(const ShareRef& ref, bool vmm, uint64_t length,
                                        int device) {
  const char* bytes = reinterpret_cast<const char*>(ref.bytes);
  std::string key = vmm ? absl::StrCat("vmm:", absl::string_view(bytes, 8))
                        : std::string(bytes, sizeof ref.bytes);
  auto it = open_.find(key);
  if (it == open_.end()) {
    // Through this end's device when the target is device memory, else
    // through device 0 (any context maps it).
    ASSIGN_OR_RETURN(Import imp, OpenNew(ref, vmm, device >= 0 ? device : 0));
    if (open_.size() >= std::max<size_t>(max_, 1)) {
      // The least recently used makes room (one thread uses the table).
      auto lru = std::min_element(open_.begin(), open_.end(), [](const auto& a, const auto& b) {
        return a.second.used < b.second.used;
      });
      Close(lru->second);
      open_.erase(lru);
    }
    it = open_.emplace(std::move(key), imp).first;
  }
  it->second.used = ++uses_;
  const Import& imp = it->second;
  if (ref.offset > imp.size || length > imp.size - ref.offset) {
    return absl::InvalidArgumentError(absl::StrCat("IPC reference [", ref.offset, ", +", length,
                                                   ") outside its allocation of ", imp.size,
                                                   " bytes"));
  }
  return static_cast<char*>(imp.mapped) + ref.offset;
}

class CudaShare final : public HostShare {
 public:
  explicit CudaShare(const CudaShareOptions& options) : options_(options) {}

  uint64_t LinkWord() const override {
    if (!cuda::Driver::Get()->HasVmm()) return 0;
    VmmServer* server = VmmServer::Get();
    return server != nullptr ? server->name() : 0;
  }

  std::unique_ptr<Export> Share(void* addr, uint64_t length, int device) override;

  // The second kind: VMM memory, named by its export id.
  bool Name(const Export& exp, uint64_t offset, uint64_t peer_word, ShareRef* ref,
            bool* second_kind) const override {
    const auto& e = static_cast<const CudaExport&>(exp);
    if (e.has_ipc) {
      // cudaMalloc memory: the peer opens the allocation's IPC handle.
      std::memcpy(ref->bytes, e.ipc.handle.reserved, sizeof ref->bytes);
      ref->offset = e.ipc.offset + offset;
      *second_kind = false;
      return true;
    }
    if (e.vmm_id == 0 || peer_word == 0) return false;
    // VMM memory: the peer maps it from this process's VMM server.
    *ref = ShareRef{};
    std::memcpy(ref->bytes, &e.vmm_id, sizeof e.vmm_id);
    ref->offset = offset;
    *second_kind = true;
    return true;
  }

  std::unique_ptr<Imports> NewImports(uint64_t peer_word) override {
    return std::make_unique<CudaImports>(peer_word, options_.max_imports);
  }

  absl::Status Copy(Imports& imports, const ShareRef& ref, bool second_kind, bool write,
                    char* target, int device, uint64_t length) override {
    ASSIGN_OR_RETURN(char* theirs,
                     static_cast<CudaImports&>(imports).Open(ref, second_kind, length, device));
    // Device to device on the GPUs (NVLink or PCIe); the CPU copies
    // nothing. Copy returns once the bytes have landed.
    return cuda::Driver::Get()->Copy(write ? target : theirs, write ? theirs : target, length,
                                     device >= 0 ? device : 0);
  }

 private:
  const CudaShareOptions options_;
};

std::unique_ptr<HostShare::Export> CudaShare::Share(void* addr, uint64_t length, int device) {
  if (device < 0) return nullptr;  // host memory goes as bytes
  const cuda::Driver* driver = cuda::Driver::Get();
  auto exp = std::make_unique<CudaExport>();
  absl::StatusOr<cuda::Driver::IpcExport> ipc = driver->IpcExportOf(addr, device);
  if (ipc.ok()) {
    exp->has_ipc = true;
    exp->ipc = *ipc;
    return exp;
  }
  if (!driver->IsVmm(addr, device)) {
    KVF_LOG(INFO) << "cuda_ipc: device memory at " << addr << " has no CUDA IPC handle ("
                  << ipc.status().message() << "): peers on this host get it staged";
    return nullptr;
  }
  // VMM memory: peers on this host fetch its chunks as fds, if they can be
  // exported (tried once here).
  absl::StatusOr<cuda::Driver::VmmExport> trial = driver->ExportVmm(addr, length, device);
  if (!trial.ok()) {
    KVF_LOG(INFO) << "cuda_ipc: VMM device memory at " << addr << " cannot be shared ("
                  << trial.status().message() << "): peers on this host get it staged";
    return nullptr;
  }
  for (const cuda::Driver::VmmChunk& c : trial->chunks) ::close(c.fd);
  VmmServer* server = VmmServer::Get();
  if (server == nullptr) return nullptr;
  exp->vmm_id = server->Add(addr, length, device);
  return exp;
}

}  // namespace

std::shared_ptr<HostShare> NewCudaShare(const CudaShareOptions& options) {
  if (cuda::Driver::Get() == nullptr) return nullptr;
  return std::make_shared<CudaShare>(options);
}

}  // namespace transport
}  // namespace kvferry
