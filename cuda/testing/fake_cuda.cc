// A fake CUDA driver library for tests on hosts without a GPU. It exports
// the driver's entry points that kvferry uses, under the same names and
// prototypes (cuda/driver_api.h, checked against NVIDIA's headers), over
// host memory:
//   * "device" memory lies in an arena that is mapped PROT_NONE at the
//     addresses handed out: any CPU access to it by the code under test
//     crashes. Only this library's copy functions touch it, through a
//     second, private read-write mapping of the same pages;
//   * calls that need a context fail with CUDA_ERROR_INVALID_CONTEXT (201)
//     on a thread with no current context, and every call before cuInit
//     with CUDA_ERROR_NOT_INITIALIZED (3), as the real driver does;
//   * the old 32-bit entry points (cuMemAlloc, cuMemcpyDtoH, ...) abort;
//   * CUDA IPC between processes: the arena is a memfd; a handle names the
//     exporting process, the fd and the allocation, and another process
//     maps the same pages (through /proc/PID/fd) PROT_NONE plus a private
//     alias, as for its own device memory.
// Environment: KVFERRY_FAKE_CUDA_DEVICES (default 2),
// KVFERRY_FAKE_CUDA_PCI ("0000:1B:00.0,..."), KVFERRY_FAKE_CUDA_MIB (arena
// size, default 256).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <iterator>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace {

using CUresult = int;
using CUdeviceptr = unsigned long long;  // NOLINT(runtime/int)

constexpr CUresult kSuccess = 0, kInvalidValue = 1, kOutOfMemory = 2, kNotInitialized = 3,
                   kInvalidDevice = 101, kInvalidContext = 201, kNotFound = 500,
                   kIllegalAddress = 700, kNotSupported = 801;
constexpr size_t kAlign = 64 << 10;

struct Context {
  int device;
};

struct State {
  std::mutex mu;
  bool initialized = false;
  int devices = 2;
  std::vector<std::string> pci;
  std::vector<Context> contexts;
  char* arena = nullptr;  // the addresses handed out, PROT_NONE
  char* alias = nullptr;  // the same pages, read-write, for the copies
  size_t arena_bytes = 0;
  struct Allocation {
    size_t size;
    int device;
  };
  std::map<size_t, Allocation> allocations;  // by offset in the arena
  std::set<void*> pinned;
  int fd = -1;  // the arena's memfd, kept for other processes' IPC imports
  struct Import {
    size_t size;
    char* alias;
    int device;
  };
  std::map<uintptr_t, Import> imports;  // another process's allocation, by address
  uint64_t ipc_opens = 0;               // successful cuIpcOpenMemHandle calls
};

struct IpcHandle {  // the 64 bytes of a CUipcMemHandle
  uint64_t magic;
  uint64_t pid;
  uint64_t fd;
  uint64_t offset;
  uint64_t size;
  uint64_t device;
  uint64_t unused[2];
};
static_assert(sizeof(IpcHandle) == 64, "CUipcMemHandle is 64 bytes");
constexpr uint64_t kIpcMagic = 0x6b76666572727931ull;

State& S() {
  static State* s = new State();
  return *s;
}

thread_local Context* current = nullptr;

bool InArena(const State& s, uintptr_t p) {
  return p >= reinterpret_cast<uintptr_t>(s.arena) &&
         p < reinterpret_cast<uintptr_t>(s.arena) + s.arena_bytes;
}

// The live allocation holding arena address p, or null.
const State::Allocation* Find(const State& s, uintptr_t p, size_t* base_off) {
  const size_t off = p - reinterpret_cast<uintptr_t>(s.arena);
  auto it = s.allocations.upper_bound(off);
  if (it == s.allocations.begin()) return nullptr;
  --it;
  if (off - it->first >= it->second.size) return nullptr;
  *base_off = it->first;
  return &it->second;
}

