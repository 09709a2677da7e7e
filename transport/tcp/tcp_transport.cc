#include "transport/tcp/tcp_transport.h"

#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/clock.h"
#include "base/errno_status.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/scratch.h"
#include "base/thread_cache.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "transport/checks.h"
#include "transport/completion_queue.h"
#include "transport/link_params.h"
#include "transport/tcp/hello_acceptor.h"
#include "transport/tcp/stream_reader.h"
#include "transport/tcp/vmm_share.h"
#include "transport/tcp/wire.h"
#include "transport/id_window.h"


namespace kvferry {
namespace transport {
namespace {

using tcp_wire::DataHeader;
using tcp_wire::DecodeLinkParams;
using tcp_wire::EncodeLinkParams;
using tcp_wire::kAckNow;
using tcp_wire::kReadReq;
using tcp_wire::kReadResp;
using tcp_wire::kViaIpc;
using tcp_wire::kViaVmm;
using tcp_wire::kWriteAck;
using tcp_wire::kWriteReq;
using tcp_wire::PeerParams;

constexpr uint32_t kMaxErrorText = 1024;
// The writer sends up to this many queued messages with one sendmsg.
constexpr size_t kMaxJobsPerSend = 64;
// A Post on an idle link of at most this many bytes is sent by the posting
// thread itself (no hand-off to the writer thread).
constexpr uint64_t kInlineSendBytes = 16 << 10;
// A responder acknowledges WRITEs in runs: up to the last request of each
// Post on the link (kAckNow), and at most this many requests or bytes.
constexpr uint64_t kMaxAckRun = 32;
constexpr uint64_t kMaxAckRunBytes = 1 << 20;
// Answers a responder queues for one link before it drops a peer that does
// not read them, in units of max_outstanding_per_link.
constexpr uint32_t kAnswerQueueFactor = 2;

// The requester's device memory of a kViaIpc request: its allocation's IPC
// handle and the offset of the request's bytes in it.
struct IpcRef {
  cuda::api::CUipcMemHandle handle;
  uint64_t offset = 0;
};
static_assert(sizeof(IpcRef) == 72, "wire IPC reference size");

// This host's identity (its kernel's boot id, which the containers on a
// host share): links between two transports on one host may use CUDA IPC.
// The CPUs this process may run on (its affinity mask: taskset, cpusets).
uint32_t UsableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return static_cast<uint32_t>(CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

uint64_t HostId() {
  static const uint64_t id = [] {
    FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f == nullptr) return uint64_t{0};
    char buf[64] = {};
    const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(buf[i])) * 1099511628211ull;
    return n > 0 ? h : 0;
  }();
  return id;
}

// The sanitizers' sendmsg interceptor checks the sent bytes after the call
// returns, when a peer in the same process may already have completed the
// request and freed the buffer; and ThreadSanitizer cannot see that bytes
// handed to send() in one thread are what recv() returns in another. Under
// ASan/TSan only, data is therefore copied to a private buffer before
// sending, and (TSan) a release after every send / acquire after every
// receive records the ordering the kernel provides.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVFERRY_SANITIZED_IO 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVFERRY_SANITIZED_IO 1
#endif
#if defined(KVFERRY_SANITIZED_IO)
constexpr bool kCopyBeforeSend = true;
#else
constexpr bool kCopyBeforeSend = false;
#endif
#if defined(__SANITIZE_THREAD__)
std::atomic<uint64_t> wire_epoch{0};
void AfterSend() { wire_epoch.fetch_add(1, std::memory_order_release); }
void AfterRecv() { (void)wire_epoch.load(std::memory_order_acquire); }
#else
void AfterSend() {}
void AfterRecv() {}
#endif

// Reads from a link's stream (its reader thread only).
absl::Status ReadStream(StreamReader& in, void* dst, size_t n) {
  absl::Status s = in.Read(dst, n);
  AfterRecv();
  return s;
}

// Drops the first `skip` bytes of the iovec array (already sent).
void SkipBytes(iovec*& iov, int& count, size_t skip) {
  while (count > 0 && skip >= iov->iov_len) {
    skip -= iov->iov_len;
    ++iov;
    --count;
  }
  if (count > 0 && skip > 0) {
    iov->iov_base = static_cast<char*>(iov->iov_base) + skip;
    iov->iov_len -= skip;
  }
}

// Sends the iovecs; `wait` false: only what the socket takes now (*sent
// says how much). Under the sanitizers the bytes are copied first, so the
// reads of request buffers happen here, where the race detector sees them.
absl::Status SendIov(int fd, iovec* iov, int count, bool wait, size_t* sent) {
  std::string copy;
  iovec flat;
  if (kCopyBeforeSend) {
    for (int i = 0; i < count; ++i) {
      copy.append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
    }
    flat = {copy.data(), copy.size()};
    iov = &flat;
    count = 1;
  }
  *sent = 0;
  const int flags = MSG_NOSIGNAL | (wait ? 0 : MSG_DONTWAIT);
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    const ssize_t w = ::sendmsg(fd, &msg, flags);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (!wait && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      return absl::UnavailableError(ErrnoError(errno, "send").message());
    }
    *sent += static_cast<size_t>(w);
    SkipBytes(iov, count, static_cast<size_t>(w));
  }
  AfterSend();
  return absl::OkStatus();
}

absl::Status SendAll(int fd, iovec* iov, int count) {
  size_t sent;
  return SendIov(fd, iov, count, /*wait=*/true, &sent);
}

// Pinned host buffers through which a link sends or receives device
// memory, the CPU never touching it: two of 256 KiB, so that the driver
// copies one chunk while the socket carries the other (copies queued on a
// stream of the device). Made on first use; one per direction per link, so
// nothing is allocated per request.
class Staging {
 public:
  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    const cuda::Driver* d = cuda::Driver::Get();
    if (d == nullptr) return;
    for (size_t i = 0; i < streams_.size(); ++i) d->DestroyStream(streams_[i], static_cast<int>(i));
    if (buffer_ != nullptr) d->FreePinned(buffer_);
  }
  // Sends [src, +n) of CUDA device `device` on `fd`: chunk k+1 is copied
  // to one buffer while chunk k is sent from the other.
  absl::Status Send(int fd, const void* src, uint64_t n, int device) {
    ASSIGN_OR_RETURN(void* stream, Ready(device));
    const cuda::Driver* d = cuda::Driver::Get();
    const char* from = static_cast<const char*>(src);
    RETURN_IF_ERROR(d->CopyAsync(Half(0), from, std::min<uint64_t>(kBytes, n), stream, device));
    RETURN_IF_ERROR(d->Synchronize(stream, device));
    int cur = 0;
    for (uint64_t off = 0; off < n;) {
      const size_t len = std::min<uint64_t>(kBytes, n - off);
      const uint64_t next = off + len;
      if (next < n) {
        RETURN_IF_ERROR(d->CopyAsync(Half(1 - cur), from + next,
                                     std::min<uint64_t>(kBytes, n - next), stream, device));
      }
      iovec v{Half(cur), len};
      const absl::Status sent = SendAll(fd, &v, 1);
      const absl::Status copied = next < n ? d->Synchronize(stream, device) : absl::OkStatus();
      RETURN_IF_ERROR(sent);
      RETURN_IF_ERROR(copied);
      off = next;
      cur = 1 - cur;
    }
    return absl::OkStatus();
  }
  // Receives n bytes from `in` into [dst, +n) of CUDA device `device`:
  // chunk k+1 arrives in one buffer while chunk k is copied from the other.
  absl::Status Recv(StreamReader& in, void* dst, uint64_t n, int device) {
    ASSIGN_OR_RETURN(void* stream, Ready(device));
    const cuda::Driver* d = cuda::Driver::Get();
    char* to = static_cast<char*>(dst);
    int cur = 0;
    bool pending = false;  // a copy out of the other buffer is running
    absl::Status status;
    for (uint64_t off = 0; off < n && status.ok();) {
      const size_t len = std::min<uint64_t>(kBytes, n - off);
      status = ReadStream(in, Half(cur), len);
      if (pending) {
        const absl::Status copied = d->Synchronize(stream, device);
        if (status.ok()) status = copied;
        pending = false;
      }
      if (!status.ok()) break;
      status = d->CopyAsync(to + off, Half(cur), len, stream, device);
      pending = status.ok();
      off += len;
      cur = 1 - cur;
    }
    if (pending) {
      const absl::Status copied = d->Synchronize(stream, device);
      if (status.ok()) status = copied;
    }
    return status;
  }

