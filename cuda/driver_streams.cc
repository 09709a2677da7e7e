// Driver: streams, events, host functions and plain allocations.
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cuda/driver.h"

namespace kvferry {
namespace cuda {

absl::Status Driver::LaunchHostFunc(void* stream, int ordinal, void (*fn)(void*),
                                    void* data) const {
  if (fn_.cuLaunchHostFunc == nullptr) {
    return absl::UnimplementedError(absl::StrCat("the CUDA driver (version ", version_,
                                                 ") has no cuLaunchHostFunc (needs 10.0)"));
  }
  Bound bound(this, ordinal);
  if (!bound.status().ok()) return bound.status();
  const api::CUresult r = fn_.cuLaunchHostFunc(static_cast<api::CUstream>(stream), fn, data);
  return r == api::kSuccess ? absl::OkStatus() : Error("cuLaunchHostFunc", r);
}

absl::StatusOr<void*> Driver::RecordEvent(void* stream, int ordinal) const {
  if (fn_.cuEventCreate == nullptr || fn_.cuEventRecord == nullptr || fn_.cuEventQuery == nullptr ||
      fn_.cuEventSynchronize == nullptr || fn_.cuEventDestroy_v2 == nullptr) {
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