// Where the copy functions read or write [p, +n): the alias for device
// memory (which must lie in one live allocation or import), p itself for
// host memory.
CUresult Translate(const State& s, uintptr_t p, size_t n, char** out) {
  auto imp = s.imports.upper_bound(p);
  if (imp != s.imports.begin()) {
    --imp;
    if (p - imp->first < imp->second.size) {
      if (p - imp->first + n > imp->second.size) return kIllegalAddress;
      *out = imp->second.alias + (p - imp->first);
      return kSuccess;
    }
  }
  if (!InArena(s, p)) {
    *out = reinterpret_cast<char*>(p);
    return kSuccess;
  }
  size_t base;
  const State::Allocation* a = Find(s, p, &base);
  const size_t off = p - reinterpret_cast<uintptr_t>(s.arena);
  if (a == nullptr || off + n > base + a->size) return kIllegalAddress;
  *out = s.alias + off;
  return kSuccess;
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned flags) {
  if (flags != 0) return kInvalidValue;
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.initialized) return kSuccess;
  if (const char* d = std::getenv("KVFERRY_FAKE_CUDA_DEVICES")) s.devices = std::atoi(d);
  std::string pci = "0000:1B:00.0,0000:3D:00.0,0000:5E:00.0,0000:7F:00.0";
  if (const char* p = std::getenv("KVFERRY_FAKE_CUDA_PCI")) pci = p;
  for (size_t start = 0; start <= pci.size();) {
    const size_t comma = pci.find(',', start);
    const size_t end = comma == std::string::npos ? pci.size() : comma;
    if (end > start) s.pci.push_back(pci.substr(start, end - start));
    start = end + 1;
  }
  s.contexts.resize(s.devices);
  for (int i = 0; i < s.devices; ++i) s.contexts[i].device = i;
  size_t mib = 256;
  if (const char* m = std::getenv("KVFERRY_FAKE_CUDA_MIB")) mib = std::strtoull(m, nullptr, 10);
  s.arena_bytes = mib << 20;
  const int fd = memfd_create("kvferry-fake-cuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, s.arena_bytes) != 0) return kOutOfMemory;
  void* arena = mmap(nullptr, s.arena_bytes, PROT_NONE, MAP_SHARED, fd, 0);
  void* alias = mmap(nullptr, s.arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  s.fd = fd;
  if (arena == MAP_FAILED || alias == MAP_FAILED) return kOutOfMemory;
  s.arena = static_cast<char*>(arena);
  s.alias = static_cast<char*>(alias);
  s.initialized = true;
  return kSuccess;
}

#define KVF_FAKE_READY()                        \
  State& s = S();                               \
  std::lock_guard<std::mutex> lock(s.mu);       \
  if (!s.initialized) return kNotInitialized

CUresult cuDriverGetVersion(int* v) {
  if (v == nullptr) return kInvalidValue;
  *v = 12060;  // needs no cuInit
  return kSuccess;
}

CUresult cuDeviceGetCount(int* count) {
  KVF_FAKE_READY();
  *count = s.devices;
  return kSuccess;
}

CUresult cuDeviceGet(int* dev, int ordinal) {
  KVF_FAKE_READY();
  if (ordinal < 0 || ordinal >= s.devices) return kInvalidDevice;
  *dev = ordinal;
  return kSuccess;
}

CUresult cuDeviceGetAttribute(int* value, int attribute, int dev) {
  KVF_FAKE_READY();
  if (dev < 0 || dev >= s.devices) return kInvalidDevice;
  (void)attribute;
  *value = 0;  // no dma-buf, no GPUDirect RDMA, ...
  return kSuccess;
}

CUresult cuDeviceGetPCIBusId(char* id, int len, int dev) {
  KVF_FAKE_READY();
  if (dev < 0 || dev >= s.devices) return kInvalidDevice;
  const std::string v = dev < static_cast<int>(s.pci.size()) ? s.pci[dev] : "0000:00:00.0";
  if (len <= static_cast<int>(v.size())) return kInvalidValue;
  std::memcpy(id, v.c_str(), v.size() + 1);
  return kSuccess;
}

CUresult cuDevicePrimaryCtxRetain(Context** ctx, int dev) {
  KVF_FAKE_READY();
  if (dev < 0 || dev >= s.devices) return kInvalidDevice;
  *ctx = &s.contexts[dev];
  return kSuccess;
}

CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
  KVF_FAKE_READY();
  return dev < 0 || dev >= s.devices ? kInvalidDevice : kSuccess;
}

CUresult cuCtxSetCurrent(Context* ctx) {
  KVF_FAKE_READY();
  current = ctx;
  return kSuccess;
}