 private:
  static constexpr size_t kBytes = 256 << 10;
  char* Half(int i) const { return static_cast<char*>(buffer_) + i * kBytes; }
  // The buffers, and the stream of `device`.
  absl::StatusOr<void*> Ready(int device) {
    const cuda::Driver* driver = cuda::Driver::Get();
    if (driver == nullptr) return absl::FailedPreconditionError("device memory without a CUDA driver");
    if (buffer_ == nullptr) {
      ASSIGN_OR_RETURN(buffer_, driver->AllocPinned(2 * kBytes));
    }
    if (device < 0) return absl::InvalidArgumentError("staging host memory");
    if (static_cast<size_t>(device) >= streams_.size()) streams_.resize(device + 1, nullptr);
    if (streams_[device] == nullptr) {
      ASSIGN_OR_RETURN(streams_[device], driver->CreateStream(device));
    }
    return streams_[device];
  }
  void* buffer_ = nullptr;
  std::vector<void*> streams_;  // by device ordinal
};

constexpr uint64_t kPreferredRequestBytes = 1 << 20;

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(TcpTransportOptions options) : options_(std::move(options)) {}
  ~TcpTransport() override;

  absl::Status Start();

  EndpointDescription LocalEndpoint() const override;
  Limits GetLimits() const override {
    // Each request costs a header, its share of a system call, an answer and
    // a completion: 1 MiB blocks moved at 0.88-0.94 of a raw stream in 1 MiB
    // requests, 0.62-0.76 in 64 KiB ones (docs/performance.md). Each link
    // keeps two threads busy at each end: on a host with few CPUs one link
    // moved more than two (docs/performance.md).
    return Limits{options_.max_outstanding_per_link, options_.max_request_bytes,
                  options_.max_region_bytes,
                  std::min<uint64_t>(kPreferredRequestBytes, options_.max_request_bytes),
                  UsableCpus() < 4 ? 1u : 2u};
  }
  absl::StatusOr<Region> RegisterMemory(void* addr, uint64_t length,
                                        Access access) override;
  absl::Status UnregisterMemory(RegionId region) override;
  absl::StatusOr<LinkOffer> CreateLink(NicIndex local_nic,
                                       const NicInfo& peer_nic) override;
  absl::StatusOr<LinkOffer> AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                       absl::string_view peer_params) override;
  absl::Status CompleteLink(LinkId link, absl::string_view peer_params) override;
  absl::Status CloseLink(LinkId link) override;
  bool HasLink(LinkId link) override;
  absl::Status Post(absl::Span<const WorkRequest> batch) override;
  size_t PollCompletions(absl::Span<Completion> out) override;
  size_t WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) override;
  void InterruptWait() override;
  std::vector<std::pair<std::string, uint64_t>> RefusedInput() const override {
    const HelloAcceptorStats s = acceptor_->stats();
    return {{"data_connection_bad_hello", s.bad_hellos},
            {"data_connection_duplicate_token", s.duplicate_tokens},
            {"data_connection_evicted", s.evicted},
            {"data_connection_expired", s.expired},
            {"data_accept_paused", s.accept_pauses},
            {"data_request_refused", refused_requests_.load()},
            {"data_peer_dropped_unread_answers", dropped_readers_.load()}};
  }
  bool SetCompletionNotifier(std::function<void()> notify) override {
    MutexLock lock(&mu_);
    notify_ = std::move(notify);
    return true;
  }

 private:
  struct RegionEntry : std::enable_shared_from_this<RegionEntry> {
    Region region;
    std::atomic<uint64_t> local_uses{0};
    // Connections moving a peer's request's bytes into or out of the region
    // now (no regions lock is held across that network I/O), and whether
    // it was unregistered: UnregisterMemory waits for them (RevokeAndDrain).
    Mutex use_mu;
    CondVar use_cv;
    bool revoked ABSL_GUARDED_BY(use_mu) = false;
    std::vector<int> using_fds ABSL_GUARDED_BY(use_mu);
    int device = -1;  // the CUDA device it lies on; -1: host memory
    // Device memory with a CUDA IPC handle (cudaMalloc memory): a peer on
    // this host copies it through IPC. `ipc.offset`: the region's start in
    // its allocation.
    bool has_ipc = false;
    cuda::Driver::IpcExport ipc{};
    // VMM device memory (no IPC handle): its export id on this process's
    // VmmServer, which peers on this host fetch it from; 0: none.
    uint64_t vmm_id = 0;
  };
  // One connection's use of a region for a peer's request (see RegionEntry);
  // ends when destroyed.
  class RegionUse {
   public:
    RegionUse() = default;
    RegionUse(std::shared_ptr<RegionEntry> entry, int fd) : entry_(std::move(entry)), fd_(fd) {}
    RegionUse(RegionUse&& o) noexcept : entry_(std::move(o.entry_)), fd_(o.fd_) {}
    RegionUse& operator=(RegionUse&&) = delete;
    ~RegionUse() {
      if (entry_ == nullptr) return;
      MutexLock lock(&entry_->use_mu);
      auto& fds = entry_->using_fds;
      fds.erase(std::find(fds.begin(), fds.end(), fd_));
      if (fds.empty()) entry_->use_cv.SignalAll();
    }

   private:
    std::shared_ptr<RegionEntry> entry_;
    int fd_ = -1;
  };
  // Something for a link's writer to send.
  struct Job {
    DataHeader header;
    const void* data = nullptr;  // request data (WRITE) from a pinned local buffer
    std::string text;            // error text of a refused request
    bool read_answer = false;    // send region bytes, re-checked under the lock
    bool close_after = false;    // the responder refused: close the connection
    int device = -1;  // data lies on this CUDA device: sent through a staging buffer
    bool ipc = false;  // header.flags has kViaIpc: ipc_ref follows the header
    IpcRef ipc_ref;
  };
  struct Link {
    using State = LinkState;  // transport/checks.h
    LinkId id = 0;
    // The peer's in-process key when it lives in this process (shortcut).
    uint64_t peer_key = 0;
    uint32_t direct_busy = 0;  // shortcut copies running on this link
    uint32_t idle_waiters = 0;  // threads in WaitLinkIdle
    net::Fd fd;
    State state = State::kPending;
    uint64_t token = 0;
    IdWindow<WorkRequest> outstanding;  // by request id, handed out in sequence
    std::vector<Job> jobs;  // the writer takes them all at once
    uint64_t jobs_from = 0;  // the Post whose jobs started `jobs`
    // Sent by the posting thread while the writer was idle (writer_busy is
    // set meanwhile). What the socket
    // did not take at once (inline_rest) the writer sends first, from byte
    // inline_sent on.
    std::vector<Job> inline_jobs;
    size_t inline_sent = 0;
    bool inline_rest = false;
    bool stopping = false;
    bool writer_busy = false;
    bool passive = false;      // made by AcceptLink
    bool reader_done = false;  // the reader thread has returned
    uint32_t queued_answers = 0;  // answers in `jobs` (reader and writer, under mu_)
    CondVar cv;  // jobs arrived / stopping / writer idle
    ThreadCache::Task reader;
    ThreadCache::Task writer;
    // Pinned host buffers for device memory, made on first use: the
    // writer's (sending) and the reader's (receiving), each used by its own
    // thread only.
    Staging send_stage;
    Staging recv_stage;
    // What the reader thread receives comes through here (made with fd).
    std::unique_ptr<StreamReader> in;
    // Both ends on this host with a CUDA driver: device memory may go
    // through CUDA IPC (until the peer says it cannot open a handle).
    bool same_host = false;
    bool ipc_ok = true;
    uint64_t peer_vmm = 0;  // the peer's VMM server (same host only); 0: none
    // The requesters' allocations this end opened (reader thread only), by
    // handle bytes; closed when the reader ends.
    struct Import {
      void* mapped;
      uint64_t size;  // of the allocation: requests must stay inside
      int ordinal;    // opened through this device's context
      VmmMapping vmm{};  // VMM memory: unmapped, not IpcClose'd
      uint64_t used = 0;  // when last used (imports_used below)
    };
    uint64_t imports_used = 0;  // a counter: the reader's requests served by IPC
    std::map<std::string, Import> ipc_imports;
  };

  // The process's TCP transports by in-process key. Held shared while a
  // shortcut copy runs, so a transport is not destroyed under it.
  struct Registry {
    SharedMutex mu;
    struct Entry {
      TcpTransport* transport;
      pid_t pid;  // a child made by fork() inherits entries that are not its own
    };
    absl::flat_hash_map<uint64_t, Entry> by_key ABSL_GUARDED_BY(mu);
  };
  // `key` if a transport of this process has it, else 0 (no shortcut).
  static uint64_t InProcessKey(uint64_t key) {
    if (key == 0) return 0;
    Registry& r = registry();
    ReaderMutexLock lock(&r.mu);
    auto it = r.by_key.find(key);
    return it != r.by_key.end() && it->second.pid == ::getpid() ? key : 0;
  }
  static Registry& registry() {
    static Registry* r = new Registry;
    return *r;
  }
  // A request on a link whose peer is in this process.
  struct Direct {
    std::shared_ptr<Link> link;
    uint64_t rid = 0;
    WorkRequest wr;
    int local_device = -1;  // the local buffer's CUDA device, -1: host
    bool run = false;  // still outstanding when the copies began
    absl::Status status;
  };
  absl::Status PostLocked(absl::Span<const WorkRequest> batch, std::vector<Direct>& direct,
                          std::vector<std::shared_ptr<Link>>& inline_links);
  // If `link` is idle (writer not busy, nothing queued before `post`),
  // claims it for the calling thread: its jobs move to inline_jobs.
  bool ClaimInline(Link& link, uint64_t post) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends a claimed link's inline_jobs without blocking; a rest goes to
  // the writer. Clears writer_busy.
  void SendInline(const std::shared_ptr<Link>& link);
  // Copies the bytes of each request and completes it, taking each lock
  // once for the lot. It holds the regions lock of whichever peer the
  // current request goes to, switching as the peer changes: beyond what
  // the thread-safety analysis can follow, so it is not analysed.
  void RunDirect(std::vector<Direct>& direct) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // Waits until no shortcut copy or send uses the link's requests.
  void WaitLinkIdle(Link& link) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++link.idle_waiters;
    while (link.writer_busy || link.direct_busy > 0) link.cv.Wait(&mu_);
    --link.idle_waiters;
  }

  // Runs the link's reader and writer on warm threads (threads_). On a
  // refusal the link fails (its connection is shut down) and the error
  // returned.
  absl::Status StartLinkThreads(const std::shared_ptr<Link>& link);
  absl::Status TooManyLinks() const {
    return absl::ResourceExhaustedError(
        absl::StrCat("this transport has its maximum of ", options_.max_links, " links"));
  }
  void ReaderLoop(std::shared_ptr<Link> link);
  // WRITEs executed and not yet acknowledged: one kWriteAck for the run
  // (header.remote_addr counts them). Requests on a link have consecutive
  // ids and any other request flushes the run first, so a run is always
  // consecutive.
  struct AckRun {
    Job job;
    uint64_t bytes = 0;
  };
  // The reader's part for one request of the peer: executes it (or, after
  // a refusal, reads it off the stream) and queues or gathers its answer.
  absl::Status Serve(Link& link, const DataHeader& h, AckRun& run, bool* refusing);
  // Hands an answer to the writer. kCancelled once the link is stopping.
  absl::Status QueueAnswer(Link& link, Job job);
  absl::Status FlushRun(Link& link, AckRun& run);
  void WriterLoop(std::shared_ptr<Link> link);
  // Sends `jobs` with one sendmsg. Sets *close_after when the connection
  // must be closed after them (a refused request).
  // `skip`: bytes of them already sent.
  absl::Status SendJobs(Link& link, absl::Span<Job> jobs, bool* close_after, size_t skip = 0);
  // Responder side: executes a peer's request; returns the answer to send.
  Job Execute(Link& link, const DataHeader& h, absl::Status* stream_error);
  // The host identity links advertise for CUDA IPC; 0: IPC off (no CUDA
  // driver, or TcpTransportOptions::cuda_ipc false).
  uint64_t IpcHost() const {
    return options_.cuda_ipc && cuda::Driver::Get() != nullptr ? HostId() : 0;
  }
  // The requester's allocation `ref` names, opened on first use (reader).
  // The requester's bytes [ref.offset, +length) in it; kInvalidArgument when
  // they are not inside the allocation.
  // `vmm`: the reference names VMM memory, fetched from the peer's
  // VmmServer.
  absl::StatusOr<char*> ImportIpc(Link& link, const IpcRef& ref, bool vmm, uint64_t length,
                                  int device);
  static void CloseImport(const Link::Import& imp);
  // Device to device on this host: fills in the IpcRef (and flags) of
  // `job` when the peer can copy `wr`'s bytes through CUDA itself.
  static bool ViaIpc(const Link& link, const RegionEntry& local, const WorkRequest& wr,
                     Job* job);
  // The VMM server links advertise; 0: none (IPC off, or no VMM in the
  // driver).
  uint64_t VmmName() const {
    if (IpcHost() == 0 || !cuda::Driver::Get()->HasVmm()) return 0;
    VmmServer* server = VmmServer::Get();
    return server != nullptr ? server->name() : 0;
  }
  // The peer could not serve request `id` through IPC: send it again with
  // its bytes, and no more IPC on this link.
  absl::Status ResendStaged(Link& link, const WorkRequest& wr, uint64_t id, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckRemote(const DataHeader& h, bool write, char** target, int* device = nullptr)
      ABSL_SHARED_LOCKS_REQUIRED(regions_mu_);
  // CheckRemote, and marks connection `fd` as using the region until the
  // returned RegionUse ends; refused once the region is unregistered.
  absl::StatusOr<RegionUse> UseRemote(const DataHeader& h, bool write, int fd, char** target,
                                      int* device);
  // After a region left the tables: waits for the peers' requests moving
  // its bytes; past a grace period it shuts their connections down (a
  // stalled peer fails its own link, never blocks the caller for long).
  static void RevokeAndDrain(RegionEntry& entry);
  // Requester side: an answer to one of our requests.
  absl::Status OnAnswer(Link& link, const DataHeader& h);
  void FailLink(Link& link, absl::Status first, uint64_t first_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StopAndJoin(const std::shared_ptr<Link>& link);
  // Closes accepted links whose connection has ended and which have nothing
  // outstanding: the peer that made them is gone or reconnected, and
  // nobody here holds their id (the engine never posts on them).
  void ReapDeadPassiveLinks();
  // Wakes threads in WaitCompletions and calls the notifier, once per run
  // of completions.
  void WakeWaiters() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues a completion; the caller wakes waiters (WakeWaiters) once.
  void CompleteLocked(const WorkRequest& wr, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ValidateLocked(const WorkRequest& wr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_)
      ABSL_SHARED_LOCKS_REQUIRED(regions_mu_);

  const TcpTransportOptions options_;
  net::ListeningSocket listener_;
  std::string advertised_;
  std::unique_ptr<HelloAcceptor> acceptor_;
  std::atomic<uint64_t> refused_requests_{0};  // out of bounds, bad key, no right
  std::atomic<uint64_t> dropped_readers_{0};   // peers that read none of their answers
  // Link readers and writers; declared before the links so that it is
  // destroyed after they are stopped.
  ThreadCache threads_{"tcp link", 16};
  std::atomic<bool> stopping_{false};
  uint64_t key_ = 0;  // in-process key, 0 without the shortcut

  SharedMutex regions_mu_;
  RegionId last_region_ ABSL_GUARDED_BY(regions_mu_) = 0;
  absl::flat_hash_map<RegionId, std::shared_ptr<RegionEntry>> regions_
      ABSL_GUARDED_BY(regions_mu_);
  absl::flat_hash_map<RemoteKey, RegionEntry*> by_key_ ABSL_GUARDED_BY(regions_mu_);

  Mutex mu_;
  CondVar cq_cv_;
  bool interrupted_ ABSL_GUARDED_BY(mu_) = false;  // see InterruptWait
  LinkId last_link_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_post_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<LinkId, std::shared_ptr<Link>> links_ ABSL_GUARDED_BY(mu_);
  CompletionQueue cq_ ABSL_GUARDED_BY(mu_);
  std::function<void()> notify_ ABSL_GUARDED_BY(mu_);  // SetCompletionNotifier
};

absl::Status TcpTransport::Start() {
  ASSIGN_OR_RETURN(listener_, net::Listen(options_.bind_host, options_.port,
                                          options_.port_range));
  std::string host = options_.advertise_host;
  if (host.empty()) {
    if (options_.bind_host == "0.0.0.0" || options_.bind_host == "::") {
      return absl::InvalidArgumentError(
          "the TCP transport binds every interface; say which address to "
          "advertise (advertise_host)");
    }
    host = options_.bind_host;
  }
  advertised_ = net::HostPort{host, listener_.address.port()}.ToString();
  if (options_.in_process_shortcut) {
    Registry& r = registry();
    WriterMutexLock lock(&r.mu);
    do {
      key_ = net::RandomU64();
    } while (key_ == 0 || r.by_key.contains(key_));
    r.by_key[key_] = Registry::Entry{this, ::getpid()};
  }
  HelloAcceptorOptions hello;
  hello.secret = options_.secret;
  ASSIGN_OR_RETURN(acceptor_, HelloAcceptor::Start(listener_.fd.get(), hello));
  // A new peer's first links take warm threads instead of starting four.
  threads_.Prestart(options_.warm_threads);
  KVF_LOG(DEBUG) << "tcp transport listening on " << listener_.address.ToString()
                 << ", advertised as " << advertised_;
  return absl::OkStatus();
}

TcpTransport::~TcpTransport() {
  if (key_ != 0) {
    // Waits for peers' shortcut copies into this transport's regions.
    Registry& r = registry();
    WriterMutexLock lock(&r.mu);
    r.by_key.erase(key_);
  }
  stopping_ = true;
  acceptor_.reset();
  std::vector<std::shared_ptr<Link>> links;
  {
    MutexLock lock(&mu_);
    for (auto& [id, link] : links_) links.push_back(link);
    links_.clear();
  }
  for (auto& link : links) StopAndJoin(link);
}

EndpointDescription TcpTransport::LocalEndpoint() const {
  EndpointDescription d;
  d.kind = "tcp";
  NicInfo nic;
  nic.name = "tcp";
  nic.address = advertised_;
  d.nics.push_back(nic);
  return d;
}

absl::StatusOr<Region> TcpTransport::RegisterMemory(void* addr, uint64_t length,
                                                    Access access) {
  if (addr == nullptr) return absl::InvalidArgumentError("RegisterMemory: null address");
  if (length == 0) return absl::InvalidArgumentError("RegisterMemory: zero length");
  if (length > options_.max_region_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "RegisterMemory: ", length, " bytes exceeds the limit of ",
        options_.max_region_bytes));
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  if (base + length < base) return absl::InvalidArgumentError("RegisterMemory: range wraps");
  // Device memory is never touched by the CPU: its bytes go through pinned
  // staging buffers (see Staging).
  int device = -1;
  uint64_t vmm_id = 0;
  absl::StatusOr<cuda::Driver::IpcExport> ipc = absl::UnavailableError("host memory");
  if (const cuda::Driver* driver = cuda::Driver::Get()) {
    ASSIGN_OR_RETURN(cuda::MemoryInfo where, driver->Classify(addr, length));
    if (where.device) {
      device = where.ordinal;
      if (IpcHost() != 0) ipc = driver->IpcExportOf(addr, device);
      if (IpcHost() != 0 && !ipc.ok() && driver->IsVmm(addr, device)) {
        // VMM memory: peers on this host fetch its chunks as fds, if they
        // can be exported (tried once here).
        absl::StatusOr<cuda::Driver::VmmExport> trial = driver->ExportVmm(addr, length, device);
        if (trial.ok()) {
          for (const cuda::Driver::VmmChunk& c : trial->chunks) ::close(c.fd);
          if (VmmServer* server = VmmServer::Get()) vmm_id = server->Add(addr, length, device);
        } else {
          KVF_LOG(INFO) << "tcp: VMM device memory at " << addr << " cannot be shared ("
                        << trial.status().message() << "): peers on this host get it staged";
        }
      } else if (IpcHost() != 0 && !ipc.ok()) {
        KVF_LOG(INFO) << "tcp: device memory at " << addr << " has no CUDA IPC handle ("
                      << ipc.status().message() << "): peers on this host get it staged";
      }
    }
  }
  WriterMutexLock lock(&regions_mu_);
  auto entry = std::make_shared<RegionEntry>();
  entry->device = device;
  entry->has_ipc = ipc.ok();
  if (ipc.ok()) entry->ipc = *ipc;
  entry->vmm_id = vmm_id;
  Region& r = entry->region;
  r.id = ++last_region_;
  r.addr = base;
  r.length = length;
  r.access = access;
  RemoteKey key;
  do {
    key = net::RandomU64();
  } while (key == 0 || by_key_.contains(key));
  r.keys = {key};
  by_key_[key] = entry.get();
  Region out = r;
  regions_.emplace(r.id, std::move(entry));
  return out;
}

absl::Status TcpTransport::UnregisterMemory(RegionId region) {
  std::shared_ptr<RegionEntry> entry;
  {
    WriterMutexLock lock(&regions_mu_);
    auto it = regions_.find(region);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("unknown region ", region));
    if (const uint64_t uses = it->second->local_uses.load(); uses != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "region ", region, " is used by ", uses, " outstanding request(s)"));
    }
    by_key_.erase(it->second->region.keys[0]);
    entry = std::move(it->second);
    regions_.erase(it);
  }
  if (entry->vmm_id != 0) VmmServer::Get()->Remove(entry->vmm_id);
  RevokeAndDrain(*entry);
  return absl::OkStatus();
}

