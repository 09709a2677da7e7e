#include "cuda/driver.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cctype>
#include <cstdlib>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"

namespace kvferry {
namespace cuda {

absl::Status CheckHostReadable(const void* p, uint64_t length) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (f == nullptr) return absl::OkStatus();  // cannot tell: trust the caller
  uintptr_t covered = addr;
  const uintptr_t end = addr + length;
  char line[512];
  while (covered < end && std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long lo, hi;  // NOLINT(runtime/int): sscanf's type
    char perms[8] = {};
    if (std::sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
    if (hi <= covered || lo > covered) continue;  // the lines are sorted by address
    if (perms[0] != 'r') break;
    covered = hi;
  }
  std::fclose(f);
  if (covered >= end) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "[%#x, +%u) is neither CUDA device memory nor host memory the CPU can read (byte %#x): "
      "a freed device pointer?",
      addr, length, covered));
}

namespace {

std::once_flag load_once;
Driver* loaded = nullptr;
absl::Status* load_error = nullptr;

}  // namespace

const Driver* Driver::Get() {
  std::call_once(load_once, [] {
    load_error = new absl::Status();
    loaded = Load(load_error);
  });
  return loaded;
}

absl::Status Driver::LoadError() {
  Get();
  return *load_error;
}

void Driver::BindVmm(void* handle, Entry* f) {
  auto optional = [&](auto& slot, const char* name) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(::dlsym(handle, name));
  };
  // VMM (CUDA 10.2; cuMemRetainAllocationHandle 11.0): all or none.
  optional(f->cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
  optional(f->cuMemCreate, "cuMemCreate");
  optional(f->cuMemRelease, "cuMemRelease");
  optional(f->cuMemAddressReserve, "cuMemAddressReserve");
  optional(f->cuMemAddressFree, "cuMemAddressFree");
  optional(f->cuMemMap, "cuMemMap");
  optional(f->cuMemUnmap, "cuMemUnmap");
  optional(f->cuMemSetAccess, "cuMemSetAccess");
  optional(f->cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
  optional(f->cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  optional(f->cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle");
  if (f->cuMemGetAllocationGranularity == nullptr || f->cuMemCreate == nullptr ||
      f->cuMemRelease == nullptr || f->cuMemAddressReserve == nullptr ||
      f->cuMemAddressFree == nullptr || f->cuMemMap == nullptr || f->cuMemUnmap == nullptr ||
      f->cuMemSetAccess == nullptr || f->cuMemExportToShareableHandle == nullptr ||
      f->cuMemImportFromShareableHandle == nullptr) {
    f->cuMemRetainAllocationHandle = nullptr;  // HasVmm() false
  }
}

Driver* Driver::Load(absl::Status* error) {
  const char* named = std::getenv("KVFERRY_CUDA_LIBRARY");
  const std::string library = named != nullptr && *named != '\0' ? named : "libcuda.so.1";
  void* handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    *error = absl::UnavailableError(absl::StrCat("no CUDA driver: cannot load ", library, " (",
                                                 why != nullptr ? why : "unknown", ")"));
    return nullptr;
  }
  auto* d = new Driver();
  d->handle_ = handle;
  d->library_ = library;
  std::string missing;
  auto bind = [&](auto& slot, const char* name) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(::dlsym(handle, name));
    if (slot == nullptr) absl::StrAppend(&missing, missing.empty() ? "" : ", ", name);
  };
  Entry& f = d->fn_;
  bind(f.cuInit, "cuInit");
  bind(f.cuDriverGetVersion, "cuDriverGetVersion");
  bind(f.cuDeviceGetCount, "cuDeviceGetCount");
  bind(f.cuDeviceGet, "cuDeviceGet");
  bind(f.cuDeviceGetAttribute, "cuDeviceGetAttribute");
  bind(f.cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId");
  bind(f.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  bind(f.cuCtxSetCurrent, "cuCtxSetCurrent");
  bind(f.cuCtxGetCurrent, "cuCtxGetCurrent");
  bind(f.cuPointerGetAttribute, "cuPointerGetAttribute");
  bind(f.cuMemGetAddressRange_v2, "cuMemGetAddressRange_v2");
  bind(f.cuMemAlloc_v2, "cuMemAlloc_v2");
  bind(f.cuMemFree_v2, "cuMemFree_v2");
  bind(f.cuMemHostAlloc, "cuMemHostAlloc");
  bind(f.cuMemFreeHost, "cuMemFreeHost");
  bind(f.cuMemcpyAsync, "cuMemcpyAsync");
  bind(f.cuStreamCreate, "cuStreamCreate");
  bind(f.cuStreamSynchronize, "cuStreamSynchronize");
  bind(f.cuStreamDestroy_v2, "cuStreamDestroy_v2");
  bind(f.cuGetErrorName, "cuGetErrorName");
  auto optional = [&](auto& slot, const char* name) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(::dlsym(handle, name));
  };
  optional(f.cuMemGetHandleForAddressRange, "cuMemGetHandleForAddressRange");
  optional(f.cuIpcGetMemHandle, "cuIpcGetMemHandle");
  optional(f.cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle_v2");
  optional(f.cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
  optional(f.cuLaunchHostFunc, "cuLaunchHostFunc");
  optional(f.cuEventCreate, "cuEventCreate");
  optional(f.cuEventRecord, "cuEventRecord");
  optional(f.cuEventSynchronize, "cuEventSynchronize");
  optional(f.cuEventQuery, "cuEventQuery");
  optional(f.cuEventDestroy_v2, "cuEventDestroy_v2");
  BindVmm(handle, &f);
  if (!missing.empty()) {
    *error = absl::UnavailableError(
        absl::StrCat("no CUDA driver: ", library, " lacks ", missing, " (a driver too old?)"));
    ::dlclose(handle);
    delete d;
    return nullptr;
  }
  api::CUresult r = f.cuInit(0);
  if (r == api::kSuccess) r = f.cuDriverGetVersion(&d->version_);
  if (r == api::kSuccess) r = f.cuDeviceGetCount(&d->device_count_);
  if (r != api::kSuccess) {
    *error = absl::UnavailableError(absl::StrCat(
        "no CUDA driver: ", library, " does not start: ",
        r == api::kErrorStubLibrary ? "it is the toolkit's stub library, not a driver"
        : r == api::kErrorNoDevice  ? "no CUDA device"
                                    : d->Error("cuInit", r).message()));
    ::dlclose(handle);
    delete d;
    return nullptr;
  }
  MutexLock lock(&d->mu_);
  d->contexts_.assign(d->device_count_, nullptr);
  d->idle_streams_.resize(d->device_count_);
  return d;
}

absl::Status Driver::Error(const char* call, api::CUresult r) const {
  const char* name = nullptr;
  if (fn_.cuGetErrorName == nullptr || fn_.cuGetErrorName(r, &name) != api::kSuccess ||
      name == nullptr) {
    name = "CUDA error";
  }
  const std::string text = absl::StrFormat("%s: %s (%d)", call, name, r);
  switch (r) {
    case api::kErrorOutOfMemory:
      return absl::ResourceExhaustedError(text);
    case api::kErrorInvalidValue:
    case api::kErrorInvalidDevice:
    case api::kErrorNotFound:
    case api::kErrorIllegalAddress:
      return absl::InvalidArgumentError(text);
    case api::kErrorNotSupported:
      return absl::UnimplementedError(text);
    default:
      return absl::InternalError(text);
  }
}

absl::StatusOr<api::CUcontext> Driver::Context(int ordinal) const {
  if (ordinal < 0 || ordinal >= device_count_) {
    return absl::InvalidArgumentError(
        absl::StrCat("no CUDA device ", ordinal, " (this host has ", device_count_, ")"));
  }
  MutexLock lock(&mu_);
  api::CUcontext& ctx = contexts_[ordinal];
  if (ctx == nullptr) {
    api::CUdevice dev;
    api::CUresult r = fn_.cuDeviceGet(&dev, ordinal);
    if (r == api::kSuccess) r = fn_.cuDevicePrimaryCtxRetain(&ctx, dev);
    if (r != api::kSuccess) {
      ctx = nullptr;
      return Error("cuDevicePrimaryCtxRetain", r);
    }
  }
  return ctx;
}

Driver::Bound::Bound(const Driver* d, int ordinal) : d_(d) {
  absl::StatusOr<api::CUcontext> ctx = d->Context(ordinal);
  if (!ctx.ok()) {
    status_ = ctx.status();
    return;
  }
  if (d->fn_.cuCtxGetCurrent(&previous_) != api::kSuccess) previous_ = nullptr;
  if (previous_ == *ctx) return;
  const api::CUresult r = d->fn_.cuCtxSetCurrent(*ctx);
  if (r != api::kSuccess) {
    status_ = d->Error("cuCtxSetCurrent", r);
    return;
  }
  restore_ = true;
}

Driver::Bound::~Bound() {
  if (restore_) (void)d_->fn_.cuCtxSetCurrent(previous_);
}

absl::StatusOr<std::string> Driver::PciBusId(int ordinal) const {
  api::CUdevice dev;
  api::CUresult r = fn_.cuDeviceGet(&dev, ordinal);
  if (r != api::kSuccess) return Error("cuDeviceGet", r);
  char id[32] = {};
  r = fn_.cuDeviceGetPCIBusId(id, sizeof id, dev);
  if (r != api::kSuccess) return Error("cuDeviceGetPCIBusId", r);
  std::string out(id);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  return out;
}

int Driver::Attribute(int ordinal, int attribute) const {
  api::CUdevice dev;
  int value = 0;
  if (fn_.cuDeviceGet(&dev, ordinal) != api::kSuccess ||
      fn_.cuDeviceGetAttribute(&value, attribute, dev) != api::kSuccess) {
    return 0;
  }
  return value;
}

absl::StatusOr<MemoryInfo> Driver::Classify(const void* addr, uint64_t length) const {
  const auto at = reinterpret_cast<api::CUdeviceptr>(addr);
  unsigned type = 0;
  api::CUresult r = fn_.cuPointerGetAttribute(&type, api::kPointerAttributeMemoryType, at);
  // Memory CUDA never saw (malloc, the stack) is INVALID_VALUE: host, if
  // the CPU can read it (a freed device pointer is INVALID_VALUE too).
  if (r == api::kErrorInvalidValue || (r == api::kSuccess && type != api::kMemoryTypeDevice)) {
    if (length == 0) return MemoryInfo{};
    unsigned last = 0;
    if (fn_.cuPointerGetAttribute(&last, api::kPointerAttributeMemoryType, at + length - 1) ==
            api::kSuccess &&
        last == api::kMemoryTypeDevice) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "[%#x, +%u) starts in host memory and ends in CUDA device memory", at, length));
    }
    if (absl::Status readable = CheckHostReadable(addr, length); !readable.ok()) return readable;
    return MemoryInfo{};
  }
  if (r != api::kSuccess) return Error("cuPointerGetAttribute", r);
  MemoryInfo info;
  info.device = true;
  r = fn_.cuPointerGetAttribute(&info.ordinal, api::kPointerAttributeDeviceOrdinal, at);
  if (r != api::kSuccess) return Error("cuPointerGetAttribute(DEVICE_ORDINAL)", r);
  Bound bound(this, info.ordinal);
  if (!bound.status().ok()) return bound.status();
  // Allocation by allocation (VMM memory is mapped in chunks, one range each).
  const api::CUdeviceptr end = at + length;
  for (api::CUdeviceptr p = at; p < end;) {
    api::CUdeviceptr base = 0;
    size_t size = 0;
    int ordinal = -1;
    unsigned kind = 0;
    if (fn_.cuPointerGetAttribute(&kind, api::kPointerAttributeMemoryType, p) != api::kSuccess ||
        kind != api::kMemoryTypeDevice ||
        fn_.cuPointerGetAttribute(&ordinal, api::kPointerAttributeDeviceOrdinal, p) !=
            api::kSuccess ||
        ordinal != info.ordinal ||
        fn_.cuMemGetAddressRange_v2(&base, &size, p) != api::kSuccess || base + size <= p) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "[%#x, +%u) is not all memory of CUDA device %d: byte %#x (offset %u) is %s", at, length,
          info.ordinal, p, p - at,
          ordinal >= 0 && ordinal != info.ordinal
              ? absl::StrCat("on device ", ordinal)
              : std::string("not in a live device allocation")));
    }
    p = base + size;
  }
  return info;
}

