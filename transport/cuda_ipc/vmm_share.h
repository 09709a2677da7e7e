// Sharing VMM device memory (cuMemCreate + cuMemMap, as PyTorch's
// expandable segments allocate) with another process on this host. VMM
// memory has no CUDA IPC memory handle: each chunk's allocation is exported
// as a POSIX fd, and fds cross between processes only over a Unix socket
// (SCM_RIGHTS).
//
// The process that registered the memory serves it: one thread, started on
// first use, answers on an abstract Unix socket "kvferry-vmm-<16 hex
// digits>" (the digits random; links carry them, VmmServer::name()). A
// request names an export id (random, 64 bits, given only to the link
// peers that requests name it to) and gets the region's chunks: their sizes,
// then their fds. Only a process of the same user (SO_PEERCRED; root's
// server serves root only) is answered. Requests arriving are polled
// together (at most kMaxVmmPending, each within kVmmRequestTime): a client
// that trickles its request delays no other; each answer is sent within
// `kVmmTimeout` a message.
//
// The importer maps the chunks back to back (cuMemImportFromShareableHandle,
// cuMemAddressReserve, cuMemMap, cuMemSetAccess) and closes the fds.
#ifndef KVFERRY_TRANSPORT_CUDA_IPC_VMM_SHARE_H_
#define KVFERRY_TRANSPORT_CUDA_IPC_VMM_SHARE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "net/socket.h"

namespace kvferry {
namespace transport {

constexpr absl::Duration kVmmTimeout = absl::Seconds(2);
constexpr absl::Duration kVmmRequestTime = absl::Milliseconds(500);
constexpr size_t kMaxVmmPending = 64;
// At most this many chunks per region (20 MiB chunks: 1.25 TiB).
constexpr uint32_t kMaxVmmChunks = 1 << 16;

class VmmServer {
 public:
  // The process's server, started on first call; null when it cannot start
  // (the error is logged once).
  static VmmServer* Get();

  // What links advertise: the random part of the socket's name.
  uint64_t name() const { return name_; }
  // Makes device memory [addr, +length) of device `ordinal` fetchable;
  // returns its export id. Remove ends that (mappings made already stay).
  uint64_t Add(const void* addr, uint64_t length, int ordinal);
  void Remove(uint64_t id);

 private:
  VmmServer() = default;
  absl::Status Start();
  void Serve();
  struct Pending;
  // Reads more of `p`'s request (`revents`: its poll events) and answers it
  // once whole; true when `p` is done with (answered, refused or gone).
  bool Progress(Pending& p, short revents, absl::Time now);
  // Accepts a connection into pending[0, *count) (same user only; at the
  // cap the oldest goes).
  void AcceptOne(Pending* pending, size_t* count, absl::Time now);
  void Answer(int fd, uint64_t magic, uint64_t id);
  // At exit: the thread ends (joined, so that no thread is left inside the
  // driver while the process goes).
  void Stop();
  struct Export {
    const void* addr;
    uint64_t length;
    int ordinal;
  };
  uint64_t name_ = 0;
  int pid_ = 0;  // the process serving
  net::Fd listener_;
  net::Fd wake_;  // an eventfd: Stop() wakes the server's poll
  Mutex mu_;
  std::map<uint64_t, Export> exports_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stopping_{false};
  std::thread thread_;  // runs until the process exits
};

// Another process's VMM region, mapped here.
struct VmmMapping {
  void* base = nullptr;   // where the chunks are mapped
  uint64_t total = 0;     // their sum
  char* start = nullptr;  // the region's first byte (inside the first chunk)
  uint64_t length = 0;    // the region's length
  int ordinal = -1;       // mapped for this device
};

// Fetches export `id` from the server `name` (on this host) and maps it for
// device `ordinal`. kUnavailable when it cannot be had (no such server or
// export, another user, a driver that refuses), kDataLoss for a reply that
// makes no sense, kDeadlineExceeded for one that takes over 10 s; never
// kInvalidArgument (the transport reserves that for bad requests).
absl::StatusOr<VmmMapping> FetchVmm(uint64_t name, uint64_t id, int ordinal);
void UnmapVmm(const VmmMapping& m);
// Reads a VMM server's reply on the connected socket `fd` as FetchVmm does:
// the chunks' sizes, and their descriptors into `fds` (which the caller
// closes, also on error). For the fuzzer of what a peer's server may send.
absl::Status ReadVmmReply(int fd, std::vector<uint64_t>* sizes, std::vector<int>* fds);
// A connection to the VMM server `name` on this host, with FetchVmm's
// timeouts (for the fuzzer of what a client may send).
absl::StatusOr<net::Fd> ConnectVmmServer(uint64_t name);

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_CUDA_IPC_VMM_SHARE_H_