void TcpTransport::RevokeAndDrain(RegionEntry& entry) {
  constexpr absl::Duration kGrace = absl::Seconds(1);
  MutexLock lock(&entry.use_mu);
  entry.revoked = true;
  if (entry.use_cv.AwaitWithDeadline(&entry.use_mu, absl::Now() + kGrace,
                                     [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                       return entry.using_fds.empty();
                                     })) {
    return;
  }
  KVF_LOG(WARNING) << "tcp: region " << entry.region.id << " unregistered while "
                   << entry.using_fds.size() << " peer request(s) still moved its bytes after "
                   << absl::FormatDuration(kGrace) << ": closing their links";
  for (int fd : entry.using_fds) ::shutdown(fd, SHUT_RDWR);
  while (!entry.using_fds.empty()) entry.use_cv.Wait(&entry.use_mu);
}

absl::StatusOr<TcpTransport::RegionUse> TcpTransport::UseRemote(const DataHeader& h, bool write,
                                                               int fd, char** target,
                                                               int* device) {
  ReaderMutexLock lock(&regions_mu_);
  RETURN_IF_ERROR(CheckRemote(h, write, target, device));
  // CheckRemote found the key: one more lookup of it, none by region id.
  std::shared_ptr<RegionEntry> entry = by_key_.find(h.rkey)->second->shared_from_this();
  MutexLock use(&entry->use_mu);
  if (entry->revoked) return UnknownKeyError(h.rkey);
  entry->using_fds.push_back(fd);
  return RegionUse(std::move(entry), fd);
}