absl::StatusOr<api::CUstream> Driver::TakeStream(int ordinal) const {
  {
    MutexLock lock(&mu_);
    if (ordinal >= 0 && static_cast<size_t>(ordinal) < idle_streams_.size() &&
        !idle_streams_[ordinal].empty()) {
      api::CUstream s = idle_streams_[ordinal].back();
      idle_streams_[ordinal].pop_back();
      return s;
    }
  }
  ASSIGN_OR_RETURN(void* s, CreateStream(ordinal));
  return static_cast<api::CUstream>(s);
}

void Driver::GiveStream(api::CUstream stream, int ordinal) const {
  MutexLock lock(&mu_);
  idle_streams_[ordinal].push_back(stream);
}

absl::Status Driver::Copy(void* dst, const void* src, uint64_t length, int ordinal) const {
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  ASSIGN_OR_RETURN(api::CUstream stream, TakeStream(ordinal));
  api::CUresult r = fn_.cuMemcpyAsync(reinterpret_cast<api::CUdeviceptr>(dst),
                                      reinterpret_cast<api::CUdeviceptr>(src), length, stream);
  const char* call = "cuMemcpyAsync";
  if (r == api::kSuccess) {
    // Landed: only now may anyone be told.
    r = fn_.cuStreamSynchronize(stream);
    call = "cuStreamSynchronize";
  }
  GiveStream(stream, ordinal);
  return r == api::kSuccess ? absl::OkStatus() : Error(call, r);
}