CUresult cuCtxGetCurrent(Context** ctx) {
  KVF_FAKE_READY();
  *ctx = current;
  return kSuccess;
}

CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr ptr) {
  KVF_FAKE_READY();
  const uintptr_t p = ptr;
  size_t base;
  const State::Allocation* a = InArena(s, p) ? Find(s, p, &base) : nullptr;
  const bool pinned = !InArena(s, p) && s.pinned.count(reinterpret_cast<void*>(p)) > 0;
  State::Allocation imported{0, 0};
  auto imp = s.imports.upper_bound(p);
  if (a == nullptr && imp != s.imports.begin() && p - std::prev(imp)->first < std::prev(imp)->second.size) {
    imported.device = std::prev(imp)->second.device;
    a = &imported;
  }
  if (a == nullptr && !pinned) return kInvalidValue;  // memory CUDA never saw
  switch (attribute) {
    case 2:  // MEMORY_TYPE
      *static_cast<unsigned*>(data) = a != nullptr ? 2 : 1;
      return kSuccess;
    case 9:  // DEVICE_ORDINAL
      *static_cast<int*>(data) = a != nullptr ? a->device : 0;
      return kSuccess;
    default:
      return kInvalidValue;
  }
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr* pbase, size_t* psize, CUdeviceptr ptr) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  auto imp = s.imports.upper_bound(ptr);
  if (imp != s.imports.begin() && ptr - std::prev(imp)->first < std::prev(imp)->second.size) {
    --imp;
    if (pbase != nullptr) *pbase = imp->first;
    if (psize != nullptr) *psize = imp->second.size;
    return kSuccess;
  }
  size_t base;
  const State::Allocation* a = InArena(s, ptr) ? Find(s, ptr, &base) : nullptr;
  if (a == nullptr) return kNotFound;
  if (pbase != nullptr) *pbase = reinterpret_cast<uintptr_t>(s.arena) + base;
  if (psize != nullptr) *psize = a->size;
  return kSuccess;
}

CUresult cuMemGetHandleForAddressRange(void*, CUdeviceptr, size_t, int,
                                       unsigned long long) {  // NOLINT
  KVF_FAKE_READY();
  return kNotSupported;  // no dma-buf in the fake
}

CUresult cuMemAlloc_v2(CUdeviceptr* out, size_t bytes) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (bytes == 0) return kInvalidValue;
  const size_t size = (bytes + kAlign - 1) / kAlign * kAlign;
  size_t off = 0;  // first fit
  for (const auto& [o, a] : s.allocations) {
    if (o - off >= size) break;
    off = o + (a.size + kAlign - 1) / kAlign * kAlign;
  }
  if (off + size > s.arena_bytes) return kOutOfMemory;
  s.allocations[off] = State::Allocation{bytes, current->device};
  *out = reinterpret_cast<uintptr_t>(s.arena) + off;
  return kSuccess;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (!InArena(s, ptr)) return kInvalidValue;
  auto it = s.allocations.find(ptr - reinterpret_cast<uintptr_t>(s.arena));
  if (it == s.allocations.end()) return kInvalidValue;
  std::memset(s.alias + it->first, 0xdd, it->second.size);  // freed: garbage
  s.allocations.erase(it);
  return kSuccess;
}

CUresult cuMemHostAlloc(void** out, size_t bytes, unsigned flags) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (bytes == 0 || (flags & ~7u) != 0) return kInvalidValue;
  void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (p == nullptr) return kOutOfMemory;
  s.pinned.insert(p);
  *out = p;
  return kSuccess;
}

CUresult cuMemFreeHost(void* p) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (s.pinned.erase(p) == 0) return kInvalidValue;
  std::free(p);
  return kSuccess;
}

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  char* d;
  char* from;
  if (Translate(s, dst, bytes, &d) != kSuccess || Translate(s, src, bytes, &from) != kSuccess) {
    return kInvalidValue;
  }
  std::memmove(d, from, bytes);
  return kSuccess;
}

