// Driver: sharing device memory with NICs and other processes (dma-buf,
// IPC handles, VMM exports and imports).
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "cuda/driver.h"

namespace kvferry {
namespace cuda {

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
  const api::CUresult r =
      fn_.cuMemGetHandleForAddressRange(&fd, start, size, api::kMemRangeHandleTypeDmaBufFd, 0);
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
  return absl::UnimplementedError(absl::StrCat("the CUDA driver (version ", version_,
                                               ") has no virtual memory management (needs 11.0)"));
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
  return MapChunks(sizes, ordinal,
                   [&](size_t i) -> absl::StatusOr<api::CUmemGenericAllocationHandle> {
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
  const api::CUresult r =
      fn_.cuMemGetAllocationGranularity(&granularity, &prop, api::kMemAllocGranularityMinimum);
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

}  // namespace cuda
}  // namespace kvferry