absl::Status Driver::ReadDevice(const void* src, uint64_t length, int ordinal,
                                absl::FunctionRef<void(const char*, size_t)> fn) const {
  if (length == 0) return absl::OkStatus();
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  ASSIGN_OR_RETURN(void* buffer, TakePinned(2 * kReadPiece));
  absl::StatusOr<api::CUstream> stream = TakeStream(ordinal);
  absl::Status status = stream.status();
  const char* from = static_cast<const char*>(src);
  auto half = [&](int i) { return static_cast<char*>(buffer) + i * kReadPiece; };
  auto start = [&](uint64_t off, int i) {
    const api::CUresult r = fn_.cuMemcpyAsync(
        reinterpret_cast<api::CUdeviceptr>(half(i)), reinterpret_cast<api::CUdeviceptr>(from + off),
        std::min<uint64_t>(kReadPiece, length - off), *stream);
    return r == api::kSuccess ? absl::OkStatus() : Error("cuMemcpyAsync", r);
  };
  if (status.ok()) status = start(0, 0);
  int cur = 0;
  for (uint64_t off = 0; status.ok() && off < length;) {
    // Piece `cur` has landed once the stream is synchronized; the next one
    // is queued behind it and runs while fn reads this one.
    const api::CUresult r = fn_.cuStreamSynchronize(*stream);
    if (r != api::kSuccess) {
      status = Error("cuStreamSynchronize", r);
      break;
    }
    const uint64_t next = off + std::min<uint64_t>(kReadPiece, length - off);
    if (next < length) status = start(next, 1 - cur);
    if (!status.ok()) break;
    fn(half(cur), next - off);
    off = next;
    cur = 1 - cur;
  }
  if (stream.ok()) {
    if (!status.ok()) (void)fn_.cuStreamSynchronize(*stream);  // nothing in flight into the buffer
    GiveStream(*stream, ordinal);
  }
  GivePinned(buffer, 2 * kReadPiece);
  return status;
}

