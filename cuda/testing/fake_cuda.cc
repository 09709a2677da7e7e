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
//   * virtual memory management (cuMemCreate, cuMemAddressReserve, cuMemMap,
//     cuMemSetAccess: PyTorch's expandable segments): each allocation is a
//     memfd of its own, exported as a POSIX fd (a dup of it) that another
//     process imports; a mapping is PROT_NONE to the CPU like the arena,
//     and copies fail until cuMemSetAccess made it accessible.
//   * copies are asynchronous where NVIDIA documents that they may be
//     ("API synchronization behavior"): a plain cuMemcpy device -> device or
//     pageable host -> device, and every cuMemcpyAsync except the ones the
//     driver documents as synchronous (device -> pageable host), only land
//     when their stream is synchronized (cuStreamSynchronize, an event
//     recorded after them and synchronized, cuCtxSynchronize, a blocking
//     copy on the legacy stream behind them) or, at the latest, a latency
//     after they were queued (a thread of the fake's plays the GPU). Until
//     then the destination holds its old bytes, for this process and for
//     every other one that maps it. A pageable source is staged when the
//     call is made; a pinned or device source is read when the copy runs.
//     Streams run in order; cuLaunchHostFunc's function runs on the GPU
//     thread once the stream's earlier work has landed, and later work on
//     the stream waits for it to return.
// Environment: KVFERRY_FAKE_CUDA_DEVICES (default 2),
// KVFERRY_FAKE_CUDA_PCI ("0000:1B:00.0,..."), KVFERRY_FAKE_CUDA_MIB (arena
// size, default 256), KVFERRY_FAKE_CUDA_VMM_NO_EXPORT=1 (VMM allocations
// exportable as nothing, whatever was asked), KVFERRY_FAKE_CUDA_LATENCY_MS
// (how long queued copies take at most when nobody waits for them, default
// 300; "never": only a synchronization lands them),
// KVFERRY_FAKE_CUDA_PEERMEM=1 (the arena is mapped readable and writable at
// the addresses handed out, so that an RDMA NIC can pin it, as
// nvidia-peermem lets ibv_reg_mr pin GPU memory; kvferry_fake_cuda_hide()
// makes it PROT_NONE again once registered: the NIC keeps its pinned pages,
// the CPU loses access), KVFERRY_FAKE_CUDA_IPC_IN_PROCESS=1 (a process may
// open its own IPC handles, as another process would: the real driver
// refuses with CUDA_ERROR_INVALID_CONTEXT, as this fake does without it; for
// tests that stand two processes' transports in one).
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using CUresult = int;
using CUdeviceptr = unsigned long long;  // NOLINT(runtime/int)

constexpr CUresult kSuccess = 0, kInvalidValue = 1, kOutOfMemory = 2, kNotInitialized = 3,
                   kInvalidDevice = 101, kInvalidContext = 201, kInvalidHandle = 400,
                   kNotFound = 500, kNotReady = 600, kIllegalAddress = 700, kNotSupported = 801;
constexpr size_t kAlign = 64 << 10;

struct Context {
  int device;
};

using Clock = std::chrono::steady_clock;

// Work queued on a stream: a copy, or a host function (cuLaunchHostFunc).
struct Op {
  uint64_t seq = 0;
  Clock::time_point due;
  CUdeviceptr dst = 0, src = 0;
  size_t bytes = 0;
  std::vector<char> staged;  // a pageable source, copied when queued
  bool use_staged = false;
  void (*fn)(void*) = nullptr;
  void* data = nullptr;
};