CUresult cuIpcGetMemHandle(IpcHandle* h, CUdeviceptr ptr) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (!InArena(s, ptr)) return kInvalidValue;
  auto it = s.allocations.find(ptr - reinterpret_cast<uintptr_t>(s.arena));
  if (it == s.allocations.end()) return kInvalidValue;  // not an allocation's base
  *h = IpcHandle{kIpcMagic, static_cast<uint64_t>(getpid()), static_cast<uint64_t>(s.fd),
                 it->first, it->second.size, static_cast<uint64_t>(it->second.device), {}};
  return kSuccess;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* out, IpcHandle h, unsigned flags) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (h.magic != kIpcMagic || flags != 1) return kInvalidValue;
  if (h.pid == static_cast<uint64_t>(getpid())) return kInvalidContext;  // as the driver: not in-process
  const std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return kInvalidValue;
  const size_t size = (h.size + 4095) / 4096 * 4096;
  void* va = mmap(nullptr, size, PROT_NONE, MAP_SHARED, fd, static_cast<off_t>(h.offset));
  void* alias = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                     static_cast<off_t>(h.offset));
  close(fd);
  if (va == MAP_FAILED || alias == MAP_FAILED) return kOutOfMemory;
  s.imports[reinterpret_cast<uintptr_t>(va)] =
      State::Import{h.size, static_cast<char*>(alias), static_cast<int>(h.device)};
  ++s.ipc_opens;
  *out = reinterpret_cast<uintptr_t>(va);
  return kSuccess;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  auto it = s.imports.find(ptr);
  if (it == s.imports.end()) return kInvalidValue;
  const size_t size = (it->second.size + 4095) / 4096 * 4096;
  munmap(reinterpret_cast<void*>(it->first), size);
  munmap(it->second.alias, size);
  s.imports.erase(it);
  return kSuccess;
}

// Streams: the fake copies at once, so a stream is a token and waiting on
// it returns at once; the context rules are the driver's.
struct Stream {
  int device;
};

CUresult cuStreamCreate(Stream** out, unsigned flags) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (flags > 1) return kInvalidValue;
  *out = new Stream{current->device};
  return kSuccess;
}

CUresult cuStreamSynchronize(Stream* stream) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  return stream == nullptr || stream->device >= 0 ? kSuccess : kInvalidValue;
}

CUresult cuStreamDestroy_v2(Stream* stream) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  delete stream;
  return kSuccess;
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, Stream* stream) {
  (void)stream;
  return cuMemcpy(dst, src, bytes);
}

CUresult cuGetErrorName(CUresult error, const char** name) {
  static const std::map<int, const char*> names = {
      {0, "CUDA_SUCCESS"},
      {1, "CUDA_ERROR_INVALID_VALUE"},
      {2, "CUDA_ERROR_OUT_OF_MEMORY"},
      {3, "CUDA_ERROR_NOT_INITIALIZED"},
      {34, "CUDA_ERROR_STUB_LIBRARY"},
      {100, "CUDA_ERROR_NO_DEVICE"},
      {101, "CUDA_ERROR_INVALID_DEVICE"},
      {201, "CUDA_ERROR_INVALID_CONTEXT"},
      {500, "CUDA_ERROR_NOT_FOUND"},
      {700, "CUDA_ERROR_ILLEGAL_ADDRESS"},
      {801, "CUDA_ERROR_NOT_SUPPORTED"},
  };
  auto it = names.find(error);
  if (it == names.end()) {
    *name = nullptr;
    return kInvalidValue;
  }
  *name = it->second;
  return kSuccess;
}

// For tests (not a driver entry point): how many IPC handles this process
// opened.
uint64_t kvferry_fake_cuda_ipc_opens() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.ipc_opens;
}

// The legacy 32-bit ABI: using one is a bug in the caller.
#define KVF_FAKE_LEGACY(name)                                                       \
  CUresult name() {                                                                 \
    std::fprintf(stderr, "fake libcuda: legacy entry point %s called\n", #name);   \
    std::abort();                                                                   \
  }
KVF_FAKE_LEGACY(cuMemAlloc)
KVF_FAKE_LEGACY(cuMemFree)
KVF_FAKE_LEGACY(cuMemAllocHost)
KVF_FAKE_LEGACY(cuMemcpyHtoD)
KVF_FAKE_LEGACY(cuMemcpyDtoH)
KVF_FAKE_LEGACY(cuMemcpyDtoD)
KVF_FAKE_LEGACY(cuMemGetAddressRange)
KVF_FAKE_LEGACY(cuCtxCreate)

}  // extern "C"
