// The CUDA driver, opened at run time: dlopen("libcuda.so.1"), or the
// library KVFERRY_CUDA_LIBRARY names (tests point it at a fake). Nothing of
// CUDA is needed to build or link kvferry; a host without the library has
// no GPU support and everything else works as before.
//
// All calls are thread-safe. Calls that act on device memory first make
// the device's primary context (the one the CUDA runtime and PyTorch use)
// current on the calling thread.
#ifndef KVFERRY_CUDA_DRIVER_H_
#define KVFERRY_CUDA_DRIVER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "cuda/driver_api.h"

namespace kvferry {
namespace cuda {

// Where a range of memory lives.
struct MemoryInfo {
  bool device = false;  // false: host memory (pageable, pinned or registered)
  int ordinal = -1;     // the CUDA device ordinal, for device memory
};

// Whether every byte of [addr, +length) lies in mappings the CPU may read
// (/proc/self/maps); kInvalidArgument naming the first that does not.
absl::Status CheckHostReadable(const void* addr, uint64_t length);
// The same, for mappings the CPU may write: memory a peer may write into
// must be (a remote WRITE into a read-only mapping would kill the process).
absl::Status CheckHostWritable(const void* addr, uint64_t length);

class Driver {
 public:
  // The process's driver, loaded on first use; null when there is none
  // (LoadError says why).
  static const Driver* Get();
  static absl::Status LoadError();

  // The library it was loaded from, and the driver's version (12060 = 12.6).
  const std::string& library() const { return library_; }
  int version() const { return version_; }
  int device_count() const { return device_count_; }
  // The PCI address of a device, lower case: "0000:1b:00.0".
  absl::StatusOr<std::string> PciBusId(int ordinal) const;
  // A device attribute (CUdevice_attribute value); 0 when the driver does
  // not know it.
  int Attribute(int ordinal, int attribute) const;

  // Host or device memory. For device memory, [addr, +length) must lie in
  // mapped allocations of one device; host memory must be mapped readable
  // (a freed device pointer is not). Else kInvalidArgument, naming the
  // first byte that is wrong.
  absl::StatusOr<MemoryInfo> Classify(const void* addr, uint64_t length) const;
  // Copies `length` bytes in any direction (the driver tells host and device
  // pointers apart); `ordinal`: the device of the device side. When it
  // returns OK the bytes are in place, for this process and any other that
  // maps the memory: the copy runs on a stream of the driver's own (kept
  // for reuse, one per concurrent caller) and that stream is synchronized.
  // A plain cuMemcpy would not do: device to device and pageable host to
  // device it may return before the copy ran (NVIDIA's "API
  // synchronization behavior"). It waits for nothing else: not the
  // caller's streams, not the context.
  absl::Status Copy(void* dst, const void* src, uint64_t length, int ordinal) const;
  // Copies queued on a stream of device `ordinal` (a CUstream), to overlap
  // them with other work. They have landed only once Synchronize(stream)
  // returned OK.
  absl::StatusOr<void*> CreateStream(int ordinal) const;
  void DestroyStream(void* stream, int ordinal) const;
  absl::Status CopyAsync(void* dst, const void* src, uint64_t length, void* stream,
                         int ordinal) const;
  absl::Status Synchronize(void* stream, int ordinal) const;

  // Reads [src, +length) of device `ordinal` for the CPU: calls
  // `fn(bytes, n)` on consecutive pieces, in order, each in pinned host
  // memory and landed; the driver copies the next piece while `fn` works
  // on this one. The CPU never touches device memory. The first error of
  // a copy is returned, and `fn` is not called past it.
  absl::Status ReadDevice(const void* src, uint64_t length, int ordinal,
                          absl::FunctionRef<void(const char*, size_t)> fn) const;

  // Stream order with a caller's stream (a CUstream of device `ordinal`;
  // null: the legacy default stream). LaunchHostFunc queues `fn(data)`
  // behind the work already on the stream: the driver calls it on a thread
  // of its own once that work finished, and the stream's later work waits
  // until it returns. `fn` must make no CUDA call. kUnimplemented where the
  // driver lacks it (before CUDA 10.0).
  absl::Status LaunchHostFunc(void* stream, int ordinal, void (*fn)(void*), void* data) const;
  // An event recorded now on `stream`; EventDone says whether the stream's
  // work before it finished, WaitEvent waits for that, DestroyEvent frees
  // it (for tests and tools).
  absl::StatusOr<void*> RecordEvent(void* stream, int ordinal) const;
  absl::StatusOr<bool> EventDone(void* event, int ordinal) const;
  absl::Status WaitEvent(void* event, int ordinal) const;
  void DestroyEvent(void* event, int ordinal) const;
  // Pinned host memory, for staging buffers.
  absl::StatusOr<void*> AllocPinned(size_t length) const;
  void FreePinned(void* p) const;
  // Pinned buffers kept for reuse: TakePinned gives one of `length` bytes
  // (a kept one, else a new one); GivePinned keeps it again, up to
  // kKeptPinnedBytes in all, and frees past that. Freeing pinned memory
  // waits for the whole device (cuMemFreeHost), which can wait on a
  // caller's stream held by a stream-ordered transfer: the data path
  // gives its buffers back instead of freeing them.
  static constexpr size_t kKeptPinnedBytes = 64 << 20;
  absl::StatusOr<void*> TakePinned(size_t length) const;
  void GivePinned(void* p, size_t length) const;
  // Device memory (tests and tools).
  absl::StatusOr<void*> AllocDevice(int ordinal, size_t length) const;
  absl::Status FreeDevice(void* p, int ordinal) const;