absl::StatusOr<void*> Driver::TakePinned(size_t length) const {
  {
    MutexLock lock(&mu_);
    for (auto it = kept_pinned_.begin(); it != kept_pinned_.end(); ++it) {
      if (it->first == length) {
        void* p = it->second;
        kept_pinned_.erase(it);
        kept_pinned_bytes_ -= length;
        return p;
      }
    }
  }
  return AllocPinned(length);
}

void Driver::GivePinned(void* p, size_t length) const {
  if (p == nullptr) return;
  {
    MutexLock lock(&mu_);
    if (kept_pinned_bytes_ + length <= kKeptPinnedBytes) {
      kept_pinned_.emplace_back(length, p);
      kept_pinned_bytes_ += length;
      return;
    }
  }
  FreePinned(p);
}

absl::Status Driver::LaunchHostFunc(void* stream, int ordinal, void (*fn)(void*),
                                    void* data) const {
  if (fn_.cuLaunchHostFunc == nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        "the CUDA driver (version ", version_, ") has no cuLaunchHostFunc (needs 10.0)"));
  }
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  const api::CUresult r = fn_.cuLaunchHostFunc(static_cast<api::CUstream>(stream), fn, data);
  return r == api::kSuccess ? absl::OkStatus() : Error("cuLaunchHostFunc", r);
}