absl::StatusOr<LinkOffer> TcpTransport::CreateLink(NicIndex local_nic,
                                                   const NicInfo& peer_nic) {
  if (local_nic != 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", local_nic));
  }
  absl::StatusOr<net::HostPort> peer = net::ParseHostPort(peer_nic.address);
  if (!peer.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a TCP NIC address: ", peer.status().message()));
  }
  ASSIGN_OR_RETURN(net::Fd fd, net::Connect(*peer, options_.connect_timeout));
  RETURN_IF_ERROR(net::SetNoDelay(fd.get()));
  RETURN_IF_ERROR(net::SetKeepAlive(fd.get(), options_.dead_peer_timeout));
  const uint64_t token = net::RandomU64();
  const std::string hello = EncodeHello(token, options_.secret);
  RETURN_IF_ERROR(net::WriteFull(fd.get(), hello.data(), hello.size(),
                                 absl::Now() + options_.connect_timeout));
  auto link = std::make_shared<Link>();
  link->fd = std::move(fd);
  link->token = token;
  MutexLock lock(&mu_);
  if (links_.size() >= options_.max_links) return TooManyLinks();
  link->id = ++last_link_;
  links_[link->id] = link;
  return LinkOffer{link->id, EncodeLinkParams(token, key_, IpcHost(), VmmName())};
}

absl::StatusOr<LinkOffer> TcpTransport::AcceptLink(NicIndex local_nic,
                                                   const NicInfo& peer_nic,
                                                   absl::string_view peer_params) {
  (void)peer_nic;
  if (local_nic != 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local NIC ", local_nic));
  }
  absl::StatusOr<PeerParams> params = DecodeLinkParams(peer_params);
  if (!params.ok()) return Annotate(params.status(), "AcceptLink");
  const uint64_t token = params->token;
  ReapDeadPassiveLinks();
  absl::StatusOr<net::Fd> fd = acceptor_->Claim(token, absl::Now() + options_.connect_timeout);
  if (!fd.ok()) return Annotate(fd.status(), "AcceptLink");
  auto link = std::make_shared<Link>();
  {
    MutexLock lock(&mu_);
    if (links_.size() >= options_.max_links) return TooManyLinks();
    link->fd = std::move(*fd);
    link->token = token;
    link->id = ++last_link_;
    link->state = Link::State::kReady;
    link->passive = true;
    if (key_ != 0) link->peer_key = InProcessKey(params->key);
    link->same_host = IpcHost() != 0 && params->host == IpcHost();
    if (link->same_host) link->peer_vmm = params->vmm;
    links_[link->id] = link;
  }
  (void)net::SetNoDelay(link->fd.get());
  (void)net::SetKeepAlive(link->fd.get(), options_.dead_peer_timeout);
  if (absl::Status started = StartLinkThreads(link); !started.ok()) {
    MutexLock lock(&mu_);
    links_.erase(link->id);
    return started;
  }
  return LinkOffer{link->id, EncodeLinkParams(token, key_, IpcHost(), VmmName())};
}

