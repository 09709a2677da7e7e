#!/usr/bin/env bash
# Checks cuda/driver_api.h against NVIDIA's own cuda.h and the entry points
# cuda/driver.cc looks up against the toolkit's stub libcuda, where a CUDA
# toolkit is installed (nvcc on PATH or /usr/local/cuda*). Hosts without one
# skip: the project never needs it.
set -euo pipefail
nvcc="$(command -v nvcc || ls -d /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1 || true)"
if [[ -z "$nvcc" ]]; then
  echo "SKIPPED: no CUDA toolkit on this host"
  exit 0
fi
toolkit="$(dirname "$(dirname "$(readlink -f "$nvcc")")")"
# Some toolkit installs (compiler-only packages, pip wheels) carry nvcc but
# not the driver API header or the stub library: find each, skip without.
include=""
for dir in "$toolkit/include" "$toolkit"/targets/*/include "${CUDA_HOME:-/nonexistent}/include" \
           /usr/local/cuda/include /usr/include; do
  if [[ -f "$dir/cuda.h" ]] && grep -q cuPointerGetAttribute "$dir/cuda.h"; then
    include="$dir"
    break
  fi
done
if [[ -z "$include" ]]; then
  echo "SKIPPED: $nvcc found, but no CUDA driver API header (cuda.h) next to it"
  exit 0
fi
stub=""
for f in "$toolkit/lib/stubs/libcuda.so" "$toolkit/lib64/stubs/libcuda.so" \
         "$toolkit"/targets/*/lib/stubs/libcuda.so; do
  if [[ -f "$f" ]]; then stub="$f"; break; fi
done
src="${TEST_SRCDIR}/${TEST_WORKSPACE}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/check.cc" <<'CC'
#include <cuda.h>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include "cuda/driver_api.h"
namespace api = kvferry::cuda::api;
static_assert(api::kSuccess == CUDA_SUCCESS, "");
static_assert(api::kErrorInvalidValue == CUDA_ERROR_INVALID_VALUE, "");
static_assert(api::kErrorOutOfMemory == CUDA_ERROR_OUT_OF_MEMORY, "");
static_assert(api::kErrorNotInitialized == CUDA_ERROR_NOT_INITIALIZED, "");
static_assert(api::kErrorStubLibrary == CUDA_ERROR_STUB_LIBRARY, "");
static_assert(api::kErrorNoDevice == CUDA_ERROR_NO_DEVICE, "");
static_assert(api::kErrorInvalidDevice == CUDA_ERROR_INVALID_DEVICE, "");
static_assert(api::kErrorInvalidContext == CUDA_ERROR_INVALID_CONTEXT, "");
static_assert(api::kErrorNotFound == CUDA_ERROR_NOT_FOUND, "");
static_assert(api::kErrorInvalidHandle == CUDA_ERROR_INVALID_HANDLE, "");
static_assert(api::kErrorNotReady == CUDA_ERROR_NOT_READY, "");
static_assert(api::kStreamNonBlocking == CU_STREAM_NON_BLOCKING, "");
static_assert(api::kEventDisableTiming == CU_EVENT_DISABLE_TIMING, "");
static_assert(api::kErrorIllegalAddress == CUDA_ERROR_ILLEGAL_ADDRESS, "");
static_assert(api::kErrorNotSupported == CUDA_ERROR_NOT_SUPPORTED, "");
static_assert(api::kPointerAttributeMemoryType == CU_POINTER_ATTRIBUTE_MEMORY_TYPE, "");
static_assert(api::kPointerAttributeDeviceOrdinal == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, "");
static_assert(api::kPointerAttributeRangeStartAddr == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, "");
static_assert(api::kPointerAttributeRangeSize == CU_POINTER_ATTRIBUTE_RANGE_SIZE, "");
static_assert(api::kMemoryTypeHost == CU_MEMORYTYPE_HOST, "");
static_assert(api::kMemoryTypeDevice == CU_MEMORYTYPE_DEVICE, "");
static_assert(api::kMemoryTypeArray == CU_MEMORYTYPE_ARRAY, "");
static_assert(api::kMemoryTypeUnified == CU_MEMORYTYPE_UNIFIED, "");
static_assert(api::kDeviceAttributeGpuDirectRdmaSupported ==
              CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, "");
static_assert(api::kDeviceAttributeDmaBufSupported == CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, "");
static_assert(api::kDeviceAttributeVirtualMemoryManagementSupported ==
              CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "");
static_assert(api::kDeviceAttributeHandleTypePosixFileDescriptorSupported ==
              CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, "");