absl::StatusOr<void*> Driver::RecordEvent(void* stream, int ordinal) const {
  if (fn_.cuEventCreate == nullptr || fn_.cuEventRecord == nullptr ||
      fn_.cuEventQuery == nullptr || fn_.cuEventSynchronize == nullptr ||
      fn_.cuEventDestroy_v2 == nullptr) {
    return absl::UnimplementedError("the CUDA driver has no events");
  }
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  api::CUevent event = nullptr;
  api::CUresult r = fn_.cuEventCreate(&event, api::kEventDisableTiming);
  if (r != api::kSuccess) return Error("cuEventCreate", r);
  r = fn_.cuEventRecord(event, static_cast<api::CUstream>(stream));
  if (r != api::kSuccess) {
    (void)fn_.cuEventDestroy_v2(event);
    return Error("cuEventRecord", r);
  }
  return static_cast<void*>(event);
}

absl::StatusOr<bool> Driver::EventDone(void* event, int ordinal) const {
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  const api::CUresult r = fn_.cuEventQuery(static_cast<api::CUevent>(event));
  if (r == api::kErrorNotReady) return false;
  if (r != api::kSuccess) return Error("cuEventQuery", r);
  return true;
}

absl::Status Driver::WaitEvent(void* event, int ordinal) const {
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  const api::CUresult r = fn_.cuEventSynchronize(static_cast<api::CUevent>(event));
  return r == api::kSuccess ? absl::OkStatus() : Error("cuEventSynchronize", r);
}

void Driver::DestroyEvent(void* event, int ordinal) const {
  if (event == nullptr || fn_.cuEventDestroy_v2 == nullptr) return;
  Bound bound(this, ordinal);
  (void)fn_.cuEventDestroy_v2(static_cast<api::CUevent>(event));
}

absl::StatusOr<Driver::DmaBuf> Driver::ExportDmaBuf(const void* addr, uint64_t length,
                                                      int ordinal) const {
  if (fn_.cuMemGetHandleForAddressRange == nullptr || version_ < 11070) {
    return absl::UnimplementedError(absl::StrCat("the CUDA driver (version ", version_,
                                                 ") has no dma-buf export (needs 11.7)"));
  }
  if (Attribute(ordinal, api::kDeviceAttributeDmaBufSupported) != 1) {
    return absl::UnimplementedError(absl::StrCat(
        "CUDA device ", ordinal, " does not support dma-buf (an older GPU, kernel or driver)"));
  }
  // The range must be whole host pages.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const auto at = reinterpret_cast<uintptr_t>(addr);
  const uintptr_t start = at & ~(page - 1);
  const uint64_t size = (at + length - start + page - 1) / page * page;
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  int fd = -1;
  const api::CUresult r = fn_.cuMemGetHandleForAddressRange(
      &fd, start, size, api::kMemRangeHandleTypeDmaBufFd, 0);
  if (r != api::kSuccess) return Error("cuMemGetHandleForAddressRange", r);
  return DmaBuf{fd, at - start};
}

absl::StatusOr<Driver::IpcExport> Driver::IpcExportOf(const void* addr, int ordinal) const {
  if (fn_.cuIpcGetMemHandle == nullptr || fn_.cuIpcOpenMemHandle_v2 == nullptr) {
    return absl::UnimplementedError("the CUDA driver has no IPC memory handles");
  }
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  api::CUdeviceptr base = 0;
  api::CUresult r =
      fn_.cuMemGetAddressRange_v2(&base, nullptr, reinterpret_cast<api::CUdeviceptr>(addr));
  if (r != api::kSuccess) return Error("cuMemGetAddressRange", r);
  IpcExport out{};
  r = fn_.cuIpcGetMemHandle(&out.handle, base);
  if (r != api::kSuccess) return Error("cuIpcGetMemHandle", r);
  out.offset = reinterpret_cast<uintptr_t>(addr) - base;
  return out;
}