// A stream's queue; events keep it alive past cuStreamDestroy.
struct Queue {
  int device = 0;
  bool blocking = false;  // created without CU_STREAM_NON_BLOCKING
  bool legacy = false;    // the context's legacy default stream
  std::deque<Op> ops;
  uint64_t queued = 0;     // seq of the last op queued
  uint64_t completed = 0;  // seq of the last op finished
  bool running = false;    // its front host function is running (unlocked)
  CUresult error = 0;      // an asynchronous failure, for the next sync
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
  std::map<size_t, Allocation> allocations;    // by offset in the arena
  std::map<uintptr_t, size_t> pinned;          // cuMemHostAlloc'd, by address
  std::vector<std::shared_ptr<Queue>> queues;  // every stream's, legacy ones first
  std::condition_variable cv;                  // work queued or finished
  bool gpu_running = false;                    // the thread that plays the GPU
  bool latency_never = false;
  Clock::duration latency = std::chrono::milliseconds(300);
  uint64_t deferred = 0;  // copies queued to land later (tests)
  int fd = -1;            // the arena's memfd, kept for other processes' IPC imports
  struct Import {
    size_t size;
    char* alias;
    int device;
    uint64_t handle = 0;     // a VMM mapping of this allocation handle; 0: IPC
    bool accessible = true;  // VMM: cuMemSetAccess was called
  };
  // Another process's allocation (IPC) or a VMM mapping, by address.
  std::map<uintptr_t, Import> imports;
  uint64_t ipc_opens = 0;  // successful cuIpcOpenMemHandle calls
  // VMM allocations by handle; each holds a reference per mapping.
  struct Physical {
    int fd;
    size_t size;
    int device;
    int handle_types;  // requested at cuMemCreate (bit 1: POSIX fd)
    int refs;
    bool imported = false;  // from another process's fd
  };
  std::map<uint64_t, Physical> physical;
  uint64_t last_handle = 0;
  std::map<uintptr_t, size_t> reservations;  // cuMemAddressReserve'd ranges
  uint64_t vmm_imports = 0;                  // cuMemImportFromShareableHandle calls
};