absl::Status TcpTransport::CompleteLink(LinkId id, absl::string_view peer_params) {
  std::shared_ptr<Link> link;
  {
    MutexLock lock(&mu_);
    auto it = links_.find(id);
    if (it == links_.end()) return absl::InvalidArgumentError(absl::StrCat("unknown link ", id));
    link = it->second;
    if (link->state != Link::State::kPending) {
      return absl::FailedPreconditionError(absl::StrCat("link ", id, " is already complete"));
    }
    absl::StatusOr<PeerParams> params = DecodeLinkParams(peer_params);
    if (!params.ok()) return Annotate(params.status(), "CompleteLink");
    if (params->token != link->token) {
      return absl::InvalidArgumentError("CompleteLink: the peer answered for another link");
    }
    link->state = Link::State::kReady;
    if (key_ != 0) link->peer_key = InProcessKey(params->key);
    link->same_host = IpcHost() != 0 && params->host == IpcHost();
    if (link->same_host) link->peer_vmm = params->vmm;
  }
  if (absl::Status started = StartLinkThreads(link); !started.ok()) {
    MutexLock lock(&mu_);
    links_.erase(link->id);
    return started;
  }
  return absl::OkStatus();
}

absl::Status TcpTransport::StartLinkThreads(const std::shared_ptr<Link>& link) {
  absl::StatusOr<ThreadCache::Task> reader = threads_.Run([this, link] { ReaderLoop(link); });
  absl::StatusOr<ThreadCache::Task> writer =
      reader.ok() ? threads_.Run([this, link] { WriterLoop(link); }) : reader;
  if (reader.ok()) link->reader = std::move(*reader);
  if (writer.ok()) {
    link->writer = std::move(*writer);
    return absl::OkStatus();
  }
  // Whatever started sees the link stopping and returns; the link fails.
  {
    MutexLock lock(&mu_);
    link->stopping = true;
    link->cv.SignalAll();
  }
  ::shutdown(link->fd.get(), SHUT_RDWR);
  return writer.status();
}