absl::StatusOr<void*> Driver::IpcOpen(const api::CUipcMemHandle& handle, int ordinal,
                                      uint64_t* size) const {
  if (fn_.cuIpcOpenMemHandle_v2 == nullptr) {
    return absl::UnimplementedError("the CUDA driver has no IPC memory handles");
  }
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  api::CUdeviceptr p = 0;
  api::CUresult r = fn_.cuIpcOpenMemHandle_v2(&p, handle, api::kIpcMemLazyEnablePeerAccess);
  if (r != api::kSuccess) return Error("cuIpcOpenMemHandle", r);
  api::CUdeviceptr base = 0;
  size_t length = 0;
  r = fn_.cuMemGetAddressRange_v2(&base, &length, p);
  if (r != api::kSuccess || base != p) {
    (void)fn_.cuIpcCloseMemHandle(p);
    return r != api::kSuccess ? Error("cuMemGetAddressRange", r)
                              : absl::InternalError("an IPC mapping that is not an allocation");
  }
  *size = length;
  return reinterpret_cast<void*>(p);
}

void Driver::IpcClose(void* mapped, int ordinal) const {
  if (fn_.cuIpcCloseMemHandle == nullptr || mapped == nullptr) return;
  Bound bound(this, ordinal);
  (void)fn_.cuIpcCloseMemHandle(reinterpret_cast<api::CUdeviceptr>(mapped));
}

absl::Status Driver::NoVmm() const {
  return absl::UnimplementedError(absl::StrCat(
      "the CUDA driver (version ", version_, ") has no virtual memory management (needs 11.0)"));
}

bool Driver::IsVmm(const void* addr, int ordinal) const {
  if (!HasVmm()) return false;
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return false;
  api::CUmemGenericAllocationHandle h = 0;
  if (fn_.cuMemRetainAllocationHandle(&h, const_cast<void*>(addr)) != api::kSuccess) return false;
  (void)fn_.cuMemRelease(h);
  return true;
}

absl::StatusOr<Driver::VmmExport> Driver::ExportVmm(const void* addr, uint64_t length,
                                                    int ordinal) const {
  if (!HasVmm()) return NoVmm();
  const auto at = reinterpret_cast<api::CUdeviceptr>(addr);
  uint64_t types = 0;  // the driver writes 4 or 8 bytes
  if (fn_.cuPointerGetAttribute(&types, api::kPointerAttributeAllowedHandleTypes, at) ==
          api::kSuccess &&
      (types & api::kMemHandleTypePosixFileDescriptor) == 0) {
    return absl::UnimplementedError(absl::StrFormat(
        "it was not created exportable as a POSIX fd (allowed handle types %#x)", types));
  }
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  VmmExport out;
  absl::Status failed;
  for (api::CUdeviceptr p = at; p < at + length && failed.ok();) {
    api::CUdeviceptr base = 0;
    size_t size = 0;
    api::CUmemGenericAllocationHandle h = 0;
    api::CUresult r = fn_.cuMemGetAddressRange_v2(&base, &size, p);
    if (r != api::kSuccess || base + size <= p) {
      failed = r != api::kSuccess ? Error("cuMemGetAddressRange", r)
                                  : absl::InternalError("an empty VMM mapping");
      break;
    }
    r = fn_.cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(base));
    if (r != api::kSuccess) {
      failed = Error("cuMemRetainAllocationHandle", r);
      break;
    }
    int fd = -1;
    r = fn_.cuMemExportToShareableHandle(&fd, h, api::kMemHandleTypePosixFileDescriptor, 0);
    (void)fn_.cuMemRelease(h);
    if (r != api::kSuccess) {
      failed = Error("cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)", r);
      if (r == api::kErrorNotSupported) failed = absl::UnimplementedError(failed.message());
      break;
    }
    if (out.chunks.empty()) out.offset = p - base;
    out.chunks.push_back(VmmChunk{fd, size});
    p = base + size;
  }
  if (!failed.ok()) {
    for (const VmmChunk& c : out.chunks) ::close(c.fd);
    return failed;
  }
  return out;
}