constexpr size_t kGranularity = 2 << 20;  // the VMM granularity, as on NVIDIA GPUs

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
// memory (which must lie in live allocations, imports or accessible VMM
// mappings), p itself for host memory. `*run`: how many of the n bytes are
// contiguous there (VMM mappings next to each other have separate aliases).
CUresult Translate(const State& s, uintptr_t p, size_t n, char** out, size_t* run) {
  *run = n;
  auto imp = s.imports.upper_bound(p);
  if (imp != s.imports.begin()) {
    --imp;
    if (p - imp->first < imp->second.size) {
      if (!imp->second.accessible) return kIllegalAddress;
      const size_t left = imp->second.size - (p - imp->first);
      if (n > left) {
        // Only VMM memory continues into the next mapping.
        auto next = std::next(imp);
        if (imp->second.handle == 0 || next == s.imports.end() ||
            next->first != imp->first + imp->second.size || next->second.handle == 0) {
          return kIllegalAddress;
        }
        *run = left;
      }
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

bool IsPinned(const State& s, uintptr_t p) {
  auto it = s.pinned.upper_bound(p);
  if (it == s.pinned.begin()) return false;
  --it;
  return p - it->first < it->second;
}

bool IsDevice(const State& s, uintptr_t p) {
  if (InArena(s, p)) return true;
  auto imp = s.imports.upper_bound(p);
  return imp != s.imports.begin() && p - std::prev(imp)->first < std::prev(imp)->second.size;
}

// Copies now, mapping by mapping; kInvalidValue for memory that is not
// (all) there.
CUresult CopyNow(const State& s, CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  while (bytes > 0) {
    char* d;
    char* from;
    size_t d_run, from_run;
    if (Translate(s, dst, bytes, &d, &d_run) != kSuccess ||
        Translate(s, src, bytes, &from, &from_run) != kSuccess) {
      return kInvalidValue;
    }
    const size_t n = d_run < from_run ? d_run : from_run;
    std::memmove(d, from, n);
    dst += n;
    src += n;
    bytes -= n;
  }
  return kSuccess;
}

// Whether both ranges are mapped now (checked when a copy is queued).
CUresult CheckCopy(const State& s, CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  for (CUdeviceptr p : {dst, src}) {
    for (size_t left = bytes; left > 0;) {
      char* at;
      size_t run;
      if (Translate(s, p, left, &at, &run) != kSuccess) return kInvalidValue;
      p += run;
      left -= run;
    }
  }
  return kSuccess;
}

void StartGpu(State& s);

// Runs q's front op (the lock held; unlocked around a host function).
void RunFront(State& s, Queue& q, std::unique_lock<std::mutex>& lock) {
  Op op = std::move(q.ops.front());
  if (op.fn != nullptr) {
    q.running = true;
    lock.unlock();
    op.fn(op.data);
    lock.lock();
    q.running = false;
  } else if (op.use_staged) {
    if (CopyNow(s, op.dst, reinterpret_cast<uintptr_t>(op.staged.data()), op.bytes) != kSuccess) {
      q.error = kIllegalAddress;
    }
  } else if (CopyNow(s, op.dst, op.src, op.bytes) != kSuccess) {
    q.error = kIllegalAddress;  // freed under the copy: the sticky error
  }
  q.ops.pop_front();
  q.completed = op.seq;
  s.cv.notify_all();
}

// Lands q's work up to `seq` on this thread (host functions run on the
// GPU thread, as the driver's own thread runs them: this one waits).
void Drain(State& s, Queue& q, uint64_t seq, std::unique_lock<std::mutex>& lock) {
  while (q.completed < seq) {
    if (q.running || (!q.ops.empty() && q.ops.front().fn != nullptr)) {
      if (!q.running) q.ops.front().due = Clock::time_point::min();
      StartGpu(s);
      s.cv.notify_all();
      s.cv.wait(lock);
      continue;
    }
    RunFront(s, q, lock);
  }
}

// A blocking copy on the legacy stream waits for it and for the device's
// blocking streams (the legacy stream's implicit synchronization).
void DrainLegacy(State& s, int device, std::unique_lock<std::mutex>& lock) {
  for (size_t i = 0; i < s.queues.size(); ++i) {
    std::shared_ptr<Queue> q = s.queues[i];
    if (q->device == device && (q->legacy || q->blocking)) Drain(s, *q, q->queued, lock);
  }
}

void DrainAll(State& s, std::unique_lock<std::mutex>& lock) {
  for (size_t i = 0; i < s.queues.size(); ++i) {
    std::shared_ptr<Queue> q = s.queues[i];
    Drain(s, *q, q->queued, lock);
  }
}

void Enqueue(State& s, Queue& q, Op op) {
  op.seq = ++q.queued;
  op.due = op.fn != nullptr  ? Clock::now()
           : s.latency_never ? Clock::time_point::max()
                             : Clock::now() + s.latency;
  if (op.fn == nullptr) ++s.deferred;
  q.ops.push_back(std::move(op));
  StartGpu(s);
  s.cv.notify_all();
}

// The GPU: lands each stream's front op once it is due, in stream order.
void GpuLoop() {
  State& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  for (;;) {
    Clock::time_point next = Clock::time_point::max();
    Queue* ready = nullptr;
    for (const std::shared_ptr<Queue>& q : s.queues) {
      if (q->running || q->ops.empty()) continue;
      if (q->ops.front().due <= Clock::now()) {
        ready = q.get();
        break;
      }
      next = std::min(next, q->ops.front().due);
    }
    if (ready != nullptr) {
      std::shared_ptr<Queue> keep;  // alive while it runs unlocked
      for (const std::shared_ptr<Queue>& q : s.queues) {
        if (q.get() == ready) keep = q;
      }
      RunFront(s, *ready, lock);
      continue;
    }
    if (next == Clock::time_point::max()) {
      s.cv.wait(lock);
    } else {
      s.cv.wait_until(lock, next);
    }
  }
}

void StartGpu(State& s) {
  if (s.gpu_running) return;
  s.gpu_running = true;
  std::thread(GpuLoop).detach();
}

// A stream handle names its queue.
struct Stream {
  std::shared_ptr<Queue> queue;
};

// The queue of a stream argument on the current context: the legacy stream
// for NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD (the fake has one).
std::shared_ptr<Queue> QueueOf(State& s, void* stream) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(stream);
  if (v == 0 || v == 1 || v == 2) return s.queues[current->device];
  return static_cast<Stream*>(stream)->queue;
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
  for (int i = 0; i < s.devices; ++i) {
    s.contexts[i].device = i;
    auto legacy = std::make_shared<Queue>();
    legacy->device = i;
    legacy->legacy = true;
    s.queues.push_back(legacy);
  }
  if (const char* l = std::getenv("KVFERRY_FAKE_CUDA_LATENCY_MS")) {
    if (std::strcmp(l, "never") == 0) {
      s.latency_never = true;
    } else {
      s.latency = std::chrono::milliseconds(std::strtoull(l, nullptr, 10));
    }
  }
  // CUDA allows no use across fork(); the fake's child gets no GPU thread.
  pthread_atfork([] { S().mu.lock(); }, [] { S().mu.unlock(); },
                 [] {
                   S().mu.unlock();
                   S().gpu_running = false;
                 });
  size_t mib = 256;
  if (const char* m = std::getenv("KVFERRY_FAKE_CUDA_MIB")) mib = std::strtoull(m, nullptr, 10);
  s.arena_bytes = mib << 20;
  const int fd = memfd_create("kvferry-fake-cuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, s.arena_bytes) != 0) return kOutOfMemory;
  const char* peermem = std::getenv("KVFERRY_FAKE_CUDA_PEERMEM");
  const int prot = peermem != nullptr && *peermem == '1' ? PROT_READ | PROT_WRITE : PROT_NONE;
  void* arena = mmap(nullptr, s.arena_bytes, prot, MAP_SHARED, fd, 0);
  void* alias = mmap(nullptr, s.arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  s.fd = fd;
  if (arena == MAP_FAILED || alias == MAP_FAILED) return kOutOfMemory;
  s.arena = static_cast<char*>(arena);
  s.alias = static_cast<char*>(alias);
  s.initialized = true;
  return kSuccess;
}

#define KVF_FAKE_READY()                   \
  State& s = S();                          \
  std::unique_lock<std::mutex> lock(s.mu); \
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
  // VMM with POSIX fd handles (102, 103); no dma-buf, no GPUDirect RDMA, ...
  *value = attribute == 102 || attribute == 103 ? 1 : 0;
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
  const bool pinned = !InArena(s, p) && IsPinned(s, p);
  State::Allocation imported{0, 0};
  auto imp = s.imports.upper_bound(p);
  if (a == nullptr && imp != s.imports.begin() &&
      p - std::prev(imp)->first < std::prev(imp)->second.size) {
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
    case 14: {  // ALLOWED_HANDLE_TYPES (4 bytes written; callers zero 8)
      unsigned types = 0;
      if (a == &imported && std::prev(imp)->second.handle != 0) {
        types = s.physical.at(std::prev(imp)->second.handle).handle_types;
      }
      *static_cast<unsigned*>(data) = types;
      return kSuccess;
    }
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
  if (s.allocations.count(ptr - reinterpret_cast<uintptr_t>(s.arena)) == 0) return kInvalidValue;
  DrainAll(s, lock);  // as the driver: the memory's queued copies finish first
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
  s.pinned[reinterpret_cast<uintptr_t>(p)] = bytes;
  *out = p;
  return kSuccess;
}

CUresult cuMemFreeHost(void* p) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (s.pinned.count(reinterpret_cast<uintptr_t>(p)) == 0) return kInvalidValue;
  DrainAll(s, lock);  // copies to or from it land first
  s.pinned.erase(reinterpret_cast<uintptr_t>(p));
  std::free(p);
  return kSuccess;
}

// The legacy stream's copy: device -> device and pageable host -> device
// may return before the copy ran (NVIDIA: "no host-side synchronization";
// the pageable source is staged first); pinned host -> device and anything
// to the host return once it landed, after the legacy stream's earlier
// work.
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (CheckCopy(s, dst, src, bytes) != kSuccess) return kInvalidValue;
  std::shared_ptr<Queue> legacy = QueueOf(s, nullptr);
  const bool to_device = IsDevice(s, dst), from_device = IsDevice(s, src);
  if (to_device && (from_device || !IsPinned(s, src))) {
    Op op;
    op.dst = dst;
    op.src = src;
    op.bytes = bytes;
    if (!from_device) {
      const char* from = reinterpret_cast<const char*>(src);
      op.staged.assign(from, from + bytes);
      op.use_staged = true;
    }
    Enqueue(s, *legacy, std::move(op));
    return kSuccess;
  }
  DrainLegacy(s, current->device, lock);
  return CopyNow(s, dst, src, bytes);
}

CUresult cuIpcGetMemHandle(IpcHandle* h, CUdeviceptr ptr) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (!InArena(s, ptr)) return kInvalidValue;
  auto it = s.allocations.find(ptr - reinterpret_cast<uintptr_t>(s.arena));
  if (it == s.allocations.end()) return kInvalidValue;  // not an allocation's base
  *h = IpcHandle{kIpcMagic,
                 static_cast<uint64_t>(getpid()),
                 static_cast<uint64_t>(s.fd),
                 it->first,
                 it->second.size,
                 static_cast<uint64_t>(it->second.device),
                 {}};
  return kSuccess;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* out, IpcHandle h, unsigned flags) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (h.magic != kIpcMagic || flags != 1) return kInvalidValue;
  const char* in_process = getenv("KVFERRY_FAKE_CUDA_IPC_IN_PROCESS");
  if (h.pid == static_cast<uint64_t>(getpid()) &&
      (in_process == nullptr || strcmp(in_process, "1") != 0)) {
    return kInvalidContext;  // as the driver: not in-process
  }
  const std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return kInvalidValue;
  const size_t size = (h.size + 4095) / 4096 * 4096;
  void* va = mmap(nullptr, size, PROT_NONE, MAP_SHARED, fd, static_cast<off_t>(h.offset));
  void* alias =
      mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(h.offset));
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
  // Copies still queued to or from it fail when they run (the sticky
  // error of their stream's next synchronization).
  auto it = s.imports.find(ptr);
  if (it == s.imports.end() || it->second.handle != 0) return kInvalidValue;
  const size_t size = (it->second.size + 4095) / 4096 * 4096;
  munmap(reinterpret_cast<void*>(it->first), size);
  munmap(it->second.alias, size);
  s.imports.erase(it);
  return kSuccess;
}