void TcpTransport::ReapDeadPassiveLinks() {
  std::vector<std::shared_ptr<Link>> dead;
  {
    MutexLock lock(&mu_);
    for (auto it = links_.begin(); it != links_.end();) {
      const Link& l = *it->second;
      if (l.passive && l.reader_done && l.outstanding.empty()) {
        dead.push_back(it->second);
        links_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (auto& link : dead) StopAndJoin(link);
}

void TcpTransport::StopAndJoin(const std::shared_ptr<Link>& link) {
  {
    MutexLock lock(&mu_);
    link->stopping = true;
    link->cv.SignalAll();
  }
  ::shutdown(link->fd.get(), SHUT_RDWR);
  link->reader.Join();
  link->writer.Join();
}

bool TcpTransport::HasLink(LinkId id) {
  // A passive link whose reader ended is gone for its peer (it is reaped at
  // the next AcceptLink).
  MutexLock lock(&mu_);
  auto it = links_.find(id);
  return it != links_.end() && !(it->second->passive && it->second->reader_done);
}

absl::Status TcpTransport::CloseLink(LinkId id) {
  std::shared_ptr<Link> link;
  {
    MutexLock lock(&mu_);
    auto it = links_.find(id);
    if (it == links_.end()) return absl::NotFoundError(absl::StrCat("unknown link ", id));
    link = it->second;
    links_.erase(it);
  }
  // Nothing touches request buffers once both threads are gone.
  StopAndJoin(link);
  MutexLock lock(&mu_);
  WaitLinkIdle(*link);
  link->outstanding.ForEach([&](uint64_t, const WorkRequest& wr) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    CompleteLocked(wr, absl::CancelledError(absl::StrCat("link ", id, " was closed")));
  });
  link->outstanding.Clear();
  WakeWaiters();
  return absl::OkStatus();
}

absl::Status TcpTransport::ValidateLocked(const WorkRequest& wr) {
  auto link = links_.find(wr.link);
  RETURN_IF_ERROR(CheckLinkUsable(wr.link, link == links_.end() ? nullptr : &link->second->state));
  auto region = regions_.find(wr.local_region);
  if (region == regions_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local region ", wr.local_region));
  }
  return CheckLocal(wr, region->second->region, options_.max_request_bytes);
}

absl::Status TcpTransport::Post(absl::Span<const WorkRequest> batch) {
  // Requests to a peer in this process, copied after the locks are gone.
  Scratch<Direct> direct;
  // Links idle when this Post came: their requests go from this thread.
  Scratch<std::shared_ptr<Link>> inline_links;
  RETURN_IF_ERROR(PostLocked(batch, *direct, *inline_links));
  for (const std::shared_ptr<Link>& link : *inline_links) SendInline(link);
  inline_links->clear();  // drop the references now, not at the next Post
  if (!direct->empty()) RunDirect(*direct);
  return absl::OkStatus();
}

bool TcpTransport::ViaIpc(const Link& link, const RegionEntry& local, const WorkRequest& wr,
                          Job* job) {
  if (!link.same_host || !link.ipc_ok || wr.length == 0) return false;
  const uint64_t offset = reinterpret_cast<uintptr_t>(wr.local_addr) - local.region.addr;
  if (local.has_ipc) {
    // cudaMalloc memory: the peer opens the allocation's IPC handle.
    job->ipc_ref.handle = local.ipc.handle;
    job->ipc_ref.offset = local.ipc.offset + offset;
    job->header.flags |= kViaIpc;
  } else if (local.vmm_id != 0 && link.peer_vmm != 0) {
    // VMM memory: the peer maps it from this process's VMM server.
    job->ipc_ref = IpcRef{};
    std::memcpy(job->ipc_ref.handle.reserved, &local.vmm_id, sizeof local.vmm_id);
    job->ipc_ref.offset = offset;
    job->header.flags |= kViaIpc | kViaVmm;
  } else {
    return false;
  }
  job->ipc = true;
  return true;
}

absl::Status TcpTransport::PostLocked(absl::Span<const WorkRequest> batch,
                                      std::vector<Direct>& direct,
                                      std::vector<std::shared_ptr<Link>>& inline_links) {
  MutexLock lock(&mu_);
  ReaderMutexLock regions(&regions_mu_);
  for (const WorkRequest& wr : batch) RETURN_IF_ERROR(ValidateLocked(wr));
  RETURN_IF_ERROR(CheckLinkCapacity(
      batch,
      [this](LinkId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {  // mu_ is held by Post
        return links_.at(id)->outstanding.size();
      },
      options_.max_outstanding_per_link));
  const uint64_t post = ++last_post_;
  for (const WorkRequest& wr : batch) {
    Link& link = *links_.at(wr.link);
    RegionEntry& local = *regions_.at(wr.local_region);
    local.local_uses.fetch_add(1);
    const uint64_t rid = link.outstanding.Add(wr);
    if (link.peer_key != 0) {
      direct.push_back(Direct{links_.at(wr.link), rid, wr, local.device});
      continue;
    }
    Job job;
    job.header.type = wr.opcode == Opcode::kWrite ? kWriteReq : kReadReq;
    job.header.id = rid;
    job.header.remote_addr = wr.remote_addr;
    job.header.rkey = wr.remote_key;
    job.header.length = wr.length;
    if (!ViaIpc(link, local, wr, &job) && wr.opcode == Opcode::kWrite) {
      job.data = wr.local_addr;
      job.device = local.device;
    }
    if (link.jobs.empty()) link.jobs_from = post;
    link.jobs.push_back(std::move(job));
  }
  // Per link: its last request of this Post asks for the answer to the
  // run it ends, and one wake-up for the writer, not one per request.
  for (size_t i = 0; i < batch.size(); ++i) {
    if (i > 0 && batch[i].link == batch[i - 1].link) continue;
    Link& link = *links_.at(batch[i].link);
    if (link.peer_key != 0) continue;  // copied in Post, no message
    link.jobs.back().header.flags |= kAckNow;  // held lock: the back is this Post's
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    if (i > 0 && batch[i].link == batch[i - 1].link) continue;
    Link& link = *links_.at(batch[i].link);
    if (link.peer_key != 0 || link.jobs.empty()) continue;
    if (ClaimInline(link, post)) {
      inline_links.push_back(links_.at(batch[i].link));
    } else {
      link.cv.SignalAll();
    }
  }
  return absl::OkStatus();
}

bool TcpTransport::ClaimInline(Link& link, uint64_t post) {
  if (link.writer_busy || link.inline_rest || link.stopping || link.jobs_from != post ||
      link.jobs.size() > kMaxJobsPerSend) {
    return false;
  }
  uint64_t bytes = 0;
  for (const Job& job : link.jobs) {
    if (job.device >= 0 || job.ipc) return false;  // staged, or with an IpcRef: the writer
    bytes += sizeof job.header + (job.data ? job.header.length : 0);
  }
  // Small Posts only: a large one is better copied into the socket by the
  // writer thread while this thread goes on (measured: 64 x 4 KiB per Post
  // ran at 0.50-0.54 of a raw stream sent from here, 0.63-0.66 handed off).
  if (bytes > kInlineSendBytes) return false;
  link.writer_busy = true;
  link.inline_jobs.swap(link.jobs);  // link.jobs is empty (and keeps its capacity)
  link.inline_sent = 0;
  return true;
}

void TcpTransport::SendInline(const std::shared_ptr<Link>& link) {
  iovec iov[2 * kMaxJobsPerSend];
  int n = 0;
  size_t total = 0;
  for (Job& job : link->inline_jobs) {  // requests only: no READ answers, no text
    iov[n++] = {&job.header, sizeof job.header};
    total += sizeof job.header;
    if (job.data != nullptr && job.header.length > 0) {
      iov[n++] = {const_cast<void*>(job.data), job.header.length};
      total += job.header.length;
    }
  }
  size_t sent = 0;
  const absl::Status st = SendIov(link->fd.get(), iov, n, /*wait=*/false, &sent);
  MutexLock lock(&mu_);
  link->writer_busy = false;
  if (!st.ok()) {
    link->inline_jobs.clear();
    ::shutdown(link->fd.get(), SHUT_RDWR);  // the reader sees it and fails the link
  } else if (sent < total) {
    link->inline_sent = sent;  // the writer sends the rest first
    link->inline_rest = true;
  } else {
    link->inline_jobs.clear();
  }
  link->cv.SignalAll();  // the writer (rest, jobs queued meanwhile) and idle waiters
}

void TcpTransport::RunDirect(std::vector<Direct>& direct) {
  {
    MutexLock lock(&mu_);
    for (Direct& d : direct) {
      // Failed or closed since Post: already completed.
      Link& link = *d.link;
      d.run = link.state != Link::State::kError && link.outstanding.Find(d.rid) != nullptr;
      if (d.run) ++link.direct_busy;
    }
  }
  {
    Registry& r = registry();
    ReaderMutexLock registered(&r.mu);
    TcpTransport* peer = nullptr;
    uint64_t peer_key = 0;
    for (Direct& d : direct) {
      if (!d.run || d.wr.length == 0) continue;
      if (d.link->peer_key != peer_key || peer == nullptr) {
        if (peer != nullptr) peer->regions_mu_.ReaderUnlock();
        auto it = r.by_key.find(d.link->peer_key);
        peer = it == r.by_key.end() ? nullptr : it->second.transport;
        peer_key = d.link->peer_key;
        if (peer != nullptr) peer->regions_mu_.ReaderLock();
      }
      if (peer == nullptr) {
        d.status = absl::UnavailableError("the peer transport in this process is gone");
        continue;
      }
      DataHeader h;
      h.remote_addr = d.wr.remote_addr;
      h.rkey = d.wr.remote_key;
      h.length = d.wr.length;
      char* remote = nullptr;
      const bool write = d.wr.opcode == Opcode::kWrite;
      int remote_device = -1;
      d.status = peer->CheckRemote(h, write, &remote, &remote_device);  // its lock is held
      if (!d.status.ok()) continue;
      void* dst = write ? static_cast<void*>(remote) : d.wr.local_addr;
      const void* src = write ? static_cast<const void*>(d.wr.local_addr) : remote;
      if (d.local_device < 0 && remote_device < 0) {
        std::memcpy(dst, src, d.wr.length);
      } else {
        // Device memory on either end: the driver's copy (device to device
        // stays on the GPUs).
        d.status = cuda::Driver::Get()->Copy(
            dst, src, d.wr.length, d.local_device >= 0 ? d.local_device : remote_device);
      }
    }
    if (peer != nullptr) peer->regions_mu_.ReaderUnlock();
  }
  MutexLock lock(&mu_);
  bool completed = false;
  for (Direct& d : direct) {
    if (!d.run) continue;
    Link& link = *d.link;
    --link.direct_busy;
    if (link.idle_waiters > 0) link.cv.SignalAll();
  }
  for (Direct& d : direct) {
    if (!d.run) continue;
    Link& link = *d.link;
    if (!d.status.ok()) {
      // Like a refused request on the wire: the link enters the error state.
      FailLink(link, std::move(d.status), d.rid);
    } else if (link.outstanding.Erase(d.rid)) {
      CompleteLocked(d.wr, absl::OkStatus());
      completed = true;
    }
  }
  if (completed) WakeWaiters();
}

void TcpTransport::CompleteLocked(const WorkRequest& wr, absl::Status status) {
  cq_.Push(wr, std::move(status));
}

void TcpTransport::WakeWaiters() {
  cq_cv_.SignalAll();
  if (notify_) notify_();
}

void TcpTransport::FailLink(Link& link, absl::Status first, uint64_t first_id) {
  if (link.state == Link::State::kError) return;
  link.state = Link::State::kError;
  link.stopping = true;
  link.jobs.clear();
  link.cv.SignalAll();
  ::shutdown(link.fd.get(), SHUT_RDWR);
  // The writer may be sending from a request buffer: wait until it is not,
  // so no buffer is read after its request has been completed.
  WaitLinkIdle(link);
  const std::string reason(first.message());
  if (link.outstanding.Find(first_id) == nullptr && !link.outstanding.empty()) {
    first_id = link.outstanding.first();
  }
  if (const WorkRequest* wr = link.outstanding.Find(first_id)) {
    CompleteLocked(*wr, std::move(first));
    link.outstanding.Erase(first_id);
  }
  link.outstanding.ForEach([&](uint64_t, const WorkRequest& wr) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    CompleteLocked(wr, absl::AbortedError(absl::StrCat("flushed: link ", link.id,
                                                       " failed earlier: ", reason)));
  });
  link.outstanding.Clear();
  WakeWaiters();
}

void TcpTransport::WriterLoop(std::shared_ptr<Link> link) {
  std::vector<Job> jobs;  // swapped with the link's queue: no allocation once warm
  std::vector<Job> rest;  // the part of an inline send the socket did not take
  for (;;) {
    jobs.clear();
    rest.clear();
    size_t skip = 0;
    {
      MutexLock lock(&mu_);
      while (((link->jobs.empty() && !link->inline_rest) || link->writer_busy) &&
             !link->stopping) {
        link->cv.Wait(&mu_);
      }
      if (link->stopping) return;
      if (link->inline_rest) {
        rest.swap(link->inline_jobs);
        skip = link->inline_sent;
        link->inline_rest = false;
      }
      jobs.swap(link->jobs);  // everything queued
      link->queued_answers = 0;
      link->writer_busy = true;
    }
    bool close_after = false;
    absl::Status sent;
    if (!rest.empty()) sent = SendJobs(*link, absl::MakeSpan(rest), &close_after, skip);
    // Up to kMaxJobsPerSend messages per sendmsg.
    for (size_t i = 0; i < jobs.size() && sent.ok() && !close_after; i += kMaxJobsPerSend) {
      sent = SendJobs(*link,
                      absl::MakeSpan(jobs).subspan(i, std::min(kMaxJobsPerSend, jobs.size() - i)),
                      &close_after);
    }
    {
      MutexLock lock(&mu_);
      link->writer_busy = false;
      link->cv.SignalAll();
    }
    if (!sent.ok() || close_after) {
      // The reader sees the connection end and fails the link.
      ::shutdown(link->fd.get(), sent.ok() ? SHUT_WR : SHUT_RDWR);
      return;
    }
  }
}

absl::Status TcpTransport::SendJobs(Link& link, absl::Span<Job> jobs, bool* close_after,
                                    size_t skip) {
  iovec iov[3 * kMaxJobsPerSend];
  int n = 0;
  // A READ answer sends region bytes: the region may have been unregistered
  // since the request was checked, so check again, and keep it registered
  // while its bytes go out (a RegionUse; no lock is held while sending).
  std::vector<RegionUse> uses;
  {
    for (Job& job : jobs) {
      if (job.read_answer) {
        char* source = nullptr;
        DataHeader request = job.header;
        request.type = kReadReq;
        absl::StatusOr<RegionUse> use =
            UseRemote(request, /*write=*/false, link.fd.get(), &source, &job.device);
        if (!use.ok()) {
          job.header.status = static_cast<uint8_t>(use.status().code());
          job.header.length = 0;
          job.text = std::string(use.status().message().substr(0, kMaxErrorText));
          job.data = nullptr;
          job.read_answer = false;
          job.close_after = true;  // nothing after a refusal: the connection closes
        } else {
          job.data = source;
          uses.push_back(std::move(*use));
        }
      }
    }
  }
  {
    for (Job& job : jobs) {
      job.header.text_len = static_cast<uint32_t>(job.text.size());
      iov[n++] = {&job.header, sizeof job.header};
      if (!job.text.empty()) iov[n++] = {job.text.data(), job.text.size()};
      if (job.ipc) iov[n++] = {&job.ipc_ref, sizeof job.ipc_ref};
      if (job.data != nullptr && job.header.length > 0 && job.device >= 0) {
        // Device memory: what is gathered goes first, then the bytes
        // through the staging buffer. (Never in an inline rest: skip
        // covers host jobs only.)
        iovec* first = iov;
        SkipBytes(first, n, skip);
        skip = 0;
        RETURN_IF_ERROR(SendAll(link.fd.get(), first, n));
        n = 0;
        RETURN_IF_ERROR(
            link.send_stage.Send(link.fd.get(), job.data, job.header.length, job.device));
      } else if (job.data != nullptr && job.header.length > 0) {
        iov[n++] = {const_cast<void*>(job.data), job.header.length};
      }
      if (job.close_after) {
        *close_after = job.close_after;
        break;  // nothing after a refusal: the connection closes
      }
    }
    iovec* first = iov;
    SkipBytes(first, n, skip);
    return SendAll(link.fd.get(), first, n);
  }
}

absl::Status TcpTransport::CheckRemote(const DataHeader& h, bool write, char** target,
                                       int* device) {
  auto it = by_key_.find(h.rkey);
  if (it == by_key_.end()) return UnknownKeyError(h.rkey);
  RETURN_IF_ERROR(CheckRemoteAccess(it->second->region, write ? Opcode::kWrite : Opcode::kRead,
                                    h.remote_addr, h.length));
  *target = reinterpret_cast<char*>(h.remote_addr);
  if (device != nullptr) *device = it->second->device;
  return absl::OkStatus();
}

TcpTransport::Job TcpTransport::Execute(Link& link, const DataHeader& h,
                                        absl::Status* stream_error) {
  const bool write = h.type == kWriteReq;
  Job answer;
  answer.header.type = write ? kWriteAck : kReadResp;
  answer.header.id = h.id;
  IpcRef ipc;
  const bool via_ipc = (h.flags & kViaIpc) != 0;
  if (via_ipc) {
    *stream_error = ReadStream(*link.in, &ipc, sizeof ipc);
    if (!stream_error->ok()) return answer;
  }
  absl::Status refused;
  // Every request, zero-length ones too, names a key this end gave out and
  // a range inside its region.
  {
    char* target = nullptr;
    int device = -1;
    // No lock is held while the bytes cross the network: the region stays
    // registered through `use` (UnregisterMemory waits for it).
    absl::StatusOr<RegionUse> use = UseRemote(h, write, link.fd.get(), &target, &device);
    refused = use.status();
    if (h.length == 0) {
      // Nothing to move.
    } else if (refused.ok() && via_ipc) {
      absl::StatusOr<char*> theirs =
          ImportIpc(link, ipc, (h.flags & kViaVmm) != 0, h.length, device);
      if (theirs.status().code() == absl::StatusCode::kInvalidArgument) {
        refused = theirs.status();  // a bad request: refused like one out of bounds
      } else if (!theirs.ok()) {
        // Not served here: the requester sends it again, staged.
        answer.header.flags = kViaIpc;
        answer.header.status = static_cast<uint8_t>(absl::StatusCode::kUnimplemented);
        answer.text = std::string(theirs.status().message().substr(0, kMaxErrorText));
        return answer;
      } else {
        // Device to device on the GPUs (NVLink or PCIe); the CPU copies nothing.
        refused = cuda::Driver::Get()->Copy(write ? target : *theirs, write ? *theirs : target,
                                            h.length, device >= 0 ? device : 0);
      }
    } else if (refused.ok() && write) {
      // Straight into a host region: no intermediate buffer.
      *stream_error = device >= 0 ? link.recv_stage.Recv(*link.in, target, h.length, device)
                                  : ReadStream(*link.in, target, h.length);
    }
  }
  if (!refused.ok()) {
    ++refused_requests_;
    if (write && !via_ipc) *stream_error = link.in->Skip(h.length);
    answer.header.status = static_cast<uint8_t>(refused.code());
    answer.text = std::string(refused.message().substr(0, kMaxErrorText));
    answer.close_after = true;  // like an RC responder entering the error state
    return answer;
  }
  if (!write && via_ipc) {
    answer.header.flags = kViaIpc;  // copied already: no bytes follow
    answer.header.length = h.length;
  } else if (!write) {
    answer.read_answer = true;
    answer.header.remote_addr = h.remote_addr;
    answer.header.rkey = h.rkey;
    answer.header.length = h.length;
  }
  return answer;
}

void TcpTransport::CloseImport(const Link::Import& imp) {
  if (imp.vmm.base != nullptr) {
    UnmapVmm(imp.vmm);
  } else {
    cuda::Driver::Get()->IpcClose(imp.mapped, imp.ordinal);
  }
}

absl::StatusOr<char*> TcpTransport::ImportIpc(Link& link, const IpcRef& ref, bool vmm,
                                              uint64_t length, int device) {
  std::string key(ref.handle.reserved, vmm ? sizeof(uint64_t) : sizeof ref.handle.reserved);
  if (vmm) key.insert(0, "vmm:");
  auto it = link.ipc_imports.find(key);
  if (it == link.ipc_imports.end()) {
    // Opened through this end's device when the target is device memory,
    // else through device 0 (any context maps it).
    const int ordinal = device >= 0 ? device : 0;
    Link::Import imp{};
    imp.ordinal = ordinal;
    if (vmm) {
      if (link.peer_vmm == 0) return absl::UnavailableError("the peer has no VMM server");
      uint64_t id;
      std::memcpy(&id, ref.handle.reserved, sizeof id);
      ASSIGN_OR_RETURN(imp.vmm, FetchVmm(link.peer_vmm, id, ordinal));
      imp.mapped = imp.vmm.start;
      imp.size = imp.vmm.length;
    } else {
      ASSIGN_OR_RETURN(imp.mapped, cuda::Driver::Get()->IpcOpen(ref.handle, ordinal, &imp.size));
    }
    if (link.ipc_imports.size() >= std::max<size_t>(options_.max_ipc_imports, 1)) {
      // The least recently used makes room (the reader is the only user).
      auto lru = std::min_element(
          link.ipc_imports.begin(), link.ipc_imports.end(),
          [](const auto& a, const auto& b) { return a.second.used < b.second.used; });
      CloseImport(lru->second);
      link.ipc_imports.erase(lru);
    }
    it = link.ipc_imports.emplace(key, imp).first;
  }
  it->second.used = ++link.imports_used;
  const Link::Import& imp = it->second;
  if (ref.offset > imp.size || length > imp.size - ref.offset) {
    return absl::InvalidArgumentError(absl::StrCat("IPC reference [", ref.offset, ", +", length,
                                                   ") outside its allocation of ", imp.size,
                                                   " bytes"));
  }
  return static_cast<char*>(imp.mapped) + ref.offset;
}

absl::Status TcpTransport::OnAnswer(Link& link, const DataHeader& h) {
  if (h.type == kWriteAck && h.status == 0) {
    // A run of WRITEs, all landed.
    if (h.remote_addr == 0 || h.remote_addr > options_.max_outstanding_per_link) {
      return absl::DataLossError(absl::StrCat("WRITE ack for ", h.remote_addr, " requests"));
    }
    MutexLock lock(&mu_);
    for (uint64_t id = h.id; id < h.id + h.remote_addr; ++id) {
      const WorkRequest* wr = link.outstanding.Find(id);
      if (wr == nullptr) {
        if (link.stopping) break;  // closed or failed here meanwhile
        return absl::DataLossError(absl::StrCat("answer for unknown request ", id));
      }
      CompleteLocked(*wr, absl::OkStatus());
      link.outstanding.Erase(id);
    }
    WakeWaiters();
    return absl::OkStatus();
  }
  WorkRequest wr;
  {
    MutexLock lock(&mu_);
    const WorkRequest* found = link.outstanding.Find(h.id);
    if (found == nullptr) {
      return absl::DataLossError(absl::StrCat("answer for unknown request ", h.id));
    }
    wr = *found;
  }
  if (h.status != 0) {
    std::string text(std::min(h.text_len, kMaxErrorText), '\0');
    RETURN_IF_ERROR(ReadStream(*link.in, text.data(), text.size()));
    MutexLock lock(&mu_);
    if ((h.flags & kViaIpc) != 0) return ResendStaged(link, wr, h.id, text);
    FailLink(link, absl::Status(static_cast<absl::StatusCode>(h.status), text), h.id);
    return absl::OkStatus();
  }
  if (h.length != wr.length) {
    return absl::DataLossError("READ answer of the wrong length");
  }
  if ((h.flags & kViaIpc) != 0) {  // the peer copied into our device memory
    MutexLock lock(&mu_);
    if (link.outstanding.Erase(h.id)) {
      CompleteLocked(wr, absl::OkStatus());
      WakeWaiters();
    }
    return absl::OkStatus();
  }
  // Straight into the caller's buffer, which stays registered until
  // completion; device memory through the staging buffer.
  // (Without a CUDA driver no region is device memory: no lookup.)
  int device = -1;
  if (cuda::Driver::Get() != nullptr) {
    ReaderMutexLock lock(&regions_mu_);
    auto it = regions_.find(wr.local_region);
    if (it != regions_.end()) device = it->second->device;
  }
  RETURN_IF_ERROR(device >= 0 ? link.recv_stage.Recv(*link.in, wr.local_addr, h.length, device)
                              : ReadStream(*link.in, wr.local_addr, h.length));
  MutexLock lock(&mu_);
  if (link.outstanding.Erase(h.id)) {
    CompleteLocked(wr, absl::OkStatus());
    WakeWaiters();
  }
  return absl::OkStatus();
}

absl::Status TcpTransport::ResendStaged(Link& link, const WorkRequest& wr, uint64_t id,
                                        const std::string& why) {
  if (link.ipc_ok) {
    KVF_LOG(WARNING) << "tcp: link " << link.id << ": the peer cannot open this process's CUDA "
                     << "IPC handles (" << why << "); device memory goes staged over the socket";
  }
  link.ipc_ok = false;
  if (link.stopping) return absl::OkStatus();
  Job job;
  job.header.type = wr.opcode == Opcode::kWrite ? kWriteReq : kReadReq;
  job.header.flags = kAckNow;
  job.header.id = id;
  job.header.remote_addr = wr.remote_addr;
  job.header.rkey = wr.remote_key;
  job.header.length = wr.length;
  if (wr.opcode == Opcode::kWrite) {
    job.data = wr.local_addr;
    ReaderMutexLock regions(&regions_mu_);
    auto it = regions_.find(wr.local_region);
    job.device = it == regions_.end() ? -1 : it->second->device;
  }
  if (link.jobs.empty()) link.jobs_from = 0;
  link.jobs.push_back(std::move(job));
  link.cv.SignalAll();
  return absl::OkStatus();
}

absl::Status TcpTransport::QueueAnswer(Link& link, Job job) {
  // Not sent from the reader's thread: the reader is the responder's busy
  // thread, and answering from it measured slower than handing off.
  MutexLock lock(&mu_);
  if (link.stopping) return absl::CancelledError("the link is closing");
  // A peer keeps at most its max_outstanding_per_link requests unanswered,
  // so a legitimate one never has more answers waiting here than that
  // (plus what the writer is sending). One that sends on without reading
  // its answers would grow this queue without bound: it loses the link.
  if (++link.queued_answers > kAnswerQueueFactor * options_.max_outstanding_per_link) {
    ++dropped_readers_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "the peer sent more than ", kAnswerQueueFactor * options_.max_outstanding_per_link,
        " requests without reading their answers"));
  }
  if (link.jobs.empty()) link.jobs_from = 0;  // not a Post's
  link.jobs.push_back(std::move(job));
  link.cv.SignalAll();
  return absl::OkStatus();
}