  // A dma-buf of the pages holding device memory [addr, +length) of device
  // `ordinal`, for ibv_reg_dmabuf_mr: the caller closes `fd`. The buffer
  // starts at `offset` within it. kUnimplemented where the device or the
  // driver has no dma-buf export.
  struct DmaBuf {
    int fd = -1;
    uint64_t offset = 0;
  };
  absl::StatusOr<DmaBuf> ExportDmaBuf(const void* addr, uint64_t length, int ordinal) const;

  // CUDA IPC (cudaMalloc memory; VMM memory has no IPC memory handle). The
  // handle of the allocation holding `addr`, and `addr`'s offset in it.
  struct IpcExport {
    api::CUipcMemHandle handle;
    uint64_t offset = 0;
  };
  absl::StatusOr<IpcExport> IpcExportOf(const void* addr, int ordinal) const;
  // Maps another process's allocation into this one (through the context of
  // `ordinal`); IpcClose unmaps it.
  // `*size` gets the mapped allocation's size (requests are checked
  // against it).
  absl::StatusOr<void*> IpcOpen(const api::CUipcMemHandle& handle, int ordinal,
                                uint64_t* size) const;
  void IpcClose(void* mapped, int ordinal) const;

  // VMM memory (cuMemCreate + cuMemMap: PyTorch's expandable segments),
  // which has no IPC memory handle. It is mapped in chunks, one allocation
  // handle each; a chunk is shared as a POSIX fd of its handle.
  // Whether the driver has it (CUDA 11.0 and later), and whether `addr`
  // lies in VMM memory.
  bool HasVmm() const { return fn_.cuMemRetainAllocationHandle != nullptr; }
  bool IsVmm(const void* addr, int ordinal) const;
  struct VmmChunk {
    int fd = -1;
    uint64_t size = 0;
  };
  struct VmmExport {
    std::vector<VmmChunk> chunks;  // the fds are the caller's to close
    uint64_t offset = 0;           // `addr`'s offset in the first chunk
  };
  // Every chunk mapped over [addr, +length), in address order.
  // kUnimplemented when the memory was not made exportable as a POSIX fd.
  absl::StatusOr<VmmExport> ExportVmm(const void* addr, uint64_t length, int ordinal) const;
  // Maps another process's chunks back to back, readable and writable by
  // device `ordinal`; returns where the first starts. The caller still
  // closes the fds. VmmUnmap undoes it (`size`: the chunks' sum).
  absl::StatusOr<void*> ImportVmm(const std::vector<VmmChunk>& chunks, int ordinal) const;
  void VmmUnmap(void* base, uint64_t size, int ordinal) const;
  // VMM memory (tests and tools): `chunks` allocations of `chunk_bytes`
  // each (a multiple of VmmGranularity), mapped back to back and exportable
  // as POSIX fds, as PyTorch's expandable segments are. FreeVmm takes the
  // same sizes.
  absl::StatusOr<uint64_t> VmmGranularity(int ordinal) const;
  absl::StatusOr<void*> AllocVmm(int ordinal, uint64_t chunk_bytes, int chunks) const;
  absl::Status FreeVmm(void* p, uint64_t chunk_bytes, int chunks, int ordinal) const;

  // A failed call's status: "cuMemcpy: CUDA_ERROR_INVALID_VALUE (1)".
  absl::Status Error(const char* call, api::CUresult r) const;

 private:
  Driver() = default;
  static Driver* Load(absl::Status* error);
  // Makes the primary context of `ordinal` current on this thread until it
  // goes out of scope; then the thread's own context is current again (a
  // caller's thread may be working on another device).
  class Bound {
   public:
    Bound(const Driver* d, int ordinal);
    ~Bound();
    const absl::Status& status() const { return status_; }

   private:
    const Driver* d_;
    api::CUcontext previous_ = nullptr;
    bool restore_ = false;
    absl::Status status_;
  };
  absl::StatusOr<api::CUcontext> Context(int ordinal) const;
  // Reserves address space for chunks of `sizes`, maps the allocation
  // handle(i) gives for each back to back (and releases it: the mapping
  // holds it), makes them readable and writable by `ordinal`; on failure
  // nothing stays mapped.
  absl::StatusOr<void*> MapChunks(
      const std::vector<uint64_t>& sizes, int ordinal,
      absl::FunctionRef<absl::StatusOr<api::CUmemGenericAllocationHandle>(size_t)> handle) const;