CUresult cuStreamCreate(Stream** out, unsigned flags) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (out == nullptr || flags > 1) return kInvalidValue;
  auto q = std::make_shared<Queue>();
  q->device = current->device;
  q->blocking = flags == 0;
  s.queues.push_back(q);
  *out = new Stream{q};
  return kSuccess;
}

CUresult cuStreamSynchronize(Stream* stream) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  std::shared_ptr<Queue> q = QueueOf(s, stream);
  if (q->legacy) {
    DrainLegacy(s, q->device, lock);
  } else {
    Drain(s, *q, q->queued, lock);
  }
  const CUresult e = q->error;
  q->error = kSuccess;
  return e;
}

CUresult cuStreamDestroy_v2(Stream* stream) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (reinterpret_cast<uintptr_t>(stream) <= 2) return kInvalidHandle;
  // The driver lets queued work finish after the call returns: it lands.
  std::shared_ptr<Queue> q = stream->queue;
  Drain(s, *q, q->queued, lock);
  for (auto it = s.queues.begin(); it != s.queues.end(); ++it) {
    if (*it == q) {
      s.queues.erase(it);
      break;
    }
  }
  delete stream;
  return kSuccess;
}

CUresult cuCtxSynchronize() {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  for (size_t i = 0; i < s.queues.size(); ++i) {
    std::shared_ptr<Queue> q = s.queues[i];
    if (q->device == current->device) Drain(s, *q, q->queued, lock);
  }
  return kSuccess;
}