absl::Status TcpTransport::FlushRun(Link& link, AckRun& run) {
  if (run.job.header.remote_addr == 0) return absl::OkStatus();
  run.bytes = 0;
  return QueueAnswer(link, std::exchange(run.job, Job{}));
}

absl::Status TcpTransport::Serve(Link& link, const DataHeader& h, AckRun& run, bool* refusing) {
  if (*refusing) {
    // After refusing a request the link closes once that answer is out
    // (like an RC responder in the error state): requests behind it are
    // read off the stream and never executed, so none of them lands after
    // the requester saw it flushed.
    if ((h.flags & kViaIpc) != 0) {
      IpcRef skipped;
      return ReadStream(*link.in, &skipped, sizeof skipped);
    }
    return h.type == kWriteReq ? link.in->Skip(h.length) : absl::OkStatus();
  }
  absl::Status stream;
  Job answer = Execute(link, h, &stream);
  RETURN_IF_ERROR(stream);
  *refusing = answer.close_after;
  if (h.type != kWriteReq || answer.header.status != 0) {
    RETURN_IF_ERROR(FlushRun(link, run));
    return QueueAnswer(link, std::move(answer));
  }
  // Acknowledged in runs up to the end of the requester's Post: one answer
  // (and one wake-up at the requester) for many WRITEs.
  if (run.job.header.remote_addr == 0) {
    run.job.header.type = kWriteAck;
    run.job.header.id = h.id;
  }
  ++run.job.header.remote_addr;
  run.bytes += h.length;
  const bool more = run.job.header.remote_addr < kMaxAckRun && run.bytes < kMaxAckRunBytes &&
                    (h.flags & kAckNow) == 0;
  return more ? absl::OkStatus() : FlushRun(link, run);
}

