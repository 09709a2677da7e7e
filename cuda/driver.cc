#include "cuda/driver.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"

namespace kvferry {
namespace cuda {

namespace {

// The first byte of [p, +length) outside mappings with `perm` ('r' or 'w')
// set, or the end; the end when /proc/self/maps cannot be read.
uintptr_t FirstWithout(const void* p, uint64_t length, char perm) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (f == nullptr) return addr + length;  // cannot tell: trust the caller
  uintptr_t covered = addr;
  const uintptr_t end = addr + length;
  char line[512];
  while (covered < end && std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long lo, hi;  // NOLINT(runtime/int): sscanf's type
    char perms[8] = {};
    if (std::sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
    if (hi <= covered || lo > covered) continue;  // the lines are sorted by address
    if (perms[perm == 'r' ? 0 : 1] != perm) break;
    covered = hi;
  }
  std::fclose(f);
  return std::min(covered, end);
}

}  // namespace

absl::Status CheckHostWritable(const void* p, uint64_t length) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = FirstWithout(p, length, 'w');
  if (first >= addr + length) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "[%#x, +%u) is not memory the CPU can write (byte %#x is read-only or unmapped)", addr,
      length, first));
}

absl::Status CheckHostReadable(const void* p, uint64_t length) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  const uintptr_t covered = FirstWithout(p, length, 'r');
  if (covered >= addr + length) return absl::OkStatus();
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

std::string Driver::BindRequired(void* handle, Entry* f) {
  std::string missing;
  auto bind = [&](auto& slot, const char* name) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(::dlsym(handle, name));
    if (slot == nullptr) absl::StrAppend(&missing, missing.empty() ? "" : ", ", name);
  };
  bind(f->cuInit, "cuInit");
  bind(f->cuDriverGetVersion, "cuDriverGetVersion");
  bind(f->cuDeviceGetCount, "cuDeviceGetCount");
  bind(f->cuDeviceGet, "cuDeviceGet");
  bind(f->cuDeviceGetAttribute, "cuDeviceGetAttribute");
  bind(f->cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId");
  bind(f->cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  bind(f->cuCtxSetCurrent, "cuCtxSetCurrent");
  bind(f->cuCtxGetCurrent, "cuCtxGetCurrent");
  bind(f->cuPointerGetAttribute, "cuPointerGetAttribute");
  bind(f->cuMemGetAddressRange_v2, "cuMemGetAddressRange_v2");
  bind(f->cuMemAlloc_v2, "cuMemAlloc_v2");
  bind(f->cuMemFree_v2, "cuMemFree_v2");
  bind(f->cuMemHostAlloc, "cuMemHostAlloc");
  bind(f->cuMemFreeHost, "cuMemFreeHost");
  bind(f->cuMemcpyAsync, "cuMemcpyAsync");
  bind(f->cuStreamCreate, "cuStreamCreate");
  bind(f->cuStreamSynchronize, "cuStreamSynchronize");
  bind(f->cuStreamDestroy_v2, "cuStreamDestroy_v2");
  bind(f->cuGetErrorName, "cuGetErrorName");
  return missing;
}

void Driver::BindOptional(void* handle, Entry* f) {
  auto optional = [&](auto& slot, const char* name) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(::dlsym(handle, name));
  };
  optional(f->cuMemGetHandleForAddressRange, "cuMemGetHandleForAddressRange");
  optional(f->cuIpcGetMemHandle, "cuIpcGetMemHandle");
  optional(f->cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle_v2");
  optional(f->cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
  optional(f->cuLaunchHostFunc, "cuLaunchHostFunc");
  optional(f->cuEventCreate, "cuEventCreate");
  optional(f->cuEventRecord, "cuEventRecord");
  optional(f->cuEventSynchronize, "cuEventSynchronize");
  optional(f->cuEventQuery, "cuEventQuery");
  optional(f->cuEventDestroy_v2, "cuEventDestroy_v2");
  BindVmm(handle, f);
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
  Entry& f = d->fn_;
  const std::string missing = BindRequired(handle, &f);
  BindOptional(handle, &f);
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
    *error = absl::UnavailableError(
        absl::StrCat("no CUDA driver: ", library, " does not start: ",
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
        ordinal != info.ordinal || fn_.cuMemGetAddressRange_v2(&base, &size, p) != api::kSuccess ||
        base + size <= p) {
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

}  // namespace cuda
}  // namespace kvferry