// Queued on the stream, landing later (see the top of this file), except
// device -> pageable host, which the driver documents as returning once
// the copy completed (after the stream's earlier work).
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, Stream* stream) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (CheckCopy(s, dst, src, bytes) != kSuccess) return kInvalidValue;
  std::shared_ptr<Queue> q = QueueOf(s, stream);
  const bool to_device = IsDevice(s, dst), from_device = IsDevice(s, src);
  if (!to_device && !IsPinned(s, dst) && from_device) {
    Drain(s, *q, q->queued, lock);
    return CopyNow(s, dst, src, bytes);
  }
  Op op;
  op.dst = dst;
  op.src = src;
  op.bytes = bytes;
  if (!from_device && !IsPinned(s, src)) {
    const char* from = reinterpret_cast<const char*>(src);
    op.staged.assign(from, from + bytes);
    op.use_staged = true;
  }
  Enqueue(s, *q, std::move(op));
  return kSuccess;
}

// Runs `fn(data)` on the GPU thread once the stream's earlier work landed;
// the stream's later work waits for it to return.
CUresult cuLaunchHostFunc(Stream* stream, void (*fn)(void*), void* data) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (fn == nullptr) return kInvalidValue;
  Op op;
  op.fn = fn;
  op.data = data;
  Enqueue(s, *QueueOf(s, stream), std::move(op));
  return kSuccess;
}