  void* handle_ = nullptr;
  std::string library_;
  int version_ = 0;
  int device_count_ = 0;
  struct Entry {
    api::cuInit_t cuInit;
    api::cuDriverGetVersion_t cuDriverGetVersion;
    api::cuDeviceGetCount_t cuDeviceGetCount;
    api::cuDeviceGet_t cuDeviceGet;
    api::cuDeviceGetAttribute_t cuDeviceGetAttribute;
    api::cuDeviceGetPCIBusId_t cuDeviceGetPCIBusId;
    api::cuDevicePrimaryCtxRetain_t cuDevicePrimaryCtxRetain;
    api::cuCtxSetCurrent_t cuCtxSetCurrent;
    api::cuCtxGetCurrent_t cuCtxGetCurrent;
    api::cuPointerGetAttribute_t cuPointerGetAttribute;
    api::cuMemGetAddressRange_v2_t cuMemGetAddressRange_v2;
    api::cuMemAlloc_v2_t cuMemAlloc_v2;
    api::cuMemFree_v2_t cuMemFree_v2;
    api::cuMemHostAlloc_t cuMemHostAlloc;
    api::cuMemFreeHost_t cuMemFreeHost;
    api::cuMemcpyAsync_t cuMemcpyAsync;
    api::cuStreamCreate_t cuStreamCreate;
    api::cuStreamSynchronize_t cuStreamSynchronize;
    api::cuStreamDestroy_v2_t cuStreamDestroy_v2;
    api::cuGetErrorName_t cuGetErrorName;
    // Optional (all since CUDA 10.0 or earlier; null where missing).
    api::cuLaunchHostFunc_t cuLaunchHostFunc;
    api::cuEventCreate_t cuEventCreate;
    api::cuEventRecord_t cuEventRecord;
    api::cuEventSynchronize_t cuEventSynchronize;
    api::cuEventQuery_t cuEventQuery;
    api::cuEventDestroy_v2_t cuEventDestroy_v2;
    // Optional: null when the driver lacks them (dma-buf export: 11.7).
    api::cuMemGetHandleForAddressRange_t cuMemGetHandleForAddressRange;
    api::cuIpcGetMemHandle_t cuIpcGetMemHandle;
    api::cuIpcOpenMemHandle_v2_t cuIpcOpenMemHandle_v2;
    api::cuIpcCloseMemHandle_t cuIpcCloseMemHandle;
    api::cuMemGetAllocationGranularity_t cuMemGetAllocationGranularity;
    api::cuMemCreate_t cuMemCreate;
    api::cuMemRelease_t cuMemRelease;
    api::cuMemAddressReserve_t cuMemAddressReserve;
    api::cuMemAddressFree_t cuMemAddressFree;
    api::cuMemMap_t cuMemMap;
    api::cuMemUnmap_t cuMemUnmap;
    api::cuMemSetAccess_t cuMemSetAccess;
    api::cuMemExportToShareableHandle_t cuMemExportToShareableHandle;
    api::cuMemImportFromShareableHandle_t cuMemImportFromShareableHandle;
    api::cuMemRetainAllocationHandle_t cuMemRetainAllocationHandle;
  } fn_{};
  absl::Status NoVmm() const;
  // Looks up the VMM entry points: all, or none (HasVmm() false).
  // Binds the entry points every supported driver has; the names of those
  // it lacks ("" when none).
  static std::string BindRequired(void* handle, Entry* f);
  // Binds those a driver may lack (IPC, events, VMM): null where absent.
  static void BindOptional(void* handle, Entry* f);
  static void BindVmm(void* handle, Entry* f);
  mutable Mutex mu_;
  // Primary contexts retained so far, by ordinal (kept for the process).
  mutable std::vector<api::CUcontext> contexts_ ABSL_GUARDED_BY(mu_);
  // Copy's streams not in use, by ordinal: as many as callers ever copied
  // at once (kept for the process).
  mutable std::vector<std::vector<api::CUstream>> idle_streams_ ABSL_GUARDED_BY(mu_);
  absl::StatusOr<api::CUstream> TakeStream(int ordinal) const;
  void GiveStream(api::CUstream stream, int ordinal) const;
  // ReadDevice's pieces (it takes two at once).
  static constexpr size_t kReadPiece = 1 << 20;
  // Kept pinned buffers, by size.
  mutable std::vector<std::pair<size_t, void*>> kept_pinned_ ABSL_GUARDED_BY(mu_);
  mutable size_t kept_pinned_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace cuda
}  // namespace kvferry

#endif  // KVFERRY_CUDA_DRIVER_H_