absl::StatusOr<void*> Driver::MapChunks(
    const std::vector<uint64_t>& sizes, int ordinal,
    absl::FunctionRef<absl::StatusOr<api::CUmemGenericAllocationHandle>(size_t)> handle) const {
  uint64_t total = 0;
  for (uint64_t size : sizes) total += size;
  if (sizes.empty() || total == 0) return absl::InvalidArgumentError("no VMM chunks to map");
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  api::CUdeviceptr base = 0;
  api::CUresult r = fn_.cuMemAddressReserve(&base, total, 0, 0, 0);
  if (r != api::kSuccess) return Error("cuMemAddressReserve", r);
  uint64_t mapped = 0;
  absl::Status failed;
  for (size_t i = 0; i < sizes.size() && failed.ok(); ++i) {
    absl::StatusOr<api::CUmemGenericAllocationHandle> h = handle(i);
    if (!h.ok()) {
      failed = h.status();
      break;
    }
    r = fn_.cuMemMap(base + mapped, sizes[i], 0, *h, 0);
    (void)fn_.cuMemRelease(*h);  // the mapping holds the allocation
    if (r != api::kSuccess) {
      failed = Error("cuMemMap", r);
      break;
    }
    mapped += sizes[i];
  }
  if (failed.ok()) {
    api::CUmemAccessDesc access{};
    access.location.type = api::kMemLocationTypeDevice;
    access.location.id = ordinal;
    access.flags = api::kMemAccessFlagsProtReadWrite;
    r = fn_.cuMemSetAccess(base, total, &access, 1);
    if (r != api::kSuccess) failed = Error("cuMemSetAccess", r);
  }
  if (!failed.ok()) {
    if (mapped > 0) (void)fn_.cuMemUnmap(base, mapped);
    (void)fn_.cuMemAddressFree(base, total);
    return failed;
  }
  return reinterpret_cast<void*>(base);
}

absl::StatusOr<void*> Driver::ImportVmm(const std::vector<VmmChunk>& chunks, int ordinal) const {
  if (!HasVmm()) return NoVmm();
  std::vector<uint64_t> sizes;
  for (const VmmChunk& c : chunks) sizes.push_back(c.size);
  return MapChunks(sizes, ordinal, [&](size_t i) -> absl::StatusOr<api::CUmemGenericAllocationHandle> {
    api::CUmemGenericAllocationHandle h = 0;
    const api::CUresult r = fn_.cuMemImportFromShareableHandle(
        &h, reinterpret_cast<void*>(static_cast<intptr_t>(chunks[i].fd)),
        api::kMemHandleTypePosixFileDescriptor);
    if (r != api::kSuccess) return Error("cuMemImportFromShareableHandle", r);
    return h;
  });
}

void Driver::VmmUnmap(void* base, uint64_t size, int ordinal) const {
  if (!HasVmm() || base == nullptr) return;
  Bound bound(this, ordinal);
  const auto at = reinterpret_cast<api::CUdeviceptr>(base);
  (void)fn_.cuMemUnmap(at, size);
  (void)fn_.cuMemAddressFree(at, size);
}

absl::StatusOr<uint64_t> Driver::VmmGranularity(int ordinal) const {
  if (!HasVmm()) return NoVmm();
  api::CUmemAllocationProp prop{};
  prop.type = api::kMemAllocationTypePinned;
  prop.requestedHandleTypes = api::kMemHandleTypePosixFileDescriptor;
  prop.location.type = api::kMemLocationTypeDevice;
  prop.location.id = ordinal;
  size_t granularity = 0;
  const api::CUresult r = fn_.cuMemGetAllocationGranularity(&granularity, &prop,
                                                            api::kMemAllocGranularityMinimum);
  if (r != api::kSuccess) return Error("cuMemGetAllocationGranularity", r);
  return granularity;
}