// Events: a point in a stream's queue.
struct Event {
  std::shared_ptr<Queue> queue;  // null: never recorded (complete)
  uint64_t seq = 0;
};

CUresult cuEventCreate(Event** out, unsigned flags) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (out == nullptr || (flags & ~7u) != 0) return kInvalidValue;
  *out = new Event();
  return kSuccess;
}

CUresult cuEventRecord(Event* event, Stream* stream) {
  KVF_FAKE_READY();
  if (current == nullptr) return kInvalidContext;
  if (event == nullptr) return kInvalidHandle;
  event->queue = QueueOf(s, stream);
  event->seq = event->queue->queued;
  return kSuccess;
}

CUresult cuEventQuery(Event* event) {
  KVF_FAKE_READY();
  if (event == nullptr) return kInvalidHandle;
  return event->queue == nullptr || event->queue->completed >= event->seq ? kSuccess : kNotReady;
}

CUresult cuEventSynchronize(Event* event) {
  KVF_FAKE_READY();
  if (event == nullptr) return kInvalidHandle;
  if (event->queue != nullptr) Drain(s, *event->queue, event->seq, lock);
  return kSuccess;
}

CUresult cuEventDestroy_v2(Event* event) {
  KVF_FAKE_READY();
  if (event == nullptr) return kInvalidHandle;
  delete event;
  return kSuccess;
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
      {400, "CUDA_ERROR_INVALID_HANDLE"},
      {500, "CUDA_ERROR_NOT_FOUND"},
      {600, "CUDA_ERROR_NOT_READY"},
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

}  // extern "C"

// Virtual memory management. These need no current context (their docs
// list no CUDA_ERROR_INVALID_CONTEXT).
namespace {

bool ValidProp(const State& s, const void* p) {
  if (p == nullptr) return false;
  int type, handle_types, loc_type, loc_id;
  std::memcpy(&type, static_cast<const char*>(p), 4);
  std::memcpy(&handle_types, static_cast<const char*>(p) + 4, 4);
  std::memcpy(&loc_type, static_cast<const char*>(p) + 8, 4);
  std::memcpy(&loc_id, static_cast<const char*>(p) + 12, 4);
  return type == 1 && loc_type == 1 && loc_id >= 0 && loc_id < s.devices &&
         (handle_types & ~9) == 0;
}

void Release(State& s, uint64_t handle) {
  auto it = s.physical.find(handle);
  if (it == s.physical.end() || --it->second.refs > 0) return;
  close(it->second.fd);
  s.physical.erase(it);
}

// The VMM mapping holding p, or end().
std::map<uintptr_t, State::Import>::iterator MappingAt(State& s, uintptr_t p) {
  auto it = s.imports.upper_bound(p);
  if (it == s.imports.begin()) return s.imports.end();
  --it;
  return p - it->first < it->second.size && it->second.handle != 0 ? it : s.imports.end();
}

}  // namespace

extern "C" {

CUresult cuMemGetAllocationGranularity(size_t* granularity, const void* prop, int option) {
  KVF_FAKE_READY();
  if (granularity == nullptr || !ValidProp(s, prop) || option < 0 || option > 1) {
    return kInvalidValue;
  }
  *granularity = kGranularity;
  return kSuccess;
}

CUresult cuMemCreate(uint64_t* handle, size_t size, const void* prop,
                     unsigned long long flags) {  // NOLINT
  KVF_FAKE_READY();
  if (handle == nullptr || !ValidProp(s, prop) || flags != 0 || size == 0 ||
      size % kGranularity != 0) {
    return kInvalidValue;
  }
  int types, device;
  std::memcpy(&types, static_cast<const char*>(prop) + 4, 4);
  // As PyTorch with TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0: nothing exportable.
  if (const char* e = std::getenv("KVFERRY_FAKE_CUDA_VMM_NO_EXPORT"); e != nullptr && *e == '1') {
    types = 0;
  }
  std::memcpy(&device, static_cast<const char*>(prop) + 12, 4);
  const std::string name = "kvferry-fake-vmm-" + std::to_string(device);
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    return kOutOfMemory;
  }
  *handle = ++s.last_handle;
  s.physical[*handle] = State::Physical{fd, size, device, types, 1};
  return kSuccess;
}