void TcpTransport::ReaderLoop(std::shared_ptr<Link> link) {
  link->in = std::make_unique<StreamReader>(link->fd.get());
  absl::Status error;
  AckRun run;
  bool refusing = false;
  while (error.ok()) {
    DataHeader h;
    error = ReadStream(*link->in, &h, sizeof h);
    if (!error.ok()) break;
    // Reading ahead pays while payloads are small; a large one would be
    // copied out of the buffer: then only the next header is read ahead.
    const bool payload = (h.type == kWriteReq || h.type == kReadResp) && (h.flags & kViaIpc) == 0;
    link->in->ReadAhead(payload && h.length >= StreamReader::kDirect ? sizeof h
                                                                     : StreamReader::kCapacity);
    if (h.type == kWriteReq || h.type == kReadReq) {
      error = Serve(*link, h, run, &refusing);
    } else if (h.type == kWriteAck || h.type == kReadResp) {
      error = OnAnswer(*link, h);
    } else {
      error = absl::DataLossError(absl::StrCat("unknown message type ", h.type));
    }
  }
  for (const auto& [handle, imp] : link->ipc_imports) CloseImport(imp);
  link->ipc_imports.clear();
  MutexLock lock(&mu_);
  link->reader_done = true;
  // Closed here (CloseLink, destruction) or already failed: nothing to do.
  if (link->stopping) return;
  FailLink(*link,
           absl::UnavailableError(absl::StrCat("connection to peer lost on link ",
                                               link->id, ": ", error.message())),
           link->outstanding.empty() ? 0 : link->outstanding.first());
}

size_t TcpTransport::PollCompletions(absl::Span<Completion> out) {
  MutexLock lock(&mu_);
  ReaderMutexLock regions(&regions_mu_);
  return cq_.Pop(out, [this](RegionId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto region = regions_.find(id);
    if (region != regions_.end()) region->second->local_uses.fetch_sub(1);
  });
}

size_t TcpTransport::WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) {
  {
    MutexLock lock(&mu_);
    cq_cv_.AwaitWithDeadline(&mu_, FastNow() + timeout, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return !cq_.empty() || interrupted_;
    });
    interrupted_ = false;
  }
  return PollCompletions(out);
}

void TcpTransport::InterruptWait() {
  MutexLock lock(&mu_);
  interrupted_ = true;
  cq_cv_.SignalAll();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(TcpTransportOptions options) {
  if (options.max_outstanding_per_link == 0 || options.max_request_bytes == 0 ||
      options.max_region_bytes == 0) {
    return absl::InvalidArgumentError("TCP transport limits must be positive");
  }
  auto t = std::make_unique<TcpTransport>(std::move(options));
  RETURN_IF_ERROR(t->Start());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace transport
}  // namespace kvferry