absl::StatusOr<void*> Driver::AllocVmm(int ordinal, uint64_t chunk_bytes, int chunks) const {
  if (!HasVmm()) return NoVmm();
  if (chunks <= 0 || chunk_bytes == 0) return absl::InvalidArgumentError("no VMM chunks");
  api::CUmemAllocationProp prop{};
  prop.type = api::kMemAllocationTypePinned;
  prop.requestedHandleTypes = api::kMemHandleTypePosixFileDescriptor;
  prop.location.type = api::kMemLocationTypeDevice;
  prop.location.id = ordinal;
  return MapChunks(std::vector<uint64_t>(chunks, chunk_bytes), ordinal,
                   [&](size_t) -> absl::StatusOr<api::CUmemGenericAllocationHandle> {
                     api::CUmemGenericAllocationHandle h = 0;
                     const api::CUresult r = fn_.cuMemCreate(&h, chunk_bytes, &prop, 0);
                     if (r != api::kSuccess) return Error("cuMemCreate", r);
                     return h;
                   });
}

absl::Status Driver::FreeVmm(void* p, uint64_t chunk_bytes, int chunks, int ordinal) const {
  if (!HasVmm()) return NoVmm();
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  const auto at = reinterpret_cast<api::CUdeviceptr>(p);
  const uint64_t total = chunk_bytes * static_cast<uint64_t>(chunks);
  api::CUresult r = fn_.cuMemUnmap(at, total);
  if (r != api::kSuccess) return Error("cuMemUnmap", r);
  r = fn_.cuMemAddressFree(at, total);
  return r == api::kSuccess ? absl::OkStatus() : Error("cuMemAddressFree", r);
}

absl::StatusOr<void*> Driver::CreateStream(int ordinal) const {
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  api::CUstream stream = nullptr;
  // Non-blocking: it waits for no work on the legacy default stream.
  const api::CUresult r = fn_.cuStreamCreate(&stream, api::kStreamNonBlocking);
  if (r != api::kSuccess) return Error("cuStreamCreate", r);
  return static_cast<void*>(stream);
}

void Driver::DestroyStream(void* stream, int ordinal) const {
  if (stream == nullptr) return;
  Bound bound(this, ordinal);
  (void)fn_.cuStreamDestroy_v2(static_cast<api::CUstream>(stream));
}

absl::Status Driver::CopyAsync(void* dst, const void* src, uint64_t length, void* stream,
                               int ordinal) const {
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  const api::CUresult r = fn_.cuMemcpyAsync(reinterpret_cast<api::CUdeviceptr>(dst),
                                            reinterpret_cast<api::CUdeviceptr>(src), length,
                                            static_cast<api::CUstream>(stream));
  return r == api::kSuccess ? absl::OkStatus() : Error("cuMemcpyAsync", r);
}

absl::Status Driver::Synchronize(void* stream, int ordinal) const {
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  const api::CUresult r = fn_.cuStreamSynchronize(static_cast<api::CUstream>(stream));
  return r == api::kSuccess ? absl::OkStatus() : Error("cuStreamSynchronize", r);
}

absl::StatusOr<void*> Driver::AllocPinned(size_t length) const {
  // Pinned memory belongs to a context: the first device's primary one,
  // made portable so every context can use it.
  Bound bound(this, 0);
  if (!bound.status().ok()) return bound.status();
  void* p = nullptr;
  const api::CUresult r = fn_.cuMemHostAlloc(&p, length, api::kMemHostAllocPortable);
  if (r != api::kSuccess) return Error("cuMemHostAlloc", r);
  return p;
}

void Driver::FreePinned(void* p) const {
  if (p == nullptr) return;
  Bound bound(this, 0);
  (void)fn_.cuMemFreeHost(p);
}

absl::StatusOr<void*> Driver::AllocDevice(int ordinal, size_t length) const {
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  api::CUdeviceptr p = 0;
  const api::CUresult r = fn_.cuMemAlloc_v2(&p, length);
  if (r != api::kSuccess) return Error("cuMemAlloc", r);
  return reinterpret_cast<void*>(p);
}

absl::Status Driver::FreeDevice(void* p, int ordinal) const {
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  const api::CUresult r = fn_.cuMemFree_v2(reinterpret_cast<api::CUdeviceptr>(p));
  return r == api::kSuccess ? absl::OkStatus() : Error("cuMemFree", r);
}

}  // namespace cuda
}  // namespace kvferry