CUresult cuMemRelease(uint64_t handle) {
  KVF_FAKE_READY();
  if (s.physical.count(handle) == 0) return kInvalidValue;
  Release(s, handle);
  return kSuccess;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {  // NOLINT
  KVF_FAKE_READY();
  (void)addr;  // a hint
  if (ptr == nullptr || size == 0 || size % 4096 != 0 || flags != 0 ||
      (alignment & (alignment - 1)) != 0) {
    return kInvalidValue;
  }
  // Aligned to the granularity (or more): reserve extra and trim.
  const size_t align = alignment > kGranularity ? alignment : kGranularity;
  void* raw =
      mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return kOutOfMemory;
  const uintptr_t start = (reinterpret_cast<uintptr_t>(raw) + align - 1) / align * align;
  if (start > reinterpret_cast<uintptr_t>(raw))
    munmap(raw, start - reinterpret_cast<uintptr_t>(raw));
  const uintptr_t end = reinterpret_cast<uintptr_t>(raw) + size + align;
  if (end > start + size) munmap(reinterpret_cast<void*>(start + size), end - start - size);
  s.reservations[start] = size;
  *ptr = start;
  return kSuccess;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  KVF_FAKE_READY();
  auto it = s.reservations.find(ptr);
  if (it == s.reservations.end() || it->second != size) return kInvalidValue;
  auto m = s.imports.lower_bound(ptr);
  if (m != s.imports.end() && m->first < ptr + size) return kInvalidValue;  // still mapped
  munmap(reinterpret_cast<void*>(ptr), size);
  s.reservations.erase(it);
  return kSuccess;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, uint64_t handle,
                  unsigned long long flags) {  // NOLINT
  KVF_FAKE_READY();
  auto ph = s.physical.find(handle);
  if (ph == s.physical.end() || flags != 0 || size == 0 || size % kGranularity != 0 ||
      offset % kGranularity != 0 || offset + size > ph->second.size || ptr % kGranularity != 0) {
    return kInvalidValue;
  }
  auto r = s.reservations.upper_bound(ptr);
  if (r == s.reservations.begin()) return kInvalidValue;
  --r;
  if (ptr + size > r->first + r->second) return kInvalidValue;  // outside any reservation
  auto m = s.imports.lower_bound(ptr);
  if ((m != s.imports.end() && m->first < ptr + size) ||
      (m != s.imports.begin() && std::prev(m)->first + std::prev(m)->second.size > ptr)) {
    return kInvalidValue;  // already mapped
  }
  void* va = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                  ph->second.fd, static_cast<off_t>(offset));
  void* alias = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, ph->second.fd,
                     static_cast<off_t>(offset));
  if (va == MAP_FAILED || alias == MAP_FAILED) return kOutOfMemory;
  State::Import mapping{size, static_cast<char*>(alias), ph->second.device};
  mapping.handle = handle;
  mapping.accessible = false;
  s.imports[ptr] = mapping;
  ++ph->second.refs;
  return kSuccess;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  KVF_FAKE_READY();
  auto it = s.imports.find(ptr);
  if (it == s.imports.end() || it->second.handle == 0) return kInvalidValue;
  for (uintptr_t p = ptr; p < ptr + size;) {  // whole mappings only
    auto m = s.imports.find(p);
    if (m == s.imports.end() || m->second.handle == 0 || p + m->second.size > ptr + size) {
      return kInvalidValue;
    }
    p += m->second.size;
  }
  for (uintptr_t p = ptr; p < ptr + size;) {
    auto m = s.imports.find(p);
    if (m == s.imports.end()) return kInvalidValue;
    const size_t n = m->second.size;
    // Back to reserved, inaccessible address space.
    mmap(reinterpret_cast<void*>(p), n, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    munmap(m->second.alias, n);
    Release(s, m->second.handle);
    s.imports.erase(m);
    p += n;
  }
  return kSuccess;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void* desc, size_t count) {
  KVF_FAKE_READY();
  if (desc == nullptr || count == 0) return kInvalidValue;
  for (size_t i = 0; i < count; ++i) {
    int loc_type, loc_id, flags;
    std::memcpy(&loc_type, static_cast<const char*>(desc) + 12 * i, 4);
    std::memcpy(&loc_id, static_cast<const char*>(desc) + 12 * i + 4, 4);
    std::memcpy(&flags, static_cast<const char*>(desc) + 12 * i + 8, 4);
    if (loc_type != 1 || loc_id < 0 || loc_id >= s.devices || (flags != 1 && flags != 3)) {
      return kInvalidValue;
    }
  }
  for (uintptr_t p = ptr; p < ptr + size;) {  // every byte mapped
    auto m = MappingAt(s, p);
    if (m == s.imports.end()) return kInvalidValue;
    p = m->first + m->second.size;
  }
  for (uintptr_t p = ptr; p < ptr + size;) {
    auto m = MappingAt(s, p);
    m->second.accessible = true;
    p = m->first + m->second.size;
  }
  return kSuccess;
}

