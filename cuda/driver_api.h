// The few types, values and entry points of the CUDA driver API that
// kvferry uses, declared here so that nothing needs CUDA's headers or
// libraries to build. The library is opened at run time (cuda/driver.h).
//
// Every value and signature matches NVIDIA's cuda.h of CUDA 12.6 and 13.0
// (x86-64 Linux); cuda/driver_api_test.cc checks them against cuda.h where
// a toolkit is installed. The names below are the exports to look up: the
// plain names of the functions that have versioned ones (cuMemAlloc,
// cuMemcpyDtoH, ...) are an older 32-bit ABI and must never be used.
#ifndef KVFERRY_CUDA_DRIVER_API_H_
#define KVFERRY_CUDA_DRIVER_API_H_

#include <cstddef>
#include <cstdint>

namespace kvferry {
namespace cuda {
namespace api {

using CUresult = int;  // an enum in cuda.h, int-sized
using CUdevice = int;
using CUdeviceptr = unsigned long long;  // NOLINT(runtime/int): cuda.h's type
struct CUctx_st;
using CUcontext = CUctx_st*;
struct CUstream_st;
using CUstream = CUstream_st*;
struct CUevent_st;
using CUevent = CUevent_st*;
// cuLaunchHostFunc's function (CUDA_CB is empty on Linux).
using CUhostFn = void (*)(void* user_data);

// cuIpcGetMemHandle's handle: 64 opaque bytes, passed by value to
// cuIpcOpenMemHandle_v2.
struct CUipcMemHandle {
  char reserved[64];
};
constexpr unsigned kIpcMemLazyEnablePeerAccess = 0x1;

// Virtual memory management (cuMemCreate/cuMemMap: PyTorch's expandable
// segments). A generic allocation handle, and the structs of cuda.h.
using CUmemGenericAllocationHandle = unsigned long long;  // NOLINT(runtime/int)
struct CUmemLocation {
  int type;  // CUmemLocationType
  int id;    // the device ordinal for kMemLocationTypeDevice
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CUmemAccess_flags
};
struct CUmemAllocationProp {
  int type;                  // CUmemAllocationType
  int requestedHandleTypes;  // CUmemAllocationHandleType bits
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;  // NOLINT(runtime/int)
    unsigned char reserved[4];
  } allocFlags;
};
constexpr int kMemAllocationTypePinned = 1;
constexpr int kMemHandleTypePosixFileDescriptor = 1;
constexpr int kMemLocationTypeDevice = 1;
constexpr int kMemAccessFlagsProtReadWrite = 3;
constexpr int kMemAllocGranularityMinimum = 0;

// CUresult
constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorInvalidValue = 1;
constexpr CUresult kErrorOutOfMemory = 2;
constexpr CUresult kErrorNotInitialized = 3;
constexpr CUresult kErrorStubLibrary = 34;
constexpr CUresult kErrorNoDevice = 100;
constexpr CUresult kErrorInvalidDevice = 101;
constexpr CUresult kErrorInvalidContext = 201;
constexpr CUresult kErrorInvalidHandle = 400;
constexpr CUresult kErrorNotFound = 500;
constexpr CUresult kErrorNotReady = 600;
constexpr CUresult kErrorIllegalAddress = 700;
constexpr CUresult kErrorNotSupported = 801;

// CUpointer_attribute
constexpr int kPointerAttributeMemoryType = 2;     // unsigned int (CUmemorytype)
constexpr int kPointerAttributeDeviceOrdinal = 9;  // int
constexpr int kPointerAttributeRangeStartAddr = 11;  // CUdeviceptr
constexpr int kPointerAttributeRangeSize = 12;       // size_t
constexpr int kPointerAttributeAllowedHandleTypes = 14;  // read 8 zeroed bytes, low bits

// CUmemorytype
constexpr unsigned kMemoryTypeHost = 1;
constexpr unsigned kMemoryTypeDevice = 2;
constexpr unsigned kMemoryTypeArray = 3;
constexpr unsigned kMemoryTypeUnified = 4;

// CUdevice_attribute
constexpr int kDeviceAttributeVirtualMemoryManagementSupported = 102;
constexpr int kDeviceAttributeHandleTypePosixFileDescriptorSupported = 103;
constexpr int kDeviceAttributeGpuDirectRdmaSupported = 116;
constexpr int kDeviceAttributeDmaBufSupported = 124;

// CUmemRangeHandleType
constexpr int kMemRangeHandleTypeDmaBufFd = 1;

// cuMemHostAlloc flags
constexpr unsigned kMemHostAllocPortable = 0x1;

// cuStreamCreate / cuEventCreate flags
constexpr unsigned kStreamNonBlocking = 0x1;
constexpr unsigned kEventDisableTiming = 0x2;

// The entry points, by the name they are exported under.
using cuInit_t = CUresult (*)(unsigned flags);
using cuDriverGetVersion_t = CUresult (*)(int* version);
using cuDeviceGetCount_t = CUresult (*)(int* count);
using cuDeviceGet_t = CUresult (*)(CUdevice* device, int ordinal);
using cuDeviceGetAttribute_t = CUresult (*)(int* value, int attribute, CUdevice device);
using cuDeviceGetPCIBusId_t = CUresult (*)(char* bus_id, int len, CUdevice device);
using cuDevicePrimaryCtxRetain_t = CUresult (*)(CUcontext* ctx, CUdevice device);
using cuDevicePrimaryCtxRelease_v2_t = CUresult (*)(CUdevice device);
using cuCtxSetCurrent_t = CUresult (*)(CUcontext ctx);
using cuCtxGetCurrent_t = CUresult (*)(CUcontext* ctx);
using cuPointerGetAttribute_t = CUresult (*)(void* data, int attribute, CUdeviceptr ptr);
using cuMemGetAddressRange_v2_t = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);
using cuMemGetHandleForAddressRange_t = CUresult (*)(void* handle, CUdeviceptr ptr, size_t size,
                                                     int handle_type,
                                                     unsigned long long flags);  // NOLINT
using cuMemAlloc_v2_t = CUresult (*)(CUdeviceptr* ptr, size_t bytes);
using cuMemFree_v2_t = CUresult (*)(CUdeviceptr ptr);
using cuMemHostAlloc_t = CUresult (*)(void** ptr, size_t bytes, unsigned flags);
using cuMemFreeHost_t = CUresult (*)(void* ptr);
using cuMemcpy_t = CUresult (*)(CUdeviceptr dst, CUdeviceptr src, size_t bytes);
using cuMemcpyAsync_t = CUresult (*)(CUdeviceptr dst, CUdeviceptr src, size_t bytes,
                                     CUstream stream);
using cuStreamCreate_t = CUresult (*)(CUstream* stream, unsigned flags);
using cuStreamSynchronize_t = CUresult (*)(CUstream stream);
using cuStreamDestroy_v2_t = CUresult (*)(CUstream stream);
using cuLaunchHostFunc_t = CUresult (*)(CUstream stream, CUhostFn fn, void* user_data);
using cuEventCreate_t = CUresult (*)(CUevent* event, unsigned flags);
using cuEventRecord_t = CUresult (*)(CUevent event, CUstream stream);
using cuEventSynchronize_t = CUresult (*)(CUevent event);
using cuEventQuery_t = CUresult (*)(CUevent event);
using cuEventDestroy_v2_t = CUresult (*)(CUevent event);
using cuGetErrorName_t = CUresult (*)(CUresult error, const char** name);
using cuIpcGetMemHandle_t = CUresult (*)(CUipcMemHandle* handle, CUdeviceptr ptr);
using cuIpcOpenMemHandle_v2_t = CUresult (*)(CUdeviceptr* ptr, CUipcMemHandle handle,
                                             unsigned flags);
using cuIpcCloseMemHandle_t = CUresult (*)(CUdeviceptr ptr);

using cuMemGetAllocationGranularity_t = CUresult (*)(size_t* granularity,
                                                     const CUmemAllocationProp* prop, int option);
using cuMemCreate_t = CUresult (*)(CUmemGenericAllocationHandle* handle, size_t size,
                                   const CUmemAllocationProp* prop,
                                   unsigned long long flags);  // NOLINT
using cuMemRelease_t = CUresult (*)(CUmemGenericAllocationHandle handle);
using cuMemAddressReserve_t = CUresult (*)(CUdeviceptr* ptr, size_t size, size_t alignment,
                                           CUdeviceptr addr, unsigned long long flags);  // NOLINT
using cuMemAddressFree_t = CUresult (*)(CUdeviceptr ptr, size_t size);
using cuMemMap_t = CUresult (*)(CUdeviceptr ptr, size_t size, size_t offset,
                                CUmemGenericAllocationHandle handle,
                                unsigned long long flags);  // NOLINT
using cuMemUnmap_t = CUresult (*)(CUdeviceptr ptr, size_t size);
using cuMemSetAccess_t = CUresult (*)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                                      size_t count);
using cuMemExportToShareableHandle_t = CUresult (*)(void* shareable,
                                                    CUmemGenericAllocationHandle handle,
                                                    int handle_type,
                                                    unsigned long long flags);  // NOLINT
// `os_handle`: a POSIX fd is passed as its value cast to a pointer.
using cuMemImportFromShareableHandle_t = CUresult (*)(CUmemGenericAllocationHandle* handle,
                                                      void* os_handle, int handle_type);
using cuMemRetainAllocationHandle_t = CUresult (*)(CUmemGenericAllocationHandle* handle,
                                                   void* addr);
}  // namespace api
}  // namespace cuda
}  // namespace kvferry

#endif  // KVFERRY_CUDA_DRIVER_API_H_