static_assert(api::kMemRangeHandleTypeDmaBufFd == CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, "");
static_assert(api::kMemHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE, "");
static_assert(sizeof(api::CUdeviceptr) == sizeof(CUdeviceptr), "");
static_assert(sizeof(api::CUdevice) == sizeof(CUdevice), "");
static_assert(sizeof(api::CUresult) == sizeof(CUresult), "");
static_assert(sizeof(api::CUipcMemHandle) == sizeof(CUipcMemHandle), "");
static_assert(api::kIpcMemLazyEnablePeerAccess == CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, "");
static_assert(api::kPointerAttributeAllowedHandleTypes ==
              CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, "");
static_assert(sizeof(api::CUmemGenericAllocationHandle) == sizeof(CUmemGenericAllocationHandle), "");
static_assert(sizeof(api::CUmemLocation) == sizeof(CUmemLocation), "");
static_assert(offsetof(api::CUmemLocation, id) == offsetof(CUmemLocation, id), "");
static_assert(sizeof(api::CUmemAccessDesc) == sizeof(CUmemAccessDesc), "");
static_assert(offsetof(api::CUmemAccessDesc, flags) == offsetof(CUmemAccessDesc, flags), "");
static_assert(sizeof(api::CUmemAllocationProp) == sizeof(CUmemAllocationProp), "");
static_assert(offsetof(api::CUmemAllocationProp, requestedHandleTypes) ==
              offsetof(CUmemAllocationProp, requestedHandleTypes), "");
static_assert(offsetof(api::CUmemAllocationProp, location) ==
              offsetof(CUmemAllocationProp, location), "");
static_assert(offsetof(api::CUmemAllocationProp, win32HandleMetaData) ==
              offsetof(CUmemAllocationProp, win32HandleMetaData), "");
static_assert(offsetof(api::CUmemAllocationProp, allocFlags) ==
              offsetof(CUmemAllocationProp, allocFlags), "");
static_assert(api::kMemAllocationTypePinned == CU_MEM_ALLOCATION_TYPE_PINNED, "");
static_assert(api::kMemHandleTypePosixFileDescriptor ==
              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, "");
static_assert(api::kMemLocationTypeDevice == CU_MEM_LOCATION_TYPE_DEVICE, "");
static_assert(api::kMemAccessFlagsProtReadWrite == CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "");
static_assert(api::kMemAllocGranularityMinimum == CU_MEM_ALLOC_GRANULARITY_MINIMUM, "");
// The VMM entry points' parameters, as cuda.h declares them (cuda.h's
// CUresult is an enum, the project's an int of the same size).
template <class F> struct Params;
template <class R, class... A> struct Params<R (*)(A...)> { using type = std::tuple<A...>; };
#define KVF_SAME_PARAMS(name) \
  static_assert(std::is_same<Params<api::name##_t>::type, Params<decltype(&name)>::type>::value, #name)
KVF_SAME_PARAMS(cuMemMap);
KVF_SAME_PARAMS(cuMemUnmap);
KVF_SAME_PARAMS(cuMemAddressFree);
KVF_SAME_PARAMS(cuMemAddressReserve);
KVF_SAME_PARAMS(cuMemRelease);
KVF_SAME_PARAMS(cuMemRetainAllocationHandle);
// The stream and event entry points (opaque handle types compared by size).
static_assert(std::tuple_size<Params<api::cuLaunchHostFunc_t>::type>::value ==
              std::tuple_size<Params<decltype(&cuLaunchHostFunc)>::type>::value, "");
static_assert(std::is_same<std::tuple_element<1, Params<decltype(&cuLaunchHostFunc)>::type>::type,
                           void (*)(void*)>::value, "cuLaunchHostFunc's CUhostFn");
static_assert(sizeof(api::CUevent) == sizeof(CUevent), "");
int main() {}
CC
g++ -std=c++17 -fsyntax-only -I"$include" -I"$src" "$tmp/check.cc"
echo "driver_api.h agrees with $include/cuda.h"
# Every name driver.cc looks up is exported by the driver (the stub has
# the real driver's symbol table).
if [[ -z "$stub" ]]; then
  echo "no stub libcuda.so in $toolkit: entry-point check skipped"
  exit 0
fi
exports="$(nm -D --defined-only "$stub" | awk '{print $3}')"
missing=0
names="$(grep -oE '(bind|optional)\(f(\.|->)[A-Za-z0-9_]*, "[A-Za-z0-9_]*"\)' "$src/cuda/driver.cc" |
         sed 's/.*"\(.*\)")/\1/')"
if [[ "$(wc -w <<<"$names")" -lt 10 ]]; then
  echo "found only $(wc -w <<<"$names") lookups in driver.cc: this check is out of date"
  exit 1
fi
for name in $names; do
  if ! grep -qx "$name" <<<"$exports"; then
    echo "driver.cc looks up $name, which $stub does not export"
    missing=1
  fi
done
[[ "$missing" == 0 ]] && echo "all $(wc -w <<<"$names") entry points driver.cc looks up are exported by $stub"
exit "$missing"
