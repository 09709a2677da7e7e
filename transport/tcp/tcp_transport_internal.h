// The TCP transport's class, shared by the files that implement it:
//   tcp_transport.cc     lifecycle, regions, links, completions;
//   tcp_requester.cc     posting requests (the socket, inline from the
//                        posting thread, or copied in-process) and their
//                        answers;
//   tcp_responder.cc     executing a peer's requests and queueing answers;
//   tcp_link_threads.cc  each link's writer and reader threads;
//   tcp_io.{h,cc}        socket I/O and the device-memory staging buffers.
// Internal to transport/tcp: users include tcp_transport.h.
#ifndef KVFERRY_TRANSPORT_TCP_TCP_TRANSPORT_INTERNAL_H_
#define KVFERRY_TRANSPORT_TCP_TCP_TRANSPORT_INTERNAL_H_

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
#include "base/status_macros.h"
#include "base/thread_cache.h"
#include "cuda/driver.h"
#include "transport/checks.h"
#include "transport/completion_queue.h"
#include "transport/host_share.h"
#include "transport/id_window.h"
#include "transport/link_params.h"
#include "transport/stream_links.h"
#include "transport/tcp/hello_acceptor.h"
#include "transport/tcp/ref_carrier.h"
#include "transport/tcp/region_table.h"
#include "transport/tcp/shortcut.h"
#include "transport/tcp/stream_reader.h"
#include "transport/tcp/tcp_io.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

using tcp_wire::DataHeader;
using tcp_wire::DecodeLinkParams;
using tcp_wire::EncodeLinkParams;
using tcp_wire::kAckNow;
using tcp_wire::kReadReq;
using tcp_wire::kReadResp;
using tcp_wire::kRefSecondKind;
using tcp_wire::kViaRef;
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

// The CPUs this process may run on (its affinity mask: taskset, cpusets).
uint32_t UsableCpus();

constexpr uint64_t kPreferredRequestBytes = 1 << 20;

class TcpTransport final : public Transport, public StreamLinks {
 public:
  explicit TcpTransport(TcpTransportOptions options)
      : options_(std::move(options)),
        refs_(options_.host_share, options_.same_host_only, options_.kind) {}
  ~TcpTransport() override;

  absl::Status Start();