CUresult cuMemRetainAllocationHandle(uint64_t* handle, void* addr) {
  KVF_FAKE_READY();
  auto m = MappingAt(s, reinterpret_cast<uintptr_t>(addr));
  if (handle == nullptr || m == s.imports.end()) return kInvalidValue;
  ++s.physical.at(m->second.handle).refs;
  *handle = m->second.handle;
  return kSuccess;
}

CUresult cuMemExportToShareableHandle(void* shareable, uint64_t handle, int type,
                                      unsigned long long flags) {  // NOLINT
  KVF_FAKE_READY();
  auto ph = s.physical.find(handle);
  if (shareable == nullptr || ph == s.physical.end() || flags != 0) return kInvalidValue;
  if (type != 1 || (ph->second.handle_types & 1) == 0) return kNotSupported;
  const int fd = fcntl(ph->second.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return kOutOfMemory;
  *static_cast<int*>(shareable) = fd;
  return kSuccess;
}

CUresult cuMemImportFromShareableHandle(uint64_t* handle, void* os_handle, int type) {
  KVF_FAKE_READY();
  const int fd = static_cast<int>(reinterpret_cast<uintptr_t>(os_handle));
  if (handle == nullptr || type != 1) return kInvalidValue;
  // The fd must be one of this fake's allocations: its name says the device.
  char link[256] = {};
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (readlink(path.c_str(), link, sizeof link - 1) <= 0) return kInvalidValue;
  const char* tag = std::strstr(link, "kvferry-fake-vmm-");
  struct stat st;
  if (tag == nullptr || fstat(fd, &st) != 0 || st.st_size <= 0) return kInvalidValue;
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) return kOutOfMemory;
  *handle = ++s.last_handle;
  s.physical[*handle] = State::Physical{own,
                                        static_cast<size_t>(st.st_size),
                                        std::atoi(tag + std::strlen("kvferry-fake-vmm-")),
                                        1,
                                        1,
                                        /*imported=*/true};
  ++s.vmm_imports;
  return kSuccess;
}

// For tests (not a driver entry point): how many VMM allocations this
// process imported from another's fds.
uint64_t kvferry_fake_cuda_vmm_imports() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.vmm_imports;
}

// For tests (not a driver entry point): takes the CPU's access to the
// arena away again (KVFERRY_FAKE_CUDA_PEERMEM); pages a NIC pinned stay
// pinned.
int kvferry_fake_cuda_hide() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.arena == nullptr ? -1 : mprotect(s.arena, s.arena_bytes, PROT_NONE);
}

// For tests (not a driver entry point): how many of another process's
// allocations this process has mapped now (IPC handles open, VMM chunks
// imported and mapped).
uint64_t kvferry_fake_cuda_live_imports() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  uint64_t n = 0;
  for (const auto& [at, m] : s.imports) {
    if (m.handle == 0 || (s.physical.count(m.handle) > 0 && s.physical.at(m.handle).imported)) ++n;
  }
  return n;
}

// For tests (not a driver entry point): how many copies were queued to
// land later.
uint64_t kvferry_fake_cuda_deferred_copies() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.deferred;
}

// For tests (not a driver entry point): how many IPC handles this process
// opened.
uint64_t kvferry_fake_cuda_ipc_opens() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.ipc_opens;
}

// The legacy 32-bit ABI: using one is a bug in the caller.
#define KVF_FAKE_LEGACY(name)                                                    \
  CUresult name() {                                                              \
    std::fprintf(stderr, "fake libcuda: legacy entry point %s called\n", #name); \
    std::abort();                                                                \
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