  EndpointDescription LocalEndpoint() const override;
  Limits GetLimits() const override {
    // Each request costs a header, its share of a system call, an answer and
    // a completion, so large requests are preferred; each link keeps two
    // threads busy at each end, so a host with few CPUs gets one link. The
    // measurements behind both: docs/performance.md, "TCP request size and
    // links".
    return Limits{options_.max_outstanding_per_link,
                  options_.max_request_bytes,
                  options_.max_region_bytes,
                  std::min<uint64_t>(kPreferredRequestBytes, options_.max_request_bytes),
                  UsableCpus() < 4 ? 1u : 2u,
                  /*accept_waits=*/false};
  }
  absl::StatusOr<Region> RegisterMemory(void* addr, uint64_t length, Access access) override;
  absl::Status UnregisterMemory(RegionId region) override;
  absl::StatusOr<LinkOffer> OfferLink(NicIndex local_nic) override;
  absl::Status ConnectOffered(LinkId link, const NicInfo& peer_nic) override;
  absl::Status AdoptConnection(LinkId link, net::Fd connection) override;
  absl::StatusOr<LinkOffer> CreateLink(NicIndex local_nic, const NicInfo& peer_nic) override;
  absl::StatusOr<LinkOffer> AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                       absl::string_view peer_params) override;
  absl::Status CompleteLink(LinkId link, absl::string_view peer_params) override;
  absl::Status CloseLink(LinkId link) override;
  bool HasLink(LinkId link) override;
  uint64_t InputCount(LinkId link) override;
  absl::Status Post(absl::Span<const WorkRequest> batch) override;
  size_t PollCompletions(absl::Span<Completion> out) override;
  size_t WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) override;
  void InterruptWait() override;
  void* QueryExtension(absl::string_view name) override {
    return name == StreamLinks::kName ? static_cast<StreamLinks*>(this) : nullptr;
  }
  std::vector<std::pair<std::string, uint64_t>> RefusedInput() const override {
    const HelloAcceptorStats s = acceptor_->stats();
    return {{"data_connection_bad_hello", s.bad_hellos},
            {"data_connection_duplicate_token", s.duplicate_tokens},
            {"data_connection_evicted", s.evicted},
            {"data_connection_expired", s.expired},
            {"data_connection_never_came", s.claims_expired},
            {"data_claim_evicted", s.claims_evicted},
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
  using RegionEntry = RegionTable::Entry;
  using RegionUse = RegionTable::Use;
  // Something for a link's writer to send.
  struct Job {
    DataHeader header;
    const void* data = nullptr;  // request data (WRITE) from a pinned local buffer
    std::string text;            // error text of a refused request
    bool read_answer = false;    // send region bytes, re-checked under the lock
    bool close_after = false;    // the responder refused: close the connection
    int device = -1;             // data lies on this CUDA device: sent through a staging buffer
    bool by_ref = false;         // header.flags has kViaRef: `ref` follows the header
    ShareRef ref;
  };
  struct Link {
    using State = LinkState;  // transport/checks.h
    LinkId id = 0;
    std::atomic<uint64_t> inputs{0};  // messages read from the peer (the reader counts)
    // The peer's in-process key when it lives in this process (shortcut).
    uint64_t peer_key = 0;
    // This end's gate (with the shortcut on), and the peer end's, through
    // which this end's shortcut copies go (null: the peer's link was gone
    // when this one was made, so its requests go over the socket).
    std::shared_ptr<DirectGate> gate;
    std::shared_ptr<DirectGate> peer_gate;
    uint32_t direct_busy = 0;   // shortcut copies running on this link
    uint32_t idle_waiters = 0;  // threads in WaitLinkIdle
    net::Fd fd;
    State state = State::kPending;
    uint64_t token = 0;
    IdWindow<WorkRequest> outstanding;  // by request id, handed out in sequence
    std::vector<Job> jobs;              // the writer takes them all at once
    uint64_t jobs_from = 0;             // the Post whose jobs started `jobs`
    // Sent by the posting thread while the writer was idle (writer_busy is
    // set meanwhile). What the socket
    // did not take at once (inline_rest) the writer sends first, from byte
    // inline_sent on.
    std::vector<Job> inline_jobs;
    size_t inline_sent = 0;
    bool inline_rest = false;
    bool stopping = false;
    bool writer_busy = false;
    bool passive = false;  // made by AcceptLink
    // A passive link's connection is being attached (Attach): its fd and
    // threads are set outside the lock, and StopAndJoin waits for that.
    bool attaching = false;
    bool reader_done = false;     // the reader thread has returned
    uint32_t queued_answers = 0;  // answers in `jobs` (reader and writer, under mu_)
    CondVar cv;                   // jobs arrived / stopping / writer idle
    ThreadCache::Task reader;
    ThreadCache::Task writer;
    // Pinned host buffers for device memory, made on first use: the
    // writer's (sending) and the reader's (receiving), each used by its own
    // thread only.
    Staging send_stage;
    Staging recv_stage;
    // What the reader thread receives comes through here (made with fd).
    std::unique_ptr<StreamReader> in;
    // Same-host sharing (ref_carrier.h); its imports are closed when the
    // reader ends.
    LinkShare share;
  };

  // An offered link's connection, once connected (ConnectOffered,
  // AdoptConnection).
  absl::Status Install(LinkId id, net::Fd fd);

  // A request on a link whose peer is in this process (shortcut.h).
  struct Direct {
    Direct(std::shared_ptr<Link> on, uint64_t id, const WorkRequest& wr, int local_device)
        : link(std::move(on)), rid(id) {
      copy.link = link.get();
      copy.gate = link->peer_gate.get();
      copy.peer_key = link->peer_key;
      copy.wr = wr;
      copy.local_device = local_device;
    }
    std::shared_ptr<Link> link;
    uint64_t rid = 0;
    Shortcuts::Copy copy;
  };
  absl::Status PostLocked(absl::Span<const WorkRequest> batch, std::vector<Direct>& direct,
                          std::vector<std::shared_ptr<Link>>& inline_links);
  // If `link` is idle (writer not busy, nothing queued before `post`),
  // claims it for the calling thread: its jobs move to inline_jobs.
  bool ClaimInline(Link& link, uint64_t post) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends a claimed link's inline_jobs without blocking; a rest goes to
  // the writer. Clears writer_busy.
  void SendInline(Link& link);
  // Copies the bytes of each request (Shortcuts::CopyAll) and completes
  // it, taking each lock once for the lot.
  void RunDirect(std::vector<Direct>& direct);
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
  // Gives passive `link` its connection and starts its threads; when the
  // connection never came (`fd` an error) or the link was closed meanwhile,
  // the link ends (reaped by the next AcceptLink). AcceptLink calls it, or
  // the hello acceptor's thread once the connection arrives.
  absl::Status Attach(const std::shared_ptr<Link>& link, absl::StatusOr<net::Fd> fd);
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
  absl::Status QueueAnswerLocked(Link& link, Job job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FlushRun(Link& link, AckRun& run);
  void WriterLoop(std::shared_ptr<Link> link);
  // Sends `jobs` with one sendmsg. Sets *close_after when the connection
  // must be closed after them (a refused request).
  // `skip`: bytes of them already sent.
  absl::Status SendJobs(Link& link, absl::Span<Job> jobs, bool* close_after, size_t skip = 0);
  // Responder side: executes a peer's request; returns the answer to send.
  Job Execute(Link& link, const DataHeader& h, absl::Status* stream_error);
  // A request whose bytes are in the requester's memory (kViaRef), copied
  // by the host share into or out of `target` (on `device`): OK when
  // copied, the error that refuses it, or OK with *unserved when this end
  // cannot open the reference (`answer` then asks for the bytes).
  absl::Status ServeByReference(Link& link, const DataHeader& h, const ShareRef& ref, char* target,
                                int device, Job* answer, bool* unserved);
  // The peer could not serve request `id` by reference: send it again with
  // its bytes, and no more references on this link.
  absl::Status ResendStaged(Link& link, const WorkRequest& wr, uint64_t id, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Requester side: an answer to one of our requests.
  absl::Status OnAnswer(Link& link, const DataHeader& h);
  absl::Status OnWriteAcks(Link& link, const DataHeader& h);  // a run of landed WRITEs
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
      ABSL_SHARED_LOCKS_REQUIRED(regions_.mu());

  const TcpTransportOptions options_;
  const RefCarrier refs_;  // references of options_.host_share
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

  RegionTable regions_;  // its own lock, taken after mu_ where both are held

  Mutex mu_;
  CondVar cq_cv_;
  bool interrupted_ ABSL_GUARDED_BY(mu_) = false;  // see InterruptWait
  LinkId last_link_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_post_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<LinkId, std::shared_ptr<Link>> links_ ABSL_GUARDED_BY(mu_);
  CompletionQueue cq_ ABSL_GUARDED_BY(mu_);
  std::function<void()> notify_ ABSL_GUARDED_BY(mu_);  // SetCompletionNotifier
};

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_TCP_TRANSPORT_INTERNAL_H_
